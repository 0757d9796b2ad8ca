"""The policy's launch fields (grid_ctas, raster_band) on the CPU: validation, the per-call check
(mok_cute.layers.launch) and what reaches the SM90 and SM100 launches. Bitwise invariance on a GPU:
tools/checks/policy.py."""
from __future__ import annotations

import pytest
import torch

from mok_cute import KernelPolicy, MoKConfig
from mok_cute.kernels.operands import RoutePlan
from mok_cute.layers import launch


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(grid_ctas=1), ValueError, "grid_ctas must be an integer >= 2, got 1"),
    (dict(grid_ctas=64.0), TypeError, "grid_ctas must be an int"),
    (dict(raster_band=0), ValueError, "raster_band must be an integer >= 1, got 0"),
    (dict(raster_band=False), TypeError, "raster_band must be an int, got bool"),
])
def test_policy_rejects(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        KernelPolicy(**kw)


def _cfg(**kw):
    return MoKConfig(policy=KernelPolicy(**kw))


IDX = torch.zeros(1000, 8, dtype=torch.int32)  # k = 8: a 1024-token ring holds 64 slots of 128 rows


def test_check_accepts_and_names_the_range():
    launch.check(MoKConfig(), IDX, 1, 132)
    launch.check(_cfg(grid_ctas=29, raster_band=64), IDX, 1, 132)  # 28 backward comm CTAs + 1
    launch.check(_cfg(grid_ctas=132), IDX, 2, 132)
    with pytest.raises(ValueError, match=r"grid_ctas = 28 must be in \[29, 132\].*comm_sms_bwd 28"):
        launch.check(_cfg(grid_ctas=28), IDX, 1, 132)
    with pytest.raises(ValueError, match=r"grid_ctas = 40 must be in \[41, 132\].*comm_sms_fwd 40"):
        launch.check(_cfg(grid_ctas=40, comm_sms_bwd=2), IDX, 2, 132)
    with pytest.raises(ValueError, match=r"grid_ctas = 133 must be in \[29, 132\].*the device's 132 SMs"):
        launch.check(_cfg(grid_ctas=133), IDX, 1, 132)
    with pytest.raises(ValueError, match=r"raster_band = 65 must be at most the ring's 64 slots"):
        launch.check(_cfg(raster_band=65), IDX, 1, 132)
    launch.check(_cfg(raster_band=16, minibatch_tokens=256), IDX, 1, 132)  # 256 * 8 / 128 = 16 slots
    with pytest.raises(ValueError, match="raster_band = 17 must be at most the ring's 16 slots"):
        launch.check(_cfg(raster_band=17, minibatch_tokens=256), IDX, 1, 132)


def test_grid_and_band():
    assert launch.grid(None) is None and launch.grid(MoKConfig()) is None and launch.grid(MoKConfig(), 66) == 66
    assert launch.grid(_cfg(grid_ctas=64)) == 64 and launch.grid(_cfg(grid_ctas=64), 66) == 64
    with pytest.raises(ValueError, match=r"grid_ctas = 100 exceeds this rank's share of the GPU's SMs \(66"):
        launch.grid(_cfg(grid_ctas=100), 66)
    assert launch.band(None) is None and launch.band(_cfg(raster_band=4)) == 4


def test_sm90_launches_take_them(monkeypatch):
    from mok_cute.kernels.sm90 import fused_bwd, fused_moe
    from mok_cute.layers import sm90

    cfg = _cfg(grid_ctas=100, raster_band=4)
    core = sm90._core_launch(fused_bwd.BackwardLaunch, sm90.ExpertGroup(None, None, None, None), cfg)
    assert core.num_ctas == 100
    seen = {}

    def fake_forward(x, plan, experts, shared, limit, launch_, ws=None, biases=None):
        seen["launch"] = launch_
        raise StopIteration

    mlp = sm90.Sm90ExpertMLP()
    monkeypatch.setattr(fused_moe, "fused_forward", fake_forward)
    monkeypatch.setattr(mlp, "_fused_operands", lambda *a: ((None,) * 5, False))
    with pytest.raises(StopIteration):
        mlp.fused_forward(None, RoutePlan(None, None, IDX, None), (None,) * 3, None, None, cfg)
    assert (seen["launch"].num_ctas, seen["launch"].band, seen["launch"].ring_chunks) == (100, 4, 64)
    with pytest.raises(StopIteration):
        mlp.fused_forward(None, RoutePlan(None, None, IDX, None), (None,) * 3, None, None, MoKConfig())
    assert (seen["launch"].num_ctas, seen["launch"].band) == (None, None)


def test_sm100_launch_takes_them():
    from mok_cute.layers import sm100

    got = sm100.fused_launch(_cfg(grid_ctas=100, raster_band=4), False, 16, 30.0, gemm="fused_forward")
    assert (got.num_ctas, got.band) == (100, 4)
    got = sm100.fused_launch(MoKConfig(), False, 16, 30.0, num_ctas=66, gemm="fused_forward")
    assert (got.num_ctas, got.band) == (66, None)

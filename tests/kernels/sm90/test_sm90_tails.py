"""H, I, I_s multiples of 64 but not of the 256-wide output tile on SM90 (issue 14, item 1): the
``n_tail`` variants of every GEMM epilogue and of both megakernels compile for sm_90a with 0
spills and unserialized wgmma, mask exactly where the aligned variants do not, and are picked
by the host only for such shapes (the aligned variants compile as before). The kernels run
at those dimensions in tools/checks/tails.py."""
import functools
import re

import pytest


def _clean(rep):
    assert re.findall(r"(\d+) bytes spill stores", rep.log) and set(re.findall(r"(\d+) bytes spill stores",
                                                                              rep.log)) == {"0"}, rep.log[-800:]
    assert "serialized" not in rep.log, rep.log[:600]


@functools.cache
def _gemm(epilogue: str, n_tail: bool, mx_h: bool = False, helpers: bool = False):
    from mok_cute.kernels.sm90 import grouped_gemm as gg
    from mok_cute.kernels.sm90.mainloop import MN_MAJOR

    major = MN_MAJOR if epilogue == "dswiglu" else "k"
    return gg.compile_grouped_gemm(epilogue, clamp=True, b_major=major, mx_h=mx_h, n_tail=n_tail, helpers=helpers,
                                   inspect=True)[1]


@pytest.mark.parametrize("epilogue, mx_h, helpers", [("plain", False, False), ("swiglu", False, False),
                                                     ("swiglu", True, False), ("swiglu", False, True),
                                                     ("dswiglu", False, False)])
def test_gemm_tail_variants(epilogue, mx_h, helpers):
    """The tail variant compiles clean and differs from the aligned one: dswiglu masks its stores, swiglu
    counts its n-tiles up to I's and masks h's per-thread stores (the MXFP8 copy, the helpers' h)."""
    rep = _gemm(epilogue, True, mx_h, helpers)
    _clean(rep)
    assert rep.ptx != _gemm(epilogue, False, mx_h, helpers).ptx


def test_plain_tma_store_needs_no_mask():
    """TMA stores clip N in the unit: the TMA-store plain epilogue's tail variant stores exactly as
    the aligned one (only its tile count rounds up)."""
    tail, aligned = _gemm("plain", True), _gemm("plain", False)
    _clean(tail)
    assert aligned.ptx.count("cp.async.bulk.tensor.4d.global.shared") > 0  # the row-bounded TMA store
    for op in ("st.global", "cp.async.bulk.tensor.4d.global.shared"):
        assert tail.ptx.count(op) == aligned.ptx.count(op), op


def test_wgrad_tail_variant():
    from mok_cute.kernels.sm90 import expert_bwd

    reps = [expert_bwd.compile_grouped_wgrad(n_tail=t, inspect=True)[1] for t in (False, True)]
    _clean(reps[1])
    assert reps[0].ptx != reps[1].ptx


@pytest.mark.parametrize("mx", [False, True])
def test_fused_forward_tail_variant(mx):
    from mok_cute.kernels.sm90 import fused_moe

    reps = [fused_moe.compile_fused_forward(True, True, mx=mx, n_tail=t, inspect=True)[1] for t in (False, True)]
    _clean(reps[1])
    assert reps[0].ptx != reps[1].ptx


@pytest.mark.parametrize("kw", [dict(scatter=True, init=True), dict(scatter=True, init=True, gather=True,
                                                                    shared=True, accumulate=True),
                                dict(mx=True, scatter=True)])
def test_fused_backward_tail_variant(kw):
    from mok_cute.kernels.sm90 import fused_bwd

    reps = [fused_bwd.compile_fused_backward_core(fused_bwd.BwdVariant(True, n_tail=t, **kw), inspect=True)[1]
            for t in (False, True)]
    _clean(reps[1])
    assert reps[0].ptx != reps[1].ptx


def test_host_picks_the_tail_variant_only_for_tails(monkeypatch):
    """The compile keys of the standalone GEMM launch: n_tail exactly when N % tile_n != 0."""
    import torch

    from mok_cute.kernels.sm90 import grouped_gemm as gg

    keys = []

    class Stop(Exception):
        pass

    def fake_cached(key, build):
        keys.append(key)
        raise Stop

    monkeypatch.setattr(gg, "compile_cached", fake_cached)
    monkeypatch.setattr(gg, "device_arch", lambda dev: (0, "sm_90a"))
    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    offs = torch.tensor([0, 4], dtype=torch.int32)
    for n in (256, 512, 320, 192):
        with pytest.raises(Stop):
            gg._launch("plain", gg.DEFAULT_CONFIG, a, torch.zeros(1, n, 64, dtype=torch.bfloat16), offs,
                       gg.GemmOutputs(None, None), n)
    assert [k[7] for k in keys] == [False, False, True, True]

"""The gpt-oss activation rows of the SM90 device checks (tools/checks/layer_sm90.py, fused_fwd.py,
fused_bwd.py) on the CPU: the checks are registered with ``python -m tools.gpu_check``, each holds
``SwiGLU.gpt_oss()`` cases, the layer rows' path pairs are the paths the SM90 layer decides for them
(the path table), their inputs build on the CPU, pass the SM90 backend's check (its kernels run the
activation: no refusal) and run on the reference backend (what the device check compares with), and
the backward core's clamped gpt-oss case has clamps acting."""
from __future__ import annotations

import pytest
import torch

from mok_cute import MoKConfig, SwiGLU
from mok_cute.layers import paths
from mok_cute.layers.select import MoEInputs, get_backend
from mok_cute.policy import BackwardPath, ForwardPath
from tools.checks import fused_bwd, fused_fwd, layer_sm90
from tools.gpu_check import check_names

CPU = torch.device("cpu")


def test_registered_with_gpt_oss_cases():
    assert {"layer_sm90", "fused_fwd", "fused_bwd"} <= set(check_names())
    gpt_oss = SwiGLU.gpt_oss()
    assert [c[0] for c in fused_fwd.CASES if c[3] == gpt_oss] == ["skew+shared gpt-oss"]
    assert [c[0] for c in fused_fwd.MX_CASES if c[3] == gpt_oss] == ["skew+shared gpt-oss"]
    assert [c[0] for c in fused_fwd.HELPER_CASES if c[4] == gpt_oss] == ["H2048 skew+shared gpt-oss"]
    acts = [a for _, _, a in fused_bwd.CORE_CASES if isinstance(a, SwiGLU)]
    assert gpt_oss in acts and all((a.alpha, a.up_offset) == (1.702, 1.0) for a in acts)
    assert gpt_oss in dict(fused_bwd.LAYER_ACTS).values()


@pytest.mark.parametrize("name, fwd, bwd, biased", layer_sm90.GPT_OSS_CASES)
def test_layer_rows_run_the_paths_they_name(name, fwd, bwd, biased):
    cfg = MoKConfig(backend="sm90", forward_path=fwd, backward_path=bwd)
    p = paths.decide(cfg, "sm90", paths.Call("bf16", ep=1, shared=True, biases=biased))
    assert (p.forward, p.backward) == (ForwardPath(fwd), BackwardPath(bwd)), name


def test_layer_inputs_build_on_cpu_pass_the_sm90_check_and_run_on_the_reference():
    act, (x, idx, w, ws, sh, dy), biases = layer_sm90.gpt_oss_problem(CPU)
    s = layer_sm90.GPT_OSS_SHAPE
    assert act == SwiGLU.gpt_oss() and x.shape == (s["t"], s["h"]) and idx.shape == (s["t"], s["k"])
    assert ws[0].shape == (s["e"], s["inter"], s["h"]) and sh is not None and (idx == -1).any()
    assert [b.shape for b in biases] == [(s["e"], s["inter"]), (s["e"], s["inter"]), (s["e"], s["h"])]
    for _, fwd, bwd, biased in layer_sm90.GPT_OSS_CASES:
        cfg = MoKConfig(backend="sm90", forward_path=fwd, backward_path=bwd)
        get_backend("sm90").check(MoEInputs(x, idx, w, *ws, sh, act,
                                            biases=biases if biased else None), cfg, None)
    outs = layer_sm90._run("reference", x, idx, w, ws, sh, dy, act)
    assert len(outs) == 9 and all(bool(torch.isfinite(o.float()).all()) for o in outs)
    with_b = layer_sm90._run("reference", x, idx, w, ws, sh, dy, act, biases=biases)
    assert len(with_b) == 12 and not torch.equal(with_b[0], outs[0])  # the biases reach y and their gradients
    plain = layer_sm90._run("reference", x, idx, w, ws, sh, dy, act.limit)
    assert not torch.equal(outs[0], plain[0])  # the activation's alpha and up offset matter at this shape


def test_core_case_with_a_low_limit_clamps():
    """``one expert gpt-oss`` (limit 1.5) draws g, u ~ N(0, 1): a good share of them clamp, so the check meets
    the clamped elements' zero gradients; at gpt-oss's limit 7 none do."""
    cases = {name: (counts, act) for name, counts, act in fused_bwd.CORE_CASES}
    for name, want in (("one expert gpt-oss", (0.05, 1.0)), ("skewed gpt-oss", (0.0, 0.0))):
        counts, act = cases[name]
        _, _, gu, _, offsets, *_ = fused_bwd._operands(counts, 1024, 512, CPU, seed=len(name))
        g, u = gu[:int(offsets[-1])].float().chunk(2, dim=1)
        share = float(((g > act.limit) | (u.abs() > act.limit)).float().mean())
        assert want[0] <= share <= want[1], (name, share)

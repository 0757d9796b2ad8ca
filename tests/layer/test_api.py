"""Public API: config validation, bad inputs (one test per case), backend selection, the
autograd path and MoELayer."""
from __future__ import annotations

import pytest
import torch

from mok_cute import MoELayer, MoKConfig, moe
from mok_cute.layers import select as B
from mok_cute import reference as R
from conftest import make_problem


def call(p, **kw):
    return moe(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"],
               shared=p["shared"], **kw)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("kw,exc,msg", [
    (dict(precision="fp16"), ValueError, "precision"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(minibatch_tokens=1000), ValueError, "minibatch_tokens"),
    (dict(minibatch_tokens=4096.0), TypeError, "minibatch_tokens"),
    (dict(comm_sms_fwd=3), ValueError, "comm_sms_fwd"),
    (dict(comm_sms_bwd=0), ValueError, "comm_sms_bwd"),
    (dict(tile_m=96), ValueError, "tile_m"),
    (dict(tile_n=100), ValueError, "tile_n"),
    (dict(tile_k=16), ValueError, "tile_k"),
    (dict(device_timeout_s=0), ValueError, "device_timeout_s"),
    (dict(device_timeout_s=float("inf")), ValueError, "device_timeout_s"),
    (dict(validate_routing=1), TypeError, "validate_routing"),
])
def test_config_rejects(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        MoKConfig(**kw)


def test_config_defaults():
    c = MoKConfig()
    # the policy's knobs: None (not given), the tuned defaults resolved by kernel_policy
    assert (c.precision, c.minibatch_tokens, c.comm_sms_fwd, c.comm_sms_bwd) == ("bf16", None, None, None)
    assert (c.kernel_policy.ring_tokens(), c.comm_ctas_bwd()) == (1024, 28)
    assert (c.tile_m, c.tile_n, c.tile_k) == (None, None, None)  # each backend's tuned tiles
    assert MoKConfig(tile_n=128).tile_n == 128 == MoKConfig(tile_n=128).kernel_policy.gemm("gemm1").tile_n
    # the forward's comm CTAs: a tuned default per EP size unless given
    assert (c.comm_ctas_fwd(1), c.comm_ctas_fwd(2), c.comm_ctas_fwd(8)) == (16, 40, 40)
    assert (MoKConfig(comm_sms_fwd=6).comm_ctas_fwd(1), MoKConfig(comm_sms_fwd=6).comm_ctas_fwd(4)) == (6, 6)


def test_gpu_backend_checks_tile_overrides():
    """A tile override is never silently ignored: the GPU backends raise ValueError naming the field
    and the allowed values before any kernel where a GEMM of the call cannot run it (SM100: its own tile_n
    only; SM90 takes tile_n 128)."""
    from mok_cute.layers.select import MoEInputs, get_backend

    p, _ = make_problem(T=8, H=256, I=256, E=2, k=2)
    inp = MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    with pytest.raises(ValueError, match=r"'sm100': policy.tiles.tile_n \(MoKConfig.tile_n\) = 128 .*allowed: 256"):
        get_backend("sm100").check(inp, MoKConfig(tile_n=128), None)
    with pytest.raises(ValueError, match=r"'sm90': policy.tiles.tile_n \(MoKConfig.tile_n\) = 64 .*allowed: 256, 128"):
        get_backend("sm90").check(inp, MoKConfig(tile_n=64), None)
    get_backend("sm90").check(inp, MoKConfig(tile_n=128), None)
    for name in ("sm90", "sm100"):
        get_backend(name).check(inp, MoKConfig(), None)


# ---------------------------------------------------------------- bad inputs
def _bad(mutate):
    p, _ = make_problem(T=8, H=128, I=64, E=4, k=2, shared_I=64, seed=3)
    mutate(p)
    return p


BAD = {
    "x_dtype": (lambda p: p.update(x=p["x"].float()), TypeError, "x must have dtype bfloat16"),
    "x_not_tensor": (lambda p: p.update(x=p["x"].tolist()), TypeError, "x must be a torch.Tensor"),
    "x_ndim": (lambda p: p.update(x=p["x"][None]), ValueError, "x must be 2-D"),
    "x_empty": (lambda p: p.update(x=p["x"][:0]), ValueError, "x must not be empty"),
    "idx_dtype": (lambda p: p.update(topk_idx=p["topk_idx"].float()), TypeError, "topk_idx must have dtype int32 or int64"),
    "idx_shape": (lambda p: p.update(topk_idx=p["topk_idx"][:4]), ValueError, r"topk_idx must have shape \[T, k\]"),
    "idx_too_big": (lambda p: p["topk_idx"].__setitem__((0, 0), 4), ValueError, "expert id 4"),
    "idx_below_minus_one": (lambda p: p["topk_idx"].__setitem__((0, 0), -2), ValueError, "expert id -2"),
    "k_gt_E": (lambda p: p.update(topk_idx=torch.zeros(8, 5, dtype=torch.long), topk_w=torch.rand(8, 5)), ValueError, "k <= E"),
    "w_dtype": (lambda p: p.update(topk_w=p["topk_w"].bfloat16()), TypeError, "topk_w must have dtype float32"),
    "w_shape": (lambda p: p.update(topk_w=p["topk_w"][:, :1]), ValueError, r"topk_w must have shape \[T, k\]"),
    "w_gate_dtype": (lambda p: p.update(w_gate=p["w_gate"].float()), TypeError, "w_gate must have dtype bfloat16"),
    "w_up_shape": (lambda p: p.update(w_up=p["w_up"][:, :, :32]), ValueError, r"w_up must have shape \[E_local, I, H\]"),
    "w_down_shape": (lambda p: p.update(w_down=p["w_down"].transpose(1, 2)), ValueError, r"w_down must have shape \[E_local, H, I\]"),
    "w_down_experts": (lambda p: p.update(w_down=p["w_down"][:3]), ValueError, "w_down must have shape"),
    "H_unaligned": (lambda p: p.update(x=p["x"][:, :96], w_gate=p["w_gate"][:, :, :96], w_up=p["w_up"][:, :, :96], w_down=p["w_down"][:, :96], shared=None), ValueError, "hidden size H = 96 must be a multiple of 64"),
    "I_unaligned": (lambda p: p.update(w_gate=p["w_gate"][:, :40], w_up=p["w_up"][:, :40], w_down=p["w_down"][:, :, :40]), ValueError, "intermediate size I = 40 must be a multiple of 64"),
    "shared_not_tuple": (lambda p: p.update(shared=p["shared"][0]), TypeError, "shared must be None or a tuple"),
    "shared_dtype": (lambda p: p.update(shared=(p["shared"][0].float(),) + p["shared"][1:]), TypeError, "ws_gate"),
    "shared_shape": (lambda p: p.update(shared=p["shared"][:2] + (p["shared"][2].t(),)), ValueError, "ws_down"),
    "limit_negative": (lambda p: p.update(limit=-1.0), ValueError, "swiglu_limit must be a positive"),
    "limit_type": (lambda p: p.update(limit="4"), TypeError, "swiglu_limit must be None or a float"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises(case):
    mutate, exc, msg = BAD[case]
    p = _bad(mutate)
    limit = p.pop("limit", None)
    with pytest.raises(exc, match=msg):
        call(p, swiglu_limit=limit, config=MoKConfig(backend="reference"))


def test_bad_config_type():
    p, _ = make_problem(T=4)
    with pytest.raises(TypeError, match="config must be a MoKConfig"):
        call(p, config={"precision": "bf16"})


def test_num_experts_not_divisible_by_ep():
    from mok_cute.validate import check_num_experts

    with pytest.raises(ValueError, match="divisible by the expert-parallel size EP = 4"):
        check_num_experts(6, 4)
    assert check_num_experts(8, 4) == 2


# ---------------------------------------------------------------- backends
def test_backend_auto_on_cpu_is_reference_and_announced_once():
    B._announced.clear()
    with pytest.warns(UserWarning, match="reference backend"):
        assert B.select_backend(torch.device("cpu"), MoKConfig()) == "reference"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert B.select_backend(torch.device("cpu"), MoKConfig()) == "reference"


def test_removed_backend_env_has_no_effect(monkeypatch):
    """MOK_CUTE_BACKEND is gone: the config's backend decides, whatever the environment says."""
    monkeypatch.setenv("MOK_CUTE_BACKEND", "reference")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert B.select_backend(cuda, MoKConfig(backend="sm90")) == "sm90"
    assert B.select_backend(cuda, MoKConfig()) == "sm90"
    monkeypatch.setenv("MOK_CUTE_BACKEND", "tpu")  # not even validated
    assert B.select_backend(torch.device("cpu"), MoKConfig(backend="reference")) == "reference"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        B.select_backend(torch.device("cpu"), MoKConfig(backend="sm100"))


def test_gpu_backend_on_cpu_tensors_rejected():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        B.select_backend(torch.device("cpu"), MoKConfig(backend="sm90"))


def test_backend_by_capability(monkeypatch):
    cuda = torch.device("cuda", 0)
    for cap, want in [((9, 0), "sm90"), ((10, 0), "sm100"), ((10, 3), "sm100"), ((8, 0), "reference")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert B.select_backend(cuda, MoKConfig()) == want


# ---------------------------------------------------------------- autograd path
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_moe_autograd_equals_reference(precision):
    p, dy = make_problem(T=16, H=64, I=64, E=4, k=2, shared_I=64, seed=9)
    leaves = [p["x"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], *p["shared"]]
    for t in leaves:
        t.requires_grad_()
    y = call(p, swiglu_limit=4.0, config=MoKConfig(backend="reference", precision=precision))
    grads = torch.autograd.grad(y, leaves, dy)
    ry, rs = R.moe_forward(**{k: v.detach() if torch.is_tensor(v) else v for k, v in p.items() if k != "shared"},
                           shared=tuple(s.detach() for s in p["shared"]), swiglu_limit=4.0, precision=precision)
    rg = R.moe_backward(rs, dy)
    assert torch.equal(y, ry)
    for a, b in zip(grads, [rg.dx, rg.d_topk_w, rg.d_w_gate, rg.d_w_up, rg.d_w_down, *rg.d_shared]):
        assert torch.equal(a, b)


def test_moe_without_shared_and_int32_idx():
    p, dy = make_problem(T=8, seed=10)
    p["topk_idx"] = p["topk_idx"].int()
    p["x"].requires_grad_()
    y = call(p, config=MoKConfig(backend="reference"))
    y.backward(dy)
    assert p["x"].grad is not None and p["x"].grad.dtype == torch.bfloat16


def test_layer_router_gradient_flows():
    torch.manual_seed(0)
    layer = MoELayer(64, 64, 8, 2, shared_intermediate_size=64, swiglu_limit=4.0,
                     config=MoKConfig(backend="reference"))
    assert layer.w_gate.shape == (8, 64, 64) and layer.w_down.shape == (8, 64, 64)
    x = torch.randn(12, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().pow(2).sum().backward()
    for prm in (layer.router_weight, layer.w_gate, layer.w_up, layer.w_down, layer.ws_gate, x):
        assert prm.grad is not None and prm.grad.abs().sum() > 0


def test_layer_without_router_needs_routing():
    layer = MoELayer(64, 64, 4, 2, router=False)
    with pytest.raises(ValueError, match="no router"):
        layer(torch.randn(4, 64, dtype=torch.bfloat16))


def test_layer_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(64, 64, 4, 5)


def test_import_needs_no_gpu_or_dsl():
    import os
    import subprocess
    import sys

    code = "import sys, mok_cute; assert 'cutlass' not in sys.modules; print(mok_cute.__all__)"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


def test_quickstart_runs_and_matches_readme():
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    script = (root / "examples" / "quickstart.py").read_text()
    body = script.split('"""', 2)[2].strip()
    assert body.split("\n", 2)[2] in (root / "README.md").read_text()  # README shows this code
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(root / "examples" / "quickstart.py")],
                         capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([512, 256])" in out.stdout
    assert out.stderr.count("reference backend") == 1


def test_gpu_backends_raise_for_missing_kernels(monkeypatch):
    from mok_cute.layers import grouped as G

    p, _ = make_problem(T=4, H=256, I=256)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    B.get_backend("sm100").check(inp, MoKConfig(precision="mxfp8"), None)  # MXFP8 wired on sm100 (EP = 1)
    B.get_backend("sm100").check(inp, MoKConfig(), None)
    with pytest.warns(RuntimeWarning, match="'sm100': precision 'fp8_block' runs as 'mxfp8'"):
        G._ALIASED.clear()
        B.get_backend("sm100").check(inp, MoKConfig(precision="fp8_block"), None)  # as MXFP8 (hardware scales)
    with monkeypatch.context() as mp:
        mp.setattr(G, "_world", lambda group: (2, 0))
        for precision in ("bf16", "mxfp8"):  # EP > 1 on sm100 still raises, in either precision
            with pytest.raises(NotImplementedError, match="'sm100': EP > 1"):
                B.get_backend("sm100").check(inp, MoKConfig(precision=precision), object())
    for precision in ("mxfp8", "fp8_block"):  # wired on sm90 at EP = 1
        B.get_backend("sm90").check(inp, MoKConfig(precision=precision), None)
    B.get_backend("sm90").check(inp, MoKConfig(), None)  # bf16, EP = 1, 256-aligned: runs
    small, _ = make_problem(T=4, H=128, I=256)
    inp2 = B.MoEInputs(small["x"], small["topk_idx"], small["topk_w"], small["w_gate"], small["w_up"],
                       small["w_down"], None, None)
    for be in ("sm90", "sm100"):  # H, I multiples of 64 (partial last tiles)
        for precision in ("bf16", "mxfp8"):
            B.get_backend(be).check(inp2, MoKConfig(precision=precision), None)
        with pytest.raises(ValueError, match="I = 96 must be a multiple of 64"):
            B.get_backend(be).check(_inputs(128, 96), MoKConfig(), None)
    with pytest.raises(ValueError, match="H = 192 must be a multiple of 128"):  # fp8_block: its 128-blocks
        B.get_backend("sm90").check(_inputs(192, 256), MoKConfig(precision="fp8_block"), None)


def _inputs(h, inter):
    p, _ = make_problem(T=4, H=h, I=inter)
    return B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)


def test_route_sort_matches_reference_order():
    from mok_cute.layers.grouped import route_sort

    p, _ = make_problem(T=20, E=5, k=3, seed=12)
    order, offsets, valid = route_sort(p["topk_idx"], 5)
    plan = R.plan_routing([p["topk_idx"]], 5, 1, 0)
    assert offsets.tolist() == plan.offsets
    n = plan.offsets[-1]
    assert torch.equal(order[:n] // 3, plan.tok) and torch.equal(order[:n] % 3, plan.slot)
    assert not valid[order[n:]].any()


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp8_block"])
def test_expert_mlp_reference_path_gradients(precision):
    """expert_mlp runs config.precision (it once ran bf16 whatever the config said)."""
    from mok_cute.ops import expert_mlp

    g = torch.Generator().manual_seed(13)
    E, H, I = 3, 128, 128
    offs = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    x = torch.randn(12, H, generator=g).bfloat16().requires_grad_()
    ws = [(torch.randn(*s, generator=g) * 0.1).bfloat16().requires_grad_() for s in [(E, I, H), (E, I, H), (E, H, I)]]
    d = torch.randn(12, H, generator=g).bfloat16()
    out = expert_mlp(x, offs, *ws, swiglu_limit=4.0, config=MoKConfig(backend="reference", precision=precision))
    grads = torch.autograd.grad(out, [x, *ws], d)
    r, saved = R.experts_forward(x.detach(), offs, *[w.detach() for w in ws], 4.0, precision)
    want = R.experts_backward(saved, d, *[w.detach() for w in ws], 4.0, precision)
    assert torch.equal(out, r)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)
    if precision != "bf16":
        r16, _ = R.experts_forward(x.detach(), offs, *[w.detach() for w in ws], 4.0, "bf16")
        assert not torch.equal(out, r16)
    with pytest.raises(TypeError, match="offsets"):
        expert_mlp(x, offs[:-1], *ws, config=MoKConfig(backend="reference"))

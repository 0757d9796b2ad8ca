"""gpt-oss's expert options through the public API on the reference backend:
``mok_cute.moe(..., swiglu_limit=mok_cute.SwiGLU(limit, alpha, up_offset))`` and expert biases as
(weight, bias) pairs, with gate / up as interleaved strided views of one projection (used in place
or copied, the gradients landing in the projection), ``main_grads``, ``activations="recompute"``,
torch.compile, ``MoELayer(swiglu_limit=SwiGLU(...)).add_expert_biases()``, the argument errors,
and the GPU backends' check: the whole SwiGLU passes it (their kernels run it), the biases pass where their
kernels run them (sm90, EP = 1, bf16) and are refused before any launch elsewhere."""
from __future__ import annotations

import pytest
import torch

import mok_cute
from mok_cute import MoKConfig, MoELayer, SwiGLU, reference as R
from mok_cute.layers import grouped as G
from mok_cute.layers import paths as P
from mok_cute.layers.select import MoEInputs, get_backend

CFG = MoKConfig(backend="reference")
ACT = SwiGLU(0.7, 1.702, 1.0)  # gpt-oss's alpha and up offset, a limit that clamps here


def _problem(seed=0, t=24, h=64, inter=64, e=4, k=2):
    """x, topk_idx (with -1 slots), topk_w, gpt-oss's gate_up [E, H, 2I] (interleaved, transposed),
    down [E, I, H], gate_up_bias [E, 2I], down_bias [E, H], dy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    gate_up = (torch.randn(e, h, 2 * inter, generator=g) * h ** -0.5).bfloat16()
    down = (torch.randn(e, inter, h, generator=g) * inter ** -0.5).bfloat16()
    gu_bias = (torch.randn(e, 2 * inter, generator=g) * 0.3).bfloat16()
    d_bias = (torch.randn(e, h, generator=g) * 0.3).bfloat16()
    dy = torch.randn(t, h, generator=g).bfloat16()
    return x, idx, w, gate_up, down, gu_bias, d_bias, dy


def _views(gate_up, down, gu_bias, d_bias):
    """mok_cute.moe's (weight, bias) pairs of gpt-oss's tensors: views, no copy."""
    gu = gate_up.transpose(1, 2)
    return ((gu[:, 0::2], gu_bias[:, 0::2]), (gu[:, 1::2], gu_bias[:, 1::2]), (down.transpose(1, 2), d_bias))


def test_interleaved_views_and_biases_match_contiguous_copies_and_grads_land_in_place():
    """moe on strided views of gpt-oss's parameters: y and every gradient equal the reference on
    contiguous copies, bitwise; the gradients land in gate_up, down and the two bias tensors."""
    x, idx, w, gate_up, down, gu_bias, d_bias, dy = _problem(1)
    params = [t.clone().requires_grad_() for t in (gate_up, down, gu_bias, d_bias)]
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mok_cute.moe(xl, idx, wl, *_views(*params), swiglu_limit=ACT, config=CFG)
    y.backward(dy)
    flat = [t.contiguous() for pair in _views(gate_up, down, gu_bias, d_bias) for t in pair]
    want, saved = R.moe_forward(x, idx, w, *flat[0::2], None, ACT, "bf16", None, None, tuple(flat[1::2]))
    g = R.moe_backward(saved, dy)
    assert torch.equal(y, want) and torch.equal(xl.grad, g.dx) and torch.equal(wl.grad, g.d_topk_w)
    d_gate_up = torch.stack([g.d_w_gate, g.d_w_up], dim=2).reshape(gate_up.shape[0], -1, gate_up.shape[1])
    assert torch.equal(params[0].grad, d_gate_up.transpose(1, 2))  # [E, H, 2I]: gate even, up odd columns
    assert torch.equal(params[1].grad, g.d_w_down.transpose(1, 2))
    assert torch.equal(params[2].grad, torch.stack(g.d_biases[:2], dim=2).reshape(gu_bias.shape))
    assert torch.equal(params[3].grad, g.d_biases[2])
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


def test_interleaved_halves_are_used_in_place_where_tma_addresses_them():
    """Gate / up interleaved rows of an untransposed [E, 2I, H] projection (rows 2i, 2i + 1) have a
    contiguous reduction dim: the kernels' TMA reads them in place (no copy); gpt-oss's transposed
    [E, H, 2I] has it strided by 2I: copied to a contiguous operand (:func:`weight_operand`)."""
    from mok_cute.dsl.host import tma_weight, weight_operand

    e, inter, h = 4, 64, 128
    fc1 = torch.randn(e, 2 * inter, h).bfloat16()
    for half in (fc1[:, 0::2], fc1[:, 1::2]):
        assert tma_weight(half) and weight_operand(half) is half
    gpt_oss = torch.randn(e, h, 2 * inter).bfloat16().transpose(1, 2)[:, 0::2]
    assert not tma_weight(gpt_oss) and weight_operand(gpt_oss).is_contiguous()
    assert torch.equal(weight_operand(gpt_oss), gpt_oss)


def test_the_layer_receives_the_activation_and_the_biases(monkeypatch):
    """The backend gets the SwiGLU (not plain) and the three biases; a plain SwiGLU(L) reaches it
    as swiglu_limit=L alone (what the GPU kernels run)."""
    from mok_cute.layers import select

    seen = []
    real = select.get_backend

    class Spy:
        def __init__(self, be):
            self.be, self.name, self.shared_gate = be, be.name, True

        def forward(self, inp, config, group):
            seen.append(inp)
            return self.be.forward(inp, config, group)

    monkeypatch.setattr(select, "get_backend", lambda name: Spy(real(name)))
    x, idx, w, gate_up, down, gu_bias, d_bias, _ = _problem(2)
    pairs = _views(gate_up, down, gu_bias, d_bias)
    mok_cute.moe(x, idx, w, *pairs, swiglu_limit=ACT, config=CFG)
    mok_cute.moe(x, idx, w, *(p[0] for p in pairs), swiglu_limit=SwiGLU(4.0), config=CFG)
    assert seen[0].swiglu_limit == ACT and len(seen[0].biases) == 3
    assert seen[1].swiglu_limit == 4.0 and seen[1].biases is None  # a plain SwiGLU: its limit alone


def test_plain_swiglu_is_the_float_limit_bitwise():
    x, idx, w, gate_up, down, *_ = _problem(3)
    ws = [t.contiguous() for t in (gate_up.transpose(1, 2)[:, 0::2], gate_up.transpose(1, 2)[:, 1::2],
                                   down.transpose(1, 2))]
    for old, new in ((None, SwiGLU()), (4.0, SwiGLU(4.0))):
        assert torch.equal(mok_cute.moe(x, idx, w, *ws, swiglu_limit=old, config=CFG),
                           mok_cute.moe(x, idx, w, *ws, swiglu_limit=new, config=CFG))


def test_main_grads_take_the_bias_gradients_last():
    """main_grads: one fp32 tensor per weight, the three biases last; main_grad = start +
    fp32(gradient), bitwise; no .grad."""
    x, idx, w, gate_up, down, gu_bias, d_bias, dy = _problem(4)
    flat = [t.contiguous() for pair in _views(gate_up, down, gu_bias, d_bias) for t in pair]
    weights, biases = flat[0::2], flat[1::2]
    leaves = [t.clone().requires_grad_() for t in weights + biases]
    y = mok_cute.moe(x, idx, w, *zip(leaves[:3], leaves[3:]), swiglu_limit=ACT, config=CFG)
    fresh = torch.autograd.grad(y, leaves, dy)
    start = [torch.randn(t.shape) for t in leaves]
    acc = [s.clone() for s in start]
    y2 = mok_cute.moe(x, idx, w, *zip(leaves[:3], leaves[3:]), swiglu_limit=ACT, config=CFG, main_grads=acc)
    y2.backward(dy)
    assert all(torch.equal(a, s + f.float()) for a, s, f in zip(acc, start, fresh))
    assert all(t.grad is None for t in leaves)
    with pytest.raises(TypeError, match=r"main_grads must be a tuple of 6 fp32 tensors \(w_gate, w_up, w_down, "
                                        r"b_gate, b_up, b_down\)"):
        mok_cute.moe(x, idx, w, *zip(leaves[:3], leaves[3:]), swiglu_limit=ACT, config=CFG, main_grads=acc[:3])


def test_gradients_for_the_biases_alone_and_recompute_is_bitwise():
    """Only the biases require grad: they get theirs; activations="recompute" gives the "save"
    policy's every gradient bitwise."""
    x, idx, w, gate_up, down, gu_bias, d_bias, dy = _problem(5)
    pairs = _views(gate_up, down, gu_bias.clone().requires_grad_(), d_bias.clone().requires_grad_())
    y = mok_cute.moe(x, idx, w, *pairs, swiglu_limit=ACT, config=CFG)
    got = torch.autograd.grad(y, [pairs[0][1], pairs[1][1], pairs[2][1]], dy)
    assert all(g is not None and g.abs().sum() > 0 for g in got)

    def grads(policy):
        leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down, gu_bias, d_bias)]
        out = mok_cute.moe(leaves[0], idx, leaves[1], *_views(*leaves[2:]), swiglu_limit=ACT,
                           config=MoKConfig(backend="reference", activations=policy))
        return [out, *torch.autograd.grad(out, leaves, dy)]

    assert all(torch.equal(a, b) for a, b in zip(grads("save"), grads("recompute")))


def test_compiles_fullgraph_bitwise():
    """A model calling moe with gpt-oss's options (the custom ops carry the activation and the
    biases), compiled with fullgraph: forward and every gradient bitwise eager."""
    x, idx, w, gate_up, down, gu_bias, d_bias, dy = _problem(6)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.down = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
            self.gu_bias, self.d_bias = torch.nn.Parameter(gu_bias.clone()), torch.nn.Parameter(d_bias.clone())

        def forward(self, x, w):
            return mok_cute.moe(x, idx, w, *_views(self.gate_up, self.down, self.gu_bias, self.d_bias),
                                swiglu_limit=ACT, config=CFG)

    def step(fn, model):
        model.zero_grad(set_to_none=True)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xl, wl)
        y.backward(dy)
        return [y, xl.grad, wl.grad] + [p.grad for p in model.parameters()]

    model = Model()
    eager = step(model, model)
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"), model)
    assert len(eager) == len(compiled) == 7
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_layer_options():
    """MoELayer(swiglu_limit=SwiGLU.gpt_oss()).add_expert_biases(): bf16 zero biases that train,
    the layer equal to the functional call with (weight, bias) pairs; with accumulate_main_grad
    their main_grad buffers fill and .grad stays None."""
    torch.manual_seed(0)
    layer = MoELayer(64, 64, 4, 2, swiglu_limit=SwiGLU.gpt_oss(), config=CFG).add_expert_biases()
    assert [tuple(b.shape) for b in (layer.b_gate, layer.b_up, layer.b_down)] == [(4, 64), (4, 64), (4, 64)]
    assert all(b.dtype == torch.bfloat16 and not b.any() for b in (layer.b_gate, layer.b_up, layer.b_down))
    with torch.no_grad():
        for b in (layer.b_gate, layer.b_up, layer.b_down):
            b.normal_(0, 0.3)
    x = torch.randn(16, 64).bfloat16()
    idx, w = layer.route(x)
    y = layer(x)
    pairs = [(layer.w_gate, layer.b_gate), (layer.w_up, layer.b_up), (layer.w_down, layer.b_down)]
    assert torch.equal(y, mok_cute.moe(x, idx, w, *pairs, swiglu_limit=SwiGLU.gpt_oss(), config=CFG))
    y.float().square().sum().backward()
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in (layer.b_gate, layer.b_up, layer.b_down))
    with pytest.raises(ValueError, match="expert biases already"):
        layer.add_expert_biases()
    acc = MoELayer(64, 64, 4, 2, shared_intermediate_size=64, config=CFG, accumulate_main_grad=True).add_expert_biases()
    acc(x).float().square().sum().backward()
    assert all(b.grad is None and b.main_grad.dtype == torch.float32 and b.main_grad.abs().sum() > 0
               for b in (acc.b_gate, acc.b_up, acc.b_down))
    assert MoELayer(64, 64, 4, 2, config=CFG).b_gate is None


def test_expert_mlp_runs_the_whole_swiglu_eager_and_compiled():
    """expert_mlp with gpt-oss's activation: out and every gradient equal the reference's grouped MLP with that
    SwiGLU, bitwise, eagerly and under torch.compile(fullgraph) (the custom ops carry alpha and up offset); a
    plain SwiGLU(L) is the float L's call."""
    from mok_cute.ops import expert_mlp

    x, _, _, gate_up, down, *_ = _problem(7)
    x = x[:20].contiguous()  # every row an expert's
    ws = [t.contiguous() for t in (gate_up.transpose(1, 2)[:, 0::2], gate_up.transpose(1, 2)[:, 1::2],
                                   down.transpose(1, 2))]
    offs = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    assert torch.equal(expert_mlp(x, offs, *ws, swiglu_limit=SwiGLU(4.0), config=CFG),
                       expert_mlp(x, offs, *ws, swiglu_limit=4.0, config=CFG))
    d_out = torch.randn(20, x.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    want, saved = R.experts_forward(x, offs, *ws, ACT, "bf16")
    want_g = R.experts_backward(saved, d_out, *ws, ACT, "bf16")

    def fn(x, *ws):
        return expert_mlp(x, offs, *ws, swiglu_limit=ACT, config=CFG)

    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in ws]
        out = f(*leaves)
        out.backward(d_out)
        assert torch.equal(out, want)
        assert all(torch.equal(p.grad, g) for p, g in zip(leaves, want_g))
    assert not torch.equal(want, expert_mlp(x, offs, *ws, swiglu_limit=ACT.limit, config=CFG))


# ---------------------------------------------------------------- argument errors
def _bad(case):
    x, idx, w, gate_up, down, gu_bias, d_bias, _ = _problem(8)
    pairs = list(_views(gate_up, down, gu_bias, d_bias))
    kw = dict(swiglu_limit=ACT, config=CFG)
    if case == "mixed":
        pairs[1] = pairs[1][0]
    elif case == "triple":
        pairs[2] = pairs[2] + (d_bias,)
    elif case == "bias_dtype":
        pairs[0] = (pairs[0][0], pairs[0][1].float())
    elif case == "bias_shape":
        pairs[1] = (pairs[1][0], gu_bias)
    elif case == "down_bias_shape":
        pairs[2] = (pairs[2][0], gu_bias[:, :32])
    elif case == "bias_device":
        pairs[2] = (pairs[2][0], torch.empty(d_bias.shape, dtype=torch.bfloat16, device="meta"))
    elif case == "bias_not_tensor":
        pairs[0] = (pairs[0][0], gu_bias.tolist())
    elif case == "limit_type":
        kw["swiglu_limit"] = (0.7, 1.702, 1.0)
    return (x, idx, w, *pairs), kw


ERRORS = {
    "mixed": (TypeError, "w_gate, w_up, w_down must all be tensors or all be \\(weight, bias\\) pairs .*w_gate, w_down only"),
    "triple": (TypeError, "w_down must be a tensor or a \\(weight, bias\\) pair, got a sequence of length 3"),
    "bias_dtype": (TypeError, "b_gate \\(w_gate's bias\\) must have dtype bfloat16, got float32"),
    "bias_shape": (ValueError, "b_up \\(w_up's bias\\) must have shape \\[E_local, I\\] = \\(4, 64\\), got \\(4, 128\\)"),
    "down_bias_shape": (ValueError, "b_down \\(w_down's bias\\) must have shape \\[E_local, H\\] = \\(4, 64\\)"),
    "bias_device": (ValueError, "b_down \\(w_down's bias\\) is on meta but w_gate is on cpu"),
    "bias_not_tensor": (TypeError, "b_gate \\(w_gate's bias\\) must be a torch.Tensor, got list"),
    "limit_type": (TypeError, "swiglu_limit must be None or a float \\(or a mok_cute.SwiGLU\\), got tuple"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_argument_errors_name_the_argument(case):
    args, kw = _bad(case)
    exc, msg = ERRORS[case]
    with pytest.raises(exc, match=msg):
        mok_cute.moe(*args, **kw)


# ---------------------------------------------------------------- the GPU backends: the activation and the biases
def _inputs(act=None, biased=False, h=256, inter=256):
    x, idx, w, gate_up, down, gu_bias, d_bias, _ = _problem(9, h=h, inter=inter)
    (wg, bg), (wu, bu), (wd, bd) = _views(gate_up, down, gu_bias, d_bias)
    return MoEInputs(x, idx, w, wg, wu, wd, None, None if act is None else act.limit if act.plain else act,
                     biases=(bg, bu, bd) if biased else None)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_gpu_backends_check_the_activation_and_the_biases_before_any_launch(arch, monkeypatch):
    """Their check (no kernel, CPU tensors here): every SwiGLU passes it (the kernels run its limit, alpha and up
    offset); expert biases pass at EP = 1 and bf16 (the epilogues add them) and raise NotImplementedError naming
    them at the other precisions and at EP > 1."""
    be = get_backend(arch)
    for act in (SwiGLU(7.0), SwiGLU(7.0, 1.702, 0.0), SwiGLU(None, 1.0, 1.0), SwiGLU.gpt_oss()):
        be.check(_inputs(act), MoKConfig(backend=arch), None)
    for ep in (1, 2):
        monkeypatch.setattr(G, "_world", lambda group, ep=ep: (ep, 0))
        for precision in ("bf16", "mxfp8", "fp8_block"):
            if precision not in P.precisions(arch):
                continue
            for act in (None, SwiGLU.gpt_oss()):
                cfg = MoKConfig(backend=arch, precision=precision)
                group = None if ep == 1 else object()
                if ep == 1 and precision == "bf16":
                    be.check(_inputs(act, True), cfg, group)
                    continue
                with pytest.raises(NotImplementedError, match=rf"'{arch}': .*with expert biases"):
                    be.check(_inputs(act, True), cfg, group)


def test_fused_whole_refuses_the_biases():
    """FUSED_WHOLE builds the routed dy rows inside its launch: no bias gradients there (FUSED runs them)."""
    from mok_cute.config import BackwardPath, ForwardPath

    call = P.Call("bf16", biases=True)
    cfg = MoKConfig(forward_path=ForwardPath.FUSED, backward_path=BackwardPath.FUSED_WHOLE)
    with pytest.raises(NotImplementedError, match="FUSED_WHOLE does not run with expert biases"):
        P.decide(cfg, "sm90", call)
    assert P.decide(MoKConfig(), "sm90", call) == P.Paths(ForwardPath.FUSED, BackwardPath.FUSED)


class _ReferenceMlp:
    """An sm90 row of the table (CPU tensors: the unfused paths) whose "kernels" are the reference's grouped
    expert math: the layer's own plumbing of the biases (forward keyword, state, backward keyword, MoEGrads)."""

    arch, dim_multiple, precisions, strided_weights, fused_mx_prologue = "sm90", {"bf16": 64}, ("bf16",), True, True
    gathers_x = False

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, biases=None):
        from mok_cute.layers.common import ExpertGroup

        r, saved = R.experts_forward(x_rows, offsets, w_gate, w_up, w_down, limit, "bf16", biases)
        return r, ExpertGroup(x_rows, offsets, saved.gu, saved.h)

    def backward(self, g, dy_rows, w_gate, w_up, w_down, limit, fused, config=None, biased=False):
        saved = R.ExpertSaved(g.x, g.gu, g.h, R._offs(g.offsets), biased)
        return R.experts_backward(saved, dy_rows, w_gate, w_up, w_down, limit, "bf16")


def test_the_gpu_layer_carries_the_biases_to_its_mlp_and_their_gradients_back():
    """GroupedExpertBackend (the sm90 / sm100 layer) with the reference's math as its MLP: y and every gradient,
    the three bias gradients included, are the reference backend's, bitwise (d topk_w: the layer's route_grad
    pass sums in fp32, the reference in fp64: within 1e-5 relative)."""
    from mok_cute.layers.grouped import GroupedExpertBackend

    x, idx, w, gate_up, down, gu_bias, d_bias, dy = _problem(4, h=64, inter=64)
    (wg, bg), (wu, bu), (wd, bd) = (tuple(t.contiguous() for t in pair) for pair in _views(gate_up, down, gu_bias,
                                                                                           d_bias))
    inp = MoEInputs(x, idx, w, wg, wu, wd, None, ACT, biases=(bg, bu, bd))
    y, st = GroupedExpertBackend(_ReferenceMlp()).forward(inp, MoKConfig(trace=False), None)
    assert st.biased and st.paths == P.Paths(P.ForwardPath.UNFUSED, P.BackwardPath.UNFUSED)
    got = GroupedExpertBackend(_ReferenceMlp()).backward(st, dy)
    want_y, saved = R.moe_forward(x, idx, w, wg, wu, wd, None, ACT, "bf16", None, None, (bg, bu, bd))
    want = R.moe_backward(saved, dy)
    assert torch.equal(y, want_y)
    for name in ("dx", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.d_topk_w, want.d_topk_w, rtol=1e-5, atol=1e-6)
    assert len(got.d_biases) == 3 and all(torch.equal(a, b) for a, b in zip(got.d_biases, want.d_biases))

"""Gradient accumulation into fp32 main_grad buffers (Megatron's fusion; MoK's ``main_grads``):
``moe(..., main_grads=...)`` and ``MoELayer(..., accumulate_main_grad=True)`` on the reference
backend, bitwise against the fresh gradients summed in fp32; and the autograd contract around
them: gradients for any subset of inputs, no graph under torch.no_grad."""
from __future__ import annotations

import pytest
import torch

import mok_cute
from mok_cute import MoKConfig, MoELayer

CFG = MoKConfig(backend="reference")


def _problem(shared: bool, seed: int, t=24, h=64, inter=64, e=4, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    ws = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((e, inter, h), (e, inter, h), (e, h, inter))]
    sh = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((inter, h), (inter, h), (h, inter))] if shared \
        else []
    dy = torch.randn(t, h, generator=g).bfloat16()
    return x, idx, w, ws, sh, dy


def _fresh(x, idx, w, ws, sh, dy, limit):
    leaves = [p.clone().requires_grad_() for p in ws + sh]
    y = mok_cute.moe(x, idx, w, *leaves[:3], shared=tuple(leaves[3:]) or None, swiglu_limit=limit, config=CFG)
    return y, torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("limit", [None, 4.0])
def test_main_grads_accumulate_fresh_gradients_in_fp32(shared, limit):
    """Two backwards into main_grads that start random: main_grad = start + fp32(dW_1) + fp32(dW_2),
    bitwise; y and dx are those of the call without main_grads; the weights get no .grad."""
    x, idx, w, ws, sh, dy = _problem(shared, 0)
    y_ref, grads = _fresh(x, idx, w, ws, sh, dy, limit)
    start = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(ws + sh)]
    acc = [s.clone() for s in start]
    leaves = [p.clone().requires_grad_() for p in ws + sh]
    xl = x.clone().requires_grad_()
    for _ in range(2):
        y = mok_cute.moe(xl, idx, w, *leaves[:3], shared=tuple(leaves[3:]) or None, swiglu_limit=limit, config=CFG,
                         main_grads=acc)
        y.backward(dy)
    assert torch.equal(y, y_ref)
    for a, s, d in zip(acc, start, grads):
        assert torch.equal(a, s + d.float() + d.float())
    assert all(p.grad is None for p in leaves) and xl.grad is not None


def test_layer_main_grad_buffers():
    """MoELayer(accumulate_main_grad=True): a zero fp32 .main_grad per expert weight, filled by the
    backward with the gradients a plain layer with the same parameters gets in .grad; .grad stays
    None; the router still gets its .grad."""
    torch.manual_seed(0)
    plain = MoELayer(64, 64, 4, 2, shared_intermediate_size=64, config=CFG)
    acc = MoELayer(64, 64, 4, 2, shared_intermediate_size=64, config=CFG, accumulate_main_grad=True)
    acc.load_state_dict(plain.state_dict())
    weights = acc._expert_weights()
    assert len(weights) == 6 and all(torch.equal(p.main_grad, torch.zeros(p.shape)) for p in weights)
    x = torch.randn(16, 64).bfloat16()
    dy = torch.randn(16, 64).bfloat16()
    plain(x).backward(dy)
    acc(x).backward(dy)
    for p, q in zip(plain._expert_weights(), weights):
        assert q.grad is None and q.main_grad.dtype == torch.float32 and torch.equal(q.main_grad, p.grad.float())
    assert torch.equal(acc.router_weight.grad, plain.router_weight.grad)
    assert not hasattr(plain.w_gate, "main_grad")


@pytest.mark.parametrize("bad,err,match", [
    (lambda m: m[:2], TypeError, "main_grads must be a tuple of 3"),
    (lambda m: [m[0].bfloat16(), *m[1:]], TypeError, r"main_grads\[0\] \(w_gate\) must have dtype float32"),
    (lambda m: [m[0], m[1][:1], m[2]], ValueError, r"main_grads\[1\] \(w_up\) must have shape"),
    (lambda m: [m[0], m[1], m[2].transpose(1, 2).contiguous().transpose(1, 2)], ValueError, "contiguous"),
])
def test_main_grads_validated(bad, err, match):
    x, idx, w, ws, _, _ = _problem(False, 1)
    good = [torch.zeros(p.shape) for p in ws]
    with pytest.raises(err, match=match):
        mok_cute.moe(x, idx, w, *ws, config=CFG, main_grads=bad(good))
    with pytest.raises(TypeError, match="accumulate_main_grad must be a bool"):
        MoELayer(64, 64, 4, 2, config=CFG, accumulate_main_grad=1)


@pytest.mark.parametrize("which", ["x", "topk_w", "w_gate", "experts", "shared", "none"])
def test_requires_grad_on_any_subset(which):
    """Only the inputs that require grad get one, each equal (bitwise) to the full backward's;
    with none requiring grad, y has no graph."""
    x, idx, w, ws, sh, dy = _problem(True, 3)
    full = [x, w, *ws, *sh]
    leaves = [p.clone().requires_grad_() for p in full]
    y = mok_cute.moe(leaves[0], idx, leaves[1], *leaves[2:5], shared=tuple(leaves[5:]), config=CFG)
    want = torch.autograd.grad(y, leaves, dy)
    pick = {"x": [0], "topk_w": [1], "w_gate": [2], "experts": [2, 3, 4], "shared": [5, 6, 7], "none": []}[which]
    part = [p.clone().requires_grad_(i in pick) for i, p in enumerate(full)]
    y2 = mok_cute.moe(part[0], idx, part[1], *part[2:5], shared=tuple(part[5:]), config=CFG)
    assert torch.equal(y2, y)
    if not pick:
        assert y2.grad_fn is None
        return
    got = torch.autograd.grad(y2, [part[i] for i in pick], dy)
    assert all(torch.equal(g, want[i]) for g, i in zip(got, pick))


def test_no_grad_keeps_no_state():
    """Under torch.no_grad the forward returns a graph-free y equal to the differentiable one."""
    x, idx, w, ws, sh, _ = _problem(True, 4)
    y = mok_cute.moe(x.clone().requires_grad_(), idx, w, *ws, shared=tuple(sh), config=CFG)
    with torch.no_grad():
        y0 = mok_cute.moe(x.clone().requires_grad_(), idx, w, *ws, shared=tuple(sh), config=CFG)
    assert y0.grad_fn is None and not y0.requires_grad and torch.equal(y0, y.detach())

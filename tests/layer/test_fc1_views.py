"""Gate and up as the two halves of one [E, 2I, H] fc1 tensor (Megatron's layout): the layer
takes the views in place wherever the kernels' TMA addresses them (no copy), and the results are
those of contiguous weights. The device run is tools/checks/fc1_views.py."""
from __future__ import annotations

import pytest
import torch

import mok_cute
from mok_cute import MoKConfig
from mok_cute.dsl.host import tma_weight, weight_operand

CFG = MoKConfig(backend="reference")


def test_tma_weight_layouts():
    e, i, h = 4, 64, 128
    w1 = torch.randn(e, 2 * i, h).bfloat16()
    assert tma_weight(w1) and tma_weight(w1[:, :i]) and tma_weight(w1[:, i:])
    assert not tma_weight(w1.transpose(1, 2))  # K not contiguous
    assert not tma_weight(w1[:, :, 1:])  # 16-byte misaligned start and rows
    assert not tma_weight(torch.randn(e, i, 100).bfloat16()[:, :, :96])  # row stride 100: not 16 bytes
    assert not tma_weight(w1.as_strided((e, i, h), (i * h, h // 2, 1)))  # rows overlap
    assert weight_operand(w1[:, :i]).data_ptr() == w1.data_ptr()  # in place
    assert weight_operand(w1.transpose(1, 2)).is_contiguous()  # else copied


def test_fc1_halves_reach_the_backend_uncopied_and_match_contiguous(monkeypatch):
    """mok_cute.moe with w_gate, w_up = fc1[:, :I], fc1[:, I:]: the backend receives the views
    themselves; y and every gradient (fc1's through both halves) equal those of contiguous copies."""
    from mok_cute.layers import select

    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 24, 64, 64, 4, 2
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    fc1 = (torch.randn(e, 2 * i, h, generator=g) * 0.1).bfloat16().requires_grad_()
    wd = (torch.randn(e, h, i, generator=g) * 0.1).bfloat16().requires_grad_()
    seen = []
    real = select.get_backend

    class Spy:
        def __init__(self, be):
            self.be, self.name = be, be.name

        def forward(self, inp, config, group):
            seen.append((inp.w_gate.data_ptr(), inp.w_up.data_ptr()))
            return self.be.forward(inp, config, group)

        def backward(self, *a, **kw):
            return self.be.backward(*a, **kw)

    monkeypatch.setattr(select, "get_backend", lambda name: Spy(real(name)))
    dy = torch.randn(t, h, generator=g).bfloat16()
    y = mok_cute.moe(x, idx, w, fc1[:, :i], fc1[:, i:], wd, config=CFG)
    # fc1 itself is the autograd input (one gradient, no zero-filled gradient per half)
    assert any(f is not None and getattr(f, "variable", None) is fc1 for f, _ in y.grad_fn.next_functions)
    y.backward(dy)
    assert seen == [(fc1.data_ptr(), fc1.data_ptr() + i * h * 2)]
    gate, up = fc1.detach()[:, :i].clone().requires_grad_(), fc1.detach()[:, i:].clone().requires_grad_()
    wd2 = wd.detach().clone().requires_grad_()
    y2 = mok_cute.moe(x, idx, w, gate, up, wd2, config=CFG)
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert torch.equal(fc1.grad, torch.cat([gate.grad, up.grad], 1)) and torch.equal(wd.grad, wd2.grad)


def test_sm90_operand_check_takes_the_halves():
    """The SM90 GEMMs' host check (no launch) accepts the fc1 halves and names a weight it cannot
    address."""
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    e, i, h = 2, 256, 256
    fc1 = torch.randn(e, 2 * i, h).bfloat16()
    x = torch.randn(8, h).bfloat16()
    offs = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert gg._check_operands(x, offs, {"w_gate": fc1[:, :i], "w_up": fc1[:, i:]}, a_name="x") == (8, h, e)
    with pytest.raises(ValueError, match="w_up must be .*strides"):
        gg._check_operands(x, offs, {"w_up": fc1.transpose(1, 2)[:, :, :h]}, a_name="x")


def _layouts(e, i, h, g):
    """(fc1 base, transposed, interleaved, w_gate view, w_up view) for every layout mok_cute.fc1 knows."""
    from mok_cute import fc1 as F

    for transposed, interleaved in F.LAYOUTS:
        base = torch.randn(*((e, h, 2 * i) if transposed else (e, 2 * i, h)), generator=g).bfloat16()
        gate, up = F.split(F.rows(base, transposed), interleaved)
        yield base, transposed, interleaved, gate, up


def test_fc1_find_operands_grad():
    """find recognises the four layouts of gate / up in one tensor (nothing else); operands gives the same
    values (in place for [E, 2I, H], a halves re-layout for [E, H, 2I]); grad gives the base's gradient in
    the base's layout (the halves' own buffer without a copy)."""
    from mok_cute import fc1 as F

    g = torch.Generator().manual_seed(0)
    e, i, h = 3, 64, 128
    for base, transposed, interleaved, gate, up in _layouts(e, i, h, g):
        found = F.find(gate, up)
        assert found == F.Fc1(base, transposed, interleaved)
        assert F.find(up, gate) is None and F.find(gate.clone(), up) is None
        og, ou = F.operands(found)
        assert torch.equal(og, gate) and torch.equal(ou, up)
        assert (og.data_ptr() == gate.data_ptr()) == (not transposed)  # in place: TMA addresses the rows
        dg, du = torch.randn(e, i, h, generator=g).bfloat16(), torch.randn(e, i, h, generator=g).bfloat16()
        d = F.grad(found, dg, du)
        assert d.shape == base.shape and d.stride() == base.stride()
        want = torch.zeros_like(base, dtype=torch.float32)
        wg, wu = F.split(F.rows(want, transposed), interleaved)
        wg.copy_(dg), wu.copy_(du)
        assert torch.equal(d.float(), want)
        assert F.grad(found, None, None) is None
    fc1 = torch.randn(e, 2 * i, h)
    assert F.find(fc1[:2, :i], fc1[:2, i:]) is None  # not every expert
    wide = torch.randn(e, 3 * i, h)
    assert F.find(wide[:, :i], wide[:, i:2 * i]) is None  # halves of a part of a bigger tensor
    found, buf = F.find(fc1[:, :i], fc1[:, i:]), torch.randn(e, 2 * i, h)
    assert F.grad(found, buf[:, :i], buf[:, i:]) is buf  # the fused backward's buffer itself
    buf = torch.randn(e, 2 * i, h, generator=g).bfloat16()  # ... or its tiled transpose for [E, H, 2I]
    for base, transposed, interleaved, gate, up in _layouts(e, i, h, g):
        d = F.grad(F.find(gate, up), buf[:, :i], buf[:, i:])
        assert d.stride() == base.stride()
        dg, du = F.split(F.rows(d, transposed), interleaved)
        assert torch.equal(dg, buf[:, :i]) and torch.equal(du, buf[:, i:])


@pytest.mark.parametrize("layout", range(4))
def test_moe_takes_fc1_in_every_layout(layout):
    """mok_cute.moe on gate / up views of one tensor, in each layout: autograd's input is that tensor, and y and
    every gradient equal those of contiguous copies of the views."""
    from mok_cute import fc1 as F

    g = torch.Generator().manual_seed(1)
    t, h, i, e, k = 24, 64, 64, 4, 2
    transposed, interleaved = F.LAYOUTS[layout]
    base = (torch.randn(*((e, h, 2 * i) if transposed else (e, 2 * i, h)), generator=g) * 0.1).bfloat16()
    base.requires_grad_()
    gate, up = F.split(F.rows(base, transposed), interleaved)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    wd = (torch.randn(e, h, i, generator=g) * 0.1).bfloat16()
    dy = torch.randn(t, h, generator=g).bfloat16()
    y = mok_cute.moe(x, idx, w, gate, up, wd, config=CFG)
    assert any(getattr(f, "variable", None) is base for f, _ in y.grad_fn.next_functions)
    y.backward(dy)
    g2, u2 = (v.detach().clone().requires_grad_() for v in (gate, up))
    y2 = mok_cute.moe(x, idx, w, g2, u2, wd, config=CFG)
    y2.backward(dy)
    assert torch.equal(y, y2)
    dg, du = F.split(F.rows(base.grad, transposed), interleaved)
    assert torch.equal(dg, g2.grad) and torch.equal(du, u2.grad)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_moe_takes_a_transposed_w_down(gpt_oss):
    """w_down given as the transpose of a contiguous [E, I, H] tensor (gpt-oss's down_proj; with ``gpt_oss`` also
    its [E, H, 2I] interleaved gate_up_proj): autograd takes the view (mok_cute.transposed), y and every gradient
    equal those of contiguous copies, and the [E, I, H] tensor's gradient comes contiguous, in its own layout."""
    from mok_cute import fc1 as F
    from mok_cute import transposed as T

    g = torch.Generator().manual_seed(2)
    t, h, i, e, k = 24, 64, 64, 4, 2
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    down = (torch.randn(e, i, h, generator=g) * 0.1).bfloat16().requires_grad_()
    base = (torch.randn(e, h, 2 * i, generator=g) * 0.1).bfloat16().requires_grad_()
    gate, up = F.split(F.rows(base, True), True) if gpt_oss else (v.detach().clone().requires_grad_() for v in
                                                                 F.split(F.rows(base, True), True))
    dy = torch.randn(t, h, generator=g).bfloat16()
    assert T.is_transposed(down.transpose(1, 2)) and not T.is_transposed(down)
    y = mok_cute.moe(x, idx, w, gate, up, down.transpose(1, 2), config=CFG)
    y.backward(dy)
    g2, u2 = (v.detach().clone().requires_grad_() for v in (gate, up))
    d2 = down.detach().transpose(1, 2).contiguous().requires_grad_()
    y2 = mok_cute.moe(x, idx, w, g2, u2, d2, config=CFG)
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert down.grad.is_contiguous() and torch.equal(down.grad, d2.grad.transpose(1, 2))
    dg, du = F.split(F.rows(base.grad, True), True) if gpt_oss else (gate.grad, up.grad)
    assert torch.equal(dg, g2.grad) and torch.equal(du, u2.grad)


@pytest.mark.parametrize("activations", ["save", "recompute"])
def test_relaid_weights_kept_for_the_backward_only_when_saving(activations):
    """gpt-oss's layouts (a transposed interleaved fc1 tensor, a transposed w_down): with ``activations="save"`` the
    layer keeps the forward's re-laid copies for the backward; with ``"recompute"`` it keeps the given weights and
    re-lays them out in the backward (nothing weight-sized held between the passes). Same y and gradients."""
    from mok_cute import fc1 as F

    g = torch.Generator().manual_seed(3)
    t, h, i, e, k = 24, 64, 64, 4, 2
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    base = (torch.randn(e, h, 2 * i, generator=g) * 0.1).bfloat16()
    down = (torch.randn(e, i, h, generator=g) * 0.1).bfloat16()
    dy = torch.randn(t, h, generator=g).bfloat16()
    out = {}
    for mode in ("save", activations):
        b, d = base.clone().requires_grad_(), down.clone().requires_grad_()
        gate, up = F.split(F.rows(b, True), True)
        y = mok_cute.moe(x, idx, w, gate, up, d.transpose(1, 2),
                         config=MoKConfig(backend="reference", activations=mode))
        held = y.grad_fn.weights
        y.backward(dy)
        out[mode] = (held, y, b.grad, d.grad)
    held = out[activations][0]
    if activations == "save":
        # the re-laid copies: gate / up the halves of one new [E, 2I, H] buffer, w_down a contiguous [E, H, I]
        assert len(held) == 3 and held[0]._base is held[1]._base is not None and held[2].is_contiguous()
    else:
        assert held is None
    assert all(torch.equal(a, c) for a, c in zip(out["save"][1:], out[activations][1:]))

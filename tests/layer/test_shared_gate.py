"""The shared expert's output gate (Qwen-style; MoK's newer API) in the reference and through
``mok_cute.moe(..., shared_gate=)`` / ``MoELayer(shared_output_gate=True)`` on the reference
backend: its rounding points (g in bf16, dy * shared-out rounded to bf16 before the sum over H,
the fp32 gate-weight gradient), its backward against float64 autograd, and its errors."""
from __future__ import annotations

import pytest
import torch

import mok_cute
from mok_cute import MoKConfig, MoELayer, reference
from mok_cute.reference import Numerics

CFG = MoKConfig(backend="reference")


def _problem(seed: int, t=24, h=64, inter=64, e=4, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    ws = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((e, inter, h), (e, inter, h), (e, h, inter))]
    sh = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((inter, h), (inter, h), (h, inter))]
    w_sg = (torch.randn(1, h, generator=g) * h ** -0.5).bfloat16()
    dy = torch.randn(t, h, generator=g).bfloat16()
    return x, idx, w, ws, sh, w_sg, dy


def test_forward_is_the_gated_combine():
    """y = bf16(fp32(s) * fp32(g) + sum_j w_j fp32(r_j)), g = bf16(sigmoid(fp32(x . w_sg^T))), bitwise."""
    x, idx, w, ws, sh, w_sg, _ = _problem(0)
    y = mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), shared_gate=w_sg, config=CFG)
    num = Numerics("bf16")
    s, _ = reference.experts_forward(x, [0, x.shape[0]], *(p[None] for p in sh), None, "bf16")
    g = torch.sigmoid((x.double() @ w_sg.double().t()).float()).bfloat16()
    assert torch.equal(g, reference.shared_gate(num, x, w_sg))
    _, saved = reference.moe_forward(x, idx, w, *ws, tuple(sh), None, "bf16")
    acc = s.float() * g.float()
    want = reference.slot_sum(acc, saved.slot_out, idx, w).bfloat16()
    assert torch.equal(y, want)
    assert not torch.equal(y, mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), config=CFG))


def test_zero_gate_weight_halves_the_shared_output():
    """w_sg = 0 is a gate of exactly 0.5, not "no gate"."""
    x, idx, w, ws, sh, _, _ = _problem(1)
    g = reference.shared_gate(Numerics("bf16"), x, torch.zeros(1, x.shape[1], dtype=torch.bfloat16))
    assert torch.equal(g, torch.full((x.shape[0], 1), 0.5, dtype=torch.bfloat16))
    z = torch.zeros(1, x.shape[1], dtype=torch.bfloat16)
    gated = mok_cute.moe(x, idx, torch.zeros_like(w), *ws, shared=tuple(sh), shared_gate=z, config=CFG)
    plain = mok_cute.moe(x, idx, torch.zeros_like(w), *ws, shared=tuple(sh), config=CFG)
    assert torch.equal(gated, (plain.float() * 0.5).bfloat16())


def test_dy_times_shared_out_is_rounded_before_the_sum():
    """A token whose fp32 products dy * s sum to 2^-14 but whose bf16 products cancel exactly:
    dg, dz, the gate's share of dx and its weight gradient are exactly 0 (an fp32 product would
    give a non-zero gradient)."""
    num = Numerics("bf16")
    a, b = 1 + 2 ** -7, 1 + 2 ** -6  # bf16 values; a * a = 1 + 2^-6 + 2^-14 is not one
    dy = torch.tensor([[a, -1.0]], dtype=torch.bfloat16)
    s = torch.tensor([[a, b]], dtype=torch.bfloat16)
    x = torch.tensor([[0.75, -1.5]], dtype=torch.bfloat16)
    w_sg = torch.tensor([[0.25, 0.5]], dtype=torch.bfloat16)
    g = reference.shared_gate(num, x, w_sg)
    assert float((dy.float() * s.float()).sum()) == 2 ** -14  # the fp32 products do not cancel
    dy_s, dx_gate, d_w = reference.shared_gate_backward(num, dy, s, g, x, w_sg)
    assert torch.equal(dx_gate, torch.zeros(1, 2)) and torch.equal(d_w, torch.zeros(1, 2))
    assert d_w.dtype == torch.float32 and dx_gate.dtype == torch.float32
    assert torch.equal(dy_s, (dy.float() * g.float()).bfloat16())


def test_gate_backward_is_the_gradient_in_exact_mode():
    """In exact (float64, unrounded) numerics the gate's backward equals float64 autograd of
    sum(dy * s * sigmoid(x . w_sg^T)) with respect to x and w_sg, and d shared-out = dy * g."""
    g0 = torch.Generator().manual_seed(5)
    x = torch.randn(7, 16, generator=g0, dtype=torch.float64)
    w_sg = torch.randn(1, 16, generator=g0, dtype=torch.float64) * 0.3
    s = torch.randn(7, 16, generator=g0, dtype=torch.float64)
    dy = torch.randn(7, 16, generator=g0, dtype=torch.float64)
    num = Numerics("exact")
    g = reference.shared_gate(num, x, w_sg)
    dy_s, dx_gate, d_w = reference.shared_gate_backward(num, dy, s, g, x, w_sg)
    xa, wa = x.clone().requires_grad_(), w_sg.clone().requires_grad_()
    (dy * s * torch.sigmoid(xa @ wa.t())).sum().backward()
    torch.testing.assert_close(dx_gate, xa.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_w, wa.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dy_s, dy * torch.sigmoid(x @ w_sg.t()), rtol=1e-12, atol=1e-12)


def _grads(x, idx, w, ws, sh, w_sg, dy, main_grads=None):
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    weights = [p.clone().requires_grad_() for p in ws + sh + [w_sg]]
    y = mok_cute.moe(leaves[0], idx, leaves[1], *weights[:3], shared=tuple(weights[3:6]), shared_gate=weights[6],
                     config=CFG, main_grads=main_grads)
    y.backward(dy)
    return y, leaves, weights


def test_autograd_gradients_are_the_reference_backward():
    """Every gradient through autograd is the reference backward's: dx with the gate's share, the
    shared expert's from dy * g, the gate weight's as bf16 of its fp32 gradient; with main_grads
    (the gate's last) the fp32 gradient itself, bitwise."""
    x, idx, w, ws, sh, w_sg, dy = _problem(2)
    y, leaves, weights = _grads(x, idx, w, ws, sh, w_sg, dy)
    y_ref, saved = reference.moe_forward(x, idx, w, *ws, tuple(sh), None, "bf16", None, w_sg)
    ref = reference.moe_backward(saved, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(leaves[0].grad, ref.dx) and torch.equal(leaves[1].grad, ref.d_topk_w)
    for got, want in zip(weights[3:6], ref.d_shared):
        assert torch.equal(got.grad, want)
    assert ref.d_shared_gate.dtype == torch.float32 and ref.d_shared_gate.abs().sum() > 0
    assert torch.equal(weights[6].grad, ref.d_shared_gate.bfloat16())
    plain = reference.moe_backward(reference.moe_forward(x, idx, w, *ws, tuple(sh), None, "bf16")[1], dy)
    assert not torch.equal(plain.dx, ref.dx)  # the gate changes dx
    mains = [torch.zeros(p.shape) for p in ws + sh + [w_sg]]
    _, _, weights = _grads(x, idx, w, ws, sh, w_sg, dy, main_grads=mains)
    assert torch.equal(mains[6], ref.d_shared_gate) and all(p.grad is None for p in weights)


def test_errors_before_any_kernel(monkeypatch):
    x, idx, w, ws, sh, w_sg, _ = _problem(3)
    with pytest.raises(ValueError, match="shared_gate.*needs shared"):
        mok_cute.moe(x, idx, w, *ws, shared_gate=w_sg, config=CFG)
    with pytest.raises(TypeError, match="shared_gate"):
        mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), shared_gate=w_sg.float(), config=CFG)
    with pytest.raises(ValueError, match=r"shared_gate.*\[1, H\]"):
        mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), shared_gate=w_sg[:, :32], config=CFG)
    with pytest.raises(TypeError, match="main_grads"):  # the gate's main grad is part of the tuple
        mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), shared_gate=w_sg, config=CFG,
                     main_grads=[torch.zeros(p.shape) for p in ws + sh])
    from mok_cute.layers import select

    class NoGate:  # a backend without the gate
        name, shared_gate = "no-gate", False

    monkeypatch.setattr(select, "get_backend", lambda name: NoGate())
    with pytest.raises(NotImplementedError, match="shared_gate.*'no-gate'"):
        mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), shared_gate=w_sg, config=CFG)


def test_gpu_backends_refuse_the_gate_at_ep_above_one():
    """sm90 / sm100 run the gate at EP = 1 only (no path of their tables takes it at EP > 1): at
    EP > 1 their check raises before any kernel, naming the gate and the EP."""
    from mok_cute.comm.virtual import VirtualGroup, run_ranks
    from mok_cute.layers.select import MoEInputs, get_backend

    x, idx, w, ws, sh, w_sg, _ = _problem(3, h=256, inter=256)
    inp = MoEInputs(x, idx, w, *ws, tuple(sh), None, w_sg)
    group = VirtualGroup(2)

    def rank(r):
        for arch in ("sm90", "sm100"):
            with pytest.raises(NotImplementedError, match=f"'{arch}': EP > 1.*shared_gate"):
                get_backend(arch).check(inp, MoKConfig(backend=arch, forward_path="fused"), group)
        with pytest.raises(NotImplementedError, match="'sm90': EP > 1.*shared_gate.*no default forward path"):
            get_backend("sm90").check(inp, MoKConfig(backend="sm90"), group)
        return True

    assert run_ranks(group, rank) == [True, True]


def test_layer_shared_output_gate():
    """MoELayer(shared_output_gate=True): a zero [1, H] bf16 gate (g = 0.5) that trains, in the
    main_grad buffers too; without the shared expert it is refused."""
    torch.manual_seed(0)
    layer = MoELayer(64, 64, 4, 2, shared_intermediate_size=64, shared_output_gate=True, config=CFG)
    assert layer.shared_gate.shape == (1, 64) and layer.shared_gate.dtype == torch.bfloat16
    assert not layer.shared_gate.any()
    x = torch.randn(16, 64).bfloat16()
    layer(x).float().square().sum().backward()
    assert layer.shared_gate.grad is not None and layer.shared_gate.grad.abs().sum() > 0
    acc = MoELayer(64, 64, 4, 2, shared_intermediate_size=64, shared_output_gate=True, accumulate_main_grad=True,
                   config=CFG)
    acc.load_state_dict(layer.state_dict())
    acc(x).float().square().sum().backward()
    assert acc.shared_gate.grad is None and acc.shared_gate.main_grad.dtype == torch.float32
    assert torch.equal(acc.shared_gate.main_grad.bfloat16(), layer.shared_gate.grad)
    with pytest.raises(ValueError, match="shared_output_gate"):
        MoELayer(64, 64, 4, 2, shared_output_gate=True, config=CFG)


def test_grouped_backend_glue_with_the_gate_is_the_reference():
    """The GPU backends' layer glue (``layers/grouped.py``, unfused path at EP = 1) with the gate,
    over the reference expert MLP: y, dx, every weight gradient and the gate's fp32 gradient
    bitwise the reference layer's (the glue runs the reference's gate ops); d topk_w to fp32
    rounding (route_grad sums in fp32, the reference in fp64)."""
    from dataclasses import dataclass

    from mok_cute.layers.grouped import GroupedExpertBackend
    from mok_cute.layers.select import MoEInputs

    @dataclass
    class Group:
        x: torch.Tensor
        offsets: torch.Tensor
        saved: tuple

    class RefMLP:  # the reference expert MLP in the sm90 row of the path table (on CPU tensors: unfused)
        arch, dim_multiple, precisions, strided_weights = "sm90", {"bf16": 64}, ("bf16",), True

        def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit):
            m = int(offsets[-1])
            out, saved = reference.experts_forward(x_rows[:m], offsets.tolist(), w_gate, w_up, w_down, limit, "bf16")
            full = torch.full((x_rows.shape[0], out.shape[1]), float("nan"), dtype=out.dtype)
            full[:m] = out
            return full, Group(x_rows, offsets, (saved, m))

        def backward(self, g, dy_rows, w_gate, w_up, w_down, limit, fused, config=None):
            assert not fused  # the unfused path: the MLP's separate kernels
            saved, m = g.saved
            dx, *dw = reference.experts_backward(saved, dy_rows[:m], w_gate, w_up, w_down, limit, "bf16")
            full = torch.zeros((dy_rows.shape[0], dx.shape[1]), dtype=dx.dtype)
            full[:m] = dx
            return (full, *dw)

    x, idx, w, ws, sh, w_sg, dy = _problem(4)
    backend = GroupedExpertBackend(RefMLP())
    y, st = backend.forward(MoEInputs(x, idx, w, *ws, tuple(sh), 4.0, w_sg), CFG, None)
    got = backend.backward(st, dy)
    y_ref, saved = reference.moe_forward(x, idx, w, *ws, tuple(sh), 4.0, "bf16", None, w_sg)
    want = reference.moe_backward(saved, dy)
    assert torch.equal(y, y_ref) and torch.equal(got.dx, want.dx)
    for a, b in zip((got.d_w_gate, got.d_w_up, got.d_w_down, *got.d_shared, got.d_shared_gate),
                    (want.d_w_gate, want.d_w_up, want.d_w_down, *want.d_shared, want.d_shared_gate)):
        assert torch.equal(a, b)
    torch.testing.assert_close(got.d_topk_w, want.d_topk_w.float(), rtol=1e-5, atol=1e-6)

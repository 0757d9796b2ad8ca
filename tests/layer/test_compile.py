"""torch.compile of models calling the layer (the ``mok_cute::moe_fwd`` / ``moe_bwd`` custom ops,
:mod:`mok_cute.custom_ops`) on the CPU with the reference backend: ``fullgraph=True`` traces with
no graph break, and forward and every gradient are bitwise the eager ones; the state table keeps
nothing without a backward to come."""
from __future__ import annotations

import gc

import pytest
import torch

import mok_cute
from mok_cute import MoKConfig, MoELayer, custom_ops

CFG = MoKConfig(backend="reference")


def _layer(**kw):
    torch.manual_seed(0)
    return MoELayer(64, 64, 4, 2, shared_intermediate_size=64, config=CFG, **kw)


def _step(model, x):
    for p in model.parameters():
        p.grad = None
    xl = x.clone().requires_grad_()
    y = model(xl)
    y.float().square().sum().backward()
    return [y, xl.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("gate", [False, True])
def test_layer_with_router_compiles_fullgraph_bitwise(gate):
    """MoELayer with its router (topk, softmax) and shared expert (and output gate), compiled whole
    (aot_eager: the graph as traced), forward and backward: bitwise the eager step."""
    model = _layer(shared_output_gate=gate)
    with torch.no_grad():
        if gate:
            model.shared_gate.normal_(0, 0.1)
    x = torch.randn(32, 64).bfloat16()
    eager = _step(model, x)
    compiled = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), x)
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_external_routing_compiles_with_inductor_bitwise():
    """The default backend (inductor) around the layer's ops: fullgraph, the layer's output and
    every gradient (main_grads too) bitwise eager. Only our ops' results are compared, never a
    torch reduction of them (inductor may reorder a float sum, per CPU)."""
    model = _layer(router=False, accumulate_main_grad=True)
    x = torch.randn(16, 64).bfloat16()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 4, (16, 2), generator=g)
    w = torch.rand(16, 2, generator=g).requires_grad_()
    dy = torch.randn(16, 64, generator=g).bfloat16()

    def fn(x, w):
        return model(x, idx, w)

    out = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        for p in model.parameters():
            p.main_grad.zero_()
        w.grad = None
        y = f(x, w)
        y.backward(dy)
        out.append([y, w.grad.clone()] + [p.main_grad.clone() for p in model.parameters()])
    for a, b in zip(*out):
        assert torch.equal(a, b)
    assert any(m.abs().sum() > 0 for m in out[0][2:])


def test_state_table_keeps_nothing_without_a_backward():
    """The custom ops' state table: nothing without ``keep``; a kept state goes with its handle
    tensor (a graph dropped before its backward) or with the backward that takes it."""
    x = torch.randn(8, 64).bfloat16()
    idx = torch.zeros(8, 2, dtype=torch.int64)
    tw = torch.rand(8, 2)
    ws = [torch.randn(4, 64, 64).bfloat16() for _ in range(3)]

    def fwd(keep):
        return torch.ops.mok_cute.moe_fwd(x, idx, tw, ws, [], None, custom_ops.config_key(CFG), 0, keep, 1.0, 0.0, False)

    gc.collect()
    n0 = len(custom_ops._STATES)
    fwd(False)
    assert len(custom_ops._STATES) == n0
    _, handle = fwd(True)
    assert len(custom_ops._STATES) == n0 + 1
    del handle
    gc.collect()
    assert len(custom_ops._STATES) == n0
    _, handle = fwd(True)
    torch.ops.mok_cute.moe_bwd(torch.randn_like(x), handle, x, tw, ws, [], False)
    assert len(custom_ops._STATES) == n0


def test_ops_are_registered_with_fake_implementations():
    """The fake implementations give the real outputs' shapes and dtypes (what torch.compile traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(8, 64).bfloat16()
    idx = torch.zeros(8, 2, dtype=torch.int64)
    tw = torch.rand(8, 2)
    ws = [torch.randn(4, 64, 64).bfloat16() for _ in range(3)]
    args = (x, idx, tw, ws, [], None, custom_ops.config_key(CFG), 0, True, 1.0, 0.0, False)
    y, handle = torch.ops.mok_cute.moe_fwd(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fy, fh = torch.ops.mok_cute.moe_fwd(*args)
        grads = torch.ops.mok_cute.moe_bwd(torch.empty_like(x), fh, x, tw, ws, [], False)
    assert (fy.shape, fy.dtype, fh.shape, fh.dtype) == (y.shape, y.dtype, handle.shape, handle.dtype)
    real = torch.ops.mok_cute.moe_bwd(torch.randn_like(x), handle, x, tw, ws, [], False)
    assert [(g.shape, g.dtype) for g in grads] == [(g.shape, g.dtype) for g in real] and len(real) == 12
    with pytest.raises(RuntimeError, match="forward state is gone"):
        torch.ops.mok_cute.moe_bwd(torch.randn_like(x), handle, x, tw, ws, [], False)


def test_compiled_calls_take_the_custom_ops(monkeypatch):
    """Under torch.compile the layer is the custom ops (the eager autograd.Function is not traced):
    with the Function disabled the compiled step still runs, bitwise the eager one."""
    model = _layer()
    x = torch.randn(16, 64).bfloat16()
    eager = _step(model, x)

    def no_function(*a, **k):
        raise AssertionError("MoEFunction used under torch.compile")

    monkeypatch.setattr(custom_ops.MoEFunction, "apply", no_function)
    compiled = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), x)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_expert_mlp_compiles_fullgraph_bitwise():
    """mok_cute.expert_mlp (rows already grouped) under torch.compile (inductor, fullgraph): the
    mok_cute::expert_mlp_fwd / _bwd ops, their output (the rows of the experts) and the gradients
    bitwise the eager call's. A loss summed by torch is not compared: inductor may reorder that
    float reduction, differently per CPU (171.0701 eager vs 171.0700 compiled, seen on another
    x86-64 machine); the gradient fed back is a fixed tensor, not a torch-computed one."""
    g = torch.Generator().manual_seed(3)
    e, i, h = 4, 64, 64
    x = torch.randn(40, h, generator=g).bfloat16()
    offsets = torch.tensor([0, 10, 10, 25, 33], dtype=torch.int32)
    ws = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((e, i, h), (e, i, h), (e, h, i))]
    d_out = torch.randn(33, h, generator=g).bfloat16()

    def fn(x, *ws):
        return mok_cute.ops.expert_mlp(x, offsets, *ws, swiglu_limit=4.0, config=CFG)[:33]  # rows past 33: unspecified

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in ws]
        out = f(*leaves)
        out.backward(d_out)
        results.append([out] + [p.grad for p in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)

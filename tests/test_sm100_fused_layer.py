"""The sm100 backend's fused forward in the layer (issue 15), on CPU: no Blackwell GPU exists
here, so the kernel never runs.

* opt-in: ``MOK_CUTE_SM100_FUSED=1`` (read at every call) makes BF16 a fused precision;
* ``Sm100ExpertMLP.fused_forward`` passes the config's comm CTAs, timeout and ring to
  :func:`mok_cute.kernels.sm100.fused_moe.fused_forward`, watches its status word and returns
  the seven outputs the layer reads;
* the layer's fused glue (state with route-order rows, x gathered again by the backward) over
  a torch model of the kernel's contract (the unfused sm100 wrappers with their launches
  modelled: ``test_sm100_tails.model``) gives y and every gradient bitwise the reference's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import make_problem
from mok_cute import reference as R
from mok_cute.config import MoKConfig
from mok_cute.layers import select as B
from mok_cute.layers.common import ring_chunks
from mok_cute.layers.grouped import routing_plan
from mok_cute.layers.sm100 import Sm100ExpertMLP
from test_sm100_mxfp8 import ref_quant  # noqa: F401 (fixture of the model fixture)
from test_sm100_tails import assert_reference_layer, model  # noqa: F401 (model: fixture)


def test_opt_in(monkeypatch):
    monkeypatch.delenv("MOK_CUTE_SM100_FUSED", raising=False)
    assert Sm100ExpertMLP().fused_precisions == ()
    with pytest.raises(ValueError, match="mxfp8"):
        Sm100ExpertMLP().fused_forward(*[None] * 10, MoKConfig(precision="mxfp8"))
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert Sm100ExpertMLP().fused_precisions == ("bf16", "mxfp8")


def test_ring_chunks_counts_the_kernels_chunks():
    from mok_cute.kernels.sm90.fused_moe import CHUNK

    idx = torch.zeros(7, 10, dtype=torch.int32)
    for mb in (256, 512, 4096):
        assert ring_chunks(MoKConfig(minibatch_tokens=mb), idx) == -(-mb * 10 // CHUNK)


def test_interleaved_weights_cached_per_version():
    from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

    mlp = Sm100ExpertMLP()
    wg, wu = torch.randn(3, 192, 64).bfloat16(), torch.randn(3, 192, 64).bfloat16()
    first = mlp._interleaved(wg, wu, 128)
    assert torch.equal(first, interleave_gate_up(wg, wu, 128))
    assert mlp._interleaved(wg, wu, 128) is first  # unchanged weights: no new copy
    with torch.no_grad():
        wu.add_(1.0)  # an optimizer step: version bump
    again = mlp._interleaved(wg, wu, 128)
    assert again is not first and torch.equal(again, interleave_gate_up(wg, wu, 128))


def _mx_expert(x, rows, offsets, w_gate, w_up, w_down, limit, scales, interleave):
    """The MXFP8 kernel's contract for one set of experts on the unfused sm100 wrappers: x's MXFP8
    token rows (quantized once, then gathered by ``rows``), the given e4m3 weights and scales,
    GEMM1 + SwiGLU, h quantized along I, GEMM2: ``(out, gu, h)``."""
    from mok_cute.kernels.quant import quantize
    from mok_cute.kernels.sm100 import grouped_gemm as k_

    xq, xs = quantize.quantize_mxfp8(x, -1)
    gu, h = k_.grouped_gemm1_swiglu(xq[rows], offsets, w_gate, w_up, limit, x_scales=xs[rows], w_scales=scales[:2],
                                    interleave=interleave)
    hq, hs = quantize.quantize_mxfp8(h, -1)
    return k_.grouped_gemm(hq, offsets, w_down, a_scales=hs, w_scales=scales[2]), gu, h


def _kernel_model(mlp):
    """A torch model of ``fused_moe.fused_forward``'s contract on the unfused sm100 wrappers (BF16:
    the MLP's forward on the gathered rows; MXFP8: :func:`_mx_expert` on what the layer hands it)."""
    calls = []

    def fused_forward(x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, comm_ctas,
                      timeout_s, num_ctas=None, ring_chunks=None, gate=None, interleave=None, w_scales=None,
                      shared_scales=None):
        calls.append(dict(comm_ctas=comm_ctas, timeout_s=timeout_s, ring_chunks=ring_chunks, gate=gate,
                          interleave=interleave == mlp._interleaved, mx=w_scales is not None))
        t, k = topk_idx.shape
        rows = order.long() // k
        whole = torch.tensor([0, t], dtype=torch.int32)
        if w_scales is None:
            out, g = mlp.forward(x.index_select(0, rows), offsets, w_gate, w_up, w_down, limit)
            gu, h = g.gu, g.h
        else:
            out, gu, h = _mx_expert(x, rows, offsets, w_gate, w_up, w_down, limit, w_scales, interleave)
        m = int(offsets[-1])
        slot = torch.full((t * k, x.shape[1]), float("nan"), dtype=torch.bfloat16)  # -1 slots: never written
        slot[order[:m].long()] = out[:m]
        gus = hs = s_out = None
        acc = torch.zeros(x.shape, dtype=torch.float32)
        if shared is not None:
            if w_scales is None:
                s_out, sg = mlp.forward(x, whole, *(w[None] for w in shared), limit)
                gus, hs = sg.gu, sg.h
            else:
                s_out, gus, hs = _mx_expert(x, torch.arange(t), whole, *(w[None] for w in shared), limit,
                                            [s[None] for s in shared_scales], interleave)
            acc = s_out.float()
        y = R.slot_sum(acc, slot.view(t, k, -1), topk_idx, topk_w).bfloat16()
        status = torch.zeros(4, dtype=torch.int32)
        return y, gu, h, slot, gus, hs, s_out, [status], None

    return fused_forward, calls


def _core_model(calls):
    """A torch model of ``fused_bwd.fused_backward_core``'s contract on the unfused sm100 wrappers:
    the unfused backward (MXFP8, ``w_scales`` given: :func:`~mok_cute.layers.sm100.mx_backward` on
    the given quantized weights), with ``tokens`` the rows scattered by ``order`` and the reference
    slot sum from fp32(dx_shared) [+ dx_add]; ``calls`` gets ``(tokens?, dx_shared?, dx_add?, mx?)``."""
    from mok_cute.kernels.sm100 import grouped_gemm as k_
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    def core(dy, x, gu, h, offsets, w_gate, w_up, w_down, lim, timeout_s, num_ctas=None, tokens=None,
             w_scales=None, consume=False):
        m = dy.shape[0]
        calls.append((tokens is not None, tokens is not None and tokens[2] is not None,
                      tokens is not None and tokens[3] is not None, w_scales is not None))
        if w_scales is None:
            dxr, dwg, dwu, dwd = S.mlp_backward(k_.grouped_dswiglu_dgrad, k_.grouped_dgrad1, k_.grouped_wgrad,
                                                ExpertGroup(x, offsets, gu[:m], h[:m]), dy, w_gate, w_up, w_down, lim)
        else:
            given = {id(w): (w, s) for w, s in zip((w_gate, w_up, w_down), w_scales)}
            dxr, dwg, dwu, dwd = S.mx_backward(k_, ExpertGroup(x, offsets, gu[:m], h[:m], "mxfp8"), dy, w_gate, w_up,
                                               w_down, lim, lambda w, axis: given[id(w)])
        if tokens is None:
            return dxr, dwg, dwu, dwd
        order, topk_idx, dxs, dxa = tokens
        t, k = topk_idx.shape
        slot = torch.zeros((t * k, dy.shape[1]), dtype=torch.bfloat16)
        slot[order[:m].long()] = dxr[:m]
        acc = torch.zeros((t, dy.shape[1])) if dxs is None else dxs.float()
        if dxa is not None:
            acc = acc + dxa
        return R.slot_sum(acc, slot.view(t, k, -1), topk_idx).bfloat16(), dwg, dwu, dwd

    return core


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_fused_glue_equals_reference(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's fused forward glue, BF16 and MXFP8 (weights quantized and cached by the MLP, the
    forward's state what the backward reads), over the kernel model; at MXFP8 the backward is the
    fused core (its mx variant, over :func:`_core_model`): y and every gradient bitwise the
    reference's."""
    from mok_cute.kernels.sm100 import fused_bwd, fused_moe
    from mok_cute.kernels.sm90 import fused_moe as fm90
    from mok_cute.layers import sm100 as S

    be = B.get_backend("sm100")
    fake, calls = _kernel_model(be.mlp)
    watched = []
    monkeypatch.setattr(fused_moe, "fused_forward", fake)
    monkeypatch.setattr(fm90, "watch_status", lambda st, first: watched.append(first))
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    p, dy = make_problem(T=40, H=192, I=320, E=5, k=3, shared_I=shared_i, seed=23)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    p["topk_idx"][3, 1] = -1
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)
    cfg = MoKConfig(comm_sms_fwd=12, device_timeout_s=3.0, minibatch_tokens=512, precision=precision)
    be.check(inp, cfg, None)
    order32, offsets, idx = routing_plan(inp.topk_idx, 5, watch=False)
    y, st = be._fused_forward(inp, cfg, order32, order32.long(), offsets, idx, idx.reshape(-1) >= 0)
    assert calls == [dict(comm_ctas=cfg.comm_ctas_fwd(1), timeout_s=3.0, ring_chunks=ring_chunks(cfg, idx), gate=None,
                          interleave=True, mx=precision == "mxfp8")]  # the MLP's cached interleave
    assert watched == [cfg.validate_routing]
    assert st.rows_by_route and st.routed.x is None  # the backward gathers x's rows again
    assert st.routed.precision == precision and st.routed.gu.dtype == st.routed.h.dtype == torch.bfloat16
    core_calls = []
    if precision == "mxfp8":  # opted in, operands it takes: the MXFP8 core
        monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: True)  # CPU tensors stand in for CUDA ones
        monkeypatch.setattr(fused_bwd, "fused_backward_core", _core_model(core_calls))
    assert_reference_layer(p, dy, limit, y, be.backward(st, dy), precision)
    assert all(c[3] for c in core_calls) and len(core_calls) == (precision == "mxfp8") * (1 + (shared_i is not None))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_unfused_forward_interleaves_once_per_weight_version(model, monkeypatch, precision):  # noqa: F811
    """The unfused sm100 layer's GEMM1 reads the MLP's cached interleave: two forwards with the
    same weights build it once (weights, and at MXFP8 their scales), an update rebuilds it."""
    from mok_cute.kernels.sm100 import grouped_gemm as k

    built = []
    real = k.interleave_gate_up
    monkeypatch.setattr(k, "interleave_gate_up", lambda g, u, half: built.append(g.dtype) or real(g, u, half))
    be = B.get_backend("sm100")
    be.mlp.weights = type(be.mlp.weights)()  # a fresh cache
    p, dy = make_problem(T=24, H=192, I=320, E=3, k=2, seed=4)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    for _ in range(2):
        be.forward(inp, MoKConfig(precision=precision), None)
    per_build = 1 if precision == "bf16" else 2  # MXFP8: the e4m3 data and the E8M0 scales
    assert len(built) == per_build
    with torch.no_grad():
        p["w_up"].mul_(0.5)
    be.forward(inp, MoKConfig(precision=precision), None)
    assert len(built) == 2 * per_build


def test_backward_takes_the_fused_core_when_opted_in(monkeypatch, ref_quant):  # noqa: F811
    """With MOK_CUTE_SM100_FUSED=1 a BF16 or MXFP8 backward is one fused_backward_core call on the
    group's operands (MXFP8: the cached quantized weights and their scales; the kernel faked);
    without it the unfused kernels run."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", lambda *a: calls.append(a) or "fused")
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: True)  # CPU tensors stand in for CUDA ones
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 64).bfloat16()
    g = ExpertGroup(x, torch.tensor([0, 6]), torch.randn(6, 128).bfloat16(), torch.randn(6, 64).bfloat16())
    w = (torch.randn(1, 64, 64).bfloat16(),) * 3
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert Sm100ExpertMLP().backward(g, dy, *w, 4.0) == "fused"
    (args,) = calls
    assert args[0] is dy and args[1] is x and args[2] is g.gu and args[3] is g.h and args[4].dtype == torch.int32
    assert args[5:9] == (*w, 4.0) and args[9] == S.FUSED_BWD_TIMEOUT_S
    monkeypatch.setattr(S, "mlp_backward", lambda *a: "unfused")
    monkeypatch.setattr(S, "mx_backward", lambda *a: "unfused mxfp8")
    monkeypatch.setattr(fused_bwd, "fused_backward_core", lambda *a, **kw: calls.append((a, kw)) or "fused mxfp8")
    mlp = Sm100ExpertMLP()
    assert mlp.backward(replace(g, precision="mxfp8"), dy, *w, 4.0) == "fused mxfp8"
    a, kw = calls[1]  # the weights quantized along their rows' K (axis 1), as mx_backward's, cached
    want = [mlp._qw(t, 1) for t in w]
    assert all(x is q for x, (q, _) in zip(a[5:8], want)) and a[8] == 4.0
    assert kw.keys() == {"w_scales"} and all(x is s for x, (_, s) in zip(kw["w_scales"], want))
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "0")
    assert Sm100ExpertMLP().backward(g, dy, *w, 4.0) == "unfused"
    assert Sm100ExpertMLP().backward(replace(g, precision="mxfp8"), dy, *w, 4.0) == "unfused mxfp8"
    assert len(calls) == 2


def test_backward_tokens_takes_the_fused_core_when_opted_in(monkeypatch, ref_quant):  # noqa: F811
    """With MOK_CUTE_SM100_FUSED=1 a BF16 / MXFP8 ``backward_tokens`` is one fused_backward_core
    call with ``tokens`` (MXFP8: and ``w_scales``; the kernel faked); None (the layer then runs
    ``backward``) without the opt-in, at other precisions, for operands the core does not take or
    a non-contiguous dx_shared / dx_add."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", lambda *a, **kw: calls.append((a, kw)) or "fused")
    ok = [True]
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: ok[0])  # CPU tensors stand in for CUDA ones
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 64).bfloat16()
    g = ExpertGroup(x, torch.tensor([0, 6]), torch.randn(6, 128).bfloat16(), torch.randn(6, 64).bfloat16())
    w = (torch.randn(1, 64, 64).bfloat16(),) * 3
    order, idx = torch.arange(6), torch.zeros(3, 2, dtype=torch.int32)
    dxs, dxa = torch.randn(3, 64).bfloat16(), torch.randn(3, 64)
    mlp = S.Sm100ExpertMLP()
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert mlp.backward_tokens(g, dy, *w, 4.0, order, idx, dxs, dxa) == "fused"
    ((args, kw),) = calls
    assert args[0] is dy and args[1] is x and args[2] is g.gu and args[3] is g.h and args[4].dtype == torch.int32
    assert args[5:9] == (*w, 4.0) and args[9] == S.FUSED_BWD_TIMEOUT_S
    assert kw.keys() == {"tokens", "consume"} and all(a is b for a, b in zip(kw["tokens"], (order, idx, dxs, dxa)))
    assert mlp.backward_tokens(g, dy, *w, None, order, idx, None, consume=True) == "fused"
    assert calls[1][1]["tokens"][2:] == (None, None) and calls[1][1]["consume"] and not kw["consume"]
    assert mlp.backward_tokens(replace(g, precision="mxfp8"), dy, *w, 4.0, order, idx, dxs) == "fused"
    assert calls[2][1].keys() == {"tokens", "consume", "w_scales"} and calls[2][0][5].dtype == torch.float8_e4m3fn
    assert mlp.backward_tokens(replace(g, precision="fp8"), dy, *w, 4.0, order, idx, dxs) is None
    assert mlp.backward_tokens(g, dy, *w, 4.0, order, idx, torch.randn(64, 3).bfloat16().t()) is None
    assert mlp.backward_tokens(g, dy, *w, 4.0, order, idx, dxs, torch.randn(64, 3).t()) is None
    ok[0] = False
    assert mlp.backward_tokens(g, dy, *w, 4.0, order, idx, dxs) is None
    ok[0] = True
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "0")
    assert mlp.backward_tokens(g, dy, *w, 4.0, order, idx, dxs) is None
    assert len(calls) == 3



@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_mode2_backward_through_backward_tokens(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's mode-2 backward (``MOK_CUTE_FUSED_BWD=2``) on the sm100 backend, opted in, calls
    ``backward_tokens`` (BF16 and MXFP8); over :func:`_core_model` (the contract of
    ``fused_backward_core(tokens=...)``) every gradient is bitwise the reference's."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S

    be = B.get_backend("sm100")
    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", _core_model(calls))
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: True)  # CPU tensors stand in for CUDA ones
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "0")  # the unfused forward; the backward opts in below
    monkeypatch.setenv("MOK_CUTE_FUSED_BWD", "2")
    p, dy = make_problem(T=40, H=192, I=320, E=5, k=3, shared_I=shared_i, seed=29)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    p["topk_idx"][3, 1] = -1
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)
    y, st = be.forward(inp, MoKConfig(precision=precision), None)
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    grads = be.backward(st, dy)
    mx = precision == "mxfp8"
    routed = (True, shared_i is not None, False, mx)
    assert sorted(calls) == sorted([routed] + [(False, False, False, mx)] * (shared_i is not None))  # + the shared
    assert_reference_layer(p, dy, limit, y, grads, precision)


def test_ep_is_opt_in(monkeypatch):
    """EP > 1 on the sm100 backend only with ``MOK_CUTE_SM100_FUSED=1`` (``expert_parallel``,
    ``ep_precisions`` read by ``GroupedExpertBackend.check``): refused before any kernel without it."""
    from mok_cute.layers import grouped

    monkeypatch.setattr(grouped, "_world", lambda group: (2, 0))
    be = B.get_backend("sm100")
    p, _ = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    monkeypatch.delenv("MOK_CUTE_SM100_FUSED", raising=False)
    assert not be.mlp.expert_parallel and be.mlp.ep_precisions == ()
    with pytest.raises(NotImplementedError, match="EP > 1"):
        be.check(inp, MoKConfig(), "group")
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert be.mlp.expert_parallel and be.mlp.ep_precisions == ("bf16", "mxfp8")
    for precision in ("bf16", "mxfp8"):
        be.check(inp, MoKConfig(precision=precision), "group")
    assert hasattr(be.mlp, "backward_fused_ep")  # layers.ep's backward: the fused EP launch (BF16)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i", [64, None])
def test_fused_forward_ep_hands_the_plan_and_workspace(monkeypatch, ref_quant, precision, shared_i):  # noqa: F811
    """``Sm100ExpertMLP.fused_forward_ep`` (the sm90 MLP's contract): one ``fused_moe.fused_forward``
    call with the plan's packed sources and offsets, int32 topk_idx, the workspace, the EP comm CTAs,
    the timeout, the ring, the grid, the MLP's cached interleave and (MXFP8) its cached row-quantized
    weights and scales; returns ``(y, gu, h, slot_out, gus, hs, w_rows)``; refused unless opted in."""
    from types import SimpleNamespace

    from mok_cute.kernels.sm100 import fused_moe

    calls = []
    out = tuple(f"out{i}" for i in range(9))
    monkeypatch.setattr(fused_moe, "fused_forward", lambda *a, **kw: calls.append((a, kw)) or out)
    mlp = Sm100ExpertMLP()
    p, _ = make_problem(T=24, H=64, I=64, E=2, k=2, shared_I=shared_i, seed=3)
    plan = SimpleNamespace(recv_src=torch.arange(96, dtype=torch.int32), offsets=torch.tensor([0, 40, 70]).int())
    ws = SimpleNamespace(EP=2)
    cfg = MoKConfig(precision=precision, comm_sms_fwd=None, device_timeout_s=2.5, minibatch_tokens=256)
    idx = p["topk_idx"].long()
    args = (ws, plan, p["x"], idx, p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], 4.0, cfg)
    monkeypatch.delenv("MOK_CUTE_SM100_FUSED", raising=False)
    with pytest.raises(ValueError, match="fused forward runs"):
        mlp.fused_forward_ep(*args, num_ctas=66)
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert mlp.fused_forward_ep(*args, num_ctas=66) == (*out[:6], out[8])
    ((a, kw),) = calls
    assert a[0] is p["x"] and a[1] is plan.recv_src and a[2] is plan.offsets and a[4] is p["topk_w"]
    assert a[3].dtype == torch.int32 and torch.equal(a[3], idx.int())
    assert a[9:] == (4.0, cfg.comm_ctas_fwd(2), 2.5) and cfg.comm_ctas_fwd(2) != cfg.comm_ctas_fwd(1)
    assert kw["ws"] is ws and kw["num_ctas"] == 66 and kw["ring_chunks"] == ring_chunks(cfg, idx)
    assert kw["interleave"] == mlp._interleaved and "gate" not in kw
    if precision == "bf16":
        assert a[5:9] == (p["w_gate"], p["w_up"], p["w_down"], p["shared"]) and "w_scales" not in kw
        return
    want = [mlp._qw(w, 2) for w in (p["w_gate"], p["w_up"], p["w_down"])]  # cached: the same tensors
    assert all(x is q for x, (q, _) in zip(a[5:8], want)) and all(x is s for x, (_, s) in zip(kw["w_scales"], want))
    if shared_i is None:
        assert a[8] is None and "shared_scales" not in kw
    else:
        qs = [mlp._qw(w[None], 2) for w in p["shared"]]
        assert all(torch.equal(x.view(torch.uint8), q[0].view(torch.uint8)) for x, (q, _) in zip(a[8], qs))
        assert all(torch.equal(x, s[0]) for x, (_, s) in zip(kw["shared_scales"], qs))


def _fused_backward_model(calls):
    """A torch model of ``fused_bwd.fused_backward``'s contract (mode 3) on the unfused sm100 wrappers:
    the route_grad pass (its torch mirror), x's rows gathered by ``order``, the shared expert's
    unfused backward (its dx the slot sum's start) and :func:`_core_model` with ``tokens``; with
    ``main_grads`` the weight gradients are added there in fp32 and returned as None (the kernel's
    contract); MXFP8 (``w_scales``): the core model's MXFP8 backward on the gathered bf16 rows (what the
    kernel's comm CTAs quantize); ``calls`` gets what the layer handed it."""
    from mok_cute.kernels import route_grad
    from mok_cute.kernels.sm100 import grouped_gemm as k_
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    core = _core_model([])

    def fused_backward(dy, x, r_rows, order, topk_w, topk_idx, offsets, gu, h, w_gate, w_up, w_down, limit, dx_shared,
                       rows_by_route, comm_ctas=16, timeout_s=30.0, num_ctas=None, shared=None, main_grads=None,
                       w_scales=None):
        calls.append(dict(rows_by_route=rows_by_route, comm_ctas=comm_ctas, timeout_s=timeout_s,
                          shared=shared is not None, dx_shared=dx_shared is not None, offsets=offsets.dtype,
                          main_grads=None if main_grads is None else len(main_grads), mx=w_scales is not None))
        k = topk_idx.shape[1]
        order = order.long()
        dy_rows, dtw = route_grad.dy_rows_and_dtopk_w_torch(dy, r_rows, order, topk_w, offsets, rows_by_route)
        dws = ()
        if shared is not None:
            offs_s, gus, hs, *ws = shared
            dx_shared, *dws = S.mlp_backward(k_.grouped_dswiglu_dgrad, k_.grouped_dgrad1, k_.grouped_wgrad,
                                             ExpertGroup(x, offs_s, gus, hs), dy, *(w[None] for w in ws), limit)
            dws = tuple(d[0] for d in dws)
        m = int(offsets[-1])
        dx, dwg, dwu, dwd = core(dy_rows[:m], x.index_select(0, order[:m] // k), gu, h, offsets, w_gate, w_up, w_down,
                                 limit, timeout_s, tokens=(order, topk_idx, dx_shared, None), w_scales=w_scales)
        if main_grads is not None:
            for mg, d in zip(main_grads, (dwg, dwu, dwd, *dws)):
                mg.add_(d.float())
            return (dx, dtw, *(None,) * (3 + len(dws)))
        return (dx, dtw, dwg, dwu, dwd, *dws)

    return fused_backward


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_mode3_backward_through_backward_fused(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's mode-3 backward (``MOK_CUTE_FUSED_BWD=3``) after the fused forward, opted in: one
    ``backward_fused`` -> ``fused_bwd.fused_backward`` call with the forward's route-order rows, the
    shared expert's group in the same launch (MXFP8: its backward first, its dx the launch's
    ``dx_shared``, the quantized weights and their scales) and the config's backward comm CTAs; over
    :func:`_fused_backward_model` y and every gradient are bitwise the reference's, and with
    ``main_grads`` those are added in fp32 (the shared expert's, at MXFP8, by the caller)."""
    from mok_cute.kernels.sm100 import fused_bwd, fused_moe
    from mok_cute.kernels.sm90 import fused_moe as fm90
    from mok_cute.layers import sm100 as S

    be = B.get_backend("sm100")
    fake, _ = _kernel_model(be.mlp)
    calls = []
    monkeypatch.setattr(fused_moe, "fused_forward", fake)
    monkeypatch.setattr(fm90, "watch_status", lambda st, first: None)
    monkeypatch.setattr(fused_bwd, "fused_backward", _fused_backward_model(calls))
    monkeypatch.setattr(fused_bwd, "fused_backward_core", _core_model([]))  # MXFP8: the shared expert's backward
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: True)  # CPU tensors stand in for CUDA ones
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    monkeypatch.setenv("MOK_CUTE_FUSED_BWD", "3")
    p, dy = make_problem(T=40, H=192, I=320, E=5, k=3, shared_I=shared_i, seed=31)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    p["topk_idx"][3, 1] = -1
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)
    cfg = MoKConfig(comm_sms_fwd=12, comm_sms_bwd=20, minibatch_tokens=512, precision=precision)
    be.check(inp, cfg, None)
    order32, offsets, idx = routing_plan(inp.topk_idx, 5, watch=False)
    y, st = be._fused_forward(inp, cfg, order32, order32.long(), offsets, idx, idx.reshape(-1) >= 0)
    grads = be.backward(st, dy)
    mx = precision == "mxfp8"
    assert calls == [dict(rows_by_route=True, comm_ctas=20, timeout_s=S.FUSED_BWD_TIMEOUT_S,
                          shared=shared_i is not None and not mx, dx_shared=shared_i is not None and mx,
                          offsets=torch.int32, main_grads=None, mx=mx)]
    assert_reference_layer(p, dy, limit, y, grads, precision)
    # main_grads: the launch adds the weight gradients (the caller gets None for them), dx as before
    weights = [p["w_gate"], p["w_up"], p["w_down"], *(p["shared"] or ())]
    start = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(weights)]
    main = [m.clone() for m in start]
    y2, st = be._fused_forward(inp, cfg, order32, order32.long(), offsets, idx, idx.reshape(-1) >= 0)
    acc = be.backward(st, dy, main)
    assert calls[-1]["main_grads"] == (3 if mx else len(weights)) and torch.equal(y2, y)
    assert torch.equal(acc.dx, grads.dx)
    fresh = [grads.d_w_gate, grads.d_w_up, grads.d_w_down, *(grads.d_shared or ())]
    assert acc.d_w_gate is None and acc.d_w_up is None and acc.d_w_down is None
    if mx and shared_i is not None:  # the shared expert ran before the launch: the caller adds its gradients
        assert all(torch.equal(a, b) for a, b in zip(acc.d_shared, grads.d_shared))
        main[3:] = [m + d.float() for m, d in zip(main[3:], acc.d_shared)]
    assert all(torch.equal(m, s0 + d.float()) for m, s0, d in zip(main, start, fresh))


def test_backward_fused_applies_only_when_opted_in(monkeypatch):
    """``backward_fused`` is None (the layer falls back) without the opt-in, for operands the launch
    does not take (not CUDA / contiguous, rows of other shapes, a strided shared w_down); else one
    ``fused_backward`` call returning ``(dx, d topk_w, dWg, dWu, dWd, d shared or None)``."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    ok = [True]
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: ok[0])
    t, k, h, i = 4, 2, 64, 64
    bf = torch.bfloat16
    g = ExpertGroup(None, torch.tensor([0, 5, 8]), torch.randn(8, 2 * i).to(bf), torch.randn(8, i).to(bf))
    sg = ExpertGroup(None, torch.tensor([0, t]), torch.randn(t, 2 * i).to(bf), torch.randn(t, i).to(bf))
    dy, x, r = torch.randn(t, h).to(bf), torch.randn(t, h).to(bf), torch.randn(t * k, h).to(bf)
    order, topk_w, idx = torch.arange(t * k), torch.rand(t, k), torch.zeros(t, k, dtype=torch.int32)
    w = (torch.randn(2, i, h).to(bf), torch.randn(2, i, h).to(bf), torch.randn(2, h, i).to(bf))
    sh = (torch.randn(i, h).to(bf), torch.randn(i, h).to(bf), torch.randn(h, i).to(bf))
    mlp = S.Sm100ExpertMLP()
    args = (g, dy, x, r, order, topk_w, idx, *w, 4.0, True)
    monkeypatch.delenv("MOK_CUTE_SM100_FUSED", raising=False)
    assert mlp.backward_fused(*args) is None
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert mlp.backward_fused(*args, comm_ctas=9) == (0, 1, 2, 3, 4, None)
    (a, kw), = calls
    assert a[:4] == (dy, x, r, order) and a[5] is idx and a[6].dtype == torch.int32 and a[7] is g.gu
    assert a[9:12] == w and a[12:16] == (4.0, None, True, 9) and kw == {"shared": None, "main_grads": None}
    assert mlp.backward_fused(*args, sg, sh) == (0, 1, 2, 3, 4, (5, 6, 7))
    assert calls[1][1]["shared"][1] is sg.gu and calls[1][1]["shared"][3:] == sh
    assert mlp.backward_fused(*args[:3], r[:7], *args[4:]) is None
    assert mlp.backward_fused(*args, sg, (sh[0], sh[1], torch.randn(i, h).to(bf).t())) is None
    # MXFP8: the quantized weights and their scales, the shared expert's backward first (its dx the launch's
    # dx_shared, its gradients returned), main_grads' routed three only
    dxs = _mx_stand_ins(monkeypatch, mlp, t, h)
    main = [torch.zeros(1)] * 6
    assert mlp.backward_fused(replace(g, precision="mxfp8"), *args[1:], sg, sh, main) == (0, 1, 2, 3, 4, "d shared")
    a, kw = calls[-1]
    assert a[9:12] == ("qg", "qu", "qd") and a[13] is dxs and kw == {"main_grads": main[:3], "w_scales": "scales"}
    ok[0] = False
    assert mlp.backward_fused(*args) is None
    assert len(calls) == 3


def _mx_stand_ins(monkeypatch, mlp, t: int, h: int):
    """CPU stand-ins for the MXFP8 launches' host steps: the quantized weights (``_core_weights``) and
    the shared expert's backward (``shared_backward``: its dx, returned, and "d shared")."""
    from mok_cute.layers import sm100 as S

    dxs = torch.randn(t, h).bfloat16()
    monkeypatch.setattr(mlp, "_core_weights", lambda g, *w: ("qg", "qu", "qd", {"w_scales": "scales"}))
    monkeypatch.setattr(S, "shared_backward", lambda m, group, dy, shared, limit: (dxs, "d shared"))
    return dxs


def test_backward_fused_ep_applies_only_when_opted_in(monkeypatch):
    """``backward_fused_ep`` (the sm90 MLP's contract) is None (layers.ep falls back to the unfused EP
    stages) without the opt-in, for operands the launch does not take (not CUDA / contiguous,
    a strided shared w_down); else one ``fused_backward_ep`` call with the workspace, the plan, this
    rank's slot rows as [T*k, H], the grouped rows' router weights, the comm CTAs and the grid, returning
    ``(dx, d topk_w, dWg, dWu, dWd, d shared or None)``."""
    from types import SimpleNamespace

    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_ep", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    ok = [True]
    monkeypatch.setattr(S, "_fused_core_ok", lambda g, dy: ok[0])
    t, k, h, i, m = 4, 2, 64, 64, 16
    bf = torch.bfloat16
    g = ExpertGroup(None, torch.tensor([0, 5, 8], dtype=torch.int32), torch.randn(m, 2 * i).to(bf),
                    torch.randn(m, i).to(bf))
    sg = ExpertGroup(None, torch.tensor([0, t]), torch.randn(t, 2 * i).to(bf), torch.randn(t, i).to(bf))
    ws, plan = object(), SimpleNamespace(recv_src=torch.arange(m, dtype=torch.int32), offsets=g.offsets)
    dy, x, slots = torch.randn(t, h).to(bf), torch.randn(t, h).to(bf), torch.randn(t, k, h).to(bf)
    w_rows, idx = torch.rand(m), torch.zeros(t, k, dtype=torch.int32)
    w = (torch.randn(2, i, h).to(bf), torch.randn(2, i, h).to(bf), torch.randn(2, h, i).to(bf))
    sh = (torch.randn(i, h).to(bf), torch.randn(i, h).to(bf), torch.randn(h, i).to(bf))
    mlp = S.Sm100ExpertMLP()
    args = (ws, plan, g, dy, x, slots, w_rows, idx, *w, 4.0)
    monkeypatch.delenv("MOK_CUTE_SM100_FUSED", raising=False)
    assert mlp.backward_fused_ep(*args) is None
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")
    assert mlp.backward_fused_ep(*args, comm_ctas=9, num_ctas=40) == (0, 1, 2, 3, 4, None)
    (a, kw), = calls
    assert a[:4] == (ws, plan, dy, x) and a[4].shape == (t * k, h) and a[4].data_ptr() == slots.data_ptr()
    assert a[5] is w_rows and a[6] is idx and a[7] is g.gu and a[8] is g.h and a[9:12] == w
    assert a[12:] == (4.0, 9, 40) and kw == {"shared": None}
    assert mlp.backward_fused_ep(*args, sg, sh) == (0, 1, 2, 3, 4, (5, 6, 7))
    assert calls[1][1]["shared"][1] is sg.gu and calls[1][1]["shared"][3:] == sh
    assert calls[1][1]["shared"][0].dtype == torch.int32
    assert mlp.backward_fused_ep(*args[:5], slots.transpose(0, 1), *args[6:]) is None
    assert mlp.backward_fused_ep(*args, sg, (sh[0], sh[1], torch.randn(i, h).to(bf).t())) is None
    dxs = _mx_stand_ins(monkeypatch, mlp, t, h)  # MXFP8: as backward_fused's
    assert mlp.backward_fused_ep(*args[:2], replace(g, precision="mxfp8"), *args[3:], sg, sh) == (0, 1, 2, 3, 4,
                                                                                                "d shared")
    a, kw = calls[-1]
    assert a[9:12] == ("qg", "qu", "qd") and kw == {"dx_shared": dxs, "w_scales": "scales"}
    ok[0] = False
    assert mlp.backward_fused_ep(*args) is None
    assert len(calls) == 3

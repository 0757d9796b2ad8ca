"""The sm100 backend's fused paths in the layer (issue 15), on CPU: no Blackwell GPU exists here,
so the kernels never run.

* the fused paths are asked for in the config (``MoKConfig.forward_path`` / ``backward_path``;
  the sm100 default is UNFUSED both ways, mok_cute.layers.paths), never by the environment;
  ``MoKConfig.tile_m`` (128 or 256) and ``comm_transport`` reach the kernels' launch policy;
* ``Sm100ExpertMLP.fused_forward`` passes the config's comm CTAs, timeout and ring to
  :func:`mok_cute.kernels.sm100.fused_moe.fused_forward`, watches its status word and returns
  the seven outputs the layer reads;
* the layer's fused glue (state with route-order rows, x gathered again by the backward) over
  a torch model of the kernel's contract (the unfused sm100 wrappers with their launches
  modelled: ``test_sm100_tails.model``) gives y and every gradient bitwise the reference's.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import make_problem
from mok_cute import reference as R
from mok_cute.config import BackwardPath, ForwardPath, MoKConfig
from mok_cute.layers import paths as P
from mok_cute.layers import select as B
from mok_cute.layers.common import ring_chunks
from mok_cute.layers.sm100 import Sm100ExpertMLP
from test_sm100_mxfp8 import ref_quant  # noqa: F401 (fixture of the model fixture)
from test_sm100_tails import assert_reference_layer, model  # noqa: F401 (model: fixture)


def _inputs(p, limit):
    return B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)


def test_fused_paths_are_asked_for_in_the_config(monkeypatch):
    """The sm100 default is UNFUSED both ways whatever the environment (the opt-in variable
    ``MOK_CUTE_SM100_FUSED`` is gone: the config's paths ask for the fused kernels); an explicit
    path wins; the MLP has no environment-dependent capability left."""
    be = B.get_backend("sm100")
    p, _ = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = _inputs(p, None)
    for value in ("1", "0"):
        monkeypatch.setenv("MOK_CUTE_SM100_FUSED", value)
        assert be.check(inp, MoKConfig(), None) == P.Paths(ForwardPath.UNFUSED, BackwardPath.UNFUSED)
        asked = MoKConfig(forward_path="fused", backward_path="fused_whole")
        assert be.check(inp, asked, None) == P.Paths(ForwardPath.FUSED, BackwardPath.FUSED_WHOLE)
    assert not hasattr(Sm100ExpertMLP, "fused_precisions")
    with pytest.raises(ValueError, match="fused forward runs"):
        Sm100ExpertMLP().fused_forward(None, None, (None,) * 3, None, None, MoKConfig(precision="fp8_block"))


def test_tile_m_and_transport_reach_the_launch_policy():
    """``MoKConfig.tile_m`` is the fused kernels' tile rows (None: 128; 256: the ``cta_group::2`` CTA
    pairs; anything else a ValueError naming tile_m and the allowed values), ``comm_transport="bulk"``
    the EP > 1 bulk push, ``trace`` the resolved trace; R1's rows are always the comm CTAs' gather."""
    from mok_cute.layers import sm100 as S

    assert S.fused_tile_m(None) == S.fused_tile_m(MoKConfig()) == 128
    assert S.fused_tile_m(MoKConfig(tile_m=256)) == 256
    with pytest.raises(ValueError, match=r"tile_m must be one of \(128, 256\).*got 64"):
        S.fused_tile_m(MoKConfig(tile_m=64))
    lau = S.fused_launch(MoKConfig(tile_m=256, comm_transport="bulk", trace=True), True, 12, 2.5, 40, 7)
    assert (lau.comm_ctas, lau.timeout_s, lau.num_ctas, lau.ring_chunks, lau.trace, lau.mx) == (12, 2.5, 40, 7, True,
                                                                                                 True)
    assert (lau.tile_m, lau.bulk_push, lau.gather) == (256, True, "comm")
    lau = S.fused_launch(None, False, 1, 30.0)
    assert (lau.tile_m, lau.bulk_push, lau.trace, lau.gather) == (128, False, False, "comm")


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
    from mok_cute.kernels.operands import FusedForwardOut

    calls = []

    def fused_forward(x, plan, weights, shared, limit, launch, scales=None, ws=None, interleave=None):
        order, offsets, topk_idx, topk_w = plan
        w_gate, w_up, w_down = weights
        gate = None if shared is None else shared.gate
        calls.append(dict(comm_ctas=launch.comm_ctas, timeout_s=launch.timeout_s, ring_chunks=launch.ring_chunks,
                          gate=gate, interleave=interleave == mlp._interleaved, mx=scales is not None,
                          tile_m=launch.tile_m))
        assert launch.mx == (scales is not None)
        t, k = topk_idx.shape
        rows = order.long() // k
        whole = torch.tensor([0, t], dtype=torch.int32)
        if scales is None:
            out, g = mlp.forward(x.index_select(0, rows), offsets, w_gate, w_up, w_down, limit)
            gu, h = g.gu, g.h
        else:
            out, gu, h = _mx_expert(x, rows, offsets, w_gate, w_up, w_down, limit, scales.routed, interleave)
        m = int(offsets[-1])
        slot = torch.full((t * k, x.shape[1]), float("nan"), dtype=torch.bfloat16)  # -1 slots: never written
        slot[order[:m].long()] = out[:m]
        gus = hs = s_out = None
        acc = torch.zeros(x.shape, dtype=torch.float32)
        if shared is not None:
            sw = shared.weights
            if scales is None:
                s_out, sg = mlp.forward(x, whole, *(w[None] for w in sw), limit)
                gus, hs = sg.gu, sg.h
            else:
                s_out, gus, hs = _mx_expert(x, torch.arange(t), whole, *(w[None] for w in sw), limit,
                                            [s[None] for s in scales.shared], interleave)
            acc = s_out.float()
        y = R.slot_sum(acc, slot.view(t, k, -1), topk_idx, topk_w).bfloat16()
        status = torch.zeros(4, dtype=torch.int32)
        return FusedForwardOut(y, gu, h, slot, gus, hs, s_out, [status], None)

    return fused_forward, calls


def _core_model(calls):
    """A torch model of ``fused_bwd.fused_backward_core``'s contract on the unfused sm100 wrappers:
    the unfused backward (MXFP8, ``w_scales`` given: :func:`~mok_cute.layers.sm100.mx_backward` on
    the given quantized weights), with ``tokens`` the rows scattered by ``order`` and the reference
    slot sum from fp32(dx_shared) [+ dx_add]; ``calls`` gets ``(tokens?, dx_shared?, dx_add?, mx?)``."""
    from mok_cute.kernels.sm100 import grouped_gemm as k_
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    def core(dy, x, gu, h, offsets, weights, lim, launch, tokens=None, w_scales=None, consume=False):
        w_gate, w_up, w_down = weights
        m = dy.shape[0]
        calls.append((tokens is not None, tokens is not None and tokens[2] is not None,
                      tokens is not None and tokens[3] is not None, w_scales is not None))
        assert launch.mx == (w_scales is not None)
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


def _problem(shared_i, seed):
    p, dy = make_problem(T=40, H=192, I=320, E=5, k=3, shared_I=shared_i, seed=seed)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    p["topk_idx"][3, 1] = -1
    return p, dy


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_fused_glue_equals_reference(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's fused forward glue (``forward_path="fused"``), BF16 and MXFP8 (weights quantized
    and cached by the MLP, the forward's state what the backward reads), over the kernel model; at
    MXFP8 the backward path is FUSED (the core: its mx variant, over :func:`_core_model`, for the
    routed experts and the shared expert), at BF16 UNFUSED (the default): y and every gradient
    bitwise the reference's."""
    from mok_cute.kernels.sm100 import fused_bwd, fused_moe
    from mok_cute.kernels.sm90 import fused_moe as fm90

    be = B.get_backend("sm100")
    fake, calls = _kernel_model(be.mlp)
    watched = []
    monkeypatch.setattr(fused_moe, "fused_forward", fake)
    monkeypatch.setattr(fm90, "watch_status", lambda st, first: watched.append(first))
    p, dy = _problem(shared_i, 23)
    inp = _inputs(p, limit)
    mx = precision == "mxfp8"
    cfg = MoKConfig(comm_sms_fwd=12, device_timeout_s=3.0, minibatch_tokens=512, precision=precision,
                    forward_path="fused", backward_path="fused" if mx else None)
    y, st = be.forward(inp, cfg, None)
    idx = st.topk_idx
    assert calls == [dict(comm_ctas=cfg.comm_ctas_fwd(1), timeout_s=3.0, ring_chunks=ring_chunks(cfg, idx), gate=None,
                          interleave=True, mx=mx, tile_m=128)]  # the MLP's cached interleave
    assert watched == [cfg.validate_routing]
    assert st.rows_by_route and st.routed.x is None  # the backward gathers x's rows again
    assert st.routed.precision == precision and st.routed.gu.dtype == st.routed.h.dtype == torch.bfloat16
    core_calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", _core_model(core_calls))
    assert_reference_layer(p, dy, limit, y, be.backward(st, dy), precision)
    assert all(c[3] for c in core_calls) and len(core_calls) == mx * (1 + (shared_i is not None))


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


def _group(precision="bf16"):
    from mok_cute.layers.common import ExpertGroup

    x = torch.randn(6, 64).bfloat16()
    return ExpertGroup(x, torch.tensor([0, 6]), torch.randn(6, 128).bfloat16(), torch.randn(6, 64).bfloat16(),
                       precision)


def test_backward_runs_the_fused_core_when_asked(monkeypatch, ref_quant):  # noqa: F811
    """``backward(fused=True)`` (the backward path FUSED) is one fused_backward_core call on the
    group's operands (MXFP8: the cached quantized weights and their scales; the config's tile_m; the
    kernel faked); ``fused=False`` runs the unfused kernels."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", lambda *a, **kw: calls.append((a, kw)) or "fused")
    g, dy = _group(), torch.randn(6, 64).bfloat16()
    w = (torch.randn(1, 64, 64).bfloat16(),) * 3
    mlp = Sm100ExpertMLP()
    assert mlp.backward(g, dy, *w, 4.0, fused=True) == "fused"
    (a, kw), = calls
    assert a[0] is dy and a[1] is g.x and a[2] is g.gu and a[3] is g.h and a[4].dtype == torch.int32
    assert tuple(a[5]) == w and a[6] == 4.0 and kw == {"w_scales": None}
    assert (a[7].timeout_s, a[7].tile_m, a[7].mx) == (S.FUSED_BWD_TIMEOUT_S, 128, False)
    assert mlp.backward(replace(g, precision="mxfp8"), dy, *w, 4.0, fused=True, config=MoKConfig(tile_m=256)) == "fused"
    a, kw = calls[1]  # the weights quantized along their rows' K (axis 1), as mx_backward's, cached
    want = [mlp._qw(t, 1) for t in w]
    assert all(x is q for x, (q, _) in zip(a[5], want)) and a[6] == 4.0
    assert all(x is s for x, (_, s) in zip(kw["w_scales"], want)) and a[7].mx and a[7].tile_m == 256
    monkeypatch.setattr(S, "mlp_backward", lambda *a: "unfused")
    monkeypatch.setattr(S, "mx_backward", lambda *a: "unfused mxfp8")
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")  # gone: not read
    assert mlp.backward(g, dy, *w, 4.0) == "unfused"
    assert mlp.backward(replace(g, precision="mxfp8"), dy, *w, 4.0) == "unfused mxfp8"
    assert len(calls) == 2


def test_backward_tokens_is_the_fused_core(monkeypatch, ref_quant):  # noqa: F811
    """``backward_tokens`` (the backward path FUSED) is one fused_backward_core call with ``tokens``
    (MXFP8: and ``w_scales``; the kernel faked), its operands made contiguous (never a None asking
    for a fallback); another precision is a ValueError."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", lambda *a, **kw: calls.append((a, kw)) or "fused")
    g, dy = _group(), torch.randn(6, 64).bfloat16()
    w = (torch.randn(1, 64, 64).bfloat16(),) * 3
    order, idx = torch.arange(6), torch.zeros(3, 2, dtype=torch.int32)
    dxs, dxa = torch.randn(3, 64).bfloat16(), torch.randn(3, 64)
    mlp = S.Sm100ExpertMLP()
    assert mlp.backward_tokens(g, dy, *w, 4.0, (order, idx, dxs, dxa), consume=True) == "fused"
    a, kw = calls[0]
    assert a[:4] == (dy, g.x, g.gu, g.h) and tuple(a[5]) == w and a[6] == 4.0 and a[7].tile_m == 128
    assert kw["tokens"] == (order, idx, dxs, dxa) and kw["consume"] is True and kw["w_scales"] is None
    assert mlp.backward_tokens(replace(g, precision="mxfp8"), dy, *w, 4.0, (order, idx, dxs, None),
                               config=MoKConfig(tile_m=256)) == "fused"
    a, kw = calls[1]
    assert a[5][0].dtype == torch.float8_e4m3fn and kw["w_scales"] is not None and a[7].mx and a[7].tile_m == 256
    strided = torch.randn(64, 3).bfloat16().t()
    assert mlp.backward_tokens(g, dy, *w, 4.0, (order, idx, strided, None)) == "fused"
    assert torch.equal(calls[2][1]["tokens"][2], strided) and calls[2][1]["tokens"][2].is_contiguous()
    with pytest.raises(ValueError, match="fused backward core runs"):
        mlp.backward_tokens(replace(g, precision="fp8_block"), dy, *w, 4.0, (order, idx, dxs, None))
    assert len(calls) == 3


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_fused_backward_through_backward_tokens(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's FUSED backward (``backward_path="fused"``, after the unfused forward) on the sm100
    backend calls ``backward_tokens`` (BF16 and MXFP8) and the shared expert's core; over
    :func:`_core_model` (the contract of ``fused_backward_core(tokens=...)``) every gradient is
    bitwise the reference's."""
    from mok_cute.kernels.sm100 import fused_bwd

    be = B.get_backend("sm100")
    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_core", _core_model(calls))
    p, dy = _problem(shared_i, 29)
    inp = _inputs(p, limit)
    y, st = be.forward(inp, MoKConfig(precision=precision, backward_path="fused"), None)
    assert st.paths == P.Paths(ForwardPath.UNFUSED, BackwardPath.FUSED)
    grads = be.backward(st, dy)
    mx = precision == "mxfp8"
    routed = (True, shared_i is not None, False, mx)
    assert sorted(calls) == sorted([routed] + [(False, False, False, mx)] * (shared_i is not None))  # + the shared
    assert_reference_layer(p, dy, limit, y, grads, precision)


def test_ep_needs_an_asked_forward_path(monkeypatch):
    """EP > 1 on the sm100 backend runs only a forward path the config asks for (the path table: no
    default at EP > 1, compile-verified only): refused before any kernel without one, whatever the
    environment."""
    from mok_cute.layers import grouped

    monkeypatch.setattr(grouped, "_world", lambda group: (2, 0))
    be = B.get_backend("sm100")
    p, _ = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = _inputs(p, None)
    monkeypatch.setenv("MOK_CUTE_SM100_FUSED", "1")  # gone: not read
    with pytest.raises(NotImplementedError, match="EP > 1"):
        be.check(inp, MoKConfig(), "group")
    for precision in ("bf16", "mxfp8"):
        assert be.check(inp, MoKConfig(precision=precision, forward_path="fused"), "group").forward is ForwardPath.FUSED


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i", [64, None])
def test_fused_forward_ep_hands_the_plan_and_workspace(monkeypatch, ref_quant, precision, shared_i):  # noqa: F811
    """``Sm100ExpertMLP.fused_forward_ep`` (the sm90 MLP's contract): one ``fused_moe.fused_forward``
    call with the plan's packed sources and offsets, int32 topk_idx, the workspace, the EP comm CTAs,
    the timeout, the ring, the grid, the config's tile_m and transport, the MLP's cached interleave
    and (MXFP8) its cached row-quantized weights and scales; returns ``(y, gu, h, slot_out, gus, hs,
    w_rows)``; a precision no fused path runs is a ValueError."""
    from mok_cute.kernels.operands import FusedForwardOut
    from mok_cute.kernels.sm100 import fused_moe

    calls = []
    out = FusedForwardOut(*(f"out{i}" for i in range(9)))
    monkeypatch.setattr(fused_moe, "fused_forward", lambda *a, **kw: calls.append((a, kw)) or out)
    mlp = Sm100ExpertMLP()
    p, _ = make_problem(T=24, H=64, I=64, E=2, k=2, shared_I=shared_i, seed=3)
    plan = SimpleNamespace(recv_src=torch.arange(96, dtype=torch.int32), offsets=torch.tensor([0, 40, 70]).int())
    ws = SimpleNamespace(EP=2)
    cfg = MoKConfig(precision=precision, comm_sms_fwd=None, device_timeout_s=2.5, minibatch_tokens=256, tile_m=256,
                    comm_transport="bulk")
    idx = p["topk_idx"].long()
    args = (ws, plan, p["x"], idx, p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], 4.0)
    with pytest.raises(ValueError, match="fused forward runs"):
        mlp.fused_forward_ep(*args, replace(cfg, precision="fp8_block"), num_ctas=66)
    assert mlp.fused_forward_ep(*args, cfg, num_ctas=66) == (*out[:6], out[8])
    ((a, kw),) = calls
    assert a[0] is p["x"] and a[1].order is plan.recv_src and a[1].offsets is plan.offsets
    assert a[1].topk_w is p["topk_w"] and a[1].topk_idx.dtype == torch.int32 and torch.equal(a[1].topk_idx, idx.int())
    lau = a[5]
    assert a[4] == 4.0 and (lau.comm_ctas, lau.timeout_s, lau.num_ctas) == (cfg.comm_ctas_fwd(2), 2.5, 66)
    assert cfg.comm_ctas_fwd(2) != cfg.comm_ctas_fwd(1) and lau.ring_chunks == ring_chunks(cfg, idx)
    assert (lau.tile_m, lau.bulk_push, lau.mx) == (256, True, precision == "mxfp8")
    assert kw["ws"] is ws and kw["interleave"] == mlp._interleaved and (a[3] is None or a[3].gate is None)
    if precision == "bf16":
        assert tuple(a[2]) == (p["w_gate"], p["w_up"], p["w_down"]) and a[6] is None
        assert (a[3] is None) == (shared_i is None) and (a[3] is None or a[3].weights == p["shared"])
        return
    want = [mlp._qw(w, 2) for w in (p["w_gate"], p["w_up"], p["w_down"])]  # cached: the same tensors
    assert all(x is q for x, (q, _) in zip(a[2], want)) and all(x is s for x, (_, s) in zip(a[6].routed, want))
    if shared_i is None:
        assert a[3] is None and a[6].shared is None
    else:
        qs = [mlp._qw(w[None], 2) for w in p["shared"]]
        assert all(torch.equal(x.view(torch.uint8), q[0].view(torch.uint8)) for x, (q, _) in zip(a[3].weights, qs))
        assert all(torch.equal(x, s[0]) for x, (_, s) in zip(a[6].shared, qs))


def _fused_backward_model(calls):
    """A torch model of ``fused_bwd.fused_backward``'s contract (FUSED_WHOLE) on the unfused sm100
    wrappers: the route_grad pass (its torch mirror), x's rows gathered by ``order``, the shared
    expert's unfused backward (its dx the slot sum's start) and :func:`_core_model` with ``tokens``;
    with ``main_grads`` the weight gradients are added there in fp32 and returned as None (the
    kernel's contract); MXFP8 (``w_scales``): the core model's MXFP8 backward on the gathered bf16
    rows (what the kernel's comm CTAs quantize); ``calls`` gets what the layer handed it."""
    from mok_cute.kernels import route_grad
    from mok_cute.kernels.sm100 import grouped_gemm as k_
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    core = _core_model([])

    def fused_backward(dy, x, plan, saved, weights, limit, launch, shared=None, dx_shared=None, main_grads=None,
                       w_scales=None):
        order, offsets, topk_idx, topk_w = plan
        calls.append(dict(rows_by_route=saved.by_route, comm_ctas=launch.comm_ctas, timeout_s=launch.timeout_s,
                          shared=shared is not None, dx_shared=dx_shared is not None, offsets=offsets.dtype,
                          main_grads=None if main_grads is None else len(main_grads), mx=w_scales is not None))
        k = topk_idx.shape[1]
        order = order.long()
        dy_rows, dtw = route_grad.dy_rows_and_dtopk_w_torch(dy, saved.rows, order, topk_w, offsets, saved.by_route)
        dws = ()
        if shared is not None:
            offs_s, gus, hs, *ws = shared
            dx_shared, *dws = S.mlp_backward(k_.grouped_dswiglu_dgrad, k_.grouped_dgrad1, k_.grouped_wgrad,
                                             ExpertGroup(x, offs_s, gus, hs), dy, *(w[None] for w in ws), limit)
            dws = tuple(d[0] for d in dws)
        m = int(offsets[-1])
        dx, dwg, dwu, dwd = core(dy_rows[:m], x.index_select(0, order[:m] // k), saved.gu, saved.h, offsets, weights,
                                 limit, launch, tokens=(order, topk_idx, dx_shared, None), w_scales=w_scales)
        if main_grads is not None:
            for mg, d in zip(main_grads, (dwg, dwu, dwd, *dws)):
                mg.add_(d.float())
            return (dx, dtw, *(None,) * (3 + len(dws)))
        return (dx, dtw, dwg, dwu, dwd, *dws)

    return fused_backward


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("shared_i, limit", [(64, 4.0), (None, None)])
def test_layer_fused_whole_backward(model, monkeypatch, shared_i, limit, precision):  # noqa: F811
    """The layer's FUSED_WHOLE backward (``backward_path="fused_whole"``) after the fused forward: one
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
    p, dy = _problem(shared_i, 31)
    inp = _inputs(p, limit)
    cfg = MoKConfig(comm_sms_fwd=12, comm_sms_bwd=20, minibatch_tokens=512, precision=precision,
                    forward_path="fused", backward_path="fused_whole")
    y, st = be.forward(inp, cfg, None)
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
    y2, st = be.forward(inp, cfg, None)
    acc = be.backward(st, dy, main)
    assert calls[-1]["main_grads"] == (3 if mx else len(weights)) and torch.equal(y2, y)
    assert torch.equal(acc.dx, grads.dx)
    fresh = [grads.d_w_gate, grads.d_w_up, grads.d_w_down, *(grads.d_shared or ())]
    assert acc.d_w_gate is None and acc.d_w_up is None and acc.d_w_down is None
    if mx and shared_i is not None:  # the shared expert ran before the launch: the caller adds its gradients
        assert all(torch.equal(a, b) for a, b in zip(acc.d_shared, grads.d_shared))
        main[3:] = [m + d.float() for m, d in zip(main[3:], acc.d_shared)]
    assert all(torch.equal(m, s0 + d.float()) for m, s0, d in zip(main, start, fresh))


def _mx_stand_ins(monkeypatch, mlp, t: int, h: int):
    """CPU stand-ins for the MXFP8 launches' host steps: the quantized weights (``_core_weights``) and
    the shared expert's backward (``shared_backward``: its dx, returned, and "d shared")."""
    from mok_cute.kernels.operands import ExpertWeights
    from mok_cute.layers import sm100 as S

    dxs = torch.randn(t, h).bfloat16()
    monkeypatch.setattr(mlp, "_core_weights", lambda g, *w: (ExpertWeights("qg", "qu", "qd"), "scales"))
    monkeypatch.setattr(S, "shared_backward", lambda m, group, dy, shared, limit, *how: (dxs, "d shared"))
    return dxs


def test_backward_fused_hands_the_launch_its_operands(monkeypatch):
    """``backward_fused`` (FUSED_WHOLE at EP = 1) is one ``fused_backward`` call on the forward state
    (never a None asking for a fallback): the route plan (int32 offsets), the forward's rows, the
    config's backward comm CTAs and tile_m, the shared group (made contiguous where it was not); MXFP8:
    the quantized weights and their scales, the shared expert's backward first (its dx the launch's
    dx_shared, its gradients returned), main_grads' routed three only."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    t, k, h, i = 4, 2, 64, 64
    bf = torch.bfloat16
    g = ExpertGroup(None, torch.tensor([0, 5, 8]), torch.randn(8, 2 * i).to(bf), torch.randn(8, i).to(bf))
    sg = ExpertGroup(None, torch.tensor([0, t]), torch.randn(t, 2 * i).to(bf), torch.randn(t, i).to(bf))
    dy, x, r = torch.randn(t, h).to(bf), torch.randn(t, h).to(bf), torch.randn(t * k, h).to(bf)
    order, topk_w, idx = torch.arange(t * k), torch.rand(t, k), torch.zeros(t, k, dtype=torch.int32)
    w = (torch.randn(2, i, h).to(bf), torch.randn(2, i, h).to(bf), torch.randn(2, h, i).to(bf))
    sh = (torch.randn(i, h).to(bf), torch.randn(i, h).to(bf), torch.randn(h, i).to(bf))
    st = SimpleNamespace(routed=g, x=x, rows=r, order=order, topk_w=topk_w, topk_idx=idx, weights=w, limit=4.0,
                         rows_by_route=True, config=MoKConfig(comm_sms_bwd=10, tile_m=256), shared_group=None,
                         shared=None)
    mlp = S.Sm100ExpertMLP()
    assert mlp.backward_fused(st, dy) == (0, 1, 2, 3, 4, None)
    (a, kw), = calls
    assert a[:2] == (dy, x) and a[2].order is order and a[2].topk_idx is idx and a[2].offsets.dtype == torch.int32
    assert a[3].gu is g.gu and a[3].h is g.h and a[3].rows is r and a[3].by_route is True
    assert tuple(a[4]) == w and a[5] == 4.0 and kw == {"shared": None, "main_grads": None}
    assert (a[6].comm_ctas, a[6].timeout_s, a[6].tile_m, a[6].mx) == (10, S.FUSED_BWD_TIMEOUT_S, 256, False)
    st.shared_group, st.shared = sg, (sh[0], sh[1], torch.randn(i, h).to(bf).t().contiguous().t())
    assert mlp.backward_fused(st, dy) == (0, 1, 2, 3, 4, (5, 6, 7))
    sh_ops = calls[1][1]["shared"]
    assert sh_ops[1] is sg.gu and sh_ops[3:5] == sh[:2] and sh_ops[5].is_contiguous()  # a copy, not a fallback
    dxs = _mx_stand_ins(monkeypatch, mlp, t, h)
    main = [torch.zeros(1)] * 6
    st.shared = sh
    st.routed = replace(g, precision="mxfp8")
    assert mlp.backward_fused(st, dy, main) == (0, 1, 2, 3, 4, "d shared")
    a, kw = calls[-1]
    assert tuple(a[4]) == ("qg", "qu", "qd") and kw == {"dx_shared": dxs, "main_grads": main[:3], "w_scales": "scales"}
    assert a[6].mx is True and len(calls) == 3


def test_backward_fused_ep_hands_the_launch_its_operands(monkeypatch):
    """``backward_fused_ep`` (the sm90 MLP's contract) is one ``fused_backward_ep`` call on the EP
    forward state (never a None asking for a fallback): the workspace, the plan's packed sources and
    offsets as the route plan, this rank's slot rows as [T*k, H] with the grouped rows' router weights,
    the config's backward comm CTAs, tile_m and transport, the workspace's grid and timeout; returns
    ``(dx, d topk_w, dWg, dWu, dWd, d shared or None)``; MXFP8 as ``backward_fused``'s."""
    from mok_cute.kernels.sm100 import fused_bwd
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward_ep", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    t, k, h, i, m = 4, 2, 64, 64, 16
    bf = torch.bfloat16
    g = ExpertGroup(None, torch.tensor([0, 5, 8], dtype=torch.int32), torch.randn(m, 2 * i).to(bf),
                    torch.randn(m, i).to(bf))
    sg = ExpertGroup(None, torch.tensor([0, t]), torch.randn(t, 2 * i).to(bf), torch.randn(t, i).to(bf))
    ws = SimpleNamespace(grid_ctas=40, timeout_s=7.0)
    plan = SimpleNamespace(recv_src=torch.arange(m, dtype=torch.int32), offsets=g.offsets)
    dy, x, slots = torch.randn(t, h).to(bf), torch.randn(t, h).to(bf), torch.randn(t, k, h).to(bf)
    w_rows, idx = torch.rand(m), torch.zeros(t, k, dtype=torch.int32)
    w = (torch.randn(2, i, h).to(bf), torch.randn(2, i, h).to(bf), torch.randn(2, h, i).to(bf))
    sh = (torch.randn(i, h).to(bf), torch.randn(i, h).to(bf), torch.randn(h, i).to(bf))
    st = SimpleNamespace(ws=ws, plan=plan, routed=g, x=x, w_rows=w_rows, topk_idx=idx, weights=w, limit=4.0,
                         shared_group=None, shared=None, slot_out=slots,
                         config=MoKConfig(comm_sms_bwd=10, comm_transport="bulk"))
    mlp = S.Sm100ExpertMLP()
    assert mlp.backward_fused_ep(st, dy) == (0, 1, 2, 3, 4, None)
    (a, kw), = calls
    assert a[0] is ws and a[1].order is plan.recv_src and a[1].offsets is plan.offsets and a[1].topk_idx is idx
    assert a[2:4] == (dy, x) and a[4].rows.shape == (t * k, h) and a[4].rows.data_ptr() == slots.data_ptr()
    assert a[4].w_rows is w_rows and a[4].gu is g.gu and a[4].h is g.h and tuple(a[5]) == w and a[6] == 4.0
    assert (a[7].comm_ctas, a[7].num_ctas, a[7].timeout_s, a[7].bulk_push, a[7].tile_m) == (10, 40, 7.0, True, 128)
    assert kw == {"shared": None}
    st.shared_group, st.shared = sg, sh
    assert mlp.backward_fused_ep(st, dy) == (0, 1, 2, 3, 4, (5, 6, 7))
    assert calls[1][1]["shared"][1] is sg.gu and calls[1][1]["shared"][3:] == sh
    assert calls[1][1]["shared"][0].dtype == torch.int32
    st.slot_out = slots.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: copied, never refused
    dxs = _mx_stand_ins(monkeypatch, mlp, t, h)  # MXFP8: as backward_fused's
    st.routed = replace(g, precision="mxfp8")
    assert mlp.backward_fused_ep(st, dy) == (0, 1, 2, 3, 4, "d shared")
    a, kw = calls[-1]
    assert tuple(a[5]) == ("qg", "qu", "qd") and kw == {"dx_shared": dxs, "w_scales": "scales"}
    assert a[4].rows.is_contiguous() and len(calls) == 3

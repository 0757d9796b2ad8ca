"""Layer backends built on grouped expert-MLP kernels: sm90 and sm100 (EP = 1; EP > 1 for
sm90 and, opted in with ``MOK_CUTE_SM100_FUSED=1``, sm100 through the symmetric-memory comm
kernels, see :mod:`mok_cute.layers.ep`).

Unfused stages, no host sync (CUDA-graph friendly): a stable sort of the T*k (token, slot)
routes by expert gives expert-grouped rows in the reference's order (token, then slot) and
device-side offsets; an arch's expert MLP (grouped GEMM kernels) runs over a fixed
[T*k, ...] row buffer (rows past offsets[E] belong to -1 slots and are never read); the
shared expert runs through the same kernels as one more group; the combine is the
reference's fixed-order slot sum. Numerics follow mok_cute.reference except that the GEMMs
accumulate in fp32 and d topk_w sums in fp32 (compared with tolerances).

An expert MLP implementation has ``arch``, ``dim_multiple`` (precision -> what H, I, I_s must be
multiples of), ``precisions``,
``forward(x_rows, offsets, w_gate, w_up, w_down, limit[, precision=]) -> (rows, ExpertGroup)``
(``precision`` passed only when not "bf16") and
``backward(group, dy_rows, w_gate, w_up, w_down, limit) -> (dx_rows, dWg, dWu, dWd)`` (in the
group's precision). MXFP8 numerics: operands quantized as in the reference's table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from mok_cute.dsl import deferred
from mok_cute.kernels import route_grad
from mok_cute.schedule import local_plan
from mok_cute.layers.common import ExpertGroup, fused_bwd_mode, shared_backward, shared_forward, whole_offsets
from mok_cute.reference import MoEGrads, Numerics, _world, shared_gate, shared_gate_backward, slot_sum


@dataclass
class _State:
    limit: float | None
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    order: torch.Tensor  # [T*k] route index (t*k + j) of each grouped row
    valid: torch.Tensor  # [T*k] route is not -1
    weights: tuple
    shared: tuple | None
    routed: ExpertGroup
    shared_group: ExpertGroup | None
    rows: torch.Tensor  # [T*k, H] GEMM2 rows (d topk_w reads them in place) ...
    rows_by_route: bool = False  # ... expert-grouped, or (fused forward) in route order t*k + j
    x: torch.Tensor | None = None  # the layer input, when routed.x is None (gathered in backward)
    comm_bwd: int = 28  # the fused backward's row-gathering CTAs (config.comm_sms_bwd)
    gate: tuple | None = None  # (w_sg, g [T, 1] bf16, s [T, H] the shared output, x): the shared output gate


_BF16 = Numerics("bf16")


def _gate(inp, s):
    """``(w_sg, g [T, 1] bf16, s, x)`` of the shared expert's output gate (the reference's own
    ops: its fp64 sums run on the device too), or None without one."""
    if inp.shared_gate is None:
        return None
    return inp.shared_gate, shared_gate(_BF16, inp.x, inp.shared_gate), s, inp.x


def fused_enabled() -> bool:
    """The fused forward runs where an arch has one unless ``MOK_CUTE_FUSED=0`` (the unfused
    stages; read at every call)."""
    return os.environ.get("MOK_CUTE_FUSED", "1") != "0"


def routing_plan(topk_idx: torch.Tensor, num_experts: int, watch: bool):
    """``(order int32 [T*k], offsets int32 [E+1], idx int32 [T, k])`` with no host sync: the
    routes sorted stably by expert (routes with no expert last), the experts' row offsets, and
    the ids with those outside [-1, E) set to -1 (such a route is skipped like a -1 slot: no
    kernel reads or writes for it). One launch on CUDA (:mod:`mok_cute.schedule.local_plan`),
    its torch mirror elsewhere. ``watch`` (``validate_routing=False``): the count of such ids
    is watched on the device (:mod:`mok_cute.dsl.deferred`), raised by a later call or
    ``mok_cute.check_errors()``."""
    if topk_idx.is_cuda and num_experts <= local_plan.MAX_EXPERTS:
        order, offsets, idx, words = local_plan.plan_local(topk_idx, num_experts)
    else:
        order, offsets, idx, words = local_plan.plan_reference(topk_idx, num_experts)
    if watch:
        deferred.watch(words, lambda w: None if w[0] == 0 else (
            f"mok_cute: topk_idx held {w[0]} expert id(s) outside [-1, E = {num_experts}) (first at flat "
            f"route {w[1]} = token * k + slot); with validate_routing=False those routes were skipped"))
    return order, offsets, idx.view(topk_idx.shape)


def route_sort(topk_idx: torch.Tensor, num_experts: int):
    """(order [T*k] int64, offsets [E+1] int32, valid [T*k] bool), no host sync: the torch
    mirror of :func:`routing_plan` (routes sorted stably by expert, -1 routes last)."""
    order, offsets, idx, _ = local_plan.plan_reference(topk_idx, num_experts)
    return order.long(), offsets, idx >= 0


def _scatter_slots(rows, order, valid, t, k):
    """Grouped rows back to [T, k, width] slot order; -1 slots are zero."""
    out = torch.empty_like(rows)
    out[order] = rows
    out = torch.where(valid[:, None], out, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return out.view(t, k, rows.shape[1])


class GroupedExpertBackend:
    """Layer backend over an arch's expert MLP (forward and backward): EP = 1 here; EP > 1
    through :mod:`mok_cute.layers.ep` when the MLP has ``expert_parallel`` true (sm90; sm100 opted in
    with ``MOK_CUTE_SM100_FUSED=1``)."""

    shared_gate = True  # the shared expert's output gate, at EP = 1 (``check``)

    def __init__(self, mlp):
        self.mlp, self.name = mlp, mlp.arch

    def check(self, inp, config, group) -> None:
        """Raise for what this backend does not run yet, before any kernel."""
        ep, _ = _world(group)
        if ep != 1 and not getattr(self.mlp, "expert_parallel", False):
            hint = " (opt in with MOK_CUTE_SM100_FUSED=1; it has not run on a GPU)" if self.mlp.arch == "sm100" else ""
            raise NotImplementedError(f"mok_cute backend {self.name!r}: EP > 1 is not enabled for this backend{hint}")
        if ep != 1 and inp.shared_gate is not None:
            raise NotImplementedError(f"mok_cute backend {self.name!r}: shared_gate (the shared expert's output gate) "
                                      "runs at EP = 1 only so far")
        if ep != 1 and config.precision not in self.mlp.ep_precisions:
            raise NotImplementedError(f"mok_cute backend {self.name!r}: EP > 1 (mok_cute.layers.ep) runs "
                                      f"{', '.join(self.mlp.ep_precisions)} only, not precision "
                                      f"{config.precision!r}: use EP = 1")
        tiles = {n: getattr(config, n) for n in ("tile_m", "tile_n", "tile_k") if getattr(config, n) is not None}
        if tiles:
            raise NotImplementedError(f"mok_cute backend {self.name!r}: GEMM tile overrides {tiles} are not "
                                      "selectable yet (leave MoKConfig tile_* as None for its tuned tiles)")
        if config.precision not in self.mlp.precisions:
            raise NotImplementedError(f"mok_cute backend {self.name!r}: precision {config.precision!r} "
                                      f"is not wired yet ({', '.join(self.mlp.precisions)} only)")
        h, inter = inp.x.shape[1], inp.w_gate.shape[1]
        sizes = [("H", h), ("I", inter)] + ([("I_s", inp.shared[0].shape[0])] if inp.shared else [])
        mult = self.mlp.dim_multiple[config.precision]
        for name, v in sizes:
            if v % mult:
                raise ValueError(f"backend {self.name!r}: {name} = {v} must be a multiple of {mult} "
                                 f"at precision {config.precision!r}")

    def forward(self, inp, config, group):
        self.check(inp, config, group)
        if not getattr(self.mlp, "strided_weights", False):  # this arch's kernels read compact weights
            inp = replace(inp, w_gate=inp.w_gate.contiguous(), w_up=inp.w_up.contiguous(),
                          w_down=inp.w_down.contiguous(),
                          shared=None if inp.shared is None else tuple(w.contiguous() for w in inp.shared))
        ep, _ = _world(group)
        if ep != 1:
            from mok_cute.layers import ep as ep_layer

            return ep_layer.forward(self.mlp, inp, group, ep, config)
        order32, offsets, idx = routing_plan(inp.topk_idx, inp.w_gate.shape[0], watch=not config.validate_routing)
        order, valid = order32.long(), idx.reshape(-1) >= 0
        if inp.x.is_cuda and config.precision in getattr(self.mlp, "fused_precisions", ()) and fused_enabled():
            return self._fused_forward(inp, config, order32, order, offsets, idx, valid)
        x, limit = inp.x, inp.swiglu_limit
        t, k = idx.shape
        x_rows = x.index_select(0, order // k)
        kw = {} if config.precision == "bf16" else {"precision": config.precision}
        r, routed = self.mlp.forward(x_rows, offsets, inp.w_gate, inp.w_up, inp.w_down, limit, **kw)
        slot_out = _scatter_slots(r, order, valid, t, k)
        s, shared_group = shared_forward(self.mlp, x, inp.shared, limit, **kw)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if s is None else s.float()
        gate = _gate(inp, s)
        if gate is not None:
            acc = acc * gate[1].float()
        y = slot_sum(acc, slot_out, idx, inp.topk_w).to(torch.bfloat16)
        state = _State(limit, idx, inp.topk_w, order, valid, (inp.w_gate, inp.w_up, inp.w_down),
                       inp.shared, routed, shared_group, r, gate=gate)
        return y, state

    def _fused_forward(self, inp, config, order32, order, offsets, idx, valid):
        """EP = 1 through the arch's fused forward on the routing plan (:func:`routing_plan`):
        one persistent launch (gather, GEMM1 + SwiGLU, GEMM2 into route-order rows, slot sum,
        shared expert)."""
        x, limit = inp.x, inp.swiglu_limit
        t = x.shape[0]
        g = None if inp.shared_gate is None else shared_gate(_BF16, x, inp.shared_gate)
        out = self.mlp.fused_forward(x, order32, offsets, idx, inp.topk_w, inp.w_gate, inp.w_up, inp.w_down, inp.shared,
                                     limit, config, gate=None if g is None else g.float().reshape(-1))
        y, gu, h, slot, gus, hs, s_out = out
        prec = config.precision
        shared_group = None
        if inp.shared is not None:
            shared_group = ExpertGroup(x, whole_offsets(t, x.device), gus, hs, prec)
        # the gathered rows went through the kernel's ring: the backward gathers x's rows again
        routed = ExpertGroup(None, offsets, gu, h, prec)
        state = _State(limit, idx, inp.topk_w, order, valid, (inp.w_gate, inp.w_up, inp.w_down), inp.shared,
                       routed, shared_group, slot, rows_by_route=True, x=x, comm_bwd=config.comm_sms_bwd,
                       gate=None if g is None else (inp.shared_gate, g, s_out, x))
        return y, state

    def backward(self, st, dy: torch.Tensor, main_grads=None) -> MoEGrads:
        """The layer's gradients; with ``main_grads`` (fp32, the weights' order) a fused backward
        may accumulate weight gradients there itself and return them as None (the caller adds the
        others)."""
        if not isinstance(st, _State):
            from mok_cute.layers import ep as ep_layer

            return ep_layer.backward(self.mlp, st, dy)
        t, k = st.topk_idx.shape
        mode = fused_bwd_mode()
        shared = None  # (dx_s, d ws): the shared expert's backward, once, when mode 2 ran it first
        dy_s, dx_gate, d_gate = dy, None, None  # the shared expert's dy, the output gate's dx share and gradient
        if st.gate is not None:
            w_sg, g, s, x = st.gate
            dy_s, dx_gate, d_gate = shared_gate_backward(_BF16, dy, s, g, x, w_sg)
        if mode == 3 and st.x is not None and st.gate is None and hasattr(self.mlp, "backward_fused"):
            out = self.mlp.backward_fused(st.routed, dy, st.x, st.rows, st.order, st.topk_w, st.topk_idx, *st.weights,
                                          st.limit, st.rows_by_route, st.shared_group, st.shared, main_grads,
                                          comm_ctas=st.comm_bwd)
            if out is not None:
                return MoEGrads(*out)
        # MXFP8 (MOK_CUTE_FUSED_BWD_MX_PROLOGUE, default on): the rows, d topk_w and the rows' round trips in two
        # launches, then mode 2's core
        pro = None
        if mode == 2 and st.routed.x is None and st.x is not None and hasattr(self.mlp, "mx_prologue"):
            pro = self.mlp.mx_prologue(st.routed, dy, st.rows, st.order, st.topk_w, st.rows_by_route)
        core = {}  # backward_tokens' extra arguments: the prologue's dy round trip along the tokens
        if pro is not None:
            dy_rows, core["mx_dyt"], dtw, x_rows = pro
            st.rows = None  # before the x rows: three [M, H] buffers at a time, as on the other path
            st.routed = replace(st.routed, x=x_rows(st.x))
        elif st.routed.x is None:  # the fused forward kept no x rows: gathered in the same pass
            dy_rows, dtw, x_rows = route_grad.dy_x_rows_and_dtopk_w(dy, st.x, st.rows, st.order, st.topk_w,
                                                                    st.routed.offsets, rows_by_route=st.rows_by_route)
            st.routed = replace(st.routed, x=x_rows)
        else:
            dy_rows, dtw = route_grad.dy_rows_and_dtopk_w(dy, st.rows, st.order, st.topk_w, st.routed.offsets,
                                                          rows_by_route=st.rows_by_route)
        st.rows = None  # the backward is one-shot (its caller drops the state): the GEMM2 rows go now
        if mode >= 2 and hasattr(self.mlp, "backward_tokens"):
            shared = shared_backward(self.mlp, st.shared_group, dy_s, st.shared, st.limit)
            out = self.mlp.backward_tokens(st.routed, dy_rows, *st.weights, st.limit, st.order, st.topk_idx, shared[0],
                                           dx_gate, consume=True, **core)
            if out is not None:
                return MoEGrads(out[0], dtw, *out[1:], shared[1], d_gate)
        dxr, dwg, dwu, dwd = self.mlp.backward(st.routed, dy_rows, *st.weights, st.limit)
        dx_slots = _scatter_slots(dxr, st.order, st.valid, t, k)
        dxs, d_shared = shared or shared_backward(self.mlp, st.shared_group, dy_s, st.shared, st.limit)
        acc = torch.zeros(dy.shape, dtype=torch.float32, device=dy.device) if dxs is None else dxs.float()
        if dx_gate is not None:
            acc = acc + dx_gate
        dx = slot_sum(acc, dx_slots, st.topk_idx).to(torch.bfloat16)
        return MoEGrads(dx, dtw, dwg, dwu, dwd, d_shared, d_gate)

"""Layer backends built on grouped expert-MLP kernels: sm90 and sm100, EP = 1 here, EP > 1
through the symmetric-memory comm kernels (:mod:`mok_cute.layers.ep`).

Each call decides its forward and backward path once (:func:`mok_cute.layers.paths.decide`,
from the config, the arch's capability table and the call's features) and keeps the decision
in its forward state; the backward runs the path decided there.

Unfused stages (``ForwardPath.UNFUSED``), no host sync (CUDA-graph friendly): the routing plan
(:func:`routing_plan`: the T*k (token, slot) routes sorted stably by expert, in the reference's
order: token, then slot, with device-side offsets); an arch's expert MLP (grouped GEMM kernels)
over a fixed [T*k, ...] row buffer (rows past offsets[E] belong to -1 slots and are never read);
the shared expert through the same kernels as one more group; the combine is the reference's
fixed-order slot sum. ``ForwardPath.FUSED``: the arch's fused forward on the same plan (one
persistent launch). Numerics follow mok_cute.reference except that the GEMMs accumulate in fp32
and d topk_w sums in fp32 (compared with tolerances).

Backward paths: UNFUSED (the route_grad pass, the MLP's separate kernels, the dx scatter and
slot sum), FUSED (the routed dy rows and d topk_w first, then one launch: the MLP's fused
backward core with the dx rows summed into their tokens; at MXFP8 after a fused forward on SM90
the rows and their round trips in two launches over every SM first, the MLP's
``fused_mx_prologue``), FUSED_WHOLE (the arch's whole backward in one launch).

An expert MLP implementation has ``arch`` ("sm90", "sm100": its row of the path table),
``dim_multiple`` (precision -> what H, I, I_s must be multiples of), ``strided_weights``
(its kernels address strided weights in place), ``fused_mx_prologue``, ``gathers_x`` (its BF16
``backward_tokens`` takes ``made.x_tok``, the layer's x, and gathers its rows in the launch), ``down_grad_first``
(then also ``down_weight_grad(group, dy_rows, config)``, whose dW_down its BF16 ``backward_tokens`` takes as
``made.dwd``: h is freed before that launch; ``made``: :class:`~mok_cute.layers.common.MadeBefore`),
``forward(x_rows, offsets, w_gate, w_up, w_down, limit[, precision=][, config=]) -> (rows, ExpertGroup)``
(``precision`` passed only when not "bf16", ``config`` only when its policy sets the unfused
GEMM1 / GEMM2 tiles: :func:`~mok_cute.layers.common.mlp_options`),
``backward(group, dy_rows, w_gate, w_up, w_down, limit, fused=, config=) -> (dx_rows, dWg, dWu,
dWd)`` (in the group's precision; ``config`` the call's, its trace resolved) and, for the fused
paths, ``fused_forward``, ``backward_tokens``, ``backward_fused`` (and at EP > 1
``fused_forward_ep``, ``backward_fused_ep``). MXFP8 numerics: operands quantized as in the
reference's table.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from mok_cute.config import BackwardPath, ForwardPath
from mok_cute.dsl import deferred
from mok_cute.dsl.host import sm_count
from mok_cute.kernels import route_grad
from mok_cute.kernels.operands import RoutePlan
from mok_cute.schedule import local_plan
from mok_cute.layers import paths as P
from mok_cute.layers import launch, tiles, tuned
from mok_cute.layers.common import (
    ExpertGroup, ExpertWeights, LocalState, MadeBefore, mlp_options, shared_backward, shared_forward, whole_offsets,
)
from mok_cute.reference import MoEGrads, Numerics, _world, shared_gate, shared_gate_backward, slot_sum


_BF16 = Numerics("bf16")


def _gate(inp, s):
    """``(w_sg, g [T, 1] bf16, s, x)`` of the shared expert's output gate (the reference's own
    ops: its fp64 sums run on the device too), or None without one."""
    if inp.shared_gate is None:
        return None
    return inp.shared_gate, shared_gate(_BF16, inp.x, inp.shared_gate), s, inp.x


def _biases(inp) -> dict:
    """The arch MLP's forward keyword for the routed experts' biases of ``inp`` (none without them: the shared
    expert and unbiased calls pass nothing)."""
    return {} if inp.biases is None else {"biases": inp.biases}


def _biased(st) -> dict:
    """The arch MLP's backward keyword asking for the biases' gradients when the forward ``st`` added biases."""
    return {"biased": True} if st.biased else {}


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


_ALIASED: set[tuple[str, str]] = set()  # (backend, precision) pairs whose alias was warned


class GroupedExpertBackend:
    """Layer backend over an arch's expert MLP (forward and backward): EP = 1 here; EP > 1
    through :mod:`mok_cute.layers.ep`. The paths each call runs: :mod:`mok_cute.layers.paths`."""

    shared_gate = True  # the shared expert's output gate (where the path table allows it: EP = 1)

    def __init__(self, mlp):
        self.mlp, self.name = mlp, mlp.arch

    def run_config(self, config):
        """``config`` with the precision this arch runs for its ``precision``: the MLP's
        ``precision_alias`` (SM100 runs fp8_block as mxfp8: :class:`~mok_cute.layers.sm100.Sm100ExpertMLP`),
        warned once per process and pair; else ``config`` itself."""
        alias = getattr(self.mlp, "precision_alias", {}).get(config.precision)
        if alias is None:
            return config
        if (self.name, config.precision) not in _ALIASED:
            _ALIASED.add((self.name, config.precision))
            warnings.warn(f"mok_cute backend {self.name!r}: precision {config.precision!r} runs as {alias!r} on this "
                          f"arch ({self.mlp.precision_alias_reason}); its results follow the {alias!r} numerics of "
                          "mok_cute.reference", RuntimeWarning, stacklevel=3)
        return replace(config, precision=alias)

    def check(self, inp, config, group) -> P.Paths:
        """Raise for what this backend does not run, before any kernel; else the paths the call
        runs (:func:`mok_cute.layers.paths.decide`), their kernels' tiles and launch fields checked
        (:func:`mok_cute.layers.tiles.check`, :func:`mok_cute.layers.launch.check`: ValueError naming a
        policy field they cannot run). ``config`` as :meth:`run_config` maps it."""
        config = self.run_config(config)
        ep, _ = _world(group)
        wired = P.precisions(self.mlp.arch)
        if config.precision not in wired:
            raise NotImplementedError(f"mok_cute backend {self.name!r}: precision {config.precision!r} "
                                      f"is not wired yet ({', '.join(wired)} only)")
        call = P.Call.of(inp, config, ep)
        paths = P.decide(config, self.mlp.arch, call)
        tiles.check(config.kernel_policy, self.mlp.arch, config.precision, paths.forward, paths.backward)
        if inp.x.is_cuda:
            launch.check(config, inp.topk_idx, ep, sm_count(inp.x.device))
        h, inter = inp.x.shape[1], inp.w_gate.shape[1]
        sizes = [("H", h), ("I", inter)] + ([("I_s", inp.shared[0].shape[0])] if inp.shared else [])
        mult = self.mlp.dim_multiple[config.precision]
        for name, v in sizes:
            if v % mult:
                raise ValueError(f"backend {self.name!r}: {name} = {v} must be a multiple of {mult} "
                                 f"at precision {config.precision!r}")
        return paths

    def forward(self, inp, config, group):
        """``(y [T, H] bf16, state)`` of one layer call: the paths decided once (:meth:`check`),
        ``config``'s trace resolved once (:func:`~mok_cute.layers.paths.with_trace`) and its tuned
        policy merged in (:func:`mok_cute.layers.tuned.apply`)."""
        config = P.with_trace(self.run_config(config))
        ep, _ = _world(group)
        config = tuned.apply(config, self.mlp.arch, inp, ep)
        paths = self.check(inp, config, group)
        if not self.mlp.strided_weights:  # this arch's kernels read compact weights
            inp = replace(inp, w_gate=inp.w_gate.contiguous(), w_up=inp.w_up.contiguous(),
                          w_down=inp.w_down.contiguous(),
                          shared=None if inp.shared is None else tuple(w.contiguous() for w in inp.shared))
        if inp.biases is not None:  # the kernels read them with unit last strides (a no-op for the layer's own)
            inp = replace(inp, biases=tuple(b.contiguous() for b in inp.biases))
        if ep != 1:
            from mok_cute.layers import ep as ep_layer

            return ep_layer.forward(self.mlp, inp, group, ep, config, paths)
        order32, offsets, idx = routing_plan(inp.topk_idx, inp.w_gate.shape[0], watch=not config.validate_routing)
        order, valid = order32.long(), idx.reshape(-1) >= 0
        if paths.forward is ForwardPath.FUSED:
            return self._fused_forward(inp, config, paths, (order32, order, offsets, idx, valid))
        x, limit = inp.x, inp.swiglu_limit
        t, k = idx.shape
        x_rows = x.index_select(0, order // k)
        kw = mlp_options(config)
        r, routed = self.mlp.forward(x_rows, offsets, inp.w_gate, inp.w_up, inp.w_down, limit, **kw,
                                     **_biases(inp))
        slot_out = _scatter_slots(r, order, valid, t, k)
        s, shared_group = shared_forward(self.mlp, x, inp.shared, limit, **kw)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if s is None else s.float()
        gate = _gate(inp, s)
        if gate is not None:
            acc = acc * gate[1].float()
        y = slot_sum(acc, slot_out, idx, inp.topk_w).to(torch.bfloat16)
        state = LocalState(limit, idx, inp.topk_w, order, valid, ExpertWeights(inp.w_gate, inp.w_up, inp.w_down),
                           inp.shared, routed, shared_group, r, config, paths, gate=gate, biased=inp.biases is not None)
        return y, state

    def _fused_forward(self, inp, config, paths, plan):
        """EP = 1 through the arch's fused forward on the routing plan ``plan`` = ``(order int32,
        order int64, offsets, idx, valid)`` (:func:`routing_plan`): one persistent launch (gather,
        GEMM1 + SwiGLU, GEMM2 into route-order rows, slot sum, shared expert)."""
        order32, order, offsets, idx, valid = plan
        x, limit = inp.x, inp.swiglu_limit
        t = x.shape[0]
        g = None if inp.shared_gate is None else shared_gate(_BF16, x, inp.shared_gate)
        out = self.mlp.fused_forward(x, RoutePlan(order32, offsets, idx, inp.topk_w),
                                     ExpertWeights(inp.w_gate, inp.w_up, inp.w_down), inp.shared, limit, config,
                                     gate=None if g is None else g.float().reshape(-1), **_biases(inp))
        y, gu, h, slot, gus, hs, s_out = out
        prec = config.precision
        shared_group = None
        if inp.shared is not None:
            shared_group = ExpertGroup(x, whole_offsets(t, x.device), gus, hs, prec)
        # the gathered rows went through the kernel's ring: the backward gathers x's rows again
        routed = ExpertGroup(None, offsets, gu, h, prec)
        state = LocalState(limit, idx, inp.topk_w, order, valid, ExpertWeights(inp.w_gate, inp.w_up, inp.w_down),
                           inp.shared, routed, shared_group, slot, config, paths, rows_by_route=True, x=x,
                           gate=None if g is None else (inp.shared_gate, g, s_out, x), biased=inp.biases is not None)
        return y, state

    def backward(self, st, dy: torch.Tensor, main_grads=None) -> MoEGrads:
        """The layer's gradients along the backward path decided with the forward; with
        ``main_grads`` (fp32, the weights' order) FUSED_WHOLE may accumulate weight gradients
        there itself and return them as None (the caller adds the others)."""
        if not isinstance(st, LocalState):
            from mok_cute.layers import ep as ep_layer

            return ep_layer.backward(self.mlp, st, dy)
        if st.paths.backward is BackwardPath.FUSED_WHOLE:  # (the table: no gate, after the fused forward)
            return MoEGrads(*self.mlp.backward_fused(st, dy, main_grads))
        dy_s, dx_gate, d_gate = dy, None, None  # the shared expert's dy, the output gate's dx share and gradient
        if st.gate is not None:
            w_sg, g, s, x = st.gate
            dy_s, dx_gate, d_gate = shared_gate_backward(_BF16, dy, s, g, x, w_sg)
        if st.paths.backward is BackwardPath.FUSED:
            return self._fused_backward(st, dy, dy_s, (dx_gate, d_gate))
        return self._unfused_backward(st, dy, dy_s, (dx_gate, d_gate))

    def _rows(self, st, dy, make_x: bool = True):
        """``(dy_rows, d topk_w)`` of the route_grad pass, the routed group given its x rows (the
        fused forward kept none: gathered in the same pass; not with ``make_x`` False, where the backward's
        launch gathers them itself); the GEMM2 rows released."""
        if st.routed.x is None and make_x:
            dy_rows, dtw, x_rows = route_grad.dy_x_rows_and_dtopk_w(dy, st.x, st.rows, st.order, st.topk_w,
                                                                    st.routed.offsets, rows_by_route=st.rows_by_route)
            st.routed = replace(st.routed, x=x_rows)
        else:
            dy_rows, dtw = route_grad.dy_rows_and_dtopk_w(dy, st.rows, st.order, st.topk_w, st.routed.offsets,
                                                          rows_by_route=st.rows_by_route)
        st.rows = None  # the backward is one-shot (its caller drops the state): the GEMM2 rows go now
        return dy_rows, dtw

    def _fused_backward(self, st, dy, dy_s, gate):
        """BackwardPath.FUSED: the routed dy rows and d topk_w (at MXFP8 after the fused forward,
        where the MLP has it, its prologue: the rows and their round trips in two launches), the
        shared expert's backward, then one launch: the routed backward with the dx rows summed
        into their tokens (the shared expert's dx and the gate's share as its start)."""
        dx_gate, d_gate = gate
        core = {}  # backward_tokens' extra arguments: the prologue's dy round trip along the tokens
        if self.mlp.fused_mx_prologue and st.routed.precision == "mxfp8" and st.routed.x is None:
            dy_rows, core["mx_dyt"], dtw, x_rows = self.mlp.mx_prologue(st.routed, dy, st.rows, st.order, st.topk_w,
                                                                        st.rows_by_route)
            st.rows = None  # before the x rows: three [M, H] buffers at a time, as on the other path
            st.routed = replace(st.routed, x=x_rows(st.x))
        else:  # BF16 on an MLP that gathers x's rows in its launch: none made here
            if st.routed.x is None and st.routed.precision == "bf16" and self.mlp.gathers_x:
                core["x_tok"] = st.x
            dy_rows, dtw = self._rows(st, dy, make_x="x_tok" not in core)
            if "x_tok" in core:  # the order as int32 (the launch turns it into each row's token in place)
                st.order, st.valid = st.order.to(torch.int32), None
                if self.mlp.down_grad_first:  # dW_down first, then h goes: the launch holds none
                    core["dwd"] = self.mlp.down_weight_grad(st.routed, dy_rows, st.config)
                    st.routed = replace(st.routed, h=None)
        dxs, d_shared = shared_backward(self.mlp, st.shared_group, dy_s, st.shared, st.limit, True, st.config)
        out = self.mlp.backward_tokens(st.routed, dy_rows, *st.weights, st.limit, (st.order, st.topk_idx, dxs, dx_gate),
                                       consume=True, config=st.config, **_biased(st),
                                       **({"made": MadeBefore(**core)} if core else {}))
        return MoEGrads(out[0], dtw, *out[1:4], d_shared, d_gate, tuple(out[4:]) or None)

    def _unfused_backward(self, st, dy, dy_s, gate):
        """BackwardPath.UNFUSED: the route_grad pass, the MLP's separate kernels, the dx scatter
        and the fixed-order dx slot sum (the shared expert's dx and the gate's share its start)."""
        dx_gate, d_gate = gate
        t, k = st.topk_idx.shape
        dy_rows, dtw = self._rows(st, dy)
        dxr, dwg, dwu, dwd, *d_biases = self.mlp.backward(st.routed, dy_rows, *st.weights, st.limit, fused=False,
                                                          config=st.config, **_biased(st))
        dx_slots = _scatter_slots(dxr, st.order, st.valid, t, k)
        dxs, d_shared = shared_backward(self.mlp, st.shared_group, dy_s, st.shared, st.limit, config=st.config)
        acc = torch.zeros(dy.shape, dtype=torch.float32, device=dy.device) if dxs is None else dxs.float()
        if dx_gate is not None:
            acc = acc + dx_gate
        dx = slot_sum(acc, dx_slots, st.topk_idx).to(torch.bfloat16)
        return MoEGrads(dx, dtw, dwg, dwu, dwd, d_shared, d_gate, tuple(d_biases) or None)

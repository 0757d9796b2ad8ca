"""Expert-parallel (EP > 1) layer over an arch's expert MLP and the comm kernels: the fused
paths (``ForwardPath.FUSED`` / ``BackwardPath.FUSED``: the forward and the backward each one
persistent launch per rank, the comm inside; FUSED_WHOLE runs the same launch as FUSED here) and
the unfused stages below (the fused ones match them bitwise). The paths are decided once per
call by the backend (:func:`mok_cute.layers.paths.decide`) and kept in the forward state.

Forward (no host sync before the status check): device plan (:func:`plan_routing_device`)
-> dispatch by pull (this rank's expert-grouped rows, plan order: expert, source rank,
token, slot) -> the arch's expert MLP over the [recv_capacity, H] row buffer with
``plan.offsets`` (rows past ``offsets[-1]`` are never read) -> combine by push with the
shared expert's output as the start (acc = fp32(shared) then + w_j * fp32(r_j) in slot
order) -> a copy of the slot buffer (the routed rows r_j of this rank's tokens, needed by
d topk_w) -> ``ws.check_status()``.

The dispatch also pulls each grouped row's router weight (``topk_w`` of its source slot,
fp32, 0 past offsets[-1]) on the device: no NCCL call in the step.

Backward: reverse_combine pulls the dy rows of the routes this rank served, each scaled by
its source slot's router weight from the forward's dispatch, dyj = bf16(fp32(dy) * w)
-> the expert MLP backward -> reverse_dispatch (push dx
rows, then dx = bf16(fp32(dx_shared) + sum_j fp32(dx_j)) in slot order) -> d topk_w[t, j] =
fp32 sum_h dy[t, h] * r_j[t, h] from the saved slot rows -> ``ws.check_status()``.

MXFP8 (``precision="mxfp8"``): each rank quantizes its x rows along H on the device
(:func:`~mok_cute.kernels.quant.quantize.quantize_mxfp8`), the dispatch pulls e4m3 data + E8M0
scales (H + H/32 bytes per row instead of 2H over NVLink) and the expert rank dequantizes them
exactly to bf16 (:func:`~mok_cute.kernels.quant.dequant_mxfp8.dequantize_mxfp8`): the rows are the
MXFP8 round trip of x, which is what the expert MLP at mxfp8 reads (its own round trip of them
is the identity). Combine and the backward's comm stay bf16, as in the reference. One
difference from the reference: the expert rank never holds x itself, so dWg / dWu quantize the
dequantized rows along tokens where the reference quantizes x (equal to the reference layer
run on x's round trip; they differ where a feature is small against its row's 32-block
maximum but not against its token block's).

sm100 (compile-verified only; at EP > 1 only with a path asked for in the config): the fused
forward's ep variant and ``backward_fused_ep`` as the sm90 MLP's, or the unfused stages above.

Every rank of the group must hold the same T (the workspace is per (T, H, k, E)) and issue
the same sequence of layer calls. The group is a torch.distributed group or a virtual group
(:mod:`mok_cute.comm.virtual`: R ranks as threads of one process on one GPU). Precisions: those
of the arch's path table at EP > 1 (:mod:`mok_cute.layers.paths`). ``MoKConfig``:
``device_timeout_s`` bounds every device-side wait (the workspace's timeout), ``comm_sms_fwd`` /
``comm_sms_bwd`` are the CTAs of the forward (dispatch, combine) and backward (reverse combine,
reverse dispatch) comm kernels.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mok_cute.config import BackwardPath, ForwardPath
from mok_cute.layers.common import (
    EPState, ExpertGroup, ExpertWeights, mlp_options, shared_backward, shared_forward, topk_w_grad,
    whole_offsets,
)
from mok_cute.reference import MoEGrads


def forward(mlp, inp, group, ep: int, config, paths):
    """``(y [T, H] bf16, EPState)`` of this rank's layer call at EP = ``ep`` along ``paths.forward``
    (``config``: the call's config, its trace resolved; ``paths``: decided by the backend)."""
    from mok_cute.comm.combine import combine
    from mok_cute.comm.dispatch import dispatch
    from mok_cute.comm.workspace import get_workspace
    from mok_cute.comm.planner import plan_routing_device

    x, idx, limit = inp.x, inp.topk_idx, inp.swiglu_limit
    t, k = idx.shape
    h = x.shape[1]
    ws = get_workspace(group, T=t, H=h, k=k, E=inp.w_gate.shape[0] * ep, timeout_s=config.device_timeout_s)
    plan = plan_routing_device(ws, idx)
    ctas = config.comm_ctas_fwd(ep)
    if paths.forward is ForwardPath.FUSED:
        return _fused_forward(mlp, inp, (ws, plan), config, paths)
    kw = mlp_options(config)
    if config.precision == "mxfp8":
        from mok_cute.kernels.quant.dequant_mxfp8 import dequantize_mxfp8
        from mok_cute.kernels.quant.quantize import quantize_mxfp8

        q, sc, w_rows = dispatch(ws, quantize_mxfp8(x, -1), plan, payload="mxfp8", topk_w=inp.topk_w, num_ctas=ctas)
        x_rows = dequantize_mxfp8(q.contiguous(), sc.contiguous())
    else:
        x_rows, w_rows = dispatch(ws, x, plan, topk_w=inp.topk_w, num_ctas=ctas)
    r, routed = mlp.forward(x_rows, plan.offsets, inp.w_gate, inp.w_up, inp.w_down, limit, **kw)
    s, shared_group = shared_forward(mlp, x, inp.shared, limit, **kw)
    y = combine(ws, r, inp.topk_w, plan, shared_out=s, num_ctas=ctas)
    slot_out = ws.view("slots", torch.bfloat16, (t, k, h)).clone()
    ws.check_status()
    state = EPState(ws, plan, limit, idx, w_rows, ExpertWeights(inp.w_gate, inp.w_up, inp.w_down), inp.shared,
                    routed, shared_group, slot_out, config, paths)
    return y, state


def _fused_forward(mlp, inp, comm, config, paths):
    """The forward through the arch's fused kernel at EP > 1 (``comm`` = the workspace and the plan
    already made): the same :class:`EPState` as the unfused stages (routed rows pulled by the
    kernel, slot rows copied out of the workspace for d topk_w)."""
    ws, plan = comm
    x, idx, limit = inp.x, inp.topk_idx, inp.swiglu_limit
    t, k = idx.shape
    y, gu, h, slot_out, gus, hs, w_rows = mlp.fused_forward_ep(
        ws, plan, x, idx, inp.topk_w, inp.w_gate, inp.w_up, inp.w_down, inp.shared, limit, config,
        num_ctas=ws.grid_ctas)
    prec = config.precision
    routed = ExpertGroup(None, plan.offsets, gu, h, prec)  # rows pulled again by the backward
    shared_group = None
    if inp.shared is not None:
        shared_group = ExpertGroup(x, whole_offsets(t, x.device), gus, hs, prec)
    ws.check_status()
    return y, EPState(ws, plan, limit, idx, w_rows, ExpertWeights(inp.w_gate, inp.w_up, inp.w_down), inp.shared,
                      routed, shared_group, slot_out.view(t, k, -1), config, paths, x=x)


def backward(mlp, st: EPState, dy: torch.Tensor) -> MoEGrads:
    """The gradients of the forward that made ``st``, along ``st.paths.backward``: FUSED /
    FUSED_WHOLE the arch's one launch per rank (``backward_fused_ep``: dy / x rows pulled, dx rows
    pushed, d topk_w and the shared expert in the launch; the table allows it after the fused
    forward only), UNFUSED the comm kernels around the MLP's separate kernels."""
    from mok_cute.comm.combine import reverse_dispatch
    from mok_cute.comm.dispatch import dispatch, reverse_combine

    ws, plan, ctas = st.ws, st.plan, st.config.comm_ctas_bwd()
    if st.paths.backward is not BackwardPath.UNFUSED:
        out = mlp.backward_fused_ep(st, dy)
        ws.check_status()
        return MoEGrads(*out)
    if st.x is not None:  # the fused forward's rows went through its ring: pull them again
        st.routed = replace(st.routed, x=dispatch(ws, st.x, plan, num_ctas=ctas))
    dyr = reverse_combine(ws, dy, plan, num_ctas=ctas)
    dy_rows = (dyr.float() * st.w_rows[:, None]).to(torch.bfloat16)
    dxr, dwg, dwu, dwd = mlp.backward(st.routed, dy_rows, *st.weights, st.limit, fused=False, config=st.config)
    dxs, d_shared = shared_backward(mlp, st.shared_group, dy, st.shared, st.limit, config=st.config)
    dx = reverse_dispatch(ws, dxr, plan, dx_shared=dxs, num_ctas=ctas)
    dtw = topk_w_grad(dy, st.slot_out, st.topk_idx)
    ws.check_status()
    return MoEGrads(dx, dtw, dwg, dwu, dwd, d_shared)

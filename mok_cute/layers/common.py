"""What both layer paths (EP = 1: :mod:`mok_cute.layers.grouped`, EP > 1:
:mod:`mok_cute.layers.ep`) and the arch expert MLPs (:mod:`mok_cute.layers.sm90`,
:mod:`mok_cute.layers.sm100`) share: the expert group's forward state, the MLP's GEMM
sequence over an arch's grouped GEMM calls, the shared expert as one more group, d topk_w, and
the fused backward's switches."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class ExpertGroup:
    """One expert group's forward state: rows x, offsets, gu = [g | u], h, and the precision
    the forward ran in (the backward runs in the same)."""

    x: torch.Tensor
    offsets: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    precision: str = "bf16"


def mlp_forward(gemm1_swiglu, gemm, x_rows, offsets, w_gate, w_up, w_down, limit):
    """(rows [M, H], ExpertGroup): h = SwiGLU GEMM1 (gu, h), then GEMM2, through an arch's
    grouped GEMM calls (``gemm1_swiglu(x, offsets, w_gate, w_up, limit) -> (gu, h)``,
    ``gemm(a, offsets, w) -> out``)."""
    gu, h = gemm1_swiglu(x_rows, offsets, w_gate, w_up, limit)
    return gemm(h, offsets, w_down), ExpertGroup(x_rows, offsets, gu, h)


def mlp_backward(dswiglu_dgrad, dgrad1, wgrad, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit):
    """(dx rows, dWg, dWu, dWd): dgrad2 + dSwiGLU, dgrad1 and the three weight gradients,
    through an arch's grouped GEMM calls (argument order of ``sm90.expert_bwd``)."""
    inter = w_gate.shape[1]
    dgu = dswiglu_dgrad(dy_rows, g.offsets, w_down, g.gu, limit)
    dx = dgrad1(dgu, g.offsets, w_gate, w_up)
    dwd = wgrad(dy_rows, g.h, g.offsets)
    dwg = wgrad(dgu[:, :inter], g.x, g.offsets)
    dwu = wgrad(dgu[:, inter:], g.x, g.offsets)
    return dx, dwg, dwu, dwd


def whole_offsets(rows: int, device) -> torch.Tensor:
    """int32 [0, rows] on ``device``: the offsets of one group holding every row (made on the
    device: no host copy, capturable)."""
    return torch.arange(2, dtype=torch.int32, device=device) * rows


def shared_forward(mlp, x, shared, limit, **kw):
    """The shared expert as one more group (all T tokens): (out [T, H], ExpertGroup), or
    (None, None) without one."""
    if shared is None:
        return None, None
    return mlp.forward(x, whole_offsets(x.shape[0], x.device), *(w[None] for w in shared), limit, **kw)


def shared_backward(mlp, group, dy, shared, limit):
    """(dx [T, H], (d ws_gate, d ws_up, d ws_down)) of the shared expert, or (None, None)."""
    if shared is None:
        return None, None
    dxs, *dws = mlp.backward(group, dy, *(w[None] for w in shared), limit)
    return dxs, tuple(d[0] for d in dws)


def shared_launch_operands(group: ExpertGroup | None, shared, contiguous: bool = False):
    """The shared expert's operands of a whole-backward launch, ``(offsets int32, gu, h, ws_gate,
    ws_up, ws_down)``; None without one; False where the launch does not take them (gu / h not
    contiguous, a weight without a unit last stride, or with ``contiguous`` any weight not
    contiguous)."""
    from mok_cute.dsl.host import offsets_i32

    if shared is None:
        return None
    ok = group.gu.is_contiguous() and group.h.is_contiguous() and all(w.stride(-1) == 1 for w in shared)
    if not ok or (contiguous and not all(w.is_contiguous() for w in shared)):
        return False
    return (offsets_i32(group.offsets), group.gu, group.h, *shared)


def topk_w_grad(dy, slot_out, topk_idx):
    """d topk_w [T, k] fp32: dy . r_j per slot (fp32 sum over H), zero for -1 slots
    (:func:`mok_cute.kernels.route_grad.slot_dtopk_w`: one pass, no [T, k, H] temporaries)."""
    from mok_cute.kernels.route_grad import slot_dtopk_w

    return slot_dtopk_w(dy.contiguous(), slot_out.contiguous(), topk_idx.long().contiguous())


def ring_chunks(config, topk_idx) -> int:
    """Slots of 128 rows (the fused kernels' ``CHUNK``, one m-tile) in a fused forward's ring: the
    routed rows of ``minibatch_tokens`` tokens at k slots each (``ceil(minibatch_tokens * k / 128)``)."""
    return -(-config.minibatch_tokens * topk_idx.shape[1] // 128)


def fused_bwd_mode() -> int:
    """``MOK_CUTE_FUSED_BWD`` (read at every call; every mode bitwise the unfused backward on an
    H200): 0 the unfused backward; 1 the routed backward's GEMMs in one fused launch
    (``kernels/sm90/fused_bwd.py``); 2 (default: the fastest measured, docs/benchmarks.md) the
    same launch also scattering the dx rows to their slots and summing them; 3 also the routed
    dy rows, d topk_w and x rows (the route_grad pass and the x gather) and the shared expert's
    tiles in it: the whole backward in one launch."""
    mode = os.environ.get("MOK_CUTE_FUSED_BWD", "2").strip() or "2"
    if mode not in ("0", "1", "2", "3"):
        raise ValueError(f"MOK_CUTE_FUSED_BWD must be 0, 1, 2 or 3, got {mode!r}")
    return int(mode)


def fused_bwd_mx_prologue() -> bool:
    """``MOK_CUTE_FUSED_BWD_MX_PROLOGUE`` (read at every call; default 1, 0 turns it off): the MXFP8 backward of mode
    2 makes its routed dy rows, d topk_w and x rows and their round trips in two launches over every SM
    (``route_grad.mx_dy_rows_and_dtopk_w`` and ``mx_x_rows``: each 32-row block staged in shared memory a slab at a
    time, every output written once) instead of the route_grad pass, an x gather and three round-trip passes."""
    return os.environ.get("MOK_CUTE_FUSED_BWD_MX_PROLOGUE", "1").strip() != "0"


def fused_bwd_mx() -> bool:
    """The MXFP8 backward through the fused backward too (its ``mx`` variant): on by default
    (bitwise equal to the unfused MXFP8 backward on an H200, ``tools/checks/fused_bwd.py``, and
    faster: docs/benchmarks.md); ``MOK_CUTE_FUSED_BWD_MX=0`` (read at every call) turns it off."""
    return os.environ.get("MOK_CUTE_FUSED_BWD_MX", "1").strip() != "0"

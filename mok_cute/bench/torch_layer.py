"""The MoE layers a PyTorch user writes without mok_cute: the baselines of ``python -m mok_cute.bench``
(EP = 1) and ``tools/bench_layer_ep.py`` (EP > 1).

:func:`torch_layer` (one GPU): stable sort of the routes by expert, ``F.grouped_mm`` for gate / up
(one [E, 2I, H] weight), clamped SwiGLU, ``F.grouped_mm`` for down, the fp32 ``index_add_`` of the
weighted rows, the dense shared expert; autograd backward. :func:`torch_ep_layer` (a Megatron
user's all-to-all dispatcher): the routes permuted by destination rank and expert,
``all_to_all_single`` of the token rows (and their local expert ids), the same expert MLP, the
reverse ``all_to_all_single`` and the fp32 weighted combine; differentiable
(``torch.distributed.nn``), the split sizes exchanged on the host (one sync per call).

Operands of both: x [T, H] bf16 (this rank's tokens), topk_idx [T, k] expert ids (-1: none;
global ids at EP > 1), topk_w [T, k] fp32, w1 [E(_local), 2I, H] bf16 = cat([w_gate, w_up], 1),
wd [E(_local), H, I] bf16, shared = (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s]) bf16 or
None, limit None or L > 0 (gate clamped to <= L, up to [-L, L], as mok_cute's ``swiglu_limit``).
Return y [T, H] bf16. Numerics: BF16 GEMMs with torch's own accumulation, the routed rows
summed per token in fp32 (rounded once to bf16), so they track mok_cute.reference within BF16
tolerances, not bitwise (tests/test_torch_ep_layer.py, tests/test_bench.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def expert_mlp(rows, offs, w1, wd, limit):
    """``grouped_mm`` gate / up, clamped SwiGLU, ``grouped_mm`` down over rows grouped by expert
    (``offs`` [E] int32: the groups' end offsets)."""
    inter = w1.shape[1] // 2
    gu = F.grouped_mm(rows, w1.transpose(1, 2), offs=offs)
    g, u = gu[:, :inter], gu[:, inter:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.grouped_mm(F.silu(g) * u, wd.transpose(1, 2), offs=offs)


def _with_shared(y, x, shared):
    """fp32 y plus the dense shared expert's output, rounded to bf16."""
    if shared is not None:
        sg, su, sd = shared
        y = y + (F.silu(x @ sg.t()) * (x @ su.t()) @ sd.t()).float()
    return y.bfloat16()


def torch_layer(x, topk_idx, topk_w, w1, wd, shared=None, limit=None):
    """y [T, H] bf16 of the one-GPU torch layer (see the module doc)."""
    t, k = topk_idx.shape
    e = w1.shape[0]
    flat = topk_idx.reshape(-1)
    # A -1 slot rides in the last expert's group and is weighted out below: a row in no group would get
    # an unspecified gradient from grouped_mm's backward (uninitialized memory, summed into dx).
    key = torch.where(flat >= 0, flat, e - 1)
    order = torch.argsort(key, stable=True)
    offs = torch.cumsum(torch.bincount(key, minlength=e), 0).to(torch.int32)
    r = expert_mlp(x[order // k], offs, w1, wd, limit)
    valid = (flat[order] >= 0)[:, None]
    rows = torch.where(valid, r.float() * topk_w.reshape(-1)[order][:, None], 0.0)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, order // k, rows)
    return _with_shared(y, x, shared)


def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def torch_ep_layer(x, topk_idx, topk_w, w1, wd, shared, limit, group):
    """y [T, H] bf16 of this rank's tokens through the all-to-all torch layer over ``group`` (see
    the module doc; w1 / wd hold this rank's E_local experts, rank p owning global experts
    [p * E_local, (p + 1) * E_local))."""
    from torch.distributed.nn.functional import all_to_all_single

    ep = dist.get_world_size(group)
    t, k = topk_idx.shape
    e_local = w1.shape[0]
    flat = topk_idx.reshape(-1)
    route = torch.nonzero(flat >= 0).squeeze(1)  # kept routes t*k + j
    dest_expert = flat[route]
    order = torch.argsort(dest_expert, stable=True)  # by destination rank, then expert (ids are rank-major)
    route, dest_expert = route[order], dest_expert[order]
    send_counts = torch.bincount(dest_expert // e_local, minlength=ep)
    recv_counts = _exchange_counts(send_counts, group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()  # the host sync
    rows = x[route // k]
    recv_rows = all_to_all_single(torch.empty((sum(recv_sizes), x.shape[1]), dtype=x.dtype, device=x.device), rows,
                                  recv_sizes, send_sizes, group=group)
    recv_expert = torch.empty(sum(recv_sizes), dtype=dest_expert.dtype, device=x.device)
    dist.all_to_all_single(recv_expert, (dest_expert % e_local).contiguous(), recv_sizes, send_sizes, group=group)
    local_order = torch.argsort(recv_expert, stable=True)  # by local expert, then source rank and route
    offs = torch.cumsum(torch.bincount(recv_expert, minlength=e_local), 0).to(torch.int32)
    out_sorted = expert_mlp(recv_rows[local_order], offs, w1, wd, limit)
    out = torch.empty_like(out_sorted).index_copy(0, local_order, out_sorted)  # back to arrival order
    back = all_to_all_single(torch.empty_like(rows), out, send_sizes, recv_sizes, group=group)
    weighted = back.float() * topk_w.reshape(-1)[route][:, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, route // k, weighted)
    return _with_shared(y, x, shared)

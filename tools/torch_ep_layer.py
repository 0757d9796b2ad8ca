"""The MoE layer a Megatron user runs at EP > 1 without mok_cute (issue 16's baseline): permute
the routes by destination rank and expert, ``all_to_all_single`` the token rows (and their
local expert ids) over the process group, ``F.grouped_mm`` gate/up, clamped SwiGLU,
``F.grouped_mm`` down, the reverse ``all_to_all_single``, and the fp32 weighted combine
(``index_add_``), plus the dense shared expert. Differentiable (``torch.distributed.nn``'s
all_to_all_single); the split sizes are exchanged on the host (one sync per call, as Megatron's
alltoall dispatcher does).

    from torch_ep_layer import torch_ep_layer
    y = torch_ep_layer(x, topk_idx, topk_w, w1_local, w_down_local, shared, limit, group)

x [T, H] bf16 (this rank's tokens), topk_idx [T, k] global expert ids (-1: none), topk_w [T, k]
fp32, w1_local [E_local, 2I, H] = [gate; up] of this rank's experts, w_down_local [E_local, H, I],
shared = (ws_gate, ws_up, ws_down) or None. tests/test_torch_ep_layer.py checks it against the
reference backend at EP = 2 (gloo, CPU); tools/bench_layer_ep.py times it next to mok_cute.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single


def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def torch_ep_layer(x, topk_idx, topk_w, w1, wd, shared, limit, group):
    """y [T, H] bf16 of this rank's tokens (see the module doc)."""
    ep = dist.get_world_size(group)
    t, k = topk_idx.shape
    e_local, inter = w1.shape[0], w1.shape[1] // 2
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    route = torch.nonzero(valid).squeeze(1)  # kept routes t*k + j
    dest_expert = flat[route]
    order = torch.argsort(dest_expert, stable=True)  # by destination rank, then expert (ids are rank-major)
    route = route[order]
    dest_expert = dest_expert[order]
    dest_rank = dest_expert // e_local
    send_counts = torch.bincount(dest_rank, minlength=ep)
    recv_counts = _exchange_counts(send_counts, group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()  # the host sync
    rows = x[route // k]
    recv_rows = all_to_all_single(torch.empty((sum(recv_sizes), x.shape[1]), dtype=x.dtype, device=x.device), rows,
                                  recv_sizes, send_sizes, group=group)
    recv_expert = torch.empty(sum(recv_sizes), dtype=dest_expert.dtype, device=x.device)
    dist.all_to_all_single(recv_expert, (dest_expert % e_local).contiguous(), recv_sizes, send_sizes, group=group)
    local_order = torch.argsort(recv_expert, stable=True)  # by local expert, then source rank and route
    offs = torch.cumsum(torch.bincount(recv_expert, minlength=e_local), 0).to(torch.int32)
    gu = F.grouped_mm(recv_rows[local_order], w1.transpose(1, 2), offs=offs)
    g, u = gu[:, :inter], gu[:, inter:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    out_sorted = F.grouped_mm(F.silu(g) * u, wd.transpose(1, 2), offs=offs)
    out = torch.empty_like(out_sorted).index_copy(0, local_order, out_sorted)  # back to arrival order
    back = all_to_all_single(torch.empty_like(rows), out, send_sizes, recv_sizes, group=group)
    weighted = back.float() * topk_w.reshape(-1)[route][:, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, route // k, weighted)
    if shared is not None:
        sg, su, sd = shared
        y = y + (F.silu(x @ sg.t()) * (x @ su.t()) @ sd.t()).float()
    return y.bfloat16()

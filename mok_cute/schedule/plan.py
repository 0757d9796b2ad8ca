"""Routing plan of an expert-parallel MoE layer: the pure-torch spec and the device planner.

Conventions (EP ranks, E global experts, ``E_local = E // EP``; rank p owns experts
``[p*E_local, (p+1)*E_local)``; every rank holds ``T`` tokens with ``k`` slots each):

* a *route* is a source (rank p, token t, slot j) with ``topk_idx[p][t, j] = e >= 0``;
  ``-1`` means "no expert" and routes nowhere;
* *plan order* on the receiving rank: local experts in order; within an expert, routes
  sorted by (source rank, token, slot);
* a route's *packed source index* is ``p*T*k + t*k + j`` (int32);
* ``offsets[r]`` ([E_local+1] int32) are the row offsets of rank r's local experts in its
  expert-grouped buffer; ``offsets[r][-1] = M_r`` rows are received by rank r;
* ``dest_rank[p][t, j]`` / ``dest_row[p][t, j]`` (int32, -1 for no expert) say where the
  route lands: the row of rank ``dest_rank``'s grouped buffer.

:func:`plan_routing` is the specification (global view, all ranks' routings).
:func:`mok_cute.comm.planner.plan_routing_device` computes one rank's :class:`RankPlan` on the GPU
from that rank's ``topk_idx`` alone (counts exchanged through the comm workspace); the result is
bitwise :meth:`RoutingPlan.rank_view`. :func:`check_plan` is what the comm kernels' launchers
check a plan with. This module imports no comm code (the comm layer builds on the schedule).
"""

from dataclasses import dataclass

import torch

from mok_cute.dsl.host import check_tensor


@dataclass
class RankPlan:
    """Routing metadata of one rank (device tensors, int32).

    ``counts`` [EP, E]: routes from each source rank to each expert (all ranks agree).
    ``offsets`` [E_local+1]: grouped-buffer row offsets of this rank's experts.
    ``recv_src`` [capacity]: packed source index per grouped row, valid prefix
    ``offsets[-1]`` (rows beyond are unspecified).
    ``dest_rank``, ``dest_row`` [T, k]: where this rank's routes land (-1: no expert).
    """

    rank: int
    E: int
    EP: int
    T: int
    k: int
    counts: torch.Tensor
    offsets: torch.Tensor
    recv_src: torch.Tensor
    dest_rank: torch.Tensor
    dest_row: torch.Tensor

    @property
    def E_local(self) -> int:
        return self.E // self.EP


@dataclass
class RoutingPlan:
    """Global routing plan (every rank's view), the spec the device planner reproduces.

    ``counts`` [EP, E], ``offsets`` [EP, E_local+1], ``dest_rank``/``dest_row`` [EP, T, k],
    ``recv_src[r]`` [M_r] (packed source indices in plan order); all int32 on the CPU.
    """

    E: int
    EP: int
    T: int
    k: int
    counts: torch.Tensor
    offsets: torch.Tensor
    recv_src: list[torch.Tensor]
    dest_rank: torch.Tensor
    dest_row: torch.Tensor

    @property
    def E_local(self) -> int:
        return self.E // self.EP

    def recv_triples(self, r: int) -> torch.Tensor:
        """Rank r's received routes as [M_r, 3] int64 (source rank, token, slot), plan order."""
        s = self.recv_src[r].long()
        tk = self.T * self.k
        return torch.stack([s // tk, (s % tk) // self.k, s % self.k], dim=1)

    def rank_view(self, r: int) -> RankPlan:
        """Rank r's slice as a :class:`RankPlan` (``recv_src`` exactly ``M_r`` long)."""
        return RankPlan(r, self.E, self.EP, self.T, self.k, self.counts.clone(),
                        self.offsets[r].clone(), self.recv_src[r].clone(),
                        self.dest_rank[r].clone(), self.dest_row[r].clone())


def validate_routing(topk_idx: torch.Tensor, E: int, EP: int) -> None:
    """Raise TypeError/ValueError unless ``topk_idx`` is an integer [T, k] routing for E/EP."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, k], got shape {tuple(topk_idx.shape)}")
    if EP < 1 or E < 1 or E % EP:
        raise ValueError(f"E ({E}) must be a positive multiple of EP ({EP})")


def plan_routing(topk_idx_per_rank: list[torch.Tensor], E: int, EP: int) -> RoutingPlan:
    """Pure-torch routing plan from every rank's ``topk_idx`` ([T, k] int, -1 = no expert)."""
    if not isinstance(topk_idx_per_rank, (list, tuple)) or len(topk_idx_per_rank) != EP:
        raise ValueError(f"need a list of EP={EP} topk_idx tensors")
    for t in topk_idx_per_rank:
        validate_routing(t, E, EP)
    T, k = topk_idx_per_rank[0].shape
    if any(tuple(t.shape) != (T, k) for t in topk_idx_per_rank):
        raise ValueError("every rank's topk_idx must have the same shape [T, k]")
    idx = torch.stack([t.detach().cpu().long().reshape(-1) for t in topk_idx_per_rank])  # [EP, N]
    if idx.numel() and (idx.min() < -1 or idx.max() >= E):
        raise ValueError(f"topk_idx values must be in [-1, {E})")
    El, N = E // EP, T * k
    valid = idx >= 0
    e_safe = idx.clamp(min=0)
    counts = torch.zeros(EP, E, dtype=torch.long)
    counts.scatter_add_(1, e_safe, valid.long())
    total = counts.sum(0)                                            # [E]
    per_rank = total.view(EP, El)
    offsets = torch.zeros(EP, El + 1, dtype=torch.long)
    offsets[:, 1:] = per_rank.cumsum(1)
    # start of expert e in its owner's buffer, plus the rows of lower source ranks
    start = offsets[:, :El].reshape(E) + (counts.cumsum(0) - counts)  # [EP, E]
    dest_rank = torch.where(valid, idx // El, -1)
    dest_row = torch.full_like(idx, -1)
    recv_src = [torch.empty(int(offsets[r, El]), dtype=torch.long) for r in range(EP)]
    pos = torch.arange(N)
    for p in range(EP):
        key = torch.where(valid[p], idx[p], E)                       # -1 sorts last
        order = torch.sort(key, stable=True).indices
        sk = key[order]
        first = torch.searchsorted(sk, sk, side="left")
        local_rank = torch.empty(N, dtype=torch.long)
        local_rank[order] = pos - first                              # rank within expert
        rows = start[p, e_safe[p]] + local_rank
        dest_row[p] = torch.where(valid[p], rows, -1)
        for r in range(EP):
            m = valid[p] & (dest_rank[p] == r)
            recv_src[r][rows[m]] = p * N + pos[m]
    i32 = torch.int32
    return RoutingPlan(E, EP, T, k, counts.to(i32), offsets.to(i32), [s.to(i32) for s in recv_src],
                       dest_rank.view(EP, T, k).to(i32), dest_row.view(EP, T, k).to(i32))


def route_weights(recv_src: torch.Tensor, offsets: torch.Tensor,
                  topk_w_all: torch.Tensor) -> torch.Tensor:
    """Torch mirror of the router weights that a dispatch with ``topk_w`` pulls: [capacity]
    fp32 weight of each grouped row; row i < offsets[-1] with packed source ``recv_src[i] =
    p*T*k + t*k + j`` gets ``topk_w_all[p, t, j]`` (``topk_w_all`` [EP, T, k] or its flat
    view); rows at or past offsets[-1] (unspecified recv_src) get 0. No host sync."""
    flat = topk_w_all.reshape(-1)
    rows = torch.arange(recv_src.shape[0], device=recv_src.device)
    valid = rows < offsets[-1].to(rows.dtype)
    zero = torch.zeros((), dtype=torch.long, device=recv_src.device)
    src = torch.where(valid, recv_src.long(), zero)
    return torch.where(valid, flat[src], torch.zeros((), dtype=flat.dtype, device=flat.device))


def check_plan(ws, plan) -> None:
    """ValueError/TypeError unless ``plan`` is this rank's device plan for the shapes of ``ws`` (a
    :class:`~mok_cute.comm.workspace.CommWorkspace`)."""
    if not isinstance(plan, RankPlan):
        raise TypeError(f"plan must be a RankPlan, got {type(plan).__name__}")
    want = (ws.me, ws.E, ws.EP, ws.T, ws.k)
    got = (plan.rank, plan.E, plan.EP, plan.T, plan.k)
    if got != want:
        raise ValueError(f"plan (rank, E, EP, T, k) = {got} does not match the workspace {want}")
    check_tensor("plan.offsets", plan.offsets, torch.int32, (ws.E // ws.EP + 1,), ws.device)
    check_tensor("plan.recv_src", plan.recv_src, torch.int32, (None,), ws.device)
    check_tensor("plan.dest_rank", plan.dest_rank, torch.int32, (ws.T, ws.k), ws.device)

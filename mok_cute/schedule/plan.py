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
:func:`plan_routing_device` computes one rank's :class:`RankPlan` on the GPU from that
rank's ``topk_idx`` alone: counts are exchanged through symmetric memory, the prefix sums
run in a fixed order, and each source pushes its packed indices to the receiving ranks.
No host sync, no NCCL; the result is bitwise :meth:`RoutingPlan.rank_view`.
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


# ---------------------------------------------------------------------------------------
# Device planner (one CTA of 1024 threads = 32 warps; built lazily: needs the CuTe DSL)
#
# Warp w owns a contiguous chunk of this rank's N = T*k routes. Pass 1 counts routes per
# (warp, expert) with match.any (leaders add the group size); a per-expert exclusive scan
# over warps gives each warp's first rank within the expert and this rank's counts row,
# which is pushed to every peer (CNT). After all rows arrived, fixed-order sums give each
# expert's start in its owner's buffer plus the rows of lower source ranks; pass 2 walks
# the chunks again to give every route its row (stable: warp, then group, then lane order
# = route order), writes dest_rank/dest_row, and pushes the packed index to the owner's
# recv scratch (META). The owner copies its scratch out and releases it (META_FREE).
# ---------------------------------------------------------------------------------------
PLAN_THREADS = 1024
PLAN_MAX_EXPERTS = 1024


def _plan_launcher():
    from mok_cute.comm import protocol as P
    from mok_cute.comm.protocol import cute, cutlass, gptr
    from cutlass import Constexpr, Int32, Int64

    if hasattr(_plan_launcher, "fn"):
        return _plan_launcher.fn
    warps = PLAN_THREADS // 32

    @cute.jit
    def route_expert(tk: cute.Tensor, i: Int32, c1: Int32, E: Constexpr, status: cute.Pointer,
                     me: Int32, epoch: Int32, report: Constexpr) -> Int32:
        """Expert of route ``i`` (-1 past ``c1`` or outside [0, E); ``report``: ids outside
        [-1, E) are recorded as BAD_EXPERT)."""
        e = Int32(-1)
        if i < c1:
            e = tk[i]
            if e < -1 or e >= E:
                if cutlass.const_expr(report):
                    P.report(status, Int32(P.BAD_EXPERT), me, Int32(P.CNT), epoch)
                e = Int32(-1)
        return e

    @cute.jit
    def count_group(hist: cute.Tensor, w: Int32, E: Constexpr, e: Int32, m: Int32, lt: Int32):
        """The lowest lane of each match group (mask ``m``, expert ``e`` >= 0) adds the group
        size to warp ``w``'s count ``hist[w * E + e]``."""
        if e >= 0:
            if (m & lt) == 0:
                hist[w * E + e] += Int32(cute.arch.popc(m))

    @cute.kernel
    def plan_kernel(peer_bases: cute.Pointer, status: cute.Pointer, topk: cute.Pointer,
                    counts_out: cute.Pointer, offsets_out: cute.Pointer, recv_out: cute.Pointer,
                    dest_rank_out: cute.Pointer, dest_row_out: cute.Pointer, cap: Int32,
                    me: Int32, ep: Int32, n: Int32, counts_off: Int64, recv_off: Int64,
                    flags_off: Int64, epoch: Int32, timeout_ns: Int64, E: Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        w = tidx // 32
        pb = cute.make_tensor(peer_bases, cute.make_layout(ep))
        local = pb[me]
        e_local = E // ep
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(warps * E), byte_alignment=16)
        base = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        total = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        misc = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        tk = cute.make_tensor(topk, cute.make_layout(n))
        chunk = (n + PLAN_THREADS - 1) // PLAN_THREADS * 32
        c0 = w * chunk
        c1 = cutlass.min(c0 + chunk, n)
        lt = cute.arch.lanemask_lt()
        if tidx == 0:
            P.wait_all(local + flags_off, Int32(P.META_FREE), ep, epoch - 1, timeout_ns, status)
        for x in range(tidx, warps * E, PLAN_THREADS):
            hist[x] = Int32(0)
        cute.arch.barrier()
        # pass 1: per-(warp, expert) counts
        g = c0
        while g < c1:
            e = route_expert(tk, g + lane, c1, E, status, me, epoch, True)
            m = cute.arch.match_sync(0xFFFFFFFF, e)
            count_group(hist, w, E, e, m, lt)
            cute.arch.sync_warp()
            g += 32
        cute.arch.barrier()
        # exclusive scan over warps per expert; push this rank's counts row to every rank
        for e in range(tidx, E, PLAN_THREADS):
            run = Int32(0)
            for ww in range(warps):
                c = hist[ww * E + e]
                hist[ww * E + e] = run
                run += c
            if not P.failed(status):
                for q in range(ep):
                    cute.arch.store(gptr(Int32, pb[q] + counts_off + Int64(me * E + e) * 4), run)
        cute.arch.barrier()
        if tidx == 0:
            if not P.failed(status):
                P.signal_all(pb, flags_off, Int32(P.CNT), me, ep, epoch)
                P.wait_all(local + flags_off, Int32(P.CNT), ep, epoch, timeout_ns, status)
        cute.arch.barrier()
        if not P.failed(status):
            counts = cute.make_tensor(gptr(Int32, local + counts_off), cute.make_layout(ep * E))
            cout = cute.make_tensor(counts_out, cute.make_layout(ep * E))
            for e in range(tidx, E, PLAN_THREADS):
                tot = Int32(0)
                before = Int32(0)
                for q in range(ep):
                    c = counts[q * E + e]
                    cout[q * E + e] = c
                    tot += c
                    if q < me:
                        before += c
                total[e] = tot
                base[e] = before
            cute.arch.barrier()
            offs = cute.make_tensor(offsets_out, cute.make_layout(e_local + 1))
            if tidx < ep:
                run = Int32(0)
                for le in range(e_local):
                    e = tidx * e_local + le
                    if tidx == me:
                        offs[le] = run
                    base[e] = base[e] + run
                    run += total[e]
                if tidx == me:
                    offs[e_local] = run
                    misc[0] = run
            cute.arch.barrier()
            # pass 2: rows, dest metadata, packed indices pushed to the owners
            drk = cute.make_tensor(dest_rank_out, cute.make_layout(n))
            drw = cute.make_tensor(dest_row_out, cute.make_layout(n))
            g = c0
            while g < c1:
                i = g + lane
                e = route_expert(tk, i, c1, E, status, me, epoch, False)
                m = cute.arch.match_sync(0xFFFFFFFF, e)
                if e >= 0:
                    row = base[e] + hist[w * E + e] + Int32(cute.arch.popc(m & lt))
                    d = e // e_local
                    drk[i] = d
                    drw[i] = row
                    cute.arch.store(gptr(Int32, pb[d] + recv_off + Int64(row) * 4), me * n + i)
                else:
                    if i < c1:
                        drk[i] = Int32(-1)
                        drw[i] = Int32(-1)
                cute.arch.sync_warp()
                count_group(hist, w, E, e, m, lt)
                cute.arch.sync_warp()
                g += 32
            cute.arch.barrier()
            if tidx == 0:
                P.signal_all(pb, flags_off, Int32(P.META), me, ep, epoch)
                P.wait_all(local + flags_off, Int32(P.META), ep, epoch, timeout_ns, status)
            cute.arch.barrier()
            if not P.failed(status):
                mrecv = misc[0]
                if mrecv > cap:
                    if tidx == 0:
                        P.report(status, Int32(P.OVERFLOW), mrecv, Int32(P.META), epoch)
                    mrecv = cap
                scratch = cute.make_tensor(gptr(Int32, local + recv_off), cute.make_layout(cap))
                rout = cute.make_tensor(recv_out, cute.make_layout(cap))
                for x in range(tidx, mrecv, PLAN_THREADS):
                    rout[x] = scratch[x]
                cute.arch.barrier()
                if tidx == 0:
                    P.signal_all(pb, flags_off, Int32(P.META_FREE), me, ep, epoch)

    @cute.jit
    def plan_host(peer_bases: cute.Pointer, status: cute.Pointer, topk: cute.Pointer,
                  counts_out: cute.Pointer, offsets_out: cute.Pointer, recv_out: cute.Pointer,
                  dest_rank_out: cute.Pointer, dest_row_out: cute.Pointer, cap: Int32,
                  me: Int32, ep: Int32, n: Int32, counts_off: Int64, recv_off: Int64,
                  flags_off: Int64, epoch: Int32, timeout_ns: Int64, stream, E: Constexpr):
        plan_kernel(peer_bases, status, topk, counts_out, offsets_out, recv_out, dest_rank_out,
                    dest_row_out, cap, me, ep, n, counts_off, recv_off, flags_off, epoch,
                    timeout_ns, E).launch(grid=[1, 1, 1], block=[PLAN_THREADS, 1, 1],
                                          smem=(warps + 2) * E * 4 + 64, stream=stream)

    _plan_launcher.fn = plan_host
    return plan_host


def compile_plan(arch: str, E: int, inspect: bool = False):
    """Compile the device planner for ``arch`` and E experts; ``(compiled, report | None)``."""
    from cutlass import Int32, Int64

    from mok_cute.dsl.compile import compile_kernel
    from mok_cute.dsl.host import fake_ptr, fake_stream

    if not 1 <= E <= PLAN_MAX_EXPERTS:
        raise ValueError(f"E must be in [1, {PLAN_MAX_EXPERTS}], got {E}")
    i32 = fake_ptr("i32")
    return compile_kernel(_plan_launcher(), fake_ptr("i64"), i32, i32, i32, i32, i32, i32, i32,
                          Int32(1), Int32(0), Int32(1), Int32(1), Int64(0), Int64(0), Int64(0),
                          Int32(1), Int64(1), fake_stream(), E, arch=arch, inspect=inspect)


def plan_routing_device(ws, topk_idx: torch.Tensor) -> RankPlan:
    """This rank's :class:`RankPlan` computed on the GPU from its ``topk_idx`` [T, k]
    (int32/int64, -1 = no expert). Collective over ``ws`` (a :class:`CommWorkspace`);
    launches on the current stream, no host sync. ``recv_src`` has ``ws.recv_capacity``
    rows. Out-of-range ids and capacity overflow are reported by ``ws.check_status()``.
    ``offsets`` start at zero: a plan that gave up (a peer's counts did not arrive in time) leaves
    no rows, so the kernels after it in the step move and multiply nothing until
    ``ws.check_status()`` raises (uninitialized offsets would send the GEMMs' tile walk anywhere)."""
    from cutlass import Int32, Int64

    from mok_cute.dsl.compile import compile_cached
    from mok_cute.dsl.host import current_stream, dptr

    validate_routing(topk_idx, ws.E, ws.EP)
    check_tensor("topk_idx", topk_idx, topk_idx.dtype, (ws.T, ws.k), ws.device)
    fn = compile_cached(("comm.plan", ws.arch, ws.E), lambda: compile_plan(ws.arch, ws.E)[0])
    idx = topk_idx.to(torch.int32).contiguous()
    dev, i32 = ws.device, torch.int32
    plan = RankPlan(ws.me, ws.E, ws.EP, ws.T, ws.k,
                    counts=torch.empty(ws.EP, ws.E, dtype=i32, device=dev),
                    offsets=torch.zeros(ws.E // ws.EP + 1, dtype=i32, device=dev),
                    recv_src=torch.empty(ws.recv_capacity, dtype=i32, device=dev),
                    dest_rank=torch.empty(ws.T, ws.k, dtype=i32, device=dev),
                    dest_row=torch.empty(ws.T, ws.k, dtype=i32, device=dev))
    epoch = ws.next_epoch("plan")
    fn(dptr(ws.peer_bases), dptr(ws.status), dptr(idx), dptr(plan.counts), dptr(plan.offsets),
       dptr(plan.recv_src), dptr(plan.dest_rank), dptr(plan.dest_row), Int32(ws.recv_capacity),
       Int32(ws.me), Int32(ws.EP), Int32(ws.T * ws.k), Int64(ws.offsets["counts"]),
       Int64(ws.offsets["recv"]), Int64(ws.offsets["flags"]), Int32(epoch),
       Int64(ws.timeout_ns), current_stream())
    return plan


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

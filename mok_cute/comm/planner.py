"""The device routing planner: one rank's :class:`~mok_cute.schedule.plan.RankPlan` computed on
the GPU from that rank's ``topk_idx`` alone, a collective over the comm workspace.

Counts are exchanged through symmetric memory (channel CNT), the prefix sums run in a fixed
order, and each source pushes its packed indices to the receiving ranks (META, released with
META_FREE; :mod:`mok_cute.comm.protocol`). No host sync, no NCCL; the result is bitwise the
specification's :meth:`~mok_cute.schedule.plan.RoutingPlan.rank_view`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute, cutlass, gptr
from mok_cute.dsl.host import check_tensor
from mok_cute.schedule.plan import RankPlan, validate_routing
from cutlass import Constexpr, Int32, Int64


class PlanOut(NamedTuple):
    """The planner's outputs (int32 pointers, :class:`~mok_cute.schedule.plan.RankPlan`'s tensors):
    ``counts`` [EP, E], ``offsets`` [E_local+1], ``recv_src`` [cap], ``dest_rank`` / ``dest_row``
    [T, k]."""

    counts: cute.Pointer
    offsets: cute.Pointer
    recv_src: cute.Pointer
    dest_rank: cute.Pointer
    dest_row: cute.Pointer


class PlanDims(NamedTuple):
    """Int32 sizes: ``cap`` rows of ``recv_src``, this rank ``me`` of ``ep``, ``n = T*k`` routes."""

    cap: Int32
    me: Int32
    ep: Int32
    n: Int32


class PlanSections(NamedTuple):
    """Int64 byte offsets of the workspace sections the planner uses: ``counts`` [EP, E] int32,
    ``recv`` [EP*T*k] int32 (the pushed packed indices), ``flags``."""

    counts: Int64
    recv: Int64
    flags: Int64


_launcher: list = []  # the planner's host launcher, built once


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
    """The planner's ``@cute.jit`` host launcher (built once)."""
    if _launcher:
        return _launcher[0]
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
    def plan_kernel(peer_bases: cute.Pointer, status: cute.Pointer, topk: cute.Pointer, out: PlanOut,
                    dims: PlanDims, sections: PlanSections, epoch: Int32, timeout_ns: Int64, E: Constexpr):
        counts_out, offsets_out, recv_out, dest_rank_out, dest_row_out = out
        cap, me, ep, n = dims
        counts_off, recv_off, flags_off = sections
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
    def plan_host(peer_bases: cute.Pointer, status: cute.Pointer, topk: cute.Pointer, out: PlanOut,
                  dims: PlanDims, sections: PlanSections, epoch: Int32, timeout_ns: Int64, stream, E: Constexpr):
        plan_kernel(peer_bases, status, topk, out, dims, sections, epoch, timeout_ns, E).launch(
            grid=[1, 1, 1], block=[PLAN_THREADS, 1, 1], smem=(warps + 2) * E * 4 + 64, stream=stream)

    _launcher.append(plan_host)
    return plan_host


def compile_plan(arch: str, E: int, inspect: bool = False):
    """Compile the device planner for ``arch`` and E experts; ``(compiled, report | None)``."""
    from mok_cute.dsl.compile import compile_kernel
    from mok_cute.dsl.host import fake_ptr, fake_stream

    if not 1 <= E <= PLAN_MAX_EXPERTS:
        raise ValueError(f"E must be in [1, {PLAN_MAX_EXPERTS}], got {E}")
    i32 = fake_ptr("i32")
    return compile_kernel(_plan_launcher(), fake_ptr("i64"), i32, i32, PlanOut(i32, i32, i32, i32, i32),
                          PlanDims(Int32(1), Int32(0), Int32(1), Int32(1)), PlanSections(Int64(0), Int64(0), Int64(0)),
                          Int32(1), Int64(1), fake_stream(), E, arch=arch, inspect=inspect)


def plan_routing_device(ws, topk_idx: torch.Tensor) -> RankPlan:
    """This rank's :class:`RankPlan` computed on the GPU from its ``topk_idx`` [T, k]
    (int32/int64, -1 = no expert). Collective over ``ws`` (a :class:`CommWorkspace`);
    launches on the current stream, no host sync. ``recv_src`` has ``ws.recv_capacity``
    rows. Out-of-range ids and capacity overflow are reported by ``ws.check_status()``.
    ``offsets`` start at zero: a plan that gave up (a peer's counts did not arrive in time) leaves
    no rows, so the kernels after it in the step move and multiply nothing until
    ``ws.check_status()`` raises (uninitialized offsets would send the GEMMs' tile walk anywhere)."""
    from mok_cute.dsl.compile import compile_cached  # looked up per call (tests stand in for them)
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
    fn(dptr(ws.peer_bases), dptr(ws.status), dptr(idx),
       PlanOut(dptr(plan.counts), dptr(plan.offsets), dptr(plan.recv_src), dptr(plan.dest_rank), dptr(plan.dest_row)),
       PlanDims(Int32(ws.recv_capacity), Int32(ws.me), Int32(ws.EP), Int32(ws.T * ws.k)),
       PlanSections(Int64(ws.offsets["counts"]), Int64(ws.offsets["recv"]), Int64(ws.offsets["flags"])),
       Int32(epoch), Int64(ws.timeout_ns), current_stream())
    return plan



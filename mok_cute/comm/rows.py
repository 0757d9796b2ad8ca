"""Grid-stride copy of routed 16-byte row vectors between this rank's expert-grouped buffer
and the peers' symmetric buffers (device side of dispatch/reverse combine and of the push
half of combine/reverse dispatch).

Grouped row ``i < M = offsets[e_local]`` (clamped to the buffer's rows, reporting OVERFLOW)
holds the route ``recv_src[i] = p*T*k + t*k + j`` of source rank p; an index outside
``[0, EP*T*k)`` is reported as BAD_INDEX. Every thread of ``nctas`` CTAs of ``THREADS``
walks the (row, vector) pairs with a grid stride.
"""
from __future__ import annotations

from typing import NamedTuple

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute, cutlass, gptr
from cutlass import BFloat16, Constexpr, Int32, Int64

THREADS = 1024  # threads per CTA of every row-moving comm kernel
# 16-byte vectors in flight per thread in the pull without weights and the push of combine /
# reverse dispatch: eight loads issued before their stores bought 11-18% at 8..32 CTAs over one
# (2x H200, 2026-11-29, commit 5266de1; docs/benchmarks.md); 4 spilled at 1024 threads
UNROLL = 8
TRANSPORTS = ("plain", "bulk")  # MoKConfig.comm_transport's values


def check_transport(transport: str) -> str:
    """``transport`` if it is one of :data:`TRANSPORTS` (``"plain"``: 16-byte loads and stores
    by every thread, the verified default; ``"bulk"``: cp.async.bulk row copies), else ValueError."""
    if transport not in TRANSPORTS:
        raise ValueError(f"comm transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


class Routes(NamedTuple):
    """The plan's grouped rows (:class:`~mok_cute.schedule.plan.RankPlan`): ``recv_src`` int32
    [capacity] packed source ``p*T*k + t*k + j`` per grouped row, ``offsets`` int32 [E_local+1]
    (valid prefix ``M = offsets[E_local]``). Pointers."""

    recv_src: cute.Pointer
    offsets: cute.Pointer


class Grouped(NamedTuple):
    """This rank's expert-grouped buffer: ``rows`` [n, V] 16-byte vectors (bf16 rows, or packed
    MXFP8 bytes: never converted), ``w_rows`` int32 [n] (the fp32 router weight bits of each row,
    written by the weighted pull; None otherwise), ``n`` (Int32) its rows."""

    rows: cute.Pointer
    w_rows: cute.Pointer | None
    n: Int32


class Dims(NamedTuple):
    """Rank and shapes (Int32): this rank ``me`` of ``ep``, ``T`` tokens per rank with ``k`` slots,
    ``V`` 16-byte vectors per row, ``e_local`` experts per rank."""

    me: Int32
    ep: Int32
    T: Int32
    k: Int32
    V: Int32
    e_local: Int32


class Sections(NamedTuple):
    """Byte offsets (Int64) of workspace sections, the same on every rank: ``rows`` the peers'
    row buffer (``src`` [T, V*16 bytes] for a pull, ``slots`` [T*k, V*16 bytes] for a push), ``w``
    the router weights [T, k] fp32 (the weighted pull only; None otherwise), ``flags``."""

    rows: Int64
    w: Int64 | None
    flags: Int64


@cute.jit
def routed_rows(tidx: Int32, bidx: Int32, status: cute.Pointer, routes: Routes, grouped_rows: Int32,
                e_local: Int32, channel: Int32, epoch: Int32):
    """``(M, recv_src)`` of a row mover: ``M = offsets[e_local]`` clamped to the buffer's
    ``grouped_rows`` (thread 0 of CTA 0 reports OVERFLOW when clamping), and ``recv_src`` as
    a tensor of ``grouped_rows`` route indices."""
    offs = cute.make_tensor(routes.offsets, cute.make_layout(e_local + 1))
    m = offs[e_local]
    if m > grouped_rows:
        if bidx == 0:
            if tidx == 0:
                P.report(status, Int32(P.OVERFLOW), m, channel, epoch)
        m = grouped_rows
    return m, cute.make_tensor(routes.recv_src, cute.make_layout(grouped_rows))


@cute.jit
def copy_routed_rows(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer, routes: Routes,
                     grouped: Grouped, dims: Dims, offs: Sections, channel: Int32, rnd: P.Round):
    """Pull, one 16-byte vector at a time: ``grouped.rows[i]`` = row t of rank p's buffer
    ``[T, V]`` at ``offs.rows``. The thread/block indices come from the caller (computed once per
    kernel). With ``grouped.w_rows``: the thread of vector 0 of grouped row i also copies the
    route's 4-byte router weight (``offs.w + (t*k + j)*4`` on rank p) to ``w_rows[i]`` (int32 bits)."""
    T, k, V = dims.T, dims.k, dims.V
    tk = T * k
    grouped_rows, nctas = grouped.n, rnd.nctas
    m, rs = routed_rows(tidx, bidx, status, routes, grouped_rows, dims.e_local, channel, rnd.epoch)
    local = cute.make_tensor(grouped.rows, cute.make_layout((grouped_rows * V, 8), stride=(8, 1)))
    n = m * V
    i = bidx * THREADS + tidx
    lim = dims.ep * tk
    while i < n:
        row, s, ok = _route_of(rs, i, V, lim)
        if ok:
            p = s // tk
            t = (s - p * tk) // k
            # 64-bit address of the 16-byte source vector on rank p
            addr = pb[p] + offs.rows + (Int64(t) * Int64(V) + Int64(i - row * V)) * 16
            src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
            local[i, None].store(src.load())
            if cutlass.const_expr(grouped.w_rows is not None):
                if i == row * V:
                    wsrc = cute.make_tensor(gptr(Int32, pb[p] + offs.w + Int64(s - p * tk) * 4, 4),
                                            cute.make_layout(1))
                    cute.make_tensor(grouped.w_rows, cute.make_layout(grouped_rows))[row] = wsrc[0]
        else:
            P.report(status, Int32(P.BAD_INDEX), row, channel, rnd.epoch)
        i += nctas * THREADS


@cute.jit
def copy_routed_rows_unrolled(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer, routes: Routes,
                              grouped: Grouped, dims: Dims, offs: Sections, channel: Int32, rnd: P.Round,
                              push: Constexpr):
    """Pull (``push`` False): ``grouped.rows[i]`` = row t of rank p's buffer ``[T, V]`` at
    ``offs.rows``; push: ``grouped.rows[i]`` goes to slot ``t*k + j`` of rank p's buffer ``[T*k, V]``
    at ``offs.rows``. :data:`UNROLL` grid-stride steps per loop trip: the trip's 16-byte loads (peer
    loads when pulling) are all issued before its stores, so each thread keeps :data:`UNROLL`
    vectors in flight instead of one (plain peer loads are latency-bound). Same rows, addresses
    and reports as :func:`copy_routed_rows`; peer addresses in 64 bits."""
    T, k, V = dims.T, dims.k, dims.V
    tk = T * k
    grouped_rows, nctas, peer_off = grouped.n, rnd.nctas, offs.rows
    m, rs = routed_rows(tidx, bidx, status, routes, grouped_rows, dims.e_local, channel, rnd.epoch)
    local = cute.make_tensor(grouped.rows, cute.make_layout((grouped_rows * V, 8), stride=(8, 1)))
    buf = cute.make_rmem_tensor((8, UNROLL), BFloat16)  # column u: vector u of the trip
    n = m * V
    stride = nctas * THREADS
    i = bidx * THREADS + tidx
    lim = dims.ep * tk
    while i < n:
        for u in cutlass.range_constexpr(UNROLL):
            j = i + u * stride
            if j < n:
                row, s, ok = _route_of(rs, j, V, lim)
                if ok:
                    if cutlass.const_expr(not push):
                        p = s // tk
                        t = (s - p * tk) // k
                        addr = pb[p] + peer_off + (Int64(t) * Int64(V) + Int64(j - row * V)) * 16
                        src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                        buf[None, u].store(src.load())
                    else:
                        buf[None, u].store(local[j, None].load())
                else:
                    P.report(status, Int32(P.BAD_INDEX), row, channel, rnd.epoch)
        for u in cutlass.range_constexpr(UNROLL):
            j = i + u * stride
            if j < n:
                row, s, ok = _route_of(rs, j, V, lim)
                if ok:
                    if cutlass.const_expr(not push):
                        local[j, None].store(buf[None, u].load())
                    else:
                        p = s // tk
                        addr = pb[p] + peer_off + (Int64(s - p * tk) * Int64(V) + Int64(j - row * V)) * 16
                        dst = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                        dst.store(buf[None, u].load())
        i += UNROLL * stride


@cute.jit
def _route_of(rs: cute.Tensor, j: Int32, V: Int32, lim: Int32):
    """``(row, route, valid)`` of vector ``j``: its grouped row, the row's packed route
    ``recv_src[row]`` and whether that lies in ``[0, lim)``."""
    row = j // V
    s = rs[row]
    return row, s, s >= 0 and s < lim


# ---------------------------------------------------------------------------------------------
# Bulk-copy transport (``transport="bulk"``; the pulls and the pushes run natively on one H200 at
# EP = 1 since protocol.wait_all became one flat poll loop, commit 5af2a71, 2026-12-01; EP > 1 and
# its speed not yet measured): whole rows move as cp.async.bulk global->shared (mbarrier
# complete_tx) and shared->global (bulk_group) through a ring of BULK_STAGES shared-memory chunks
# of BULK_CHUNK bytes, issued by thread 0 of each CTA. Used only by the separate bulk kernels
# (dispatch.pull_bulk_launcher, combine.push_reduce_bulk_launcher); the default kernels never
# reference it.
# Alignment: every row is V*16 bytes, chunks start at multiples of BULK_CHUNK (16 KiB) within
# a row, so sizes and global addresses (16-byte aligned buffers / 256-byte aligned workspace
# sections) stay 16-byte aligned; ring stages are 16 KiB apart from a 128-byte aligned base;
# each stage's mbarrier expects exactly the bytes of its one copy.

BULK_CHUNK = 16384   # bytes per stage (a row of H*2 bytes moves as ceil(H*2 / BULK_CHUNK) chunks)
BULK_STAGES = 8      # shared-memory ring depth (BULK_STAGES - 1 loads in flight per CTA)
BULK_SMEM = BULK_CHUNK * BULK_STAGES + 8 * BULK_STAGES + 256  # dynamic shared memory per CTA


@cute.jit
def bulk_g2s(smem_addr: Int32, gaddr: Int64, nbytes: Int32, mbar_addr: Int32):
    """cp.async.bulk global -> shared of ``nbytes`` (multiple of 16), completing on the mbarrier."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[{$r0}], [{$r1}], {$r2}, [{$r3}];", read_only_args=[smem_addr, gaddr, nbytes, mbar_addr])


@cute.jit
def bulk_s2g(gaddr: Int64, smem_addr: Int32, nbytes: Int32):
    """cp.async.bulk shared -> global of ``nbytes`` in the current bulk group."""
    cute.arch.inline_ptx("cp.async.bulk.global.shared::cta.bulk_group [{$r0}], [{$r1}], {$r2};",
                         read_only_args=[gaddr, smem_addr, nbytes])


@cute.jit
def bulk_ring(n: Int32, j0: Int32, stages: Constexpr, mbar: cute.Pointer, load, store):
    """One thread moves items ``0 .. n-1`` through a shared-memory ring of ``stages`` bulk-copy stages: item ``i``
    uses stage ``(j0 + i) % stages`` (``j0``: the items this thread moved through the ring before, so each stage's
    mbarrier phase carries on); ``load(i, stage)`` issues its global -> shared copy completing on ``mbar + stage``
    (or only arrives there), ``store(i, stage)`` its shared -> global copy (or nothing). ``stages - 1`` loads are in
    flight; a stage is loaded again only once the store that read it has (``wait_group.read``). Returns after every
    store completed (``cp.async.bulk.wait_group 0``) and a ``fence.proxy.async.global``, so that the caller's release
    orders the stores before its signal."""
    i = Int32(0)
    while i < n and i < stages - 1:
        load(i, (j0 + i) % stages)
        i += 1
    i = Int32(0)
    while i < n:
        j = j0 + i
        stage = j % stages
        cute.arch.mbarrier_wait(mbar + stage, (j // stages) % 2)
        store(i, stage)
        cute.arch.cp_async_bulk_commit_group()
        nxt = i + stages - 1
        if nxt < n:  # its stage held item i - 1: that store must have read it
            cute.arch.cp_async_bulk_wait_group(1, read=True)
            load(nxt, (j0 + nxt) % stages)
        i += 1
    cute.arch.cp_async_bulk_wait_group(0)
    cute.arch.fence_proxy("async.global")


class _BulkWalk(NamedTuple):
    """One CTA's walk over the bulk items (trace-time values of :func:`bulk_routed_rows`): block
    ``bidx`` of ``nctas``, ``nch`` chunks of a row of ``rb`` bytes, the peer table ``pb``, the routes
    ``rs``, the grouped buffer's address ``local_base``, the peers' row section ``peer_off``, the
    valid route bound ``lim = EP*T*k``, ``tk = T*k``, ``k``, and the ring's shared address ``ring``."""

    bidx: Int32
    nctas: Int32
    nch: Int32
    rb: Int64
    pb: cute.Tensor
    rs: cute.Tensor
    local_base: Int64
    peer_off: Int64
    lim: Int32
    tk: Int32
    k: Int32
    ring: Int32


@cute.jit
def _bulk_item(w: Int32, walk: _BulkWalk, push: Constexpr):
    """Item ``w`` = chunk ``c`` of grouped row ``row``: (valid, row, c, src, dst, nbytes)."""
    nch, rb, tk = walk.nch, walk.rb, walk.tk
    row = w // nch
    c = w - row * nch
    off = Int64(c) * BULK_CHUNK
    nb = rb - off
    if nb > BULK_CHUNK:
        nb = Int64(BULK_CHUNK)
    s = walk.rs[row]
    ok = (s >= 0) & (s < walk.lim)
    src = Int64(0)
    dst = Int64(0)
    if ok:
        p = s // tk
        local = walk.local_base + Int64(row) * rb + off
        if cutlass.const_expr(not push):
            t = (s - p * tk) // walk.k
            src = walk.pb[p] + walk.peer_off + Int64(t) * rb + off
            dst = local
        else:
            src = local
            dst = walk.pb[p] + walk.peer_off + Int64(s - p * tk) * rb + off
    return ok, row, c, src, dst, Int32(nb)


@cute.jit
def _bulk_issue(j: Int32, stage: Int32, walk: _BulkWalk, mbar: cute.Pointer, status: cute.Pointer, channel: Int32,
                epoch: Int32, push: Constexpr):
    """Issue the load of this CTA's ``j``-th item into ``stage`` (an invalid route reports BAD_INDEX and only
    arrives, so the stage's phase still flips)."""
    ok, row, c, src, dst, nb = _bulk_item(walk.bidx + j * walk.nctas, walk, push)
    if ok:
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + stage, nb)
        bulk_g2s(walk.ring + stage * BULK_CHUNK, src, nb, (mbar + stage).toint())
    else:
        if c == 0:
            P.report(status, Int32(P.BAD_INDEX), row, channel, epoch)
        cute.arch.mbarrier_arrive(mbar + stage)


@cute.jit
def _bulk_store(j: Int32, stage: Int32, walk: _BulkWalk, push: Constexpr):
    """Store this CTA's ``j``-th item from ``stage`` to its destination (nothing for an invalid route)."""
    ok, row, c, src, dst, nb = _bulk_item(walk.bidx + j * walk.nctas, walk, push)
    if ok:
        bulk_s2g(dst, walk.ring + stage * BULK_CHUNK, nb)


@cute.jit
def bulk_routed_rows(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer, routes: Routes,
                     grouped: Grouped, dims: Dims, offs: Sections, channel: Int32, rnd: P.Round,
                     push: Constexpr):
    """The bulk-copy counterpart of :func:`copy_routed_rows_unrolled` (same rows, same reports):
    thread 0 of each CTA moves its items (chunk ``c`` of grouped row ``row``, item ``row*nch + c``,
    grid-stride over CTAs) with ``cp.async.bulk`` through the shared-memory ring; the other
    threads only wait at the caller's barrier. Pull: peer row -> shared -> ``grouped.rows[i]``;
    push: ``grouped.rows[i]`` -> shared -> peer slot. Returns after every bulk store completed
    (``cp.async.bulk.wait_group 0``) and a ``fence.proxy.async.global``, so the caller's
    barrier + release flag order the stores before the signal."""
    tk = dims.T * dims.k
    V, nctas, epoch = dims.V, rnd.nctas, rnd.epoch
    smem = cutlass.memory.SmemAllocator()
    ring_ptr = smem.allocate_array(cutlass.Int8, BULK_CHUNK * BULK_STAGES, byte_alignment=128)
    mbar = smem.allocate_array(Int64, BULK_STAGES, byte_alignment=8)
    if tidx == 0:
        m, rs = routed_rows(tidx, bidx, status, routes, grouped.n, dims.e_local, channel, epoch)
        rb = Int64(V) * 16
        nch = (V * 16 + BULK_CHUNK - 1) // BULK_CHUNK
        n_items = m * nch
        cnt = Int32(0)
        if bidx < n_items:
            cnt = (n_items - bidx + nctas - 1) // nctas
        lim = dims.ep * tk
        local_base = grouped.rows.toint()
        ring = ring_ptr.toint()
        for s in cutlass.range_constexpr(BULK_STAGES):
            cute.arch.mbarrier_init(mbar + s, 1)
        cute.arch.mbarrier_init_fence()
        # order the peer's released generic writes (acquired before the caller's barrier)
        # before this thread's async-proxy accesses
        cute.arch.fence_proxy("async.global")
        walk = _BulkWalk(bidx, nctas, nch, rb, pb, rs, local_base, offs.rows, lim, tk, dims.k, ring)
        bulk_ring(cnt, Int32(0), BULK_STAGES, mbar,
                  lambda j, stage: _bulk_issue(j, stage, walk, mbar, status, channel, epoch, push),
                  lambda j, stage: _bulk_store(j, stage, walk, push))

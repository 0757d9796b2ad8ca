"""Push of expert rows back to their source ranks, then a fixed-order per-token sum:
forward combine and reverse dispatch.

Expert side: grouped row ``i < M = offsets[-1]`` (``recv_src[i] = p*T*k + t*k + j``) of
``rows`` ([>= M, H] bf16, plan order) is stored into rank p's symmetric slot buffer
``slots[t*k + j]`` ([T*k, H] bf16). Source side, once every peer signalled, for each token t:

  acc = fp32(start[t]) if start is given else 0
  for j in 0..k-1 with dest_rank[t, j] >= 0:   acc = acc + w[t, j] * fp32(slots[t*k + j])
  out[t] = bf16(acc)                           (round to nearest even)

with a separate fp32 multiply and add (``mul.rn``/``add.rn``: never fused into an FMA).
Combine: ``w = topk_w``, ``start = shared expert output``; reverse dispatch: no weight
(``acc = acc + fp32(slot)``), ``start = dx of the shared expert``.

Protocol per call (push epoch e): every CTA waits FREE >= e-1 from every peer (the peer
finished reading its slots of the previous push), pushes its rows with plain 16-byte
stores (``MOK_COMM_TRANSPORT=bulk``: the opt-in cp.async.bulk kernel
:func:`push_reduce_bulk_launcher`, not yet run on a GPU), the last CTA signals DATA = e
to every peer; every CTA waits DATA >= e from every peer, reduces its tokens, and the last
CTA signals FREE = e.
"""
from __future__ import annotations

import os

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute, cutlass, gptr
from mok_cute.comm.rows import (BULK_SMEM, THREADS, bulk_routed_rows, copy_routed_rows,
                                copy_routed_rows_unrolled, unroll_of, use_bulk)
from mok_cute.comm.workspace import CommWorkspace, check_num_ctas
from mok_cute.dsl.compile import compile_cached, compile_kernel
from mok_cute.dsl.host import check_tensor, current_stream, dptr, fake_ptr, fake_stream
from mok_cute.schedule.plan import check_plan
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64

SPLIT_PHASES = os.environ.get("MOK_COMM_SPLIT", "0") == "1"  # debugging: two launches, synced
# combine transport: "push" (rows stored into the source rank's slots) or "pull" (the source
# rank reads its rows from the expert rank's staged output and reduces them on the fly)
COMBINE_MODE = os.environ.get("MOK_COMM_COMBINE", "push")
PUSH_STORE = os.environ.get("MOK_COMM_PUSH_STORE", "v4")  # "v4": 16-byte stores, "b32": 4-byte


@cute.jit
def mul_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


@cute.jit
def add_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("add.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


@cute.jit
def _reduce_tokens(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer,
                   dest_rank: cute.Pointer, dest_row: cute.Pointer, weights: cute.Pointer,
                   start: cute.Pointer, out: cute.Pointer, slots_base: Int64, eo_rows: Int32,
                   ep: Int32, T: Int32, k: Int32, tk: Int32, V: Int32, eo_off: Int64, epoch: Int32,
                   nctas: Int32, has_w: Constexpr, has_start: Constexpr, pull: Constexpr):
    """Grid-stride over this rank's (token, vector) pairs: ``out[t] = bf16(start[t] + sum_j
    w[t, j] * slot_j)`` in slot order j with separate mul.rn/add.rn. Slot j of token t
    (``dest_rank[t, j] >= 0``) is local slot ``t*k + j`` of the slot buffer at address
    ``slots_base``, or (``pull``) row ``dest_row[t, j]`` of rank ``dest_rank[t, j]``'s ``eo``
    section ``[eo_rows, H]`` at ``eo_off`` (out of range: OVERFLOW); ``tk = T*k``.
    ``weights`` is the int32 view of the fp32 ``topk_w`` (read only with ``has_w``),
    ``start`` is read only with ``has_start``, ``dest_row`` only with ``pull``. Slot and
    peer addresses are computed in 64 bits."""
    dr = cute.make_tensor(dest_rank, cute.make_layout(tk))
    dst = cute.make_tensor(out, cute.make_layout((T * V, 8), stride=(8, 1)))
    acc = cute.make_rmem_tensor((8,), Float32)
    xf = cute.make_rmem_tensor((8,), Float32)
    n = T * V
    i = bidx * THREADS + tidx
    while i < n:
        t = i // V
        v = i - t * V
        if cutlass.const_expr(has_start):
            st = cute.make_tensor(start, cute.make_layout((T * V, 8), stride=(8, 1)))
            acc.store(st[i, None].load().to(Float32))
        else:
            acc.fill(0.0)
        for j in range(k):
            r = t * k + j
            d = dr[r]
            if d >= 0:
                if cutlass.const_expr(pull):
                    dw = cute.make_tensor(dest_row, cute.make_layout(tk))
                    row = dw[r]
                    if d < ep and row >= 0 and row < eo_rows:
                        addr = pb[d] + eo_off + (Int64(row) * Int64(V) + Int64(v)) * 16
                        src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                        xf.store(src.load().to(Float32))
                        _accumulate(acc, xf, weights, r, tk, has_w)
                    else:
                        P.report(status, Int32(P.OVERFLOW), row, Int32(P.DATA), epoch)
                else:
                    addr = slots_base + (Int64(r) * Int64(V) + Int64(v)) * 16
                    src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                    xf.store(src.load().to(Float32))
                    _accumulate(acc, xf, weights, r, tk, has_w)
        dst[i, None].store(acc.load().to(BFloat16))
        i += nctas * THREADS


@cute.jit
def _accumulate(acc: cute.Tensor, xf: cute.Tensor, weights: cute.Pointer, r: Int32, tk: Int32,
                has_w: Constexpr):
    """``acc += w[r] * xf`` (``acc += xf`` without weights), element by element; ``weights``
    is the int32 view of fp32 ``topk_w``, bit-cast back to fp32 here."""
    if cutlass.const_expr(has_w):
        wt = cute.make_tensor(cute.recast_ptr(weights, dtype=Float32), cute.make_layout(tk))
        w = wt[r]
        for e in cutlass.range_constexpr(8):
            acc[e] = add_rn(acc[e], mul_rn(w, xf[e]))
    else:
        for e in cutlass.range_constexpr(8):
            acc[e] = add_rn(acc[e], xf[e])


@cute.jit
def _push_half(pb: cute.Tensor, status: cute.Pointer, counters: cute.Pointer,
               recv_src: cute.Pointer, offsets: cute.Pointer, rows: cute.Pointer, in_rows: Int32,
               me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32, e_local: Int32,
               slots_off: Int64, flags_off: Int64, epoch: Int32, timeout_ns: Int64, nctas: Int32,
               resets: Constexpr, mover: Constexpr = 1):
    """Wait FREE >= epoch-1, push the grouped rows into the source ranks' slot buffers, and
    arrive on ``counters[0]`` (the last CTA zeroes the first ``resets`` counters, then
    signals DATA = epoch). Plan memory (offsets, recv_src) is local and complete before
    the launch (same stream), so reading it does not depend on the wait. ``mover``: 1 the
    16-byte stores one at a time; n > 1 ``n`` vectors in flight per thread
    (``MOK_COMM_UNROLL``, default 8); ``"bulk"`` cp.async.bulk (opt-in, local row -> shared -> peer slot,
    every bulk store complete and proxy-fenced before the CTA barrier and the DATA signal)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx == 0:
        P.wait_all(pb[me] + flags_off, Int32(P.FREE), ep, epoch - 1, timeout_ns, status)
    cute.arch.barrier()
    if not P.failed(status):
        if cutlass.const_expr(mover == "bulk"):
            bulk_routed_rows(tidx, bidx, pb, status, recv_src, offsets, rows, in_rows, ep, T, k, T * k,
                             V, e_local, slots_off, Int32(P.DATA), epoch, nctas, True)
        elif cutlass.const_expr(mover == 1):
            copy_routed_rows(tidx, bidx, pb, status, recv_src, offsets, rows, in_rows, ep, T, k, T * k,
                             V, e_local, slots_off, Int32(P.DATA), epoch, nctas, True,
                             PUSH_STORE == "b32")
        else:
            copy_routed_rows_unrolled(tidx, bidx, pb, status, recv_src, offsets, rows, in_rows, ep, T, k,
                                      T * k, V, e_local, slots_off, Int32(P.DATA), epoch, nctas, True, mover)
    cute.arch.barrier()
    if tidx == 0:
        P.arrive_and_signal(pb, status, counters, counters, resets, flags_off, Int32(P.DATA), me,
                            ep, epoch, nctas)


@cute.jit
def _reduce_half(pb: cute.Tensor, status: cute.Pointer, counters: cute.Pointer,
                 dest_rank: cute.Pointer, weights: cute.Pointer, start: cute.Pointer,
                 out: cute.Pointer, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                 slots_off: Int64, flags_off: Int64, epoch: Int32, timeout_ns: Int64,
                 nctas: Int32, has_w: Constexpr, has_start: Constexpr):
    """Wait DATA >= epoch, reduce the local slots (their address is only dereferenced after
    the acquire + CTA barrier), arrive on ``counters[1]``; the last CTA zeroes counters 0
    and 1 and signals FREE = epoch."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx == 0:
        P.wait_all(pb[me] + flags_off, Int32(P.DATA), ep, epoch, timeout_ns, status)
    cute.arch.barrier()
    if not P.failed(status):
        _reduce_tokens(tidx, bidx, pb, status, dest_rank, dest_rank, weights, start, out,
                       pb[me] + slots_off, Int32(0), ep, T, k, T * k, V, Int64(0), epoch, nctas,
                       has_w, has_start, False)
    cute.arch.barrier()
    if tidx == 0:
        P.arrive_and_signal(pb, status, counters + 1, counters, 2, flags_off, Int32(P.FREE), me, ep,
                            epoch, nctas)


_launchers: dict = {}


@cute.jit
def _push_reduce_body(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                 recv_src: cute.Pointer, offsets: cute.Pointer, rows: cute.Pointer, in_rows: Int32,
                 dest_rank: cute.Pointer, weights: cute.Pointer, start: cute.Pointer, out: cute.Pointer,
                 me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32, e_local: Int32, slots_off: Int64,
                 flags_off: Int64, epoch: Int32, timeout_ns: Int64, nctas: Int32, phase: Constexpr,
                 has_w: Constexpr, has_start: Constexpr, mover: Constexpr):
    """The push-and-reduce kernel body: ``phase`` 1 = push half only, 2 = reduce half only,
    3 = both; ``mover`` as :func:`_push_half`."""
    pb = cute.make_tensor(peer_bases, cute.make_layout(ep))
    if cutlass.const_expr(phase & 1):  # launched alone the push half resets its counter
        _push_half(pb, status, counters, recv_src, offsets, rows, in_rows, me, ep, T, k, V,
                   e_local, slots_off, flags_off, epoch, timeout_ns, nctas, 1 if phase == 1 else 0, mover)
    if cutlass.const_expr(phase & 2):
        _reduce_half(pb, status, counters, dest_rank, weights, start, out, me, ep, T, k, V,
                     slots_off, flags_off, epoch, timeout_ns, nctas, has_w, has_start)


def _push_host(kernel, smem: int = 0):
    """The ``@cute.jit`` host launcher of a push-and-reduce kernel (``nctas`` CTAs of 1024
    threads on ``stream``; ``smem`` bytes of dynamic shared memory when nonzero)."""

    @cute.jit
    def push_reduce_host(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                         recv_src: cute.Pointer, offsets: cute.Pointer, rows: cute.Pointer,
                         in_rows: Int32, dest_rank: cute.Pointer, weights: cute.Pointer,
                         start: cute.Pointer, out: cute.Pointer, me: Int32, ep: Int32, T: Int32,
                         k: Int32, V: Int32, e_local: Int32, slots_off: Int64, flags_off: Int64,
                         epoch: Int32, timeout_ns: Int64, nctas: Int32, stream):
        launch = kernel(peer_bases, status, counters, recv_src, offsets, rows, in_rows, dest_rank, weights,
                        start, out, me, ep, T, k, V, e_local, slots_off, flags_off, epoch, timeout_ns, nctas)
        if cutlass.const_expr(smem):
            launch.launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], smem=smem, stream=stream)
        else:
            launch.launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return push_reduce_host


def push_reduce_launcher(has_w: bool, has_start: bool, phase: int = 3, unroll: int = 1):
    """The ``@cute.jit`` launcher of one push-and-reduce variant, built once per variant.

    The variant (``has_w``, ``has_start``, ``phase``: 1 = push half only, 2 = reduce half
    only, 3 = both; ``unroll`` > 1: the unrolled push, both halves, kernel
    ``push_unrolled_reduce_kernel``) is fixed by Python closure at build time: the launched
    kernel has no Constexpr parameters and the argument kinds of the pull
    kernel (int64/int32/bf16 pointers, Int32/Int64 scalars). ``weights`` is passed as an
    int32 pointer (the fp32 ``topk_w`` bits) and ``start`` is always a real buffer (the
    workspace's zero ``dummy`` when absent: never read, never aliases ``out``)."""
    key = ("push_reduce", bool(has_w), bool(has_start), int(phase), int(unroll))
    if key in _launchers:
        return _launchers[key]
    has_w, has_start, phase, unroll = bool(has_w), bool(has_start), int(phase), int(unroll)
    if unroll > 1 and phase != 3:
        raise ValueError("the unrolled push-and-reduce runs both halves (phase 3)")

    @cute.kernel
    def push_reduce_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                           recv_src: cute.Pointer, offsets: cute.Pointer, rows: cute.Pointer,
                           in_rows: Int32, dest_rank: cute.Pointer, weights: cute.Pointer,
                           start: cute.Pointer, out: cute.Pointer, me: Int32, ep: Int32, T: Int32,
                           k: Int32, V: Int32, e_local: Int32, slots_off: Int64, flags_off: Int64,
                           epoch: Int32, timeout_ns: Int64, nctas: Int32):
        _push_reduce_body(peer_bases, status, counters, recv_src, offsets, rows, in_rows, dest_rank, weights, start,
                     out, me, ep, T, k, V, e_local, slots_off, flags_off, epoch, timeout_ns, nctas, phase, has_w,
                     has_start, 1)

    @cute.kernel
    def push_unrolled_reduce_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                                    recv_src: cute.Pointer, offsets: cute.Pointer, rows: cute.Pointer,
                                    in_rows: Int32, dest_rank: cute.Pointer, weights: cute.Pointer,
                                    start: cute.Pointer, out: cute.Pointer, me: Int32, ep: Int32, T: Int32,
                                    k: Int32, V: Int32, e_local: Int32, slots_off: Int64, flags_off: Int64,
                                    epoch: Int32, timeout_ns: Int64, nctas: Int32):
        _push_reduce_body(peer_bases, status, counters, recv_src, offsets, rows, in_rows, dest_rank, weights, start,
                     out, me, ep, T, k, V, e_local, slots_off, flags_off, epoch, timeout_ns, nctas, 3, has_w,
                     has_start, unroll)

    _launchers[key] = host = _push_host(push_reduce_kernel if unroll == 1 else push_unrolled_reduce_kernel)
    return host


def push_reduce_bulk_launcher(has_w: bool, has_start: bool):
    """The launcher of the opt-in bulk-copy push-and-reduce (``MOK_COMM_TRANSPORT=bulk``):
    the push half moving rows by cp.async.bulk, then the same :func:`_reduce_half` (the
    fixed-order sum is the plain transport's code). Its own closure and kernel name, the
    argument kinds of :func:`push_reduce_launcher`, ``BULK_SMEM`` bytes of dynamic shared memory."""
    key = ("push_reduce_bulk", bool(has_w), bool(has_start))
    if key in _launchers:
        return _launchers[key]
    has_w, has_start = bool(has_w), bool(has_start)

    @cute.kernel
    def push_reduce_bulk_kernel(peer_bases: cute.Pointer, status: cute.Pointer,
                                counters: cute.Pointer, recv_src: cute.Pointer,
                                offsets: cute.Pointer, rows: cute.Pointer, in_rows: Int32,
                                dest_rank: cute.Pointer, weights: cute.Pointer,
                                start: cute.Pointer, out: cute.Pointer, me: Int32, ep: Int32,
                                T: Int32, k: Int32, V: Int32, e_local: Int32, slots_off: Int64,
                                flags_off: Int64, epoch: Int32, timeout_ns: Int64, nctas: Int32):
        _push_reduce_body(peer_bases, status, counters, recv_src, offsets, rows, in_rows, dest_rank, weights, start,
                     out, me, ep, T, k, V, e_local, slots_off, flags_off, epoch, timeout_ns, nctas, 3, has_w,
                     has_start, "bulk")

    _launchers[key] = host = _push_host(push_reduce_bulk_kernel, BULK_SMEM)
    return host


def compile_push_reduce_bulk(arch: str, has_w: bool, has_start: bool, inspect: bool = False):
    """Compile one bulk-copy push-and-reduce variant; ``(compiled, CompileReport | None)``."""
    i32, bf = fake_ptr("i32"), fake_ptr("bf16")
    return compile_kernel(push_reduce_bulk_launcher(has_w, has_start), fake_ptr("i64"), i32,
                          i32, i32, i32, bf, Int32(1), i32, i32, bf, bf, Int32(0), Int32(1),
                          Int32(1), Int32(1), Int32(1), Int32(1), Int64(0), Int64(0), Int32(1),
                          Int64(1), Int32(1), fake_stream(), arch=arch, inspect=inspect)


def compile_push_reduce(arch: str, has_w: bool, has_start: bool, inspect: bool = False,
                        phase: int = 3, unroll: int = 1):
    """Compile one variant for ``arch``; returns ``(compiled, CompileReport | None)``.
    ``phase`` 1/2 builds only the push/reduce half (debugging: launch both, in order);
    ``unroll`` > 1 the unrolled push (both halves)."""
    i32, bf = fake_ptr("i32"), fake_ptr("bf16")
    return compile_kernel(push_reduce_launcher(has_w, has_start, phase, unroll), fake_ptr("i64"), i32,
                          i32, i32, i32, bf, Int32(1), i32, i32, bf, bf, Int32(0), Int32(1),
                          Int32(1), Int32(1), Int32(1), Int32(1), Int64(0), Int64(0), Int32(1),
                          Int64(1), Int32(1), fake_stream(), arch=arch, inspect=inspect)


def _optional_inputs(ws: CommWorkspace, weights, start):
    """Pointers for the optional inputs: fp32 ``topk_w`` as int32 bits, bf16 ``start``; the
    workspace's zero ``dummy`` buffer (never read) when absent."""
    w = dptr(weights if weights is not None else ws.dummy, Int32)
    s = dptr(start if start is not None else ws.dummy, BFloat16)
    return w, s


def _push_reduce(ws: CommWorkspace, rows: torch.Tensor, plan, weights, start, num_ctas, name,
                 start_name) -> torch.Tensor:
    check_plan(ws, plan)
    check_tensor(name, rows, torch.bfloat16, (None, ws.H), ws.device)
    if weights is not None:
        check_tensor("topk_w", weights, torch.float32, (ws.T, ws.k), ws.device)
    if start is not None:
        check_tensor(start_name, start, torch.bfloat16, (ws.T, ws.H), ws.device)
    nctas = ws.num_ctas if num_ctas is None else num_ctas
    check_num_ctas(nctas)
    if COMBINE_MODE == "pull":
        return _pull_reduce(ws, rows, plan, weights, start, nctas)
    has_w, has_start = weights is not None, start is not None
    phases = (1, 2) if SPLIT_PHASES else (3,)
    out = torch.empty(ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    in_rows = min(rows.shape[0], plan.recv_src.shape[0])
    epoch = ws.next_epoch("push")
    w_ptr, s_ptr = _optional_inputs(ws, weights, start)
    bulk = use_bulk("push") and not SPLIT_PHASES
    unroll = 1 if SPLIT_PHASES else unroll_of()
    for ph in phases:
        if bulk:
            fn = compile_cached(("comm.push_reduce_bulk", ws.arch, has_w, has_start),
                                lambda: compile_push_reduce_bulk(ws.arch, has_w, has_start)[0])
        elif unroll > 1:
            fn = compile_cached(("comm.push_reduce_unrolled", ws.arch, has_w, has_start, unroll),
                                lambda: compile_push_reduce(ws.arch, has_w, has_start, unroll=unroll)[0])
        else:
            fn = compile_cached(("comm.push_reduce", ws.arch, has_w, has_start, ph),
                                lambda: compile_push_reduce(ws.arch, has_w, has_start, phase=ph)[0])
        fn(dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["push"]), dptr(plan.recv_src),
           dptr(plan.offsets), dptr(rows), Int32(in_rows), dptr(plan.dest_rank), w_ptr, s_ptr,
           dptr(out), Int32(ws.me), Int32(ws.EP), Int32(ws.T), Int32(ws.k), Int32(ws.H // 8),
           Int32(ws.E // ws.EP), Int64(ws.offsets["slots"]), Int64(ws.offsets["flags"]),
           Int32(epoch), Int64(ws.timeout_ns), Int32(nctas), current_stream())
        if SPLIT_PHASES:
            torch.cuda.synchronize()
            print(f"[comm rank {ws.me}] push_reduce phase {ph} (epoch {epoch}): ok", flush=True)
    return out


def pull_reduce_launcher(has_w: bool, has_start: bool):
    """The ``@cute.jit`` launcher of one pull-combine variant (closure-specialized like
    :func:`push_reduce_launcher`: no Constexpr kernel parameters)."""
    key = ("pull_reduce", bool(has_w), bool(has_start))
    if key in _launchers:
        return _launchers[key]
    has_w, has_start = bool(has_w), bool(has_start)

    @cute.kernel
    def pull_reduce_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                           dest_rank: cute.Pointer, dest_row: cute.Pointer, weights: cute.Pointer,
                           start: cute.Pointer, out: cute.Pointer, eo_rows: Int32, me: Int32,
                           ep: Int32, T: Int32, k: Int32, V: Int32, eo_off: Int64,
                           flags_off: Int64, epoch: Int32, timeout_ns: Int64, nctas: Int32):
        """Combine by pull: every expert rank staged its rows (plan order) in its symmetric
        ``eo`` section and signalled DATA; this rank reads row ``dest_row[t, j]`` of rank
        ``dest_rank[t, j]`` straight into the fixed-order sum, then signals FREE."""
        P.pull_round(peer_bases, status, counters, me, ep, flags_off, epoch, timeout_ns, nctas,
                     lambda tidx, bidx, pb: _reduce_tokens(
                         tidx, bidx, pb, status, dest_rank, dest_row, weights, start, out, Int64(0), eo_rows, ep,
                         T, k, T * k, V, eo_off, epoch, nctas, has_w, has_start, True),
                     P.DATA, P.FREE)

    kernel = pull_reduce_kernel

    @cute.jit
    def pull_reduce_host(peer_bases: cute.Pointer, status: cute.Pointer, counters: cute.Pointer,
                         dest_rank: cute.Pointer, dest_row: cute.Pointer, weights: cute.Pointer,
                         start: cute.Pointer, out: cute.Pointer, eo_rows: Int32, me: Int32,
                         ep: Int32, T: Int32, k: Int32, V: Int32, eo_off: Int64, flags_off: Int64,
                         epoch: Int32, timeout_ns: Int64, nctas: Int32, stream):
        kernel(peer_bases, status, counters, dest_rank, dest_row, weights, start, out, eo_rows, me,
               ep, T, k, V, eo_off, flags_off, epoch, timeout_ns, nctas).launch(
            grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    _launchers[key] = host = pull_reduce_host
    return host


def compile_pull_reduce(arch: str, has_w: bool, has_start: bool, inspect: bool = False):
    """Compile one pull-combine variant for ``arch``; ``(compiled, CompileReport | None)``."""
    i32, bf = fake_ptr("i32"), fake_ptr("bf16")
    return compile_kernel(pull_reduce_launcher(has_w, has_start), fake_ptr("i64"), i32, i32, i32,
                          i32, i32, bf, bf, Int32(1), Int32(0), Int32(1), Int32(1), Int32(1),
                          Int32(1), Int64(0), Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(),
                          arch=arch, inspect=inspect)


def _pull_reduce(ws: CommWorkspace, rows: torch.Tensor, plan, weights, start, num_ctas) -> torch.Tensor:
    nctas = ws.num_ctas if num_ctas is None else num_ctas
    has_w, has_start = weights is not None, start is not None
    fn = compile_cached(("comm.pull_reduce", ws.arch, has_w, has_start),
                        lambda: compile_pull_reduce(ws.arch, has_w, has_start)[0])
    out = torch.empty(ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    ws.stage_eo(rows)
    epoch = ws.next_epoch("push")
    w_ptr, s_ptr = _optional_inputs(ws, weights, start)
    fn(dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["pull_reduce"]), dptr(plan.dest_rank),
       dptr(plan.dest_row), w_ptr, s_ptr, dptr(out), Int32(ws.recv_capacity), Int32(ws.me),
       Int32(ws.EP), Int32(ws.T), Int32(ws.k), Int32(ws.H // 8), Int64(ws.offsets["eo"]),
       Int64(ws.offsets["flags"]), Int32(epoch), Int64(ws.timeout_ns), Int32(nctas),
       current_stream())
    return out


def combine(ws: CommWorkspace, expert_out: torch.Tensor, topk_w: torch.Tensor, plan,
            shared_out: torch.Tensor | None = None, *, num_ctas: int | None = None) -> torch.Tensor:
    """Forward combine by push: ``expert_out`` [>= M, H] bf16 (this rank's expert outputs in
    plan order) goes to the source ranks; returns this rank's ``y`` [T, H] bf16 =
    bf16(fp32(shared_out or 0) + sum_j topk_w[t, j] * fp32(slot_j)). ``topk_w`` [T, k] fp32.
    Collective; current stream, no host sync."""
    return _push_reduce(ws, expert_out, plan, topk_w, shared_out, num_ctas, "expert_out",
                        "shared_out")


def reverse_dispatch(ws: CommWorkspace, dx_expert: torch.Tensor, plan,
                     dx_shared: torch.Tensor | None = None, *,
                     num_ctas: int | None = None) -> torch.Tensor:
    """Backward of dispatch by push: ``dx_expert`` [>= M, H] bf16 (input grads of this rank's
    expert rows, plan order) goes to the source ranks; returns this rank's ``dx`` [T, H] bf16
    = bf16(fp32(dx_shared or 0) + sum_j fp32(slot_j)). Collective; current stream."""
    return _push_reduce(ws, dx_expert, plan, None, dx_shared, num_ctas, "dx_expert", "dx_shared")

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
finished reading its slots of the previous push), pushes its rows (``transport="plain"``: 16-byte
stores, :data:`~mok_cute.comm.rows.UNROLL` vectors in flight per thread; ``"bulk"``: the
cp.async.bulk kernel :func:`push_reduce_bulk_launcher`), the last CTA signals DATA = e to every
peer; every CTA waits DATA >= e from every peer, reduces its tokens, and the last CTA signals
FREE = e.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import Link, Round, cute, cutlass, gptr
from mok_cute.comm.rows import (BULK_SMEM, THREADS, Dims, Grouped, Routes, Sections, bulk_routed_rows,
                                check_transport, copy_routed_rows_unrolled)
from mok_cute.comm.workspace import CommWorkspace, check_num_ctas
from mok_cute.dsl.compile import compile_cached, compile_kernel
from mok_cute.dsl.host import check_tensor, current_stream, dptr, fake_ptr, fake_stream
from mok_cute.schedule.plan import check_plan
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64


class Sum(NamedTuple):
    """The source side's fixed-order sum (pointers): ``dest_rank`` int32 [T, k] (-1: no expert),
    ``weights`` int32 [T, k] (the fp32 ``topk_w`` bits; read only by a weighted variant), ``start``
    bf16 [T, H] (read only by a variant with a start), ``out`` bf16 [T, H]. An absent input is the
    workspace's zero ``dummy`` (never read, never aliases ``out``)."""

    dest_rank: cute.Pointer
    weights: cute.Pointer
    start: cute.Pointer
    out: cute.Pointer


@cute.jit
def mul_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


@cute.jit
def add_rn(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("add.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


@cute.jit
def _reduce_tokens(tidx: Int32, bidx: Int32, sm: Sum, slots_base: Int64, dims: Dims, nctas: Int32,
                   has_w: Constexpr, has_start: Constexpr):
    """Grid-stride over this rank's (token, vector) pairs: ``out[t] = bf16(start[t] + sum_j
    w[t, j] * slot_j)`` in slot order j with separate mul.rn/add.rn. Slot j of token t
    (``dest_rank[t, j] >= 0``) is local slot ``t*k + j`` of the slot buffer at address
    ``slots_base``. ``weights`` is read only with ``has_w``, ``start`` only with ``has_start``.
    Slot addresses are computed in 64 bits."""
    T, k, V = dims.T, dims.k, dims.V
    tk = T * k
    dr = cute.make_tensor(sm.dest_rank, cute.make_layout(tk))
    dst = cute.make_tensor(sm.out, cute.make_layout((T * V, 8), stride=(8, 1)))
    acc = cute.make_rmem_tensor((8,), Float32)
    xf = cute.make_rmem_tensor((8,), Float32)
    n = T * V
    i = bidx * THREADS + tidx
    while i < n:
        t = i // V
        v = i - t * V
        if cutlass.const_expr(has_start):
            st = cute.make_tensor(sm.start, cute.make_layout((T * V, 8), stride=(8, 1)))
            acc.store(st[i, None].load().to(Float32))
        else:
            acc.fill(0.0)
        for j in range(k):
            r = t * k + j
            d = dr[r]
            if d >= 0:
                addr = slots_base + (Int64(r) * Int64(V) + Int64(v)) * 16
                src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                xf.store(src.load().to(Float32))
                _accumulate(acc, xf, sm.weights, r, tk, has_w)
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
def _push_half(pb: cute.Tensor, link: Link, routes: Routes, grouped: Grouped, dims: Dims, offs: Sections,
               rnd: Round, bulk: Constexpr):
    """Wait FREE >= epoch-1, push the grouped rows into the source ranks' slot buffers, and
    arrive on ``counters[0]`` (the last CTA signals DATA = epoch; :func:`_reduce_half` zeroes the
    counter). Plan memory (offsets, recv_src) is local and complete before the launch (same
    stream), so reading it does not depend on the wait. The rows move by 16-byte stores,
    :data:`~mok_cute.comm.rows.UNROLL` vectors in flight per thread, or (``bulk``) by cp.async.bulk
    (local row -> shared -> peer slot, every bulk store complete and proxy-fenced before the CTA
    barrier and the DATA signal)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    me, ep, status = dims.me, dims.ep, link.status
    if tidx == 0:
        P.wait_all(pb[me] + offs.flags, Int32(P.FREE), ep, rnd.epoch - 1, rnd.timeout_ns, status)
    cute.arch.barrier()
    if not P.failed(status):
        if cutlass.const_expr(bulk):
            bulk_routed_rows(tidx, bidx, pb, status, routes, grouped, dims, offs, Int32(P.DATA), rnd, True)
        else:
            copy_routed_rows_unrolled(tidx, bidx, pb, status, routes, grouped, dims, offs, Int32(P.DATA), rnd,
                                      True)
    cute.arch.barrier()
    if tidx == 0:
        P.arrive_and_signal(pb, status, link.counters, link.counters, 0, offs.flags, Int32(P.DATA), me, ep,
                            rnd.epoch, rnd.nctas)


@cute.jit
def _reduce_half(pb: cute.Tensor, link: Link, sm: Sum, dims: Dims, offs: Sections, rnd: Round,
                 has_w: Constexpr, has_start: Constexpr):
    """Wait DATA >= epoch, reduce the local slots (their address is only dereferenced after
    the acquire + CTA barrier), arrive on ``counters[1]``; the last CTA zeroes counters 0
    and 1 and signals FREE = epoch."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    me, ep, status = dims.me, dims.ep, link.status
    if tidx == 0:
        P.wait_all(pb[me] + offs.flags, Int32(P.DATA), ep, rnd.epoch, rnd.timeout_ns, status)
    cute.arch.barrier()
    if not P.failed(status):
        _reduce_tokens(tidx, bidx, sm, pb[me] + offs.rows, dims, rnd.nctas, has_w, has_start)
    cute.arch.barrier()
    if tidx == 0:
        P.arrive_and_signal(pb, status, link.counters + 1, link.counters, 2, offs.flags, Int32(P.FREE), me, ep,
                            rnd.epoch, rnd.nctas)


_launchers: dict = {}


@cute.jit
def _push_reduce_body(link: Link, routes: Routes, grouped: Grouped, sm: Sum, dims: Dims, offs: Sections,
                      rnd: Round, has_w: Constexpr, has_start: Constexpr, bulk: Constexpr):
    """The push-and-reduce kernel body: the push half, then the reduce half; ``bulk`` as
    :func:`_push_half`."""
    pb = cute.make_tensor(link.peer_bases, cute.make_layout(dims.ep))
    _push_half(pb, link, routes, grouped, dims, offs, rnd, bulk)
    _reduce_half(pb, link, sm, dims, offs, rnd, has_w, has_start)


def _push_host(kernel, smem: int = 0):
    """The ``@cute.jit`` host launcher of a push-and-reduce kernel (``rnd.nctas`` CTAs of 1024
    threads on ``stream``; ``smem`` bytes of dynamic shared memory when nonzero). The kernel's
    operands: ``link`` (peer table, status, push counters), ``routes`` (the plan's recv_src and
    offsets), ``grouped`` (the expert rows, no ``w_rows``), ``sm``, ``dims`` (``V = H / 8``),
    ``offs`` (the ``slots`` section, no ``w``, ``flags``), ``rnd``."""

    @cute.jit
    def push_reduce_host(link: Link, routes: Routes, grouped: Grouped, sm: Sum, dims: Dims, offs: Sections,
                         rnd: Round, stream):
        launch = kernel(link, routes, grouped, sm, dims, offs, rnd)
        if cutlass.const_expr(smem):
            launch.launch(grid=[rnd.nctas, 1, 1], block=[THREADS, 1, 1], smem=smem, stream=stream)
        else:
            launch.launch(grid=[rnd.nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return push_reduce_host


def push_reduce_launcher(has_w: bool, has_start: bool):
    """The ``@cute.jit`` launcher of one push-and-reduce variant (kernel ``push_reduce_kernel``),
    built once per variant.

    The variant (``has_w``, ``has_start``) is fixed by Python closure at build time: the launched
    kernel has no Constexpr parameters, only int64/int32/bf16 pointers and Int32/Int64 scalars
    (in its operand bundles). ``weights`` is an int32 pointer (the fp32 ``topk_w`` bits) and
    ``start`` is always a real buffer (the workspace's zero ``dummy`` when absent: never read,
    never aliases ``out``)."""
    key = ("push_reduce", bool(has_w), bool(has_start))
    if key in _launchers:
        return _launchers[key]
    has_w, has_start = bool(has_w), bool(has_start)

    @cute.kernel
    def push_reduce_kernel(link: Link, routes: Routes, grouped: Grouped, sm: Sum, dims: Dims, offs: Sections,
                           rnd: Round):
        _push_reduce_body(link, routes, grouped, sm, dims, offs, rnd, has_w, has_start, False)

    _launchers[key] = host = _push_host(push_reduce_kernel)
    return host


def push_reduce_bulk_launcher(has_w: bool, has_start: bool):
    """The launcher of the bulk-copy push-and-reduce (``transport="bulk"``): the push half moving
    rows by cp.async.bulk, then the same :func:`_reduce_half` (the fixed-order sum is the plain
    transport's code). Its own closure and kernel name, the operands of
    :func:`push_reduce_launcher`, ``BULK_SMEM`` bytes of dynamic shared memory."""
    key = ("push_reduce_bulk", bool(has_w), bool(has_start))
    if key in _launchers:
        return _launchers[key]
    has_w, has_start = bool(has_w), bool(has_start)

    @cute.kernel
    def push_reduce_bulk_kernel(link: Link, routes: Routes, grouped: Grouped, sm: Sum, dims: Dims,
                                offs: Sections, rnd: Round):
        _push_reduce_body(link, routes, grouped, sm, dims, offs, rnd, has_w, has_start, True)

    _launchers[key] = host = _push_host(push_reduce_bulk_kernel, BULK_SMEM)
    return host


def _fake_operands():
    """Compile-time placeholders of a push-and-reduce's bundles (every variant takes the same)."""
    i32, bf = fake_ptr("i32"), fake_ptr("bf16")
    return (Link(fake_ptr("i64"), i32, i32), Routes(i32, i32), Grouped(bf, None, Int32(1)), Sum(i32, i32, bf, bf),
            Dims(Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1)), Sections(Int64(0), None, Int64(0)),
            Round(Int32(1), Int64(1), Int32(1)))


def compile_push_reduce(arch: str, has_w: bool, has_start: bool, inspect: bool = False):
    """Compile one push-and-reduce variant for ``arch``; ``(compiled, CompileReport | None)``."""
    return compile_kernel(push_reduce_launcher(has_w, has_start), *_fake_operands(), fake_stream(), arch=arch,
                          inspect=inspect)


def compile_push_reduce_bulk(arch: str, has_w: bool, has_start: bool, inspect: bool = False):
    """Compile one bulk-copy push-and-reduce variant; ``(compiled, CompileReport | None)``."""
    return compile_kernel(push_reduce_bulk_launcher(has_w, has_start), *_fake_operands(), fake_stream(),
                          arch=arch, inspect=inspect)


def _optional_inputs(ws: CommWorkspace, weights, start):
    """Pointers for the optional inputs: fp32 ``topk_w`` as int32 bits, bf16 ``start``; the
    workspace's zero ``dummy`` buffer (never read) when absent."""
    w = dptr(weights if weights is not None else ws.dummy, Int32)
    s = dptr(start if start is not None else ws.dummy, BFloat16)
    return w, s


def _push_reduce(ws: CommWorkspace, rows: torch.Tensor, plan, weights, start, num_ctas, name,
                 start_name, transport: str) -> torch.Tensor:
    check_transport(transport)
    check_plan(ws, plan)
    check_tensor(name, rows, torch.bfloat16, (None, ws.H), ws.device)
    if weights is not None:
        check_tensor("topk_w", weights, torch.float32, (ws.T, ws.k), ws.device)
    if start is not None:
        check_tensor(start_name, start, torch.bfloat16, (ws.T, ws.H), ws.device)
    nctas = ws.num_ctas if num_ctas is None else num_ctas
    check_num_ctas(nctas)
    has_w, has_start = weights is not None, start is not None
    out = torch.empty(ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    in_rows = min(rows.shape[0], plan.recv_src.shape[0])
    epoch = ws.next_epoch("push")
    w_ptr, s_ptr = _optional_inputs(ws, weights, start)
    if transport == "bulk":
        fn = compile_cached(("comm.push_reduce_bulk", ws.arch, has_w, has_start),
                            lambda: compile_push_reduce_bulk(ws.arch, has_w, has_start)[0])
    else:
        fn = compile_cached(("comm.push_reduce", ws.arch, has_w, has_start),
                            lambda: compile_push_reduce(ws.arch, has_w, has_start)[0])
    fn(Link(dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["push"])),
       Routes(dptr(plan.recv_src), dptr(plan.offsets)), Grouped(dptr(rows), None, Int32(in_rows)),
       Sum(dptr(plan.dest_rank), w_ptr, s_ptr, dptr(out)),
       Dims(Int32(ws.me), Int32(ws.EP), Int32(ws.T), Int32(ws.k), Int32(ws.H // 8), Int32(ws.E // ws.EP)),
       Sections(Int64(ws.offsets["slots"]), None, Int64(ws.offsets["flags"])),
       Round(Int32(epoch), Int64(ws.timeout_ns), Int32(nctas)), current_stream())
    return out


def combine(ws: CommWorkspace, expert_out: torch.Tensor, topk_w: torch.Tensor, plan,
            shared_out: torch.Tensor | None = None, *, num_ctas: int | None = None,
            transport: str = "plain") -> torch.Tensor:
    """Forward combine by push: ``expert_out`` [>= M, H] bf16 (this rank's expert outputs in
    plan order) goes to the source ranks; returns this rank's ``y`` [T, H] bf16 =
    bf16(fp32(shared_out or 0) + sum_j topk_w[t, j] * fp32(slot_j)). ``topk_w`` [T, k] fp32.
    ``transport``: ``"plain"`` (default) or ``"bulk"`` (the rows pushed by cp.async.bulk; the same
    sum); ValueError otherwise. Collective; current stream, no host sync."""
    return _push_reduce(ws, expert_out, plan, topk_w, shared_out, num_ctas, "expert_out",
                        "shared_out", transport)


def reverse_dispatch(ws: CommWorkspace, dx_expert: torch.Tensor, plan,
                     dx_shared: torch.Tensor | None = None, *,
                     num_ctas: int | None = None, transport: str = "plain") -> torch.Tensor:
    """Backward of dispatch by push: ``dx_expert`` [>= M, H] bf16 (input grads of this rank's
    expert rows, plan order) goes to the source ranks; returns this rank's ``dx`` [T, H] bf16
    = bf16(fp32(dx_shared or 0) + sum_j fp32(slot_j)). ``transport`` as :func:`combine`.
    Collective; current stream."""
    return _push_reduce(ws, dx_expert, plan, None, dx_shared, num_ctas, "dx_expert", "dx_shared",
                        transport)

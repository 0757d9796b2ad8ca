"""Arch-neutral routed-row device code of the megakernels (SM90 and SM100): the fixed-order slot
sum over each token's (token, slot) rows and a warp's copy of one bf16 row.

* :func:`slot_sum`: ``out[t] = bf16(acc)``, ``acc = fp32(init[t])`` (or 0 without ``init``; with
  ``gate`` fp32 [T]: ``acc = fp32(init[t]) * gate[t]``, the shared expert's output gate; with
  ``add`` fp32 [T, H]: ``acc = acc + add[t]``, the gate's share of dx), then
  for each slot j in order with ``idx[t*k + j] >= 0``: ``acc = acc + w[t, j] * fp32(slot[t*k + j])``
  (``w`` None: ``acc + fp32(slot)``; ``row`` given: ``slot[row[t*k + j]]``), single-rounded fp32
  operations: the reference's ``slot_sum``. Grid stride over (token, 16-byte vector); each thread
  keeps ``nb`` slot rows' vectors in flight as cp.async copies into ``sbuf`` [nb * threads, 8]
  bf16 (idle shared memory: no register holds them).
* :func:`copy_row`: one warp copies a bf16 row between global addresses, loads batched.
* :func:`gather_rows_staged`: a CTA copies token rows to grouped rows through idle shared memory
  (cp.async), two batches of loads in flight per lane.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from mok_cute.comm import protocol as P
from mok_cute.comm.combine import add_rn, mul_rn

_VEC = 8  # bf16 elements per 16-byte vector


class SlotSumOperands(NamedTuple):
    """The tensors of :func:`slot_sum` (T tokens, k slots each, H hidden): ``slot`` [slot rows, H] bf16 (the
    slot rows), ``init`` [T, H] bf16 or None, ``out`` [T, H] bf16, ``idx`` int32 [T*k] (slot ``t*k + j`` summed
    where ``idx >= 0``), ``w`` fp32 [T*k] or None, ``gate`` fp32 [T] or None (with ``init``), ``add`` fp32
    [T, H] or None; ``copy`` [T*k, H] bf16 or None: the slot rows summed are also stored there as read (a copy
    that outlives the slot buffer); ``row`` int32 [T*k] or None: slot ``t*k + j``'s row of ``slot`` is
    ``row[t*k + j]`` (in ``[0, slot rows)`` for every slot, summed or not), not ``t*k + j``."""

    slot: cute.Tensor
    init: cute.Tensor
    out: cute.Tensor
    idx: cute.Tensor
    w: cute.Tensor = None
    gate: cute.Tensor = None
    add: cute.Tensor = None
    copy: cute.Tensor = None
    row: cute.Tensor = None


class TokenRows(NamedTuple):
    """The source of :func:`gather_rows_staged`: grouped row ``rr`` comes from token row ``order[row0 + rr] // k``
    of a row-major bf16 buffer at global byte address ``base`` (Int64), rows ``row_bytes`` (Int32) apart;
    ``order`` int32 [M] (grouped row -> token * k + slot), ``row0`` and ``k`` Int32."""

    order: cute.Tensor
    row0: Int32
    k: Int32
    base: Int64
    row_bytes: Int32


@cute.jit
def slot_sum(tidx: Int32, bidx: Int32, grid: Int32, ops: SlotSumOperands, k: Int32, tokens: Int32, hidden: Int32,
             sbuf: cute.Tensor, nb: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """Every CTA's share of ``ops.out`` [T, H] from ``ops.slot`` (see the module doc and
    :class:`SlotSumOperands`; ``threads`` per CTA, all of them here)."""
    mSlot, mInit, mOut, mIdx, mW, mGate, mAdd, mCopy, mRow = ops
    v = hidden // _VEC
    slot = cute.make_tensor(mSlot.iterator, cute.make_layout((mSlot.shape[0] * v, _VEC), stride=(_VEC, 1)))
    y = cute.make_tensor(mOut.iterator, cute.make_layout((tokens * v, _VEC), stride=(_VEC, 1)))
    s = add = None
    if cutlass.const_expr(mInit is not None):
        s = cute.make_tensor(mInit.iterator, cute.make_layout((tokens * v, _VEC), stride=(_VEC, 1)))
    if cutlass.const_expr(mAdd is not None):
        add = cute.make_tensor(mAdd.iterator, cute.make_layout((tokens * v, _VEC), stride=(_VEC, 1)))
    copy = None
    if cutlass.const_expr(mCopy is not None):
        copy = cute.make_tensor(mCopy.iterator, cute.make_layout((mCopy.shape[0] * v, _VEC), stride=(_VEC, 1)))
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                              num_bits_per_copy=128)
    acc = cute.make_rmem_tensor((_VEC,), Float32)
    ws = cute.make_rmem_tensor((nb,), Float32)
    es = cute.make_rmem_tensor((nb,), Int32)
    for i in cutlass.range(bidx * threads + tidx, tokens * v, grid * threads, unroll=1):
        t = i // v
        c = i - t * v
        if cutlass.const_expr(mInit is not None):
            acc.store(s[i, None].load().to(Float32))
        else:
            acc.fill(0.0)
        if cutlass.const_expr(mGate is not None):
            g = mGate[t]
            for e in cutlass.range_constexpr(_VEC):
                acc[e] = mul_rn(acc[e], g)
        if cutlass.const_expr(mAdd is not None):
            a = add[i, None].load()
            for e in cutlass.range_constexpr(_VEC):
                acc[e] = add_rn(acc[e], a[e])
        for j0 in cutlass.range(0, k, nb, unroll=1):
            for u in cutlass.range_constexpr(nb):  # nb slot rows in flight
                es[u] = Int32(-1)
                if j0 + u < k:
                    r = t * k + j0 + u
                    es[u] = mIdx[r]
                    if cutlass.const_expr(mW is not None):
                        ws[u] = mW[r]
                    src = r
                    if cutlass.const_expr(mRow is not None):
                        src = mRow[r]
                    cute.copy(g2s, slot[src * v + c, None], sbuf[u * threads + tidx, None])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            for u in cutlass.range_constexpr(nb):  # added in slot order
                if es[u] >= 0:
                    if cutlass.const_expr(mCopy is not None):
                        copy[(t * k + j0 + u) * v + c, None].store(sbuf[u * threads + tidx, None].load())
                    xs = sbuf[u * threads + tidx, None].load().to(Float32)
                    for e in cutlass.range_constexpr(_VEC):
                        if cutlass.const_expr(mW is not None):
                            acc[e] = add_rn(acc[e], mul_rn(ws[u], xs[e]))
                        else:
                            acc[e] = add_rn(acc[e], xs[e])
        y[i, None].store(acc.load().to(cutlass.BFloat16))


@cute.jit
def copy_row(lane: Int32, src: Int64, dst: Int64, units: Int32, unroll: cutlass.Constexpr[int]):
    """One warp: the ``units`` 16-byte units of a bf16 row at global address ``src`` to ``dst``;
    lane l moves units l, l + 32, ..., ``unroll`` loads in flight before their stores."""
    buf = cute.make_rmem_tensor((_VEC, unroll), cutlass.BFloat16)
    for c0 in cutlass.range(lane, units, 32 * unroll, unroll=1):
        for u in cutlass.range_constexpr(unroll):  # every load first
            cu = c0 + u * 32
            if cu < units:
                buf[None, u].store(cute.make_tensor(P.gptr(cutlass.BFloat16, src + Int64(cu) * 16, 16),
                                                    cute.make_layout((_VEC,))).load())
        for u in cutlass.range_constexpr(unroll):
            cu = c0 + u * 32
            if cu < units:
                cute.make_tensor(P.gptr(cutlass.BFloat16, dst + Int64(cu) * 16, 16),
                                 cute.make_layout((_VEC,))).store(buf[None, u].load())


def staged_plan(rows, units, warp, warps: int, cap: int):
    """``(per, cpr, n)`` of :func:`gather_rows_staged` for warp ``warp`` of ``warps``: units per lane
    of a batch (balanced, <= ``cap``), batches per row (``units`` >= 1), and the warp's batches. Plain
    integer arithmetic: the kernel's (DSL Int32) and the tests' (Python int) alike."""
    per_row = (units + 31) // 32
    cpr = (per_row + cap - 1) // cap
    return (per_row + cpr - 1) // cpr, cpr, (rows - warp + warps - 1) // warps * cpr


def staged_batch(b, warp, warps: int, cpr, per):
    """``(row, first unit)`` of the warp's batch ``b``: lane l moves units ``c0 + u*32 + l``, u < ``per``."""
    return warp + b // cpr * warps, b % cpr * per * 32


@cute.jit
def _issue_batch(g2s: cute.CopyAtom, src: Int64, c0: Int32, per: Int32, units: Int32, lane: Int32, tidx: Int32,
                 sbuf: cute.Tensor, slot0: Int32, threads: cutlass.Constexpr[int]):
    """A lane's units ``c0 + u*32 + lane`` (u < ``per``, inside the row) of the row at ``src`` as
    cp.async copies into ``sbuf[(slot0 + u) * threads + tidx]``, committed as one group."""
    for u in cutlass.range(per, unroll=4):
        cu = c0 + u * 32 + lane
        if cu < units:
            cute.copy(g2s, cute.make_tensor(P.gptr(cutlass.BFloat16, src + Int64(cu) * 16, 16), cute.make_layout((_VEC,))),
                      sbuf[(slot0 + u) * threads + tidx, None])
    cute.arch.cp_async_commit_group()


@cute.jit
def gather_rows_staged(tidx: Int32, rows: Int32, units: Int32, src: TokenRows, dst_base: Int64, dst_row0: Int32,
                       sbuf: cute.Tensor, threads: cutlass.Constexpr[int], cap: cutlass.Constexpr[int]):
    """Grouped rows ``rr < rows`` of ``units`` 16-byte units: from token row ``src.order[src.row0 + rr] // src.k``
    (:class:`TokenRows`) to row ``dst_row0 + rr`` of a dense bf16 buffer at ``dst_base``.
    Warp w takes rows w, w + warps, ...; a row's units go in batches of at most ``cap`` per lane, each
    batch's loads cp.async copies into one half of ``sbuf`` [2 * cap * threads, 8] bf16 (idle shared
    memory), batch b + 1 in flight while batch b is stored: up to 2 * cap 16-byte loads per lane in
    flight, none held in registers. The caller fences the shared memory for its next (async-proxy) use."""
    mOrder, row0, k, src_base, src_bytes = src
    warps = threads // 32
    warp = tidx // 32
    lane = tidx % 32
    per, cpr, n = staged_plan(rows, units, warp, warps, cap)
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                              num_bits_per_copy=128)
    if n > 0:
        _issue_batch(g2s, src_base + Int64(mOrder[row0 + warp] // k) * Int64(src_bytes), Int32(0), per, units, lane,
                     tidx, sbuf, Int32(0), threads)
    for b in cutlass.range(n, unroll=1):
        half = b % 2
        if b + 1 < n:
            rr, c0 = staged_batch(b + 1, warp, warps, cpr, per)
            _issue_batch(g2s, src_base + Int64(mOrder[row0 + rr] // k) * Int64(src_bytes), c0, per, units, lane, tidx,
                         sbuf, (1 - half) * cap, threads)
        else:
            cute.arch.cp_async_commit_group()  # an empty group: the wait below still leaves batch b's done
        cute.arch.cp_async_wait_group(1)
        rr, c0 = staged_batch(b, warp, warps, cpr, per)
        dst = dst_base + Int64(dst_row0 + rr) * Int64(units * 16)
        for u in cutlass.range(per, unroll=4):
            cu = c0 + u * 32 + lane
            if cu < units:
                cute.make_tensor(P.gptr(cutlass.BFloat16, dst + Int64(cu) * 16, 16),
                                 cute.make_layout((_VEC,))).store(sbuf[(half * cap + u) * threads + tidx, None].load())

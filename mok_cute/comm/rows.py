"""Grid-stride copy of routed 16-byte row vectors between this rank's expert-grouped buffer
and the peers' symmetric buffers (device side of dispatch/reverse combine and of the push
half of combine/reverse dispatch).

Grouped row ``i < M = offsets[e_local]`` (clamped to the buffer's rows, reporting OVERFLOW)
holds the route ``recv_src[i] = p*T*k + t*k + j`` of source rank p; an index outside
``[0, EP*T*k)`` is reported as BAD_INDEX. Every thread of ``nctas`` CTAs of ``THREADS``
walks the (row, vector) pairs with a grid stride.
"""
from __future__ import annotations

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute, cutlass, gptr
from cutlass import BFloat16, Constexpr, Int32, Int64

THREADS = 1024  # threads per CTA of every row-moving comm kernel


@cute.jit
def copy_routed_rows(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer,
                     recv_src: cute.Pointer, offsets: cute.Pointer, grouped: cute.Pointer,
                     grouped_rows: Int32, ep: Int32, T: Int32, k: Int32, tk: Int32, V: Int32,
                     e_local: Int32, peer_off: Int64, channel: Int32, epoch: Int32, nctas: Int32,
                     push: Constexpr, store32: Constexpr = False):
    """Pull (``push`` False): ``grouped[i]`` = row t of rank p's buffer ``[T, H]`` at
    ``peer_off``. Push: ``grouped[i]`` goes to slot ``t*k + j`` of rank p's buffer
    ``[T*k, H]`` at ``peer_off``, as one 16-byte store (or, ``store32``, four 4-byte ones).
    ``grouped`` is bf16 ``[grouped_rows, H]`` with ``V = H / 8`` vectors per row; ``tk = T*k``
    and the thread/block indices come from the caller (computed once per kernel)."""
    offs = cute.make_tensor(offsets, cute.make_layout(e_local + 1))
    m = offs[e_local]
    if m > grouped_rows:
        if bidx == 0:
            if tidx == 0:
                P.report(status, Int32(P.OVERFLOW), m, channel, epoch)
        m = grouped_rows
    rs = cute.make_tensor(recv_src, cute.make_layout(grouped_rows))
    local = cute.make_tensor(grouped, cute.make_layout((grouped_rows * V, 8), stride=(8, 1)))
    local32 = cute.make_tensor(cute.recast_ptr(grouped, dtype=Int32),
                               cute.make_layout((grouped_rows * V, 4), stride=(4, 1)))
    n = m * V
    i = bidx * THREADS + tidx
    lim = ep * tk
    while i < n:
        row = i // V
        s = rs[row]
        if s >= 0 and s < lim:
            p = s // tk
            if cutlass.const_expr(not push):
                t = (s - p * tk) // k
                # 64-bit address of the 16-byte source vector on rank p (as the push path)
                addr = pb[p] + peer_off + (Int64(t) * Int64(V) + Int64(i - row * V)) * 16
                src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                local[i, None].store(src.load())
            else:
                # 64-bit address of the 16-byte slot vector on rank p (no 32-bit byte offsets)
                addr = pb[p] + peer_off + (Int64(s - p * tk) * Int64(V) + Int64(i - row * V)) * 16
                if cutlass.const_expr(store32):
                    d32 = cute.make_tensor(gptr(Int32, addr, 16), cute.make_layout(4))
                    r4 = cute.make_rmem_tensor((4,), Int32)
                    r4.store(local32[i, None].load())
                    for e in cutlass.range_constexpr(4):
                        d32[e] = r4[e]
                else:
                    dst = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
                    dst.store(local[i, None].load())
        else:
            P.report(status, Int32(P.BAD_INDEX), row, channel, epoch)
        i += nctas * THREADS


@cute.jit
def pull_rows_ext(tidx: Int32, bidx: Int32, pb: cute.Tensor, status: cute.Pointer,
                  recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                  out2: cute.Pointer, w_out: cute.Pointer, grouped_rows: Int32, ep: Int32,
                  T: Int32, k: Int32, tk: Int32, V: Int32, Vd: Int32, Vs: Int32, e_local: Int32,
                  peer_off: Int64, w_off: Int64, channel: Int32, epoch: Int32, nctas: Int32,
                  split: Constexpr, has_w: Constexpr):
    """The pull of :func:`copy_routed_rows` for other payloads (same rows, same reports, same
    64-bit peer addresses): source row t of rank p is ``V`` 16-byte vectors at ``peer_off +
    t*V*16``. Without ``split`` (``Vd == V``) vector v of grouped row i goes to ``out[i, v]``;
    with ``split`` vectors ``v < Vd`` go to ``out`` (row pitch ``Vd`` vectors) and the rest to
    ``out2[i, v - Vd]`` (row pitch ``Vs`` vectors): MXFP8 data then scales. With ``has_w`` the
    thread of vector 0 also copies the route's 4-byte weight (``w_off + (t*k + j)*4`` on rank
    p) to ``w_out[i]`` (int32 bits). Byte movement only: no value is converted."""
    offs = cute.make_tensor(offsets, cute.make_layout(e_local + 1))
    m = offs[e_local]
    if m > grouped_rows:
        if bidx == 0:
            if tidx == 0:
                P.report(status, Int32(P.OVERFLOW), m, channel, epoch)
        m = grouped_rows
    rs = cute.make_tensor(recv_src, cute.make_layout(grouped_rows))
    dst = cute.make_tensor(out, cute.make_layout((grouped_rows * Vd, 8), stride=(8, 1)))
    dst2 = cute.make_tensor(out2, cute.make_layout((grouped_rows * Vs, 8), stride=(8, 1)))
    wo = cute.make_tensor(w_out, cute.make_layout(grouped_rows))
    n = m * V
    i = bidx * THREADS + tidx
    lim = ep * tk
    while i < n:
        row = i // V
        v = i - row * V
        s = rs[row]
        if s >= 0 and s < lim:
            p = s // tk
            r = s - p * tk
            t = r // k
            addr = pb[p] + peer_off + (Int64(t) * Int64(V) + Int64(v)) * 16
            src = cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout(8))
            if cutlass.const_expr(split):
                if v < Vd:
                    dst[row * Vd + v, None].store(src.load())
                else:
                    dst2[row * Vs + (v - Vd), None].store(src.load())
            else:
                dst[i, None].store(src.load())
            if cutlass.const_expr(has_w):
                if v == 0:
                    wsrc = cute.make_tensor(gptr(Int32, pb[p] + w_off + Int64(r) * 4, 4),
                                            cute.make_layout(1))
                    wo[row] = wsrc[0]
        else:
            P.report(status, Int32(P.BAD_INDEX), row, channel, epoch)
        i += nctas * THREADS

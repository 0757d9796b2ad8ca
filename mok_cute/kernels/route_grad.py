"""Routed-gradient prologue of the expert MLP backward (CuTe DSL), one pass over the routes:

    dy_rows[p] = bf16(fp32(dy[t]) * topk_w[t, j])      (the routed dy row of slot j)
    d_topk_w[t, j] = fp32 sum_h fp32(dy[t, h]) * fp32(r[p, h])

for every expert-grouped row p < offsets[E] with route q = order[p] = t * k + j, and
d_topk_w[q] = 0 for the rows p >= offsets[E] (routes whose slot is -1). ``r`` [M, H] are the
forward's expert-grouped GEMM2 rows, so the backward reads them in place (no [T, k, H] slot
copy, no fp32 temporaries). dy_rows is bitwise the reference's ``bf16(fp32(dy) * topk_w)``
(one ``mul.rn.f32``, one ``cvt.rn.bf16x2.f32``); d topk_w is an fp32 sum (the reference sums
in fp64: compared with a tolerance) in a fixed order — each lane FMAs its 16-byte chunks
``lane, lane + 32, ...`` in order, then a fixed butterfly over the warp — so it is bitwise
reproducible. Rows p >= offsets[E] of dy_rows are not written (no expert reads them).

One warp per route, in route order (the warps of one token's routes run side by side, so dy's token
row is read from DRAM about once, not once per expert sweep; each route's grouped row comes from the
inverse of ``order``, one scatter), 16-byte loads and stores; dims are runtime ``Int32`` (one compiled
kernel per arch). :func:`dy_x_rows_and_dtopk_w` also copies x's token row into the route's grouped
row in the same warp (the BF16 backward's x gather).

:func:`mx_dy_rows_and_dtopk_w` and :func:`mx_x_rows`: the MXFP8 backward's prologue in two launches over every SM
(bitwise the two passes of the fused backward's comm-CTA gather with its SM90 MXFP8 step, and so the unfused
passes): the routed dy rows with d topk_w, then the x rows, each 32-row block staged in shared memory a slab of H
at a time and every output written once, in place of this kernel, an x gather and three round-trip passes over
[M, H] buffers; two launches so that the forward's rows, read by the first alone, can be freed before the second
allocates the x rows.
"""

from typing import NamedTuple

import torch

from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel, dsl
from mok_cute.dsl.host import MAX_NUMEL, current_stream

_WARPS = 4  # routes per CTA
_X_UNROLL = 8  # 16-byte loads in flight per lane of the x row copy
_MX_THREADS = 256  # per CTA of the MXFP8 prologue (8 warps; warp w gathers rows w, w + 8, w + 16, w + 24 of a block)
_MX_SLAB = 128  # 16-byte chunks of the block's 32 rows staged in shared memory at a time (64 KB)


class _RouteOperands(NamedTuple):
    """The route-major kernel's operands: global pointers at its launch, tensors in the kernel. bf16 rows as
    (rows * H/8, 4) uint32 words of their 16-byte chunks: ``dy`` [T, H], ``r`` [M, H] (the forward's rows),
    ``out`` [M, H] (the routed dy rows), ``x`` [T, H] and ``x_out`` [M, H] (``with_x``: x's grouped rows; else
    any valid rows, unread); ``row_of`` int32 [M] (each route's grouped row), ``w`` / ``dtw`` fp32 bits [T*k]
    (topk_w, d topk_w), ``offs`` int32 [E+1]."""

    dy: object
    r: object
    out: object
    row_of: object
    w: object
    dtw: object
    offs: object
    x: object
    x_out: object


class _MxOperands(NamedTuple):
    """The MXFP8 prologue's pointers (:func:`_mx_pointers`): ``src`` the token rows [T, H] (dy or x), ``r`` the
    forward's rows, ``w`` / ``dtw`` topk_w and d topk_w (fp32 bits [T*k]; pass 0 only), ``order`` / ``offs`` int32
    [M] / [E+1], ``rows`` the grouped rows out [M, H], ``dy_t`` dy's round trip along the tokens [M, H] (pass 0);
    rows as uint32 words."""

    src: object
    r: object
    w: object
    dtw: object
    order: object
    offs: object
    rows: object
    dy_t: object


def _build(arch: str, by_route: bool = False, with_x: bool = False):
    """The route-major pass: one warp per route q (consecutive warps take one token's routes, so dy's and x's token
    rows are read from DRAM about once however many experts the token went to); ``with_x`` also copies x's token
    row into its grouped row."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415 (the DSL is imported lazily, on first compile)

    cutlass, cute = dsl()
    from mok_cute.kernels.route_grad_row import route_row  # noqa: PLC0415
    from mok_cute.kernels.slot_rows import copy_row  # noqa: PLC0415

    Int32, Int64, Uint32 = cutlass.Int32, cutlass.Int64, cutlass.Uint32

    @cute.kernel
    def kernel(ops: _RouteOperands, e: Int32, m: Int32, k: Int32, hc: Int32):
        dy, r, out, row_of, w, dtw, offs, x, x_out = ops
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % 32
        q = bid * _WARPS + tid // 32
        if q < m:
            p = row_of[q]
            if p < offs[e]:
                rr = p  # the forward row of this route
                if cutlass.const_expr(by_route):
                    rr = q
                acc = route_row(lane, dy, r, out, q // k, rr, p, w[q], hc)
                if cutlass.const_expr(with_x):
                    row_bytes = Int64(hc * 16)
                    copy_row(lane, x.iterator.toint() + Int64(q // k) * row_bytes,
                             x_out.iterator.toint() + Int64(p) * row_bytes, hc, _X_UNROLL)
                if lane == 0:
                    dtw[q] = acc
            else:
                if lane == 0:
                    dtw[q] = Uint32(0)

    @cute.jit
    def launch(ptrs: _RouteOperands, t: Int32, m: Int32, k: Int32, e: Int32, hc: Int32, stream: cuda.CUstream):
        dyp, rp, outp, rowp, wp, dtwp, offp, xp, xop = ptrs
        chunks = cute.make_layout
        dy = cute.make_tensor(dyp, chunks((t * hc, 4), stride=(4, 1)))
        r = cute.make_tensor(rp, chunks((m * hc, 4), stride=(4, 1)))
        out = cute.make_tensor(outp, chunks((m * hc, 4), stride=(4, 1)))
        row_of = cute.make_tensor(rowp, cute.make_layout((m,)))
        w = cute.make_tensor(wp, cute.make_layout((t * k,)))
        dtw = cute.make_tensor(dtwp, cute.make_layout((t * k,)))
        offs = cute.make_tensor(offp, cute.make_layout((e + 1,)))
        x = cute.make_tensor(xp, chunks((t * hc, 4), stride=(4, 1)))
        x_out = cute.make_tensor(xop, chunks((m * hc, 4), stride=(4, 1)))
        kernel(_RouteOperands(dy, r, out, row_of, w, dtw, offs, x, x_out), e, m, k, hc).launch(
            grid=[(m + _WARPS - 1) // _WARPS, 1, 1], block=[32 * _WARPS, 1, 1], stream=stream)

    return compile_kernel(launch, _pointers(*(0,) * 9), *(Int32(1),) * 5, cuda.CUstream(0), arch=arch, inspect=True)


def _build_mx(arch: str, xpass: int, by_route: bool):
    """The MXFP8 prologue's pass ``xpass`` (0: dy rows, d topk_w, dy's two round trips; 1: x rows and theirs).

    CTA ``b`` takes the 32-row block of rank ``b`` in the token-local round order
    (:mod:`mok_cute.schedule.token_rounds`; blocks start at each expert's first row: an MXFP8 token block) and walks
    H in slabs of :data:`_MX_SLAB` chunks: its warps copy the slab of every row into shared memory by 16-byte
    cp.async, every lane's copies of its warp's rows in flight at once (pass 0 then scales them in place by the
    route's weight while each lane goes on with route_row's fixed-order d topk_w sum over its chunks ``lane,
    lane + 32, ...`` in order, the forward rows loaded one row ahead), then the round trips read the slab there
    and write the outputs once (pass 0: warps 0-3 one column chunk each along the tokens into ``dy_t``, warps 4-7
    the rows along H into the dy rows; pass 1: every thread a column chunk along the tokens into the x rows)."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    cutlass, cute = dsl()
    from mok_cute.kernels import mx_rows  # noqa: PLC0415
    from mok_cute.kernels.route_grad_row import dot_pair, scale_pair, warp_sum_rn  # noqa: PLC0415
    from mok_cute.schedule.token_rounds import round_block  # noqa: PLC0415
    from cutlass.cute.nvgpu import cpasync  # noqa: PLC0415

    Int32, Uint32 = cutlass.Int32, cutlass.Uint32
    blk, slab, warps = mx_rows.MX_BLOCK, _MX_SLAB, _MX_THREADS // 32
    per_lane = _MX_SLAB // 32

    @cute.jit
    def _r_chunks(r: cute.Tensor, order: cute.Tensor, row0: Int32, i: Int32, lane: Int32, rows: Int32, s0: Int32,
                  n: Int32, hc: Int32, dst: cute.Tensor):
        """The forward row of block row ``i``'s chunks ``lane, lane + 32, ...`` of the slab into ``dst`` (no row
        past ``rows``)."""
        if i < rows:
            rr = row0 + i
            if cutlass.const_expr(by_route):
                rr = order[row0 + i]
            for u in cutlass.range_constexpr(per_lane):
                c = lane + 32 * u
                if c < n:
                    dst[None, u].store(r[rr * hc + s0 + c, None].load())

    @cute.kernel
    def kernel(src: cute.Tensor, r: cute.Tensor, w: cute.Tensor, dtw: cute.Tensor, order: cute.Tensor,
               offs: cute.Tensor, rows_out: cute.Tensor, dy_t: cute.Tensor, k: Int32, hc: Int32, rounds: Int32,
               steps: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp, lane = tid // 32, tid % 32
        n_exp = offs.shape[0] - 1
        stage = cutlass.memory.SmemAllocator().allocate_tensor(
            Uint32, cute.make_layout((blk, slab, 4), stride=(slab * 4, 4, 1)), byte_alignment=16)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        sums = cutlass.memory.SmemAllocator().allocate_tensor(  # each row's lanes' d topk_w sums between slabs
            Uint32, cute.make_layout((blk, 32), stride=(32, 1)), byte_alignment=16)
        # the block of this CTA's rank in the token-local order (dy / x token rows reused in L2): warp 0 finds it
        # and hands it over in shared memory (found by every warp, its search raised the loop's registers)
        block = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(2), byte_alignment=8)
        if warp == 0:
            fe, fb = round_block(offs, n_exp, blk, rounds, steps, bid, lane)
            if lane == 0:
                block[0] = fe
                block[1] = fb
        cute.arch.barrier()
        e = block[0]
        if e < n_exp:
            row0 = offs[e] + block[1] * blk
            rows = cutlass.min(offs[e + 1] - row0, blk)
            for i in cutlass.range(warp, rows, warps, unroll=1):
                sums[i, lane] = Uint32(0)
            # the outputs from the block's first row as (row, chunk, word); the stride's divisibility keeps
            # their 16-byte stores
            whole = cute.make_layout((blk, hc, 4), stride=(cute.assume(hc * 4, divby=4), 4, 1))
            for s0 in cutlass.range(0, hc, slab, unroll=1):
                n = cutlass.min(slab, hc - s0)
                # every lane copies its chunks (lane, lane + 32, ...) of the warp's rows of src into the slab by
                # cp.async, all in flight at once (no registers); each lane later reads back only what it copied
                for i in cutlass.range(warp, rows, warps, unroll=1):
                    t = order[row0 + i] // k
                    for u in cutlass.range_constexpr(per_lane):
                        c = lane + 32 * u
                        if c < n:
                            cute.copy(g2s, src[t * hc + s0 + c, None], stage[(i, c, None)])
                cute.arch.cp_async_commit_group()
                if cutlass.const_expr(xpass == 0):  # dy scaled in place and d topk_w, r one row ahead
                    nxt = cute.make_rmem_tensor((4, per_lane), Uint32)
                    _r_chunks(r, order, row0, warp, lane, rows, s0, n, hc, nxt)
                    cute.arch.cp_async_wait_group(0)
                    for i in cutlass.range(warp, rows, warps, unroll=1):
                        bb = cute.make_rmem_tensor((4, per_lane), Uint32)
                        bb.store(nxt.load())
                        _r_chunks(r, order, row0, i + warps, lane, rows, s0, n, hc, nxt)
                        acc = sums[i, lane]
                        wq = w[order[row0 + i]]
                        for u in cutlass.range_constexpr(per_lane):  # the chunks in order: the sum's order
                            c = lane + 32 * u
                            if c < n:
                                a = stage[(i, c, None)].load()
                                o = cute.make_rmem_tensor((4,), Uint32)
                                for h in cutlass.range_constexpr(4):
                                    o[h] = scale_pair(a[h], wq)
                                    acc = dot_pair(acc, a[h], bb[h, u])
                                stage[(i, c, None)].store(o.load())
                        sums[i, lane] = acc
                else:
                    cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                at = cute.domain_offset((row0, s0, 0), cute.make_tensor(rows_out.iterator, whole))
                if cutlass.const_expr(xpass == 0):
                    if warp < warps // 2:
                        if tid < n:
                            dst = cute.domain_offset((row0, s0, 0), cute.make_tensor(dy_t.iterator, whole))
                            mx_rows.mx_column_block(stage, Int32(0), tid, rows, dst, True)
                    else:
                        for i in cutlass.range(warp - warps // 2, rows, warps // 2, unroll=1):
                            mx_rows.mx_row(lane, stage, i, n, at)
                else:
                    for c in cutlass.range(tid, n, _MX_THREADS, unroll=1):
                        mx_rows.mx_column_block(stage, Int32(0), c, rows, at, True)
                cute.arch.barrier()  # the slab read before the next one is staged
            if cutlass.const_expr(xpass == 0):
                for i in cutlass.range(warp, rows, warps, unroll=1):
                    v = warp_sum_rn(sums[i, lane])
                    if lane == 0:
                        dtw[order[row0 + i]] = v
        if cutlass.const_expr(xpass == 0):  # d topk_w = 0 for the routes past the experts' rows (-1 slots)
            for p in cutlass.range(offs[n_exp] + bid * _MX_THREADS + tid, order.shape[0], grid * _MX_THREADS,
                                   unroll=1):
                dtw[order[p]] = Uint32(0)

    @cute.jit
    def launch(ptrs: _MxOperands, t: Int32, m: Int32, k: Int32, e: Int32, hc: Int32, ctas: Int32, rounds: Int32,
               steps: Int32, stream: cuda.CUstream):
        srcp, rp, wp, dtwp, orderp, offp, rowsp, dytp = ptrs

        def chunks(ptr, n):  # bf16 rows as (rows * hc, 4) words of their 16-byte chunks
            return cute.make_tensor(ptr, cute.make_layout((n * hc, 4), stride=(4, 1)))

        def vec(ptr, n):
            return cute.make_tensor(ptr, cute.make_layout((n,)))

        dy_only = (chunks(rp, m), vec(wp, t * k), vec(dtwp, t * k)) if xpass == 0 else (None, None, None)
        kernel(chunks(srcp, t), *dy_only, vec(orderp, m), vec(offp, e + 1), vec(rowsp, m * hc * 4),
               vec(dytp, m * hc * 4) if xpass == 0 else None, k, hc, rounds, steps).launch(
            grid=[ctas, 1, 1], block=[_MX_THREADS, 1, 1], stream=stream)

    return compile_kernel(launch, _mx_pointers(*(0,) * 8), *(Int32(1),) * 8, cuda.CUstream(0), arch=arch,
                          inspect=True)


def _mx_pointers(src: int, r: int, w: int, dtw: int, order: int, offs: int, rows: int, dy_t: int):
    """The MXFP8 prologue's kernel pointers (bf16 rows and fp32 weights as uint32 words, int32 order / offsets)."""
    cutlass, cute = dsl()

    def ptr(dtype, addr, align):
        return cute.runtime.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)

    u32, i32 = cutlass.Uint32, cutlass.Int32
    return _MxOperands(ptr(u32, src, 16), ptr(u32, r, 16), ptr(u32, w, 4), ptr(u32, dtw, 4), ptr(i32, order, 4),
                       ptr(i32, offs, 4), ptr(u32, rows, 16), ptr(u32, dy_t, 16))


def compiled_mx_rows(arch: str, xpass: int, by_route: bool = False):
    """The cached ``(compiled, CompileReport)`` of the MXFP8 prologue's pass ``xpass`` for an arch
    (:func:`mx_dy_rows_and_dtopk_w`: 0, :func:`mx_x_rows`: 1)."""
    return compile_cached(("route_grad_mx", arch, xpass, by_route), lambda: _build_mx(arch, xpass, by_route))


def _mx_launch(xpass: int, by_route: bool, src, order, offsets, rows, k: int, r=None, w=None, dtw=None, dy_t=None):
    """One launch of the MXFP8 prologue's pass ``xpass``: one CTA per 32-row block at most (grid M/32 + E + 1), the
    blocks in :mod:`mok_cute.schedule.token_rounds` order (rounds of 32 tokens)."""
    m, e = order.shape[0], offsets.numel() - 1
    if not m:
        return
    from mok_cute.schedule import token_rounds  # noqa: PLC0415 (imports the DSL)

    ctas = m // 32 + e + 1
    rounds = token_rounds.rounds_for(src.shape[0])
    fn, _ = compiled_mx_rows(arch_of_device(src.device), xpass, by_route)
    addr = [0 if a is None else a.data_ptr() for a in (r, w, dtw)]
    with torch.cuda.device(src.device):
        fn(_mx_pointers(src.data_ptr(), *addr, order.data_ptr(), offsets.data_ptr(), rows.data_ptr(),
                        0 if dy_t is None else dy_t.data_ptr()),
           src.shape[0], m, k, e, src.shape[1] // 8, ctas, rounds, token_rounds.search_steps(rounds),
           current_stream(src.device))


def mx_dy_rows_and_dtopk_w(dy, r_rows, order, topk_w, offsets, rows_by_route: bool = False):
    """The MXFP8 backward's prologue, its dy pass (the module doc): ``(dy_rows, dy_t, d_topk_w)`` with ``dy_rows``
    [T*k, H] bf16 the routed dy rows (:func:`dy_rows_and_dtopk_w`'s) after their MXFP8 round trip along H, ``dy_t``
    the same rows' round trip along the tokens (blocks of 32 from each expert's first row) and ``d_topk_w`` [T, k]
    fp32 (:func:`dy_rows_and_dtopk_w`'s, 0 for -1 slots): bitwise the fused backward's comm-CTA gather (FUSED_WHOLE) and
    so the unfused passes; rows at or past offsets[E] are not written. dy [T, H] bf16 (H % 32 == 0), r_rows [T*k, H]
    bf16 (``rows_by_route``: in route order), order int32 [T*k], topk_w fp32 [T, k], offsets int32 [E+1]; all
    contiguous on one CUDA device. Its x pass, :func:`mx_x_rows`, reads none of r_rows: the caller may free them
    first."""
    _check(dy, r_rows, order, topk_w, offsets, torch.int32)
    if dy.shape[1] % 32:
        raise ValueError(f"dy: H = {dy.shape[1]} must be a multiple of 32 (the MXFP8 block)")
    if not dy.is_cuda:
        raise ValueError("mx_dy_rows_and_dtopk_w runs on a CUDA device")
    dy_rows, dy_t = torch.empty_like(r_rows), torch.empty_like(r_rows)
    dtw = torch.empty_like(topk_w)
    _mx_launch(0, rows_by_route, dy, order, offsets, dy_rows, topk_w.shape[1], r_rows, topk_w, dtw, dy_t)
    return dy_rows, dy_t, dtw


def mx_x_rows(x, order, offsets, k: int):
    """The MXFP8 prologue's x pass: x_rows [T*k, H] bf16, row p = ``x[order[p] // k]`` after the MXFP8 round trip
    along the tokens (blocks of 32 from each expert's first row; rows at or past offsets[E] not written), bitwise
    the fused backward's comm-CTA gather (FUSED_WHOLE). x [T, H] bf16 (H % 32 == 0), order int32 [T*k], offsets int32
    [E+1]; contiguous, one CUDA device."""
    _typed(("x", x, torch.bfloat16, 2), ("order", order, torch.int32, 1), ("offsets", offsets, torch.int32, 1))
    if order.shape[0] * x.shape[1] > MAX_NUMEL:
        raise ValueError("the x rows [T*k, H] must hold < 2^31 elements")
    if x.shape[1] % 32 or x.shape[1] == 0 or order.shape[0] != x.shape[0] * k or offsets.numel() < 2:
        raise ValueError(f"x must be [T, H] with H a positive multiple of 32 (the MXFP8 block), order "
                         f"[T*k = {x.shape[0] * k}] and offsets [E+1 >= 2]: got x {tuple(x.shape)}, order "
                         f"{tuple(order.shape)}, offsets {tuple(offsets.shape)}")
    if not x.is_cuda:
        raise ValueError("mx_x_rows runs on a CUDA device")
    rows = torch.empty((order.shape[0], x.shape[1]), dtype=torch.bfloat16, device=x.device)
    _mx_launch(1, False, x, order, offsets, rows, k)
    return rows


def _build_dots(arch: str):
    """The slot-row variant (:func:`slot_dtopk_w`): one warp per route q of [T*k]."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    cutlass, cute = dsl()
    from mok_cute.kernels.route_grad_row import route_row  # noqa: PLC0415

    Int32, Uint32 = cutlass.Int32, cutlass.Uint32

    @cute.kernel
    def kernel(dy: cute.Tensor, r: cute.Tensor, idx: cute.Tensor, dtw: cute.Tensor, m: Int32, k: Int32, hc: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        q = bid * _WARPS + tid // 32
        if q < m:
            acc = Uint32(0)
            if idx[q] >= 0:
                acc = route_row(tid % 32, dy, r, None, q // k, q, Int32(0), Uint32(0), hc)
            if tid % 32 == 0:
                dtw[q] = acc

    @cute.jit
    def launch(dyp: cute.Pointer, rp: cute.Pointer, idxp: cute.Pointer, dtwp: cute.Pointer, t: Int32, k: Int32,
               hc: Int32, stream: cuda.CUstream):
        m = t * k
        dy = cute.make_tensor(dyp, cute.make_layout((t * hc, 4), stride=(4, 1)))
        r = cute.make_tensor(rp, cute.make_layout((m * hc, 4), stride=(4, 1)))
        kernel(dy, r, cute.make_tensor(idxp, cute.make_layout((m,))), cute.make_tensor(dtwp, cute.make_layout((m,))),
               m, k, hc).launch(grid=[(m + _WARPS - 1) // _WARPS, 1, 1], block=[32 * _WARPS, 1, 1], stream=stream)

    return compile_kernel(launch, *_slot_pointers(0, 0, 0, 0), Int32(1), Int32(1), Int32(1), cuda.CUstream(0),
                          arch=arch, inspect=True)


def compiled_slot_dtopk_w(arch: str):
    """The cached ``(compiled, CompileReport)`` of :func:`slot_dtopk_w`'s kernel for an arch."""
    return compile_cached(("route_grad_slots", arch), lambda: _build_dots(arch))


def slot_dtopk_w(dy: torch.Tensor, slot_rows: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """d topk_w [T, k] fp32 from the slot rows: ``fp32 sum_h dy[t, h] * slot_rows[t*k + j, h]`` in
    route_row's fixed order (the EP > 1 fused backward's), 0 where ``topk_idx`` is -1 (those slot
    rows are never read). dy [T, H] bf16, slot_rows [T*k, H] bf16 (or [T, k, H]), topk_idx [T, k]
    int64; contiguous, one device; CPU tensors: the same sum in torch ops (fp32, torch's order)."""
    t, k = topk_idx.shape
    slot_rows = slot_rows.reshape(t * k, -1) if slot_rows.dim() == 3 else slot_rows
    for name, x, dtype in (("dy", dy, torch.bfloat16), ("slot_rows", slot_rows, torch.bfloat16),
                           ("topk_idx", topk_idx, torch.int64)):
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    h = dy.shape[1]
    if dy.dim() != 2 or dy.shape[0] != t or slot_rows.shape != (t * k, h) or h % 8:
        raise ValueError(f"shapes must be dy [T, H] (H % 8 == 0), slot_rows [T*k, H], topk_idx [T, k]: got dy "
                         f"{tuple(dy.shape)}, slot_rows {tuple(slot_rows.shape)}, topk_idx {tuple(topk_idx.shape)}")
    if not dy.is_cuda:
        dtw = (dy.float()[:, None, :] * slot_rows.view(t, k, h).float()).sum(-1)
        return torch.where(topk_idx >= 0, dtw, torch.zeros_like(dtw))
    if max(dy.numel(), slot_rows.numel()) > MAX_NUMEL:
        raise ValueError("dy and slot_rows must hold < 2^31 elements")
    dtw = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    if t * k:
        fn, _ = compiled_slot_dtopk_w(arch_of_device(dy.device))
        with torch.cuda.device(dy.device):
            fn(*_slot_pointers(dy.data_ptr(), slot_rows.data_ptr(), topk_idx.data_ptr(), dtw.data_ptr()), t, k, h // 8,
               current_stream(dy.device))
    return dtw


def _ptr(kind: str, addr: int, align: int):
    """A global pointer argument: ``kind`` u32 (bf16 rows as 32-bit words, fp32 bits), i64 or i32."""
    cutlass, cute = dsl()
    dtype = {"u32": cutlass.Uint32, "i64": cutlass.Int64, "i32": cutlass.Int32}[kind]
    return cute.runtime.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def _pointers(dy: int, r: int, out: int, row_of: int, w: int, dtw: int, offs: int, x: int, x_out: int):
    """Kernel pointer arguments (rows as 32-bit words, each route's grouped row int32, weights as fp32 bits)."""
    return _RouteOperands(_ptr("u32", dy, 16), _ptr("u32", r, 16), _ptr("u32", out, 16), _ptr("i32", row_of, 4),
                          _ptr("u32", w, 4), _ptr("u32", dtw, 4), _ptr("i32", offs, 4), _ptr("u32", x, 16),
                          _ptr("u32", x_out, 16))


def _slot_pointers(dy: int, slots: int, idx: int, dtw: int):
    """:func:`slot_dtopk_w`'s kernel pointers (topk_idx int64, d topk_w as fp32 bits)."""
    return _ptr("u32", dy, 16), _ptr("u32", slots, 16), _ptr("i64", idx, 8), _ptr("u32", dtw, 4)


def compiled_route_grad(arch: str, by_route: bool = False, with_x: bool = False):
    """The cached ``(compiled, CompileReport)`` for an arch in ``compile.ARCHS`` (``by_route``:
    the forward rows are in route order, see :func:`dy_rows_and_dtopk_w`; ``with_x``: the x rows too,
    :func:`dy_x_rows_and_dtopk_w`)."""
    return compile_cached(("route_grad", arch, by_route, with_x), lambda: _build(arch, by_route, with_x))


def _typed(*specs):
    """Each ``(name, tensor, dtype, ndim)``: a contiguous torch tensor of that dtype and rank, else TypeError /
    ValueError naming it."""
    for name, t, dtype, nd in specs:
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != nd:
            raise TypeError(f"{name} must be a {nd}-D {dtype} tensor")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _check(dy, r_rows, order, topk_w, offsets, order_dtype=torch.int64):
    """The operands' dtypes, ranks and shapes: TypeError / ValueError naming the argument."""
    _typed(("dy", dy, torch.bfloat16, 2), ("r_rows", r_rows, torch.bfloat16, 2), ("order", order, order_dtype, 1),
           ("topk_w", topk_w, torch.float32, 2), ("offsets", offsets, torch.int32, 1))
    (t, h), (k, m) = dy.shape, (topk_w.shape[1], r_rows.shape[0])
    if h % 8 or h == 0:
        raise ValueError(f"dy: H = {h} must be a positive multiple of 8")
    if topk_w.shape[0] != t or r_rows.shape[1] != h or m != t * k or order.shape[0] != m:
        raise ValueError(f"shapes must be dy [T, H], topk_w [T, k], r_rows and order [T*k, ...]: got dy "
                         f"{tuple(dy.shape)}, topk_w {tuple(topk_w.shape)}, r_rows {tuple(r_rows.shape)}, "
                         f"order {tuple(order.shape)}")
    if offsets.numel() < 2:
        raise ValueError(f"offsets must hold E+1 >= 2 entries, got {offsets.numel()}")
    if max(dy.numel(), r_rows.numel()) > MAX_NUMEL:
        raise ValueError("dy and r_rows must hold < 2^31 elements")


def dy_rows_and_dtopk_w_torch(dy, r_rows, order, topk_w, offsets, rows_by_route: bool = False):
    """The same contract in torch ops (CPU path and test mirror); rows past offsets[E] of
    dy_rows are zero here. Returns (dy_rows [T*k, H] bf16, d_topk_w [T, k] fp32)."""
    t, k = topk_w.shape
    w_rows = topk_w.reshape(-1)[order]
    dy_g = dy.index_select(0, order // k)
    valid = torch.arange(order.shape[0], device=dy.device) < offsets[-1]
    dy_rows = torch.where(valid[:, None], (dy_g.float() * w_rows[:, None]).to(torch.bfloat16),
                          torch.zeros((), dtype=torch.bfloat16, device=dy.device))
    r_g = r_rows.index_select(0, order) if rows_by_route else r_rows
    dtw = torch.where(valid, (dy_g.float() * r_g.float()).sum(-1), torch.zeros((), device=dy.device))
    out = torch.empty_like(dtw)
    out[order] = dtw
    return dy_rows, out.view(t, k)


def dy_rows_and_dtopk_w(dy, r_rows, order, topk_w, offsets, rows_by_route: bool = False):
    """(dy_rows [T*k, H] bf16, d_topk_w [T, k] fp32) per the module contract, on the device
    (no host sync). dy [T, H] bf16, r_rows [T*k, H] bf16 (expert-grouped forward rows; with
    ``rows_by_route`` in route order instead: row t*k + j is slot j of token t, as the fused
    forward writes them),
    order [T*k] int64 (route of each grouped row), topk_w [T, k] fp32, offsets [E+1] int32;
    all contiguous, on one CUDA device; CPU tensors take :func:`dy_rows_and_dtopk_w_torch`."""
    _check(dy, r_rows, order, topk_w, offsets)
    if not dy.is_cuda:
        return dy_rows_and_dtopk_w_torch(dy, r_rows, order, topk_w, offsets, rows_by_route)
    return _launch(dy, r_rows, order, topk_w, offsets, rows_by_route)


def dy_x_rows_and_dtopk_w(dy, x, r_rows, order, topk_w, offsets, rows_by_route: bool = False):
    """:func:`dy_rows_and_dtopk_w` and the expert-grouped x rows in the same pass: ``(dy_rows, d_topk_w, x_rows)``
    with ``x_rows`` [T*k, H] bf16, row p = ``x[order[p] // k]`` for p < offsets[E] (later rows not written on the
    device). x [T, H] bf16 contiguous, the other operands as there."""
    _check(dy, r_rows, order, topk_w, offsets)
    _typed(("x", x, torch.bfloat16, 2))
    if x.shape != dy.shape:
        raise ValueError(f"x must be [T, H] = {tuple(dy.shape)} as dy, got {tuple(x.shape)}")
    if not dy.is_cuda:
        dy_rows, dtw = dy_rows_and_dtopk_w_torch(dy, r_rows, order, topk_w, offsets, rows_by_route)
        return dy_rows, dtw, x.index_select(0, order // topk_w.shape[1])
    return _launch(dy, r_rows, order, topk_w, offsets, rows_by_route, x)


def _launch(dy, r_rows, order, topk_w, offsets, rows_by_route: bool, x=None):
    """The route-major kernel: every route's grouped row from the inverse of ``order`` (one scatter), then one warp
    per route; returns ``(dy_rows, d_topk_w)`` and, with ``x``, the x rows."""
    t, h = dy.shape
    k, m = topk_w.shape[1], r_rows.shape[0]
    out = torch.empty_like(r_rows)
    dtw = torch.empty_like(topk_w)
    x_rows = None if x is None else torch.empty_like(r_rows)
    if m:
        row_of = torch.empty(m, dtype=torch.int32, device=dy.device)
        row_of.scatter_(0, order, torch.arange(m, dtype=torch.int32, device=dy.device))
        fn, _ = compiled_route_grad(arch_of_device(dy.device), rows_by_route, x is not None)
        xs = (dy, out) if x is None else (x, x_rows)  # without x: any valid pointers, unread
        with torch.cuda.device(dy.device):
            fn(_pointers(dy.data_ptr(), r_rows.data_ptr(), out.data_ptr(), row_of.data_ptr(), topk_w.data_ptr(),
                         dtw.data_ptr(), offsets.data_ptr(), xs[0].data_ptr(), xs[1].data_ptr()),
               t, m, k, offsets.numel() - 1, h // 8, current_stream(dy.device))
    return (out, dtw) if x is None else (out, dtw, x_rows)

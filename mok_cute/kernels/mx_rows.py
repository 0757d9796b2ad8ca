"""MXFP8 round trips (quantize to e4m3 with an E8M0 scale per 32-element block, dequantize back
to bf16) of bf16 rows in place of a kernel, with the ops of :class:`~mok_cute.kernels.quant.fp8_ops.Fp8Ops`,
so each is bitwise :mod:`~mok_cute.kernels.quant.dequant_mxfp8`'s round-trip kernel on the same
rows: :func:`mx_column_block` along the rows' axis (one 32-row block of one 8-column chunk),
:func:`mx_row` along a row (one warp). Views are uint32 words of bf16 pairs, 16-byte chunks
of 4 words; shared by the SM90 dSwiGLU epilogue, the fused backwards' gather
(:func:`~mok_cute.kernels.route_grad_row.gather_chunks`) and the MXFP8 prologue
(:mod:`~mok_cute.kernels.route_grad`)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from mok_cute.kernels.quant.fp8_ops import Fp8Ops

MX_BLOCK = 32  # elements per MXFP8 block
_OPS = Fp8Ops(bf16=True)  # (a module global: a local object may not cross a run-time loop)


def chunk_words(m: cute.Tensor, hc: Int32, per_chunk: int) -> cute.Tensor:
    """A 2-D tensor of ``hc`` chunks per row as (rows, hc, per_chunk) uint32 words: bf16 rows with 4
    words per 16-byte chunk of 8 elements, their e4m3 rows with 2 (8 bytes per chunk)."""
    return cute.make_tensor(cute.recast_ptr(m.iterator, dtype=Uint32),
                            cute.make_layout((m.shape[0], hc, per_chunk), stride=(hc * per_chunk, per_chunk, 1)))


@cute.jit
def mx_column_block(words: cute.Tensor, r0: Int32, c: Int32, rows: Int32, out: cute.Tensor = None,
                    guard: cutlass.Constexpr[bool] = False):
    """Rows ``r0 .. r0 + 32`` of 8-column chunk ``c`` of a (rows, chunks, 4) word view: the block's
    amax per column (rows ``>= rows`` as 0), each column's E8M0 scale, then each row's chunk
    quantized to e4m3 and dequantized back into ``out`` (None: in place; the second pass reads
    ``words`` again). ``guard``: rows ``>= rows`` are neither read nor written (a global view whose
    later rows belong to another tile); else all 32 are read and written (a tile in shared memory)."""
    dst = words if cutlass.const_expr(out is None) else out
    mul, deq, masks, _ = column_scales(words, r0, c, rows, guard, True)
    for i in cutlass.range(MX_BLOCK, unroll=2 if guard else 4):
        if cutlass.const_expr(guard):
            if r0 + i < rows:
                _round_trip_chunk(words, dst, r0 + i, c, mul, deq, masks)
        else:
            _round_trip_chunk(words, dst, r0 + i, c, mul, deq, masks)


@cute.jit
def column_scales(words: cute.Tensor, r0: Int32, c: Int32, rows: Int32, guard: cutlass.Constexpr[bool],
                  deq_bits: cutlass.Constexpr[bool]):
    """The MXFP8 scales of rows ``r0 .. r0 + 32`` of 8-column chunk ``c`` (:func:`mx_column_block`'s
    first pass; ``guard`` as there): ``(mul, deq, masks, bytes)``: per column its 2^-e fp32
    multiplier, its dequantize multiplier's fp32 bits (with ``deq_bits``; else None) and its E8M0
    byte; per data word (4 columns) the NaN-byte mask."""
    a0, a1, a2, a3 = (Uint32(0),) * 4  # |x| bits >= 0: a max from 0 is the max
    for i in cutlass.range(MX_BLOCK, unroll=2 if guard else 4):  # run-time: 32 rows' loads not all hoisted
        keep = Uint32(0) - Uint32(r0 + i < rows)  # rows past the tile's: 0
        row = r0 + i
        if cutlass.const_expr(guard):
            row = cutlass.min(row, rows - 1)
        v = words[(row, c, None)].load()
        a0 = _OPS.amax_acc(a0, v[0] & keep)
        a1 = _OPS.amax_acc(a1, v[1] & keep)
        a2 = _OPS.amax_acc(a2, v[2] & keep)
        a3 = _OPS.amax_acc(a3, v[3] & keep)
    accs = [a0, a1, a2, a3]
    mul, deq, nan, scale_bytes = [], [], [], []
    for e in cutlass.range_constexpr(8):  # element 2j: word j's low half, 2j + 1 its high half
        a = Int32(accs[e // 2] & Uint32(0xFFFF0000))
        if cutlass.const_expr(e % 2 == 0):
            a = Int32((accs[e // 2] & Uint32(0xFFFF)) << 16)
        sc, byte, nf = _OPS.e8m0(a)
        mul.append(sc)
        if cutlass.const_expr(deq_bits):
            deq.append(_OPS.scale_bits(byte))
        nan.append(nf)
        scale_bytes.append(byte)
    masks = []  # per data word (4 e4m3 bytes, one column each): each byte's NaN mask
    for w in cutlass.range_constexpr(2):
        masks.append((nan[4 * w] & Uint32(0xFF)) | (nan[4 * w + 1] & Uint32(0xFF00))
                     | (nan[4 * w + 2] & Uint32(0xFF0000)) | (nan[4 * w + 3] & Uint32(0xFF000000)))
    return mul, deq if cutlass.const_expr(deq_bits) else None, masks, scale_bytes


def _round_trip_chunk(words: cute.Tensor, dst: cute.Tensor, row: Int32, c: Int32, mul: list, deq: list,
                      masks: list):
    """Chunk ``(row, c)`` of ``words`` quantized with the per-column multipliers ``mul`` and NaN
    ``masks``, dequantized with ``deq``, into ``dst``."""
    q = _OPS.fp8_words(_OPS.elems(words[(row, c, None)].load()), mul, masks)
    o = cute.make_rmem_tensor((4,), Uint32)
    _OPS.deq_bf16([q[0], q[1]], deq, o)
    dst[(row, c, None)].store(o.load())


@cute.jit
def mx_row(lane: Int32, words: cute.Tensor, p: Int32, hc: Int32, out: cute.Tensor = None):
    """One warp: row ``p`` of a (rows, hc, 4) word view (``hc`` 16-byte chunks, a multiple of 4)
    after the round trip along the row (a block = 4 adjacent lanes' chunks, amax by shuffles),
    bitwise ``dequant_mxfp8.mxfp8_round_trip``, into ``out`` at the same coordinates (None: in
    place). Every lane joins every shuffle: a lane past the row's end reloads its last chunk and
    stores nothing (whole blocks of lanes)."""
    dst = words if cutlass.const_expr(out is None) else out
    for c0 in cutlass.range(0, hc, 32, unroll=1):
        c = c0 + lane
        v = words[(p, cutlass.min(c, hc - 1), None)].load()
        o = _OPS.mx_round_trip(v, 4)
        if c < hc:
            dst[(p, c, None)].store(o.load())


@cute.jit
def mx_tile_columns(tidx: Int32, threads: cutlass.Constexpr[int], src: cute.Tensor, dst: cute.Tensor, row0: Int32,
                    rows: Int32, tile_m: cutlass.Constexpr[int], hc: Int32):
    """A CTA's ``threads``: rows ``row0 .. row0 + rows`` (an m-tile whose row 0 starts an MXFP8 block,
    e.g. an expert's tile) of ``src`` after the round trip along the rows' axis into ``dst`` (may be
    ``src``), one thread per (32-row block, chunk): :func:`mx_column_block` with ``guard``; bitwise
    ``dequant_mxfp8.mxfp8_round_trip_tokens`` on those rows."""
    end = row0 + rows
    for item in cutlass.range(tidx, (tile_m // MX_BLOCK) * hc, threads, unroll=1):
        r0 = row0 + (item // hc) * MX_BLOCK
        if r0 < end:
            mx_column_block(src, r0, item % hc, end, dst, True)

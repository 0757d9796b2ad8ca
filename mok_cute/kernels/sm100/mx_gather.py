"""The SM100 fused backward's MXFP8 gather step (:func:`quantize_tile`, the ``mx`` step of
:func:`~mok_cute.kernels.route_grad_row.gather_chunks`): the comm CTAs quantize each gathered
m-tile's bf16 rows into the block-scaled operands the tcgen05 MXFP8 tiles read, as the unfused
MXFP8 backward's host makes them (``fused_bwd._mx_operands``):

* dy along H (D2's A): e4m3 rows [M, H] and their row scales in the grouped blocked layout
  (``quantize_mxfp8(dy_rows, -1)`` placed by ``layouts.pack_row_scales``);
* dy and x along the tokens (dW_down's and dW_gate / dW_up's B): e4m3 token rows [M, H] and the
  token scales in the wgrad layout (``layouts.TokenOperand``: blocks of 32 rows from each expert's
  first row, block j of expert e at column 4 (o_e // 128 + e) + j of the [H, KB] matrix).

The ops are the quantizers' (:class:`~mok_cute.kernels.quant.fp8_ops.Fp8Ops`, the column scales
of :func:`~mok_cute.kernels.mx_rows.column_scales`), so each byte is the host path's. Scale bytes
the tiles do not cover stay as the host zeroed them.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from mok_cute.kernels.mx_rows import MX_BLOCK, chunk_words, column_scales
from mok_cute.kernels.route_grad_row import MxTile
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.kernels.sm100 import layouts as lay

_OPS = Fp8Ops(bf16=True)  # (a module global: a local object may not cross a run-time loop)


@cute.jit
def quantize_tile(tile: MxTile, xpass: cutlass.Constexpr[int], operands: tuple):
    """The CTA's ``threads`` (``tile``: :class:`~mok_cute.kernels.route_grad_row.MxTile`) on m-tile ``m_tile`` of
    ``expert`` (rows ``row0 .. row0 + rows`` of the
    bf16 ``dy_rows`` / ``x_rows`` [M, H], stored before it by any of them; the caller's fence and
    barrier follow it). ``operands`` = ``(dyq, dy_sf, dy_t, dy_tsf, x_t, x_tsf)``: e4m3 [M, H] dy
    along H, uint8 flat blocked row scales, e4m3 [M, H] dy along the tokens and its token scales,
    the same for x. Pass 0 writes dy's three (with their scales), pass 1 x's token rows. ``tile_m``
    128 or 256 (the ``cta_group::2`` megakernels' m-tiles: two scale atom rows each)."""
    tidx, warp, lane, threads, dy_rows, x_rows, row0, rows, tile_m, hc, offsets, expert, m_tile = tile
    dyq, dy_sf, dy_t, dy_tsf, x_t, x_tsf = operands
    atom_row = offsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile  # the tile's scale atom row
    if cutlass.const_expr(tile_m != lay.SF_ATOM_ROWS):
        atom_row = offsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile * (tile_m // lay.SF_ATOM_ROWS)
    t_atoms = (dy_rows.shape[0] + (lay.SF_ATOM_ROWS - 1)) // lay.SF_ATOM_ROWS + offsets.shape[0] - 1
    cute.arch.barrier()
    if cutlass.const_expr(xpass == 0):
        src = chunk_words(dy_rows, hc, 4)
        _token_blocks(tidx, threads, src, chunk_words(dy_t, hc, 2), dy_tsf, row0, rows, tile_m, hc, atom_row, t_atoms)
        h_atoms = (hc + (4 * lay.SF_ATOM_KBLOCKS - 1)) // (4 * lay.SF_ATOM_KBLOCKS)  # H / 32 blocks, 4 per atom
        q = chunk_words(dyq, hc, 2)
        for rr in cutlass.range(warp, rows, threads // 32, unroll=1):
            if cutlass.const_expr(tile_m == lay.SF_ATOM_ROWS):
                _row_blocks(lane, src, q, dy_sf, row0 + rr, rr, hc, atom_row, h_atoms)
            else:
                _row_blocks(lane, src, q, dy_sf, row0 + rr, rr % lay.SF_ATOM_ROWS, hc,
                            atom_row + rr // lay.SF_ATOM_ROWS, h_atoms)
    else:
        _token_blocks(tidx, threads, chunk_words(x_rows, hc, 4), chunk_words(x_t, hc, 2), x_tsf, row0, rows, tile_m, hc,
                      atom_row, t_atoms)


@cute.jit
def _row_blocks(lane: Int32, src: cute.Tensor, q: cute.Tensor, sf: cute.Tensor, p: Int32, r: Int32, hc: Int32,
                atom_row: Int32, h_atoms: Int32):
    """One warp: row ``p`` (row ``r`` of its tile) quantized along H, a block = 4 adjacent lanes'
    chunks (:meth:`Fp8Ops.mx_block`), e4m3 into ``q``, each block's byte into ``sf`` at (atom row,
    r, block). Every lane joins every shuffle: a lane past the row's end reloads its last chunk and
    stores nothing (whole blocks of lanes: hc is a multiple of 4)."""
    for c0 in cutlass.range(0, hc, 32, unroll=1):
        c = c0 + lane
        words, byte = _OPS.mx_block(src[(p, cutlass.min(c, hc - 1), None)].load(), 4)
        if c < hc:
            q[(p, c, 0)] = words[0]
            q[(p, c, 1)] = words[1]
            if c % 4 == 0:
                sf[lay.sf_byte(atom_row, r, c // 4, h_atoms)] = cutlass.Uint8(byte)


@cute.jit
def _token_blocks(tidx: Int32, threads: cutlass.Constexpr[int], src: cute.Tensor, q: cute.Tensor, sf: cute.Tensor,
                  row0: Int32, rows: Int32, tile_m: cutlass.Constexpr[int], hc: Int32, atom_row: Int32,
                  t_atoms: Int32):
    """The CTA's ``threads``, one per (32-row block b, 8-column chunk c) of the tile: its columns'
    scales along the tokens (:func:`~mok_cute.kernels.mx_rows.column_scales`, rows past the tile's
    as 0), each row's chunk as e4m3 into ``q``, column n's byte into ``sf`` at feature n's scale row
    and token block 4 atom_row + b (``t_atoms`` atoms per atom row)."""
    end = row0 + rows
    for item in cutlass.range(tidx, (tile_m // MX_BLOCK) * hc, threads, unroll=1):
        b = item // hc
        c = item % hc
        r0 = row0 + b * MX_BLOCK
        if r0 < end:
            mul, _, masks, scale_bytes = column_scales(src, r0, c, end, True, False)
            for i in cutlass.range(MX_BLOCK, unroll=2):
                if r0 + i < end:
                    o = _OPS.fp8_words(_OPS.elems(src[(r0 + i, c, None)].load()), mul, masks)
                    q[(r0 + i, c, 0)] = o[0]
                    q[(r0 + i, c, 1)] = o[1]
            for e in cutlass.range_constexpr(8):
                n = c * 8 + e
                sf[lay.sf_byte(n // lay.SF_ATOM_ROWS, n % lay.SF_ATOM_ROWS, lay.SF_ATOM_KBLOCKS * atom_row + b,
                               t_atoms)] = cutlass.Uint8(scale_bytes[e])

"""Persistent tile schedule over grouped (per-expert) GEMM tiles, read from device offsets.

Tile space: experts in order; expert ``e`` owns rows ``offsets[e]..offsets[e+1]`` and
``ceil(rows_e / tile_m) * n_tiles`` tiles, numbered m-tile fastest
(``local = n_tile * m_tiles_e + m_tile``). Linear tile ``t`` of the whole space belongs to
the expert whose tile range holds it. CTA ``c`` of ``num_ctas`` runs tiles
``c, c + num_ctas, c + 2 * num_ctas, ...`` until the space is exhausted, so no SM idles
while another expert still has tiles (one hot expert is spread over all CTAs).

Weight-gradient schedule (K = an expert's tokens): every expert owns the same
``m_tiles * n_tiles`` output tiles whatever its token count (an expert with no tokens
still has tiles: they are written as zeros). Linear tile ``t`` is expert
``t // (m_tiles * n_tiles)``, m-tile fastest inside it; CTAs stride over all tiles the
same way (:func:`wgrad_tile`, mirror :func:`wgrad_cta_tiles`). Consecutive CTAs share an
expert's token panel, and every CTA samples every expert, so one hot expert does not
leave SMs idle.

Device side: the cursor ``(expert, base)`` — the expert being scanned and the linear index
of its first tile — only moves forward, so a CTA scans the offsets once in total
(O(E + tiles) per CTA), with no host sync and no dependence on token counts at compile
time. This module imports no GEMM code.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


# ---------------------------------------------------------------- pure-Python mirror
def expert_tiles(offsets, tile_m: int, n_tiles: int) -> list[int]:
    """Tiles of each expert: ``ceil(rows_e / tile_m) * n_tiles``."""
    offs = [int(o) for o in offsets]
    return [mtiles(offs[e], offs[e + 1], tile_m) * n_tiles for e in range(len(offs) - 1)]


def total_tiles(offsets, tile_m: int, n_tiles: int) -> int:
    """Size of the linear tile space."""
    return sum(expert_tiles(offsets, tile_m, n_tiles))


def cta_tiles(offsets, tile_m: int, n_tiles: int, cta: int, num_ctas: int) -> list[tuple[int, int, int, int, int]]:
    """Mirror of the device walk for one CTA: ``[(expert, m_tile, n_tile, row0, rows)]``.

    ``row0`` is the first global row of the tile, ``rows`` how many of its ``tile_m`` rows
    belong to the expert (the store mask).
    """
    offs = [int(o) for o in offsets]
    num_experts = len(offs) - 1
    out = []
    expert, base, linear = 0, 0, cta
    while True:
        expert, base = _seek(offs, num_experts, tile_m, n_tiles, linear, expert, base)
        if expert >= num_experts:
            return out
        out.append(_coords(offs, tile_m, linear, expert, base))
        linear += num_ctas


def _seek(offs, num_experts, tile_m, n_tiles, linear, expert, base):
    while expert < num_experts:
        nt = mtiles(offs[expert], offs[expert + 1], tile_m) * n_tiles
        if linear < base + nt:
            break
        base += nt
        expert += 1
    return expert, base


def _coords(offs, tile_m, linear, expert, base):
    m_tiles = mtiles(offs[expert], offs[expert + 1], tile_m)
    local = linear - base
    m_tile, n_tile = local % m_tiles, local // m_tiles
    row0 = offs[expert] + m_tile * tile_m
    return expert, m_tile, n_tile, row0, min(tile_m, offs[expert + 1] - row0)


def wgrad_cta_tiles(num_experts: int, m_tiles: int, n_tiles: int, cta: int, num_ctas: int) -> list[tuple[int, int, int]]:
    """Mirror of the weight-gradient walk for one CTA: ``[(expert, m_tile, n_tile)]``."""
    per_expert = m_tiles * n_tiles
    out = []
    for linear in range(cta, num_experts * per_expert, num_ctas):
        local = linear % per_expert
        out.append((linear // per_expert, local % m_tiles, local // m_tiles))
    return out


def mtiles(lo, hi, tile_m: int):
    """``ceil((hi - lo) / tile_m)``: the ``tile_m``-row tiles over rows ``lo .. hi`` (Python ints or DSL values)."""
    return (hi - lo + (tile_m - 1)) // tile_m


def expert_mtile_count(offsets, e, tile_m: int):
    """:func:`mtiles` of expert ``e``'s rows ``offsets[e] .. offsets[e + 1]`` (offsets: a device tensor [E+1])."""
    hi = offsets[e + 1]
    return mtiles(offsets[e], hi, tile_m)


# ---------------------------------------------------------------- device functions
@cute.jit
def seek(offsets: cute.Tensor, num_experts: Int32, tile_m: cutlass.Constexpr[int], n_tiles: Int32,
         linear: Int32, expert: Int32, base: Int32):
    """Advance the cursor ``(expert, base)`` until expert's tiles hold ``linear``.

    ``offsets``: int32 gmem tensor [E+1]. ``linear`` must not be below ``base`` (indices
    only grow). Returns the new ``(expert, base)``; ``expert == num_experts`` means
    ``linear`` is past the last tile (the CTA is done).
    """
    e = expert
    b = base
    searching = e < num_experts
    while searching:
        lo = offsets[e]
        hi = offsets[e + 1]
        nt = mtiles(lo, hi, tile_m) * n_tiles
        if linear < b + nt:
            searching = False
        else:
            b = b + nt
            e = e + 1
            searching = e < num_experts
    return e, b


def tiles_over(n, tile, n_tail: bool):
    """Tiles of ``tile`` over ``n``: rounded up with ``n_tail`` (a partial last tile), else ``n``
    is a multiple of ``tile`` (exact division: the aligned kernels' code as it always was)."""
    return (n + (tile - 1)) // tile if n_tail else n // tile


@cute.jit
def grouped_start(offsets: cute.Tensor, b_len: Int32, b_rows, k_len: Int32, tile_m: cutlass.Constexpr[int],
                  tile_k: cutlass.Constexpr[int], n_tail: cutlass.Constexpr[bool] = False):
    """This CTA's start in the persistent tile sequence of a grouped GEMM whose B has ``b_len``
    rows of N loaded ``b_rows`` per tile (``n_tail``: the last tile may run past them; else
    ``b_len`` is a multiple of ``b_rows``) and whose reduction is ``k_len`` long:
    ``(num_experts, n_tiles, k_tiles, linear, grid, expert, base)`` with ``linear`` = the block
    index, ``grid`` = the stride (number of CTAs) and ``(expert, base)`` = :func:`seek` of
    ``linear`` from the first expert."""
    num_experts = offsets.shape[0] - 1
    n_tiles = tiles_over(b_len, b_rows, n_tail)
    k_tiles = (k_len + (tile_k - 1)) // tile_k
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    linear = Int32(bidx)
    expert, base = seek(offsets, num_experts, tile_m, n_tiles, linear, Int32(0), Int32(0))
    return num_experts, n_tiles, k_tiles, linear, grid, expert, base


@cute.jit
def tile_coords(offsets: cute.Tensor, tile_m: cutlass.Constexpr[int], linear: Int32, expert: Int32, base: Int32):
    """``(m_tile, n_tile, row0, rows)`` of ``linear`` inside ``expert`` (cursor from :func:`seek`).

    ``row0``: first global row of the tile; ``rows``: rows of the tile inside the expert.
    """
    lo = offsets[expert]
    hi = offsets[expert + 1]
    m_tiles = mtiles(lo, hi, tile_m)
    local = linear - base
    m_tile = local % m_tiles
    n_tile = local // m_tiles
    row0 = lo + m_tile * tile_m
    rows = cutlass.min(hi - row0, tile_m)
    return m_tile, n_tile, row0, rows


@cute.jit
def wgrad_start(offsets: cute.Tensor, rows_out: Int32, cols_out: Int32, tile_m: cutlass.Constexpr[int],
                tile_n: cutlass.Constexpr[int], n_tail: cutlass.Constexpr[bool] = False):
    """This CTA's start in the weight-gradient walk over an [E, rows_out, cols_out] output:
    ``(num_experts, m_tiles, n_tiles, total, linear, grid)`` (the last m-tile may run past
    ``rows_out``, with ``n_tail`` the last n-tile past ``cols_out``; ``linear`` the block index, ``grid`` the stride, ``total`` the tiles of all
    experts; :func:`wgrad_tile` maps a linear tile)."""
    num_experts = offsets.shape[0] - 1
    m_tiles = (rows_out + (tile_m - 1)) // tile_m
    n_tiles = tiles_over(cols_out, tile_n, n_tail)
    total = num_experts * m_tiles * n_tiles
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    return num_experts, m_tiles, n_tiles, total, Int32(bidx), grid


@cute.jit
def wgrad_tile(linear: Int32, m_tiles: Int32, n_tiles: Int32):
    """``(expert, m_tile, n_tile)`` of linear weight-gradient tile ``linear`` (see module doc)."""
    per_expert = m_tiles * n_tiles
    local = linear % per_expert
    return linear // per_expert, local % m_tiles, local // m_tiles


@cute.jit
def warp_sum(v: Int32) -> Int32:
    """The sum of ``v`` over the 32 lanes of a converged warp, in every lane (butterfly shuffles)."""
    for s in cutlass.range_constexpr(5):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> s)
    return v

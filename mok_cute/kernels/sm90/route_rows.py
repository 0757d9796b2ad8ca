"""Routed rows of the SM90 megakernels: a staged tile's grouped rows stored to their (token, slot)
rows, and the fixed-order slot sum over each token's slot rows (the forward's combine of y, the
backward's of dx).

* :func:`scatter`: rows ``r < rows`` of the staged (tile_m, tile_n) bf16 tile go to row
  ``order[row0 + r]`` = ``t*k + j`` of ``slot`` [T*k, N] (EP > 1, ``ep`` a
  :class:`~mok_cute.comm.peer_rows.PeerRows`: to the source rank's slot buffer, ``order`` then
  holding ``p*T*k + t*k + j``).
* :func:`slot_sum`: :func:`mok_cute.kernels.slot_rows.slot_sum` (arch-neutral) over the SM90
  kernels' ``NUM_THREADS``, its tensors bundled (``slot_rows.SlotSumOperands``).
* :func:`accumulate`: a staged bf16 tile added into fp32 rows (main_grad accumulation).
* :func:`copy_row`: :func:`mok_cute.kernels.slot_rows.copy_row` (one warp copies a bf16 row).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from mok_cute.comm.combine import add_rn
from mok_cute.kernels import slot_rows
from mok_cute.kernels.slot_rows import SlotSumOperands  # noqa: F401 (the megakernels' route_rows.SlotSumOperands)
from mok_cute.kernels.slot_rows import copy_row  # noqa: F401 (the megakernels' route_rows.copy_row)
from mok_cute.kernels.sm90.grouped_gemm import _VEC, _load_rows, _row_copy
from mok_cute.kernels.sm90.mainloop import NUM_THREADS


def grouped_rows(order: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [n]: route ``t*k + j`` -> its grouped row (``order`` int32 [M]: grouped row -> route; the
    inverse), 0 for a route without one: the ``mRow`` of a slot sum over grouped slot rows."""
    rows = torch.zeros(n, dtype=torch.int32, device=order.device)
    rows[order.long()] = torch.arange(order.shape[0], dtype=torch.int32, device=order.device)
    return rows


SUM_REGS = 160  # per thread in every warpgroup for the slot sum after the GEMM tasks (3 x 128 x 160 <= 64K)


@cute.jit
def tile_routes(tid: Int32, row0: Int32, rows: Int32, mOrder: cute.Tensor, tile_m: cutlass.Constexpr[int],
                tile_n: cutlass.Constexpr[int]) -> cute.Tensor:
    """Consumer thread ``tid``: ``order[row0 + r]`` of each tile row r that :func:`scatter` gives it (-1 past
    ``rows``), as an Int32 register tensor. Loaded before the tile's mainloop, the loads' latency is off the
    epilogue's path (the stores' addresses do not wait on them)."""
    coords = _row_copy(tile_n).get_slice(tid).partition_S(cute.make_identity_tensor((tile_m, tile_n)))
    n_rows = cute.size(coords, mode=[1])
    routes = cute.make_rmem_tensor((n_rows,), Int32)
    for m in cutlass.range_constexpr(n_rows):
        rr, _ = coords[(0, m, 0)]
        routes[m] = Int32(-1)
        if rr < rows:
            routes[m] = mOrder[row0 + rr]
    return routes


@cute.jit
def scatter(sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mSlot: cute.Tensor,
            mOrder: cute.Tensor, tile_n: cutlass.Constexpr[int], ep, n_tail: cutlass.Constexpr[bool] = False,
            routes: cute.Tensor = None):
    """Store the staged tile's rows ``r < rows`` to ``slot[order[row0 + r]]`` (see the module doc;
    ``n_tail``: only the columns inside N; ``routes``: those rows' ``order`` values from
    :func:`tile_routes`, else they are loaded here)."""
    copy = _row_copy(tile_n)
    r, coords = _load_rows(copy, tid, sC)
    v = mSlot.shape[1] // _VEC
    dst = cute.make_tensor(mSlot.iterator, cute.make_layout((mSlot.shape[0] * v, _VEC), stride=(_VEC, 1)))
    col0 = n_tile * (tile_n // _VEC)
    for m in cutlass.range_constexpr(cute.size(r, mode=[1])):
        rr, c = coords[(0, m, 0)]
        if rr < rows:
            if cutlass.const_expr(routes is None):
                route = mOrder[row0 + rr]
            else:
                route = routes[m]
            for n in cutlass.range_constexpr(cute.size(r, mode=[2])):
                _, cn = coords[(0, m, n)]
                inside = True
                if cutlass.const_expr(n_tail):
                    inside = col0 + cn // _VEC < v
                if inside:
                    if cutlass.const_expr(ep is not None):
                        ep.push_vec(route, col0 + cn // _VEC, v, r[(None, m, n)].load())
                    else:
                        dst[route * v + col0 + cn // _VEC, None].store(r[(None, m, n)].load())


def slot_sum(tidx: Int32, bidx: Int32, grid: Int32, ops: SlotSumOperands, k: Int32, tokens: Int32, hidden: Int32,
             sbuf: cute.Tensor, nb: int):
    """:func:`mok_cute.kernels.slot_rows.slot_sum` of ``ops`` (:class:`~mok_cute.kernels.slot_rows.SlotSumOperands`)
    over this kernel's ``NUM_THREADS`` per CTA."""
    slot_rows.slot_sum(tidx, bidx, grid, ops, k, tokens, hidden, sbuf, nb, NUM_THREADS)


@cute.jit
def accumulate(sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mMain: cute.Tensor,
               tile_n: cutlass.Constexpr[int], n_tail: cutlass.Constexpr[bool] = False):
    """``main[row0 + r, n_tile * tile_n + c] += fp32(tile[r, c])`` for rows ``r < rows`` (and with
    ``n_tail`` columns ``< C``) of the staged bf16 tile (``add.rn.f32``: Megatron's gradient-accumulation fusion,
    bitwise ``main.add_(bf16_grad.float())``); ``mMain`` fp32 [R, C] row-major."""
    copy = _row_copy(tile_n)
    r, coords = _load_rows(copy, tid, sC)
    g = cute.local_tile(cute.domain_offset((row0, 0), mMain), (cute.size(sC, mode=[0]), tile_n), (0, n_tile))
    for m in cutlass.range_constexpr(cute.size(r, mode=[1])):
        rr, _ = coords[(0, m, 0)]
        if rr < rows:
            for n in cutlass.range_constexpr(cute.size(r, mode=[2])):
                _, cn = coords[(0, m, n)]
                inside = True
                if cutlass.const_expr(n_tail):
                    inside = cn < mMain.shape[1] - n_tile * tile_n
                if inside:
                    vals = r[(None, m, n)].load().to(Float32)
                    for j in cutlass.range_constexpr(_VEC):
                        g[rr, cn + j] = add_rn(g[rr, cn + j], vals[j])

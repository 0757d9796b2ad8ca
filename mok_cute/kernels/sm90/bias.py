"""Expert biases in the SM90 GEMM epilogues (gpt-oss's experts): a tile's FP32 accumulators plus
the bias of its expert and column, before the epilogue rounds them (the reference's
``bf16(fp32(acc) + fp32(b[e, n]))``: one fp32 add, the bias never quantized).

The biases are [E, N] bf16 tensors (any row stride, unit column stride) read by scalar loads:
a consumer thread loads each distinct column of its accumulator fragment once per tile (in the
wgmma layout a quarter of the tile's columns, each shared by its rows). ``split`` is GEMM1's
stacked tile, whose columns ``[0, tile_n/2)`` are gate columns ``n_tile * tile_n/2 + c`` (``lo``
= b_gate) and ``[tile_n/2, tile_n)`` the up columns of the same ``c`` (``hi`` = b_up); otherwise
column ``c`` is ``n_tile * tile_n + c`` of ``lo`` (GEMM2's b_down). Columns past the bias's width
(a partial last n-tile) add nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from mok_cute.kernels.sm90.persistent import opaque


class TileBias(NamedTuple):
    """A fused kernel's biases (kernel parameters; None without them): ``gate``, ``up`` [E, I] (GEMM1's halves)
    and ``down`` [E, H] (GEMM2's), bf16."""

    gate: cute.Tensor | None = None
    up: cute.Tensor | None = None
    down: cute.Tensor | None = None


def fake_bias(dtype, experts, width):
    """The compile-time stand-in of one [E, N] bias: symbolic row stride, unit column stride, 2-byte aligned."""
    return cute.runtime.make_fake_tensor(dtype, (experts, width), stride=(cute.sym_int64(), 1), assumed_align=2)


@cute.jit
def add_bias(tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, tile_m: cutlass.Constexpr[int],
             tile_n: cutlass.Constexpr[int], expert: Int32, n_tile: Int32, lo: cute.Tensor, hi: cute.Tensor = None,
             tail: cutlass.Constexpr[bool] = True):
    """``acc[i] += fp32(b[expert, column of i])`` for this consumer thread's fragment of the tile
    ``n_tile`` (``hi`` given: the split GEMM1 tile, see the module doc; ``tail``: the tile may reach past the
    bias's width, whose columns are skipped, else every column is inside).

    An element's column is thread 0's (known when tracing) plus this thread's offset from thread 0
    (less than 8: one 8-column group), so its half of a split tile is a compile-time fact."""
    ident = cute.make_identity_tensor((tile_m, tile_n))
    t0 = tiled_mma.get_slice(0).partition_C(ident)
    mine = thr_mma.partition_C(ident)
    n = cute.size(acc)
    offs = [t0[i][1] - t0[0][1] for i in range(n)]
    distinct = sorted(set(offs))
    # this thread's column offset from thread 0 and the expert through a side-effecting move: the loads'
    # addresses are computed here, after the mainloop (not hoisted into it, where the accumulators are live)
    shift = opaque(mine[0][1] - t0[0][1])
    expert = opaque(expert)
    width = lo.shape[1]
    split = hi is not None
    half = tile_n // 2
    for o in distinct:  # one bias value live at a time (the 128 accumulators already hold most registers)
        c0 = t0[0][1] + o  # thread 0's column of these elements (compile time)
        src = lo
        col = n_tile * tile_n + c0 + shift
        if cutlass.const_expr(split):
            if cutlass.const_expr(c0 >= half):
                src = hi
            col = n_tile * half + (c0 % half) + shift
        v = Float32(0.0)
        if cutlass.const_expr(tail):
            if col < width:
                v = src[expert, col].to(Float32)
        else:
            v = src[expert, col].to(Float32)
        for i in cutlass.range_constexpr(n):
            if cutlass.const_expr(offs[i] == o):
                acc[i] = acc[i] + v

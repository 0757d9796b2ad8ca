"""Expert biases in the SM90 GEMM epilogues (gpt-oss's experts): a tile's FP32 accumulators plus
the bias of its expert and column, before the epilogue rounds them (the reference's
``bf16(fp32(acc) + fp32(b[e, n]))``: one fp32 add, the bias never quantized).

The biases are [E, N] bf16 tensors (any row stride, unit column stride). ``split`` is GEMM1's
stacked tile, whose columns ``[0, tile_n/2)`` are gate columns ``n_tile * tile_n/2 + c`` (``lo``
= b_gate) and ``[tile_n/2, tile_n)`` the up columns of the same ``c`` (``hi`` = b_up); otherwise
column ``c`` is ``n_tile * tile_n + c`` of ``lo`` (GEMM2's b_down).

Two steps per tile, so that no load latency sits between the mainloop and the epilogue:
:func:`bias_load` before the tile's mainloop (consumer thread t loads the bias of column
``t % tile_n``: one register held across the mainloop), :func:`add_bias` after it (the values
staged in a ``tile_n`` fp32 shared buffer, one consumer barrier, then each accumulator element
adds its column's). Columns past the bias's width (a partial last n-tile) load the last column
instead: they land in accumulator columns the epilogue never stores.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from mok_cute.kernels.sm90.mainloop import consumer_barrier


class TileBias(NamedTuple):
    """A kernel's biases (kernel parameters; None without them): ``gate``, ``up`` [E, I] (GEMM1's halves)
    and ``down`` [E, H] (GEMM2's), bf16."""

    gate: cute.Tensor | None = None
    up: cute.Tensor | None = None
    down: cute.Tensor | None = None


def fake_bias(dtype, experts, width):
    """The compile-time stand-in of one [E, N] bias: symbolic row stride, unit column stride, 2-byte aligned."""
    return cute.runtime.make_fake_tensor(dtype, (experts, width), stride=(cute.sym_int64(), 1), assumed_align=2)


@cute.jit
def bias_load(tid: Int32, tile_n: cutlass.Constexpr[int], expert: Int32, n_tile: Int32, lo: cute.Tensor,
              hi: cute.Tensor = None) -> Float32:
    """Consumer thread ``tid``'s bias value of tile ``n_tile`` of ``expert``: column ``tid % tile_n`` (``hi``
    given: the split GEMM1 tile, see the module doc), clamped to the bias's last column."""
    c = tid % tile_n
    width = lo.shape[1]
    col = n_tile * tile_n + c
    if cutlass.const_expr(hi is not None):
        col = n_tile * (tile_n // 2) + c % (tile_n // 2)
    col = cutlass.min(col, width - 1)
    v = Float32(0.0)
    if cutlass.const_expr(hi is not None):
        if c < tile_n // 2:
            v = lo[expert, col].to(Float32)
        else:
            v = hi[expert, col].to(Float32)
    else:
        v = lo[expert, col].to(Float32)
    return v


@cute.jit
def add_bias(tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, tile_m: cutlass.Constexpr[int],
             tile_n: cutlass.Constexpr[int], tid: Int32, v: Float32, sBias: cute.Tensor):
    """After the tile's mainloop: stage this thread's :func:`bias_load` value ``v`` in ``sBias`` (fp32
    [tile_n]), meet the consumers, then ``acc[i] += sBias[column of i]``. The epilogue's barriers order
    these reads before the next tile's writes.

    An element's column is thread 0's (known when tracing) plus this thread's offset from thread 0, so
    each distinct column is read once."""
    if tid < tile_n:
        sBias[tid] = v
    consumer_barrier()
    ident = cute.make_identity_tensor((tile_m, tile_n))
    t0 = tiled_mma.get_slice(0).partition_C(ident)
    mine = thr_mma.partition_C(ident)
    n = cute.size(acc)
    offs = [t0[i][1] - t0[0][1] for i in range(n)]
    base = mine[0][1]  # this thread's first column (dynamic)
    for o in sorted(set(offs)):
        b = sBias[base + o]
        for i in cutlass.range_constexpr(n):
            if cutlass.const_expr(offs[i] == o):
                acc[i] = acc[i] + b

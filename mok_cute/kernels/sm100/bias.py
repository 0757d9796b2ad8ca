"""Expert biases in the SM100 GEMM epilogues (gpt-oss's experts), BF16: a tile's FP32 accumulators plus the bias
of its expert and column, before the epilogue rounds them (the reference's ``bf16(fp32(acc) + fp32(b[e, n]))``:
one fp32 add, the bias never quantized), and before the SwiGLU reads g, u.

The SM90 counterpart is :mod:`mok_cute.kernels.sm90.bias`. On SM100 an epilogue thread owns one accumulator row
and loads it from tensor memory in chunks of :data:`~mok_cute.kernels.sm100.mainloop.EPI_N` (32) columns
(:class:`~mok_cute.kernels.sm100.mainloop.AccChunks`): every thread of the tile needs the same 32 bias values per
chunk, read as four 16-byte loads (one address per warp: a broadcast) issued before the chunk's ``tcgen05.ld``, so
their latency overlaps it, then added to the chunk's FP32 registers. A chunk past the bias's width (a partial last
n-tile; the epilogue stores nothing there) loads nothing and adds zeros.

The biases are [E, N] bf16 tensors with a unit column stride, a row stride a multiple of 8 elements and a 16-byte
aligned start (:func:`fake_bias`; the host wrappers check it, :func:`check_bias`): GEMM1's b_gate, b_up [E, I],
GEMM2's b_down [E, H]. In a SwiGLU tile (gate columns ``[0, tile_n/2)``, up ``[tile_n/2, tile_n)`` of intermediate
columns ``n_tile * tile_n/2 + c``) chunk c of the gate half reads b_gate, chunk c of the up half b_up, at the same
columns; in a plain tile column c is ``n_tile * tile_n + c`` of b_down.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from mok_cute.dsl.status import gptr
from mok_cute.dsl.tensors import _fake_2d
from mok_cute.kernels.sm100.mainloop import EPI_N, EPI_THREADS, AccChunks

ROW_MULTIPLE = 8  # a bias's row stride, in elements (16 bytes: the loads' alignment)


def fake_bias(experts, width):
    """The compile-time stand-in of one [E, N] bf16 bias: symbolic row stride (a multiple of
    :data:`ROW_MULTIPLE`), unit column stride, 16-byte aligned."""
    return _fake_2d(cutlass.BFloat16, experts, width)


def check_bias(name: str, b, shape: tuple, device) -> None:
    """ValueError unless ``b`` is a bf16 tensor of exactly ``shape`` on ``device`` with a unit last stride, a row
    stride a multiple of :data:`ROW_MULTIPLE` and a 16-byte aligned start (what the epilogue's loads read)."""
    if not isinstance(b, torch.Tensor) or b.dtype != torch.bfloat16 or b.dim() != 2:
        raise ValueError(f"{name} must be a 2-D bfloat16 tensor [E, N], got "
                         f"{type(b).__name__ if not isinstance(b, torch.Tensor) else (b.dtype, tuple(b.shape))}")
    if tuple(b.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(b.shape)}")
    if b.device != device:
        raise ValueError(f"{name} is on {b.device} but the operands are on {device}")
    if b.stride(1) != 1 or b.stride(0) % ROW_MULTIPLE or b.data_ptr() % 16:
        raise ValueError(f"{name} must have a unit last stride, a row stride a multiple of {ROW_MULTIPLE} and a "
                         f"16-byte aligned start, got strides {b.stride()}")


def aligned(b: torch.Tensor) -> torch.Tensor:
    """``b`` [E, N] as :func:`check_bias` wants it: itself where it already is, else a compact copy (N a multiple
    of :data:`ROW_MULTIPLE`: the layer's H and I are)."""
    if b.stride(-1) == 1 and b.stride(0) % ROW_MULTIPLE == 0 and b.data_ptr() % 16 == 0:
        return b
    return torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b)


@cute.jit
def load_bias(b: cute.Tensor, expert: Int32, col0: Int32, live) -> cute.Tensor:
    """bf16 registers (EPI_N,) of ``b[expert, col0 : col0 + EPI_N]`` (16-byte loads; ``col0`` a multiple of
    EPI_N), zeros where ``live`` is false (the chunk is past the bias's width: nothing is read)."""
    r = cute.make_rmem_tensor((EPI_N,), cutlass.BFloat16)
    r.fill(0.0)
    if live:  # the address as an integer: a pointer that says its 16-byte alignment (the loads' width)
        addr = b.iterator.toint() + (Int64(expert) * Int64(b.stride[0]) + Int64(col0)) * (cutlass.BFloat16.width // 8)
        cute.autovec_copy(cute.make_tensor(gptr(cutlass.BFloat16, addr, 16), cute.make_layout((EPI_N,))), r)
    return r


def _columns(chunks: AccChunks) -> list:
    """The chunk column of each of a thread's registers (as :meth:`AccChunks.load` returns them): thread 0's
    coordinates, known when tracing (every thread's columns are the same, its row its own)."""
    t0 = chunks.copy.get_slice(0).partition_D(cute.make_identity_tensor((EPI_THREADS, EPI_N)))
    cols = [t0[i][1] for i in range(cute.size(t0))]
    assert sorted(cols) == list(range(EPI_N)), cols
    return cols


@cute.jit
def add_bias(chunks: AccChunks, acc: cute.Tensor, bias: cute.Tensor):
    """``acc[i] += fp32(bias[column of i])`` for one chunk's FP32 registers ``acc`` (:meth:`AccChunks.load`)
    and its bias values (:func:`load_bias`)."""
    cols = _columns(chunks)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] + bias[cols[i]].to(Float32)

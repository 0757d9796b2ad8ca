"""Per-expert row sums (CuTe DSL, arch-neutral SIMT: SM90 and SM100), the gradient of expert biases:

    out[e, n] = bf16(fp32 sum over rows p in [offsets[e], offsets[e+1]) of fp32(rows[p, n]))

for e < E, n < N; an expert with no rows gets 0. Each column's sum is a chain of single-rounded fp32 adds in
row order (p ascending), computed by exactly one thread, so the result is bitwise reproducible run to run and
independent of the grid size; the reference (:func:`mok_cute.reference.grouped_row_sums`) sums in fp64, so the
two are compared with a tolerance.

Grid (E, ceil(N / (128 * 8))), 128 threads per CTA: thread ``c`` of expert ``e`` owns the 8 adjacent columns of
16-byte chunk ``c`` and walks the expert's rows with :data:`_UNROLL` 16-byte loads in flight before their adds.
``offsets`` is read only on the device (no host sync, CUDA-graph capturable); the rows walked are clamped to
``[0, M)`` so bad offsets read nothing out of bounds. ``rows`` may be a strided column slice (row stride a
multiple of 8 elements, e.g. ``dgu[:, :I]``): read in place. Dims are runtime ``Int32`` (one compiled kernel
per arch).
"""

import torch

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch, dsl
from mok_cute.dsl.host import MAX_NUMEL, current_stream, dptr, fake_ptr, fake_stream

_THREADS = 128  # per CTA, one 16-byte column chunk each
_VEC = 8  # bf16 columns per 16-byte chunk
_UNROLL = 8  # rows whose loads are in flight before their adds


def _build(arch: str):
    """The kernel and its launch, compiled for ``arch`` with symbolic dims."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415 (the DSL is imported lazily, on first compile)

    cutlass, cute = dsl()
    Int32, Float32 = cutlass.Int32, cutlass.Float32

    @cute.kernel
    def kernel(rows: cute.Tensor, offs: cute.Tensor, out: cute.Tensor, m: Int32, ldc: Int32, nc: Int32):
        tid, _, _ = cute.arch.thread_idx()
        e, by, _ = cute.arch.block_idx()
        c = by * _THREADS + tid
        if c < nc:
            lo = cutlass.min(cutlass.max(offs[e], 0), m)
            hi = cutlass.max(cutlass.min(offs[e + 1], m), lo)
            full = lo + (hi - lo) // _UNROLL * _UNROLL
            acc = cute.make_rmem_tensor((_VEC,), Float32)
            acc.fill(0.0)
            buf = cute.make_rmem_tensor((_VEC, _UNROLL), cutlass.BFloat16)
            for p0 in cutlass.range(lo, full, _UNROLL, unroll=1):
                for u in cutlass.range_constexpr(_UNROLL):  # every load first
                    buf[None, u].store(rows[(p0 + u) * ldc + c, None].load())
                for u in cutlass.range_constexpr(_UNROLL):  # then the adds, in row order
                    acc.store(acc.load() + buf[None, u].load().to(Float32))
            for p in cutlass.range(full, hi, unroll=1):
                acc.store(acc.load() + rows[p * ldc + c, None].load().to(Float32))
            out[e * nc + c, None].store(acc.load().to(cutlass.BFloat16))

    @cute.jit
    def launch(rows_p: cute.Pointer, offs_p: cute.Pointer, out_p: cute.Pointer, m: Int32, e: Int32, ldc: Int32,
               nc: Int32, stream: cuda.CUstream):
        # rows and out as 16-byte chunks (row p's chunk c at p * ldc + c)
        rows = cute.make_tensor(rows_p, cute.make_layout((m * ldc, _VEC), stride=(_VEC, 1)))
        offs = cute.make_tensor(offs_p, cute.make_layout((e + 1,)))
        out = cute.make_tensor(out_p, cute.make_layout((e * nc, _VEC), stride=(_VEC, 1)))
        kernel(rows, offs, out, m, ldc, nc).launch(
            grid=[e, (nc + _THREADS - 1) // _THREADS, 1], block=[_THREADS, 1, 1], stream=stream)

    offs = cute.runtime.make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)  # as dptr(offsets, align=4)
    return compile_kernel(launch, fake_ptr("bf16"), offs, fake_ptr("bf16"), *(Int32(1),) * 4, fake_stream(),
                          arch=arch, inspect=True)


def compiled_row_sums(arch: str):
    """The cached ``(compiled, CompileReport)`` of :func:`expert_row_sums`'s kernel for an arch in
    ``compile.ARCHS``."""
    return compile_cached(("row_sums", arch), lambda: _build(arch))


def _check(rows, offsets, out) -> torch.Tensor | None:
    """TypeError / ValueError naming the argument, before any launch (CPU tensors too)."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bfloat16 or rows.dim() != 2:
        raise TypeError(f"rows must be a 2-D torch.bfloat16 tensor, got "
                        f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1:
        raise TypeError(f"offsets must be a 1-D torch.int32 tensor, got "
                        f"{getattr(offsets, 'dtype', type(offsets).__name__)} {tuple(getattr(offsets, 'shape', ()))}")
    m, n = rows.shape
    if n % _VEC:
        raise ValueError(f"rows: N = {n} columns must be a multiple of {_VEC} (16-byte chunks)")
    if rows.stride(1) != 1 or (m > 1 and (rows.stride(0) % _VEC or rows.stride(0) < n)) or rows.data_ptr() % 16:
        raise ValueError(f"rows must be row-major with unit column stride, a row stride that is a multiple of {_VEC} "
                         f"(>= N) and a 16-byte aligned start, got strides {rows.stride()}")
    if m * max(rows.stride(0), n) > MAX_NUMEL:
        raise ValueError(f"rows must span < 2^31 elements (M * row stride), got {m} * {rows.stride(0)}")
    if offsets.numel() < 2 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be contiguous with E+1 >= 2 entries, got shape {tuple(offsets.shape)}")
    if offsets.device != rows.device:
        raise ValueError(f"offsets must be on rows' device {rows.device}, got {offsets.device}")
    if out is not None:
        shape = (offsets.numel() - 1, n)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
            raise TypeError(f"out must be a torch.bfloat16 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        if tuple(out.shape) != shape or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(f"out must be contiguous, 16-byte aligned, with shape {shape}, got {tuple(out.shape)}")
        if out.device != rows.device:
            raise ValueError(f"out must be on rows' device {rows.device}, got {out.device}")
    return out


def expert_row_sums(rows: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert row sums ``out`` [E, N] bf16 (the module doc): ``out[e] = bf16(fp32 sum of rows[offsets[e]:
    offsets[e+1]])`` summed in row order, bitwise reproducible; 0 for an expert with no rows.

    rows [M, N] bf16, N a multiple of 8, unit column stride, row stride a multiple of 8 (a column slice such as
    ``dgu[:, I:]`` is read in place), 16-byte aligned; offsets int32 [E+1] contiguous, non-decreasing, within
    [0, M] (not checked: that would read them on the host; rows outside [0, M) are never read); ``out`` (optional)
    bf16 [E, N] contiguous, 16-byte aligned; all on one device. CUDA: one launch on the current stream, no host
    sync (graph capturable). CPU tensors: :func:`mok_cute.reference.grouped_row_sums` (fp64 sum rounded to fp32
    then bf16). Raises TypeError / ValueError naming the argument before any launch."""
    out = _check(rows, offsets, out)
    (m, n), e = rows.shape, offsets.numel() - 1
    if not rows.is_cuda:
        from mok_cute import reference  # noqa: PLC0415

        want = reference.grouped_row_sums(rows, offsets)
        return want if out is None else out.copy_(want)
    if out is None:
        out = torch.empty((e, n), dtype=torch.bfloat16, device=rows.device)
    if m == 0:
        return out.zero_()
    if n:
        dev, arch = device_arch(rows.device)
        fn, _ = compiled_row_sums(arch)
        ldc = (rows.stride(0) if m > 1 else n) // _VEC
        with torch.cuda.device(dev):
            fn(dptr(rows), dptr(offsets, align=4), dptr(out), m, e, ldc, n // _VEC, current_stream(dev))
    return out

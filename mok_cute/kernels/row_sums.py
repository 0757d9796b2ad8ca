"""Per-expert row sums (CuTe DSL, arch-neutral SIMT: SM90 and SM100), the gradient of expert biases:

    out[e, n] = bf16(fp32 sum over rows p in [offsets[e], offsets[e+1]) of fp32(rows[p, n]))

for e < E, n < N; an expert with no rows gets 0. The fp32 summation order is fixed by the expert's rows alone
(not by the grid, the scheduling or the device): with ``lo = offsets[e]``, stripe ``w`` (of :data:`_WARPS`) is the
chain of single-rounded fp32 adds, from 0 in row order, of rows ``lo + w, lo + w + 8, lo + w + 16, ...``, and the
column's sum is ``((s_0 + s_1) + s_2) + ... + s_7``, rounded once to bf16. So the result is bitwise reproducible run
to run and independent of the grid size; the reference (:func:`mok_cute.reference.grouped_row_sums`) sums in fp64,
so the two are compared with a tolerance.

Grid (E, ceil(N / 256)), 256 threads (:data:`_WARPS` warps) per CTA: the CTA owns expert ``e`` and a 256-column
block (32 lanes x one 16-byte chunk of 8 bf16 columns); warp ``w`` sums stripe ``w`` of the expert's rows (each
row's 512 bytes of the block in one coalesced warp load), a round of :data:`_UNROLL` 16-byte loads per lane in
flight at once (software pipelined: issued at the end of the previous round's iteration, before the back edge,
so ptxas cannot interleave them with the adds; 64 registers, 4 CTAs per SM, 128 KiB of loads in flight per SM);
the 8 stripes' fp32 partials meet in shared memory and warp 0 adds them in stripe order and stores the bf16
chunk. A whole expert is one CTA per column block: with few experts of many rows (E * ceil(N/256)
well under the SM count) the kernel is latency bound, not bandwidth bound (no split of an expert's rows across
CTAs). ``offsets`` is read only on the device (no host sync, CUDA-graph capturable); the rows walked are clamped
to ``[0, M)`` so bad offsets read nothing out of bounds. ``rows`` may be a strided column slice (row stride a
multiple of 8 elements, e.g. ``dgu[:, :I]``): read in place. Dims are runtime ``Int32`` (one compiled kernel
per arch).
"""

import torch

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch, dsl
from mok_cute.dsl.host import MAX_NUMEL, current_stream, dptr, fake_ptr, fake_stream

_WARPS = 8  # per CTA: the expert's rows in _WARPS interleaved stripes, one per warp
_LANES = 32  # 16-byte column chunks per CTA (one per lane)
_VEC = 8  # bf16 columns per 16-byte chunk
_UNROLL = 8  # rows of a warp's stripe whose loads are in flight before their adds


def _build(arch: str):
    """The kernel and its launch, compiled for ``arch`` with symbolic dims."""
    import cuda.bindings.driver as cuda  # noqa: PLC0415 (the DSL is imported lazily, on first compile)

    cutlass, cute = dsl()
    Int32, Float32 = cutlass.Int32, cutlass.Float32
    step = _WARPS * _UNROLL  # rows per unrolled round of the CTA

    @cute.jit
    def _load_round(rows: cute.Tensor, buf: cute.Tensor, p0: Int32, hi: Int32, ldc: Int32, c: Int32):
        """buf[:, u] = rows p0 + 8u (zeros past hi: adding +0.0 to a sum that starts at +0.0 changes no bit)."""
        for u in cutlass.range_constexpr(_UNROLL):
            buf[None, u].fill(0.0)
            if p0 + u * _WARPS < hi:
                buf[None, u].store(rows[(p0 + u * _WARPS) * ldc + c, None].load())

    @cute.jit
    def _add_round(acc: cute.Tensor, buf: cute.Tensor):
        for u in cutlass.range_constexpr(_UNROLL):  # in the stripe's row order
            acc.store(acc.load() + buf[None, u].load().to(Float32))

    @cute.kernel
    def kernel(rows: cute.Tensor, offs: cute.Tensor, out: cute.Tensor, m: Int32, ldc: Int32, nc: Int32):
        tid, _, _ = cute.arch.thread_idx()
        e, by, _ = cute.arch.block_idx()
        warp, lane = tid // _LANES, tid % _LANES
        c = by * _LANES + lane
        part = cutlass.memory.SmemAllocator().allocate_tensor(  # the stripes' partials (stripe, lane, column)
            Float32, cute.make_layout((_WARPS, _LANES, _VEC), stride=(_LANES * _VEC, _VEC, 1)), byte_alignment=16)
        acc = cute.make_rmem_tensor((_VEC,), Float32)
        acc.fill(0.0)
        if c < nc:
            lo = cutlass.min(cutlass.max(offs[e], 0), m)
            hi = cutlass.max(cutlass.min(offs[e + 1], m), lo)
            buf = cute.make_rmem_tensor((_VEC, _UNROLL), cutlass.BFloat16)
            _load_round(rows, buf, lo + warp, hi, ldc, c)
            # software pipelined: a round's loads are issued at the end of the previous iteration, across the loop's
            # back edge (else ptxas interleaves them with the adds, 2 loads in flight), then added in row order
            for p0 in cutlass.range(lo + step, hi, step, unroll=1):
                _add_round(acc, buf)
                _load_round(rows, buf, p0 + warp, hi, ldc, c)
            _add_round(acc, buf)
        if warp > 0:
            part[warp, lane, None].store(acc.load())
        cute.arch.barrier()
        if warp == 0:
            if c < nc:
                for w in cutlass.range_constexpr(1, _WARPS):  # the stripes in order (stripe 0's sum is acc)
                    acc.store(acc.load() + part[w, lane, None].load())
                out[e * nc + c, None].store(acc.load().to(cutlass.BFloat16))

    @cute.jit
    def launch(rows_p: cute.Pointer, offs_p: cute.Pointer, out_p: cute.Pointer, m: Int32, e: Int32, ldc: Int32,
               nc: Int32, stream: cuda.CUstream):
        # rows and out as 16-byte chunks (row p's chunk c at p * ldc + c)
        rows = cute.make_tensor(rows_p, cute.make_layout((m * ldc, _VEC), stride=(_VEC, 1)))
        offs = cute.make_tensor(offs_p, cute.make_layout((e + 1,)))
        out = cute.make_tensor(out_p, cute.make_layout((e * nc, _VEC), stride=(_VEC, 1)))
        kernel(rows, offs, out, m, ldc, nc).launch(
            grid=[e, (nc + _LANES - 1) // _LANES, 1], block=[_WARPS * _LANES, 1, 1], stream=stream)

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
    offsets[e+1]])`` in a fixed fp32 order (8 interleaved row stripes, each in row order, then added in stripe
    order: the module doc), bitwise reproducible; 0 for an expert with no rows.

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

"""MXFP8 quantize kernels (CuTe DSL): bf16/fp32 [M, N] -> e4m3 data + E8M0 scales.

Contract (bitwise equal to :func:`mok_cute.reference.mxfp8_quantize`): blocks of 32
consecutive elements along ``dim``; amax is taken on the |x| bit patterns (subnormals kept);
scale byte = max(E - 8 + [mantissa > 0x600000], 0) from amax's fp32 exponent E; data =
e4m3(x * 2^(127 - byte)) with ``mul.rn.f32`` (no FTZ) and ``cvt.rn.satfinite.e4m3x2.f32``.
A block holding NaN or Inf gets scale 0xFF and data 0x7F.

Kernels work on 32-bit words: a 16-byte *chunk* holds C = 8 bf16 (or 4 fp32) elements of
one row; its output is C e4m3 bytes (OW = C / 4 words).

- ``row`` (dim=-1): lane-contiguous chunks, so each warp load is 512 coalesced bytes; the
  L = 32 / C lanes holding one block combine their amax with butterfly shuffles. Each
  thread owns ``_ROW_UNROLL`` chunks (loads issued before any math).
- ``row_pitched``: ``row`` writing row r's data at byte r * P of its output and its scales at byte
  r * P of a second pointer (the MXFP8 token rows a fused forward moves: data then scales in one
  row of P bytes), the same kernel body over hierarchical (chunk, row) output layouts.
- ``row_pitched_rt`` (bf16 input): ``row_pitched`` also writing each chunk's MXFP8 round trip (the data
  dequantized back to bf16, bitwise ``dequant_mxfp8.mxfp8_round_trip``) into a bf16 [M, N] output: the
  MXFP8 forward's token rows and its shared expert's GEMM1 operand from one read of x.
- ``col`` (dim=0): one thread per (32-row group, chunk column): 32 loads of 16 bytes down
  the column (consecutive lanes take consecutive chunks, so every load is coalesced along N),
  C per-column amaxes and scales, 32 stores of C bytes, one C-byte scale store.

Dims are runtime ``Int32`` arguments: one compiled kernel per (kind, arch, dtype) serves
every shape; the wrapper requires numel < 2^31.
"""

import torch

from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel, dsl
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.dsl.host import FLOAT_INPUTS, check_float_input, check_rows16, current_stream

KINDS = ("row", "row_pitched", "row_pitched_rt", "col")
DTYPES = FLOAT_INPUTS
_ROW_THREADS = 256
_ROW_UNROLL = 4
_COL_THREADS = 128


def _dims(x: torch.Tensor, dim: int) -> int:
    """Validate ``x``/``dim`` (no CUDA calls); return dim normalised to 0 or 1."""
    check_float_input(x, "x")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if dim not in (-2, -1, 0, 1):
        raise ValueError(f"dim must be -1/1 (row-wise) or 0/-2 (column-wise), got {dim}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, N], got shape {tuple(x.shape)}")
    dim %= 2
    if x.shape[dim] % 32:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be a multiple of 32 (the MX block)")
    check_rows16(x, "x")
    if x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    return dim


def _build(kind: str, dtype: torch.dtype, arch: str):
    """Trace and compile one kernel; returns ``(compiled, CompileReport)``."""
    cutlass, cute = dsl()
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    Int32, Uint32, Uint8 = cutlass.Int32, cutlass.Uint32, cutlass.Uint8
    bf16 = dtype == torch.bfloat16
    C = 8 if bf16 else 4  # elements per 16-byte chunk
    OW = C // 4  # output words per chunk
    L = 32 // C  # lanes (chunks) per row-wise block

    ops = Fp8Ops(bf16)
    with_rt = kind == "row_pitched_rt"

    def scale_of(a):
        """amax |x| bits (bf16 or fp32 pattern) -> (2^-e fp32 bits, scale byte, nonfinite mask)."""
        return ops.e8m0(Int32(a) << 16 if bf16 else Int32(a))

    if kind in ("row", "row_pitched", "row_pitched_rt"):
        @cute.kernel
        def row_kernel(x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, n: Int32, rt: cute.Tensor):
            lane, base, vs = ops.row_loads(x, n, _ROW_THREADS, _ROW_UNROLL)
            for u in cutlass.range_constexpr(_ROW_UNROLL):
                o, byte = ops.mx_block(vs[u], L)
                i = base + u * 32
                if i < n:
                    q[i, None].store(o.load())
                    if lane % L == 0:
                        s[i // L] = Uint8(byte)
                    if cutlass.const_expr(rt is not None):  # the round trip: ops.mx_round_trip's dequantize
                        back = cute.make_rmem_tensor((4,), Uint32)
                        ops.deq_bf16([o[0], o[1]], [ops.scale_bits(byte)] * 8, back)
                        rt[i, None].store(back.load())

        @cute.jit
        def launch(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, n_chunks: Int32,
                   stream: cuda.CUstream):
            x = cute.make_tensor(xp, cute.make_layout((n_chunks, 4), stride=(4, 1)))
            q = cute.make_tensor(qp, cute.make_layout((n_chunks, OW), stride=(OW, 1)))
            s = cute.make_tensor(sp, cute.make_layout((n_chunks // L,)))
            per_cta = _ROW_THREADS * _ROW_UNROLL
            row_kernel(x, q, s, n_chunks, None).launch(
                grid=[(n_chunks + per_cta - 1) // per_cta, 1, 1], block=[_ROW_THREADS, 1, 1],
                stream=stream)

        @cute.jit
        def launch_pitched(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, rtp: cute.Pointer, rows: Int32,
                           cpr: Int32, pitch: Int32, stream: cuda.CUstream):
            # chunk i = c + cpr * r: its data at word c * OW + r * pitch / 4, its block's scale at byte
            # (c / L) + r * pitch (pitch % 16 == 0, cpr % L == 0); row_pitched_rt: its round trip at chunk i of rtp
            x = cute.make_tensor(xp, cute.make_layout((rows * cpr, 4), stride=(4, 1)))
            rt = cute.make_tensor(rtp, cute.make_layout((rows * cpr, 4), stride=(4, 1))) if with_rt else None
            q = cute.make_tensor(qp, cute.make_layout(((cpr, rows), OW),
                                                      stride=((OW, cute.assume(pitch // 4, divby=4)), 1)))
            s = cute.make_tensor(sp, cute.make_layout(((cpr // L, rows),),
                                                      stride=((1, cute.assume(pitch, divby=16)),)))
            per_cta = _ROW_THREADS * _ROW_UNROLL
            row_kernel(x, q, s, rows * cpr, rt).launch(
                grid=[(rows * cpr + per_cta - 1) // per_cta, 1, 1], block=[_ROW_THREADS, 1, 1],
                stream=stream)
    else:
        @cute.kernel
        def col_kernel(x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, items: Int32, nc: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            t = bid * _COL_THREADS + tid
            tc = cutlass.min(t, items - 1)  # out-of-range threads reload the last item
            g = tc // nc
            c = tc - g * nc
            row0 = g * 32 * nc + c
            xs = cute.make_tensor(x[row0, None].iterator, cute.make_layout(
                (32, 4), stride=(cute.assume(nc * 4, divby=4), 1)))
            qs = cute.make_tensor(q[row0, None].iterator, cute.make_layout(
                (32, OW), stride=(cute.assume(nc * OW, divby=OW), 1)))
            vs = [xs[r, None].load() for r in range(32)]  # unrolled at trace time
            accs = ops.column_amax(vs)
            amaxes = []
            for j in cutlass.range_constexpr(4):
                amaxes += [accs[j] & Uint32(0xFFFF), accs[j] >> 16] if bf16 else [accs[j]]
            cols = [scale_of(a) for a in amaxes]  # C x (scale bits, byte, nonfinite)
            sw = cute.make_rmem_tensor((OW,), Uint32)
            masks = []
            for w in cutlass.range_constexpr(OW):
                word = Uint32(0)
                mask = Uint32(0)
                for k in cutlass.range_constexpr(4):
                    word = word | (cols[4 * w + k][1] << (8 * k))
                    mask = mask | (cols[4 * w + k][2] & Uint32(0xFF << (8 * k)))
                sw[w] = word
                masks.append(mask)
            if t < items:
                for r in cutlass.range_constexpr(32):
                    o = ops.fp8_words(ops.elems(vs[r]), [col[0] for col in cols], masks)
                    qs[r, None].store(o.load())
                s[tc, None].store(sw.load())

        @cute.jit
        def launch(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, m: Int32, nc: Int32,
                   stream: cuda.CUstream):
            # Chunk-indexed views (static inner strides keep the 16-byte vector accesses).
            items = (m // 32) * nc
            x = cute.make_tensor(xp, cute.make_layout((m * nc, 4), stride=(4, 1)))
            q = cute.make_tensor(qp, cute.make_layout((m * nc, OW), stride=(OW, 1)))
            s = cute.make_tensor(sp, cute.make_layout((items, OW), stride=(OW, 1)))
            col_kernel(x, q, s, items, nc).launch(
                grid=[(items + _COL_THREADS - 1) // _COL_THREADS, 1, 1],
                block=[_COL_THREADS, 1, 1], stream=stream)

    pitched = (_rt_pointer(0),) if kind.startswith("row_pitched") else ()
    dims = {"row": (Int32(1),), "col": (Int32(32), Int32(1))}.get(kind, (Int32(1), Int32(4), Int32(16)))
    return compile_kernel(launch_pitched if pitched else launch, *_pointers(kind, dtype, 0, 0, 0), *pitched,
                          *dims, cuda.CUstream(0), arch=arch, inspect=True)


def _rt_pointer(rt: int):
    """The pitched kinds' round-trip output pointer (bf16 chunks as 32-bit words; unread by ``row_pitched``)."""
    cutlass, cute = dsl()
    return cute.runtime.make_ptr(cutlass.Uint32, rt, cute.AddressSpace.gmem, assumed_align=16)


def _pointers(kind: str, dtype: torch.dtype, x: int, data: int, scales: int):
    """Kernel pointer arguments: x, data and col scales as 32-bit words, row scales as bytes.

    Raw int addresses must not be passed to the compiled function: 4.8.1 converts them to
    Int32 when the kernel was compiled with ``Pointer`` objects."""
    cutlass, cute = dsl()
    gmem, make_ptr = cute.AddressSpace.gmem, cute.runtime.make_ptr
    out_align = 2 if dtype == torch.bfloat16 else 1  # C / 4 words per chunk
    return (make_ptr(cutlass.Uint32, x, gmem, assumed_align=16),
            make_ptr(cutlass.Uint32, data, gmem, assumed_align=4 * out_align),
            make_ptr(cutlass.Uint8, scales, gmem, assumed_align=1) if kind != "col"
            else make_ptr(cutlass.Uint32, scales, gmem, assumed_align=4 * out_align))


def compiled_quantize(kind: str, arch: str, dtype: torch.dtype = torch.bfloat16):
    """The cached ``(compiled, CompileReport)`` for ``kind`` in KINDS, an arch in
    ``compile.ARCHS`` and an input dtype in DTYPES (compiled on first request)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if dtype not in DTYPES or (kind == "row_pitched_rt" and dtype != torch.bfloat16):
        raise TypeError(f"dtype must be torch.bfloat16{'' if kind == 'row_pitched_rt' else ' or torch.float32'}, "
                        f"got {dtype}")
    return compile_cached(("mxfp8_quantize", kind, arch, dtype), lambda: _build(kind, dtype, arch))


def quantize_mxfp8(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize a contiguous CUDA bf16/fp32 [M, N] tensor along ``dim`` on the current stream.

    Requires size(dim) % 32 == 0, N * x.element_size() % 16 == 0, numel < 2^31 and a
    16-byte aligned data pointer. Returns ``(data, scales)``: data float8_e4m3fn [M, N]
    (row-major); scales uint8 E8M0, [M, N/32] for dim=-1/1 or [M/32, N] for dim=0/-2,
    contiguous. Bitwise equal to ``mok_cute.reference.mxfp8_quantize(x, dim)``.
    """
    d = _dims(x, dim)
    M, N = x.shape
    data = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((M, N // 32) if d == 1 else (M // 32, N), dtype=torch.uint8,
                         device=x.device)
    if x.numel() == 0:
        return data, scales
    kind = "row" if d == 1 else "col"
    fn, _ = compiled_quantize(kind, arch_of_device(x.device), x.dtype)
    stream = current_stream(x.device)
    chunks_per_row = N * x.element_size() // 16
    dims = (M * chunks_per_row,) if kind == "row" else (M, chunks_per_row)
    ptrs = _pointers(kind, x.dtype, x.data_ptr(), data.data_ptr(), scales.data_ptr())
    with torch.cuda.device(x.device):
        fn(*ptrs, *dims, stream)
    return data, scales


def quantize_mxfp8_rows_into(x: torch.Tensor, out: torch.Tensor, rt: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP8-quantize a contiguous CUDA bf16/fp32 [M, N] tensor along its rows into ``out`` uint8 [M, P]
    (contiguous, P % 16 == 0, P >= N + N/32; 16-byte aligned): row r's e4m3 data in ``out[r, :N]``, its E8M0
    scales in ``out[r, N:N + N/32]`` (the rest of the row untouched), bitwise :func:`quantize_mxfp8` (x, -1)'s, in
    one pass on the current stream (no separate data and scale buffers). ``rt`` (bf16 x only): a contiguous bf16
    [M, N] tensor that also gets x's MXFP8 round trip along the rows, bitwise ``mxfp8_round_trip(x)``, in the same
    pass. Returns ``out``."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 2:
        raise TypeError("out must be a 2-D torch.uint8 tensor [M, P]")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % 32 == 0:  # x's own checks follow (_dims)
        m, n = x.shape
        p = out.shape[1]
        if out.shape[0] != m or p % 16 or p < n + n // 32 or out.data_ptr() % 16:
            raise ValueError(f"out must be [M = {m}, P] with P % 16 == 0 and P >= N + N/32 = {n + n // 32}, "
                             f"16-byte aligned; got {tuple(out.shape)}")
    if rt is not None:
        if not isinstance(rt, torch.Tensor) or rt.dtype != torch.bfloat16 or not isinstance(x, torch.Tensor) \
                or x.dtype != torch.bfloat16:
            raise TypeError("rt (the round trip) must be a torch.bfloat16 tensor, and x bf16 with it")
        if rt.shape != x.shape or not rt.is_contiguous() or rt.data_ptr() % 16:
            raise ValueError(f"rt must be a contiguous 16-byte aligned [M, N] = {tuple(x.shape)} tensor, got "
                             f"{tuple(rt.shape)}")
    _dims(x, -1)
    m, n = x.shape
    for name, t in (("out", out), ("rt", rt)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if out.numel() >= 2 ** 31:
        raise ValueError("out must hold < 2^31 bytes")
    if x.numel():
        kind = "row_pitched" if rt is None else "row_pitched_rt"
        fn, _ = compiled_quantize(kind, arch_of_device(x.device), x.dtype)
        cpr = n * x.element_size() // 16
        ptrs = _pointers(kind, x.dtype, x.data_ptr(), out.data_ptr(), out.data_ptr() + n)
        with torch.cuda.device(x.device):
            fn(*ptrs, _rt_pointer((x if rt is None else rt).data_ptr()), m, cpr, p, current_stream(x.device))
    return out

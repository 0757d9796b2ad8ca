"""MXFP8 -> BF16 dequantize kernels (CuTe DSL), for GEMMs on chips without block-scaled MMA (SM90).

Value of element x with scale byte s: e4m3(x) * 2^(s - 127) (s = 0xFF: NaN), i.e.
``reference.mxfp8_dequantize``; the output is its bf16 rounding (``cvt.rn.bf16x2.f32``, round
to nearest even, no FTZ), so it equals ``reference.mxfp8_dequantize(...).bfloat16()`` bitwise
(NaNs as NaN; payloads may differ). Exactness: e4m3 has 4 significant bits, so the product is
exact in fp32 and in bf16 unless it falls below bf16's subnormal step 2^-133: every element is
exact iff its scale byte is >= 3 (e4m3's smallest subnormal is 2^-9). An fp32 product that
overflows (byte 247 with |x| = 256 needs 2^128) is +-inf in both.

A round trip (quantize, then dequantize) of a BF16 input is always exact in bf16: for a scale
byte s < 3, x is a multiple of 2^-133 (bf16's subnormal step), so y = x * 2^(127 - s) is a
multiple of 2^(-6 - s) >= the e4m3 spacing wherever y is not on the e4m3 grid; e4m3(y) is
then y itself or a multiple of a spacing >= 2^(-6 - s), and e4m3(y) * 2^(s - 127) a multiple
of 2^-133 (the GPU check confirms it on edge inputs). Only dequantizing arbitrary data /
scale pairs (e.g. fp32-sourced or received MXFP8) can round.

Inexact count: with ``counter`` (int32 [1] on the device) each launch atomically adds the
number of finite elements whose fp32 value is not representable in bf16 (low 16 bits of the
fp32 product nonzero); no host sync. Zero for every scale byte >= 3, so nonzero means a
block with a scale near 2^-127 (values ~1e-38) was rounded.

Layouts (inputs are the outputs of :mod:`mok_cute.kernels.quant.quantize` / ``quantize_fp8``):

* ``row``    data [R, C], scales [R, C/32] (``quantize_mxfp8(x, -1)``): per 16-byte chunk (16
  elements, half a block) one 16-byte load, one scale byte, two 16-byte stores; a thread
  takes ``_UNROLL`` lane-contiguous chunks (all loads issued first).
* ``col``    data [R, C], scales [R/32, C] (``quantize_mxfp8(x, 0)``): as ``row``; a chunk's 16
  per-column scales are one 16-byte load.
* ``tokens`` data_t [N, 32 S], scales [S, N] (``quantize_tokens(x, offsets, "mxfp8")``: token
  offsets[e] + t of expert e in column 32 (offsets[e] // 32 + e) + t) -> token rows [M, N]
  (row r = token r; rows at or past offsets[E] are 0). One thread per (32-token slot, 8
  features): 16 loads of 16 bytes (32 tokens of each feature), one 8-byte scale load, a byte
  transpose in registers (``prmt``), 32 stores of 16 bytes (8 features of each token); a slot
  finds its expert by binary search on offsets. Threads past the slots zero the rows at or
  past offsets[E] (32-row groups).

Round trips (bf16 in, bf16 out, one pass: quantize with the ops of :mod:`quantize` /
``quantize_fp8`` (:class:`Fp8Ops`), then dequantize as above; what a BF16 GEMM reads for an
MXFP8 operand):

* ``rt_row``    x [M, K] along rows: per 16-byte chunk (8 elements) one load, the 4 lanes of a
  block combine amaxes by shuffles, one 16-byte store; ``_UNROLL`` chunks per thread.
* ``rt_tokens`` x [M, N] token rows along tokens per expert (blocks of 32 from each expert's
  first row) -> token rows [M, N] (0 past offsets[E]): one thread per (32-row block, 8
  features): 32 loads and stores of 16 bytes, per-column amax in registers. Counting variant:
  a block with a scale byte < 3 is recounted from reloaded rows (rare path).

Dims are runtime ``Int32``: one compiled kernel per (layout, arch, counting) serves every shape.
"""

import torch

from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel, dsl
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.dsl.host import MAX_NUMEL, _check_devices, current_stream

LAYOUTS = ("row", "col", "tokens", "rt_row", "rt_tokens")
_THREADS = 256
_UNROLL = 4  # row / col: 16-byte chunks per thread
_TOK_THREADS = 128
_FP8 = torch.float8_e4m3fn


def _build(layout: str, count: bool, arch: str):
    """Trace and compile one kernel; returns ``(compiled, CompileReport)``."""
    cutlass, cute = dsl()
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    Int32, Uint32 = cutlass.Int32, cutlass.Uint32

    ops = Fp8Ops(bf16=True)
    scale_bits = ops.scale_bits

    def prmt(a, b, sel: int):
        return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {sel:#x};",
                                    write_only_types=[Uint32], read_only_args=[a, b])

    def inexact(ps):
        """Number of finite products in ``ps`` that bf16 cannot hold (low 16 bits nonzero)."""
        n = Int32(0)
        for p in ps:
            n = n + Int32(((p & Uint32(0xFFFF)) != Uint32(0)) & ((p & Uint32(0x7FFFFFFF)) < Uint32(0x7F800000)))
        return n

    def convert(words, scales, o, cnt):
        """Dequantize e4m3 ``words`` (4 bytes each) with per-element multipliers ``scales``
        into bf16x2 words of the register tensor ``o``; returns the updated inexact count."""
        total = [cnt]

        def each(ps):
            total[0] = total[0] + inexact(ps)
        ops.deq_bf16(words, scales, o, each if count else None)
        return total[0]

    @cute.jit
    def slot_rows(offs: cute.Tensor, slot: Int32, num_e: Int32):
        """(first row, valid rows 0..32) of 32-token slot ``slot`` of the token-wise layout:
        its expert is the largest e in [0, E] with offs[e] // 32 + e <= slot (binary search)."""
        lo = Int32(0)
        hi = num_e
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if offs[mid] // 32 + mid <= slot:
                lo = mid
            else:
                hi = mid - 1
        g_lo = offs[lo]
        g_hi = offs[cutlass.min(lo + 1, num_e)]
        row0 = g_lo + (slot - (g_lo // 32 + lo)) * 32
        rows = cutlass.max(cutlass.min(g_hi - row0, 32), 0)
        if lo >= num_e:
            rows = Int32(0)
        return row0, rows

    @cute.jit
    def flush_count(cnt: Int32, counter: cute.Tensor):
        """Add this thread's count of inexact conversions to ``counter`` (count variants only;
        one atomic per thread that saw any)."""
        if cutlass.const_expr(count):
            if cnt > Int32(0):
                cute.arch.atomic_add(counter.iterator, cnt)

    @cute.jit
    def zero_tail(out: cute.Tensor, offs: cute.Tensor, z: Int32, nc: Int32, m: Int32, num_e: Int32):
        """Zero chunk column z % nc of the rows at or past offs[E] in 32-row group z // nc."""
        g = z // nc
        c = z - g * nc
        end = offs[num_e]
        zero = cute.make_rmem_tensor((4,), Uint32)
        zero.fill(0)
        for r in cutlass.range_constexpr(32):
            row = g * 32 + r
            if (row >= end) & (row < m):
                out[row, c, None].store(zero.load())

    def tok_launch(kernel, dp, op, offp, cp, m, nc, num_e, stream, sp=None):
        """Grid of the token-wise kernels: one thread per (slot, chunk), then per (32-row group,
        chunk) for the tail zeroing."""
        slots = m // 32 + num_e
        out = cute.make_tensor(op, cute.make_layout((m, nc, 4), stride=(cute.assume(nc * 4, divby=4), 4, 1)))
        offs = cute.make_tensor(offp, cute.make_layout((num_e + 1,)))
        counter = cute.make_tensor(cp, cute.make_layout((1,)))
        slot_items = slots * nc
        items = slot_items + ((m + 31) // 32) * nc
        if cutlass.const_expr(sp is None):  # round trip: x token rows [m, nc, 4] words
            src = (cute.make_tensor(dp, cute.make_layout((m, nc, 4), stride=(cute.assume(nc * 4, divby=4), 4, 1))),)
        else:  # dequantize: data_t (feature, slot, 8 words), scales (slot, chunk, 2 words)
            src = (cute.make_tensor(dp, cute.make_layout((nc * 8, slots, 8),
                                                         stride=(cute.assume(slots * 8, divby=8), 8, 1))),
                   cute.make_tensor(sp, cute.make_layout((slots, nc, 2), stride=(cute.assume(nc * 2, divby=2), 2, 1))))
        kernel(*src, out, offs, counter, m, nc, num_e, slot_items, items).launch(
            grid=[(items + _TOK_THREADS - 1) // _TOK_THREADS, 1, 1], block=[_TOK_THREADS, 1, 1], stream=stream)

    if layout in ("row", "col"):
        @cute.kernel
        def chunk_kernel(d: cute.Tensor, s: cute.Tensor, out: cute.Tensor, counter: cute.Tensor, n: Int32,
                         nc: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            lane = tid % 32
            base = (bid * _THREADS + tid - lane) * _UNROLL + lane  # chunks base + 32 u: lane-contiguous
            vs, ss = [], []
            for u in cutlass.range_constexpr(_UNROLL):  # every load issued before any math
                ic = cutlass.min(base + 32 * u, n - 1)
                vs.append(d[ic, None].load())
                if cutlass.const_expr(layout == "row"):
                    ss.append(s[ic // 2])
                else:
                    r = ic // nc
                    ss.append(s[(r // 32) * nc + (ic - r * nc), None].load())
            cnt = Int32(0)
            for u in cutlass.range_constexpr(_UNROLL):
                i = base + 32 * u
                words = [vs[u][j] for j in range(4)]
                if cutlass.const_expr(layout == "row"):
                    mult = [scale_bits(ss[u])] * 16
                else:
                    mult = [scale_bits((ss[u][j // 4] >> (8 * (j % 4))) & Uint32(0xFF)) for j in range(16)]
                o = cute.make_rmem_tensor((8,), Uint32)
                c = convert(words, mult, o, Int32(0))
                if cutlass.const_expr(count):
                    cnt = cnt + Int32(i < n) * c
                if i < n:
                    out[i, None].store(o.load())
            flush_count(cnt, counter)

        @cute.jit
        def launch(dp: cute.Pointer, sp: cute.Pointer, op: cute.Pointer, cp: cute.Pointer, n: Int32, nc: Int32,
                   stream: cuda.CUstream):
            d = cute.make_tensor(dp, cute.make_layout((n, 4), stride=(4, 1)))
            if cutlass.const_expr(layout == "row"):
                s = cute.make_tensor(sp, cute.make_layout((n // 2,)))
            else:
                s = cute.make_tensor(sp, cute.make_layout((n // 32, 4), stride=(4, 1)))
            out = cute.make_tensor(op, cute.make_layout((n, 8), stride=(8, 1)))
            counter = cute.make_tensor(cp, cute.make_layout((1,)))
            chunk_kernel(d, s, out, counter, n, nc).launch(
                grid=[(n + _THREADS * _UNROLL - 1) // (_THREADS * _UNROLL), 1, 1], block=[_THREADS, 1, 1],
                stream=stream)

        args = (Int32(2), Int32(2))
    elif layout == "tokens":
        @cute.kernel
        def tok_kernel(d: cute.Tensor, s: cute.Tensor, out: cute.Tensor, offs: cute.Tensor, counter: cute.Tensor,
                       m: Int32, nc: Int32, num_e: Int32, slot_items: Int32, items: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            t = bid * _TOK_THREADS + tid
            if t < slot_items:
                slot = t // nc
                c = t - slot * nc
                row0, rows = slot_rows(offs, slot, num_e)
                if rows > 0:
                    feats = [d[c * 8 + f, slot, None].load() for f in range(8)]  # 8 words = 32 tokens each
                    sw = s[slot, c, None].load()
                    mult = [scale_bits((sw[f // 4] >> (8 * (f % 4))) & Uint32(0xFF)) for f in range(8)]
                    cnt = Int32(0)
                    for tok in cutlass.range_constexpr(32):
                        wi, b = tok // 4, tok % 4
                        sel = b | ((4 + b) << 4)  # byte b of the first operand, then byte b of the second
                        lo01 = prmt(feats[0][wi], feats[1][wi], sel)
                        lo23 = prmt(feats[2][wi], feats[3][wi], sel)
                        hi01 = prmt(feats[4][wi], feats[5][wi], sel)
                        hi23 = prmt(feats[6][wi], feats[7][wi], sel)
                        words = [prmt(lo01, lo23, 0x5410), prmt(hi01, hi23, 0x5410)]
                        o = cute.make_rmem_tensor((4,), Uint32)
                        total = [cnt]

                        def each(ps, tok=tok):
                            total[0] = total[0] + Int32(tok < rows) * inexact(ps)
                        ops.deq_bf16(words, mult, o, each if count else None)
                        cnt = total[0]
                        if tok < rows:
                            out[row0 + tok, c, None].store(o.load())
                    flush_count(cnt, counter)
            elif t < items:
                zero_tail(out, offs, t - slot_items, nc, m, num_e)

        @cute.jit
        def launch(dp: cute.Pointer, sp: cute.Pointer, op: cute.Pointer, offp: cute.Pointer, cp: cute.Pointer,
                   m: Int32, nc: Int32, num_e: Int32, stream: cuda.CUstream):
            tok_launch(tok_kernel, dp, op, offp, cp, m, nc, num_e, stream, sp)

        args = (Int32(32), Int32(1), Int32(1))
    elif layout == "rt_row":
        @cute.kernel
        def rt_row_kernel(x: cute.Tensor, out: cute.Tensor, counter: cute.Tensor, n: Int32):
            # chunk = 8 bf16 (16 bytes); the 4 lanes of a 32-element block combine their amax
            lane, base, vs = ops.row_loads(x, n, _THREADS, _UNROLL)
            cnt = Int32(0)
            for u in cutlass.range_constexpr(_UNROLL):
                q, byte = ops.mx_block(vs[u], 4)
                o = cute.make_rmem_tensor((4,), Uint32)
                c = convert([q[0], q[1]], [scale_bits(byte)] * 8, o, Int32(0))
                i = base + u * 32
                if cutlass.const_expr(count):
                    cnt = cnt + Int32(i < n) * c
                if i < n:
                    out[i, None].store(o.load())
            flush_count(cnt, counter)

        @cute.jit
        def launch(xp: cute.Pointer, op: cute.Pointer, cp: cute.Pointer, n: Int32, stream: cuda.CUstream):
            x = cute.make_tensor(xp, cute.make_layout((n, 4), stride=(4, 1)))
            out = cute.make_tensor(op, cute.make_layout((n, 4), stride=(4, 1)))
            counter = cute.make_tensor(cp, cute.make_layout((1,)))
            rt_row_kernel(x, out, counter, n).launch(
                grid=[(n + _THREADS * _UNROLL - 1) // (_THREADS * _UNROLL), 1, 1], block=[_THREADS, 1, 1],
                stream=stream)

        args = (Int32(4),)
    else:
        @cute.kernel
        def rt_tok_kernel(x: cute.Tensor, out: cute.Tensor, offs: cute.Tensor, counter: cute.Tensor, m: Int32,
                          nc: Int32, num_e: Int32, slot_items: Int32, items: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            t = bid * _TOK_THREADS + tid
            if t < slot_items:
                slot = t // nc
                c = t - slot * nc
                row0, rows = slot_rows(offs, slot, num_e)
                if rows > 0:
                    vs = []
                    for r in cutlass.range_constexpr(32):  # rows past the block read a valid row, masked to +0
                        v = x[cutlass.min(row0 + r, m - 1), c, None].load()
                        keep = Uint32(0) - Uint32(r < rows)
                        vs.append([v[j] & keep for j in range(4)])
                    amaxes = []
                    for a in ops.column_amax(vs):  # u16 pairs -> fp32 amax bits per feature
                        amaxes += [(a & Uint32(0xFFFF)) << 16, a & Uint32(0xFFFF0000)]
                    cols = [ops.e8m0(Int32(a)) for a in amaxes]  # per feature (2^-e, byte, NaN mask)
                    masks = []
                    for w in cutlass.range_constexpr(2):
                        mk = Uint32(0)
                        for k in cutlass.range_constexpr(4):
                            mk = mk | (cols[4 * w + k][2] & Uint32(0xFF << (8 * k)))
                        masks.append(mk)
                    mult = [scale_bits(col[1]) for col in cols]
                    for r in cutlass.range_constexpr(32):
                        q = ops.fp8_words(ops.elems(vs[r]), [col[0] for col in cols], masks)
                        o = cute.make_rmem_tensor((4,), Uint32)
                        convert([q[0], q[1]], mult, o, Int32(0))
                        if r < rows:
                            out[row0 + r, c, None].store(o.load())
                    if cutlass.const_expr(count):
                        # only a scale byte < 3 can round: recount (rare) instead of counting on the main path
                        small = Int32(0)
                        for col in cols:
                            small = small | Int32(col[1] < Uint32(3))
                        if small != Int32(0):
                            cnt = Int32(0)
                            for r in cutlass.range_constexpr(32):  # rows reloaded: vs is dead by now
                                v = x[cutlass.min(row0 + r, m - 1), c, None].load()
                                keep = Uint32(0) - Uint32(r < rows)
                                q = ops.fp8_words(ops.elems([v[j] & keep for j in range(4)]), [col[0] for col in cols],
                                                  masks)
                                o = cute.make_rmem_tensor((4,), Uint32)
                                cnt = cnt + Int32(r < rows) * convert([q[0], q[1]], mult, o, Int32(0))
                            flush_count(cnt, counter)
            elif t < items:
                zero_tail(out, offs, t - slot_items, nc, m, num_e)

        @cute.jit
        def launch(xp: cute.Pointer, op: cute.Pointer, offp: cute.Pointer, cp: cute.Pointer, m: Int32, nc: Int32,
                   num_e: Int32, stream: cuda.CUstream):
            tok_launch(rt_tok_kernel, xp, op, offp, cp, m, nc, num_e, stream)

        args = (Int32(32), Int32(1), Int32(1))
    return compile_kernel(launch, *_pointers(layout, 0, 0, 0, 0, 0), *args, cuda.CUstream(0), arch=arch,
                          inspect=True)


def _pointers(layout: str, data: int, scales: int, out: int, counter: int, offsets: int):
    """Kernel pointer arguments (make_ptr objects: raw int addresses would truncate to Int32)."""
    cutlass, cute = dsl()
    gmem, make_ptr = cute.AddressSpace.gmem, cute.runtime.make_ptr
    u32 = cutlass.Uint32
    d = make_ptr(u32, data, gmem, assumed_align=16)
    o = make_ptr(u32, out, gmem, assumed_align=16)
    c = make_ptr(cutlass.Int32, counter, gmem, assumed_align=4)
    if layout == "row":
        return d, make_ptr(cutlass.Uint8, scales, gmem, assumed_align=1), o, c
    if layout == "col":
        return d, make_ptr(u32, scales, gmem, assumed_align=16), o, c
    if layout == "rt_row":
        return d, o, c
    if layout == "rt_tokens":
        return d, o, make_ptr(cutlass.Int32, offsets, gmem, assumed_align=4), c
    offs = make_ptr(cutlass.Int32, offsets, gmem, assumed_align=4)
    return d, make_ptr(u32, scales, gmem, assumed_align=8), o, offs, c


def compiled_dequant(layout: str, arch: str, count: bool = False):
    """The cached ``(compiled, CompileReport)`` for ``layout`` in LAYOUTS, an arch in
    ``compile.ARCHS``, with or without the inexact counter (compiled on first request)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return compile_cached(("mxfp8_dequant", layout, arch, bool(count)), lambda: _build(layout, bool(count), arch))


def _check(name, t, dtype, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() > MAX_NUMEL:
        raise ValueError(f"{name}.numel() = {t.numel()} must be < 2^31")


def _check_counter(counter, device):
    if counter is None:
        return
    _check("counter", counter, torch.int32, 1)
    if counter.numel() != 1 or counter.device != device:
        raise ValueError(f"counter must be int32 [1] on {device}, got {tuple(counter.shape)} on {counter.device}")


def _check_out(out, shape, device):
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check("out", out, torch.bfloat16, 2)
    if tuple(out.shape) != tuple(shape) or out.data_ptr() % 16:
        raise ValueError(f"out must be contiguous {tuple(shape)} and 16-byte aligned, got {tuple(out.shape)}")
    return out


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, dim: int = -1, *, out=None, counter=None):
    """bf16 [R, C] = data * 2^(scales - 127) along ``dim`` on the current stream.

    data float8_e4m3fn [R, C] contiguous, 16-byte aligned, C % 16 == 0; scales uint8 contiguous
    [R, C/32] for dim -1/1 (C % 32 == 0) or [R/32, C] for dim 0/-2 (R % 32 == 0; 16-byte
    aligned). ``out``: optional contiguous bf16 [R, C]; ``counter``: optional int32 [1] that
    receives the inexact count (module docstring). Bitwise
    ``reference.mxfp8_dequantize(data, scales, dim).bfloat16()`` (NaNs as NaN).
    """
    _check("data", data, _FP8, 2)
    _check("scales", scales, torch.uint8, 2)
    if isinstance(dim, bool) or dim not in (-2, -1, 0, 1):
        raise ValueError(f"dim must be -1/1 (row-wise) or 0/-2 (column-wise), got {dim!r}")
    r, c = data.shape
    row = dim % 2 == 1
    if c % (32 if row else 16) or (not row and r % 32):
        raise ValueError(f"data {tuple(data.shape)}: need C % {32 if row else 16} == 0"
                         + ("" if row else " and R % 32 == 0"))
    want = (r, c // 32) if row else (r // 32, c)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must be {want} for data {tuple(data.shape)} and dim={dim}, got {tuple(scales.shape)}")
    if data.data_ptr() % 16 or (not row and scales.data_ptr() % 16):
        raise ValueError("data (and column scales) must be 16-byte aligned")
    _check_devices(data=data, scales=scales, out=out, counter=counter)
    _check_counter(counter, data.device)
    out = _check_out(out, (r, c), data.device)
    if data.numel():
        layout = "row" if row else "col"
        fn, _ = compiled_dequant(layout, arch_of_device(data.device), counter is not None)
        cptr = (counter if counter is not None else out).data_ptr()
        with torch.cuda.device(data.device):
            fn(*_pointers(layout, data.data_ptr(), scales.data_ptr(), out.data_ptr(), cptr, 0),
               r * c // 16, c // 16, current_stream(data.device))
    return out


def dequantize_mxfp8_tokens(data_t: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, m: int, *,
                            out=None, counter=None):
    """Token rows bf16 [m, N] of a token-wise MXFP8 operand on the current stream: row r of
    expert e (offsets[e] <= r < offsets[e+1]) = data_t[:, 32 (offsets[e] // 32 + e) + r -
    offsets[e]] * 2^(scales[offsets[e] // 32 + e + (r - offsets[e]) // 32] - 127); rows at or
    past offsets[E] are 0. No host sync.

    data_t float8_e4m3fn [N, 32 S], scales uint8 [S, N] (``quantize_tokens(x [m, N], offsets,
    "mxfp8")``), S = m // 32 + E, N % 8 == 0, contiguous, data_t 16-byte and scales 8-byte
    aligned; offsets int32 [E+1] contiguous on the device (0, non-decreasing, offsets[E] <= m;
    trusted). ``out`` / ``counter`` as in :func:`dequantize_mxfp8`.
    """
    _check("data_t", data_t, _FP8, 2)
    _check("scales", scales, torch.uint8, 2)
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1:
        raise TypeError("offsets must be a 1-D torch.int32 tensor [E+1]")
    if offsets.numel() < 2 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be contiguous with E+1 >= 2 entries, got {offsets.numel()}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise TypeError(f"m must be a non-negative int, got {m!r}")
    n = data_t.shape[0]
    num_e = offsets.numel() - 1
    slots = m // 32 + num_e
    if n % 8 or tuple(data_t.shape) != (n, 32 * slots) or tuple(scales.shape) != (slots, n):
        raise ValueError(f"need data_t [N, 32 S] and scales [S, N] with S = m // 32 + E = {slots}, N % 8 == 0; "
                         f"got data_t {tuple(data_t.shape)}, scales {tuple(scales.shape)}")
    if data_t.data_ptr() % 16 or scales.data_ptr() % 8:
        raise ValueError("data_t must be 16-byte and scales 8-byte aligned")
    if m * n > MAX_NUMEL:
        raise ValueError("the output must hold < 2^31 elements")
    _check_devices(data_t=data_t, scales=scales, offsets=offsets, out=out, counter=counter)
    _check_counter(counter, data_t.device)
    out = _check_out(out, (m, n), data_t.device)
    if m and n:
        fn, _ = compiled_dequant("tokens", arch_of_device(data_t.device), counter is not None)
        cptr = (counter if counter is not None else out).data_ptr()
        with torch.cuda.device(data_t.device):
            fn(*_pointers("tokens", data_t.data_ptr(), scales.data_ptr(), out.data_ptr(), cptr, offsets.data_ptr()),
               m, n // 8, num_e, current_stream(data_t.device))
    return out


def _check_bf16_rows(x, name="x"):
    _check(name, x, torch.bfloat16, 2)
    if x.shape[1] % 8 or x.data_ptr() % 16:
        raise ValueError(f"{name}: columns = {x.shape[1]} must be a multiple of 8 and data 16-byte aligned")


def mxfp8_round_trip(x: torch.Tensor, *, out=None, counter=None):
    """bf16 [M, K]: x MXFP8-quantized along its rows (K, blocks of 32) and dequantized, in one
    pass on the current stream (4 bytes per element instead of the 6 of quantize + dequantize).

    x bf16 [M, K] contiguous, 16-byte aligned, K % 32 == 0. Bitwise
    ``reference.mx_round_trip(x, -1).bfloat16()`` = ``dequantize_mxfp8(*quantize_mxfp8(x, -1))``
    (same quantize ops as :mod:`mok_cute.kernels.quant.quantize`; NaN blocks as NaN). ``out`` /
    ``counter`` as in :func:`dequantize_mxfp8`.
    """
    _check_bf16_rows(x)
    m, k = x.shape
    if k % 32:
        raise ValueError(f"x.shape[1] = {k} must be a multiple of 32 (the MX block)")
    _check_devices(x=x, out=out, counter=counter)
    _check_counter(counter, x.device)
    out = _check_out(out, (m, k), x.device)
    if x.numel():
        fn, _ = compiled_dequant("rt_row", arch_of_device(x.device), counter is not None)
        cptr = (counter if counter is not None else out).data_ptr()
        with torch.cuda.device(x.device):
            fn(*_pointers("rt_row", x.data_ptr(), 0, out.data_ptr(), cptr, 0), m * k // 8, current_stream(x.device))
    return out


def mxfp8_round_trip_tokens(x: torch.Tensor, offsets: torch.Tensor, *, out=None, counter=None):
    """bf16 token rows [M, N]: x MXFP8-quantized along tokens (dim 0) in blocks of 32 rows from
    each group's first row (zero padding) and dequantized, in one pass; rows at or past
    offsets[E] are 0. No host sync. With offsets [0, M] (M % 32 == 0) this is the column-wise
    round trip (``quantize_mxfp8(x, 0)``).

    x bf16 [M, N] contiguous, 16-byte aligned, N % 8 == 0; offsets int32 [E+1] contiguous on
    x's device (0, non-decreasing, offsets[E] <= M; trusted). Bitwise, on rows < offsets[E],
    ``dequantize_mxfp8_tokens(*quantize_tokens(x, offsets, "mxfp8"), offsets, M)`` =
    ``reference._mx_round_trip_groups(x, offsets).bfloat16()``. ``out`` / ``counter`` as in
    :func:`dequantize_mxfp8`.
    """
    _check_bf16_rows(x)
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1:
        raise TypeError("offsets must be a 1-D torch.int32 tensor [E+1]")
    if offsets.numel() < 2 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be contiguous with E+1 >= 2 entries, got {offsets.numel()}")
    m, n = x.shape
    _check_devices(x=x, offsets=offsets, out=out, counter=counter)
    _check_counter(counter, x.device)
    out = _check_out(out, (m, n), x.device)
    if m and n:
        fn, _ = compiled_dequant("rt_tokens", arch_of_device(x.device), counter is not None)
        cptr = (counter if counter is not None else out).data_ptr()
        with torch.cuda.device(x.device):
            fn(*_pointers("rt_tokens", x.data_ptr(), 0, out.data_ptr(), cptr, offsets.data_ptr()),
               m, n // 8, offsets.numel() - 1, current_stream(x.device))
    return out

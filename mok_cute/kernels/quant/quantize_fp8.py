"""FP8 quantize kernels (CuTe DSL) for the FP8 expert GEMMs: FP8 blockwise ("fp8_block",
DeepSeek-V3 recipe) row-wise, and token-wise transposed copies for wgrad (fp8_block and MXFP8).

Contracts (bitwise equal to :mod:`mok_cute.reference`, by construction: same fp32 ops):

* ``row`` — :func:`quantize_fp8_block_act` = ``reference.fp8_block_quantize_act``: x [M, K]
  bf16/fp32, 1x128 tiles along K. Per tile: amax on the |x| bit patterns (u16x2 / u32 max:
  subnormals kept, NaN/Inf detected as bits >= 0x7F800000); a = max(amax, 2^-100) (integer
  max on the bits); ``inv = div.rn.f32(448, a)``, ``scale = div.rn.f32(a, 448)`` (IEEE
  divisions, never ``div.approx``/``div.full``); data = ``cvt.rn.satfinite.e4m3x2.f32`` of
  ``mul.rn.f32(x, inv)`` (no FTZ). Non-finite tile: scale NaN (0x7FC00000), data 0x7F.
  Scales are stored MN-major, [K/128, M] contiguous (what the GEMM's per-k-tile promotion
  reads: the 128 row scales of one k-block are contiguous); the wrapper returns the
  [M, K/128] view (``.t()``), value-equal to the reference.
* ``tokens`` — :func:`quantize_tokens` = ``reference.fp8_block_quantize_tokens`` (block 128,
  fp32 scales) or ``reference.mxfp8_quantize_tokens`` (block 32, E8M0 scales, the MXFP8
  ops of :mod:`mok_cute.kernels.quant.quantize`): x [M, N] token rows grouped by expert
  (offsets [E+1] int32 on the device, no host sync), quantized along tokens per group and
  written transposed, tile-aligned: data_t [N, B*S] (group e's tokens from column
  B*(offsets[e] // B + e)), scales [S, N], S = M // B + E. Every slot is written (padding
  rows and unused slots as 0), so the output is fully defined without a memset.

* ``weight`` / ``weight_t`` — :func:`quantize_fp8_block_weight` = ``reference.fp8_block_quantize_weight``;
  :func:`quantize_fp8_block_weights_t` also writes the stacked, per-expert transposed copy (the
  dgrad weights) from the same registers, through a shared [128 x 132-byte] tile per block:
  w [N, K] in 128x128 blocks, one CTA of 256 threads per block, the ``row`` kind's ops with
  the amax over 16384 elements. Bitwise equal to the reference on the H200 (1847 GB/s on
  16384 x 7168 bf16, 11.7x the torch ops); the sm90 backend's fp8_block weights come from it
  (cached per weight version by ``mok_cute.layers.weight_cache``).

Thread work (``tokens``): one thread = 32 token rows x one 16-byte column chunk (C = 8 bf16
or 4 fp32 features); the B/32 threads of one B-token tile are adjacent lanes and combine
per-column amaxes with butterfly shuffles; each feature's 32 bytes go out as two 16-byte
stores (the transposed layout is tile-aligned, so these are aligned). A slot finds its
group by binary search on offsets (base(e) = offsets[e] // B + e is non-decreasing).

Dims are runtime ``Int32``: one compiled kernel per (kind, fmt, arch, dtype).
"""

import torch

from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel, dsl
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.dsl.host import FLOAT_INPUTS, MAX_NUMEL, check_float_input, check_rows16, current_stream

KINDS = ("row", "tokens", "weight", "weight_t")
FORMATS = ("fp8_block", "mxfp8")
DTYPES = FLOAT_INPUTS
BLOCK = {"fp8_block": 128, "mxfp8": 32}
_ROW_THREADS = 256
_ROW_UNROLL = 4
_TOK_THREADS = 128
_W_THREADS = 256  # weight kind: one CTA per 128x128 block, 8 row chunks per thread
_T_PITCH = 132  # weight_t: bytes per column of the shared transposed block (128 + 4: 4-way byte-store conflicts)
F448 = 0x43E00000  # 448.0f
AMAX_MIN_BITS = 0x0D800000  # 2^-100 (reference.FP8_AMAX_MIN)
NAN_BITS = 0x7FC00000  # the canonical fp32 NaN (what torch writes)


def _build(kind: str, fmt: str, dtype: torch.dtype, arch: str):
    """Trace and compile one kernel; returns ``(compiled, CompileReport)``."""
    cutlass, cute = dsl()
    import cuda.bindings.driver as cuda  # noqa: PLC0415

    Int32, Uint32 = cutlass.Int32, cutlass.Uint32
    bf16 = dtype == torch.bfloat16
    C = 8 if bf16 else 4  # elements per 16-byte chunk
    OW = C // 4  # output words per chunk (row kernel)

    ops = Fp8Ops(bf16)

    def block_scale(a32):
        """fp8_block: amax fp32 bits -> (inv bits, scale bits, nonfinite mask)."""
        nonfinite = Uint32(0) - Uint32(a32 >= Uint32(0x7F800000))
        inv, sc = cute.arch.inline_ptx(
            "{ .reg .b32 a;\n"
            f"max.u32 a, {{$r0}}, {AMAX_MIN_BITS};\n"
            f"div.rn.f32 {{$w0}}, 0f{F448:08X}, a;\n"
            f"div.rn.f32 {{$w1}}, a, 0f{F448:08X}; }}",
            write_only_types=[Uint32, Uint32], read_only_args=[a32])
        return inv, (sc & ~nonfinite) | (Uint32(NAN_BITS) & nonfinite), nonfinite

    def col_amaxes(accs):
        """4 running-max words -> C per-element amax fp32 bit patterns."""
        out = []
        for a in accs:
            out += [(a & Uint32(0xFFFF)) << 16, a & Uint32(0xFFFF0000)] if bf16 else [a]
        return out

    if kind == "row":
        L = 128 // C  # lanes (chunks) per 1x128 tile

        @cute.kernel
        def row_kernel(x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, n: Int32, m: Int32, kt: Int32):
            lane, base, vs = ops.row_loads(x, n, _ROW_THREADS, _ROW_UNROLL)
            for u in cutlass.range_constexpr(_ROW_UNROLL):
                v = vs[u]
                a = ops.block_amax(v, L, fp32_bits=True)
                inv, sc, nf = block_scale(a)
                o = ops.fp8_words(ops.elems(v), [inv] * C, [nf] * OW)
                i = base + u * 32
                if i < n:
                    q[i, None].store(o.load())
                    if lane % L == 0:
                        t = i // L
                        row = t // kt
                        s[(t - row * kt) * m + row] = sc

        @cute.jit
        def launch(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, n_chunks: Int32, m: Int32,
                   kt: Int32, stream: cuda.CUstream):
            x = cute.make_tensor(xp, cute.make_layout((n_chunks, 4), stride=(4, 1)))
            q = cute.make_tensor(qp, cute.make_layout((n_chunks, OW), stride=(OW, 1)))
            s = cute.make_tensor(sp, cute.make_layout((m * kt,)))
            per_cta = _ROW_THREADS * _ROW_UNROLL
            row_kernel(x, q, s, n_chunks, m, kt).launch(
                grid=[(n_chunks + per_cta - 1) // per_cta, 1, 1], block=[_ROW_THREADS, 1, 1],
                stream=stream)

        args = (Int32(1), Int32(1), Int32(1))
    elif kind == "tokens":
        B = BLOCK[fmt]
        SUB = B // 32  # threads per (tile, chunk)
        SW = C if fmt == "fp8_block" else C // 4  # scale words per chunk

        @cute.kernel
        def tok_kernel(x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, offs: cute.Tensor, items: Int32,
                       nc: Int32, m: Int32, num_e: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            t = bid * _TOK_THREADS + tid
            tc = cutlass.min(t, items * SUB - 1)  # out-of-range threads redo the last item
            sub = tc % SUB
            item = tc // SUB
            slot = item // nc
            c = item - slot * nc
            # group of this slot: the largest e in [0, E] with offs[e] // B + e <= slot
            lo = Int32(0)
            hi = num_e
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if offs[mid] // B + mid <= slot:
                    lo = mid
                else:
                    hi = mid - 1
            e = lo
            g_lo = offs[e]
            g_hi = offs[cutlass.min(e + 1, num_e)]
            row0 = g_lo + (slot - (g_lo // B + e)) * B
            tile_rows = cutlass.max(cutlass.min(g_hi - row0, B), 0)
            if e >= num_e:
                tile_rows = Int32(0)
            valid = tile_rows - sub * 32
            r0 = row0 + sub * 32
            vs = []
            for r in cutlass.range_constexpr(32):
                # rows past the tile (or the whole tile of an unused slot) read a valid row
                # and are masked to +0: zero padding
                v = x[cutlass.max(cutlass.min(r0 + r, m - 1), 0), c, None].load()
                keep = Uint32(0) - Uint32(r < valid)
                vs.append([v[j] & keep for j in range(4)])
            accs = ops.column_amax(vs)
            for k in cutlass.range_constexpr(SUB.bit_length() - 1):
                for j in cutlass.range_constexpr(4):
                    # packed per-element max (bf16: u16 pairs), not a whole-word max.u32
                    accs[j] = ops.wmax(accs[j], cute.arch.shuffle_sync_bfly(accs[j], offset=1 << k))
            amaxes = col_amaxes(accs)
            if cutlass.const_expr(fmt == "fp8_block"):
                cols = [block_scale(a) for a in amaxes]  # (inv, scale bits, mask)
                used = Uint32(0) - Uint32(tile_rows > 0)
                sw = cute.make_rmem_tensor((SW,), Uint32)
                for i in cutlass.range_constexpr(C):
                    sw[i] = cols[i][1] & used
            else:
                cols = [ops.e8m0(Int32(a)) for a in amaxes]  # (2^-e, byte, mask)
                sw = cute.make_rmem_tensor((SW,), Uint32)
                for w in cutlass.range_constexpr(SW):
                    word = Uint32(0)
                    for k in cutlass.range_constexpr(4):
                        word = word | (cols[4 * w + k][1] << (8 * k))
                    sw[w] = word
            if t < items * SUB:
                for i in cutlass.range_constexpr(C):
                    f = [ops.elems(vs[r])[i] for r in range(32)]
                    o = ops.fp8_words(f, [cols[i][0]] * 32, [cols[i][2]] * 8)
                    q[c * C + i, slot * SUB + sub, None].store(o.load())
                if sub == 0:
                    s[slot, c, None].store(sw.load())

        @cute.jit
        def launch(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, op: cute.Pointer, m: Int32,
                   nc: Int32, num_e: Int32, stream: cuda.CUstream):
            slots = m // B + num_e
            items = slots * nc
            x = cute.make_tensor(xp, cute.make_layout((m, nc, 4), stride=(cute.assume(nc * 4, divby=4), 4, 1)))
            # data_t [N, B * slots] as 32-byte groups of 8 words: (feature, 32-token group, word)
            qw = slots * B // 4
            q = cute.make_tensor(qp, cute.make_layout((nc * C, slots * SUB, 8),
                                                      stride=(cute.assume(qw, divby=8), 8, 1)))
            s = cute.make_tensor(sp, cute.make_layout((slots, nc, SW),
                                                      stride=(cute.assume(nc * SW, divby=SW), SW, 1)))
            offs = cute.make_tensor(op, cute.make_layout((num_e + 1,)))
            threads = items * SUB
            tok_kernel(x, q, s, offs, items, nc, m, num_e).launch(
                grid=[(threads + _TOK_THREADS - 1) // _TOK_THREADS, 1, 1], block=[_TOK_THREADS, 1, 1],
                stream=stream)

        args = (Int32(128), Int32(1), Int32(1))
    elif kind in ("weight", "weight_t"):
        transposed = kind == "weight_t"
        KC = 128 // C  # 16-byte chunks per block row
        RPP = _W_THREADS // KC  # block rows per pass
        PASSES = 128 // RPP
        WARPS = _W_THREADS // 32

        def chunks_amax(vs):
            """amax fp32 bit pattern over this thread's chunks (u16x2 / u32 running maxima)."""
            acc = None
            for v in vs:
                for j in range(4):
                    acc = ops.amax_acc(acc, v[j])
            return ops.umax(acc & Uint32(0xFFFF), acc >> 16) << 16 if bf16 else acc

        def store_transposed(tile, os, tid):
            """This thread's quantized bytes into the block's transposed staging tile (column
            byte rows of ``_T_PITCH`` bytes: tile[col, row])."""
            for u in range(PASSES):
                for w in range(OW):
                    for b in range(4):
                        tile[(tid % KC) * C + 4 * w + b, tid // KC + RPP * u] = cutlass.Uint8(
                            (os[u][w] >> Uint32(8 * b)) & Uint32(0xFF))

        @cute.kernel
        def w_kernel(x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, kc: Int32, kb: Int32, qt: cute.Tensor,
                     st: cute.Tensor, rb: Int32, ntw: Int32, nb: Int32, cb0: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            br = bid // kb
            bc = bid - br * kb
            c = bc * KC + tid % KC  # this thread's chunk column
            rows = [br * 128 + tid // KC + RPP * u for u in range(PASSES)]
            vs = [x[r * kc + c, None].load() for r in rows]  # every load issued first
            a = chunks_amax(vs)
            for k in cutlass.range_constexpr(5):
                a = ops.umax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << k))
            red = cutlass.memory.SmemAllocator().allocate_tensor(Uint32, cute.make_layout(WARPS), byte_alignment=16)
            if tid % 32 == 0:
                red[tid // 32] = a
            cute.arch.barrier()
            a = red[0]
            for w in cutlass.range_constexpr(1, WARPS):
                a = ops.umax(a, red[w])
            inv, sc, nf = block_scale(a)
            os = []
            for u in cutlass.range_constexpr(PASSES):
                o = ops.fp8_words(ops.elems(vs[u]), [inv] * C, [nf] * OW)
                q[rows[u] * kc + c, None].store(o.load())
                os.append(o)
            if tid == 0:
                s[bid] = sc
            if cutlass.const_expr(transposed):
                # block (br, bc) of W[e] (e = br // rb) is block (bc, cb0 + br % rb) of W[e]^T
                t32 = cutlass.memory.SmemAllocator().allocate_tensor(
                    Uint32, cute.make_layout((128, _T_PITCH // 4), stride=(_T_PITCH // 4, 1)), byte_alignment=16)
                store_transposed(cute.recast_tensor(t32, cutlass.Uint8), os, tid)
                cute.arch.barrier()
                e = br // rb
                col0 = (cb0 + br - e * rb) * 32  # first word of the block's columns in a W^T row
                row0 = (cutlass.Int64(e) * (kb * 128) + bc * 128) * ntw  # word of W[e]^T row bc * 128
                for i in cutlass.range_constexpr(128 * 32 // _W_THREADS):
                    w = tid + _W_THREADS * i
                    qt[row0 + cutlass.Int64(w // 32) * ntw + col0 + w % 32] = t32[w // 32, w % 32]
                if tid == 0:
                    st[(e * kb + bc) * nb + cb0 + br - e * rb] = sc

        @cute.jit
        def launch(xp: cute.Pointer, qp: cute.Pointer, sp: cute.Pointer, qtp: cute.Pointer, stp: cute.Pointer,
                   n: Int32, kc: Int32, rb: Int32, nb: Int32, cb0: Int32, stream: cuda.CUstream):
            x = cute.make_tensor(xp, cute.make_layout((n * kc, 4), stride=(4, 1)))
            q = cute.make_tensor(qp, cute.make_layout((n * kc, OW), stride=(OW, 1)))
            kb = kc // KC
            s = cute.make_tensor(sp, cute.make_layout(((n // 128) * kb,)))
            e = n // (rb * 128)
            qt = cute.make_tensor(qtp, cute.make_layout((cutlass.Int64(e) * (kb * 128) * (nb * 32),)))
            st = cute.make_tensor(stp, cute.make_layout((e * kb * nb,)))
            w_kernel(x, q, s, kc, kb, qt, st, rb, nb * 32, nb, cb0).launch(
                grid=[(n // 128) * kb, 1, 1], block=[_W_THREADS, 1, 1], stream=stream)

        args = (Int32(128), Int32(KC), Int32(1), Int32(1), Int32(0))
    return compile_kernel(launch, *_pointers(kind, fmt, 0, 0, 0, 0), *args, cuda.CUstream(0), arch=arch,
                          inspect=True)


def _pointers(kind: str, fmt: str, x: int, data: int, scales: int, offsets: int, data_t: int = 0,
              scales_t: int = 0):
    """Kernel pointer arguments (32-bit words; see quantize.py on raw int addresses); the
    weight kinds also take the transposed outputs (unused by ``weight``)."""
    cutlass, cute = dsl()
    gmem, make_ptr = cute.AddressSpace.gmem, cute.runtime.make_ptr
    u32 = cutlass.Uint32
    if kind == "row":
        return (make_ptr(u32, x, gmem, assumed_align=16), make_ptr(u32, data, gmem, assumed_align=4),
                make_ptr(u32, scales, gmem, assumed_align=4))
    if kind in ("weight", "weight_t"):
        return tuple(make_ptr(u32, a, gmem, assumed_align=16 if i == 0 else 4)
                     for i, a in enumerate((x, data, scales, data_t, scales_t)))
    return (make_ptr(u32, x, gmem, assumed_align=16), make_ptr(u32, data, gmem, assumed_align=16),
            make_ptr(u32, scales, gmem, assumed_align=16 if fmt == "fp8_block" else 4),
            make_ptr(cutlass.Int32, offsets, gmem, assumed_align=4))


def compiled_quantize_fp8(kind: str, fmt: str, arch: str, dtype: torch.dtype = torch.bfloat16):
    """The cached ``(compiled, CompileReport)`` for ``kind`` in KINDS, ``fmt`` in FORMATS
    (``row`` is fp8_block only; MXFP8 row/col kernels are in quantize.py), an arch in
    ``compile.ARCHS`` and an input dtype in DTYPES."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if fmt not in FORMATS or (kind in ("row", "weight", "weight_t") and fmt != "fp8_block"):
        raise ValueError(f"fmt must be one of {FORMATS} ('fp8_block' for kinds 'row', 'weight', 'weight_t'), "
                         f"got {fmt!r}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    return compile_cached(("fp8_quantize", kind, fmt, arch, dtype), lambda: _build(kind, fmt, dtype, arch))


def _check_x(x: torch.Tensor) -> None:
    check_float_input(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    check_rows16(x, "x")


def quantize_fp8_block_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 blockwise 1x128 quantization of a contiguous CUDA bf16/fp32 x [M, K] (K % 128 == 0).

    Returns ``(data float8_e4m3fn [M, K], scales float32 [M, K/128])``; ``scales`` is the
    transposed view of a contiguous [K/128, M] buffer (``scales.t()`` is what the FP8 GEMM
    takes). Bitwise equal to ``reference.fp8_block_quantize_act(x)``.
    """
    _check_x(x)
    m, k = x.shape
    if k % 128:
        raise ValueError(f"x.shape[1] = {k} must be a multiple of 128 (the 1x128 tile)")
    if x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales_t = torch.empty((k // 128, m), dtype=torch.float32, device=x.device)
    if x.numel():
        fn, _ = compiled_quantize_fp8("row", "fp8_block", arch_of_device(x.device), x.dtype)
        n_chunks = m * k * x.element_size() // 16
        with torch.cuda.device(x.device):
            fn(*_pointers("row", "fp8_block", x.data_ptr(), data.data_ptr(), scales_t.data_ptr(), 0),
               n_chunks, m, k // 128, current_stream(x.device))
    return data, scales_t.t()


def _check_weight(w: torch.Tensor) -> tuple[int, int]:
    _check_x(w)
    n, k = w.shape
    if n % 128 or k % 128:
        raise ValueError(f"w: shape {tuple(w.shape)} must be multiples of 128 in both dims (128x128 blocks)")
    if w.device.type != "cuda":
        raise ValueError(f"w must be a CUDA tensor, got device {w.device}")
    return n, k


def _launch_weight(kind: str, w, data, scales, data_t=None, scales_t=None, rows: int = 128, nt: int = 128,
                   col0: int = 0):
    n, k = w.shape
    fn, _ = compiled_quantize_fp8(kind, "fp8_block", arch_of_device(w.device), w.dtype)
    ptrs = _pointers(kind, "fp8_block", w.data_ptr(), data.data_ptr(), scales.data_ptr(), 0,
                     0 if data_t is None else data_t.data_ptr(), 0 if scales_t is None else scales_t.data_ptr())
    with torch.cuda.device(w.device):
        fn(*ptrs, n, k * w.element_size() // 16, rows // 128, nt // 128, col0 // 128, current_stream(w.device))


def quantize_fp8_block_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 blockwise 128x128 quantization of a contiguous CUDA bf16/fp32 weight [N, K] (N, K
    multiples of 128; an [E, R, C] weight as its [E*R, C] view: R % 128 == 0, so no block
    straddles two experts). Returns ``(data float8_e4m3fn [N, K], scales float32 [N/128,
    K/128])``, bitwise equal to ``reference.fp8_block_quantize_weight(w)`` (the ops of
    :func:`quantize_fp8_block_act` with the amax over the block's 16384 elements: per-thread
    u16x2 / u32 maxima, a warp butterfly, then the 8 warps' maxima through shared memory)."""
    n, k = _check_weight(w)
    data = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty((n // 128, k // 128), dtype=torch.float32, device=w.device)
    if w.numel():
        _launch_weight("weight", w, data, scales)
    return data, scales


def quantize_fp8_block_weights_t(*weights: torch.Tensor):
    """Per-expert 128x128 quantization of expert weights w_j [E, R_j, K] (contiguous CUDA
    bf16/fp32, R_j and K multiples of 128) together with the dgrad operand: the weights
    stacked along R and transposed, in one read of each weight.

    Returns ``([(data_j [E, R_j, K] e4m3, scales_j [E, R_j/128, K/128] fp32) ...], (data_t
    [E, K, N] e4m3, scales_t [E, K/128, N/128] fp32))`` with N = sum R_j: data_j / scales_j
    bitwise ``reference.fp8_block_quantize_weight`` per expert, and data_t / scales_t their
    stack along R transposed per expert (a block of W^T is the transpose of a block of W with
    the same scale), i.e. ``sm90.fp8_expert.transpose_weight_blocks`` of the pairs. The
    transposed block goes through a shared [128 x 132-byte] tile of the block's CTA."""
    if not weights:
        raise ValueError("quantize_fp8_block_weights_t needs at least one weight")
    for j, w in enumerate(weights):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"weights[{j}] must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3 or w.shape[0] != weights[0].shape[0] or w.shape[2] != weights[0].shape[-1]:
            raise ValueError(f"weights[{j}] must be [E, R, K] with the E and K of weights[0] "
                             f"{tuple(weights[0].shape)}, got {tuple(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"weights[{j}] must be contiguous")
        if w.shape[1] % 128 or w.shape[2] % 128:
            raise ValueError(f"weights[{j}]: R and K of {tuple(w.shape)} must be multiples of 128 (128x128 blocks "
                             "per expert)")
    for w in weights:
        _check_weight(w.view(-1, w.shape[2]))
    e, k = weights[0].shape[0], weights[0].shape[2]
    nt = sum(w.shape[1] for w in weights)
    dev = weights[0].device
    data_t = torch.empty((e, k, nt), dtype=torch.float8_e4m3fn, device=dev)
    scales_t = torch.empty((e, k // 128, nt // 128), dtype=torch.float32, device=dev)
    out, col0 = [], 0
    for w in weights:
        r = w.shape[1]
        data = torch.empty((e, r, k), dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.empty((e, r // 128, k // 128), dtype=torch.float32, device=dev)
        if w.numel():
            _launch_weight("weight_t", w.view(e * r, k), data, scales, data_t, scales_t, r, nt, col0)
        out.append((data, scales))
        col0 += r
    return out, (data_t, scales_t)


def quantize_tokens(x: torch.Tensor, offsets: torch.Tensor, fmt: str = "fp8_block"):
    """Token-wise (wgrad) quantization of expert-grouped rows x [M, N] (contiguous CUDA
    bf16/fp32, N * element size a multiple of 16) with offsets int32 [E+1] on the device
    (0, non-decreasing, offsets[E] <= M; trusted: checking needs a host sync).

    ``fmt`` "fp8_block": returns (data_t float8_e4m3fn [N, 128 S], scales float32 [S, N]),
    S = M // 128 + E, bitwise equal to ``reference.fp8_block_quantize_tokens(x, offsets)``;
    "mxfp8": (data_t [N, 32 S], scales uint8 [S, N]), S = M // 32 + E, equal to
    ``reference.mxfp8_quantize_tokens``. No host sync.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    _check_x(x)
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1:
        raise TypeError("offsets must be a 1-D torch.int32 tensor [E+1]")
    if offsets.numel() < 2 or not offsets.is_contiguous():
        raise ValueError(f"offsets must be contiguous with E+1 >= 2 entries, got {offsets.numel()}")
    if x.device.type != "cuda" or offsets.device != x.device:
        raise ValueError(f"x and offsets must be on one CUDA device, got {x.device} and {offsets.device}")
    m, n = x.shape
    e = offsets.numel() - 1
    b = BLOCK[fmt]
    slots = m // b + e
    if slots * b * n > MAX_NUMEL:
        raise ValueError("the transposed output must hold < 2^31 elements")
    data_t = torch.empty((n, slots * b), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((slots, n), dtype=torch.float32 if fmt == "fp8_block" else torch.uint8,
                         device=x.device)
    if n and m:
        fn, _ = compiled_quantize_fp8("tokens", fmt, arch_of_device(x.device), x.dtype)
        nc = n * x.element_size() // 16
        with torch.cuda.device(x.device):
            fn(*_pointers("tokens", fmt, x.data_ptr(), data_t.data_ptr(), scales.data_ptr(), offsets.data_ptr()),
               m, nc, e, current_stream(x.device))
    elif n:
        data_t.zero_()
        scales.zero_()
    return data_t, scales

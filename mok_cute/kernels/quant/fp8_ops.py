"""Trace-time building blocks of the FP8 quantize and dequantize kernels (:mod:`quantize`,
:mod:`quantize_fp8`, :mod:`dequant_mxfp8`) and of the GEMM epilogues' MXFP8 copies and round trips
(:mod:`mok_cute.kernels.sm90.grouped_gemm`, :mod:`mok_cute.kernels.mx_rows`, the megakernels).

Inputs are handled as 32-bit words of bf16 (two elements, low half first) or fp32 (one) bit
patterns; an amax is the max of the |x| bit patterns (integer max: subnormals kept, NaN/Inf
are the patterns >= 0x7F800000). Every method emits the instructions at the call site.
"""

from mok_cute.dsl.compile import dsl


class Fp8Ops:
    """Word ops for inputs of bf16 (``bf16=True``) or fp32 elements."""

    def __init__(self, bf16: bool):
        self.cutlass, self.cute = dsl()
        self.bf16 = bf16

    def umax(self, a, b):
        return self.cute.arch.inline_ptx("max.u32 {$w0}, {$r0}, {$r1};",
                                         write_only_types=[self.cutlass.Uint32], read_only_args=[a, b])

    def wmax(self, a, b):
        """Per-element max of two amax words (already |x| bits): u16 pairs for bf16
        (``max.u16x2``: a whole-word ``max.u32`` would pick both halves from the word with
        the larger high half), one u32 for fp32."""
        if not self.bf16:
            return self.umax(a, b)
        return self.cute.arch.inline_ptx("max.u16x2 {$w0}, {$r0}, {$r1};",
                                         write_only_types=[self.cutlass.Uint32], read_only_args=[a, b])

    def amax_acc(self, acc, w):
        """Running max of |x| bits (``acc`` None: start); bf16 words hold two elements,
        compared as u16 pairs."""
        Uint32 = self.cutlass.Uint32
        if self.bf16:
            w = w & Uint32(0x7FFF7FFF)
            if acc is None:
                return w
            return self.wmax(acc, w)
        w = w & Uint32(0x7FFFFFFF)
        return w if acc is None else self.umax(acc, w)

    def row_loads(self, x, n, threads: int, unroll: int):
        """Row kernels (``threads`` per CTA, x viewed as [n, 4] words): ``(lane, base, vs)``,
        chunk ``base + 32 u`` of this thread loaded into ``vs[u]`` (u < ``unroll``, all loads
        issued first). Out-of-range lanes reload the last chunk (whole blocks of lanes, so
        the shuffles mix only valid or only clamped data) and must store nothing."""
        cutlass, cute = self.cutlass, self.cute
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % 32
        base = (bid * threads + tid - lane) * unroll + lane
        vs = []
        for u in range(unroll):
            i = cutlass.min(base + u * 32, n - 1)
            vs.append(x[i, None].load())
        return lane, base, vs

    def block_amax(self, v, lanes: int, fp32_bits: bool):
        """amax bits of a block held by ``lanes`` adjacent lanes (butterfly shuffles), chunk
        ``v`` (4 words) each; for bf16 the 16-bit pattern, or with ``fp32_bits`` shifted to
        the fp32 one before the shuffles."""
        Uint32 = self.cutlass.Uint32
        acc = None
        for j in range(4):
            acc = self.amax_acc(acc, v[j])
        a = acc
        if self.bf16:
            a = self.umax(acc & Uint32(0xFFFF), acc >> 16)
            if fp32_bits:
                a = a << 16
        for k in range(lanes.bit_length() - 1):
            a = self.umax(a, self.cute.arch.shuffle_sync_bfly(a, offset=1 << k))
        return a

    def mx_block(self, v, lanes: int):
        """MXFP8 of one 16-byte chunk ``v`` whose 32-element block spans ``lanes`` adjacent
        lanes (butterfly amax): ``(data words, scale byte)``, the ops of
        ``reference.mxfp8_quantize`` (every lane of the block computes the same byte)."""
        a = self.block_amax(v, lanes, fp32_bits=False)
        sc, byte, nf = self.e8m0(self.cutlass.Int32(a) << 16 if self.bf16 else self.cutlass.Int32(a))
        c = 8 if self.bf16 else 4
        return self.fp8_words(self.elems(v), [sc] * c, [nf] * (c // 4)), byte

    def column_amax(self, vs):
        """The 4 running-max words (per word position) over the rows' chunks ``vs``."""
        accs = [None] * 4
        for v in vs:
            for j in range(4):
                accs[j] = self.amax_acc(accs[j], v[j])
        return accs

    def e8m0(self, A):
        """MXFP8 scale of amax fp32 bits ``A`` (Int32): ``(2^-e fp32 bits, scale byte, nonfinite
        mask)``; byte = max(E - 8 + [mantissa > 0x600000], 0), 0xFF for NaN/Inf."""
        cutlass, Int32, Uint32 = self.cutlass, self.cutlass.Int32, self.cutlass.Uint32
        b = cutlass.max((A >> 23) - 8 + Int32((A & 0x7FFFFF) > 0x600000), 0)
        nonfinite = Uint32(0) - Uint32(A >= 0x7F800000)  # 0xFFFFFFFF or 0
        # b <= 247 for finite input, so 254 - b is a normal exponent field (>= 7).
        return Uint32((254 - b) << 23), (Uint32(b) | nonfinite) & Uint32(0xFF), nonfinite

    def fp8x4(self, f, s, nan_mask):
        """e4m3(f[i] * s[i]) for 4 fp32 bit patterns -> one word (f[0] in the low byte), with
        ``mul.rn.f32`` (no FTZ) and ``cvt.rn.satfinite``; bytes selected by ``nan_mask`` become
        0x7F."""
        Uint32 = self.cutlass.Uint32
        q = self.cute.arch.inline_ptx(
            "{ .reg .b32 p0, p1, p2, p3; .reg .b16 lo, hi;\n"
            "mul.rn.f32 p0, {$r0}, {$r4};\n"
            "mul.rn.f32 p1, {$r1}, {$r5};\n"
            "mul.rn.f32 p2, {$r2}, {$r6};\n"
            "mul.rn.f32 p3, {$r3}, {$r7};\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, p1, p0;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, p3, p2;\n"
            "mov.b32 {$w0}, {lo, hi}; }",
            write_only_types=[Uint32], read_only_args=[*f, *s])
        return (q & ~nan_mask) | (Uint32(0x7F7F7F7F) & nan_mask)

    def fp8_words(self, f, scales, masks):
        """Register tensor of ``len(f) / 4`` words: word w = :meth:`fp8x4` of ``f[4w:4w+4]``
        times ``scales[4w:4w+4]`` (fp32 bit patterns), NaN bytes from ``masks[w]``."""
        o = self.cute.make_rmem_tensor((len(f) // 4,), self.cutlass.Uint32)
        for w in range(len(f) // 4):
            o[w] = self.fp8x4(f[4 * w:4 * w + 4], scales[4 * w:4 * w + 4], masks[w])
        return o

    def elems(self, v):
        """The fp32 bit patterns (8 for bf16, 4 for fp32) of a 16-byte chunk's 4 input words
        (a list or a TensorSSA)."""
        words = [v[j] for j in range(4)]  # (a TensorSSA is not iterable)
        if not self.bf16:
            return words
        out = []
        for w in words:
            out += [w << 16, w & self.cutlass.Uint32(0xFFFF0000)]
        return out

    def scale_bits(self, byte):
        """fp32 bits of the E8M0 multiplier 2^(byte - 127) (byte 0: the subnormal 2^-127;
        0xFF: NaN)."""
        cutlass, Uint32 = self.cutlass, self.cutlass.Uint32
        b = Uint32(byte)
        bits = b << 23
        bits = cutlass.select_(b == Uint32(0), Uint32(0x00400000), bits)
        return cutlass.select_(b == Uint32(0xFF), Uint32(0x7FC00000), bits)

    def deq4(self, word, s):
        """fp32 bit patterns of the 4 e4m3 bytes of ``word`` (byte 0 first) times the fp32
        multipliers ``s`` (exact: e4m3 -> f16 is exact, f16 -> f32 too, the product fits)."""
        return self.cute.arch.inline_ptx(
            "{ .reg .b16 lo, hi, e0, e1, e2, e3; .reg .b32 h0, h1, f0, f1, f2, f3;\n"
            "mov.b32 {lo, hi}, {$r0};\n"
            "cvt.rn.f16x2.e4m3x2 h0, lo;\n"
            "cvt.rn.f16x2.e4m3x2 h1, hi;\n"
            "mov.b32 {e0, e1}, h0;\n"
            "mov.b32 {e2, e3}, h1;\n"
            "cvt.f32.f16 f0, e0;\n"
            "cvt.f32.f16 f1, e1;\n"
            "cvt.f32.f16 f2, e2;\n"
            "cvt.f32.f16 f3, e3;\n"
            "mul.rn.f32 {$w0}, f0, {$r1};\n"
            "mul.rn.f32 {$w1}, f1, {$r2};\n"
            "mul.rn.f32 {$w2}, f2, {$r3};\n"
            "mul.rn.f32 {$w3}, f3, {$r4}; }",
            write_only_types=[self.cutlass.Uint32] * 4, read_only_args=[word, *s])

    def deq_bf16(self, words, s, o, each=None):
        """bf16x2 words of register tensor ``o`` (2 per input word) = the e4m3 ``words`` (4 bytes
        each) times the fp32 multipliers ``s`` (4 per word), rounded to bf16; ``each(products)``
        is called after each word's (e.g. to count inexact ones)."""
        for w in range(len(words)):
            ps = self.deq4(words[w], s[4 * w:4 * w + 4])
            o[2 * w] = self.bf16x2(ps[0], ps[1])
            o[2 * w + 1] = self.bf16x2(ps[2], ps[3])
            if each is not None:
                each(ps)

    def mx_round_trip(self, v, lanes: int):
        """bf16 chunk (4 bf16x2 words, a register tensor) of one 16-byte bf16 chunk ``v`` after
        the MXFP8 quantize (:meth:`mx_block`, 32-element block over ``lanes`` adjacent lanes)
        and the dequantize back: bitwise the round-trip kernel of :mod:`dequant_mxfp8`."""
        q, byte = self.mx_block(v, lanes)
        o = self.cute.make_rmem_tensor((4,), self.cutlass.Uint32)
        self.deq_bf16([q[0], q[1]], [self.scale_bits(byte)] * 8, o)
        return o

    def bf16x2(self, p0, p1):
        """bf16 pair (p0 in the low half) of two fp32 bit patterns, round to nearest even."""
        return self.cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};",
                                         write_only_types=[self.cutlass.Uint32], read_only_args=[p0, p1])

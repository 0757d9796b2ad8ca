"""Device check: per-element-scaled SM90 FP8 GEMMs (mok_cute.kernels.sm90.fp8_scaled).

fp8_block wgrad (``grouped_wgrad_fp8_block``) vs ``reference.grouped_wgrad(a, b, offsets,
"fp8_block")``, per routing (uniform / skewed: one hot expert, empty experts, counts not
multiples of 128), 8 experts: token rows a, b with one random power-of-two magnitude per
(64-token block, feature) (so a wrong slot or feature scale index shows); operands quantized
by ``quantize_fp8.quantize_tokens`` (checked bitwise == reference.fp8_block_quantize_tokens
on the same GPU tensor); cases: dWg / dWu from the two feature halves of one quantized
dgu [M, 2I] (row slices of data_t, strided column slices of the scales, read in place) and
a direct Na = 320 (not a multiple of 128) x Nb = 256. Outputs NaN-poisoned, 5 repeats
bitwise, rel-L1 <= 1e-2 and finite, empty experts exactly zero, the masked-store epilogue
(process-wide TMA store off) bitwise equal to the TMA-store one, and an extra expert slot
past the output's end untouched.

MXFP8 per-32 promotion (``grouped_gemm_mxfp8_promoted``, tile_n 64 and 128) vs
``reference.grouped_gemm(a, offsets, w, "mxfp8")`` with the same quantization
(``reference.mxfp8_quantize`` along K), K = 1024, N = 512, magnitudes 2^[-8, 8] per
(row, 32-block): NaN-poisoned, 5 repeats bitwise, rel-L1 <= 1e-2, finite, tile_n 64 ==
tile_n 128 bitwise (same per-element arithmetic, same order). Plus a scale-edge row: random
e4m3 data with random scale bytes (0 = 2^-127 included, sums within the exact range) and
one 0xFF block, vs the reference's own dequantization (fp64 products): the 0xFF row is NaN
everywhere and only there; other rows per-row rel-L1 <= 1e-2.

Timed (8 experts x 4096 rows): wgrad Na = H = 7168, Nb = I = 2048 beside the BF16
``sm90_expert_bwd.grouped_wgrad``; MXFP8 promoted at K = 7168, N = 4096 (tile_n 64 and 128)
beside the BF16 ``sm90_grouped_gemm.grouped_gemm`` (TFLOP/s in the note).
"""
from __future__ import annotations

import torch

from checks.common import Row, bench_us, seeded, sm90_skip
from checks.gemm_sm90 import SENTINEL, _counts, _errors, _guarded, _offsets, _poisoned, _row, nonfinite_where

REPEATS = 5
E = 8  # must match gemm_sm90._counts
I_HALF, H_W = 256, 384  # wgrad: dgu [M, 2 I], x [M, H]
K_MX, N_MX = 1024, 512
BENCH_WGRAD = (8, 4096, 7168, 2048)  # experts, rows per expert, Na, Nb
BENCH_MX = (8, 4096, 7168, 4096)  # experts, rows per expert, K, N


def _rows(r) -> list[Row]:
    return r if isinstance(r, list) else [r]


def _varied(m: int, n: int, block: int, lo: int, hi: int, dev) -> torch.Tensor:
    """randn [m, n] times 2^randint[lo, hi] per (``block`` rows, column), bf16."""
    mag = torch.exp2(torch.randint(lo, hi + 1, (-(-m // block), n), device=dev).float())
    return (torch.randn(m, n, device=dev) * mag.repeat_interleave(block, 0)[:m]).bfloat16()


def _varied_k(m: int, k: int, lo: int, hi: int, dev) -> torch.Tensor:
    """randn [m, k] times 2^randint[lo, hi] per (row, 32-column block), bf16."""
    mag = torch.exp2(torch.randint(lo, hi + 1, (m, k // 32), device=dev).float())
    return (torch.randn(m, k, device=dev) * mag.repeat_interleave(32, 1)).bfloat16()


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    v = (lambda t: t.contiguous().view(torch.int32)) if x.dtype == torch.float32 else (
        lambda t: t.contiguous().view(torch.uint8))
    return torch.equal(v(x), v(y))


def _empty_zero(out, counts) -> bool:
    return all(bool((out[e] == 0).all()) for e, c in enumerate(counts) if c == 0)


def _wgrad_case(S, gg, dev, name, a_q, b_q, offs, counts, want):
    """Run the wgrad ``REPEATS`` times into NaN-poisoned outputs (heads of a buffer whose
    extra expert slot holds SENTINEL, which must survive), with the process-wide TMA-store
    epilogue setting as it is, then once with the masked-store epilogue (must be bitwise
    equal); one Row."""
    (a_t, sa), (b_t, sb) = a_q, b_q
    shape = (E, a_t.shape[0], b_t.shape[0])
    outs, tails = [], []
    for i in range(REPEATS + 1):
        big = torch.full((E + 1,) + shape[1:], SENTINEL, dtype=torch.bfloat16, device=dev)
        out = big[:E]
        out.fill_(float("nan"))
        tails.append(big[E])
        prev = gg.set_tma_store(False) if i == REPEATS else None
        try:
            outs.append(S.grouped_wgrad_fp8_block(a_t, sa, b_t, sb, offs, out=out))
        finally:
            if prev is not None:
                gg.set_tma_store(prev)
    torch.cuda.synchronize()
    masked = outs.pop()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    same_masked = torch.equal(outs[0], masked)
    tail_ok = all(bool((t == SENTINEL).all()) for t in tails)
    zeros = _empty_zero(outs[0], counts)
    per_e = []
    for e in range(E):
        _, rel, fin = _errors(outs[0][e], want[e])
        if rel > 1e-2 or not fin:
            per_e.append(f"e{e}: relL1={rel:.1e} finite={fin} {nonfinite_where('out', outs[0][e])}")
    row = _row(name, [outs[0].flatten(0, 1)], [want.flatten(0, 1)], same,
               f"empty experts zero={zeros} masked-store epilogue bitwise={same_masked} past-end untouched={tail_ok} "
               f"Na={shape[1]} Nb={shape[2]} counts={counts} {'; '.join(per_e)[:300]}")
    row.ok = row.ok and zeros and same_masked and tail_ok
    return row


def _check_wgrad(S, qf, ref, gg, dev, routing):
    gen = torch.Generator().manual_seed(7 if routing == "uniform" else 8)
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    dgu = _varied(m, 2 * I_HALF, 64, -5, 5, dev)
    x = _varied(m, H_W, 64, -5, 5, dev)
    q_dgu = qf.quantize_tokens(dgu, offs, "fp8_block")
    q_x = qf.quantize_tokens(x, offs, "fp8_block")
    r_dgu = ref.fp8_block_quantize_tokens(dgu, offs)
    q_ok = _bits_equal(q_dgu[0].view(torch.uint8), r_dgu[0].view(torch.uint8)) and _bits_equal(q_dgu[1], r_dgu[1])
    rows = [Row(f"fp8 tokens quantize {routing}: kernel == ref", bitwise=q_ok, ok=q_ok,
                note=f"dgu [M={m}, {2 * I_HALF}] data_t {tuple(q_dgu[0].shape)} scales {tuple(q_dgu[1].shape)}")]
    (d_t, d_s) = q_dgu
    for label, cols in (("dWg", slice(0, I_HALF)), ("dWu", slice(I_HALF, 2 * I_HALF))):
        want = ref.grouped_wgrad(dgu[:, cols], x, offs, "fp8_block")
        rows.append(_guarded(f"fp8 wgrad {label} {routing}", _wgrad_case, S, gg, dev,
                             f"fp8 wgrad {label} (slices) {routing}", (d_t[cols], d_s[:, cols]), q_x, offs,
                             counts, want))
    a = _varied(m, 320, 64, -5, 5, dev)
    b = _varied(m, 256, 64, -5, 5, dev)
    want = ref.grouped_wgrad(a, b, offs, "fp8_block")
    rows.append(_guarded(f"fp8 wgrad Na=320 {routing}", _wgrad_case, S, gg, dev, f"fp8 wgrad Na=320 {routing}",
                         qf.quantize_tokens(a, offs, "fp8_block"), qf.quantize_tokens(b, offs, "fp8_block"),
                         offs, counts, want))
    return rows


def _mx_weights(ref, w):
    parts = [ref.mxfp8_quantize(w[e], -1) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _check_mx(S, ref, dev, routing, cfgs):
    gen = torch.Generator().manual_seed(9 if routing == "uniform" else 10)
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    a = _varied_k(m, K_MX, -8, 8, dev).cpu()
    w = (_varied_k(E * N_MX, K_MX, -8, 8, dev).float() * K_MX ** -0.5).bfloat16().view(E, N_MX, K_MX).cpu()
    # reference on the CPU (its MXFP8 dequantizer builds its NaN fill on the CPU)
    qa, sa = (t.to(dev) for t in ref.mxfp8_quantize(a, -1))
    qw, sw = (t.to(dev) for t in _mx_weights(ref, w))
    want = ref.grouped_gemm(a, offs.cpu(), w, "mxfp8").to(dev)
    rows, firsts = [], []
    for cfg in cfgs:
        def run():
            outs = []
            for _ in range(REPEATS):
                (out,) = _poisoned((m, N_MX), device=dev)
                outs.append(S.grouped_gemm_mxfp8_promoted(qa, sa, offs, qw, sw, out=out, cfg=cfg))
            torch.cuda.synchronize()
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            firsts.append(outs[0])
            return _row(f"mxfp8 promoted n{cfg.tile_n} {routing}", [outs[0]], [want], same,
                        f"M={m} K={K_MX} N={N_MX} counts={counts}")
        rows.append(_guarded(f"mxfp8 promoted n{cfg.tile_n} {routing}", run))
    if len(firsts) == 2:
        same = torch.equal(firsts[0], firsts[1])
        rows.append(Row(f"mxfp8 promoted n{cfgs[0].tile_n} == n{cfgs[1].tile_n} {routing}", bitwise=same, ok=same))
    return rows


def _random_e4m3(shape, dev, gen):
    """Random finite e4m3 bytes (0x7F / 0xFF are NaN: replaced by 0x7E / 0xFE)."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    return b.to(dev).view(torch.float8_e4m3fn)


def _check_mx_scale_edges(S, ref, dev):
    """Arbitrary scale bytes: 0 (2^-127, subnormal factor side), wide range, one 0xFF block."""
    gen = torch.Generator().manual_seed(11)
    counts = [300, 0, 129, 33, 0, 500, 1, 64]
    m = sum(counts)
    offs = _offsets(counts, dev)
    k, n = 512, 256
    qa = _random_e4m3((m, k), dev, gen)
    qw = _random_e4m3((E, n, k), dev, gen)
    sa = torch.randint(100, 161, (m, k // 32), generator=gen, dtype=torch.uint8)
    sa[torch.rand(m, k // 32, generator=gen) < 0.05] = 0  # 2^-127 blocks (sum with sw >= 110)
    sw = torch.randint(110, 201, (E, n, k // 32), generator=gen, dtype=torch.uint8)
    nan_row = 5
    sa[nan_row, 3] = 0xFF
    deq_a = ref.mxfp8_dequantize(qa.cpu(), sa, -1).double()  # reference dequantizer on the CPU
    want = torch.zeros(m, n, dtype=torch.float64)
    lo = 0
    for e, c in enumerate(counts):
        if c:
            want[lo:lo + c] = deq_a[lo:lo + c] @ ref.mxfp8_dequantize(qw[e].cpu(), sw[e], -1).double().t()
        lo += c
    want = want.float().bfloat16().to(dev)
    sa, sw = sa.to(dev), sw.to(dev)
    outs = []
    for _ in range(REPEATS):
        (out,) = _poisoned((m, n), device=dev)
        outs.append(S.grouped_gemm_mxfp8_promoted(qa, sa, offs, qw, sw, out=out))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs[1:])
    got = outs[0].float()
    nan_rows = (~torch.isfinite(got)).any(1).nonzero().flatten().tolist()
    all_nan_row = bool(torch.isnan(got[nan_row]).all())
    keep = torch.ones(m, dtype=torch.bool, device=dev)
    keep[nan_row] = False
    g, r = got[keep], want[keep].float()
    per_row = (g - r).abs().sum(1) / r.abs().sum(1).clamp_min(1e-30)
    worst = float(per_row.max())
    ok = same and nan_rows == [nan_row] and all_nan_row and worst <= 1e-2
    return Row("mxfp8 promoted scale edges (0, 0xFF, wide)", max_err=worst, bitwise=same, ok=ok,
               note=f"nonfinite rows {nan_rows[:8]} (want [{nan_row}], all NaN={all_nan_row}); "
                    f"worst per-row relL1 {worst:.1e} (row {int(per_row.argmax())}); M={m} K={k} N={n}")


def _bench_wgrad(S, qf, bwd, gg, dev):
    e, rows, na, nb = BENCH_WGRAD
    m = e * rows
    offs = _offsets([rows] * e, dev)
    a = torch.randn(m, na, device=dev).bfloat16()
    b = torch.randn(m, nb, device=dev).bfloat16()
    a_t, sa = qf.quantize_tokens(a, offs, "fp8_block")
    b_t, sb = qf.quantize_tokens(b, offs, "fp8_block")
    out8 = torch.empty(e, na, nb, dtype=torch.bfloat16, device=dev)
    out16 = torch.empty(e, na, nb, dtype=torch.bfloat16, device=dev)
    t8 = bench_us(lambda: S.grouped_wgrad_fp8_block(a_t, sa, b_t, sb, offs, out=out8))
    tma = gg.set_tma_store(False)
    try:
        t8m = bench_us(lambda: S.grouped_wgrad_fp8_block(a_t, sa, b_t, sb, offs, out=out8))
    finally:
        gg.set_tma_store(tma)
    t16 = bench_us(lambda: bwd.grouped_wgrad(a, b, offs, out=out16))
    tq = bench_us(lambda: (qf.quantize_tokens(a, offs, "fp8_block"), qf.quantize_tokens(b, offs, "fp8_block")))
    torch.cuda.synchronize()
    flops = 2.0 * m * na * nb
    finite = bool(torch.isfinite(out8.float()).all())
    _, rel, _ = _errors(out8, out16)
    ok = finite and rel <= 0.1
    return Row(f"bench fp8_block wgrad {e}x{rows} Na={na} Nb={nb}", time_us=t8, ok=ok,
               note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 wgrad {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                    f"speedup bf16/fp8 {t16 / t8:.2f}x; TMA-store epilogue={tma} (masked stores: {t8m:.1f} us); "
                    f"+quantize a,b {tq:.1f} us; finite={finite} "
                    f"relL1 vs bf16 {rel:.1e}")


def mx_bench_problem(ref, dev, shape):
    """(m, offs, a, w, (qa, sa), (qw, sw)) of an MXFP8 GEMM benchmark: ``shape`` = (experts, rows per
    expert, K, N), bf16 a [M, K] and w [E, N, K] random, quantized along K by the reference."""
    e, rows, k, n = shape
    m = e * rows
    a = torch.randn(m, k, device=dev).bfloat16()
    w = (torch.randn(e, n, k, device=dev) * k ** -0.5).bfloat16()
    # on the GPU (the quantizer is device-independent)
    return m, _offsets([rows] * e, dev), a, w, ref.mxfp8_quantize(a, -1), _mx_weights(ref, w)


def _bench_mx(S, ref, gg, dev, cfgs):
    e, rows, k, n = BENCH_MX
    m, offs, a, w, (qa, sa), (qw, sw) = mx_bench_problem(ref, dev, BENCH_MX)
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    t16 = bench_us(lambda: gg.grouped_gemm(a, offs, w, out=out16))
    flops = 2.0 * m * k * n
    res = []
    for cfg in cfgs:
        out8 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        t8 = bench_us(lambda: S.grouped_gemm_mxfp8_promoted(qa, sa, offs, qw, sw, out=out8, cfg=cfg))
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out8.float()).all())
        _, rel, _ = _errors(out8, out16)
        res.append(Row(f"bench mxfp8 promoted n{cfg.tile_n} {e}x{rows} K={k} N={n}", time_us=t8,
                       ok=finite and rel <= 0.1,
                       note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 plain {t16:.1f} us {flops / t16 / 1e6:.0f} "
                            f"TFLOP/s; speedup bf16/mxfp8 {t16 / t8:.2f}x; finite={finite} relL1 vs bf16 {rel:.1e}"))
    return res


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_fp8_scaled"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels.quant import quantize_fp8 as qf  # noqa: PLC0415
    from mok_cute.kernels.sm90 import expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels.sm90 import fp8_scaled as S  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415
    from mok_cute.dsl.compile import cache_stats  # noqa: PLC0415

    dev = ctx.device
    seeded(2468)
    cfgs = [S.Fp8MainloopConfig(tile_n=64), S.Fp8MainloopConfig(tile_n=128)]
    rows = _rows(_guarded("fp8 wgrad uniform", _check_wgrad, S, qf, ref, gg, dev, "uniform"))
    rows += _rows(_guarded("mxfp8 promoted uniform", _check_mx, S, ref, dev, "uniform", cfgs))
    compiles = cache_stats()["compiles"]
    rows += _rows(_guarded("fp8 wgrad skewed", _check_wgrad, S, qf, ref, gg, dev, "skewed"))
    rows += _rows(_guarded("mxfp8 promoted skewed", _check_mx, S, ref, dev, "skewed", cfgs))
    rows.append(_guarded("mxfp8 scale edges", _check_mx_scale_edges, S, ref, dev))
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("fp8 scaled: no recompile for new counts", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows += _rows(_guarded("bench fp8_block wgrad", _bench_wgrad, S, qf, bwd, gg, dev))
    rows += _rows(_guarded("bench mxfp8 promoted", _bench_mx, S, ref, gg, dev, cfgs))
    return rows

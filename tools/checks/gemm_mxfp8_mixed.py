"""Device check: mixed-input MXFP8 grouped GEMM (mok_cute.kernels.sm90.mxfp8_act_gemm: MXFP8
activations x bf16 weights).

Contract under test: ``grouped_gemm_mxfp8_mixed(a, sa, offsets, w)`` is BITWISE
``sm90_grouped_gemm.grouped_gemm(deq_a, offsets, w)`` with deq_a made on the device by
``dequant_mxfp8.dequantize_mxfp8`` (same bf16 tiles, same wgmma k-order, same epilogue). The
bf16 weight w is an MXFP8 weight dequantized on the device (deq_w), as the layer's weight
cache makes it.

Per routing (8 experts, uniform / skewed: one hot expert, two empty ones, counts not multiples
of 128), K = 1024, N = 512, magnitudes 2^[-8, 8] per (row, 32-block), operands quantized by
``reference.mxfp8_quantize`` along K: NaN-poisoned outputs whose buffer tail past M holds a
sentinel (must survive), 5 repeats bitwise, bitwise == grouped_gemm on the dequantized
operands (mismatch count, first bad row / col / expert in the note), rel-L1 <= 1e-2 vs
``reference.grouped_gemm(a, offsets, w, "mxfp8")``, int64 offsets and the masked-store
epilogue (process-wide TMA store off) bitwise equal to the first result.

Scale edges: random finite e4m3 bytes with scale bytes 0 (2^-127), a wide range (A 20..60,
W 150..230), one A block 0xFF (that row NaN), one A row at 254 (2^127: products overflow),
one W (expert, column, block) 0xFF (that column of deq_w NaN for the expert's rows): 5 runs,
bitwise == grouped_gemm on the dequantized operands everywhere (NaN / Inf included, compared as
bits), non-finite exactly where expected, per-row rel-L1 <= 1e-2 vs the fp64 product of the
reference's dequantized operands elsewhere.

Timed (8 experts x 4096 rows, K = 7168, N = 4096): mixed vs the BF16 ``grouped_gemm`` (on bf16
operands) vs dequantize-both-then-BF16-GEMM, TFLOP/s and ratios in the note; the timed result is
also checked bitwise against the BF16 GEMM on the dequantized operands.
"""
from __future__ import annotations

import bisect

import torch

from checks.common import Row, bench_us, seeded, sm90_skip
from checks.gemm_sm90 import E, _counts, _errors, _guarded, _guarded_out, _offsets, _poisoned, _tail_ok

REPEATS = 5
K_MX, N_MX = 1024, 512
BENCH = (8, 4096, 7168, 4096)  # experts, rows per expert, K, N
REL_TOL = 1e-2


def _mx_weights(ref, w):
    parts = [ref.mxfp8_quantize(w[e], -1) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _random_e4m3(shape, dev, gen):
    """Random finite e4m3 bytes (0x7F / 0xFF are NaN: replaced by 0x7E / 0xFE)."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    return b.to(dev).view(torch.float8_e4m3fn)


def mx_bench_problem(ref, dev, shape):
    """(m, offs, a, w, (qa, sa), (qw, sw)) of an MXFP8 GEMM benchmark: ``shape`` = (experts, rows per
    expert, K, N), bf16 a [M, K] and w [E, N, K] random, quantized along K by the reference."""
    e, rows, k, n = shape
    m = e * rows
    a = torch.randn(m, k, device=dev).bfloat16()
    w = (torch.randn(e, n, k, device=dev) * k ** -0.5).bfloat16()
    # on the GPU (the quantizer is device-independent)
    return m, _offsets([rows] * e, dev), a, w, ref.mxfp8_quantize(a, -1), _mx_weights(ref, w)


def _varied_k(m: int, k: int, lo: int, hi: int, dev) -> torch.Tensor:
    """randn [m, k] times 2^randint[lo, hi] per (row, 32-column block), bf16."""
    mag = torch.exp2(torch.randint(lo, hi + 1, (m, k // 32), device=dev).float())
    return (torch.randn(m, k, device=dev) * mag.repeat_interleave(32, 1)).bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _diff(x: torch.Tensor, y: torch.Tensor, offs: list[int]) -> tuple[bool, str]:
    """(bitwise equal, note: mismatch count, first bad row / col / expert and its values)."""
    bad = _bits(x) != _bits(y)
    n = int(bad.sum())
    if n == 0:
        return True, "mismatches 0"
    rows, cols = bad.nonzero(as_tuple=True)
    r, c = int(rows[0]), int(cols[0])
    e = bisect.bisect_right(offs, r) - 1
    return False, (f"mismatches {n} in {int(rows.unique().numel())} rows / {int(cols.unique().numel())} cols; "
                   f"first row {r} (expert {e}, local {r - offs[e]}, m-tile {(r - offs[e]) // 128}) col {c} "
                   f"(n-tile {c // 256}): {float(x[r, c])} vs {float(y[r, c])}")


def _dequantized(dq, qa, sa, qw, sw):
    """bf16 operands from the device dequantize kernel (the values the mixed kernel makes)."""
    e, n, k = qw.shape
    deq_a = dq.dequantize_mxfp8(qa, sa)
    deq_w = dq.dequantize_mxfp8(qw.view(e * n, k), sw.view(e * n, k // 32)).view(e, n, k)
    return deq_a, deq_w


def _act_rows(X, qa, sa, offs, deq_w, base, offs_l, shape, dev, name):
    """The mixed GEMM with W = the dequantized weight ``deq_w``: 5 runs on
    poisoned, guarded outputs, each bitwise == ``base`` (the BF16 GEMM on the dequantized
    operands; NaN / Inf compared as bits); ``(row, first output)``."""
    outs, tails = [], []
    for _ in range(REPEATS):
        out, tail = _guarded_out(shape, dev)
        outs.append(X.grouped_gemm_mxfp8_mixed(qa, sa, offs, deq_w, out=out))
        tails.append(tail)
    torch.cuda.synchronize()
    same = all(torch.equal(_bits(outs[0]), _bits(o)) for o in outs[1:])
    vs_bf16, note = _diff(outs[0], base, offs_l)
    ok = same and vs_bf16 and _tail_ok(tails)
    return Row(f"mxfp8 mixed bf16-W == bf16 gemm(deq) {name}", bitwise=same and vs_bf16, ok=ok,
               note=f"{note}; repeats bitwise={same}"), outs[0]


def _check_routing(X, gg, dq, ref, dev, routing):
    gen = torch.Generator().manual_seed(31 if routing == "uniform" else 32)
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    offs_l = offs.tolist()
    a = _varied_k(m, K_MX, -8, 8, dev).cpu()
    w = (_varied_k(E * N_MX, K_MX, -8, 8, dev).float() * K_MX ** -0.5).bfloat16().view(E, N_MX, K_MX).cpu()
    qa, sa = (t.to(dev) for t in ref.mxfp8_quantize(a, -1))
    qw, sw = (t.to(dev) for t in _mx_weights(ref, w))
    want = ref.grouped_gemm(a, offs.cpu(), w, "mxfp8").to(dev)  # reference on the CPU (its NaN fill)
    deq_a, deq_w = _dequantized(dq, qa, sa, qw, sw)
    (base,) = _poisoned((m, N_MX), device=dev)
    gg.grouped_gemm(deq_a, offs, deq_w, out=base)
    act, first = _act_rows(X, qa, sa, offs, deq_w, base, offs_l, (m, N_MX), dev, routing)
    out64, tail64 = _guarded_out((m, N_MX), dev)
    X.grouped_gemm_mxfp8_mixed(qa, sa, offs.long(), deq_w, out=out64)
    prev = gg.set_tma_store(False)
    try:
        masked, tail_m = _guarded_out((m, N_MX), dev)
        X.grouped_gemm_mxfp8_mixed(qa, sa, offs, deq_w, out=masked)
    finally:
        gg.set_tma_store(prev)
    torch.cuda.synchronize()
    same64, _ = _diff(out64, first, offs_l)
    same_masked, note_masked = _diff(masked, first, offs_l)
    tails_ok = _tail_ok([tail64, tail_m])
    max_abs, rel, finite = _errors(first, want)
    ok = same64 and same_masked and tails_ok and finite and rel <= REL_TOL
    return [
        act,
        Row(f"mxfp8 mixed bf16-W vs reference {routing}", max_err=max_abs, bitwise=same64 and same_masked, ok=ok,
            note=f"relL1={rel:.2e} (tol {REL_TOL}) finite={finite} int64 offsets bitwise={same64} masked-store "
                 f"epilogue bitwise={same_masked} ({note_masked}) past-M untouched={tails_ok}; M={m} K={K_MX} "
                 f"N={N_MX} counts={counts}"),
    ]


def _check_scale_edges(X, gg, dq, ref, dev):
    gen = torch.Generator().manual_seed(33)
    counts = [300, 0, 129, 33, 0, 500, 1, 64]
    m = sum(counts)
    offs = _offsets(counts, dev)
    offs_l = offs.tolist()
    k, n = 512, 256
    qa = _random_e4m3((m, k), dev, gen)
    qw = _random_e4m3((E, n, k), dev, gen)
    sa = torch.randint(20, 61, (m, k // 32), generator=gen, dtype=torch.uint8)
    sa[torch.rand(m, k // 32, generator=gen) < 0.05] = 0  # 2^-127 (deq rounds below 2^-133)
    sw = torch.randint(150, 231, (E, n, k // 32), generator=gen, dtype=torch.uint8)
    nan_row, big_row, nan_e, nan_col = 5, 7, 5, 17
    sa[nan_row, 3] = 0xFF
    sa[big_row] = 254
    sw[nan_e, nan_col, 2] = 0xFF
    deq_a_ref = ref.mxfp8_dequantize(qa.cpu(), sa, -1).double()
    want = torch.zeros(m, n, dtype=torch.float64)
    for e in range(E):
        lo, hi = offs_l[e], offs_l[e + 1]
        if hi > lo:
            want[lo:hi] = deq_a_ref[lo:hi] @ ref.mxfp8_dequantize(qw[e].cpu(), sw[e], -1).double().t()
    want = want.to(dev)
    sa, sw = sa.to(dev), sw.to(dev)
    deq_a, deq_w = _dequantized(dq, qa, sa, qw, sw)
    (base,) = _poisoned((m, n), device=dev)
    gg.grouped_gemm(deq_a, offs, deq_w, out=base)
    act, first = _act_rows(X, qa, sa, offs, deq_w, base, offs_l, (m, n), dev, "scale edges")
    got = first.float()
    expect_bad = torch.zeros(m, n, dtype=torch.bool, device=dev)
    expect_bad[nan_row] = True
    expect_bad[big_row] = True
    expect_bad[offs_l[nan_e]:offs_l[nan_e + 1], nan_col] = True
    bad = ~torch.isfinite(got)
    nan_ok = bool(torch.isnan(got[nan_row]).all()) and bool(
        torch.isnan(got[offs_l[nan_e]:offs_l[nan_e + 1], nan_col]).all())
    unexpected = int((bad & ~expect_bad).sum())
    big_bad = int(bad[big_row].sum())
    g = torch.where(expect_bad, 0.0, got).double()
    r = torch.where(expect_bad, 0.0, want)
    keep = torch.ones(m, dtype=torch.bool, device=dev)
    keep[[nan_row, big_row]] = False
    per_row = ((g - r).abs().sum(1) / r.abs().sum(1).clamp_min(1e-300))[keep]
    worst = float(per_row.max())
    worst_row = int(keep.nonzero().flatten()[int(per_row.argmax())])
    ok = nan_ok and unexpected == 0 and big_bad > 0 and worst <= REL_TOL
    return [
        act,
        Row("mxfp8 mixed bf16-W scale edges (0, 0xFF, 2^127)", max_err=worst, ok=ok,
            note=f"worst per-row relL1 {worst:.1e} (row {worst_row}); NaN where 0xFF={nan_ok}; "
                 f"non-finite outside the expected set {unexpected}; row {big_row} (2^127) non-finite {big_bad}/{n}; "
                 f"M={m} K={k} N={n}"),
    ]


def _bench(X, gg, dq, ref, dev):
    e, rows, k, n = BENCH
    m, offs, a, w, (qa, sa), (qw, sw) = mx_bench_problem(ref, dev, BENCH)
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    deq_a, deq_w = _dequantized(dq, qa, sa, qw, sw)
    out_act = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    t_act = bench_us(lambda: X.grouped_gemm_mxfp8_mixed(qa, sa, offs, deq_w, out=out_act))
    t16 = bench_us(lambda: gg.grouped_gemm(a, offs, w, out=out16))

    def dequant_then_gemm():
        da, dw = _dequantized(dq, qa, sa, qw, sw)
        gg.grouped_gemm(da, offs, dw, out=out16)

    t_dq = bench_us(dequant_then_gemm)
    gg.grouped_gemm(deq_a, offs, deq_w, out=out16)
    torch.cuda.synchronize()
    same, note = _diff(out_act, out16, offs.tolist())
    finite = bool(torch.isfinite(out_act.float()).all())
    tf = 2.0 * m * k * n / 1e6
    return Row(f"bench mxfp8 mixed {e}x{rows} K={k} N={n}", time_us=t_act, bitwise=same, ok=same and finite,
               note=f"bf16-W mixed {tf / t_act:.0f} TFLOP/s = {t16 / t_act:.2f}x bf16; bf16 {t16:.1f} us "
                    f"{tf / t16:.0f}; dequant x2 + bf16 {t_dq:.1f} us {tf / t_dq:.0f}, mixed/(dequant x2 + bf16) "
                    f"{t_dq / t_act:.2f}x; == bf16 gemm(deq): {note}; finite={finite}")


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_mxfp8_mixed"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels.quant import dequant_mxfp8 as dq  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415
    from mok_cute.kernels.sm90 import mxfp8_act_gemm as X  # noqa: PLC0415
    from mok_cute.dsl.compile import cache_stats  # noqa: PLC0415

    dev = ctx.device
    seeded(1357)
    rows = []
    for routing in ("uniform", "skewed"):
        res = _guarded(f"mxfp8 mixed {routing}", _check_routing, X, gg, dq, ref, dev, routing)
        rows += res if isinstance(res, list) else [res]
        if routing == "uniform":
            compiles = cache_stats()["compiles"]
    res = _guarded("mxfp8 mixed scale edges", _check_scale_edges, X, gg, dq, ref, dev)
    rows += res if isinstance(res, list) else [res]
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("mxfp8 mixed: no recompile for new counts", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows.append(_guarded("bench mxfp8 mixed", _bench, X, gg, dq, ref, dev))
    return rows

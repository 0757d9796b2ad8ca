"""Device check: per-element-scaled SM90 FP8 GEMM, the fp8_block wgrad (mok_cute.kernels.sm90.fp8_scaled).

fp8_block wgrad (``grouped_wgrad_fp8_block``) vs ``reference.grouped_wgrad(a, b, offsets,
"fp8_block")``, per routing (uniform / skewed: one hot expert, empty experts, counts not
multiples of 128), 8 experts: token rows a, b with one random power-of-two magnitude per
(64-token block, feature) (so a wrong slot or feature scale index shows); operands quantized
by ``quantize_fp8.quantize_tokens`` (checked bitwise == reference.fp8_block_quantize_tokens
on the same GPU tensor); cases: dWg / dWu from the two feature halves of one quantized
dgu [M, 2I] (row slices of data_t, strided column slices of the scales, read in place) and
a direct Na = 320 (not a multiple of 128) x Nb = 256. Outputs NaN-poisoned, 5 repeats
bitwise, rel-L1 <= 1e-2 and finite, empty experts exactly zero, and an extra expert slot
past the output's end untouched (the TMA-store epilogue's row bound).

Timed (8 experts x 4096 rows): wgrad Na = H = 7168, Nb = I = 2048 beside the BF16
``sm90_expert_bwd.grouped_wgrad`` (TFLOP/s in the note).
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded, sm90_skip
from tools.checks.gemm_sm90 import SENTINEL, _counts, _errors, _guarded, _offsets, _row, nonfinite_where

REPEATS = 5
E = 8  # must match gemm_sm90._counts
I_HALF, H_W = 256, 384  # wgrad: dgu [M, 2 I], x [M, H]
BENCH_WGRAD = (8, 4096, 7168, 2048)  # experts, rows per expert, Na, Nb


def _rows(r) -> list[Row]:
    return r if isinstance(r, list) else [r]


def _varied(m: int, n: int, block: int, lo: int, hi: int, dev) -> torch.Tensor:
    """randn [m, n] times 2^randint[lo, hi] per (``block`` rows, column), bf16."""
    mag = torch.exp2(torch.randint(lo, hi + 1, (-(-m // block), n), device=dev).float())
    return (torch.randn(m, n, device=dev) * mag.repeat_interleave(block, 0)[:m]).bfloat16()


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    v = (lambda t: t.contiguous().view(torch.int32)) if x.dtype == torch.float32 else (
        lambda t: t.contiguous().view(torch.uint8))
    return torch.equal(v(x), v(y))


def _empty_zero(out, counts) -> bool:
    return all(bool((out[e] == 0).all()) for e, c in enumerate(counts) if c == 0)


def _wgrad_case(S, dev, name, a_q, b_q, offs, counts, want):
    """Run the wgrad ``REPEATS`` times into NaN-poisoned outputs (heads of a buffer whose
    extra expert slot holds SENTINEL, which must survive); one Row."""
    (a_t, sa), (b_t, sb) = a_q, b_q
    shape = (E, a_t.shape[0], b_t.shape[0])
    outs, tails = [], []
    for _ in range(REPEATS):
        big = torch.full((E + 1,) + shape[1:], SENTINEL, dtype=torch.bfloat16, device=dev)
        out = big[:E]
        out.fill_(float("nan"))
        tails.append(big[E])
        outs.append(S.grouped_wgrad_fp8_block(a_t, sa, b_t, sb, offs, out=out))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    tail_ok = all(bool((t == SENTINEL).all()) for t in tails)
    zeros = _empty_zero(outs[0], counts)
    per_e = []
    for e in range(E):
        _, rel, fin = _errors(outs[0][e], want[e])
        if rel > 1e-2 or not fin:
            per_e.append(f"e{e}: relL1={rel:.1e} finite={fin} {nonfinite_where('out', outs[0][e])}")
    row = _row(name, [outs[0].flatten(0, 1)], [want.flatten(0, 1)], same,
               f"empty experts zero={zeros} past-end untouched={tail_ok} "
               f"Na={shape[1]} Nb={shape[2]} counts={counts} {'; '.join(per_e)[:300]}")
    row.ok = row.ok and zeros and tail_ok
    return row


def _check_wgrad(S, qf, ref, dev, routing):
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
        rows.append(_guarded(f"fp8 wgrad {label} {routing}", _wgrad_case, S, dev,
                             f"fp8 wgrad {label} (slices) {routing}", (d_t[cols], d_s[:, cols]), q_x, offs,
                             counts, want))
    a = _varied(m, 320, 64, -5, 5, dev)
    b = _varied(m, 256, 64, -5, 5, dev)
    want = ref.grouped_wgrad(a, b, offs, "fp8_block")
    rows.append(_guarded(f"fp8 wgrad Na=320 {routing}", _wgrad_case, S, dev, f"fp8 wgrad Na=320 {routing}",
                         qf.quantize_tokens(a, offs, "fp8_block"), qf.quantize_tokens(b, offs, "fp8_block"),
                         offs, counts, want))
    return rows


def _bench_wgrad(S, qf, bwd, dev):
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
    t16 = bench_us(lambda: bwd.grouped_wgrad(a, b, offs, out=out16))
    tq = bench_us(lambda: (qf.quantize_tokens(a, offs, "fp8_block"), qf.quantize_tokens(b, offs, "fp8_block")))
    torch.cuda.synchronize()
    flops = 2.0 * m * na * nb
    finite = bool(torch.isfinite(out8.float()).all())
    _, rel, _ = _errors(out8, out16)
    ok = finite and rel <= 0.1
    return Row(f"bench fp8_block wgrad {e}x{rows} Na={na} Nb={nb}", time_us=t8, ok=ok,
               note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 wgrad {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                    f"speedup bf16/fp8 {t16 / t8:.2f}x; "
                    f"+quantize a,b {tq:.1f} us; finite={finite} "
                    f"relL1 vs bf16 {rel:.1e}")


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_fp8_scaled"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels.quant import quantize_fp8 as qf  # noqa: PLC0415
    from mok_cute.kernels.sm90 import expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels.sm90 import fp8_scaled as S  # noqa: PLC0415
    from mok_cute.dsl.compile import cache_stats  # noqa: PLC0415

    dev = ctx.device
    seeded(2468)
    rows = _rows(_guarded("fp8 wgrad uniform", _check_wgrad, S, qf, ref, dev, "uniform"))
    compiles = cache_stats()["compiles"]
    rows += _rows(_guarded("fp8 wgrad skewed", _check_wgrad, S, qf, ref, dev, "skewed"))
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("fp8 scaled: no recompile for new counts", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows += _rows(_guarded("bench fp8_block wgrad", _bench_wgrad, S, qf, bwd, dev))
    return rows

"""Device check: MXFP8 -> BF16 dequantize kernels and the sm90 layer at precisions mxfp8 and
fp8_block (EP = 1).

Dequantize (mok_cute.kernels.quant.dequant_mxfp8) vs ``reference.mxfp8_dequantize(...).bfloat16()``
computed on the CPU: bitwise on every non-NaN element, NaN exactly where the reference has
NaN; inputs are random e4m3 bytes (NaN codes and -0 included) with random scale bytes over
0..255 plus whole rows / columns at the edge bytes 0, 1, 2, 3 and 0xFF; the inexact counter
must equal the number of finite reference values with nonzero low 16 fp32 bits. Layouts:
row [R, C/32], column [R/32, C], token-wise (``quantize_tokens(x, offsets, "mxfp8")`` with
empty experts, partial blocks and rows past offsets[E], scales overwritten with random bytes).

Round trips (``mxfp8_round_trip`` / ``_tokens``, what the sm90 mxfp8 path runs) vs
``reference.mx_round_trip`` / ``_mx_round_trip_groups`` and vs the two-pass quantize +
dequantize: bitwise (NaN-aware), inputs with row magnitudes down to 2^-128 (scale bytes 0..3)
and Inf / NaN blocks, counter (0: a bf16 round trip is exact); token-wise with empty experts
and a tail past offsets[E]; column-wise (the weight path, one group).

Layer: ``mok_cute.moe(backend="sm90")`` vs the reference backend at the same precision:
rel-L1 <= 2e-2 on y and every gradient, everything finite, d topk_w included; all outputs
bitwise equal over 5 repeats; uniform and skewed routing + shared expert, SwiGLU limit 4 on
one case.
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, sm90_skip
from tools.checks.layer_sm90 import OUT_NAMES, _problem

REL_L1, REPEATS = 2e-2, 5
EDGE = (0, 1, 2, 3, 0xFF)


def _ref_bf16(vals32: torch.Tensor):
    """(bf16 reference, NaN mask, expected inexact count) from fp32 reference values (CPU)."""
    bits = vals32.view(torch.int32)
    finite = torch.isfinite(vals32)
    return vals32.bfloat16(), torch.isnan(vals32), int(((bits & 0xFFFF) != 0)[finite].sum())


def _same(got: torch.Tensor, want: torch.Tensor, nan: torch.Tensor) -> tuple[bool, str]:
    """Bitwise on non-NaN elements, NaN where the reference is NaN; a note locating mismatches."""
    g = got.cpu()
    gnan = torch.isnan(g.float())
    bad = (g.view(torch.int16) != want.view(torch.int16)) & ~nan
    bad |= gnan != nan
    n = int(bad.sum())
    if not n:
        return True, "0 mismatches"
    r, c = bad.nonzero()[0].tolist()
    return False, (f"{n} mismatches, first at ({r},{c}) got {float(g[r, c])!r} want {float(want[r, c])!r}; "
                   f"rows {int(bad.any(1).sum())} cols {int(bad.any(0).sum())}")


def _random_mx(r, c, dim, dev, gen):
    data = torch.randint(0, 256, (r, c), generator=gen, dtype=torch.uint8)
    srows, scols = (r, c // 32) if dim == -1 else (r // 32, c)
    scales = torch.randint(0, 256, (srows, scols), generator=gen, dtype=torch.uint8)
    for i, b in enumerate(EDGE):  # whole scale rows at the edge bytes
        scales[i] = b
    return data.view(torch.float8_e4m3fn), scales


def _dequant_rows(ctx) -> list[Row]:
    from mok_cute import reference as R
    from mok_cute.layers import sm100 as S
    from mok_cute.kernels.quant import quantize_fp8
    from mok_cute.kernels.quant.dequant_mxfp8 import dequantize_mxfp8, dequantize_mxfp8_tokens

    dev, gen = ctx.device, torch.Generator().manual_seed(11)
    rows = []
    for dim, (r, c) in ((-1, (192, 544)), (0, (320, 528))):
        data, scales = _random_mx(r, c, dim, dev, gen)
        want, nan, n_inexact = _ref_bf16(R.mxfp8_dequantize(data, scales, dim))
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        got = dequantize_mxfp8(data.to(dev), scales.to(dev), dim, counter=cnt)
        plain = dequantize_mxfp8(data.to(dev), scales.to(dev), dim)
        ok, note = _same(got, want, nan)
        same_plain = torch.equal(got.view(torch.int16), plain.view(torch.int16))
        got_cnt = int(cnt.item())
        rows.append(Row(f"dequant mxfp8 {'row' if dim == -1 else 'col'} {r}x{c}", bitwise=ok and same_plain,
                        ok=ok and same_plain and got_cnt == n_inexact,
                        note=f"{note}; inexact {got_cnt} (want {n_inexact}); counter variant == plain: {same_plain}"))
    # token-wise layout
    m, n = 700, 136
    offs = torch.tensor([0, 150, 150, 181, 300, 300, 650], dtype=torch.int32)  # empty experts, rows 650.. unused
    x = (torch.randn(m, n, generator=gen) * torch.rand(m, 1, generator=gen) * 8).bfloat16()
    data_t, scales = quantize_fp8.quantize_tokens(x.to(dev), offs.to(dev), "mxfp8")
    scales = scales.cpu()
    rnd = torch.randint(0, 256, scales.shape, generator=gen, dtype=torch.uint8)
    scales = torch.where(torch.rand(scales.shape, generator=gen) < 0.3, rnd, scales)
    scales[:, :len(EDGE)] = torch.tensor(EDGE, dtype=torch.uint8)
    data_rows = S.token_rows(data_t.cpu(), offs, m)  # e4m3 token rows, 0 past offsets[E]
    o = offs.long()
    rows_idx = torch.arange(m)
    e = torch.searchsorted(o[1:], rows_idx, right=True)
    valid = e < o.numel() - 1
    ec = e.clamp(max=o.numel() - 2)
    slot = torch.where(valid, o[ec] // 32 + ec + (rows_idx - o[ec]) // 32, torch.zeros_like(rows_idx))
    byte = scales[slot].to(torch.int32)  # [m, n]
    mult = torch.where(byte == 0xFF, torch.full(byte.shape, float("nan")), R._pow2_f32(byte.clamp(max=254) - 127))
    vals = torch.where(valid[:, None], data_rows.float() * mult, torch.zeros(()))
    want, nan, n_inexact = _ref_bf16(vals)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)  # every row must be written
    got = dequantize_mxfp8_tokens(data_t, scales.to(dev), offs.to(dev), m, out=out, counter=cnt)
    ok, note = _same(got, want, nan)
    got_cnt = int(cnt.item())
    rows.append(Row(f"dequant mxfp8 tokens {m}x{n} E{offs.numel() - 1}", bitwise=ok, ok=ok and got_cnt == n_inexact,
                    note=f"{note}; inexact {got_cnt} (want {n_inexact})"))
    rows += _round_trip_rows(ctx, gen)
    # bandwidth: one row-layout and one token-layout dequant of an MoE-sized operand
    big = torch.randint(0, 120, (16384, 7168), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    bs = torch.randint(100, 140, (16384, 7168 // 32), dtype=torch.uint8, device=dev)
    reps = 10  # calls per timed run: queued back to back, so host launch cost hides behind the kernels
    loop = lambda f: (lambda: [f() for _ in range(reps)])
    t_row = bench_us(loop(lambda: dequantize_mxfp8(big, bs, -1))) / reps
    xb = torch.randn(16384, 2048, device=dev).bfloat16()
    ob = torch.tensor([0, 4000, 4000, 9001, 16000], dtype=torch.int32, device=dev)
    dt, st = quantize_fp8.quantize_tokens(xb, ob, "mxfp8")
    t_tok = bench_us(loop(lambda: dequantize_mxfp8_tokens(dt, st, ob, 16384))) / reps
    gb = lambda nbytes, us: nbytes / us / 1e3
    rows.append(Row("dequant mxfp8 row 16384x7168 timing", time_us=t_row,
                    note=f"{gb(big.numel() * 3, t_row):.0f} GB/s (1 B in + 2 B out per element)"))
    rows.append(Row("dequant mxfp8 tokens 16384x2048 timing", time_us=t_tok,
                    note=f"{gb(xb.numel() * 3, t_tok):.0f} GB/s"))
    return rows


def _edge_x(m, n, gen):
    """bf16 [m, n] with row magnitudes from 2^-128 (scale bytes 0..3: rounded dequantized
    values) to 2^100, plus a block holding Inf and one holding NaN."""
    x = torch.randn(m, n, generator=gen)
    expo = torch.randint(-30, 100, (m, 1), generator=gen).float()
    expo[:8] = torch.tensor([-128.0, -126, -125, -124, -123, -122, -120, -118])[:, None]
    x = (x * torch.exp2(expo)).bfloat16()
    x[9, 3], x[10, 40] = float("inf"), float("nan")
    return x


def _round_trip_rows(ctx, gen) -> list[Row]:
    """mxfp8_round_trip(_tokens) (one pass) vs the reference round trips and vs quantize +
    dequantize (two passes): bitwise, NaN-aware, inexact counter."""
    from mok_cute import reference as R
    from mok_cute.kernels.quant import quantize, quantize_fp8
    from mok_cute.kernels.quant.dequant_mxfp8 import (
        dequantize_mxfp8, dequantize_mxfp8_tokens, mxfp8_round_trip, mxfp8_round_trip_tokens,
    )

    dev, rows = ctx.device, []

    def row(name, got, vals32, two):
        want, nan, n_inexact = _ref_bf16(vals32)
        ok, note = _same(got, want, nan)
        same_two = torch.equal(got.view(torch.int16), two.view(torch.int16))
        return ok, same_two, n_inexact, note

    x = _edge_x(256, 544, gen)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    got = mxfp8_round_trip(x.to(dev), counter=cnt)
    two = dequantize_mxfp8(*quantize.quantize_mxfp8(x.to(dev), -1), -1)
    ok, same_two, want_cnt, note = row("rt_row", got, R.mx_round_trip(x, -1), two)
    rows.append(Row("mxfp8 round trip row 256x544 (edges)", bitwise=ok and same_two,
                    ok=ok and same_two and int(cnt.item()) == want_cnt,
                    note=f"{note}; == quantize+dequantize: {same_two}; inexact {int(cnt.item())} (want {want_cnt})"))
    m, n = 700, 136
    offs = torch.tensor([0, 150, 150, 181, 300, 300, 650], dtype=torch.int32)
    x = _edge_x(m, n, gen)
    vals = torch.zeros(m, n)
    vals[:650] = R._mx_round_trip_groups(x, offs.tolist())[:650]
    cnt.zero_()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)  # every row must be written
    got = mxfp8_round_trip_tokens(x.to(dev), offs.to(dev), out=out, counter=cnt)
    two = dequantize_mxfp8_tokens(*quantize_fp8.quantize_tokens(x.to(dev), offs.to(dev), "mxfp8"), offs.to(dev), m)
    ok, same_two, want_cnt, note = row("rt_tokens", got, vals, two)
    rows.append(Row(f"mxfp8 round trip tokens {m}x{n} E6 (edges)", bitwise=ok and same_two,
                    ok=ok and same_two and int(cnt.item()) == want_cnt,
                    note=f"{note}; == quantize+dequantize: {same_two}; inexact {int(cnt.item())} (want {want_cnt})"))
    x = _edge_x(320, 528, gen)  # the weight path: one group [0, R] = column-wise round trip
    cnt.zero_()
    got = mxfp8_round_trip_tokens(x.to(dev), torch.tensor([0, 320], dtype=torch.int32, device=dev), counter=cnt)
    two = dequantize_mxfp8(*quantize.quantize_mxfp8(x.to(dev), 0), 0)
    ok, same_two, want_cnt, note = row("rt_col", got, R.mx_round_trip(x, 0), two)
    rows.append(Row("mxfp8 round trip columns 320x528 (edges)", bitwise=ok and same_two,
                    ok=ok and same_two and int(cnt.item()) == want_cnt,
                    note=f"{note}; == quantize+dequantize: {same_two}; inexact {int(cnt.item())} (want {want_cnt})"))
    reps = 10
    loop = lambda f: (lambda: [f() for _ in range(reps)])
    xb = torch.randn(16384, 7168, device=dev).bfloat16()
    t_row = bench_us(loop(lambda: mxfp8_round_trip(xb))) / reps
    xt = xb[:, :2048].contiguous()
    ob = torch.tensor([0, 4000, 4000, 9001, 16000], dtype=torch.int32, device=dev)
    t_tok = bench_us(loop(lambda: mxfp8_round_trip_tokens(xt, ob))) / reps
    rows.append(Row("mxfp8 round trip row 16384x7168 timing", time_us=t_row,
                    note=f"{xb.numel() * 4 / t_row / 1e3:.0f} GB/s (2 B in + 2 B out per element)"))
    rows.append(Row("mxfp8 round trip tokens 16384x2048 timing", time_us=t_tok,
                    note=f"{xt.numel() * 4 / t_tok / 1e3:.0f} GB/s"))
    return rows


def _run(backend, precision, x, idx, w, ws, sh, dy, limit):
    import mok_cute

    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()] + [p.clone().requires_grad_() for p in ws]
    shl = [p.clone().requires_grad_() for p in sh] if sh else []
    y = mok_cute.moe(leaves[0], idx, leaves[1], *leaves[2:], shared=tuple(shl) if shl else None,
                     swiglu_limit=limit, config=mok_cute.MoKConfig(backend=backend, precision=precision))
    grads = torch.autograd.grad(y, leaves + shl, dy)
    return [y] + list(grads)


def _compare(name, outs, refs, same):
    worst, bad, finite = 0.0, [], True
    for i, (o, r) in enumerate(zip(outs, refs)):
        fin = bool(torch.isfinite(o.float()).all())
        d = (o.float() - r.float()).abs()
        rel = float(d.sum() / r.float().abs().sum().clamp_min(1e-30))
        finite &= fin
        worst = rel if (rel != rel or worst != worst) else max(worst, rel)
        if not (fin and rel <= REL_L1):
            bad.append(f"{OUT_NAMES[i]}(rel={rel:.1e},max={float(d.max()):.2g},finite={fin})")
    ok = finite and worst <= REL_L1 and same
    note = f"relL1={worst:.2e} finite={finite}" + (f" bad: {' '.join(bad)}" if bad else "")
    return Row(name, max_err=worst, bitwise=same, ok=ok, note=note)


def _layer_rows(ctx) -> list[Row]:
    dev = ctx.device
    rows = []
    cases = [("uniform", False, False, None), ("skew+shared L=4", True, True, 4.0)]
    for precision in ("mxfp8", "fp8_block"):
        for i, (name, skew, shared, limit) in enumerate(cases):
            x, idx, w, ws, sh, dy = _problem(1000, 1024, 512, 8, 4, shared, skew, dev, seed=300 + i)
            try:
                # the reference on the CPU (its mxfp8 dequantize mixes CPU and CUDA tensors on a GPU)
                cpu = lambda t: None if t is None else (tuple(v.cpu() for v in t) if isinstance(t, tuple) else t.cpu())
                ref = [r.to(dev) for r in _run("reference", precision, *map(cpu, (x, idx, w, ws, sh, dy)), limit)]
                outs = [_run("sm90", precision, x, idx, w, ws, sh, dy, limit) for _ in range(REPEATS)]
                torch.cuda.synchronize()
            except NotImplementedError as exc:  # an FP8 kernel not built yet
                rows.append(Row(f"layer sm90 {precision} {name}", ok=False, note=f"NotImplementedError: {exc}"[:150]))
                continue
            same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
            rows.append(_compare(f"layer sm90 {precision} {name}", outs[0], ref, same))
    return rows


def run(ctx) -> list[Row]:
    skip = sm90_skip(ctx, "layer_fp8")
    if skip is not None:
        return skip
    return _dequant_rows(ctx) + _layer_rows(ctx)

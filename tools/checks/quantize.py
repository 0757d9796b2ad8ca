"""Device check of the MXFP8 quantize kernels (mok_cute.kernels.quant.quantize.quantize_mxfp8).

Bitwise comparison with mok_cute.reference.mxfp8_quantize on the CPU copy of each input
(data compared as uint8, scales as uint8), for row-wise (dim=-1) and column-wise (dim=0):
random bf16/fp32 with per-block magnitudes 2^-140..2^120, and an edge-case tensor (zero and
-0.0 blocks, amax exactly 448*2^e, powers of two, mantissas around 1.75, subnormals, ties,
NaN/Inf, bf16 max). Then the time on 16384 x 7168 bf16 (GB/s counts bytes read + written)
and on a tiny tensor (host launch overhead).

FP8 rows (mok_cute.kernels.quant.quantize_fp8): the fp8_block 1x128 row quantizer vs
reference.fp8_block_quantize_act (scales compared as fp32 bit patterns, NaN included), and
the token-wise transposed wgrad quantizers (fp8_block and MXFP8) vs
reference.fp8_block_quantize_tokens / mxfp8_quantize_tokens on expert-grouped rows
(ragged, empty and 128-aligned groups, rows past offsets[E]), and the 128x128 weight quantizer
vs reference.fp8_block_quantize_weight (a tiny block, a NaN/Inf block), bitwise; GB/s on 16384 x 7168
(the weight quantizer beside the torch reference ops it would replace).
"""
import time

import torch

from tools.checks.common import Row, bench_us

HBM_GBS = 4300.0  # measured H200 copy bandwidth
DIMS = {"row": -1, "col": 0}


def _random(shape, dim, dtype, gen, device):
    """randn * 2^k with one k in [-140, 120] per 32-block along ``dim``."""
    M, N = shape
    bshape = (M, N // 32) if dim == -1 else (M // 32, N)
    k = torch.randint(-140, 121, bshape, generator=gen, device="cpu").float()
    mag = torch.exp2(k).repeat_interleave(32, dim=1 if dim == -1 else 0)
    x = torch.randn(shape, generator=gen, device="cpu") * mag
    return x.to(dtype).to(device)


def _edge_blocks(gen) -> torch.Tensor:
    """[nblocks, 32] fp32 values that are exact in bf16, one edge case per block."""
    def rnd():
        return torch.randn(32, generator=gen).to(torch.bfloat16).float()

    def pow2(e):
        return float(2.0 ** e)

    blocks = [torch.zeros(32), -torch.zeros(32), torch.where(torch.arange(32) % 2 == 0, 0.0, -0.0)]
    for e in (-133, -126, -120, -60, -9, 0, 7, 60, 119):
        b = rnd().clamp(-1, 1) * 300 * pow2(e)
        b[5] = 448 * pow2(e)  # amax exactly 448 * 2^e
        blocks.append(b)
        b = rnd().clamp(-1, 1) * 0.5 * pow2(e)
        b[17] = -pow2(e)  # amax a power of two
        blocks.append(b)
        for mant in (0x60, 0x61, 0x5F, 0x7F, 0x00):  # mantissa around 1.75 (bf16 7-bit field)
            b = rnd().clamp(-1, 1) * pow2(e)
            b[3] = torch.tensor([((127 + e) << 7 | mant) if -126 <= e <= 127 else 0x0080],
                                dtype=torch.int16).view(torch.bfloat16).float()
            blocks.append(b)
    sub = torch.randint(1, 0x80, (4, 32), generator=gen, dtype=torch.int16)  # bf16 subnormals
    sub = sub * torch.where(torch.rand(4, 32, generator=gen) < 0.5, 1, -1).to(torch.int16)
    sub = torch.where(sub < 0, (-sub) | -0x8000, sub).view(torch.bfloat16).float()
    blocks += list(sub)
    mixed = sub[0].clone()
    mixed[0] = 1.0  # one normal value among subnormals
    blocks.append(mixed)
    ties = (torch.arange(32) / 16.0 + 1.0) * torch.where(torch.arange(32) % 3 == 0, -1.0, 1.0)
    ties[31] = 448.0  # scale 2^0: x/16 steps hit e4m3 round-to-even ties
    blocks.append(ties)
    big = rnd()
    big[9] = float(torch.finfo(torch.bfloat16).max)
    blocks.append(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        b = rnd()
        b[11] = bad
        blocks.append(b)
    nan_big = rnd()
    nan_big[0], nan_big[1] = float("nan"), 1e30
    blocks.append(nan_big)
    while len(blocks) % 64:  # column layout needs N = nblocks / 8 to be a multiple of 8
        blocks.append(rnd())
    return torch.stack(blocks)


def _edge(dim, dtype, gen, device):
    """Edge blocks laid out as 32-element blocks along ``dim`` (8 blocks per row / column)."""
    b = _edge_blocks(gen)  # [nb, 32]
    rows = b.reshape(-1, 8 * 32)  # row-wise blocks: [nb/8, 256]
    x = rows if dim == -1 else rows.t().contiguous()  # column blocks: [256, nb/8]
    return x.to(dtype).to(device)


def _compare(name, x, dim, quantize, reference) -> Row:
    data, scales = quantize(x, dim)
    torch.cuda.synchronize()
    ref_data, ref_scales = reference(x.cpu(), dim)
    assert data.shape == ref_data.shape and scales.shape == ref_scales.shape, (
        f"{name}: shapes {tuple(data.shape)}/{tuple(scales.shape)} vs "
        f"{tuple(ref_data.shape)}/{tuple(ref_scales.shape)}")
    bad_d = (data.cpu().view(torch.uint8) != ref_data.view(torch.uint8)).sum().item()
    bad_s = (scales.cpu() != ref_scales).sum().item()
    ok = bad_d == 0 and bad_s == 0
    return Row(name, bitwise=ok, ok=ok,
               note=f"{tuple(x.shape)}; mismatched data bytes {bad_d}, scale bytes {bad_s}")


def run(ctx) -> list[Row]:  # MXFP8 rows, then run_fp8's
    from mok_cute.kernels.quant.quantize import quantize_mxfp8
    from mok_cute.reference import mxfp8_quantize

    dev = ctx.device
    gen = torch.Generator().manual_seed(1234)
    rows = []
    for kind, dim in DIMS.items():
        t0 = time.time()
        quantize_mxfp8(torch.zeros(32, 256, dtype=torch.bfloat16, device=dev), dim)
        torch.cuda.synchronize()
        first = time.time() - t0
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            for shape in ((256, 7168), (1056, 2336), (96, 160), (32, 32)):
                x = _random(shape, dim, dtype, gen, dev)
                rows.append(_compare(f"mxfp8 {kind} random {tag} {shape[0]}x{shape[1]}", x, dim,
                                     quantize_mxfp8, mxfp8_quantize))
            rows.append(_compare(f"mxfp8 {kind} edge cases {tag}", _edge(dim, dtype, gen, dev), dim,
                                 quantize_mxfp8, mxfp8_quantize))
        M, N = 16384, 7168
        x = _random((M, N), dim, torch.bfloat16, gen, dev)
        rows.append(_compare(f"mxfp8 {kind} random bf16 {M}x{N}", x, dim, quantize_mxfp8,
                             mxfp8_quantize))
        us = bench_us(lambda: quantize_mxfp8(x, dim), warmup=10, iters=50)
        nbytes = M * N * 2 + M * N + M * N // 32
        gbs = nbytes / us / 1e3
        rows.append(Row(f"mxfp8 {kind} time bf16 {M}x{N}", time_us=us, ok=True,
                        note=f"{gbs:.0f} GB/s = {100 * gbs / HBM_GBS:.0f}% of {HBM_GBS:.0f}; "
                             f"first call {first:.1f}s"))
        tiny = torch.randn(32, 256, device=dev).to(torch.bfloat16)
        us = bench_us(lambda: quantize_mxfp8(tiny, dim), warmup=10, iters=50)
        rows.append(Row(f"mxfp8 {kind} time bf16 32x256", time_us=us, ok=True,
                        note="host launch overhead bound"))
    return rows + _pitched_rows(dev, gen) + run_fp8(ctx, gen)


def _pitched_rows(dev, gen) -> list[Row]:
    """``quantize_mxfp8_rows_into`` (the fused MXFP8 forward's token rows: data then scales in one pitched row) vs
    ``quantize_mxfp8(x, -1)`` bitwise, the bytes past the scales untouched; its time beside the two-buffer quantize
    and the two copies it replaces at 8192 x 4096."""
    from mok_cute.comm.workspace import mxfp8_row_bytes
    from mok_cute.kernels.quant.dequant_mxfp8 import mxfp8_round_trip
    from mok_cute.kernels.quant.quantize import quantize_mxfp8, quantize_mxfp8_rows_into

    rows = []
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for m, n in ((256, 7168), (1056, 2336), (96, 160), (8192, 4096)):
            x = _random((m, n), -1, dtype, gen, dev)
            p = mxfp8_row_bytes(n) + 16
            out = torch.full((m, p), 0xA5, dtype=torch.uint8, device=dev)
            quantize_mxfp8_rows_into(x, out)
            q, s = quantize_mxfp8(x, -1)
            same = [torch.equal(out[:, :n], q.view(torch.uint8)), torch.equal(out[:, n:n + n // 32], s),
                    bool((out[:, n + n // 32:] == 0xA5).all())]
            if dtype == torch.bfloat16:  # with the round trip in the same pass
                out2 = torch.full_like(out, 0xA5)
                rt = torch.full_like(x, float("nan"))
                quantize_mxfp8_rows_into(x, out2, rt)
                same += [torch.equal(out2, out), torch.equal(rt, mxfp8_round_trip(x))]
            rows.append(Row(f"mxfp8 rows_into {tag} {m}x{n} pitch {p}", bitwise=all(same), ok=all(same),
                            note=f"[data, scales, rest untouched] == quantize_mxfp8(x, -1) (bf16: then with rt, the "
                                 f"same rows and rt == mxfp8_round_trip(x)): {same}"))
    x = _random((8192, 4096), -1, torch.bfloat16, gen, dev)
    out = torch.empty((8192, mxfp8_row_bytes(4096)), dtype=torch.uint8, device=dev)

    def two_buffers():
        q, s = quantize_mxfp8(x, -1)
        out[:, :4096].copy_(q.view(torch.uint8))
        out[:, 4096:4096 + 128].copy_(s)

    us_into = bench_us(lambda: quantize_mxfp8_rows_into(x, out), warmup=10, iters=50)
    us_two = bench_us(two_buffers, warmup=10, iters=50)
    rows.append(Row("mxfp8 rows_into time bf16 8192x4096", time_us=us_into, ok=True,
                    note=f"quantize_mxfp8 + two copies into the rows: {us_two:.0f} us ({us_two / us_into:.2f}x)"))
    rt = torch.empty_like(x)
    us_rt = bench_us(lambda: quantize_mxfp8_rows_into(x, out, rt), warmup=10, iters=50)
    us_apart = bench_us(lambda: (quantize_mxfp8_rows_into(x, out), mxfp8_round_trip(x, out=rt)), warmup=10, iters=50)
    rows.append(Row("mxfp8 rows_into + round trip time bf16 8192x4096", time_us=us_rt, ok=True,
                    note=f"rows_into then mxfp8_round_trip: {us_apart:.0f} us ({us_apart / us_rt:.2f}x)"))
    return rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().cpu()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _compare_bits(name, got, ref, shape) -> Row:
    bad = []
    for g, r in zip(got, ref):
        if tuple(g.shape) != tuple(r.shape):
            return Row(name, bitwise=False, ok=False, note=f"shape {tuple(g.shape)} vs {tuple(r.shape)}")
        bad.append(int((_bits(g) != _bits(r)).sum()))
    ok = not any(bad)
    return Row(name, bitwise=ok, ok=ok, note=f"{shape}; mismatched data {bad[0]}, scales {bad[1]}")


def _groups(m, e, gen, kind):
    """int32 offsets [E+1] of M rows: random ragged (some empty), 128-aligned, or one group."""
    if kind == "one":
        return torch.tensor([0, m], dtype=torch.int32)
    if kind == "aligned":
        cuts = torch.sort(torch.randint(0, m // 128 + 1, (e - 1,), generator=gen)).values * 128
    else:
        cuts = torch.sort(torch.randint(0, m - 4, (e - 1,), generator=gen)).values
        cuts[: e // 4] = cuts[0]  # a few empty experts
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([m - 5 if kind == "ragged" else m])]).to(torch.int32)


def _weights_t_rows(dtype, tag, gen, dev) -> list[Row]:
    """quantize_fp8_block_weights_t(wg, wu) vs the reference per expert and its stacked
    transpose (sm90_fp8_expert.transpose_weight_blocks of the reference pairs), bitwise."""
    from mok_cute.kernels.quant.quantize_fp8 import quantize_fp8_block_weights_t
    from mok_cute.kernels.sm90.fp8_expert import transpose_weight_blocks
    from mok_cute.reference import fp8_block_quantize_weight

    e, k = 3, 384
    ws = [_random((e * r, k), -1, dtype, gen, dev).view(e, r, k) for r in (256, 128)]
    ws[0][1, :128, 128:256] *= 2.0 ** -120  # a tiny block
    ws[1][2, 5, 300] = float("nan") if dtype == torch.float32 else float("inf")  # a non-finite block
    parts, (qt, st) = quantize_fp8_block_weights_t(*ws)
    torch.cuda.synchronize()
    rows = []
    refs = []
    for j, (w, (q, sc)) in enumerate(zip(ws, parts)):
        ref = [fp8_block_quantize_weight(w[i].cpu()) for i in range(e)]
        ref_q, ref_s = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
        refs.append((ref_q, ref_s))
        rows.append(_compare_bits(f"fp8_block weights_t W{j} {tag} {tuple(w.shape)}", (q, sc), (ref_q, ref_s),
                                  tuple(w.shape)))
    ref_t = transpose_weight_blocks(*refs)
    rows.append(_compare_bits(f"fp8_block weights_t stacked^T {tag}", (qt, st), ref_t, tuple(qt.shape)))
    return rows


def run_fp8(ctx, gen) -> list[Row]:
    from mok_cute.kernels.quant.quantize_fp8 import (quantize_fp8_block_act, quantize_fp8_block_weight,
                                               quantize_fp8_block_weights_t, quantize_tokens)
    from mok_cute.reference import (fp8_block_quantize_act, fp8_block_quantize_tokens, fp8_block_quantize_weight,
                                    mxfp8_quantize_tokens)

    dev = ctx.device
    rows = []
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for shape in ((256, 7168), (1056, 2304), (96, 128)):
            x = _random(shape, -1, dtype, gen, dev)
            got = quantize_fp8_block_act(x)
            rows.append(_compare_bits(f"fp8_block row random {tag} {shape[0]}x{shape[1]}", got,
                                      fp8_block_quantize_act(x.cpu()), shape))
        x = _edge(-1, dtype, gen, dev)  # 8 MX blocks per row = two 1x128 tiles
        rows.append(_compare_bits(f"fp8_block row edge cases {tag}", quantize_fp8_block_act(x),
                                  fp8_block_quantize_act(x.cpu()), tuple(x.shape)))
        for fmt, ref in (("fp8_block", fp8_block_quantize_tokens), ("mxfp8", mxfp8_quantize_tokens)):
            for (m, n, e), kind in (((1000, 512, 8), "ragged"), ((1024, 256, 4), "aligned"),
                                    ((300, 128, 1), "one"), ((4096, 2048, 32), "ragged")):
                x = _random((m, n), -1, dtype, gen, dev)
                offs = _groups(m, e, gen, kind)
                got = quantize_tokens(x, offs.to(dev), fmt)
                rows.append(_compare_bits(f"{fmt} tokens {kind} {tag} {m}x{n} E={e}", got,
                                          ref(x.cpu(), offs), (m, n)))
            x = _edge(0, dtype, gen, dev)  # column blocks of 32 tokens
            offs = torch.tensor([0, 37, 37, x.shape[0]], dtype=torch.int32)
            rows.append(_compare_bits(f"{fmt} tokens edge cases {tag}", quantize_tokens(x, offs.to(dev), fmt),
                                      ref(x.cpu(), offs), tuple(x.shape)))
        for shape in ((256, 7168), (3 * 2048, 384), (128, 128)):  # 128x128 weight blocks
            w = _random(shape, -1, dtype, gen, dev)
            w[:128, :128] *= 2.0 ** -120  # one tiny block (amax floor region)
            if shape[0] > 128:
                w[130, 5] = float("nan") if dtype == torch.float32 else float("inf")
            rows.append(_compare_bits(f"fp8_block weight {tag} {shape[0]}x{shape[1]}", quantize_fp8_block_weight(w),
                                      fp8_block_quantize_weight(w.cpu()), shape))
        rows += _weights_t_rows(dtype, tag, gen, dev)
    M, N = 16384, 7168
    x = _random((M, N), -1, torch.bfloat16, gen, dev)
    us = bench_us(lambda: quantize_fp8_block_weight(x), warmup=5, iters=20)
    ref_us = bench_us(lambda: fp8_block_quantize_weight(x), warmup=2, iters=5)
    gbs = (M * N * 3) / us / 1e3
    rows.append(Row(f"fp8_block weight time bf16 {M}x{N}", time_us=us, ok=True,
                    note=f"{gbs:.0f} GB/s = {100 * gbs / HBM_GBS:.0f}% of {HBM_GBS:.0f}; torch reference ops "
                         f"{ref_us:.0f} us"))
    e, i, h = 8, 3072, 7168  # gate and up of the large bench shape: forward copies + the dgrad1 operand
    wg, wu = (_random((e * i, h), -1, torch.bfloat16, gen, dev).view(e, i, h) for _ in range(2))
    us = bench_us(lambda: quantize_fp8_block_weights_t(wg, wu), warmup=3, iters=10)

    def separate():
        from mok_cute.kernels.sm90.fp8_expert import transpose_weight_blocks
        qs = [quantize_fp8_block_weight(w.view(e * i, h)) for w in (wg, wu)]
        transpose_weight_blocks(*((q.view(e, i, h), sc.view(e, i // 128, h // 128)) for q, sc in qs))

    sep_us = bench_us(separate, warmup=3, iters=10)
    gbs = (2 * e * i * h * (2 + 1 + 1)) / us / 1e3
    rows.append(Row(f"fp8_block weights_t time bf16 2x{e}x{i}x{h}", time_us=us, ok=True,
                    note=f"{gbs:.0f} GB/s (2 B in, 2 x 1 B out); quantize + torch transpose {sep_us:.0f} us "
                         f"({sep_us / us:.2f}x)"))
    us = bench_us(lambda: quantize_fp8_block_act(x), warmup=10, iters=50)
    gbs = (M * N * 3 + M * N // 32) / us / 1e3
    rows.append(Row(f"fp8_block row time bf16 {M}x{N}", time_us=us, ok=True,
                    note=f"{gbs:.0f} GB/s = {100 * gbs / HBM_GBS:.0f}% of {HBM_GBS:.0f}"))
    offs = _groups(M, 32, gen, "ragged").to(dev)
    for fmt, sbytes in (("fp8_block", 4 / 128), ("mxfp8", 1 / 32)):
        us = bench_us(lambda: quantize_tokens(x, offs, fmt), warmup=10, iters=50)
        gbs = M * N * (3 + sbytes) / us / 1e3
        rows.append(Row(f"{fmt} tokens time bf16 {M}x{N} E=32", time_us=us, ok=True,
                        note=f"{gbs:.0f} GB/s = {100 * gbs / HBM_GBS:.0f}% of {HBM_GBS:.0f}"))
    return rows

"""Device check: SM90 FP8 blockwise grouped GEMM (mok_cute.kernels.sm90.fp8_gemm.grouped_gemm_fp8_block)
vs mok_cute.reference.grouped_gemm(..., precision="fp8_block").

Per routing (uniform / skewed: one expert with most rows, empty experts, counts not
multiples of the 128-row tile), 8 experts, K = H = 1024, N = 1024:
  * activations x [M, K] bf16 with one random power-of-two magnitude per 1x128 tile, weights
    randn * K^-0.5 with one per 128x128 block (so a wrong row / block scale index shows);
  * quantize x with the CuTe kernel (quantize_fp8.quantize_fp8_block_act) and with
    reference.fp8_block_quantize_act on the same GPU tensor: data and scales bitwise equal
    (one row; scales compared as fp32 bit patterns); weights quantized per expert with
    reference.fp8_block_quantize_weight on the CPU, moved to the GPU (also checked bitwise
    against the same reference run on the GPU copy, which is what the GEMM reference uses);
  * the GEMM into NaN-poisoned outputs, 5 repeats bitwise equal, plus one run on the
    reference-quantized operands (contiguous [M, K/128] scales: the wrapper's copy path)
    bitwise equal to the first; vs the reference on the GPU tensors (same quantized
    operands, only the accumulation order differs): rel-L1 <= 1e-2 and finite.
Each GEMM row is repeated for the serial promotion consumer
(Fp8MainloopConfig(overlap_promotion=False); the default overlaps): the same checks, plus
bitwise equality with the default kernel's output.

Expert-MLP kernels (mok_cute.kernels.sm90.fp8_expert), per routing, E = 8, H = 1024, I = 512,
operands quantized by quantize_fp8_block_act (activations) and reference.fp8_block_quantize_weight
per expert (weights; dgrad weights through transpose_weight_blocks), vs the reference with
precision="fp8_block" (rel-L1 <= 1e-2, finite: NaN-poisoned outputs fully written; 5 repeats
bitwise; one run with the serial consumer bitwise equal to the default):
  * grouped_gemm1_swiglu_fp8_block (gu and h) vs reference.grouped_gemm1_swiglu, limit None / 4.0;
  * grouped_dswiglu_dgrad_fp8_block vs reference.grouped_dswiglu_dgrad, limit None / 4.0;
  * grouped_dgrad1_fp8_block vs reference.grouped_dgrad1.
Then: zero total rows, no recompile for new counts, and timed shapes: the plain GEMM (8 experts
x 4096 rows, K = H = 7168, N = 4096; FP8 default, FP8 serial, BF16 grouped_gemm in the same
rows) and each expert kernel at 8 x 4096 rows, H = 7168, I = 2048 beside its BF16 kernel
(sm90_grouped_gemm.grouped_gemm1_swiglu, sm90_expert_bwd.grouped_dswiglu_dgrad / grouped_dgrad1).
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded, sm90_skip
from tools.checks.gemm_sm90 import _counts, _errors, _guarded, _offsets, _poisoned, _row

REPEATS = 5
E, K, N = 8, 1024, 1024  # correctness shape (E must match gemm_sm90._counts)
BENCH = (8, 4096, 7168, 4096)  # experts, rows per expert, K (= H), N
BLK = 128
SERIAL = None  # Fp8MainloopConfig(overlap_promotion=False), set in run() (imports the DSL lazily)
HID, INTER = 1024, 512  # expert-kernel correctness shape
EXPERT_BENCH = (8, 4096, 7168, 2048)  # experts, rows per expert, H, I


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return -1
    return int((_bits(got) != _bits(want)).sum())


def _inputs(m: int, dev, gen: torch.Generator):
    """x [m, K] bf16 (randn * 2^[-6, 6] per 1x128 tile), w [E, N, K] bf16 (randn * K^-0.5 *
    2^[-4, 4] per 128x128 block), both generated on the CPU, returned on ``dev``."""
    tile = torch.exp2(torch.randint(-6, 7, (m, K // BLK), generator=gen).float()).repeat_interleave(BLK, 1)
    x = (torch.randn(m, K, generator=gen) * tile).bfloat16()
    blk = torch.exp2(torch.randint(-4, 5, (E, N // BLK, K // BLK), generator=gen).float())
    blk = blk.repeat_interleave(BLK, 1).repeat_interleave(BLK, 2)
    w = (torch.randn(E, N, K, generator=gen) * K ** -0.5 * blk).bfloat16()
    return x.to(dev), w.to(dev)


def _quantize_weights(ref, w: torch.Tensor):
    """reference.fp8_block_quantize_weight per expert on w's device: (data [E, N, K], scales [E, N/128, K/128])."""
    parts = [ref.fp8_block_quantize_weight(w[e]) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _rows(r) -> list[Row]:
    """A case returns a list of rows; :func:`_guarded` turns a crash into one failed Row."""
    return r if isinstance(r, list) else [r]


def _check_routing(fg, qf, ref, dev, gen, routing):
    """Two rows: the activation quantizer (bitwise vs the reference), then the GEMM."""
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    x, w = _inputs(m, dev, gen)

    # quantized operands: kernel vs reference (activations), CPU vs GPU reference (weights)
    qa, sa = qf.quantize_fp8_block_act(x)
    ra, rsa = ref.fp8_block_quantize_act(x)
    wq_cpu, ws_cpu = _quantize_weights(ref, w.cpu())
    wq, ws = wq_cpu.to(dev), ws_cpu.to(dev)
    wq_gpu, ws_gpu = _quantize_weights(ref, w)
    ra_cpu, rsa_cpu = ref.fp8_block_quantize_act(x.cpu())
    # scales compared by value (_bits copies the kernel's [M, K/128] view of its [K/128, M]
    # buffer to row-major first); act also GPU ref vs CPU ref (the reference is device-independent)
    bad = [_mismatches(qa, ra), _mismatches(sa, rsa), _mismatches(wq, wq_gpu), _mismatches(ws, ws_gpu),
           _mismatches(ra.cpu(), ra_cpu), _mismatches(rsa.cpu(), rsa_cpu)]
    q_ok = not any(bad)
    q_row = Row(f"fp8 quantize act {routing}: kernel == ref", bitwise=q_ok, ok=q_ok,
                note=f"M={m} K={K}; mismatched act data {bad[0]}, act scales {bad[1]}; "
                     f"weight CPU ref vs GPU ref data {bad[2]}, scales {bad[3]}; "
                     f"act CPU ref vs GPU ref data {bad[4]}, scales {bad[5]} (-1: shape/dtype)")

    def gemm():
        want = ref.grouped_gemm(x, offs, w, precision="fp8_block")
        outs = []
        for _ in range(REPEATS):
            (out,) = _poisoned((m, N), device=dev)
            outs.append(fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out))
        (out,) = _poisoned((m, N), device=dev)
        via_ref = fg.grouped_gemm_fp8_block(ra, rsa, offs, wq, ws, out=out)
        torch.cuda.synchronize()
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        same_ref_ops = torch.equal(outs[0], via_ref)
        row = _row(f"fp8_block gemm {routing}", [outs[0]], [want], same,
                   f"ref-quantized operands bitwise={same_ref_ops} M={m} counts={counts}")
        row.ok = row.ok and same_ref_ops
        return row, want, outs[0]

    def gemm_serial(want, default_out):
        """The serial promotion consumer: same checks, and bitwise equal to the default
        overlapped one (same wgmma batches, same FMA order by construction; a read of
        in-flight wgmma registers would show here)."""
        outs = []
        for _ in range(REPEATS):
            (out,) = _poisoned((m, N), device=dev)
            outs.append(fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out, cfg=SERIAL))
        (out,) = _poisoned((m, N), device=dev)
        via_ref = fg.grouped_gemm_fp8_block(ra, rsa, offs, wq, ws, out=out, cfg=SERIAL)
        torch.cuda.synchronize()
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        same_ref_ops = torch.equal(outs[0], via_ref)
        same_default = default_out is not None and torch.equal(outs[0], default_out)
        row = _row(f"fp8_block gemm serial {routing}", [outs[0]], [want], same,
                   f"== default bitwise={same_default} ref-quantized operands bitwise={same_ref_ops} M={m}")
        row.ok = row.ok and same_ref_ops and same_default
        return row

    res = _guarded(f"fp8_block gemm {routing}", gemm)
    if isinstance(res, Row):  # crashed: still run the serial variant against the reference
        want, default_out = ref.grouped_gemm(x, offs, w, precision="fp8_block"), None
        rows = [q_row, res]
    else:
        row, want, default_out = res
        rows = [q_row, row]
    return rows + [_guarded(f"fp8_block gemm serial {routing}", gemm_serial, want, default_out)]


def _check_zero_rows(fg, qf, dev):
    offs = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    qa, sa = qf.quantize_fp8_block_act(torch.zeros(0, K, dtype=torch.bfloat16, device=dev))
    wq = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn, device=dev)
    ws = torch.ones(E, N // BLK, K // BLK, dtype=torch.float32, device=dev)
    out = fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws)
    torch.cuda.synchronize()
    ok = tuple(qa.shape) == (0, K) and tuple(sa.shape) == (0, K // BLK) and tuple(out.shape) == (0, N)
    return Row("fp8 zero total rows (quantize + gemm)", ok=ok,
               note=f"data {tuple(qa.shape)} scales {tuple(sa.shape)} out {tuple(out.shape)}")


def _bench(fg, qf, gg, ref, dev):
    e, rows, k, n = BENCH
    m = e * rows
    offs = _offsets([rows] * e, dev)
    x = torch.randn(m, k, device=dev).bfloat16()
    w = (torch.randn(e, n, k, device=dev) * k ** -0.5).bfloat16()
    qa, sa = qf.quantize_fp8_block_act(x)
    wq, ws = _quantize_weights(ref, w)  # the reference on the GPU (values do not matter here)
    out8 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    out8s = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    t8 = bench_us(lambda: fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out8))
    t8s = bench_us(lambda: fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out8s, cfg=SERIAL))
    t16 = bench_us(lambda: gg.grouped_gemm(x, offs, w, out=out16))
    tq = bench_us(lambda: qf.quantize_fp8_block_act(x))
    torch.cuda.synchronize()
    flops = 2.0 * m * k * n
    finite = bool(torch.isfinite(out8.float()).all())
    _, rel, _ = _errors(out8, out16)  # quantization error, for information only
    same = torch.equal(out8, out8s)
    return [Row(f"bench fp8_block gemm {e}x{rows} K={k} N={n}", time_us=t8, ok=finite,
                note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 plain {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                     f"speedup bf16/fp8 {t16 / t8:.2f}x; +act quantize {tq:.1f} us; "
                     f"finite={finite} relL1 vs bf16 {rel:.1e}"),
            Row(f"bench fp8_block gemm serial {e}x{rows} K={k} N={n}", time_us=t8s, bitwise=same, ok=same,
                note=f"{flops / t8s / 1e6:.0f} TFLOP/s; default (overlapped) {t8:.1f} us "
                     f"{flops / t8 / 1e6:.0f} TFLOP/s (default speedup over serial {t8s / t8:.2f}x); "
                     f"bf16 plain {t16:.1f} us; == default bitwise={same}")]



# ---------------------------------------------------------------- expert-MLP kernels
def _act(m: int, k: int, gen: torch.Generator, dev, spread: int = 6) -> torch.Tensor:
    """[m, k] bf16: randn * 2^[-spread, spread] per 1x128 tile (a wrong row scale shows)."""
    tile = torch.exp2(torch.randint(-spread, spread + 1, (m, k // BLK), generator=gen).float())
    return (torch.randn(m, k, generator=gen) * tile.repeat_interleave(BLK, 1)).bfloat16().to(dev)


def _weight(e: int, n: int, k: int, gen: torch.Generator, dev) -> torch.Tensor:
    """[e, n, k] bf16: randn * k^-0.5 * 2^[-3, 3] per 128x128 block (a wrong block scale shows)."""
    blk = torch.exp2(torch.randint(-3, 4, (e, n // BLK, k // BLK), generator=gen).float())
    blk = blk.repeat_interleave(BLK, 1).repeat_interleave(BLK, 2)
    return (torch.randn(e, n, k, generator=gen) * k ** -0.5 * blk).bfloat16().to(dev)


def _repeat(fn, shapes, dev):
    """5 runs of ``fn(*outs)`` into fresh NaN-poisoned outputs, then one with the serial
    consumer; returns (first result tuple, repeats bitwise, serial == default bitwise)."""
    res = []
    for i in range(REPEATS + 1):
        outs = _poisoned(*shapes, device=dev)
        r = fn(*outs, cfg=SERIAL) if i == REPEATS else fn(*outs)
        res.append(r if isinstance(r, tuple) else (r,))
    torch.cuda.synchronize()
    same = all(all(torch.equal(a, b) for a, b in zip(res[0], r)) for r in res[1:REPEATS])
    serial = all(torch.equal(a, b) for a, b in zip(res[0], res[REPEATS]))
    return res[0], same, serial


def _check_gemm1(fx, qf, ref, dev, gen, routing, limit):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    x = _act(m, HID, gen, dev, spread=3)
    wg, wu = _weight(E, INTER, HID, gen, dev), _weight(E, INTER, HID, gen, dev)
    xq, xs = qf.quantize_fp8_block_act(x)
    (wgq, wgs), (wuq, wus) = _quantize_weights(ref, wg), _quantize_weights(ref, wu)
    gu_ref, h_ref = ref.grouped_gemm1_swiglu(x, offs, wg, wu, limit, precision="fp8_block")
    (gu, h), same, serial = _repeat(
        lambda gu, h, cfg=fx.DEFAULT_FP8_CONFIG: fx.grouped_gemm1_swiglu_fp8_block(
            xq, xs, offs, wgq, wgs, wuq, wus, limit, gu=gu, h=h, cfg=cfg), [(m, 2 * INTER), (m, INTER)], dev)
    h_own = ref.swiglu(gu[:, :INTER].float(), gu[:, INTER:].float(), limit).bfloat16()
    _, rel_own, _ = _errors(h, h_own)
    rels = [f"{n} relL1={_errors(o, r)[1]:.1e}" for n, o, r in (("gate", gu[:, :INTER], gu_ref[:, :INTER]),
                                                                  ("up", gu[:, INTER:], gu_ref[:, INTER:]),
                                                                  ("h", h, h_ref))]
    clamped = 0 if limit is None else int((gu_ref.float().abs() > limit).sum())
    row = _row(f"fp8 gemm1 swiglu {routing} L={limit}", [gu, h], [gu_ref, h_ref], same,
               f"{' '.join(rels)} h-vs-own-gu relL1={rel_own:.1e} serial==default {serial} clamped={clamped} "
               f"M={m} counts={counts}", names=["gu", "h"])
    row.ok = row.ok and serial
    return row


def _check_dswiglu(fx, qf, ref, dev, gen, routing, limit):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    dy = _act(m, HID, gen, dev)
    wd = _weight(E, HID, INTER, gen, dev)
    gu = (torch.randn(m, 2 * INTER, generator=gen) * 3).bfloat16().to(dev)  # |.| > 4 often: clamps engage
    dyq, dys = qf.quantize_fp8_block_act(dy)
    wdt_q, wdt_s = fx.transpose_weight_blocks(_quantize_weights(ref, wd))
    want = ref.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit, precision="fp8_block")
    (out,), same, serial = _repeat(
        lambda out, cfg=fx.DEFAULT_FP8_CONFIG: fx.grouped_dswiglu_dgrad_fp8_block(
            dyq, dys, offs, wdt_q, wdt_s, gu, limit, out=out, cfg=cfg), [(m, 2 * INTER)], dev)
    rels = [f"{n} relL1={_errors(o, r)[1]:.1e}" for n, o, r in (("dg", out[:, :INTER], want[:, :INTER]),
                                                                  ("du", out[:, INTER:], want[:, INTER:]))]
    row = _row(f"fp8 dswiglu dgrad {routing} L={limit}", [out], [want], same,
               f"{' '.join(rels)} serial==default {serial} M={m} counts={counts}", names=["dgu"])
    row.ok = row.ok and serial
    return row


def _check_dgrad1(fx, qf, ref, dev, gen, routing):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    dgu = _act(m, 2 * INTER, gen, dev)
    wg, wu = _weight(E, INTER, HID, gen, dev), _weight(E, INTER, HID, gen, dev)
    dguq, dgus = qf.quantize_fp8_block_act(dgu)
    w1t_q, w1t_s = fx.transpose_weight_blocks(_quantize_weights(ref, wg), _quantize_weights(ref, wu))
    want = ref.grouped_dgrad1(dgu, offs, wg, wu, precision="fp8_block")
    (out,), same, serial = _repeat(
        lambda out, cfg=fx.DEFAULT_FP8_CONFIG: fx.grouped_dgrad1_fp8_block(
            dguq, dgus, offs, w1t_q, w1t_s, out=out, cfg=cfg), [(m, HID)], dev)
    row = _row(f"fp8 dgrad1 {routing}", [out], [want], same,
               f"serial==default {serial} M={m} counts={counts}", names=["dx"])
    row.ok = row.ok and serial
    return row


def _bench_experts(fx, qf, gg, bwd, ref, dev):
    """FP8 expert kernels (operands pre-quantized) beside their BF16 kernels, same shapes."""
    e, rows, hid, inter = EXPERT_BENCH
    m = e * rows
    offs = _offsets([rows] * e, dev)
    x = torch.randn(m, hid, device=dev).bfloat16()
    wg = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wu = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wd = (torch.randn(e, hid, inter, device=dev) * inter ** -0.5).bfloat16()
    xq, xs = qf.quantize_fp8_block_act(x)
    qg, qu, qd = _quantize_weights(ref, wg), _quantize_weights(ref, wu), _quantize_weights(ref, wd)
    wdt = fx.transpose_weight_blocks(qd)
    w1t = fx.transpose_weight_blocks(qg, qu)
    gu = torch.empty(m, 2 * inter, dtype=torch.bfloat16, device=dev)
    h = torch.empty(m, inter, dtype=torch.bfloat16, device=dev)
    gu16 = torch.empty_like(gu)
    h16 = torch.empty_like(h)
    dgu = torch.empty(m, 2 * inter, dtype=torch.bfloat16, device=dev)
    dgu16 = torch.empty_like(dgu)
    dx = torch.empty(m, hid, dtype=torch.bfloat16, device=dev)
    dx16 = torch.empty_like(dx)
    dy, dyq, dys = x, xq, xs  # same distribution; values do not matter here
    rows_out = []
    t8 = bench_us(lambda: fx.grouped_gemm1_swiglu_fp8_block(xq, xs, offs, *qg, *qu, 4.0, gu=gu, h=h))
    t16 = bench_us(lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu, 4.0, out=(gu16, h16)))
    flops = 2.0 * m * hid * 2 * inter
    rows_out.append(Row(f"bench fp8 gemm1 swiglu {e}x{rows} H={hid} I={inter}", time_us=t8,
                        ok=bool(torch.isfinite(h.float()).all()),
                        note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                             f"speedup bf16/fp8 {t16 / t8:.2f}x; gu relL1 vs bf16 {_errors(gu, gu16)[1]:.1e}"))
    gu.copy_(gu16)
    t8 = bench_us(lambda: fx.grouped_dswiglu_dgrad_fp8_block(dyq, dys, offs, *wdt, gu, 4.0, out=dgu))
    t16 = bench_us(lambda: bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, 4.0, out=dgu16))
    flops = 2.0 * m * hid * inter
    rows_out.append(Row(f"bench fp8 dswiglu dgrad {e}x{rows} H={hid} I={inter}", time_us=t8,
                        ok=bool(torch.isfinite(dgu.float()).all()),
                        note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                             f"speedup bf16/fp8 {t16 / t8:.2f}x; relL1 vs bf16 {_errors(dgu, dgu16)[1]:.1e}"))
    dguq, dgus = qf.quantize_fp8_block_act(dgu16)
    t8 = bench_us(lambda: fx.grouped_dgrad1_fp8_block(dguq, dgus, offs, *w1t, out=dx))
    t16 = bench_us(lambda: bwd.grouped_dgrad1(dgu16, offs, wg, wu, out=dx16))
    flops = 2.0 * m * 2 * inter * hid
    rows_out.append(Row(f"bench fp8 dgrad1 {e}x{rows} H={hid} I={inter}", time_us=t8,
                        ok=bool(torch.isfinite(dx.float()).all()),
                        note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                             f"speedup bf16/fp8 {t16 / t8:.2f}x; relL1 vs bf16 {_errors(dx, dx16)[1]:.1e}"))
    return rows_out


def _check_expert_zero_rows(fx, dev):
    f8 = torch.float8_e4m3fn
    offs = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    xq = torch.zeros(0, HID, dtype=f8, device=dev)
    xs = torch.zeros(0, HID // BLK, device=dev)
    w = torch.zeros(E, INTER, HID, dtype=f8, device=dev)
    ws = torch.ones(E, INTER // BLK, HID // BLK, device=dev)
    gu, h = fx.grouped_gemm1_swiglu_fp8_block(xq, xs, offs, w, ws, w, ws)
    dgu = fx.grouped_dswiglu_dgrad_fp8_block(xq, xs, offs, w, ws, torch.zeros(0, 2 * INTER, dtype=torch.bfloat16,
                                                                               device=dev))
    w1t, w1ts = fx.transpose_weight_blocks((w, ws), (w, ws))
    dx = fx.grouped_dgrad1_fp8_block(torch.zeros(0, 2 * INTER, dtype=f8, device=dev),
                                     torch.zeros(0, 2 * INTER // BLK, device=dev), offs, w1t, w1ts)
    torch.cuda.synchronize()
    shapes = [tuple(t.shape) for t in (gu, h, dgu, dx)]
    ok = shapes == [(0, 2 * INTER), (0, INTER), (0, 2 * INTER), (0, HID)]
    return Row("fp8 expert kernels zero total rows", ok=ok, note=f"out shapes {shapes}")


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_fp8"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels.quant import quantize_fp8 as qf  # noqa: PLC0415
    from mok_cute.kernels.sm90 import expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels.sm90 import fp8_expert as fx  # noqa: PLC0415
    from mok_cute.kernels.sm90 import fp8_gemm as fg  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415
    from mok_cute.dsl.compile import cache_stats  # noqa: PLC0415

    global SERIAL  # noqa: PLW0603
    SERIAL = fg.Fp8MainloopConfig(overlap_promotion=False)
    dev = ctx.device
    gen = seeded(4321)
    rows = _rows(_guarded("fp8 uniform", _check_routing, fg, qf, ref, dev, gen, "uniform"))
    for limit in (None, 4.0):
        rows.append(_guarded(f"fp8 gemm1 swiglu uniform L={limit}", _check_gemm1, fx, qf, ref, dev, gen, "uniform",
                             limit))
        rows.append(_guarded(f"fp8 dswiglu dgrad uniform L={limit}", _check_dswiglu, fx, qf, ref, dev, gen,
                             "uniform", limit))
    rows.append(_guarded("fp8 dgrad1 uniform", _check_dgrad1, fx, qf, ref, dev, gen, "uniform"))
    compiles = cache_stats()["compiles"]
    rows += _rows(_guarded("fp8 skewed", _check_routing, fg, qf, ref, dev, gen, "skewed"))
    for limit in (None, 4.0):
        rows.append(_guarded(f"fp8 gemm1 swiglu skewed L={limit}", _check_gemm1, fx, qf, ref, dev, gen, "skewed",
                             limit))
        rows.append(_guarded(f"fp8 dswiglu dgrad skewed L={limit}", _check_dswiglu, fx, qf, ref, dev, gen,
                             "skewed", limit))
    rows.append(_guarded("fp8 dgrad1 skewed", _check_dgrad1, fx, qf, ref, dev, gen, "skewed"))
    rows.append(_guarded("fp8 zero rows", _check_zero_rows, fg, qf, dev))
    rows.append(_guarded("fp8 expert zero rows", _check_expert_zero_rows, fx, dev))
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("fp8 no recompile for new counts", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows += _rows(_guarded("bench fp8_block gemm", _bench, fg, qf, gg, ref, dev))
    rows += _rows(_guarded("bench fp8 expert kernels", _bench_experts, fx, qf, gg, bwd, ref, dev))
    return rows

"""Device check: SM90 FP8 blockwise grouped GEMM (mok_cute.kernels.sm90_fp8_gemm.grouped_gemm_fp8_block)
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
Each GEMM row is repeated for the opt-in overlapped-promotion consumer
(Fp8MainloopConfig(overlap_promotion=True)): the same checks, plus bitwise equality with the
default kernel's output. Then: zero total rows, no recompile for new counts, and one timed shape (8 experts x 4096
rows, K = H = 7168, N = 4096): FP8 GEMM time (operands pre-quantized), TFLOP/s, and the BF16
plain grouped GEMM (sm90_grouped_gemm.grouped_gemm) at the same shape timed in the same row;
a second row times the overlapped-promotion variant beside the default and BF16.
"""
from __future__ import annotations

import torch

from checks.common import Row, bench_us, seeded, sm90_skip
from checks.gemm_sm90 import _counts, _errors, _guarded, _offsets, _poisoned, _row

REPEATS = 5
E, K, N = 8, 1024, 1024  # correctness shape (E must match gemm_sm90._counts)
BENCH = (8, 4096, 7168, 4096)  # experts, rows per expert, K (= H), N
BLK = 128
OVERLAP = None  # Fp8MainloopConfig(overlap_promotion=True), set in run() (imports the DSL lazily)


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

    def gemm_overlap(want, default_out):
        """The opt-in overlapped-promotion consumer: same checks, and bitwise equal to the
        default (same wgmma batches, same FMA order by construction; a read of in-flight
        wgmma registers would show here)."""
        outs = []
        for _ in range(REPEATS):
            (out,) = _poisoned((m, N), device=dev)
            outs.append(fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out, cfg=OVERLAP))
        (out,) = _poisoned((m, N), device=dev)
        via_ref = fg.grouped_gemm_fp8_block(ra, rsa, offs, wq, ws, out=out, cfg=OVERLAP)
        torch.cuda.synchronize()
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        same_ref_ops = torch.equal(outs[0], via_ref)
        same_default = default_out is not None and torch.equal(outs[0], default_out)
        row = _row(f"fp8_block gemm overlap {routing}", [outs[0]], [want], same,
                   f"== default bitwise={same_default} ref-quantized operands bitwise={same_ref_ops} M={m}")
        row.ok = row.ok and same_ref_ops and same_default
        return row

    res = _guarded(f"fp8_block gemm {routing}", gemm)
    if isinstance(res, Row):  # crashed: still run the overlap variant against the reference
        want, default_out = ref.grouped_gemm(x, offs, w, precision="fp8_block"), None
        rows = [q_row, res]
    else:
        row, want, default_out = res
        rows = [q_row, row]
    return rows + [_guarded(f"fp8_block gemm overlap {routing}", gemm_overlap, want, default_out)]


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
    out8o = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    t8 = bench_us(lambda: fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out8))
    t8o = bench_us(lambda: fg.grouped_gemm_fp8_block(qa, sa, offs, wq, ws, out=out8o, cfg=OVERLAP))
    t16 = bench_us(lambda: gg.grouped_gemm(x, offs, w, out=out16))
    tq = bench_us(lambda: qf.quantize_fp8_block_act(x))
    torch.cuda.synchronize()
    flops = 2.0 * m * k * n
    finite = bool(torch.isfinite(out8.float()).all())
    _, rel, _ = _errors(out8, out16)  # quantization error, for information only
    same = torch.equal(out8, out8o)
    return [Row(f"bench fp8_block gemm {e}x{rows} K={k} N={n}", time_us=t8, ok=finite,
                note=f"{flops / t8 / 1e6:.0f} TFLOP/s; bf16 plain {t16:.1f} us {flops / t16 / 1e6:.0f} TFLOP/s; "
                     f"speedup bf16/fp8 {t16 / t8:.2f}x; +act quantize {tq:.1f} us; "
                     f"finite={finite} relL1 vs bf16 {rel:.1e}"),
            Row(f"bench fp8_block gemm overlap {e}x{rows} K={k} N={n}", time_us=t8o, bitwise=same, ok=same,
                note=f"{flops / t8o / 1e6:.0f} TFLOP/s; default {t8:.1f} us {flops / t8 / 1e6:.0f} TFLOP/s "
                     f"(overlap/default speedup {t8 / t8o:.2f}x); bf16 plain {t16:.1f} us; "
                     f"speedup bf16/overlap {t16 / t8o:.2f}x; == default bitwise={same}")]


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_fp8"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels import quantize_fp8 as qf  # noqa: PLC0415
    from mok_cute.kernels import sm90_fp8_gemm as fg  # noqa: PLC0415
    from mok_cute.kernels import sm90_grouped_gemm as gg  # noqa: PLC0415
    from mok_cute.kernels.compile import cache_stats  # noqa: PLC0415

    global OVERLAP  # noqa: PLW0603
    OVERLAP = fg.Fp8MainloopConfig(overlap_promotion=True)
    dev = ctx.device
    gen = seeded(4321)
    rows = _rows(_guarded("fp8 uniform", _check_routing, fg, qf, ref, dev, gen, "uniform"))
    compiles = cache_stats()["compiles"]
    rows += _rows(_guarded("fp8 skewed", _check_routing, fg, qf, ref, dev, gen, "skewed"))
    rows.append(_guarded("fp8 zero rows", _check_zero_rows, fg, qf, dev))
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("fp8 no recompile for new counts", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows += _rows(_guarded("bench fp8_block gemm", _bench, fg, qf, gg, ref, dev))
    return rows

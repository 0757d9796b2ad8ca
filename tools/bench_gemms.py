"""The expert GEMMs of one MoE layer shape run alone, ours (SM90 grouped kernels) beside ``torch._grouped_mm``:
CUDA-event times, TFLOP/s and the MMA rate as microseconds per 128 x 256 x 64 k-tile on each SM (the yardstick of
docs/performance.md's per-task tables), so that the fused kernels' tiles can be compared with the same GEMMs alone.

    python -m tools.bench_gemms [--shape NAME | T,H,I,E,k] [--rounds 3] [--iters 20] [--ncu]

Rows are grouped by expert (random balanced routing, T*k rows); operands bf16 random. Ours: GEMM1 plain and with the
SwiGLU epilogue (K = H), GEMM2 (K = I), dgrad2 + dSwiGLU (K = H), dgrad1 (K = 2I), the dW_down weight gradient;
torch: the same products through ``torch._grouped_mm`` (cuBLAS / CUTLASS grouped GEMM, no epilogue math).
``--ncu``: run each kernel once between ``cudaProfilerStart`` / ``Stop`` after the warm-up and exit (for
``ncu --profile-from-start off ... python -m tools.bench_gemms --ncu``; tools.ncu_step's columns).
"""
from __future__ import annotations

import argparse
import sys

SM_COUNT_REF = 132  # the k-tile rate is per SM of an H100 / H200 (132 SMs)


def cases(t: int, h: int, i: int, e: int, k: int, device: str = "cuda") -> dict:
    """``{name: (call, flop, n, k_depth)}`` of the layer's GEMMs on fresh random operands."""
    import torch

    from mok_cute.kernels.sm90 import expert_bwd as eb
    from mok_cute.kernels.sm90 import grouped_gemm as gg
    from mok_cute.schedule.group_tiles import total_tiles

    m = t * k
    gen = torch.Generator().manual_seed(0)
    cnt = torch.multinomial(torch.ones(e), m, replacement=True, generator=gen).bincount(minlength=e)
    offs = torch.zeros(e + 1, dtype=torch.int32)
    offs[1:] = cnt.cumsum(0)
    offs = offs.to(device)
    ends = offs[1:].contiguous()

    def r(*shape):
        return (torch.randn(*shape, device=device) * 0.05).to(torch.bfloat16)

    x, w1, h_rows, w2, dy, gu, dgu = r(m, h), r(e, 2 * i, h), r(m, i), r(e, h, i), r(m, h), r(m, 2 * i), r(m, 2 * i)
    wg, wu = w1[:, :i].contiguous(), w1[:, i:].contiguous()
    f1, f2 = 2 * m * 2 * i * h, 2 * m * h * i
    return {
        "ours GEMM1 plain": (lambda: gg.grouped_gemm(x, offs, w1), f1, 2 * i, h),
        "ours GEMM1 + SwiGLU": (lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu), f1, 2 * i, h),
        "ours GEMM2": (lambda: gg.grouped_gemm(h_rows, offs, w2), f2, h, i),
        "ours dgrad2 + dSwiGLU": (lambda: eb.grouped_dswiglu_dgrad(dy, offs, w2, gu), f2, i, h),
        "ours dgrad1": (lambda: eb.grouped_dgrad1(dgu, offs, wg, wu), f1, h, 2 * i),
        "ours dW_down": (lambda: eb.grouped_wgrad(h_rows, dy, offs), f2, h, i),
        "torch GEMM1": (lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends), f1, 2 * i, h),
        "torch GEMM2": (lambda: torch._grouped_mm(h_rows, w2.transpose(-2, -1), offs=ends), f2, h, i),
        "torch dgrad2": (lambda: torch._grouped_mm(dy, w2, offs=ends), f2, i, h),
        "torch dgrad1": (lambda: torch._grouped_mm(dgu, w1, offs=ends), f1, h, 2 * i),
    }, total_tiles(offs.tolist(), 128, 1)


def ktile_us(ms: float, m_tiles: int, n: int, depth: int) -> float:
    """Microseconds per 128 x 256 x 64 k-tile on each of :data:`SM_COUNT_REF` SMs, for a GEMM of ``m_tiles``
    128-row tiles, N = ``n`` and K = ``depth`` taking ``ms``."""
    from mok_cute.schedule.group_tiles import mtiles

    k_tiles = m_tiles * mtiles(0, n, 256) * (depth // 64)
    return ms * 1e3 * SM_COUNT_REF / k_tiles


def main(argv: list[str] | None = None) -> int:
    import torch

    from tools.mem_peak import parse_shape

    ap = argparse.ArgumentParser(prog="python -m tools.bench_gemms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("qwen3-30b-a3b"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ncu", action="store_true", help="one call each between profiler start / stop, no table")
    args = ap.parse_args(argv)
    s = args.shape
    calls, m_tiles = cases(s.t, s.h, s.i, s.e, s.k)
    for f, *_ in calls.values():  # compile and warm up
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    if args.ncu:
        torch.cuda.profiler.start()
        for f, *_ in calls.values():
            f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    times = {name: [] for name in calls}
    for _ in range(args.rounds):  # interleaved rounds
        for name, (f, *_) in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                f()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / args.iters)
    print(f"{torch.cuda.get_device_name()}, {s.dims}: {s.t * s.k} rows, {m_tiles} m-tiles of 128")
    print("| kernel | ms (best of rounds) | TFLOP/s | us per 128x256x64 k-tile and SM |\n|---|---|---|---|")
    for name, (_, flop, n, depth) in calls.items():
        ms = min(times[name])
        print(f"| {name} | {ms:.3f} | {flop / ms / 1e9:.0f} | {ktile_us(ms, m_tiles, n, depth):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

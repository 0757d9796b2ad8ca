"""The fixed cost per output tile of the SM90 GEMM1 kernels: time against the reduction depth K.

At M = ``--experts`` x ``--rows`` grouped rows and N = 2I (GEMM1's gate and up), each of our
GEMM1 + SwiGLU kernel (h by its helper warps, the default, and by its MMA warps), our plain
grouped GEMM and torch's ``F.grouped_mm`` (CUTLASS) runs at several K; a straight line
``t = a + b K`` fitted per kernel splits its time into what grows with K (the mainloop) and what
each tile pays once (``a``: epilogue, pipeline fill, the last wave). The helpers run from
``grouped_gemm.HELPERS_MIN_K``: below it both SwiGLU rows are the same kernel.
CUDA events over bursts of ``--iters`` calls, median of ``--passes`` (boost clocks: a comparison,
not a steady-state figure):

    source .gpu-node/activate.sh && python3 tools/bench_tile_overhead.py [--ks 512,1024,2048,4096,7168]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks.common import bench_pipelined_us  # noqa: E402


def _fit(ks: list[int], ts: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``t = a + b k``."""
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    b = sum((k - mk) * (t - mt) for k, t in zip(ks, ts)) / sum((k - mk) ** 2 for k in ks)
    return mt - b * mk, b


def main() -> int:
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="512,1024,2048,4096,7168")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    e, rows, inter = args.experts, args.rows, args.inter
    m = e * rows
    offs = torch.arange(0, m + 1, rows, device=dev, dtype=torch.int32)
    ks = [int(k) for k in args.ks.split(",")]
    names = ("ours GEMM1+SwiGLU", "ours GEMM1+SwiGLU, h by the MMA warps", "ours plain GEMM", "torch F.grouped_mm")

    def no_helpers(fn):
        def run():
            was = gg.set_swiglu_helpers(False)
            try:
                return fn()
            finally:
                gg.set_swiglu_helpers(was)
        return run

    times: dict[str, list[float]] = {n: [] for n in names}
    for k in ks:
        x = torch.randn(m, k, device=dev).bfloat16()
        wg = (torch.randn(e, inter, k, device=dev) * k ** -0.5).bfloat16()
        wu = (torch.randn(e, inter, k, device=dev) * k ** -0.5).bfloat16()
        w1 = torch.cat([wg, wu], dim=1).contiguous()
        w1t = w1.transpose(1, 2)
        fns = (lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=None),
               no_helpers(lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=None)),
               lambda: gg.grouped_gemm(x, offs, w1),
               lambda: F.grouped_mm(x, w1t, offs=offs[1:]))
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        per = {n: [] for n in names}
        for _ in range(args.passes):  # the kernels interleaved pass by pass
            for n, fn in zip(names, fns):
                per[n].append(bench_pipelined_us(fn, warmup=0, iters=args.iters))
        for n in names:
            times[n].append(statistics.median(per[n]))
    tiles = e * -(-rows // 128) * (2 * inter // 256)
    waves = tiles / torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"M {m} ({e} x {rows}), N {2 * inter}: {tiles} tiles of 128 x 256, {waves:.2f} waves; us per call")
    print("| kernel | " + " | ".join(f"K {k}" for k in ks) + " | a (us) | b (us per 1024 K) | a per wave (us) |")
    print("|---|" + "---|" * (len(ks) + 3))
    for n in names:
        a, b = _fit(ks, times[n])
        print(f"| {n} | " + " | ".join(f"{t:.1f}" for t in times[n]) + f" | {a:.1f} | {b * 1024:.1f} | {a / waves:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

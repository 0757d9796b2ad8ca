"""The forward's four GEMMs run alone (the standalone grouped kernels of ``bench_layer.gemms_alone``), each
as SM-time per 128-row tile (time x SMs / tiles): directly comparable with the fused forward's per-task
durations in its trace (``bench_layer.py --trace``, ``trace_view.kind_stats``), so that a fused tile kind
slower than its standalone kernel's tile is told apart from one that is slow alone.

    source .gpu-node/activate.sh && python3 tools/tile_rates.py [--shapes 0,1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, tile_operands  # noqa: E402
from checks.common import bench_us  # noqa: E402
from checks.layer_sm90 import _problem  # noqa: E402


def tile_count(offsets: list[int], n_out: int, tile_m: int = 128, tile_n: int = 256) -> int:
    """Output tiles of a grouped GEMM: per group ceil(rows / tile_m) x ceil(n_out / tile_n)."""
    return sum(-(-(b - a) // tile_m) for a, b in zip(offsets, offsets[1:])) * -(-n_out // tile_n)


def rates(t, h, inter, e, k, skew, dev) -> list[tuple[str, int, float, float]]:
    """(GEMM, tiles, us per call, SM-us per tile) of the routed and shared GEMM1 + SwiGLU and GEMM2."""
    from mok_cute.kernels.sm90 import grouped_gemm as g

    x, idx, _, ws, sh, _ = _problem(t, h, inter, e, k, True, skew, dev, seed=5)
    rows, offsets, ws, sh_w, sh_offs = tile_operands(x, idx, ws, sh)
    h_r = g._run_gemm1_swiglu(rows, offsets, ws[0], ws[1], None)[1]
    h_s = g._run_gemm1_swiglu(x, sh_offs, sh_w[0], sh_w[1], None)[1]
    offs = offsets.tolist()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    runs = (("R1 routed GEMM1+SwiGLU", offs, 2 * inter, lambda: g._run_gemm1_swiglu(rows, offsets, ws[0], ws[1], None)),
            ("S1 shared GEMM1+SwiGLU", [0, t], 2 * inter, lambda: g._run_gemm1_swiglu(x, sh_offs, sh_w[0], sh_w[1], None)),
            ("R2 routed GEMM2", offs, h, lambda: g._run_gemm(h_r, offsets, ws[2])),
            ("S2 shared GEMM2", [0, t], h, lambda: g._run_gemm(h_s, sh_offs, sh_w[2])))
    out = []
    for name, o, n_out, fn in runs:
        n = tile_count(o, n_out)
        us = bench_us(fn)
        out.append((name, n, us, us * sms / n))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1", help="bench_layer.SHAPES indices")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print("| shape | GEMM | tiles | us per call | SM-us per tile |\n|---|---|---|---|---|")
    for i in (int(s) for s in args.shapes.split(",")):
        t, h, inter, e, k, skew = SHAPES[i]
        label = f"T{t} H{h} I{inter} E{e} k{k}{' skew' if skew else ''}"
        for name, n, us, per in rates(t, h, inter, e, k, skew, dev):
            print(f"| {label} | {name} | {n} | {us:.0f} | {per:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Power drawn by the fused forward's two kinds of phase at the H200's cap, by proxies run back to back
(steady state): the slot sum's HBM pass (a [T*k, H] bf16 slot buffer summed over the k slots of each token
into [T, H] bf16: the bytes of the slot sum after the last GEMM2 tile), the GEMM tiles alone (tensor-bound,
``bench_layer.gemms_alone``), and the idle GPU. Per row: time per call, bytes moved per second (the sum
pass), SM clock and mean power over every sample. Whether overlapping the slot sum with GEMM tiles can pay at
the cap: the capped phases absorb only the share of the pass's power above the idle GPU's.

    source .gpu-node/activate.sh && python3 tools/phase_power.py [--shapes 3,0] [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, gemms_alone  # noqa: E402
from checks.common import PowerSampler, power_summary  # noqa: E402
from checks.layer_sm90 import _problem  # noqa: E402
from energy_fwd import steady_run  # noqa: E402


def _measure(fn, seconds: float) -> tuple[float, str]:
    """(us per call, power summary over every sample) of ``fn`` back to back for ``seconds`` after as long a
    warm-up (``fn`` None: the GPU left idle)."""
    if fn is None:
        with PowerSampler() as ps:
            time.sleep(seconds)
        return float("nan"), power_summary(ps.lines, busy_w=0.0)
    us, lines = steady_run(fn, seconds, ms=250)
    return us, power_summary(lines, busy_w=0.0)


def _shape_rows(t: int, h: int, inter: int, e: int, k: int, skew: bool, seconds: float) -> list[tuple]:
    name = f"T{t} H{h} I{inter} E{e} k{k}"
    slot = torch.randn(t * k, h, device="cuda").bfloat16()
    y = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
    us, power = _measure(lambda: torch.sum(slot.view(t, k, h), dim=1, out=y), seconds)
    rows = [("slot-sum pass", name, us, power, f"{(t * k + t) * h * 2 / us / 1e6:.2f} TB/s")]
    x, idx, _, ws, sh, _ = _problem(t, h, inter, e, k, True, skew, torch.device("cuda"), seed=11)
    us, power = _measure(gemms_alone(x, idx, ws, sh), seconds)
    return rows + [("GEMM tiles alone", name, us, power, "-")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="3,0", help="bench_layer.SHAPES indices")
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    rows = [("idle GPU", "-", *_measure(None, args.seconds), "-")]
    for i in (int(s) for s in args.shapes.split(",")):
        rows += _shape_rows(*SHAPES[i], args.seconds)
        torch.cuda.empty_cache()
    print("| proxy | shape (+ shared) | us per call | power (every sample) | HBM rate |")
    print("|---|---|---|---|---|")
    for kind, name, us, power, rate in rows:
        print(f"| {kind} | {name} | {us:.0f} | {power} | {rate} |")


if __name__ == "__main__":
    main()

"""What is allocated at the peak of one layer forward + backward (sm90 backend, EP = 1): replays
torch's allocator trace of one step (after two warm-up steps: the weight caches and kernels
are built) and prints, at the moment of the highest allocation above the step's start, every
live block of the step by size with the mok_cute / tools frame that allocated it.

    source .gpu-node/activate.sh && python3 tools/mem_peak.py [--shape T,H,I,E,k] [--precision mxfp8] [--top 16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks.layer_sm90 import _problem  # noqa: E402


def _where(frames: list) -> str:
    """The innermost frame of this project (mok_cute or tools), as ``file:line function``."""
    for f in frames:
        name = f.get("filename", "")
        if "/mok_cute/" in name or "/tools/" in name:
            return f"{name.split('/mok_cute/')[-1].split('/tools/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def peak_blocks(trace: list) -> tuple[int, dict]:
    """(the peak's bytes above the trace's start, the blocks live then: addr -> (size, frames))."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif act in ("free_requested", "free_completed") and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    return peak, at_peak


def main() -> int:
    import mok_cute

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048,7168,2048,16,8")
    ap.add_argument("--precision", default="mxfp8")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    t, h, inter, e, k = (int(v) for v in args.shape.split(","))
    x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, False, torch.device("cuda"), seed=3)
    leaves = [a.requires_grad_() for a in (x, w, *ws, *sh)]
    cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False, precision=args.precision)

    def step():
        for p in leaves:
            p.grad = None
        y = mok_cute.moe(x, idx, w, *ws, shared=sh, config=cfg)
        torch.autograd.backward(y, dy)
        del y

    for _ in range(2):
        step()
    for p in leaves:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    peak, blocks = peak_blocks(snap["device_traces"][torch.cuda.current_device()])
    mb = 2 ** 20
    print(f"T{t} H{h} I{inter} E{e} k{k} + shared, {args.precision}: peak above the step's start "
          f"{measured:.0f} MB (max_memory_allocated), {peak / mb:.0f} MB (trace replay)")
    print("| MB | allocated at |\n|---|---|")
    for size, frames in sorted(blocks.values(), key=lambda b: -b[0])[:args.top]:
        print(f"| {size / mb:.1f} | {_where(frames)} |")
    rest = sorted(blocks.values(), key=lambda b: -b[0])[args.top:]
    print(f"| {sum(s for s, _ in rest) / mb:.1f} | {len(rest)} smaller blocks |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

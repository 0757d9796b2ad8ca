"""What is allocated at the peak of one layer forward + backward (one GPU, EP = 1): replays
torch's allocator trace of one step (after two warm-up steps: the weight caches and kernels
are built) and prints, at the moment of the highest allocation above the step's start, every
live block of the step by size with the mok_cute / tools frame that allocated it.

    python -m tools.mem_peak [--shape NAME | T,H,I,E,k] [--precision mxfp8] [--top 16]

``--shape``: a shape of ``python -m mok_cute.bench --list-shapes``, or T,H,I,E,k with a shared
expert of width I (default 2048,7168,2048,16,8).
"""
from __future__ import annotations

import argparse
import sys

import torch

from mok_cute.bench.shapes import Shape, make_inputs, parse


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


def parse_shape(text: str) -> Shape:
    """``--shape``: :func:`mok_cute.bench.shapes.parse` for argparse."""
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    import mok_cute

    ap = argparse.ArgumentParser(prog="python -m tools.mem_peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("2048,7168,2048,16,8"))
    ap.add_argument("--precision", default="mxfp8")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args(argv)
    s = args.shape
    inputs, dy = make_inputs(s, torch.device("cuda"), seed=3)
    shared = inputs.pop("shared")
    leaves = [inputs[n].requires_grad_() for n in ("x", "topk_w", "w_gate", "w_up", "w_down")]
    leaves += [w.requires_grad_() for w in shared or ()]
    cfg = mok_cute.MoKConfig(validate_routing=False, precision=args.precision)

    def step():
        for p in leaves:
            p.grad = None
        y = mok_cute.moe(**inputs, shared=shared, swiglu_limit=s.limit, config=cfg)
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
    print(f"{s.dims}, {args.precision}: peak above the step's start {measured:.0f} MB (max_memory_allocated), "
          f"{peak / mb:.0f} MB (trace replay)")
    print("| MB | allocated at |\n|---|---|")
    for size, frames in sorted(blocks.values(), key=lambda b: -b[0])[:args.top]:
        print(f"| {size / mb:.1f} | {_where(frames)} |")
    rest = sorted(blocks.values(), key=lambda b: -b[0])[args.top:]
    print(f"| {sum(size for size, _ in rest) / mb:.1f} | {len(rest)} smaller blocks |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

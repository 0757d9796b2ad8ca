"""Stress the fused SM90 forward launch by launch (H200): every routing case of the fused_fwd
check x ``--comm`` values x ``--ring`` sizes (slots of 128 rows; 0: one per m-tile) x ``--reps`` repeats, each launch synchronised and timed, with a
short device timeout so a stall shows in seconds. On an error it prints the status words and
the readiness counters that fell short (which gather chunk / m-tile / ticket), so a stall
names its wait. y must be bitwise the same for every launch of a case.

    python3 tools/fused_stress.py [--comm 2,8,40] [--ring 0,2,16] [--reps 3] [--timeout 3] [--progress]

With ``--progress`` the kernel's progress variant runs (MOK_CUTE_FUSED_PROGRESS=1): if a
launch has not finished ``2 * timeout + 5`` s after it started (a stall that no bounded wait
catches), the per-CTA progress words are read from host memory while the kernel still runs,
printed grouped by state, and the process exits (code 2).

Prints one line per (case, comm) and a summary table last; exit code 1 on any error.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks.layer_sm90 import _problem  # noqa: E402

CASES = (("uniform", False, False, None), ("skew+shared L=4", True, True, 4.0), ("skew", True, False, None),
         ("uniform+shared", False, True, None), ("one expert+shared L=4", False, True, 4.0))


def _shortfalls(counters, n1: int, n1s: int, mtiles: int) -> str:
    """The readiness counters that did not reach their targets (first few of each; gather and h
    over the launch's ``mtiles`` routed m-tiles, the rest of their arrays is never used)."""
    gather, h_ready, sh_ready, done, status = (c.cpu() for c in counters)
    out = []
    for name, c, target in (("gather", gather[:mtiles], 1), ("h", h_ready[:mtiles], n1), ("sh", sh_ready, n1s)):
        short = (c < target).nonzero().flatten().tolist()
        if short:
            out.append(f"{name}<{target} at {short[:6]}{'...' if len(short) > 6 else ''} (of {c.numel()})")
    out.append(f"done={int(done[0])} ticket={int(done[1])}")
    return "; ".join(out)


def _dump_progress(words) -> None:
    """Print the progress words of every CTA, grouped by (producer, consumers, CTA, sum) state."""
    from mok_cute.kernels.sm90.fused_moe import PROGRESS_STATES

    groups = collections.defaultdict(list)
    for cta, row in enumerate(words.tolist()):
        state = tuple((v >> 32, v & 0xFFFFFFFF) for v in row)
        groups[tuple(code for code, _ in state)].append((cta, state))
    print("progress (producer | consumers | CTA | slot sum): CTAs")
    for codes, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        names = [d.get(c, str(c)) if c else "-" for d, c in zip(PROGRESS_STATES, codes)]
        detail = " ".join(f"{cta}:{'/'.join(str(v) for _, v in st)}" for cta, st in members[:12])
        print(f"  {' | '.join(names)}: {len(members)} CTAs  [{detail}{' ...' if len(members) > 12 else ''}]")


def _launch(fused, args_, comm, ring, timeout, watch):
    """One launch, synchronised; with ``watch`` a stall dumps the progress words and exits."""
    out = fused.fused_forward(*args_, comm, timeout, ring_chunks=ring or None)
    if watch:
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.perf_counter() + 2 * timeout + 5
        while not ev.query():
            if time.perf_counter() > deadline:
                print(f"STALL: launch with comm {comm} still running after {2 * timeout + 5:.0f} s", flush=True)
                _dump_progress(fused.last_progress())
                sys.stdout.flush()
                os._exit(2)
            time.sleep(0.01)
    torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comm", default="2,4,8,16,40,64,131")
    ap.add_argument("--ring", default="0,2,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--shape", default="1000,1024,512,8,4", help="T,H,I,E,k")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    if args.progress:
        os.environ["MOK_CUTE_FUSED_PROGRESS"] = "1"
    from mok_cute.kernels.sm90 import fused_moe as fused
    from mok_cute.layers.grouped import route_sort
    from mok_cute.schedule.fused_tasks import mtile_rows

    dev = torch.device("cuda")
    t, h, inter, e, k = (int(v) for v in args.shape.split(","))
    runs = [(int(c), int(r)) for c in args.comm.split(",") for r in args.ring.split(",")]
    bad, table = 0, []
    for ci, (name, skew, shared, limit) in enumerate(CASES):
        x, idx, w, ws, sh, _ = _problem(t, h, inter, e, k, shared, skew, dev, seed=300 + ci)
        if name.startswith("one expert"):
            idx = torch.full_like(idx, -1)
            idx[:, 0] = 3
        order, offsets, _ = route_sort(idx, e)
        mtiles = len(mtile_rows(offsets.tolist(), 128))
        args_ = (x, order.to(torch.int32), offsets, idx.to(torch.int32), w, *ws, sh, limit)
        first = None
        for comm, ring in runs:
            times, errs = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                out = _launch(fused, args_, comm, ring, args.timeout, args.progress)
                times.append((time.perf_counter() - t0) * 1e3)
                counters = out[7]
                msg = fused.describe(counters[-1].tolist())
                if msg:
                    errs.append(f"{msg} | {_shortfalls(counters, inter // 128, 0 if sh is None else inter // 128, mtiles)}")
                elif first is None:
                    first = out[0].clone()
                elif not torch.equal(first, out[0]):
                    errs.append("y differs bitwise from the first launch")
            bad += bool(errs)
            line = f"{name:24s} comm {comm:3d} ring {ring:3d}: ms {' '.join(f'{v:.1f}' for v in times)}"
            print(line + ("" if not errs else "  ERROR " + errs[0]), flush=True)
            table.append((name, comm, ring, max(times), "ok" if not errs else "ERROR"))
    print("\n| case | comm CTAs | ring slots | worst launch ms | result |\n|---|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2] or 'all'} | {r[3]:.1f} | {r[4]} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

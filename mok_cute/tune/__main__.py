"""``python -m mok_cute.tune``: tune one layer shape on this GPU and write the winner to the tuning file.

Prints every candidate's time against the current best (and whether it was bitwise the default),
then the winner and its margin over the default, measured side by side; the entry is written to
the user's tuning file (``--file`` to choose another, ``--no-write`` for none), where every layer call
of that GPU, shape, EP and precision finds it (``MoKConfig(tuned=False)`` opts out).
"""
from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    from mok_cute.bench.shapes import add_size_args
    from mok_cute.config import PRECISIONS

    ap = argparse.ArgumentParser(prog="python -m mok_cute.tune", description=__doc__.split("\n\n")[0],
                                 epilog="Example: python -m mok_cute.tune --hidden 2048 --inter 768 --experts 128 "
                                        "--topk 8 --tokens 16384. At EP > 1: torchrun --nproc_per_node N -m "
                                        "mok_cute.tune ... --ep N.")
    add_size_args(ap, "E, the routed experts in all (E / ep per rank)",
                  "T, tokens per rank per layer call (micro-batch x sequence)",
                  "each with its own shared expert and clamp, tuned one after the other")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1; > 1 under torchrun)")
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--limit", type=float, default=None, help="the SwiGLU clamp (default: none)")
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                    help="tune the training step (default) or, with --no-backward, the forward alone")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per comparison (default 5)")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed round (default 10)")
    ap.add_argument("--margin", type=float, default=0.01, help="a candidate replaces the current best only when "
                                                               "faster by more than this fraction (default 0.01)")
    ap.add_argument("--file", default="default", help="the tuning file to write (default: the user's, "
                                                      "$MOK_CUTE_TUNING_FILE or ~/.cache/mok_cute/tuning.json)")
    ap.add_argument("--no-write", action="store_true", help="print the result, write nothing")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    import os

    dims = ("hidden", "inter", "experts", "topk", "tokens")
    if args.shape is None and any(getattr(args, d) is None for d in dims):
        ap.error("give --hidden, --inter, --experts, --topk and --tokens, or --shape NAME ...")
    if args.shape is not None and any(getattr(args, d) is not None for d in dims):
        ap.error("give either --shape or the five sizes, not both")
    try:
        problems = _problems(args)
    except ValueError as e:
        ap.error(str(e))

    if args.ep > 1:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    from mok_cute import tuning
    from mok_cute.dsl import env
    from mok_cute.tune import tune

    file = None if args.no_write else args.file
    for p in problems:
        try:
            result = tune(p.hidden, p.inter, p.experts, p.topk, p.tokens, shared=p.shared, ep=p.ep,
                          precision=p.precision, backward=p.backward, limit=p.limit, rounds=args.rounds,
                          iters=args.iters, margin=args.margin, file=file, progress=not args.no_progress, report=True)
        except ValueError as e:
            print(f"mok_cute.tune: {e}", file=sys.stderr)
            return 2
        if args.ep == 1 or __import__("torch").distributed.get_rank() == 0:
            print(f"\n{result.key.describe()}\n")
            print(result.table(), flush=True)
    where = tuning.user_file() if file == "default" else file
    why = "--no-write" if file is None else f"{env.TUNING_FILE} is off"
    print(f"\nwritten to {where}" if where else f"\nnot written ({why})")
    return 0


def _problems(args) -> list:
    """The :class:`~mok_cute.tune.search.Problem` of each shape asked for (ValueError for a bad one)."""
    from mok_cute.bench.shapes import pick
    from mok_cute.tune.search import Problem

    common = dict(ep=args.ep, precision=args.precision, backward=args.backward)
    if args.shape is None:
        return [Problem(args.tokens, args.hidden, args.inter, args.experts, args.topk, args.shared, limit=args.limit,
                        **common)]
    return [Problem(s.t, s.h, s.i, s.e, s.k, s.shared_i, limit=s.limit, **common) for s in pick(args.shape)]


if __name__ == "__main__":
    sys.exit(main())

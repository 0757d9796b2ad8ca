"""``python -m mok_cute.bench``: the mok_cute layer against the torch layer, per model shape and precision.

    python -m mok_cute.bench [--shapes NAME ...] [--precision bf16 mxfp8 ...] [--tokens T]
        [--rounds 5] [--iters 10] [--warmup 3] [--config FIELD=VALUE ...] [--out PREFIX]
        [--plot DIR] [--trace-shape NAME] [--save-outputs FILE] [--digests] [--no-progress] [--list-shapes]

On one CUDA GPU (EP = 1), per shape (:data:`mok_cute.bench.shapes.SHAPES`): the torch layer a
PyTorch user writes (:mod:`mok_cute.bench.torch_layer`, BF16) and ``mok_cute.moe`` at each
precision, on the same inputs, timed as :mod:`mok_cute.bench.run` says (warm-up, CUDA events,
interleaved rounds, the median round). Prints a table (shape, precision, ms of each, speed-up
torch / mok), writes ``PREFIX.json`` and ``PREFIX.csv``; ``--plot DIR`` writes ``speedup.png``
and, from one traced step of the ``--trace-shape`` (default: the first) at the first precision,
``timeline.png`` (SMs busy per task kind over the fused forward and backward) beside the traces
(``trace_forward.json``, ``trace_backward.json``; ``python -m mok_cute.trace`` reads them).
``--save-outputs FILE``: y and every gradient of one mok_cute step per shape and precision
(``torch.save``: {"shape/precision": {name: tensor}}; gigabytes at the model shapes), and their
sha256 in the JSON, so that two commits' runs can be compared bitwise; ``--digests``: only the
sha256 in the JSON. Without a GPU it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import subprocess
import sys
from pathlib import Path

import torch

from mok_cute import MoKConfig, __version__
from mok_cute.config import PRECISIONS
from mok_cute.bench import report, run
from mok_cute.bench.shapes import SHAPES, pick

OWN_FIELDS = ("precision", "trace")  # set by --precision and the trace step, not by --config


def parse_value(text: str):
    """A ``--config`` value: ``none`` / ``true`` / ``false`` (any case), an int, a float, or the string."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_config(items: list[str]) -> dict:
    """``["FIELD=VALUE", ...]`` as MoKConfig fields; ValueError for a malformed item, an unknown or
    reserved field, or a value MoKConfig rejects."""
    fields = {f.name for f in dataclasses.fields(MoKConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--config takes FIELD=VALUE, got {item!r}")
        if name not in fields:
            raise ValueError(f"--config: MoKConfig has no field {name!r}")
        if name in OWN_FIELDS:
            raise ValueError(f"--config: {name!r} is set by the benchmark itself (see --precision / --plot)")
        out[name] = parse_value(value)
    try:
        MoKConfig(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config: {e}") from None
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mok_cute.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["all"], metavar="NAME",
                    help=f"shapes to run, in this order (default: all): {', '.join(SHAPES)}")
    ap.add_argument("--precision", nargs="+", default=["bf16", "mxfp8"], choices=PRECISIONS,
                    help="mok_cute's precisions (default: bf16 mxfp8); the torch layer runs BF16")
    ap.add_argument("--tokens", type=int, default=None, help="T of every shape (default: each shape's own)")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds, the implementations interleaved (default 5)")
    ap.add_argument("--iters", type=int, default=10,
                    help="back-to-back forwards per timing (half as many forward + backward steps; default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="calls after the compiling one before timing (default 3)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a MoKConfig field of the mok_cute rows, e.g. forward_path=unfused (repeatable; "
                         "validate_routing=false unless given)")
    ap.add_argument("--out", default="mok_bench_results", metavar="PREFIX",
                    help="write PREFIX.json and PREFIX.csv (default mok_bench_results)")
    ap.add_argument("--plot", default=None, metavar="DIR", help="write speedup.png and timeline.png into DIR")
    ap.add_argument("--trace-shape", default=None, metavar="NAME", help="the shape of --plot's timeline (default: the first)")
    ap.add_argument("--save-outputs", default=None, metavar="FILE",
                    help="torch.save y and every gradient of one mok_cute step per shape and precision")
    ap.add_argument("--digests", action="store_true",
                    help="the sha256 of y and every gradient of one mok_cute step per shape and precision in the JSON "
                         "(implied by --save-outputs)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list-shapes", action="store_true", help="print the shapes and exit (no GPU needed)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, with ``shapes`` as :class:`Shape` objects and ``config`` as a dict
    (errors exit through argparse, status 2)."""
    ap = parser()
    args = ap.parse_args(argv)
    try:
        args.shapes = pick(args.shapes, args.tokens)
        args.config = parse_config(args.config)
    except ValueError as e:
        ap.error(str(e))
    for name in ("rounds", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.warmup < 0 or (args.tokens is not None and args.tokens < 1):
        ap.error("--warmup must be >= 0 and --tokens >= 1")
    names = [s.name for s in args.shapes]
    if args.trace_shape is not None and args.trace_shape not in names:
        ap.error(f"--trace-shape {args.trace_shape!r} is not among the shapes run: {names}")
    args.trace_shape = args.trace_shape or names[0]
    args.precision = list(dict.fromkeys(args.precision))
    return args


def shapes_table() -> str:
    """The named shapes, one Markdown row each."""
    lines = ["| name | shape | what |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.dims} | {s.note} |" for s in SHAPES.values()]
    return "\n".join(lines)


def _commit() -> str | None:
    """The checkout's short commit (with ``+dirty`` if it has changes), None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def metadata(args, argv) -> dict:
    """Where and how the numbers were measured (device, date, versions, commit, command, method)."""
    return {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "mok_cute": __version__,
            "commit": _commit(), "command": " ".join(["python -m mok_cute.bench", *argv]),
            "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "config": args.config,
            "precisions": args.precision}


def bench_shape(shape, args, bar, saved: dict, digests: dict, device="cuda") -> tuple[list[dict], dict]:
    """One shape's result rows, and its traces ({pass: Trace}) if it is the traced shape of ``--plot``;
    the outputs of one step per precision into ``saved`` (``--save-outputs``) and their sha256 into
    ``digests`` (``--digests`` too), keyed ``shape/precision``."""
    impls = run.build(shape, device, args.precision, args.config)
    for impl in impls:
        bar.set_description(f"{shape.name}: compiling + warm-up {impl.name}")
        run.warm(impl, args.warmup)
        bar.update()
    peaks = {impl.name: None if impl.error else run.peak_mb(impl) for impl in impls}
    if args.save_outputs or args.digests:
        for impl in impls[1:]:
            if not impl.error:
                bar.set_description(f"{shape.name}: the outputs of one step of {impl.name}")
                key, out = f"{shape.name}/{impl.precision}", run.outputs(impl)
                digests[key] = {n: run.digest(t) for n, t in out.items()}
                if args.save_outputs:
                    saved[key] = out
    for r in range(args.rounds):
        bar.set_description(f"{shape.name}: timing round {r + 1}/{args.rounds}")
        run.time_round(impls, args.iters)
        bar.update()
    base = impls[0]
    base_ms = {w: run.median_ms(base, w) for w in ("fwd", "fwdbwd")}
    rows = [report.make_row(shape, m.precision, base_ms, {w: run.median_ms(m, w) for w in ("fwd", "fwdbwd")},
                            (peaks[base.name], peaks[m.name]), m.error or (base.error and f"torch layer: {base.error}"))
            for m in impls[1:]]
    traces = {}
    traced = impls[1]
    if args.plot and shape.name == args.trace_shape and not traced.error:
        bar.set_description(f"{shape.name}: one traced step ({traced.name})")
        fwd, bwd = run.traced_step(traced)
        traces = {name: tr for name, tr in (("forward", fwd), ("backward", bwd)) if tr is not None}
    return rows, traces


def write_plots(plot_dir: Path, rows: list[dict], traces: dict, title: str, trace_label: str) -> None:
    """speedup.png, and the traces (JSON) with their timeline.png; a message where one is not written."""
    from mok_cute import trace

    plot_dir.mkdir(parents=True, exist_ok=True)
    if not report.plot_speedup(rows, plot_dir / "speedup.png", title):
        print("matplotlib missing (pip install mok_cute[plot]): no plots written", file=sys.stderr)
        return
    loaded = {}
    for name, tr in traces.items():
        path = plot_dir / f"trace_{name}.json"
        trace.dump(path, tr.records, tr.comm_ctas, tr.kinds, tr.gemm_kinds)
        recs, kinds, _, _ = trace.load(path)
        loaded[f"{trace_label}: fused {name}"] = (recs, kinds)
    if not report.plot_timeline(loaded, plot_dir / "timeline.png", title):
        print("no traced fused kernel ran (see --config's forward_path / backward_path): no timeline.png",
              file=sys.stderr)
    print(f"plots written to {plot_dir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list_shapes:
        print(shapes_table())
        return 0
    if not torch.cuda.is_available():
        print("mok_cute.bench times the layer on a CUDA GPU, and torch sees none here: nothing was run "
              "(--list-shapes works without one).", file=sys.stderr)
        return 2
    from tqdm import tqdm

    meta = metadata(args, argv)
    rows, saved, digests, traces = [], {}, {}, {}
    units = len(args.shapes) * (1 + len(args.precision) + args.rounds)
    with tqdm(total=units, disable=args.no_progress, file=sys.stderr, unit="step") as bar:
        for shape in args.shapes:
            shape_rows, shape_traces = bench_shape(shape, args, bar, saved, digests)
            rows += shape_rows
            traces.update(shape_traces)
            torch.cuda.empty_cache()
    where = f"{meta['device']}, {meta['date']}, commit {meta['commit'] or 'unknown'}"
    print(report.table(rows, f"mok_cute.bench on {where}: EP = 1; speed-up = torch layer ms / mok_cute ms (the torch "
                             f"layer: BF16 sort + grouped_mm + fp32 scatter)"))
    report.write_json(f"{args.out}.json", meta, rows, digests)
    report.write_csv(f"{args.out}.csv", rows)
    print(f"results written to {args.out}.json and {args.out}.csv", file=sys.stderr)
    if args.save_outputs:
        torch.save(saved, args.save_outputs)
        print(f"outputs of one step per shape and precision saved to {args.save_outputs}", file=sys.stderr)
    if args.plot:
        write_plots(Path(args.plot), rows, traces, where, f"{args.trace_shape} {args.precision[0]}")
    return 0

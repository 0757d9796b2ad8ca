"""``python -m mok_cute.bench``: the mok_cute layer against the torch layer, per model shape and precision.

    python -m mok_cute.bench [--shapes NAME ...] [--precision bf16 mxfp8 ...] [--tokens T]
        [--rounds 5] [--iters 10] [--warmup 3] [--config FIELD=VALUE ...] [--out PREFIX]
        [--plot DIR] [--trace-shape NAME] [--save-outputs FILE] [--digests] [--peers sonicmoe]
        [--no-progress] [--list-shapes]

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

``--peers sonicmoe``: SonicMoE (:mod:`mok_cute.bench.peers`; ``tools/peer_env.sh`` installs it) runs
beside them in the same process on the same inputs, routing and weights, and a second table (JSON
``systems``, ``PREFIX_systems.csv``) has one row per system: its ms, peak memory, first-call seconds
(its first forward + backward, compiling included) and the relative L1 error of y and of every
gradient against an fp32 computation of the same layer (:mod:`mok_cute.bench.accuracy`). SonicMoE has
no shared expert and no SwiGLU clamp, so with ``--peers`` every shape runs without them for every
system (the table's dims say so). Every mok_cute kernel the run needs is compiled, at every shape,
before SonicMoE is imported (importing QuACK changes CuTe DSL process-wide: the peers module says
how), so mok_cute's first-call seconds come from that first pass. :func:`compare` runs the same from
Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

from mok_cute import MoKConfig, __version__
from mok_cute.config import PRECISIONS
from mok_cute.bench import accuracy, report, run
from mok_cute.bench import peers as peer_layers
from mok_cute.bench.shapes import SHAPES, Shape, pick

OWN_FIELDS = {"precision": "--precision", "trace": "the trace step"}  # set by the benchmark, not by --config


def parse_value(text: str):
    """A ``--config`` value: ``none`` / ``true`` / ``false`` (any case), an int, a float, a JSON object (``{...}``:
    e.g. ``policy={"fused_forward": {"tile_n": 128}}``, a ``KernelPolicy``'s fields), or the string."""
    if text.strip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: {text!r} is not a JSON object ({e})") from None
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


def parse_config(items: list[str], own: dict[str, str] = OWN_FIELDS) -> dict:
    """``["FIELD=VALUE", ...]`` as MoKConfig fields; ValueError for a malformed item, an unknown field, one of
    ``own`` (field -> what sets it instead), or a value MoKConfig rejects."""
    fields = {f.name for f in dataclasses.fields(MoKConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--config takes FIELD=VALUE, got {item!r}")
        if name not in fields:
            raise ValueError(f"--config: MoKConfig has no field {name!r}")
        if name in own:
            raise ValueError(f"--config: {name!r} is set by {own[name]}")
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
                    help="a MoKConfig field of the mok_cute rows, e.g. forward_path=unfused or "
                         "'policy={\"fused_forward\": {\"tile_n\": 128}}' (repeatable; validate_routing=false "
                         "unless given)")
    ap.add_argument("--out", default="mok_bench_results", metavar="PREFIX",
                    help="write PREFIX.json and PREFIX.csv (default mok_bench_results)")
    ap.add_argument("--plot", default=None, metavar="DIR", help="write speedup.png and timeline.png into DIR")
    ap.add_argument("--trace-shape", default=None, metavar="NAME", help="the shape of --plot's timeline (default: the first)")
    ap.add_argument("--save-outputs", default=None, metavar="FILE",
                    help="torch.save y and every gradient of one mok_cute step per shape and precision")
    ap.add_argument("--digests", action="store_true",
                    help="the sha256 of y and every gradient of one mok_cute step per shape and precision in the JSON "
                         "(implied by --save-outputs)")
    ap.add_argument("--peers", nargs="+", default=[], choices=peer_layers.PEERS,
                    help="other MoE layers to run beside them (every shape without its shared expert and clamp), "
                         "with a per-system table of times, peak memory, first-call seconds and accuracy")
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
    args.peers = list(dict.fromkeys(args.peers))
    if args.peers:
        args.shapes = [s.routed_only() for s in args.shapes]
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
            "precisions": args.precision, "peers": args.peers}


def compile_ours_first(args, bar, device="cuda") -> tuple[dict, dict]:
    """Before any peer is imported (:mod:`mok_cute.bench.peers` says why): every mok row of every
    shape compiled and warmed up (:func:`mok_cute.bench.run.warm`), and ``--plot``'s traced step
    taken. Returns ``({shape name: {row name: (first-call s, error)}}, traces)``."""
    first, traces = {}, {}
    for shape in args.shapes:
        moks = run.build(shape, device, args.precision, args.config)[1:]
        for impl in moks:
            bar.set_description(f"{shape.name}: compiling + warm-up {impl.name} (before the peers)")
            run.warm(impl, args.warmup)
            bar.update()
        first[shape.name] = {m.name: (m.first_s, m.error) for m in moks}
        if args.plot and shape.name == args.trace_shape:
            traces = traced(moks[0], bar, shape.name)
        del moks
        torch.cuda.empty_cache()
    return first, traces


def traced(impl, bar, shape_name: str) -> dict:
    """{pass: Trace} of one traced step of the mok row ``impl`` (empty if it did not run)."""
    if impl.error:
        return {}
    bar.set_description(f"{shape_name}: one traced step ({impl.name})")
    fwd, bwd = run.traced_step(impl)
    return {name: tr for name, tr in (("forward", fwd), ("backward", bwd)) if tr is not None}


def bench_shape(shape, args, bar, saved: dict, digests: dict, device="cuda", systems: list | None = None,
                first: dict | None = None) -> tuple[list[dict], dict]:
    """One shape's result rows, and its traces ({pass: Trace}) if it is the traced shape of ``--plot``
    (without peers; with them :func:`compile_ours_first` takes the traced step); the outputs of one
    step per precision into ``saved`` (``--save-outputs``) and their sha256 into ``digests``
    (``--digests`` too), keyed ``shape/precision``. With ``args.peers``: the peers join the rows, one
    system row per implementation goes into ``systems``, and ``first`` (the shape's entry of
    :func:`compile_ours_first`) gives the mok rows' first-call seconds and errors."""
    names = getattr(args, "peers", None) or []
    want = accuracy.reference_for(shape, device) if names else None  # before the rows: its fp32 tensors leave first
    impls = build_and_warm(shape, args, bar, device, first)
    moks = [m for m in impls if m.config is not None]
    peaks = {impl.name: None if impl.error else run.peak_mb(impl) for impl in impls}
    if args.save_outputs or args.digests:
        for impl in moks:
            if not impl.error:
                bar.set_description(f"{shape.name}: the outputs of one step of {impl.name}")
                key, out = f"{shape.name}/{impl.precision}", run.outputs(impl)
                digests[key] = {n: run.digest(t) for n, t in out.items()}
                if args.save_outputs:
                    saved[key] = out
    errs = {}
    for impl in impls if want else ():
        if not impl.error:
            bar.set_description(f"{shape.name}: accuracy of {impl.name}")
            errs[impl.name] = accuracy.errors(run.step_outputs(impl), want)
    del want
    for r in range(args.rounds):
        bar.set_description(f"{shape.name}: timing round {r + 1}/{args.rounds}")
        run.time_round(impls, args.iters)
        bar.update()
    base = impls[0]
    base_ms = {w: run.median_ms(base, w) for w in ("fwd", "fwdbwd")}
    rows = [report.make_row(shape, m.precision, base_ms, {w: run.median_ms(m, w) for w in ("fwd", "fwdbwd")},
                            (peaks[base.name], peaks[m.name]), m.error or (base.error and f"torch layer: {base.error}"))
            for m in moks]
    if names and systems is not None:
        systems += [system_row(shape, impl, peaks[impl.name], errs.get(impl.name, {})) for impl in impls]
    traces = {}
    if args.plot and shape.name == args.trace_shape and not names:
        traces = traced(moks[0], bar, shape.name)
    return rows, traces


def build_and_warm(shape, args, bar, device="cuda", first: dict | None = None) -> list:
    """The rows of ``shape`` (:func:`mok_cute.bench.run.rows`: torch, then mok at each precision),
    compiled and warmed up, then each of ``args.peers`` on the same leaves (imported only now, after
    ours) warmed up. ``first`` (the shape's entry of :func:`compile_ours_first`): the mok rows'
    first-call seconds, and their errors (a row that failed before the peers' import is not
    compiled after it)."""
    inputs, dy = run.leaves(shape, device)
    impls = run.rows(shape, inputs, dy, args.precision, args.config)
    done = first or {}
    for impl in impls:
        impl.error = done[impl.name][1] if impl.name in done else impl.error
    for impl in impls:
        bar.set_description(f"{shape.name}: compiling + warm-up {impl.name}")
        run.warm(impl, args.warmup)
        impl.first_s = done[impl.name][0] if impl.name in done else impl.first_s
        bar.update()
    for name in getattr(args, "peers", None) or []:
        impls.append(peer_layers.build(name, shape, inputs, dy))
        bar.set_description(f"{shape.name}: compiling + warm-up {name}")
        run.warm(impls[-1], args.warmup)
        bar.update()
    return impls


def system_row(shape, impl, peak, errors: dict) -> dict:
    """The system row of ``impl`` (:func:`mok_cute.bench.report.make_system_row`) after its rounds."""
    measured = {w: run.median_ms(impl, w) for w in ("fwd", "fwdbwd")}
    measured.update(peak_mb=peak, first_call_s=None if impl.error else impl.first_s)
    return report.make_system_row(shape, impl.name, impl.precision, measured, errors, impl.error)


def run_shapes(args, bar, device="cuda", on_shape=None) -> dict:
    """Every shape of ``args`` (:func:`parse_args`): ``{"rows", "systems", "traces", "saved",
    "digests"}`` (:func:`bench_shape`'s, gathered); with peers, :func:`compile_ours_first` first.
    ``on_shape(out, rows)``, if given, runs after each shape with the results so far and that
    shape's rows (the CLI writes its files then: a run cut short keeps the shapes it finished)."""
    out = {"rows": [], "systems": [], "traces": {}, "saved": {}, "digests": {}}
    first = {}
    if args.peers:
        first, out["traces"] = compile_ours_first(args, bar, device)
    for shape in args.shapes:
        rows, traces = bench_shape(shape, args, bar, out["saved"], out["digests"], device, out["systems"],
                                   first.get(shape.name))
        out["rows"] += rows
        out["traces"].update(traces)
        torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(out, rows)
    return out


def compare(shapes, peers=peer_layers.PEERS, precisions=("bf16",), config: dict | None = None, rounds: int = 5,
            iters: int = 10, warmup: int = 3, device="cuda") -> list[dict]:
    """``python -m mok_cute.bench --peers`` from Python, nothing printed or written: the system rows
    (:func:`mok_cute.bench.report.make_system_row`) of the torch layer, mok_cute at each of
    ``precisions`` (with MoKConfig fields ``config``) and each of ``peers``, per shape (names of
    :data:`SHAPES` or :class:`Shape` objects; each run :meth:`Shape.routed_only`). ValueError for
    no peer, an unknown peer or shape."""
    if not peers or any(p not in peer_layers.PEERS for p in peers):
        raise ValueError(f"peers must name one or more of {peer_layers.PEERS}, got {list(peers)}")
    from tqdm import tqdm

    args = parse_args(["--peers", *peers, "--precision", *precisions, "--rounds", str(rounds), "--iters", str(iters),
                       "--warmup", str(warmup)])
    args.shapes = [s.routed_only() for s in (x if isinstance(x, Shape) else pick([x])[0] for x in shapes)]
    args.config = dict(config or {})
    with tqdm(disable=True) as bar:
        return run_shapes(args, bar, device)["systems"]


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


def _ms(v, unit: str = "ms", digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f} {unit}"


def write_partial(args, meta: dict, out: dict, rows: list[dict], bar) -> None:
    """After each shape: its rows printed (one line each, through the progress bar) and the JSON
    and CSV files written with every shape finished so far."""
    for r in rows:
        bar.write(f"{r['shape']} {r['precision']}: fwd {r['fwd_speedup'] or 0:.2f}x, fwd+bwd "
                  f"{r['fwdbwd_speedup'] or 0:.2f}x the torch layer{' (' + r['error'] + ')' if r['error'] else ''}",
                  file=sys.stdout)
    shape = rows[0]["shape"] if rows else None
    for r in (r for r in out["systems"] if r["shape"] == shape):
        bar.write(f"{shape} {r['system']}: fwd {_ms(r['fwd_ms'])}, fwd+bwd {_ms(r['fwdbwd_ms'])}, peak "
                  f"{_ms(r['peak_mb'], 'MiB', 0)}, first call {_ms(r['first_call_s'], 's', 1)}"
                  f"{' (' + r['error'] + ')' if r['error'] else ''}", file=sys.stdout)
    report.write_json(f"{args.out}.json", meta, out["rows"], out["digests"], out["systems"])
    report.write_csv(f"{args.out}.csv", out["rows"])
    if out["systems"]:
        report.write_csv(f"{args.out}_systems.csv", out["systems"], report.SYSTEM_FIELDS)


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
    units = len(args.shapes) * (1 + len(args.precision) * (2 if args.peers else 1) + len(args.peers) + args.rounds)
    with tqdm(total=units, disable=args.no_progress, file=sys.stderr, unit="step") as bar:
        out = run_shapes(args, bar, on_shape=lambda so_far, rows: write_partial(args, meta, so_far, rows, bar))
    rows, saved, digests, traces, systems = out["rows"], out["saved"], out["digests"], out["traces"], out["systems"]
    where = f"{meta['device']}, {meta['date']}, commit {meta['commit'] or 'unknown'}"
    print(report.table(rows, f"mok_cute.bench on {where}: EP = 1; speed-up = torch layer ms / mok_cute ms (the torch "
                             f"layer: BF16 sort + grouped_mm + fp32 scatter)"))
    if systems:
        meta["peer_versions"] = peer_layers.versions()
        print()
        print(report.system_table(systems, f"beside {', '.join(args.peers)}: the same inputs, routing and weights, "
                                           f"no shared expert or clamp; rel-L1 against an fp32 computation"))
        report.write_csv(f"{args.out}_systems.csv", systems, report.SYSTEM_FIELDS)
    report.write_json(f"{args.out}.json", meta, rows, digests, systems)
    report.write_csv(f"{args.out}.csv", rows)
    also = f" and {args.out}_systems.csv" if systems else ""
    print(f"results written to {args.out}.json and {args.out}.csv{also}", file=sys.stderr)
    if args.save_outputs:
        torch.save(saved, args.save_outputs)
        print(f"outputs of one step per shape and precision saved to {args.save_outputs}", file=sys.stderr)
    if args.plot:
        write_plots(Path(args.plot), rows, traces, where, f"{args.trace_shape} {args.precision[0]}")
    return 0

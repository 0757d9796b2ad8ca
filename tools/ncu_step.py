"""Nsight Compute figures of one layer step's kernels (one GPU, EP = 1): runs ``ncu`` on a child process
that warms the layer up, then profiles exactly one forward (``--bwd``: forward + backward) between
``cudaProfilerStart`` / ``cudaProfilerStop``, and prints one row per kernel: its time, the tensor pipe's
active cycles (wgmma on SM90), SM, DRAM and L2 throughput and the L2 hit rate, each as ncu reports it.

    python -m tools.ncu_step [--shape NAME | T,H,I,E,k] [--precision bf16] [--bwd] [--kernels REGEX]
        [--ncu PATH] [--metrics NAME ...] [--comm N] [--forward-path P] [--backward-path P]
        [--config FIELD=VALUE ...]

``--kernels``: only kernels whose name matches (ncu's ``regex:``; default: every kernel of the step). The layer's
options are ``python -m tools.profile_fwd``'s.

ncu replays each kernel once per pass its metrics need, restoring the memory it writes, so a persistent
megakernel's counters start from the same state in every pass. The clocks are left alone (``--clock-control
none``): the kernels run at the clocks the power cap gives them, whose mean the SM GHz column reports.
"""
from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys


METRICS = {  # ncu metric -> column title
    "gpu__time_duration.sum": "us",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor pipe %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "sm__cycles_elapsed.avg.per_second": "SM GHz",
}


def parse_args(argv):
    from tools.profile_fwd import add_layer_options, parse_with_config

    ap = argparse.ArgumentParser(prog="python -m tools.ncu_step", description=__doc__.split("\n\n")[0])
    add_layer_options(ap, "qwen3-30b-a3b")
    ap.add_argument("--kernels", default=None, help="only kernels whose name matches this regex")
    ap.add_argument("--ncu", default="ncu", help="the ncu executable (default: ncu on PATH)")
    ap.add_argument("--metrics", nargs="+", default=list(METRICS), help="ncu metric names (default: the table's)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parse_with_config(ap, argv)


def ncu_command(args, argv: list[str]) -> list[str]:
    """The ncu command line that profiles the child (this tool with ``--child`` and the same ``argv``)."""
    cmd = [args.ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
           "--metrics", ",".join(args.metrics)]
    if args.kernels:
        cmd += ["--kernel-name", f"regex:{args.kernels}"]
    return cmd + [sys.executable, "-m", "tools.ncu_step", "--child", *argv]


def rows_of(text: str, metrics: list[str]) -> list[dict]:
    """ncu's ``--csv --page raw`` output (one line per profiled kernel after a header line and a units
    line; ncu's own ``==PROF==`` lines and the child's output around it are skipped) as dicts: ``name``,
    then each metric as a float (None where ncu gave none); ``gpu__time_duration.sum`` in microseconds, the SM
    clock in GHz."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    head, body = table[0], table[2:]  # table[1]: the units
    units = dict(zip(head, table[1])) if len(table) > 1 else {}
    out = []
    for rec in body:
        got = dict(zip(head, rec))
        row = {"name": got.get("Kernel Name", "?")}
        for m in metrics:
            row[m] = _number(got.get(m))
            if row[m] is not None:
                row[m] *= _SCALE.get(m, {}).get(units.get(m), 1.0)
        out.append(row)
    return out


_SCALE = {  # metric -> {ncu's unit: factor to the table's unit}: microseconds, GHz
    "gpu__time_duration.sum": {"nsecond": 1e-3, "ns": 1e-3, "nsec": 1e-3, "usecond": 1.0, "us": 1.0, "usec": 1.0,
                               "msecond": 1e3, "ms": 1e3, "msec": 1e3, "second": 1e6, "s": 1e6},
    "sm__cycles_elapsed.avg.per_second": {"cycle/nsecond": 1.0, "cycle/usecond": 1e-3, "cycle/msecond": 1e-6,
                                          "cycle/second": 1e-9, "Ghz": 1.0, "Mhz": 1e-3, "hz": 1e-9},
}


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except (TypeError, ValueError):
        return None


def table(rows: list[dict], metrics: list[str]) -> str:
    """A markdown table of :func:`rows_of`'s rows, the kernel names shortened."""
    titles = [METRICS.get(m, m) for m in metrics]
    out = ["| kernel | " + " | ".join(titles) + " |", "|---|" + "---|" * len(titles)]
    for r in rows:
        cells = ["-" if r[m] is None else f"{r[m]:.2f}" if METRICS.get(m) == "SM GHz" else f"{r[m]:.1f}"
                 for m in metrics]
        out.append(f"| {_short(r['name'])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _short(name: str) -> str:
    for key in ("FusedMoeBwd", "FusedMoeFwd", "RouteOperands", "count_kernel", "scatter_kernel"):
        if key in name:
            return key
    return name[:48]


def child(args) -> int:
    """Warm the layer up (compiles, caches), then one profiled step between cudaProfilerStart / Stop."""
    import torch

    from tools.profile_fwd import layer_fields, layer_step

    step, _ = layer_step(args.shape, args.precision, args.bwd, layer_fields(args))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        return child(args)
    if shutil.which(args.ncu) is None:
        print(f"ncu_step: no ncu executable {args.ncu!r}; pass --ncu PATH (e.g. /usr/local/cuda/bin/ncu)",
              file=sys.stderr)
        return 2
    done = subprocess.run(ncu_command(args, argv), capture_output=True, text=True)
    rows = rows_of(done.stdout, args.metrics)
    if done.returncode or not rows:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        print(f"ncu_step: ncu exited with {done.returncode}, {len(rows)} kernels profiled", file=sys.stderr)
        return done.returncode or 1
    s = args.shape
    print(f"{s.dims} {args.precision} {'forward + backward' if args.bwd else 'forward'}, one step under ncu:")
    print(table(rows, args.metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())

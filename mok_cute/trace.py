"""Task traces of the fused megakernels: read, summarize, convert and plot them.

A kernel run with ``MoKConfig(trace=True)`` (or ``MOK_CUTE_TRACE=1``) writes one record per task;
:func:`last` returns the last traced launch's records, :func:`dump` writes them to a file, and

    python -m mok_cute.trace trace.json [--out-prefix PATH]

turns such a file into a Chrome / Perfetto trace (``PATH.chrome.json``), a PNG of SM occupancy by
task kind over time (``PATH.png``, needs matplotlib: ``pip install mok_cute[plot]``), and prints
the summary (:func:`summary`) and each kind's duration percentiles (:func:`kind_stats`).

Trace file: ``{"records": [[start_ns, end_ns, kind | cta << 8, task], ...], "kinds": [...],
"comm_ctas": N, "gemm_kinds": G}`` (records of tasks that did not run are dropped; kinds below
G are GEMM tasks; a file without ``gemm_kinds`` has G = 4, the fused forward's). Loaded records
are tuples ``(start_ns, end_ns, kind, cta, task)`` with times relative to the earliest start.
Scheduler share = the gaps between one GEMM task's end and the next one's start on the same CTA
(the task lookup on the device), summed over the GEMM CTAs / their busy spans.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

FORWARD_GEMM_KINDS = 4  # S1, R1, S2, R2: the fused forward's GEMM task kinds


class Trace(NamedTuple):
    """One traced launch: ``records`` int64 [n, 4] (a torch tensor; zero rows: tasks that did not
    run), the kinds' names, the comm CTAs, and how many kinds (the first) are GEMM tasks."""

    records: object
    kinds: tuple
    comm_ctas: int
    gemm_kinds: int


def last(pass_: str = "forward") -> Trace | None:
    """The last traced launch of the SM90 fused ``"forward"`` or ``"backward"`` in this process
    (None if none was traced). Imports the kernel modules (needs the CuTe DSL, not a GPU)."""
    if pass_ == "forward":
        from mok_cute.kernels.sm90 import fused_moe as kernel

        gemm_kinds = FORWARD_GEMM_KINDS
    elif pass_ == "backward":
        from mok_cute.kernels.sm90 import fused_bwd as kernel

        gemm_kinds = kernel.GEMM_KINDS
    else:
        raise ValueError(f"pass_ must be 'forward' or 'backward', got {pass_!r}")
    got = kernel.last_trace()
    if got is None:
        return None
    records, comm_ctas = got
    return Trace(records, tuple(kernel.KINDS), int(comm_ctas), gemm_kinds)


def dump(path, records, comm_ctas: int, kinds, gemm_kinds: int = FORWARD_GEMM_KINDS) -> None:
    """Write a trace file from the kernel's int64 [n, 4] records (a torch tensor)."""
    rows = [r for r in records.cpu().tolist() if r[1]]
    Path(path).write_text(json.dumps({"records": rows, "kinds": list(kinds), "comm_ctas": comm_ctas,
                                      "gemm_kinds": gemm_kinds}))


def load(path) -> tuple[list, list, int, int]:
    """``(records, kinds, comm_ctas, gemm_kinds)`` of a trace file (records as in the module doc)."""
    d = json.loads(Path(path).read_text())
    return normalize(d["records"]), d["kinds"], d["comm_ctas"], d.get("gemm_kinds", FORWARD_GEMM_KINDS)


def normalize(rows) -> list:
    """Raw records ``[start_ns, end_ns, kind | cta << 8, task]`` (rows of a :class:`Trace`'s tensor as lists, or of
    a file) as loaded tuples ``(start_ns, end_ns, kind, cta, task)``, times relative to the earliest start;
    zero rows (tasks that did not run) dropped."""
    rows = [r for r in rows if r[1]]
    t0 = min(r[0] for r in rows)
    return [(r[0] - t0, r[1] - t0, r[2] & 0xFF, r[2] >> 8, r[3]) for r in rows]


def summary(recs, kinds, comm_ctas, gemm_kinds: int = FORWARD_GEMM_KINDS) -> dict:
    """Span, busy time and task count per kind, the scheduler share of the GEMM CTAs, and (with
    "CTA" life records) the time from the first CTA's entry to the first task and from the last
    task's end to the last CTA's exit."""
    span = max(r[1] for r in recs)
    busy = {k: 0 for k in kinds}
    count = {k: 0 for k in kinds}
    per_cta: dict[int, list] = {}
    for s, e, kind, cta, _ in recs:
        busy[kinds[kind]] += e - s
        count[kinds[kind]] += 1
        if kind < gemm_kinds:  # GEMM tasks
            per_cta.setdefault(cta, []).append((s, e))
    gaps = active = 0
    for spans in per_cta.values():
        spans.sort()
        active += spans[-1][1] - spans[0][0]
        gaps += sum(max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
    out = {}
    if "CTA" in kinds:  # CTA life records (entry to exit): the kernel's start-up before / tail after its tasks
        life = [r for r in recs if kinds[r[2]] == "CTA"]
        tasks = [r for r in recs if r[2] < gemm_kinds]
        if life and tasks:
            out = {"before_first_task_us": (min(r[0] for r in tasks) - min(r[0] for r in life)) / 1e3,
                   "after_last_task_us": (max(r[1] for r in life) - max(r[1] for r in tasks)) / 1e3}
    return out | {"span_us": span / 1e3, "busy_us": {k: v / 1e3 for k, v in busy.items() if count[k]},
                  "tasks": {k: v for k, v in count.items() if v}, "scheduler_share": gaps / active if active else 0.0,
                  "gemm_ctas": len(per_cta), "comm_ctas": comm_ctas}


def kind_stats(recs, kinds, gemm_kinds: int = FORWARD_GEMM_KINDS) -> dict:
    """Per task kind: count, p10 / p50 / p90 / max duration (us), CTA-time (ms) and, for GEMM kinds, the mean
    gap (us) from a task's end to its CTA's next GEMM task's start when that is of the same kind."""
    durs: dict[str, list] = {}
    per_cta: dict[int, list] = {}
    for s, e, kind, cta, _ in recs:
        durs.setdefault(kinds[kind], []).append((e - s) / 1e3)
        if kind < gemm_kinds:
            per_cta.setdefault(cta, []).append((s, e, kind))
    gaps: dict[str, list] = {}
    for spans in per_cta.values():
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if a[2] == b[2]:
                gaps.setdefault(kinds[a[2]], []).append(max(0, b[0] - a[1]) / 1e3)
    out = {}
    for kind, d in durs.items():
        d.sort()
        pick = lambda q: d[min(len(d) - 1, int(q * len(d)))]  # noqa: E731
        out[kind] = {"n": len(d), "p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": d[-1],
                     "cta_ms": sum(d) / 1e3}
        if kind in gaps:
            out[kind]["gap_us"] = sum(gaps[kind]) / len(gaps[kind])
    return out


def format_kind_stats(stats: dict) -> str:
    """One line: ``kind n p10/p50/p90/max us, CTA-time ms[, gap us]`` per kind."""
    return "; ".join(f"{k} {v['n']} {v['p10']:.1f}/{v['p50']:.1f}/{v['p90']:.1f}/{v['max']:.1f} us {v['cta_ms']:.1f} ms"
                     + (f" gap {v['gap_us']:.2f}" if "gap_us" in v else "") for k, v in stats.items())


def chrome(recs, kinds) -> dict:
    """The records as Chrome / Perfetto trace events: one thread per CTA, one slice per task."""
    return {"traceEvents": [{"name": kinds[k], "ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3, "pid": 0, "tid": cta,
                             "args": {"task": w}} for s, e, k, cta, w in recs]}


def occupancy(recs, n_kinds: int, bins: int = 400) -> tuple[list[float], list[list[float]]]:
    """``(bin centres in us, SMs busy per kind per bin)``: each task's time spread over the time bins
    it overlaps, so a kind's value in a bin is the mean number of SMs running it there."""
    span = max(r[1] for r in recs) or 1
    width = span / bins
    occ = [[0.0] * bins for _ in range(n_kinds)]
    for s, e, k, _, _ in recs:
        b0, b1 = int(s // width), min(bins - 1, int(e // width))
        for b in range(b0, b1 + 1):
            lo, hi = max(s, b * width), min(e, (b + 1) * width)
            occ[k][b] += max(0.0, hi - lo) / width
    return [(b + 0.5) * width / 1e3 for b in range(bins)], occ


def plot_occupancy(ax, recs, kinds, title: str = "") -> None:
    """Stack plot of :func:`occupancy` on the matplotlib axes ``ax`` (kinds that never ran left out, and
    the "CTA" life records: a CTA's span from entry to exit, not a task)."""
    xs, occ = occupancy(recs, len(kinds))
    used = [k for k in range(len(kinds)) if any(occ[k]) and kinds[k] != "CTA"]
    ax.stackplot(xs, *[occ[k] for k in used], labels=[kinds[k] for k in used])
    ax.set_xlabel("time (us)")
    ax.set_ylabel("SMs busy")
    if title:
        ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def occupancy_png(recs, kinds, path) -> None:
    """Write :func:`plot_occupancy` of one trace as a PNG (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    plot_occupancy(ax, recs, kinds)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_cute.trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a trace file written by mok_cute.trace.dump")
    ap.add_argument("--out-prefix", default=None, help="output path prefix (default: the trace file's, less .json)")
    args = ap.parse_args(argv)
    recs, kinds, comm, gemm_kinds = load(args.trace)
    prefix = args.out_prefix or str(Path(args.trace).with_suffix(""))
    Path(prefix + ".chrome.json").write_text(json.dumps(chrome(recs, kinds)))
    try:
        occupancy_png(recs, kinds, prefix + ".png")
    except ImportError:
        print("matplotlib missing (pip install mok_cute[plot]): no PNG written", file=sys.stderr)
    print(json.dumps(summary(recs, kinds, comm, gemm_kinds), indent=1))
    print("per kind n p10/p50/p90/max, CTA-time, same-kind gap:", format_kind_stats(kind_stats(recs, kinds, gemm_kinds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

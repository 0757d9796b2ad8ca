"""Turn a fused-forward or fused-backward trace (``MOK_CUTE_TRACE=1``) into a Chrome/Perfetto trace and a PNG of SM
occupancy by task kind over time, and print the scheduler's share of the GEMM CTAs' time and each kind's duration
percentiles (:func:`kind_stats`).

    python3 tools/trace_view.py trace.json [--out-prefix PATH]

``trace.json``: ``{"records": [[start_ns, end_ns, kind | cta << 8, task], ...], "kinds": [...],
"comm_ctas": N, "gemm_kinds": G}`` as written by :func:`dump` (records of tasks that did not run
are zero; kinds below G are GEMM tasks).
Scheduler share = sum over GEMM CTAs of the gaps between one task's end and the next one's start
(the task lookup on the device) / the GEMM CTAs' busy span.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def dump(path, records, comm_ctas: int, kinds, gemm_kinds: int = 4) -> None:
    """Write a trace file from the kernel's int64 [n, 4] records (a torch tensor)."""
    rows = [r for r in records.cpu().tolist() if r[1]]
    Path(path).write_text(json.dumps({"records": rows, "kinds": list(kinds), "comm_ctas": comm_ctas,
                                      "gemm_kinds": gemm_kinds}))


def load(path):
    d = json.loads(Path(path).read_text())
    t0 = min(r[0] for r in d["records"])
    recs = [(r[0] - t0, r[1] - t0, r[2] & 0xFF, r[2] >> 8, r[3]) for r in d["records"]]
    return recs, d["kinds"], d["comm_ctas"], d.get("gemm_kinds", 4)


def summary(recs, kinds, comm_ctas, gemm_kinds: int = 4) -> dict:
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


def kind_stats(recs, kinds, gemm_kinds: int = 4) -> dict:
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
    return {"traceEvents": [{"name": kinds[k], "ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3, "pid": 0, "tid": cta,
                             "args": {"task": w}} for s, e, k, cta, w in recs]}


def occupancy_png(recs, kinds, path, bins: int = 400) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max(r[1] for r in recs)
    width = span / bins
    occ = {k: [0.0] * bins for k in range(len(kinds))}
    for s, e, k, _, _ in recs:
        b0, b1 = int(s // width), min(bins - 1, int(e // width))
        for b in range(b0, b1 + 1):
            lo, hi = max(s, b * width), min(e, (b + 1) * width)
            occ[k][b] += max(0.0, hi - lo) / width
    xs = [(b + 0.5) * width / 1e3 for b in range(bins)]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.stackplot(xs, *[occ[k] for k in range(len(kinds))], labels=kinds)
    ax.set_xlabel("time (us)")
    ax.set_ylabel("SMs busy")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--out-prefix", default=None)
    args = ap.parse_args()
    recs, kinds, comm, gemm_kinds = load(args.trace)
    prefix = args.out_prefix or str(Path(args.trace).with_suffix(""))
    Path(prefix + ".chrome.json").write_text(json.dumps(chrome(recs, kinds)))
    s = summary(recs, kinds, comm, gemm_kinds)
    try:
        occupancy_png(recs, kinds, prefix + ".png")
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    print(json.dumps(s, indent=1))
    print("per kind n p10/p50/p90/max, CTA-time, same-kind gap:", format_kind_stats(kind_stats(recs, kinds, gemm_kinds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

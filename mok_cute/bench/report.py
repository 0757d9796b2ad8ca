"""The benchmark's results: rows, the printed table, the JSON / CSV files and the PNG plots.

A row is one (shape, precision): the torch layer's and mok_cute's forward and forward + backward
times (ms), the speed-ups torch / mok (> 1: mok_cute is faster), peak memory of one forward +
backward (MiB) and mok_cute's TFLOP/s (forward FLOPs :attr:`Shape.flop_fwd`, three times that
for forward + backward). Plots need matplotlib (``pip install mok_cute[plot]``).

With ``--peers``, a system row is one (shape, system): the torch layer, each mok_cute precision and
each peer, with its times, peak memory, first-call seconds (compiling included) and the relative
L1 error of y and of each gradient against the fp32 computation (:mod:`mok_cute.bench.accuracy`).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

FIELDS = ("shape", "dims", "precision", "torch_fwd_ms", "mok_fwd_ms", "fwd_speedup", "torch_fwdbwd_ms", "mok_fwdbwd_ms",
          "fwdbwd_speedup", "torch_peak_mb", "mok_peak_mb", "mok_fwd_tflops", "mok_fwdbwd_tflops", "error")
ERROR_NAMES = ("y", "dx", "dtopk_w", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")
SYSTEM_FIELDS = ("shape", "dims", "system", "precision", "fwd_ms", "fwdbwd_ms", "peak_mb", "first_call_s",
                 *(f"rel_l1_{n}" for n in ERROR_NAMES), "error")
SYSTEM_COLUMNS = (("shape", "shape"), ("system", "system"), ("fwd ms", "fwd_ms"), ("fwd+bwd ms", "fwdbwd_ms"),
                  ("peak MiB", "peak_mb"), ("first call s", "first_call_s"), ("rel-L1 y", "rel_l1_y"),
                  ("dx", "rel_l1_dx"), ("dtopk_w", "rel_l1_dtopk_w"), ("dw_gate", "rel_l1_dw_gate"),
                  ("dw_up", "rel_l1_dw_up"), ("dw_down", "rel_l1_dw_down"))
COLUMNS = (("shape", "shape"), ("precision", "precision"), ("torch fwd ms", "torch_fwd_ms"),
           ("mok fwd ms", "mok_fwd_ms"), ("fwd speed-up", "fwd_speedup"), ("torch fwd+bwd ms", "torch_fwdbwd_ms"),
           ("mok fwd+bwd ms", "mok_fwdbwd_ms"), ("fwd+bwd speed-up", "fwdbwd_speedup"))


def make_row(shape, precision: str, torch_ms: dict, mok_ms: dict, peaks: tuple, error: str = "") -> dict:
    """One result row (see the module doc). ``torch_ms`` / ``mok_ms``: {"fwd": ms, "fwdbwd": ms}
    (None where it did not run); ``peaks``: (torch MiB, mok MiB), None where not measured."""
    def ratio(what):
        a, b = torch_ms.get(what), mok_ms.get(what)
        return a / b if a and b else None

    def tflops(flop, ms):
        return flop / ms / 1e9 if ms else None

    return {"shape": shape.name, "dims": shape.dims, "precision": precision,
            "torch_fwd_ms": torch_ms.get("fwd"), "mok_fwd_ms": mok_ms.get("fwd"), "fwd_speedup": ratio("fwd"),
            "torch_fwdbwd_ms": torch_ms.get("fwdbwd"), "mok_fwdbwd_ms": mok_ms.get("fwdbwd"),
            "fwdbwd_speedup": ratio("fwdbwd"), "torch_peak_mb": peaks[0], "mok_peak_mb": peaks[1],
            "mok_fwd_tflops": tflops(shape.flop_fwd, mok_ms.get("fwd")),
            "mok_fwdbwd_tflops": tflops(3 * shape.flop_fwd, mok_ms.get("fwdbwd")), "error": error}


def make_system_row(shape, name: str, precision: str, measured: dict, errors: dict, error: str = "") -> dict:
    """One system row (see the module doc). ``measured``: {"fwd": ms, "fwdbwd": ms, "peak_mb": MiB,
    "first_call_s": s}, None (or absent) where not measured; ``errors``: {"rel_l1_NAME": value}
    (:func:`mok_cute.bench.accuracy.errors`)."""
    row = {"shape": shape.name, "dims": shape.dims, "system": name, "precision": precision,
           "fwd_ms": measured.get("fwd"), "fwdbwd_ms": measured.get("fwdbwd"), "peak_mb": measured.get("peak_mb"),
           "first_call_s": measured.get("first_call_s")}
    row.update({f"rel_l1_{n}": errors.get(f"rel_l1_{n}") for n in ERROR_NAMES})
    row["error"] = error
    return row


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if key.endswith("speedup"):
        return f"{v:.2f}x"
    if key.startswith("rel_l1") and isinstance(v, float):
        return f"{v:.2e}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: list[dict], title: str = "", columns=COLUMNS, label=("shape", "precision")) -> str:
    """The rows as a Markdown table (``title`` above it), each row's error below it (named by the
    ``label`` fields); ``columns``: (header, key) pairs (:data:`SYSTEM_COLUMNS` for system rows)."""
    lines = [title, ""] if title else []
    lines.append("| " + " | ".join(h for h, _ in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_cell(k, r.get(k)) for _, k in columns) + " |")
    errors = [f"- {' '.join(str(r[k]) for k in label)}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))


def system_table(rows: list[dict], title: str = "") -> str:
    """System rows (:func:`make_system_row`) as a Markdown table, errors below it."""
    return table(rows, title, SYSTEM_COLUMNS, ("shape", "system"))


def write_json(path, meta: dict, rows: list[dict], digests: dict | None = None, systems: list | None = None) -> None:
    """``{"meta": ..., "rows": [...], "systems": [...], "outputs_sha256": {"shape/precision": {name:
    sha256}}}`` (``systems`` and ``outputs_sha256`` only where given)."""
    out = {"meta": meta, "rows": rows}
    if systems:
        out["systems"] = systems
    if digests:
        out["outputs_sha256"] = digests
    Path(path).write_text(json.dumps(out, indent=1))


def write_csv(path, rows: list[dict], fields=FIELDS) -> None:
    """One line per row, the columns of ``fields`` (:data:`FIELDS`, or :data:`SYSTEM_FIELDS` for
    system rows; empty where None)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in fields})


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(rows: list[dict], path, title: str = "") -> bool:
    """Bars of the speed-up over the torch layer per shape (groups) and precision (bars), forward and
    forward + backward side by side, written as a PNG; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(shapes) * 2), 4.2), sharey=True)
    width = 0.8 / max(1, len(precisions))
    for ax, key, name in zip(axes, ("fwd_speedup", "fwdbwd_speedup"), ("forward", "forward + backward")):
        for j, p in enumerate(precisions):
            vals = {r["shape"]: r[key] for r in rows if r["precision"] == p}
            xs = [i + (j - (len(precisions) - 1) / 2) * width for i in range(len(shapes))]
            ys = [vals.get(s) or 0.0 for s in shapes]
            bars = ax.bar(xs, ys, width, label=p)
            ax.bar_label(bars, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=6, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("speed-up over the torch layer (x)")
    top = max([r[k] or 0.0 for r in rows for k in ("fwd_speedup", "fwdbwd_speedup")] + [1.0])
    axes[0].set_ylim(0, top * 1.25)  # headroom for the legend above the bars
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(precisions), title="mok_cute precision",
                   title_fontsize=8)
    return _save(plt, fig, path, title, 120)


def _save(plt, fig, path, title: str, dpi: int) -> bool:
    """Title, lay out, write ``fig`` to ``path`` as a PNG of ``dpi`` and close it; True."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def plot_timeline(traces: dict, path, title: str = "") -> bool:
    """SMs busy per task kind over time, one panel per traced pass (``traces``: pass name -> the
    ``(records, kinds)`` of :func:`mok_cute.trace.load`), as a PNG; False without matplotlib or traces."""
    from mok_cute import trace

    plt = pyplot()
    if plt is None or not traces:
        return False
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 3.6 * len(traces)), squeeze=False)
    for ax, (name, (recs, kinds)) in zip(axes[:, 0], traces.items()):
        trace.plot_occupancy(ax, recs, kinds, name)
    return _save(plt, fig, path, title, 110)

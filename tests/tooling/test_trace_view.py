"""mok_cute.trace (the trace viewer, ``python -m mok_cute.trace``) on synthetic records, and the fused
backward's trace buffer bound."""
from __future__ import annotations

import json
import random

import pytest
import torch

from mok_cute import trace as trace_view


def _rec(start, end, kind, cta, what):
    return [start, end, kind + (cta << 8), what]


def test_summary_counts_kinds_and_scheduler_gaps(tmp_path):
    kinds = ("A", "B", "gather")
    recs = torch.tensor([_rec(100, 200, 0, 1, 0), _rec(210, 300, 1, 1, 1), _rec(100, 150, 0, 2, 2),
                         _rec(100, 400, 2, 0, 0), [0, 0, 0, 0]], dtype=torch.int64)
    path = tmp_path / "t.json"
    trace_view.dump(path, recs, 1, kinds, gemm_kinds=2)
    loaded = trace_view.load(path)
    assert loaded[3] == 2 and len(loaded[0]) == 4  # the zero record (a task that did not run) is dropped
    s = trace_view.summary(*loaded)
    assert s["tasks"] == {"A": 2, "B": 1, "gather": 1}
    assert s["busy_us"] == {"A": 0.15, "B": 0.09, "gather": 0.3}
    assert s["span_us"] == 0.3 and s["gemm_ctas"] == 2
    # CTA 1: one 10 ns gap over its 200 ns; CTA 2: none over 50 ns
    assert s["scheduler_share"] == pytest.approx(10 / 250)


def test_kind_stats_percentiles_cta_time_and_same_kind_gaps():
    kinds = ("A", "B", "gather")
    # CTA 1: A 100-200, A 210-300 (gap 10 ns), B 305-405; CTA 2: A 0-40; comm CTA 0: gather 0-1000
    recs = [(100, 200, 0, 1, 0), (210, 300, 0, 1, 1), (305, 405, 1, 1, 2), (0, 40, 0, 2, 3), (0, 1000, 2, 0, 0)]
    st = trace_view.kind_stats(recs, kinds, gemm_kinds=2)
    assert st["A"]["n"] == 3 and st["A"]["p10"] == 0.04 and st["A"]["p50"] == 0.09 and st["A"]["max"] == 0.1
    assert st["A"]["cta_ms"] == pytest.approx(0.23e-3) and st["A"]["gap_us"] == pytest.approx(0.01)
    assert "gap_us" not in st["B"] and "gap_us" not in st["gather"]  # B follows A; gather is not a GEMM kind
    line = trace_view.format_kind_stats(st)
    assert line.startswith("A 3 0.0/0.1/0.1/0.1 us 0.0 ms gap 0.01; B 1 ") and "gather 1 1.0/1.0/1.0/1.0" in line


def test_forward_traces_still_load(tmp_path):
    """A trace without ``gemm_kinds`` (the forward's older files) counts kinds < 4 as GEMM tasks."""
    path = tmp_path / "old.json"
    path.write_text('{"records": [[5, 9, 3, 0], [5, 9, 4, 1]], "kinds": ["a", "b", "c", "d", "e"], "comm_ctas": 1}')
    s = trace_view.summary(*trace_view.load(path))
    assert s["gemm_ctas"] == 1 and s["tasks"] == {"d": 1, "e": 1}


@pytest.mark.parametrize("shared", [False, True])
def test_fused_bwd_trace_buffer_holds_every_task(shared):
    from mok_cute.kernels.sm90 import fused_bwd
    from mok_cute.schedule import fused_bwd_tasks as tasks

    rng = random.Random(3)
    hid, inter, i_s, t = 768, 512, 256, 300
    for _ in range(20):
        e = rng.randint(1, 9)
        counts = [rng.choice([0, 1, 127, 128, 129, rng.randint(0, 700)]) for _ in range(e)]
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        m = offsets[-1] + rng.randint(0, 50)
        w_d = -(-hid // 128) * (inter // 256)
        w_gu = -(-inter // 128) * (hid // 256)
        n = len(tasks.task_list(offsets, 0, 128, inter // 256, 0, hid // 256, w_d, w_gu, False))
        sh = None
        if shared:
            sh = (None, torch.empty(t, 2 * i_s), None, torch.empty(i_s, hid), None, None)
            n += len(tasks.task_list([0], t, 128, 0, i_s // 256, hid // 256, -(-hid // 128) * (i_s // 256),
                                     -(-i_s // 128) * (hid // 256), True))
        assert fused_bwd._task_cap(m, e, hid, inter, sh) >= n


def test_occupancy_spreads_each_task_over_its_bins():
    """A task covering a bin adds 1 SM there; a task over half a bin adds 0.5; kinds apart."""
    recs = [(0, 100, 0, 1, 0), (0, 50, 1, 2, 0), (50, 100, 1, 3, 0)]
    xs, occ = trace_view.occupancy(recs, 3, bins=2)
    assert xs == [0.025, 0.075]
    assert occ[0] == [1.0, 1.0] and occ[1] == [1.0, 1.0] and occ[2] == [0.0, 0.0]
    _, occ = trace_view.occupancy([(0, 25, 0, 1, 0), (0, 100, 1, 2, 0)], 2, bins=2)
    assert occ == [[0.5, 0.0], [1.0, 1.0]]  # a quarter of the span: half of the first bin


def test_cli_writes_chrome_trace_and_png(tmp_path, capsys):
    """``python -m mok_cute.trace FILE``: the Chrome trace (one slice per task, a thread per CTA), the
    PNG (matplotlib present) and the summary printed."""
    pytest.importorskip("matplotlib")
    recs = torch.tensor([_rec(100, 200, 0, 1, 0), _rec(210, 300, 1, 1, 1), _rec(100, 400, 2, 0, 0)], dtype=torch.int64)
    path = tmp_path / "t.json"
    trace_view.dump(path, recs, 1, ("A", "B", "gather"), gemm_kinds=2)
    assert trace_view.main([str(path), "--out-prefix", str(tmp_path / "out")]) == 0
    events = json.loads((tmp_path / "out.chrome.json").read_text())["traceEvents"]
    assert [(e["name"], e["tid"], e["dur"]) for e in events] == [("A", 1, 0.1), ("B", 1, 0.09), ("gather", 0, 0.3)]
    assert (tmp_path / "out.png").stat().st_size > 0
    assert '"span_us": 0.3' in capsys.readouterr().out


def test_last_names_the_pass():
    with pytest.raises(ValueError, match="forward' or 'backward"):
        trace_view.last("sideways")


class _Axes:
    """Records what plot_occupancy draws (no matplotlib needed)."""

    def stackplot(self, xs, *ys, labels):
        self.labels, self.ys = list(labels), ys

    def __getattr__(self, name):
        return lambda *a, **k: None


def test_occupancy_plot_stacks_tasks_not_cta_lives():
    from mok_cute import trace

    kinds = ["R1", "R2", "CTA"]
    recs = [(0, 1000, 0, 0, 0), (1000, 2000, 1, 0, 0), (0, 2000, 2, 0, 0), (0, 2000, 0, 1, 0)]
    ax = _Axes()
    trace.plot_occupancy(ax, recs, kinds)
    assert ax.labels == ["R1", "R2"]
    total = [sum(col) for col in zip(*ax.ys)]
    assert max(total) <= 2.0 + 1e-9  # two SMs ran tasks; their CTA lives add nothing

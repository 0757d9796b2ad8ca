"""The device checks' shared pieces on the CPU: tools/checks/common (power_summary: the busy samples of
nvidia-smi's clock / power / reasons query; the rows of a check run in a child process), the check
registry of ``python -m tools.gpu_check``, the ``gpu`` marker's skip (tests/conftest.py), and
tools/mem_peak's allocator-trace replay."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.checks.common import ROOT, PowerSampler, Row, all_skipped, child_rows, power_summary, read_rows


def test_busy_samples_clock_power_and_cap_share():
    lines = ["1980, 123.1, 0x0000000000000000", "1365, 701.7, 0x0000000000000004", "1800, 678.3, 0x0000000000000004",
             "1965, 508.5, 0x0000000000000000", "[N/A], 80.0, 0x1", "garbage"]
    got = power_summary(lines)
    assert got.startswith("3 samples above 300 W")
    assert "SM clock mean 1710 MHz (min 1365)" in got and "power mean 630 W" in got and "cap active in 67%" in got
    assert power_summary(lines[:1]) == "no sample above 300 W"


def test_sampler_without_nvidia_smi(monkeypatch):
    import tools.checks.common as c

    monkeypatch.setattr(c.shutil, "which", lambda name: None)
    with PowerSampler() as p:
        pass
    assert p.summary() == "nvidia-smi not found"


def test_mem_peak_replays_the_allocator_trace():
    """tools/mem_peak.peak_blocks: the highest running sum of the trace's allocations (frees by
    request or completion, each counted once), and the blocks live at that moment; _where names
    the innermost project frame."""
    from tools.mem_peak import _where, peak_blocks

    f = [{"filename": "/x/torch/nn.py", "line": 1, "name": "f"},
         {"filename": "/r/mok_cute/kernels/a.py", "line": 7, "name": "g"}]
    trace = [dict(action="alloc", addr=1, size=100, frames=f), dict(action="alloc", addr=2, size=50),
             dict(action="free_requested", addr=1), dict(action="free_completed", addr=1),
             dict(action="alloc", addr=3, size=60), dict(action="alloc", addr=4, size=30),
             dict(action="free_completed", addr=3), dict(action="segment_alloc", addr=9, size=999)]
    peak, live = peak_blocks(trace)
    assert peak == 150 and sorted(live) == [1, 2] and live[1][0] == 100
    assert _where(f) == "kernels/a.py:7 g" and _where(f[:1]) == "?"
    assert peak_blocks(trace[2:]) == (90, {3: (60, []), 4: (30, [])})


def test_check_registry_lists_every_check_module():
    """tools.gpu_check.check_names: every module of tools/checks but ``common`` (the tests of tests/gpu)."""
    from tools.gpu_check import CHECKS_DIR, check_names

    names = check_names()
    assert names == sorted(names) and "common" not in names and "__init__" not in names
    assert {"layer_sm90", "fused_fwd", "fused_bwd", "comm"} <= set(names)
    assert set(names) == {p.stem for p in CHECKS_DIR.glob("*.py")} - {"common", "__init__"}


def test_read_rows_and_skipped_checks(tmp_path):
    rows = [Row("a: skipped", ok=True, note="needs sm_90"), Row("b", max_err=0.5, bitwise=False, ok=False, note="x")]
    path = tmp_path / "gpu_check.jsonl"
    path.write_text("".join(json.dumps(r.__dict__) + "\n" for r in rows))
    assert read_rows(path, "lbl", 0) == rows
    missing = read_rows(tmp_path / "none.jsonl", "lbl", 3)
    assert len(missing) == 1 and not missing[0].ok and missing[0].name == "lbl: child failed" and "3" in missing[0].note
    assert all_skipped(rows[:1]) and not all_skipped(rows) and not all_skipped([])
    assert not all_skipped([Row("c: skipped", ok=False)])


def test_child_rows_of_an_unknown_check_fail_without_a_gpu():
    """``python -m tools.gpu_check`` refuses an unknown name before touching CUDA (status 2, no rows):
    the child's failure comes back as one failed row."""
    rows = child_rows("no_such_check", {}, 120, "probe")
    assert len(rows) == 1 and not rows[0].ok and rows[0].note == "exit code 2, no rows written"
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "no_such_check"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 2 and "unknown check(s) ['no_such_check']" in out.stderr


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_marker_skips_without_cuda(monkeypatch, cuda):
    """tests/conftest.py: items marked ``gpu`` get a skip marker with the reason when torch sees no
    CUDA device, and none when it does; unmarked items are left alone."""
    import conftest

    class Item:
        def __init__(self, gpu):
            self.gpu, self.added = gpu, []

        def get_closest_marker(self, name):
            return object() if name == "gpu" and self.gpu else None

        def add_marker(self, marker):
            self.added.append(marker)

    monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda: cuda)
    items = [Item(True), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert items[1].added == []
    if cuda:
        assert items[0].added == []
    else:
        (mark,) = items[0].added
        assert mark.mark.name == "skip" and mark.mark.kwargs["reason"] == conftest.GPU_SKIP_REASON

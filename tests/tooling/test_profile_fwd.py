"""tools.profile_fwd's task lines (``--tasks``) and mok_cute.trace.normalize on CPU records."""
import json

import torch

from mok_cute import trace
from tools import profile_fwd


def _trace(rows):
    return trace.Trace(torch.tensor(rows, dtype=torch.int64), ("A", "B", "wait"), 1, 2)


def test_normalize_is_what_load_reads(tmp_path):
    rows = [[1000, 4000, 0 | 3 << 8, 7], [0, 0, 0, 0], [2000, 2500, 1 | 1 << 8, 8]]
    trace.dump(tmp_path / "t.json", torch.tensor(rows), 1, ("A", "B"), 2)
    assert trace.normalize(rows) == trace.load(tmp_path / "t.json")[0]
    assert trace.normalize(rows) == [(0, 3000, 0, 3, 7), (1000, 1500, 1, 1, 8)]
    assert json.loads((tmp_path / "t.json").read_text())["gemm_kinds"] == 2


def test_task_lines_name_each_kind_and_the_span():
    t = _trace([[0, 10_000, 0, 1], [5_000, 25_000, 0 | 1 << 8, 2], [25_000, 27_000, 1, 3], [0, 0, 0, 0]])
    fwd, bwd = profile_fwd.task_lines({"forward": t, "backward": None})
    assert fwd.startswith("forward tasks (span 27 us): ") and "A 2 " in fwd and "B 1 " in fwd and "wait" not in fwd
    assert bwd == "backward: no fused launch traced"


def test_config_fields_reach_the_layer_config():
    """``--config FIELD=VALUE`` (the benchmark's parser) adds MoKConfig fields, policy objects included; the fields
    the tool sets itself, unknown fields and rejected values exit with an error naming them."""
    import pytest

    args = profile_fwd.parse_args(["--config", 'policy={"fused_backward": {"tile_n": 128, "stages": 3}}',
                                   "--config", "minibatch_tokens=4096"])
    assert args.config == {"policy": {"fused_backward": {"tile_n": 128, "stages": 3}}, "minibatch_tokens": 4096}
    assert profile_fwd.parse_args([]).config == {}
    for bad in ("comm_sms_fwd=8", "validate_routing=true", "no_such=1", "tile_n=100"):
        with pytest.raises(SystemExit):
            profile_fwd.parse_args(["--config", bad])


def test_call_stats_leave_out_the_first_call():
    """Three calls of two events each, the first with a long profiler start-up gap: the per-call figures are
    those of the last two (span, busy, idle, events); without plan kernels every call counts."""
    ev = [("count_kernel", 0, 10), ("fused", 500, 1000),  # call 1: 490 us idle
          ("count_kernel", 1005, 1015), ("fused", 1020, 1500),
          ("count_kernel", 1510, 1520), ("fused", 1525, 2005)]
    st = profile_fwd.call_stats(ev, 3)
    assert st["calls_counted"] == 2 and st["events"] == 2
    assert st["span"] == (2005 - 1005) / 2 and st["busy"] == (10 + 480) * 2 / 2
    assert st["idle"] == st["span"] - st["busy"] == 10
    plain = profile_fwd.call_stats([("k", 0, 10), ("k", 20, 30)], 2)
    assert plain["calls_counted"] == 2 and plain["idle"] == 5 and plain["busy"] == 10


def test_synchronizing_calls_are_the_sync_debug_warnings(monkeypatch):
    """Only the warnings of torch's sync debug mode count, each as ``file:line message``; the mode is off after."""
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at x.cpp:1.)")
        warnings.warn("an unrelated warning")

    found = profile_fwd.synchronizing_calls(step)
    assert len(found) == 1 and "test_profile_fwd.py:" in found[0] and "synchronizing CUDA operation" in found[0]
    assert modes == ["warn", 0]


def test_launch_line_counts_per_call():
    """The launch line divides each path's count between two snapshots by the calls: steady-state steps should show
    captures 0 (every launch a replay of a graph captured before)."""
    line = profile_fwd.launch_line({"graph": 10, "capture": 4, "dsl": 1}, {"graph": 70, "capture": 24, "dsl": 1}, 20)
    assert line == "mok_cute launches per call: 3.0 graph replays, 1.0 captures (new argument sets), 0.0 DSL calls"
    assert set(profile_fwd.launch_stats()) == {"graph", "capture", "dsl"}

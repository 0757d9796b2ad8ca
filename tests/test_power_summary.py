"""tools/checks/common.power_summary: the busy samples of nvidia-smi's clock / power / reasons query
(what bench_layer.py prints for its timed rounds)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checks.common import PowerSampler, power_summary  # noqa: E402


def test_busy_samples_clock_power_and_cap_share():
    lines = ["1980, 123.1, 0x0000000000000000", "1365, 701.7, 0x0000000000000004", "1800, 678.3, 0x0000000000000004",
             "1965, 508.5, 0x0000000000000000", "[N/A], 80.0, 0x1", "garbage"]
    got = power_summary(lines)
    assert got.startswith("3 samples above 300 W")
    assert "SM clock mean 1710 MHz (min 1365)" in got and "power mean 630 W" in got and "cap active in 67%" in got
    assert power_summary(lines[:1]) == "no sample above 300 W"


def test_sampler_without_nvidia_smi(monkeypatch):
    import checks.common as c

    monkeypatch.setattr(c.shutil, "which", lambda name: None)
    with PowerSampler() as p:
        pass
    assert p.summary() == "nvidia-smi not found"


def test_mem_peak_replays_the_allocator_trace():
    """tools/mem_peak.peak_blocks: the highest running sum of the trace's allocations (frees by
    request or completion, each counted once), and the blocks live at that moment; _where names
    the innermost project frame."""
    from mem_peak import _where, peak_blocks

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


def test_energy_fwd_backward_rows():
    """tools/energy_fwd.backward_rows: each implementation's fwd+bwd minus its fwd, against the torch
    layer's and the tiles' backward; rows without a forward (or no torch / tiles pair) give nothing."""
    from energy_fwd import backward_rows

    us = {"fwd GEMM tiles alone": 100.0, "fwd torch": 300.0, "fwd fused default": 120.0,
          "fwd+bwd GEMM tiles alone": 400.0, "fwd+bwd torch": 900.0, "fwd+bwd fused default": 450.0,
          "fwd+bwd fused other": 1.0}
    got = {name: (v, a, b) for name, v, a, b in backward_rows(us)}
    assert set(got) == {"bwd GEMM tiles alone", "bwd torch", "bwd fused default"}
    v, vs_torch, vs_tiles = got["bwd fused default"]
    assert (v, vs_torch, vs_tiles) == (330.0, 600.0 / 330.0, 330.0 / 300.0)
    assert got["bwd torch"][1] == 1.0 and got["bwd GEMM tiles alone"][2] == 1.0
    assert backward_rows({k: v for k, v in us.items() if "torch" not in k}) == []


def test_energy_fwd_median_round():
    """tools/energy_fwd.median_round: the whole round of median time (its clock and power with it), the lower middle
    one of an even count."""
    from energy_fwd import median_round

    rounds = [(120.0, 1400.0, 690.0), (100.0, 1500.0, 680.0), (110.0, 1450.0, 685.0)]
    assert median_round(rounds) == (110.0, 1450.0, 685.0)
    assert median_round(rounds[:2]) == (100.0, 1500.0, 680.0)
    assert median_round(rounds[:1]) == rounds[0]

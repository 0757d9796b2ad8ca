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

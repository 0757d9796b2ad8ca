"""examples/hf_finetune.py at --tiny on the CPU (mok_cute's reference backend, transformers'
grouped_mm): three training steps of each backend, then the JSON report it writes."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17",
                    reason="transformers >= 5.17 is not installed (pip install -e '.[test]' installs it)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_finetune.py"


def _example():
    spec = importlib.util.spec_from_file_location("hf_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registry():
    """Restores transformers' experts registry after the example's register() replaced "mok_cute"."""
    from transformers.integrations.moe import ExpertsInterface

    saved = dict(ExpertsInterface._global_mapping)
    yield
    ExpertsInterface._global_mapping.clear()
    ExpertsInterface._global_mapping.update(saved)


def test_tiny_finetune_writes_its_report(tmp_path, registry):
    returned = _example().main(["--tiny", "--steps", "3", "--warmup", "1", "--device", "cpu",
                                "--backends", "grouped_mm,mok_cute,sonicmoe", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "hf_finetune.json").read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["reference"] == "grouped_mm"
    assert set(report["backends"]) == {"grouped_mm", "mok_cute"}
    assert "sonicmoe" in report["skipped"]  # no GPU here: skipped, with the reason
    for name, r in report["backends"].items():
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), name
        assert r["final_loss"] == r["losses"][-1] and r["tokens_per_s"] > 0 and r["first_step_s"] > 0
        assert r["peak_memory_gib"] is None  # CPU: no CUDA memory statistics
    # the same initial weights and batches: the first step's loss is the same model on the same tokens
    first = [r["losses"][0] for r in report["backends"].values()]
    assert abs(first[0] - first[1]) <= 1e-2 * first[0]
    assert report["backends"]["grouped_mm"]["loss_gap_vs_reference"] == 0.0
    assert report["backends"]["mok_cute"]["loss_gap_vs_reference"] < 5e-2
    assert (tmp_path / report["plot"]).is_file() and report["plot"] in ("hf_finetune_loss.png", "hf_finetune_loss.csv")


def test_ceiling_times_the_step_without_experts(tmp_path, registry):
    report = _example().main(["--tiny", "--steps", "2", "--warmup", "0", "--device", "cpu", "--ceiling", "2",
                              "--backends", "grouped_mm", "--out", str(tmp_path)])
    c = report["ceiling"]
    assert c["steps"] == 2 and c["step_s_without_experts"] > 0
    assert set(c["experts_share"]) == {"grouped_mm"} and c["experts_share"]["grouped_mm"] < 1
    assert c["max_speedup_vs_grouped_mm"] == pytest.approx(
        report["backends"]["grouped_mm"]["step_s_median"] / c["step_s_without_experts"])


def test_no_experts_keeps_the_router_and_the_experts_weights_in_the_step():
    """The ceiling's experts backend returns zeros, yet the routing weights and the experts' parameters get (zero)
    gradients: the router's backward and the optimizer's update of those weights stay in the timed step."""
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
    experts.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))
    hidden, top_w = torch.randn(3, 4, requires_grad=True), torch.rand(3, 2, requires_grad=True)
    y = _example()._no_experts(experts, hidden, torch.zeros(3, 2, dtype=torch.long), top_w)
    assert torch.equal(y, torch.zeros(3, 4))
    y.sum().backward()
    for t in (experts.gate_up_proj, experts.down_proj, top_w):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_sonicmoe_must_follow_mok_cute(tmp_path, registry):
    # importing SonicMoE patches CuTe DSL process-wide: mok_cute's kernels must compile first
    with pytest.raises(SystemExit, match="mok_cute before sonicmoe"):
        _example().main(["--tiny", "--steps", "1", "--device", "cpu", "--backends", "sonicmoe,mok_cute",
                         "--out", str(tmp_path)])

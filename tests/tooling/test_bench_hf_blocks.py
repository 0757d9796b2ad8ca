"""``python -m tools.bench_hf_blocks --tiny`` on the CPU (hf_tiny's dims, mok_cute's reference backend): its
rows and JSON fields, the reasons of what cannot run, and its command line."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17",
                    reason="transformers >= 5.17 is not installed (pip install -e '.[test]' installs it)")

from tools import bench_hf_blocks as bench  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")  # the reference backend, as intended here
META = {"device", "date", "command", "torch", "transformers", "tokens", "warmup", "iters", "tiny"}


def test_tiny_rows_have_finite_times_and_the_documented_fields(tmp_path, capsys):
    path = tmp_path / "blocks.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--models", "qwen2_moe,gpt_oss", "--tokens", "64",
                       "--json", str(path)])
    data = json.loads(path.read_text())
    assert set(data["meta"]) == META and data["meta"]["tiny"] is True and data["meta"]["device"] == "cpu"
    assert data["meta"]["command"].endswith(f"--json {path}")
    assert (data["meta"]["iters"], data["meta"]["warmup"], data["meta"]["tokens"]) == (1, 0, 64)
    assert data["rows"] == rows and [r["model"] for r in rows] == ["qwen2_moe", "gpt_oss"]
    for r in rows:
        assert tuple(r) == bench.FIELDS and r["error"] is None, r
        for key in ("grouped_mm_ms", "mok_cute_ms", "speedup"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["rel_err_out"] < 5e-2 and r["rel_err_dx"] < 5e-2  # bf16 on both backends, the same routing
        assert r["grouped_mm_peak_mib"] is None and r["mok_cute_peak_mib"] is None  # no CUDA memory on the CPU
        assert (r["tokens"], r["hidden"], r["intermediate"], r["experts"], r["top_k"]) == (64, 64, 64, 4, 4)
    assert rows[0]["shared_intermediate"] == 128 and rows[0]["shape"] == "T64 H64 I64 E4 k4 +shared128"
    assert rows[1]["block"] == "GptOssMLP" and rows[1]["shared_intermediate"] is None
    out = capsys.readouterr().out
    assert out.startswith("# cpu, ") and "mok_cute_ms" in out and "qwen2_moe" in out and "gpt_oss" in out


def test_what_cannot_run_gets_its_reason_and_the_rest_goes_on(monkeypatch, capsys):
    monkeypatch.setitem(bench.FAMILIES, "olmoe", ("NoSuchBlock", {}, "OLMoE"))  # as if transformers lacked it
    timed = bench.time_backend

    def out_of_memory_on_mok_cute(block, impl, *args):
        if impl != "grouped_mm":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return timed(block, impl, *args)

    monkeypatch.setattr(bench, "time_backend", out_of_memory_on_mok_cute)
    olmoe, qwen = bench.main(["--tiny", "--device", "cpu", "--models", "olmoe", "qwen3_moe", "--tokens", "32"])
    assert olmoe["error"].startswith("AttributeError: ") and "NoSuchBlock" in olmoe["error"]
    assert olmoe["grouped_mm_ms"] is None and olmoe["shape"] is None
    assert qwen["error"] == "mok_cute: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert math.isfinite(qwen["grouped_mm_ms"]) and qwen["mok_cute_ms"] is None and qwen["speedup"] is None
    assert "[mok_cute: OutOfMemoryError" in capsys.readouterr().out


def test_command_line_defaults_and_refusals():
    args = bench.parse_args([])
    assert (args.tokens, args.iters, args.warmup, args.models) == (8192, 10, 3, list(bench.FAMILIES))
    assert list(bench.FAMILIES) == ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss"]
    tiny = bench.parse_args(["--tiny", "--models", "mixtral,olmoe", "gpt_oss", "--warmup", "2"])
    assert (tiny.tokens, tiny.iters, tiny.warmup, tiny.models) == (256, 1, 2, ["mixtral", "olmoe", "gpt_oss"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "llama"])

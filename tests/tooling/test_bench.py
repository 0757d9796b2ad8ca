"""``python -m mok_cute.bench`` on the CPU: its command line, the shape table, the inputs, the torch
baseline layer against mok_cute.reference, the rows / table / JSON / CSV, the plots (and their clean
absence without matplotlib), and the clear refusal to time anything without a GPU."""
from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

import mok_cute
from mok_cute.bench import cli, report, run
from mok_cute.bench.accuracy import rel_l1
from mok_cute.bench.shapes import SHAPES, Shape, make_inputs, parse, pick
from mok_cute.bench.torch_layer import torch_layer

TINY = Shape("tiny", 24, 64, 64, 4, 2, shared_i=64, limit=4.0)


# ---------------------------------------------------------------- shapes


def test_shape_table_names_the_models_and_the_docs_shapes():
    assert list(SHAPES) == ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v3-ep8",
                            "h7168", "i1024"]
    assert SHAPES["h7168"].dims == "T4096 H7168 I2048 E16 k8 +shared2048"
    assert SHAPES["i1024"].dims == "T8192 H4096 I1024 E32 k10 +shared1024"
    assert SHAPES["gpt-oss-20b"].dims == "T8192 H2880 I2880 E32 k4 L7"
    assert SHAPES["mixtral-8x7b"].dims == "T4096 H4096 I14336 E8 k2"
    for s in SHAPES.values():  # what the GPU kernels take: H, I, I_s multiples of 64, k <= E
        assert s.h % 64 == 0 and s.i % 64 == 0 and s.shared_i % 64 == 0 and 1 <= s.k <= s.e and s.note


def test_shape_flops_tokens_and_parse():
    s = SHAPES["h7168"]
    assert s.flop_fwd == 6 * 7168 * (4096 * 8 * 2048 + 4096 * 2048)
    assert s.with_tokens(256).t == 256 and s.with_tokens(256).dims.startswith("T256 H7168")
    assert parse("h7168") is s
    got = parse("2048,7168,2048,16,8")
    assert (got.t, got.h, got.i, got.e, got.k, got.shared_i, got.limit) == (2048, 7168, 2048, 16, 8, 2048, None)
    with pytest.raises(ValueError, match="T,H,I,E,k"):
        parse("2048,7168")
    assert [p.name for p in pick(None)] == list(SHAPES) and [p.name for p in pick(["all"])] == list(SHAPES)
    assert [p.t for p in pick(["i1024", "h7168"], tokens=512)] == [512, 512]
    with pytest.raises(ValueError, match="unknown shape"):
        pick(["h7168", "nope"])


def test_inputs_are_reproducible_and_shaped():
    a, dy = make_inputs(TINY, "cpu", seed=5)
    b, dy2 = make_inputs(TINY, "cpu", seed=5)
    assert a["x"].shape == (24, 64) and a["x"].dtype == torch.bfloat16 and dy.shape == (24, 64)
    assert a["topk_idx"].dtype == torch.int32 and a["topk_idx"].shape == (24, 2)
    assert a["w_gate"].shape == (4, 64, 64) and a["w_down"].shape == (4, 64, 64) and len(a["shared"]) == 3
    assert torch.allclose(a["topk_w"].sum(1), torch.ones(24))
    for name in ("x", "topk_idx", "topk_w", "w_gate", "w_up", "w_down"):
        assert torch.equal(a[name], b[name])
    assert torch.equal(dy, dy2) and not torch.equal(make_inputs(TINY, "cpu", seed=6)[0]["x"], a["x"])
    assert make_inputs(Shape("n", 8, 64, 64, 4, 2), "cpu")[0]["shared"] is None


# ---------------------------------------------------------------- the torch layer


@pytest.mark.parametrize("shared,limit,minus_one", [(False, None, False), (True, 4.0, True)])
def test_torch_layer_tracks_the_reference(shared, limit, minus_one):
    """The baseline computes the same layer as mok_cute (y and every gradient within BF16 tolerance of
    the reference backend), -1 slots and the SwiGLU clamp included: its speed ratio compares like with like."""
    s = Shape("t", 32, 64, 128, 4, 2, shared_i=64 if shared else 0, limit=limit)
    inputs, dy = make_inputs(s, "cpu", seed=3)
    if minus_one:
        inputs["topk_idx"][1, 1] = -1
        inputs["topk_idx"][7] = -1
    sh = inputs.pop("shared")
    leaves = [inputs[n].requires_grad_() for n in ("x", "topk_w", "w_gate", "w_up", "w_down")]
    sh_leaves = [w.requires_grad_() for w in sh or ()]
    y_ref = mok_cute.moe(**inputs, shared=sh, swiglu_limit=limit, config=mok_cute.MoKConfig(backend="reference"))
    ref = torch.autograd.grad(y_ref, leaves + sh_leaves, dy)
    w1 = torch.cat([inputs["w_gate"].detach(), inputs["w_up"].detach()], 1).requires_grad_()
    y = torch_layer(inputs["x"], inputs["topk_idx"], inputs["topk_w"], w1, inputs["w_down"], sh, limit)
    got = torch.autograd.grad(y, [inputs["x"], inputs["topk_w"], w1, inputs["w_down"]] + sh_leaves, dy)
    got = [got[0], got[1], got[2][:, :s.i], got[2][:, s.i:], *got[3:]]
    assert y.dtype == torch.bfloat16 and y.shape == (32, 64)
    assert rel_l1(y, y_ref) < 2e-2
    for name, a, b in zip(("dx", "dtopk_w", "dWg", "dWu", "dWd", "dWsg", "dWsu", "dWsd"), got, ref):
        assert rel_l1(a, b) < 3e-2, name
    if minus_one:  # a token with no expert: y is its shared expert's output alone
        assert torch.equal(y[7], ((torch.nn.functional.silu(inputs["x"][7] @ sh[0].t()) * (inputs["x"][7] @ sh[1].t()))
                                  @ sh[2].t()).float().bfloat16())


# ---------------------------------------------------------------- the rows of one shape (CPU: the reference backend)


def test_build_outputs_and_digests_on_the_reference_backend():
    impls = run.build(TINY, "cpu", ["bf16"], {"backend": "reference"})
    assert [i.name for i in impls] == ["torch", "mok bf16"]
    mok = impls[1]
    assert mok.config.precision == "bf16" and mok.config.validate_routing is False and impls[0].config is None
    first, again = run.outputs(mok), run.outputs(mok)
    assert list(first) == ["y", *run.GRAD_NAMES] and all(p.grad is None for p in mok.leaves)
    for name in first:  # deterministic: the same step twice is bitwise the same
        assert torch.equal(first[name], again[name]) and run.digest(first[name]) == run.digest(again[name])
    assert run.digest(first["y"]) != run.digest(first["dx"])
    assert run.digest(torch.zeros(2, dtype=torch.bfloat16)) != run.digest(torch.zeros(1, dtype=torch.float32))
    y_torch = impls[0].step()
    assert rel_l1(y_torch, first["y"]) < 2e-2 and impls[0].leaves[2].grad.shape == (4, 128, 64)


def test_warm_keeps_a_failure_in_its_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    impls = run.build(TINY, "cpu", ["bf16"], {"backend": "reference"})
    run.warm(impls[1], 1)
    assert impls[1].error == ""

    def refuse(cfg):
        raise NotImplementedError("fp8_block: not on this backend\nsecond line")
    bad = run.Impl("mok fp8_block", "fp8_block", refuse, [], None)
    run.warm(bad, 2)
    assert bad.error == "NotImplementedError: fp8_block: not on this backend"
    run.time_round([bad], 3)  # a failed row is not timed
    assert bad.times == {"fwd": [], "fwdbwd": []} and run.median_ms(bad, "fwd") is None
    bad.times["fwd"] = [3.0, 1.0, 2.0]
    assert run.median_ms(bad, "fwd") == 2.0


def test_one_shape_rows_digests_and_saved_outputs(monkeypatch):
    """cli.bench_shape on the CPU (the reference backend; CUDA timing and memory faked): one row per
    precision against the torch row, the median rounds' ratio, and the outputs of one step with their
    digests (``--save-outputs``) or the digests alone (``--digests``)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(run, "peak_mb", lambda impl: 10.0 if impl.name == "torch" else 5.0)
    ms = {"torch": iter([4.0, 8.0, 4.0, 8.0]), "mok bf16": iter([1.0, 2.0, 3.0, 6.0])}
    monkeypatch.setattr(run, "events_ms", lambda fn, iters: next(ms[fn.__self__.name]))

    class Bar:
        def set_description(self, text):
            pass

        def update(self, n=1):
            pass

    args = cli.parse_args(["--precision", "bf16", "--rounds", "2", "--warmup", "0", "--save-outputs", "o.pt",
                           "--config", "backend=reference"])
    saved, digests = {}, {}
    rows, traces = cli.bench_shape(TINY, args, Bar(), saved, digests, device="cpu")
    assert traces == {} and len(rows) == 1
    r = rows[0]
    assert (r["shape"], r["precision"], r["error"]) == ("tiny", "bf16", "")
    assert (r["torch_fwd_ms"], r["mok_fwd_ms"], r["fwd_speedup"]) == (4.0, 2.0, 2.0)  # medians of [1, 3] and [4, 4]
    assert (r["torch_fwdbwd_ms"], r["mok_fwdbwd_ms"], r["fwdbwd_speedup"]) == (8.0, 4.0, 2.0)
    assert (r["torch_peak_mb"], r["mok_peak_mb"]) == (10.0, 5.0)
    assert list(saved) == ["tiny/bf16"] and list(saved["tiny/bf16"]) == ["y", *run.GRAD_NAMES]
    assert digests["tiny/bf16"] == {n: run.digest(t) for n, t in saved["tiny/bf16"].items()}
    ms.update({"torch": iter([4.0, 8.0]), "mok bf16": iter([1.0, 2.0])})
    only, kept = {}, {}
    args = cli.parse_args(["--precision", "bf16", "--rounds", "1", "--warmup", "0", "--digests", "--config",
                           "backend=reference"])
    cli.bench_shape(TINY, args, Bar(), kept, only, device="cpu")
    assert kept == {} and only == digests  # the same step: bitwise the same outputs


# ---------------------------------------------------------------- the report


def _rows():
    s1, s2 = SHAPES["h7168"], SHAPES["i1024"]
    return [report.make_row(s1, "bf16", {"fwd": 6.0, "fwdbwd": 24.0}, {"fwd": 3.0, "fwdbwd": 16.0}, (4741.0, 3373.0)),
            report.make_row(s1, "mxfp8", {"fwd": 6.0, "fwdbwd": 24.0}, {"fwd": 2.5, "fwdbwd": None}, (4741.0, None)),
            report.make_row(s2, "bf16", {"fwd": 5.0, "fwdbwd": 12.0}, {}, (1.0, None), error="RuntimeError: boom")]


def test_rows_ratios_and_tflops():
    r = _rows()
    assert r[0]["fwd_speedup"] == 2.0 and r[0]["fwdbwd_speedup"] == 1.5 and r[0]["dims"] == SHAPES["h7168"].dims
    assert r[0]["mok_fwd_tflops"] == pytest.approx(SHAPES["h7168"].flop_fwd / 3e-3 / 1e12)
    assert r[0]["mok_fwdbwd_tflops"] == pytest.approx(3 * SHAPES["h7168"].flop_fwd / 16e-3 / 1e12)
    assert r[1]["fwdbwd_speedup"] is None and r[1]["mok_fwdbwd_tflops"] is None and r[1]["mok_peak_mb"] is None
    assert r[2]["fwd_speedup"] is None and r[2]["error"] == "RuntimeError: boom"


def test_table_format():
    text = report.table(_rows(), "title line")
    lines = text.splitlines()
    assert lines[0] == "title line" and lines[2].startswith("| shape | precision | torch fwd ms | mok fwd ms |")
    assert lines[3] == "|---|---|---|---|---|---|---|---|"
    assert lines[4] == "| h7168 | bf16 | 6 | 3 | 2.00x | 24 | 16 | 1.50x |"
    assert lines[5] == "| h7168 | mxfp8 | 6 | 2.5 | 2.40x | 24 | - | - |"
    assert lines[6] == "| i1024 | bf16 | 5 | - | - | 12 | - | - |"
    assert lines[-1] == "- i1024 bf16: RuntimeError: boom"
    assert max(len(c) for line in lines if line.startswith("|") for c in line.split("|")) < 300


def test_json_and_csv(tmp_path):
    rows = _rows()
    report.write_json(tmp_path / "r.json", {"device": "X"}, rows, {"h7168/bf16": {"y": "ab"}})
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["meta"] == {"device": "X"} and got["rows"] == rows and got["outputs_sha256"]["h7168/bf16"] == {"y": "ab"}
    report.write_json(tmp_path / "s.json", {}, rows)
    assert "outputs_sha256" not in json.loads((tmp_path / "s.json").read_text())
    report.write_csv(tmp_path / "r.csv", rows)
    with open(tmp_path / "r.csv") as f:
        back = list(csv.DictReader(f))
    assert tuple(back[0]) == report.FIELDS and len(back) == 3
    assert float(back[0]["fwd_speedup"]) == 2.0 and back[1]["mok_fwdbwd_ms"] == "" and back[2]["error"]


def test_plots_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.plot_speedup(_rows(), tmp_path / "speedup.png", "title")
    recs = [(0, 100, 0, 1, 0), (50, 150, 1, 2, 1), (0, 150, 2, 0, 0)]
    assert report.plot_timeline({"forward": (recs, ["S1", "R1", "gather"]), "backward": (recs, ["a", "b", "c"])},
                                tmp_path / "timeline.png", "t")
    assert not report.plot_timeline({}, tmp_path / "none.png")
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "timeline.png").stat().st_size
    assert not (tmp_path / "none.png").exists()


def test_plots_skipped_cleanly_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.pyplot() is None
    assert report.plot_speedup(_rows(), tmp_path / "speedup.png") is False
    cli.write_plots(tmp_path / "plots", _rows(), {}, "t", "h7168 bf16")
    assert "matplotlib missing (pip install mok_cute[plot])" in capsys.readouterr().err
    assert list((tmp_path / "plots").iterdir()) == []


# ---------------------------------------------------------------- the command line


def test_defaults():
    args = cli.parse_args([])
    assert [s.name for s in args.shapes] == list(SHAPES) and args.precision == ["bf16", "mxfp8"]
    assert args.config == {} and args.trace_shape == "mixtral-8x7b" and args.out == "mok_bench_results"
    assert (args.rounds, args.iters, args.warmup, args.plot, args.save_outputs, args.digests) == (5, 10, 3, None, None, False)


def test_arguments():
    args = cli.parse_args(["--shapes", "i1024", "h7168", "--precision", "mxfp8", "bf16", "mxfp8", "--tokens", "512",
                           "--config", "forward_path=unfused", "--config", "comm_sms_fwd=8", "--config",
                           "validate_routing=true", "--plot", "p", "--trace-shape", "h7168", "--save-outputs", "o.pt"])
    assert [(s.name, s.t) for s in args.shapes] == [("i1024", 512), ("h7168", 512)]
    assert args.precision == ["mxfp8", "bf16"]
    assert args.config == {"forward_path": "unfused", "comm_sms_fwd": 8, "validate_routing": True}
    assert args.trace_shape == "h7168" and args.plot == "p" and args.save_outputs == "o.pt"


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "nope"], "unknown shape"),
    (["--precision", "fp4"], "invalid choice"),
    (["--config", "precision=mxfp8"], "is set by --precision"),
    (["--config", "trace=true"], "is set by the trace step"),
    (["--config", "no_such=1"], "no field 'no_such'"),
    (["--config", "comm_sms_fwd=3"], "even integer"),
    (["--config", "comm_sms_fwd"], "FIELD=VALUE"),
    (["--shapes", "h7168", "--trace-shape", "i1024"], "not among the shapes run"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_config_values():
    assert [cli.parse_value(v) for v in ("None", "TRUE", "false", "8", "0.5", "fused")] == [None, True, False, 8, 0.5,
                                                                                              "fused"]
    # a JSON object: a KernelPolicy's fields (MoKConfig takes the mapping)
    policy = cli.parse_config(['policy={"fused_forward": {"tile_n": 128}, "minibatch_tokens": 2048}'])["policy"]
    assert policy == {"fused_forward": {"tile_n": 128}, "minibatch_tokens": 2048}
    with pytest.raises(ValueError, match="not a JSON object"):
        cli.parse_value("{tile_n: 128}")
    with pytest.raises(ValueError, match="--config: .*tile_n must be one of"):
        cli.parse_config(['policy={"gemm1": {"tile_n": 100}}'])


def test_list_shapes_needs_no_gpu(capsys):
    assert cli.main(["--list-shapes"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| name | shape | what |") and "| h7168 | T4096 H7168 I2048 E16 k8 +shared2048 |" in out


def test_without_a_gpu_nothing_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--shapes", "h7168", "--out", str(tmp_path / "r")]) == 2
    assert "torch sees none here: nothing was run" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()

"""``python -m mok_cute.bench --peers`` on the CPU: SonicMoE's weight layout and routing, the command
line, the fp32 accuracy computation against mok_cute.reference, the system rows and their files, a
missing peer as a row with an error, and the order "every mok_cute row compiled, then the peer
imported" (with a fake ``sonicmoe`` that computes SonicMoE's math in torch and checks what it is given)."""
from __future__ import annotations

import csv
import importlib.abc
import importlib.util
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import mok_cute
from mok_cute import reference
from mok_cute.bench import accuracy, cli, peers, report, run
from mok_cute.bench.shapes import SHAPES, Shape, make_inputs

CPU = {"backend": "reference"}
TINY = Shape("tiny", 24, 64, 64, 4, 2, shared_i=64, limit=4.0)
NARROW = Shape("narrow", 16, 64, 128, 4, 3)


# ---------------------------------------------------------------- SonicMoE's layout and routing


def test_weight_layout_round_trip():
    inputs, _ = make_inputs(Shape("w", 8, 64, 32, 3, 2), "cpu", seed=1)
    wg, wu, wd = inputs["w_gate"], inputs["w_up"], inputs["w_down"]
    w1, w2 = peers.to_sonic(wg, wu, wd)
    assert w1.shape == (3, 64, 64) and w1.is_contiguous() and w2 is wd
    assert torch.equal(w1[:, 0::2], wg) and torch.equal(w1[:, 1::2], wu)  # rows gate_0, up_0, gate_1, up_1, ...
    assert torch.equal(w1[1, 6], wg[1, 3]) and torch.equal(w1[1, 7], wu[1, 3])
    back = peers.from_sonic(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(back, (wg, wu, wd)))
    v1, v2 = peers.sonic_views(w1, w2)  # [2I, H, E] / [H, I, E], E the outermost stride (its MoE's permute(1, 2, 0))
    assert v1.shape == (64, 64, 3) and v1.stride() == (64, 1, 64 * 64) and v1.data_ptr() == w1.data_ptr()
    assert v2.shape == (64, 32, 3) and v2.stride() == (32, 1, 64 * 32)
    w1.requires_grad_()
    (peers.sonic_views(w1, w2)[0][5, :, 2].float().sum() * 2).backward()  # row 5 = up row 2
    grads = peers.from_sonic(w1.grad, w2)
    assert float(grads[1][2, 2].float().sum()) == 128.0 and float(grads[0].float().abs().sum()) == 0.0


def test_flat_routing():
    idx = torch.tensor([[2, 0], [1, 3], [0, 2]], dtype=torch.int32)
    kept, tokens, experts = peers.flat_routing(idx)
    assert kept is None and tokens.tolist() == [0, 0, 1, 1, 2, 2] and experts.tolist() == [2, 0, 1, 3, 0, 2]
    assert tokens.dtype == experts.dtype == torch.int32
    idx[1, 0] = -1
    kept, tokens, experts = peers.flat_routing(idx)
    assert kept.tolist() == [0, 1, 3, 4, 5] and tokens.tolist() == [0, 0, 1, 2, 2]
    assert experts.tolist() == [2, 0, 3, 0, 2]


def test_a_shape_with_a_shared_expert_or_clamp_is_refused_with_a_reason():
    assert peers.unsupported(NARROW) == ""
    why = peers.unsupported(TINY)
    assert "a shared expert and a SwiGLU clamp" in why and "--peers runs every shape without them" in why
    impl = peers.build("sonicmoe", TINY, *run.leaves(TINY, "cpu"))  # refused before any import
    assert (impl.name, impl.error, impl.leaves) == ("sonicmoe", why, [])
    run.warm(impl, 1)
    assert impl.error == why and impl.first_s is None


# ---------------------------------------------------------------- the command line


def test_cli_parses_peers():
    args = cli.parse_args(["--peers", "sonicmoe", "--shapes", "h7168", "gpt-oss-20b", "qwen3-30b-a3b"])
    assert args.peers == ["sonicmoe"]
    assert [s.dims for s in args.shapes] == ["T4096 H7168 I2048 E16 k8", "T8192 H2880 I2880 E32 k4",
                                             "T16384 H2048 I768 E128 k8"]  # routed only, for every system
    assert [s.name for s in args.shapes] == ["h7168", "gpt-oss-20b", "qwen3-30b-a3b"]
    plain = cli.parse_args(["--shapes", "h7168"])
    assert plain.peers == [] and plain.shapes[0] is SHAPES["h7168"]
    assert SHAPES["h7168"].routed_only().flop_fwd == 6 * 7168 * 4096 * 8 * 2048


def test_cli_refuses_an_unknown_peer(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--peers", "megablocks"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="peers must name"):
        cli.compare(["h7168"], peers=())


# ---------------------------------------------------------------- accuracy


def test_float32_computation_is_the_reference_math():
    """The fp32 computation against mok_cute.reference's float64 "exact" mode (nothing rounded): the
    same layer, shared expert, clamp and -1 slots included."""
    inputs, dy = make_inputs(TINY, "cpu", seed=4)
    inputs["topk_idx"][3, 1] = -1
    inputs["topk_idx"][9] = -1
    got = accuracy.reference(inputs, dy, TINY.limit)
    d = {n: inputs[n].double() for n in ("x", "topk_w", "w_gate", "w_up", "w_down")}
    y, saved = reference.moe_forward(d["x"], inputs["topk_idx"], d["topk_w"], d["w_gate"], d["w_up"], d["w_down"],
                                     tuple(w.double() for w in inputs["shared"]), TINY.limit, precision="exact")
    g = reference.moe_backward(saved, dy.double())
    want = [y, g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *g.d_shared]
    assert list(got) == ["y", *run.GRAD_NAMES]
    for (name, a), b in zip(got.items(), want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert accuracy.rel_l1(a, b) < 1e-5, name
    assert float(got["dtopk_w"][3, 1]) == 0.0 and float(got["dtopk_w"][9].abs().sum()) == 0.0


def test_rel_l1():
    a, b = torch.randn(1000), torch.randn(1000)
    direct = float((a - b).abs().sum() / b.abs().sum())
    assert accuracy.rel_l1(a, b, chunk=7) == pytest.approx(direct, rel=1e-6)
    assert accuracy.rel_l1(b.bfloat16(), b) < 4e-3 and accuracy.rel_l1(b, b) == 0.0
    assert accuracy.rel_l1(torch.zeros(3), torch.zeros(3)) == 0.0
    assert accuracy.rel_l1(torch.ones(3), torch.zeros(3)) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        accuracy.rel_l1(a, b[:10])
    errs = accuracy.errors({"y": a, "dx": None}, {"y": b, "dx": b, "dw_up": b})
    assert errs == {"rel_l1_y": pytest.approx(direct, rel=1e-6)}


# ---------------------------------------------------------------- the report


def _system_rows():
    s = NARROW
    measured = {"fwd": 1.5, "fwdbwd": 4.0, "peak_mb": 12.0, "first_call_s": 30.25}
    ok = report.make_system_row(s, "mok bf16", "bf16", measured, {"rel_l1_y": 0.0031, "rel_l1_dx": 0.0042,
                                                                  "rel_l1_dw_up": 0.005})
    bad = report.make_system_row(s, "sonicmoe", "bf16", {}, {}, "sonicmoe is not importable (x); y")
    return [ok, bad]


def test_system_rows_table_and_files(tmp_path):
    rows = _system_rows()
    assert tuple(rows[0]) == report.SYSTEM_FIELDS and rows[0]["rel_l1_dws_gate"] is None
    lines = report.system_table(rows, "t").splitlines()
    assert lines[2].startswith("| shape | system | fwd ms | fwd+bwd ms | peak MiB | first call s | rel-L1 y | dx |")
    assert lines[4] == "| narrow | mok bf16 | 1.5 | 4 | 12 | 30.25 | 3.10e-03 | 4.20e-03 | - | - | 5.00e-03 | - |"
    assert lines[5] == "| narrow | sonicmoe | - | - | - | - | - | - | - | - | - | - |"
    assert lines[-1] == "- narrow sonicmoe: sonicmoe is not importable (x); y"
    report.write_json(tmp_path / "r.json", {}, [], None, rows)
    assert json.loads((tmp_path / "r.json").read_text())["systems"] == rows
    report.write_csv(tmp_path / "s.csv", rows, report.SYSTEM_FIELDS)
    with open(tmp_path / "s.csv") as f:
        back = list(csv.DictReader(f))
    assert tuple(back[0]) == report.SYSTEM_FIELDS and back[0]["rel_l1_y"] == "0.0031" and back[1]["fwd_ms"] == ""


# ---------------------------------------------------------------- the whole run on the CPU, a fake SonicMoE


def _fake_general_routing(events):
    """SonicMoE's ``moe_general_routing_inputs`` in torch (fp32 math, bf16 out), checking its operands'
    layout as the module doc of mok_cute.bench.peers states it."""
    def moe_general_routing_inputs(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                                   activation_type, is_inference_mode_enabled=False, concat_layout=False):
        events.append(("sonicmoe call",))
        two_i, h, e = w1.shape
        assert w2.shape == (h, two_i // 2, e) and E == e and b1 is None and b2 is None and not concat_layout
        assert w1.stride()[2] == two_i * h and w2.stride()[2] == h * two_i // 2  # E outermost in storage
        assert token_indices.dtype == expert_indices.dtype == torch.int32 and router_scores.dtype == torch.float32
        assert bool((token_indices[1:] >= token_indices[:-1]).all()) and activation_type == "swiglu"
        assert is_inference_mode_enabled == (not torch.is_grad_enabled())
        tok, ex = token_indices.long(), expert_indices.long()
        gu = torch.einsum("mh,mih->mi", x[tok].float(), w1.permute(2, 0, 1).float()[ex])
        a = F.silu(gu[:, 0::2]) * gu[:, 1::2]  # interleaved: gate on even rows, up on odd
        r = torch.einsum("mi,mhi->mh", a, w2.permute(2, 0, 1).float()[ex])
        o = torch.zeros(x.shape).index_add(0, tok, r * router_scores[:, None])
        return o.to(x.dtype), torch.bincount(ex, minlength=E)

    return moe_general_routing_inputs


class FakeSonic(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sonicmoe`` gives a fake module and logs the import."""

    def __init__(self, events):
        self.events = events

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "sonicmoe" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.events.append(("import sonicmoe",))
        module.moe_general_routing_inputs = _fake_general_routing(self.events)
        module.enums = types.SimpleNamespace(ActivationType=types.SimpleNamespace(SWIGLU="swiglu"))


@pytest.fixture
def cpu_timing(monkeypatch):
    """CUDA timing, memory and syncs faked (the logic under test is the CPU part)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(run, "peak_mb", lambda impl: 7.0)
    monkeypatch.setattr(run, "events_ms", lambda fn, iters: 2.0)


@pytest.fixture
def events(monkeypatch):
    """The event log of mok_cute calls ("mok", T, precision) and of the fake sonicmoe's import and calls."""
    log = []
    monkeypatch.delitem(sys.modules, "sonicmoe", raising=False)
    monkeypatch.setattr(sys, "meta_path", [FakeSonic(log), *sys.meta_path])

    def logged_moe(**kw):
        log.append(("mok", kw["x"].shape[0], kw["config"].precision))
        return mok_cute.moe(**kw)

    monkeypatch.setattr(run, "moe", logged_moe)
    return log


def test_ours_compile_before_the_peer_import_and_every_system_is_measured(cpu_timing, events):
    systems = cli.compare([TINY, NARROW], precisions=("bf16", "fp8_block"), config=CPU, rounds=2, iters=1, warmup=1,
                          device="cpu")
    at = events.index(("import sonicmoe",))
    before, after = set(events[:at]), set(events[at + 1:])
    assert {("mok", 24, "bf16"), ("mok", 16, "bf16")} <= before  # both shapes' mok rows ran before the import
    assert {e for e in after if e[0] == "mok"} <= before  # nothing new of ours after it
    assert ("mok", 16, "fp8_block") in before and ("mok", 16, "fp8_block") not in after  # failed before: not retried
    assert ("sonicmoe call",) in after and events.count(("import sonicmoe",)) == 1
    assert [(r["shape"], r["system"]) for r in systems] == [(s, n) for s in ("tiny", "narrow")
                                                            for n in ("torch", "mok bf16", "mok fp8_block", "sonicmoe")]
    for r in systems:
        assert r["dims"] in ("T24 H64 I64 E4 k2", "T16 H64 I128 E4 k3")  # without shared expert and clamp
        if r["system"] == "mok fp8_block":  # H 64: not a multiple of fp8_block's 128
            assert r["error"] and r["fwd_ms"] is None and r["rel_l1_y"] is None and r["first_call_s"] is None
            continue
        assert r["error"] == "" and (r["fwd_ms"], r["fwdbwd_ms"], r["peak_mb"]) == (2.0, 2.0, 7.0), r
        assert r["first_call_s"] > 0 and r["rel_l1_dws_gate"] is None
        assert r["rel_l1_y"] < 1e-2, r
        for n in ("dx", "dtopk_w", "dw_gate", "dw_up", "dw_down"):
            assert 0 < r[f"rel_l1_{n}"] < 3e-2, (r["system"], n)


def test_a_missing_sonicmoe_gives_a_row_with_an_error(cpu_timing, monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import sonicmoe raises ImportError
    systems = cli.compare([NARROW], config=CPU, rounds=1, iters=1, warmup=0, device="cpu")
    assert [r["system"] for r in systems] == ["torch", "mok bf16", "sonicmoe"]
    assert systems[0]["error"] == systems[1]["error"] == "" and systems[1]["rel_l1_y"] < 1e-2
    err = systems[2]["error"]
    assert err.startswith("sonicmoe is not importable (ModuleNotFoundError") and "tools/peer_env.sh" in err
    assert systems[2]["fwd_ms"] is None and systems[2]["rel_l1_y"] is None and systems[2]["peak_mb"] is None


def test_one_shape_alone_runs_ours_before_the_import_too(cpu_timing, events):
    """cli.bench_shape without the first pass (one shape): its mok rows run before the peer is
    imported, and it gives one main row per precision and one system row per system."""
    from tqdm import tqdm

    args = cli.parse_args(["--peers", "sonicmoe", "--precision", "bf16", "--rounds", "1", "--warmup", "0",
                           "--config", "backend=reference"])
    systems = []
    with tqdm(disable=True) as bar:
        rows, traces = cli.bench_shape(NARROW, args, bar, {}, {}, device="cpu", systems=systems)
    at = events.index(("import sonicmoe",))
    assert ("mok", 16, "bf16") in events[:at] and ("sonicmoe call",) in events[at:]
    assert traces == {} and [r["precision"] for r in rows] == ["bf16"] and rows[0]["error"] == ""
    assert [r["system"] for r in systems] == ["torch", "mok bf16", "sonicmoe"] and not any(r["error"] for r in systems)


def test_a_sonicmoe_with_another_api_gives_a_row_with_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", types.ModuleType("sonicmoe"))  # imports, has no enums
    impl = peers.build("sonicmoe", NARROW, *run.leaves(NARROW, "cpu"))
    assert impl.error == "sonicmoe row not built: AttributeError: module 'sonicmoe' has no attribute 'enums'"


def test_each_finished_shape_is_printed_and_written_at_once(cpu_timing, events, tmp_path, capsys):
    """A run cut short keeps what it finished: after each shape its lines are printed and the
    JSON / CSV files hold every shape done so far."""
    from tqdm import tqdm

    args = cli.parse_args(["--peers", "sonicmoe", "--precision", "bf16", "--rounds", "1", "--warmup", "0",
                           "--config", "backend=reference", "--out", str(tmp_path / "r")])
    args.shapes = [TINY.routed_only(), NARROW]
    meta, seen = {"device": "cpu"}, []

    def on_shape(out, rows):
        cli.write_partial(args, meta, out, rows, bar)
        seen.append([r["shape"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]])
        with open(tmp_path / "r_systems.csv") as f:
            seen[-1].append(len(list(csv.DictReader(f))))

    with tqdm(disable=True) as bar:
        cli.run_shapes(args, bar, "cpu", on_shape=on_shape)
    assert seen == [["tiny", 3], ["tiny", "narrow", 6]]
    printed = capsys.readouterr().out
    assert "narrow bf16: fwd 1.00x, fwd+bwd 1.00x the torch layer" in printed
    assert "narrow sonicmoe: fwd 2.000 ms, fwd+bwd 2.000 ms, peak 7 MiB" in printed

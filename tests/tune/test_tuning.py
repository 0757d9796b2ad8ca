"""The tuning file (mok_cute.tuning): keying, reading, staleness, damage, concurrent writers; and the
layer's merge of a tuned entry under its config (mok_cute.layers.tuned)."""
from __future__ import annotations

import json
import multiprocessing as mp
import warnings
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch

from mok_cute import tuning
from mok_cute.config import MoKConfig
from mok_cute.layers import paths as P
from mok_cute.layers import tuned
from mok_cute.policy import BackwardPath, GemmTiles, KernelPolicy

KEY = tuning.Key("NVIDIA H100 80GB HBM3", 132, "sm90", 16384, 2048, 768, 128, 8, 0, 1, "bf16", tuning.version())
POLICY = KernelPolicy(fused_forward=GemmTiles(tile_n=128), minibatch_tokens=2048, backward_path="fused_whole")


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("MOK_CUTE_TUNING_FILE", str(path))
    monkeypatch.setattr(tuning, "SHIPPED", tmp_path / "shipped.json")  # none: the package's entries stay out
    tuning._READ.clear()
    tuning._warned.clear()
    return path


def test_record_then_lookup(user_file):
    tuning.record(user_file, KEY, POLICY, {"speedup": 1.1})
    hit = tuning.lookup(KEY)
    assert hit.policy == POLICY and hit.measured == {"speedup": 1.1} and hit.source == user_file
    assert tuning.lookup(replace(KEY, tokens=8192)) is None  # every key field must match
    assert tuning.lookup(replace(KEY, gpu="NVIDIA H200")) is None
    doc = json.loads(user_file.read_text())
    assert doc["entries"][0]["policy"] == {"backward_path": "fused_whole", "fused_forward.tile_n": 128,
                                           "minibatch_tokens": 2048}


def test_record_replaces_its_key_and_keeps_the_others(user_file):
    other = replace(KEY, precision="mxfp8")
    tuning.record(user_file, KEY, POLICY, {})
    tuning.record(user_file, other, KernelPolicy(), {})
    tuning.record(user_file, KEY, KernelPolicy(comm_sms_bwd=20), {})
    entries = json.loads(user_file.read_text())["entries"]
    assert len(entries) == 2
    assert tuning.lookup(KEY).policy == KernelPolicy(comm_sms_bwd=20)
    assert tuning.lookup(other).policy == KernelPolicy()


def test_the_user_file_wins_over_the_shipped_one(user_file, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.json"
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    tuning.record(shipped, KEY, KernelPolicy(comm_sms_bwd=36), {})
    assert tuning.lookup(KEY).policy == KernelPolicy(comm_sms_bwd=36)
    tuning.record(user_file, KEY, POLICY, {})
    assert tuning.lookup(KEY).policy == POLICY
    monkeypatch.setenv("MOK_CUTE_TUNING_FILE", "off")
    assert tuning.files() == [shipped] and tuning.lookup(KEY).policy == KernelPolicy(comm_sms_bwd=36)


def test_a_stale_entry_is_ignored_with_a_warning(user_file):
    tuning.record(user_file, replace(KEY, version="0.0.1"), POLICY, {})
    tuning.record(user_file, replace(KEY, tokens=1), KernelPolicy(), {})
    with pytest.warns(UserWarning, match="1 entry tuned for another mok_cute version"):
        assert tuning.lookup(replace(KEY, version="0.0.1")) is None
    assert tuning.lookup(replace(KEY, tokens=1)) is not None  # the current entry still counts


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "entries": []}', '[1, 2]', "\xff\xfe"])
def test_an_unreadable_file_is_ignored_with_a_warning(user_file, text):
    user_file.write_text(text, errors="surrogateescape") if text != "\xff\xfe" else user_file.write_bytes(b"\xff\xfe")
    with pytest.warns(UserWarning, match="ignored"):
        assert tuning.lookup(KEY) is None
    with pytest.warns(UserWarning, match="replaced by a new file"):
        tuning.record(user_file, KEY, POLICY, {})  # a damaged file is rewritten, not a crash
    assert tuning.lookup(KEY).policy == POLICY


def test_an_invalid_entry_is_ignored_with_a_warning(user_file):
    good = {"key": asdict(KEY), "policy": {"comm_sms_bwd": 20}, "measured": {}}
    bad = [{"key": {**asdict(KEY), "tokens": 1}, "policy": {"fused_forward.tile_n": 96}},
           {"key": {**asdict(KEY), "tokens": "many"}, "policy": {}},
           {"key": asdict(KEY) | {"tokens": 2}, "policy": {"no_such_field": 1}}, "not an entry"]
    user_file.write_text(json.dumps({"format": 1, "entries": [*bad, good]}))
    with pytest.warns(UserWarning, match="4 invalid entries ignored"):
        assert tuning.lookup(KEY).policy == KernelPolicy(comm_sms_bwd=20)


def test_a_rewritten_file_is_read_again(user_file):
    tuning.record(user_file, KEY, POLICY, {})
    assert tuning.lookup(KEY).policy == POLICY
    tuning.record(user_file, KEY, KernelPolicy(), {"note": "a longer measured field changes the size"})
    assert tuning.lookup(KEY).policy == KernelPolicy()


def _writer(path: str, n: int) -> None:
    for i in range(5):
        tuning.record(tuning.Path(path), replace(KEY, tokens=1000 * n + i), KernelPolicy(comm_sms_bwd=2 * (i + 1)), {})


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = tmp_path / "shared.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), n)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = json.loads(path.read_text())["entries"]
    assert sorted(e["key"]["tokens"] for e in entries) == sorted(1000 * n + i for n in range(4) for i in range(5))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


# ---------------------------------------------------------------- the layer's merge
CALL = P.Call("bf16", 1)


def _merge(config, policy, call=CALL):
    return tuned._merge(config, policy, "sm90", call)


def test_tuned_fields_fill_what_the_config_leaves_none():
    got = _merge(MoKConfig(), POLICY).kernel_policy
    assert got == POLICY


def test_explicit_fields_win():
    cfg = MoKConfig(minibatch_tokens=512, policy=KernelPolicy(backward_path="fused"))
    got = _merge(cfg, POLICY).kernel_policy
    assert got.minibatch_tokens == 512 and got.backward_path is BackwardPath.FUSED
    assert got.fused_forward == GemmTiles(tile_n=128)
    # MoKConfig(tile_n=...) is policy.tiles: a GEMM's tuned tile_n would override it, so it is not taken
    got = _merge(MoKConfig(tile_n=256), POLICY).kernel_policy
    assert got.fused_forward == GemmTiles() and got.tiles == GemmTiles(tile_n=256)
    assert got.minibatch_tokens == 2048


def test_a_tuned_path_the_call_cannot_run_is_left_out():
    gated = replace(CALL, shared=True, shared_gate=True)  # FUSED_WHOLE does not run with shared_gate
    got = _merge(MoKConfig(), POLICY, gated).kernel_policy
    assert got.backward_path is None and got.minibatch_tokens == 2048
    fp8 = _merge(MoKConfig(precision="fp8_block"), POLICY, P.Call("fp8_block", 1)).kernel_policy  # no fused paths
    assert fp8.backward_path is None and fp8.forward_path is None


def test_a_tuned_tile_the_kernels_do_not_take_leaves_the_config_alone():
    bad = KernelPolicy(gemm1=GemmTiles(stages=6), comm_sms_bwd=20)  # stages 6 runs at tile_n 128 only
    assert _merge(MoKConfig(), bad) == MoKConfig()


def test_apply_reads_the_file_for_a_cuda_call(user_file, monkeypatch):
    monkeypatch.setattr(tuning, "device_identity", lambda device: (KEY.gpu, KEY.sms))
    x = SimpleNamespace(is_cuda=True, shape=(KEY.tokens, KEY.hidden), device="cuda:0")
    inp = SimpleNamespace(x=x, w_gate=torch.empty(KEY.experts, KEY.inter, KEY.hidden, device="meta"),
                          topk_idx=torch.empty(KEY.tokens, KEY.topk, device="meta"), shared=None, shared_gate=None,
                          main_grads=None, biases=None)
    assert tuned.apply(MoKConfig(), "sm90", inp, 1) == MoKConfig()  # no entry yet
    tuning.record(user_file, KEY, POLICY, {})
    assert tuned.apply(MoKConfig(), "sm90", inp, 1).kernel_policy == POLICY
    assert tuned.apply(MoKConfig(tuned=False), "sm90", inp, 1) == MoKConfig(tuned=False)
    assert tuned.apply(MoKConfig(precision="mxfp8"), "sm90", inp, 1) == MoKConfig(precision="mxfp8")
    x.is_cuda = False
    assert tuned.apply(MoKConfig(), "sm90", inp, 1) == MoKConfig()


def test_tuned_must_be_a_bool():
    with pytest.raises(TypeError, match="tuned must be a bool"):
        MoKConfig(tuned=1)


def test_the_shipped_file_reads_cleanly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = tuning._parse(tuning.SHIPPED)
    assert all(e.policy is not None for e in entries.values())
    assert json.loads(tuning.SHIPPED.read_text())["format"] == tuning.FORMAT

"""The autotuner (mok_cute.tune) on the CPU: its candidate space, its search over the reference
backend (timings there are only noise: the machinery is what is tested), the bitwise guard, the
tuning file it writes and its command line. The device runs: docs/performance.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mok_cute
from mok_cute import tuning
from mok_cute.layers import paths as P
from mok_cute.policy import BackwardPath, KernelPolicy
from mok_cute.tune import search, space

SMALL = dict(hidden=64, inter=64, experts=4, topk=2, tokens=64, device="cpu", backend="reference", arch="sm90",
             rounds=1, iters=1, progress=False)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp8_block"])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_every_option_runs_on_the_arch(arch, precision):
    if precision not in P.precisions(arch):
        pytest.skip(f"{arch} does not run {precision}")
    call = P.Call(precision, 1, shared=True)
    seen = 0
    for g in space.groups(backward=True):
        for fields in space.options(g, KernelPolicy(), precision, arch, call):
            assert space.valid(space.with_fields(KernelPolicy(), fields), precision, arch, call), fields
            seen += 1
    assert seen > 0 or precision == "fp8_block"


def test_the_space_follows_the_current_paths():
    call = P.Call("bf16", 1)
    fused = KernelPolicy()
    unfused = KernelPolicy(forward_path="unfused", backward_path="unfused")
    names = lambda pol, arch="sm90": {k for g in space.groups(True) for o in space.options(g, pol, "bf16", arch, call)
                                      for k in o}
    assert {"fused_forward.tile_n", "minibatch_tokens", "fused_backward.tile_n"} <= names(fused)
    assert not {"gemm1.tile_n", "wgrad.tile_n"} & names(fused)
    assert {"gemm1.tile_n", "wgrad.tile_n"} <= names(unfused)
    assert not {"fused_forward.tile_n", "minibatch_tokens", "fused_backward.tile_n"} & names(unfused)
    assert not {"forward_path", "backward_path"} & names(KernelPolicy(), "sm100")  # on sm100 the paths stay put
    assert {k for g in space.groups(False) for k in (g.name,)}.isdisjoint({"backward_path", "comm_sms_bwd"})


def test_space_helpers():
    p = space.with_fields(KernelPolicy(fused_forward={"tile_n": 128, "stages": 4}), {"fused_forward.tile_n": 256})
    assert p.fused_forward.stages is None  # a new tile_n drops the old ring depth
    assert space._spread("comm_sms_fwd", 16) == [{"comm_sms_fwd": 8}, {"comm_sms_fwd": 24}]
    assert space._spread("comm_sms_fwd", 2) == [{"comm_sms_fwd": 4}]
    assert space.describe({"backward_path": BackwardPath.UNFUSED}) == "backward_path=unfused"


def test_tune_writes_an_entry_the_lookup_finds(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    monkeypatch.setenv("MOK_CUTE_TUNING_FILE", str(path))
    result = mok_cute.tune(**SMALL, shared=64, report=True)
    assert isinstance(result.policy, KernelPolicy)
    assert result.trials and all(t.bitwise for t in result.trials)  # the reference ignores every policy
    assert result.speedup >= 1.0  # never slower than the default as measured
    key = tuning.Key("cpu", 0, "sm90", 64, 64, 64, 4, 2, 64, 1, "bf16", tuning.version())
    assert result.key == key
    hit = tuning.lookup(key)
    assert hit is not None and hit.policy == result.policy and hit.measured["objective"] == "fwdbwd"
    assert "winner:" in result.table()
    assert isinstance(mok_cute.tune(**SMALL, file=None, backward=False), KernelPolicy)
    assert len(json.loads(path.read_text())["entries"]) == 1  # file=None wrote nothing


def test_a_candidate_that_changes_the_results_is_never_chosen(monkeypatch):
    real = search.Bench.outputs

    def outputs(self, policy):
        out = real(self, policy)
        if policy.comm_sms_bwd is not None:  # pretend these kernels compute something else
            out[0] = out[0] + 1
        return out

    def time_(self, policies, what, rounds, iters):  # the broken candidates look fastest
        return [0.5 if p.comm_sms_bwd is not None else 1.0 + 0.1 * (p != KernelPolicy()) for p in policies]

    monkeypatch.setattr(search.Bench, "outputs", outputs)
    monkeypatch.setattr(search.Bench, "time", time_)
    result = mok_cute.tune(**SMALL, file=None, report=True)
    broken = [t for t in result.trials if t.group == "comm_sms_bwd"]
    assert broken and all(t.bitwise is False and not t.adopted for t in broken)
    assert result.policy.comm_sms_bwd is None
    assert result.policy == KernelPolicy()  # every other candidate was slower than the default


def test_a_faster_candidate_is_adopted(monkeypatch):
    def time_(self, policies, what, rounds, iters):
        return [0.8 if p.minibatch_tokens == 2048 else 1.0 for p in policies]

    monkeypatch.setattr(search.Bench, "time", time_)
    monkeypatch.setattr(P, "_choose", _cuda_defaults(P._choose))
    result = mok_cute.tune(**SMALL, file=None, report=True)
    assert result.policy.minibatch_tokens == 2048 and result.speedup == pytest.approx(1.25)


def _cuda_defaults(choose):
    """The path decision as on a GPU (fused defaults) although the tuner's tensors are on the CPU."""
    def wrapped(arch, pass_, path, call, forward):
        from dataclasses import replace

        return choose(arch, pass_, path, replace(call, cuda=True), forward)

    return wrapped


@pytest.mark.parametrize("bad, match", [
    (dict(experts=6, ep=4), "multiple of ep"), (dict(topk=9), "topk"), (dict(rounds=0), "rounds"),
    (dict(margin=0.7), "margin"), (dict(ep=2), "process group initialized with 2 ranks"),
    (dict(tokens=0), "tokens must be a positive int"), (dict(shared=-1), "shared must be"),
])
def test_bad_arguments_raise_before_running(bad, match):
    with pytest.raises(ValueError, match=match):
        mok_cute.tune(**{**SMALL, "experts": 8, **bad}, file=None)


def test_the_command_line_on_a_cpu(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "mok_cute.tune", *a], capture_output=True, text=True,
                                    timeout=120)
    r = run("--help")
    assert r.returncode == 0 and "--tokens" in r.stdout and "--shape" in r.stdout
    r = run("--hidden", "64")
    assert r.returncode == 2 and "--shape NAME" in r.stderr
    r = run("--shape", "qwen3-30b-a3b", "--tokens", "8")
    assert r.returncode == 2 and "not both" in r.stderr
    r = run("--shape", "nope")
    assert r.returncode == 2 and "unknown shape" in r.stderr
    r = run("--shape", "qwen3-30b-a3b", "--no-write", "--no-progress")  # no GPU here: a clear refusal
    assert r.returncode == 2 and "no mok_cute GPU kernels run there" in r.stderr

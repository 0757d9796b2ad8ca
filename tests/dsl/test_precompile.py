"""``python -m mok_cute.precompile`` (mok_cute.precompile) on the CPU for sm_90a into a temporary cache directory:
the kernels a layer call's default paths need are found (the path decision's, every token count alike); a run fills
the cache with one entry per kernel and a second run compiles nothing; --help; bad arguments are refused with a
message naming them before anything is compiled. The compile test takes about 30 s on two cores (two small fused
kernels, route_grad and the routing plan, compiled once, then loaded)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mok_cute import precompile as pc
from mok_cute.dsl import disk_cache as dc
from mok_cute.dsl import env

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "128", "--inter", "128", "--experts", "4", "--topk", "2", "--tokens", "64"]


def run(*argv: str, **env_vars: str) -> subprocess.CompletedProcess:
    check = "import atexit, sys; atexit.register(lambda: print('DSL imported' if 'cutlass' in sys.modules else ''))"
    code = ("import sys, runpy; sys.argv = ['mok_cute.precompile', *sys.argv[1:]]; "
            "runpy.run_module('mok_cute.precompile', run_name='__main__', alter_sys=True)")
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env_vars)
    return subprocess.run([sys.executable, "-c", f"{check}\n{code}", *argv], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=600)


def test_help_runs_without_the_dsl():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert "usage: python -m mok_cute.precompile" in out.stdout
    assert all(opt in out.stdout for opt in ("--shape", "--arch", "--jobs", "--no-backward", "--list"))
    assert "DSL imported" not in out.stdout


@pytest.mark.parametrize("argv, match", [
    ([], "give --hidden, --inter, --experts, --topk and --tokens, or --shape"),
    (["--hidden", "128"], "or --shape NAME"),
    (["--shape", "qwen3-30b-a3b", "--hidden", "128"], "not both"),
    (["--shape", "nope"], "unknown shape"),
    (SMALL + ["--jobs", "0"], "--jobs must be at least 1"),
    (SMALL + ["--ep", "2"], "EP > 1 is not precompiled"),
    (SMALL + ["--arch", "sm_80"], "invalid choice: 'sm_80'"),
    (SMALL + ["--config", "precision=mxfp8"], "'precision' is set by --precision"),
    (SMALL + ["--config", "backend=sm90"], "'backend' is set by --arch"),
    (SMALL + ["--config", "nosuch=1"], "MoKConfig has no field 'nosuch'"),
    (SMALL + ["--config", "forward_path"], "FIELD=VALUE"),
    (SMALL + ["--config", "forward_path=sideways"], "forward_path"),
    (["--hidden", "128", "--inter", "128", "--experts", "4", "--topk", "5", "--tokens", "64"], "topk = 5"),
    (["--hidden", "128", "--inter", "128", "--experts", "4", "--topk", "2", "--tokens", "0"], "tokens must be"),
    (SMALL + ["--shared-gate"], "needs a shared expert"),
    (SMALL + ["--gpu", "NVIDIA H200"], "both gpu"),
    (SMALL + ["--swiglu-alpha", "-1"], "alpha"),
])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        pc.main(argv + ([] if "--arch" in argv else ["--arch", "sm_90a"]))
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default arch is the present GPU's")
def test_no_arch_and_no_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        pc.main(SMALL)
    assert "no CUDA GPU here: give the target arch" in capsys.readouterr().err


def test_api_refusals(monkeypatch, tmp_path):
    p = pc.Problem(64, 128, 128, 4, 2)
    with pytest.raises(TypeError, match="non-empty list"):
        pc.precompile([], arch="sm_90a")
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        pc.precompile(p, arch="sm_90a", jobs=0)
    with pytest.raises(ValueError, match="arch must be one of"):
        pc.precompile(p, arch="sm_89")
    monkeypatch.setenv(env.CACHE_DIR, "off")
    with pytest.raises(ValueError, match="is off"):
        pc.precompile(p, arch="sm_90a")
    with pytest.raises(ValueError, match="precision must be one of"):
        pc.Problem(64, 128, 128, 4, 2, precision="fp4")
    with pytest.raises(ValueError, match="config: "):
        pc.Problem(64, 128, 128, 4, 2, config={"nosuch": 1})
    with pytest.raises(ValueError, match="index_dtypes"):
        pc.Problem(64, 128, 128, 4, 2, index_dtypes=("int16",))
    assert not any(tmp_path.iterdir())


def test_the_kernels_found_are_the_decided_paths(tmp_path):
    """One worker pass per problem, nothing compiled: the default sm90 paths (FUSED both ways: the fused forward,
    route_grad, the dW_down weight gradient and the fused backward core, the routing plan per topk_idx dtype) at two
    token counts reach the same kernels; UNFUSED both ways reaches the grouped GEMMs (the weight gradients' kernel
    too) instead; a shape the backend refuses is named."""
    unfused = {"forward_path": "unfused", "backward_path": "unfused"}
    problems = [pc.Problem(64, 128, 128, 4, 2), pc.Problem(1000, 128, 128, 4, 2),
                pc.Problem(64, 128, 128, 4, 2, config=unfused, index_dtypes=("int32",))]
    s = pc.precompile(problems, arch="sm_90a", cache_dir=tmp_path, dry_run=True, progress=False)
    by = {}
    for k in s.kernels:
        assert k.status == "listed" and "'sm_90a'" in k.key
        by.setdefault(k.label, []).append(k)
    defaults = {"schedule.local_plan", "sm90_fused_moe_fwd", "route_grad", "sm90_grouped_wgrad",
                "sm90_fused_moe_bwd_core"}
    assert defaults <= set(by) and "sm90_grouped_gemm" in by and "sm90_grouped_wgrad" in by
    assert {k.key.split(", ")[-1] for k in by["schedule.local_plan"]} == {"'i32')", "'i64')"}
    for k in s.kernels:
        if k.label.startswith("sm90_fused"):
            assert k.problems == [0, 1]  # T changes no kernel; the unfused call runs none of them
        if k.label == "sm90_grouped_gemm":
            assert k.problems == [2]
        if k.label == "sm90_grouped_wgrad":  # the FUSED backward's dW_down: the unfused backward's kernel
            assert k.problems == [0, 1, 2]
    assert not any(tmp_path.iterdir())  # nothing written
    assert "4 kernels" not in s.table() and f"{len(s.kernels)} kernels for sm_90a (listed" in s.table()
    with pytest.raises(ValueError, match="H = 96 must be a multiple of 64"):
        pc.precompile(pc.Problem(64, 96, 128, 4, 2), arch="sm_90a", cache_dir=tmp_path, dry_run=True, progress=False)


def test_precompile_fills_the_cache_then_compiles_nothing(tmp_path):
    """``python -m mok_cute.precompile`` twice into an empty cache directory, one process: the first run compiles
    each kernel into one entry, the second finds every one (loaded from disk: 0 compiled)."""
    argv = SMALL + ["--arch", "sm_90a", "--index-dtype", "int32", "--jobs", "1", "--json", "--no-progress"]
    first = run(*argv, **{env.CACHE_DIR: str(tmp_path)})
    assert first.returncode == 0, first.stderr
    got = json.loads(first.stdout[:first.stdout.rindex("}") + 1])
    n = len(got["kernels"])
    assert n == 5 and (got["compiled"], got["cached"], got["failed"], got["jobs"]) == (n, 0, 0, 1)
    assert {k["label"] for k in got["kernels"]} == {"schedule.local_plan", "sm90_fused_moe_fwd", "route_grad",
                                                    "sm90_grouped_wgrad", "sm90_fused_moe_bwd_core"}
    assert all(k["compiles"] == 1 for k in got["kernels"]) and got["directory"] == str(tmp_path)
    info = dc.info(tmp_path)
    assert info["entries"] == info["current"] == n and info["temporary"] == 0
    second = run(*argv, **{env.CACHE_DIR: str(tmp_path)})
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout[:second.stdout.rindex("}") + 1])
    assert (again["compiled"], again["cached"], again["failed"]) == (0, n, 0)
    assert all(k["hits"] == 1 and k["compiles"] == 0 for k in again["kernels"])
    assert dc.info(tmp_path)["entries"] == n


def test_biased_calls_reach_the_biased_kernels(tmp_path):
    """--biases (gpt-oss): the fused forward's biased variant and the bias gradients' row sums, beside the unbiased
    call's kernels; at MXFP8 the backend's refusal names the biases."""
    plain, biased = pc.Problem(64, 128, 128, 4, 2), pc.Problem(64, 128, 128, 4, 2, biases=True)
    s = pc.precompile([plain, biased], arch="sm_90a", cache_dir=tmp_path, dry_run=True, progress=False)
    fwd = {k.key.endswith("'biased')"): k.problems for k in s.kernels if k.label == "sm90_fused_moe_fwd"}
    assert fwd == {False: [0], True: [1]}
    assert [k.problems for k in s.kernels if k.label == "row_sums"] == [[1]]
    assert "biases" in biased.describe()
    with pytest.raises(NotImplementedError, match="with expert biases"):
        pc.precompile(pc.Problem(64, 128, 128, 4, 2, biases=True, precision="mxfp8"), arch="sm_90a",
                      cache_dir=tmp_path, dry_run=True, progress=False)

"""CPU tests of the per-element-scaled SM90 FP8 GEMM (mok_cute.kernels.sm90.fp8_scaled, the
fp8_block wgrad): it compiles for sm_90a with e4m3 wgmma, setmaxnreg, the expected promotion arithmetic and
no spills; argument validation raises before any compile or launch. Numerics run on the GPU
(tools/checks/gemm_fp8_scaled.py)."""
import re

import pytest
import torch

from mok_cute.kernels.sm90 import fp8_scaled as S

F8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def wgrad_report():
    return S.compile_fp8_block_wgrad(S.DEFAULT_WGRAD_CONFIG, inspect=True)[1]


def _no_spills(rep):
    """ptxas's resource lines (read from the log itself: long kernel names wrap the report)."""
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", rep.log)
    assert frames, rep.log
    assert all(v == ("0", "0", "0") for v in frames), frames
    assert "C7514" not in rep.log and "serialized" not in rep.log, rep.log  # wgmma serialization
    assert "C7517" not in rep.log, rep.log  # ptxas-injected wait_group (accumulator read too early)


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


def test_wgrad_compiles(wgrad_report):
    rep = wgrad_report
    assert rep.arch == "sm_90a"
    _no_spills(rep)
    ptx = rep.ptx
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx)) == {
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
    assert _count(r"wgmma\.mma_async", ptx) == 4  # one promotion unit: 4 k-blocks of 32
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)) == {"0"}
    # per k-tile and element: tmp * sa[row] (mul), then fma(., sb[col], acc)
    assert _count(r"\bfma\.rn\.f32\b", ptx) == 64
    assert _count(r"\bmul\.(rn\.)?f32\b", ptx) == 64
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert "cp.async.bulk.tensor" in ptx
    # factors staged in shared memory once per k-tile, one consumer barrier for them
    assert re.search(r"bar\.sync\s+1, 256;", ptx)


def test_wgrad_tma_store(wgrad_report):
    """The TMA-store epilogue (the one path, as the BF16 wgrad's): one bulk tensor store per tile from shared
    memory, waited for before the staging buffer is rewritten; no row-masked global stores."""
    ptx = wgrad_report.ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx)
    assert "cp.async.bulk.wait_group.read" in ptx
    assert not re.search(r"\bst\.global\.v4\.b32\b", ptx)


def test_compile_rejects_other_arch():
    with pytest.raises(ValueError, match="sm_90a"):
        S.compile_fp8_block_wgrad(arch="sm_100a")


@pytest.fixture
def no_launch(forbid):
    forbid(S, "compile_cached", "device_arch", "_sm90")


def _wgrad_args(na=256, nb=128, e=2, s=4):
    return dict(a_t=torch.zeros(na, 128 * s, dtype=F8), a_scales=torch.ones(s, na),
                b_t=torch.zeros(nb, 128 * s, dtype=F8), b_scales=torch.ones(s, nb),
                offsets=torch.tensor([0, 100, 200][:e + 1], dtype=torch.int32))


@pytest.mark.parametrize("change, match", [
    (dict(a_t=torch.zeros(256, 512, dtype=torch.bfloat16)), "a_t must have dtype"),
    (dict(a_t=torch.zeros(256, 500, dtype=F8)), "a_t must have unit column stride"),
    (dict(a_t=torch.zeros(256, 384, dtype=F8)[:, :320]), "a_t must be \\[Na, 128 S\\]"),
    (dict(b_t=torch.zeros(128, 384, dtype=F8)), "b_t must be \\[Nb, 128 S"),
    (dict(b_t=torch.zeros(96, 512, dtype=F8), b_scales=torch.ones(4, 96)), "Nb=96"),
    (dict(a_scales=torch.ones(4, 255)), "a_scales must be fp32 \\(4, 256\\)"),
    (dict(a_scales=torch.ones(4, 256, dtype=torch.float64)), "a_scales must have dtype"),
    (dict(b_scales=torch.ones(128, 4).t()), "b_scales must have unit column stride"),
    (dict(offsets=torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)), "S >= E=5"),
    (dict(offsets=torch.tensor([0, 1.0])), "offsets must have dtype"),
    ({}, "CUDA"),
])
def test_wgrad_validation(no_launch, change, match):
    args = dict(_wgrad_args(), **change)
    with pytest.raises((TypeError, ValueError), match=match):
        S.grouped_wgrad_fp8_block(args["a_t"], args["a_scales"], args["b_t"], args["b_scales"], args["offsets"])


def test_wgrad_accepts_feature_slices(no_launch):
    """dWg / dWu operands: row slices of data_t and column slices of the scales pass
    validation (read in place; the CPU tensors then stop at the device check)."""
    a_t, sa = torch.zeros(512, 512, dtype=F8), torch.ones(4, 512)
    for rows in (slice(0, 256), slice(256, 512)):
        args = dict(_wgrad_args(), a_t=a_t[rows], a_scales=sa[:, rows])
        with pytest.raises(ValueError, match="CUDA"):
            S.grouped_wgrad_fp8_block(**args)


def test_wgrad_out_validation(no_launch):
    args = _wgrad_args()
    with pytest.raises(ValueError, match="out must be contiguous with shape \\(2, 256, 128\\)"):
        S.grouped_wgrad_fp8_block(**args, out=torch.zeros(2, 256, 64, dtype=torch.bfloat16))


def test_defaults():
    assert S.DEFAULT_WGRAD_CONFIG.tile_n == 128

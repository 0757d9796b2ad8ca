"""CPU tests of the mixed-input MXFP8 grouped GEMM (mok_cute.kernels.sm90.mxfp8_act_gemm: MXFP8
activations x bf16 weights): it compiles for sm_90a with BF16 wgmma fed by a TMA ring of e4m3 A
and bf16 W tiles, A dequantized in shared memory by the MMA warps (cvt e4m3x2 -> f16x2, one
non-FTZ fp32 multiply, bf16 RNE), fenced for the async proxy, with 0 spills; the wgmma stream is
that of the BF16 grouped GEMM (what the bitwise match rests on); argument validation raises
before any compile, device query or launch. Numerics run on the GPU
(tools/checks/gemm_mxfp8_mixed.py)."""
import dataclasses
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cutlass

from mok_cute.kernels.sm90 import grouped_gemm as G
from mok_cute.kernels.sm90 import mxfp8_act_gemm as X

F8 = torch.float8_e4m3fn


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


def _wgmma_stream(ptx):
    """The wgmma instructions in order (operands dropped)."""
    return re.findall(r"wgmma\.(?:mma_async\.sync\.aligned\.\S+|fence\S*|commit_group\S*|wait_group\S*\s+\d+)", ptx)


@pytest.fixture(scope="module")
def act_report():
    return X.compile_mxfp8_mixed_gemm(inspect=True)[1], G.compile_grouped_gemm("plain", inspect=True)[1]


def test_bf16_weights_variant(act_report):
    """bf16 weights (Mxfp8ActGemmSm90): one TMA ring of A e4m3 + W bf16 (one expect-tx
    arrive), the MMA warps dequantize their warpgroup's 64 A rows (16 per warp: 4 passes, in
    the first k-tile and in the loop), fence them for the async proxy and meet at a per-warpgroup
    named barrier (128 threads) before their wgmma; the wgmma stream is the BF16 kernel's;
    the BF16 kernel's 40 / 232 register split; 0 spills."""
    rep, bf16 = act_report
    ptx = rep.ptx
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", rep.log)
    assert frames and all(v == ("0", "0", "0") for v in frames), rep.log
    assert _wgmma_stream(ptx) == _wgmma_stream(bf16.ptx)
    for dims in ("2d", "3d"):  # A e4m3 [M, K] and W bf16 (N, K, E), one ring
        assert _count(rf"cp\.async\.bulk\.tensor\.{dims}\.shared::cta\.global\.tile\.mbarrier::complete_tx", ptx) == 1
    assert _count(r"mbarrier\.arrive\.expect_tx", ptx) == 1
    n = 2 * 4  # 2 call sites x 4 passes
    assert _count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == 4 * n
    assert _count(r"\bmul\.rn\.f32\b", ptx) == 8 * n
    assert ".ftz" not in ptx and _count(r"fence\.proxy\.async\.shared::cta", ptx) == 2
    assert _count(r"bar\.sync\s+%r\d+, 128;", ptx) == 2  # the warpgroup's named barrier, per call site
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{X.ACT_PRODUCER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{X.ACT_MMA_REGS};", ptx)
    op = X.Mxfp8ActGemmSm90()
    assert op.smem_bytes + 1024 <= 232448 and op.tx_bytes == 128 * 64 + 256 * 64 * 2


def test_compile_rejects_other_arch():
    with pytest.raises(ValueError, match="sm_90a"):
        X.compile_mxfp8_mixed_gemm(arch="sm_100a")


@pytest.mark.parametrize("change", [dict(ab_dtype=cutlass.Float16), dict(tile_n=128)])
def test_config_rejected(change):
    with pytest.raises(ValueError, match="tile 128 x 256 x 64"):
        X.Mxfp8ActGemmSm90(dataclasses.replace(X.DEFAULT_CONFIG, **change))


@pytest.fixture
def no_launch(forbid):
    forbid(X, "compile_cached", "_sm90", "sm_count")


def _args(m=256, k=256, n=256, e=2):
    return dict(a=torch.zeros(m, k, dtype=F8), a_scales=torch.zeros(m, k // 32, dtype=torch.uint8),
                offsets=torch.tensor([0, m // 2, m][:e + 1], dtype=torch.int32),
                w=torch.zeros(e, n, k, dtype=torch.bfloat16))


@pytest.mark.parametrize("change, match", [
    (dict(a=torch.zeros(256, 256, dtype=torch.bfloat16)), "a must have dtype"),
    (dict(a="a"), "a must be a torch.Tensor"),
    (dict(a=torch.zeros(256, 224, dtype=F8)), "K=224 must be a positive multiple of 128"),
    (dict(a=torch.zeros(256, 512, dtype=F8)[:, :256]), "a must be contiguous"),
    (dict(w=torch.zeros(2, 256, 256, dtype=F8)), "w must have dtype"),  # e4m3 weights: not taken
    (dict(w=torch.zeros(2, 128, 256, dtype=torch.bfloat16)), "N a positive multiple of tile_n=256"),
    (dict(w=torch.zeros(3, 256, 256, dtype=torch.bfloat16)), "w must be \\[E=2"),
    (dict(w=torch.zeros(2, 256, 512, dtype=torch.bfloat16)[:, :, :256]), "w must be contiguous"),
    (dict(a_scales=torch.zeros(256, 8, dtype=torch.int8)), "a_scales must have dtype"),
    (dict(a_scales=torch.zeros(256, 4, dtype=torch.uint8)), "a_scales must be uint8 E8M0 \\(256, 8\\)"),
    (dict(offsets=torch.tensor([0], dtype=torch.int32)), "E\\+1"),
    (dict(offsets=torch.tensor([0, 1.0])), "offsets must have dtype"),
    ({}, "CUDA"),
])
def test_validation(no_launch, change, match):
    args = dict(_args(), **change)
    with pytest.raises((TypeError, ValueError), match=match):
        X.grouped_gemm_mxfp8_mixed(args["a"], args["a_scales"], args["offsets"], args["w"])


@pytest.mark.parametrize("out, match", [
    (torch.zeros(256, 128, dtype=torch.bfloat16), "out must be contiguous with shape \\(256, 256\\)"),
    (torch.zeros(256, 256, dtype=torch.float32), "out must have dtype"),
])
def test_out_validation(no_launch, out, match):
    with pytest.raises((TypeError, ValueError), match=match):
        X.grouped_gemm_mxfp8_mixed(**_args(), out=out)


def test_defaults():
    """The bitwise match with grouped_gemm needs the BF16 kernel's tile shape."""
    cfg = X.DEFAULT_CONFIG
    assert (cfg.tile_m, cfg.tile_n, cfg.tile_k) == (128, 256, 64) and cfg == G.DEFAULT_CONFIG


# ---------------------------------------------------------------- the device check's own logic
def _check_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import checks.gemm_mxfp8_mixed as C  # noqa: PLC0415
    return C


def _mirrors(flip_bit: bool = False):
    """CPU stand-ins for the kernels the check calls: dequantize = the reference's, the BF16
    grouped GEMM = fp32 matmul per expert rounded to bf16, the mixed GEMM = both (so equal
    bitwise unless ``flip_bit`` flips one output bit)."""
    from mok_cute import reference as ref  # noqa: PLC0415

    def dequantize_mxfp8(data, scales, dim=-1):
        return ref.mxfp8_dequantize(data, scales, dim).bfloat16()

    def grouped_gemm(a, offsets, w, *, out):
        offs = offsets.tolist()
        for e in range(w.shape[0]):
            out[offs[e]:offs[e + 1]] = (a[offs[e]:offs[e + 1]].float() @ w[e].float().t()).bfloat16()
        return out

    def mixed(a, sa, offsets, w, *, out):
        grouped_gemm(dequantize_mxfp8(a, sa), offsets, w, out=out)
        if flip_bit:
            out.view(torch.int16)[offsets[1] + 3, 300] ^= 1
        return out

    dq = SimpleNamespace(dequantize_mxfp8=dequantize_mxfp8)
    gg = SimpleNamespace(grouped_gemm=grouped_gemm, set_tma_store=lambda on: True)
    return SimpleNamespace(grouped_gemm_mxfp8_mixed=mixed), gg, dq, ref


def test_check_logic_on_cpu(monkeypatch):
    """tools/checks/gemm_mxfp8_mixed.py with CPU mirrors: every correctness row passes; a
    flipped output bit fails the bitwise row and is located (row, expert, column)."""
    C = _check_module()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    cpu = torch.device("cpu")
    rows = C._check_routing(*_mirrors(), cpu, "skewed") + C._check_scale_edges(*_mirrors(), cpu)
    assert all(r.ok for r in rows), [(r.name, r.note) for r in rows]
    bad = C._check_routing(*_mirrors(flip_bit=True), cpu, "uniform")
    assert not bad[0].ok and "mismatches 1 " in bad[0].note and "expert 1, local 3" in bad[0].note, bad[0].note
    assert "col 300 (n-tile 1)" in bad[0].note, bad[0].note

"""CPU tests of the FP8 kernels: quantizers (mok_cute.kernels.quantize_fp8) and the SM90 FP8
blockwise grouped GEMM (mok_cute.kernels.sm90_fp8_gemm) compile, PTX/ptxas checks, argument
validation before any launch. Numerics run on the GPU (tools/checks/quantize.py)."""
import re

import pytest
import torch

from mok_cute.kernels import quantize_fp8 as qf

# per thread: row kernel 4 chunks of C elements, tokens kernel 32 rows x C features
ELEMS = {torch.bfloat16: 8, torch.float32: 4}
CASES = ([("row", "fp8_block", a, dt) for a in ("sm_90a", "sm_100a") for dt in qf.DTYPES]
         + [("tokens", f, a, dt) for f in qf.FORMATS for a in ("sm_90a", "sm_100a") for dt in qf.DTYPES])


def _id(c):
    return f"{c[0]}-{c[1]}-{c[2]}-{str(c[3])[6:]}"


@pytest.fixture(scope="module")
def reports():
    return {c: qf.compiled_quantize_fp8(*c)[1] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_quantizer_compiles_without_spills(reports, case):
    rep = reports[case]
    assert len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values())
    assert rep.max_registers <= (40 if case[0] == "row" else 168), rep.registers


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_quantizer_ptx(reports, case):
    kind, fmt, _, dt = case
    ptx = reports[case].ptx
    c = ELEMS[dt]
    elems = 4 * c if kind == "row" else 32 * c
    scales = 4 if kind == "row" else c  # scale computations per thread
    assert len(re.findall(r"\bmul\.rn\.f32\b", ptx)) == elems
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == elems // 2
    assert ".ftz" not in ptx and "div.approx" not in ptx and "div.full" not in ptx
    # fp8_block: exactly two IEEE divisions per scale (448 / a and a / 448)
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == (2 * scales if fmt == "fp8_block" else 0)
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == (4 if kind == "row" else 32)
    if kind == "tokens":  # each feature's 32 tokens: two aligned 16-byte stores
        assert len(re.findall(r"st\.global\.v4\.b32", ptx)) >= 2 * c
        shuffles = 8 if fmt == "fp8_block" else 0
        assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == shuffles
        # per-column amax words: 31 row maxes per word, then one per shuffle, all per element
        # (bf16: max.u16x2 on the packed pairs; a max.u32 would mix the two halves)
        n_u16x2 = len(re.findall(r"\bmax\.u16x2\b", ptx))
        n_u32 = len(re.findall(r"\bmax\.u32\b", ptx))
        floors = c if fmt == "fp8_block" else 0  # max(amax, 2^-100) per scale
        if dt == torch.bfloat16:
            assert n_u16x2 == 4 * 31 + shuffles and n_u32 == floors
        else:
            assert n_u16x2 == 0 and n_u32 == 4 * 31 + shuffles + floors


def test_bad_keys():
    with pytest.raises(ValueError, match="fmt"):
        qf.compiled_quantize_fp8("row", "mxfp8", "sm_90a")
    with pytest.raises(ValueError, match="kind"):
        qf.compiled_quantize_fp8("col", "fp8_block", "sm_90a")
    with pytest.raises(TypeError, match="dtype"):
        qf.compiled_quantize_fp8("tokens", "mxfp8", "sm_90a", torch.float16)


@pytest.fixture
def no_launch(forbid):
    """Make any step past validation fail loudly (compile, device query)."""
    forbid(qf, "compiled_quantize_fp8", "arch_of_device")


@pytest.mark.parametrize("x, match", [
    (torch.zeros(4, 64, dtype=torch.bfloat16), "multiple of 128"),
    (torch.zeros(4, 128, dtype=torch.float16), "bfloat16 or torch.float32"),
    (torch.zeros(128, 4, dtype=torch.bfloat16).t(), "contiguous"),
    (torch.zeros(4, 128, dtype=torch.bfloat16), "CUDA"),
])
def test_act_validation(no_launch, x, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_fp8_block_act(x)


@pytest.mark.parametrize("x, offs, fmt, match", [
    (torch.zeros(4, 12, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "fp8_block", "multiple of 8"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4]), "fp8_block", "int32"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0], dtype=torch.int32), "mxfp8", "E\\+1"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "nvfp4", "fmt"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "mxfp8", "CUDA"),
])
def test_tokens_validation(no_launch, x, offs, fmt, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_tokens(x, offs, fmt)


# ---------------------------------------------------------------- FP8 GEMM
@pytest.fixture(scope="module")
def gemm_report():
    from mok_cute.kernels import sm90_fp8_gemm as g
    return g.compile_fp8_block_gemm(inspect=True)[1]


def test_fp8_gemm_compiles_e4m3_wgmma(gemm_report):
    rep = gemm_report
    assert rep.arch == "sm_90a" and len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values())
    kinds = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", rep.ptx))
    assert kinds == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
    assert len(re.findall(r"wgmma\.mma_async", rep.ptx)) == 4  # 4 k-blocks of 32 per 128-K tile
    # promotion: one FMA per accumulator element (64 per thread at 128x128), one multiply per row
    assert len(re.findall(r"\bfma\.rn\.f32\b", rep.ptx)) == 64
    assert len(re.findall(r"\bmul\.(rn\.)?f32\b", rep.ptx)) == 2
    assert "cp.async.bulk.tensor" in rep.ptx


@pytest.fixture(scope="module")
def overlap_report():
    from mok_cute.kernels import sm90_fp8_gemm as g
    return g.compile_fp8_block_gemm(g.Fp8MainloopConfig(overlap_promotion=True), inspect=True)[1]


def test_fp8_gemm_default_promotion_unchanged(gemm_report):
    ptx = gemm_report.ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)) == {"0"}
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)


def test_fp8_gemm_overlap_compiles(overlap_report):
    """Opt-in overlapped promotion: the next k-tile's wgmma batch is issued into the second
    temporary before waiting on the previous one (wait_group 1), 3 FP32 fragments without
    spills (24 / 240 register split), no wgmma serialization by ptxas."""
    rep = overlap_report
    assert rep.arch == "sm_90a" and len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values()), rep.log
    assert "C7514" not in rep.log and "serialized" not in rep.log, rep.log  # wgmma serialization
    assert "C7517" not in rep.log, rep.log  # ptxas-injected wait_group (accumulator read too early)
    ptx = rep.ptx
    kinds = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx))
    assert kinds == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
    # 4 k-blocks per batch: k-tile 0, the loop unrolled by two, the even-k_tiles tail
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 16
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 3 and waits.count("0") == 2, waits
    # promotions: 2 in the loop, 2 + 1 in the tails; 2 row-scale multiplies each
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == 5 * 64
    assert len(re.findall(r"\bmul\.(rn\.)?f32\b", ptx)) == 5 * 2
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert "cp.async.bulk.tensor" in ptx


def test_fp8_overlap_compile_key():
    from mok_cute.kernels.sm90_fp8_gemm import DEFAULT_FP8_CONFIG, Fp8MainloopConfig
    assert DEFAULT_FP8_CONFIG.overlap_promotion is False
    assert Fp8MainloopConfig(overlap_promotion=True).key() != DEFAULT_FP8_CONFIG.key()
    assert Fp8MainloopConfig().key() == DEFAULT_FP8_CONFIG.key()


def test_fp8_config_validation():
    from mok_cute.kernels.sm90_fp8_gemm import Fp8MainloopConfig
    Fp8MainloopConfig().validate()
    for bad in (dict(tile_n=256), dict(tile_k=64), dict(tile_m=64)):
        with pytest.raises(ValueError):
            Fp8MainloopConfig(**bad).validate()


def _gemm_args(m=256, k=256, n=256, e=2):
    f8 = torch.float8_e4m3fn
    return dict(a=torch.zeros(m, k, dtype=f8), a_scales=torch.ones(m, k // 128),
                offsets=torch.tensor([0, m // 2, m], dtype=torch.int32), w=torch.zeros(e, n, k, dtype=f8),
                w_scales=torch.ones(e, n // 128, k // 128))


@pytest.mark.parametrize("change, match", [
    (dict(a=torch.zeros(256, 256, dtype=torch.bfloat16)), "a must have dtype"),
    (dict(a=torch.zeros(256, 192, dtype=torch.float8_e4m3fn)), "multiple of 128"),
    (dict(w=torch.zeros(2, 192, 256, dtype=torch.float8_e4m3fn)), "N=192"),
    (dict(a_scales=torch.ones(256, 3)), "a_scales must be"),
    (dict(w_scales=torch.ones(2, 2, 3)), "w_scales must be"),
    (dict(offsets=torch.tensor([0, 256], dtype=torch.int32)), "E\\+1"),
    ({}, "CUDA"),
])
def test_fp8_gemm_validation(change, match):
    from mok_cute.kernels import sm90_fp8_gemm as g
    args = dict(_gemm_args(), **change)
    with pytest.raises((TypeError, ValueError), match=match):
        g.grouped_gemm_fp8_block(args["a"], args["a_scales"], args["offsets"], args["w"], args["w_scales"])

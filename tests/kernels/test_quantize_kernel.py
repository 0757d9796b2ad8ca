"""CPU tests of the MXFP8 quantize kernels: compile for every arch, inspect PTX/ptxas, validate
arguments before any launch, compile cache. Numerics are checked on the GPU by
tools/checks/quantize.py."""
import re

import pytest
import torch

from mok_cute.dsl import compile as kc
from mok_cute.kernels.quant import quantize as kq

# Per thread: row kernel 4 chunks, col kernel 32 chunks; a chunk is 16 input bytes.
CHUNKS = {"row": 4, "row_pitched": 4, "row_pitched_rt": 4, "col": 32}
ELEMS_PER_CHUNK = {torch.bfloat16: 8, torch.float32: 4}
CASES = [(kind, arch, dt) for kind in kq.KINDS for arch in kc.ARCHS for dt in kq.DTYPES
         if kind != "row_pitched_rt" or dt == torch.bfloat16]  # the round trip: bf16 x only


@pytest.fixture(scope="module")
def reports():
    """Compile each (kind, arch, dtype) once for the whole module."""
    return {case: kq.compiled_quantize(*case)[1] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{str(c[2])[6:]}")
def test_compiles_without_spills(reports, case):
    rep = reports[case]
    assert rep.arch == case[1]
    assert len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0
    assert all(v == 0 for v in rep.stack_bytes.values())
    # row: full occupancy needs <= 32 regs/thread; col: >= 3 CTAs of 128 threads per SM.
    assert rep.max_registers <= (168 if case[0] == "col" else 32), rep.registers


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{str(c[2])[6:]}")
def test_ptx_instructions(reports, case):
    kind, _, dt = case
    ptx = reports[case].ptx
    elems = CHUNKS[kind] * ELEMS_PER_CHUNK[dt]
    # every element is scaled by exactly one non-FTZ fp32 multiply (row_pitched_rt: and one more dequantizing it) ...
    assert len(re.findall(r"\bmul\.rn\.f32\b", ptx)) == elems * (2 if kind == "row_pitched_rt" else 1)
    assert not re.search(r"\bmul(\.\w+)*\.ftz", ptx)
    assert not re.search(r"\bmul(\.rz|\.rm|\.rp)?\.f32\b", ptx)
    assert ".ftz" not in ptx
    # ... and converted pairwise by the round-to-nearest-even satfinite e4m3 cvt
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == elems // 2
    # 16-byte loads, one per chunk
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == CHUNKS[kind]
    assert "max.u16x2" in ptx if dt == torch.bfloat16 else "max.u32" in ptx


def test_compile_cache_hits(reports):
    before = kc.cache_stats()
    first = kq.compiled_quantize("row", "sm_90a", torch.bfloat16)
    again = kq.compiled_quantize("row", "sm_90a", torch.bfloat16)
    after = kc.cache_stats()
    assert first is again
    assert after["compiles"] == before["compiles"]
    assert after["hits"] == before["hits"] + 2


def test_compiled_quantize_rejects_bad_keys():
    with pytest.raises(ValueError, match="kind"):
        kq.compiled_quantize("diag", "sm_90a")
    with pytest.raises(TypeError, match="dtype"):
        kq.compiled_quantize("row", "sm_90a", torch.float16)
    with pytest.raises(ValueError, match="arch"):
        kq.compiled_quantize("row", "sm_80", torch.bfloat16)


@pytest.fixture
def no_launch(forbid):
    """Make any step past validation fail loudly (compile, device query)."""
    forbid(kq, "compiled_quantize", "arch_of_device")


def _misaligned():
    return torch.zeros(64 * 64 + 1, dtype=torch.bfloat16)[1:].view(64, 64)


@pytest.mark.parametrize("x, dim, exc, match", [
    ([[1.0] * 32], -1, TypeError, "torch.Tensor"),
    (torch.zeros(64, 64, dtype=torch.float16), -1, TypeError, "bfloat16 or torch.float32"),
    (torch.zeros(64, 64, dtype=torch.int32), 0, TypeError, "bfloat16 or torch.float32"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), 1.0, TypeError, "dim must be an int"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), True, TypeError, "dim must be an int"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), 2, ValueError, "dim must be"),
    (torch.zeros(64, dtype=torch.bfloat16), -1, ValueError, "2-D"),
    (torch.zeros(2, 64, 64, dtype=torch.bfloat16), -1, ValueError, "2-D"),
    (torch.zeros(64, 48, dtype=torch.bfloat16), -1, ValueError, r"x.shape\[1\] = 48 .* multiple of 32"),
    (torch.zeros(48, 64, dtype=torch.bfloat16), 0, ValueError, r"x.shape\[0\] = 48 .* multiple of 32"),
    (torch.zeros(64, 36, dtype=torch.bfloat16), 0, ValueError, r"x.shape\[1\] = 36 .* multiple of 8"),
    (torch.zeros(64, 6, dtype=torch.float32), -2, ValueError, r"x.shape\[1\] = 6 .* multiple of 4"),
    (torch.empty(2**16, 2**15 + 32, dtype=torch.bfloat16, device="meta"), -1, ValueError, "2\\^31"),
    (torch.zeros(64, 128, dtype=torch.bfloat16).t(), -1, ValueError, "contiguous"),
    (torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64], 1, ValueError, "contiguous"),
    (_misaligned(), -1, ValueError, "16-byte aligned"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), -1, ValueError, "CUDA"),
    (torch.zeros(64, 64, dtype=torch.float32), 0, ValueError, "CUDA"),
])
def test_validation_before_launch(no_launch, x, dim, exc, match):
    with pytest.raises(exc, match=match):
        kq.quantize_mxfp8(x, dim)


@pytest.mark.parametrize("out, exc, match", [
    (torch.zeros(64, 80, dtype=torch.int8), TypeError, "uint8"),
    (torch.zeros(64 * 80, dtype=torch.uint8), TypeError, "2-D"),
    (torch.zeros(64, 72, dtype=torch.uint8), ValueError, r"P % 16 == 0 and P >= N \+ N/32 = 66"),
    (torch.zeros(64, 64, dtype=torch.uint8), ValueError, "P >= N"),
    (torch.zeros(32, 80, dtype=torch.uint8), ValueError, r"\[M = 64, P\]"),
    (torch.zeros(64, 160, dtype=torch.uint8)[:, :80], ValueError, "contiguous"),
])
def test_rows_into_validation_before_launch(no_launch, out, exc, match):
    """quantize_mxfp8_rows_into names ``out`` and the row pitch it needs (x as quantize_mxfp8 checks it)."""
    with pytest.raises(exc, match=match):
        kq.quantize_mxfp8_rows_into(torch.zeros(64, 64, dtype=torch.bfloat16), out)
    with pytest.raises(ValueError, match="multiple of 32"):
        kq.quantize_mxfp8_rows_into(torch.zeros(64, 48, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.uint8))


@pytest.mark.parametrize("x, rt, exc, match", [
    (torch.zeros(64, 64), torch.zeros(64, 64, dtype=torch.bfloat16), TypeError, "x bf16"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64), TypeError, "rt"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16), ValueError, r"\[M, N\]"),
    (torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64], ValueError,
     "contiguous"),
])
def test_rows_into_round_trip_validation(no_launch, x, rt, exc, match):
    """The round trip output of quantize_mxfp8_rows_into: bf16 x only, rt a contiguous [M, N] bf16 tensor."""
    with pytest.raises(exc, match=match):
        kq.quantize_mxfp8_rows_into(x, torch.zeros(64, 80, dtype=torch.uint8), rt)


def test_rows_into_round_trip_compiles(reports):
    """row_pitched_rt: the row_pitched kernel plus the dequantize (e4m3 -> f16 -> f32, bf16 rounding) and its stores;
    fp32 x has no round-trip variant."""
    rep = reports[("row_pitched_rt", "sm_90a", torch.bfloat16)]
    plain = reports[("row_pitched", "sm_90a", torch.bfloat16)]
    assert rep.has("cvt.rn.f16x2.e4m3x2") and rep.has("cvt.rn.bf16x2.f32") and not plain.has("cvt.rn.f16x2.e4m3x2")
    assert rep.ptx.count("st.global.v4") > plain.ptx.count("st.global.v4")
    with pytest.raises(TypeError, match="bfloat16"):
        kq.compiled_quantize("row_pitched_rt", "sm_90a", torch.float32)


def test_ptx_manifest_lists_the_compiled_variants():
    """tools/ptx_manifest.py's quantize table holds exactly the variants this module compiles (it once listed
    ``row_pitched_rt`` with fp32 input, which compiled_quantize rejects, and the manifest run stopped there)."""
    from tools.ptx_manifest import _quant

    names = {n for n in _quant() if n.startswith("quantize/")}
    assert names == {f"quantize/{kind}-{str(dt)[6:]}@{arch}" for kind, arch, dt in CASES}

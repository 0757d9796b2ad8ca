"""Expert biases in the SM90 kernels (``mok_cute.kernels.sm90.bias``), compiled for sm_90a on the CPU: the
grouped GEMM's swiglu / plain epilogues and the fused forward's R1 / R2 tiles each load one bias value per
consumer thread before the mainloop (a 16-bit global load), stage the tile's values in shared memory (fp32) and
add them to the accumulators; no spills; the unbiased variants load none. Their numerics run on the GPU
(tools/checks/layer_sm90.py's gpt-oss rows)."""
from __future__ import annotations

import functools
import re

import pytest

from mok_cute.kernels.sm90.grouped_gemm import GroupedGemmSm90, compile_grouped_gemm
from mok_cute.kernels.sm90.mainloop import MainloopConfig
from mok_cute.kernels.swiglu_math import Gated

_LD16 = re.compile(r"ld\.global[^\n]*\.(?:b16|u16)")  # a bf16 bias element


@functools.cache
def _gemm(epilogue: str, biased: bool, **kw):
    return compile_grouped_gemm(epilogue, biased=biased, inspect=True, **kw)[1]


@functools.cache
def _fused(biased: bool, **kw):
    from mok_cute.kernels.sm90 import fused_moe

    return fused_moe.compile_fused_forward(True, True, biased=biased, inspect=True, **kw)[1]


@pytest.mark.parametrize("epilogue, kw", [("swiglu", {"helpers": True, "gated": Gated(1.702, 1.0)}), ("plain", {})])
def test_grouped_gemm_biased_variant(epilogue, kw):
    rep, plain = _gemm(epilogue, True, **kw), _gemm(epilogue, False, **kw)
    assert rep.total_spill_bytes == 0 and rep.registers
    assert len(_LD16.findall(rep.ptx)) in (1, 2) and not _LD16.findall(plain.ptx)  # one load (split: gate or up)
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")


@pytest.mark.parametrize("kw", [{"n_tail": True}], ids=["tail"])
def test_fused_forward_biased_variant(kw):
    rep, plain = _fused(True, **kw), _fused(False, **kw)
    assert rep.total_spill_bytes == 0
    assert len(_LD16.findall(rep.ptx)) >= 3 and not _LD16.findall(plain.ptx)  # b_gate, b_up, b_down
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")


def test_biased_refuses_the_dswiglu_epilogue():
    with pytest.raises(ValueError, match="biased: the swiglu and plain"):
        GroupedGemmSm90(MainloopConfig(), "dswiglu", biased=True)

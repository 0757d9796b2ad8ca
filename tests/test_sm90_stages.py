"""SM90 GEMM1+SwiGLU with the split TMA-store epilogue (``MainloopConfig(epi_split=True)``): gate, up and
h staged in turn through one (tile_m, tile_n/2) buffer, so the ring gets 4 stages instead of 3; compiles
for sm_90a with no spills, fits in shared memory, and leaves the existing variants as they were. CPU only."""
import functools
import re

import pytest

from mok_cute.kernels.sm90.grouped_gemm import GroupedGemmSm90, compile_grouped_gemm
from mok_cute.kernels.sm90.mainloop import NUM_THREADS, SMEM_BYTES, MainloopConfig

BASE = MainloopConfig(tma_store=True)
SPLIT = MainloopConfig(tma_store=True, epi_split=True)
SPLIT_PAIR = MainloopConfig(tma_store=True, epi_split=True, cluster_mn=(2, 1))
VARIANTS = {
    "split": lambda: compile_grouped_gemm("swiglu", cfg=SPLIT, inspect=True),
    "split-clamp": lambda: compile_grouped_gemm("swiglu", clamp=True, cfg=SPLIT, inspect=True),
    "split-c21": lambda: compile_grouped_gemm("swiglu", cfg=SPLIT_PAIR, inspect=True),
}
_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\S* \[[^\]]*\], \[%r\d+\+(\d+)\]")


@functools.cache
def _compiled(name):
    return VARIANTS[name]()[1]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_without_spills(name):
    rep = _compiled(name)
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers * NUM_THREADS <= 65536
    assert rep.has("wgmma.mma_async") and rep.has("cp.async.bulk.wait_group.read")


def test_four_stages_fit():
    base, split = GroupedGemmSm90(BASE, "swiglu").mainloop, GroupedGemmSm90(SPLIT, "swiglu").mainloop
    assert base.stages == 3 and split.stages == 4
    assert split.smem_bytes == 4 * SPLIT.stage_bytes() + 128 * 128 * 2
    assert split.smem_bytes + 1024 <= SMEM_BYTES  # + the mbarriers' 1024-byte aligned slot
    assert GroupedGemmSm90(SPLIT_PAIR, "swiglu").mainloop.stages == 4


def test_stores_read_one_half_tile_buffer():
    """Every TMA store of the split variant reads the one 32 KB buffer after the 4 stages (the whole
    128x128 piece: two 64-column boxes)."""
    start = 1024 + 4 * SPLIT.stage_bytes()
    offs = sorted({int(m) for m in _STORE.findall(_compiled("split").ptx)})
    assert offs == [start, start + 128 * 64 * 2], offs


def test_existing_config_unchanged():
    assert MainloopConfig() == MainloopConfig(epi_split=False)
    assert "epi_split" not in MainloopConfig().key() and "epi_split" not in BASE.key()
    assert "epi_split" in SPLIT.key() and SPLIT.key() != BASE.key()
    epi = GroupedGemmSm90(BASE, "swiglu").epi
    assert not epi.split and epi.smem_elems() == 128 * 256


@pytest.mark.parametrize("kwargs", [
    dict(epilogue="plain", cfg=SPLIT),
    dict(epilogue="dswiglu", cfg=SPLIT),
    dict(epilogue="swiglu", cfg=MainloopConfig(epi_split=True)),  # no TMA store
    dict(epilogue="swiglu", cfg=SPLIT, mx_h=True),
])
def test_validation(kwargs):
    with pytest.raises(ValueError, match="epi_split"):
        GroupedGemmSm90(kwargs.pop("cfg"), kwargs.pop("epilogue"), **kwargs)

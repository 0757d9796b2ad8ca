"""SM100 expert GEMMs compile for sm_100a and sm_103a (CPU only, never run: no Blackwell GPU)
with the tcgen05 / TMA / mbarrier instructions in the PTX, the expected TMA descriptors, no
spills and register headroom; the host wrappers validate inputs before any launch."""
import re

import pytest
import torch

import cutlass
from mok_cute.kernels.sm100 import grouped_gemm as g
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.kernels.sm100.mainloop import NUM_THREADS, Sm100Config, Sm100Mainloop

VARIANTS = g.variants()
MAX_REGISTERS = 200  # headroom below 255 so epilogue changes surface before they spill


@pytest.fixture(scope="module", params=[(v, a) for v in VARIANTS for a in g.ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def compiled(request):
    name, arch = request.param
    build, needed = VARIANTS[name]
    _, rep = build(arch)
    return name, rep, needed


def test_ptx_instructions(compiled):
    _, rep, needed = compiled
    missing = [i for i in needed if not rep.has(i)]
    assert not missing, missing


def test_no_spills_and_registers_fit(compiled):
    _, rep, _ = compiled
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536


def test_tma_descriptors(compiled):
    """One CUtensorMap kernel parameter (128 bytes, 64-aligned) per TMA operand: A, B, (MXFP8)
    SFA, SFB, and (dgrad1) the second parts of A and B along K: dgu's halves, w_gate and w_up
    are read in place."""
    name, rep, _ = compiled
    expect = 2 + 2 * name.startswith("mxfp8") + 2 * ("dgrad1" in name)
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == expect


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile_m=64), "tile_m"),
    (dict(tile_n=48), "tile_n"),
    (dict(tile_n=64, ab_dtype=cutlass.Float8E4M3FN), "MXFP8 tile_n"),
    (dict(ab_dtype=cutlass.Float16), "ab_dtype"),
    (dict(stages=40), "exceed"),
    (dict(acc_stages=3), "TMEM"),
])
def test_config_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sm100Config(**kwargs).validate()


def test_majorness_and_epilogue_validated():
    with pytest.raises(ValueError, match="a_major"):
        Sm100Mainloop(Sm100Config(), a_major="m")
    with pytest.raises(ValueError, match="epilogue"):
        g.GroupedGemmSm100(Sm100Config(), "relu")
    with pytest.raises(ValueError, match="split_k"):
        g.GroupedGemmSm100(Sm100Config(), split_k=True)  # K-major B
    with pytest.raises(ValueError, match="arch"):
        g.compile_grouped_gemm("plain", arch="sm_90a")


def test_fake_tensors_are_symbolic():
    """Runtime tensors mark every shape mode dynamic; a static mode in a compile-time fake
    (e.g. the 2 of gu's [M, 2, I]) would shift the argument descriptor's fields."""
    with pytest.raises(TypeError, match="symbolic"):
        g._fake_3d(cutlass.BFloat16, 1, 2, 3)


def _raises(fn, args, kwargs, exc, name):
    """``fn(**args)`` with ``kwargs`` replacing some arguments raises ``exc`` matching ``name``."""
    with pytest.raises(exc, match=name):
        fn(**dict(args, **kwargs))


bf, f8, u8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


_KBS = lay.grouped_sf_rows(300, 3) // lay.SF_VEC  # wgrad token scale blocks for _offs()


def _offs():
    return torch.tensor([0, 100, 100, 300], dtype=torch.int32)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(a="x"), TypeError, "a"),
    (dict(a=torch.zeros(300, 64)), TypeError, "a"),
    (dict(a=torch.zeros(300, 60, dtype=bf)), ValueError, "a"),
    (dict(w=torch.zeros(3, 200, 64, dtype=bf)), ValueError, "multiple of 32"),
    (dict(w=torch.zeros(3, 192, 64, dtype=bf)), ValueError, "CUDA"),  # N tail: valid
    (dict(w=torch.zeros(2, 256, 64, dtype=bf)), ValueError, "w"),
    (dict(offsets=torch.zeros(4)), TypeError, "offsets"),
    (dict(a=torch.zeros(300, 64, dtype=f8), w=torch.zeros(3, 256, 64, dtype=f8)), ValueError, "a_scales"),
    (dict(a=torch.zeros(300, 64, dtype=f8), w=torch.zeros(3, 256, 64, dtype=f8),
          a_scales=torch.zeros(300, 2, dtype=u8), w_scales=torch.zeros(3, 256, 3, dtype=u8)), ValueError, "w_scales"),
    (dict(a=torch.zeros(300, 64, dtype=f8), w=torch.zeros(3, 256, 64, dtype=f8),
          a_scales=torch.zeros(300, 2, dtype=u8), w_scales=torch.zeros(3, 256, 2, dtype=u8)), ValueError, "CUDA"),
    (dict(cfg=g.MXFP8_CONFIG), ValueError, "cfg"),
    (dict(), ValueError, "CUDA"),  # valid, but on the CPU
])
def test_grouped_gemm_validation(kwargs, exc, name):
    args = dict(a=torch.zeros(300, 64, dtype=bf), offsets=_offs(), w=torch.zeros(3, 256, 64, dtype=bf))
    _raises(g.grouped_gemm, args, kwargs, exc, name)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_up=torch.zeros(3, 128, 64, dtype=bf)), ValueError, "w_up"),
    (dict(w_gate=torch.zeros(3, 200, 64, dtype=bf), w_up=torch.zeros(3, 200, 64, dtype=bf)), ValueError, "w_gate"),
    (dict(w_gate=torch.zeros(3, 192, 64, dtype=bf), w_up=torch.zeros(3, 192, 64, dtype=bf)), ValueError, "CUDA"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(x=torch.zeros(300, 64, dtype=f8), w_gate=torch.zeros(3, 256, 64, dtype=f8),
          w_up=torch.zeros(3, 256, 64, dtype=f8), x_scales=torch.zeros(300, 2, dtype=u8)), ValueError, "w_scales"),
    (dict(limit=4.0), ValueError, "CUDA"),
])
def test_swiglu_validation(kwargs, exc, name):
    args = dict(x=torch.zeros(300, 64, dtype=bf), offsets=_offs(), w_gate=torch.zeros(3, 256, 64, dtype=bf),
                w_up=torch.zeros(3, 256, 64, dtype=bf))
    _raises(g.grouped_gemm1_swiglu, args, kwargs, exc, name)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_down=torch.zeros(3, 64, 200, dtype=bf)), ValueError, "w_down"),
    (dict(w_down=torch.zeros(3, 64, 192, dtype=bf), gu=torch.zeros(300, 384, dtype=bf)), ValueError, "CUDA"),
    (dict(gu=torch.zeros(300, 256, dtype=bf)), ValueError, "gu"),
    (dict(dy=torch.zeros(300, 64, dtype=f8), w_down=torch.zeros(3, 64, 256, dtype=f8)), ValueError, "dy_scales"),
    (dict(limit=0.0), ValueError, "limit"),
    (dict(limit=4.0), ValueError, "CUDA"),
])
def test_dswiglu_validation(kwargs, exc, name):
    args = dict(dy=torch.zeros(300, 64, dtype=bf), offsets=_offs(), w_down=torch.zeros(3, 64, 256, dtype=bf),
                gu=torch.zeros(300, 512, dtype=bf))
    _raises(g.grouped_dswiglu_dgrad, args, kwargs, exc, name)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_gate=torch.zeros(3, 128, 256, dtype=bf)), ValueError, "w_gate"),
    (dict(w_up=torch.zeros(3, 256, 512, dtype=bf)[:, :, 1:257]), ValueError, "w_up"),  # misaligned
    (dict(w_up=torch.zeros(3, 256, 256, dtype=f8)), TypeError, "w_up"),
    (dict(dgu=torch.zeros(300, 72, dtype=bf), w_gate=torch.zeros(3, 36, 256, dtype=bf),
          w_up=torch.zeros(3, 36, 256, dtype=bf)), ValueError, "dgu"),
    (dict(dgu=torch.zeros(300, 96, dtype=f8), w_gate=torch.zeros(3, 48, 256, dtype=f8),
          w_up=torch.zeros(3, 48, 256, dtype=f8)), ValueError, "dgu"),
    (dict(w_gate=torch.zeros(3, 256, 200, dtype=bf), w_up=torch.zeros(3, 256, 200, dtype=bf)), ValueError, "w_gate"),
    (dict(dgu=torch.zeros(300, 384, dtype=bf), w_gate=torch.zeros(3, 192, 192, dtype=bf),
          w_up=torch.zeros(3, 192, 192, dtype=bf)), ValueError, "CUDA"),  # K split at I % 128 == 64, N tail
    (dict(dgu=torch.zeros(300, 512, dtype=f8), w_gate=torch.zeros(3, 256, 256, dtype=f8),
          w_up=torch.zeros(3, 256, 256, dtype=f8)), ValueError, "dgu_scales"),
    (dict(dgu=torch.zeros(300, 512, dtype=f8), w_gate=torch.zeros(3, 256, 256, dtype=f8),
          w_up=torch.zeros(3, 256, 256, dtype=f8), dgu_scales=torch.zeros(300, 16, dtype=u8),
          w_scales=torch.zeros(3, 8, 256, dtype=u8)), ValueError, "gate_scales, up_scales"),
    (dict(dgu=torch.zeros(300, 512, dtype=f8), w_gate=torch.zeros(3, 256, 256, dtype=f8),
          w_up=torch.zeros(3, 256, 256, dtype=f8), dgu_scales=torch.zeros(300, 16, dtype=u8),
          w_scales=(torch.zeros(3, 8, 256, dtype=u8), torch.zeros(3, 256, 8, dtype=u8))), ValueError, "w_scales"),
    (dict(dgu=torch.zeros(300, 512, dtype=f8), w_gate=torch.zeros(3, 256, 256, dtype=f8),
          w_up=torch.zeros(3, 256, 256, dtype=f8), dgu_scales=torch.zeros(300, 16, dtype=u8),
          w_scales=(torch.zeros(3, 8, 256, dtype=u8),) * 2), ValueError, "CUDA"),
    (dict(out=torch.zeros(300, 512, dtype=bf)), ValueError, "out"),
    (dict(), ValueError, "CUDA"),
    (dict(w_gate=torch.zeros(3, 512, 256, dtype=bf)[:, :256], w_up=torch.zeros(3, 512, 256, dtype=bf)[:, 256:]),
     ValueError, "CUDA"),  # halves of a stacked [E, 2I, H] are read in place
])
def test_dgrad1_validation(kwargs, exc, name):
    args = dict(dgu=torch.zeros(300, 512, dtype=bf), offsets=_offs(), w_gate=torch.zeros(3, 256, 256, dtype=bf),
                w_up=torch.zeros(3, 256, 256, dtype=bf))
    _raises(g.grouped_dgrad1, args, kwargs, exc, name)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(a=torch.zeros(300, 64)), TypeError, "a"),
    (dict(a=torch.zeros(64, 300, dtype=bf).t()), ValueError, "a"),  # column-major
    (dict(a=torch.zeros(300, 70, dtype=bf)[:, 1:65]), ValueError, "a"),  # misaligned slice
    (dict(b=torch.zeros(300, 260, dtype=bf)[:, :256]), ValueError, "b"),  # row stride not 16 bytes
    (dict(b=torch.zeros(299, 256, dtype=bf)), ValueError, "b"),
    (dict(b=torch.zeros(300, 200, dtype=bf)), ValueError, "Nb=200"),
    (dict(a=torch.zeros(300, 192, dtype=bf), b=torch.zeros(300, 320, dtype=bf)), ValueError, "CUDA"),  # M, N tails
    (dict(a=torch.zeros(300, 64, dtype=f8), b=torch.zeros(300, 256, dtype=f8)), ValueError, "a_scales"),
    (dict(a=torch.zeros(300, 64, dtype=f8), b=torch.zeros(300, 256, dtype=f8),
          a_scales=torch.zeros(10, dtype=u8), b_scales=torch.zeros(10, dtype=u8)), ValueError, "a_scales"),
    (dict(out=torch.zeros(3, 64, 128, dtype=bf)), ValueError, "out"),
    (dict(), ValueError, "CUDA"),
    (dict(a=torch.zeros(300, 512, dtype=bf)[:, 256:320], b=torch.zeros(300, 512, dtype=bf)[:, 256:]),
     ValueError, "CUDA"),  # column slices (dgu[:, I:]) are read in place
    (dict(a=torch.zeros(300, 128, dtype=f8)[:, 64:], b=torch.zeros(300, 512, dtype=f8)[:, :256],
          a_scales=torch.zeros(lay.sf_bytes(64, _KBS), dtype=u8),
          b_scales=torch.zeros(lay.sf_bytes(256, _KBS), dtype=u8)),
     ValueError, "CUDA"),
])
def test_wgrad_validation(kwargs, exc, name):
    args = dict(a=torch.zeros(300, 64, dtype=bf), b=torch.zeros(300, 256, dtype=bf), offsets=_offs())
    _raises(g.grouped_wgrad, args, kwargs, exc, name)


def test_mxfp8_2cta_multicasts_sfb_and_offsets_sfa():
    """MXFP8 with cta_group::2: the block-scaled MMA and the scale copies run on the CTA pair,
    SFB's TMA load is a cluster multicast (each CTA loads half, both receive all), and the
    stage budget of sm100_layouts equals CuTe's (checked at trace time)."""
    _, rep = g.variants()["mxfp8-plain-2cta"][0]("sm_100a")
    assert rep.has("tcgen05.mma.cta_group::2.kind::mxf8f6f4.block_scale")
    assert rep.has("tcgen05.cp.cta_group::2")
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\S+", rep.ptx)
    assert sum("multicast::cluster" in ld for ld in loads) == 1, loads  # SFB only
    assert all("cta_group::2" in ld for ld in loads)
    ml = Sm100Mainloop(g.MXFP8_2CTA_CONFIG)
    assert ml.cta_tile_m == 128 and ml.stage_bytes == lay.stage_bytes(256, 256, True, 2)

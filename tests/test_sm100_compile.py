"""SM100 expert GEMMs compile for sm_100a and sm_103a (CPU only, never run: no Blackwell GPU)
with the tcgen05 / TMA / mbarrier instructions in the PTX and no spills; the host wrappers
validate inputs before any launch."""
import pytest
import torch

import cutlass
from mok_cute.kernels import sm100_grouped_gemm as g
from mok_cute.kernels.sm100_mainloop import NUM_THREADS, Sm100Config, Sm100Mainloop

VARIANTS = g.variants()


@pytest.fixture(scope="module", params=[(v, a) for v in VARIANTS for a in g.ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def compiled(request):
    name, arch = request.param
    build, needed = VARIANTS[name]
    _, rep = build(arch)
    return rep, needed


def test_ptx_instructions(compiled):
    rep, needed = compiled
    missing = [i for i in needed if not rep.has(i)]
    assert not missing, missing


def test_no_spills_and_registers_fit(compiled):
    rep, _ = compiled
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= 255 and rep.max_registers * NUM_THREADS <= 65536


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile_m=64), "tile_m"),
    (dict(tile_n=48), "tile_n"),
    (dict(tile_n=64, ab_dtype=cutlass.Float8E4M3FN), "MXFP8 tile_n"),
    (dict(tile_m=256, ab_dtype=cutlass.Float8E4M3FN), "cta_group"),
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
    with pytest.raises(ValueError, match="arch"):
        g.compile_grouped_gemm("plain", arch="sm_90a")


bf, f8, u8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


def _offs():
    return torch.tensor([0, 100, 100, 300], dtype=torch.int32)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(a="x"), TypeError, "a"),
    (dict(a=torch.zeros(300, 64)), TypeError, "a"),
    (dict(a=torch.zeros(300, 60, dtype=bf)), ValueError, "a"),
    (dict(w=torch.zeros(3, 200, 64, dtype=bf)), ValueError, "tile_n"),
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
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        g.grouped_gemm(**args)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_up=torch.zeros(3, 128, 64, dtype=bf)), ValueError, "w_up"),
    (dict(w_gate=torch.zeros(3, 192, 64, dtype=bf), w_up=torch.zeros(3, 192, 64, dtype=bf)), ValueError, "w_gate"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(x=torch.zeros(300, 64, dtype=f8), w_gate=torch.zeros(3, 256, 64, dtype=f8),
          w_up=torch.zeros(3, 256, 64, dtype=f8), x_scales=torch.zeros(300, 2, dtype=u8)), ValueError, "w_scales"),
    (dict(limit=4.0), ValueError, "CUDA"),
])
def test_swiglu_validation(kwargs, exc, name):
    args = dict(x=torch.zeros(300, 64, dtype=bf), offsets=_offs(), w_gate=torch.zeros(3, 256, 64, dtype=bf),
                w_up=torch.zeros(3, 256, 64, dtype=bf))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        g.grouped_gemm1_swiglu(**args)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_down=torch.zeros(3, 64, 200, dtype=bf)), ValueError, "w_down"),
    (dict(gu=torch.zeros(300, 256, dtype=bf)), ValueError, "gu"),
    (dict(dy=torch.zeros(300, 64, dtype=f8), w_down=torch.zeros(3, 64, 256, dtype=f8)), ValueError, "dy_scales"),
    (dict(limit=0.0), ValueError, "limit"),
    (dict(limit=4.0), ValueError, "CUDA"),
])
def test_dswiglu_validation(kwargs, exc, name):
    args = dict(dy=torch.zeros(300, 64, dtype=bf), offsets=_offs(), w_down=torch.zeros(3, 64, 256, dtype=bf),
                gu=torch.zeros(300, 512, dtype=bf))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        g.grouped_dswiglu_dgrad(**args)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(a=torch.zeros(300, 64)), TypeError, "a"),
    (dict(b=torch.zeros(299, 256, dtype=bf)), ValueError, "b"),
    (dict(b=torch.zeros(300, 200, dtype=bf)), ValueError, "tile_n"),
    (dict(a=torch.zeros(300, 64, dtype=f8), b=torch.zeros(300, 256, dtype=f8)), ValueError, "a_scales"),
    (dict(a=torch.zeros(300, 64, dtype=f8), b=torch.zeros(300, 256, dtype=f8),
          a_scales=torch.zeros(10, dtype=u8), b_scales=torch.zeros(10, dtype=u8)), ValueError, "a_scales"),
    (dict(out=torch.zeros(3, 64, 128, dtype=bf)), ValueError, "out"),
    (dict(), ValueError, "CUDA"),
])
def test_wgrad_validation(kwargs, exc, name):
    args = dict(a=torch.zeros(300, 64, dtype=bf), b=torch.zeros(300, 256, dtype=bf), offsets=_offs())
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        g.grouped_wgrad(**args)

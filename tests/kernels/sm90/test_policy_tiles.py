"""Every KernelPolicy tile value the SM90 table allows (mok_cute.layers.tiles) compiles for sm_90a with
no spills and changes the compiled kernel (CPU only); the default policy compiles the kernels as before
(``launch_config()`` is ``MainloopConfig()``, the PTX of an explicit default mainloop is the implicit one's).
The PTX against the previous commit: ``python -m tools.ptx_manifest`` before and after."""
import functools

import pytest

from mok_cute.kernels.sm90 import fused_bwd as fb
from mok_cute.kernels.sm90 import fused_moe as fm
from mok_cute.kernels.sm90.expert_bwd import compile_grouped_wgrad
from mok_cute.kernels.sm90.grouped_gemm import compile_grouped_gemm
from mok_cute.kernels.sm90.mainloop import MN_MAJOR, MainloopConfig, launch_config
from mok_cute.layers.tiles import CHOICES

SM90 = CHOICES["sm90"]["bf16"]
UNFUSED = {  # the unfused kernel of each GEMM, as the layer launches it (BF16; MXFP8 runs the same kernels)
    "gemm1": lambda cfg: compile_grouped_gemm("swiglu", clamp=True, cfg=cfg, inspect=True),
    "gemm2": lambda cfg: compile_grouped_gemm("plain", cfg=cfg, inspect=True),
    "dgrad2": lambda cfg: compile_grouped_gemm("dswiglu", clamp=True, b_major=MN_MAJOR, cfg=cfg, inspect=True),
    "dgrad1": lambda cfg: compile_grouped_gemm("plain", b_major=MN_MAJOR, split_b=True, cfg=cfg, inspect=True),
    "wgrad": lambda cfg: compile_grouped_wgrad(cfg=cfg, inspect=True),
}
FUSED = {  # the fused kernels' fullest variants: the whole forward with a shared expert, the whole backward
    "fused_forward": lambda cfg: fm.compile_fused_forward(True, True, cfg=cfg, inspect=True),
    "fused_backward": lambda cfg: fb.compile_fused_backward_core(fb.BwdVariant(True, True, True, True, True, True),
                                                                 cfg=cfg, inspect=True),
}
BUILD = {**UNFUSED, **FUSED}


def _values(gemm: str):
    """``(tile_n, stages)`` of every non-default combination the table allows for ``gemm`` (stages None: as many
    as fit), the default (256, None) excluded."""
    c = SM90[gemm]
    out = [(tn, st) for tn in c.tile_n for st in (None,) + c.stages_at(tn)]
    return [(tn, st) for tn, st in out if (tn, st) != (c.tile_n[0], None) and st != c.stages_at(tn)[-1]]


@functools.cache
def _report(gemm: str, tile_n: int | None = None, stages: int | None = None):
    return BUILD[gemm](launch_config(tile_n, stages))[1]


def test_default_mainloop_is_the_kernels_default():
    """No tile choice: the kernels' own mainloop, the same compile key as before the policy."""
    assert launch_config() == MainloopConfig() and launch_config(None, None).key() == MainloopConfig().key()
    assert launch_config(128, 4) == MainloopConfig(tile_n=128, stages=4)
    assert fb.BackwardLaunch().tile_n is None and fm.FusedLaunch(8, 1.0).stages is None


@pytest.mark.parametrize("gemm", list(UNFUSED))
def test_explicit_default_compiles_the_same_ptx(gemm):
    """The default policy's mainloop gives the PTX of a launch that names none (the layer's calls before)."""
    default = {"gemm1": lambda: compile_grouped_gemm("swiglu", clamp=True, inspect=True),
               "gemm2": lambda: compile_grouped_gemm("plain", inspect=True),
               "dgrad2": lambda: compile_grouped_gemm("dswiglu", clamp=True, b_major=MN_MAJOR, inspect=True),
               "dgrad1": lambda: compile_grouped_gemm("plain", b_major=MN_MAJOR, split_b=True, inspect=True),
               "wgrad": lambda: compile_grouped_wgrad(inspect=True)}[gemm]
    assert default()[1].ptx == _report(gemm).ptx


@pytest.mark.parametrize("gemm,tile_n,stages", [(g, tn, st) for g in UNFUSED for tn, st in _values(g)])
def test_unfused_tiles_compile_without_spills(gemm, tile_n, stages):
    rep = _report(gemm, tile_n, stages)
    assert rep.total_spill_bytes == 0, rep.log[-2000:]
    assert rep.ptx != _report(gemm).ptx  # the choice reaches the kernel


@pytest.mark.parametrize("gemm,tile_n,stages", [(g, tn, st) for g in FUSED for tn, st in _values(g)])
def test_fused_tiles_compile_without_spills(gemm, tile_n, stages):
    rep = _report(gemm, tile_n, stages)
    assert rep.total_spill_bytes == 0, rep.log[-2000:]
    assert rep.ptx != _report(gemm).ptx
    assert rep.has("wgmma.mma_async") and rep.has("setmaxnreg.inc")


@pytest.mark.parametrize("build", [
    lambda cfg: fm.compile_fused_forward(False, True, mx=True, n_tail=True, cfg=cfg, inspect=True),
    lambda cfg: fm.compile_fused_forward(True, False, ep=True, mx=True, cfg=cfg, inspect=True),
    lambda cfg: fb.compile_fused_backward_core(fb.BwdVariant(True, True, True, mx=True, n_tail=True,
                                                             grouped_slots=True, wd_first=True), cfg=cfg, inspect=True),
    lambda cfg: fb.compile_fused_backward_core(fb.BwdVariant(False, True, True, True, mx=True, ep=True), cfg=cfg,
                                               inspect=True),
], ids=["fwd-mx-tail", "fwd-mx-ep", "bwd-mx-grouped-slots-tail", "bwd-gather-mx-ep"])
def test_tile_n_128_mxfp8_and_ep_variants_compile_without_spills(build):
    """tile_n 128 on the MXFP8 and EP variants (their epilogues' 32-column blocks in 64-column halves)."""
    rep = build(MainloopConfig(tile_n=128))[1]
    assert rep.total_spill_bytes == 0, rep.log[-2000:]


def test_stage_limits_are_refused_by_the_kernels():
    """One stage below the table's range fails the fused kernels' slot-sum buffer; tile_n 128 with the helper
    warps is refused (their lanes span a 256-wide tile's half)."""
    with pytest.raises(ValueError, match="SUM_BATCH"):
        fm.FusedMoeFwdSm90(True, True, cfg=MainloopConfig(tile_n=128, stages=2))
    with pytest.raises(ValueError, match="SUM_BATCH"):
        fb.FusedMoeBwdCoreSm90(fb.BwdVariant(True, True, True), MainloopConfig(tile_n=128, stages=2))
    fb.FusedMoeBwdCoreSm90(fb.BwdVariant(True), MainloopConfig(tile_n=128, stages=2))  # no slot sum: fits
    with pytest.raises(ValueError, match="tile_n 256 only"):
        compile_grouped_gemm("swiglu", helpers=True, cfg=MainloopConfig(tile_n=128))

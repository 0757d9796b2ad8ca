"""The policy device check (tools/checks/policy.py) on the CPU: it is registered with ``python -m
tools.gpu_check`` (so ``pytest -m gpu tests/gpu`` runs it), and every policy variant it runs is one the
SM90 layer accepts: the path table decides its paths (:func:`mok_cute.layers.paths.decide`) and the
tiles table's check (:func:`mok_cute.layers.tiles.check`) takes it at those paths."""
from __future__ import annotations

import pytest

from mok_cute.config import MoKConfig
from mok_cute.layers import paths, tiles
from mok_cute.policy import GEMMS, BackwardPath, ForwardPath, KernelPolicy
from tools.checks import policy as check
from tools.gpu_check import check_names


def test_registered():
    assert "policy" in check_names()
    assert callable(check.run)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("precision", check.PRECISIONS)
def test_variants_allowed_on_sm90(precision, shared):
    got = check.variants(precision, shared)
    names = [n for n, _ in got]
    assert len(names) == len(set(names)), names
    for name, pol in got:
        assert isinstance(pol, KernelPolicy) and pol != KernelPolicy(), name
        cfg = MoKConfig(backend="sm90", precision=precision, policy=pol)
        p = paths.decide(cfg, "sm90", paths.Call(precision, ep=1, shared=shared))
        tiles.check(cfg.kernel_policy, "sm90", precision, p.forward, p.backward)  # raises if not allowed


@pytest.mark.parametrize("precision", check.PRECISIONS)
def test_variants_cover_the_table(precision):
    """Every GEMM's non-default tile_n of the table is run, the fused backward's under each fused path."""
    pols = [p for _, p in check.variants(precision, shared=True)]
    table = tiles.CHOICES["sm90"][precision]
    for gemm in GEMMS:
        for tn in table[gemm].tile_n[1:]:
            hits = [p for p in pols if p.gemm(gemm).tile_n == tn and getattr(p, gemm).tile_n == tn]
            assert hits, (gemm, tn)
            if gemm == "fused_backward":
                assert {p.backward_path for p in hits} == {BackwardPath.FUSED, BackwardPath.FUSED_WHOLE}
            elif gemm != "fused_forward":
                assert all(p.forward_path is ForwardPath.UNFUSED and p.backward_path is BackwardPath.UNFUSED
                           for p in hits)
    assert any(p.tiles.tile_n == 128 for p in pols)
    assert any(p.fused_forward.stages == 2 for p in pols)
    assert {p.minibatch_tokens for p in pols} >= {512, 4096} and any(p.comm_sms_fwd == 8 for p in pols)


def test_shape_b_partial_tile_at_256_only():
    (_, (_, h, inter, *_)), = [s for s in check.SHAPES if s[0] == "B"]
    assert h % 256 and not h % 128 and not inter % 128

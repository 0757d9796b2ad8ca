"""The SM100 fused forward's opt-in bulk push (``bulk_push``, ``MoKConfig.comm_transport="bulk"``) on the CPU:
at EP > 1 R2's epilogue threads stage each 32-column bf16 chunk of their row in shared memory and
move it into the owner rank's slot row with ``cp.async.bulk`` shared -> global (bulk groups, a read
wait before a slice is rewritten, a full wait and ``fence.proxy.async.global`` before the
system-scope fence and the release that publishes the tile). It compiles for sm_100a and sm_103a
(one-CTA and ``cta_group::2`` tiles, BF16 and MXFP8) with the EP protocol's instructions and no
spills; the host picks it from its launch policy. Nothing here runs a kernel (no Blackwell GPU)."""
import functools
import re

import pytest

from test_sm100_fused_fwd import EP_NEEDED, MAX_REGISTERS, _fake_device, _operands, _rep, by_name, forward

from mok_cute.kernels.sm100.grouped_gemm import ARCHS

BULK_NEEDED = ("fence.proxy.async.shared::cta", "cp.async.bulk.global.shared::cta.bulk_group",
               "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read")
# a tile's copies complete, then the proxy fence, the system-scope fence, the epilogue barrier, the release
PUBLISH = re.compile(r"cp\.async\.bulk\.wait_group\s+0;\s*fence\.proxy\.async\.global;.*?fence\.acq_rel\.sys;"
                     r"\s*bar\.sync\s+1, 128;.*?atom\.global\.release\.add", re.S)
CASES = [(False, False, False, 128), (True, True, True, 128), (False, False, False, 256), (True, True, True, 256)]


@functools.cache
def _bulk(arch: str, clamp: bool, shared: bool, mx: bool, tile_m: int):
    from mok_cute.kernels.sm100 import fused_moe as fm

    return fm.compile_fused_forward_sm100(fm.FwdVariant(clamp, shared, mx=mx, ep=True, tile_m=tile_m, bulk_push=True),
                                          arch, inspect=True)[1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp,shared,mx,tile_m", CASES)
def test_bulk_push_compiles(arch, clamp, shared, mx, tile_m):
    """Every bulk-push variant: the bulk copies (one 64-byte copy per 32-column chunk: 8 per tile
    row), their commits and waits, the EP protocol's signals / waits / fences, the FREE wait
    followed by a proxy fence, the publish order; 0 spills, <= MAX_REGISTERS; the same GEMM code
    as the st-push variant, which has no bulk copy to global memory."""
    rep, st = _bulk(arch, clamp, shared, mx, tile_m), _rep(arch, clamp, shared, mx=mx, ep=True, tile_m=tile_m)
    missing = [i for i in BULK_NEEDED + EP_NEEDED if not rep.has(i)]
    assert not missing, missing
    assert rep.ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 8
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+1;", rep.ptx)) == 6  # chunks 2 .. 7
    assert PUBLISH.search(rep.ptx), "the bulk copies are not waited for and fenced before the release"
    assert re.search(r"bar\.sync\s+1, 128;\s*fence\.proxy\.async\.global;", rep.ptx)  # after the FREE wait
    assert ("cta_group::2" in rep.ptx) == (tile_m == 256) and ("kind::mxf8f6f4" in rep.ptx) == mx
    assert "multimem" not in rep.ptx
    assert rep.registers and rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS
    assert "cp.async.bulk.global.shared::cta" not in st.ptx
    assert rep.ptx.count("tcgen05.mma") == st.ptx.count("tcgen05.mma")
    tma = r"\.param \.align 64 \.b8 \S+\[128\]"
    assert len(re.findall(tma, rep.ptx)) == len(re.findall(tma, st.ptx))


def test_bulk_push_registry():
    """tools/blackwell_readiness.py's and ptx_manifest's bulk-push entries: each PTX item in the kernel."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    reg = fm.variants()
    names = {"fused-fwd-ep-bulk-push-noclamp-routed": (False, False, False, 128),
             "fused-fwd-mxfp8-ep-bulk-push-clamp-shared": (True, True, True, 128),
             "fused-fwd-ep-2cta-bulk-push-noclamp-routed": (False, False, False, 256),
             "fused-fwd-mxfp8-ep-2cta-bulk-push-clamp-shared": (True, True, True, 256)}
    assert sorted(n for n in reg if "bulk-push" in n) == sorted(names)
    for name, case in names.items():
        rep = _bulk("sm_100a", *case)
        needed = reg[name][1]
        assert all(i in needed for i in BULK_NEEDED + EP_NEEDED) and all(rep.has(i) for i in needed), name


def test_bulk_push_shared_memory_and_arguments(monkeypatch):
    """bulk_push needs ep; the staging area fits next to every config's stages (BF16 cta_group::2
    with one stage fewer than PAIR_CONFIG's, the other configs unchanged); a staging area that does
    not fit is a ValueError at construction."""
    from mok_cute.kernels.sm100 import fused_moe as fm
    from mok_cute.kernels.sm100 import layouts as lay

    with pytest.raises(ValueError, match="bulk_push.*needs ep"):
        fm.FwdVariant(True, True, bulk_push=True)
    assert fm.PUSH_SMEM == 128 * (2 * 64 + 16)
    for mx in (False, True):
        for tile_m in (128, 256):
            bulk = fm.FusedMoeFwdSm100(fm.FwdVariant(False, False, mx=mx, ep=True, tile_m=tile_m, bulk_push=True))
            st = fm.FusedMoeFwdSm100(fm.FwdVariant(False, False, mx=mx, ep=True, tile_m=tile_m))
            assert bulk.mainloop.smem_bytes + fm.PUSH_SMEM <= lay.SMEM_CAPACITY
            assert bulk.mainloop.stages == st.mainloop.stages - (not mx and tile_m == 256)
            assert bulk.cfg.key()[:2] == st.cfg.key()[:2] and bulk.cfg.key()[3:] == st.cfg.key()[3:]
    pair = fm.FusedMoeFwdSm100(fm.FwdVariant(False, False, ep=True, tile_m=256))
    assert fm.PAIR_CONFIG.stages == 0 and pair.mainloop.stages == 7
    monkeypatch.setattr(fm, "PUSH_SMEM", 64 * 1024)
    with pytest.raises(ValueError, match="staging area does not fit"):
        fm.FusedMoeFwdSm100(fm.FwdVariant(False, False, ep=True, bulk_push=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_host_push_toggle(monkeypatch, arch):
    """fused_forward(ws=...) on CPU (compile and launch faked): ``Sm100Launch.bulk_push`` picks the
    variant (the compile key's ``bulk_push``: st, the default; bulk; with ``tile_m`` 256 too), with
    one argument per ``__call__`` parameter either way; EP = 1 ignores it (no peers to push to); the
    environment is not read."""
    from conftest import FakeWorkspace

    fm, fake, keys = _fake_device(monkeypatch, arch)
    ops = dict(_operands(True), comm_ctas=100)
    ws = FakeWorkspace(100, 256, 2)
    monkeypatch.setenv("MOK_CUTE_SM100_PUSH", "bulk")  # gone: not read
    forward(fm, ops, ws=ws, num_ctas=74)
    v = keys[-1][2]
    assert keys[-1][:2] == ("sm100_fused_moe_fwd", arch) and (v.ep, v.gather, v.tile_m, v.bulk_push) == \
        (True, "comm", 128, False)
    for tile_m, bulk in ((128, True), (128, False), (256, True)):
        forward(fm, ops, ws=ws, num_ctas=74, tile_m=tile_m, bulk_push=bulk)
        assert (keys[-1][2].tile_m, keys[-1][2].bulk_push) == (tile_m, bulk)
        by_name(fake.direct[-1])  # one argument per __call__ parameter
    assert len(fake.direct) == 4 and not fake.calls
    forward(fm, _operands(True), bulk_push=True)  # EP = 1: the st variant
    assert keys[-1][2].bulk_push is False and keys[-1][2].ep is False and len(fake.calls) == 1
    with pytest.raises(TypeError, match="bulk_push"):
        forward(fm, ops, ws=ws, bulk_push="bulk")

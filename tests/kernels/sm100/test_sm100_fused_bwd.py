"""The fused SM100 backward core (kernels/sm100/fused_bwd.py) on the CPU: it compiles for sm_100a
and sm_103a with the instructions its protocol needs (tcgen05 MMA / TMEM, TMA, the ticket and the
D2 readiness release adds, %globaltimer-bounded waits), no spills, no multicast; its host entry
validates before any compile or launch and passes one argument per kernel parameter. Nothing
here runs a kernel (no Blackwell GPU)."""
import functools
import inspect
import re
from dataclasses import replace

import pytest

from conftest import fake_sm100_device
from test_sm100_mxfp8 import ref_quant  # noqa: F401 (fixture)

from mok_cute.kernels.sm100.grouped_gemm import ARCHS
from mok_cute.kernels.sm100.mainloop import NUM_THREADS

MAX_REGISTERS = 200  # as tests/test_sm100_compile.py: headroom below 255
MX_PARAMS = ("mDysf", "mWdsf", "mDgusf", "mWgusf", "mDyt", "mDytsf", "mHtsf", "mDgut", "mDgtsf", "mDutsf", "mXtsf")


@functools.cache
def _rep(arch: str, clamp: bool, tokens: bool = False, init: bool = False, add: bool = False, mx: bool = False,
         gather: bool = False, shared: bool = False, ep: bool = False, accumulate: bool = False,
         grouped: bool = False):
    from mok_cute.kernels.sm100 import fused_bwd as fb

    v = fb.BwdVariant(clamp, tokens=tokens, init=init, add=add, mx=mx, gather=gather, by_route=gather and not ep,
                      shared=shared, ep=ep, accumulate=accumulate, grouped_slots=grouped)
    return fb.compile_fused_backward_sm100(v, arch, inspect=True)[1]


# the launch's bundles' fields as the flat kernel parameters they were (``__call__``'s order before bundling)
PARAM_NAMES = {
    "routed": ("mDy", "mX", "mGU", "mH", "mWg", "mWu", "mWd", "mDgu", "mDx", "mDWg", "mDWu", "mDWd", "mOffsets", "mD2",
               "mWords"),
    "toks": ("mOrder", "mIdx", "mInit", "mAdd", "mOut"),
    "mx": ("mDysf", "mWdsf", "mDgusf", "mWgusf", "mDyt", "mDytsf", "mHtsf", "mDgut", "mDgtsf", "mDutsf", "mXtsf"),
    "gather": ("mDyTok", "mXTok", "mR", "mW", "mDtw", "mGdy", "mDyRows", "mXRows"),
    "shared": ("mSDy", "mSX", "mSGU", "mSH", "mSWg", "mSWu", "mSWd", "mSDgu", "mSDx", "mSDWg", "mSDWu", "mSDWd",
               "mSOffsets", "mSD2", "mSWords"),
    "scalars": ("k", "comm_ctas", "limit", "num_ctas", "timeout_ns"),
    "peer": ("mPeer", "mStatus", "me", "n_ranks", "src_off", "dy_off", "slots_off", "flags_off", "epoch_pull",
             "epoch_push"),
}


def by_name(args, keep: bool = False) -> dict:
    """One launch's arguments (the bundles, then the stream) by their flat parameter names, after
    checking they are ``__call__``'s bundles in order (an all-None one passed as None); ``keep``: a
    tensor's ``_Desc`` as its tensor."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters.values())[1:]
    assert len(args) == len(params), (len(args), len(params))
    out = {}
    for b, p in zip(args[:-1], params):
        names = PARAM_NAMES[p.name]
        assert b is None or (type(b).__name__ == p.annotation and len(b) == len(names)
                             and any(v is not None for v in b))
        out.update(zip(names, (None,) * len(names) if b is None else b))
    if keep:
        out = {n: None if a is None else getattr(a, "_keep", a) for n, a in out.items()}
    return out


def _launch_of(o: dict, mx: bool, timeout_s=30.0):
    """The ``Sm100Launch`` of the launch fields popped from the flat operands ``o``."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    kw = {n: o.pop(n) for n in ("num_ctas", "tile_m", "bulk_push") if n in o}
    return fm.Sm100Launch(o.pop("comm_ctas", 1), o.pop("timeout_s", timeout_s), mx=mx, **kw)


def core(fb, ops: dict, **more):
    """``fb.fused_backward_core`` on the flat operands of :func:`_operands` (and ``more``) bundled."""
    from mok_cute.kernels.operands import ExpertWeights

    o = dict(ops, **more)
    w_scales = o.pop("w_scales", None)
    launch = _launch_of(o, w_scales is not None)
    return fb.fused_backward_core(o.pop("dy"), o.pop("x"), o.pop("gu"), o.pop("h"), o.pop("offsets"),
                                  ExpertWeights(o.pop("w_gate"), o.pop("w_up"), o.pop("w_down")), o.pop("limit"),
                                  launch, w_scales=w_scales, **o)


def whole(fb, ops: dict, **more):
    """``fb.fused_backward`` on the flat operands of :func:`_gather_operands` (and ``more``) bundled."""
    from mok_cute.kernels.operands import ExpertWeights, RoutePlan

    o = dict(ops, **more)
    w_scales = o.pop("w_scales", None)
    launch = _launch_of(o, w_scales is not None)
    plan = RoutePlan(o.pop("order"), o.pop("offsets"), o.pop("topk_idx"), o.pop("topk_w"))
    saved = fb.ForwardSaved(o.pop("gu"), o.pop("h"), o.pop("r_rows"), o.pop("rows_by_route"))
    weights = ExpertWeights(o.pop("w_gate"), o.pop("w_up"), o.pop("w_down"))
    return fb.fused_backward(o.pop("dy"), o.pop("x"), plan, saved, weights, o.pop("limit"), launch, w_scales=w_scales,
                             **o)


def whole_ep(fb, ops: dict, **more):
    """``fb.fused_backward_ep`` on the flat operands of :func:`_ep_operands` (and ``more``) bundled."""
    from mok_cute.kernels.operands import ExpertWeights, RoutePlan

    o = dict(ops, **more)
    ws, p = o.pop("ws"), o.pop("plan")
    w_scales = o.pop("w_scales", None)
    launch = _launch_of(o, w_scales is not None, ws.timeout_s)
    plan = RoutePlan(p.recv_src, p.offsets, o.pop("topk_idx"), None)
    saved = fb.ForwardSaved(o.pop("gu"), o.pop("h"), o.pop("slot_rows"), False, o.pop("w_rows"))
    weights = ExpertWeights(o.pop("w_gate"), o.pop("w_up"), o.pop("w_down"))
    return fb.fused_backward_ep(ws, plan, o.pop("dy"), o.pop("x"), saved, weights, o.pop("limit"), launch,
                                w_scales=w_scales, **o)


NEEDED = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
          "mbarrier.try_wait", "atom.global.add.u32",  # the ticket (relaxed)
          "atom.global.release.add.u32",  # d2[mt]
          "ld.acquire", "%globaltimer", "fence.proxy.async.global", "fence.acq_rel.gpu", "ex2.approx")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp", [True, False])
def test_compiles_with_its_protocol(arch, clamp):
    rep = _rep(arch, clamp)
    missing = [i for i in NEEDED if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    # one CUtensorMap per TMA operand: D2 dy + w_down, D1 dg + w_gate + du + w_up, dWd dy + h, dWg dg + x, dWu du
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 11
    assert rep.ptx.count("tcgen05.alloc") == 1 and "tcgen05.relinquish_alloc_permit" in rep.ptx
    assert rep.ptx.count("atom.global.release.add.u32") == 1  # only D2 tiles publish
    # no data atomics: the ticket (claimed before and in the loop), the D2 count, the status word's first-error CAS
    ops = re.findall(r"\b(?:atom|red)\.global\.(\S+)", rep.ptx)
    assert sorted(set(ops)) == ["add.u32", "cas.b32", "release.add.u32"] and ops.count("add.u32") == 2, ops


def test_clamp_changes_only_the_dswiglu():
    """The clamp variant adds the dSwiGLU clamp's selects; the GEMM and protocol code is the same."""
    on, off = _rep("sm_100a", True), _rep("sm_100a", False)
    for i in ("tcgen05.mma", "cp.async.bulk.tensor", "atom.global", "%globaltimer"):
        assert on.ptx.count(i) == off.ptx.count(i), i
    assert on.ptx.count("selp") > off.ptx.count("selp")


def test_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    with pytest.raises(ValueError, match="arch"):
        fb.compile_fused_backward_sm100(fb.BwdVariant(True), "sm_90a")


def test_gated_swiglu_variant():
    """gpt-oss's dSwiGLU (``gated``: alpha 1.702, up offset 1) in the D2 epilogue (sm_100a): the plain core's GEMM
    code (tcgen05.mma count), 0 spills, registers within the headroom, alpha as an fp32 immediate."""
    from mok_cute.kernels.sm100 import fused_bwd as fb
    from mok_cute.kernels.swiglu_math import Gated

    rep = fb.compile_fused_backward_sm100(fb.BwdVariant(True, gated=Gated(1.702, 1.0)), "sm_100a", inspect=True)[1]
    plain = _rep("sm_100a", True)
    assert rep.total_spill_bytes == 0 and rep.max_registers <= MAX_REGISTERS
    assert rep.ptx.count("tcgen05.mma") == plain.ptx.count("tcgen05.mma")
    alpha = re.compile(r"0f[3B]FD9DB23\b")
    assert alpha.search(rep.ptx) and not alpha.search(plain.ptx)


def test_host_launch_compiles_the_activation_in(monkeypatch):
    """fused_backward_core takes the activation as ``limit``: SwiGLU.gpt_oss()'s alpha and up offset go in the
    compiled variant (``gated``), its limit 7 in the scalars; a plain SwiGLU(L) is the float L's variant."""
    from mok_cute.kernels.swiglu_math import Gated
    from mok_cute.reference import SwiGLU

    fb, fake, keys = _fake_device(monkeypatch)
    for act in (SwiGLU.gpt_oss(), SwiGLU(4.0), 4.0):
        core(fb, dict(_operands(), limit=act))
    assert [k[2] for k in keys] == [fb.BwdVariant(True, gated=Gated(1.702, 1.0)), fb.BwdVariant(True),
                                    fb.BwdVariant(True)]
    assert [by_name(args)["limit"].value for args in fake.calls] == [7.0, 4.0, 4.0]


def _fake_device(monkeypatch, arch="sm_100a"):
    from mok_cute.kernels.sm100 import fused_bwd as fb

    return fake_sm100_device(monkeypatch, fb, arch)


def _operands(m=200, h=256, inter=192, e=4, mcap=260):
    import torch

    bf = torch.bfloat16
    return dict(
        dy=torch.randn(m, h).to(bf), x=torch.randn(m, h).to(bf), gu=torch.randn(mcap, 2 * inter).to(bf),
        h=torch.randn(mcap, inter).to(bf), offsets=torch.tensor([0, 50, 100, 150, 200], dtype=torch.int32)[:e + 1],
        w_gate=torch.randn(e, inter, h).to(bf), w_up=torch.randn(e, inter, h).to(bf),
        w_down=torch.randn(e, h, inter).to(bf), limit=4.0, timeout_s=1.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("limit", [4.0, None])
def test_host_launch_matches_the_kernel_signature(monkeypatch, arch, limit):
    """fused_backward_core's host side on CPU tensors (compile and launch replaced): one argument
    per parameter of the kernel's ``__call__`` (a host / kernel mismatch fails here, not on the
    GPU), the operands the unfused SM100 kernels read, the counters, the cache key per variant."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch, arch)
    ops = _operands()
    ops["limit"] = limit
    dx, dwg, dwu, dwd = core(fb, ops)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    by = by_name(args)
    assert keys == [("sm100_fused_moe_bwd", arch, fb.BwdVariant(limit is not None))]
    assert by["mDy"]._keep is ops["dy"] and by["mX"]._keep is ops["x"] and by["mWd"]._keep is ops["w_down"]
    assert by["mWg"]._keep is ops["w_gate"] and by["mWu"]._keep is ops["w_up"] and by["mOffsets"]._keep is ops["offsets"]
    assert torch.equal(by["mGU"]._keep, ops["gu"][:200].view(200, 2, 192))  # the forward's first M rows
    assert torch.equal(by["mH"]._keep, ops["h"][:200])
    assert tuple(by["mDgu"]._keep.shape) == (200, 2, 192)
    assert by["mDx"]._keep is dx and by["mDWg"]._keep is dwg and by["mDWu"]._keep is dwu and by["mDWd"]._keep is dwd
    assert tuple(dx.shape) == (200, 256) and tuple(dwg.shape) == tuple(dwu.shape) == (4, 192, 256)
    assert tuple(dwd.shape) == (4, 256, 192)
    # d2: ceil(200 / 128) + 4 + 1 m-tiles at most (one zeroed buffer with the ticket + status words)
    d2, words = by["mD2"]._keep, by["mWords"]._keep
    assert tuple(d2.shape) == (6,) and tuple(words.shape) == (5,) and not d2.any() and not words.any()
    assert words.data_ptr() == d2.data_ptr() + 6 * 4
    assert all(by[n] is None for n in ("mOrder", "mIdx", "mInit", "mAdd", "mOut") + MX_PARAMS)
    assert int(by["num_ctas"]) == 148 and int(by["timeout_ns"]) == 10 ** 9
    assert by["limit"].value == (0.0 if limit is None else 4.0)
    core(fb, ops, num_ctas=7)
    assert int(by_name(fake.calls[1])["num_ctas"]) == 7
    assert by["mDgu"]._keep.data_ptr() != ops["gu"].data_ptr()
    core(fb, ops, consume=True)  # the one-shot layer backward: dgu over gu's first M rows
    dgu = by_name(fake.calls[2])["mDgu"]._keep
    assert dgu.data_ptr() == ops["gu"].data_ptr() and tuple(dgu.shape) == (200, 2, 192)


def test_host_no_rows(monkeypatch):
    """M = 0: zero weight gradients, an empty dx, nothing compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], offsets=torch.zeros(5, dtype=torch.int32))
    dx, dwg, dwu, dwd = core(fb, ops)
    assert tuple(dx.shape) == (0, 256) and not fake.calls and not keys
    assert not dwg.any() and not dwu.any() and not dwd.any()


@pytest.mark.parametrize("change, exc, match", [
    (dict(dy="dy"), TypeError, "dy"),
    (dict(dy=None), TypeError, "dy"),
    ("dy_float", TypeError, "dy"),
    ("dy_h", ValueError, "multiple of 64"),
    ("x_shape", ValueError, "x"),
    ("x_float", TypeError, "x"),
    ("offsets_i64", TypeError, "offsets"),
    ("offsets_len", ValueError, "offsets"),
    ("inter", ValueError, "w_gate"),
    ("w_up_shape", ValueError, "w_up"),
    ("w_down_shape", ValueError, "w_down"),
    ("w_down_strided", ValueError, "w_down"),
    ("gu_rows", ValueError, "gu"),
    ("gu_cols", ValueError, "gu"),
    ("h_float", TypeError, "h"),
    ("h_strided", ValueError, "h"),
    ("dy_strided", ValueError, "dy"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(timeout_s=0.0), ValueError, "timeout_s"),
    (dict(timeout_s="1"), TypeError, "timeout_s"),
    (dict(num_ctas=0), ValueError, "num_ctas"),
    ("arch", ValueError, "sm_100a / sm_103a"),
])
def test_host_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad operand raises, naming it, before anything is compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch, "sm_90a" if change == "arch" else "sm_100a")
    ops = _operands()
    bf = torch.bfloat16
    edits = {
        "dy_float": dict(dy=torch.zeros(200, 256)),
        "dy_h": dict(dy=torch.zeros(200, 96, dtype=bf)),
        "x_shape": dict(x=torch.zeros(199, 256, dtype=bf)),
        "x_float": dict(x=torch.zeros(200, 256)),
        "offsets_i64": dict(offsets=torch.zeros(5, dtype=torch.int64)),
        "offsets_len": dict(offsets=torch.zeros(4, dtype=torch.int32)),
        "inter": dict(w_gate=torch.zeros(4, 100, 256, dtype=bf)),
        "w_up_shape": dict(w_up=torch.zeros(4, 128, 256, dtype=bf)),
        "w_down_shape": dict(w_down=torch.zeros(4, 192, 256, dtype=bf)),
        "w_down_strided": dict(w_down=torch.zeros(4, 256, 384, dtype=bf)[:, :, :192]),
        "gu_rows": dict(gu=torch.zeros(199, 384, dtype=bf)),
        "gu_cols": dict(gu=torch.zeros(260, 192, dtype=bf)),
        "h_float": dict(h=torch.zeros(260, 192)),
        "h_strided": dict(h=torch.zeros(260, 384, dtype=bf)[:, :192]),
        "dy_strided": dict(dy=torch.zeros(200, 512, dtype=bf)[:, :256]),
        "arch": {},
    }
    ops.update(change if isinstance(change, dict) else edits[change])
    with pytest.raises(exc, match=match):
        core(fb, ops)
    assert not fake.calls and (change == "arch" or not keys)


def test_strided_gate_up_halves_accepted(monkeypatch):
    """w_gate / w_up may be the halves of one stacked [E, 2I, H] (read in place, as the unfused dgrad1)."""
    import torch

    fb, fake, _ = _fake_device(monkeypatch)
    ops = _operands()
    w = torch.cat([ops["w_gate"], ops["w_up"]], 1)
    ops.update(w_gate=w[:, :192], w_up=w[:, 192:])
    core(fb, ops)
    (args,) = fake.calls
    by = by_name(args)
    assert by["mWg"]._keep.stride() == (384 * 256, 256, 1) and by["mWu"]._keep.data_ptr() == w[:, 192:].data_ptr()


def test_variants_registry():
    """tools/blackwell_readiness.py's entries: both clamp variants, each PTX item in the compiled kernel."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    reg = {n: v for n, v in fb.variants().items() if "2cta" not in n and "bulk" not in n}  # tested below
    assert sorted(fb.variants()) == sorted(list(reg) + PAIR_VARIANTS + BULK_VARIANTS)
    assert sorted(reg) == ["fused-bwd-core-clamp", "fused-bwd-core-noclamp", "fused-bwd-ep-clamp",
                           "fused-bwd-ep-shared-noclamp", "fused-bwd-gather-clamp",
                           "fused-bwd-gather-shared-main-grads-noclamp", "fused-bwd-gather-shared-noclamp",
                           "fused-bwd-mxfp8-core-clamp", "fused-bwd-mxfp8-ep-init-noclamp",
                           "fused-bwd-mxfp8-gather-init-clamp",
                           "fused-bwd-mxfp8-tokens-grouped-noclamp", "fused-bwd-mxfp8-tokens-noclamp",
                           "fused-bwd-tokens-clamp", "fused-bwd-tokens-noclamp"]
    for name, (build, needed) in reg.items():
        assert callable(build)
        clamp, tokens, mx, ep, shared = (name.endswith("-clamp"), "tokens" in name, "mxfp8" in name,
                                         "-ep-" in name, "shared" in name)
        if "gather" in name or ep:
            rep = _rep("sm_100a", clamp, True, shared or "init" in name, False, mx, True, shared, ep,
                       "main-grads" in name)
        else:
            rep = _rep("sm_100a", clamp, tokens, tokens and clamp, tokens and clamp, mx, grouped="grouped" in name)
        assert all(rep.has(i) for i in needed), [i for i in needed if not rep.has(i)]


# ---------------------------------------------------------------- the tokens variant (dx scatter + slot sum)
TOKEN_VARIANTS = [(True, True, True), (False, False, False)]  # (clamp, init, add)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp, init, add", TOKEN_VARIANTS)
def test_tokens_variant_compiles_with_its_protocol(arch, clamp, init, add):
    """The core's protocol plus a release add per stored D1 tile (on ``done``), the slot sum's
    bounded acquire wait on it, and the slot sum itself (single-rounded fp32 adds over cp.async
    slot rows; unweighted: dy is already scaled, so no mul.rn); no spills."""
    rep, core = _rep(arch, clamp, True, init, add), _rep(arch, clamp)
    missing = [i for i in NEEDED + ("add.rn.f32", "cp.async.cg", "bar.sync") if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.total_spill_bytes == 0 and rep.registers
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    assert rep.ptx.count("atom.global.release.add.u32") == 2  # d2[mt] per D2 tile, done per D1 tile
    waits = re.findall(r"ld\.acquire\.\S+", rep.ptx)
    assert len(waits) == core.ptx.count("ld.acquire") + 2  # wait_geq's first load and its loop's
    assert all(w == "ld.acquire.sys.global.b32" for w in waits), set(waits)
    assert rep.ptx.count("%globaltimer") > core.ptx.count("%globaltimer")  # the done wait is bounded
    ops = re.findall(r"\b(?:atom|red)\.global\.(\S+)", rep.ptx)
    assert sorted(set(ops)) == ["add.u32", "cas.b32", "release.add.u32"] and ops.count("add.u32") == 2, ops
    assert "mul.rn.f32" not in rep.ptx
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 11  # no new TMA operand


def test_tokens_start_terms_change_only_the_slot_sum():
    """init / add add the start's loads and fp32 adds; the GEMM and protocol code is the same."""
    full, bare = _rep("sm_100a", True, True, True, True), _rep("sm_100a", True, True)
    for i in ("tcgen05.mma", "cp.async.bulk.tensor", "atom.global", "ld.acquire", "cp.async.cg"):
        assert full.ptx.count(i) == bare.ptx.count(i), i
    assert full.ptx.count("add.rn.f32") > bare.ptx.count("add.rn.f32")


def test_tokens_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    for kw in (dict(init=True), dict(add=True)):
        with pytest.raises(ValueError, match="need tokens"):
            fb.BwdVariant(True, **kw)


def _tokens(t=90, k=3, h=256, m=200, shared=True, add=True, seed=0):
    """(order [m + 7] int64: grouped row -> t*k + j, topk_idx [T, k] with -1 slots, dx_shared, dx_add)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    routes = torch.randperm(t * k, generator=g)[:m]
    idx = torch.full((t * k,), -1, dtype=torch.int64)
    idx[routes] = torch.randint(0, 4, (m,), generator=g)
    order = torch.cat([routes, torch.full((7,), -1)])  # past M: unread
    dxs = torch.randn(t, h, generator=g).bfloat16() if shared else None
    dxa = torch.randn(t, h, generator=g) if add else None
    return order, idx.view(t, k), dxs, dxa


@pytest.mark.parametrize("shared, add", [(True, True), (True, False), (False, False)])
def test_host_tokens_launch_matches_the_kernel_signature(monkeypatch, shared, add):
    """fused_backward_core(tokens=...) on CPU tensors (compile and launch replaced): dx is [T, H]
    (the kernel's mOut), D1 rows go to a [T*k, H] slot buffer (mDx), order / topk_idx as int32
    vectors, the done word after the status words, one argument per kernel parameter."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    order, idx, dxs, dxa = _tokens(shared=shared, add=add)
    tokens = (order, idx, dxs) + ((dxa,) if add else ())
    dx, dwg, dwu, dwd = core(fb, ops, tokens=tokens)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    by = by_name(args)
    assert keys == [("sm100_fused_moe_bwd", "sm_100a", fb.BwdVariant(True, True, shared, add))]
    assert tuple(dx.shape) == (90, 256) and dx.dtype == torch.bfloat16 and by["mOut"]._keep is dx
    assert tuple(by["mDx"]._keep.shape) == (270, 256) and by["mDx"]._keep.dtype == torch.bfloat16
    assert by["mOrder"]._keep.dtype == torch.int32 and torch.equal(by["mOrder"]._keep, order[:200].int())
    assert by["mIdx"]._keep.dtype == torch.int32 and torch.equal(by["mIdx"]._keep, idx.reshape(-1).int())
    assert (by["mInit"] is None) != shared and (not shared or by["mInit"]._keep is dxs)
    assert (by["mAdd"] is None) != add and (not add or by["mAdd"]._keep is dxa)
    assert int(by["k"]) == 3
    d2, words = by["mD2"]._keep, by["mWords"]._keep
    assert tuple(words.shape) == (fb.DONE_WORD + 1,) and not words.any()  # ticket, status, done
    assert words.data_ptr() == d2.data_ptr() + d2.numel() * 4
    assert tuple(dwg.shape) == (4, 192, 256) and tuple(dwd.shape) == (4, 256, 192)


@pytest.mark.parametrize("shared, add", [(True, True), (True, False), (False, True), (False, False)])
def test_host_tokens_no_rows(monkeypatch, shared, add):
    """M = 0: dx is the slot sum's start, bf16(fp32(dx_shared) or 0 [+ dx_add]) (the reference's),
    nothing compiled or launched."""
    import torch

    from mok_cute import reference as R

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], offsets=torch.zeros(5, dtype=torch.int32))
    order, idx, dxs, dxa = _tokens(m=0, shared=shared, add=add)
    dx, dwg, _, _ = core(fb, ops, tokens=(order, idx, dxs, dxa))
    start = torch.zeros(90, 256) if dxs is None else dxs.float()
    if dxa is not None:
        start = start + dxa
    want = R.slot_sum(start, torch.zeros(90, 3, 256, dtype=torch.bfloat16), idx).bfloat16()
    assert torch.equal(dx, want) and not fake.calls and not keys and not dwg.any()


@pytest.mark.parametrize("change, exc, match", [
    ("not_tuple", ValueError, "tokens"),
    ("order_float", TypeError, "order"),
    ("order_short", ValueError, "order"),
    ("idx_1d", ValueError, "topk_idx"),
    ("idx_float", TypeError, "topk_idx"),
    ("idx_k0", ValueError, "topk_idx"),
    ("shared_float", TypeError, "dx_shared"),
    ("shared_shape", ValueError, "dx_shared"),
    ("shared_strided", ValueError, "dx_shared"),
    ("add_bf16", TypeError, "dx_add"),
    ("add_shape", ValueError, "dx_add"),
    ("add_strided", ValueError, "dx_add"),
])
def test_host_tokens_validated_before_launch(monkeypatch, change, exc, match):
    """Every bad tokens entry raises, naming it, before anything is compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    order, idx, dxs, dxa = _tokens()
    tok = dict(order=order, idx=idx, dxs=dxs, dxa=dxa)
    edits = {
        "order_float": dict(order=order.float()),
        "order_short": dict(order=order[:199]),
        "idx_1d": dict(idx=idx.reshape(-1)),
        "idx_float": dict(idx=idx.float()),
        "idx_k0": dict(idx=idx[:, :0]),
        "shared_float": dict(dxs=dxs.float()),
        "shared_shape": dict(dxs=dxs[:89]),
        "shared_strided": dict(dxs=torch.zeros(90, 512, dtype=torch.bfloat16)[:, :256]),
        "add_bf16": dict(dxa=dxa.bfloat16()),
        "add_shape": dict(dxa=dxa[:, :128]),
        "add_strided": dict(dxa=torch.zeros(90, 512)[:, ::2]),
    }
    tokens = (order, idx)
    if change != "not_tuple":
        tok.update(edits[change])
        tokens = (tok["order"], tok["idx"], tok["dxs"], tok["dxa"])
    with pytest.raises(exc, match=match):
        core(fb, ops, tokens=tokens)
    assert not fake.calls and not keys


# ---------------------------------------------------------------- the MXFP8 variant (mx)
MX_REGISTERS = 255  # 0 spills; D2's two dgu quantizations (token-wise: warp shuffles) raise the epilogue's demand
MX_NEEDED = tuple(i for i in NEEDED if i != "kind::f16") + (
    "kind::mxf8f6f4", "block_scale", "tcgen05.cp", "cvt.rn.satfinite.e4m3x2.f32", "max.u16x2", "shfl.sync.bfly",
    "shfl.sync.idx")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp, tokens", [(True, False), (False, True)])
def test_mx_variant_compiles_with_its_protocol(arch, clamp, tokens):
    """Block-scaled tcgen05 MMAs (no kind::f16), scale k-tiles to TMEM, D2's in-epilogue dgu
    quantizations; the same counters and atomics as BF16; one CUtensorMap per operand and scale
    tensor: D2 dy, w_down + 2 scales, D1 dg, w_gate + 2 scales + du, w_up, dWd dy, h + 2, dWg dg, x
    + 2, dWu du + its scales; no spills."""
    rep, bf16 = _rep(arch, clamp, tokens, False, False, True), _rep(arch, clamp, tokens)
    missing = [i for i in MX_NEEDED if not rep.has(i)]
    assert not missing, missing
    assert "kind::f16" not in rep.ptx and "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers and rep.total_spill_bytes == 0
    assert rep.max_registers <= MX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 20
    for i in ("atom.global.release.add.u32", "ld.acquire", "atom.global.add.u32", "cas.b32"):
        assert rep.ptx.count(i) == bf16.ptx.count(i), i


@pytest.mark.parametrize("arch", ARCHS)
def test_mx_tokens_grouped_variant(arch):
    """The MXFP8 tokens variant with the dx rows over dy (``grouped_slots``): no spills, the same MMAs
    and counters as the slot-buffer variant, other code (D1's plain rows, the slot sum's row lookup);
    refused without mx or with the gather."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    rep, scatter = _rep(arch, False, True, False, False, True, grouped=True), _rep(arch, False, True, False, False, True)
    assert rep.registers and rep.total_spill_bytes == 0 and rep.ptx != scatter.ptx
    for i in ("tcgen05.mma", "atom.global.release.add.u32", "ld.acquire", "add.rn.f32"):
        assert rep.ptx.count(i) == scatter.ptx.count(i), i
    for bad in (dict(mx=False), dict(mx=True, gather=True, by_route=True)):
        with pytest.raises(ValueError, match="grouped_slots"):
            fb.BwdVariant(True, tokens=True, grouped_slots=True, **bad)


def test_host_mx_tokens_consumed_writes_dx_over_dy(monkeypatch, ref_quant):  # noqa: F811
    """fused_backward_core(tokens=, w_scales=, consume=True) (the layer's one-shot MXFP8 backward): the
    grouped_slots variant with the caller's dy as the D1 rows and the inverse order as mOrder; without
    consume a fresh [T*k, H] slot buffer and the order itself."""
    import torch

    from mok_cute.kernels.sm90.fused_bwd import grouped_rows

    fb, fake, keys = _fake_device(monkeypatch)
    ops, _ = _mx_operands(monkeypatch)
    order, idx, dxs, _ = _tokens(shared=True, add=False)
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    for consume in (True, False):
        core(fb, ops, tokens=(order, idx, dxs), consume=consume)
        by = by_name(fake.calls[-1], keep=True)
        v = keys[-1][2]
        assert v.grouped_slots is consume and v.mx is True and (v.tile_m, v.bulk_push) == (128, False)
        assert by["mDy"].dtype == torch.float8_e4m3fn  # no tile reads the bf16 dy: its rows are free
        if consume:
            assert by["mDx"] is ops["dy"]
            assert torch.equal(by["mOrder"], grouped_rows(order[:200].int(), 270))
        else:
            assert tuple(by["mDx"].shape) == (270, 256) and by["mDx"].data_ptr() != ops["dy"].data_ptr()
            assert torch.equal(by["mOrder"], order[:200].int())


def _mx_operands(monkeypatch):
    """``_operands()`` with the weights MXFP8-quantized along their rows' K as the unfused MXFP8
    backward reads them (``layers.sm100.quantize_weight(w, 1)``; the reference quantizer)."""
    from mok_cute import reference as R
    from mok_cute.kernels.quant import quantize
    from mok_cute.layers import sm100 as S

    monkeypatch.setattr(quantize, "quantize_mxfp8", R.mxfp8_quantize)
    ops = _operands()
    (gq, gs), (uq, us), (dq, ds) = (S.quantize_weight(ops[n], 1) for n in ("w_gate", "w_up", "w_down"))
    return dict(ops, w_gate=gq, w_up=uq, w_down=dq, w_scales=(gs, us, ds)), ops


def test_mx_host_launch_hands_the_unfused_operands(monkeypatch, ref_quant):  # noqa: F811
    """fused_backward_core(w_scales=...) on CPU (compile and launch faked): one argument per kernel
    parameter, the mx cache key, and every operand byte-equal to what ``layers.sm100.mx_backward``
    hands the unfused SM100 MXFP8 GEMMs (their launches / the wgrad calls recorded) on the same
    quantized weights: dy's e4m3 rows and scales, w_down's and [w_gate; w_up]'s blocked scales, dy /
    h / x token rows and token scales; dgu's in-kernel operands shaped and zeroed as theirs."""
    import torch

    from mok_cute.kernels.sm100 import grouped_gemm as k
    from mok_cute.layers import sm100 as S
    from mok_cute.layers.common import ExpertGroup

    fb, fake, keys = _fake_device(monkeypatch)
    ops, bf = _mx_operands(monkeypatch)
    dx, dwg, dwu, dwd = core(fb, ops)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params)
    by = by_name(args, keep=True)
    assert keys == [("sm100_fused_moe_bwd", "sm_100a", fb.BwdVariant(True, mx=True))]
    assert tuple(dx.shape) == (200, 256) and dx.dtype == torch.bfloat16 and tuple(dwd.shape) == (4, 256, 192)

    launched, wgrads = [], []
    monkeypatch.setattr(k, "_launch", lambda *a, **kw: launched.append((a, kw)))
    monkeypatch.setattr(k, "_check_devices", lambda **t: None)

    class Wrappers:  # the unfused wrappers, grouped_wgrad recorded
        grouped_dswiglu_dgrad, grouped_dgrad1 = k.grouped_dswiglu_dgrad, k.grouped_dgrad1

        @staticmethod
        def grouped_wgrad(a, b, offsets, a_scales=None, b_scales=None):
            wgrads.append((a, b, a_scales, b_scales))

    given = {id(w): (w, s) for w, s in zip((ops["w_gate"], ops["w_up"], ops["w_down"]), ops["w_scales"])}
    g = ExpertGroup(bf["x"], bf["offsets"], bf["gu"][:200], bf["h"][:200], "mxfp8")
    S.mx_backward(Wrappers, g, bf["dy"], ops["w_gate"], ops["w_up"], ops["w_down"], 4.0, lambda w, ax: given[id(w)])
    (d2, _), (d1, d1_kw) = launched
    u8 = torch.uint8
    f8 = torch.float8_e4m3fn
    # grouped_gemm._launch(kind, a, w, (a_sf, w_sf), offsets, (out0, out1), limit, n, w2=)
    assert torch.equal(by["mDy"].view(u8), d2[1].view(u8)) and by["mWd"] is d2[2] is ops["w_down"]
    assert torch.equal(by["mDysf"], d2[3][0]) and torch.equal(by["mWdsf"], d2[3][1])
    assert torch.equal(by["mGU"], d2[5][1]) and torch.equal(by["mGU"], bf["gu"][:200].view(200, 2, 192))
    assert by["mWg"] is d1[2] and by["mWu"] is d1_kw["w2"] and torch.equal(by["mWgusf"], d1[3][1])
    assert by["mDgu"].dtype == f8 and by["mDgu"].shape == d1[1].shape  # written by D2 (along I)
    assert by["mDgusf"].shape == d1[3][0].shape and not by["mDgusf"].any()  # zeroed: the padding stays 0
    (wd_a, wd_b, wd_as, wd_bs), (wg_a, wg_b, wg_as, wg_bs), (wu_a, wu_b, wu_as, wu_bs) = wgrads
    assert torch.equal(by["mDyt"].view(u8), wd_a.view(u8)) and torch.equal(by["mH"].view(u8), wd_b.view(u8))
    assert torch.equal(by["mDytsf"], wd_as) and torch.equal(by["mHtsf"], wd_bs)
    assert torch.equal(by["mX"].view(u8), wg_b.view(u8)) and wg_b is wu_b
    assert torch.equal(by["mXtsf"], wg_bs) and torch.equal(by["mXtsf"], wu_bs)
    assert by["mDgut"].dtype == f8 and by["mDgut"][:, 0].shape == wg_a.shape == wu_a.shape  # written by D2
    for name, want in (("mDgtsf", wg_as), ("mDutsf", wu_as)):
        assert by[name].shape == want.shape and not by[name].any(), name


def test_mx_dgu_scale_placement_is_the_unfused_layout():
    """D2's dgu scale stores modelled in torch with the index calls the epilogue makes
    (``layouts.sf_byte``, ``GroupedGemmSm100._store_dgu_mx``): the row scales (tile row r, chunk c
    of n-tile nt, half j) are the unfused dgrad1's ``pack_row_scales(pad_k_parts(...))`` operand and
    the token scales (warp w's block, lane l's feature) the unfused wgrads'
    ``pack_token_scales_device`` operands, byte for byte over every expert's atoms. I = 320:
    partial scale atoms and a partial last n-tile; an empty expert, a one-row expert."""
    import torch

    from mok_cute.kernels.sm100 import layouts as lay

    g = torch.Generator().manual_seed(7)
    offs, inter, tile_n = [0, 130, 130, 300, 301], 320, 256
    e, m = len(offs) - 1, offs[-1]
    kb_i = inter // 32
    rs = torch.randint(0, 255, (m, 2 * kb_i), dtype=torch.uint8, generator=g)  # dgu's row scales (quantizer's)
    ts = torch.randint(0, 255, (m // 32 + e, 2 * inter), dtype=torch.uint8, generator=g)  # its token scales
    half_atoms = -(-inter // 128)
    t_atoms = -(-m // 128) + e
    row_sf = torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(m, e), 2 * 4 * half_atoms), dtype=torch.uint8)
    tok_sf = [torch.zeros(lay.sf_bytes(inter, lay.grouped_sf_rows(m, e) // 32), dtype=torch.uint8) for _ in "gu"]
    for ex in range(e):
        for mt in range(-(-(offs[ex + 1] - offs[ex]) // 128)):
            row0, rows = offs[ex] + 128 * mt, min(128, offs[ex + 1] - offs[ex] - 128 * mt)
            sf_row = offs[ex] // 128 + ex + mt
            for nt in range(-(-inter // tile_n)):
                for c in range(min(inter - nt * tile_n, tile_n) // 32):  # live chunks
                    for j in range(2):
                        blk = nt * (tile_n // 32) + c
                        for r in range(rows):
                            row_sf[lay.sf_byte(sf_row, r, j * half_atoms * 4 + blk, 2 * half_atoms)] = rs[row0 + r,
                                                                                                         j * kb_i + blk]
                        for w in range(4):
                            if 32 * w >= rows:
                                continue
                            slot = offs[ex] // 32 + ex + 4 * mt + w  # quantize_tokens' block slot
                            for lane in range(32):
                                n = nt * tile_n + c * 32 + lane
                                tok_sf[j][lay.sf_byte(n // 128, n % 128, 4 * sf_row + w, t_atoms)] = \
                                    ts[slot, j * inter + n]
    offsets = torch.tensor(offs)
    want = lay.pack_row_scales(lay.pad_k_parts(rs.chunk(2, 1), 1), offsets)
    used = (m // 128 + e) * 2 * half_atoms * lay.SF_ATOM_BYTES  # every expert's atom rows (past them: never read)
    assert row_sf.shape == want.shape and torch.equal(row_sf[:used], want[:used])
    for j in range(2):
        assert torch.equal(tok_sf[j], lay.pack_token_scales_device(ts[:, j * inter:(j + 1) * inter], offsets, m)), j


@pytest.mark.parametrize("tile_m", [128, 256])
def test_mx_gather_scale_placement_is_the_unfused_layout(tile_m):
    """The MXFP8 gather's scale stores (``mx_gather.quantize_tile``) modelled in torch with its index
    calls: per m-tile the atom row ``o_e // 128 + e + m_tile * tile_m / 128``, dy's row scales at (atom
    row + tile row // 128, tile row % 128, block) over ``ceil(H / 128)`` atoms, the token scales of
    feature n and the tile's block b at (n // 128, n % 128, 4 atom row + b) over ``ceil(M / 128) + E``
    atoms: byte for byte the unfused ``pack_row_scales`` / ``pack_token_scales_device`` operands.
    H = 320 (partial atoms), M past the experts' rows (routes without an expert), an empty and a
    one-row expert; ``tile_m`` 256: the CTA pairs' m-tiles."""
    import torch

    from mok_cute.kernels.sm100 import layouts as lay

    g = torch.Generator().manual_seed(8)
    offs, hid, m = [0, 130, 130, 300, 301], 320, 320
    e, hc = len(offs) - 1, 320 // 8
    rs = torch.randint(0, 255, (m, hid // 32), dtype=torch.uint8, generator=g)  # the row quantizer's scales
    ts = torch.randint(0, 255, (m // 32 + e, hid), dtype=torch.uint8, generator=g)  # quantize_tokens' scales
    h_atoms = (hc + 15) // 16
    t_atoms = (m + 127) // 128 + e
    row_sf = torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(m, e), hid // 32), dtype=torch.uint8)
    tok_sf = torch.zeros(lay.sf_bytes(hid, lay.grouped_sf_rows(m, e) // 32), dtype=torch.uint8)
    per = tile_m // 128
    for ex in range(e):
        for mt in range(-(-(offs[ex + 1] - offs[ex]) // tile_m)):
            row0, rows = offs[ex] + tile_m * mt, min(tile_m, offs[ex + 1] - offs[ex] - tile_m * mt)
            atom_row = offs[ex] // 128 + ex + mt * per
            for r in range(rows):  # _row_blocks: lane c % 4 == 0 stores block c // 4
                for c in range(0, hc, 4):
                    row_sf[lay.sf_byte(atom_row + r // 128, r % 128, c // 4, h_atoms)] = rs[row0 + r, c // 4]
            for b in range(tile_m // 32):  # _token_blocks: (block b, chunk c), column n = 8 c + i
                if row0 + 32 * b >= row0 + rows:
                    continue
                slot = offs[ex] // 32 + ex + (tile_m // 32) * mt + b  # quantize_tokens' block slot
                for n in range(hid):
                    tok_sf[lay.sf_byte(n // 128, n % 128, 4 * atom_row + b, t_atoms)] = ts[slot, n]
    offsets = torch.tensor(offs)
    want = lay.pack_row_scales(rs, offsets)
    used = (offs[-1] // 128 + e) * h_atoms * lay.SF_ATOM_BYTES  # every expert's atom rows (past them: never read)
    assert m > offs[-1] and row_sf.shape == want.shape and torch.equal(row_sf[:used], want[:used])
    assert torch.equal(tok_sf, lay.pack_token_scales_device(ts, offsets, m))


@pytest.mark.parametrize("change, exc, match", [
    ("bf16_weights", TypeError, "w_gate"),
    ("no_scales", TypeError, "w_gate"),
    ("scales_len", ValueError, "w_scales must be"),
    ("scale_shape", ValueError, r"w_scales\[2\]"),
    ("scale_dtype", TypeError, r"w_scales\[0\]"),
    ("up_scale_shape", ValueError, r"w_scales\[1\]"),
    ("w_down_fp8_bf16", TypeError, "w_down"),
    ("scales_device", ValueError, "w_scales"),
])
def test_mx_host_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad MXFP8 operand raises before anything is quantized, compiled or launched."""
    from mok_cute.kernels.quant import quantize

    fb, fake, keys = _fake_device(monkeypatch)
    ops, bf = _mx_operands(monkeypatch)
    monkeypatch.setattr(quantize, "quantize_mxfp8", lambda *a: pytest.fail("quantized before validation"))
    gs, us, ds = ops["w_scales"]
    edits = {
        "bf16_weights": dict(w_gate=bf["w_gate"], w_up=bf["w_up"], w_down=bf["w_down"]),
        "no_scales": dict(w_scales=None),
        "scales_len": dict(w_scales=(gs, us)),
        "scale_shape": dict(w_scales=(gs, us, ds[:, :, :5])),
        "scale_dtype": dict(w_scales=(gs.int(), us, ds)),
        "up_scale_shape": dict(w_scales=(gs, us[:, :3], ds)),
        "w_down_fp8_bf16": dict(w_down=bf["w_down"]),
        "scales_device": dict(w_scales=(gs, us, ds.to("meta"))),
    }
    ops.update(edits[change])
    with pytest.raises(exc, match=match):
        core(fb, ops)
    assert not fake.calls and not keys


# ---------------------------------------------------------------- the gather / shared variants (mode 3)
GATHER_VARIANTS = [(True, False), (False, True)]  # (clamp, shared)
ROUTE_ROW_PTX = ("mul.rn.f32", "fma.rn.f32", "shfl.sync.bfly")  # route_row: dy * w, dy . r, its butterfly


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp, shared", GATHER_VARIANTS)
def test_gather_variant_compiles_with_its_protocol(arch, clamp, shared):
    """The tokens variant's protocol plus the comm CTAs' rows: route_row's single-rounded products /
    FMAs and butterfly, a release add per gathered pass (gdy), the D2 / W tiles' bounded waits on it;
    the shared group: its own descriptors (11 more), the same tcgen05.mma count as the routed group
    and its own d2 / done publishes; no spills."""
    rep, toks = _rep(arch, clamp, True, shared, False, False, True, shared), _rep(arch, clamp, True)
    missing = [i for i in NEEDED + ("add.rn.f32", "cp.async.cg", "bar.sync") + ROUTE_ROW_PTX if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers and rep.total_spill_bytes == 0, rep.log[-2000:]
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    groups = 2 if shared else 1
    assert rep.ptx.count("tcgen05.mma") == groups * toks.ptx.count("tcgen05.mma")
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 11 * groups
    # d2[mt] and done per group, gdy once per gather pass (dy rows, then x rows)
    assert rep.ptx.count("atom.global.release.add.u32") == 2 * groups + 2
    assert rep.ptx.count("ld.acquire") > toks.ptx.count("ld.acquire")  # the gdy waits
    ops = re.findall(r"\b(?:atom|red)\.global\.(\S+)", rep.ptx)
    assert sorted(set(ops)) == ["add.u32", "cas.b32", "release.add.u32"] and ops.count("add.u32") == 2, ops
    assert "mul.rn.f32" not in toks.ptx and "shfl.sync.bfly" not in toks.ptx


@pytest.mark.parametrize("arch, ep, acc", [("sm_100a", False, False), ("sm_100a", True, False),
                                           ("sm_103a", False, False), ("sm_100a", False, True)])
def test_mx_gather_variant_compiles_with_its_quantizers(arch, ep, acc):
    """The MXFP8 whole backward (``mx`` + ``gather``; EP > 1 too): the mx tokens variant's tiles (same
    tcgen05.mma count) plus the comm CTAs' quantizers, per gathered m-tile: 4 e4m3 conversions of a
    row chunk along H, 2 x 8 (two passes, the column loop unrolled twice) along the tokens; one byte
    store of a row scale and 2 x 8 of token scales; e4m3 word pairs; the gather's release adds; no
    spills; ``acc`` (main_grads, the layer's MXFP8 mode 3): the W stores' 3 x 256 adds more. (The
    registry's two variants and the mx tokens variant: compiled once for every test.)"""
    mx_tok = _rep(arch, False, True, False, False, True)
    rep = _rep(arch, not ep, True, True, False, True, True, False, ep, acc)
    if acc:
        assert rep.ptx.count("add.rn.f32") == _rep(arch, True, True, True, False, True, True).ptx.count("add.rn.f32") \
            + 3 * 256
    assert rep.total_spill_bytes == 0, rep.log[-2000:]
    assert rep.ptx.count("tcgen05.mma") == mx_tok.ptx.count("tcgen05.mma")
    cvt = "cvt.rn.satfinite.e4m3x2.f32"
    assert rep.ptx.count(cvt) == mx_tok.ptx.count(cvt) + 4 + 16
    assert rep.ptx.count("st.global.b8") == mx_tok.ptx.count("st.global.b8") + 1 + 16
    assert rep.ptx.count("st.global.v2.b32") >= 1 + 4 and "st.global.v2.b32" not in mx_tok.ptx
    assert rep.ptx.count("atom.global.release.add.u32") == mx_tok.ptx.count("atom.global.release.add.u32") + 2
    assert all(rep.has(i) for i in ROUTE_ROW_PTX + ("kind::mxf8f6f4", "block_scale"))


def test_gather_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    for kw in (dict(gather=True), dict(tokens=True, by_route=True), dict(tokens=True, shared=True, init=True),
               dict(tokens=True, gather=True, shared=True), dict(tokens=True, gather=True, init=True, shared=True,
                                                                 mx=True)):
        with pytest.raises(ValueError, match="need|mx"):
            fb.BwdVariant(True, **kw)


def _gather_operands(t=90, k=3, h=256, inter=192, e=4, i_s=128, shared=True, seed=3):
    """fused_backward's operands on CPU: T tokens routed to k slots (-1 slots last in order)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    idx = torch.randint(0, e, (t, k), generator=g)
    idx[idx == 2] = -1  # expert 2 gets no row, some routes no expert
    flat = idx.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    order = torch.cat([valid[torch.argsort(flat[valid], stable=True)], (flat < 0).nonzero().squeeze(1)])
    counts = torch.bincount(flat[valid], minlength=e)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int()
    ops = dict(dy=torch.randn(t, h, generator=g).to(bf), x=torch.randn(t, h, generator=g).to(bf),
               r_rows=torch.randn(t * k, h, generator=g).to(bf), order=order, topk_w=torch.rand(t, k, generator=g),
               topk_idx=idx, offsets=offsets, gu=torch.randn(t * k, 2 * inter, generator=g).to(bf),
               h=torch.randn(t * k, inter, generator=g).to(bf), w_gate=torch.randn(e, inter, h, generator=g).to(bf),
               w_up=torch.randn(e, inter, h, generator=g).to(bf), w_down=torch.randn(e, h, inter, generator=g).to(bf),
               limit=4.0, dx_shared=None, rows_by_route=True, comm_ctas=12, timeout_s=1.0)
    if shared:
        ops["shared"] = (torch.tensor([0, t], dtype=torch.int32), torch.randn(t, 2 * i_s, generator=g).to(bf),
                         torch.randn(t, i_s, generator=g).to(bf), torch.randn(i_s, h, generator=g).to(bf),
                         torch.randn(i_s, h, generator=g).to(bf), torch.randn(h, i_s, generator=g).to(bf))
    return ops


@pytest.mark.parametrize("shared", [True, False])
def test_host_gather_launch_matches_the_kernel_signature(monkeypatch, shared):
    """fused_backward on CPU tensors (compile and launch faked): one argument per kernel parameter,
    the variant's cache key, the token operands handed as the gather's sources (dy, x, the GEMM2 rows,
    topk_w flat; d topk_w the returned [T, k]), the grouped dy / x rows [T*k, H] the tiles read, the
    whole order, the gdy / shared d2 counters zeroed after the words, the shared group's tensors (its
    dx the slot sum's init) and the comm CTAs clamped below the grid."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _gather_operands(shared=shared)
    out = whole(fb, ops)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    by = by_name(args, keep=True)
    assert keys == [("sm100_fused_moe_bwd", "sm_100a",
                     fb.BwdVariant(True, True, shared, False, False, True, True, shared))]
    assert len(out) == 5 + 3 * shared
    dx, dtw, dwg, dwu, dwd = out[:5]
    assert tuple(dx.shape) == (90, 256) and by["mOut"] is dx and dtw.dtype == torch.float32
    assert tuple(dtw.shape) == (90, 3) and by["mDtw"].data_ptr() == dtw.data_ptr() and by["mDtw"].shape == (270,)
    assert by["mDyTok"] is ops["dy"] and by["mXTok"] is ops["x"] and by["mR"] is ops["r_rows"]
    assert torch.equal(by["mW"], ops["topk_w"].reshape(-1))
    assert tuple(by["mDy"].shape) == tuple(by["mX"].shape) == (270, 256) and by["mDy"].dtype == torch.bfloat16
    assert tuple(by["mDx"].shape) == (270, 256)  # the slot rows
    assert by["mOrder"].dtype == torch.int32 and torch.equal(by["mOrder"], ops["order"].int())
    assert torch.equal(by["mIdx"], ops["topk_idx"].reshape(-1).int())
    assert torch.equal(by["mGU"], ops["gu"].view(270, 2, 192)) and by["mWd"] is ops["w_down"]
    assert by["mDWg"] is dwg and by["mDWu"] is dwu and by["mDWd"] is dwd and by["mAdd"] is None
    mt_cap = 270 // 128 + 4 + 1
    d2, words, gdy = by["mD2"], by["mWords"], by["mGdy"]
    assert d2.shape == (mt_cap,) and words.shape == (fb.DONE_WORD + 1,) and gdy.shape == (mt_cap,)
    assert words.data_ptr() == d2.data_ptr() + mt_cap * 4 and gdy.data_ptr() == words.data_ptr() + words.numel() * 4
    assert not d2.any() and not words.any() and not gdy.any()
    assert int(by["k"]) == 3 and int(by["comm_ctas"]) == 12 and int(by["num_ctas"]) == 148
    assert all(by[n] is None for n in MX_PARAMS)
    names = ("mSGU", "mSH", "mSWg", "mSWu", "mSWd", "mSDgu", "mSDWg", "mSDWu", "mSDWd", "mSOffsets", "mSD2")
    if not shared:
        assert by["mInit"] is None and all(by[n] is None for n in names)
    else:
        offs, gus, hs, wsg, wsu, wsd = ops["shared"]
        assert tuple(by["mInit"].shape) == (90, 256)  # the shared expert's dx, made in the launch
        assert torch.equal(by["mSGU"], gus.view(90, 2, 128)) and by["mSH"] is hs and by["mSOffsets"] is offs
        assert by["mSWg"].shape == (1, 128, 256) and by["mSWg"].data_ptr() == wsg.data_ptr()
        assert by["mSWu"].data_ptr() == wsu.data_ptr() and by["mSWd"].data_ptr() == wsd.data_ptr()
        assert tuple(by["mSDgu"].shape) == (90, 2, 128)
        assert [by[n].data_ptr() for n in ("mSDWg", "mSDWu", "mSDWd")] == [d.data_ptr() for d in out[5:]]
        assert tuple(out[5].shape) == tuple(out[6].shape) == (128, 256) and tuple(out[7].shape) == (256, 128)
        assert by["mSD2"].shape == (90 // 128 + 2,) and not by["mSD2"].any()
        assert by["mSD2"].data_ptr() == gdy.data_ptr() + gdy.numel() * 4
    whole(fb, dict(ops, comm_ctas=500, num_ctas=20))
    assert int(by_name(fake.calls[1])["comm_ctas"]) == 19  # one GEMM CTA remains


def test_host_gather_dx_shared_is_the_init(monkeypatch):
    """Without the shared group a given dx_shared starts the slot sum (the init variant)."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    dxs = torch.randn(90, 256).bfloat16()
    whole(fb, dict(_gather_operands(shared=False), dx_shared=dxs, rows_by_route=False))
    by = by_name(fake.calls[0])
    assert by["mInit"]._keep is dxs
    assert keys == [("sm100_fused_moe_bwd", "sm_100a", fb.BwdVariant(True, True, True, False, False, True, False))]


def test_host_gather_no_tokens(monkeypatch):
    """T = 0: empty dx and d topk_w, zero weight gradients (the shared expert's too), no launch."""
    fb, fake, keys = _fake_device(monkeypatch)
    ops = _gather_operands()
    offs, gus, hs, *w = ops["shared"]
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], r_rows=ops["r_rows"][:0], order=ops["order"][:0],
               topk_w=ops["topk_w"][:0], topk_idx=ops["topk_idx"][:0], shared=(offs, gus[:0], hs[:0], *w))
    out = whole(fb, ops)
    assert tuple(out[0].shape) == (0, 256) and tuple(out[1].shape) == (0, 3) and not fake.calls and not keys
    assert all(not d.any() for d in out[2:]) and len(out) == 8


def test_host_mx_gather_hands_buffers_for_the_launch_to_fill(monkeypatch, ref_quant):  # noqa: F811
    """fused_backward(w_scales=...) on CPU (compile and launch faked): the mx gather variant's key; the
    gather's bf16 rows as ``mDyRows`` / ``mXRows``; the tiles' dy / x operands e4m3 buffers the comm
    CTAs fill (x's token rows and every scale they write zeroed, as the host quantizers leave what no
    tile covers); h's token rows and scales, the weights' scales and dgu's buffers as the unfused MXFP8
    backward's; dx_shared the slot sum's start; with the shared expert in the launch: ValueError."""
    import torch

    from mok_cute.kernels.sm100 import layouts as lay

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _gather_operands(shared=False)
    g = torch.Generator().manual_seed(9)
    e, inter, hid = ops["w_gate"].shape[0], ops["w_gate"].shape[1], ops["dy"].shape[1]
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    for name in ("w_gate", "w_up", "w_down"):
        ops[name] = ops[name].to(f8)
    scales = (torch.randint(0, 255, (e, inter // 32, hid), dtype=u8, generator=g),
              torch.randint(0, 255, (e, inter // 32, hid), dtype=u8, generator=g),
              torch.randint(0, 255, (e, hid // 32, inter), dtype=u8, generator=g))
    dxs = torch.randn(90, hid).bfloat16()
    out = whole(fb, dict(ops, dx_shared=dxs), w_scales=scales)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    by = by_name(args, keep=True)
    assert len(args) == len(params) and len(out) == 5
    assert keys == [("sm100_fused_moe_bwd", "sm_100a", fb.BwdVariant(True, True, True, False, True, True, True))]
    m = 270
    tok_kb = lay.grouped_sf_rows(m, e) // 32
    assert by["mInit"] is dxs and by["mDyTok"] is ops["dy"] and by["mXTok"] is ops["x"]
    for name in ("mDyRows", "mXRows"):
        assert by[name].dtype == torch.bfloat16 and tuple(by[name].shape) == (m, hid), name
    for name in ("mDy", "mX", "mDyt"):
        assert by[name].dtype == f8 and tuple(by[name].shape) == (m, hid), name
    assert not by["mX"].view(u8).any() and not by["mDyt"].view(u8).any()
    zeroed = {"mDysf": lay.sf_bytes(lay.grouped_sf_rows(m, e), hid // 32), "mDytsf": lay.sf_bytes(hid, tok_kb),
              "mXtsf": lay.sf_bytes(hid, tok_kb)}
    for name, size in zeroed.items():
        assert by[name].shape == (size,) and not by[name].any(), name
    h_t = lay.TokenOperand(ops["h"][:m], ops["offsets"])
    assert torch.equal(by["mH"].view(u8), h_t.data.view(u8)) and torch.equal(by["mHtsf"], h_t.scales())
    assert torch.equal(by["mWdsf"], lay.pack_kn_weight_scales(scales[2]))
    assert torch.equal(by["mWgusf"], lay.pack_kn_weight_scales(*scales[:2]))
    assert by["mDgu"].dtype == f8 and by["mDgut"].dtype == f8 and not by["mDgusf"].any()
    assert all(by[n] is None for n in ("mSGU", "mSDWg", "mSOffsets"))
    bad = dict(_gather_operands(shared=True), **{n: ops[n] for n in ("w_gate", "w_up", "w_down")})
    with pytest.raises(ValueError, match="w_scales"):
        whole(fb, bad, w_scales=scales)
    assert len(fake.calls) == 1


@pytest.mark.parametrize("change, exc, match", [
    ("idx_float", TypeError, "topk_idx"),
    ("dy_tokens", ValueError, "dy"),
    ("gu_rows", ValueError, "gu"),
    ("order_short", ValueError, "order"),
    ("r_rows_shape", ValueError, "r_rows"),
    ("r_rows_float", TypeError, "r_rows"),
    ("topk_w_bf16", TypeError, "topk_w"),
    ("topk_w_shape", ValueError, "topk_w"),
    ("by_route", TypeError, "rows_by_route"),
    ("comm", ValueError, "comm_ctas"),
    ("dx_shared_and_shared", ValueError, "dx_shared"),
    ("shared_len", ValueError, "shared must be"),
    ("shared_offsets", ValueError, "offsets_s"),
    ("shared_inter", ValueError, "ws_gate"),
    ("shared_down", ValueError, "ws_down"),
    ("shared_gu", ValueError, "gu_s"),
    ("shared_h_float", TypeError, "h_s"),
    ("limit", ValueError, "limit"),
    ("device", ValueError, "topk_w"),
    ("arch", ValueError, "sm_100a / sm_103a"),
    ("main_grads_len", TypeError, "main_grads must be a tuple of 6"),
    ("main_grads_bf16", TypeError, r"main_grads\[1\] \(w_up\)"),
    ("main_grads_shape", ValueError, r"main_grads\[2\] \(w_down\)"),
    ("main_grads_strided", ValueError, r"main_grads\[5\] \(ws_down\)"),
])
def test_host_gather_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad fused_backward operand raises, naming it, before anything is compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch, "sm_90a" if change == "arch" else "sm_100a")
    ops = _gather_operands()
    offs, gus, hs, wsg, wsu, wsd = ops["shared"]
    bf = torch.bfloat16
    edits = {
        "idx_float": dict(topk_idx=ops["topk_idx"].float()),
        "dy_tokens": dict(dy=ops["dy"][:89], x=ops["x"][:89]),
        "gu_rows": dict(gu=ops["gu"][:269]),
        "order_short": dict(order=ops["order"][:269]),
        "r_rows_shape": dict(r_rows=ops["r_rows"][:200]),
        "r_rows_float": dict(r_rows=ops["r_rows"].float()),
        "topk_w_bf16": dict(topk_w=ops["topk_w"].bfloat16()),
        "topk_w_shape": dict(topk_w=ops["topk_w"][:, :2]),
        "by_route": dict(rows_by_route=1),
        "comm": dict(comm_ctas=0),
        "dx_shared_and_shared": dict(dx_shared=torch.zeros(90, 256, dtype=bf)),
        "shared_len": dict(shared=ops["shared"][:5]),
        "shared_offsets": dict(shared=(offs[:1], gus, hs, wsg, wsu, wsd)),
        "shared_inter": dict(shared=(offs, gus, hs, wsg[:100], wsu, wsd)),
        "shared_down": dict(shared=(offs, gus, hs, wsg, wsu, wsd.t())),
        "shared_gu": dict(shared=(offs, gus[:89], hs, wsg, wsu, wsd)),
        "shared_h_float": dict(shared=(offs, gus, hs.float(), wsg, wsu, wsd)),
        "limit": dict(limit=-1.0),
        "device": dict(topk_w=ops["topk_w"].to("meta")),
        "arch": {},
    }
    main = [torch.zeros(a.shape) for a in (ops["w_gate"], ops["w_up"], ops["w_down"], wsg, wsu, wsd)]
    edits.update({"main_grads_len": dict(main_grads=main[:3]),
                  "main_grads_bf16": dict(main_grads=main[:1] + [main[1].bfloat16()] + main[2:]),
                  "main_grads_shape": dict(main_grads=main[:2] + [main[0]] + main[3:]),
                  "main_grads_strided": dict(main_grads=main[:5] + [torch.zeros(wsd.shape[::-1]).t()])})
    ops.update(edits[change])
    with pytest.raises(exc, match=match):
        whole(fb, ops)
    assert not fake.calls and (change == "arch" or not keys)


# ---------------------------------------------------------------- main grads (accumulate)
@pytest.mark.parametrize("arch", ARCHS)
def test_main_grads_variant_compiles_with_its_adds(arch):
    """``accumulate``: each weight-gradient tile read-add-written into fp32 main grads: 3 x tile_n more
    single-rounded adds per group (a thread's row of dWg, dWu, dWd tiles), the same MMAs, waits and
    counters as the bf16 variant, no atomics on the main grads, no spills."""
    base, rep = (_rep(arch, False, True, True, False, False, True, True, False, acc) for acc in (False, True))
    assert rep.total_spill_bytes == 0 and rep.max_registers <= MAX_REGISTERS, rep.log[-2000:]
    assert rep.ptx.count("add.rn.f32") == base.ptx.count("add.rn.f32") + 2 * 3 * 256
    for same in ("tcgen05.mma", "ld.acquire", "atom.global"):
        assert rep.ptx.count(same) == base.ptx.count(same), same
    assert not re.search(r"\b(?:atom|red)\.global(?:\.\w+)*\.f32", rep.ptx)


def test_accumulate_needs_gather():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    with pytest.raises(ValueError, match="accumulate"):
        fb.BwdVariant(True, tokens=True, accumulate=True)


@pytest.mark.parametrize("shared", [True, False])
def test_host_main_grads_are_the_weight_gradient_operands(monkeypatch, shared):
    """fused_backward(main_grads=...): the accumulate variant's key, the main grads handed as the
    kernel's dW operands (the shared expert's as [1, ...] views of its three), every weight gradient
    returned as None; T = 0: nothing launched, the main grads unchanged."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _gather_operands(shared=shared)
    ws = [ops["w_gate"], ops["w_up"], ops["w_down"]] + (list(ops["shared"][3:]) if shared else [])
    main = [torch.randn(w.shape) for w in ws]
    start = [m.clone() for m in main]
    out = whole(fb, ops, main_grads=main)
    (args,) = fake.calls
    by = by_name(args)
    assert keys == [("sm100_fused_moe_bwd", "sm_100a",
                     fb.BwdVariant(True, True, shared, False, False, True, True, shared, accumulate=True))]
    assert len(out) == 5 + 3 * shared and all(d is None for d in out[2:])
    names = ("mDWg", "mDWu", "mDWd") + (("mSDWg", "mSDWu", "mSDWd") if shared else ())
    for n, m in zip(names, main):
        a = getattr(by[n], "_keep", by[n])
        assert a.dtype == torch.float32 and a.data_ptr() == m.data_ptr() and a.numel() == m.numel(), n
    offs, gus, hs, *w = ops["shared"] if shared else (None,) * 6
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], r_rows=ops["r_rows"][:0], order=ops["order"][:0],
               topk_w=ops["topk_w"][:0], topk_idx=ops["topk_idx"][:0])
    if shared:
        ops["shared"] = (offs, gus[:0], hs[:0], *w)
    out = whole(fb, ops, main_grads=main)
    assert len(fake.calls) == 1 and all(d is None for d in out[2:])
    assert all(torch.equal(m, s) for m, s in zip(main, start))


# ---------------------------------------------------------------- the EP > 1 variant (ep: mode 3 across ranks)
EP_PTX = ("st.release.sys", "ld.acquire.sys", "fence.acq_rel.sys")  # the pull / push signals, waits, fences


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp, shared", GATHER_VARIANTS)
def test_ep_variant_compiles_with_its_protocol(arch, clamp, shared):
    """The EP > 1 whole backward (dy / x rows pulled from the peers' workspaces, dgrad1 rows pushed to
    them, the slot sum after every rank's DATA): the gather variant's GEMM code (tcgen05.mma count,
    descriptors), route_row's products / sums, the protocol's system-scope signals, waits and fences
    (signals and fences absent at EP = 1); no spills."""
    rep, local = _rep(arch, clamp, True, shared, False, False, True, shared, True), \
        _rep(arch, clamp, True, shared, False, False, True, shared)
    missing = [i for i in NEEDED + ("add.rn.f32", "cp.async.cg") + ROUTE_ROW_PTX + EP_PTX if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers and rep.total_spill_bytes == 0, rep.log[-2000:]
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    assert rep.ptx.count("tcgen05.mma") == local.ptx.count("tcgen05.mma")
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 11 * (2 if shared else 1)
    assert "st.release.sys" not in local.ptx and "fence.acq_rel.sys" not in local.ptx
    assert rep.ptx.count("ld.acquire.sys") > local.ptx.count("ld.acquire.sys")  # + the flag waits


def test_ep_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    for kw in (dict(tokens=True, ep=True), dict(tokens=True, gather=True, by_route=True, ep=True)):
        with pytest.raises(ValueError, match="ep"):
            fb.BwdVariant(True, **kw)


def _ep_operands(t=64, h=256, inter=128, e=2, k=2, i_s=128, shared=True, seed=5):
    """fused_backward_ep's operands on CPU: a FakeWorkspace (rank 1 of 2), a plan with M = EP * T * k
    receive rows (packed sources, local expert offsets), this rank's slot rows and the grouped rows'
    router weights."""
    from types import SimpleNamespace

    import torch

    from conftest import FakeWorkspace

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    m = 2 * t * k
    rn = lambda *s: torch.randn(*s, generator=g).to(bf)  # noqa: E731
    plan = SimpleNamespace(recv_src=torch.randperm(m, generator=g).int(),
                           offsets=torch.tensor([0, 90, 200], dtype=torch.int32))
    ops = dict(ws=FakeWorkspace(t, h, k), plan=plan, dy=rn(t, h), x=rn(t, h), slot_rows=rn(t * k, h),
               w_rows=torch.rand(m, generator=g), topk_idx=torch.randint(-1, 2 * e, (t, k), generator=g),
               gu=rn(m, 2 * inter), h=rn(m, inter), w_gate=rn(e, inter, h), w_up=rn(e, inter, h),
               w_down=rn(e, h, inter), limit=4.0, comm_ctas=6, num_ctas=66)
    if shared:
        ops["shared"] = (torch.tensor([0, t], dtype=torch.int32), rn(t, 2 * i_s), rn(t, i_s), rn(i_s, h), rn(i_s, h),
                         rn(h, i_s))
    return ops


@pytest.mark.parametrize("shared", [True, False])
def test_host_ep_launch_matches_the_kernel_signature(monkeypatch, shared):
    """fused_backward_ep on CPU tensors (compile and launch faked): x and dy staged in the workspace's
    src and dy sections, the ep variant launched directly (the epochs change every call) with one
    argument per ``__call__`` parameter: the plan's packed sources as the row order and its local
    offsets, the forward's router weight per grouped row, this rank's slot rows for d topk_w, the
    workspace's slot section as the push target, its status for every wait, its sections' offsets,
    rank and size; the arrival words after the done word; the epochs bumped once per launch."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _ep_operands(shared=shared)
    ws, plan = ops["ws"], ops["plan"]
    out = whole_ep(fb, ops)
    assert not fake.calls and len(fake.direct) == 1
    assert keys == [("sm100_fused_moe_bwd", "sm_100a",
                     fb.BwdVariant(True, True, shared, False, False, True, False, shared, True))]
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    (args,) = fake.direct
    assert len(args) == len(params), (len(args), len(params))
    a = by_name(args, keep=True)
    assert torch.equal(ws._src, ops["x"]) and torch.equal(ws._dy, ops["dy"])
    assert a["mDx"].data_ptr() == ws._slots.data_ptr() and tuple(a["mDx"].shape) == (128, 256)
    assert a["mStatus"] is ws.status and a["mPeer"] is ws.peer_bases
    assert torch.equal(a["mOrder"], plan.recv_src) and a["mOrder"].data_ptr() == plan.recv_src.data_ptr()
    assert a["mOffsets"] is plan.offsets and torch.equal(a["mIdx"], ops["topk_idx"].reshape(-1).int())
    assert a["mW"] is ops["w_rows"] and a["mR"] is ops["slot_rows"]
    assert a["mDyTok"] is ops["dy"] and a["mXTok"] is ops["x"]
    assert tuple(a["mDy"].shape) == tuple(a["mX"].shape) == (256, 256)  # M = EP * T * k grouped rows
    assert torch.equal(a["mGU"], ops["gu"].view(256, 2, 128))
    assert (int(a["epoch_pull"]), int(a["epoch_push"]), int(a["me"]), int(a["n_ranks"])) == (1, 1, 1, 2)
    assert [int(a[n]) for n in ("src_off", "dy_off", "slots_off", "flags_off")] == \
        [ws.offsets[s] for s in fb.EP_SECTIONS] == [ws.offsets[s] for s in ("src", "dy", "slots", "flags")]
    assert (int(a["num_ctas"]), int(a["comm_ctas"]), int(a["k"])) == (66, 6, 2)
    words = a["mWords"]
    assert words.shape == (fb.SUMMED_WORD + 1,) and not words.any() and fb.PULLED_WORD == fb.DONE_WORD + 1
    assert int(a["timeout_ns"]) == int(ws.timeout_s * 1e9)
    assert (a["mInit"] is not None) == shared and a["mAdd"] is None and all(a[n] is None for n in MX_PARAMS)
    dx, dtw = out[:2]
    assert a["mOut"] is dx and tuple(dx.shape) == (64, 256) and a["mDtw"].data_ptr() == dtw.data_ptr()
    assert tuple(dtw.shape) == (64, 2) and len(out) == 5 + 3 * shared
    whole_ep(fb, ops)
    assert ws.epoch == {"pull": 2, "push": 2} and len(fake.direct) == 2
    weights = [ops["w_gate"], ops["w_up"], ops["w_down"]] + (list(ops["shared"][3:]) if shared else [])
    main = [torch.zeros(w.shape) for w in weights]  # main_grads: the accumulate variant on the same protocol
    out = whole_ep(fb, ops, main_grads=main)
    assert keys[-1][2] == replace(keys[0][2], accumulate=True) and all(d is None for d in out[2:])
    a = by_name(fake.direct[-1])
    assert getattr(a["mDWd"], "_keep", a["mDWd"]).data_ptr() == main[2].data_ptr()
    monkeypatch.setenv("MOK_CUTE_SM100_PUSH", "bulk")  # gone: not read
    whole_ep(fb, ops)
    assert keys[-1][2] == keys[0][2]
    whole_ep(fb, ops, bulk_push=True)  # the bulk transport (MoKConfig.comm_transport="bulk")
    assert keys[-1][2] == replace(keys[0][2], bulk_push=True) and len(fake.direct[-1]) == len(params)


def test_host_ep_mx_launches_the_mx_ep_variant(monkeypatch, ref_quant):  # noqa: F811
    """fused_backward_ep(w_scales=..., dx_shared=...): the mx ep variant with the gather's bf16 rows
    and e4m3 buffers (as fused_backward's), the shared expert's dx the slot sum's start; dx_shared
    without w_scales, or with the shared expert in the launch: ValueError before anything is staged."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _ep_operands(shared=False)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    e, inter, hid = 2, 128, 256
    for name in ("w_gate", "w_up", "w_down"):
        ops[name] = ops[name].to(f8)
    scales = (torch.zeros(e, inter // 32, hid, dtype=u8), torch.zeros(e, inter // 32, hid, dtype=u8),
              torch.zeros(e, hid // 32, inter, dtype=u8))
    dxs = torch.randn(64, hid).bfloat16()
    out = whole_ep(fb, ops, w_scales=scales, dx_shared=dxs)
    (args,) = fake.direct
    a = by_name(args)
    a = {n: None if v is None else getattr(v, "_keep", v) for n, v in a.items()}
    assert keys == [("sm100_fused_moe_bwd", "sm_100a",
                     fb.BwdVariant(True, True, True, False, True, True, False, False, True))]
    assert a["mInit"] is dxs and a["mDy"].dtype == f8 and a["mDyRows"].dtype == torch.bfloat16 and len(out) == 5
    assert tuple(a["mXRows"].shape) == (256, hid) and a["mDyt"].dtype == f8
    bad = {"dx_shared without w_scales": dict(_ep_operands(shared=False), dx_shared=dxs),
           "shared with w_scales": dict(_ep_operands(shared=True), w_scales=scales,
                                        **{n: ops[n] for n in ("w_gate", "w_up", "w_down")})}
    for kw in bad.values():
        with pytest.raises(ValueError, match="dx_shared|w_scales"):
            whole_ep(fb, kw)
    assert len(fake.direct) == 1


def test_host_ep_no_tokens(monkeypatch):
    """T = 0 (on every rank of the group): empty dx and d topk_w, zero weight gradients, nothing
    staged or launched, the epochs unchanged."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _ep_operands(t=64)
    offs, gus, hs, *w = ops["shared"]
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], slot_rows=ops["slot_rows"][:0], topk_idx=ops["topk_idx"][:0],
               w_rows=ops["w_rows"][:0], shared=(offs, gus[:0], hs[:0], *w))
    ops["plan"].recv_src = ops["plan"].recv_src[:0]
    ops["plan"].offsets = torch.zeros(3, dtype=torch.int32)
    out = whole_ep(fb, ops)
    assert tuple(out[0].shape) == (0, 256) and tuple(out[1].shape) == (0, 2) and all(not d.any() for d in out[2:])
    assert not fake.direct and not fake.calls and not keys and ops["ws"].epoch == {"pull": 0, "push": 0}


@pytest.mark.parametrize("change, exc, match", [
    ("recv_src_long", TypeError, "recv_src"),
    ("idx_float", TypeError, "topk_idx"),
    ("dy_tokens", ValueError, "dy"),
    ("gu_rows", ValueError, "gu"),
    ("offsets_len", ValueError, "offsets"),
    ("slot_rows_shape", ValueError, "slot_rows"),
    ("slot_rows_float", TypeError, "slot_rows"),
    ("w_rows_len", ValueError, "w_rows"),
    ("w_rows_bf16", TypeError, "w_rows"),
    ("comm", ValueError, "comm_ctas"),
    ("shared_gu", ValueError, "gu_s"),
    ("limit", ValueError, "limit"),
    ("device", ValueError, "w_rows"),
    ("arch", ValueError, "sm_100a / sm_103a"),
])
def test_host_ep_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad fused_backward_ep operand raises, naming it, before anything is staged in the
    workspace, compiled or launched."""
    fb, fake, keys = _fake_device(monkeypatch, "sm_90a" if change == "arch" else "sm_100a")
    ops = _ep_operands()
    plan, (offs, gus, hs, wsg, wsu, wsd) = ops["plan"], ops["shared"]
    edits = {
        "recv_src_long": lambda: setattr(plan, "recv_src", plan.recv_src.long()),
        "idx_float": lambda: ops.update(topk_idx=ops["topk_idx"].float()),
        "dy_tokens": lambda: ops.update(dy=ops["dy"][:63], x=ops["x"][:63]),
        "gu_rows": lambda: ops.update(gu=ops["gu"][:255]),
        "offsets_len": lambda: setattr(plan, "offsets", plan.offsets[:2]),
        "slot_rows_shape": lambda: ops.update(slot_rows=ops["slot_rows"][:100]),
        "slot_rows_float": lambda: ops.update(slot_rows=ops["slot_rows"].float()),
        "w_rows_len": lambda: ops.update(w_rows=ops["w_rows"][:255]),
        "w_rows_bf16": lambda: ops.update(w_rows=ops["w_rows"].bfloat16()),
        "comm": lambda: ops.update(comm_ctas=0),
        "shared_gu": lambda: ops.update(shared=(offs, gus[:63], hs, wsg, wsu, wsd)),
        "limit": lambda: ops.update(limit=-1.0),
        "device": lambda: ops.update(w_rows=ops["w_rows"].to("meta")),
        "arch": lambda: None,
    }
    edits[change]()
    with pytest.raises(exc, match=match):
        whole_ep(fb, ops)
    ws = ops["ws"]
    assert not fake.direct and not fake.calls and (change == "arch" or not keys)
    assert not ws._src.any() and not ws._dy.any() and ws.epoch == {"pull": 0, "push": 0}


PAIR_PTX = ("cta_group::2", "st.async.shared::cluster.mbarrier::complete_tx::bytes", "mapa.shared::cluster",
            "mbarrier.arrive.release.cluster.shared::cluster", "barrier.cluster.wait")
PAIR_VARIANTS = ["fused-bwd-2cta-tokens-clamp", "fused-bwd-mxfp8-2cta-tokens-grouped-noclamp",
                 "fused-bwd-2cta-gather-shared-main-grads-noclamp", "fused-bwd-mxfp8-2cta-gather-init-clamp",
                 "fused-bwd-2cta-ep-clamp", "fused-bwd-mxfp8-2cta-ep-init-noclamp"]


@functools.cache
def _pair_rep(name: str, arch: str):
    from mok_cute.kernels.sm100 import fused_bwd as fb

    return fb.variants()[name][0](arch)[1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", PAIR_VARIANTS)
def test_pair_variants_compile_with_cta_group_2(arch, name):
    """``tile_m`` 256 (every registry entry named 2cta): ``cta_group::2`` MMAs, the pair's task ring and
    the cluster barrier before exit, the registry's PTX items, 0 spills, registers as their one-CTA
    variants' bound (MXFP8: the dgu quantizing epilogue's 255)."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    rep = _pair_rep(name, arch)
    needed = fb.variants()[name][1]
    assert not [p for p in needed + PAIR_PTX if p not in rep.ptx]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= (255 if "mxfp8" in name else MAX_REGISTERS)


def test_one_cta_variants_have_no_pair_instructions():
    rep = _rep("sm_100a", True, tokens=True, init=True, add=True)
    assert not any(p in rep.ptx for p in PAIR_PTX)
    assert rep.ptx.count("tcgen05.mma") == _pair_rep("fused-bwd-2cta-tokens-clamp", "sm_100a").ptx.count("tcgen05.mma")


def test_host_pair_launch(monkeypatch):
    """``Sm100Launch(tile_m=256)`` on the backward's host path (compile and launch faked): the
    variant's tile rows, the grid is whole pairs, fewer than two pairs is a ValueError, the variant
    compiled with ``tile_m`` 256; the environment is not read; a bad tile_m is a ValueError naming it
    and the allowed values."""
    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    monkeypatch.setenv("MOK_CUTE_SM100_TILE_M", "256")  # gone: not read
    core(fb, ops)
    assert (keys[-1][2].tile_m, keys[-1][2].bulk_push) == (128, False)
    core(fb, ops, num_ctas=9, tile_m=256)
    assert keys[-1][2] == replace(keys[0][2], tile_m=256)
    assert int(by_name(fake.calls[-1])["num_ctas"]) == 8
    with pytest.raises(ValueError, match="two CTA pairs"):
        core(fb, ops, num_ctas=3, tile_m=256)
    with pytest.raises(ValueError, match=r"tile_m must be one of \(128, 256\)"):
        fb.BwdVariant(True, tile_m=192)
    with pytest.raises(ValueError, match=r"tile_m must be one of \(128, 256\)"):
        core(fb, ops, tile_m=192)


BULK_VARIANTS = ["fused-bwd-ep-bulk-push-clamp", "fused-bwd-mxfp8-ep-bulk-push-init-noclamp",
                 "fused-bwd-2cta-ep-bulk-push-shared-noclamp"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", BULK_VARIANTS)
def test_bulk_push_variants(arch, name):
    """``bulk_push`` (EP > 1): D1's rows go to the peers by ``cp.async.bulk`` from the shared staging
    slices (fused_moe.push_routed_bulk), the copies complete and are fenced into the async proxy
    before the system-scope fence that orders the tile's count; the registry's PTX items, 0 spills;
    the st EP variant has no bulk store."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    rep = _pair_rep(name, arch)
    needed = fb.variants()[name][1]
    assert not [p for p in needed if p not in rep.ptx]
    assert rep.total_spill_bytes == 0 and rep.max_registers <= (255 if "mxfp8" in name else MAX_REGISTERS)
    ptx = rep.ptx
    last_copy = ptx.rindex("cp.async.bulk.global.shared::cta.bulk_group")
    wait0 = last_copy + re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx[last_copy:]).end()
    assert ptx.index("fence.proxy.async.global", wait0) < ptx.index("fence.acq_rel.sys", wait0)
    st = _pair_rep("fused-bwd-ep-clamp", arch)
    assert "cp.async.bulk.global.shared::cta" not in st.ptx


def test_host_bulk_push(monkeypatch):
    """``Sm100Launch.bulk_push`` picks the bulk variant for the EP > 1 backward only (test_host_ep_launch_*);
    EP = 1 ignores it; a variant with bulk_push without ep is a ValueError."""
    fb, fake, keys = _fake_device(monkeypatch)
    core(fb, _operands(), bulk_push=True)
    assert keys[-1][2].bulk_push is False
    with pytest.raises(ValueError, match="bulk_push"):
        fb.BwdVariant(True, bulk_push=True)

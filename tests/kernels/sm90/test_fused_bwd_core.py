"""The fused routed backward core (kernels/sm90/fused_bwd.py) on the CPU: it compiles for sm_90a
with 0 spills and the instructions its schedule needs, and its task decoding
(schedule/fused_bwd_tasks.core_task, mirror core_task_list) walks the backward list's routed
phases with every dW output tile once per expert. The kernel runs in tools/checks/fused_bwd.py."""
import functools
import re

import pytest
import torch

from mok_cute.schedule import fused_bwd_tasks as bt
from conftest import offsets_from


def _report(*flags, **named):
    """The compile report of one variant, ``fused_bwd.BwdVariant(*flags, **named)`` (ValueError for one the
    kernel does not build)."""
    from mok_cute.kernels.sm90 import fused_bwd

    return fused_bwd.compile_fused_backward_core(fused_bwd.BwdVariant(*flags, **named), inspect=True)[1]


@functools.cache
def _compiled(clamp: bool, scatter: bool = False, init: bool = False):
    return _report(clamp, scatter, init)


def _clean(rep, spill: int = 0):
    """``spill`` bytes of spill stores (0), and ptxas kept the wgmma batches asynchronous: its C7520
    remark ("wgmma.mma_async instructions are serialized", a fence it had to add in a divergent path)
    cost this kernel 16%."""
    assert re.findall(r"(\d+) bytes spill stores", rep.log) == [str(spill)]
    assert "serialized" not in rep.log, rep.log[:600]


@pytest.mark.parametrize("clamp", [False, True])
def test_compiles_with_its_schedule(clamp):
    rep = _compiled(clamp)
    assert rep.registers, "no ptxas resource report parsed"
    _clean(rep)
    for needed in ("wgmma.mma_async", "cp.async.bulk.tensor", "atom.global.release.add", "setmaxnreg",
                   "bar.arrive", "fence.proxy.async.global", "cp.async.ca.shared.global", "%globaltimer"):
        assert needed in rep.ptx, needed
    assert "multimem" not in rep.ptx
    # the two mainloops' wgmma: A K-major (dgrad: transpose-A 0) and A MN-major (wgrad: 1), B MN-major
    flags = {m.groups() for m in re.finditer(r"wgmma\.mma_async[^;]*?p,\s*1,\s*1,\s*(\d),\s*(\d);", rep.ptx)}
    assert flags == {("0", "1"), ("1", "1")}, flags


def test_clamp_variant_differs():
    assert _compiled(True).ptx != _compiled(False).ptx


@pytest.mark.parametrize("flags", [(True,), (True, True, True, True, True, True)], ids=["core", "whole"])
def test_gated_swiglu_variant(flags):
    """gpt-oss's dSwiGLU (``gated``: alpha 1.702, up offset 1) in the D2 epilogue: the plain variant's GEMM work
    (wgmma count), clean (no spills, no serialized wgmma), alpha as an fp32 immediate (the plain one has none)."""
    from mok_cute.kernels.swiglu_math import Gated

    rep, plain = _report(*flags, gated=Gated(1.702, 1.0)), _report(*flags)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    alpha = re.compile(r"0f[3B]FD9DB23\b")
    assert alpha.search(rep.ptx) and not alpha.search(plain.ptx)


@pytest.mark.parametrize("clamp,init", [(True, True), (False, False)])
def test_tokens_variant(clamp, init):
    """The variant that scatters the dx rows and ends with the slot sum: 0 spills, the slot sum's
    cp.async staging and fp32 adds, its wait on the dgrad1 tiles (acquire) after the register
    hand-back, and the same GEMM work as the plain core."""
    rep = _compiled(clamp, True, init)
    plain = _compiled(clamp)
    _clean(rep)
    for needed in ("cp.async.cg.shared.global", "add.rn.f32"):
        assert needed in rep.ptx and needed not in plain.ptx, needed
    regs = {tuple(m.groups()) for m in re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", rep.ptx)}
    assert regs == {("dec", "40"), ("inc", "232"), ("dec", "160"), ("inc", "160")}, regs
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    assert "mul.rn.f32" not in rep.ptx or "mul.rn.f32" in plain.ptx  # dx rows carry no router weight
    assert (rep.ptx != _compiled(clamp, True, not init).ptx)


def test_backward_path_is_a_config_field(monkeypatch):
    """The backward's modes are ``MoKConfig.backward_path`` (the ``MOK_CUTE_FUSED_BWD`` modes 0 / 2 / 3 and
    ``MOK_CUTE_FUSED_BWD_MX`` were environment reads; mode 1, the fused GEMMs without the dx slot sum, is gone):
    SM90's default is FUSED at BF16 and MXFP8 (the fused core with the dx slot sum), FUSED_WHOLE (one launch for
    the whole backward) runs only when asked, UNFUSED when asked; the retired variables change nothing."""
    from mok_cute.config import BackwardPath, MoKConfig
    from mok_cute.layers import paths

    for name, value in (("MOK_CUTE_FUSED_BWD", "0"), ("MOK_CUTE_FUSED_BWD_MX", "0")):
        monkeypatch.setenv(name, value)
    for prec in ("bf16", "mxfp8"):
        call = paths.Call(prec)
        assert paths.decide(MoKConfig(), "sm90", call).backward is BackwardPath.FUSED
        for want in (BackwardPath.UNFUSED, BackwardPath.FUSED):
            assert paths.decide(MoKConfig(backward_path=want), "sm90", call).backward is want
    assert MoKConfig(backward_path="fused_whole").backward_path is BackwardPath.FUSED_WHOLE
    with pytest.raises(ValueError):
        MoKConfig(backward_path="mode 1")


@pytest.mark.parametrize("wd_first", [False, True])
@pytest.mark.parametrize("counts", [[256] * 4, [1000, 0, 0, 0], [0, 0, 0, 1], [0] * 3, [129, 1, 0, 300]])
def test_core_list_is_the_routed_backward(counts, wd_first):
    """The core list is task_list's routed phases in order (``wd_first``: the dW_down tiles first, expert-major,
    then the rest in that order); D2 / D1 cover every (m-tile, n-tile) of every expert once; W covers every dW
    output tile of every expert once per gradient."""
    offs = offsets_from(counts)
    n_i, n_h, wd, wgu = 2, 3, (3, 2), (2, 4)
    core = bt.core_task_list(offs, 128, n_i, n_h, wd, wgu, wd_first)
    full = bt.task_list(offs, 0, 128, n_i, 0, n_h, wd[0] * wd[1], wgu[0] * wgu[1], False)
    if wd_first:
        first = [f for f in full if f[0] == bt.W and f[4] == bt.WD]
        full = first + [f for f in full if not (f[0] == bt.W and f[4] == bt.WD)]
        n_wd = len(first)
        assert all(c[0] == bt.W and c[5] == bt.WD for c in core[:n_wd])
        assert all(not (c[0] == bt.W and c[5] == bt.WD) for c in core[n_wd:])
    assert [(c[0], c[1]) for c in core] == [(f[0], f[1]) for f in full]
    per_e = bt.expert_mtiles(offs, 128)
    for phase, n in ((bt.D2, n_i), (bt.D1, n_h)):
        got = sorted((c[1], c[3], c[2], c[4]) for c in core if c[0] == phase)
        want = sorted((e, m, nt, mt) for e, mts in enumerate(per_e) for m, mt in enumerate(mts) for nt in range(n))
        assert got == want
    for which, (mm, nn) in ((bt.WD, wd), (bt.WG, wgu), (bt.WU, wgu)):
        got = sorted((c[1], c[3], c[2]) for c in core if c[0] == bt.W and c[5] == which)
        assert got == sorted((e, m, nt) for e in range(len(counts)) for m in range(mm) for nt in range(nn))


@functools.cache
def _host_core_decoder(wd_first: bool = False):
    """``fused_bwd_tasks.core_task`` (the device decode of both archs' fused backward) compiled as a host function:
    decodes ids ``start, start + step, ..`` below ``n`` into ``out`` [n, 6] (phase, expert, n_tile, m_tile, mt,
    which), carrying its cursors as a CTA does."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    @cute.jit
    def decode(out: cute.Tensor, offsets: cute.Tensor, n_d2: Int32, n_d1: Int32, n_i: Int32, n_h: Int32,
               wd_m: Int32, wd_n: Int32, wgu_m: Int32, wgu_n: Int32, n: Int32, start: Int32, step: Int32):
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        for t in cutlass.range(start, n, step, unroll=1):
            phase, expert, n_tile, m_tile, _, _, mt, which, e1, b1, e2, b2 = bt.core_task(
                t, bt.CoreDims(n_d2, n_d1, n_i, n_h, wd_m, wd_n, wgu_m, wgu_n), offsets, offsets.shape[0] - 1, 128,
                (e1, b1, e2, b2), wd_first)
            for i, v in enumerate((phase, expert, n_tile, m_tile, mt, which)):
                out[t, i] = v
    return decode


@pytest.mark.parametrize("wd_first", [False, True])
@pytest.mark.parametrize("counts", [[256] * 4, [1000, 0, 0, 0], [0, 0, 0, 1], [129, 1, 0, 300, 7]])
def test_device_core_decode_matches_the_list(counts, wd_first):
    """The device decode itself (run on the host) walks core_task_list, in list order and along strided CTA ids
    (``wd_first`` too: the D2 / D1 cursors only grow in that order as well)."""
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    offs = offsets_from(counts)
    n_i, n_h, wd, wgu = 2, 3, (3, 2), (2, 4)
    core = bt.core_task_list(offs, 128, n_i, n_h, wd, wgu, wd_first)
    m_routed = sum(len(m) for m in bt.expert_mtiles(offs, 128))
    for start, step in ((0, 1), (3, 5), (1, 64)):
        out = torch.full((len(core), 6), -7, dtype=torch.int32)
        _host_core_decoder(wd_first)(from_dlpack(out), from_dlpack(torch.tensor(offs, dtype=torch.int32)),
                             Int32(m_routed * n_i), Int32(m_routed * n_h), Int32(n_i), Int32(n_h), Int32(wd[0]),
                             Int32(wd[1]), Int32(wgu[0]), Int32(wgu[1]), Int32(len(core)), Int32(start), Int32(step))
        for t in range(start, len(core), step):
            assert tuple(out[t].tolist()) == core[t], (t, core[t])


def test_core_waits_point_backwards():
    """Every D1 / dWg / dWu tile's d2 counters are complete before it in the list."""
    offs = offsets_from([300, 0, 129, 1])
    n_i = 2
    core = bt.core_task_list(offs, 128, n_i, 3, (2, 2), (2, 2))
    per_e = bt.expert_mtiles(offs, 128)
    done = {}
    for phase, e, _, _, mt, which in core:
        if phase == bt.D1:
            assert done.get(mt, 0) == n_i
        if phase == bt.W and which != bt.WD:
            assert all(done.get(m, 0) == n_i for m in per_e[e])
        if phase == bt.D2:
            done[mt] = done.get(mt, 0) + 1


@pytest.mark.parametrize("by_route", [False, True])
def test_gather_variant(by_route):
    """The variant that also builds the routed dy rows, d topk_w and x rows in its comm CTAs:
    0 spills, route_grad's exact arithmetic (mul.rn, fma.rn, the butterfly), the same GEMM work."""
    rep = _compiled_gather(by_route)
    plain = _compiled(True, True, True)
    _clean(rep)
    for needed in ("fma.rn.f32", "mul.rn.f32", "cvt.rn.bf16x2.f32", "shfl.sync.bfly"):
        assert rep.ptx.count(needed) > plain.ptx.count(needed), needed
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")


@functools.cache
def _compiled_gather(by_route: bool):
    from mok_cute.kernels.sm90 import fused_bwd

    return _report(True, True, True, True, by_route)


def test_status_words_described():
    """A timed-out wait names what it waited for; a clean status is no error."""
    from mok_cute.comm import protocol as P
    from mok_cute.kernels.sm90 import fused_bwd

    assert fused_bwd.describe([P.OK, 0, 0, 0]) is None
    msg = fused_bwd.describe([P.TIMEOUT, 5, fused_bwd.D2_READY, 8])
    assert "fused backward" in msg and "dgrad2 tiles of m-tile 5" in msg and "device_timeout_s" in msg
    assert "routed rows of m-tile 2" in fused_bwd.describe([P.TIMEOUT, 2, fused_bwd.ROWS_READY, 1])


def test_shared_variant():
    """The whole-backward variant: the shared expert's tiles in the same launch (a second group of
    one expert), 0 spills, about twice the GEMM code of the routed-only gather variant."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, True, True)
    routed = _compiled_gather(True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") >= 2 * routed.ptx.count("wgmma.mma_async") - 8
    with pytest.raises(ValueError, match="shared needs init"):
        _report(True, True, False, True, True, True)


def test_accumulate_variant():
    """The main_grads variant: the weight-gradient tiles added into fp32 main grads (add.rn.f32 on
    32-bit loads and stores) instead of written as bf16; 0 spills; the same GEMM work."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, True, True, True)
    plain = _report(True, True, True, True, True, True)
    _clean(rep)
    assert rep.ptx.count("add.rn.f32") > plain.ptx.count("add.rn.f32")
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")


def test_trace_variant():
    """The trace variant: %globaltimer records of every task (64-bit stores), 0 spills,
    the same GEMM work; the untraced build reads the timer only in its bounded waits."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, True, True, False, True)
    plain = _report(True, True, True, True, True, True)
    _clean(rep)
    assert rep.ptx.count("%globaltimer") > plain.ptx.count("%globaltimer")
    st64 = lambda p: p.count("st.global.u64") + p.count("st.global.b64") + p.count("st.global.s64")
    assert st64(rep.ptx) > st64(plain.ptx)
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")


@pytest.mark.parametrize("scatter", [False, True])
def test_mx_variant(scatter):
    """The MXFP8 variant: dgu's round trips along 2I and along the tokens in the dSwiGLU epilogue
    (e4m3 quantize and dequantize instructions the BF16 build lacks), the same GEMM work, 0 spills,
    no serialized wgmma; with the shared group it is refused."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, scatter, scatter, mx=True)
    plain = _compiled(True, scatter, scatter)
    _clean(rep)
    for needed in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "max.u16x2"):
        assert rep.ptx.count(needed) > plain.ptx.count(needed), needed
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    with pytest.raises(ValueError, match="mx"):
        _report(True, True, True, True, False, True, mx=True)


def test_ep_mx_variant():
    """The EP > 1 whole backward at MXFP8 (the shared expert outside the launch): the comm CTAs'
    round trips of the pulled rows (the tokens' blocks: e4m3 quantize / dequantize, u16x2 maxima;
    H's: the 4-lane butterfly) on top of the epilogue's, the same GEMM work; 0 spills (16 bytes
    while the consumers' D1 count was a loop-carried register, not a shared-memory word)."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, ep=True, mx=True)
    bf16 = _report(True, True, True, True, ep=True)
    core = _report(True, True, True, mx=True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == bf16.ptx.count("wgmma.mma_async")
    for needed in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "max.u16x2"):
        assert rep.ptx.count(needed) > core.ptx.count(needed), needed
    assert rep.ptx.count("shfl.sync.bfly") > bf16.ptx.count("shfl.sync.bfly")
    assert "st.release.sys" in rep.ptx


def test_add_variant():
    """``tokens`` with an fp32 dx term (the output gate's share): the slot sum's start gets one
    more add.rn.f32 per element and 32-byte fp32 loads, 0 spills; it needs the slot sum."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, add=True)
    plain = _compiled(True, True, True)
    _clean(rep)
    assert rep.ptx.count("add.rn.f32") == plain.ptx.count("add.rn.f32") + 8
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    with pytest.raises(ValueError, match="add.*needs scatter"):
        _report(True, add=True)


def test_ep_variant():
    """The EP > 1 whole backward (rows pulled from the peers' workspaces, dgrad1 rows pushed to
    them, the slot sum after every rank's DATA): 0 spills, the shared variant's GEMM code, the
    pull / push protocol's system-scope signals and waits, and d topk_w's fixed-order sum."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, False, True, ep=True)
    local = _report(True, True, True, True, False, True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == local.ptx.count("wgmma.mma_async")
    for needed in ("st.release.sys", "ld.acquire.sys", "fence.acq_rel.sys", "fma.rn.f32", "shfl.sync.bfly"):
        assert needed in rep.ptx, needed
    assert "st.release.sys" not in local.ptx
    with pytest.raises(ValueError, match="ep"):
        _report(True, True, True, True, True, True, ep=True)


def _launched(args) -> dict:
    """One launch's arguments (a FakeLauncher's record) by ``FusedMoeBwdCoreSm90.__call__`` parameter, each
    bundle's tensors unwrapped from their descriptors."""
    import inspect

    from mok_cute.kernels.sm90 import fused_bwd

    params = list(inspect.signature(fused_bwd.FusedMoeBwdCoreSm90.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))

    def unwrap(v):
        return type(v)(*(unwrap(u) for u in v)) if isinstance(v, tuple) else getattr(v, "_keep", v)
    return {n: unwrap(v) for n, v in zip(params, args)}


def _ep_host(monkeypatch):
    """fused_backward_ep's host side on CPU tensors: compile and launch replaced (``(fake launcher,
    compile keys)``), and one EP problem ``(ws, plan, dy, x, slot_rows, w_rows, idx, weights, gu, h,
    shared operands)`` (T 64, H 256, I 128, E 2, k 2, M 256: the receive capacity EP * T * k)."""
    from types import SimpleNamespace

    from conftest import FakeLauncher, FakeWorkspace
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys = FakeLauncher(), []
    monkeypatch.setattr(fused_bwd, "device_arch", lambda d: (0, "sm_90a"))
    monkeypatch.setattr(fused_bwd, "sm_count", lambda d: 132)
    monkeypatch.setattr(fused_bwd, "compile_cached", lambda key, build: keys.append(key) or fake)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    t, h, inter, e, k, m = 64, 256, 128, 2, 2, 256
    bf = torch.bfloat16
    plan = SimpleNamespace(recv_src=torch.arange(m, dtype=torch.int32), offsets=torch.tensor([0, 90, 200], dtype=torch.int32))
    weights = (torch.randn(e, inter, h).to(bf), torch.randn(e, inter, h).to(bf), torch.randn(e, h, inter).to(bf))
    sh = (torch.tensor([0, t], dtype=torch.int32), torch.randn(t, 2 * inter).to(bf), torch.randn(t, inter).to(bf),
          *(w[0] for w in weights[:2]), weights[2][0])
    prob = (FakeWorkspace(t, h, k), plan, torch.randn(t, h).to(bf), torch.randn(t, h).to(bf),
            torch.randn(t * k, h).to(bf), torch.rand(m), torch.zeros(t, k, dtype=torch.int64), weights,
            torch.randn(m, 2 * inter).to(bf), torch.randn(m, inter).to(bf), sh)
    return fake, keys, prob


def test_ep_host_launch(monkeypatch):
    """fused_backward_ep's host side on CPU tensors (compile and launch replaced): x and dy are
    staged in the workspace's src and dy sections, the ep variant launches directly (the epochs
    change every call) with one argument per ``__call__`` parameter, the plan's packed sources
    as the row order, the forward's router weight per grouped row, this rank's slot rows for d
    topk_w, the workspace's slot section as the push target and its status for every wait."""
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (ws, plan, dy, x, slot_rows, w_rows, idx, weights, gu, hh, sh) = _ep_host(monkeypatch)
    t, h, k, m = 64, 256, 2, 256
    out = fused_bwd.fused_backward_ep(ws, plan, fused_bwd.BackwardInputs(dy, x, slot_rows, gu, hh), w_rows, idx,
                                      weights, 4.0, fused_bwd.BackwardLaunch(num_ctas=66, comm_ctas=6), shared=sh)
    assert not fake.calls and len(fake.direct) == 1 and keys[0][2].ep
    (args,) = fake.direct
    a = _launched(args)
    assert torch.equal(ws._src, x) and torch.equal(ws._dy, dy)
    assert a["slots"].slot.data_ptr() == ws._slots.data_ptr() and a["ep"].status is ws.status
    assert a["slots"].order is plan.recv_src and a["rows"].w is w_rows and a["rows"].r is slot_rows
    assert a["rows"].dy_tok is dy and a["rows"].x_tok is x and tuple(a["routed"].dy.shape) == (m, h)
    ep = a["ep"]
    assert (int(ep.epoch_pull), int(ep.epoch_push), int(ep.me), int(ep.n_ranks)) == (1, 1, 1, 2)
    assert int(ep.dy_off) == ws.offsets["dy"] and int(ep.slots_off) == ws.offsets["slots"]
    assert (int(a["sc"].num_ctas), int(a["sc"].comm_ctas)) == (66, 6)
    assert int(a["sc"].timeout_ns) == int(ws.timeout_s * 1e9)  # the workspace's bound, not the launch's default
    assert len(out) == 8 and out[1].shape == (t, k) and out[0].shape == (t, h)  # dx, d topk_w, 3 + 3 dW


def test_host_launch_compiles_the_activation_in(monkeypatch):
    """fused_backward_ep takes the activation as ``limit``: SwiGLU.gpt_oss()'s alpha and up offset go in the
    compiled variant (``gated``), its limit 7 in the scalars; a plain SwiGLU(L) is the float L's variant."""
    from mok_cute.kernels.sm90 import fused_bwd
    from mok_cute.kernels.swiglu_math import Gated
    from mok_cute.reference import SwiGLU

    fake, keys, (ws, plan, dy, x, slot_rows, w_rows, idx, weights, gu, hh, sh) = _ep_host(monkeypatch)
    for act in (SwiGLU.gpt_oss(), SwiGLU(4.0), 4.0):
        fused_bwd.fused_backward_ep(ws, plan, fused_bwd.BackwardInputs(dy, x, slot_rows, gu, hh), w_rows, idx,
                                    weights, act, fused_bwd.BackwardLaunch(num_ctas=66, comm_ctas=6), shared=sh)
    assert [(k[2].clamp, k[2].gated) for k in keys] == [(True, Gated(1.702, 1.0)), (True, None), (True, None)]
    assert keys[1] == keys[2] and [_launched(args)["sc"].limit.value for args in fake.direct] == [7.0, 4.0, 4.0]


def test_gather_mx_variant():
    """The whole backward at MXFP8, EP = 1 (FUSED_WHOLE; the shared expert outside the launch): the
    gather's round trips on top of the epilogue's, the same GEMM work as the BF16 gather variant,
    no serialized wgmma; the 16 bytes of spill of :func:`test_ep_mx_variant`."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep = _report(True, True, True, True, mx=True)
    bf16 = _report(True, True, True, True)
    core = _report(True, True, True, mx=True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == bf16.ptx.count("wgmma.mma_async")
    for needed in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "max.u16x2"):
        assert rep.ptx.count(needed) > core.ptx.count(needed), needed


def test_host_launch_mx(monkeypatch):
    """fused_backward (EP = 1) at MXFP8 on CPU tensors (compile, launch and the round-trip kernel
    replaced): the mx gather variant with the shared expert's dx as the slot sum's start, h's round
    trip over the experts' rows as the routed h, a fresh mx.dy_t; with the shared tiles it is refused."""
    from mok_cute.kernels.operands import RoutePlan
    from mok_cute.kernels.quant import dequant_mxfp8
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, plan, dy, x, _, _, idx, weights, gu, hh, sh) = _ep_host(monkeypatch)
    trips, t, h, k = [], 64, 256, 2
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip_tokens",
                        lambda a, offs: trips.append((a, offs)) or a.clone() + 1)
    r_rows, order, dxs = torch.randn(t * k, h).to(torch.bfloat16), torch.arange(t * k), torch.randn(t, h).to(torch.bfloat16)
    topk_w, offsets = torch.rand(t, k), torch.tensor([0, 50, 128], dtype=torch.int32)
    gu, hh = gu[:t * k], hh[:t * k]
    inputs, routes = fused_bwd.BackwardInputs(dy, x, r_rows, gu, hh), RoutePlan(order, offsets, idx, topk_w)
    fused_bwd.fused_backward(inputs, routes, weights, 4.0, fused_bwd.BackwardLaunch(num_ctas=66, comm_ctas=6, mx=True),
                             dxs)
    variant = keys[0][2]
    assert variant.init and variant.gather and not variant.shared and variant.mx and not variant.ep
    a = _launched((fake.calls or fake.direct)[0])
    (rt_in, rt_offs), = trips
    assert torch.equal(rt_in, hh) and rt_offs is offsets and torch.equal(a["routed"].h, hh + 1)
    assert tuple(a["mx"].dy_t.shape) == (t * k, h) and a["slots"].init is dxs and a["shared"] is None
    with pytest.raises(ValueError, match="mx"):
        fused_bwd.fused_backward(inputs, routes, weights, 4.0, fused_bwd.BackwardLaunch(mx=True), shared=sh)


def test_host_core_consume_writes_dgu_over_gu(monkeypatch):
    """fused_backward_core(consume=True) (the layer's one-shot FUSED backward): D2's dgu output is
    gu's first M rows (no new [M, 2I] buffer; each dSwiGLU tile reads its own g, u before it stores
    their dg, du); without consume a fresh buffer, gu untouched as an input only."""
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    m, h = 200, 256
    dy, x = torch.randn(m, h).to(torch.bfloat16), torch.randn(m, h).to(torch.bfloat16)
    offsets = torch.tensor([0, 50, m], dtype=torch.int32)
    ptrs = []
    for consume in (False, True):
        fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, x, gu, hh, offsets), weights, 4.0, consume=consume)
        a = _launched((fake.calls or fake.direct)[-1])["routed"]
        assert a.gu3.data_ptr() == gu.data_ptr() and tuple(a.dgu3.shape) == (m, 2, 128)
        ptrs.append(a.dgu3.data_ptr())
    assert ptrs[0] != gu.data_ptr() and ptrs[1] == gu.data_ptr()


def test_host_trace_is_the_launch_flag(monkeypatch):
    """The trace variant is the launch's explicit ``BackwardLaunch.trace`` (the layer passes ``config.trace``):
    ``MOK_CUTE_TRACE=1`` in the environment does not turn it on, ``trace=True`` does, with a zeroed int64 record
    buffer; the kernel's scalars reach the compiled call as DSL values, each tensor as its descriptor and an
    absent bundle as None."""
    from cutlass import Float32, Int32, Int64

    from mok_cute.dsl.launch import _Desc
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    m, h = 200, 256
    rows = fused_bwd.ExpertRows(torch.randn(m, h).to(torch.bfloat16), torch.randn(m, h).to(torch.bfloat16), gu, hh,
                                torch.tensor([0, 50, m], dtype=torch.int32))
    monkeypatch.setenv("MOK_CUTE_TRACE", "1")
    for trace in (False, True):
        fused_bwd.fused_backward_core(rows, weights, 4.0, fused_bwd.BackwardLaunch(trace=trace))
        args = (fake.calls or fake.direct)[-1]
        assert keys[-1][2].trace is trace and (args[7] is not None) is trace
    assert isinstance(args[0].dy, _Desc) and args[0].dx._keep.shape == (m, h)
    assert args[2:6] == (None,) * 4  # no slot sum, gather, shared group or MXFP8 operands: absent bundles
    sc = args[8]
    assert [type(v) for v in sc] == [Int32, Int32, Float32, Int32, Int64] and int(sc.num_ctas) == 132
    records, comm = fused_bwd.last_trace()
    assert records.dtype == torch.int64 and not records.any() and comm == 0


@pytest.mark.parametrize("tile_n,stages", [(None, None), (128, None), (128, 3), (256, 2)])
def test_host_launch_tiles_reach_the_compile_key(monkeypatch, tile_n, stages):
    """``BackwardLaunch.tile_n`` / ``stages`` (the policy's ``fused_backward``) pick the compiled mainloop (its key
    in the compile key) and the host's tile arithmetic: n_tail by tile_n (I 128: a partial tile at tile_n 256, none
    at 128), the trace buffer's task bound (``_task_cap`` on that mainloop, at least the task list's length)."""
    from mok_cute.kernels.sm90 import fused_bwd
    from mok_cute.kernels.sm90.mainloop import MainloopConfig
    from mok_cute.schedule import fused_bwd_tasks as tasks

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    m, h, inter = 200, 256, 128
    rows = fused_bwd.ExpertRows(torch.randn(m, h).to(torch.bfloat16), torch.randn(m, h).to(torch.bfloat16), gu, hh,
                                torch.tensor([0, 50, m], dtype=torch.int32))
    launch = fused_bwd.BackwardLaunch(trace=True, tile_n=tile_n, stages=stages)
    fused_bwd.fused_backward_core(rows, weights, 4.0, launch)
    cfg = MainloopConfig(tile_n=tile_n or 256, stages=stages or 0)
    assert keys[-1][3] == cfg.key() and keys[-1][2].n_tail is (cfg.tile_n == 256)
    tn = cfg.tile_n
    n = len(tasks.task_list([0, 50, m], 0, 128, -(-inter // tn), 0, h // tn, -(-h // 128) * -(-inter // tn),
                            -(-inter // 128) * (h // tn), False))
    assert fused_bwd._task_cap(m, 2, h, inter, None, cfg) >= n
    records, _ = fused_bwd.last_trace()
    assert records.shape[0] == fused_bwd._task_cap(m, 2, h, inter, None, cfg) + 2 * (m // 128 + 3) + 3 * 132


def test_bundles_keep_the_flat_parameter_order():
    """The launch bundles flatten (None fields dropped, as the DSL does) to the kernel's flat parameter order of
    the commit before the bundles: the shared group's 14 tensors in their old order (its dy, x and dx absent),
    the gather's rows, the EP tail; the graph key of a launch covers every tensor's pointer, shape and strides."""
    from mok_cute.kernels.route_grad_row import GatherRows
    from mok_cute.kernels.sm90 import fused_bwd

    t, i_s, hid = 256, 128, 256
    bf = torch.bfloat16
    shared = fused_bwd.SharedOperands(torch.tensor([0, t], dtype=torch.int32), torch.randn(t, 2 * i_s).to(bf),
                                      torch.randn(t, i_s).to(bf), torch.randn(i_s, hid).to(bf),
                                      torch.randn(i_s, hid).to(bf), torch.randn(hid, i_s).to(bf))
    args, dws = fused_bwd._shared_args(shared, "cpu")
    present = [n for n, v in zip(args._fields, args) if v is not None]
    assert present == ["gu3", "h", "wg", "wu", "wd", "dgu", "dg", "du", "dgu3", "dwg", "dwu", "dwd", "offsets", "d2"]
    assert args.gu3.data_ptr() == shared.gu.data_ptr() and args.dg.data_ptr() == args.dgu.data_ptr()
    assert [tuple(d.shape) for d in dws] == [(i_s, hid), (i_s, hid), (hid, i_s)]
    assert GatherRows._fields[:6] == ("dy_tok", "x_tok", "r", "w", "dtw", "ready")
    assert fused_bwd.EpOperands._fields[2:] == ("me", "n_ranks", "src_off", "dy_off", "slots_off", "flags_off",
                                                "epoch_pull", "epoch_push")
    assert len(fused_bwd._NO_EP) == 8 and fused_bwd.EP_SECTIONS == ("src", "dy", "slots", "flags")
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    key = fused_bwd._graph_key((fused_bwd.SlotSum(a, None, None, None, None), 3))
    assert key == fused_bwd._graph_key((fused_bwd.SlotSum(a, None, None, None, None), 3))
    assert key != fused_bwd._graph_key((fused_bwd.SlotSum(b, None, None, None, None), 3))
    assert key != fused_bwd._graph_key((fused_bwd.SlotSum(a[:2], None, None, None, None), 3))


@functools.cache
def _mx_tokens_core(grouped_slots: bool, wd_first: bool = False):
    """The MXFP8 tokens core's compile report (shared by the tests below: one compile per variant and process)."""
    from mok_cute.kernels.sm90 import fused_bwd

    return _report(True, True, False, mx=True, grouped_slots=grouped_slots, wd_first=wd_first)


def test_grouped_slots_variant():
    """The MXFP8 core with the dx rows over dy's grouped rows (``grouped_slots``): 0 spills, the same
    GEMM work as the scatter variant, different code (D1's plain store, the slot sum's row lookup);
    refused where the rows are gathered in the launch or the shared group is in it, and at BF16
    without wd_first (dW_down reads dy there)."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep, scatter = _mx_tokens_core(True), _mx_tokens_core(False)
    _clean(rep)
    assert rep.ptx != scatter.ptx
    assert rep.ptx.count("wgmma.mma_async") == scatter.ptx.count("wgmma.mma_async")
    for bad in (dict(mx=False), dict(mx=True, gather=True), dict(mx=False, wd_first=True, gather=True),
                dict(mx=False, wd_first=True, shared=True)):
        with pytest.raises(ValueError, match="grouped_slots"):
            _report(True, True, bad.get("shared", False), grouped_slots=True, **bad)


def test_bf16_grouped_slots_variant():
    """The BF16 tokens core with the dx rows over dy (``grouped_slots`` + ``wd_first``: the layer's FUSED
    backward, no [T*k, H] slot buffer): 0 spills, unserialized wgmma, the scatter variant's GEMM work, one
    release add more (a dW_down tile done) and more bounded acquire waits (dgrad1's producer waits for
    every dW_down tile, dgrad2's does not)."""
    rep, scatter = _report(True, True, False, grouped_slots=True, wd_first=True), _compiled(True, True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == scatter.ptx.count("wgmma.mma_async")
    assert rep.ptx.count("atom.global.release.add") == scatter.ptx.count("atom.global.release.add") + 1
    assert rep.ptx.count("ld.acquire") > scatter.ptx.count("ld.acquire")


def test_wd_first_variant():
    """``wd_first`` (the MXFP8 tokens core with the dW_down tiles first): 0 spills, unserialized wgmma, the same
    GEMM work as grouped_slots plus one release add (a dW_down tile done) and one bounded acquire wait (D2's
    producer); refused without grouped_slots."""
    from mok_cute.kernels.sm90 import fused_bwd

    rep, base = _mx_tokens_core(True, True), _mx_tokens_core(True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == base.ptx.count("wgmma.mma_async")
    assert rep.ptx.count("atom.global.release.add") == base.ptx.count("atom.global.release.add") + 1
    assert rep.ptx.count("ld.acquire") > base.ptx.count("ld.acquire")
    with pytest.raises(ValueError, match="wd_first"):
        _report(True, True, False, mx=True, wd_first=True)


def test_wd_first_invariants_in_the_source():
    """What wd_first relies on, pinned in the kernel's source: a D2 tile's producer first waits for every dW_down
    tile (``num_experts * wd_m * wd_n`` on the WD_WORD counter), and a dW_down tile counts itself after its
    epilogue; the list puts every dW_down tile before the first D2 tile (test_core_list_is_the_routed_backward)."""
    import inspect

    from mok_cute.kernels.sm90 import fused_bwd

    src = inspect.getsource(fused_bwd.FusedMoeBwdCoreSm90)
    d2 = src[src.index("        if phase == D2:\n            if cutlass.const_expr(self.wd_first and self.mx"):]
    assert re.match(r"\s+if phase == D2:\n[^\n]+\n\s+wd_seen = self\._wait_wd_done\(g, wd_done, wd_seen,", d2)
    helper = src[src.index("    def _wait_wd_done("):]
    assert re.search(r"if wd_seen == 0:\s+wd_m, wd_n, _, _ = g\.wdims\s+"
                     r"persistent\.wait_input\(wd_done, g\.num_experts \* wd_m \* wd_n,[^\n]*\n\s+wd_seen = Int32\(1\)"
                     r"\s+return wd_seen", helper)
    assert re.search(r"if which == WD:\s+if tid == 0:\s+cute\.arch\.atomic_add\(wd_done, Int32\(1\), "
                     r"sem=\"release\"", src)


def test_grouped_slots_invariants_in_the_source():
    """What grouped_slots relies on, pinned in the kernel's source: a D1 tile's producer waits for
    d2[mt] to reach n_i (every dgrad2 tile of its m-tile has read dy's rows), and the MXFP8 dW_down
    tiles read dy's round trip along the tokens (mx.dy_t), not dy, so dgrad2 is dy's only reader."""
    import inspect

    from mok_cute.kernels.sm90 import fused_bwd

    src = inspect.getsource(fused_bwd.FusedMoeBwdCoreSm90)
    d1 = src[src.index("elif phase == D1:"):]
    assert re.match(r"elif phase == D1:\s+persistent\.wait_input\(g\.d2\.iterator \+ mt, g\.n_i,", d1)
    assert "_ragged_k(g.dy if dyt is None else dyt)" in src
    assert re.search(r"r_tma = self\._tma\(routed, mx\.dy_t\)", src)
    # BF16 (dW_down reads dy itself): the D1 producer also waits for every dW_down tile, counted after its epilogue
    # (until one wait of the CTA's saw them all: the count only grows)
    # (:meth:`_wait_wd_done`, pinned by test_wd_first_invariants_in_the_source)
    assert re.match(r"elif phase == D1:\s+persistent\.wait_input\(g\.d2[^\n]+\n\s+if cutlass\.const_expr\(self\.grouped_slots "
                    r"and not self\.mx\):[^\n]*\n\s+wd_seen = self\._wait_wd_done\(g, wd_done, wd_seen,", d1)


def test_grouped_rows_reads_the_scattered_rows():
    """grouped_rows is order's inverse: slot t*k + j's row of the grouped dx rows is the row the
    scatter would have put at t*k + j (bitwise, on a skewed routing with -1 slots), and 0 where no
    grouped row exists; the reference slot sum through it equals the one over the scattered rows."""
    from mok_cute.kernels.sm90.fused_bwd import grouped_rows
    from mok_cute.layers.grouped import _scatter_slots
    from mok_cute.reference import slot_sum

    g = torch.Generator().manual_seed(5)
    t, k, e, h = 97, 4, 6, 16
    idx = torch.randint(0, e, (t, k), generator=g)
    idx[::3, 2], idx[11] = -1, -1
    flat = idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, e), stable=True)
    valid = flat >= 0
    m = int(valid.sum())
    rows = grouped_rows(order[:m].to(torch.int32), t * k)
    assert rows.dtype == torch.int32 and tuple(rows.shape) == (t * k,)
    assert torch.equal(rows[order[:m]], torch.arange(m, dtype=torch.int32)) and not rows[~valid].any()
    dxr = torch.randn(t * k, h, generator=g).bfloat16()  # grouped rows, the routes without an expert last
    scattered = _scatter_slots(dxr, order, valid, t, k)
    through = dxr[:m][rows.long()].view(t, k, h)
    assert torch.equal(through[idx >= 0], scattered[idx >= 0])
    start = torch.randn(t, h, generator=g)
    assert torch.equal(slot_sum(start, through, idx), slot_sum(start, scattered, idx))


def test_host_core_mx_tokens_writes_dx_over_dy(monkeypatch):
    """fused_backward_core(tokens=, mx) (the layer's FUSED MXFP8 backward): the grouped_slots variant
    with dy's round trip along H as the slot rows (no [T*k, H] slot buffer) and the inverse order as
    the slot order; at BF16 a fresh slot buffer and the order itself. Where 2I > H dgu's round trip
    along the tokens has its own buffer; where 2I <= H (``wd_first``, always taken there: the
    ``MOK_CUTE_FUSED_BWD_MX_WD_FIRST=0`` opt-out is gone) it is written over dy's and no [M, 2I]
    buffer is made for it."""
    from mok_cute.kernels.quant import dequant_mxfp8
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip_tokens", lambda a, offs, out=None: a.clone() + 1)
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip", lambda a, out=None: a.clone() + 2)
    t, k, m, h = 100, 2, 200, 256
    dy, x = torch.randn(m, h).to(torch.bfloat16), torch.randn(m, h).to(torch.bfloat16)
    offsets = torch.tensor([0, 50, m], dtype=torch.int32)
    idx = torch.zeros(t, k, dtype=torch.int32)
    order = torch.randperm(t * k)
    wide = (torch.randn(2, 192, h).to(torch.bfloat16), torch.randn(2, 192, h).to(torch.bfloat16),
            torch.randn(2, h, 192).to(torch.bfloat16))  # 2I = 384 > H
    wide_rows = fused_bwd.ExpertRows(dy, x, torch.randn(m, 384).to(torch.bfloat16),
                                     torch.randn(m, 192).to(torch.bfloat16), offsets)
    for mx, rows, wts in ((True, wide_rows, wide), (False, fused_bwd.ExpertRows(dy, x, gu, hh, offsets), weights)):
        fused_bwd.fused_backward_core(rows, wts, 4.0, fused_bwd.BackwardLaunch(mx=mx), tokens=(order, idx, None))
        a = _launched((fake.calls or fake.direct)[-1])
        assert (keys[-1][2].grouped_slots, keys[-1][2].wd_first) == (mx, False)
        if mx:
            assert a["slots"].slot.data_ptr() == a["routed"].dy.data_ptr() and torch.equal(a["routed"].dy, dy + 2)
            assert torch.equal(a["slots"].order, fused_bwd.grouped_rows(order.to(torch.int32), t * k))
            assert a["mx"].dgu_t3.data_ptr() != a["mx"].dy_t.data_ptr()
        else:
            assert tuple(a["slots"].slot.shape) == (t * k, h) and a["slots"].slot.data_ptr() != dy.data_ptr()
            assert torch.equal(a["slots"].order, order.to(torch.int32))
    # 2I <= H: dgu's token round trip over dy's, the dW_down tiles first, and no [M, 2I] buffer made for it (only
    # D2's own dgu: a buffer allocated and dropped would still count at the memory peak)
    shapes, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: shapes.append(tuple(s[0]) if len(s) == 1 else s) or empty(*s, **kw))
    fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, x, gu, hh, offsets), weights, 4.0,
                                  fused_bwd.BackwardLaunch(mx=True), tokens=(order, idx, None))
    monkeypatch.setattr(torch, "empty", empty)
    a = _launched((fake.calls or fake.direct)[-1])
    assert (keys[-1][2].grouped_slots, keys[-1][2].wd_first) == (True, True)
    assert a["mx"].dgu_t3.data_ptr() == a["mx"].dy_t.data_ptr() and a["routed"].dg.data_ptr() == a["mx"].dy_t.data_ptr()
    assert shapes.count((m, 2 * weights[0].shape[1])) == 1, shapes


def test_host_core_mx_prologue_operands(monkeypatch):
    """fused_backward_core(mx, mx_dyt=) (FUSED at MXFP8 after the MXFP8 prologue, ``route_grad``'s
    ``mx_dy_rows_and_dtopk_w`` and ``mx_x_rows``, always taken there: the ``MOK_CUTE_FUSED_BWD_MX_PROLOGUE=0``
    opt-out is gone): dy and x reach the launch as given (already their round trips along H and along the
    tokens), mx.dy_t is ``mx_dyt``, only h is round-tripped here (in place when consumed), and the variant is
    the FUSED MXFP8 one (grouped_slots, wd_first with 2I <= H)."""
    from mok_cute.kernels.quant import dequant_mxfp8
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    trips = []
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip_tokens",
                        lambda a, offs, out=None: trips.append("tokens") or a.clone() + 1)
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip", lambda a, out=None: trips.append("rows") or a.clone() + 2)
    t, k, m, h = 100, 2, 200, 256
    dy, x = torch.randn(m, h).to(torch.bfloat16), torch.randn(m, h).to(torch.bfloat16)
    dyt = torch.randn(m, h).to(torch.bfloat16)
    offsets = torch.tensor([0, 50, m], dtype=torch.int32)
    idx = torch.zeros(t, k, dtype=torch.int32)
    fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, x, gu, hh, offsets), weights, 4.0,
                                  fused_bwd.BackwardLaunch(mx=True), tokens=(torch.randperm(t * k), idx, None),
                                  consume=True, mx_dyt=dyt)
    a = _launched((fake.calls or fake.direct)[-1])
    assert trips == ["tokens"] and torch.equal(a["routed"].h, hh[:m] + 1)
    assert a["routed"].dy.data_ptr() == dy.data_ptr() and torch.equal(a["routed"].dy, dy)
    assert a["routed"].x.data_ptr() == x.data_ptr()
    assert a["mx"].dy_t.data_ptr() == dyt.data_ptr() and a["slots"].slot.data_ptr() == dy.data_ptr()
    assert (keys[-1][2].grouped_slots, keys[-1][2].wd_first) == (True, True)


def test_ep_host_launch_mx(monkeypatch):
    """fused_backward_ep at MXFP8 on CPU tensors (compile, launch and the round-trip kernel
    replaced): the mx ep variant, h's round trip along the tokens over the plan's experts as the
    routed h, a fresh [M, H] mx.dy_t for the launch to write, the shared expert's dx (made outside) as
    the slot sum's start and no shared tiles; mx with the shared tiles in the launch is refused."""
    from mok_cute.kernels.quant import dequant_mxfp8
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (ws, plan, dy, x, slot_rows, w_rows, idx, weights, gu, hh, sh) = _ep_host(monkeypatch)
    trips, m, h = [], 256, 256
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip_tokens",
                        lambda a, offs: trips.append((a, offs)) or a.clone() + 1)
    dxs = torch.randn(64, h).to(torch.bfloat16)
    inputs = fused_bwd.BackwardInputs(dy, x, slot_rows, gu, hh)
    fused_bwd.fused_backward_ep(ws, plan, inputs, w_rows, idx, weights, 4.0,
                                fused_bwd.BackwardLaunch(num_ctas=66, comm_ctas=6, mx=True), dx_shared=dxs)
    variant = keys[0][2]
    assert variant.init and variant.gather and not variant.shared and variant.mx and variant.ep
    (args,) = fake.direct
    a = _launched(args)
    (rt_in, rt_offs), = trips
    assert torch.equal(rt_in, hh) and rt_offs is plan.offsets and torch.equal(a["routed"].h, hh + 1)
    assert tuple(a["mx"].dy_t.shape) == (m, h) and a["mx"].dy_t.data_ptr() not in (a["routed"].dy.data_ptr(),
                                                                                  dy.data_ptr())
    assert a["slots"].init is dxs and a["shared"] is None
    with pytest.raises(ValueError, match="mx"):
        fused_bwd.fused_backward_ep(ws, plan, inputs, w_rows, idx, weights, 4.0, fused_bwd.BackwardLaunch(mx=True),
                                    shared=sh)
    with pytest.raises(ValueError, match="dx_shared"):
        fused_bwd.fused_backward_ep(ws, plan, inputs, w_rows, idx, weights, 4.0, dx_shared=dxs[:-1])


def test_ep_host_validates_before_staging(monkeypatch):
    """fused_backward_ep refuses wrong operands (named) before it stages anything in the workspace
    or compiles: slot rows not [T*k, H], w_rows not fp32 [M], a dy of the wrong shape."""
    from types import SimpleNamespace

    from conftest import FakeWorkspace
    from mok_cute.kernels.sm90 import fused_bwd

    t, h, k, m = 16, 64, 2, 64
    ws = FakeWorkspace(t, h, k)
    monkeypatch.setattr(ws, "acquire_src", lambda *a: (_ for _ in ()).throw(AssertionError("staged")))
    plan = SimpleNamespace(recv_src=torch.arange(m, dtype=torch.int32), offsets=torch.tensor([0, m], dtype=torch.int32))
    bf = torch.bfloat16
    dy, x, slots, w = torch.randn(t, h).to(bf), torch.randn(t, h).to(bf), torch.randn(t * k, h).to(bf), torch.rand(m)
    gu, hh, idx = torch.randn(m, 64).to(bf), torch.randn(m, 32).to(bf), torch.zeros(t, k, dtype=torch.int64)
    wts = (torch.randn(1, 32, h).to(bf), torch.randn(1, 32, h).to(bf), torch.randn(1, h, 32).to(bf))
    for (d, xx, r, ww), err, what in (((dy, x, slots.view(t, k, h), w), ValueError, "slot_rows"),
                                      ((dy, x, slots, w.double()), TypeError, "w_rows"),
                                      ((dy[:-1], x, slots, w), ValueError, "dy")):
        with pytest.raises(err, match=what):
            fused_bwd.fused_backward_ep(ws, plan, fused_bwd.BackwardInputs(d, xx, r, gu, hh), ww, idx, wts, None)


def test_x_gather_variant():
    """``x_gather`` (the layer's BF16 FUSED backward: x's token rows gathered in the dW_gate / dW_up loads, no
    grouped x rows): 0 spills, unserialized wgmma, the grouped_slots variant's GEMM work; the producer warpgroup's
    four warps share each gathered k-tile, 16 zero-filling 16-byte ``cp.async`` copies per lane at tile_n 256 (one
    per k-row of the warp), in warp 0's two W-tile loaders and the other warps' one, each k-tile's copies counted
    on its slot (``cp.async.mbarrier.arrive``, not ``.noinc``) before the warp's own arrival; the tiles handed on
    through two named barriers; refused without grouped_slots or at MXFP8."""
    rep = _report(True, True, False, grouped_slots=True, wd_first=True, x_gather=True)
    base = _report(True, True, False, grouped_slots=True, wd_first=True)
    _clean(rep)
    assert rep.ptx.count("wgmma.mma_async") == base.ptx.count("wgmma.mma_async")
    zfill = re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16, %r\d+;", rep.ptx)
    assert len(zfill) == 3 * 16
    assert rep.ptx.count("cp.async.mbarrier.arrive.shared::cta.b64") == 3
    assert rep.ptx.count("bar.sync \t10, 128;") >= 3 and rep.ptx.count("bar.arrive 11, 128;") == 1
    assert "cp.async.mbarrier.arrive.noinc" not in rep.ptx
    assert "cp.async.mbarrier.arrive" not in base.ptx
    for bad in (dict(), dict(mx=True, grouped_slots=True)):
        with pytest.raises(ValueError, match="x_gather"):
            _report(True, True, False, x_gather=True, **bad)


def test_gather_b_offset_is_the_dsl_layout():
    """The byte offsets the gathered-B loader writes (``mainloop.gather_b_offset``) are the DSL's MN-major 16-bit
    B stage layout with its 128-byte swizzle applied to byte addresses, for every (n, k) of two stages at tile_n
    128 and 256 (evaluated while tracing: static layouts give Python ints)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.tensor_utils import LayoutEnum

    from mok_cute.kernels.sm90.mainloop import gather_b_offset

    found = {}

    @cute.jit
    def trace():
        for tile_n in cutlass.range_constexpr(128, 257, 128):
            staged = sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (128, tile_n, 64), cutlass.BFloat16, 2)
            found[tile_n] = (str(staged.inner), [2 * cute.crd2idx((n, kk, s), staged.outer)
                                                 for s in range(2) for n in range(tile_n) for kk in range(64)])
    trace()
    for tile_n, (swizzle, offsets) in found.items():
        assert swizzle == "S<3,4,3>"
        swizzled = [b ^ (((b >> 7) & 7) << 4) for b in offsets]
        want = [s * tile_n * 128 + gather_b_offset(n, kk, 64) for s in range(2) for n in range(tile_n)
                for kk in range(64)]
        assert swizzled == want


def test_host_core_x_tok(monkeypatch):
    """fused_backward_core(x_tok=): the launch gets the layer's x [T, H] as the routed group's x and each grouped
    row's token (order // k) as ``tok``, compiles the ``x_gather`` variant; x_tok without consume / tokens, with
    x rows given, or at MXFP8 is a ValueError before any launch."""
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    t, k, m, h = 100, 2, 200, 256
    dy, x_tok = torch.randn(m, h).to(torch.bfloat16), torch.randn(t, h).to(torch.bfloat16)
    offsets = torch.tensor([0, 50, m], dtype=torch.int32)
    order = torch.randperm(m)
    idx = torch.zeros(t, k, dtype=torch.int64)
    fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, None, gu, hh, offsets), weights, 4.0,
                                  tokens=(order, idx, None), consume=True, x_tok=x_tok)
    a = _launched((fake.calls or fake.direct)[-1])["routed"]
    assert a.x.data_ptr() == x_tok.data_ptr() and a.tok.dtype == torch.int32
    assert torch.equal(a.tok, (order // k).to(torch.int32))
    assert keys[-1][2].x_gather and keys[-1][2].grouped_slots
    assert torch.equal(a_slots := _launched((fake.calls or fake.direct)[-1])["slots"].order,
                       fused_bwd.grouped_rows(order.to(torch.int32), t * k)) and a_slots.dtype == torch.int32
    order32 = order.to(torch.int32)  # an int32 order (the layer's, consumed): the tokens are written over it
    fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, None, gu, hh, offsets), weights, 4.0,
                                  tokens=(order32, idx, None), consume=True, x_tok=x_tok)
    a = _launched((fake.calls or fake.direct)[-1])["routed"]
    assert a.tok.data_ptr() == order32.data_ptr() and torch.equal(order32, (order // k).to(torch.int32))
    rows = fused_bwd.ExpertRows(dy, None, gu, hh, offsets)
    for kw in (dict(tokens=(order, idx, None)), dict(consume=True),
               dict(tokens=(order, idx, None), consume=True, launch=fused_bwd.BackwardLaunch(mx=True))):
        with pytest.raises(ValueError, match="x_tok"):
            fused_bwd.fused_backward_core(rows, weights, 4.0, x_tok=x_tok, **kw)
    with pytest.raises(ValueError, match="x_tok"):
        fused_bwd.fused_backward_core(rows._replace(x=dy), weights, 4.0, tokens=(order, idx, None), consume=True,
                                      x_tok=x_tok)


def test_host_core_dwd_resumes_after_the_dw_down_tiles(monkeypatch):
    """fused_backward_core(dwd=) (the layer's BF16 FUSED backward after down_weight_grad): the variant compiled
    without it (grouped_slots, wd_first), its ticket and dW_down-done words starting at E * the dW_down tiles
    of one expert (no dW_down tile is claimed, no dgrad1 tile waits for one), h None (gu's gate half stands in,
    unread), ``dwd`` returned as dW_down; at MXFP8, without consume or tokens, of the wrong shape, or with
    neither h nor dwd: a ValueError before any launch."""
    from mok_cute.kernels.sm90 import fused_bwd

    fake, keys, (_, _, _, _, _, _, _, weights, gu, hh, _) = _ep_host(monkeypatch)
    t, k, m, h, inter, e = 100, 2, 200, 256, 128, 2
    dy, x_tok = torch.randn(m, h).to(torch.bfloat16), torch.randn(t, h).to(torch.bfloat16)
    offsets = torch.tensor([0, 50, m], dtype=torch.int32)
    order, idx = torch.randperm(m), torch.zeros(t, k, dtype=torch.int64)
    kw = dict(tokens=(order, idx, None), consume=True, x_tok=x_tok)
    fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy.clone(), None, gu.clone(), hh, offsets), weights, 4.0, **kw)
    with_h = _launched((fake.calls or fake.direct)[-1])
    assert int(with_h["mCounters"][0]) == 0 and int(with_h["mCounters"][fused_bwd.WD_WORD]) == 0
    dwd = torch.randn(e, h, inter).to(torch.bfloat16)
    out = fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, None, gu, None, offsets), weights, 4.0, dwd=dwd, **kw)
    assert out[3] is dwd and keys[-1] == keys[-2]
    a = _launched((fake.calls or fake.direct)[-1])
    wd_tiles = e * (h // 128) * 1  # tile_m 128 over H, one 256-wide n-tile over I = 128
    assert int(a["mCounters"][0]) == wd_tiles and int(a["mCounters"][fused_bwd.WD_WORD]) == wd_tiles
    assert a["routed"].h.data_ptr() == gu.data_ptr() and tuple(a["routed"].h.shape) == (m, inter)
    launches = len(fake.calls or fake.direct)
    bad = (dict(kw, launch=fused_bwd.BackwardLaunch(mx=True), x_tok=None), dict(kw, consume=False, x_tok=None),
           dict(consume=True))
    for args in bad:
        with pytest.raises(ValueError, match="dwd"):
            fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, x_tok.new_zeros(m, h), gu, hh, offsets), weights,
                                          4.0, dwd=dwd, **args)
    with pytest.raises(ValueError, match="dwd must be contiguous bf16"):
        fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, None, gu, None, offsets), weights, 4.0,
                                      dwd=dwd[:, :, :64], **kw)
    with pytest.raises(ValueError, match="rows.h"):
        fused_bwd.fused_backward_core(fused_bwd.ExpertRows(dy, None, gu, None, offsets), weights, 4.0, **kw)
    assert len(fake.calls or fake.direct) == launches


def test_gate_up_grads_follow_the_weights_layout():
    """The fused backward's dW_gate / dW_up take their weights' layout (autograd then hands them over without a
    copy): the halves of one [E, 2I, H] buffer for the halves of one fc1 tensor, two contiguous tensors for
    separate weights (MoELayer's parameters) or interleaved views."""
    from mok_cute.kernels.sm90.fused_bwd import gate_up_grads

    base = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    dg, du = gate_up_grads(base[:, :8], base[:, 8:])
    assert dg._base is du._base and dg.stride() == base[:, :8].stride() and du.data_ptr() - dg.data_ptr() == 8 * 32 * 2
    for gate, up in ((torch.zeros(4, 8, 32, dtype=torch.bfloat16), torch.zeros(4, 8, 32, dtype=torch.bfloat16)),
                     (base[:, 0::2], base[:, 1::2]), (base[:, 8:], base[:, :8])):
        dg, du = gate_up_grads(gate, up)
        assert dg.is_contiguous() and du.is_contiguous() and dg._base is None and du._base is None
        assert dg.shape == du.shape == (4, 8, 32)


@pytest.mark.parametrize("tile_n", [64, 128, 256])
@pytest.mark.parametrize("warps", [1, 4])
def test_gather_b_lanes_cover_the_k_tile_once(tile_n, warps):
    """The gathered B's lane plan (``mainloop.gather_pass_row`` / ``gather_token_row``, the formulas the loader
    traces): over the warps, lanes and passes of one k-tile every (k-row, 16-byte unit) is copied exactly once,
    and in each pass the lane a shuffle reads (register ``q * rpp // 32``, lane ``(q * rpp + sub) % 32``) holds the
    token of the k-row being copied."""
    from mok_cute.kernels.sm90.mainloop import gather_pass_row, gather_token_row

    tile_k, units = 64, tile_n // 8
    rpp, per_warp = 32 // units, tile_k // warps
    copied = []
    for w in range(warps):
        held = {(j // 32, j % 32): gather_token_row(j, w, warps, rpp) for j in range(per_warp)}
        for q in range(per_warp // rpp):
            for lane in range(32):
                u, sub = lane % units, lane // units
                kr = gather_pass_row(q, w, sub, warps, rpp)
                assert held[(q * rpp // 32, (q * rpp + sub) % 32)] == kr
                copied.append((kr, u))
    assert sorted(copied) == [(kr, u) for kr in range(tile_k) for u in range(units)]


def test_mxfp8_backward_weights_keep_fc1_halves(monkeypatch):
    """At MXFP8 the backward's dequantized gate / up weights stay the halves of one tensor where the given ones
    are (so the fused backward's gradients are fc1's in one piece), and equal the halves dequantized one by one
    (blocks of 32 along 2I never straddle gate and up); separate weights stay separate."""
    from mok_cute import reference
    from mok_cute.dsl.host import halves_of
    from mok_cute.layers import sm90
    from mok_cute.layers.common import ExpertGroup

    def dequant(w, axis):  # the kernel's: [E*R, C] in blocks of 32 rows from row 0 (axis 1)
        assert axis == 1
        return reference.mx_round_trip(w.reshape(-1, w.shape[2]).float(), 0).bfloat16().view(w.shape)
    monkeypatch.setattr(sm90, "_mx_dequant_weight", dequant)
    base = torch.randn(2, 128, 64).bfloat16()
    gate, up, w_down = base[:, :64], base[:, 64:], torch.randn(2, 64, 64).bfloat16()
    group = ExpertGroup(None, None, torch.zeros(1), torch.zeros(1), "mxfp8")
    halves = sm90.Sm90ExpertMLP()._bwd_weights(group, gate, up, w_down)
    apart = sm90.Sm90ExpertMLP()._bwd_weights(group, gate.contiguous(), up.contiguous(), w_down)
    assert all(torch.equal(a, b) for a, b in zip(halves, apart))
    assert halves_of(*halves[:2]) is not None and halves_of(*apart[:2]) is None
    assert halves_of(gate, up) is not None and halves_of(up, gate) is None


def test_weight_tiles_wait_side_by_side():
    """A dW_gate / dW_up tile's producer waits for its expert's dgrad2 tiles with the warp's lanes side by side in
    the grouped_slots variants (the layer's BF16 and MXFP8 FUSED backward): the expert's first m-tile one warp sum
    (5 butterfly shuffles), the counters one per lane, then the warp meets; the core variant keeps the one-thread
    pass (no butterfly: its producer's registers)."""
    rep = _report(False, True, False, grouped_slots=True, wd_first=True, x_gather=True)
    core = _compiled(False)
    assert rep.ptx.count("shfl.sync.bfly") == 5 and "bar.warp.sync" in rep.ptx
    assert "shfl.sync.bfly" not in core.ptx

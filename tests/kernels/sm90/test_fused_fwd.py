"""The fused SM90 forward (kernels/sm90/fused_moe.py) on the CPU: it compiles for sm_90a with
the instructions its protocol needs, its task list (schedule/fused_tasks.py) is complete,
matches the grouped-tile walk and cannot deadlock on random and adversarial routings, its
host entry validates before any launch, and the backward reads its route-order rows
(route_grad ``rows_by_route``). The kernel itself runs in tools/checks/fused_fwd.py."""
import functools
import random
import re

import pytest
import torch

from mok_cute.kernels.operands import ExpertWeights, RoutePlan
from mok_cute.kernels import route_grad
from mok_cute.layers.grouped import route_sort
from mok_cute.schedule import fused_tasks as ft
from mok_cute.schedule.group_tiles import cta_tiles
from conftest import offsets_from


@functools.cache
def _compiled(clamp: bool, shared: bool, trace: bool = False):
    from mok_cute.kernels.sm90 import fused_moe

    return fused_moe.compile_fused_forward(clamp, shared, trace=trace, inspect=True)[1]


VARIANTS = [(True, True, False), (False, False, False), (True, False, False), (False, True, False), (True, True, True)]


@functools.cache
def _built(clamp: bool, shared: bool, **kw):
    """The compile report of one fused-forward variant (``kw``: :func:`compile_fused_forward`'s flags), once."""
    from mok_cute.kernels.sm90 import fused_moe

    return fused_moe.compile_fused_forward(clamp, shared, inspect=True, **kw)[1]


@pytest.mark.parametrize("clamp,shared,trace", VARIANTS)
def test_compiles_with_its_protocol(clamp, shared, trace):
    rep = _compiled(clamp, shared, trace)
    assert rep.registers, "no ptxas resource report parsed"
    for needed in ("wgmma.mma_async", "cp.async.bulk.tensor", "atom.global.release.add", "ld.acquire.sys",
                   "bar.arrive", "setmaxnreg", "fence.proxy.async.global", "mul.rn.f32", "add.rn.f32",
                   "%globaltimer"):
        assert needed in rep.ptx, needed
    assert ("st.global.v4" in rep.ptx) and ("multimem" not in rep.ptx)
    plain = _compiled(clamp, shared, False)  # the bounded waits read %globaltimer too; a trace adds stamps
    assert (rep.ptx.count("%globaltimer") > plain.ptx.count("%globaltimer")) == trace


_ALPHA = re.compile(r"0f[3B]FD9DB23\b")  # +-1.702 (gpt-oss's alpha) as an fp32 PTX immediate


@pytest.mark.parametrize("kw", [{}, {"helpers": True}], ids=["staged", "helpers"])
def test_gated_swiglu_variant(kw):
    """gpt-oss's SwiGLU (``gated``: alpha 1.702, up offset 1) in the R1 / S1 epilogues (stored by the consumers, or
    by the helper warps): the plain variant's GEMM code (wgmma count), no spills, alpha as an fp32 immediate."""
    from mok_cute.kernels.swiglu_math import Gated

    rep, plain = _built(True, True, gated=Gated(1.702, 1.0), **kw), _built(True, True, **kw)
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    assert rep.total_spill_bytes == 0
    assert _ALPHA.search(rep.ptx) and not _ALPHA.search(plain.ptx)


@pytest.mark.parametrize("clamp,shared", [(True, True), (False, False)])
def test_ep_variant_protocol(clamp, shared):
    """The EP > 1 variant (pull dispatch / push combine through the symmetric workspace) compiles
    with the comm protocol's instructions: system-scope release flags and acquire waits, a
    system-scope fence before them, arrival counters; unicast only; no spills."""
    from mok_cute.kernels.sm90 import fused_moe

    rep = fused_moe.compile_fused_forward(clamp, shared, ep=True, inspect=True)[1]
    plain = _compiled(clamp, shared)
    for needed in ("st.release.sys", "fence.acq_rel.sys", "atom.global.acq_rel.add"):
        assert needed in rep.ptx and needed not in plain.ptx, needed
    assert "ld.acquire.sys" in rep.ptx and "multimem" not in rep.ptx
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    assert rep.total_spill_bytes == 0


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["random", "one rank's experts", "nothing to one rank", "skewed + -1"])
def test_ep_schedule_complete(ep, name):
    """Every rank's task list completes and every route's GEMM2 row is pushed exactly once per
    column tile, EP 1/2/4/8 (schedule/fused_tasks.simulate_ep)."""
    gen = torch.Generator().manual_seed(ep)
    e, t, k = 16, 300, 4
    per_rank = []
    for r in range(ep):
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        if name == "one rank's experts":
            idx = idx % (e // ep)  # every route to rank 0's experts
        elif name == "nothing to one rank":
            idx = torch.where(idx // (e // ep) == ep - 1, torch.full_like(idx, -1), idx) if ep > 1 else idx
        elif name == "skewed + -1":
            idx[::3, 0] = 0
            idx[::5, -1] = -1
        per_rank.append(idx)
    rounds = ft.simulate_ep(per_rank, e, 128, n1=4, n1s=2, n2=3, shared=True, gemm_ctas=20, comm_ctas=4)
    assert len(rounds) == ep and all(r > 0 for r in rounds)


@pytest.mark.parametrize("clamp,shared,ep", [(True, True, False), (False, False, False), (True, True, True)])
def test_mxfp8_variant_round_trips_h(clamp, shared, ep):
    """The MXFP8 variant: the gather dequantizes e4m3 token rows, the SwiGLU epilogue quantizes h to
    e4m3 and dequantizes it back (the round-trip kernel's ops), everything else as the BF16
    variant; no spills. At EP = 1 the producer warps' background pieces dequantize too (more e4m3
    conversions than EP > 1's register gather in the comm CTAs alone; their named barrier 6, as the BF16
    background gather's)."""
    rep = _built(clamp, shared, mx=True, ep=ep)
    plain = _compiled(clamp, shared)
    for needed in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "shfl.sync.bfly"):
        assert needed in rep.ptx and needed not in plain.ptx, needed
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    assert rep.total_spill_bytes == 0
    if not ep:
        regs = _built(clamp, shared, mx=True, ep=True)
        assert rep.ptx.count("cvt.rn.f16x2.e4m3x2") > regs.ptx.count("cvt.rn.f16x2.e4m3x2")
        assert "bar.sync \t6, 96;" in rep.ptx and "bar.sync \t6, 96;" not in regs.ptx


@pytest.mark.parametrize("clamp,shared,trace", VARIANTS[:2])
def test_register_handback_order(clamp, shared, trace):
    """Before the slot sum the consumer warpgroups give registers back (setmaxnreg.dec 160) and
    a CTA barrier passes before the producer warpgroup takes them (setmaxnreg.inc 160): an
    increase takes from the CTA's pool warp by warp, so producer warps raising first would take
    the registers the consumers' first increase (to 232) still waits for, and the CTA stalls
    forever (seen on the H200 before the fix)."""
    ptx = _compiled(clamp, shared, trace).ptx
    dec = ptx.index("setmaxnreg.dec.sync.aligned.u32 \t160")
    inc = ptx.index("setmaxnreg.inc.sync.aligned.u32 \t160")
    assert dec < inc and re.search(r"bar\.sync \t0;", ptx[dec:inc]), "no CTA barrier between hand-back and take"
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t160") == 1


@pytest.mark.parametrize("clamp,shared,trace", VARIANTS)
def test_no_spills(clamp, shared, trace):
    rep = _compiled(clamp, shared, trace)
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", rep.log)]
    # (the unclamped variants spilled 80-104 bytes: the epilogues' loop-invariant shared addresses,
    # hoisted out of the consumers' task loop; fused_moe._opaque rebuilds them per tile)
    assert spills == [0], spills


ROUTINGS = {
    "uniform": lambda e, m: [m // e] * e,
    "one expert": lambda e, m: [m] + [0] * (e - 1),
    "last expert": lambda e, m: [0] * (e - 1) + [m],
    "nothing routed": lambda e, m: [0] * e,
    "ragged": lambda e, m: [(7 * i * i + 3) % 300 for i in range(e)],
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("shared", [False, True])
def test_schedule_completes_without_deadlock(name, shared):
    for e, tokens in ((1, 128), (8, 1000), (16, 129)):
        offs = offsets_from(ROUTINGS[name](e, 4 * tokens))
        for gemm, comm in ((1, 1), (7, 2), (130, 2), (3, 40)):
            ft.simulate(offs, tokens, 128, n1=4, n1s=2, n2=3, shared=shared, gemm_ctas=gemm, comm_ctas=comm)


@pytest.mark.parametrize("ring", [False, True])
def test_schedule_random_routings(ring):
    """Random routings (a hot expert, -1 slots), shapes and CTA counts; with ``ring``, a random
    ring size and a band no wider than it."""
    rng = random.Random(int(ring))
    for _ in range(40):
        e, tokens = rng.choice([1, 2, 8, 32]), rng.randint(1, 900)
        counts = [0] * e
        for _ in range(tokens * rng.randint(1, 4)):
            if rng.random() < 0.9:
                counts[0 if rng.random() < 0.4 else rng.randrange(e)] += 1
        slots = rng.randint(1, 20) if ring else None
        ft.simulate(offsets_from(counts), tokens, 128, n1=rng.randint(1, 8), n1s=rng.randint(1, 4),
                    n2=rng.randint(1, 6), shared=rng.random() < 0.5, gemm_ctas=rng.randint(1, 140), comm_ctas=rng.randint(1, 40),
                    seed=rng.randint(0, 99),
                    gather=ft.Gather(ring=slots, band=rng.randint(1, slots) if ring else None))


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_ring_schedule_completes_without_deadlock(name):
    """The ring: a gather reusing a slot waits for the slot's previous m-tile's GEMM1 tiles; with
    bands no wider than the ring that never deadlocks, down to one slot and one GEMM CTA."""
    for e, tokens in ((1, 300), (8, 1000), (16, 129)):
        offs = offsets_from(ROUTINGS[name](e, 4 * tokens))
        for ring, band in ((1, 1), (2, 2), (3, 2), (8, 8), (16, 4)):
            for gemm, comm in ((1, 1), (7, 2), (3, 40)):
                ft.simulate(offs, tokens, 128, n1=4, n1s=2, n2=3, shared=True, gemm_ctas=gemm, comm_ctas=comm,
                            gather=ft.Gather(ring=ring, band=band), seed=ring)


def test_ring_wider_bands_than_slots_deadlock():
    """The mirror is not vacuous about the ring: bands wider than the ring (an m-tile's GEMM1
    tiles after a later m-tile's, whose gather waits for them) deadlock."""
    with pytest.raises(AssertionError, match="deadlock"):
        ft.simulate(offsets_from([128 * 6]), 128, 128, n1=4, n1s=1, n2=2, shared=False, gemm_ctas=4, comm_ctas=1,
                    gather=ft.Gather(ring=2, band=6))


def test_banded_task_list():
    """R1 in bands: each expert's m-tiles in groups of ``band``, a group's tiles n-tile outer; the
    same tiles as the unbanded walk, and an m-tile's GEMM1 tiles all before the next band's."""
    offs = offsets_from([700, 0, 129, 1, 512])
    plain = ft.task_list(offs, 700, 128, n1=3, n1s=2, n2=3, shared=True)
    banded = ft.task_list(offs, 700, 128, n1=3, n1s=2, n2=3, shared=True, band=2)
    assert sorted(plain) == sorted(banded) and [t for t in plain if t[0] != ft.R1] == [t for t in banded if t[0] != ft.R1]
    r1 = [t for t in banded if t[0] == ft.R1]
    assert [(t[5], t[2]) for t in r1[:6]] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    first, last = {}, {}
    for i, t in enumerate(r1):
        first.setdefault(t[5], i)
        last[t[5]] = i
    rows = ft.mtile_rows(offs, 128)
    assert [(r0, n) for _, r0, n in sorted({(t[5], t[3], t[4]) for t in r1})] == rows
    for mt in range(len(rows) - 2):  # m-tile mt's tiles end before m-tile mt + 2's start (bands of 2)
        assert last[mt] < first[mt + 2]


def test_task_list_matches_the_grouped_walk():
    """The routed phases walk the tile space of group_tiles (expert, n-tile, row0, rows), and the
    m-tile indices count each expert's m-tiles in order."""
    offs = offsets_from([300, 0, 129, 1, 512])
    tasks = ft.task_list(offs, 700, 128, n1=4, n1s=2, n2=3, shared=True)
    for phase, n in ((ft.R1, 4), (ft.R2, 3)):
        mine = [(e, nt, r0, rows) for p, e, nt, r0, rows, _ in tasks if p == phase]
        walk = [(e, nt, r0, rows) for e, _, nt, r0, rows in cta_tiles(offs, 128, n, 0, 1)]
        assert mine == walk
    mts = sorted({(e, r0, mt) for p, e, _, r0, _, mt in tasks if p == ft.R1})
    assert [mt for _, _, mt in mts] == list(range(len(mts)))
    assert sum(p == ft.S1 for p, *_ in tasks) == 6 * 2 and sum(p == ft.S2 for p, *_ in tasks) == 6 * 3


def test_simulate_detects_a_missing_dependency(monkeypatch):
    """The mirror is not vacuous: a task list whose GEMM2 waits for a GEMM1 tile that is never
    published deadlocks."""
    monkeypatch.setattr(ft, "needs", lambda task, n1, n1s, units=1: [("h", 10 ** 6, 1)] if task[0] == ft.R2 else [])
    with pytest.raises(AssertionError, match="deadlock"):
        ft.simulate(offsets_from([200]), 100, 128, n1=2, n1s=1, n2=2, shared=False, gemm_ctas=4, comm_ctas=1)


def test_route_order_rows_match_grouped_rows():
    """The backward's d topk_w from route-order rows (the fused forward's) equals the one from
    expert-grouped rows."""
    g = torch.Generator().manual_seed(3)
    t, k, e, h = 41, 3, 5, 64
    idx = torch.randint(-1, e, (t, k), generator=g)
    order, offsets, _ = route_sort(idx, e)
    dy = torch.randn(t, h, generator=g).bfloat16()
    w = torch.rand(t, k, generator=g)
    by_route = torch.randn(t * k, h, generator=g).bfloat16()
    grouped = by_route[order]
    a = route_grad.dy_rows_and_dtopk_w_torch(dy, grouped, order, w, offsets)
    b = route_grad.dy_rows_and_dtopk_w_torch(dy, by_route, order, w, offsets, rows_by_route=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_route_grad_by_route_compiles():
    _, rep = route_grad.compiled_route_grad("sm_90a", True)
    assert rep.registers and rep.total_spill_bytes == 0


def test_fused_entry_validates_before_launch():
    from mok_cute import MoKConfig
    from mok_cute.layers.sm90 import Sm90ExpertMLP

    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    wg = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    order, offsets, _ = route_sort(torch.zeros(16, 2, dtype=torch.int64), 2)
    plan = RoutePlan(order.int(), offsets, torch.zeros(16, 2, dtype=torch.int32), torch.zeros(16, 2))
    bad_down = ExpertWeights(wg, wg, torch.zeros(2, 256, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w_down"):
        Sm90ExpertMLP().fused_forward(x, plan, bad_down, None, None, MoKConfig())
    with pytest.raises(ValueError, match="CUDA"):
        Sm90ExpertMLP().fused_forward(x, plan, ExpertWeights(wg, wg, wg), None, None, MoKConfig())


def test_ptxas_report_parses_wrapped_entries():
    """ptxas puts the entry name on its own line when it warns (spills): still parsed."""
    from mok_cute.dsl.compile import _parse_ptxas

    log = ("ptxas info    : Function properties for\n          kern_a\n"
           "ptxas         .     48 bytes stack frame, 52 bytes spill stores, 52 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n")
    rep = _parse_ptxas(log, "sm_90a", "")
    assert rep.registers == {"kern_a": 168} and rep.spill_bytes == {"kern_a": 104}


def _fake_host(monkeypatch):
    """``fused_moe`` with compile and launch replaced (CPU): ``(module, launcher, compile keys)``; MXFP8 quantized by
    the reference on the CPU (each row's e4m3 data, then its scales, as ``quantize_mxfp8_rows_into`` packs them)."""
    from mok_cute import reference
    from mok_cute.kernels.quant import quantize
    from mok_cute.kernels.sm90 import fused_moe as fm

    from conftest import FakeLauncher

    fake, keys = FakeLauncher(), []
    monkeypatch.delenv("MOK_CUTE_PROGRESS", raising=False)
    monkeypatch.setattr(fm, "device_arch", lambda d: (0, "sm_90a"))
    monkeypatch.setattr(fm, "sm_count", lambda d: 132)
    monkeypatch.setattr(fm, "compile_cached", lambda key, build: keys.append(key) or fake)

    def rows_into(x, out, rt=None):
        q, s = reference.mxfp8_quantize(x)
        out[:, :x.shape[1]] = q.view(torch.uint8)
        out[:, x.shape[1]:x.shape[1] + s.shape[1]] = s
        if rt is not None:
            rt.copy_(reference.mxfp8_dequantize(q, s).to(x.dtype))
        return out

    monkeypatch.setattr(quantize, "quantize_mxfp8", reference.mxfp8_quantize)
    monkeypatch.setattr(quantize, "quantize_mxfp8_rows_into", rows_into)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    return fm, fake, keys


def _host_problem(fm, shared: bool, t=100, h=256, inter=256, e=4, k=2):
    """``(x, plan, experts, shared expert)`` of a small CPU problem: 2 * T routes, 50 per expert."""
    bf = torch.bfloat16
    x = torch.randn(t, h).to(bf)
    plan = fm.RoutePlan(torch.arange(t * k, dtype=torch.int32), torch.tensor([0, 50, 100, 150, 200], dtype=torch.int32),
                        torch.zeros(t, k, dtype=torch.int32), torch.rand(t, k))
    experts = fm.ExpertWeights(torch.randn(e, inter, h).to(bf), torch.randn(e, inter, h).to(bf),
                               torch.randn(e, h, inter).to(bf))
    sh = (torch.randn(inter, h).to(bf), torch.randn(inter, h).to(bf), torch.randn(h, inter).to(bf)) if shared else None
    return x, plan, experts, fm.SharedExpert.of(sh)


def test_host_launch_compiles_the_activation_in(monkeypatch):
    """fused_forward takes the activation as ``limit``: SwiGLU.gpt_oss()'s alpha and up offset go in the compile
    key (the variant's ``gated``), its limit 7 in the kernel's scalars; a plain SwiGLU(L) is the float L's variant."""
    from mok_cute.kernels.swiglu_math import Gated
    from mok_cute.reference import SwiGLU

    fm, fake, keys = _fake_host(monkeypatch)
    x, plan, experts, sh = _host_problem(fm, True)
    for act in (SwiGLU.gpt_oss(), SwiGLU(4.0), 4.0):
        fm.fused_forward(x, plan, experts, sh, act, fm.FusedLaunch(8, 1.0, ring_chunks=5))
    # (clamp, shared, ..., gate, gated, n_tail, helpers, mainloop)
    assert [(k[2], k[-4]) for k in keys] == [(True, Gated(1.702, 1.0)), (True, None), (True, None)]
    assert keys[1] == keys[2] and [args[5].limit.value for args in fake.calls] == [7.0, 4.0, 4.0]


@pytest.mark.parametrize("shared,mx,ep", [(False, False, False), (True, False, False), (True, True, False),
                                          (True, False, True), (False, True, True)])
def test_host_launch_matches_the_kernel_signature(monkeypatch, shared, mx, ep):
    """fused_forward's host side on CPU tensors (compile and launch replaced): EP = 1 replays a
    graph of the plain variant, EP > 1 launches the ep variant directly with the workspace's
    status, slots and epochs; the arguments are the kernel's ``__call__`` bundles, one per parameter, each of its
    bundle type with a field per kernel operand (a host / kernel mismatch fails here, not on the GPU)."""
    import inspect

    from mok_cute import reference

    from conftest import FakeWorkspace

    fm, fake, keys = _fake_host(monkeypatch)
    t, h, k = 100, 256, 2
    x, plan, experts, sh = _host_problem(fm, shared)
    ws = FakeWorkspace(t, h, k) if ep else None
    out = fm.fused_forward(x, plan, experts, sh, None,
                           fm.FusedLaunch(100 if ep else 8, 1.0, num_ctas=66 if ep else None, ring_chunks=5, mx=mx),
                           ws=ws)
    (args,) = fake.direct if ep else fake.calls
    assert len(fake.calls) + len(fake.direct) == 1
    # (..., trace, progress, mx, ep, gate, gated, n_tail, helpers, mainloop): no helpers below H = HELPERS_MIN_K
    assert keys[0][-9:-1] == (False, False, mx, ep, False, None, False, False)
    assert keys[0][-1] == fm.MainloopConfig().key()
    params = list(inspect.signature(fm.FusedMoeFwdSm90.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    bundles = (fm.FwdInputs, fm.FwdWeights, fm.FwdOutputs, fm.FwdRoutes, fm.FwdCounters, fm.FwdScalars, fm.FwdPeers)
    assert [type(a) for a in args[:7]] == list(bundles)
    inp, weights, outs, routes, sync, scalars, peers = args[:7]
    assert all((getattr(peers, n) is not None) == ep for n in ("peer", "w_rows", "slot_copy"))
    assert (outs.h_rt is not None) == mx and (outs.hs_rt is not None) == (mx and shared)
    assert (weights.s_gate is not None) == shared and (outs.s_out is not None) == shared
    assert (inp.xq is not None) == mx  # MXFP8: the token rows move as e4m3 + scales
    assert routes.gate is None and sync.trace is None  # no shared-expert output gate, no trace
    if mx:  # data bytes then E8M0 scales per token row, bitwise the reference quantizer's
        q, sc = reference.mxfp8_quantize(x)
        rows = inp.xq._keep
        assert torch.equal(rows[:, :h], q.view(torch.uint8)) and torch.equal(rows[:, h:h + h // 32], sc)
        assert ep == (ws is not None and rows.data_ptr() == ws._src.data_ptr())  # EP > 1: in the pull source
    assert int(args[7]) == (66 if ep else 132)  # the grid
    assert int(scalars.comm_ctas) == (65 if ep else 8)  # a GEMM CTA is left to free ring slots
    # the ring: 5 slots asked, 2 + 4 = 6 routed m-tiles at most; R1's bands never wider than the ring
    assert (int(scalars.ring), int(scalars.band)) == (5, 5) and tuple(inp.xg._keep.shape) == (5 * 128, h)
    assert isinstance(out, fm.FusedForwardOut) and out.y.shape == (t, h) and (out.s_out is not None) == shared
    if ep:
        assert out.w_rows is not None and out.w_rows.shape == (t * k,)
        assert outs.slot._keep.data_ptr() == ws._slots.data_ptr() and out.counters[-1] is ws.status
        assert out.slot_out is peers.slot_copy._keep and out.slot_out.shape == (t * k, h)  # the slot sum's copy
        assert (int(peers.epoch_pull), int(peers.epoch_push), int(peers.me)) == (1, 1, 1)
    else:
        assert out.w_rows is None and peers is fm._NO_PEERS


def test_trace_is_a_launch_choice_not_the_environment(monkeypatch):
    """The launcher reads no trace variable: ``FusedLaunch.trace`` alone picks the traced variant and its record
    buffer (the layer resolves ``MoKConfig.trace`` against ``MOK_CUTE_TRACE`` before it launches)."""
    fm, fake, keys = _fake_host(monkeypatch)
    x, plan, experts, sh = _host_problem(fm, True)
    for env_value, trace in (("1", False), ("0", True)):
        monkeypatch.setenv("MOK_CUTE_TRACE", env_value)
        fm.fused_forward(x, plan, experts, sh, 4.0, fm.FusedLaunch(8, 1.0, trace=trace))
        sync = fake.calls[-1][4]
        assert keys[-1][2 + 2] is trace and (sync.trace is not None) == trace
    records, comm = fm.last_trace()
    assert comm == 8 and records.shape[1] == fm.TRACE_WORDS and sync.trace._keep.data_ptr() == records.data_ptr()


def test_operand_bundles():
    """The host bundles: a shared expert's gate needs the shared expert; the launch policy's defaults (every SM,
    one ring slot per m-tile, no trace, BF16); a fused forward's result unpacks as the 9-tuple the layers read."""
    from mok_cute.kernels import operands as ops

    w = torch.zeros(4, 8)
    assert ops.SharedExpert.of(None) is None
    sh = ops.SharedExpert.of((w, w, w), gate=torch.ones(3))
    assert sh.weights == (w, w, w) and sh.gate.shape == (3,) and ops.SharedExpert.of((w, w, w)).gate is None
    with pytest.raises(ValueError, match="output gate needs a shared expert"):
        ops.SharedExpert.of(None, gate=torch.ones(3))
    launch = ops.FusedLaunch(16, 30.0)
    assert (launch.num_ctas, launch.ring_chunks, launch.trace, launch.mx) == (None, None, False, False)
    with pytest.raises(AttributeError):
        launch.trace = True  # frozen
    out = ops.FusedForwardOut(*range(9))
    y, gu, h, slot, gus, hs, s_out, counters, w_rows = out
    assert out[:7] == (0, 1, 2, 3, 4, 5, 6) and (counters, w_rows) == (out.counters, out.w_rows) == (7, 8)


def test_schedule_mirror_detects_a_wrong_order(monkeypatch):
    """The ticket mirror fails when a task waits for a later one (the list reversed)."""
    real = ft.task_list
    monkeypatch.setattr(ft, "task_list", lambda *a: real(*a)[::-1])
    with pytest.raises(AssertionError, match="deadlock"):
        ft.simulate(offsets_from([300, 200]), 100, 128, n1=2, n1s=1, n2=2, shared=True, gemm_ctas=2, comm_ctas=1)


def test_gate_variant_scales_the_shared_start():
    """The shared expert's output gate: the slot sum starts from fp32(s_out) * gate[t] (one more
    mul.rn.f32 per element of the start), 0 spills; refused without the shared expert."""
    from mok_cute.kernels.sm90 import fused_moe as fm

    rep = _built(True, True, gate=True)
    plain = _built(True, True)
    assert rep.total_spill_bytes == 0 and "serialized" not in rep.log
    assert rep.ptx.count("mul.rn.f32") == plain.ptx.count("mul.rn.f32") + 8
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    with pytest.raises(ValueError, match="gate.*needs shared"):
        fm.compile_fused_forward(True, False, gate=True)


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_background_gather_schedule_completes(name):
    """gather="bg": the comm CTAs fill the ring, every CTA's background warps gather the later
    chunks in pieces beside the GEMM tasks; complete down to one slot, one GEMM CTA and one comm
    CTA, and with a ring as large as every chunk (no background pieces)."""
    for e, tokens in ((1, 300), (8, 1000), (16, 129)):
        offs = offsets_from(ROUTINGS[name](e, 4 * tokens))
        for ring, band in ((1, 1), (2, 2), (8, 8), (16, 4), (None, None)):
            for gemm, comm in ((1, 1), (7, 2), (3, 40)):
                ft.simulate(offs, tokens, 128, n1=4, n1s=2, n2=3, shared=name != "ragged", gemm_ctas=gemm,
                            comm_ctas=comm, seed=gemm, gather=ft.Gather("bg", ring, band))


def test_background_gather_needs_every_piece(monkeypatch):
    """The mirror is not vacuous about pieces: if an R1 tile waited for one piece only, the slot of a
    chunk would be reused while its later pieces were still being written; the mirror's chunk
    target is PIECES and dropping one piece of a chunk deadlocks."""
    real = ft.strided
    monkeypatch.setattr(ft, "strided", lambda jobs, ctas: real(jobs[1:], ctas))  # lose the first background piece
    with pytest.raises(AssertionError, match="deadlock"):
        ft.simulate(offsets_from([128 * 6]), 128, 128, n1=2, n1s=1, n2=2, shared=False, gemm_ctas=2, comm_ctas=1,
                    gather=ft.Gather("bg", ring=2, band=2))


def test_gather_paths_compile():
    """The BF16 gathers compile with 0 spills: at EP = 1 the comm CTAs move their rows (the ring's first fill) with
    16-byte cp.async copies into the stages (waiting one batch behind) and fence them before the TMA loads, and the
    background warps have their named barrier; at EP > 1 the comm CTAs pull every chunk through registers: none of
    the staging."""
    from mok_cute.kernels.sm90 import fused_moe as fm

    bg, regs = _built(True, True), _built(True, True, ep=True)
    assert bg.total_spill_bytes == 0 and regs.total_spill_bytes == 0
    wait1, bg_bar = r"cp\.async\.wait_group\s+1;", rf"bar\.sync\s+{fm.BG_BARRIER},\s*96;"
    assert "cp.async.cg.shared.global" in bg.ptx and re.search(wait1, bg.ptx)
    assert "fence.proxy.async.shared::cta" in bg.ptx and re.search(bg_bar, bg.ptx)
    assert not re.search(wait1, regs.ptx) and not re.search(bg_bar, regs.ptx)


def test_gather_path_follows_ep():
    """Which gather a variant runs is decided by EP and precision, nothing else: EP = 1 the background gather (BF16
    staging its first fill), EP > 1 the register pulls; the helper warps only at EP = 1."""
    from mok_cute.kernels.sm90 import fused_moe as fm

    for mx in (False, True):
        op = fm.FusedMoeFwdSm90(True, True, mx=mx)
        assert op.bg and op.staged == (not mx) and op.gather_units == fm.PIECES and op.bg_warps == fm.BG_WARPS
        ep = fm.FusedMoeFwdSm90(True, True, mx=mx, ep=True)
        assert not ep.bg and not ep.staged and ep.gather_units == 1
        with pytest.raises(ValueError, match="helpers"):
            fm.FusedMoeFwdSm90(True, True, mx=mx, ep=True, helpers=True)
    with pytest.raises(ValueError, match="trace and progress"):
        fm.FusedMoeFwdSm90(True, True, trace=True, progress=True)


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_direct_gather_schedule_completes(name):
    """gather="direct": no gather jobs, every CTA claims tickets from the start and R1 waits for nothing; the
    list completes on every routing, down to one CTA."""
    for e, tokens in ((1, 300), (8, 1000), (16, 129)):
        offs = offsets_from(ROUTINGS[name](e, 4 * tokens))
        for gemm, comm in ((1, 1), (7, 2), (3, 40)):
            ft.simulate(offs, tokens, 128, n1=4, n1s=2, n2=3, shared=name != "ragged", gemm_ctas=gemm,
                        comm_ctas=comm, seed=gemm, gather=ft.Gather("direct"))


def test_direct_gather_mirror_detects_a_wrong_order(monkeypatch):
    """The direct mirror still runs the R2 / S2 waits: the list reversed deadlocks."""
    real = ft.task_list
    monkeypatch.setattr(ft, "task_list", lambda *a: real(*a)[::-1])
    with pytest.raises(AssertionError, match="deadlock"):
        ft.simulate(offsets_from([300, 200]), 100, 128, n1=2, n1s=1, n2=2, shared=True, gemm_ctas=2, comm_ctas=1,
                    gather=ft.Gather("direct"))


@pytest.mark.parametrize("units", [8, 360, 512, 896, 1000])
@pytest.mark.parametrize("cap", [1, 5, 12])
def test_staged_gather_batches_cover_each_unit_once(units, cap):
    """slot_rows.staged_plan / staged_batch (the staged gather's indexing, as the kernel runs it): over a
    CTA's warps, lanes and batches, every (row, 16-byte unit) of ``rows`` rows is moved exactly once,
    no lane holds more than ``cap`` units of a batch, and a row takes the fewest batches, of even size."""
    from mok_cute.kernels import slot_rows

    warps = 12
    for rows in (0, 1, 5, 11, 128):
        moved = []
        for warp in range(warps):
            per, cpr, n = slot_rows.staged_plan(rows, units, warp, warps, cap)
            per_row = -(-units // 32)
            assert per <= cap and cpr == -(-per_row // cap) and per == -(-per_row // cpr)  # fewest, even batches
            for b in range(n):
                rr, c0 = slot_rows.staged_batch(b, warp, warps, cpr, per)
                assert rr < rows
                moved += [(rr, cu) for lane in range(32) for u in range(per)
                          if (cu := c0 + u * 32 + lane) < units]
        assert sorted(moved) == [(r, u) for r in range(rows) for u in range(units)]


# ---------------------------------------------------------------- the device decodes, run on the host
@functools.cache
def _host_decoder():
    """``fused_tasks.task`` (the device decode the fused forward's roles run) compiled as a host function: decodes
    the ids ``start, start + step, ..`` below ``n_tasks`` into ``out`` [n_tasks, 6] (phase, expert, n_tile, row0,
    rows, mt), carrying its cursors as a CTA does."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    @cute.jit
    def decode(out: cute.Tensor, offsets: cute.Tensor, n_s1: Int32, n_r1: Int32, n_s2: Int32, m_sh: Int32, n1: Int32,
               n2: Int32, tokens: Int32, band: Int32, n_tasks: Int32, start: Int32, step: Int32):
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        for t in cutlass.range(start, n_tasks, step, unroll=1):
            phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2 = ft.task(
                t, ft.ListShape(n_s1, n_r1, n_s2, m_sh, n1, n2), offsets, offsets.shape[0] - 1, tokens, 128, band, e1,
                b1, e2, b2)
            for i, v in enumerate((phase, expert, n_tile, row0, rows, mt)):
                out[t, i] = v
    return decode


@pytest.mark.parametrize("shared", [False, True])
def test_device_decode_matches_the_mirror(shared):
    """The device decode itself (run on the host) walks the task list of the pure-Python mirror (R1 in bands), in
    list order and along a CTA's strided ids (its cursors only move forward)."""
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    counts, tokens, n1, n1s, n2, band = [300, 0, 129, 1000, 7, 128], 700, 3, 2, 5, 2
    offs = offsets_from(counts)
    lst = ft.task_list(offs, tokens, 128, n1, n1s if shared else 0, n2, shared, band)
    m_sh = -(-tokens // 128)
    m_routed = len(ft.mtile_rows(offs, 128))
    n_s1 = m_sh * n1s if shared else 0
    n_s2 = m_sh * n2 if shared else 0
    decode = _host_decoder()
    for start, step in ((0, 1), (1, 7), (5, 131), (2, 3)):
        out = torch.full((len(lst), 6), -7, dtype=torch.int32)
        decode(from_dlpack(out), from_dlpack(torch.tensor(offs, dtype=torch.int32)), Int32(n_s1), Int32(m_routed * n1),
               Int32(n_s2), Int32(m_sh), Int32(n1), Int32(n2), Int32(tokens), Int32(band), Int32(len(lst)),
               Int32(start), Int32(step))
        for t in range(start, len(lst), step):
            phase, expert, n_tile, row0, rows, mt = out[t].tolist()
            want = lst[t]
            routed = want[0] in (ft.R1, ft.R2)
            assert (phase, n_tile, row0, rows, mt) == (want[0], want[2], want[3], want[4], want[5]), (t, want)
            assert expert == (want[1] if routed else 0), (t, want)


@functools.cache
def _host_mtile_decoder():
    """``fused_tasks.routed_mtiles`` and ``fused_tasks.mtile`` (a gather chunk's rows: the ring's chunks, the
    background pieces) compiled as a host function over chunks ``start, start + step, ..``: ``out`` [n, 2] (row0,
    rows), ``total`` [1] the routed m-tiles."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    @cute.jit
    def decode(out: cute.Tensor, total: cute.Tensor, offsets: cute.Tensor, start: Int32, step: Int32):
        e = offsets.shape[0] - 1
        n = ft.routed_mtiles(offsets, e, 128)
        total[0] = n
        ge, gb = Int32(0), Int32(0)
        for c in cutlass.range(start, n, step, unroll=1):
            row0, rows, ge, gb = ft.mtile(offsets, e, 128, c, ge, gb)
            out[c, 0] = row0
            out[c, 1] = rows
    return decode


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_device_mtile_decode_matches_the_mirror(name):
    """The gather chunks' device decode (run on the host) gives mtile_rows' (row0, rows) for every routed m-tile,
    in order and along a strided CTA sequence."""
    from cutlass.cute.runtime import from_dlpack
    from cutlass import Int32

    offs = offsets_from(ROUTINGS[name](8, 4000))
    want = ft.mtile_rows(offs, 128)
    for start, step in ((0, 1), (2, 5)):
        out, total = torch.full((max(1, len(want)), 2), -7, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        _host_mtile_decoder()(from_dlpack(out), from_dlpack(total), from_dlpack(torch.tensor(offs, dtype=torch.int32)),
                              Int32(start), Int32(step))
        assert int(total[0]) == len(want)
        for c in range(start, len(want), step):
            assert tuple(out[c].tolist()) == want[c], (c, want[c])


@pytest.mark.parametrize("shared,n_tail,mx", [(True, False, False), (False, True, False), (True, False, True)])
def test_helpers_variant(shared, n_tail, mx):
    """``helpers``: the S1 / R1 tiles' h by the producer warpgroup's last two warps (beside the one background
    gather warp): the consumers hand a staged tile and its coordinates over (STAGED, FREE named barriers over the
    consumers and the helpers; the helpers never take the producer's hand-offs), the helpers meet on their own
    barrier and publish; MXFP8: the helpers also write h's round trip (the e4m3 converts both ways and the block
    amax's three butterfly steps over 8 lanes); 0 spills; refused with EP > 1."""
    from mok_cute.kernels.sm90 import fused_moe
    from mok_cute.kernels.sm90.grouped_gemm import FREE_BARRIER, STAGED_BARRIER, helper_threads

    op = fused_moe.FusedMoeFwdSm90(False, shared, mx=mx, helpers=True)
    assert (op.helper_warps, op.bg_warps, op.bg_bulk) == (2, 1, not mx)
    rep = _built(False, shared, mx=mx, n_tail=n_tail, helpers=True)
    n = helper_threads(2)
    # the consumers arrive on STAGED and wait on FREE, the helpers the other way round
    assert f"bar.sync \t{STAGED_BARRIER}, {n}" in rep.ptx and f"bar.sync \t{FREE_BARRIER}, {n}" in rep.ptx
    assert f"bar.arrive {FREE_BARRIER}, {n}" in rep.ptx and f"bar.arrive {STAGED_BARRIER}, {n}" in rep.ptx
    assert f"bar.sync \t{fused_moe.HELPERS_BARRIER}, 64" in rep.ptx
    assert f"bar.sync \t{fused_moe.BG_BARRIER}, 32" in rep.ptx
    for inst in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2"):
        assert rep.has(inst) == mx, inst
    assert rep.total_spill_bytes == 0
    with pytest.raises(ValueError, match="helpers"):
        fused_moe.FusedMoeFwdSm90(False, shared, mx=mx, helpers=True, ep=True)


def test_helpers_rule():
    """The measured rule (docs/design-decisions.md, 2026-12-02/03): the helper warps at EP = 1 from a GEMM1 depth H of
    ``HELPERS_MIN_K`` (BF16) or ``HELPERS_MX_MIN_K`` (MXFP8), never at EP > 1."""
    from mok_cute.kernels.sm90 import fused_moe as fm
    from mok_cute.kernels.sm90.grouped_gemm import HELPERS_MIN_K, HELPERS_MX_MIN_K

    assert fm.fused_helpers(False, False, HELPERS_MIN_K) and not fm.fused_helpers(False, False, HELPERS_MIN_K - 64)
    assert fm.fused_helpers(True, False, HELPERS_MX_MIN_K) and not fm.fused_helpers(True, False, HELPERS_MX_MIN_K - 64)
    assert not fm.fused_helpers(True, False, HELPERS_MIN_K)
    assert not fm.fused_helpers(False, True, HELPERS_MX_MIN_K) and not fm.fused_helpers(True, True, HELPERS_MX_MIN_K)


def test_helpers_launch_at_depth(monkeypatch):
    """The host launches the helpers variant by :func:`fused_helpers`: at H 2048 BF16 (EP = 1) yes, MXFP8 no (its
    threshold is H 7168), nor with tile_n 128 (the helper lanes span a 256-wide tile's half); the compile key's last
    entries are (n_tail, helpers, the mainloop's key)."""
    fm, fake, keys = _fake_host(monkeypatch)
    x, plan, experts, sh = _host_problem(fm, False, h=2048)
    for mx in (False, True):
        fm.fused_forward(x, plan, experts, sh, None, fm.FusedLaunch(8, 1.0, mx=mx))
        assert keys[-1][-3:-1] == (False, not mx)
    fm.fused_forward(x, plan, experts, sh, None, fm.FusedLaunch(8, 1.0, tile_n=128))
    assert keys[-1][-3:] == (False, False, fm.MainloopConfig(tile_n=128).key())
    assert not fm.fused_helpers(False, False, 2048, 128) and fm.fused_helpers(False, False, 2048, 256)
    with pytest.raises(ValueError, match="tile_n 256 only, got 128"):
        fm.FusedMoeFwdSm90(False, False, helpers=True, cfg=fm.MainloopConfig(tile_n=128))


@pytest.mark.parametrize("tile_n,stages,n_tail", [(None, None, True), (128, None, False), (128, 4, False),
                                                  (256, 2, True)])
def test_launch_tiles_reach_the_compile_key(monkeypatch, tile_n, stages, n_tail):
    """``FusedLaunch.tile_n`` / ``stages`` (the policy's ``fused_forward``) pick the compiled mainloop (its key in
    the compile key: every field that changes the binary) and the host's tile arithmetic: n_tail by tile_n (I 192:
    a partial 128-wide GEMM1 tile at tile_n 256, none at tile_n 128), the trace's task records (GEMM1 n-tiles of
    tile_n / 2 columns, GEMM2 of tile_n). None, None: the default mainloop, ``MainloopConfig()``."""
    fm, fake, keys = _fake_host(monkeypatch)
    x, plan, experts, sh = _host_problem(fm, True, h=256, inter=192)
    fm.fused_forward(x, plan, experts, sh, 4.0, fm.FusedLaunch(8, 1.0, trace=True, tile_n=tile_n, stages=stages))
    want = fm.MainloopConfig(tile_n=tile_n or 256, stages=stages or 0)
    assert keys[-1][-1] == want.key() and keys[-1][-3] is n_tail
    records, _ = fm.last_trace()
    tn = tile_n or 256
    sizes = fm.counter_sizes(100, 200, 4)
    tasks = sizes[2] * (-(-192 // (tn // 2)) + -(-256 // tn)) + sizes[1] * (-(-192 // (tn // 2)) + -(-256 // tn))
    assert records.shape[0] == sizes[0] + tasks + 2 * 132


def test_bulk_background_gather_variant():
    """The BF16 background gather's one warp beside the helpers: lane 0 moves the rows by ``cp.async.bulk`` global
    -> shared (mbarrier ``complete_tx``) and shared -> global (bulk groups, a stage reused only once the store that
    read it is done), proxy fences on both sides of the async-proxy writes, the piece's release add after every
    store completed; 0 spills; also with H not a multiple of 256 (gpt-oss's 2880). MXFP8's background warp beside
    the helpers dequantizes through its registers instead."""
    rep = _built(True, True, helpers=True)
    assert rep.total_spill_bytes == 0 and "serialized" not in rep.log
    for inst in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                 "cp.async.bulk.global.shared::cta.bulk_group", "fence.proxy.async.global", "mbarrier.try_wait.parity"):
        assert rep.has(inst), inst
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", rep.ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", rep.ptx)
    tail = _built(False, False, n_tail=True, helpers=True)
    assert tail.total_spill_bytes == 0 and tail.has("cp.async.bulk.global.shared::cta.bulk_group")
    assert not _built(True, True, mx=True, helpers=True).has("cp.async.bulk.global.shared::cta.bulk_group")

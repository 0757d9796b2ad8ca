"""Virtual ranks (mok_cute.comm.virtual) on the CPU: world and rank per thread, the host
collectives over threads, errors and stalls, the workspaces' shared peer table, and the reference
backend on a virtual group of R = 2 and 4 equal to the global EP = 1 reference bitwise."""
import threading
import time

import pytest
import torch

import mok_cute
import mok_cute.comm.workspace as W
import mok_cute.layers.select as B
from mok_cute import reference as R
from mok_cute.comm.virtual import VirtualGroup, run_ranks


@pytest.mark.parametrize("size", [1, 2, 4])
def test_world_and_rank_per_thread(size):
    g = VirtualGroup(size, "cpu")

    def fn(r):
        g.barrier()  # every rank's thread is alive at once: their idents are distinct
        return g.rank(), g.size(), R._world(g), threading.get_ident(), torch._C._is_multithreading_enabled()

    got = run_ranks(g, fn)
    assert [v[:3] for v in got] == [(r, size, (size, r)) for r in range(size)]
    assert len({v[3] for v in got}) == size and threading.get_ident() not in {v[3] for v in got}
    assert not any(v[4] for v in got)  # backward runs in the rank's own thread
    assert torch._C._is_multithreading_enabled()  # the caller's setting is untouched
    with pytest.raises(RuntimeError, match="outside a rank thread"):
        g.rank()
    with pytest.raises(RuntimeError, match="outside a rank thread"):
        R._world(g)


def test_the_reference_sees_a_virtual_group_by_its_interface():
    """The reference imports no comm code: a virtual group is a ``reference.HostGroup`` by its
    methods (size, rank, all_gather); a torch.distributed group and None are not."""
    import torch.distributed as dist

    g = VirtualGroup(2, "cpu")
    assert isinstance(g, R.HostGroup)
    assert not isinstance(None, R.HostGroup) and not isinstance(object(), R.HostGroup)
    if dist.is_available():
        assert not issubclass(dist.ProcessGroup, R.HostGroup)
    assert R._world(None) == (1, 0) or dist.is_initialized()
    got = run_ranks(g, lambda r: R._all_gather(torch.full((r + 1, 2), float(r)), g, 2))
    assert all(len(v) == 2 and v[0].shape == (1, 2) and v[1].shape == (2, 2) for v in got)


def test_layer_backends_see_the_virtual_ep():
    from conftest import make_problem

    p, _ = make_problem(T=4, H=256, I=256, E=2)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    g = VirtualGroup(2, "cpu")
    run_ranks(g, lambda r: B.get_backend("sm90").check(inp, mok_cute.MoKConfig(), g))  # EP = 2: wired
    with pytest.raises(NotImplementedError, match="'sm100': EP > 1"):
        run_ranks(g, lambda r: B.get_backend("sm100").check(inp, mok_cute.MoKConfig(), g))


@pytest.mark.parametrize("size", [1, 3, 4])
def test_all_gather_over_threads(size):
    g = VirtualGroup(size, "cpu")

    def fn(r):
        mine = torch.full((r + 1, 3), float(r))
        first = g.all_gather(mine)
        second = g.all_gather(-mine)  # the slots are reused by the next collective
        first[r][0, 0] = 99.0  # copies: the source is not touched
        return first, second, mine

    out = run_ranks(g, fn)
    for r, (first, second, mine) in enumerate(out):
        assert mine[0, 0] == r
        for q in range(size):
            want = torch.full((q + 1, 3), float(q))
            if q != r:
                assert torch.equal(first[q], want)
            assert torch.equal(second[q], -want)


def test_a_failing_rank_aborts_the_collectives_of_the_others():
    g = VirtualGroup(3, "cpu", timeout_s=30.0)

    def fn(r):
        if r == 1:
            raise ValueError("rank 1 gives up")
        g.barrier()

    t0 = time.time()
    with pytest.raises(ValueError, match="rank 1 gives up") as info:
        run_ranks(g, fn)
    assert time.time() - t0 < 10  # not the 30 s timeout
    notes = "\n".join(info.value.__notes__)
    assert "raised by virtual rank 1" in notes and "rank 0 also raised RuntimeError" in notes
    assert "rank 2 also raised RuntimeError" in notes
    assert run_ranks(g, lambda r: [int(t[0]) for t in g.all_gather(torch.tensor([r]))]) == [[0, 1, 2]] * 3


def test_a_stalled_rank_makes_the_others_raise_within_the_timeout():
    g = VirtualGroup(2, "cpu", timeout_s=0.3)

    def fn(r):
        if r == 0:  # rank 1 never joins
            g.all_gather(torch.zeros(1))

    t0 = time.time()
    with pytest.raises(RuntimeError, match="did not arrive within 0.3 s"):
        run_ranks(g, fn)
    assert time.time() - t0 < 5


def test_run_ranks_is_one_run_at_a_time():
    g = VirtualGroup(2, "cpu")
    with pytest.raises(RuntimeError, match="already running"):
        run_ranks(g, lambda r: run_ranks(g, lambda q: q))
    assert run_ranks(g, lambda r: r) == [0, 1]


def test_cached_builds_once_per_key():
    g = VirtualGroup(4, "cpu")
    calls = []

    def build():
        calls.append(1)
        time.sleep(0.05)  # the other ranks ask meanwhile
        return object()

    got = run_ranks(g, lambda r: (g.cached("a", build), g.cached("b", build)))
    assert len(calls) == 2
    assert len({id(a) for a, _ in got}) == 1 and len({id(b) for _, b in got}) == 1 and got[0][0] is not got[0][1]


def test_virtual_workspaces_share_one_peer_table(monkeypatch):
    """Every rank's peer table holds the R buffers' addresses and a peer's section is at its
    base plus the section offset, as the kernels compute it (CPU buffers: layout only)."""
    monkeypatch.setattr(W, "arch_of_device", lambda device: "sm_90a")
    size, T, H, k, E = 4, 5, 64, 2, 8
    g = VirtualGroup(size, "cpu")
    ws = run_ranks(g, lambda r: W.get_workspace(g, T=T, H=H, k=k, E=E, timeout_s=3.0))
    again = run_ranks(g, lambda r: W.get_workspace(g, T=T, H=H, k=k, E=E, timeout_s=3.0))
    other = run_ranks(g, lambda r: W.get_workspace(g, T=T, H=H, k=k, E=E, timeout_s=4.0))
    assert all(a is b for a, b in zip(ws, again)) and not any(a is b for a, b in zip(ws, other))
    bases = [w.buf.data_ptr() for w in ws]
    assert len(set(bases)) == size
    for r, w in enumerate(ws):
        assert (w.me, w.EP, w.recv_capacity, w.timeout_s) == (r, size, size * T * k, 3.0)
        assert w.offsets == ws[0].offsets and w.sym_bytes == ws[0].sym_bytes
        assert w.peer_addrs == bases and w.peer_bases.tolist() == bases and w.local_base == bases[r]
        assert not w.buf.any() and not w.status.any()
        for q in range(size):
            slots = ws[q].view("slots", torch.bfloat16, (T * k, H))
            assert slots.data_ptr() == w.peer_addrs[q] + w.offsets["slots"]
        assert w.describe()["buffer_ptrs"] == [hex(b) for b in bases]
    with pytest.raises(ValueError, match="multiple of the group size"):
        W.CommWorkspace.virtual(VirtualGroup(3, "cpu"), T, H, k, E)


def _starve(idx, e_local, size):
    """Rank 0's experts receive nothing and the last rank's tokens route nowhere."""
    t = idx.shape[0] // size
    idx = torch.where((idx >= 0) & (idx < e_local), -1, idx)
    idx[(size - 1) * t:] = -1
    return idx


@pytest.mark.parametrize("size,routing,precision,limit", [(2, "random", "bf16", None), (4, "random", "bf16", 4.0),
                                                          (4, "starved", "bf16", None), (2, "random", "mxfp8", 4.0)])
def test_reference_on_virtual_group_equals_global_ep1(size, routing, precision, limit):
    """mok_cute.moe (reference backend, autograd) on R virtual ranks: each rank's y and gradients
    are the global EP = 1 reference's on its tokens / its experts, bitwise (the shared expert is
    local: its gradients are those of this rank's tokens)."""
    from conftest import make_problem

    t_rank, E = 6, 8
    p, dy = make_problem(T=t_rank * size, H=64, I=64, E=E, k=2, shared_I=64, seed=size * 10 + len(routing))
    if routing == "starved":
        p["topk_idx"] = _starve(p["topk_idx"], E // size, size)
    ref_y, ref_s = R.moe_forward(**p, swiglu_limit=limit, precision=precision)
    ref_g = R.moe_backward(ref_s, dy)
    cfg = mok_cute.MoKConfig(backend="reference", precision=precision)
    g = VirtualGroup(size, "cpu")

    def rank(r):
        tok, exp = slice(r * t_rank, (r + 1) * t_rank), slice(r * E // size, (r + 1) * E // size)
        leaves = [t.clone().requires_grad_() for t in (p["x"][tok], p["topk_w"][tok], p["w_gate"][exp],
                                                     p["w_up"][exp], p["w_down"][exp], *p["shared"])]
        y = mok_cute.moe(leaves[0], p["topk_idx"][tok], *leaves[1:5], shared=tuple(leaves[5:]),
                         swiglu_limit=limit, config=cfg, group=g)
        grads = torch.autograd.grad(y, leaves, dy[tok])
        only = dict(x=p["x"][tok], topk_idx=torch.full_like(p["topk_idx"][tok], -1), topk_w=p["topk_w"][tok],
                    w_gate=p["w_gate"][:0], w_up=p["w_up"][:0], w_down=p["w_down"][:0], shared=p["shared"])
        shared_ref = R.moe_backward(R.moe_forward(**only, swiglu_limit=limit, precision=precision)[1], dy[tok])
        return tok, exp, y, grads, shared_ref.d_shared

    for tok, exp, y, grads, d_shared in run_ranks(g, rank):
        assert torch.equal(y, ref_y[tok])
        dx, dtw, dwg, dwu, dwd, *dsh = grads
        assert torch.equal(dx, ref_g.dx[tok]) and torch.equal(dtw, ref_g.d_topk_w[tok])
        assert torch.equal(dwg, ref_g.d_w_gate[exp]) and torch.equal(dwu, ref_g.d_w_up[exp])
        assert torch.equal(dwd, ref_g.d_w_down[exp])
        assert all(torch.equal(a, b) for a, b in zip(dsh, d_shared))
    if routing == "starved":  # the edge cases are there: rank 0 got no rows, the last rank sent none
        assert not bool(((p["topk_idx"] >= 0) & (p["topk_idx"] < E // size)).any())
        assert bool((ref_g.d_w_gate[:E // size] == 0).all()) and bool(ref_g.d_w_gate[E // size:].any())


def test_a_plan_that_gave_up_leaves_no_rows(monkeypatch):
    """A device plan whose kernel wrote nothing (a peer's counts never came) has zero offsets, so
    the GEMMs' tile walk after it has no tile (the plan's other outputs are never trusted)."""
    import mok_cute.dsl.compile as C
    import mok_cute.dsl.host as H
    import mok_cute.comm.planner as PL
    from mok_cute.schedule.group_tiles import total_tiles

    monkeypatch.setattr(W, "arch_of_device", lambda device: "sm_90a")
    monkeypatch.setattr(C, "compile_cached", lambda key, build: lambda *args: None)  # the kernel gave up
    monkeypatch.setattr(H, "current_stream", lambda device=None: None)
    empty = torch.empty
    monkeypatch.setattr(PL.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(0x7F7F))  # stale memory
    g = VirtualGroup(2, "cpu")
    idx = torch.zeros(5, 2, dtype=torch.int32)
    plans = run_ranks(g, lambda r: PL.plan_routing_device(W.get_workspace(g, T=5, H=64, k=2, E=4), idx))
    for r, plan in enumerate(plans):
        assert plan.rank == r and plan.recv_src.shape == (20,) and bool((plan.recv_src == 0x7F7F).all())
        assert plan.offsets.tolist() == [0, 0, 0] and total_tiles(plan.offsets.tolist(), 128, 4) == 0


def test_device_check_plumbing_on_cpu(monkeypatch):
    """tools/checks/layer_ep_virtual's cases on the CPU, the reference backend standing in for
    sm90 (no warm-up): one row per rank, all passing and bitwise; the starved case routes nothing
    to rank 0 and nothing from the last rank; a rank whose y is off, or whose repeats differ,
    fails its row."""
    from types import SimpleNamespace

    import tools.checks.layer_ep_virtual as V

    monkeypatch.setattr(V, "SHAPE", (8, 256, 256, 8, 2))
    monkeypatch.setattr(V, "_warm", lambda *a: None)
    run, calls = V._run, []

    def stand_in(backend, *args, **config):
        out = run("reference", *args)
        if backend == "sm90" and fault and args[-1].rank() == 1:  # args[-1]: the group
            calls.append(1)
            out[0] = out[0] + (1.0 if fault == "wrong" else len(calls) * 2.0 ** -8)
        return out

    monkeypatch.setattr(V, "_run", stand_in)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    fault = None
    for size in V.SIZES:
        for seed, case in enumerate(V.CASES):
            rows = V._case(ctx, size, seed, *case, "unfused")  # the reference stands in: no fused-launch rows
            assert [r.name for r in rows] == [f"layer_ep{size}v {case[0]} r{r}" for r in range(size)]
            assert all(r.ok and r.bitwise for r in rows), rows
    t, h, inter, e, k = V.SHAPE
    probs = [V._starve(V._problem(t, h, inter, e, k, 4, r, False, False, ctx.device, 0), r, 4, 2) for r in range(4)]
    assert not any(bool(((p[1] >= 0) & (p[1] < 2)).any()) for p in probs) and bool((probs[3][1] == -1).all())
    assert all(bool((p[1] >= 2).any()) for p in probs[:3])
    for fault, ok, bitwise in (("wrong", False, True), ("noise", False, False)):
        rows = V._case(ctx, 2, 0, *V.CASES[0], "unfused")
        assert rows[0].ok and (rows[1].ok, rows[1].bitwise) == (ok, bitwise), rows

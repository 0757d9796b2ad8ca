"""CPU-testable pieces of the EP > 1 layer path (mok_cute.layers.ep): the router weight of
each grouped row from the plan's packed sources (the mirror of what the dispatch pulls),
which backends accept EP > 1, and the layer glue with mirrored comm (no NCCL call)."""
import pytest
import torch

import mok_cute.layers.select as B
import mok_cute.layers.grouped as G
from mok_cute import reference as R
from mok_cute.config import MoKConfig
from mok_cute.schedule.plan import plan_routing, route_weights


def _routing(EP, T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = [torch.randint(-1, E, (T, k), generator=g, dtype=torch.int32) for _ in range(EP)]
    idx[0][:, 0] = 0  # a hot expert
    w = torch.rand(EP, T, k, generator=g)
    return idx, w


@pytest.mark.parametrize("EP,T,k,E", [(2, 13, 3, 4), (4, 7, 4, 8), (2, 1, 2, 2)])
def test_route_weights_match_reference_slot_weights(EP, T, k, E):
    idx, w = _routing(EP, T, k, E, seed=EP * 100 + T)
    spec = plan_routing(idx, E, EP)
    cap = EP * T * k
    for r in range(EP):
        view = spec.rank_view(r)
        m = int(view.offsets[-1])
        # the device plan's recv_src has capacity rows, unspecified past M: fill with junk
        recv = torch.full((cap,), 2 ** 30, dtype=torch.int32)
        recv[m + 1:] = -7
        recv[:m] = view.recv_src
        got = route_weights(recv, view.offsets, w)
        assert got.dtype == torch.float32 and got.shape == (cap,)
        assert torch.equal(got[m:], torch.zeros(cap - m))
        trip = spec.recv_triples(r)
        assert torch.equal(got[:m], w[trip[:, 0], trip[:, 1], trip[:, 2]])
        # the reference layer's per-row weights (its plan: same order)
        ref = R.plan_routing(idx, E, EP, r)
        assert ref.offsets == view.offsets.tolist()
        assert torch.equal(got[:m], w[ref.src, ref.tok, ref.slot])
        assert torch.equal(route_weights(recv, view.offsets, w.reshape(-1)), got)


def test_ep_gate_sm90_only(monkeypatch):
    from conftest import make_problem

    p, _ = make_problem(T=4, H=256, I=256)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    monkeypatch.setattr(G, "_world", lambda group: (2, 0))
    B.get_backend("sm90").check(inp, MoKConfig(), object())  # EP = 2 bf16 and mxfp8: wired
    B.get_backend("sm90").check(inp, MoKConfig(precision="mxfp8"), object())
    with pytest.raises(NotImplementedError, match="'sm100': EP > 1"):
        B.get_backend("sm100").check(inp, MoKConfig(), object())
    with pytest.raises(NotImplementedError, match="precision 'fp8_block'"):
        B.get_backend("sm90").check(inp, MoKConfig(precision="fp8_block"), object())


class _MockWS:
    """EP = 1 stand-in of a CommWorkspace: the slot buffer the combine 'pushes' into."""

    def __init__(self, T, H, k):
        self.T, self.H, self.k = T, H, k
        self.slots = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16)
        self.checked = 0

    def view(self, name, dtype, shape):
        assert name == "slots"
        return self.slots.view(shape)

    def check_status(self):
        self.checked += 1


class _RefMLP:
    """The reference expert MLP behind the arch-MLP interface (rows past offsets[-1]: junk)."""

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, precision="bf16"):
        offs = offsets.tolist()
        out, saved = R.experts_forward(x_rows[:offs[-1]], offs, w_gate, w_up, w_down, limit, precision)
        full = torch.full((x_rows.shape[0], out.shape[1]), float("nan"), dtype=out.dtype)
        full[:offs[-1]] = out
        return full, (saved, offs[-1], x_rows.shape[0], precision)

    def backward(self, g, dy_rows, w_gate, w_up, w_down, limit, fused, config=None):
        assert not fused  # the unfused EP backward: the MLP's separate kernels
        saved, m, cap, precision = g
        dx, *dw = R.experts_backward(saved, dy_rows[:m], w_gate, w_up, w_down, limit, precision)
        full = torch.full((cap, dx.shape[1]), float("nan"), dtype=dx.dtype)
        full[:m] = dx
        return (full, *dw)


@pytest.mark.parametrize("shared,limit,precision", [(None, None, "bf16"), (32, 4.0, "bf16"), (32, 4.0, "mxfp8")])
def test_ep_layer_glue_equals_reference_with_mirrored_comm(monkeypatch, shared, limit, precision):
    """ep_layer.forward/backward with the comm ops replaced by torch mirrors (one rank, the
    plan spec padded to capacity with junk) equals the reference layer bitwise; at mxfp8 the
    x rows travel as MXFP8 (quantize / dequantize kernels = the reference's ops)."""
    import mok_cute.comm.combine as C
    import mok_cute.comm.dispatch as D
    import mok_cute.comm.workspace as W
    import mok_cute.layers.ep as L
    import mok_cute.comm.planner as PL
    from conftest import make_problem

    p, _ = make_problem(T=12, H=64, I=32, E=4, k=3, shared_I=shared, seed=5)
    idx = p["topk_idx"].clone()
    idx[2, 1] = -1
    idx[7] = -1
    T, k = idx.shape
    ws = _MockWS(T, 64, k)
    cap = T * k

    def plan_dev(ws_, topk_idx):
        v = plan_routing([topk_idx], 4, 1).rank_view(0)
        recv = torch.full((cap,), 10 ** 6, dtype=torch.int32)
        recv[:v.recv_src.shape[0]] = v.recv_src
        v.recv_src = recv
        return v

    ctas = []  # comm CTAs asked of each call: config.comm_sms_fwd / comm_sms_bwd

    def pull(ws_, rows, plan, num_ctas=None):
        if num_ctas is not None:
            ctas.append(num_ctas)
        m = int(plan.offsets[-1])
        out = torch.zeros((cap, rows.shape[1]), dtype=rows.dtype)
        if rows.is_floating_point():
            out.fill_(float("nan"))
        out[:m] = rows[plan.recv_src[:m].long() // k]
        return out

    def dispatch(ws_, rows, plan, *, topk_w, num_ctas=None, payload="bf16"):
        """Mirror of dispatch(..., topk_w=): rows (mxfp8: data, scales) and each row's weight
        (0 past M)."""
        assert payload == precision
        w = torch.zeros(cap)
        m = int(plan.offsets[-1])
        w[:m] = topk_w.reshape(-1)[plan.recv_src[:m].long()]
        assert torch.equal(w, route_weights(plan.recv_src, plan.offsets, topk_w[None]))
        if payload == "mxfp8":
            q, sc = rows
            q_rows = pull(ws_, q.view(torch.uint8), plan, num_ctas).view(torch.float8_e4m3fn)
            return q_rows, pull(ws_, sc, plan, None), w
        return pull(ws_, rows, plan, num_ctas), w

    def push_reduce(ws_, rows, plan, w, start, num_ctas):
        ctas.append(num_ctas)
        m = int(plan.offsets[-1])
        ws_.slots[plan.recv_src[:m].long()] = rows[:m]
        acc = start.float() if start is not None else torch.zeros(T, rows.shape[1])
        return R.slot_sum(acc, ws_.slots.view(T, k, -1), plan.dest_rank, w).to(torch.bfloat16)

    timeouts = []
    monkeypatch.setattr(W, "get_workspace", lambda *a, **kw: timeouts.append(kw["timeout_s"]) or ws)
    monkeypatch.setattr(PL, "plan_routing_device", plan_dev)
    monkeypatch.setattr(D, "dispatch", dispatch)
    monkeypatch.setattr(D, "reverse_combine", pull)
    monkeypatch.setattr(C, "combine", lambda ws_, r, w, plan, shared_out=None, num_ctas=None:
                        push_reduce(ws_, r, plan, w, shared_out, num_ctas))
    monkeypatch.setattr(C, "reverse_dispatch", lambda ws_, r, plan, dx_shared=None, num_ctas=None:
                        push_reduce(ws_, r, plan, None, dx_shared, num_ctas))
    import mok_cute.kernels.quant.dequant_mxfp8 as DQ
    import mok_cute.kernels.quant.quantize as Q
    import torch.distributed as dist

    monkeypatch.setattr(Q, "quantize_mxfp8", R.mxfp8_quantize)
    monkeypatch.setattr(DQ, "dequantize_mxfp8", lambda q, sc: R.mxfp8_dequantize(q, sc).bfloat16())

    for name in ("all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, **kw: pytest.fail("NCCL call in the EP step"))

    sh = p.get("shared")
    if precision == "mxfp8":  # a tiny feature: flushed by each row's MXFP8 round trip along H, kept along tokens
        p["x"][:, 2] *= 2.0 ** -12
    inp = B.MoEInputs(p["x"], idx, p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], sh, limit)
    cfg = MoKConfig(comm_sms_fwd=24, comm_sms_bwd=12, device_timeout_s=7.5, precision=precision)
    from mok_cute.config import BackwardPath, ForwardPath
    from mok_cute.layers.paths import Paths

    y, st = L.forward(_RefMLP(), inp, None, 1, cfg, Paths(ForwardPath.UNFUSED, BackwardPath.UNFUSED))
    dy = torch.randn(T, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    g = L.backward(_RefMLP(), st, dy)
    assert ws.checked == 2
    assert timeouts == [7.5] and ctas == [24, 24, 12, 12]  # the config reaches the comm kernels
    y_ref, saved = R.moe_forward(p["x"], idx, p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], sh, limit,
                                 precision=precision)
    g_ref = R.moe_backward(saved, dy)
    assert torch.equal(y, y_ref)
    gate_up = ("d_w_gate", "d_w_up")
    for name in ("dx", "d_w_down") + (() if precision == "mxfp8" else gate_up):
        assert torch.equal(getattr(g, name), getattr(g_ref, name)), name
    if precision == "mxfp8":
        # the expert rank only holds x's MXFP8 rows: dWg / dWu quantize the dequantized rows along
        # tokens (the reference quantizes x itself), i.e. the reference layer run on x's round trip
        x_rt = R.mxfp8_dequantize(*R.mxfp8_quantize(p["x"], -1)).bfloat16()
        g_rt = R.moe_backward(R.moe_forward(x_rt, idx, p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], sh, limit,
                                            precision=precision)[1], dy)
        for name in gate_up:
            assert torch.equal(getattr(g, name), getattr(g_rt, name)), name
            assert not torch.equal(getattr(g, name), getattr(g_ref, name)), name  # the difference is seen
    # d topk_w: fp32 sum here, fp64 sum in the reference
    torch.testing.assert_close(g.d_topk_w, g_ref.d_topk_w, rtol=1e-5, atol=1e-5)
    assert bool((g.d_topk_w[idx < 0] == 0).all())
    if sh is not None:
        for a, b in zip(g.d_shared, g_ref.d_shared):
            assert torch.equal(a, b)

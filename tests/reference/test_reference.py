"""The reference layer against an independent per-token loop, float64 autograd, itself
(determinism), and adversarial routings."""
from __future__ import annotations

import pytest
import torch

from mok_cute import reference as R
from conftest import make_problem


def naive_layer(p, limit, precision="bf16"):
    """y by an explicit loop over tokens and slots, written independently of the reference."""
    q = (lambda a, d: R.mx_round_trip(a, d)) if precision == "mxfp8" else (lambda a, d: a)

    def dot(a, b):  # a [K], b [N, K] -> fp32 [N] via an fp64 sum
        return (b.double() @ a.double()).float()

    def mlp(xt, wg, wu, wd):
        g = dot(q(xt[None], -1)[0], q(wg, -1)).bfloat16().float()
        u = dot(q(xt[None], -1)[0], q(wu, -1)).bfloat16().float()
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        h = (g * torch.sigmoid(g) * u).bfloat16()
        return dot(q(h[None].float(), -1)[0], q(wd, -1)).bfloat16()

    x, idx, w = p["x"], p["topk_idx"], p["topk_w"]
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        if p["shared"] is not None:
            acc = mlp(x[t], *p["shared"]).float()
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= 0:
                acc = acc + w[t, j] * mlp(x[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e]).float()
        y[t] = acc.bfloat16()
    return y


def run(p, limit=None, precision="bf16", dy=None):
    y, saved = R.moe_forward(**p, swiglu_limit=limit, precision=precision)
    return y, (R.moe_backward(saved, dy) if dy is not None else None)


@pytest.mark.parametrize("limit", [None, 4.0, 0.5])
@pytest.mark.parametrize("shared_I", [None, 64])
def test_forward_matches_naive_loop_bitwise(limit, shared_I):
    p, _ = make_problem(T=16, shared_I=shared_I, seed=1)
    assert torch.equal(run(p, limit)[0], naive_layer(p, limit))


def test_mxfp8_forward_matches_naive_loop_bitwise():
    p, _ = make_problem(T=12, shared_I=64, seed=2)
    assert torch.equal(run(p, 4.0, "mxfp8")[0], naive_layer(p, 4.0, "mxfp8"))


def test_mxfp8_close_to_bf16():
    p, dy = make_problem(T=64, H=128, I=128, E=4, k=2, shared_I=64, seed=3)
    yb, gb = run(p, None, "bf16", dy)
    ym, gm = run(p, None, "mxfp8", dy)
    rel = lambda a, b: float((a.float() - b.float()).abs().sum() / b.float().abs().sum())
    assert rel(ym, yb) < 0.1 and rel(gm.dx, gb.dx) < 0.1 and rel(gm.d_w_gate, gb.d_w_gate) < 0.1
    assert not torch.equal(ym, yb)


def _f64(p):
    out = {k: (v.double().requires_grad_() if torch.is_tensor(v) and v.is_floating_point() else v)
           for k, v in p.items() if k != "shared"}
    out["shared"] = None if p["shared"] is None else tuple(s.double().requires_grad_() for s in p["shared"])
    return out


@pytest.mark.parametrize("limit", [None, 0.6])
@pytest.mark.parametrize("shared_I", [None, 64])
def test_backward_matches_float64_autograd(limit, shared_I):
    p, dy = make_problem(T=10, H=64, I=64, E=3, k=2, shared_I=shared_I, seed=4)
    q = _f64(p)
    y, saved = R.moe_forward(**q, swiglu_limit=limit, precision="exact")
    dy = dy.double()
    g = R.moe_backward(saved, dy)
    leaves = [q["x"], q["topk_w"], q["w_gate"], q["w_up"], q["w_down"]] + list(q["shared"] or ())
    auto = torch.autograd.grad(y, leaves, dy)
    mine = [g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down] + list(g.d_shared or ())
    for a, m in zip(auto, mine):
        torch.testing.assert_close(m, a, rtol=1e-10, atol=1e-10)
    assert (g.d_topk_w[p["topk_idx"] < 0] == 0).all()


@pytest.mark.parametrize("limit", [None, 0.7])
def test_gradcheck_tiny(limit):
    """Finite differences on the exact (float64) forward: the math itself is differentiated right."""
    g = torch.Generator().manual_seed(5)
    T, H, I, E, k = 4, 6, 4, 3, 2
    idx = torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1]])
    args = [torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True),
            torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)]
    args += [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
             for s in [(E, I, H), (E, I, H), (E, H, I), (I, H), (I, H), (H, I)]]

    def f(x, w, wg, wu, wd, sg, su, sd):
        return R.moe_forward(x, idx, w, wg, wu, wd, (sg, su, sd), limit, "exact")[0]

    assert torch.autograd.gradcheck(f, tuple(args))


def test_bitwise_deterministic_over_repeats():
    p, dy = make_problem(T=40, H=128, I=64, E=4, k=3, shared_I=64, seed=6)
    for precision in ("bf16", "mxfp8"):
        y0, g0 = run(p, 4.0, precision, dy)
        for _ in range(3):
            y1, g1 = run(p, 4.0, precision, dy)
            assert torch.equal(y0, y1)
            for a, b in zip(_flat(g0), _flat(g1)):
                assert torch.equal(a, b)


def _flat(g):
    return [g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down] + list(g.d_shared or ())


ADVERSARIAL = {
    "all_to_one_expert": lambda T, E, k: torch.stack([torch.tensor([2] + [-1] * (k - 1))] * T),
    "empty_experts": lambda T, E, k: torch.stack([torch.arange(k)] * T),  # experts >= k get no token
    "all_slots_minus_one": lambda T, E, k: torch.full((T, k), -1),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_routing(case):
    T, E, k = 12, 4, 2
    p, dy = make_problem(T=T, E=E, k=k, shared_I=64, seed=7, idx=ADVERSARIAL[case](T, E, k))
    y, g = run(p, None, "bf16", dy)
    assert torch.equal(y, naive_layer(p, None))
    counts = torch.bincount(p["topk_idx"][p["topk_idx"] >= 0].flatten(), minlength=E)
    for e in range(E):  # an expert with no tokens gets exactly zero weight gradient
        if counts[e] == 0:
            assert not g.d_w_gate[e].any() and not g.d_w_down[e].any()
        else:
            assert g.d_w_gate[e].any()
    if case == "all_slots_minus_one":  # only the shared expert acts
        assert not g.d_topk_w.any()


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (1, 4, 4), (9, 1, 3), (9, 3, 3)])
def test_edge_shapes(T, k, E):
    p, dy = make_problem(T=T, E=E, k=k, seed=8, minus_one=False)
    y, g = run(p, 4.0, "bf16", dy)
    assert torch.equal(y, naive_layer(p, 4.0))
    assert g.dx.shape == p["x"].shape and g.d_topk_w.shape == (T, k)


def test_token_order_within_expert():
    """Rows of each expert: by source rank, then token, then slot."""
    idx = [torch.tensor([[1, 0], [0, 1], [1, -1]]), torch.tensor([[0, 1]])]
    r = R.plan_routing(idx, 2, 1, 0)
    assert r.offsets == [0, 3, 7]
    rows = list(zip(r.src.tolist(), r.tok.tolist(), r.slot.tolist()))
    assert rows == [(0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0), (0, 1, 1), (0, 2, 0), (1, 0, 1)]
    r2 = R.plan_routing(idx, 2, 2, 1)  # with EP = 2, rank 1 owns expert 1
    assert r2.offsets == [0, 4]
    assert list(zip(r2.src.tolist(), r2.tok.tolist(), r2.slot.tolist())) == rows[3:]

"""gpt-oss's expert options in the reference (the spec): the SwiGLU's alpha and up offset with its
clamps (:class:`mok_cute.reference.SwiGLU`) and the routed experts' biases. Their forward and
every gradient against an independent float64 autograd computation, the clamps' zero gradients,
the bf16 rounding points (bias added before each GEMM's rounding, the down bias inside the
expert output the routing weight scales, bias gradients as rounded sums) against a per-token loop
written from the module doc, expert parallelism, and that the defaults change nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok_cute import reference as R
from mok_cute.comm.virtual import VirtualGroup, run_ranks
from mok_cute.reference import SwiGLU
from conftest import make_problem

GPT_OSS = SwiGLU.gpt_oss()
# (limit, alpha, up_offset): gpt-oss's constants with a limit that clamps a fair share of the values
ACTS = {"gpt_oss_clamped": SwiGLU(0.7, 1.702, 1.0), "gpt_oss": GPT_OSS, "alpha_only": SwiGLU(None, 0.5, 0.0),
        "offset_only": SwiGLU(1.5, 1.0, -0.25), "plain": SwiGLU()}


def _biases(e, inter, h, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=g) * 0.3).to(dtype) for s in ((e, inter), (e, inter), (e, h)))


def _problem(seed, T=12, H=64, I=64, E=3, k=2, shared_I=64):
    p, dy = make_problem(T=T, H=H, I=I, E=E, k=k, shared_I=shared_I, seed=seed)
    return p, dy, _biases(E, I, H, seed + 100)


# ---------------------------------------------------------------- float64 autograd (independent)
def _naive_f64(x, idx, w, wg, wu, wd, shared, biases, act: SwiGLU):
    """The layer written from gpt-oss's definition, per token and slot, in float64 (autograd
    differentiates it): gate_up = x W^T + b, gate <= L, up in [-L, L], (up + o) * gate *
    sigmoid(alpha * gate), then W_down + b_down, times the routing weight."""
    lim, a, o = act.limit, act.alpha, act.up_offset

    def mlp(xt, g_w, u_w, d_w, b=None):
        g, u = g_w @ xt, u_w @ xt
        if b is not None:
            g, u = g + b[0], u + b[1]
        if lim is not None:
            g, u = torch.clamp(g, max=lim), torch.clamp(u, -lim, lim)
        r = d_w @ ((u + o) * (g * torch.sigmoid(a * g)))
        return r if b is None else r + b[2]

    rows = []
    for t in range(x.shape[0]):
        acc = mlp(x[t], *shared) if shared is not None else torch.zeros_like(x[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= 0:
                b = None if biases is None else tuple(bb[e] for bb in biases)
                acc = acc + w[t, j] * mlp(x[t], wg[e], wu[e], wd[e], b)
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("act", list(ACTS), ids=list(ACTS))
@pytest.mark.parametrize("biased", [True, False])
def test_layer_forward_and_every_gradient_match_float64_autograd(act, biased):
    """Exact (float64) numerics: y and dx, d topk_w, the routed and shared weights' and the biases'
    gradients equal float64 autograd of :func:`_naive_f64` (a -1 slot and a clamped share included)."""
    p, dy, biases = _problem(seed=1)
    leaf = lambda t: t.double().requires_grad_()
    x, w = leaf(p["x"]), leaf(p["topk_w"])
    ws = [leaf(p[n]) for n in ("w_gate", "w_up", "w_down")]
    sh = tuple(leaf(s) for s in p["shared"])
    bs = tuple(leaf(b) for b in biases) if biased else None
    y, saved = R.moe_forward(x, p["topk_idx"], w, *ws, sh, ACTS[act], "exact", None, None, bs)
    want = _naive_f64(x, p["topk_idx"], w, *ws, sh, bs, ACTS[act])
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    g = R.moe_backward(saved, dy.double())
    leaves = [x, w, *ws, *sh] + list(bs or ())
    auto = torch.autograd.grad(want, leaves, dy.double())
    mine = [g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *g.d_shared] + list(g.d_biases or ())
    assert (g.d_biases is not None) == biased and len(mine) == len(auto)
    for name, m, a in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "ws_gate", "ws_up", "ws_down",
                           "b_gate", "b_up", "b_down"], mine, auto):
        torch.testing.assert_close(m, a, rtol=1e-10, atol=1e-10, msg=name)
    if act == "gpt_oss_clamped":  # the clamps act on a fair share of the routed values
        gu = saved.routed.gu
        assert (gu[:, :64] > 0.7).float().mean() > 0.1 and (gu[:, 64:].abs() > 0.7).float().mean() > 0.1


def test_gradcheck_tiny_with_biases():
    """Finite differences of the exact forward with gpt-oss's activation and biases."""
    g = torch.Generator().manual_seed(5)
    T, H, I, E, k = 4, 6, 4, 3, 2
    idx = torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1]])
    shapes = [(T, H), (T, k), (E, I, H), (E, I, H), (E, H, I), (E, I), (E, I), (E, H)]
    args = tuple(torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes)

    def f(x, w, wg, wu, wd, bg, bu, bd):
        return R.moe_forward(x, idx, w, wg, wu, wd, None, SwiGLU(0.9, 1.702, 1.0), "exact", None, None,
                             (bg, bu, bd))[0]

    assert torch.autograd.gradcheck(f, args)


# ---------------------------------------------------------------- the activation and its clamps
@pytest.mark.parametrize("act", list(ACTS), ids=list(ACTS))
def test_activation_and_its_gradient_match_float64_autograd(act):
    """:func:`swiglu` / :func:`dswiglu` in float64 against autograd of gpt-oss's formula, on a grid
    that holds the limits themselves (a value at the limit passes its gradient, as torch.clamp's)."""
    a = ACTS[act]
    lim = 1.5 if a.limit is None else a.limit
    vals = torch.tensor([-3 * lim, -lim, -0.5 * lim, 0.0, 0.3, lim, 1.0001 * lim, 2 * lim], dtype=torch.float64)
    g, u = (t.reshape(-1).clone().requires_grad_() for t in torch.meshgrid(vals, vals, indexing="ij"))
    dh = torch.linspace(-2, 2, g.numel(), dtype=torch.float64)
    gc, uc = g, u
    if a.limit is not None:
        gc, uc = torch.clamp(g, max=a.limit), torch.clamp(u, -a.limit, a.limit)
    want = (uc + a.up_offset) * (gc * torch.sigmoid(a.alpha * gc))
    torch.testing.assert_close(R.swiglu(g.detach(), u.detach(), a), want, rtol=1e-14, atol=1e-14)
    dg, du = R.dswiglu(dh, g.detach(), u.detach(), a)
    ag, au = torch.autograd.grad(want, (g, u), dh)
    torch.testing.assert_close(dg, ag, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(du, au, rtol=1e-13, atol=1e-13)
    if a.limit is not None:  # clamped: exactly zero gradient; at the limit: a gradient
        assert not dg[g.detach() > a.limit].any() and not du[u.detach().abs() > a.limit].any()
        at = (g.detach() == a.limit) & (u.detach() == 0.3)
        assert dg[at].abs().min() > 0


def test_activation_rounding_points_in_fp32():
    """bf16 numerics: act(gc) = gc * sigmoid(a * gc) with a as an fp32 value and each op in fp32
    in the documented order, (uc + o) then the product; silu at a = 1."""
    g0 = torch.Generator().manual_seed(9)
    g, u = (torch.randn(4096, generator=g0) * 3).bfloat16().float(), (torch.randn(4096, generator=g0) * 3).bfloat16().float()
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    a32, o32 = torch.tensor(1.702, dtype=torch.float32), torch.tensor(1.0, dtype=torch.float32)
    want = (gc * torch.sigmoid(a32 * gc)) * (uc + o32)
    assert torch.equal(R.swiglu(g, u, GPT_OSS), want)
    assert torch.equal(R.swiglu(g, u, SwiGLU(7.0, 1.0, 1.0)), F.silu(gc) * (uc + o32))
    s = torch.sigmoid(a32 * gc)
    dh = torch.randn(4096, generator=g0)
    dg = torch.where(g <= 7.0, dh * (uc + o32) * s * (1 + a32 * gc * (1 - s)), torch.zeros(()))
    du = torch.where(u.abs() <= 7.0, dh * (gc * s), torch.zeros(()))
    got = R.dswiglu(dh, g, u, GPT_OSS)
    assert torch.equal(got[0], dg) and torch.equal(got[1], du)


# ---------------------------------------------------------------- bf16 rounding points, bitwise
def _dot(a, b):
    """a [K] . b [N, K]^T: exact products, fp64 sum, rounded to fp32."""
    return (b.double() @ a.double()).float()


def _contract_loop(p, dy, biases, act: SwiGLU):
    """y, d b_gate, d b_up, d b_down by a per-token loop written from the module doc (bf16)."""
    x, idx, w = p["x"], p["topk_idx"], p["topk_w"]
    wg, wu, wd = p["w_gate"], p["w_up"], p["w_down"]
    lim, e_n = act.limit, wg.shape[0]
    a32, o32 = torch.tensor(act.alpha), torch.tensor(act.up_offset)
    sums = [torch.zeros(e_n, wg.shape[1], dtype=torch.float64), torch.zeros(e_n, wg.shape[1], dtype=torch.float64),
            torch.zeros(e_n, wd.shape[1], dtype=torch.float64)]

    def forward(xt, e):
        g = (_dot(xt, wg[e]) + biases[0][e].float()).bfloat16().float()
        u = (_dot(xt, wu[e]) + biases[1][e].float()).bfloat16().float()
        gc, uc = g.clamp(max=lim), u.clamp(-lim, lim)
        h = ((gc * torch.sigmoid(a32 * gc)) * (uc + o32)).bfloat16()
        r = (_dot(h.float(), wd[e]) + biases[2][e].float()).bfloat16()
        return g, u, gc, uc, r

    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            g, u, gc, uc, r = forward(x[t], e)
            acc = acc + w[t, j] * r.float()
            dyj = (dy[t].float() * w[t, j]).bfloat16()
            dh = _dot(dyj, wd[e].t())
            s = torch.sigmoid(a32 * gc)
            dg = torch.where(g <= lim, dh * (uc + o32) * s * (1 + a32 * gc * (1 - s)), torch.zeros(()))
            du = torch.where(u.abs() <= lim, dh * (gc * s), torch.zeros(()))
            sums[0][e] += dg.bfloat16().double()
            sums[1][e] += du.bfloat16().double()
            sums[2][e] += dyj.double()
        y[t] = acc.bfloat16()
    return y, [s.float().bfloat16() for s in sums]


def test_bf16_rounding_points_match_a_loop_over_tokens_bitwise():
    """y and the bias gradients of the bf16 reference equal the module doc's contract computed token
    by token: g, u = bf16(fp32 GEMM + fp32 bias); h in fp32 from them; r = bf16(fp32 GEMM2 + b_down),
    scaled by the routing weight in the combine; d b = bf16(fp32(fp64 sum of the bf16 rows))."""
    p, dy, biases = _problem(seed=2, T=16, E=4, shared_I=None)
    y, saved = R.moe_forward(**p, swiglu_limit=SwiGLU(0.7, 1.702, 1.0), expert_biases=biases)
    grads = R.moe_backward(saved, dy)
    want_y, want_db = _contract_loop(p, dy, biases, SwiGLU(0.7, 1.702, 1.0))
    assert torch.equal(y, want_y)
    for name, got, want in zip(("b_gate", "b_up", "b_down"), grads.d_biases, want_db):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name


def test_down_bias_is_scaled_by_the_routing_weight():
    """With zero weights (every GEMM 0), r = b_down of the expert: y = bf16(sum_j w_j * b_down[e_j]),
    and d topk_w[t, j] = dy[t] . b_down[e_j]; the gate / up biases alone reach y through the MLP."""
    p, dy, biases = _problem(seed=3, shared_I=None)
    zero = {n: torch.zeros_like(p[n]) for n in ("w_gate", "w_up", "w_down")}
    y, saved = R.moe_forward(**{**p, **zero}, expert_biases=biases)
    idx, w = p["topk_idx"], p["topk_w"]
    rows = biases[2][idx.clamp(min=0)].float()  # [T, k, H]
    want = torch.zeros(y.shape)
    for j in range(idx.shape[1]):
        want = torch.where((idx[:, j] >= 0)[:, None], want + w[:, j:j + 1] * rows[:, j], want)
    assert torch.equal(y, want.bfloat16())
    dtw = R.moe_backward(saved, dy).d_topk_w
    want_dtw = torch.where(idx >= 0, (dy.double()[:, None] * rows.double()).sum(-1), torch.zeros(())).float()
    assert torch.equal(dtw, want_dtw)


def test_experts_without_rows_get_zero_bias_gradients():
    p, dy, biases = _problem(seed=4, E=4, shared_I=None)
    p["topk_idx"] = torch.stack([torch.tensor([0, 1])] * p["x"].shape[0])  # experts 2, 3: no token
    _, saved = R.moe_forward(**p, swiglu_limit=GPT_OSS, expert_biases=biases)
    d = R.moe_backward(saved, dy).d_biases
    for db in d:
        assert not db[2:].any() and db[:2].any()


def test_mxfp8_and_fp8_block_run_the_biases_unquantized():
    """At mxfp8 / fp8_block the GEMM operands are quantized, not the biases: a bias alone (zero
    weights) gives the same y at every precision; with weights, the results stay close to bf16."""
    p, dy, biases = _problem(seed=5, H=128, I=128, E=4, shared_I=None)
    zero = {n: torch.zeros_like(p[n]) for n in ("w_gate", "w_up", "w_down")}
    ys = [R.moe_forward(**{**p, **zero}, expert_biases=biases, precision=prec)[0] for prec in R.PRECISIONS]
    assert all(torch.equal(ys[0], v) for v in ys[1:])
    yb, sb = R.moe_forward(**p, swiglu_limit=GPT_OSS, expert_biases=biases)
    gb = R.moe_backward(sb, dy)
    for prec in ("mxfp8", "fp8_block"):
        y, s = R.moe_forward(**p, swiglu_limit=GPT_OSS, expert_biases=biases, precision=prec)
        g = R.moe_backward(s, dy)
        rel = lambda a, b: float((a.float() - b.float()).abs().sum() / b.float().abs().sum())
        assert rel(y, yb) < 0.1 and rel(g.dx, gb.dx) < 0.1
        assert all(rel(a, b) < 0.1 for a, b in zip(g.d_biases, gb.d_biases))


# ---------------------------------------------------------------- defaults, determinism, EP
def test_defaults_change_nothing_bitwise():
    """SwiGLU() is no activation argument, SwiGLU(L) is swiglu_limit=L, expert_biases=None is no
    biases: y and every gradient bitwise equal, at every precision."""
    p, dy = make_problem(T=12, H=128, I=128, E=4, k=2, shared_I=128, seed=6)
    cases = [("bf16", None, SwiGLU()), ("bf16", 4.0, SwiGLU(4.0)), ("bf16", 0.5, SwiGLU(0.5, 1, 0)),
             ("mxfp8", 4.0, SwiGLU(4.0)), ("fp8_block", None, SwiGLU())]
    for prec, old, new in cases:
        a, sa = R.moe_forward(**p, swiglu_limit=old, precision=prec)
        b, sb = R.moe_forward(**p, swiglu_limit=new, precision=prec, expert_biases=None)
        assert torch.equal(a, b)
        ga, gb = R.moe_backward(sa, dy), R.moe_backward(sb, dy)
        assert gb.d_biases is None
        for u, v in zip(_flat(ga), _flat(gb)):
            assert torch.equal(u, v)


def _flat(g):
    return [g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *(g.d_shared or ()), *(g.d_biases or ())]


def test_bitwise_deterministic_over_repeats():
    p, dy, biases = _problem(seed=7, T=32, E=4)
    runs = []
    for _ in range(3):
        y, s = R.moe_forward(**p, swiglu_limit=GPT_OSS, expert_biases=biases)
        runs.append([y] + _flat(R.moe_backward(s, dy)))
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))


def test_ep2_equals_ep1_bitwise():
    """Two virtual ranks, each with half the tokens, half the experts and their biases: the same y,
    dx, d topk_w and weight / bias gradients as one rank with everything."""
    ep, t_rank, e = 2, 10, 4
    p, dy, biases = _problem(seed=8, T=t_rank * ep, E=e, shared_I=None)
    y1, s1 = R.moe_forward(**p, swiglu_limit=GPT_OSS, expert_biases=biases)
    g1 = R.moe_backward(s1, dy)
    group = VirtualGroup(ep, device="cpu")

    def rank(r):
        tok, exp = slice(r * t_rank, (r + 1) * t_rank), slice(r * e // ep, (r + 1) * e // ep)
        y, s = R.moe_forward(p["x"][tok], p["topk_idx"][tok], p["topk_w"][tok], p["w_gate"][exp], p["w_up"][exp],
                             p["w_down"][exp], None, GPT_OSS, "bf16", group, None, tuple(b[exp] for b in biases))
        g = R.moe_backward(s, dy[tok])
        return (torch.equal(y, y1[tok]) and torch.equal(g.dx, g1.dx[tok]) and torch.equal(g.d_topk_w, g1.d_topk_w[tok])
                and all(torch.equal(a, b[exp]) for a, b in zip((g.d_w_gate, g.d_w_up, g.d_w_down, *g.d_biases),
                                                               (g1.d_w_gate, g1.d_w_up, g1.d_w_down, *g1.d_biases))))

    assert run_ranks(group, rank) == [True, True]


# ---------------------------------------------------------------- SwiGLU itself
def test_swiglu_values_and_errors():
    assert SwiGLU() == SwiGLU(None, 1.0, 0.0) and SwiGLU().plain and SwiGLU(4).plain and SwiGLU(4).limit == 4.0
    assert GPT_OSS == SwiGLU(7.0, 1.702, 1.0) and not GPT_OSS.plain and isinstance(SwiGLU(3, 2, 1).alpha, float)
    assert R.swiglu_of(None) == SwiGLU() and R.swiglu_of(2.0) == SwiGLU(2.0) and R.swiglu_of(GPT_OSS) is GPT_OSS
    for kw, exc, msg in [(dict(limit=0.0), ValueError, "SwiGLU.limit must be a positive finite"),
                         (dict(limit=float("inf")), ValueError, "SwiGLU.limit"),
                         (dict(limit="7"), TypeError, "SwiGLU.limit must be a float, got str"),
                         (dict(alpha=-1.0), ValueError, "SwiGLU.alpha must be a positive finite"),
                         (dict(alpha=True), TypeError, "SwiGLU.alpha must be a float, got bool"),
                         (dict(up_offset=float("nan")), ValueError, "SwiGLU.up_offset must be a finite float"),
                         (dict(up_offset=None), TypeError, "SwiGLU.up_offset")]:
        with pytest.raises(exc, match=msg):
            SwiGLU(**kw)
    with pytest.raises(AttributeError):
        GPT_OSS.alpha = 1.0  # frozen

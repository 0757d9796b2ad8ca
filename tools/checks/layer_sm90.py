"""Device check: the whole layer (mok_cute.moe, backend sm90, EP = 1) and the expert_mlp op
against the reference backend, forward and backward.

Tolerances (BF16, MoK's): max-abs <= 0.5 and rel-L1 <= 1e-2 per output and gradient;
bitwise equality of everything over 5 repeats. Routings: uniform top-k, skewed (most routes
to one expert, some experts empty, -1 slots); with and without the shared expert, SwiGLU
clamped (L = 4) and not; gpt-oss's SwiGLU (``SwiGLU.gpt_oss()``: alpha 1.702, up offset 1, limit 7,
:data:`GPT_OSS_CASES`) at one small shape along each path pair: the fused forward with the whole fused
backward (no expert biases: that path refuses them), then with gpt-oss's expert biases (b_gate, b_up,
b_down; their gradients compared too) the fused forward with the fused backward core, and both unfused. Inputs are fresh random
(MoK-style: logits N(0,1), softmax over the top-k values, weights N(0,1) * fan_in^-0.5).
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us

MAX_ABS, REL_L1, REPEATS = 0.5, 1e-2, 5
# gpt-oss's activation rows: (name, forward_path, backward_path, expert biases), skewed routing + shared expert at
# GPT_OSS_SHAPE
GPT_OSS_CASES = (("fused/fused_whole", "fused", "fused_whole", False), ("fused/fused +biases", "fused", "fused", True),
                 ("unfused/unfused +biases", "unfused", "unfused", True))
GPT_OSS_SHAPE = dict(t=512, h=512, inter=256, e=8, k=4)


def gpt_oss_problem(dev, seed=900):
    """``(SwiGLU.gpt_oss(), layer inputs, biases)`` of the gpt-oss rows: :func:`_problem` at :data:`GPT_OSS_SHAPE`,
    skewed routing, the shared expert (on ``dev``: the CPU too), and the routed experts' (b_gate, b_up [E, I],
    b_down [E, H]) bf16, N(0, 0.1^2)."""
    from mok_cute import SwiGLU

    s = GPT_OSS_SHAPE
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    biases = tuple((torch.randn(s["e"], n, device=dev, generator=g) * 0.1).bfloat16()
                   for n in (s["inter"], s["inter"], s["h"]))
    return SwiGLU.gpt_oss(), _problem(s["t"], s["h"], s["inter"], s["e"], s["k"], True, True, dev, seed), biases


def _problem(t, h, inter, e, k, shared, skew, dev, seed, e_local=None):
    """Layer inputs over E global experts, weights for ``e_local`` of them (default all)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    el = e if e_local is None else e_local
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    logits = torch.randn(t, e, device=dev, generator=g)
    if skew:
        logits[:, 0] += 3.0
        logits[:, 1:3] -= 100.0  # experts 1, 2 empty
    vals, idx = logits.topk(k, dim=-1)
    w = torch.softmax(vals, dim=-1)
    if skew:
        idx[::7, -1] = -1
        idx[5] = -1
    rnd = lambda *s, fan: (torch.randn(*s, device=dev, generator=g) * fan ** -0.5).bfloat16()
    ws = (rnd(el, inter, h, fan=h), rnd(el, inter, h, fan=h), rnd(el, h, inter, fan=inter))
    sh = (rnd(inter, h, fan=h), rnd(inter, h, fan=h), rnd(h, inter, fan=inter)) if shared else None
    dy = torch.randn(t, h, device=dev, generator=g).bfloat16()
    return x, idx, w, ws, sh, dy


def _run(backend, x, idx, w, ws, sh, dy, limit, group=None, precision="bf16", biases=None, **config):
    """[y, dx, d topk_w, dWg, dWu, dWd(, dWs_gate, dWs_up, dWs_down)(, d b_gate, d b_up, d b_down)] of
    mok_cute.moe on copies of the inputs (``biases``: the routed experts', passed as (weight, bias) pairs;
    ``config``: further MoKConfig fields)."""
    import mok_cute

    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()] + [p.clone().requires_grad_() for p in ws]
    shl = [p.clone().requires_grad_() for p in sh] if sh else []
    bl = [b.clone().requires_grad_() for b in biases] if biases else []
    routed = tuple(zip(leaves[2:], bl)) if bl else leaves[2:]
    y = mok_cute.moe(leaves[0], idx, leaves[1], *routed, shared=tuple(shl) if shl else None,
                     swiglu_limit=limit, config=mok_cute.MoKConfig(backend=backend, precision=precision, **config),
                     group=group)
    grads = torch.autograd.grad(y, leaves + shl + bl, dy)
    return [y] + list(grads)


OUT_NAMES = ["y", "dx", "dtopk_w", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down", "db_gate", "db_up",
             "db_down"]


def _compare(name, outs, refs, same):
    worst_abs, worst_rel, finite = 0.0, 0.0, True
    bad = []  # the outputs over tolerance or not finite, named
    for i, (o, r) in enumerate(zip(outs, refs)):
        fin = bool(torch.isfinite(o.float()).all())
        d = (o.float() - r.float()).abs()
        a = float(d.max()) if d.numel() else 0.0
        rel = float(d.sum() / r.float().abs().sum().clamp_min(1e-30))
        finite &= fin
        worst_abs = a if (a != a or worst_abs != worst_abs) else max(worst_abs, a)  # keep NaN
        worst_rel = rel if (rel != rel or worst_rel != worst_rel) else max(worst_rel, rel)
        if not (fin and a <= MAX_ABS and rel <= REL_L1):
            bad.append(f"{OUT_NAMES[i]}(abs={a:.2g},rel={rel:.1e},finite={fin})")
    ok = finite and worst_abs <= MAX_ABS and worst_rel <= REL_L1 and same
    note = f"relL1={worst_rel:.2e} finite={finite}" + (f" bad: {' '.join(bad)}" if bad else "")
    return Row(name, max_err=worst_abs, bitwise=same, ok=ok, note=note)


def run(ctx) -> list[Row]:
    dev = ctx.device
    rows = []
    cases = [("uniform", False, False, None), ("skew+shared", True, True, None),
             ("skew+shared L=4", True, True, 4.0), ("uniform L=4", False, False, 4.0)]
    for i, (name, skew, shared, limit) in enumerate(cases):
        x, idx, w, ws, sh, dy = _problem(1000, 1024, 512, 8, 4, shared, skew, dev, seed=100 + i)
        ref = _run("reference", x, idx, w, ws, sh, dy, limit)
        outs = [_run("sm90", x, idx, w, ws, sh, dy, limit) for _ in range(REPEATS)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
        rows.append(_compare(f"layer sm90 {name}", outs[0], ref, same))
    act, (x, idx, w, ws, sh, dy), biases = gpt_oss_problem(dev)
    refs = {b: _run("reference", x, idx, w, ws, sh, dy, act, biases=biases if b else None) for b in (False, True)}
    for name, fwd_path, bwd_path, biased in GPT_OSS_CASES:
        ref = refs[biased]
        outs = [_run("sm90", x, idx, w, ws, sh, dy, act, biases=biases if biased else None, forward_path=fwd_path,
                     backward_path=bwd_path) for _ in range(REPEATS)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
        rows.append(_compare(f"layer sm90 gpt-oss {name}", outs[0], ref, same))
    # timing: one MoK-like shape scaled to one GPU
    x, idx, w, ws, sh, dy = _problem(4096, 7168, 2048, 16, 8, True, False, dev, seed=7)
    import mok_cute

    cfg = mok_cute.MoKConfig(backend="sm90")
    for t in [x, w, *ws, *sh]:
        t.requires_grad_()
    fwd = lambda: mok_cute.moe(x, idx, w, *ws, shared=sh, config=cfg)
    fb = lambda: torch.autograd.backward(fwd(), dy)
    with torch.no_grad():
        t_f = bench_us(fwd, warmup=3, iters=10)
    t_fb = bench_us(fb, warmup=3, iters=10)
    flop = 6 * (4096 + 4096 * 8) * 7168 * 2048  # MoK's count: routed + shared
    rows.append(Row("layer sm90 T4096 k8 E16 H7168 I2048 +shared", time_us=t_fb,
                    note=f"fwd {t_f:.0f}us {flop / t_f / 1e6:.0f} TF/s; fwd+bwd {3 * flop / t_fb / 1e6:.0f} TF/s"))
    return rows

"""Device check: the routed backward core in one launch (kernels/sm90/fused_bwd.py) against the
unfused backward's five grouped launches (dgrad2 + dSwiGLU, dgrad1, three wgrads).

* dx rows, dWg, dWu and dWd bitwise equal to the unfused ones, on uniform, skewed (empty
  experts, partial m-tiles) and one-expert routings, with and without the SwiGLU clamp;
* bitwise across 3 repeats and across grid sizes (132, 37, 8 CTAs);
* the layer: ``mok_cute.moe`` forward + backward with ``MOK_CUTE_FUSED_BWD=1`` gives every
  gradient bitwise equal to ``MOK_CUTE_FUSED_BWD=0`` (shared expert included: it runs the core
  too, as one group of all tokens);
* time of the core vs the five launches at 8 experts x 4096 rows, H 7168, I 2048.
"""
from __future__ import annotations

import os

import torch

from checks.common import Row, bench_us
from checks.layer_sm90 import _problem, _run


def _operands(m_counts, h, inter, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    e = len(m_counts)
    m = sum(m_counts)
    rnd = lambda *s, fan=1.0: (torch.randn(*s, device=dev, generator=g) * fan ** -0.5).bfloat16()
    offsets = torch.tensor([0] + list(torch.tensor(m_counts).cumsum(0)), dtype=torch.int32, device=dev)
    return (rnd(m, h), rnd(m, h), rnd(m, 2 * inter), rnd(m, inter), offsets, rnd(e, inter, h, fan=h),
            rnd(e, inter, h, fan=h), rnd(e, h, inter, fan=inter))


def _unfused(dy, x, gu, h, offsets, wg, wu, wd, limit):
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.layers.common import ExpertGroup, mlp_backward

    g = ExpertGroup(x, offsets, gu, h, "bf16")
    return mlp_backward(bwd._run_dswiglu_dgrad, bwd._run_dgrad1, bwd._run_wgrad, g, dy, wg, wu, wd, limit)


def run(ctx) -> list[Row]:
    from checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_bwd")
    if skip:
        return skip
    from mok_cute.kernels.sm90.fused_bwd import fused_backward_core

    dev = ctx.device
    rows = []
    cases = [("uniform", [370, 385, 390, 361, 402, 377, 366, 389], None),
             ("skewed", [2845, 0, 32, 0, 4, 82, 0, 37], 4.0),
             ("one expert", [0, 0, 1000, 0], 1.5)]
    names = ("dx", "dWg", "dWu", "dWd")
    for name, counts, limit in cases:
        ops = _operands(counts, 1024, 512, dev, seed=len(name))
        want = _unfused(*ops, limit)
        runs = [fused_backward_core(*ops, limit, num_ctas=n) for n in (132, 132, 132, 37, 8)]
        torch.cuda.synchronize()
        eq = [all(torch.equal(a, b) for a, b in zip(r, want)) for r in runs]
        diff = [n for n, a, b in zip(names, runs[0], want) if not torch.equal(a, b)]
        finite = all(bool(torch.isfinite(a.float()).all()) for a in runs[0])
        rows.append(Row(f"fused bwd core {name} L={limit}", bitwise=all(eq), ok=all(eq) and finite,
                        note=f"== unfused per run (132 x3, 37, 8 CTAs): {eq}; differs: {diff} M={sum(counts)}"))
    x, idx, w, ws, sh, dy = _problem(600, 1024, 512, 8, 4, True, True, dev, seed=71)
    outs = {}
    for flag in ("0", "1"):
        os.environ["MOK_CUTE_FUSED_BWD"] = flag
        try:
            outs[flag] = _run("sm90", x, idx, w, ws, sh, dy, 4.0)
        finally:
            del os.environ["MOK_CUTE_FUSED_BWD"]
    same = [torch.equal(a, b) for a, b in zip(outs["0"], outs["1"])]
    rows.append(Row("layer grads MOK_CUTE_FUSED_BWD=1 == 0 (skew + shared)", bitwise=all(same), ok=all(same),
                    note=f"[y, dx, dtw, dWg, dWu, dWd, dWs...] equal: {same}"))
    ops = _operands([4096] * 8, 7168, 2048, dev, seed=5)
    t_unf = bench_us(lambda: _unfused(*ops, 4.0))
    t_fus = bench_us(lambda: fused_backward_core(*ops, 4.0))
    flop = 2 * 8 * 4096 * 7168 * 2048 * 3 * 2  # dgrad2, dgrad1 (2I), dWd, dWg + dWu
    rows.append(Row("bench fused bwd core vs unfused (8x4096 rows, H 7168, I 2048)", time_us=t_fus, ok=True,
                    note=f"unfused {t_unf:.0f} us, fused {t_fus:.0f} us: {t_unf / t_fus:.3f}x; "
                         f"{flop / t_fus / 1e6:.0f} TFLOP/s fused"))
    return rows

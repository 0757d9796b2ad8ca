"""Device check: the shared expert's output gate on the sm90 backend at EP = 1 (the fused
forward's slot sum starting from fp32(s) * g, the fused backward's dx start plus the gate's fp32
share): y and every gradient (the gate's included) bitwise between the forward paths FUSED and
UNFUSED and between the backward paths FUSED and UNFUSED (``MoKConfig.forward_path`` /
``backward_path``), and within the BF16 tolerances of the reference backend
(tests/test_shared_gate.py pins the reference's rounding on the CPU)."""
from __future__ import annotations

import torch

from tools.checks.common import Row


def _run(backend, x, idx, w, ws, sh, w_sg, dy, fused="fused", bwd="fused"):
    """[y, dx, d topk_w, dW x3, dWs x3, d gate] of mok_cute.moe along the forward path ``fused``
    and the backward path ``bwd`` (the reference backend ignores both)."""
    import mok_cute

    paths = {} if backend == "reference" else dict(forward_path=fused, backward_path=bwd)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    weights = [p.clone().requires_grad_() for p in (*ws, *sh, w_sg)]
    y = mok_cute.moe(leaves[0], idx, leaves[1], *weights[:3], shared=tuple(weights[3:6]), shared_gate=weights[6],
                     swiglu_limit=4.0, config=mok_cute.MoKConfig(backend=backend, **paths))
    return [y, *torch.autograd.grad(y, leaves + weights, dy)]


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip
    from tools.checks.layer_sm90 import _problem

    skip = sm90_skip(ctx, "shared_gate")
    if skip:
        return skip
    dev = ctx.device
    rows = []
    x, idx, w, ws, sh, dy = _problem(600, 1024, 512, 8, 4, True, True, dev, seed=81)
    g = torch.Generator(device=dev).manual_seed(82)
    w_sg = (torch.randn(1, 1024, device=dev, generator=g) * 0.05).bfloat16()
    base = _run("sm90", x, idx, w, ws, sh, w_sg, dy, fused="unfused", bwd="unfused")
    for fused, bwd in (("fused", "unfused"), ("fused", "fused"), ("unfused", "fused")):
        got = _run("sm90", x, idx, w, ws, sh, w_sg, dy, fused, bwd)
        same = [torch.equal(a, b) for a, b in zip(got, base)]
        rows.append(Row(f"shared gate sm90 forward {fused} backward {bwd} == unfused", bitwise=all(same),
                        ok=all(same), note=f"[y, dx, dtw, dW x3, dWs x3, d gate] equal: {same}"))
    ref = _run("reference", x, idx, w, ws, sh, w_sg, dy)
    worst = 0.0
    for a, b in zip(base, ref):
        rel = float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp_min(1e-30))
        worst = max(worst, rel)
    rows.append(Row("shared gate sm90 vs the reference backend", max_err=worst, ok=worst < 2e-2,
                    note=f"max relative L1 over y and every gradient {worst:.2e} (< 2e-2, BF16)"))
    return rows

"""Device check: ``torch.compile(fullgraph=True)`` of a model with MoELayer on the sm90 backend
(the fused forward and backward through the ``mok_cute::moe_fwd`` / ``moe_bwd`` custom ops): the
loss and every gradient bitwise the eager step's, with the router (aot_eager: the traced graph
as is) and with external routing under inductor; and the eager host time per forward next to
the compiled one. The CPU suite runs the same on the reference backend (tests/test_compile.py)."""
from __future__ import annotations

import time

import torch

from tools.checks.common import Row


def _step(model, x, *route):
    for p in model.parameters():
        p.grad = None
    xl = x.clone().requires_grad_()
    y = model(xl, *route)
    y.float().square().mean().backward()
    return [y, xl.grad] + [p.grad for p in model.parameters()]


def _host_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "compile")
    if skip:
        return skip
    import mok_cute

    dev = ctx.device
    cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False)
    rows = []
    torch.manual_seed(0)
    model = mok_cute.MoELayer(1024, 512, 8, 2, shared_intermediate_size=512, swiglu_limit=7.0, config=cfg, device=dev)
    x = torch.randn(1024, 1024, device=dev).bfloat16()
    eager = _step(model, x)
    compiled = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), x)
    same = [torch.equal(a, b) for a, b in zip(eager, compiled)]
    rows.append(Row("torch.compile fullgraph (aot_eager) MoELayer + router", bitwise=all(same), ok=all(same),
                    note=f"[y, dx, weights' grads...] == eager: {same}"))
    torch.manual_seed(1)
    ext = mok_cute.MoELayer(1024, 512, 8, 2, shared_intermediate_size=512, router=False, config=cfg, device=dev)
    idx = torch.randint(-1, 8, (1024, 2), device=dev)
    w = torch.rand(1024, 2, device=dev)
    eager = _step(ext, x, idx, w)
    fn = torch.compile(ext, fullgraph=True)
    compiled = _step(fn, x, idx, w)
    same = [torch.equal(a, b) for a, b in zip(eager, compiled)]
    with torch.no_grad():
        t_eager = _host_us(lambda: ext(x, idx, w))
        t_comp = _host_us(lambda: fn(x, idx, w))
    rows.append(Row("torch.compile fullgraph (inductor) MoELayer, external routing", bitwise=all(same), ok=all(same),
                    note=f"== eager: {same}; host us per forward: eager {t_eager:.0f}, compiled {t_comp:.0f}"))
    return rows

"""Device check: a small MoE trained for 50 steps (router on, shared expert, SwiGLU clamp, AdamW on
every parameter), the loss curve bitwise identical across two runs and tracking the reference
backend's, for the sm90 backend along each backward path (``MoKConfig.backward_path``: UNFUSED,
FUSED, FUSED_WHOLE); and the whole step (forward, backward, optimizer step)
captured in one CUDA graph, its replays giving the eager run's losses bitwise.

The model: x [T, H] -> MoELayer -> y; loss = mean((y - target)^2) in fp32 with a fixed random
target, data fixed per step (a seeded generator). The CPU suite runs :func:`train` on the
reference backend (tests/test_train_loop.py).
"""
from __future__ import annotations

import torch

from tools.checks.common import Row

SHAPE = dict(tokens=512, hidden=512, inter=256, experts=8, top_k=2, shared=256)


def train(backend: str, steps: int, device, seed: int = 0, shape: dict = SHAPE, graph: bool = False,
          config: dict | None = None) -> list[float]:
    """The loss of each of ``steps`` AdamW steps (``graph``: the step captured once, replayed;
    ``config``: further MoKConfig fields, e.g. ``backward_path``)."""
    import mok_cute

    torch.manual_seed(seed)
    s = shape
    cfg = mok_cute.MoKConfig(backend=backend, validate_routing=not graph, **(config or {}))
    layer = mok_cute.MoELayer(s["hidden"], s["inter"], s["experts"], s["top_k"], shared_intermediate_size=s["shared"],
                              swiglu_limit=7.0, config=cfg, device=device)
    cuda = torch.device(device).type == "cuda"
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, capturable=cuda)  # one Adam form, eager or captured
    for p in layer.parameters():  # gradients exist before the first step (a graph captures them in place)
        p.grad = torch.zeros_like(p)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    xs = [torch.randn(s["tokens"], s["hidden"], device=device, generator=g).bfloat16() for _ in range(4)]
    target = torch.randn(s["tokens"], s["hidden"], device=device, generator=g)
    x_in = xs[0].clone()

    def step():
        opt.zero_grad(set_to_none=False)
        loss = (layer(x_in).float() - target).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    losses = []
    if not graph:
        for i in range(steps):
            x_in.copy_(xs[i % len(xs)])
            losses.append(float(step()))
        return losses
    x_in.copy_(xs[0])
    side = torch.cuda.Stream()  # warm-up on a side stream (compiles, caches, optimizer state)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses.append(float(step()))
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        loss = step()
    for i in range(1, steps):
        x_in.copy_(xs[i % len(xs)])
        cuda_graph.replay()
        losses.append(float(loss))
    return losses


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "train_loop")
    if skip:
        return skip
    dev = ctx.device
    ref = train("reference", 50, dev)
    rows = []
    for path in ("unfused", "fused", "fused_whole"):
        paths = dict(backward_path=path)
        a, b = train("sm90", 50, dev, config=paths), train("sm90", 50, dev, config=paths)
        gap = max(abs(x - y) / abs(y) for x, y in zip(a, ref))
        ok = a == b and gap < 2e-2 and a[-1] < a[0]
        rows.append(Row(f"train 50 steps sm90 backward_path={path}", max_err=gap, bitwise=a == b, ok=ok,
                        note=f"loss {a[0]:.5f} -> {a[-1]:.5f}; reference {ref[0]:.5f} -> {ref[-1]:.5f}; "
                             f"max rel gap to the reference {gap:.1e} (< 2e-2)"))
    eager = train("sm90", 10, dev, graph=False)
    try:
        replayed = train("sm90", 10, dev, graph=True)
        same = eager == replayed
        note = f"eager {eager[-1]:.6f}, graph {replayed[-1]:.6f}"
    except Exception as exc:  # capture failing is the finding
        same, note = False, f"{type(exc).__name__}: {exc}"[:110]
    rows.append(Row("train step (fwd + bwd + AdamW) in one CUDA graph == eager, 10 steps", bitwise=same, ok=same,
                    note=note))
    return rows

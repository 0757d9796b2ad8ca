"""gpt-oss's experts at gpt-oss-20b's dimensions (T8192 H2880 I2880 E32 k4), one layer (``mok_cute.moe``, EP = 1):
plain SwiGLU against gpt-oss's activation (``SwiGLU.gpt_oss()``: alpha 1.702, up offset 1, limit 7) and against
that activation with the experts' biases, forward and forward + backward side by side in one process (CUDA
events, the median of ``--iters`` calls, the best of ``--rounds`` interleaved rounds). Issue 47's target: the
activation (with its biases) within 5% of plain SwiGLU.

    python -m tools.bench_gpt_oss [--tokens 8192] [--iters 20] [--rounds 2]

Prints one row per case; a figure quoted from it names the card, the date and the commit.
"""
from __future__ import annotations

import argparse

import torch

from tools.checks.common import bench_us


def _inputs(t: int, h: int, inter: int, e: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16().requires_grad_()
    vals, idx = torch.randn(t, e, device="cuda", generator=g).topk(k, dim=-1)
    w = torch.softmax(vals, -1).requires_grad_()
    ws = [(torch.randn(e, *s, device="cuda", generator=g) * s[1] ** -0.5).bfloat16().requires_grad_()
          for s in ((inter, h), (inter, h), (h, inter))]
    bs = [(torch.randn(e, n, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_() for n in (inter, inter, h)]
    dy = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    return x, idx, w, ws, bs, dy


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    import mok_cute
    from mok_cute import SwiGLU

    x, idx, w, ws, bs, dy = _inputs(a.tokens, 2880, 2880, 32, 4)
    cases = {"plain SwiGLU": (tuple(ws), None), "gpt-oss activation": (tuple(ws), SwiGLU.gpt_oss()),
             "gpt-oss activation + biases": (tuple(zip(ws, bs)), SwiGLU.gpt_oss())}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(a.rounds):
        for name, (routed, act) in cases.items():
            def fwd(routed=routed, act=act):
                return mok_cute.moe(x, idx, w, *routed, swiglu_limit=act)
            with torch.no_grad():
                tf = bench_us(fwd, warmup=3, iters=a.iters) / 1e3
            tb = bench_us(lambda: torch.autograd.backward(fwd(), dy), warmup=3, iters=a.iters) / 1e3
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], tf), min(old[1], tb))
    base = best["plain SwiGLU"][1]
    print(f"# {torch.cuda.get_device_name()}: T{a.tokens} H2880 I2880 E32 k4")
    for name, (tf, tb) in best.items():
        print(f"{name:28s} fwd {tf:7.3f} ms  fwd+bwd {tb:7.3f} ms  fwd+bwd / plain {tb / base:.3f}x")
    return best


if __name__ == "__main__":
    main()

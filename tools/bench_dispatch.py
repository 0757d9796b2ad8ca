"""Host time per eager ``mok_cute.moe`` call (forward + backward) spent in the API itself: the
backend is replaced by a stub that returns preallocated outputs, so what is timed is validation,
config handling, the autograd plumbing (the custom ops of ``mok_cute.custom_ops``, or an older
tree's autograd.Function) and the state hand-over. Runs on the CPU; compare two trees:

    python3 tools/bench_dispatch.py                      # this tree
    PYTHONPATH=/tmp/base python3 /tmp/base/tools/bench_dispatch.py   # e.g. the commit before

Prints the median us per forward and per forward + backward over many calls (T 256, H 1024).
"""
from __future__ import annotations

import statistics
import time

import torch

import mok_cute
from mok_cute import reference
from mok_cute.layers import select


class _Stub:
    """A backend that does no math: forward returns a preallocated y, backward preallocated grads."""

    name = "stub"

    def __init__(self, x, topk_w, ws):
        self.y = torch.zeros_like(x)
        self.grads = reference.MoEGrads(torch.zeros_like(x), torch.zeros_like(topk_w), *(torch.zeros_like(w) for w in ws),
                                        None)

    def forward(self, inp, config, group):
        return self.y, object()

    def backward(self, state, dy, main_grads=None):
        return self.grads


def main() -> int:
    t, h, i, e, k = 256, 1024, 512, 8, 4
    x = torch.randn(t, h).bfloat16().requires_grad_()
    idx = torch.randint(0, e, (t, k))
    tw = torch.rand(t, k).requires_grad_()
    ws = [torch.randn(e, i, h).bfloat16().requires_grad_(), torch.randn(e, i, h).bfloat16().requires_grad_(),
          torch.randn(e, h, i).bfloat16().requires_grad_()]
    stub = _Stub(x, tw, ws)
    select.get_backend = lambda name: stub  # what both paths look up
    if hasattr(mok_cute.ops, "get_backend"):
        mok_cute.ops.get_backend = lambda name: stub
    cfg = mok_cute.MoKConfig(backend="reference", validate_routing=False)
    dy = torch.ones(t, h, dtype=torch.bfloat16)
    fwd, step = [], []
    for it in range(2200):
        a = time.perf_counter()
        y = mok_cute.moe(x, idx, tw, *ws, config=cfg)
        b = time.perf_counter()
        y.backward(dy)
        c = time.perf_counter()
        if it >= 200:
            fwd.append(b - a)
            step.append(c - a)
        x.grad = tw.grad = None
        for w in ws:
            w.grad = None
    print(f"forward {statistics.median(fwd) * 1e6:.1f} us, forward + backward {statistics.median(step) * 1e6:.1f} us "
          f"per call (median of 2000; stub backend, T {t}, H {h})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

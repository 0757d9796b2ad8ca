"""Where the host time of one expert-MLP fwd+bwd goes (sm90 backend), at a small shape where
the host, not the GPU, bounds the step: wall time per step (pipelined, one sync at the end)
and a cProfile table of 50 steps (top functions by own time).

    source .gpu-node/activate.sh && python3 tools/host_overhead.py [E M H I]
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    import mok_cute  # noqa: PLC0415
    from mok_cute.ops import expert_mlp  # noqa: PLC0415

    e, m, h, inter = (int(v) for v in (argv or [8, 4096, 4096, 1024]))
    dev = torch.device("cuda")
    offs = torch.arange(0, m + 1, m // e, device=dev, dtype=torch.int32)
    x = torch.randn(m, h, device=dev).bfloat16().requires_grad_()
    wg, wu = ((torch.randn(e, inter, h, device=dev) * h ** -0.5).bfloat16().requires_grad_() for _ in range(2))
    wd = (torch.randn(e, h, inter, device=dev) * inter ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, h, device=dev).bfloat16()
    cfg = mok_cute.MoKConfig(backend="sm90")

    def step():
        torch.autograd.backward(expert_mlp(x, offs, wg, wu, wd, config=cfg), dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    for label, n in (("pipelined", 50),):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        t_host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / n * 1e6
        print(f"[host_overhead] E{e} M{m} H{h} I{inter} {label}: host enqueue {t_host:.0f} us/step, "
              f"incl. drain {t_all:.0f} us/step")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

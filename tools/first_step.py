"""Seconds from process start to the end of a layer's first forward + backward, and whether that
step's outputs are bitwise those of an earlier process (the on-disk kernel cache's check).

    MOK_CUTE_CACHE_DIR=DIR python -m tools.first_step --precision bf16 --ref REF.pt   # cold: compiles
    MOK_CUTE_CACHE_DIR=DIR python -m tools.first_step --precision bf16 --ref REF.pt   # warm: loads

The layer: ``MoELayer`` with its router, T1024 H2048 I1024 E16 k8 (the shape of issue 46's report)
unless given. The first process writes y, dx and every gradient of its fourth step to ``REF``; a later
one compares its own with ``torch.equal``. Prints one line: import seconds, first-step seconds, their
sum, the bitwise verdict (None for the writer), then the compile cache's and the launcher's counters.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()  # the process's start, as near as a module can see it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="bf16", choices=("bf16", "mxfp8", "fp8_block"))
    p.add_argument("--ref", required=True, help="outputs of the first process (written when absent)")
    p.add_argument("--shape", default="1024,2048,1024,16,8", help="T,H,I,E,k")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the first step's N most expensive functions (cProfile, cumulative seconds)")
    a = p.parse_args(argv)
    import mok_cute
    from mok_cute.dsl.compile import cache_stats
    from mok_cute.dsl.launch import stats as launch_stats

    t_import = time.perf_counter() - _T0
    t, h, i, e, k = (int(v) for v in a.shape.split(","))
    torch.manual_seed(0)
    layer = mok_cute.MoELayer(h, i, e, k, config=mok_cute.MoKConfig(precision=a.precision), device="cuda")
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    prof = cProfile.Profile() if a.profile else None
    start = time.perf_counter()
    with prof or contextlib.nullcontext():
        layer(x).float().square().mean().backward()
        torch.cuda.synchronize()
    t_step = time.perf_counter() - start
    for _ in range(3):  # graph captures, then replays, of the same kernels
        x.grad = None
        layer.zero_grad()
        y = layer(x)
        y.float().square().mean().backward()
    torch.cuda.synchronize()
    out = [y, x.grad] + [q.grad for q in layer.parameters() if q.grad is not None]
    same = None
    if os.path.exists(a.ref):
        same = all(torch.equal(u, v) for u, v in zip(out, torch.load(a.ref)))
    else:
        torch.save(out, a.ref)
    print(f"{a.precision} cache {os.environ.get('MOK_CUTE_CACHE_DIR')}: import {t_import:.2f} s, first fwd+bwd "
          f"{t_step:.2f} s (start to end of step 1: {t_import + t_step:.2f} s), bitwise = first process: {same}\n"
          f"  {cache_stats()}\n  launches {launch_stats()}", flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
    return 0 if same in (None, True) else 1


if __name__ == "__main__":
    raise SystemExit(main())

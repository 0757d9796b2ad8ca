"""Device check: the EP = 1 routing plan kernel (mok_cute/schedule/local_plan.py) against its
torch mirror ``plan_reference``, bitwise (order, offsets, sanitised ids, error words), on
random, skewed (one hot expert, empty experts, -1 slots), all -1, out-of-range and empty
routings (int64 ids past int32's range among them), int32 and int64 ids, E from 1 to 1024 and T*k up to 163840; plus its time next to
the torch mirror's (one call each, CUDA events)."""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us

CASES = [  # (name, T, k, E, mode)
    ("random", 4096, 8, 16, "random"), ("skewed", 8192, 10, 32, "skew"), ("all -1", 1000, 4, 8, "none"),
    ("out of range", 2048, 6, 64, "bad"), ("E=1", 777, 3, 1, "random"), ("E=1024", 4096, 8, 1024, "random"),
    ("T16384 k10", 16384, 10, 256, "random"), ("empty", 0, 4, 8, "random"), ("T=1", 1, 8, 16, "random"),
]


def _ids(t, k, e, mode, dev, gen, dtype):
    ids = torch.randint(-1, e, (t, k), device=dev, generator=gen)
    if mode == "skew":
        ids = torch.where(torch.rand(t, k, device=dev, generator=gen) < 0.7, torch.zeros_like(ids), ids)
        ids[ids == 3] = -1
    elif mode == "none":
        ids.fill_(-1)
    elif mode == "bad":
        ids[::5, 0] = e + 3
        ids[1::7, -1] = -9
    ids = ids.to(dtype)
    if mode == "bad" and dtype == torch.int64:  # ids whose low 32 bits are valid experts are still bad
        ids[2::11, 1] = 2**32 + 1
        ids[3::13, 2] = -(2**32) + 2
    return ids


def run(ctx) -> list[Row]:
    from mok_cute.schedule import local_plan as lp

    dev, rows = ctx.device, []
    gen = torch.Generator(device=dev).manual_seed(7)
    for name, t, k, e, mode in CASES:
        for dtype in (torch.int32, torch.int64):
            ids = _ids(t, k, e, mode, dev, gen, dtype)
            got = lp.plan_local(ids, e)
            want = lp.plan_reference(ids, e)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            note = f"T{t} k{k} E{e} {str(dtype)[6:]}"
            us = None
            if same and t >= 4096:
                us = bench_us(lambda: lp.plan_local(ids, e), warmup=3, iters=20)
                note += f"; torch mirror {bench_us(lambda: lp.plan_reference(ids, e), warmup=3, iters=20):.0f} us"
            rows.append(Row(f"local plan {name}", bitwise=same, ok=same, time_us=us, note=note))
    return rows

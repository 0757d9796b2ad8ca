"""Shared pieces of the device checks: the result row, the run context, timing."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One check: ``max_err`` vs the reference, ``bitwise`` equality (None if not asked),
    ``time_us`` (median, None if not timed), ``ok`` and a short note (e.g. GB/s)."""

    name: str
    max_err: float | None = None
    bitwise: bool | None = None
    time_us: float | None = None
    ok: bool = True
    note: str = ""

    @staticmethod
    def table(rows: list["Row"], device: str) -> str:
        head = f"{'check':44s} {'max_err':>10s} {'bitwise':>7s} {'time_us':>10s} {'ok':>4s}  note"
        lines = [f"== gpu_check on {device} ==", head, "-" * len(head)]
        for r in rows:
            err = "-" if r.max_err is None else f"{r.max_err:.3g}"
            bw = "-" if r.bitwise is None else ("yes" if r.bitwise else "NO")
            t = "-" if r.time_us is None else f"{r.time_us:.1f}"
            lines.append(f"{r.name[:44]:44s} {err:>10s} {bw:>7s} {t:>10s} {'ok' if r.ok else 'FAIL':>4s}  {r.note}")
        return "\n".join(lines)


@dataclass
class Ctx:
    """Where the checks run: rank/world (torchrun sets them; 1 process otherwise)."""

    rank: int
    world: int
    device: torch.device
    device_name: str

    @staticmethod
    def create() -> "Ctx":
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        return Ctx(rank, world, dev, torch.cuda.get_device_name(dev))


def bench_us(fn, warmup: int = 5, iters: int = 20, barrier=None) -> float:
    """Median time of ``fn()`` in microseconds, timed with CUDA events; ``barrier`` (e.g.
    ``dist.barrier``) is called between the warm-up and the timed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_pipelined_us(fn, warmup: int = 3, iters: int = 10) -> float:
    """Mean time of ``fn()`` in microseconds over ``iters`` back-to-back calls with no sync
    between them (one CUDA-event pair around all): a training step's view, where the host
    enqueues the next call while the GPU runs this one."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def sm90_skip(ctx: Ctx, check: str) -> list[Row] | None:
    """The one skipped row of ``check`` unless the device is an sm_90 GPU (None: run it)."""
    if torch.cuda.get_device_capability(ctx.device) != (9, 0):
        return [Row(f"{check}: skipped", ok=True, note=f"needs sm_90, have {ctx.device_name}")]
    return None


def sm100_skip(ctx: Ctx, check: str) -> list[Row] | None:
    """The one skipped row of ``check`` unless the device is a Blackwell (sm_100 / sm_103) GPU."""
    if torch.cuda.get_device_capability(ctx.device) not in ((10, 0), (10, 3)):
        return [Row(f"{check}: skipped", ok=True, note=f"needs sm_100 / sm_103, have {ctx.device_name}")]
    return None


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``, after seeding torch's global RNG with it too."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return gen

"""Shared pieces of the device checks (``tools/checks``, run by ``python -m tools.gpu_check``): the result
row, the run context, timing, power sampling, and running a check in a child process."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
    from mok_cute.bench.run import events_ms

    for _ in range(warmup - 1):
        fn()
    return events_ms(fn, iters) * 1e3  # events_ms makes the last warm-up call itself


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


def busy_samples(lines: list[str], busy_w: float = 300.0) -> list[tuple[float, float, int]]:
    """``(MHz, W, clock-event reasons)`` of the ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active
    --format=csv,noheader,nounits`` samples (``"1980, 125.46, 0x0000000000000000"``) drawing more than ``busy_w`` W
    (the GPU busy); unparsable lines skipped."""
    busy = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz, watts, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except (IndexError, ValueError):
            continue
        if watts > busy_w:
            busy.append((mhz, watts, reasons))
    return busy


def power_summary(lines: list[str], busy_w: float = 300.0) -> str:
    """Summary of nvidia-smi samples (:func:`busy_samples`): of those drawing more than ``busy_w`` W, the SM clock
    (mean, min), the mean power and the share with the software power cap active (reason bit 0x4)."""
    busy = busy_samples(lines, busy_w)
    if not busy:
        return f"no sample above {busy_w:.0f} W"
    n = len(busy)
    capped = sum(1 for *_, r in busy if r & 0x4)
    return (f"{n} samples above {busy_w:.0f} W: SM clock mean {sum(b[0] for b in busy) / n:.0f} MHz (min "
            f"{min(b[0] for b in busy):.0f}), power mean {sum(b[1] for b in busy) / n:.0f} W, power cap active in "
            f"{100 * capped / n:.0f}%")


@contextlib.contextmanager
def env_var(name, value: str | None = None):
    """``os.environ[name] = value`` (or every ``name: value`` of a dict ``name``) inside the block, the caller's
    values (or none) after it."""
    values = name if isinstance(name, dict) else {name: value}
    prev = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class PowerSampler:
    """``nvidia-smi`` samples of the SM clock, power and clock-event reasons every ``ms`` while the
    block runs (none where nvidia-smi is absent); :meth:`summary` after it (:func:`power_summary`)."""

    def __init__(self, ms: int = 250):
        self.ms, self.proc, self.lines = ms, None, []

    def __enter__(self) -> "PowerSampler":
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.ms)], stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.lines = out.splitlines()

    def summary(self) -> str:
        return power_summary(self.lines) if self.proc is not None else "nvidia-smi not found"


ROOT = Path(__file__).resolve().parents[2]  # the repository: ``python -m tools.gpu_check`` runs from here


def child_rows(check: str, env: dict, timeout_s: float, label: str) -> list[Row]:
    """The rows of ``python -m tools.gpu_check check`` run in a child process from the repository root
    with ``env`` added (rank 0 of 1), read back from its ``$OUT/gpu_check.jsonl``; one failed row named
    ``label`` if it times out or writes none."""
    with tempfile.TemporaryDirectory() as out:
        full = {**os.environ, **env, "OUT": out, "RANK": "0", "WORLD_SIZE": "1"}
        cmd = [sys.executable, "-m", "tools.gpu_check", check]
        try:
            code = subprocess.run(cmd, env=full, cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return [Row(f"{label}: child timed out", ok=False, note=f"killed after {timeout_s} s")]
        return read_rows(Path(out) / "gpu_check.jsonl", label, code)


def read_rows(path: Path, label: str, code: int) -> list[Row]:
    """The rows a ``gpu_check`` run wrote as JSON lines to ``path``; one failed row named ``label``
    (with the run's exit ``code``) if it wrote none."""
    if not path.exists() or not path.read_text().strip():
        return [Row(f"{label}: child failed", ok=False, note=f"exit code {code}, no rows written")]
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def all_skipped(rows: list[Row]) -> bool:
    """Every row is a check's "skipped" row (e.g. ``needs sm_90``): the check did not apply here."""
    return bool(rows) and all(r.ok and r.name.endswith(": skipped") for r in rows)

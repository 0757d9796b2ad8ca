"""Device check: the on-disk kernel cache (``mok_cute.dsl.disk_cache``) across real processes.

Each step is a fresh ``python -m tools.first_step`` process (the layer with its router, one
forward + backward, then three more steps) on the same inputs:

  cold       an empty cache directory: compiles and stores every kernel; writes the reference outputs
  warm       the same directory: loads every kernel (no ``cute.compile``), outputs bitwise the cold ones
  off        no disk cache: compiles, outputs bitwise
  writers    four processes at once on a second empty directory: each finishes, each bitwise

A row per step, its note the process's "start to end of step 1" seconds and the cache counters;
the warm row also says whether the first step ended within 1.5 s of the import (issue 46's target,
reported, not asserted). Timeouts bound every process.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.checks.common import Row

TIMEOUT_S = 300
WRITERS = 4


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "disk_cache")
    if skip:
        return skip
    with tempfile.TemporaryDirectory(prefix="mok_cache_check_") as tmp:
        tmp = Path(tmp)
        ref, cache = tmp / "ref.pt", tmp / "cache"
        rows = [_row("cold", [_start(cache, ref)], compiled=True),
                _row("warm", [_start(cache, ref)], compiled=False),
                _row("off", [_start("off", ref)], compiled=True)]
        rows.append(_row(f"{WRITERS} writers", [_start(tmp / "shared", ref) for _ in range(WRITERS)], compiled=None))
    return rows


def _start(cache, ref: Path) -> subprocess.Popen:
    env = dict(os.environ, MOK_CUTE_CACHE_DIR=str(cache))
    return subprocess.Popen([sys.executable, "-m", "tools.first_step", "--ref", str(ref)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _row(step: str, procs: list[subprocess.Popen], compiled: bool | None) -> Row:
    """One row for ``procs`` (started together): each exited 0 with outputs bitwise the cold run's (the
    cold run itself writes them); ``compiled`` True: each compiled kernels, False: none did (all loaded),
    None (writers sharing one directory: a process may load what another stored): some process did."""
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n(killed after {TIMEOUT_S} s)"
        outs.append(out)
        codes.append(p.returncode)
    facts = [_facts(o) for o in outs]
    ok = all(c == 0 for c in codes) and all(f["kernel_compiles"] is not None for f in facts)
    if ok and compiled is None:
        ok = any(f["kernel_compiles"] > 0 for f in facts)
    elif ok:
        ok = all((f["kernel_compiles"] > 0) == compiled for f in facts)
    note = "; ".join(f"{f['seconds']} s to the end of step 1, kernel_compiles {f['kernel_compiles']}, "
                     f"disk hits {f['disk_hits']}, bitwise {f['bitwise']}" for f in facts)
    if step == "warm" and facts[0]["step_s"] is not None:
        note += f"; first step {'within' if facts[0]['step_s'] <= 1.5 else 'over'} 1.5 s of the import"
    if not ok:
        note += " | " + " || ".join(o.strip().splitlines()[-1] if o.strip() else "(no output)" for o in outs)
    bitwise = None if step == "cold" else all(f["bitwise"] == "True" for f in facts)
    return Row(f"disk cache: {step}", bitwise=bitwise, ok=ok and bitwise is not False, note=note)


def _facts(out: str) -> dict:
    """What one ``tools.first_step`` process printed: seconds, first-step seconds, bitwise, counters."""
    def grab(pattern, cast=str):
        m = re.search(pattern, out)
        return None if m is None else cast(m.group(1))

    return {"seconds": grab(r"start to end of step 1: ([\d.]+) s"), "step_s": grab(r"first fwd\+bwd ([\d.]+) s", float),
            "bitwise": grab(r"bitwise = first process: (\w+)"),
            "kernel_compiles": grab(r"'kernel_compiles': (\d+)", int), "disk_hits": grab(r"'disk_hits': (\d+)", int)}

"""Device checks: runs the check modules of tools/checks on the GPU(s) here and prints their rows.

Usage (from the repo root, on a GPU machine):
    python -m tools.gpu_check [name ...]                     # every check, or the named ones
    torchrun --nproc_per_node=2 -m tools.gpu_check comm      # the EP > 1 checks
    pytest -m gpu tests/gpu                                  # every check as a test, each in its own process

A check is a module ``tools/checks/<name>.py`` (every module there but ``common``: :func:`check_names`)
with ``run(ctx) -> list[Row]``; a Row is one result: name, max error, bitwise equal (or None when
tolerance-based), time in microseconds, and a pass flag with a note. The table is printed last; the
exit status is non-zero if any check failed or raised. Rows are also written as JSON lines to
``$OUT/gpu_check.jsonl`` when ``$OUT`` is set (how :func:`tools.checks.common.child_rows` reads a
child's rows).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path

from tools.checks.common import Ctx, Row

CHECKS_DIR = Path(__file__).resolve().parent / "checks"


def check_names() -> list[str]:
    """Every check module's name, sorted (read from the directory: nothing is imported)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(CHECKS_DIR)]) if m.name != "common")


def run_check(name: str, ctx: Ctx) -> list[Row]:
    """The rows of check ``name``; a check that raises gives one failed row (the others still run)."""
    try:
        return importlib.import_module(f"tools.checks.{name}").run(ctx)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return [Row(f"{name}: crashed", ok=False, note=f"{type(e).__name__}: {e}"[:120])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0],
                                 epilog=f"checks: {' '.join(check_names())}")
    ap.add_argument("names", nargs="*", metavar="NAME", help="checks to run (default: all)")
    names = ap.parse_args(argv).names or check_names()
    unknown = sorted(set(names) - set(check_names()))
    if unknown:
        print(f"unknown check(s) {unknown}; known: {' '.join(check_names())}", file=sys.stderr)
        return 2
    ctx = Ctx.create()
    rows: list[Row] = []
    for name in names:
        t0 = time.time()
        rows += run_check(name, ctx)
        print(f"[gpu_check] {name} took {time.time() - t0:.1f}s", flush=True)
    if ctx.rank == 0:
        out = os.environ.get("OUT")
        if out:
            with open(Path(out) / "gpu_check.jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps(r.__dict__) + "\n")
        print(Row.table(rows, ctx.device_name))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

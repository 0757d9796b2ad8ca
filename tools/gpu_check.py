"""Device check script: runs every check module in tools/checks on the GPU(s) here.

Usage (on the H200, from the repo root):
    source .gpu-node/activate.sh && python3 tools/gpu_check.py [name ...]
    source .gpu-node/activate.sh && torchrun --nproc_per_node=2 tools/gpu_check.py comm

Each module in tools/checks defines ``run(ctx) -> list[Row]``; a Row is one check:
name, max error, bitwise equal (or None when tolerance-based), time in microseconds, and a
pass flag with a note. The table is printed last; the exit code is non-zero if any check
failed or raised. Rows are also written as JSON lines to $OUT/gpu_check.jsonl when $OUT is set.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from checks.common import Row, Ctx  # noqa: E402


def main(argv: list[str]) -> int:
    names = argv or sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "tools" / "checks")])
                           if m.name != "common")
    ctx = Ctx.create()
    rows: list[Row] = []
    for name in names:
        t0 = time.time()
        try:
            mod = importlib.import_module(f"checks.{name}")
            rows += mod.run(ctx)
        except Exception as e:  # a crashing check is a failed row, the others still run
            traceback.print_exc()
            rows.append(Row(f"{name}: crashed", ok=False, note=f"{type(e).__name__}: {e}"[:120]))
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
    sys.exit(main(sys.argv[1:]))

"""Device check: expert ids outside [-1, E) with ``validate_routing=False`` (the CUDA-graph
setting) through mok_cute.moe at EP = 1, BF16, fused and unfused forward.

Such a route must be skipped exactly like a -1 slot (y bitwise equal to the same call with
those ids replaced by -1), no kernel may read or write out of bounds for it (run this check
under ``compute-sanitizer --tool memcheck``), and ``mok_cute.check_errors()`` must raise
RuntimeError naming topk_idx afterwards (no host sync in the call itself).
"""
from __future__ import annotations

import torch

from tools.checks.common import Row
from tools.checks.layer_sm90 import _problem


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_bad_expert")
    if skip:
        return skip
    import mok_cute

    x, idx, w, ws, sh, _ = _problem(300, 1024, 512, 8, 4, True, False, ctx.device, seed=500)
    bad = idx.clone()
    bad[3, 1], bad[7, 0], bad[299, 3] = 8 + 5, -7, 1 << 20
    clean = torch.where((bad < -1) | (bad >= 8), torch.full_like(bad, -1), bad)
    rows = []
    for path in ("fused", "unfused"):
        cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False, forward_path=path)
        with torch.no_grad():
            mok_cute.check_errors()  # nothing pending from earlier checks
            y_clean = mok_cute.moe(x, clean, w, *ws, shared=sh, config=cfg)
            y_bad = mok_cute.moe(x, bad, w, *ws, shared=sh, config=cfg)  # a later call would raise
        try:
            mok_cute.check_errors()
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        same = torch.equal(y_bad, y_clean)
        ok = same and "topk_idx" in raised and "3 expert id" in raised
        rows.append(Row(f"bad expert ids skipped, raised later ({path})", bitwise=same, ok=ok,
                        note=(raised or "no error raised")[:110]))
    return rows

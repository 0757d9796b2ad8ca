"""Device check: the fused SM90 forward's summed list (``MOK_CUTE_SUM_GROUPS``: the slot sum as tasks of the
ticket list, beside the later column groups' GEMM2 tiles; mok_cute.schedule.fused_tasks) through mok_cute.moe
at EP = 1, with a 3 s device timeout so that a scheduling bug fails fast.

Per case (uniform routing; skewed with the shared expert and L = 4; skewed + shared at H 1216: 5 n-tiles,
at 3 and 4 groups of widths 2, 2, 1, the last n-tile partial), BF16 and MXFP8:
  * y bitwise the plain list's (the default) at 1, 3 and 4 column groups, each in its own (comm_sms_fwd,
    minibatch_tokens) configuration, and at 4 groups with the direct gather;
  * no device wait timed out (``check_errors``).
"""
from __future__ import annotations

import torch

from checks.common import Row
from checks.fused_fwd import CONFIGS, _gathered, _moe
from checks.layer_sm90 import _problem


def run(ctx) -> list[Row]:
    from checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_summed")
    if skip:
        return skip
    from mok_cute.kernels.sm90 import fused_moe as fused

    rows = []
    cases = [("uniform", 1024, False, False, None), ("skew+shared L=4", 1024, True, True, 4.0),
             ("skew+shared H=1216", 1216, True, True, None)]
    for i, (name, hid, skew, shared, limit) in enumerate(cases):
        x, idx, w, ws, sh, _ = _problem(1000, hid, 512, 8, 4, shared, skew, ctx.device, seed=500 + i)
        for precision in ("bf16", "mxfp8"):
            def moe(**c):
                return _moe(x, idx, w, ws, sh, limit, precision=precision, device_timeout_s=3.0, **c)
            with torch.no_grad():
                want = moe()
            ys = [_gathered("MOK_CUTE_SUM_GROUPS", str(g), lambda c=c, m=m: moe(comm_sms_fwd=c, minibatch_tokens=m))
                  for g, (c, m) in zip((1, 3, 4), CONFIGS)]
            direct = "MOK_CUTE_GATHER_MX" if precision == "mxfp8" else "MOK_CUTE_GATHER"
            ys.append(_gathered(direct, "direct", lambda: _gathered("MOK_CUTE_SUM_GROUPS", "4", moe)))
            try:
                fused.check_errors()
                err = ""
            except RuntimeError as exc:
                err = str(exc)[:120]
            same = all(torch.equal(y, want) for y in ys)
            rows.append(Row(f"fused summed {precision} {name}", bitwise=same, ok=same and not err,
                            note=err or "1 / 3 / 4 groups and 4 + direct == the plain list"))
    return rows

"""Device check: only the GEMM1 + SwiGLU rows with h's MXFP8 copy (``mx_h``) of
:mod:`checks.gemm_sm90` (bitwise vs reference.mxfp8_quantize, gu/h == the plain kernel),
for a short run; ``gemm_sm90`` runs them too."""
from __future__ import annotations

from tools.checks.common import Row, seeded, sm90_skip
from tools.checks.gemm_sm90 import _check_swiglu_mx, _guarded


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "swiglu_mx"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415

    gen = seeded(4321)
    return [_guarded("swiglu mx_h", _check_swiglu_mx, gg, ref, ctx.device, gen, routing, limit, tma)
            for routing, limit, tma in (("uniform", None, True), ("skewed", 4.0, True), ("skewed", 4.0, False))]

"""SwiGLU and dSwiGLU element math in FP32, shared by the SM90 and SM100 epilogues (numerics of
:mod:`mok_cute.reference`; ``clamp`` with limit L: g = min(g, L), u = clamp(u, -L, L))."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def swiglu_(g: cute.Tensor, u: cute.Tensor, limit: Float32, clamp: cutlass.Constexpr[bool]):
    """g = silu(g) * u elementwise, in place (FP32 register tensors)."""
    for i in cutlass.range_constexpr(cute.size(g)):
        gi = g[i]
        ui = u[i]
        if cutlass.const_expr(clamp):
            gi = cutlass.min(gi, limit)
            ui = cutlass.max(cutlass.min(ui, limit), -limit)
        g[i] = gi / (Float32(1.0) + cute.math.exp(-gi)) * ui


@cute.jit
def dswiglu(dh: Float32, g: Float32, u: Float32, limit: Float32, clamp: cutlass.Constexpr[bool]):
    """(dg, du) of h = silu(g) * u at upstream gradient ``dh``; clamped inputs get zero gradient."""
    gc = g
    uc = u
    if cutlass.const_expr(clamp):
        gc = cutlass.min(g, limit)
        uc = cutlass.max(cutlass.min(u, limit), -limit)
    s = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gc, fastmath=True))
    dg = dh * uc * s * (Float32(1.0) + gc * (Float32(1.0) - s))
    du = dh * (gc * s)
    if cutlass.const_expr(clamp):
        dg = Float32(cutlass.select_(g > limit, Float32(0.0), dg))
        du = Float32(cutlass.select_((u < -limit) | (u > limit), Float32(0.0), du))
    return dg, du

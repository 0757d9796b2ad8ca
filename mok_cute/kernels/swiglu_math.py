"""SwiGLU and dSwiGLU element math in FP32, shared by the SM90 and SM100 epilogues (numerics of
:mod:`mok_cute.reference`'s :class:`~mok_cute.reference.SwiGLU`).

Compile-time switches: ``clamp`` (limit L given, a runtime Float32: gc = min(g, L),
uc = clamp(u, -L, L)) and ``gated`` (None: h = silu(gc) * uc, the plain SwiGLU, whose code is the same
whatever gated activations exist; a :class:`Gated` (alpha a, up offset o): h = gc * sigmoid(a * gc) *
(uc + o) with a and o baked in as fp32 constants, so they belong in every compile key, as ``gated``).
The host side turns a layer's activation argument into these with :func:`swiglu_args`."""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32


class Gated(NamedTuple):
    """The alpha (sigmoid slope) and up offset of a SwiGLU other than silu(g) * u (gpt-oss: 1.702, 1.0),
    Python floats a kernel uses as fp32 constants (a compile-time switch: part of every compile key)."""

    alpha: float
    up_offset: float


def swiglu_args(act) -> tuple[bool, Gated | None, float]:
    """``(clamp, gated, limit)`` of a kernel's activation argument: None (silu(g) * u), a clamp limit L, or
    an object with ``limit``, ``alpha``, ``up_offset`` (a :class:`~mok_cute.reference.SwiGLU`; ``gated`` None
    when alpha is 1 and up_offset 0). ``limit`` is the runtime Float32 value (0.0 without a clamp)."""
    if act is None or isinstance(act, (int, float)):
        lim, gated = act, None
    else:
        lim = act.limit
        plain = act.alpha == 1.0 and act.up_offset == 0.0
        gated = None if plain else Gated(float(act.alpha), float(act.up_offset))
    return lim is not None, gated, 0.0 if lim is None else float(lim)


@cute.jit
def swiglu_(g: cute.Tensor, u: cute.Tensor, limit: Float32, clamp: cutlass.Constexpr[bool],
            gated: cutlass.Constexpr = None):
    """g = act(gc) * (uc + o) elementwise, in place (FP32 register tensors); plain (``gated`` None):
    silu(gc) * uc = gc / (1 + exp(-gc)) * uc. Gated, in the reference's op order: act(gc) = silu(gc)
    at alpha 1, else gc * (1 / (1 + exp(-(a * gc)))); then uc + o (skipped at o = 0), then the product."""
    for i in cutlass.range_constexpr(cute.size(g)):
        gi = g[i]
        ui = u[i]
        if cutlass.const_expr(clamp):
            gi = cutlass.min(gi, limit)
            ui = cutlass.max(cutlass.min(ui, limit), -limit)
        if cutlass.const_expr(gated is None):
            g[i] = gi / (Float32(1.0) + cute.math.exp(-gi)) * ui
        else:
            if cutlass.const_expr(gated.alpha == 1.0):
                act = gi / (Float32(1.0) + cute.math.exp(-gi))
            else:
                act = gi * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-(Float32(gated.alpha) * gi))))
            up = ui
            if cutlass.const_expr(gated.up_offset != 0.0):
                up = ui + Float32(gated.up_offset)
            g[i] = act * up


@cute.jit
def dswiglu(dh: Float32, g: Float32, u: Float32, limit: Float32, clamp: cutlass.Constexpr[bool],
            gated: cutlass.Constexpr = None):
    """(dg, du) of :func:`swiglu_`'s h at upstream gradient ``dh``; clamped inputs get zero gradient.
    With s = sigmoid(a * gc) (a = 1 plain): dg = dh * (uc + o) * s * (1 + a * gc * (1 - s)),
    du = dh * (gc * s), the reference's order (plain: dh * uc * s * (1 + gc * (1 - s)))."""
    gc = g
    uc = u
    if cutlass.const_expr(clamp):
        gc = cutlass.min(g, limit)
        uc = cutlass.max(cutlass.min(u, limit), -limit)
    if cutlass.const_expr(gated is None):
        s = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gc, fastmath=True))
        dg = dh * uc * s * (Float32(1.0) + gc * (Float32(1.0) - s))
        du = dh * (gc * s)
    else:
        t = gc  # a * gc (exactly gc at a = 1)
        if cutlass.const_expr(gated.alpha != 1.0):
            t = Float32(gated.alpha) * gc
        s = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-t, fastmath=True))
        up = uc
        if cutlass.const_expr(gated.up_offset != 0.0):
            up = uc + Float32(gated.up_offset)
        dg = dh * up * s * (Float32(1.0) + t * (Float32(1.0) - s))
        du = dh * (gc * s)
    if cutlass.const_expr(clamp):
        dg = Float32(cutlass.select_(g > limit, Float32(0.0), dg))
        du = Float32(cutlass.select_((u < -limit) | (u > limit), Float32(0.0), du))
    return dg, du

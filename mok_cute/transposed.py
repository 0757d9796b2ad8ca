"""Expert weights given transposed: a model's contiguous [E, K, N] tensor seen as the [E, N, K] the layer
takes (gpt-oss's ``down_proj`` [E, I, H] as w_down [E, H, I]).

In an eager :func:`mok_cute.moe` call autograd takes the view itself: the forward hands the kernels one
contiguous re-layout (:func:`operand`, the tiled transpose of :mod:`mok_cute.kernels.relayout`) and the
backward returns the gradient as the same kind of view of a new contiguous [E, K, N] tensor (:func:`grad`),
which autograd hands to the parameter as it is. Before, ``contiguous()`` on the view and the parameter's
gradient accumulation each made a torch strided copy, reading or writing 2-byte elements K or N apart.
Values are unchanged: the same weights reach the same kernels; the gradient is the same numbers.
"""
from __future__ import annotations

import torch

from .dsl.host import tma_weight
from .kernels.relayout import relayout, relayout_fits


def is_transposed(w: torch.Tensor) -> bool:
    """Whether the 3-D weight ``w`` [E, N, K] is the transpose of a tensor :func:`relayout` takes (contiguous
    [E, K, N], 16-byte aligned, K and N multiples of 8) and the kernels cannot address it in place."""
    return w.dim() == 3 and not tma_weight(w) and relayout_fits(w.transpose(1, 2))


def operand(w: torch.Tensor) -> torch.Tensor:
    """``w`` (:func:`is_transposed`) as a contiguous [E, N, K] tensor."""
    return relayout(w.transpose(1, 2), "plain")


def grad(g: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient ``g`` [E, N, K] of a transposed weight as a view of a contiguous [E, K, N] tensor (the
    weight's own layout), or ``g`` itself when :func:`relayout` cannot take it."""
    if g is None or not relayout_fits(g):
        return g
    return relayout(g, "plain").transpose(1, 2)

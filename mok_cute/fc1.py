"""Gate and up as one projection tensor, fc1 (Megatron's ``linear_fc1``, transformers' ``gate_up_proj``).

Models keep the experts' gate and up weights in one tensor ``base``: [E, 2I, H], or [E, H, 2I]
("transposed", e.g. gpt-oss), with gate and up as its two halves along the 2I dim, or interleaved
(gate at even, up at odd positions, e.g. gpt-oss). :func:`mok_cute.moe` takes w_gate and w_up as
views of it; when both are views of one ``base`` (:func:`find`), the layer's autograd function takes
``base`` itself, so that

* the kernels read the views in place where TMA addresses them ([E, 2I, H] halves or interleaved
  rows) and otherwise one re-layout copy of ``base`` into a [E, 2I, H] halves buffer
  (:func:`operands`: one read, one write, instead of a strided copy per view; a transposed ``base`` by
  the tiled transpose of :mod:`mok_cute.kernels.relayout`), and
* ``base``'s gradient is one tensor in ``base``'s layout (:func:`grad`): the fused backward's
  dW_gate / dW_up, the halves of one buffer, as they are for [E, 2I, H] halves; one copy into
  ``base``'s layout otherwise. Autograd on the views instead allocates a zero-filled gradient of
  ``base``'s size per view, copies each in, and adds the two (about six bytes of traffic per byte
  of ``base``, and twice its size in memory at the peak).

Values are unchanged: the same weights reach the same kernels; gradients are the same numbers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .dsl.host import halves_of, tma_weight
from .kernels.relayout import relayout, relayout_fits

LAYOUTS = tuple((t, i) for t in (False, True) for i in (False, True))  # (transposed, interleaved)


class Fc1(NamedTuple):
    """``base`` [E, 2I, H] (or [E, H, 2I] when ``transposed``) holding w_gate and w_up as its halves along
    the 2I dim, or ``interleaved`` (gate at even, up at odd positions)."""

    base: torch.Tensor
    transposed: bool
    interleaved: bool


def rows(base: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``base`` as [E, 2I, H] (a view)."""
    return base.transpose(1, 2) if transposed else base


def split(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) [E, I, H] views of ``gate_up`` [E, 2I, H]: its halves, or its even / odd rows."""
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


def find(w_gate: torch.Tensor, w_up: torch.Tensor) -> Fc1 | None:
    """The :class:`Fc1` whose gate and up views ``w_gate`` and ``w_up`` [E, I, H] are, or None (not views of
    one 3-D tensor that way: separate tensors, a part of a bigger tensor, swapped halves)."""
    base = w_gate._base
    if base is None or w_up._base is not base or base.dim() != 3 or w_gate.dim() != 3:
        return None
    e, inter, h = w_gate.shape
    for transposed, interleaved in LAYOUTS:
        gate_up = rows(base, transposed)
        if tuple(gate_up.shape) != (e, 2 * inter, h):
            continue
        gate, up = split(gate_up, interleaved)
        if _same_view(gate, w_gate) and _same_view(up, w_up):
            return Fc1(base, transposed, interleaved)
    return None


def operands(fc1: Fc1) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate, w_up) [E, I, H] as the kernels take them: the views of ``fc1.base`` themselves when TMA
    addresses both (:func:`mok_cute.dsl.host.tma_weight`), else the halves of one contiguous [E, 2I, H]
    re-layout of it (a transposed ``base``: :func:`mok_cute.kernels.relayout.relayout`'s tiled transpose)."""
    gate_up = rows(fc1.base, fc1.transposed)
    gate, up = split(gate_up, fc1.interleaved)
    if tma_weight(gate) and tma_weight(up):
        return gate, up
    if fc1.transposed and relayout_fits(fc1.base):
        return split(relayout(fc1.base, "deinterleave" if fc1.interleaved else "plain"), False)
    e, two_i, h = gate_up.shape
    if fc1.interleaved:  # [E, I, 2, H] -> [E, 2, I, H]: gate rows, then up rows
        gate_up = gate_up.unflatten(1, (two_i // 2, 2)).transpose(1, 2)
    return split(gate_up.reshape(e, two_i, h).contiguous(), False)


def grad(fc1: Fc1, d_gate: torch.Tensor | None, d_up: torch.Tensor | None) -> torch.Tensor | None:
    """``fc1.base``'s gradient in its layout from the gate / up gradients [E, I, H] (None when both are None:
    accumulated elsewhere). When they are the halves of one [E, 2I, H] buffer (the fused backward's): that
    buffer itself for [E, 2I, H] halves (no copy), its tiled transpose for a transposed ``base``; otherwise one
    copy of each into a new tensor of ``base``'s strides."""
    if d_gate is None and d_up is None:
        return None
    buf = halves_of(d_gate, d_up)
    if buf is not None and not fc1.transposed and not fc1.interleaved:
        return buf
    if buf is not None and fc1.transposed and relayout_fits(buf) and fc1.base.is_contiguous():
        return relayout(buf, "interleave" if fc1.interleaved else "plain")
    out = torch.empty_like(fc1.base)
    gate, up = split(rows(out, fc1.transposed), fc1.interleaved)
    gate.copy_(d_gate)
    up.copy_(d_up)
    return out

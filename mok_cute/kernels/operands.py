"""Host-side operand bundles of the fused MoE kernels, shared by the archs' launchers.

Arch-neutral: torch tensors and plain Python values only (no CuTe import), so that any arch's
host code, the layers and the tests can build them. Each bundle groups operands by meaning:

* :class:`RoutePlan`: where the routed rows come from and go (the routing plan of one pass);
* :class:`ExpertWeights`: the routed experts' weights;
* :class:`SharedExpert`: the shared expert's weights and its optional output gate;
* :class:`FusedLaunch`: how a fused forward launches (grid split, ring, timeout, trace,
  precision of the moving rows): policy, never numerics of a given precision;
* :class:`FusedForwardOut`: what a fused forward returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class RoutePlan(NamedTuple):
    """The routing plan of one pass, all on x's device.

    order: int32 [M_cap], the route ``t*k + j`` of each grouped row (rows sorted by expert; at
        EP > 1 the device plan's ``recv_src``, packed ``p*T*k + t*k + j``);
    offsets: int32 [E+1], each (local) expert's first grouped row, ``offsets[E]`` the row count;
    topk_idx: int32 [T, k], the expert id of each slot, -1 for none;
    topk_w: fp32 [T, k], the router weight of each slot.
    """

    order: torch.Tensor
    offsets: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor


class ExpertWeights(NamedTuple):
    """The routed experts' weights, bf16 (at MXFP8 their MXFP8 round trips, as the kernels read
    them): ``w_gate``, ``w_up`` [E, I, H] and ``w_down`` [E, H, I]."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class SharedExpert(NamedTuple):
    """The shared expert: ``w_gate``, ``w_up`` [I_s, H] and ``w_down`` [H, I_s] bf16 (at MXFP8
    their round trips); ``gate``: None or fp32 [T], its output gate per token (the layer's
    output starts from ``fp32(shared output) * gate``)."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gate: torch.Tensor | None = None

    @property
    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w_gate, w_up, w_down)``."""
        return self.w_gate, self.w_up, self.w_down

    @classmethod
    def of(cls, weights, gate: torch.Tensor | None = None) -> SharedExpert | None:
        """The bundle of ``weights`` (a ``(w_gate, w_up, w_down)`` tuple, or None: no shared
        expert, then None) and ``gate``; a gate without a shared expert raises ValueError."""
        if weights is None:
            if gate is not None:
                raise ValueError("the shared expert's output gate needs a shared expert")
            return None
        return cls(*weights, gate=gate)


@dataclass(frozen=True)
class FusedLaunch:
    """How a fused forward launches (the numerics do not depend on any of these except ``mx``).

    comm_ctas: CTAs that gather (EP > 1: pull) the routed rows before they take GEMM tiles;
        clamped to ``[1, num_ctas - 1]`` (a GEMM CTA must be left to free ring slots).
    timeout_s: bound on every device-side wait; a timeout is raised on the host later.
    num_ctas: the grid; None: one CTA per SM (fewer for virtual ranks sharing one GPU).
    ring_chunks: slots of 128 gathered rows in the ring; None (or more than the routed m-tiles
        can number): one slot per m-tile, no slot reused.
    trace: the kernel records one timestamped record per task (``mok_cute.trace``).
    mx: the MXFP8 forward (x's rows move as e4m3 + E8M0; the reference's MXFP8 numerics).
    tile_n / stages: the GEMMs' tile width and ring of shared-memory stages (None: the arch's
        default; the layer checks a policy's values per arch, ``mok_cute.layers.tiles``). Results do
        not depend on them (each element's sum over K keeps its order).
    band: R1's m-tiles per band (the GEMM1 walk's raster order), at most ``ring_chunks`` (the layer
        checks it, ``mok_cute.layers.launch``); None: the kernel's ``RING_BAND``. Results do not
        depend on it.
    """

    comm_ctas: int
    timeout_s: float
    num_ctas: int | None = None
    ring_chunks: int | None = None
    trace: bool = False
    mx: bool = False
    tile_n: int | None = None
    stages: int | None = None
    band: int | None = None


class FusedForwardOut(NamedTuple):
    """What a fused forward returns (a tuple: unpacks and indexes as one).

    y: bf16 [T, H], the layer's output; gu: bf16 [M_cap, 2I]; h: bf16 [M_cap, I] (the routed
    rows' GEMM1 output and activation); slot_out: bf16 [T*k, H], the GEMM2 row of each route
    (rows of -1 slots unwritten); gus, hs, s_out: the shared expert's gu [T, 2I_s], h [T, I_s]
    and output [T, H] (None without one); counters: the kernel's int32 counter tensors, its
    status words last; w_rows: fp32 [M_cap], each grouped row's router weight (EP > 1; None at
    EP = 1).
    """

    y: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    slot_out: torch.Tensor
    gus: torch.Tensor | None
    hs: torch.Tensor | None
    s_out: torch.Tensor | None
    counters: list
    w_rows: torch.Tensor | None

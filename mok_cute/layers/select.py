"""Backend selection and the backends behind :func:`mok_cute.moe`.

A backend has ``forward(inputs, config, group) -> (y, state)``, ``backward(state, dy,
main_grads=None) -> reference.MoEGrads`` and ``shared_gate`` (whether it runs the shared
expert's output gate). Selection: ``config.backend`` ("auto": by device: CPU -> reference
(announced once), capability 9.0 -> sm90, 10.x -> sm100, others -> reference); the environment
plays no part. A GPU backend asked for what it does not run (a precision not wired, a path its
table does not allow: :mod:`mok_cute.layers.paths`) raises NotImplementedError: it never
silently falls back on a GPU.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from mok_cute import reference
from mok_cute.config import BACKENDS, MoKConfig
from mok_cute.layers.grouped import GroupedExpertBackend
from mok_cute.layers.sm90 import Sm90ExpertMLP
from mok_cute.layers.sm100 import Sm100ExpertMLP

_announced: set[str] = set()


@dataclass
class MoEInputs:
    """The arguments of one layer call (weights are this rank's local slice; shapes and dtypes:
    :func:`mok_cute.moe`): ``shared`` (ws_gate, ws_up, ws_down) or None, ``swiglu_limit`` the
    activation as the expert MLPs and their kernels take it: None (silu(g) * u), a clamp limit L, or
    a :class:`~mok_cute.reference.SwiGLU` when its alpha or up offset is not the default (the
    kernels' :func:`~mok_cute.kernels.swiglu_math.swiglu_args` compile them in), ``shared_gate`` [1, H]
    the shared expert's output gate or None, ``main_grads`` the fp32 buffers the backward adds the
    weight gradients into, or None, ``biases`` the routed experts' (b_gate, b_up [E_local, I],
    b_down [E_local, H]) bf16 or None."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared: tuple | None
    swiglu_limit: float | reference.SwiGLU | None
    shared_gate: torch.Tensor | None = None
    main_grads: tuple | None = None
    biases: tuple | None = None


def select_backend(device: torch.device, config: MoKConfig) -> str:
    """Name of the backend that runs on ``device`` under ``config`` (its ``backend`` field)."""
    choice = config.backend
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        if device.type != "cuda":
            _announce("no CUDA device: mok_cute runs the pure-torch reference backend")
            return "reference"
        major, _ = torch.cuda.get_device_capability(device)
        if major == 9:
            return "sm90"
        if major == 10:
            return "sm100"
        _announce(f"capability {major}.x has no mok_cute kernels: running the reference backend")
        return "reference"
    if choice in ("sm90", "sm100") and device.type != "cuda":
        raise ValueError(f"backend {choice!r} needs CUDA tensors, got tensors on {device}")
    return choice


def _announce(msg: str) -> None:
    if msg not in _announced:
        _announced.add(msg)
        warnings.warn(msg, stacklevel=3)


class ReferenceBackend:
    """The executable specification (mok_cute.reference), any device, every precision, every
    feature (the shared expert's output gate, the SwiGLU's alpha / up offset, expert biases)."""

    name = "reference"
    shared_gate = True  # runs the shared expert's output gate

    def forward(self, inp: MoEInputs, config: MoKConfig, group):
        return reference.moe_forward(inp.x, inp.topk_idx, inp.topk_w, inp.w_gate, inp.w_up,
                                     inp.w_down, inp.shared, inp.swiglu_limit, config.precision,
                                     group, inp.shared_gate, inp.biases)

    def backward(self, state, dy: torch.Tensor, main_grads=None) -> reference.MoEGrads:
        """(``main_grads`` is the caller's to accumulate into: every gradient is returned.)"""
        return reference.moe_backward(state, dy)


_BACKENDS = {
    "reference": ReferenceBackend(),
    "sm90": GroupedExpertBackend(Sm90ExpertMLP()),
    "sm100": GroupedExpertBackend(Sm100ExpertMLP()),
}


def get_backend(name: str):
    """The backend object registered under ``name``."""
    return _BACKENDS[name]

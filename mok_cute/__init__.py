"""mok_cute: deterministic Mixture-of-Experts training kernels in CUTLASS CuTe DSL.

Public API: :func:`moe`, :class:`MoELayer`, :class:`SwiGLU` (the experts' activation: clamp
limit, alpha, up offset), :class:`MoKConfig` (with its path enums
:class:`ForwardPath`, :class:`BackwardPath` and its :class:`KernelPolicy` of :class:`GemmTiles`),
:func:`check_errors` (raise for a device-side error an earlier call recorded: a wait that
timed out, an expert id out of range with ``validate_routing=False``; waits for the queued
launches), :func:`tune` (the autotuner: the fastest KernelPolicy for a shape on this GPU,
written to the tuning file the layer reads). The pure-torch reference (:mod:`mok_cute.reference`) is the executable
specification. Importing needs no GPU and no CuTe DSL; kernels are compiled lazily on first use.
"""
from .config import BackwardPath, ForwardPath, MoKConfig
from .policy import GemmTiles, KernelPolicy
from .dsl.deferred import check as check_errors
from .layer import MoELayer
from .ops import moe
from .reference import SwiGLU
from . import custom_ops  # noqa: F401  (the mok_cute:: ops, registered on import)
from . import tune  # noqa: F401  (mok_cute.tune(...): the autotuner; python -m mok_cute.tune)

__all__ = ["BackwardPath", "ForwardPath", "GemmTiles", "KernelPolicy", "MoKConfig", "MoELayer", "SwiGLU", "check_errors",
           "moe", "tune"]
__version__ = "0.1.0"

"""mok_cute: deterministic Mixture-of-Experts training kernels in CUTLASS CuTe DSL.

Public API: :func:`moe`, :class:`MoELayer`, :class:`MoKConfig`. The pure-torch reference
(:mod:`mok_cute.reference`) is the executable specification. Importing needs no GPU and no
CuTe DSL; kernels are compiled lazily on first use.
"""
from .config import MoKConfig
from .layer import MoELayer
from .ops import moe

__all__ = ["MoKConfig", "MoELayer", "moe"]
__version__ = "0.1.0"

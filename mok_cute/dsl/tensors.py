"""Tensors handed to compiled kernels: symbolic compile-time fakes and the DSL's runtime tensors.

Fake-tensor shapes must be symbolic: the runtime tensors (:func:`_cute_tensor`) mark every
shape mode dynamic, and the argument descriptor holds only dynamic modes, so a static mode in
the fake shifts every later field (this made a kernel read gu's strides wrong).
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack


def _dynamic(*dims):
    """TypeError unless every fake-tensor dim is symbolic (see the module doc)."""
    for d in dims:
        if isinstance(d, int):
            raise TypeError(f"fake tensor dims must be symbolic (cute.sym_int), got the int {d}")


def _div16(dtype) -> int:
    """Elements of ``dtype`` in 16 bytes (row strides are multiples of it: TMA, 16-byte vectors)."""
    return 128 // dtype.width


def _fake_2d(dtype, rows, cols):
    """Row-major [rows, cols] fake with a symbolic row stride (a multiple of 16 bytes), 16-byte aligned."""
    _dynamic(rows, cols)
    return cute.runtime.make_fake_tensor(dtype, (rows, cols), stride=(cute.sym_int64(divisibility=_div16(dtype)), 1),
                                         assumed_align=16)


def _fake_3d(dtype, d0, d1, d2):
    """Row-major [d0, d1, d2] fake with symbolic outer strides (multiples of 16 bytes), 16-byte aligned."""
    _dynamic(d0, d1, d2)
    div = _div16(dtype)
    stride = (cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div), 1)
    return cute.runtime.make_fake_tensor(dtype, (d0, d1, d2), stride=stride, assumed_align=16)


def _cute_tensor(t, align=16):
    """The DSL's own runtime tensor (every shape mode dynamic, strides dynamic but the last = 1);
    ~10 us per tensor on the host (the SM90 launches pack the same bytes faster: ``_Desc``)."""
    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

"""The arch-neutral routed-row device code of the megakernels (mok_cute.kernels.slot_rows) compiles on the CPU
from its operand bundles: :class:`SlotSumOperands` through ``cute.compile`` into a host function, a kernel and
the nested slot sum, each optional tensor absent at compile time when None and adding its own instructions when
given; :class:`TokenRows` into the staged gather. The numerics run inside the fused kernels' device checks."""
from __future__ import annotations

import functools
import re

import pytest

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64

from mok_cute.dsl.compile import compile_kernel
from mok_cute.dsl.tensors import _fake_2d
from mok_cute.kernels import slot_rows

THREADS, NB, CAP = 128, 2, 2  # threads per CTA, slot rows in flight, units per lane and batch


@cute.kernel
def _sum_kernel(ops: slot_rows.SlotSumOperands, k: Int32, tokens: Int32, hidden: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    sbuf = cutlass.memory.SmemAllocator().allocate_tensor(
        cutlass.BFloat16, cute.make_layout((NB * THREADS, 8), stride=(8, 1)), 16)
    slot_rows.slot_sum(tidx, bidx, grid, ops, k, tokens, hidden, sbuf, NB, THREADS)


@cute.jit
def _sum_host(ops: slot_rows.SlotSumOperands, k: Int32, tokens: Int32, hidden: Int32, stream):
    _sum_kernel(ops, k, tokens, hidden).launch(grid=[2, 1, 1], block=[THREADS, 1, 1], stream=stream)


@cute.kernel
def _gather_kernel(src: slot_rows.TokenRows, rows: Int32, units: Int32, dst_base: Int64):
    tidx, _, _ = cute.arch.thread_idx()
    sbuf = cutlass.memory.SmemAllocator().allocate_tensor(
        cutlass.BFloat16, cute.make_layout((2 * CAP * THREADS, 8), stride=(8, 1)), 16)
    slot_rows.gather_rows_staged(tidx, rows, units, src, dst_base, Int32(0), sbuf, THREADS, CAP)


@cute.jit
def _gather_host(src: slot_rows.TokenRows, rows: Int32, units: Int32, dst_base: Int64, stream):
    _gather_kernel(src, rows, units, dst_base).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)


def _vec(dtype):
    return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=4)


OPTIONAL = ("init", "w", "gate", "add", "copy", "row")


@functools.cache
def _sum_ptx(*given: str) -> str:
    """The PTX of a slot sum whose optional tensors are ``given`` (``gate`` comes with ``init``)."""
    t, rows = cute.sym_int(), cute.sym_int()
    h = cute.sym_int(divisibility=8)
    fakes = dict(init=_fake_2d(cutlass.BFloat16, t, h), w=_vec(cutlass.Float32), gate=_vec(cutlass.Float32),
                 add=_fake_2d(cutlass.Float32, t, h), copy=_fake_2d(cutlass.BFloat16, rows, h), row=_vec(Int32))
    ops = slot_rows.SlotSumOperands(_fake_2d(cutlass.BFloat16, rows, h), None, _fake_2d(cutlass.BFloat16, t, h),
                                    _vec(Int32))._replace(**{name: fakes[name] for name in given})
    return compile_kernel(_sum_host, ops, Int32(2), Int32(1), Int32(64), cute.runtime.make_fake_stream(),
                          arch="sm_90a", inspect=True)[1].ptx


def _count(ptx: str, op: str) -> int:
    return sum(1 for ln in ptx.splitlines() if ln.strip().startswith(op))


def test_slot_sum_bundle_defaults():
    """Only the slot rows, the start, the output and the slot index are positional; every other tensor of the
    sum defaults to None (absent)."""
    ops = slot_rows.SlotSumOperands(1, None, 2, 3)
    assert ops._fields == ("slot", "init", "out", "idx") + OPTIONAL[1:]
    assert all(getattr(ops, f) is None for f in OPTIONAL)


@pytest.mark.parametrize("given", [(), ("w",), ("init",), ("init", "gate"), ("add",), ("copy",), ("row",)],
                         ids=lambda g: "-".join(g) or "bare")
def test_slot_sum_compiles_each_optional_tensor(given):
    """Each optional tensor of the bundle changes the code only when given: the router weights and the gate
    multiply (``mul.rn.f32``), the start, the addend and the row map add global loads, the copy adds stores."""
    ptx, bare = _sum_ptx(*given), _sum_ptx()
    assert "cp.async" in ptx and "add.rn.f32" in ptx  # slot rows staged by cp.async, summed by add.rn
    if not given:
        assert "mul.rn.f32" not in ptx
        return
    assert ptx != bare
    if "w" in given or "gate" in given:
        assert "mul.rn.f32" in ptx
    if {"init", "add", "row"} & set(given):
        assert _count(ptx, "ld.global") > _count(bare, "ld.global")
    if "copy" in given:
        assert _count(ptx, "st.global") > _count(bare, "st.global")


def test_gather_rows_staged_compiles_from_token_rows():
    """The staged gather of grouped rows from their token rows (:class:`TokenRows`): 16-byte cp.async loads into
    shared memory, one batch in flight behind the one being stored (``cp.async.wait_group 1``)."""
    order = _vec(Int32)
    src = slot_rows.TokenRows(order, Int32(0), Int32(2), Int64(0), Int32(128))
    ptx = compile_kernel(_gather_host, src, Int32(64), Int32(8), Int64(0), cute.runtime.make_fake_stream(),
                         arch="sm_90a", inspect=True)[1].ptx
    assert "cp.async.cg.shared.global" in ptx
    assert re.search(r"cp\.async\.wait_group\s+1;", ptx)
    assert slot_rows.TokenRows._fields == ("order", "row0", "k", "base", "row_bytes")

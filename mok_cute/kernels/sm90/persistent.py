"""Device helpers of the SM90 persistent megakernels (the fused forward and backward): the task
tickets, their hand-off from the producer warp to the consumer warpgroups, and the producer's
bounded wait for a task's inputs.

A CTA's producer warp claims task ids from a ticket counter (:func:`claim`, list order across
the grid), hands each to the two consumer warpgroups through two shared-memory slots guarded by
named barriers (:func:`hand_off` / :func:`take`: FULL + slot and EMPTY + slot, producer warp +
consumers, :data:`HANDOFF_THREADS`), waits for the task's inputs (:func:`wait_input`) and streams its k-tiles; the
consumers walk the same ids. A task id past the list, handed off last, stops the consumers;
:func:`finish_hand_offs` completes the EMPTY phases so no named barrier is left mid-phase when
the CTA exits. Named barrier 1 is the consumers' own (``mainloop.consumer_barrier``).

Tracing (a launcher's explicit ``trace`` flag): a kernel built with it writes one record of
``TRACE_WORDS`` int64 per task (:func:`record`: start / end from %globaltimer, ``kind | cta << 8``,
the task id) into a device buffer, read by ``tools/trace_view.py``.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from mok_cute.comm import protocol as P
from mok_cute.kernels.sm90.mainloop import NUM_CONSUMER_THREADS

FULL, EMPTY = 2, 4  # named barrier ids of the two hand-off slots
HANDOFF_THREADS = 32 + NUM_CONSUMER_THREADS
TRACE_WORDS = 4  # per trace record: start ns, end ns, kind | cta << 8, task or chunk


@cute.jit
def now(on: cutlass.Constexpr):
    """%globaltimer in a traced kernel (``on``), else 0 (no instruction)."""
    t = Int64(0)
    if cutlass.const_expr(on):
        t = cute.arch.globaltimer()
    return t


@cute.jit
def record(mTrace: cute.Tensor, i: Int32, start: Int64, end: Int64, kind, cta: Int32, what: Int32):
    """Trace record ``i``: (start, end, kind | cta << 8, what)."""
    base = i * TRACE_WORDS
    mTrace[base] = start
    mTrace[base + 1] = end
    mTrace[base + 2] = Int64(kind) + (Int64(cta) << 8)
    mTrace[base + 3] = Int64(what)


@cute.jit
def claim(ticket: cute.Pointer):
    """Producer warp: the next task id (one atomic per warp, broadcast from lane 0)."""
    t = Int32(0)
    if cute.arch.lane_idx() == 0:
        t = cute.arch.atomic_add(ticket, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(t, 0)


@cute.jit
def hand_off(sTask: cute.Tensor, i: Int32, t: Int32, fields: tuple = ()):
    """Producer warp: hand-off ``i`` of task ``t`` (and the Int32 ``fields`` the producer decoded for it, so that
    the takers need no global loads) through slot ``i % 2`` of ``1 + len(fields)`` words."""
    slot = i % 2
    words = 1 + len(fields)
    if i >= 2:
        cute.arch.barrier(barrier_id=EMPTY + slot, number_of_threads=HANDOFF_THREADS)
    sTask[slot * words] = t
    for j in cutlass.range_constexpr(len(fields)):
        sTask[slot * words + 1 + j] = fields[j]
    cute.arch.barrier_arrive(barrier_id=FULL + slot, number_of_threads=HANDOFF_THREADS)


@cute.jit
def take(sTask: cute.Tensor, i: Int32, n_fields: cutlass.Constexpr[int] = 0):
    """Consumers: the task of hand-off ``i``; with ``n_fields``, ``(t, field_0, ...)``."""
    slot = i % 2
    words = 1 + n_fields
    cute.arch.barrier(barrier_id=FULL + slot, number_of_threads=HANDOFF_THREADS)
    t = sTask[slot * words]
    fields = [sTask[slot * words + 1 + j] for j in range(n_fields)]
    cute.arch.barrier_arrive(barrier_id=EMPTY + slot, number_of_threads=HANDOFF_THREADS)
    out = t
    if cutlass.const_expr(n_fields > 0):
        out = (t, *fields)
    return out


@cute.jit
def publish_count(counter: cute.Pointer, n: Int32, to_peers: cutlass.Constexpr[bool]):
    """One thread, past a barrier that ordered every store of ``n`` counted tiles before it: add ``n`` to
    ``counter`` (release, GPU scope) after one fence, cumulative over those stores (system scope when some went to
    peers); nothing when ``n`` is 0. A CTA's tiles that only a wait for all of them needs, published once."""
    if n > 0:
        P.fence_stores(to_peers)
        cute.arch.atomic_add(counter, n, sem="release", scope="gpu")


@cute.jit
def finish_hand_offs(i: Int32):
    """Producer warp after its last hand-off ``i``: complete the EMPTY phases of the last two."""
    for j in cutlass.range_constexpr(2):
        if i - 1 + j >= 0:
            cute.arch.barrier(barrier_id=EMPTY + (i - 1 + j) % 2, number_of_threads=HANDOFF_THREADS)


@cute.jit
def wait_input(counter: cute.Pointer, target: Int32, timeout_ns: Int64, status: cute.Pointer, channel: Int32,
               what: Int32):
    """Producer thread: bounded wait for ``*counter >= target`` (a timeout is recorded in
    ``status`` as ``(channel, what)``), then order the async proxy's (TMA) reads after the
    generic-proxy writes it observed."""
    P.wait_geq(counter, target, timeout_ns, status, what, channel)
    cute.arch.fence_proxy("async.global")


@cute.jit
def wait_inputs(counters: cute.Pointer, first: Int32, count: Int32, target: Int32, timeout_ns: Int64,
                status: cute.Pointer, channel: Int32, lanes: cutlass.Constexpr[bool] = True):
    """A whole producer warp: :func:`wait_input` for ``counters[first .. first + count)`` each ``>= target``;
    ``lanes``: the lanes wait on every 32nd counter side by side (not one after another), then the warp meets and
    every lane orders its async proxy's reads after what the warp observed (False: one after another, a warp with
    no registers to spare)."""
    if cutlass.const_expr(lanes):
        for m in cutlass.range(cute.arch.lane_idx(), count, 32, unroll=1):
            P.wait_geq(counters + first + m, target, timeout_ns, status, first + m, channel)
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")
    else:
        for m in cutlass.range(count, unroll=1):
            wait_input(counters + first + m, target, timeout_ns, status, channel, first + m)


def opaque(v: Int32) -> Int32:
    """``v`` through a side-effecting move: what is derived from it is computed where it is used
    (LLVM cannot hoist it out of a loop), so no register holds it across the loop (the
    megakernels' per-tile epilogue addresses)."""
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(Int32.mlir_type, [v.ir_value()], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True))


def describer(kernel: str, waits: dict):
    """The host's reading of a megakernel's status words ``(code, what, channel, target)``
    (:mod:`mok_cute.dsl.deferred`): None, or the error naming the wait that timed out
    (``waits``: channel -> what it waits for)."""
    def describe(words) -> str | None:
        code, what, channel, target = (int(w) for w in words)
        if code == P.OK:
            return None
        if code == P.TIMEOUT and channel in waits:
            return (f"mok_cute {kernel}: a device wait timed out ({waits[channel]} {what}, target {target}): "
                    "raise MoKConfig.device_timeout_s if the GPU is shared, otherwise this is a scheduling bug")
        return f"mok_cute {kernel}: device error code {code} ({what}, {channel}, {target})"
    return describe

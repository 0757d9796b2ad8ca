"""The task-id ring of the SM100 persistent megakernels (the fused forward and backward): the
TMA warp claims each task from the device ticket and hands its id to the MMA warp and the
epilogue warps through ``TASK_STAGES`` shared-memory slots guarded by an mbarrier pipeline (one
producer thread; a slot is free once MMA lane 0 and every epilogue thread have read it).

A kernel's shared storage holds ``task_bar`` (``STORAGE["task_bar"]``) and ``task`` slots;
:func:`make` builds the pipeline on them (``defer_sync``: the kernel's pipeline init barrier
covers it), :func:`publish` / :func:`take` move one id; :func:`kernel_start` is both kernels'
common start.

A CTA pair (``cta_group::2``: a cluster of two CTAs computes each 256-row tile) shares one
sequence of task ids: the leader's TMA warp claims each id once and :func:`publish_pair` writes it
into both CTAs' slots (its own with a plain store and an arrive; the peer's with ``st.async``,
whose bytes complete the peer's full barrier after a remote ``arrive.expect_tx``). Every reader
in either CTA (leader: MMA warp and epilogue warps; peer: TMA warp and epilogue warps) reads a
slot as a whole warp and its lane 0 frees it on the leader's empty barrier (a cluster-scope
remote arrive, :func:`take_pair`), so the leader reuses a slot only once both CTAs read it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Int32

from cutlass._mlir.dialects import nvvm

from mok_cute.kernels.sm100.mainloop import EPI_THREADS, EPI_WARPS, TMA_WARP
from mok_cute.kernels.sm90 import persistent

TASK_STAGES = 4  # task ids in flight from the TMA warp to the MMA and epilogue warps
ARRIVALS = 1 + EPI_THREADS  # a task slot is free once MMA lane 0 and every epilogue thread read it
PAIR_ARRIVALS = 2 * (1 + EPI_WARPS)  # a pair's slot: lane 0 of both CTAs' MMA / TMA and epilogue warps
STORAGE = {"task_bar": cute.struct.MemRange[cutlass.Int64, 2 * TASK_STAGES],
           "task": cute.struct.MemRange[cutlass.Int32, TASK_STAGES]}


def make(storage):
    """``(pipeline, slots)``: the ring's mbarrier pipeline and its int32 [TASK_STAGES] slots."""
    pipe = pipeline.PipelineAsync.create(
        barrier_storage=storage.task_bar.data_ptr(), num_stages=TASK_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, ARRIVALS), defer_sync=True)
    return pipe, storage.task.get_tensor(cute.make_layout(TASK_STAGES))


@cute.jit
def make_pair(storage):
    """``((full, empty), slots)``: a CTA pair's ring (the module doc) on the storage's ``task_bar``
    (full barriers: one arrival, the leader's; empty: :data:`PAIR_ARRIVALS`, used in the leader)
    and int32 [TASK_STAGES] slots; warp 0 initialises them, the kernel's cluster-wide pipeline
    init barrier makes them visible to the peer."""
    full = storage.task_bar.data_ptr()
    empty = full + TASK_STAGES
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        with cute.arch.elect_one():
            for i in cutlass.range_constexpr(TASK_STAGES):
                cute.arch.mbarrier_init(full + i, 1)
                cute.arch.mbarrier_init(empty + i, PAIR_ARRIVALS)
    cute.arch.mbarrier_init_fence()
    return (full, empty), storage.task.get_tensor(cute.make_layout(TASK_STAGES))


class Pipes(NamedTuple):
    """A megakernel's pipelines, made by :func:`kernel_start`: the A/B stages (``ab``: TMA warp ->
    MMA warp), the TMEM accumulators (``acc``: MMA warp -> epilogue warps), the task ring
    (``task`` with its id slots ``sTask``) and the TMEM allocator ``tmem``."""
    ab: Any
    acc: Any
    task: Any
    sTask: Any
    tmem: Any


@cute.jit
def kernel_start(ml, atoms, shared_storage):
    """Both megakernels' start: the TMA warp prefetches ``atoms``' descriptors, the storage is
    allocated, ``ml``'s A/B and accumulator pipelines, the task ring (``cta_group::2``: the pair's,
    :func:`make_pair`) and the TMEM allocator are made on it and the pipelines' init arrive is
    issued (cluster-wide); ``(warp, tidx, storage, Pipes)``.
    The caller takes its shared-memory tensors, then ``pipeline.pipeline_init_wait`` over the
    cluster ``(ml.cfg.cta_group, 1)``."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    if warp == TMA_WARP:
        for atom in atoms:
            cute.nvgpu.cpasync.prefetch_descriptor(atom)
    storage = cutlass.memory.SmemAllocator().allocate(shared_storage)
    ab_pipe, acc_pipe = ml.make_pipelines(storage)
    if cutlass.const_expr(ml.cfg.cta_group == 2):
        task_pipe, sTask = make_pair(storage)
    else:
        task_pipe, sTask = make(storage)
    tmem = ml.make_tmem_allocator(storage)
    pipeline.pipeline_init_arrive(cluster_shape_mn=(ml.cfg.cta_group, 1), is_relaxed=True)
    return warp, tidx, storage, Pipes(ab_pipe, acc_pipe, task_pipe, sTask, tmem)


def producer_state():
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TASK_STAGES)


def consumer_state():
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TASK_STAGES)


@cute.jit
def publish(task_pipe, state, sTask: cute.Tensor, t: Int32):
    """TMA warp: task id ``t`` into the next slot (lane 0 writes and arrives); the next state."""
    task_pipe.producer_acquire(state)
    if cute.arch.lane_idx() == 0:
        sTask[state.index] = t
        task_pipe.producer_commit(state)
    state.advance()
    return state


@cute.jit
def take(task_pipe, state, sTask: cute.Tensor, mma: cutlass.Constexpr[bool]):
    """MMA warp (``mma``: lane 0 frees the slot once the warp has read it) or epilogue thread
    (each frees it): ``(task id, next state)``."""
    task_pipe.consumer_wait(state)
    t = sTask[state.index]
    if cutlass.const_expr(mma):
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            task_pipe.consumer_release(state)
    else:
        task_pipe.consumer_release(state)
    state.advance()
    return t, state


@cute.jit
def publish_pair(bars, state, sTask: cute.Tensor, t: Int32):
    """Leader's TMA warp: task id ``t`` into the next slot of both CTAs of the pair, once both read
    that slot's previous id (the leader's empty barrier); the next state."""
    full, empty = bars
    cute.arch.mbarrier_wait(empty + state.index, state.phase)
    if cute.arch.lane_idx() == 0:
        sTask[state.index] = t
        cute.arch.mbarrier_arrive(full + state.index)
        cute.arch.mbarrier_arrive_and_expect_tx(full + state.index, 4, peer_cta_rank_in_cluster=1)
        cute.arch.store_async_dsmem(sTask.iterator + state.index, t, full + state.index, 1)
    state.advance()
    return state


@cute.jit
def take_pair(bars, state, sTask: cute.Tensor):
    """A whole warp of either CTA of a pair: ``(task id, next state)``; lane 0 frees the slot on
    the leader's empty barrier once the warp read it."""
    full, empty = bars
    cute.arch.mbarrier_wait(full + state.index, state.phase)
    t = sTask[state.index]
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(empty + state.index, peer_cta_rank_in_cluster=0, scope=nvvm.MemScopeKind.CLUSTER)
    state.advance()
    return t, state


@cute.jit
def next_task(ticket: cute.Pointer, task_pipe, state, sTask: cute.Tensor, cta_v: Int32, pair: cutlass.Constexpr[bool]):
    """TMA warp: ``(next task id, state)``: claimed from the device ticket and handed on
    (:func:`publish`; a pair's leader: :func:`publish_pair`), or, a pair's peer (``cta_v`` 1), taken
    from the leader (:func:`take_pair`)."""
    if cutlass.const_expr(not pair):
        t = persistent.claim(ticket)
        return t, publish(task_pipe, state, sTask, t)
    t = Int32(0)
    if cta_v == 0:
        t = persistent.claim(ticket)
        state = publish_pair(task_pipe, state, sTask, t)
    else:
        t, state = take_pair(task_pipe, state, sTask)
    return t, state


@cute.jit
def take_any(task_pipe, state, sTask: cute.Tensor, mma: cutlass.Constexpr[bool], pair: cutlass.Constexpr[bool]):
    """MMA warp / epilogue thread: :func:`take`, or a pair's :func:`take_pair` (a whole warp)."""
    if cutlass.const_expr(not pair):
        return take(task_pipe, state, sTask, mma)
    return take_pair(task_pipe, state, sTask)


def tile_target(n, cta_group: int):
    """A readiness target of ``n`` tiles when each of a tile's ``cta_group`` CTAs publishes it."""
    if cutlass.const_expr(cta_group == 1):
        return n
    return n * cta_group


def pair_exit(cta_group: int):
    """Every thread of a ``cta_group::2`` kernel, last: no CTA leaves while its pair may still signal
    its barriers (a cluster-wide arrive and wait); nothing for one-CTA tiles."""
    if cutlass.const_expr(cta_group == 2):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

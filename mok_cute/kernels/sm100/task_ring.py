"""The task-id ring of the SM100 persistent megakernels (the fused forward and backward): the
TMA warp claims each task from the device ticket and hands its id to the MMA warp and the
epilogue warps through ``TASK_STAGES`` shared-memory slots guarded by an mbarrier pipeline (one
producer thread; a slot is free once MMA lane 0 and every epilogue thread have read it).

A kernel's shared storage holds ``task_bar`` (``STORAGE["task_bar"]``) and ``task`` slots;
:func:`make` builds the pipeline on them (``defer_sync``: the kernel's pipeline init barrier
covers it), :func:`publish` / :func:`take` move one id; :func:`kernel_start` is both kernels'
common start.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Int32

from mok_cute.kernels.sm100.mainloop import EPI_THREADS, TMA_WARP

TASK_STAGES = 4  # task ids in flight from the TMA warp to the MMA and epilogue warps
ARRIVALS = 1 + EPI_THREADS  # a task slot is free once MMA lane 0 and every epilogue thread read it
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
def kernel_start(ml, atoms, shared_storage):
    """Both megakernels' start: the TMA warp prefetches ``atoms``' descriptors, the storage is
    allocated, ``ml``'s A/B and accumulator pipelines, the task ring and the TMEM allocator are made
    on it and the pipelines' init arrive is issued; ``(warp, tidx, storage, ab_pipe, acc_pipe,
    task_pipe, sTask, tmem)``. The caller takes its shared-memory tensors, then
    ``pipeline.pipeline_init_wait``."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    if warp == TMA_WARP:
        for atom in atoms:
            cute.nvgpu.cpasync.prefetch_descriptor(atom)
    storage = cutlass.memory.SmemAllocator().allocate(shared_storage)
    ab_pipe, acc_pipe = ml.make_pipelines(storage)
    task_pipe, sTask = make(storage)
    tmem = ml.make_tmem_allocator(storage)
    pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
    return warp, tidx, storage, ab_pipe, acc_pipe, task_pipe, sTask, tmem


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

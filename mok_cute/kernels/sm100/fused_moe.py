"""The fused MoE forward on Blackwell (sm_100a / sm_103a), BF16, EP = 1: one persistent launch.

The SM100 counterpart of :mod:`mok_cute.kernels.sm90.fused_moe`, with the same schedule, the
same counters and the same numerics, on the tcgen05 building blocks of
:mod:`mok_cute.kernels.sm100.mainloop` (192 threads: epilogue warps 0-3, MMA warp 4, TMA warp 5;
FP32 accumulators in tensor memory, ``tile_m`` 128, ``tile_n`` 256, one CTA per SM):

1. gather (the first ``comm_ctas`` CTAs, all six warps, one grouped row per warp): routed m-tile
   ``c`` (up to 128 grouped rows ``i`` of one expert, each ``x[order[i] // k]``) into ring slot
   ``c % ring`` of ``xg`` [ring * 128, H]; chunk ``c >= ring`` first waits until m-tile ``c - ring``
   has all its GEMM1 tiles (``h_ready``); each chunk bumps ``gather_ready[c]`` (release).
2. GEMM tasks S1 / R1 / S2 / R2 of the static list of :mod:`mok_cute.schedule.fused_tasks`, claimed
   by the TMA warp from the device ticket (list order across the grid), handed to the MMA warp and
   the epilogue warps through a shared-memory ring of task ids (:mod:`~mok_cute.kernels.sm100.task_ring`).
   The TMA warp waits for the task's inputs (bounded, :func:`~mok_cute.kernels.sm90.persistent.wait_input`)
   and loads its k-tiles; the MMA warp accumulates the tile in TMEM; the epilogue warps store it
   (R1 / S1: the SwiGLU epilogue of :class:`~mok_cute.kernels.sm100.grouped_gemm.GroupedGemmSm100`
   into gu / h or gus / hs; S2: the plain epilogue into s_out; R2: the plain epilogue with each row
   sent to its (token, slot) row ``order[i]`` of ``slot_out`` [T*k, H]), then publish it (``h_ready``,
   ``sh_ready`` or ``done``, release add after a GPU-scope fence).
3. slot sum (every CTA, once ``done`` counts every GEMM2 tile):
   :func:`mok_cute.kernels.slot_rows.slot_sum`, the fixed slot order of the SM90 kernel.

GEMM1's B operand is gate and up interleaved in blocks of ``tile_n / 2`` rows
(:func:`~mok_cute.kernels.sm100.grouped_gemm.interleave_gate_up`, made by the host per call), the
unfused SM100 path's operand, so every GEMM tile is bitwise the unfused SM100 GEMMs' (same tiles,
same k-tile order, same epilogues). Deadlock freedom and determinism are the SM90 kernel's: waits
point backwards in the list, each CTA runs its tasks in list order, all CTAs are resident, every
wait is bounded by ``timeout_ns`` of ``%globaltimer`` (first error in ``status`` int32[4], later
waits give up; the host raises), and no result depends on which CTA ran a task.

Operands (bf16, row-major, 16-byte aligned): x [T, H]; w1 [E, 2 I_p, H] (interleaved, I_p = I
rounded up to 128), w_down [E, H, I]; shared s1 [1, 2 I_sp, H], s_down [1, H, I_s]; order int32
[M_cap], offsets int32 [E+1], topk_idx int32 [T*k], topk_w fp32 [T*k], gate fp32 [T] or None.
Outputs: xg (scratch), gu [M_cap, 2, I], h [M_cap, I], slot_out [T*k, H] (rows of -1 slots
untouched), gus [T, 2, I_s], hs [T, I_s], s_out [T, H], y [T, H]. Counters int32, zero at launch,
as :func:`mok_cute.kernels.sm90.fused_moe.counter_sizes`. H, I, I_s multiples of 64.
Variants: ``clamp``, ``shared``, ``gate`` (y starts from fp32(s_out) * gate), ``trace`` (per-task
records in the SM90 kernel's layout).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from mok_cute.comm import protocol as P
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import _check_limit, _check_tensor, sm_count
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels import slot_rows
from mok_cute.kernels.sm100.grouped_gemm import ARCHS, GroupedGemmSm100, interleave_gate_up
from mok_cute.kernels.sm100 import task_ring
from mok_cute.kernels.sm100.mainloop import (
    MMA_WARP, NUM_THREADS, TMA_WARP, AccChunks, Sm100Config, Sm100Mainloop, epi_barrier,
)
from mok_cute.kernels.sm90 import persistent
from mok_cute.kernels.sm90.fused_moe import (
    CHUNK, COUNTER_WORDS, DONE, GATHER, GATHER_KIND, GATHER_UNROLL, H_READY, RING, SH_READY, SUM_BATCH,
    counter_sizes, record_sum, ring_band, slot_sum_batch,
)
from mok_cute.kernels.sm90.persistent import TRACE_WORDS, tracing
from mok_cute.schedule import fused_tasks as tasks
from mok_cute.schedule.fused_tasks import R1, R2, S1, S2

CONFIG = Sm100Config()  # 128 x 256 x 64 BF16, cta_group::1: the unfused SM100 GEMMs' tiles
DIM_MULTIPLE = 64  # H, I, I_s
_VEC = 8  # bf16 elements per 16-byte vector


@cute.jit
def store_routed(epi: GroupedGemmSm100, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32,
                 mSlot: cute.Tensor, mOrder: cute.Tensor):
    """``epi``'s plain epilogue with tile row r (< rows) stored to row ``order[row0 + r]`` of
    ``slot`` (its (token, slot) row): the fused forward's R2 and the fused backward's D1 rows."""
    route = chunks.row
    if chunks.row < rows:
        route = mOrder[row0 + chunks.row]
    epi._store_plain(chunks, route - chunks.row, rows, n_tile, mSlot)


class FusedMoeFwdSm100:
    """The persistent fused forward (see the module doc); ``clamp``: SwiGLU limit given,
    ``shared``: a shared expert is fused in; ``unroll``: 16-byte loads in flight per gather lane;
    ``sum_batch``: slot rows in flight per slot-sum thread (cp.async into the idle B stages)."""

    def __init__(self, clamp: bool, shared: bool, unroll: int = 8, trace: bool = False,
                 sum_batch: int = SUM_BATCH):
        self.cfg, self.clamp, self.shared, self.unroll, self.trace = CONFIG, clamp, shared, unroll, trace
        self.sum_batch = sum_batch
        self.mainloop = Sm100Mainloop(CONFIG)
        self.swiglu = GroupedGemmSm100(CONFIG, "swiglu", clamp)  # its epilogues (the unfused path's)
        self.plain = GroupedGemmSm100(CONFIG, "plain")
        b_bytes = self.mainloop.stages * CONFIG.tile_n * CONFIG.tile_k * 2
        if not 1 <= sum_batch * NUM_THREADS * _VEC * 2 <= b_bytes:
            raise ValueError(f"sum_batch {sum_batch}: the slot sum's cp.async buffer must fit the B stages "
                             f"({b_bytes} bytes)")

    def _storage(self):
        ml = self.mainloop
        fields = {
            "ab_bar": cute.struct.MemRange[cutlass.Int64, 2 * ml.stages],
            "acc_bar": cute.struct.MemRange[cutlass.Int64, 2 * ml.acc_stages],
            **task_ring.STORAGE,
            "tmem_dealloc_bar": cutlass.Int64,
            "tmem_ptr": cutlass.Int32,
            "sA": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(ml.a_smem.outer)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(ml.b_smem.outer)], 1024],
        }
        return cute.struct(type("FusedFwdStorage", (), {"__annotations__": fields}))

    @staticmethod
    def _b(w: cute.Tensor) -> cute.Tensor:
        """[E, N, K] weights -> the (N, K, E) view TMA reads."""
        return cute.make_tensor(w.iterator, cute.select(w.layout, mode=[1, 2, 0]))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mXg: cute.Tensor, mW1: cute.Tensor, mWd: cute.Tensor, mS1: cute.Tensor,
                 mSd: cute.Tensor, mGU: cute.Tensor, mH: cute.Tensor, mGUs: cute.Tensor, mHs: cute.Tensor,
                 mSlot: cute.Tensor, mSout: cute.Tensor, mY: cute.Tensor, mOrder: cute.Tensor, mOffsets: cute.Tensor,
                 mIdx: cute.Tensor, mW: cute.Tensor, mGate: cute.Tensor, mGather: cute.Tensor, mHready: cute.Tensor,
                 mShready: cute.Tensor, mDone: cute.Tensor, mStatus: cute.Tensor, mTrace: cute.Tensor, k: Int32,
                 limit: Float32, comm_ctas: Int32, num_ctas: Int32, ring: Int32, band: Int32, timeout_ns: Int64,
                 stream: cuda.CUstream):
        ml = self.mainloop
        ml.setup()
        rows = GroupedGemmSm100._rows
        tmas = ml.make_tma(rows(mXg), self._b(mW1)) + ml.make_tma(rows(mH), self._b(mWd))
        if cutlass.const_expr(self.shared):
            tmas = tmas + ml.make_tma(rows(mX), self._b(mS1)) + ml.make_tma(rows(mHs), self._b(mSd))
        self.shared_storage = self._storage()
        self.kernel([t[0] for t in tmas], [t[1] for t in tmas], mX, mXg, mGU, mH, mGUs, mHs, mSlot, mSout, mY, mOrder,
                    mOffsets, mIdx, mW, mGate, mGather, mHready, mShready, mDone, mStatus, mTrace, k, limit, comm_ctas,
                    ring, band, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, atoms: list, coords: list, mX: cute.Tensor, mXg: cute.Tensor, mGU: cute.Tensor,
               mH: cute.Tensor, mGUs: cute.Tensor, mHs: cute.Tensor, mSlot: cute.Tensor, mSout: cute.Tensor,
               mY: cute.Tensor, mOrder: cute.Tensor, mOffsets: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor,
               mGate: cute.Tensor, mGather: cute.Tensor, mHready: cute.Tensor, mShready: cute.Tensor,
               mDone: cute.Tensor, mStatus: cute.Tensor, mTrace: cute.Tensor, k: Int32, limit: Float32,
               comm_ctas: Int32, ring: Int32, band: Int32, timeout_ns: Int64):
        cfg, ml = self.cfg, self.mainloop
        ml.setup()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp == TMA_WARP:
            for atom in atoms:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipe, acc_pipe = ml.make_pipelines(storage)
        task_pipe, sTask = task_ring.make(storage)
        tmem = ml.make_tmem_allocator(storage)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA, sB, _, _ = ml.smem_tensors(storage)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        status = mStatus.iterator

        tokens = mX.shape[0]
        hidden = mX.shape[1]
        num_experts = mOffsets.shape[0] - 1
        n1 = (coords[1].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n  # GEMM1 n-tiles (2 I_p / tile_n)
        n2 = (coords[3].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n  # GEMM2 n-tiles (H / tile_n, rounded up)
        k1 = (hidden + (cfg.tile_k - 1)) // cfg.tile_k
        k2 = (coords[2].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        m_sh = (tokens + (cfg.tile_m - 1)) // cfg.tile_m
        n1s = Int32(0)
        k2s = Int32(0)
        n_s2 = Int32(0)
        if cutlass.const_expr(self.shared):
            n1s = (coords[5].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n
            k2s = (coords[6].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
            n_s2 = m_sh * n2
        mt_routed = tasks.routed_mtiles(mOffsets, num_experts, cfg.tile_m)
        n_s1 = m_sh * n1s
        n_r1 = mt_routed * n1
        n_tasks = n_s1 + n_r1 + n_s2 + mt_routed * n2
        shape = (n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band)

        if bidx < comm_ctas:  # first the gather, then GEMM tasks like every CTA
            self._gather(tidx, bidx, comm_ctas, mX, mXg, mOrder, mOffsets, num_experts, mt_routed, ring, n1, k,
                         mGather, mHready, mTrace, timeout_ns, status)
            cute.arch.barrier()
        if warp == TMA_WARP:
            self._produce(ab_pipe, task_pipe, sTask, sA, sB, atoms, coords, mDone.iterator + 1, shape, k1, k2, k2s,
                          ring, mOffsets, num_experts, tokens, mGather, mHready, mShready, status, timeout_ns)
        if warp == MMA_WARP:
            self._mma(ab_pipe, acc_pipe, task_pipe, sTask, sA, sB, tmem, shape, k1, k2, k2s)
        if warp < MMA_WARP:
            self._epilogue(acc_pipe, task_pipe, sTask, tmem, tidx, shape, mOffsets, num_experts, tokens, mGU, mH,
                           mGUs, mHs, mSlot, mSout, mOrder, mHready, mShready, mDone, limit, mTrace, bidx,
                           mGather.shape[0])

        # every CTA: the slot sum, once every GEMM2 tile is stored
        cute.arch.barrier()
        t0 = persistent.now(self.trace)
        if tidx == 0:
            P.wait_geq(mDone.iterator, n_s2 + mt_routed * n2, timeout_ns, status, Int32(0), Int32(DONE))
        cute.arch.barrier()
        t1 = persistent.now(self.trace)
        sbuf = cute.make_tensor(storage.sB.data_ptr(), cute.make_layout((self.sum_batch * NUM_THREADS, _VEC),
                                                                        stride=(_VEC, 1)))
        s_out = mSout if cutlass.const_expr(self.shared) else None
        slot_rows.slot_sum(tidx, bidx, grid, mSlot, s_out, mY, mIdx, mW, k, tokens, hidden, sbuf, self.sum_batch,
                           NUM_THREADS, mGate)
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                record_sum(mTrace, grid, bidx, t0, t1)

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _gather(self, tidx: Int32, bidx: Int32, comm_ctas: Int32, mX: cute.Tensor, mXg: cute.Tensor,
                mOrder: cute.Tensor, mOffsets: cute.Tensor, num_experts: Int32, chunks: Int32, ring: Int32, n1: Int32,
                k: Int32, mGather: cute.Tensor, mHready: cute.Tensor, mTrace: cute.Tensor, timeout_ns: Int64,
                status: cute.Pointer):
        """Comm CTA ``bidx``: chunks ``c = bidx, bidx + comm_ctas, ...`` in order (see the module doc)."""
        hid = mXg.shape[1]
        warp = tidx // 32
        lane = tidx % 32
        base = mX.iterator.toint()
        dbase = mXg.iterator.toint()
        ge, gb = Int32(0), Int32(0)  # m-tile cursor (tasks.mtile)
        for c in cutlass.range(bidx, chunks, comm_ctas, unroll=1):
            t0 = persistent.now(self.trace)
            row0, rows, ge, gb = tasks.mtile(mOffsets, num_experts, CHUNK, c, ge, gb)
            if c >= ring:
                if tidx == 0:
                    P.wait_geq(mHready.iterator + (c - ring), n1, timeout_ns, status, c - ring, Int32(RING))
                cute.arch.barrier()
            slot_row = (c % ring) * CHUNK
            for rr in cutlass.range(warp, rows, NUM_THREADS // 32, unroll=1):
                src = base + Int64(mOrder[row0 + rr] // k) * Int64(hid * 2)
                dst = dbase + Int64(slot_row + rr) * Int64(hid * 2)
                slot_rows.copy_row(lane, src, dst, hid // _VEC, self.unroll)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(mGather.iterator + c, Int32(1), sem="release", scope="gpu")
                if cutlass.const_expr(self.trace):
                    persistent.record(mTrace, c, t0, persistent.now(self.trace), GATHER_KIND, bidx, c)

    @cute.jit
    def _produce(self, ab_pipe, task_pipe, sTask: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, atoms, coords,
                 ticket: cute.Pointer, shape, k1: Int32, k2: Int32, k2s: Int32, ring: Int32, mOffsets: cute.Tensor,
                 num_experts: Int32, tokens: Int32, mGather: cute.Tensor, mHready: cute.Tensor,
                 mShready: cute.Tensor, status: cute.Pointer, timeout_ns: Int64):
        """TMA warp: claim tasks from the ticket (list order across the grid), hand each on, wait
        for its inputs, load its k-tiles; the first id >= n_tasks is handed on last (stop)."""
        cfg = self.cfg
        n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band = shape
        tiler_a = (cfg.tile_m, cfg.tile_k)
        tiler_b = (cfg.tile_n, cfg.tile_k)
        b_parts = [self.mainloop.partition_b(atoms[i], cute.local_tile(coords[i], tiler_b, (None, None, None)), sB, 0)
                   for i in range(1, len(atoms), 2)]  # (smem, gmem) of w1, w_down[, s1, s_down]
        no_mask = (None, None)
        state = self.mainloop.producer_state()
        tstate = task_ring.producer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        t = persistent.claim(ticket)
        tstate = task_ring.publish(task_pipe, tstate, sTask, t)
        while t < n_tasks:
            phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2 = tasks.task(
                t, n_s1, n_r1, n_s2, m_sh, n1, n2, mOffsets, num_experts, tokens, self.cfg.tile_m, band, e1, b1, e2, b2)
            if phase == R1:
                persistent.wait_input(mGather.iterator + mt, Int32(1), timeout_ns, status, Int32(GATHER), mt)
            if phase == R2:
                persistent.wait_input(mHready.iterator + mt, n1, timeout_ns, status, Int32(H_READY), mt)
            if cutlass.const_expr(self.shared):
                if phase == S2:
                    persistent.wait_input(mShready.iterator + mt, n1s, timeout_ns, status, Int32(SH_READY), mt)
            if phase == R1:
                gA = cute.local_tile(cute.domain_offset(((mt % ring) * CHUNK, 0), coords[0][(None, None, 0)]),
                                     tiler_a, (0, None))
                tAsA, tAgA = self.mainloop.partition_a(atoms[0], gA, sA, 0)
                state = self.mainloop.load_tile(ab_pipe, state, atoms[0:2], (tAgA, b_parts[0][1][(None, n_tile, None, expert)]),
                                     (tAsA, b_parts[0][0]), k1, Int32(0), no_mask)
            elif phase == R2:
                gA = cute.local_tile(cute.domain_offset((row0, 0), coords[2][(None, None, 0)]), tiler_a, (0, None))
                tAsA, tAgA = self.mainloop.partition_a(atoms[2], gA, sA, 0)
                state = self.mainloop.load_tile(ab_pipe, state, atoms[2:4], (tAgA, b_parts[1][1][(None, n_tile, None, expert)]),
                                     (tAsA, b_parts[1][0]), k2, Int32(0), no_mask)
            else:
                if cutlass.const_expr(self.shared):
                    if phase == S1:
                        gA = cute.local_tile(cute.domain_offset((row0, 0), coords[4][(None, None, 0)]), tiler_a,
                                             (0, None))
                        tAsA, tAgA = self.mainloop.partition_a(atoms[4], gA, sA, 0)
                        state = self.mainloop.load_tile(ab_pipe, state, atoms[4:6],
                                             (tAgA, b_parts[2][1][(None, n_tile, None, 0)]), (tAsA, b_parts[2][0]),
                                             k1, Int32(0), no_mask)
                    else:
                        gA = cute.local_tile(cute.domain_offset((row0, 0), coords[6][(None, None, 0)]), tiler_a,
                                             (0, None))
                        tAsA, tAgA = self.mainloop.partition_a(atoms[6], gA, sA, 0)
                        state = self.mainloop.load_tile(ab_pipe, state, atoms[6:8],
                                             (tAgA, b_parts[3][1][(None, n_tile, None, 0)]), (tAsA, b_parts[3][0]),
                                             k2s, Int32(0), no_mask)
            t = persistent.claim(ticket)
            tstate = task_ring.publish(task_pipe, tstate, sTask, t)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _mma(self, ab_pipe, acc_pipe, task_pipe, sTask: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, tmem, shape,
             k1: Int32, k2: Int32, k2s: Int32):
        """MMA warp: each task's tile into the next TMEM accumulator stage."""
        n_tasks, n_s1, n_r1, n_s2 = shape[0], shape[1], shape[2], shape[3]
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.mainloop.acc_tensor(acc_ptr)
        tCrA, tCrB, _ = self.mainloop.mma_fragments(sA, sB, None, None, acc_ptr)
        tiled_mma = self.mainloop.make_tiled_mma()
        state = self.mainloop.consumer_state()
        acc_state = self.mainloop.acc_producer_state()
        tstate = task_ring.consumer_state()
        t, tstate = task_ring.take(task_pipe, tstate, sTask, True)
        while t < n_tasks:
            kt = k1  # S1, R1
            if t >= n_s1 + n_r1 + n_s2:
                kt = k2
            elif t >= n_s1 + n_r1:
                kt = k2s
            acc_pipe.producer_acquire(acc_state)
            state, tiled_mma = self.mainloop.mma_tile(tiled_mma, ab_pipe, state, tCrA, tCrB, None,
                                           acc[(None, None, None, acc_state.index)], kt)
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t, tstate = task_ring.take(task_pipe, tstate, sTask, True)
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def _epilogue(self, acc_pipe, task_pipe, sTask: cute.Tensor, tmem, tidx: Int32, shape, mOffsets: cute.Tensor,
                  num_experts: Int32, tokens: Int32, mGU: cute.Tensor, mH: cute.Tensor, mGUs: cute.Tensor,
                  mHs: cute.Tensor, mSlot: cute.Tensor, mSout: cute.Tensor, mOrder: cute.Tensor,
                  mHready: cute.Tensor, mShready: cute.Tensor, mDone: cute.Tensor, limit: Float32,
                  mTrace: cute.Tensor, bidx: Int32, trace_base: Int32):
        """Epilogue warps: store each task's accumulator, then publish it (release add by thread 0
        after every thread's GPU-scope fence and the epilogue barrier)."""
        n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band = shape
        tmem.allocate(self.mainloop.tmem_alloc)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.mainloop.acc_tensor(acc_ptr)
        acc_state = self.mainloop.acc_consumer_state()
        tstate = task_ring.consumer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        t, tstate = task_ring.take(task_pipe, tstate, sTask, False)
        while t < n_tasks:
            phase, _, n_tile, row0, rows, mt, e1, b1, e2, b2 = tasks.task(
                t, n_s1, n_r1, n_s2, m_sh, n1, n2, mOffsets, num_experts, tokens, self.cfg.tile_m, band, e1, b1, e2,
                b2)
            t0 = persistent.now(self.trace)
            acc_pipe.consumer_wait(acc_state)
            chunks = AccChunks(acc[(None, None, None, acc_state.index)], tidx)
            if phase == R1:
                self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGU, mH, limit)
            elif phase == R2:
                store_routed(self.plain, chunks, row0, rows, n_tile, mSlot, mOrder)
            else:
                if cutlass.const_expr(self.shared):
                    if phase == S1:
                        self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGUs, mHs, limit)
                    else:
                        self.plain._store_plain(chunks, row0, rows, n_tile, mSout)
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            cute.arch.fence_acq_rel_gpu()  # this thread's stores before thread 0's release below
            epi_barrier()
            if tidx == 0:
                tasks.publish(phase, mt, mDone, mHready, mShready)
                if cutlass.const_expr(self.trace):
                    persistent.record(mTrace, trace_base + t, t0, persistent.now(self.trace), phase, bidx, t)
            t, tstate = task_ring.take(task_pipe, tstate, sTask, False)
        tmem.relinquish_alloc_permit()
        epi_barrier()
        tmem.free(acc_ptr)


# ---------------------------------------------------------------- compile
def compile_fused_forward_sm100(clamp: bool, shared: bool, *, arch: str = "sm_100a", unroll: int = 8,
                                trace: bool = False, sum_batch: int = SUM_BATCH, gate: bool = False,
                                inspect: bool = False):
    """Compile one variant with symbolic T, H, I, I_s, E, M_cap for ``arch`` (sm_100a / sm_103a;
    ``gate``: the slot sum starts from fp32(s_out) * gate, needs ``shared``); returns
    ``(compiled, report)``."""
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused forward needs arch in {ARCHS}, got {arch!r}")
    if gate and not shared:
        raise ValueError("gate (the shared expert's output gate) needs shared")
    op = FusedMoeFwdSm100(clamp, shared, unroll, trace, sum_batch)
    bf = cutlass.BFloat16
    t, mcap, tk, e = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hid, inter, inter_s = (cute.sym_int(divisibility=DIM_MULTIPLE) for _ in range(3))

    def vec(dtype, n, align=4):
        return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align)

    shared_w = (_fake_3d(bf, cute.sym_int(), cute.sym_int(), hid), _fake_3d(bf, cute.sym_int(), hid, inter_s)) \
        if shared else (None, None)
    shared_out = (_fake_3d(bf, t, cute.sym_int(), inter_s), _fake_2d(bf, t, inter_s)) if shared else (None, None)
    args = (_fake_2d(bf, t, hid), _fake_2d(bf, cute.sym_int(), hid), _fake_3d(bf, e, cute.sym_int(), hid),
            _fake_3d(bf, e, hid, inter), *shared_w, _fake_3d(bf, mcap, cute.sym_int(), inter), _fake_2d(bf, mcap, inter),
            *shared_out, _fake_2d(bf, tk, hid), _fake_2d(bf, t, hid) if shared else None, _fake_2d(bf, t, hid),
            vec(Int32, mcap), vec(Int32, cute.sym_int()), vec(Int32, tk), vec(Float32, tk),
            vec(Float32, t) if gate else None, *(vec(Int32, cute.sym_int()) for _ in range(5)),
            vec(Int64, cute.sym_int(), 8) if trace else None)
    return compile_kernel(op, *args, Int32(1), Float32(0.0), Int32(1), Int32(2), Int32(1), Int32(1), Int64(1),
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


# ---------------------------------------------------------------- launch
_last_trace: list = []  # (records int64 [n, 4], comm_ctas) of the last traced launch


def last_trace():
    """``(records int64 [n, 4], comm_ctas)`` of the last traced launch (the SM90 kernel's record
    layout: gather chunks, then every possible task, then two per CTA), or None."""
    return _last_trace[0] if _last_trace else None


def _check_operands(x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, comm_ctas,
                    timeout_s, num_ctas, ring_chunks, gate):
    """Raise TypeError / ValueError for operands :func:`fused_forward` cannot launch on."""
    bf = (torch.bfloat16,)
    _check_tensor("x", x, 2, bf)
    t, hid = x.shape
    if t == 0 or hid == 0 or hid % DIM_MULTIPLE:
        raise ValueError(f"x must be [T, H] with T > 0 and H a positive multiple of {DIM_MULTIPLE}, got {tuple(x.shape)}")
    _check_tensor("topk_idx", topk_idx, 2, (torch.int32,))
    _check_tensor("topk_w", topk_w, 2, (torch.float32,))
    if topk_idx.shape[0] != t or topk_idx.shape[1] == 0 or topk_w.shape != topk_idx.shape:
        raise ValueError(f"topk_idx and topk_w must both be [T={t}, k >= 1], got {tuple(topk_idx.shape)} and "
                         f"{tuple(topk_w.shape)}")
    _check_tensor("order", order, 1, (torch.int32,))
    _check_tensor("offsets", offsets, 1, (torch.int32,))
    _check_tensor("w_gate", w_gate, 3, bf)
    e, inter = w_gate.shape[0], w_gate.shape[1]
    if inter == 0 or inter % DIM_MULTIPLE or e == 0:
        raise ValueError(f"w_gate must be [E >= 1, I, H] with I a positive multiple of {DIM_MULTIPLE}, "
                         f"got {tuple(w_gate.shape)}")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must hold E+1 = {e + 1} entries, got {offsets.numel()}")
    weights = {"w_gate": (w_gate, (e, inter, hid)), "w_up": (w_up, (e, inter, hid)),
               "w_down": (w_down, (e, hid, inter))}
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise ValueError("shared must be None or (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s])")
        _check_tensor("ws_gate", shared[0], 2, bf)
        inter_s = shared[0].shape[0]
        if inter_s == 0 or inter_s % DIM_MULTIPLE:
            raise ValueError(f"ws_gate: I_s={inter_s} must be a positive multiple of {DIM_MULTIPLE}")
        weights.update(ws_gate=(shared[0], (inter_s, hid)), ws_up=(shared[1], (inter_s, hid)),
                       ws_down=(shared[2], (hid, inter_s)))
    if gate is not None:
        if shared is None:
            raise ValueError("gate (the shared expert's output gate) needs shared")
        _check_tensor("gate", gate, 1, (torch.float32,))
        if gate.shape[0] != t:
            raise ValueError(f"gate must be [T={t}], got {tuple(gate.shape)}")
    for name, (w, shape) in weights.items():
        _check_tensor(name, w, len(shape), bf)
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(w.shape)}")
    for name, a in dict(x=x, order=order, offsets=offsets, topk_idx=topk_idx, topk_w=topk_w, gate=gate,
                        **{n: w for n, (w, _) in weights.items()}).items():
        if a is None:
            continue
        if a.device != x.device:
            raise ValueError(f"{name} is on {a.device} but x is on {x.device}")
        if not a.is_contiguous() or a.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    _check_limit(limit)
    if isinstance(comm_ctas, bool) or not isinstance(comm_ctas, int) or comm_ctas < 1:
        raise ValueError(f"comm_ctas must be an int >= 1, got {comm_ctas!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if num_ctas is not None and num_ctas < 2:
        raise ValueError(f"num_ctas must be None or >= 2 (a comm CTA and a GEMM CTA), got {num_ctas}")
    if ring_chunks is not None and ring_chunks < 1:
        raise ValueError(f"ring_chunks must be None or >= 1, got {ring_chunks}")


def fused_forward(x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, comm_ctas: int,
                  timeout_s: float, num_ctas: int | None = None, ring_chunks: int | None = None, gate=None,
                  interleave=interleave_gate_up):
    """Validate, then launch the fused forward on the current stream (EP = 1, BF16; the contract
    of :func:`mok_cute.kernels.sm90.fused_moe.fused_forward` without ``mx`` / ``ws``): x [T, H]; ``order``
    int32 [M_cap] (route ``t*k + j`` of each grouped row, rows sorted by expert); ``offsets``
    int32 [E+1] (trusted: 0, non-decreasing, last <= M_cap); ``topk_idx`` int32 / ``topk_w`` fp32
    [T, k]; w_gate, w_up [E, I, H], w_down [E, H, I]; ``shared`` None or (ws_gate [I_s, H], ws_up
    [I_s, H], ws_down [H, I_s]); ``limit`` None or the SwiGLU clamp; ``gate`` None or fp32 [T] (y
    starts from fp32(s_out) * gate; needs ``shared``); H, I, I_s multiples of 64; every tensor
    contiguous on one sm_100 / sm_103 device. gate / up are interleaved into one copy by
    ``interleave(w_gate, w_up, tile_n / 2)`` (default
    :func:`~mok_cute.kernels.sm100.grouped_gemm.interleave_gate_up`, the unfused GEMM1's operand, a
    copy per call; a caller may pass one that caches it while the weights are unchanged).
    ``ring_chunks``: ring slots of 128 gathered rows (None: one per routed m-tile), R1's band
    ``min(ring_band(), ring)``; ``num_ctas``: the grid (default all SMs), ``comm_ctas`` clamped to
    ``[1, num_ctas - 1]``. Returns ``(y, gu [M_cap, 2I], h, slot_out, gus [T, 2 I_s], hs, s_out,
    counters, None)`` (shared outputs None without a shared expert; ``counters``: gather_ready,
    h_ready, sh_ready, done + ticket + 2 spare words, status, int32 device tensors; read status with
    :func:`mok_cute.kernels.sm90.fused_moe.watch_status`: the same wait channels)."""
    _check_operands(x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, comm_ctas,
                    timeout_s, num_ctas, ring_chunks, gate)
    dev, arch = device_arch(x.device)
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused forward needs an sm_100a / sm_103a device, got {arch}")
    t, hid = x.shape
    k = topk_idx.shape[1]
    mcap, e, inter = order.shape[0], w_gate.shape[0], w_gate.shape[1]
    bf = dict(dtype=torch.bfloat16, device=x.device)
    half = CONFIG.tile_n // 2
    sizes = counter_sizes(t, mcap, e)
    ring = sizes[0] if ring_chunks is None else min(int(ring_chunks), sizes[0])
    band = min(ring_band(), ring)
    xg = torch.empty((ring * CHUNK, hid), **bf)
    w1 = interleave(w_gate, w_up, half)
    gu = torch.empty((mcap, 2, inter), **bf)
    h = torch.empty((mcap, inter), **bf)
    slot = torch.empty((t * k, hid), **bf)
    y = torch.empty((t, hid), **bf)
    counters = torch.zeros(sum(sizes) + COUNTER_WORDS, dtype=torch.int32, device=x.device)
    parts = list(torch.split(counters, list(sizes) + [COUNTER_WORDS]))
    s1 = sd = gus = hs = s_out = None
    n1s = 0
    if shared is not None:
        inter_s = shared[0].shape[0]
        n1s = -(-inter_s // half)
        s1, sd = interleave(shared[0][None], shared[1][None], half), shared[2][None]
        gus = torch.empty((t, 2, inter_s), **bf)
        hs = torch.empty((t, inter_s), **bf)
        s_out = torch.empty((t, hid), **bf)
    trace = tracing()
    nb = slot_sum_batch()
    variant = (limit is not None, shared is not None, GATHER_UNROLL, trace, nb, gate is not None)
    launcher = compile_cached(("sm100_fused_moe_fwd", arch) + variant, lambda: GraphLauncher(
        compile_fused_forward_sm100(variant[0], variant[1], arch=arch, unroll=GATHER_UNROLL, trace=trace,
                                    sum_batch=nb, gate=gate is not None)[0]))
    num_ctas = sm_count(dev) if num_ctas is None else num_ctas
    # chunk c is CTA c % comm_ctas's, and a gather waiting for its ring slot needs a GEMM CTA to free it
    comm_ctas = max(1, min(comm_ctas, num_ctas - 1))
    records = None
    if trace:  # gather chunks, then every possible task, then two per CTA
        n2, n1, m_sh, mt = -(-hid // CONFIG.tile_n), -(-inter // half), sizes[2], sizes[1]
        n_tasks = m_sh * (n1s + (n2 if shared is not None else 0)) + mt * (n1 + n2)
        records = torch.zeros((sizes[0] + n_tasks + 2 * num_ctas, TRACE_WORDS), dtype=torch.int64, device=x.device)
        _last_trace[:] = [(records, comm_ctas)]
    tensors = (x, xg, w1, w_down, s1, sd, gu, h, gus, hs, slot, s_out, y, order, offsets, topk_idx.reshape(-1),
               topk_w.reshape(-1), gate, *parts, None if records is None else records.view(-1))
    lim, timeout_ns = 0.0 if limit is None else float(limit), int(timeout_s * 1e9)
    scalars = (Int32(k), Float32(lim), Int32(comm_ctas), Int32(num_ctas), Int32(ring), Int32(band), Int64(timeout_ns))
    key = tuple(None if a is None else tensor_key(a) for a in tensors) + (k, lim, comm_ctas, num_ctas, ring, band,
                                                                           timeout_ns)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda st: (
        *(None if a is None else _Desc(a) for a in tensors), *scalars, st))
    return (y, gu.view(mcap, 2 * inter), h, slot, None if gus is None else gus.view(t, -1), hs, s_out, parts, None)


# ---------------------------------------------------------------- variant registry (readiness tool)
_PTX = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
        "mbarrier", "atom.global.add.u32", "atom.global.release.add.u32", "ld.acquire", "%globaltimer",
        "fence.proxy.async.global", "add.rn.f32")


def variants() -> dict:
    """``name -> (compile(arch, inspect) -> (compiled, report), PTX substrings it must hold)`` for
    every fused-forward variant this module builds."""
    def fused(clamp, shared, **kw):
        return lambda arch, inspect=True: compile_fused_forward_sm100(clamp, shared, arch=arch, inspect=inspect, **kw)

    return {
        "fused-fwd-clamp-shared": (fused(True, True), _PTX),
        "fused-fwd-noclamp-shared": (fused(False, True), _PTX),
        "fused-fwd-clamp-routed": (fused(True, False), _PTX),
        "fused-fwd-noclamp-routed": (fused(False, False), _PTX),
        "fused-fwd-clamp-shared-gate": (fused(True, True, gate=True), _PTX),
        "fused-fwd-clamp-shared-trace": (fused(True, True, trace=True), _PTX),
    }

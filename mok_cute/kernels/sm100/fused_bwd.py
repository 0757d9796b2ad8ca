"""The fused routed MoE backward core on Blackwell (sm_100a / sm_103a), BF16, EP = 1: one persistent launch.

The SM100 counterpart of the core of :mod:`mok_cute.kernels.sm90.fused_bwd` and of its ``tokens``
variant (no gather, no shared group, no MXFP8), with its task list, counters and numerics, on the
tcgen05 building blocks of :mod:`mok_cute.kernels.sm100.mainloop` (192 threads: epilogue warps 0-3,
MMA warp 4, TMA warp 5; FP32 accumulators in tensor memory, ``tile_m`` 128, ``tile_n`` 256, one CTA
per SM). Tasks, :func:`mok_cute.schedule.fused_bwd_tasks.core_task` order, claimed by the TMA warp
from the device ticket and handed to the MMA and epilogue warps through a shared-memory ring of
task ids (:mod:`~mok_cute.kernels.sm100.task_ring`), as in :mod:`mok_cute.kernels.sm100.fused_moe`:

  D2  dh = dy_e . w_down[e] -> dSwiGLU with gu -> dgu   needs nothing; publishes ``d2[mt]``
  D1  dx = dgu_e . [w_gate[e]; w_up[e]] (split K)       needs ``d2[mt] >= n_i`` (every D2 tile
                                                        of its m-tile)
  W   dWd = dy_e^T h_e, dWg = dg_e^T x_e, dWu = du_e^T  dWd: nothing; dWg / dWu: every D2 tile of
      x_e per expert (K = the expert's rows, in order)  the expert's m-tiles (once per expert/CTA)

Each tile is the unfused SM100 kernels' tile (:class:`~mok_cute.kernels.sm100.grouped_gemm.GroupedGemmSm100`:
``dswiglu`` with w_down MN-major, split-K ``plain`` dgrad1, ``wgrad`` over the ragged token view),
their operand views, k-tile order and epilogues, so every output is bitwise theirs whichever CTA
ran it (no atomics on data). A D2 tile is published by a release add after every epilogue
thread's GPU-scope fence; the TMA warp's waits are bounded by ``timeout_ns`` of ``%globaltimer``
(first error in ``status``, read by the host later) and followed by an async-proxy fence before
TMA reads what they waited for. Waits point backwards in the list and every CTA is resident, so
the list cannot deadlock (``fused_bwd_tasks.simulate``).

Operands (bf16, row-major, 16-byte aligned; grouped rows sorted by expert, ``offsets`` int32
[E+1]): dy, x [M, H]; gu [M, 2, I]; h [M, I]; w_gate, w_up [E, I, H]; w_down [E, H, I]. Outputs:
dgu [M, 2, I] (scratch the D1 and W tiles read), dx [M, H], dWg, dWu [E, I, H], dWd [E, H, I].
Counters int32, zero at launch: ``d2`` [>= routed m-tiles], ``words`` [1 + STATUS_WORDS] (the
ticket, then the status words). H, I multiples of 64.

``tokens`` variant: each D1 row r goes to slot row ``order[row0 + r]`` of [T*k, H] (the fused
forward's R2 store, :func:`~mok_cute.kernels.sm100.fused_moe.store_routed`), every stored D1 tile
is counted on a last ``words`` entry (release add), and once it counts them all (bounded
acquire wait) every CTA runs its share of :func:`mok_cute.kernels.slot_rows.slot_sum` into dx
[T, H] (start fp32(dx_shared) or 0, plus dx_add if given; the slots in order).
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
from mok_cute.dsl import deferred
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import _check_limit, _check_tensor, sm_count
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels.sm90 import persistent
from mok_cute.kernels.sm90.expert_bwd import _expert_k
from mok_cute.kernels import slot_rows
from mok_cute.kernels.sm90.fused_bwd import D1_DONE, D2_READY, SUM_BATCH, describe
from mok_cute.kernels.sm100.fused_moe import store_routed
from mok_cute.kernels.sm100.grouped_gemm import ARCHS, GroupedGemmSm100, _check_weight
from mok_cute.kernels.sm100 import task_ring
from mok_cute.kernels.sm100.mainloop import (
    MMA_WARP, MN_MAJOR, NUM_THREADS, TMA_WARP, AccChunks, Sm100Config, epi_barrier,
)
from mok_cute.schedule import fused_bwd_tasks as tasks
from mok_cute.schedule.fused_bwd_tasks import D1, D2, WD, WG
from mok_cute.schedule.fused_tasks import routed_mtiles

CONFIG = Sm100Config()  # 128 x 256 x 64 BF16, cta_group::1: the unfused SM100 GEMMs' tiles
DIM_MULTIPLE = 64  # H, I
WORDS = 1 + P.STATUS_WORDS  # the ticket, then the status words
DONE_WORD = WORDS  # tokens variant: a last word, the stored D1 tiles (the slot sum's wait)
_VEC = 8  # bf16 elements per 16-byte vector


class FusedMoeBwdSm100:
    """The persistent routed backward core (see the module doc); ``clamp``: SwiGLU limit given;
    ``tokens``: D1 rows to their (token, slot) rows and the dx slot sum in the launch, starting
    from fp32(``init``) (else 0) plus, with ``add``, an fp32 [T, H] term."""

    def __init__(self, clamp: bool, tokens: bool = False, init: bool = False, add: bool = False):
        if (init or add) and not tokens:
            raise ValueError("init / add (terms of the dx slot sum's start) need tokens")
        self.cfg, self.clamp, self.tokens, self.init, self.add = CONFIG, clamp, tokens, init, add
        self.dswiglu = GroupedGemmSm100(CONFIG, "dswiglu", clamp, MN_MAJOR)  # D2
        self.dgrad1 = GroupedGemmSm100(CONFIG, "plain", b_major=MN_MAJOR, split_k=True)  # D1
        self.wgrad = GroupedGemmSm100(CONFIG, wgrad=True)  # W
        self.ml_d, self.ml_w = self.dswiglu.mainloop, self.wgrad.mainloop  # (K, MN) and (MN, MN) majors
        assert self.dgrad1.mainloop.stages == self.ml_d.stages == self.ml_w.stages

    def _storage(self):
        md, mw = self.ml_d, self.ml_w
        a_n = max(cute.cosize(md.a_smem.outer), cute.cosize(mw.a_smem.outer))
        b_n = max(cute.cosize(md.b_smem.outer), cute.cosize(mw.b_smem.outer))
        fields = {
            "ab_bar": cute.struct.MemRange[cutlass.Int64, 2 * md.stages],
            "acc_bar": cute.struct.MemRange[cutlass.Int64, 2 * md.acc_stages],
            **task_ring.STORAGE,
            "tmem_dealloc_bar": cutlass.Int64,
            "tmem_ptr": cutlass.Int32,
            "sA": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a_n], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, b_n], 1024],
        }
        return cute.struct(type("FusedBwdStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, mDy: cute.Tensor, mX: cute.Tensor, mGU: cute.Tensor, mH: cute.Tensor, mWg: cute.Tensor,
                 mWu: cute.Tensor, mWd: cute.Tensor, mDgu: cute.Tensor, mDx: cute.Tensor, mDWg: cute.Tensor,
                 mDWu: cute.Tensor, mDWd: cute.Tensor, mOffsets: cute.Tensor, mD2: cute.Tensor, mWords: cute.Tensor,
                 mOrder: cute.Tensor, mIdx: cute.Tensor, mInit: cute.Tensor, mAdd: cute.Tensor, mOut: cute.Tensor,
                 k: Int32, limit: Float32, num_ctas: Int32, timeout_ns: Int64, stream: cuda.CUstream):
        """Tokens variant: ``mDx`` is the slot rows [T*k, H] (rows of -1 slots untouched), ``mOrder``
        int32 [M] (grouped row -> t*k + j), ``mIdx`` int32 [T*k] (-1: no expert), ``mInit`` bf16
        [T, H] or None, ``mAdd`` fp32 [T, H] or None, ``mOut`` the dx [T, H]; ``mWords`` then holds
        the done word too. Otherwise those five are None and ``mDx`` is dx [M, H]."""
        md, mw = self.ml_d, self.ml_w
        md.setup()
        mw.setup()
        e = mOffsets.shape[0] - 1
        dg, du = mDgu[(None, 0, None)], mDgu[(None, 1, None)]
        d2_a, d2_b, _, _ = self.dswiglu._views(mDy, mWd, None, None, e)
        d1_a, d1_b, _, _ = self.dgrad1._views(mDgu, mWg, None, None, e)
        d1_b2 = cute.make_tensor(mWu.iterator, cute.select(mWu.layout, mode=[2, 1, 0]))
        wd_a, wd_b, _, _ = self.wgrad._views(mDy, mH, None, None, e)
        wg_a, x_b, _, _ = self.wgrad._views(dg, mX, None, None, e)
        wu_a, _, _, _ = self.wgrad._views(du, mX, None, None, e)
        # atoms: 0-1 D2 (dy, w_down), 2-5 D1 (dg, w_gate, du, w_up), 6-7 dWd (dy, h), 8-9 dWg (dg, x), 10 dWu's du
        tmas = md.make_tma(d2_a, d2_b) + md.make_tma(d1_a, d1_b, mA2=GroupedGemmSm100._rows(du), mB2=d1_b2) \
            + mw.make_tma(wd_a, wd_b) + mw.make_tma(wg_a, x_b) + mw.make_tma(wu_a, x_b)[:1]
        self.shared_storage = self._storage()
        self.kernel([t[0] for t in tmas], [t[1] for t in tmas], mGU, mDgu, mDx, mDWg, mDWu, mDWd, mOffsets, mD2,
                    mWords, mOrder, mIdx, mInit, mAdd, mOut, k, limit, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, atoms: list, coords: list, mGU: cute.Tensor, mDgu: cute.Tensor, mDx: cute.Tensor,
               mDWg: cute.Tensor, mDWu: cute.Tensor, mDWd: cute.Tensor, mOffsets: cute.Tensor, mD2: cute.Tensor,
               mWords: cute.Tensor, mOrder: cute.Tensor, mIdx: cute.Tensor, mInit: cute.Tensor, mAdd: cute.Tensor,
               mOut: cute.Tensor, k: Int32, limit: Float32, timeout_ns: Int64):
        cfg, md, mw = self.cfg, self.ml_d, self.ml_w
        md.setup()
        mw.setup()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == TMA_WARP:
            for atom in atoms:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipe, acc_pipe = md.make_pipelines(storage)
        task_pipe, sTask = task_ring.make(storage)
        tmem = md.make_tmem_allocator(storage)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA, sB, _, _ = md.smem_tensors(storage)
        sA_w, sB_w, _, _ = mw.smem_tensors(storage)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        num_experts = mOffsets.shape[0] - 1
        hidden = mDx.shape[1]
        inter = mGU.shape[2]
        n_i = (inter + (cfg.tile_n - 1)) // cfg.tile_n  # D2 n-tiles
        n_h = (hidden + (cfg.tile_n - 1)) // cfg.tile_n  # D1 n-tiles
        wd_m = (hidden + (cfg.tile_m - 1)) // cfg.tile_m  # dWd [H, I] tiles: (wd_m, n_i); dWg, dWu: (wgu_m, n_h)
        wgu_m = (inter + (cfg.tile_m - 1)) // cfg.tile_m
        mt = routed_mtiles(mOffsets, num_experts, cfg.tile_m)
        n_d2 = mt * n_i
        n_d1 = mt * n_h
        per_e = wd_m * n_i + 2 * wgu_m * n_h
        n_tasks = n_d2 + n_d1 + num_experts * per_e
        k_h = (hidden + (cfg.tile_k - 1)) // cfg.tile_k
        k_i = (inter + (cfg.tile_k - 1)) // cfg.tile_k
        dims = (n_tasks, n_d2, n_d1, n_i, n_h, wd_m, wgu_m, per_e, k_h, k_i)

        if warp == TMA_WARP:
            self._produce(ab_pipe, task_pipe, sTask, (sA, sB, sA_w, sB_w), atoms, coords, mWords.iterator, dims,
                          mOffsets, num_experts, mD2, mWords.iterator + 1, timeout_ns)
        if warp == MMA_WARP:
            self._mma(ab_pipe, acc_pipe, task_pipe, sTask, (sA, sB, sA_w, sB_w), tmem, dims, mOffsets)
        if warp < MMA_WARP:
            self._epilogue(acc_pipe, task_pipe, sTask, tmem, tidx, dims, mOffsets, num_experts, mGU, mDgu, mDx,
                           mDWg, mDWu, mDWd, mD2, limit, mOrder, mWords.iterator + DONE_WORD)
        if cutlass.const_expr(self.tokens):  # every CTA: the dx slot sum, once every D1 tile is stored
            cute.arch.barrier()
            if tidx == 0:
                P.wait_geq(mWords.iterator + DONE_WORD, n_d1, timeout_ns, mWords.iterator + 1, Int32(0),
                           Int32(D1_DONE))
            cute.arch.barrier()
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            sbuf = cute.make_tensor(storage.sB.data_ptr(), cute.make_layout((SUM_BATCH * NUM_THREADS, _VEC),
                                                                            stride=(_VEC, 1)))
            slot_rows.slot_sum(tidx, bidx, grid, mDx, mInit, mOut, mIdx, None, k, mOut.shape[0], hidden, sbuf,
                               SUM_BATCH, NUM_THREADS, None, mAdd)

    @cute.jit
    def _decode(self, t: Int32, dims, mOffsets: cute.Tensor, num_experts: Int32, cur):
        """:func:`~mok_cute.schedule.fused_bwd_tasks.core_task` of task ``t`` with the role's cursors ``cur``."""
        n_d2, n_d1, n_i, n_h, wd_m, wgu_m = dims[1:7]
        return tasks.core_task(t, n_d2, n_d1, n_i, n_h, mOffsets, num_experts, self.cfg.tile_m, wd_m, n_i, wgu_m,
                               n_h, *cur)

    # ------------------------------------------------------------------ task hand-off
    # ------------------------------------------------------------------ roles
    @cute.jit
    def _produce(self, ab_pipe, task_pipe, sTask: cute.Tensor, views, atoms, coords, ticket: cute.Pointer, dims,
                 mOffsets: cute.Tensor, num_experts: Int32, mD2: cute.Tensor, status: cute.Pointer,
                 timeout_ns: Int64):
        """TMA warp: claim tasks from the ticket (list order across the grid), hand each on, wait
        for its inputs, load its k-tiles; the first id >= n_tasks is handed on last (stop)."""
        cfg, md = self.cfg, self.ml_d
        sA, sB, sA_w, sB_w = views
        n_tasks, n_i, k_h, k_i = dims[0], dims[3], dims[8], dims[9]
        tiler_a = (cfg.tile_m, cfg.tile_k)
        tiler_b = (cfg.tile_n, cfg.tile_k)
        tBsB, tBgWd = md.partition_b(atoms[1], cute.local_tile(coords[1], tiler_b, (None, None, None)), sB, 0)
        _, tBgWg = md.partition_b(atoms[3], cute.local_tile(coords[3], tiler_b, (None, None, None)), sB, 0)
        _, tBgWu = md.partition_b(atoms[5], cute.local_tile(coords[5], tiler_b, (None, None, None)), sB, 0)
        no_mask = (None, None)
        state = md.producer_state()
        tstate = task_ring.producer_state()
        cur = (Int32(0), Int32(0), Int32(0), Int32(0))
        ready_e = Int32(-1)  # the last expert whose D2 tiles this CTA saw complete
        t = persistent.claim(ticket)
        tstate = task_ring.publish(task_pipe, tstate, sTask, t)
        while t < n_tasks:
            phase, expert, n_tile, m_tile, row0, _, mt, which, e1, b1, e2, b2 = self._decode(
                t, dims, mOffsets, num_experts, cur)
            cur = (e1, b1, e2, b2)
            if phase == D2:
                gA = cute.local_tile(cute.domain_offset((row0, 0), coords[0][(None, None, 0)]), tiler_a, (0, None))
                tAsA, tAgA = self.ml_d.partition_a(atoms[0], gA, sA, 0)
                state = self.ml_d.load_tile(ab_pipe, state, atoms[0:2], (tAgA, tBgWd[(None, n_tile, None, expert)]),
                                     (tAsA, tBsB), k_h, Int32(0), no_mask)
            elif phase == D1:
                persistent.wait_input(mD2.iterator + mt, n_i, timeout_ns, status, Int32(D2_READY), mt)
                gA = cute.local_tile(cute.domain_offset((row0, 0), coords[2][(None, None, 0)]), tiler_a, (0, None))
                gA2 = cute.local_tile(cute.domain_offset((row0, 0), coords[4][(None, None, 0)]), tiler_a, (0, None))
                tAsA, tAgA = self.ml_d.partition_a(atoms[2], gA, sA, 0)
                _, tAgA2 = self.ml_d.partition_a(atoms[4], gA2, sA, 0)
                part2 = (atoms[4:6], (tAgA2, tBgWu[(None, n_tile, None, expert)]), k_i)
                state = self.ml_d.load_tile(ab_pipe, state, atoms[2:4], (tAgA, tBgWg[(None, n_tile, None, expert)]),
                                     (tAsA, tBsB), 2 * k_i, Int32(0), no_mask, part2)
            else:
                lo = mOffsets[expert]
                length = mOffsets[expert + 1] - lo
                kt = cutlass.max((length + (self.cfg.tile_k - 1)) // self.cfg.tile_k, 1)
                if which == WD:
                    state = self._load_w(ab_pipe, state, atoms[6], coords[6], atoms[7], coords[7], sA_w, sB_w, lo,
                                         length, m_tile, n_tile, kt)
                else:
                    if expert != ready_e:  # once per expert and CTA: its tickets only grow
                        first, count = tasks.expert_mtile_range(mOffsets, expert, self.cfg.tile_m)
                        for m in cutlass.range(count, unroll=1):
                            persistent.wait_input(mD2.iterator + first + m, n_i, timeout_ns, status,
                                                  Int32(D2_READY), first + m)
                        ready_e = expert
                    if which == WG:
                        state = self._load_w(ab_pipe, state, atoms[8], coords[8], atoms[9], coords[9], sA_w, sB_w,
                                             lo, length, m_tile, n_tile, kt)
                    else:
                        state = self._load_w(ab_pipe, state, atoms[10], coords[10], atoms[9], coords[9], sA_w,
                                             sB_w, lo, length, m_tile, n_tile, kt)
            t = persistent.claim(ticket)
            tstate = task_ring.publish(task_pipe, tstate, sTask, t)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _load_w(self, ab_pipe, state, atom_a, coord_a: cute.Tensor, atom_b, coord_b: cute.Tensor, sA: cute.Tensor,
                sB: cute.Tensor, lo: Int32, length: Int32, m_tile: Int32, n_tile: Int32, kt: Int32):
        """TMA warp: the k-tiles of weight-gradient tile (m_tile, n_tile) over the expert's rows
        ``lo .. lo + length`` (the unfused wgrad's ragged views); returns the state."""
        cfg, mw = self.cfg, self.ml_w
        gA = cute.local_tile(_expert_k(coord_a, lo, length), (cfg.tile_m, cfg.tile_k), (m_tile, None))
        gB = cute.local_tile(_expert_k(coord_b, lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
        tAsA, tAgA = mw.partition_a(atom_a, gA, sA, 0)
        tBsB, tBgB = mw.partition_b(atom_b, gB, sB, 0)
        return mw.load_tile(ab_pipe, state, [atom_a, atom_b], (tAgA, tBgB), (tAsA, tBsB), kt, Int32(0),
                            (None, None))

    @cute.jit
    def _mma(self, ab_pipe, acc_pipe, task_pipe, sTask: cute.Tensor, views, tmem, dims, mOffsets: cute.Tensor):
        """MMA warp: each task's tile into the next TMEM accumulator stage (D2, D1: the (K, MN)
        tiled MMA; W: the (MN, MN) one)."""
        md, mw = self.ml_d, self.ml_w
        sA, sB, sA_w, sB_w = views
        n_tasks, n_d2, n_d1, per_e, k_h, k_i = dims[0], dims[1], dims[2], dims[7], dims[8], dims[9]
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = md.acc_tensor(acc_ptr)
        acc_w = mw.acc_tensor(acc_ptr)
        tCrA, tCrB, _ = md.mma_fragments(sA, sB, None, None, acc_ptr)
        tCrA_w, tCrB_w, _ = mw.mma_fragments(sA_w, sB_w, None, None, acc_ptr)
        mma_d = md.make_tiled_mma()
        mma_w = mw.make_tiled_mma()
        state = md.consumer_state()
        acc_state = md.acc_producer_state()
        tstate = task_ring.consumer_state()
        t, tstate = task_ring.take(task_pipe, tstate, sTask, True)
        while t < n_tasks:
            acc_pipe.producer_acquire(acc_state)
            if t >= n_d2 + n_d1:  # W: K = the expert's rows
                expert = (t - n_d2 - n_d1) // per_e
                length = mOffsets[expert + 1] - mOffsets[expert]
                kt = cutlass.max((length + (self.cfg.tile_k - 1)) // self.cfg.tile_k, 1)
                state, mma_w = self.ml_w.mma_tile(mma_w, ab_pipe, state, tCrA_w, tCrB_w, None,
                                           acc_w[(None, None, None, acc_state.index)], kt)
            else:
                kt = k_h  # D2: K = H; D1: K = 2 x I in k-tiles of each half
                if t >= n_d2:
                    kt = 2 * k_i
                state, mma_d = self.ml_d.mma_tile(mma_d, ab_pipe, state, tCrA, tCrB, None,
                                           acc[(None, None, None, acc_state.index)], kt)
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t, tstate = task_ring.take(task_pipe, tstate, sTask, True)
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def _epilogue(self, acc_pipe, task_pipe, sTask: cute.Tensor, tmem, tidx: Int32, dims, mOffsets: cute.Tensor,
                  num_experts: Int32, mGU: cute.Tensor, mDgu: cute.Tensor, mDx: cute.Tensor, mDWg: cute.Tensor,
                  mDWu: cute.Tensor, mDWd: cute.Tensor, mD2: cute.Tensor, limit: Float32, mOrder: cute.Tensor,
                  done: cute.Pointer):
        """Epilogue warps: store each task's accumulator with the unfused kernels' epilogue (tokens
        variant: D1 row r to slot row ``order[row0 + r]``); a D2 tile is then published on
        ``d2[mt]``, a D1 tile of the tokens variant counted on ``done`` (release add by thread 0
        after every thread's GPU-scope fence and the epilogue barrier)."""
        n_tasks = dims[0]
        tmem.allocate(self.ml_d.tmem_alloc)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.ml_d.acc_tensor(acc_ptr)
        acc_state = self.ml_d.acc_consumer_state()
        tstate = task_ring.consumer_state()
        cur = (Int32(0), Int32(0), Int32(0), Int32(0))
        t, tstate = task_ring.take(task_pipe, tstate, sTask, False)
        while t < n_tasks:
            phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = self._decode(
                t, dims, mOffsets, num_experts, cur)
            cur = (e1, b1, e2, b2)
            acc_pipe.consumer_wait(acc_state)
            chunks = AccChunks(acc[(None, None, None, acc_state.index)], tidx)
            if phase == D2:
                self.dswiglu._store_dswiglu(chunks, row0, rows, n_tile, mDgu, mGU, limit)
            elif phase == D1:
                if cutlass.const_expr(self.tokens):
                    store_routed(self.dgrad1, chunks, row0, rows, n_tile, mDx, mOrder)
                else:
                    self.dgrad1._store_plain(chunks, row0, rows, n_tile, mDx)
            else:
                r0 = m_tile * self.cfg.tile_m
                if which == WD:
                    self.wgrad._store_plain(chunks, r0, mDWd.shape[1] - r0, n_tile, mDWd[(expert, None, None)])
                elif which == WG:
                    self.wgrad._store_plain(chunks, r0, mDWg.shape[1] - r0, n_tile, mDWg[(expert, None, None)])
                else:
                    self.wgrad._store_plain(chunks, r0, mDWu.shape[1] - r0, n_tile, mDWu[(expert, None, None)])
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            if phase == D2:
                cute.arch.fence_acq_rel_gpu()  # this thread's dgu stores before thread 0's release below
                epi_barrier()
                if tidx == 0:
                    cute.arch.atomic_add(mD2.iterator + mt, Int32(1), sem="release", scope="gpu")
            if cutlass.const_expr(self.tokens):
                if phase == D1:
                    cute.arch.fence_acq_rel_gpu()  # this thread's slot rows before thread 0's count below
                    epi_barrier()
                    if tidx == 0:
                        cute.arch.atomic_add(done, Int32(1), sem="release", scope="gpu")
            t, tstate = task_ring.take(task_pipe, tstate, sTask, False)
        tmem.relinquish_alloc_permit()
        epi_barrier()
        tmem.free(acc_ptr)


# ---------------------------------------------------------------- compile
def compile_fused_backward_sm100(clamp: bool, tokens: bool = False, init: bool = False, add: bool = False, *,
                                 arch: str = "sm_100a", inspect: bool = False):
    """Compile the routed core with symbolic M, T, T*k, H, I, E for ``arch`` (sm_100a / sm_103a;
    ``tokens``: the dx scatter and slot sum in the launch, ``init`` / ``add``: its bf16 / fp32
    start terms, need ``tokens``); returns ``(compiled, report)``."""
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused backward needs arch in {ARCHS}, got {arch!r}")
    op = FusedMoeBwdSm100(clamp, tokens, init, add)
    bf = cutlass.BFloat16
    m, e, two, t, tk = (cute.sym_int() for _ in range(5))
    hid, inter = (cute.sym_int(divisibility=DIM_MULTIPLE) for _ in range(2))

    def vec(n=None):
        return cute.runtime.make_fake_tensor(Int32, (cute.sym_int() if n is None else n,), stride=(1,),
                                             assumed_align=4)

    args = (_fake_2d(bf, m, hid), _fake_2d(bf, m, hid), _fake_3d(bf, m, two, inter), _fake_2d(bf, m, inter),
            _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter),
            _fake_3d(bf, m, two, inter), _fake_2d(bf, tk if tokens else m, hid), _fake_3d(bf, e, inter, hid),
            _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter), vec(), vec(), vec())
    toks = (None,) * 5
    if tokens:
        toks = (vec(), vec(tk), _fake_2d(bf, t, hid) if init else None, _fake_2d(Float32, t, hid) if add else None,
                _fake_2d(bf, t, hid))
    return compile_kernel(op, *args, *toks, Int32(1), Float32(0.0), Int32(1), Int64(1), cute.runtime.make_fake_stream(),
                          arch=arch, inspect=inspect)


# ---------------------------------------------------------------- launch
def _check_operands(dy, x, gu, h, offsets, w_gate, w_up, w_down, limit, timeout_s, num_ctas):
    """Raise TypeError / ValueError for operands :func:`fused_backward_core` cannot launch on."""
    bf = (torch.bfloat16,)
    _check_tensor("dy", dy, 2, bf)
    m, hid = dy.shape
    if hid == 0 or hid % DIM_MULTIPLE:
        raise ValueError(f"dy must be [M, H] with H a positive multiple of {DIM_MULTIPLE}, got {tuple(dy.shape)}")
    _check_tensor("x", x, 2, bf)
    if tuple(x.shape) != (m, hid):
        raise ValueError(f"x must have dy's shape {(m, hid)}, got {tuple(x.shape)}")
    _check_tensor("offsets", offsets, 1, (torch.int32,))
    _check_tensor("w_gate", w_gate, 3, bf)
    e, inter = w_gate.shape[0], w_gate.shape[1]
    if e == 0 or inter == 0 or inter % DIM_MULTIPLE:
        raise ValueError(f"w_gate must be [E >= 1, I, H] with I a positive multiple of {DIM_MULTIPLE}, "
                         f"got {tuple(w_gate.shape)}")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must hold E+1 = {e + 1} entries, got {offsets.numel()}")
    _check_weight("w_gate", w_gate, (e, inter, hid), False, strided=True)
    _check_weight("w_up", w_up, (e, inter, hid), False, strided=True)
    _check_weight("w_down", w_down, (e, hid, inter), False)
    for name, a, cols in (("gu", gu, 2 * inter), ("h", h, inter)):
        _check_tensor(name, a, 2, bf)
        if a.shape[0] < m or a.shape[1] != cols:
            raise ValueError(f"{name} must be [>= M={m}, {cols}], got {tuple(a.shape)}")
    for name, a in dict(dy=dy, x=x, gu=gu, h=h, offsets=offsets, w_gate=w_gate, w_up=w_up, w_down=w_down).items():
        if a.device != dy.device:
            raise ValueError(f"{name} is on {a.device} but dy is on {dy.device}")
        if name not in ("w_gate", "w_up") and (not a.is_contiguous() or a.data_ptr() % 16):
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    _check_limit(limit)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if num_ctas is not None and (isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1):
        raise ValueError(f"num_ctas must be None or an int >= 1, got {num_ctas!r}")


def _check_tokens(tokens, dy):
    """Raise TypeError / ValueError for a ``tokens`` argument :func:`fused_backward_core` cannot
    launch on; returns ``(order int32 [M], topk_idx int32 [T*k], dx_shared, dx_add, T, k)``."""
    if not isinstance(tokens, (tuple, list)) or len(tokens) not in (3, 4):
        raise ValueError("tokens must be (order, topk_idx, dx_shared) or (order, topk_idx, dx_shared, dx_add)")
    order, topk_idx, dxs, add = (*tokens, None)[:4]
    m, hid = dy.shape
    ints = (torch.int32, torch.int64)
    _check_tensor("order", order, 1, ints)
    if order.numel() < m:
        raise ValueError(f"order must hold >= M = {m} entries, got {order.numel()}")
    _check_tensor("topk_idx", topk_idx, 2, ints)
    t, k = topk_idx.shape
    if k == 0:
        raise ValueError(f"topk_idx must be [T, k >= 1], got {tuple(topk_idx.shape)}")
    for name, a, dtype in (("dx_shared", dxs, torch.bfloat16), ("dx_add", add, torch.float32)):
        if a is None:
            continue
        _check_tensor(name, a, 2, (dtype,))
        if tuple(a.shape) != (t, hid):
            raise ValueError(f"{name} must be [T, H] = {(t, hid)}, got {tuple(a.shape)}")
        if not a.is_contiguous() or a.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    for name, a in dict(order=order, topk_idx=topk_idx, dx_shared=dxs, dx_add=add).items():
        if a is not None and a.device != dy.device:
            raise ValueError(f"{name} is on {a.device} but dy is on {dy.device}")
    return (order[:m].to(torch.int32).contiguous(), topk_idx.reshape(-1).to(torch.int32).contiguous(), dxs, add,
            t, k)


def fused_backward_core(dy, x, gu, h, offsets, w_gate, w_up, w_down, limit, timeout_s: float,
                        num_ctas: int | None = None, tokens=None):
    """Validate, then launch the routed backward core on the current stream (the contract of
    :func:`mok_cute.kernels.sm90.fused_bwd.fused_backward_core` without ``tokens`` / ``mx``):
    dy, x [M, H] bf16 (grouped rows, dy already scaled by the router weights); gu [>= M, 2I] and
    h [>= M, I] (the forward's, first M rows read); ``offsets`` int32 [E+1] (trusted: 0,
    non-decreasing, last = M); w_gate, w_up [E, I, H] (unit last stride, other strides multiples of
    16 bytes), w_down [E, H, I]; ``limit`` None or the SwiGLU clamp; H, I multiples of 64; one
    sm_100 / sm_103 device. ``num_ctas``: the grid (default all SMs). Returns ``(dx [M, H], dWg,
    dWu [E, I, H], dWd [E, H, I])``, meant bitwise the unfused SM100 backward's (unverified on
    hardware). ``tokens`` = ``(order, topk_idx, dx_shared[, dx_add])``: each dx row goes to its
    (token, slot) row and the launch ends with the fixed-order slot sum, so dx is [T, H] =
    bf16(fp32(dx_shared) (or 0) [+ dx_add] + the slot rows j = 0.. of each token with
    topk_idx >= 0), bitwise the unfused scatter and reference slot sum; ``order`` int [>= M]
    (grouped row -> t*k + j, trusted), ``topk_idx`` int [T, k], ``dx_shared`` bf16 [T, H] or None,
    ``dx_add`` fp32 [T, H] or None (both contiguous). A device wait's timeout is raised by a later
    call (:mod:`mok_cute.dsl.deferred`)."""
    _check_operands(dy, x, gu, h, offsets, w_gate, w_up, w_down, limit, timeout_s, num_ctas)
    toks = None if tokens is None else _check_tokens(tokens, dy)
    dev, arch = device_arch(dy.device)
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused backward needs an sm_100a / sm_103a device, got {arch}")
    m, hid = dy.shape
    e, inter = w_gate.shape[0], w_gate.shape[1]
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dx = torch.empty((m if toks is None else toks[4], hid), **bf)
    dwg = torch.empty((e, inter, hid), **bf)
    dwu = torch.empty((e, inter, hid), **bf)
    dwd = torch.empty((e, hid, inter), **bf)
    if m == 0:  # no rows: no tile reads anything, zero gradients (dx: the slot sum's start)
        if toks is not None:
            dx.copy_(toks[2]) if toks[2] is not None else dx.zero_()
            if toks[3] is not None:
                dx.copy_((dx.float() + toks[3]).bfloat16())
        return dx, dwg.zero_(), dwu.zero_(), dwd.zero_()
    dgu = torch.empty((m, 2, inter), **bf)
    mt_cap = m // CONFIG.tile_m + e + 1  # routed m-tiles: at most one partial per expert
    n_words = WORDS if toks is None else DONE_WORD + 1
    counters = torch.zeros(mt_cap + n_words, dtype=torch.int32, device=dy.device)
    d2, words = counters[:mt_cap], counters[mt_cap:]
    k, tok_args, rows = 1, (None,) * 5, dx
    if toks is not None:
        order32, idx32, dxs, add, t, k = toks
        rows = torch.empty((t * k, hid), **bf)  # the dx rows by (token, slot); rows of -1 slots not summed
        tok_args = (order32, idx32, dxs, add, dx)
    variant = (limit is not None, toks is not None, toks is not None and toks[2] is not None,
               toks is not None and toks[3] is not None)
    launcher = compile_cached(("sm100_fused_moe_bwd_core", arch) + variant, lambda: GraphLauncher(
        compile_fused_backward_sm100(variant[0], *variant[1:], arch=arch)[0]))
    num_ctas = sm_count(dev) if num_ctas is None else num_ctas
    tensors = (dy, x, gu[:m].view(m, 2, inter), h[:m], w_gate, w_up, w_down, dgu, rows, dwg, dwu, dwd, offsets, d2,
               words, *tok_args)
    lim, timeout_ns = 0.0 if limit is None else float(limit), int(timeout_s * 1e9)
    key = tuple(None if a is None else tensor_key(a) for a in tensors) + (k, lim, num_ctas, timeout_ns)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda st: (
        *(None if a is None else _Desc(a) for a in tensors), Int32(k), Float32(lim), Int32(num_ctas),
        Int64(timeout_ns), st))
    deferred.watch(words[1:WORDS], describe)
    return dx, dwg, dwu, dwd


# ---------------------------------------------------------------- variant registry (readiness tool)
_PTX = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
        "mbarrier", "atom.global.add.u32", "atom.global.release.add.u32", "ld.acquire", "%globaltimer",
        "fence.proxy.async.global")
_PTX_TOKENS = ("add.rn.f32", "cp.async.cg")  # the dx slot sum: single-rounded fp32 adds, slot rows via cp.async


def variants() -> dict:
    """``name -> (compile(arch, inspect) -> (compiled, report), PTX substrings it must hold)`` for
    every fused-backward variant this module builds."""
    def core(clamp, **kw):
        return lambda arch, inspect=True: compile_fused_backward_sm100(clamp, arch=arch, inspect=inspect, **kw)

    return {"fused-bwd-core-clamp": (core(True), _PTX), "fused-bwd-core-noclamp": (core(False), _PTX),
            "fused-bwd-tokens-clamp": (core(True, tokens=True, init=True, add=True), _PTX + _PTX_TOKENS),
            "fused-bwd-tokens-noclamp": (core(False, tokens=True), _PTX + _PTX_TOKENS)}

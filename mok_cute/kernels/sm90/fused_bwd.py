"""The routed core of the fused MoE backward on SM90: one persistent launch for the routed
experts' dgrad2 + dSwiGLU, dgrad1 and three weight gradients (issue 13's first kernel; the comm
jobs, the shared expert and the dx slot sum stay outside it for now).

Inputs (grouped rows, expert order, ``offsets`` int32 [E+1]; M rows, bf16): ``dy`` [M, H] (the
route's dy row times its router weight, ``kernels/route_grad.py``), ``x`` [M, H] (the gathered
input rows), ``gu`` [M, 2I] and ``h`` [M, I] (saved by the forward); weights ``w_gate``,
``w_up`` [E, I, H], ``w_down`` [E, H, I]. Outputs: ``dgu`` [M, 2I] (kept: the weight gradients
read it), ``dx`` [M, H] (grouped rows), ``dWg``, ``dWu`` [E, I, H] and ``dWd`` [E, H, I].

Tasks (:func:`mok_cute.schedule.fused_bwd_tasks.core_task`, claimed from one ticket counter in
list order, :mod:`mok_cute.kernels.sm90.persistent`):

  D2  dh = dy_e . w_down[e]  -> dSwiGLU with gu -> dgu   ``mt * I / tile_n`` tiles, need nothing
  D1  dx = dgu_e . [w_gate[e]; w_up[e]]                  ``mt * H / tile_n``, need every D2 tile
                                                         of their m-tile (counter ``d2[mt]``)
  W   per expert: dWd = dy_e^T h_e, dWg = dg_e^T x_e,    need nothing (dWd), or every D2 tile of
      dWu = du_e^T x_e; one CTA per output tile, the     the expert's m-tiles (dWg, dWu)
      expert's rows summed in row order (ragged K)

Each tile is the standalone kernels' tile (``grouped_gemm.GroupedGemmSm90`` dswiglu / split-B
plain, ``expert_bwd.GroupedWgradSm90``) on the one ``Sm90Mainloop`` building block: D2 and D1
read (A K-major, B MN-major) shared views, W (A MN-major, B MN-major) views of the same ring
stages, through one mbarrier pipeline. So every output is bitwise the
unfused backward's, whichever CTA ran which tile. Waits point backwards in the list, so with
every CTA resident it cannot deadlock (the mirror, ``fused_bwd_tasks.simulate``); a wait is
bounded by ``timeout_ns`` and recorded in ``status`` (int32[4], read by the host later).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from mok_cute.dsl import deferred
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import sm_count
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.comm import protocol as P
from mok_cute.kernels.route_grad_row import route_row
from mok_cute.kernels.sm90 import persistent, route_rows
from mok_cute.kernels.sm90.persistent import opaque as _opaque
from mok_cute.kernels.sm90.expert_bwd import _expert_k, _ragged_k
from mok_cute.kernels.sm90.grouped_gemm import _VEC, DSwigluEpilogue, PlainEpilogue
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, MN_MAJOR, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG, MainloopConfig, Sm90Mainloop,
    acc_to_smem, consumer_barrier, experts_last,
)
from mok_cute.schedule import fused_bwd_tasks as tasks
from mok_cute.schedule.fused_bwd_tasks import D1, D2, WD, WG
from mok_cute.schedule.fused_tasks import mtile, routed_mtiles

D2_READY, D1_DONE, ROWS_READY = 24, 25, 26  # status channels: the waits on d2[mt], on the D1 tiles (slot sum),
#                                             on the gathered rows of m-tile mt
DONE_WORD = 1 + P.STATUS_WORDS  # counters: the ticket, the status words, the stored D1 tiles (scatter)
COUNTER_WORDS = DONE_WORD + 1
SUM_BATCH = 8  # slot rows in flight per thread of the dx slot sum


class FusedMoeBwdCoreSm90:
    """The persistent routed backward (see the module doc); ``clamp``: the SwiGLU limit given."""

    def __init__(self, clamp: bool, scatter: bool = False, gather: bool = False, by_route: bool = False,
                 cfg: MainloopConfig = MainloopConfig()):
        if gather and not scatter:
            raise ValueError("gather (the dy / x rows in the launch) needs scatter")
        self.cfg, self.clamp, self.scatter, self.gather, self.by_route = cfg, clamp, scatter, gather, by_route
        self.dswiglu = DSwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp)
        self.plain = PlainEpilogue(cfg.tile_m, cfg.tile_n)
        epi = max(self.dswiglu.smem_elems(), self.plain.smem_elems())
        self.epi_elems = epi
        self.ml_d = Sm90Mainloop(cfg, epi_smem_bytes=epi * 2, b_major=MN_MAJOR)  # D2, D1
        self.ml_w = Sm90Mainloop(cfg, epi_smem_bytes=epi * 2, a_major=MN_MAJOR, b_major=MN_MAJOR)  # W
        assert self.ml_d.stages == self.ml_w.stages

    @cute.jit
    def __call__(self, mDy: cute.Tensor, mX: cute.Tensor, mGU: cute.Tensor, mH: cute.Tensor, mWg: cute.Tensor,
                 mWu: cute.Tensor, mWd: cute.Tensor, mDgu: cute.Tensor, mDg: cute.Tensor, mDu: cute.Tensor,
                 mDgu3: cute.Tensor, mDx: cute.Tensor, mDWg: cute.Tensor, mDWu: cute.Tensor, mDWd: cute.Tensor,
                 mOffsets: cute.Tensor, mD2: cute.Tensor, mCounters: cute.Tensor, mSlot: cute.Tensor,
                 mOrder: cute.Tensor, mIdx: cute.Tensor, mInit: cute.Tensor, mOut: cute.Tensor, mDyTok: cute.Tensor,
                 mXTok: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mDtw: cute.Tensor, mGdy: cute.Tensor,
                 k: Int32, comm_ctas: Int32, limit: Float32, num_ctas: Int32, timeout_ns: Int64,
                 stream: cuda.CUstream):
        """``mGU`` / ``mDgu3``: gu / dgu as [M, 2, I]; ``mDgu`` [M, 2I]; ``mDg`` / ``mDu``: its
        column halves [M, I] (views of one buffer). ``scatter`` variant: ``mSlot`` [T*k, H] (dx
        slot rows), ``mOrder`` int32 [M] (grouped row -> t*k + j), ``mIdx`` int32 [T*k], ``mInit``
        [T, H] or None (the shared expert's dx), ``mOut`` [T, H] (dx); otherwise None. ``gather``
        variant: the first ``comm_ctas`` CTAs write ``mDy`` / ``mX`` (grouped rows, then read by the
        tiles) from ``mDyTok`` / ``mXTok`` [T, H] and the forward's GEMM2 rows ``mR`` (grouped, or
        ``by_route``: in route order) with ``mW`` / ``mDtw`` fp32 [T*k] (topk_w in, d topk_w out),
        publishing routed m-tile c on ``mGdy[c]``; ``mOrder`` then holds all T*k routes."""
        md, mw = self.ml_d, self.ml_w
        md.setup()
        mw.setup()
        # D2: A = dy (M, H) K-major, B = w_down as (I, H, E) MN-major
        atom_dy, coord_dy, atom_wd, coord_wd = md.make_tma(mDy, experts_last(mWd, True))
        # D1: A = dgu (M, 2I) K-major, B = w_gate then w_up along K, each (H, I, E) MN-major
        atom_dgu, coord_dgu, atom_wg, coord_wg = md.make_tma(mDgu, experts_last(mWg, True))
        _, _, atom_wu, coord_wu = md.make_tma(mDgu, experts_last(mWu, True))
        # W: both operands (N, rows) MN-major, ragged along the rows (expert_bwd)
        atom_dyt, coord_dyt, atom_ht, coord_ht = mw.make_tma(_ragged_k(_t(mDy)), _ragged_k(_t(mH)))
        atom_dgt, coord_dgt, atom_xt, coord_xt = mw.make_tma(_ragged_k(_t(mDg)), _ragged_k(_t(mX)))
        atom_dut, coord_dut, _, _ = mw.make_tma(_ragged_k(_t(mDu)), _ragged_k(_t(mX)))
        self.shared_storage = md.shared_storage(self.epi_elems, extra_i32=2)
        self.kernel(atom_dy, coord_dy, atom_wd, coord_wd, atom_dgu, coord_dgu, atom_wg, coord_wg, atom_wu,
                    coord_wu, atom_dyt, coord_dyt, atom_ht, coord_ht, atom_dgt, coord_dgt, atom_xt, coord_xt,
                    atom_dut, coord_dut, mGU, mDgu3, mDx, mDWg, mDWu, mDWd, mOffsets, mD2, mCounters, mSlot,
                    mOrder, mIdx, mInit, mOut, mDyTok, mXTok, mR, mW, mDtw, mGdy, mDy, mX, k, comm_ctas, limit,
                    timeout_ns).launch(grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1],
                                       min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, atom_dy: cute.CopyAtom, coord_dy: cute.Tensor, atom_wd: cute.CopyAtom, coord_wd: cute.Tensor,
               atom_dgu: cute.CopyAtom, coord_dgu: cute.Tensor, atom_wg: cute.CopyAtom, coord_wg: cute.Tensor,
               atom_wu: cute.CopyAtom, coord_wu: cute.Tensor, atom_dyt: cute.CopyAtom, coord_dyt: cute.Tensor,
               atom_ht: cute.CopyAtom, coord_ht: cute.Tensor, atom_dgt: cute.CopyAtom, coord_dgt: cute.Tensor,
               atom_xt: cute.CopyAtom, coord_xt: cute.Tensor, atom_dut: cute.CopyAtom, coord_dut: cute.Tensor,
               mGU: cute.Tensor, mDgu: cute.Tensor, mDx: cute.Tensor, mDWg: cute.Tensor, mDWu: cute.Tensor,
               mDWd: cute.Tensor, mOffsets: cute.Tensor, mD2: cute.Tensor, mCounters: cute.Tensor,
               mSlot: cute.Tensor, mOrder: cute.Tensor, mIdx: cute.Tensor, mInit: cute.Tensor, mOut: cute.Tensor,
               mDyTok: cute.Tensor, mXTok: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mDtw: cute.Tensor,
               mGdy: cute.Tensor, mDyRows: cute.Tensor, mXRows: cute.Tensor, k: Int32, comm_ctas: Int32,
               limit: Float32, timeout_ns: Int64):
        cfg = self.cfg
        md, mw = self.ml_d, self.ml_w
        atoms = [atom_dy, atom_wd, atom_dgu, atom_wg, atom_wu, atom_dyt, atom_ht, atom_dgt, atom_xt, atom_dut]
        tidx, warp = md.start(atoms)
        mw.setup()
        pipe, sA, sB, _, storage = md.allocate(self.shared_storage, self.plain, with_storage=True)
        sA_w = storage.sA.get_tensor(mw.a_smem_staged.outer, swizzle=mw.a_smem_staged.inner)
        sB_w = storage.sB.get_tensor(mw.b_smem_staged.outer, swizzle=mw.b_smem_staged.inner)
        sTask = storage.extra.get_tensor(cute.make_layout(2))

        num_experts = mOffsets.shape[0] - 1
        inter = mGU.shape[2]
        hidden = mDWd.shape[1]
        n_i = inter // cfg.tile_n  # D2 n-tiles
        n_h = hidden // cfg.tile_n  # D1 n-tiles
        mt = routed_mtiles(mOffsets, num_experts, cfg.tile_m)
        dims = (n_i, n_h, (hidden + cfg.tile_m - 1) // cfg.tile_m, inter // cfg.tile_n,
                (inter + cfg.tile_m - 1) // cfg.tile_m, hidden // cfg.tile_n)
        n_d2, n_d1 = mt * n_i, mt * n_h
        n_tasks = n_d2 + n_d1 + num_experts * (dims[2] * dims[3] + 2 * dims[4] * dims[5])
        status = mCounters.iterator + 1
        if cutlass.const_expr(self.gather):
            bidx, _, _ = cute.arch.block_idx()
            if bidx < comm_ctas:  # first the routed rows, then GEMM tasks like every CTA
                self._gather(tidx, bidx, comm_ctas, mt, mOffsets, num_experts, mOrder, mDyTok, mXTok, mR, mW, mDtw,
                             mDyRows, mXRows, mGdy, k, hidden)
                cute.arch.barrier()
        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self._produce(pipe, sA, sB, sA_w, sB_w, sTask, mCounters.iterator, n_tasks, n_d2, n_d1, dims,
                              mOffsets, num_experts, hidden, inter, atom_dy, coord_dy, atom_wd, coord_wd, atom_dgu,
                              coord_dgu, atom_wg, coord_wg, atom_wu, coord_wu, atom_dyt, coord_dyt, atom_ht,
                              coord_ht, atom_dgt, coord_dgt, atom_xt, coord_xt, atom_dut, coord_dut, mD2, status,
                              timeout_ns, mGdy)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(pipe, sA, sB, sA_w, sB_w, storage, sTask, tidx - THREADS_PER_WG, n_tasks, n_d2, n_d1,
                          dims, mOffsets, num_experts, hidden, inter, mGU, mDgu, mDx, mDWg, mDWu, mDWd, mD2, limit,
                          mSlot, mOrder, mCounters.iterator + DONE_WORD)
        if cutlass.const_expr(self.scatter):
            # every CTA: the dx slot sum once every dgrad1 tile is stored, registers evened out as in
            # the fused forward (the consumers give theirs back before the producer warpgroup takes any)
            if warp >= THREADS_PER_WG // 32:
                cute.arch.setmaxregister_decrease(route_rows.SUM_REGS)
            cute.arch.barrier()
            if warp < THREADS_PER_WG // 32:
                cute.arch.setmaxregister_increase(route_rows.SUM_REGS)
            if tidx == 0:
                P.wait_geq(mCounters.iterator + DONE_WORD, n_d1, timeout_ns, status, Int32(0), Int32(D1_DONE))
            cute.arch.barrier()
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            sbuf = cute.make_tensor(storage.sB.data_ptr(), cute.make_layout((SUM_BATCH * NUM_THREADS, _VEC),
                                                                            stride=(_VEC, 1)))
            route_rows.slot_sum(tidx, bidx, grid, mSlot, mInit, mOut, mIdx, None, k, mOut.shape[0], hidden, sbuf,
                                SUM_BATCH)

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _produce(self, pipe, sA, sB, sA_w, sB_w, sTask: cute.Tensor, ticket: cute.Pointer, n_tasks: Int32,
                 n_d2: Int32, n_d1: Int32, dims, mOffsets: cute.Tensor, num_experts: Int32, hidden: Int32,
                 inter: Int32, atom_dy, coord_dy, atom_wd, coord_wd, atom_dgu, coord_dgu, atom_wg, coord_wg, atom_wu,
                 coord_wu, atom_dyt, coord_dyt, atom_ht, coord_ht, atom_dgt, coord_dgt, atom_xt, coord_xt, atom_dut,
                 coord_dut, mD2: cute.Tensor, status: cute.Pointer, timeout_ns: Int64, mGdy: cute.Tensor):
        """Producer warp: claim tasks in list order, hand each to the consumers, wait for its
        inputs, then TMA its k-tiles; a task id >= n_tasks handed off last stops the consumers."""
        cfg = self.cfg
        n_i, n_h = dims[0], dims[1]
        k_h = hidden // cfg.tile_k
        k_i = inter // cfg.tile_k
        state = self.ml_d.producer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        ready_e = Int32(-1)  # the last expert whose dgrad2 tiles this producer saw complete
        ready_g = Int32(-1)  # ... whose routed rows (gather) it saw stored
        i = Int32(0)
        t = persistent.claim(ticket)
        while t < n_tasks:
            persistent.hand_off(sTask, i, t)
            i += 1
            phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = tasks.core_task(
                t, n_d2, n_d1, n_i, n_h, mOffsets, num_experts, cfg.tile_m, *dims[2:], e1, b1, e2, b2)
            if phase == D2:
                if cutlass.const_expr(self.gather):
                    persistent.wait_input(mGdy.iterator + mt, Int32(1), timeout_ns, status, Int32(ROWS_READY), mt)
                gA = cute.local_tile(cute.domain_offset((row0, 0), coord_dy), (cfg.tile_m, cfg.tile_k), (0, None))
                gB = cute.local_tile(coord_wd[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                state = self.ml_d.load_tile(pipe, state, atom_dy, gA, sA, atom_wd, gB, sB, k_h)
            elif phase == D1:
                persistent.wait_input(mD2.iterator + mt, n_i, timeout_ns, status, Int32(D2_READY), mt)
                gA = cute.local_tile(cute.domain_offset((row0, 0), coord_dgu), (cfg.tile_m, cfg.tile_k), (0, None))
                gB = cute.local_tile(coord_wg[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                gB2 = cute.local_tile(coord_wu[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                state = self.ml_d.load_tile(pipe, state, atom_dgu, gA, sA, atom_wg, gB, sB, k_i, atom_wu, gB2, k_i)
            else:
                lo = mOffsets[expert]
                length = mOffsets[expert + 1] - lo
                k_rows = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
                if cutlass.const_expr(self.gather):
                    if expert != ready_g:  # the expert's dy and x rows, once per expert and CTA
                        first, count = tasks.expert_mtile_range(mOffsets, expert, cfg.tile_m)
                        for m in cutlass.range(count, unroll=1):
                            persistent.wait_input(mGdy.iterator + first + m, Int32(1), timeout_ns, status,
                                                  Int32(ROWS_READY), first + m)
                        ready_g = expert
                if which == WD:
                    gA = cute.local_tile(_expert_k(coord_dyt, lo, length), (cfg.tile_m, cfg.tile_k), (m_tile, None))
                    gB = cute.local_tile(_expert_k(coord_ht, lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
                    state = self.ml_w.load_tile(pipe, state, atom_dyt, gA, sA_w, atom_ht, gB, sB_w, k_rows)
                else:
                    if expert != ready_e:  # once per expert and CTA: its tickets only grow
                        first, count = tasks.expert_mtile_range(mOffsets, expert, cfg.tile_m)
                        for m in cutlass.range(count, unroll=1):
                            persistent.wait_input(mD2.iterator + first + m, n_i, timeout_ns, status,
                                                  Int32(D2_READY), first + m)
                        ready_e = expert
                    gB = cute.local_tile(_expert_k(coord_xt, lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
                    if which == WG:
                        gA = cute.local_tile(_expert_k(coord_dgt, lo, length), (cfg.tile_m, cfg.tile_k),
                                             (m_tile, None))
                        state = self.ml_w.load_tile(pipe, state, atom_dgt, gA, sA_w, atom_xt, gB, sB_w, k_rows)
                    else:
                        gA = cute.local_tile(_expert_k(coord_dut, lo, length), (cfg.tile_m, cfg.tile_k),
                                             (m_tile, None))
                        state = self.ml_w.load_tile(pipe, state, atom_dut, gA, sA_w, atom_xt, gB, sB_w, k_rows)
            t = persistent.claim(ticket)
        persistent.hand_off(sTask, i, t)
        persistent.finish_hand_offs(i)
        pipe.producer_tail(state)

    @cute.jit
    def _consume(self, pipe, sA, sB, sA_w, sB_w, storage, sTask: cute.Tensor, tid: Int32, n_tasks: Int32,
                 n_d2: Int32, n_d1: Int32, dims, mOffsets: cute.Tensor, num_experts: Int32, hidden: Int32,
                 inter: Int32, mGU: cute.Tensor, mDgu: cute.Tensor, mDx: cute.Tensor, mDWg: cute.Tensor,
                 mDWu: cute.Tensor, mDWd: cute.Tensor, mD2: cute.Tensor, limit: Float32, mSlot: cute.Tensor,
                 mOrder: cute.Tensor, done: cute.Pointer):
        """Consumer warpgroups: MMA each task's tile, run its epilogue; a D2 tile is published on
        ``d2[mt]`` (release) once its dgu rows are stored; ``scatter``: a D1 tile's rows go to
        their (token, slot) rows and it is counted on ``done``."""
        cfg = self.cfg
        n_i, n_h = dims[0], dims[1]
        k_h = hidden // cfg.tile_k
        k_2i = 2 * (inter // cfg.tile_k)
        state = self.ml_d.consumer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        i = Int32(0)
        t = persistent.take(sTask, i)
        while t < n_tasks:
            i += 1
            phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = tasks.core_task(
                t, n_d2, n_d1, n_i, n_h, mOffsets, num_experts, cfg.tile_m, *dims[2:], e1, b1, e2, b2)
            et = _opaque(tid)  # the epilogues' shared addresses rebuilt per tile, not held across the loop
            # each branch builds its own fragments and accumulator: none is live across the tasks
            if phase == D2:
                thr_d, tCrA, tCrB, acc = self.ml_d.consumer_fragments(sA, sB, et)
                s_dsw = self.dswiglu.smem_tensor(storage.sC)
                self.dswiglu.prefetch(s_dsw, et, row0, rows, n_tile, mGU)
                state = self.ml_d.mma_tile(pipe, state, tCrA, tCrB, acc, k_h)
                self.dswiglu.run(self.ml_d.tiled_mma, thr_d, acc, s_dsw, et, row0, rows, n_tile, mDgu, mGU, limit)
                cute.arch.fence_acq_rel_gpu()  # this thread's dgu stores before the CTA's release below
                consumer_barrier()
                if tid == 0:
                    cute.arch.atomic_add(mD2.iterator + mt, Int32(1), sem="release", scope="gpu")
            elif phase == D1:
                thr_d, tCrA, tCrB, acc = self.ml_d.consumer_fragments(sA, sB, et)
                state = self.ml_d.mma_tile(pipe, state, tCrA, tCrB, acc, k_2i)
                if cutlass.const_expr(self.scatter):
                    s_plain = self.plain.smem_tensor(storage.sC)
                    acc_to_smem(thr_d, acc, s_plain)
                    consumer_barrier()
                    route_rows.scatter(s_plain, et, row0, rows, n_tile, mSlot, mOrder, cfg.tile_n, None)
                    cute.arch.fence_acq_rel_gpu()  # this thread's rows before the CTA's count below
                    consumer_barrier()
                    if tid == 0:
                        cute.arch.atomic_add(done, Int32(1), sem="release", scope="gpu")
                else:
                    self.plain.run(self.ml_d.tiled_mma, thr_d, acc, self.plain.smem_tensor(storage.sC), et, row0,
                                   rows, n_tile, mDx, mDx, Float32(0.0))
            else:
                length = mOffsets[expert + 1] - mOffsets[expert]
                k_rows = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
                thr_w, tCrA_w, tCrB_w, acc = self.ml_w.consumer_fragments(sA_w, sB_w, et)
                state = self.ml_w.mma_tile(pipe, state, tCrA_w, tCrB_w, acc, k_rows)
                r0 = m_tile * cfg.tile_m
                s_plain = self.plain.smem_tensor(storage.sC)
                if which == WD:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(hidden - r0, cfg.tile_m), n_tile, mDWd[(expert, None, None)],
                                   mDWd[(expert, None, None)], Float32(0.0))
                elif which == WG:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(inter - r0, cfg.tile_m), n_tile, mDWg[(expert, None, None)],
                                   mDWg[(expert, None, None)], Float32(0.0))
                else:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(inter - r0, cfg.tile_m), n_tile, mDWu[(expert, None, None)],
                                   mDWu[(expert, None, None)], Float32(0.0))
            t = persistent.take(sTask, i)


    @cute.jit
    def _gather(self, tidx: Int32, bidx: Int32, comm_ctas: Int32, chunks: Int32, mOffsets: cute.Tensor,
                num_experts: Int32, mOrder: cute.Tensor, mDyTok: cute.Tensor, mXTok: cute.Tensor, mR: cute.Tensor,
                mW: cute.Tensor, mDtw: cute.Tensor, mDyRows: cute.Tensor, mXRows: cute.Tensor, mGdy: cute.Tensor,
                k: Int32, hidden: Int32):
        """Comm CTAs: routed m-tile c (its grouped rows p, route q = order[p] = t*k + j), by CTA
        ``c % comm_ctas``, one warp per row: dy_rows[p] = bf16(dy[t] * w[q]) and d_topk_w[q] = dy[t] .
        r[p or q] (``kernels.route_grad_row.route_row``, bitwise the route_grad kernel), x_rows[p] = x[t];
        published by a release add on ``gdy[c]``. Then d_topk_w = 0 for the routes past the
        experts' rows (-1 slots), as route_grad writes them."""
        hc = hidden // _VEC
        u32 = cutlass.Uint32

        def rows4(m: cute.Tensor):
            return cute.make_tensor(cute.recast_ptr(m.iterator, dtype=u32),
                                    cute.make_layout((m.shape[0] * hc, 4), stride=(4, 1)))

        dyv, rv, outv, xv, xg = rows4(mDyTok), rows4(mR), rows4(mDyRows), rows4(mXTok), rows4(mXRows)
        w = cute.make_tensor(cute.recast_ptr(mW.iterator, dtype=u32), cute.make_layout(mW.shape[0]))
        dtw = cute.make_tensor(cute.recast_ptr(mDtw.iterator, dtype=u32), cute.make_layout(mDtw.shape[0]))
        warp = tidx // 32
        lane = tidx % 32
        ge, gb = Int32(0), Int32(0)
        for c in cutlass.range(bidx, chunks, comm_ctas, unroll=1):
            row0, rows, ge, gb = mtile(mOffsets, num_experts, self.cfg.tile_m, c, ge, gb)
            for rr in cutlass.range(warp, rows, NUM_THREADS // 32, unroll=1):
                p = row0 + rr
                q = mOrder[p]
                t = q // k
                src = p
                if cutlass.const_expr(self.by_route):
                    src = q
                acc = route_row(lane, dyv, rv, outv, t, src, p, w[q], hc)
                if lane == 0:
                    dtw[q] = acc
                for cc in cutlass.range(lane, hc, 32, unroll=1):
                    xg[p * hc + cc, None].store(xv[t * hc + cc, None].load())
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(mGdy.iterator + c, Int32(1), sem="release", scope="gpu")
        for p in cutlass.range(mOffsets[num_experts] + bidx * NUM_THREADS + tidx, mOrder.shape[0],
                               comm_ctas * NUM_THREADS, unroll=1):
            dtw[mOrder[p]] = u32(0)


def _t(m: cute.Tensor) -> cute.Tensor:
    """A row-major (rows, N) tensor seen as (N, rows)."""
    return cute.make_tensor(m.iterator, cute.select(m.layout, mode=[1, 0]))




# ---------------------------------------------------------------- compile and launch
def compile_fused_backward_core(clamp: bool, scatter: bool = False, init: bool = False, gather: bool = False,
                                by_route: bool = False, *, arch: str = "sm_90a", inspect: bool = False):
    """Compile one variant with symbolic M, T, T*k, H, I, E (``scatter``: dx rows to their slots
    and the dx slot sum in the launch, ``init``: from the shared expert's dx; ``gather``: the
    routed dy rows, d topk_w and x rows in the launch too, ``by_route``: the forward's GEMM2 rows
    in route order); returns ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 fused backward needs arch sm_90a, got {arch!r}")
    if init and not scatter:
        raise ValueError("init (the shared expert's dx) needs scatter")
    op = FusedMoeBwdCoreSm90(clamp, scatter, gather, by_route)
    bf = cutlass.BFloat16
    m, e, t, tk = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hid, inter = cute.sym_int(divisibility=_VEC), cute.sym_int(divisibility=_VEC)

    def vec(dtype, n=None):
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int() if n is None else n,), stride=(1,),
                                             assumed_align=4)

    args = (_fake_2d(bf, m, hid), _fake_2d(bf, m, hid), _fake_3d(bf, m, cute.sym_int(), inter), _fake_2d(bf, m, inter),
            _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter),
            _fake_2d(bf, m, cute.sym_int(divisibility=_VEC)), _fake_2d(bf, m, inter), _fake_2d(bf, m, inter),
            _fake_3d(bf, m, cute.sym_int(), inter), None if scatter else _fake_2d(bf, m, hid),
            _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter), vec(Int32),
            vec(Int32), vec(Int32))
    tail = (None,) * 5
    if scatter:
        tail = (_fake_2d(bf, tk, hid), vec(Int32), vec(Int32, tk), _fake_2d(bf, t, hid) if init else None,
                _fake_2d(bf, t, hid))
    rows = (None,) * 6
    if gather:
        rows = (_fake_2d(bf, t, hid), _fake_2d(bf, t, hid), _fake_2d(bf, cute.sym_int(), hid), vec(Float32, tk),
                vec(Float32, tk), vec(Int32))
    return compile_kernel(op, *args, *tail, *rows, Int32(1), Int32(1), Float32(0.0), Int32(1), Int64(1),
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


_WAITS = {D2_READY: "dgrad2 tiles of m-tile", D1_DONE: "dgrad1 tiles, target", ROWS_READY: "routed rows of m-tile"}
describe = persistent.describer("fused backward", _WAITS)  # the status words, read by the host later


def fused_backward_core(dy, x, gu, h, offsets, w_gate, w_up, w_down, limit, timeout_s: float = 30.0,
                        num_ctas: int | None = None, tokens=None):
    """The routed backward in one launch (module doc) on operands the unfused path accepts
    (``expert_bwd``: dy, x [M, H], gu [M, 2I], h [M, I] bf16 contiguous; weights with unit last
    stride; I, H multiples of 256; offsets int32 [E+1] on the device). Returns ``(dx [M, H],
    dWg, dWu [E, I, H], dWd [E, H, I])``, bitwise the unfused ``mlp_backward``'s.

    ``tokens`` = ``(order, topk_idx, dx_shared)``: the dx rows go straight to their (token,
    slot) rows and the launch ends with the fixed-order slot sum, so dx is [T, H], bitwise the
    unfused ``slot_sum(fp32(dx_shared) or 0, scattered rows, topk_idx)``; ``order`` [M] (grouped
    row -> t*k + j), ``topk_idx`` [T, k] (-1: no expert), ``dx_shared`` [T, H] bf16 or None.
    Errors of the device waits are raised by a later call (:mod:`mok_cute.dsl.deferred`)."""
    m = dy.shape[0]
    if tokens is None:
        return _launch(dy, x, gu, h, offsets, (w_gate, w_up, w_down), limit, timeout_s, num_ctas, None, None)
    order, topk_idx, dxs = tokens
    return _launch(dy, x, gu, h, offsets, (w_gate, w_up, w_down), limit, timeout_s, num_ctas,
                   (order[:m].to(torch.int32), topk_idx, dxs), None)


def fused_backward(dy, x, r_rows, order, topk_w, topk_idx, offsets, gu, h, w_gate, w_up, w_down, limit, dx_shared,
                   rows_by_route: bool, comm_ctas: int = 16, timeout_s: float = 30.0, num_ctas: int | None = None):
    """The routed backward from the layer's tokens in one launch: :func:`fused_backward_core` with
    ``tokens`` and, in its first ``comm_ctas`` CTAs, the work of ``route_grad.dy_rows_and_dtopk_w``
    and of gathering x's rows (bitwise theirs). dy, x [T, H] bf16; r_rows [T*k, H] (the forward's
    GEMM2 rows, expert-grouped or, ``rows_by_route``, in route order); order [T*k] (grouped row ->
    t*k + j, routes without an expert last); topk_w fp32, topk_idx [T, k]; offsets int32 [E+1];
    gu [T*k, 2I], h [T*k, I]. Returns ``(dx [T, H], d topk_w [T, k] fp32, dWg, dWu, dWd)``."""
    t, k = topk_idx.shape
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dy_rows = torch.empty((t * k, dy.shape[1]), **bf)
    x_rows = torch.empty((t * k, dy.shape[1]), **bf)
    dtw = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    gather = (dy, x, r_rows, topk_w.reshape(-1), dtw.view(-1), rows_by_route, comm_ctas)
    out = _launch(dy_rows, x_rows, gu, h, offsets, (w_gate, w_up, w_down), limit, timeout_s, num_ctas,
                  (order.to(torch.int32), topk_idx, dx_shared), gather)
    return (out[0], dtw, *out[1:])


def _launch(dy, x, gu, h, offsets, weights, limit, timeout_s, num_ctas, tokens, gather):
    """One launch of the variant the arguments ask for (see the two entries above)."""
    w_gate, w_up, w_down = weights
    m, hid = dy.shape
    e, inter = w_gate.shape[0], w_gate.shape[1]
    dev, arch = device_arch(dy.device)
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dwg = torch.empty((e, inter, hid), **bf)
    dwu = torch.empty((e, inter, hid), **bf)
    dwd = torch.empty((e, hid, inter), **bf)
    slot_args, row_args, k, comm = (None,) * 5, (None,) * 6, 1, 1
    if tokens is None:
        dx = torch.empty((m, hid), **bf)
    else:
        order32, topk_idx, dxs = tokens
        t, k = topk_idx.shape
        dx = torch.empty((t, hid), **bf)
        slot_args = (torch.empty((t * k, hid), **bf), order32, topk_idx.reshape(-1).to(torch.int32), dxs, dx)
    mt_cap = m // 128 + e + 1  # routed m-tiles: at most one partial per expert
    counters = torch.zeros(2 * mt_cap + COUNTER_WORDS, dtype=torch.int32, device=dy.device)
    d2, gdy, words = counters[:mt_cap], counters[mt_cap:2 * mt_cap], counters[2 * mt_cap:]
    if gather is not None:
        dy_tok, x_tok, r_rows, w_flat, dtw_flat, by_route, comm = gather
        row_args = (dy_tok, x_tok, r_rows, w_flat, dtw_flat, gdy)
    if m == 0:  # no rows: no tile reads anything, every weight gradient is zero
        if tokens is not None:
            dx.copy_(tokens[2]) if tokens[2] is not None else dx.zero_()
        if gather is not None:
            gather[4].zero_()
        return dx, dwg.zero_(), dwu.zero_(), dwd.zero_()
    dgu = torch.empty((m, 2 * inter), **bf)
    variant = (limit is not None, tokens is not None, tokens is not None and tokens[2] is not None,
               gather is not None, gather is not None and gather[5])
    launcher = compile_cached(("sm90_fused_moe_bwd_core", arch) + variant, lambda: GraphLauncher(
        compile_fused_backward_core(*variant, arch=arch)[0]))
    num_ctas = sm_count(dev) if num_ctas is None else num_ctas
    comm = max(1, min(int(comm), num_ctas - 1))  # a GEMM CTA must remain to run the tiles that wait on them
    tensors = (dy, x, gu[:m].view(m, 2, inter), h[:m], w_gate, w_up, w_down, dgu, dgu[:, :inter], dgu[:, inter:],
               dgu.view(m, 2, inter), None if tokens is not None else dx, dwg, dwu, dwd, offsets, d2, words,
               *slot_args, *row_args)
    lim, timeout_ns = 0.0 if limit is None else float(limit), int(timeout_s * 1e9)
    key = tuple(None if a is None else tensor_key(a) for a in tensors) + (k, comm, lim, num_ctas, timeout_ns)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda st: (
        *(None if a is None else _Desc(a) for a in tensors), Int32(k), Int32(comm), Float32(lim), Int32(num_ctas),
        Int64(timeout_ns), st))
    deferred.watch(words[1:1 + P.STATUS_WORDS], describe)
    return dx, dwg, dwu, dwd

"""The fused routed MoE backward core on Blackwell (sm_100a / sm_103a), BF16 or MXFP8, EP = 1 (and the whole
BF16 backward at EP > 1): one persistent launch.

The SM100 counterpart of the core of :mod:`mok_cute.kernels.sm90.fused_bwd` and of its ``tokens``
variant (no gather, no shared group), with its task list, counters and numerics, on the
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

MXFP8 (``mx``, the tiles of ``MXFP8_CONFIG``: 128 x 256 x 128, ``kind::mxf8f6f4.block_scale``):
every GEMM operand is e4m3 with E8M0 scales in the blocked layouts of
:mod:`~mok_cute.kernels.sm100.layouts`, the operands ``layers.sm100.mx_backward`` hands the unfused
MXFP8 GEMMs, so every tile is bitwise theirs: D2 reads dy quantized along H and w_down along H,
D1 dgu quantized along I and w_gate / w_up along I, the weight gradients dy, h, x and dgu quantized
along tokens (blocks of 32 from each expert's first row). The host quantizes dy, x, h (the unfused
quantizers); D2's dSwiGLU epilogue writes dgu's two quantizations instead of bf16 dgu (the
quantizers' ops: :meth:`~mok_cute.kernels.sm100.grouped_gemm.GroupedGemmSm100._store_dgu_mx`).
The weights come quantized from the caller (``layers.sm100.quantize_weight(w, 1)``).

``cta_group::2`` (``tile_m`` 256, ``Sm100Launch.tile_m``: ``MoKConfig.tile_m=256``): as in the fused
forward, every task is a 256-row tile run by a CTA pair (the leader claims it for both through the
pair's task ring and issues its MMAs; each CTA loads its halves and stores its 128 rows, of dW's rows
in W), the comm CTAs' chunks are 256-row m-tiles, and both CTAs publish each tile, so every readiness
target above counts each tile twice. MXFP8 scale atom rows of a 256-row tile may start odd: SFA is
offset by atom rows before tiling.

EP > 1 (``ep``, with gather, :func:`fused_backward_ep`): the SM90 ep variant's protocol
(:class:`~mok_cute.comm.peer_rows.PeerRows`). ``order`` holds packed sources ``p*T*k + t*k + j``
(the device plan's ``recv_src``); the comm CTAs pull each grouped row's dy (times its router weight
``w_rows[p]``) and x from rank p's ``dy`` / ``src`` sections between READY and DONE, then make d
topk_w of this rank's routes from its slot rows (0 for -1 slots); the epilogue waits FREE of the
previous push epoch, D1 pushes each row into rank p's ``slots[t*k + j]`` (a system-scope fence
before the tile is counted); the slot sum waits DATA from every rank and the last CTA to finish
says FREE. Every wait's error goes to the workspace's status.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from mok_cute.comm import protocol as P
from mok_cute.comm.peer_rows import PeerRows, PeerSections
from mok_cute.dsl import deferred
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import _check_limit, _check_tensor, sm_count
from mok_cute.dsl.launch import GraphLauncher
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels.operands import ExpertWeights, RoutePlan
from mok_cute.kernels.sm90 import persistent
from mok_cute.kernels.sm90.expert_bwd import _expert_k
from mok_cute.kernels import slot_rows
from mok_cute.kernels.route_grad_row import CommCta, EpPull, GatherRows, RowWalk, gather_chunks
from mok_cute.kernels.sm90.fused_bwd import (
    _NO_EP, D1_DONE, D2_READY, EP_SECTIONS, ROWS_READY, SUM_BATCH, X_UNROLL, _split, describe, grouped_rows,
)
from mok_cute.kernels.sm100.fused_moe import (
    _BULK_PTX, _PAIR_PTX, PUSH_FIELD, Sm100Launch, _check_launch, check_push_fits, check_tile_m, pair_grid,
    push_routed, push_routed_bulk, push_staging, store_routed, tile_config,
)
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.kernels.sm100.bundles import (
    BwdGather, BwdGroup, BwdMx, BwdPeer, BwdScalars, BwdTokens, GatherPass, launch_bundles, present,
)
from mok_cute.kernels.sm100.grouped_gemm import (
    ARCHS, MXFP8_CONFIG, GroupedGemmSm100, _check_gate_up_scales, _check_scales, _check_weight, _fake_sf,
)
from mok_cute.kernels.sm100 import task_ring
from mok_cute.kernels.sm100.mx_gather import quantize_tile
from mok_cute.kernels.swiglu_math import Gated, swiglu_args
from mok_cute.kernels.sm100.mainloop import (
    EPI_THREADS, MMA_WARP, MN_MAJOR, NUM_THREADS, SF_DTYPE, TMA_WARP, AccChunks, Sm100Config, epi_barrier,
)
from mok_cute.schedule import fused_bwd_tasks as tasks
from mok_cute.schedule.fused_bwd_tasks import D1, D2, WD, WG
from mok_cute.schedule.fused_tasks import routed_mtiles

CONFIG = Sm100Config()  # 128 x 256 x 64 BF16, cta_group::1: the unfused SM100 GEMMs' tiles
MX_CONFIG = MXFP8_CONFIG  # 128 x 256 x 128 MXFP8: the unfused SM100 MXFP8 GEMMs' tiles
DIM_MULTIPLE = 64  # H, I
WORDS = 1 + P.STATUS_WORDS  # the ticket, then the status words
DONE_WORD = WORDS  # tokens variant: a last word, the stored D1 tiles (the slot sum's wait)
PULLED_WORD, SUMMED_WORD = DONE_WORD + 1, DONE_WORD + 2  # EP > 1: comm CTAs done pulling, CTAs done summing
_VEC = 8  # bf16 elements per 16-byte vector
_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class BwdVariant:
    """What changes the fused backward's generated code (with the arch, its compile cache key).

    ``clamp``: SwiGLU limit given; ``tokens``: D1 rows to their (token, slot) rows and the dx slot sum
    in the launch, starting from fp32(``init``) (else 0) plus, with ``add``, an fp32 [T, H] term;
    ``mx``: MXFP8 tiles; ``gather``: the routed dy rows, d topk_w and x rows built in the launch by
    its first ``comm_ctas`` CTAs (``by_route``: the forward's GEMM2 rows in route order); ``shared``:
    the shared expert's tiles as a second group, its dx the slot sum's ``init``; ``ep``: EP > 1;
    ``accumulate``: the weight-gradient tiles added into fp32 main grads (``main += fp32(bf16(dW))``,
    Megatron's gradient-accumulation fusion) instead of written as bf16, the whole backward's
    (``gather``); ``grouped_slots`` (MXFP8 tokens, no gather): the D1 rows stay in grouped order over
    the caller's bf16 dy (which no MXFP8 tile reads) and the slot sum reads slot (t, j) at row
    ``order[t*k + j]`` (the inverse order, ``sm90.fused_bwd.grouped_rows``); ``tile_m`` 128 or 256
    (``cta_group::2`` tiles run by CTA pairs); ``bulk_push`` (needs ``ep``): D1's rows into the peers
    by ``cp.async.bulk``; ``gated``: the SwiGLU's alpha and up offset (None: silu(g) * u;
    :mod:`mok_cute.kernels.swiglu_math`)."""

    clamp: bool
    tokens: bool = False
    init: bool = False
    add: bool = False
    mx: bool = False
    gather: bool = False
    by_route: bool = False
    shared: bool = False
    ep: bool = False
    accumulate: bool = False
    grouped_slots: bool = False
    tile_m: int = 128
    bulk_push: bool = False
    gated: Gated | None = None

    def __post_init__(self):
        if (self.init or self.add) and not self.tokens:
            raise ValueError("init / add (terms of the dx slot sum's start) need tokens")
        if (self.gather and not self.tokens) or (self.by_route and not self.gather) or \
                (self.shared and not (self.gather and self.init)):
            raise ValueError("gather needs tokens, by_route needs gather, shared needs gather and init (its dx)")
        if self.mx and self.shared:
            raise ValueError("mx (the MXFP8 backward) runs the routed experts only: the shared expert's tiles are "
                             "not in its launch")
        if self.ep and not (self.gather and not self.by_route):
            raise ValueError("ep (EP > 1) moves the rows in the launch: it needs gather, not by_route")
        if self.accumulate and not self.gather:
            raise ValueError("accumulate (main grads) is the whole backward's: it needs gather")
        if self.grouped_slots and not (self.mx and self.tokens and not self.gather):
            raise ValueError("grouped_slots (the dx rows in grouped order over dy) needs mx and tokens without gather")
        check_tile_m(self.tile_m)
        if self.bulk_push and not self.ep:
            raise ValueError("bulk_push (D1's rows by cp.async.bulk into the peers) needs ep (EP > 1)")


class FusedMoeBwdSm100:
    """The persistent routed backward core of variant ``v`` (:class:`BwdVariant`; see the module doc).
    ``__call__`` takes the bundles of :mod:`~mok_cute.kernels.sm100.bundles`: :class:`BwdPeer` holds
    the EP > 1 operands (ignored at EP = 1); with ``accumulate`` the weight gradients of both groups
    (``dwg`` .. ``dwd``) are the fp32 main grads."""

    def __init__(self, v: BwdVariant):
        clamp, tokens, init, add, mx, gather, by_route, shared, ep, accumulate, grouped_slots, tile_m, bulk_push = (
            v.clamp, v.tokens, v.init, v.add, v.mx, v.gather, v.by_route, v.shared, v.ep, v.accumulate,
            v.grouped_slots, v.tile_m, v.bulk_push)
        self.variant = v
        self.grouped_slots, self.bulk_push = grouped_slots, bulk_push
        cfg = tile_config(mx, tile_m, bulk_push)
        self.cg = cfg.cta_group  # CTAs per tile: each publishes it (readiness targets count tiles cg times)
        self.cfg, self.clamp, self.tokens, self.init, self.add, self.mx = cfg, clamp, tokens, init, add, mx
        self.gather, self.by_route, self.shared, self.ep, self.accumulate = gather, by_route, shared, ep, accumulate
        self.per = 4 if mx else 2  # TMA descriptors per GEMM operand set: A, B[, SFA, SFB]
        self.dswiglu = GroupedGemmSm100(cfg, "dswiglu", clamp, MN_MAJOR, gated=v.gated)  # D2
        self.dgrad1 = GroupedGemmSm100(cfg, "plain", b_major=MN_MAJOR, split_k=True)  # D1
        self.wgrad = GroupedGemmSm100(cfg, wgrad=True)  # W
        self.ml_d, self.ml_w = self.dswiglu.mainloop, self.wgrad.mainloop  # (K, MN) and (MN, MN) majors
        assert self.dgrad1.mainloop.stages == self.ml_d.stages == self.ml_w.stages
        if bulk_push:
            check_push_fits(self.ml_d)

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
            "sA": cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, a_n], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, b_n], 1024],
        }
        if cutlass.const_expr(self.mx):
            for name, sd, sw in (("sSFA", md.sfa_smem, mw.sfa_smem), ("sSFB", md.sfb_smem, mw.sfb_smem)):
                fields[name] = cute.struct.Align[cute.struct.MemRange[SF_DTYPE, max(cute.cosize(sd), cute.cosize(sw))],
                                                 1024]
        if cutlass.const_expr(self.bulk_push):  # push_routed_bulk's staging rows
            fields["sPush"] = PUSH_FIELD
        return cute.struct(type("FusedBwdStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, routed: BwdGroup, toks: BwdTokens, mx: BwdMx, gather: BwdGather, shared: BwdGroup,
                 scalars: BwdScalars, peer: BwdPeer, stream: cuda.CUstream):
        """Launch on ``stream`` (the bundles of :mod:`~mok_cute.kernels.sm100.bundles`; the kernel gets
        them less what only this host side reads: the TMA atoms' operands, the grid size, and at EP = 1
        no ``peer``). Below, ``mX`` names a field of a bundle as the flat kernel parameter it was.

        Tokens variant (``toks``): ``mDx`` (routed.dx) is the slot rows [T*k, H] (rows of -1 slots
        untouched), ``mOrder`` int32 [M] (grouped row -> t*k + j), ``mIdx`` int32 [T*k] (-1: no expert), ``mInit`` bf16
        [T, H] or None, ``mAdd`` fp32 [T, H] or None, ``mOut`` the dx [T, H]; ``mWords`` then holds
        the done word too (``grouped_slots``: ``mDx`` the caller's dy [M, H], D1 rows in grouped order,
        ``mOrder`` [T*k] t*k + j -> its grouped row). Otherwise those five are None and ``mDx`` is dx
        [M, H].

        MXFP8 (``mx``; else the eleven ``m*sf`` / ``mDyt`` / ``mDgut`` are None): ``mDy`` is dy
        quantized along H, ``mX`` / ``mH`` / ``mDyt`` x, h, dy quantized along tokens (token rows),
        ``mDgu`` / ``mDgut`` dgu quantized along I / along tokens (written by D2), the weights e4m3;
        the flat uint8 blocked scales: ``mDysf`` (dy rows), ``mWdsf`` / ``mWgusf`` (w_down /
        [w_gate; w_up] along K), ``mDgusf`` (dgu rows, halves padded to whole atoms), ``mDytsf``,
        ``mHtsf``, ``mXtsf``, ``mDgtsf``, ``mDutsf`` (token scales of dy, h, x, dg, du).

        Gather (else the six None, ``comm_ctas`` unread): ``mDy`` / ``mX`` [M, H] are written by the
        comm CTAs from ``mDyTok`` / ``mXTok`` [T, H] and ``mR`` (the forward's GEMM2 rows: grouped
        [M, H], ``by_route``: [T*k, H] in route order), ``mW`` / ``mDtw`` fp32 [T*k] (topk_w in,
        d topk_w out), routed m-tile c published on ``mGdy[c]`` int32 (1: dy rows, 2: x rows too);
        ``mOrder`` then holds all T*k routes (routes without an expert last). With ``mx`` the gathered
        rows go to the bf16 ``mDyRows`` / ``mXRows`` [M, H] (else None) and the comm CTAs quantize each
        m-tile into ``mDy``, ``mDysf``, ``mDyt``, ``mDytsf``, ``mX`` and ``mXtsf`` before publishing it
        (:func:`~mok_cute.kernels.sm100.mx_gather.quantize_tile`; the scale buffers zeroed by the
        caller); ``mH`` / ``mHtsf`` are h's along the tokens, as without the gather. Shared (else the
        eleven ``mS*`` None): the shared expert's gu [T, 2, I_s], h [T, I_s], weights [1, I_s, H] x 2,
        [1, H, I_s], dgu scratch [T, 2, I_s], dW [1, ...], offsets [0, T] and dgrad2 counters; its dy
        / x are ``mDyTok`` / ``mXTok``, its dx goes to ``mInit``.

        EP > 1 (``ep``; else None / ignored): ``mPeer`` int64 [R] (the workspaces' bases), ``mStatus``
        int32 [4] (the workspace's status, every wait's error), rank ``me`` of ``n_ranks``, the
        sections' offsets (``src``: x, ``dy``, ``slots``, ``flags``) and the launch's pull and push
        epochs; ``mOrder`` [M] packed ``p*T*k + t*k + j``, ``mW`` fp32 [M] each grouped row's router
        weight, ``mR`` [T*k, H] this rank's slot rows of the forward, ``mDx`` the workspace's slot
        section; ``mWords`` then holds the pull and sum arrival words too."""
        # absent bundles arrive as None (bundles.present): their empty bundles
        toks, mx = BwdTokens() if toks is None else toks, BwdMx() if mx is None else mx
        gather, shared = BwdGather() if gather is None else gather, BwdGroup() if shared is None else shared
        md, mw = self.ml_d, self.ml_w
        md.setup()
        mw.setup()
        tmas = self._tma(routed, routed.offsets.shape[0] - 1, mx)
        s_t = g_t = None
        if cutlass.const_expr(self.shared):
            tmas = tmas + self._tma(shared._replace(dy=gather.dy_tok, x=gather.x_tok), shared.offsets.shape[0] - 1,
                                    BwdMx())
            s_t = shared._replace(dy=None, x=None, h=None, w_gate=None, w_up=None, w_down=None, dx=toks.init)
        if cutlass.const_expr(self.gather):
            g_t = GatherPass(*gather[:6], routed.dy, routed.x, scalars.comm_ctas, None)
            if cutlass.const_expr(self.mx):  # the bf16 rows, then their MXFP8 operands
                g_t = GatherPass(*gather, scalars.comm_ctas,
                                 (routed.dy, mx.dy_sf, mx.dy_t, mx.dy_tsf, routed.x, mx.x_tsf))
        self.shared_storage = self._storage()
        self.kernel([t[0] for t in tmas], [t[1] for t in tmas],
                    routed._replace(dy=None, x=None, h=None, w_gate=None, w_up=None, w_down=None), toks,
                    mx._replace(dy_sf=None, wd_sf=None, wgu_sf=None, dy_t=None, dy_tsf=None, h_tsf=None, x_tsf=None),
                    scalars._replace(comm_ctas=None, num_ctas=None), s_t, g_t,
                    peer if cutlass.const_expr(self.ep) else None).launch(
            grid=[scalars.num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[self.cg, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    def _tma(self, g: BwdGroup, e, mx_ops: BwdMx):
        """Group ``g``'s TMA (atom, coordinates) pairs (p = self.per: A, B[, SFA, SFB]): D2 (dy,
        w_down) from 0, D1 (dg, w_gate) from p and its second part (du, w_up) at 2p, dWd (dy, h) from
        2p + 2, dWg (dg, x) from 3p + 2, dWu's du [and its scales] from 4p + 2 (its x operands:
        dWg's); ``e`` experts, ``mx_ops``: the MXFP8 tensors (None each for BF16)."""
        md, mw = self.ml_d, self.ml_w
        mDy, mX, mH, mWg, mWu, mWd, mDgu = g.dy, g.x, g.h, g.w_gate, g.w_up, g.w_down, g.dgu
        mDysf, mWdsf, mDgusf, mWgusf, mDyt, mDytsf, mHtsf, mDgut, mDgtsf, mDutsf, mXtsf = mx_ops
        dgt = mDgut if cutlass.const_expr(self.mx) else mDgu  # the wgrads' dg / du (MXFP8: along tokens)
        dg, du = dgt[(None, 0, None)], dgt[(None, 1, None)]
        dyt = mDyt if cutlass.const_expr(self.mx) else mDy
        d2 = self.dswiglu._views(mDy, mWd, mDysf, mWdsf, e)
        d1 = self.dgrad1._views(mDgu, mWg, mDgusf, mWgusf, e)
        d1_b2 = cute.make_tensor(mWu.iterator, cute.select(mWu.layout, mode=[2, 1, 0]))
        wd = self.wgrad._views(dyt, mH, mDytsf, mHtsf, e)
        wg = self.wgrad._views(dg, mX, mDgtsf, mXtsf, e)
        wu = self.wgrad._views(du, mX, mDutsf, mXtsf, e)
        d1_a2 = mDgu[(None, 1, None)] if cutlass.const_expr(self.mx) else du
        tmas = md.make_tma(*d2) + md.make_tma(*d1, mA2=GroupedGemmSm100._rows(d1_a2), mB2=d1_b2) \
            + mw.make_tma(*wd) + mw.make_tma(*wg)
        wu_tma = mw.make_tma(*wu)
        return tmas + wu_tma[:1] + wu_tma[2:3]

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, atoms: list, coords: list, routed_t: BwdGroup, toks: BwdTokens, mx: BwdMx, scalars: BwdScalars,
               s_t: BwdGroup, g_t: GatherPass, peer: BwdPeer):
        mDx, mWords = routed_t.dx, routed_t.words
        mOrder, mIdx, mInit, mAdd, mOut = toks
        k, _, limit, _, timeout_ns = scalars
        cfg, md, mw = self.cfg, self.ml_d, self.ml_w
        md.setup()
        mw.setup()
        warp, tidx, storage, pipes = task_ring.kernel_start(md, atoms, self.shared_storage)
        smem = md.smem_tensors(storage) + mw.smem_tensors(storage)  # sA, sB, sSFA, sSFB of each (SF: MXFP8)
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cg, 1))
        cta_v = cute.arch.block_idx()[0] % self.cg  # this CTA's half of a cta_group::2 tile (0: the leader)

        n_r = len(atoms) // 2 if cutlass.const_expr(self.shared) else len(atoms)  # the routed group's atoms
        routed = _Group(cfg, atoms[:n_r], coords[:n_r], routed_t, self.gather, self.tokens)
        shared = None
        n_tasks, n_done = routed.dims[0], routed.n_d1  # the tasks, the D1 tiles the slot sum waits for
        if cutlass.const_expr(self.shared):
            shared = _Group(cfg, atoms[n_r:], coords[n_r:], s_t, False, False)
            n_tasks, n_done = n_tasks + shared.dims[0], n_done + shared.n_d1
        ep = ep_dy = None  # EP > 1: the workspace's x rows (``src``) and dy rows as pull sources
        if cutlass.const_expr(self.ep):
            mPeer, mStatus, me, n_ranks, src_off, dy_off, slots_off, flags_off, epoch_pull, epoch_push = peer
            status = mStatus.iterator  # every wait's error: the workspace's status
            ep = PeerRows(mPeer, g_t[3], me, n_ranks, PeerSections(src_off, slots_off, Int64(0), flags_off),
                          epoch_pull, epoch_push, mIdx.shape[0], timeout_ns, status)
            ep_dy = PeerRows(mPeer, g_t[3], me, n_ranks, PeerSections(dy_off, slots_off, Int64(0), flags_off),
                             epoch_pull, epoch_push, mIdx.shape[0], timeout_ns, status)
        gdy = None
        if cutlass.const_expr(self.gather):
            gdy = g_t[5]
            bidx, _, _ = cute.arch.block_idx()
            if bidx < g_t[8]:  # a comm CTA: first the routed rows, then GEMM tasks like every CTA
                self._gather(tidx, bidx, routed, mOrder, mIdx, k, g_t, ep, ep_dy, mWords.iterator)
                cute.arch.barrier()

        if warp == TMA_WARP:
            self._produce(pipes, smem, routed, shared, mWords.iterator, n_tasks, gdy,
                          mWords.iterator + 1 if ep is None else ep.status, timeout_ns, cta_v)
        if warp == MMA_WARP:
            if cta_v == 0:  # cta_group::2: the leader issues the pair's MMAs
                self._mma(pipes, smem, routed, shared, n_tasks)
        if warp < MMA_WARP:
            sPush = push_staging(storage) if cutlass.const_expr(self.bulk_push) else None
            self._epilogue(pipes, tidx, routed, shared, n_tasks, limit, mOrder, mWords.iterator + DONE_WORD,
                           (mx.dgu_sf, mx.dgu_t, mx.dg_tsf, mx.du_tsf), ep, cta_v, sPush)
        if cutlass.const_expr(self.tokens):  # every CTA: the dx slot sum, once every D1 tile is stored
            cute.arch.barrier()
            if tidx == 0:
                P.wait_geq(mWords.iterator + DONE_WORD, task_ring.tile_target(n_done, self.cg), timeout_ns,
                           mWords.iterator + 1 if ep is None else ep.status, Int32(0), Int32(D1_DONE))
                if cutlass.const_expr(self.ep):  # every rank's dx rows are in my slot buffer (DATA)
                    ep.wait_rows(cute.arch.block_idx()[0])
            cute.arch.barrier()
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            buf = storage.sB.data_ptr()
            if cutlass.const_expr(self.mx):
                buf = cute.recast_ptr(buf, dtype=cutlass.BFloat16)
            sbuf = cute.make_tensor(buf, cute.make_layout((SUM_BATCH * NUM_THREADS, _VEC), stride=(_VEC, 1)))
            sums = slot_rows.SlotSumOperands(mDx, mInit, mOut, mIdx, add=mAdd,
                                             row=mOrder if self.grouped_slots else None)
            slot_rows.slot_sum(tidx, bidx, grid, sums, k, mOut.shape[0], routed.hidden, sbuf, SUM_BATCH, NUM_THREADS)
            if cutlass.const_expr(self.ep):  # every CTA has read its slot rows: the last one says FREE
                ep.close_push(tidx, mWords.iterator + SUMMED_WORD, grid)
        task_ring.pair_exit(self.cg)

    @cute.jit
    def _decode(self, g, t: Int32, cur):
        """:func:`~mok_cute.schedule.fused_bwd_tasks.core_task` of group ``g``'s task ``t`` with the
        role's cursors ``cur``: ``(phase, expert, n_tile, m_tile, row0, rows, mt, which, cur)``."""
        n_d2, n_d1, n_i, n_h, wd_m, wgu_m = g.dims[1:7]
        phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = tasks.core_task(
            t, tasks.CoreDims(n_d2, n_d1, n_i, n_h, wd_m, n_i, wgu_m, n_h), g.offsets, g.num_experts, self.cfg.tile_m,
            cur)
        return phase, expert, n_tile, m_tile, row0, rows, mt, which, (e1, b1, e2, b2)

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _gather(self, tidx: Int32, bidx: Int32, g, mOrder: cute.Tensor, mIdx: cute.Tensor, k: Int32, g_t: tuple,
                ep, ep_dy, counters: cute.Pointer):
        """Comm CTA ``bidx`` (gather variant): the routed rows group ``g``'s tiles read, routed m-tile
        c by CTA ``c % comm_ctas`` (:func:`~mok_cute.kernels.route_grad_row.gather_chunks`, the SM90
        kernel's: dy rows times topk_w and d topk_w, then x rows, each pass released on ``gdy[c]``;
        EP > 1: pulled from the source ranks through ``ep`` / ``ep_dy``, the last comm CTA arriving on
        ``counters + PULLED_WORD`` says DONE, d topk_w of this rank's routes; ``mx``: each m-tile
        quantized, :func:`~mok_cute.kernels.sm100.mx_gather.quantize_tile`)."""
        mDyTok, mXTok, mR, mW, mDtw, mGdy, mDyRows, mXRows, comm_ctas, mx_ops = g_t
        gather_chunks(CommCta(tidx, bidx, comm_ctas, NUM_THREADS),
                      RowWalk(g.mt, g.offsets, g.num_experts, mOrder, mIdx, k, g.hidden, self.cfg.tile_m),
                      GatherRows(mDyTok, mXTok, mR, mW, mDtw, mGdy, mDyRows, mXRows),
                      None if ep is None else EpPull(ep, ep_dy, counters, PULLED_WORD), None, X_UNROLL, self.by_route,
                      (quantize_tile, mx_ops) if self.mx else None)

    @cute.jit
    def _produce(self, pipes: task_ring.Pipes, views, routed, shared, ticket: cute.Pointer, n_tasks: Int32,
                 gdy: cute.Tensor, status: cute.Pointer, timeout_ns: Int64, cta_v: Int32):
        """TMA warp: claim tasks from the ticket (list order across the grid), hand each on, wait
        for its inputs, load its k-tiles; the first id >= n_tasks is handed on last (stop). With a
        shared group, list task t is ``fused_bwd90._split``'s (group, task). ``cta_group::2``: the
        leader claims for the pair, the peer takes its ids (:func:`task_ring.next_task`), each loads
        its halves (``cta_v``)."""
        ab_pipe, task_pipe, sTask = pipes.ab, pipes.task, pipes.sTask
        r_parts = self._parts(routed, views, cta_v)
        s_parts = self._parts(shared, views, cta_v) if cutlass.const_expr(self.shared) else None
        state = self.ml_d.producer_state()
        tstate = task_ring.producer_state()
        cur = (Int32(0), Int32(0), Int32(0), Int32(0))
        ready = (Int32(-1), Int32(-1))  # the last expert whose D2 tiles / gathered rows this CTA saw complete
        s_cur, s_ready = cur, ready
        t, tstate = task_ring.next_task(ticket, task_pipe, tstate, sTask, cta_v, self.cg == 2)
        while t < n_tasks:
            if cutlass.const_expr(self.shared):
                grp, lt = _split(t, shared, routed)
                if grp == 0:
                    *tile, s_cur = self._decode(shared, lt, s_cur)
                    state, s_ready = self._load(shared, s_parts, tile, ab_pipe, state, views, s_ready, gdy, status,
                                                timeout_ns, cta_v)
                else:
                    *tile, cur = self._decode(routed, lt, cur)
                    state, ready = self._load(routed, r_parts, tile, ab_pipe, state, views, ready, gdy, status,
                                              timeout_ns, cta_v)
            else:
                *tile, cur = self._decode(routed, t, cur)
                state, ready = self._load(routed, r_parts, tile, ab_pipe, state, views, ready, gdy, status, timeout_ns,
                                          cta_v)
            t, tstate = task_ring.next_task(ticket, task_pipe, tstate, sTask, cta_v, self.cg == 2)
        ab_pipe.producer_tail(state)

    def _parts(self, g, views, cta_v):
        """TMA warp, group ``g``: the B partitions over every (n-tile, k-tile, expert) of D2's
        w_down, D1's w_gate and w_up, and (MXFP8) D2's and D1's (SFA, SFB) partitions with their
        smem destinations: ``(sB, w_down, w_gate, w_up, sf, sf_dst)``."""
        cfg, md, p = self.cfg, self.ml_d, self.per
        atoms, coords = g.atoms, g.coords
        sB, sSFA, sSFB = views[1:4]
        tiler_a = (cfg.tile_m, cfg.tile_k)
        tiler_b = (cfg.tile_n, cfg.tile_k)
        every = (None, None, None)
        tBsB, tBgWd = md.partition_b(atoms[1], cute.local_tile(coords[1], tiler_b, every), sB, cta_v)
        _, tBgWg = md.partition_b(atoms[p + 1], cute.local_tile(coords[p + 1], tiler_b, every), sB, cta_v)
        _, tBgWu = md.partition_b(atoms[2 * p + 1], cute.local_tile(coords[2 * p + 1], tiler_b, every), sB, cta_v)
        sf = sf_dst = None
        if cutlass.const_expr(self.mx):
            sf = []
            for i in (2, p + 2):
                tAsSFA, tAgSFA = md.partition_a(atoms[i], cute.local_tile(coords[i], tiler_a, every), sSFA, cta_v)
                tBsSFB, tBgSFB = md.partition_sfb(atoms[i + 1], cute.local_tile(coords[i + 1], tiler_b, every), sSFB,
                                                  cta_v)
                sf.append((tAgSFA, tBgSFB))
            sf_dst = (tAsSFA, tBsSFB)
        return tBsB, tBgWd, tBgWg, tBgWu, sf, sf_dst

    @cute.jit
    def _load(self, g, parts, tile, ab_pipe, state, views, ready, gdy: cute.Tensor, status: cute.Pointer,
              timeout_ns: Int64, cta_v: Int32):
        """TMA warp, group ``g``'s task (``tile``: :meth:`_decode`'s): wait for its inputs (D1: ``d2[mt]``; dWg / dWu: every
        D2 tile of the expert; gather: D2 its m-tile's dy rows, W the expert's dy and x rows), load its
        k-tiles. ``ready``: the last experts whose D2 tiles / gathered
        rows this CTA saw complete (their tickets only grow); returns ``(state, ready)``. ``cta_v``: this
        CTA's halves of a ``cta_group::2`` tile."""
        cfg, p = self.cfg, self.per
        atoms, coords = g.atoms, g.coords
        sA = views[0]
        n_i, k_h, k_i = g.dims[3], g.dims[8], g.dims[9]
        tBsB, tBgWd, tBgWg, tBgWu, sf, sf_dst = parts
        tiler_a = (cfg.tile_m, cfg.tile_k)
        masks = self.ml_d.mcast_masks(cta_v)[:p]
        ready_e, ready_g = ready
        phase, expert, n_tile, m_tile, row0, _, mt, which = tile
        if phase == D2:
            if cutlass.const_expr(g.gather):
                persistent.wait_input(gdy.iterator + mt, Int32(1), timeout_ns, status, Int32(ROWS_READY), mt)
            gA = cute.local_tile(cute.domain_offset((row0, 0), coords[0][(None, None, 0)]), tiler_a, (0, None))
            tAsA, tAgA = self.ml_d.partition_a(atoms[0], gA, sA, cta_v)
            srcs, dsts = (tAgA, tBgWd[(None, n_tile, None, expert)]), (tAsA, tBsB)
            if cutlass.const_expr(self.mx):
                srcs = srcs + self._sf_tile(sf[0], g.offsets, expert, m_tile, n_tile, atoms[2], coords[2], views[2],
                                            cta_v)
                dsts = dsts + sf_dst
            state = self.ml_d.load_tile(ab_pipe, state, atoms[0:p], srcs, dsts, k_h, Int32(0), masks)
        elif phase == D1:
            persistent.wait_input(g.d2.iterator + mt, task_ring.tile_target(n_i, self.cg), timeout_ns, status,
                                  Int32(D2_READY), mt)
            gA = cute.local_tile(cute.domain_offset((row0, 0), coords[p][(None, None, 0)]), tiler_a, (0, None))
            gA2 = cute.local_tile(cute.domain_offset((row0, 0), coords[2 * p][(None, None, 0)]), tiler_a,
                                  (0, None))
            tAsA, tAgA = self.ml_d.partition_a(atoms[p], gA, sA, cta_v)
            _, tAgA2 = self.ml_d.partition_a(atoms[2 * p], gA2, sA, cta_v)
            part2 = (atoms[2 * p:2 * p + 2], (tAgA2, tBgWu[(None, n_tile, None, expert)]), k_i)
            srcs, dsts = (tAgA, tBgWg[(None, n_tile, None, expert)]), (tAsA, tBsB)
            if cutlass.const_expr(self.mx):
                srcs = srcs + self._sf_tile(sf[1], g.offsets, expert, m_tile, n_tile, atoms[p + 2], coords[p + 2],
                                            views[2], cta_v)
                dsts = dsts + sf_dst
            state = self.ml_d.load_tile(ab_pipe, state, atoms[p:2 * p], srcs, dsts, 2 * k_i, Int32(0), masks,
                                        part2)
        else:
            lo = g.offsets[expert]
            length = g.offsets[expert + 1] - lo
            kt = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
            if cutlass.const_expr(g.gather):
                if expert != ready_g:  # the expert's dy and x rows, once per expert and CTA
                    first, count = tasks.expert_mtile_range(g.offsets, expert, cfg.tile_m)
                    for m in cutlass.range(count, unroll=1):
                        persistent.wait_input(gdy.iterator + first + m, Int32(2), timeout_ns, status,
                                              Int32(ROWS_READY), first + m)
                    ready_g = expert
            w0 = 2 * p + 2  # dWd's atoms, then dWg's, dWu's
            if which == WD:
                state = self._load_w(ab_pipe, state, (atoms, coords, views[4:]), (w0, w0 + 1, w0 + 2, w0 + 3),
                                     (lo, length), (m_tile, n_tile, kt, expert), cta_v)
            else:
                if expert != ready_e:  # once per expert and CTA: its tickets only grow
                    first, count = tasks.expert_mtile_range(g.offsets, expert, cfg.tile_m)
                    for m in cutlass.range(count, unroll=1):
                        persistent.wait_input(g.d2.iterator + first + m, task_ring.tile_target(n_i, self.cg),
                                              timeout_ns, status,
                                              Int32(D2_READY), first + m)
                    ready_e = expert
                wg = w0 + p
                if which == WG:
                    state = self._load_w(ab_pipe, state, (atoms, coords, views[4:]), (wg, wg + 1, wg + 2, wg + 3),
                                         (lo, length), (m_tile, n_tile, kt, expert), cta_v)
                else:
                    state = self._load_w(ab_pipe, state, (atoms, coords, views[4:]),
                                         (wg + p, wg + 1, wg + p + 1, wg + 3), (lo, length),
                                         (m_tile, n_tile, kt, expert), cta_v)
        return state, (ready_e, ready_g)

    @cute.jit
    def _sf_tile(self, sf, mOffsets: cute.Tensor, expert: Int32, m_tile: Int32, n_tile: Int32, atom_sfa, coord_sfa,
                 sSFA: cute.Tensor, cta_v: Int32):
        """MXFP8 D2 / D1 tile: its (SFA, SFB) k-tile sources, as the unfused grouped GEMM reads them
        (SFA from scale atom row ``o_e // 128 + e + m_tile * tile_m / 128``, SFB of the expert's
        n-tile); a 256-row tile may start at an odd atom row: SFA offset by atom rows, then tiled and
        partitioned for this CTA (``atom_sfa``, ``coord_sfa``, the staged ``sSFA``)."""
        if cutlass.const_expr(self.cg == 1):
            sf_row = mOffsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile
            return sf[0][(None, sf_row, None, 0)], sf[1][(None, n_tile, None, expert)]
        atom_row = mOffsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile * self.cg
        g_sf = cute.local_tile(cute.domain_offset((atom_row * lay.SF_ATOM_ROWS, 0), coord_sfa[(None, None, 0)]),
                               (self.cfg.tile_m, self.cfg.tile_k), (0, None))
        _, sfa = self.ml_d.partition_a(atom_sfa, g_sf, sSFA, cta_v)
        return sfa, sf[1][(None, n_tile, None, expert)]

    @cute.jit
    def _load_w(self, ab_pipe, state, tma: tuple, idx: tuple, rows: tuple, tile: tuple, cta_v: Int32):
        """TMA warp: the ``kt`` k-tiles of weight-gradient tile (m_tile, n_tile) of ``expert`` (``tile`` =
        (m_tile, n_tile, kt, expert)) over the expert's rows ``lo .. lo + length`` (``rows``; the unfused
        wgrad's ragged views; ``tma`` = (atoms, coords, smem); ``idx``: the atoms of A, B[, SFA, SFB],
        MXFP8: scale k-tiles from the expert's first, ``lo // 128 + e``); returns the state."""
        atoms, coords, smem = tma
        lo, length = rows
        m_tile, n_tile, kt, expert = tile
        cfg, mw = self.cfg, self.ml_w
        atom_a, atom_b = atoms[idx[0]], atoms[idx[1]]
        gA = cute.local_tile(_expert_k(coords[idx[0]], lo, length), (cfg.tile_m, cfg.tile_k), (m_tile, None))
        gB = cute.local_tile(_expert_k(coords[idx[1]], lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
        tAsA, tAgA = mw.partition_a(atom_a, gA, smem[0], cta_v)
        tBsB, tBgB = mw.partition_b(atom_b, gB, smem[1], cta_v)
        used, srcs, dsts, sf_k0 = [atom_a, atom_b], (tAgA, tBgB), (tAsA, tBsB), Int32(0)
        if cutlass.const_expr(self.mx):
            every = (None, None, None)
            tAsSFA, tAgSFA = mw.partition_a(atoms[idx[2]], cute.local_tile(coords[idx[2]], (cfg.tile_m, cfg.tile_k),
                                                                           every), smem[2], cta_v)
            tBsSFB, tBgSFB = mw.partition_sfb(atoms[idx[3]], cute.local_tile(coords[idx[3]], (cfg.tile_n, cfg.tile_k),
                                                                             every), smem[3], cta_v)
            used = used + [atoms[idx[2]], atoms[idx[3]]]
            srcs = srcs + (tAgSFA[(None, m_tile, None, 0)], tBgSFB[(None, n_tile, None, 0)])
            dsts = dsts + (tAsSFA, tBsSFB)
            sf_k0 = lo // lay.SF_ATOM_ROWS + expert
        return mw.load_tile(ab_pipe, state, used, srcs, dsts, kt, sf_k0, mw.mcast_masks(cta_v)[:self.per])

    @cute.jit
    def _mma(self, pipes: task_ring.Pipes, views, routed, shared, n_tasks: Int32):
        """MMA warp: each task's tile into the next TMEM accumulator stage (D2, D1: the (K, MN)
        tiled MMA; W: the (MN, MN) one)."""
        ab_pipe, acc_pipe, task_pipe, sTask, tmem = pipes
        md, mw = self.ml_d, self.ml_w
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        accs = (md.acc_tensor(acc_ptr), mw.acc_tensor(acc_ptr))
        frags = md.mma_fragments(*views[:4], acc_ptr) + mw.mma_fragments(*views[4:], acc_ptr)
        mma_d = md.make_tiled_mma()
        mma_w = mw.make_tiled_mma()
        state = md.consumer_state()
        acc_state = md.acc_producer_state()
        tstate = task_ring.consumer_state()
        t, tstate = task_ring.take_any(task_pipe, tstate, sTask, True, self.cg == 2)
        while t < n_tasks:
            acc_pipe.producer_acquire(acc_state)
            if cutlass.const_expr(self.shared):
                grp, lt = _split(t, shared, routed)
                if grp == 0:
                    state, mma_d, mma_w = self._mma_tile(shared, lt, ab_pipe, state, frags, mma_d, mma_w, accs,
                                                         acc_state.index)
                else:
                    state, mma_d, mma_w = self._mma_tile(routed, lt, ab_pipe, state, frags, mma_d, mma_w, accs,
                                                         acc_state.index)
            else:
                state, mma_d, mma_w = self._mma_tile(routed, t, ab_pipe, state, frags, mma_d, mma_w, accs,
                                                     acc_state.index)
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t, tstate = task_ring.take_any(task_pipe, tstate, sTask, True, self.cg == 2)
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def _mma_tile(self, g, t: Int32, ab_pipe, state, frags, mma_d, mma_w, accs, stage: Int32):
        """MMA warp, group ``g``'s task ``t``: its k-tiles (D2: K = H; D1: 2 x I in k-tiles of each
        half; W: the expert's rows) into accumulator ``stage`` of ``accs`` (the (K, MN) / (MN, MN)
        views); returns ``(state, mma_d, mma_w)``."""
        n_d2, n_d1, per_e, k_h, k_i = g.dims[1], g.dims[2], g.dims[7], g.dims[8], g.dims[9]
        tCrA, tCrB, sf, tCrA_w, tCrB_w, sf_w = frags
        if t >= n_d2 + n_d1:  # W: K = the expert's rows
            expert = (t - n_d2 - n_d1) // per_e
            length = g.offsets[expert + 1] - g.offsets[expert]
            kt = cutlass.max((length + (self.cfg.tile_k - 1)) // self.cfg.tile_k, 1)
            state, mma_w = self.ml_w.mma_tile(mma_w, ab_pipe, state, tCrA_w, tCrB_w, sf_w,
                                              accs[1][(None, None, None, stage)], kt)
        else:
            kt = k_h  # D2: K = H; D1: K = 2 x I in k-tiles of each half
            if t >= n_d2:
                kt = 2 * k_i
            state, mma_d = self.ml_d.mma_tile(mma_d, ab_pipe, state, tCrA, tCrB, sf, accs[0][(None, None, None, stage)],
                                              kt)
        return state, mma_d, mma_w

    @cute.jit
    def _epilogue(self, pipes: task_ring.Pipes, tidx: Int32, routed, shared, n_tasks: Int32, limit: Float32,
                  mOrder: cute.Tensor, done: cute.Pointer, mx_out, ep, cta_v: Int32, sPush: cute.Tensor = None):
        """Epilogue warps: store each task's accumulator (:meth:`_store`), then publish it
        (:meth:`_publish`). EP > 1: first, every rank must have freed its slot buffer of the previous
        push round (FREE >= epoch - 1: an earlier launch's, so nothing in this one waits for it).
        ``cta_group::2``: this CTA stores rows ``cta_v * 128 ..`` of each tile (its TMEM half) and
        publishes the tile too. ``bulk_push``: D1's rows go to the peers through ``sPush``
        (:func:`~mok_cute.kernels.sm100.fused_moe.push_routed_bulk`)."""
        _, acc_pipe, task_pipe, sTask, tmem = pipes
        t_atoms = None
        if cutlass.const_expr(self.mx):  # token scales: ceil(M / 128) + E atoms per feature atom row
            t_atoms = (routed.gu.shape[0] + (lay.SF_ATOM_ROWS - 1)) // lay.SF_ATOM_ROWS + routed.num_experts
        tmem.allocate(self.ml_d.tmem_alloc)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.ml_d.acc_tensor(acc_ptr)
        if cutlass.const_expr(self.ep):
            if tidx == 0:
                ep.wait_free()
            epi_barrier()
            if cutlass.const_expr(self.bulk_push):  # FREE (thread 0's acquire) before async-proxy stores
                cute.arch.fence_proxy("async.global")
        acc_state = self.ml_d.acc_consumer_state()
        tstate = task_ring.consumer_state()
        cur = (Int32(0), Int32(0), Int32(0), Int32(0))
        s_cur = cur
        t, tstate = task_ring.take_any(task_pipe, tstate, sTask, False, self.cg == 2)
        while t < n_tasks:
            if cutlass.const_expr(self.shared):
                grp, lt = _split(t, shared, routed)
                phase, expert, n_tile, m_tile, row0, rows, mt, which = (Int32(0),) * 8
                if grp == 0:
                    phase, expert, n_tile, m_tile, row0, rows, mt, which, s_cur = self._decode(shared, lt, s_cur)
                else:
                    phase, expert, n_tile, m_tile, row0, rows, mt, which, cur = self._decode(routed, lt, cur)
            else:
                phase, expert, n_tile, m_tile, row0, rows, mt, which, cur = self._decode(routed, t, cur)
            acc_pipe.consumer_wait(acc_state)
            chunks = AccChunks(acc[(None, None, None, acc_state.index)], tidx)
            if cutlass.const_expr(self.cg == 2):  # this CTA's 128 rows of the tile (W: of dW's rows, in _store)
                row0 = row0 + cta_v * EPI_THREADS
                rows = rows - cta_v * EPI_THREADS
            tile = (phase, expert, n_tile, m_tile, row0, rows, which, cta_v)
            if cutlass.const_expr(self.shared):
                if grp == 0:
                    self._store(shared, chunks, tile, limit, mOrder, mx_out, t_atoms, ep, sPush)
                else:
                    self._store(routed, chunks, tile, limit, mOrder, mx_out, t_atoms, ep, sPush)
            else:
                self._store(routed, chunks, tile, limit, mOrder, mx_out, t_atoms, ep, sPush)
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            if cutlass.const_expr(self.shared):
                if grp == 0:
                    self._publish(shared, phase, mt, tidx, done)
                else:
                    self._publish(routed, phase, mt, tidx, done)
            else:
                self._publish(routed, phase, mt, tidx, done)
            t, tstate = task_ring.take_any(task_pipe, tstate, sTask, False, self.cg == 2)
        tmem.relinquish_alloc_permit()
        epi_barrier()
        tmem.free(acc_ptr)

    @cute.jit
    def _store(self, g, chunks, tile, limit: Float32, mOrder: cute.Tensor, mx_out, t_atoms, ep, sPush):
        """Epilogue warps, group ``g``'s tile ``(phase, expert, n_tile, m_tile, row0, rows, which, cta_v)``
        (row0 / rows: this CTA's rows):
        the unfused kernels' epilogue (D1 of a ``routed`` group in the tokens variant: row r to slot
        row ``order[row0 + r]``, EP > 1 on its source rank, :func:`~mok_cute.kernels.sm100.fused_moe.push_routed`;
        MXFP8: D2 stores dgu's two quantizations, ``mx_out`` = (dgu_sf, dgut, dg_tsf, du_tsf) beside
        the e4m3 dgu along I)."""
        phase, expert, n_tile, m_tile, row0, rows, which, cta_v = tile
        if phase == D2:
            if cutlass.const_expr(self.mx):
                sf_row = g.offsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile
                if cutlass.const_expr(self.cg == 2):  # this CTA's atom row
                    sf_row = g.offsets[expert] // lay.SF_ATOM_ROWS + expert + m_tile * self.cg + cta_v
                self.dswiglu._store_dswiglu(chunks, row0, rows, n_tile, None, g.gu, limit,
                                            (g.dgu, *mx_out, sf_row, t_atoms))
            else:
                self.dswiglu._store_dswiglu(chunks, row0, rows, n_tile, g.dgu, g.gu, limit)
        elif phase == D1:
            if cutlass.const_expr(g.routed and self.ep and self.bulk_push):
                push_routed_bulk(self.dgrad1, chunks, row0, rows, n_tile, g.dx, mOrder, ep, sPush)
            elif cutlass.const_expr(g.routed and self.ep):
                push_routed(self.dgrad1, chunks, row0, rows, n_tile, g.dx, mOrder, ep)
            elif cutlass.const_expr(g.routed and not self.grouped_slots):
                store_routed(self.dgrad1, chunks, row0, rows, n_tile, g.dx, mOrder)
            else:
                self.dgrad1._store_plain(chunks, row0, rows, n_tile, g.dx)
        else:
            r0 = m_tile * self.cfg.tile_m
            if cutlass.const_expr(self.cg == 2):
                r0 = r0 + cta_v * EPI_THREADS
            store = self.wgrad._store_accumulate if cutlass.const_expr(self.accumulate) else self.wgrad._store_plain
            if which == WD:
                store(chunks, r0, g.dwd.shape[1] - r0, n_tile, g.dwd[(expert, None, None)])
            elif which == WG:
                store(chunks, r0, g.dwg.shape[1] - r0, n_tile, g.dwg[(expert, None, None)])
            else:
                store(chunks, r0, g.dwu.shape[1] - r0, n_tile, g.dwu[(expert, None, None)])

    @cute.jit
    def _publish(self, g, phase: Int32, mt: Int32, tidx: Int32, done: cute.Pointer):
        """Epilogue warps: a D2 tile is published on ``g.d2[mt]``, a D1 tile of the tokens variant
        counted on ``done`` (release add by thread 0 after every thread's GPU-scope fence, EP > 1
        system-scope for the routed rows pushed to peers, and the epilogue barrier)."""
        if phase == D2:
            cute.arch.fence_acq_rel_gpu()  # this thread's dgu stores before thread 0's release below
            epi_barrier()
            if tidx == 0:
                cute.arch.atomic_add(g.d2.iterator + mt, Int32(1), sem="release", scope="gpu")
        if cutlass.const_expr(self.tokens):
            if phase == D1:
                P.fence_stores(g.routed and self.ep)  # this thread's slot rows (EP > 1: in peers) before the count
                epi_barrier()
                if tidx == 0:
                    cute.arch.atomic_add(done, Int32(1), sem="release", scope="gpu")


class _Group:
    """One group of the backward's tiles inside the kernel: the routed experts, or (``shared``) the
    shared expert as one expert over the T tokens. ``atoms`` / ``coords``: its TMA atoms and
    coordinates (:meth:`FusedMoeBwdSm100._tma` order); ``t``: its :class:`~mok_cute.kernels.sm100.bundles.BwdGroup`
    (gu, dgu, dx, dWg, dWu, dWd, offsets, d2 read); ``gather``: its D2 / W tiles wait for the comm CTAs'
    rows; ``routed``: D1 rows to
    their (token, slot) rows. ``dims`` = ``(n_tasks, n_d2, n_d1, n_i, n_h, wd_m, wgu_m, per_e, k_h,
    k_i)``; ``n_d2`` / ``n_d1`` / ``n_w``: its phases' sizes (``fused_bwd90._split``)."""

    def __init__(self, cfg, atoms, coords, t: BwdGroup, gather: bool, routed: bool):
        self.atoms, self.coords, self.gather, self.routed = atoms, coords, gather, routed
        self.gu, self.dgu, self.dx, self.dwg, self.dwu, self.dwd, self.offsets, self.d2 = (
            t.gu, t.dgu, t.dx, t.dwg, t.dwu, t.dwd, t.offsets, t.d2)
        self.num_experts = self.offsets.shape[0] - 1
        self.hidden = self.dx.shape[1]
        inter = self.gu.shape[2]
        n_i = (inter + (cfg.tile_n - 1)) // cfg.tile_n  # D2 n-tiles
        n_h = (self.hidden + (cfg.tile_n - 1)) // cfg.tile_n  # D1 n-tiles
        wd_m = (self.hidden + (cfg.tile_m - 1)) // cfg.tile_m  # dWd [H, I] tiles: (wd_m, n_i); dWg, dWu: (wgu_m, n_h)
        wgu_m = (inter + (cfg.tile_m - 1)) // cfg.tile_m
        self.mt = routed_mtiles(self.offsets, self.num_experts, cfg.tile_m)
        self.n_d2 = self.mt * n_i
        self.n_d1 = self.mt * n_h
        per_e = wd_m * n_i + 2 * wgu_m * n_h
        self.n_w = self.num_experts * per_e
        n_tasks = self.n_d2 + self.n_d1 + self.n_w
        k_h = (self.hidden + (cfg.tile_k - 1)) // cfg.tile_k
        k_i = (inter + (cfg.tile_k - 1)) // cfg.tile_k
        self.dims = (n_tasks, self.n_d2, self.n_d1, n_i, n_h, wd_m, wgu_m, per_e, k_h, k_i)


# ---------------------------------------------------------------- compile
def compile_fused_backward_sm100(v: BwdVariant, arch: str = "sm_100a", inspect: bool = False):
    """Compile variant ``v`` (:class:`BwdVariant`) with symbolic M, T, T*k, H, I, I_s, E for ``arch``
    (sm_100a / sm_103a); returns ``(compiled, report)``."""
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused backward needs arch in {ARCHS}, got {arch!r}")
    op = FusedMoeBwdSm100(v)
    tokens, init, add, mx, gather, shared, ep, accumulate, grouped_slots = (
        v.tokens, v.init, v.add, v.mx, v.gather, v.shared, v.ep, v.accumulate, v.grouped_slots)
    bf = cutlass.BFloat16
    dw = Float32 if accumulate else bf  # the weight gradients' element type
    q = cutlass.Float8E4M3FN if mx else bf  # the GEMM operands
    m, e, two, t, tk = (cute.sym_int() for _ in range(5))
    hid, inter = (cute.sym_int(divisibility=DIM_MULTIPLE) for _ in range(2))

    def vec(n=None, dtype=Int32):
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int() if n is None else n,), stride=(1,),
                                             assumed_align=4)

    routed = BwdGroup(_fake_2d(q, m, hid), _fake_2d(q, m, hid), _fake_3d(bf, m, two, inter), _fake_2d(q, m, inter),
                      _fake_3d(q, e, inter, hid), _fake_3d(q, e, inter, hid), _fake_3d(q, e, hid, inter),
                      _fake_3d(q, m, two, inter), _fake_2d(bf, tk if tokens and not grouped_slots else m, hid),
                      _fake_3d(dw, e, inter, hid), _fake_3d(dw, e, inter, hid), _fake_3d(dw, e, hid, inter), vec(),
                      vec(), vec())
    toks = BwdTokens()
    if tokens:
        toks = BwdTokens(vec(), vec(tk), _fake_2d(bf, t, hid) if init else None,
                         _fake_2d(Float32, t, hid) if add else None, _fake_2d(bf, t, hid))
    mxs = BwdMx()
    if mx:
        sf = MX_CONFIG
        mxs = BwdMx(_fake_sf(sf), _fake_sf(sf), _fake_sf(sf), _fake_sf(sf), _fake_2d(q, m, hid), _fake_sf(sf),
                    _fake_sf(sf), _fake_3d(q, m, two, inter), _fake_sf(sf), _fake_sf(sf), _fake_sf(sf))
    rows = BwdGather()
    if gather:
        rows = BwdGather(_fake_2d(bf, t, hid), _fake_2d(bf, t, hid), _fake_2d(bf, cute.sym_int(), hid),
                         vec(m if ep else tk, Float32), vec(tk, Float32), vec(),
                         *((_fake_2d(bf, m, hid), _fake_2d(bf, m, hid)) if mx else (None, None)))
    sh = BwdGroup()
    if shared:
        i_s, one = cute.sym_int(divisibility=DIM_MULTIPLE), cute.sym_int()
        sh = BwdGroup(None, None, _fake_3d(bf, t, two, i_s), _fake_2d(bf, t, i_s), _fake_3d(bf, one, i_s, hid),
                      _fake_3d(bf, one, i_s, hid), _fake_3d(bf, one, hid, i_s), _fake_3d(bf, t, two, i_s), None,
                      _fake_3d(dw, one, i_s, hid), _fake_3d(dw, one, i_s, hid), _fake_3d(dw, one, hid, i_s), vec(),
                      vec())
    peer = BwdPeer(*((cute.runtime.make_fake_tensor(Int64, (cute.sym_int(),), stride=(1,), assumed_align=8),
                      vec()) if ep else (None, None)), *_NO_EP)
    scalars = BwdScalars(Int32(1), Int32(1), Float32(0.0), Int32(1), Int64(1))
    return compile_kernel(op, routed, *(present(b) for b in (toks, mxs, rows, sh)), scalars, peer,
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


# ---------------------------------------------------------------- launch
class ForwardSaved(NamedTuple):
    """What the forward kept for a fused backward launch.

    gu [>= M, 2I], h [>= M, I]: bf16, the forward's GEMM1 output and activation (first M rows read);
    rows: its GEMM2 rows [T*k, H] bf16 (EP = 1: expert-grouped or, ``by_route``, in route order;
        EP > 1: this rank's slot rows, rows of -1 slots unread);
    by_route: the EP = 1 rows are in route order;
    w_rows: fp32 [M], each grouped row's router weight (EP > 1; None at EP = 1).
    """

    gu: torch.Tensor
    h: torch.Tensor
    rows: torch.Tensor | None = None
    by_route: bool = False
    w_rows: torch.Tensor | None = None


class _Whole(NamedTuple):
    """:func:`_whole`'s validated extras: the checked shared group (by name) or None, the slot sum's
    start ``dx_shared`` or None, the checked main grads or None, the MXFP8 weight scales or None, the
    EP > 1 workspace or None, and ``(T, k, M grouped rows)``."""

    sh: dict | None
    dx_shared: torch.Tensor | None
    main_grads: tuple | None
    w_scales: tuple | None
    ws: object
    dims: tuple


def _check_operands(dy, x, gu, h, offsets, weights: ExpertWeights, limit, launch: Sm100Launch, w_scales=None,
                    rows=None):
    """Raise TypeError / ValueError for operands :func:`fused_backward_core` cannot launch on
    (``w_scales`` given: MXFP8, e4m3 weights with those scales; ``rows``: the grouped rows gu and h
    hold at least, default dy's)."""
    w_gate, w_up, w_down = weights
    bf = (torch.bfloat16,)
    mx = w_scales is not None
    _check_tensor("dy", dy, 2, bf)
    m, hid = dy.shape
    if hid == 0 or hid % DIM_MULTIPLE:
        raise ValueError(f"dy must be [M, H] with H a positive multiple of {DIM_MULTIPLE}, got {tuple(dy.shape)}")
    _check_tensor("x", x, 2, bf)
    if tuple(x.shape) != (m, hid):
        raise ValueError(f"x must have dy's shape {(m, hid)}, got {tuple(x.shape)}")
    _check_tensor("offsets", offsets, 1, (torch.int32,))
    _check_tensor("w_gate", w_gate, 3, (_FP8,) if mx else bf)
    e, inter = w_gate.shape[0], w_gate.shape[1]
    if e == 0 or inter == 0 or inter % DIM_MULTIPLE:
        raise ValueError(f"w_gate must be [E >= 1, I, H] with I a positive multiple of {DIM_MULTIPLE}, "
                         f"got {tuple(w_gate.shape)}")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must hold E+1 = {e + 1} entries, got {offsets.numel()}")
    _check_weight("w_gate", w_gate, (e, inter, hid), mx, strided=True)
    _check_weight("w_up", w_up, (e, inter, hid), mx, strided=True)
    _check_weight("w_down", w_down, (e, hid, inter), mx)
    scales = {}
    if mx:
        if not isinstance(w_scales, (tuple, list)) or len(w_scales) != 3:
            raise ValueError("w_scales must be (gate [E, I/32, H], up [E, I/32, H], down [E, H/32, I]) for MXFP8")
        _check_gate_up_scales(w_scales[:2], (e, inter // lay.SF_VEC, hid))
        _check_scales("w_scales[2]", w_scales[2], (e, hid // lay.SF_VEC, inter))
        scales = {f"w_scales[{i}]": s for i, s in enumerate(w_scales)}
    m = m if rows is None else rows
    for name, a, cols in (("gu", gu, 2 * inter), ("h", h, inter)):
        _check_tensor(name, a, 2, bf)
        if a.shape[0] < m or a.shape[1] != cols:
            raise ValueError(f"{name} must be [>= M={m}, {cols}], got {tuple(a.shape)}")
    for name, a in dict(dy=dy, x=x, gu=gu, h=h, offsets=offsets, w_gate=w_gate, w_up=w_up, w_down=w_down,
                        **scales).items():
        if a.device != dy.device:
            raise ValueError(f"{name} is on {a.device} but dy is on {dy.device}")
        if name not in ("w_gate", "w_up", *scales) and (not a.is_contiguous() or a.data_ptr() % 16):
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    _check_limit(limit)
    _check_launch(launch, mx, min_ctas=1)


def _check_tokens(tokens, dy, rows=None):
    """Raise TypeError / ValueError for a ``tokens`` argument :func:`fused_backward_core` cannot
    launch on; returns ``(order int32 [M], topk_idx int32 [T*k], dx_shared, dx_add, T, k)`` (``rows``:
    the order entries used, default M = dy's rows)."""
    if not isinstance(tokens, (tuple, list)) or len(tokens) not in (3, 4):
        raise ValueError("tokens must be (order, topk_idx, dx_shared) or (order, topk_idx, dx_shared, dx_add)")
    order, topk_idx, dxs, add = (*tokens, None)[:4]
    m, hid = dy.shape
    m = m if rows is None else rows
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


def fused_backward_core(dy, x, gu, h, offsets, weights: ExpertWeights, limit, launch: Sm100Launch, tokens=None,
                        w_scales=None, consume: bool = False):
    """Validate, then launch the routed backward core on the current stream (the contract of
    :func:`mok_cute.kernels.sm90.fused_bwd.fused_backward_core` without ``tokens`` / ``mx``):
    dy, x [M, H] bf16 (grouped rows, dy already scaled by the router weights); gu [>= M, 2I] and
    h [>= M, I] (the forward's, first M rows read); ``offsets`` int32 [E+1] (trusted: 0,
    non-decreasing, last = M); ``weights``: w_gate, w_up [E, I, H] (unit last stride, other strides
    multiples of 16 bytes), w_down [E, H, I]; ``limit`` None, the SwiGLU clamp or a
    :class:`~mok_cute.reference.SwiGLU` (its alpha and up offset compiled in); H, I multiples of
    64; one sm_100 / sm_103 device. ``launch`` (:class:`~mok_cute.kernels.sm100.fused_moe.Sm100Launch`):
    ``num_ctas`` the grid (default all SMs), ``timeout_s``, ``tile_m`` (``comm_ctas`` unread: no
    gather). Returns ``(dx [M, H], dWg,
    dWu [E, I, H], dWd [E, H, I])``, meant bitwise the unfused SM100 backward's (unverified on
    hardware). ``tokens`` = ``(order, topk_idx, dx_shared[, dx_add])``: each dx row goes to its
    (token, slot) row and the launch ends with the fixed-order slot sum, so dx is [T, H] =
    bf16(fp32(dx_shared) (or 0) [+ dx_add] + the slot rows j = 0.. of each token with
    topk_idx >= 0), bitwise the unfused scatter and reference slot sum; ``order`` int [>= M]
    (grouped row -> t*k + j, trusted), ``topk_idx`` int [T, k], ``dx_shared`` bf16 [T, H] or None,
    ``dx_add`` fp32 [T, H] or None (both contiguous). ``consume`` (the caller gives up dy and gu: a
    one-shot layer backward): at BF16 D2 writes dgu over gu's first M rows (each epilogue thread reads
    its row's g, u chunk before it stores their dg, du; nothing else reads gu), not into a new
    [M, 2I] buffer; at MXFP8 with ``tokens`` the dx rows go over dy (no tile reads its bf16 rows),
    in grouped order, not into a new [T*k, H] buffer. A device wait's timeout is raised by a later
    call (:mod:`mok_cute.dsl.deferred`).

    MXFP8 (``w_scales`` given): the weights float8_e4m3fn quantized along their rows' K as the
    unfused MXFP8 backward reads them (``layers.sm100.quantize_weight(w, 1)``: w_gate, w_up along
    I, w_down along H), ``w_scales`` = (gate [E, I/32, H], up [E, I/32, H], down [E, H/32, I])
    uint8 E8M0; dy, x, h stay bf16 and are quantized here as ``layers.sm100.mx_backward`` does
    (dy along H, ``quantize.quantize_mxfp8``; dy, x, h along tokens,
    :class:`~mok_cute.kernels.sm100.layouts.TokenOperand`; the quantizers looked up at call time);
    D2's epilogue quantizes dgu along I and along tokens
    (:meth:`~mok_cute.kernels.sm100.grouped_gemm.GroupedGemmSm100._store_dgu_mx`), so every tile is
    the unfused MXFP8 GEMMs' on the same operands (meant bitwise ``mx_backward``)."""
    _check_operands(dy, x, gu, h, offsets, weights, limit, launch, w_scales)
    toks = None if tokens is None else _check_tokens(tokens, dy)
    w_gate, w_up, w_down = weights
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
    mx = w_scales is not None
    mx_args = BwdMx()
    ops = (dy, x, h[:m])
    if consume and not mx:  # D2's bf16 dgu over gu (the caller gives it up)
        dgu = gu[:m].view(m, 2, inter)
    else:
        dgu = torch.empty((m, 2, inter), dtype=_FP8 if mx else torch.bfloat16, device=dy.device)
    if mx:
        ops, mx_args = _mx_operands(dy, x, h[:m], offsets, w_scales)
    _, d2, words = _counters(m, e, DONE_WORD + 1 if toks is not None else WORDS, dy.device)
    k, tok_args, rows = 1, BwdTokens(), dx
    grouped = mx and consume and toks is not None  # dy is contiguous (_check_operands)
    if toks is not None:
        order32, idx32, dxs, add, t, k = toks
        if grouped:  # the dx rows over dy's grouped rows, the slot sum through the inverse order
            rows, order32 = dy, grouped_rows(order32, t * k)
        else:
            rows = torch.empty((t * k, hid), **bf)  # the dx rows by (token, slot); rows of -1 slots not summed
        tok_args = BwdTokens(order32, idx32, dxs, add, dx)
    clamp, gated, _ = swiglu_args(limit)
    v = BwdVariant(clamp, toks is not None, toks is not None and toks[2] is not None,
                   toks is not None and toks[3] is not None, mx, grouped_slots=grouped, tile_m=launch.tile_m,
                   gated=gated)
    routed = BwdGroup(ops[0], ops[1], gu[:m].view(m, 2, inter), ops[2], w_gate, w_up, w_down, dgu, rows, dwg, dwu,
                      dwd, offsets, d2, words)
    _launch(v, (routed, tok_args, mx_args, BwdGather(), BwdGroup()), k, limit, launch, dev)
    return dx, dwg, dwu, dwd


def fused_backward(dy, x, plan: RoutePlan, saved: ForwardSaved, weights: ExpertWeights, limit,
                   launch: Sm100Launch, shared=None, dx_shared=None, main_grads=None, w_scales=None):
    """The routed backward from the layer's tokens in one launch (BF16 or MXFP8; the contract of
    :func:`mok_cute.kernels.sm90.fused_bwd.fused_backward`):
    :func:`fused_backward_core` with ``tokens`` and, in its first ``launch.comm_ctas`` CTAs, the work
    of ``route_grad.dy_rows_and_dtopk_w`` and of gathering x's rows (meant bitwise theirs). dy, x
    [T, H] bf16; ``plan``: ``order`` int [T*k] (grouped row -> t*k + j, routes without an expert
    last, trusted), ``offsets`` int32 [E+1] (trusted), ``topk_idx`` int, ``topk_w`` fp32 [T, k];
    ``saved`` (:class:`ForwardSaved`): gu [>= T*k, 2I], h [>= T*k, I], ``rows`` [T*k, H] (the
    forward's GEMM2 rows, expert-grouped or, ``by_route``, in route order); ``dx_shared`` bf16 [T, H]
    or None (the slot sum's start). Returns ``(dx [T, H], d topk_w [T, k] fp32, dWg, dWu, dWd)``
    (d topk_w 0 for -1 slots).

    ``shared`` = ``(offsets_s int32 [0, T], gu_s [T, 2I_s], h_s [T, I_s], ws_gate, ws_up [I_s, H],
    ws_down [H, I_s])`` (the shared expert's group, as the forward made it): its tiles run in the same
    launch as a second group (``dx_shared`` must be None: its dx is made there and starts the slot
    sum) and its three weight gradients [I_s, H], [I_s, H], [H, I_s] follow the routed ones.
    ``main_grads``: contiguous fp32 tensors of the weights' shapes (w_gate, w_up, w_down, then the
    shared expert's with ``shared``): each weight-gradient tile is added into them (``main +=
    fp32(bf16(dW))``) and its weight gradient is returned as None.

    ``w_scales``: the MXFP8 backward (:func:`fused_backward_core`'s weights and scales), meant bitwise
    the unfused one: the comm CTAs quantize the gathered dy rows along H and along the tokens and the
    x rows along the tokens per m-tile (:func:`~mok_cute.kernels.sm100.mx_gather.quantize_tile`), h
    is quantized along the tokens here; the shared expert runs outside the launch (``shared`` None,
    its dx ``dx_shared``). Every operand is validated before anything is compiled or launched; a
    device wait's timeout is raised by a later call (:mod:`mok_cute.dsl.deferred`)."""
    order, offsets, topk_idx, topk_w = plan
    ints = (torch.int32, torch.int64)
    _check_tensor("topk_idx", topk_idx, 2, ints)
    t, k = topk_idx.shape
    m = t * k
    _check_operands(dy, x, saved.gu, saved.h, offsets, weights, limit, launch, w_scales, rows=m)
    hid = dy.shape[1]
    if dy.shape[0] != t:
        raise ValueError(f"dy must be [T, H] with T = topk_idx's {t} tokens, got {tuple(dy.shape)}")
    if shared is not None and dx_shared is not None:
        raise ValueError("dx_shared must be None when the shared expert runs in the launch")
    if shared is not None and w_scales is not None:
        raise ValueError("w_scales (MXFP8): the shared expert runs outside the launch (give its dx as dx_shared)")
    order32, idx32, _, _, _, _ = _check_tokens((order, topk_idx, dx_shared), dy, rows=m)
    r_rows = saved.rows
    _check_tensor("r_rows", r_rows, 2, (torch.bfloat16,))
    _check_tensor("topk_w", topk_w, 2, (torch.float32,))
    if tuple(r_rows.shape) != (m, hid) or not r_rows.is_contiguous() or r_rows.data_ptr() % 16:
        raise ValueError(f"r_rows must be contiguous [T*k, H] = {(m, hid)}, got {tuple(r_rows.shape)}")
    if tuple(topk_w.shape) != (t, k):
        raise ValueError(f"topk_w must be [T, k] = {(t, k)}, got {tuple(topk_w.shape)}")
    if not isinstance(saved.by_route, bool):
        raise TypeError(f"rows_by_route must be a bool, got {type(saved.by_route).__name__}")
    sh = None if shared is None else _check_shared(shared, t, hid)
    mains = _check_main_grads(main_grads, weights, sh)
    for name, a in dict(r_rows=r_rows, topk_w=topk_w, **(sh or {}), **mains).items():
        if a.device != dy.device:
            raise ValueError(f"{name} is on {a.device} but dy is on {dy.device}")
    return _whole(dy, x, RoutePlan(order32, offsets, idx32, topk_w.reshape(-1).contiguous()), saved, weights, limit,
                  launch, _Whole(sh, dx_shared, main_grads, w_scales, None, (t, k, m)))


def fused_backward_ep(ws, plan: RoutePlan, dy, x, saved: ForwardSaved, weights: ExpertWeights, limit,
                      launch: Sm100Launch, shared=None, main_grads=None, w_scales=None, dx_shared=None):
    """The backward at EP > 1 in one launch per rank (BF16 or MXFP8; collective over ``ws``'s ranks, every
    rank calls it in the same order; the contract of :func:`mok_cute.kernels.sm90.fused_bwd.fused_backward_ep`):
    :func:`fused_backward` with the rows moved through the workspace (``main_grads``, ``w_scales`` as
    there; with ``w_scales`` the shared expert's dx [T, H] bf16 is ``dx_shared``, the slot sum's start). This
    rank's x and dy [T, H] bf16 are staged in its ``src`` and ``dy`` sections (after every peer finished
    the previous pull); the comm CTAs pull the dy rows (times ``saved.w_rows`` [M] fp32, the forward's router
    weight of each grouped row) and x rows of the routes this rank's experts serve (``plan``: the
    forward's device plan, ``order`` = its ``recv_src`` int32 [M] packed sources, local expert ``offsets``
    int32 [E+1], ``topk_idx`` [T, k]; ``topk_w`` unread), the dgrad1 rows are pushed to their (token, slot)
    rows of the source ranks' slot sections, and every rank sums its own (from the shared expert's dx
    with ``shared``, as :func:`fused_backward`). d topk_w [T, k] of this rank's routes is made from
    ``saved.rows`` [T*k, H] (its routed rows of the forward, rows of -1 slots unread). ``saved.gu``
    [>= M, 2I], ``saved.h`` [>= M, I]: the forward's. Returns ``(dx [T, H], d topk_w [T, k] fp32, dWg,
    dWu, dWd)``, then the shared expert's three with ``shared``. Every operand is validated before
    anything is staged, compiled or launched; errors of the device waits (a peer's timeout included)
    go to ``ws.status`` (the caller's ``ws.check_status()``); ``launch.num_ctas``: this rank's grid
    (default all SMs; ``ws.grid_ctas`` for virtual ranks sharing one GPU); the waits' bound is the
    workspace's ``timeout_s``; ``launch.bulk_push``: the dgrad1 rows by ``cp.async.bulk``."""
    recv_src, offsets, topk_idx, _ = plan
    _check_tensor("topk_idx", topk_idx, 2, (torch.int32, torch.int64))
    t, k = topk_idx.shape
    _check_tensor("recv_src", recv_src, 1, (torch.int32,))
    m = recv_src.shape[0]
    _check_operands(dy, x, saved.gu, saved.h, offsets, weights, limit, launch, w_scales, rows=m)
    hid = dy.shape[1]
    if dy.shape[0] != t:
        raise ValueError(f"dy must be [T, H] with T = topk_idx's {t} tokens, got {tuple(dy.shape)}")
    if dx_shared is not None and (shared is not None or w_scales is None):
        raise ValueError("dx_shared is the MXFP8 launch's (w_scales given, shared None)")
    if shared is not None and w_scales is not None:
        raise ValueError("w_scales (MXFP8): the shared expert runs outside the launch (give its dx as dx_shared)")
    order32, idx32, _, _, _, _ = _check_tokens((recv_src, topk_idx, dx_shared), dy, rows=m)
    slot_rows, w_rows = saved.rows, saved.w_rows
    _check_tensor("slot_rows", slot_rows, 2, (torch.bfloat16,))
    _check_tensor("w_rows", w_rows, 1, (torch.float32,))
    if tuple(slot_rows.shape) != (t * k, hid) or not slot_rows.is_contiguous() or slot_rows.data_ptr() % 16:
        raise ValueError(f"slot_rows must be contiguous [T*k, H] = {(t * k, hid)}, got {tuple(slot_rows.shape)}")
    if w_rows.shape[0] != m:
        raise ValueError(f"w_rows must be [M] = [{m}] (plan.recv_src's rows), got {tuple(w_rows.shape)}")
    sh = None if shared is None else _check_shared(shared, t, hid)
    mains = _check_main_grads(main_grads, weights, sh)
    for name, a in dict(recv_src=recv_src, slot_rows=slot_rows, w_rows=w_rows, **(sh or {}), **mains).items():
        if a.device != dy.device:
            raise ValueError(f"{name} is on {a.device} but dy is on {dy.device}")
    return _whole(dy, x, RoutePlan(order32, offsets, idx32, w_rows), saved._replace(by_route=False), weights, limit,
                  replace(launch, timeout_s=ws.timeout_s), _Whole(sh, dx_shared, main_grads, w_scales, ws, (t, k, m)))


def _whole(dy, x, plan: RoutePlan, saved: ForwardSaved, weights: ExpertWeights, limit, launch: Sm100Launch,
           opts: _Whole):
    """The launch of :func:`fused_backward` (``opts.ws`` None) or :func:`fused_backward_ep` on validated
    operands: ``plan`` = (int32 order, offsets, flat int32 topk_idx, the gather's flat router weights:
    topk_w, at EP > 1 the grouped rows' ``w_rows``), ``saved.rows`` the gather's GEMM2 rows (EP > 1:
    this rank's slot rows); returns their outputs (T = 0: zeros, nothing launched, the main grads
    unchanged; every rank of an EP group holds the same T)."""
    sh, dx_shared, main_grads, w_scales, ws, (t, k, m) = opts
    order32, offsets, idx32, w = plan
    gu, h = saved.gu, saved.h
    w_gate, w_up, w_down = weights
    hid = dy.shape[1]
    dev, arch = device_arch(dy.device)
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused backward needs an sm_100a / sm_103a device, got {arch}")
    e, inter = w_gate.shape[0], w_gate.shape[1]
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dx = torch.empty((t, hid), **bf)
    dtw = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    dw = (torch.empty((e, inter, hid), **bf), torch.empty((e, inter, hid), **bf), torch.empty((e, hid, inter), **bf))
    dws = ()
    if sh is not None:
        i_s = sh["ws_gate"].shape[0]
        dws = (torch.empty((1, i_s, hid), **bf), torch.empty((1, i_s, hid), **bf), torch.empty((1, hid, i_s), **bf))
    if main_grads is not None:  # the tiles add into them; nothing returned in their place
        dw, dws = tuple(main_grads[:3]), tuple(mg[None] for mg in main_grads[3:])
    n_dw = 3 + len(dws)
    if t == 0:  # no tokens: no tile reads anything
        if main_grads is not None:
            return (dx, dtw, *(None,) * n_dw)
        return (dx, dtw, *(d.zero_() for d in dw), *(d[0].zero_() for d in dws))
    if ws is None:
        slot = torch.empty((m, hid), **bf)  # the dx rows by (token, slot)
    else:
        ws.acquire_src().copy_(x)  # a device wait first: every peer finished the previous pull from it
        ws.view("dy", torch.bfloat16, (t, hid)).copy_(dy)
        slot = ws.view("slots", torch.bfloat16, (t * k, hid))  # the push target
    mt_cap, sd2_cap = m // CONFIG.tile_m + e + 1, t // CONFIG.tile_m + 2
    counters, d2, words = _counters(m, e, (DONE_WORD if ws is None else SUMMED_WORD) + 1, dy.device,
                                    mt_cap + sd2_cap)
    gdy, sd2 = counters[-(mt_cap + sd2_cap):-sd2_cap], counters[-sd2_cap:]
    init = dx_shared if sh is None else torch.empty((t, hid), **bf)  # the shared expert's dx: D1 of its group
    rows_bf = (torch.empty((m, hid), **bf), torch.empty((m, hid), **bf))  # the gather's dy and x rows
    if w_scales is None:  # the tiles read the gathered rows
        gather, ops = BwdGather(dy, x, saved.rows, w, dtw.view(-1), gdy), (*rows_bf, h[:m])
        dgu, mx_args = torch.empty((m, 2, inter), **bf), BwdMx()
    else:  # the tiles read their MXFP8 operands, made from the rows in the launch
        gather = BwdGather(dy, x, saved.rows, w, dtw.view(-1), gdy, *rows_bf)
        ops, mx_args = _mx_operands(None, None, h[:m], offsets, w_scales, hid)
        dgu = torch.empty((m, 2, inter), dtype=_FP8, device=dy.device)
    sh_args = BwdGroup()
    if sh is not None:
        i_s = sh["ws_gate"].shape[0]
        sh_args = BwdGroup(None, None, sh["gu_s"].view(t, 2, i_s), sh["h_s"], sh["ws_gate"][None], sh["ws_up"][None],
                           sh["ws_down"][None], torch.empty((t, 2, i_s), **bf), None, *dws, sh["offsets_s"], sd2)
    routed = BwdGroup(ops[0], ops[1], gu[:m].view(m, 2, inter), ops[2], w_gate, w_up, w_down, dgu, slot, *dw, offsets,
                      d2, words)
    clamp, gated, _ = swiglu_args(limit)
    v = BwdVariant(clamp, True, init is not None, False, w_scales is not None, True, saved.by_route,
                   sh is not None, ws is not None, main_grads is not None, tile_m=launch.tile_m,
                   bulk_push=launch.bulk_push and ws is not None, gated=gated)
    _launch(v, (routed, BwdTokens(order32, idx32, init, None, dx), mx_args, gather, sh_args), k, limit, launch, dev,
            ws)
    if main_grads is not None:
        return (dx, dtw, *(None,) * n_dw)
    return (dx, dtw, *dw, *(d[0] for d in dws))


def _check_main_grads(main_grads, weights: tuple, sh) -> dict:
    """Raise TypeError / ValueError for ``main_grads`` the launch cannot add into (one contiguous fp32
    tensor per weight: ``weights``' three, then the shared group's with ``sh``); returns them by name
    ({} for None)."""
    if main_grads is None:
        return {}
    names = ("w_gate", "w_up", "w_down") + (("ws_gate", "ws_up", "ws_down") if sh is not None else ())
    ws = tuple(weights) + (tuple(sh[n] for n in names[3:]) if sh is not None else ())
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != len(names):
        raise TypeError(f"main_grads must be a tuple of {len(names)} fp32 tensors ({', '.join(names)})")
    out = {}
    for i, (name, mg, wt) in enumerate(zip(names, main_grads, ws)):
        what = f"main_grads[{i}] ({name})"
        _check_tensor(what, mg, wt.dim(), (torch.float32,))
        if tuple(mg.shape) != tuple(wt.shape) or not mg.is_contiguous() or mg.data_ptr() % 16:
            raise ValueError(f"{what} must be contiguous, 16-byte aligned and of {name}'s shape {tuple(wt.shape)}, "
                             f"got {tuple(mg.shape)}")
        out[what] = mg
    return out


def _check_shared(shared, t: int, hid: int) -> dict:
    """Raise TypeError / ValueError for a ``shared`` group :func:`fused_backward` cannot launch on;
    returns its tensors by name."""
    names = ("offsets_s", "gu_s", "h_s", "ws_gate", "ws_up", "ws_down")
    if not isinstance(shared, (tuple, list)) or len(shared) != len(names):
        raise ValueError("shared must be (offsets_s [0, T], gu_s [T, 2I_s], h_s [T, I_s], ws_gate, ws_up [I_s, H], "
                         "ws_down [H, I_s])")
    sh = dict(zip(names, shared))
    _check_tensor("offsets_s", sh["offsets_s"], 1, (torch.int32,))
    if sh["offsets_s"].numel() != 2:
        raise ValueError(f"offsets_s must be [0, T] (2 entries), got {sh['offsets_s'].numel()}")
    _check_tensor("ws_gate", sh["ws_gate"], 2, (torch.bfloat16,))
    i_s = sh["ws_gate"].shape[0]
    if i_s == 0 or i_s % DIM_MULTIPLE:
        raise ValueError(f"ws_gate must be [I_s, H] with I_s a positive multiple of {DIM_MULTIPLE}, "
                         f"got {tuple(sh['ws_gate'].shape)}")
    for name, shape, strided in (("ws_gate", (i_s, hid), True), ("ws_up", (i_s, hid), True),
                                 ("ws_down", (hid, i_s), False)):
        _check_tensor(name, sh[name], 2, (torch.bfloat16,))
        _check_weight(name, sh[name][None], (1, *shape), False, strided)
    for name, cols in (("gu_s", 2 * i_s), ("h_s", i_s)):
        a = sh[name]
        _check_tensor(name, a, 2, (torch.bfloat16,))
        if tuple(a.shape) != (t, cols) or not a.is_contiguous() or a.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous [T, {cols}] = {(t, cols)}, got {tuple(a.shape)}")
    return sh


def _counters(m: int, e: int, n_words: int, device, extra: int = 0):
    """``(counters, d2, words)``: one zeroed int32 buffer, ``d2`` [the routed m-tiles at most: one
    partial per expert], then ``words`` [n_words], then ``extra`` more (the gather / shared counters)."""
    mt_cap = m // CONFIG.tile_m + e + 1
    counters = torch.zeros(mt_cap + n_words + extra, dtype=torch.int32, device=device)
    return counters, counters[:mt_cap], counters[mt_cap:mt_cap + n_words]


def _launch(v: BwdVariant, bundles: tuple, k: int, limit, launch: Sm100Launch, dev: int, ws=None):
    """Compile (cached per arch and ``v``) variant ``v`` and launch it on the current stream with
    ``bundles`` = (routed :class:`BwdGroup`, :class:`BwdTokens`, :class:`BwdMx`, :class:`BwdGather`,
    shared :class:`BwdGroup`) and the scalars of ``k``, ``limit`` and ``launch`` (``tile_m`` 256: CTA
    pairs, the grid and the comm CTAs rounded to whole pairs); the status words (the routed group's
    ``words``) watched. ``ws``: the EP > 1 variant over that workspace (launched directly with its
    arguments, the epochs bumped; its status, not ``words``, holds the errors)."""
    _, arch = device_arch(dev)
    launcher = compile_cached(("sm100_fused_moe_bwd", arch, v),
                              lambda: GraphLauncher(compile_fused_backward_sm100(v, arch)[0]))
    num_ctas = sm_count(dev) if launch.num_ctas is None else launch.num_ctas
    lim, timeout_ns = swiglu_args(limit)[2], int(launch.timeout_s * 1e9)
    comm = max(1, min(launch.comm_ctas, num_ctas - 1))  # a GEMM CTA must remain to run the tiles that wait on the rows
    num_ctas, comm = pair_grid(num_ctas, comm, v.tile_m)
    scalars = BwdScalars(Int32(k), Int32(comm), Float32(lim), Int32(num_ctas), Int64(timeout_ns))
    peer = BwdPeer(None, None, *_NO_EP) if ws is None else BwdPeer(*ws.kernel_args((ws.status,), EP_SECTIONS))
    launch_bundles(launcher, dev, (*bundles, scalars, peer), direct=ws is not None)
    if ws is None:
        deferred.watch(bundles[0].words[1:WORDS], describe)


def _mx_operands(dy, x, h, offsets, w_scales, hid: int | None = None):
    """``((dyq, x_t, h_t), tensors)`` of the MXFP8 variant, what ``layers.sm100.mx_backward`` hands
    the unfused MXFP8 GEMMs: dy quantized along H (D2's A) and x, h token rows quantized along
    tokens (dWg / dWu's and dWd's B), then the kernel's eleven MXFP8 tensors (a :class:`BwdMx`):
    dy's grouped blocked row scales, w_down's and [w_gate; w_up]'s blocked scales along K
    (``pack_kn_weight_scales``), dgu's row scales (zeroed: the halves' padding stays 0), dy's token
    rows and token scales, h's token scales, dgu's token rows (scratch), dg's and du's token scales
    (zeroed), x's token scales (the grouped blocked layouts of
    :mod:`~mok_cute.kernels.sm100.layouts`). ``dy`` and ``x`` None (the gather variant, which
    quantizes them in the launch): their operands are buffers of ``hid`` columns, the e4m3 token rows
    and every scale zeroed (as the host quantizers leave rows and padding no tile fills)."""
    from mok_cute.kernels.quant import quantize

    m, inter = h.shape
    e = offsets.numel() - 1
    u8 = dict(dtype=torch.uint8, device=h.device)
    h_t = lay.TokenOperand(h, offsets)
    half_kb = -(-inter // (lay.SF_ATOM_KBLOCKS * lay.SF_VEC)) * lay.SF_ATOM_KBLOCKS  # blocks per half, padded
    tok_kb = lay.grouped_sf_rows(m, e) // lay.SF_VEC
    if dy is None:
        fp8 = dict(dtype=_FP8, device=h.device)
        dyq, x_data = torch.empty((m, hid), **fp8), torch.zeros((m, hid), **fp8)
        dy_sf = torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(m, e), hid // lay.SF_VEC), **u8)
        dy_t = (torch.zeros((m, hid), **fp8), torch.zeros(lay.sf_bytes(hid, tok_kb), **u8))
        x_sf = torch.zeros(lay.sf_bytes(hid, tok_kb), **u8)
    else:
        dyq, dys = quantize.quantize_mxfp8(dy, -1)
        dy_sf = lay.pack_row_scales(dys, offsets)
        dyt, x_t = lay.TokenOperand(dy, offsets), lay.TokenOperand(x, offsets)
        dy_t, x_data, x_sf = (dyt.data, dyt.scales()), x_t.data, x_t.scales()
    tensors = BwdMx(dy_sf, lay.pack_kn_weight_scales(w_scales[2]),
                    torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(m, e), 2 * half_kb), **u8),
                    lay.pack_kn_weight_scales(*w_scales[:2]), *dy_t, h_t.scales(),
                    torch.empty((m, 2, inter), dtype=_FP8, device=h.device),
                    torch.zeros(lay.sf_bytes(inter, tok_kb), **u8), torch.zeros(lay.sf_bytes(inter, tok_kb), **u8),
                    x_sf)
    return (dyq, x_data, h_t.data), tensors


# ---------------------------------------------------------------- variant registry (readiness tool)
_PTX = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
        "mbarrier", "atom.global.add.u32", "atom.global.release.add.u32", "ld.acquire", "%globaltimer",
        "fence.proxy.async.global")
_PTX_TOKENS = ("add.rn.f32", "cp.async.cg")  # the dx slot sum: single-rounded fp32 adds, slot rows via cp.async
_PTX_GATHER = ("mul.rn.f32", "fma.rn.f32", "shfl.sync.bfly")  # route_row: dy * w, dy . r, its butterfly
_PTX_EP = ("st.release.sys", "ld.acquire.sys", "fence.acq_rel.sys")  # the EP > 1 signals, waits and fences
_MX_PTX = tuple(p for p in _PTX if p != "kind::f16") + (  # block-scaled MMAs, dgu's two quantizations
    "kind::mxf8f6f4", "block_scale", "tcgen05.cp", "cvt.rn.satfinite.e4m3x2.f32", "max.u16x2", "shfl.sync.bfly")


_MX_GATHER_PTX = ("st.global.b8", "st.global.v2.b32")  # the gather's scale bytes and e4m3 word pairs


def variants() -> dict:
    """``name -> (compile(arch, inspect) -> (compiled, report), PTX substrings it must hold)`` for
    every fused-backward variant this module builds."""
    def core(clamp, **kw):
        return lambda arch, inspect=True: compile_fused_backward_sm100(BwdVariant(clamp, **kw), arch, inspect)

    return {"fused-bwd-core-clamp": (core(True), _PTX), "fused-bwd-core-noclamp": (core(False), _PTX),
            "fused-bwd-tokens-clamp": (core(True, tokens=True, init=True, add=True), _PTX + _PTX_TOKENS),
            "fused-bwd-tokens-noclamp": (core(False, tokens=True), _PTX + _PTX_TOKENS),
            "fused-bwd-mxfp8-core-clamp": (core(True, mx=True), _MX_PTX),
            "fused-bwd-mxfp8-tokens-noclamp": (core(False, tokens=True, mx=True), _MX_PTX + _PTX_TOKENS),
            "fused-bwd-mxfp8-tokens-grouped-noclamp": (core(False, tokens=True, mx=True, grouped_slots=True),
                                                       _MX_PTX + _PTX_TOKENS),
            "fused-bwd-gather-clamp": (core(True, tokens=True, gather=True, by_route=True),
                                       _PTX + _PTX_TOKENS + _PTX_GATHER),
            "fused-bwd-gather-shared-noclamp": (core(False, tokens=True, init=True, gather=True, by_route=True,
                                                     shared=True), _PTX + _PTX_TOKENS + _PTX_GATHER),
            "fused-bwd-gather-shared-main-grads-noclamp": (core(False, tokens=True, init=True, gather=True,
                                                                by_route=True, shared=True, accumulate=True),
                                                           _PTX + _PTX_TOKENS + _PTX_GATHER),
            "fused-bwd-mxfp8-gather-init-clamp": (core(True, tokens=True, init=True, gather=True, by_route=True,
                                                       mx=True), _MX_PTX + _PTX_TOKENS + _PTX_GATHER + _MX_GATHER_PTX),
            "fused-bwd-mxfp8-ep-init-noclamp": (core(False, tokens=True, init=True, gather=True, ep=True, mx=True),
                                                _MX_PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _MX_GATHER_PTX),
            "fused-bwd-ep-clamp": (core(True, tokens=True, gather=True, ep=True),
                                   _PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP),
            "fused-bwd-ep-shared-noclamp": (core(False, tokens=True, init=True, gather=True, shared=True, ep=True),
                                            _PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP),
            "fused-bwd-2cta-tokens-clamp": (core(True, tokens=True, init=True, add=True, tile_m=256),
                                            _PTX + _PTX_TOKENS + _PAIR_PTX),
            "fused-bwd-mxfp8-2cta-tokens-grouped-noclamp": (core(False, tokens=True, mx=True, grouped_slots=True,
                                                                 tile_m=256), _MX_PTX + _PTX_TOKENS + _PAIR_PTX),
            "fused-bwd-2cta-gather-shared-main-grads-noclamp": (
                core(False, tokens=True, init=True, gather=True, by_route=True, shared=True, accumulate=True,
                     tile_m=256), _PTX + _PTX_TOKENS + _PTX_GATHER + _PAIR_PTX),
            "fused-bwd-mxfp8-2cta-gather-init-clamp": (
                core(True, tokens=True, init=True, gather=True, by_route=True, mx=True, tile_m=256),
                _MX_PTX + _PTX_TOKENS + _PTX_GATHER + _MX_GATHER_PTX + _PAIR_PTX),
            "fused-bwd-2cta-ep-clamp": (core(True, tokens=True, gather=True, ep=True, tile_m=256),
                                        _PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _PAIR_PTX),
            "fused-bwd-mxfp8-2cta-ep-init-noclamp": (
                core(False, tokens=True, init=True, gather=True, ep=True, mx=True, tile_m=256),
                _MX_PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _MX_GATHER_PTX + _PAIR_PTX),
            "fused-bwd-ep-bulk-push-clamp": (core(True, tokens=True, gather=True, ep=True, bulk_push=True),
                                             _PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _BULK_PTX),
            "fused-bwd-mxfp8-ep-bulk-push-init-noclamp": (
                core(False, tokens=True, init=True, gather=True, ep=True, mx=True, bulk_push=True),
                _MX_PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _MX_GATHER_PTX + _BULK_PTX),
            "fused-bwd-2cta-ep-bulk-push-shared-noclamp": (
                core(False, tokens=True, init=True, gather=True, shared=True, ep=True, tile_m=256, bulk_push=True),
                _PTX + _PTX_TOKENS + _PTX_GATHER + _PTX_EP + _PAIR_PTX + _BULK_PTX)}

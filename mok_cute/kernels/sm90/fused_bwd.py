"""The fused MoE backward on SM90: one persistent launch for the experts' dgrad2 + dSwiGLU,
dgrad1 and three weight gradients (the core), optionally (variants) with the dx rows scattered
to their slots and the fixed-order dx slot sum, the routed dy rows / d topk_w / x rows built by
its first CTAs, and the shared expert's tiles as a second group: the whole backward in one launch.

Inputs (grouped rows, expert order, ``offsets`` int32 [E+1]; M rows, bf16): ``dy`` [M, H] (the
route's dy row times its router weight, ``kernels/route_grad.py``), ``x`` [M, H] (the gathered
input rows; the ``x_gather`` variant: the layer's x [T, H], its token rows gathered in the dW_gate /
dW_up tiles' loads), ``gu`` [M, 2I] and ``h`` [M, I] (saved by the forward); weights ``w_gate``,
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

from dataclasses import dataclass, replace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from mok_cute.dsl import deferred
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import halves_of, sm_count
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.comm import protocol as P
from mok_cute.comm.peer_rows import PeerRows, PeerSections
from mok_cute.kernels.route_grad_row import CommCta, EpPull, GatherRows, RowWalk, gather_chunks, mx_round_trips
from mok_cute.kernels.sm90 import persistent, route_rows
from mok_cute.kernels.sm90.route_rows import grouped_rows
from mok_cute.kernels.sm90.persistent import opaque as _opaque
from mok_cute.kernels.sm90.expert_bwd import _expert_k, _ragged_k
from mok_cute.kernels.sm90.grouped_gemm import _VEC, DSwigluEpilogue, PlainEpilogue
from mok_cute.kernels.swiglu_math import Gated, swiglu_args
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, MN_MAJOR, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG, GatherB, MainloopConfig, Sm90Mainloop, SplitB,
    TmaA,
    acc_to_smem, consumer_barrier, experts_last, launch_config,
)
from mok_cute.schedule import fused_bwd_tasks as tasks
from mok_cute.schedule.fused_bwd_tasks import D1, D2, WD, WG
from mok_cute.schedule.fused_tasks import routed_mtiles
from mok_cute.schedule.group_tiles import mtiles, tiles_over

D2_READY, D1_DONE, ROWS_READY, WD_DONE = 24, 25, 26, 27  # status channels: the waits on d2[mt], on the D1 tiles (slot sum),
#                                             on the gathered rows of m-tile mt
KINDS = ("D2", "D1", "dWd", "dWg", "dWu", "shared D2", "shared D1", "shared dWd", "shared dWg", "shared dWu",
         "gather dy", "wait dgrad1", "slot sum", "CTA", "gather x")  # trace record kinds (the trace variant)
GEMM_KINDS, SHARED_KIND, GATHER_KIND, WAIT_KIND, SUM_KIND, CTA_KIND, GATHER_X_KIND = 10, 5, 10, 11, 12, 13, 14
DONE_WORD = 1 + P.STATUS_WORDS  # counters: the ticket, the status words, the stored D1 tiles (scatter)
PULLED_WORD, SUMMED_WORD = DONE_WORD + 1, DONE_WORD + 2  # EP > 1: comm CTAs done pulling, CTAs done summing
WD_WORD = DONE_WORD + 3  # wd_first: the dW_down tiles done (they have read dy's token round trip)
COUNTER_WORDS = DONE_WORD + 4
SUM_BATCH = 8  # slot rows in flight per thread of the dx slot sum
GATHER_WARPS = THREADS_PER_WG // 32  # x_gather: the producer warpgroup's warps share each gathered k-tile's copies
TILE_BAR, READ_BAR = 10, 11  # x_gather: the producer warps' named barriers (a gathered tile handed on, its words
#                              read; 1: the consumers', 2-5: the task hand-off)
_TILE_WORDS = 3  # shared int32 words: the task hand-off (2), the stored D1 tiles (1); x_gather: _GatherTile after
X_UNROLL = 8  # 16-byte loads in flight per lane of the x row copy


class BwdVariant(NamedTuple):
    """What one compiled fused backward contains, each a compile-time switch (the kernel's doc):
    ``clamp`` the SwiGLU limit given; ``scatter`` the dx rows to their (token, slot) rows and the
    fixed-order dx slot sum in the launch, ``init`` from the shared expert's dx; ``gather`` the routed
    dy rows, d topk_w and x rows built by the first CTAs, ``by_route`` from the forward's GEMM2 rows in
    route order; ``shared`` the shared expert's tiles as a second group (its dx the sum's start);
    ``accumulate`` the weight gradients added into fp32 main grads; ``trace`` per-task records;
    ``mx`` the MXFP8 backward's operands; ``add`` an fp32 [T, H] term in the sum's start; ``n_tail``
    H, I or I_s not a multiple of tile_n; ``ep`` EP > 1 (the rows pulled and pushed through the
    workspace); ``grouped_slots`` the dx rows over dy's grouped rows (no [T*k, H] slot buffer); ``wd_first``
    the dW_down tiles first (MXFP8: dgu's round trip along the tokens over dy's; BF16: dW_down reads dy
    itself, so with grouped_slots every dgrad1 tile waits for them before it writes over dy); ``gated`` the
    SwiGLU's alpha and up offset (None: silu(g) * u; :mod:`mok_cute.kernels.swiglu_math`); ``x_gather`` the
    dW_gate / dW_up tiles gather x's token rows in their loads (``routed.x`` the layer's x [T, H], ``routed.tok``
    each grouped row's token: no [M, H] x rows)."""

    clamp: bool
    scatter: bool = False
    init: bool = False
    gather: bool = False
    by_route: bool = False
    shared: bool = False
    accumulate: bool = False
    trace: bool = False
    mx: bool = False
    add: bool = False
    n_tail: bool = False
    ep: bool = False
    grouped_slots: bool = False
    wd_first: bool = False
    gated: Gated | None = None
    x_gather: bool = False


class GroupOperands(NamedTuple):
    """One group's tensors at the launch (:meth:`FusedMoeBwdCoreSm90.__call__`), bf16 unless said: the
    routed experts, or the shared expert as one expert over the T tokens (then ``dy``, ``x`` and ``dx``
    are None: its dy / x are the gather's token rows, its dx the slot sum's start ``SlotSum.init``).

    ``dy``, ``x`` [M, H] the grouped dy and x rows (MXFP8: dy's round trip along H, x's along the
    tokens); ``gu3`` [M, 2, I] gu as the forward saved it; ``h`` [M, I] (MXFP8: its round trip along the
    tokens); ``wg``, ``wu`` [E, I, H], ``wd`` [E, H, I]; ``dgu`` [M, 2I] dgrad1's A; ``dg``, ``du`` [M, I]
    the weight gradients' A (dgu's column halves, or of its MXFP8 round trip along the tokens);
    ``dgu3`` [M, 2, I] D2's output view of ``dgu``; ``dx`` [M, H] the grouped dx rows (None with the slot
    sum); ``dwg``, ``dwu`` [E, I, H], ``dwd`` [E, H, I] (bf16, or fp32 main grads: ``accumulate``);
    ``offsets`` int32 [E+1]; ``d2`` int32 [m-tiles], zeroed: the D2 tiles done per m-tile; ``tok`` int32 [M]
    (``x_gather``, else None): each grouped row's token, ``x`` then the layer's x [T, H]."""

    dy: cute.Tensor | None
    x: cute.Tensor | None
    gu3: cute.Tensor
    h: cute.Tensor
    wg: cute.Tensor
    wu: cute.Tensor
    wd: cute.Tensor
    dgu: cute.Tensor
    dg: cute.Tensor
    du: cute.Tensor
    dgu3: cute.Tensor
    dx: cute.Tensor | None
    dwg: cute.Tensor
    dwu: cute.Tensor
    dwd: cute.Tensor
    offsets: cute.Tensor
    d2: cute.Tensor
    tok: cute.Tensor | None = None


class SlotSum(NamedTuple):
    """The dx scatter and slot sum (``scatter`` variant; else every field None): ``slot`` bf16 [T*k, H]
    the dx slot rows (``grouped_slots``: dy's buffer [M, H]; EP > 1: the workspace's slot section);
    ``order`` int32, [M] grouped row -> t*k + j (``gather``: all T*k routes; ``grouped_slots``: [T*k]
    slot -> grouped row, 0 for a slot without one; EP > 1: [M] packed ``p*T*k + t*k + j``); ``idx`` int32
    [T*k] each slot's expert (-1: none); ``init`` bf16 [T, H] or None, the sum's start (the shared
    expert's dx); ``out`` bf16 [T, H], dx."""

    slot: cute.Tensor | None
    order: cute.Tensor | None
    idx: cute.Tensor | None
    init: cute.Tensor | None
    out: cute.Tensor | None


class MxOperands(NamedTuple):
    """The MXFP8 variant's own tensors (else both None): ``dy_t`` bf16 [M, H] dy's round trip along the
    tokens (dW_down's A; ``gather``: written by the comm CTAs), ``dgu_t3`` bf16 [M, 2, I] dgu's round
    trip along the tokens, written by the dSwiGLU epilogue (the buffer the ``dg`` / ``du`` views see)."""

    dy_t: cute.Tensor | None
    dgu_t3: cute.Tensor | None


class Scalars(NamedTuple):
    """The launch's scalars: ``k`` routes per token, ``comm_ctas`` (``gather``: the CTAs that build the
    rows first), ``limit`` fp32 the SwiGLU clamp (0: none), ``num_ctas`` the grid (a launch parameter,
    None in the kernel's bundle), ``timeout_ns`` every device wait's bound."""

    k: Int32
    comm_ctas: Int32
    limit: Float32
    num_ctas: Int32 | None
    timeout_ns: Int64


class EpOperands(NamedTuple):
    """EP > 1 (``ep`` variant; at EP = 1 the tensors None and the scalars :data:`_NO_EP`):
    ``peer`` int64 [R] the workspaces' bases, ``status`` int32 [4] the workspace's status (every wait's
    error), this rank ``me`` of ``n_ranks``, the byte offsets of the workspace sections ``src`` (x),
    ``dy``, ``slots`` and ``flags`` (:data:`EP_SECTIONS`), the launch's pull and push epochs."""

    peer: cute.Tensor | None
    status: cute.Tensor | None
    me: Int32
    n_ranks: Int32
    src_off: Int64
    dy_off: Int64
    slots_off: Int64
    flags_off: Int64
    epoch_pull: Int32
    epoch_push: Int32


class GroupTma(NamedTuple):
    """One group's TMA atoms and coordinate tensors (:meth:`FusedMoeBwdCoreSm90._tma`): D2 reads dy
    and w_down, D1 dgu, w_gate and w_up, the weight gradients dy (MXFP8: its round trip along the
    tokens), h, dg, x and du along the rows (``t`` suffix: ragged along the rows)."""

    atom_dy: cute.CopyAtom
    coord_dy: cute.Tensor
    atom_wd: cute.CopyAtom
    coord_wd: cute.Tensor
    atom_dgu: cute.CopyAtom
    coord_dgu: cute.Tensor
    atom_wg: cute.CopyAtom
    coord_wg: cute.Tensor
    atom_wu: cute.CopyAtom
    coord_wu: cute.Tensor
    atom_dyt: cute.CopyAtom
    coord_dyt: cute.Tensor
    atom_ht: cute.CopyAtom
    coord_ht: cute.Tensor
    atom_dgt: cute.CopyAtom
    coord_dgt: cute.Tensor
    atom_xt: cute.CopyAtom
    coord_xt: cute.Tensor
    atom_dut: cute.CopyAtom
    coord_dut: cute.Tensor


class GroupTensors(NamedTuple):
    """One group's tensors in the kernel beside its TMA operands (:class:`GroupOperands`' of the same
    name; ``dx`` of the shared group: the slot sum's start; ``dgut3``: the MXFP8 variant's dgu round
    trip along the tokens, else None; ``x`` / ``tok``: the ``x_gather`` variant's token rows and each grouped
    row's token, else None)."""

    gu3: cute.Tensor
    dgu3: cute.Tensor
    dx: cute.Tensor | None
    dwg: cute.Tensor
    dwu: cute.Tensor
    dwd: cute.Tensor
    offsets: cute.Tensor
    d2: cute.Tensor
    dgut3: cute.Tensor | None
    x: cute.Tensor | None = None
    tok: cute.Tensor | None = None


class _GatherTile(NamedTuple):
    """A dW_gate / dW_up tile producer warp 0 hands on to warps 1-3 (``x_gather``): the expert's rows ``lo``,
    ``length``, the tile's ``n_tile``, its k-tiles ``k_rows`` (-1: stop) and the ring state of its first."""

    lo: Int32
    length: Int32
    n_tile: Int32
    k_rows: Int32
    index: Int32
    phase: Int32


class _Smem(NamedTuple):
    """A CTA's shared memory as its roles use it: the mbarrier ring ``pipe``, the ring's ``views``
    ``(sA, sB, sA_w, sB_w)`` (D2 / D1 and W mainloops), the ``storage`` struct (epilogue staging, extra
    words) and the ``task`` hand-off words."""

    pipe: object
    views: tuple
    storage: object
    task: cute.Tensor


def _absent(bundle, cls):
    """``bundle``, or ``cls`` with every field None where it is None."""
    return cls(*(None,) * len(cls._fields)) if bundle is None else bundle


def _present(bundle):
    """``bundle``, or None where every field is None (how the launch passes an absent bundle)."""
    return None if all(v is None for v in bundle) else bundle


class FusedMoeBwdCoreSm90:
    """The persistent routed backward (see the module doc); ``clamp``: the SwiGLU limit given;
    ``n_tail``: H, I or I_s not a multiple of tile_n (the last n-tiles' stores masked); ``ep``: EP > 1
    (with gather and scatter: the dy / x rows pulled from the source ranks, the dx rows pushed to
    them, d topk_w of this rank's routes, :func:`fused_backward_ep`)."""

    def __init__(self, v: BwdVariant, cfg: MainloopConfig = MainloopConfig()):
        _check_variant(v)
        clamp, mx, n_tail = v.clamp, v.mx, v.n_tail
        self.cfg, self.clamp, self.scatter, self.gather, self.by_route = cfg, clamp, v.scatter, v.gather, v.by_route
        self.shared, self.accumulate = v.shared, v.accumulate  # accumulate: dW tiles added into fp32 main grads
        self.trace, self.mx, self.n_tail, self.ep, self.grouped_slots = v.trace, mx, n_tail, v.ep, v.grouped_slots
        # wd_first: every dW_down tile runs first and counts itself done (WD_WORD). MXFP8: the producer of a D2
        # tile waits for all of them, so D2 may write dgu's token round trip over dy's (the caller's buffers).
        # BF16 (grouped_slots): dW_down reads dy itself, so the producer of a D1 tile waits for them before its
        # dx rows go over dy's. Routed group only: grouped_slots has no shared group in the launch
        self.wd_first = v.wd_first
        self.x_gather = v.x_gather  # dW_gate / dW_up: x's token rows gathered in the producer's loads
        # a W tile's readiness waits side by side in the producer warp's lanes (tasks.expert_mtile_range,
        # persistent.wait_inputs); not where the producer has no registers to spare (the gather / shared variants)
        self.lanes = v.grouped_slots
        self.extra = GATHER_WARPS - 1 if v.x_gather else 0  # the TMA tiles' arrivals for the other gathering warps
        self.dswiglu = DSwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp, mx, n_tail, v.gated)
        self.plain = PlainEpilogue(cfg.tile_m, cfg.tile_n, n_tail)
        epi = max(self.dswiglu.smem_elems(), self.plain.smem_elems())
        self.epi_elems = epi
        self.ml_d = Sm90Mainloop(cfg, epi_smem_bytes=epi * 2, b_major=MN_MAJOR)  # D2, D1
        self.ml_w = Sm90Mainloop(cfg, epi_smem_bytes=epi * 2, a_major=MN_MAJOR, b_major=MN_MAJOR)  # W
        assert self.ml_d.stages == self.ml_w.stages
        b_bytes = self.ml_d.stages * cfg.tile_n * cfg.tile_k * 2
        if self.scatter and SUM_BATCH * NUM_THREADS * _VEC * 2 > b_bytes:
            raise ValueError(f"SUM_BATCH {SUM_BATCH}: the dx slot sum's cp.async buffer must fit the B stages "
                             f"({b_bytes} bytes at tile_n {cfg.tile_n}, {self.ml_d.stages} stages)")

    @cute.jit
    def __call__(self, routed: GroupOperands, mCounters: cute.Tensor, slots: SlotSum, rows: GatherRows,
                 shared: GroupOperands, mx: MxOperands, mAdd: cute.Tensor, mTrace: cute.Tensor, sc: Scalars,
                 ep: EpOperands, stream: cuda.CUstream):
        """``routed``: the routed experts' :class:`GroupOperands`; ``mCounters`` int32, zeroed: the
        ticket, the status words (int32[4] at 1, every wait's error), the D1 tiles stored, the EP and
        ``wd_first`` words (:data:`COUNTER_WORDS`); ``slots``: :class:`SlotSum` (``scatter`` variant);
        ``rows``: the ``gather`` variant's :class:`~mok_cute.kernels.route_grad_row.GatherRows` (its
        ``dy_rows`` / ``x_rows`` / ``dyt_rows`` None: the comm CTAs write ``routed.dy`` / ``routed.x`` /
        ``mx.dy_t``), the first ``comm_ctas`` CTAs building ``routed.dy`` / ``routed.x`` from ``dy_tok`` /
        ``x_tok`` [T, H] and the forward's GEMM2 rows ``r`` (grouped, or ``by_route`` in route order) with
        topk_w / d topk_w ``w`` / ``dtw`` fp32 [T*k], publishing routed m-tile c on ``ready[c]``
        (``slots.order`` then holds all T*k routes); ``shared`` variant: ``rows.dy_tok`` / ``x_tok`` also
        carry the shared group (``shared``: its :class:`GroupOperands`, offsets [0, T]), its dx written
        into ``slots.init``; ``mx``: :class:`MxOperands` (the MXFP8 backward, every operand an MXFP8
        round trip as the unfused one reads it: ``routed.dy`` dy's along H (dgrad2's A), ``mx.dy_t``
        along the tokens (dW_down's A), ``routed.x`` / ``h`` those of x / h along the tokens, the weights
        dequantized; the dSwiGLU epilogue writes dgu's along 2I into ``dgu`` (dgrad1's A) and along the
        tokens into ``mx.dgu_t3`` (the weight gradients' A); with ``gather`` the comm CTAs make dy's,
        ``dy_t`` and x's, ``route_grad_row.gather_chunks``); ``grouped_slots`` variant (no gather, no
        shared group): ``slots.slot`` is dy's buffer [M, H] itself, each dgrad1 tile writes its dx rows over
        dy's grouped rows (dead once the m-tile's dgrad2 tiles, which dgrad1 waits for, have read them; at
        BF16 the dW_down tiles read dy too: they run first, ``wd_first``, and dgrad1 waits for them),
        ``slots.order`` [T*k] maps t*k + j to its grouped row; ``mAdd`` fp32 [T, H] (scatter variant) or
        None: added to the slot sum's start (the shared expert's output gate's share of dx); ``trace``
        variant: ``mTrace`` int64 [n * TRACE_WORDS] (task t's record at t, gather chunk c's at n_tasks +
        c (its x pass n_tasks + chunks + c), the last three per CTA: its life from entry to exit, its
        dgrad1 wait and its slot sum); else None; ``sc``: :class:`Scalars`; ``ep``: :class:`EpOperands`
        (``ep`` variant: ``slots.order`` [M] packed ``p*T*k + t*k + j``, ``rows.w`` fp32 [M] each grouped
        row's router weight, ``rows.r`` [T*k, H] this rank's slot rows of the forward, ``slots.slot`` the
        workspace's slot section). A bundle whose fields would all be None is passed as None (the DSL
        takes no all-None tuple as an argument); it reads as that all-None bundle here."""
        slots, rows, shared, mx = (_absent(b, cls) for b, cls in ((slots, SlotSum), (rows, GatherRows),
                                                                  (shared, GroupOperands), (mx, MxOperands)))
        self.ml_d.setup()
        self.ml_w.setup()
        r_tma = self._tma(routed, mx.dy_t)
        s_tma, s_t = None, None
        if cutlass.const_expr(self.shared):  # its dy / x: the layer's token rows, its dx: the slot sum's start
            s_tma = self._tma(shared._replace(dy=rows.dy_tok, x=rows.x_tok))
            s_t = GroupTensors(shared.gu3, shared.dgu3, slots.init, shared.dwg, shared.dwu, shared.dwd, shared.offsets,
                               shared.d2, None)
        words = _TILE_WORDS + (len(_GatherTile._fields) if self.x_gather else 0)
        self.shared_storage = self.ml_d.shared_storage(self.epi_elems, extra_i32=words)
        ep_args = None
        if cutlass.const_expr(self.ep):
            ep_args = ep
        r_t = GroupTensors(routed.gu3, routed.dgu3, routed.dx, routed.dwg, routed.dwu, routed.dwd, routed.offsets,
                           routed.d2, mx.dgu_t3, routed.x if self.x_gather else None, routed.tok)
        k_rows = rows._replace(dy_rows=routed.dy, x_rows=routed.x, dyt_rows=mx.dy_t if self.gather else None)
        self.kernel(r_tma, r_t, s_tma, s_t, mCounters, slots, k_rows, mAdd, mTrace, sc._replace(num_ctas=None),
                    ep_args).launch(grid=[sc.num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1],
                                    min_blocks_per_mp=1, stream=stream)

    def _tma(self, g: GroupOperands, dyt: cute.Tensor = None) -> GroupTma:
        """Group ``g``'s TMA atoms and coordinates: D2 reads dy (M, H) K-major and w_down as (I, H, E)
        MN-major; D1 dgu (M, 2I) K-major and w_gate then w_up along K, each (H, I, E) MN-major; W (N,
        rows) MN-major operands, ragged along the rows (expert_bwd), dW_down's dy from ``dyt`` when
        given (the MXFP8 variant's)."""
        md, mw = self.ml_d, self.ml_w
        d2 = md.make_tma(g.dy, experts_last(g.wd, True))
        d1 = md.make_tma(g.dgu, experts_last(g.wg, True))
        _, _, atom_wu, coord_wu = md.make_tma(g.dgu, experts_last(g.wu, True))
        wd = mw.make_tma(_ragged_k(g.dy if dyt is None else dyt), _ragged_k(g.h))
        wg = mw.make_tma(_ragged_k(g.dg), _ragged_k(g.x))
        atom_dut, coord_dut, _, _ = mw.make_tma(_ragged_k(g.du), _ragged_k(g.x))
        return GroupTma(*d2, *d1, atom_wu, coord_wu, *wd, *wg, atom_dut, coord_dut)

    @cute.kernel
    def kernel(self, r_tma: GroupTma, r_t: GroupTensors, s_tma: GroupTma, s_t: GroupTensors, mCounters: cute.Tensor,
               slots: SlotSum, rows: GatherRows, mAdd: cute.Tensor, mTrace: cute.Tensor, sc: Scalars,
               ep_args: EpOperands):
        """:meth:`__call__`'s bundles as the CTAs read them: each group's TMA operands and tensors (the
        shared group's None without it), ``rows`` with ``dy_rows`` / ``x_rows`` the routed group's dy and
        x (``dyt_rows``: the MXFP8 gather's ``dy_t``, else None), ``sc`` without ``num_ctas``,
        ``ep_args`` None at EP = 1."""
        mSlot, mOrder, mIdx, mInit, mOut = slots
        k, comm_ctas, limit, _, timeout_ns = sc
        cfg = self.cfg
        md, mw = self.ml_d, self.ml_w
        t_entry = persistent.now(self.trace)
        atoms = [r_tma[i] for i in range(0, len(r_tma), 2)]
        if cutlass.const_expr(self.shared):
            atoms += [s_tma[i] for i in range(0, len(s_tma), 2)]
        tidx, warp = md.start(atoms)
        mw.setup()
        pipe, sA, sB, _, storage = md.allocate(self.shared_storage, self.plain, with_storage=True,
                                               producers=GATHER_WARPS if self.x_gather else 1)
        sA_w = storage.sA.get_tensor(mw.a_smem_staged.outer, swizzle=mw.a_smem_staged.inner)
        sB_w = storage.sB.get_tensor(mw.b_smem_staged.outer, swizzle=mw.b_smem_staged.inner)
        sTask = storage.extra.get_tensor(cute.make_layout(2))
        views = (sA, sB, sA_w, sB_w)
        smem = _Smem(pipe, views, storage, sTask)
        routed = _Group(r_tma, r_t, cfg, self.n_tail)
        shared = _Group(s_tma, s_t, cfg, self.n_tail) if cutlass.const_expr(self.shared) else None
        n_tasks = routed.n_tasks
        n_done = routed.n_d1  # the tiles the dx slot sum waits for
        if cutlass.const_expr(self.shared):
            n_tasks += shared.n_tasks
            n_done += shared.n_d1
        status = mCounters.iterator + 1
        ep = ep_dy = None  # EP > 1: the workspace's x rows (``src``) and dy rows as pull sources
        if cutlass.const_expr(self.ep):
            mPeer, mStatus, me, n_ranks, src_off, dy_off, slots_off, flags_off, epoch_pull, epoch_push = ep_args
            status = mStatus.iterator
            ep = PeerRows(mPeer, rows.w, me, n_ranks, PeerSections(src_off, slots_off, Int64(0), flags_off),
                          epoch_pull, epoch_push, mIdx.shape[0], timeout_ns, status)
            ep_dy = PeerRows(mPeer, rows.w, me, n_ranks, PeerSections(dy_off, slots_off, Int64(0), flags_off),
                             epoch_pull, epoch_push, mIdx.shape[0], timeout_ns, status)
        if cutlass.const_expr(self.gather):
            bidx, _, _ = cute.arch.block_idx()
            if bidx < comm_ctas:  # first the routed rows, then GEMM tasks like every CTA
                self._gather(CommCta(tidx, bidx, comm_ctas, NUM_THREADS), routed, slots, rows, k, mTrace, n_tasks,
                             EpPull(ep, ep_dy, mCounters.iterator, PULLED_WORD))
                cute.arch.barrier()
        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self._produce(smem, mCounters.iterator, n_tasks, routed, shared, rows.ready, status, timeout_ns,
                              mCounters.iterator + WD_WORD)
            elif cutlass.const_expr(self.x_gather):
                self._gather_x(smem, routed, warp)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(smem, tidx - THREADS_PER_WG, n_tasks, routed, shared, limit, slots,
                          mCounters.iterator + DONE_WORD, mTrace, ep, mCounters.iterator + WD_WORD)
        if cutlass.const_expr(self.scatter):
            # every CTA: the dx slot sum once every dgrad1 tile is stored, registers evened out as in
            # the fused forward (the consumers give theirs back before the producer warpgroup takes any)
            if warp >= THREADS_PER_WG // 32:
                cute.arch.setmaxregister_decrease(route_rows.SUM_REGS)
            cute.arch.barrier()
            if warp < THREADS_PER_WG // 32:
                cute.arch.setmaxregister_increase(route_rows.SUM_REGS)
            t0 = persistent.now(self.trace)
            if tidx == 0:
                P.wait_geq(mCounters.iterator + DONE_WORD, n_done, timeout_ns, status, Int32(0), Int32(D1_DONE))
                if cutlass.const_expr(self.ep):  # every rank's dx rows are in my slot buffer (DATA)
                    ep.wait_rows(cute.arch.block_idx()[0])
            cute.arch.barrier()
            t1 = persistent.now(self.trace)
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            sbuf = cute.make_tensor(storage.sB.data_ptr(), cute.make_layout((SUM_BATCH * NUM_THREADS, _VEC),
                                                                            stride=(_VEC, 1)))
            route_rows.slot_sum(tidx, bidx, grid, route_rows.SlotSumOperands(
                mSlot, mInit, mOut, mIdx, None, None, mAdd, None, mOrder if self.grouped_slots else None),
                k, mOut.shape[0], routed.hidden, sbuf, SUM_BATCH)
            if cutlass.const_expr(self.ep):  # every CTA has read its slot rows: the last one says FREE
                ep.close_push(tidx, mCounters.iterator + SUMMED_WORD, grid)
            if cutlass.const_expr(self.trace):
                if tidx == 0:
                    base = mTrace.shape[0] // persistent.TRACE_WORDS - 3 * grid + 3 * bidx
                    persistent.record(mTrace, base + 1, t0, t1, WAIT_KIND, bidx, Int32(0))
                    persistent.record(mTrace, base + 2, t1, persistent.now(self.trace), SUM_KIND, bidx, Int32(0))
        if cutlass.const_expr(self.trace):  # the CTA's life, entry to exit: the kernel's start-up and tail
            cute.arch.barrier()
            cta = cute.arch.block_idx()[0]
            ctas = cute.arch.grid_dim()[0]
            if tidx == 0:
                base = mTrace.shape[0] // persistent.TRACE_WORDS - 3 * ctas + 3 * cta
                persistent.record(mTrace, base, t_entry, persistent.now(self.trace), CTA_KIND, cta, Int32(0))

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _produce(self, smem: _Smem, ticket: cute.Pointer, n_tasks: Int32, routed, shared, mGdy: cute.Tensor,
                 status: cute.Pointer, timeout_ns: Int64, wd_done: cute.Pointer):
        """Producer warp: claim tasks in list order, hand each to the consumers, wait for its
        inputs, then TMA its k-tiles; a task id >= n_tasks handed off last stops the consumers."""
        pipe, sTask = smem.pipe, smem.task
        state = self.ml_d.producer_state()
        rc = (Int32(0), Int32(0), Int32(0), Int32(0), Int32(-1), Int32(-1), Int32(0))  # routed: cursors, ready
        sc = (Int32(0), Int32(0), Int32(0), Int32(0), Int32(-1), Int32(-1), Int32(0))  # experts, dW_down seen done
        i = Int32(0)
        t = persistent.claim(ticket)
        while t < n_tasks:
            persistent.hand_off(sTask, i, t)
            i += 1
            if cutlass.const_expr(self.shared):
                grp, lt = _split(t, shared, routed)
                if grp == 0:
                    state, sc = self._load(shared, lt, smem, state, sc, mGdy, status, timeout_ns, False)
                else:
                    state, rc = self._load(routed, lt, smem, state, rc, mGdy, status, timeout_ns, self.gather)
            else:
                state, rc = self._load(routed, t, smem, state, rc, mGdy, status, timeout_ns, self.gather, wd_done)
            t = persistent.claim(ticket)
        persistent.hand_off(sTask, i, t)
        persistent.finish_hand_offs(i)
        if cutlass.const_expr(self.x_gather):  # the other producer warps stop
            self._hand_on(smem, _GatherTile(Int32(0), Int32(0), Int32(0), Int32(-1), Int32(0), Int32(0)))
        pipe.producer_tail(state)

    @cute.jit
    def _load(self, g, lt: Int32, smem: _Smem, state, cur, mGdy: cute.Tensor, status: cute.Pointer,
              timeout_ns: Int64, gather: cutlass.Constexpr, wd_done: cute.Pointer = None):
        """Producer warp, group ``g``'s task ``lt``: wait for its inputs, TMA its k-tiles. ``cur``:
        the group's (D2 cursor, D1 cursor, last expert whose dgrad2 tiles / gathered rows this
        producer saw complete, 1 once it saw every dW_down tile done); returns ``(state, cur)``.
        ``wd_first`` (``wd_done``: the dW_down tiles done, given for the routed group): a D2 tile (MXFP8) or a
        D1 tile (BF16 grouped_slots) first waits for every dW_down tile."""
        cfg = self.cfg
        pipe, (sA, sB, sA_w, sB_w) = smem.pipe, smem.views
        e1, b1, e2, b2, ready_e, ready_g, wd_seen = cur
        phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = tasks.core_task(
            lt, g.dims, g.offsets, g.num_experts, cfg.tile_m, (e1, b1, e2, b2), self.wd_first)
        k_h = g.hidden // cfg.tile_k
        k_i = g.inter // cfg.tile_k
        if phase == D2:
            if cutlass.const_expr(self.wd_first and self.mx):
                wd_seen = self._wait_wd_done(g, wd_done, wd_seen, timeout_ns, status)
            if cutlass.const_expr(gather):
                persistent.wait_input(mGdy.iterator + mt, Int32(1), timeout_ns, status, Int32(ROWS_READY), mt)
            gA = cute.local_tile(cute.domain_offset((row0, 0), g.coord_dy), (cfg.tile_m, cfg.tile_k), (0, None))
            gB = cute.local_tile(g.coord_wd[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
            state = self.ml_d.load_tile(pipe, state, g.atom_dy, gA, sA, g.atom_wd, gB, sB, k_h,
                                        extra_arrivals=self.extra)
        elif phase == D1:
            persistent.wait_input(g.d2.iterator + mt, g.n_i, timeout_ns, status, Int32(D2_READY), mt)
            if cutlass.const_expr(self.grouped_slots and not self.mx):  # dx over dy, which dW_down reads (BF16)
                wd_seen = self._wait_wd_done(g, wd_done, wd_seen, timeout_ns, status)
            gA = cute.local_tile(cute.domain_offset((row0, 0), g.coord_dgu), (cfg.tile_m, cfg.tile_k), (0, None))
            gB = cute.local_tile(g.coord_wg[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
            gB2 = cute.local_tile(g.coord_wu[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
            state = self.ml_d.load_tile(pipe, state, g.atom_dgu, gA, sA, g.atom_wg, gB, sB, k_i,
                                        SplitB(g.atom_wu, gB2, k_i),
                                        extra_arrivals=self.extra)
        else:
            lo = g.offsets[expert]
            length = g.offsets[expert + 1] - lo
            k_rows = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
            if cutlass.const_expr(gather):
                if expert != ready_g:  # the expert's dy and x rows (both passes), once per expert and CTA
                    first, count = tasks.expert_mtile_range(g.offsets, expert, cfg.tile_m, self.lanes)
                    persistent.wait_inputs(mGdy.iterator, first, count, Int32(2), timeout_ns, status,
                                           Int32(ROWS_READY), self.lanes)
                    ready_g = expert
            if which == WD:
                gA = cute.local_tile(_expert_k(g.coord_dyt, lo, length), (cfg.tile_m, cfg.tile_k), (m_tile, None))
                gB = cute.local_tile(_expert_k(g.coord_ht, lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
                state = self.ml_w.load_tile(pipe, state, g.atom_dyt, gA, sA_w, g.atom_ht, gB, sB_w, k_rows,
                                        extra_arrivals=self.extra)
            else:
                if expert != ready_e:  # once per expert and CTA: its tickets only grow
                    first, count = tasks.expert_mtile_range(g.offsets, expert, cfg.tile_m, self.lanes)
                    persistent.wait_inputs(g.d2.iterator, first, count, g.n_i, timeout_ns, status, Int32(D2_READY),
                                           self.lanes)
                    ready_e = expert
                if which == WG:
                    state = self._load_wx(g, g.atom_dgt, g.coord_dgt, smem, state, (lo, length, n_tile, m_tile, k_rows))
                else:
                    state = self._load_wx(g, g.atom_dut, g.coord_dut, smem, state, (lo, length, n_tile, m_tile, k_rows))
        return state, (e1, b1, e2, b2, ready_e, ready_g, wd_seen)

    @cute.jit
    def _wait_wd_done(self, g, wd_done: cute.Pointer, wd_seen: Int32, timeout_ns: Int64, status: cute.Pointer):
        """``wd_first``: wait until every dW_down tile of group ``g`` counted itself on ``wd_done`` (after its
        epilogue), unless this CTA saw that already (``wd_seen`` 1: the count only grows); returns 1."""
        if wd_seen == 0:
            wd_m, wd_n, _, _ = g.wdims
            persistent.wait_input(wd_done, g.num_experts * wd_m * wd_n, timeout_ns, status, Int32(WD_DONE), Int32(0))
            wd_seen = Int32(1)
        return wd_seen

    @cute.jit
    def _load_wx(self, g, atom_a: cute.CopyAtom, coord_a: cute.Tensor, smem: _Smem, state, tile: tuple):
        """Producer warp: the k-tiles of a dW_gate / dW_up tile ``tile`` = ``(lo, length, n_tile, m_tile, k_rows)``
        (the expert's rows, the tile, its k-tiles), A (``atom_a``, ``coord_a``: dg or du along the rows) by TMA, B
        x's rows: by TMA from the grouped x rows, or (``x_gather``) gathered from x's token rows
        (:meth:`~mok_cute.kernels.sm90.mainloop.Sm90Mainloop.load_tile_gather_b`). Returns the state."""
        cfg = self.cfg
        lo, length, n_tile, m_tile, k_rows = tile
        pipe, (_, _, sA_w, sB_w) = smem.pipe, smem.views
        gA = cute.local_tile(_expert_k(coord_a, lo, length), (cfg.tile_m, cfg.tile_k), (m_tile, None))
        if cutlass.const_expr(self.x_gather and g.tok is not None):
            self._hand_on(smem, _GatherTile(lo, length, n_tile, k_rows, state.index, state.phase))
            state = self.ml_w.load_tile_gather_b(pipe, state, smem.storage.sB.data_ptr().toint(),
                                                 self._x_rows(g, lo, length, n_tile), k_rows,
                                                 TmaA(atom_a, gA, sA_w), Int32(0), GATHER_WARPS)
        else:
            gB = cute.local_tile(_expert_k(g.coord_xt, lo, length), (cfg.tile_n, cfg.tile_k), (n_tile, None))
            state = self.ml_w.load_tile(pipe, state, atom_a, gA, sA_w, g.atom_xt, gB, sB_w, k_rows,
                                        extra_arrivals=self.extra)
        return state

    def _x_rows(self, g, lo: Int32, length: Int32, n_tile: Int32) -> GatherB:
        """The x rows of one dW_gate / dW_up tile (``x_gather``): expert rows ``lo .. lo + length`` of group ``g``,
        each its token's row of ``g.x``, the columns of ``n_tile``."""
        xb = g.x.element_type.width // 8
        return GatherB(g.x.iterator.toint(), Int64(g.x.stride[0]) * xb, n_tile * (self.cfg.tile_n * xb),
                       g.hidden * xb, g.tok, lo, length)

    @cute.jit
    def _hand_on(self, smem: _Smem, tile: _GatherTile):
        """Producer warp 0 (``x_gather``): hand a gathered tile (``k_rows`` -1: stop) to warps 1-3 (``TILE_BAR``),
        then wait until they have read its words (``READ_BAR``), so the next hand-on cannot overwrite them."""
        words = cute.make_tensor(smem.storage.extra.data_ptr() + _TILE_WORDS, cute.make_layout(len(tile)))
        if cute.arch.lane_idx() == 0:
            for j in cutlass.range_constexpr(len(tile)):
                words[j] = tile[j]
        cute.arch.barrier(barrier_id=TILE_BAR, number_of_threads=THREADS_PER_WG)
        cute.arch.barrier(barrier_id=READ_BAR, number_of_threads=THREADS_PER_WG)

    @cute.jit
    def _gather_x(self, smem: _Smem, routed, warp: Int32):
        """Producer warps 1-3 (``x_gather``): for every dW_gate / dW_up tile producer warp 0 hands on
        (:meth:`_hand_on`), their share of its x rows' copies (``load_tile_gather_b`` at the tile's ring slot);
        until the stop."""
        n_words = len(_GatherTile._fields)
        words = cute.make_tensor(smem.storage.extra.data_ptr() + _TILE_WORDS, cute.make_layout(n_words))
        go = Int32(1)
        while go > 0:
            cute.arch.barrier(barrier_id=TILE_BAR, number_of_threads=THREADS_PER_WG)
            tile = _GatherTile(*(words[j] for j in range(n_words)))
            cute.arch.barrier_arrive(barrier_id=READ_BAR, number_of_threads=THREADS_PER_WG)
            if tile.k_rows < 0:
                go = Int32(0)
            else:
                state = pipeline.PipelineState(self.ml_w.stages, Int32(0), tile.index, tile.phase)
                self.ml_w.load_tile_gather_b(smem.pipe, state, smem.storage.sB.data_ptr().toint(),
                                             self._x_rows(routed, tile.lo, tile.length, tile.n_tile), tile.k_rows,
                                             None, warp, GATHER_WARPS)

    @cute.jit
    def _consume(self, smem: _Smem, tid: Int32, n_tasks: Int32, routed, shared, limit: Float32, slots: SlotSum,
                 done: cute.Pointer, mTrace: cute.Tensor, ep, wd_done: cute.Pointer):
        """Consumer warpgroups: MMA each task's tile and run its epilogue (:meth:`_compute`); traced,
        consumer thread 0 records each task from its hand-off to its epilogue's end. EP > 1: first,
        every rank must have freed its slot buffer of the previous push round (FREE >= epoch - 1;
        an earlier launch's, so nothing in this one waits for it)."""
        storage, sTask = smem.storage, smem.task
        if cutlass.const_expr(self.ep):
            if tid == 0:
                ep.wait_free()
            consumer_barrier()
        state = self.ml_d.consumer_state()
        rc = (Int32(0), Int32(0), Int32(0), Int32(0))
        sc = (Int32(0), Int32(0), Int32(0), Int32(0))
        i = Int32(0)
        sD1 = cute.make_tensor(storage.extra.data_ptr() + 2, cute.make_layout(1))  # after sTask
        if tid == 0:  # D1 tiles stored (with the slot sum), in shared memory (no register held across the tasks)
            sD1[0] = Int32(0)
        t = persistent.take(sTask, i)
        while t < n_tasks:
            i += 1
            t0 = persistent.now(self.trace)
            kind = Int32(0)
            if cutlass.const_expr(self.shared):
                grp, lt = _split(t, shared, routed)
                if grp == 0:
                    state, sc, kind = self._compute(shared, lt, smem, state, tid, sc, limit, slots, False)
                    kind += SHARED_KIND
                else:
                    state, rc, kind = self._compute(routed, lt, smem, state, tid, rc, limit, slots, self.scatter, ep)
            else:
                state, rc, kind = self._compute(routed, t, smem, state, tid, rc, limit, slots, self.scatter, ep,
                                                wd_done)
            if cutlass.const_expr(self.scatter):
                if tid == 0:
                    if kind % SHARED_KIND == 1:
                        sD1[0] = sD1[0] + 1
            if cutlass.const_expr(self.trace):
                if tid == 0:
                    bidx, _, _ = cute.arch.block_idx()
                    persistent.record(mTrace, t, t0, persistent.now(self.trace), kind, bidx, t)
            t = persistent.take(sTask, i)
        if cutlass.const_expr(self.scatter):  # only the slot sum, after every task, waits for ``done``
            if tid == 0:  # one fence (EP > 1: system scope), cumulative over the rows each D1 tile's barrier ordered
                persistent.publish_count(done, sD1[0], self.ep)

    @cute.jit
    def _compute(self, g, lt: Int32, smem: _Smem, state, tid: Int32, cur, limit: Float32, slots: SlotSum,
                 scatter: cutlass.Constexpr, ep=None, wd_done: cute.Pointer = None):
        """Consumer warpgroups, group ``g``'s task ``lt``: a D2 tile is published on ``g.d2[mt]``
        (release) once its dgu rows are stored; a D1 tile's rows go to ``g.dx`` (``scatter``: to
        their (token, slot) rows, ``ep``: on their source ranks); in a kernel with the slot sum every D1 tile is
        counted (on ``done``, by :meth:`_consume` after the CTA's last task). ``cur``: the group's D2 and D1
        cursors; returns ``(state, cur, trace kind)``
        (D2 0, D1 1, dWd / dWg / dWu 2-4). ``wd_first`` (``wd_done``: given for the routed group): a dW_down tile counts itself on
        ``wd_done`` (release) once its epilogue is done (its operand loads landed before its MMAs)."""
        cfg = self.cfg
        pipe, (sA, sB, sA_w, sB_w), storage = smem.pipe, smem.views, smem.storage
        mSlot, mOrder = slots.slot, slots.order
        e1, b1, e2, b2 = cur
        phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2 = tasks.core_task(
            lt, g.dims, g.offsets, g.num_experts, cfg.tile_m, (e1, b1, e2, b2), self.wd_first)
        k_h = g.hidden // cfg.tile_k
        k_2i = 2 * (g.inter // cfg.tile_k)
        et = _opaque(tid)  # the epilogues' shared addresses rebuilt per tile, not held across the loop
        # each branch builds its own fragments and accumulator: none is live across the tasks
        if phase == D2:
            thr_d, tCrA, tCrB, acc = self.ml_d.consumer_fragments(sA, sB, et)
            s_dsw = self.dswiglu.smem_tensor(storage.sC)
            self.dswiglu.prefetch(s_dsw, et, row0, rows, n_tile, g.gu3)
            state = self.ml_d.mma_tile(pipe, state, tCrA, tCrB, acc, k_h)
            self.dswiglu.run(self.ml_d.tiled_mma, thr_d, acc, s_dsw, et, row0, rows, n_tile, g.dgu3, g.gu3, limit,
                             g.dgut3)
            consumer_barrier()
            if tid == 0:  # one fence, cumulative over the consumers' dgu stores ordered before it by the barrier
                cute.arch.fence_acq_rel_gpu()
                cute.arch.atomic_add(g.d2.iterator + mt, Int32(1), sem="release", scope="gpu")
        elif phase == D1:
            thr_d, tCrA, tCrB, acc = self.ml_d.consumer_fragments(sA, sB, et)
            routes = None  # the scattered rows' routes, loaded before the mainloop (not at MXFP8: its 255
            if cutlass.const_expr(scatter and not self.grouped_slots and not self.mx):  # registers would spill)
                routes = route_rows.tile_routes(tid, row0, rows, mOrder, cfg.tile_m, cfg.tile_n)
            state = self.ml_d.mma_tile(pipe, state, tCrA, tCrB, acc, k_2i)
            s_plain = self.plain.smem_tensor(storage.sC)
            if cutlass.const_expr(self.grouped_slots):  # over dy's rows: every dgrad2 tile of m-tile mt (and, BF16,
                # every dW_down tile: the producer waited) has read them
                self.plain.run(self.ml_d.tiled_mma, thr_d, acc, s_plain, et, row0, rows, n_tile, mSlot, mSlot,
                               Float32(0.0))
            elif cutlass.const_expr(scatter):
                acc_to_smem(thr_d, acc, s_plain)
                consumer_barrier()
                route_rows.scatter(s_plain, et, row0, rows, n_tile, mSlot, mOrder, cfg.tile_n, ep, self.n_tail, routes)
            else:
                self.plain.run(self.ml_d.tiled_mma, thr_d, acc, s_plain, et, row0, rows, n_tile, g.dx, g.dx,
                               Float32(0.0))
            if cutlass.const_expr(self.scatter):  # the slot sum counts this tile (:meth:`_consume` publishes it)
                consumer_barrier()
        else:
            length = g.offsets[expert + 1] - g.offsets[expert]
            k_rows = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
            thr_w, tCrA_w, tCrB_w, acc = self.ml_w.consumer_fragments(sA_w, sB_w, et)
            state = self.ml_w.mma_tile(pipe, state, tCrA_w, tCrB_w, acc, k_rows)
            r0 = m_tile * cfg.tile_m
            s_plain = self.plain.smem_tensor(storage.sC)
            if cutlass.const_expr(self.accumulate):  # main_grad += fp32(bf16(dW tile))
                acc_to_smem(thr_w, acc, s_plain)
                consumer_barrier()
                if which == WD:
                    route_rows.accumulate(s_plain, et, r0, cutlass.min(g.hidden - r0, cfg.tile_m), n_tile,
                                          g.dwd[(expert, None, None)], cfg.tile_n, self.n_tail)
                elif which == WG:
                    route_rows.accumulate(s_plain, et, r0, cutlass.min(g.inter - r0, cfg.tile_m), n_tile,
                                          g.dwg[(expert, None, None)], cfg.tile_n, self.n_tail)
                else:
                    route_rows.accumulate(s_plain, et, r0, cutlass.min(g.inter - r0, cfg.tile_m), n_tile,
                                          g.dwu[(expert, None, None)], cfg.tile_n, self.n_tail)
                consumer_barrier()
            else:
                if which == WD:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(g.hidden - r0, cfg.tile_m), n_tile, g.dwd[(expert, None, None)],
                                   g.dwd[(expert, None, None)], Float32(0.0))
                elif which == WG:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(g.inter - r0, cfg.tile_m), n_tile, g.dwg[(expert, None, None)],
                                   g.dwg[(expert, None, None)], Float32(0.0))
                else:
                    self.plain.run(self.ml_w.tiled_mma, thr_w, acc, s_plain, et, r0,
                                   cutlass.min(g.inter - r0, cfg.tile_m), n_tile, g.dwu[(expert, None, None)],
                                   g.dwu[(expert, None, None)], Float32(0.0))
            if cutlass.const_expr(self.wd_first):
                if which == WD:
                    if tid == 0:
                        cute.arch.atomic_add(wd_done, Int32(1), sem="release", scope="gpu")
        kind = Int32(0)
        if phase == D1:
            kind = Int32(1)
        elif phase != D2:
            kind = 2 + which
        return state, (e1, b1, e2, b2), kind


    @cute.jit
    def _gather(self, cta: CommCta, g, slots: SlotSum, rows: GatherRows, k: Int32, mTrace: cute.Tensor,
                n_tasks: Int32, pull: EpPull):
        """Comm CTAs: the routed rows group ``g``'s tiles read (dy rows times topk_w, d topk_w, x rows; at
        EP > 1 pulled from the source ranks, d topk_w of this rank's routes), routed m-tile c by CTA
        ``c % comm_ctas``: :func:`~mok_cute.kernels.route_grad_row.gather_chunks` (bitwise the
        route_grad kernel and the x gather; the ``mx`` variant: with its rows' MXFP8 round trips,
        dy's along the tokens into ``rows.dyt_rows``). Traced, chunk c's passes are records n_tasks + c
        and n_tasks + chunks + c."""
        trace_rec = (mTrace, n_tasks, (GATHER_KIND, GATHER_X_KIND)) if cutlass.const_expr(self.trace) else None
        walk = RowWalk(g.mt, g.offsets, g.num_experts, slots.order, slots.idx, k, g.hidden, self.cfg.tile_m)
        gather_chunks(cta, walk, rows, pull, trace_rec, X_UNROLL, self.by_route,
                      (mx_round_trips, (rows.dyt_rows,)) if self.mx else None)


class _Group:
    """One group of the backward's tiles inside the kernel (the routed experts, or the shared expert as
    one expert over the T tokens): its TMA atoms / coordinates (:class:`GroupTma`, as attributes),
    tensors (:class:`GroupTensors`) and tile counts (``dims``: :class:`~mok_cute.schedule.
    fused_bwd_tasks.CoreDims`)."""

    def __init__(self, tma: GroupTma, t: GroupTensors, cfg: MainloopConfig, n_tail: bool):
        for name, value in zip(tma._fields, tma):
            setattr(self, name, value)
        (self.gu3, self.dgu3, self.dx, self.dwg, self.dwu, self.dwd, self.offsets, self.d2, self.dgut3, self.x,
         self.tok) = t
        self.num_experts = self.offsets.shape[0] - 1
        self.inter = self.gu3.shape[2]
        self.hidden = self.dwd.shape[1]
        self.n_i = tiles_over(self.inter, cfg.tile_n, n_tail)  # D2 n-tiles (n_tail: the last may run past I)
        self.n_h = tiles_over(self.hidden, cfg.tile_n, n_tail)  # D1 n-tiles
        self.wdims = ((self.hidden + cfg.tile_m - 1) // cfg.tile_m, self.n_i,
                      (self.inter + cfg.tile_m - 1) // cfg.tile_m, self.n_h)
        self.mt = routed_mtiles(self.offsets, self.num_experts, cfg.tile_m)
        self.n_d2, self.n_d1 = self.mt * self.n_i, self.mt * self.n_h
        self.dims = tasks.CoreDims(self.n_d2, self.n_d1, self.n_i, self.n_h, *self.wdims)
        self.n_w = self.num_experts * (self.wdims[0] * self.wdims[1] + 2 * self.wdims[2] * self.wdims[3])
        self.n_tasks = self.n_d2 + self.n_d1 + self.n_w


@cute.jit
def _split(t: Int32, s: _Group, r: _Group):
    """``(group, its task)`` of list task ``t`` over the phases SD2, D2, SD1, D1, SW, W
    (``fused_bwd_tasks.task_list`` order): group 0 the shared expert, 1 the routed experts."""
    grp = Int32(1)
    lt = t
    a = s.n_d2
    b = a + r.n_d2
    c = b + s.n_d1
    d = c + r.n_d1
    f = d + s.n_w
    if t < a:
        grp = Int32(0)
    elif t < b:
        lt = t - a
    elif t < c:
        grp = Int32(0)
        lt = s.n_d2 + (t - b)
    elif t < d:
        lt = r.n_d2 + (t - c)
    elif t < f:
        grp = Int32(0)
        lt = s.n_d2 + s.n_d1 + (t - d)
    else:
        lt = r.n_d2 + r.n_d1 + (t - f)
    return grp, lt


# ---------------------------------------------------------------- compile and launch
def _check_variant(v: BwdVariant, arch: str = "sm_90a") -> None:
    """ValueError for a variant the kernel does not build (or an arch other than sm_90a), naming why."""
    if v.add and not v.scatter:
        raise ValueError("add (a term of the dx slot sum's start) needs scatter")
    if arch != "sm_90a":
        raise ValueError(f"the SM90 fused backward needs arch sm_90a, got {arch!r}")
    if v.init and not v.scatter:
        raise ValueError("init (the shared expert's dx) needs scatter")
    if v.shared and not v.init:
        raise ValueError("shared needs init (its dx starts the slot sum)")
    if (v.gather or v.shared) and not v.scatter:
        raise ValueError("gather (the dy / x rows in the launch) and shared need scatter")
    if v.mx and v.shared:
        raise ValueError("mx (the MXFP8 backward) runs the routed experts only: the shared expert's tiles "
                         "are not in its launch")
    if v.ep and not (v.gather and not v.by_route):
        raise ValueError("ep (EP > 1) moves the rows in the launch: it needs gather, not by_route")
    if v.grouped_slots and not (v.scatter and not v.gather and not v.shared):
        raise ValueError("grouped_slots (the dx rows over dy's rows) needs scatter without gather or shared: "
                         "only there is dy the caller's grouped rows, read by dgrad2 and dW_down alone")
    if v.grouped_slots and not v.mx and not v.wd_first:
        raise ValueError("grouped_slots at BF16 needs wd_first: dW_down reads dy, so every dW_down tile must be "
                         "done before a dgrad1 tile writes over it")
    if v.x_gather and not (v.grouped_slots and not v.mx):
        raise ValueError("x_gather (x's token rows gathered in the weight gradients' loads) needs grouped_slots at "
                         "BF16: the launch without the gather and the shared group, on the layer's x")
    if v.wd_first and not v.grouped_slots:
        raise ValueError("wd_first (the dW_down tiles first, a later phase writing over dy's rows) needs "
                         "grouped_slots")


def compile_fused_backward_core(variant: BwdVariant, *, cfg: MainloopConfig = MainloopConfig(), arch: str = "sm_90a",
                                inspect: bool = False):
    """Compile one :class:`BwdVariant` with symbolic M, T, T*k, H, I, E on the mainloop ``cfg`` (its tile_n and
    stages: :func:`~mok_cute.kernels.sm90.mainloop.launch_config`); returns ``(compiled, report)`` (the report with
    ``inspect``). ValueError for a variant the kernel does not build."""
    v = variant
    _check_variant(v, arch)
    op = FusedMoeBwdCoreSm90(v, cfg)
    dw = Float32 if v.accumulate else cutlass.BFloat16  # the weight gradients' element type
    bf = cutlass.BFloat16
    m, e, t, tk = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hid, inter = cute.sym_int(divisibility=_VEC), cute.sym_int(divisibility=_VEC)

    def vec(dtype, n=None):
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int() if n is None else n,), stride=(1,),
                                             assumed_align=4)

    routed = GroupOperands(
        _fake_2d(bf, m, hid), _fake_2d(bf, t if v.x_gather else m, hid), _fake_3d(bf, m, cute.sym_int(), inter),
        _fake_2d(bf, m, inter),
        _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter),
        _fake_2d(bf, m, cute.sym_int(divisibility=_VEC)), _fake_2d(bf, m, inter), _fake_2d(bf, m, inter),
        _fake_3d(bf, m, cute.sym_int(), inter), None if v.scatter else _fake_2d(bf, m, hid),
        _fake_3d(dw, e, inter, hid), _fake_3d(dw, e, inter, hid), _fake_3d(dw, e, hid, inter), vec(Int32), vec(Int32),
        vec(Int32, m) if v.x_gather else None)
    counters = vec(Int32)
    slots = SlotSum(None, None, None, None, None)
    if v.scatter:
        slots = SlotSum(_fake_2d(bf, m if v.grouped_slots else tk, hid), vec(Int32), vec(Int32, tk),
                        _fake_2d(bf, t, hid) if v.init else None, _fake_2d(bf, t, hid))
    rows = GatherRows(None, None, None, None, None, None)
    if v.gather or v.shared:
        rows = GatherRows(_fake_2d(bf, t, hid), _fake_2d(bf, t, hid), None, None, None, None)
    if v.gather:
        rows = rows._replace(r=_fake_2d(bf, cute.sym_int(), hid), w=vec(Float32, m if v.ep else tk),
                             dtw=vec(Float32, tk), ready=vec(Int32))
    shared = GroupOperands(*(None,) * 17)
    if v.shared:
        i_s = cute.sym_int(divisibility=_VEC)
        shared = GroupOperands(
            None, None, _fake_3d(bf, t, cute.sym_int(), i_s), _fake_2d(bf, t, i_s),
            _fake_3d(bf, cute.sym_int(), i_s, hid), _fake_3d(bf, cute.sym_int(), i_s, hid),
            _fake_3d(bf, cute.sym_int(), hid, i_s), _fake_2d(bf, t, cute.sym_int(divisibility=_VEC)),
            _fake_2d(bf, t, i_s), _fake_2d(bf, t, i_s), _fake_3d(bf, t, cute.sym_int(), i_s), None,
            _fake_3d(dw, cute.sym_int(), i_s, hid), _fake_3d(dw, cute.sym_int(), i_s, hid),
            _fake_3d(dw, cute.sym_int(), hid, i_s), vec(Int32), vec(Int32))
    rec = cute.runtime.make_fake_tensor(Int64, (cute.sym_int(),), stride=(1,), assumed_align=8) if v.trace else None
    mx = MxOperands(_fake_2d(bf, m, hid), _fake_3d(bf, m, cute.sym_int(), inter)) if v.mx else MxOperands(None, None)
    addf = _fake_2d(Float32, t, hid) if v.add else None
    ep = EpOperands(None, None, *_NO_EP)
    if v.ep:
        ep = EpOperands(cute.runtime.make_fake_tensor(Int64, (cute.sym_int(),), stride=(1,), assumed_align=8),
                        vec(Int32), *_NO_EP)
    sc = Scalars(Int32(1), Int32(1), Float32(0.0), Int32(1), Int64(1))
    return compile_kernel(op, routed, counters, *(_present(b) for b in (slots, rows, shared, mx)), addf, rec, sc, ep,
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


_NO_EP = (Int32(0), Int32(1), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0), Int32(0))  # EP = 1 launches
EP_SECTIONS = ("src", "dy", "slots", "flags")  # the workspace sections the ep variant addresses (kernel order)


_WAITS = {D2_READY: "dgrad2 tiles of m-tile", D1_DONE: "dgrad1 tiles, target", ROWS_READY: "routed rows of m-tile",
          WD_DONE: "dW_down tiles"}
describe = persistent.describer("fused backward", _WAITS)  # the status words, read by the host later
_last_trace: list = []  # (records int64 [n, 4], comm_ctas) of the last traced launch


def last_trace():
    """``(records int64 [n, 4], comm_ctas)`` of the last traced launch (:data:`KINDS`; records of
    tasks that did not exist are zero), or None."""
    return _last_trace[0] if _last_trace else None


# ---------------------------------------------------------------- host operands
class ExpertRows(NamedTuple):
    """The routed rows one expert backward reads (the unfused ``expert_bwd`` path's operands): ``dy``,
    ``x`` [M, H] bf16 the grouped dy rows (each route's dy row times its router weight) and x rows,
    ``gu`` [M, 2I] and ``h`` [M, I] bf16 the forward's, contiguous; ``offsets`` int32 [E+1] on the
    device, each expert's first grouped row."""

    dy: torch.Tensor
    x: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    offsets: torch.Tensor


class BackwardInputs(NamedTuple):
    """What a whole-layer backward starts from: ``dy``, ``x`` [T, H] bf16 the output's gradient and the
    layer input; ``r_rows`` [T*k, H] bf16 the forward's GEMM2 rows (expert-grouped, or in route order with
    ``rows_by_route``; EP > 1: this rank's slot rows, in route order); ``gu`` [M, 2I] and ``h`` [M, I]
    bf16 the forward's saved rows."""

    dy: torch.Tensor
    x: torch.Tensor
    r_rows: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    rows_by_route: bool = False


class TokenSum(NamedTuple):
    """The dx slot sum of :func:`fused_backward_core` (``tokens``): ``order`` [M] grouped row -> t*k + j,
    ``topk_idx`` [T, k] (-1: no expert), ``dx_shared`` bf16 [T, H] or None (the sum's start; else 0),
    ``dx_add`` fp32 [T, H] or None, added to that start in fp32 (the shared expert's output gate's
    share of dx); ``x_tok`` bf16 [T, H] or None: the layer's x, whose token rows the weight gradients gather
    in their loads (``x_gather``; the launch's x rows None)."""

    order: torch.Tensor
    topk_idx: torch.Tensor
    dx_shared: torch.Tensor | None = None
    dx_add: torch.Tensor | None = None
    x_tok: torch.Tensor | None = None


class SharedOperands(NamedTuple):
    """The shared expert's group in a whole-backward launch, as the forward made it: ``offsets`` int32
    [0, T], ``gu`` [T, 2I_s], ``h`` [T, I_s] bf16 contiguous, ``w_gate``, ``w_up`` [I_s, H], ``w_down``
    [H, I_s] bf16 (unit last stride)."""

    offsets: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class BackwardLaunch:
    """How a fused backward launches (the numerics depend on none of these but ``mx``).

    timeout_s: bound on every device wait (EP > 1: the workspace's); a timeout is raised later.
    num_ctas: the grid; None: one CTA per SM (``ws.grid_ctas`` for virtual ranks sharing one GPU).
    comm_ctas: the CTAs that build (EP > 1: pull) the routed rows before they take tiles, clamped
        to ``[1, num_ctas - 1]``; read where the launch gathers the rows.
    trace: the kernel records one timestamped record per task (:func:`last_trace`).
    mx: the MXFP8 backward, bitwise the unfused one (see each entry point).
    tile_n / stages: the mainloop's tile width and ring of shared-memory stages, one for all its GEMMs
        (None: the defaults; :func:`~mok_cute.kernels.sm90.mainloop.launch_config`); results do not depend
        on them (each element's sum over K keeps its order).
    """

    timeout_s: float = 30.0
    num_ctas: int | None = None
    comm_ctas: int = 16
    trace: bool = False
    mx: bool = False
    tile_n: int | None = None
    stages: int | None = None


class _Gather(NamedTuple):
    """A launch's gather on the host: the layer's ``dy`` / ``x`` [T, H], the forward's ``r_rows``,
    ``w`` fp32 (topk_w [T*k]; EP > 1: [M] per grouped row), ``dtw`` fp32 [T*k] (d topk_w out), ``by_route``."""

    dy: torch.Tensor
    x: torch.Tensor
    r_rows: torch.Tensor
    w: torch.Tensor
    dtw: torch.Tensor
    by_route: bool


# ---------------------------------------------------------------- entry points
def fused_backward_core(rows: ExpertRows, weights, limit, launch: BackwardLaunch = BackwardLaunch(), tokens=None,
                        consume: bool = False, mx_dyt=None, x_tok=None, dwd=None):
    """The routed backward in one launch (module doc) on ``rows`` (:class:`ExpertRows`, the operands
    the unfused path accepts; I, H multiples of 64, not of 256: the n_tail variant) and ``weights``
    ``(w_gate, w_up [E, I, H], w_down [E, H, I])`` bf16 with unit last stride (``ExpertWeights``).
    Returns ``(dx [M, H], dWg, dWu [E, I, H], dWd [E, H, I])``, bitwise the unfused ``mlp_backward``'s.
    ``limit``: the activation, None, a clamp L or a :class:`~mok_cute.reference.SwiGLU` (its alpha and up offset
    compiled in: :func:`~mok_cute.kernels.swiglu_math.swiglu_args`).

    ``tokens`` (:class:`TokenSum` or its tuple): the dx rows go straight to their (token, slot) rows
    and the launch ends with the fixed-order slot sum, so dx is [T, H], bitwise the unfused
    ``slot_sum(fp32(dx_shared) + dx_add or 0, scattered rows, topk_idx)``.

    ``launch.mx``: the MXFP8 backward, bitwise the unfused one (``layers.sm90``'s ``_mx_backward``):
    the weights given dequantized from their MXFP8 along dgrad's reduction axis (the caller's cache);
    dy's round trips along H and along the tokens and those of x and h along the tokens are made here,
    dgu's two in the dSwiGLU epilogue; ``consume`` (the caller gives up dy, x, gu and h: a one-shot
    layer backward) makes the round trips of the contiguous ones in place instead of in new [M, H] /
    [M, I] buffers, and D2 writes dgu over gu's first M rows (each dSwiGLU tile reads its own g, u
    elements before it stores their dg, du, and no other task reads gu), not into a new [M, 2I]
    buffer. With ``tokens`` and ``consume`` (BF16) or ``mx`` the dx rows are written over dy (MXFP8: its
    round trip along H) (``grouped_slots``: no [T*k, H] slot buffer; BF16: after every dW_down tile, which
    reads dy and runs first, ``wd_first``, bitwise the same) and, at MXFP8 where 2I <= H, every dW_down tile runs first and
    dgu's round trip along the tokens is written over dy's (``wd_first``: no [M, 2I] buffer for it;
    measured bitwise on the device, docs/benchmarks.md). ``mx_dyt`` (with ``mx``): the caller made dy's
    and x's round trips (``route_grad.mx_dy_rows_and_dtopk_w``, ``mx_x_rows``): ``rows.dy`` is its round
    trip along H, ``rows.x`` along the tokens, ``mx_dyt`` [M, H] dy's along the tokens; only h's is made
    here. ``x_tok`` (BF16, with ``tokens`` and ``consume``; ``rows.x`` then None): the layer's x [T, H] bf16
    contiguous; the dW_gate / dW_up tiles gather each grouped row's token row of it in their loads (no [M, H] x
    rows; bitwise the same); each row's token is written over ``tokens.order``'s first M entries where that is
    int32 (consumed too), else into a new int32 tensor. ``dwd`` (BF16 with ``tokens`` and ``consume``): dW_down
    [E, H, I] bf16 that :func:`down_weight_grad` made from the same dy rows and h before this launch; the launch
    resumes its task list after the dW_down tiles (ticket and dW_down-done words start at their count), reads no h
    (``rows.h`` may be None: the caller can free h first) and returns ``dwd`` as dWd. Errors of the device waits are
    raised by a later call (:mod:`mok_cute.dsl.deferred`)."""
    dy, x, gu, h, offsets = rows
    m = dy.shape[0]
    if dwd is not None and (launch.mx or tokens is None or not consume):
        raise ValueError("dwd (dW_down made before the launch) needs BF16, tokens and consume=True (the launch "
                         f"whose dW_down tiles run first), got mx={launch.mx}, tokens={tokens is not None}, "
                         f"consume={consume}")
    if h is None and dwd is None:
        raise ValueError("rows.h: the forward's h [M, I] bf16 is needed unless dwd is given")
    if x_tok is not None and (tokens is None or not consume or launch.mx or x is not None):
        raise ValueError("x_tok (x's rows gathered in the launch) needs tokens, consume=True, BF16 and rows.x None")
    toks = None
    if tokens is not None:
        order, topk_idx, dxs, add = TokenSum(*tokens)[:4]
        toks = TokenSum(order[:m].to(torch.int32), topk_idx, dxs, add, x_tok)
    dyt = None
    if launch.mx and m:
        from mok_cute.kernels.quant.dequant_mxfp8 import mxfp8_round_trip, mxfp8_round_trip_tokens

        def into(a):  # the round trip's buffer: ``a`` itself when consumed
            return a if consume and a.is_contiguous() else None

        if mx_dyt is None:
            dyt = mxfp8_round_trip_tokens(dy.contiguous(), offsets)
            x, h = (mxfp8_round_trip_tokens(a.contiguous(), offsets, out=into(a)) for a in (x, h[:m]))
            dy = mxfp8_round_trip(dy.contiguous(), out=into(dy))
        else:
            dyt, h = mx_dyt, mxfp8_round_trip_tokens(h[:m].contiguous(), offsets, out=into(h[:m]))
    dgu = gu[:m].view(m, -1) if consume and gu[:m].is_contiguous() else None
    return _launch(ExpertRows(dy, x, gu, h, offsets), weights, limit, launch, toks, None, mx_dyt=dyt,
                   made=_Made(dgu, dwd), dy_free=consume or launch.mx)


def down_weight_grad(dy, h, offsets, launch: BackwardLaunch = BackwardLaunch()):
    """dW_down [E, H, I] bf16 = each expert's ``dy_e^T h_e`` (``dy`` [M, H], ``h`` [M, I] bf16 contiguous grouped
    rows, ``offsets`` int32 [E+1]) by the grouped weight-gradient kernel on ``launch``'s mainloop: the tiles the
    fused backward's dW_down tasks run, bitwise theirs (each element sums its expert's rows in row order). The
    layer runs it before :func:`fused_backward_core` (``dwd=``) so that h is freed before that launch."""
    from mok_cute.kernels.sm90.expert_bwd import _run_wgrad

    return _run_wgrad(dy, h, offsets, cfg=launch_config(launch.tile_n, launch.stages))


def fused_backward(inputs: BackwardInputs, plan, weights, limit, launch: BackwardLaunch = BackwardLaunch(),
                   dx_shared=None, shared=None, main_grads=None):
    """The routed backward from the layer's tokens in one launch: :func:`fused_backward_core` with
    ``tokens`` and, in its first ``launch.comm_ctas`` CTAs, the work of ``route_grad.dy_rows_and_dtopk_w``
    and of gathering x's rows (bitwise theirs). ``inputs``: :class:`BackwardInputs`; ``plan``: the
    forward's routing (``kernels.operands.RoutePlan``: ``order`` [T*k] grouped row -> t*k + j, routes
    without an expert last; ``offsets`` int32 [E+1]; ``topk_idx`` [T, k]; ``topk_w`` fp32 [T, k]);
    ``weights`` as :func:`fused_backward_core`'s; ``dx_shared`` bf16 [T, H] or None: the slot sum's
    start. Returns ``(dx [T, H], d topk_w [T, k] fp32, dWg, dWu, dWd)``.

    ``shared`` (:class:`SharedOperands` or its tuple, the shared expert's group as the forward made
    it): the shared expert's tiles run in the same launch (``dx_shared`` must be None: its dx is made
    there and starts the slot sum), and its three weight gradients follow the routed ones.
    ``main_grads``: fp32 tensors of the weights' shapes (w_gate, w_up, w_down, then the shared
    expert's with ``shared``): each weight-gradient tile is added into them (``main +=
    fp32(bf16(dW))``) and its weight gradient is returned as None.

    ``launch.mx``: the MXFP8 backward, bitwise the unfused one (as :func:`fused_backward_ep`'s: the
    weights given dequantized, h's round trip along the tokens made here, the gathered rows' in the
    launch, dgu's in the epilogue; the shared expert outside the launch, its dx ``dx_shared``)."""
    dy, x, r_rows, gu, h, rows_by_route = inputs
    order, offsets, topk_idx, topk_w = plan
    t, k = topk_idx.shape
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dy_rows = torch.empty((t * k, dy.shape[1]), **bf)
    x_rows = torch.empty((t * k, dy.shape[1]), **bf)
    dtw = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    gather = _Gather(dy, x, r_rows, topk_w.reshape(-1), dtw.view(-1), rows_by_route)
    if shared is not None:
        if dx_shared is not None:
            raise ValueError("dx_shared must be None when the shared expert runs in the launch")
        if launch.mx:
            raise ValueError("mx: the shared expert runs outside the launch (give its dx as dx_shared)")
        dx_shared = torch.empty_like(dy)
    dyt, h = _mx_gather_operands(launch.mx, h, offsets, t * k, dy.shape[1], bf)
    out = _launch(ExpertRows(dy_rows, x_rows, gu, h, offsets), weights, limit, launch,
                  TokenSum(order.to(torch.int32), topk_idx, dx_shared), gather, shared, main_grads, mx_dyt=dyt)
    return (out[0], dtw, *out[1:])


def fused_backward_ep(ws, plan, inputs: BackwardInputs, w_rows, topk_idx, weights, limit,
                      launch: BackwardLaunch = BackwardLaunch(), shared=None, main_grads=None, dx_shared=None):
    """The backward at EP > 1 in one launch per rank (collective over ``ws``'s ranks, every rank
    calls it in the same order): :func:`fused_backward` with the rows moved through the workspace.
    ``inputs`` (:class:`BackwardInputs`): this rank's x and dy [T, H] bf16, staged in its ``src`` and
    ``dy`` sections (after every peer finished the previous pull), ``r_rows`` its slot rows [T*k, H] of
    the forward (rows of -1 slots unread: d topk_w [T, k] of this rank's routes is made from them),
    gu [M, 2I] and h [M, I] the forward's (M = ``plan.recv_src.shape[0]``). The launch's comm CTAs pull
    the dy rows (times ``w_rows`` [M] fp32, the forward's router weight of each grouped row) and x
    rows of the routes this rank's experts serve (``plan``: the forward's device plan, ``recv_src``
    packed sources, local expert ``offsets``), the dgrad1 rows are pushed to their (token, slot) rows
    of the source ranks' slot buffers, and every rank sums its own, from the shared expert's dx when
    ``shared`` (as :func:`fused_backward`, its tiles in the launch). Returns ``(dx [T, H], d topk_w
    [T, k] fp32, dWg, dWu, dWd)``, then the shared expert's three with ``shared``; ``main_grads`` as in
    :func:`fused_backward`. Errors of the device waits (a peer's timeout included) go to ``ws.status``:
    the caller runs ``ws.check_status()``. The waits' bound is the workspace's (``ws.timeout_s``, not
    ``launch.timeout_s``); ``launch.num_ctas``: this rank's grid.

    ``launch.mx``: the MXFP8 backward, bitwise the unfused EP one (``layers.sm90``'s ``_mx_backward``
    on the pulled rows): the weights given dequantized from their MXFP8 along dgrad's reduction axis,
    h's round trip along the tokens made here, the pulled rows' in the launch (the ``mx`` gather,
    :func:`~mok_cute.kernels.route_grad_row.gather_chunks`), dgu's in the dSwiGLU epilogue; the
    shared expert runs outside the launch (``shared`` None): its dx [T, H] bf16, ``dx_shared``
    (or None), starts the slot sum."""
    dy, x, slot_rows, gu, h, _ = inputs
    t, k = topk_idx.shape
    m, hid = plan.recv_src.shape[0], dy.shape[1]
    _check_ep(inputs, w_rows, t, k, m)
    if dx_shared is not None and (shared is not None or tuple(dx_shared.shape) != (t, hid)
                                  or dx_shared.dtype != torch.bfloat16 or not dx_shared.is_contiguous()):
        raise ValueError(f"dx_shared must be a contiguous bf16 [{t}, {hid}] tensor, with shared None")
    if launch.mx and shared is not None:
        raise ValueError("mx: the shared expert runs outside the launch (give its dx as dx_shared)")
    src = ws.acquire_src()  # device wait: every peer finished the previous pull from this rank
    src.copy_(x)
    ws.view("dy", torch.bfloat16, (t, hid)).copy_(dy)
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    dy_rows = torch.empty((m, hid), **bf)
    x_rows = torch.empty((m, hid), **bf)
    dtw = torch.empty((t, k), dtype=torch.float32, device=dy.device)
    if shared is not None:
        dx_shared = torch.empty_like(dy)
    dyt, h = _mx_gather_operands(launch.mx, h, plan.offsets, m, hid, bf)
    gather = _Gather(dy, x, slot_rows, w_rows, dtw.view(-1), False)
    out = _launch(ExpertRows(dy_rows, x_rows, gu, h, plan.offsets), weights, limit,
                  replace(launch, timeout_s=ws.timeout_s), TokenSum(plan.recv_src, topk_idx, dx_shared), gather,
                  shared, main_grads, mx_dyt=dyt, ws=ws)
    return (out[0], dtw, *out[1:])


def _mx_gather_operands(mx: bool, h, offsets, m: int, hid: int, bf: dict):
    """``(dy_t, h)`` of a launch whose gather makes the MXFP8 round trips: dy_t a fresh [m, H] buffer
    (the launch writes dy's round trip along the tokens there), h's round trip along the tokens
    (over ``offsets``' experts); ``(None, h)`` unless ``mx``."""
    if not mx:
        return None, h
    from mok_cute.kernels.quant.dequant_mxfp8 import mxfp8_round_trip_tokens

    return torch.empty((m, hid), **bf), mxfp8_round_trip_tokens(h[:m].contiguous(), offsets) if m else h


def _check_ep(inputs: BackwardInputs, w_rows, t: int, k: int, m: int) -> None:
    """:func:`fused_backward_ep`'s operands, before anything is staged: TypeError / ValueError naming
    the argument and what it must be."""
    dy, x, slot_rows, gu, h, _ = inputs
    hid = dy.shape[-1]
    want = {"dy": (dy, (t, hid), torch.bfloat16), "x": (x, (t, hid), torch.bfloat16),
            "slot_rows": (slot_rows, (t * k, hid), torch.bfloat16), "w_rows": (w_rows, (m,), torch.float32)}
    for name, (a, shape, dtype) in want.items():
        if not isinstance(a, torch.Tensor) or a.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor")
        if tuple(a.shape) != shape or not a.is_contiguous():
            raise ValueError(f"{name} must be contiguous of shape {shape}, got {tuple(a.shape)}")
    if gu.shape[0] < m or h.shape[0] < m:
        raise ValueError(f"gu and h must hold the M = {m} grouped rows of the plan, got {gu.shape[0]} / {h.shape[0]}")


# ---------------------------------------------------------------- one launch
class _Made(NamedTuple):
    """Buffers a launch's caller made: ``dgu`` D2's output [M, 2I] bf16 (None: a new one), ``dwd`` dW_down
    [E, H, I] bf16 from :func:`down_weight_grad` (None: the launch's dW_down tiles make it)."""

    dgu: torch.Tensor | None = None
    dwd: torch.Tensor | None = None


def _launch(rows: ExpertRows, weights, limit, launch: BackwardLaunch, tokens: TokenSum | None,
            gather: _Gather | None, shared=None, main_grads=None, mx_dyt=None, ws=None, made: _Made = None,
            dy_free: bool = False):
    """One launch of the variant the arguments ask for (see the entries above); with ``shared``
    returns the shared expert's (dWs_gate, dWs_up, dWs_down) after the routed ones; with
    ``main_grads`` the weight gradients are accumulated there and returned as None; ``mx_dyt``: the
    MXFP8 variant (dy's round trip along the tokens; dy, x, h already theirs; with ``gather``: its
    buffer, the launch writes it and the rows' round trips, h already its own); ``ws``: the EP > 1
    variant over that workspace (:func:`fused_backward_ep`); ``made`` (:class:`_Made`, None: nothing): ``dgu``
    D2's output buffer [M, 2I] bf16 (None: a new one), ``dwd`` below. ``tokens`` without ``gather`` or
    ``shared`` where ``dy_free`` (the caller gives up ``rows.dy``: consumed, or the MXFP8 round trip made for
    the launch) (``grouped_slots``): the dx rows written over ``rows.dy`` (no [T*k, H] slot buffer); BF16: after
    every dW_down tile, which reads dy and runs first (``wd_first``); MXFP8 where 2I <= H (``wd_first``): dgu's
    round trip along the tokens written over ``mx_dyt`` once every dW_down tile has read it (no [M, 2I] buffer).
    ``tokens.x_tok``: the layer's x [T, H], ``rows.x`` None (``x_gather``: x's rows gathered in the dW_gate / dW_up
    loads; needs ``grouped_slots``). ``dwd``: dW_down made before the launch (BF16 ``wd_first``): the task list
    resumes after the dW_down tiles and gu's gate half stands in for the unread h."""
    dy, x, gu, h, offsets = rows
    w_gate, w_up, w_down = weights
    dgu, dwd = _Made() if made is None else made
    dwd_made = dwd is not None
    m, hid = dy.shape
    e, inter = w_gate.shape[0], w_gate.shape[1]
    grouped_slots = dy_free and tokens is not None and gather is None and shared is None
    wd_first = grouped_slots and (mx_dyt is None or 2 * inter <= hid)
    if dwd is not None and not (wd_first and mx_dyt is None and main_grads is None):
        raise ValueError("dwd: only a BF16 launch whose dW_down tiles run first (grouped_slots) skips them")
    tok = inverse = None
    if grouped_slots:  # before the big buffers, so that its temporaries stay below the launch's peak
        inverse = grouped_rows(tokens.order, tokens.topk_idx.numel())
    x_tok = None if tokens is None else tokens.x_tok
    if x_tok is not None:  # each grouped row's token, from the plan's order (grouped row -> t*k + j), written over
        # that int32 order (consumed: fused_backward_core's check makes this launch grouped_slots at BF16, whose
        # kernel reads the inverse order made above instead)
        x = x_tok
        tok = tokens.order[:m]
        torch.div(tok, tokens.topk_idx.shape[1], rounding_mode="floor", out=tok)
    dev, arch = device_arch(dy.device)
    bf = dict(dtype=torch.bfloat16, device=dy.device)
    if main_grads is None:
        dwg, dwu = gate_up_grads(w_gate, w_up)
        if dwd is None:
            dwd = torch.empty((e, hid, inter), **bf)
        elif tuple(dwd.shape) != (e, hid, inter) or dwd.dtype != torch.bfloat16 or not dwd.is_contiguous():
            raise ValueError(f"dwd must be contiguous bf16 {(e, hid, inter)}, got {dwd.dtype} {tuple(dwd.shape)}")
    else:
        dwg, dwu, dwd = main_grads[:3]
    slots, k, comm = SlotSum(None, None, None, None, None), 1, 1
    if tokens is None:
        dx = torch.empty((m, hid), **bf)
    else:
        order32, topk_idx, dxs = tokens[:3]
        t, k = topk_idx.shape
        dx = torch.empty((t, hid), **bf)
        if grouped_slots:  # the slot sum reads the dx rows at dy's grouped rows, through the inverse order
            slot, order32 = dy, inverse
        else:
            slot = torch.empty((t * k, hid), **bf) if ws is None else ws.view("slots", torch.bfloat16, (t * k, hid))
        slots = SlotSum(slot, order32, topk_idx.reshape(-1).to(torch.int32), dxs, dx)
    cfg = launch_config(launch.tile_n, launch.stages)
    mt_cap = m // cfg.tile_m + e + 1  # routed m-tiles: at most one partial per expert
    counters = torch.zeros(2 * mt_cap + COUNTER_WORDS, dtype=torch.int32, device=dy.device)
    d2, gdy, words = counters[:mt_cap], counters[mt_cap:2 * mt_cap], counters[2 * mt_cap:]
    if dwd_made:  # the list's first E * (dW_down tiles per expert) tasks ran in that launch: claimed and done
        words[0] = words[WD_WORD] = e * mtiles(0, hid, cfg.tile_m) * mtiles(0, inter, cfg.tile_n)
        h = gu[:m].view(m, 2, inter)[:, 0]  # an [M, I] view the launch's h operand never reads
    row_args = GatherRows(None, None, None, None, None, None)
    if gather is not None:
        row_args = GatherRows(gather.dy, gather.x, gather.r_rows, gather.w, gather.dtw, gdy)
        comm = launch.comm_ctas
    sh_args, sh_out = GroupOperands(*(None,) * 17), ()
    if shared is not None:
        sh_args, sh_out = _shared_args(SharedOperands(*shared), dy.device,
                                       None if main_grads is None else main_grads[3:])
    if m == 0 and shared is None and main_grads is None and ws is None:  # no rows: no tile reads, zero gradients
        if tokens is not None:
            dx.copy_(tokens.dx_shared) if tokens.dx_shared is not None else dx.zero_()
            if tokens.dx_add is not None:
                dx.copy_((dx.float() + tokens.dx_add).bfloat16())
        if gather is not None:
            gather.dtw.zero_()
        return dx, dwg.zero_(), dwu.zero_(), dwd.zero_()
    dgu = torch.empty((m, 2 * inter), **bf) if dgu is None else dgu
    if wd_first and mx_dyt is not None:  # the weight gradients' dgu over dy's token round trip, dead once every
        # dW_down tile has read it
        dgut = mx_dyt.view(-1)[:m * 2 * inter].view(m, 2 * inter)
    else:
        dgut = dgu if mx_dyt is None else torch.empty((m, 2 * inter), **bf)
    clamp, gated, lim = swiglu_args(limit)
    variant = BwdVariant(
        clamp, tokens is not None, tokens is not None and tokens.dx_shared is not None, gather is not None,
        gather is not None and gather.by_route, shared is not None, main_grads is not None, launch.trace,
        mx_dyt is not None, tokens is not None and tokens.dx_add is not None,
        any(d % cfg.tile_n for d in (hid, inter, *(() if shared is None else (shared[3].shape[0],)))),
        ws is not None, grouped_slots, wd_first, gated, x_tok is not None)
    launcher = compile_cached(("sm90_fused_moe_bwd_core", arch, variant, cfg.key()), lambda: GraphLauncher(
        compile_fused_backward_core(variant, cfg=cfg, arch=arch)[0]))
    num_ctas = sm_count(dev) if launch.num_ctas is None else launch.num_ctas
    comm = max(1, min(int(comm), num_ctas - 1))  # a GEMM CTA must remain to run the tiles that wait on them
    records = None
    if launch.trace:  # every possible task, the gather chunks of both passes, three per CTA (see the kernel)
        n_rec = _task_cap(m, e, hid, inter, shared, cfg) + 2 * mt_cap + 3 * num_ctas
        records = torch.zeros((n_rec, persistent.TRACE_WORDS), dtype=torch.int64, device=dy.device)
        _last_trace[:] = [(records, comm if gather is not None else 0)]
    mx = MxOperands(None, None) if mx_dyt is None else MxOperands(mx_dyt, dgut.view(m, 2, inter))
    routed = GroupOperands(dy, x, gu[:m].view(m, 2, inter), h[:m], w_gate, w_up, w_down, dgu, dgut[:, :inter],
                           dgut[:, inter:], dgu.view(m, 2, inter), None if tokens is not None else dx, dwg, dwu, dwd,
                           offsets, d2, tok)
    sc = Scalars(k, comm, lim, num_ctas, int(launch.timeout_s * 1e9))
    ep = EpOperands(None, None, *_NO_EP) if ws is None else EpOperands(*ws.kernel_args((ws.status,), EP_SECTIONS))
    _run(launcher, dev, (routed, words, *(_present(b) for b in (slots, row_args, sh_args, mx)),
                         None if tokens is None else tokens.dx_add, None if records is None else records.view(-1), sc,
                         ep), direct=ws is not None)
    if ws is None:  # at EP > 1 errors go to the workspace's status (the caller's check_status)
        deferred.watch(words[1:1 + P.STATUS_WORDS], describe)
    if main_grads is not None:
        return (dx, None, None, None, *sh_out)
    return (dx, dwg, dwu, dwd, *sh_out)


def gate_up_grads(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (dW_gate, dW_up) bf16 [E, I, H] in the weights' own layout, so that autograd hands them to the
    parameters as they are: the halves of one [E, 2I, H] buffer where w_gate and w_up are such halves (fc1's
    gradient in one tensor, :mod:`mok_cute.fc1`), else two contiguous tensors (a strided half given to a
    contiguous parameter would be copied by autograd's gradient accumulation: twice dW_gate's and dW_up's
    bytes of traffic and memory)."""
    e, inter, hid = w_gate.shape
    if halves_of(w_gate, w_up) is not None:
        dwgu = torch.empty((e, 2 * inter, hid), dtype=torch.bfloat16, device=w_gate.device)
        return dwgu[:, :inter], dwgu[:, inter:]
    return (torch.empty((e, inter, hid), dtype=torch.bfloat16, device=w_gate.device),
            torch.empty((e, inter, hid), dtype=torch.bfloat16, device=w_gate.device))


def _run(launcher: GraphLauncher, dev: int, args: tuple, direct: bool) -> None:
    """Launch ``args`` (:meth:`FusedMoeBwdCoreSm90.__call__`'s arguments before the stream: bundles of
    torch tensors, None and, in ``Scalars``, Python numbers; None for an absent bundle) on the current
    stream: a graph replay keyed by every tensor's (pointer, shape, strides) and the scalars
    (:class:`~mok_cute.dsl.launch.GraphLauncher`; the EP bundle, constant at EP = 1, is not in the key),
    or with ``direct`` (EP > 1: its epochs change every call) through the DSL. The compiled function
    receives the bundles with each tensor as its memref descriptor and the scalars as DSL values: the
    kernel's parameter bytes of a flat launch."""
    stream = torch._C._cuda_getCurrentRawStream(dev)

    def make_args(st):
        return (*(_kernel_arg(a) for a in args), st)
    if direct:
        launcher.launch_direct(stream, make_args)
    else:
        launcher.launch(dev, stream, _graph_key(args[:-1]), make_args)


def _kernel_arg(a):
    """``a`` as the compiled function takes it: a torch tensor as its descriptor, :class:`Scalars` as
    DSL values, other bundles field by field, anything else (None, DSL values, descriptors) as is."""
    if isinstance(a, torch.Tensor):
        return _Desc(a)
    if isinstance(a, Scalars):
        return Scalars(Int32(a.k), Int32(a.comm_ctas), Float32(a.limit), Int32(a.num_ctas), Int64(a.timeout_ns))
    if isinstance(a, tuple):
        return type(a)(*(_kernel_arg(v) for v in a))
    return a


def _graph_key(a):
    """What ``a`` (a tensor, a bundle, a Python number or None) contributes to a launch's parameters."""
    if isinstance(a, torch.Tensor):
        return tensor_key(a)
    if isinstance(a, tuple):
        return tuple(_graph_key(v) for v in a)
    return a


def _task_cap(m: int, e: int, hid: int, inter: int, shared, cfg: MainloopConfig = MainloopConfig()) -> int:
    """An upper bound of the launch's task count on the mainloop ``cfg`` (routed m-tiles at most
    ``m // tile_m + e + 1``)."""
    tm, tn = cfg.tile_m, cfg.tile_n

    def group(mt: int, experts: int, i: int) -> int:  # D2 + D1 tiles, then dWd + dWg + dWu tiles
        ni, nh = -(-i // tn), -(-hid // tn)
        return mt * (ni + nh) + experts * (-(-hid // tm) * ni + 2 * -(-i // tm) * nh)
    cap = group(m // tm + e + 1, e, inter)
    if shared is not None:
        cap += group(shared[1].shape[0] // tm + 2, 1, shared[3].shape[0])
    return cap


def _shared_args(shared: SharedOperands, device, main_grads=None):
    """The shared group's :class:`GroupOperands` (dy, x, dx None) and its weight gradients (None each
    when accumulated into ``main_grads``, fp32 [I_s, H], [I_s, H], [H, I_s])."""
    offs, gus, hs, ws_gate, ws_up, ws_down = shared
    t = gus.shape[0]
    i_s, hid = ws_gate.shape
    bf = dict(dtype=torch.bfloat16, device=device)
    dgus = torch.empty((t, 2 * i_s), **bf)
    if main_grads is None:
        dws = (torch.empty((1, i_s, hid), **bf), torch.empty((1, i_s, hid), **bf), torch.empty((1, hid, i_s), **bf))
    else:
        dws = tuple(mg[None] for mg in main_grads)
    d2s = torch.zeros(t // 128 + 2, dtype=torch.int32, device=device)
    args = GroupOperands(None, None, gus.view(t, 2, i_s), hs, ws_gate[None], ws_up[None], ws_down[None], dgus,
                         dgus[:, :i_s], dgus[:, i_s:], dgus.view(t, 2, i_s), None, *dws, offs, d2s)
    return args, (None, None, None) if main_grads is not None else tuple(d[0] for d in dws)

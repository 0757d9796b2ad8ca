"""The fused MoE forward on Blackwell (sm_100a / sm_103a), BF16 or MXFP8, EP = 1 or > 1: one persistent launch.

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
records in the SM90 kernel's layout), ``mx``, ``ep``, ``biased`` (BF16: the routed experts' biases b_gate,
b_up [E, I] added to R1's accumulators before the SwiGLU epilogue rounds g, u, b_down [E, H] to R2's before the
rows round; the shared expert has none: :mod:`~mok_cute.kernels.sm100.bias`, the epilogue warps read the task's
expert from the task list).

``cta_group::2`` (``tile_m`` 256, ``MoKConfig.tile_m=256``): every GEMM task is a 256-row tile run by a
cluster of two CTAs, the leader claiming it from the ticket for both (:mod:`~mok_cute.kernels.sm100.task_ring`'s
pair ring) and issuing its MMAs, each CTA loading its halves of A and B and storing its 128 rows;
gather chunks, ring slots and m-tiles are 256 rows; both CTAs publish a finished tile, so each
readiness target above counts every tile twice. The grid and the comm CTAs are whole pairs.

EP > 1 (``ep``, :func:`fused_forward` with a workspace): the SM90 ep variant's protocol
(:class:`~mok_cute.comm.peer_rows.PeerRows`, :mod:`mok_cute.comm.protocol`). ``order`` holds packed
sources ``p*T*k + t*k + j`` (the device plan's ``recv_src``). The gather pulls each grouped row from
rank p's staged ``src[t]`` and its router weight ``w[t, j]`` into ``w_rows`` (CTA 0 signals READY,
every comm CTA waits READY from every rank, the last comm CTA to finish signals DONE); R2 pushes
each row into rank p's ``slots[t*k + j]`` (the epilogue first waits FREE of the previous push
epoch from every rank; a system-scope fence before the tile is published); the slot sum waits
until every GEMM2 tile is stored, CTA 0 signals DATA, every CTA waits DATA from every rank, sums
this rank's slot buffer while copying its rows into ``slot_copy`` (``slot_rows.SlotSumOperands(copy=)``),
and the last CTA to finish signals FREE. MXFP8 at EP > 1: the staged rows are
:func:`~mok_cute.comm.workspace.mxfp8_row_bytes` wide (H e4m3 bytes, then x's scale words,
zero-padded), the gather reads both from the source rank. ``bulk_push`` (``MoKConfig.comm_transport="bulk"``):
R2's rows go to the peers by ``cp.async.bulk`` shared -> global from a per-thread staging area in shared
memory instead of ``st.global`` (:func:`push_routed_bulk`; compile-verified only, not yet run on a GPU).

MXFP8 (``mx``, the tiles of ``MXFP8_CONFIG``: 128 x 256 x 128, ``kind::mxf8f6f4.block_scale``):
every GEMM operand is e4m3 with E8M0 scales in the blocked layouts of
:mod:`~mok_cute.kernels.sm100.layouts`, the unfused SM100 MXFP8 GEMMs' operands, so every tile is
bitwise theirs. x is quantized along H once per call (a token row's quantization does not depend
on the other rows); the gather moves a row's e4m3 bytes and its scale words into ring slot ``s``
(scale atom row ``s`` of the ring's blocked scales); S1 reads x's e4m3 rows and blocked scales.
R1 / S1's SwiGLU epilogue also writes h / hs quantized along I (an epilogue thread's 32 columns
are one MX block) into hq [M_cap, I] / hsq [T, I_s] e4m3 and blocked scales (hq's at the grouped
row placement of ``pack_row_scales``, zero-initialised), GEMM2's A operands. gu, h, gus, hs stay
bf16 (what the unfused MXFP8 backward reads). Weights and their scales come quantized from the
caller (along their rows: ``layers.sm100.quantize_weight(w, 2)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from mok_cute.comm import protocol as P
from mok_cute.comm.peer_rows import PeerRows, PeerSections
from mok_cute.comm.rows import bulk_s2g
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import _check_limit, _check_tensor, sm_count
from mok_cute.dsl.launch import GraphLauncher
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels import slot_rows
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.kernels.sm100.bias import check_bias, fake_bias
from mok_cute.kernels.sm100.bundles import (
    ExpertBias, FwdCounters, FwdMx, FwdOperands, FwdOutputs, FwdPeer, FwdRouting, FwdScalars, launch_bundles, present,
)
from mok_cute.kernels.sm100.grouped_gemm import (
    ARCHS, BIAS_PTX, GPT_OSS, MXFP8_2CTA_CONFIG, MXFP8_CONFIG, GroupedGemmSm100, _bf16, _check_gate_up_scales,
    _check_scales, _fake_sf, interleave_gate_up,
)
from mok_cute.kernels.swiglu_math import Gated, swiglu_args
from mok_cute.kernels.sm100 import task_ring
from mok_cute.kernels.sm100.mainloop import (
    EPI_N, EPI_THREADS, MMA_WARP, NUM_THREADS, SF_DTYPE, TMA_WARP, AccChunks, Sm100Config, Sm100Mainloop, epi_barrier,
)
from mok_cute.kernels.sm90 import persistent
from mok_cute.kernels.sm90.fused_moe import (
    _NO_EP, CHUNK, DONE, EP_SECTIONS, GATHER, GATHER_KIND, GATHER_UNROLL, H_READY, RING, RING_BAND, SH_READY,
    SUM_BATCH, counter_sizes, record_sum, routed_outputs,
)
from mok_cute.kernels.sm90.persistent import TRACE_WORDS
from mok_cute.kernels.operands import ExpertWeights, FusedForwardOut, FusedLaunch, RoutePlan, SharedExpert
from mok_cute.schedule import fused_tasks as tasks
from mok_cute.schedule.fused_tasks import R1, R2, S1, S2

CONFIG = Sm100Config()  # 128 x 256 x 64 BF16, cta_group::1: the unfused SM100 GEMMs' tiles
MX_CONFIG = MXFP8_CONFIG  # 128 x 256 x 128 MXFP8: the unfused SM100 MXFP8 GEMMs' tiles
PAIR_CONFIG = Sm100Config(tile_m=256)  # 256 x 256 x 64 BF16, cta_group::2
MX_PAIR_CONFIG = MXFP8_2CTA_CONFIG  # 256 x 256 x 128 MXFP8, cta_group::2
# bulk_push with BF16 cta_group::2 tiles (PAIR_CONFIG's 7 stages leave 2 KiB of shared memory, PUSH_SMEM is 18 KiB)
PAIR_BULK_CONFIG = Sm100Config(tile_m=256, stages=6)
PUSH_BUFS = 2  # bulk_push: staging slices per epilogue thread (its chunks in flight)
PUSH_PITCH = PUSH_BUFS * EPI_N * 2 + 16  # bytes per thread: its 64-byte slices, then 16 (spreads the banks)
PUSH_SMEM = EPI_THREADS * PUSH_PITCH  # the staging area's bytes
PUSH_FIELD = cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, PUSH_SMEM // 2], 128]  # storage field sPush
DIM_MULTIPLE = 64  # H, I, I_s
_VEC = 8  # bf16 elements per 16-byte vector
_FP8 = torch.float8_e4m3fn


@cute.jit
def store_routed(epi: GroupedGemmSm100, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32,
                 mSlot: cute.Tensor, mOrder: cute.Tensor, bias=None):
    """``epi``'s plain epilogue with tile row r (< rows) stored to row ``order[row0 + r]`` of
    ``slot`` (its (token, slot) row): the fused forward's R2 and the fused backward's D1 rows;
    ``bias``: :meth:`GroupedGemmSm100._store_plain`'s (None: none)."""
    route = chunks.row
    if chunks.row < rows:
        route = mOrder[row0 + chunks.row]
    epi._store_plain(chunks, route - chunks.row, rows, n_tile, mSlot, bias=bias)


@cute.jit
def push_routed(epi: GroupedGemmSm100, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32,
                mSlot: cute.Tensor, mOrder: cute.Tensor, ep: PeerRows, bias=None):
    """:func:`store_routed` at EP > 1: tile row r (< rows) stored to rank p's slot row ``t*k + j``
    (``order[row0 + r]`` = ``p*T*k + t*k + j``; ``mSlot`` gives the slot section's layout)."""
    route = chunks.row
    addr = ep.pb[ep.me] + ep.slots_off
    if chunks.row < rows:
        q = mOrder[row0 + chunks.row]
        p = q // ep.tk
        route = q - p * ep.tk
        addr = ep.pb[p] + ep.slots_off
    dst = cute.make_tensor(P.gptr(cutlass.BFloat16, addr, 16), mSlot.layout)
    epi._store_plain(chunks, route - chunks.row, rows, n_tile, dst, bias=bias)


@cute.jit
def push_routed_bulk(epi: GroupedGemmSm100, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32,
                     mSlot: cute.Tensor, mOrder: cute.Tensor, ep: PeerRows, sPush: cute.Tensor, bias=None):
    """:func:`push_routed` (same rows, same destinations) by bulk copies: for each 32-column chunk of
    its row inside H (row r < rows only), the thread converts it to bf16, writes it into its slice
    ``c % PUSH_BUFS`` of ``sPush`` (bf16 [EPI_THREADS, PUSH_PITCH / 2]: row t is thread t's, 64 bytes
    per slice), ``fence.proxy.async.shared::cta``, then one 64-byte ``cp.async.bulk`` shared -> global
    into the peer's slot row and a commit; before rewriting a slice it waits until the copy that read
    it has (``cp.async.bulk.wait_group.read``). Returns after its copies completed
    (``cp.async.bulk.wait_group 0``) and a ``fence.proxy.async.global``, so the caller's system-scope
    fence and release order them before the tile is published; ``bias``: :meth:`GroupedGemmSm100._store_plain`'s
    (None: none). Compile-verified only."""
    row = chunks.row
    cols = mSlot.shape[1] - n_tile * epi.cfg.tile_n
    gaddr = Int64(0)  # this row's first byte of the tile's columns on the owner rank
    if row < rows:
        q = mOrder[row0 + row]
        p = q // ep.tk
        gaddr = ep.pb[p] + ep.slots_off + (Int64(q - p * ep.tk) * Int64(mSlot.stride[0])
                                           + Int64(n_tile * epi.cfg.tile_n)) * 2
    sbase = sPush.iterator.toint() + row * PUSH_PITCH  # this thread's slices
    for c in cutlass.range_constexpr(epi.cfg.tile_n // EPI_N):
        b = c % PUSH_BUFS
        if cutlass.const_expr(bias is None):
            r = _bf16(chunks.load(c))
        else:
            r = epi._biased_chunk(chunks, c, bias, n_tile * epi.cfg.tile_n + c * EPI_N, c * EPI_N < cols)
        stage = chunks.part(cute.local_tile(sPush, (EPI_THREADS, EPI_N), (0, b)))
        if row < rows:
            if c * EPI_N < cols:
                if cutlass.const_expr(c >= PUSH_BUFS):  # the copy of chunk c - PUSH_BUFS has read the slice
                    cute.arch.cp_async_bulk_wait_group(PUSH_BUFS - 1, read=True)
                cute.autovec_copy(r, stage)
                cute.arch.fence_proxy("async.shared", space="cta")  # the slice's generic writes before the copy
                bulk_s2g(gaddr + c * EPI_N * 2, sbase + b * EPI_N * 2, Int32(EPI_N * 2))
                cute.arch.cp_async_bulk_commit_group()
    cute.arch.cp_async_bulk_wait_group(0)
    cute.arch.fence_proxy("async.global")


def tile_config(mx: bool, tile_m: int, bulk_push: bool = False) -> Sm100Config:
    """Both megakernels' tile config: BF16 or MXFP8, ``tile_m`` 128 or 256 (``cta_group::2``);
    ``bulk_push`` with BF16 256-row tiles: 6 stages, room for :data:`PUSH_SMEM`."""
    if tile_m == 128:
        return MX_CONFIG if mx else CONFIG
    if mx:
        return MX_PAIR_CONFIG
    return PAIR_BULK_CONFIG if bulk_push else PAIR_CONFIG


def check_push_fits(ml: Sm100Mainloop):
    """ValueError unless :data:`PUSH_SMEM` fits in shared memory next to ``ml``'s stages."""
    if ml.smem_bytes + PUSH_SMEM > lay.SMEM_CAPACITY:
        raise ValueError(f"bulk_push: the {PUSH_SMEM}-byte staging area does not fit next to the mainloop's "
                         f"{ml.stages} stages ({ml.smem_bytes} of {lay.SMEM_CAPACITY} bytes of shared memory)")


def push_staging(storage) -> cute.Tensor:
    """The bf16 [EPI_THREADS, PUSH_PITCH / 2] staging rows of :func:`push_routed_bulk` in a kernel
    storage's ``sPush`` field (:data:`PUSH_FIELD`)."""
    return cute.make_tensor(storage.sPush.data_ptr(), cute.make_layout((EPI_THREADS, PUSH_PITCH // 2),
                                                                       stride=(PUSH_PITCH // 2, 1)))


TILE_MS = (128, 256)  # the megakernels' tile rows: cta_group::1, cta_group::2 (CTA pairs)
GATHERS = ("comm", "tma")  # R1's rows: gathered into the ring by the comm CTAs, or TMA gather4 from x


def check_tile_m(tile_m) -> None:
    """ValueError unless ``tile_m`` is one of :data:`TILE_MS` (the fused kernels' tile rows)."""
    if isinstance(tile_m, bool) or tile_m not in TILE_MS:
        raise ValueError(f"tile_m must be one of {TILE_MS} on the sm100 fused kernels (256: cta_group::2 CTA "
                         f"pairs), got {tile_m!r}")


@dataclass(frozen=True)
class FwdVariant:
    """What changes the fused forward's generated code (with the arch, its compile cache key).

    ``clamp``: a SwiGLU limit is given; ``shared``: a shared expert is fused in; ``gate``: the slot
    sum starts from fp32(s_out) * gate (needs ``shared``); ``mx``: MXFP8; ``ep``: EP > 1; ``trace``:
    per-task records; ``gather``: ``"comm"`` (the comm CTAs gather R1's rows into the ring) or
    ``"tma"`` (BF16, EP = 1, ``tile_m`` 128: R1's TMA warp loads x's rows by token with
    ``tile::gather4``, no ring; compile-verified only, never measured against the ring); ``tile_m``
    128 or 256 (``cta_group::2``); ``bulk_push`` (needs ``ep``): R2's rows into the peers by
    ``cp.async.bulk``; ``unroll``: 16-byte loads in flight per gather lane; ``sum_batch``: slot rows
    in flight per slot-sum thread; ``gated``: the SwiGLU's alpha and up offset (None: silu(g) * u;
    :mod:`mok_cute.kernels.swiglu_math`); ``biased`` (BF16): the routed experts' biases added in R1's and R2's
    epilogues (:class:`~mok_cute.kernels.sm100.bundles.ExpertBias`, :mod:`~mok_cute.kernels.sm100.bias`)."""

    clamp: bool
    shared: bool
    gate: bool = False
    mx: bool = False
    ep: bool = False
    trace: bool = False
    gather: str = "comm"
    tile_m: int = 128
    bulk_push: bool = False
    unroll: int = 8
    sum_batch: int = SUM_BATCH
    gated: Gated | None = None
    biased: bool = False

    def __post_init__(self):
        check_tile_m(self.tile_m)
        if self.biased and self.mx:
            raise ValueError("biased (expert biases): the BF16 fused forward only, not mx")
        if self.gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {self.gather!r}")
        if self.gate and not self.shared:
            raise ValueError("gate (the shared expert's output gate) needs shared")
        if self.bulk_push and not self.ep:
            raise ValueError("bulk_push (R2's rows by cp.async.bulk into the peers) needs ep (EP > 1)")
        if self.gather == "tma" and (self.mx or self.ep or self.tile_m != 128):
            raise ValueError("gather='tma' (R1's rows by TMA gather4 from x) is the BF16 EP = 1 forward's, tile_m 128")


class FusedMoeFwdSm100:
    """The persistent fused forward of variant ``v`` (:class:`FwdVariant`; see the module doc).
    ``__call__`` takes the bundles of :mod:`~mok_cute.kernels.sm100.bundles`: :class:`FwdMx` holds the
    MXFP8 operands (None each at BF16), :class:`FwdPeer` the EP > 1 ones (ignored at EP = 1),
    :class:`FwdRouting`'s ``tok`` the TMA gather's token per grouped row (``order[p] // k``, then
    padding; the comm CTAs then only run GEMM tasks). ``tile_m`` 256: ``cta_group::2`` tiles
    (:data:`PAIR_CONFIG` / :data:`MX_PAIR_CONFIG`): a cluster of two CTAs runs each task, the
    leader claiming it for both (:func:`~mok_cute.kernels.sm100.task_ring.publish_pair`), each CTA
    loading and storing its 128 rows; m-tiles, gather chunks and ring slots are 256 rows; both CTAs
    publish a finished task, so every readiness target counts each tile twice. ``bulk_push``: R2's
    rows go to the peers from a staging area of :data:`PUSH_SMEM` bytes in shared memory after the
    mainloop's stages (:func:`push_routed_bulk`; BF16 ``tile_m`` 256 then runs
    :data:`PAIR_BULK_CONFIG`'s 6 stages); compile-verified only."""

    def __init__(self, v: FwdVariant):
        mx, ep, bulk_push, sum_batch = v.mx, v.ep, v.bulk_push, v.sum_batch
        self.variant, self.tma_gather = v, v.gather == "tma"
        cfg = tile_config(mx, v.tile_m, bulk_push)
        self.bulk_push = bulk_push
        self.cfg, self.clamp, self.shared, self.unroll, self.trace, self.mx = cfg, v.clamp, v.shared, v.unroll, \
            v.trace, mx
        self.ep, self.biased = ep, v.biased
        self.sum_batch = sum_batch
        self.per = 4 if mx else 2  # TMA descriptors per GEMM: A, B[, SFA, SFB]
        self.mainloop = Sm100Mainloop(cfg)
        if bulk_push:
            check_push_fits(self.mainloop)
        self.swiglu = GroupedGemmSm100(cfg, "swiglu", v.clamp, gated=v.gated)  # its views and epilogues (the unfused
        # path's)
        self.plain = GroupedGemmSm100(cfg, "plain")
        self.cg = cfg.cta_group  # CTAs per tile: each publishes it (readiness targets count tiles cg times)
        self.chunk = cfg.tile_m  # rows of a gather chunk, a ring slot and an m-tile
        b_bytes = self.mainloop.stages * (cfg.tile_n // self.cg) * lay.K_TILE_BYTES
        self.staged = not mx and not ep and not self.tma_gather  # the bf16 EP = 1 gather through the idle B stages
        self.gather_cap = b_bytes // (2 * NUM_THREADS * _VEC * 2)
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
            "sA": cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, cute.cosize(ml.a_smem.outer)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, cute.cosize(ml.b_smem.outer)], 1024],
        }
        if cutlass.const_expr(self.mx):
            fields["sSFA"] = cute.struct.Align[cute.struct.MemRange[SF_DTYPE, cute.cosize(ml.sfa_smem)], 1024]
            fields["sSFB"] = cute.struct.Align[cute.struct.MemRange[SF_DTYPE, cute.cosize(ml.sfb_smem)], 1024]
        if cutlass.const_expr(self.bulk_push):  # push_routed_bulk's staging rows
            fields["sPush"] = PUSH_FIELD
        return cute.struct(type("FusedFwdStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, ops: FwdOperands, outs: FwdOutputs, plan: FwdRouting, counters: FwdCounters, mx: FwdMx,
                 scalars: FwdScalars, peer: FwdPeer, bias: ExpertBias, stream: cuda.CUstream):
        """Launch on ``stream`` (the module doc; each bundle's doc gives shapes and dtypes). The kernel
        gets the same bundles less what only this host side reads (the weights and the operands the
        TMA atoms carry, the grid size) and, at EP = 1, no ``peer``; ``bias`` (``biased``; else None): the
        routed experts' biases, read by the epilogue warps."""
        mx = FwdMx() if mx is None else mx  # BF16: no MXFP8 operands (bundles.present)
        ml = self.mainloop
        ml.setup()
        views = self.swiglu._views  # (M|N, K, L) views of A, B[, SFA, SFB]; ring and shared: no per-expert atoms
        a2, a2s = (mx.hq, mx.hsq) if cutlass.const_expr(self.mx) else (outs.h, outs.hs)  # GEMM2's A operands
        tmas = ml.make_tma(*views(ops.xg, ops.w1, mx.ring_sf, mx.w1_sf, 0)) + \
            ml.make_tma(*views(a2, ops.w_down, mx.h_sf, mx.wd_sf, plan.offsets.shape[0] - 1))
        if cutlass.const_expr(self.tma_gather):  # R1's A: x's rows by token, not the ring
            tmas[0] = ml.make_gather4_tma_a(ops.x, plan.tok)
        if cutlass.const_expr(self.shared):
            tmas = tmas + ml.make_tma(*views(ops.x, ops.s1, mx.x_sf, mx.s1_sf, 0)) + \
                ml.make_tma(*views(a2s, ops.s_down, mx.hs_sf, mx.sd_sf, 0))
        self.shared_storage = self._storage()
        self.kernel([t[0] for t in tmas], [t[1] for t in tmas],
                    ops._replace(w1=None, w_down=None, s1=None, s_down=None), outs, plan._replace(tok=None), counters,
                    mx._replace(w1_sf=None, wd_sf=None, x_sf=None, s1_sf=None, sd_sf=None),
                    scalars._replace(num_ctas=None), peer if cutlass.const_expr(self.ep) else None,
                    bias if cutlass.const_expr(self.biased) else None).launch(
            grid=[scalars.num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[self.cg, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, atoms: list, coords: list, ops: FwdOperands, outs: FwdOutputs, plan: FwdRouting,
               counters: FwdCounters, mx: FwdMx, scalars: FwdScalars, peer: FwdPeer, bias: ExpertBias):
        mX, mXg = ops.x, ops.xg
        mGU, mH, mGUs, mHs, mSlot, mSout, mY = outs
        mOrder, mOffsets, mIdx, mW, mGate, _ = plan
        mGather, mHready, mShready, mDone, mStatus, mTrace = counters
        k, limit, comm_ctas, _, ring, band, timeout_ns = scalars
        cfg, ml, per = self.cfg, self.mainloop, self.per
        ml.setup()
        warp, tidx, storage, pipes = task_ring.kernel_start(ml, atoms, self.shared_storage)
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        smem = ml.smem_tensors(storage)  # sA, sB, sSFA, sSFB (MXFP8)
        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cg, 1))
        status = mStatus.iterator
        cta_v = bidx % self.cg  # this CTA's half of a cta_group::2 tile (0: the leader)

        tokens = mX.shape[0]
        hidden = mX.shape[1]
        ep = slot_copy = None  # EP > 1: the symmetric workspace's rows and flags
        if cutlass.const_expr(self.ep):
            slot_copy = peer[2]
            ep = PeerRows(peer[0], peer[1], peer[3], peer[4], PeerSections(*peer[5:9]), peer[9], peer[10], tokens * k,
                          timeout_ns, status)
        num_experts = mOffsets.shape[0] - 1
        n1 = (coords[1].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n  # GEMM1 n-tiles (2 I_p / tile_n)
        n2 = (coords[per + 1].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n  # GEMM2 n-tiles (H / tile_n, rounded up)
        k1 = (hidden + (cfg.tile_k - 1)) // cfg.tile_k
        k2 = (coords[per].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        m_sh = (tokens + (cfg.tile_m - 1)) // cfg.tile_m
        n1s = Int32(0)
        k2s = Int32(0)
        n_s2 = Int32(0)
        if cutlass.const_expr(self.shared):
            n1s = (coords[2 * per + 1].shape[0] + (cfg.tile_n - 1)) // cfg.tile_n
            k2s = (coords[3 * per].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
            n_s2 = m_sh * n2
        mt_routed = tasks.routed_mtiles(mOffsets, num_experts, cfg.tile_m)
        n_s1 = m_sh * n1s
        n_r1 = mt_routed * n1
        n_tasks = n_s1 + n_r1 + n_s2 + mt_routed * n2
        shape = (n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band)
        work = (shape, (k1, k2, k2s), num_experts, tokens)  # the task list and k-tiles (the roles' geometry)

        if cutlass.const_expr(not self.tma_gather):  # tma_gather: no gather, the comm CTAs run GEMM tasks
            if bidx < comm_ctas:  # first the gather, then GEMM tasks like every CTA
                gbuf = None
                if cutlass.const_expr(self.staged):
                    gbuf = cute.make_tensor(cute.recast_ptr(storage.sB.data_ptr(), dtype=cutlass.BFloat16),
                                            cute.make_layout((2 * self.gather_cap * NUM_THREADS, _VEC),
                                                             stride=(_VEC, 1)))
                self._gather(tidx, bidx, ops, plan, counters, mx, scalars,
                             (num_experts, mt_routed, task_ring.tile_target(n1, self.cg)), ep, gbuf, status)
                if cutlass.const_expr(self.staged):  # generic-proxy writes of the B stages before their TMA loads
                    cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier()
        if warp == TMA_WARP:
            self._produce(pipes, (atoms, coords, smem), mDone.iterator + 1, work, plan, counters, scalars, status,
                          cta_v)
        if warp == MMA_WARP:
            if cta_v == 0:  # cta_group::2: the leader issues the pair's MMAs
                self._mma(pipes, smem, work)
        if warp < MMA_WARP:
            sPush = push_staging(storage) if cutlass.const_expr(self.bulk_push) else None
            self._epilogue(pipes, (tidx, bidx, cta_v), work, outs, plan, counters, mx, scalars, mGather.shape[0], ep,
                           sPush, bias)

        # every CTA: the slot sum, once every GEMM2 tile is stored
        cute.arch.barrier()
        t0 = persistent.now(self.trace)
        if tidx == 0:
            P.wait_geq(mDone.iterator, task_ring.tile_target(n_s2 + mt_routed * n2, self.cg), timeout_ns, status,
                       Int32(0), Int32(DONE))
            if cutlass.const_expr(self.ep):  # every rank's rows are in my slot buffer (DATA)
                ep.wait_rows(bidx)
        cute.arch.barrier()
        t1 = persistent.now(self.trace)
        sbuf = cute.make_tensor(cute.recast_ptr(storage.sB.data_ptr(), dtype=cutlass.BFloat16),
                                cute.make_layout((self.sum_batch * NUM_THREADS, _VEC), stride=(_VEC, 1)))
        s_out = mSout if cutlass.const_expr(self.shared) else None
        sums = slot_rows.SlotSumOperands(mSlot, s_out, mY, mIdx, mW, mGate, copy=slot_copy)
        slot_rows.slot_sum(tidx, bidx, grid, sums, k, tokens, hidden, sbuf, self.sum_batch, NUM_THREADS)
        if cutlass.const_expr(self.ep):  # every CTA has read its slot rows: the last one says FREE
            ep.close_push(tidx, mDone.iterator + 3, grid)
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                record_sum(mTrace, grid, bidx, t0, t1)
        task_ring.pair_exit(self.cg)

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _gather(self, tidx: Int32, bidx: Int32, ops: FwdOperands, plan: FwdRouting, counters: FwdCounters, mx: FwdMx,
                scalars: FwdScalars, tiles: tuple, ep, gbuf: cute.Tensor, status: cute.Pointer):
        """Comm CTA ``bidx``: chunks ``c = bidx, bidx + comm_ctas, ...`` in order (see the module doc);
        ``tiles`` = (experts, routed m-tiles = chunks, GEMM1 tiles an m-tile's slot waits for).
        BF16 at EP = 1 (``staged``): through ``gbuf``, the idle B stages
        (:func:`~mok_cute.kernels.slot_rows.gather_rows_staged`, as the SM90 forward's comm CTAs).
        MXFP8: a row's e4m3 bytes, then its scale words (``mXsw`` [T, W] int32, W = ceil(H / 128):
        4 E8M0 bytes of one scale atom each) to ring slot ``c % ring``'s scale atom row of the blocked
        ``mXgsf`` (:func:`~mok_cute.kernels.sm100.layouts.sf_byte`). EP > 1 (``ep``): the rows (and
        MXFP8 scale words, after a staged row's H data bytes) are pulled from the source ranks' staged
        rows and lane 0 pulls each row's router weight into ``w_rows``, between the READY and DONE
        signals of the pull protocol (the module doc)."""
        mX, mXg, mOrder, mOffsets = ops.x, ops.xg, plan.order, plan.offsets
        mGather, mHready, mDone, mTrace = counters.gather_ready, counters.h_ready, counters.done, counters.trace
        mXsw, mXgsf = mx.x_words, mx.ring_sf
        k, comm_ctas, ring, timeout_ns = scalars.k, scalars.comm_ctas, scalars.ring, scalars.timeout_ns
        num_experts, chunks, n1 = tiles
        hid = mXg.shape[1]
        row_bytes = hid * (self.cfg.ab_dtype.width // 8)
        warp = tidx // 32
        lane = tidx % 32
        base = mX.iterator.toint()
        dbase = mXg.iterator.toint()
        xsw = rsw = None
        if cutlass.const_expr(self.mx):
            xsw = mXsw
            rsw = cute.make_tensor(cute.recast_ptr(mXgsf.iterator, dtype=Int32),
                                   cute.make_layout((mXgsf.shape[0] // 4,)))
        src_bytes = None  # a staged source row's bytes (EP > 1)
        if cutlass.const_expr(self.ep):
            src_bytes = row_bytes
            if cutlass.const_expr(self.mx):
                src_bytes = hid + (hid // lay.SF_VEC + 15) // 16 * 16  # comm.workspace.mxfp8_row_bytes
            ep.open_pull(tidx, bidx)
        ge, gb = Int32(0), Int32(0)  # m-tile cursor (tasks.mtile)
        for c in cutlass.range(bidx, chunks, comm_ctas, unroll=1):
            t0 = persistent.now(self.trace)
            row0, rows, ge, gb = tasks.chunk_start(tidx, c, ring, n1, mOffsets, num_experts, self.chunk, ge, gb,
                                                   tasks.RingWait(mHready, timeout_ns, status, Int32(RING)))
            slot_row = (c % ring) * self.chunk
            if cutlass.const_expr(self.staged):
                slot_rows.gather_rows_staged(tidx, rows, hid // _VEC,
                                             slot_rows.TokenRows(mOrder, row0, k, base, row_bytes), dbase, slot_row,
                                             gbuf, NUM_THREADS, self.gather_cap)
            else:
                for rr in cutlass.range(warp, rows, NUM_THREADS // 32, unroll=1):
                    q = mOrder[row0 + rr]
                    tok = q // k
                    if cutlass.const_expr(self.ep):
                        src = ep.src_row(q, k, src_bytes)
                        if lane == 0:
                            ep.pull_w(q, row0 + rr)
                    else:
                        src = base + Int64(tok) * Int64(row_bytes)
                    dst = dbase + Int64(slot_row + rr) * Int64(row_bytes)
                    slot_rows.copy_row(lane, src, dst, hid // (128 // self.cfg.ab_dtype.width), self.unroll)
                    if cutlass.const_expr(self.mx):
                        words = xsw.shape[1]
                        for j in cutlass.range(lane, words, 32, unroll=1):
                            if cutlass.const_expr(self.ep):
                                w = cute.make_tensor(P.gptr(Int32, src + Int64(hid + 4 * j)), cute.make_layout((1,)))[0]
                            else:
                                w = xsw[tok, j]
                            if cutlass.const_expr(self.cg == 1):
                                rsw[lay.sf_byte(c % ring, rr, lay.SF_ATOM_KBLOCKS * j, words) // 4] = w
                            else:  # a 256-row slot holds two scale atom rows
                                rsw[lay.sf_byte((c % ring) * 2 + rr // lay.SF_ATOM_ROWS, rr % lay.SF_ATOM_ROWS,
                                                lay.SF_ATOM_KBLOCKS * j, words) // 4] = w
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(mGather.iterator + c, Int32(1), sem="release", scope="gpu")
                if cutlass.const_expr(self.trace):
                    persistent.record(mTrace, c, t0, persistent.now(self.trace), GATHER_KIND, bidx, c)
        if cutlass.const_expr(self.ep):  # every comm CTA has pulled its chunks: the last one says DONE
            ep.close_pull(tidx, mDone.iterator + 2, comm_ctas)

    @cute.jit
    def _produce(self, pipes: task_ring.Pipes, tma: tuple, ticket: cute.Pointer, work: tuple, plan: FwdRouting,
                 counters: FwdCounters, scalars: FwdScalars, status: cute.Pointer, cta_v: Int32):
        """TMA warp: claim tasks from the ticket (list order across the grid), hand each on, wait
        for its inputs, load its k-tiles; the first id >= n_tasks is handed on last (stop).
        ``cta_group::2``: the leader claims for the pair, the peer takes the leader's ids, and each
        loads its halves of the tiles (``cta_v``). ``tma`` = (atoms, coords, smem), ``work`` the
        kernel's (task list sizes, k-tiles, experts, tokens)."""
        ab_pipe, task_pipe, sTask = pipes.ab, pipes.task, pipes.sTask
        atoms, coords, smem = tma
        shape, (k1, k2, k2s), num_experts, tokens = work
        mOffsets, mGather, mHready, mShready = plan.offsets, counters.gather_ready, counters.h_ready, counters.sh_ready
        ring, timeout_ns = scalars.ring, scalars.timeout_ns
        n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band = shape
        parts = self._b_parts(atoms, coords, smem, cta_v)
        state = self.mainloop.producer_state()
        tstate = task_ring.producer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        t, tstate = task_ring.next_task(ticket, task_pipe, tstate, sTask, cta_v, self.cg == 2)
        while t < n_tasks:
            phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2 = tasks.task(
                t, tasks.ListShape(n_s1, n_r1, n_s2, m_sh, n1, n2), mOffsets, num_experts, tokens, self.cfg.tile_m,
                band, e1, b1, e2, b2)
            if cutlass.const_expr(not self.tma_gather):  # the gathered chunk (tma_gather: x is ready)
                if phase == R1:
                    persistent.wait_input(mGather.iterator + mt, Int32(1), timeout_ns, status, Int32(GATHER), mt)
            if phase == R2:
                persistent.wait_input(mHready.iterator + mt, task_ring.tile_target(n1, self.cg), timeout_ns, status,
                                      Int32(H_READY), mt)
            if cutlass.const_expr(self.shared):
                if phase == S2:
                    persistent.wait_input(mShready.iterator + mt, task_ring.tile_target(n1s, self.cg), timeout_ns,
                                          status,
                                          Int32(SH_READY), mt)
            if phase == R1:
                slot = mt % ring
                a_row = row0 if cutlass.const_expr(self.tma_gather) else slot * self.chunk  # x's rows by token / ring
                state = self._load(ab_pipe, state, tma, parts, 0, a_row, slot, n_tile, expert, k1, cta_v)
            elif phase == R2:
                state = self._load(ab_pipe, state, tma, parts, 1, row0, self._sf_row(mOffsets, expert, row0), n_tile,
                                   expert, k2, cta_v)
            else:
                if cutlass.const_expr(self.shared):
                    if phase == S1:
                        state = self._load(ab_pipe, state, tma, parts, 2, row0, mt, n_tile, Int32(0), k1, cta_v)
                    else:
                        state = self._load(ab_pipe, state, tma, parts, 3, row0, mt, n_tile, Int32(0), k2s, cta_v)
            t, tstate = task_ring.next_task(ticket, task_pipe, tstate, sTask, cta_v, self.cg == 2)
        ab_pipe.producer_tail(state)


    def _b_parts(self, atoms, coords, smem, cta_v):
        """Per GEMM (R1, R2[, S1, S2]): the (smem, gmem) TMA partitions of B over every (n-tile,
        k-tile, expert) and, MXFP8, of SFA over every (atom row, k-tile) and SFB as B's."""
        cfg, ml, per = self.cfg, self.mainloop, self.per
        sA, sB, sSFA, sSFB = smem
        tiler_a = (cfg.tile_m, cfg.tile_k)
        tiler_b = (cfg.tile_n, cfg.tile_k)
        every = (None, None, None)
        parts = []
        for g in range(len(atoms) // per):
            i = g * per
            p = [ml.partition_b(atoms[i + 1], cute.local_tile(coords[i + 1], tiler_b, every), sB, cta_v)]
            if cutlass.const_expr(self.mx):
                p.append(ml.partition_a(atoms[i + 2], cute.local_tile(coords[i + 2], tiler_a, every), sSFA, cta_v))
                p.append(ml.partition_sfb(atoms[i + 3], cute.local_tile(coords[i + 3], tiler_b, every), sSFB, cta_v))
            parts.append(p)
        return parts

    @cute.jit
    def _load(self, ab_pipe, state, tma: tuple, parts, g: cutlass.Constexpr[int], row0: Int32, sf_row: Int32,
              n_tile: Int32, expert: Int32, k_tiles: Int32, cta_v: Int32):
        """TMA warp: the k-tiles of GEMM ``g``'s tile (A rows from ``row0``, B's ``n_tile`` of
        ``expert``; MXFP8: SFA's tile ``sf_row`` (R2: the scale atom row where the tile's scales
        start, maybe odd with 256-row tiles), SFB as B) into the ring; ``tma`` = (atoms, coords,
        smem); ``cta_v``: this CTA's halves of a ``cta_group::2`` tile."""
        atoms, coords, smem = tma
        ml, per = self.mainloop, self.per
        i = g * per
        tiler = (self.cfg.tile_m, self.cfg.tile_k)
        if cutlass.const_expr(g == 0 and self.tma_gather):  # grouped rows row0 .. of the token index tensor
            xc, rows = coords[0]
            tAsA, tAgA = ml.partition_a_gather(atoms[0], cute.local_tile(cute.domain_offset((row0, 0), xc), tiler,
                                                                         (0, None)),
                                               cute.local_tile(cute.domain_offset((row0, 0), rows), tiler, (0, None)),
                                               smem[0])
        else:
            gA = cute.local_tile(cute.domain_offset((row0, 0), coords[i][(None, None, 0)]), tiler, (0, None))
            tAsA, tAgA = ml.partition_a(atoms[i], gA, smem[0], cta_v)
        sB, gB = parts[g][0]
        srcs, dsts = (tAgA, gB[(None, n_tile, None, expert)]), (tAsA, sB)
        if cutlass.const_expr(self.mx):
            (sSFA, gSFA), (sSFB, gSFB) = parts[g][1], parts[g][2]
            sfa = gSFA[(None, sf_row, None, 0)]
            if cutlass.const_expr(self.cg == 2 and g == 1):  # the grouped scales: offset by atom rows, then tile
                g_sf = cute.local_tile(
                    cute.domain_offset((sf_row * lay.SF_ATOM_ROWS, 0), coords[i + 2][(None, None, 0)]), tiler, (0, None))
                _, sfa = ml.partition_a(atoms[i + 2], g_sf, smem[2], cta_v)
            srcs = srcs + (sfa, gSFB[(None, n_tile, None, expert)])
            dsts = dsts + (sSFA, sSFB)
        return ml.load_tile(ab_pipe, state, atoms[i:i + per], srcs, dsts, k_tiles, Int32(0),
                            ml.mcast_masks(cta_v)[:per])

    @cute.jit
    def _sf_row(self, mOffsets: cute.Tensor, expert: Int32, row0: Int32) -> Int32:
        """The scale atom row of grouped row ``row0`` (of ``expert``; a tile's or a CTA's first) in the
        grouped blocked layout (:func:`~mok_cute.kernels.sm100.layouts.pack_row_scales`)."""
        lo = mOffsets[expert]
        return lo // lay.SF_ATOM_ROWS + expert + (row0 - lo) // lay.SF_ATOM_ROWS

    @cute.jit
    def _mma(self, pipes: task_ring.Pipes, smem, work: tuple):
        """MMA warp: each task's tile into the next TMEM accumulator stage (MXFP8: each k-tile's
        scales copied to TMEM first, :meth:`Sm100Mainloop.mma_tile`)."""
        ab_pipe, acc_pipe, task_pipe, sTask, tmem = pipes
        shape, (k1, k2, k2s), _, _ = work
        n_tasks, n_s1, n_r1, n_s2 = shape[0], shape[1], shape[2], shape[3]
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.mainloop.acc_tensor(acc_ptr)
        tCrA, tCrB, sf = self.mainloop.mma_fragments(*smem, acc_ptr)
        tiled_mma = self.mainloop.make_tiled_mma()
        state = self.mainloop.consumer_state()
        acc_state = self.mainloop.acc_producer_state()
        tstate = task_ring.consumer_state()
        t, tstate = task_ring.take_any(task_pipe, tstate, sTask, True, self.cg == 2)
        while t < n_tasks:
            kt = k1  # S1, R1
            if t >= n_s1 + n_r1 + n_s2:
                kt = k2
            elif t >= n_s1 + n_r1:
                kt = k2s
            acc_pipe.producer_acquire(acc_state)
            state, tiled_mma = self.mainloop.mma_tile(tiled_mma, ab_pipe, state, tCrA, tCrB, sf,
                                                      acc[(None, None, None, acc_state.index)], kt)
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t, tstate = task_ring.take_any(task_pipe, tstate, sTask, True, self.cg == 2)
        acc_pipe.producer_tail(acc_state)


    @cute.jit
    def _epilogue(self, pipes: task_ring.Pipes, who: tuple, work: tuple, outs: FwdOutputs, plan: FwdRouting,
                  counters: FwdCounters, mx: FwdMx, scalars: FwdScalars, trace_base: Int32, ep,
                  sPush: cute.Tensor = None, bias: ExpertBias = None):
        """Epilogue warps (``who`` = (tidx, bidx, cta_v)): store each task's accumulator, then publish
        it (release add by thread 0 after every thread's GPU-scope fence and the epilogue barrier;
        ``work`` the kernel's task geometry, the bundles the kernel's). MXFP8: R1 / S1 also store
        h / hs quantized (GEMM2's A: ``mHq`` + ``mHsf`` at the tile's grouped scale atom row,
        ``mHsq`` + ``mHssf`` at its m-tile). EP > 1 (``ep``): R2 rows go to the source ranks' slot
        sections (:func:`push_routed`) once every rank freed its slot buffer of the previous push
        epoch (thread 0 waits FREE >= epoch - 1 before this CTA's first R2 tile), and the fences are
        system-scope; ``bulk_push``: by :func:`push_routed_bulk` through ``sPush``, after a
        ``fence.proxy.async.global`` behind the FREE wait. ``cta_group::2``: this CTA stores rows
        ``cta_v * 128 ..`` of each tile (its TMEM half) and publishes the tile too (the leader alone
        records it in the trace). ``biased``: R1's accumulators plus ``bias``'s b_gate / b_up of the task's expert,
        R2's plus its b_down, before they are rounded (:mod:`~mok_cute.kernels.sm100.bias`)."""
        _, acc_pipe, task_pipe, sTask, tmem = pipes
        tidx, bidx, cta_v = who
        shape, _, num_experts, tokens = work
        mGU, mH, mGUs, mHs, mSlot, mSout, _ = outs
        mOrder, mOffsets = plan.order, plan.offsets
        mHready, mShready, mDone, mTrace = counters.h_ready, counters.sh_ready, counters.done, counters.trace
        mHq, mHsf, mHsq, mHssf, limit = mx.hq, mx.h_sf, mx.hsq, mx.hs_sf, scalars.limit
        n_tasks, n_s1, n_r1, n_s2, m_sh, n1, n1s, n2, band = shape
        tmem.allocate(self.mainloop.tmem_alloc)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(Float32)
        acc = self.mainloop.acc_tensor(acc_ptr)
        acc_state = self.mainloop.acc_consumer_state()
        tstate = task_ring.consumer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        freed = Int32(0)
        t, tstate = task_ring.take_any(task_pipe, tstate, sTask, False, self.cg == 2)
        while t < n_tasks:
            phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2 = tasks.task(
                t, tasks.ListShape(n_s1, n_r1, n_s2, m_sh, n1, n2), mOffsets, num_experts, tokens, self.cfg.tile_m,
                band, e1, b1, e2, b2)
            sf_mt = mt  # hsq's scale atom row (S1)
            if cutlass.const_expr(self.cg == 2):  # this CTA's 128 rows of the tile
                row0 = row0 + cta_v * EPI_THREADS
                rows = rows - cta_v * EPI_THREADS
                sf_mt = mt * 2 + cta_v
            t0 = persistent.now(self.trace)
            acc_pipe.consumer_wait(acc_state)
            chunks = AccChunks(acc[(None, None, None, acc_state.index)], tidx)
            if phase == R1:
                if cutlass.const_expr(self.mx):
                    self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGU, mH, limit, mHq, mHsf,
                                              self._sf_row(mOffsets, expert, row0))
                elif cutlass.const_expr(self.biased):
                    self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGU, mH, limit,
                                              bias=(bias.gate, bias.up, expert))
                else:
                    self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGU, mH, limit)
            elif phase == R2:
                if cutlass.const_expr(self.ep):
                    if freed == 0:
                        if tidx == 0:
                            ep.wait_free()
                        epi_barrier()
                        if cutlass.const_expr(self.bulk_push):  # FREE (thread 0's acquire) before async-proxy stores
                            cute.arch.fence_proxy("async.global")
                        freed = Int32(1)
                    if cutlass.const_expr(self.bulk_push):
                        push_routed_bulk(self.plain, chunks, row0, rows, n_tile, mSlot, mOrder, ep, sPush,
                                         self._b_down(bias, expert))
                    else:
                        push_routed(self.plain, chunks, row0, rows, n_tile, mSlot, mOrder, ep,
                                    self._b_down(bias, expert))
                else:
                    store_routed(self.plain, chunks, row0, rows, n_tile, mSlot, mOrder, self._b_down(bias, expert))
            else:
                if cutlass.const_expr(self.shared):
                    if phase == S1:
                        self.swiglu._store_swiglu(chunks, row0, rows, n_tile, mGUs, mHs, limit, mHsq, mHssf, sf_mt)
                    else:
                        self.plain._store_plain(chunks, row0, rows, n_tile, mSout)
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            P.fence_stores(self.ep)  # this thread's stores (EP > 1: into peers too) before thread 0's release
            epi_barrier()
            if tidx == 0:
                tasks.publish(phase, mt, mDone, mHready, mShready)
                if cutlass.const_expr(self.trace):
                    if cta_v == 0:
                        persistent.record(mTrace, trace_base + t, t0, persistent.now(self.trace), phase, bidx, t)
            t, tstate = task_ring.take_any(task_pipe, tstate, sTask, False, self.cg == 2)
        tmem.relinquish_alloc_permit()
        epi_barrier()
        tmem.free(acc_ptr)

    def _b_down(self, bias: ExpertBias, expert):
        """R2's ``bias`` argument of the plain epilogue: ``(b_down, expert)`` when ``biased``, else None."""
        return (bias.down, expert) if self.biased else None


# ---------------------------------------------------------------- compile
def compile_fused_forward_sm100(v: FwdVariant, arch: str = "sm_100a", inspect: bool = False):
    """Compile variant ``v`` (:class:`FwdVariant`) with symbolic T, H, I, I_s, E, M_cap for ``arch``
    (sm_100a / sm_103a); returns ``(compiled, report)``."""
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused forward needs arch in {ARCHS}, got {arch!r}")
    op = FusedMoeFwdSm100(v)
    shared, mx = v.shared, v.mx
    bf, ab = cutlass.BFloat16, op.cfg.ab_dtype
    t, mcap, tk, e = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hid, inter, inter_s = (cute.sym_int(divisibility=DIM_MULTIPLE) for _ in range(3))

    def vec(dtype, n, align=4):
        return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align)

    shared_w = (_fake_3d(ab, cute.sym_int(), cute.sym_int(), hid), _fake_3d(ab, cute.sym_int(), hid, inter_s)) \
        if shared else (None, None)
    shared_out = (_fake_3d(bf, t, cute.sym_int(), inter_s), _fake_2d(bf, t, inter_s)) if shared else (None, None)
    mx_args = FwdMx()
    if mx:  # x scale words, ring / w1 scales, hq + scales, w_down scales, [x, s1 scales, hsq + scales, s_down scales]
        sf = _fake_sf(op.cfg)
        words = cute.runtime.make_fake_tensor(Int32, (t, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4)
        mx_args = FwdMx(words, sf, sf, _fake_2d(ab, mcap, inter), sf, sf,
                        *((sf, sf, _fake_2d(ab, t, inter_s), sf, sf) if shared else (None,) * 5))
    ops = FwdOperands(_fake_2d(ab, t, hid), _fake_2d(ab, cute.sym_int(), hid), _fake_3d(ab, e, cute.sym_int(), hid),
                      _fake_3d(ab, e, hid, inter), *shared_w)
    outs = FwdOutputs(_fake_3d(bf, mcap, cute.sym_int(), inter), _fake_2d(bf, mcap, inter), *shared_out,
                      _fake_2d(bf, tk, hid), _fake_2d(bf, t, hid) if shared else None, _fake_2d(bf, t, hid))
    plan = FwdRouting(vec(Int32, mcap), vec(Int32, cute.sym_int()), vec(Int32, tk), vec(Float32, tk),
                      vec(Float32, t) if v.gate else None,
                      vec(Int32, cute.sym_int(), 16) if v.gather == "tma" else None)
    counters = FwdCounters(*(vec(Int32, cute.sym_int()) for _ in range(5)),
                           vec(Int64, cute.sym_int(), 8) if v.trace else None)
    scalars = FwdScalars(Int32(1), Float32(0.0), Int32(1), Int32(2), Int32(1), Int32(1), Int64(1))
    peer = FwdPeer(*((vec(Int64, cute.sym_int(), 8), vec(Float32, mcap), _fake_2d(bf, tk, hid)) if v.ep
                     else (None,) * 3), *_NO_EP)
    bias = ExpertBias(fake_bias(e, inter), fake_bias(e, inter), fake_bias(e, hid)) if v.biased else None
    return compile_kernel(op, ops, outs, plan, counters, present(mx_args), scalars, peer, bias,
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


# ---------------------------------------------------------------- launch
_last_trace: list = []  # (records int64 [n, 4], comm_ctas) of the last traced launch


def last_trace():
    """``(records int64 [n, 4], comm_ctas)`` of the last traced launch (the SM90 kernel's record
    layout: gather chunks, then every possible task, then two per CTA), or None."""
    return _last_trace[0] if _last_trace else None


@dataclass(frozen=True)
class Sm100Launch(FusedLaunch):
    """:class:`~mok_cute.kernels.operands.FusedLaunch` plus the SM100 megakernels' own choices (the
    forward's and the backward's launch policy; the results do not depend on them).

    tile_m: 128 (``cta_group::1``, the default) or 256 (``cta_group::2``: CTA pairs run 256-row
        tiles; the grid and the comm CTAs rounded to whole pairs, a grid of >= 4 CTAs).
    bulk_push: EP > 1 only (ignored at EP = 1): the GEMM2 (forward) / dgrad1 (backward) rows go into
        the peers by ``cp.async.bulk`` from shared memory instead of ``st.global``
        (``MoKConfig.comm_transport == "bulk"``; compile-verified only).
    gather: the BF16 EP = 1 forward's R1 rows: ``"comm"`` (the default: the comm CTAs gather them into
        the ring) or ``"tma"`` (R1's TMA warp loads x's rows by token with ``tile::gather4``, no ring;
        compile-verified only and never measured against the ring, so no config field reaches it).
    The backward reads ``comm_ctas`` (its gather), ``timeout_s``, ``num_ctas``, ``tile_m`` and
    ``bulk_push``; ``mx`` must say whether MXFP8 weight scales are given.
    """

    tile_m: int = 128
    bulk_push: bool = False
    gather: str = "comm"

    def __post_init__(self):
        check_tile_m(self.tile_m)
        if self.gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {self.gather!r}")
        if not isinstance(self.bulk_push, bool):
            raise TypeError(f"bulk_push must be a bool, got {type(self.bulk_push).__name__}")


class MxScales(NamedTuple):
    """The MXFP8 weights' E8M0 scales (uint8; the weights float8_e4m3fn quantized along their rows,
    ``layers.sm100.quantize_weight(w, 2)``): ``routed`` = (gate [E, I, H/32], up [E, I, H/32], down
    [E, H, I/32]); ``shared`` = the shared expert's (gate [I_s, H/32], up, down [H, I_s/32]) or None."""

    routed: tuple
    shared: tuple | None = None


def _check_operands(x, plan: RoutePlan, weights: ExpertWeights, shared: SharedExpert | None, limit,
                    launch: Sm100Launch, scales: MxScales | None):
    """Raise TypeError / ValueError for operands :func:`fused_forward` cannot launch on."""
    order, offsets, topk_idx, topk_w = plan
    w_gate, w_up, w_down = weights
    gate = None if shared is None else shared.gate
    if scales is not None and scales.routed is None:
        raise ValueError("shared_scales (MXFP8) needs w_scales")
    bf = (torch.bfloat16,)
    mx = scales is not None
    wdt = (_FP8,) if mx else bf  # the weights' dtype
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
    _check_tensor("w_gate", w_gate, 3, wdt)
    e, inter = w_gate.shape[0], w_gate.shape[1]
    if inter == 0 or inter % DIM_MULTIPLE or e == 0:
        raise ValueError(f"w_gate must be [E >= 1, I, H] with I a positive multiple of {DIM_MULTIPLE}, "
                         f"got {tuple(w_gate.shape)}")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must hold E+1 = {e + 1} entries, got {offsets.numel()}")
    named = {"w_gate": (w_gate, (e, inter, hid)), "w_up": (w_up, (e, inter, hid)),
             "w_down": (w_down, (e, hid, inter))}
    if shared is not None:
        _check_tensor("ws_gate", shared.w_gate, 2, wdt)
        inter_s = shared.w_gate.shape[0]
        if inter_s == 0 or inter_s % DIM_MULTIPLE:
            raise ValueError(f"ws_gate: I_s={inter_s} must be a positive multiple of {DIM_MULTIPLE}")
        named.update(ws_gate=(shared.w_gate, (inter_s, hid)), ws_up=(shared.w_up, (inter_s, hid)),
                     ws_down=(shared.w_down, (hid, inter_s)))
    if gate is not None:
        _check_tensor("gate", gate, 1, (torch.float32,))
        if gate.shape[0] != t:
            raise ValueError(f"gate must be [T={t}], got {tuple(gate.shape)}")
    for name, (w, shape) in named.items():
        _check_tensor(name, w, len(shape), wdt)
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(w.shape)}")
    by_name = _check_mx_scales(scales, shared is not None, e, hid, inter,
                               None if shared is None else shared.w_gate.shape[0])
    for name, a in dict(x=x, order=order, offsets=offsets, topk_idx=topk_idx, topk_w=topk_w, gate=gate,
                        **{n: w for n, (w, _) in named.items()}, **by_name).items():
        if a is None:
            continue
        if a.device != x.device:
            raise ValueError(f"{name} is on {a.device} but x is on {x.device}")
        if name not in by_name and (not a.is_contiguous() or a.data_ptr() % 16):
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    _check_limit(limit)
    _check_launch(launch, mx)
    if launch.ring_chunks is not None and launch.ring_chunks < 1:
        raise ValueError(f"ring_chunks must be None or >= 1, got {launch.ring_chunks}")


def _check_launch(launch, mx: bool, min_ctas: int = 2) -> None:
    """TypeError / ValueError for a launch policy the SM100 megakernels cannot take: not an
    :class:`Sm100Launch`, ``mx`` not saying whether MXFP8 scales are given, comm CTAs < 1, a
    timeout <= 0 or a grid under ``min_ctas``."""
    if not isinstance(launch, Sm100Launch):
        raise TypeError(f"launch must be an Sm100Launch, got {type(launch).__name__}")
    if launch.mx != mx:
        raise ValueError(f"launch.mx={launch.mx} but MXFP8 weight scales are {'' if mx else 'not '}given")
    comm = launch.comm_ctas
    if isinstance(comm, bool) or not isinstance(comm, int) or comm < 1:
        raise ValueError(f"comm_ctas must be an int >= 1, got {comm!r}")
    t = launch.timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise TypeError(f"timeout_s must be a number, got {type(t).__name__}")
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {t!r}")
    n = launch.num_ctas
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < min_ctas):
        raise ValueError(f"num_ctas must be None or an int >= {min_ctas}, got {n!r}")


def _check_mx_scales(scales: MxScales | None, shared: bool, e: int, hid: int, inter: int, inter_s):
    """The MXFP8 weight scales (uint8 E8M0, the weights quantized along their rows) by name, {}
    for BF16 (``scales`` None); ValueError / TypeError for missing or misshapen ones."""
    if scales is None:
        return {}
    w_scales, shared_scales = scales
    if not isinstance(w_scales, (tuple, list)) or len(w_scales) != 3:
        raise ValueError("w_scales must be (gate [E, I, H/32], up [E, I, H/32], down [E, H, I/32]) for MXFP8")
    _check_gate_up_scales(w_scales[:2], (e, inter, hid // lay.SF_VEC))
    _check_scales("w_scales[2]", w_scales[2], (e, hid, inter // lay.SF_VEC))
    out = {"w_scales[0]": w_scales[0], "w_scales[1]": w_scales[1], "w_scales[2]": w_scales[2]}
    if not shared:
        if shared_scales is not None:
            raise ValueError("shared_scales given without a shared expert")
        return out
    if not isinstance(shared_scales, (tuple, list)) or len(shared_scales) != 3:
        raise ValueError("shared_scales must be (gate [I_s, H/32], up [I_s, H/32], down [H, I_s/32]) for MXFP8 "
                         "with a shared expert")
    for i, shape in enumerate(((inter_s, hid // lay.SF_VEC),) * 2 + ((hid, inter_s // lay.SF_VEC),)):
        _check_scales(f"shared_scales[{i}]", shared_scales[i], shape)
        out[f"shared_scales[{i}]"] = shared_scales[i]
    return out


def fused_forward(x, plan: RoutePlan, weights: ExpertWeights, shared: SharedExpert | None, limit,
                  launch: Sm100Launch, scales: MxScales | None = None, ws=None,
                  interleave=interleave_gate_up, biases=None) -> FusedForwardOut:
    """Validate, then launch the fused forward on the current stream (BF16 or MXFP8; the contract of
    :func:`mok_cute.kernels.sm90.fused_moe.fused_forward`): x [T, H] bf16; ``plan``: ``order`` int32
    [M_cap] (route ``t*k + j`` of each grouped row, rows sorted by expert), ``offsets`` int32 [E+1]
    (trusted: 0, non-decreasing, last <= M_cap), ``topk_idx`` int32 / ``topk_w`` fp32 [T, k];
    ``weights``: w_gate, w_up [E, I, H], w_down [E, H, I]; ``shared`` None or the shared expert
    (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s]; its ``gate`` None or fp32 [T]: y starts from
    fp32(s_out) * gate); ``limit`` None, the SwiGLU clamp or a :class:`~mok_cute.reference.SwiGLU` (its alpha and up
    offset compiled in); H, I, I_s multiples of 64; every tensor
    contiguous on one sm_100 / sm_103 device. gate / up (and their MXFP8 scales) are interleaved by
    ``interleave(w_gate, w_up, tile_n / 2)`` (default
    :func:`~mok_cute.kernels.sm100.grouped_gemm.interleave_gate_up`, the unfused GEMM1's operand, a
    copy per call; a caller may pass one that caches it while the weights are unchanged).

    MXFP8 (``scales`` given, ``launch.mx``): every weight float8_e4m3fn quantized along its rows (K),
    :class:`MxScales` their E8M0 scales; x is quantized along H here (``quantize.quantize_mxfp8(x, -1)``,
    looked up at call time) and the gather moves its e4m3 rows and scales; GEMM1's epilogue quantizes
    h along I for GEMM2 (:meth:`GroupedGemmSm100._store_swiglu`): bitwise the unfused SM100 MXFP8
    forward (``layers.sm100.mx_forward``: x rows quantized, the MXFP8 GEMM1 + SwiGLU, h quantized, the
    MXFP8 GEMM2 on the same tiles).

    ``launch`` (:class:`Sm100Launch`): ``comm_ctas`` clamped to ``[1, num_ctas - 1]``; ``num_ctas`` the
    grid (default all SMs; ``tile_m`` 256: >= 4, the grid and ``comm_ctas`` rounded to whole pairs);
    ``ring_chunks`` the ring's size in chunks of 128 gathered rows (None: a slot per routed m-tile; a
    slot holds ``tile_m`` rows, so at 256 two chunks, rounded up), R1's band ``min(RING_BAND, ring)``;
    ``trace``: per-task records (:func:`last_trace`); ``gather="tma"`` (BF16, EP = 1, ``tile_m`` 128):
    no ring and no gather, R1 loads x's rows by token with TMA gather4, the comm CTAs run GEMM tasks
    only; ``bulk_push`` (EP > 1 only, ignored at EP = 1): R2's rows go to the peers by
    ``cp.async.bulk`` (:func:`push_routed_bulk`, compile-verified only).

    Returns :class:`~mok_cute.kernels.operands.FusedForwardOut` (gu [M_cap, 2I], h, gus [T, 2 I_s], hs
    bf16 as the unfused path saves them; shared outputs None without a shared expert; ``counters``:
    gather_ready, h_ready, sh_ready, done + ticket + gather and slot-sum arrivals, status, int32
    device tensors; read status with :func:`mok_cute.kernels.sm90.fused_moe.watch_status`: the same
    wait channels; ``w_rows`` None at EP = 1).

    EP > 1 with ``ws`` (this rank's :class:`~mok_cute.comm.workspace.CommWorkspace`; no gate):
    ``plan.order`` / ``plan.offsets`` are the device plan's ``recv_src`` (packed ``p*T*k + t*k + j``)
    and local expert offsets; x (MXFP8: its e4m3 rows and scale words) and topk_w are staged in the
    workspace (after every peer finished the previous pull), ``slot_out`` is the slot sum's copy of
    this rank's slot rows (rows of -1 slots unwritten), ``w_rows`` [M_cap] fp32 each grouped row's
    router weight, status = ``ws.status`` (peer errors: the caller's ``ws.check_status()``);
    ``num_ctas`` this rank's grid (fewer for virtual ranks on one GPU). Launched through the DSL (the
    epochs change every call).

    ``biases`` (BF16 only): None, or the routed experts' (b_gate [E, I], b_up [E, I], b_down [E, H]) bf16 with unit
    last strides, row strides multiples of 8 and 16-byte aligned starts (:func:`~mok_cute.kernels.sm100.bias.
    check_bias`), added to GEMM1's g, u (before the SwiGLU) and GEMM2's rows before their rounding (the
    reference's numerics; the ``biased`` variant, compile-verified only)."""
    _check_operands(x, plan, weights, shared, limit, launch, scales)
    _check_biases(biases, x, weights, scales)
    if ws is not None and shared is not None and shared.gate is not None:
        raise ValueError("gate (the shared expert's output gate) runs at EP = 1 only")
    if launch.gather == "tma" and (scales is not None or ws is not None or launch.tile_m != 128):
        raise ValueError("gather='tma' (R1's rows by TMA gather4 from x) is the BF16 EP = 1 forward's, tile_m 128")
    dev, arch = device_arch(x.device)
    if arch not in ARCHS:
        raise ValueError(f"the SM100 fused forward needs an sm_100a / sm_103a device, got {arch}")
    clamp, gated, _ = swiglu_args(limit)
    v = FwdVariant(clamp, shared is not None, gate=shared is not None and shared.gate is not None,
                   mx=scales is not None, ep=ws is not None, trace=launch.trace, gather=launch.gather,
                   tile_m=launch.tile_m, bulk_push=launch.bulk_push and ws is not None, unroll=GATHER_UNROLL,
                   sum_batch=SUM_BATCH, gated=gated, biased=biases is not None)
    launcher = compile_cached(("sm100_fused_moe_fwd", arch, v),
                              lambda: GraphLauncher(compile_fused_forward_sm100(v, arch)[0]))
    bundles, out = _forward_bundles(x, plan, weights, shared, limit, launch, scales, ws, interleave, v, dev)
    launch_bundles(launcher, dev, bundles + (None if biases is None else ExpertBias(*biases),),
                   direct=ws is not None)
    return out


def _check_biases(biases, x, weights: ExpertWeights, scales) -> None:
    """ValueError for expert biases :func:`fused_forward` cannot take: not a triple (b_gate, b_up, b_down), with
    MXFP8 weights, or one failing :func:`~mok_cute.kernels.sm100.bias.check_bias` ([E, I], [E, I], [E, H])."""
    if biases is None:
        return
    if not isinstance(biases, (tuple, list)) or len(biases) != 3:
        raise ValueError("biases must be None or (b_gate [E, I], b_up [E, I], b_down [E, H])")
    if scales is not None:
        raise ValueError("biases (expert biases) run with the BF16 fused forward only, not MXFP8")
    e, inter, hid = weights[0].shape[0], weights[0].shape[1], x.shape[1]
    for name, b, shape in zip(("b_gate", "b_up", "b_down"), biases, ((e, inter), (e, inter), (e, hid))):
        check_bias(name, b, shape, x.device)


def _forward_bundles(x, plan, weights, shared, limit, launch, scales, ws, interleave, v: FwdVariant, dev: int):
    """``(bundles, FusedForwardOut)``: :class:`FusedMoeFwdSm100`'s launch bundles (in ``__call__``
    order) for validated operands, and what :func:`fused_forward` returns (its buffers, allocated
    here)."""
    tile_m, mx, tma_gather = v.tile_m, v.mx, v.gather == "tma"
    order, offsets, topk_idx, topk_w = plan
    w_gate, w_up, w_down = weights
    t, hid = x.shape
    k = topk_idx.shape[1]
    mcap, e, inter = order.shape[0], w_gate.shape[0], w_gate.shape[1]
    bf = dict(dtype=torch.bfloat16, device=x.device)
    half = CONFIG.tile_n // 2
    sizes = counter_sizes(t, mcap, e)  # 128-row m-tiles: enough for 256-row ones
    mtiles = -(-mcap // tile_m) + e  # routed m-tiles at most
    ring_chunks = launch.ring_chunks
    ring = mtiles if ring_chunks is None else min(-(-int(ring_chunks) * CHUNK // tile_m), mtiles)
    band = min(RING_BAND if launch.band is None else launch.band, ring)
    xg = torch.empty(((1 if tma_gather else ring) * tile_m, hid), dtype=_FP8 if mx else torch.bfloat16,
                     device=x.device)  # tma_gather: a slot's stand-in (R1 reads x)
    tok = None
    if tma_gather:  # each grouped row's token, then a tile of padding (an R1 tile's indices past M_cap)
        tok = torch.zeros(mcap + CHUNK, dtype=torch.int32, device=x.device)
        tok[:mcap] = order // k
    w1 = interleave(w_gate, w_up, half)
    gu, h, slot, y, parts = routed_outputs(t, k, hid, mcap, inter, sizes, ws, x.device)
    s1 = sd = gus = hs = s_out = None
    n1s = 0
    if shared is not None:
        inter_s = shared.w_gate.shape[0]
        n1s = -(-inter_s // half)
        s1, sd = interleave(shared.w_gate[None], shared.w_up[None], half), shared.w_down[None]
        gus = torch.empty((t, 2, inter_s), **bf)
        hs = torch.empty((t, inter_s), **bf)
        s_out = torch.empty((t, hid), **bf)
    mx_tensors = FwdMx()
    if mx:
        x, mx_tensors = _mx_operands(x, mcap, e, inter, ring * tile_m, scales, interleave)
    w_rows = slot_copy = None
    if ws is not None:
        _stage_source(ws, x, mx_tensors.x_words)
        ws.view("w", torch.float32, (t, k)).copy_(topk_w)
        w_rows = torch.zeros(mcap, dtype=torch.float32, device=x.device)
        slot_copy = torch.empty((t * k, hid), **bf)
    num_ctas = sm_count(dev) if launch.num_ctas is None else launch.num_ctas
    # chunk c is CTA c % comm_ctas's, and a gather waiting for its ring slot needs a GEMM CTA to free it
    comm_ctas = max(1, min(launch.comm_ctas, num_ctas - 1))
    num_ctas, comm_ctas = pair_grid(num_ctas, comm_ctas, tile_m)
    records = None
    if v.trace:  # gather chunks, then every possible task, then two per CTA
        n2, n1, m_sh, mt = -(-hid // CONFIG.tile_n), -(-inter // half), -(-t // tile_m), mtiles
        n_tasks = m_sh * (n1s + (n2 if shared is not None else 0)) + mt * (n1 + n2)
        records = torch.zeros((sizes[0] + n_tasks + 2 * num_ctas, TRACE_WORDS), dtype=torch.int64, device=x.device)
        _last_trace[:] = [(records, comm_ctas)]
    lim, timeout_ns = swiglu_args(limit)[2], int(launch.timeout_s * 1e9)
    peer = FwdPeer(None, None, None, *_NO_EP) if ws is None else \
        FwdPeer(*ws.kernel_args((w_rows, slot_copy), EP_SECTIONS))
    bundles = (FwdOperands(x, xg, w1, w_down, s1, sd), FwdOutputs(gu, h, gus, hs, slot, s_out, y),
               FwdRouting(order, offsets, topk_idx.reshape(-1), topk_w.reshape(-1),
                          None if shared is None else shared.gate, tok),
               FwdCounters(*parts, None if records is None else records.view(-1)), mx_tensors,
               FwdScalars(Int32(k), Float32(lim), Int32(comm_ctas), Int32(num_ctas), Int32(ring), Int32(band),
                          Int64(timeout_ns)), peer)
    out = FusedForwardOut(y, gu.view(mcap, 2 * inter), h, slot if ws is None else slot_copy,
                          None if gus is None else gus.view(t, -1), hs, s_out, parts, w_rows)
    return bundles, out


def pair_grid(num_ctas: int, comm_ctas: int, tile_m: int) -> tuple[int, int]:
    """Both megakernels' grid and comm CTAs (comm_ctas already in ``[1, num_ctas - 1]``); with 256-row
    tiles rounded to whole CTA pairs (a pair's two CTAs both gather or both start on GEMM tasks, and a
    GEMM pair remains); ValueError for fewer than two pairs."""
    if tile_m != 256:
        return num_ctas, comm_ctas
    if num_ctas < 4:
        raise ValueError(f"num_ctas must be >= 4 (two CTA pairs) with tile_m 256, got {num_ctas}")
    num_ctas -= num_ctas % 2
    return num_ctas, min(comm_ctas + comm_ctas % 2, num_ctas - 2)


def _stage_source(ws, x, x_words):
    """x's rows into the workspace's pull source (a device wait first: every peer finished the
    previous pull from it): bf16 [T, H], or MXFP8 (``x`` e4m3, ``x_words`` its scale words [T, W]
    int32) rows of ``mxfp8_row_bytes(H)``: H e4m3 bytes, then the 4W scale bytes (zero-padded to
    whole scale atoms, as the gather copies them)."""
    if x_words is None:
        src = ws.acquire_src()
        if src.data_ptr() != x.data_ptr():
            src.copy_(x)
        return
    from mok_cute.comm.workspace import mxfp8_row_bytes

    hid = x.shape[1]
    src = ws.acquire_src(mxfp8_row_bytes(hid))
    src[:, :hid].copy_(x.view(torch.uint8))
    src[:, hid:hid + 4 * x_words.shape[1]].copy_(x_words.view(torch.uint8))


def _mx_operands(x, mcap: int, e: int, inter: int, ring_rows: int, scales: MxScales, interleave):
    """``(xq, FwdMx)`` of the MXFP8 variant: x's e4m3 rows (the gather's source and S1's A) and
    the kernel's eleven MXFP8 tensors (:class:`FwdMx` order): x's scale words [T, ceil(H / 128)]
    int32 (each row's E8M0 bytes zero-padded to whole scale atoms), the ring's blocked scales,
    GEMM1's interleaved weight scales (blocked per expert), hq [M_cap, I] e4m3 and its grouped
    blocked scales (zeroed: padding stays 0), w_down's blocked scales, then with a shared expert
    x's blocked scales, s1's, hsq [T, I_s] and its blocked scales (zeroed), s_down's (else None).
    The scale layouts are the unfused MXFP8 GEMMs' (:mod:`~mok_cute.kernels.sm100.layouts`)."""
    from mok_cute.kernels.quant import quantize

    w_scales, shared_scales = scales
    t, hid = x.shape
    dev, u8 = x.device, torch.uint8
    half = MX_CONFIG.tile_n // 2
    xq, xs = quantize.quantize_mxfp8(x, -1)
    words = -(-hid // (lay.SF_ATOM_KBLOCKS * lay.SF_VEC))
    xs_w = torch.zeros((t, lay.SF_ATOM_KBLOCKS * words), dtype=u8, device=dev)
    xs_w[:, :hid // lay.SF_VEC] = xs
    out = [xs_w.view(torch.int32), torch.empty(lay.sf_bytes(ring_rows, hid // lay.SF_VEC), dtype=u8, device=dev),
           lay.to_blocked(interleave(w_scales[0], w_scales[1], half)).reshape(-1),
           torch.empty((mcap, inter), dtype=_FP8, device=dev),
           torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(mcap, e), inter // lay.SF_VEC), dtype=u8, device=dev),
           lay.to_blocked(w_scales[2]).reshape(-1)]
    if shared_scales is None:
        return xq, FwdMx(*out)
    inter_s = shared_scales[0].shape[0]
    s1_sf = lay.to_blocked(interleave(shared_scales[0][None], shared_scales[1][None], half)).reshape(-1)
    out += [lay.to_blocked(xs), s1_sf, torch.empty((t, inter_s), dtype=_FP8, device=dev),
            torch.zeros(lay.sf_bytes(t, inter_s // lay.SF_VEC), dtype=u8, device=dev),
            lay.to_blocked(shared_scales[2][None]).reshape(-1)]
    return xq, FwdMx(*out)


# ---------------------------------------------------------------- variant registry (readiness tool)
_PTX = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
        "mbarrier", "atom.global.add.u32", "atom.global.release.add.u32", "ld.acquire", "%globaltimer",
        "fence.proxy.async.global", "add.rn.f32")
_MX_PTX = tuple(p for p in _PTX if p != "kind::f16") + (
    "kind::mxf8f6f4", "block_scale", "tcgen05.cp", "cvt.rn.satfinite.e4m3x2.f32", "max.u16x2")
_EP_PTX = ("st.release.sys", "ld.acquire.sys", "fence.acq_rel.sys")  # the EP > 1 signals and fences
_PAIR_PTX = ("cta_group::2", "st.async", "mapa", "barrier.cluster")  # cta_group::2 tiles, the pair's task ring
_BULK_PTX = ("fence.proxy.async.shared::cta", "cp.async.bulk.global.shared::cta.bulk_group",
             "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read", "cp.async.bulk.wait_group")  # bulk_push


def variants() -> dict:
    """``name -> (compile(arch, inspect) -> (compiled, report), PTX substrings it must hold)`` for
    every fused-forward variant this module builds."""
    def fused(clamp, shared, **kw):
        return lambda arch, inspect=True: compile_fused_forward_sm100(FwdVariant(clamp, shared, **kw), arch, inspect)

    return {
        "fused-fwd-clamp-shared": (fused(True, True), _PTX),
        "fused-fwd-noclamp-shared": (fused(False, True), _PTX),
        "fused-fwd-clamp-routed": (fused(True, False), _PTX),
        "fused-fwd-noclamp-routed": (fused(False, False), _PTX),
        "fused-fwd-clamp-shared-gate": (fused(True, True, gate=True), _PTX),
        "fused-fwd-clamp-shared-trace": (fused(True, True, trace=True), _PTX),
        "fused-fwd-mxfp8-clamp-shared": (fused(True, True, mx=True), _MX_PTX),
        "fused-fwd-mxfp8-noclamp-routed": (fused(False, False, mx=True), _MX_PTX),
        "fused-fwd-ep-clamp-shared": (fused(True, True, ep=True), _PTX + _EP_PTX),
        "fused-fwd-ep-noclamp-routed": (fused(False, False, ep=True), _PTX + _EP_PTX),
        "fused-fwd-mxfp8-ep-clamp-shared": (fused(True, True, mx=True, ep=True), _MX_PTX + _EP_PTX),
        "fused-fwd-tma-gather-clamp-shared": (fused(True, True, gather="tma"), _PTX + ("tile::gather4",)),
        "fused-fwd-2cta-clamp-shared": (fused(True, True, tile_m=256), _PTX + _PAIR_PTX),
        "fused-fwd-2cta-noclamp-routed-trace": (fused(False, False, tile_m=256, trace=True), _PTX + _PAIR_PTX),
        "fused-fwd-mxfp8-2cta-clamp-shared": (fused(True, True, mx=True, tile_m=256), _MX_PTX + _PAIR_PTX),
        "fused-fwd-ep-2cta-noclamp-routed": (fused(False, False, ep=True, tile_m=256), _PTX + _EP_PTX + _PAIR_PTX),
        "fused-fwd-mxfp8-ep-2cta-clamp-shared": (fused(True, True, mx=True, ep=True, tile_m=256),
                                                 _MX_PTX + _EP_PTX + _PAIR_PTX),
        "fused-fwd-ep-bulk-push-noclamp-routed": (fused(False, False, ep=True, bulk_push=True),
                                                  _PTX + _EP_PTX + _BULK_PTX),
        "fused-fwd-mxfp8-ep-bulk-push-clamp-shared": (fused(True, True, mx=True, ep=True, bulk_push=True),
                                                      _MX_PTX + _EP_PTX + _BULK_PTX),
        "fused-fwd-ep-2cta-bulk-push-noclamp-routed": (fused(False, False, ep=True, tile_m=256, bulk_push=True),
                                                       _PTX + _EP_PTX + _PAIR_PTX + _BULK_PTX),
        "fused-fwd-mxfp8-ep-2cta-bulk-push-clamp-shared": (
            fused(True, True, mx=True, ep=True, tile_m=256, bulk_push=True), _MX_PTX + _EP_PTX + _PAIR_PTX + _BULK_PTX),
        "fused-fwd-biased-gpt-oss-shared": (fused(True, True, gated=GPT_OSS, biased=True), _PTX + BIAS_PTX),
        "fused-fwd-2cta-biased-gpt-oss-routed": (fused(True, False, gated=GPT_OSS, tile_m=256, biased=True),
                                                 _PTX + _PAIR_PTX + BIAS_PTX),
    }

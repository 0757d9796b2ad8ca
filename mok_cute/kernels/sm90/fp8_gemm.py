"""Hopper (sm_90a) FP8 grouped expert GEMM on the shared mainloop: FP8 blockwise
(precision "fp8_block", DeepSeek-V3 recipe) with per-128-K promotion into an FP32 accumulator.

Operands (both K-major, as FP8 ``wgmma.mma_async ... .e4m3.e4m3`` requires):
  A   data [M_total, K] float8_e4m3fn, tokens grouped by expert (offsets int32 [E+1] on the
      device, trusted); scales fp32 stored [K/128, M_total] (MN-major: the 128 row scales of
      one k-block are contiguous), i.e. ``quantize_fp8.quantize_fp8_block_act``'s output.
  B   data [E, N, K] float8_e4m3fn; scales fp32 [E, N/128, K/128] (128x128 blocks,
      ``reference.fp8_block_quantize_weight`` per expert).
  out [M_total, N] bf16: rows of expert e = bf16(sum_kb sa[m, kb] sb[e, n/128, kb] P_kb[m, n]),
      P_kb the e4m3 partial product over k-block kb.
The same kernel also runs the expert-MLP variants (:class:`Fp8BlockGroupedGemm` epilogues
``swiglu``: GEMM1 with gate and up halves of one B tile, each half promoted with its own
block scale; ``dswiglu``: dgrad of GEMM2 with the dSwiGLU epilogue, its g, u inputs
prefetched before the mainloop); their wrappers are in :mod:`mok_cute.kernels.sm90.fp8_expert`.

Mainloop: the producer is ``Sm90Mainloop.load_tile`` unchanged (TMA of A and B k-tiles;
tile_k = 128 e4m3 = 128 bytes = one swizzle atom = one scale block). The serial consumer
(``Fp8MainloopConfig(overlap_promotion=False)``) is this
module's :meth:`Fp8BlockGroupedGemm.mma_tile_promoted` (the "2xacc" pattern): per k-tile the
4 wgmma k-blocks (k = 32 each) accumulate into a temporary FP32 fragment (the first
overwrites it), the thread loads its 2 row scales and the tile's block scale while they
run, waits, frees the ring slot, and promotes ``acc = fma(tmp, sa[row] * sb, acc)`` (one
FMA per accumulator element per 128 K, one multiply per row). Hopper's FP8 wgmma adds
with reduced internal precision, which is why partial sums are promoted every 128 K.
Two FP32 fragments live per thread, so tile_n <= 128 (2 x 64 registers at tile_n = 128).

Default (``Fp8MainloopConfig.overlap_promotion`` True, part of the compile key; verified
on an H200: bitwise equal to the serial consumer, 7% faster):
:meth:`Fp8BlockGroupedGemm.mma_tile_overlapped` keeps the tensor cores
busy across promotion with two temporaries: k-tile j's batch is issued before waiting for
batch j-1 (``wait_group(1)``), which is then released and promoted while batch j runs;
the scales of k-tile j are loaded right after its batch is issued and used one batch later.
Same arithmetic in the same order, so its output is bitwise the serial consumer's. Three FP32
fragments (192 registers) need the 24 / 240 producer / consumer register split (0 spills).

MXFP8 on SM90 (not built; the arithmetic for the choice). Promotion per 32 K costs per
accumulator element one FMA plus a per-element scale (the column scale 2^eb varies along N,
the row scale 2^ea along M: ~2 CUDA-core ops) for every 64 tensor-core FLOP (one k = 32
block). H200: ~1979 TFLOP/s dense FP8 vs ~67 TFLOP/s FP32 FMA, i.e. the promotion alone
takes ~2 * 1979 / 64 / 67 ~ 0.9x the wgmma time, plus a wgmma wait every 32 K (4x as many
as here): expect <= ~50% of FP8 peak. Dequantizing MXFP8 tiles to BF16 in shared memory
(a dequant warpgroup: ~1 op per operand element per k-tile, (128 + 128) x 128 per
128x128x128 tile = 1/256 of the MMA FLOPs) then BF16 wgmma is bounded by BF16 peak (~50%
of FP8) with no promotion waits. e4m3 x 2^e is exact in bf16 unless the product leaves
bf16's normal range (|value| > bf16 max needs e > 127 - 8; results below 2^-133 lose bits):
scale bytes near the extremes, detectable per block by the dequant warpgroup (flag and
round, or scale the block into range and fold the factor into the epilogue). Both are
near 50% of FP8 peak on paper; dequant is simpler (reuses the BF16 mainloop unchanged) and
overlaps better, so build it first and measure both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import _check_devices, _check_out, _check_tensor, current_stream, offsets_i32, sm_count
from mok_cute.dsl.launch import _Desc
from mok_cute.kernels.sm90.grouped_gemm import (
    EPILOGUES, DSwigluEpilogue, PlainEpilogue, SwigluEpilogue, _fetch_rows, _load_rows, _row_copy, _store_rows,
)
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, NUM_CONSUMER_WG, PRODUCER_REGS, NUM_THREADS, THREADS_PER_WG, GroupWalk, MainloopConfig,
    Sm90Mainloop, TmaLoads, consumer_barrier, experts_last,
)
from mok_cute.kernels.swiglu_math import Gated, dswiglu, swiglu_args
from mok_cute.schedule.group_tiles import grouped_start, seek, tile_coords

SCALE_BLOCK = 128
# overlapped promotion (the default): 3 FP32 fragments per consumer thread (192 registers) do not
# fit the shared mainloop's 232 without spills; the TMA producer warpgroup needs few
# registers, so this kernel splits 24 / 240 (128 * 24 + 256 * 240 = 64512 <= 65536)
OVERLAP_PRODUCER_REGS = 24
OVERLAP_CONSUMER_REGS = 240


@dataclass(frozen=True)
class Fp8MainloopConfig(MainloopConfig):
    """:class:`MainloopConfig` for e4m3 operands: tile_k = 128 (one scale block), tile_n 64
    or 128 (two FP32 fragments per thread; 128 matches the 128-wide B scale block)."""

    tile_n: int = 128
    tile_k: int = 128
    ab_dtype: type = cutlass.Float8E4M3FN
    #: overlapped promotion (default; bitwise equal to the serial consumer and 7% faster on
    #: an H200), see :meth:`Fp8BlockGroupedGemm.mma_tile_overlapped`; False: the serial
    #: :meth:`Fp8BlockGroupedGemm.mma_tile_promoted` (part of the compile key)
    overlap_promotion: bool = True

    def validate(self) -> None:
        if self.tile_m != 128:
            raise ValueError(f"tile_m must be 128, got {self.tile_m}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128 for the promoted FP8 GEMM, got {self.tile_n}")
        if self.tile_k != SCALE_BLOCK:
            raise ValueError(f"tile_k must be {SCALE_BLOCK} (one scale block), got {self.tile_k}")
        if tuple(self.cluster_mn) != (1, 1):
            raise ValueError(f"cluster_mn {self.cluster_mn} not implemented, only (1, 1)")
        if self.ab_dtype is not cutlass.Float8E4M3FN:
            raise ValueError(f"ab_dtype must be Float8E4M3FN, got {self.ab_dtype}")

    def key(self) -> tuple:
        return super().key() + (("overlap_promotion",) if self.overlap_promotion else ())


class Fp8Scales(NamedTuple):
    """The block scales of :class:`Fp8BlockGroupedGemm`'s kernel (parameters in this order): ``sa`` fp32
    [K/128, M] (A's row scales, MN-major), ``sb`` fp32 [E, N/128, K/128] (B's 128x128 block scales) and ``sb2``
    (swiglu: w_up's, like ``sb``; None otherwise)."""

    sa: cute.Tensor
    sb: cute.Tensor
    sb2: cute.Tensor = None


class TileScales(NamedTuple):
    """A consumer thread's promotion scales of one tile (:meth:`Fp8BlockGroupedGemm.mma_tile_promoted`):
    ``elem_scales`` (compile time: accumulator element i's (row index, B scale index), see
    :meth:`Fp8BlockGroupedGemm._promote`), ``sa`` (A's scales [K/128, M]), ``sbs`` (the tile's B block scales
    along K: one 1-D view, or gate and up) and ``rows_a`` (the thread's distinct global A rows, clamped into
    [0, M))."""

    elem_scales: list
    sa: cute.Tensor
    sbs: list
    rows_a: list


class _Batch(NamedTuple):
    """One overlapped wgmma batch's FP32 temporary ``tmp`` and its k-tile's scale registers ``sc``."""

    tmp: cute.Tensor
    sc: cute.Tensor


class Fp8Operand(NamedTuple):
    """An fp8_block GEMM operand at a launch (torch tensors): e4m3 ``data`` and fp32 ``scales`` (A: [M, K] and
    [M, K/128]; B: [E, N, K] and [E, N/128, K/128])."""

    data: torch.Tensor
    scales: torch.Tensor


class DSwigluPrefetchedEpilogue(DSwigluEpilogue):
    """:class:`DSwigluEpilogue` with both column halves' g and u fetched (cp.async) before the
    mainloop into four row-padded buffers, so no global-load round trip sits inside the
    epilogue (the FP8 mainloop is short enough per tile for it to show). Same math, same
    stores."""

    def smem_elems(self) -> int:
        return 4 * self.tile_m * self.pitch

    def smem_tensor(self, region):
        """(tile_m, half, 2, 2): (g, u) buffers of column half 0, then of half 1."""
        plane = self.tile_m * self.pitch
        return region.get_tensor(cute.make_layout((self.tile_m, self.half, 2, 2),
                                                  stride=(self.pitch, 1, plane, 2 * plane)))

    def _bufs(self, sC: cute.Tensor, h: int = 0):
        return sC[(None, None, 0, h)], sC[(None, None, 1, h)]  # g, u of column half h

    @cute.jit
    def prefetch(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mGU: cute.Tensor):
        """Before the mainloop: fetch g and u of both column halves (one cp.async group)."""
        for h in cutlass.range_constexpr(2):
            bufs = self._bufs(sC, h)
            for j in cutlass.range_constexpr(2):  # 0: gate half of gu, 1: up half
                src = cute.domain_offset((row0, 0), mGU[(None, j, None)])
                _fetch_rows(self.half, tid, cute.local_tile(src, (self.tile_m, self.half), (0, 2 * n_tile + h)),
                            bufs[j], rows)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def run(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32,
            row0: Int32, rows: Int32, n_tile: Int32, mDGU: cute.Tensor, mGU: cute.Tensor, limit: Float32):
        shape = (self.tile_m, self.half)
        # a (tile_m, tile_n) view whose column c lands on buffer column c % half
        alias = cute.make_layout((self.tile_m, (self.half, 2)), stride=(self.pitch, (1, 0)))
        cols = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        copy = _row_copy(self.half)
        cute.arch.cp_async_wait_group(0)
        consumer_barrier()
        for h in cutlass.range_constexpr(2):
            bufs = self._bufs(sC, h)
            tG = thr_mma.partition_C(cute.make_tensor(bufs[0].iterator, alias))
            tU = thr_mma.partition_C(cute.make_tensor(bufs[1].iterator, alias))
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cutlass.const_expr(i % 16 == 0):
                    cute.arch.sync_warp()  # scheduling fence (see DSwigluEpilogue.run)
                if cutlass.const_expr(cols[i][1] // self.half == h):
                    dg, du = dswiglu(acc[i], tG[i].to(Float32), tU[i].to(Float32), limit, self.clamp, self.gated)
                    tG[i] = dg.to(cutlass.BFloat16)
                    tU[i] = du.to(cutlass.BFloat16)
        consumer_barrier()
        for h in cutlass.range_constexpr(2):
            bufs = self._bufs(sC, h)
            for j in cutlass.range_constexpr(2):
                r, coords = _load_rows(copy, tid, bufs[j])
                dst = cute.domain_offset((row0, 0), mDGU[(None, j, None)])
                _store_rows(copy, tid, r, coords, cute.local_tile(dst, shape, (0, 2 * n_tile + h)), rows)
        consumer_barrier()


class Fp8BlockGroupedGemm:
    """Persistent warp-specialized grouped FP8 GEMM with per-k-tile scale promotion.

    Call (jit): ``(mA [M, K] e4m3, mSA [K/128, M] f32, mB, mSB, mB2, mSB2, mOffsets [E+1]
    int32, mOut0, mOut1, limit, num_ctas, stream)``. Epilogues (``epilogue``):

    * ``plain``: mB [E, N, K] e4m3, mSB [E, N/128, K/128]; mB2 = mSB2 = None;
      mOut0 = mOut1 = out [M, N] bf16; N a multiple of tile_n.
    * ``swiglu``: mB = w_gate, mB2 = w_up [E, I, K] e4m3 with scales mSB, mSB2
      [E, I/128, K/128]; each B tile is tile_n/2 gate rows stacked on the matching up rows
      (two TMA loads per k-tile); accumulator elements of the gate half are promoted with
      the gate block scale, those of the up half with the up one (which half is a
      compile-time fact of the element's index); mOut0 = gu [M, 2, I], mOut1 = h [M, I]
      (:class:`SwigluEpilogue`, clamp ``limit`` when built with ``clamp``; ``gated``: the SwiGLU's alpha / up
      offset, compile-time constants, :mod:`~mok_cute.kernels.swiglu_math`).
    * ``dswiglu``: as ``plain`` with N = I; mOut0 = dgu [M, 2, I] (out), mOut1 = gu
      [M, 2, I] (in); :class:`DSwigluPrefetchedEpilogue` on the FP32 accumulator (g, u of
      the tile fetched before the mainloop: 73.7 KB of shared memory, 4 ring stages).
    """

    def __init__(self, cfg: Fp8MainloopConfig, epilogue: str = "plain", clamp: bool = False,
                 gated: Gated | None = None):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        self.cfg, self.epilogue = cfg, epilogue
        self.stack_n = epilogue == "swiglu"
        if epilogue == "plain":
            self.epi = PlainEpilogue(cfg.tile_m, cfg.tile_n)
        elif epilogue == "swiglu":
            self.epi = SwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp, gated=gated)
        else:
            self.epi = DSwigluPrefetchedEpilogue(cfg.tile_m, cfg.tile_n, clamp, gated=gated)
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=self.epi.smem_elems() * 2)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mSA: cute.Tensor, mB: cute.Tensor, mSB: cute.Tensor, mB2: cute.Tensor,
                 mSB2: cute.Tensor, mOffsets: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor, limit: Float32,
                 num_ctas: Int32, stream: cuda.CUstream):
        ml = self.mainloop
        ml.setup()
        atom_a, coord_a, atom_b, coord_b = ml.make_tma(mA, experts_last(mB), b_half=self.stack_n)
        atom_b2, coord_b2 = None, None
        if cutlass.const_expr(self.stack_n):
            _, _, atom_b2, coord_b2 = ml.make_tma(mA, experts_last(mB2), b_half=True)
        self.shared_storage = ml.shared_storage(self.epi.smem_elems())
        self.kernel(TmaLoads(atom_a, coord_a, atom_b, coord_b, atom_b2, coord_b2), Fp8Scales(mSA, mSB, mSB2),
                    mOffsets, mOut0, mOut1, limit).launch(grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1],
                                                          cluster=[1, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------ promotion helpers (shared by both consumers)
    def _mma(self):
        """A private tiled MMA: its ACCUMULATE field is toggled inside a dynamic k loop, so it
        must not be the mainloop's (whose fragments the epilogue partitions after it) and
        must not leave the enclosing loop body."""
        ml = self.mainloop
        return sm90.make_trivial_tiled_mma(
            self.cfg.ab_dtype, self.cfg.ab_dtype, ml.a_layout.sm90_mma_major_mode(),
            ml.b_layout.sm90_mma_major_mode(), self.cfg.acc_dtype, (NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, self.cfg.tile_n))

    def _issue(self, pipe, state, tCrA, tCrB, tmp):
        """Wait for ring slot ``state`` and issue its 4 wgmma k-blocks into ``tmp`` (the first
        overwrites it); one commit group."""
        mma = self._mma()
        pipe.consumer_wait(state)
        warpgroup.fence()  # orders the promotion's earlier reads of tmp before the wgmma writes
        for kb in range(cute.size(tCrA, mode=[2])):
            mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(mma, tmp, tCrA[(None, None, kb, state.index)], tCrB[(None, None, kb, state.index)], tmp)
        warpgroup.commit_group()

    def _load_scales(self, sc, mSA, sbs, rows_a, kt, n_rows=None):
        """sc[i] = sa[rows_a[i], kt], then sc[n_rows + j] = sbs[j][kt] (``n_rows`` defaults to
        ``len(rows_a)``; pass it with ``rows_a = []`` to load only the B scales)."""
        n_rows = len(rows_a) if n_rows is None else n_rows
        for i, r in enumerate(rows_a):
            sc[i] = mSA[kt, r]
        for j, sb in enumerate(sbs):
            sc[n_rows + j] = sb[kt]

    def _promote(self, acc, tmp, sc, elem_scales, n_rows):
        """acc = fma(tmp, sa[row] * sb[half], acc); ``elem_scales[i]`` = (row index, B scale
        index) of accumulator element i (compile time); one multiply per distinct pair."""
        pairs = sorted(set(elem_scales))
        s = {p: sc[p[0]] * sc[n_rows + p[1]] for p in pairs}
        for i in range(cute.size(acc)):
            acc[i] = tmp[i] * s[elem_scales[i]] + acc[i]  # contracted to one FMA

    @cute.jit
    def mma_tile_promoted(self, pipe, state, tCrA: cute.Tensor, tCrB: cute.Tensor, acc: cute.Tensor,
                          tmp: cute.Tensor, k_tiles: Int32, scales: TileScales):
        """acc = sum over k-tiles of (A_kt @ B_kt^T) * sa[row, kt] * sb[kt]
        (``Fp8MainloopConfig(overlap_promotion=False)``: one wgmma batch, wait, promote).

        ``scales`` (:class:`TileScales`): ``rows_a``, this thread's distinct global A rows (clamped into
        [0, M)); ``sbs``, the tile's B block scales along K (one 1-D view, or gate and up: ``mSB[expert,
        n_blk, None]``); ``elem_scales``: see :meth:`_promote`.
        """
        elem_scales, mSA, sbs, rows_a = scales
        k_blocks = cute.size(tCrA, mode=[2])
        n_rows = len(rows_a)
        sc = cute.make_rmem_tensor((n_rows + len(sbs),), Float32)
        acc.fill(0.0)
        for kt in cutlass.range(k_tiles, unroll=1):
            mma = self._mma()
            pipe.consumer_wait(state)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma, tmp, tCrA[(None, None, kb, state.index)],
                          tCrB[(None, None, kb, state.index)], tmp)
            warpgroup.commit_group()
            self._load_scales(sc, mSA, sbs, rows_a, kt)  # issued while the batch runs
            warpgroup.wait_group(0)
            pipe.consumer_release(state)
            state.advance()
            self._promote(acc, tmp, sc, elem_scales, n_rows)
        return state

    def _step(self, pipe, state, release, tCrA, tCrB, acc, nxt: _Batch, prev: _Batch, kt, scales: TileScales):
        """One overlapped step: issue k-tile ``kt`` into ``nxt.tmp``, wait for the previous
        batch (``wait_group(1)``), release its slot and promote ``prev.tmp`` with ``prev.sc``;
        ``kt``'s scales go to ``nxt.sc`` right after the issue; with gate/up tiles (2 row +
        2 block scales per k-tile) the two block scales are loaded after the promotion
        instead (loading all four early spilled 8 bytes at 240 registers; the loads still
        lead their use by a whole batch). Returns the advanced ``(state, release)`` (rebind them at the call site:
        the DSL tracks loop-carried values only through plain local rebinds)."""
        elem_scales, mSA, sbs, rows_a = scales
        self._issue(pipe, state, tCrA, tCrB, nxt.tmp)
        self._load_scales(nxt.sc, mSA, sbs if not self.stack_n else [], rows_a, kt)
        state.advance()
        warpgroup.wait_group(1)
        pipe.consumer_release(release)
        release.advance()
        self._promote(acc, prev.tmp, prev.sc, elem_scales, len(rows_a))
        if cutlass.const_expr(self.stack_n):
            self._load_scales(nxt.sc, mSA, sbs, [], kt, len(rows_a))
        return state, release

    @cute.jit
    def mma_tile_overlapped(self, pipe, state, tCrA: cute.Tensor, tCrB: cute.Tensor, acc: cute.Tensor,
                            tmp0: cute.Tensor, tmp1: cute.Tensor, k_tiles: Int32, scales: TileScales):
        """Same result as :meth:`mma_tile_promoted` (bitwise: same wgmma, same FMA order), with
        the tensor cores busy during promotion (the default): k-tile j's wgmma batch goes
        into one of two temporaries before the thread waits for batch j-1
        (``wait_group(1)``), then k-tile j-1's slot is released and its temporary promoted
        while batch j runs. The scales of k-tile j are loaded into registers right after
        batch j is issued and used one batch later, so their global-load latency is hidden
        behind a whole wgmma batch.

        Temporaries alternate at compile time: the k loop is unrolled by two, then a dynamic
        ``if`` on the parity of ``k_tiles`` drains one or two batches.
        Registers per thread at 128x128: acc + 2 temporaries = 3 x 64 FP32.
        """
        elem_scales, mSA, sbs, rows_a = scales
        n_rows = len(rows_a)
        n_sc = n_rows + len(sbs)
        sc0 = cute.make_rmem_tensor((n_sc,), Float32)
        sc1 = cute.make_rmem_tensor((n_sc,), Float32)
        acc.fill(0.0)
        release = state.clone()
        # k-tile 0 into tmp0
        self._issue(pipe, state, tCrA, tCrB, tmp0)
        self._load_scales(sc0, mSA, sbs, rows_a, Int32(0))
        state.advance()
        # pairs: k-tile 2p+1 into tmp1 (promote 2p from tmp0), 2p+2 into tmp0 (promote 2p+1)
        for p in cutlass.range((k_tiles - 1) // 2, unroll=1):
            kt = 2 * p + 1
            state, release = self._step(pipe, state, release, tCrA, tCrB, acc, _Batch(tmp1, sc1), _Batch(tmp0, sc0),
                                        kt, scales)
            state, release = self._step(pipe, state, release, tCrA, tCrB, acc, _Batch(tmp0, sc0), _Batch(tmp1, sc1),
                                        kt + 1, scales)
        # tails: tmp0 holds k-tile k_tiles - 2 (even k_tiles) or k_tiles - 1 (odd). Dynamic
        # ifs, not loops of trip count 0/1: LLVM hoisted the loop-invariant tmp0 * s out of
        # such a loop, above its wait_group (a read of in-flight wgmma registers, unfused)
        if (k_tiles - 1) % 2 == 1:  # even k_tiles: the last k-tile into tmp1
            state, release = self._step(pipe, state, release, tCrA, tCrB, acc, _Batch(tmp1, sc1), _Batch(tmp0, sc0),
                                        k_tiles - 1, scales)
            warpgroup.wait_group(0)
            pipe.consumer_release(release)
            self._promote(acc, tmp1, sc1, elem_scales, n_rows)
        else:
            warpgroup.wait_group(0)
            pipe.consumer_release(release)
            self._promote(acc, tmp0, sc0, elem_scales, n_rows)
        return state

    @cute.kernel
    def kernel(self, loads: TmaLoads, scales: Fp8Scales, mOffsets: cute.Tensor, mOut0: cute.Tensor,
               mOut1: cute.Tensor, limit: Float32):
        cfg = self.cfg
        atom_a, coord_a, atom_b, coord_b, atom_b2, coord_b2 = loads
        mSA, mSB, mSB2 = scales
        overlap = cfg.overlap_promotion
        atoms = [atom_a, atom_b]
        if cutlass.const_expr(self.stack_n):
            atoms.append(atom_b2)
        tidx, warp = self.mainloop.start(atoms)
        pipe, sA, sB, sC = self.mainloop.allocate(self.shared_storage, self.epi)

        b_rows = cfg.tile_n // 2 if cutlass.const_expr(self.stack_n) else cfg.tile_n  # B rows per TMA tile
        num_experts, n_tiles, k_tiles, linear, grid, expert, base = grouped_start(
            mOffsets, coord_b.shape[0], b_rows, coord_a.shape[1], cfg.tile_m, cfg.tile_k)
        m_total = coord_a.shape[0]

        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(OVERLAP_PRODUCER_REGS if cutlass.const_expr(overlap)
                                              else PRODUCER_REGS)
            if warp == 0:
                self.mainloop.produce_grouped(pipe, GroupWalk(mOffsets, num_experts, n_tiles, linear, expert, base,
                                                              grid), loads, sA, sB, b_rows, k_tiles, self.stack_n)
        else:
            cute.arch.setmaxregister_increase(OVERLAP_CONSUMER_REGS if cutlass.const_expr(overlap)
                                              else CONSUMER_REGS)
            tid = tidx - THREADS_PER_WG
            thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(sA, sB, tid)
            tmp = cute.make_rmem_tensor_like(acc)
            tmp1 = cute.make_rmem_tensor_like(acc) if cutlass.const_expr(overlap) else None
            # accumulator element i sits in row (this thread's first row) + off[i] and (swiglu)
            # in the gate or up half of the tile, both compile-time (thread 0's coordinates:
            # the C layout is thread part + value part, a thread's columns stay within one
            # 8-column group of thread 0's)
            ident = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
            t0 = self.mainloop.tiled_mma.get_slice(0).partition_C(ident)
            mine = thr_mma.partition_C(ident)
            offs = [t0[i][0] - t0[0][0] for i in range(cute.size(acc))]
            distinct = sorted(set(offs))
            halves = [t0[i][1] // (cfg.tile_n // 2) if self.stack_n else 0 for i in range(cute.size(acc))]
            elem_scales = [(distinct.index(o), hf) for o, hf in zip(offs, halves)]
            mSBs = [mSB, mSB2] if cutlass.const_expr(self.stack_n) else [mSB]
            state = self.mainloop.consumer_state()
            while expert < num_experts:
                _, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                first = row0 + mine[0][0]
                rows_a = [cutlass.min(first + o, m_total - 1) for o in distinct]
                n_blk = (n_tile * b_rows) // SCALE_BLOCK
                sbs = [t[(expert, n_blk, None)] for t in mSBs]
                if cutlass.const_expr(self.epilogue == "dswiglu"):
                    self.epi.prefetch(sC, tid, row0, rows, n_tile, mOut1)
                tile_scales = TileScales(elem_scales, mSA, sbs, rows_a)
                if cutlass.const_expr(overlap):
                    state = self.mma_tile_overlapped(pipe, state, tCrA, tCrB, acc, tmp, tmp1, k_tiles, tile_scales)
                else:
                    state = self.mma_tile_promoted(pipe, state, tCrA, tCrB, acc, tmp, k_tiles, tile_scales)
                self.epi.run(self.mainloop.tiled_mma, thr_mma, acc, sC, tid, row0, rows, n_tile, mOut0, mOut1, limit)
                linear = linear + grid
                expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)


# ---------------------------------------------------------------- compile
def _fake(dtype, shape, align_elems):
    """Fake row-major tensor with symbolic dims and strides (last stride 1)."""
    strides = tuple(cute.sym_int64(divisibility=align_elems) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=strides, assumed_align=16 if align_elems > 1 else 4)


def compile_fp8_block_gemm(cfg: Fp8MainloopConfig = Fp8MainloopConfig(), arch: str = "sm_90a", inspect: bool = False,
                           epilogue: str = "plain", clamp: bool = False, gated: Gated | None = None):
    """Compile one FP8 blockwise grouped GEMM variant (``epilogue`` plain / swiglu / dswiglu, ``clamp`` and
    ``gated`` the (d)SwiGLU's switches, see :class:`Fp8BlockGroupedGemm`) with symbolic M, N, K, E; returns
    ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 FP8 GEMM needs arch sm_90a, got {arch!r}")
    op = Fp8BlockGroupedGemm(cfg, epilogue, clamp, gated)
    f8, bf16 = cutlass.Float8E4M3FN, cutlass.BFloat16
    m, n, e = cute.sym_int(), cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=16)
    kt, nb = cute.sym_int(), cute.sym_int()
    mA = _fake(f8, (m, k), 16)
    mSA = _fake(Float32, (kt, m), 1)
    mB = _fake(f8, (e, n, k), 16)
    mSB = _fake(Float32, (e, nb, kt), 1)
    mB2 = mSB2 = None
    out0 = out1 = _fake(bf16, (m, n), 8)
    if epilogue == "swiglu":  # w_gate, w_up [E, I, K]; gu [M, 2, I], h [M, I]
        mB2, mSB2 = _fake(f8, (e, n, k), 16), _fake(Float32, (e, nb, kt), 1)
        out0 = _fake(bf16, (m, cute.sym_int(), n), 8)
    elif epilogue == "dswiglu":  # dgu, gu [M, 2, I]
        two = cute.sym_int()
        out0, out1 = _fake(bf16, (m, two, n), 8), _fake(bf16, (m, two, n), 8)
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    return compile_kernel(op, mA, mSA, mB, mSB, mB2, mSB2, offs, out0, out1, Float32(0.0), Int32(1),
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


def launch_fp8_block(epilogue: str, cfg: Fp8MainloopConfig, a: Fp8Operand, w: Fp8Operand, w2: Fp8Operand | None,
                     offsets, out0, out1, n: int, act=None):
    """Compile (cached per variant and config) and launch on the current stream; operands
    already validated (:class:`Fp8BlockGroupedGemm`'s ``mB2`` / ``mSB2`` from ``w2``, swiglu's w_up);
    ``act``: the (d)SwiGLU's activation argument (None, a limit L or a SwiGLU:
    :func:`~mok_cute.kernels.swiglu_math.swiglu_args` gives the compile-time clamp and alpha / up offset and the
    runtime limit);
    ``n``: the N extent tiled by ``cfg.tile_n``; ``a.scales`` [M, K/128] (its [K/128, M] transpose is
    read, copied only if not already contiguous)."""
    (a, a_scales), (w, w_scales) = a, w
    dev, arch = device_arch(a.device)
    if arch != "sm_90a":
        raise ValueError(f"a: the SM90 FP8 GEMM needs an sm_90a device, got {arch}")
    clamp, gated, limit = swiglu_args(act)
    compiled = compile_cached(("sm90_fp8_block_gemm", arch, epilogue, clamp, gated, cfg.key()),
                              lambda: compile_fp8_block_gemm(cfg, arch, epilogue=epilogue, clamp=clamp, gated=gated)[0])
    m, e = a.shape[0], w.shape[0]
    sa_t = a_scales.t() if a_scales.t().is_contiguous() else a_scales.t().contiguous()
    tiles_bound = (-(-m // cfg.tile_m) + e) * (n // cfg.tile_n)
    num_ctas = max(1, min(sm_count(dev), tiles_bound))
    offs32 = offsets_i32(offsets)
    compiled(_Desc(a), _Desc(sa_t), _Desc(w), _Desc(w_scales.contiguous()),
             None if w2 is None else _Desc(w2.data), None if w2 is None else _Desc(w2.scales.contiguous()),
             _Desc(offs32), _Desc(out0), _Desc(out1), Float32(limit), Int32(num_ctas),
             current_stream(dev))


# ---------------------------------------------------------------- host wrapper
DEFAULT_FP8_CONFIG = Fp8MainloopConfig()


def grouped_gemm_fp8_block(a, a_scales, offsets, w, w_scales, *, out=None, cfg: Fp8MainloopConfig = DEFAULT_FP8_CONFIG):
    """out [M, N] bf16: rows of expert e = bf16(dequant(a_e) @ dequant(w[e])^T), FP8 blockwise.

    a [M, K] float8_e4m3fn contiguous, K a multiple of 128; a_scales fp32 [M, K/128] (the
    view ``quantize_fp8_block_act`` returns; any other strides are copied to the [K/128, M]
    storage the kernel reads); offsets int32/int64 [E+1] on the device (trusted); w [E, N, K]
    float8_e4m3fn contiguous, N a multiple of ``cfg.tile_n`` and of 128; w_scales fp32
    [E, N/128, K/128]. Bitwise reproducible (fixed k order per tile).
    """
    _check_tensor("a", a, 2, (torch.float8_e4m3fn,))
    _check_tensor("w", w, 3, (torch.float8_e4m3fn,))
    _check_tensor("a_scales", a_scales, 2, (torch.float32,))
    _check_tensor("w_scales", w_scales, 3, (torch.float32,))
    _check_tensor("offsets", offsets, 1, (torch.int32, torch.int64))
    m, k = a.shape
    e, n = w.shape[0], w.shape[1]
    if k % SCALE_BLOCK or k == 0:
        raise ValueError(f"a: K={k} must be a positive multiple of {SCALE_BLOCK}")
    if n % SCALE_BLOCK or n % cfg.tile_n or n == 0:
        raise ValueError(f"w: N={n} must be a positive multiple of {SCALE_BLOCK} and tile_n={cfg.tile_n}")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets must hold E+1 = {e + 1} entries, got {offsets.numel()}")
    if w.shape[2] != k:
        raise ValueError(f"w must be [E, N, K={k}], got {tuple(w.shape)}")
    if tuple(a_scales.shape) != (m, k // SCALE_BLOCK):
        raise ValueError(f"a_scales must be [M, K/128] = {(m, k // SCALE_BLOCK)}, got {tuple(a_scales.shape)}")
    if tuple(w_scales.shape) != (e, n // SCALE_BLOCK, k // SCALE_BLOCK):
        raise ValueError(f"w_scales must be [E, N/128, K/128] = {(e, n // SCALE_BLOCK, k // SCALE_BLOCK)}, "
                         f"got {tuple(w_scales.shape)}")
    for name, t in (("a", a), ("w", w)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous (K contiguous) and 16-byte aligned")
    out = _check_out("out", out, (m, n), a.device)
    _check_devices(a=a, a_scales=a_scales, offsets=offsets, w=w, w_scales=w_scales, out=out)
    if m == 0:
        return out
    launch_fp8_block("plain", cfg, Fp8Operand(a, a_scales), Fp8Operand(w, w_scales), None, offsets, out, out, n)
    return out

"""Hopper (sm_90a) persistent grouped expert GEMMs: variable rows per expert, no host sync.

Operands (BF16):
  A   [M_total, K]  K-major, tokens grouped by expert; expert e owns rows offsets[e]..offsets[e+1]
  B   per-expert weights, either ``b_major="k"``: [E, N, K] (tile = A_e @ B_e^T) or
      ``b_major="mn"``: [E, K, N] (tile = A_e @ B_e, read N-contiguous, no transpose copy);
      optionally split along K into two tensors B1 (first K1 of K) and B2 (the rest), each
      with its own TMA descriptor (K1 a multiple of tile_k).
  offsets int32 [E+1] on the device, offsets[0] = 0, non-decreasing, offsets[E] = M_total
    (trusted, not checked: checking needs a host sync).
One compiled kernel serves every token count (M_total and the offsets are runtime values);
the compile cache key holds only what changes code (arch, dtypes, tile shape, majorness,
epilogue, clamp flag, the gated activation's constants). Grid = number of SMs; CTAs stride over all experts' tiles
(:mod:`mok_cute.schedule.group_tiles`). Rows past an expert's end are read by the A tile
(they belong to the next expert or are TMA zero fill) but never written: stores are
row-masked (16-byte vectors) or row-clipped by the TMA unit.

TMA-store epilogue (``plain`` and ``swiglu``; measured on an H200 on 2026-11-29: +3% on the expert MLP
fwd+bwd over row-masked 16-byte stores, which ``dswiglu`` keeps): the BF16 tile is staged in shared
memory, then one consumer warp issues ``cp.async.bulk.tensor`` stores (after a
``fence.proxy.async.shared::cta`` and a consumer barrier) and commits them as a bulk group;
the consumers go straight back to the next tile's MMA and wait
(``cp.async.bulk.wait_group.read``) only before the staging buffer is rewritten. Row
masking is done by the TMA unit: the output is seen through a per-expert row-bounded view
(the wrap-around trick of the ragged-K wgrad loads, :func:`_ragged_rows`), so rows past
the expert's last row are clipped. ``dswiglu`` keeps the masked stores.

SwiGLU's h by helper warps (``swiglu`` without the MXFP8 h copy, K >= :data:`HELPERS_MIN_K`; measured on
an H200 on 2026-12-02, commit d39f26b: bitwise the same, 4-12% faster at K 2048-7168, slower below): the
producer warpgroup's idle warps 1-3 compute and store h from the staged gate / up tile while the MMA warps
run the next tile's mainloop (:func:`swiglu_helpers`).

Epilogues:
  ``plain``:   out [M_total, N] = bf16(A_e @ B_e)
  ``swiglu``:  B = w_gate [E, I, H] and B2 = w_up [E, I, H], K-major: each B tile is
               stacked along N from tile_n/2 gate rows and the matching tile_n/2 up rows
               (two TMA loads per k-tile, no interleaved weight copy); writes
               gu [M_total, 2I] (gate in [0, I), up in [I, 2I)) and
               h [M_total, I] = bf16(silu(g) * u) from the BF16-rounded g, u in FP32, with
               optional clamp L: g = min(g, L), u = clamp(u, -L, L); gated (alpha a, up offset o,
               compile-time constants): h = bf16(g * sigmoid(a * g) * (u + o)).
  ``dswiglu``: N = I; the FP32 accumulator dh (never rounded) meets g, u read from
               gu [M_total, 2I]: gc = min(g, L), uc = clamp(u, -L, L), s = sigmoid(a * gc),
               dg = dh * (uc + o) * s * (1 + a * gc * (1 - s)) (0 where g > L),
               du = dh * (gc * s) (0 where |u| > L) (a = 1, o = 0 unless gated); writes
               dgu = bf16([dg | du]).
Element math: :mod:`mok_cute.kernels.swiglu_math` (``clamp`` and ``gated`` compile-time).
"""
from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.kernels.mx_rows import MX_BLOCK, mx_column_block
from mok_cute.kernels.sm90.bias import TileBias, add_bias, bias_load, fake_bias
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.dsl.host import (
    _check_devices, _check_limit, _check_out, _check_tensor, offsets_i32, sm_count, tma_weight,
)
from mok_cute.kernels.swiglu_math import Gated, dswiglu, swiglu_, swiglu_args
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, K_MAJOR, MN_MAJOR, NUM_CONSUMER_THREADS, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG,
    GroupWalk, MainloopConfig, Sm90Mainloop, TmaLoads, acc_to_smem, consumer_barrier, epi_smem_layout, experts_last,
)
from mok_cute.schedule.group_tiles import grouped_start, seek, tile_coords

EPILOGUES = ("plain", "swiglu", "dswiglu")
_VEC = 8  # bf16 elements per 16-byte store
N_ALIGN = 64  # N (I for swiglu / dswiglu) of every GEMM: a multiple of this; a tile's columns past N are masked
_BF16_OPS = Fp8Ops(bf16=True)  # (a module global: a local object may not cross a run-time loop)
# SwiGLU's helper warps (``GroupedGemmSm90(helpers=True)``): the producer warpgroup's warps 1-3 compute
# and store h from the staged gate / up tile while the MMA warps go on to the next tile's mainloop
HELPER_WARPS = 3
# named barriers of the hand-off (1: the consumers' own; 2-6: the fused forward's task hand-off and gather)
STAGED_BARRIER, FREE_BARRIER = 7, 8
_H_VEC = 4  # h elements per helper lane and row: 32 lanes x 4 = a 128-column half tile
HELPERS_TILE_N = 2 * 32 * _H_VEC  # so the helper warps run with tile_n 256 only (other tiles: without them)
HELPERS_MIN_K = 2048  # below it a tile's mainloop is shorter than the helpers' h (measured: K 1024 slower)
# the fused MXFP8 forward's helpers also make h's round trip: measured 3% faster at K 7168, 5% slower at K 4096
HELPERS_MX_MIN_K = 7168


def helper_threads(warps: int) -> int:
    """Threads of the hand-off barriers: the MMA warps and ``warps`` helper warps."""
    return NUM_CONSUMER_THREADS + 32 * warps


def _row_copy(width: int):
    """Tiled copy of 16-byte vectors over a (rows, width) BF16 tile by the 256 consumer threads."""
    tpr = width // _VEC
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
    thr = cute.make_layout((NUM_CONSUMER_THREADS // tpr, tpr), stride=(tpr, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, _VEC)))


@cute.jit
def _load_rows(tiled_copy: cute.TiledCopy, tid: Int32, s_tile: cute.Tensor):
    """This thread's vectors of a shared (rows, width) tile, in registers, and their coordinates."""
    thr = tiled_copy.get_slice(tid)
    tS = thr.partition_S(s_tile)
    r = cute.make_rmem_tensor_like(tS)
    cute.copy(tiled_copy, tS, r)
    coords = thr.partition_S(cute.make_identity_tensor(cute.product_each(s_tile.shape)))
    return r, coords


@cute.jit
def _store_rows(tiled_copy: cute.TiledCopy, tid: Int32, r: cute.Tensor, coords: cute.Tensor,
                g_tile: cute.Tensor, rows: Int32, cols: Int32 = None):
    """Store register vectors ``r`` to the gmem tile, skipping rows ``>= rows`` and (``cols``
    given: the tile's columns inside N, a multiple of 8) columns ``>= cols``."""
    tD = tiled_copy.get_slice(tid).partition_D(g_tile)
    if _in_cols(coords, cols):
        for m in cutlass.range_constexpr(cute.size(tD, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(tD, mode=[2])):
                if coords[(0, m, n)][0] < rows:
                    cute.copy(tiled_copy, r[(None, m, n)], tD[(None, m, n)])


@cute.jit
def _in_cols(coords: cute.Tensor, cols: Int32):
    """Whether this thread's vectors (one 8-column group: a :func:`_row_copy` thread's, the same
    in every row) lie inside the tile's first ``cols`` columns (``cols`` None: all columns)."""
    if cutlass.const_expr(cute.size(coords, mode=[2]) != 1):
        raise ValueError("_in_cols: one 8-column group per thread expected")
    ok = True
    if cutlass.const_expr(cols is not None):
        ok = coords[(0, 0, 0)][1] < cols
    return ok


@cute.jit
def _fetch_rows(width: cutlass.Constexpr[int], tid: Int32, g_tile: cute.Tensor, s_tile: cute.Tensor, rows: Int32,
                cols: Int32 = None):
    """Issue cp.async 16-byte copies of rows ``< rows`` (and, ``cols`` given, columns ``< cols``)
    of a gmem (rows, width) tile into the shared tile (the rest is left as it is); the caller
    commits and waits."""
    tpr = width // _VEC
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.BFloat16, num_bits_per_copy=128)
    thr = cute.make_layout((NUM_CONSUMER_THREADS // tpr, tpr), stride=(tpr, 1))
    tiled_copy = cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, _VEC)))
    thr_copy = tiled_copy.get_slice(tid)
    tG = thr_copy.partition_S(g_tile)
    tS = thr_copy.partition_D(s_tile)
    coords = thr_copy.partition_S(cute.make_identity_tensor(cute.product_each(s_tile.shape)))
    if _in_cols(coords, cols):
        for m in cutlass.range_constexpr(cute.size(tG, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(tG, mode=[2])):
                if coords[(0, m, n)][0] < rows:
                    cute.copy(tiled_copy, tG[(None, m, n)], tS[(None, m, n)])


class _StagedEpilogue:
    """Epilogues that read the tile rounded to BF16 and staged whole in shared memory."""

    def smem_elems(self) -> int:
        return self.tile_m * self.tile_n

    def smem_tensor(self, region):
        layout = epi_smem_layout(cutlass.BFloat16, self.tile_m, self.tile_n)
        return region.get_tensor(layout.outer, swizzle=layout.inner)

    @cute.jit
    def run(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32,
            row0: Int32, rows: Int32, n_tile: Int32, mOut0: cute.Tensor, mOut1: cute.Tensor, limit: Float32):
        """Consumer threads: stage the tile's accumulators as BF16 in ``sC`` and :meth:`store` rows ``< rows``
        of it (row-masked 16-byte stores; ``tiled_mma`` unused: the signature every epilogue's ``run`` shares)."""
        acc_to_smem(thr_mma, acc, sC)
        consumer_barrier()
        self.store(sC, tid, row0, rows, n_tile, mOut0, mOut1, limit)
        consumer_barrier()


class PlainEpilogue(_StagedEpilogue):
    """out[row0 + r, n_tile * tile_n + c] = tile[r, c] for r < rows (``n_tail``: and columns inside
    out's N; without it N must be a multiple of tile_n)."""

    def __init__(self, tile_m: int, tile_n: int, n_tail: bool = False):
        self.tile_m, self.tile_n, self.n_tail = tile_m, tile_n, n_tail

    @cute.jit
    def store(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32,
              mOut: cute.Tensor, mAux: cute.Tensor, limit: Float32):
        copy = _row_copy(self.tile_n)
        r, coords = _load_rows(copy, tid, sC)
        g = cute.local_tile(cute.domain_offset((row0, 0), mOut), (self.tile_m, self.tile_n), (0, n_tile))
        _store_rows(copy, tid, r, coords, g, rows, mOut.shape[1] - n_tile * self.tile_n if self.n_tail else None)


# ---------------------------------------------------------------- TMA-store epilogue
# Per-expert row bound for the output (the wrap-around trick of the ragged-K wgrad loads,
# see ``sm90.expert_bwd``): the [M, N] output (row stride s) is seen as (R, N, X, X) with
# strides (s, 1, 2^34 - s, s). Rows ``row0 .. row0 + tile_m`` of an expert ending at row
# ``hi`` are addressed at row coordinate ``R - hi + row0`` and extra coordinates (R, hi):
# address (row0 + r) s + 2^64 (mod 2^64: row row0 + r), in bounds iff row0 + r < hi, so
# the TMA unit drops every row past the expert (the next expert's rows, or past M).
_RAGGED = 2 ** 30
_EXTRA = 2 ** 31 - 1
_WRAP = 2 ** 34


def _ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """(M, N) tensor with strides (s, 1) -> (R, N, X, X) row-bounded view (see above)."""
    s = cutlass.Int64(t.stride[0])
    layout = cute.make_layout((_RAGGED, t.shape[1], _EXTRA, _EXTRA), stride=(s, 1, cutlass.Int64(_WRAP) - s, s))
    return cute.make_tensor(t.iterator, layout)


def _ragged_gu(t: cute.Tensor) -> cute.Tensor:
    """(M, 2, I) tensor with strides (s, s1, 1) -> (R, I, 2, X, X) row-bounded view."""
    s = cutlass.Int64(t.stride[0])
    layout = cute.make_layout((_RAGGED, t.shape[2], 2, _EXTRA, _EXTRA),
                              stride=(s, 1, cutlass.Int64(t.stride[1]), cutlass.Int64(_WRAP) - s, s))
    return cute.make_tensor(t.iterator, layout)


@cute.jit
def _expert_rows(coord: cute.Tensor, row0: Int32, hi: Int32) -> cute.Tensor:
    """(rows, N) TMA coordinates starting at row ``row0`` with rows ``>= hi`` out of bounds
    (``coord``: a :func:`_ragged_rows` coordinate tensor)."""
    return _bounded(coord[(None, None, _RAGGED, hi)], row0, hi)


@cute.jit
def _bounded(coord_rn: cute.Tensor, row0: Int32, hi: Int32) -> cute.Tensor:
    """Shift the (R, N) mode pair of a ragged coordinate tensor, already sliced at extra
    coordinates (R, hi), so that its row 0 is global row ``row0``."""
    return cute.domain_offset((_RAGGED - hi + row0, 0), coord_rn)


@cute.jit
def rows_tma_tile(coord: cute.Tensor, row0: Int32, rows: Int32, n_tile: Int32, tile_m: cutlass.Constexpr[int],
                  tile_n: cutlass.Constexpr[int]) -> cute.Tensor:
    """The (tile_m, tile_n) TMA coordinate tile ``n_tile`` of rows ``row0 .. row0 + rows`` (rows past them out
    of bounds; ``coord``: a :func:`_ragged_rows` store coordinate tensor)."""
    return cute.local_tile(_expert_rows(coord, row0, row0 + rows), (tile_m, tile_n), (0, n_tile))


class SwigluTmaTiles(NamedTuple):
    """A SwiGLU tile's TMA stores (:meth:`SwigluEpilogue.run_tma`): gu's store atom with the tile's gate and up
    coordinate tiles (tile_m, tile_n/2) and h's store atom with its coordinate tile (:func:`swiglu_tma_tiles`)."""

    atom_gu: cute.CopyAtom
    gate: cute.Tensor
    up: cute.Tensor
    atom_h: cute.CopyAtom
    h: cute.Tensor


@cute.jit
def swiglu_tma_tiles(coord_gu: cute.Tensor, coord_h: cute.Tensor, row0: Int32, rows: Int32, n_tile: Int32,
                     tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int]):
    """``(gate, up, h)`` TMA coordinate tiles of a SwiGLU tile's rows ``row0 .. row0 + rows`` (rows past them
    out of bounds) and intermediate columns ``n_tile * tile_n / 2 ..`` (``coord_gu``: a :func:`_ragged_gu`
    store coordinate tensor, ``coord_h``: a :func:`_ragged_rows` one; :meth:`SwigluEpilogue.run_tma`'s)."""
    hi = row0 + rows
    half = (tile_m, tile_n // 2)
    g_gate = cute.local_tile(_bounded(coord_gu[(None, None, 0, _RAGGED, hi)], row0, hi), half, (0, n_tile))
    g_up = cute.local_tile(_bounded(coord_gu[(None, None, 1, _RAGGED, hi)], row0, hi), half, (0, n_tile))
    g_h = cute.local_tile(_expert_rows(coord_h, row0, hi), half, (0, n_tile))
    return g_gate, g_up, g_h


def make_tma_store(mOut: cute.Tensor, tile_m: int, tile_n: int):
    """TMA store atom and coordinate tensor of a (rows, N, ...) BF16 output from the staged
    (tile_m, tile_n) shared tile (:func:`epi_smem_layout`)."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mOut,
                                       epi_smem_layout(cutlass.BFloat16, tile_m, tile_n), (tile_m, tile_n))


@cute.jit
def _store_warp(tid: Int32):
    """The consumer warp that issues, commits and waits for the TMA stores (bulk groups are
    per thread, so it must always be the same one)."""
    return tid // 32 == 0


@cute.jit
def tma_store_tile(thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32, atom_c: cute.CopyAtom,
                   gC: cute.Tensor):
    """Stage the BF16 tile in ``sC`` and store it to the (tile_m, tile_n) TMA coordinates ``gC``
    asynchronously; returns as soon as the store is issued.

    Before writing ``sC`` the store warp waits until the previous tile's store has finished
    READING it (``cp.async.bulk.wait_group.read 0``; by then a whole mainloop has run, so
    this rarely blocks); after writing, every thread fences its generic-proxy shared writes
    against the async proxy, and after the barrier one warp issues the store and commits it.
    """
    _stage_for_tma(thr_mma, acc, sC, tid)
    if _store_warp(tid):
        _tma_store(atom_c, sC, gC)
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def _stage_for_tma(thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32):
    """Write the BF16 tile to ``sC`` once the previous TMA store has read it, fenced for the
    async proxy, all consumers past the barrier (see :func:`tma_store_tile`)."""
    if _store_warp(tid):
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    consumer_barrier()
    acc_to_smem(thr_mma, acc, sC)
    cute.arch.fence_proxy("async.shared", space="cta")
    consumer_barrier()


@cute.jit
def _tma_store(atom: cute.CopyAtom, s_tile: cute.Tensor, g_tile: cute.Tensor):
    """Issue the TMA store of a whole shared tile to its coordinate tile (store warp; no commit)."""
    tSs, tGg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
                                     cute.group_modes(g_tile, 0, 2))
    cute.copy(atom, tSs, tGg)


@cute.jit
def tma_store_drain(tid: Int32):
    """After the last tile: wait for this CTA's outstanding TMA stores."""
    if _store_warp(tid):
        cute.arch.cp_async_bulk_wait_group(0, read=True)


class SwigluEpilogue(_StagedEpilogue):
    """Tile columns [0, tile_n/2) are gate, [tile_n/2, tile_n) up, for intermediate columns
    ``n_tile * tile_n/2 + c``: writes gu (gate, up halves) and h = silu(g) * u (optionally clamped; ``gated``:
    :func:`~mok_cute.kernels.swiglu_math.swiglu_`'s alpha / up offset).

    ``mx_h`` (:meth:`run_tma`): also writes h quantized to MXFP8 along I (GEMM2's forward operand, quantized
    where it is produced): data hq [M, I] e4m3 (seen as u32 words [M, I/4]) and E8M0 scales
    hs [M, I/32], bitwise ``reference.mxfp8_quantize(h, -1)`` (the ops of
    :mod:`mok_cute.kernels.quant.quantize`'s row kernel on the same bf16 values). In the 16-byte
    row copy a 32-element block is 4 adjacent lanes (``tile_n/2`` is a multiple of 32), whose
    amax meets by two butterfly shuffles.

    ``mx_rt``: also writes h's MXFP8 round trip along I as bf16 (``mHrt`` [M, I], the fused
    MXFP8 forward's GEMM2 operand), bitwise ``dequant_mxfp8.mxfp8_round_trip(h)``.

    ``n_tail``: the last tile's columns past I are not stored (without it I must be a multiple of
    tile_n / 2).
    """

    def __init__(self, tile_m: int, tile_n: int, clamp: bool, mx_h: bool = False, mx_rt: bool = False,
                 n_tail: bool = False, gated: Gated | None = None):
        self.tile_m, self.tile_n, self.half, self.clamp, self.mx_h = tile_m, tile_n, tile_n // 2, clamp, mx_h
        self.mx_rt, self.n_tail, self.gated = mx_rt, n_tail, gated
        if (mx_h or mx_rt) and self.half % MX_BLOCK:
            raise ValueError(f"mx_h / mx_rt need tile_n/2 a multiple of {MX_BLOCK}, got tile_n={tile_n}")

    @cute.jit
    def store(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32,
              mGU: cute.Tensor, mH: cute.Tensor, limit: Float32, mHrt: cute.Tensor = None):
        """Row-masked stores of the staged tile's rows ``< rows``: gu (:meth:`store_gu`), h and (``mx_rt``) h's
        MXFP8 round trip ``mHrt`` (the MXFP8 h copy of ``mx_h`` is :meth:`run_tma`'s)."""
        copy = _row_copy(self.half)
        shape = (self.tile_m, self.half)
        cols = mH.shape[1] - n_tile * self.half if self.n_tail else None  # the tile's columns inside I
        rg, ru, coords = self.store_gu(sC, tid, row0, rows, n_tile, mGU, cols)
        rh = self._h(rg, ru, limit)
        h_tile = cute.local_tile(cute.domain_offset((row0, 0), mH), shape, (0, n_tile))
        _store_rows(copy, tid, rh, coords, h_tile, rows, cols)
        if cutlass.const_expr(self.mx_rt):
            rt_tile = cute.local_tile(cute.domain_offset((row0, 0), mHrt), shape, (0, n_tile))
            _store_rows(copy, tid, _mx_rows_rt(rh), coords, rt_tile, rows, cols)

    @cute.jit
    def store_gu(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mGU: cute.Tensor,
                 cols: Int32 = None):
        """The staged gate and up halves to gu's rows ``< rows`` (``cols``: the tile's columns inside I, None: all);
        returns this thread's ``(gate, up)`` register vectors and their coordinates."""
        copy = _row_copy(self.half)
        shape = (self.tile_m, self.half)
        rg, coords = _load_rows(copy, tid, cute.local_tile(sC, shape, (0, 0)))
        ru, _ = _load_rows(copy, tid, cute.local_tile(sC, shape, (0, 1)))
        gate_rows = cute.domain_offset((row0, 0), mGU[(None, 0, None)])
        up_rows = cute.domain_offset((row0, 0), mGU[(None, 1, None)])
        _store_rows(copy, tid, rg, coords, cute.local_tile(gate_rows, shape, (0, n_tile)), rows, cols)
        _store_rows(copy, tid, ru, coords, cute.local_tile(up_rows, shape, (0, n_tile)), rows, cols)
        return rg, ru, coords

    @cute.jit
    def _store_mx(self, rh: cute.Tensor, coords: cute.Tensor, row0: Int32, rows: Int32, n_tile: Int32,
                  mHq: cute.Tensor, mHs: cute.Tensor):
        """MXFP8 of this thread's h vectors (see the class doc): 8 data bytes per vector as two
        words of hq, one scale byte per block from its first lane; rows ``>= rows`` and columns
        past I skipped (every lane still joins the shuffles)."""
        ops = Fp8Ops(bf16=True)
        words = cute.recast_tensor(rh, cutlass.Uint32)
        for m in cutlass.range_constexpr(cute.size(words, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(words, mode=[2])):
                v = [words[(j, m, n)] for j in range(4)]
                o, byte = ops.mx_block(v, 4)
                r, c = coords[(0, m, n)]
                if r < rows:
                    col = n_tile * self.half + c
                    inside = True
                    if cutlass.const_expr(self.n_tail):
                        inside = col < mHs.shape[1] * MX_BLOCK
                    if inside:
                        mHq[row0 + r, col // 4] = o[0]
                        mHq[row0 + r, col // 4 + 1] = o[1]
                        if c % MX_BLOCK == 0:
                            mHs[row0 + r, col // MX_BLOCK] = cutlass.Uint8(byte)

    @cute.jit
    def _h(self, rg: cute.Tensor, ru: cute.Tensor, limit: Float32):
        """h = silu(g) * u (optionally clamped, or gated) in FP32 from BF16 register vectors, as BF16."""
        g = cute.make_rmem_tensor_like(rg, Float32)
        u = cute.make_rmem_tensor_like(ru, Float32)
        g.store(rg.load().to(Float32))
        u.store(ru.load().to(Float32))
        swiglu_(g, u, limit, self.clamp, self.gated)
        rh = cute.make_rmem_tensor_like(rg)
        rh.store(g.load().to(cutlass.BFloat16))
        return rh

    @cute.jit
    def run_tma(self, thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32, tiles: SwigluTmaTiles,
                limit: Float32, row0: Int32 = None, rows: Int32 = None, n_tile: Int32 = None,
                mHq: cute.Tensor = None, mHs: cute.Tensor = None):
        """TMA-store epilogue: the gate and up halves of the staged tile go to gu by two TMA stores
        (``tiles``: :class:`SwigluTmaTiles`); h is computed from them, written over the gate half once
        the gu stores have read it, and stored by a third (all row-bounded per expert). With ``mx_h``
        (``row0``, ``rows``, ``n_tile``, ``mHq``, ``mHs`` given) also h's MXFP8 copy, by masked stores."""
        atom_gu, gGate, gUp, atom_h, gH = tiles
        shape = (self.tile_m, self.half)
        s_gate = cute.local_tile(sC, shape, (0, 0))
        s_up = cute.local_tile(sC, shape, (0, 1))
        _stage_for_tma(thr_mma, acc, sC, tid)  # after the previous tile's h store has read sC
        if _store_warp(tid):
            _tma_store(atom_gu, s_gate, gGate)
            _tma_store(atom_gu, s_up, gUp)
            cute.arch.cp_async_bulk_commit_group()
        copy = _row_copy(self.half)
        rg, coords = _load_rows(copy, tid, s_gate)
        ru, _ = _load_rows(copy, tid, s_up)
        rh = self._h(rg, ru, limit)
        if cutlass.const_expr(self.mx_h):  # (row0, rows, n_tile, mHq, mHs given with mx_h)
            self._store_mx(rh, coords, row0, rows, n_tile, mHq, mHs)
        if _store_warp(tid):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the gu stores have read the tile
        consumer_barrier()
        cute.copy(copy, rh, copy.get_slice(tid).partition_D(s_gate))
        cute.arch.fence_proxy("async.shared", space="cta")
        consumer_barrier()
        if _store_warp(tid):
            _tma_store(atom_h, s_gate, gH)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def stage_for_helpers(self, thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32,
                          atom_gu: cute.CopyAtom, gGate: cute.Tensor, gUp: cute.Tensor):
        """MMA warps, with helper warps (:meth:`help_h`): once the previous tile's gu stores and the
        helpers have read ``sC`` (``FREE_BARRIER``), stage this tile's gate and up halves, meet the
        helpers (``STAGED_BARRIER``) and store gu by two TMA stores; h is the helpers' work."""
        threads = helper_threads(HELPER_WARPS)
        if _store_warp(tid):
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=FREE_BARRIER, number_of_threads=threads)
        acc_to_smem(thr_mma, acc, sC)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=STAGED_BARRIER, number_of_threads=threads)
        if _store_warp(tid):
            shape = (self.tile_m, self.half)
            _tma_store(atom_gu, cute.local_tile(sC, shape, (0, 0)), gGate)
            _tma_store(atom_gu, cute.local_tile(sC, shape, (0, 1)), gUp)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def help_h(self, sC: cute.Tensor, hw: Int32, lane: Int32, row0: Int32, rows: Int32, n_tile: Int32,
               mH: cute.Tensor, limit: Float32, warps: cutlass.Constexpr[int] = HELPER_WARPS,
               mHrt: cute.Tensor = None):
        """Helper warp ``hw`` (0 .. ``warps`` - 1), between the hand-off barriers: h of the staged
        tile's rows ``hw, hw + warps, ..`` below ``rows`` (lane: ``_H_VEC`` columns), from the bf16
        gate and up halves in ``sC``, stored to ``mH`` (the same arithmetic as :meth:`store`); with
        ``mHrt`` (``mx_rt``) also h's MXFP8 round trip along I (a 32-column block over 8 adjacent
        lanes), bitwise :meth:`store`'s."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16,
                                   num_bits_per_copy=16 * _H_VEC)
        copy = cute.make_tiled_copy_tv(atom, cute.make_layout((1, 32)), cute.make_layout((1, _H_VEC)))
        thr = copy.get_slice(lane)
        row = (1, self.half)
        g_h = cute.domain_offset((row0, 0), mH)
        g_rt = None if mHrt is None else cute.domain_offset((row0, 0), mHrt)
        inside = True
        if cutlass.const_expr(self.n_tail):
            inside = n_tile * self.half + lane * _H_VEC < mH.shape[1]
        for r in cutlass.range(hw, rows, warps, unroll=1):
            sg = thr.partition_S(cute.local_tile(sC, row, (r, 0)))
            su = thr.partition_S(cute.local_tile(sC, row, (r, 1)))
            rg = cute.make_rmem_tensor_like(sg)
            ru = cute.make_rmem_tensor_like(su)
            cute.copy(copy, sg, rg)
            cute.copy(copy, su, ru)
            rh = self._h(rg, ru, limit)
            if inside:
                cute.copy(copy, rh, thr.partition_D(cute.local_tile(g_h, row, (r, n_tile))))
            if cutlass.const_expr(mHrt is not None):  # every lane joins the block's shuffles
                rt = _mx_lane_rt(rh)
                if inside:
                    cute.copy(copy, rt, thr.partition_D(cute.local_tile(g_rt, row, (r, n_tile))))


@cute.jit
def _mx_lane_rt(r: cute.Tensor) -> cute.Tensor:
    """A helper lane's ``_H_VEC`` = 4 bf16 of one row (a 32-column MXFP8 block over 8 adjacent lanes) after the
    MXFP8 round trip along the row, bitwise ``dequant_mxfp8.mxfp8_round_trip``: the 16-byte chunk ops of
    :func:`_mx_rows_rt` on the lane's two words given twice (the block's amax and each value's own quantize do
    not change), the first two result words kept."""
    rt = cute.make_rmem_tensor_like(r)
    words, rt_words = cute.recast_tensor(r, cutlass.Uint32), cute.recast_tensor(rt, cutlass.Uint32)
    o = _BF16_OPS.mx_round_trip([words[0], words[1], words[0], words[1]], 8)
    rt_words[0] = o[0]
    rt_words[1] = o[1]
    return rt


@cute.jit
def _mx_rows_rt(r: cute.Tensor) -> cute.Tensor:
    """Register vectors of a staged tile's rows (8 bf16 each, ``_row_copy`` of a 128-column
    half: a 32-column MXFP8 block spans 4 adjacent lanes) after the MXFP8 round trip along the
    rows, bitwise ``dequant_mxfp8.mxfp8_round_trip`` (every lane joins the shuffles)."""
    rt = cute.make_rmem_tensor_like(r)
    words, rt_words = cute.recast_tensor(r, cutlass.Uint32), cute.recast_tensor(rt, cutlass.Uint32)
    for m in cutlass.range_constexpr(cute.size(words, mode=[1])):
        for n in cutlass.range_constexpr(cute.size(words, mode=[2])):
            o = _BF16_OPS.mx_round_trip([words[(j, m, n)] for j in range(4)], 4)
            for j in cutlass.range_constexpr(4):
                rt_words[(j, m, n)] = o[j]
    return rt


@cute.jit
def _mx_tokens_rt(buf: cute.Tensor, tid: Int32, rows: Int32, tile_m: cutlass.Constexpr[int],
                  width: cutlass.Constexpr[int], pitch: cutlass.Constexpr[int]):
    """In place, a shared (tile_m, width) bf16 tile (row pitch ``pitch`` elements) after the
    MXFP8 round trip along its rows' axis: blocks of 32 rows from row 0, per column, rows
    ``>= rows`` taken as 0 (the zero padding of an expert's last block), bitwise
    ``dequant_mxfp8.mxfp8_round_trip_tokens`` on a tile whose row 0 starts a block. One
    consumer thread per (32-row block, 8-column chunk): :func:`~mok_cute.kernels.mx_rows.mx_column_block`."""
    chunks = width // _VEC
    words = cute.make_tensor(cute.recast_ptr(buf.iterator, dtype=cutlass.Uint32),
                             cute.make_layout((tile_m, chunks, 4), stride=(pitch // 2, 4, 1)))
    for item in cutlass.range(tid, (tile_m // MX_BLOCK) * chunks, NUM_CONSUMER_THREADS, unroll=1):
        mx_column_block(words, (item // chunks) * MX_BLOCK, item % chunks, rows)


class DSwigluEpilogue:
    """dSwiGLU on the FP32 accumulator dh of intermediate columns ``n_tile * tile_n + c``.

    ``mDGU`` (out) and ``mGU`` (in) are [M, 2, I] views of dgu / gu (gate half, up half).
    The tile is done in two column halves: the g and u halves are fetched (cp.async) into
    two row-padded (conflict-free for the accumulator layout, unswizzled so addresses are
    a per-thread base plus constants) shared buffers (half 0 by :meth:`prefetch` before
    the mainloop), each thread turns its accumulator elements of that half into bf16 dg /
    du in place (same shared positions), then rows ``< rows`` are stored. In the wgmma
    accumulator layout a thread's column for element i differs from thread 0's by less
    than 8 (within one 8-column group), so an element's half is a compile-time fact
    (taken from thread 0's coordinates; checked for every 5th thread, tile_n 128 and 256).

    ``n_tail``: columns past I are neither fetched nor stored (without it I must be a multiple of
    tile_n). ``mx`` (the MXFP8 backward's operands): instead of dgu, ``mDGU`` gets dgu's MXFP8 round trip
    along its rows (dgrad1's operand) and ``mDGUt`` its round trip along the tokens in blocks
    of 32 rows from the tile's first row (the weight gradients' operand; a tile's rows are one
    expert's, from a multiple of 128 of them), bitwise ``dequant_mxfp8.mxfp8_round_trip`` and
    ``mxfp8_round_trip_tokens`` of the unfused dgu. ``clamp``, ``gated``: those of
    :func:`~mok_cute.kernels.swiglu_math.dswiglu`.
    """

    def __init__(self, tile_m: int, tile_n: int, clamp: bool, mx: bool = False, n_tail: bool = False,
                 gated: Gated | None = None):
        if tile_n % 16:
            raise ValueError(f"dswiglu needs tile_n a multiple of 16, got {tile_n}")
        if mx and (tile_n // 2) % MX_BLOCK:
            raise ValueError(f"mx needs tile_n/2 a multiple of {MX_BLOCK}, got tile_n={tile_n}")
        self.tile_m, self.tile_n, self.half, self.clamp, self.mx = tile_m, tile_n, tile_n // 2, clamp, mx
        self.pitch = self.half + _VEC  # row pitch: 16 bytes of padding
        self.n_tail, self.gated = n_tail, gated

    def smem_elems(self) -> int:
        return 2 * self.tile_m * self.pitch

    def smem_tensor(self, region):
        """(tile_m, half, 2): the g and u buffers."""
        return region.get_tensor(cute.make_layout((self.tile_m, self.half, 2),
                                                  stride=(self.pitch, 1, self.tile_m * self.pitch)))

    def _bufs(self, sC: cute.Tensor):
        return sC[(None, None, 0)], sC[(None, None, 1)]  # g, u

    @cute.jit
    def _valid(self, n_tile: Int32, h: cutlass.Constexpr[int], mGU: cute.Tensor):
        """Columns of half ``h`` of the tile inside I (``n_tail``; else None: all)."""
        valid = None
        if cutlass.const_expr(self.n_tail):
            valid = mGU.shape[2] - (2 * n_tile + h) * self.half
        return valid

    @cute.jit
    def _fetch(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mGU: cute.Tensor,
               h: cutlass.Constexpr[int]):
        """Start the cp.async loads of column half ``h`` of the tile's g and u."""
        bufs = self._bufs(sC)
        for j in cutlass.range_constexpr(2):  # 0: gate half of gu, 1: up half
            src = cute.domain_offset((row0, 0), mGU[(None, j, None)])
            _fetch_rows(self.half, tid, cute.local_tile(src, (self.tile_m, self.half), (0, 2 * n_tile + h)),
                        bufs[j], rows, self._valid(n_tile, h, mGU))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def prefetch(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32, mGU: cute.Tensor):
        """Before the mainloop (the buffer is free, the accumulators not yet live): fetch half 0."""
        self._fetch(sC, tid, row0, rows, n_tile, mGU, 0)

    @cute.jit
    def run(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32,
            row0: Int32, rows: Int32, n_tile: Int32, mDGU: cute.Tensor, mGU: cute.Tensor, limit: Float32,
            mDGUt: cute.Tensor = None):
        shape = (self.tile_m, self.half)
        bufs = self._bufs(sC)
        # a (tile_m, tile_n) view whose column c lands on buffer column c % half
        alias = cute.make_layout((self.tile_m, (self.half, 2)), stride=(self.pitch, (1, 0)))
        tG = thr_mma.partition_C(cute.make_tensor(bufs[0].iterator, alias))
        tU = thr_mma.partition_C(cute.make_tensor(bufs[1].iterator, alias))
        cols = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        copy = _row_copy(self.half)
        for h in cutlass.range_constexpr(2):
            if cutlass.const_expr(h == 1):
                self._fetch(sC, tid, row0, rows, n_tile, mGU, 1)
            cute.arch.cp_async_wait_group(0)
            consumer_barrier()
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cutlass.const_expr(i % 16 == 0):
                    # scheduling fence: stops ptxas hoisting every shared load of the half
                    # above the math (with 128 accumulators live that spilled)
                    cute.arch.sync_warp()
                if cutlass.const_expr(cols[i][1] // self.half == h):
                    dg, du = dswiglu(acc[i], tG[i].to(Float32), tU[i].to(Float32), limit, self.clamp, self.gated)
                    tG[i] = dg.to(cutlass.BFloat16)
                    tU[i] = du.to(cutlass.BFloat16)
            consumer_barrier()
            valid = self._valid(n_tile, h, mGU)
            for j in cutlass.range_constexpr(2):
                r, coords = _load_rows(copy, tid, bufs[j])
                if cutlass.const_expr(self.mx):
                    r = _mx_rows_rt(r)
                dst = cute.domain_offset((row0, 0), mDGU[(None, j, None)])
                _store_rows(copy, tid, r, coords, cute.local_tile(dst, shape, (0, 2 * n_tile + h)), rows, valid)
            if cutlass.const_expr(self.mx):  # then the round trip along the tokens, in place
                consumer_barrier()
                for j in cutlass.range_constexpr(2):
                    _mx_tokens_rt(bufs[j], tid, rows, self.tile_m, self.half, self.pitch)
                consumer_barrier()
                for j in cutlass.range_constexpr(2):
                    r, coords = _load_rows(copy, tid, bufs[j])
                    dst = cute.domain_offset((row0, 0), mDGUt[(None, j, None)])
                    _store_rows(copy, tid, r, coords, cute.local_tile(dst, shape, (0, 2 * n_tile + h)), rows, valid)
            consumer_barrier()


class GemmOutputs(NamedTuple):
    """The output tensors of one grouped GEMM (:class:`GroupedGemmSm90`'s kernel parameters in this order;
    torch tensors at a launch, cute tensors in the kernel). ``plain``: ``out0`` = ``out1`` = out [M, N] bf16;
    ``swiglu``: ``out0`` = gu [M, 2, I], ``out1`` = h [M, I] bf16 and, with the MXFP8 copy of h, ``hq``
    [M, I/4] u32 words and ``hs`` [M, I/32] uint8 scales (None without it); ``dswiglu``: ``out0`` = dgu
    (written), ``out1`` = gu (read), both [M, 2, I] bf16."""

    out0: cute.Tensor
    out1: cute.Tensor
    hq: cute.Tensor = None
    hs: cute.Tensor = None


class TmaStores(NamedTuple):
    """The TMA-store epilogue's store atoms and row-bounded coordinate tensors (:func:`make_tma_store`; kernel
    parameters in this order): ``plain``: the output's ``atom_c`` / ``coord_c`` (:func:`_ragged_rows`);
    ``swiglu``: gu's (:func:`_ragged_gu`) and h's ``atom_h`` / ``coord_h``; None where unused (``dswiglu``)."""

    atom_c: cute.CopyAtom = None
    coord_c: cute.Tensor = None
    atom_h: cute.CopyAtom = None
    coord_h: cute.Tensor = None


class GroupedGemmSm90:
    """Persistent warp-specialized grouped GEMM: mainloop per tile + pluggable epilogue.

    Call (jit): ``(mA [M, K], mB, mB2, mOffsets [E+1] int32, mOut0, mOut1, mHq, mHs, limit, num_ctas,
    stream)``. ``mB``: [E, N, K] (``b_major="k"``) or [E, K1, N] (``"mn"``); ``mB2``: None,
    or (``split_b``) the [E, K - K1, N] second part of B along K, or (swiglu) w_up [E, I, K]
    stacked along N with ``mB`` = w_gate. ``mOut0 .. mHs``: :class:`GemmOutputs`. N (I for swiglu) a multiple
    of tile_n (tile_n/2), or with ``n_tail`` of ``N_ALIGN`` (the last n-tile's columns past N: B rows
    zero-filled by TMA, stores masked or clipped); K1 a multiple of tile_k. ``plain`` and ``swiglu`` store
    through TMA, ``dswiglu`` by row-masked stores (see the module doc). ``clamp``, ``gated``: the (d)SwiGLU's
    compile-time switches (:mod:`~mok_cute.kernels.swiglu_math`).
    """

    def __init__(self, cfg: MainloopConfig, epilogue: str, clamp: bool = False, b_major: str = K_MAJOR,
                 split_b: bool = False, mx_h: bool = False, n_tail: bool = False, helpers: bool = False,
                 gated: Gated | None = None, biased: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if biased and (epilogue == "dswiglu" or split_b):
            raise ValueError("biased: the swiglu and plain (K-major B) epilogues only")
        self.biased = biased
        if mx_h and epilogue != "swiglu":
            raise ValueError("mx_h (the MXFP8 copy of h) needs epilogue 'swiglu'")
        self.mx_h = mx_h
        if split_b and b_major != MN_MAJOR:
            raise ValueError("split_b needs b_major='mn'")
        self.cfg, self.b_major, self.split_b = cfg, b_major, split_b
        self.stack_n = epilogue == "swiglu"  # B tile = [w_gate rows; w_up rows]
        if self.stack_n and (b_major != K_MAJOR or split_b):
            raise ValueError("swiglu needs b_major='k' and no split_b")
        if epilogue == "plain":
            self.epi = PlainEpilogue(cfg.tile_m, cfg.tile_n, n_tail)
        elif epilogue == "swiglu":
            self.epi = SwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp, mx_h, n_tail=n_tail, gated=gated)
        else:
            self.epi = DSwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp, n_tail=n_tail, gated=gated)
        self.tma_store = epilogue in ("plain", "swiglu")  # dswiglu: masked stores
        if helpers and not (self.stack_n and not mx_h):
            raise ValueError("helpers (h by the producer warpgroup's warps) needs the swiglu epilogue without mx_h")
        if helpers and cfg.tile_n != HELPERS_TILE_N:
            raise ValueError(f"helpers: the helper lanes span a {HELPERS_TILE_N // 2}-column half tile, so tile_n "
                             f"{HELPERS_TILE_N} only, got {cfg.tile_n}")
        self.helpers = helpers
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=self.epi.smem_elems() * 2, b_major=b_major)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mB2: cute.Tensor, mOffsets: cute.Tensor,
                 mOut0: cute.Tensor, mOut1: cute.Tensor, mHq: cute.Tensor, mHs: cute.Tensor, bias: TileBias,
                 limit: Float32, num_ctas: Int32, stream: cuda.CUstream):
        ml = self.mainloop
        ml.setup()
        atom_a, coord_a, atom_b, coord_b = ml.make_tma(mA, experts_last(mB, self.b_major != K_MAJOR), b_half=self.stack_n)
        atom_b2, coord_b2 = None, None
        if cutlass.const_expr(self.split_b or self.stack_n):
            _, _, atom_b2, coord_b2 = ml.make_tma(mA, experts_last(mB2, self.b_major != K_MAJOR), b_half=self.stack_n)
        stores = TmaStores()
        if cutlass.const_expr(self.tma_store and self.stack_n):  # gu [M, 2, I] and h [M, I]
            stores = TmaStores(*make_tma_store(_ragged_gu(mOut0), self.cfg.tile_m, self.cfg.tile_n // 2),
                               *make_tma_store(_ragged_rows(mOut1), self.cfg.tile_m, self.cfg.tile_n // 2))
        elif cutlass.const_expr(self.tma_store):
            stores = TmaStores(*make_tma_store(_ragged_rows(mOut0), self.cfg.tile_m, self.cfg.tile_n))

        self.shared_storage = ml.shared_storage(self.epi.smem_elems(), extra_f32=self.cfg.tile_n if self.biased else 0)
        self.kernel(TmaLoads(atom_a, coord_a, atom_b, coord_b, atom_b2, coord_b2), mOffsets,
                    GemmOutputs(mOut0, mOut1, mHq, mHs), bias, limit, stores).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, loads: TmaLoads, mOffsets: cute.Tensor, outs: GemmOutputs, bias: TileBias, limit: Float32,
               stores: TmaStores):
        cfg = self.cfg
        atom_c, coord_c, atom_h, coord_h = stores
        atoms = [loads.atom_a, loads.atom_b]
        if cutlass.const_expr(self.split_b or self.stack_n):
            atoms.append(loads.atom_b2)
        if cutlass.const_expr(self.tma_store):
            atoms.append(atom_c)
            if cutlass.const_expr(self.stack_n):
                atoms.append(atom_h)
        tidx, warp = self.mainloop.start(atoms)

        pipe, sA, sB, sC, storage = self.mainloop.allocate(self.shared_storage, self.epi, with_storage=True)

        b_rows = cfg.tile_n // 2 if cutlass.const_expr(self.stack_n) else cfg.tile_n  # B rows per TMA tile
        num_experts, n_tiles, k_tiles, linear, grid, expert, base = grouped_start(
            mOffsets, loads.coord_b.shape[0], b_rows, loads.coord_a.shape[1], cfg.tile_m, cfg.tile_k,
            self.epi.n_tail)
        k_tiles1 = k_tiles
        if cutlass.const_expr(self.split_b):
            k_tiles1 = loads.coord_b.shape[1] // cfg.tile_k

        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self.mainloop.produce_grouped(pipe, GroupWalk(mOffsets, num_experts, n_tiles, linear, expert, base,
                                                              grid), loads, sA, sB, b_rows, k_tiles, self.stack_n,
                                              k_tiles1 if self.split_b else None)
            elif cutlass.const_expr(self.helpers):  # warps 1-3: every tile's h (the MMA warps' FREE waits
                # match one arrive before the first tile and one after each tile but the last)
                threads = helper_threads(HELPER_WARPS)
                cute.arch.barrier_arrive(barrier_id=FREE_BARRIER, number_of_threads=threads)
                while expert < num_experts:
                    _, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                    cute.arch.barrier(barrier_id=STAGED_BARRIER, number_of_threads=threads)
                    self.epi.help_h(sC, warp - 1, tidx % 32, row0, rows, n_tile, outs.out1, limit)
                    linear = linear + grid
                    expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)
                    if expert < num_experts:
                        cute.arch.barrier_arrive(barrier_id=FREE_BARRIER, number_of_threads=threads)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            tid = tidx - THREADS_PER_WG
            thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(sA, sB, tid)
            state = self.mainloop.consumer_state()
            while expert < num_experts:
                _, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                if cutlass.const_expr(isinstance(self.epi, DSwigluEpilogue)):
                    self.epi.prefetch(sC, tid, row0, rows, n_tile, outs.out1)
                bv = Float32(0.0)
                if cutlass.const_expr(self.biased):  # swiglu: b_gate | b_up; plain: b_down
                    bv = bias_load(tid, cfg.tile_n, expert, n_tile, bias.gate if self.stack_n else bias.down,
                                   bias.up if self.stack_n else None)
                state = self.mainloop.mma_tile(pipe, state, tCrA, tCrB, acc, k_tiles)
                if cutlass.const_expr(self.biased):
                    add_bias(self.mainloop.tiled_mma, thr_mma, acc, cfg.tile_m, cfg.tile_n, tid, bv,
                             storage.extra_f32.get_tensor(cute.make_layout(cfg.tile_n)))
                if cutlass.const_expr(self.helpers):
                    g_gate, g_up, _ = swiglu_tma_tiles(coord_c, coord_h, row0, rows, n_tile, cfg.tile_m, cfg.tile_n)
                    self.epi.stage_for_helpers(thr_mma, acc, sC, tid, atom_c, g_gate, g_up)
                elif cutlass.const_expr(self.tma_store and self.stack_n):
                    g_gate, g_up, g_h = swiglu_tma_tiles(coord_c, coord_h, row0, rows, n_tile, cfg.tile_m, cfg.tile_n)
                    self.epi.run_tma(thr_mma, acc, sC, tid, SwigluTmaTiles(atom_c, g_gate, g_up, atom_h, g_h), limit,
                                     row0, rows, n_tile, outs.hq, outs.hs)
                elif cutlass.const_expr(self.tma_store):
                    gC = rows_tma_tile(coord_c, row0, rows, n_tile, cfg.tile_m, cfg.tile_n)
                    tma_store_tile(thr_mma, acc, sC, tid, atom_c, gC)
                else:
                    self.epi.run(self.mainloop.tiled_mma, thr_mma, acc, sC, tid, row0, rows, n_tile, outs.out0,
                                 outs.out1, limit)
                linear = linear + grid
                expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)
            if cutlass.const_expr(self.tma_store):
                tma_store_drain(tid)


# ---------------------------------------------------------------- compile
def compile_grouped_gemm(epilogue: str, *, clamp: bool = False, cfg: MainloopConfig = MainloopConfig(),
                         b_major: str = K_MAJOR, split_b: bool = False, mx_h: bool = False, n_tail: bool = False,
                         helpers: bool = False, gated: Gated | None = None, biased: bool = False,
                         arch: str = "sm_90a", inspect: bool = False):
    """Compile one kernel variant with symbolic M_total, N, K, E (``n_tail``: N not a multiple of
    the tile; ``helpers``: SwiGLU's h by helper warps; ``gated``: the SwiGLU's alpha / up offset;
    ``biased``: expert biases, :mod:`~mok_cute.kernels.sm90.bias`; see :class:`GroupedGemmSm90`);
    returns ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 grouped GEMM needs arch sm_90a, got {arch!r}")
    op = GroupedGemmSm90(cfg, epilogue, clamp, b_major, split_b, mx_h, n_tail, helpers, gated, biased)
    ab = cfg.ab_dtype
    m, k, n, e = cute.sym_int(), cute.sym_int(divisibility=_VEC), cute.sym_int(), cute.sym_int()
    mA = _fake_2d(ab, m, k)
    mB2 = None
    if epilogue == "swiglu":  # w_gate, w_up [E, I, K]
        inter = cute.sym_int(divisibility=_VEC)
        mB, mB2 = _fake_3d(ab, e, inter, k), _fake_3d(ab, e, inter, k)
    elif b_major == K_MAJOR:
        mB = _fake_3d(ab, e, n, k)
    else:
        mB = _fake_3d(ab, e, cute.sym_int(divisibility=_VEC), n)
        if split_b:
            mB2 = _fake_3d(ab, e, cute.sym_int(divisibility=_VEC), n)
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    out0 = out1 = _fake_2d(cutlass.BFloat16, m, n)
    if epilogue == "swiglu":  # gu as [M, 2, I], h as [M, I]
        out0, out1 = _fake_3d(cutlass.BFloat16, m, cute.sym_int(), inter), _fake_2d(cutlass.BFloat16, m, inter)
    elif epilogue == "dswiglu":  # dgu, gu as [M, 2, I]
        two = cute.sym_int()
        out0, out1 = _fake_3d(cutlass.BFloat16, m, two, n), _fake_3d(cutlass.BFloat16, m, two, n)
    hq = hs = None
    if mx_h:  # hq [M, I/4] u32 words, hs [M, I/32] bytes
        hq = _fake_2d(cutlass.Uint32, m, cute.sym_int())
        hs = cute.runtime.make_fake_tensor(cutlass.Uint8, (m, cute.sym_int()), stride=(cute.sym_int64(), 1),
                                           assumed_align=4)
    bias = TileBias()
    if biased and epilogue == "swiglu":
        bias = TileBias(fake_bias(ab, e, inter), fake_bias(ab, e, inter))
    elif biased:
        bias = TileBias(down=fake_bias(ab, e, n))
    stream = cute.runtime.make_fake_stream()
    return compile_kernel(op, mA, mB, mB2, offs, out0, out1, hq, hs, bias, Float32(0.0), Int32(1), stream,
                          arch=arch, inspect=inspect)


# ---------------------------------------------------------------- host wrappers
DEFAULT_CONFIG = MainloopConfig()


def swiglu_helpers(epilogue: str, mx_h: bool, k: int, tile_n: int = HELPERS_TILE_N) -> bool:
    """Whether a launch of ``epilogue`` with ``mx_h``, reduction depth ``k`` and ``tile_n`` runs the helper-warp
    variant: BF16 GEMM1 + SwiGLU without the MXFP8 h copy from K = :data:`HELPERS_MIN_K` (see the module doc), at
    tile_n :data:`HELPERS_TILE_N` (the helper lanes span its half tile)."""
    return epilogue == "swiglu" and not mx_h and k >= HELPERS_MIN_K and tile_n == HELPERS_TILE_N


def _check_operands(a, offsets, weights: dict, a_name: str = "a"):
    """Validate A [M, K], offsets [E+1], weights [E, N, K] (not devices); returns (M, K, E)."""
    _check_tensor(a_name, a, 2, (torch.bfloat16,))
    _check_tensor("offsets", offsets, 1, (torch.int32, torch.int64))
    m, k = a.shape
    if k % _VEC or k == 0:
        raise ValueError(f"{a_name}: K={k} must be a positive multiple of {_VEC}")
    if not a.is_contiguous() or a.data_ptr() % 16:
        raise ValueError(f"{a_name} must be contiguous (row-major, K contiguous) and 16-byte aligned")
    e = offsets.numel() - 1
    if e < 1:
        raise ValueError(f"offsets must hold E+1 >= 2 entries, got {offsets.numel()}")
    for name, w in weights.items():
        _check_tensor(name, w, 3, (torch.bfloat16,))
        if w.shape[0] != e or w.shape[2] != k:
            raise ValueError(f"{name} must be [E={e}, N, K={k}], got {tuple(w.shape)}")
        if not tma_weight(w):
            raise ValueError(f"{name} must be [E, N, K] with K contiguous, 16-byte strides that do not overlap and "
                             f"16-byte alignment (contiguous, or e.g. a half of an [E, 2N, K] tensor), got strides "
                             f"{w.stride()}")
    return m, k, e


def _launch(epilogue: str, cfg: MainloopConfig, a, w, offsets, outs: GemmOutputs, n: int, act=None,
            b_major: str = K_MAJOR, w2=None, bias: TileBias = TileBias()):
    """Compile (once per variant) and launch one grouped GEMM on the current stream; ``outs``: the
    :class:`GemmOutputs` torch tensors (``hq``/``hs``, swiglu only: the MXFP8 copy of h as int32 words
    [M, I/4] and uint8 scales [M, I/32]); ``n`` is the N extent tiled by ``cfg.tile_n``; ``act``: the (d)SwiGLU's
    activation argument (None, a limit L or a SwiGLU: :func:`~mok_cute.kernels.swiglu_math.swiglu_args`, which
    gives the compile-time clamp and alpha / up offset and the runtime limit); ``bias``: the expert biases' bf16 torch
    tensors (:class:`~mok_cute.kernels.sm90.bias.TileBias`: swiglu ``gate`` and ``up``, plain ``down``; all None:
    none). Launches replay a captured graph per argument set (:mod:`mok_cute.dsl.launch`)."""
    dev, arch = device_arch(a.device)
    if arch != "sm_90a":
        raise ValueError(f"a: the SM90 grouped GEMM needs an sm_90a device, got {arch}")
    clamp, gated, limit = swiglu_args(act)
    split_b = w2 is not None and epilogue != "swiglu"  # swiglu: w2 = w_up, stacked along N
    mx_h = outs.hq is not None
    n_tail = n % cfg.tile_n != 0  # a partial last n-tile: the masked variant
    helpers = swiglu_helpers(epilogue, mx_h, a.shape[1], cfg.tile_n)
    biased = any(b is not None for b in bias)
    launcher = compile_cached(
        ("sm90_grouped_gemm", arch, epilogue, clamp, b_major, split_b, mx_h, n_tail, helpers, gated, cfg.key())
        + (("biased",) if biased else ()),
        lambda: GraphLauncher(compile_grouped_gemm(epilogue, clamp=clamp, cfg=cfg, b_major=b_major,
                                                   split_b=split_b, mx_h=mx_h, n_tail=n_tail, helpers=helpers,
                                                   gated=gated, biased=biased, arch=arch)[0]))
    m, e = a.shape[0], offsets.numel() - 1
    tiles_bound = (-(-m // cfg.tile_m) + e) * -(-n // cfg.tile_n)
    num_ctas = max(1, min(sm_count(dev), tiles_bound))
    offs32 = offsets_i32(offsets)
    key = (tensor_key(a), tensor_key(w), None if w2 is None else tensor_key(w2), offs32.data_ptr(), offs32.shape,
           tensor_key(outs.out0), tensor_key(outs.out1), limit, num_ctas) + (
               (tensor_key(outs.hq), tensor_key(outs.hs)) if mx_h else ()) + tuple(
               tensor_key(b) for b in bias if b is not None)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda stream: (
        _Desc(a), _Desc(w), None if w2 is None else _Desc(w2), _Desc(offs32),
        *(None if t is None else _Desc(t) for t in outs), TileBias(*(None if b is None else _Desc(b) for b in bias)),
        Float32(limit), Int32(num_ctas), stream))


def grouped_gemm(a, offsets, w, *, out=None, cfg: MainloopConfig = DEFAULT_CONFIG):
    """out [M, N] bf16: rows offsets[e]..offsets[e+1] = bf16(a_e @ w[e]^T) (FP32 accumulate).

    a [M, K] bf16 contiguous; offsets [E+1] int32/int64 on the device (0, non-decreasing,
    last = M; not checked); w [E, N, K] bf16 contiguous, N a multiple of ``N_ALIGN`` (64);
    ``out``: optional preallocated [M, N] bf16 result (every row is written).
    """
    m, _, _ = _check_operands(a, offsets, {"w": w})
    n = w.shape[1]
    if n % N_ALIGN:
        raise ValueError(f"w: N={n} must be a multiple of {N_ALIGN}")
    out = _check_out("out", out, (m, n), a.device)
    _check_devices(a=a, offsets=offsets, w=w, out=out)
    return _run_gemm(a, offsets, w, out, cfg)


def _run_gemm(a, offsets, w, out=None, cfg: MainloopConfig = DEFAULT_CONFIG, bias=None):
    """:func:`grouped_gemm` on operands already validated (no checks; ``out`` None allocates); ``bias``: None
    or [E, N] bf16 with a unit last stride, added to each row of expert e before the rounding (the reference's
    ``grouped_gemm(..., bias=)``)."""
    m, n = a.shape[0], w.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m:
        _launch("plain", cfg, a, w, offsets, GemmOutputs(out, out), n, bias=TileBias(down=bias))
    return out


def grouped_gemm1_swiglu(x, offsets, w_gate, w_up, limit=None, *, out=None, cfg: MainloopConfig = DEFAULT_CONFIG):
    """(gu [M, 2I], h [M, I]) bf16 for expert rows of x [M, H]: gu = bf16(x_e @ [w_gate[e]; w_up[e]]^T)
    (gate in columns [0, I), up in [I, 2I)); h = bf16(silu(g) * u) in FP32 from the bf16 g, u,
    with g = min(g, limit), u = clamp(u, -limit, limit) when ``limit`` is given. ``limit``: None, L, or a
    :class:`~mok_cute.reference.SwiGLU` (its limit, alpha and up offset: h = bf16(g * sigmoid(a * g) * (u + o))).

    w_gate, w_up [E, I, H] bf16 contiguous, I a multiple of ``N_ALIGN`` (64); read in place
    (each B tile is tile_n/2 gate rows stacked on the matching up rows by two TMA loads).
    ``out``: optional preallocated ``(gu, h)``.
    """
    m, _, _ = _check_operands(x, offsets, {"w_gate": w_gate, "w_up": w_up}, a_name="x")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_up shape {tuple(w_up.shape)} must equal w_gate shape {tuple(w_gate.shape)}")
    inter = w_gate.shape[1]
    if inter % N_ALIGN:
        raise ValueError(f"w_gate: I={inter} must be a multiple of {N_ALIGN}")
    _check_limit(limit)
    gu, h = (None, None) if out is None else out
    gu = _check_out("gu", gu, (m, 2 * inter), x.device)
    h = _check_out("h", h, (m, inter), x.device)
    _check_devices(x=x, offsets=offsets, w_gate=w_gate, w_up=w_up, gu=gu, h=h)
    return _run_gemm1_swiglu(x, offsets, w_gate, w_up, limit, gu, h, cfg)


def _run_gemm1_swiglu(x, offsets, w_gate, w_up, limit, gu=None, h=None, cfg: MainloopConfig = DEFAULT_CONFIG,
                      mx_h: bool = False, bias=None):
    """:func:`grouped_gemm1_swiglu` on operands already validated (no checks); with ``mx_h``
    returns ``(gu, h, hq, hs)``: also h's MXFP8 copy along I (data e4m3 [M, I], scales uint8
    [M, I/32], bitwise ``reference.mxfp8_quantize(h, -1)`` on rows < offsets[E]). ``bias``: None or
    ``(b_gate, b_up)`` [E, I] bf16 each (unit last stride), added to g and u before their rounding."""
    m, inter = x.shape[0], w_gate.shape[1]
    if gu is None:
        gu = torch.empty((m, 2 * inter), dtype=torch.bfloat16, device=x.device)
    if h is None:
        h = torch.empty((m, inter), dtype=torch.bfloat16, device=x.device)
    hq = hs = None
    if mx_h:
        hq = torch.empty((m, inter), dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty((m, inter // MX_BLOCK), dtype=torch.uint8, device=x.device)
    if m:
        outs = GemmOutputs(gu.view(m, 2, inter), h, None if hq is None else hq.view(torch.int32), hs)
        _launch("swiglu", cfg, x, w_gate, offsets, outs, 2 * inter, limit, w2=w_up,
                bias=TileBias() if bias is None else TileBias(*bias))
    return (gu, h, hq, hs) if mx_h else (gu, h)

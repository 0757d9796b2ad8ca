"""Blackwell (sm_100a / sm_103a) persistent grouped expert GEMMs, BF16 and MXFP8, no host sync.

Same operand and offsets contract as :mod:`mok_cute.kernels.sm90.grouped_gemm` and
:mod:`mok_cute.kernels.sm90.expert_bwd` (offsets int32 [E+1] on the device, offsets[0] = 0,
non-decreasing, offsets[E] = M_total, trusted), on the :mod:`sm100.mainloop` (TMA warp,
tcgen05 MMA warp, TMEM accumulators, four epilogue warps). One compiled kernel serves every
token count; the compile cache key holds arch, dtype, tile shape, majorness, split B,
epilogue, clamp and the gated SwiGLU's constants (:mod:`mok_cute.kernels.swiglu_math`).
Tiles are scheduled by :mod:`mok_cute.schedule.group_tiles` (grid = SMs; with
``cta_group::2`` a cluster of two CTAs takes one tile, clusters stride over the tiles).

Grouped GEMM (``A [M, K]`` token rows, ``B`` per-expert weights ``[E, N, K]`` K-major or
``[E, K, N]`` MN-major):
  ``plain``:   out [M, N] = bf16(A_e @ B_e); with split K (dgrad1: A = dgu = [dg | du], B =
               [w_gate; w_up] along K, MN-major) A's and B's two parts have their own TMA
               descriptors, switched at the k-tile k1 = ceil(I / tile_k), into one FP32 TMEM
               accumulator (no concatenated copy; each part's K tail is zero-filled).
  ``swiglu``:  B = :func:`interleave_gate_up` (w_gate, w_up; I padded to tile_n/2 with zero
               rows); gu [M, 2I] (gate cols [0, I), up [I, 2I)) and h [M, I] = bf16(silu(g) * u)
               from the bf16 g, u in FP32, optional clamp L: g = min(g, L), u = clamp(u, -L, L);
               gated (alpha a, up offset o): h = bf16(g * sigmoid(a * g) * (u + o)) (as the SM90 epilogue).
  ``dswiglu``: N = I, the FP32 accumulator dh (never rounded) meets g, u read from gu:
               dgu = bf16([dg | du]) (formula of :func:`mok_cute.reference.dswiglu`).
Expert biases (``biased``, BF16 ``plain`` and ``swiglu`` only; gpt-oss): the epilogue adds fp32(b[e, n]) to the
FP32 accumulator before it rounds (swiglu: b_gate to g's and b_up to u's columns, before the SwiGLU reads them;
plain: b_down), :mod:`mok_cute.kernels.sm100.bias`.
N tails: N (H or I) need only be a multiple of :data:`EPI_N` (32); the tile count over N
rounds up, TMA zero-fills B's rows past N (B is viewed 3-D per expert) and the epilogues
store (dswiglu: also read) only the 32-column chunks inside N. K tails are zero-filled too
(MXFP8: with zero scales from the padded blocked layouts).
Weight gradient: dW[e] = bf16(a_e^T . b_e), a [M, Na], b [M, Nb] token-row-major, column
slices allowed (read MN-major, K = the expert's tokens in order through the ragged TMA view of
:mod:`sm90.expert_bwd`: no split-K, no atomics, bitwise reproducible; empty experts get 0).

MXFP8 (``ab_dtype=Float8E4M3FN``): operands are e4m3 data plus flat uint8 E8M0 scale buffers
in the layouts of :mod:`mok_cute.kernels.sm100.layouts`: token-row A scales grouped per
expert (:func:`~sm100.layouts.pack_row_scales`), weight scales ``to_blocked`` per expert
(B viewed (N, K): [E, N_pad * K_pad / 32]; MN-major weights via
:func:`~sm100.layouts.pack_kn_weight_scales`; split K: one matrix over both parts, each
part's blocks padded to whole 128-element k-tiles, :func:`~sm100.layouts.pad_k_parts`),
wgrad scales along tokens
(:func:`~sm100.layouts.pack_token_scales`). Stores are row- and column-masked 16-byte vectors
straight from registers (rows past an expert's end and columns past N are computed, never
written).
"""
from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass import Float32, Int32

from mok_cute.comm.combine import add_rn
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.kernels.sm100.bias import add_bias, check_bias, fake_bias, load_bias
from mok_cute.kernels.sm100.bundles import ExpertBias
from mok_cute.dsl.compile import arch_of_device, compile_cached, compile_kernel
from mok_cute.kernels.sm90.expert_bwd import _expert_k, _ragged_k
from mok_cute.dsl.tensors import _cute_tensor, _fake_2d, _fake_3d
from mok_cute.dsl.host import (
    _FP8, _check_devices, _check_limit, _check_offsets, _check_out, _check_tensor, check_wgrad_operands, offsets_i32,
    sm_count, wgrad_out,
)
from mok_cute.kernels.sm100.mainloop import (
    EPI_N, EPI_THREADS, K_MAJOR, MMA_WARP, MN_MAJOR, NUM_THREADS, SF_DTYPE, TMA_WARP, AccChunks, Sm100Config,
    Sm100Mainloop, epi_barrier, tmem_load,
)
from mok_cute.kernels.swiglu_math import Gated, dswiglu, swiglu_, swiglu_args
from mok_cute.schedule.group_tiles import seek, tile_coords, wgrad_tile

ARCHS = ("sm_100a", "sm_103a")
EPILOGUES = ("plain", "swiglu", "dswiglu")
_VEC = 16  # byte alignment of rows / strides (TMA)


def _bf16(r: cute.Tensor) -> cute.Tensor:
    out = cute.make_rmem_tensor_like(r, cutlass.BFloat16)
    out.store(r.load().to(cutlass.BFloat16))
    return out


_BF16_OPS = Fp8Ops(bf16=True)  # (a module global: a local object may not cross a run-time loop)


@cute.jit
def _mxfp8_block(r: cute.Tensor):
    """``(e4m3 registers shaped like r, E8M0 scale byte)`` of one MX block, the 32 bf16 values
    ``r`` of one thread: the ops of the MXFP8 row quantizer (:mod:`mok_cute.kernels.quant.quantize`:
    amax of the |x| bit patterns, :meth:`Fp8Ops.e8m0`, ``mul.rn.f32`` + ``cvt.rn.satfinite``;
    NaN / Inf blocks get 0xFF and 0x7F), so bitwise its output on the same values."""
    ops = _BF16_OPS
    words = cute.recast_tensor(r, cutlass.Uint32)
    n = cute.size(words)
    acc = None
    for j in cutlass.range_constexpr(n):
        acc = ops.amax_acc(acc, words[j])
    a = ops.umax(acc & cutlass.Uint32(0xFFFF), acc >> 16)
    sc, byte, nf = ops.e8m0(Int32(a) << 16)
    elems = []
    for j in cutlass.range_constexpr(n // 4):
        elems += ops.elems([words[4 * j + i] for i in range(4)])
    o = ops.fp8_words(elems, [sc] * len(elems), [nf] * (n // 2))
    q = cute.make_rmem_tensor_like(r, cutlass.Float8E4M3FN)
    qw = cute.recast_tensor(q, cutlass.Uint32)
    for j in cutlass.range_constexpr(n // 2):
        qw[j] = o[j]
    return q, cutlass.Uint8(byte)


@cute.jit
def _mxfp8_tokens(r: cute.Tensor, valid, lane: Int32):
    """``(e4m3 registers shaped like r, E8M0 scale byte of column lane)``: MXFP8 along tokens of
    one 32-row block held by a warp, lane l's row in ``r`` (32 bf16 values, one per column; rows
    with ``valid`` false count as 0, the quantizer's zero padding): the ops of the token quantizer
    (``reference.mxfp8_quantize_tokens``: per column the amax of the |x| bit patterns, then
    :meth:`Fp8Ops.e8m0`, ``mul.rn.f32`` + ``cvt.rn.satfinite``, NaN / Inf columns 0xFF and 0x7F),
    so bitwise its output. The column amaxes (``max.u16x2`` on |x| word pairs) are a warp
    reduce-scatter (16 butterfly shuffles: lanes 2w, 2w+1 end with word w, columns 2w, 2w+1);
    lane l computes column l's byte, four lanes pack theirs into a word (2 shuffles) and each
    output word reads its columns' bytes back (8 indexed shuffles), the multiplier 2^-e being
    ``(254 - byte) << 23`` (e8m0's; a 0xFF column's bytes are masked to 0x7F)."""
    ops = _BF16_OPS
    words = cute.recast_tensor(r, cutlass.Uint32)
    n = cute.size(words)
    cur = [cutlass.select_(valid, words[j] & cutlass.Uint32(0x7FFF7FFF), cutlass.Uint32(0))
           for j in range(n)]
    for st in cutlass.range_constexpr(5):  # offsets 16 .. 1: keep the half this lane's bit selects
        off = 16 >> st
        upper = (lane & off) != 0
        half = len(cur) // 2
        if cutlass.const_expr(half == 0):
            cur = [ops.wmax(cur[0], cute.arch.shuffle_sync_bfly(cur[0], offset=off))]
        else:
            nxt = []
            for j in cutlass.range_constexpr(half):
                keep = cutlass.select_(upper, cur[j + half], cur[j])
                send = cutlass.select_(upper, cur[j], cur[j + half])
                nxt.append(ops.wmax(keep, cute.arch.shuffle_sync_bfly(send, offset=off)))
            cur = nxt
    mine = cur[0]  # amax word lane // 2
    _, own, _ = ops.e8m0(Int32(cutlass.select_((lane & 1) != 0, mine & cutlass.Uint32(0xFFFF0000), mine << 16)))
    packed = cutlass.Uint32(own) << (8 * (lane & 3))  # then lanes 4g .. 4g+3: the bytes of columns 4g ..
    for b in cutlass.range_constexpr(2):
        packed = packed | cute.arch.shuffle_sync_bfly(packed, offset=1 << b)
    q = cute.make_rmem_tensor_like(r, cutlass.Float8E4M3FN)
    qw = cute.recast_tensor(q, cutlass.Uint32)
    for w in cutlass.range_constexpr(n // 2):  # output word w: columns 4w .. 4w+3, input words 2w, 2w+1
        bw = cute.arch.shuffle_sync(packed, offset=4 * w)
        scs = []
        nan = cutlass.Uint32(0)
        for i in cutlass.range_constexpr(4):  # 2^-e of byte b (e8m0's multiplier; 0xFF: NaN / Inf, masked)
            byte = (bw >> (8 * i)) & cutlass.Uint32(0xFF)
            scs.append((cutlass.Uint32(254) - byte) << 23)
            nan = nan | cutlass.select_(byte == cutlass.Uint32(0xFF), cutlass.Uint32(0xFF << (8 * i)),
                                        cutlass.Uint32(0))
        f = []
        for h in cutlass.range_constexpr(2):  # fp32 bits of the words' bf16 (low half first)
            f += [words[2 * w + h] << 16, words[2 * w + h] & cutlass.Uint32(0xFFFF0000)]
        qw[w] = ops.fp8x4(f, scs, nan)
    return q, cutlass.Uint8(own)


def _shared_storage(ab, stages: int, acc_stages: int, a_n: int, b_n: int, sf_n=None):
    """The kernel's shared storage struct: pipeline barriers, the TMEM pointer, 1024-aligned
    A/B stages and, for MXFP8 (``sf_n`` = (SFA, SFB) sizes), the scale factor stages."""
    fields = {
        "ab_bar": cute.struct.MemRange[cutlass.Int64, 2 * stages],
        "acc_bar": cute.struct.MemRange[cutlass.Int64, 2 * acc_stages],
        "tmem_dealloc_bar": cutlass.Int64,
        "tmem_ptr": cutlass.Int32,
        "sA": cute.struct.Align[cute.struct.MemRange[ab, a_n], 1024],
        "sB": cute.struct.Align[cute.struct.MemRange[ab, b_n], 1024],
    }
    if sf_n is not None:
        fields["sSFA"] = cute.struct.Align[cute.struct.MemRange[SF_DTYPE, sf_n[0]], 1024]
        fields["sSFB"] = cute.struct.Align[cute.struct.MemRange[SF_DTYPE, sf_n[1]], 1024]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


class GroupedGemmSm100:
    """Persistent warp-specialized grouped GEMM (``wgrad=False``) or weight gradient (``True``).

    Call (jit), grouped: ``(mA [M, K], mB, mB2, mSFA, mSFB, mOffsets [E+1] int32, mOut0,
    mOut1, bias, limit, num_ctas, stream)``: ``mB`` [E, N, K] (``b_major="k"``) or [E, K, N]
    (``"mn"``); ``split_k``: ``mA`` [M, 2, K1] and ``mB`` [E, K1, N], ``mB2`` [E, K1, N] are
    A's and B's two parts along K (four TMA descriptors; MXFP8 scales padded per part to
    whole k-tiles), else ``mB2`` None; plain: ``mOut0`` = out [M, N] (``mOut1`` = mOut0);
    swiglu: B's N = 2 I_p (I_p = I padded to tile_n/2), gu [M, 2, I], h [M, I]; dswiglu: dgu,
    gu [M, 2, N]. Wgrad: ``(mA [M, Na], mB [M, Nb], None, mSFA, mSFB, mOffsets, mOut [E, Na,
    Nb], mOut, limit, num_ctas, stream)``. ``mSFA``/``mSFB``: flat uint8 scale buffers
    (MXFP8; SFB over the whole K) or None. N (Nb, I) a multiple of :data:`EPI_N`, tiles over
    it round up; ``num_ctas`` a multiple of the cluster size. ``clamp``, ``gated``: the (d)SwiGLU's compile-time
    switches (:mod:`mok_cute.kernels.swiglu_math`). ``biased`` (BF16 plain with K-major B, swiglu): ``bias`` an
    :class:`~mok_cute.kernels.sm100.bundles.ExpertBias` (swiglu: gate, up [E, I]; plain: down [E, N]) added to the
    accumulators before the epilogue rounds them (:mod:`~mok_cute.kernels.sm100.bias`); else None. Wgrad: ``bias``
    None too.
    """

    def __init__(self, cfg: Sm100Config, epilogue: str = "plain", clamp: bool = False, b_major: str = K_MAJOR,
                 wgrad: bool = False, split_k: bool = False, gated: Gated | None = None, biased: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if biased and (wgrad or split_k or epilogue == "dswiglu" or b_major != K_MAJOR):
            raise ValueError("biased (expert biases): the plain epilogue with K-major B and the swiglu epilogue only")
        if biased and cfg.mx:
            raise ValueError("biased (expert biases): BF16 only, not MXFP8")
        if wgrad and epilogue != "plain":
            raise ValueError("wgrad has the plain epilogue only")
        if split_k and (wgrad or b_major != MN_MAJOR):
            raise ValueError("split_k needs b_major='mn' (and no wgrad)")
        if epilogue == "swiglu" and (cfg.tile_n // 2) % EPI_N:
            raise ValueError(f"swiglu needs tile_n a multiple of {2 * EPI_N}, got {cfg.tile_n}")
        self.cfg, self.epilogue, self.clamp, self.wgrad, self.split_k = cfg, epilogue, clamp, wgrad, split_k
        self.gated, self.biased = gated, biased
        self.b_major = MN_MAJOR if wgrad else b_major
        self.mainloop = Sm100Mainloop(cfg, a_major=MN_MAJOR if wgrad else K_MAJOR, b_major=self.b_major)

    # ------------------------------------------------------------ launcher
    def _views(self, mA, mB, mSFA, mSFB, num_experts):
        """(M|N, K, L) views of A (split K: its first part), B and, for MXFP8, the blocked scale
        tensors (SFB over A's K; split K: both parts, each padded to whole k-tiles)."""
        cfg = self.cfg
        sfa = sfb = None
        if cutlass.const_expr(self.wgrad):
            a = _ragged_k(mA)
            b = _ragged_k(mB)
            if cutlass.const_expr(cfg.mx):
                k_sf = (mA.shape[0] + (lay.SF_ATOM_ROWS - 1)) // lay.SF_ATOM_ROWS * lay.SF_ATOM_ROWS \
                    + lay.SF_ATOM_ROWS * num_experts
                sfa = self._sf(mSFA, (mA.shape[1], k_sf, 1))
                sfb = self._sf(mSFB, (mB.shape[1], k_sf, 1))
        else:
            a = self._rows(mA[(None, 0, None)] if cutlass.const_expr(self.split_k) else mA)
            modes = [1, 2, 0] if self.b_major == K_MAJOR else [2, 1, 0]
            b = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=modes))
            if cutlass.const_expr(cfg.mx):
                m_sf = (mA.shape[0] + (lay.SF_ATOM_ROWS - 1)) // lay.SF_ATOM_ROWS * lay.SF_ATOM_ROWS \
                    + lay.SF_ATOM_ROWS * num_experts
                k_sf = mA.shape[1]
                if cutlass.const_expr(self.split_k):
                    k_sf = 2 * ((mA.shape[2] + (cfg.tile_k - 1)) // cfg.tile_k * cfg.tile_k)
                sfa = self._sf(mSFA, (m_sf, k_sf, 1))
                sfb = self._sf(mSFB, (b.shape[0], k_sf, b.shape[2]))
        return a, b, sfa, sfb

    @staticmethod
    def _rows(t: cute.Tensor) -> cute.Tensor:
        """(M, K) token rows -> the (M, K, 1) view TMA reads."""
        return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))

    @staticmethod
    def _sf(flat: cute.Tensor, shape):
        return cute.make_tensor(cute.recast_ptr(flat.iterator, dtype=SF_DTYPE),
                                blockscaled.tile_atom_to_shape_SF(shape, lay.SF_VEC))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mB2: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor,
                 mOffsets: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor, bias: ExpertBias, limit: Float32,
                 num_ctas: Int32, stream: cuda.CUstream):
        ml, cfg = self.mainloop, self.cfg
        ml.setup()
        a2 = b2 = None
        if cutlass.const_expr(self.split_k):
            a2 = self._rows(mA[(None, 1, None)])
            b2 = cute.make_tensor(mB2.iterator, cute.select(mB2.layout, mode=[2, 1, 0]))
        tmas = ml.make_tma(*self._views(mA, mB, mSFA, mSFB, mOffsets.shape[0] - 1), mA2=a2, mB2=b2)
        ab, stages, acc_stages = cfg.ab_dtype, ml.stages, ml.acc_stages
        a_n, b_n = cute.cosize(ml.a_smem.outer), cute.cosize(ml.b_smem.outer)

        sf_n = None
        if cutlass.const_expr(cfg.mx):
            sf_n = (cute.cosize(ml.sfa_smem), cute.cosize(ml.sfb_smem))
        self.shared_storage = _shared_storage(ab, stages, acc_stages, a_n, b_n, sf_n)
        atoms = [t[0] for t in tmas]
        coords = [t[1] for t in tmas]
        self.kernel(atoms, coords, mOffsets, mOut0, mOut1, bias, limit).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[cfg.cta_group, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------ schedule
    @cute.jit
    def _advance(self, mOffsets: cute.Tensor, num_experts: Int32, n_tiles: Int32, total: Int32, linear: Int32,
                 expert: Int32, base: Int32):
        """Move the cursor to tile ``linear``; returns ``(expert, base, valid)``."""
        if cutlass.const_expr(self.wgrad):
            return expert, base, linear < total
        e, b = seek(mOffsets, num_experts, self.cfg.tile_m, n_tiles, linear, expert, base)
        return e, b, e < num_experts

    @cute.jit
    def _coords(self, mOffsets: cute.Tensor, linear: Int32, expert: Int32, base: Int32, m_tiles: Int32,
                n_tiles: Int32, k_tiles: Int32, na: Int32):
        """``(expert, m_tile, n_tile, row0, rows, k_tiles, sf_tile, lo, length)`` of a valid tile.

        Grouped: row0/rows = the tile's first global token row and rows inside the expert,
        ``sf_tile`` = the scale atom row of the tile (``o_e // 128 + e + m_tile * tile_m / 128``). Wgrad: row0/rows
        = output rows of dW[e] (masked at Na), ``sf_tile`` = first scale atom column of the
        expert's tokens, ``lo``/``length`` = the expert's token rows.
        """
        cfg = self.cfg
        if cutlass.const_expr(self.wgrad):
            e, m_tile, n_tile = wgrad_tile(linear, m_tiles, n_tiles)
            lo = mOffsets[e]
            length = mOffsets[e + 1] - lo
            row0 = m_tile * cfg.tile_m
            kt = cutlass.max((length + (cfg.tile_k - 1)) // cfg.tile_k, 1)
            return e, m_tile, n_tile, row0, na - row0, kt, lo // lay.SF_ATOM_ROWS + e, lo, length
        m_tile, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
        lo = mOffsets[expert]
        atom_row = lo // lay.SF_ATOM_ROWS + expert + m_tile  # 128-row scale atoms (cta_group::2: 2 per tile)
        if cutlass.const_expr(cfg.tile_m != lay.SF_ATOM_ROWS):
            atom_row = lo // lay.SF_ATOM_ROWS + expert + m_tile * (cfg.tile_m // lay.SF_ATOM_ROWS)
        return expert, m_tile, n_tile, row0, rows, k_tiles, atom_row, lo, rows

    # ------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, atoms: list, coords: list, mOffsets: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor,
               bias: ExpertBias, limit: Float32):
        cfg = self.cfg
        self.mainloop.setup()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        cta_v = bidx % cfg.cta_group
        if warp == TMA_WARP:
            for atom in atoms:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        atoms2 = coords2 = None
        if cutlass.const_expr(self.split_k):  # A's and B's second parts along K: last in the lists
            atoms2, coords2 = atoms[-2:], coords[-2:]
            atoms, coords = atoms[:-2], coords[:-2]

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipe, acc_pipe = self.mainloop.make_pipelines(storage)
        tmem = self.mainloop.make_tmem_allocator(storage)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(cfg.cta_group, 1), is_relaxed=True)
        sA, sB, sSFA, sSFB = self.mainloop.smem_tensors(storage)
        pipeline.pipeline_init_wait(cluster_shape_mn=(cfg.cta_group, 1))

        num_experts = mOffsets.shape[0] - 1
        coord_b = coords[1]
        na = Int32(0)
        m_tiles = Int32(0)
        total = Int32(0)
        k_tiles = Int32(0)
        k_tiles1 = None
        if cutlass.const_expr(self.wgrad):
            na = coords[0].shape[0]
            m_tiles = (na + (cfg.tile_m - 1)) // cfg.tile_m
        else:
            k_tiles = (coords[0].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
            if cutlass.const_expr(self.split_k):
                k_tiles1 = k_tiles
                k_tiles = k_tiles1 + (coords2[0].shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        n_tiles = (coord_b.shape[0] + (cfg.tile_n - 1)) // cfg.tile_n
        if cutlass.const_expr(self.wgrad):
            total = num_experts * m_tiles * n_tiles
        linear0 = Int32(bidx // cfg.cta_group)
        stride = Int32(grid // cfg.cta_group)

        if warp == TMA_WARP:
            masks = self.mainloop.mcast_masks(cta_v)
            tiler_a = (cfg.tile_m, cfg.tile_k)
            tiler_b = (cfg.tile_n, cfg.tile_k)
            # grouped: B (and the scale tensors) tiled once, A per tile (row starts vary);
            # wgrad: A and B per tile (the expert's token range is the K extent)
            tBsB, tBgB_all = sB, None
            if cutlass.const_expr(not self.wgrad):
                tBsB, tBgB_all = self.mainloop.partition_b(
                    atoms[1], cute.local_tile(coord_b, tiler_b, (None, None, None)), sB, cta_v)
            tBgB2_all = None
            if cutlass.const_expr(self.split_k):
                _, tBgB2_all = self.mainloop.partition_b(
                    atoms2[1], cute.local_tile(coords2[1], tiler_b, (None, None, None)), sB, cta_v)
            sf_src = None
            if cutlass.const_expr(cfg.mx):
                tAsSFA, tAgSFA_all = self.mainloop.partition_a(
                    atoms[2], cute.local_tile(coords[2], tiler_a, (None, None, None)), sSFA, cta_v)
                tBsSFB, tBgSFB_all = self.mainloop.partition_sfb(
                    atoms[3], cute.local_tile(coords[3], tiler_b, (None, None, None)), sSFB, cta_v)
                sf_src = (tAgSFA_all, tBgSFB_all)
            state = self.mainloop.producer_state()
            linear = linear0
            expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, Int32(0), Int32(0))
            while valid:
                e, m_tile, n_tile, row0, _, kt, sf_tile, lo, length = self._coords(
                    mOffsets, linear, expert, base, m_tiles, n_tiles, k_tiles, na)
                part2 = None
                if cutlass.const_expr(self.wgrad):
                    gA = cute.local_tile(_expert_k(coords[0], lo, length), tiler_a, (m_tile, None))
                    gB = cute.local_tile(_expert_k(coord_b, lo, length), tiler_b, (n_tile, None))
                    sB_t, tBgB = self.mainloop.partition_b(atoms[1], gB, sB, cta_v)
                else:
                    sB_t = tBsB
                    gA = cute.local_tile(cute.domain_offset((row0, 0), coords[0][(None, None, 0)]), tiler_a, (0, None))
                    tBgB = tBgB_all[(None, n_tile, None, e)]
                    if cutlass.const_expr(self.split_k):
                        gA2 = cute.local_tile(cute.domain_offset((row0, 0), coords2[0][(None, None, 0)]), tiler_a,
                                              (0, None))
                        _, tAgA2 = self.mainloop.partition_a(atoms2[0], gA2, sA, cta_v)
                        part2 = (atoms2, (tAgA2, tBgB2_all[(None, n_tile, None, e)]), k_tiles1)
                tAsA, tAgA = self.mainloop.partition_a(atoms[0], gA, sA, cta_v)
                srcs, dsts, sf_k0 = (tAgA, tBgB), (tAsA, sB_t), Int32(0)
                if cutlass.const_expr(cfg.mx):
                    dsts = dsts + (tAsSFA, tBsSFB)
                    if cutlass.const_expr(self.wgrad):  # sf_tile: the expert's first scale k-tile
                        srcs = srcs + (sf_src[0][(None, m_tile, None, 0)], sf_src[1][(None, n_tile, None, 0)])
                        sf_k0 = sf_tile
                    elif cutlass.const_expr(cfg.tile_m == lay.SF_ATOM_ROWS):  # sf_tile: the tile's scale atom row
                        srcs = srcs + (sf_src[0][(None, sf_tile, None, 0)], sf_src[1][(None, n_tile, None, e)])
                    else:  # a 256-row tile may start at an odd 128-row atom: offset, then tile
                        gSFA = cute.local_tile(cute.domain_offset((sf_tile * lay.SF_ATOM_ROWS, 0),
                                                                  coords[2][(None, None, 0)]), tiler_a, (0, None))
                        _, tAgSFA = self.mainloop.partition_a(atoms[2], gSFA, sSFA, cta_v)
                        srcs = srcs + (tAgSFA, sf_src[1][(None, n_tile, None, e)])
                state = self.mainloop.load_tile(ab_pipe, state, atoms, srcs, dsts, kt, sf_k0, masks, part2)
                linear = linear + stride
                expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, expert, base)
            ab_pipe.producer_tail(state)

        if warp == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            acc = self.mainloop.acc_tensor(acc_ptr)
            tCrA, tCrB, sf = self.mainloop.mma_fragments(sA, sB, sSFA, sSFB, acc_ptr)
            tiled_mma = self.mainloop.make_tiled_mma()
            state = self.mainloop.consumer_state()
            acc_state = self.mainloop.acc_producer_state()
            linear = linear0
            expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, Int32(0), Int32(0))
            while valid:
                _, _, _, _, _, kt, _, _, _ = self._coords(mOffsets, linear, expert, base, m_tiles, n_tiles, k_tiles, na)
                if cta_v == 0:
                    acc_pipe.producer_acquire(acc_state)
                    state, tiled_mma = self.mainloop.mma_tile(tiled_mma, ab_pipe, state, tCrA, tCrB, sf,
                                                              acc[(None, None, None, acc_state.index)], kt)
                    acc_pipe.producer_commit(acc_state)
                acc_state.advance()
                linear = linear + stride
                expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, expert, base)
            acc_pipe.producer_tail(acc_state)

        if warp < MMA_WARP:
            tmem.allocate(self.mainloop.tmem_alloc)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            acc = self.mainloop.acc_tensor(acc_ptr)
            acc_state = self.mainloop.acc_consumer_state()
            linear = linear0
            expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, Int32(0), Int32(0))
            while valid:
                e, _, n_tile, row0, rows, _, _, _, _ = self._coords(
                    mOffsets, linear, expert, base, m_tiles, n_tiles, k_tiles, na)
                acc_pipe.consumer_wait(acc_state)
                chunks = AccChunks(acc[(None, None, None, acc_state.index)], tidx)
                # this CTA's 128 rows of the tile
                crow0 = row0 + cta_v * EPI_THREADS
                crows = rows - cta_v * EPI_THREADS
                if cutlass.const_expr(self.wgrad):
                    out_e = mOut0[(e, None, None)]
                    self._store_plain(chunks, crow0, crows, n_tile, out_e)
                elif cutlass.const_expr(self.epilogue == "plain"):
                    if cutlass.const_expr(self.biased):  # + b_down[e]
                        self._store_plain(chunks, crow0, crows, n_tile, mOut0, bias=(bias.down, e))
                    else:
                        self._store_plain(chunks, crow0, crows, n_tile, mOut0)
                elif cutlass.const_expr(self.epilogue == "swiglu"):
                    if cutlass.const_expr(self.biased):  # + b_gate[e], b_up[e]
                        self._store_swiglu(chunks, crow0, crows, n_tile, mOut0, mOut1, limit,
                                           bias=(bias.gate, bias.up, e))
                    else:
                        self._store_swiglu(chunks, crow0, crows, n_tile, mOut0, mOut1, limit)
                else:
                    self._store_dswiglu(chunks, crow0, crows, n_tile, mOut0, mOut1, limit)
                cute.arch.fence_view_async_tmem_load()
                acc_pipe.consumer_release(acc_state)
                acc_state.advance()
                linear = linear + stride
                expert, base, valid = self._advance(mOffsets, num_experts, n_tiles, total, linear, expert, base)
            tmem.relinquish_alloc_permit()
            epi_barrier()
            tmem.free(acc_ptr)

    # ------------------------------------------------------------ epilogues (epilogue warps)
    @cute.jit
    def _store_plain(self, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32, mOut: cute.Tensor,
                     bias=None):
        """out[row0 + r, n_tile * tile_n + c] = bf16(acc[r, c]) for r < rows and columns inside
        out's N (a multiple of EPI_N); ``bias`` = ``(b [E, N] bf16, expert)``: bf16(acc[r, c] +
        fp32(b[expert, n_tile * tile_n + c])) (:mod:`~mok_cute.kernels.sm100.bias`), None: none."""
        row = chunks.row
        cols = mOut.shape[1] - n_tile * self.cfg.tile_n
        g = cute.local_tile(cute.domain_offset((row0, 0), mOut), (EPI_THREADS, self.cfg.tile_n), (0, n_tile))
        for c in cutlass.range_constexpr(self.cfg.tile_n // EPI_N):
            if cutlass.const_expr(bias is None):
                r = _bf16(chunks.load(c))
            else:
                r = self._biased_chunk(chunks, c, bias, n_tile * self.cfg.tile_n + c * EPI_N, c * EPI_N < cols)
            dst = chunks.part(cute.local_tile(g, (EPI_THREADS, EPI_N), (0, c)))
            if row < rows:
                if c * EPI_N < cols:
                    cute.autovec_copy(r, dst)

    @cute.jit
    def _store_accumulate(self, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32, mMain: cute.Tensor):
        """main[row0 + r, n_tile * tile_n + c] += fp32(bf16(acc[r, c])) for r < rows and columns inside
        main's N (a multiple of EPI_N): ``mMain`` fp32 [R, N] row-major, single-rounded adds
        (``add.rn.f32``), bitwise ``main.add_(bf16_grad.float())`` (Megatron's gradient-accumulation
        fusion); each element read and written by one thread, so any tile order gives the same sum."""
        row = chunks.row
        cols = mMain.shape[1] - n_tile * self.cfg.tile_n
        g = cute.local_tile(cute.domain_offset((row0, 0), mMain), (EPI_THREADS, self.cfg.tile_n), (0, n_tile))
        for c in cutlass.range_constexpr(self.cfg.tile_n // EPI_N):
            acc = chunks.load(c)
            vals = acc.load().to(cutlass.BFloat16).to(Float32)
            dst = chunks.part(cute.local_tile(g, (EPI_THREADS, EPI_N), (0, c)))
            if row < rows:
                if c * EPI_N < cols:
                    cur = cute.make_rmem_tensor_like(acc, Float32)
                    cute.autovec_copy(dst, cur)
                    for j in cutlass.range_constexpr(cute.size(cur)):
                        cur[j] = add_rn(cur[j], vals[j])
                    cute.autovec_copy(cur, dst)

    @cute.jit
    def _store_swiglu(self, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32, mGU: cute.Tensor,
                      mH: cute.Tensor, limit: Float32, mHq: cute.Tensor = None, mHsf: cute.Tensor = None,
                      sf_row: Int32 = None, bias=None):
        """Tile columns [0, tile_n/2) are gate, [tile_n/2, tile_n) up, of intermediate columns
        ``n_tile * tile_n/2 + c``: writes gu (gate, up halves of [M, 2, I]) and h, for
        columns < I (a multiple of EPI_N; B's padding rows past I gave zeros).

        ``mHq`` given (the fused MXFP8 forward): also h quantized along I, GEMM2's A operand:
        e4m3 ``mHq`` [M, I] and each row's E8M0 scales into the flat blocked ``mHsf`` at scale
        atom row ``sf_row`` (:func:`~sm100.layouts.sf_byte`, I / 128 atoms per atom row rounded
        up), bitwise ``quantize_mxfp8(h, -1)`` placed as ``pack_row_scales`` places it (an
        epilogue thread's EPI_N = 32 columns are one MX block: :func:`_mxfp8_block`).

        ``bias`` = ``(b_gate, b_up [E, I] bf16, expert)``: g, u = bf16(acc + fp32(b_gate / b_up[expert, column]))
        before the SwiGLU reads them (:mod:`~mok_cute.kernels.sm100.bias`), None: none."""
        half = self.cfg.tile_n // 2
        shape = (EPI_THREADS, half)
        row = chunks.row
        cols = mH.shape[1] - n_tile * half
        g_gate = cute.local_tile(cute.domain_offset((row0, 0), mGU[(None, 0, None)]), shape, (0, n_tile))
        g_up = cute.local_tile(cute.domain_offset((row0, 0), mGU[(None, 1, None)]), shape, (0, n_tile))
        g_h = cute.local_tile(cute.domain_offset((row0, 0), mH), shape, (0, n_tile))
        g_hq = None
        kb_atoms = None
        if cutlass.const_expr(mHq is not None):
            g_hq = cute.local_tile(cute.domain_offset((row0, 0), mHq), shape, (0, n_tile))
            kb_atoms = (mH.shape[1] + (lay.SF_ATOM_KBLOCKS * lay.SF_VEC - 1)) // (lay.SF_ATOM_KBLOCKS * lay.SF_VEC)
        for c in cutlass.range_constexpr(half // EPI_N):
            if cutlass.const_expr(bias is None):
                rg = _bf16(chunks.load(c))
                ru = _bf16(chunks.load(c + half // EPI_N))
            else:
                col, live = n_tile * half + c * EPI_N, c * EPI_N < cols  # gate chunk c, up chunk c + half / EPI_N
                rg = self._biased_chunk(chunks, c, (bias[0], bias[2]), col, live)
                ru = self._biased_chunk(chunks, c + half // EPI_N, (bias[1], bias[2]), col, live)
            g = cute.make_rmem_tensor_like(rg, Float32)
            g.store(rg.load().to(Float32))
            u = cute.make_rmem_tensor_like(ru, Float32)
            u.store(ru.load().to(Float32))
            swiglu_(g, u, limit, self.clamp, self.gated)
            rh = _bf16(g)
            d_gate = chunks.part(cute.local_tile(g_gate, (EPI_THREADS, EPI_N), (0, c)))
            d_up = chunks.part(cute.local_tile(g_up, (EPI_THREADS, EPI_N), (0, c)))
            d_h = chunks.part(cute.local_tile(g_h, (EPI_THREADS, EPI_N), (0, c)))
            if row < rows:
                if c * EPI_N < cols:
                    cute.autovec_copy(rg, d_gate)
                    cute.autovec_copy(ru, d_up)
                    cute.autovec_copy(rh, d_h)
            if cutlass.const_expr(mHq is not None):
                q, byte = _mxfp8_block(rh)
                d_q = chunks.part(cute.local_tile(g_hq, (EPI_THREADS, EPI_N), (0, c)))
                if row < rows:
                    if c * EPI_N < cols:
                        cute.autovec_copy(q, d_q)
                        mHsf[lay.sf_byte(sf_row, row, n_tile * (half // lay.SF_VEC) + c, kb_atoms)] = byte

    @cute.jit
    def _biased_chunk(self, chunks: AccChunks, c: cutlass.Constexpr[int], bias, col: Int32, live):
        """bf16 registers of accumulator chunk ``c`` plus ``bias`` = ``(b, expert)``: bf16(acc + fp32(b[expert,
        col + j])) (``col``: the chunk's first bias column; the bias loaded before the chunk's ``tcgen05.ld``,
        nothing read unless ``live``: a chunk past the bias's width is not stored)."""
        b = load_bias(bias[0], bias[1], col, live)
        acc = chunks.load(c)
        add_bias(chunks, acc, b)
        return _bf16(acc)

    @cute.jit
    def _store_dswiglu(self, chunks: AccChunks, row0: Int32, rows: Int32, n_tile: Int32, mDGU: cute.Tensor,
                       mGU: cute.Tensor, limit: Float32, mx=None):
        """dSwiGLU of the FP32 accumulator dh (intermediate columns ``n_tile * tile_n + c``)
        with g, u read from gu [M, 2, I] (this thread's row); writes dgu [M, 2, I]. Only the
        chunks inside I (a multiple of EPI_N) are read, computed and written.

        ``mx`` given (the fused MXFP8 backward; ``mDGU`` then None): instead of bf16 dgu, its two
        MXFP8 quantizations (:meth:`_store_dgu_mx`), ``mx = (dguq, dgu_sf, dgut, dg_tsf, du_tsf,
        sf_row, t_atoms)``."""
        shape = (EPI_THREADS, self.cfg.tile_n)
        row = chunks.row
        live = cutlass.min(mGU.shape[2] - n_tile * self.cfg.tile_n, self.cfg.tile_n) // EPI_N
        copy, src, reg_shape = chunks.copy, chunks.src, chunks.reg_shape
        outs = (mDGU,) if cutlass.const_expr(mx is None) else (mx[0], mx[2])
        parts = [
            chunks.part_all(cute.local_tile(cute.domain_offset((row0, 0), t[(None, j, None)]), shape, (0, n_tile)))
            for t in (mGU,) + outs for j in (0, 1)]
        src_g, src_u = parts[:2]
        for c in cutlass.range(live, unroll=2 if cutlass.const_expr(mx is None) else 1):
            dh = tmem_load(copy, src[(None, None, None, 0, c)], reg_shape)
            g = cute.make_rmem_tensor_like(dh, cutlass.BFloat16)
            u = cute.make_rmem_tensor_like(dh, cutlass.BFloat16)
            g.fill(0.0)
            u.fill(0.0)
            d_g = parts[2][(None, None, None, 0, c)]
            d_u = parts[3][(None, None, None, 0, c)]
            if row < rows:
                cute.autovec_copy(src_g[(None, None, None, 0, c)], g)
                cute.autovec_copy(src_u[(None, None, None, 0, c)], u)
            dg = cute.make_rmem_tensor_like(dh, Float32)
            du = cute.make_rmem_tensor_like(dh, Float32)
            for i in cutlass.range_constexpr(cute.size(dh)):
                gf = g[i].to(Float32)
                uf = u[i].to(Float32)
                if cutlass.const_expr(self.gated is not None):  # gpt-oss's: swiglu_math's dSwiGLU
                    a, b = dswiglu(dh[i], gf, uf, limit, self.clamp, self.gated)
                else:  # (swiglu_math.dswiglu's plain arm, written out: the PTX of the measured kernels)
                    gc = gf
                    uc = uf
                    if cutlass.const_expr(self.clamp):
                        gc = cutlass.min(gf, limit)
                        uc = cutlass.max(cutlass.min(uf, limit), -limit)
                    s = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gc, fastmath=True))
                    a = dh[i] * uc * s * (Float32(1.0) + gc * (Float32(1.0) - s))
                    b = dh[i] * (gc * s)
                    if cutlass.const_expr(self.clamp):
                        a = Float32(cutlass.select_(gf > limit, Float32(0.0), a))
                        b = Float32(cutlass.select_((uf < -limit) | (uf > limit), Float32(0.0), b))
                dg[i] = a
                du[i] = b
            rdg = _bf16(dg)
            rdu = _bf16(du)
            if cutlass.const_expr(mx is None):
                if row < rows:
                    cute.autovec_copy(rdg, d_g)
                    cute.autovec_copy(rdu, d_u)
            else:
                self._store_dgu_mx((rdg, rdu), row, rows, n_tile, c, parts[2:], mx)

    @cute.jit
    def _store_dgu_mx(self, vals, row: Int32, rows: Int32, n_tile: Int32, c: Int32, dsts, mx):
        """The fused MXFP8 backward's dgu operands from this thread's bf16 dg, du (``vals``, chunk
        ``c`` of the tile's row ``row``), each a 32-column MX block, as the unfused path quantizes
        bf16 dgu: along I (dgrad1's A, ``quantize_mxfp8(dgu, -1)``: :func:`_mxfp8_block`) into
        e4m3 ``dguq`` [M, 2, I] and the blocked ``dgu_sf`` at scale atom row ``sf_row`` (blocks
        of each half padded to whole scale atoms, ``pad_k_parts`` + ``pack_row_scales``), and
        along tokens (dWg / dWu's A, ``quantize_tokens``: :func:`_mxfp8_tokens`, a warp's 32 rows
        are a token block: m-tiles start at their expert's first row) into e4m3 ``dgut`` [M, 2, I]
        and the blocked ``dg_tsf`` / ``du_tsf`` (features x token blocks, ``t_atoms`` scale atoms
        per atom row; the warp's block 4 sf_row + warp written once it holds a row of the
        expert). The scale buffers are zeroed by the host (their padding stays 0)."""
        dguq, dgu_sf, _, dg_tsf, du_tsf, sf_row, t_atoms = mx
        cfg = self.cfg
        atom_k = lay.SF_ATOM_KBLOCKS * lay.SF_VEC
        half_atoms = (dguq.shape[2] + (atom_k - 1)) // atom_k  # scale atoms per half along I
        lane = row % 32
        warp = row // 32
        n = n_tile * cfg.tile_n + c * EPI_N + lane  # the feature column of this lane's token scale
        for j in cutlass.range_constexpr(2):
            q, byte = _mxfp8_block(vals[j])
            tq, tbyte = _mxfp8_tokens(vals[j], row < rows, lane)
            if row < rows:
                cute.autovec_copy(q, dsts[j][(None, None, None, 0, c)])
                kb = j * half_atoms * lay.SF_ATOM_KBLOCKS + n_tile * (cfg.tile_n // lay.SF_VEC) + c
                dgu_sf[lay.sf_byte(sf_row, row, kb, 2 * half_atoms)] = byte
                cute.autovec_copy(tq, dsts[2 + j][(None, None, None, 0, c)])
            if warp * 32 < rows:
                (dg_tsf, du_tsf)[j][lay.sf_byte(n // lay.SF_ATOM_ROWS, n % lay.SF_ATOM_ROWS,
                                                4 * sf_row + warp, t_atoms)] = tbyte


# ---------------------------------------------------------------- compile
def _fake_sf(cfg: Sm100Config):
    if not cfg.mx:
        return None
    return cute.runtime.make_fake_tensor(cutlass.Uint8, (cute.sym_int(divisibility=lay.SF_ATOM_BYTES),), stride=(1,),
                                         assumed_align=16)


def _check_arch(arch: str):
    if arch not in ARCHS:
        raise ValueError(f"the SM100 grouped GEMMs need arch in {ARCHS}, got {arch!r}")


def compile_grouped_gemm(epilogue: str, *, clamp: bool = False, cfg: Sm100Config = Sm100Config(),
                         b_major: str = K_MAJOR, split_k: bool = False, gated: Gated | None = None,
                         biased: bool = False, arch: str = "sm_100a", inspect: bool = False):
    """Compile one grouped GEMM variant with symbolic M_total, N, K, E (and strides; ``split_k``:
    A = [M, 2, K1], B = [E, K1, N] + [E, K1, N]; ``gated``: the SwiGLU's alpha / up offset; ``biased``: expert
    biases, swiglu b_gate / b_up [E, I], plain b_down [E, N], :mod:`~mok_cute.kernels.sm100.bias`); returns
    ``(compiled, report)``."""
    _check_arch(arch)
    op = GroupedGemmSm100(cfg, epilogue, clamp, b_major, split_k=split_k, gated=gated, biased=biased)
    ab = cfg.ab_dtype
    div = _VEC * 8 // ab.width
    m, k, n, e = cute.sym_int(), cute.sym_int(divisibility=div), cute.sym_int(), cute.sym_int()
    mA = _fake_2d(ab, m, k)
    mB2 = None
    if b_major == K_MAJOR:
        mB = _fake_3d(ab, e, n, k)
    elif split_k:
        mA = _fake_3d(ab, m, cute.sym_int(), cute.sym_int(divisibility=div))
        mB, mB2 = _fake_3d(ab, e, cute.sym_int(divisibility=div), n), _fake_3d(ab, e, cute.sym_int(divisibility=div), n)
    else:
        mB = _fake_3d(ab, e, k, n)
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    out0 = out1 = _fake_2d(cutlass.BFloat16, m, n)
    bias = None
    if epilogue == "swiglu":  # gu as [M, 2, I], h as [M, I]
        inter = cute.sym_int(divisibility=8)
        out0, out1 = _fake_3d(cutlass.BFloat16, m, cute.sym_int(), inter), _fake_2d(cutlass.BFloat16, m, inter)
        if biased:
            bias = ExpertBias(fake_bias(e, inter), fake_bias(e, inter))
    elif epilogue == "dswiglu":  # dgu, gu as [M, 2, I]
        two = cute.sym_int()
        out0, out1 = _fake_3d(cutlass.BFloat16, m, two, n), _fake_3d(cutlass.BFloat16, m, two, n)
    elif biased:
        bias = ExpertBias(down=fake_bias(e, n))
    return compile_kernel(op, mA, mB, mB2, _fake_sf(cfg), _fake_sf(cfg), offs, out0, out1, bias, Float32(0.0),
                          Int32(1), cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


def compile_grouped_wgrad(*, cfg: Sm100Config = Sm100Config(), arch: str = "sm_100a", inspect: bool = False):
    """Compile the weight-gradient kernel with symbolic M, Na, Nb, E and row strides; returns
    ``(compiled, report)``."""
    _check_arch(arch)
    op = GroupedGemmSm100(cfg, wgrad=True)
    div = _VEC * 8 // cfg.ab_dtype.width
    m = cute.sym_int()
    mA = _fake_2d(cfg.ab_dtype, m, cute.sym_int(divisibility=div))
    mB = _fake_2d(cfg.ab_dtype, m, cute.sym_int(divisibility=div))
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    out = _fake_3d(cutlass.BFloat16, cute.sym_int(), cute.sym_int(), cute.sym_int())
    return compile_kernel(op, mA, mB, None, _fake_sf(cfg), _fake_sf(cfg), offs, out, out, None, Float32(0.0),
                          Int32(1), cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


# ---------------------------------------------------------------- host wrappers
DEFAULT_CONFIG = Sm100Config()
MXFP8_CONFIG = Sm100Config(ab_dtype=cutlass.Float8E4M3FN)
MXFP8_2CTA_CONFIG = Sm100Config(tile_m=256, ab_dtype=cutlass.Float8E4M3FN)  # cta_group::2 (compile-verified only)


def _config(a, cfg, name="a"):
    """The config for operand dtype ``a.dtype`` (bf16 or float8_e4m3fn), checked against ``cfg``."""
    _check_tensor(name, a, 2, (torch.bfloat16, _FP8))
    mx = a.dtype == _FP8
    cfg = cfg or (MXFP8_CONFIG if mx else DEFAULT_CONFIG)
    if cfg.mx != mx:
        raise ValueError(f"cfg.ab_dtype {cfg.ab_dtype.__name__} does not match operand dtype {a.dtype}")
    return cfg


def _check_rows(name, t, mx, k_name="K"):
    """Row-major [M, K] operand: contiguous, 16-byte aligned, K a positive multiple of 16 bytes
    (MXFP8: of 32 elements)."""
    _check_tensor(name, t, 2, (_FP8,) if mx else (torch.bfloat16,))
    mult = lay.SF_VEC if mx else 8
    if t.shape[1] % mult or t.shape[1] == 0:
        raise ValueError(f"{name}: {k_name}={t.shape[1]} must be a positive multiple of {mult}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous (row-major) and 16-byte aligned")


def _row_operand(name, t, offsets, cfg, k_name="K"):
    """``(cfg, E)`` for a grouped GEMM's row operand ``t`` (checked as :func:`_check_rows`)
    and its offsets."""
    cfg = _config(t, cfg, name)
    _check_rows(name, t, cfg.mx, k_name)
    return cfg, _check_offsets(offsets)


def _check_weight(name, w, shape, mx, strided=False):
    """[E, R, C] weight of exactly ``shape``: contiguous, or (``strided``) with unit last stride
    and the other strides multiples of 16 bytes (e.g. one half of a stacked [E, 2R, C]); 16-byte
    aligned."""
    _check_tensor(name, w, 3, (_FP8,) if mx else (torch.bfloat16,))
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(w.shape)}")
    vec = _VEC // w.element_size()
    if strided:
        if w.stride(2) != 1 or w.stride(1) % vec or w.stride(0) % vec or w.data_ptr() % 16:
            raise ValueError(f"{name} must have unit last stride, other strides multiples of {vec} and 16-byte "
                             f"alignment, got strides {w.stride()}")
    elif not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")


def _check_scales(name, s, shape):
    """MXFP8 scales: uint8 E8M0 of exactly ``shape``."""
    if s is None:
        raise ValueError(f"{name} is required for float8_e4m3fn operands")
    _check_tensor(name, s, len(shape), (torch.uint8,))
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(s.shape)}")


def _check_gate_up_scales(w_scales, shape):
    """MXFP8 ``w_scales = (gate_scales, up_scales)``, each uint8 of exactly ``shape``."""
    if not isinstance(w_scales, (tuple, list)) or len(w_scales) != 2:
        raise ValueError("w_scales must be (gate_scales, up_scales) for float8_e4m3fn weights")
    _check_scales("w_scales[0]", w_scales[0], shape)
    _check_scales("w_scales[1]", w_scales[1], shape)


def _arch(device) -> str:
    arch = arch_of_device(device)
    if arch not in ARCHS:
        raise ValueError(f"the SM100 grouped GEMMs need an sm_100a/sm_103a device, got {arch}")
    return arch


def _num_ctas(device, cfg: Sm100Config, tiles: int) -> int:
    """Persistent grid: min(SMs, tiles) clusters' worth of CTAs (a multiple of the cluster size)."""
    clusters = max(1, min(sm_count(device) // cfg.cta_group, tiles))
    return clusters * cfg.cta_group


class GemmKind(NamedTuple):
    """One grouped GEMM variant of :class:`GroupedGemmSm100`: its tile config, epilogue (one of
    :data:`EPILOGUES`), whether the SwiGLU / dSwiGLU epilogue clamps, B's major mode, and the SwiGLU's
    alpha / up offset (``gated``, None: silu(g) * u)."""

    cfg: Sm100Config
    epilogue: str
    clamp: bool
    b_major: str
    gated: Gated | None = None


def _launch(kind: GemmKind, a, w, scales: tuple, offsets, outs: tuple, limit: float, n: int, w2=None,
            bias: ExpertBias | None = None):
    """Compile (once per variant and arch) and launch one grouped GEMM of ``kind`` on the current
    stream: A ``a``, B ``w`` (``w2``: B's second part along K, split K: ``a`` is then [M, 2, K1]),
    ``scales`` = (A's, B's blocked MXFP8 scales, or None each), ``outs`` = (out0, out1) (the same
    tensor twice for the plain epilogue); ``n``: B's N; ``bias``: None, or the
    :class:`~mok_cute.kernels.sm100.bundles.ExpertBias` of checked bf16 torch tensors (swiglu: gate, up;
    plain: down), the ``biased`` variant."""
    cfg, epilogue, clamp, b_major, gated = kind
    (a_sf, w_sf), (out0, out1) = scales, outs
    arch = _arch(a.device)
    split_k = w2 is not None
    biased = bias is not None
    compiled = compile_cached(
        ("sm100_grouped_gemm", arch, epilogue, clamp, b_major, split_k, gated, cfg.key()) + (("biased",) if biased
                                                                                              else ()),
        lambda: compile_grouped_gemm(epilogue, clamp=clamp, cfg=cfg, b_major=b_major, split_k=split_k,
                                     gated=gated, biased=biased, arch=arch)[0])
    m, e = a.shape[0], offsets.numel() - 1
    tiles = (-(-m // cfg.tile_m) + e) * -(-n // cfg.tile_n)
    offs32 = offsets_i32(offsets)
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    compiled(_cute_tensor(a), _cute_tensor(w), None if w2 is None else _cute_tensor(w2),
             None if a_sf is None else _cute_tensor(a_sf), None if w_sf is None else _cute_tensor(w_sf),
             _cute_tensor(offs32, 4), _cute_tensor(out0), _cute_tensor(out1),
             None if bias is None else ExpertBias(*(None if b is None else _cute_tensor(b) for b in bias)),
             Float32(limit), Int32(_num_ctas(a.device, cfg, tiles)), stream)


def _check_biases(cfg: Sm100Config, given: dict, shapes: dict, device) -> bool:
    """Whether expert biases are given (``given``: name -> tensor or None, all or none; each checked by
    :func:`~mok_cute.kernels.sm100.bias.check_bias` against ``shapes``); ValueError for MXFP8 operands with
    biases (the epilogues add them at BF16 only)."""
    if all(b is None for b in given.values()):
        return False
    if cfg.mx:
        raise ValueError("expert biases (bias=) run with BF16 operands only, not MXFP8")
    for name, b in given.items():
        if b is None:
            raise ValueError(f"{name} is None: give every bias or none")
        check_bias(name, b, shapes[name], device)
    return True


def _check_n(name, n):
    """N dims (H, I): positive multiples of :data:`EPI_N` (the epilogue's column chunk; tiles
    over N round up)."""
    if n % EPI_N or n == 0:
        raise ValueError(f"{name} must be a positive multiple of {EPI_N}")


def interleave_gate_up(w_gate, w_up, half: int):
    """[E, I, C] gate and up weights (or their MXFP8 scales) -> [E, 2 I_p, C], I_p = I rounded
    up to ``half`` (= tile_n / 2): blocks of ``half`` rows alternating gate, up, zero rows past
    I, so one tile_n-wide output tile holds matching gate and up columns. One copy."""
    e, inter, c = w_gate.shape
    full, rem = divmod(inter, half)
    out = w_gate.new_empty(e, full + (rem > 0), 2, half, c)
    for j, w in enumerate((w_gate, w_up)):
        out[:, :full, j] = w[:, :full * half].reshape(e, full, half, c)
        if rem:
            out[:, full, j, :rem] = w[:, full * half:]
            out[:, full, j, rem:] = 0
    return out.view(e, -1, c)


def grouped_gemm(a, offsets, w, *, a_scales=None, w_scales=None, out=None, cfg: Sm100Config | None = None,
                 bias=None):
    """out [M, N] bf16: rows offsets[e]..offsets[e+1] = bf16(a_e @ w[e]^T) (FP32 accumulate).

    a [M, K] bf16 or float8_e4m3fn, contiguous; offsets [E+1] int32/int64 on the device (0,
    non-decreasing, last = M; not checked); w [E, N, K] same dtype, N a multiple of 32
    (:data:`EPI_N`). MXFP8: ``a_scales`` [M, K/32] and ``w_scales`` [E, N, K/32] uint8 E8M0
    (``mxfp8_quantize`` along K), repacked on the device into the blocked layouts.
    ``bias`` (BF16 only): None or [E, N] bf16 (unit last stride, row stride a multiple of 8, 16-byte aligned):
    out = bf16(fp32(a_e @ w[e]^T) + fp32(bias[e])), added to the accumulator before the rounding.
    """
    cfg, e = _row_operand("a", a, offsets, cfg)
    m, k = a.shape
    _check_tensor("w", w, 3, (a.dtype,))
    _check_weight("w", w, (e, w.shape[1], k), cfg.mx)
    n = w.shape[1]
    _check_n(f"w: N={n}", n)
    a_sf = w_sf = None
    if cfg.mx:
        _check_scales("a_scales", a_scales, (m, k // lay.SF_VEC))
        _check_scales("w_scales", w_scales, (e, n, k // lay.SF_VEC))
    out = _check_out("out", out, (m, n), a.device)
    _check_devices(a=a, offsets=offsets, w=w, out=out)
    biased = _check_biases(cfg, {"bias": bias}, {"bias": (e, n)}, a.device)
    if m:
        if cfg.mx:
            a_sf, w_sf = lay.pack_row_scales(a_scales, offsets), lay.to_blocked(w_scales).reshape(-1)
        _launch(GemmKind(cfg, "plain", False, K_MAJOR), a, w, (a_sf, w_sf), offsets, (out, out), 0.0, n,
                **({"bias": ExpertBias(down=bias)} if biased else {}))
    return out


def grouped_gemm1_swiglu(x, offsets, w_gate, w_up, limit=None, *, x_scales=None, w_scales=None, out=None,
                         cfg: Sm100Config | None = None, interleave=None, bias=None):
    """(gu [M, 2I], h [M, I]) bf16: gu = bf16(x_e @ [w_gate[e]; w_up[e]]^T) (gate in columns
    [0, I), up in [I, 2I)); h = bf16(silu(g) * u) in FP32 from the bf16 g, u, with g = min(g,
    limit), u = clamp(u, -limit, limit) when ``limit`` is given; ``limit`` may be a
    :class:`~mok_cute.reference.SwiGLU` (h = bf16(g * sigmoid(alpha * g) * (u + up_offset)), clamped as above).

    x [M, H], w_gate/w_up [E, I, H] (bf16, or float8_e4m3fn with ``x_scales`` [M, H/32] and
    ``w_scales = (gate_scales, up_scales)`` each [E, I, H/32]); I a multiple of 32. The
    weights (and scales) are interleaved into one [E, 2 I_p, H] copy by ``interleave(w_gate, w_up,
    tile_n / 2)`` (default :func:`interleave_gate_up`, a copy per call; I_p = I rounded up to
    ``tile_n / 2``; a caller may pass one that caches it while the weights are unchanged).
    ``bias`` (BF16 only): None or ``(b_gate, b_up)`` [E, I] bf16 each (unit last stride, row stride a multiple of
    8, 16-byte aligned): g = bf16(fp32(x_e @ w_gate[e]^T) + fp32(b_gate[e])), u likewise with b_up, added to the
    accumulator before the rounding; h from those g, u.
    """
    interleave = interleave_gate_up if interleave is None else interleave
    cfg, e = _row_operand("x", x, offsets, cfg, "H")
    m, hid = x.shape
    _check_tensor("w_gate", w_gate, 3, (x.dtype,))
    inter = w_gate.shape[1]
    _check_weight("w_gate", w_gate, (e, inter, hid), cfg.mx)
    _check_weight("w_up", w_up, (e, inter, hid), cfg.mx)
    _check_n(f"w_gate: I={inter}", inter)
    _check_limit(limit)
    if cfg.mx:
        _check_scales("x_scales", x_scales, (m, hid // lay.SF_VEC))
        _check_gate_up_scales(w_scales, (e, inter, hid // lay.SF_VEC))
    gu, h = (None, None) if out is None else out
    gu = _check_out("gu", gu, (m, 2 * inter), x.device)
    h = _check_out("h", h, (m, inter), x.device)
    _check_devices(x=x, offsets=offsets, w_gate=w_gate, w_up=w_up, gu=gu, h=h)
    if bias is not None and (not isinstance(bias, (tuple, list)) or len(bias) != 2):
        raise ValueError("bias must be None or (b_gate, b_up), each [E, I] bf16")
    b_gate, b_up = (None, None) if bias is None else bias
    biased = _check_biases(cfg, {"bias[0] (b_gate)": b_gate, "bias[1] (b_up)": b_up},
                           {"bias[0] (b_gate)": (e, inter), "bias[1] (b_up)": (e, inter)}, x.device)
    if m:
        w = interleave(w_gate, w_up, cfg.tile_n // 2)
        x_sf = w_sf = None
        if cfg.mx:
            x_sf = lay.pack_row_scales(x_scales, offsets)
            w_sf = lay.to_blocked(interleave(*w_scales, cfg.tile_n // 2)).reshape(-1)
        clamp, gated, lim = swiglu_args(limit)
        _launch(GemmKind(cfg, "swiglu", clamp, K_MAJOR, gated), x, w, (x_sf, w_sf), offsets, (gu.view(m, 2, inter), h),
                lim, w.shape[1], **({"bias": ExpertBias(b_gate, b_up)} if biased else {}))
    return gu, h


def grouped_dswiglu_dgrad(dy, offsets, w_down, gu, limit=None, *, dy_scales=None, w_scales=None, out=None,
                          cfg: Sm100Config | None = None):
    """dgu [M, 2I] bf16 = bf16([dg | du]): dh = dy_e . w_down[e] in FP32 (never rounded), then
    the dSwiGLU of :func:`mok_cute.reference.dswiglu` at the bf16 g = gu[:, :I], u = gu[:, I:] (``limit``: None,
    L or a :class:`~mok_cute.reference.SwiGLU`, as in the forward).

    dy [M, H] (routed rows, scaled by topk_w), w_down [E, H, I] contiguous (read N-major in
    place), bf16 or float8_e4m3fn with ``dy_scales`` [M, H/32] and ``w_scales`` [E, H/32, I]
    (w_down quantized along H); gu [M, 2I] bf16; I a multiple of 32.
    """
    cfg, e = _row_operand("dy", dy, offsets, cfg, "H")
    m, hid = dy.shape
    _check_tensor("w_down", w_down, 3, (dy.dtype,))
    inter = w_down.shape[2]
    _check_weight("w_down", w_down, (e, hid, inter), cfg.mx)
    _check_n(f"w_down: I={inter}", inter)
    _check_tensor("gu", gu, 2, (torch.bfloat16,))
    if tuple(gu.shape) != (m, 2 * inter) or not gu.is_contiguous():
        raise ValueError(f"gu must be contiguous with shape {(m, 2 * inter)}, got {tuple(gu.shape)}")
    _check_limit(limit)
    if cfg.mx:
        _check_scales("dy_scales", dy_scales, (m, hid // lay.SF_VEC))
        _check_scales("w_scales", w_scales, (e, hid // lay.SF_VEC, inter))
    out = _check_out("out", out, (m, 2 * inter), dy.device)
    _check_devices(dy=dy, offsets=offsets, w_down=w_down, gu=gu, out=out)
    if m:
        dy_sf = w_sf = None
        if cfg.mx:
            dy_sf = lay.pack_row_scales(dy_scales, offsets)
            w_sf = lay.pack_kn_weight_scales(w_scales)
        clamp, gated, lim = swiglu_args(limit)
        _launch(GemmKind(cfg, "dswiglu", clamp, MN_MAJOR, gated), dy, w_down, (dy_sf, w_sf), offsets,
                (out.view(m, 2, inter), gu.view(m, 2, inter)), lim, inter)
    return out


def grouped_dgrad1(dgu, offsets, w_gate, w_up, *, dgu_scales=None, w_scales=None, out=None,
                   cfg: Sm100Config | None = None):
    """dx [M, H] bf16 = bf16(dgu_e . [w_gate[e]; w_up[e]]): one FP32 TMEM accumulator over
    K = 2I (gate rows first, then up rows).

    dgu [M, 2I] contiguous (read as its two halves); w_gate, w_up [E, I, H] with unit last
    stride and the other strides multiples of 16 bytes (two tensors, or the halves ``w[:, :I]``,
    ``w[:, I:]`` of one stacked [E, 2I, H]), read MN-major in place; A's and B's halves have
    their own TMA descriptors, switched at k-tile ceil(I / tile_k) (each half's K tail
    zero-filled); bf16, or float8_e4m3fn with ``dgu_scales`` [M, 2I/32] (dgu quantized along
    I) and ``w_scales = (gate_scales, up_scales)`` each [E, I/32, H] (quantized along I, the
    columns of [I, H]), repacked on the device into the blocked layouts with each half padded
    to whole k-tiles (:func:`~sm100.layouts.pad_k_parts`). I a multiple of 8 (MXFP8: 32), H of
    32; ``out``: optional preallocated [M, H].
    """
    cfg, e = _row_operand("dgu", dgu, offsets, cfg, "2I")
    m, two_i = dgu.shape
    inter = two_i // 2
    _check_tensor("w_gate", w_gate, 3, (dgu.dtype,))
    hid = w_gate.shape[2]
    _check_weight("w_gate", w_gate, (e, inter, hid), cfg.mx, strided=True)
    _check_weight("w_up", w_up, (e, inter, hid), cfg.mx, strided=True)
    k_mult = lay.SF_VEC if cfg.mx else 8
    if inter % k_mult:
        raise ValueError(f"dgu: I={inter} (half of its columns) must be a multiple of {k_mult}")
    _check_n(f"w_gate: H={hid}", hid)
    if cfg.mx:
        _check_scales("dgu_scales", dgu_scales, (m, two_i // lay.SF_VEC))
        _check_gate_up_scales(w_scales, (e, inter // lay.SF_VEC, hid))
    out = _check_out("out", out, (m, hid), dgu.device)
    _check_devices(dgu=dgu, offsets=offsets, w_gate=w_gate, w_up=w_up, out=out)
    if m:
        dgu_sf = w_sf = None
        if cfg.mx:
            dgu_sf = lay.pack_row_scales(lay.pad_k_parts(dgu_scales.chunk(2, 1), 1), offsets)
            w_sf = lay.pack_kn_weight_scales(*w_scales)
        _launch(GemmKind(cfg, "plain", False, MN_MAJOR), dgu.view(m, 2, inter), w_gate, (dgu_sf, w_sf), offsets,
                (out, out), 0.0, hid, w2=w_up)
    return out


def grouped_wgrad(a, b, offsets, *, a_scales=None, b_scales=None, out=None, cfg: Sm100Config | None = None):
    """dW [E, Na, Nb] bf16: dW[e] = bf16(a_e^T . b_e) over expert e's rows, tokens summed in
    order in FP32 (no split-K, no atomics: bitwise reproducible); empty experts get zeros.

    a [M, Na], b [M, Nb] row-major with unit column stride and row strides multiples of 16
    bytes (column slices such as ``dgu[:, :I]`` are read in place), bf16 or float8_e4m3fn
    quantized along tokens per expert (blocks of 32 from each expert's first row) with
    ``a_scales`` / ``b_scales`` already in the grouped token layout
    (:func:`~mok_cute.kernels.sm100.layouts.pack_token_scales`: flat uint8 of
    ``sf_bytes(N, grouped_sf_rows(M, E) / 32)``); Na, Nb multiples of 16 bytes, Nb of 32 (tiles
    over Na and Nb round up: rows past Na and columns past Nb are not written).
    """
    cfg = _config(a, cfg)
    m, na, nb, e = check_wgrad_operands(a, b, offsets, EPI_N, cfg.mx)
    if cfg.mx:
        kbs = lay.grouped_sf_rows(m, e) // lay.SF_VEC
        _check_scales("a_scales", a_scales, (lay.sf_bytes(na, kbs),))
        _check_scales("b_scales", b_scales, (lay.sf_bytes(nb, kbs),))
    out = wgrad_out(out, (e, na, nb), a.device)
    _check_devices(a=a, b=b, offsets=offsets, out=out)
    arch = _arch(a.device)
    if m == 0:
        return out.zero_()
    compiled = compile_cached(("sm100_grouped_wgrad", arch, cfg.key()),
                              lambda: compile_grouped_wgrad(cfg=cfg, arch=arch)[0])
    tiles = e * -(-na // cfg.tile_m) * -(-nb // cfg.tile_n)
    offs32 = offsets_i32(offsets)
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    compiled(_cute_tensor(a), _cute_tensor(b), None, None if a_scales is None else _cute_tensor(a_scales),
             None if b_scales is None else _cute_tensor(b_scales), _cute_tensor(offs32, 4),
             _cute_tensor(out), _cute_tensor(out), None, Float32(0.0), Int32(_num_ctas(a.device, cfg, tiles)), stream)
    return out


# ---------------------------------------------------------------- variant registry (tests, readiness tool)
_COMMON_PTX = ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor", "mbarrier")
_BF16_PTX = _COMMON_PTX + ("kind::f16",)
_MX_PTX = _COMMON_PTX + ("kind::mxf8f6f4", "block_scale", "tcgen05.cp")
BIAS_PTX = ("ld.global.v4.b32", "add.rn.f32.bf16")  # expert biases: 16-byte bias loads, fp32 + bf16 adds
GPT_OSS = Gated(1.702, 1.0)  # gpt-oss's SwiGLU constants (reference.SwiGLU.gpt_oss), the gated variants'


def variants() -> dict:
    """``name -> (compile(arch, inspect) -> (compiled, report), PTX substrings it must hold)``
    for every SM100 kernel variant this module builds."""
    mx = MXFP8_CONFIG

    def gemm(epi, **kw):
        return lambda arch, inspect=True: compile_grouped_gemm(epi, arch=arch, inspect=inspect, **kw)

    def wgrad(**kw):
        return lambda arch, inspect=True: compile_grouped_wgrad(arch=arch, inspect=inspect, **kw)

    return {
        "bf16-plain": (gemm("plain"), _BF16_PTX),
        "bf16-swiglu-clamp": (gemm("swiglu", clamp=True), _BF16_PTX),
        "bf16-dswiglu-clamp": (gemm("dswiglu", clamp=True, b_major=MN_MAJOR), _BF16_PTX),
        "bf16-swiglu-gpt-oss": (gemm("swiglu", clamp=True, gated=GPT_OSS), _BF16_PTX),
        "bf16-dswiglu-gpt-oss": (gemm("dswiglu", clamp=True, b_major=MN_MAJOR, gated=GPT_OSS), _BF16_PTX),
        "bf16-dgrad1": (gemm("plain", b_major=MN_MAJOR, split_k=True), _BF16_PTX),
        "bf16-wgrad": (wgrad(), _BF16_PTX),
        "bf16-plain-2cta": (gemm("plain", cfg=Sm100Config(tile_m=256)), _BF16_PTX + ("cta_group::2",)),
        "bf16-plain-biased": (gemm("plain", biased=True), _BF16_PTX + BIAS_PTX),
        "bf16-swiglu-gpt-oss-biased": (gemm("swiglu", clamp=True, gated=GPT_OSS, biased=True), _BF16_PTX + BIAS_PTX),
        "bf16-plain-2cta-biased": (gemm("plain", cfg=Sm100Config(tile_m=256), biased=True),
                                   _BF16_PTX + ("cta_group::2",) + BIAS_PTX),
        "mxfp8-plain": (gemm("plain", cfg=mx), _MX_PTX),
        "mxfp8-swiglu-clamp": (gemm("swiglu", clamp=True, cfg=mx), _MX_PTX),
        "mxfp8-dswiglu": (gemm("dswiglu", b_major=MN_MAJOR, cfg=mx), _MX_PTX),
        "mxfp8-swiglu-gpt-oss": (gemm("swiglu", clamp=True, gated=GPT_OSS, cfg=mx), _MX_PTX),
        "mxfp8-dgrad1": (gemm("plain", b_major=MN_MAJOR, split_k=True, cfg=mx), _MX_PTX),
        "mxfp8-wgrad": (wgrad(cfg=mx), _MX_PTX),
        "mxfp8-plain-2cta": (gemm("plain", cfg=MXFP8_2CTA_CONFIG), _MX_PTX + ("cta_group::2",)),
        "mxfp8-swiglu-2cta": (gemm("swiglu", clamp=True, cfg=MXFP8_2CTA_CONFIG), _MX_PTX + ("cta_group::2",)),
        "mxfp8-dswiglu-2cta": (gemm("dswiglu", b_major=MN_MAJOR, cfg=MXFP8_2CTA_CONFIG), _MX_PTX + ("cta_group::2",)),
        "mxfp8-dgrad1-2cta": (gemm("plain", b_major=MN_MAJOR, split_k=True, cfg=MXFP8_2CTA_CONFIG),
                              _MX_PTX + ("cta_group::2",)),
        "mxfp8-wgrad-2cta": (wgrad(cfg=MXFP8_2CTA_CONFIG), _MX_PTX + ("cta_group::2",)),
    }

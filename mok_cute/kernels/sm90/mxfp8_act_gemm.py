"""Hopper (sm_90a) MXFP8 grouped GEMM, mixed input: MXFP8 (e4m3 + E8M0) activations x bf16
weights, the activation tiles dequantized exactly to BF16 in shared memory by the MMA warps,
then the BF16 wgmma mainloop of :mod:`sm90.grouped_gemm` (:class:`Mxfp8ActGemmSm90`).

Contract (:func:`grouped_gemm_mxfp8_mixed`): rows of expert e: out = bf16(fp32 sum over K of
deq(a) * w[e]), deq(q, s) = bf16(fp32(q) * 2^(s - 127)) (one ``mul.rn.f32``, no FTZ, then
``cvt.rn.bf16x2.f32``; scale 0xFF -> NaN): the ops of :mod:`dequant_mxfp8` (shared through
:class:`~mok_cute.kernels.quant.fp8_ops.Fp8Ops`), so the BF16 A tiles equal
``dequantize_mxfp8(a, a_scales)`` bitwise. The BF16 tiles, the tiled MMA, the k-order and the
epilogue are those of ``sm90.grouped_gemm.grouped_gemm`` (128 x 256 x 64, same
:meth:`Sm90Mainloop.mma_tile`, same persistent tile walk), so the result is bitwise
``grouped_gemm(dequantize_mxfp8(a, a_scales), offsets, w)``. W is e.g. an MXFP8 weight
dequantized once per weight version; the activations are read at 1 + 1/32 bytes per element
instead of 2.

Design: one TMA ring of 3 stages holds A's e4m3 tile (8 KB, unswizzled row-major) and W's bf16
tile (32 KB, swizzled as wgmma reads it). The MMA warps dequantize A themselves, 16 rows per
warp (their warpgroup's 64 wgmma rows), into one of two BF16 A buffers: k-tile kt's rows are
converted while wgmma batch kt - 1 runs (buffer kt % 2 was last read by batch kt - 2, retired by
the previous ``wait_group(1)``), then ``fence.proxy.async`` and a per-warpgroup named barrier,
then the BF16 kernel's wgmma batch; the ring slot is released when its batch retires. Per pass
a lane takes 8 bytes (2 words) of one row, converts them with the row's E8M0 multiplier and
stores one 16-byte vector through the buffer's swizzled cute tensor (:func:`_copies`).
Scales are not TMA-loaded (a 64-K k-tile holds 2 scale bytes per row, below TMA's 16-byte box
minimum): the host passes them as int32 words (4 blocks = 2 k-tiles per word); each lane
decodes its held (row, block) multiplier (fp32 bits of 2^(s - 127), :meth:`Fp8Ops.scale_bits`)
from a word it loaded one k-tile ahead, and each pass takes its multiplier from the holding lane
by one ``shfl.sync`` (layout in :func:`_lanes`). Shared memory 3 x 40 KB + 2 x 16 KB + 64 KB
epilogue = 216 KB; registers 40 / 232 as the BF16 kernel. Same wgmma stream, so the same
bitwise result. Measured (H200, 8 x 4096 rows, K 7168, N 4096): 608-624 TFLOP/s = 0.92-0.94x
the BF16 GEMM, bitwise equal to it on the dequantized operands.

The e4m3-weight form (both operands MXFP8, three dequant warps beside the producer, 0.35-0.39x
the BF16 GEMM) was removed: ``docs/architecture.md``, "Removed kernels".
"""
from __future__ import annotations

import copy

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync

from mok_cute.dsl.compile import compile_cached, compile_kernel
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.dsl.host import _check_devices, _check_offsets, _check_out, _check_tensor, offsets_i32, sm_count
from mok_cute.kernels.sm90.fp8_gemm import SCALE_BLOCK, _fake
from mok_cute.kernels.sm90.fp8_scaled import _sm90
from mok_cute.kernels.sm90.grouped_gemm import (
    DEFAULT_CONFIG, PlainEpilogue, _ragged_rows, effective_config, make_tma_store, rows_tma_tile,
    tma_store_drain, tma_store_tile,
)
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.kernels.sm90.mainloop import (
    SMEM_BYTES, NUM_THREADS, THREADS_PER_WG, MainloopConfig, Sm90Mainloop, experts_last,
)
from mok_cute.schedule.group_tiles import grouped_start, seek, tile_coords

MX_BLOCK = 32
_VEC = 8  # elements per dequant vector: 8 e4m3 bytes in, one 16-byte bf16 vector out
ACT_STAGES = 3  # TMA ring: A e4m3 (8 KB) + W bf16 (32 KB) per stage
ACT_A_BUFFERS = 2  # BF16 A tiles written by the MMA warps (16 KB each)
ACT_PRODUCER_REGS, ACT_MMA_REGS = 40, 232  # the BF16 kernel's split: 40 x 128 + 232 x 256 <= 65536
_ACT_BLOCK_ROWS = 16  # A rows per MMA warp: 4 warps x 16 = the warpgroup's 64 wgmma rows
_ACT_BARRIER = 2  # named barriers 2, 3: one per MMA warpgroup (1 is the consumers' epilogue barrier)


class Mxfp8ActGemmSm90:
    """Persistent grouped GEMM with MXFP8 activations and bf16 weights, the A tile dequantized
    by the MMA warps themselves (see the module doc).

    Call (jit): ``(mA [M, K] e4m3, mSA [M, K/128] int32 (E8M0 bytes as words), mB [E, N, K]
    bf16, mOffsets [E+1] int32, mOut [M, N] bf16, num_ctas, stream)``; K a multiple of 128,
    N of ``cfg.tile_n``. ``cfg``: the BF16 mainloop's (tile 128 x 256 x 64).
    """

    def __init__(self, cfg: MainloopConfig = DEFAULT_CONFIG):
        if cfg.ab_dtype is not cutlass.BFloat16 or (cfg.tile_m, cfg.tile_n, cfg.tile_k) != (128, 256, 64):
            raise ValueError(f"the mixed MXFP8 GEMM needs a BF16 mainloop with tile 128 x 256 x 64, got {cfg}")
        self.cfg = cfg
        self.epi = PlainEpilogue(cfg.tile_m, cfg.tile_n)
        self.a8_bytes = cfg.tile_m * cfg.tile_k
        self.tx_bytes = self.a8_bytes + cfg.tile_n * cfg.tile_k * 2
        extra = ACT_STAGES * self.a8_bytes + ACT_A_BUFFERS * cfg.tile_m * cfg.tile_k * 2 + 2 * ACT_STAGES * 8
        # the shared mainloop's tiled MMA, fragments and TMA walk; its own BF16 ring is not allocated
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=self.epi.smem_elems() * 2 + extra)
        self.smem_bytes = ACT_STAGES * cfg.tile_n * cfg.tile_k * 2 + extra + self.epi.smem_elems() * 2
        if self.smem_bytes > SMEM_BYTES - 1024:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory do not fit")
        self.ring = copy.copy(self.mainloop)  # the TMA walk over the ACT_STAGES ring
        self.ring.stages = ACT_STAGES

    def _layouts(self):
        """Shared layouts (in the launcher and in the kernel): A e4m3 unswizzled K-contiguous
        (tile_m, tile_k, ACT_STAGES); A bf16 (ACT_A_BUFFERS) and W bf16 (ACT_STAGES) swizzled
        as the BF16 wgmma reads them."""
        ml, cfg = self.mainloop, self.cfg
        k = cfg.tile_k
        self.a8_layout = cute.make_layout((cfg.tile_m, k, ACT_STAGES), stride=(k, 1, cfg.tile_m * k))
        self.a_layout = sm90.make_smem_layout_a(ml.a_layout, ml.tile_mnk, cfg.ab_dtype, ACT_A_BUFFERS)
        self.w_layout = sm90.make_smem_layout_b(ml.b_layout, ml.tile_mnk, cfg.ab_dtype, ACT_STAGES)

    def _storage(self):
        cfg = self.cfg
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * ACT_STAGES],
            "sA": cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(self.a_layout)], 1024],
            "sW": cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(self.w_layout)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, self.epi.smem_elems()], 1024],
            "sA8": cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.a8_layout)], 1024],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mSA: cute.Tensor, mB: cute.Tensor, mOffsets: cute.Tensor,
                 mOut: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        cfg = self.cfg
        self.mainloop.setup()
        self._layouts()
        atom_a, coord_a, atom_b, coord_b, atom_c, coord_c = _tma_atoms(cfg, mA, self.a8_layout, mB, self.w_layout,
                                                                       mOut)
        self.shared_storage = self._storage()
        self.kernel(atom_a, coord_a, atom_b, coord_b, mSA, mOffsets, mOut, atom_c, coord_c).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    @cute.kernel
    def kernel(self, atom_a: cute.CopyAtom, coord_a: cute.Tensor, atom_b: cute.CopyAtom, coord_b: cute.Tensor,
               mSA: cute.Tensor, mOffsets: cute.Tensor, mOut: cute.Tensor, atom_c: cute.CopyAtom,
               coord_c: cute.Tensor):
        cfg = self.cfg
        atoms = [atom_a, atom_b]
        if cutlass.const_expr(cfg.tma_store):
            atoms.append(atom_c)
        tidx, warp = self.mainloop.start(atoms)
        self._layouts()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe = self.mainloop.make_pipeline(storage.barriers.data_ptr(), ACT_STAGES, self.tx_bytes)
        sA = storage.sA.get_tensor(self.a_layout.outer, swizzle=self.a_layout.inner)
        sW = storage.sW.get_tensor(self.w_layout.outer, swizzle=self.w_layout.inner)
        sC = self.epi.smem_tensor(storage.sC)
        sA8 = storage.sA8.get_tensor(self.a8_layout)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cfg.cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=cfg.cluster_mn)
        num_experts, n_tiles, k_tiles, linear, grid, expert, base = grouped_start(
            mOffsets, coord_b.shape[0], cfg.tile_n, coord_a.shape[1], cfg.tile_m, cfg.tile_k)
        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(ACT_PRODUCER_REGS)
            if warp == 0:
                self.ring.produce_grouped(pipe, mOffsets, num_experts, n_tiles, linear, expert, base, grid,
                                          atom_a, coord_a, sA8, atom_b, coord_b, sW, cfg.tile_n, k_tiles)
        else:
            cute.arch.setmaxregister_increase(ACT_MMA_REGS)
            tid = tidx - THREADS_PER_WG
            wg = tid // THREADS_PER_WG
            lane = cute.arch.lane_idx()
            block = tid // 32  # 16-row block of the tile: warpgroup wg's rows [64 wg, 64 wg + 64)
            thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(sA, sW, tid)
            rd, wr = _copies(cfg.tile_k)
            src = rd.get_slice(lane).partition_S(cute.local_tile(
                cute.recast_tensor(sA8, Uint32), (_ACT_BLOCK_ROWS, cfg.tile_k // 4, ACT_STAGES), (block, 0, 0)))
            dst = wr.get_slice(lane).partition_D(
                cute.local_tile(sA, (_ACT_BLOCK_ROWS, cfg.tile_k, ACT_A_BUFFERS), (block, 0, 0)))
            hold_row, reader = _lanes(lane)
            words = cute.make_rmem_tensor((1,), Uint32)
            mult = cute.make_rmem_tensor((1,), Uint32)
            m_total = coord_a.shape[0]
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACT_STAGES)
            while expert < num_experts:
                _, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                row = row0 + block * _ACT_BLOCK_ROWS + hold_row
                _load_words(words, mSA, row, m_total, Int32(0))
                state = self.mainloop.mma_tile(
                    pipe, state, tCrA, tCrB, acc, k_tiles,
                    stage_a=lambda slot, kt: self._stage_a(src, dst, slot, kt, words, mult, mSA, row, m_total, lane,
                                                           reader, wg, k_tiles))
                _store_tile(cfg, self.epi, self.mainloop.tiled_mma, thr_mma, acc, sC, tid, atom_c, coord_c, row0, rows,
                            n_tile, mOut)
                linear = linear + grid
                expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)
            if cutlass.const_expr(cfg.tma_store):
                tma_store_drain(tid)

    @cute.jit
    def _stage_a(self, src: cute.Tensor, dst: cute.Tensor, slot: Int32, kt: Int32, words: cute.Tensor,
                 mult: cute.Tensor, mSA: cute.Tensor, row: Int32, m_total: Int32, lane: Int32, reader: Int32,
                 wg: Int32, k_tiles: Int32):
        """``Sm90Mainloop.mma_tile``'s A staging: this warp's 16 A rows of k-tile ``kt``, e4m3
        ring slot ``slot`` -> BF16 A buffer kt % 2 (last read by batch kt - 2, retired by the
        previous ``wait_group(1)``); the next k-tile's scale word is loaded meanwhile; then the
        stores are fenced for the async proxy and the warpgroup meets at its named barrier (its
        wgmma reads all 64 rows). Returns the buffer index."""
        buf = kt % ACT_A_BUFFERS
        _decode(words, mult, kt, lane)
        _load_words(words, mSA, row, m_total, cutlass.min(kt + 1, k_tiles - 1))
        _convert(src[(None, None, 0, slot)], dst[(None, None, 0, buf)], mult, reader)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=_ACT_BARRIER + wg, number_of_threads=THREADS_PER_WG)
        return buf


# ---------------------------------------------------------------- TMA atoms, epilogue
def _tma_atoms(cfg: MainloopConfig, mA: cute.Tensor, a_smem, mB: cute.Tensor, b_smem, mOut: cute.Tensor):
    """(atom_a, coord_a, atom_b, coord_b, atom_c, coord_c): TMA loads of A [M, K] into ``a_smem``
    stages and of B [E, N, K] (tiled as (N, K, E)) into ``b_smem`` stages, and the output's TMA
    store (None, None without ``cfg.tma_store``)."""
    b_nke = experts_last(mB)
    atom_a, coord_a = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(a_smem, (None, None, 0)), (cfg.tile_m, cfg.tile_k))
    atom_b, coord_b = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), b_nke, cute.slice_(b_smem, (None, None, 0)), (cfg.tile_n, cfg.tile_k))
    atom_c, coord_c = None, None
    if cutlass.const_expr(cfg.tma_store):
        atom_c, coord_c = make_tma_store(_ragged_rows(mOut), cfg.tile_m, cfg.tile_n)
    return atom_a, coord_a, atom_b, coord_b, atom_c, coord_c


@cute.jit
def _store_tile(cfg: cutlass.Constexpr, epi: cutlass.Constexpr, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma,
                acc: cute.Tensor, sC: cute.Tensor, tid: Int32, atom_c: cute.CopyAtom, coord_c: cute.Tensor,
                row0: Int32, rows: Int32, n_tile: Int32, mOut: cute.Tensor):
    """The BF16 kernel's plain epilogue of one output tile: TMA store (``cfg.tma_store``) or
    masked 16-byte stores of the tile's ``rows`` valid rows from ``row0``."""
    if cutlass.const_expr(cfg.tma_store):
        gC = rows_tma_tile(coord_c, row0, rows, n_tile, cfg.tile_m, cfg.tile_n)
        tma_store_tile(thr_mma, acc, sC, tid, atom_c, gC)
    else:
        epi.run(tiled_mma, thr_mma, acc, sC, tid, row0, rows, n_tile, mOut, mOut, Float32(0.0))


# ---------------------------------------------------------------- dequant building blocks
def _copies(tile_k: int):
    """(read, write) tiled copies of a dequant warp: 8 lanes per row, 4 rows per pass;
    read = 8 e4m3 bytes as 2 words, write = 8 bf16 as one 16-byte vector."""
    tpr = tile_k // _VEC
    thr = cute.make_layout((32 // tpr, tpr), stride=(tpr, 1))
    rd = cute.make_tiled_copy_tv(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=64),
                                 thr, cute.make_layout((1, 2)))
    wr = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128),
        thr, cute.make_layout((1, _VEC)))
    return rd, wr


def _lanes(lane):
    """(hold_row, reader) of a dequant lane. Pass p of lane l covers row l // 8 + 4 p,
    columns 8 (l % 8) .. + 7 (:func:`_copies`): block (l % 8) // 4 of the k-tile. Multipliers
    are decoded once per (row, block): lane h holds in mult[j] the one of row 16 j + 4 (h // 8)
    + (h % 8) // 2 (its ``hold_row`` + 16 j), block h % 2, so pass p reads mult[p // 4] of
    lane ``reader`` + 8 (p % 4), reader = 2 (l // 8) + (l % 8) // 4."""
    return 4 * (lane // 8) + (lane % 8) // 2, 2 * (lane // 8) + (lane % 8) // 4


@cute.jit
def _decode(words: cute.Tensor, mult: cute.Tensor, kt: Int32, lane: Int32):
    """``mult[j]``: fp32 bits of 2^(s - 127) for the held (row, block) of k-tile ``kt``
    (block 2 kt + lane % 2: byte 2 (kt % 2) + lane % 2 of word kt // 2)."""
    shift = Uint32(8 * (2 * (kt % 2) + lane % 2))
    for j in cutlass.range_constexpr(cute.size(words)):
        mult[j] = Fp8Ops(bf16=True).scale_bits((words[j] >> shift) & Uint32(0xFF))


@cute.jit
def _load_words(words: cute.Tensor, mSA: cute.Tensor, row: Int32, m_total: Int32, kt: Int32):
    """``words[j]``: the scale word (4 E8M0 bytes: k-tiles 2 (kt // 2) and 2 (kt // 2) + 1) of
    row ``row + 16 j`` of A (rows past M read the last row: their data is TMA zero fill and their
    output rows are never stored)."""
    for j in cutlass.range_constexpr(cute.size(words)):
        words[j] = Uint32(mSA[cutlass.min(row + 16 * j, m_total - 1), kt // 2])


@cute.jit
def _convert(src: cute.Tensor, dst: cute.Tensor, mult: cute.Tensor, reader: Int32):
    """The row passes of a k-tile: e4m3 words ``src`` (vals, passes) -> bf16 vectors ``dst``;
    pass p's multiplier is ``mult[p // 4]`` of lane ``reader + 8 (p % 4)``."""
    ops = Fp8Ops(bf16=True)
    for p in cutlass.range_constexpr(cute.size(src, mode=[1])):
        m = cute.arch.shuffle_sync(mult[p // 4], reader + 8 * (p % 4))
        data = cute.make_rmem_tensor_like(src[(None, p)])
        cute.autovec_copy(src[(None, p)], data)
        vec = cute.make_rmem_tensor_like(dst[(None, p)])
        out = cute.recast_tensor(vec, Uint32)
        for i in cutlass.range_constexpr(2):
            ps = ops.deq4(data[i], [m] * 4)
            out[2 * i] = ops.bf16x2(ps[0], ps[1])
            out[2 * i + 1] = ops.bf16x2(ps[2], ps[3])
        cute.autovec_copy(vec, dst[(None, p)])


# ---------------------------------------------------------------- compile
def compile_mxfp8_mixed_gemm(cfg: MainloopConfig = DEFAULT_CONFIG, arch: str = "sm_90a", inspect: bool = False):
    """Compile the mixed-input MXFP8 grouped GEMM (:class:`Mxfp8ActGemmSm90`: MXFP8 activations,
    bf16 weights) with symbolic M, N, K, E; ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 mixed-input MXFP8 GEMM needs arch sm_90a, got {arch!r}")
    f8 = cutlass.Float8E4M3FN
    m, n, e, kw = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=16)
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    a, sa, out = _fake_2d(f8, m, k), _fake(Int32, (m, kw), 1), _fake_2d(cutlass.BFloat16, m, n)
    op, args = Mxfp8ActGemmSm90(cfg), (a, sa, _fake_3d(cutlass.BFloat16, e, n, k), offs, out)
    return compile_kernel(op, *args, Int32(1), cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


# ---------------------------------------------------------------- host wrapper
def _check_mx_scales(name, t, shape):
    _check_tensor(name, t, len(shape), (torch.uint8,))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be uint8 E8M0 {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous() or t.data_ptr() % 4:
        raise ValueError(f"{name} must be contiguous and 4-byte aligned")


def check_mxfp8_operands(a, a_scales, offsets, w, out, tile_n: int):
    """Validate the operands of :func:`grouped_gemm_mxfp8_mixed` (``w`` a bf16 weight
    [E, N, K]) before any launch; returns ``(M, N, E, out)`` (``out`` allocated if None)."""
    _check_tensor("a", a, 2, (torch.float8_e4m3fn,))
    _check_tensor("w", w, 3, (torch.bfloat16,))
    e = _check_offsets(offsets)
    m, k = a.shape
    n = w.shape[1]
    if k % SCALE_BLOCK or k == 0:
        raise ValueError(f"a: K={k} must be a positive multiple of {SCALE_BLOCK}")
    if tuple(w.shape) != (e, n, k) or n == 0 or n % tile_n:
        raise ValueError(f"w must be [E={e}, N, K={k}] with N a positive multiple of tile_n={tile_n}, "
                         f"got {tuple(w.shape)}")
    for name, t in (("a", a), ("w", w)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous (K contiguous) and 16-byte aligned")
    _check_mx_scales("a_scales", a_scales, (m, k // MX_BLOCK))
    out = _check_out("out", out, (m, n), a.device)
    _check_devices(a=a, a_scales=a_scales, offsets=offsets, w=w, out=out)
    return m, n, e, out


def grouped_gemm_mxfp8_mixed(a, a_scales, offsets, w, *, out=None, cfg: MainloopConfig = DEFAULT_CONFIG):
    """out [M, N] bf16: rows of expert e = bf16(fp32 sum over K of deq(a) * w[e]) with
    deq(q, s) = bf16(fp32(q) * 2^(s - 127)) (scale 0xFF: NaN); w a bf16 weight (e.g. an MXFP8
    weight dequantized once per weight version); bitwise
    ``grouped_gemm(dequantize_mxfp8(a, a_scales), offsets, w)`` and bitwise repeatable.

    a [M, K] float8_e4m3fn contiguous, K a positive multiple of 128; a_scales uint8 [M, K/32]
    contiguous; w [E, N, K] bf16 contiguous, N a multiple of ``cfg.tile_n`` (256); offsets
    int32/int64 [E+1] on the device (0, non-decreasing, last = M; trusted, no host sync).
    ``out``: optional contiguous [M, N] bf16 (every row is written). The TMA-store epilogue
    follows the BF16 kernel's process-wide setting (``sm90.grouped_gemm.set_tma_store``).
    """
    m, n, e, out = check_mxfp8_operands(a, a_scales, offsets, w, out, cfg.tile_n)
    if m == 0:
        return out
    dev, arch = _sm90(a, "mixed-input MXFP8 GEMM")
    cfg = effective_config(cfg)
    launcher = compile_cached(("sm90_mxfp8_mixed_gemm", arch, cfg.key()),
                              lambda: GraphLauncher(compile_mxfp8_mixed_gemm(cfg, arch)[0]))
    tiles_bound = (-(-m // cfg.tile_m) + e) * (n // cfg.tile_n)
    num_ctas = max(1, min(sm_count(dev), tiles_bound))
    offs32 = offsets_i32(offsets)
    sa32 = a_scales.view(torch.int32)
    key = (tensor_key(a), tensor_key(sa32), tensor_key(w), offs32.data_ptr(), offs32.shape, tensor_key(out), num_ctas)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda stream: (
        _Desc(a), _Desc(sa32), _Desc(w), _Desc(offs32), _Desc(out), Int32(num_ctas), stream))
    return out

"""Warp-specialized Blackwell (sm_100a / sm_103a) GEMM mainloop with TMEM accumulators.

Roles (192 threads): warps 0-3 are the epilogue (they allocate tensor memory, read finished
accumulators with ``tcgen05.ld`` and store them; thread t owns accumulator row t), warp 4
issues ``tcgen05.mma`` (one elected thread), warp 5 issues the TMA loads. Two mbarrier
pipelines connect them: A/B (+ scale factor) k-tiles in a ring of shared-memory stages
(``PipelineTmaUmma``: TMA -> MMA), and ``acc_stages`` FP32 accumulator buffers in tensor
memory (``PipelineUmmaAsync``: MMA -> epilogue), so the epilogue of one tile overlaps the
MMAs of the next.

Operand types (:class:`Sm100Config` ``ab_dtype``):
* ``cutlass.BFloat16``: ``tcgen05.mma.kind::f16``.
* ``cutlass.Float8E4M3FN`` (MXFP8): ``tcgen05.mma.kind::mxf8f6f4.block_scale`` with one E8M0
  scale per 32 elements along K; each k-tile's SFA / SFB bytes are TMA-loaded with A and B
  and copied shared -> tensor memory (``tcgen05.cp``) right before the MMAs that read them.
  Scales live in the 128x4 blocked layout of :mod:`mok_cute.kernels.sm100.layouts`.

``tile_m`` 256 selects ``cta_group::2``: a cluster of two CTAs computes one 256-row tile,
each CTA holding 128 rows of A, half of B's rows and its own 128 accumulator rows; the
leader CTA issues the MMAs. MXFP8 with ``cta_group::2``: each CTA loads its rows' SFA; SFB
(the whole tile's N, padded to 128) is split between the two CTAs' TMA loads and multicast to
both (a separate one-CTA tiled MMA of shape (tile_m / 2, N) describes its partition), so each
CTA's shared memory, and then its TMEM, holds every SFB column the pair's MMAs read.

Operands are given as A (M, K, L) and B (N, K, L) views (tile = A @ B^T), each K-major or
MN-major (:data:`K_MAJOR` / :data:`MN_MAJOR`), read in place by TMA and the MMA. The
building blocks are per tile (the driver picks tile coordinates): :meth:`Sm100Mainloop.load_tile`
(TMA warp), :meth:`Sm100Mainloop.mma_tile` (MMA warp), :class:`AccChunks` (epilogue).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.cute.core as core
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass._mlir.dialects import cute_nvgpu as nvgpu_ir  # the gather4 TMA atom (no public builder for an MMA operand)
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from mok_cute.kernels.sm100 import layouts as lay

EPI_WARPS = 4
MMA_WARP = 4
TMA_WARP = 5
NUM_THREADS = 32 * 6
EPI_THREADS = 32 * EPI_WARPS
EPI_N = 32  # accumulator columns per tcgen05.ld chunk (one 32x32b.x32 load per warp)
SF_DTYPE = cutlass.Float8E8M0FNU
K_MAJOR = "k"
MN_MAJOR = "mn"
_MAJOR = {K_MAJOR: OperandMajorMode.K, MN_MAJOR: OperandMajorMode.MN}
_EPI_BARRIER = 1
_TMEM_BARRIER = 2


@dataclass(frozen=True)
class Sm100Config:
    """Compile-time shape of the mainloop.

    ``tile_m``: 128 (one CTA) or 256 (``cta_group::2``, cluster of 2 along M).
    ``tile_n``: multiple of 32 in [32, 256] (BF16), 128 or 256 (MXFP8). ``tile_k`` is fixed at
    128 bytes (64 BF16 / 128 FP8 elements = 4 MMA k-blocks; for MXFP8 one scale atom).
    ``stages`` 0: as many ring stages as fit; ``acc_stages`` 0: 2 if they fit in TMEM.
    """

    tile_m: int = 128
    tile_n: int = 256
    stages: int = 0
    acc_stages: int = 0
    ab_dtype: type = cutlass.BFloat16

    @property
    def mx(self) -> bool:
        return self.ab_dtype is cutlass.Float8E4M3FN

    @property
    def cta_group(self) -> int:
        return 2 if self.tile_m == 256 else 1

    @property
    def tile_k(self) -> int:
        return lay.K_TILE_BYTES * 8 // self.ab_dtype.width

    @property
    def num_acc_stages(self) -> int:
        return self.acc_stages or lay.acc_stages(self.tile_n, self.mx, self.tile_m // self.cta_group)

    @property
    def num_stages(self) -> int:
        return lay.num_stages(self.tile_m, self.tile_n, self.mx, self.cta_group, self.stages)

    def tmem_columns(self) -> tuple[int, int]:
        return lay.tmem_columns(self.tile_n, self.num_acc_stages, self.mx, self.tile_m // self.cta_group)

    def validate(self) -> None:
        if self.ab_dtype not in (cutlass.BFloat16, cutlass.Float8E4M3FN):
            raise ValueError(f"ab_dtype must be BFloat16 or Float8E4M3FN (MXFP8), got {self.ab_dtype}")
        if self.tile_m not in (128, 256):
            raise ValueError(f"tile_m must be 128 or 256 (cta_group::2), got {self.tile_m}")
        if self.mx and self.tile_n not in (128, 256):
            raise ValueError(f"MXFP8 tile_n must be 128 or 256, got {self.tile_n}")
        if self.tile_n % EPI_N or not EPI_N <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of {EPI_N} in [{EPI_N}, 256], got {self.tile_n}")
        used, alloc = self.tmem_columns()
        if alloc > lay.TMEM_COLUMNS:
            raise ValueError(f"{used} TMEM columns needed, only {lay.TMEM_COLUMNS} exist")
        if self.num_stages < 2:
            raise ValueError(f"only {self.num_stages} pipeline stage(s) fit in shared memory")
        if self.num_stages * lay.stage_bytes(self.tile_m, self.tile_n, self.mx, self.cta_group) \
                + lay.SMEM_RESERVED > lay.SMEM_CAPACITY:
            raise ValueError(f"{self.num_stages} stages exceed shared memory")

    def key(self) -> tuple:
        return (self.tile_m, self.tile_n, self.stages, self.acc_stages, self.ab_dtype.__name__)


def _tma_partition(atom, smem, tCg):
    """``(smem, gmem)`` TMA views of a shared tile and its MMA-partitioned coordinates."""
    s, g = cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                            cute.group_modes(tCg, 0, 3))
    return cute.filter_zeros(s), cute.filter_zeros(g)


class Sm100Mainloop:
    """Tiled MMA, shared/tensor memory layouts, TMA atoms, pipelines and per-tile loops.

    Construct on the host; call :meth:`setup` inside the ``@cute.jit`` launcher and again in
    the kernel (it builds MLIR values). ``a_major``/``b_major``: which of A's (M, K) and B's
    (N, K) modes is contiguous in global memory.
    """

    def __init__(self, cfg: Sm100Config, a_major: str = K_MAJOR, b_major: str = K_MAJOR):
        cfg.validate()
        for name, major in (("a_major", a_major), ("b_major", b_major)):
            if major not in _MAJOR:
                raise ValueError(f"{name} must be {K_MAJOR!r} or {MN_MAJOR!r}, got {major!r}")
        self.cfg, self.a_major, self.b_major = cfg, _MAJOR[a_major], _MAJOR[b_major]
        self.stages, self.acc_stages = cfg.num_stages, cfg.num_acc_stages
        self.tmem_used, self.tmem_alloc = cfg.tmem_columns()
        self.mma_tiler = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.cta_tile_m = cfg.tile_m // cfg.cta_group
        self.stage_bytes = lay.stage_bytes(cfg.tile_m, cfg.tile_n, cfg.mx, cfg.cta_group)
        self.smem_bytes = self.stages * self.stage_bytes + lay.SMEM_RESERVED

    # ------------------------------------------------------------ host/trace-time setup
    def setup(self):
        """Tiled MMA, staged shared layouts, cluster layout (call inside jit)."""
        cfg = self.cfg
        self.tiled_mma = self.make_tiled_mma()
        self.cluster_vmnk = cute.tiled_divide(cute.make_layout((cfg.cta_group, 1, 1)),
                                              (self.tiled_mma.thr_id.shape,))
        self.tiled_mma_sfb, self.mma_tiler_sfb, self.cluster_sfb_vmnk = self.tiled_mma, self.mma_tiler, self.cluster_vmnk
        if cutlass.const_expr(cfg.mx and cfg.cta_group == 2):
            n_sfb = -(-cfg.tile_n // 128) * 128
            self.mma_tiler_sfb = (cfg.tile_m // 2, n_sfb, cfg.tile_k)
            self.tiled_mma_sfb = sm100.make_blockscaled_trivial_tiled_mma(
                cfg.ab_dtype, cfg.ab_dtype, self.a_major, self.b_major, SF_DTYPE, lay.SF_VEC, tcgen05.CtaGroup.ONE,
                self.mma_tiler_sfb[:2])
            self.cluster_sfb_vmnk = cute.tiled_divide(cute.make_layout((cfg.cta_group, 1, 1)),
                                                      (self.tiled_mma_sfb.thr_id.shape,))
        self.a_smem = sm100.make_smem_layout_a(self.tiled_mma, self.mma_tiler, cfg.ab_dtype, self.stages)
        self.b_smem = sm100.make_smem_layout_b(self.tiled_mma, self.mma_tiler, cfg.ab_dtype, self.stages)
        one_a = cute.slice_(self.a_smem, (None, None, None, 0))
        one_b = cute.slice_(self.b_smem, (None, None, None, 0))
        tx = cute.size_in_bytes(cfg.ab_dtype, one_a) + cute.size_in_bytes(cfg.ab_dtype, one_b)
        if cutlass.const_expr(cfg.mx):
            self.sfa_smem = blockscaled.make_smem_layout_sfa(self.tiled_mma, self.mma_tiler, lay.SF_VEC, self.stages)
            self.sfb_smem = blockscaled.make_smem_layout_sfb(self.tiled_mma, self.mma_tiler, lay.SF_VEC, self.stages)
            tx += cute.size_in_bytes(SF_DTYPE, cute.slice_(self.sfa_smem, (None, None, None, 0)))
            tx += cute.size_in_bytes(SF_DTYPE, cute.slice_(self.sfb_smem, (None, None, None, 0)))
        if tx != self.stage_bytes:  # sm100.layouts.stage_bytes is the budget the host relies on
            raise ValueError(f"stage bytes: CuTe {tx}, sm100.layouts {self.stage_bytes}")
        self.tx_bytes = tx * cfg.cta_group  # the leader's full barrier counts both CTAs' bytes

    def make_tiled_mma(self):
        """A fresh tiled MMA (the MMA warp owns one: its ACCUMULATE field changes in the loop)."""
        cfg = self.cfg
        group = tcgen05.CtaGroup.TWO if cfg.cta_group == 2 else tcgen05.CtaGroup.ONE
        if cutlass.const_expr(cfg.mx):
            return sm100.make_blockscaled_trivial_tiled_mma(
                cfg.ab_dtype, cfg.ab_dtype, self.a_major, self.b_major, SF_DTYPE, lay.SF_VEC, group,
                (cfg.tile_m, cfg.tile_n))
        return sm100.make_trivial_tiled_mma(
            cfg.ab_dtype, cfg.ab_dtype, self.a_major, self.b_major, cutlass.Float32, group, (cfg.tile_m, cfg.tile_n))

    def make_tma(self, mA: cute.Tensor, mB: cute.Tensor, mSFA: cute.Tensor = None, mSFB: cute.Tensor = None,
                 mA2: cute.Tensor = None, mB2: cute.Tensor = None):
        """TMA load atoms for A (M, K, ...), B (N, K, ...), (MXFP8) their scale tensors, and
        optionally the second parts A2 (M, K2, ...), B2 (N, K2, ...) of a K in two parts (the
        k-tiles after A's and B's; same smem layouts: :meth:`load_tile` ``part2``). Returns
        ``[(atom, coords)]`` for A, B[, SFA, SFB][, A2, B2]."""
        cfg = self.cfg
        cl = self.cluster_vmnk.shape
        op_a = sm100.cluster_shape_to_tma_atom_A((cfg.cta_group, 1), self.tiled_mma.thr_id)
        op_b = sm100.cluster_shape_to_tma_atom_B((cfg.cta_group, 1), self.tiled_mma.thr_id)
        out = [
            cute.nvgpu.make_tiled_tma_atom_A(op_a, mA, cute.slice_(self.a_smem, (None, None, None, 0)),
                                             self.mma_tiler, self.tiled_mma, cl),
            cute.nvgpu.make_tiled_tma_atom_B(op_b, mB, cute.slice_(self.b_smem, (None, None, None, 0)),
                                             self.mma_tiler, self.tiled_mma, cl),
        ]
        if cutlass.const_expr(cfg.mx):
            out.append(cute.nvgpu.make_tiled_tma_atom_A(
                op_a, mSFA, cute.slice_(self.sfa_smem, (None, None, None, 0)), self.mma_tiler, self.tiled_mma, cl,
                internal_type=cutlass.Int16))
            op_sfb = op_b
            if cutlass.const_expr(cfg.cta_group == 2):
                op_sfb = sm100.cluster_shape_to_tma_atom_SFB((cfg.cta_group, 1), self.tiled_mma.thr_id)
            out.append(cute.nvgpu.make_tiled_tma_atom_B(
                op_sfb, mSFB, cute.slice_(self.sfb_smem, (None, None, None, 0)), self.mma_tiler_sfb,
                self.tiled_mma_sfb, self.cluster_sfb_vmnk.shape, internal_type=cutlass.Int16))
        if cutlass.const_expr(mA2 is not None):
            out.append(cute.nvgpu.make_tiled_tma_atom_A(op_a, mA2, cute.slice_(self.a_smem, (None, None, None, 0)),
                                                        self.mma_tiler, self.tiled_mma, cl))
            out.append(cute.nvgpu.make_tiled_tma_atom_B(op_b, mB2, cute.slice_(self.b_smem, (None, None, None, 0)),
                                                        self.mma_tiler, self.tiled_mma, cl))
        return out

    # ------------------------------------------------------------ in-kernel construction
    def smem_tensors(self, storage):
        """``(sA, sB, sSFA, sSFB)`` staged shared tensors (scale tensors None for BF16)."""
        sA = storage.sA.get_tensor(self.a_smem.outer, swizzle=self.a_smem.inner)
        sB = storage.sB.get_tensor(self.b_smem.outer, swizzle=self.b_smem.inner)
        if cutlass.const_expr(self.cfg.mx):
            return sA, sB, storage.sSFA.get_tensor(self.sfa_smem), storage.sSFB.get_tensor(self.sfb_smem)
        return sA, sB, None, None

    def make_pipelines(self, storage):
        """``(ab_pipe, acc_pipe)`` on the storage's ``ab_bar`` (2 * stages) and ``acc_bar``
        (2 * acc_stages) mbarriers."""
        ab = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tx_bytes, cta_layout_vmnk=self.cluster_vmnk, defer_sync=True)
        acc = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_bar.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPI_THREADS * self.cfg.cta_group),
            cta_layout_vmnk=self.cluster_vmnk, defer_sync=True)
        return ab, acc

    def make_tmem_allocator(self, storage):
        return cutlass.memory.TmemAllocator(
            storage.tmem_ptr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_TMEM_BARRIER, num_threads=32 * (EPI_WARPS + 1)),
            allocator_warp_id=0, is_two_cta=self.cfg.cta_group == 2,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_bar.ptr)

    def acc_tensor(self, acc_ptr):
        """TMEM accumulators ((MMA_M, MMA_N), 1, 1, acc_stages) at ``acc_ptr``."""
        shape = self.tiled_mma.partition_shape_C(self.mma_tiler[:2])
        fake = self.tiled_mma.make_fragment_C(cute.append(shape, self.acc_stages))
        return cute.make_tensor(acc_ptr, fake.layout)

    def producer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)

    def consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

    def acc_producer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)

    def acc_consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)

    # ------------------------------------------------------------ TMA warp
    @cute.jit
    def partition_a(self, atom: cute.CopyAtom, gA: cute.Tensor, sA: cute.Tensor, cta_v: cutlass.Int32):
        """``(tAsA, tAgA)`` of a (tile_m, tile_k, ...) tiled A (or SFA) coordinate tensor."""
        return _tma_partition(atom, sA, self.tiled_mma.get_slice(cta_v).partition_A(gA))

    def make_gather4_tma_a(self, mA: cute.Tensor, mRows: cute.Tensor):
        """A TMA gather4 load atom for A (cta_group::1): the rows of the 2-D ``mA`` (R, K) named by the
        int32 row indices ``mRows`` [M] (``cp.async.bulk.tensor.2d.tile::gather4``, four rows per
        instruction), into A's staged MMA layout, projected as :meth:`make_tma`'s A atom is. Returns
        ``(atom, (coords, rows))``: the TMA coordinates of ``mA`` and ``mRows`` as an (M, K) tensor
        (its K mode a broadcast), the pair :meth:`partition_a_gather` takes."""
        if self.cfg.cta_group != 1:
            raise ValueError("the gather4 A atom is cta_group::1's")
        rows = cute.make_tensor(mRows.iterator, cute.make_layout((mRows.shape[0], mA.shape[1]), stride=(1, 0)))
        g_tile = core.composition(core.make_identity_layout(mA.shape), (self.mma_tiler[0], self.mma_tiler[2]))
        cta_v_map = core.dice(core.get(self.tiled_mma._thrfrg_A(g_tile), mode=[1]), (1, (1,) * core.rank(g_tile)))
        smem = cute.slice_(self.a_smem, (None, None, None, 0))
        op = cute.nvgpu.cpasync.CopyBulkTensor2DGather4G2SOp()
        res = nvgpu_ir.atom_make_non_exec_2d_gather4_tma_load(
            mA.value, rows.layout, smem.value if isinstance(smem, core._ComposedLayout) else smem, cta_v_map,
            op._to_ir(), num_multicast=1, tma_format=None)
        return cute.CopyAtom(op, cute.nvgpu.cpasync.CopyBulkTensor2DGather4G2SNonExecTrait(res[0])), (res[1], rows)

    @cute.jit
    def partition_a_gather(self, atom: cute.CopyAtom, gA: cute.Tensor, gRows: cute.Tensor, sA: cute.Tensor):
        """``(tAsA, (tAgA, tAgRows))`` of a gather4 A atom (:meth:`make_gather4_tma_a`) over (tile_m,
        tile_k, ...) tiles of its coordinates and of its row tensor: :meth:`load_tile` issues a pair
        source as one gather copy per k-tile."""
        part = self.tiled_mma.get_slice(0)
        s, g, r = cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
            [cute.group_modes(part.partition_A(gA), 0, 3), cute.group_modes(part.partition_A(gRows), 0, 3)])
        return s, (g, r)

    @cute.jit
    def partition_b(self, atom: cute.CopyAtom, gB: cute.Tensor, sB: cute.Tensor, cta_v: cutlass.Int32):
        """``(tBsB, tBgB)`` of a (tile_n, tile_k, ...) tiled B (or SFB) coordinate tensor."""
        return _tma_partition(atom, sB, self.tiled_mma.get_slice(cta_v).partition_B(gB))

    @cute.jit
    def partition_sfb(self, atom: cute.CopyAtom, gSFB: cute.Tensor, sSFB: cute.Tensor, cta_v: cutlass.Int32):
        """``(tBsSFB, tBgSFB)`` of a (tile_n, tile_k, ...) tiled SFB coordinate tensor; with
        cta_group::2 this CTA's half of the multicast load (see the module doc)."""
        if cutlass.const_expr(self.cfg.cta_group == 1):
            return self.partition_b(atom, gSFB, sSFB, cta_v)
        coord = self.cluster_sfb_vmnk.get_flat_coord(cta_v)
        cta_layout = cute.make_layout(cute.slice_(self.cluster_sfb_vmnk, (0, None, 0, 0)).shape)
        s, g = cute.nvgpu.cpasync.tma_partition(atom, coord[1], cta_layout, cute.group_modes(sSFB, 0, 3),
                                                cute.group_modes(self.tiled_mma_sfb.get_slice(cta_v).partition_B(gSFB),
                                                                 0, 3))
        return cute.filter_zeros(s), cute.filter_zeros(g)

    def mcast_masks(self, cta_v):
        """TMA multicast masks of A, B, SFA, SFB for cta_group::2 (both CTAs' A/B/SFA loads
        signal the leader; SFB multicast to both CTAs), else None."""
        if cutlass.const_expr(self.cfg.cta_group == 1):
            return None, None, None, None
        coord = self.cluster_vmnk.get_flat_coord(cta_v)
        mask = cute.nvgpu.cpasync.create_tma_multicast_mask
        a, b = mask(self.cluster_vmnk, coord, mcast_mode=2), mask(self.cluster_vmnk, coord, mcast_mode=1)
        if cutlass.const_expr(not self.cfg.mx):
            return a, b, None, None
        sfb = mask(self.cluster_sfb_vmnk, self.cluster_sfb_vmnk.get_flat_coord(cta_v), mcast_mode=1)
        return a, b, a, sfb

    @cute.jit
    def load_tile(self, pipe, state, atoms, srcs, dsts, k_tiles: cutlass.Int32, sf_k0: cutlass.Int32, masks,
                  part2=None):
        """TMA warp: load k-tiles ``0 .. k_tiles-1`` of one tile into the ring; returns the state.

        ``atoms``/``srcs``/``dsts``: A, B[, SFA, SFB] atoms, per-tile gmem TMA partitions
        ((atom_v), k) and staged smem partitions ((atom_v), stage); a pair source ``(coords, rows)`` is
        a gather4 atom's (:meth:`partition_a_gather`). Scale k-tile ``k`` is read
        at ``sf_k0 + k`` (wgrad: the expert's first scale atom column; else 0). ``part2``: None
        or ``((atom_a2, atom_b2), (src_a2, src_b2), k1)``: A and B k-tiles ``k >= k1`` are
        k-tile ``k - k1`` of the second parts (K in two parts).
        """
        for k in cutlass.range(k_tiles, unroll=1):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            for i in cutlass.range_constexpr(len(atoms)):
                dst = dsts[i][(None, state.index)]
                if cutlass.const_expr(i < 2 and part2 is not None):
                    if k < part2[2]:
                        cute.copy(atoms[i], srcs[i][(None, k)], dst, tma_bar_ptr=bar, mcast_mask=masks[i])
                    else:
                        cute.copy(part2[0][i], part2[1][i][(None, k - part2[2])], dst, tma_bar_ptr=bar,
                                  mcast_mask=masks[i])
                elif cutlass.const_expr(isinstance(srcs[i], tuple)):  # gather4: coordinates and row indices
                    cute.copy(atoms[i], [srcs[i][0][(None, k)], srcs[i][1][(None, k)]], dst, tma_bar_ptr=bar)
                else:
                    kk = k if i < 2 else sf_k0 + k
                    cute.copy(atoms[i], srcs[i][(None, kk)], dst, tma_bar_ptr=bar, mcast_mask=masks[i])
            pipe.producer_commit(state)
            state.advance()
        return state

    # ------------------------------------------------------------ MMA warp
    def mma_fragments(self, sA, sB, sSFA, sSFB, acc_ptr):
        """MMA-side views: A/B smem descriptors, and for MXFP8 the TMEM scale tensors placed
        after the accumulators plus the shared->TMEM (``tcgen05.cp``) copies that fill them.
        Returns ``(tCrA, tCrB, sf)`` where ``sf`` is None or a tuple of the scale views."""
        tCrA = self.tiled_mma.make_fragment_A(sA)
        tCrB = self.tiled_mma.make_fragment_B(sB)
        if cutlass.const_expr(not self.cfg.mx):
            return tCrA, tCrB, None
        sfa_cols, _ = lay.sf_tmem_columns(self.cta_tile_m, self.cfg.tile_n)
        acc_cols = self.cfg.tile_n * self.acc_stages
        views = []
        for col, smem, make in ((acc_cols, sSFA, blockscaled.make_tmem_layout_sfa),
                                (acc_cols + sfa_cols, sSFB, blockscaled.make_tmem_layout_sfb)):
            layout = make(self.tiled_mma, self.mma_tiler, lay.SF_VEC, cute.slice_(smem.layout, (None, None, None, 0)))
            t_sf = cute.make_tensor(cute.recast_ptr(acc_ptr + col, dtype=SF_DTYPE), layout)
            atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(
                tcgen05.CtaGroup.TWO if self.cfg.cta_group == 2 else tcgen05.CtaGroup.ONE), SF_DTYPE)
            t_compact = cute.filter_zeros(t_sf)
            copy = tcgen05.make_s2t_copy(atom, t_compact)
            thr = copy.get_slice(0)
            src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(cute.filter_zeros(smem)))
            views.append((t_sf, copy, src, thr.partition_D(t_compact)))
        return tCrA, tCrB, tuple(views)

    @cute.jit
    def mma_tile(self, tiled_mma: cute.TiledMma, pipe, state, tCrA: cute.Tensor, tCrB: cute.Tensor, sf,
                 acc: cute.Tensor, k_tiles: cutlass.Int32):
        """MMA warp (leader CTA): ``acc = A_tile @ B_tile^T`` over ``k_tiles`` (>= 1) ring
        slots; each slot is released (``tcgen05.commit`` to its empty barrier) once the MMAs
        reading it retire. ``tiled_mma``: the warp's own (:meth:`make_tiled_mma`). Returns
        ``(state, tiled_mma)`` (rebind both: the MMA's ACCUMULATE field is loop state)."""
        k_blocks = cute.size(tCrA, mode=[2])
        for k in cutlass.range(k_tiles, unroll=1):
            pipe.consumer_wait(state)
            if cutlass.const_expr(sf is not None):
                for t_sf, copy, src, dst in sf:
                    cute.copy(copy, src[(None, None, None, None, state.index)], dst)
            for kb in cutlass.range_constexpr(k_blocks):
                if cutlass.const_expr(kb == 0):
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
                else:
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                crd = (None, None, kb, state.index)
                if cutlass.const_expr(sf is not None):
                    cute.gemm(tiled_mma, acc, [tCrA[crd], sf[0][0][(None, None, kb)]],
                              [tCrB[crd], sf[1][0][(None, None, kb)]], acc)
                else:
                    cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            pipe.consumer_release(state)
            state.advance()
        return state, tiled_mma


class AccChunks:
    """Epilogue view of one CTA's (128, tile_n) FP32 accumulator in TMEM, read in chunks of
    :data:`EPI_N` columns with ``tcgen05.ld.32x32b.x32``: epilogue thread t (warp t // 32
    reads TMEM lanes 32 * (t // 32) ..) gets row t, columns ``c * EPI_N ..`` of chunk c.
    """

    def __init__(self, acc: cute.Tensor, tid: cutlass.Int32):
        tile = acc[((None, None), 0, 0)]  # (128, tile_n)
        self.chunks = cute.flat_divide(tile, (EPI_THREADS, EPI_N))  # (128, EPI_N, 1, n_chunks)
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32)
        self.copy = tcgen05.make_tmem_copy(atom, self.chunks[(None, None, 0, 0)])
        self.thr = self.copy.get_slice(tid)
        self.src = self.thr.partition_S(self.chunks)
        coords = self.thr.partition_D(cute.make_identity_tensor((EPI_THREADS, EPI_N)))
        self.reg_shape = coords.shape
        self.row = coords[0][0]  # this thread's accumulator row

    def num_chunks(self) -> int:
        return cute.size(self.chunks, mode=[3])

    def load(self, c) -> cute.Tensor:
        """FP32 registers of chunk ``c`` (this thread's row, EPI_N columns; ``c`` static)."""
        return tmem_load(self.copy, self.src[(None, None, None, 0, c)], self.reg_shape)

    def part(self, g_chunk: cute.Tensor) -> cute.Tensor:
        """This thread's elements (its row) of a (128, EPI_N) gmem tile, shaped like :meth:`load`."""
        return self.thr.partition_D(g_chunk)

    def part_all(self, g_tile: cute.Tensor) -> cute.Tensor:
        """This thread's elements of a (128, tile_n) gmem tile; ``[(None, None, None, 0, c)]``
        is chunk c (for loops over a dynamic ``c``, where :meth:`load`/:meth:`part` cannot be
        called: the DSL would carry this object through the loop)."""
        return self.thr.partition_D(cute.flat_divide(g_tile, (EPI_THREADS, EPI_N)))


@cute.jit
def tmem_load(copy: cute.TiledCopy, src: cute.Tensor, reg_shape: cutlass.Constexpr) -> cute.Tensor:
    """``tcgen05.ld`` of one accumulator chunk (``AccChunks.src[..., c]``) into FP32 registers,
    then ``tcgen05.wait::ld`` so they can be read."""
    r = cute.make_rmem_tensor(reg_shape, cutlass.Float32)
    cute.copy(copy, src, r)
    cute.arch.fence_view_async_tmem_load()
    return r


def epi_barrier():
    """Named barrier over the four epilogue warps."""
    cute.arch.barrier(barrier_id=_EPI_BARRIER, number_of_threads=EPI_THREADS)

"""Warp-specialized Hopper (sm_90a) GEMM mainloop: one output tile at a time.

Roles (384 threads): warpgroup 0 is the producer (warp 0 issues TMA loads of A and B
k-tiles into a ring of ``stages`` shared-memory buffers guarded by a PipelineTmaAsync
mbarrier pipeline; the warpgroup gives registers back with ``setmaxnreg``); warpgroups 1-2
are the consumers (``wgmma``, operands from shared memory, FP32 accumulators, each
warpgroup owns 64 of the tile's ``tile_m = 128`` rows; they take registers with
``setmaxnreg``).

The building blocks are per tile, so any persistent driver (a grouped GEMM, a future
megakernel) picks the tile coordinates and the epilogue:

* :meth:`Sm90Mainloop.load_tile` (producer warp) streams the k-tiles of one (A tile,
  B tile) pair into the ring;
* :meth:`Sm90Mainloop.mma_tile` (consumer warpgroups) accumulates them into registers;
* :func:`acc_to_smem` converts the accumulators and stages the whole tile in shared memory,
  where a pluggable epilogue reads it back (see ``sm90.grouped_gemm``).

Device operand bundles (:class:`typing.NamedTuple`, flattened in field order where a kernel takes them):
:class:`TmaLoads` (a grouped GEMM's TMA load atoms and coordinates), :class:`GroupWalk` (a CTA's tile walk),
:class:`SplitB` / :class:`StackedB` (B from two tensors, along K / along N).

B gathered along K (:meth:`Sm90Mainloop.load_tile_gather_b`, an MN-major B whose K rows are arbitrary
rows of a row-major tensor, e.g. the tokens' x rows of one expert's routed rows in a weight gradient):
the producer warps' lanes copy each k-tile's rows by 16-byte ``cp.async`` into their swizzled places
(rows past the expert and columns past the tensor zero-filled) while one lane TMA-loads A; each lane's
``cp.async.mbarrier.arrive`` (counted: it raises the slot's pending arrivals before its warp's arrival)
makes the slot's full barrier wait for its copies. Such a pipeline counts one producer arrival per warp
(``producers``); its TMA-only tiles add the other warps' in one arrive (``load_tile(extra_arrivals=)``).

Operands are given logically as A (M, K) and B (N, K) (the tile is ``A @ B^T``); each is
K-major (K contiguous: rows of a [M, K] / [N, K] tensor) or MN-major (M resp. N contiguous:
a [K, M] / [K, N] tensor seen transposed), chosen per operand (``a_major``/``b_major``,
:data:`K_MAJOR` or :data:`MN_MAJOR`). MN-major operands get MN-contiguous swizzled shared
layouts that wgmma reads directly (BF16/FP16 only), so no transpose copy is ever made.
The producer and consumers must walk the same tile sequence (each reads the same pipeline
in order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from mok_cute.schedule.group_tiles import seek, tile_coords

SMEM_BYTES = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
THREADS_PER_WG = 128
NUM_CONSUMER_WG = 2
NUM_THREADS = THREADS_PER_WG * (1 + NUM_CONSUMER_WG)
NUM_CONSUMER_THREADS = THREADS_PER_WG * NUM_CONSUMER_WG
PRODUCER_REGS = 40
CONSUMER_REGS = 232
_BARRIER_BYTES = 1024  # mbarriers and struct padding
UNIT = 16  # bytes per cp.async copy of a gathered B row
K_MAJOR = "k"
MN_MAJOR = "mn"
_LAYOUT = {K_MAJOR: LayoutEnum.ROW_MAJOR, MN_MAJOR: LayoutEnum.COL_MAJOR}


@dataclass(frozen=True)
class MainloopConfig:
    """Compile-time shape of the mainloop.

    ``tile_m`` is 128 (two consumer warpgroups of 64 rows); ``tile_n`` a multiple of 16 up
    to 256; ``tile_k`` 64 for 16-bit operands (128 bytes: one swizzle atom). ``stages`` 0
    picks as many ring buffers as fit beside the epilogue's shared memory.
    ``cluster_mn`` is carried for later multicast work; only (1, 1) is implemented.
    ``ab_dtype`` is the operand type (``cutlass.BFloat16``; FP8 e4m3 later).
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 0
    cluster_mn: tuple[int, int] = (1, 1)
    ab_dtype: type = cutlass.BFloat16
    acc_dtype: type = cutlass.Float32

    def validate(self) -> None:
        if self.tile_m != 128:
            raise ValueError(f"tile_m must be 128, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if self.tile_k * self.ab_dtype.width != 1024:
            raise ValueError(f"tile_k must span 128 bytes ({1024 // self.ab_dtype.width} elements), got {self.tile_k}")
        if tuple(self.cluster_mn) != (1, 1):
            raise ValueError(f"cluster_mn {self.cluster_mn} not implemented, only (1, 1)")
        if self.ab_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise ValueError(f"ab_dtype {self.ab_dtype} not implemented (BFloat16, Float16)")

    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k * self.ab_dtype.width // 8

    def num_stages(self, epi_smem_bytes: int) -> int:
        """Ring depth: ``stages`` if set, else as many as fit next to the epilogue."""
        if self.stages:
            return self.stages
        return (SMEM_BYTES - _BARRIER_BYTES - epi_smem_bytes) // self.stage_bytes()

    def key(self) -> tuple:
        return (self.tile_m, self.tile_n, self.tile_k, self.stages, tuple(self.cluster_mn),
                self.ab_dtype.__name__, self.acc_dtype.__name__)


def launch_config(tile_n: int | None = None, stages: int | None = None) -> MainloopConfig:
    """The BF16 mainloop of a launch's tile choices (``FusedLaunch`` / ``BackwardLaunch`` / the layer's
    policy, checked there): ``tile_n`` (None: the default 256) and ``stages`` (None: as many as fit);
    tile_m and tile_k the defaults. Both None: ``MainloopConfig()`` itself (the same compile key)."""
    default = MainloopConfig()
    return MainloopConfig(tile_n=default.tile_n if tile_n is None else tile_n,
                          stages=default.stages if stages is None else stages)


class TmaLoads(NamedTuple):
    """A grouped GEMM kernel's TMA load atoms and coordinate tensors (:meth:`Sm90Mainloop.make_tma`): A (M, K),
    B (N, K, E) and B2 (N, K, E), B's second part along K or (gate / up) the upper half of each B tile along N;
    ``atom_b2`` / ``coord_b2`` None without one. Kernel parameters in this order."""

    atom_a: cute.CopyAtom
    coord_a: cute.Tensor
    atom_b: cute.CopyAtom
    coord_b: cute.Tensor
    atom_b2: cute.CopyAtom = None
    coord_b2: cute.Tensor = None


class GroupWalk(NamedTuple):
    """A CTA's persistent walk over a grouped GEMM's tiles (:mod:`mok_cute.schedule.group_tiles`):
    ``offsets`` int32 [E+1], the expert count, n-tiles per m-tile, and the walk's start (``linear``, ``expert``,
    ``base``: :func:`~mok_cute.schedule.group_tiles.grouped_start`) and stride ``grid`` (Int32 each)."""

    offsets: cute.Tensor
    num_experts: cutlass.Int32
    n_tiles: cutlass.Int32
    linear: cutlass.Int32
    expert: cutlass.Int32
    base: cutlass.Int32
    grid: cutlass.Int32


class SplitB(NamedTuple):
    """B's second part along K (:meth:`Sm90Mainloop.load_tile`): its TMA atom, its (tile_n, tile_k, k-tiles)
    coordinate tile and its k-tile count (A's k-tiles past the first part pair with them)."""

    atom: cute.CopyAtom
    g: cute.Tensor
    k_tiles: cutlass.Int32


class StackedB(NamedTuple):
    """The upper half of a B tile stacked along N from a second tensor (rows ``[tile_n/2, tile_n)`` of the ring
    slot, :meth:`Sm90Mainloop.load_tile`): its TMA atom (``make_tma(..., b_half=True)``) and its
    (tile_n/2, tile_k, k-tiles) coordinate tile."""

    atom: cute.CopyAtom
    g: cute.Tensor


class TmaA(NamedTuple):
    """An A operand by TMA beside a gathered B (:meth:`Sm90Mainloop.load_tile_gather_b`): its atom, its
    (tile_m, tile_k, k-tiles) coordinate tile and the staged ring tensor."""

    atom: cute.CopyAtom
    g: cute.Tensor
    s: cute.Tensor


class GatherB(NamedTuple):
    """The rows of a B operand gathered along K (:meth:`Sm90Mainloop.load_tile_gather_b`): k-row ``r`` of the tile
    (``r < rows``) is row ``tok[row0 + r]`` of a row-major 16-bit tensor at global byte address ``base`` (rows
    ``row_bytes`` apart), its N columns from byte ``col0`` of that row; k-rows past ``rows`` and bytes past
    ``row_end`` of a row are zeros. Int64 addresses and byte counts, Int32 rows."""

    base: cutlass.Int64
    row_bytes: cutlass.Int64
    col0: cutlass.Int32
    row_end: cutlass.Int32
    tok: cute.Tensor
    row0: cutlass.Int32
    rows: cutlass.Int32


@cute.jit
def cp_async_16(smem_addr: cutlass.Int32, gaddr: cutlass.Int64, src_bytes: cutlass.Int32):
    """``cp.async.cg`` of 16 bytes global -> shared, the bytes past ``src_bytes`` (0 or 16) zero-filled."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
                         read_only_args=[smem_addr, gaddr, src_bytes])


@cute.jit
def cp_async_arrive(mbar_addr: cutlass.Int32):
    """``cp.async.mbarrier.arrive`` (counted): the mbarrier's pending arrivals rise by one now and fall by one
    once this thread's earlier ``cp.async`` copies have landed."""
    cute.arch.inline_ptx("cp.async.mbarrier.arrive.shared::cta.b64 [{$r0}];", read_only_args=[mbar_addr])


def gather_pass_row(q, warp, sub, warps: int, rpp: int):
    """The k-row a gathering lane copies in its warp's pass ``q`` (:meth:`Sm90Mainloop.load_tile_gather_b`: warp
    ``warp`` of ``warps``, ``sub`` = lane // units, ``rpp`` k-rows per pass); Python ints or DSL values."""
    return (q * warps + warp) * rpp + sub


def gather_token_row(j, warp, warps: int, rpp: int):
    """The k-row whose token a gathering warp's lane ``j % 32`` holds in register ``j // 32`` (its warp's j-th
    k-row: the rows of :func:`gather_pass_row` in pass order)."""
    return (j // rpp * warps + warp) * rpp + j % rpp


def gather_b_offset(n: int, k: int, tile_k: int) -> int:
    """The byte offset in a B stage (MN-major, 16-bit, the 128-byte swizzle) of element (n, k): 64-column blocks
    of ``tile_k`` k-rows of 128 bytes, each row's 16-byte units permuted by ``k % 8``; the formula
    :meth:`Sm90Mainloop.load_tile_gather_b` writes by, in its two parts (tests check it against the DSL's
    layout)."""
    return gather_unit_at(gather_unit_block(n // 8, tile_k), n // 8, k) + (n % 8) * 2


def gather_unit_block(u, tile_k: int):
    """The byte offset of 16-byte unit ``u``'s 64-column block in a B stage (:func:`gather_b_offset`)."""
    return (u // 8) * (tile_k * 128)


def gather_unit_at(block, u, k):
    """The byte address of 16-byte unit ``u`` of k-row ``k`` in the block at ``block`` (:func:`gather_b_offset`)."""
    return block + k * 128 + ((u % 8) ^ (k % 8)) * UNIT


class Sm90Mainloop:
    """Layouts, TMA atoms, pipeline and per-tile device loops for one :class:`MainloopConfig`.

    Construct on the host; call :meth:`setup` inside the ``@cute.jit`` launcher (it builds
    MLIR layouts). ``epi_smem_bytes`` is what the epilogue needs beside the ring;
    ``a_major``/``b_major`` (:data:`K_MAJOR` or :data:`MN_MAJOR`) say which of A's (M, K)
    and B's (N, K) modes is contiguous in global memory.
    """

    def __init__(self, cfg: MainloopConfig, epi_smem_bytes: int, a_major: str = K_MAJOR, b_major: str = K_MAJOR):
        cfg.validate()
        for name, major in (("a_major", a_major), ("b_major", b_major)):
            if major not in _LAYOUT:
                raise ValueError(f"{name} must be {K_MAJOR!r} or {MN_MAJOR!r}, got {major!r}")
        self.cfg = cfg
        self.a_layout, self.b_layout = _LAYOUT[a_major], _LAYOUT[b_major]
        self.stages = cfg.num_stages(epi_smem_bytes)
        if self.stages < 2:
            raise ValueError(f"only {self.stages} pipeline stage(s) fit in shared memory")
        if self.stages * cfg.stage_bytes() + epi_smem_bytes + _BARRIER_BYTES > SMEM_BYTES:
            raise ValueError(f"{self.stages} stages + {epi_smem_bytes} epilogue bytes exceed shared memory")
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.smem_bytes = self.stages * cfg.stage_bytes() + epi_smem_bytes

    def setup(self):
        """Build the tiled MMA and the staged shared-memory layouts (call inside jit)."""
        cfg = self.cfg
        self.tiled_mma = self._tiled_mma()
        self.a_smem_staged = sm90.make_smem_layout_a(self.a_layout, self.tile_mnk, cfg.ab_dtype, self.stages)
        self.b_smem_staged = sm90.make_smem_layout_b(self.b_layout, self.tile_mnk, cfg.ab_dtype, self.stages)
        self.tx_bytes = cfg.stage_bytes()

    def _tiled_mma(self):
        cfg = self.cfg
        return sm90.make_trivial_tiled_mma(
            cfg.ab_dtype, cfg.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            cfg.acc_dtype, (NUM_CONSUMER_WG, 1, 1), tiler_mn=(64, cfg.tile_n))

    def make_tma(self, mA: cute.Tensor, mB: cute.Tensor, b_half: bool = False):
        """TMA load atoms for A (M, K, ...) and B (N, K, ...) with the declared majorness
        (extra modes, e.g. an expert mode L, are addressed by the coordinate tensors).

        ``b_half``: the B atom loads half a tile (``tile_n / 2`` rows of N), for a B tile
        stacked along N from two tensors (see :meth:`load_tile`).
        Returns ``(atom_a, coord_a, atom_b, coord_b)``; the coordinate tensors are what
        the producer tiles (``domain_offset`` them for per-group row starts).
        """
        cfg = self.cfg
        atom_a, coord_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(self.a_smem_staged, (None, None, 0)),
            (cfg.tile_m, cfg.tile_k))
        b_n = cfg.tile_n // 2 if b_half else cfg.tile_n
        b_smem = self.b_smem_staged
        if b_half:
            b_smem = sm90.make_smem_layout_b(self.b_layout, (cfg.tile_m, b_n, cfg.tile_k), cfg.ab_dtype, 1)
        atom_b, coord_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem, (None, None, 0)), (b_n, cfg.tile_k))
        return atom_a, coord_a, atom_b, coord_b

    def make_pipeline(self, barrier_ptr, stages: int | None = None, tx_bytes: int | None = None, producers: int = 1):
        """The A/B ring's full/empty mbarrier pipeline (``barrier_ptr``: 2 * stages Int64): ``producers`` arrivals
        per slot (one TMA producer thread; a gathered-B pipeline's warps: one each, :meth:`load_tile_gather_b`),
        one arrive per consumer warp; ``stages`` / ``tx_bytes`` (bytes landing per slot) default to this
        mainloop's ring."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_ptr,
            num_stages=self.stages if stages is None else stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_CONSUMER_WG * 4),
            tx_count=self.tx_bytes if tx_bytes is None else tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )

    @cute.jit
    def start(self, atoms: list):
        """First thing in the kernel: build the layouts (:meth:`setup`) and let warp 0 prefetch
        the TMA descriptors ``atoms``; returns ``(thread index, warp index)``."""
        self.setup()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        return tidx, warp

    def shared_storage(self, epi_elems: int, extra_i32: int = 0, bulk_bytes: int = 0, bulk_barriers: int = 0,
                       extra_f32: int = 0):
        """The kernel's shared storage struct: the ring's mbarriers, the A/B stages and a BF16
        epilogue buffer of ``epi_elems`` elements (each 1024-byte aligned), and ``extra_i32``
        int32 words of the kernel's own (field ``extra``) when asked; ``bulk_bytes``: a 128-byte aligned
        byte buffer (field ``bulk``) and ``bulk_barriers`` mbarriers (field ``bulk_mbar``) of the kernel's own
        bulk copies; ``extra_f32``: fp32 words of the kernel's own (field ``extra_f32``: a tile's biases)."""
        ab = self.cfg.ab_dtype
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.stages],
            "sA": cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(self.a_smem_staged)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(self.b_smem_staged)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, epi_elems], 1024],
        }
        if extra_i32:
            fields["extra"] = cute.struct.MemRange[cutlass.Int32, extra_i32]
        if bulk_bytes:
            fields["bulk"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int8, bulk_bytes], 128]
            fields["bulk_mbar"] = cute.struct.MemRange[cutlass.Int64, bulk_barriers]
        if extra_f32:
            fields["extra_f32"] = cute.struct.MemRange[cutlass.Float32, extra_f32]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def allocate(self, shared_storage, epi, with_storage: bool = False, producers: int = 1):
        """In the kernel: allocate ``shared_storage`` (:meth:`shared_storage`), build the ring's
        pipeline (:meth:`make_pipeline`, ``producers`` arrivals per slot) and initialise its barriers; returns
        ``(pipe, sA, sB, sC)`` (``sC``: the epilogue ``epi``'s view of its buffer), and the
        storage itself with ``with_storage``."""
        storage = cutlass.memory.SmemAllocator().allocate(shared_storage)
        pipe = self.make_pipeline(storage.barriers.data_ptr(), producers=producers)
        sA = storage.sA.get_tensor(self.a_smem_staged.outer, swizzle=self.a_smem_staged.inner)
        sB = storage.sB.get_tensor(self.b_smem_staged.outer, swizzle=self.b_smem_staged.inner)
        sC = epi.smem_tensor(storage.sC)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cfg.cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cfg.cluster_mn)
        if with_storage:
            return pipe, sA, sB, sC, storage
        return pipe, sA, sB, sC

    def producer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)

    @cute.jit
    def produce_grouped(self, pipe, walk: GroupWalk, loads: TmaLoads, sA: cute.Tensor, sB: cute.Tensor,
                        b_rows: cutlass.Constexpr[int], k_tiles: cutlass.Int32,
                        stack_n: cutlass.Constexpr[bool] = False, k_tiles1: cutlass.Int32 = None):
        """Producer warp of a grouped GEMM (rows grouped by expert, ``walk.offsets`` [E+1]): walk the
        persistent tile sequence ``walk`` (:mod:`mok_cute.schedule.group_tiles`, the consumers' sequence)
        and :meth:`load_tile` each tile's k-tiles: A rows of the tile's expert, B = ``loads.coord_b``
        (N, K, E) tiles of ``b_rows`` rows; with ``stack_n`` the B tile's second half comes from
        ``loads.coord_b2`` (gate/up), with ``k_tiles1`` B's k-tiles past ``k_tiles1`` come from
        ``loads.coord_b2`` (split along K). Ends with the pipeline's producer tail."""
        cfg = self.cfg
        mOffsets, num_experts, n_tiles, linear, expert, base, grid = walk
        atom_a, coord_a, atom_b, coord_b, atom_b2, coord_b2 = loads
        state = self.producer_state()
        while expert < num_experts:
            _, n_tile, row0, _ = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
            gA = cute.local_tile(cute.domain_offset((row0, 0), coord_a), (cfg.tile_m, cfg.tile_k), (0, None))
            gB = cute.local_tile(coord_b[(None, None, expert)], (b_rows, cfg.tile_k), (n_tile, None))
            if cutlass.const_expr(stack_n):
                gB_hi = cute.local_tile(coord_b2[(None, None, expert)], (b_rows, cfg.tile_k), (n_tile, None))
                state = self.load_tile(pipe, state, atom_a, gA, sA, atom_b, gB, sB, k_tiles,
                                       b_hi=StackedB(atom_b2, gB_hi))
            elif cutlass.const_expr(k_tiles1 is not None):
                gB2 = cute.local_tile(coord_b2[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                state = self.load_tile(pipe, state, atom_a, gA, sA, atom_b, gB, sB, k_tiles1,
                                       SplitB(atom_b2, gB2, k_tiles - k_tiles1))
            else:
                state = self.load_tile(pipe, state, atom_a, gA, sA, atom_b, gB, sB, k_tiles)
            linear = linear + grid
            expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)
        pipe.producer_tail(state)

    def consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

    @cute.jit
    def load_tile(self, pipe, state, atom_a: cute.CopyAtom, gA: cute.Tensor, sA: cute.Tensor,
                  atom_b: cute.CopyAtom, gB: cute.Tensor, sB: cute.Tensor, k_tiles: cutlass.Int32,
                  b2: SplitB = None, b_hi: StackedB = None, extra_arrivals: cutlass.Constexpr[int] = 0):
        """Producer warp: TMA every k-tile of one tile pair into the ring; returns the state.

        ``gA``: TMA coordinates (tile_m, tile_k, k_tiles [+ b2.k_tiles]); ``gB``: (tile_n, tile_k,
        k_tiles); ``sA``/``sB``: the staged ring tensors. With ``b2`` (:class:`SplitB`) the B
        operand is the concatenation along K of two tensors: k-tiles ``k_tiles ..
        k_tiles + b2.k_tiles - 1`` of A pair with k-tiles ``0 .. b2.k_tiles - 1`` of ``b2.g``.
        With ``b_hi`` (:class:`StackedB`) the B tile is stacked along N from two tensors: rows
        ``[0, tile_n/2)`` of the ring slot come from ``gB`` (tile_n/2, tile_k, k_tiles), rows
        ``[tile_n/2, tile_n)`` from ``b_hi.g`` (atoms from ``make_tma(..., b_half=True)``).
        ``extra_arrivals``: a gathered-B pipeline's other arrivals per slot (its other warps'), made by one thread.
        """
        tAsA, tAgA = cpasync.tma_partition(atom_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB, tBsB_hi, tBgB_hi = self._b_partitions(atom_b, gB, sB, b_hi)
        for k in cutlass.range(k_tiles, unroll=1):
            bar = self._acquire(pipe, state, extra_arrivals)
            cute.copy(atom_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(atom_b, tBgB[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            if cutlass.const_expr(b_hi is not None):
                cute.copy(b_hi.atom, tBgB_hi[(None, k)], tBsB_hi[(None, state.index)], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        if cutlass.const_expr(b2 is not None):
            _, tBgB2 = cpasync.tma_partition(b2.atom, 0, cute.make_layout(1),
                                             cute.group_modes(sB, 0, 2), cute.group_modes(b2.g, 0, 2))
            for k in cutlass.range(b2.k_tiles, unroll=1):
                bar = self._acquire(pipe, state, extra_arrivals)
                cute.copy(atom_a, tAgA[(None, k_tiles + k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(b2.atom, tBgB2[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                pipe.producer_commit(state)
                state.advance()
        return state

    @cute.jit
    def _acquire(self, pipe, state, extra_arrivals: cutlass.Constexpr[int] = 0):
        """Producer warp: wait for the slot of ``state`` and arrive on its full barrier expecting the stage's
        bytes (and ``extra_arrivals`` more, by one thread); returns the barrier."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        if cutlass.const_expr(extra_arrivals > 0):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(bar, arrive_count=extra_arrivals)
        return bar

    def _b_partitions(self, atom_b: cute.CopyAtom, gB: cute.Tensor, sB: cute.Tensor, b_hi: StackedB = None):
        """TMA partitions ``(tBsB, tBgB, tBsB_hi, tBgB_hi)`` of a B tile: all of it from ``gB``, or (``b_hi``)
        stacked along N, rows ``[0, tile_n/2)`` of the slot from ``gB`` and the rest from ``b_hi.g`` (the hi
        pair None otherwise)."""
        sB_lo, tBsB_hi, tBgB_hi = sB, None, None
        if b_hi is not None:
            half_tiler = (self.cfg.tile_n // 2, self.cfg.tile_k, self.stages)
            sB_lo = cute.local_tile(sB, half_tiler, (0, 0, 0))
        tBsB, tBgB = cpasync.tma_partition(atom_b, 0, cute.make_layout(1),
                                           cute.group_modes(sB_lo, 0, 2), cute.group_modes(gB, 0, 2))
        if b_hi is not None:
            sB_hi = cute.local_tile(sB, half_tiler, (1, 0, 0))
            tBsB_hi, tBgB_hi = cpasync.tma_partition(b_hi.atom, 0, cute.make_layout(1),
                                                     cute.group_modes(sB_hi, 0, 2), cute.group_modes(b_hi.g, 0, 2))
        return tBsB, tBgB, tBsB_hi, tBgB_hi

    @cute.jit
    def load_tile_gather_b(self, pipe, state, sB_addr: cutlass.Int32, src: GatherB, k_tiles: cutlass.Int32,
                           a: TmaA = None, warp: cutlass.Int32 = 0, warps: cutlass.Constexpr[int] = 1):
        """Producer warp ``warp`` of ``warps`` (B MN-major, 16-bit, ``tile_k`` 64; a pipeline of ``warps``
        producer arrivals per slot): the k-tiles of one tile whose B k-rows are gathered (:class:`GatherB`) into
        the stages at shared address ``sB_addr``, A TMA-loaded by warp 0 (``a``: :class:`TmaA`; None in the other
        warps). Per k-tile the warp waits for the slot; warp 0 expects A's bytes on its full barrier and TMA-loads
        A's k-tile; every lane takes the tokens of its warp's k-rows (the warps take the passes of ``32 / U``
        k-rows in turn, U = tile_n / 8 units per k-row), copies its 16-byte units (unit ``lane % U`` of k-row
        ``pass * 32 / U + lane // U``) by ``cp.async`` to :func:`gather_b_offset` and counts them on the full
        barrier (:func:`cp_async_arrive`: the pending arrivals rise now, before the warp's own arrival below, so
        the slot's phase waits for every copy); then one lane arrives. The warps need not meet: each warp's
        arrival follows its lanes' counts, and the phase completes only with every warp's arrival. Returns the
        advanced state."""
        cfg = self.cfg
        units = cfg.tile_n * cfg.ab_dtype.width // 8 // UNIT  # 16-byte units per k-row
        rpp = 32 // units  # k-rows per pass of a warp
        per_warp = cfg.tile_k // warps  # k-rows per warp and k-tile
        a_bytes = cfg.tile_m * cfg.tile_k * cfg.ab_dtype.width // 8
        b_stage = cfg.tile_n * cfg.tile_k * cfg.ab_dtype.width // 8
        lane = cute.arch.lane_idx()
        u = lane % units
        sub = lane // units
        tAsA, tAgA = None, None
        if cutlass.const_expr(a is not None):
            tAsA, tAgA = cpasync.tma_partition(a.atom, 0, cute.make_layout(1),
                                               cute.group_modes(a.s, 0, 2), cute.group_modes(a.g, 0, 2))
        col = src.col0 + u * UNIT
        size = cutlass.Int32(0)  # the lane's bytes per row: its unit inside the row, or none
        if col < src.row_end:
            size = cutlass.Int32(UNIT)
        gcol = src.base + cutlass.Int64(col)
        lane_dst = sB_addr + gather_unit_block(u, cfg.tile_k)
        cur = self._gather_tokens(src, 0, lane, warp, warps, rpp, per_warp)
        for kt in cutlass.range(k_tiles, unroll=1):
            nxt = self._gather_tokens(src, (kt + 1) * cfg.tile_k, lane, warp, warps, rpp, per_warp)  # in flight now
            pipe.sync_object_empty.wait(state.index, state.phase)
            bar = pipe.producer_get_barrier(state)
            if cutlass.const_expr(a is not None):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_expect_tx(bar, a_bytes)
                cute.copy(a.atom, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            stage = lane_dst + state.index * b_stage
            for q in cutlass.range_constexpr(per_warp // rpp):
                kr = gather_pass_row(q, warp, sub, warps, rpp)
                t = cute.arch.shuffle_sync(cur[q * rpp // 32], (q * rpp + sub) % 32)  # the lane holding kr's token
                n = cutlass.Int32(0)
                if t >= 0:
                    n = size
                g = gcol + cutlass.Int64(cutlass.max(t, 0)) * src.row_bytes
                cp_async_16(gather_unit_at(stage, u, kr), g, n)
            cp_async_arrive(bar.toint())
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(bar)
            state.advance()
            cur = nxt
        return state

    @cute.jit
    def _gather_tokens(self, src: GatherB, r0: cutlass.Int32, lane: cutlass.Int32, warp: cutlass.Int32,
                       warps: cutlass.Constexpr[int], rpp: cutlass.Constexpr[int], per_warp: cutlass.Constexpr[int]):
        """The tokens :meth:`load_tile_gather_b`'s lane holds for the k-tile from k-row ``r0``: ``(t0, t1)``, those
        of its warp's k-rows ``lane`` and ``32 + lane`` (-1: past the warp's k-rows or the expert's rows)."""
        toks = [cutlass.Int32(-1), cutlass.Int32(-1)]
        for h in cutlass.range_constexpr((per_warp + 31) // 32):
            j = h * 32 + lane
            kr = gather_token_row(j, warp, warps, rpp)
            t = cutlass.Int32(-1)
            if j < per_warp and r0 + kr < src.rows:
                t = src.tok[src.row0 + r0 + kr]
            toks[h] = t
        return toks[0], toks[1]

    def consumer_fragments(self, sA: cute.Tensor, sB: cute.Tensor, consumer_tid):
        """``(thr_mma, tCrA, tCrB, acc)`` for consumer thread ``consumer_tid`` (0..255)."""
        thr_mma = self.tiled_mma.get_slice(consumer_tid)
        tCrA = self.tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = self.tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = thr_mma.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n))
        acc = cute.make_rmem_tensor(acc_shape, self.cfg.acc_dtype)
        return thr_mma, tCrA, tCrB, acc

    @cute.jit
    def mma_tile(self, pipe, state, tCrA: cute.Tensor, tCrB: cute.Tensor, acc: cute.Tensor,
                 k_tiles: cutlass.Int32, stage_a: cutlass.Constexpr = None):
        """Consumer warpgroups: ``acc = A_tile @ B_tile^T`` over ``k_tiles`` (>= 1) ring slots.

        One wgmma batch stays in flight; a slot is released once the batch reading it
        retired. Returns the advanced state; all slots of the tile are released on return.
        ``stage_a(slot, kt)``: when given, called once k-tile ``kt``'s slot has landed (batch
        kt - 1 still running); it writes that k-tile's A operand and returns the index of
        ``tCrA``'s stage holding it (without it, A is the ring slot's).
        """
        release = state.clone()
        k_blocks = cute.size(tCrA, mode=[2])
        # a tiled MMA of this call: its ACCUMULATE field is set below, and a field set on the shared
        # one inside a run-time branch would escape the branch (a kernel may pick its mainloop per task)
        mma = self._tiled_mma()
        # first k-tile: the first k-block overwrites the accumulators (no zero fill). Each batch's
        # wgmma.fence comes after its slot's wait, right before its wgmmas: before the wait (a spin
        # loop, a divergent path to ptxas) ptxas may add one itself and serialize every wgmma of
        # the kernel (its C7520 "Potential Performance Loss" remark)
        pipe.consumer_wait(state)
        a_idx = state.index
        if cutlass.const_expr(stage_a is not None):
            a_idx = stage_a(state.index, cutlass.Int32(0))
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(mma, acc, tCrA[(None, None, kb, a_idx)],
                      tCrB[(None, None, kb, state.index)], acc)
        warpgroup.commit_group()
        state.advance()
        for kt in cutlass.range(k_tiles - 1, unroll=1):
            pipe.consumer_wait(state)
            a_idx = state.index
            if cutlass.const_expr(stage_a is not None):
                a_idx = stage_a(state.index, kt + 1)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(mma, acc, tCrA[(None, None, kb, a_idx)],
                          tCrB[(None, None, kb, state.index)], acc)
            warpgroup.commit_group()
            state.advance()
            warpgroup.wait_group(1)
            pipe.consumer_release(release)
            release.advance()
        warpgroup.wait_group(0)
        pipe.consumer_release(release)
        return state


@cute.jit
def acc_to_smem(thr_mma: cute.ThrMma, acc: cute.Tensor, sC: cute.Tensor):
    """Round the FP32 accumulators to ``sC``'s dtype and store this thread's part of the tile."""
    tCsC = thr_mma.partition_C(sC)
    rC = cute.make_rmem_tensor_like(acc, sC.element_type)
    rC.store(acc.load().to(sC.element_type))
    cute.autovec_copy(rC, tCsC)


def experts_last(t: cute.Tensor, swap: bool = False) -> cute.Tensor:
    """A per-expert [E, R, C] tensor seen as (R, C, E) (``swap``: (C, R, E)): the (N, K, L)
    order the TMA atoms and the tile walk index, whatever the storage order."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0] if swap else [1, 2, 0]))


def consumer_barrier():
    """Named barrier over the two consumer warpgroups only (id 1)."""
    cute.arch.barrier(barrier_id=1, number_of_threads=NUM_CONSUMER_THREADS)


def epi_smem_layout(dtype, tile_m: int, tile_n: int):
    """Swizzled K-contiguous (row-major) shared layout for a whole (tile_m, tile_n) tile."""
    staged = sm90.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, (tile_m, tile_n), 1)
    return cute.slice_(staged, (None, None, 0))

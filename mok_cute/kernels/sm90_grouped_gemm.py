"""Hopper (sm_90a) persistent grouped expert GEMMs: variable rows per expert, no host sync.

Operands (all K-major, BF16):
  A   [M_total, K]  tokens grouped by expert; expert e owns rows offsets[e]..offsets[e+1]
  B   [E, N, K]     per-expert weights; tile = A_e @ B_e^T
  offsets int32 [E+1] on the device, offsets[0] = 0, non-decreasing, offsets[E] = M_total
    (trusted, not checked: checking needs a host sync).
One compiled kernel serves every token count (M_total and the offsets are runtime values);
the compile cache key holds only what changes code (arch, dtypes, tile shape, epilogue,
clamp flag). Grid = number of SMs; CTAs stride over all experts' tiles
(:mod:`mok_cute.schedule.group_tiles`). Each tile is staged in shared memory as BF16 and
written back with row-masked 16-byte stores, so rows past an expert's end are never written.

Epilogues:
  ``plain``:  out [M_total, N] = bf16(A_e @ B_e^T)
  ``swiglu``: B = :func:`interleave_gate_up` (w_gate, w_up) [E, 2I, H]; writes
              gu [M_total, 2I] (gate in [0, I), up in [I, 2I)) and
              h [M_total, I] = bf16(silu(g) * u) from the BF16-rounded g, u in FP32, with
              optional clamp L: g = min(g, L), u = clamp(u, -L, L).
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.runtime import from_dlpack

from mok_cute.kernels.compile import arch_of_device, compile_cached, compile_kernel
from mok_cute.kernels.sm90_mainloop import (
    CONSUMER_REGS, NUM_CONSUMER_THREADS, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG,
    MainloopConfig, Sm90Mainloop, acc_to_smem, consumer_barrier, epi_smem_layout,
)
from mok_cute.schedule.group_tiles import seek, tile_coords

EPILOGUES = ("plain", "swiglu")
_VEC = 8  # bf16 elements per 16-byte store


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
                g_tile: cute.Tensor, rows: Int32):
    """Store register vectors ``r`` to the gmem tile, skipping rows ``>= rows``."""
    tD = tiled_copy.get_slice(tid).partition_D(g_tile)
    for m in cutlass.range_constexpr(cute.size(tD, mode=[1])):
        for n in cutlass.range_constexpr(cute.size(tD, mode=[2])):
            if coords[(0, m, n)][0] < rows:
                cute.copy(tiled_copy, r[(None, m, n)], tD[(None, m, n)])


class PlainEpilogue:
    """out[row0 + r, n_tile * tile_n + c] = tile[r, c] for r < rows."""

    def __init__(self, tile_m: int, tile_n: int):
        self.tile_m, self.tile_n = tile_m, tile_n

    @cute.jit
    def store(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32,
              mOut: cute.Tensor, mAux: cute.Tensor, limit: Float32):
        copy = _row_copy(self.tile_n)
        r, coords = _load_rows(copy, tid, sC)
        g = cute.local_tile(cute.domain_offset((row0, 0), mOut), (self.tile_m, self.tile_n), (0, n_tile))
        _store_rows(copy, tid, r, coords, g, rows)


class SwigluEpilogue:
    """Tile columns [0, tile_n/2) are gate, [tile_n/2, tile_n) up, for intermediate columns
    ``n_tile * tile_n/2 + c``: writes gu (gate, up halves) and h = silu(g) * u (optionally clamped)."""

    def __init__(self, tile_m: int, tile_n: int, clamp: bool):
        self.tile_m, self.half, self.clamp = tile_m, tile_n // 2, clamp

    @cute.jit
    def store(self, sC: cute.Tensor, tid: Int32, row0: Int32, rows: Int32, n_tile: Int32,
              mGU: cute.Tensor, mH: cute.Tensor, limit: Float32):
        copy = _row_copy(self.half)
        shape = (self.tile_m, self.half)
        rg, coords = _load_rows(copy, tid, cute.local_tile(sC, shape, (0, 0)))
        ru, _ = _load_rows(copy, tid, cute.local_tile(sC, shape, (0, 1)))
        gate_rows = cute.domain_offset((row0, 0), mGU[(None, 0, None)])
        up_rows = cute.domain_offset((row0, 0), mGU[(None, 1, None)])
        _store_rows(copy, tid, rg, coords, cute.local_tile(gate_rows, shape, (0, n_tile)), rows)
        _store_rows(copy, tid, ru, coords, cute.local_tile(up_rows, shape, (0, n_tile)), rows)
        g = cute.make_rmem_tensor_like(rg, Float32)
        u = cute.make_rmem_tensor_like(ru, Float32)
        g.store(rg.load().to(Float32))
        u.store(ru.load().to(Float32))
        for i in cutlass.range_constexpr(cute.size(g)):
            gi = g[i]
            ui = u[i]
            if cutlass.const_expr(self.clamp):
                gi = cutlass.min(gi, limit)
                ui = cutlass.max(cutlass.min(ui, limit), -limit)
            g[i] = gi / (Float32(1.0) + cute.math.exp(-gi)) * ui
        rh = cute.make_rmem_tensor_like(rg)
        rh.store(g.load().to(cutlass.BFloat16))
        h_tile = cute.local_tile(cute.domain_offset((row0, 0), mH), shape, (0, n_tile))
        _store_rows(copy, tid, rh, coords, h_tile, rows)


class GroupedGemmSm90:
    """Persistent warp-specialized grouped GEMM: mainloop per tile + pluggable epilogue.

    Call (jit): ``(mA [M, K], mB [E, N, K], mOffsets [E+1] int32, mOut0, mOut1, limit,
    num_ctas, stream)``. plain: ``mOut0`` = out [M, N] (``mOut1`` ignored, pass mOut0);
    swiglu: ``mOut0`` = gu [M, N], ``mOut1`` = h [M, N/2]. N must be a multiple of tile_n.
    """

    def __init__(self, cfg: MainloopConfig, epilogue: str, clamp: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        self.cfg = cfg
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=cfg.tile_m * cfg.tile_n * 2)
        if epilogue == "plain":
            self.epi = PlainEpilogue(cfg.tile_m, cfg.tile_n)
        else:
            self.epi = SwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOffsets: cute.Tensor, mOut0: cute.Tensor,
                 mOut1: cute.Tensor, limit: Float32, num_ctas: Int32, stream: cuda.CUstream):
        ml = self.mainloop
        ml.setup()
        mB_nkl = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 2, 0]))
        atom_a, coord_a, atom_b, coord_b = ml.make_tma(mA, mB_nkl)
        c_layout = epi_smem_layout(cutlass.BFloat16, self.cfg.tile_m, self.cfg.tile_n)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * ml.stages]
            sA: cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, cute.cosize(ml.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.cfg.ab_dtype, cute.cosize(ml.b_smem_staged)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(c_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(atom_a, coord_a, atom_b, coord_b, mOffsets, mOut0, mOut1, limit).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, atom_a: cute.CopyAtom, coord_a: cute.Tensor, atom_b: cute.CopyAtom,
               coord_b: cute.Tensor, mOffsets: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor,
               limit: Float32):
        cfg = self.cfg
        self.mainloop.setup()
        c_layout = epi_smem_layout(cutlass.BFloat16, cfg.tile_m, cfg.tile_n)
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(atom_b)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe = self.mainloop.make_pipeline(storage.barriers.data_ptr())
        sA = storage.sA.get_tensor(self.mainloop.a_smem_staged.outer, swizzle=self.mainloop.a_smem_staged.inner)
        sB = storage.sB.get_tensor(self.mainloop.b_smem_staged.outer, swizzle=self.mainloop.b_smem_staged.inner)
        sC = storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cfg.cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=cfg.cluster_mn)

        num_experts = mOffsets.shape[0] - 1
        n_tiles = coord_b.shape[0] // cfg.tile_n
        k_tiles = (coord_a.shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        linear = Int32(bidx)
        expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, Int32(0), Int32(0))

        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                state = self.mainloop.producer_state()
                while expert < num_experts:
                    _, n_tile, row0, _ = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                    gA = cute.local_tile(cute.domain_offset((row0, 0), coord_a), (cfg.tile_m, cfg.tile_k), (0, None))
                    gB = cute.local_tile(coord_b[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                    state = self.mainloop.load_tile(pipe, state, atom_a, gA, sA, atom_b, gB, sB, k_tiles)
                    linear = linear + grid
                    expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)
                pipe.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            tid = tidx - THREADS_PER_WG
            thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(sA, sB, tid)
            state = self.mainloop.consumer_state()
            while expert < num_experts:
                _, n_tile, row0, rows = tile_coords(mOffsets, cfg.tile_m, linear, expert, base)
                state = self.mainloop.mma_tile(pipe, state, tCrA, tCrB, acc, k_tiles)
                acc_to_smem(thr_mma, acc, sC)
                consumer_barrier()
                self.epi.store(sC, tid, row0, rows, n_tile, mOut0, mOut1, limit)
                consumer_barrier()
                linear = linear + grid
                expert, base = seek(mOffsets, num_experts, cfg.tile_m, n_tiles, linear, expert, base)


# ---------------------------------------------------------------- compile
def _fake_2d(dtype, rows, cols):
    return cute.runtime.make_fake_tensor(dtype, (rows, cols), stride=(cute.sym_int64(divisibility=_VEC), 1),
                                         assumed_align=16)


def compile_grouped_gemm(epilogue: str, *, clamp: bool = False, cfg: MainloopConfig = MainloopConfig(),
                         arch: str = "sm_90a", inspect: bool = False):
    """Compile one kernel variant with symbolic M_total, N, K, E; returns ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 grouped GEMM needs arch sm_90a, got {arch!r}")
    op = GroupedGemmSm90(cfg, epilogue, clamp)
    ab = cfg.ab_dtype
    m, k, n, e = cute.sym_int(), cute.sym_int(divisibility=_VEC), cute.sym_int(), cute.sym_int()
    mA = _fake_2d(ab, m, k)
    mB = cute.runtime.make_fake_tensor(ab, (e, n, k), stride=(cute.sym_int64(divisibility=_VEC),
                                                              cute.sym_int64(divisibility=_VEC), 1),
                                       assumed_align=16)
    offs = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    out0 = _fake_2d(cutlass.BFloat16, m, n)
    if epilogue == "swiglu":  # gu as [M, 2, I], h as [M, I]
        inter = cute.sym_int(divisibility=_VEC)
        out0 = cute.runtime.make_fake_tensor(cutlass.BFloat16, (m, 2, inter), assumed_align=16, stride=(
            cute.sym_int64(divisibility=_VEC), cute.sym_int64(divisibility=_VEC), 1))
        out1 = _fake_2d(cutlass.BFloat16, m, inter)
    else:
        out1 = out0
    stream = cute.runtime.make_fake_stream()
    return compile_kernel(op, mA, mB, offs, out0, out1, Float32(0.0), Int32(1), stream,
                          arch=arch, inspect=inspect)


# ---------------------------------------------------------------- host wrappers
DEFAULT_CONFIG = MainloopConfig()
_sm_count: dict[int, int] = {}


def interleave_gate_up(w_gate, w_up, tile_n: int = DEFAULT_CONFIG.tile_n):
    """[E, I, H] gate and up weights -> [E, 2I, H] with blocks of ``tile_n/2`` rows alternating
    gate, up (so one ``tile_n``-wide output tile holds matching gate and up columns)."""
    e, inter, h = w_gate.shape
    half = tile_n // 2
    if inter % half:
        raise ValueError(f"w_gate: I={inter} must be a multiple of tile_n/2={half}")
    blocks = (w_gate.reshape(e, inter // half, 1, half, h), w_up.reshape(e, inter // half, 1, half, h))
    return torch.cat(blocks, dim=2).reshape(e, 2 * inter, h)


def _check_tensor(name, t, ndim, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_devices(**tensors):
    """All tensors on one CUDA device (checked after shapes so CPU tests reach shape errors)."""
    first = None
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"{name} is on {t.device} but {first[0]} is on {first[1]}")


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
        if not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous ([E, N, K], K contiguous) and 16-byte aligned")
    return m, k, e


def _cute_tensor(t, align=16):
    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def _launch(epilogue: str, clamp: bool, cfg: MainloopConfig, a, w, offsets, out0, out1, limit: float, n: int):
    arch = arch_of_device(a.device)
    if arch != "sm_90a":
        raise ValueError(f"a: the SM90 grouped GEMM needs an sm_90a device, got {arch}")
    compiled = compile_cached(("sm90_grouped_gemm", arch, epilogue, clamp, cfg.key()),
                              lambda: compile_grouped_gemm(epilogue, clamp=clamp, cfg=cfg, arch=arch)[0])
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if dev not in _sm_count:
        _sm_count[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    m, e = a.shape[0], offsets.numel() - 1
    tiles_bound = (-(-m // cfg.tile_m) + e) * (n // cfg.tile_n)
    num_ctas = max(1, min(_sm_count[dev], tiles_bound))
    offs32 = offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    compiled(_cute_tensor(a), _cute_tensor(w), _cute_tensor(offs32.contiguous(), 4), _cute_tensor(out0),
             _cute_tensor(out1), Float32(limit), Int32(num_ctas), stream)


def _check_out(name, t, shape, device):
    if t is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check_tensor(name, t, len(shape), (torch.bfloat16,))
    if tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def grouped_gemm(a, offsets, w, *, out=None, cfg: MainloopConfig = DEFAULT_CONFIG):
    """out [M, N] bf16: rows offsets[e]..offsets[e+1] = bf16(a_e @ w[e]^T) (FP32 accumulate).

    a [M, K] bf16 contiguous; offsets [E+1] int32/int64 on the device (0, non-decreasing,
    last = M; not checked); w [E, N, K] bf16 contiguous, N a multiple of ``cfg.tile_n``;
    ``out``: optional preallocated [M, N] bf16 result (every row is written).
    """
    m, _, _ = _check_operands(a, offsets, {"w": w})
    n = w.shape[1]
    if n % cfg.tile_n:
        raise ValueError(f"w: N={n} must be a multiple of tile_n={cfg.tile_n}")
    out = _check_out("out", out, (m, n), a.device)
    _check_devices(a=a, offsets=offsets, w=w, out=out)
    if m:
        _launch("plain", False, cfg, a, w, offsets, out, out, 0.0, n)
    return out


def grouped_gemm1_swiglu(x, offsets, w_gate, w_up, limit=None, *, out=None, cfg: MainloopConfig = DEFAULT_CONFIG):
    """(gu [M, 2I], h [M, I]) bf16 for expert rows of x [M, H]: gu = bf16(x_e @ [w_gate[e]; w_up[e]]^T)
    (gate in columns [0, I), up in [I, 2I)); h = bf16(silu(g) * u) in FP32 from the bf16 g, u,
    with g = min(g, limit), u = clamp(u, -limit, limit) when ``limit`` is given.

    w_gate, w_up [E, I, H] bf16, I a multiple of ``cfg.tile_n / 2``. The weights are
    interleaved into one [E, 2I, H] copy per call (:func:`interleave_gate_up`).
    ``out``: optional preallocated ``(gu, h)``.
    """
    m, _, _ = _check_operands(x, offsets, {"w_gate": w_gate, "w_up": w_up}, a_name="x")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_up shape {tuple(w_up.shape)} must equal w_gate shape {tuple(w_gate.shape)}")
    inter = w_gate.shape[1]
    if inter % (cfg.tile_n // 2):
        raise ValueError(f"w_gate: I={inter} must be a multiple of tile_n/2={cfg.tile_n // 2}")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(f"limit must be a float or None, got {type(limit).__name__}")
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"limit must be finite and > 0, got {limit}")
    gu, h = (None, None) if out is None else out
    gu = _check_out("gu", gu, (m, 2 * inter), x.device)
    h = _check_out("h", h, (m, inter), x.device)
    _check_devices(x=x, offsets=offsets, w_gate=w_gate, w_up=w_up, gu=gu, h=h)
    if m:
        w = interleave_gate_up(w_gate, w_up, cfg.tile_n)
        _launch("swiglu", limit is not None, cfg, x, w, offsets, gu.view(m, 2, inter), h,
                0.0 if limit is None else float(limit), 2 * inter)
    return gu, h

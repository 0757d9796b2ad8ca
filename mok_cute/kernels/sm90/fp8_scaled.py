"""Hopper (sm_90a) FP8 GEMM whose promotion scale varies per accumulator element: a row
scale times a column scale per promotion block, on the shared mainloop
(:class:`~mok_cute.kernels.sm90.mainloop.Sm90Mainloop`: TMA producer, ring pipeline,
``consumer_fragments``; tile 128 x tile_n x 128 e4m3, both operands K-major).

:func:`grouped_wgrad_fp8_block` — fp8_block weight gradient:
``out[e] = bf16(sum_j (A_j^T B_j) * sa[j, row] * sb[j, col])`` over expert e's 128-token
k-tiles j (the token-wise operands of ``quantize_fp8.quantize_tokens(x, offsets,
"fp8_block")``: data_t [N, 128 S] K-major, scales fp32 [S, N]; group e's slots start at
``offsets[e] // 128 + e``, ``ceil(rows_e / 128)`` of them, zero padded). One promotion per
k-tile: ``acc = fma(tmp, sa[row] * sb[col], acc)`` (one rounding of the scale product, as
sm90.fp8_gemm's ``sa * sb``). Experts without tokens run no k-tile and write zeros. One CTA
owns a whole output tile, k-tiles in order: no split-K, no atomics, bitwise repeatable.

Consumer (:meth:`_ScaledGemm.mma_tile_scaled`). Per k-tile, the 256 consumer threads stage
the k-tile's promotion factors in shared memory (thread t < 128: the factor of tile row t;
thread 128 + c: that of tile column c; double-buffered, one consumer barrier per k-tile),
from a scale loaded one k-tile ahead into a register (its global latency hides behind a
k-tile). Each thread then reads the factors of its 2 rows and tile_n / 4 columns (their
positions come from partitioning an identity tensor at trace time, as in ``sm90.fp8_gemm``).
Registers: acc + 1 temporary = 128 per thread at tile_n = 128 under the mainloop's 40 / 232
split, 0 spills.

Measured on one H200 (8 experts x 4096 tokens; tools/checks/gemm_fp8_scaled.py, all
correctness rows pass): Na = 7168, Nb = 2048: 1217-1268 us, 759-790 TFLOP/s with the
TMA-store epilogue (1337 us with masked stores; BF16 grouped_wgrad 712-731 TFLOP/s).
The per-32-K promoted MXFP8 GEMM that shared this consumer is removed (docs/architecture.md).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import (_check_devices, _check_offsets, _check_tensor, offsets_i32, sm_count,
                                   wgrad_out)
from mok_cute.kernels.sm90.fp8_gemm import (
    OVERLAP_CONSUMER_REGS, OVERLAP_PRODUCER_REGS, SCALE_BLOCK, Fp8MainloopConfig, _fake,
)
from mok_cute.kernels.sm90.grouped_gemm import (
    PlainEpilogue, make_tma_store, tma_store_drain, tma_store_tile,
)
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, NUM_CONSUMER_WG, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG, Sm90Mainloop, consumer_barrier,
    experts_last,
)
from mok_cute.schedule.group_tiles import wgrad_start, wgrad_tile

_ROWS = 128  # tile_m: factor slots 0..127 are rows, 128.. columns


class _ScaledGemm:
    """Persistent warp-specialized FP8 GEMM with per-element promotion (base of both kernels).

    ``cfg``: tile shape (tile_n 64 or 128; its ``overlap_promotion`` is sm90.fp8_gemm's and
    ignored here). ``units``: promotion units per 128-K k-tile (1: one per k-tile, 4: one per wgmma
    k-block); with more than one unit two temporaries alternate (overlapped promotion).
    Subclasses load a scale word per consumer thread and k-tile (:meth:`_load_word`) and
    turn it into factors in shared memory (:meth:`_store_factors`).
    """

    def __init__(self, cfg: Fp8MainloopConfig, units: int):
        self.cfg = cfg
        self.units = units
        self.temps = 2 if units > 1 else 1
        self.kb_per_unit = (SCALE_BLOCK // 32) // units
        self.epi = PlainEpilogue(cfg.tile_m, cfg.tile_n)
        self.fac_slots = _ROWS + cfg.tile_n
        fac_bytes = 2 * units * self.fac_slots * 4
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=self.epi.smem_elems() * 2 + fac_bytes)

    def _storage(self):
        ml, cfg = self.mainloop, self.cfg

        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * ml.stages],
            "sA": cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(ml.a_smem_staged)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(ml.b_smem_staged)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, self.epi.smem_elems()], 1024],
            "sF": cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.units * self.fac_slots], 16],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _regs(self):
        if self.temps == 2:
            return OVERLAP_PRODUCER_REGS, OVERLAP_CONSUMER_REGS
        return PRODUCER_REGS, CONSUMER_REGS

    def _allocate(self):
        """In the kernel (after ``mainloop.start``): shared storage, ring pipeline; returns
        ``(pipe, sA, sB, sC, fac)`` (``fac``: the (slots, units, 2) factor buffers)."""
        ml = self.mainloop
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe = ml.make_pipeline(storage.barriers.data_ptr())
        sA = storage.sA.get_tensor(ml.a_smem_staged.outer, swizzle=ml.a_smem_staged.inner)
        sB = storage.sB.get_tensor(ml.b_smem_staged.outer, swizzle=ml.b_smem_staged.inner)
        sC = self.epi.smem_tensor(storage.sC)
        fac = storage.sF.get_tensor(cute.make_layout((self.fac_slots, self.units, 2)))
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cfg.cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cfg.cluster_mn)
        return pipe, sA, sB, sC, fac

    def _thread_elems(self, thr_mma):
        """Trace time: this thread's accumulator rows / columns as ``(rows, cols, ri, ci)``:
        ``rows``/``cols`` its distinct tile-local rows and factor slots of columns (dynamic),
        ``ri[i]``/``ci[i]`` (compile-time) which of them accumulator element i uses."""
        cfg = self.cfg
        ident = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        t0 = self.mainloop.tiled_mma.get_slice(0).partition_C(ident)
        mine = thr_mma.partition_C(ident)
        n = cute.size(t0)
        roff = [t0[i][0] - t0[0][0] for i in range(n)]
        coff = [t0[i][1] - t0[0][1] for i in range(n)]
        dr, dc = sorted(set(roff)), sorted(set(coff))
        rows = [mine[0][0] + o for o in dr]
        cols = [_ROWS + mine[0][1] + o for o in dc]
        return rows, cols, [dr.index(o) for o in roff], [dc.index(o) for o in coff]

    def _issue(self, tCrA, tCrB, tmp, slot, unit: int):
        """Issue the wgmma k-blocks of promotion unit ``unit`` of ring slot ``slot`` into
        ``tmp`` (the first overwrites it); one commit group. The tiled MMA is private to the
        call site (its ACCUMULATE field must not leave the enclosing loop body)."""
        ml = self.mainloop
        mma = sm90.make_trivial_tiled_mma(
            self.cfg.ab_dtype, self.cfg.ab_dtype, ml.a_layout.sm90_mma_major_mode(),
            ml.b_layout.sm90_mma_major_mode(), self.cfg.acc_dtype, (NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, self.cfg.tile_n))
        warpgroup.fence()  # orders earlier promotion reads of tmp before the wgmma writes
        for j in range(self.kb_per_unit):
            kb = unit * self.kb_per_unit + j
            mma.set(warpgroup.Field.ACCUMULATE, j != 0)
            cute.gemm(mma, tmp, tCrA[(None, None, kb, slot)], tCrB[(None, None, kb, slot)], tmp)
        warpgroup.commit_group()

    def _promote(self, acc, tmp, fac, buf, unit: int, elems):
        """acc[i] = fma(tmp[i], row_factor * col_factor, acc[i]) with unit ``unit``'s factors,
        column factors read in chunks of 8 (short live ranges)."""
        rows, cols, ri, ci = elems
        rf = [fac[r, unit, buf] for r in rows]
        for c0 in range(0, len(cols), 8):
            cf = {c: fac[cols[c], unit, buf] for c in range(c0, min(c0 + 8, len(cols)))}
            for i in range(cute.size(acc)):
                if ci[i] in cf:
                    acc[i] = tmp[i] * (rf[ri[i]] * cf[ci[i]]) + acc[i]  # one mul, one FMA

    @cute.jit
    def mma_tile_scaled(self, pipe, state, tCrA: cute.Tensor, tCrB: cute.Tensor, acc: cute.Tensor, tmps,
                        k_tiles: Int32, fac: cute.Tensor, fb: Int32, t: Int32, elems, src):
        """Consumer warpgroups: acc = sum over ``k_tiles`` (>= 0; 0 gives zeros) k-tiles and their
        units of the unit's wgmma partial product times its per-element factors.

        ``fb``: running k-tile count (selects the factor buffer; returned advanced), ``t``:
        consumer thread index (0..255), ``elems``: :meth:`_thread_elems`, ``src``: the
        subclass's scale sources for this tile. Returns ``(state, fb)``; every ring slot of
        the tile is released and no wgmma is in flight on return.
        """
        acc.fill(0.0)
        word = self._load_word(src, t, Int32(0))
        for kt in cutlass.range(k_tiles, unroll=1):
            buf = fb % 2
            self._store_factors(fac, buf, t, word)  # while the k-tile's TMA may still land
            pipe.consumer_wait(state)
            self._issue(tCrA, tCrB, tmps[0], state.index, 0)
            if cutlass.const_expr(self.temps == 2):
                self._issue(tCrA, tCrB, tmps[1], state.index, 1)
            word = self._load_word(src, t, cutlass.min(kt + 1, k_tiles - 1))  # next k-tile's, one ahead
            consumer_barrier()  # factors of this k-tile visible (and the other buffer free)
            for u in cutlass.range_constexpr(self.units):
                if cutlass.const_expr(u + 1 < self.units):
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                    pipe.consumer_release(state)
                self._promote(acc, tmps[u % self.temps], fac, buf, u, elems)
                if cutlass.const_expr(u + 2 < self.units):
                    self._issue(tCrA, tCrB, tmps[u % self.temps], state.index, u + 2)
            state.advance()
            fb = fb + 1
        return state, fb

    def _consumer_setup(self, sA, sB, tid):
        """``(thr_mma, tCrA, tCrB, acc, tmps, elems)`` of consumer thread ``tid``."""
        thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(sA, sB, tid)
        tmps = [cute.make_rmem_tensor_like(acc) for _ in range(self.temps)]
        return thr_mma, tCrA, tCrB, acc, tmps, self._thread_elems(thr_mma)


# ---------------------------------------------------------------- fp8_block wgrad
class Fp8BlockWgradSm90(_ScaledGemm):
    """fp8_block grouped weight gradient (one promotion per 128-token k-tile).

    Call (jit): ``(mA [Na, 128 S] e4m3, mSA [S, Na] f32, mB [Nb, 128 S] e4m3, mSB [S, Nb] f32,
    mOffsets [E+1] int32, mOut [E, Na, Nb] bf16, num_ctas, stream)``; scale row strides
    arbitrary (unit column stride); Nb a multiple of tile_n; one asynchronous TMA store per tile, as
    ``sm90.expert_bwd``'s wgrad (rows past Na clipped by the TMA unit).
    """

    def __init__(self, cfg: Fp8MainloopConfig):
        super().__init__(cfg, units=1)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mSA: cute.Tensor, mB: cute.Tensor, mSB: cute.Tensor,
                 mOffsets: cute.Tensor, mOut: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        self.mainloop.setup()
        atom_a, coord_a, atom_b, coord_b = self.mainloop.make_tma(mA, mB)
        # out as (Na, Nb, E): rows past Na are out of bounds
        atom_c, coord_c = make_tma_store(experts_last(mOut), self.cfg.tile_m, self.cfg.tile_n)
        self.shared_storage = self._storage()
        self.kernel(atom_a, coord_a, atom_b, coord_b, mSA, mSB, mOffsets, mOut, atom_c, coord_c).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1,
            stream=stream)

    @cute.jit
    def _load_word(self, src, t: Int32, kt: Int32):
        """Thread t < 128: sa[slot, row t]; 128 <= t < 128 + tile_n: sb[slot, column t - 128]."""
        mSA, mSB, base, m0, n0, na = src
        w = Float32(0.0)
        if t < _ROWS:
            w = mSA[base + kt, cutlass.min(m0 + t, na - 1)]
        elif t < self.fac_slots:
            w = mSB[base + kt, n0 + t - _ROWS]
        return w

    @cute.jit
    def _store_factors(self, fac: cute.Tensor, buf: Int32, t: Int32, w: Float32):
        if t < self.fac_slots:
            fac[t, 0, buf] = w

    @cute.kernel
    def kernel(self, atom_a: cute.CopyAtom, coord_a: cute.Tensor, atom_b: cute.CopyAtom, coord_b: cute.Tensor,
               mSA: cute.Tensor, mSB: cute.Tensor, mOffsets: cute.Tensor, mOut: cute.Tensor,
               atom_c: cute.CopyAtom, coord_c: cute.Tensor):
        cfg = self.cfg
        tidx, warp = self.mainloop.start([atom_a, atom_b, atom_c])
        pipe, sA, sB, sC, fac = self._allocate()
        na = coord_a.shape[0]
        num_experts, m_tiles, n_tiles, total, linear, grid = wgrad_start(mOffsets, na, coord_b.shape[0], cfg.tile_m,
                                                                         cfg.tile_n)
        producer_regs, consumer_regs = self._regs()

        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(producer_regs)
            if warp == 0:
                state = self.mainloop.producer_state()
                while linear < total:
                    expert, m_tile, n_tile = wgrad_tile(linear, m_tiles, n_tiles)
                    lo = mOffsets[expert]
                    k_tiles = (mOffsets[expert + 1] - lo + (cfg.tile_k - 1)) // cfg.tile_k
                    k0 = (lo // cfg.tile_k + expert) * cfg.tile_k
                    gA = cute.local_tile(cute.domain_offset((0, k0), coord_a), (cfg.tile_m, cfg.tile_k),
                                         (m_tile, None))
                    gB = cute.local_tile(cute.domain_offset((0, k0), coord_b), (cfg.tile_n, cfg.tile_k),
                                         (n_tile, None))
                    state = self.mainloop.load_tile(pipe, state, atom_a, gA, sA, atom_b, gB, sB, k_tiles)
                    linear = linear + grid
                pipe.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(consumer_regs)
            tid = tidx - THREADS_PER_WG
            thr_mma, tCrA, tCrB, acc, tmps, elems = self._consumer_setup(sA, sB, tid)
            state = self.mainloop.consumer_state()
            fb = Int32(0)
            while linear < total:
                expert, m_tile, n_tile = wgrad_tile(linear, m_tiles, n_tiles)
                lo = mOffsets[expert]
                k_tiles = (mOffsets[expert + 1] - lo + (cfg.tile_k - 1)) // cfg.tile_k
                row0 = m_tile * cfg.tile_m
                src = (mSA, mSB, lo // cfg.tile_k + expert, row0, n_tile * cfg.tile_n, na)
                state, fb = self.mma_tile_scaled(pipe, state, tCrA, tCrB, acc, tmps, k_tiles, fac, fb, tid,
                                                 elems, src)
                gC = cute.local_tile(coord_c[(None, None, expert)], (cfg.tile_m, cfg.tile_n), (m_tile, n_tile))
                tma_store_tile(thr_mma, acc, sC, tid, atom_c, gC)
                linear = linear + grid
            tma_store_drain(tid)


# ---------------------------------------------------------------- compile
def _offs_fake():
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)


def compile_fp8_block_wgrad(cfg: Fp8MainloopConfig = Fp8MainloopConfig(tile_n=128), arch: str = "sm_90a",
                            inspect: bool = False):
    """Compile the fp8_block wgrad with symbolic Na, Nb, S, E and strides; ``(compiled, report)``."""
    if arch != "sm_90a":
        raise ValueError(f"the SM90 fp8_block wgrad needs arch sm_90a, got {arch!r}")
    f8 = cutlass.Float8E4M3FN
    na, nb, s, e = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=16)
    args = (_fake(f8, (na, k), 16), _fake(Float32, (s, na), 1), _fake(f8, (nb, k), 16), _fake(Float32, (s, nb), 1),
            _offs_fake(), _fake(cutlass.BFloat16, (e, na, nb), 8))
    return compile_kernel(Fp8BlockWgradSm90(cfg), *args, Int32(1), cute.runtime.make_fake_stream(), arch=arch,
                          inspect=inspect)


# ---------------------------------------------------------------- host wrappers
DEFAULT_WGRAD_CONFIG = Fp8MainloopConfig(tile_n=128)


def _check_fp8_rows(name, t):
    """2-D e4m3 with unit column stride, row stride a multiple of 16 bytes, 16-byte aligned."""
    _check_tensor(name, t, 2, (torch.float8_e4m3fn,))
    if t.stride(1) != 1 or t.stride(0) % 16 or t.stride(0) < t.shape[1] or t.data_ptr() % 16:
        raise ValueError(f"{name} must have unit column stride, a row stride that is a multiple of 16 and "
                         f"16-byte alignment, got strides {t.stride()}")


def _check_scales(name, t, shape):
    _check_tensor(name, t, 2, (torch.float32,))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be fp32 {tuple(shape)}, got {tuple(t.shape)}")
    if t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        raise ValueError(f"{name} must have unit column stride (any row stride >= its columns), got {t.stride()}")


def _sm90(t, what):
    dev, arch = device_arch(t.device)
    if arch != "sm_90a":
        raise ValueError(f"the SM90 {what} needs an sm_90a device, got {arch}")
    return dev, arch


def grouped_wgrad_fp8_block(a_t, a_scales, b_t, b_scales, offsets, *, out=None,
                            cfg: Fp8MainloopConfig = DEFAULT_WGRAD_CONFIG):
    """dW [E, Na, Nb] bf16: dW[e] = bf16(sum over expert e's 128-token k-tiles j of
    (A_j^T B_j) * a_scales[j, row] * b_scales[j, col]), tiles in order, FP32 accumulation
    (bitwise repeatable); experts without tokens get zeros.

    Operands as ``quantize_fp8.quantize_tokens(x, offsets, "fp8_block")`` returns them:
    a_t float8_e4m3fn [Na, 128 S] (unit column stride, row stride a multiple of 16,
    16-byte aligned: e.g. the row slices ``dgu_t[:I]`` / ``dgu_t[I:]``), a_scales fp32
    [S, Na] with unit column stride and any row stride (column slices such as
    ``dgu_scales[:, :I]`` are read in place, not copied); b_t [Nb, 128 S], b_scales [S, Nb]
    likewise; Nb a multiple of ``cfg.tile_n``. offsets int32/int64 [E+1] on the device
    (0, non-decreasing, last = M with S = M // 128 + E; trusted, not checked: no host sync).
    ``out``: optional preallocated contiguous [E, Na, Nb].
    """
    _check_fp8_rows("a_t", a_t)
    _check_fp8_rows("b_t", b_t)
    e = _check_offsets(offsets)
    na, ka = a_t.shape
    nb = b_t.shape[0]
    if ka % SCALE_BLOCK or ka // SCALE_BLOCK < e:
        raise ValueError(f"a_t must be [Na, 128 S] with S >= E={e} token slots, got {tuple(a_t.shape)}")
    s = ka // SCALE_BLOCK
    if b_t.shape[1] != ka:
        raise ValueError(f"b_t must be [Nb, 128 S = {ka}] (as a_t), got {tuple(b_t.shape)}")
    if na == 0 or nb == 0 or nb % cfg.tile_n:
        raise ValueError(f"Na={na} must be positive and Nb={nb} a positive multiple of tile_n={cfg.tile_n}")
    _check_scales("a_scales", a_scales, (s, na))
    _check_scales("b_scales", b_scales, (s, nb))
    out = wgrad_out(out, (e, na, nb), a_t.device)
    _check_devices(a_t=a_t, a_scales=a_scales, b_t=b_t, b_scales=b_scales, offsets=offsets, out=out)
    dev, arch = _sm90(a_t, "fp8_block wgrad")
    launcher = compile_cached(("sm90_fp8_block_wgrad", arch, cfg.key()),
                              lambda: GraphLauncher(compile_fp8_block_wgrad(cfg, arch)[0]))
    tiles = e * -(-na // cfg.tile_m) * (nb // cfg.tile_n)
    num_ctas = max(1, min(sm_count(dev), tiles))
    offs32 = offsets_i32(offsets)
    key = (tensor_key(a_t), tensor_key(a_scales), tensor_key(b_t), tensor_key(b_scales), offs32.data_ptr(),
           offs32.shape, tensor_key(out), num_ctas)
    launcher.launch(dev, torch._C._cuda_getCurrentRawStream(dev), key, lambda stream: (
        _Desc(a_t), _Desc(a_scales), _Desc(b_t), _Desc(b_scales), _Desc(offs32), _Desc(out), Int32(num_ctas),
        stream))
    return out

"""The fused MoE forward on Hopper (sm_90a): one persistent launch per forward per rank.

One kernel runs the whole layer after the routing plan, with the SMs split into
``comm_ctas`` row-moving CTAs and ``grid - comm_ctas`` GEMM CTAs working at the same time:

1. gather into the ring ``xg`` [ring * 128, H]: chunk ``c`` = routed m-tile ``c`` (up to 128
   grouped rows ``i`` of one expert, each ``x[order[i] // k]``) goes to ring slot ``c % ring``;
   chunk ``c >= ring`` waits until m-tile ``c - ring``'s GEMM1 tiles have read the slot
   (``h_ready``); each chunk bumps ``gather_ready[c]`` when its rows are stored. The ring is the
   only buffer of gathered rows (``ring`` >= the m-tiles: no slot is reused). At EP = 1 the comm
   CTAs gather the ring's first fill (BF16: through their idle shared-memory stages; MXFP8:
   dequantized through registers), then take GEMM tasks; the later chunks are gathered in
   pieces of :data:`~mok_cute.schedule.fused_tasks.PIECE_ROWS` rows by the idle producer warps
   1-3 of every CTA beside its tiles (the background gather). At EP > 1 the comm CTAs pull every
   chunk from the source ranks through registers.
2. GEMM tasks, one static list (:mod:`mok_cute.schedule.fused_tasks`) whose tasks every CTA
   claims from a device ticket counter (the comm CTAs once their chunks are gathered), in
   dependency order:

   ====  ==================================  ==========================  ======================
   S1    shared GEMM1 + SwiGLU (x rows)       ready at once               bumps ``sh_ready[m]``
   R1    routed GEMM1 + SwiGLU (ring slot)    waits its gather chunk      bumps ``h_ready[mt]``
   S2    shared GEMM2 -> s_out [T, H]         waits ``sh_ready[m]``       bumps ``done``
   R2    routed GEMM2 -> slot_out[route]      waits ``h_ready[mt]``       bumps ``done``
   ====  ==================================  ==========================  ======================

   so the shared expert's tiles keep the tensor cores busy while the first chunks are
   gathered. R1 walks each expert's m-tiles in bands of ``band = min(RING_BAND, ring)`` (see
   :mod:`mok_cute.schedule.fused_tasks`), so the ring's waits point backwards in the list. A
   routed GEMM2 row goes straight to its (token, slot) row ``order[i]`` of ``slot_out``
   [T*k, H] (never accumulated).
3. slot sum (every CTA, once ``done`` counts every GEMM2 tile): ``y[t] = bf16(acc)`` with
   ``acc = fp32(s_out[t])`` (0 without a shared expert) then ``acc = acc + w[t, j] *
   fp32(slot_out[t*k + j])`` for the slots ``j`` in order whose expert id is >= 0 (separate
   ``mul.rn`` / ``add.rn``, the reference's rounding).

Deadlock freedom: every task waits only for tasks earlier in the list, each CTA runs its
tasks in list order, and all CTAs are resident (one CTA per SM, grid <= SMs). Every wait is
bounded (``timeout_ns`` of ``%globaltimer``; the first error is recorded in ``status``
int32[4] and every later wait gives up, so the kernel always ends; the host raises).

Determinism: each output element's arithmetic is fixed by the data (a GEMM row's k-tile
order, the slot order), never by which CTA ran a task or when it ran, so ``y`` is bitwise
the same for any ``comm_ctas`` and run after run.

Operands (bf16, row-major, 16-byte aligned; bundled as :class:`FwdInputs`, :class:`FwdWeights`,
:class:`FwdOutputs`, :class:`FwdRoutes`, :class:`FwdCounters`, :class:`FwdScalars`,
:class:`FwdPeers`): x [T, H]; w_gate, w_up [E, I, H]; w_down [E, H, I]; shared ws_gate, ws_up
[1, I_s, H], ws_down [1, H, I_s]; order int32 [M_cap] (route ``t*k + j`` of each grouped row,
rows sorted by expert), offsets int32 [E+1]; topk_idx int32 [T*k], topk_w fp32 [T*k].
Outputs: xg [ring * 128, H] (scratch), gu [M_cap, 2, I], h [M_cap, I], slot_out [T*k, H] (rows
of -1 slots untouched), gus [T, 2, I_s], hs [T, I_s], s_out [T, H], y [T, H]. Counters int32,
zero at launch: gather_ready and h_ready [ceil(M_cap/128) + E] (per routed m-tile), sh_ready
[ceil(T/128)], [done, ticket, gather CTAs, slot-sum CTAs]. H, I, I_s multiples of 64 (H not of
tile_n, 256 by default, or I, I_s not of tile_n / 2: the ``n_tail`` variant, its last n-tiles masked).

Variants: ``mx`` (MXFP8: x's rows move as e4m3 + E8M0 and are dequantized into the ring, the
SwiGLU epilogue also writes h's MXFP8 round trip, GEMM2's A operand); ``ep`` (EP > 1,
:func:`fused_forward` with a workspace: the gather pulls rows and router weights from the
source ranks, GEMM2 rows are pushed to the source ranks' slot buffers, the slot sum waits for
every rank's DATA; protocol in docs/architecture.md); ``trace`` (per-task records) and
``progress`` (per-CTA progress words in host memory); ``helpers`` (EP = 1, from a GEMM1 depth H
of :func:`fused_helpers`): an S1 / R1 tile's h (MXFP8: and its round trip) is computed, stored
and published by the producer warpgroup's last two warps from the staged tile (named barriers
STAGED / FREE) while the consumers store gu and go on; one background-gather warp is left
beside them, which at BF16 moves its rows by ``cp.async.bulk`` through a small shared-memory
ring (the register copy fell behind GEMM1 at I 1024); ``clamp`` / ``gated``: the SwiGLU's limit given / its
alpha and up offset (compile-time constants, :mod:`mok_cute.kernels.swiglu_math`).
"""
from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from mok_cute.comm import protocol as P
from mok_cute.comm.peer_rows import PeerRows, PeerSections
from mok_cute.comm.rows import bulk_g2s, bulk_ring, bulk_s2g
from mok_cute.dsl import deferred, env
from mok_cute.dsl.compile import compile_cached, compile_kernel, device_arch
from mok_cute.dsl.host import sm_count
from mok_cute.dsl.launch import GraphLauncher, _Desc, tensor_key
from mok_cute.dsl.tensors import _fake_2d, _fake_3d
from mok_cute.kernels import slot_rows
from mok_cute.kernels.operands import ExpertWeights, FusedForwardOut, FusedLaunch, RoutePlan, SharedExpert  # noqa: F401
from mok_cute.kernels.quant.fp8_ops import Fp8Ops
from mok_cute.kernels.sm90 import persistent, route_rows
from mok_cute.kernels.sm90.persistent import TRACE_WORDS
from mok_cute.kernels.sm90.bias import TileBias, add_bias, bias_load, fake_bias
from mok_cute.kernels.sm90.persistent import opaque as _opaque
from mok_cute.kernels.sm90.grouped_gemm import (
    _VEC, FREE_BARRIER, HELPERS_MIN_K, HELPERS_MX_MIN_K, HELPERS_TILE_N, STAGED_BARRIER, PlainEpilogue,
    SwigluEpilogue, helper_threads,
)
from mok_cute.kernels.swiglu_math import Gated, swiglu_args
from mok_cute.kernels.sm90.mainloop import (
    CONSUMER_REGS, NUM_THREADS, PRODUCER_REGS, THREADS_PER_WG, MainloopConfig, Sm90Mainloop, StackedB, acc_to_smem,
    consumer_barrier, experts_last, launch_config,
)
from mok_cute.schedule import fused_tasks as tasks
from mok_cute.schedule.fused_tasks import PIECE_ROWS, PIECES, R1, R2, S1, S2
from mok_cute.schedule.group_tiles import tiles_over

CHUNK = 128  # rows per gather chunk (= tile_m)
# wait channels recorded in status on a timeout (after the comm protocol's own)
GATHER, H_READY, SH_READY, DONE, RING = 16, 17, 18, 19, 20
PROGRESS_WORDS = 4  # per CTA in the progress variant: producer, consumers, CTA, slot sum (see _mark)
PROGRESS_STATES = (  # per word, what each code the kernel's _mark calls write means
    {1: "claimed", 2: "inputs ready", 3: "loaded", 4: "stop handed off", 5: "EMPTY done", 6: "tail done",
     7: "wait GEMM2", 8: "GEMM2 seen"},
    {1: "took", 2: "mma done", 3: "epilogue done", 4: "published", 5: "loop left", 6: "regs for sum"},
    {1: "gathered chunk", 2: "gather done", 3: "producer wg regs for sum"},
    {9: "slot sum", 10: "finished"},
)
KINDS = ("S1", "R1", "S2", "R2", "gather", "wait GEMM2", "slot sum")
GATHER_KIND, WAIT_KIND, SUM_KIND = 4, 5, 6
BG_WARPS = 3  # producer warpgroup warps 1-3: the background gather (warp 0 is the TMA producer)
BG_BARRIER = 6  # their named barrier (1: consumers' epilogue, 2-5: the task hand-off)
HELPERS_BARRIER = 9  # the SwiGLU helper warps' own (7, 8: their hand-off with the consumers)
TASK_FIELDS = 5  # a task handed off decoded (tasks.task): phase, n_tile, row0, rows, mt
TASK_WORDS = 2 * (1 + TASK_FIELDS)  # the hand-off's two slots: the task id, then its fields
HELP_WORDS = 5  # the staged S1 / R1 tile the consumers hand to the helpers: phase (-1: stop), n_tile, row0, rows, mt
BG_UNROLL = 4  # 16-byte loads in flight per background lane (they run at PRODUCER_REGS)
BG_MX_UNROLL = 2  # MXFP8 chunks (16 e4m3 + a scale byte, 32 bf16 bytes out) in flight per background lane
BG_SEG = 4096  # bytes per bulk copy of the bf16 background gather beside the helpers: a row in segments
BG_STAGES = 4  # its shared-memory ring of BG_SEG-byte stages (BG_STAGES - 1 loads in flight)
# Measured choices (docs/design-decisions.md): 4 and 16 slot rows in flight per slot-sum thread within 1% or slower,
# R1 bands of 16 and 32 within 0.3% at the power cap, more gather loads in flight changed nothing
SUM_BATCH = 8  # slot rows in flight per thread of the slot sum (cp.async into the idle B stages)
RING_BAND = 8  # R1's band of m-tiles per expert (at most the ring's slots: a slot reuse never waits forward)
GATHER_UNROLL = 8  # 16-byte loads in flight per lane of the comm CTAs' register gather


# ---------------------------------------------------------------- the kernel's operand bundles
# Each is passed whole through cute.compile into the kernel: its fields become the kernel's parameters in field
# order (None fields: absent), so the order below is the kernel's parameter order.
class FwdInputs(NamedTuple):
    """The rows the forward reads: x bf16 [T, H]; xq uint8 [T, rb] or None (MXFP8: x's token rows as H e4m3 bytes
    then H/32 E8M0 scales, the gather's source); xg bf16 [ring * 128, H], the ring of gathered rows."""

    x: cute.Tensor
    xq: cute.Tensor | None
    xg: cute.Tensor


class FwdWeights(NamedTuple):
    """The weights (host function only; the kernel gets their TMA atoms), bf16: w_gate, w_up [E, I, H], w_down
    [E, H, I]; the shared expert's s_gate, s_up [1, I_s, H] and s_down [1, H, I_s] (None without one); the routed
    experts' biases b_gate, b_up [E, I] and b_down [E, H] (``biased``; else None), which the kernel reads itself."""

    w_gate: cute.Tensor
    w_up: cute.Tensor
    w_down: cute.Tensor
    s_gate: cute.Tensor | None
    s_up: cute.Tensor | None
    s_down: cute.Tensor | None
    b_gate: cute.Tensor | None = None
    b_up: cute.Tensor | None = None
    b_down: cute.Tensor | None = None


class FwdOutputs(NamedTuple):
    """What the forward writes, bf16: gu [M_cap, 2, I], h [M_cap, I]; the shared expert's gus [T, 2, I_s], hs
    [T, I_s] (None without one); MXFP8: h_rt [M_cap, I], hs_rt [T, I_s], h's round trips (GEMM2's A; else None);
    slot [T*k, H], the GEMM2 row of each route; s_out [T, H], the shared expert's output (or None); y [T, H]."""

    gu: cute.Tensor
    h: cute.Tensor
    gus: cute.Tensor | None
    hs: cute.Tensor | None
    h_rt: cute.Tensor | None
    hs_rt: cute.Tensor | None
    slot: cute.Tensor
    s_out: cute.Tensor | None
    y: cute.Tensor


class FwdRoutes(NamedTuple):
    """The routing and the slot sum's factors: order int32 [M_cap] (each grouped row's route), offsets int32
    [E+1]; idx int32 [T*k], w fp32 [T*k] (each slot's expert id and router weight); gate fp32 [T] or None, the
    shared expert's output gate per token."""

    order: cute.Tensor
    offsets: cute.Tensor
    idx: cute.Tensor
    w: cute.Tensor
    gate: cute.Tensor | None


class FwdCounters(NamedTuple):
    """The kernel's int32 counters, zero at launch (:func:`counter_sizes`): gather_ready, h_ready (per routed
    m-tile), sh_ready (per shared m-tile), done [done, ticket, gather CTAs, slot-sum CTAs]; status int32 [4], the
    first error; trace int64 [n * 4] or None, the trace records or the progress words."""

    gather: cute.Tensor
    h_ready: cute.Tensor
    sh_ready: cute.Tensor
    done: cute.Tensor
    status: cute.Tensor
    trace: cute.Tensor | None


class FwdScalars(NamedTuple):
    """k (slots per token), limit (the SwiGLU clamp; unused without one), comm_ctas, ring (slots of the ring), band
    (R1's m-tiles per band, <= ring), timeout_ns (every device wait's bound)."""

    k: Int32
    limit: Float32
    comm_ctas: Int32
    ring: Int32
    band: Int32
    timeout_ns: Int64


class FwdPeers(NamedTuple):
    """EP > 1 (:class:`~mok_cute.comm.peer_rows.PeerRows`, :meth:`CommWorkspace.kernel_args` order): peer int64
    [R] (each rank's workspace base), w_rows fp32 [M_cap] (each grouped row's router weight, pulled), slot_copy
    bf16 [T*k, H] (this rank's slot rows as summed); this rank, the rank count, the workspace sections' offsets,
    the launch's pull and push epochs. At EP = 1 the tensors are None (:data:`_NO_PEERS`)."""

    peer: cute.Tensor | None
    w_rows: cute.Tensor | None
    slot_copy: cute.Tensor | None
    me: Int32
    n_ranks: Int32
    src_off: Int64
    slots_off: Int64
    w_off: Int64
    flags_off: Int64
    epoch_pull: Int32
    epoch_push: Int32


class Tma(NamedTuple):
    """One TMA operand: its copy atom and the coordinate tensor the loads partition."""

    atom: cute.CopyAtom
    coord: cute.Tensor


class FwdTmas(NamedTuple):
    """The kernel's TMA operands (:class:`Tma`, made by the host function): x (S1's A), xg (R1's A), w_gate / w_up
    halves (GEMM1's B), h or its round trip (R2's A), w_down; the shared expert's gate / up halves, hs or its round
    trip, w_down (None without one)."""

    x: Tma
    xg: Tma
    wg: Tma
    wu: Tma
    h: Tma
    wd: Tma
    sg: Tma | None
    su: Tma | None
    hs: Tma | None
    sd: Tma | None


# ---------------------------------------------------------------- in-kernel groupings (never kernel parameters)
class _Walk(NamedTuple):
    """What every role of a CTA derives once at kernel entry: its block and the grid, the status words, the
    problem's sizes and the task list's counts (see :func:`mok_cute.schedule.fused_tasks.task`)."""

    bidx: Int32
    grid: Int32
    status: cute.Pointer
    tokens: Int32
    num_experts: Int32
    shape: tasks.ListShape  # the task list's phase sizes (n1: GEMM1 n-tiles, n2: GEMM2 n-tiles)
    n1s: Int32  # the shared expert's GEMM1 n-tiles
    k1: Int32  # k-tiles of GEMM1 (S1, R1), R2 and S2
    k2: Int32
    k2s: Int32
    n_tasks: Int32
    mt_routed: Int32
    fill: Int32  # chunks the comm CTAs gather (the ring's first fill with the background gather)


class _Smem(NamedTuple):
    """The CTA's shared memory: the A / B stages, the epilogue tile, the task hand-off, the helpers' words and
    (``biased``) the tile's biases, fp32 [tile_n]."""

    a: cute.Tensor
    b: cute.Tensor
    c: cute.Tensor
    task: cute.Tensor
    help: cute.Tensor
    bias: cute.Tensor | None


class _Tile(NamedTuple):
    """A task's tile as handed off: phase, n-tile, first grouped row, rows, m-tile, expert (``biased``; else 0)."""

    phase: Int32
    n_tile: Int32
    row0: Int32
    rows: Int32
    mt: Int32
    expert: Int32


class FusedMoeFwdSm90:
    """The persistent fused forward (see the module doc); ``clamp``: SwiGLU limit given, ``gated``: the SwiGLU's
    alpha and up offset (None: silu(g) * u), ``shared``: a shared expert is fused in; ``n_tail``: H not a multiple
    of tile_n or I, I_s not of tile_n / 2 (the last n-tiles' stores masked); ``biased``: the routed experts' biases
    added to the R1 / R2 tiles' accumulators (:mod:`~mok_cute.kernels.sm90.bias`; the hand-off carries each task's
    expert); ``helpers`` (EP = 1): the S1 / R1
    tiles' h (MXFP8: and its round trip) computed, stored and published by the producer warpgroup's last two warps
    from the staged tile while the consumers store gu and go on to the next tile, the one background-gather warp
    left beside them moving its rows (BF16) by ``cp.async.bulk`` through a small shared-memory ring."""

    def __init__(self, clamp: bool, shared: bool, *, trace: bool = False, progress: bool = False, mx: bool = False,
                 ep: bool = False, n_tail: bool = False, helpers: bool = False,
                 cfg: MainloopConfig = MainloopConfig(), gated: Gated | None = None, biased: bool = False):
        if trace and progress:
            raise ValueError("trace and progress share the kernel's record buffer: ask for one")
        if helpers and ep:
            raise ValueError("helpers (SwiGLU's h by the producer warpgroup's warps): EP = 1 only")
        if helpers and cfg.tile_n != HELPERS_TILE_N:
            raise ValueError(f"helpers: the helper lanes span a {HELPERS_TILE_N // 2}-column half tile, so tile_n "
                             f"{HELPERS_TILE_N} only, got {cfg.tile_n}")
        self.cfg, self.clamp, self.shared, self.trace = cfg, clamp, shared, trace
        self.progress, self.mx, self.ep, self.n_tail = progress, mx, ep, n_tail
        # EP = 1: the comm CTAs gather the ring's first fill, the background warps the later chunks (bg); EP > 1:
        # the comm CTAs pull every chunk through registers
        self.bg = not ep
        self.staged = not mx and not ep  # the BF16 comm CTAs' chunks through their idle shared-memory stages
        self.gather_units = PIECES if self.bg else 1  # gather_ready's count of a gathered chunk
        self.helpers, self.biased = helpers, biased
        self.fields = TASK_FIELDS + (1 if biased else 0)  # the hand-off's words per task: the expert when biased
        self.task_words = 2 * (1 + self.fields)
        self.bg_warps = 1 if helpers else BG_WARPS
        self.helper_warps = 3 - self.bg_warps if helpers else 0
        self.bg_bulk = helpers and not mx  # the BF16 background warp beside the helpers: by cp.async.bulk
        self.swiglu = SwigluEpilogue(cfg.tile_m, cfg.tile_n, clamp, mx_rt=mx, n_tail=n_tail, gated=gated)
        self.fp8 = Fp8Ops(bf16=True)  # the MXFP8 gather's dequantization
        self.plain = PlainEpilogue(cfg.tile_m, cfg.tile_n, n_tail)
        self.mainloop = Sm90Mainloop(cfg, epi_smem_bytes=self.swiglu.smem_elems() * 2)
        b_bytes = self.mainloop.stages * cfg.tile_n * cfg.tile_k * 2
        if not 1 <= SUM_BATCH * NUM_THREADS * _VEC * 2 <= b_bytes:
            raise ValueError(f"SUM_BATCH {SUM_BATCH}: the slot sum's cp.async buffer must fit the B stages "
                             f"({b_bytes} bytes)")
        # the staged gather's two batches per lane fill the A and B stages (contiguous, 1024-aligned)
        self.gather_cap = self.mainloop.stages * cfg.stage_bytes() // (2 * NUM_THREADS * _VEC * 2)

    @cute.jit
    def __call__(self, inp: FwdInputs, weights: FwdWeights, outs: FwdOutputs, routes: FwdRoutes, sync: FwdCounters,
                 scalars: FwdScalars, peers: FwdPeers, num_ctas: Int32, stream: cuda.CUstream):
        ml = self.mainloop
        ml.setup()
        atom_x, coord_x, atom_wg, coord_wg = ml.make_tma(inp.x, experts_last(weights.w_gate), b_half=True)
        atom_xg, coord_xg, atom_wu, coord_wu = ml.make_tma(inp.xg, experts_last(weights.w_up), b_half=True)
        h2, hs2 = outs.h, outs.hs  # GEMM2's A operands: h, or (MXFP8) its round trip
        if cutlass.const_expr(self.mx):
            h2, hs2 = outs.h_rt, outs.hs_rt
        atom_h, coord_h, atom_wd, coord_wd = ml.make_tma(h2, experts_last(weights.w_down))
        sg, su, hs, sd = None, None, None, None
        if cutlass.const_expr(self.shared):
            _, _, atom_sg, coord_sg = ml.make_tma(inp.x, experts_last(weights.s_gate), b_half=True)
            _, _, atom_su, coord_su = ml.make_tma(inp.x, experts_last(weights.s_up), b_half=True)
            atom_hs, coord_hs, atom_sd, coord_sd = ml.make_tma(hs2, experts_last(weights.s_down))
            sg, su, hs, sd = Tma(atom_sg, coord_sg), Tma(atom_su, coord_su), Tma(atom_hs, coord_hs), Tma(atom_sd,
                                                                                                         coord_sd)
        tma = FwdTmas(Tma(atom_x, coord_x), Tma(atom_xg, coord_xg), Tma(atom_wg, coord_wg), Tma(atom_wu, coord_wu),
                      Tma(atom_h, coord_h), Tma(atom_wd, coord_wd), sg, su, hs, sd)
        # extra words: the task hand-off's two slots, then (helpers) the staged tile's (phase, n_tile, row0, rows, mt)
        self.shared_storage = ml.shared_storage(self.swiglu.smem_elems(), extra_i32=self.task_words + HELP_WORDS,
                                                bulk_bytes=BG_SEG * BG_STAGES if self.bg_bulk else 0,
                                                bulk_barriers=BG_STAGES if self.bg_bulk else 0,
                                                extra_f32=self.cfg.tile_n if self.biased else 0)
        bias = TileBias(weights.b_gate, weights.b_up, weights.b_down)
        self.kernel(tma, inp, outs, routes, sync, scalars, peers, bias).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, tma: FwdTmas, inp: FwdInputs, outs: FwdOutputs, routes: FwdRoutes, sync: FwdCounters,
               scalars: FwdScalars, peers: FwdPeers, bias: TileBias):
        cfg = self.cfg
        atoms = [tma.x.atom, tma.xg.atom, tma.wg.atom, tma.wu.atom, tma.h.atom, tma.wd.atom]
        if cutlass.const_expr(self.shared):
            atoms += [tma.sg.atom, tma.su.atom, tma.hs.atom, tma.sd.atom]
        tidx, warp = self.mainloop.start(atoms)
        pipe, sA, sB, sC, storage = self.mainloop.allocate(self.shared_storage, self.swiglu, with_storage=True)
        sTask = storage.extra.get_tensor(cute.make_layout(self.task_words))  # task hand-off: producer -> consumers
        sHelp = cute.make_tensor(storage.extra.data_ptr() + self.task_words, cute.make_layout(HELP_WORDS))  # helpers
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        status = sync.status.iterator
        ep = None  # EP > 1: the symmetric workspace's rows and flags
        if cutlass.const_expr(self.ep):
            ep = PeerRows(peers.peer, peers.w_rows, peers.me, peers.n_ranks,
                          PeerSections(peers.src_off, peers.slots_off, peers.w_off, peers.flags_off), peers.epoch_pull,
                          peers.epoch_push, inp.x.shape[0] * scalars.k, scalars.timeout_ns, status)

        tokens = inp.x.shape[0]
        hidden = inp.x.shape[1]
        num_experts = routes.offsets.shape[0] - 1
        n1 = tiles_over(tma.wg.coord.shape[0], cfg.tile_n // 2, self.n_tail)  # GEMM1 n-tiles (2I / tile_n)
        n2 = tiles_over(tma.wd.coord.shape[0], cfg.tile_n, self.n_tail)  # GEMM2 n-tiles (H / tile_n)
        k1 = (hidden + (cfg.tile_k - 1)) // cfg.tile_k
        k2 = (tma.h.coord.shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        m_sh = (tokens + (cfg.tile_m - 1)) // cfg.tile_m
        n1s = Int32(0)
        k2s = Int32(0)
        if cutlass.const_expr(self.shared):
            n1s = tiles_over(tma.sg.coord.shape[0], cfg.tile_n // 2, self.n_tail)
            k2s = (tma.hs.coord.shape[1] + (cfg.tile_k - 1)) // cfg.tile_k
        mt_routed = tasks.routed_mtiles(routes.offsets, num_experts, cfg.tile_m)
        n_s1 = m_sh * n1s
        n_r1 = mt_routed * n1
        n_s2 = Int32(0)
        if cutlass.const_expr(self.shared):
            n_s2 = m_sh * n2
        n_tasks = n_s1 + n_r1 + n_s2 + mt_routed * n2
        gemm2_tiles = n_s2 + mt_routed * n2
        fill = mt_routed  # chunks the comm CTAs gather; with bg only the ring's first fill, then warps 1-3 of every CTA
        if cutlass.const_expr(self.bg):
            fill = cutlass.min(scalars.ring, mt_routed)
        walk = _Walk(bidx, grid, status, tokens, num_experts, tasks.ListShape(n_s1, n_r1, n_s2, m_sh, n1, n2), n1s,
                     k1, k2, k2s, n_tasks, mt_routed, fill)
        sBias = None
        if cutlass.const_expr(self.biased):
            sBias = storage.extra_f32.get_tensor(cute.make_layout(cfg.tile_n))
        smem = _Smem(sA, sB, sC, sTask, sHelp, sBias)

        if bidx < scalars.comm_ctas:  # first the gather, then GEMM tasks like every CTA
            gbuf = None  # the staged gather's buffer: the idle A and B stages
            if cutlass.const_expr(self.staged):
                gbuf = cute.make_tensor(storage.sA.data_ptr(), cute.make_layout(
                    (2 * self.gather_cap * NUM_THREADS, _VEC), stride=(_VEC, 1)))
            self._gather(tidx, inp, routes, sync, scalars, walk, ep, gbuf)
            if cutlass.const_expr(self.staged):  # generic-proxy writes of the stages before their TMA loads
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()
            if tidx == 0:
                self._mark(sync.trace, bidx, 2, 2, Int32(0))
        ticket = sync.done.iterator + 1
        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self._produce(pipe, smem, ticket, tma, routes, sync, scalars, walk)
            if cutlass.const_expr(self.helpers):
                if warp > 3 - self.helper_warps:
                    self._help(warp - (4 - self.helper_warps), tidx % 32, smem, outs, sync, scalars.limit)
            if cutlass.const_expr(self.bg):
                if warp > 0 and warp <= self.bg_warps:
                    if cutlass.const_expr(self.bg_bulk):
                        self._gather_bg_bulk(tidx - 32, inp, routes, sync, scalars, walk,
                                             storage.bulk.data_ptr().toint(), storage.bulk_mbar.data_ptr())
                    else:
                        self._gather_bg(tidx - 32, inp, routes, sync, scalars, walk)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(pipe, smem, tidx - THREADS_PER_WG, outs, routes, sync, scalars, walk, ep,
                          sync.gather.shape[0], bias)
        # every CTA: the slot sum, once every GEMM2 tile is stored, with the registers evened out.
        # The consumers give registers back first and the producer warpgroup takes them only after
        # a CTA barrier: setmaxnreg.inc takes from the CTA's pool per warp, so producer warps that
        # raised early would take the registers the consumers' first increase waits for (the
        # intermittent stall seen on the H200: consumers stuck before their first task).
        if warp >= THREADS_PER_WG // 32:
            cute.arch.setmaxregister_decrease(route_rows.SUM_REGS)
            if tidx == THREADS_PER_WG:
                self._mark(sync.trace, bidx, 1, 6, Int32(0))
        cute.arch.barrier()
        if warp < THREADS_PER_WG // 32:
            cute.arch.setmaxregister_increase(route_rows.SUM_REGS)
            if tidx == 32:
                self._mark(sync.trace, bidx, 2, 3, Int32(0))
        t0 = persistent.now(self.trace)
        if tidx == 0:
            self._mark(sync.trace, bidx, 0, 7, Int32(0))
            P.wait_geq(sync.done.iterator, gemm2_tiles, scalars.timeout_ns, status, Int32(0), Int32(DONE))
            self._mark(sync.trace, bidx, 0, 8, Int32(0))
            if cutlass.const_expr(self.ep):  # every rank's rows are in my slot buffer (DATA)
                ep.wait_rows(bidx)
        cute.arch.barrier()
        t1 = persistent.now(self.trace)
        if tidx == 0:
            self._mark(sync.trace, bidx, 3, 9, Int32(0))
        sbuf = cute.make_tensor(storage.sB.data_ptr(), cute.make_layout((SUM_BATCH * NUM_THREADS, _VEC),
                                                                        stride=(_VEC, 1)))
        route_rows.slot_sum(tidx, bidx, grid, route_rows.SlotSumOperands(
            outs.slot, outs.s_out, outs.y, routes.idx, routes.w, routes.gate, copy=peers.slot_copy), scalars.k,
            tokens, hidden, sbuf, SUM_BATCH)
        if tidx == 0:
            self._mark(sync.trace, bidx, 3, 10, Int32(0))
        if cutlass.const_expr(self.ep):  # every CTA has read its slot rows: the last one says FREE
            ep.close_push(tidx, sync.done.iterator + 3, grid)
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                record_sum(sync.trace, grid, bidx, t0, t1)

    # ------------------------------------------------------------------ roles
    @cute.jit
    def _gather(self, tidx: Int32, inp: FwdInputs, routes: FwdRoutes, sync: FwdCounters, scalars: FwdScalars,
                walk: _Walk, ep, gbuf: cute.Tensor):
        """Comm CTAs: chunk c = routed m-tile c (its grouped rows) into ring slot ``c % ring``, by
        CTA ``c % comm_ctas``, in order, for c < ``walk.fill``; chunk ``c >= ring`` first waits until every GEMM1
        n-tile of m-tile ``c - ring`` has read the slot (``h_ready``); each chunk is published by a release
        add on ``gather_ready[c]``. EP > 1 (``ep``): the rows are pulled from the source ranks'
        staged x (pull protocol: CTA 0 signals READY, every comm CTA waits READY from every rank,
        the last comm CTA to finish signals DONE) together with each row's router weight
        (``w_rows``). MXFP8 (``mx``): the rows move as e4m3 + E8M0 (``inp.xq``) and are
        dequantized into the ring (:meth:`_gather_rows`)."""
        bidx, ring = walk.bidx, scalars.ring
        if cutlass.const_expr(self.ep):
            ep.open_pull(tidx, bidx)
        ge, gb = Int32(0), Int32(0)  # m-tile cursor (tasks.mtile)
        for c in cutlass.range(bidx, walk.fill, scalars.comm_ctas, unroll=1):
            t0 = persistent.now(self.trace)
            row0, rows, ge, gb = tasks.chunk_start(tidx, c, ring, walk.shape.n1, routes.offsets, walk.num_experts,
                                                   CHUNK, ge, gb, tasks.RingWait(sync.h_ready, scalars.timeout_ns,
                                                                                 walk.status, Int32(RING)))
            self._gather_rows(tidx, row0, rows, (c % ring) * CHUNK, inp, routes.order, scalars.k, ep, gbuf)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(sync.gather.iterator + c, Int32(self.gather_units), sem="release", scope="gpu")
                self._mark(sync.trace, bidx, 2, 1, c)
                if cutlass.const_expr(self.trace):
                    persistent.record(sync.trace, c, t0, persistent.now(self.trace), GATHER_KIND, bidx, c)
        if cutlass.const_expr(self.ep):  # every comm CTA has pulled its chunks: the last one says DONE
            ep.close_pull(tidx, sync.done.iterator + 2, scalars.comm_ctas)

    @cute.jit
    def _gather_bg(self, t: Int32, inp: FwdInputs, routes: FwdRoutes, sync: FwdCounters, scalars: FwdScalars,
                   walk: _Walk):
        """Producer warpgroup warps 1-3 (1 beside the helpers) of every CTA (``t`` < 96), beside its GEMM tasks (EP =
        1): the chunks from ``walk.fill`` (past the ring's first fill) in pieces of :data:`PIECE_ROWS` rows, piece
        ``q`` (chunk ``fill + q // PIECES``, rows ``(q % PIECES) * PIECE_ROWS ..``) for q = bidx, bidx + grid, ...:
        wait until m-tile ``c - ring``'s GEMM1 tiles have read the slot, copy the rows through registers
        (:data:`BG_UNROLL` loads in flight per lane, one warp per row; MXFP8: :meth:`_mx_row`, :data:`BG_MX_UNROLL`
        chunks), publish with a release add of 1 on ``gather_ready[c]`` (a chunk is ready at :data:`PIECES`). Not
        traced: the pieces overlap the CTA's GEMM tasks."""
        first, chunks, ring, k = walk.fill, walk.mt_routed, scalars.ring, scalars.k
        hid = inp.xg.shape[1]
        warp = t // 32
        lane = t % 32
        base, rb = self._source(inp.x, inp.xq, hid)
        dbase = inp.xg.iterator.toint()
        ge, gb = Int32(0), Int32(0)  # m-tile cursor (tasks.mtile)
        for q in cutlass.range(walk.bidx, (chunks - first) * PIECES, walk.grid, unroll=1):
            c = first + q // PIECES  # >= ring: the chunk's slot was used before
            row0, rows, ge, gb = tasks.chunk_start(t, c, ring, walk.shape.n1, routes.offsets, walk.num_experts, CHUNK,
                                                   ge, gb, tasks.RingWait(sync.h_ready, scalars.timeout_ns,
                                                                          walk.status, Int32(RING)),
                                                   BG_BARRIER, self.bg_warps * 32)
            p0 = q % PIECES * PIECE_ROWS
            for rr in cutlass.range(p0 + warp, cutlass.min(rows, p0 + PIECE_ROWS), self.bg_warps, unroll=1):
                src = base + Int64(routes.order[row0 + rr] // k) * Int64(rb)
                self._move_row(lane, src, dbase + Int64(c % ring * CHUNK + rr) * Int64(hid * 2), hid,
                               BG_MX_UNROLL if self.mx else BG_UNROLL)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=BG_BARRIER, number_of_threads=self.bg_warps * 32)
            if t == 0:
                cute.arch.atomic_add(sync.gather.iterator + c, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _gather_bg_bulk(self, t: Int32, inp: FwdInputs, routes: FwdRoutes, sync: FwdCounters, scalars: FwdScalars,
                        walk: _Walk, buf: Int32, mbar: cute.Pointer):
        """:meth:`_gather_bg` for the one BF16 background warp beside the helpers: the same pieces, slot waits and
        publications, but lane 0 moves each row in :data:`BG_SEG`-byte segments with ``cp.async.bulk`` global ->
        shared (completing on the stage's mbarrier) and shared -> global (bulk groups) through :data:`BG_STAGES`
        stages at ``buf`` (mbarriers at ``mbar``), :data:`BG_STAGES` - 1 loads in flight and no registers held;
        before a piece's release add, every store has completed (``wait_group 0``) and is fenced to the generic
        proxy, after its slot wait the async-proxy writes are ordered after the slot's readers."""
        first, chunks, ring, k, mOrder = walk.fill, walk.mt_routed, scalars.ring, scalars.k, routes.order
        hid = inp.xg.shape[1]
        rb = hid * 2
        nseg = (rb + (BG_SEG - 1)) // BG_SEG
        base = inp.x.iterator.toint()
        dbase = inp.xg.iterator.toint()
        if t == 0:
            for s in cutlass.range_constexpr(BG_STAGES):
                cute.arch.mbarrier_init(mbar + s, 1)
            cute.arch.mbarrier_init_fence()
        ge, gb = Int32(0), Int32(0)  # m-tile cursor (tasks.mtile)
        j0 = Int32(0)  # segments this warp moved before the piece: the stage and phase of its next one
        for q in cutlass.range(walk.bidx, (chunks - first) * PIECES, walk.grid, unroll=1):
            c = first + q // PIECES  # >= ring: the chunk's slot was used before
            row0, rows, ge, gb = tasks.chunk_start(t, c, ring, walk.shape.n1, routes.offsets, walk.num_experts, CHUNK,
                                                   ge, gb, tasks.RingWait(sync.h_ready, scalars.timeout_ns,
                                                                          walk.status, Int32(RING)),
                                                   BG_BARRIER, 32)
            if t == 0:
                p0 = q % PIECES * PIECE_ROWS
                n = cutlass.max(cutlass.min(rows - p0, PIECE_ROWS), 0) * nseg
                dst0 = dbase + Int64(c % ring * CHUNK + p0) * Int64(rb)
                cute.arch.fence_proxy("async.global")  # the slot's readers (acquired above) before these writes
                bulk_ring(n, j0, BG_STAGES, mbar,
                          lambda i, stage: self._bulk_load(i, stage, nseg, rb, base, row0 + p0, mOrder, k, buf, mbar),
                          lambda i, stage: self._bulk_store(i, stage, nseg, rb, dst0, buf))
                j0 += n
                cute.arch.fence_acq_rel_gpu()
                cute.arch.atomic_add(sync.gather.iterator + c, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _bulk_load(self, i: Int32, stage: Int32, nseg: Int32, rb: Int32, base: Int64, grow0: Int32,
                   mOrder: cute.Tensor, k: Int32, buf: Int32, mbar: cute.Pointer):
        """Lane 0 of :meth:`_gather_bg_bulk`: segment ``i`` of the piece (row ``i // nseg`` from grouped row ``grow0``,
        its token row's bytes ``(i % nseg) * BG_SEG ..``) into ``stage``."""
        seg = i % nseg
        nb = cutlass.min(rb - seg * BG_SEG, BG_SEG)
        src = base + Int64(mOrder[grow0 + i // nseg] // k) * Int64(rb) + Int64(seg * BG_SEG)
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + stage, nb)
        bulk_g2s(buf + stage * BG_SEG, src, nb, (mbar + stage).toint())

    @cute.jit
    def _bulk_store(self, i: Int32, stage: Int32, nseg: Int32, rb: Int32, dst0: Int64, buf: Int32):
        """Lane 0 of :meth:`_gather_bg_bulk`: segment ``i`` of the piece from ``stage`` to its ring row (``dst0``: the
        piece's first)."""
        seg = i % nseg
        bulk_s2g(dst0 + Int64(i // nseg) * Int64(rb) + Int64(seg * BG_SEG), buf + stage * BG_SEG,
                 cutlass.min(rb - seg * BG_SEG, BG_SEG))

    @cute.jit
    def _gather_rows(self, tidx: Int32, row0: Int32, rows: Int32, slot_row: Int32, inp: FwdInputs,
                     mOrder: cute.Tensor, k: Int32, ep, gbuf: cute.Tensor):
        """Grouped rows ``row0 .. row0 + rows`` into ring rows ``slot_row ..``, one warp per row
        (``staged``, BF16 at EP = 1: :func:`~mok_cute.kernels.slot_rows.gather_rows_staged` through
        ``gbuf``, the idle A / B stages; otherwise through registers, :meth:`_gather_rows_regs`)."""
        hid = inp.xg.shape[1]
        if cutlass.const_expr(self.staged):
            units = hid // _VEC  # (the operands in the order they were always computed: the PTX stays the same)
            src = slot_rows.TokenRows(mOrder, row0, k, inp.x.iterator.toint(), hid * 2)
            slot_rows.gather_rows_staged(tidx, rows, units, src, inp.xg.iterator.toint(), slot_row, gbuf, NUM_THREADS,
                                         self.gather_cap)
        else:
            self._gather_rows_regs(tidx, row0, rows, slot_row, inp, mOrder, k, ep)

    @cute.jit
    def _gather_rows_regs(self, tidx: Int32, row0: Int32, rows: Int32, slot_row: Int32, inp: FwdInputs,
                          mOrder: cute.Tensor, k: Int32, ep):
        """:meth:`_gather_rows` through registers: the row's source address (a token row of x, or at EP > 1 the
        source rank's staged row, whose router weight lane 0 pulls into ``w_rows``) is resolved once, then the
        lanes move its 16-byte units, :data:`GATHER_UNROLL` loads in flight each. MXFP8 (``mx``): the source rows
        are ``inp.xq`` [T, rb] uint8 (H e4m3 bytes, then H/32 E8M0 scales) and each unit (16 e4m3 values and their
        scale byte) is dequantized to bf16, bitwise the reference's MXFP8 round trip."""
        hid = inp.xg.shape[1]
        warp = tidx // 32
        lane = tidx % 32
        base, rb = self._source(inp.x, inp.xq, hid)
        dbase = inp.xg.iterator.toint()
        for rr in cutlass.range(warp, rows, NUM_THREADS // 32, unroll=1):
            r = row0 + rr
            q = mOrder[r]
            src = base + Int64(q // k) * Int64(rb)
            if cutlass.const_expr(self.ep):
                src = ep.src_row(q, k, rb)
                if lane == 0:
                    ep.pull_w(q, r)
            self._move_row(lane, src, dbase + Int64(slot_row + rr) * Int64(hid * 2), hid, GATHER_UNROLL)

    def _source(self, mX: cute.Tensor, mXq: cute.Tensor, hid: Int32):
        """``(base address, bytes per row)`` of the rows a gather reads: x's bf16 rows of ``hid`` elements, or at
        MXFP8 ``mXq``'s packed rows (traced at the call site)."""
        if self.mx:
            return mXq.iterator.toint(), mXq.shape[1]
        return mX.iterator.toint(), hid * 2

    @cute.jit
    def _move_row(self, lane: Int32, src: Int64, dst: Int64, hid: Int32, unroll: cutlass.Constexpr[int]):
        """One warp: the source row at ``src`` into the bf16 ring row at ``dst`` (:meth:`_mx_row` at MXFP8, else
        16-byte copies), ``unroll`` units in flight per lane."""
        if cutlass.const_expr(self.mx):
            self._mx_row(lane, src, dst, hid, unroll)
        else:
            route_rows.copy_row(lane, src, dst, hid // _VEC, unroll)

    @cute.jit
    def _mx_row(self, lane: Int32, src: Int64, dst: Int64, hid: Int32, unroll: cutlass.Constexpr[int]):
        """One warp: the MXFP8 row at ``src`` (H e4m3 bytes, then H/32 E8M0 scales) dequantized to the bf16 row at
        ``dst``, 16-value chunks ``lane, lane + 32, ...``, ``unroll`` chunks' loads issued before their conversions."""
        nu = hid // 16  # 16-value chunks of an MXFP8 row
        qs = cute.make_rmem_tensor((4, unroll), cutlass.Uint32)
        ss = cute.make_rmem_tensor((unroll,), cutlass.Uint32)
        for c0 in cutlass.range(lane, nu, 32 * unroll, unroll=1):
            for u in cutlass.range_constexpr(unroll):  # every load first
                cu = c0 + u * 32
                if cu < nu:
                    qs[None, u].store(cute.make_tensor(P.gptr(cutlass.Uint32, src + Int64(cu) * 16, 16),
                                                       cute.make_layout((4,))).load())
                    sc = cute.make_tensor(P.gptr(cutlass.Uint8, src + Int64(hid + cu // 2), 1),
                                          cute.make_layout((1,)))
                    ss[u] = cutlass.Uint32(sc[0])
            for u in cutlass.range_constexpr(unroll):
                cu = c0 + u * 32
                if cu < nu:
                    o = cute.make_rmem_tensor((8,), cutlass.Uint32)
                    self.fp8.deq_bf16([qs[j, u] for j in range(4)], [self.fp8.scale_bits(ss[u])] * 16, o)
                    cute.make_tensor(P.gptr(cutlass.Uint32, dst + Int64(cu) * 32, 16),
                                     cute.make_layout((8,))).store(o.load())

    @cute.jit
    def _mark(self, mProg: cute.Tensor, bidx: Int32, word: int, code: int, value: Int32):
        """Progress word ``word`` of this CTA = ``code << 32 | value`` (system-scope store into
        host-mapped memory, readable by the host while the kernel runs; progress variant only)."""
        if cutlass.const_expr(self.progress):
            cute.arch.store(mProg.iterator + (bidx * PROGRESS_WORDS + word), (Int64(code) << 32) + Int64(value),
                            sem="relaxed", scope="sys")

    @cute.jit
    def _produce(self, pipe, smem: _Smem, ticket: cute.Pointer, tma: FwdTmas, routes: FwdRoutes, sync: FwdCounters,
                 scalars: FwdScalars, walk: _Walk):
        """Producer warp: claim tasks from the ticket counter (in list order across the grid), hand
        each to the consumers with its coordinates (:data:`TASK_FIELDS`), wait for its inputs, then TMA
        its k-tiles; a task id >= n_tasks handed off last tells the consumers to stop."""
        cfg = self.cfg
        mProg, bidx, ring, timeout_ns, status = sync.trace, walk.bidx, scalars.ring, scalars.timeout_ns, walk.status
        sA, sB, sTask = smem.a, smem.b, smem.task
        half = cfg.tile_n // 2
        state = self.mainloop.producer_state()
        e1, b1, e2, b2 = Int32(0), Int32(0), Int32(0), Int32(0)
        lead = cute.arch.lane_idx() == 0
        i = Int32(0)
        t = persistent.claim(ticket)
        while t < walk.n_tasks:
            if lead:
                self._mark(mProg, bidx, 0, 1, t)
            phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2 = tasks.task(
                t, walk.shape, routes.offsets, walk.num_experts, walk.tokens, self.cfg.tile_m, scalars.band, e1, b1,
                e2, b2)
            persistent.hand_off(sTask, i, t, (phase, n_tile, row0, rows, mt) + ((expert,) if self.biased else ()))
            i += 1
            if phase == R1:
                persistent.wait_input(sync.gather.iterator + mt, Int32(self.gather_units), timeout_ns, status,
                                      Int32(GATHER), mt)
            if phase == R2:
                persistent.wait_input(sync.h_ready.iterator + mt, walk.shape.n1, timeout_ns, status, Int32(H_READY),
                                      mt)
            if cutlass.const_expr(self.shared):
                if phase == S2:
                    persistent.wait_input(sync.sh_ready.iterator + mt, walk.n1s, timeout_ns, status, Int32(SH_READY),
                                          mt)
            if lead:
                self._mark(mProg, bidx, 0, 2, t)
            if phase == R1:
                gA = cute.local_tile(cute.domain_offset(((mt % ring) * CHUNK, 0), tma.xg.coord),
                                     (cfg.tile_m, cfg.tile_k), (0, None))
                gB = cute.local_tile(tma.wg.coord[(None, None, expert)], (half, cfg.tile_k), (n_tile, None))
                gB_hi = cute.local_tile(tma.wu.coord[(None, None, expert)], (half, cfg.tile_k), (n_tile, None))
                state = self.mainloop.load_tile(pipe, state, tma.xg.atom, gA, sA, tma.wg.atom, gB, sB, walk.k1,
                                                b_hi=StackedB(tma.wu.atom, gB_hi))
            elif phase == R2:
                gA = cute.local_tile(cute.domain_offset((row0, 0), tma.h.coord), (cfg.tile_m, cfg.tile_k), (0, None))
                gB = cute.local_tile(tma.wd.coord[(None, None, expert)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                state = self.mainloop.load_tile(pipe, state, tma.h.atom, gA, sA, tma.wd.atom, gB, sB, walk.k2)
            else:
                if cutlass.const_expr(self.shared):
                    if phase == S1:
                        gA = cute.local_tile(cute.domain_offset((row0, 0), tma.x.coord), (cfg.tile_m, cfg.tile_k),
                                             (0, None))
                        gB = cute.local_tile(tma.sg.coord[(None, None, 0)], (half, cfg.tile_k), (n_tile, None))
                        gB_hi = cute.local_tile(tma.su.coord[(None, None, 0)], (half, cfg.tile_k), (n_tile, None))
                        state = self.mainloop.load_tile(pipe, state, tma.x.atom, gA, sA, tma.sg.atom, gB, sB, walk.k1,
                                                        b_hi=StackedB(tma.su.atom, gB_hi))
                    else:
                        gA = cute.local_tile(cute.domain_offset((row0, 0), tma.hs.coord), (cfg.tile_m, cfg.tile_k),
                                             (0, None))
                        gB = cute.local_tile(tma.sd.coord[(None, None, 0)], (cfg.tile_n, cfg.tile_k), (n_tile, None))
                        state = self.mainloop.load_tile(pipe, state, tma.hs.atom, gA, sA, tma.sd.atom, gB, sB,
                                                        walk.k2s)
            if lead:
                self._mark(mProg, bidx, 0, 3, t)
            t = persistent.claim(ticket)
        persistent.hand_off(sTask, i, t, (Int32(0),) * self.fields)
        if lead:
            self._mark(mProg, bidx, 0, 4, i)
        persistent.finish_hand_offs(i)
        if lead:
            self._mark(mProg, bidx, 0, 5, i)
        pipe.producer_tail(state)
        if lead:
            self._mark(mProg, bidx, 0, 6, i)

    @cute.jit
    def _help(self, hw: Int32, lane: Int32, smem: _Smem, outs: FwdOutputs, sync: FwdCounters, limit: Float32):
        """Helper warp ``hw`` (``helpers``): for each S1 / R1 tile the consumers stage (``STAGED_BARRIER``; the tile
        in ``smem.help``, phase -1: no more), compute and store its h rows (``SwigluEpilogue.help_h``; ``mx``: also
        their round trips into ``h_rt`` / ``hs_rt``, GEMM2's operands); then the helpers
        meet, one fences and publishes the tile, and all arrive on ``FREE_BARRIER`` (the consumers wait there
        before they write ``sC`` again). The helpers never wait for the producer's hand-off."""
        sHelp, sC = smem.help, smem.c
        threads = helper_threads(self.helper_warps)
        cute.arch.barrier(barrier_id=STAGED_BARRIER, number_of_threads=threads)
        phase = sHelp[0]
        while phase >= 0:
            n_tile, row0, rows, mt = sHelp[1], sHelp[2], sHelp[3], sHelp[4]
            if phase == R1:
                self.swiglu.help_h(sC, hw, lane, row0, rows, n_tile, outs.h, limit, self.helper_warps,
                                   outs.h_rt if self.mx else None)
            else:
                if cutlass.const_expr(self.shared):
                    self.swiglu.help_h(sC, hw, lane, row0, rows, n_tile, outs.hs, limit, self.helper_warps,
                                       outs.hs_rt if self.mx else None)
            cute.arch.barrier(barrier_id=HELPERS_BARRIER, number_of_threads=32 * self.helper_warps)
            if hw == 0:
                if lane == 0:
                    P.fence_stores(False)
                    tasks.publish(phase, mt, sync.done, sync.h_ready, sync.sh_ready)
            cute.arch.barrier_arrive(barrier_id=FREE_BARRIER, number_of_threads=threads)
            cute.arch.barrier(barrier_id=STAGED_BARRIER, number_of_threads=threads)
            phase = sHelp[0]

    @cute.jit
    def _consume(self, pipe, smem: _Smem, tid: Int32, outs: FwdOutputs, routes: FwdRoutes, sync: FwdCounters,
                 scalars: FwdScalars, walk: _Walk, ep, trace_base: Int32, bias: TileBias):
        """Consumer warpgroups: MMA each task's tile (handed off decoded: no global load between tiles), run its
        epilogue, publish it (``trace_base``: the task records' first index, past the gather chunks'). EP > 1:
        before the CTA's first routed GEMM2 rows go to their source ranks, every rank must have freed
        its slot buffer of the previous step (FREE >= epoch - 1)."""
        mTrace, bidx, sC, sTask, sHelp = sync.trace, walk.bidx, smem.c, smem.task, smem.help
        thr_mma, tCrA, tCrB, acc = self.mainloop.consumer_fragments(smem.a, smem.b, tid)
        state = self.mainloop.consumer_state()
        freed = Int32(0)
        staged = Int32(0)  # helpers: an S1 / R1 tile is staged in sC and its h not yet read by the helpers
        gemm2 = Int32(0)  # GEMM2 tiles stored, published once after the CTA's last task
        i = Int32(0)
        t, phase, n_tile, row0, rows, mt, expert = self._take(sTask, i)
        while t < walk.n_tasks:
            if tid == 0:
                self._mark(mTrace, bidx, 1, 1, t)
            i += 1
            t0 = persistent.now(self.trace)  # after the hand-off: the gap since the last record is the scheduler's
            r2_rows = Int32(0)  # an R2 tile's routes are loaded before its mainloop (none for other tiles)
            if phase == R2:
                r2_rows = rows
            r2_routes = route_rows.tile_routes(tid, row0, r2_rows, routes.order, self.cfg.tile_m, self.cfg.tile_n)
            tile = _Tile(phase, n_tile, row0, rows, mt, expert)
            bv = Float32(0.0)
            if cutlass.const_expr(self.biased):
                bv = self._bias_load(tile, tid, bias)
            state = self.mainloop.mma_tile(pipe, state, tCrA, tCrB, acc, _k_tiles(phase, walk.k1, walk.k2, walk.k2s))
            if tid == 0:
                self._mark(mTrace, bidx, 1, 2, t)
            if cutlass.const_expr(self.biased):
                if (phase == R1) | (phase == R2):  # (shared-expert tiles have no biases)
                    add_bias(self.mainloop.tiled_mma, thr_mma, acc, self.cfg.tile_m, self.cfg.tile_n, tid, bv,
                             smem.bias)
            # the tile's stores are published by one thread (:meth:`_publish`) after the consumers' barrier; the
            # helpers publish the S1 / R1 tiles
            if cutlass.const_expr(self.helpers):
                if (phase == R1) | (phase == S1):  # the helpers make h and publish the tile
                    staged = self._stage_swiglu(tile, thr_mma, acc, smem, tid, staged, outs)
                else:
                    staged = self._wait_helpers(staged)
                    freed = self._store_staged(tile, thr_mma, acc, sC, tid, scalars.limit, outs, routes.order, ep,
                                               freed, r2_routes)
                    if tid == 0:
                        self._mark(mTrace, bidx, 1, 3, t)
                    consumer_barrier()
                    gemm2 = self._publish(tid, phase, mt, sync, gemm2)
            else:
                freed = self._store_staged(tile, thr_mma, acc, sC, tid, scalars.limit, outs, routes.order, ep, freed,
                                           r2_routes)
                if tid == 0:
                    self._mark(mTrace, bidx, 1, 3, t)
                consumer_barrier()
                gemm2 = self._publish(tid, phase, mt, sync, gemm2)
            if tid == 0:
                if cutlass.const_expr(self.trace):
                    persistent.record(mTrace, trace_base + t, t0, persistent.now(self.trace), phase, bidx, t)
                self._mark(mTrace, bidx, 1, 4, t)
            t, phase, n_tile, row0, rows, mt, expert = self._take(sTask, i)
        if tid == 0:  # every GEMM2 tile's stores came before a consumer barrier that thread 0 passed since
            persistent.publish_count(sync.done.iterator, gemm2, self.ep)
        if cutlass.const_expr(self.helpers):  # the helpers' last FREE arrive, then their stop
            staged = self._wait_helpers(staged)
            if tid == 0:
                sHelp[0] = Int32(-1)
            cute.arch.barrier_arrive(barrier_id=STAGED_BARRIER, number_of_threads=helper_threads(self.helper_warps))
        if tid == 0:
            self._mark(mTrace, bidx, 1, 5, i)

    @cute.jit
    def _take(self, sTask: cute.Tensor, i: Int32):
        """Consumers: hand-off ``i`` as ``(t, phase, n_tile, row0, rows, mt, expert)`` (expert 0 unless ``biased``)."""
        got = persistent.take(sTask, i, self.fields)
        expert = Int32(0)
        if cutlass.const_expr(self.biased):
            expert = got[6]
        return (*got[:6], expert)

    @cute.jit
    def _bias_load(self, tile: _Tile, tid: Int32, bias: TileBias) -> Float32:
        """``biased``, before the tile's mainloop: this consumer thread's bias value (:func:`~mok_cute.kernels.sm90.
        bias.bias_load`) of an R1 tile (b_gate / b_up) or an R2 tile (b_down) of its expert; 0 for a shared-expert
        tile (no biases)."""
        v = Float32(0.0)
        if tile.phase == R1:
            v = bias_load(tid, self.cfg.tile_n, tile.expert, tile.n_tile, bias.gate, bias.up)
        elif tile.phase == R2:
            v = bias_load(tid, self.cfg.tile_n, tile.expert, tile.n_tile, bias.down)
        return v

    @cute.jit
    def _store_staged(self, tile: _Tile, thr_mma, acc: cute.Tensor, sC: cute.Tensor, tid: Int32, limit: Float32,
                      outs: FwdOutputs, mOrder: cute.Tensor, ep, freed: Int32, r2_routes):
        """Consumers: the tile staged in ``sC`` and stored by its epilogue with 16-byte stores (R2: scattered to
        its routes' slot rows, ``r2_routes`` from :func:`~mok_cute.kernels.sm90.route_rows.tile_routes`; EP > 1:
        first waits once for every rank's FREE); returns ``freed``."""
        phase, n_tile, row0, rows = tile.phase, tile.n_tile, tile.row0, tile.rows
        acc_to_smem(thr_mma, acc, sC)
        consumer_barrier()
        et = _opaque(tid)  # the epilogues' shared addresses rebuilt per tile, not held across the loop
        if phase == R1:
            self.swiglu.store(sC, et, row0, rows, n_tile, outs.gu, outs.h, limit, mHrt=outs.h_rt)
        elif phase == R2:
            if cutlass.const_expr(self.ep):
                if freed == 0:
                    if tid == 0:
                        ep.wait_free()
                    consumer_barrier()
                    freed = Int32(1)
            route_rows.scatter(sC, et, row0, rows, n_tile, outs.slot, mOrder, self.cfg.tile_n, ep, self.n_tail,
                               r2_routes)
        else:
            if cutlass.const_expr(self.shared):
                if phase == S1:
                    self.swiglu.store(sC, et, row0, rows, n_tile, outs.gus, outs.hs, limit, mHrt=outs.hs_rt)
                else:
                    self.plain.store(sC, et, row0, rows, n_tile, outs.s_out, outs.s_out, limit)
        return freed

    @cute.jit
    def _publish(self, tid: Int32, phase: Int32, mt: Int32, sync: FwdCounters, gemm2: Int32):
        """Consumers, past the barrier after a tile's 16-byte stores: an S1 / R1 tile (its h waited for by GEMM2
        tiles) thread 0 alone fences (cumulative over every consumer's stores the barrier ordered before it) and
        publishes; a GEMM2 tile (waited for only by the slot sum, all of them) is counted: returns ``gemm2`` + 1,
        published by :meth:`_consume` after the CTA's last task (one fence, EP > 1 at system scope: some rows went to
        peers), so that no fence holds the consumers between GEMM2 tiles."""
        if phase == R1 or phase == S1:
            if tid == 0:
                P.fence_stores(self.ep)
                tasks.publish(phase, mt, sync.done, sync.h_ready, sync.sh_ready)
        else:
            gemm2 += 1
        return gemm2

    @cute.jit
    def _wait_helpers(self, staged: Int32):
        """Consumers (``helpers``), before they write ``sC``: if an S1 / R1 tile is staged there, wait until the
        helpers have read it (``FREE_BARRIER``, which also meets every consumer); returns 0 (nothing staged)."""
        if staged != 0:
            cute.arch.barrier(barrier_id=FREE_BARRIER, number_of_threads=helper_threads(self.helper_warps))
        return Int32(0)

    @cute.jit
    def _stage_swiglu(self, tile: _Tile, thr_mma, acc: cute.Tensor, smem: _Smem, tid: Int32, staged: Int32,
                      outs: FwdOutputs):
        """Consumers (``helpers``), an S1 / R1 tile: stage it once ``sC`` is free, hand it and its coordinates
        (``smem.help``) to the helpers (an arrive on ``STAGED_BARRIER``: the consumers do not wait for them) and
        store its gu rows from ``sC``; returns 1 (staged: the helpers read it)."""
        phase, n_tile, row0, rows, mt, _ = tile
        sC, sHelp = smem.c, smem.help
        self._wait_helpers(staged)
        acc_to_smem(thr_mma, acc, sC)
        if tid == 0:
            sHelp[0] = phase
            sHelp[1] = n_tile
            sHelp[2] = row0
            sHelp[3] = rows
            sHelp[4] = mt
        consumer_barrier()
        cute.arch.barrier_arrive(barrier_id=STAGED_BARRIER, number_of_threads=helper_threads(self.helper_warps))
        et = _opaque(tid)
        if phase == R1:
            cols = outs.h.shape[1] - n_tile * self.swiglu.half if self.n_tail else None
            self.swiglu.store_gu(sC, et, row0, rows, n_tile, outs.gu, cols)
        else:
            if cutlass.const_expr(self.shared):
                cols = outs.hs.shape[1] - n_tile * self.swiglu.half if self.n_tail else None
                self.swiglu.store_gu(sC, et, row0, rows, n_tile, outs.gus, cols)
        return Int32(1)


@cute.jit
def _k_tiles(phase: Int32, k1: Int32, k2: Int32, k2s: Int32):
    """k-tiles of a task of ``phase``: GEMM1 (S1, R1) ``k1``, R2 ``k2``, S2 ``k2s``."""
    k_tiles = k1
    if phase == R2:
        k_tiles = k2
    if phase == S2:
        k_tiles = k2s
    return k_tiles


# ---------------------------------------------------------------- compile and launch
@cute.jit
def record_sum(mTrace: cute.Tensor, grid: Int32, bidx: Int32, t0: Int64, t1: Int64):
    """Thread 0 of a traced fused forward's CTA ``bidx``: its two last records, after the gather
    chunks and the tasks: the wait for every GEMM2 tile (``t0`` .. ``t1``) and the slot sum
    (``t1`` .. now)."""
    base = mTrace.shape[0] // TRACE_WORDS - 2 * grid + 2 * bidx
    persistent.record(mTrace, base, t0, t1, WAIT_KIND, bidx, Int32(0))
    persistent.record(mTrace, base + 1, t1, persistent.now(True), SUM_KIND, bidx, Int32(0))


def compile_fused_forward(clamp: bool, shared: bool, *, gate: bool = False, cfg: MainloopConfig = MainloopConfig(),
                          arch: str = "sm_90a", inspect: bool = False, **switches):
    """Compile one variant with symbolic T, H, I, I_s, E, M_cap (``gate``: the slot sum starts from the shared
    output times the per-token output gate, ``FwdRoutes.gate`` fp32 [T]; ``switches``: :class:`FusedMoeFwdSm90`'s
    keyword switches ``trace``, ``progress``, ``mx``, ``ep``, ``n_tail``, ``helpers``, ``gated``, ``biased``, all off by
    default; ``cfg``: the mainloop's tile_n and stages, :func:`~mok_cute.kernels.sm90.mainloop.launch_config`);
    returns ``(compiled, report)``."""
    if gate and not shared:
        raise ValueError("gate (the shared expert's output gate) needs shared")
    if arch != "sm_90a":
        raise ValueError(f"the SM90 fused forward needs arch sm_90a, got {arch!r}")
    op = FusedMoeFwdSm90(clamp, shared, cfg=cfg, **switches)
    trace, progress, mx, ep, biased = op.trace, op.progress, op.mx, op.ep, op.biased
    bf = cutlass.BFloat16
    t, mcap, tk, e = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    hid, inter, inter_s = (cute.sym_int(divisibility=_VEC) for _ in range(3))

    def vec(dtype, n, align=4):
        return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align)

    # (the fake tensors are made in the kernel's parameter order)
    shared_w = (_fake_3d(bf, cute.sym_int(), inter_s, hid), _fake_3d(bf, cute.sym_int(), inter_s, hid),
                _fake_3d(bf, cute.sym_int(), hid, inter_s)) if shared else (None, None, None)
    shared_out = (_fake_3d(bf, t, cute.sym_int(), inter_s), _fake_2d(bf, t, inter_s)) if shared else (None, None)
    rt_out = (_fake_2d(bf, mcap, inter) if mx else None, _fake_2d(bf, t, inter_s) if mx and shared else None)
    xq = _fake_2d(cutlass.Uint8, t, cute.sym_int(divisibility=16)) if mx else None  # MXFP8 token rows
    inp = FwdInputs(_fake_2d(bf, t, hid), xq, _fake_2d(bf, cute.sym_int(), hid))
    biases = (fake_bias(bf, e, inter), fake_bias(bf, e, inter), fake_bias(bf, e, hid)) if biased else (None,) * 3
    weights = FwdWeights(_fake_3d(bf, e, inter, hid), _fake_3d(bf, e, inter, hid), _fake_3d(bf, e, hid, inter),
                         *shared_w, *biases)
    outs = FwdOutputs(_fake_3d(bf, mcap, cute.sym_int(), inter), _fake_2d(bf, mcap, inter), *shared_out, *rt_out,
                      _fake_2d(bf, tk, hid), _fake_2d(bf, t, hid) if shared else None, _fake_2d(bf, t, hid))
    routes = FwdRoutes(vec(Int32, mcap), vec(Int32, cute.sym_int()), vec(Int32, tk), vec(Float32, tk),
                       vec(Float32, t) if gate else None)
    sync = FwdCounters(*(vec(Int32, cute.sym_int()) for _ in range(5)),
                       vec(Int64, cute.sym_int(), 8) if trace or progress else None)
    peers = _NO_PEERS
    if ep:
        peers = FwdPeers(vec(Int64, cute.sym_int(), 8), vec(Float32, mcap), _fake_2d(bf, tk, hid), *_NO_EP)
    scalars = FwdScalars(Int32(1), Float32(0.0), Int32(1), Int32(1), Int32(1), Int64(1))
    return compile_kernel(op, inp, weights, outs, routes, sync, scalars, peers, Int32(2),
                          cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)


COUNTER_WORDS = 4  # status
EP_SECTIONS = ("src", "slots", "w", "flags")  # the workspace sections the ep variant addresses (kernel order)
_NO_EP = (Int32(0), Int32(1), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0), Int32(0))  # EP = 1 launches
_NO_PEERS = FwdPeers(None, None, None, *_NO_EP)  # the EP = 1 variant's FwdPeers (no tensors, unused scalars)
_last_trace: list = []  # (records int64 [n, 4], comm_ctas) of the last traced launch
_last_progress: list = []  # host-pinned progress words of the last progress-mode launch


def fused_helpers(mx: bool, ep: bool, hidden: int, tile_n: int = HELPERS_TILE_N) -> bool:
    """Whether a forward runs :class:`FusedMoeFwdSm90`'s ``helpers`` variant (S1 / R1 tiles' h by the producer
    warpgroup's warps): at EP = 1 from a GEMM1 depth H of ``grouped_gemm.HELPERS_MIN_K`` (2048) at BF16 and of
    ``grouped_gemm.HELPERS_MX_MIN_K`` (7168) at MXFP8 (docs/design-decisions.md, 2026-12-02/03: BF16 1.6-1.8% faster
    from H 2048; MXFP8 2.0-2.9% faster at H 7168 but 5.1% slower at H 4096), with tile_n
    ``grouped_gemm.HELPERS_TILE_N`` (the helper lanes span its half tile; other tiles run without them)."""
    return not ep and hidden >= (HELPERS_MX_MIN_K if mx else HELPERS_MIN_K) and tile_n == HELPERS_TILE_N


def last_progress():
    """Host-pinned int64 [grid, 4] progress words of the last progress-mode launch (readable
    while it runs: producer / consumers / CTA / slot sum, each ``code << 32 | value``), or None."""
    return _last_progress[0] if _last_progress else None


def last_trace():
    """``(records int64 [n, 4], comm_ctas)`` of the last traced launch (records of tasks that
    did not exist are zero), or None."""
    return _last_trace[0] if _last_trace else None


def _mx_source(x, ws, shared: bool):
    """``(xq, x_s1)`` of the MXFP8 forward: x's MXFP8 token rows (uint8 [T, rb], H e4m3 bytes
    then H/32 E8M0 scales; at EP > 1 the workspace's pull source, after every peer finished the
    previous pull), and what the shared expert's GEMM1 reads (x's round trip; x without one)."""
    from mok_cute.comm.workspace import mxfp8_row_bytes
    from mok_cute.kernels.quant.quantize import quantize_mxfp8_rows_into

    t, hid = x.shape
    rb = mxfp8_row_bytes(hid)
    xq = ws.acquire_src(rb) if ws is not None else torch.empty((t, rb), dtype=torch.uint8, device=x.device)
    rt = torch.empty_like(x) if shared else None  # the round trip in the same pass over x
    return quantize_mxfp8_rows_into(x, xq, rt), rt if shared else x


def counter_sizes(t: int, mcap: int, e: int) -> tuple[int, int, int, int]:
    """Lengths of (gather_ready, h_ready, sh_ready, [done, ticket, gather CTAs, slot-sum CTAs]) for
    T tokens, M_cap rows, E experts (the last two count arrivals at EP > 1)."""
    mtiles = -(-mcap // CHUNK) + e  # routed m-tiles at most
    return mtiles, mtiles, -(-t // CHUNK), 4


def routed_outputs(t: int, k: int, hid: int, mcap: int, inter: int, sizes, ws, device):
    """The fused forwards' routed buffers ``(gu [M_cap, 2, I], h [M_cap, I], slot rows [T*k, H], y [T, H],
    counters)``, bf16 on ``device``: the slot rows are the workspace's at EP > 1 (``ws``); ``counters`` the
    zeroed int32 counters of :func:`counter_sizes`' ``sizes`` and the status words, split (EP > 1: the
    workspace's status last)."""
    bf = dict(dtype=torch.bfloat16, device=device)
    slot = torch.empty((t * k, hid), **bf) if ws is None else ws.view("slots", torch.bfloat16, (t * k, hid))
    counters = torch.zeros(sum(sizes) + COUNTER_WORDS, dtype=torch.int32, device=device)
    parts = list(torch.split(counters, list(sizes) + [COUNTER_WORDS]))
    if ws is not None:
        parts[-1] = ws.status
    return torch.empty((mcap, 2, inter), **bf), torch.empty((mcap, inter), **bf), slot, torch.empty((t, hid), **bf), parts


def _stage_source(x, plan: RoutePlan, ws, mx: bool, shared: bool):
    """``(x, xq, w_rows, slot_copy)`` before a launch: MXFP8: x's token rows quantized (:func:`_mx_source`; x then
    what the shared expert reads); EP > 1: x (or its MXFP8 rows) and topk_w staged in the workspace, this rank's
    router weight per grouped row (zeroed) and the slot sum's copy of the slot rows allocated."""
    xq = w_rows = slot_copy = None
    if mx:
        xq, x = _mx_source(x, ws, shared)
    elif ws is not None:
        src = ws.acquire_src()  # device wait: every peer finished the previous pull from it
        if src.data_ptr() != x.data_ptr():
            src.copy_(x)
        x = src
    if ws is not None:
        t, k = plan.topk_idx.shape
        ws.view("w", torch.float32, (t, k)).copy_(plan.topk_w)
        w_rows = torch.zeros(plan.order.shape[0], dtype=torch.float32, device=x.device)
        slot_copy = torch.empty((t * k, x.shape[1]), dtype=torch.bfloat16, device=x.device)
    return x, xq, w_rows, slot_copy


def _shared_outputs(t: int, hid: int, shared: SharedExpert | None, mx: bool, device):
    """The shared expert's ``(gus [T, 2, I_s], hs [T, I_s], s_out [T, H], hs_rt [T, I_s] at MXFP8)``, bf16; Nones
    without one."""
    if shared is None:
        return None, None, None, None
    bf = dict(dtype=torch.bfloat16, device=device)
    inter_s = shared.w_gate.shape[0]
    return (torch.empty((t, 2, inter_s), **bf), torch.empty((t, inter_s), **bf), torch.empty((t, hid), **bf),
            torch.empty((t, inter_s), **bf) if mx else None)


def _records(trace: bool, progress: bool, sizes, n_tasks: int, num_ctas: int, comm_ctas: int, device):
    """The kernel's record buffer (flat, or None): progress: host-pinned words the kernel writes as it runs (UVA: the
    pinned pointer is device-visible); trace: the gather chunks, then every possible task, then two per CTA."""
    records = None
    if progress:
        records = torch.zeros((num_ctas, PROGRESS_WORDS), dtype=torch.int64, pin_memory=True)
        _last_progress[:] = [records]
    if trace:
        records = torch.zeros((sizes[0] + n_tasks + 2 * num_ctas, TRACE_WORDS), dtype=torch.int64, device=device)
        _last_trace[:] = [(records, comm_ctas)]
    return None if records is None else records.view(-1)


def _max_tasks(sizes, hid: int, inter: int, inter_s: int | None, tile_n: int) -> int:
    """Every task the list can hold (the trace's records): S1 and S2 per shared m-tile, R1 and R2 per routed one
    (GEMM1 n-tiles of ``tile_n / 2`` intermediate columns, GEMM2 n-tiles of ``tile_n`` output columns)."""
    n1s = 0 if inter_s is None else -(-inter_s // (tile_n // 2))
    m_sh, mt, n2 = sizes[2], sizes[1], -(-hid // tile_n)
    return m_sh * (n1s + (n2 if inter_s is not None else 0)) + mt * (-(-inter // (tile_n // 2)) + n2)


def _wrap(bundle):
    """``bundle`` with each torch tensor as a kernel argument (``_Desc``)."""
    return type(bundle)(*(_Desc(a) if isinstance(a, torch.Tensor) else a for a in bundle))


def _launch(launcher: GraphLauncher, dev: int, host: tuple, tail: tuple, key_scalars: tuple | None) -> None:
    """Launch on the current stream with the bundles of torch tensors ``host`` (each tensor wrapped as a kernel
    argument) then ``tail`` (the scalars, the peers' bundle, the grid): at EP = 1 a graph replay keyed by every
    tensor's address, shape and strides and ``key_scalars`` (the tail's Python values: everything the kernel
    receives); with ``key_scalars`` None through the DSL (EP > 1: the epochs change every call)."""
    def args(stream):
        return (*(_wrap(b) for b in host), *tail, stream)
    stream = torch._C._cuda_getCurrentRawStream(dev)
    if key_scalars is None:
        launcher.launch_direct(stream, args)
    else:
        key = tuple(None if a is None else tensor_key(a) for b in host for a in b) + key_scalars
        launcher.launch(dev, stream, key, args)


def fused_forward(x, plan: RoutePlan, experts: ExpertWeights, shared: SharedExpert | None, limit,
                  launch: FusedLaunch, ws=None, biases=None) -> FusedForwardOut:
    """Launch the fused forward on validated operands (see the module doc for shapes): x [T, H] bf16, the routing
    ``plan`` (:class:`~mok_cute.kernels.operands.RoutePlan`, on x's device), the routed ``experts``' weights, the
    ``shared`` expert (None: none; its ``gate``: y starts from fp32(s_out) * gate), the SwiGLU ``limit`` (None: no
    clamp; or a :class:`~mok_cute.reference.SwiGLU`: its limit, alpha and up offset) and the ``launch`` policy
    (:class:`~mok_cute.kernels.operands.FusedLaunch`: comm CTAs, grid, ring slots, timeout, trace, MXFP8, the
    mainloop's tile_n and stages). Returns a
    :class:`~mok_cute.kernels.operands.FusedForwardOut`.

    ``launch.mx``: the MXFP8 forward (the reference's numerics): x is quantized here and its rows move as e4m3
    + E8M0 (:func:`~mok_cute.comm.workspace.mxfp8_row_bytes` per row; at EP > 1 staged in the workspace),
    dequantized into the ring by the gather; the shared expert reads x's round trip; GEMM2 reads h's MXFP8 round
    trip along I, made in the SwiGLU epilogue; the weights come round-tripped from the caller. R1's bands are
    ``min(RING_BAND, ring)``.

    EP > 1 with ``ws`` (this rank's :class:`~mok_cute.comm.workspace.CommWorkspace`): ``plan.order`` and
    ``plan.offsets`` are the device plan's ``recv_src`` (packed ``p*T*k + t*k + j``) and local expert offsets; x
    and topk_w are staged in the workspace (after every peer finished the previous pull), the rows are pulled
    from the peers, the GEMM2 rows pushed into the source ranks' slot buffers (``slot_out``: a copy of this
    rank's slot rows made by the slot sum before it frees the buffer; rows of -1 slots unwritten), peer errors
    go to ``ws.status``, ``w_rows`` [M_cap] fp32 holds each grouped row's router weight (None at EP = 1).
    Launched through the DSL (the epochs change every call); at EP = 1 a cached CUDA-graph replay.

    ``biases``: None, or the routed experts' (b_gate [E, I], b_up [E, I], b_down [E, H]) bf16 with unit last
    strides, added to GEMM1's g, u and GEMM2's rows before their rounding (the reference's numerics)."""
    dev, arch = device_arch(x.device)
    t, hid = x.shape
    k = plan.topk_idx.shape[1]
    mcap, e, inter = plan.order.shape[0], experts.w_gate.shape[0], experts.w_gate.shape[1]
    mx, ep, trace = launch.mx, ws is not None, launch.trace
    gate = None if shared is None else shared.gate
    x, xq, w_rows, slot_copy = _stage_source(x, plan, ws, mx, shared is not None)
    sizes = counter_sizes(t, mcap, e)
    ring = sizes[0] if launch.ring_chunks is None else max(1, min(int(launch.ring_chunks), sizes[0]))
    band = min(RING_BAND if launch.band is None else launch.band, ring)
    xg = torch.empty((ring * CHUNK, hid), dtype=torch.bfloat16, device=x.device)
    gu, h, slot, y, parts = routed_outputs(t, k, hid, mcap, inter, sizes, ws, x.device)
    gus, hs, s_out, hs_rt = _shared_outputs(t, hid, shared, mx, x.device)
    h_rt = torch.empty((mcap, inter), dtype=torch.bfloat16, device=x.device) if mx else None
    inter_s = None if shared is None else shared.w_gate.shape[0]
    progress = env.progress() and not trace  # debugging a stall: process infrastructure, not a kernel choice
    cfg = launch_config(launch.tile_n, launch.stages)
    tn = cfg.tile_n
    n_tail = hid % tn != 0 or any(i % (tn // 2) for i in (inter, *(() if inter_s is None else (inter_s,))))
    helpers = fused_helpers(mx, ep, hid, tn)
    clamp, gated, lim = swiglu_args(limit)
    variant = (clamp, shared is not None, trace, progress, mx, ep, gate is not None, gated, n_tail, helpers)
    biased = biases is not None
    launcher = compile_cached(("sm90_fused_moe_fwd", arch) + variant + (cfg.key(),) + (("biased",) if biased else ()),
                              lambda: GraphLauncher(compile_fused_forward(
                                  variant[0], variant[1], trace=trace, progress=progress, mx=mx, ep=ep,
                                  gate=gate is not None, n_tail=n_tail, helpers=helpers, cfg=cfg, gated=gated,
                                  biased=biased, arch=arch)[0]))
    num_ctas = sm_count(dev) if launch.num_ctas is None else launch.num_ctas
    # chunk c is CTA c % comm_ctas's: that CTA must exist, and a gather waiting for its ring
    # slot needs a GEMM CTA to free it
    comm_ctas = max(1, min(launch.comm_ctas, num_ctas - 1))
    records = _records(trace, progress, sizes, _max_tasks(sizes, hid, inter, inter_s, tn) if trace else 0, num_ctas,
                       comm_ctas, x.device)
    shared_w = (None,) * 3 if shared is None else tuple(w[None] for w in shared.weights)
    host = (FwdInputs(x, xq, xg), FwdWeights(*experts, *shared_w, *(biases if biased else (None,) * 3)),
            FwdOutputs(gu, h, gus, hs, h_rt, hs_rt, slot, s_out, y),
            FwdRoutes(plan.order, plan.offsets, plan.topk_idx.reshape(-1), plan.topk_w.reshape(-1), gate),
            FwdCounters(*parts, records))
    timeout_ns = int(launch.timeout_s * 1e9)
    scalars = FwdScalars(Int32(k), Float32(lim), Int32(comm_ctas), Int32(ring), Int32(band), Int64(timeout_ns))
    if ws is None:
        _launch(launcher, dev, host, (scalars, _NO_PEERS, Int32(num_ctas)),
                (k, lim, comm_ctas, num_ctas, ring, band, timeout_ns))
    else:
        peers = FwdPeers(*ws.kernel_args((w_rows, slot_copy), EP_SECTIONS))  # the launch's new epochs
        _launch(launcher, dev, host, (scalars, peers, Int32(num_ctas)), None)
    return FusedForwardOut(y, gu.view(mcap, 2 * inter), h, slot if ws is None else slot_copy,
                           None if gus is None else gus.view(t, -1), hs, s_out, parts, w_rows)


# ---------------------------------------------------------------- error status
_WAITS = {GATHER: "gather chunk", H_READY: "h m-tile", SH_READY: "shared h m-tile", DONE: "GEMM2 tiles",
          RING: "ring slot of m-tile"}
describe = persistent.describer("fused forward", _WAITS)  # the status words, read by the host later


def watch_status(status: torch.Tensor, first: bool = True) -> None:
    """Raise RuntimeError for an error an earlier finished launch recorded (unless ``first`` is
    False: a layer call that watched something already), then queue this launch's ``status``
    (:func:`mok_cute.dsl.deferred.watch`; no host sync)."""
    deferred.watch(status, describe, first)


def check_errors() -> None:
    """Wait for every queued launch and raise RuntimeError for the first recorded error."""
    deferred.check()

"""Task list of the fused MoE forward (device functions and their pure-Python mirror).

The CTAs of the fused forward claim the tasks of one static list from a device ticket
counter, in list order (the comm CTAs once their gather chunks are stored), in four phases:

  S1  shared GEMM1 + SwiGLU   ``m_sh * n1s`` tiles   (m_sh = ceil(T / tile_m), n1s = I_s / (tile_n/2))
  R1  routed GEMM1 + SwiGLU   ``mt * n1`` tiles      (mt = sum_e ceil(rows_e / tile_m), n1 = I / (tile_n/2))
  S2  shared GEMM2            ``m_sh * n2`` tiles    (n2 = H / tile_n)
  R2  routed GEMM2            ``mt * n2`` tiles

Inside a phase the tiles are numbered m-tile fastest (routed phases: experts in order, the
walk of :mod:`mok_cute.schedule.group_tiles`), except that R1 walks each expert's m-tiles in
*bands* of ``band`` m-tiles: a band's tiles (n-tile outer, m-tile inner) all come before the
next band's. ``mt`` numbers the routed m-tiles in expert order (an m-tile's readiness counter).

The ring: the gathered rows live in ``ring`` chunk slots of ``tile_m`` rows; routed m-tile
``mt`` is gather chunk ``mt`` and goes to slot ``mt % ring``, so the gather of chunk ``c >= ring``
first waits until every GEMM1 n-tile of m-tile ``c - ring`` has read the slot. With ``ring >=
band`` that m-tile's band lies wholly before chunk c's band in the list, so the wait points
backwards. Dependencies point backwards only: an R1 tile needs its gather chunk; an S2 / R2
tile needs every GEMM1 n-tile of its m-tile; the slot sum needs every GEMM2 tile. With all
CTAs resident and tickets handed out in list order, the lowest unfinished task's inputs are
always finished or being made and it is held by a running CTA, so the list cannot deadlock
(:func:`simulate` checks it on concrete routings under random interleavings, ring included).
This module imports no GEMM code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from mok_cute.dsl.status import wait_geq
from mok_cute.schedule.group_tiles import expert_mtile_count, mtiles, seek, tile_coords
from mok_cute.schedule.tickets import run_tickets, strided

S1, R1, S2, R2 = range(4)
PHASES = ("S1", "R1", "S2", "R2")
PIECE_ROWS = 32  # rows of a chunk's piece in the background gather (gather="bg"): what gather_ready counts there
PIECES = 128 // PIECE_ROWS  # pieces per chunk of tile_m = 128 rows


# ---------------------------------------------------------------- pure-Python mirror
def task_list(offsets, tokens: int, tile_m: int, n1: int, n1s: int, n2: int, shared: bool,
              band: int | None = None) -> list[tuple]:
    """Every task in list order: ``(phase, expert, n_tile, row0, rows, mt)`` (shared phases:
    expert -1, ``mt`` = the token m-tile; routed: ``mt`` = the routed m-tile index); R1 in bands
    of ``band`` m-tiles per expert (None: one band per expert)."""
    offs = [int(o) for o in offsets]
    m_sh = mtiles(0, tokens, tile_m)
    routed = []  # (expert, m_tile, row0, rows, mt) in expert order
    for e in range(len(offs) - 1):
        for m in range(mtiles(offs[e], offs[e + 1], tile_m)):
            row0 = offs[e] + m * tile_m
            routed.append((e, row0, min(tile_m, offs[e + 1] - row0), len(routed)))
    out = []
    for phase, n in ((S1, n1s if shared else 0), (R1, n1), (S2, n2 if shared else 0), (R2, n2)):
        if phase in (S1, S2):
            out += [(phase, -1, nt, m * tile_m, min(tile_m, tokens - m * tile_m), m)
                    for nt in range(n) for m in range(m_sh)]
        else:  # per expert (R1: per band of its m-tiles): m-tiles fastest, then n-tiles
            by_expert: dict[int, list] = {}
            for r in routed:
                by_expert.setdefault(r[0], []).append(r)
            for e in sorted(by_expert):
                mts = by_expert[e]
                width = len(mts) if phase == R2 or band is None else band
                for b in range(0, len(mts), width):
                    out += [(phase, e, nt, row0, rows, mt) for nt in range(n) for (_, row0, rows, mt) in mts[b:b + width]]
    return out


def mtile_rows(offsets, tile_m: int) -> list[tuple[int, int]]:
    """``(row0, rows)`` of every routed m-tile (= gather chunk) in ``mt`` order."""
    offs = [int(o) for o in offsets]
    return [(offs[e] + m * tile_m, min(tile_m, offs[e + 1] - offs[e] - m * tile_m))
            for e in range(len(offs) - 1) for m in range(mtiles(offs[e], offs[e + 1], tile_m))]


def needs(task: tuple, n1: int, n1s: int, units: int = 1) -> list[tuple[str, int, int]]:
    """What a task waits for: ``(counter, index, target)`` with counters ``gather`` (chunk: ``units``
    publications, :data:`PIECES` with the background gather), ``h`` (routed m-tile: n1 GEMM1 tiles),
    ``sh`` (shared m-tile: n1s tiles)."""
    phase, mt = task[0], task[5]
    if phase == R1:
        return [("gather", mt, units)]
    if phase == R2:
        return [("h", mt, n1)]
    if phase == S2:
        return [("sh", mt, n1s)]
    return []


def publishes(task: tuple) -> tuple[str, int]:
    """The counter a finished task bumps by one: ``(counter, index)`` (the sm90 kernel adds a CTA's GEMM2 tiles to
    ``done`` at once after its last task: only the slot sum, after every task, waits for ``done``)."""
    phase, _, _, _, _, mt = task
    return {S1: ("sh", mt), R1: ("h", mt), S2: ("done", 0), R2: ("done", 0)}[phase]


@dataclass(frozen=True)
class Gather:
    """How the fused forward's routed rows reach GEMM1, as :func:`simulate` runs it: ``mode``
    ``"comm"`` (the comm CTAs gather every chunk into the ring), ``"bg"`` (the comm CTAs gather the
    ring's first fill, background warps the later chunks in :data:`PIECES` pieces) or ``"direct"``
    (no ring, no gather: the producer warpgroup reads x's rows); ``ring`` chunk slots (None: every
    chunk has its own slot); ``band`` m-tiles per R1 band (None: one band per expert)."""

    mode: str = "comm"
    ring: int | None = None
    band: int | None = None

    def __post_init__(self):
        if self.mode not in ("comm", "bg", "direct"):
            raise ValueError(f"gather mode must be 'comm', 'bg' or 'direct', got {self.mode!r}")


def simulate(offsets, tokens: int, tile_m: int, n1: int, n1s: int, n2: int, shared: bool, gemm_ctas: int,
             comm_ctas: int, seed: int = 0, gather: Gather = Gather()) -> int:
    """Run the fused forward's schedule on the host as the kernel runs it
    (:func:`~mok_cute.schedule.tickets.run_tickets`): comm CTA ``c`` gathers chunks ``c, c +
    comm_ctas, ...`` in order (chunk ``i >= ring`` once m-tile ``i - ring`` has all its GEMM1
    tiles), then joins the GEMM CTAs in claiming the list's tickets. ``gather.mode == "bg"``: the
    comm CTAs gather only the ring's first fill (chunks < ring); the later chunks go in
    :data:`PIECES` pieces, piece q to the background warps of CTA ``q % (comm_ctas + gemm_ctas)``
    (each piece once its slot is free), and an R1 tile waits for all of its chunk's pieces.
    ``"direct"``: every CTA claims tickets from the start and an R1 tile waits for nothing. Returns
    the number of rounds; AssertionError on a deadlock or a missing publication."""
    ring, band = gather.ring, gather.band
    tasks = task_list(offsets, tokens, tile_m, n1, n1s, n2, shared, band)
    if gather.mode == "direct":
        wants = lambda t: [] if t[0] == R1 else needs(t, n1, n1s)  # noqa: E731
        rounds, count = run_tickets(tasks, wants, publishes, [], comm_ctas + gemm_ctas, seed)
        assert count.get(("done", 0), 0) == sum(t[0] in (S2, R2) for t in tasks), "slot sum would wait forever"
        return rounds
    chunks = len(mtile_rows(offsets, tile_m))
    ring = chunks if ring is None else ring
    slot_free = lambda c: [("h", c - ring, n1)] if c >= ring else []  # noqa: E731
    units, background = 1, []
    fill = chunks
    if gather.mode == "bg":
        units, fill = PIECES, min(ring, chunks)
        pieces = [(slot_free(c), ("gather", c)) for c in range(fill, chunks) for _ in range(PIECES)]
        background = strided(pieces, comm_ctas + gemm_ctas)
    gathers = [(slot_free(c), ("gather", c)) for c in range(fill) for _ in range(units)]
    rounds, count = run_tickets(tasks, lambda t: needs(t, n1, n1s, units), publishes,
                                strided_chunks(gathers, comm_ctas, units), gemm_ctas, seed, background)
    gemm2 = sum(t[0] in (S2, R2) for t in tasks)
    assert count.get(("done", 0), 0) == gemm2, "slot sum would wait forever"
    return rounds


def strided_chunks(jobs: list, ctas: int, units: int) -> list[list]:
    """:func:`~mok_cute.schedule.tickets.strided` over chunks of ``units`` consecutive jobs (a comm CTA's
    gathered chunk publishes all its units at once)."""
    chunked = [jobs[i:i + units] for i in range(0, len(jobs), units)]
    return [[j for chunk in chunked[c::ctas] for j in chunk] for c in range(ctas)]


def simulate_ep(topk_idx_per_rank, num_experts: int, tile_m: int, n1: int, n1s: int, n2: int, shared: bool,
                gemm_ctas: int, comm_ctas: int, gather: Gather = Gather()) -> list[int]:
    """The fused forward at EP > 1 on the host: every rank's task list over its receive rows (the
    routing plan of :func:`mok_cute.schedule.plan.plan_routing`) must complete (:func:`simulate`;
    a rank's GEMM tasks wait only for its own gather and tiles: READY is signalled at launch and
    FREE by the previous step), and every valid route (p, t, j) of every source rank must get each
    of its ``n2`` GEMM2 column tiles pushed exactly once (the slot sum's DATA wait then counts
    every rank's pushes). Returns the rounds per rank; AssertionError otherwise."""
    def rank(offs, tokens):
        rounds = simulate(offs, tokens, tile_m, n1, n1s, n2, shared, gemm_ctas, comm_ctas, gather=gather)
        return rounds, [(row0, rows, n_tile) for phase, _, n_tile, row0, rows, _ in
                        task_list(offs, tokens, tile_m, n1, n1s, n2, shared) if phase == R2]
    return check_ep_pushes(topk_idx_per_rank, num_experts, n2, rank, "GEMM2")


def check_ep_pushes(topk_idx_per_rank, num_experts: int, n_cols: int, rank, what: str) -> list[int]:
    """Shared by the forward's and the backward's EP mirrors: plan the routing
    (:func:`mok_cute.schedule.plan.plan_routing`), run ``rank(offsets, tokens) -> (rounds, pushes)``
    per rank (``pushes``: ``(row0, rows, n_tile)`` of every task that pushes grouped rows to their
    source ranks) and assert that every valid route gets each of its ``n_cols`` column tiles
    pushed exactly once. Returns the rounds per rank."""
    from mok_cute.schedule.plan import plan_routing

    ep = len(topk_idx_per_rank)
    tokens = topk_idx_per_rank[0].shape[0]
    plan = plan_routing(list(topk_idx_per_rank), num_experts, ep)
    pushed: dict[tuple[int, int], int] = {}
    rounds = []
    for r in range(ep):
        recv = plan.recv_src[r].tolist()
        n_rounds, pushes = rank([int(o) for o in plan.offsets[r]], tokens)
        rounds.append(n_rounds)
        for row0, rows, n_tile in pushes:
            for row in range(row0, row0 + rows):
                pushed[(recv[row], n_tile)] = pushed.get((recv[row], n_tile), 0) + 1
    n = topk_idx_per_rank[0].numel()
    want = {(p * n + i, nt): 1 for p, idx in enumerate(topk_idx_per_rank)
            for i, e in enumerate(idx.reshape(-1).tolist()) if e >= 0 for nt in range(n_cols)}
    assert pushed == want, f"a route's {what} row is pushed other than exactly once per column tile"
    return rounds


# ---------------------------------------------------------------- device functions
class RingWait(NamedTuple):
    """What a gather chunk waits on before it rewrites its ring slot: ``h_ready`` int32 [routed
    m-tiles] (GEMM1 n-tiles finished per m-tile), the wait's bound ``timeout_ns`` (Int64), the
    error ``status`` (int32[4] pointer) and the ``channel`` (Int32) a timeout is recorded under."""

    h_ready: cute.Tensor
    timeout_ns: Int64
    status: cute.Pointer
    channel: Int32


class ListShape(NamedTuple):
    """The task list's phase sizes (Int32): tasks ``n_s1`` (S1), ``n_r1`` (R1), ``n_s2`` (S2),
    ``m_sh`` shared m-tiles, ``n1`` GEMM1 and ``n2`` GEMM2 n-tiles."""

    n_s1: Int32
    n_r1: Int32
    n_s2: Int32
    m_sh: Int32
    n1: Int32
    n2: Int32


@cute.jit
def chunk_start(tidx: Int32, c: Int32, ring: Int32, n1: Int32, offsets: cute.Tensor, num_experts: Int32,
                tile_m: cutlass.Constexpr[int], expert: Int32, base: Int32, wait: RingWait,
                barrier_id: cutlass.Constexpr[int] = 0, threads: cutlass.Constexpr[int] = 0):
    """The start of gather chunk ``c`` (or of a piece of it): ``(row0, rows, expert, base)``
    (:func:`mtile`); chunk ``c >= ring`` first waits (thread ``tidx`` 0, bounded, status
    ``wait.channel``; then the CTA, or with ``barrier_id`` the ``threads`` of that named barrier) until
    every GEMM1 n-tile of m-tile ``c - ring`` has read its ring slot (``wait.h_ready >= n1``)."""
    row0, rows, e, b = mtile(offsets, num_experts, tile_m, c, expert, base)
    if c >= ring:
        if tidx == 0:
            wait_geq(wait.h_ready.iterator + (c - ring), n1, wait.timeout_ns, wait.status, c - ring, wait.channel)
        if cutlass.const_expr(barrier_id == 0):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    return row0, rows, e, b


@cute.jit
def routed_mtiles(offsets: cute.Tensor, num_experts: Int32, tile_m: cutlass.Constexpr[int]):
    """m-tiles of all routed experts, ``sum_e ceil(rows_e / tile_m)`` (one pass over offsets)."""
    total = Int32(0)
    for e in cutlass.range(num_experts, unroll=1):
        total += expert_mtile_count(offsets, e, tile_m)
    return total


@cute.jit
def mtile(offsets: cute.Tensor, num_experts: Int32, tile_m: cutlass.Constexpr[int], c: Int32, expert: Int32,
          base: Int32):
    """``(row0, rows, expert, base)`` of routed m-tile ``c`` (gather chunk ``c``); the cursor
    ``(expert, base)`` (m-tiles before ``expert``) only moves forward, as in
    :func:`~mok_cute.schedule.group_tiles.seek` with one tile per m-tile."""
    e, b = seek(offsets, num_experts, tile_m, Int32(1), c, expert, base)
    row0 = offsets[e] + (c - b) * tile_m
    return row0, cutlass.min(offsets[e + 1] - row0, tile_m), e, b


@cute.jit
def banded_coords(offsets: cute.Tensor, tile_m: cutlass.Constexpr[int], linear: Int32, expert: Int32, base: Int32,
                  n_tiles: Int32, band: Int32):
    """``(m_tile, n_tile, row0, rows)`` of ``linear`` inside ``expert`` when its m-tiles run in
    bands of ``band`` (a band's n-tiles outer, its m-tiles inner; ``band`` >= the expert's m-tiles
    is :func:`~mok_cute.schedule.group_tiles.tile_coords`)."""
    lo = offsets[expert]
    hi = offsets[expert + 1]
    m_tiles = mtiles(lo, hi, tile_m)
    local = linear - base
    b = local // (band * n_tiles)
    within = local - b * band * n_tiles
    width = cutlass.min(band, m_tiles - b * band)
    m_tile = b * band + within % width
    row0 = lo + m_tile * tile_m
    return m_tile, within // width, row0, cutlass.min(hi - row0, tile_m)


@cute.jit
def task(t: Int32, shape: ListShape, offsets: cute.Tensor, num_experts: Int32, tokens: Int32,
         tile_m: cutlass.Constexpr[int], band: Int32, e1: Int32, b1: Int32, e2: Int32, b2: Int32):
    """``(phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2)`` of task ``t`` (the list's
    ``shape``; R1 in bands of ``band`` m-tiles). The routed phases advance their own cursor
    ``(e, b)`` of :func:`~mok_cute.schedule.group_tiles.seek` (a CTA's tasks only grow)."""
    n_s1, n_r1, n_s2, m_sh, n1, n2 = shape
    phase = Int32(R2)
    expert = Int32(0)
    n_tile = Int32(0)
    row0 = Int32(0)
    rows = Int32(0)
    mt = Int32(0)
    if t < n_s1:
        phase = Int32(S1)
        mt = t % m_sh
        n_tile = t // m_sh
    elif t < n_s1 + n_r1:
        phase = Int32(R1)
        lin = t - n_s1
        e1, b1 = seek(offsets, num_experts, tile_m, n1, lin, e1, b1)
        expert = e1
        m_tile, n_tile, row0, rows = banded_coords(offsets, tile_m, lin, e1, b1, n1, band)
        mt = b1 // n1 + m_tile
    elif t < n_s1 + n_r1 + n_s2:
        phase = Int32(S2)
        lin = t - n_s1 - n_r1
        mt = lin % m_sh
        n_tile = lin // m_sh
    else:
        lin = t - n_s1 - n_r1 - n_s2
        e2, b2 = seek(offsets, num_experts, tile_m, n2, lin, e2, b2)
        expert = e2
        m_tile, n_tile, row0, rows = tile_coords(offsets, tile_m, lin, e2, b2)
        mt = b2 // n2 + m_tile
    if phase == S1 or phase == S2:
        row0 = mt * tile_m
        rows = cutlass.min(tokens - row0, tile_m)
    return phase, expert, n_tile, row0, rows, mt, e1, b1, e2, b2


@cute.jit
def publish(phase: Int32, mt: Int32, mDone: cute.Tensor, mHready: cute.Tensor, mShready: cute.Tensor):
    """One thread, after a finished task's stores are fenced: bump the counter it publishes
    (:func:`publishes`: ``sh_ready[mt]`` after S1, ``h_ready[mt]`` after R1, ``done`` after S2 /
    R2) by one, a release add at GPU scope."""
    counter = mDone.iterator
    if phase == R1:
        counter = mHready.iterator + mt
    if phase == S1:
        counter = mShready.iterator + mt
    cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")

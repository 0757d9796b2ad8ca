"""Task list of the fused MoE backward (issue 13): the schedule the backward megakernel runs,
checked for completeness and deadlock freedom on the host (:func:`simulate`, :func:`simulate_ep`),
and the device decoding of one group's GEMM phases (:func:`core_task`, mirror
:func:`core_task_list`): ``kernels/sm90/fused_bwd.py`` runs the routed experts and the shared
expert as two such groups, interleaved in :func:`task_list`'s phase order.

Work, per rank, with the forward's tile walk (routed m-tile ``mt``: <= ``tile_m`` grouped rows of
one expert, numbered in expert order; shared m-tile ``m``: ``tile_m`` tokens):

  comm CTAs  dy chunk ``mt``: grouped dy rows times their router weights and d topk_w (EP > 1:
             pulled from the source ranks), then x chunk ``mt`` (the forward kept no x rows)
  SD2  shared dgrad2 + dSwiGLU   ``m_sh * n_is`` tiles   needs nothing (dy is local)
  D2   routed dgrad2 + dSwiGLU   ``mt * n_i`` tiles      needs dy chunk ``mt``
  SD1  shared dgrad1 -> dx_s     ``m_sh * n_h`` tiles    needs every SD2 tile of its m-tile
  D1   routed dgrad1 -> dx rows  ``mt * n_h`` tiles      needs every D2 tile of its m-tile; rows go
                                                         to their (token, slot) (EP > 1: pushed)
  SW   shared weight gradients   ``w_d + 2 w_gu`` tiles  dWs_down: nothing; dWs_gate/up: every SD2
  W    routed weight gradients   per expert, the same    dWd_e: e's dy chunks; dWg_e / dWu_e:
                                                         e's D2 tiles and x chunks
  then every CTA: the fixed-order slot sum of dx (all D1 and SD1 tiles in; EP > 1: every rank's
  pushes), as in the forward.

A weight-gradient tile reduces over its expert's rows in row order inside one CTA (no atomics),
so dW is bitwise the same whoever runs it; an expert without rows still owns its tiles (zeros).
Every wait points backwards in the list or at a comm job, so with all CTAs resident the list
cannot deadlock. This module imports no GEMM code.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from mok_cute.schedule.fused_tasks import check_ep_pushes, mtile_rows
from mok_cute.schedule.group_tiles import expert_mtile_count, mtiles, seek, tile_coords, warp_sum
from mok_cute.schedule.tickets import run_tickets, strided

SD2, D2, SD1, D1, SW, W = range(6)
PHASES = ("SD2", "D2", "SD1", "D1", "SW", "W")
WD, WG, WU = range(3)  # which weight gradient a SW / W tile belongs to


def expert_mtiles(offsets, tile_m: int) -> list[list[int]]:
    """The routed m-tile indices ``mt`` of each expert."""
    offs = [int(o) for o in offsets]
    out, mt = [], 0
    for e in range(len(offs) - 1):
        n = mtiles(offs[e], offs[e + 1], tile_m)
        out.append(list(range(mt, mt + n)))
        mt += n
    return out


def task_list(offsets, tokens: int, tile_m: int, n_i: int, n_is: int, n_h: int, w_d: int, w_gu: int,
              shared: bool) -> list[tuple]:
    """Every task in list order: ``(phase, expert, tile, mt, which)`` (``tile``: the n-tile, or the
    weight-gradient tile; ``mt``: the routed or shared m-tile, -1 for weight tiles; ``which``:
    WD / WG / WU for weight tiles, else -1). ``w_d`` / ``w_gu``: tiles of one dW_down / one dW_gate
    (= dW_up) per expert (the shared expert's counts when ``shared``: the same formula at I_s)."""
    m_sh = mtiles(0, tokens, tile_m)
    per_e = expert_mtiles(offsets, tile_m)
    out = []
    if shared:
        out += [(SD2, -1, n, m, -1) for n in range(n_is) for m in range(m_sh)]
    out += [(D2, e, n, mt, -1) for e, mts in enumerate(per_e) for n in range(n_i) for mt in mts]
    if shared:
        out += [(SD1, -1, n, m, -1) for n in range(n_h) for m in range(m_sh)]
    out += [(D1, e, n, mt, -1) for e, mts in enumerate(per_e) for n in range(n_h) for mt in mts]
    weights = ((WD, w_d), (WG, w_gu), (WU, w_gu))
    if shared:
        out += [(SW, -1, i, -1, which) for which, n in weights for i in range(n)]
    out += [(W, e, i, -1, which) for e in range(len(per_e)) for which, n in weights for i in range(n)]
    return out


def needs(task: tuple, per_e: list[list[int]], m_sh: int, n_i: int, n_is: int) -> list[tuple[str, int, int]]:
    """What a task waits for: ``(counter, index, target)`` over ``gdy`` / ``gx`` (comm chunks),
    ``d2`` / ``sd2`` (dgrad2 tiles per m-tile)."""
    phase, e, _, mt, which = task
    if phase == D2:
        return [("gdy", mt, 1)]
    if phase == SD1:
        return [("sd2", mt, n_is)]
    if phase == D1:
        return [("d2", mt, n_i)]
    if phase == SW:
        return [] if which == WD else [("sd2", m, n_is) for m in range(m_sh)]
    if phase == W:
        if which == WD:
            return [("gdy", m, 1) for m in per_e[e]]
        return [("d2", m, n_i) for m in per_e[e]] + [("gx", m, 1) for m in per_e[e]]
    return []


def publishes(task: tuple) -> tuple[str, int]:
    """The counter a finished task bumps by one."""
    phase, _, _, mt, _ = task
    return {SD2: ("sd2", mt), D2: ("d2", mt), SD1: ("dx", 0), D1: ("dx", 0), SW: ("w", 0), W: ("w", 0)}[phase]


def simulate(offsets, tokens: int, tile_m: int, n_i: int, n_is: int, n_h: int, w_d: int, w_gu: int, shared: bool,
             gemm_ctas: int, comm_ctas: int, seed: int = 0) -> int:
    """Run the backward's list (:func:`~mok_cute.schedule.tickets.run_tickets`; the comm CTAs move
    every dy chunk, then every x chunk, dealt round-robin): it must finish, every dx tile must be
    in before the slot sum and every weight tile done. Returns the rounds."""
    tasks = task_list(offsets, tokens, tile_m, n_i, n_is, n_h, w_d, w_gu, shared)
    per_e = expert_mtiles(offsets, tile_m)
    chunks = len(mtile_rows(offsets, tile_m))
    m_sh = mtiles(0, tokens, tile_m)
    jobs = [([], ("gdy", c)) for c in range(chunks)] + [([], ("gx", c)) for c in range(chunks)]
    rounds, count = run_tickets(tasks, lambda t: needs(t, per_e, m_sh, n_i, n_is), publishes,
                                strided(jobs, comm_ctas), gemm_ctas, seed)
    assert count.get(("dx", 0), 0) == sum(t[0] in (SD1, D1) for t in tasks), "the dx slot sum would wait forever"
    assert count.get(("w", 0), 0) == sum(t[0] in (SW, W) for t in tasks), "a weight-gradient tile never ran"
    return rounds


def simulate_ep(topk_idx_per_rank, num_experts: int, tile_m: int, n_i: int, n_is: int, n_h: int, w_d: int,
                w_gu: int, shared: bool, gemm_ctas: int, comm_ctas: int) -> list[int]:
    """The backward at EP > 1: every rank's list over its receive rows completes, and every valid
    route (p, t, j) gets each of its ``n_h`` dgrad1 column tiles pushed to its source rank exactly
    once (:func:`~mok_cute.schedule.fused_tasks.check_ep_pushes`; the dx slot sum then counts every
    rank's pushes). Returns the rounds per rank."""
    def rank(offs, tokens):
        rows = mtile_rows(offs, tile_m)
        rounds = simulate(offs, tokens, tile_m, n_i, n_is, n_h, w_d, w_gu, shared, gemm_ctas, comm_ctas)
        return rounds, [(*rows[mt], n_tile) for phase, _, n_tile, mt, _ in
                        task_list(offs, tokens, tile_m, n_i, n_is, n_h, w_d, w_gu, shared) if phase == D1]
    return check_ep_pushes(topk_idx_per_rank, num_experts, n_h, rank, "dx")


# ---------------------------------------------------------------- the routed core on the device
def core_task_list(offsets, tile_m: int, n_i: int, n_h: int, wd_tiles: tuple[int, int],
                   wgu_tiles: tuple[int, int], wd_first: bool = False) -> list[tuple]:
    """The routed core of :func:`task_list` (no shared expert) with each weight tile's
    coordinates: ``(phase, expert, n_tile, m_tile, mt, which)``; D2 / D1: ``m_tile`` is the
    m-tile inside the expert and ``mt`` the routed m-tile; W: ``(m_tile, n_tile)`` of the dW
    output tile, m fastest (``wd_tiles`` / ``wgu_tiles``: (m-tiles, n-tiles) of one dW_down /
    one dW_gate), ``mt`` -1. The order is :func:`task_list`'s; ``wd_first``: every dW_down tile
    first (experts in order), then the rest in that order (on the device: :func:`wd_first_id`)."""
    out = []
    for phase, expert, tile, mt, which in task_list(offsets, 0, tile_m, n_i, 0, n_h, wd_tiles[0] * wd_tiles[1],
                                                    wgu_tiles[0] * wgu_tiles[1], False):
        if phase == W:
            m_tiles = (wd_tiles if which == WD else wgu_tiles)[0]
            out.append((W, expert, tile // m_tiles, tile % m_tiles, -1, which))
        else:
            first = expert_mtiles(offsets, tile_m)[expert][0]
            out.append((phase, expert, tile, mt - first, mt, -1))
    if wd_first:
        is_wd = [t[0] == W and t[5] == WD for t in out]
        out = [t for t, wd in zip(out, is_wd) if wd] + [t for t, wd in zip(out, is_wd) if not wd]
    return out


@cute.jit
def wd_first_id(t: Int32, n_d: Int32, num_experts: Int32, wd: Int32, wgu: Int32):
    """The default-order :func:`core_task_list` id of task ``t`` of the ``wd_first`` order: its first ``E * wd`` tasks are the
    dW_down tiles (expert-major), then the D2 and D1 tiles (``n_d``), then each expert's dW_gate and dW_up tiles."""
    n_wd = num_experts * wd
    out = t - n_wd
    if t < n_wd:
        out = n_d + t // wd * (wd + 2 * wgu) + t % wd
    elif t - n_wd >= n_d:
        lin = t - n_wd - n_d
        out = n_d + lin // (2 * wgu) * (wd + 2 * wgu) + wd + lin % (2 * wgu)
    return out


class CoreDims(NamedTuple):
    """One group's task counts and tile grids (:func:`core_task`): ``n_d2`` / ``n_d1`` the D2 / D1 tasks,
    ``n_i`` / ``n_h`` the n-tiles over I / H, ``wd_m`` x ``wd_n`` the (m, n) tiles of one dW_down and
    ``wgu_m`` x ``wgu_n`` those of one dW_gate (= dW_up); Int32 each."""

    n_d2: Int32
    n_d1: Int32
    n_i: Int32
    n_h: Int32
    wd_m: Int32
    wd_n: Int32
    wgu_m: Int32
    wgu_n: Int32


@cute.jit
def core_task(t: Int32, dims: CoreDims, offsets: cute.Tensor, num_experts: Int32, tile_m: cutlass.Constexpr[int],
              cur: tuple, wd_first: cutlass.Constexpr[bool] = False):
    """``(phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2)`` of core task
    ``t`` (:func:`core_task_list` order; ``dims``: :class:`CoreDims`). D2 and D1 advance their own
    :func:`~mok_cute.schedule.group_tiles.seek` cursor, ``cur`` = ``(e1, b1, e2, b2)`` (a CTA's tasks
    only grow: the ``wd_first`` order keeps each phase's ids increasing); ``row0`` / ``rows``: the
    grouped rows of a D2 / D1 tile; W: ``which`` in WD / WG / WU, ``(m_tile, n_tile)`` its dW output tile."""
    n_d2, n_d1, n_i, n_h, wd_m, wd_n, wgu_m, wgu_n = dims
    e1, b1, e2, b2 = cur
    if cutlass.const_expr(wd_first):
        t = wd_first_id(t, n_d2 + n_d1, num_experts, wd_m * wd_n, wgu_m * wgu_n)
    phase = Int32(W)
    expert = Int32(0)
    n_tile = Int32(0)
    m_tile = Int32(0)
    row0 = Int32(0)
    rows = Int32(0)
    mt = Int32(-1)
    which = Int32(-1)
    if t < n_d2:
        phase = Int32(D2)
        e1, b1 = seek(offsets, num_experts, tile_m, n_i, t, e1, b1)
        expert = e1
        m_tile, n_tile, row0, rows = tile_coords(offsets, tile_m, t, e1, b1)
        mt = b1 // n_i + m_tile
    elif t < n_d2 + n_d1:
        phase = Int32(D1)
        lin = t - n_d2
        e2, b2 = seek(offsets, num_experts, tile_m, n_h, lin, e2, b2)
        expert = e2
        m_tile, n_tile, row0, rows = tile_coords(offsets, tile_m, lin, e2, b2)
        mt = b2 // n_h + m_tile
    else:
        lin = t - n_d2 - n_d1
        wd = wd_m * wd_n
        wgu = wgu_m * wgu_n
        per_e = wd + 2 * wgu
        expert = lin // per_e
        r = lin - expert * per_e
        m_tiles = wd_m
        which = Int32(WD)
        if r >= wd:
            r = r - wd
            m_tiles = wgu_m
            which = Int32(WG)
            if r >= wgu:
                r = r - wgu
                which = Int32(WU)
        m_tile = r % m_tiles
        n_tile = r // m_tiles
    return phase, expert, n_tile, m_tile, row0, rows, mt, which, e1, b1, e2, b2


@cute.jit
def expert_mtile_range(offsets: cute.Tensor, expert: Int32, tile_m: cutlass.Constexpr[int],
                       warp: cutlass.Constexpr[bool] = False):
    """``(first routed m-tile of expert, its m-tile count)``: one pass over the offsets before it, or (``warp``,
    called by a whole converged warp) each lane summing the m-tiles of every 32nd expert before it (independent
    loads), then the warp adding the lanes' sums (the SM90 backward; SM100's TMA warp keeps the one pass: the
    warp's registers)."""
    first = Int32(0)
    start, step = (cute.arch.lane_idx(), 32) if cutlass.const_expr(warp) else (0, 1)
    for e in cutlass.range(start, expert, step, unroll=1):
        first += expert_mtile_count(offsets, e, tile_m)
    if cutlass.const_expr(warp):
        first = warp_sum(first)
    return first, expert_mtile_count(offsets, expert, tile_m)

"""Task list of the fused MoE backward (issue 13; pure-Python mirror, the kernel is not built):
the schedule the backward megakernel is to run, checked for completeness and deadlock freedom
on the host (:func:`simulate`, :func:`simulate_ep`) before any device code exists.

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

from mok_cute.schedule.fused_tasks import check_ep_pushes, mtile_rows
from mok_cute.schedule.tickets import run_tickets, strided

SD2, D2, SD1, D1, SW, W = range(6)
PHASES = ("SD2", "D2", "SD1", "D1", "SW", "W")
WD, WG, WU = range(3)  # which weight gradient a SW / W tile belongs to


def expert_mtiles(offsets, tile_m: int) -> list[list[int]]:
    """The routed m-tile indices ``mt`` of each expert."""
    offs = [int(o) for o in offsets]
    out, mt = [], 0
    for e in range(len(offs) - 1):
        n = -(-(offs[e + 1] - offs[e]) // tile_m)
        out.append(list(range(mt, mt + n)))
        mt += n
    return out


def task_list(offsets, tokens: int, tile_m: int, n_i: int, n_is: int, n_h: int, w_d: int, w_gu: int,
              shared: bool) -> list[tuple]:
    """Every task in list order: ``(phase, expert, tile, mt, which)`` (``tile``: the n-tile, or the
    weight-gradient tile; ``mt``: the routed or shared m-tile, -1 for weight tiles; ``which``:
    WD / WG / WU for weight tiles, else -1). ``w_d`` / ``w_gu``: tiles of one dW_down / one dW_gate
    (= dW_up) per expert (the shared expert's counts when ``shared``: the same formula at I_s)."""
    m_sh = -(-tokens // tile_m)
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
    m_sh = -(-tokens // tile_m)
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

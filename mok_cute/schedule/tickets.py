"""Host model of a persistent kernel's ticket schedule (the pure-Python mirror shared by the
fused forward's and backward's task lists): tests run a task list through it to show that it
completes under any interleaving. This module imports no GEMM code.

The model: ``comm`` CTAs first run their own jobs in order (gathers: a job waits for its
counters, then publishes one), then every CTA claims tickets of one list in order from a shared
counter; a CTA holds its ticket until the task's inputs are published, then publishes the
task's output counter; background agents only run their jobs. All CTAs are resident, as the
kernels require.
"""
from __future__ import annotations

import random
from typing import Callable

Need = tuple[str, int, int]  # (counter, index, target): wait for count[counter, index] >= target
Key = tuple[str, int]


def run_tickets(tasks: list, needs: Callable[[object], list[Need]], publishes: Callable[[object], Key],
                comm_jobs: list[list[tuple[list[Need], Key]]], gemm_ctas: int, seed: int = 0,
                background: list[list[tuple[list[Need], Key]]] = ()):
    """Run ``tasks`` (in ticket order) on ``len(comm_jobs)`` comm CTAs (each with its job list)
    and ``gemm_ctas`` more CTAs, visiting the CTAs in a random order per round (``seed``);
    ``background``: job lists of agents that run beside the CTAs and never claim a ticket (warps
    of a CTA that work while its GEMM warps hold a task).
    Returns ``(rounds, count)`` (``count``: every counter's final value); AssertionError with the
    held tickets on a deadlock (a round in which no CTA can move)."""
    rng = random.Random(seed)
    count: dict[Key, int] = {}
    jobs = [list(j) for j in comm_jobs] + [[] for _ in range(gemm_ctas)] + [list(j) for j in background]
    claimers = len(comm_jobs) + gemm_ctas
    held: list = [None] * len(jobs)
    ticket, finished, rounds = 0, 0, 0

    def ready(wants):
        return all(count.get((name, i), 0) >= target for name, i, target in wants)

    while finished < len(tasks) or any(jobs):
        progressed = False
        for cta in rng.sample(range(len(held)), len(held)):
            if jobs[cta]:
                wants, key = jobs[cta][0]
                if ready(wants):
                    jobs[cta].pop(0)
                    count[key] = count.get(key, 0) + 1
                    progressed = True
                continue
            if cta >= claimers:
                continue
            if held[cta] is None and ticket < len(tasks):
                held[cta], ticket, progressed = ticket, ticket + 1, True
            if held[cta] is not None and ready(needs(tasks[held[cta]])):
                key = publishes(tasks[held[cta]])
                count[key] = count.get(key, 0) + 1
                held[cta], finished, progressed = None, finished + 1, True
        assert progressed, f"deadlock after {rounds} rounds: held tickets {[h for h in held if h is not None]}"
        rounds += 1
    return rounds, count


def strided(jobs: list, ctas: int) -> list[list]:
    """``jobs`` dealt to ``ctas`` CTAs round-robin (job i to CTA i % ctas), each in order."""
    return [jobs[c::ctas] for c in range(ctas)]

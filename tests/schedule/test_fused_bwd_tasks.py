"""The fused backward's task list (schedule/fused_bwd_tasks; the mirror of issue 13's kernel,
not built yet): complete and deadlock-free on adversarial routings at EP 1/2/4/8, with every
dx row pushed once per column tile, and not vacuous (a broken list is caught)."""
from __future__ import annotations

import random

import pytest
import torch

from mok_cute.schedule import fused_bwd_tasks as bt
from conftest import offsets_from

DIMS = dict(n_i=2, n_is=1, n_h=3, w_d=2, w_gu=3)


@pytest.mark.parametrize("counts", [[256] * 4, [1000, 0, 0, 0], [0, 0, 0, 1], [0] * 4, [129, 1, 0, 300]])
@pytest.mark.parametrize("shared", [False, True])
def test_backward_schedule_completes(counts, shared):
    for gemm, comm in ((1, 1), (9, 2), (140, 3)):
        bt.simulate(offsets_from(counts), 300, 128, **DIMS, shared=shared, gemm_ctas=gemm, comm_ctas=comm, seed=gemm)


def test_backward_schedule_random():
    rng = random.Random(2)
    for _ in range(30):
        e, tokens = rng.choice([1, 2, 8, 32]), rng.randint(1, 700)
        counts = [0] * e
        for _ in range(tokens * rng.randint(1, 4)):
            counts[0 if rng.random() < 0.5 else rng.randrange(e)] += 1
        dims = {k: rng.randint(1, 4) for k in DIMS}
        bt.simulate(offsets_from(counts), tokens, 128, **dims, shared=rng.random() < 0.5, gemm_ctas=rng.randint(1, 60),
                    comm_ctas=rng.randint(1, 20), seed=rng.randint(0, 99))


def test_task_list_shape():
    """Tile counts per phase, experts without rows keep their weight tiles, and no task needs a
    counter that only a later ticket publishes."""
    offs = offsets_from([300, 0, 129])
    tasks = bt.task_list(offs, 200, 128, **DIMS, shared=True)
    per_e = bt.expert_mtiles(offs, 128)
    assert per_e == [[0, 1, 2], [], [3, 4]]
    by = {p: [t for t in tasks if t[0] == p] for p in range(6)}
    assert len(by[bt.SD2]) == 2 * 1 and len(by[bt.D2]) == 5 * 2 and len(by[bt.SD1]) == 2 * 3
    assert len(by[bt.D1]) == 5 * 3 and len(by[bt.SW]) == 2 + 3 + 3 and len(by[bt.W]) == 3 * (2 + 3 + 3)
    assert {t[1] for t in by[bt.W]} == {0, 1, 2}
    published = set()
    for t in tasks:
        for name, i, _ in bt.needs(t, per_e, 2, DIMS["n_i"], DIMS["n_is"]):
            assert name in ("gdy", "gx") or (name, i) in published, (t, name, i)
        published.add(bt.publishes(t))


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_backward_ep_pushes_every_route_once(ep):
    gen = torch.Generator().manual_seed(ep)
    e, t, k = 16, 200, 4
    per_rank = []
    for r in range(ep):
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        idx[::3, 0] = 0  # a hot expert
        idx[::5, -1] = -1
        per_rank.append(idx)
    rounds = bt.simulate_ep(per_rank, e, 128, **DIMS, shared=True, gemm_ctas=12, comm_ctas=3)
    assert len(rounds) == ep and all(r > 0 for r in rounds)


def test_simulate_catches_a_broken_list(monkeypatch):
    """A wgrad tile that waits for a counter nobody publishes deadlocks; a list whose dgrad1 comes
    before the dgrad2 it needs deadlocks on a single CTA."""
    real = bt.needs
    monkeypatch.setattr(bt, "needs", lambda task, *a: real(task, *a) + ([("gx", 10 ** 6, 1)] if task[0] == bt.W else []))
    with pytest.raises(AssertionError, match="deadlock"):
        bt.simulate(offsets_from([200]), 100, 128, **DIMS, shared=False, gemm_ctas=2, comm_ctas=1)
    monkeypatch.setattr(bt, "needs", real)
    real_list = bt.task_list
    monkeypatch.setattr(bt, "task_list", lambda *a, **kw: sorted(real_list(*a, **kw), key=lambda t: t[0] != bt.D1))
    with pytest.raises(AssertionError, match="deadlock"):
        bt.simulate(offsets_from([200]), 100, 128, **DIMS, shared=False, gemm_ctas=1, comm_ctas=1)

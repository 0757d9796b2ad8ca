"""The pure-torch routing planner against a brute-force Python-loop reference."""
import pytest
import torch

from mok_cute.schedule.plan import plan_routing


def brute_force(idx_list, E, EP):
    T, k = idx_list[0].shape
    El = E // EP
    counts = [[0] * E for _ in range(EP)]
    recv = [[] for _ in range(EP)]
    for p in range(EP):
        for t in range(T):
            for j in range(k):
                e = int(idx_list[p][t, j])
                if e >= 0:
                    counts[p][e] += 1
    dest_rank = [[[-1] * k for _ in range(T)] for _ in range(EP)]
    dest_row = [[[-1] * k for _ in range(T)] for _ in range(EP)]
    offsets = []
    for r in range(EP):
        offs = [0]
        for le in range(El):
            e = r * El + le
            for p in range(EP):
                for t in range(T):
                    for j in range(k):
                        if int(idx_list[p][t, j]) == e:
                            dest_rank[p][t][j] = r
                            dest_row[p][t][j] = len(recv[r])
                            recv[r].append(p * T * k + t * k + j)
            offs.append(len(recv[r]))
        offsets.append(offs)
    return counts, offsets, recv, dest_rank, dest_row


def check(idx_list, E, EP):
    plan = plan_routing(idx_list, E, EP)
    counts, offsets, recv, dest_rank, dest_row = brute_force(idx_list, E, EP)
    assert plan.counts.tolist() == counts
    assert plan.offsets.tolist() == offsets
    assert [s.tolist() for s in plan.recv_src] == recv
    assert plan.dest_rank.tolist() == dest_rank
    assert plan.dest_row.tolist() == dest_row
    for t in (plan.counts, plan.offsets, plan.dest_rank, plan.dest_row, *plan.recv_src):
        assert t.dtype == torch.int32
    for r in range(EP):
        tr = plan.recv_triples(r)
        for row, (p, t, j) in enumerate(tr.tolist()):
            assert plan.dest_rank[p, t, j] == r and plan.dest_row[p, t, j] == row
        v = plan.rank_view(r)
        assert torch.equal(v.offsets, plan.offsets[r]) and v.recv_src.numel() == offsets[r][-1]
    return plan


def random_routing(g, T, k, E, drop=0.1):
    """Distinct experts per token (top-k style) with some -1 slots."""
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)
    mask = torch.rand(T, k, generator=g) < drop
    return torch.where(mask, -1, idx)


@pytest.mark.parametrize("EP", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_random(EP, seed):
    g = torch.Generator().manual_seed(seed + 10 * EP)
    E, T, k = 8 * EP, 13, 3
    check([random_routing(g, T, k, E) for _ in range(EP)], E, EP)


@pytest.mark.parametrize("EP", [1, 2, 4])
def test_adversarial(EP):
    g = torch.Generator().manual_seed(EP)
    E, T, k = 4 * EP, 7, 4
    # one hot expert: every slot to expert E-1 (repeats within a token are allowed)
    check([torch.full((T, k), E - 1) for _ in range(EP)], E, EP)
    # ranks with nothing routed (all -1 rows) next to normal ranks
    idx = [random_routing(g, T, k, E, 0.0) if p % 2 else torch.full((T, k), -1) for p in range(EP)]
    check(idx, E, EP)
    # all -1 everywhere
    plan = check([torch.full((T, k), -1) for _ in range(EP)], E, EP)
    assert int(plan.offsets[:, -1].sum()) == 0
    # T = 1
    check([random_routing(g, 1, k, E) for _ in range(EP)], E, EP)
    # k = E: every token to every expert
    check([torch.stack([torch.randperm(E, generator=g) for _ in range(T)]) for _ in range(EP)], E, EP)
    # int32 input, mixed -1 positions
    check([random_routing(g, T, k, E, 0.5).to(torch.int32) for _ in range(EP)], E, EP)


def test_validation():
    with pytest.raises(ValueError):
        plan_routing([torch.zeros(2, 2, dtype=torch.long)], 3, 2)
    with pytest.raises(ValueError):
        plan_routing([torch.full((2, 2), 4)], 4, 1)
    with pytest.raises(TypeError):
        plan_routing([torch.zeros(2, 2)], 4, 1)
    with pytest.raises(ValueError):
        plan_routing([torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long)], 4, 2)


def test_check_plan_matches_the_workspace():
    """The plan check the comm launchers run (schedule side: it knows RankPlan, not the workspace)."""
    import types

    from mok_cute.schedule.plan import check_plan

    plan = plan_routing([torch.tensor([[0, 1], [3, -1]]), torch.tensor([[2, 2], [-1, 1]])], 4, 2).rank_view(1)
    plan.recv_src = torch.zeros(8, dtype=torch.int32)
    ws = types.SimpleNamespace(me=1, E=4, EP=2, T=2, k=2, device=torch.device("cpu"))
    check_plan(ws, plan)
    with pytest.raises(TypeError, match="RankPlan"):
        check_plan(ws, "plan")
    with pytest.raises(ValueError, match="does not match"):
        check_plan(types.SimpleNamespace(**{**vars(ws), "me": 0}), plan)
    plan.offsets = plan.offsets[:-1]
    with pytest.raises(ValueError, match="offsets"):
        check_plan(ws, plan)

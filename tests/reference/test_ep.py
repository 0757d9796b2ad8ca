"""Expert parallelism in the reference: EP = 2 (gloo, 2 processes on CPU) equals EP = 1 on
the same global problem, bitwise."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mok_cute import reference as R

T_RANK, H, I, E, K, EP = 10, 64, 64, 4, 2, 2


def _global_problem(seed):
    from conftest import make_problem

    p, dy = make_problem(T=T_RANK * EP, H=H, I=I, E=E, k=K, shared_I=64, seed=seed)
    p["topk_idx"][3] = torch.tensor([1, -1])  # rank 0 token sent to rank 0 only
    p["topk_idx"][T_RANK + 2] = torch.tensor([3, 2])  # rank 1 token to rank 1's experts
    return p, dy


def _worker(rank, init_file, precision, limit):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP)
    try:
        solo = [dist.new_group([r]) for r in range(EP)][rank]  # EP = 1 inside this process
        p, dy = _global_problem(seed=11)
        ref_y, ref_s = R.moe_forward(**p, swiglu_limit=limit, precision=precision, group=solo)
        ref_g = R.moe_backward(ref_s, dy)
        tok = slice(rank * T_RANK, (rank + 1) * T_RANK)
        exp = slice(rank * E // EP, (rank + 1) * E // EP)
        local = dict(x=p["x"][tok], topk_idx=p["topk_idx"][tok], topk_w=p["topk_w"][tok],
                     w_gate=p["w_gate"][exp], w_up=p["w_up"][exp], w_down=p["w_down"][exp],
                     shared=p["shared"])
        y, s = R.moe_forward(**local, swiglu_limit=limit, precision=precision, group=dist.group.WORLD)
        g = R.moe_backward(s, dy[tok])
        assert torch.equal(y, ref_y[tok]), "y"
        assert torch.equal(g.dx, ref_g.dx[tok]), "dx"
        assert torch.equal(g.d_topk_w, ref_g.d_topk_w[tok]), "d_topk_w"
        for name in ("d_w_gate", "d_w_up", "d_w_down"):
            a, b = getattr(g, name), getattr(ref_g, name)[exp]
            assert torch.equal(a, b), (name, float((a.float()-b.float()).abs().max()), int((a != b).sum()), a.numel())
        # the shared expert is local to each rank: its grads are those of this rank's tokens
        only = dict(local, w_gate=p["w_gate"][:0], w_up=p["w_up"][:0], w_down=p["w_down"][:0],
                    topk_idx=torch.full_like(local["topk_idx"], -1))
        _, s1 = R.moe_forward(**only, swiglu_limit=limit, precision=precision, group=solo)
        for a, b in zip(g.d_shared, R.moe_backward(s1, dy[tok]).d_shared):
            assert torch.equal(a, b), "d_shared"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision,limit", [("bf16", None), ("bf16", 4.0), ("mxfp8", 4.0)])
def test_ep2_equals_ep1_bitwise(tmp_path, precision, limit):
    mp.spawn(_worker, args=(str(tmp_path / "init"), precision, limit), nprocs=EP, join=True)

"""mok_cute.bench.torch_layer.torch_ep_layer (the torch + NCCL baseline of tools/bench_layer_ep.py,
here over gloo on the CPU): at EP = 2 its y and gradients track the reference backend's on the same
group within BF16 tolerances, so a speed ratio against it compares like with like."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T_RANK, H, I, E, K, EP = 24, 64, 64, 4, 2, 2


def _worker(rank, init_file):
    import mok_cute
    from conftest import make_problem
    from mok_cute.bench.torch_layer import torch_ep_layer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP)
    try:
        p, dy = make_problem(T=T_RANK * EP, H=H, I=I, E=E, k=K, shared_I=64, seed=21)
        tok = slice(rank * T_RANK, (rank + 1) * T_RANK)
        exp = slice(rank * E // EP, (rank + 1) * E // EP)
        idx = p["topk_idx"][tok].clone()
        idx[1, 0] = -1  # a -1 slot
        x = p["x"][tok].clone().requires_grad_()
        w = p["topk_w"][tok].clone().requires_grad_()
        wg, wu, wd = (p[n][exp].clone().requires_grad_() for n in ("w_gate", "w_up", "w_down"))
        sh = [s.clone().requires_grad_() for s in p["shared"]]
        y_ref = mok_cute.moe(x, idx, w, wg, wu, wd, shared=tuple(sh), swiglu_limit=4.0,
                             config=mok_cute.MoKConfig(backend="reference"), group=dist.group.WORLD)
        ref = torch.autograd.grad(y_ref, [x, w, wg, wu, wd], dy[tok])
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        w1 = torch.cat([wg.detach(), wu.detach()], 1).requires_grad_()
        wd2 = wd.detach().clone().requires_grad_()
        y = torch_ep_layer(x2, idx, w2, w1, wd2, tuple(s.detach() for s in sh), 4.0, dist.group.WORLD)
        got = torch.autograd.grad(y, [x2, w2, w1, wd2], dy[tok])
        got = [got[0], got[1], got[2][:, :I], got[2][:, I:], got[3]]

        def rel(a, b):
            return float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp_min(1e-30))

        assert rel(y, y_ref) < 2e-2, rel(y, y_ref)
        for name, a, b in zip(("dx", "dtw", "dWg", "dWu", "dWd"), got, ref):
            assert rel(a, b) < 3e-2, (name, rel(a, b))
    finally:
        dist.destroy_process_group()


def test_torch_ep_layer_tracks_the_reference(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=EP, join=True)

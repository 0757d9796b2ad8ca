"""Benchmark of the EP communication kernels on 2 GPUs against a torch/NCCL baseline.

    source .gpu-node/activate.sh && torchrun --nproc_per_node=2 tools/bench_comm.py [--quick]

For each (tokens per rank T, hidden H, top-k k) with bf16 rows and E = 32 * EP experts
(random top-k routing, no dropped slots):
  * dispatch: pull of the routed rows into expert-grouped order (``mok dispatch``), timed
    with x already in the source buffer (``pull``) and including the staging copy;
  * combine: push of the expert rows + fixed-order weighted sum (``mok combine``);
  * baseline: the same jobs through NCCL as Megatron's all-to-all dispatcher does them
    (permute -> ``all_to_all_single`` -> sort by expert; and back: unsort ->
    ``all_to_all_single`` -> weighted sum over slots); splits exchanged beforehand;
  * the comm-CTA sweep 4..32 for dispatch and combine.
Times are medians of 20 iterations on the slowest rank (CUDA events). GB/s per direction
counts only the bytes that cross NVLink (rows whose source rank differs from the expert
rank). The peer copy rate is torch ``copy_`` of 256 MiB from the peer's symmetric buffer
while the peer does the same. The table is printed last (rank 0); JSON lines go to
$OUT/bench_comm.jsonl when $OUT is set.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checks.common import bench_us as median_us  # noqa: E402
from mok_cute.comm.combine import combine  # noqa: E402
from mok_cute.comm.dispatch import dispatch  # noqa: E402
from mok_cute.comm.workspace import get_workspace  # noqa: E402
from mok_cute.schedule.plan import plan_routing, plan_routing_device  # noqa: E402

BF16 = torch.bfloat16


def bench_us(fn, warmup=5, iters=20) -> float:
    """Median per-rank time (us), then the max over ranks (the slowest rank)."""
    t = torch.tensor([median_us(fn, warmup, iters, barrier=dist.barrier)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def peer_copy_rate(nbytes=256 << 20) -> tuple[float, float]:
    """(pull, push) GB/s per direction of torch copy_ between the two GPUs' symmetric buffers."""
    import torch.distributed._symmetric_memory as symm_mem

    me, ep = dist.get_rank(), dist.get_world_size()
    n = nbytes // 2
    buf = symm_mem.empty(n, dtype=BF16, device="cuda")
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    buf.normal_()
    peer = (me + 1) % ep
    if hasattr(hdl, "get_remote_tensor"):
        remote = hdl.get_remote_tensor(peer, (n,), BF16)
    else:
        remote = hdl.get_buffer(peer, (n,), BF16, getattr(hdl, "offset", 0) // 2)
    local = torch.empty(n, dtype=BF16, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    t_pull = bench_us(lambda: local.copy_(remote))
    t_push = bench_us(lambda: remote.copy_(local))
    dist.barrier()
    return nbytes / t_pull / 1e3, nbytes / t_push / 1e3


class Baseline:
    """Megatron-style all-to-all dispatch/combine with precomputed splits (bf16)."""

    def __init__(self, idx_all, me, T, k, E, EP, dev):
        El = E // EP
        idx = idx_all[me].reshape(-1)                          # [T*k] routes of this rank
        dest = idx // El
        order = torch.sort(dest * (T * k) + torch.arange(T * k, device=dev)).indices
        self.send_tok = (order // k).contiguous()              # token of each sent row
        self.send_route = order.contiguous()                   # route id (t*k+j) of each row
        self.send_splits = torch.bincount(dest, minlength=EP).tolist()
        # what I receive: from each source p (in p order) its routes to my experts, in
        # (t, j) order; expert-grouped order sorts them by (expert, p, t, j)
        recv_e = []
        for p in range(EP):
            ip = idx_all[p].reshape(-1)
            mine = ip[(ip // El) == me]
            recv_e.append(mine)
        self.recv_splits = [int(r.numel()) for r in recv_e]
        re_ = torch.cat(recv_e)
        self.sort_idx = torch.sort(re_ * re_.numel() + torch.arange(re_.numel(), device=dev)).indices
        self.unsort_idx = torch.argsort(self.sort_idx)
        self.M = re_.numel()

    def dispatch(self, x, H):
        send = x.index_select(0, self.send_tok)
        recv = torch.empty(self.M, H, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(recv, send, self.recv_splits, self.send_splits)
        return recv.index_select(0, self.sort_idx)

    def combine(self, expert_out, w, T, k, H):
        back = expert_out[:self.M].index_select(0, self.unsort_idx)
        recv = torch.empty(T * k, H, dtype=back.dtype, device=back.device)
        dist.all_to_all_single(recv, back, self.send_splits, self.recv_splits)
        rows = torch.empty_like(recv).index_copy_(0, self.send_route, recv)
        acc = torch.zeros(T, H, dtype=torch.float32, device=back.device)
        rv = rows.view(T, k, H)
        for j in range(k):
            acc = acc + w[:, j:j + 1] * rv[:, j].float()
        return acc.to(BF16)


def routing(p, T, k, E, dev):
    g = torch.Generator(device=dev).manual_seed(1000 + p)
    return torch.rand(T, E, generator=g, device=dev).topk(k, dim=1).indices


def bench_case(T, H, k, ctas, rows, sweep):
    me, EP, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda")
    E = 32 * EP
    idx_all = [routing(p, T, k, E, dev) for p in range(EP)]
    spec = plan_routing(idx_all, E, EP)
    srcs = spec.recv_triples(me)[:, 0]
    M = int(srcs.numel())
    remote = torch.tensor([int((srcs != me).sum())], device=dev)
    dist.all_reduce(remote, op=dist.ReduceOp.MIN)          # per direction, the smaller side
    remote_bytes = int(remote) * H * 2
    Mmax = torch.tensor([M], device=dev)
    dist.all_reduce(Mmax, op=dist.ReduceOp.MAX)
    ws = get_workspace(T=T, H=H, k=k, E=E, timeout_s=20.0, num_ctas=32,
                       recv_capacity=int(Mmax))
    plan = plan_routing_device(ws, idx_all[me])
    x = torch.randn(T, H, device=dev).to(BF16)
    eo = torch.randn(int(Mmax), H, device=dev).to(BF16)
    w = torch.rand(T, k, device=dev)
    out = torch.empty(int(Mmax), H, dtype=BF16, device=dev)
    ws.check_status()
    src = ws.acquire_src()
    src.copy_(x)
    tag = f"T{T} H{H} k{k}"

    def add(name, t, nbytes=remote_bytes, **kw):
        rows.append(dict(case=tag, name=name, us=t, GBps=nbytes / t / 1e3 if nbytes else None, **kw))

    for c in (sweep if sweep else [ctas]):
        add(f"mok dispatch pull, {c} CTAs", bench_us(lambda: dispatch(ws, src, plan, num_ctas=c, out=out)), ctas=c)
        add(f"mok combine push+sum, {c} CTAs", bench_us(lambda: combine(ws, eo, w, plan, num_ctas=c)), ctas=c)
    add(f"mok dispatch incl. staging, {ctas} CTAs",
        bench_us(lambda: dispatch(ws, x, plan, num_ctas=ctas, out=out)), ctas=ctas)
    ws.check_status()
    base = Baseline(idx_all, me, T, k, E, EP, dev)
    add("nccl dispatch (permute+a2a+sort)", bench_us(lambda: base.dispatch(x, H)))
    add("nccl combine (unsort+a2a+wsum)", bench_us(lambda: base.combine(eo, w, T, k, H)))
    add("nccl a2a only (dispatch bytes)", bench_us(lambda: dist.all_to_all_single(
        torch.empty(base.M, H, dtype=BF16, device=dev), x.index_select(0, base.send_tok),
        base.recv_splits, base.send_splits)))
    return ws


def main():
    quick = "--quick" in sys.argv
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    me = dist.get_rank()
    pull_rate, push_rate = peer_copy_rate()
    rows = [dict(case="-", name="torch copy_ peer->local (pull) 256MiB", us=None, GBps=pull_rate),
            dict(case="-", name="torch copy_ local->peer (push) 256MiB", us=None, GBps=push_rate)]
    cases = [(4096, 7168, 8), (8192, 7168, 8)] if quick else [
        (2048, 7168, 8), (4096, 7168, 8), (8192, 7168, 8), (16384, 7168, 8),
        (4096, 4096, 8), (8192, 4096, 8), (4096, 7168, 6), (8192, 7168, 6)]
    for i, (T, H, k) in enumerate(cases):
        sweep = [4, 8, 16, 24, 32] if (T, H, k) in ((4096, 7168, 8), (8192, 7168, 8)) else [16, 32]
        bench_case(T, H, k, 32, rows, sweep)
        if me == 0:
            print(f"[bench_comm] done T{T} H{H} k{k}", flush=True)
    if me == 0:
        out = os.environ.get("OUT")
        if out:
            with open(Path(out) / "bench_comm.jsonl", "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        peer = min(pull_rate, push_rate)
        print(f"== bench_comm on 2x {torch.cuda.get_device_name()} (bf16, E=64 random top-k; "
              f"GB/s per direction over remote rows; slowest rank) ==")
        print(f"{'case':16s} {'what':44s} {'us':>9s} {'GB/s':>7s} {'%peer':>6s}")
        for r in rows:
            us = "-" if r["us"] is None else f"{r['us']:.1f}"
            gb = "-" if r["GBps"] is None else f"{r['GBps']:.0f}"
            pc = "-" if r["GBps"] is None else f"{100 * r['GBps'] / peer:.0f}"
            print(f"{r['case']:16s} {r['name'][:44]:44s} {us:>9s} {gb:>7s} {pc:>6s}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Benchmark of the EP communication kernels on 2 GPUs against a torch/NCCL baseline.

    source .gpu-node/activate.sh && torchrun --nproc_per_node=2 -m tools.bench_comm [--quick] [--bulk]

Sweep (E = 32 * EP experts, random top-k routing, no dropped slots): tokens per rank T in
2048, 4096, 8192, 16384; H in 4096, 7168; k in 6, 8; dispatch payload bf16 and MXFP8 (e4m3
rows + E8M0 scale rows, H + H/32 bytes per row). Per (T, H, k, payload):
  * mok dispatch: pull into expert-grouped order, with the rows already in the source buffer
    (``staged``: the kernel alone) and including the staging copy;
  * mok combine: push of the bf16 expert rows + fixed-order weighted sum (combine and the
    reverse paths are bf16 in both recipes, so the MXFP8 line repeats the bf16 combine);
  * NCCL baseline, as Megatron's all-to-all dispatcher does it: permute -> all_to_all_single
    -> sort by expert (MXFP8: one packed uint8 row of data + scales); back: unsort ->
    all_to_all_single -> weighted sum over slots; splits exchanged beforehand.
Plus the comm-CTA sweep (4..32; ``MOK_BENCH_SWEEP``) at T 8192, H 7168, k 8, and the peer copy rate (torch
``copy_`` of 256 MiB from / to the peer's symmetric buffer, both ranks at once).
Times are medians on the slowest rank (CUDA events; 20 iterations, 10 for the largest
shapes). GB/s per direction counts only the bytes that cross NVLink (rows whose source rank
differs from the expert rank); %peer is against the slower peer copy direction. One compact
table is printed last (rank 0); JSON lines go to $OUT/bench_comm.jsonl when $OUT is set.
``--quick``: T 4096 and 8192 at H 7168, k 8, bf16 only, with the CTA sweep.
``--bulk``: the comm ops run with ``transport="bulk"`` (the bf16 and MXFP8 dispatch and the
combine by cp.async.bulk).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mok_cute.comm.combine import combine
from mok_cute.comm.dispatch import dispatch
from mok_cute.comm.planner import plan_routing_device
from mok_cute.comm.rows import UNROLL
from mok_cute.comm.workspace import get_workspace, mxfp8_row_bytes
from mok_cute.schedule.plan import plan_routing
from tools.checks.common import bench_us as median_us

BF16 = torch.bfloat16
SWEEP_SHAPE = (8192, 7168, 8)
# comm CTAs of the sweep and of the cases (MOK_BENCH_SWEEP="4,8,...", MOK_BENCH_CTAS=n to change)
SWEEP_CTAS = tuple(int(c) for c in os.environ.get("MOK_BENCH_SWEEP", "4,8,16,24,32").split(","))
CTAS = int(os.environ.get("MOK_BENCH_CTAS", "32"))
TRANSPORT = "bulk" if "--bulk" in sys.argv else "plain"  # the comm ops' transport in this run


def bench_us(fn, iters=20) -> float:
    """Median per-rank time (us), then the max over ranks (the slowest rank)."""
    t = torch.tensor([median_us(fn, 3, iters, barrier=dist.barrier)], device="cuda")
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
    """Megatron-style all-to-all dispatch/combine with precomputed splits."""

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
            recv_e.append(ip[(ip // El) == me])
        self.recv_splits = [int(r.numel()) for r in recv_e]
        re_ = torch.cat(recv_e)
        self.sort_idx = torch.sort(re_ * re_.numel() + torch.arange(re_.numel(), device=dev)).indices
        self.unsort_idx = torch.argsort(self.sort_idx)
        self.M = re_.numel()

    def dispatch(self, x):
        """x [T, W] (bf16 rows, or uint8 packed MXFP8 rows) -> [M, W] expert-grouped."""
        send = x.index_select(0, self.send_tok)
        recv = torch.empty(self.M, x.shape[1], dtype=x.dtype, device=x.device)
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


def bench_case(T, H, k, payloads, sweep, res):
    """Time one (T, H, k) for each payload; appends result dicts to ``res``."""
    me, EP, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda")
    E = 32 * EP
    iters = 10 if T * H * k > 8192 * 7168 * 8 else 20
    idx_all = [routing(p, T, k, E, dev) for p in range(EP)]
    spec = plan_routing(idx_all, E, EP)
    srcs = spec.recv_triples(me)[:, 0]
    M = int(srcs.numel())
    remote = torch.tensor([int((srcs != me).sum())], device=dev)
    dist.all_reduce(remote, op=dist.ReduceOp.MIN)          # per direction, the smaller side
    remote = int(remote)
    Mmax = torch.tensor([M], device=dev)
    dist.all_reduce(Mmax, op=dist.ReduceOp.MAX)
    cap = int(Mmax)
    ws = get_workspace(T=T, H=H, k=k, E=E, timeout_s=20.0, num_ctas=CTAS, recv_capacity=cap)
    plan = plan_routing_device(ws, idx_all[me])
    x = torch.randn(T, H, device=dev).to(BF16)
    eo = torch.randn(cap, H, device=dev).to(BF16)
    w = torch.rand(T, k, device=dev)
    base = Baseline(idx_all, me, T, k, E, EP, dev)
    ws.check_status()
    case = f"T{T} H{H} k{k}"
    S, rb = H // 32, mxfp8_row_bytes(H)
    r_comb = dict(us=bench_us(lambda: combine(ws, eo, w, plan, num_ctas=CTAS, transport=TRANSPORT), iters),
                  nccl_us=bench_us(lambda: base.combine(eo, w, T, k, H), iters))
    for payload in payloads:
        if payload == "bf16":
            row_bytes = 2 * H
            src = ws.acquire_src()
            src.copy_(x)
            out = torch.empty(cap, H, dtype=BF16, device=dev)
            staged, full, packed = src, x, x

            def run(inp, c):
                return dispatch(ws, inp, plan, num_ctas=c, out=out, transport=TRANSPORT)
        else:
            row_bytes = H + S
            xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
            xs = torch.randint(0, 256, (T, S), device=dev, dtype=torch.uint8)
            src = ws.acquire_src(rb)
            src[:, :H].copy_(xq.view(torch.uint8))
            src[:, H:H + S].copy_(xs)
            out = torch.empty(cap, rb, dtype=torch.uint8, device=dev)
            staged, full = src, (xq, xs)
            packed = torch.cat([xq.view(torch.uint8), xs], dim=1)

            def run(inp, c):
                return dispatch(ws, inp, plan, payload="mxfp8", num_ctas=c, out=out, transport=TRANSPORT)
        nbytes = remote * row_bytes
        r = dict(case=case, payload=payload, remote_rows=remote, disp_bytes=nbytes,
                 comb_bytes=remote * 2 * H, ctas=CTAS)
        r["disp_us"] = bench_us(lambda: run(staged, CTAS), iters)
        r["disp_stage_us"] = bench_us(lambda: run(full, CTAS), iters)
        r["nccl_disp_us"] = bench_us(lambda: base.dispatch(packed), iters)
        r["comb_us"], r["nccl_comb_us"] = r_comb["us"], r_comb["nccl_us"]
        ws.check_status()
        res["cases"].append(r)
        if sweep:
            for c in SWEEP_CTAS:
                s = dict(case=case, payload=payload, ctas=c, disp_bytes=nbytes,
                         comb_bytes=remote * 2 * H)
                s["disp_us"] = bench_us(lambda: run(staged, c), iters)
                s["comb_us"] = (bench_us(lambda: combine(ws, eo, w, plan, num_ctas=c, transport=TRANSPORT), iters)
                                if payload == "bf16" else None)
                res["sweep"].append(s)
            ws.check_status()


def _gbps(nbytes, us):
    return nbytes / us / 1e3 if us else 0.0


def print_table(res, pull_rate, push_rate):
    peer = min(pull_rate, push_rate)
    print(f"== bench_comm on {dist.get_world_size()}x {torch.cuda.get_device_name()}: E=32*EP "
          f"random top-k, {CTAS} comm CTAs, transport {TRANSPORT} unroll {UNROLL}; GB/s per direction over "
          f"remote rows, slowest rank; peer copy_ pull {pull_rate:.0f} / push "
          f"{push_rate:.0f} GB/s (%pk vs {peer:.0f}) ==")
    print(f"{'case':17s} {'pay':5s} | {'disp us':>8s} {'GB/s':>5s} {'%pk':>4s} {'+stage':>8s} "
          f"{'nccl us':>8s} {'GB/s':>5s} | {'comb us':>8s} {'GB/s':>5s} {'%pk':>4s} "
          f"{'nccl us':>8s} {'GB/s':>5s}")
    for r in res["cases"]:
        d, c = _gbps(r["disp_bytes"], r["disp_us"]), _gbps(r["comb_bytes"], r["comb_us"])
        print(f"{r['case']:17s} {r['payload']:5s} | {r['disp_us']:8.1f} {d:5.0f} "
              f"{100 * d / peer:4.0f} {r['disp_stage_us']:8.1f} {r['nccl_disp_us']:8.1f} "
              f"{_gbps(r['disp_bytes'], r['nccl_disp_us']):5.0f} | {r['comb_us']:8.1f} {c:5.0f} "
              f"{100 * c / peer:4.0f} {r['nccl_comb_us']:8.1f} "
              f"{_gbps(r['comb_bytes'], r['nccl_comb_us']):5.0f}")
    if res["sweep"]:
        print("CTA sweep (dispatch staged / combine; GB/s per direction, %pk):")
        for s in res["sweep"]:
            d = _gbps(s["disp_bytes"], s["disp_us"])
            line = (f"  {s['case']:17s} {s['payload']:5s} {s['ctas']:3d} CTAs: dispatch "
                    f"{s['disp_us']:8.1f} us {d:5.0f} GB/s {100 * d / peer:4.0f}%")
            if s["comb_us"] is not None:
                c = _gbps(s["comb_bytes"], s["comb_us"])
                line += f" | combine {s['comb_us']:8.1f} us {c:5.0f} GB/s {100 * c / peer:4.0f}%"
            print(line)


def main():
    quick = "--quick" in sys.argv
    t0 = time.time()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    me = dist.get_rank()
    pull_rate, push_rate = peer_copy_rate()
    if quick:
        shapes, payloads = [(4096, 7168, 8), (8192, 7168, 8)], ("bf16",)
    else:
        shapes = [(T, H, k) for H in (4096, 7168) for k in (6, 8)
                  for T in (2048, 4096, 8192, 16384)]
        payloads = ("bf16", "mxfp8")
    res = {"cases": [], "sweep": []}
    for T, H, k in shapes:
        bench_case(T, H, k, payloads, (T, H, k) == SWEEP_SHAPE, res)
        if me == 0:
            print(f"[bench_comm] done T{T} H{H} k{k} ({time.time() - t0:.0f} s)", flush=True)
    if me == 0:
        out = os.environ.get("OUT")
        if out:
            with open(Path(out) / "bench_comm.jsonl", "w") as f:
                f.write(json.dumps(dict(peer_pull_GBps=pull_rate, peer_push_GBps=push_rate)) + "\n")
                for r in res["cases"] + res["sweep"]:
                    f.write(json.dumps(r) + "\n")
        print(f"[bench_comm] total {time.time() - t0:.0f} s", flush=True)
        print_table(res, pull_rate, push_rate)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

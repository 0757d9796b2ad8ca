"""Does TMA multicast of the weight tile across a 2-CTA cluster speed up the SM90 GEMM1+SwiGLU?

    source .gpu-node/activate.sh && python3 tools/bench_multicast.py [--tokens 2048,4096] [--iters 40]
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,lts__t_bytes.sum,\
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed --csv \
        python3 tools/bench_multicast.py --ncu        # each of c11, c21, torch once at T 2048

Per T (tokens; H 7168, I 2048, E 16, k 8, M = T*k routed rows, balanced: M/E rows per expert,
random token rows) times, in one process, side by side (CUDA events around each call, warm-up,
the three interleaved call by call so clock drift at the power cap hits all alike; median and
spread (p25-p75) of ``--iters`` calls each). ``--routing balanced,topk``: also (``topk``) each token's
k experts drawn uniformly at random (k distinct), so experts get about M/E rows, not exactly, and
odd m-tile counts give the pair schedule empty tiles:
  * ``c11``: ours, ``grouped_gemm1_swiglu`` with ``MainloopConfig()`` (1-CTA clusters, no multicast);
  * ``c21``: ours with ``MainloopConfig(cluster_mn=(2, 1))`` (CTA pairs on m-tiles (m, m+1), each loads
    its A tile and half of the B tile, multicast to both);
  * ``torch``: ``F.grouped_mm(x, [w_gate; w_up]^T, offs=...)`` (CUTLASS grouped GEMM, no SwiGLU).
Both of ours run with the process-wide epilogue default (TMA store unless MOK_CUTE_SM90_TMA_STORE=0).
Checks: c21's gu and h bitwise equal to c11's (outputs poisoned with NaN first, so every row must be
written), on the balanced problem and on a ragged one (odd m-tile counts, partial tiles, an empty
expert: the pair schedule's empty tiles), plus the ``plain`` epilogue on the ragged problem; and
gu's relative L1 error against torch. Prints a short table last.

Measured 2026-12-02 on one H200 (``--routing balanced,topk --iters 100``, power cap active): c21 / c11
= 0.991 at T 2048 and 4096 balanced (inside the p25-p75 spread), 1.047 / 1.024 with random top-k
routing (the pair schedule's empty tiles); bitwise equal everywhere. ncu at T 2048 balanced (boost
clocks, one launch each): L2 traffic 11.8 GB (c11) -> 8.6 GB (c21; torch 8.9), tensor pipe 87.5% ->
87.5% (torch 90.8%), 1331 -> 1288 us (torch 1257): the multicast removes the extra L2 traffic but
L2 was not what held the tensor pipe back (CUTLASS's kernel there: 4 stages, cooperative, 2x1).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks.common import PowerSampler, power_summary  # noqa: E402

H, I, E, K = 7168, 2048, 16, 8


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-30))


def _problem(counts: list[int], gen: torch.Generator, dev):
    m = sum(counts)
    x = torch.randn(m, H, generator=gen).to(dev, torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(dev, torch.bfloat16)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    offs0 = torch.cat([offs.new_zeros(1), offs])
    return x, w1, offs, offs0


def _ours(x, offs0, wg, wu, cfg):
    from mok_cute.kernels.sm90.grouped_gemm import grouped_gemm1_swiglu

    m = x.shape[0]
    gu = torch.full((m, 2 * I), float("nan"), dtype=torch.bfloat16, device=x.device)
    h = torch.full((m, I), float("nan"), dtype=torch.bfloat16, device=x.device)
    return (lambda: grouped_gemm1_swiglu(x, offs0, wg, wu, out=(gu, h), cfg=cfg)), gu, h


def _bitwise(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN-poisoned rows never match


def check_ragged(gen, dev, c11, c21) -> list[str]:
    """Bitwise c21 == c11 on ragged counts (odd m-tile counts, partial tiles, an empty expert), for
    swiglu and plain."""
    from mok_cute.kernels.sm90.grouped_gemm import grouped_gemm

    counts = [300, 0, 1000, 129, 128, 1, 640, 257, 900, 384, 77, 1500, 256, 513, 31, 1100]
    x, w1, _, offs0 = _problem(counts, gen, dev)
    wg, wu = w1[:, :I].contiguous(), w1[:, I:].contiguous()
    out = []
    run1, gu1, h1 = _ours(x, offs0, wg, wu, c11)
    run2, gu2, h2 = _ours(x, offs0, wg, wu, c21)
    run1(), run2()
    torch.cuda.synchronize()
    out.append(f"ragged swiglu: gu bitwise {_bitwise(gu1, gu2)}, h bitwise {_bitwise(h1, h2)}")
    w = w1[:, :1024].contiguous()  # plain: N 1024 (4 n-tiles of 256)
    p1 = torch.full((x.shape[0], 1024), float("nan"), dtype=torch.bfloat16, device=dev)
    p2 = p1.clone()
    grouped_gemm(x, offs0, w, out=p1, cfg=c11)
    grouped_gemm(x, offs0, w, out=p2, cfg=c21)
    torch.cuda.synchronize()
    out.append(f"ragged plain:  out bitwise {_bitwise(p1, p2)}")
    return out


def _q(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def _interleaved(runs: dict, iters: int, warmup: int = 5) -> dict[str, list[float]]:
    """us per call of each of ``runs``, timed with CUDA events around each call, the variants
    interleaved call by call (``warmup`` rounds first)."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    for _ in range(iters):
        for k, fn in runs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--routing", default="balanced", help="balanced and/or topk, comma-separated")
    ap.add_argument("--ncu", action="store_true", help="each variant once at the first T, inside profiler start/stop")
    args = ap.parse_args()

    from mok_cute.kernels.sm90 import grouped_gemm as gg
    from mok_cute.kernels.sm90.mainloop import MainloopConfig

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(0)
    c11, c21 = MainloopConfig(), MainloopConfig(cluster_mn=(2, 1))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"== bench_multicast {stamp} on {torch.cuda.get_device_name(dev)}; H {H} I {I} E {E} k {K}; "
          f"TMA-store epilogue {'on' if gg.effective_config(c11).tma_store else 'off'}; "
          f"max active 2-CTA clusters {gg.max_clusters(0, 2)}")
    if not args.ncu:
        for n in check_ragged(gen, dev, c11, c21):
            print(n)
    rows = []
    sampler = PowerSampler()
    sampler.__enter__()
    for t, routing in ((int(s), r) for s in args.tokens.split(",") for r in args.routing.split(",")):
        m = t * K
        if routing == "balanced":
            counts = [m // E] * E
        else:  # each token's k distinct experts uniformly at random
            counts = torch.bincount(torch.rand(t, E, generator=gen).topk(K, dim=1).indices.flatten(),
                                    minlength=E).tolist()
        x, w1, offs, offs0 = _problem(counts, gen, dev)
        wg, wu = w1[:, :I].contiguous(), w1[:, I:].contiguous()
        w1t = w1.transpose(1, 2)
        run1, gu1, h1 = _ours(x, offs0, wg, wu, c11)
        run2, gu2, h2 = _ours(x, offs0, wg, wu, c21)
        run1(), run2()
        torch.cuda.synchronize()
        ok_gu, ok_h = _bitwise(gu1, gu2), _bitwise(h1, h2)
        ref = F.grouped_mm(x, w1t, offs=offs)
        rel = _rel(gu1, ref)
        runs = {"c11": run1, "c21": run2, "torch": lambda: F.grouped_mm(x, w1t, offs=offs)}
        if args.ncu:
            for fn in runs.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for k, fn in runs.items():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print("profiled c11, c21, torch at T", t)
            return
        times = _interleaved(runs, args.iters)
        flops = 2.0 * m * H * 2 * I
        odd = sum(-(-c // 128) % 2 for c in counts)
        rows.append((t, m, routing, odd, times, flops, ok_gu, ok_h, rel))
        del x, w1, wg, wu, w1t, gu1, h1, gu2, h2, ref
        torch.cuda.empty_cache()

    sampler.__exit__(None, None, None)
    print(f"clocks while timing ({len(sampler.lines)} nvidia-smi samples):", power_summary(sampler.lines, 150.0),
          "(odd: experts with an odd m-tile count)")
    head = (f"{'T':>5s} {'M':>6s} {'routing':>8s} {'odd':>3s} {'variant':>7s} {'median us':>9s} {'p25-p75 us':>13s} "
            f"{'TFLOP/s':>8s} {'x c11':>6s}  check")
    print(head)
    print("-" * len(head))
    for t, m, routing, odd, times, flops, ok_gu, ok_h, rel in rows:
        base = _q(times["c11"], 0.5)
        for k, v in times.items():
            med = _q(v, 0.5)
            chk = {"c11": f"gu relL1 vs torch {rel:.2e}", "c21": f"gu bitwise {ok_gu}, h bitwise {ok_h}",
                   "torch": "gu only (no SwiGLU)"}[k]
            spread = f"{_q(v, 0.25):.0f}-{_q(v, 0.75):.0f}"
            print(f"{t:5d} {m:6d} {routing:>8s} {odd:3d} {k:>7s} {med:9.1f} {spread:>13s} {flops / med / 1e6:8.1f} "
                  f"{med / base:6.3f}  {chk}")


if __name__ == "__main__":
    main()

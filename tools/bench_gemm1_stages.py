"""Does a 4-stage ring (the split SwiGLU epilogue, ``MainloopConfig(epi_split=True)``) speed up the SM90
GEMM1+SwiGLU?

    source .gpu-node/activate.sh && python3 tools/bench_gemm1_stages.py [--tokens 2048,4096] [--iters 100]
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,\
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed --csv \
        python3 tools/bench_gemm1_stages.py --ncu          # c11, s4, torch once at the first T, balanced

Variants (problem of ``tools/bench_multicast.py``: H 7168, I 2048, E 16, k 8, M = T*k routed rows,
balanced or random top-k routing), timed interleaved call by call with CUDA events (median and
p25-p75 of ``--iters`` calls), the whole interleaved pass done ``--passes`` times (the spread
between passes is the noise floor):
  * ``c11``: ``grouped_gemm1_swiglu`` with ``MainloopConfig(tma_store=True)``: the whole 128x256 tile
    staged for the TMA stores (64 KB), 3 ring stages of 48 KB;
  * ``s4``: ``MainloopConfig(tma_store=True, epi_split=True)``: gate, up and h staged in turn through one
    128x128 buffer (32 KB), 4 ring stages;
  * ``torch``: ``F.grouped_mm(x, [w_gate; w_up]^T, offs=...)`` (CUTLASS grouped GEMM, no SwiGLU).
Checks: s4's gu and h bitwise equal to c11's (outputs poisoned with NaN first) on every timed problem
(before and after timing) and on a ragged one (partial tiles, an empty expert), with and without the
clamp; on the ragged one also s4 in 2-CTA clusters (``cluster_mn=(2, 1)``, B multicast).

Measured 2026-12-02 on one H200 (``--iters 100 --passes 2``, power cap active 77% of the busy samples,
SM clock mean 1641 MHz): bitwise equal everywhere (ragged with and without clamp, s4-c21 too), but s4 is
SLOWER: s4 / c11 = 1.009-1.016 at T 2048 balanced, 1.016-1.023 top-k, 1.014 at T 4096 balanced,
1.017-1.018 top-k (torch / c11 0.94-0.98). ncu at T 2048 balanced (one launch each): tensor pipe 87.6%
(c11) -> 86.0% (s4), 1329 -> 1339 us (torch: CUTLASS 4 stages, 2x1 cluster, cooperative). The fourth
stage does not pay for the three serialized staging rounds (each waits for the previous TMA store to
read the buffer) of the 32 KB epilogue.
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
from bench_multicast import E, H, I, K, _bitwise, _problem, _q, _rel  # noqa: E402
from checks.common import PowerSampler, power_summary  # noqa: E402


def _ours(x, offs0, wg, wu, cfg, limit=None):
    from mok_cute.kernels.sm90.grouped_gemm import grouped_gemm1_swiglu

    m = x.shape[0]
    gu = torch.full((m, 2 * I), float("nan"), dtype=torch.bfloat16, device=x.device)
    h = torch.full((m, I), float("nan"), dtype=torch.bfloat16, device=x.device)
    return (lambda: grouped_gemm1_swiglu(x, offs0, wg, wu, limit, out=(gu, h), cfg=cfg)), gu, h


def check_ragged(gen, dev, base, splits: dict) -> list[str]:
    counts = [300, 0, 1000, 129, 128, 1, 640, 257, 900, 384, 77, 1500, 256, 513, 31, 1100]
    x, w1, _, offs0 = _problem(counts, gen, dev)
    wg, wu = w1[:, :I].contiguous(), w1[:, I:].contiguous()
    out = []
    for limit in (None, 1.0):
        run1, gu1, h1 = _ours(x, offs0, wg, wu, base, limit)
        run1()
        for name, split in splits.items():
            run2, gu2, h2 = _ours(x, offs0, wg, wu, split, limit)
            run2()
            torch.cuda.synchronize()
            nan = int(torch.isnan(h2).sum()) + int(torch.isnan(gu2).sum())
            out.append(f"ragged swiglu limit {limit} {name}: gu bitwise {_bitwise(gu1, gu2)}, "
                       f"h bitwise {_bitwise(h1, h2)}, NaN left {nan}")
    return out


def _interleaved(runs: dict, iters: int, warmup: int = 5) -> dict[str, list[float]]:
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
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--routing", default="balanced,topk")
    ap.add_argument("--ncu", action="store_true", help="each variant once at the first T, inside profiler start/stop")
    args = ap.parse_args()

    from mok_cute.kernels.sm90 import grouped_gemm as gg
    from mok_cute.kernels.sm90.mainloop import MainloopConfig

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(0)
    c11, s4 = MainloopConfig(tma_store=True), MainloopConfig(tma_store=True, epi_split=True)
    st = {k: gg.GroupedGemmSm90(c, "swiglu").mainloop for k, c in (("c11", c11), ("s4", s4))}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"== bench_gemm1_stages {stamp} on {torch.cuda.get_device_name(dev)}; H {H} I {I} E {E} k {K}; "
          + "; ".join(f"{k}: {m.stages} stages, {m.smem_bytes} B smem" for k, m in st.items()))
    if not args.ncu:
        s4c21 = MainloopConfig(tma_store=True, epi_split=True, cluster_mn=(2, 1))
        for n in check_ragged(gen, dev, c11, {"s4": s4, "s4-c21": s4c21}):
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
        run2, gu2, h2 = _ours(x, offs0, wg, wu, s4)
        run1(), run2()
        torch.cuda.synchronize()
        ok_gu, ok_h = _bitwise(gu1, gu2), _bitwise(h1, h2)
        rel = _rel(gu1, F.grouped_mm(x, w1t, offs=offs))
        runs = {"c11": run1, "s4": run2, "torch": lambda: F.grouped_mm(x, w1t, offs=offs)}
        if args.ncu:
            for fn in runs.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for fn in runs.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled c11, s4, torch at T {t} {routing}; gu bitwise {ok_gu}, h bitwise {ok_h}")
            return
        passes = [_interleaved(runs, args.iters) for _ in range(args.passes)]
        # after timing: the last calls' outputs must still be bitwise equal
        ok_gu, ok_h = ok_gu and _bitwise(gu1, gu2), ok_h and _bitwise(h1, h2)
        rows.append((t, m, routing, passes, 2.0 * m * H * 2 * I, ok_gu, ok_h, rel))
        del x, w1, wg, wu, w1t, gu1, h1, gu2, h2
        torch.cuda.empty_cache()
    sampler.__exit__(None, None, None)
    print(f"clocks while timing ({len(sampler.lines)} nvidia-smi samples):", power_summary(sampler.lines, 150.0))
    head = (f"{'T':>5s} {'routing':>8s} {'variant':>7s} {'median us/pass':>17s} {'p25-p75 us':>11s} {'TFLOP/s':>8s} "
            f"{'x c11':>12s}  check")
    print(head)
    print("-" * len(head))
    for t, m, routing, passes, flops, ok_gu, ok_h, rel in rows:
        bases = [_q(p["c11"], 0.5) for p in passes]
        for k in passes[0]:
            meds = [_q(p[k], 0.5) for p in passes]
            v = [x for p in passes for x in p[k]]
            ratio = "/".join(f"{md / b:.3f}" for md, b in zip(meds, bases))
            chk = {"c11": f"gu relL1 vs torch {rel:.1e}", "s4": f"gu bitwise {ok_gu}, h bitwise {ok_h}",
                   "torch": "gu only"}[k]
            print(f"{t:5d} {routing:>8s} {k:>7s} {'/'.join(f'{md:.1f}' for md in meds):>17s} "
                  f"{_q(v, 0.25):5.0f}-{_q(v, 0.75):<5.0f} {flops / _q(v, 0.5) / 1e6:8.1f} {ratio:>12s}  {chk}")


if __name__ == "__main__":
    main()

"""The layer at the H200's 700 W cap in steady state: per implementation (the fused forward at its
gathers, ``--mx`` MXFP8 too, the GEMM tiles alone, the torch layer; ``--bwd``: also forward +
backward steps) the time per call, SM clock and power while it runs back to back for
``--seconds`` after as long a warm-up (the cap reached), its ratios to the torch layer and the
tiles alone, and the energy per call; with ``--bwd`` also the backward alone (fwd+bwd minus
fwd). (bench_layer's rounds of 10-call bursts let some rows run above the steady-state clock.)
``--ncu``: instead, each once between ``cudaProfilerStart`` / ``Stop`` for Nsight Compute's DRAM /
L2 byte counters:

    source .gpu-node/activate.sh && python3 tools/energy_fwd.py [--shapes 3,0,4] [--mx] [--bwd] [--minibatch 256,512]
        [--comm 8,16] [--env MOK_CUTE_FUSED_HELPERS=0] [--seconds 2]
    ncu --profile-from-start off --clock-control none --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
        --csv python3 tools/energy_fwd.py --ncu
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, _ours, gemms_alone, torch_layer  # noqa: E402
from checks.common import PowerSampler, busy_samples, env_var  # noqa: E402
from checks.layer_sm90 import _problem  # noqa: E402


def _run_for(fn, seconds: float, depth: int = 6) -> tuple[int, float]:
    """(calls, seconds) of back-to-back calls of ``fn`` for about ``seconds``: the host waits only
    for the call ``depth`` back to finish, so the GPU queue never drains."""
    torch.cuda.synchronize()
    t0, n, done = time.perf_counter(), 0, []
    while time.perf_counter() - t0 < seconds:
        fn()
        ev = torch.cuda.Event()
        ev.record()
        done.append(ev)
        n += 1
        if len(done) > depth:
            done.pop(0).synchronize()
    torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def steady_run(fn, seconds: float, ms: int = 100) -> tuple[float, list[str]]:
    """(us per call, nvidia-smi samples every ``ms``) of ``fn`` back to back for ``seconds`` after as long a
    warm-up (the cap reached)."""
    _run_for(fn, seconds)
    with PowerSampler(ms=ms) as p:
        n, s = _run_for(fn, seconds)
    return s / n * 1e6, p.lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="3", help="bench_layer.SHAPES indices, comma-separated")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=1, help="rounds over every row, interleaved (each row's median "
                    "and its per-round ratios to the torch layer are printed)")
    ap.add_argument("--gathers", default="default", help="the fused rows' MOK_CUTE_GATHER values")
    ap.add_argument("--minibatch", default="", help="also fused BF16 rows at these minibatch_tokens (the ring's "
                    "size: 1024 tokens x k rows by default, above L2 at H 7168)")
    ap.add_argument("--mx", action="store_true", help="also the fused MXFP8 forward")
    ap.add_argument("--comm", default="16", help="comm_sms_fwd values of the fused rows (BF16, and MXFP8 with --mx)")
    ap.add_argument("--env", default="", help="also fused BF16 rows (and MXFP8 with --mx) with these NAME=VALUE settings "
                    "(comma-separated, one row each; e.g. MOK_CUTE_FUSED_HELPERS=0; the gathers: --gathers)")
    ap.add_argument("--bwd", action="store_true", help="also forward + backward steps (grads set to None first)")
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    lines = []
    for i in (int(v) for v in args.shapes.split(",")):
        lines += _shape(*SHAPES[i], args)
    if not args.ncu:
        rounds = " | vs torch per round" if args.repeat > 1 else ""
        print(f"| shape (+ shared) | impl | us per call | vs torch | vs tiles alone | SM clock MHz | W | mJ per call"
              f"{rounds} |")
        print("|---|---|---|---|---|---|---|---|" + ("---|" if rounds else ""))
        print("\n".join(lines))
    return 0


def _in_env(name: str, value: str, fn, *args):
    """``fn(*args)`` with the environment variable ``name`` set to ``value``."""
    with env_var(name, value):
        return fn(*args)


def _shape(t, h, inter, e, k, skew, args) -> list[str]:
    x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, skew, torch.device("cuda"), seed=11)
    w1 = torch.cat(ws[:2], 1)
    leaves = [x, w, *ws, *sh, w1]
    for p in leaves:
        p.requires_grad_()
    tiles = gemms_alone(x, idx, ws, sh)
    fwd = {"GEMM tiles alone": tiles, "torch": lambda: torch_layer(x, idx, w, w1, ws[2], sh, None)}
    comms = [int(v) for v in args.comm.split(",")]
    for g in args.gathers.split(","):
        for c in comms:
            tag = f"fused {g}" + (f" c{c}" if len(comms) > 1 else "")
            fwd[tag] = lambda g=g, c=c: _ours(True, c, gather=None if g == "default" else g)(x, idx, w, ws, sh)
    for mb in (int(v) for v in args.minibatch.split(",") if v):
        fwd[f"fused mb{mb}"] = lambda mb=mb: _ours(True, 16, minibatch=mb)(x, idx, w, ws, sh)
    settings = [v.split("=", 1) for v in args.env.split(",") if v]
    for name, _ in settings:
        if name in ("MOK_CUTE_GATHER", "MOK_CUTE_GATHER_MX"):  # each fused row sets these itself
            raise SystemExit(f"--env {name}: give the gather with --gathers")
    envs = {}  # row -> (name, value) of its --env setting

    def env_rows(precision: str, prefix: str):
        for name, value in settings:
            fwd[f"{prefix}{name}={value}"] = lambda name=name, value=value: _in_env(
                name, value, _ours(True, 16, precision), x, idx, w, ws, sh)
            envs[f"{prefix}{name}={value}"] = (name, value)

    env_rows("bf16", "fused ")
    if args.mx:
        for c in comms:
            tag = "fused mxfp8" + (f" c{c}" if len(comms) > 1 else "")
            fwd[tag] = lambda c=c: _ours(True, c, "mxfp8")(x, idx, w, ws, sh)
        env_rows("mxfp8", "fused mxfp8 ")
    runs = {f"fwd {n}": (fn, True) for n, fn in fwd.items()}
    if args.bwd:
        def step(fn):
            for p in leaves:
                p.grad = None
            torch.autograd.backward(fn(), dy)
        for n, fn in fwd.items():  # an --env row's setting holds through its backward too
            runs[f"fwd+bwd {n}"] = ((lambda: (tiles(), tiles.backward_tiles())) if fn is tiles else
                                   (lambda fn=fn, n=n: _in_env(*envs[n], step, fn) if n in envs else step(fn)), False)
    for fn, no_grad in runs.values():
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            _run_for(fn, 0.2)
    if args.ncu:
        torch.cuda.profiler.start()
        with torch.no_grad():
            for fn in fwd.values():
                fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return []
    samples = {name: [] for name in runs}  # per row, (us, MHz, W) of each round
    for _ in range(args.repeat):
        for name, (fn, no_grad) in runs.items():
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                us, lines = steady_run(fn, args.seconds)
            busy = [b[:2] for b in busy_samples(lines)] or [(float("nan"), float("nan"))]
            mhz, watts = (sum(v) / len(busy) for v in zip(*busy))
            samples[name].append((us, mhz, watts))
    stats = {name: median_round(v) for name, v in samples.items()}
    out = []
    label = f"T{t} H{h} I{inter} E{e} k{k}{' skewed' if skew else ''}"
    for name, (us, mhz, watts) in stats.items():
        kind = name.split(" ")[0]
        ref, til = stats[f"{kind} torch"][0], stats[f"{kind} GEMM tiles alone"][0]
        per_round = ""
        if args.repeat > 1:
            per_round = " | " + " ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(samples[f"{kind} torch"], samples[name]))
        out.append(f"| {label} | {name} | {us:.0f} | {ref / us:.2f}x | "
                   f"{us / til:.2f}x | {mhz:.0f} | {watts:.0f} | {watts * us * 1e-3:.0f}{per_round} |")
    for name, us, vs_torch, vs_tiles in backward_rows({n: v[0] for n, v in stats.items()}):
        no_rounds = " | -" if args.repeat > 1 else ""
        out.append(f"| {label} | {name} | {us:.0f} | {vs_torch:.2f}x | {vs_tiles:.2f}x | - | - | -{no_rounds} |")
    return out


def median_round(rounds: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The round of median time among a row's ``(us, MHz, W)`` rounds (the lower middle one of an even count)."""
    return sorted(rounds)[(len(rounds) - 1) // 2]


def backward_rows(us: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """The backward alone, as the difference of each implementation's ``fwd+bwd`` and ``fwd``
    times (us per call, keyed by row name): ``(bwd NAME, us, torch's / ours, ours / the tiles')``
    for every NAME with both rows (issue 13's backward targets are ratios of these)."""
    bwd = {n[len("fwd+bwd "):]: us[n] - us["fwd " + n[len("fwd+bwd "):]] for n in us
           if n.startswith("fwd+bwd ") and "fwd " + n[len("fwd+bwd "):] in us}
    if "torch" not in bwd or "GEMM tiles alone" not in bwd:
        return []
    return [(f"bwd {n}", v, bwd["torch"] / v, v / bwd["GEMM tiles alone"]) for n, v in bwd.items()]


if __name__ == "__main__":
    sys.exit(main())

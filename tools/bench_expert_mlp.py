"""Expert-MLP benchmark on one GPU (tokens already grouped by expert).

    python -m tools.bench_expert_mlp [--quick] [--shapes 0,1] [--precision bf16,mxfp8] [--json PATH]

For each shape (E experts, routed tokens, H, I) and routing (uniform, skewed), times forward,
backward and forward+backward of:
  * torch: F.grouped_mm GEMM1 -> torch SwiGLU -> F.grouped_mm GEMM2, autograd backward;
  * ours: ``mok_cute.ops.expert_mlp`` (backend sm90: GEMM1+SwiGLU, GEMM2; backward dgrad2+dSwiGLU,
    dgrad1, three wgrads), forward and forward+backward, separate w_gate / w_up leaves;
  * dense: one cuBLAS bf16 matmul with half the fwd+bwd FLOPs (a ceiling at that size);
and prints TFLOP/s (FLOPs: 6*M*H*I forward, 12*M*H*I backward, M = routed tokens), the
speedup torch/ours per row and its geometric mean. ``relL1`` compares ours with torch
(forward output, dx, dW_down) once per shape as a sanity check.
Also per row: pipe_f+b / host_f+b (20 calls queued back to back: device us per call and the
host's enqueue us per call) and graph_f+b (one CUDA-graph replay of fwd+bwd, both
implementations captured the same way; x_graph = torch / ours).
Prints one table, last; --json PATH writes the rows; --no-ours times torch only.
--precision bf16,mxfp8,fp8_block (default bf16: nothing extra): per row, ours at each listed
precision (and bf16, for the ratio) through ``mok_cute.ops.expert_mlp`` with
``MoKConfig(precision=...)``: fwd and fwd+bwd with the weights' quantizations cached (repeated
calls on unchanged weights), f+b_wq with every weight bumped in place before each call (an
optimizer step: weights re-quantized), and x_* = time / ours-bf16 time.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mok_cute.bench.accuracy import rel_l1
from tools.checks.common import bench_us

SHAPES = [  # (experts, routed tokens, H, I)
    (8, 32768, 7168, 3072),
    (16, 16384, 7168, 2048),
    (32, 16384, 4096, 1024),
    (8, 4096, 4096, 1024),
]


def counts_for(m: int, e: int, skew: bool, gen: torch.Generator) -> torch.Tensor:
    """Tokens per expert: uniform, or skewed (half the tokens to expert 0, two experts empty,
    the rest random and not multiples of 128)."""
    if not skew:
        return torch.full((e,), m // e, dtype=torch.int64)
    c = torch.zeros(e, dtype=torch.int64)
    c[0] = m // 2
    rest = torch.rand(e - 3, generator=gen)
    c[3:] = (rest / rest.sum() * (m - c[0])).long()
    c[0] += m - c.sum()
    return c


def torch_mlp(x, offs, w1t, wdt, inter):
    gu = F.grouped_mm(x, w1t, offs=offs)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    return F.grouped_mm(h, wdt, offs=offs)


def pipelined_us(fn, n: int = 20) -> tuple[float, float]:
    """(device us per call, host us per call) for ``n`` calls queued back to back: the
    first is max(host, device) per call, the second the host's enqueue cost."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    host = (time.perf_counter() - t0) / n * 1e6
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n, host


def graph_us(fn, warmup: int = 3) -> float:
    """:func:`_graph_us`, retried once: on the H200 (2026-11-29) ours' first capture in a
    process failed (cudaErrorStreamCaptureInvalidated, cause not found) and every later one
    succeeded. The retry is not yet verified on the device."""
    t = _graph_us(fn, warmup)
    return _graph_us(fn, warmup) if math.isnan(t) else t


def _graph_us(fn, warmup: int = 3) -> float:
    """Median us of one replay of ``fn`` captured in a CUDA graph (warm-up on a side stream
    first, as torch.cuda.graph asks); NaN if capture fails. What a training step run as a
    graph sees: no host launch cost for either implementation. ``fn`` computes the grads
    with torch.autograd.grad (no AccumulateGrad: leaves made outside the capture stream
    would sync with the default stream and invalidate the capture)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        t = bench_us(g.replay)
        del g
        return t
    except Exception as exc:  # noqa: BLE001 (report, keep benchmarking)
        print(f"graph capture failed: {exc!r}"[:300], file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def profile_table(fn, path: str, title: str) -> None:
    """Append a torch.profiler kernel table (3 calls of ``fn``) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"== {title} (3 calls) ==\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        f.write("\n")


def run_ours(e, m, h, inter, offs, x, w1, wd, dy, t_f_torch, t_fb_torch, t_graph_torch, profile_path=None, title=""):
    """Time ``mok_cute.ops.expert_mlp`` (sm90) on the same problem; relL1 vs torch once."""
    import mok_cute
    from mok_cute.ops import expert_mlp

    cfg = mok_cute.MoKConfig(backend="sm90")
    offs0 = torch.cat([offs.new_zeros(1), offs])
    xo = x.detach().clone().requires_grad_()
    wg = w1.detach()[:, :inter].contiguous().requires_grad_()
    wu = w1.detach()[:, inter:].contiguous().requires_grad_()
    wdo = wd.detach().clone().requires_grad_()

    def fwd():
        return expert_mlp(xo, offs0, wg, wu, wdo, config=cfg)

    def fwd_bwd():
        torch.autograd.backward(fwd(), dy)

    # sanity: ours vs torch (forward, dx, dW_down)
    y = fwd()
    y.backward(dy)
    x.grad = wd.grad = None
    y_t = torch_mlp(x, offs, w1.transpose(1, 2), wd.transpose(1, 2), inter)
    y_t.backward(dy)
    with torch.no_grad():
        rel = max(rel_l1(y, y_t), rel_l1(xo.grad, x.grad), rel_l1(wdo.grad, wd.grad))
    x.grad = w1.grad = wd.grad = xo.grad = wg.grad = wu.grad = wdo.grad = None
    with torch.no_grad():
        t_f = bench_us(fwd)
    t_fb = bench_us(fwd_bwd)
    pipe_fb, host_fb = pipelined_us(fwd_bwd)
    leaves = (xo, wg, wu, wdo)
    graph_fb = graph_us(lambda: torch.autograd.grad(fwd(), leaves, dy))
    if profile_path:
        profile_table(fwd_bwd, profile_path, f"ours fwd+bwd {title}")
    fwd_flop, bwd_flop = 6 * m * h * inter, 12 * m * h * inter
    return dict(ours_graph_fb_us=graph_fb, speedup_graph_fb=t_graph_torch / graph_fb, ours_pipe_fb_us=pipe_fb, ours_host_fb_us=host_fb, ours_fwd_us=t_f, ours_bwd_us=t_fb - t_f, ours_fwdbwd_us=t_fb,
                ours_fwd_tflops=fwd_flop / t_f / 1e6, ours_fwdbwd_tflops=(fwd_flop + bwd_flop) / t_fb / 1e6,
                speedup_fwd=t_f_torch / t_f, speedup_fwdbwd=t_fb_torch / t_fb, rel_l1_vs_torch=rel)


def run_precisions(inter, offs, x, w1, wd, dy, precisions):
    """{precision: (fwd us, fwd+bwd us, fwd+bwd us with weights re-quantized)} of
    ``mok_cute.ops.expert_mlp`` at each precision, bf16 first."""
    import mok_cute
    from mok_cute.ops import expert_mlp

    offs0 = torch.cat([offs.new_zeros(1), offs])
    xs = x.detach().clone().requires_grad_()
    wdd = wd.detach().clone().requires_grad_()
    wg = w1.detach()[:, :inter].contiguous().requires_grad_()
    wu = w1.detach()[:, inter:].contiguous().requires_grad_()
    out = {}
    for p in ["bf16"] + [q for q in precisions if q != "bf16"]:
        cfg = mok_cute.MoKConfig(precision=p)

        def fwd():
            return expert_mlp(xs, offs0, wg, wu, wdd, config=cfg)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (xs, wg, wu, wdd), dy)

        def step():  # an in-place no-op per weight bumps its version: re-quantized as after an update
            with torch.no_grad():
                for w in (wg, wu, wdd):
                    w.add_(0)
            return fwd_bwd()

        with torch.no_grad():
            t_f = bench_us(fwd)
        out[p] = (t_f, bench_us(fwd_bwd), bench_us(step))
        torch.cuda.empty_cache()
    return out


def run_shape(e, m, h, inter, skew, dev, gen, ours=True, profile_path=None, precisions=("bf16",)):
    counts = counts_for(m, e, skew, gen)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    dg = torch.Generator(device=dev).manual_seed(1000 * e + m + skew)  # not the default generator
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=dg).requires_grad_()
    w1 = (torch.randn(e, 2 * inter, h, device=dev, generator=dg) * h ** -0.5).bfloat16().requires_grad_()
    wd = (torch.randn(e, h, inter, device=dev, generator=dg) * inter ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=dg)
    fwd_flop, bwd_flop = 6 * m * h * inter, 12 * m * h * inter

    def fwd():
        return torch_mlp(x, offs, w1.transpose(1, 2), wd.transpose(1, 2), inter)

    def fwd_bwd():
        torch.autograd.backward(fwd(), dy)

    with torch.no_grad():
        t_f = bench_us(fwd)
    t_fb = bench_us(fwd_bwd)
    n = max(256, int(round(((fwd_flop + bwd_flop) / 2) ** (1 / 3) / 256)) * 256)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=dg)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=dg)
    t_d = bench_us(lambda: a @ b)
    tf = lambda flop, us: flop / us / 1e6
    row = dict(shape=f"E{e} M{m} H{h} I{inter}", routing="skew" if skew else "uniform",
               torch_fwd_us=t_f, torch_bwd_us=t_fb - t_f, torch_fwdbwd_us=t_fb,
               torch_fwd_tflops=tf(fwd_flop, t_f), torch_fwdbwd_tflops=tf(fwd_flop + bwd_flop, t_fb),
               dense_tflops=tf(2 * n ** 3, t_d))
    del a, b
    row["torch_pipe_fb_us"], row["torch_host_fb_us"] = pipelined_us(fwd_bwd)
    row["torch_graph_fb_us"] = graph_us(lambda: torch.autograd.grad(fwd(), (x, w1, wd), dy))
    if profile_path and not skew:
        profile_table(fwd_bwd, profile_path, f"torch fwd+bwd {row['shape']}")
    if ours:
        row.update(run_ours(e, m, h, inter, offs, x, w1, wd, dy, t_f, t_fb, row["torch_graph_fb_us"],
                            profile_path if not skew else None, row["shape"]))
        if tuple(precisions) != ("bf16",):
            row["precisions"] = run_precisions(inter, offs, x, w1, wd, dy, precisions)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_expert_mlp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the smallest shape")
    ap.add_argument("--shapes", type=str, default=None, help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--no-ours", action="store_true", help="torch baseline only")
    ap.add_argument("--profile", type=str, default=None, help="append torch.profiler kernel tables (uniform rows) here")
    ap.add_argument("--precision", default="bf16",
                    help="comma-separated precisions of ours to time (bf16, mxfp8, fp8_block; ratio to bf16)")
    args = ap.parse_args(argv)
    precisions = tuple(args.precision.split(","))
    if not set(precisions) <= {"bf16", "mxfp8", "fp8_block"}:
        ap.error(f"--precision: unknown precision in {args.precision!r}")
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    rows = []
    shapes = SHAPES[-1:] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    for shape in shapes:
        for skew in (False, True):
            rows.append(run_shape(*shape, skew, dev, gen, ours=not args.no_ours, profile_path=args.profile,
                                  precisions=precisions))
            r = rows[-1]
            print(f"[row] {r['shape']} {r['routing']}: torch f+b {r['torch_fwdbwd_us']:.0f} us, ours "
                  f"{r.get('ours_fwdbwd_us', float('nan')):.0f} us, graph torch {r['torch_graph_fb_us']:.0f} "
                  f"ours {r.get('ours_graph_fb_us', float('nan')):.0f}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"== bench_expert_mlp on {torch.cuda.get_device_name()} (torch {torch.__version__}) ==")
    print(f"{'shape':26s} {'routing':8s} {'impl':5s} {'fwd_us':>9s} {'bwd_us':>9s} {'f+b_us':>9s} {'fwd_TF':>7s} "
          f"{'f+b_TF':>7s} {'dense_TF':>8s} {'x_fwd':>6s} {'x_f+b':>6s} {'relL1':>8s} {'pipe_f+b':>9s} {'host_f+b':>9s} "
          f"{'graph_f+b':>9s} {'x_graph':>7s}")
    for r in rows:
        print(f"{r['shape']:26s} {r['routing']:8s} torch {r['torch_fwd_us']:9.0f} {r['torch_bwd_us']:9.0f} "
              f"{r['torch_fwdbwd_us']:9.0f} {r['torch_fwd_tflops']:7.0f} {r['torch_fwdbwd_tflops']:7.0f} {r['dense_tflops']:8.0f}"
              f" {'':6s} {'':6s} {'':8s} {r['torch_pipe_fb_us']:9.0f} {r['torch_host_fb_us']:9.0f}"
              f" {r['torch_graph_fb_us']:9.0f}")
        if "ours_fwd_us" in r:
            print(f"{'':26s} {'':8s} ours  {r['ours_fwd_us']:9.0f} {r['ours_bwd_us']:9.0f} {r['ours_fwdbwd_us']:9.0f} "
                  f"{r['ours_fwd_tflops']:7.0f} {r['ours_fwdbwd_tflops']:7.0f} {'':8s} {r['speedup_fwd']:6.2f} "
                  f"{r['speedup_fwdbwd']:6.2f} {r['rel_l1_vs_torch']:8.1e} {r['ours_pipe_fb_us']:9.0f} {r['ours_host_fb_us']:9.0f} "
                  f"{r['ours_graph_fb_us']:9.0f} {r['speedup_graph_fb']:7.2f}")
    prec_rows = [r for r in rows if "precisions" in r]
    if prec_rows:
        print("== ours by precision (mok_cute.ops.expert_mlp; x_* = time / ours-bf16 time) ==")
        print(f"{'shape':26s} {'routing':8s} {'prec':9s} {'fwd_us':>9s} {'f+b_us':>9s} {'f+b_wq_us':>9s} {'f+b_TF':>7s} "
              f"{'x_fwd':>6s} {'x_f+b':>6s} {'x_f+b_wq':>8s}")
        for r in prec_rows:
            e_, m_, h_, i_ = (int(v[1:]) for v in r["shape"].split())
            flop = 18 * m_ * h_ * i_
            base = r["precisions"]["bf16"]
            for p, (tf, tfb, twq) in r["precisions"].items():
                print(f"{r['shape']:26s} {r['routing']:8s} {p:9s} {tf:9.0f} {tfb:9.0f} {twq:9.0f} {flop / tfb / 1e6:7.0f} "
                      f"{tf / base[0]:6.2f} {tfb / base[1]:6.2f} {twq / base[2]:8.2f}")
    ours = [r for r in rows if "ours_fwd_us" in r]
    if ours:
        geo = lambda key: math.exp(sum(math.log(r[key]) for r in ours) / len(ours))
        print(f"geomean speedup torch/ours: fwd {geo('speedup_fwd'):.2f}x, fwd+bwd {geo('speedup_fwdbwd'):.2f}x; "
              f"min fwd+bwd {min(r['speedup_fwdbwd'] for r in ours):.2f}x; largest shape fwd+bwd "
              f"{ours[0]['ours_fwdbwd_tflops']:.0f} TF/s = {ours[0]['ours_fwdbwd_tflops'] / 788 * 100:.0f}% of 788")
        graphs = [r["speedup_graph_fb"] for r in ours if math.isfinite(r["speedup_graph_fb"])]
        if graphs:
            print(f"CUDA-graph replay f+b, torch/ours: geomean "
                  f"{math.exp(sum(math.log(v) for v in graphs) / len(graphs)):.2f}x, min {min(graphs):.2f}x "
                  f"({len(graphs)}/{len(ours)} rows captured)")
        from mok_cute.dsl import launch

        print(f"kernel launch paths: {launch.stats()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

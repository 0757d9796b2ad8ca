"""Layer benchmark on one GPU (EP = 1): the fused sm90 forward, the unfused sm90 path and the
torch layer a PyTorch user writes, side by side in one run.

    source .gpu-node/activate.sh && python3 tools/bench_layer.py [--quick] [--comm 2,8,16] [--minibatch 512,4096]
        [--band 4,16] [--mx] [--bwd 1,2]

torch layer: stable sort of the routes by expert, ``F.grouped_mm`` for gate/up (one [E, 2I, H]
weight), clamped SwiGLU, ``F.grouped_mm`` for down, fp32 ``index_add_`` of the weighted rows,
dense shared expert; autograd backward. Ours: ``mok_cute.moe`` (backend sm90, BF16,
validate_routing=False: no host sync) fused (the default; one row per ``comm_sms_fwd`` x
``minibatch_tokens``, the ring's size, plus rows at other R1 bands ``MOK_CUTE_RING_BAND`` for the
first of each) and
unfused (MOK_CUTE_FUSED=0, and the unfused backward, ``MOK_CUTE_FUSED_BWD=0``); the fused rows run the
library's default backward (``MOK_CUTE_FUSED_BWD`` unset: mode 2), the rows of ``--bwd`` modes that mode
(0 unfused, 1 the routed backward's GEMMs in one launch, 2 also the dx scatter and slot sum, 3 the whole
backward in one launch; ``--bwd-comm`` mode 3 at other ``comm_sms_bwd``; the MXFP8 rows run the fused
backward's MXFP8 variant, the default); "GEMM tiles alone": the
forward's grouped GEMM kernels on pre-gathered rows (its fwd+bwd: then the backward's GEMM kernels,
unfused, on its gu / h: a backward's "GEMM tiles alone" is that row's fwd+bwd minus its fwd). Times: the mean over back-to-back calls
(``bench_pipelined_us``: a training step's view, host work overlapped), measured in ``--rounds`` rounds
that visit every row in turn (clock and thermal drift hit all rows alike), the median round
reported (``[power]``: the SM clock and power nvidia-smi sampled meanwhile: the H200 reaches its
700 W cap there), and, last columns, the
median of calls each followed by a sync (``bench_us``: host time of a call exposed); TFLOP/s
by MoK's count 6 (T + T k) H I forward (the shared expert has width I), twice that backward;
fwd+bwd: each backward starts from ``.grad = None`` (``zero_grad(set_to_none=True)``, as a training
step: no gradient-accumulation kernel in any row); peak MB: the memory one forward + backward allocates above what was allocated before it;
MB held: what the forward leaves allocated for the backward (y included), the memory a stack of layers holds per layer
(``--recompute`` adds rows with ``MoKConfig(activations="recompute")``).
The table prints last.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks.common import PowerSampler, bench_pipelined_us, bench_us  # noqa: E402
from checks.layer_sm90 import _problem  # noqa: E402

SHAPES = [  # (T, H, I, E, k, skewed)
    (4096, 7168, 2048, 16, 8, False),
    (8192, 4096, 1024, 32, 10, False),
    (4096, 4096, 1024, 32, 10, True),
    (2048, 7168, 2048, 16, 8, False),
    (16384, 7168, 2048, 16, 8, False),
]


def tile_operands(x, idx, ws, sh):
    """The grouped GEMMs' operands, prepared outside any timing: ``(rows, offsets, wr, sh_w, sh_offs)``, x's
    routed rows gathered in expert order [T*k, H] with their group offsets [E+1], the routed weights, the shared
    expert's weights as one group and its offsets [0, T] (all detached)."""
    from mok_cute.layers.grouped import route_sort

    t, k = idx.shape
    order, offsets, _ = route_sort(idx, ws[0].shape[0])
    rows = x.detach()[order // k].contiguous()
    sh_offs = torch.tensor([0, t], dtype=torch.int32, device=x.device)
    return rows, offsets, tuple(w.detach() for w in ws), tuple(w.detach()[None] for w in sh), sh_offs


def gemms_alone(x, idx, ws, sh):
    """The forward's GEMM tiles alone, on inputs prepared outside the timing: the routed GEMM1 +
    SwiGLU and GEMM2 grouped kernels over pre-gathered rows, and the shared expert's two (the
    fused forward's work without the gather, the scatter and the slot sum)."""
    from mok_cute.kernels.sm90 import grouped_gemm as g

    t = idx.shape[0]
    rows, offsets, wr, sh_w, sh_offs = tile_operands(x, idx, ws, sh)

    def fn():
        h = g._run_gemm1_swiglu(rows, offsets, wr[0], wr[1], None)[1]
        g._run_gemm(h, offsets, wr[2])
        hs = g._run_gemm1_swiglu(x, sh_offs, sh_w[0], sh_w[1], None)[1]
        return g._run_gemm(hs, sh_offs, sh_w[2])

    gu, h = g._run_gemm1_swiglu(rows, offsets, wr[0], wr[1], None)
    gus, hs = g._run_gemm1_swiglu(x, sh_offs, sh_w[0], sh_w[1], None)
    dy = torch.randn_like(rows)

    def bwd():
        """The backward's GEMM tiles alone (the unfused kernels, routed then shared): dgrad2 + dSwiGLU,
        dgrad1 and three weight gradients each, on the forward tiles' gu / h and a random dy."""
        from mok_cute.kernels.sm90 import expert_bwd as b
        from mok_cute.layers.common import ExpertGroup, mlp_backward

        mlp_backward(b._run_dswiglu_dgrad, b._run_dgrad1, b._run_wgrad, ExpertGroup(rows, offsets, gu, h, "bf16"), dy,
                     *wr, None)
        mlp_backward(b._run_dswiglu_dgrad, b._run_dgrad1, b._run_wgrad, ExpertGroup(x, sh_offs, gus, hs, "bf16"),
                     dy[:t], *sh_w, None)

    fn.backward_tiles = bwd
    return fn


def torch_layer(x, idx, topk_w, w1, wd, shared, limit):
    """The twenty-line torch MoE layer (see the module doc); w1 [E, 2I, H] = [gate; up]."""
    t, k = idx.shape
    e, inter = w1.shape[0], w1.shape[1] // 2
    flat = idx.reshape(-1)
    key = torch.where(flat >= 0, flat, e)
    order = torch.argsort(key, stable=True)
    offs = torch.cumsum(torch.bincount(key, minlength=e + 1)[:e], 0).to(torch.int32)
    gu = F.grouped_mm(x[order // k], w1.transpose(1, 2), offs=offs)
    g, u = gu[:, :inter], gu[:, inter:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    r = F.grouped_mm(F.silu(g) * u, wd.transpose(1, 2), offs=offs)
    valid = (key[order] < e)[:, None]
    rows = torch.where(valid, r.float() * topk_w.reshape(-1)[order][:, None], 0.0)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, order // k, rows)
    if shared is not None:
        sg, su, sd = shared
        y = y + (F.silu(x @ sg.t()) * (x @ su.t()) @ sd.t()).float()
    return y.bfloat16()


def _ours(fused: bool, comm: int, precision: str = "bf16", minibatch: int | None = None, band: int | None = None,
          bwd: str | None = None, activations: str = "save", bwd_comm: int | None = None, gather: str | None = None,
          gather_mx: str | None = None):
    import mok_cute

    mb = {} if minibatch is None else {"minibatch_tokens": minibatch}
    if bwd_comm is not None:
        mb["comm_sms_bwd"] = bwd_comm
    cfg = mok_cute.MoKConfig(backend="sm90", comm_sms_fwd=comm, validate_routing=False, precision=precision,
                             activations=activations, **mb)

    def fn(x, idx, w, ws, sh):
        os.environ["MOK_CUTE_FUSED"] = "1" if fused else "0"
        if bwd is None:  # the library's default backward
            os.environ.pop("MOK_CUTE_FUSED_BWD", None)
        else:
            os.environ["MOK_CUTE_FUSED_BWD"] = bwd
        for var, mode in (("MOK_CUTE_GATHER", gather), ("MOK_CUTE_GATHER_MX", gather_mx)):
            if mode is None:  # the library's default gather
                os.environ.pop(var, None)
            else:
                os.environ[var] = mode
        if band is None:
            os.environ.pop("MOK_CUTE_RING_BAND", None)
        else:
            os.environ["MOK_CUTE_RING_BAND"] = str(band)
        return mok_cute.moe(x, idx, w, *ws, shared=sh, config=cfg)
    return fn


def traced(fn, path: str) -> dict:
    """One fused forward with MOK_CUTE_TRACE=1: the trace written to ``path``, its summary (with ``kind_stats``)."""
    import trace_view
    from mok_cute.kernels.sm90 import fused_moe as fused

    os.environ["MOK_CUTE_TRACE"] = "1"
    try:
        with torch.no_grad():
            fn()
            torch.cuda.synchronize()
    finally:
        del os.environ["MOK_CUTE_TRACE"]
    records, comm = fused.last_trace()
    trace_view.dump(path, records, comm, fused.KINDS)
    loaded = trace_view.load(path)
    return trace_view.summary(*loaded) | {"kind_stats": trace_view.format_kind_stats(trace_view.kind_stats(
        loaded[0], loaded[1], loaded[3]))}


def traced_bwd(fn, dy, path: str) -> dict:
    """One forward + fused backward with MOK_CUTE_TRACE=1 in the backward only: its trace written
    to ``path``, its summary."""
    import trace_view
    from mok_cute.kernels.sm90 import fused_bwd

    y = fn()
    torch.cuda.synchronize()
    os.environ["MOK_CUTE_TRACE"] = "1"
    try:
        torch.autograd.backward(y, dy)
        torch.cuda.synchronize()
    finally:
        del os.environ["MOK_CUTE_TRACE"]
    records, comm = fused_bwd.last_trace()
    trace_view.dump(path, records, comm, fused_bwd.KINDS, fused_bwd.GEMM_KINDS)
    return trace_view.summary(*trace_view.load(path))


def run_shape(t, h, inter, e, k, skew, comms, dev, trace=None, mx=False, minibatches=(None,), bands=(), refs=True,
              bwds=(), recompute=False, trace_bwd=None, bwd_comms=(), tiles=False, rounds=3, gathers=()):
    x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, skew, dev, seed=11)
    w1 = torch.cat(ws[:2], 1).detach()
    leaves = [x, w, *ws, *sh, w1]
    for p in leaves:
        p.requires_grad_()
    flop = 6 * (t + t * k) * h * inter
    impls = {"torch": lambda: torch_layer(x, idx, w, w1, ws[2], sh, None)}
    if refs:
        impls["unfused"] = lambda: _ours(False, 8, bwd="0")(x, idx, w, ws, sh)
    if refs or tiles:
        impls["GEMM tiles alone"] = gemms_alone(x, idx, ws, sh)
    mb0 = minibatches[0]
    for c in comms:
        for m in minibatches:
            impls[f"fused c{c}{'' if m is None else f' m{m}'}"] = (
                lambda c=c, m=m: _ours(True, c, minibatch=m)(x, idx, w, ws, sh))
    for g in gathers:  # the forward's other gathers (MOK_CUTE_GATHER): the measured choice
        for c in comms:
            impls[f"fused c{c} gather {g}"] = lambda c=c, g=g: _ours(True, c, minibatch=mb0, gather=g)(x, idx, w, ws, sh)
    for b in bands:
        impls[f"fused c{comms[0]}{'' if mb0 is None else f' m{mb0}'} band{b}"] = (
            lambda b=b: _ours(True, comms[0], minibatch=mb0, band=b)(x, idx, w, ws, sh))
    for b in bwds:  # the fused backward (MOK_CUTE_FUSED_BWD), after the fused forward at the first comm value
        impls[f"fused c{comms[0]} bwd{b}"] = lambda b=b: _ours(True, comms[0], minibatch=mb0, bwd=b)(x, idx, w, ws, sh)
    for cb in bwd_comms:  # mode 3 at other comm_sms_bwd values (its gather CTAs)
        impls[f"fused c{comms[0]} bwd3 cb{cb}"] = lambda cb=cb: _ours(True, comms[0], minibatch=mb0, bwd="3",
                                                                      bwd_comm=cb)(x, idx, w, ws, sh)
    if recompute:  # MoKConfig(activations="recompute"), after the fused forward at the first comm value
        for b in bwds or ("2",):
            impls[f"fused c{comms[0]} bwd{b} recompute"] = lambda b=b: _ours(
                True, comms[0], minibatch=mb0, bwd=b, activations="recompute")(x, idx, w, ws, sh)
    if mx:  # MXFP8 (the reference's numerics), fused at the first comm and minibatch values, and unfused
        impls[f"fused mxfp8 c{comms[0]}{'' if mb0 is None else f' m{mb0}'}"] = (
            lambda: _ours(True, comms[0], "mxfp8", minibatch=mb0)(x, idx, w, ws, sh))
        for g in gathers:  # the MXFP8 rows' other gathers (MOK_CUTE_GATHER_MX=regs / direct; the default is bg)
            if g in ("regs", "direct"):
                impls[f"fused mxfp8 c{comms[0]} gather {g}"] = lambda g=g: _ours(True, comms[0], "mxfp8", minibatch=mb0,
                                                                                 gather_mx=g)(x, idx, w, ws, sh)
        if "0" in bwds:  # the same with the unfused MXFP8 backward
            impls[f"fused mxfp8 c{comms[0]} bwd0"] = lambda: _ours(True, comms[0], "mxfp8", minibatch=mb0,
                                                                   bwd="0")(x, idx, w, ws, sh)
        if refs:
            impls["unfused mxfp8"] = lambda: _ours(False, 8, "mxfp8", bwd="0")(x, idx, w, ws, sh)
    out, steps = {}, {}
    for name, fn in impls.items():  # warm-up, synced time and memory, once per row
        with torch.no_grad():
            t_sync = bench_us(fn, warmup=3, iters=10)

        def step(fn=fn):  # a training step's view: zero_grad(set_to_none=True), no accumulation kernel
            for p in leaves:
                p.grad = None
            torch.autograd.backward(fn(), dy)
        if name == "GEMM tiles alone":  # fwd+bwd: the forward's tiles then the backward's (unfused kernels)
            steps[name] = lambda fn=fn: (fn(), fn.backward_tiles())
        else:
            steps[name] = step
        steps[name]()
        peak = held = float("nan")
        if name != "GEMM tiles alone":  # one forward + backward from a clean peak counter
            for p in leaves:
                p.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = fn()
            torch.cuda.synchronize()
            held = (torch.cuda.memory_allocated() - base) / 2 ** 20  # what the forward keeps for the backward, y too
            torch.autograd.backward(y, dy)
            del y
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        out[name] = [[], [], t_sync, peak, held]
        for p in leaves:
            p.grad = None
    from mok_cute.dsl import launch

    captures = 0  # kernel graphs captured inside the timed calls (each row's warm-up captures its own)

    def timed(f, iters):
        nonlocal captures
        for _ in range(2):  # warm-up: the row's allocations, hence its cached kernel graphs, come back
            f()
        c0 = launch._stats["capture"]
        us = bench_pipelined_us(f, warmup=0, iters=iters)
        captures += launch._stats["capture"] - c0
        return us
    with PowerSampler() as power:
        for _ in range(rounds):  # the rows interleaved, round after round: drift hits every row alike
            for name, fn in impls.items():
                with torch.no_grad():
                    out[name][0].append(timed(fn, 10))
                out[name][1].append(timed(steps[name], 5))
                for p in leaves:
                    p.grad = None
    print(f"[power] T{t} H{h} timed rounds: {power.summary()}", flush=True)
    print(f"[launch] T{t} H{h}: {captures} kernel graphs captured inside the timed calls; "
          f"per row and round fwd us {[[round(v) for v in row[0]] for row in out.values()]}, "
          f"fwd+bwd us {[[round(v) for v in row[1]] for row in out.values()]}", flush=True)
    for row in out.values():  # the median round
        row[0], row[1] = (sorted(v)[len(v) // 2] for v in row[:2])
    os.environ.pop("MOK_CUTE_FUSED", None)
    os.environ.pop("MOK_CUTE_FUSED_BWD", None)
    os.environ.pop("MOK_CUTE_RING_BAND", None)
    os.environ.pop("MOK_CUTE_GATHER", None)
    if trace:  # the default gather, then each other --gather
        for g in (None, *gathers):
            path = trace if g is None else trace.replace(".json", f"_{g}.json")
            s = traced(lambda g=g: _ours(True, comms[-1], minibatch=mb0, gather=g)(x, idx, w, ws, sh), path)
            os.environ.pop("MOK_CUTE_GATHER", None)
            per = {kd: f"{s['busy_us'][kd]:.0f} us / {n} = {s['busy_us'][kd] / n:.1f}" for kd, n in s["tasks"].items()}
            print(f"[trace] c{comms[-1]} gather {g or 'default'} {path}: span {s['span_us']:.0f} us, scheduler share "
                  f"{100 * s['scheduler_share']:.2f}% of GEMM-CTA time, per kind busy / tasks = us per task: {per}",
                  flush=True)
            print(f"[trace] per kind n p10/p50/p90/max us, CTA-time, same-kind gap: {s['kind_stats']}", flush=True)
    if trace_bwd:
        for b in bwds or ("3",):
            path = trace_bwd.replace(".json", f"_bwd{b}.json")
            s = traced_bwd(lambda: _ours(True, comms[0], minibatch=mb0, bwd=b)(x, idx, w, ws, sh), dy, path)
            per = {kd: f"{s['busy_us'][kd]:.0f} us / {n} = {s['busy_us'][kd] / n:.1f}" for kd, n in s["tasks"].items()}
            print(f"[trace bwd{b}] {path}: span {s['span_us']:.0f} us (first task {s.get('before_first_task_us', 0):.0f} us "
                  f"after the first CTA's entry, last CTA exit {s.get('after_last_task_us', 0):.0f} us after the last "
                  f"task), scheduler share "
                  f"{100 * s['scheduler_share']:.2f}%, per kind busy / tasks = us per task: {per}", flush=True)
    label = f"T{t} H{h} I{inter} E{e} k{k}{' skew' if skew else ''} +shared"
    lines = []
    tf_f, tf_b, tf_s = out["torch"][:3]
    for name, (t_f, t_fb, t_s, peak, held) in out.items():
        lines.append(f"| {label} | {name} | {t_f:.0f} | {tf_f / t_f:.2f}x | {flop / t_f / 1e6:.0f} | {t_fb:.0f} | "
                     f"{tf_b / t_fb:.2f}x | {3 * flop / t_fb / 1e6:.0f} | {t_s:.0f} | {tf_s / t_s:.2f}x | {peak:.0f} | "
                     f"{held:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first shape")
    ap.add_argument("--shapes", default=None, help="indices into SHAPES to run (default: all)")
    ap.add_argument("--no-ref", action="store_true", help="skip the unfused and GEMM-tiles-alone rows")
    ap.add_argument("--tiles", action="store_true", help="the GEMM-tiles-alone row even with --no-ref")
    ap.add_argument("--comm", default="2,8,16", help="comm_sms_fwd values of the fused rows")
    ap.add_argument("--trace", default=None, help="write a trace of the first shape's fused forward here")
    ap.add_argument("--trace-bwd", default=None,
                    help="write traces of the first shape's fused backward per --bwd mode here (NAME.json -> NAME_bwdN.json)")
    ap.add_argument("--bwd-comm", default="", help="extra fused rows of MOK_CUTE_FUSED_BWD=3 at these comm_sms_bwd values")
    ap.add_argument("--mx", action="store_true", help="add MXFP8 rows (fused at the first --comm value, unfused)")
    ap.add_argument("--minibatch", default=None, help="minibatch_tokens values of the fused rows (default: the config's)")
    ap.add_argument("--band", default="", help="extra fused rows at these MOK_CUTE_RING_BAND values")
    ap.add_argument("--bwd", default="", help="extra fused rows at these MOK_CUTE_FUSED_BWD modes (1, 2, 3)")
    ap.add_argument("--recompute", action="store_true",
                    help="extra rows with MoKConfig(activations='recompute') (per --bwd mode)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timing rounds over all rows, interleaved; each row's median round is reported")
    ap.add_argument("--gather", default="",
                    help="extra fused rows per --comm value at these MOK_CUTE_GATHER modes (bg, staged, regs, direct); "
                         "with --mx, regs / direct also add the MXFP8 row with that MOK_CUTE_GATHER_MX")
    args = ap.parse_args()
    dev = torch.device("cuda")
    comms = [int(c) for c in args.comm.split(",")]
    lines = []
    picked = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        picked = [SHAPES[int(i)] for i in args.shapes.split(",")]
    for i, shape in enumerate(picked):
        lines += run_shape(*shape, comms, dev, trace=args.trace if i == 0 else None, mx=args.mx,
                           minibatches=[int(m) for m in args.minibatch.split(",")] if args.minibatch else [None],
                           bands=[int(b) for b in args.band.split(",") if b], refs=not args.no_ref,
                           bwds=[b.strip() for b in args.bwd.split(",") if b.strip()], recompute=args.recompute,
                           trace_bwd=args.trace_bwd if i == 0 else None, gathers=[g for g in args.gather.split(",") if g],
                           bwd_comms=[int(c) for c in args.bwd_comm.split(",") if c], tiles=args.tiles,
                           rounds=args.rounds)
        torch.cuda.empty_cache()
    print(f"\n== bench_layer on {torch.cuda.get_device_name(dev)} (EP = 1, BF16) ==")
    print("| shape | impl | fwd us | fwd vs torch | fwd TF/s | fwd+bwd us | f+b vs torch | f+b TF/s | "
          "fwd us synced | synced vs torch | peak MB fwd+bwd | MB held fwd->bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one forward (``--bwd``: forward + backward) of the layer spends its time on the GPU (one GPU, EP = 1): a
torch.profiler kernel table of ``--calls`` calls (CUDA time per kernel name, per call), the GPU time between
kernels (idle), the host time per call (pipelined calls, one sync at the end) and mok_cute's launches per call
by path (graph replays, captures of new argument sets, DSL calls); ``--graph``: the wall time per replay of one
forward captured in a CUDA graph; ``--tasks``: one traced call more, then each fused kernel's tasks by kind
(count, p10 / p50 / p90 / max us, CTA time: :func:`mok_cute.trace.kind_stats`).

    python -m tools.profile_fwd [--shape NAME | T,H,I,E,k] [--precision bf16] [--comm 16]
        [--forward-path fused|unfused] [--backward-path fused|fused_whole|unfused] [--bwd]
        [--graph] [--host] [--timeline] [--tasks] [--who TEXT] [--config FIELD=VALUE ...]

``--shape``: as ``python -m tools.mem_peak`` (default 4096,7168,2048,16,8). ``--config``: further MoKConfig
fields, as the benchmark's (e.g. ``--config 'policy={"fused_backward": {"tile_n": 128, "stages": 3}}'``).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from mok_cute.bench.cli import parse_config
from mok_cute.config import BackwardPath, ForwardPath
from mok_cute.dsl.launch import stats as launch_stats
from tools.mem_peak import parse_shape


def add_layer_options(ap: argparse.ArgumentParser, shape: str) -> None:
    """The layer call's options (shared with ``tools.ncu_step``): ``--shape`` (default ``shape``), ``--precision``,
    ``--bwd``, ``--comm``, ``--forward-path``, ``--backward-path`` (:func:`layer_fields` turns them into MoKConfig
    fields)."""
    ap.add_argument("--shape", type=parse_shape, default=parse_shape(shape))
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--bwd", action="store_true", help="forward + backward steps (grads set to None first)")
    ap.add_argument("--comm", type=int, default=None, help="MoKConfig.comm_sms_fwd (default: the config's)")
    ap.add_argument("--forward-path", choices=[p.value for p in ForwardPath], default=None)
    ap.add_argument("--backward-path", choices=[p.value for p in BackwardPath], default=None)


def layer_fields(args) -> dict:
    """The MoKConfig fields of :func:`add_layer_options`' options that were given, and ``--config``'s."""
    fields = {k: v for k, v in (("comm_sms_fwd", args.comm), ("forward_path", args.forward_path),
                                ("backward_path", args.backward_path)) if v is not None}
    return {**fields, **args.config}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tools.profile_fwd", description=__doc__.split("\n\n")[0])
    add_layer_options(ap, "4096,7168,2048,16,8")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--graph", action="store_true", help="also time 20 replays of one forward captured in a CUDA graph")
    ap.add_argument("--syncs", action="store_true",
                    help="also, with validate_routing off and on: the synchronizing calls of one call (torch's sync "
                         "debug mode) and ms per call over 10 calls by CUDA events")
    ap.add_argument("--host", action="store_true",
                    help="also profile the host: CUDA API calls by total time, and the GPU gap between calls")
    ap.add_argument("--timeline", action="store_true",
                    help="print the last profiled call's GPU events in order: start, duration, gap before each")
    ap.add_argument("--tasks", action="store_true",
                    help="one traced call more: the fused kernels' task durations by kind (mok_cute.trace)")
    ap.add_argument("--who", default="", help="print the Python stack (mok_cute frames) of the ops launching "
                                              "kernels whose name contains this text")
    return parse_with_config(ap, argv)


def parse_with_config(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``ap``'s arguments with a repeatable ``--config FIELD=VALUE`` option added (further MoKConfig fields,
    values as ``python -m mok_cute.bench --config``; those in :data:`OWN` are the tool's), ``config`` a dict."""
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further MoKConfig field (repeatable; values as python -m mok_cute.bench --config)")
    args = ap.parse_args(argv)
    try:
        args.config = parse_config(args.config, OWN)
    except ValueError as e:
        ap.error(str(e))
    return args


OWN = {"precision": "--precision", "validate_routing": "this tool (off: no host sync)", "comm_sms_fwd": "--comm",
       "forward_path": "--forward-path", "backward_path": "--backward-path"}  # set by the tool, not by --config


def host_table(prof, evs, calls: int) -> None:
    """Host CUDA API calls by total time, and the GPU gap before each call's routing plan."""
    api = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith(("cuda", "cu")):
            api[ev.name][0] += 1
            api[ev.name][1] += ev.cpu_time_total
    print("| host API call | per call | us per call |\n|---|---|---|")
    for name, (n, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"| {name[:60]} | {n / calls:.1f} | {us / calls:.1f} |")
    gaps, end = [], None
    for ev in sorted(evs, key=lambda ev: ev.time_range.start):
        if PLAN_KERNEL in ev.name and end is not None:
            gaps.append(ev.time_range.start - end)
        end = ev.time_range.end if end is None else max(end, ev.time_range.end)
    print(f"GPU gap before each call's plan (us): {[round(g) for g in gaps]}")


PLAN_KERNEL = "count_kernel"  # the routing plan's first kernel: the first GPU event of every layer call


def call_stats(spans: list[tuple[str, float, float]], calls: int) -> dict:
    """Per-call GPU figures of ``calls`` profiled calls from their events ``(name, start us, end us)``: ``span``
    (first start to last end), ``busy`` (the events' durations), ``idle`` (span - busy) and ``events``, each per
    call. Where the routing plan's kernel (:data:`PLAN_KERNEL`) marks two or more calls, the first call is left
    out (the profiler's start-up stretches it: hundreds of microseconds between its kernels that no later call
    has), and ``calls_counted`` says over how many calls the figures are."""
    spans = sorted(spans, key=lambda e: e[1])
    starts = [a for name, a, _ in spans if PLAN_KERNEL in name]
    counted = calls
    if len(starts) >= 2:
        spans = [e for e in spans if e[1] >= starts[1]]
        counted = len(starts) - 1
    busy = sum(b - a for _, a, b in spans)
    whole = max(b for _, _, b in spans) - spans[0][1]
    return {"span": whole / counted, "busy": busy / counted, "idle": (whole - busy) / counted,
            "events": len(spans) / counted, "calls_counted": counted}


def timeline_table(evs, calls: int) -> None:
    """The last call's GPU events (its plan kernel starts it): start, duration, gap before each."""
    last = sorted(evs, key=lambda ev: ev.time_range.start)[-len(evs) // calls:]
    prev = last[0].time_range.start
    print("| event | start us | duration us | gap before us |\n|---|---|---|---|")
    for ev in last:
        print(f"| {ev.name[:60]} | {ev.time_range.start - last[0].time_range.start:.1f} | {ev.device_time:.1f} | "
              f"{ev.time_range.start - prev:.1f} |")
        prev = max(prev, ev.time_range.end)


def task_lines(traces: dict) -> list[str]:
    """One line per traced pass (``traces``: pass name -> :class:`mok_cute.trace.Trace` or None): its span and
    its tasks by kind (:func:`mok_cute.trace.kind_stats`)."""
    from mok_cute import trace

    out = []
    for name, t in traces.items():
        if t is None:
            out.append(f"{name}: no fused launch traced")
            continue
        recs = trace.normalize(t.records.cpu().tolist())
        span = trace.summary(recs, t.kinds, t.comm_ctas, t.gemm_kinds)["span_us"]
        out.append(f"{name} tasks (span {span:.0f} us): "
                   + trace.format_kind_stats(trace.kind_stats(recs, t.kinds, t.gemm_kinds)))
    return out


def launch_line(before: dict[str, int], after: dict[str, int], calls: int) -> str:
    """Per call, the mok_cute launches between two :func:`launch_stats`: CUDA-graph replays, captures (an argument
    set seen for the first time: a stream capture and a graph instantiation on the host) and DSL launches."""
    per = {k: (after[k] - before[k]) / calls for k in after}
    return (f"mok_cute launches per call: {per['graph']:.1f} graph replays, {per['capture']:.1f} captures (new "
            f"argument sets), {per['dsl']:.1f} DSL calls")


def layer_step(s, precision: str, bwd: bool, config: dict):
    """A callable running one layer call of shape ``s`` on the GPU (the benchmark's inputs, seed 11;
    ``MoKConfig(precision=..., validate_routing=False, **config)``, or the MoKConfig ``step(cfg)`` is given):
    its forward, or (``bwd``) forward and backward with the leaves' gradients set to None first. Returns
    ``(step, cfg)``."""
    import mok_cute
    from mok_cute.bench.shapes import make_inputs

    inputs, dy = make_inputs(s, torch.device("cuda"), seed=11)
    shared = inputs.pop("shared")
    base = mok_cute.MoKConfig(precision=precision, validate_routing=False, **config)
    leaves = [inputs[n].requires_grad_() for n in ("x", "topk_w", "w_gate", "w_up", "w_down")] if bwd else []
    leaves += [w.requires_grad_() for w in shared or ()] if bwd else []

    def step(cfg=None):
        call = lambda: mok_cute.moe(**inputs, shared=shared, swiglu_limit=s.limit, config=cfg or base)  # noqa: E731
        if not bwd:
            return call()
        for p in leaves:
            p.grad = None
        with torch.enable_grad():
            call().backward(dy)
    return step, base


def synchronizing_calls(step) -> list[str]:
    """``file:line message`` of each synchronizing CUDA call torch's sync debug mode reports during ``step()``."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno} {str(w.message).splitlines()[0][:80]}" for w in caught
            if "synchroniz" in str(w.message)]


def sync_lines(step, cfg) -> list[str]:
    """For ``validate_routing`` False and True: one call's synchronizing calls, then ms per call over 10 calls
    (CUDA events) and the host's enqueue ms per call."""
    from dataclasses import replace

    out = []
    for v in (False, True):
        c = replace(cfg, validate_routing=v)
        for _ in range(3):
            step(c)
        torch.cuda.synchronize()
        found = synchronizing_calls(lambda: step(c))  # noqa: B023
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(10):
            step(c)
        host = (time.perf_counter() - t0) / 10 * 1e3
        end.record()
        end.synchronize()
        out.append(f"validate_routing={v}: {start.elapsed_time(end) / 10:.3f} ms per call (events), host "
                   f"{host:.3f} ms; {len(found)} synchronizing call(s){': ' if found else ''}{'; '.join(found)}")
    return out


def main(argv: list[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile

    args = parse_args(argv)
    s = args.shape
    fwd, cfg = layer_step(s, args.precision, args.bwd, layer_fields(args))
    with torch.no_grad():
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
        before = launch_stats()
        t0 = time.perf_counter()
        for _ in range(20):
            fwd()
        host = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20 * 1e6
        launches = launch_line(before, launch_stats(), 20)
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host or args.who else [])
        with profile(activities=acts, with_stack=bool(args.who)) as prof:
            for _ in range(args.calls):
                fwd()
            torch.cuda.synchronize()
    if args.graph:  # the same forward with the host and the stream gaps between its kernels taken out
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            fwd()
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        print(f"CUDA graph replay: wall per call {(time.perf_counter() - t0) / 20 * 1e6:.0f} us")
    evs = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for ev in evs:
        by_name[ev.name][0] += 1
        by_name[ev.name][1] += ev.device_time
    st = call_stats([(ev.name, ev.time_range.start, ev.time_range.end) for ev in evs], args.calls)
    print(f"{s.dims} {args.precision}: host time per call {host:.0f} us (enqueue, pipelined); wall per call {wall:.0f} us")
    print(launches)
    print(f"GPU per call (the last {st['calls_counted']} of {args.calls} profiled calls): span {st['span']:.0f} us, "
          f"kernels {st['busy']:.0f} us, idle between kernels {st['idle']:.0f} us, {st['events']:.0f} kernels")
    if args.host:
        host_table(prof, evs, args.calls)
    if args.timeline:
        timeline_table(evs, args.calls)
    if args.who:  # the innermost CPU ops whose kernels match, with their mok_cute frames
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CPU and any(args.who in k.name for k in ev.kernels):
                frames = [f for f in ev.stack if "mok_cute" in f or "tools/" in f][:6]
                print(f"{ev.name}: {[k.name[:50] for k in ev.kernels][:2]} <- {frames}")
    print("| kernel | per call | us per call |\n|---|---|---|")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {name[:90]} | {n / args.calls:.0f} | {us / args.calls:.1f} |")
    if args.syncs:
        print(*sync_lines(fwd, cfg), sep="\n")
    if args.tasks:
        from dataclasses import replace

        from mok_cute import trace

        fwd(replace(cfg, trace=True))
        torch.cuda.synchronize()
        passes = ("forward", "backward") if args.bwd else ("forward",)
        print(*task_lines({p: trace.last(p) for p in passes}), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

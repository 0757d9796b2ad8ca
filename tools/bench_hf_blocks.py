"""One MoE block of each Hugging Face family mok_cute.integrations.transformers covers, forward + backward,
on transformers' ``grouped_mm`` experts backend and on mok_cute, side by side in one process.

    python -m tools.bench_hf_blocks                      # every family of FAMILIES, T = 8192, on the GPU
    python -m tools.bench_hf_blocks --models qwen3_moe mixtral --iters 20 --json out.json
    python -m tools.bench_hf_blocks --tiny               # CPU smoke test: hf_tiny's dims, mok_cute's reference backend

The block: the family's sparse MoE module of one decoder layer (router, experts, the shared expert of qwen2_moe /
deepseek_v3) at its published config's dimensions (:data:`FAMILIES`), N(0, initializer_range) weights, bf16,
training mode; both backends run the same block (``config._experts_implementation`` switched) on the same x
[1, T, H], hence the same routing. DeepSeek-V3 runs as one rank of EP = 8: 32 of its 256 experts, top-8 (each
expert gets the T * k / 32 rows of a balanced EP = 8 rank of T tokens); --deepseek-experts 256 runs all of them.

Measured per backend: a step = forward + ``out.backward(dy)`` (dy fixed), its gradients freed after it; --warmup
steps (kernel compilation there), then --iters steps, each between CUDA events (perf_counter on CPU): the median
ms; speedup = grouped_mm ms / mok_cute ms; peak MiB = max_memory_allocated over the timed steps minus
memory_allocated before the backend's first step (activations, gradients, workspaces, caches it keeps).
Sanity: max|a - b| / max|b| of the output and of dx, a = mok_cute, b = grouped_mm. --tiny: 1 step, no warmup.
What cannot run (transformers lacks the family, OOM, a refusal) gets its reason in the row. --json PATH:
{"meta": {device, date, command, torch, transformers, tokens, warmup, iters, tiny}, "rows": [{FIELDS}]} (None
where not measured). Quote figures with the card, the date and the command line (all in "meta").
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import statistics
import sys
import time

import torch

from tools import hf_tiny

# model type -> (its MoE block class in transformers.models.<type>.modeling_<type>, published dims, model)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True), "Qwen3-30B-A3B"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60,
                  num_experts_per_tok=4, shared_expert_intermediate_size=5632, norm_topk_prob=False),
                  "Qwen1.5-MoE-A2.7B"),
    "mixtral": ("MixtralSparseMoeBlock", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                num_experts_per_tok=2), "Mixtral-8x7B"),
    "deepseek_v3": ("DeepseekV3MoE", dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=32,
                    num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    norm_topk_prob=True), "DeepSeek-V3, one rank of EP=8 (32 of 256 experts)"),
    "olmoe": ("OlmoeSparseMoeBlock", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
              num_experts_per_tok=8, norm_topk_prob=False), "OLMoE-1B-7B"),
    "gpt_oss": ("GptOssMLP", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                swiglu_limit=7.0), "gpt-oss-20b (biases, clamped SwiGLU)"),
}
BACKENDS = ("grouped_mm", "mok_cute")
FIELDS = ("model", "block", "note", "shape", "tokens", "hidden", "intermediate", "experts", "top_k",
          "shared_intermediate", "grouped_mm_ms", "mok_cute_ms", "speedup", "grouped_mm_host_ms", "mok_cute_host_ms",
          "grouped_mm_peak_mib",
          "mok_cute_peak_mib", "rel_err_out", "rel_err_dx", "error")
COLUMNS = {"grouped_mm_ms": ".2f", "mok_cute_ms": ".2f", "speedup": ".2f", "grouped_mm_host_ms": ".2f",
           "mok_cute_host_ms": ".2f", "grouped_mm_peak_mib": ".0f",
           "mok_cute_peak_mib": ".0f", "rel_err_out": ".1e", "rel_err_dx": ".1e"}  # the table's, after model, shape


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(FAMILIES), help=f"families (default all: {' '.join(FAMILIES)})")
    p.add_argument("--tokens", type=int, help="tokens T (default 8192; 256 with --tiny)")
    p.add_argument("--iters", type=int, help="timed steps per backend (default 10; 1 with --tiny)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3; 0 with --tiny)")
    p.add_argument("--deepseek-experts", type=int, default=32, help="DeepSeek-V3's experts (default 32: EP=8's slice)")
    p.add_argument("--json", metavar="PATH", help="write meta and rows to PATH")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timing, print each backend's N heaviest CUDA kernels per step (torch.profiler, "
                        "2 steps) and its GPU-busy ms per step (default 0: no profile)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="after the timing, print the N Python functions with the most own host time over 5 mok_cute "
                        "steps (cProfile; default 0: none)")
    p.add_argument("--tiny", action="store_true", help="tools/hf_tiny's dims, mok_cute's reference backend, 1 step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.models = [m for arg in args.models for m in arg.split(",") if m]
    if unknown := sorted(set(args.models) - set(FAMILIES)):
        p.error(f"unknown models {unknown}; choose from {list(FAMILIES)}")
    args.tokens = args.tokens or (256 if args.tiny else 8192)
    args.iters = args.iters or (1 if args.tiny else 10)
    args.warmup = (0 if args.tiny else 3) if args.warmup is None else args.warmup
    return args


def build(model_type: str, args) -> tuple[torch.nn.Module, dict]:
    """The family's MoE block (bf16, N(0, initializer_range) weights, seed 0) on args.device, and its row's
    dimension fields, read from the block."""
    from transformers import AutoConfig

    cls_name, dims, _ = FAMILIES[model_type]
    dims = {**dims, "n_routed_experts": args.deepseek_experts} if model_type == "deepseek_v3" else dims
    cfg = hf_tiny.tiny_config(model_type) if args.tiny else AutoConfig.for_model(model_type, **dims)
    cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), cls_name)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 (as from_config(dtype=...)): no fp32 copy on the way
    try:
        with torch.device(args.device):
            block = cls(cfg).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, cfg.initializer_range)
    experts = block.experts
    e, h, i = (experts.down_proj.transpose(1, 2) if experts.is_transposed else experts.down_proj).shape
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    s_i, k = shared and shared.up_proj.weight.shape[0], cfg.num_experts_per_tok
    shape = f"T{args.tokens} H{h} I{i} E{e} k{k}" + (f" +shared{s_i}" if s_i else "")
    return block, dict(block=type(block).__name__, shape=shape, hidden=h, intermediate=i, experts=e, top_k=k,
                       shared_intermediate=s_i)


def time_backend(block, impl: str, x, dy, args) -> tuple[float, float | None, torch.Tensor, torch.Tensor]:
    """(median ms, median host ms, peak MiB above the start or None on CPU, output, dx) of ``impl``'s steps; host
    ms: a step's enqueue time on the host (no synchronization), ~ its ms when the host is the bottleneck."""
    block.experts.config._experts_implementation = impl
    cuda = x.device.type == "cuda"

    def step():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out  # gpt-oss's block also returns its router scores
        out.backward(dy)
        dx, x.grad = x.grad, None
        block.zero_grad(set_to_none=True)
        return out.detach(), dx

    def mark():  # a CUDA event recorded now, or perf_counter in ms
        if not cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    base = torch.cuda.memory_allocated() if cuda else 0  # weights, inputs: no gradients
    for _ in range(args.warmup):
        step()
    if cuda:  # the peak of the timed steps, over anything the backend keeps from its warmup (caches) too
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    laps, host = [], []
    for _ in range(args.iters):
        out = dx = None  # the previous step's output is no part of this step's peak
        start, t0 = mark(), time.perf_counter()
        out, dx = step()
        host.append((time.perf_counter() - t0) * 1e3)
        laps.append((start, mark()))
    if cuda:
        torch.cuda.synchronize()
    times = [start.elapsed_time(end) if cuda else end - start for start, end in laps]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return statistics.median(times), statistics.median(host), peak, out, dx


def profile_backend(block, impl: str, x, dy, top: int, steps: int = 2) -> str:
    """``impl``'s ``top`` heaviest CUDA kernels over ``steps`` steps (ms per step, calls per step), and the sum of
    every kernel's time per step (GPU busy): a step's span above that is launch latency or host time."""
    from torch.profiler import ProfilerActivity, profile

    block.experts.config._experts_implementation = impl
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            out = block(x)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
            x.grad = None
            block.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    lines = [f"  {impl}: GPU busy {busy:.2f} ms per step, {sum(e.count for e in kernels) // steps} kernels per step"]
    lines += [f"    {e.device_time_total / steps / 1e3:7.3f} ms x{e.count // steps:<3} {e.key[:90]}" for e in kernels[:top]]
    return "\n".join(lines)


def profile_host(block, impl: str, x, dy, top: int, steps: int = 5) -> str:
    """The ``top`` functions with the most own (not cumulative) host seconds over ``steps`` steps of ``impl``
    (cProfile, the backward run on the calling thread so that it is seen), per step in ms: where a step's
    enqueue time goes."""
    import cProfile
    import io
    import pstats

    block.experts.config._experts_implementation = impl
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False), prof:
        for _ in range(steps):
            out = block(x)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
            x.grad = None
            block.zero_grad(set_to_none=True)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    total = stats.total_tt / steps * 1e3
    stats.sort_stats("tottime").print_stats(top)
    return f"  {impl}: host {total:.2f} ms per step (profiled)\n" + "\n".join(
        "    " + line for line in text.getvalue().splitlines() if line.strip())


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def reason(e: Exception) -> str:
    """The exception's type and first line (a string: holding ``e`` would keep its frames' tensors alive)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def bench(model_type: str, args) -> dict:
    """One family's row (:data:`FIELDS`); what failed goes into its "error" field."""
    row = dict.fromkeys(FIELDS)
    row.update(model=model_type, tokens=args.tokens, note=FAMILIES[model_type][2] + " (tiny dims)" * args.tiny)
    errors, results = [], {}
    try:
        block, dims = build(model_type, args)
        row.update(dims)
        g = torch.Generator(args.device).manual_seed(1)
        x, dy = (torch.randn(1, args.tokens, row["hidden"], generator=g, device=args.device).bfloat16() for _ in "xy")
        x.requires_grad_()
        for name in BACKENDS:
            try:  # --tiny registers mok_cute's reference backend under its own name
                impl = "mok_cute_reference" if args.tiny and name == "mok_cute" else name
                results[name] = time_backend(block, impl, x, dy, args)
                if args.profile and x.device.type == "cuda":
                    print(profile_backend(block, impl, x, dy, args.profile), flush=True)
                if args.host_profile and name == "mok_cute":
                    print(profile_host(block, impl, x, dy, args.host_profile), flush=True)
            except Exception as e:  # noqa: BLE001  (OOM, a refusal, a missing kernel: reported, the rest goes on)
                errors.append(f"{name}: {reason(e)}")
                x.grad = None
                block.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001  (transformers lacks the family, OOM building it)
        errors.append(reason(e))
    for name, (ms, host, peak, _, _) in results.items():
        row[f"{name}_ms"], row[f"{name}_host_ms"], row[f"{name}_peak_mib"] = ms, host, peak
    if len(results) == len(BACKENDS):
        (*_, y_mm, dx_mm), (*_, y_mok, dx_mok) = results["grouped_mm"], results["mok_cute"]
        row.update(speedup=row["grouped_mm_ms"] / row["mok_cute_ms"], rel_err_out=max_rel(y_mok, y_mm),
                   rel_err_dx=max_rel(dx_mok, dx_mm))
    row["error"] = "; ".join(errors) or None
    return row


def table(rows: list[dict]) -> str:
    """The rows as a text table, each ending with its note and [error]."""
    lines = [f"{'model':<12} {'shape':<36} " + " ".join(f"{key:>11}" for key in COLUMNS) + "  note"]
    for r in rows:
        cells = " ".join(f"{'-' if r[k] is None else format(r[k], fmt):>{max(11, len(k))}}"
                         for k, fmt in COLUMNS.items())
        lines.append(f"{r['model']:<12} {r['shape'] or '-':<36} {cells}  {r['note']}"
                     + (f"  [{r['error']}]" if r["error"] else ""))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if problem := hf_tiny.transformers_problem():
        raise SystemExit(f"bench_hf_blocks: {problem}")
    import transformers

    import mok_cute
    import mok_cute.integrations.transformers as mok_hf

    if args.tiny:  # under its own name: the process's "mok_cute" registration stays as it is
        mok_hf.register(mok_cute.MoKConfig(backend="reference"), name="mok_cute_reference")
    else:
        mok_hf.register()
    meta = dict(device=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                command=" ".join(["python -m tools.bench_hf_blocks", *(sys.argv[1:] if argv is None else argv)]),
                torch=torch.__version__, transformers=transformers.__version__, tokens=args.tokens,
                warmup=args.warmup, iters=args.iters, tiny=args.tiny)
    print(f"# {meta['device']}, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}: "
          f"{meta['command']}", flush=True)
    rows = []
    for model_type in args.models:
        rows.append(bench(model_type, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # each row as it lands (a run cut short keeps them)
        torch.cuda.empty_cache()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""Train a small Qwen3-MoE with Hugging Face transformers on mok_cute, and on transformers' own
experts backends for comparison.

The model: Qwen3-30B-A3B's layer dimensions (hidden 2048, 128 experts of intermediate size 768,
top-8, 32 query / 4 key-value heads of 128) with only 4 layers, random weights, bf16. Each backend
trains the same initial weights (one state dict, loaded before each run) with AdamW on the same
batches, 16,384 tokens per step (--batch 4 x --seq 4096):

    python examples/hf_finetune.py --steps 200 --out results/     # on a GPU
    python examples/hf_finetune.py --tiny --steps 20 --out /tmp/x # a toy model, on the CPU too

(on the offline GPU node, transformers comes from the bundle of tools/hf_bundle.py:
``source .gpu-node/activate.sh && source .hfnode/activate.sh && python3 examples/hf_finetune.py``)

Backends (--backends): "mok_cute" (registered by ``mok_cute.integrations.transformers.register()``),
transformers' "grouped_mm", and transformers' "sonicmoe" on a Hopper or newer GPU, with transformers'
hub kernel or, offline, the ``sonic-moe`` pip package (``bash tools/peer_env.sh`` installs its wheels;
else skipped, with the reason; listed after mok_cute). On a CPU, mok_cute runs its pure-torch
reference backend.

Reported per backend: tokens/s of the whole training step (forward, backward and optimizer step;
the median step after --warmup steps, timed between torch.cuda.synchronize calls), the first
step's seconds (kernel compilation included), peak GPU memory (torch.cuda.max_memory_allocated,
reset between backends), the final loss and its relative gap to grouped_mm's final loss. --out
gets hf_finetune.json (every number and each step's loss) and hf_finetune_loss.png (the loss
curves; hf_finetune_loss.csv instead when matplotlib, the ``plot`` extra, is not installed).

The data is synthetic and learnable: each sequence strings together "phrases", fixed runs of 16
distinct tokens drawn once from the vocabulary, so that a token predicts its successor except at a
phrase's end. The loss falls from ln(vocab) towards (ln #phrases) / 16.

Memory: 4 layers of 128 experts are 2.4 B parameters (2.6 B with the embeddings); with their
gradients and AdamW's two bf16 states that is ~20 GiB before activations. The vocabulary defaults
to 32,768: Qwen3-30B-A3B's --vocab 151936 adds 0.5 B parameters (~4 GiB with their states) and
16,384 x 151,936 logits (~14 GiB in bf16 and in fp32 for the loss).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

PHRASE_LEN = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps per backend (default 200)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers, every one MoE (default 4)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--backends", default="grouped_mm,mok_cute,sonicmoe",
                   help="experts backends to train, in this order (default grouped_mm,mok_cute,sonicmoe)")
    p.add_argument("--out", type=Path, default=Path("hf_finetune_out"), help="folder for the JSON and the plot")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (Qwen3-30B-A3B: 151936)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=4, help="key-value heads (default 4)")
    p.add_argument("--head-dim", type=int, default=128, help="dimension of a head (default 128)")
    p.add_argument("--lr", type=float, help="AdamW's learning rate (default 3e-4; 3e-3 with --tiny)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time (default 5)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "mxfp8", "fp8_block"),
                   help="mok_cute's GEMM precision (default bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceiling", type=int, default=0, metavar="STEPS",
                   help="also time STEPS steps with the routed experts' computation skipped (an experts backend "
                        "that returns zeros, its weights still updated with zero gradients): the rest of the step, "
                        "hence the experts' share of each backend's step and the most any experts backend could "
                        "gain (default 0: not measured)")
    p.add_argument("--tiny", action="store_true",
                   help="a toy model for a smoke test, fast on a CPU: 2 layers, hidden 64, 8 experts of 64, top-2, "
                        "vocab 512, 2 heads of 32, 2 x 64 tokens a step (these flags are then ignored)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.batch, args.seq, args.vocab = 2, 2, 64, 512
        args.heads, args.kv_heads, args.head_dim = 2, 1, 32
    if args.lr is None:
        args.lr = 3e-3 if args.tiny else 3e-4
    return args


def model_config(args):
    """Qwen3-30B-A3B's dimensions with ``args``' layers, vocabulary and attention (a toy with --tiny)."""
    from transformers import AutoConfig

    dims = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    if args.tiny:
        dims = dict(hidden_size=64, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    return AutoConfig.for_model(
        "qwen3_moe", **dims, num_hidden_layers=args.layers, vocab_size=args.vocab,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        norm_topk_prob=True, max_position_embeddings=max(args.seq, 4096), tie_word_embeddings=False,
        use_cache=False)


class Phrases:
    """The synthetic data: batch ``step`` is the same for every backend (seeded by the step)."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        n = min(64, vocab // PHRASE_LEN)
        self.table = torch.randperm(vocab, generator=g)[: n * PHRASE_LEN].view(n, PHRASE_LEN)
        self.seed = seed

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(0, len(self.table), (batch, -(-seq // PHRASE_LEN)), generator=g)
        return self.table[picks].view(batch, -1)[:, :seq]


def sonicmoe_missing(device: torch.device) -> str | None:
    """Why the "sonicmoe" backend cannot run here, or None when it can: a CUDA GPU of SM90 or newer, and
    either transformers' hub kernel (``kernels`` installed) or the ``sonic-moe`` pip package. Imports
    nothing of SonicMoE: importing it (QuACK) patches CuTe DSL process-wide, so it is loaded only by
    :func:`load_sonicmoe`, after mok_cute's kernels have compiled."""
    import importlib.util

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "SonicMoE needs an NVIDIA GPU of SM90 (Hopper) or newer"
    if importlib.util.find_spec("kernels") is None and importlib.util.find_spec("sonicmoe") is None:
        return ("neither the `kernels` package (transformers' hub kernel) nor the `sonic-moe` package is installed "
                "(pip install sonic-moe)")
    return None


def load_sonicmoe() -> str:
    """Load SonicMoE for transformers' "sonicmoe" backend: transformers' own loader (the hub kernel
    ``kernels-community/sonic-moe``), else the installed ``sonic-moe`` package put in its place
    (``transformers.integrations.sonicmoe._SONICMOE``; its ``moe_general_routing_inputs`` takes the
    same arguments). Returns where it came from; raises ImportError when neither loads."""
    from transformers.integrations import sonicmoe as hf_sonic

    try:
        hf_sonic.load_sonicmoe_kernel()
        return "kernels-community/sonic-moe (transformers' hub kernel)"
    except Exception as hub_error:  # noqa: BLE001  (no `kernels`, no network, no build for this torch)
        try:
            import sonicmoe
        except ImportError as e:
            raise ImportError(f"SonicMoE: hub kernel: {hub_error}; pip package: {e}") from e
        hf_sonic._SONICMOE = hf_sonic.SonicMoE(activation_type_enum=sonicmoe.enums.ActivationType,
                                              moe_general_routing_inputs=sonicmoe.moe_general_routing_inputs)
        return f"sonic-moe {getattr(sonicmoe, '__version__', '?')} (pip package)"


def train(model, init: dict, backend: str, args, data: Phrases, device: torch.device) -> dict:
    """``args.steps`` AdamW steps of ``model`` from the weights ``init`` on the experts ``backend``."""
    model.load_state_dict(init)
    if backend == "sonicmoe":
        print(f"hf_finetune: sonicmoe from {load_sonicmoe()}")
    model.set_experts_implementation(backend)
    model.train()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for step in tqdm(range(args.steps), desc=backend, unit="step"):
        ids = data.batch(step, args.batch, args.seq).to(device)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    del optimizer  # its states go before the next backend's run
    timed = seconds[args.warmup:] or seconds[-1:]
    step_s = statistics.median(timed)
    return dict(tokens_per_s=args.batch * args.seq / step_s, step_s_median=step_s, first_step_s=seconds[0],
                peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                final_loss=losses[-1], losses=losses)


class _FreeExperts(torch.autograd.Function):
    """Zeros forward; backward, zero gradients for the routing weights and the experts' own parameters, so that
    the router's backward and the optimizer's update of the experts' weights stay in the step."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, *params):
        ctx.like = [(t.shape, t.dtype, t.device) for t in (top_k_weights, *params)]  # shapes only, nothing saved
        return hidden_states.new_zeros(hidden_states.shape)

    @staticmethod
    def backward(ctx, dy):
        return (None, *(torch.zeros(shape, dtype=dtype, device=dev) for shape, dtype, dev in ctx.like))


def _no_experts(self, hidden_states, top_k_index, top_k_weights):
    """An experts backend that computes nothing (zeros) at no cost, its weights and the routing weights still
    getting (zero) gradients: what the rest of the training step costs, the optimizer's work on the experts'
    weights included."""
    return _FreeExperts.apply(hidden_states, top_k_weights, *self.parameters(recurse=False))


def measure_ceiling(model, init: dict, args, data, device, results: dict) -> dict:
    """``args.ceiling`` steps with the routed experts' computation skipped (:func:`_no_experts`, registered as
    "no_experts"; their weights still updated by the optimizer): the median step without it, each backend's
    experts share (1 - that / its step) and the most any experts backend could speed up grouped_mm's step, were
    its experts free (Amdahl: grouped_mm's step / the step without them). Printed, and returned for the report."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("no_experts", _no_experts)
    short = argparse.Namespace(**{**vars(args), "steps": args.ceiling, "warmup": min(args.warmup, args.ceiling - 1)})
    rest = train(model, init, "no_experts", short, data, device)["step_s_median"]
    out = dict(steps=args.ceiling, step_s_without_experts=rest,
               experts_share={name: 1 - rest / r["step_s_median"] for name, r in results.items()})
    if "grouped_mm" in results:
        out["max_speedup_vs_grouped_mm"] = results["grouped_mm"]["step_s_median"] / rest
    print(f"\nwithout the routed experts: {rest * 1e3:.1f} ms a step; experts' share: "
          + ", ".join(f"{n} {v:.0%}" for n, v in out["experts_share"].items())
          + (f"; free experts would make grouped_mm's step {out['max_speedup_vs_grouped_mm']:.2f}x faster"
             if "max_speedup_vs_grouped_mm" in out else ""))
    return out


def write_plot(out: Path, results: dict, title: str) -> Path:
    """The loss curves as a PNG, or as a CSV (one column per backend) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = out / "hf_finetune_loss.csv"
        print(f"matplotlib is not installed (pip install 'mok_cute[plot]'): writing the loss curves to {path}")
        names = list(results)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", *names])
            for step, row in enumerate(zip(*(results[n]["losses"] for n in names))):
                w.writerow([step, *row])
        return path
    path = out / "hf_finetune_loss.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} (final {r['final_loss']:.4f})", linewidth=1)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM

    import mok_cute
    import mok_cute.integrations.transformers as mok_hf

    device = torch.device(args.device)
    if device.type == "cpu":
        # mok_cute warns that it runs its pure-torch reference backend without a GPU: that is the point here
        warnings.filterwarnings("ignore", message="no CUDA device")
        if not args.tiny:
            print("hf_finetune: the full-size model on a CPU takes very long; --tiny is the CPU smoke test")
    # transformers' router gives every token valid expert ids: skip mok_cute's check (a host sync per layer)
    mok_hf.register(mok_cute.MoKConfig(precision=args.precision, validate_routing=False))

    backends, skipped = [], {}
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "sonicmoe" in names and "mok_cute" in names[names.index("sonicmoe"):]:
        raise SystemExit("hf_finetune: --backends must list mok_cute before sonicmoe (importing SonicMoE patches "
                         "CuTe DSL process-wide; mok_cute's kernels must compile first)")
    for name in names:
        reason = sonicmoe_missing(device) if name == "sonicmoe" else None
        if reason:
            print(f"hf_finetune: skipping sonicmoe ({reason})")
            skipped[name] = reason
        else:
            backends.append(name)
    if not backends:
        raise SystemExit("hf_finetune: no backend of --backends can run here")

    cfg = model_config(args)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"hf_finetune: Qwen3-MoE, {args.layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts "
          f"of {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}: "
          f"{n_params / 1e9:.3f} B parameters; {args.batch} x {args.seq} tokens a step on {device}")

    data = Phrases(args.vocab, args.seed)
    results = {name: train(model, init, name, args, data, device) for name in backends}
    ceiling = measure_ceiling(model, init, args, data, device, results) if args.ceiling else None

    reference = "grouped_mm" if "grouped_mm" in results else next(iter(results))
    ref_loss = results[reference]["final_loss"]
    for r in results.values():
        r["loss_gap_vs_reference"] = abs(r["final_loss"] - ref_loss) / abs(ref_loss)
    print(f"\n{'backend':12s} {'tokens/s':>10s} {'step ms':>9s} {'first step s':>13s} {'peak GiB':>9s} "
          f"{'final loss':>11s} {'gap vs ' + reference:>18s}")
    for name, r in results.items():
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(f"{name:12s} {r['tokens_per_s']:10.0f} {r['step_s_median'] * 1e3:9.1f} {r['first_step_s']:13.2f} "
              f"{peak:>9s} {r['final_loss']:11.4f} {r['loss_gap_vs_reference']:18.2e}")

    args.out.mkdir(parents=True, exist_ok=True)
    title = (f"Qwen3-MoE {args.layers}L H{cfg.hidden_size} E{cfg.num_experts} k{cfg.num_experts_per_tok}, "
             f"{args.batch}x{args.seq} tokens/step")
    plot = write_plot(args.out, results, title)
    report = dict(
        model=dict(layers=args.layers, hidden=cfg.hidden_size, moe_intermediate=cfg.moe_intermediate_size,
                   experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, vocab=cfg.vocab_size,
                   heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, parameters=n_params),
        run=dict(steps=args.steps, batch=args.batch, seq=args.seq, tokens_per_step=args.batch * args.seq,
                 warmup=args.warmup, lr=args.lr, seed=args.seed, precision=args.precision, device=str(device),
                 gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                 torch=torch.__version__, transformers=transformers.__version__),
        reference=reference, backends=results, skipped=skipped, plot=plot.name, ceiling=ceiling)
    path = args.out / "hf_finetune.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} and {plot}")
    if not all(math.isfinite(r["final_loss"]) for r in results.values()):
        raise SystemExit("hf_finetune: a backend's loss is not finite")
    return report


if __name__ == "__main__":
    main()

"""Device check (issue 47, item 2): Hugging Face transformers MoE models on mok_cute's SM90 kernels, through
its experts backend (:mod:`mok_cute.integrations.transformers`), against transformers' own "eager" experts.

For each of Qwen3-MoE, Qwen2-MoE (its shared expert and sigmoid shared-expert gate, run by the model's
block), Mixtral, DeepSeek-V3 (sigmoid routing, shared expert), OLMoE and gpt-oss: the tiny random 2-layer
model of :mod:`tools.hf_tiny` (the configs and builders tests/integrations/test_transformers.py runs on the
CPU: H = 64, E = 4 experts of I = 64, top-k = E, multiples of 64 as the SM90 kernels need; weights rounded
to bf16), on CUDA:

    (a) in bf16 with ``experts_implementation="mok_cute"``, registered as
        ``register(MoKConfig(backend="sm90"))`` (fallback off: a layer mok_cute cannot run raises);
    (b) the same weights in float32 with ``experts_implementation="eager"`` (TF32 off), the reference.

One cross-entropy forward + backward on fixed tokens (:data:`IDS_SHAPE`); compared: the logits and every
parameter's gradient (experts, routers and their score biases, shared experts and gates, attention, norms,
embeddings), and (a) twice for bitwise equality of all of them. Each row also checks that every MoE layer's
experts ran through mok_cute (a counting wrapper around the registered function).

Tolerances (BF16; rel-L1 = sum|a - b| / sum|b|, max-abs scaled = max|a - b| / max|b|):
    logits rel-L1 <= 2e-2, every gradient rel-L1 <= 5e-2 (tests/integrations/test_transformers.py's), gpt-oss's
    gradients <= 1e-1 (its attention sinks [heads] and router bias [E] are a few values each, sums over all
    tokens: transformers' own eager experts in bf16 are 5.6% / 8.6% off there at these shapes); max-abs scaled
    <= 0.1 for the logits and <= 0.25 for each gradient. Measured on the CPU reference backend at these
    shapes (bf16 model vs float32 eager): logits rel-L1 0.7-1.0%, max-abs scaled 1.0-1.9%; the worst gradient
    rel-L1 1.4-2.2% (gpt-oss: 5.5%, its sinks), max-abs scaled 1.4-4.5%: the same as transformers' eager and
    grouped_mm experts in bf16. The GPU's bf16 attention and matmuls around the experts add their own rounding
    (hence the margins). A wrong gate / up layout gives logits ~35% and a lost router gradient 100% (measured
    in tests/integrations), far beyond them. A missing gradient or a non-finite value fails.
    Bitwise: logits and all gradients equal over two runs of (a), under torch's default settings (no
    ``use_deterministic_algorithms``: it would also change the torch ops mok_cute itself calls); a difference
    names the tensors (a torch op of the model around the experts, e.g. attention's backward, could be the
    cause: these 64-token sequences fit one attention block).
Row: ``max_err`` the worst scaled max-abs (logits or a gradient), ``bitwise`` the determinism, the note the
logits' and worst gradient's rel-L1 (named) and the experts calls.

gpt-oss has expert biases (``gate_up_proj_bias``, ``down_proj_bias``): the SM90 kernels add them in their GEMM
epilogues and the layer sums their gradients per expert (bf16, EP = 1), so its row is a comparison like the
others.

Skipped (one ok row) without an sm_90 GPU, or when transformers (>= 5.17) is not importable: the GPU node
has none of its own; ``source .gpu-node/activate.sh && source .hfnode/activate.sh`` there first (the
offline bundle ``python -m tools.hf_bundle`` builds, :mod:`tools.hf_bundle`), e.g.
``source .hfnode/activate.sh && python -m tools.gpu_check hf_models`` (or before ``pytest -m gpu tests/gpu``,
whose child processes inherit it).
"""
from __future__ import annotations

import contextlib
import copy

import torch

from tools import hf_tiny
from tools.checks.common import Row, sm90_skip

CHECK = "hf_models"
MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss")
LOGITS_REL_L1, GRAD_REL_L1 = 2e-2, 5e-2
GRAD_REL_L1_OF = {"gpt_oss": 1e-1}  # per model type, where not GRAD_REL_L1 (module doc)
LOGITS_MAX_ABS, GRAD_MAX_ABS = 0.1, 0.25  # max|a - b| / max|b|
IDS_SHAPE = (4, 64)  # 256 tokens, k = 4: 1024 routes over 4 experts per layer
BACKEND_NAME = "mok_cute"


def skip_rows(ctx) -> list[Row] | None:
    """The one skipped row when transformers cannot serve the integration here, else None."""
    problem = hf_tiny.transformers_problem()
    if problem is not None:
        return [Row(f"{CHECK}: skipped", ok=True,
                    note=f"{problem}; on the GPU node: source .hfnode/activate.sh (python -m tools.hf_bundle)")]
    return None


def register(config, name: str = BACKEND_NAME, fallback: bool = False) -> list[int]:
    """Register mok_cute under ``name`` with ``config`` wrapped in a call counter; the counter (a
    one-element list) back."""
    from transformers.integrations.moe import ExpertsInterface

    import mok_cute.integrations.transformers as mok_hf

    forward = mok_hf.register(config, name=name, fallback=fallback)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    ExpertsInterface.register(name, counted)
    return calls


def build(model_type: str):
    """The tiny float32 model of ``model_type`` (CPU, "eager" experts, bf16-valued weights,
    seeded: :func:`tools.hf_tiny.fp32_model`) and its token ids [:data:`IDS_SHAPE`] (CPU)."""
    model = hf_tiny.fp32_model(model_type)
    return model, hf_tiny.token_ids(IDS_SHAPE)


def on(model, device, dtype, experts: str):
    """A copy of ``model`` on ``device`` in ``dtype`` on the ``experts`` backend."""
    out = copy.deepcopy(model).to(device=device, dtype=dtype)
    out.set_experts_implementation(experts)
    return out


@contextlib.contextmanager
def exact_fp32():
    """No TF32 in float32 matmuls (the reference) inside; the caller's settings after."""
    prev = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cudnn.allow_tf32 = prev[1]


def errors(run, ref) -> dict[str, tuple[float, float]]:
    """``{name: (rel-L1, scaled max-abs)}`` of the logits and each gradient of ``run`` ((logits, grads)
    of :func:`tools.hf_tiny.step`) against ``ref``; a missing gradient or a non-finite value is
    ``(inf, inf)``."""
    (logits, grads), (logits_ref, grads_ref) = run, ref
    pairs = {"logits": (logits, logits_ref)}
    pairs.update({n: (grads.get(n), g) for n, g in grads_ref.items()})
    out = {}
    for name, (a, b) in pairs.items():
        if a is None or b is None or not bool(torch.isfinite(a).all()):
            out[name] = (float("inf"), float("inf"))
            continue
        d, ref = (a.float() - b.float()).abs(), b.float().abs()
        out[name] = (_ratio(float(d.sum()), float(ref.sum())), _ratio(float(d.max()), float(ref.max())))
    return out


def _ratio(err: float, ref: float) -> float:
    """``err / ref``; 0 for no error against a zero reference, inf for an error against one."""
    return err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))


def bitwise_equal(run1, run2) -> list[str]:
    """The names (``logits`` and parameter names) whose values differ between the two runs (empty: bitwise)."""
    (l1, g1), (l2, g2) = run1, run2
    diff = [] if torch.equal(l1, l2) else ["logits"]
    for n in g1:
        a, b = g1[n], g2.get(n)
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            diff.append(n)
    return diff


def judge(label: str, errs: dict[str, tuple[float, float]], diff: list[str] | None, calls: int,
          want_calls: int, grad_rel_l1: float = GRAD_REL_L1) -> Row:
    """The row of one model: tolerances (module doc; ``grad_rel_l1`` the gradients' rel-L1), bitwise
    (``diff`` the differing names, None: not asked) and the experts calls through mok_cute (``want_calls``)."""
    rel_logits, max_logits = errs["logits"]
    grads = {n: e for n, e in errs.items() if n != "logits"}
    worst_rel = max(grads, key=lambda n: grads[n][0]) if grads else None
    bad = [n for n, (rel, mx) in errs.items()
           if not (rel <= (LOGITS_REL_L1 if n == "logits" else grad_rel_l1)
                   and mx <= (LOGITS_MAX_ABS if n == "logits" else GRAD_MAX_ABS))]
    max_err = max(mx for _, mx in errs.values())
    same = None if diff is None else not diff
    ok = not bad and same is not False and calls == want_calls and len(grads) > 0
    note = f"logits relL1={rel_logits:.2e}"
    if worst_rel is not None:
        note += f" worst grad relL1={grads[worst_rel][0]:.2e} ({worst_rel})"
    note += f" experts calls {calls}/{want_calls}"
    if bad:
        note += " bad: " + " ".join(f"{n}(rel={errs[n][0]:.1e},max={errs[n][1]:.1e})" for n in bad[:4])
        note += f" (+{len(bad) - 4})" if len(bad) > 4 else ""
    if diff:
        note += f" not bitwise: {' '.join(diff[:3])}" + (f" (+{len(diff) - 3})" if len(diff) > 3 else "")
    return Row(label, max_err=max_err, bitwise=same, ok=ok, note=note)


def compare(model_type: str, device, config, label: str | None = None) -> Row:
    """The row of ``model_type``: its tiny model in bf16 on mok_cute (``config``, registered as
    :data:`BACKEND_NAME`) on ``device``, twice, against float32 "eager" there."""
    label = label or f"hf {model_type} bf16 mok_cute vs fp32 eager"
    model, ids = build(model_type)
    layers = len(hf_tiny.experts_of(model))
    calls = register(config)
    with exact_fp32():
        ref = hf_tiny.step(on(model, device, torch.float32, "eager"), ids)
    bf16 = on(model, device, torch.bfloat16, BACKEND_NAME)
    first = hf_tiny.step(bf16, ids)
    second = hf_tiny.step(bf16, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return judge(label, errors(first, ref), bitwise_equal(first, second), calls[0], 2 * layers,
                 GRAD_REL_L1_OF.get(model_type, GRAD_REL_L1))


def run(ctx) -> list[Row]:
    skipped = skip_rows(ctx) or sm90_skip(ctx, CHECK)
    if skipped:
        return skipped
    import mok_cute

    config = mok_cute.MoKConfig(backend="sm90")
    rows = []
    for model_type in MODEL_TYPES:
        try:
            rows.append(compare(model_type, ctx.device, config))
        except Exception as e:  # noqa: BLE001  (one model's failure is its row; the others still run)
            rows.append(Row(f"hf {model_type}: crashed", ok=False, note=f"{type(e).__name__}: {e}"[:160]))
    return rows

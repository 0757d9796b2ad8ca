"""Tiny random 2-layer Hugging Face MoE models of the families mok_cute.integrations.transformers
covers, shared by the CPU tests (tests/integrations/test_transformers.py) and the device check
(tools/checks/hf_models.py): one place for their configs and builders.

Every layer is an MoE layer with E = 4 experts of I = 64 on H = 64 (multiples of 64: the SM90 / SM100
kernels accept them), each token routed to all four (top-k = E: see the test module for why).
transformers is imported inside the functions only: importing this module needs torch alone (the
device check imports it on machines without transformers; on the GPU node ``source
.hfnode/activate.sh``, built by ``python -m tools.hf_bundle``, makes transformers importable).
"""
from __future__ import annotations

import torch

MIN_TRANSFORMERS = "5.17"  # mok_cute.integrations.transformers needs transformers >= 5.17
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)
# every layer an MoE layer with E = 4 experts of I = 64, each token routed to all four
MODELS = {
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=4,
                      norm_topk_prob=True),
    # a shared expert with its sigmoid output gate (shared_expert_gate), run by the model's block
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                      num_experts=4, num_experts_per_tok=4),
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=4),
    # sigmoid routing with a score-correction bias, and a shared expert
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=4,
                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                        head_dim=16, num_key_value_heads=2),
    "olmoe": dict(intermediate_size=64, num_experts=4, num_experts_per_tok=4, eos_token_id=2),
    # gate_up_proj [E, H, 2I], down_proj [E, I, H] (is_transposed), and shared experts
    "aria_text": dict(intermediate_size=64, moe_num_experts=4, moe_topk=4, moe_num_shared_experts=1),
    # gate_up_proj [E, H, 2I] interleaved (gate even, up odd) and transposed, biases, alpha 1.702, limit 7
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=4),
}
BATCH = (2, 16)  # (sequences, tokens each) of :func:`token_ids`


def transformers_problem() -> str | None:
    """Why transformers cannot serve the integration here (not importable, or older than
    :data:`MIN_TRANSFORMERS`), or None when it can."""
    try:
        import transformers
        from packaging.version import Version
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken install raising something else)
        return f"transformers is not importable ({type(e).__name__}: {e})"
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        return f"transformers {transformers.__version__} < {MIN_TRANSFORMERS}"
    return None


def tiny_config(model_type: str, **overrides):
    """The transformers config of the tiny ``model_type`` model (:data:`COMMON`, its :data:`MODELS`
    entry, then ``overrides``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **MODELS.get(model_type, {}), **overrides})


def fp32_model(model_type: str, **overrides):
    """A tiny float32 model on the CPU and transformers' "eager" experts, its weights rounded to bf16
    (so that its bf16 copy holds the same values); seeded (torch's global RNG, seed 0). Expert biases
    (gpt-oss's, zero-initialized) are drawn N(0, 0.1) so that they matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32,
                                             experts_implementation="eager")
    with torch.no_grad():
        for m in experts_of(model):
            if m.has_bias:
                m.gate_up_proj_bias.normal_(0.0, 0.1)
                m.down_proj_bias.normal_(0.0, 0.1)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def experts_of(model) -> list:
    """The experts modules of ``model`` (its MoE layers' ``experts``), in layer order."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def token_ids(shape: tuple[int, int] = BATCH, seed: int = 1) -> torch.Tensor:
    """Fixed random token ids [sequences, tokens] (CPU, seeded)."""
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def step(model, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Logits [*ids.shape, VOCAB] (fp32) and every parameter's gradient (fp32; None if it got none)
    of one cross-entropy forward + backward of ``model`` on ``ids`` (default :func:`token_ids`),
    moved to the model's device."""
    ids = (token_ids() if ids is None else ids).to(next(model.parameters()).device)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.float() for n, p in model.named_parameters()}
    return out.logits.detach().float(), grads


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum|a - b| / sum|b| (b the reference)."""
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())

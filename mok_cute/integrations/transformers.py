"""mok_cute as a Hugging Face transformers experts backend (transformers >= 5.17).

Usage (one explicit call per process; importing mok_cute does not import transformers)::

    import mok_cute.integrations.transformers as mok_hf

    mok_hf.register()  # or register(MoKConfig(precision="mxfp8"), name="mok_cute_mxfp8")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 experts_implementation="mok_cute")
    # or, on a loaded model: model.set_experts_implementation("mok_cute")

Every MoE layer's experts module (a class decorated with transformers'
``use_experts_implementation``) then runs its routed experts through :func:`mok_cute.moe`,
forward and backward. The model's own block keeps everything around the experts: its router
(softmax / sigmoid top-k, groups, score bias, scaling), its shared experts and their gates.

What the backend reads from the experts module, each call:
    * ``gate_up_proj``: [E, 2I, H] (``is_transposed`` False) or [E, H, 2I] (True), gate rows /
      columns first, then up (``is_concatenated``), or gate and up interleaved (gate at even,
      up at odd rows / columns: gpt-oss); ``down_proj``: [E, H, I] or [E, I, H].
      w_gate, w_up are the two halves (or the even / odd rows) of ``gate_up_proj`` and w_down is
      ``down_proj``, all as views of the parameters (no copy here): gradients land in the
      parameters themselves. The GPU kernels address the untransposed halves in place; a
      transposed or interleaved layout has its reduction dim strided, which mok_cute copies to a
      contiguous operand inside the layer (:func:`mok_cute.dsl.host.weight_operand`), each call.
    * with ``has_bias``: ``gate_up_proj_bias`` [E, 2I] (split as ``gate_up_proj``) and
      ``down_proj_bias`` [E, H], views passed as mok_cute's expert biases (added before each
      GEMM's rounding; the down bias inside the expert output the routing weight scales, as
      transformers does).
    * the activation: ``act_fn`` SiLU with transformers' default gate (silu(gate) * up), or
      gpt-oss's own ``GptOssExperts._apply_gate`` (``(clamp(up, -limit, limit) + 1) *
      gate * sigmoid(alpha * gate)``, gate clamped to <= limit; its ``alpha`` and ``limit`` read
      from the module): :class:`mok_cute.SwiGLU` ``(limit, alpha, up_offset=1)``.
    * the hidden states [T, H], ``top_k_index`` [T, k] (int; expert ids of this module's
      experts) and ``top_k_weights`` [T, k] (any float dtype: passed as fp32, so their gradient
      flows back to the router through the cast). With transformers' expert parallelism
      (``_is_expert_parallel``), ids >= ``num_experts`` mark routes to other ranks' experts
      and are passed as -1 (no expert): transformers moves the tokens, mok_cute runs EP = 1.
    Returns [T, H] in the hidden states' dtype (bf16).

mok_cute always runs these calls at EP = 1 on the calling rank, also when torch.distributed is
initialized (data parallelism, FSDP, transformers' own expert parallelism).

What mok_cute cannot run raises, naming the experts class, the model type and the feature:
a dtype other than bf16 (hidden states, weights or biases) a TypeError; interleaved gate/up
with the default activation, a model's own gated activation (``_apply_gate``) other than
gpt-oss's, an activation other than SiLU, experts without a gate, a post-expert norm, H or I not
a multiple of 64 a NotImplementedError. With ``fallback=True`` those layers run on
transformers' ``grouped_mm`` backend instead, with one warning per experts class and reason.
gpt-oss's activation (alpha and up offset included) and its expert biases run in the kernels at bf16 (the
biases: not at MXFP8 / fp8_block, where the backend raises NotImplementedError naming them; SM100:
compile-verified only).
"""
from __future__ import annotations

import warnings

import torch

from ..config import MoKConfig
from ..ops import SwiGLU, moe
from ..validate import ALIGN


class _OneRank:
    """An expert-parallel group of one rank (the calling one), in the form
    :func:`mok_cute.moe` takes: ``size()``, ``rank()``, ``all_gather``."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]


ONE_RANK = _OneRank()


def register(config: MoKConfig | None = None, *, name: str = "mok_cute", fallback: bool = False):
    """Register mok_cute in transformers' experts registry (``ExpertsInterface``) as ``name``.

    config: the :class:`~mok_cute.MoKConfig` of every layer call of the models that select
    ``name`` (None: the defaults with ``validate_routing=False``: a transformers router's top-k ids
    are in range by construction, ids of other ranks' experts are passed as -1 here, so the check's
    host sync per layer call would buy nothing; an id out of range is still caught on the device and
    raised by a later call). For another configuration per model (precision, paths, activations
    policy), register it under another name and give each model its name.
    fallback: run the layers mok_cute cannot (module docstring) on transformers' ``grouped_mm``
    backend, warning once per experts class and reason; False (default): raise for them.
    Registering a name again replaces its backend. Returns the registered function
    ``(experts_module, hidden_states, top_k_index, top_k_weights) -> hidden_states``.
    Imports transformers (>= 5.17).
    """
    from transformers.integrations.moe import ExpertsInterface

    config = config if config is not None else MoKConfig(validate_routing=False)
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig or None, got {type(config).__name__}")
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(f"name must be a non-empty string other than 'eager', got {name!r}")
    forward = _experts_forward(config, ExpertsInterface()["grouped_mm"] if fallback else None)
    ExpertsInterface.register(name, forward)
    return forward


def _experts_forward(config: MoKConfig, fallback):
    """The backend function over ``config``; ``fallback``: transformers' backend function for
    the layers mok_cute cannot run, or None (raise for them)."""
    warned: set[str] = set()  # the fallback's messages already warned

    def mok_cute_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        """Experts of ``self`` on mok_cute: hidden_states [T, H] bf16, top_k_index [T, k] int,
        top_k_weights [T, k] float -> [T, H] bf16 (see mok_cute.integrations.transformers)."""
        problem = unsupported(self, hidden_states)
        if problem is not None:
            error, message = problem
            if fallback is None:
                raise error(f"{message} (register(..., fallback=True) runs such layers on transformers' "
                            f"grouped_mm backend)")
            if message not in warned:
                warned.add(message)
                warnings.warn(f"{message}. Running it on transformers' grouped_mm backend (fallback=True)",
                              RuntimeWarning, stacklevel=2)
            return fallback(self, hidden_states, top_k_index, top_k_weights)
        routed = expert_weights(self)
        biases = expert_biases(self)
        if biases is not None:  # mok_cute.moe's (weight, bias) pairs
            routed = tuple(zip(routed, biases))
        return moe(hidden_states, local_ids(self, top_k_index), top_k_weights.float(), *routed,
                   swiglu_limit=activation(self), config=config, group=ONE_RANK)

    return mok_cute_experts_forward


def unsupported(experts, hidden_states: torch.Tensor) -> tuple[type[Exception], str] | None:
    """``(NotImplementedError, message)`` for the features of ``experts`` mok_cute cannot run,
    else ``(TypeError, message)`` when the hidden states or the weights are not bf16, else None.
    Each message names the experts class and the model type."""
    who = describe(experts)
    features = missing_features(experts)
    if features:
        return NotImplementedError, f"mok_cute cannot run the experts of {who}: {'; '.join(features)}"
    dtypes = {"hidden states": hidden_states.dtype, "gate_up_proj": experts.gate_up_proj.dtype,
              "down_proj": experts.down_proj.dtype}
    if experts.has_bias:
        dtypes.update(gate_up_proj_bias=experts.gate_up_proj_bias.dtype, down_proj_bias=experts.down_proj_bias.dtype)
    if any(d != torch.bfloat16 for d in dtypes.values()):
        got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        return TypeError, (f"mok_cute runs bfloat16 experts only, but {who} has {got}: load the model "
                           f"with dtype=torch.bfloat16")
    return None


def describe(experts) -> str:
    """``"<experts class> (model_type '<type>')"``, the model type from the module's config."""
    model_type = getattr(getattr(experts, "config", None), "model_type", None)
    return f"{type(experts).__name__} (model_type {model_type!r})"


def missing_features(experts) -> list[str]:
    """What the experts module ``experts`` needs beyond mok_cute's layer (gate and up
    concatenated [gate; up] with silu(gate) * up, or interleaved with gpt-oss's activation;
    biases or none; no post-expert norm; H and I multiples of :data:`~mok_cute.validate.ALIGN`),
    one phrase each; empty when mok_cute runs it."""
    from transformers.integrations import moe as hf_moe

    out = []
    gpt_oss = is_gpt_oss_gate(experts)
    if not experts.has_gate:
        out.append("experts without a gate (up_proj then act_fn; mok_cute runs silu(gate) * up)")
    if not experts.is_concatenated and not gpt_oss:
        out.append("gate and up interleaved in gate_up_proj (is_concatenated=False) with silu(gate) * up")
    if experts.is_concatenated and gpt_oss:
        out.append("gpt-oss's activation (gate and up interleaved) on concatenated [gate; up] (is_concatenated=True)")
    if experts.has_post_expert_norm:
        out.append("a norm after each expert (has_post_expert_norm=True)")
    if type(experts)._apply_gate is not hf_moe._default_apply_gate and not gpt_oss:
        params = ", ".join(f"{a}={getattr(experts, a)}" for a in ("alpha", "limit") if hasattr(experts, a))
        out.append(f"its own gated activation {type(experts).__name__}._apply_gate"
                   f"{f' ({params})' if params else ''} instead of silu(gate) * up or gpt-oss's")
    elif not gpt_oss and experts.has_gate and not is_silu(getattr(experts, "act_fn", None)):
        act = getattr(experts, "act_fn", None)
        hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
        out.append(f"the activation {type(act).__name__} (hidden_act {hidden_act!r}); mok_cute runs SiLU only")
    if not out:
        _, h, i = expert_weights(experts)[2].shape
        if h % ALIGN or i % ALIGN:
            out.append(f"hidden size H = {h}, intermediate size I = {i}: mok_cute needs multiples of {ALIGN}")
    return out


def is_silu(act) -> bool:
    """Whether the module or function ``act`` computes SiLU (transformers' ``ACT2FN["silu"]``,
    ``ACT2FN["swish"]``, torch's ``nn.SiLU`` or ``F.silu``)."""
    from transformers.activations import SiLUActivation

    return isinstance(act, (torch.nn.SiLU, SiLUActivation)) or act is torch.nn.functional.silu


_GPT_OSS_GATE = ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate")


def is_gpt_oss_gate(experts) -> bool:
    """Whether ``experts`` computes gpt-oss's gated activation: its class's ``_apply_gate`` is the
    function transformers defines as ``GptOssExperts._apply_gate`` (gate / up interleaved, gate
    clamped to <= limit, up to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)``), not
    one a subclass or a patch put in its place."""
    fn = type(experts)._apply_gate
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _GPT_OSS_GATE


def activation(experts) -> SwiGLU | None:
    """The :class:`mok_cute.SwiGLU` of ``experts``: gpt-oss's ``(limit, alpha, up_offset=1)`` from
    the module, else None (silu(gate) * up)."""
    if not is_gpt_oss_gate(experts):
        return None
    return SwiGLU(experts.limit, experts.alpha, 1.0)


def _split(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of ``gate_up`` along dim 1: its halves, or its even / odd entries."""
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]


def expert_weights(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I])``: views of the module's
    ``gate_up_proj`` ([E, 2I, H], or [E, H, 2I] with ``is_transposed``; gate first, or gate / up
    interleaved when not ``is_concatenated``) and ``down_proj`` ([E, H, I], or [E, I, H] with
    ``is_transposed``), no copy."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if experts.is_transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return (*_split(gate_up, not experts.is_concatenated), down)


def expert_biases(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(b_gate [E, I], b_up [E, I], b_down [E, H])``: views of the module's ``gate_up_proj_bias``
    [E, 2I] (split as ``gate_up_proj``) and ``down_proj_bias`` [E, H], or None without biases."""
    if not experts.has_bias:
        return None
    return (*_split(experts.gate_up_proj_bias, not experts.is_concatenated), experts.down_proj_bias)


def local_ids(experts, top_k_index: torch.Tensor) -> torch.Tensor:
    """``top_k_index`` with transformers' expert-parallel sentinels (ids >= ``num_experts``:
    another rank's expert, weight 0) as -1, mok_cute's "no expert"; itself without EP."""
    if not getattr(experts, "_is_expert_parallel", False):
        return top_k_index
    return torch.where(top_k_index < experts.num_experts, top_k_index, -1)

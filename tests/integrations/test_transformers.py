"""mok_cute as a Hugging Face transformers experts backend (mok_cute.integrations.transformers), on
the CPU reference backend: tiny random 2-layer models of each covered family run in bf16 on
"mok_cute" against the same weights in float32 on transformers' "eager" experts.

Tolerances (rel-L1 = sum|a - b| / sum|b|): logits <= 2e-2 and every parameter's gradient
<= 5e-2 (cross-entropy loss). Measured on these models: logits ~0.7%, the worst gradient 1.5-2.5%,
the same as transformers' own eager experts run in bf16. A wrong layout (gate and up swapped)
gives logits ~35% and gradients ~80-120%, a dropped routing-weight gradient 100% on the router
(:func:`test_the_tolerances_catch_a_wrong_layout_and_a_lost_router_gradient`). The models route
each token to all their experts (top-k = E = 4): with k < E, near-tied router scores pick other
experts in bf16 than in float32 for a few tokens (measured with 4-8 experts, top-2: 0-7 tokens of
256 per layer), which moves gradients by up to 20% whatever the experts backend. Sparse routing
(k < E) is compared at the experts module (:func:`test_sparse_routing_matches_fp32_eager`;
measured ~0.4%, tolerance 1.5e-2).

gpt-oss (gate / up interleaved in a transposed ``gate_up_proj``, biases, its clamped
``(up + 1) * gate * sigmoid(1.702 * gate)``) runs through ``mok_cute.SwiGLU`` and the expert
biases; its zero-initialized biases are drawn N(0, 0.1) here so that they matter. Measured:
logits 0.9%, the worst gradient (the router's bias) 3.5% (transformers' eager experts in bf16:
1.0%, 3.1%). At its limit 7 no clamp acts in these tiny models; at limit 1 (10-20% of gate / up
clamped) the whole model's router-bias gradient moves ~10% whatever the experts backend in bf16
(values on either side of the limit in bf16 and float32), so the clamps are compared at the
experts module (:func:`test_gpt_oss_clamps_match_fp32_eager`: measured <= 1.1%, tolerance 1.5e-2)
and exactly in tests/reference.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17",
                    reason="transformers >= 5.17 is not installed (pip install -e '.[test]' installs it)")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

import mok_cute  # noqa: E402
import mok_cute.integrations.transformers as mok_hf  # noqa: E402
from mok_cute.reference import _world  # noqa: E402
from tools import hf_tiny  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:no CUDA device")  # the reference backend, as intended here

LOGITS_TOL, GRAD_TOL, SPARSE_TOL = 2e-2, 5e-2, 1.5e-2
# the tiny models (configs, builders), shared with the device check tools/checks/hf_models.py
VOCAB, COMMON, MODELS = hf_tiny.VOCAB, hf_tiny.COMMON, hf_tiny.MODELS
rel_l1 = hf_tiny.rel_l1


@pytest.fixture(scope="module", autouse=True)
def backends():
    """"mok_cute" (raising) and "mok_cute_fallback" (fallback=True) in the experts registry."""
    mok_hf.register()
    mok_hf.register(name="mok_cute_fallback", fallback=True)


@functools.cache
def _fp32_model(model_type: str, **overrides):
    """A tiny float32 model on "eager" experts, its weights rounded to bf16 (so that its bf16 copy
    holds the same values); seeded (:func:`tools.hf_tiny.fp32_model`), built once per arguments."""
    return hf_tiny.fp32_model(model_type, **overrides)


def _copy(model, dtype, experts: str):
    """A copy of ``model`` in ``dtype`` on the ``experts`` backend."""
    out = copy.deepcopy(model).to(dtype)
    out.set_experts_implementation(experts)
    return out


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Logits [2, 16, VOCAB] (fp32) and every parameter's gradient (fp32; None if it got none)
    of one cross-entropy forward + backward on fixed tokens (:func:`tools.hf_tiny.step`)."""
    return hf_tiny.step(model)


def _errors(model_type: str, experts: str) -> dict[str, float]:
    """rel-L1 of the logits and of each parameter's gradient of the bf16 model on ``experts``
    against the float32 model on "eager" (a missing gradient counts as 1.0)."""
    ref = _fp32_model(model_type)
    logits32, grads32 = _step(ref)
    logits, grads = _step(_copy(ref, torch.bfloat16, experts))
    out = {"logits": rel_l1(logits, logits32)}
    out.update({n: 1.0 if grads[n] is None else rel_l1(grads[n], g) for n, g in grads32.items()})
    return out


_experts_of = hf_tiny.experts_of


@pytest.mark.parametrize("model_type", list(MODELS))
def test_model_matches_fp32_eager(model_type):
    """Logits and every parameter's gradient (experts, routers, shared experts and their gates,
    attention, norms, embeddings) within bf16 tolerances of the float32 eager model."""
    err = _errors(model_type, "mok_cute")
    assert err.pop("logits") <= LOGITS_TOL
    worst = max(err, key=err.get)
    assert err[worst] <= GRAD_TOL, (worst, err[worst])
    assert any(".experts." in n for n in err) and len(err) > 10


@pytest.mark.parametrize("model_type", list(MODELS))
def test_model_is_bitwise_deterministic(model_type):
    """Two forward + backward steps of the bf16 mok_cute model: the same logits and gradients, bitwise."""
    model = _copy(_fp32_model(model_type), torch.bfloat16, "mok_cute")
    (l1, g1), (l2, g2) = _step(model), _step(model)
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def _swapped_gate_up(self, hidden_states, top_k_index, top_k_weights):
    w_gate, w_up, w_down = mok_hf.expert_weights(self)
    return mok_cute.moe(hidden_states, top_k_index, top_k_weights.float(), w_up, w_gate, w_down, group=mok_hf.ONE_RANK)


def _detached_weights(self, hidden_states, top_k_index, top_k_weights):
    return mok_cute.moe(hidden_states, top_k_index, top_k_weights.float().detach(), *mok_hf.expert_weights(self),
                        group=mok_hf.ONE_RANK)


def test_the_tolerances_catch_a_wrong_layout_and_a_lost_router_gradient():
    """Two broken backends fail the comparison of :func:`test_model_matches_fp32_eager`."""
    ExpertsInterface.register("broken_swapped", _swapped_gate_up)
    ExpertsInterface.register("broken_detached", _detached_weights)
    swapped = _errors("qwen3_moe", "broken_swapped")
    assert swapped["logits"] > 10 * LOGITS_TOL and swapped["model.layers.0.mlp.experts.gate_up_proj"] > 10 * GRAD_TOL
    detached = _errors("qwen3_moe", "broken_detached")
    assert detached["logits"] <= LOGITS_TOL  # the forward is right ...
    assert detached["model.layers.0.mlp.gate.weight"] > 10 * GRAD_TOL  # ... the router gets no gradient


@pytest.mark.parametrize("model_type", list(MODELS))
def test_sparse_routing_matches_fp32_eager(model_type):
    """The first experts module alone, each token routed to 2 of its 4 experts: output and the
    gradients of the hidden states, routing weights and both weight tensors (and the biases)
    vs float32 eager."""
    _sparse_errors_within(_fp32_model(model_type), SPARSE_TOL)


def test_gpt_oss_clamps_match_fp32_eager():
    """gpt-oss's experts with limit 1 (10-20% of the gate / up values clamped), sparse routing:
    as :func:`test_sparse_routing_matches_fp32_eager`."""
    model = _fp32_model("gpt_oss", swiglu_limit=1.0)
    module = _experts_of(model)[0]
    gu = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) @ module.gate_up_proj[0].detach()
    assert (gu[:, 0::2] > 1.0).float().mean() > 0.05 and (gu[:, 1::2].abs() > 1.0).float().mean() > 0.05
    _sparse_errors_within(model, SPARSE_TOL)


def _sparse_errors_within(model, tol):
    g = torch.Generator().manual_seed(2)
    t, k = 64, 2
    x = torch.randn(t, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    dy = torch.randn(t, 64, generator=g).bfloat16()
    runs = []
    for dtype, experts in ((torch.float32, "eager"), (torch.bfloat16, "mok_cute")):
        module = _experts_of(_copy(model, dtype, experts))[0]
        xx, ww = (v.to(dtype).detach().clone().requires_grad_() for v in (x, w))
        y = module(xx, idx, ww)
        y.backward(dy.to(dtype))
        grads = (xx.grad, ww.grad, module.gate_up_proj.grad, module.down_proj.grad)
        if module.has_bias:
            grads += (module.gate_up_proj_bias.grad, module.down_proj_bias.grad)
        runs.append([v.detach().float() for v in (y, *grads)])
    names = ("y", "dx", "d topk_w", "d gate_up_proj", "d down_proj", "d gate_up_proj_bias", "d down_proj_bias")
    assert len(runs[1]) == len(runs[0]) >= 5
    for name, a, b in zip(names, runs[1], runs[0]):
        assert rel_l1(a, b) <= tol, name


@pytest.mark.parametrize("model_type", ["qwen3_moe", "aria_text"])
def test_weights_reach_the_layer_as_views(model_type, monkeypatch):
    """mok_cute.moe gets gate_up_proj's halves and down_proj themselves (no copy; gate first),
    fp32 routing weights and a one-rank expert-parallel group."""
    seen = []
    monkeypatch.setattr(mok_hf, "moe", lambda *a, **kw: seen.append((a, kw)) or mok_cute.moe(*a, **kw))
    model = _copy(_fp32_model(model_type), torch.bfloat16, "mok_cute")
    _step(model)
    experts = _experts_of(model)
    assert len(seen) == len(experts) == 2
    for (args, kw), module in zip(seen, experts):
        _, _, topk_w, w_gate, w_up, w_down = args
        gate_up, down = module.gate_up_proj, module.down_proj
        inter = w_gate.shape[1]
        half = inter * (1 if module.is_transposed else gate_up.shape[2]) * gate_up.element_size()
        assert w_gate.data_ptr() == gate_up.data_ptr() and w_up.data_ptr() == gate_up.data_ptr() + half
        assert w_down.data_ptr() == down.data_ptr()
        assert w_gate.shape == w_up.shape == (4, inter, 64) and w_down.shape == (4, 64, inter)
        assert topk_w.dtype == torch.float32 and _world(kw["group"]) == (1, 0) and kw["config"] == mok_cute.MoKConfig(validate_routing=False)


def test_expert_parallel_sentinels_are_no_expert():
    """With transformers' expert parallelism, ids >= num_experts (other ranks' experts, weight 0)
    run as -1 slots: the same output and gradients, bitwise."""
    module = _experts_of(_copy(_fp32_model("qwen3_moe"), torch.bfloat16, "mok_cute"))[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g).bfloat16()
    idx = torch.randint(0, 4, (16, 2), generator=g)
    idx[::3, 1] = 4
    w = torch.rand(16, 2, generator=g).masked_fill(idx == 4, 0.0)
    runs = []
    for ep, ids in ((True, idx), (False, idx.masked_fill(idx == 4, -1))):
        module._is_expert_parallel = ep
        module.zero_grad(set_to_none=True)
        y = module(x, ids, w)
        y.float().square().sum().backward()
        runs.append((y, module.gate_up_proj.grad, module.down_proj.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_gpt_oss_reaches_the_layer_as_interleaved_views_with_its_activation(monkeypatch):
    """gpt-oss's experts: mok_cute.moe gets (weight, bias) pairs of views -- gate / up the even /
    odd columns of the transposed gate_up_proj and of gate_up_proj_bias, down_proj transposed,
    down_proj_bias -- and SwiGLU(limit 7, alpha 1.702, up_offset 1) from the module; the
    gradients land in the four parameters."""
    seen = []
    monkeypatch.setattr(mok_hf, "moe", lambda *a, **kw: seen.append((a, kw)) or mok_cute.moe(*a, **kw))
    model = _copy(_fp32_model("gpt_oss"), torch.bfloat16, "mok_cute")
    _step(model)
    experts = _experts_of(model)
    assert len(seen) == len(experts) == 2
    for (args, kw), module in zip(seen, experts):
        (w_gate, b_gate), (w_up, b_up), (w_down, b_down) = args[3:]
        gate_up, bias = module.gate_up_proj, module.gate_up_proj_bias
        assert torch.equal(w_gate, gate_up.transpose(1, 2)[:, 0::2]) and torch.equal(w_up, gate_up.transpose(1, 2)[:, 1::2])
        assert w_gate.data_ptr() == gate_up.data_ptr() and w_up.data_ptr() == gate_up.data_ptr() + gate_up.element_size()
        assert w_gate.shape == w_up.shape == (4, 64, 64) and w_gate.stride() == (64 * 128, 2, 128)
        assert torch.equal(w_down, module.down_proj.transpose(1, 2)) and w_down.data_ptr() == module.down_proj.data_ptr()
        assert b_gate.data_ptr() == bias.data_ptr() and b_up.data_ptr() == bias.data_ptr() + bias.element_size()
        assert b_gate.stride() == b_up.stride() == (128, 2) and b_down is module.down_proj_bias
        assert kw["swiglu_limit"] == mok_cute.SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


@pytest.fixture
def own_gate(monkeypatch):
    """GptOssExperts with its ``_apply_gate`` replaced by another function of the same values: a
    model's own gated activation, which mok_cute cannot know, so it refuses it (or falls back)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gpt_oss_gate = GptOssExperts._apply_gate

    def own(self, gate_up):
        return gpt_oss_gate(self, gate_up)

    monkeypatch.setattr(GptOssExperts, "_apply_gate", own)


def test_other_gated_activation_raises_naming_it(own_gate):
    model = _copy(_fp32_model("gpt_oss"), torch.bfloat16, "mok_cute")
    with pytest.raises(NotImplementedError, match=r"GptOssExperts \(model_type 'gpt_oss'\)") as err:
        _step(model)
    message = str(err.value)
    for feature in ("GptOssExperts._apply_gate (alpha=1.702, limit=7.0)", "interleaved"):
        assert feature in message
    assert "bias" not in message  # biases are no refusal now


def test_other_gated_activation_falls_back_to_grouped_mm_with_one_warning(own_gate):
    ref = _fp32_model("gpt_oss")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, grads = _step(_copy(ref, torch.bfloat16, "mok_cute_fallback"))
    fallback = [w for w in caught if "grouped_mm" in str(w.message)]
    assert len(fallback) == 1 and "GptOssExperts" in str(fallback[0].message)  # two layers, one warning
    logits_mm, grads_mm = _step(_copy(ref, torch.bfloat16, "grouped_mm"))
    assert torch.equal(logits, logits_mm) and all(torch.equal(grads[n], grads_mm[n]) for n in grads)


def test_gpt_oss_biases_pass_the_sm90_check_and_are_refused_where_no_kernel_runs_them():
    """gpt-oss's experts (activation and biases) pass the sm90 and sm100 backends' check at bf16, EP = 1 (their
    kernels run them; the check runs here on CPU tensors); at mxfp8 both refuse the biases before any launch,
    naming them and not the activation; without the biases mxfp8 passes."""
    from mok_cute.layers.select import MoEInputs, get_backend

    module = _experts_of(_copy(_fp32_model("gpt_oss", hidden_size=256, intermediate_size=256), torch.bfloat16,
                               "mok_cute"))[0]
    x = torch.randn(8, 256).bfloat16()
    idx = torch.randint(0, 4, (8, 2))
    act = mok_hf.activation(module)
    inp = MoEInputs(x, idx, torch.rand(8, 2), *mok_hf.expert_weights(module), None, act,
                    biases=mok_hf.expert_biases(module))
    for arch in ("sm90", "sm100"):
        get_backend(arch).check(inp, mok_cute.MoKConfig(backend=arch), None)
    for arch, precision in (("sm100", "mxfp8"), ("sm90", "mxfp8")):
        with pytest.raises(NotImplementedError, match=rf"'{arch}': .*with expert biases") as err:
            get_backend(arch).check(inp, mok_cute.MoKConfig(backend=arch, precision=precision), None)
        assert "SwiGLU" not in str(err.value)
    get_backend("sm100").check(dataclasses.replace(inp, biases=None), mok_cute.MoKConfig(backend="sm100",
                                                                                          precision="mxfp8"), None)


@pytest.mark.parametrize("model_type, match", [
    ("qwen3_moe", r"bfloat16 .* Qwen3MoeExperts \(model_type 'qwen3_moe'\) has hidden states torch.float32"),
    ("gpt_oss", r"bfloat16 .* GptOssExperts \(model_type 'gpt_oss'\) has hidden states torch.float32.*"
                r"gate_up_proj_bias torch.float32"),
])
def test_float32_model_raises_naming_the_dtype(model_type, match):
    cfg = copy.deepcopy(_fp32_model(model_type).config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="mok_cute")
    with pytest.raises(TypeError, match=match):
        _step(model)


def test_float32_model_falls_back_to_grouped_mm():
    ref = _fp32_model("qwen3_moe")
    with pytest.warns(RuntimeWarning, match="float32"):
        logits, _ = _step(_copy(ref, torch.float32, "mok_cute_fallback"))
    assert torch.equal(logits, _step(_copy(ref, torch.float32, "grouped_mm"))[0])


def test_other_activation_raises_naming_it():
    model = _copy(_fp32_model("qwen3_moe", hidden_act="gelu"), torch.bfloat16, "mok_cute")
    with pytest.raises(NotImplementedError, match=r"Qwen3MoeExperts .* activation GELUActivation "
                                                  r"\(hidden_act 'gelu'\); mok_cute runs SiLU only"):
        _step(model)


def test_register_checks_its_arguments():
    with pytest.raises(TypeError, match="MoKConfig"):
        mok_hf.register({"precision": "bf16"})
    with pytest.raises(ValueError, match="eager"):
        mok_hf.register(name="eager")


def test_importing_mok_cute_does_not_import_transformers():
    code = ("import sys, mok_cute, mok_cute.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

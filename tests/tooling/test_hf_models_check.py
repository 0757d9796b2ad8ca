"""The Hugging Face models device check (tools/checks/hf_models.py) on the CPU, so that it cannot rot:
it is registered with ``python -m tools.gpu_check``, imports without transformers and skips (one ok row)
where transformers is missing, each model's tiny config and inputs build here with experts the SM90 backend
accepts (gpt-oss: refused for its biases alone, as the check's row expects), and each model's whole row runs
here on the reference backend -- also with the SM90 backend's own check (run on CPU tensors) in front of
every experts call, where gpt-oss's row is the documented refusal."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tools.checks import hf_models
from tools.checks.common import ROOT, Ctx, Row, all_skipped
from tools.gpu_check import check_names

CPU = torch.device("cpu")
CPU_CTX = Ctx(0, 1, CPU, "cpu")


def test_registered_and_listed_by_help():
    assert "hf_models" in check_names()
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    listed = out.split("checks:", 1)[1].split()
    assert "hf_models" in listed and {"layer_sm90", "fused_fwd"} <= set(listed)


def test_importing_the_check_does_not_import_transformers():
    code = ("import sys, tools.checks.hf_models, tools.hf_tiny; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_skips_with_one_ok_row_without_transformers(monkeypatch):
    monkeypatch.setattr(hf_models.hf_tiny, "transformers_problem", lambda: "transformers is not importable (test)")
    rows = hf_models.run(CPU_CTX)
    assert len(rows) == 1 and rows[0].ok and all_skipped(rows)
    assert ".hfnode/activate.sh" in rows[0].note and "not importable" in rows[0].note


def test_judge_fails_what_it_should():
    good = {"logits": (1e-2, 2e-2), "a.weight": (2e-2, 5e-2), "b.weight": (3e-2, 0.1)}
    assert hf_models.judge("x", good, [], 4, 4).ok
    assert not hf_models.judge("x", {**good, "a.weight": (6e-2, 0.1)}, [], 4, 4).ok
    assert hf_models.judge("x", {**good, "a.weight": (6e-2, 0.1)}, [], 4, 4, grad_rel_l1=1e-1).ok
    assert not hf_models.judge("x", {**good, "a.weight": (1e-2, 0.3)}, [], 4, 4).ok  # max-abs
    assert not hf_models.judge("x", {**good, "logits": (3e-2, 0.01)}, [], 4, 4).ok
    missing = hf_models.errors((torch.ones(2), {"a.weight": None}), (torch.ones(2), {"a.weight": torch.ones(3)}))
    assert missing["a.weight"] == (float("inf"), float("inf"))
    assert not hf_models.judge("x", {**good, **missing}, [], 4, 4).ok
    row = hf_models.judge("x", good, ["logits", "a.weight"], 4, 4)
    assert not row.ok and row.bitwise is False and "not bitwise: logits a.weight" in row.note
    assert not hf_models.judge("x", good, [], 2, 4).ok  # experts that did not run through mok_cute


# --- with transformers (its CPU build, as tests/integrations) ---------------------------------------------

@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers", minversion="5.17", reason="transformers >= 5.17 is not installed")
    import mok_cute.integrations.transformers as mok_hf

    return mok_hf


def _sm90_inputs(mok_hf, module, t=16, k=2):
    """The layer inputs the integration gives ``mok_cute.moe`` for the experts ``module`` (bf16, CPU)."""
    from mok_cute.layers.select import MoEInputs

    g = torch.Generator().manual_seed(3)
    h = module.down_proj.shape[1 if not module.is_transposed else 2]
    x = torch.randn(t, h, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(module.num_experts, generator=g)[:k] for _ in range(t)])
    act = mok_hf.activation(module)
    return MoEInputs(x, idx, torch.rand(t, k, generator=g), *mok_hf.expert_weights(module), None,
                     act, biases=mok_hf.expert_biases(module))


@pytest.mark.parametrize("model_type", hf_models.MODEL_TYPES)
def test_model_inputs_build_on_cpu_and_the_sm90_backend_takes_them(hf, model_type):
    """The check's tiny model and token ids build here (2 MoE layers, H and I multiples of 64, ids in the
    vocabulary and within the positions); the bf16 copy's experts are no refusal of the integration, and
    the SM90 backend's check (on CPU tensors) passes them, gpt-oss's biases included."""
    from mok_cute import MoKConfig
    from mok_cute.layers.select import get_backend

    model, ids = hf_models.build(model_type)
    assert model.config.model_type == model_type and next(model.parameters()).device == CPU
    assert ids.shape == hf_models.IDS_SHAPE and int(ids.max()) < hf_models.hf_tiny.VOCAB
    assert ids.shape[1] <= model.config.max_position_embeddings
    bf16 = hf_models.on(model, CPU, torch.bfloat16, "eager")
    experts = hf_models.hf_tiny.experts_of(bf16)
    assert len(experts) == 2
    for module in experts:
        _, inter, h = hf.expert_weights(module)[0].shape
        assert h % 64 == 0 and inter % 64 == 0
        assert hf.unsupported(module, torch.zeros(1, h, dtype=torch.bfloat16)) is None
        get_backend("sm90").check(_sm90_inputs(hf, module), MoKConfig(backend="sm90"), None)


@pytest.mark.filterwarnings("ignore:no CUDA device")
@pytest.mark.parametrize("model_type", hf_models.MODEL_TYPES)
def test_each_row_runs_here_on_the_reference_backend(hf, model_type):
    """The whole row (bf16 on mok_cute vs float32 eager, twice, every experts call counted) on the CPU
    reference backend: within the check's tolerances and bitwise."""
    from mok_cute import MoKConfig

    row = hf_models.compare(model_type, CPU, MoKConfig(backend="reference"))
    assert isinstance(row, Row) and row.ok and row.bitwise is True, row
    assert "experts calls 4/4" in row.note and row.max_err < hf_models.GRAD_MAX_ABS


@pytest.fixture
def sm90_checked(hf, monkeypatch):
    """The integration's ``mok_cute.moe`` with the SM90 backend's check (CPU tensors) in front of it: what
    the SM90 backend refuses raises as on the GPU; the rest runs on the given config (the reference)."""
    from mok_cute import MoKConfig
    from mok_cute.layers.select import MoEInputs, get_backend

    real = hf.moe

    def moe(x, idx, w, *routed, swiglu_limit=None, config=None, group=None):
        ws, bs = (tuple(zip(*routed)) if isinstance(routed[0], tuple) else (routed, None))
        get_backend("sm90").check(MoEInputs(x, idx, w, *ws, None, swiglu_limit, biases=bs),
                                  MoKConfig(backend="sm90"), None)
        return real(x, idx, w, *routed, swiglu_limit=swiglu_limit, config=config, group=group)

    monkeypatch.setattr(hf, "moe", moe)


@pytest.mark.filterwarnings("ignore:no CUDA device")
@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen2_moe"])
def test_rows_with_the_sm90_check_in_front(sm90_checked, model_type):
    """With the SM90 backend's check in front of every experts call, gpt-oss (biases) and Qwen2-MoE (shared
    expert, its gate) are comparison rows as without it: the check passes both."""
    from mok_cute import MoKConfig

    row = hf_models.compare(model_type, CPU, MoKConfig(backend="reference"))
    assert row.ok and row.bitwise is True and "experts calls 4/4" in row.note

"""MoKConfig(activations="recompute"): the forward keeps no activations and the backward runs
the forward once more (no autograd) before the backward; every gradient is bitwise the
"save" policy's (reference backend; the GPU backends run the same autograd function)."""
import pytest
import torch

import mok_cute
from mok_cute.layers import select
from mok_cute.config import MoKConfig

from conftest import make_problem


def _grads(activations, p, dy, main_grads=None):
    leaves = [p["x"].clone().requires_grad_(), p["topk_w"].clone().requires_grad_(),
              *(p[n].clone().requires_grad_() for n in ("w_gate", "w_up", "w_down"))]
    sh = [w.clone().requires_grad_() for w in p["shared"]] if p["shared"] else []
    y = mok_cute.moe(leaves[0], p["topk_idx"], leaves[1], *leaves[2:], shared=tuple(sh) or None,
                     swiglu_limit=4.0, config=MoKConfig(backend="reference", activations=activations),
                     main_grads=main_grads)
    want = leaves + (sh if main_grads is None else [])
    if main_grads is not None:
        want = leaves[:2]
    return [y] + list(torch.autograd.grad(y, want, dy))


@pytest.mark.parametrize("shared_I", [None, 64])
def test_recompute_gives_the_saved_gradients_bitwise(shared_I):
    p, dy = make_problem(T=40, H=64, I=64, E=4, k=2, shared_I=shared_I, seed=3)
    a, b = _grads("save", p, dy), _grads("recompute", p, dy)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_recompute_runs_the_forward_again_and_keeps_no_state(monkeypatch):
    calls = _spy(monkeypatch)
    p, dy = make_problem(T=24, H=64, I=64, E=4, k=2, seed=5)
    for policy, want in (("save", ["forward", ("backward", True)]),
                         ("recompute", ["forward", "forward", ("backward", True)])):
        calls.clear()
        _grads(policy, p, dy)
        assert calls == want, (policy, calls)


def test_recompute_with_main_grads():
    p, dy = make_problem(T=24, H=64, I=64, E=4, k=2, shared_I=64, seed=6)
    shapes = [p[n].shape for n in ("w_gate", "w_up", "w_down")] + [w.shape for w in p["shared"]]
    accs = {pol: [torch.zeros(s) for s in shapes] for pol in ("save", "recompute")}
    for pol in accs:
        _grads(pol, p, dy, main_grads=tuple(accs[pol]))
    assert all(torch.equal(u, v) for u, v in zip(accs["save"], accs["recompute"]))
    assert any(bool(a.abs().sum()) for a in accs["save"])


def test_bad_policy():
    with pytest.raises(ValueError, match="activations"):
        MoKConfig(activations="offload")


def _spy(monkeypatch):
    """The calls the layer makes of its backend (what the custom op looks up), recorded in order."""
    calls = []
    real = select.get_backend

    class Spy:
        def __init__(self, be):
            self.be = be

        def forward(self, *a):
            calls.append("forward")
            return self.be.forward(*a)

        def backward(self, state, dy, main_grads=None):
            calls.append(("backward", state is not None))
            return self.be.backward(state, dy, main_grads=main_grads)

    monkeypatch.setattr(select, "get_backend", lambda name: Spy(real(name)))
    return calls


def _two_layers(p, dy, cfg):
    """Two layer calls in a row (the second on the first's output), then one backward: every
    gradient of the inputs and of both calls' weights."""
    leaves = [p["x"].clone().requires_grad_()] + [p[n].clone().requires_grad_() for n in ("w_gate", "w_up", "w_down")]
    y = mok_cute.moe(leaves[0], p["topk_idx"], p["topk_w"], *leaves[1:], swiglu_limit=4.0, config=cfg)
    y = mok_cute.moe(y, p["topk_idx"], p["topk_w"], *leaves[1:], swiglu_limit=4.0, config=cfg)
    return [y] + list(torch.autograd.grad(y, leaves, dy))


def test_budget_keeps_what_fits_and_recomputes_the_rest(monkeypatch):
    """activations="budget": with room for one call's activations the first call keeps them and
    the second recomputes (three forwards in all); no room: both recompute; room for both: none
    does; every gradient bitwise the "save" policy's; the held bytes return to where they were."""
    from mok_cute import custom_ops

    p, dy = make_problem(T=32, H=64, I=64, E=4, k=2, seed=8)
    want = _two_layers(p, dy, MoKConfig(backend="reference"))
    calls = _spy(monkeypatch)
    held0 = custom_ops._HELD[0]
    leaves = [p["x"]] + [p[n] for n in ("w_gate", "w_up", "w_down")]
    _, state = mok_cute.reference.moe_forward(p["x"], p["topk_idx"], p["topk_w"], *leaves[1:], None, 4.0)
    one = custom_ops._state_bytes(state, leaves + [p["topk_idx"], p["topk_w"]])
    assert one > 0
    for budget_mb, forwards in ((0.0, 4), (1.5 * one / 2 ** 20, 3), (4 * one / 2 ** 20, 2)):
        calls.clear()
        got = _two_layers(p, dy, MoKConfig(backend="reference", activations="budget", activation_budget_mb=budget_mb))
        assert calls.count("forward") == forwards, (budget_mb, calls)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert custom_ops._HELD[0] == held0


def test_budget_config_errors():
    with pytest.raises(ValueError, match="activation_budget_mb"):
        MoKConfig(activations="budget")
    with pytest.raises(ValueError, match="activation_budget_mb"):
        MoKConfig(activation_budget_mb=10.0)
    with pytest.raises(ValueError, match="activation_budget_mb"):
        MoKConfig(activations="budget", activation_budget_mb=-1.0)
    assert MoKConfig(activations="budget", activation_budget_mb=0).activation_budget_mb == 0

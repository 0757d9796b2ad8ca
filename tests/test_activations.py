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

    monkeypatch.setattr(select, "get_backend", lambda name: Spy(real(name)))  # what the custom op looks up
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

"""``Sm90ExpertMLP.backward_fused`` (FUSED_WHOLE at EP = 1) on the CPU: one ``fused_bwd.fused_backward``
call built from the forward state, the launch itself replaced by a recorder."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from mok_cute import MoKConfig
from mok_cute.layers.common import ExpertGroup

BF = torch.bfloat16


def _state(t=4, k=2, h=64, i=64):
    g = ExpertGroup(None, torch.tensor([0, 5, 8]), torch.randn(8, 2 * i).to(BF), torch.randn(8, i).to(BF))
    w = (torch.randn(2, i, h).to(BF), torch.randn(2, i, h).to(BF), torch.randn(2, h, i).to(BF))
    rows = torch.randn(t * k, 2 * h).to(BF)[:, :h]  # not contiguous: the launch gets a contiguous copy
    return SimpleNamespace(routed=g, x=torch.randn(t, h).to(BF), rows=rows, order=torch.arange(t * k),
                           topk_w=torch.rand(k, t).t(), topk_idx=torch.zeros(t, k, dtype=torch.int32), weights=w,
                           limit=4.0, rows_by_route=True, config=MoKConfig(comm_sms_bwd=10, trace=False),
                           shared_group=None, shared=None)


def test_backward_fused_hands_the_launch_its_operands(monkeypatch):
    from mok_cute.kernels.sm90 import fused_bwd
    from mok_cute.layers.sm90 import Sm90ExpertMLP

    calls = []
    monkeypatch.setattr(fused_bwd, "fused_backward", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    st = _state()
    dy = torch.randn(4, 64).to(BF)
    assert Sm90ExpertMLP().backward_fused(st, dy) == (0, 1, 2, 3, 4, None)
    (a, kw), = calls
    inputs, plan, weights, limit, launch = a
    assert inputs.dy is dy and inputs.x is st.x and inputs.gu is st.routed.gu and inputs.h is st.routed.h
    assert inputs.r_rows.is_contiguous() and torch.equal(inputs.r_rows, st.rows) and inputs.rows_by_route is True
    assert plan.order is st.order and plan.topk_idx is st.topk_idx and plan.offsets.dtype == torch.int32
    assert plan.topk_w.is_contiguous() and torch.equal(plan.topk_w, st.topk_w)
    assert tuple(weights) == st.weights and limit == 4.0
    assert (launch.comm_ctas, launch.trace, launch.mx) == (10, False, False)
    assert kw == {"shared": None, "main_grads": None}


def test_backward_fused_mxfp8_runs_the_shared_expert_first(monkeypatch):
    from mok_cute.kernels.sm90 import fused_bwd
    from mok_cute.layers import sm90 as S

    calls, dxs = [], torch.randn(4, 64).to(BF)
    monkeypatch.setattr(fused_bwd, "fused_backward", lambda *a, **kw: calls.append((a, kw)) or tuple(range(8)))
    monkeypatch.setattr(S, "shared_backward", lambda m, group, dy, shared, limit, *how: (dxs, "d shared"))
    mlp = S.Sm90ExpertMLP()
    monkeypatch.setattr(mlp, "_bwd_weights", lambda g, *w: ("qg", "qu", "qd"))
    st = _state()
    st.routed = replace(st.routed, precision="mxfp8")
    assert mlp.backward_fused(st, torch.randn(4, 64).to(BF)) == (0, 1, 2, 3, 4, "d shared")
    (a, kw), = calls
    assert a[2] == ("qg", "qu", "qd") and a[4].mx is True and torch.equal(a[5], dxs)

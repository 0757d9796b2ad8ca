"""The public functional API: :func:`moe` through a torch.autograd.Function."""
from __future__ import annotations

import torch

from .backend import MoEInputs, get_backend, select_backend
from .config import MoKConfig
from .reference import _world
from .validate import check_moe_inputs


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, config, group, swiglu_limit, x, topk_idx, topk_w, w_gate, w_up,
                w_down, ws_gate, ws_up, ws_down):
        shared = None if ws_gate is None else (ws_gate, ws_up, ws_down)
        inp = MoEInputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit)
        y, state = backend.forward(inp, config, group)
        ctx.backend, ctx.state, ctx.has_shared = backend, state, shared is not None
        ctx.mark_non_differentiable(topk_idx)
        return y

    @staticmethod
    def backward(ctx, dy):
        g = ctx.backend.backward(ctx.state, dy.contiguous())
        ctx.state = None
        d_shared = g.d_shared if ctx.has_shared else (None, None, None)
        return (None, None, None, None, g.dx, None, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down,
                *d_shared)


def moe(x, topk_idx, topk_w, w_gate, w_up, w_down, *, shared=None, swiglu_limit=None, config=None,
        group=None) -> torch.Tensor:
    """One MoE layer (dispatch, expert MLPs, combine) on this rank; differentiable.

    x [T, H] bf16; topk_idx [T, k] int32/int64 global expert ids (-1: no expert);
    topk_w [T, k] fp32; w_gate, w_up [E_local, I, H] bf16 and w_down [E_local, H, I] bf16 are
    this rank's experts (rank p of EP owns experts [p*E_local, (p+1)*E_local));
    shared = (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s]) bf16 or None;
    swiglu_limit: None or L > 0 (gate clamped to <= L, up to [-L, L]);
    group: torch.distributed group of the expert-parallel ranks (None: the default group if
    initialized, else EP = 1). Returns y [T, H] bf16. Numerics: mok_cute.reference.
    """
    config = config if config is not None else MoKConfig()
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig or None, got {type(config).__name__}")
    ep, _ = _world(group)
    check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, ep,
                     check_values=config.validate_routing)
    backend = get_backend(select_backend(x.device, config))
    ws = tuple(w.contiguous() for w in shared) if shared is not None else (None, None, None)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    return _MoEFunction.apply(backend, config, group, limit, x.contiguous(), topk_idx.contiguous(),
                              topk_w.contiguous(), w_gate.contiguous(), w_up.contiguous(),
                              w_down.contiguous(), *ws)

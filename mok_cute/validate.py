"""Input checks for the public API: clear TypeError/ValueError before any kernel runs.

Alignment the kernels need: H, I (and the shared expert's I_s) are multiples of 64
(MXFP8 blocks of 32 along H and I, 16-byte TMA row strides, whole 64-wide K tiles).
"""
from __future__ import annotations

import math

import torch

from .reference import SwiGLU

ALIGN = 64


def _tensor(name: str, t, dtypes: tuple, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")


def _shape(name: str, t: torch.Tensor, want: tuple, what: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {what} = {want}, got {tuple(t.shape)}")


def _aligned(name: str, v: int) -> None:
    if v % ALIGN:
        raise ValueError(f"{name} = {v} must be a multiple of {ALIGN} (MXFP8 blocks, TMA alignment, K tiles)")


def check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, ep: int,
                     check_values: bool = True) -> None:
    """Validate the arguments of :func:`mok_cute.moe` (weights are the local slice; E = E_local * ep)."""
    bf16 = (torch.bfloat16,)
    _tensor("x", x, bf16, 2)
    _tensor("topk_idx", topk_idx, (torch.int32, torch.int64), 2)
    _tensor("topk_w", topk_w, (torch.float32,), 2)
    _tensor("w_gate", w_gate, bf16, 3)
    _tensor("w_up", w_up, bf16, 3)
    _tensor("w_down", w_down, bf16, 3)
    t, h = x.shape
    e_local, inter, _ = w_gate.shape
    k = topk_idx.shape[1]
    n_exp = e_local * ep
    _shape("topk_idx", topk_idx, (t, k), "[T, k]")
    _shape("topk_w", topk_w, (t, k), "[T, k]")
    _shape("w_gate", w_gate, (e_local, inter, h), "[E_local, I, H]")
    _shape("w_up", w_up, (e_local, inter, h), "[E_local, I, H]")
    _shape("w_down", w_down, (e_local, h, inter), "[E_local, H, I]")
    if k > n_exp:
        raise ValueError(f"topk_idx has k = {k} slots but there are only E = {n_exp} experts (k <= E)")
    _aligned("hidden size H", h)
    _aligned("intermediate size I", inter)
    tensors = [("x", x), ("topk_idx", topk_idx), ("topk_w", topk_w), ("w_gate", w_gate),
               ("w_up", w_up), ("w_down", w_down)]
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise TypeError("shared must be None or a tuple (ws_gate, ws_up, ws_down)")
        names = ("shared[0] (ws_gate)", "shared[1] (ws_up)", "shared[2] (ws_down)")
        for n, w in zip(names, shared):
            _tensor(n, w, bf16, 2)
        i_s = shared[0].shape[0]
        _shape(names[0], shared[0], (i_s, h), "[I_s, H]")
        _shape(names[1], shared[1], (i_s, h), "[I_s, H]")
        _shape(names[2], shared[2], (h, i_s), "[H, I_s]")
        _aligned("shared intermediate size I_s", i_s)
        tensors += list(zip(names, shared))
    if swiglu_limit is not None and not isinstance(swiglu_limit, SwiGLU):  # (a SwiGLU checked itself)
        if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)):
            raise TypeError(f"swiglu_limit must be None or a float (or a mok_cute.SwiGLU), "
                            f"got {type(swiglu_limit).__name__}")
        if not math.isfinite(swiglu_limit) or swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be a positive finite float, got {swiglu_limit}")
    dev = x.device
    for n, tt in tensors:
        if tt.device != dev:
            raise ValueError(f"{n} is on {tt.device} but x is on {dev}: all tensors must share a device")
    if check_values:
        bad = (topk_idx < -1) | (topk_idx >= n_exp)
        if bool(bad.any()):
            v = int(topk_idx[bad][0])
            raise ValueError(f"topk_idx holds expert id {v}; ids must be -1 (no expert) or in [0, E = {n_exp})")


def split_biases(w_gate, w_up, w_down):
    """``((w_gate, w_up, w_down), biases)`` of :func:`mok_cute.moe`'s weight arguments: each a
    tensor (biases None), or each a pair (weight, bias) -- all three or none -- (biases
    ``(b_gate, b_up, b_down)``). Checks the form only (:func:`check_expert_biases` the biases)."""
    pairs = [isinstance(w, (tuple, list)) for w in (w_gate, w_up, w_down)]
    if not any(pairs):
        return (w_gate, w_up, w_down), None
    names = ("w_gate", "w_up", "w_down")
    if not all(pairs):
        raise TypeError("w_gate, w_up, w_down must all be tensors or all be (weight, bias) pairs (expert biases), "
                        f"got pairs for {', '.join(n for n, q in zip(names, pairs) if q)} only")
    for n, w in zip(names, (w_gate, w_up, w_down)):
        if len(w) != 2:
            raise TypeError(f"{n} must be a tensor or a (weight, bias) pair, got a sequence of length {len(w)}")
    return (w_gate[0], w_up[0], w_down[0]), (w_gate[1], w_up[1], w_down[1])


def check_expert_biases(biases, w_gate, w_down) -> None:
    """The routed experts' biases of :func:`mok_cute.moe` (None, or (b_gate, b_up, b_down)):
    bf16 (the weights' dtype) b_gate, b_up [E_local, I] and b_down [E_local, H], on the weights'
    device (any strides: e.g. gpt-oss's interleaved ``gate_up_proj_bias[:, ::2]``)."""
    if biases is None:
        return
    e_local, inter, h = w_gate.shape
    names = ("b_gate (w_gate's bias)", "b_up (w_up's bias)", "b_down (w_down's bias)")
    for n, b, want, what in zip(names, biases, ((e_local, inter), (e_local, inter), (e_local, h)),
                                ("[E_local, I]", "[E_local, I]", "[E_local, H]")):
        _tensor(n, b, (torch.bfloat16,), 2)
        _shape(n, b, want, what)
        if b.device != w_gate.device:
            raise ValueError(f"{n} is on {b.device} but w_gate is on {w_gate.device}")


def check_main_grads(main_grads, weights, biased: bool = False) -> None:
    """``main_grads`` of :func:`mok_cute.moe`: a tuple/list of fp32 tensors, one per weight in the
    order w_gate, w_up, w_down (then ws_gate, ws_up, ws_down with a shared expert, then
    shared_gate with its output gate, then b_gate, b_up, b_down with expert biases: ``biased``),
    each of its weight's shape, contiguous, on its device."""
    names = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down", "shared_gate")[:len(weights) - 3 * biased]
    names += ("b_gate", "b_up", "b_down") if biased else ()
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != len(weights):
        raise TypeError(f"main_grads must be a tuple of {len(weights)} fp32 tensors ({', '.join(names)})"
                        f", got {type(main_grads).__name__} of length {len(main_grads) if hasattr(main_grads, '__len__') else '?'}")
    for name, g, w in zip(names, main_grads, weights):
        what = f"main_grads[{names.index(name)}] ({name})"
        _tensor(what, g, (torch.float32,), w.dim())
        _shape(what, g, tuple(w.shape), f"{name}'s shape")
        if g.device != w.device:
            raise ValueError(f"{what} is on {g.device} but {name} is on {w.device}")
        if not g.is_contiguous():
            raise ValueError(f"{what} must be contiguous (it is accumulated in place)")


def check_shared_gate(shared_gate, shared, x) -> None:
    """``shared_gate`` of :func:`mok_cute.moe`: None, or the shared expert's output gate weight,
    a bf16 tensor [1, H] on x's device (needs ``shared``)."""
    if shared_gate is None:
        return
    if shared is None:
        raise ValueError("shared_gate (the shared expert's output gate) needs shared (the shared expert)")
    _tensor("shared_gate", shared_gate, (torch.bfloat16,), 2)
    _shape("shared_gate", shared_gate, (1, x.shape[1]), "[1, H]")
    if shared_gate.device != x.device:
        raise ValueError(f"shared_gate is on {shared_gate.device} but x is on {x.device}")


def check_num_experts(num_experts: int, ep: int) -> int:
    """E_local for E experts over ``ep`` ranks; E must be divisible by EP."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % ep:
        raise ValueError(f"num_experts E = {num_experts} must be divisible by the expert-parallel size EP = {ep}")
    return num_experts // ep

"""The public functional API: :func:`moe` (eager: an autograd.Function; under torch.compile: the
``mok_cute::moe_fwd`` / ``moe_bwd`` custom ops, traced without a graph break; both over
:mod:`mok_cute.custom_ops`'s core), and :func:`expert_mlp`."""
from __future__ import annotations

import torch

from .custom_ops import (
    ExpertMLPFunction, LayerCall, MoEFunction, config_key, expert_mlp_fwd, group_key, mlp_activation, moe_fwd,
)
from . import fc1 as fc1_views, transposed
from .config import MoKConfig
from .dsl.host import weight_operand
from .reference import SwiGLU, _world
from .validate import check_expert_biases, check_main_grads, check_moe_inputs, check_shared_gate, split_biases


def moe(x, topk_idx, topk_w, w_gate, w_up, w_down, *, shared=None, swiglu_limit=None, config=None,
        group=None, main_grads=None, shared_gate=None) -> torch.Tensor:
    """One MoE layer (dispatch, expert MLPs, combine) on this rank; differentiable.

    x [T, H] bf16; topk_idx [T, k] int32/int64 global expert ids (-1: no expert);
    topk_w [T, k] fp32; w_gate, w_up [E_local, I, H] bf16 and w_down [E_local, H, I] bf16 are
    this rank's experts (rank p of EP owns experts [p*E_local, (p+1)*E_local));
    shared = (ws_gate [I_s, H], ws_up [I_s, H], ws_down [H, I_s]) bf16 or None;
    swiglu_limit: the experts' activation (every expert, the shared one too): None (silu(g) * u),
    L > 0 (gate clamped to <= L, up to [-L, L]), or a :class:`~mok_cute.reference.SwiGLU`
    ``(limit, alpha, up_offset)``: h = gc * sigmoid(alpha * gc) * (uc + up_offset) with the
    clamped gc, uc (``SwiGLU.gpt_oss()``: L 7, alpha 1.702, up_offset 1);
    group: torch.distributed group of the expert-parallel ranks (None: the default group if
    initialized, else EP = 1), or a :class:`mok_cute.comm.virtual.VirtualGroup` (virtual ranks
    in one process: call inside its ``run_ranks``). Returns y [T, H] bf16. Numerics:
    mok_cute.reference.

    main_grads: None, or fp32 tensors of the weights' shapes in the order w_gate, w_up, w_down
    (then ws_gate, ws_up, ws_down with a shared expert): the backward adds each weight's
    gradient into its tensor in fp32 (``main_grad += fp32(dW)``; Megatron's gradient-accumulation
    fusion) and returns no gradient for the weights, so their ``.grad`` stays None.

    shared_gate: None, or the shared expert's output gate w_sg [1, H] bf16 (Qwen-style; needs
    ``shared``): y = bf16(fp32(shared(x)) * g + routed sum) with g = bf16(sigmoid(x . w_sg^T))
    per token (mok_cute.reference). Its gradient is computed in fp32 (kept in fp32 through
    ``main_grads``, whose last tensor it then is; autograd's ``.grad`` is bf16). Every backend
    runs it at EP = 1; the GPU backends raise NotImplementedError for it at EP > 1.

    config: :class:`~mok_cute.config.MoKConfig` (None: the defaults). Its fields are the only
    choices: the environment does not override them (``mok_cute.dsl.env`` holds the process-level
    variables, e.g. ``MOK_CUTE_TRACE``, the default of ``config.trace`` only). The GPU backends
    decide the forward and backward paths once per call (:mod:`mok_cute.layers.paths`).

    Expert biases (gpt-oss): w_gate, w_up, w_down may each be a pair (weight, bias) instead, all
    three or none, with b_gate, b_up [E_local, I] and b_down [E_local, H] bf16 (any strides: e.g.
    the interleaved ``gate_up_proj_bias[:, ::2]``): the gate / up bias is added to GEMM1's fp32
    result before its rounding, the down bias to GEMM2's, inside the expert's output, which the
    routing weight then scales (as gpt-oss). Their gradients are bf16 (with ``main_grads``: three
    more fp32 tensors, last). Weights may be strided views too (gate / up interleaved in one
    projection: ``gate_up[:, ::2]``, ``gate_up[:, 1::2]``): used in place where the kernels' TMA
    addresses them, else copied to contiguous operands. When w_gate and w_up are views of one tensor
    (a model's ``gate_up_proj``: [E, 2I, H] or [E, H, 2I], halves or interleaved), autograd takes that
    tensor and its gradient comes as one tensor in its layout (:mod:`mok_cute.fc1`; eager calls without
    ``main_grads``). Every backend runs the SwiGLU's alpha /
    up_offset (the GPU kernels compile them in). The biases run on the reference backend and on the GPU
    backends at bf16, EP = 1 (their GEMM epilogues add them; their gradients are per-expert row sums in a fixed
    order in fp32, rounded once); elsewhere (mxfp8, fp8_block, EP > 1) the GPU backends raise
    NotImplementedError naming them before any launch.

    Under ``torch.compile`` the routing values are not checked on the host (``validate_routing``
    needs a host sync): an id outside [-1, E) is then handled as with ``validate_routing=False``.
    """
    config = config if config is not None else MoKConfig()
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig or None, got {type(config).__name__}")
    (w_gate, w_up, w_down), biases = split_biases(w_gate, w_up, w_down)
    ep, _ = _world(group)
    check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit, ep,
                     check_values=config.validate_routing and not torch.compiler.is_compiling())
    check_shared_gate(shared_gate, shared, x)
    check_expert_biases(biases, w_gate, w_down)
    given = ((w_gate, w_up, w_down) + (tuple(shared) if shared is not None else ())
             + ((shared_gate,) if shared_gate is not None else ()) + (tuple(biases) if biases is not None else ()))
    if main_grads is not None:
        check_main_grads(main_grads, given, biased=biases is not None)
        main_grads = tuple(main_grads)
    act = swiglu_limit if isinstance(swiglu_limit, SwiGLU) else SwiGLU(swiglu_limit)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_w) + given)
    # weights as given when the kernels' TMA addresses them in place (fc1 halves: no copy)
    x, topk_idx, topk_w = x.contiguous(), topk_idx.contiguous(), topk_w.contiguous()
    compiling = torch.compiler.is_compiling()
    # gate / up as views of one tensor (a model's gate_up_proj): autograd takes that tensor (mok_cute.fc1)
    eager = main_grads is None and not compiling
    fc1 = fc1_views.find(w_gate, w_up) if eager else None
    # transposed weights (e.g. gpt-oss's down_proj) as given: the layer re-lays them out (mok_cute.transposed)
    mats = given[0 if fc1 is None else 2:6 if shared is not None else 3]
    flip = [eager and transposed.is_transposed(w) for w in mats]
    weights = [w if f else weight_operand(w) for w, f in zip(mats, flip)]
    if fc1 is not None:
        weights, flip = [fc1.base, *weights], [False, *flip]
    weights += [] if shared_gate is None else [shared_gate.contiguous()]
    weights += [] if biases is None else [b.contiguous() for b in biases]
    if compiling:  # the custom ops: opaque to the trace, no graph break
        return moe_fwd(x, topk_idx, topk_w, weights, list(main_grads or ()), act.limit, config_key(config),
                       group_key(group), keep, act.alpha, act.up_offset, biases is not None)[0]
    call = LayerCall(config, group, keep, act, topk_idx, main_grads, biases is not None,
                     None if fc1 is None else (fc1.transposed, fc1.interleaved),
                     tuple(i for i, f in enumerate(flip) if f))
    return MoEFunction.apply(call, x, topk_w, *weights)


def expert_mlp(x_rows, offsets, w_gate, w_up, w_down, *, swiglu_limit=None, config=None):
    """Grouped expert MLP (tokens already grouped by expert), differentiable.

    x_rows [M, H] bf16, expert e owns rows offsets[e]..offsets[e+1] (offsets [E+1] int32 on
    x's device, non-decreasing, offsets[0] = 0, offsets[E] <= M; rows past offsets[E] are
    ignored); w_gate, w_up [E, I, H], w_down [E, H, I] bf16. Returns out [M, H] bf16 with
    out[rows of e] = bf16(swiglu(x.Wg^T, x.Wu^T) . Wd^T) (numerics of mok_cute.reference; ``swiglu_limit``:
    None, L, or a :class:`~mok_cute.reference.SwiGLU`, e.g. ``SwiGLU.gpt_oss()``, as for :func:`moe`);
    rows past offsets[E] are unspecified. Precision ``config.precision`` (bf16, mxfp8,
    fp8_block: the reference's numerics for each; a backend that does not run it raises
    NotImplementedError). Backend: sm90 kernels on capability 9.0, sm100 on
    10.x (compile-verified only), the reference elsewhere (``config.backend`` overrides, as for
    :func:`moe`). Backward: ``config.backward_path`` (None: the fused backward core on SM90 in
    BF16 / MXFP8, the separate kernels otherwise; FUSED_WHOLE needs the layer's routing and is
    refused); ``config.forward_path`` does not apply (the grouped GEMMs run either way).
    """
    config = config if config is not None else MoKConfig()
    for arg, t, nd in (("x_rows", x_rows, 2), ("w_gate", w_gate, 3), ("w_up", w_up, 3), ("w_down", w_down, 3)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != nd:
            raise TypeError(f"{arg} must be a {nd}-D bfloat16 tensor")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int32, torch.int64) \
            or offsets.shape != (w_gate.shape[0] + 1,):
        raise TypeError(f"offsets must be an int32/int64 tensor of shape [E+1] = [{w_gate.shape[0] + 1}]")
    act = swiglu_limit if isinstance(swiglu_limit, SwiGLU) else SwiGLU(
        None if swiglu_limit is None else float(swiglu_limit))
    args = (x_rows.contiguous(), offsets, w_gate.contiguous(), w_up.contiguous(), w_down.contiguous())
    if torch.compiler.is_compiling():  # the custom ops (mok_cute::expert_mlp_fwd / _bwd): no graph break
        keep = torch.is_grad_enabled() and any(t.requires_grad for t in (args[0], *args[2:]))
        return expert_mlp_fwd(*args, act.limit, config_key(config), keep, act.alpha, act.up_offset)[0]
    return ExpertMLPFunction.apply(config, mlp_activation(act.limit, act.alpha, act.up_offset), *args)

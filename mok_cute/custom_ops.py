"""The layer (and :func:`mok_cute.expert_mlp`) as ``torch.library`` custom ops, so that
``torch.compile(..., fullgraph=True)`` traces a model calling :func:`mok_cute.moe` without a graph
break (the ops are opaque to it; their fake implementations give the output shapes); eager calls
run the same core through autograd.Functions.

* ``mok_cute::moe_fwd(x, topk_idx, topk_w, weights[], main_grads[], swiglu_limit?, config, group,
  keep, swiglu_alpha, swiglu_up_offset, biased) -> (y, handle)``: the backend's forward.
  ``weights``: the layer's weights present, in the order w_gate, w_up, w_down, ws_gate, ws_up,
  ws_down, shared_gate, b_gate, b_up, b_down (the shared expert's three, then its gate: it needs
  the shared expert; the routed experts' biases last, with ``biased``). The activation is
  :class:`~mok_cute.reference.SwiGLU` ``(swiglu_limit, swiglu_alpha, swiglu_up_offset)``.
  ``config``: the :class:`~mok_cute.config.MoKConfig` as a string
  (:func:`config_key`), ``group``: a key of :func:`group_key` (0: none). With ``keep`` (a
  backward will follow) the backend's state is held in a table under the int64 handle's id
  until the backward takes it or the handle tensor is freed; without it nothing is kept.
* ``mok_cute::moe_bwd(dy, handle, x, topk_w, weights[], main_grads[], biased) -> 12 tensors``: the
  backward of the forward that made ``handle``, adding into ``main_grads`` (mutated) when given:
  dx, d topk_w, then one per weight slot (``weights``' order; an empty tensor for each slot past
  the weights given, and for a weight whose gradient ``main_grads`` took).

Autograd is registered on ``moe_fwd`` (``torch.library.register_autograd``). Eager calls take
:class:`MoEFunction` over the same :func:`run_forward` / :func:`run_backward` (the ops' Python
dispatch costs about 0.2 ms per call); :func:`mok_cute.moe` picks the ops under torch.compile.
``mok_cute::expert_mlp_fwd`` / ``expert_mlp_bwd`` and :class:`ExpertMLPFunction` do the same for
the grouped expert MLP.
"""
from __future__ import annotations

import itertools
import json
import weakref
from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from . import fc1, transposed
from .config import MoKConfig
from .reference import SwiGLU

_STATES: dict[int, tuple] = {}  # handle id -> a forward's entry for its backward (run_forward, run_mlp_forward)
_IDS = itertools.count(1)
_CONFIGS: dict[str, MoKConfig] = {}
_GROUPS = weakref.WeakValueDictionary()  # key -> group (a group is not kept alive by being used)


def config_key(config: MoKConfig) -> str:
    """``config`` as the string argument of the ops (JSON of its fields, made at construction)."""
    return config._key


def _config(key: str) -> MoKConfig:
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = MoKConfig(**json.loads(key))
    return cfg


def group_key(group) -> int:
    """The int argument of the ops for ``group`` (0 for None)."""
    if group is None:
        return 0
    _GROUPS[id(group)] = group  # (torch.distributed groups and VirtualGroup are weak-referenceable)
    return id(group)


def _drop(i: int) -> None:
    _STATES.pop(i, None)


class _Held:
    """The bytes one kept layer state counts against ``activations="budget"`` (:data:`_HELD`),
    given back when the state goes (its backward ran, or its graph was dropped)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        _HELD[0] += nbytes

    def __del__(self):
        _HELD[0] -= self.nbytes


_HELD = [0]  # bytes of activations held by kept states under activations="budget"


def _storages(obj) -> dict:
    """``{storage pointer: bytes}`` of the tensors reachable from ``obj`` (through dataclasses,
    tuples, lists, dicts)."""
    out, stack = {}, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif is_dataclass(o):
            stack.extend(getattr(o, f.name) for f in fields(o))
    return out


def _state_bytes(state, inputs) -> int:
    """Bytes of the distinct tensor storages reachable from ``state`` that are not reachable from
    ``inputs`` (the layer's inputs: autograd keeps those anyway)."""
    held = _storages(inputs)
    return sum(n for p, n in _storages(state).items() if p not in held)


def layer_inputs(x, topk_idx, topk_w, weights, act: SwiGLU, main_grads, biased: bool = False):
    """:class:`~mok_cute.layers.select.MoEInputs` of one layer call from its weights present
    (``weights``: w_gate, w_up, w_down[, ws_gate, ws_up, ws_down[, shared_gate]][, b_gate, b_up,
    b_down] -- the biases with ``biased``), the activation ``act`` and ``main_grads`` (a sequence
    of fp32 tensors, empty or None for none)."""
    from .layers.select import MoEInputs

    n = len(weights) - 3 * biased  # the weights before the biases
    shared = tuple(weights[3:6]) if n > 3 else None
    gate = weights[6] if n > 6 else None
    return MoEInputs(x, topk_idx, topk_w, *weights[:3], shared, act.limit if act.plain else act, gate,
                     tuple(main_grads) if main_grads else None, tuple(weights[n:]) if biased else None)


def run_forward(inp, cfg: MoKConfig, grp, keep: bool):
    """The backend's forward on the layer inputs ``inp`` (:class:`~mok_cute.layers.select.MoEInputs`):
    ``(y, entry)``, ``entry`` what :func:`run_backward` needs (None without ``keep``; with
    ``activations="recompute"``, or "budget" when this state would not fit, the inputs instead of
    the state)."""
    from .layers.select import get_backend, select_backend

    backend = get_backend(select_backend(inp.x.device, cfg))
    if inp.shared_gate is not None and not backend.shared_gate:
        raise NotImplementedError(f"shared_gate: the {backend.name!r} backend does not run the shared expert's output "
                                  "gate yet (the reference backend does: MoKConfig(backend='reference'))")
    y, state = backend.forward(inp, cfg, grp)
    if not keep:
        return y, None
    if cfg.activations == "recompute":
        return y, (backend, None, (inp, cfg, grp))
    if cfg.activations == "budget":
        nbytes = _state_bytes(state, inp)
        if _HELD[0] + nbytes > cfg.activation_budget_mb * 2 ** 20:
            return y, (backend, None, (inp, cfg, grp))  # does not fit: recompute in the backward
        return y, (backend, state, None, _Held(nbytes))
    return y, (backend, state, None)


def run_backward(entry, dy, weights, main_grads, biased: bool = False) -> list:
    """``[dx, d topk_w, one per weight]`` of the forward that made ``entry`` (``weights`` as
    :func:`layer_inputs` takes them); with ``main_grads`` (one fp32 tensor per weight) the weight
    gradients are added into them and given as None."""
    backend, state, recompute = entry[:3]  # (a 4th item: the budget's hold, released with the entry)
    if recompute is not None:  # run the forward again, then the backward
        with torch.no_grad():
            _, state = backend.forward(*recompute)
    g = backend.backward(state, dy, main_grads=tuple(main_grads) if main_grads else None)
    n = len(weights) - 3 * biased  # the weights before the biases
    d_w = [g.d_w_gate, g.d_w_up, g.d_w_down]
    if n > 3:
        d_w += list(g.d_shared)
    if n > 6:
        d_w.append(g.d_shared_gate)  # fp32
    if biased:
        d_w += list(g.d_biases)
    if main_grads:  # accumulate in fp32 (Megatron's main_grad); the weights get no gradient
        for acc, d in zip(main_grads, d_w):
            if d is not None:  # None: the backend accumulated it already (the fused backward's epilogue)
                acc.add_(d.float())
        d_w = [None] * len(weights)
    elif n > 6:
        d_w[6] = d_w[6].to(weights[6].dtype)  # the gate's fp32 gradient as its weight's dtype
    return [g.dx, g.d_topk_w, *d_w]


@dataclass(frozen=True)
class LayerCall:
    """What one eager layer call passes :class:`MoEFunction` besides the tensors autograd tracks:
    the config, the expert-parallel group, ``keep`` (a backward will follow), the activation
    (:class:`~mok_cute.reference.SwiGLU`), topk_idx [T, k] (not differentiable), ``main_grads``
    (fp32 tensors or None) and ``biased`` (the weights end with the routed experts' biases)."""

    config: MoKConfig
    group: object
    keep: bool
    swiglu: SwiGLU
    topk_idx: torch.Tensor
    main_grads: tuple | None
    biased: bool = False
    fc1: tuple[bool, bool] | None = None  # the weights start with fc1's base: (transposed, interleaved), mok_cute.fc1
    transposed: tuple[int, ...] = ()  # the weights given transposed (mok_cute.transposed), by index


class MoEFunction(torch.autograd.Function):
    """The eager path of :func:`mok_cute.moe` (the custom ops' Python dispatch costs about 0.2 ms
    per call, ``tools/bench_dispatch.py``): the same :func:`run_forward` / :func:`run_backward`,
    the state held in ``ctx``. The weights present are passed one by one, in :func:`layer_inputs`'
    order, so that autograd tracks each; with ``call.fc1`` the first is the tensor whose views w_gate
    and w_up are (:mod:`mok_cute.fc1`), and its gradient is one tensor in its layout; those given
    transposed (``call.transposed``, :mod:`mok_cute.transposed`) reach the kernels re-laid out. With
    ``activations="recompute"`` the re-laid copies are not kept: the backward makes them again."""

    @staticmethod
    def forward(ctx, call: LayerCall, x, topk_w, *weights):
        ctx.fc1 = None if call.fc1 is None else fc1.Fc1(weights[0], *call.fc1)
        ctx.transposed, ctx.biased, ctx.main_grads = call.transposed, call.biased, call.main_grads
        ops = _operands(ctx.fc1, ctx.transposed, weights)
        inp = layer_inputs(x, call.topk_idx, topk_w, ops, call.swiglu, call.main_grads, call.biased)
        y, entry = run_forward(inp, call.config, call.group, call.keep)
        ctx.weights, ctx.given = ops, None
        if entry is not None and entry[1] is None and _relaid(ctx.fc1, ctx.transposed):
            # the backward runs the forward again: keep the given weights, not their re-laid copies
            ctx.weights, ctx.given = None, weights
            entry = _with_routed(entry, None, None, None)
        ctx.entry = entry
        return y

    @staticmethod
    def backward(ctx, dy):
        entry, ctx.entry = ctx.entry, None
        weights = ctx.weights
        if weights is None:  # the re-laid copies again, for the forward the backward runs again
            weights = _operands(ctx.fc1, ctx.transposed, ctx.given)
            entry = _with_routed(entry, *weights[:3])
        grads = run_backward(entry, dy.contiguous(), weights, ctx.main_grads, ctx.biased)
        if ctx.fc1 is not None:
            grads = [*grads[:2], fc1.grad(ctx.fc1, grads[2], grads[3]), *grads[4:]]
        grads = [transposed.grad(g) if i - 2 in ctx.transposed else g for i, g in enumerate(grads)]
        return None, *grads


def _operands(fc: fc1.Fc1 | None, flipped: tuple[int, ...], weights) -> list:
    """The weights as :func:`layer_inputs` takes them: those given transposed re-laid out
    (:mod:`mok_cute.transposed`), fc1's tensor as its gate / up operands (:mod:`mok_cute.fc1`)."""
    weights = [transposed.operand(w) if i in flipped else w for i, w in enumerate(weights)]
    return weights if fc is None else [*fc1.operands(fc), *weights[1:]]


def _relaid(fc: fc1.Fc1 | None, flipped: tuple[int, ...]) -> bool:
    """Whether :func:`_operands` copies a weight (a transposed one, or a transposed fc1 tensor)."""
    return bool(flipped) or (fc is not None and fc.transposed)


def _with_routed(entry, w_gate, w_up, w_down):
    """A recompute ``entry`` (:func:`run_forward`) whose saved inputs hold these routed weights."""
    backend, state, (inp, cfg, grp), *rest = entry
    return (backend, state, (replace(inp, w_gate=w_gate, w_up=w_up, w_down=w_down), cfg, grp), *rest)


@torch.library.custom_op("mok_cute::moe_fwd", mutates_args=())
def moe_fwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, weights: list[torch.Tensor],
            main_grads: list[torch.Tensor], swiglu_limit: float | None, config: str, group: int,
            keep: bool, swiglu_alpha: float, swiglu_up_offset: float, biased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    act = SwiGLU(swiglu_limit, swiglu_alpha, swiglu_up_offset)
    inp = layer_inputs(x, topk_idx, topk_w, weights, act, main_grads, biased)
    y, entry = run_forward(inp, _config(config), _GROUPS.get(group) if group else None, keep)
    return y, _stash(entry)


def _stash(entry) -> torch.Tensor:
    """The int64 [1] handle of ``entry`` in the state table (0 and nothing kept for None); the
    entry goes when the handle tensor is freed (a forward whose backward never runs keeps nothing)."""
    handle = torch.zeros(1, dtype=torch.int64)
    if entry is not None:
        i = next(_IDS)
        handle[0] = i
        _STATES[i] = entry
        weakref.finalize(handle, _drop, i)
    return handle


def _take(handle: torch.Tensor):
    entry = _STATES.pop(int(handle[0]), None)
    if entry is None:
        raise RuntimeError("mok_cute: this layer call's forward state is gone (a second backward through the same "
                           "graph, or a forward run without grad); use retain_graph-free training steps")
    return entry


@moe_fwd.register_fake
def _(x, topk_idx, topk_w, weights, main_grads, swiglu_limit, config, group, keep, swiglu_alpha, swiglu_up_offset,
      biased):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64)


_BWD_OUTS = 12  # dx, d topk_w, then up to 10 weight slots (3 routed, 3 shared, the gate, 3 biases)


@torch.library.custom_op("mok_cute::moe_bwd", mutates_args=("main_grads",))
def moe_bwd(dy: torch.Tensor, handle: torch.Tensor, x: torch.Tensor, topk_w: torch.Tensor,
            weights: list[torch.Tensor], main_grads: list[torch.Tensor], biased: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = run_backward(_take(handle), dy, weights, main_grads, biased)
    grads = [g if g is not None else torch.empty(0, dtype=w.dtype, device=w.device)
             for g, w in zip(grads, [x, topk_w, *weights])]
    return *grads, *_absent(dy, _BWD_OUTS - len(grads))


def _absent(like: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=like.dtype, device=like.device) for _ in range(n)]


@moe_bwd.register_fake
def _(dy, handle, x, topk_w, weights, main_grads, biased):
    d_w = [torch.empty(0, dtype=w.dtype, device=w.device) if main_grads else torch.empty_like(w) for w in weights]
    return torch.empty_like(x), torch.empty_like(topk_w), *d_w, *_absent(dy, _BWD_OUTS - 2 - len(d_w))


def _setup(ctx, inputs, output):
    x, _, topk_w, weights, main_grads = inputs[:5]
    ctx.n_weights, ctx.n_main, ctx.biased = len(weights), len(main_grads), inputs[11]
    ctx.save_for_backward(output[1], x, topk_w, *weights, *main_grads)


def _backward(ctx, dy, _dhandle):
    """The gradients of moe_fwd's inputs: x, none for topk_idx, topk_w, one per weight (None for
    each with ``main_grads``: they took them), none for the rest."""
    handle, x, topk_w, *rest = ctx.saved_tensors
    weights, main_grads = rest[:ctx.n_weights], rest[ctx.n_weights:]
    g = moe_bwd(dy.contiguous(), handle, x, topk_w, list(weights), list(main_grads), ctx.biased)
    d_w = [None] * len(weights) if main_grads else list(g[2:2 + len(weights)])
    return g[0], None, g[1], d_w, [None] * ctx.n_main, None, None, None, None, None, None, None


moe_fwd.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------- the grouped expert MLP (mok_cute.expert_mlp)
def mlp_activation(limit: float | None, alpha: float, up_offset: float):
    """The expert MLPs' activation argument from its three numbers: the clamp limit alone (None or L) for
    silu(g) * u, else the :class:`~mok_cute.reference.SwiGLU` (alpha / up offset compiled into the kernels)."""
    act = SwiGLU(limit, alpha, up_offset)
    return act.limit if act.plain else act


def run_mlp_forward(x_rows, offsets, w_gate, w_up, w_down, swiglu_limit, cfg: MoKConfig):
    """``(out, entry)`` of the expert MLP on the backend ``cfg`` selects for x's device (the
    reference, or an arch's MLP in a precision it runs, else NotImplementedError first); the
    backward path decided here, once (:func:`mok_cute.layers.paths.decide_expert_mlp`)."""
    from . import reference
    from .config import BackwardPath
    from .layers import paths
    from .layers.select import get_backend, select_backend

    name, precision = select_backend(x_rows.device, cfg), cfg.precision
    if name == "reference":
        out, saved = reference.experts_forward(x_rows, offsets, w_gate, w_up, w_down, swiglu_limit, precision)
        return out, (None, saved, precision, False)
    mlp = get_backend(name).mlp
    if precision not in mlp.precisions:
        raise NotImplementedError(f"expert_mlp: backend {name!r} runs precisions {mlp.precisions}, not {precision!r}")
    tiles = {k: v for k, v in cfg.kernel_policy.given().items() if "." in k}  # "gemm1.tile_n", "tiles.stages"
    if tiles:
        raise NotImplementedError(f"expert_mlp: backend {name!r} runs its tuned tiles only; the kernel policy's tiles "
                                  f"{tiles} apply to mok_cute.moe (leave them None here)")
    call = paths.Call(precision, recompute=cfg.activations != "save", cuda=x_rows.is_cuda)
    fused = paths.decide_expert_mlp(cfg, mlp.arch, call) is not BackwardPath.UNFUSED
    kw = {} if precision == "bf16" else {"precision": precision}
    out, saved = mlp.forward(x_rows, offsets, w_gate, w_up, w_down, swiglu_limit, **kw)
    return out, (mlp, saved, precision, fused)


def run_mlp_backward(entry, d_out, weights, swiglu_limit) -> tuple:
    """``(dx_rows, dW_gate, dW_up, dW_down)`` of the forward that made ``entry``."""
    from . import reference

    mlp, saved, precision, fused = entry
    if mlp is None:
        return tuple(reference.experts_backward(saved, d_out, *weights, swiglu_limit, precision))
    return tuple(mlp.backward(saved, d_out, *weights, swiglu_limit, fused=fused))


class ExpertMLPFunction(torch.autograd.Function):
    """The eager path of :func:`mok_cute.expert_mlp` over :func:`run_mlp_forward` / :func:`run_mlp_backward`."""

    @staticmethod
    def forward(ctx, cfg, swiglu_limit, x_rows, offsets, w_gate, w_up, w_down):
        out, ctx.entry = run_mlp_forward(x_rows, offsets, w_gate, w_up, w_down, swiglu_limit, cfg)
        ctx.weights, ctx.limit = (w_gate, w_up, w_down), swiglu_limit
        ctx.mark_non_differentiable(offsets)
        return out

    @staticmethod
    def backward(ctx, d_out):
        entry, ctx.entry = ctx.entry, None
        g = run_mlp_backward(entry, d_out.contiguous(), ctx.weights, ctx.limit)
        return None, None, g[0], None, *g[1:]


@torch.library.custom_op("mok_cute::expert_mlp_fwd", mutates_args=())
def expert_mlp_fwd(x_rows: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, swiglu_limit: float | None, config: str, keep: bool,
                   swiglu_alpha: float = 1.0, swiglu_up_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    act = mlp_activation(swiglu_limit, swiglu_alpha, swiglu_up_offset)
    out, entry = run_mlp_forward(x_rows, offsets, w_gate, w_up, w_down, act, _config(config))
    return out, _stash(entry if keep else None)


@expert_mlp_fwd.register_fake
def _(x_rows, offsets, w_gate, w_up, w_down, swiglu_limit, config, keep, swiglu_alpha=1.0, swiglu_up_offset=0.0):
    out = torch.empty((x_rows.shape[0], w_down.shape[1]), dtype=x_rows.dtype, device=x_rows.device)
    return out, torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("mok_cute::expert_mlp_bwd", mutates_args=())
def expert_mlp_bwd(d_out: torch.Tensor, handle: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, swiglu_limit: float | None, swiglu_alpha: float = 1.0,
                   swiglu_up_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    act = mlp_activation(swiglu_limit, swiglu_alpha, swiglu_up_offset)
    return run_mlp_backward(_take(handle), d_out, (w_gate, w_up, w_down), act)


@expert_mlp_bwd.register_fake
def _(d_out, handle, w_gate, w_up, w_down, swiglu_limit, swiglu_alpha=1.0, swiglu_up_offset=0.0):
    return torch.empty_like(d_out), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


def _mlp_setup(ctx, inputs, output):
    ctx.act = (inputs[5], *inputs[8:10])  # limit, alpha, up offset
    ctx.save_for_backward(output[1], *inputs[2:5])


def _mlp_backward(ctx, d_out, _dhandle):
    handle, w_gate, w_up, w_down = ctx.saved_tensors
    g = expert_mlp_bwd(d_out.contiguous(), handle, w_gate, w_up, w_down, *ctx.act)
    return g[0], None, g[1], g[2], g[3], None, None, None, None, None


expert_mlp_fwd.register_autograd(_mlp_backward, setup_context=_mlp_setup)

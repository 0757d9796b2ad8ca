"""What both layer paths (EP = 1: :mod:`mok_cute.layers.grouped`, EP > 1:
:mod:`mok_cute.layers.ep`) and the arch expert MLPs (:mod:`mok_cute.layers.sm90`,
:mod:`mok_cute.layers.sm100`) share: the expert group's forward state, the layer's forward
states (what a backward reads, the decided paths included), the MLP's GEMM sequence over an
arch's grouped GEMM calls, the shared expert as one more group, and d topk_w."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mok_cute.config import MoKConfig
from mok_cute.kernels.operands import ExpertWeights  # noqa: F401 (the states' weights; re-exported)
from mok_cute.layers.paths import Paths


@dataclass
class ExpertGroup:
    """One expert group's forward state: rows x, offsets, gu = [g | u], h, and the precision
    the forward ran in (the backward runs in the same)."""

    x: torch.Tensor
    offsets: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    precision: str = "bf16"


@dataclass(frozen=True)
class MadeBefore:
    """What the layer made before an arch MLP's fused backward launch (``backward_tokens(made=)``), None where
    it made nothing: ``mx_dyt`` dy's MXFP8 round trip along the tokens (``mx_prologue``), ``x_tok`` the layer's x
    [T, H] whose rows the launch gathers (``gathers_x``), ``dwd`` the dW_down of ``down_weight_grad``
    (``down_grad_first``: the launch skips its dW_down tiles and reads no h)."""

    mx_dyt: torch.Tensor | None = None
    x_tok: torch.Tensor | None = None
    dwd: torch.Tensor | None = None


def contiguous_group(g: ExpertGroup) -> ExpertGroup:
    """``g`` with x, gu and h contiguous, as the fused launches read them (the same tensors where
    they already are: the layer's own, always); x or h None (not kept) stays None."""
    x = None if g.x is None else g.x.contiguous()
    return replace(g, x=x, gu=g.gu.contiguous(), h=None if g.h is None else g.h.contiguous())


def whole_backward_operands(st, dy):
    """``(g, dy, x, r_rows, (w_gate, w_up, w_down))`` of the FUSED_WHOLE backward from the EP = 1
    forward state ``st`` (:class:`LocalState`): the routed group with contiguous rows
    (:func:`contiguous_group`), the layer's dy and x and the forward's route-order GEMM2 rows,
    contiguous, and the routed weights. The rest the arch reads from ``st`` itself."""
    return contiguous_group(st.routed), dy.contiguous(), st.x.contiguous(), st.rows.contiguous(), st.weights


@dataclass
class LocalState:
    """The EP = 1 forward's state, what its backward reads (one-shot: the backward consumes it).

    ``order`` [T*k] the route index (t*k + j) of each grouped row, ``valid`` [T*k] the route is
    not -1; ``rows`` [T*k, H] the GEMM2 rows (d topk_w reads them in place), expert-grouped or,
    with ``rows_by_route`` (the fused forward), in route order; ``x`` the layer input when
    ``routed.x`` is None (the fused forward kept no gathered rows: the backward gathers them);
    ``gate`` ``(w_sg, g [T, 1] bf16, s [T, H] the shared output, x)`` of the shared expert's
    output gate; ``config`` the call's config (``trace`` resolved, :func:`~mok_cute.layers.paths.
    with_trace`); ``paths`` the paths decided with the forward; ``limit`` the experts' activation
    (:func:`activation`); ``biased``: the forward added the routed experts' biases (the backward returns their
    gradients)."""

    limit: object
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    order: torch.Tensor
    valid: torch.Tensor
    weights: ExpertWeights
    shared: tuple | None
    routed: ExpertGroup
    shared_group: ExpertGroup | None
    rows: torch.Tensor | None
    config: MoKConfig
    paths: Paths
    rows_by_route: bool = False
    x: torch.Tensor | None = None
    gate: tuple | None = None
    biased: bool = False


@dataclass
class EPState:
    """The EP > 1 forward's state: the workspace ``ws`` and device ``plan``, ``w_rows``
    [recv_capacity] fp32 the router weight of each grouped row (0 past M), ``slot_out`` [T, k, H]
    the routed rows r_j of this rank's tokens (stale for -1 slots), ``x`` the layer input when
    ``routed.x`` is None (the backward pulls its rows again), ``config`` / ``paths`` / ``limit`` as in
    :class:`LocalState`."""

    ws: object
    plan: object
    limit: object
    topk_idx: torch.Tensor
    w_rows: torch.Tensor
    weights: ExpertWeights
    shared: tuple | None
    routed: ExpertGroup
    shared_group: ExpertGroup | None
    slot_out: torch.Tensor
    config: MoKConfig
    paths: Paths
    x: torch.Tensor | None = None


def mlp_forward(gemm1_swiglu, gemm, x_rows, offsets, w_gate, w_up, w_down, limit, biases=None):
    """(rows [M, H], ExpertGroup): h = SwiGLU GEMM1 (gu, h), then GEMM2, through an arch's
    grouped GEMM calls (``gemm1_swiglu(x, offsets, w_gate, w_up, limit) -> (gu, h)``,
    ``gemm(a, offsets, w) -> out``); ``biases``: None or the experts' (b_gate, b_up, b_down), passed
    to those calls as ``bias=(b_gate, b_up)`` and ``bias=b_down``."""
    if biases is None:
        gu, h = gemm1_swiglu(x_rows, offsets, w_gate, w_up, limit)
        return gemm(h, offsets, w_down), ExpertGroup(x_rows, offsets, gu, h)
    gu, h = gemm1_swiglu(x_rows, offsets, w_gate, w_up, limit, bias=tuple(biases[:2]))
    return gemm(h, offsets, w_down, bias=biases[2]), ExpertGroup(x_rows, offsets, gu, h)


def mlp_backward(dswiglu_dgrad, dgrad1, wgrad, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit,
                 biased: bool = False):
    """(dx rows, dWg, dWu, dWd): dgrad2 + dSwiGLU, dgrad1 and the three weight gradients,
    through an arch's grouped GEMM calls (argument order of ``sm90.expert_bwd``); ``biased``: then
    also the biases' gradients (:func:`bias_grads`)."""
    inter = w_gate.shape[1]
    dgu = dswiglu_dgrad(dy_rows, g.offsets, w_down, g.gu, limit)
    dx = dgrad1(dgu, g.offsets, w_gate, w_up)
    dwd = wgrad(dy_rows, g.h, g.offsets)
    dwg = wgrad(dgu[:, :inter], g.x, g.offsets)
    dwu = wgrad(dgu[:, inter:], g.x, g.offsets)
    return (dx, dwg, dwu, dwd) + (bias_grads(dgu, dy_rows, g.offsets) if biased else ())


def expert_sums(rows, offsets) -> torch.Tensor:
    """[E, N] bf16: each expert's rows of ``rows`` [M, N] summed in fp32 in a fixed order (8 interleaved row
    stripes, each in row order, then added in stripe order), rounded once: an expert bias's gradient
    (:func:`mok_cute.kernels.row_sums.expert_row_sums`; the reference's ``grouped_row_sums`` within its
    tolerance); the offsets stay on the device (no host sync)."""
    from mok_cute.dsl.host import offsets_i32
    from mok_cute.kernels.row_sums import expert_row_sums

    return expert_row_sums(rows, offsets_i32(offsets))


def gate_up_bias_grads(dgu, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d b_gate, d b_up)`` [E, I]: the halves of :func:`expert_sums` of dgu [M, 2I] (one launch over both halves;
    each column's sum is its own, so the same values as one launch per half)."""
    inter = dgu.shape[1] // 2
    sums = expert_sums(dgu, offsets)
    return sums[:, :inter], sums[:, inter:]


def bias_grads(dgu, dy_rows, offsets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d b_gate, d b_up [E, I], d b_down [E, H])`` of the routed experts' biases: :func:`gate_up_bias_grads` of
    dgu and :func:`expert_sums` of the routed dy rows [M, H]."""
    return (*gate_up_bias_grads(dgu, offsets), expert_sums(dy_rows, offsets))


def check_biases(arch: str, biases, precision: str) -> None:
    """Expert biases (validated by ``ops.moe``; None or anything) run at precision "bf16" only in the ``arch``
    expert MLPs' kernels: NotImplementedError naming the precision otherwise."""
    if biases is not None and precision != "bf16":
        raise NotImplementedError(f"{arch} expert MLP: expert biases run at precision 'bf16' only, not {precision!r}")


def whole_offsets(rows: int, device) -> torch.Tensor:
    """int32 [0, rows] on ``device``: the offsets of one group holding every row (made on the
    device: no host copy, capturable)."""
    return torch.arange(2, dtype=torch.int32, device=device) * rows


def shared_forward(mlp, x, shared, limit, **kw):
    """The shared expert as one more group (all T tokens): (out [T, H], ExpertGroup), or
    (None, None) without one."""
    if shared is None:
        return None, None
    return mlp.forward(x, whole_offsets(x.shape[0], x.device), *(w[None] for w in shared), limit, **kw)


def shared_backward(mlp, group, dy, shared, limit, fused: bool = False, config=None):
    """(dx [T, H], (d ws_gate, d ws_up, d ws_down)) of the shared expert, or (None, None);
    ``fused``: through the MLP's fused backward core (the backward path is FUSED or FUSED_WHOLE),
    else its separate kernels; ``config``: the call's (its trace resolved), for the fused core."""
    if shared is None:
        return None, None
    dxs, *dws = mlp.backward(group, dy, *(w[None] for w in shared), limit, fused=fused, config=config)
    return dxs, tuple(d[0] for d in dws)


def shared_launch_operands(group: ExpertGroup | None, shared, contiguous: bool = False):
    """The shared expert's operands of a whole-backward launch, ``(offsets int32, gu, h, ws_gate,
    ws_up, ws_down)``, or None without one: gu / h contiguous, each weight with a unit last stride
    (with ``contiguous``: contiguous), copies where one is not (the layer's own always are)."""
    from mok_cute.dsl.host import offsets_i32

    if shared is None:
        return None
    ws = tuple(w.contiguous() if contiguous or w.stride(-1) != 1 else w for w in shared)
    return (offsets_i32(group.offsets), group.gu.contiguous(), group.h.contiguous(), *ws)


def topk_w_grad(dy, slot_out, topk_idx):
    """d topk_w [T, k] fp32: dy . r_j per slot (fp32 sum over H), zero for -1 slots
    (:func:`mok_cute.kernels.route_grad.slot_dtopk_w`: one pass, no [T, k, H] temporaries)."""
    from mok_cute.kernels.route_grad import slot_dtopk_w

    return slot_dtopk_w(dy.contiguous(), slot_out.contiguous(), topk_idx.long().contiguous())


def ring_chunks(config, topk_idx) -> int:
    """Slots of 128 rows (the fused kernels' ``CHUNK``, one m-tile) in a fused forward's ring: the
    routed rows of the policy's ``minibatch_tokens`` tokens at k slots each
    (``ceil(minibatch_tokens * k / 128)``)."""
    return -(-config.kernel_policy.ring_tokens() * topk_idx.shape[1] // 128)


def mlp_options(config) -> dict:
    """An expert MLP's ``forward`` keywords for the call's ``config``: ``precision`` unless "bf16",
    ``config`` where its policy sets tiles of the unfused GEMM1 / GEMM2 (else the MLP runs its own)."""
    kw = {} if config.precision == "bf16" else {"precision": config.precision}
    if any(config.kernel_policy.gemm(g).given() for g in ("gemm1", "gemm2")):
        kw["config"] = config
    return kw

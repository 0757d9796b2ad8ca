"""SM100/SM103 expert MLP: the Blackwell (tcgen05) grouped GEMM kernels behind one call.

Compile-verified only: no Blackwell GPU is available to this project, so this path has
never run. Forward: GEMM1 + SwiGLU (gu, h), GEMM2; backward: dgrad2 + dSwiGLU, dgrad1, three
wgrads (mok_cute.kernels.sm100.grouped_gemm, whose wrappers validate every call). The layer
runs the unfused path by default; the fused paths (the fused forward, its EP mode
:meth:`Sm100ExpertMLP.fused_forward_ep`, the fused backward core, :meth:`Sm100ExpertMLP.backward_fused`,
:meth:`Sm100ExpertMLP.backward_fused_ep`) and EP > 1 only when the config asks for a path
(:mod:`mok_cute.layers.paths`).

Precisions "bf16" and "mxfp8". MXFP8 quantizes every GEMM operand along the axes of the
table in :mod:`mok_cute.reference` with the CuTe quantize kernels, then calls the MXFP8
wrappers (e4m3 data + raw E8M0 scales; the wrappers repack scales into the blocked layouts):

    GEMM1        x rows along H (``quantize_mxfp8(x, -1)``); Wg, Wu along H (rows of [E*I, H])
    GEMM2        h rows along I; Wd along I (rows of [E*H, I])
    dgrad2       dyj rows along H; Wd along H (``quantize_mxfp8([E*H, I], 0)``: H % 32 == 0, so
                 no block straddles two experts)
    dgrad1       dgu rows along 2I; Wg, Wu along I (``quantize_mxfp8([E*I, H], 0)``)
    wgrads       dyj, h, dgu, x along tokens per expert (``quantize_tokens(., offsets,
                 "mxfp8")``; dgu and x quantized once for dWg and dWu: token-wise blocks are per
                 feature column); the transposed tile-aligned output is repacked on the device
                 into what the wgrad kernel reads: data as token rows (:func:`token_rows`),
                 scales in the grouped blocked layout (:func:`pack_token_scales_device`,
                 equal to ``sm100.layouts.pack_token_scales``).

Weight quantizations are cached (:class:`~mok_cute.layers.weight_cache.WeightCache`: once per weight
and axis while the weight is unchanged, e.g. across micro-batches). No host sync in the step:
offsets stay on the device, the packers are torch ops on device
tensors. The quantize kernels are looked up at call time (``mok_cute.kernels.quant.quantize.
quantize_mxfp8``, ``mok_cute.kernels.quant.quantize_fp8.quantize_tokens``) so CPU tests can swap in
the reference quantizers.

Expert biases (gpt-oss's b_gate, b_up [E, I], b_down [E, H] bf16; precision "bf16" only): the GEMM1 + SwiGLU and
GEMM2 epilogues add them to the FP32 accumulators before they round (:mod:`mok_cute.kernels.sm100.bias`; the
unfused wrappers' ``bias=`` and the fused forward's ``biases=``); their gradients are per-expert row sums of dgu's
halves and of the routed dy rows (:func:`~mok_cute.layers.common.bias_grads`), after the unfused backward's
dSwiGLU or, in :meth:`Sm100ExpertMLP.backward_tokens`, around the fused core's launch.
"""
from __future__ import annotations

import functools

import torch

from mok_cute.layers.common import (
    ExpertGroup, check_biases, contiguous_group, expert_sums, gate_up_bias_grads, mlp_backward, mlp_forward,
    ring_chunks, shared_backward, shared_launch_operands, whole_backward_operands,
)
from mok_cute.layers import launch as policy_launch
from mok_cute.layers import paths
from mok_cute.layers.weight_cache import WeightCache
from mok_cute.config import ForwardPath
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.kernels.sm100.layouts import TokenOperand, pack_token_scales_device, token_rows  # noqa: F401
from mok_cute.dsl.host import offsets_i32

MX_BLOCK = lay.SF_VEC


def quantize_rows(x: torch.Tensor):
    """(e4m3 [M, K], scales uint8 [M, K/32]): x quantized along its rows (K)."""
    from mok_cute.kernels.quant import quantize

    return quantize.quantize_mxfp8(x, -1)


def quantize_weight(w: torch.Tensor, axis: int):
    """MXFP8 of a 3-D weight [E, R, C] along ``axis`` 2 (C: scales [E, R, C/32]) or 1 (R:
    scales [E, R/32, C]) through one 2-D [E*R, C] quantization (R % 32 == 0 for axis 1, so
    no block straddles two experts). Returns (data [E, R, C], scales)."""
    from mok_cute.kernels.quant import quantize

    e, r, c = w.shape
    if axis not in (1, 2):
        raise ValueError(f"axis must be 1 or 2, got {axis}")
    if axis == 1 and r % MX_BLOCK:
        raise ValueError(f"weight dim {r} must be a multiple of {MX_BLOCK} to quantize along it")
    data, scales = quantize.quantize_mxfp8(w.reshape(e * r, c), -1 if axis == 2 else 0)
    shape = (e, r, c // MX_BLOCK) if axis == 2 else (e, r // MX_BLOCK, c)
    return data.view(e, r, c), scales.view(shape)


def mx_forward(k, x_rows, offsets, w_gate, w_up, w_down, limit, qw=quantize_weight, interleave=None):
    """MXFP8 forward through the sm100 wrappers ``k``: (rows [M, H], ExpertGroup); ``qw(w,
    axis)`` quantizes a weight (:func:`quantize_weight`, or a cached lookup of it);
    ``interleave``: GEMM1's gate / up interleave (None: a copy per call)."""
    xq, xs = quantize_rows(x_rows)
    (gq, gs), (uq, us) = qw(w_gate, 2), qw(w_up, 2)
    gu, h = k.grouped_gemm1_swiglu(xq, offsets, gq, uq, limit, x_scales=xs, w_scales=(gs, us), interleave=interleave)
    hq, hs = quantize_rows(h)
    dq, ds = qw(w_down, 2)
    out = k.grouped_gemm(hq, offsets, dq, a_scales=hs, w_scales=ds)
    return out, ExpertGroup(x_rows, offsets, gu, h, "mxfp8")


def mx_backward(k, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, qw=quantize_weight):
    """MXFP8 backward through the sm100 wrappers ``k``: (dx rows, dWg, dWu, dWd)."""
    inter = w_gate.shape[1]
    dyq, dys = quantize_rows(dy_rows)
    wdq, wds = qw(w_down, 1)
    dgu = k.grouped_dswiglu_dgrad(dyq, g.offsets, wdq, g.gu, limit, dy_scales=dys, w_scales=wds)
    dguq, dgus = quantize_rows(dgu)
    (gq, gs), (uq, us) = qw(w_gate, 1), qw(w_up, 1)
    dx = k.grouped_dgrad1(dguq, g.offsets, gq, uq, dgu_scales=dgus, w_scales=(gs, us))
    dy_t, h_t = TokenOperand(dy_rows, g.offsets), TokenOperand(g.h, g.offsets)
    dgu_t, x_t = TokenOperand(dgu, g.offsets), TokenOperand(g.x, g.offsets)
    x_s = x_t.scales()
    dwd = k.grouped_wgrad(dy_t.data, h_t.data, g.offsets, a_scales=dy_t.scales(), b_scales=h_t.scales())
    dwg = k.grouped_wgrad(dgu_t.data[:, :inter], x_t.data, g.offsets, a_scales=dgu_t.scales(0, inter),
                          b_scales=x_s)
    dwu = k.grouped_wgrad(dgu_t.data[:, inter:], x_t.data, g.offsets, a_scales=dgu_t.scales(inter),
                          b_scales=x_s)
    return dx, dwg, dwu, dwd


FUSED_BWD_TIMEOUT_S = 30.0  # the fused backward core's bounded waits (the sm90 core's default)


def _kernel_biases(biases):
    """``(b_gate, b_up, b_down)`` as the sm100 epilogues read them (unit last stride, rows 16-byte aligned:
    :func:`mok_cute.kernels.sm100.bias.aligned`, the given tensors where they already are), or None."""
    if biases is None:
        return None
    from mok_cute.kernels.sm100.bias import aligned

    if len(biases) != 3:
        raise ValueError("biases must be None or (b_gate, b_up, b_down)")
    return tuple(aligned(b) for b in biases)


FUSED_CORE_PRECISIONS = ("bf16", "mxfp8")  # the fused backward core's (fused_bwd: BF16 and its mx variant)


def fused_tile_m(config, gemm: str = "fused_backward") -> int:
    """The SM100 fused kernel ``gemm``'s ("fused_forward" or "fused_backward") tile rows for ``config``:
    its policy's ``tile_m`` (``policy.<gemm>.tile_m``, else ``policy.tiles.tile_m``: ``MoKConfig.tile_m``),
    128 (None: the default, ``cta_group::1``) or 256 (``cta_group::2``: CTA pairs run 256-row tiles);
    ValueError naming ``tile_m`` and the allowed values otherwise. ``config`` None: 128."""
    from mok_cute.kernels.sm100.fused_moe import check_tile_m

    tile_m = None if config is None else config.kernel_policy.gemm(gemm).tile_m
    tile_m = 128 if tile_m is None else tile_m
    check_tile_m(tile_m)
    return tile_m


def fused_launch(config, mx: bool, comm_ctas: int, timeout_s: float, num_ctas: int | None = None,
                 ring: int | None = None, gemm: str = "fused_backward"):
    """The SM100 megakernels' launch policy (:class:`~mok_cute.kernels.sm100.fused_moe.Sm100Launch`)
    of one call with ``config`` (None: the defaults): ``comm_ctas``, ``timeout_s``, the grid
    ``num_ctas`` (None: every SM), the forward's ``ring`` chunks, ``mx`` (MXFP8 weight scales are
    given), ``config.trace`` (resolved by the layer: a bool), :func:`fused_tile_m` of ``gemm`` (the
    launch's kernel: "fused_forward" or "fused_backward"), and the EP > 1
    push by ``cp.async.bulk`` where ``config.comm_transport`` is "bulk" (the kernels ignore it at
    EP = 1). R1's rows are always gathered by the comm CTAs (``gather="comm"``): the TMA gather4
    variant has never been measured against it (no Blackwell GPU), so no config field selects it."""
    from mok_cute.kernels.sm100.fused_moe import Sm100Launch

    return Sm100Launch(comm_ctas, timeout_s, policy_launch.grid(config, num_ctas), ring,
                       bool(config is not None and config.trace), mx,
                       tile_m=fused_tile_m(config, gemm), band=policy_launch.band(config),
                       bulk_push=config is not None and config.comm_transport == "bulk")


class Sm100ExpertMLP:
    """BF16 / MXFP8 expert MLP on the SM100 kernels (output tiles 256 wide; H, I, I_s any
    multiple of 64: partial last tiles along N are masked, K tails zero-filled)."""

    arch = "sm100"  # its row of the path table (mok_cute.layers.paths): what runs fused, in which precisions
    dim_multiple = {"bf16": 64, "mxfp8": 64}
    strided_weights = False  # its kernels read compact weights (the layer passes contiguous ones)
    precisions = ("bf16", "mxfp8")
    # a layer asking for fp8_block (Hopper's recipe: fp32 scales per 128 of K) runs MXFP8 here, for this reason
    # (GroupedExpertBackend.run_config warns with it; docs/blackwell.md)
    precision_alias = {"fp8_block": "mxfp8"}
    precision_alias_reason = ("tcgen05 scales FP8 blocks of 32 in hardware (MXFP8); fp32 scales per 128 would need "
                              "the accumulator promoted outside the MMA")
    fused_mx_prologue = False  # BackwardPath.FUSED: the route_grad pass, then backward_tokens
    gathers_x = False  # its backward_tokens reads the grouped x rows the route_grad pass makes
    down_grad_first = False  # its backward_tokens computes dW_down in its launch (h held through it)

    def __init__(self):
        self.weights = WeightCache()

    def _core_weights(self, g: ExpertGroup, w_gate, w_up, w_down):
        """``(ExpertWeights, w_scales or None)``: the fused backward's weights, at MXFP8 quantized
        along their rows' K as :func:`mx_backward` reads them (cached per version), with their scales."""
        from mok_cute.kernels.operands import ExpertWeights

        if g.precision != "mxfp8":
            return ExpertWeights(w_gate, w_up, w_down), None
        (gq, gs), (uq, us), (dq, ds) = (self._qw(w, 1) for w in (w_gate, w_up, w_down))
        return ExpertWeights(gq, uq, dq), (gs, us, ds)

    def fused_forward(self, x, plan, weights, shared, limit, config, gate=None, biases=None):
        """The fused forward at EP = 1 on the route ``plan`` and routed ``weights`` (:mod:`mok_cute.kernels.operands`)
        in ``config.precision`` (bf16, or mxfp8: the weights quantized
        along their rows as the unfused MXFP8 forward does, cached per version; x quantized by the
        kernel's host): the contract of the sm90 MLP's ``fused_forward`` (``(y, gu, h, slot_out, gus,
        hs, s_out)``, gu / h / gus / hs bf16 for the unfused MXFP8 backward; the ring of
        ``ring_chunks`` slots; the kernel's status watched on the device, raised by a later call).
        ``biases``: None or the routed experts' (b_gate, b_up [E, I], b_down [E, H]) bf16 (bf16 only: the
        kernel's ``biased`` variant adds them in R1's and R2's epilogues; NotImplementedError at mxfp8)."""
        from mok_cute.kernels.operands import SharedExpert
        from mok_cute.kernels.sm100 import fused_moe as fused
        from mok_cute.kernels.sm90.fused_moe import watch_status

        check_biases("sm100", biases, config.precision)
        weights, shared, scales = self._fused_weights(config, *weights, shared)
        launch = fused_launch(config, scales is not None, config.comm_ctas_fwd(1), config.device_timeout_s,
                              ring=ring_chunks(config, plan.topk_idx), gemm="fused_forward")
        kw = {} if biases is None else {"biases": _kernel_biases(biases)}
        out = fused.fused_forward(x, plan, weights,
                                  SharedExpert.of(shared, gate), limit, launch, scales, interleave=self._interleaved,
                                  **kw)
        watch_status(out.counters[-1], first=config.validate_routing)
        return out[:7]

    def fused_forward_ep(self, ws, plan, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, config,
                         num_ctas: int | None = None):
        """The fused forward at EP > 1 (this rank's launch; collective over ``ws``'s ranks) on the
        device plan ``plan`` (``recv_src``, ``offsets``), the contract of the sm90 MLP's
        ``fused_forward_ep``: returns ``(y, gu, h, slot_out, gus, hs, w_rows)`` (``slot_out`` this
        rank's slot rows [T*k, H], ``w_rows`` each grouped row's router weight); peer errors are in
        ``ws.status`` (the caller's ``ws.check_status()``); ``num_ctas``: this rank's grid."""
        from mok_cute.kernels.operands import RoutePlan, SharedExpert
        from mok_cute.kernels.sm100 import fused_moe as fused

        weights, shared, scales = self._fused_weights(config, w_gate, w_up, w_down, shared)
        launch = fused_launch(config, scales is not None, config.comm_ctas_fwd(ws.EP), config.device_timeout_s,
                              num_ctas, ring_chunks(config, topk_idx), gemm="fused_forward")
        out = fused.fused_forward(x, RoutePlan(plan.recv_src, plan.offsets, topk_idx.to(torch.int32), topk_w), weights,
                                  SharedExpert.of(shared), limit, launch, scales, ws=ws, interleave=self._interleaved)
        return (*out[:6], out.w_rows)

    def _fused_weights(self, config, w_gate, w_up, w_down, shared):
        """``(ExpertWeights, shared weights or None, MxScales or None)`` as the fused forward reads
        them in ``config.precision`` (ValueError unless a fused precision of the path table): BF16 as
        given; MXFP8 quantized along their rows as the unfused MXFP8 forward does (cached per
        version), their scales in the :class:`~mok_cute.kernels.sm100.fused_moe.MxScales`."""
        from mok_cute.kernels.operands import ExpertWeights
        from mok_cute.kernels.sm100.fused_moe import MxScales

        fused = paths.runs("sm100", "forward", ForwardPath.FUSED, 1).precisions
        if config.precision not in fused:
            raise ValueError(f"the sm100 fused forward runs {fused}, not {config.precision!r}")
        if config.precision != "mxfp8":
            return ExpertWeights(w_gate, w_up, w_down), shared, None
        (w_gate, gs), (w_up, us), (w_down, ds) = (self._qw(w, 2) for w in (w_gate, w_up, w_down))
        shared_scales = None
        if shared is not None:  # as shared_forward's [1, R, C] weights: the same rows quantized
            q = [self._qw(w[None], 2) for w in shared]
            shared, shared_scales = tuple(d[0] for d, _ in q), tuple(s[0] for _, s in q)
        return ExpertWeights(w_gate, w_up, w_down), shared, MxScales((gs, us, ds), shared_scales)

    def _interleaved(self, w_gate, w_up, half: int):
        """GEMM1's interleaved gate / up weights, or their MXFP8 scales
        (``grouped_gemm.interleave_gate_up``), built once while both are unchanged."""
        from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

        return self.weights.get(("interleave", half), (w_gate, w_up), lambda g, u: interleave_gate_up(g, u, half))

    def _qw(self, w, axis):
        """MXFP8 of a weight along ``axis``, quantized once while the weight is unchanged."""
        return self.weights.get(("mxfp8", axis), (w,), lambda t: quantize_weight(t, axis))

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, precision: str = "bf16", config=None,
                biases=None):
        """(rows [M, H], ExpertGroup) for expert-grouped x_rows (``config``: the call's; its policy's
        unfused tiles are the kernels' own here, the layer's check allows no other); ``biases``: None or the
        experts' (b_gate, b_up [E, I], b_down [E, H]) bf16 (bf16 only: NotImplementedError at another
        precision), passed to the GEMM1 + SwiGLU and GEMM2 wrappers (``bias=``)."""
        from mok_cute.kernels.sm100 import grouped_gemm as k

        check_biases("sm100", biases, precision)
        if precision == "mxfp8":
            return mx_forward(k, x_rows, offsets, w_gate, w_up, w_down, limit, self._qw, self._interleaved)
        if precision != "bf16":
            raise NotImplementedError(f"sm100 expert MLP: precision {precision!r} is not wired")
        gemm1 = functools.partial(k.grouped_gemm1_swiglu, interleave=self._interleaved)
        return mlp_forward(gemm1, k.grouped_gemm, x_rows, offsets, w_gate, w_up, w_down, limit, _kernel_biases(biases))

    def backward(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, *, fused: bool = False, config=None,
                 biased: bool = False):
        """(dx rows, dWg, dWu, dWd) in the precision of the forward that made ``g``; ``fused``: BF16
        or MXFP8 through the fused backward core (:mod:`mok_cute.kernels.sm100.fused_bwd`, one launch;
        the backward path FUSED, asked for in the config: compile-verified only; its tiles
        :func:`fused_tile_m` of ``config``), else the unfused kernels. ``biased`` (the forward added expert
        biases; BF16, the unfused kernels): then also (d b_gate, d b_up [E, I], d b_down [E, H]), the per-expert
        row sums of dgu's halves and of dy_rows (:func:`~mok_cute.layers.common.bias_grads`)."""
        from mok_cute.kernels.sm100 import grouped_gemm as k

        if biased:
            check_biases("sm100", True, g.precision)
            if fused:
                raise ValueError("biased: the sm100 expert MLP's unfused BF16 backward only, not fused=True (the "
                                 "layer's fused backward with biases: backward_tokens)")
        if fused:
            from mok_cute.kernels.sm100.fused_bwd import fused_backward_core

            g, dy_rows = contiguous_group(g), dy_rows.contiguous()
            weights, scales = self._core_weights(g, w_gate, w_up, w_down)
            return fused_backward_core(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets), weights, limit,
                                       fused_launch(config, scales is not None, 1, FUSED_BWD_TIMEOUT_S),
                                       w_scales=scales)
        if g.precision == "mxfp8":
            return mx_backward(k, g, dy_rows, w_gate, w_up, w_down, limit, self._qw)
        return mlp_backward(k.grouped_dswiglu_dgrad, k.grouped_dgrad1, k.grouped_wgrad, g, dy_rows, w_gate, w_up,
                            w_down, limit, **({"biased": True} if biased else {}))


    def backward_tokens(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, tokens, consume: bool = False,
                        config=None, biased: bool = False):
        """``(dx [T, H], dWg, dWu, dWd)``: :meth:`backward` with the dx rows summed into their tokens
        in the same launch (``fused_bwd.fused_backward_core(tokens=...)``; ``tokens`` = ``(order,
        topk_idx, dx_shared, dx_add)``: ``order`` [M+] grouped row -> t*k + j, ``topk_idx`` [T, k],
        ``dx_shared`` [T, H] or None, ``dx_add`` fp32 [T, H] or None: added to its fp32 start), meant
        bitwise the unfused scatter and slot sum: the backward
        path FUSED (asked for in the config), BF16 or MXFP8. ``consume`` (the caller gives up dy_rows,
        g.x, g.gu, g.h): at BF16 dgu is written over gu (the core makes no round trips), at MXFP8 the
        dx rows over dy_rows. ``config``: the call's (the core's tiles, :func:`fused_tile_m`). ``biased`` (the
        forward added expert biases; BF16 with ``consume``): then also (d b_gate, d b_up [E, I], d b_down [E, H]):
        d b_down the row sums of dy_rows before the launch (which may write over them), d b_gate / d b_up those of
        the dgu halves the launch writes over gu (:func:`~mok_cute.layers.common.bias_grads`' sums)."""
        if g.precision not in FUSED_CORE_PRECISIONS:
            raise ValueError(f"the sm100 fused backward core runs {FUSED_CORE_PRECISIONS}, not {g.precision!r}")
        if biased:
            check_biases("sm100", True, g.precision)
            if not consume:
                raise ValueError("biased: backward_tokens needs consume=True (the core writes dgu, whose row sums "
                                 "are d b_gate / d b_up, over gu only then)")
        order, topk_idx, dx_shared, dx_add = tokens
        g, dy_rows = contiguous_group(g), dy_rows.contiguous()
        dx_shared, dx_add = (None if a is None else a.contiguous() for a in (dx_shared, dx_add))
        from mok_cute.kernels.sm100.fused_bwd import fused_backward_core

        weights, scales = self._core_weights(g, w_gate, w_up, w_down)
        d_down = expert_sums(dy_rows, g.offsets) if biased else None  # before the launch: dy rows may be consumed
        out = fused_backward_core(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets), weights, limit,
                                  fused_launch(config, scales is not None, 1, FUSED_BWD_TIMEOUT_S),
                                  tokens=(order, topk_idx, dx_shared, dx_add), w_scales=scales, consume=consume)
        if not biased:
            return out
        return (*out, *gate_up_bias_grads(g.gu, g.offsets), d_down)  # consume at BF16: dgu was written over gu

    def backward_fused(self, st, dy, main_grads=None):
        """The backward path FUSED_WHOLE (after the fused forward, no output gate: the path table;
        asked for in the config: compile-verified only): the whole backward from the layer's tokens in
        one launch (``fused_bwd.fused_backward``: the route_grad pass, the x gather, the routed and the
        shared expert's GEMMs, the dx scatter and slot sum) from the EP = 1 forward state ``st``
        (:class:`~mok_cute.layers.common.LocalState`), the contract of the sm90 MLP's
        ``backward_fused``: ``(dx [T, H], d topk_w [T, k], dWg, dWu, dWd, d shared weights or None)``,
        meant bitwise the unfused backward; with ``main_grads`` (fp32, validated by ``ops.moe``; all
        contiguous, else the caller adds them) the weight gradients are added into them in the launch
        and returned as None. MXFP8: the launch's ``mx`` variant (the gathered rows quantized by its
        comm CTAs), the shared expert's backward before it (its dx the slot sum's start, its weight
        gradients returned; ``main_grads`` then takes the routed three)."""
        g, dy, x, r_rows, (w_gate, w_up, w_down) = whole_backward_operands(st, dy)
        order, topk_w, topk_idx, limit, rows_by_route = st.order, st.topk_w, st.topk_idx, st.limit, st.rows_by_route
        comm_ctas, shared_group, shared = st.config.comm_ctas_bwd(), st.shared_group, st.shared
        from mok_cute.kernels.operands import RoutePlan
        from mok_cute.kernels.sm100.fused_bwd import ForwardSaved, fused_backward

        if main_grads is not None and not all(mg.is_contiguous() for mg in main_grads):
            main_grads = None  # the caller adds them
        weights, scales = self._core_weights(g, w_gate, w_up, w_down)
        plan = RoutePlan(order, offsets_i32(g.offsets), topk_idx, topk_w.contiguous())
        saved = ForwardSaved(g.gu, g.h, r_rows, rows_by_route)
        launch = fused_launch(st.config, scales is not None, comm_ctas, FUSED_BWD_TIMEOUT_S)
        if g.precision == "mxfp8":
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit, True, st.config)
            out = fused_backward(dy, x, plan, saved, weights, limit, launch,
                                 dx_shared=None if dxs is None else dxs.contiguous(),
                                 main_grads=None if main_grads is None else main_grads[:3], w_scales=scales)
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared, contiguous=True)
        out = fused_backward(dy, x, plan, saved, weights, limit, launch, shared=sh, main_grads=main_grads)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

    def backward_fused_ep(self, st, dy):
        """The backward path FUSED (or FUSED_WHOLE: the same launch) at EP > 1 after the fused forward
        (asked for in the config: compile-verified only): the whole backward in one launch per rank
        (``fused_bwd.fused_backward_ep``; collective over the workspace's ranks) from the EP forward
        state ``st`` (:class:`~mok_cute.layers.common.EPState`), the contract of the sm90 MLP's
        ``backward_fused_ep``: ``(dx [T, H], d topk_w [T, k], dWg, dWu, dWd, d shared weights or
        None)``, meant the unfused EP backward's with d topk_w a fixed-order fp32 sum; MXFP8 as
        :meth:`backward_fused`'s (the shared expert's backward before the launch). The caller checks
        the workspace's status."""
        ws, plan, g, x, w_rows, topk_idx = st.ws, st.plan, contiguous_group(st.routed), st.x, st.w_rows, st.topk_idx
        w_gate, w_up, w_down = st.weights
        limit, shared_group, shared = st.limit, st.shared_group, st.shared
        comm_ctas, num_ctas = st.config.comm_ctas_bwd(), ws.grid_ctas
        dy, x, slot_rows = dy.contiguous(), x.contiguous(), st.slot_out.contiguous()
        t, k = topk_idx.shape
        from mok_cute.kernels.operands import RoutePlan
        from mok_cute.kernels.sm100.fused_bwd import ForwardSaved, fused_backward_ep

        weights, scales = self._core_weights(g, w_gate, w_up, w_down)
        route = RoutePlan(plan.recv_src, plan.offsets, topk_idx, None)  # topk_w: per grouped row in w_rows
        saved = ForwardSaved(g.gu, g.h, slot_rows.view(t * k, -1), False, w_rows)
        launch = fused_launch(st.config, scales is not None, comm_ctas, ws.timeout_s, num_ctas)
        if g.precision == "mxfp8":
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit, True, st.config)
            out = fused_backward_ep(ws, route, dy, x, saved, weights, limit, launch, w_scales=scales,
                                    dx_shared=None if dxs is None else dxs.contiguous())
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared, contiguous=True)
        out = fused_backward_ep(ws, route, dy, x, saved, weights, limit, launch, shared=sh)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

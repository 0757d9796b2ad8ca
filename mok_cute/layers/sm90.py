"""SM90 expert MLP: the Hopper grouped GEMM kernels behind one validated call, in precisions
"bf16", "mxfp8" and "fp8_block" (numerics: :mod:`mok_cute.reference`).

Forward: GEMM1 + SwiGLU (gu, h), GEMM2. Backward: dgrad2 + dSwiGLU, dgrad1, three wgrads.
Inputs are validated once per call here; the kernels then run unchecked
(mok_cute.kernels.sm90.grouped_gemm / sm90.expert_bwd).

MXFP8 (Hopper has no block-scaled MMA): every GEMM operand goes through its MXFP8 round trip
along the reference's axes (the table of :mod:`mok_cute.layers.sm100`: rows along K, weights
through 2-D views [E*R, C] along C or along R, wgrad operands token-wise per expert) in one
pass each (:func:`mok_cute.kernels.quant.dequant_mxfp8.mxfp8_round_trip` / ``_tokens``: the CuTe
quantizers' ops, then the dequantization to BF16), and the BF16 kernels run on the result.
The round trip of a BF16 input is always exact in BF16 (see :mod:`dequant_mxfp8`), so the
kernels read the reference's dequantized values and the layer equals the reference's mxfp8
layer up to fp32 accumulation order.

FP8 blockwise: activations quantized 1x128 along K (``quantize_fp8_block_act``), wgrad
operands 128x1 along tokens (``quantize_tokens(., offsets, "fp8_block")``), weights in
128x128 blocks per expert (``quantize_fp8_block_weights_t`` = ``reference.fp8_block_quantize_weight``
per expert, with the transposed dgrad operands written in the same pass: I, H multiples of
128, so no block straddles two experts), then the SM90 FP8 kernels (:func:`fp8_kernel`).

Weights: their quantizations (MXFP8: dequantized BF16 per axis; fp8_block: data + scales,
and the transposed dgrad operands) are cached in a
:class:`~mok_cute.layers.weight_cache.WeightCache` while the weight is unchanged, so the
forward and backward of a step (and the shared expert) quantize each weight once; an in-place
update (optimizer step: ``_version`` bump) recomputes. The cache holds no reference to the
weights; its entries live as long as their weights' storage (cost: one extra copy per cached
form). Writes that bypass the version counter (``w.data``) are not seen.

Which of the fused entry points run (``fused_forward``, ``backward_tokens``, ``backward_fused``,
their EP forms) is the layer's decision, once per call (:mod:`mok_cute.layers.paths`); each
runs when called (none hands back None to ask for another path).
"""
from __future__ import annotations

import functools
import importlib

import torch

from mok_cute.config import ForwardPath
from mok_cute.layers import launch, paths
from mok_cute.layers.common import (
    ExpertGroup, MadeBefore, check_biases, contiguous_group, expert_sums, gate_up_bias_grads, mlp_backward, mlp_forward,
    ring_chunks, shared_backward, shared_launch_operands, whole_backward_operands, whole_offsets,
)
from mok_cute.dsl.host import halves_of, offsets_i32, tma_weight
from mok_cute.layers.weight_cache import WeightCache

# FP8 blockwise kernels and the module of each (looked up at call time: tests swap in emulators)
_FP8_KERNELS = {
    "grouped_gemm1_swiglu_fp8_block": "fp8_expert",
    "grouped_gemm_fp8_block": "fp8_gemm",
    "grouped_dswiglu_dgrad_fp8_block": "fp8_expert",
    "grouped_dgrad1_fp8_block": "fp8_expert",
    "grouped_wgrad_fp8_block": "fp8_scaled",
}


def fp8_kernel(name: str):
    """The FP8 blockwise kernel wrapper ``name`` (a key of ``_FP8_KERNELS``)."""
    return getattr(importlib.import_module(f"mok_cute.kernels.sm90.{_FP8_KERNELS[name]}"), name)


# ----------------------------------------------------------------------------- MXFP8
def _mx_dequant_weight(w, axis):
    """bf16 [E, R, C]: w's MXFP8 round trip along ``axis`` (2: C, rows of [E*R, C]; 1: R, columns
    of [E*R, C] in blocks of 32 rows from row 0: R % 32 == 0, so no block straddles experts)."""
    from mok_cute.kernels.quant import dequant_mxfp8

    e, r, c = w.shape
    w2 = w.reshape(e * r, c)
    if axis == 2:
        return dequant_mxfp8.mxfp8_round_trip(w2).view(e, r, c)
    return dequant_mxfp8.mxfp8_round_trip_tokens(w2, whole_offsets(e * r, w.device)).view(e, r, c)


FUSED_CORE_PRECISIONS = ("bf16", "mxfp8")  # the fused backward core's (fused_bwd: BF16 and its mx variant)


def _mx_rows(x):
    """bf16 [M, K]: x's MXFP8 round trip along its rows."""
    from mok_cute.kernels.quant import dequant_mxfp8

    return dequant_mxfp8.mxfp8_round_trip(x)


def _mx_tokens(x, offs32):
    """bf16 token rows [M, N]: x's MXFP8 round trip along tokens per expert (0 past offsets[E])."""
    from mok_cute.kernels.quant import dequant_mxfp8

    return dequant_mxfp8.mxfp8_round_trip_tokens(x, offs32)


# ----------------------------------------------------------------------------- FP8 blockwise
def _tiles(config, gemm: str) -> dict:
    """``tile_n`` and ``stages`` of GEMM ``gemm`` (``mok_cute.policy.GEMMS``) under the call's ``config``
    (its ``kernel_policy``, checked by the layer: SM90 runs tile_m and tile_k at their defaults only), as
    the launches take them (None: the kernel's default); none for ``config`` None."""
    if config is None:
        return {}
    t = config.kernel_policy.gemm(gemm)
    return {"tile_n": t.tile_n, "stages": t.stages}


def _with_tiles(run, config, gemm: str):
    """The unfused GEMM ``gemm``'s run function ``run`` with the mainloop of the call's ``config`` (``cfg=``),
    or ``run`` itself where the policy leaves that GEMM's tiles to the kernel (the call as it always was)."""
    from mok_cute.kernels.sm90.mainloop import launch_config

    tiles = _tiles(config, gemm)
    if all(v is None for v in tiles.values()):
        return run
    return functools.partial(run, cfg=launch_config(**tiles))


def _core_launch(launch_cls, g: ExpertGroup, config):
    """The fused backward core's launch for group ``g`` under the call's ``config`` (None: defaults):
    its device timeout, resolved trace flag and the policy's fused backward tiles, MXFP8 by the group's
    precision."""
    extra = {} if config is None else dict(timeout_s=config.device_timeout_s, trace=bool(config.trace),
                                           num_ctas=launch.grid(config), **_tiles(config, "fused_backward"))
    return launch_cls(mx=g.precision == "mxfp8", **extra)


def _fp8_weights(*ws):
    """``([(data [E, R_j, C] e4m3, scales [E, R_j/128, C/128] fp32) per weight], (data_t [E, C,
    sum R_j], scales_t))``: 128x128 blocks per expert, and the dgrad operand (the weights stacked
    along R and transposed), in one pass (``quantize_fp8.quantize_fp8_block_weights_t``)."""
    from mok_cute.kernels.quant import quantize_fp8

    return quantize_fp8.quantize_fp8_block_weights_t(*(w.contiguous() for w in ws))


def _fp8_act(x):
    from mok_cute.kernels.quant import quantize_fp8

    return quantize_fp8.quantize_fp8_block_act(x)


def _fp8_tokens(x, offs32):
    from mok_cute.kernels.quant import quantize_fp8

    return quantize_fp8.quantize_tokens(x, offs32, "fp8_block")


class Sm90ExpertMLP:
    """BF16 / MXFP8 / FP8-blockwise expert MLP on the SM90 kernels (output tile 256 wide; a
    partial last tile where H or I is not a multiple of it)."""

    arch = "sm90"  # its row of the path table (mok_cute.layers.paths): what runs fused, in which precisions
    dim_multiple = {"bf16": 64, "mxfp8": 64, "fp8_block": 128}  # H, I, I_s (fp8_block: its 128-blocks)
    strided_weights = True  # weights in place when TMA addresses them (dsl.host.tma_weight), no copy
    precisions = ("bf16", "mxfp8", "fp8_block")
    fused_mx_prologue = True  # BackwardPath.FUSED at MXFP8 after the fused forward: mx_prologue first
    gathers_x = True  # BackwardPath.FUSED at BF16: backward_tokens(made.x_tok) gathers x's rows in its launch
    down_grad_first = True  # BackwardPath.FUSED at BF16: down_weight_grad, then backward_tokens(made.dwd) without h

    def __init__(self):
        self.weights = WeightCache()

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, precision: str = "bf16", config=None,
                biases=None):
        """(rows [M, H], ExpertGroup) for expert-grouped x_rows, in ``precision``; ``config``: the call's,
        whose policy's GEMM1 / GEMM2 tiles the BF16 kernels run (None: their defaults; fp8_block: its own);
        ``biases``: None or the experts' (b_gate, b_up [E, I], b_down [E, H]) bf16, unit last strides (BF16 only:
        the epilogues add them, :mod:`~mok_cute.kernels.sm90.bias`)."""
        from mok_cute.kernels.sm90 import grouped_gemm as fwd

        if precision not in self.precisions:
            raise ValueError(f"sm90 expert MLP: precision must be one of {self.precisions}, got {precision!r}")
        _check_mlp(fwd, x_rows, offsets, w_gate, w_up, w_down, limit, self.dim_multiple[precision])
        check_biases("sm90", biases, precision)
        gemm1 = _with_tiles(fwd._run_gemm1_swiglu, config, "gemm1")
        gemm2 = _with_tiles(fwd._run_gemm, config, "gemm2")
        if precision == "mxfp8":
            return self._mx_forward((gemm1, gemm2), x_rows, offsets, w_gate, w_up, w_down, limit)
        if precision == "fp8_block":
            return self._fp8_forward(x_rows, offsets, w_gate, w_up, w_down, limit)
        return mlp_forward(gemm1, gemm2, x_rows, offsets, w_gate, w_up, w_down, limit, biases)

    def fused_forward(self, x, plan, weights, shared, limit, config, gate=None, biases=None):
        """The fused forward (:mod:`mok_cute.kernels.sm90.fused_moe`) at EP = 1 on x [T, H], the route ``plan``
        (:class:`~mok_cute.kernels.operands.RoutePlan`: order int32 [T*k], offsets int32 [E+1], topk_idx, topk_w)
        and the routed ``weights`` (:class:`~mok_cute.kernels.operands.ExpertWeights`) in ``config.precision``
        (bf16 or mxfp8: x and the weights round-tripped as the unfused MXFP8 forward does, h in the kernel);
        ``gate``: fp32 [T], the shared expert's output gate per token; ``biases``: as :meth:`forward`'s; returns
        ``(y, gu, h, slot_out, gus, hs, s_out)`` (``s_out`` the shared expert's output, None without one). The
        gathered rows pass through a ring of ``config.minibatch_tokens * k`` rows
        (:func:`~mok_cute.layers.common.ring_chunks`), not kept."""
        from mok_cute.kernels.sm90 import fused_moe as fused

        args, mx = self._fused_operands(x, plan.offsets, *weights, shared, limit, config)
        check_biases("sm90", biases, config.precision)
        out = fused.fused_forward(
            args[0], plan, fused.ExpertWeights(*args[1:4]), fused.SharedExpert.of(args[4], gate), limit,
            fused.FusedLaunch(config.comm_ctas_fwd(1), config.device_timeout_s, num_ctas=launch.grid(config),
                              ring_chunks=ring_chunks(config, plan.topk_idx), trace=bool(config.trace), mx=mx,
                              band=launch.band(config), **_tiles(config, "fused_forward")), biases=biases)
        fused.watch_status(out[7][-1], first=config.validate_routing)  # else routing_plan watched first
        return out[:7]

    def fused_forward_ep(self, ws, plan, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, config,
                         num_ctas: int | None = None):
        """The fused forward at EP > 1 (this rank's launch; collective over ``ws``'s ranks) on the
        device plan ``plan``: returns ``(y, gu, h, slot_out, gus, hs, w_rows)`` (the pulled rows
        pass through the ring, as at EP = 1); peer errors are in ``ws.status`` (the caller's
        ``ws.check_status()``)."""
        from mok_cute.kernels.sm90 import fused_moe as fused

        args, mx = self._fused_operands(x, plan.offsets, w_gate, w_up, w_down, shared, limit, config)
        out = fused.fused_forward(
            args[0], fused.RoutePlan(plan.recv_src, plan.offsets, topk_idx.to(torch.int32), topk_w),
            fused.ExpertWeights(*args[1:4]), fused.SharedExpert.of(args[4]), limit,
            fused.FusedLaunch(config.comm_ctas_fwd(ws.EP), config.device_timeout_s,
                              num_ctas=launch.grid(config, num_ctas), ring_chunks=ring_chunks(config, topk_idx),
                              trace=bool(config.trace), mx=mx, band=launch.band(config),
                              **_tiles(config, "fused_forward")), ws=ws)
        return (*out[:6], out[8])

    def _fused_operands(self, x, offsets, w_gate, w_up, w_down, shared, limit, config):
        """((x, w_gate, w_up, w_down, shared) as the fused kernel reads them, mx): validated; at
        mxfp8 the weights MXFP8 round-tripped (cached per version), x quantized by the kernel's host."""
        from mok_cute.kernels.sm90 import grouped_gemm as fwd

        fused = paths.runs("sm90", "forward", ForwardPath.FUSED, 1).precisions
        if config.precision not in fused:
            raise ValueError(f"the sm90 fused forward runs {fused}, not {config.precision!r}")
        mult = self.dim_multiple[config.precision]
        _check_mlp(fwd, x, offsets, w_gate, w_up, w_down, limit, mult)
        if shared is not None:
            _check_mlp(fwd, x, offsets[:2], *(w[None] for w in shared), limit, mult)
        mx = config.precision == "mxfp8"
        if mx:  # x stays as given: the kernel moves its MXFP8 rows (fused_moe._mx_source)
            w_gate, w_up, w_down = (self._mx_weight(w, 2) for w in (w_gate, w_up, w_down))
            if shared is not None:
                shared = tuple(self._mx_weight(w[None], 2)[0] for w in shared)
        return (x, w_gate, w_up, w_down, shared), mx

    def backward(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, *, fused: bool = False, config=None,
                 biased: bool = False):
        """(dx rows, dWg, dWu, dWd) in the precision of the forward that made ``g``; operands
        were validated by forward, only dy is new. ``fused``: one launch of the fused backward
        core (BF16, MXFP8: its mx variant; the backward path FUSED), else the separate kernels
        (bitwise the same). ``config``: the call's (its ``trace`` resolved by the layer; its policy's tiles
        of the kernels that run), or None. ``biased`` (BF16, the separate kernels): then also (d b_gate,
        d b_up, d b_down) (:func:`~mok_cute.layers.common.bias_grads`)."""
        from mok_cute.kernels.sm90 import expert_bwd as bwd
        from mok_cute.kernels.sm90 import grouped_gemm as fwd

        _check_dy(fwd, g, dy_rows)
        if biased and (fused or g.precision != "bf16"):
            raise ValueError(f"biased: the sm90 expert MLP's separate BF16 kernels only, not fused={fused} at "
                             f"{g.precision!r} (the layer's fused backward: backward_tokens)")
        if fused and g.precision not in FUSED_CORE_PRECISIONS:
            raise ValueError(f"the sm90 fused backward core runs {FUSED_CORE_PRECISIONS}, not {g.precision!r}")
        if g.precision == "fp8_block":
            return self._fp8_backward(g, dy_rows, w_gate, w_up, w_down, limit)
        if fused:
            from mok_cute.kernels.sm90.fused_bwd import BackwardLaunch, ExpertRows, fused_backward_core

            g = contiguous_group(g)
            return fused_backward_core(ExpertRows(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets)),
                                       self._bwd_weights(g, w_gate, w_up, w_down), limit,
                                       _core_launch(BackwardLaunch, g, config))
        kernels = tuple(_with_tiles(f, config, n) for f, n in (
            (bwd._run_dswiglu_dgrad, "dgrad2"), (bwd._run_dgrad1, "dgrad1"), (bwd._run_wgrad, "wgrad")))
        if g.precision == "mxfp8":
            return self._mx_backward(kernels, g, dy_rows, w_gate, w_up, w_down, limit)
        return mlp_backward(*kernels, g, dy_rows, w_gate, w_up, w_down, limit, biased)

    def backward_tokens(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, tokens, consume: bool = False,
                        config=None, biased: bool = False, made: MadeBefore = MadeBefore()):
        """``(dx [T, H], dWg, dWu, dWd)``: :meth:`backward` with the dx rows summed into their tokens
        in the same launch (``fused_bwd.fused_backward_core(tokens=...)``; ``tokens`` = ``(order,
        topk_idx, dx_shared, dx_add)``: ``order`` [M+] grouped row -> t*k + j, ``topk_idx`` [T, k],
        ``dx_shared`` [T, H] or None, ``dx_add`` fp32 [T, H] or None: added to its fp32 start),
        bitwise the unfused scatter and slot sum: the backward path FUSED, BF16 or MXFP8.
        ``consume``: the caller gives up ``dy_rows``, ``g.x``, ``g.gu`` and ``g.h`` (dgu is written
        over gu; MXFP8: their round trips are made in place). ``config``: the call's (its ``trace``
        resolved by the layer), or None. ``biased`` (BF16, ``consume``): then also (d b_gate, d b_up,
        d b_down): d b_down from dy_rows before the launch (which writes the dx rows over them), the others
        from the dgu it writes over gu (:func:`~mok_cute.layers.common.bias_grads`). ``made``
        (:class:`~mok_cute.layers.common.MadeBefore`): ``mx_dyt``: :meth:`mx_prologue` made dy_rows' and g.x's
        round trips (dy_t its second output); ``x_tok`` (BF16 with ``consume``, ``g.x`` None): the layer's x
        [T, H], the launch's weight gradients gather its rows (no grouped x rows are made); ``dwd`` (BF16 with
        ``consume``): :meth:`down_weight_grad`'s dW_down, made before this launch, which then skips its dW_down
        tiles and reads no h (``g.h`` may be None)."""
        from mok_cute.kernels.sm90 import grouped_gemm as fwd
        from mok_cute.kernels.sm90.fused_bwd import BackwardLaunch, ExpertRows, fused_backward_core

        if g.precision not in FUSED_CORE_PRECISIONS:
            raise ValueError(f"the sm90 fused backward core runs {FUSED_CORE_PRECISIONS}, not {g.precision!r}")
        order, topk_idx, dx_shared, dx_add = tokens
        x_tok = made.x_tok
        g = contiguous_group(g)
        if dx_shared is not None:
            dx_shared = dx_shared.contiguous()
        _check_dy(fwd, g, dy_rows, x_tok)
        if biased and not (consume and g.precision == "bf16"):
            raise ValueError(f"biased: backward_tokens at bf16 with consume only, got {g.precision!r}, "
                             f"consume={consume}")
        d_down = expert_sums(dy_rows, g.offsets) if biased else None
        out = fused_backward_core(ExpertRows(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets)),
                                  self._bwd_weights(g, w_gate, w_up, w_down), limit,
                                  _core_launch(BackwardLaunch, g, config),
                                  tokens=(order, topk_idx, dx_shared, dx_add), consume=consume, mx_dyt=made.mx_dyt,
                                  x_tok=None if x_tok is None else x_tok.contiguous(), dwd=made.dwd)
        if not biased:
            return out
        return (*out, *gate_up_bias_grads(g.gu, g.offsets), d_down)  # the launch wrote dgu over gu (consume)

    def down_weight_grad(self, g: ExpertGroup, dy_rows, config=None):
        """dW_down [E, H, I] of BF16 group ``g`` from the routed dy rows [M, H], by the fused backward's dW_down
        tiles on their own (``fused_bwd.down_weight_grad``, bitwise the launch's): run before
        :meth:`backward_tokens` (``dwd=``) so that the caller frees h before that launch, whose peak then holds
        no h. ``config``: the call's, or None."""
        from mok_cute.kernels.sm90 import grouped_gemm as fwd
        from mok_cute.kernels.sm90.fused_bwd import BackwardLaunch, down_weight_grad

        if g.precision != "bf16" or g.h is None:
            raise ValueError(f"down_weight_grad: a BF16 group with its h, got {g.precision!r}, h={g.h is not None}")
        _check_dy(fwd, g, dy_rows)
        return down_weight_grad(dy_rows, g.h.contiguous(), offsets_i32(g.offsets),
                                _core_launch(BackwardLaunch, g, config))

    def mx_prologue(self, g: ExpertGroup, dy, r_rows, order, topk_w, rows_by_route: bool):
        """The MXFP8 backward's prologue (the backward path FUSED at MXFP8 after the fused forward,
        whose route-order rows ``r_rows`` [T*k, H] it reads): ``(dy_rows, dy_t, d topk_w, x_rows)``
        from the layer's dy in one launch (``route_grad.mx_dy_rows_and_dtopk_w``: the route_grad pass
        and dy's round trips), ``x_rows(x)`` making the grouped x rows with their round trip in a
        second (``route_grad.mx_x_rows``); the caller frees ``r_rows`` before it calls ``x_rows``, then
        runs :meth:`backward_tokens` with ``g.x`` those rows and ``mx_dyt=dy_t``. Both launches run
        over every SM, each output written once (faster than the route_grad pass, the x gather and
        three round-trip passes it replaces: docs/design-decisions.md, 2026-12-03)."""
        t, k = topk_w.shape
        if g.precision != "mxfp8" or r_rows.shape[0] != t * k:
            raise ValueError(f"mx_prologue: an MXFP8 group and [T*k = {t * k}, H] route rows, got "
                             f"{g.precision!r}, {tuple(r_rows.shape)}")
        dy, r_rows = dy.contiguous(), r_rows.contiguous()
        from mok_cute.kernels.route_grad import mx_dy_rows_and_dtopk_w, mx_x_rows

        order32, offs32 = order.to(torch.int32), offsets_i32(g.offsets)
        dy_rows, dy_t, dtw = mx_dy_rows_and_dtopk_w(dy, r_rows, order32, topk_w.contiguous(), offs32, rows_by_route)
        return dy_rows, dy_t, dtw, lambda x: mx_x_rows(x.contiguous(), order32, offs32, k)

    def _bwd_weights(self, g: ExpertGroup, w_gate, w_up, w_down):
        """The weights the backward's GEMMs read: as given (BF16), or dequantized from their MXFP8
        along dgrad's reduction axis (cached while unchanged); gate and up given as the halves of one fc1
        tensor stay the halves of one dequantized tensor (their gradients then are too: fc1's in one piece;
        the MXFP8 blocks of 32 along 2I never straddle the halves, I being a multiple of 64)."""
        if g.precision != "mxfp8":
            return w_gate, w_up, w_down
        fc1 = halves_of(w_gate, w_up)
        if fc1 is None:
            return tuple(self._mx_weight(w, 1) for w in (w_gate, w_up, w_down))
        inter = w_gate.shape[1]
        d = self._mx_weight(fc1, 1)
        return d[:, :inter], d[:, inter:], self._mx_weight(w_down, 1)

    def backward_fused(self, st, dy, main_grads=None):
        """The backward path FUSED_WHOLE (after the fused forward, no output gate: the path table):
        the whole backward from the layer's tokens in one launch (``fused_bwd.fused_backward``: the
        route_grad pass, the x gather, the routed and the shared expert's GEMMs, the dx scatter and
        slot sum), from the EP = 1 forward state ``st`` (:class:`~mok_cute.layers.common.LocalState`):
        ``(dx [T, H], d topk_w [T, k], dWg, dWu, dWd, d shared weights or None)``, bitwise the unfused
        backward; with ``main_grads`` (fp32, validated by ``ops.moe``; BF16 only, the table) the weight
        gradients are added into them in the launch and returned as None; ``comm_sms_bwd`` CTAs build
        the routed rows first. MXFP8: the launch's mx variant (the rows' round trips in the launch),
        the shared expert's backward before it."""
        from mok_cute.kernels.operands import RoutePlan
        from mok_cute.kernels.sm90.fused_bwd import BackwardInputs, BackwardLaunch, fused_backward

        g, dy, x, r_rows, (w_gate, w_up, w_down) = whole_backward_operands(st, dy)
        order, topk_w, topk_idx, limit, rows_by_route = st.order, st.topk_w, st.topk_idx, st.limit, st.rows_by_route
        comm_ctas, shared_group, shared = st.config.comm_ctas_bwd(), st.shared_group, st.shared
        tiles = _tiles(st.config, "fused_backward")
        mx = g.precision == "mxfp8"
        if mx:  # the shared expert's backward first, its dx the slot sum's start (as at EP > 1)
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit, True, st.config)
            out = fused_backward(BackwardInputs(dy, x, r_rows, g.gu, g.h, rows_by_route),
                                 RoutePlan(order, offsets_i32(g.offsets), topk_idx, topk_w.contiguous()),
                                 self._bwd_weights(g, w_gate, w_up, w_down), limit,
                                 BackwardLaunch(num_ctas=launch.grid(st.config), comm_ctas=comm_ctas,
                                                trace=st.config.trace, mx=True, **tiles),
                                 None if dxs is None else dxs.contiguous())
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared)
        if main_grads is not None and not all(mg.is_contiguous() for mg in main_grads):
            main_grads = None  # the caller adds them
        out = fused_backward(BackwardInputs(dy, x, r_rows, g.gu, g.h, rows_by_route),
                             RoutePlan(order, offsets_i32(g.offsets), topk_idx, topk_w.contiguous()),
                             (w_gate, w_up, w_down), limit,
                             BackwardLaunch(num_ctas=launch.grid(st.config), comm_ctas=comm_ctas,
                                            trace=st.config.trace, **tiles),
                             shared=sh, main_grads=main_grads)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

    def backward_fused_ep(self, st, dy):
        """The backward path FUSED (or FUSED_WHOLE: the same launch) at EP > 1 after the fused forward:
        the whole backward in one launch per rank (``fused_bwd.fused_backward_ep``; collective over the
        workspace's ranks) from the EP forward state ``st`` (:class:`~mok_cute.layers.common.EPState`):
        ``(dx [T, H], d topk_w [T, k], dWg, dWu, dWd, d shared weights or None)``, the unfused EP
        backward's (reverse combine, expert backward, reverse dispatch) with d topk_w a fixed-order fp32
        sum, the same answer on every rank. At MXFP8 the shared expert's backward runs before the launch
        (:func:`~mok_cute.layers.common.shared_backward`) and its dx starts the launch's slot sum. The
        caller checks the workspace's status."""
        from mok_cute.kernels.sm90.fused_bwd import BackwardInputs, BackwardLaunch, fused_backward_ep

        ws, plan, g, x, w_rows, topk_idx = st.ws, st.plan, contiguous_group(st.routed), st.x, st.w_rows, st.topk_idx
        w_gate, w_up, w_down = st.weights
        limit, shared_group, shared = st.limit, st.shared_group, st.shared
        comm_ctas, num_ctas = st.config.comm_ctas_bwd(), launch.grid(st.config, ws.grid_ctas)
        tiles = _tiles(st.config, "fused_backward")
        dy, x = dy.contiguous(), x.contiguous()
        mx = g.precision == "mxfp8"
        slots = st.slot_out.contiguous().reshape(-1, dy.shape[1])
        if mx:
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit, True, st.config)
            out = fused_backward_ep(ws, plan, BackwardInputs(dy, x, slots, g.gu, g.h), w_rows, topk_idx,
                                    self._bwd_weights(g, w_gate, w_up, w_down), limit,
                                    BackwardLaunch(num_ctas=num_ctas, comm_ctas=comm_ctas, trace=st.config.trace,
                                                   mx=True, **tiles),
                                    dx_shared=None if dxs is None else dxs.contiguous())
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared)
        out = fused_backward_ep(ws, plan, BackwardInputs(dy, x, slots, g.gu, g.h), w_rows, topk_idx,
                                (w_gate, w_up, w_down), limit,
                                BackwardLaunch(num_ctas=num_ctas, comm_ctas=comm_ctas, trace=st.config.trace, **tiles),
                                shared=sh)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

    # ------------------------------------------------------------------ MXFP8
    def _mx_weight(self, w, axis):
        return self.weights.get(("mxfp8", axis), (w,), lambda t: _mx_dequant_weight(t, axis))

    def _mx_forward(self, gemms, x_rows, offsets, w_gate, w_up, w_down, limit):
        """The MXFP8 forward on the BF16 ``gemms`` (GEMM1 + SwiGLU, GEMM2) over the operands' round trips."""
        gemm1, gemm2 = gemms
        gu, h = gemm1(_mx_rows(x_rows), offsets, self._mx_weight(w_gate, 2), self._mx_weight(w_up, 2), limit)
        out = gemm2(_mx_rows(h), offsets, self._mx_weight(w_down, 2))
        return out, ExpertGroup(x_rows, offsets, gu, h, "mxfp8")

    def _mx_backward(self, kernels, g, dy_rows, w_gate, w_up, w_down, limit):
        """The MXFP8 backward on the BF16 ``kernels`` (dgrad2 + dSwiGLU, dgrad1, wgrad) over the round trips."""
        dswiglu_dgrad, dgrad1, wgrad = kernels
        inter = w_gate.shape[1]
        dgu = dswiglu_dgrad(_mx_rows(dy_rows), g.offsets, self._mx_weight(w_down, 1), g.gu, limit)
        dx = dgrad1(_mx_rows(dgu), g.offsets, self._mx_weight(w_gate, 1), self._mx_weight(w_up, 1))
        offs32 = offsets_i32(g.offsets)
        dy_t, h_t = _mx_tokens(dy_rows, offs32), _mx_tokens(g.h, offs32)
        dgu_t, x_t = _mx_tokens(dgu, offs32), _mx_tokens(g.x, offs32)
        dwd = wgrad(dy_t, h_t, g.offsets)
        dwg = wgrad(dgu_t[:, :inter], x_t, g.offsets)
        dwu = wgrad(dgu_t[:, inter:], x_t, g.offsets)
        return dx, dwg, dwu, dwd

    # ------------------------------------------------------------------ FP8 blockwise
    def _fp8_weights(self, *ws):
        """Cached :func:`_fp8_weights` of (w_gate, w_up) or (w_down,), while unchanged."""
        return self.weights.get(("fp8_block",), ws, _fp8_weights)

    def _fp8_forward(self, x_rows, offsets, w_gate, w_up, w_down, limit):
        kernels = {name: fp8_kernel(name) for name in _FP8_KERNELS}  # all of them, before any launch
        xq, xs = _fp8_act(x_rows)
        ((gq, gs), (uq, us)), _ = self._fp8_weights(w_gate, w_up)
        gu, h = kernels["grouped_gemm1_swiglu_fp8_block"](xq, xs, offsets, gq, gs, uq, us, limit=limit)
        hq, hs = _fp8_act(h)
        ((dq, ds),), _ = self._fp8_weights(w_down)
        out = kernels["grouped_gemm_fp8_block"](hq, hs, offsets, dq, ds)
        return out, ExpertGroup(x_rows, offsets, gu, h, "fp8_block")

    def _fp8_backward(self, g, dy_rows, w_gate, w_up, w_down, limit):
        k = {name: fp8_kernel(name) for name in _FP8_KERNELS}
        inter = w_gate.shape[1]
        _, wdt = self._fp8_weights(w_down)
        _, w1t = self._fp8_weights(w_gate, w_up)
        dyq, dys = _fp8_act(dy_rows)
        dgu = k["grouped_dswiglu_dgrad_fp8_block"](dyq, dys, g.offsets, *wdt, g.gu, limit=limit)
        dguq, dgus = _fp8_act(dgu)
        dx = k["grouped_dgrad1_fp8_block"](dguq, dgus, g.offsets, *w1t)
        offs32 = offsets_i32(g.offsets)
        (dy_t, dy_s), (h_t, h_s) = _fp8_tokens(dy_rows, offs32), _fp8_tokens(g.h, offs32)
        (dgu_t, dgu_s), (x_t, x_s) = _fp8_tokens(dgu, offs32), _fp8_tokens(g.x, offs32)
        wgrad = k["grouped_wgrad_fp8_block"]
        dwd = wgrad(dy_t, dy_s, h_t, h_s, g.offsets)
        dwg = wgrad(dgu_t[:inter], dgu_s[:, :inter], x_t, x_s, g.offsets)
        dwu = wgrad(dgu_t[inter:], dgu_s[:, inter:], x_t, x_s, g.offsets)
        return dx, dwg, dwu, dwd


def _check_mlp(fwd, x_rows, offsets, w_gate, w_up, w_down, limit, mult: int):
    """Validate, once, everything the expert MLP's seven launches need (the kernels then run
    unchecked): x [M, H] contiguous, w_gate/w_up [E, I, H], w_down [E, H, I] bf16 addressable in
    place by TMA (``dsl.host.tma_weight``: e.g. the halves of one fc1 tensor) on one CUDA device,
    offsets int32/int64 [E+1], H and I multiples of ``mult`` (the precision's ``dim_multiple``: 64,
    also the 32 of the MX blocks; fp8_block 128, its blocks)."""
    m, hid, e = fwd._check_operands(x_rows, offsets, {"w_gate": w_gate, "w_up": w_up}, a_name="x")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_up shape {tuple(w_up.shape)} must equal w_gate shape {tuple(w_gate.shape)}")
    inter = w_gate.shape[1]
    fwd._check_tensor("w_down", w_down, 3, (torch.bfloat16,))
    if tuple(w_down.shape) != (e, hid, inter) or not tma_weight(w_down):
        raise ValueError(f"w_down must be [E, H, I] = {(e, hid, inter)} with I contiguous, 16-byte strides and "
                         f"alignment, got shape {tuple(w_down.shape)} strides {w_down.stride()}")
    for name, v in (("H", hid), ("I", inter)):
        if v % mult or v == 0:
            raise ValueError(f"expert MLP: {name} = {v} must be a positive multiple of {mult}")
    if m >= 2 ** 31:
        raise ValueError(f"x: M = {m} rows must be < 2^31")
    fwd._check_limit(limit)
    fwd._check_devices(x=x_rows, offsets=offsets, w_gate=w_gate, w_up=w_up, w_down=w_down)


def _check_dy(fwd, g: ExpertGroup, dy_rows, x_tok=None):
    """The backward's one new input: dy [M, H] bf16 contiguous, 16-byte aligned, x's device (M: g.x's rows, or
    with ``x_tok``, the layer's x [T, H] whose rows the launch gathers, gu's; with neither, M gu's rows and the
    device gu's)."""
    fwd._check_tensor("dy", dy_rows, 2, (torch.bfloat16,))
    x = g.x if x_tok is None else x_tok
    if x is None:
        x = g.gu
        want = (g.gu.shape[0], dy_rows.shape[1])
    else:
        want = tuple(x.shape) if x_tok is None else (g.gu.shape[0], x_tok.shape[1])
    if tuple(dy_rows.shape) != want or not dy_rows.is_contiguous() or dy_rows.data_ptr() % 16:
        raise ValueError(f"dy must be contiguous {want} and 16-byte aligned, got {tuple(dy_rows.shape)}")
    fwd._check_devices(x=x, dy=dy_rows)

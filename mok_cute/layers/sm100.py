"""SM100/SM103 expert MLP: the Blackwell (tcgen05) grouped GEMM kernels behind one call.

Compile-verified only: no Blackwell GPU is available to this project, so this path has
never run. Forward: GEMM1 + SwiGLU (gu, h), GEMM2; backward: dgrad2 + dSwiGLU, dgrad1, three
wgrads (mok_cute.kernels.sm100.grouped_gemm, whose wrappers validate every call). EP > 1 (opt-in,
``MOK_CUTE_SM100_FUSED=1``): the fused forward's EP mode (:meth:`Sm100ExpertMLP.fused_forward_ep`),
the fused EP backward at BF16 (:meth:`Sm100ExpertMLP.backward_fused_ep`), else the unfused EP backward
of :mod:`mok_cute.layers.ep` over :meth:`Sm100ExpertMLP.backward`.

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
"""
from __future__ import annotations

import functools
import os

import torch

from mok_cute.layers.common import (
    ExpertGroup, mlp_backward, mlp_forward, ring_chunks, shared_backward, shared_launch_operands,
)
from mok_cute.layers.weight_cache import WeightCache
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


def _fused_core_ok(g: ExpertGroup, dy_rows) -> bool:
    """Whether the fused backward core takes these operands: contiguous CUDA rows (elsewhere the
    unfused path, whose kernels the CPU tests emulate)."""
    return g.x is not None and dy_rows.is_cuda and all(t.is_contiguous() for t in (dy_rows, g.x, g.gu, g.h))


FUSED_CORE_PRECISIONS = ("bf16", "mxfp8")  # the fused backward core's (fused_bwd: BF16 and its mx variant)


class Sm100ExpertMLP:
    """BF16 / MXFP8 expert MLP on the SM100 kernels (output tiles 256 wide; H, I, I_s any
    multiple of 64: partial last tiles along N are masked, K tails zero-filled)."""

    arch = "sm100"
    dim_multiple = {"bf16": 64, "mxfp8": 64}
    precisions = ("bf16", "mxfp8")

    def __init__(self):
        self.weights = WeightCache()

    @property
    def fused_precisions(self) -> tuple:
        """The precisions the EP = 1 layer runs through the fused forward
        (:mod:`mok_cute.kernels.sm100.fused_moe`: BF16 and MXFP8) and, where it takes the group
        (:data:`FUSED_CORE_PRECISIONS`: BF16 and MXFP8), the fused backward core
        (:mod:`mok_cute.kernels.sm100.fused_bwd`): opt-in with ``MOK_CUTE_SM100_FUSED=1`` (read at
        every call) until they have run on a Blackwell GPU; else none (the unfused path)."""
        return ("bf16", "mxfp8") if os.environ.get("MOK_CUTE_SM100_FUSED", "0") == "1" else ()

    @property
    def expert_parallel(self) -> bool:
        """EP > 1 through :mod:`mok_cute.layers.ep` (its forward the fused kernel's EP mode,
        :meth:`fused_forward_ep`, unless ``MOK_CUTE_FUSED_EP=0``; its backward :meth:`backward_fused_ep`,
        BF16 and MXFP8, unless ``MOK_CUTE_FUSED_BWD=0``: the unfused EP stages over :meth:`backward`): opted in with
        ``MOK_CUTE_SM100_FUSED=1`` only, as the fused kernels (never run on a Blackwell GPU)."""
        return bool(self.fused_precisions)

    @property
    def ep_precisions(self) -> tuple:
        """The precisions EP > 1 runs in (``GroupedExpertBackend.check``): those of the fused forward."""
        return self.fused_precisions

    def _fused_core(self, g: ExpertGroup, dy_rows) -> bool:
        """Whether the fused backward core runs this backward: opted in, a BF16 / MXFP8 group, operands it takes."""
        return g.precision in FUSED_CORE_PRECISIONS and g.precision in self.fused_precisions \
            and _fused_core_ok(g, dy_rows)

    def _core_weights(self, g: ExpertGroup, w_gate, w_up, w_down):
        """``(w_gate, w_up, w_down, {"w_scales": ...} or {})``: the fused core's weights, at MXFP8
        quantized along their rows' K as :func:`mx_backward` reads them (cached per version)."""
        if g.precision != "mxfp8":
            return w_gate, w_up, w_down, {}
        (gq, gs), (uq, us), (dq, ds) = (self._qw(w, 1) for w in (w_gate, w_up, w_down))
        return gq, uq, dq, {"w_scales": (gs, us, ds)}

    def fused_forward(self, x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, config,
                      gate=None):
        """The fused forward at EP = 1 in ``config.precision`` (bf16, or mxfp8: the weights quantized
        along their rows as the unfused MXFP8 forward does, cached per version; x quantized by the
        kernel's host): the contract of the sm90 MLP's ``fused_forward`` (``(y, gu, h, slot_out, gus,
        hs, s_out)``, gu / h / gus / hs bf16 for the unfused MXFP8 backward; the ring of
        ``ring_chunks`` slots; the kernel's status watched on the device, raised by a later call)."""
        from mok_cute.kernels.sm100 import fused_moe as fused
        from mok_cute.kernels.sm90.fused_moe import watch_status

        w_gate, w_up, w_down, shared, mx = self._fused_weights(config, w_gate, w_up, w_down, shared)
        out = fused.fused_forward(x, order, offsets, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit,
                                  config.comm_ctas_fwd(1), config.device_timeout_s,
                                  ring_chunks=ring_chunks(config, topk_idx), gate=gate, interleave=self._interleaved,
                                  **mx)
        watch_status(out[7][-1], first=config.validate_routing)
        return out[:7]

    def fused_forward_ep(self, ws, plan, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, limit, config,
                         num_ctas: int | None = None):
        """The fused forward at EP > 1 (this rank's launch; collective over ``ws``'s ranks) on the
        device plan ``plan`` (``recv_src``, ``offsets``), the contract of the sm90 MLP's
        ``fused_forward_ep``: returns ``(y, gu, h, slot_out, gus, hs, w_rows)`` (``slot_out`` this
        rank's slot rows [T*k, H], ``w_rows`` each grouped row's router weight); peer errors are in
        ``ws.status`` (the caller's ``ws.check_status()``); ``num_ctas``: this rank's grid."""
        from mok_cute.kernels.sm100 import fused_moe as fused

        w_gate, w_up, w_down, shared, mx = self._fused_weights(config, w_gate, w_up, w_down, shared)
        out = fused.fused_forward(x, plan.recv_src, plan.offsets, topk_idx.to(torch.int32), topk_w, w_gate, w_up,
                                  w_down, shared, limit, config.comm_ctas_fwd(ws.EP), config.device_timeout_s,
                                  num_ctas=num_ctas, ring_chunks=ring_chunks(config, topk_idx),
                                  interleave=self._interleaved, ws=ws, **mx)
        return (*out[:6], out[8])

    def _fused_weights(self, config, w_gate, w_up, w_down, shared):
        """``(w_gate, w_up, w_down, shared, mx kwargs)`` as the fused forward reads them in
        ``config.precision`` (ValueError unless a fused precision): BF16 as given; MXFP8 quantized
        along their rows as the unfused MXFP8 forward does (cached per version), ``mx`` holding
        ``w_scales`` [and ``shared_scales``]."""
        if config.precision not in self.fused_precisions:
            raise ValueError(f"the sm100 fused forward runs {self.fused_precisions}, not {config.precision!r}")
        mx = {}
        if config.precision == "mxfp8":
            (w_gate, gs), (w_up, us), (w_down, ds) = (self._qw(w, 2) for w in (w_gate, w_up, w_down))
            mx["w_scales"] = (gs, us, ds)
            if shared is not None:  # as shared_forward's [1, R, C] weights: the same rows quantized
                q = [self._qw(w[None], 2) for w in shared]
                shared, mx["shared_scales"] = tuple(d[0] for d, _ in q), tuple(s[0] for _, s in q)
        return w_gate, w_up, w_down, shared, mx

    def _interleaved(self, w_gate, w_up, half: int):
        """GEMM1's interleaved gate / up weights, or their MXFP8 scales
        (``grouped_gemm.interleave_gate_up``), built once while both are unchanged."""
        from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

        return self.weights.get(("interleave", half), (w_gate, w_up), lambda g, u: interleave_gate_up(g, u, half))

    def _qw(self, w, axis):
        """MXFP8 of a weight along ``axis``, quantized once while the weight is unchanged."""
        return self.weights.get(("mxfp8", axis), (w,), lambda t: quantize_weight(t, axis))

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, precision: str = "bf16"):
        """(rows [M, H], ExpertGroup) for expert-grouped x_rows."""
        from mok_cute.kernels.sm100 import grouped_gemm as k

        if precision == "mxfp8":
            return mx_forward(k, x_rows, offsets, w_gate, w_up, w_down, limit, self._qw, self._interleaved)
        if precision != "bf16":
            raise NotImplementedError(f"sm100 expert MLP: precision {precision!r} is not wired")
        gemm1 = functools.partial(k.grouped_gemm1_swiglu, interleave=self._interleaved)
        return mlp_forward(gemm1, k.grouped_gemm, x_rows, offsets, w_gate, w_up, w_down, limit)

    def backward(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit):
        """(dx rows, dWg, dWu, dWd) in the precision of the forward that made ``g``: BF16 or MXFP8
        through the fused backward core (:mod:`mok_cute.kernels.sm100.fused_bwd`, one launch) with
        ``MOK_CUTE_SM100_FUSED=1`` (opt-in until it has run on a Blackwell GPU), else the unfused
        kernels."""
        from mok_cute.kernels.sm100 import grouped_gemm as k

        if self._fused_core(g, dy_rows):
            from mok_cute.kernels.sm100.fused_bwd import fused_backward_core

            *w, mx = self._core_weights(g, w_gate, w_up, w_down)
            return fused_backward_core(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets), *w, limit,
                                       FUSED_BWD_TIMEOUT_S, **mx)

        if g.precision == "mxfp8":
            return mx_backward(k, g, dy_rows, w_gate, w_up, w_down, limit, self._qw)
        return mlp_backward(k.grouped_dswiglu_dgrad, k.grouped_dgrad1, k.grouped_wgrad, g, dy_rows, w_gate, w_up,
                            w_down, limit)


    def backward_tokens(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, order, topk_idx, dx_shared,
                        dx_add=None, consume: bool = False):
        """``(dx [T, H], dWg, dWu, dWd)``: :meth:`backward` with the dx rows summed into their tokens
        in the same launch (``fused_bwd.fused_backward_core(tokens=...)``; ``order`` [M+] grouped
        row -> t*k + j, ``topk_idx`` [T, k], ``dx_shared`` [T, H] or None, ``dx_add`` fp32 [T, H] or
        None: added to its fp32 start), meant bitwise the unfused scatter and slot sum; None where
        that launch does not apply (not BF16 / MXFP8, not opted in, operands not contiguous CUDA:
        then call :meth:`backward`). ``consume`` (the caller gives up dy_rows, g.x, g.gu, g.h): at
        BF16 dgu is written over gu (the core makes no round trips), at MXFP8 the dx rows over
        dy_rows."""
        if not self._fused_core(g, dy_rows):
            return None
        if any(a is not None and not a.is_contiguous() for a in (dx_shared, dx_add)):
            return None
        from mok_cute.kernels.sm100.fused_bwd import fused_backward_core

        *w, mx = self._core_weights(g, w_gate, w_up, w_down)
        return fused_backward_core(dy_rows, g.x, g.gu, g.h, offsets_i32(g.offsets), *w, limit, FUSED_BWD_TIMEOUT_S,
                                   tokens=(order, topk_idx, dx_shared, dx_add), consume=consume, **mx)

    def backward_fused(self, g: ExpertGroup, dy, x, r_rows, order, topk_w, topk_idx, w_gate, w_up, w_down, limit,
                       rows_by_route: bool, shared_group: ExpertGroup | None = None, shared=None, main_grads=None,
                       comm_ctas: int = 28):
        """The whole backward from the layer's tokens in one launch (``fused_bwd.fused_backward``: the
        route_grad pass, the x gather, the routed and the shared expert's GEMMs, the dx scatter and slot
        sum), the contract of the sm90 MLP's ``backward_fused``: ``(dx [T, H], d topk_w [T, k], dWg, dWu,
        dWd, d shared weights or None)``, meant bitwise the unfused backward; with ``main_grads`` (fp32,
        validated by ``ops.moe``; all contiguous, else the caller adds them) the weight gradients are
        added into them in the launch and returned as None. MXFP8: the launch's ``mx`` variant (the
        gathered rows quantized by its comm CTAs), the shared expert's backward before it (its dx the
        slot sum's start, its weight gradients returned; ``main_grads`` then takes the routed three).
        None where it does not apply (not opted in with ``MOK_CUTE_SM100_FUSED=1``, operands not
        contiguous CUDA tensors of the forward's shapes: the layer falls back)."""
        t, k = topk_idx.shape
        rows = t * k
        if rows == 0 or g.precision not in FUSED_CORE_PRECISIONS or g.precision not in self.fused_precisions:
            return None
        if not (_fused_core_ok(ExpertGroup(x, g.offsets, g.gu, g.h), dy) and r_rows.is_contiguous()):
            return None
        if r_rows.shape[0] != rows or g.gu.shape[0] < rows or g.h.shape[0] < rows or order.shape[0] != rows:
            return None
        from mok_cute.kernels.sm100.fused_bwd import fused_backward

        if main_grads is not None and not all(mg.is_contiguous() for mg in main_grads):
            main_grads = None  # the caller adds them
        if g.precision == "mxfp8":
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit)
            *w, mx = self._core_weights(g, w_gate, w_up, w_down)
            out = fused_backward(dy, x, r_rows, order, topk_w.contiguous(), topk_idx, offsets_i32(g.offsets), g.gu,
                                 g.h, *w, limit, None if dxs is None else dxs.contiguous(), rows_by_route, comm_ctas,
                                 FUSED_BWD_TIMEOUT_S, main_grads=None if main_grads is None else main_grads[:3], **mx)
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared, contiguous=True)
        if sh is False:
            return None
        out = fused_backward(dy, x, r_rows, order, topk_w.contiguous(), topk_idx, offsets_i32(g.offsets), g.gu, g.h,
                             w_gate, w_up, w_down, limit, None, rows_by_route, comm_ctas, FUSED_BWD_TIMEOUT_S,
                             shared=sh, main_grads=main_grads)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

    def backward_fused_ep(self, ws, plan, g: ExpertGroup, dy, x, slot_rows, w_rows, topk_idx, w_gate, w_up, w_down,
                          limit, shared_group: ExpertGroup | None = None, shared=None, comm_ctas: int = 16,
                          num_ctas: int | None = None):
        """The whole backward at EP > 1 in one launch per rank (``fused_bwd.fused_backward_ep``; collective
        over ``ws``'s ranks), the contract of the sm90 MLP's ``backward_fused_ep``: ``(dx [T, H], d topk_w
        [T, k], dWg, dWu, dWd, d shared weights or None)``, meant the unfused EP backward's with d topk_w a
        fixed-order fp32 sum (``slot_rows``: this rank's [T, k, H] or [T*k, H] slot rows of the forward);
        MXFP8 as :meth:`backward_fused`'s (the shared expert's backward before the launch). None where it
        does not apply (not opted in with ``MOK_CUTE_SM100_FUSED=1``, operands not contiguous CUDA
        tensors), the same answer on every rank. The caller checks ``ws``'s status."""
        t, k = topk_idx.shape
        if g.precision not in FUSED_CORE_PRECISIONS or g.precision not in self.fused_precisions:
            return None
        if not (_fused_core_ok(ExpertGroup(x, g.offsets, g.gu, g.h), dy) and slot_rows.is_contiguous()):
            return None
        from mok_cute.kernels.sm100.fused_bwd import fused_backward_ep

        if g.precision == "mxfp8":
            dxs, d_shared = shared_backward(self, shared_group, dy, shared, limit)
            *w, mx = self._core_weights(g, w_gate, w_up, w_down)
            out = fused_backward_ep(ws, plan, dy, x, slot_rows.view(t * k, -1), w_rows, topk_idx, g.gu, g.h, *w,
                                    limit, comm_ctas, num_ctas, dx_shared=None if dxs is None else dxs.contiguous(),
                                    **mx)
            return (*out[:5], d_shared)
        sh = shared_launch_operands(shared_group, shared, contiguous=True)
        if sh is False:
            return None
        out = fused_backward_ep(ws, plan, dy, x, slot_rows.view(t * k, -1), w_rows, topk_idx, g.gu, g.h, w_gate,
                                w_up, w_down, limit, comm_ctas, num_ctas, shared=sh)
        return (*out[:5], tuple(out[5:]) if shared is not None else None)

"""Hopper (sm_90a) FP8 blockwise (precision "fp8_block") expert-MLP GEMMs besides plain GEMM2
and wgrad, on the promoted FP8 mainloop of :mod:`mok_cute.kernels.sm90.fp8_gemm`.

Numerics: :mod:`mok_cute.reference` ("FP8 blockwise"): operands quantized as the reference
does (activations / gradients 1x128 along K, weights in 128x128 blocks, one block set for
forward and dgrad), fp32 partial sums over each 128-K block promoted with
``sa[row] * sb[block]``; only the fp32 accumulation order differs from the reference's
exact sum. Rounding points as in bf16 (gu, h, dgu, dx rounded once to bf16).

* :func:`grouped_gemm1_swiglu_fp8_block`: gu = bf16(x_e . [Wg_e; Wu_e]^T), h = SwiGLU(g, u).
  One 128-wide output tile holds 64 gate and the matching 64 up columns (two TMA loads per
  B k-tile, weights read in place); gate elements are promoted with the gate block scale,
  up elements with the up one.
* :func:`grouped_dswiglu_dgrad_fp8_block`: dh = dy_e . Wd_e (fp32, never rounded), then
  dSwiGLU against the bf16 gu -> dgu. FP8 wgmma needs K-major B, so Wd is read through
  its transposed quantization ``wdt`` [E, I, H] (:func:`transpose_weight_blocks`).
* :func:`grouped_dgrad1_fp8_block`: dx = bf16(dgu_e . [Wg_e; Wu_e]) over K = 2I, B =
  ``w1t`` [E, H, 2I] = [Wg; Wu]^T's quantization (gate block columns, then up).

Activation operands: data [M, K] float8_e4m3fn contiguous with fp32 scales [M, K/128] (the
view ``quantize_fp8.quantize_fp8_block_act`` returns: its [K/128, M] storage is read in
place; other strides are copied on the device). offsets int32/int64 [E+1] on the device
(trusted, no host sync). Compiles are cached per (epilogue, clamp, gated, config); M, N, K, E are
symbolic. Outputs are written in every row; results are bitwise reproducible.
"""
from __future__ import annotations

import torch

from mok_cute.dsl.host import _check_devices, _check_limit, _check_out, _check_tensor
from mok_cute.kernels.sm90.fp8_gemm import (
    DEFAULT_FP8_CONFIG, SCALE_BLOCK, Fp8MainloopConfig, Fp8Operand, launch_fp8_block,
)

_FP8 = torch.float8_e4m3fn


def _check_act(name: str, q, s_name: str, s):
    """Activation operand: q [M, K] e4m3 contiguous 16-byte aligned, K a positive multiple of
    128; s fp32 [M, K/128]. Returns (M, K)."""
    _check_tensor(name, q, 2, (_FP8,))
    _check_tensor(s_name, s, 2, (torch.float32,))
    m, k = q.shape
    if k % SCALE_BLOCK or k == 0:
        raise ValueError(f"{name}: K={k} must be a positive multiple of {SCALE_BLOCK}")
    if not q.is_contiguous() or q.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous (row-major) and 16-byte aligned")
    if tuple(s.shape) != (m, k // SCALE_BLOCK):
        raise ValueError(f"{s_name} must be [M, K/128] = {(m, k // SCALE_BLOCK)}, got {tuple(s.shape)}")
    return m, k


def _check_weight(name: str, q, s_name: str, s, shape):
    """Weight operand: q e4m3 contiguous 16-byte aligned of ``shape`` [E, N, K] (N, K positive
    multiples of 128); s fp32 [E, N/128, K/128]."""
    _check_tensor(name, q, 3, (_FP8,))
    _check_tensor(s_name, s, 3, (torch.float32,))
    e, n, k = shape
    if tuple(q.shape) != (e, n, k):
        raise ValueError(f"{name} must have shape {(e, n, k)}, got {tuple(q.shape)}")
    if n % SCALE_BLOCK or n == 0:
        raise ValueError(f"{name}: dim 1 = {n} must be a positive multiple of {SCALE_BLOCK}")
    if not q.is_contiguous() or q.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    want = (e, n // SCALE_BLOCK, k // SCALE_BLOCK)
    if tuple(s.shape) != want:
        raise ValueError(f"{s_name} must be [E, N/128, K/128] = {want}, got {tuple(s.shape)}")


def _experts(offsets) -> int:
    _check_tensor("offsets", offsets, 1, (torch.int32, torch.int64))
    if offsets.numel() < 2:
        raise ValueError(f"offsets must hold E+1 >= 2 entries, got {offsets.numel()}")
    return offsets.numel() - 1


def grouped_gemm1_swiglu_fp8_block(xq, x_scales, offsets, wg_q, wg_s, wu_q, wu_s, limit=None, *, gu=None, h=None,
                                   cfg: Fp8MainloopConfig = DEFAULT_FP8_CONFIG):
    """GEMM1 + SwiGLU, FP8 blockwise: returns (gu [M, 2I], h [M, I]) bf16 with
    gu = bf16(x_e . [Wg_e; Wu_e]^T) (gate in columns [0, I), up in [I, 2I)) and
    h = bf16(silu(g) * u) in fp32 from the bf16 g, u (g = min(g, limit), u = clamp(u, -limit,
    limit) when ``limit`` is given), as ``reference.grouped_gemm1_swiglu(..., "fp8_block")``; ``limit`` may be
    a :class:`~mok_cute.reference.SwiGLU` (h = bf16(g * sigmoid(alpha * g) * (u + up_offset)), clamped as above).

    xq [M, H] e4m3 + x_scales fp32 [M, H/128]; wg_q, wu_q [E, I, H] e4m3 contiguous with
    wg_s, wu_s fp32 [E, I/128, H/128] (``reference.fp8_block_quantize_weight`` per expert);
    I, H multiples of 128. ``gu``, ``h``: optional preallocated contiguous outputs.
    """
    m, hid = _check_act("xq", xq, "x_scales", x_scales)
    e = _experts(offsets)
    _check_tensor("wg_q", wg_q, 3, (_FP8,))
    inter = wg_q.shape[1]
    _check_weight("wg_q", wg_q, "wg_s", wg_s, (e, inter, hid))
    _check_weight("wu_q", wu_q, "wu_s", wu_s, (e, inter, hid))
    _check_limit(limit)
    gu = _check_out("gu", gu, (m, 2 * inter), xq.device)
    h = _check_out("h", h, (m, inter), xq.device)
    _check_devices(xq=xq, x_scales=x_scales, offsets=offsets, wg_q=wg_q, wg_s=wg_s, wu_q=wu_q, wu_s=wu_s, gu=gu, h=h)
    if m:
        launch_fp8_block("swiglu", cfg, Fp8Operand(xq, x_scales), Fp8Operand(wg_q, wg_s), Fp8Operand(wu_q, wu_s),
                         offsets, gu.view(m, 2, inter), h, 2 * inter, limit)
    return gu, h


def grouped_dswiglu_dgrad_fp8_block(dyq, dy_scales, offsets, wdt_q, wdt_s, gu, limit=None, *, out=None,
                                    cfg: Fp8MainloopConfig = DEFAULT_FP8_CONFIG):
    """dgu [M, 2I] bf16 = bf16([dg | du]): dh = dy_e . Wd_e in fp32 (never rounded), dSwiGLU at
    the bf16 g = gu[:, :I], u = gu[:, I:] (``limit``: None, L or a SwiGLU, as in the forward), as
    ``reference.grouped_dswiglu_dgrad(..., "fp8_block")``.

    dyq [M, H] e4m3 + dy_scales fp32 [M, H/128]; wdt_q [E, I, H] e4m3 contiguous = the
    transposed data of Wd's per-expert 128x128 quantization, wdt_s [E, I/128, H/128] its
    transposed scale grid (:func:`transpose_weight_blocks`); gu [M, 2I] bf16 contiguous;
    ``out``: optional preallocated dgu.
    """
    m, hid = _check_act("dyq", dyq, "dy_scales", dy_scales)
    e = _experts(offsets)
    _check_tensor("wdt_q", wdt_q, 3, (_FP8,))
    inter = wdt_q.shape[1]
    _check_weight("wdt_q", wdt_q, "wdt_s", wdt_s, (e, inter, hid))
    _check_tensor("gu", gu, 2, (torch.bfloat16,))
    if tuple(gu.shape) != (m, 2 * inter) or not gu.is_contiguous() or gu.data_ptr() % 16:
        raise ValueError(f"gu must be contiguous, 16-byte aligned, with shape {(m, 2 * inter)}, got "
                         f"{tuple(gu.shape)}")
    _check_limit(limit)
    out = _check_out("out", out, (m, 2 * inter), dyq.device)
    _check_devices(dyq=dyq, dy_scales=dy_scales, offsets=offsets, wdt_q=wdt_q, wdt_s=wdt_s, gu=gu, out=out)
    if m:
        launch_fp8_block("dswiglu", cfg, Fp8Operand(dyq, dy_scales), Fp8Operand(wdt_q, wdt_s), None, offsets,
                         out.view(m, 2, inter), gu.view(m, 2, inter), inter, limit)
    return out


def grouped_dgrad1_fp8_block(dguq, dgu_scales, offsets, w1t_q, w1t_s, *, out=None,
                             cfg: Fp8MainloopConfig = DEFAULT_FP8_CONFIG):
    """dx [M, H] bf16 = bf16(dgu_e . [Wg_e; Wu_e]) (one fp32 sum over K = 2I), as
    ``reference.grouped_dgrad1(..., "fp8_block")``.

    dguq [M, 2I] e4m3 + dgu_scales fp32 [M, 2I/128]; w1t_q [E, H, 2I] e4m3 contiguous = the
    transposed data of [Wg_e; Wu_e]'s 128x128 quantization (gate block columns, then up),
    w1t_s [E, H/128, 2I/128] (:func:`transpose_weight_blocks`); ``out``: optional [M, H].
    """
    m, two_i = _check_act("dguq", dguq, "dgu_scales", dgu_scales)
    e = _experts(offsets)
    _check_tensor("w1t_q", w1t_q, 3, (_FP8,))
    hid = w1t_q.shape[1]
    _check_weight("w1t_q", w1t_q, "w1t_s", w1t_s, (e, hid, two_i))
    if hid % cfg.tile_n:
        raise ValueError(f"w1t_q: H={hid} must be a multiple of tile_n={cfg.tile_n}")
    out = _check_out("out", out, (m, hid), dguq.device)
    _check_devices(dguq=dguq, dgu_scales=dgu_scales, offsets=offsets, w1t_q=w1t_q, w1t_s=w1t_s, out=out)
    if m:
        launch_fp8_block("plain", cfg, Fp8Operand(dguq, dgu_scales), Fp8Operand(w1t_q, w1t_s), None, offsets, out,
                         out, hid)
    return out


def transpose_weight_blocks(*pairs):
    """Dgrad weights from per-expert 128x128 quantizations, on the device (no host sync), by
    torch transposes: the layout definition the device checks and tests build their operands
    with (the backend gets the same tensors from ``quantize_fp8.quantize_fp8_block_weights_t``
    in the quantizing pass).

    ``pairs``: one or more ``(data [E, N_j, K] float8_e4m3fn, scales [E, N_j/128, K/128]
    fp32)``; they are stacked along N (in order) and transposed: returns (data_t [E, K, N]
    contiguous, scales_t [E, K/128, N/128] contiguous), N = sum N_j. The blocks of W^T are
    the blocks of W, so no value changes:
        wdt_q, wdt_s = transpose_weight_blocks((wd_q, wd_s))              # [E, I, H]
        w1t_q, w1t_s = transpose_weight_blocks((wg_q, wg_s), (wu_q, wu_s))  # [E, H, 2I]
    """
    if not pairs:
        raise ValueError("transpose_weight_blocks needs at least one (data, scales) pair")
    for j, (q, s) in enumerate(pairs):
        _check_tensor(f"pairs[{j}] data", q, 3, (_FP8,))
        _check_tensor(f"pairs[{j}] scales", s, 3, (torch.float32,))
        e0, k0 = pairs[0][0].shape[0], pairs[0][0].shape[2]
        e, n, k = q.shape
        if (e, k) != (e0, k0) or n % SCALE_BLOCK or k % SCALE_BLOCK:
            raise ValueError(f"pairs[{j}] data must be [E={e0}, N, K={k0}] with N, K multiples of {SCALE_BLOCK}, "
                             f"got {tuple(q.shape)}")
        if tuple(s.shape) != (e, n // SCALE_BLOCK, k // SCALE_BLOCK):
            raise ValueError(f"pairs[{j}] scales must be {(e, n // SCALE_BLOCK, k // SCALE_BLOCK)}, "
                             f"got {tuple(s.shape)}")
    data = torch.cat([q.view(torch.uint8) for q, _ in pairs], dim=1)
    scales = torch.cat([s for _, s in pairs], dim=1)
    return (data.transpose(1, 2).contiguous().view(_FP8), scales.transpose(1, 2).contiguous())

"""Pure-torch reference MoE layer: the executable specification every kernel must meet.

Runs on CPU and GPU, is bitwise deterministic, and imports no kernel.

Layer (per rank; EP = world size of ``group``, a torch.distributed group or a virtual group of
:mod:`mok_cute.comm.virtual`; rank p owns experts [p*E/EP, (p+1)*E/EP)):
    x [T, H] bf16, topk_idx [T, k] int (global expert id, -1 = no expert), topk_w [T, k] fp32,
    w_gate/w_up [E_local, I, H] bf16, w_down [E_local, H, I] bf16,
    optional shared expert ws_gate/ws_up [I_s, H], ws_down [H, I_s] (every token), optionally
    with an output gate w_sg [1, H] bf16 (Qwen-style; :func:`shared_gate`), optional routed
    expert biases b_gate/b_up [E_local, I], b_down [E_local, H] bf16 (gpt-oss), and the experts'
    activation, a :class:`SwiGLU` (clamp limit L, alpha, up offset).

Numerics (precision "bf16"; "where rounding happens" is the contract):
    * Every GEMM multiplies its operands exactly and sums in fp64, then rounds to fp32
      (an order-free stand-in for fp32 accumulation; kernels accumulate in fp32 and are
      compared with tolerances).
    * GEMM1: g = bf16(x.Wg^T), u = bf16(x.Wu^T) (these bf16 values are what backward reads).
      With expert biases (routed experts only) b_gate, b_up [E_local, I] bf16: the bias is added
      to the GEMM's fp32 result (a kernel: to its fp32 accumulator, in the epilogue) before the
      one rounding to bf16: g = bf16(fp32(x.Wg^T) + fp32(b_gate[e])), u = bf16(fp32(x.Wu^T) +
      fp32(b_up[e])) (one fp32 add; biases are never quantized, at any precision).
    * SwiGLU (:class:`SwiGLU`: limit L, alpha a, up offset o; defaults None, 1, 0; every expert,
      the shared one included) in fp32 from the bf16 g, u: gc = min(g, L), uc = clamp(u, -L, L)
      (no clamp without L); h = bf16(act(gc) * (uc + o)) with act(gc) = gc * sigmoid(a * gc),
      fp32 ops in this order: a * gc, sigmoid, gc * that (at a = 1: silu(gc), torch's silu),
      uc + o (skipped at o = 0), then the product. The defaults are silu(g) * u; gpt-oss is
      L = 7, a = 1.702, o = 1. a and o are used as fp32 values (no gradient: constants).
    * GEMM2: r = bf16(h.Wd^T), one row per routed (token, slot). With expert biases,
      b_down [E_local, H] bf16: r = bf16(fp32(h.Wd^T) + fp32(b_down[e])), the bias inside r,
      so the combine scales it by the routing weight (gpt-oss: (h.Wd^T + b_down) * w).
    * Combine: acc = fp32(shared(x)[t]) (or 0); for j = 0..k-1 with topk_idx[t, j] >= 0:
      acc = acc + topk_w[t, j] * fp32(r_j) (an fp32 multiply, then an fp32 add);
      y = bf16(acc). Slots with -1 are skipped (not added as zeros).
    * Shared-expert output gate w_sg: z = fp32(x.w_sg^T) (the GEMM rule), g = bf16(sigmoid(z))
      [T, 1]; the combine starts from acc = fp32(s) * fp32(g) (one fp32 multiply) instead of
      fp32(s). w_sg = 0 gives g = 0.5 (a gate, not "no gate").
    Backward (dy [T, H] bf16):
    * Routed dy row of slot j: dyj = bf16(fp32(dy) * topk_w[t, j]); the shared expert's is dy
      (with the gate: bf16(fp32(dy) * fp32(g))).
    * Gate: dg = fp32(sum_h bf16(fp32(dy) * fp32(s)))  (each product rounded to bf16 before the
      fp64 sum), dz = sigmoid_backward(dg, fp32(g)) = dg * (1 - g) * g in fp32, the gate's share
      of dx is the fp32 product dz * fp32(w_sg), and d w_sg = fp32(dz^T . x) [1, H] (fp32, the
      GEMM rule).
    * d topk_w[t, j] = fp32(sum_h dy[t, h] * r_j[t, h]) (fp64 sum), 0 for -1 slots.
    * dh = dyj.Wd in fp32 (never rounded); dSwiGLU with gc, uc the clamped g, u, s = sigmoid(a * gc):
      dg = dh * (uc + o) * s * (1 + a * gc * (1 - s)) * [g <= L],  du = dh * (gc * s) * [-L <= u <= L]
      (fp32, in this order; uc + o is uc at o = 0); dgu = bf16([dg, du]).
    * dx_j = bf16(dgu.[Wg; Wu]) (one sum over 2I); dx = bf16(fp32(dx_shared) [+ gate's share]
      + sum_j fp32(dx_j)) in slot order, -1 slots skipped.
    * dWd = bf16(dyj^T.h), dWg = bf16(dg^T.x), dWu = bf16(du^T.x) per expert over its tokens.
    * Expert biases, per expert over its rows (bf16, the biases' dtype): d b_down = bf16(sum dyj),
      d b_gate = bf16(sum dg), d b_up = bf16(sum du), summing the bf16 rows dyj and dgu = [dg, du]
      with the GEMM rule (a wgrad against a column of ones: fp64 sum of the rows in token order,
      rounded to fp32, then to bf16); at every precision the rows are summed unquantized. An
      expert with no rows gets 0.
    Token order inside an expert: by source rank, then token index, then slot.

MXFP8 (precision "mxfp8"): E4M3 elements, one E8M0 scale per 32 elements along the GEMM's
reduction dim (see :func:`mxfp8_quantize`). Every GEMM operand above is quantized, then the
GEMM runs on the dequantized (exact) values; rounding points stay as in bf16. Axes:
    forward  GEMM1  x        along H (rows)      Wg, Wu   along H (rows of [I, H])
    forward  GEMM2  h        along I (rows)      Wd       along I (rows of [H, I])
    dgrad    GEMM2  dyj      along H (rows)      Wd       along H (columns of [H, I])
    dgrad    GEMM1  dgu      along I (rows)      Wg, Wu   along I (columns of [I, H])
    wgrad    GEMM2  dyj, h   along tokens (columns), blocks of 32 from each expert's first row
    wgrad    GEMM1  dgu, x   along tokens (columns), same blocking
A partial last token block is zero-padded. The shared expert is one more group (all T tokens).

FP8 blockwise (precision "fp8_block", the DeepSeek-V3 recipe; see :func:`fp8_block_quantize_act`):
E4M3 elements with fp32 scales, activations/gradients in 1x128 tiles along the GEMM's
reduction dim, weights in 128x128 blocks (one block set serves forward and dgrad: the
blocks of W^T are the blocks of W). Every GEMM operand is quantized, then the GEMM runs on
the dequantized values data * scale (exact in fp64); rounding points stay as in bf16. A
kernel applies the scales per 128-K block to fp32 partial sums (promotion). Axes:
    forward  GEMM1  x        1x128 along H       Wg, Wu   128x128 blocks of [I, H]
    forward  GEMM2  h        1x128 along I       Wd       128x128 blocks of [H, I]
    dgrad    GEMM2  dyj      1x128 along H       Wd       same blocks (read as [I, H] = Wd^T)
    dgrad    GEMM1  dgu      1x128 along 2I      Wg, Wu   same blocks (read as [H, 2I])
    wgrad    GEMM2  dyj, h   128x1 along tokens (columns), tiles of 128 from each expert's first row
    wgrad    GEMM1  dgu, x   128x1 along tokens (columns), same tiling
H, I (and I_s) must be multiples of 128; a partial last token tile is zero-padded.

Precision "exact" (float64 inputs, no rounding, no quantization) is the same math for
gradient checks against torch.autograd.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

PRECISIONS = ("bf16", "mxfp8", "fp8_block")
MX_BLOCK = 32
FP8_MAX = 448.0


# ----------------------------------------------------------------------------- MXFP8
def _pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in [-127, 127], built from the bit pattern."""
    k = k.to(torch.int32)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 0x00400000))
    return bits.view(torch.float32)


def _blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """View a 2-D ``x`` as [..., 32] blocks along ``dim`` (the block axis moved last)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    dim = dim % 2
    if x.shape[dim] % MX_BLOCK:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be a multiple of {MX_BLOCK}")
    xt = x if dim == 1 else x.t()
    return xt.reshape(xt.shape[0], xt.shape[1] // MX_BLOCK, MX_BLOCK)


def mxfp8_quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D bf16/fp32 tensor to MXFP8 along ``dim``.

    Returns ``(data, scales)``: data float8_e4m3fn with x's shape; scales uint8 E8M0 (bias
    127) with x's shape except size(dim) / 32. Per block of 32: amax = max |x|;
    exponent e = ceil(log2(amax / 448)) clamped below at -127 (computed exactly from amax's
    bits: byte = max(E - 8 + [mantissa > 0x600000], 0)); data = e4m3(x * 2^-e), round to
    nearest even (never saturates). A block holding NaN or Inf gets scale 0xFF and NaN data.
    """
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    xb = _blocks(x.float(), dim)
    bits = xb.view(torch.int32) & 0x7FFFFFFF
    amax_bits = bits.amax(dim=-1)
    nonfinite = amax_bits >= 0x7F800000
    biased = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    byte = (biased - 8 + (mant > 0x600000).to(torch.int32)).clamp(min=0)
    scaled = xb * _pow2_f32(127 - byte)[..., None]
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(nonfinite[..., None], torch.full_like(data, 0x7F), data)
    byte = torch.where(nonfinite, torch.full_like(byte, 0xFF), byte).to(torch.uint8)
    data = data.reshape(xb.shape[0], -1).view(torch.float8_e4m3fn)
    if dim % 2 == 0:
        return data.t().contiguous(), byte.t().contiguous()
    return data.contiguous(), byte.contiguous()


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize`: fp32 values data * 2^(scale - 127) (NaN for 0xFF)."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn, got {data.dtype}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales must be uint8, got {scales.dtype}")
    vals = _blocks(data.float(), dim)
    byte = (scales if dim % 2 == 1 else scales.t()).to(torch.int32)
    nan = torch.full(byte.shape, float("nan"), device=byte.device)
    mult = torch.where(byte == 0xFF, nan, _pow2_f32(byte.clamp(max=254) - 127))
    out = (vals * mult[..., None]).reshape(vals.shape[0], -1)
    return out.t().contiguous() if dim % 2 == 0 else out


def mx_round_trip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The fp32 values a GEMM sees after MXFP8 quantization of ``x`` along ``dim``."""
    return mxfp8_dequantize(*mxfp8_quantize(x, dim), dim=dim)


def _mx_round_trip_groups(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """MXFP8 round trip along dim 0 in blocks of 32 rows starting at each group's start."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        n = hi - lo
        if n == 0:
            continue
        pad = (-n) % MX_BLOCK
        xp = F.pad(x[lo:hi].float(), (0, 0, 0, pad))
        out[lo:hi] = mx_round_trip(xp, 0)[:n]
    return out


# ----------------------------------------------------------------------------- FP8 blockwise
FP8_BLOCK = 128
FP8_AMAX_MIN = 2.0 ** -100  # amax floor: keeps 448 / amax finite (see fp8_block_quantize_act)


def _tiles_1x128(x: torch.Tensor, name: str) -> torch.Tensor:
    """View a 2-D ``x`` as fp32 [M, K/128, 128] tiles along its last dim."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be a bfloat16 or float32 tensor")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if x.shape[1] % FP8_BLOCK:
        raise ValueError(f"{name}.shape[1] = {x.shape[1]} must be a multiple of {FP8_BLOCK}")
    return x.float().reshape(x.shape[0], x.shape[1] // FP8_BLOCK, FP8_BLOCK)


_AMAX_MIN_BITS = 0x0D800000  # fp32 bit pattern of FP8_AMAX_MIN = 2^-100
_ONE_BITS = 0x3F800000  # 1.0f


def _div_rn_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 a / b, round to nearest even (``div.rn.f32``), identical on every device.

    Computed as one float64 division of the (exactly widened) fp32 operands, rounded once
    to fp32: the float64 quotient carries 53 >= 2 * 24 + 2 bits, so this double rounding
    is innocuous and gives the correctly rounded fp32 quotient (finite nonzero operands; here
    a, b in [2^-100, 2^128), quotients in the fp32 normal range). The divisor must be a
    tensor: torch's CUDA ``tensor / python_scalar`` is evaluated as ``tensor * (1 / scalar)``
    (not a correctly rounded division; that was the reference's CPU/CUDA scale mismatch).
    """
    return torch.div(a.double(), b.double()).float()


def _fp8_block_tiles(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 tiles [..., n] (one scale per tile): returns (e4m3 [..., n], fp32 [...])."""
    bits = t.view(torch.int32) & 0x7FFFFFFF
    amax_bits = bits.amax(dim=-1)  # integer max: exact, order-independent
    nonfinite = amax_bits >= 0x7F800000
    # a = max(amax, 2^-100) on the bit patterns (no float op: no FTZ / NaN semantics involved)
    a_bits = torch.clamp(amax_bits, min=_AMAX_MIN_BITS)
    a_bits = torch.where(nonfinite, torch.full_like(a_bits, _ONE_BITS), a_bits)
    amax = a_bits.view(torch.float32)
    inv = _div_rn_f32(torch.full_like(amax, FP8_MAX), amax)  # fp32 448 / a, correctly rounded
    scale = _div_rn_f32(amax, torch.full_like(amax, FP8_MAX))  # fp32 a / 448, correctly rounded
    data = (t * inv[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(nonfinite[..., None], torch.full_like(data, 0x7F), data)
    scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    return data.view(torch.float8_e4m3fn), scale


def fp8_block_quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 blockwise quantization of an activation / gradient along its last dim (K).

    x [M, K] bf16/fp32, K a multiple of 128. Per 1x128 tile, all in fp32 with IEEE
    round-to-nearest-even:
        amax  = max |x| (taken on the bit patterns: subnormals kept, NaN/Inf detected)
        a     = max(amax, 2^-100)          (all-zero tiles: data 0, keeps 448 / a finite)
        inv   = 448 / a                    (one fp32 division, div.rn.f32 on the GPU)
        scale = a / 448                    (one fp32 division)
    Bitwise identical on CPU and CUDA: amax and the floor are integer ops on the bits, each
    division is the correctly rounded fp32 quotient (:func:`_div_rn_f32`: float64 division
    rounded once; never torch's CUDA ``tensor / scalar``, which multiplies by 1 / scalar),
    and x * inv is one IEEE fp32 multiply.
        data  = e4m3(x * inv)              (fp32 multiply, then RNE to e4m3; |x * inv| <=
                                            448 (1 + 2^-24) rounds to <= 448: never saturates)
    The two divisions are DeepSeek-V3's (DeepGEMM ``x * (448 / amax)``, scale ``amax / 448``)
    without its 1e-4 amax floor (gradients are often smaller). A tile holding NaN or Inf
    gets scale NaN (bits 0x7FC00000) and data 0x7F (NaN); -0.0 stays 0x80. Dequantized value:
    data * scale.
    Returns (data float8_e4m3fn [M, K], scales float32 [M, K/128]).
    """
    data, scale = _fp8_block_tiles(_tiles_1x128(x, "x"))
    return data.reshape(x.shape).contiguous(), scale.contiguous()


def fp8_block_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 blockwise quantization of a weight [N, K] in 128x128 blocks (same fp32 ops as
    :func:`fp8_block_quantize_act`, amax over the 16384 elements of a block).
    Returns (data float8_e4m3fn [N, K], scales float32 [N/128, K/128])."""
    t = _tiles_1x128(w, "w")  # [N, K/128, 128]
    n, kb = t.shape[0], t.shape[1]
    if n % FP8_BLOCK:
        raise ValueError(f"w.shape[0] = {n} must be a multiple of {FP8_BLOCK}")
    blocks = t.reshape(n // FP8_BLOCK, FP8_BLOCK, kb, FP8_BLOCK).permute(0, 2, 1, 3)
    data, scale = _fp8_block_tiles(blocks.reshape(n // FP8_BLOCK, kb, FP8_BLOCK * FP8_BLOCK))
    data = data.reshape(n // FP8_BLOCK, kb, FP8_BLOCK, FP8_BLOCK).permute(0, 2, 1, 3)
    return data.reshape(w.shape).contiguous(), scale.contiguous()


def fp8_block_dequantize_act(data: torch.Tensor, scales: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [M, K] * scales [M, K/128] (broadcast over each 1x128 tile) in ``dtype``;
    exact in float64, one rounding per element in float32."""
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError("data must be float8_e4m3fn and scales float32")
    m, k = data.shape
    if tuple(scales.shape) != (m, k // FP8_BLOCK) or k % FP8_BLOCK:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match data {tuple(data.shape)}")
    vals = data.to(dtype).reshape(m, k // FP8_BLOCK, FP8_BLOCK)
    return (vals * scales.to(dtype)[..., None]).reshape(m, k)


def fp8_block_dequantize_weight(data: torch.Tensor, scales: torch.Tensor,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [N, K] * scales [N/128, K/128] (broadcast over each 128x128 block) in ``dtype``."""
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError("data must be float8_e4m3fn and scales float32")
    n, k = data.shape
    if n % FP8_BLOCK or k % FP8_BLOCK or tuple(scales.shape) != (n // FP8_BLOCK, k // FP8_BLOCK):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match data {tuple(data.shape)}")
    full = scales.to(dtype).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return data.to(dtype) * full


def token_tile_bases(offsets, rows: int, block: int = FP8_BLOCK) -> list[int]:
    """Token-wise (wgrad) layouts give group e the tile slots starting at
    ``offsets[e] // block + e``, never below the previous group's end (so a kernel needs
    no prefix sum); the last entry is the slot count ``rows // block + E``."""
    offs = _offs(offsets)
    return [o // block + e for e, o in enumerate(offs[:-1])] + [rows // block + len(offs) - 1]


def _quantize_tokens(x, offsets, block: int, quantize, scale_dtype):
    """Shared body of the token-wise quantizers (see :func:`fp8_block_quantize_tokens`)."""
    offs = _offs(offsets)
    m, n = x.shape
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if offs[0] != 0 or offs[-1] > m or any(b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"offsets must start at 0, not decrease and end <= {m}, got {offs}")
    base = token_tile_bases(offs, m, block)
    data_t = torch.zeros(n, base[-1] * block, dtype=torch.uint8, device=x.device)
    scales = torch.zeros(base[-1], n, dtype=scale_dtype, device=x.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi == lo:
            continue
        pad = (-(hi - lo)) % block
        d, sc = quantize(F.pad(x[lo:hi].float(), (0, 0, 0, pad)))  # [padded, N], [tiles, N]
        c0 = base[e] * block
        data_t[:, c0: c0 + d.shape[0]] = d.view(torch.uint8).t()
        scales[base[e]: base[e] + sc.shape[0]] = sc
    return data_t.view(torch.float8_e4m3fn), scales


def fp8_block_quantize_tokens(x: torch.Tensor, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """Wgrad operand: quantize x [M, N] along tokens (dim 0) in 128x1 tiles starting at each
    group's first row, written transposed and tile-aligned for a K-major FP8 GEMM operand.

    Group e's tiles occupy slots ``j = offsets[e] // 128 + e + t`` (:func:`token_tile_bases`),
    S = M // 128 + E slots in all. Returns (data_t float8_e4m3fn [N, 128 S]: column
    128 j + r of feature n holds token offsets[e] + 128 t + r (quantized with the fp32 ops
    of :func:`fp8_block_quantize_act`); scales float32 [S, N]). Rows past a group's end
    (zero padding: amax unchanged) and slots no group uses are 0 in both; rows at or past
    offsets[E] belong to no group. The wgrad GEMM of group e runs whole 128-token k-tiles
    over its slots: padding contributes exact zeros.
    """
    def quantize(xp):
        d, sc = fp8_block_quantize_act(xp.t().contiguous())
        return d.t(), sc.t()
    return _quantize_tokens(x, offsets, FP8_BLOCK, quantize, torch.float32)


def mxfp8_quantize_tokens(x: torch.Tensor, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 wgrad operand: :func:`mxfp8_quantize` along tokens in blocks of 32 from each
    group's first row, in the transposed tile-aligned layout of
    :func:`fp8_block_quantize_tokens` with 32-token slots: (data_t float8_e4m3fn
    [N, 32 S], scales uint8 E8M0 [S, N]), S = M // 32 + E; unused slots 0."""
    return _quantize_tokens(x, offsets, MX_BLOCK, lambda xp: mxfp8_quantize(xp, 0), torch.uint8)


def _fp8_round_trip_groups(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 values of x after 128x1 token-wise quantization per group (wgrad operands)."""
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi == lo:
            continue
        pad = (-(hi - lo)) % FP8_BLOCK
        xt = F.pad(x[lo:hi].float(), (0, 0, 0, pad)).t().contiguous()
        d, s = fp8_block_quantize_act(xt)
        out[lo:hi] = fp8_block_dequantize_act(d, s, torch.float64).t()[: hi - lo]
    return out


def fp8_round_trip_act(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """float64 values a GEMM sees after 1x128 quantization of ``x`` along ``dim``."""
    if dim % 2 == 0:
        return fp8_round_trip_act(x.t().contiguous(), -1).t()
    return fp8_block_dequantize_act(*fp8_block_quantize_act(x), dtype=torch.float64)


def fp8_round_trip_weight(w: torch.Tensor) -> torch.Tensor:
    """float64 values a GEMM sees after 128x128 block quantization of ``w`` (either orientation)."""
    return fp8_block_dequantize_weight(*fp8_block_quantize_weight(w), dtype=torch.float64)


# ----------------------------------------------------------------------------- numerics
@dataclass(frozen=True)
class Numerics:
    """Rounding policy: ``precision`` in bf16 | mxfp8 | fp8_block | exact (float64, nothing rounded)."""

    precision: str = "bf16"

    @property
    def exact(self) -> bool:
        return self.precision == "exact"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Round an activation / GEMM output to its storage type (bf16)."""
        return x if self.exact else x.to(torch.bfloat16)

    def f32(self, x: torch.Tensor) -> torch.Tensor:
        """Upcast for fp32 math (float64 in exact mode)."""
        return x.double() if self.exact else x.float()

    def q(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Activation operand as the GEMM reads it (MXFP8 round trip along ``dim`` when
        mxfp8, 1x128 FP8 blockwise along ``dim`` when fp8_block)."""
        if self.precision == "fp8_block":
            return fp8_round_trip_act(x, dim)
        return mx_round_trip(x, dim) if self.precision == "mxfp8" else x

    def q_weight(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """Weight operand as the GEMM reads it: 128x128 blocks when fp8_block (``dim`` does not
        matter), else as :meth:`q`."""
        return fp8_round_trip_weight(w) if self.precision == "fp8_block" else self.q(w, dim)

    def q_tokens(self, x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
        """Wgrad operand quantized along tokens, per group."""
        if self.precision == "fp8_block":
            return _fp8_round_trip_groups(x, offsets)
        return _mx_round_trip_groups(x, offsets) if self.precision == "mxfp8" else x

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [M, K] . b[N, K]^T with an fp64 sum, rounded to fp32 (fp64 in exact mode)."""
        out = a.double() @ b.double().t()
        return out if self.exact else out.float()


def _num(precision: str) -> Numerics:
    if precision not in PRECISIONS + ("exact",):
        raise ValueError(f"precision must be one of {PRECISIONS + ('exact',)}, got {precision!r}")
    return Numerics(precision)


# ----------------------------------------------------------------------------- SwiGLU
def _real(name: str, v, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite float, got {v}")
    return float(v)


@dataclass(frozen=True)
class SwiGLU:
    """The experts' gated activation (the module doc's numerics): with gc = min(g, L) and
    uc = clamp(u, -L, L) (no clamp when ``limit`` is None),
    ``h = gc * sigmoid(alpha * gc) * (uc + up_offset)``. The defaults are silu(g) * u;
    ``SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)`` is gpt-oss's (:meth:`gpt_oss`).

    limit: None or L > 0 (what ``swiglu_limit=L`` alone gives); alpha: the sigmoid's slope, > 0;
    up_offset: added to the clamped up before the product (gpt-oss: 1). Validated on
    construction (TypeError / ValueError naming the field)."""

    limit: float | None = None
    alpha: float = 1.0
    up_offset: float = 0.0

    def __post_init__(self):
        if self.limit is not None:
            object.__setattr__(self, "limit", _real("SwiGLU.limit", self.limit, positive=True))
        object.__setattr__(self, "alpha", _real("SwiGLU.alpha", self.alpha, positive=True))
        object.__setattr__(self, "up_offset", _real("SwiGLU.up_offset", self.up_offset, positive=False))

    @classmethod
    def gpt_oss(cls, limit: float = 7.0, alpha: float = 1.702) -> SwiGLU:
        """gpt-oss's activation: ``(clamp(u, -L, L) + 1) * gc * sigmoid(alpha * gc)``."""
        return cls(limit, alpha, 1.0)

    @property
    def plain(self) -> bool:
        """Whether this is silu(min(g, L)) * clamp(u, -L, L) (alpha 1, up offset 0): what a bare
        ``swiglu_limit`` gives."""
        return self.alpha == 1.0 and self.up_offset == 0.0


def swiglu_of(limit) -> SwiGLU:
    """The :class:`SwiGLU` of an activation argument: None (silu(g) * u), a limit L, or a SwiGLU."""
    return limit if isinstance(limit, SwiGLU) else SwiGLU(limit)


def _consts(act: SwiGLU, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha and up_offset as 0-dim tensors of ``like``'s dtype (fp32 values in fp32 math)."""
    return (torch.tensor(act.alpha, dtype=like.dtype, device=like.device),
            torch.tensor(act.up_offset, dtype=like.dtype, device=like.device))


def swiglu(g: torch.Tensor, u: torch.Tensor, limit) -> torch.Tensor:
    """act(min(g, L)) * (clamp(u, -L, L) + o) in the inputs' dtype (fp32 or fp64), act(gc) =
    gc * sigmoid(a * gc) (silu at a = 1); ``limit``: None, L, or a :class:`SwiGLU` (L, a, o)."""
    act = swiglu_of(limit)
    if act.limit is not None:
        g = g.clamp(max=act.limit)
        u = u.clamp(-act.limit, act.limit)
    if act.plain:
        return F.silu(g) * u
    alpha, offset = _consts(act, g)
    a = F.silu(g) if act.alpha == 1.0 else g * torch.sigmoid(alpha * g)
    return a * (u if act.up_offset == 0.0 else u + offset)


def dswiglu(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, limit):
    """(dg, du) of :func:`swiglu` at (g, u) for upstream dh; clamped inputs get zero grad."""
    act = swiglu_of(limit)
    lim = act.limit
    gc, uc = g, u
    if lim is not None:
        gc, uc = g.clamp(max=lim), u.clamp(-lim, lim)
    if act.plain:
        s = torch.sigmoid(gc)
        dg = dh * uc * s * (1 + gc * (1 - s))
    else:
        alpha, offset = _consts(act, gc)
        s = torch.sigmoid(alpha * gc)
        up = uc if act.up_offset == 0.0 else uc + offset
        dg = dh * up * s * (1 + alpha * gc * (1 - s))
    du = dh * (gc * s)
    if lim is not None:
        dg = torch.where(g <= lim, dg, torch.zeros_like(dg))
        du = torch.where((u >= -lim) & (u <= lim), du, torch.zeros_like(du))
    return dg, du


# ----------------------------------------------------------------------------- grouped expert math
def _offs(offsets) -> list[int]:
    return [int(v) for v in (offsets.tolist() if torch.is_tensor(offsets) else offsets)]


def grouped_gemm(a, offsets, w, precision: str = "bf16", bias=None) -> torch.Tensor:
    """out[rows of e] = round(a_e . w[e]^T [+ bias[e]]); a [M, K], w [E, N, K], bias None or
    [E, N] (added to the GEMM's fp32 result, unquantized, before the rounding) -> [M, N]."""
    num, offs = _num(precision), _offs(offsets)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi > lo:
            acc = num.mm(num.q(a[lo:hi], -1), num.q_weight(w[e], -1))
            out[lo:hi] = num.act(acc if bias is None else acc + num.f32(bias[e]))
    return out


def grouped_row_sums(a, offsets, precision: str = "bf16") -> torch.Tensor:
    """d bias[e] = round(sum of expert e's rows of ``a``) [E, N]: the GEMM rule's fp64 sum in row
    order, rounded to fp32 then to ``a``'s storage type (bf16; nothing rounded in exact mode);
    never quantized; 0 for an expert with no rows."""
    num, offs = _num(precision), _offs(offsets)
    out = torch.zeros(len(offs) - 1, a.shape[1], dtype=a.dtype, device=a.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi > lo:
            s = a[lo:hi].double().sum(0)
            out[e] = num.act(s if num.exact else s.float())
    return out


def grouped_gemm1_swiglu(x, offsets, w_gate, w_up, limit=None, precision: str = "bf16", bias=None):
    """GEMM1 + SwiGLU: returns (gu [M, 2I] = [g | u] rounded, h [M, I] rounded). ``limit``: None,
    L or a :class:`SwiGLU`; ``bias``: None or (b_gate, b_up) [E, I] each."""
    num = _num(precision)
    w1 = torch.cat([w_gate, w_up], dim=1)  # [E, 2I, H]
    gu = grouped_gemm(x, offsets, w1, precision, None if bias is None else torch.cat(bias, dim=1))
    inter = w_gate.shape[1]
    h = num.act(swiglu(num.f32(gu[:, :inter]), num.f32(gu[:, inter:]), limit))
    return gu, h


def grouped_dswiglu_dgrad(dy, offsets, w_down, gu, limit=None, precision: str = "bf16"):
    """dh = dy_e . Wd_e (fp32, unrounded), then dSwiGLU -> dgu [M, 2I] rounded."""
    num, offs = _num(precision), _offs(offsets)
    inter = w_down.shape[2]
    dh = torch.zeros(dy.shape[0], inter, dtype=torch.float64 if num.exact else torch.float32,
                     device=dy.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi > lo:
            dh[lo:hi] = num.mm(num.q(dy[lo:hi], -1), num.q_weight(w_down[e], 0).t())
    dg, du = dswiglu(dh, num.f32(gu[:, :inter]), num.f32(gu[:, inter:]), limit)
    return num.act(torch.cat([dg, du], dim=1))


def grouped_dgrad1(dgu, offsets, w_gate, w_up, precision: str = "bf16"):
    """dx rows = round(dgu_e . [Wg_e; Wu_e]) (one sum over 2I) -> [M, H]."""
    w1t = torch.cat([w_gate, w_up], dim=1)  # [E, 2I, H]
    num, offs = _num(precision), _offs(offsets)
    out = torch.zeros(dgu.shape[0], w1t.shape[2], dtype=dgu.dtype, device=dgu.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi > lo:
            out[lo:hi] = num.act(num.mm(num.q(dgu[lo:hi], -1), num.q_weight(w1t[e], 0).t()))
    return out


def grouped_wgrad(a, b, offsets, precision: str = "bf16"):
    """dW[e] = round(a_e^T . b_e) over expert e's rows (tokens): a [M, Na], b [M, Nb] -> [E, Na, Nb]."""
    num, offs = _num(precision), _offs(offsets)
    aq, bq = num.q_tokens(a, offs), num.q_tokens(b, offs)
    out = torch.zeros(len(offs) - 1, a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi > lo:
            out[e] = num.act(num.mm(aq[lo:hi].t(), bq[lo:hi].t()))
    return out


@dataclass
class ExpertSaved:
    """What an expert group's backward reads: inputs x, gu = [g | u], h, offsets; ``biased``:
    the forward added expert biases (the backward returns their gradients too)."""

    x: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor
    offsets: list[int]
    biased: bool = False


def experts_forward(x, offsets, w_gate, w_up, w_down, limit, precision, biases=None):
    """Grouped expert MLP forward: rows r [M, H] and what backward needs. ``limit``: None, L or
    a :class:`SwiGLU`; ``biases``: None or (b_gate [E, I], b_up [E, I], b_down [E, H])."""
    gu, h = grouped_gemm1_swiglu(x, offsets, w_gate, w_up, limit, precision,
                                 None if biases is None else tuple(biases[:2]))
    r = grouped_gemm(h, offsets, w_down, precision, None if biases is None else biases[2])
    return r, ExpertSaved(x, gu, h, _offs(offsets), biases is not None)


def experts_backward(saved: ExpertSaved, dy_rows, w_gate, w_up, w_down, limit, precision):
    """Grouped expert MLP backward for routed dy rows [M, H]: (dx rows, dWg, dWu, dWd), then
    (d b_gate, d b_up, d b_down) when the forward added biases (``saved.biased``)."""
    inter = w_gate.shape[1]
    dgu = grouped_dswiglu_dgrad(dy_rows, saved.offsets, w_down, saved.gu, limit, precision)
    dx = grouped_dgrad1(dgu, saved.offsets, w_gate, w_up, precision)
    dwd = grouped_wgrad(dy_rows, saved.h, saved.offsets, precision)
    dwg = grouped_wgrad(dgu[:, :inter], saved.x, saved.offsets, precision)
    dwu = grouped_wgrad(dgu[:, inter:], saved.x, saved.offsets, precision)
    if not saved.biased:
        return dx, dwg, dwu, dwd
    dbg, dbu, dbd = (grouped_row_sums(a, saved.offsets, precision) for a in (dgu[:, :inter], dgu[:, inter:], dy_rows))
    return dx, dwg, dwu, dwd, dbg, dbu, dbd


# ----------------------------------------------------------------------------- routing
@dataclass
class Routing:
    """Rows received by this rank's experts from the global problem.

    ``src`` [M] source rank, ``tok`` [M] token index on that rank, ``slot`` [M], all int64 in
    expert-grouped order (by source rank, token, slot); ``offsets`` [E_local + 1].
    """

    src: torch.Tensor
    tok: torch.Tensor
    slot: torch.Tensor
    offsets: list[int]


def plan_routing(topk_idx_all: list[torch.Tensor], num_experts: int, ep: int, rank: int) -> Routing:
    """Which (source rank, token, slot) rows each of ``rank``'s local experts receives."""
    e_local = num_experts // ep
    srcs, toks, slots, eids = [], [], [], []
    for p, idx in enumerate(topk_idx_all):
        t, j = torch.nonzero(idx >= 0, as_tuple=True)
        e = idx[t, j].long()
        keep = (e >= rank * e_local) & (e < (rank + 1) * e_local)
        srcs.append(torch.full_like(t[keep], p))
        toks.append(t[keep])
        slots.append(j[keep])
        eids.append(e[keep] - rank * e_local)
    src, tok, slot, eid = (torch.cat(v).cpu() for v in (srcs, toks, slots, eids))
    order = torch.argsort(eid, stable=True)  # inputs are already in (rank, token, slot) order
    counts = torch.bincount(eid, minlength=e_local)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    return Routing(src[order], tok[order], slot[order], offsets)


@runtime_checkable
class HostGroup(Protocol):
    """A group of ranks that are threads of this process (e.g.
    :class:`mok_cute.comm.virtual.VirtualGroup`), as the reference uses one: ``size()``, the calling
    thread's ``rank()``, and ``all_gather(t)`` (every rank's ``t`` in rank order, first dims may
    differ; collective). A torch.distributed group is not one (it has no ``all_gather`` method)."""

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


def _world(group) -> tuple[int, int]:
    """(EP, rank) of ``group``: a torch.distributed group (None: the default group when one is
    initialized, else EP = 1), or a :class:`HostGroup` (the calling thread's rank). Checked in
    that order: a runtime Protocol ``isinstance`` costs microseconds on every layer call."""
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        return dist.get_world_size(), dist.get_rank()
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group), dist.get_rank(group)
    if isinstance(group, HostGroup):
        return group.size(), group.rank()
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(t: torch.Tensor, group, ep: int) -> list[torch.Tensor]:
    """All-gather tensors whose first dim may differ per rank (over ``group``: a
    torch.distributed group or a virtual group)."""
    if ep == 1:
        return [t]
    if isinstance(group, HostGroup):
        return group.all_gather(t)
    import torch.distributed as dist

    n = torch.tensor([t.shape[0]], device=t.device)
    ns = [torch.zeros_like(n) for _ in range(ep)]
    dist.all_gather(ns, n, group=group)
    ns = [int(v) for v in ns]
    pad = torch.zeros((max(ns),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[: t.shape[0]] = t
    outs = [torch.empty_like(pad) for _ in range(ep)]
    dist.all_gather(outs, pad, group=group)
    return [o[:m] for o, m in zip(outs, ns)]


# ----------------------------------------------------------------------------- the layer
def _deliver(rows, routing: Routing, t_all: list[int], k: int, topk_idx, e_local: int, group,
             ep: int, rank: int) -> torch.Tensor:
    """Send rows computed by this rank's experts back to their source ranks; return the
    [T, k, width] rows of this rank's own tokens (zeros for -1 slots)."""
    width = rows.shape[1]
    per_src = []
    for p, tp in enumerate(t_all):
        buf = torch.zeros(tp * k, width, dtype=rows.dtype, device=rows.device)
        sel = (routing.src == p).to(rows.device)
        buf[(routing.tok * k + routing.slot).to(rows.device)[sel]] = rows[sel]
        per_src.append(buf.view(tp, k, width))
    if ep == 1:
        return per_src[0]
    mine = None
    for p in range(ep):  # every rank joins each gather; only the source keeps the result
        got = _all_gather(per_src[p], group, ep)
        if p == rank:
            mine = got
    idx = topk_idx.long().to(rows.device)
    out = torch.zeros(t_all[rank], k, width, dtype=rows.dtype, device=rows.device)
    for q in range(ep):
        owned = (idx >= q * e_local) & (idx < (q + 1) * e_local)
        out[owned] = mine[q][owned]
    return out


# ----------------------------------------------------------------------------- the layer
@dataclass
class MoESaved:
    """Forward state the reference backward reads."""

    num: Numerics
    limit: float | SwiGLU | None  # the activation
    group: object
    ep: int
    rank: int
    e_local: int
    topk_idx: torch.Tensor
    slot_w: torch.Tensor  # [M] router weight of each received row
    routing: Routing
    gather_idx: torch.Tensor  # [M] row of each received token in the gathered x
    t_all: list[int]
    weights: tuple  # (w_gate, w_up, w_down)
    shared: tuple | None  # (ws_gate, ws_up, ws_down)
    routed: ExpertSaved
    shared_saved: ExpertSaved | None
    slot_out: torch.Tensor  # [T, k, H] routed output rows r_j of this rank's tokens
    gate: tuple | None = None  # (w_sg [1, H], g [T, 1] bf16, s [T, H] the shared output, x) with the gate


def shared_gate(num: Numerics, x: torch.Tensor, w_sg: torch.Tensor) -> torch.Tensor:
    """g [T, 1] = bf16(sigmoid(fp32(x . w_sg^T))) (the module doc; fp64 in exact mode)."""
    return num.act(torch.sigmoid(num.mm(x, w_sg)))


def shared_gate_backward(num: Numerics, dy: torch.Tensor, s: torch.Tensor, g: torch.Tensor, x: torch.Tensor,
                         w_sg: torch.Tensor):
    """The gate's backward (the module doc): ``(dy_s [T, H], the shared expert's dy; dx_gate [T,
    H] fp32, the gate's share of dx; d w_sg [1, H] fp32)``."""
    g32 = num.f32(g)
    dy_s = num.act(num.f32(dy) * g32)
    p = num.act(num.f32(dy) * num.f32(s))  # rounded before the sum over H
    dg = p.double().sum(-1, keepdim=True)
    dg = dg if num.exact else dg.float()
    dz = torch.ops.aten.sigmoid_backward(dg, g32)
    return dy_s, dz * num.f32(w_sg), num.mm(dz.t(), x.t())


def slot_sum(acc: torch.Tensor, rows: torch.Tensor, topk_idx: torch.Tensor, scale=None):
    """acc + sum_j (scale_j *) rows[:, j] in slot order, skipping -1 slots."""
    for j in range(rows.shape[1]):
        term = rows[:, j].to(acc.dtype)
        if scale is not None:
            term = scale[:, j : j + 1].to(acc.dtype) * term
        acc = torch.where((topk_idx[:, j] >= 0)[:, None].to(acc.device), acc + term, acc)
    return acc


def moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared=None, swiglu_limit=None,
                precision: str = "bf16", group=None, shared_gate_w=None, expert_biases=None):
    """The layer forward on this rank (see the module docstring). Returns (y [T, H], saved).
    ``swiglu_limit``: None, L, or a :class:`SwiGLU` (every expert's activation);
    ``shared_gate_w``: the shared expert's output gate w_sg [1, H] bf16 (needs ``shared``);
    ``expert_biases``: None or the routed experts' (b_gate [E_local, I], b_up [E_local, I],
    b_down [E_local, H])."""
    if shared_gate_w is not None and shared is None:
        raise ValueError("shared_gate_w (the shared expert's output gate) needs shared")
    num = _num(precision)
    ep, rank = _world(group)
    e_local = w_gate.shape[0]
    k = topk_idx.shape[1]
    x_all = _all_gather(x, group, ep)
    idx_all = _all_gather(topk_idx, group, ep)
    w_all = _all_gather(topk_w, group, ep)
    t_all = [t.shape[0] for t in x_all]
    routing = plan_routing(idx_all, e_local * ep, ep, rank)
    base = torch.tensor([0] + t_all[:-1]).cumsum(0)
    gather_idx = (base[routing.src] + routing.tok).to(x.device)
    slot_w = torch.cat(w_all)[gather_idx, routing.slot.to(x.device)]
    r, routed = experts_forward(torch.cat(x_all)[gather_idx], routing.offsets, w_gate, w_up,
                                w_down, swiglu_limit, precision, expert_biases)
    slot_out = _deliver(r, routing, t_all, k, topk_idx, e_local, group, ep, rank)
    acc = torch.zeros(x.shape, dtype=torch.float64 if num.exact else torch.float32, device=x.device)
    shared_saved = gate = None
    if shared is not None:
        s, shared_saved = experts_forward(x, [0, x.shape[0]], *(w[None] for w in shared),
                                          swiglu_limit, precision)
        acc = num.f32(s)
        if shared_gate_w is not None:
            g = shared_gate(num, x, shared_gate_w)
            acc = acc * num.f32(g)
            gate = (shared_gate_w, g, s, x)
    y = num.act(slot_sum(acc, slot_out, topk_idx, topk_w))
    saved = MoESaved(num, swiglu_limit, group, ep, rank, e_local, topk_idx, slot_w, routing,
                     gather_idx, t_all, (w_gate, w_up, w_down), shared, routed, shared_saved,
                     slot_out, gate)
    return y, saved


@dataclass
class MoEGrads:
    """Gradients of the layer: dx [T, H], d_topk_w [T, k] fp32, routed weight grads
    (local slice), and the shared expert's (ws_gate, ws_up, ws_down) grads or None."""

    dx: torch.Tensor
    d_topk_w: torch.Tensor
    d_w_gate: torch.Tensor
    d_w_up: torch.Tensor
    d_w_down: torch.Tensor
    d_shared: tuple | None
    d_shared_gate: torch.Tensor | None = None  # [1, H] fp32, with the shared expert's output gate
    d_biases: tuple | None = None  # (d b_gate, d b_up, d b_down) bf16, with expert biases


def moe_backward(saved: MoESaved, dy: torch.Tensor) -> MoEGrads:
    """The layer backward for upstream dy [T, H] (see the module docstring)."""
    num, ep = saved.num, saved.ep
    precision = num.precision
    dy_rows = torch.cat(_all_gather(dy, saved.group, ep))[saved.gather_idx]
    dy_rows = num.act(num.f32(dy_rows) * saved.slot_w.to(num.f32(dy).dtype)[:, None])
    dxr, dwg, dwu, dwd, *d_biases = experts_backward(saved.routed, dy_rows, *saved.weights, saved.limit,
                                                     precision)
    dx_slots = _deliver(dxr, saved.routing, saved.t_all, saved.topk_idx.shape[1],
                        saved.topk_idx, saved.e_local, saved.group, ep, saved.rank)
    acc = torch.zeros(dy.shape, dtype=num.f32(dy).dtype, device=dy.device)
    d_shared = d_gate = None
    if saved.shared is not None:
        dy_s, dx_gate = dy, None
        if saved.gate is not None:
            w_sg, g, s, x = saved.gate
            dy_s, dx_gate, d_gate = shared_gate_backward(num, dy, s, g, x, w_sg)
        dxs, *dws = experts_backward(saved.shared_saved, dy_s, *(w[None] for w in saved.shared),
                                     saved.limit, precision)
        acc = num.f32(dxs)
        if dx_gate is not None:
            acc = acc + dx_gate
        d_shared = tuple(d[0] for d in dws)
    dx = num.act(slot_sum(acc, dx_slots, saved.topk_idx))
    dtw = (dy.double()[:, None, :] * saved.slot_out.double()).sum(-1)
    dtw = torch.where(saved.topk_idx >= 0, dtw, torch.zeros_like(dtw))
    dtw = dtw if num.exact else dtw.float()
    return MoEGrads(dx, dtw, dwg, dwu, dwd, d_shared, d_gate, tuple(d_biases) if d_biases else None)


def moe(x, topk_idx, topk_w, w_gate, w_up, w_down, shared=None, swiglu_limit=None,
        precision: str = "bf16", group=None, shared_gate_w=None, expert_biases=None) -> torch.Tensor:
    """Forward only: y [T, H]."""
    return moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, swiglu_limit,
                       precision, group, shared_gate_w, expert_biases)[0]

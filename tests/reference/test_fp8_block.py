"""FP8 blockwise (precision "fp8_block", DeepSeek-V3 recipe) in the reference: quantizers on
hand-computed values, round-trip bounds, token-wise (wgrad) layout, the layer vs bf16."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from mok_cute import MoKConfig, moe
from mok_cute import reference as R
from conftest import make_problem

E4M3 = {448.0: 0x7E, 224.0: 0x76, 16.0: 0x58, 1.0: 0x38, -448.0: 0xFE, 2.0 ** -9: 0x01}


def tile(*vals, fill=0.0, n=128):
    v = list(vals) + [fill] * (n - len(vals))
    return torch.tensor([v], dtype=torch.float32)


def q1(x):
    d, s = R.fp8_block_quantize_act(x)
    return d.view(torch.uint8)[0].tolist(), s[0].tolist()


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def test_all_zero_tile_uses_amax_floor():
    data, (scale,) = q1(tile())
    assert data == [0] * 128 and scale == f32(R.FP8_AMAX_MIN / 448)
    data, _ = q1(tile(-0.0, 0.0, -0.0))
    assert data[:3] == [0x80, 0x00, 0x80]


def test_amax_448_is_identity_scale():
    data, (scale,) = q1(tile(448.0, 17.0, 19.0, -1.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10))
    assert scale == 1.0
    # 17 and 19 are ties between e4m3 neighbours (spacing 2 in [16, 32)): to even -> 16, 20
    assert data[:7] == [0x7E, 0x58, 0x5A, 0xB8, 0x01, 0x00, 0x02]


def test_amax_one():
    data, (scale,) = q1(tile(1.0, 0.5, -1.0))
    assert scale == f32(1.0 / 448.0)
    assert data[:3] == [0x7E, 0x76, 0xFE]


def test_inverse_is_rounded_fp32_division():
    # amax 3: inv = fp32(448 / 3); 3 * inv rounds back to 448 (never above: no saturation)
    x = tile(3.0, 1.0, 0.1)
    data, (scale,) = q1(x)
    inv = torch.tensor(448.0) / torch.tensor(3.0)
    want = (x[0, :3] * inv).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert data[:3] == want and data[0] == 0x7E
    assert scale == float(torch.tensor(3.0) / torch.tensor(448.0))


def test_tiny_and_huge_amax():
    data, (scale,) = q1(tile(2.0 ** -100, 2.0 ** -130))  # amax at the floor; 2^-130 underflows
    assert data[:2] == [0x7E, 0x00] and scale == f32(2.0 ** -100 / 448)
    big = float(torch.finfo(torch.bfloat16).max)
    data, (scale,) = q1(tile(big, -big / 2))
    assert data[:2] == [0x7E, 0xF6] and scale == f32(big / 448)  # -224 = 0xF6


def test_nan_inf_tiles():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.cat([tile(bad, 1.0), tile(3.0)], dim=1)
        d, s = R.fp8_block_quantize_act(x)
        assert torch.isnan(s[0, 0]) and s[0, 1] == f32(3.0 / 448)
        assert (d.view(torch.uint8)[0, :128] == 0x7F).all()
        back = R.fp8_block_dequantize_act(d, s)
        assert torch.isnan(back[0, :128]).all() and torch.isfinite(back[0, 128:]).all()


def _rn_f32_bits(q: Fraction) -> int:
    """Bit pattern of the fp32 nearest to the positive rational q (ties to even; exact
    integer arithmetic, normal range only: the quotients here are in [2^-109, 2^110])."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    assert Fraction(2) ** e <= q < Fraction(2) ** (e + 1) and -126 <= e <= 127
    m = q / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    r = m.numerator // m.denominator
    rem = m - r
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and r % 2):
        r += 1
    if r == 1 << 24:
        r, e = 1 << 23, e + 1
    return ((e + 127) << 23) | (r - (1 << 23))


def _f32_from_bits(b: int) -> float:
    return torch.tensor([b], dtype=torch.int32).view(torch.float32).item()


def _amax_bits_cases(seed: int) -> list[int]:
    """fp32 |x| patterns: random over [2^-100, 2^128) and edges (the floor, 448 * 2^k,
    powers of two, all-ones mantissas, largest finite, just above / below the floor)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 0x0D800000, 0x7F7FFFFF
    rand = torch.randint(lo, hi + 1, (4000,), generator=g, dtype=torch.int64).tolist()
    edge = [lo, lo + 1, hi, hi - 1, 0x3F800000, 0x3F800001, 0x3F7FFFFF, 0x43E00000, 0x43E00001, 0x43DFFFFF]
    for k in range(-100, 119, 7):
        for mant in (0, 1, 0x7FFFFF, 0x600000, 0x400000, 0x2AAAAB):
            edge.append(((k + 127) << 23) | mant)
    return edge + rand


def test_scale_and_inverse_are_correctly_rounded_fp32_quotients():
    """Pins the reference's divisions: scale = RN_f32(a / 448) and inv = RN_f32(448 / a)
    (checked against exact rational rounding), on one-nonzero tiles with amax a."""
    amax_bits = _amax_bits_cases(7)
    a = torch.tensor(amax_bits, dtype=torch.int32).view(torch.float32)
    t = torch.zeros(len(amax_bits), 1, 128)
    t[:, 0, 5] = a
    t[1::2, 0, 5] = -a[1::2]  # the sign does not matter
    d, s = R._fp8_block_tiles(t)
    got = s[:, 0].view(torch.int32).tolist()
    for i, b in enumerate(amax_bits):
        fa = Fraction(_f32_from_bits(b))
        want_scale = _rn_f32_bits(fa / 448)
        assert got[i] == want_scale, (hex(b), hex(got[i]), hex(want_scale))
        inv = _f32_from_bits(_rn_f32_bits(Fraction(448) / fa))
        assert inv == R._div_rn_f32(torch.tensor([448.0]), torch.tensor([_f32_from_bits(b)])).item()
        # x * inv rounded to fp32, then e4m3: the amax element maps to exactly +-448
        assert d.view(torch.uint8)[i, 0, 5].item() == (0xFE if i % 2 else 0x7E)
    # the check has teeth: a * fp32(1/448) (what CUDA's tensor / scalar computes) often differs
    recip = (a * torch.tensor(1 / 448, dtype=torch.float32)).view(torch.int32)
    assert (recip != s[:, 0].view(torch.int32)).sum() > 100


def test_div_rn_f32_matches_exact_rounding_on_random_operands():
    g = torch.Generator().manual_seed(11)
    n = 3000
    # operands with exponents in [-60, 60]: every quotient is a normal fp32
    ea = torch.randint(67, 188, (n,), generator=g, dtype=torch.int64)
    eb = torch.randint(67, 188, (n,), generator=g, dtype=torch.int64)
    ma = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int64)
    mb = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int64)
    a = ((ea << 23) | ma).to(torch.int32).view(torch.float32)
    b = ((eb << 23) | mb).to(torch.int32).view(torch.float32)
    q = R._div_rn_f32(a, b).view(torch.int32).tolist()
    for i in range(n):
        want = _rn_f32_bits(Fraction(a[i].item()) / Fraction(b[i].item()))
        assert q[i] == want, (a[i].item(), b[i].item())


def test_weight_scales_are_correctly_rounded():
    w = _random((256, 256), 5, spread=40)
    _, s = R.fp8_block_quantize_weight(w)
    amax = w.float().reshape(2, 128, 2, 128).abs().amax(dim=(1, 3))
    for i in range(2):
        for j in range(2):
            want = _rn_f32_bits(Fraction(amax[i, j].item()) / 448)
            assert s[i, j].view(torch.int32).item() == want


def _random(shape, seed, spread=30):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-spread, spread, (shape[0], 1), generator=g).float())
    return (torch.randn(shape, generator=g) * mag).bfloat16()


def _check_bound(back, x, scale_full):
    """|deq - x| <= 2^-4 |x| (3 mantissa bits, RNE) + half the e4m3 subnormal step (2^-10 * scale)
    + fp32 rounding of inv and of the scale (a few 2^-24 relative)."""
    err = (back.double() - x.double()).abs()
    bound = (2.0 ** -4 + 2.0 ** -20) * x.double().abs() + 2.0 ** -10 * scale_full.double()
    assert bool((err <= bound).all())


def test_act_round_trip_bound_and_axes():
    x = _random((128, 384), 0)
    d, s = R.fp8_block_quantize_act(x)
    assert d.shape == x.shape and d.dtype == torch.float8_e4m3fn and s.shape == (128, 3) and s.dtype == torch.float32
    back = R.fp8_block_dequantize_act(d, s, torch.float64)
    _check_bound(back, x, s.repeat_interleave(128, 1))
    # each tile's amax element maps to exactly 448 (never saturates, never above)
    assert bool((d.float().abs().reshape(128, 3, 128).amax(-1) == 448).all())
    assert torch.equal(R.fp8_round_trip_act(x, 0), R.fp8_round_trip_act(x.t().contiguous(), -1).t())
    # float64 dequantization is exact: data * scale has at most 4 + 24 significant bits
    assert torch.equal(back.float(), (d.double() * s.double().repeat_interleave(128, 1)).float())


def test_weight_blocks():
    w = _random((256, 384), 1, spread=5)
    w[130, 300] = 1000.0  # block (1, 2) gets a large amax
    d, s = R.fp8_block_quantize_weight(w)
    assert s.shape == (2, 3)
    blocks = w.float().reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(s, blocks / 448)
    assert s[1, 2] == f32(1000.0 / 448)
    back = R.fp8_block_dequantize_weight(d, s, torch.float64)
    _check_bound(back, w, s.repeat_interleave(128, 0).repeat_interleave(128, 1))
    # one block set serves W and W^T
    dt, st = R.fp8_block_quantize_weight(w.t().contiguous())
    assert torch.equal(dt.view(torch.uint8), d.view(torch.uint8).t()) and torch.equal(st, s.t())


def test_weight_equals_act_on_its_blocks():
    w = _random((128, 256), 2)
    d, s = R.fp8_block_quantize_weight(w)
    for kb in range(2):
        flat = w[:, kb * 128:(kb + 1) * 128].reshape(1, -1).float()
        # a 128x128 block quantized as one tile of 16384 elements: same fp32 ops
        dd, ss = R._fp8_block_tiles(flat.reshape(1, 1, -1))
        assert ss.item() == s[0, kb].item()
        assert torch.equal(dd.view(torch.uint8).reshape(128, 128), d.view(torch.uint8)[:, kb * 128:(kb + 1) * 128])


OFFSETS = [[0, 300], [0, 0, 5, 133, 133, 400], [0, 128, 256, 257]]


@pytest.mark.parametrize("offsets", OFFSETS)
def test_token_wise_layout(offsets):
    m = offsets[-1] + 3  # rows past offsets[E] belong to no group
    x = _random((m, 32), 3)
    data_t, scales = R.fp8_block_quantize_tokens(x, offsets)
    base = R.token_tile_bases(offsets, m)
    assert data_t.shape == (32, 128 * base[-1]) and scales.shape == (base[-1], 32)
    du = data_t.view(torch.uint8)
    used = torch.zeros(base[-1], dtype=torch.bool)
    for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        for t0 in range(lo, hi, 128):
            rows = x[t0:min(t0 + 128, hi)].float()
            n = rows.shape[0]
            amax = rows.abs().amax(0).clamp(min=R.FP8_AMAX_MIN)
            slot = base[e] + (t0 - lo) // 128
            assert not used[slot]
            used[slot] = True
            assert torch.equal(scales[slot], amax / 448)
            want = (rows * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn).view(torch.uint8).t()
            assert torch.equal(du[:, 128 * slot:128 * slot + n], want)
            assert not du[:, 128 * slot + n:128 * (slot + 1)].any()  # zero padding
    assert not scales[~used].any()
    assert not du.view(32, -1, 128)[:, ~used].any()
    # the dequantized values are what the wgrad reference sees
    back = R._fp8_round_trip_groups(x, offsets)
    for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        for t0 in range(lo, hi, 128):
            slot = base[e] + (t0 - lo) // 128
            n = min(t0 + 128, hi) - t0
            assert torch.equal(back[t0:t0 + n], data_t[:, 128 * slot:128 * slot + n].double().t() * scales[slot].double())


@pytest.mark.parametrize("offsets", OFFSETS)
def test_mxfp8_token_wise_layout(offsets):
    m = offsets[-1] + 3
    x = _random((m, 64), 4)
    data_t, scales = R.mxfp8_quantize_tokens(x, offsets)
    base = R.token_tile_bases(offsets, m, 32)
    assert data_t.shape == (64, 32 * base[-1]) and scales.shape == (base[-1], 64) and scales.dtype == torch.uint8
    du = data_t.view(torch.uint8)
    back = R._mx_round_trip_groups(x, offsets)
    used = torch.zeros(base[-1], dtype=torch.bool)
    for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        for t0 in range(lo, hi, 32):
            n = min(t0 + 32, hi) - t0
            slot = base[e] + (t0 - lo) // 32
            used[slot] = True
            d, sc = R.mxfp8_quantize(torch.nn.functional.pad(x[t0:t0 + n].float(), (0, 0, 0, 32 - n)), 0)
            assert torch.equal(scales[slot], sc[0])
            assert torch.equal(du[:, 32 * slot:32 * (slot + 1)], d.view(torch.uint8).t())
            assert torch.equal(back[t0:t0 + n], R.mxfp8_dequantize(d, sc, 0)[:n])
    assert not scales[~used].any() and not du.view(64, -1, 32)[:, ~used].any()


def test_group_tile_bases_never_overlap():
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        counts = torch.randint(0, 400, (7,), generator=g)
        counts[torch.rand(7, generator=g) < 0.3] = 0
        offs = [0] + torch.cumsum(counts, 0).tolist()
        base = R.token_tile_bases(offs, offs[-1])
        for e in range(7):
            assert base[e] + -(-int(counts[e]) // 128) <= base[e + 1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 128"):
        R.fp8_block_quantize_act(torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        R.fp8_block_quantize_weight(torch.zeros(64, 128, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        R.fp8_block_quantize_act(torch.zeros(4, 128, dtype=torch.float16))


# ---------------------------------------------------------------- the layer
def _run(p, dy, precision, limit=None):
    y, s = R.moe_forward(**p, swiglu_limit=limit, precision=precision)
    return y, R.moe_backward(s, dy)


def _rel(a, b):
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def test_layer_close_to_bf16():
    p, dy = make_problem(T=64, H=256, I=128, E=4, k=2, shared_I=128, seed=3)
    yb, gb = _run(p, dy, "bf16")
    yf, gf = _run(p, dy, "fp8_block")
    assert _rel(yf, yb) < 0.1 and not torch.equal(yf, yb)
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        assert _rel(getattr(gf, name), getattr(gb, name)) < 0.1, name
    for a, b in zip(gf.d_shared, gb.d_shared):
        assert _rel(a, b) < 0.1


def test_layer_forward_matches_dequantized_loop():
    """y by a per-token loop on operands quantized independently (act 1x128, weight blocks)."""
    p, _ = make_problem(T=8, H=128, I=128, E=3, k=2, seed=5)

    def mm(a, w):  # a [K] activation, w [N, K] weight
        return (R.fp8_round_trip_weight(w) @ R.fp8_round_trip_act(a[None], -1)[0]).float()

    y = torch.empty_like(p["x"])
    for t in range(p["x"].shape[0]):
        acc = torch.zeros(p["x"].shape[1])
        for j in range(2):
            e = int(p["topk_idx"][t, j])
            if e < 0:
                continue
            g = mm(p["x"][t], p["w_gate"][e]).bfloat16().float()
            u = mm(p["x"][t], p["w_up"][e]).bfloat16().float()
            h = (g * torch.sigmoid(g) * u).bfloat16()
            acc = acc + p["topk_w"][t, j] * mm(h, p["w_down"][e]).bfloat16().float()
        y[t] = acc.bfloat16()
    assert torch.equal(R.moe(**p, precision="fp8_block"), y)


def test_bitwise_deterministic():
    p, dy = make_problem(T=40, H=128, I=128, E=4, k=3, shared_I=128, seed=6)
    y0, g0 = _run(p, dy, "fp8_block", 4.0)
    for _ in range(2):
        y1, g1 = _run(p, dy, "fp8_block", 4.0)
        assert torch.equal(y0, y1)
        for a, b in zip([g0.dx, g0.d_topk_w, g0.d_w_gate, g0.d_w_up, g0.d_w_down, *g0.d_shared],
                        [g1.dx, g1.d_topk_w, g1.d_w_gate, g1.d_w_up, g1.d_w_down, *g1.d_shared]):
            assert torch.equal(a, b)


def test_config_and_api():
    assert MoKConfig(precision="fp8_block").precision == "fp8_block"
    p, dy = make_problem(T=16, H=128, I=128, E=4, k=2, shared_I=128, seed=9)
    leaves = [p["x"], p["w_down"]]
    for t in leaves:
        t.requires_grad_()
    y = moe(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], shared=p["shared"],
            config=MoKConfig(backend="reference", precision="fp8_block"))
    dx, dwd = torch.autograd.grad(y, leaves, dy)
    q = {k: v.detach() if torch.is_tensor(v) else v for k, v in p.items()}
    ry, rs = R.moe_forward(**q, precision="fp8_block")
    rg = R.moe_backward(rs, dy)
    assert torch.equal(y, ry) and torch.equal(dx, rg.dx) and torch.equal(dwd, rg.d_w_down)

"""MXFP8 quantize / dequantize of the reference on hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from mok_cute.reference import mx_round_trip, mxfp8_dequantize, mxfp8_quantize


def block(*vals, fill=0.0):
    """One row-wise block of 32 bf16-exact values: ``vals`` first, then ``fill``."""
    v = list(vals) + [fill] * (32 - len(vals))
    return torch.tensor([v], dtype=torch.float32).bfloat16()


def q1(x):
    d, s = mxfp8_quantize(x, -1)
    return d.view(torch.uint8)[0].tolist(), int(s[0, 0])


def test_all_zero_block():
    data, scale = q1(block())
    assert scale == 0 and data == [0] * 32  # e = -127, all data zero


def test_negative_zero_keeps_sign():
    data, _ = q1(block(-0.0, 1.0))
    assert data[0] == 0x80


@pytest.mark.parametrize("amax,byte", [(1.0, 119), (2.0 ** 10, 129), (2.0 ** -20, 99)])
def test_amax_power_of_two(amax, byte):
    # 2^p / 448 = 2^(p-9) * 1.14..., so e = p - 8; the element 2^p becomes 2^8 = 256 = 0x78
    data, scale = q1(block(amax, -amax / 4))
    assert scale == byte and data[0] == 0x78 and data[1] == 0xE8  # -64 = 0xE8


@pytest.mark.parametrize("e", [0, 3, -10])
def test_amax_exactly_448_times_pow2(e):
    data, scale = q1(block(448.0 * 2.0 ** e))
    assert scale == 127 + e and data[0] == 0x7E  # 448 = max normal e4m3, no saturation


def test_amax_just_over_448_moves_scale_up():
    x = block(452.0)  # bf16-exact; 452 > 448 so e = 1 and 452 / 2 = 226 rounds to 224
    d, s = mxfp8_quantize(x)
    assert int(s[0, 0]) == 128 and d.view(torch.uint8)[0, 0].item() == 0x76  # 226 -> 224 (0x76)


def test_subnormal_results_round_to_nearest_even():
    # scale e = 0 (amax 448): 2^-10 is half of the smallest subnormal 2^-9 -> ties to 0;
    # 1.5 * 2^-10 -> 0.75 * 2^-9 -> 2^-9 (0x01); 3 * 2^-10 = 1.5 * 2^-9 -> even -> 2 * 2^-9 (0x02)
    data, scale = q1(block(448.0, 2.0 ** -10, 1.5 * 2.0 ** -10, 3 * 2.0 ** -10, 7 * 2.0 ** -9))
    assert scale == 127
    assert data[1:5] == [0x00, 0x01, 0x02, 0x07]


def test_subnormal_bf16_input_is_not_flushed():
    tiny = 2.0 ** -130  # a bf16 subnormal
    data, scale = q1(block(tiny))
    assert scale == 0  # clamped at e = -127
    assert data[0] == 0x20  # tiny * 2^127 = 2^-3 = 0x20 in e4m3


def test_nan_and_inf_blocks():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.cat([block(bad, 1.0), block(3.0)], dim=1)
        d, s = mxfp8_quantize(x)
        assert s.tolist() == [[0xFF, 120]]  # amax 3 -> e = ceil(log2(3/448)) = -7
        assert (d.view(torch.uint8)[0, :32] == 0x7F).all()
        back = mxfp8_dequantize(d, s)
        assert torch.isnan(back[0, :32]).all() and torch.isfinite(back[0, 32:]).all()


def test_round_trip_error_bound_and_axes():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())).bfloat16()
    for dim in (0, 1):
        d, s = mxfp8_quantize(x, dim)
        assert d.shape == x.shape and s.dtype == torch.uint8
        assert s.shape == ((2, 96) if dim == 0 else (64, 3))
        back = mx_round_trip(x, dim)
        # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal results
        big = x.float().abs() > 2.0 ** -6 * x.float().abs().amax()
        rel = ((back - x.float()).abs() / x.float().abs())[big]
        assert float(rel.max()) <= 2.0 ** -4
    assert torch.equal(mx_round_trip(x, 0), mx_round_trip(x.t().contiguous(), 1).t())


def test_scale_matches_ceil_log2_definition():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 32 * 8, generator=g) * 1000).bfloat16()
    _, s = mxfp8_quantize(x)
    amax = x.float().abs().reshape(16, 8, 32).amax(-1)
    want = torch.tensor([[max(math.ceil(math.log2(a / 448)), -127) + 127 for a in row] for row in amax.tolist()])
    assert torch.equal(s.long(), want)


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be"):
        mxfp8_quantize(torch.zeros(32, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.zeros(4, 48, dtype=torch.bfloat16))


def test_dequantize_stays_on_the_input_device():
    """No CPU-only intermediate (it broke the reference on CUDA tensors): runs on 'meta'."""
    d = torch.empty(4, 64, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(4, 2, dtype=torch.uint8, device="meta")
    out = mxfp8_dequantize(d, s)
    assert out.device.type == "meta" and out.shape == (4, 64)

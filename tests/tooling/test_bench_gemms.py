"""tools.bench_gemms on the CPU: the k-tile rate's arithmetic (the GEMMs themselves run on the device only)."""
import pytest

from tools import bench_gemms


def test_ktile_rate_is_per_sm_and_128x256x64_tile():
    # 1086 m-tiles, N 1536 (6 tiles of 256), K 2048 (32 k-tiles): 208512 k-tiles over 132 SMs in 1.178 ms
    assert bench_gemms.ktile_us(1.178, 1086, 1536, 2048) == pytest.approx(1.178e3 * 132 / (1086 * 6 * 32))
    # a partial last n-tile counts as a tile
    assert bench_gemms.ktile_us(1.0, 10, 320, 64) == pytest.approx(1e3 * 132 / (10 * 2 * 1))


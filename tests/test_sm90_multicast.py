"""SM90 grouped GEMM in 2-CTA clusters with the B tile multicast (``MainloopConfig(cluster_mn=(2, 1))``):
compiles for sm_90a with no spills, issues multicast TMA loads only when opted in, and the cluster-pair
schedule's pure-Python mirror covers every tile once (odd m-tile counts: empty tiles). CPU only."""
import functools
import random

import pytest

from mok_cute.kernels.sm90.grouped_gemm import compile_grouped_gemm
from mok_cute.kernels.sm90.mainloop import NUM_THREADS, MainloopConfig
from mok_cute.schedule.group_tiles import cta_tiles, pair_cta_tiles
from conftest import offsets_from

PAIR = MainloopConfig(cluster_mn=(2, 1))
PAIR_TMA = MainloopConfig(cluster_mn=(2, 1), tma_store=True)
VARIANTS = {  # name -> (compile, multicast expected)
    "swiglu": (lambda: compile_grouped_gemm("swiglu", inspect=True), False),
    "swiglu-c21": (lambda: compile_grouped_gemm("swiglu", cfg=PAIR, inspect=True), True),
    "swiglu-c21-tma": (lambda: compile_grouped_gemm("swiglu", cfg=PAIR_TMA, inspect=True), True),
    "plain-c21-tma": (lambda: compile_grouped_gemm("plain", cfg=PAIR_TMA, inspect=True), True),
}
_MCAST = ".multicast::cluster"


@functools.cache
def _compiled(name):
    return VARIANTS[name][0]()[1]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_without_spills(name):
    rep = _compiled(name)
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers * NUM_THREADS <= 65536
    assert rep.has("wgmma.mma_async")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_multicast_only_when_opted_in(name):
    rep = _compiled(name)
    mcast = [ln for ln in rep.ptx.splitlines() if "cp.async.bulk.tensor" in ln and _MCAST in ln]
    if VARIANTS[name][1]:
        assert mcast, "no multicast TMA load in the (2, 1) PTX"
        assert rep.has("mapa.shared::cluster") or rep.has("shared::cluster")  # remote empty-barrier arrives
        assert rep.has("barrier.cluster.arrive") and rep.has("barrier.cluster.wait")
    else:
        assert not mcast and not rep.has(_MCAST)


def test_config_validation():
    assert PAIR.multicast and not MainloopConfig().multicast
    assert PAIR.key() != MainloopConfig().key()
    with pytest.raises(ValueError, match="cluster_mn"):
        MainloopConfig(cluster_mn=(1, 2)).validate()
    with pytest.raises(ValueError, match="cluster_mn"):
        compile_grouped_gemm("dswiglu", b_major="mn", cfg=PAIR)


def check_pairs(counts, tile_m, n_tiles, num_ctas):
    offs = offsets_from(counts)
    want = sorted(t for c in range(num_ctas) for t in cta_tiles(offs, tile_m, n_tiles, c, num_ctas))
    seen, empty = [], []
    for c in range(0, num_ctas, 2):
        t0, t1 = pair_cta_tiles(offs, tile_m, n_tiles, c, num_ctas), pair_cta_tiles(offs, tile_m, n_tiles, c + 1,
                                                                                     num_ctas)
        assert len(t0) == len(t1)  # both CTAs of a cluster walk the same number of tiles (and k-tiles)
        for a, b in zip(t0, t1):
            assert a[0] == b[0] and a[2] == b[2]  # same expert, same n-tile: the shared B tile
            assert b[1] == a[1] + 1 and a[1] % 2 == 0 and b[3] == a[3] + tile_m
            assert a[4] > 0
        for t in t0 + t1:
            (seen if t[4] else empty).append(t)
    assert sorted(seen) == want  # every real tile exactly once
    for e, m, n, row0, rows in empty:  # only the last m-tile of an expert with an odd count
        m_tiles = -(-counts[e] // tile_m)
        assert m_tiles % 2 == 1 and m == m_tiles
    assert len(empty) == sum(n_tiles for c in counts if -(-c // tile_m) % 2)


@pytest.mark.parametrize("counts", [
    [1024] * 16,
    [300, 0, 1000, 129, 128, 1, 640, 257],
    [0, 0, 5],
    [128 * 3, 0, 128 * 5 + 1, 127],
])
@pytest.mark.parametrize("num_ctas", [2, 6, 132])
def test_pair_schedule(counts, num_ctas):
    for n_tiles in (1, 3, 16):
        check_pairs(counts, 128, n_tiles, num_ctas)


def test_pair_schedule_random():
    rng = random.Random(0)
    for _ in range(50):
        counts = [rng.choice([0, 1, 127, 128, 129, rng.randrange(2000)]) for _ in range(rng.randrange(1, 12))]
        check_pairs(counts, 128, rng.randrange(1, 9), 2 * rng.randrange(1, 70))

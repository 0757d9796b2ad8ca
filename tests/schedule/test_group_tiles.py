"""The grouped tile schedule's pure-Python mirror vs brute-force enumeration."""
import random

import pytest

from mok_cute.schedule.group_tiles import cta_tiles, expert_tiles, total_tiles, wgrad_cta_tiles
from conftest import offsets_from


def brute_force(offsets, tile_m, n_tiles):
    """Every tile in linear order: experts in order, n-tile outer, m-tile inner."""
    tiles = []
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        m_tiles = -(-(hi - lo) // tile_m)
        for n in range(n_tiles):
            for m in range(m_tiles):
                row0 = lo + m * tile_m
                tiles.append((e, m, n, row0, min(tile_m, hi - row0)))
    return tiles


def check(counts, tile_m, n_tiles, num_ctas):
    offs = offsets_from(counts)
    want = brute_force(offs, tile_m, n_tiles)
    assert total_tiles(offs, tile_m, n_tiles) == len(want)
    assert sum(expert_tiles(offs, tile_m, n_tiles)) == len(want)
    seen = []
    for c in range(num_ctas):
        got = cta_tiles(offs, tile_m, n_tiles, c, num_ctas)
        assert got == want[c::num_ctas]
        seen += got
    assert sorted(seen) == sorted(want)
    # every expert row is covered exactly once per n-tile, no row outside the expert
    for e in range(len(counts)):
        rows = sorted(r for (ee, m, n, row0, nr) in seen if ee == e and n == 0 for r in range(row0, row0 + nr))
        assert rows == list(range(offs[e], offs[e + 1]))


ADVERSARIAL = [
    [1000, 0, 0, 0],  # all rows in one expert
    [0, 0, 0, 1000],
    [0, 5, 0, 0, 130, 0],  # empty experts, tails
    [128, 128, 128],  # exact multiples
    [127, 129, 1, 255],  # not multiples
    [0, 0, 0],  # zero total rows
    [0],
    [1],
    [7000] + [1] * 7,  # one hot expert, many tiny ones
]


@pytest.mark.parametrize("counts", ADVERSARIAL)
@pytest.mark.parametrize("num_ctas", [1, 3, 132])
def test_adversarial(counts, num_ctas):
    check(counts, 128, 4, num_ctas)


def test_random():
    rng = random.Random(0)
    for _ in range(200):
        e = rng.randint(1, 24)
        counts = [rng.choice([0, rng.randint(0, 300), rng.randint(0, 3000)]) for _ in range(e)]
        check(counts, rng.choice([64, 128]), rng.randint(1, 30), rng.randint(1, 140))


def test_no_idle_cta_with_hot_expert():
    """One expert with nearly all rows still spreads over every CTA."""
    offs = offsets_from([8192, 1, 0, 3])
    busy = [len(cta_tiles(offs, 128, 16, c, 132)) for c in range(132)]
    assert min(busy) >= 7 and max(busy) - min(busy) <= 1


@pytest.mark.parametrize("experts, m_tiles, n_tiles, num_ctas", [(8, 16, 28, 132), (1, 1, 1, 132), (3, 2, 5, 1),
                                                                 (5, 3, 1, 7)])
def test_wgrad_schedule_covers_every_tile_once(experts, m_tiles, n_tiles, num_ctas):
    seen = [t for c in range(num_ctas) for t in wgrad_cta_tiles(experts, m_tiles, n_tiles, c, num_ctas)]
    want = [(e, m, n) for e in range(experts) for m in range(m_tiles) for n in range(n_tiles)]
    assert sorted(seen) == want
    busy = [len(wgrad_cta_tiles(experts, m_tiles, n_tiles, c, num_ctas)) for c in range(num_ctas)]
    assert max(busy) - min(busy) <= 1

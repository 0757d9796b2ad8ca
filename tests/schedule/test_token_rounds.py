"""The token-local round order of an expert-grouped buffer's row blocks: a bijection onto the blocks, each round
holding the same fraction of every expert's blocks; the device steps' mirror equals the definition, and the device
function compiles inside the MXFP8 prologue (tests/test_route_grad.py)."""
import random

import pytest

from mok_cute.schedule import token_rounds as tr


def _offsets(counts):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return offs


_RANDOM = [[random.Random(s).randrange(0, 900) for _ in range(70)] for s in range(3)]


@pytest.mark.parametrize("counts", [[0], [5], [32, 32, 32], [1000, 0, 7, 64, 0, 31, 33], [0] * 40 + [4097] + [3] * 30,
                                    *_RANDOM])
@pytest.mark.parametrize("rounds", [1, 2, 7, 64, 300])
def test_mirror_is_the_definition_and_a_bijection(counts, rounds):
    offs = _offsets(counts)
    want = tr.round_blocks(offs, 32, rounds)
    nb = [-(-c // 32) for c in counts]
    assert sorted(want) == [(e, b) for e, n in enumerate(nb) for b in range(n)]
    got = [tr.round_block_mirror(offs, 32, rounds, c) for c in range(len(want) + 3)]
    assert got[:len(want)] == want
    assert got[len(want):] == [(len(counts), 0)] * 3


def test_rounds_follow_the_fraction_of_every_expert():
    offs = _offsets([640, 320, 64])  # 20, 10 and 2 blocks over 4 rounds: 5 + 2 + 0, 5 + 3 + 1, 5 + 2 + 0, 5 + 3 + 1
    order = tr.round_blocks(offs, 32, 4)
    assert order[:7] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1)]
    assert order[7:16] == [(0, b) for b in range(5, 10)] + [(1, 2), (1, 3), (1, 4), (2, 0)]


def test_rounds_and_steps():
    assert tr.rounds_for(0) == 1 and tr.rounds_for(32) == 1 and tr.rounds_for(33) == 2
    for r in (1, 2, 3, 255, 256, 257):
        assert 2 ** tr.search_steps(r) >= r

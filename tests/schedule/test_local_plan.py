"""The EP = 1 device routing plan (mok_cute/schedule/local_plan.py) on the CPU: it compiles for
every arch with the instructions its algorithm needs and no spills, and its torch mirror
``plan_reference`` (what the device check compares the kernel with, bitwise) matches a
plain-Python oracle of the contract on random, skewed, empty and out-of-range routings.
The kernel itself runs in tools/checks/local_plan.py."""
import random

import pytest
import torch

from mok_cute.schedule import local_plan as lp


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kind", ["i32", "i64"])
def test_compiles(arch, kind):
    _, rep = lp.compile_local_plan(arch, 64, kind, inspect=True)
    assert len(rep.registers) == 2 and rep.total_spill_bytes == 0  # count_kernel, scatter_kernel
    for needed in ("vote.sync.ballot", "popc", "atom.shared", "bar.sync"):
        assert needed in rep.ptx, needed


def test_plan_ctas():
    """One CTA per CTA_ROUTES routes, at least one, at most MAX_CTAS."""
    assert [lp.plan_ctas(n) for n in (1, lp.CTA_ROUTES, lp.CTA_ROUTES + 1, 81920)] == [1, 1, 2, 20]
    assert lp.plan_ctas(10 ** 9) == lp.MAX_CTAS


def test_rejects_too_many_experts():
    with pytest.raises(ValueError, match="E must be in"):
        lp.compile_local_plan("sm_90a", lp.MAX_EXPERTS + 1)


def _oracle(ids: list[int], e: int):
    """The contract in plain Python: (order, offsets, idx, words)."""
    idx = [v if -1 <= v < e else -1 for v in ids]
    bad = [i for i, v in enumerate(ids) if not -1 <= v < e]
    key = [v if v >= 0 else e for v in idx]
    order = sorted(range(len(ids)), key=lambda i: (key[i], i))
    offsets = [0]
    for x in range(e):
        offsets.append(offsets[-1] + key.count(x))
    return order, offsets, idx, [len(bad), bad[0] if bad else -1]


@pytest.mark.parametrize("seed", range(12))
def test_mirror_matches_oracle(seed):
    rng = random.Random(seed)
    e = rng.choice([1, 2, 7, 64])
    t, k = (0 if seed == 5 else rng.randint(1, 300)), rng.randint(1, 8)
    mode = seed % 4
    ids = []
    for _ in range(t * k):
        if mode == 1:  # skewed: most routes to expert 0, some -1
            ids.append(0 if rng.random() < 0.8 else rng.choice([-1, e - 1]))
        elif mode == 2:  # out-of-range ids mixed in
            ids.append(rng.choice([-1, e, e + 5, -3, 1 << 20] + list(range(e))))
        elif mode == 3:
            ids.append(-1)
        else:
            ids.append(rng.randrange(-1, e))
    dtype = torch.int32 if seed % 2 else torch.int64
    topk = torch.tensor(ids, dtype=dtype).view(t, k)
    order, offsets, idx, words = lp.plan_reference(topk, e)
    want = _oracle(ids, e)
    assert order.dtype == offsets.dtype == idx.dtype == words.dtype == torch.int32
    assert order.tolist() == want[0]
    assert offsets.tolist() == want[1]
    assert idx.tolist() == want[2]
    assert words.tolist() == want[3]

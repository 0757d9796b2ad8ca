"""The CTA pair's task ring (kernels/sm100/task_ring.py, the ``cta_group::2`` megakernels' scheduler
hand-off) on the CPU: its device probe (tools/checks/pair_ring.py, run on the H200 by
``gpu_check pair_ring``) compiles for every arch with clusters with the ring's instructions and 0
spills, and the probe's verdict catches each way the ring could fail."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checks import pair_ring  # noqa: E402

PTX = ("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32", "mapa.shared::cluster",
       "mbarrier.arrive.expect_tx.shared::cluster", "mbarrier.arrive.release.cluster.shared::cluster",
       "mbarrier.try_wait.parity", "barrier.cluster.wait", "atom.global.add.u32")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_probe_compiles_with_the_ring_instructions(arch):
    rep = pair_ring.compiled(arch, inspect=True)[1]
    assert not [p for p in PTX if p not in rep.ptx]
    assert rep.total_spill_bytes == 0


def _log(pairs: int, seqs: list[list[int]]) -> torch.Tensor:
    """A log where pair p's ten readers all logged ``seqs[p]``."""
    n = max(len(s) for s in seqs)
    log = torch.full((2 * pairs, 6, n), -1, dtype=torch.int32)
    for p, s in enumerate(seqs):
        for v, w in pair_ring.READERS:
            log[2 * p + v, w, :len(s)] = torch.tensor(s, dtype=torch.int32)
    return log


def test_verdict():
    good = _log(2, [[0, 3, 4, 6], [1, 2, 5]])  # 5 tasks: stop ids 6 and 5
    assert pair_ring.verify(good, 5) == ""
    bad = good.clone()
    bad[3, 5, 1] = 9  # the peer's TMA warp read another id
    assert "CTA 1 warp 5" in pair_ring.verify(bad, 5)
    assert "ids taken" in pair_ring.verify(_log(2, [[0, 3, 6], [1, 2, 5]]), 5)  # id 4 lost
    assert "ids taken" in pair_ring.verify(_log(2, [[0, 3, 4, 6], [1, 2, 3, 5]]), 5)  # id 3 twice
    assert "no stop" in pair_ring.verify(_log(2, [[0, 3, 4], [1, 2, 5]]), 5)
    assert "no stop" in pair_ring.verify(_log(2, [[0, 3, 4, 6, 7], [1, 2, 5]]), 5)  # an id after the stop

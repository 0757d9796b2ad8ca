"""The CTA pair's task ring (kernels/sm100/task_ring.py, the ``cta_group::2`` megakernels' scheduler
hand-off) on the CPU: its device probe (tools/checks/pair_ring.py, run on the H200 by
``gpu_check pair_ring``) compiles for every arch with clusters with the ring's instructions and 0
spills, and the probe's verdict catches each way the ring could fail."""

import pytest
import torch

from tools.checks import pair_ring

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


@pytest.mark.parametrize("counts", [[256] * 4, [1000, 0, 0, 0], [0, 0, 0, 1], [129, 1, 0, 300, 513]])
def test_pairs_run_the_shared_task_lists(counts):
    """``cta_group::2``: a pair claims as one CTA over 256-row tiles, so the forward's and the
    backward's pure-Python mirrors (the SM90 kernels' lists, shared) must complete at tile_m 256 with
    the pair counts as CTA counts (a full grid of 148 SMs is 74 pairs), the ring included, on
    skewed routings (one expert with every row, empty experts, tiles of one row)."""
    from conftest import offsets_from

    from mok_cute.schedule import fused_bwd_tasks as bt
    from mok_cute.schedule import fused_tasks as ft

    offs = offsets_from(counts)
    for pairs, comm in ((1, 1), (5, 2), (74, 8)):
        ft.simulate(offs, 700, 256, n1=4, n1s=2, n2=3, shared=True, gemm_ctas=pairs, comm_ctas=comm, seed=pairs,
                    gather=ft.Gather(ring=max(2, comm), band=max(2, comm)))  # the kernel's band: min(ring_band(), ring)
        bt.simulate(offs, 700, 256, n_i=2, n_is=1, n_h=3, w_d=2, w_gu=3, shared=True, gemm_ctas=pairs, comm_ctas=comm,
                    seed=pairs)

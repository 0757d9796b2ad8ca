"""The comm and schedule operand bundles on the CPU (no compile): field order and optional fields,
the trace-time PeerRows round trip, the workspace's sections and counters, the gather knobs of the
fused schedule's mirror."""
import pytest
import torch

pytest.importorskip("cutlass")

from mok_cute.comm import protocol as P  # noqa: E402
from mok_cute.comm import rows as R  # noqa: E402
from mok_cute.comm.peer_rows import PeerRows, PeerSections  # noqa: E402
from mok_cute.schedule import fused_tasks as ft  # noqa: E402


def test_bundle_fields_keep_the_flat_kernel_order():
    """The kernels' parameters are the bundles' fields in order (the PTX of the flat signatures):
    link, routes, grouped rows, dims, sections, round."""
    assert P.Link._fields == ("peer_bases", "status", "counters")
    assert P.Round._fields == ("epoch", "timeout_ns", "nctas")
    assert R.Routes._fields == ("recv_src", "offsets")
    assert R.Grouped._fields == ("rows", "w_rows", "n")
    assert R.Dims._fields == ("me", "ep", "T", "k", "V", "e_local")
    assert R.Sections._fields == ("rows", "w", "flags")
    from mok_cute.comm.combine import Sum
    from mok_cute.comm.planner import PlanDims, PlanOut, PlanSections

    assert Sum._fields == ("dest_rank", "weights", "start", "out")
    assert PlanOut._fields == ("counts", "offsets", "recv_src", "dest_rank", "dest_row")
    assert PlanDims._fields == ("cap", "me", "ep", "n") and PlanSections._fields == ("counts", "recv", "flags")


def test_only_the_weighted_pull_carries_the_weights():
    """A None field is absent from the compiled kernel: the pull without weights has no ``w_rows``
    and no ``w`` section, the weighted pull has both."""
    from mok_cute.comm.combine import _fake_operands as push_operands
    from mok_cute.comm.dispatch import _fake_operands

    plain, weighted = _fake_operands(False), _fake_operands(True)
    assert plain[2].w_rows is None and plain[4].w is None
    assert weighted[2].w_rows is not None and weighted[4].w is not None
    push = push_operands()
    assert push[2].w_rows is None and push[5].w is None and len(push) == 7


def test_peer_rows_round_trip():
    """PeerRows carried through a run-time loop comes back with the same fields (flat, in order)."""
    vals = [f"v{i}" for i in range(13)]
    pr = PeerRows(*vals[:4], PeerSections(*vals[4:8]), *vals[8:])
    assert pr.__extract_mlir_values__() == vals
    back = pr.__new_from_mlir_values__(vals)
    assert back._fields() == vals
    assert (back.src_off, back.slots_off, back.w_off, back.flags_off) == tuple(vals[4:8])


def test_workspace_sections_and_counters(monkeypatch):
    """The workspace holds the push combine's sections only (the pull combine's staged rows are
    gone) and a counters allocation per kernel kind that exists."""
    import mok_cute.comm.workspace as W
    from mok_cute.comm.virtual import VirtualGroup

    monkeypatch.setattr(W, "arch_of_device", lambda device: "sm_90a")
    wss = W.CommWorkspace.virtual(VirtualGroup(2, "cpu"), T=4, H=64, k=2, E=4)
    for ws in wss:
        assert list(ws.offsets) == ["flags", "counts", "recv", "src", "slots", "w", "dy"]
        assert sorted(ws.counters) == ["pull", "push"]
        assert all(off % 256 == 0 for off in ws.offsets.values())
        assert ws.peer_bases.tolist() == [w.buf.data_ptr() for w in wss]


def test_gather_knobs():
    """The fused schedule's mirror takes its gather knobs as one validated bundle."""
    assert ft.Gather() == ft.Gather("comm", None, None)
    with pytest.raises(ValueError, match="gather mode"):
        ft.Gather("pull")
    offs = [0, 300, 300, 520]
    for mode in ("comm", "bg", "direct"):
        assert ft.simulate(offs, 256, 128, 2, 1, 2, True, 3, 1, gather=ft.Gather(mode, ring=2, band=2)) > 0
    assert ft.simulate(offs, 256, 128, 2, 1, 2, True, 3, 1) == ft.simulate(offs, 256, 128, 2, 1, 2, True, 3, 1,
                                                                            gather=ft.Gather())
    assert ft.ListShape._fields == ("n_s1", "n_r1", "n_s2", "m_sh", "n1", "n2")
    assert ft.RingWait._fields == ("h_ready", "timeout_ns", "status", "channel")


def test_status_words_are_one_vocabulary():
    """The error status lives in dsl.status (the schedule's ring waits record into it too); the comm
    protocol re-exports it and names every code."""
    from mok_cute.dsl import status as S

    assert (P.OK, P.TIMEOUT, P.BAD_EXPERT, P.OVERFLOW, P.BAD_INDEX) == (S.OK, S.TIMEOUT, S.BAD_EXPERT, S.OVERFLOW,
                                                                        S.BAD_INDEX) == (0, 1, 2, 3, 4)
    assert P.wait_geq is S.wait_geq and ft.wait_geq is S.wait_geq and P.STATUS_WORDS == 4
    for code, what in ((S.BAD_EXPERT, "expert id"), (S.OVERFLOW, "capacity"), (S.BAD_INDEX, "packed source")):
        assert what in P.describe_status([code, 3, P.META, 2], 1.0)
    assert "unknown" in P.describe_status([9, 0, 0, 0], 1.0)

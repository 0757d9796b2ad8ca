"""tools.compare_trees' timing rounds: interleaved, the order reversed every other round, the median kept."""
from mok_cute.bench import run
from tools import compare_trees


def test_rounds_alternate_order_and_take_the_median(monkeypatch):
    calls, ms = [], iter([1.0, 5.0, 3.0, 2.0, 9.0, 4.0])
    monkeypatch.setattr(run, "events_ms", lambda fn, iters: (calls.append(fn()), next(ms))[1])
    out = compare_trees.time_rounds({"base": lambda: "base", "tree": lambda: "tree"}, rounds=3, iters=1)
    assert calls == ["base", "tree", "tree", "base", "base", "tree"]
    assert out == {"base": 2.0, "tree": 4.0}  # base 1, 2, 9; tree 5, 3, 4


def _fake_package(monkeypatch, name):
    """A package ``name`` with ``ops.moe`` and ``layers.grouped.GroupedExpertBackend.forward`` (each
    sleeping a little) and nothing else of HOST_TARGETS."""
    import sys
    import time
    import types

    pkg = types.ModuleType(name)
    pkg.__path__ = []
    ops, layers, grouped = (types.ModuleType(f"{name}.{m}") for m in ("ops", "layers", "layers.grouped"))

    class GroupedExpertBackend:
        def forward(self):
            time.sleep(0.001)
            return "y"

    ops.moe = lambda: (time.sleep(0.001), GroupedExpertBackend().forward())[1]
    grouped.GroupedExpertBackend = GroupedExpertBackend
    pkg.moe = ops.moe  # as ``from .ops import moe`` in the package's __init__
    for m in (pkg, ops, layers, grouped):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return pkg, ops, GroupedExpertBackend


def test_host_timers_time_the_targets_present_and_restore_them(monkeypatch):
    pkg, ops, cls = _fake_package(monkeypatch, "fake_tree")
    moe, forward = ops.moe, cls.forward
    with compare_trees.host_timers(pkg) as acc:
        assert pkg.moe() == "y" and ops.moe is not moe and pkg.moe is ops.moe  # both names timed
    assert set(acc) == {"ops.moe", "layers.grouped.GroupedExpertBackend.forward"}
    assert acc["ops.moe"] > acc["layers.grouped.GroupedExpertBackend.forward"] >= 0.001
    assert ops.moe is moe and pkg.moe is moe and cls.forward is forward


def test_host_table_rows(monkeypatch):
    pkg, ops, _ = _fake_package(monkeypatch, "fake_base")
    syncs = []
    rows = compare_trees.host_table({"base": (pkg, lambda: pkg.moe())}, calls=3, sync=lambda: syncs.append(1))
    assert len(syncs) == 4 and rows[0] == "| function | base us |" and len(rows) == 2 + len(compare_trees.HOST_TARGETS)
    moe_row = next(r for r in rows if r.startswith("| ops.moe |"))
    assert float(moe_row.split("|")[2]) >= 2000  # two 1 ms sleeps per call
    assert "| validate.check_moe_inputs | - |" in rows


def test_step_times_the_layer_without_the_routing_sync():
    """Each timed call builds its MoKConfig with ``validate_routing=False`` (no host sync per call, as the
    benchmark), unless the caller's fields set it."""
    import types

    import torch

    seen = []
    pkg = types.SimpleNamespace(MoKConfig=lambda **kw: kw, moe=lambda **kw: seen.append(kw["config"]) or torch.ones(1))
    inputs = {"x": torch.ones(2), "topk_idx": torch.zeros(2, dtype=torch.int64)}
    compare_trees._step(pkg, inputs, None, None, None, "bf16", backward=False)
    compare_trees._step(pkg, inputs, None, None, None, "bf16", backward=False, fields={"validate_routing": True})
    assert seen == [{"precision": "bf16", "validate_routing": False}, {"precision": "bf16", "validate_routing": True}]

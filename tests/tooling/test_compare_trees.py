"""tools.compare_trees' timing rounds: interleaved, the order reversed every other round, the median kept."""
from mok_cute.bench import run
from tools import compare_trees


def test_rounds_alternate_order_and_take_the_median(monkeypatch):
    calls, ms = [], iter([1.0, 5.0, 3.0, 2.0, 9.0, 4.0])
    monkeypatch.setattr(run, "events_ms", lambda fn, iters: (calls.append(fn()), next(ms))[1])
    out = compare_trees.time_rounds({"base": lambda: "base", "tree": lambda: "tree"}, rounds=3, iters=1)
    assert calls == ["base", "tree", "tree", "base", "base", "tree"]
    assert out == {"base": 2.0, "tree": 4.0}  # base 1, 2, 9; tree 5, 3, 4

"""tools/checks/disk_cache.py on the CPU: its reading of a ``tools.first_step`` process's line and its
verdict per step (fake processes; the check itself runs on a GPU)."""
from __future__ import annotations

from tools.checks import disk_cache as check


def _line(compiles: int, bitwise, step_s: float = 0.8) -> str:
    """A ``tools.first_step`` print, in its own format."""
    return (f"bf16 cache /c: import 3.10 s, first fwd+bwd {step_s:.2f} s (start to end of step 1: 3.90 s), bitwise "
            f"= first process: {bitwise}\n  {{'compiles': 5, 'hits': 3, 'kernel_compiles': {compiles}, 'entries': 5, "
            f"'disk_hits': 9, 'disk_misses': 0}}\n  launches {{}}")


class _Proc:
    def __init__(self, out: str, code: int = 0):
        self.out, self.returncode = out, code

    def communicate(self, timeout=None):
        return self.out, None


def test_reads_the_first_step_line():
    f = check._facts(_line(0, True))
    assert f == {"seconds": "3.90", "step_s": 0.8, "bitwise": "True", "kernel_compiles": 0, "disk_hits": 9}
    assert check._facts("Traceback ...")["kernel_compiles"] is None


def test_verdicts():
    assert check._row("cold", [_Proc(_line(7, None))], compiled=True).ok
    warm = check._row("warm", [_Proc(_line(0, True))], compiled=False)
    assert warm.ok and warm.bitwise and "within 1.5 s" in warm.note
    assert not check._row("warm", [_Proc(_line(3, True))], compiled=False).ok  # compiled: nothing was loaded
    assert not check._row("warm", [_Proc(_line(0, False))], compiled=False).ok  # outputs differ
    assert not check._row("off", [_Proc(_line(7, True), code=1)], compiled=True).ok
    assert not check._row("off", [_Proc("Traceback: boom")], compiled=True).ok
    writers = [_Proc(_line(7, True)), _Proc(_line(0, True)), _Proc(_line(0, True))]
    assert check._row("writers", writers, compiled=None).ok  # one compiled, the others loaded its entries
    assert not check._row("writers", [_Proc(_line(0, True))] * 2, compiled=None).ok

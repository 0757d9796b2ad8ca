"""tools/ptx_manifest.py's PTX normalizations and its comparison (CPU, no kernel compiled)."""
from __future__ import annotations

from tools.ptx_manifest import compare, entry_normalized, names_normalized

PTX = """.visible .entry kern_abc(
\t.param .u64 kern_abc_param_0
)
{
\tadd.s32 \t%r5, %r7, 1;
$L__BB0_3:
\tmov.b64 \t%rd2, %rd9;
\t@%p1 bra \t$L__BB0_3;
}
"""


def test_names_normalized_renumbers_registers_and_labels_in_order():
    """Registers per class and labels get numbers in order of first appearance (``%rd`` is not ``%r``); the same
    code with other names normalizes alike, other operands do not; the entry symbol is renamed first."""
    got = names_normalized(PTX)
    assert "kernel_0_param_0" in got and "add.s32 \t%r0, %r1, 1;" in got and "$L0:" in got
    assert "mov.b64 \t%rd0, %rd1;" in got and "@%p0 bra \t$L0;" in got
    renamed = PTX.replace("%r5", "%r40").replace("%r7", "%r41").replace("$L__BB0_3", "$L__BB2_9")
    assert renamed != PTX and names_normalized(renamed) == got
    other_operand = PTX.replace("%r5, %r7", "%r5, %r5")  # a different dataflow, not a renaming
    assert names_normalized(other_operand) != got
    assert entry_normalized(PTX) != got


def test_compare_reports_name_only_differences(capsys):
    """A variant whose PTX differs only in register / label names is counted apart, still as a difference."""
    h = lambda raw, entry, names: {"raw": raw, "entry": entry, "names": names}  # noqa: E731
    before = {"a": h(1, 1, 1), "b": h(2, 2, 2), "c": h(3, 3, 3)}
    after = {"a": h(1, 1, 1), "b": h(9, 9, 2), "c": h(8, 8, 8)}
    assert compare(before, after) == 1
    out = capsys.readouterr().out
    assert "SAME BUT FOR NAMES b" in out and "DIFFERS c" in out
    assert "3 variants compared: 1 byte-identical, 0 identical but for the kernel entry symbol, 2 differ (1 of them " \
           "only in their register and label names)" in out

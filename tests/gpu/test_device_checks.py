"""Every device check of tools/checks (the registry of ``python -m tools.gpu_check``) as a test,
marked ``gpu``: skipped without a CUDA device (tests/conftest.py), so that

    pytest -m gpu tests/gpu

on a GPU machine runs them all. Each check runs in its own child process (``python -m
tools.gpu_check NAME``, as :func:`tools.checks.common.child_rows` starts it): a device fault or a
hang in one check cannot take the others down, and a check that sets environment variables read at
CUDA initialization gets a fresh process. One process is rank 0 of 1: the EP > 1 checks run at
EP = 1 or report themselves skipped (their two-GPU form: ``torchrun --nproc_per_node=2 -m
tools.gpu_check comm layer_ep``). A check whose rows are all "skipped" (another architecture) is a
skipped test; any row not ok fails it, named with its note.
"""
from __future__ import annotations

import pytest

from tools.checks.common import Row, all_skipped, child_rows
from tools.gpu_check import check_names

TIMEOUT_S = 1200  # the slowest checks compile dozens of kernel variants on a fresh machine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", check_names())
def test_device_check(name):
    rows = child_rows(name, {}, TIMEOUT_S, name)
    print(Row.table(rows, f"{name}, child process"))
    if all_skipped(rows):
        pytest.skip("; ".join(f"{r.name} ({r.note})" for r in rows))
    failed = [r for r in rows if not r.ok]
    assert not failed, "\n".join(f"{r.name}: {r.note}" for r in failed)

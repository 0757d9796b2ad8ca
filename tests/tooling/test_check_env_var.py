"""tools/checks/common.env_var: one variable or a dict of them set inside the block, the caller's
values (or their absence) back after it, also when the block raises."""
from __future__ import annotations

import os

import pytest

from tools.checks.common import env_var


def test_one_and_several_restored(monkeypatch):
    monkeypatch.setenv("MOK_TEST_A", "caller")
    monkeypatch.delenv("MOK_TEST_B", raising=False)
    with env_var("MOK_TEST_A", "1"):
        assert os.environ["MOK_TEST_A"] == "1"
    assert os.environ["MOK_TEST_A"] == "caller"
    with pytest.raises(RuntimeError):
        with env_var({"MOK_TEST_A": "2", "MOK_TEST_B": "3"}):
            assert (os.environ["MOK_TEST_A"], os.environ["MOK_TEST_B"]) == ("2", "3")
            raise RuntimeError
    assert os.environ["MOK_TEST_A"] == "caller" and "MOK_TEST_B" not in os.environ
    with env_var({}):
        assert os.environ["MOK_TEST_A"] == "caller"

"""``python -m mok_cute.cache``: --help and --info on a CPU machine (no DSL imported for them), --info's counts,
--clear, --prune (entries of other sources; leftovers of interrupted writes), ``off``."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mok_cute import cache as cli
from mok_cute.dsl import disk_cache as dc
from mok_cute.dsl import env

ROOT = Path(__file__).resolve().parents[2]


def fake_entry(root: Path, name: str, source: str | None = None, size: int = 1000) -> Path:
    """An entry as disk_cache writes it (``source``: the source hash it was written for; default: these)."""
    key = {"source": source or dc.source_hash(), "dsl": dc.dsl_version(), "call": 0}
    d = root / dc.ROOT / name[:2] / name
    assert dc.write_entry(d, {"format": dc.FORMAT, "key": key, "object": dc._file(b"x" * size)}, b"x" * size, None)
    return d


def run(*argv: str, **env_vars: str) -> subprocess.CompletedProcess:
    code = ("import sys, runpy; sys.argv = ['mok_cute.cache', *sys.argv[1:]]; "
            "runpy.run_module('mok_cute.cache', run_name='__main__', alter_sys=True)")
    check = "import atexit, sys; atexit.register(lambda: print('DSL imported' if 'cutlass' in sys.modules else ''))"
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env_vars)
    return subprocess.run([sys.executable, "-c", f"{check}\n{code}", *argv], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=120)


def test_help_and_info_run_without_the_dsl(tmp_path):
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert "usage: python -m mok_cute.cache" in out.stdout and "--clear" in out.stdout
    fake_entry(tmp_path, "ab" * 32)
    out = run("--info", "--json", **{env.CACHE_DIR: str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "DSL imported" not in out.stdout
    info = json.loads(out.stdout.strip())
    assert info["directory"] == str(tmp_path) and info["entries"] == 1 and info["dsl_version"] == dc.dsl_version()


def test_python_dash_m(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mok_cute.cache", "--dir", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"directory    {tmp_path}" in out.stdout and "entries      0" in out.stdout


def test_info_counts_entries_size_and_leftovers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    fake_entry(tmp_path, "ab" * 32, size=2000)
    fake_entry(tmp_path, "cd" * 32, source="0" * 64)
    (tmp_path / dc.ROOT / "ab" / ".tmp-abab-1").mkdir()
    assert cli.main(["--info"]) == 0
    text = capsys.readouterr().out
    assert f"directory    {tmp_path}" in text
    assert "entries      2 (1 for these sources and this DSL)" in text
    assert "temporary    1" in text and dc.dsl_version() in text
    info = dc.info(tmp_path)
    assert info["bytes"] > 3000 and info["current"] == 1


def test_clear_removes_only_the_cache_format_root(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    mine = tmp_path / "notes.txt"  # a user's file in a directory they pointed the cache at
    mine.write_text("keep")
    for name in ("ab" * 32, "cd" * 32):
        fake_entry(tmp_path, name)
    assert cli.main(["--clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert not (tmp_path / dc.ROOT).exists() and mine.read_text() == "keep"
    assert dc.info(tmp_path)["entries"] == 0


def test_prune_keeps_current_entries(tmp_path, capsys):
    keep = fake_entry(tmp_path, "ab" * 32)
    old = fake_entry(tmp_path, "cd" * 32, source="0" * 64)
    fresh = tmp_path / dc.ROOT / "ab" / ".tmp-abab-fresh"  # a writer at work
    stale = tmp_path / dc.ROOT / "ab" / ".tmp-abab-stale"  # an interrupted one
    fresh.mkdir()
    stale.mkdir()
    past = time.time() - 2 * dc.LEFTOVER_S
    os.utime(stale, (past, past))
    assert cli.main(["--prune", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert keep.is_dir() and not old.exists() and fresh.is_dir() and not stale.exists()


def test_off(monkeypatch, capsys):
    for value in ("off", "0"):
        monkeypatch.setenv(env.CACHE_DIR, value)
        assert cli.main([]) == 0
        assert "off (MOK_CUTE_CACHE_DIR=off|0;" in capsys.readouterr().out
        assert cli.main(["--clear"]) == 1


@pytest.mark.parametrize("argv", [["--info", "--clear"], ["--bogus"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2

"""The process environment mok_cute reads: process-level infrastructure only.

This is the one module of the package that reads ``os.environ``. Nothing here chooses what a
kernel computes or how fast: those choices are fields of :class:`mok_cute.MoKConfig`, and a
config field that exists for the same thing always wins over the variable here (the variable
is only its default when the field is None). Each function reads the environment at every
call, so a test or a script can set a variable late.

| variable | values | what it does |
|---|---|---|
| ``MOK_CUTE_TRACE`` | ``0`` (default), ``1`` | the megakernels record one timestamped record per task (``MoKConfig(trace=...)`` wins) |
| ``MOK_CUTE_PROGRESS`` | ``0`` (default), ``1`` | debugging a stall: the fused forward writes per-CTA progress words to pinned host memory |
| ``MOK_CUTE_LAUNCH`` | ``graph`` (default), ``dsl`` | host launch path: one-node CUDA-graph replays, or every launch through the DSL |
| ``MOK_CUTE_CACHE_DIR`` | unset (default), a directory, ``off`` | where compiled kernels persist across processes (:mod:`mok_cute.dsl.disk_cache`): unset or ``on`` is ``$XDG_CACHE_HOME/mok_cute``, else ``~/.cache/mok_cute``; ``off`` keeps them in memory only (every process compiles) |
| ``MOK_CUTE_TUNING_FILE`` | unset (default), a file, ``off`` | the tuning file :mod:`mok_cute.tune` writes and every layer call reads (:mod:`mok_cute.tuning`): unset is ``$XDG_CACHE_HOME/mok_cute/tuning.json``, else ``~/.cache/mok_cute/tuning.json``; ``off``: only the tuned defaults shipped with the package |
"""
from __future__ import annotations

import os

TRACE = "MOK_CUTE_TRACE"
PROGRESS = "MOK_CUTE_PROGRESS"
LAUNCH = "MOK_CUTE_LAUNCH"
CACHE_DIR = "MOK_CUTE_CACHE_DIR"
CACHE_OFF = ("off", "0")  # values of MOK_CUTE_CACHE_DIR that turn the disk cache off
TUNING_FILE = "MOK_CUTE_TUNING_FILE"


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {value!r}")
    return value == "1"


def trace() -> bool:
    """``MOK_CUTE_TRACE=1``: the megakernels write a task trace (read by ``mok_cute.trace``).
    Only the default of ``MoKConfig.trace``: an explicit ``trace=True/False`` wins."""
    return _flag(TRACE)


def progress() -> bool:
    """``MOK_CUTE_PROGRESS=1``: the fused forward writes per-CTA progress words into pinned host
    memory as it runs, readable while it is stalled (debugging only; not with the trace)."""
    return _flag(PROGRESS)


def launch_mode() -> str:
    """``MOK_CUTE_LAUNCH``: ``graph`` (default) replays each kernel launch as a captured one-node
    CUDA graph; ``dsl`` launches through the DSL's call path (slower host side; for debugging)."""
    value = os.environ.get(LAUNCH, "graph").strip() or "graph"
    if value not in ("graph", "dsl"):
        raise ValueError(f"environment variable {LAUNCH} must be 'graph' or 'dsl', got {value!r}")
    return value


def _user_cache(*parts: str) -> str:
    """``$XDG_CACHE_HOME/mok_cute/...``, else ``~/.cache/mok_cute/...`` (absolute)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return os.path.abspath(os.path.expanduser(os.path.join(base, "mok_cute", *parts)))


def tuning_file() -> str | None:
    """``MOK_CUTE_TUNING_FILE``: the user's tuning file (an absolute path, ``~`` expanded); unset or
    empty: ``$XDG_CACHE_HOME/mok_cute/tuning.json``, else ``~/.cache/mok_cute/tuning.json``; None for
    ``off`` or ``0`` (no user file: the package's shipped tuned defaults only)."""
    value = os.environ.get(TUNING_FILE, "").strip()
    if value.lower() in CACHE_OFF:
        return None
    return os.path.abspath(os.path.expanduser(value)) if value else _user_cache("tuning.json")


def cache_dir() -> str | None:
    """``MOK_CUTE_CACHE_DIR``: the directory compiled kernels persist in across processes (an absolute
    path; ``~`` expanded); unset, empty or ``on`` (the default): ``$XDG_CACHE_HOME/mok_cute``, else
    ``~/.cache/mok_cute``; None for ``off`` or ``0`` (compile in every process). A loaded kernel is
    bitwise the compiled one (checked on a GPU by ``tools/checks/disk_cache.py``). ``python -m
    mok_cute.cache --info`` shows it; ``--clear`` empties it."""
    value = os.environ.get(CACHE_DIR, "").strip()
    if value.lower() in CACHE_OFF:
        return None
    if not value or value.lower() == "on":
        return _user_cache()
    return os.path.abspath(os.path.expanduser(value))

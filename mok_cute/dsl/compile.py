"""Compile CuTe DSL kernels for a target arch, with an in-memory cache and PTX inspection.

Everything that imports ``cutlass`` goes through :func:`dsl` so that ``import mok_cute``
never needs the DSL (or a GPU). Compilation needs no GPU: the target is passed as
``--gpu-arch`` (``sm_90a``, ``sm_100a``, ``sm_103a``).

Cache contract: ``compile_cached(key, build)`` compiles once per key for the life of the
process. The key must hold everything that changes the generated code (kernel name, arch,
dtypes, tile shapes, flags); dims that vary per step (token counts) stay symbolic in the
compiled kernel and are *not* part of the key, so a training step never recompiles.

Across processes: while ``build()`` runs, each ``compile_kernel`` call is looked up in the disk cache
(:mod:`mok_cute.dsl.disk_cache`, ``MOK_CUTE_CACHE_DIR``) by the key, which call of the build it is,
the arch and the sources: an earlier process's kernel is loaded instead of compiled.
"""
from __future__ import annotations

import io
import re
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable

from mok_cute.dsl import disk_cache
from mok_cute.dsl.host import device_index

ARCHS = ("sm_90a", "sm_100a", "sm_103a")

_lock = threading.Lock()
_cache: dict[Hashable, Any] = {}
_stats = {"compiles": 0, "hits": 0, "kernel_compiles": 0}
_build = threading.local()  # the compile_cached key whose build() runs, and its compile_kernel calls so far


_dump_dir: list[str] = []  # private PTX dump directory, made on the first inspected compile


def dsl():
    """Import and return ``(cutlass, cute)``."""
    import cutlass  # noqa: PLC0415 (lazy on purpose)
    import cutlass.cute as cute  # noqa: PLC0415

    return cutlass, cute


def arch_of_device(device=None) -> str:
    """The ``--gpu-arch`` string for a CUDA device (``sm_90a`` for capability 9.0)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


_arch_of: dict[int, str] = {}


def device_arch(device) -> tuple[int, str]:
    """(device index, ``--gpu-arch``) of a CUDA device, cached (host launch overhead)."""
    dev = device_index(device)
    arch = _arch_of.get(dev)
    if arch is None:
        arch = _arch_of[dev] = arch_of_device(dev)
    return dev, arch


@dataclass
class CompileReport:
    """What ptxas said about one compiled module (all kernels in it)."""

    arch: str
    ptx: str
    log: str
    registers: dict[str, int] = field(default_factory=dict)
    spill_bytes: dict[str, int] = field(default_factory=dict)
    stack_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def max_registers(self) -> int:
        return max(self.registers.values(), default=0)

    @property
    def total_spill_bytes(self) -> int:
        return sum(self.spill_bytes.values())

    def has(self, instruction: str) -> bool:
        """True if the PTX contains ``instruction`` (a substring such as ``wgmma.mma_async``)."""
        return instruction in self.ptx


_ENTRY = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _parse_ptxas(log: str, arch: str, ptx: str) -> CompileReport:
    rep = CompileReport(arch=arch, ptx=ptx, log=log)
    current = None
    # ptxas wraps the entry name onto the next line when it also prints a warning (e.g. spills)
    for line in re.sub(r"Function properties for\s*\n\s*", "Function properties for ", log).splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
        elif current and (m := _FRAME.search(line)):
            rep.stack_bytes[current] = int(m.group(1))
            rep.spill_bytes[current] = int(m.group(2)) + int(m.group(3))
        elif current and (m := _REGS.search(line)):
            rep.registers[current] = int(m.group(1))
    return rep


def compile_kernel(fn: Callable, *args, arch: str, inspect: bool = False, **kwargs):
    """``cute.compile(fn, *args)`` for ``arch``; returns ``(compiled, CompileReport | None)``.

    With ``inspect`` the PTX is kept and the ptxas resource report is captured. Inside a
    :func:`compile_cached` build the result may come from the disk cache (a loaded function, the
    stored report) instead.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    scope = getattr(_build, "key", None)
    if scope is None:
        return _compile(fn, args, kwargs, arch, inspect)
    _build.calls += 1

    def build():
        compiled, rep = _compile(fn, args, kwargs, arch, inspect)
        return compiled, None if rep is None else asdict(rep)
    compiled, rep = disk_cache.compile_or_load(scope[0], _build.calls - 1, fn, arch, inspect, kwargs, build)
    return compiled, None if rep is None else CompileReport(**rep)


def _compile(fn: Callable, args: tuple, kwargs: dict, arch: str, inspect: bool):
    _, cute = dsl()
    _stats["kernel_compiles"] += 1
    opts = f"--gpu-arch {arch}"
    if not inspect:
        return cute.compile(fn, *args, options=opts, **kwargs), None
    if not _dump_dir:
        _dump_dir.append(tempfile.mkdtemp(prefix="mok_cute_dsl_"))
    buf, old = io.StringIO(), sys.stderr
    sys.stderr = buf
    try:
        compiled = cute.compile(
            fn, *args, options=f"{opts} --keep-ptx --dump-dir {_dump_dir[0]} remarks{{ptx}}", **kwargs)
    finally:
        sys.stderr = old
    return compiled, _parse_ptxas(buf.getvalue(), arch, compiled.__ptx__ or "")


def compile_cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled object for ``key``, calling ``build()`` only on the first request (its
    ``compile_kernel`` calls go through the disk cache, see the module doc)."""
    with _lock:
        if key in _cache:
            _stats["hits"] += 1
            return _cache[key]
        outer = getattr(_build, "key", None), getattr(_build, "calls", 0)
        _build.key, _build.calls = (key,), 0  # boxed: a key may be None
        try:
            obj = build()
        finally:
            _build.key, _build.calls = outer
        _cache[key] = obj
        _stats["compiles"] += 1
        return obj


def cache_stats() -> dict[str, int]:
    """Counts in this process: compiled objects built (``compiles``) and found (``hits``) in memory,
    ``cute.compile`` calls (``kernel_compiles``) and the disk cache's (``disk_*``, see
    :func:`mok_cute.dsl.disk_cache.stats`). A training step should add only ``hits``."""
    disk = {f"disk_{k}": v for k, v in disk_cache.stats().items()}
    return dict(_stats, entries=len(_cache), **disk)

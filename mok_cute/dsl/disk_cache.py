"""Compiled kernels on disk: a process loads what an earlier process compiled instead of compiling it again.

Where it sits: :func:`mok_cute.dsl.compile.compile_cached` keeps one compiled object per key in memory;
while its ``build()`` runs, every :func:`~mok_cute.dsl.compile.compile_kernel` call goes through
:func:`compile_or_load` here. On a hit the kernel is loaded from disk (~2 ms) instead of traced and
compiled (seconds); on a miss it is compiled, then stored. ``compile_kernel`` called outside
``compile_cached`` (tools, PTX checks) always compiles.

The format is the DSL's own ahead-of-time export, not ours: ``compiled.dump_to_object(prefix)`` (what
``export_to_c`` writes as its ``.o``: the host launch function, the argument signature and the cubin)
and ``cutlass.runtime.load_module(path)[prefix]``, which returns the same class ``cute.compile``
does (``CudaDialectJitCompiledFunction``), called the same way (``GraphLauncher`` and the direct
launches call ``compiled(*args)``). The DSL's own file cache (``CUTE_DSL_CACHE_DIR``) is never used
by ``cute.compile`` (it passes ``no_cache=True``), and would only skip lowering, not the Python trace.
Two pieces of call-path state live outside the exported object (which Python values the compile saw
as raw pointers or ``None``, and the workspace-argument count); they are kept in ``meta.json`` and
set on the loaded function (:func:`call_state`), and a test checks loaded and compiled agree.

Key (``meta.json``'s ``key``; its sha256 names the entry): the format version, a hash of mok_cute's
sources (:func:`source_hash`: every ``.py`` of the package but ``layers/`` and the public API modules,
which kernel code may not import, tests/package/test_layering.py), the file defining the compiled
function when it lies outside the package (tools, tests), the DSL version and its compile-affecting
settings (``CUTE_DSL_LINEINFO`` ...; not its detected arch), the host CPU's instruction set (the
exported host code is compiled for it: AVX-512 instructions where the CPU has them), the target arch,
``inspect``, the ``compile_cached`` key's ``repr`` and which ``compile_kernel`` call of that build it
is. A key whose ``repr`` holds a memory address (``<... at 0x...>``) is not stable across processes:
that kernel stays in memory only (one warning).

Layout: ``<dir>/v1/<d[:2]>/<d>/{kernel.o, meta.json[, report.json]}`` for digest ``d``
(``report.json``: the :class:`CompileReport` of an ``inspect`` compile). ``--clear`` removes only
``<dir>/v1``.

Concurrency: an entry is written into a fresh temporary directory beside it and renamed into place
in one ``os.rename``; a second writer's rename fails (the entry exists) and it drops its copy, so a
reader sees a whole entry or none and never needs a lock. A per-entry ``flock`` (``<d>.lock``) only
saves work: while one process compiles an entry, the others wait for it (at most
:data:`LOCK_WAIT_S`) and then load it instead of compiling it too (a file system without ``flock``:
everyone compiles, still safe).

Damage: ``meta.json`` holds the size and sha256 of every file and the full key; an entry that does
not match (truncated, corrupt, written for another key) is removed with a warning and compiled
again. A load that fails anyway (what only a GPU can show: the loaded module's CUDA library load
or launch) warns once, removes the entry and turns the disk cache off for the rest of the process;
an unwritable directory warns once and stops the writes. A broken cache costs compile time, never
a run.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Hashable

from mok_cute.dsl import env, flock

FORMAT = 1
ROOT = "v1"  # everything this module writes lies under <cache dir>/v1
OBJECT, META, REPORT = "kernel.o", "meta.json", "report.json"
LOCK_WAIT_S = 300.0  # longest wait for another process compiling the same entry
LEFTOVER_S = 3600.0  # a temporary directory this old belongs to no running writer
PACKAGE = Path(__file__).resolve().parents[1]
# kernel code may not import these (tests/package/test_layering.py): editing them keeps the cache
NOT_KERNEL_SOURCES = ("layers", "ops.py", "layer.py", "config.py", "validate.py", "tune", "tuning.py", "bench",
                      "integrations", "precompile.py", "cache.py")
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")
# the settings the DSL keys its own cache by, where its spec cannot be read (arch: from --gpu-arch)
_DSL_SETTINGS = ("debug", "lineinfo", "enable_assertions", "compiler_opt", "compiler_backend", "shared_libs",
                 "enable_tvm_ffi", "enable_pyir", "loc_tracebacks", "warnings_as_errors", "dryrun")
# call-path state of a compiled function that the exported object does not carry (see call_state)
_ARG_STATE = ("_pointer_address_arg_specs", "_compiled_with_none", "_has_pointer_address_arg_specs")
_FN_STATE = ("total_added_arguments", "kernel_extra_args")

_stats = {"hits": 0, "misses": 0, "stores": 0, "rebuilt": 0, "load_failures": 0, "unkeyed": 0}
_state = {"load_broken": False, "store_broken": False}
_warned: set[str] = set()


class Corrupt(Exception):
    """An entry on disk that does not match its ``meta.json`` or its key."""


def stats() -> dict[str, int]:
    """Disk-cache counts in this process: loads (hits), compiles (misses), entries written (stores: not
    those another process wrote first), entries found damaged and rebuilt, failed loads, kernels whose
    key cannot persist (unkeyed)."""
    return dict(_stats)


def directory() -> Path | None:
    """The cache directory (``MOK_CUTE_CACHE_DIR``, :func:`mok_cute.dsl.env.cache_dir`), None when off."""
    d = env.cache_dir()
    return None if d is None else Path(d)


# ---------------------------------------------------------------- the key
def _hash_files(h, files, base: Path) -> None:
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:  # removed meanwhile (an editor's save)
            data = b"\0unreadable"
        h.update(f"{path.relative_to(base).as_posix()}\0{len(data)}\0".encode())
        h.update(data)


@functools.lru_cache(maxsize=8)
def source_hash(root: Path = PACKAGE) -> str:
    """sha256 of the kernel sources under ``root`` (the mok_cute package): every ``.py`` file but those
    in :data:`NOT_KERNEL_SOURCES`, by relative path and content. Once per process."""
    files = sorted(p for p in root.rglob("*.py")
                   if p.relative_to(root).parts[0] not in NOT_KERNEL_SOURCES and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    _hash_files(h, files, root)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def dsl_version() -> str:
    """The installed CuTe DSL (``nvidia-cutlass-dsl``) version, read without importing it."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        import cutlass  # noqa: PLC0415

        return str(getattr(cutlass, "__version__", "unknown"))


@functools.lru_cache(maxsize=1)
def dsl_settings() -> str:
    """The DSL's compile-affecting settings (its own cache key's, ``CUTE_DSL_*``) but the detected arch:
    the target arch is ``--gpu-arch``, so a kernel compiled on a CPU machine serves the GPU one."""
    from cutlass.cutlass_dsl import CuTeDSL  # noqa: PLC0415

    envar = CuTeDSL._get_dsl().envar
    try:
        names = {e.key_name for e in type(envar)._ENV_VAR_SPEC if e.affects_compile}
    except AttributeError:  # another DSL version: its version is in the key too
        names = set(_DSL_SETTINGS)
    names.discard("arch")
    return ";".join(f"{n}={_render(getattr(envar, n, None))}" for n in sorted(names))


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """This machine's architecture and instruction-set flags (hashed): an entry's host launch code is
    compiled for the CPU it was compiled on (AVX-512 where there is one), so a node with other flags
    compiles its own entry rather than loading one it cannot run."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(set(line.split(":", 1)[1].split())))
                return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"
    except OSError:
        pass
    return f"{platform.machine()}:{platform.processor()}"


def _render(value) -> str:
    return repr(tuple(sorted(value, key=repr)) if isinstance(value, (set, frozenset)) else value)


def _defined_in(fn) -> tuple[str, str]:
    """(qualified name, sha256 of its file when outside the package, else "") of a compiled function
    (a ``@cute.jit`` function, or an object whose ``__call__`` is one)."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    target = inspect.unwrap(target)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(fn).__qualname__)}"
    try:
        path = Path(inspect.getsourcefile(target) or "").resolve()
    except TypeError:
        return name, ""
    if not path.is_file() or PACKAGE in path.parents:
        return name, ""
    return name, hashlib.sha256(path.read_bytes()).hexdigest()


def entry_key(scope: Hashable, ordinal: int, fn, arch: str, inspect_: bool, kwargs: dict) -> dict | None:
    """The key of one ``compile_kernel`` call (see the module doc), None when it cannot persist."""
    name, outside = _defined_in(fn)
    parts = {"format": FORMAT, "source": source_hash(), "outside_source": outside, "dsl": dsl_version(),
             "dsl_settings": dsl_settings(), "host": host_cpu(), "arch": arch, "inspect": bool(inspect_),
             "key": repr(scope), "call": ordinal, "function": name, "kwargs": repr(sorted(kwargs.items()))}
    if _ADDRESS.search(parts["key"]) or _ADDRESS.search(parts["kwargs"]):
        return None
    return parts


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_dir(root: Path, parts: dict) -> Path:
    d = digest(parts)
    return root / ROOT / d[:2] / d


# ---------------------------------------------------------------- lookup
def compile_or_load(scope: Hashable, ordinal: int, fn, arch: str, inspect_: bool, kwargs: dict,
                    build: Callable[[], tuple[Any, dict | None]]) -> tuple[Any, dict | None]:
    """``(compiled, report dict | None)`` of call ``ordinal`` of the ``compile_cached`` build for
    ``scope``: loaded from the cache directory when an earlier process stored it, else ``build()``
    (compiles), then stored. Without a directory (``off``), or after a failed load, just ``build()``."""
    root = directory()
    parts = None if root is None or _state["load_broken"] else _key(scope, ordinal, fn, arch, inspect_, kwargs)
    if parts is None:
        return build()
    d = entry_dir(root, parts)
    if (got := _try_load(d, parts)) is not None:
        return got
    with _entry_lock(d):
        if (got := _try_load(d, parts)) is not None:  # stored by the process we waited for
            return got
        compiled, report = build()
        _stats["misses"] += 1
        _store(d, parts, compiled, report)
    return compiled, report


def _key(scope: Hashable, ordinal: int, fn, arch: str, inspect_: bool, kwargs: dict) -> dict | None:
    """:func:`entry_key`, or None (with one warning) where it fails or cannot persist."""
    try:
        parts = entry_key(scope, ordinal, fn, arch, inspect_, kwargs)
    except Exception as exc:  # noqa: BLE001 (a key we cannot make: compile, as without the cache)
        _warn_once(f"key {exc!r}", f"mok_cute: no disk cache key for {scope!r} ({exc!r}); compiling it")
        return None
    if parts is None:
        _stats["unkeyed"] += 1
        _warn_once(f"unkeyed {scope!r}", f"mok_cute: the compile key {scope!r} holds a memory address, so its "
                   "kernel is not kept on disk (compiled in every process)")
    return parts


def _try_load(d: Path, parts: dict):
    try:
        meta, report = read_entry(d, parts)
    except FileNotFoundError:
        return None
    except Corrupt as exc:
        _stats["rebuilt"] += 1
        warnings.warn(f"mok_cute: disk cache entry {d} is unusable ({exc}); removed, compiling it again",
                      stacklevel=4)
        discard(d)
        return None
    try:
        fn = load(d / OBJECT, meta)
    except Exception as exc:  # noqa: BLE001 (whatever the DSL raises: compile instead)
        _stats["load_failures"] += 1
        _state["load_broken"] = True
        warnings.warn(f"mok_cute: could not load the compiled kernel {d} ({exc!r}); removed, compiling "
                      "instead, and the disk cache is off for the rest of this process", stacklevel=4)
        discard(d)
        return None
    _stats["hits"] += 1
    return fn, report


def _checked(path: Path, want: dict) -> bytes:
    data = path.read_bytes()
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise Corrupt(f"{path.name}: {len(data)} bytes, not the {want['bytes']} bytes recorded, or another checksum")
    return data


def read_entry(d: Path, parts: dict) -> tuple[dict, dict | None]:
    """``(meta, report | None)`` of the whole, verified entry ``d`` for key ``parts``; FileNotFoundError
    when there is none, :class:`Corrupt` when it does not match its ``meta.json`` or the key."""
    if not d.is_dir():
        raise FileNotFoundError(d)
    try:
        meta = json.loads((d / META).read_text())
        if meta.get("format") != FORMAT or meta.get("key") != parts:
            raise Corrupt("written for another key or format")
        _checked(d / OBJECT, meta["object"])
        report = json.loads(_checked(d / REPORT, meta["report"])) if meta.get("report") else None
    except FileNotFoundError as exc:
        if not d.is_dir():  # removed by another process meanwhile: a miss
            raise
        raise Corrupt(f"{Path(exc.filename or '?').name} is missing") from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        raise Corrupt(f"unreadable: {exc!r}") from None
    return meta, report


def discard(d: Path) -> None:
    """Remove entry ``d``: renamed away first (so no reader sees half of it), then deleted."""
    trash = d.parent / f".trash-{uuid.uuid4().hex}"
    try:
        os.rename(d, trash)
    except OSError:
        return  # gone already
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------- the DSL's export and load
@functools.lru_cache(maxsize=1)
def _runtime():
    """``cutlass.runtime`` with the DSL's export/load providers set and its runtime library loaded
    globally (exporting needs its CUDA-runtime symbols, also on a machine without a GPU)."""
    import ctypes  # noqa: PLC0415

    import cutlass.cute.export  # noqa: F401, PLC0415 (sets the export/load providers)
    import cutlass.runtime  # noqa: PLC0415

    for lib in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return cutlass.runtime


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def call_state(compiled) -> dict:
    """What the call path of ``compiled`` reads that its exported object lacks: which arguments the
    compile saw as raw pointers or None (``ExecutionArgs``), the workspace-argument count."""
    args = compiled.execution_args
    return {"class": _class_name(compiled),
            "args": {n: getattr(args, n) for n in _ARG_STATE if hasattr(args, n)},
            "function": {n: getattr(compiled, n) for n in _FN_STATE if hasattr(compiled, n)}}


def _restore(fn, state: dict) -> None:
    if _class_name(fn) != state["class"]:
        raise TypeError(f"loaded a {_class_name(fn)}, compiled a {state['class']}")
    args = fn.execution_args
    specs = state["args"].get("_pointer_address_arg_specs")
    if specs is not None and len(specs) != args._meta.arg_count:
        raise ValueError(f"{len(specs)} argument specs for {args._meta.arg_count} arguments")
    for name, value in state["args"].items():
        setattr(args, name, value)
    for name, value in state["function"].items():
        setattr(fn, name, value)


def load(path: Path, meta: dict):
    """The compiled function stored at ``path``: the DSL's loader, plus :func:`call_state`."""
    module = _runtime().load_module(str(path))
    fn = module[meta["prefix"]]
    _restore(fn, meta["call_state"])
    fn._mok_cute_module = module  # the module owns the JIT engine the function runs in
    return fn


def export(compiled, prefix: str) -> bytes:
    """``compiled`` as an object file (host launch code, signature, cubin) with symbols ``prefix_*``."""
    _runtime()
    return compiled.dump_to_object(prefix)


# ---------------------------------------------------------------- store
def _file(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _store(d: Path, parts: dict, compiled, report: dict | None) -> None:
    if _state["store_broken"]:
        return
    prefix = f"mok_{d.name[:24]}"
    label = f"{parts['key']} (call {parts['call']})"
    try:
        obj, state = export(compiled, prefix), call_state(compiled)
        json.dumps(state)
    except Exception as exc:  # noqa: BLE001 (a kernel the DSL cannot export: compiled every time)
        _warn_once(f"export {label}", f"mok_cute: the kernel {label} cannot be exported ({exc!r}); it is not "
                   "kept on disk (compiled in every process)")
        return
    meta = {"format": FORMAT, "key": parts, "prefix": prefix, "call_state": state, "object": _file(obj),
            "created": time.time(), "pid": os.getpid()}
    try:
        _stats["stores"] += write_entry(d, meta, obj, report)
    except OSError as exc:
        _state["store_broken"] = True
        warnings.warn(f"mok_cute: cannot write the kernel cache under {d.parent} ({exc}); compiled kernels are not "
                      "kept on disk by this process", stacklevel=4)


def write_entry(d: Path, meta: dict, obj: bytes, report: dict | None) -> bool:
    """Write entry ``d`` whole or not at all: files into a fresh directory beside it, then one rename.
    False when another process stored ``d`` first (ours is dropped)."""
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{d.name[:16]}-", dir=d.parent))
    try:
        (tmp / OBJECT).write_bytes(obj)
        if report is not None:
            rep = json.dumps(report).encode()
            (tmp / REPORT).write_bytes(rep)
            meta = dict(meta, report=_file(rep))
        (tmp / META).write_text(json.dumps(meta, indent=1))
        os.rename(tmp, d)
        return True
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and d.is_dir():
            return False
        raise


@contextlib.contextmanager
def _entry_lock(d: Path):
    """Hold ``<d>.lock`` exclusively (waiting at most :data:`LOCK_WAIT_S`) so that one process compiles
    the entry while the others wait to load it; only saves work, so any failure just goes on unlocked."""
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(d.parent / f"{d.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        flock.acquire(fd, LOCK_WAIT_S)  # not held (timed out, no flock here): go on unlocked
        yield
    finally:
        os.close(fd)  # releases the lock


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------- inspection (the CLI)
def _entries(root: Path):
    base = root / ROOT
    if not base.is_dir():
        return
    for sub in sorted(base.iterdir()):
        if sub.is_dir():
            yield from sorted(p for p in sub.iterdir() if p.is_dir())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _current(entry: Path) -> bool:
    try:
        key = json.loads((entry / META).read_text())["key"]
        return key["source"] == source_hash() and key["dsl"] == dsl_version()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def info(root: Path | None) -> dict:
    """What :func:`directory` ``root`` holds: entries (those written for these sources and this DSL:
    ``current``), their bytes, leftover temporary directories of interrupted writers."""
    out = {"directory": None if root is None else str(root), "dsl_version": dsl_version(),
           "source_hash": source_hash()[:16], "entries": 0, "current": 0, "bytes": 0, "temporary": 0}
    if root is None:
        return out
    for entry in _entries(root):
        leftover = entry.name.startswith(".")
        out["temporary" if leftover else "entries"] += 1
        out["current"] += not leftover and _current(entry)
        out["bytes"] += _size(entry)
    return out


def clear(root: Path, stale_only: bool = False) -> int:
    """Remove every entry under ``root``, lock files included (``stale_only``: the entries not :func:`info`'s
    current, and temporary directories left for an hour); the number of entries removed."""
    if not stale_only:
        n = sum(not e.name.startswith(".") for e in _entries(root))
        shutil.rmtree(root / ROOT, ignore_errors=True)
        return n
    removed = 0
    for entry in list(_entries(root)):
        if entry.name.startswith("."):
            if time.time() - entry.stat().st_mtime > LEFTOVER_S:
                shutil.rmtree(entry, ignore_errors=True)
        elif not _current(entry):
            discard(entry)
            removed += 1
    return removed

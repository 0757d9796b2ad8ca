"""Tuned kernel policies on disk: the tuning files :mod:`mok_cute.tune` writes and every layer call reads.

A tuning file is JSON, ``{"format": 1, "entries": [{"key": {...}, "policy": {...}, "measured": {...}}]}``:

- ``key`` (:class:`Key`): what the measurement holds for: the GPU's name and SM count, the arch, the
  layer's shape per rank (tokens, hidden, inter, experts, topk, shared expert width, 0 for none), the
  expert-parallel size, the precision and the package version;
- ``policy``: the tuned :class:`~mok_cute.policy.KernelPolicy` fields, by dotted name
  (:meth:`KernelPolicy.given <mok_cute.policy.KernelPolicy.given>`; paths as their string values);
- ``measured``: what the tuner saw (the default's and the tuned policy's milliseconds, the pass
  timed, the date, the commit); informational.

Files read, the first match wins: the user's file (``MOK_CUTE_TUNING_FILE``, default
``~/.cache/mok_cute/tuning.json``: :func:`mok_cute.dsl.env.tuning_file`), then the tuned defaults
shipped in the package (:data:`SHIPPED`). A file that cannot be read or parsed is ignored with a
warning; so are its entries of another package version (stale: tuned for other kernels) and an
entry whose policy does not validate (one warning per file and reason). A layer call takes a
matching entry's fields only where its config leaves them None (:mod:`mok_cute.layers.tuned`).

Writing (:func:`record`) is a read-modify-write under an exclusive lock on ``<file>.lock`` and an
atomic rename: tuners writing one file at once keep each other's entries, and a reader never sees
a partial file. Reading needs no GPU, no torch and no CuTe DSL.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from mok_cute.dsl import env, flock
from mok_cute.policy import KernelPolicy

FORMAT = 1
#: the tuned defaults shipped with the package (measured by ``python -m mok_cute.tune --shipped``)
SHIPPED = Path(__file__).resolve().parent / "tuned_policies.json"
LOCK_WAIT_S = 60.0


def version() -> str:
    """The package version entries are keyed by (an entry of another version is stale)."""
    from mok_cute import __version__

    return __version__


@dataclass(frozen=True)
class Key:
    """What one tuning entry holds for (the module doc). ``shared``: the shared expert's width, 0
    without one; ``experts``: the experts the layer call's weights hold (per rank)."""

    gpu: str
    sms: int
    arch: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    shared: int
    ep: int
    precision: str
    version: str

    @classmethod
    def from_json(cls, d) -> Key:
        """The key of a file's ``"key"`` object; ValueError when a field is missing or mistyped."""
        if not isinstance(d, dict):
            raise ValueError(f"a key is an object, got {type(d).__name__}")
        out = {}
        for f in fields(cls):
            v = d.get(f.name)
            want = str if f.type == "str" else int
            if isinstance(v, bool) or not isinstance(v, want):
                raise ValueError(f"key field {f.name!r} must be a {want.__name__}, got {v!r}")
            out[f.name] = v
        return cls(**out)

    def describe(self) -> str:
        """``T16384 H2048 I768 E128 k8 EP1 bf16 on NVIDIA H100 80GB HBM3 (132 SMs, sm90)``."""
        shared = f" +shared{self.shared}" if self.shared else ""
        return (f"T{self.tokens} H{self.hidden} I{self.inter} E{self.experts} k{self.topk}{shared} EP{self.ep} "
                f"{self.precision} on {self.gpu} ({self.sms} SMs, {self.arch})")


def device_identity(device) -> tuple[str, int]:
    """``(name, SM count)`` of a CUDA ``device`` (a torch.device; its properties are read once per process)."""
    from mok_cute.dsl.host import device_props

    p = device_props(device)
    return p.name, p.multi_processor_count


class Entry(NamedTuple):
    """One tuning entry: its policy, what the tuner measured, and the file it came from."""

    policy: KernelPolicy
    measured: dict
    source: Path


def user_file() -> Path | None:
    """The user's tuning file (:func:`mok_cute.dsl.env.tuning_file`), None when turned off."""
    f = env.tuning_file()
    return None if f is None else Path(f)


def files() -> list[Path]:
    """The files :func:`lookup` reads, in order: the user's (if on), then :data:`SHIPPED`."""
    user = user_file()
    return ([user] if user is not None else []) + [SHIPPED]


# ---------------------------------------------------------------- reading
_READ: dict[Path, tuple[tuple, dict]] = {}  # path -> ((mtime_ns, size), {Key: Entry})
_warned: set[tuple[str, str]] = set()


def _warn(path: Path, reason: str, message: str) -> None:
    if (str(path), reason) not in _warned:
        _warned.add((str(path), reason))
        warnings.warn(f"mok_cute tuning file {path}: {message}", stacklevel=3)


def _stamp(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def read(path: Path) -> dict[Key, Entry]:
    """The current entries of the tuning file ``path`` by key (empty when it does not exist); an
    unreadable file, a stale or invalid entry: warned about (once) and left out. Re-read only when
    the file's modification time or size changed."""
    stamp = _stamp(path)
    if stamp is None:
        return {}
    hit = _READ.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    entries = _parse(path)
    _READ[path] = (stamp, entries)
    return entries


def _load_json(path: Path):
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        raise ValueError(f"is not a format-{FORMAT} tuning file ({{\"format\": {FORMAT}, \"entries\": [...]}})")
    return doc


def _parse(path: Path) -> dict[Key, Entry]:
    try:
        doc = _load_json(path)
    except ValueError as e:
        _warn(path, "unreadable", f"{e}; ignored")
        return {}
    out, stale, bad = {}, 0, []
    for raw in doc["entries"]:
        try:
            key = Key.from_json(raw.get("key") if isinstance(raw, dict) else None)
            policy = KernelPolicy.from_given(raw.get("policy") or {})
        except (TypeError, ValueError) as e:
            bad.append(str(e))
            continue
        if key.version != version():
            stale += 1
            continue
        measured = raw.get("measured")
        out[key] = Entry(policy, measured if isinstance(measured, dict) else {}, path)
    if stale:
        _warn(path, "stale", f"{stale} entr{'y' if stale == 1 else 'ies'} tuned for another mok_cute version ignored "
                             f"(this is {version()}): run python -m mok_cute.tune again for them")
    if bad:
        _warn(path, "invalid", f"{len(bad)} invalid entr{'y' if len(bad) == 1 else 'ies'} ignored (first: {bad[0]})")
    return out


def lookup(key: Key) -> Entry | None:
    """The entry for ``key`` in the first of :func:`files` that has one, or None."""
    for path in files():
        hit = read(path).get(key)
        if hit is not None:
            return hit
    return None


# ---------------------------------------------------------------- writing
@contextlib.contextmanager
def _locked(path: Path):
    """Hold ``<path>.lock`` exclusively; TimeoutError after :data:`LOCK_WAIT_S` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not flock.acquire(fd, LOCK_WAIT_S):
            raise TimeoutError(f"tuning file {path}: its lock was not free within {LOCK_WAIT_S:.0f} s")
        yield
    finally:
        os.close(fd)


def record(path: Path, key: Key, policy: KernelPolicy, measured: dict) -> None:
    """Write ``policy`` (with ``measured``) for ``key`` into the tuning file ``path``, replacing an
    entry of the same key and keeping every other one (a file that cannot be read is replaced, with
    a warning): under the file's lock, through a temporary file renamed over it."""
    path = Path(path)
    entry = {"key": asdict(key), "policy": {k: getattr(v, "value", v) for k, v in policy.given().items()},
             "measured": measured}
    with _locked(path):
        entries = []
        if path.exists():
            try:
                entries = _load_json(path)["entries"]
            except ValueError as e:
                _warn(path, "replaced", f"{e}; replaced by a new file")
        entries = [e for e in entries if not (isinstance(e, dict) and e.get("key") == entry["key"])] + [entry]
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

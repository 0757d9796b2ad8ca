"""Ahead-of-time warm-up of the compiled-kernel cache: ``python -m mok_cute.precompile``.

Compiles every kernel a layer shape's training step needs into the disk cache
(:mod:`mok_cute.dsl.disk_cache`, ``MOK_CUTE_CACHE_DIR``), in parallel worker processes, so that the
first step of a training run loads its kernels (milliseconds) instead of compiling them (seconds
each). Needs no GPU: give the target arch (``--arch sm_90a``; default: the present GPU's)::

    python -m mok_cute.precompile --hidden 2048 --inter 768 --experts 128 --topk 8 --tokens 16384
    python -m mok_cute.precompile --shape qwen3-30b-a3b deepseek-v3-ep8 --precision bf16 mxfp8 --jobs 8
    python -m mok_cute.precompile --shape gpt-oss-20b --arch sm_100a --list      # the kernels, nothing compiled

or from Python: ``mok_cute.precompile.precompile(Problem(16384, 2048, 768, 128, 8), arch="sm_90a")``
returns a :class:`Summary` (compiled, already cached, failed, seconds); the workers are spawned
processes, so a script calling it needs the ``if __name__ == "__main__":`` guard.

How the kernels are found (exact, not a hand-kept list): a worker process runs the layer's own
forward and backward (:func:`mok_cute.custom_ops.run_forward` / ``run_backward``: the backend, the
path decision :func:`mok_cute.layers.paths.decide`, the tuned policy, every kernel wrapper's host
code) on torch fake tensors of the shape on a fake ``cuda`` device, with the device queries
answering for the target arch (``device_arch``, ``arch_of_device``, ``sm_count``, the streams) and
``compile_cached`` recording each compile key and returning a stand-in that launches nothing. The
distinct keys are the kernels. Each one is then compiled by a worker that runs the same pass up to
that key's ``compile_cached`` call, then calls the real :func:`~mok_cute.dsl.compile.compile_cached`
with that key and the wrapper's own ``build`` (outside the fake tensor modes): the very call a GPU
process makes, so the disk entries are the ones it looks up (or, where they exist already, loads
them: "already cached"). No kernel is launched; on a GPU machine each worker still holds a CUDA
context (torch's fake CUDA tensors make one).

Why the entries match a later GPU run: a disk entry's key (:func:`mok_cute.dsl.disk_cache.entry_key`)
is the ``compile_cached`` key's ``repr`` and the ordinal of each ``compile_kernel`` call in its
build, the compiled function's name, the arch (``sm_90a``, ``sm_100a``, ``sm_103a``: what
``arch_of_device`` gives for capability 9.0, 10.0, 10.3), the sources of mok_cute, the CuTe DSL
version and its ``CUTE_DSL_*`` settings, and the CPU's instruction set (the exported host code is
compiled for it). Nothing in it reads the GPU itself: no SM count (that is a launch argument), no
device name. So:

* run it with the same checkout and install (an edit to mok_cute's kernel sources or another DSL
  version makes new keys; ``python -m mok_cute.cache --prune`` drops the old entries);
* on the GPU node itself, or a machine with the same CPU type (a node with other CPU instruction
  set flags looks up other entries and compiles its own);
* with the same ``MOK_CUTE_TRACE`` / ``MOK_CUTE_PROGRESS`` and ``CUTE_DSL_*`` environment as the
  training run (they select kernel variants or compile settings), and the same ``MoKConfig``
  (``--config FIELD=VALUE``: paths, tiles, stages, ``trace`` choose kernels; ``backend`` and
  ``precision`` are set by ``--arch`` and ``--precision``; ``validate_routing`` plays no part);
* a tuning-file entry (:mod:`mok_cute.tuning`) applies to the layer call it matches by the GPU's
  name and SM count: the present GPU's when its arch is the target, else ``--gpu NAME --sms N``;
  without either no entry applies and the kernels are the untuned policy's (the same ones where
  an entry changes only launch arguments, as the shipped entries' comm CTAs do).

Covered: one layer call's forward and (unless ``--no-backward``) backward at EP = 1 on the
``sm90`` / ``sm100`` backend, in each precision asked for, with the shared expert (``--shared``),
its output gate (``--shared-gate``), ``main_grads`` (``--main-grads``), the SwiGLU clamp and
gpt-oss's alpha / up offset (``--limit 7 --swiglu-alpha 1.702 --swiglu-up-offset 1``), expert biases
(``--biases``: gpt-oss; bf16 only, as the layer runs them), and the
routing plan for int32 and int64 ``topk_idx`` (``MoELayer``'s router gives int64; ``--index-dtype``).
``activations="recompute"`` / ``"budget"`` run the same kernels. The token count T changes no key
(every per-step dim is symbolic in the kernels); it only selects a tuning entry.

Not covered: EP > 1 (``--ep`` > 1 is refused: the EP layer's comm kernels, device planner and
``ep`` kernel variants need the ranks' symmetric-memory workspace and process group; its first
step compiles them), :func:`mok_cute.expert_mlp` (the grouped expert MLP on its own), more than 1024
experts per rank (the routing plan's torch
fallback has a value-dependent shape: refused with a message), and kernels compiled outside
``compile_cached`` (tools, PTX checks), which never use the disk cache.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from mok_cute.bench.shapes import LayerSize

ARCHS = ("sm_90a", "sm_100a", "sm_103a")
INDEX_DTYPES = ("int32", "int64")
_BACKEND = {"sm_90a": "sm90", "sm_100a": "sm100", "sm_103a": "sm100"}
_SMS = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}  # H100 / H200, B200 / B300 SXM: without --sms


# ---------------------------------------------------------------- what to compile
@dataclass(frozen=True)
class Problem(LayerSize):
    """One layer call whose kernels to compile: its sizes (:class:`~mok_cute.bench.shapes.LayerSize`, E
    ``experts`` per rank; ``ep``: only 1 is covered), ``precision`` (None: ``config``'s), the activation (``limit`` None: no clamp;
    ``swiglu_alpha`` / ``swiglu_up_offset``: gpt-oss's 1.702 / 1), ``backward`` (the backward's
    kernels too), ``shared_gate`` (the shared expert's output gate), ``main_grads`` (the weight
    gradients added into fp32 buffers), ``biases`` (the routed experts' biases, gpt-oss), ``index_dtypes`` (``topk_idx``'s dtypes: the routing plan
    compiles per dtype) and ``config`` (a :class:`~mok_cute.config.MoKConfig`, or a mapping of its
    fields; None: the defaults). ValueError for a value no layer call takes."""

    precision: str | None = None
    limit: float | None = None
    swiglu_alpha: float = 1.0
    swiglu_up_offset: float = 0.0
    backward: bool = True
    shared_gate: bool = False
    main_grads: bool = False
    biases: bool = False
    index_dtypes: tuple[str, ...] = INDEX_DTYPES
    config: object = None
    name: str = ""

    def __post_init__(self):
        from mok_cute.config import PRECISIONS, MoKConfig

        super().__post_init__()
        if self.ep != 1:
            raise ValueError(f"ep = {self.ep}: EP > 1 is not precompiled (its comm kernels, device planner and ep "
                             "kernel variants need the ranks' workspace and process group; see the module doc), "
                             "only ep = 1")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.shared_gate and not self.shared:
            raise ValueError("shared_gate (the shared expert's output gate) needs a shared expert (shared > 0)")
        dtypes = tuple(self.index_dtypes)
        if not dtypes or any(d not in INDEX_DTYPES for d in dtypes):
            raise ValueError(f"index_dtypes must be a non-empty subset of {INDEX_DTYPES}, got {self.index_dtypes!r}")
        object.__setattr__(self, "index_dtypes", tuple(dict.fromkeys(dtypes)))
        cfg = self.config
        if cfg is None or isinstance(cfg, Mapping):
            try:
                cfg = MoKConfig(**dict(cfg or {}))
            except TypeError as e:
                raise ValueError(f"config: {e}") from None
        if not isinstance(cfg, MoKConfig):
            raise TypeError(f"config must be a MoKConfig, a dict of its fields or None, got {type(cfg).__name__}")
        object.__setattr__(self, "config", cfg)
        self.swiglu()  # validates limit, alpha, up offset

    def swiglu(self):
        """The experts' activation (:class:`~mok_cute.reference.SwiGLU`)."""
        from mok_cute.reference import SwiGLU

        return SwiGLU(self.limit, self.swiglu_alpha, self.swiglu_up_offset)

    def layer_config(self, arch: str):
        """The MoKConfig the layer call runs under for ``arch``: ``config`` with the arch's backend and
        ``precision`` (routing values are never read here: ``validate_routing`` off, which changes no kernel)."""
        prec = self.precision or self.config.precision
        return replace(self.config, precision=prec, backend=_BACKEND[arch], validate_routing=False)

    def describe(self) -> str:
        """``qwen3-30b-a3b: T16384 H2048 I768 E128 k8 bf16 fwd+bwd`` and the options given."""
        extra = [f"+shared{self.shared}"] if self.shared else []
        extra += [f"L{self.limit:g}"] if self.limit is not None else []
        extra += [f"alpha{self.swiglu_alpha:g} up{self.swiglu_up_offset:g}"] if not self.swiglu().plain else []
        extra += ["shared_gate"] * self.shared_gate + ["main_grads"] * self.main_grads + ["biases"] * self.biases
        dims = " ".join([f"T{self.tokens} H{self.hidden} I{self.inter} E{self.experts} k{self.topk}", *extra])
        prec = self.precision or self.config.precision
        return f"{self.name + ': ' if self.name else ''}{dims} {prec} {'fwd+bwd' if self.backward else 'fwd'}"


@dataclass(frozen=True)
class Target:
    """What the kernels are compiled for: ``arch``, and the GPU identity tuning entries are looked up by
    (``gpu`` name, ``sms``; None: no tuned entry applies)."""

    arch: str
    gpu: str | None = None
    sms: int | None = None


@dataclass
class Kernel:
    """One kernel (one ``compile_cached`` key) and what became of it: ``status`` "compiled", "cached"
    (loaded from the disk cache: already there), "not kept" (its key cannot persist: compiled in every
    process), "failed", or "listed" (``dry_run``); ``compile_kernel`` calls ``compiles`` (entries written or
    found ``hits``); ``problems`` the indices of the problems that need it."""

    label: str
    key: str
    problems: list[int]
    status: str = "listed"
    seconds: float = 0.0
    compiles: int = 0
    hits: int = 0
    error: str = ""


@dataclass
class Summary:
    """What :func:`precompile` did: the target, the cache directory, each kernel, the problems, the wall time."""

    target: Target
    directory: str | None
    kernels: list[Kernel]
    problems: list[str]
    jobs: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(k.status == status for k in self.kernels)

    @property
    def compiled(self) -> int:
        return self.count("compiled")

    @property
    def cached(self) -> int:
        return self.count("cached")

    @property
    def failed(self) -> int:
        return self.count("failed")

    def as_dict(self) -> dict:
        return {"target": asdict(self.target), "directory": self.directory, "problems": self.problems,
                "jobs": self.jobs, "seconds": round(self.seconds, 2), "compiled": self.compiled,
                "cached": self.cached, "failed": self.failed, "not_kept": self.count("not kept"),
                "notes": self.notes, "kernels": [asdict(k) for k in self.kernels]}

    def table(self, verbose: bool = False) -> str:
        """The summary as lines of text (``verbose``: one line per kernel too; failures always)."""
        lines = [f"  {p}" for p in self.problems]
        for k in self.kernels:
            if k.status == "listed":
                lines.append(f"  {k.label}  {k.key}")
            elif verbose or k.status in ("failed", "not kept"):
                lines.append(f"{k.status:>9}  {k.seconds:6.1f} s  {k.label}  {k.key}")
                if k.error:
                    lines += [f"           {line}" for line in k.error.rstrip().splitlines()[-6:]]
        lines += [f"note: {n}" for n in self.notes]
        listed = self.count("listed")
        if listed:
            lines.append(f"{listed} kernels for {self.target.arch} (listed, nothing compiled)")
        else:
            not_kept = self.count("not kept")
            lines.append(f"{len(self.kernels)} kernels for {self.target.arch}: {self.compiled} compiled, {self.cached} "
                         f"already cached, {self.failed} failed" + (f", {not_kept} not kept on disk" if not_kept else "")
                         + f" in {self.seconds:.1f} s ({self.jobs} processes) into {self.directory}")
        return "\n".join(lines)


# ---------------------------------------------------------------- the fake device (worker processes only)
_NO_ADDRESS = " at 0x"  # a key whose repr holds a memory address cannot persist (disk_cache)
_state = threading.local()
_worker: dict = {}  # the installed patches' state in a worker process: target, on_key, real compile_cached


class _Stand:
    """What ``compile_cached`` hands the layer's host code instead of a compiled kernel: calling it,
    launching it (GraphLauncher's methods) does nothing; unpacked or indexed it is ``(itself, None)`` (the
    builds that return ``(compiled, CompileReport)``)."""

    compiled = None

    def __init__(self):
        pass

    def __call__(self, *args, **kwargs):
        return None

    def launch(self, *args, **kwargs):
        return None

    launch_direct = launch_tensors = launch

    def __iter__(self):
        return iter((self, None))

    def __getitem__(self, i):
        return (self, None)[i]


def _stand_class():
    """:class:`_Stand` as a GraphLauncher (the host code may check the type)."""
    from mok_cute.dsl.launch import GraphLauncher

    return type("StandIn", (_Stand, GraphLauncher), {})


class _Props:
    """``torch.cuda.get_device_properties``' fields the layer reads, for the target."""

    def __init__(self, target: Target):
        self.name = target.gpu or "unknown GPU (mok_cute.precompile)"  # matches no tuning entry
        self.multi_processor_count = target.sms or _SMS[target.arch]  # a launch argument only (and grid_ctas' bound)
        self.major, self.minor = {"sm_90a": (9, 0), "sm_100a": (10, 0), "sm_103a": (10, 3)}[target.arch]


class _Stream:
    cuda_stream = 0


class _NoDevice(contextlib.nullcontext):
    """``torch.cuda.device(d)``: nothing to switch."""

    def __init__(self, device=None):
        super().__init__()


def _fake_mode():
    """A TorchFunctionMode over the fake tensors: indexing computed on meta twins (the C++ indexing path
    wants a CUDA device guard), writes through ``[]`` dropped (no values exist), ``data_ptr`` a distinct,
    aligned fake address per storage (nothing reads it but alignment checks and launch keys), and an op
    refused for want of a CUDA device retried as its aten op (no device guard there)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    bases: dict[int, int] = {}

    def meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device="meta")

    def index(v):
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            raise NotImplementedError("mok_cute.precompile: indexing by a boolean mask reads values, which fake "
                                      "tensors do not have")
        return meta(v)

    def address(t) -> int:
        s = t.untyped_storage()
        if s._cdata not in bases:  # 16 GiB apart: no two storages overlap
            bases[s._cdata] = (1 << 40) + (len(bases) << 34)
        return bases[s._cdata] + t.storage_offset() * t.element_size()

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.__getitem__:
                t, idx = args
                m = meta(t)
                r = m[tree_map(index, idx)]
                if r._base is m:  # a view: the same view of the fake tensor
                    return t.as_strided(r.size(), r.stride(), t.storage_offset() + r.storage_offset())
                return torch.empty_strided(r.size(), r.stride(), dtype=r.dtype, device=t.device)
            if func is torch.Tensor.__setitem__:
                return None
            if func is torch.Tensor.data_ptr:
                return address(args[0])
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:  # e.g. "not linked with support for cuda devices": a Python binding's guard
                op = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
                if op is None:
                    raise
                try:
                    return op(*args, **kwargs)
                except Exception:  # noqa: BLE001 (the first error is the one to report)
                    raise e from None
    return Mode()


def _install(target: Target) -> None:
    """Make this (worker) process's device queries answer for ``target`` and route ``compile_cached``
    through :func:`_compile_cached`: every ``mok_cute`` module's binding of each function replaced, the
    defining modules' too (so modules imported later and function-level imports bind the stand-ins), and
    the torch.cuda calls the host code makes. For the life of the process (workers are made for this)."""
    _worker["target"] = target
    if _worker.get("installed"):
        return
    import torch

    from mok_cute import custom_ops  # noqa: F401 (the layer's modules, imported before the sweep below)
    from mok_cute.dsl import compile as kc
    from mok_cute.dsl import deferred, host, tensors
    from mok_cute.layers import select  # noqa: F401 (every backend and kernel module it imports)

    _worker["real"] = kc.compile_cached
    _worker["stand"] = _stand_class()
    arch = lambda: _worker["target"].arch  # noqa: E731
    swaps = {
        kc.compile_cached: _compile_cached,
        kc.device_arch: lambda device: (0, arch()),
        kc.arch_of_device: lambda device=None: arch(),
        host.sm_count: lambda device: _Props(_worker["target"]).multi_processor_count,
        host.device_props: lambda device: _Props(_worker["target"]),
        host.current_stream: lambda device=None: host.fake_stream(),
        tensors._cute_tensor: lambda t, align=16: None,  # a launch argument only (nothing launches)
        deferred.watch: lambda *args, **kwargs: None,  # no device words to read back
    }
    by_id = {id(f): swap for f, swap in swaps.items()}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "mok_cute" or name.startswith("mok_cute.")):
            continue
        for attr, value in list(vars(module).items()):
            swap = by_id.get(id(value))
            if swap is not None:
                setattr(module, attr, swap)
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.cuda.device = _NoDevice
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    _worker["installed"] = True


def _compile_cached(key, build):
    """The stand-in ``compile_cached``: inside a real build (nested keys) the real one; else the pass's
    ``on_key(key, build)``."""
    if getattr(_state, "building", 0):
        return _worker["real"](key, build)
    return _worker["on_key"](key, build)


def _run_layer(problem: Problem, target: Target, on_key) -> None:
    """One pass of ``problem``'s layer call (forward, then the backward) on fake tensors for ``target``,
    ``on_key(key, build)`` called at each ``compile_cached``; once per ``topk_idx`` dtype."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mok_cute import custom_ops, validate

    _install(target)
    _worker["on_key"] = on_key
    p, cfg, act = problem, problem.layer_config(target.arch), problem.swiglu()
    for dtype in p.index_dtypes:
        with FakeTensorMode(allow_non_fake_inputs=True), _fake_mode():
            def empty(*shape, dtype=torch.bfloat16):
                return torch.empty(*shape, dtype=dtype, device="cuda")

            x, topk_w = empty(p.tokens, p.hidden), empty(p.tokens, p.topk, dtype=torch.float32)
            topk_idx = empty(p.tokens, p.topk, dtype=getattr(torch, dtype))
            weights = [empty(p.experts, p.inter, p.hidden), empty(p.experts, p.inter, p.hidden),
                       empty(p.experts, p.hidden, p.inter)]
            shared = None
            if p.shared:
                shared = (empty(p.shared, p.hidden), empty(p.shared, p.hidden), empty(p.hidden, p.shared))
                weights += list(shared)
            gate = empty(1, p.hidden) if p.shared_gate else None
            weights += [gate] if gate is not None else []
            biases = (empty(p.experts, p.inter), empty(p.experts, p.inter), empty(p.experts, p.hidden)) if p.biases \
                else None
            validate.check_moe_inputs(x, topk_idx, topk_w, *weights[:3], shared, act, 1, check_values=False)
            validate.check_shared_gate(gate, shared, x)
            validate.check_expert_biases(biases, weights[0], weights[2])
            weights += list(biases or ())
            main_grads = [empty(*w.shape, dtype=torch.float32) for w in weights] if p.main_grads else None
            if main_grads is not None:
                validate.check_main_grads(main_grads, weights, biased=p.biases)
            inp = custom_ops.layer_inputs(x, topk_idx, topk_w, weights, act, main_grads, p.biases)
            _, entry = custom_ops.run_forward(inp, cfg, None, p.backward)
            if p.backward:
                custom_ops.run_backward(entry, empty(p.tokens, p.hidden), weights, main_grads, p.biases)


def _label(key) -> str:
    return str(key[0]) if isinstance(key, tuple) and key and isinstance(key[0], str) else type(key).__name__


def _worker_init(cache_dir: str | None) -> None:
    if cache_dir is not None:
        os.environ["MOK_CUTE_CACHE_DIR"] = cache_dir


def _enumerate(problems: list[Problem], target: Target) -> list[tuple[str, str, list[int]]]:
    """(label, key repr, problem indices) of every distinct key the problems' layer calls reach, in
    first-use order (a worker task)."""
    found: dict[str, tuple[str, list[int]]] = {}
    for i, p in enumerate(problems):
        def on_key(key, build, i=i):
            label, users = found.setdefault(repr(key), (_label(key), []))
            if i not in users:
                users.append(i)
            return _worker["stand"]()
        try:
            _run_layer(p, target, on_key)
        except Exception as e:  # noqa: BLE001 (re-raised as a plain exception: it crosses processes)
            for kind in (ValueError, TypeError, NotImplementedError):  # the layer's refusals
                if isinstance(e, kind):
                    raise kind(f"{p.describe()}: {e}") from None
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if f"{os.sep}mok_cute{os.sep}" in f.filename and not f.filename.endswith("precompile.py")]
            where = ", ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:])
            raise RuntimeError(f"{p.describe()}: the layer call's host code did not run on fake tensors "
                               f"({type(e).__name__}: {e}; at {where or '?'})") from None
    return [(label, key, users) for key, (label, users) in found.items()]


def _compile(problem: Problem, target: Target, key: str) -> dict:
    """Compile (or find in the disk cache) the kernel of ``key`` (a repr) that ``problem``'s layer call
    reaches (a worker task): the pass runs up to that ``compile_cached`` call, then the real
    ``compile_cached(key, build)`` runs outside the fake tensor modes (a build sees no fake tensor).
    Returns ``{"status", "seconds", "compiles", "hits", "error"}``."""
    from mok_cute.dsl import compile as kc
    from mok_cute.dsl import disk_cache

    out = {"status": "failed", "seconds": 0.0, "compiles": 0, "hits": 0, "error": ""}
    reached = []

    def on_key(k, build):
        if repr(k) == key:
            reached.append((k, build))
            raise _Done
        return _worker["stand"]()
    try:
        _run_layer(problem, target, on_key)
    except _Done:
        pass
    except Exception:  # noqa: BLE001 (reported per kernel; the others go on)
        out["error"] = traceback.format_exc(limit=-8)
        return out
    if not reached:
        out["error"] = "the layer call did not reach this key again (a key that differs between processes?)"
        return out
    before, t0 = (kc.cache_stats(), disk_cache.stats()), time.perf_counter()
    _state.building = getattr(_state, "building", 0) + 1
    try:
        _worker["real"](*reached[0])
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc(limit=-8)
        return out
    finally:
        _state.building -= 1
        out["seconds"] = time.perf_counter() - t0
    after = (kc.cache_stats(), disk_cache.stats())
    out["compiles"] = after[0]["kernel_compiles"] - before[0]["kernel_compiles"]
    out["hits"] = after[1]["hits"] - before[1]["hits"]
    unkeyed = after[1]["unkeyed"] - before[1]["unkeyed"]
    out["status"] = "not kept" if unkeyed else "compiled" if out["compiles"] else "cached"
    return out


class _Done(BaseException):
    """Ends a compile task's pass at its kernel's ``compile_cached`` call (not an Exception: no handler in
    the host code on the way out catches it)."""


# ---------------------------------------------------------------- the driver
def default_target(arch: str | None = None, gpu: str | None = None, sms: int | None = None) -> Target:
    """The :class:`Target`: ``arch`` (default: the present GPU's; ValueError without one), and the tuning
    identity ``gpu`` / ``sms`` (default: the present GPU's when its arch is ``arch``)."""
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if (gpu is None) != (sms is None):
        raise ValueError("give the tuning identity whole: both gpu (the device name) and sms (its SM count), or neither")
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise ValueError(f"sms must be a positive int, got {sms!r}")
    present = None
    if arch is None or gpu is None:
        import torch

        if torch.cuda.is_available():
            from mok_cute.dsl.compile import arch_of_device

            props = torch.cuda.get_device_properties(0)
            present = (arch_of_device(0), props.name, props.multi_processor_count)
    if arch is None:
        if present is None:
            raise ValueError(f"no CUDA GPU here: give the target arch ({', '.join(ARCHS)})")
        arch = present[0]
    if gpu is None and present is not None and present[0] == arch:
        gpu, sms = present[1], present[2]
    return Target(arch, gpu, sms)


def precompile(problems, *, arch: str | None = None, jobs: int | None = None, gpu: str | None = None,
               sms: int | None = None, cache_dir: str | None = None, progress: bool = True,
               dry_run: bool = False) -> Summary:
    """Compile every kernel the layer calls ``problems`` (a :class:`Problem` or a list of them) need into the
    disk cache for ``arch`` (default: the present GPU's), in ``jobs`` worker processes (default: one per
    CPU, at most one per kernel), with a tqdm bar on stderr (``progress``); ``gpu`` / ``sms``: the GPU
    identity tuning entries are matched by (default: the present GPU's when its arch is ``arch``);
    ``cache_dir``: this cache directory instead of ``MOK_CUTE_CACHE_DIR``'s; ``dry_run``: find the kernels,
    compile nothing. Returns the :class:`Summary`. ValueError (before anything is compiled) for bad
    arguments, a disk cache that is off, or a layer call the backend refuses."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from mok_cute.dsl import env

    problems = [problems] if isinstance(problems, Problem) else list(problems)
    if not problems or not all(isinstance(p, Problem) for p in problems):
        raise TypeError("problems must be a Problem or a non-empty list of them")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    target = default_target(arch, gpu, sms)
    if cache_dir is not None:
        cache_dir = os.path.abspath(os.path.expanduser(str(cache_dir)))
    directory = cache_dir or env.cache_dir()
    if directory is None and not dry_run:
        raise ValueError(f"{env.CACHE_DIR} is off: there is no disk cache to compile into (unset it, or give a "
                         "directory)")
    notes = [] if target.gpu is not None else [
        "no GPU identity (--gpu / --sms): tuning-file entries are not applied, the kernels are those of the "
        "untuned policies"]
    t0 = time.perf_counter()
    cpus = os.cpu_count() or 1
    pool = ProcessPoolExecutor(max_workers=jobs or cpus, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(cache_dir,))
    try:
        try:
            found = pool.submit(_enumerate, problems, target).result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"mok_cute.precompile: the worker process finding the kernels died ({e}); a script "
                               "calling precompile() needs an `if __name__ == \"__main__\":` guard (spawned "
                               "workers import it)") from None
        kernels = [Kernel(label, key, users) for label, key, users in found]
        summary = Summary(target, directory, kernels, [p.describe() for p in problems],
                          min(jobs or cpus, max(1, len(kernels))), 0.0, notes)
        if not dry_run:
            _run_compiles(pool, problems, target, kernels, progress)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C: no new compiles (running ones finish)
        raise
    pool.shutdown()
    summary.seconds = time.perf_counter() - t0
    return summary


def _run_compiles(pool, problems, target, kernels: list[Kernel], progress: bool) -> None:
    """Submit one compile task per kernel (the fused kernels, the longest, first) and fill in the results
    as they come, under a tqdm bar."""
    from concurrent.futures import as_completed

    from tqdm import tqdm

    todo = []
    for k in kernels:
        if _NO_ADDRESS in k.key:
            k.status, k.error = "not kept", "its key holds a memory address: compiled in every process"
        else:
            todo.append(k)
    todo.sort(key=lambda k: "fused" not in k.label)
    futures = {pool.submit(_compile, problems[k.problems[0]], target, k.key): k for k in todo}
    with tqdm(total=len(kernels), initial=len(kernels) - len(todo), disable=not progress, file=sys.stderr,
              unit="kernel", desc=f"mok_cute.precompile {target.arch}") as bar:
        for fut in as_completed(futures):
            k = futures[fut]
            try:
                got = fut.result()
            except Exception as e:  # noqa: BLE001 (a worker that died: that kernel failed)
                got = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            k.status, k.error = got["status"], got.get("error", "")
            k.seconds, k.compiles, k.hits = got.get("seconds", 0.0), got.get("compiles", 0), got.get("hits", 0)
            bar.update(1)
            bar.set_postfix(compiled=sum(x.status == "compiled" for x in kernels),
                            cached=sum(x.status == "cached" for x in kernels),
                            failed=sum(x.status == "failed" for x in kernels))


# ---------------------------------------------------------------- the command line
def parser() -> argparse.ArgumentParser:
    from mok_cute.bench.shapes import add_size_args
    from mok_cute.config import PRECISIONS

    ap = argparse.ArgumentParser(
        prog="python -m mok_cute.precompile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Compile every kernel a layer shape's training step needs (forward and backward, EP = 1) into the disk "
            "cache (MOK_CUTE_CACHE_DIR), in parallel processes, so that a later run loads them instead of compiling "
            "them. No GPU needed with --arch; run it on the GPU node or a machine with the same CPU type, checkout "
            "and environment (pydoc mok_cute.precompile: what is covered, what must match).", 100),
        epilog="examples:\n"
               "  python -m mok_cute.precompile --hidden 2048 --inter 768 --experts 128 --topk 8 --tokens 16384\n"
               "  python -m mok_cute.precompile --shape qwen3-30b-a3b gpt-oss-20b --precision bf16 mxfp8 --jobs 8\n"
               "  python -m mok_cute.precompile --shape deepseek-v3-ep8 --arch sm_100a --list")
    add_size_args(ap, "E, the routed experts (per rank)",
                  "T, tokens per layer call (with --shape: instead of each shape's own; changes no kernel, only "
                  "which tuning entry applies)", "each with its own shared expert and clamp")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size: only 1 is covered (the module doc)")
    ap.add_argument("--precision", nargs="+", default=None, choices=PRECISIONS,
                    help="the precisions to compile for (default: --config's, else bf16)")
    ap.add_argument("--limit", type=float, default=None, help="the SwiGLU clamp (default: none; a shape's own)")
    ap.add_argument("--swiglu-alpha", type=float, default=1.0, help="the SwiGLU's alpha (gpt-oss: 1.702; default 1)")
    ap.add_argument("--swiglu-up-offset", type=float, default=0.0, help="the SwiGLU's up offset (gpt-oss: 1; default 0)")
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                    help="the training step's kernels (default) or, with --no-backward, the forward's alone")
    ap.add_argument("--shared-gate", action="store_true", help="with the shared expert's output gate")
    ap.add_argument("--main-grads", action="store_true", help="with main_grads (fp32 weight-gradient accumulation)")
    ap.add_argument("--biases", action="store_true", help="with the routed experts' biases (gpt-oss; bf16)")
    ap.add_argument("--index-dtype", choices=(*INDEX_DTYPES, "both"), default="both",
                    help="topk_idx's dtype (MoELayer's router: int64; default both)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a MoKConfig field of the training run, e.g. forward_path=unfused or "
                         "'policy={\"fused_forward\": {\"tile_n\": 128}}' (repeatable)")
    ap.add_argument("--arch", choices=ARCHS, default=None, help="the target arch (default: the present GPU's)")
    ap.add_argument("--gpu", default=None, metavar="NAME",
                    help="the GPU name tuning entries are matched by, e.g. 'NVIDIA H200' (with --sms; default: the "
                         "present GPU's when its arch is --arch)")
    ap.add_argument("--sms", type=int, default=None, help="that GPU's SM count (with --gpu)")
    ap.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                    help="parallel compile processes (default: the CPU count, at most one per kernel)")
    ap.add_argument("--dir", default=None, help="this cache directory instead of MOK_CUTE_CACHE_DIR's")
    ap.add_argument("--list", action="store_true", help="list the kernels, compile nothing")
    ap.add_argument("--verbose", "-v", action="store_true", help="one line per kernel")
    ap.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


_OWN_FIELDS = {"precision": "--precision", "backend": "--arch"}


def parse_config(items: list[str]) -> dict:
    """``["FIELD=VALUE", ...]`` as MoKConfig fields (``python -m mok_cute.bench --config``'s rules, precision and
    backend set by --precision / --arch here)."""
    from mok_cute.bench.cli import parse_config as bench_config

    return bench_config(items, _OWN_FIELDS)


def problems_of(args) -> list[Problem]:
    """The :class:`Problem` of each shape and precision the parsed command line asks for (ValueError for a bad one)."""
    from mok_cute.bench.shapes import pick

    config = parse_config(args.config)
    precisions = args.precision or [config.get("precision") or "bf16"]
    common = dict(ep=args.ep, swiglu_alpha=args.swiglu_alpha, swiglu_up_offset=args.swiglu_up_offset,
                  backward=args.backward, shared_gate=args.shared_gate, main_grads=args.main_grads, biases=args.biases,
                  index_dtypes=INDEX_DTYPES if args.index_dtype == "both" else (args.index_dtype,), config=config)
    if args.shape is None:
        shapes = [(args.tokens, args.hidden, args.inter, args.experts, args.topk, args.shared, args.limit, "")]
    else:
        shapes = [(s.t, s.h, s.i, s.e, s.k, s.shared_i, s.limit if args.limit is None else args.limit, s.name)
                  for s in pick(args.shape, args.tokens)]
    return [Problem(t, h, i, e, k, sh, precision=p, limit=lim, name=name, **common)
            for t, h, i, e, k, sh, lim, name in shapes for p in precisions]


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    dims = ("hidden", "inter", "experts", "topk")
    if args.shape is None and any(getattr(args, d) is None for d in (*dims, "tokens")):
        ap.error("give --hidden, --inter, --experts, --topk and --tokens, or --shape NAME ...")
    if args.shape is not None and (any(getattr(args, d) is not None for d in dims) or args.shared):
        ap.error("give either --shape or the sizes (--hidden, --inter, --experts, --topk, --shared), not both")
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        problems = problems_of(args)
        target = default_target(args.arch, args.gpu, args.sms)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    try:
        summary = precompile(problems, arch=target.arch, jobs=args.jobs, gpu=target.gpu, sms=target.sms,
                             cache_dir=args.dir, progress=not args.no_progress, dry_run=args.list)
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        print(f"mok_cute.precompile: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(summary.as_dict(), indent=1))
    else:
        print(summary.table(verbose=args.verbose or args.list))
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())

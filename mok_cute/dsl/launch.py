"""Lean host launches of compiled CuTe DSL kernels: a captured single-kernel CUDA graph per
distinct argument set.

The DSL's call path (argument marshalling in Python, then the JIT host function, which
encodes the TMA descriptors and calls ``cudaLaunchKernelEx``) cost ~30 us of
``cudaLaunchKernelExC`` plus tens of us of Python per launch on the H200 host. Everything
the kernel receives is a pure function of the host arguments (pointers, shapes, strides,
scalars, grid size), so :class:`GraphLauncher` captures the DSL launch once per distinct
argument set into a one-node CUDA graph (on a private side stream, nothing runs) and from
then on replays that graph with one ``cuGraphLaunch`` on the caller's stream: same kernel,
same parameter bytes, hence bitwise the same results. The key is built from the tensors'
``(data_ptr, shape, stride)`` and the scalars, so a training step whose buffers come back
at the same addresses (the caching allocator's steady state) only replays graphs.

Fallbacks (always correct, only slower): the first launch of a kernel on a device goes
through the DSL (module load), so does every launch while the caller's stream is being
captured (a graph of the whole step is built by the user; host cost does not matter
there), and ``MOK_CUTE_LAUNCH=dsl`` (:func:`mok_cute.dsl.env.launch_mode`, read at import)
turns the graph path off. A failed capture turns it off for the process (with a warning) and
launches through the DSL.
"""
from __future__ import annotations

import ctypes
import struct
import threading
import warnings
from collections import OrderedDict

import torch

import cuda.bindings.driver as cuda

from mok_cute.dsl import env

_MAX_GRAPHS = 512  # per kernel variant (LRU); each exec is a few KB of host/driver memory
_enabled = env.launch_mode() != "dsl"  # read once, at import
_side: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
_stats = {"graph": 0, "capture": 0, "dsl": 0}


def stats() -> dict[str, int]:
    """Launch counts by path: graph replays, captures (first use of an argument set), DSL."""
    return dict(_stats)


def _check(res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if err != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def _side_stream(dev: int) -> torch.cuda.Stream:
    s = _side.get(dev)
    if s is None:
        s = _side[dev] = torch.cuda.Stream(device=dev)  # pool streams are non-blocking
    return s


def tensor_key(t: torch.Tensor) -> tuple:
    """What a kernel tensor argument contributes to its parameters."""
    return (t.data_ptr(), t.shape, t.stride())


class GraphLauncher:
    """Launch one compiled kernel: ``launch(dev, stream, key, make_args)`` where ``key`` is
    hashable and determines every byte of the kernel's parameters, and ``make_args(stream)``
    returns the compiled function's argument tuple for a ``cuda.CUstream``."""

    def __init__(self, compiled):
        self.compiled = compiled
        self._graphs: OrderedDict = OrderedDict()
        self._loaded: set[int] = set()

    def _dsl(self, make_args, stream: int):
        _stats["dsl"] += 1
        self.compiled(*make_args(cuda.CUstream(stream)))

    def _capture(self, dev: int, make_args):
        side = cuda.CUstream(_side_stream(dev).cuda_stream)
        _check(cuda.cuStreamBeginCapture(side, cuda.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        try:
            self.compiled(*make_args(side))
        finally:
            graph = _check(cuda.cuStreamEndCapture(side), "cuStreamEndCapture")
        try:
            return _check(cuda.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            cuda.cuGraphDestroy(graph)

    def launch_direct(self, stream: int, make_args) -> None:
        """Launch through the DSL call path (for arguments that change every call, e.g. epochs)."""
        self._dsl(make_args, stream)

    def launch_tensors(self, dev: int, tensors: tuple, scalars: tuple, key_scalars: tuple, absent: tuple,
                       direct: tuple | None = None) -> None:
        """Launch on the current stream with ``tensors`` (torch tensors or None) then ``scalars`` (DSL
        values; ``key_scalars`` their Python values): a graph replay keyed by both, the kernel's
        trailing parameters ``absent`` (their stand-ins: None, zeros); or, with ``direct`` (trailing
        arguments that change every call, e.g. :meth:`CommWorkspace.kernel_args`), through the DSL."""
        stream = torch._C._cuda_getCurrentRawStream(dev)

        def args(tail):
            return lambda st: (*(None if a is None else _Desc(a) for a in tensors), *scalars, *tail, st)
        if direct is None:
            key = tuple(None if a is None else tensor_key(a) for a in tensors) + tuple(key_scalars)
            self.launch(dev, stream, key, args(absent))
        else:
            self.launch_direct(stream, args(direct))

    def launch(self, dev: int, stream: int, key, make_args) -> None:
        global _enabled
        if not _enabled or dev not in self._loaded or torch.cuda.is_current_stream_capturing():
            self._dsl(make_args, stream)
            self._loaded.add(dev)
            return
        key = (dev, key)
        gexec = self._graphs.get(key)
        if gexec is None:
            try:
                with _lock:
                    gexec = self._capture(dev, make_args)
            except Exception as exc:  # noqa: BLE001 (any failure: fall back for good)
                _enabled = False
                warnings.warn(f"mok_cute: CUDA-graph launch path disabled ({exc!r}); launching through the DSL",
                              stacklevel=3)
                self._dsl(make_args, stream)
                return
            _stats["capture"] += 1
            self._graphs[key] = gexec
            if len(self._graphs) > _MAX_GRAPHS:
                _, old = self._graphs.popitem(last=False)
                cuda.cuGraphExecDestroy(old)
        else:
            self._graphs.move_to_end(key)
        _stats["graph"] += 1
        _check(cuda.cuGraphLaunch(gexec, cuda.CUstream(stream)), "cuGraphLaunch")


class _Desc:
    """Fast host-side kernel argument for a torch tensor: the ``{data, i32 shapes[n], i64
    strides[n-1]}`` memref descriptor that :func:`_cute_tensor` builds (every shape mode
    dynamic, last stride static 1), packed directly (tests check the bytes are equal).
    The compiled function reads it through ``__c_pointers__``; the tensor is kept alive."""

    __slots__ = ("_buf", "_keep")

    def __init__(self, t: torch.Tensor):
        n = t.dim()
        if t.stride(-1) != 1:
            raise ValueError(f"kernel tensor arguments need a unit last stride, got strides {t.stride()}")
        pad = (0,) if n % 2 else ()  # the i64 strides start 8-byte aligned
        fmt = "<Q" + "i" * (n + len(pad)) + "q" * (n - 1)
        self._buf = ctypes.create_string_buffer(struct.pack(fmt, t.data_ptr(), *t.shape, *pad, *t.stride()[:-1]))
        self._keep = t

    def __c_pointers__(self):
        return [ctypes.addressof(self._buf)]

    def raw(self) -> bytes:
        return self._buf.raw[:len(self._buf.raw) - 1]  # create_string_buffer adds a NUL

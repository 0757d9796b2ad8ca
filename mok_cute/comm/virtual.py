"""Virtual expert-parallel ranks: R ranks of one process on one device, to run the EP > 1 path
(plan, dispatch, expert MLP, combine, backward) at EP = 2, 4, ... on a single GPU.

A :class:`VirtualGroup` stands in for a torch.distributed group wherever mok_cute takes one
(``mok_cute.moe(..., group=)``, the reference backend, :func:`mok_cute.comm.workspace.get_workspace`).
Each rank's host code runs in its own thread (:func:`run_ranks`) on its own CUDA stream; one
rank's device-side waits are satisfied by the other ranks' kernels running concurrently on
theirs. The comm kernels are the symmetric-memory ones, unchanged: rank r's workspace is a
plain device allocation and every rank's ``peer_bases`` table holds the addresses of all R
(:meth:`~mok_cute.comm.workspace.CommWorkspace.virtual`), so peers are reached by unicast
loads and stores as on symmetric memory. Host collectives (the reference backend's):
:meth:`VirtualGroup.all_gather`, :meth:`VirtualGroup.barrier`.

What concurrent ranks on one GPU need from the caller:

* every kernel that waits for a peer must be co-resident with the peers' kernels: R x the comm
  CTAs (``MoKConfig.comm_sms_fwd`` / ``comm_sms_bwd``) well below the SM count;
* no rank may compile or first load a kernel while a peer's comm kernel waits for it: compile and
  launch every kernel once beforehand (e.g. one step on a 1-rank group), and prefer
  ``CUDA_MODULE_LOADING=EAGER`` (a lazy kernel load may synchronize the context);
* no device-wide synchronization inside a rank thread (``torch.cuda.synchronize``), stream
  synchronization only (tools/checks/layer_ep_virtual also launches the GEMMs through the DSL,
  ``MOK_CUTE_LAUNCH=dsl``, so that no CUDA graph is captured or instantiated while peers wait).

Rank r of every group on a device runs on stream r of one set of non-blocking streams per device,
created consecutively and kept for the life of the process. Work of streams that share a hardware
queue (``CUDA_DEVICE_MAX_CONNECTIONS`` of them, default 8) starts in submission order, so a comm
kernel waiting for a peer could hold back the peer's kernel queued behind it; consecutive streams
are assumed to get distinct queues (the driver's assignment is not documented), and the device
check raises the queue count to 32. Every device wait is bounded by the workspace timeout and
every host collective by ``timeout_s``: a stalled rank makes the others raise RuntimeError.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

import torch

Out = TypeVar("Out")
_cuda_lock = threading.Lock()
_contexts: dict[int, object] = {}  # device index -> its primary context (retained once)
_streams: dict[int, list] = {}  # device index -> the rank streams, in creation order


def _driver(result, what: str):
    """The value of a ``cuda.bindings.driver`` call's result tuple; RuntimeError on an error."""
    import cuda.bindings.driver as cu  # noqa: PLC0415 (CUDA groups only)

    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"mok_cute virtual ranks: {what} failed: {result[0]}")
    return result[1] if len(result) > 1 else None


def _primary_context(index: int):
    """The primary context of device ``index`` (the one torch uses); call under ``_cuda_lock``."""
    import cuda.bindings.driver as cu  # noqa: PLC0415

    if index not in _contexts:
        dev = _driver(cu.cuDeviceGet(index), "cuDeviceGet")
        _contexts[index] = _driver(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return _contexts[index]


def _rank_streams(device: torch.device, n: int) -> list:
    """Streams 0..n-1 of ``device`` (non-blocking; the missing ones created now, consecutively)."""
    import cuda.bindings.driver as cu  # noqa: PLC0415

    with _cuda_lock:
        have = _streams.setdefault(device.index, [])
        if len(have) < n:
            _driver(cu.cuCtxPushCurrent(_primary_context(device.index)), "cuCtxPushCurrent")
            try:
                while len(have) < n:
                    s = _driver(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
                    have.append(torch.cuda.ExternalStream(int(s), device=device))
            finally:
                _driver(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
        return have[:n]


def _bind(device: torch.device) -> None:
    """Make ``device`` current in this thread for torch and for the driver API (the DSL's launches
    and the CUDA-graph calls of :mod:`mok_cute.dsl.launch` use the thread's current context)."""
    import cuda.bindings.driver as cu  # noqa: PLC0415

    torch.cuda.set_device(device)
    with _cuda_lock:
        ctx = _primary_context(device.index)
    _driver(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class VirtualGroup:
    """``size`` virtual ranks in this process on ``device`` (default: the current CUDA device, or
    the CPU without one). ``size()`` is the number of ranks, ``rank()`` the calling thread's rank
    (only inside :func:`run_ranks`). ``timeout_s`` bounds every host collective. ``streams[r]``
    is rank r's stream (CUDA groups). Objects shared by the ranks (their workspaces) are built once
    per key and kept for the group's lifetime (:meth:`cached`)."""

    def __init__(self, size: int, device=None, timeout_s: float = 60.0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.init()  # the driver is up before the driver-API calls of _rank_streams
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self._size, self.device, self.timeout_s = size, device, float(timeout_s)
        self.streams = _rank_streams(device, size) if device.type == "cuda" else None
        self._tls = threading.local()
        self._barrier = threading.Barrier(size, timeout=self.timeout_s)
        self._slots: list = [None] * size
        self._cache: dict = {}
        self._cache_lock = threading.Lock()
        self._running = threading.Lock()

    def __repr__(self) -> str:
        return f"VirtualGroup(size={self._size}, device={self.device})"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        """The calling thread's rank; RuntimeError outside :func:`run_ranks`."""
        r = getattr(self._tls, "rank", None)
        if r is None:
            raise RuntimeError(f"{self!r}: rank() called outside a rank thread (run the layer "
                               "inside mok_cute.comm.virtual.run_ranks)")
        return r

    def barrier(self) -> None:
        """Wait until every rank arrives; RuntimeError after ``timeout_s`` or once a rank failed."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"{self!r}: rank {self.rank()} left a collective: a rank did not arrive "
                               f"within {self.timeout_s:g} s, or failed") from None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` in rank order (first dims may differ), copied on this rank's current
        stream. Collective: every rank calls it, in the same order. CUDA tensors: each rank's
        stream is synchronized before its tensor is handed over and after its copies, so no rank
        reads a tensor that is still being written, or freed."""
        r = self.rank()
        sync = torch.cuda.current_stream(t.device).synchronize if t.is_cuda else (lambda: None)
        sync()
        self._slots[r] = t
        self.barrier()
        out = [s.clone() for s in self._slots]
        sync()
        self.barrier()
        self._slots[r] = None
        return out

    def cached(self, key: Hashable, build: Callable[[], Out]) -> Out:
        """``build()``'s result for ``key``: built by the first rank to ask (the others wait for
        it), then returned to every rank for the group's lifetime."""
        with self._cache_lock:
            if key not in self._cache:
                self._cache[key] = build()
            return self._cache[key]

    def _call(self, r: int, fn: Callable[[int], Out]) -> Out:
        """``fn(r)`` in rank r's thread, on its device and stream; the stream synchronized after."""
        self._tls.rank = r
        with torch.autograd.set_multithreading_enabled(False):
            if self.streams is None:
                return fn(r)
            _bind(self.device)
            try:
                with torch.cuda.stream(self.streams[r]):
                    return fn(r)
            finally:
                self.streams[r].synchronize()


def run_ranks(group: VirtualGroup, fn: Callable[[int], Out]) -> list[Out]:
    """``[fn(0), ..., fn(R-1)]``: each call in its own thread as that rank of ``group``.

    In rank r's thread ``group.rank()`` is r, the group's device is current, rank r's stream is
    the current stream, and autograd runs a backward in the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``; by default torch runs CUDA backward
    nodes on one engine thread per device, which would serialize the ranks' backward passes).
    The caller's current stream is synchronized before the threads start (inputs it made are
    complete), and each rank's stream once its ``fn`` returns or raises (results are complete
    here; a rank's allocations belong to its stream in the caching allocator).

    If a rank raises, the group's host collectives are aborted for the others (they raise
    RuntimeError instead of waiting), every thread is joined, and the first exception raised is
    re-raised with the other ranks' errors as notes. One run at a time per group.
    """
    if not group._running.acquire(blocking=False):
        raise RuntimeError(f"{group!r}: run_ranks is already running on this group")
    try:
        if group.streams is not None:
            torch.cuda.current_stream(group.device).synchronize()
        group._barrier.reset()
        group._slots = [None] * group.size()
        results: list = [None] * group.size()
        errors: list = []
        lock = threading.Lock()

        def main(r: int) -> None:
            try:
                results[r] = group._call(r, fn)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                with lock:
                    errors.append((r, e))
                group._barrier.abort()

        threads = [threading.Thread(target=main, args=(r,), name=f"mok_cute-rank{r}", daemon=True)
                   for r in range(group.size())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        group._running.release()
    if errors:
        (r, first), rest = errors[0], errors[1:]
        for q, e in rest:
            first.add_note(f"virtual rank {q} also raised {type(e).__name__}: {e}")
        first.add_note(f"raised by virtual rank {r} of {group!r}")
        raise first
    return results

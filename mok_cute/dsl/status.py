"""Device-side error status and bounded waits, shared by the comm kernels, the fused kernels and
their task schedules (:mod:`mok_cute.schedule.fused_tasks`).

A kernel that may wait records its first error in a local ``status`` tensor, int32[STATUS_WORDS]
= (code, peer, channel, epoch), zero while no error is recorded; the first error wins. Codes:
``OK``, ``TIMEOUT`` (a bounded wait gave up: ``peer`` / ``channel`` / ``epoch`` say which),
``BAD_EXPERT``, ``OVERFLOW``, ``BAD_INDEX`` (their meaning per channel:
:func:`mok_cute.comm.protocol.describe_status`). Every wait is bounded by ``timeout_ns`` of
``%globaltimer`` and also ends once the status holds an error recorded elsewhere.
"""
from __future__ import annotations

from mok_cute.dsl.compile import dsl

cutlass, cute = dsl()
from cutlass import Boolean, Int32, Int64  # noqa: E402

OK, TIMEOUT, BAD_EXPERT, OVERFLOW, BAD_INDEX = 0, 1, 2, 3, 4
STATUS_WORDS = 4  # code, peer, channel, epoch


def gptr(dtype, addr: Int64, align: int = 4):
    """Global pointer of ``dtype`` at integer address ``addr``."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def report(status: cute.Pointer, code: Int32, peer: Int32, channel: Int32, epoch: Int32):
    """Record an error in ``status`` (int32[4]) unless one is recorded already."""
    old = cute.arch.atomic_cas(status, cmp=Int32(0), val=code, sem="relaxed", scope="gpu")
    if old == 0:
        cute.arch.store(status + 1, peer)
        cute.arch.store(status + 2, channel)
        cute.arch.store(status + 3, epoch)
        cute.arch.fence_acq_rel_gpu()


@cute.jit
def failed(status: cute.Pointer) -> Boolean:
    """True once any error is recorded (relaxed load, GPU scope)."""
    return cute.arch.load(status, Int32, sem="relaxed", scope="gpu") != 0


@cute.jit
def wait_geq(flag: cute.Pointer, target: Int32, timeout_ns: Int64, status: cute.Pointer,
             peer: Int32, channel: Int32) -> Boolean:
    """Spin (acquire, system scope) until ``*flag >= target``; False on timeout or error."""
    start = cute.arch.globaltimer()
    v = cute.arch.load(flag, Int32, sem="acquire", scope="sys")
    ok = Boolean(True)
    while v - target < 0 and ok:
        if cute.arch.globaltimer() - start > timeout_ns:
            report(status, Int32(TIMEOUT), peer, channel, target)
            ok = Boolean(False)
        else:
            if failed(status):
                ok = Boolean(False)
            else:
                v = cute.arch.load(flag, Int32, sem="acquire", scope="sys")
    return ok

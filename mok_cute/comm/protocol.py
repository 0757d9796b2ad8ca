"""Device-side signalling between ranks: epoch flags, bounded waits, error status.

Flags live in the symmetric workspace as an int32 array ``[NUM_CHANNELS, EP]`` on every
rank. ``flags[ch][q]`` on rank r is written only by rank q (a remote release store at
system scope) and read only by rank r (acquire loads at system scope), so every wait
polls local memory. Values are epochs: each operation bumps a host-side counter and a
wait is ``flag >= epoch``; nothing is ever reset between steps.

Channels (who writes -> meaning):
  CNT       source q -> "my per-expert counts row is in your counts buffer"
  META      source q -> "my packed source indices are in your recv buffer"
  META_FREE rank q   -> "I copied out the plan scratch you pushed to me"
  READY     source q -> "my pull-source buffer (x or dy) holds this epoch's rows"
  DONE      rank q   -> "I finished pulling from your source buffer"
  DATA      rank q   -> "my rows for this epoch are in your slot buffer"
  FREE      rank q   -> "I finished reading my slot buffer, you may overwrite it"

Every wait is bounded by ``timeout_ns`` of ``%globaltimer``. On timeout the waiting
thread records ``(TIMEOUT, peer, channel, epoch)`` in the local status tensor (int32[4],
first error wins) and the kernel skips the rest of its work; any wait also gives up
once the status holds an error. The host reads the status with
:meth:`CommWorkspace.check_status` and raises ``RuntimeError``.
"""
from __future__ import annotations

from typing import NamedTuple

from mok_cute.dsl.compile import dsl
# the error status and the bounded wait are the protocol's vocabulary (re-exported for the kernels)
from mok_cute.dsl.status import (  # noqa: F401
    BAD_EXPERT, BAD_INDEX, OK, OVERFLOW, STATUS_WORDS, TIMEOUT, failed, gptr, report, wait_geq,
)

cutlass, cute = dsl()
from cutlass import Boolean, Int32, Int64  # noqa: E402

CNT, META, META_FREE, READY, DONE, DATA, FREE = range(7)
NUM_CHANNELS = 7
CHANNEL_NAMES = ("CNT", "META", "META_FREE", "READY", "DONE", "DATA", "FREE")

NUM_COUNTERS = 4  # CTA-arrival counters per kernel kind (own allocation, used from offset 0)


class Link(NamedTuple):
    """One comm kernel's handles on this rank's workspace: ``peer_bases`` int64 [EP] (every
    rank's symmetric buffer address), ``status`` int32 [STATUS_WORDS] (the error word), ``counters``
    int32 [NUM_COUNTERS] (the kernel kind's CTA-arrival counters, zero at launch). Pointers."""

    peer_bases: cute.Pointer
    status: cute.Pointer
    counters: cute.Pointer


class Round(NamedTuple):
    """One launch's round: ``epoch`` (Int32, the flags it signals and waits for), ``timeout_ns``
    (Int64, the bound of every wait) and ``nctas`` (Int32, the grid's CTAs)."""

    epoch: Int32
    timeout_ns: Int64
    nctas: Int32


def describe_status(words: list[int], timeout_s: float) -> str | None:
    """Human-readable error for a status tensor's contents, None when it holds no error."""
    code, peer, ch, epoch = words
    if code == OK:
        return None
    name = CHANNEL_NAMES[ch] if 0 <= ch < NUM_CHANNELS else str(ch)
    if code == TIMEOUT:
        return (f"mok_cute comm: peer rank {peer} did not arrive within the timeout of "
                f"{timeout_s:g} s (channel {name}, epoch {epoch})")
    if code == BAD_EXPERT:
        return f"mok_cute comm: topk_idx holds an expert id outside [-1, E) (epoch {epoch})"
    if code == OVERFLOW:
        return (f"mok_cute comm: {peer} routed rows exceed the receive capacity / expert "
                f"output rows (epoch {epoch})")
    if code == BAD_INDEX:
        return (f"mok_cute comm: plan row {peer} holds a packed source index outside "
                f"[0, EP*T*k) (channel {name}, epoch {epoch}): plan does not match the workspace")
    return f"mok_cute comm: unknown error code {code}"


@cute.jit
def fence_stores(to_peers: cutlass.Constexpr[bool]):
    """Order this thread's stores before a release that publishes them: at system scope when some
    went to peers (EP > 1), else at GPU scope."""
    if cutlass.const_expr(to_peers):
        cute.arch.fence_acq_rel_sys()
    else:
        cute.arch.fence_acq_rel_gpu()


@cute.jit
def wait_all(flags_local: Int64, channel: Int32, ep: Int32, target: Int32, timeout_ns: Int64,
             status: cute.Pointer) -> Boolean:
    """One thread: wait until every rank q has set ``flags[channel][q] >= target`` here: rank q's
    flag polled (acquire, system scope) until it is, then rank q + 1's, each bounded by
    ``timeout_ns`` (a timeout or an error recorded elsewhere ends the wait: False; a timeout is
    recorded as peer q). One flat poll loop, not a peer loop around :func:`wait_geq`: with a
    run-time ``ep`` the nested form faulted natively beside cp.async.bulk copies (the bulk
    transport; commit 5af2a71, 2026-12-01)."""
    row = gptr(Int32, flags_local + Int64(channel * ep) * 4)
    q = Int32(0)
    ok = Boolean(True)
    start = cute.arch.globaltimer()
    while q < ep and ok:
        v = cute.arch.load(row + q, Int32, sem="acquire", scope="sys")
        if v - target >= 0:
            q += 1
            start = cute.arch.globaltimer()
        elif cute.arch.globaltimer() - start > timeout_ns:
            report(status, Int32(TIMEOUT), q, channel, target)
            ok = Boolean(False)
        elif failed(status):
            ok = Boolean(False)
    return ok


@cute.jit
def signal_all(peer_bases: cute.Tensor, flags_off: Int64, channel: Int32, me: Int32, ep: Int32,
               epoch: Int32):
    """One thread: ``flags[channel][me] = epoch`` on every rank (release, system scope),
    after a system-scope fence that orders this CTA's earlier writes before the flags."""
    cute.arch.fence_acq_rel_sys()
    for q in range(ep):
        addr = peer_bases[q] + flags_off + Int64(channel * ep + me) * 4
        cute.arch.store(gptr(Int32, addr), epoch, sem="release", scope="sys")


@cute.jit
def arrive_last(counter: cute.Pointer, nctas: Int32) -> Boolean:
    """One thread per CTA, after a CTA barrier: True for the last CTA to arrive."""
    cute.arch.fence_acq_rel_gpu()
    old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
    return old == nctas - 1


@cute.jit
def arrive_and_signal(peer_bases: cute.Tensor, status: cute.Pointer, arrive: cute.Pointer,
                      counters: cute.Pointer, resets: cutlass.Constexpr, flags_off: Int64,
                      channel: Int32, me: Int32, ep: Int32, epoch: Int32, nctas: Int32):
    """One thread per CTA, after a CTA barrier: the last CTA to arrive on ``arrive`` zeroes
    the first ``resets`` counters and, unless an error is recorded, signals ``channel``."""
    if arrive_last(arrive, nctas):
        for c in cutlass.range_constexpr(resets):
            cute.arch.store(counters + c, Int32(0))
        if not failed(status):
            signal_all(peer_bases, flags_off, channel, me, ep, epoch)


@cute.jit
def pull_round(link: Link, me: Int32, ep: Int32, flags_off: Int64, rnd: Round, move: cutlass.Constexpr):
    """Every CTA of one pull from the peers' buffers (epoch ``rnd.epoch``): CTA 0 signals READY
    to every peer, every CTA waits READY from every peer, the CTA's threads run
    ``move(tidx, bidx, pb)`` (unless a wait failed), and the last CTA to finish arrives on
    ``link.counters[0]`` (zeroing it) and signals DONE."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    pb = cute.make_tensor(link.peer_bases, cute.make_layout(ep))
    if tidx == 0:
        if bidx == 0:
            signal_all(pb, flags_off, Int32(READY), me, ep, rnd.epoch)
        wait_all(pb[me] + flags_off, Int32(READY), ep, rnd.epoch, rnd.timeout_ns, link.status)
    cute.arch.barrier()
    if not failed(link.status):
        move(tidx, bidx, pb)
    cute.arch.barrier()
    if tidx == 0:
        arrive_and_signal(pb, link.status, link.counters, link.counters, 1, flags_off, Int32(DONE), me, ep,
                          rnd.epoch, rnd.nctas)


@cute.kernel
def _wait_kernel(flags_local: Int64, channel: Int32, ep: Int32, target: Int32, timeout_ns: Int64,
                 status: cute.Pointer):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        wait_all(flags_local, channel, ep, target, timeout_ns, status)


@cute.jit
def wait_flags_host(flags_local: Int64, channel: Int32, ep: Int32, target: Int32,
                    timeout_ns: Int64, status: cute.Pointer, stream):
    """Launch one thread that waits for ``flags[channel][q] >= target`` for all q."""
    _wait_kernel(flags_local, channel, ep, target, timeout_ns, status).launch(
        grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

"""Device-side addressing of the symmetric workspace inside a fused kernel at EP > 1.

:class:`PeerRows` bundles, for one launch, the peer pointer table and the section offsets of
:class:`~mok_cute.comm.workspace.CommWorkspace` (``src`` x rows [T, H] bf16, ``slots``
[T*k, H] bf16, ``w`` topk_w [T, k] fp32, ``flags``), the epochs of the launch's pull
(READY / DONE) and push (DATA / FREE) rounds, and the status pointer, so that a kernel can
move single 16-byte vectors of routed rows with unicast peer loads and stores:

* :meth:`pull_vec`: vector ``c`` of the x row of packed source ``q = p*T*k + t*k + j`` (rank
  p's ``src[t]``), and optionally its router weight into ``w_rows[r]`` (:meth:`pull_w`);
  :meth:`src_row` is the row's address for other row formats (MXFP8 rows);
* :meth:`push_vec`: a vector into rank p's ``slots[t*k + j]``.

The launch's rounds, on :mod:`mok_cute.comm.protocol`'s signalling (``signal_all`` / ``wait_all``
/ ``arrive_last``): :meth:`open_pull` / :meth:`close_pull` around the pulls (READY, DONE),
:meth:`wait_free` before the first push, :meth:`wait_rows` / :meth:`close_push` around the reads
of this rank's slot buffer (DATA, FREE). Built at trace time inside a kernel (its fields are
kernel values).
"""
from typing import NamedTuple

from mok_cute.comm.protocol import (
    DATA, DONE, FREE, READY, arrive_last, cute, failed, gptr, signal_all, wait_all,
)
from cutlass import BFloat16, Float32, Int32, Int64

VEC = 8  # bf16 elements per 16-byte vector


class PeerSections(NamedTuple):
    """Byte offsets (Int64) of the workspace sections a fused kernel reaches on every rank: ``src``
    (the pull source: x rows, or the backward's dy rows), ``slots`` (the push target), ``w`` (the
    router weights; ``Int64(0)`` where the kernel pulls none) and ``flags``."""

    src: Int64
    slots: Int64
    w: Int64
    flags: Int64


class PeerRows:
    """One launch's view of the symmetric workspace (see the module doc): the peer table
    ``peer_bases`` (int64 [EP] tensor), ``w_rows`` (where :meth:`pull_w` writes), this rank ``me`` of
    ``n``, the ``sections``, the epochs of the launch's pull and push rounds, ``tk`` = T*k, the
    waits' bound ``timeout_ns`` and the error ``status`` pointer."""

    def __init__(self, peer_bases, w_rows, me, n, sections: PeerSections, epoch_pull, epoch_push, tk, timeout_ns,
                 status):
        self.pb, self.w_rows, self.me, self.n = peer_bases, w_rows, me, n
        self.src_off, self.slots_off, self.w_off, self.flags_off = sections
        self.epoch_pull, self.epoch_push, self.tk = epoch_pull, epoch_push, tk
        self.timeout_ns, self.status = timeout_ns, status

    def _fields(self) -> list:
        return [self.pb, self.w_rows, self.me, self.n, self.src_off, self.slots_off, self.w_off, self.flags_off,
                self.epoch_pull, self.epoch_push, self.tk, self.timeout_ns, self.status]

    def __extract_mlir_values__(self) -> list:
        """(The DSL's protocol for values carried through run-time loops: the fields.)"""
        return self._fields()

    def __new_from_mlir_values__(self, values: list) -> "PeerRows":
        pb, w_rows, me, n, src, slots, w, flags, epoch_pull, epoch_push, tk, timeout_ns, status = values
        return PeerRows(pb, w_rows, me, n, PeerSections(src, slots, w, flags), epoch_pull, epoch_push, tk,
                        timeout_ns, status)

    @cute.jit
    def src_row(self, q, k, rb):
        """Address (Int64) of source ``q``'s staged row (rank p's ``src[t]``, ``rb`` bytes per row:
        2H for bf16 rows, :func:`~mok_cute.comm.workspace.mxfp8_row_bytes` for MXFP8 rows)."""
        p = q // self.tk
        rem = q - p * self.tk
        return self.pb[p] + self.src_off + Int64(rem // k) * Int64(rb)

    @cute.jit
    def pull_w(self, q, r):
        """``w_rows[r]`` = the router weight of source slot ``q`` (rank p's ``w[t, j]``)."""
        p = q // self.tk
        rem = q - p * self.tk
        w = cute.make_tensor(gptr(Float32, self.pb[p] + self.w_off + Int64(rem) * 4, 4), cute.make_layout((1,)))
        self.w_rows[r] = w[0]

    @cute.jit
    def pull_vec(self, q, k, c, v, r, with_w):
        """Vector ``c`` (of ``v`` per row) of source ``q``'s x row; with ``with_w`` also
        ``w_rows[r]`` = the source slot's router weight."""
        row = self.src_row(q, k, v * 16)
        vec = cute.make_tensor(gptr(BFloat16, row + Int64(c) * 16, 16), cute.make_layout((VEC,)))
        if with_w:
            self.pull_w(q, r)
        return vec.load()

    @cute.jit
    def push_vec(self, q, c, v, val):
        """Store ``val`` (8 bf16) as vector ``c`` of rank p's slot row ``t*k + j`` (``q`` packed)."""
        p = q // self.tk
        rem = q - p * self.tk
        addr = self.pb[p] + self.slots_off + Int64(rem) * Int64(v * 16) + Int64(c) * 16
        cute.make_tensor(gptr(BFloat16, addr, 16), cute.make_layout((VEC,))).store(val)

    @cute.jit
    def open_pull(self, tidx, bidx):
        """Every pulling CTA, before its first pull: CTA 0 tells every rank this rank's sources are
        staged (READY), thread 0 waits for every rank's READY, then the CTA's barrier."""
        if tidx == 0:
            if bidx == 0:
                signal_all(self.pb, self.flags_off, Int32(READY), self.me, self.n, self.epoch_pull)
            wait_all(self.pb[self.me] + self.flags_off, Int32(READY), self.n, self.epoch_pull, self.timeout_ns,
                     self.status)
        cute.arch.barrier()

    @cute.jit
    def close_pull(self, tidx, arrivals, ctas):
        """Every pulling CTA, after its last pull: the CTA's barrier, then the last of ``ctas`` to
        arrive on ``arrivals`` (an int32 counter, zero at launch) tells every rank it may overwrite its
        sources (DONE), unless a wait failed."""
        cute.arch.barrier()
        if tidx == 0:
            if arrive_last(arrivals, ctas):
                if not failed(self.status):
                    signal_all(self.pb, self.flags_off, Int32(DONE), self.me, self.n, self.epoch_pull)

    @cute.jit
    def wait_free(self):
        """The calling thread waits until every rank has read its slot buffer of the previous push
        round (FREE >= epoch - 1: an earlier launch's, so nothing in this one waits for it)."""
        wait_all(self.pb[self.me] + self.flags_off, Int32(FREE), self.n, self.epoch_push - 1, self.timeout_ns,
                 self.status)

    @cute.jit
    def wait_rows(self, bidx):
        """Thread 0 of each CTA once this rank's pushes are all in (its caller's count): CTA 0 tells
        every rank (DATA, unless a wait failed), then it waits for every rank's DATA: every row of
        this rank's slot buffer is in."""
        if bidx == 0:
            if not failed(self.status):
                signal_all(self.pb, self.flags_off, Int32(DATA), self.me, self.n, self.epoch_push)
        wait_all(self.pb[self.me] + self.flags_off, Int32(DATA), self.n, self.epoch_push, self.timeout_ns, self.status)

    @cute.jit
    def close_push(self, tidx, arrivals, ctas):
        """Every CTA after reading its slot rows: the CTA's barrier, then the last of ``ctas`` to
        arrive on ``arrivals`` tells every rank the slot buffer is free (FREE), unless a wait failed."""
        cute.arch.barrier()
        if tidx == 0:
            if arrive_last(arrivals, ctas):
                if not failed(self.status):
                    signal_all(self.pb, self.flags_off, Int32(FREE), self.me, self.n, self.epoch_push)

"""Pull of token rows into expert-grouped order: forward dispatch and reverse combine.

The expert-owning rank reads, for every grouped row ``i < M = offsets[-1]`` of its plan,
the row ``t`` of source rank ``p`` (``recv_src[i] = p*T*k + t*k + j``) from that rank's
symmetric source buffer (x in the forward pass, dy in the backward pass) straight into
``out[i]`` ([capacity, H] bf16; rows >= M are left untouched).

Protocol per call (pull epoch e): the source stages its rows in the buffer (waiting for
DONE >= e-1 from every peer first), the kernel's CTA 0 signals READY = e to every peer,
every CTA waits READY >= e from every peer, the CTAs copy 16-byte vectors (plain peer
loads, grid-stride over (row, vector)), and the last CTA to finish signals DONE = e.

Speed notes: plain 16-byte peer loads are latency-bound (~14 GB/s per 1024-thread CTA
measured). Next steps: per-row bulk copies (cp.async.bulk global->shared, then
shared->global) with a few rows in flight per CTA, or TMA with per-peer descriptors;
let the producer write x straight into :meth:`CommWorkspace.acquire_src` to skip the
staging copy.
"""
from __future__ import annotations

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute
from mok_cute.comm.rows import THREADS, copy_routed_rows
from mok_cute.comm.workspace import (CommWorkspace, _fake_ptr, check_num_ctas, check_plan,
                                     check_tensor, current_stream, dptr, fake_stream)
from mok_cute.kernels.compile import compile_cached, compile_kernel
from cutlass import Int32, Int64


_launchers: dict = {}


def pull_launcher():
    """The ``@cute.jit`` launcher of the pull kernel, built once by Python closure like
    :func:`mok_cute.comm.combine.push_reduce_launcher`: no Constexpr kernel parameters,
    int64/int32/bf16 pointers and Int32/Int64 scalars only, peer addresses in 64 bits."""
    if "pull" in _launchers:
        return _launchers["pull"]

    @cute.kernel
    def pull_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                    recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                    out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                    e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                    timeout_ns: Int64, nctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        pb = cute.make_tensor(peer_bases, cute.make_layout(ep))
        if tidx == 0:
            if bidx == 0:
                P.signal_all(pb, flags_off, Int32(P.READY), me, ep, epoch)
            P.wait_all(pb[me] + flags_off, Int32(P.READY), ep, epoch, timeout_ns, status)
        cute.arch.barrier()
        if not P.failed(status):
            copy_routed_rows(tidx, bidx, pb, status, recv_src, offsets, out, out_rows, ep, T, k,
                             T * k, V, e_local, src_off, Int32(P.READY), epoch, nctas, False)
        cute.arch.barrier()
        if tidx == 0:
            P.arrive_and_signal(pb, status, counter, counter, 1, flags_off, Int32(P.DONE), me, ep,
                                epoch, nctas)

    kernel = pull_kernel

    @cute.jit
    def pull_rows_host(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                       recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                       out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                       e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                       timeout_ns: Int64, nctas: Int32, stream):
        """Launch the pull kernel: ``nctas`` CTAs of 1024 threads on ``stream``."""
        kernel(peer_bases, status, counter, recv_src, offsets, out, out_rows, me, ep, T, k, V,
               e_local, src_off, flags_off, epoch, timeout_ns, nctas).launch(
            grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    _launchers["pull"] = host = pull_rows_host
    return host


def compile_pull(arch: str, inspect: bool = False):
    """Compile the pull launcher for ``arch``; returns ``(compiled, CompileReport | None)``."""
    i32, i64 = _fake_ptr("i32"), _fake_ptr("i64")
    return compile_kernel(pull_launcher(), i64, i32, i32, i32, i32, _fake_ptr("bf16"), Int32(1),
                          Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int64(0),
                          Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(),
                          arch=arch, inspect=inspect)


def _pull(ws: CommWorkspace, rows: torch.Tensor, plan, num_ctas: int | None,
          out: torch.Tensor | None, name: str) -> torch.Tensor:
    check_tensor(name, rows, torch.bfloat16, (ws.T, ws.H), ws.device)
    check_plan(ws, plan)
    nctas = ws.num_ctas if num_ctas is None else num_ctas
    check_num_ctas(nctas)
    if out is None:
        out = torch.empty(ws.recv_capacity, ws.H, dtype=torch.bfloat16, device=ws.device)
    check_tensor("out", out, torch.bfloat16, (None, ws.H), ws.device)
    out_rows = min(out.shape[0], plan.recv_src.shape[0])
    fn = compile_cached(("comm.pull", ws.arch), lambda: compile_pull(ws.arch)[0])
    ws.stage_src(rows)
    epoch = ws.next_epoch("pull")
    fn(dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["pull"]), dptr(plan.recv_src),
       dptr(plan.offsets), dptr(out), Int32(out_rows), Int32(ws.me), Int32(ws.EP), Int32(ws.T),
       Int32(ws.k), Int32(ws.H // 8), Int32(ws.E // ws.EP), Int64(ws.offsets["src"]),
       Int64(ws.offsets["flags"]), Int32(epoch), Int64(ws.timeout_ns), Int32(nctas),
       current_stream())
    return out


def dispatch(ws: CommWorkspace, x: torch.Tensor, plan, *, num_ctas: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Forward dispatch by pull: ``x`` [T, H] bf16 (this rank's tokens) -> this rank's
    expert-grouped rows [capacity, H] bf16 (valid prefix ``plan.offsets[-1]``), in plan order.
    Collective over the workspace group; launches on the current stream, no host sync."""
    return _pull(ws, x, plan, num_ctas, out, "x")


def reverse_combine(ws: CommWorkspace, dy: torch.Tensor, plan, *, num_ctas: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of combine by pull: ``dy`` [T, H] bf16 (this rank's output grads) -> dy rows
    of the routes this rank's experts served, [capacity, H] bf16 in plan order (unscaled:
    the expert side applies topk_w). Collective; current stream, no host sync."""
    return _pull(ws, dy, plan, num_ctas, out, "dy")

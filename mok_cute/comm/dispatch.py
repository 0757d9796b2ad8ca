"""Pull of token rows into expert-grouped order: forward dispatch and reverse combine.

The expert-owning rank reads, for every grouped row ``i < M = offsets[-1]`` of its plan,
the row ``t`` of source rank ``p`` (``recv_src[i] = p*T*k + t*k + j``) from that rank's
symmetric source buffer (x in the forward pass, dy in the backward pass) straight into
``out[i]`` ([capacity, H] bf16; rows >= M are left untouched).

Payloads (forward dispatch): ``"bf16"`` rows [T, H]; ``"mxfp8"`` e4m3 data [T, H] plus
E8M0 scales [T, H/32] (uint8), staged per token as one packed row of :func:`mxfp8_row_bytes`
bytes and pulled as such (the same kernels as bf16 with ``V = row bytes / 16``) into a
[capacity, row bytes] receive buffer whose column views are the data and the scales. With
``topk_w`` ([T, k] fp32, staged in the workspace's ``w`` section) the route's router weight
travels too: ``w_rows[i]`` = topk_w of source (p, t, j) for i < M, 0 past M. Reverse
combine is bf16.

Protocol per call (pull epoch e): the source stages its rows in the buffer (waiting for
DONE >= e-1 from every peer first), the kernel's CTA 0 signals READY = e to every peer,
every CTA waits READY >= e from every peer, the CTAs copy 16-byte vectors (plain peer
loads, grid-stride over (row, vector)), and the last CTA to finish signals DONE = e.

Transport: 16-byte peer loads by every thread, ``MOK_COMM_UNROLL`` (default 8) of them in
flight per thread before their stores (:func:`pull_launcher` ``unroll``; 1 = one load then its
store); the weighted pull keeps one. ``MOK_COMM_TRANSPORT=bulk`` switches the pull without
weights to the opt-in cp.async.bulk kernel (:func:`pull_bulk_launcher`; faults natively, see
docs/comm-status.md).

Speed (2x H200, docs/benchmarks.md): the pull is bound by loads in flight; unrolled x8 it
reaches 300-311 GB/s (83-86% of the peer copy rate) at 128 CTAs on T 16384 and 193-205 GB/s
at 32 CTAs (the plain copy 168-177).
"""
from __future__ import annotations

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import cute, cutlass
from mok_cute.comm.rows import (BULK_SMEM, THREADS, bulk_routed_rows, copy_routed_rows,
                                copy_routed_rows_unrolled, unroll_of, use_bulk)
from mok_cute.comm.workspace import CommWorkspace, check_num_ctas, mxfp8_row_bytes
from mok_cute.dsl.compile import compile_cached, compile_kernel
from mok_cute.dsl.host import check_tensor, current_stream, dptr, fake_ptr, fake_stream
from mok_cute.schedule.plan import check_plan
from cutlass import BFloat16, Int32, Int64

PAYLOADS = ("bf16", "mxfp8")


_launchers: dict = {}

# The row-moving kernels are built per variant by Python closure (see docs/comm-status.md): no
# Constexpr kernel parameters; int64/int32/bf16 pointers and Int32/Int64 scalars only; peer
# addresses in 64 bits. They share the pull protocol below and, where their arguments are the
# same, one host launcher.


def _rows_host(kernel, smem: int = 0):
    """The ``@cute.jit`` host launcher of a bf16 row pull kernel (``nctas`` CTAs of 1024
    threads on ``stream``; ``smem`` bytes of dynamic shared memory when nonzero)."""

    @cute.jit
    def pull_rows_host(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                       recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                       out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                       e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                       timeout_ns: Int64, nctas: Int32, stream):
        launch = kernel(peer_bases, status, counter, recv_src, offsets, out, out_rows, me, ep, T, k, V,
                        e_local, src_off, flags_off, epoch, timeout_ns, nctas)
        if cutlass.const_expr(smem):
            launch.launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], smem=smem, stream=stream)
        else:
            launch.launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return pull_rows_host


def pull_launcher(unroll: int = 1):
    """The launcher of the bf16 pull (dispatch, reverse combine): :func:`mok_cute.comm.protocol.pull_round` with
    :func:`mok_cute.comm.rows.copy_routed_rows` moving the rows (kernel ``pull_kernel``), or,
    with ``unroll`` > 1 (opt-in ``MOK_COMM_UNROLL``),
    :func:`mok_cute.comm.rows.copy_routed_rows_unrolled` (kernel ``pull_unrolled_kernel``)."""
    key = ("pull", int(unroll))
    if key in _launchers:
        return _launchers[key]
    unroll = int(unroll)

    @cute.kernel
    def pull_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                    recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                    out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                    e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                    timeout_ns: Int64, nctas: Int32):
        P.pull_round(peer_bases, status, counter, me, ep, flags_off, epoch, timeout_ns, nctas,
                       lambda tidx, bidx, pb: copy_routed_rows(
                           tidx, bidx, pb, status, recv_src, offsets, out, out_rows, ep, T, k, T * k, V, e_local,
                           src_off, Int32(P.READY), epoch, nctas, False))

    @cute.kernel
    def pull_unrolled_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                             recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                             out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                             e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                             timeout_ns: Int64, nctas: Int32):
        P.pull_round(peer_bases, status, counter, me, ep, flags_off, epoch, timeout_ns, nctas,
                       lambda tidx, bidx, pb: copy_routed_rows_unrolled(
                           tidx, bidx, pb, status, recv_src, offsets, out, out_rows, ep, T, k, T * k, V, e_local,
                           src_off, Int32(P.READY), epoch, nctas, False, unroll))

    _launchers[key] = host = _rows_host(pull_kernel if unroll == 1 else pull_unrolled_kernel)
    return host


def compile_pull(arch: str, inspect: bool = False, unroll: int = 1):
    """Compile the pull launcher (:func:`pull_launcher`) for ``arch``;
    returns ``(compiled, CompileReport | None)``."""
    i32, i64 = fake_ptr("i32"), fake_ptr("i64")
    return compile_kernel(pull_launcher(unroll), i64, i32, i32, i32, i32, fake_ptr("bf16"), Int32(1),
                          Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int64(0),
                          Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(),
                          arch=arch, inspect=inspect)


def pull_w_launcher():
    """The launcher of the pull that also moves the router weights
    (:func:`mok_cute.comm.rows.copy_routed_rows` with ``w_out``, kernel ``pull_w_kernel``; rows of ``V``
    16-byte vectors, bf16 or packed MXFP8). Closure-built like :func:`pull_launcher` (no
    Constexpr kernel parameters; int64/int32/bf16 pointers and Int32/Int64 scalars only)."""
    key = ("pull_w",)
    if key in _launchers:
        return _launchers[key]

    @cute.kernel
    def pull_w_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                      recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                      w_out: cute.Pointer, out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32,
                      V: Int32, e_local: Int32, src_off: Int64, w_off: Int64, flags_off: Int64,
                      epoch: Int32, timeout_ns: Int64, nctas: Int32):
        P.pull_round(peer_bases, status, counter, me, ep, flags_off, epoch, timeout_ns, nctas,
                       lambda tidx, bidx, pb: copy_routed_rows(
                           tidx, bidx, pb, status, recv_src, offsets, out, out_rows, ep, T, k, T * k, V, e_local,
                           src_off, Int32(P.READY), epoch, nctas, False, w_out=w_out, w_off=w_off))

    @cute.jit
    def pull_w_host(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                    recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                    w_out: cute.Pointer, out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32,
                    V: Int32, e_local: Int32, src_off: Int64, w_off: Int64, flags_off: Int64,
                    epoch: Int32, timeout_ns: Int64, nctas: Int32, stream):
        """Launch the weighted pull kernel: ``nctas`` CTAs of 1024 threads on ``stream``."""
        pull_w_kernel(peer_bases, status, counter, recv_src, offsets, out, w_out, out_rows, me, ep,
                      T, k, V, e_local, src_off, w_off, flags_off, epoch, timeout_ns,
                      nctas).launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    _launchers[key] = pull_w_host
    return pull_w_host


def compile_pull_w(arch: str, inspect: bool = False):
    """Compile the weighted pull for ``arch``; ``(compiled, CompileReport | None)``."""
    i32 = fake_ptr("i32")
    return compile_kernel(pull_w_launcher(), fake_ptr("i64"), i32, i32, i32, i32, fake_ptr("bf16"), i32,
                          Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int64(0),
                          Int64(0), Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(),
                          arch=arch, inspect=inspect)


def pull_bulk_launcher():
    """The launcher of the opt-in bulk-copy pull (``MOK_COMM_TRANSPORT=bulk``, bf16 payload
    without weights): the protocol of :func:`pull_launcher` with the rows moved by
    :func:`mok_cute.comm.rows.bulk_routed_rows` (thread 0 of each CTA, cp.async.bulk peer ->
    shared -> ``out``). Its own closure and kernel name (``pull_bulk_kernel``), same argument
    kinds, ``BULK_SMEM`` bytes of dynamic shared memory; :func:`pull_launcher` is untouched."""
    if "pull_bulk" in _launchers:
        return _launchers["pull_bulk"]

    @cute.kernel
    def pull_bulk_kernel(peer_bases: cute.Pointer, status: cute.Pointer, counter: cute.Pointer,
                         recv_src: cute.Pointer, offsets: cute.Pointer, out: cute.Pointer,
                         out_rows: Int32, me: Int32, ep: Int32, T: Int32, k: Int32, V: Int32,
                         e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32,
                         timeout_ns: Int64, nctas: Int32):
        P.pull_round(peer_bases, status, counter, me, ep, flags_off, epoch, timeout_ns, nctas,
                       lambda tidx, bidx, pb: bulk_routed_rows(
                           tidx, bidx, pb, status, recv_src, offsets, out, out_rows, ep, T, k, T * k, V, e_local,
                           src_off, Int32(P.READY), epoch, nctas, False))

    _launchers["pull_bulk"] = host = _rows_host(pull_bulk_kernel, BULK_SMEM)
    return host


def compile_pull_bulk(arch: str, inspect: bool = False):
    """Compile the bulk-copy pull for ``arch``; ``(compiled, CompileReport | None)``."""
    i32, i64 = fake_ptr("i32"), fake_ptr("i64")
    return compile_kernel(pull_bulk_launcher(), i64, i32, i32, i32, i32, fake_ptr("bf16"),
                          Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
                          Int64(0), Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(),
                          arch=arch, inspect=inspect)


def _check_out(out, dtype, cols: int, ws: CommWorkspace, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(ws.recv_capacity, cols, dtype=dtype, device=ws.device)
    check_tensor(name, out, dtype, (None, cols), ws.device)
    return out


def _launch_pull(ws: CommWorkspace, plan, out: torch.Tensor, out_rows: int, V: int, nctas: int,
                 w_out: torch.Tensor | None = None) -> None:
    """Launch one pull of rows of ``V`` 16-byte vectors from the staged source buffers into
    ``out`` (next pull epoch): with ``w_out`` the weighted pull (:func:`pull_w_launcher`),
    else ``MOK_COMM_TRANSPORT=bulk``'s opt-in :func:`pull_bulk_launcher` or the
    :func:`pull_launcher` of ``MOK_COMM_UNROLL`` (default 8)."""
    unroll = unroll_of()
    if w_out is not None:
        fn = compile_cached(("comm.pull_w", ws.arch), lambda: compile_pull_w(ws.arch)[0])
    elif use_bulk("pull"):
        fn = compile_cached(("comm.pull_bulk", ws.arch), lambda: compile_pull_bulk(ws.arch)[0])
    elif unroll > 1:
        fn = compile_cached(("comm.pull_unrolled", ws.arch, unroll), lambda: compile_pull(ws.arch, unroll=unroll)[0])
    else:
        fn = compile_cached(("comm.pull", ws.arch), lambda: compile_pull(ws.arch)[0])
    epoch = ws.next_epoch("pull")
    head = (dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["pull"]), dptr(plan.recv_src),
            dptr(plan.offsets), dptr(out, BFloat16))
    shape = (Int32(ws.me), Int32(ws.EP), Int32(ws.T), Int32(ws.k), Int32(V), Int32(ws.E // ws.EP),
             Int64(ws.offsets["src"]))
    tail = (Int64(ws.offsets["flags"]), Int32(epoch), Int64(ws.timeout_ns), Int32(nctas), current_stream())
    if w_out is not None:
        fn(*head, dptr(w_out, Int32), Int32(out_rows), *shape, Int64(ws.offsets["w"]), *tail)
    else:
        fn(*head, Int32(out_rows), *shape, *tail)


def _check_mxfp8(ws: CommWorkspace, x):
    """``(x_q, x_s)`` to stage, or None when ``x`` is the already staged source buffer."""
    if ws.H % 32:
        raise ValueError(f"payload 'mxfp8' needs H % 32 == 0, got H={ws.H}")
    if isinstance(x, torch.Tensor):
        rb = mxfp8_row_bytes(ws.H)
        check_tensor("x", x, torch.uint8, (ws.T, rb), ws.device)
        if x.data_ptr() != ws.local_base + ws.offsets["src"]:
            raise ValueError("x as one uint8 tensor must be this step's "
                             "ws.acquire_src(mxfp8_row_bytes(H)) (data then scales per row)")
        return None
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError("x must be a pair (x_q [T, H] float8_e4m3fn, x_s [T, H/32] uint8) for "
                        "payload 'mxfp8'")
    q, sc = x
    check_tensor("x_q", q, torch.float8_e4m3fn, (ws.T, ws.H), ws.device)
    check_tensor("x_s", sc, torch.uint8, (ws.T, ws.H // 32), ws.device)
    return q, sc


def dispatch(ws: CommWorkspace, x, plan, *, payload: str = "bf16",
             topk_w: torch.Tensor | None = None, num_ctas: int | None = None, out=None,
             w_out: torch.Tensor | None = None):
    """Forward dispatch by pull: this rank's tokens -> its expert-grouped rows in plan order
    (valid prefix ``M = plan.offsets[-1]`` of ``capacity`` rows; rows >= M untouched).

    ``payload="bf16"``: ``x`` [T, H] bf16 -> rows [capacity, H] bf16 (``out``: optional
    preallocated [N, H] bf16).
    ``payload="mxfp8"``: ``x = (x_q [T, H] float8_e4m3fn, x_s [T, H/32] uint8 E8M0)``, or
    this step's ``ws.acquire_src(mxfp8_row_bytes(H))`` with ``[:, :H]`` = data bytes and
    ``[:, H:H + H/32]`` = scales already written (no staging copy). Each token moves as one
    packed row of ``rb = mxfp8_row_bytes(H)`` bytes into a receive buffer [capacity, rb]
    uint8 (``out``: optional preallocated [N, rb] uint8); returns its views
    ``(q [capacity, H] float8_e4m3fn, s [capacity, H/32] uint8)``, row stride rb bytes
    (``.contiguous()`` for kernels that need dense rows).
    ``topk_w`` [T, k] fp32: also returns ``w_rows`` [capacity] fp32 (or into ``w_out``), the
    router weight of each grouped row (0 past M); the result is then ``(rows, w_rows)`` /
    ``(q, s, w_rows)``. Collective over the workspace group (every rank passes the same
    payload and topk_w-or-not); launches on the current stream, no host sync."""
    return _pull_rows(ws, x, plan, payload, topk_w, num_ctas, out, w_out, "x")


def _pull_rows(ws: CommWorkspace, x, plan, payload: str, topk_w, num_ctas, out, w_out, name: str):
    """:func:`dispatch` (and :func:`reverse_combine`: bf16, no weights) with the source rows
    named ``name`` in the error messages."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    mx = payload == "mxfp8"
    if mx:
        staged = _check_mxfp8(ws, x)
    else:
        check_tensor(name, x, torch.bfloat16, (ws.T, ws.H), ws.device)
    if topk_w is not None:
        check_tensor("topk_w", topk_w, torch.float32, (ws.T, ws.k), ws.device)
    check_plan(ws, plan)
    nctas = ws.num_ctas if num_ctas is None else num_ctas
    check_num_ctas(nctas)
    H = ws.H
    rb = mxfp8_row_bytes(H) if mx else 2 * H
    recv = _check_out(out, torch.uint8, rb, ws, "out") if mx else _check_out(out, torch.bfloat16, H, ws, "out")
    rows_n = min(recv.shape[0], plan.recv_src.shape[0])
    if topk_w is not None:
        if w_out is None:
            w_out = torch.zeros(ws.recv_capacity, dtype=torch.float32, device=ws.device)
        else:
            check_tensor("w_out", w_out, torch.float32, (None,), ws.device)
            w_out.zero_()
        rows_n = min(rows_n, w_out.shape[0])
    if not mx:
        ws.stage_src(x)
    elif staged is not None:  # waits DONE of the previous pull, then data and scales per token row
        src = ws.acquire_src(rb)
        src[:, :H].copy_(staged[0].view(torch.uint8))
        src[:, H:H + H // 32].copy_(staged[1])
    if topk_w is not None:  # after the DONE wait of the staging / acquire_src for this step
        ws.view("w", torch.float32, (ws.T, ws.k)).copy_(topk_w)
    _launch_pull(ws, plan, recv, rows_n, rb // 16, nctas, w_out)
    res = (recv[:, :H].view(torch.float8_e4m3fn), recv[:, H:H + H // 32]) if mx else (recv,)
    if topk_w is not None:
        res = res + (w_out,)
    return res if len(res) > 1 else res[0]


def reverse_combine(ws: CommWorkspace, dy: torch.Tensor, plan, *, num_ctas: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Backward of combine by pull: ``dy`` [T, H] bf16 (this rank's output grads) -> dy rows
    of the routes this rank's experts served, [capacity, H] bf16 in plan order (unscaled:
    the expert side applies topk_w). Collective; current stream, no host sync."""
    return _pull_rows(ws, dy, plan, "bf16", None, num_ctas, out, None, "dy")

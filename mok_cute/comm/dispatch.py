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

Transport (``transport``, the layer's ``MoKConfig.comm_transport``): ``"plain"`` (default)
16-byte peer loads by every thread, :data:`~mok_cute.comm.rows.UNROLL` (8) of them in flight per
thread before their stores (:func:`pull_launcher`; the weighted pull keeps one); ``"bulk"`` moves
the rows of the pull without weights by cp.async.bulk (:func:`pull_bulk_launcher`; runs natively
at EP = 1, see docs/comm-status.md).

Speed (2x H200, docs/benchmarks.md): the pull is bound by loads in flight; unrolled x8 it
reaches 300-311 GB/s (83-86% of the peer copy rate) at 128 CTAs on T 16384 and 193-205 GB/s
at 32 CTAs (the plain copy 168-177).
"""
from __future__ import annotations

import torch

from mok_cute.comm import protocol as P
from mok_cute.comm.protocol import Link, Round, cute, cutlass
from mok_cute.comm.rows import (BULK_SMEM, THREADS, Dims, Grouped, Routes, Sections, bulk_routed_rows,
                                check_transport, copy_routed_rows, copy_routed_rows_unrolled)
from mok_cute.comm.workspace import CommWorkspace, check_num_ctas, mxfp8_row_bytes
from mok_cute.dsl.compile import compile_cached, compile_kernel
from mok_cute.dsl.host import check_tensor, current_stream, dptr, fake_ptr, fake_stream
from mok_cute.schedule.plan import check_plan
from cutlass import BFloat16, Int32, Int64

PAYLOADS = ("bf16", "mxfp8")


_launchers: dict = {}

# The row-moving kernels are built per variant by Python closure (see docs/comm-status.md): no
# Constexpr kernel parameters; int64/int32/bf16 pointers and Int32/Int64 scalars only (in the
# operand bundles of :mod:`mok_cute.comm.rows`, flattened in field order); peer addresses in 64
# bits. They share the pull protocol (:func:`mok_cute.comm.protocol.pull_round`) and one host
# launcher.


def _rows_host(kernel, smem: int = 0):
    """The ``@cute.jit`` host launcher of a row pull kernel (``rnd.nctas`` CTAs of 1024 threads on
    ``stream``; ``smem`` bytes of dynamic shared memory when nonzero). The kernel's operands:
    ``link`` (the workspace's peer table, status and pull counters), ``routes`` (the plan's
    recv_src and offsets), ``grouped`` (the receive buffer, with ``w_rows`` for the weighted pull),
    ``dims``, ``offs`` (the ``src`` section, ``w`` for the weighted pull, ``flags``), ``rnd``."""

    @cute.jit
    def pull_rows_host(link: Link, routes: Routes, grouped: Grouped, dims: Dims, offs: Sections, rnd: Round,
                       stream):
        launch = kernel(link, routes, grouped, dims, offs, rnd)
        if cutlass.const_expr(smem):
            launch.launch(grid=[rnd.nctas, 1, 1], block=[THREADS, 1, 1], smem=smem, stream=stream)
        else:
            launch.launch(grid=[rnd.nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return pull_rows_host


def pull_launcher():
    """The launcher of the bf16 pull (dispatch, reverse combine; also packed MXFP8 rows):
    :func:`mok_cute.comm.protocol.pull_round` with :func:`mok_cute.comm.rows.copy_routed_rows_unrolled`
    moving the rows (kernel ``pull_kernel``)."""
    if "pull" in _launchers:
        return _launchers["pull"]

    @cute.kernel
    def pull_kernel(link: Link, routes: Routes, grouped: Grouped, dims: Dims, offs: Sections, rnd: Round):
        P.pull_round(link, dims.me, dims.ep, offs.flags, rnd,
                     lambda tidx, bidx, pb: copy_routed_rows_unrolled(
                         tidx, bidx, pb, link.status, routes, grouped, dims, offs, Int32(P.READY), rnd, False))

    _launchers["pull"] = host = _rows_host(pull_kernel)
    return host


def _fake_operands(w: bool):
    """Compile-time placeholders of a pull's bundles (with the router weights when ``w``)."""
    i32 = fake_ptr("i32")
    return (Link(fake_ptr("i64"), i32, i32), Routes(i32, i32),
            Grouped(fake_ptr("bf16"), i32 if w else None, Int32(1)),
            Dims(Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1)),
            Sections(Int64(0), Int64(0) if w else None, Int64(0)), Round(Int32(1), Int64(1), Int32(1)))


def compile_pull(arch: str, inspect: bool = False):
    """Compile the pull launcher (:func:`pull_launcher`) for ``arch``;
    returns ``(compiled, CompileReport | None)``."""
    return compile_kernel(pull_launcher(), *_fake_operands(False), fake_stream(), arch=arch, inspect=inspect)


def pull_w_launcher():
    """The launcher of the pull that also moves the router weights
    (:func:`mok_cute.comm.rows.copy_routed_rows` with ``grouped.w_rows``, kernel ``pull_w_kernel``;
    rows of ``V`` 16-byte vectors, bf16 or packed MXFP8). Closure-built like :func:`pull_launcher`."""
    if "pull_w" in _launchers:
        return _launchers["pull_w"]

    @cute.kernel
    def pull_w_kernel(link: Link, routes: Routes, grouped: Grouped, dims: Dims, offs: Sections, rnd: Round):
        P.pull_round(link, dims.me, dims.ep, offs.flags, rnd,
                     lambda tidx, bidx, pb: copy_routed_rows(
                         tidx, bidx, pb, link.status, routes, grouped, dims, offs, Int32(P.READY), rnd))

    _launchers["pull_w"] = host = _rows_host(pull_w_kernel)
    return host


def compile_pull_w(arch: str, inspect: bool = False):
    """Compile the weighted pull for ``arch``; ``(compiled, CompileReport | None)``."""
    return compile_kernel(pull_w_launcher(), *_fake_operands(True), fake_stream(), arch=arch, inspect=inspect)


def pull_bulk_launcher():
    """The launcher of the bulk-copy pull (``transport="bulk"``, without weights): the protocol of
    :func:`pull_launcher` with the rows moved by :func:`mok_cute.comm.rows.bulk_routed_rows` (thread 0
    of each CTA, cp.async.bulk peer -> shared -> ``grouped.rows``). Its own closure and kernel name
    (``pull_bulk_kernel``), the same operands, ``BULK_SMEM`` bytes of dynamic shared memory."""
    if "pull_bulk" in _launchers:
        return _launchers["pull_bulk"]

    @cute.kernel
    def pull_bulk_kernel(link: Link, routes: Routes, grouped: Grouped, dims: Dims, offs: Sections, rnd: Round):
        P.pull_round(link, dims.me, dims.ep, offs.flags, rnd,
                     lambda tidx, bidx, pb: bulk_routed_rows(
                         tidx, bidx, pb, link.status, routes, grouped, dims, offs, Int32(P.READY), rnd, False))

    _launchers["pull_bulk"] = host = _rows_host(pull_bulk_kernel, BULK_SMEM)
    return host


def compile_pull_bulk(arch: str, inspect: bool = False):
    """Compile the bulk-copy pull for ``arch``; ``(compiled, CompileReport | None)``."""
    return compile_kernel(pull_bulk_launcher(), *_fake_operands(False), fake_stream(), arch=arch, inspect=inspect)


def _check_out(out, dtype, cols: int, ws: CommWorkspace, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(ws.recv_capacity, cols, dtype=dtype, device=ws.device)
    check_tensor(name, out, dtype, (None, cols), ws.device)
    return out


def _launch_pull(ws: CommWorkspace, plan, out: torch.Tensor, out_rows: int, V: int, nctas: int,
                 w_out: torch.Tensor | None, transport: str) -> None:
    """Launch one pull of rows of ``V`` 16-byte vectors from the staged source buffers into
    ``out`` (next pull epoch): with ``w_out`` the weighted pull (:func:`pull_w_launcher`), else
    :func:`pull_bulk_launcher` (``transport="bulk"``) or :func:`pull_launcher`."""
    if w_out is not None:
        fn = compile_cached(("comm.pull_w", ws.arch), lambda: compile_pull_w(ws.arch)[0])
    elif transport == "bulk":
        fn = compile_cached(("comm.pull_bulk", ws.arch), lambda: compile_pull_bulk(ws.arch)[0])
    else:
        fn = compile_cached(("comm.pull", ws.arch), lambda: compile_pull(ws.arch)[0])
    epoch = ws.next_epoch("pull")
    w = w_out is not None
    fn(Link(dptr(ws.peer_bases), dptr(ws.status), dptr(ws.counters["pull"])),
       Routes(dptr(plan.recv_src), dptr(plan.offsets)),
       Grouped(dptr(out, BFloat16), dptr(w_out, Int32) if w else None, Int32(out_rows)),
       Dims(Int32(ws.me), Int32(ws.EP), Int32(ws.T), Int32(ws.k), Int32(V), Int32(ws.E // ws.EP)),
       Sections(Int64(ws.offsets["src"]), Int64(ws.offsets["w"]) if w else None, Int64(ws.offsets["flags"])),
       Round(Int32(epoch), Int64(ws.timeout_ns), Int32(nctas)), current_stream())


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
             w_out: torch.Tensor | None = None, transport: str = "plain"):
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
    payload and topk_w-or-not); launches on the current stream, no host sync.
    ``transport``: ``"plain"`` (default) or ``"bulk"`` (cp.async.bulk rows for the pull without
    ``topk_w``; the weighted pull always moves 16-byte vectors); ValueError otherwise."""
    return _pull_rows(ws, x, plan, payload, topk_w, num_ctas, out, w_out, "x", transport)


def _pull_rows(ws: CommWorkspace, x, plan, payload: str, topk_w, num_ctas, out, w_out, name: str,
               transport: str):
    """:func:`dispatch` (and :func:`reverse_combine`: bf16, no weights) with the source rows
    named ``name`` in the error messages."""
    check_transport(transport)
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
    _launch_pull(ws, plan, recv, rows_n, rb // 16, nctas, w_out, transport)
    res = (recv[:, :H].view(torch.float8_e4m3fn), recv[:, H:H + H // 32]) if mx else (recv,)
    if topk_w is not None:
        res = res + (w_out,)
    return res if len(res) > 1 else res[0]


def reverse_combine(ws: CommWorkspace, dy: torch.Tensor, plan, *, num_ctas: int | None = None,
                    out: torch.Tensor | None = None, transport: str = "plain") -> torch.Tensor:
    """Backward of combine by pull: ``dy`` [T, H] bf16 (this rank's output grads) -> dy rows
    of the routes this rank's experts served, [capacity, H] bf16 in plan order (unscaled:
    the expert side applies topk_w). ``transport`` as :func:`dispatch`. Collective; current
    stream, no host sync."""
    return _pull_rows(ws, dy, plan, "bf16", None, num_ctas, out, None, "dy", transport)

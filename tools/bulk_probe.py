"""Probe of the opt-in bulk (cp.async.bulk) row mover outside the comm protocol, on one GPU:

    python3 tools/bulk_probe.py minimal|mover|round|ws-plan|ws-src|ws|ws-prod|ws-rt[-me|-ep|-ep_round|-ep_move|-timeout|-none]|dispatch [threads]

``minimal``: thread 0 of one CTA copies T rows of x [T, H] bf16 to out, each row global ->
shared -> global with one cp.async.bulk each way, one at a time (``comm.rows.bulk_g2s`` /
``bulk_s2g``). ``mover``: ``comm.rows.bulk_routed_rows`` itself (the pull of the bulk
dispatch) on a 1-rank plan, rows ``out[i] = x[route_i // k]``, 8 CTAs; ``round``: the same mover
inside ``comm.protocol.pull_round`` (READY / DONE flags in the buffer after x). ``ws-plan`` /
``ws-src`` / ``ws``: the ``round`` kernel with, one at a time, the real pieces of the bulk
dispatch on a 1-rank workspace (``comm.workspace.get_workspace``): its device routing plan
(``recv_src``, ``offsets`` of E + 1 entries, capacity rows), its ``src`` section (x staged there,
read through the peer table at the section offset, flags in its ``flags`` section), or both. Both launch like the
bulk pull kernel (``BULK_SMEM`` bytes of dynamic shared memory, ``threads`` per CTA, default
1024). Prints whether out equals the torch gather; a fault aborts the process (run each
variant in its own process). ``ws-prod``: the ``ws`` arguments given to the production bulk pull
kernel (``comm.dispatch.compile_pull_bulk``) instead of the probe's; ``ws-rt``: to the probe's
kernel with ``me``, ``ep`` and the timeout as run-time arguments, as production has them; ``ws-rt-me`` / ``-ep`` / ``-timeout``: only that one at run time
(``-ep_round`` / ``-ep_move``: ep only in the round's peer loops / the mover's bounds; a
``+table`` suffix: the mover reads the peer table through a view of static layout (1);
``ws-rt-loops-S`` / ``-W`` / ``-A`` (``-0``: none): the round written out, ep run-time only in its signal / wait /
arrive loop (``-W``: the wait as the nested peer loop around ``wait_geq`` that faulted, ``-F``:
``P.wait_all``, one flat poll loop);
``-none``: none, the control; with ``MOK_PROBE_PLAIN=1`` the rows and flags lie in a plain allocation). ``dispatch``: the production bulk pull, ``comm.dispatch.dispatch``
under ``MOK_COMM_TRANSPORT=bulk_pull``, on the same workspace and plan."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuda.bindings.driver as cuda  # noqa: E402

from mok_cute.comm import protocol as P  # noqa: E402
from mok_cute.comm import rows as R  # noqa: E402
from mok_cute.comm.protocol import cute, cutlass  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402


def build(kind: str, threads: int, fixed: frozenset = frozenset()):
    """The probe's host function for ``kind``; ``fixed`` names the run-time arguments of
    ``round-rt`` traced as constants instead: ``me`` (0), ``ep_round`` / ``ep_move`` (1, in
    ``pull_round``'s peer loops / in the mover's bounds), ``timeout`` (1 s); ``table``: the mover's
    peer table a view of static layout (1) instead of ``pull_round``'s (ep,) one."""
    @cute.kernel
    def minimal_kernel(x: cute.Pointer, out: cute.Pointer, n: Int32, rb: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_array(cutlass.Int8, R.BULK_CHUNK * R.BULK_STAGES, byte_alignment=128)
        mbar = smem.allocate_array(Int64, R.BULK_STAGES, byte_alignment=8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
            for j in cutlass.range(n, unroll=1):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, rb)
                R.bulk_g2s(ring.toint(), x.toint() + Int64(j) * Int64(rb), rb, mbar.toint())
                cute.arch.mbarrier_wait(mbar, j % 2)
                R.bulk_s2g(out.toint() + Int64(j) * Int64(rb), ring.toint(), rb)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.barrier()

    @cute.kernel
    def mover_kernel(pb: cute.Pointer, status: cute.Pointer, recv_src: cute.Pointer, offsets: cute.Pointer,
                     out: cute.Pointer, rows: Int32, t: Int32, k: Int32, v: Int32, nctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        pbt = cute.make_tensor(pb, cute.make_layout(1))
        R.bulk_routed_rows(tidx, bidx, pbt, status, recv_src, offsets, out, rows, Int32(1), t, k, t * k, v, Int32(1),
                           Int64(0), Int32(1), Int32(1), nctas, False)
        cute.arch.barrier()

    @cute.kernel
    def round_kernel(pb: cute.Pointer, status: cute.Pointer, counter: cute.Pointer, recv_src: cute.Pointer,
                     offsets: cute.Pointer, out: cute.Pointer, rows: Int32, t: Int32, k: Int32, v: Int32,
                     nctas: Int32, flags_off: Int64, e_local: Int32, src_off: Int64, epoch: Int32):
        P.pull_round(pb, status, counter, Int32(0), Int32(1), flags_off, epoch, Int64(10 ** 9), nctas,
                     lambda tidx, bidx, pbt: R.bulk_routed_rows(
                         tidx, bidx, pbt, status, recv_src, offsets, out, rows, Int32(1), t, k, t * k, v, e_local,
                         src_off, Int32(P.READY), epoch, nctas, False))

    @cute.kernel
    def round_rt_kernel(pb: cute.Pointer, status: cute.Pointer, counter: cute.Pointer, recv_src: cute.Pointer,
                        offsets: cute.Pointer, out: cute.Pointer, rows: Int32, me: Int32, ep: Int32, t: Int32, k: Int32,
                        v: Int32, e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32, timeout_ns: Int64,
                        nctas: Int32):
        if cutlass.const_expr("me" in fixed):
            me = Int32(0)
        ep_round, ep_move = ep, ep  # ep of pull_round's peer loops / of the mover's bounds
        if cutlass.const_expr("ep_round" in fixed):
            ep_round = Int32(1)
        if cutlass.const_expr("ep_move" in fixed):
            ep_move = Int32(1)
        if cutlass.const_expr("timeout" in fixed):
            timeout_ns = Int64(10 ** 9)
        if cutlass.const_expr(any(f.startswith("loops") for f in fixed)):  # pull_round inline, ep per loop
            _round_by_loop(pb, status, counter, recv_src, offsets, out, rows, t, k, v, e_local, src_off, flags_off,
                           epoch, timeout_ns, nctas, ep, fixed)
            return
        P.pull_round(pb, status, counter, me, ep_round, flags_off, epoch, timeout_ns, nctas,
                     lambda tidx, bidx, pbt: R.bulk_routed_rows(
                         tidx, bidx, cute.make_tensor(pb, cute.make_layout(1)) if "table" in fixed else pbt,
                         status, recv_src, offsets, out, rows, ep_move, t, k, t * k, v, e_local,
                         src_off, Int32(P.READY), epoch, nctas, False))

    @cute.jit
    def host_round_rt(pb: cute.Pointer, status: cute.Pointer, counter: cute.Pointer, recv_src: cute.Pointer,
                      offsets: cute.Pointer, out: cute.Pointer, rows: Int32, me: Int32, ep: Int32, t: Int32, k: Int32,
                      v: Int32, e_local: Int32, src_off: Int64, flags_off: Int64, epoch: Int32, timeout_ns: Int64,
                      nctas: Int32, stream):
        round_rt_kernel(pb, status, counter, recv_src, offsets, out, rows, me, ep, t, k, v, e_local, src_off,
                        flags_off, epoch, timeout_ns, nctas).launch(grid=[nctas, 1, 1], block=[threads, 1, 1],
                                                                   smem=R.BULK_SMEM, stream=stream)

    @cute.jit
    def host_round(pb: cute.Pointer, status: cute.Pointer, counter: cute.Pointer, recv_src: cute.Pointer,
                   offsets: cute.Pointer, out: cute.Pointer, rows: Int32, t: Int32, k: Int32, v: Int32, nctas: Int32,
                   flags_off: Int64, e_local: Int32, src_off: Int64, epoch: Int32, stream):
        round_kernel(pb, status, counter, recv_src, offsets, out, rows, t, k, v, nctas, flags_off, e_local, src_off,
                     epoch).launch(grid=[nctas, 1, 1], block=[threads, 1, 1], smem=R.BULK_SMEM, stream=stream)

    @cute.jit
    def host_minimal(x: cute.Pointer, out: cute.Pointer, n: Int32, rb: Int32, stream):
        minimal_kernel(x, out, n, rb).launch(grid=[1, 1, 1], block=[threads, 1, 1], smem=R.BULK_SMEM, stream=stream)

    @cute.jit
    def host_mover(pb: cute.Pointer, status: cute.Pointer, recv_src: cute.Pointer, offsets: cute.Pointer,
                   out: cute.Pointer, rows: Int32, t: Int32, k: Int32, v: Int32, nctas: Int32, stream):
        mover_kernel(pb, status, recv_src, offsets, out, rows, t, k, v, nctas).launch(
            grid=[nctas, 1, 1], block=[threads, 1, 1], smem=R.BULK_SMEM, stream=stream)

    return {"minimal": host_minimal, "mover": host_mover, "round": host_round, "round-rt": host_round_rt}[kind]


@cute.jit
def _round_by_loop(pb, status, counter, recv_src, offsets, out, rows, t, k, v, e_local, src_off, flags_off, epoch,
                   timeout_ns, nctas, ep, fixed: cutlass.Constexpr):
    """``P.pull_round``'s body at me 0 with the bulk mover, ``ep`` run-time in the loops named in
    ``fixed`` (``loops-S``: signal_all, ``loops-F``: wait_all, ``loops-A``: arrive_and_signal;
    ``loops-W``: the wait as the nested loop it was, :func:`_wait_all_nested`), the constant 1 in
    the others; the peer table a view of static layout (1)."""
    ep_s = ep if cutlass.const_expr("loops-S" in fixed) else Int32(1)
    ep_f = ep if cutlass.const_expr("loops-F" in fixed) else Int32(1)
    ep_a = ep if cutlass.const_expr("loops-A" in fixed) else Int32(1)
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    pbt = cute.make_tensor(pb, cute.make_layout(1))
    if tidx == 0:
        if bidx == 0:
            P.signal_all(pbt, flags_off, Int32(P.READY), Int32(0), ep_s, epoch)
        if cutlass.const_expr("loops-W" in fixed):
            _wait_all_nested(pbt[0] + flags_off, Int32(P.READY), ep, epoch, timeout_ns, status)
        else:
            P.wait_all(pbt[0] + flags_off, Int32(P.READY), ep_f, epoch, timeout_ns, status)
    cute.arch.barrier()
    if not P.failed(status):
        R.bulk_routed_rows(tidx, bidx, pbt, status, recv_src, offsets, out, rows, Int32(1), t, k, t * k, v, e_local,
                           src_off, Int32(P.READY), epoch, nctas, False)
    cute.arch.barrier()
    if tidx == 0:
        P.arrive_and_signal(pbt, status, counter, counter, 1, flags_off, Int32(P.DONE), Int32(0), ep_a,
                            epoch, nctas)


@cute.jit
def _wait_all_nested(flags_local, channel, ep, target, timeout_ns, status):
    """``P.wait_all`` as it was before session 12: a peer loop around ``P.wait_geq`` (with a run-time
    ``ep`` it faults natively in this kernel; the flat loop of ``P.wait_all`` does not)."""
    from mok_cute.comm.protocol import gptr

    row = gptr(Int32, flags_local + Int64(channel * ep) * 4)
    ok = cutlass.Boolean(True)
    for q in range(ep):
        if ok:
            ok = P.wait_geq(row + q, target, timeout_ns, status, q, channel)


def main() -> int:
    from mok_cute.dsl.compile import compile_kernel
    from mok_cute.dsl.host import dptr as _p, fake_ptr, fake_stream

    kind = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    t, h, k = 256, 512, 4
    dev = torch.device("cuda")
    x = torch.randn(t, h, device=dev).bfloat16()
    st = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    if kind == "minimal":
        c, _ = compile_kernel(build(kind, threads), fake_ptr("bf16"), fake_ptr("bf16"), Int32(1), Int32(16),
                              fake_stream(), arch="sm_90a")
        out = torch.zeros_like(x)
        c(_p(x), _p(out), Int32(t), Int32(2 * h), st)
        want = x
    elif kind.startswith("ws"):
        out, want = _with_workspace(kind, x, threads, t, h, k, st)
    elif kind == "dispatch":  # the production bulk pull itself (comm.dispatch), same 1-rank workspace
        out, want = _dispatch(x, t, h, k)
    elif kind == "round":  # the mover inside the pull protocol, x and 4 KiB of flags in one buffer
        buf = torch.zeros(t * h * 2 + 4096, dtype=torch.uint8, device=dev)
        buf[: t * h * 2].view(torch.bfloat16).view(t, h).copy_(x)
        routes = torch.randperm(t * k, device=dev)[: t * 3].to(torch.int32)
        offsets = torch.tensor([0, routes.numel()], dtype=torch.int32, device=dev)
        pb = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=dev)
        status = torch.zeros(4, dtype=torch.int32, device=dev)
        counter = torch.zeros(4, dtype=torch.int32, device=dev)
        out = torch.zeros(routes.numel(), h, dtype=torch.bfloat16, device=dev)
        c, _ = compile_kernel(build(kind, threads), fake_ptr("i64"), fake_ptr("i32"), fake_ptr("i32"), fake_ptr("i32"),
                              fake_ptr("i32"), fake_ptr("bf16"), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
                              Int64(0), Int32(1), Int64(0), Int32(1), fake_stream(), arch="sm_90a")
        c(_p(pb), _p(status), _p(counter), _p(routes), _p(offsets), _p(out), Int32(routes.numel()), Int32(t),
          Int32(k), Int32(h // 8), Int32(8), Int64(t * h * 2), Int32(1), Int64(0), Int32(1), st)
        want = x[(routes // k).long()]
    else:
        routes = torch.randperm(t * k, device=dev)[: t * 3].to(torch.int32)
        offsets = torch.tensor([0, routes.numel()], dtype=torch.int32, device=dev)
        pb = torch.tensor([x.data_ptr()], dtype=torch.int64, device=dev)
        status = torch.zeros(4, dtype=torch.int32, device=dev)
        out = torch.zeros(routes.numel(), h, dtype=torch.bfloat16, device=dev)
        c, _ = compile_kernel(build(kind, threads), fake_ptr("i64"), fake_ptr("i32"), fake_ptr("i32"), fake_ptr("i32"),
                              fake_ptr("bf16"), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), fake_stream(),
                              arch="sm_90a")
        c(_p(pb), _p(status), _p(routes), _p(offsets), _p(out), Int32(routes.numel()), Int32(t), Int32(k),
          Int32(h // 8), Int32(8), st)
        want = x[(routes // k).long()]
    torch.cuda.synchronize()
    print(f"bulk probe {kind} threads {threads}: out == want: {torch.equal(out, want)}", flush=True)
    return 0


def _with_workspace(kind: str, x, threads: int, t: int, h: int, k: int, st):
    """The ``round`` kernel with the workspace's plan (``ws-plan``), source section (``ws-src``) or
    both (``ws``); returns ``(out, want)``."""
    import os

    from mok_cute.comm.workspace import get_workspace
    from mok_cute.dsl.compile import compile_kernel
    from mok_cute.dsl.host import dptr as _p, fake_ptr, fake_stream
    from mok_cute.schedule.plan import plan_routing_device

    _one_rank_group(x.device)
    dev, e = x.device, 8
    idx = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    ws = get_workspace(None, T=t, H=h, k=k, E=e)
    rt = kind.startswith("ws-rt")
    if kind in ("ws-plan", "ws", "ws-prod") or rt:
        plan = plan_routing_device(ws, idx)
        routes, offsets, e_local, rows = plan.recv_src, plan.offsets, e, plan.recv_src.shape[0]
    else:
        flat = idx.reshape(-1)
        routes = torch.argsort(flat, stable=True).to(torch.int32)
        offsets = torch.tensor([0, routes.numel()], dtype=torch.int32, device=dev)
        e_local, rows = 1, routes.numel()
    # MOK_PROBE_PLAIN=1: the source rows and flags in a plain allocation instead of the symmetric one
    ws_src = (kind in ("ws-src", "ws", "ws-prod") or rt) and os.environ.get("MOK_PROBE_PLAIN") != "1"
    if ws_src:
        ws.acquire_src().copy_(x)
        pb, src_off, flags_off = ws.peer_bases, ws.offsets["src"], ws.offsets["flags"]
        buf = None
    else:
        buf = torch.zeros(t * h * 2 + 4096, dtype=torch.uint8, device=dev)
        buf[: t * h * 2].view(torch.bfloat16).view(t, h).copy_(x)
        pb, src_off, flags_off = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=dev), 0, t * h * 2
    status = torch.zeros(4, dtype=torch.int32, device=dev)
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    out = torch.zeros(rows, h, dtype=torch.bfloat16, device=dev)
    print(f"addresses: buf={ws.buf.data_ptr():#x} peer_bases={[hex(a) for a in ws.peer_bases.tolist()]} "
          f"peer_bases_ptr={ws.peer_bases.data_ptr():#x} pb_ptr={pb.data_ptr():#x} src_off={src_off} "
          f"flags_off={flags_off} status_ptr={status.data_ptr():#x}", flush=True)
    epoch = ws.next_epoch("pull") if ws_src else 1
    if kind == "ws-prod" or rt:  # the production bulk pull kernel, or the probe's with me / ep / timeout
        from mok_cute.comm.dispatch import compile_pull_bulk  # given at run time, on these arguments

        if kind == "ws-prod":
            c, _ = compile_pull_bulk("sm_90a")
        else:
            i32 = fake_ptr("i32")
            # ws-rt: all three at run time; ws-rt-me / -ep / -timeout: only that one
            names = {"me": {"me"}, "ep": {"ep_round", "ep_move"}, "ep_round": {"ep_round"},
                     "ep_move": {"ep_move"}, "timeout": {"timeout"}, "none": set()}
            name = kind[len("ws-rt-"):]
            if name.startswith("loops-"):  # ws-rt-loops-S / -W / -A: ep run-time in that loop of the round only
                names[name] = set()
                fixed_extra = {name}
            else:
                fixed_extra = set()
            table = name.endswith("+table")  # the mover's peer table of static layout (1) (ep = 1 only)
            name = name[:-len("+table")] if table else name
            fixed = frozenset({"me", "ep_round", "ep_move", "timeout"} - names[name]) if kind != "ws-rt" else frozenset()
            fixed = (fixed | {"table"} if table else fixed) | fixed_extra
            c, _ = compile_kernel(build("round-rt", threads, fixed), fake_ptr("i64"), i32, i32, i32, i32, fake_ptr("bf16"),
                                  Int32(1), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int64(0),
                                  Int64(0), Int32(1), Int64(1), Int32(1), fake_stream(), arch="sm_90a")
        c(_p(pb), _p(status), _p(counter), _p(routes), _p(offsets), _p(out), Int32(rows), Int32(0), Int32(1),
          Int32(t), Int32(k), Int32(h // 8), Int32(e_local), Int64(src_off), Int64(flags_off), Int32(epoch),
          Int64(10 ** 9), Int32(8), st)
    else:
        c, _ = compile_kernel(build("round", threads), fake_ptr("i64"), fake_ptr("i32"), fake_ptr("i32"),
                              fake_ptr("i32"), fake_ptr("i32"), fake_ptr("bf16"), Int32(1), Int32(1), Int32(1),
                              Int32(1), Int32(1), Int64(0), Int32(1), Int64(0), Int32(1), fake_stream(), arch="sm_90a")
        c(_p(pb), _p(status), _p(counter), _p(routes), _p(offsets), _p(out), Int32(rows), Int32(t), Int32(k),
          Int32(h // 8), Int32(8), Int64(flags_off), Int32(e_local), Int64(src_off), Int32(epoch), st)
    torch.cuda.synchronize()
    m = int(offsets[-1])
    assert not int(status.abs().sum()), f"status {status.tolist()}"
    return out[:m], x[(routes[:m].long() // k)]


def _dispatch(x, t: int, h: int, k: int):
    """``comm.dispatch.dispatch`` under ``MOK_COMM_TRANSPORT=bulk_pull`` on the ``ws`` probe's
    1-rank workspace and plan; returns ``(out, want)`` over the plan's rows."""
    import os

    from mok_cute.comm.dispatch import dispatch
    from mok_cute.comm.workspace import get_workspace
    from mok_cute.schedule.plan import plan_routing_device

    os.environ["MOK_COMM_TRANSPORT"] = "bulk_pull"
    _one_rank_group(x.device)
    idx = torch.stack([torch.randperm(8, device=x.device)[:k] for _ in range(t)])
    ws = get_workspace(None, T=t, H=h, k=k, E=8, num_ctas=8)
    plan = plan_routing_device(ws, idx)
    out = dispatch(ws, x, plan, num_ctas=8)
    torch.cuda.synchronize()
    ws.check_status()
    m = int(plan.offsets[-1])
    return out[:m], x[(plan.recv_src[:m].long() // k)]


def _one_rank_group(dev) -> None:
    """A 1-rank NCCL group (the workspace is collective)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)


if __name__ == "__main__":
    sys.exit(main())

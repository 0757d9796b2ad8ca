"""Device check of the EP communication kernels (plan, dispatch, combine, reverse paths).

Run with ``torchrun --nproc_per_node=2 tools/gpu_check.py comm``, or on one GPU without
torchrun (``python3 tools/gpu_check.py comm``: EP = 1, a 1-rank group, same kernels). Every
rank builds every rank's inputs from fixed seeds, so each rank computes its references
locally: plan == the pure-torch mirror, pulls == torch gathers in plan order, pushes ==
the fixed-order formula in torch; all bitwise, repeated, and across CTA counts. Then a
stalled peer must raise RuntimeError within the timeout, and dispatch/combine are timed
at 4096 tokens x H 7168 x k 8.

Environment: ``MOK_COMM_QUICK=1`` (first case only), ``MOK_COMM_DEBUG=1`` (sync + status
check after every kernel), ``MOK_COMM_EAGER=1`` (``CUDA_MODULE_LOADING=EAGER``). The
driver reads CUDA_MODULE_LOADING once, at CUDA init, and tools/gpu_check.py initializes
CUDA before this module runs, so ``MOK_COMM_EAGER=1`` sets it as early as this module can
(import time and first thing in :func:`run`) and warns when CUDA is already up; for a
guaranteed eager run put ``CUDA_MODULE_LOADING=EAGER`` in the command itself.
``MOK_COMM_CHECK_TRANSPORT=bulk`` (a separate invocation, so that a fault cannot take down the
default checks): the same rows with ``transport="bulk"`` passed to every comm op (cp.async.bulk
kernels for the pulls without weights, combine and reverse dispatch; the weighted dispatch keeps
plain loads); rows are named ``bulk...`` instead of ``comm...``. First run it as
``MOK_COMM_CHECK_TRANSPORT=bulk MOK_COMM_QUICK=1 MOK_COMM_DEBUG=1 CUDA_LAUNCH_BLOCKING=1 torchrun
--nproc_per_node=2 tools/gpu_check.py comm``.
``MOK_COMM_PULL_TWICE=1``: per case only plan, dispatch, dispatch, reverse_combine (the pull
kernel launched 3 times on one workspace, synced and checked after each), then stop.

Rows per case (names shortened: rnd = random routing, disp+w = dispatch with topk_w, mx =
MXFP8 dispatch): plan==mirror; dispatch, disp+w rows / w_rows (route_weights mirror, 0 past
M), mx data / scales (bytes == the torch gather of the same e4m3 / E8M0 bytes), mx+w;
combine, combine+sh, rev_combine, rev_dispatch; 5 repeats at 4..32 CTAs bitwise.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tools.checks.common import Ctx, Row, bench_us
from mok_cute.comm import protocol as P
from mok_cute.comm.combine import combine, reverse_dispatch
from mok_cute.comm.dispatch import dispatch, reverse_combine
from mok_cute.comm.planner import plan_routing_device
from mok_cute.comm.rows import check_transport
from mok_cute.comm.workspace import get_workspace
from mok_cute.schedule.plan import RankPlan, plan_routing, route_weights

BF16 = torch.bfloat16


def _eager_loading() -> None:
    """MOK_COMM_EAGER=1: CUDA_MODULE_LOADING=EAGER (effective only before CUDA init)."""
    if os.environ.get("MOK_COMM_EAGER", "0") != "1":
        return
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    if torch.cuda.is_initialized():
        print("[comm] MOK_COMM_EAGER=1 but CUDA is already initialized: module loading stays "
              f"{os.environ.get('CUDA_MODULE_LOADING')!r} only if it was set in the command "
              "(put CUDA_MODULE_LOADING=EAGER in the command line)", flush=True)


_eager_loading()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(ctx: Ctx) -> None:
    """Join (or, without torchrun, create) the process group: one process is a 1-rank group
    (EP = 1: the same kernels, every route local)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port() if ctx.world == 1 else 29561)
    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world))
    dist.init_process_group("nccl", device_id=ctx.device)


def _gen(seed: int, dev):
    return torch.Generator(device=dev).manual_seed(seed)


def _routing(case: str, p: int, T: int, k: int, E: int, dev) -> torch.Tensor:
    g = _gen(1000 + p, dev)
    if case == "hot":
        return torch.full((T, k), E - 1, dtype=torch.int64, device=dev)
    if case == "rank0_empty" and p == 0:
        return torch.full((T, k), -1, dtype=torch.int64, device=dev)
    idx = torch.rand(T, E, generator=g, device=dev).topk(k, dim=1).indices
    drop = torch.rand(T, k, generator=g, device=dev) < 0.1
    return torch.where(drop, -1, idx)


def _randn(seed: int, shape, dev, dtype=BF16):
    return torch.randn(*shape, generator=_gen(seed, dev), device=dev, dtype=torch.float32).to(dtype)


def _ref_reduce(slots, valid, w, start):
    """Fixed-order reference: acc = fp32(start) or 0; acc = acc + w_j * fp32(slot_j)."""
    T, k, H = slots.shape
    acc = start.float() if start is not None else torch.zeros(T, H, device=slots.device)
    for j in range(k):
        term = slots[:, j].float()
        if w is not None:
            term = w[:, j:j + 1] * term
        acc = torch.where(valid[:, j:j + 1], acc + term, acc)
    return acc.to(BF16)


# short row names (the table shows 44 characters of a name)
_CASE = {"random": "rnd", "rank0_empty": "r0empty"}
_LABEL = {"combine+shared": "combine+sh", "reverse_combine": "rev_combine",
          "reverse_dispatch": "rev_dispatch", "dispatch+topk_w rows": "disp+w rows",
          "dispatch+topk_w w_rows": "disp+w w_rows", "dispatch mxfp8 data": "mx data",
          "dispatch mxfp8 scales": "mx scales", "dispatch mxfp8+topk_w data": "mx+w data",
          "dispatch mxfp8+topk_w scales": "mx+w scales", "dispatch mxfp8+topk_w w_rows": "mx+w w"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor (float8 has no torch.equal on every build)."""
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _eq(name, got, ref, note="") -> Row:
    got, ref = _bytes(got), _bytes(ref)
    same = got.shape == ref.shape and torch.equal(got, ref)
    err = None
    if got.shape == ref.shape and got.is_floating_point() and got.numel():
        err = float((got.float() - ref.float()).abs().nan_to_num(float("inf")).max())
    if not same and got.shape == ref.shape and got.numel():
        bad = (got != ref) if got.dim() < 2 else (got != ref).reshape(got.shape[0], -1).any(1)
        rows_bad = bad.nonzero().flatten()
        note = (f"{note} {int(rows_bad.numel())}/{got.shape[0]} rows differ, first at "
                f"{rows_bad[:4].tolist()}").strip()
    elif not same:
        note = f"{note} shape {tuple(got.shape)} vs ref {tuple(ref.shape)}".strip()
    return Row(name, max_err=err, bitwise=same, ok=same, note=note)


DEBUG = os.environ.get("MOK_COMM_DEBUG", "0") == "1"
# the comm ops' transport in this run (run() sets it from MOK_COMM_CHECK_TRANSPORT)
TRANSPORT = {"transport": "plain"}
# isolate the 2nd launch of the pull kernel: plan, dispatch, dispatch, reverse_combine, stop
PULL_TWICE = os.environ.get("MOK_COMM_PULL_TWICE", "0") == "1"


def _log(ctx: Ctx, msg: str) -> None:
    if DEBUG:
        print(f"[comm rank {ctx.rank}] {msg}", flush=True)


def _sync(ctx: Ctx, ws, what: str) -> None:
    """Debug mode: synchronize and check the status after every kernel, naming it."""
    if DEBUG:
        torch.cuda.synchronize()
        ws.check_status()
        _log(ctx, f"{what}: ok")


def _mirror_plan(ws, view) -> RankPlan:
    """The pure-torch plan of this rank as a device RankPlan (recv_src padded to capacity)."""
    dev = ws.device
    rs = torch.zeros(ws.recv_capacity, dtype=torch.int32)
    rs[:view.recv_src.numel()] = view.recv_src
    return RankPlan(view.rank, view.E, view.EP, view.T, view.k, view.counts.to(dev),
                    view.offsets.to(dev), rs.to(dev), view.dest_rank.to(dev), view.dest_row.to(dev))


def _plan_diff(plan, view, M: int) -> list[str]:
    bad = []
    for name, a, b in [("counts", plan.counts, view.counts), ("offsets", plan.offsets, view.offsets),
                       ("recv_src", plan.recv_src[:M], view.recv_src),
                       ("dest_rank", plan.dest_rank, view.dest_rank),
                       ("dest_row", plan.dest_row, view.dest_row)]:
        a = a.cpu()
        if a.shape != b.shape or not torch.equal(a, b):
            where = (a != b).nonzero()[:3].tolist() if a.shape == b.shape else f"shape {tuple(a.shape)}"
            bad.append(f"{name} differs at {where}")
    return bad


def _probe(ctx: Ctx, ws) -> None:
    """Debug: touch every byte of every rank's workspace through torch (handle.get_buffer):
    read all, then zero the (still unused) slot section of every peer."""
    so = ws.offsets["slots"]
    bufs = [ws.handle.get_buffer(q, (ws.sym_bytes,), torch.uint8, ws.sym_offsets[q])
            for q in range(ws.EP)]
    for q, t in enumerate(bufs):
        _log(ctx, f"probe rank {q}: torch ptr {t.data_ptr():#x} vs ours {ws.peer_addrs[q]:#x}")
        int(t[:so].sum())
        torch.cuda.synchronize()
        int(t[so:].sum())
        torch.cuda.synchronize()
        _log(ctx, f"probe rank {q}: read all {ws.sym_bytes} bytes ok")
    dist.barrier()
    for q, t in enumerate(bufs):
        t[so:].zero_()
        torch.cuda.synchronize()
        _log(ctx, f"probe rank {q}: wrote slots ok")
    dist.barrier()


def _correctness(ctx: Ctx, case: str, T: int, H: int, k: int, E: int) -> list[Row]:
    me, EP, dev = ctx.rank, ctx.world, ctx.device
    ws = get_workspace(T=T, H=H, k=k, E=E, timeout_s=20.0, num_ctas=8)
    _log(ctx, f"workspace {ws.describe()}")
    idx_all = [_routing(case, p, T, k, E, dev) for p in range(EP)]
    spec = plan_routing(idx_all, E, EP)
    view = spec.rank_view(me)
    M = int(view.offsets[-1])
    tag = f"comm[{_CASE.get(case, case)} T{T} H{H} k{k} E{E}]"
    rows = []

    plan = plan_routing_device(ws, idx_all[me])
    ws.check_status()
    _log(ctx, "plan: ok")
    diff = _plan_diff(plan, view, M)
    ok = not diff
    rows.append(Row(f"{tag} plan==mirror", bitwise=ok, ok=ok, note=f"M_recv={M} " + "; ".join(diff)))
    if diff:  # keep testing the data paths with the correct plan
        _log(ctx, f"plan mismatch: {diff}")
        plan = _mirror_plan(ws, view)
    if DEBUG:
        _probe(ctx, ws)

    trip = spec.recv_triples(me).to(dev)
    x_all = [_randn(10 + p, (T, H), dev) for p in range(EP)]
    cap = ws.recv_capacity
    eo_all = [_randn(20 + r, (cap, H), dev) for r in range(EP)]
    w_all = [torch.rand(T, k, generator=_gen(30 + p, dev), device=dev) for p in range(EP)]
    sh_all = [_randn(40 + p, (T, H), dev) for p in range(EP)]
    dy_all = [_randn(50 + p, (T, H), dev) for p in range(EP)]
    dxe_all = [_randn(60 + r, (cap, H), dev) for r in range(EP)]
    # MXFP8 payload: random e4m3 bytes and E8M0 scale bytes (moved, never interpreted)
    q_all = [torch.randint(0, 256, (T, H), generator=_gen(70 + p, dev), device=dev,
                           dtype=torch.uint8).view(torch.float8_e4m3fn) for p in range(EP)]
    s_all = [torch.randint(0, 256, (T, H // 32), generator=_gen(80 + p, dev), device=dev,
                           dtype=torch.uint8) for p in range(EP)]

    def gather(src_all):
        return torch.stack([_bytes(t) for t in src_all])[trip[:, 0], trip[:, 1]]

    dr, dw = view.dest_rank.to(dev).long(), view.dest_row.to(dev).long()
    valid = dr >= 0

    def slots_of(rows_all):
        stack = torch.stack(rows_all)                               # [EP, cap, H]
        return stack[dr.clamp(min=0), dw.clamp(min=0)]              # [T, k, H]

    w_rows_ref = route_weights(view.recv_src.to(dev), view.offsets.to(dev), torch.stack(w_all))
    w_rows_ref = torch.cat([w_rows_ref, torch.zeros(cap - M, device=dev)])
    refs = {
        "dispatch": gather(x_all),
        "dispatch+topk_w rows": gather(x_all),
        "dispatch+topk_w w_rows": w_rows_ref,
        "dispatch mxfp8 data": gather(q_all),
        "dispatch mxfp8 scales": gather(s_all),
        "dispatch mxfp8+topk_w data": gather(q_all),
        "dispatch mxfp8+topk_w scales": gather(s_all),
        "dispatch mxfp8+topk_w w_rows": w_rows_ref,
        "combine": _ref_reduce(slots_of(eo_all), valid, w_all[me], None),
        "combine+shared": _ref_reduce(slots_of(eo_all), valid, w_all[me], sh_all[me]),
        "reverse_combine": gather(dy_all),
        "reverse_dispatch": _ref_reduce(slots_of(dxe_all), valid, None, sh_all[me]),
    }

    if PULL_TWICE:  # the pull kernel alone, launched 3 times in a row on one workspace
        for n, (name, src_all) in enumerate([("dispatch", x_all), ("dispatch again", x_all),
                                             ("reverse_combine", dy_all)]):
            got = (dispatch if src_all is x_all else reverse_combine)(ws, src_all[me], plan,
                                                                      num_ctas=8, **TRANSPORT)[:M]
            torch.cuda.synchronize()
            ws.check_status()
            _log(ctx, f"pull #{n + 1} {name} (epoch {ws.epoch['pull']}): ok")
            rows.append(_eq(f"{tag} pull-twice #{n + 1} {name}", got, gather(src_all)))
        return rows

    def step(num_ctas):
        def mx(with_w):
            res = dispatch(ws, (q_all[me], s_all[me]), plan, payload="mxfp8", num_ctas=num_ctas,
                           topk_w=w_all[me] if with_w else None, **TRANSPORT)
            return (res[0][:M], res[1][:M]) + tuple(res[2:])

        ops = {
            "dispatch": lambda: dispatch(ws, x_all[me], plan, num_ctas=num_ctas, **TRANSPORT)[:M],
            "dispatch+topk_w": lambda: (lambda r: (r[0][:M], r[1]))(
                dispatch(ws, x_all[me], plan, topk_w=w_all[me], num_ctas=num_ctas, **TRANSPORT)),
            "dispatch mxfp8": lambda: mx(False),
            "dispatch mxfp8+topk_w": lambda: mx(True),
            "combine": lambda: combine(ws, eo_all[me], w_all[me], plan, num_ctas=num_ctas, **TRANSPORT),
            "combine+shared": lambda: combine(ws, eo_all[me], w_all[me], plan, sh_all[me],
                                              num_ctas=num_ctas, **TRANSPORT),
            "reverse_combine": lambda: reverse_combine(ws, dy_all[me], plan, num_ctas=num_ctas, **TRANSPORT)[:M],
            "reverse_dispatch": lambda: reverse_dispatch(ws, dxe_all[me], plan, sh_all[me],
                                                         num_ctas=num_ctas, **TRANSPORT),
        }
        parts = {"dispatch+topk_w": ("rows", "w_rows"), "dispatch mxfp8": ("data", "scales"),
                 "dispatch mxfp8+topk_w": ("data", "scales", "w_rows")}
        out = {}
        for name, op in ops.items():
            res = op()
            _sync(ctx, ws, f"{name} ({num_ctas} CTAs)")
            if name in parts:
                out.update({f"{name} {part}": _bytes(t) for part, t in zip(parts[name], res)})
            else:
                out[name] = res
        return out

    first = step(8)
    ws.check_status()
    for name, ref in refs.items():
        rows.append(_eq(f"{tag} {_LABEL.get(name, name)}", first[name], ref))
    same = True
    for rep in range(5):
        out = step([4, 8, 16, 32, 8][rep])
        ws.check_status()
        same &= all(torch.equal(out[n], first[n]) for n in first)
    plan2 = plan_routing_device(ws, idx_all[me])
    ws.check_status()
    same &= torch.equal(plan2.recv_src[:M], plan.recv_src[:M]) and torch.equal(plan2.dest_row, plan.dest_row)
    rows.append(Row(f"{tag} 5 reps 4..32CTA", bitwise=same, ok=same,
                    note="every op above, bitwise == 1st run"))
    return rows


def _stall(ctx: Ctx) -> Row:
    """One rank skips a step: the others must raise RuntimeError naming it within the timeout."""
    timeout = 2.0
    ws = get_workspace(T=16, H=64, k=2, E=2 * ctx.world, timeout_s=timeout, num_ctas=4)
    dev = ctx.device
    if ctx.world == 1:  # nobody can stall: wait for a flag no one will set
        t0 = time.time()
        try:
            ws.wait_flags(P.READY, ws.epoch["pull"] + 5)
            ws.check_status()
            return Row("comm stalled peer (1 rank: unset flag)", ok=False, note="no error raised")
        except RuntimeError as e:
            dt = time.time() - t0
            ok = "peer rank 0" in str(e) and dt < timeout + 5
            return Row("comm stalled peer (1 rank: unset flag)", time_us=dt * 1e6, ok=ok, note=str(e)[:60])
    idx = _routing("random", ctx.rank, 16, 2, 2 * ctx.world, dev)
    plan = plan_routing_device(ws, idx)
    ws.check_status()
    x = torch.zeros(16, 64, dtype=BF16, device=dev)
    stalled = 1
    row = Row(f"comm stalled peer (rank {stalled} skips)", ok=True, note="skipped the step")
    if ctx.rank != stalled:
        t0 = time.time()
        try:
            dispatch(ws, x, plan, **TRANSPORT)
            ws.check_status()
            row = Row(f"comm stalled peer (rank {stalled} skips)", ok=False, note="no error raised")
        except RuntimeError as e:
            dt = time.time() - t0
            ok = f"peer rank {stalled}" in str(e) and dt < timeout + 5
            row = Row(f"comm stalled peer (rank {stalled} skips)", time_us=dt * 1e6, ok=ok,
                      note=str(e)[:60])
    torch.cuda.synchronize()
    dist.barrier()
    return row


def _timing(ctx: Ctx) -> list[Row]:
    me, EP, dev = ctx.rank, ctx.world, ctx.device
    T, H, k, E = 4096, 7168, 8, 32 * EP
    ws = get_workspace(T=T, H=H, k=k, E=E, timeout_s=20.0, num_ctas=32)
    idx_all = [_routing("random", p, T, k, E, dev) for p in range(EP)]
    spec = plan_routing(idx_all, E, EP)
    srcs = spec.recv_triples(me)[:, 0]
    # bytes that cross NVLink; with one rank every row is local and counted instead
    rows_moved = int((srcs != me).sum()) if EP > 1 else int(srcs.numel())
    pulled_remote = rows_moved * H * 2
    pushed_remote = pulled_remote  # the rows we pull are the rows we push back
    where = "remote rows" if EP > 1 else "local rows, EP=1"
    plan = plan_routing_device(ws, idx_all[me])
    x = _randn(10 + me, (T, H), dev)
    eo = _randn(20 + me, (ws.recv_capacity, H), dev)
    w = torch.rand(T, k, generator=_gen(30 + me, dev), device=dev)
    ws.check_status()
    rows = []
    t_plan = bench_us(lambda: plan_routing_device(ws, idx_all[me]))
    rows.append(Row("comm plan T4096 k8", time_us=t_plan, note=f"E={E}"))
    src = ws.acquire_src()
    src.copy_(x)
    for nctas in (8, 16, 32):
        t = bench_us(lambda: dispatch(ws, src, plan, num_ctas=nctas, **TRANSPORT))
        rows.append(Row(f"comm dispatch pull {nctas} CTAs", time_us=t,
                        note=f"{pulled_remote / t / 1e3:.0f} GB/s in ({where})"))
        t = bench_us(lambda: combine(ws, eo, w, plan, num_ctas=nctas, **TRANSPORT))
        rows.append(Row(f"comm combine push+reduce {nctas} CTAs", time_us=t,
                        note=f"{pushed_remote / t / 1e3:.0f} GB/s out ({where})"))
    t = bench_us(lambda: dispatch(ws, x, plan, **TRANSPORT))
    rows.append(Row("comm dispatch incl. staging copy", time_us=t,
                    note=f"{pulled_remote / t / 1e3:.0f} GB/s in"))
    xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.randint(0, 256, (T, H // 32), generator=_gen(80 + me, dev), device=dev,
                       dtype=torch.uint8)
    mx_bytes = rows_moved * (H + H // 32)
    t = bench_us(lambda: dispatch(ws, (xq, xs), plan, payload="mxfp8", **TRANSPORT))
    rows.append(Row("comm dispatch mxfp8 incl. staging", time_us=t,
                    note=f"{mx_bytes / t / 1e3:.0f} GB/s in ({where})"))
    t = bench_us(lambda: dispatch(ws, x, plan, topk_w=w))
    rows.append(Row("comm dispatch +topk_w incl. staging", time_us=t,
                    note=f"{pulled_remote / t / 1e3:.0f} GB/s in"))
    ws.check_status()
    return rows


def _guard(ctx: Ctx, name: str, fn) -> list[Row]:
    """Run one group of checks; a RuntimeError (comm status) becomes a failed row."""
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except RuntimeError as e:
        if "CUDA" in str(e) or "cuda" in type(e).__name__.lower():
            raise  # a device fault poisons the context: stop here
        _log(ctx, f"{name} raised {e}")
        return [Row(f"{name} raised", ok=False, note=str(e)[:100])]


def run(ctx: Ctx) -> list[Row]:
    try:
        tr = check_transport(os.environ.get("MOK_COMM_CHECK_TRANSPORT", "plain"))
    except ValueError as e:
        return [Row("comm transport", ok=False, note=str(e)[:100])]
    TRANSPORT["transport"] = tr
    _eager_loading()
    _init(ctx)
    EP = ctx.world
    quick = os.environ.get("MOK_COMM_QUICK", "0") == "1"
    cases = [("random", 256, 512, 4, 8 * EP), ("hot", 64, 256, 4, 4 * EP),
             ("rank0_empty", 64, 256, 2, 4 * EP), ("random", 1, 64, 2 * EP, 2 * EP),  # T=1, k=E
             ("random", 4096, 7168, 8, 32 * EP)]
    rows = [Row(f"comm transport {tr}, EP={EP}", ok=True,
                note=("one process, 1-rank group: same kernels, every route local; "
                      if EP == 1 else "") + ("transport=bulk: bf16 row moves by cp.async.bulk"
                                            if tr != "plain" else "default"))]
    for c in cases[:1] if quick else cases:
        rows += _guard(ctx, f"comm[{c[0]} T{c[1]} H{c[2]} k{c[3]} E{c[4]}]",
                       lambda c=c: _correctness(ctx, *c))
    if not (quick or PULL_TWICE):
        rows += _guard(ctx, "comm stalled peer", lambda: _stall(ctx))
        rows += _guard(ctx, "comm timing", lambda: _timing(ctx))
    if tr != "plain":  # the separate bulk invocation: its rows say so
        for r in rows[1:]:
            r.name = "bulk" + r.name[4:] if r.name.startswith("comm") else r.name
    return rows

"""Device check: the expert-parallel layer (mok_cute.moe, backend sm90) at EP = 2 and 4 with
*virtual ranks* on one GPU (mok_cute.comm.virtual: a thread and a stream per rank, plain device
buffers as the symmetric workspaces), against the reference backend on the same virtual group,
forward and backward.

Run with ``python3 tools/gpu_check.py layer_ep_virtual`` (one GPU). The cases run in a child
``tools/gpu_check.py layer_ep_virtual`` with CHILD_ENV set, read at CUDA's initialization (done
by gpu_check.py before this module runs) or at import: eager module loading, so that no kernel is
loaded lazily while another rank's comm kernel waits for it (a lazy load may synchronize the
context); 32 hardware queues for the ranks' streams; GEMMs launched through the DSL rather than
captured CUDA graphs (no graph capture or instantiation while peers wait; same kernels, same
parameters). Its rows come back through its $OUT/gpu_check.jsonl; a child that hangs is killed
after CHILD_TIMEOUT_S.

Per R and case, each rank's problem is layer_ep's (T 512 per rank, H 1024, I 512, E 8 global,
k 4, seeded per rank): uniform routing with the shared expert; skewed routing (a hot expert,
empty experts, -1 slots, a -1 token) with the shared expert and L = 4; uniform without the
shared expert, L = 4; rank 0 receiving nothing and the last rank sending nothing; skewed with
the shared expert at MXFP8 (rel-L1 2e-2 against the reference at mxfp8; its fused backward is
the mx variant, the shared expert's backward outside the launch). Each rank's y
and gradients are compared with the reference backend run on the same group (MoK's BF16
tolerances, layer_sm90._compare) and must be bitwise equal over REPEATS runs; rows
``layer_ep<R>v <case> r<rank>``. The comm kernels run on COMM_CTAS CTAs of 1024 threads: 4 ranks'
are 32 CTAs, co-resident on the 132 SMs beside the other ranks' GEMMs. Before each case one EP
step on a 1-rank virtual group (no peer to wait for) compiles and loads every kernel the case
launches. Last, per R: virtual rank 1 skips a dispatch, then a whole layer call; the others
must raise RuntimeError naming it within the timeout. ``MOK_EP_VIRTUAL_QUICK=1``: R = 2, the first
two cases, no stall rows; ``MOK_EP_VIRTUAL_CASES``: the cases to run (indices);
``MOK_EP_VIRTUAL_MODES``: the forward paths to run (``MoKConfig.forward_path``, e.g.
"unfused,fused"; default "fused"). On the fused path (the fused kernel's EP mode, each rank's grid
``ws.grid_ctas`` = SMs / R, its ring 8 slots: minibatch_tokens 256, reused; the backward path
FUSED, one launch per rank) a row per case counts the fused forwards and backwards (R x REPEATS
each) and another compares the gradients with the unfused backward's (``backward_path="unfused"``).
"""
from __future__ import annotations

import os
import time

import torch

from tools.checks.comm import _guard, _routing
from tools.checks.common import Row, child_rows, sm90_skip
from tools.checks.layer_ep import _problem
from tools.checks.layer_sm90 import _compare, _run
from mok_cute.comm.virtual import VirtualGroup, run_ranks

QUICK = os.environ.get("MOK_EP_VIRTUAL_QUICK", "0") == "1"  # R = 2, the first two cases, no stall rows
SIZES = (2,) if QUICK else (2, 4)
# indices into CASES to run (MOK_EP_VIRTUAL_CASES="0,4"; default: the first two with QUICK, else all)
# forward paths to run (MoKConfig.forward_path values), e.g. "unfused,fused"
MODES = os.environ.get("MOK_EP_VIRTUAL_MODES", "fused").split(",")
REPEATS = 3
# T per rank, H, I, E (global), k; MOK_EP_VIRTUAL_SHAPE="T,H,I,E,k" overrides (e.g. H, I not multiples of 256)
SHAPE = tuple(int(v) for v in os.environ.get("MOK_EP_VIRTUAL_SHAPE", "512,1024,512,8,4").split(","))
COMM_CTAS = 8
# minibatch_tokens 256: the fused forward's ring holds 8 slots of 128 rows, reused (~16 m-tiles per rank)
CONFIG = dict(comm_sms_fwd=COMM_CTAS, comm_sms_bwd=COMM_CTAS, device_timeout_s=10.0, minibatch_tokens=256)
CASES = [  # name, routing, shared expert, SwiGLU limit
    ("uniform+sh", "uniform", True, None),
    ("skew+sh L=4", "skew", True, 4.0),
    ("uniform L=4", "uniform", False, 4.0),
    ("r0 gets none, last sends none", "starve", False, None),
    ("skew+sh mxfp8", "skew", True, None),  # precision mxfp8: rel-L1 2e-2 against the reference at mxfp8
]
PICK = ({int(i) for i in os.environ["MOK_EP_VIRTUAL_CASES"].split(",")} if os.environ.get("MOK_EP_VIRTUAL_CASES")
        else set(range(2 if QUICK else len(CASES))))
CHILD_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32", "MOK_CUTE_LAUNCH": "dsl"}
CHILD_TIMEOUT_S = 540


def _starve(prob, rank: int, size: int, e_local: int):
    """``prob`` with its routes to rank 0's experts set to -1, and every route -1 on the last rank."""
    x, idx, w, ws, sh, dy = prob
    idx = torch.full_like(idx, -1) if rank == size - 1 else torch.where(idx < e_local, -1, idx)
    return x, idx, w, ws, sh, dy


def _warm(ctx, shared: bool, limit, seed: int, precision: str, forward: str) -> None:
    """Compile and load every kernel of an EP step at the case's shapes with no peer to wait for:
    one forward and backward of mok_cute.layers.ep on a 1-rank virtual group (all E experts) along
    the forward path ``forward``, with its default backward path and with the unfused one
    (:func:`_vs_unfused_backward` runs it)."""
    import mok_cute
    from mok_cute.config import BackwardPath, ForwardPath
    from mok_cute.layers import ep as ep_layer
    from mok_cute.layers.paths import Paths
    from mok_cute.layers.select import MoEInputs, get_backend

    t, h, inter, e, k = SHAPE
    x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, 1, 0, shared, False, ctx.device, seed)
    mlp, one = get_backend("sm90").mlp, VirtualGroup(1, ctx.device)
    cfg = mok_cute.MoKConfig(backend="sm90", precision=precision, **CONFIG)
    inp = MoEInputs(x, idx, w, *ws, sh, limit)
    fwd = ForwardPath(forward)
    for bwd in {BackwardPath.FUSED if fwd is ForwardPath.FUSED else BackwardPath.UNFUSED, BackwardPath.UNFUSED}:
        paths = Paths(fwd, bwd)
        run_ranks(one, lambda r: ep_layer.backward(mlp, ep_layer.forward(mlp, inp, one, 1, cfg, paths)[1], dy))


_FUSED_CALLS = {"fused_forward_ep": 0, "backward_fused_ep": 0}  # Sm90ExpertMLP's fused EP entries, per call


def _count_fused_calls():
    """Wrap the EP fused forward's and backward's host entries with call counters (so the fused
    rows prove the fused kernels ran, the paths the layer decided)."""
    from mok_cute.layers.sm90 import Sm90ExpertMLP

    for name in _FUSED_CALLS:
        real = getattr(Sm90ExpertMLP, name)
        if getattr(real, "counted", False):
            continue

        def counted(self, *a, _real=real, _name=name, **kw):
            out = _real(self, *a, **kw)
            _FUSED_CALLS[_name] += 1
            return out

        counted.counted = True
        setattr(Sm90ExpertMLP, name, counted)


def _case(ctx, size: int, seed: int, name: str, routing: str, shared: bool, limit,
          forward: str = "fused") -> list[Row]:
    """The rows of one case at R = ``size`` along the forward path ``forward`` (the config's
    ``forward_path``; the backward path the default after it)."""
    t, h, inter, e, k = SHAPE
    probs = [_problem(t, h, inter, e, k, size, r, shared, routing == "skew", ctx.device, seed) for r in range(size)]
    if routing == "starve":
        probs = [_starve(p, r, size, e // size) for r, p in enumerate(probs)]
    prec = "mxfp8" if name.endswith("mxfp8") else "bf16"
    _warm(ctx, shared, limit, seed, prec, forward)
    group = VirtualGroup(size, ctx.device)
    ref = run_ranks(group, lambda r: _run("reference", *probs[r], limit, group, precision=prec))
    calls = dict(_FUSED_CALLS)
    cfg = dict(CONFIG, forward_path=forward)
    outs = [run_ranks(group, lambda r: _run("sm90", *probs[r], limit, group, precision=prec, **cfg))
            for _ in range(REPEATS)]
    rows = []
    if forward == "fused":  # the backward path FUSED by default after it (MXFP8: the shared expert outside the launch)
        n = {key: _FUSED_CALLS[key] - calls[key] for key in calls}
        want = size * REPEATS
        rows.append(Row(f"layer_ep{size}v {name} fused launches",
                        ok=n["fused_forward_ep"] == want and n["backward_fused_ep"] == want,
                        note=f"{n['fused_forward_ep']} fused forwards, {n['backward_fused_ep']} fused backwards "
                             f"(want {want} each) for {size} ranks x {REPEATS} repeats"))
        rows += _vs_unfused_backward(group, probs, limit, prec, size, name, outs[0])
    for r in range(size):
        same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0][r], o[r]))
        if prec == "bf16":
            rows.append(_compare(f"layer_ep{size}v {name} r{r}", outs[0][r], ref[r], same))
            continue
        rel = max(float((o.float() - g.float()).abs().sum() / g.float().abs().sum().clamp_min(1e-30))
                  for o, g in zip(outs[0][r], ref[r]))
        rows.append(Row(f"layer_ep{size}v {name} r{r}", bitwise=same, ok=same and rel <= 2e-2,
                        note=f"max relL1 {rel:.2e} (<= 2e-2)"))
    return rows


def _vs_unfused_backward(group, probs, limit, prec, size: int, name: str, fused) -> list[Row]:
    """The fused EP backward's gradients against the unfused EP backward's (``backward_path="unfused"``,
    same fused forward): y, dx, d topk_w (both route_row's fixed-order sum) and every weight
    gradient bitwise."""
    cfg = dict(CONFIG, forward_path="fused", backward_path="unfused")
    base = run_ranks(group, lambda r: _run("sm90", *probs[r], limit, group, precision=prec, **cfg))
    rows = []
    for r in range(size):
        eq = [torch.equal(a, b) for a, b in zip(fused[r], base[r])]
        rows.append(Row(f"layer_ep{size}v {name} r{r} fused bwd == unfused", bitwise=all(eq), ok=all(eq),
                        note=f"y, dx, d topk_w, dW... equal: {eq}"))
    return rows


def _stall(ctx, size: int, forward: str = "fused") -> list[Row]:
    """Virtual rank 1 stalls, first in the comm kernels (it plans with the others, then skips a
    dispatch), then in the layer (it skips a whole mok_cute.moe call): every other rank must raise
    RuntimeError naming it within the timeout (+5 s)."""
    from mok_cute.comm.dispatch import dispatch
    from mok_cute.comm.workspace import get_workspace
    from mok_cute.comm.planner import plan_routing_device

    timeout, stalled = 2.0, 1
    t, h, inter, e, k = SHAPE
    group = VirtualGroup(size, ctx.device)
    idx = [_routing("random", p, 16, 2, e, ctx.device) for p in range(size)]
    x = torch.zeros(16, 64, dtype=torch.bfloat16, device=ctx.device)
    probs = [_problem(t, h, inter, e, k, size, r, True, False, ctx.device, 399) for r in range(size)]

    def in_dispatch(r):
        ws = get_workspace(group, T=16, H=64, k=2, E=e, timeout_s=timeout)
        plan = plan_routing_device(ws, idx[r])
        ws.check_status()
        if r != stalled:
            dispatch(ws, x, plan, num_ctas=COMM_CTAS)
            ws.check_status()

    def in_layer(r):
        if r != stalled:
            _run("sm90", *probs[r], None, group, **dict(CONFIG, device_timeout_s=timeout, forward_path=forward))

    rows = []
    for what, step in (("dispatch", in_dispatch), ("layer", in_layer)):
        def timed(r, step=step):
            t0 = time.time()
            try:
                step(r)
                return "no error raised", time.time() - t0
            except RuntimeError as err:
                return str(err), time.time() - t0

        got = [v for r, v in enumerate(run_ranks(group, timed)) if r != stalled]
        ok = all(f"peer rank {stalled}" in msg and dt < timeout + 5 for msg, dt in got)
        rows.append(Row(f"layer_ep{size}v rank {stalled} stalls ({what})", time_us=max(dt for _, dt in got) * 1e6,
                        ok=ok, note=got[0][0][:60]))
    return rows


def run(ctx) -> list[Row]:
    skip = sm90_skip(ctx, "layer_ep_virtual")
    if skip:
        return skip
    if any(os.environ.get(key) != value for key, value in CHILD_ENV.items()):
        return child_rows("layer_ep_virtual", CHILD_ENV, CHILD_TIMEOUT_S, "layer_ep_virtual")
    VirtualGroup(max(SIZES), ctx.device)  # creates the rank streams back to back (mok_cute.comm.virtual)
    _count_fused_calls()
    rows = []
    for mode in MODES:  # the forward's EP path: unfused stages or the fused kernel (MoKConfig.forward_path)
        start = len(rows)
        for size in SIZES:
            for seed, case in enumerate(CASES):
                if seed not in PICK:
                    continue
                rows += _guard(ctx, f"layer_ep{size}v {case[0]}", lambda: _case(ctx, size, 300 + seed, *case, mode))
            if not QUICK:
                rows += _guard(ctx, f"layer_ep{size}v stalled rank", lambda: _stall(ctx, size, mode))
        for row in rows[start:]:
            row.name = f"{row.name} {mode}" if len(MODES) > 1 else row.name
    return rows

"""Device check: the expert-parallel layer (mok_cute.moe, backend sm90, EP = world size)
against the reference backend on the same group, forward and backward.

Run with ``torchrun --nproc_per_node=2 tools/gpu_check.py layer_ep``. Each rank draws its
own tokens, routing (global expert ids) and local expert slice from seeds; the reference
backend runs on the same GPU tensors (it all-gathers with NCCL). Tolerances (BF16, MoK's):
max-abs <= 0.5 and rel-L1 <= 1e-2 per output and gradient; bitwise equality over 5
repeats. Cases: uniform and skewed routing (hot expert, empty experts, -1 slots), with the
shared expert, SwiGLU limit None and 4; two of them again at precision mxfp8 (x dispatched as
MXFP8 rows) against the reference backend at mxfp8. Rows of every rank are gathered (name
suffix ``r<rank>``). Timing: T = 4096 per rank, H 7168, I 2048, E 16, k 8, shared expert, bf16
and mxfp8; MoK's FLOP count 6*(T + T*k)*H*I per rank forward, 3x for forward + backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tools.checks.common import Row, bench_us, sm90_skip
from tools.checks.comm import _init
from tools.checks.layer_sm90 import _compare, _run
from tools.checks.layer_sm90 import _problem as layer_problem

REPEATS = 5


def _problem(t, h, inter, e, k, ep, rank, shared, skew, dev, seed):
    """This rank's tokens and routing over E global experts, and its E/EP local experts."""
    return layer_problem(t, h, inter, e, k, shared, skew, dev, seed * 1000 + rank, e_local=e // ep)


def _all_rows(rows: list[Row], rank: int, world: int) -> list[Row]:
    for r in rows:
        r.name = f"{r.name} r{rank}"
    got = [None] * world
    dist.all_gather_object(got, rows)
    return [r for part in got for r in part]


def _warm_mlp(x, ws, sh, dy, limit, precision="bf16"):
    """Compile the expert-MLP kernels for these shapes on this rank alone (EP = 1 op), so
    that the first EP step does not wait on a peer's kernel compiles inside a comm kernel."""
    import mok_cute
    from mok_cute.ops import expert_mlp

    cfg = mok_cute.MoKConfig(backend="sm90", precision=precision)
    for w3 in [ws] + ([tuple(p[None] for p in sh)] if sh else []):
        e = w3[0].shape[0]
        offs = torch.linspace(0, 64, e + 1, device=x.device).to(torch.int32)
        leaves = [x[:64].clone().requires_grad_()] + [p.clone().requires_grad_() for p in w3]
        out = expert_mlp(leaves[0], offs, *leaves[1:], swiglu_limit=limit, config=cfg)
        torch.autograd.grad(out, leaves, dy[:64])
    torch.cuda.synchronize()


def _correctness(ctx, group) -> list[Row]:
    dev, ep, me = ctx.device, ctx.world, ctx.rank
    cases = [("uniform", False, True, None, "bf16"), ("skew+shared", True, True, None, "bf16"),
             ("skew+shared L=4", True, True, 4.0, "bf16"), ("uniform noshared L=4", False, False, 4.0, "bf16"),
             ("uniform mxfp8", False, True, None, "mxfp8"), ("skew+shared L=4 mxfp8", True, True, 4.0, "mxfp8")]
    rows = []
    for i, (name, skew, shared, limit, prec) in enumerate(cases):
        x, idx, w, ws, sh, dy = _problem(512, 1024, 512, 8, 4, ep, me, shared, skew, dev, seed=200 + i)
        try:
            _warm_mlp(x, ws, sh, dy, limit, prec)
            dist.barrier(group)
            ref = _run("reference", x, idx, w, ws, sh, dy, limit, group, prec)
            outs = [_run("sm90", x, idx, w, ws, sh, dy, limit, group, prec) for _ in range(REPEATS)]
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
            rows.append(_compare(f"layer_ep{ep} {name}", outs[0], ref, same))
        except RuntimeError as e:
            if "CUDA" in str(e):
                raise
            rows.append(Row(f"layer_ep{ep} {name} raised", ok=False, note=str(e)[:100]))
    return rows


def _timing(ctx, group, precision="bf16") -> list[Row]:
    import mok_cute

    dev, ep, me = ctx.device, ctx.world, ctx.rank
    T, H, I, E, k = 4096, 7168, 2048, 16, 8
    x, idx, w, ws, sh, dy = _problem(T, H, I, E, k, ep, me, True, False, dev, seed=7)
    cfg = mok_cute.MoKConfig(backend="sm90", precision=precision)
    _warm_mlp(x, ws, sh, dy, None, precision)
    dist.barrier(group)
    for p in [x, w, *ws, *sh]:
        p.requires_grad_()
    fwd = lambda: mok_cute.moe(x, idx, w, *ws, shared=sh, config=cfg, group=group)
    fb = lambda: torch.autograd.backward(fwd(), dy)
    bar = lambda: dist.barrier(group)
    with torch.no_grad():
        t_f = bench_us(fwd, warmup=3, iters=10, barrier=bar)
    t_fb = bench_us(fb, warmup=3, iters=10, barrier=bar)
    flop = 6 * (T + T * k) * H * I  # per rank, MoK's count: routed + shared
    return [Row(f"layer_ep{ep} {precision} T{T}/rank k{k} E{E} H{H} I{I} +sh", time_us=t_fb,
                note=f"fwd {t_f:.0f}us {flop / t_f / 1e6:.0f} TF/s; fwd+bwd {3 * flop / t_fb / 1e6:.0f} TF/s")]


def run(ctx) -> list[Row]:
    skip = sm90_skip(ctx, "layer_ep")
    if skip:
        return skip
    if ctx.world < 2:
        return [Row("layer_ep: skipped", ok=True, note="needs torchrun --nproc_per_node >= 2")]
    _init(ctx)
    group = dist.group.WORLD
    rows = _correctness(ctx, group)
    try:
        rows += _timing(ctx, group) + _timing(ctx, group, "mxfp8")
    except RuntimeError as e:
        if "CUDA" in str(e):
            raise
        rows.append(Row(f"layer_ep{ctx.world} timing raised", ok=False, note=str(e)[:100]))
    return _all_rows(rows, ctx.rank, ctx.world)

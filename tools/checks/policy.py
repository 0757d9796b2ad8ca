"""Device check: every non-default :class:`~mok_cute.policy.KernelPolicy` choice of the SM90 layer
gives bitwise the default's results (the policy's promise: it changes how the kernels run, never
what they compute).

For BF16 and MXFP8 and three small shapes, ``mok_cute.moe(backend="sm90")`` forward + backward
(one dy) runs with the default config, then with each variant of :func:`variants`; y, dx,
d topk_w and every weight gradient must be ``torch.equal`` to the default run's. Shapes (EP = 1):

- A: T1000 H1024 I512 E8 k4, skewed routing (empty experts, -1 slots) + shared expert, SwiGLU limit 4
- B: T1000 H1408 I640 E8 k4, skewed + shared (a partial n-tile at tile_n 256, none at 128)
- C: T2048 H2048 I1024 E16 k8, uniform routing, no shared expert

The variants come from the tiles table (:data:`mok_cute.layers.tiles.CHOICES`, so the check follows
it) and the path table (:mod:`mok_cute.layers.paths`): each GEMM's non-default tile_n under the paths
that run it (the fused backward under FUSED and, where the table allows, FUSED_WHOLE; the unfused
GEMMs and ``policy.tiles`` under forward and backward UNFUSED), the fused forward's smallest ring at
its default tile_n, the paths alone (to tell a path's difference from a tile's), comm_sms_fwd 8 and
minibatch_tokens 512 / 4096, grid_ctas 64 and raster_band 1 / 32. A first row per (shape, precision) repeats the default run (the
baseline must itself be deterministic). One row per (shape, precision, variant); a variant that
raises is a failed row and the others still run. Notes give the first call's seconds (with compile).
"""
from __future__ import annotations

import time

import torch

from tools.checks.common import Row, sm90_skip
from tools.checks.layer_sm90 import OUT_NAMES, _problem, _run

PRECISIONS = ("bf16", "mxfp8")
ARCH = "sm90"
# name, (T, H, I, E, k, shared, skew, swiglu limit)
SHAPES = (
    ("A", (1000, 1024, 512, 8, 4, True, True, 4.0)),
    ("B", (1000, 1408, 640, 8, 4, True, True, None)),
    ("C", (2048, 2048, 1024, 16, 8, False, False, None)),
)
COMM_SMS_FWD = (8,)
MINIBATCH_TOKENS = (512, 4096)
GRID_CTAS = (64,)  # of 132 SMs: a grid of about half the GPU
RASTER_BANDS = (1, 32)  # a 1024-token ring holds 32 slots at k 4


def variants(precision: str, shared: bool) -> list[tuple[str, object]]:
    """``(name, KernelPolicy)`` of every non-default policy the check runs at ``precision`` on SM90
    (EP = 1, a shared expert or not): built from the tiles table and the path table."""
    from mok_cute.layers import paths
    from mok_cute.layers.tiles import CHOICES
    from mok_cute.policy import GEMMS, BackwardPath, ForwardPath, GemmTiles, KernelPolicy

    table = CHOICES[ARCH][precision]
    short = {"fused_forward": "fused_fwd", "fused_backward": "fused_bwd"}  # row names fit the table's 44 columns
    call = paths.Call(precision, ep=1, shared=shared)
    fused_bwds = [b for b in (BackwardPath.FUSED, BackwardPath.FUSED_WHOLE)
                  if paths.refusal(ARCH, "backward", b, call, ForwardPath.FUSED) is None]
    unfused = dict(forward_path=ForwardPath.UNFUSED, backward_path=BackwardPath.UNFUSED)
    out = [("paths unfused", KernelPolicy(**unfused))]
    out += [(f"bwd {b.value}", KernelPolicy(backward_path=b)) for b in fused_bwds if b is not BackwardPath.FUSED]
    for gemm in GEMMS:
        if gemm not in table:
            continue
        ch, label = table[gemm], short.get(gemm, gemm)
        for tn in ch.tile_n[1:]:  # the non-default tile_n values
            t = GemmTiles(tile_n=tn)
            if gemm == "fused_forward":
                out.append((f"{label} n{tn}", KernelPolicy(fused_forward=t)))
            elif gemm == "fused_backward":
                out += [(f"{label} n{tn} {b.value}", KernelPolicy(backward_path=b, fused_backward=t)) for b in fused_bwds]
            else:
                out.append((f"{gemm} n{tn} unfused", KernelPolicy(**unfused, **{gemm: t})))
        if gemm == "fused_forward":  # the smallest ring at the default tile_n (the largest is the default)
            tn0 = ch.tile_n[0]
            out += [(f"{label} n{tn0} stages{s}", KernelPolicy(fused_forward=GemmTiles(tile_n=tn0, stages=s)))
                    for s in ch.stages_at(tn0)[:1] if s != ch.stages_at(tn0)[-1]]
    # policy.tiles (MoKConfig.tile_n): every GEMM the call runs must take it; the unfused ones do
    common = [tn for tn in table["gemm1"].tile_n[1:] if all(tn in table[g].tile_n for g in GEMMS[2:])]
    out += [(f"tiles n{tn} unfused", KernelPolicy(**unfused, tiles=GemmTiles(tile_n=tn))) for tn in common]
    out += [(f"comm_sms_fwd {c}", KernelPolicy(comm_sms_fwd=c)) for c in COMM_SMS_FWD]
    out += [(f"minibatch_tokens {m}", KernelPolicy(minibatch_tokens=m)) for m in MINIBATCH_TOKENS]
    out += [(f"grid_ctas {g}", KernelPolicy(grid_ctas=g)) for g in GRID_CTAS]
    out += [(f"raster_band {b}", KernelPolicy(raster_band=b)) for b in RASTER_BANDS]
    return out


def _diff(outs, ref) -> tuple[bool, float, list[str]]:
    """(all bitwise equal, max |difference|, the outputs that differ, named)."""
    same, worst, bad = True, 0.0, []
    for i, (o, r) in enumerate(zip(outs, ref)):
        if torch.equal(o, r):
            continue
        same = False
        bad.append(OUT_NAMES[i])
        if o.shape == r.shape:
            d = (o.float() - r.float()).abs()
            worst = max(worst, float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0)
        else:
            worst = float("inf")
    return same, worst, bad


def run(ctx) -> list[Row]:
    skip = sm90_skip(ctx, "policy")
    if skip:
        return skip
    dev = ctx.device
    rows: list[Row] = []
    for si, (sname, (t, h, inter, e, k, shared, skew, limit)) in enumerate(SHAPES):
        x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, shared, skew, dev, seed=300 + si)
        for prec in PRECISIONS:
            tag = f"policy {sname} {prec}"

            def run_with(policy=None):
                kw = {} if policy is None else {"policy": policy}
                out = _run("sm90", x, idx, w, ws, sh, dy, limit, precision=prec, **kw)
                torch.cuda.synchronize()
                return out

            try:
                ref = run_with()
            except Exception as ex:  # noqa: BLE001
                rows.append(Row(f"{tag} default", ok=False, note=f"{type(ex).__name__}: {ex}"[:120]))
                continue
            rows.append(_compare(f"{tag} default (repeat)", run_with, None, ref))
            rows += [_compare(f"{tag} {vname}", run_with, pol, ref) for vname, pol in variants(prec, shared)]
            del ref
    return rows


def _compare(name: str, run_with, policy, ref) -> Row:
    """One row: the layer under ``policy`` (None: the default again) against ``ref``, torch.equal on every
    output; an exception is a failed row (the other variants still run)."""
    t0 = time.time()
    try:
        outs = run_with(policy)
    except Exception as ex:  # noqa: BLE001
        return Row(name, ok=False, note=f"{type(ex).__name__}: {ex}"[:120])
    same, worst, bad = _diff(outs, ref)
    return Row(name, max_err=worst, bitwise=same, ok=same,
               note=f"{time.time() - t0:.1f}s" + (f"; differ: {' '.join(bad)}" if bad else ""))

"""Device check for a first Blackwell run (sm_100 / sm_103; docs/blackwell.md), never run yet
(no Blackwell GPU was lent).

BF16 expert GEMMs of :mod:`mok_cute.kernels.sm100.grouped_gemm` (plain, GEMM1+SwiGLU, dSwiGLU
dgrad, dgrad1 with stacked and separate weights, wgrad with a column-slice operand) through the
checks of :mod:`checks.gemm_sm90` (vs the reference, NaN-poisoned outputs, guard rows, 5 repeats
bitwise) at H/I 1024/512 and 320/128 (partial tiles). Then the layer:

``mok_cute.moe(backend="sm100")`` (the unfused tcgen05 expert GEMMs) vs ``backend="reference"``
at the same precision, y and every gradient, shared expert on, skewed routing with -1 slots,
SwiGLU limit 4: an aligned shape and one with H, I, I_s multiples of 64 only (partial tiles),
BF16 (max-abs <= 0.5, rel-L1 <= 1e-2) and MXFP8 (max-abs <= 1, rel-L1 <= 2e-2); 3 repeats
bitwise. Last, the opt-in fused path (``MOK_CUTE_SM100_FUSED=1``; BF16: the fused forward and
the fused backward core, and the whole backward in one launch, mode 3; MXFP8: the fused forward with
the fused backward core's mx variant, then mode 3's mx variant, its comm CTAs quantizing the gathered
rows) bitwise the unfused path at both shapes; ``main_grads`` accumulated twice
unfused and in mode 3 (the W epilogue's accumulate variant), bitwise start + 2 fp32(fresh dW).
Then timing rows: the sm100 layer's fwd + bwd (BF16 unfused, BF16 with the
fused forward, MXFP8, MXFP8 with the fused forward) beside the torch layer at T4096 H7168 I2048 E16
k8 + shared. Last, EP = 2 with virtual ranks on this GPU (:func:`_ep_rows`, in a child run with
layer_ep_virtual's environment): the fused forward's ep variant bitwise the unfused EP stages, and
the fused EP backward (BF16 and MXFP8) bitwise the unfused EP backward (``MOK_CUTE_FUSED_BWD=0``).
"""
from __future__ import annotations

import os

import torch

import mok_cute
from checks.common import Row, bench_us, child_rows, env_var, sm100_skip
from checks.fused_bwd import _main_grads_rows
from checks.layer_sm90 import _problem, _run
from checks.tails import TOL, _dims, _errors

SHAPES = [("aligned T600 H1024 I512", 600, 1024, 512, 8, 4, None),
          ("tails T500 H320 I128 I_s192", 500, 320, 128, 6, 3, 192)]


def _gemm_rows(dev) -> list[Row]:
    from checks import gemm_sm90 as G
    from checks.common import seeded
    from mok_cute import reference as ref
    from mok_cute.kernels.sm100 import grouped_gemm as k

    gen, rows = seeded(99), []
    for h, inter in ((1024, 512), (320, 128)):
        with _dims(G, h, inter):
            for r in (G._guarded("plain", G._check_plain, k, ref, dev, gen, "skewed", torch.int32),
                      G._guarded("swiglu", G._check_swiglu, k, ref, dev, gen, "skewed", 4.0),
                      G._guarded("dswiglu dgrad", G._check_dswiglu_dgrad, k, ref, dev, gen, "skewed", 4.0),
                      G._guarded("dgrad1", G._check_dgrad1, k, ref, dev, gen, "skewed"),
                      G._guarded("wgrad", G._check_wgrad, k, ref, dev, gen, "uniform", True)):
                r.name = f"sm100 {r.name} H{h} I{inter}"
                rows.append(r)
    return rows


def _fused_rows(dev) -> list[Row]:
    """The opt-in fused path (``MOK_CUTE_SM100_FUSED=1``, EP = 1: BF16 and MXFP8 through the fused
    forward and the fused backward core, MXFP8 their ``mx`` variants; then the whole backward in one
    launch, ``MOK_CUTE_FUSED_BWD=3``: ``fused_bwd.fused_backward``, gather + shared at BF16, at MXFP8
    the gather's quantizing ``mx`` variant with the shared expert before it; BF16 again with R1's rows
    by TMA gather4, ``MOK_CUTE_SM100_GATHER=tma``; then with ``cta_group::2`` tiles,
    ``MOK_CUTE_SM100_TILE_M=256``, whose MMAs sum each element over the same k order): y and every
    gradient bitwise the unfused sm100 path's (``MOK_CUTE_FUSED_BWD=0``), 3 repeats."""
    rows = []
    for precision, what, mode, gather, tile_m in (("bf16", "fwd + bwd core", "2", "comm", "128"),
                                                  ("mxfp8", "fwd + bwd core", "2", "comm", "128"),
                                                  ("bf16", "fwd + bwd mode 3", "3", "comm", "128"),
                                                  ("mxfp8", "fwd + bwd mode 3", "3", "comm", "128"),
                                                  ("bf16", "fwd tma gather4 + bwd core", "2", "tma", "128"),
                                                  ("bf16", "2-CTA fwd + bwd core", "2", "comm", "256"),
                                                  ("mxfp8", "2-CTA fwd + bwd core", "2", "comm", "256"),
                                                  ("bf16", "2-CTA fwd + bwd mode 3", "3", "comm", "256"),
                                                  ("mxfp8", "2-CTA fwd + bwd mode 3", "3", "comm", "256")):
        for si, (name, t, h, inter, e, k, _) in enumerate(SHAPES):
            x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, True, dev, seed=600 + si)
            with env_var("MOK_CUTE_FUSED_BWD", "0"):
                want = _run("sm100", x, idx, w, ws, sh, dy, 4.0, precision=precision)
            with env_var({"MOK_CUTE_SM100_FUSED": "1", "MOK_CUTE_FUSED_BWD": mode, "MOK_CUTE_SM100_GATHER": gather,
                          "MOK_CUTE_SM100_TILE_M": tile_m}):
                runs = [_run("sm100", x, idx, w, ws, sh, dy, 4.0, precision=precision) for _ in range(3)]
            same = [all(torch.equal(a, b) for a, b in zip(want, r)) for r in runs]
            rows.append(Row(f"sm100 fused {what} {name} {precision} == unfused", bitwise=all(same), ok=all(same),
                            note=f"[y and every gradient] equal per run: {same}"))
    # main_grads: unfused (the layer adds), then mode 3 (the W epilogue adds each tile: the accumulate variant)
    name, t, h, inter, e, k, _ = SHAPES[0]
    rows += _main_grads_rows(*_problem(t, h, inter, e, k, True, True, dev, seed=650), backend="sm100",
                             flags=("0", "3"), env={"MOK_CUTE_SM100_FUSED": "1"})
    return rows


def _layer_rows(dev) -> list[Row]:
    rows = []
    for si, (name, t, h, inter, e, k, i_s) in enumerate(SHAPES):
        x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, True, dev, seed=500 + si)
        if i_s is not None:  # a shared expert of another width
            g = torch.Generator(device=dev).manual_seed(9)
            sh = tuple((torch.randn(*s, device=dev, generator=g) * f ** -0.5).bfloat16()
                       for s, f in (((i_s, h), h), ((i_s, h), h), ((h, i_s), i_s)))
        for precision in ("bf16", "mxfp8"):
            max_abs, max_rel = TOL[precision]
            want = _run("reference", x, idx, w, ws, sh, dy, 4.0, precision=precision)
            runs = [_run("sm100", x, idx, w, ws, sh, dy, 4.0, precision=precision) for _ in range(3)]
            rep = all(all(torch.equal(a, b) for a, b in zip(runs[0], r)) for r in runs[1:])
            a, rel, bad = _errors(runs[0], want)
            rows.append(Row(f"sm100 layer {name} {precision}", max_err=a, bitwise=rep,
                            ok=rep and not bad and a <= max_abs and rel <= max_rel,
                            note=f"relL1={rel:.2e} vs reference; repeats equal {rep} {' '.join(bad)}"))
    return rows


def _bench_rows(dev) -> list[Row]:
    """fwd + bwd of T4096 H7168 I2048 E16 k8 + shared: the sm100 layer (unfused; the fused forward
    and backward core opt-in) beside the torch layer a user writes (``bench_layer.torch_layer``) in the same run."""
    from bench_layer import torch_layer

    x, idx, w, ws, sh, dy = _problem(4096, 7168, 2048, 16, 8, True, False, dev, seed=11)
    w1 = torch.cat(ws[:2], 1)
    leaves = [t.requires_grad_() for t in (x, w, *ws, *sh, w1)]

    def step(fn):
        def go():
            for t in leaves:
                t.grad = None
            fn().backward(dy)
        return go

    t_torch = bench_us(step(lambda: torch_layer(x, idx, w, w1, ws[2], sh, None)), 3, 10)
    rows = [Row("bench torch layer fwd+bwd T4096 H7168 I2048 E16 k8 +shared", time_us=t_torch)]
    for name, precision, fused in (("bf16", "bf16", False), ("bf16 fused", "bf16", True),
                                   ("mxfp8", "mxfp8", False), ("mxfp8 fused", "mxfp8", True)):
        cfg = mok_cute.MoKConfig(backend="sm100", precision=precision, validate_routing=False)
        with env_var("MOK_CUTE_SM100_FUSED", "1" if fused else "0"):
            t = bench_us(step(lambda: mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), config=cfg)), 3, 10)
        rows.append(Row(f"bench sm100 {name} fwd+bwd (same shape)", time_us=t, note=f"{t_torch / t:.2f}x the torch layer"))
    return rows


EP_SHAPE = (512, 1024, 512, 8, 4)  # T per rank, H, I, E (global), k: layer_ep_virtual's
EP_CONFIG = dict(comm_sms_fwd=8, comm_sms_bwd=8, device_timeout_s=10.0, minibatch_tokens=256)  # ring reused
EP_CASES = [("uniform+sh", False, None, "bf16"), ("skew+sh L=4", True, 4.0, "bf16"),
            ("skew+sh L=4 mxfp8", True, 4.0, "mxfp8")]
EP_CHILD = "MOK_SM100_EP_CHILD"  # set in the child that runs only the EP rows


def _ep_rows(dev) -> list[Row]:
    """EP = 2, virtual ranks (:mod:`mok_cute.comm.virtual`), the sm100 backend opted in
    (``MOK_CUTE_SM100_FUSED=1``): per case and rank, y and every gradient with the fused forward's
    ep variant (``MOK_CUTE_FUSED_EP=1``, the unfused EP backward: ``MOK_CUTE_FUSED_BWD=0``) bitwise
    those of the unfused EP stages (``MOK_CUTE_FUSED_EP=0``), one fused forward per rank; then
    with the fused EP backward too (BF16 and MXFP8) (``MOK_CUTE_FUSED_BWD=2``, ``Sm100ExpertMLP.backward_fused_ep``:
    one launch per rank) bitwise the fused forward's run with the unfused EP backward. MXFP8: dWg / dWu
    within rel-L1 2e-2 (after the fused forward the backward's x rows are x's, not their MXFP8 round
    trip as the unfused dispatch's: ``layers.ep``'s doc). Last, the fused forward and backward again with
    the bulk push (``MOK_CUTE_SM100_PUSH=bulk``: GEMM2's and dgrad1's rows into the peers by
    ``cp.async.bulk``) on ``cta_group::2`` tiles (``MOK_CUTE_SM100_TILE_M=256``): bitwise the run before.
    Every kernel is compiled and loaded first on a 1-rank group (no peer waits while one compiles)."""
    from checks.layer_ep import _problem as ep_problem
    from mok_cute.comm.virtual import VirtualGroup, run_ranks
    from mok_cute.layers import ep as ep_layer
    from mok_cute.layers.select import MoEInputs
    from mok_cute.layers.sm100 import Sm100ExpertMLP

    t, h, inter, e, k = EP_SHAPE
    size, rows, calls = 2, [], {"fused_forward_ep": 0, "backward_fused_ep": 0}
    real = {name: getattr(Sm100ExpertMLP, name) for name in calls}

    def counted(name):
        def call(self, *a, **kw):
            out = real[name](self, *a, **kw)
            calls[name] += out is not None
            return out
        return call

    for name in calls:
        setattr(Sm100ExpertMLP, name, counted(name))
    os.environ["MOK_CUTE_SM100_FUSED"] = "1"
    group, one, mlp = VirtualGroup(size, dev), VirtualGroup(1, dev), Sm100ExpertMLP()
    try:
        for seed, (name, skew, limit, prec) in enumerate(EP_CASES):
            probs = [ep_problem(t, h, inter, e, k, size, r, True, skew, dev, 700 + seed) for r in range(size)]
            x, idx, w, ws, sh, dy = ep_problem(t, h, inter, e, k, 1, 0, True, skew, dev, 700 + seed)
            cfg = mok_cute.MoKConfig(backend="sm100", precision=prec, **EP_CONFIG)
            out, n = {}, {}
            # (FUSED_EP, FUSED_BWD[, SM100_PUSH, SM100_TILE_M])
            runs = (("0", "0"), ("1", "0"), ("1", "2"), ("1", "2", "bulk", "256"))
            for mode in runs:
                push, tile_m = mode[2:] or ("st", "128")
                os.environ.update(MOK_CUTE_FUSED_EP=mode[0], MOK_CUTE_FUSED_BWD=mode[1], MOK_CUTE_SM100_PUSH=push,
                                  MOK_CUTE_SM100_TILE_M=tile_m)
                inp = MoEInputs(x, idx, w, *ws, sh, limit)
                run_ranks(one, lambda r: ep_layer.backward(mlp, ep_layer.forward(mlp, inp, one, 1, cfg)[1], dy))
                before = dict(calls)
                out[mode] = run_ranks(group, lambda r: _run("sm100", *probs[r], limit, group, precision=prec,
                                                             **EP_CONFIG))
                n[mode] = {key: calls[key] - before[key] for key in calls}
            loose = (3, 4) if prec == "mxfp8" else ()  # dWg, dWu
            fused = n[("1", "0")]["fused_forward_ep"]
            for r in range(size):
                pairs = list(zip(out[("1", "0")][r], out[("0", "0")][r]))
                eq = [torch.equal(a, b) for a, b in pairs]
                rel = max((float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp_min(1e-30))
                           for i, (a, b) in enumerate(pairs) if i in loose), default=0.0)
                ok = all(e for i, e in enumerate(eq) if i not in loose) and rel <= 2e-2 and fused == size
                rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} fused fwd == unfused", bitwise=all(eq), ok=ok,
                                note=f"[y and every gradient] equal: {eq}; dWg / dWu relL1 {rel:.1e}; "
                                     f"{fused} fused forwards (want {size})"))
            if ("1", "2") in out:
                bwd = n[("1", "2")]["backward_fused_ep"]
                for r in range(size):
                    eq = [torch.equal(a, b) for a, b in zip(out[("1", "2")][r], out[("1", "0")][r])]
                    rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} fused bwd == unfused", bitwise=all(eq),
                                    ok=all(eq) and bwd == size,
                                    note=f"y, dx, d topk_w, dW... equal (vs MOK_CUTE_FUSED_BWD=0): {eq}; "
                                         f"{bwd} fused EP backwards (want {size})"))
            for r in range(size):
                eq = [torch.equal(a, b) for a, b in zip(out[runs[3]][r], out[("1", "2")][r])]
                rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} 2-CTA bulk push == st", bitwise=all(eq), ok=all(eq),
                                note=f"y, dx, d topk_w, dW... equal: {eq}"))
    finally:
        for name, fn in real.items():
            setattr(Sm100ExpertMLP, name, fn)
        for key in ("MOK_CUTE_SM100_FUSED", "MOK_CUTE_FUSED_EP", "MOK_CUTE_FUSED_BWD", "MOK_CUTE_SM100_PUSH",
                    "MOK_CUTE_SM100_TILE_M"):
            os.environ.pop(key, None)
    return rows


def _ep_child() -> list[Row]:
    """:func:`_ep_rows` from a child ``gpu_check.py sm100`` with layer_ep_virtual's CHILD_ENV (eager
    module loading, DSL launches: nothing loaded or captured while a peer waits)."""
    from checks.layer_ep_virtual import CHILD_ENV, CHILD_TIMEOUT_S

    return child_rows("sm100", {**CHILD_ENV, EP_CHILD: "1"}, CHILD_TIMEOUT_S, "sm100 layer_ep2v")


def run(ctx) -> list[Row]:
    if skipped := sm100_skip(ctx, "sm100"):
        return skipped
    if os.environ.get(EP_CHILD) == "1":
        return _ep_rows(ctx.device)
    return _gemm_rows(ctx.device) + _layer_rows(ctx.device) + _fused_rows(ctx.device) + _bench_rows(ctx.device) + \
        _ep_child()

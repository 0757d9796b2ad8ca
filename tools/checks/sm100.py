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
bitwise. Last, the fused paths asked for in the config (``forward_path="fused"``; BF16: the fused
forward and the fused backward core, ``backward_path="fused"``, and the whole backward in one launch,
``"fused_whole"``; MXFP8: the fused forward with the fused backward core's mx variant, then the whole
launch's mx variant, its comm CTAs quantizing the gathered rows; then with ``cta_group::2`` tiles,
``tile_m=256``) bitwise the unfused path at both shapes; the fused forward with R1's rows by TMA
gather4 (a kernel launch parameter, ``Sm100Launch(gather="tma")``: no config field reaches it) bitwise
the comm CTAs' gather; ``main_grads`` accumulated twice unfused and with FUSED_WHOLE (the W epilogue's
accumulate variant), bitwise start + 2 fp32(fresh dW). Then timing rows: the sm100 layer's fwd + bwd
(BF16 unfused, BF16 fused, MXFP8, MXFP8 fused) beside the torch layer at T4096 H7168 I2048 E16 k8 +
shared. Last, EP = 2 with virtual ranks on this GPU (:func:`_ep_rows`, in a child run with
layer_ep_virtual's environment): the fused forward's ep variant bitwise the unfused EP stages, and
the fused EP backward (BF16 and MXFP8) bitwise the unfused EP backward (``backward_path="unfused"``).
"""
from __future__ import annotations

import os

import torch

import mok_cute
from tools.checks.common import Row, bench_us, child_rows, sm100_skip
from tools.checks.layer_sm90 import _problem, _run
from tools.checks.tails import TOL, _dims, _errors

SHAPES = [("aligned T600 H1024 I512", 600, 1024, 512, 8, 4, None),
          ("tails T500 H320 I128 I_s192", 500, 320, 128, 6, 3, 192)]


def _gemm_rows(dev) -> list[Row]:
    from tools.checks import gemm_sm90 as G
    from tools.checks.common import seeded
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
    """The fused paths asked for in the config (EP = 1: BF16 and MXFP8 through the fused forward and
    the fused backward core, ``backward_path="fused"``, MXFP8 their ``mx`` variants; then the whole
    backward in one launch, ``"fused_whole"``: ``fused_bwd.fused_backward``, gather + shared at BF16,
    at MXFP8 the gather's quantizing ``mx`` variant with the shared expert before it; then with
    ``cta_group::2`` tiles, ``tile_m=256``, whose MMAs sum each element over the same k order): y and
    every gradient bitwise the unfused sm100 path's (the default), 3 repeats; R1's rows by TMA gather4
    (:func:`_tma_gather_rows`); ``main_grads``."""
    rows = []
    for precision, what, bwd, tile_m in (("bf16", "fwd + bwd core", "fused", None),
                                         ("mxfp8", "fwd + bwd core", "fused", None),
                                         ("bf16", "fwd + whole bwd", "fused_whole", None),
                                         ("mxfp8", "fwd + whole bwd", "fused_whole", None),
                                         ("bf16", "2-CTA fwd + bwd core", "fused", 256),
                                         ("mxfp8", "2-CTA fwd + bwd core", "fused", 256),
                                         ("bf16", "2-CTA fwd + whole bwd", "fused_whole", 256),
                                         ("mxfp8", "2-CTA fwd + whole bwd", "fused_whole", 256)):
        for si, (name, t, h, inter, e, k, _) in enumerate(SHAPES):
            x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, True, dev, seed=600 + si)
            want = _run("sm100", x, idx, w, ws, sh, dy, 4.0, precision=precision)
            runs = [_run("sm100", x, idx, w, ws, sh, dy, 4.0, precision=precision, forward_path="fused",
                         backward_path=bwd, tile_m=tile_m) for _ in range(3)]
            same = [all(torch.equal(a, b) for a, b in zip(want, r)) for r in runs]
            rows.append(Row(f"sm100 fused {what} {name} {precision} == unfused", bitwise=all(same), ok=all(same),
                            note=f"[y and every gradient] equal per run: {same}"))
    rows += _tma_gather_rows(dev)
    name, t, h, inter, e, k, _ = SHAPES[0]
    rows += _main_grads_rows(*_problem(t, h, inter, e, k, True, True, dev, seed=650))
    return rows


def _tma_gather_rows(dev) -> list[Row]:
    """The BF16 EP = 1 fused forward with R1's rows loaded by TMA gather4 from x
    (``Sm100Launch(gather="tma")``, no ring; a kernel launch parameter, never measured against the
    ring: no config field reaches it) vs the comm CTAs' gather into the ring: y, gu, h and the slot
    rows bitwise, 3 repeats."""
    from mok_cute.kernels.operands import ExpertWeights, RoutePlan, SharedExpert
    from mok_cute.kernels.sm100 import fused_moe as fm
    from mok_cute.layers.grouped import routing_plan

    rows = []
    for si, (name, t, h, inter, e, k, _) in enumerate(SHAPES):
        x, idx, w, ws, sh, _ = _problem(t, h, inter, e, k, True, True, dev, seed=620 + si)
        order, offsets, idx32 = routing_plan(idx, e, watch=False)
        plan = RoutePlan(order, offsets, idx32, w.float().contiguous())
        args = (x, plan, ExpertWeights(*ws), SharedExpert(*sh), 4.0)

        def fwd(gather):
            out = fm.fused_forward(*args, fm.Sm100Launch(16, 10.0, gather=gather))
            return [t_.clone() for t_ in out[:4]]
        want = fwd("comm")
        runs = [fwd("tma") for _ in range(3)]
        same = [all(torch.equal(a, b) for a, b in zip(want, r)) for r in runs]
        rows.append(Row(f"sm100 fused fwd tma gather4 {name} bf16 == comm gather", bitwise=all(same), ok=all(same),
                        note=f"[y, gu, h, slot rows] equal per run: {same}"))
    return rows


def _main_grads_rows(x, idx, w, ws, sh, dy) -> list[Row]:
    """``mok_cute.moe(..., main_grads=)`` twice into random fp32 buffers, unfused and along the fused
    forward and FUSED_WHOLE (the W epilogue's accumulate variant): start + 2 fp32(fresh dW) bitwise,
    the weights without ``.grad``."""
    rows = []
    weights = [p.clone().requires_grad_() for p in (*ws, *sh)]

    def moe(cfg, main=None):
        return mok_cute.moe(x, idx, w, *weights[:3], shared=tuple(weights[3:]), swiglu_limit=4.0, config=cfg,
                            main_grads=main)
    fresh = torch.autograd.grad(moe(mok_cute.MoKConfig(backend="sm100")), weights, dy)
    for paths in (dict(), dict(forward_path="fused", backward_path="fused_whole")):
        g = torch.Generator(device=x.device).manual_seed(4)
        start = [torch.randn(p.shape, device=x.device, generator=g) for p in weights]
        acc = [s_.clone() for s_ in start]
        for _ in range(2):
            moe(mok_cute.MoKConfig(backend="sm100", **paths), tuple(acc)).backward(dy)
        torch.cuda.synchronize()
        want = [s_ + f.float() + f.float() for s_, f in zip(start, fresh)]
        same = all(torch.equal(a, b) for a, b in zip(acc, want))
        no_grad = all(p.grad is None for p in weights)
        rows.append(Row(f"sm100 main_grads += fp32(dW) twice, {paths or 'unfused'}", bitwise=same,
                        ok=same and no_grad, note=f"== start + 2 fp32(fresh dW): {same}; weights without .grad: "
                                                  f"{no_grad}"))
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
    """fwd + bwd of T4096 H7168 I2048 E16 k8 + shared: the sm100 layer (unfused, the default; the
    fused forward and backward core asked for in the config) beside the torch layer a user writes
    (``bench_layer.torch_layer``) in the same run."""
    from mok_cute.bench.torch_layer import torch_layer

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
        paths = dict(forward_path="fused", backward_path="fused") if fused else {}
        cfg = mok_cute.MoKConfig(backend="sm100", precision=precision, validate_routing=False, **paths)
        t = bench_us(step(lambda: mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), config=cfg)), 3, 10)
        rows.append(Row(f"bench sm100 {name} fwd+bwd (same shape)", time_us=t, note=f"{t_torch / t:.2f}x the torch layer"))
    return rows


EP_SHAPE = (512, 1024, 512, 8, 4)  # T per rank, H, I, E (global), k: layer_ep_virtual's
EP_CONFIG = dict(comm_sms_fwd=8, comm_sms_bwd=8, device_timeout_s=10.0, minibatch_tokens=256)  # ring reused
EP_CASES = [("uniform+sh", False, None, "bf16"), ("skew+sh L=4", True, 4.0, "bf16"),
            ("skew+sh L=4 mxfp8", True, 4.0, "mxfp8")]
EP_CHILD = "MOK_SM100_EP_CHILD"  # set in the child that runs only the EP rows


def _ep_rows(dev) -> list[Row]:
    """EP = 2, virtual ranks (:mod:`mok_cute.comm.virtual`), the sm100 backend's paths asked for in the
    config: per case and rank, y and every gradient with the fused forward's ep variant
    (``forward_path="fused"``, the unfused EP backward: ``backward_path="unfused"``) bitwise those of the
    unfused EP stages (``forward_path="unfused"``), one fused forward per rank; then with the fused EP
    backward too (BF16 and MXFP8) (``backward_path="fused"``, ``Sm100ExpertMLP.backward_fused_ep``: one
    launch per rank) bitwise the fused forward's run with the unfused EP backward. MXFP8: dWg / dWu
    within rel-L1 2e-2 (after the fused forward the backward's x rows are x's, not their MXFP8 round
    trip as the unfused dispatch's: ``layers.ep``'s doc). Last, the fused forward and backward again with
    the bulk push (``comm_transport="bulk"``: GEMM2's and dgrad1's rows into the peers by
    ``cp.async.bulk``) on ``cta_group::2`` tiles (``tile_m=256``): bitwise the run before. Every kernel
    is compiled and loaded first on a 1-rank group (no peer waits while one compiles)."""
    from tools.checks.layer_ep import _problem as ep_problem
    from mok_cute.comm.virtual import VirtualGroup, run_ranks
    from mok_cute.layers import ep as ep_layer
    from mok_cute.layers import paths as P
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
    group, one, mlp = VirtualGroup(size, dev), VirtualGroup(1, dev), Sm100ExpertMLP()
    try:
        for seed, (name, skew, limit, prec) in enumerate(EP_CASES):
            probs = [ep_problem(t, h, inter, e, k, size, r, True, skew, dev, 700 + seed) for r in range(size)]
            x, idx, w, ws, sh, dy = ep_problem(t, h, inter, e, k, 1, 0, True, skew, dev, 700 + seed)
            out, n = {}, {}
            # (forward path, backward path[, comm_transport, tile_m])
            runs = (("unfused", "unfused"), ("fused", "unfused"), ("fused", "fused"), ("fused", "fused", "bulk", 256))
            for mode in runs:
                transport, tile_m = mode[2:] or ("plain", None)
                fields = dict(EP_CONFIG, forward_path=mode[0], backward_path=mode[1], comm_transport=transport,
                              tile_m=tile_m)
                cfg = mok_cute.MoKConfig(backend="sm100", precision=prec, **fields)
                inp = MoEInputs(x, idx, w, *ws, sh, limit)
                paths = P.Paths(*mode[:2])
                run_ranks(one, lambda r: ep_layer.backward(mlp, ep_layer.forward(mlp, inp, one, 1, cfg, paths)[1], dy))
                before = dict(calls)
                out[mode] = run_ranks(group, lambda r: _run("sm100", *probs[r], limit, group, precision=prec,
                                                             **fields))
                n[mode] = {key: calls[key] - before[key] for key in calls}
            loose = (3, 4) if prec == "mxfp8" else ()  # dWg, dWu
            fused = n[runs[1]]["fused_forward_ep"]
            for r in range(size):
                pairs = list(zip(out[runs[1]][r], out[runs[0]][r]))
                eq = [torch.equal(a, b) for a, b in pairs]
                rel = max((float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp_min(1e-30))
                           for i, (a, b) in enumerate(pairs) if i in loose), default=0.0)
                ok = all(e for i, e in enumerate(eq) if i not in loose) and rel <= 2e-2 and fused == size
                rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} fused fwd == unfused", bitwise=all(eq), ok=ok,
                                note=f"[y and every gradient] equal: {eq}; dWg / dWu relL1 {rel:.1e}; "
                                     f"{fused} fused forwards (want {size})"))
            bwd = n[runs[2]]["backward_fused_ep"]
            for r in range(size):
                eq = [torch.equal(a, b) for a, b in zip(out[runs[2]][r], out[runs[1]][r])]
                rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} fused bwd == unfused", bitwise=all(eq),
                                ok=all(eq) and bwd == size,
                                note=f"y, dx, d topk_w, dW... equal (vs backward_path=unfused): {eq}; "
                                     f"{bwd} fused EP backwards (want {size})"))
            for r in range(size):
                eq = [torch.equal(a, b) for a, b in zip(out[runs[3]][r], out[runs[2]][r])]
                rows.append(Row(f"sm100 layer_ep{size}v {name} r{r} 2-CTA bulk push == st", bitwise=all(eq), ok=all(eq),
                                note=f"y, dx, d topk_w, dW... equal: {eq}"))
    finally:
        for name, fn in real.items():
            setattr(Sm100ExpertMLP, name, fn)
    return rows


def _ep_child() -> list[Row]:
    """:func:`_ep_rows` from a child ``gpu_check.py sm100`` with layer_ep_virtual's CHILD_ENV (eager
    module loading, DSL launches: nothing loaded or captured while a peer waits)."""
    from tools.checks.layer_ep_virtual import CHILD_ENV, CHILD_TIMEOUT_S

    return child_rows("sm100", {**CHILD_ENV, EP_CHILD: "1"}, CHILD_TIMEOUT_S, "sm100 layer_ep2v")


def run(ctx) -> list[Row]:
    if skipped := sm100_skip(ctx, "sm100"):
        return skipped
    if os.environ.get(EP_CHILD) == "1":
        return _ep_rows(ctx.device)
    return _gemm_rows(ctx.device) + _layer_rows(ctx.device) + _fused_rows(ctx.device) + _bench_rows(ctx.device) + \
        _ep_child()

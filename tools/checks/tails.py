"""Device check: H, I and I_s multiples of 64 but not of 256 on the sm90 backend (issue 14,
item 1): the last n-tile of a GEMM runs past N (its B rows zero-filled by TMA, its stores
masked or clipped).

GEMMs: the checks of :mod:`checks.gemm_sm90` (vs the reference, NaN-poisoned outputs whose
buffers end in a sentinel, 5 repeats bitwise) at tail dimensions (TMA-store epilogues, dSwiGLU's
masked stores), h's MXFP8 copy included.

Layer: ``mok_cute.moe(backend="sm90")`` at real models' dimensions (DeepSeek-V2-Lite H 2048,
I 1408; gpt-oss H = I = 2880; a small H 320, I 128, I_s 192) vs the reference backend at the
same precision (BF16: max-abs <= 0.5, rel-L1 <= 1e-2; MXFP8: rel-L1 <= 2e-2), y and every
gradient, shared expert on, skewed routing with -1 slots; the backward paths FUSED and
FUSED_WHOLE and the unfused forward (``forward_path="unfused"``) bitwise equal to the fused
forward + the unfused backward (``backward_path="unfused"``); 3 repeats bitwise; ``main_grads``
on FUSED_WHOLE (accumulated in the fused epilogue) bitwise start + fp32(fresh dW).
"""
from __future__ import annotations

import contextlib

import torch

from tools.checks.common import Row, seeded, sm90_skip
from tools.checks.layer_sm90 import OUT_NAMES, _problem, _run

SHAPES = [("DeepSeek-V2-Lite H2048 I1408", 700, 2048, 1408, 8, 4),
          ("gpt-oss H2880 I2880", 300, 2880, 2880, 4, 2),
          ("small H320 I128", 500, 320, 128, 6, 3)]
TOL = {"bf16": (0.5, 1e-2), "mxfp8": (1.0, 2e-2)}


@contextlib.contextmanager
def _dims(mod, h, inter):
    """The GEMM check module's correctness shape set to (H, I) for the block."""
    old = mod.H, mod.INTER
    mod.H, mod.INTER = h, inter
    try:
        yield
    finally:
        mod.H, mod.INTER = old


def _gemm_rows(dev) -> list[Row]:
    from tools.checks import gemm_sm90 as G
    from mok_cute import reference as ref
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    gen = seeded(4321)
    rows = []
    for h, inter in ((2880, 1408), (320, 128), (2048, 192)):
        with _dims(G, h, inter):
            tag = f" H{h} I{inter}"
            for r in (G._check_plain(gg, ref, dev, gen, "skewed", torch.int32),
                      G._check_swiglu(gg, ref, dev, gen, "skewed", 4.0),
                      G._guarded("dgrad1", G._check_dgrad1, bwd, ref, dev, gen, "skewed"),
                      G._guarded("wgrad", G._check_wgrad, bwd, ref, dev, gen, "skewed", False),
                      G._guarded("wgrad", G._check_wgrad, bwd, ref, dev, gen, "uniform", True),
                      G._guarded("dswiglu dgrad", G._check_dswiglu_dgrad, bwd, ref, dev, gen, "skewed", 4.0),
                      G._guarded("swiglu mx_h", G._check_swiglu_mx, gg, ref, dev, gen, "skewed", 4.0),
                      G._guarded("swiglu mx_h", G._check_swiglu_mx, gg, ref, dev, gen, "uniform", None)):
                r.name += tag
                rows.append(r)
    return rows


def _errors(outs, refs):
    worst_abs, worst_rel, bad = 0.0, 0.0, []
    for name, o, r in zip(OUT_NAMES, outs, refs):
        d = (o.float() - r.float()).abs()
        a = float(d.max()) if d.numel() else 0.0
        rel = float(d.sum() / r.float().abs().sum().clamp_min(1e-30))
        fin = bool(torch.isfinite(o.float()).all())
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
        if not fin or a != a or rel != rel:
            bad.append(f"{name} finite={fin}")
    return worst_abs, worst_rel, bad


def _paths(backward: str, forward: str = "fused") -> dict:
    """MoKConfig fields: the backward path ``backward`` after the forward path ``forward``."""
    return dict(forward_path=forward, backward_path=backward)


def _layer_rows(dev) -> list[Row]:
    rows = []
    for si, (name, t, h, inter, e, k) in enumerate(SHAPES):
        x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, True, True, dev, seed=300 + si)
        if h == 320:  # a shared expert of another width (I_s 192)
            g = torch.Generator(device=dev).manual_seed(7)
            sh = tuple((torch.randn(*s, device=dev, generator=g) * f ** -0.5).bfloat16()
                       for s, f in (((192, h), h), ((192, h), h), ((h, 192), 192)))
        for precision in ("bf16", "mxfp8"):
            max_abs, max_rel = TOL[precision]
            want = _run("reference", x, idx, w, ws, sh, dy, 4.0, precision=precision)
            runs = {m: [_run("sm90", x, idx, w, ws, sh, dy, 4.0, precision=precision, **_paths(m))
                        for _ in range(3 if m == "unfused" else 1)] for m in ("unfused", "fused", "fused_whole")}
            base = runs["unfused"][0]
            rep = all(all(torch.equal(a, b) for a, b in zip(base, r)) for r in runs["unfused"][1:])
            modes = {m: all(torch.equal(a, b) for a, b in zip(base, runs[m][0])) for m in ("fused", "fused_whole")}
            unfused = _run("sm90", x, idx, w, ws, sh, dy, 4.0, precision=precision, **_paths("unfused", "unfused"))
            modes["unfused fwd"] = all(torch.equal(a, b) for a, b in zip(base, unfused))
            a, rel, bad = _errors(base, want)
            ok = rep and all(modes.values()) and not bad and a <= max_abs and rel <= max_rel
            rows.append(Row(f"layer tails {name} {precision}", max_err=a, bitwise=rep and all(modes.values()), ok=ok,
                            note=f"relL1={rel:.2e} vs reference; repeats equal {rep}; == unfused backward: {modes} "
                                 f"{' '.join(bad)}"))
    rows.append(_main_grads_row(dev))
    return rows


def _main_grads_row(dev) -> Row:
    """main_grads on the backward path FUSED_WHOLE (the fused epilogue adds each dW tile) at H 2880, I 1408."""
    import mok_cute

    x, idx, w, ws, sh, dy = _problem(400, 2880, 1408, 4, 2, True, True, dev, seed=77)
    fresh = _run("sm90", x, idx, w, ws, sh, dy, 4.0, **_paths("unfused"))[3:]
    g = torch.Generator(device=dev).manual_seed(5)
    start = [torch.randn(p.shape, device=dev, generator=g) for p in (*ws, *sh)]
    acc = [s.clone() for s in start]
    params = [p.clone().requires_grad_() for p in (*ws, *sh)]

    def step():
        y = mok_cute.moe(x, idx, w, *params[:3], shared=tuple(params[3:]), swiglu_limit=4.0,
                         config=mok_cute.MoKConfig(backend="sm90", **_paths("fused_whole")), main_grads=tuple(acc))
        y.backward(dy)

    step()
    torch.cuda.synchronize()
    same = [torch.equal(a, s + f.float()) for a, s, f in zip(acc, start, fresh)]
    return Row("main_grads tails H2880 I1408 fused_whole", bitwise=all(same), ok=all(same),
               note=f"== start + fp32(fresh dW): {same}; .grad None: {all(p.grad is None for p in params)}")


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "tails"):
        return skipped
    return _gemm_rows(ctx.device) + _layer_rows(ctx.device)

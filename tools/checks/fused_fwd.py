"""Device check: the fused SM90 forward (one persistent launch; mok_cute.kernels.sm90.fused_moe)
through mok_cute.moe at EP = 1, BF16.

Per routing case (uniform, skewed with empty experts and -1 slots, every token to one expert,
with and without the shared expert, SwiGLU clamped at 4 and not, gpt-oss's SwiGLU: ``SwiGLU.gpt_oss()``, alpha
1.702, up offset 1, limit 7; also in the MXFP8 and the helper-warp rows):
  * y and every gradient (the backward is the unfused one, fed by the fused forward's saved
    rows; it gathers x's rows again) vs the reference backend at MoK's BF16 tolerances (max-abs 0.5, rel-L1 1e-2);
  * y bitwise equal to the unfused sm90 forward (``forward_path="unfused"``; the same GEMM tiles and the
    same slot-sum rounding, so the two must agree to the bit);
  * y bitwise across 5 repeats and across comm_sms_fwd in (2, 8, 40) and minibatch_tokens
    (256, 1024, 4096: a ring of 8 and 32 slots, reused, and one slot per m-tile);
  * MXFP8 (precision="mxfp8", two cases): y bitwise equal to the unfused MXFP8 forward and
    across comm_sms_fwd and minibatch_tokens, y and every gradient within rel-L1 2e-2 of the reference backend at
    mxfp8;
  * exactly one fused-kernel launch per forward (torch.profiler kernel names);
  * the helper warps (the S1 / R1 tiles' h by the producer warpgroup's warps, beside one background-gather warp
    which at BF16 moves its rows by cp.async.bulk): at H 2048 and 2880 (BF16) and H 7168 (MXFP8), y and every
    gradient bitwise the unfused forward's, y across three configurations;
  * CUDA-graph capture and replay of the forward equals eager (validate_routing=False).
"""
from __future__ import annotations

import torch

from mok_cute import SwiGLU
from tools.checks.common import Row
from tools.checks.layer_sm90 import _compare, _problem, _run

REPEATS = 5
UNFUSED = dict(forward_path="unfused")
GPT_OSS = SwiGLU.gpt_oss()  # gpt-oss's activation (the kernels compile its alpha and up offset in)
# (name, skew, shared, limit, every token to one expert) of the BF16 rows at T 1000, H 1024, I 512, E 8, k 4
CASES = (("uniform", False, False, None, False), ("skew+shared L=4", True, True, 4.0, False),
         ("skew", True, False, None, False), ("uniform+shared", False, True, None, False),
         ("one expert+shared L=4", False, True, 4.0, True), ("skew+shared gpt-oss", True, True, GPT_OSS, False))
# (name, H, skew, shared, limit, precision) of the helper-warp rows at T 1500, I 512, E 8, k 4
HELPER_CASES = (("H2048 uniform+shared", 2048, False, True, None, "bf16"),
                ("H2048 skew+shared L=4", 2048, True, True, 4.0, "bf16"),
                ("H2048 skew", 2048, True, False, None, "bf16"),
                ("H2880 skew+shared", 2880, True, True, None, "bf16"),  # a row of 1.4 bulk segments, the n_tail variant
                ("mxfp8 H7168 skew+shared L=4", 7168, True, True, 4.0, "mxfp8"),
                ("H2048 skew+shared gpt-oss", 2048, True, True, GPT_OSS, "bf16"))
# (name, skew, shared, limit) of the MXFP8 rows at T 1000, H 1024, I 512, E 8, k 4
MX_CASES = (("uniform", False, False, None), ("skew+shared L=4", True, True, 4.0),
            ("skew+shared gpt-oss", True, True, GPT_OSS))


def _moe(x, idx, w, ws, sh, limit, **cfg):
    import mok_cute

    return mok_cute.moe(x, idx, w, *ws, shared=sh, swiglu_limit=limit,
                        config=mok_cute.MoKConfig(backend="sm90", **cfg))


def _unfused(*args, **cfg):
    return _moe(*args, **UNFUSED, **cfg)


CONFIGS = ((16, 1024), (2, 256), (40, 4096))  # (comm_sms_fwd, minibatch_tokens) of the helper rows


def _one_expert(x, idx, w):
    idx = torch.full_like(idx, -1)
    idx[:, 0] = 3
    return idx


def _launches(fn) -> tuple[int, int]:
    """(fused-kernel launches, all kernel launches) of one ``fn()`` call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]
    return sum("FusedMoeFwdSm90" in n for n in kernels), len(kernels)


def _helper_rows(dev, fused) -> list[Row]:
    """Per case ``(name, H, skew, shared, limit, precision)`` (T 1500, I 512, E 8, k 4) at a depth where the helper
    warps run (``fused_moe.fused_helpers``: BF16 from H 2048, MXFP8 from H 7168): y and every gradient bitwise the
    unfused forward's (the same backward on bitwise the same saved rows), y bitwise across three configurations
    (the ring reused at 256 tokens)."""
    rows = []
    for i, (name, hid, skew, shared, limit, prec) in enumerate(HELPER_CASES):
        x, idx, w, ws, sh, dy = _problem(1500, hid, 512, 8, 4, shared, skew, dev, seed=370 + i)
        outs = _run("sm90", x, idx, w, ws, sh, dy, limit, precision=prec)
        base = _run("sm90", x, idx, w, ws, sh, dy, limit, precision=prec, **UNFUSED)
        with torch.no_grad():
            ys = [_moe(x, idx, w, ws, sh, limit, precision=prec, comm_sms_fwd=c, minibatch_tokens=m)
                  for c, m in CONFIGS]
        fused.check_errors()
        equal = [torch.equal(a, b) for a, b in zip(outs, base)]
        same = [torch.equal(y, outs[0]) for y in ys]
        rows.append(Row(f"fused fwd helpers {name}", bitwise=all(same), ok=all(equal) and all(same),
                        note=f"y, grads == unfused: {equal}; y == 3 configurations: {same}"))
    return rows


def _mx_rows(dev, fused) -> list[Row]:
    """MXFP8: y bitwise the unfused MXFP8 forward's and across comm CTAs; everything within the MXFP8 tolerance of
    the reference backend at mxfp8 (rel-L1 2e-2, as checks/layer_fp8)."""
    rows = []
    for i, (name, skew, shared, limit) in enumerate(MX_CASES):
        x, idx, w, ws, sh, dy = _problem(1000, 1024, 512, 8, 4, shared, skew, dev, seed=350 + i)
        ref = _run("reference", x, idx, w, ws, sh, dy, limit, precision="mxfp8")
        outs = _run("sm90", x, idx, w, ws, sh, dy, limit, precision="mxfp8")
        with torch.no_grad():
            ys = [_moe(x, idx, w, ws, sh, limit, precision="mxfp8", comm_sms_fwd=c, minibatch_tokens=m)
                  for c, m in ((40, 4096), (40, 4096), (4, 256), (16, 1024))]
            y_unfused = _unfused(x, idx, w, ws, sh, limit, precision="mxfp8")
        same = all(torch.equal(ys[0], y) for y in ys[1:]) and torch.equal(outs[0], ys[0])
        rel = max(float((o.float() - r.float()).abs().sum() / r.float().abs().sum().clamp_min(1e-30))
                  for o, r in zip(outs, ref))
        eq = torch.equal(ys[0], y_unfused)
        rows.append(Row(f"fused fwd mxfp8 {name}", bitwise=same, ok=same and eq and rel <= 2e-2,
                        note=f"max relL1 {rel:.2e} (<= 2e-2) ==unfused mxfp8:{'yes' if eq else 'NO'}"))
    fused.check_errors()
    return rows


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_fwd")
    if skip:
        return skip
    from mok_cute.kernels.sm90 import fused_moe as fused

    dev, rows = ctx.device, []
    for i, (name, skew, shared, limit, one) in enumerate(CASES):
        x, idx, w, ws, sh, dy = _problem(1000, 1024, 512, 8, 4, shared, skew, dev, seed=300 + i)
        if one:
            idx = _one_expert(x, idx, w)
        ref = _run("reference", x, idx, w, ws, sh, dy, limit)
        outs = _run("sm90", x, idx, w, ws, sh, dy, limit, forward_path="fused")
        with torch.no_grad():
            ys = [_moe(x, idx, w, ws, sh, limit) for _ in range(REPEATS)]
            ys += [_moe(x, idx, w, ws, sh, limit, comm_sms_fwd=c, minibatch_tokens=m)
                   for c, m in ((2, 256), (8, 4096), (40, 1024))]
            y_unfused = _unfused(x, idx, w, ws, sh, limit)
        fused.check_errors()
        same = all(torch.equal(ys[0], y) for y in ys[1:]) and torch.equal(outs[0], ys[0])
        row = _compare(f"fused fwd {name}", outs, ref, same)
        eq_unfused = torch.equal(ys[0], y_unfused)
        row.ok &= eq_unfused
        row.note += f" ==unfused:{'yes' if eq_unfused else 'NO'}"
        rows.append(row)
    rows += _mx_rows(dev, fused)
    fused.check_errors()
    rows += _helper_rows(dev, fused)
    # one launch per forward, and CUDA-graph capture == eager
    x, idx, w, ws, sh, dy = _problem(2048, 1024, 512, 8, 4, True, False, dev, seed=400)
    with torch.no_grad():
        fwd = lambda: _moe(x, idx, w, ws, sh, 4.0, validate_routing=False)
        n_fused, n_all = _launches(fwd)
        rows.append(Row("fused fwd launches per forward", ok=n_fused == 1,
                        note=f"fused kernel x{n_fused}, {n_all} kernels in all (plan included)"))
        eager = fwd()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fwd()  # warm: compile and load outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                y_g = fwd()
            g.replay()
            torch.cuda.synchronize()
            rows.append(Row("fused fwd CUDA graph replay == eager", bitwise=torch.equal(y_g, eager),
                            ok=torch.equal(y_g, eager)))
        except Exception as exc:  # report, the other rows stand
            import traceback

            traceback.print_exc()
            rows.append(Row("fused fwd CUDA graph replay == eager", ok=False, note=f"{type(exc).__name__}: {exc}"[:150]))
    fused.check_errors()
    return rows

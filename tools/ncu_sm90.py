"""Profile target for Nsight Compute: each SM90 expert-MLP kernel once, at 8 experts x 4096
rows, H 7168, I 2048 (bf16), plus torch's grouped_mm at the GEMM1 shape for comparison.

Kernels are compiled and warmed up first; only the profiled launches run between
``torch.cuda.profiler.start()`` and ``stop()``, so run it as (on the H200, repo root):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --csv python3 tools/ncu_sm90.py

``--fp8`` profiles the FP8 GEMMs beside the BF16 one instead (:func:`fp8_kernels`).
Without ncu it just runs (prints one line per kernel), which is how the test suite's
import check and a dry run use it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernels(e: int = 8, rows: int = 4096, hid: int = 7168, inter: int = 2048):
    """[(name, fn)] for the SM90 kernels of one expert-MLP fwd+bwd at the given shape."""
    import torch.nn.functional as F  # noqa: PLC0415

    from mok_cute.kernels.sm90 import expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415

    dev = torch.device("cuda")
    m = e * rows
    offs = torch.arange(0, m + 1, rows, device=dev, dtype=torch.int32)
    x = torch.randn(m, hid, device=dev).bfloat16()
    wg = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wu = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wd = (torch.randn(e, hid, inter, device=dev) * inter ** -0.5).bfloat16()
    h = torch.randn(m, inter, device=dev).bfloat16()
    dy = torch.randn(m, hid, device=dev).bfloat16()
    gu = torch.randn(m, 2 * inter, device=dev).bfloat16()
    dgu = torch.randn(m, 2 * inter, device=dev).bfloat16()
    w1t = torch.cat([wg, wu], dim=1).transpose(1, 2)  # [E, H, 2I] view for torch
    return [
        ("gemm1+swiglu", lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=4.0)),
        ("gemm2", lambda: gg.grouped_gemm(h, offs, wd)),
        ("dgrad2+dswiglu", lambda: bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=4.0)),
        ("dgrad1", lambda: bwd.grouped_dgrad1(dgu, offs, wg, wu)),
        ("wgrad dWd", lambda: bwd.grouped_wgrad(dy, h, offs)),
        ("torch grouped_mm gemm1", lambda: F.grouped_mm(x, w1t, offs=offs[1:])),
    ]


def fp8_kernels(e: int = 8, rows: int = 4096, hid: int = 7168, inter: int = 2048):
    """[(name, fn)]: each fp8_block expert-MLP kernel beside its BF16 counterpart (GEMM1 +
    SwiGLU, GEMM2, dgrad2 + dSwiGLU, dgrad1, wgrad dWd) and the
    fp8_block quantizers (1x128 rows, 128x128 weight, token-wise), at the shape of
    :func:`kernels`; operands quantized once, outside the profiled range."""
    from mok_cute.kernels.quant import quantize_fp8  # noqa: PLC0415
    from mok_cute.kernels.sm90 import fp8_expert as sm90_fp8_expert, fp8_gemm as sm90_fp8_gemm, fp8_scaled as sm90_fp8_scaled

    bf16 = dict(kernels(e, rows, hid, inter))
    dev = torch.device("cuda")
    m = e * rows
    offs = torch.arange(0, m + 1, rows, device=dev, dtype=torch.int32)
    x = torch.randn(m, hid, device=dev).bfloat16()
    h = torch.randn(m, inter, device=dev).bfloat16()
    dy = torch.randn(m, hid, device=dev).bfloat16()
    dgu = torch.randn(m, 2 * inter, device=dev).bfloat16()
    gu = torch.randn(m, 2 * inter, device=dev).bfloat16()

    def weight(n, k):
        w = (torch.randn(e * n, k, device=dev) * k ** -0.5).bfloat16()
        q, s = quantize_fp8.quantize_fp8_block_weight(w)
        return w, (q.view(e, n, k), s.view(e, n // 128, k // 128))

    _, wg = weight(inter, hid)
    _, wu = weight(inter, hid)
    wd_bf16, wd = weight(hid, inter)
    wdt = sm90_fp8_expert.transpose_weight_blocks(wd)
    w1t = sm90_fp8_expert.transpose_weight_blocks(wg, wu)
    xq, hq, dyq, dguq = (quantize_fp8.quantize_fp8_block_act(t) for t in (x, h, dy, dgu))
    dy_t, h_t = (quantize_fp8.quantize_tokens(t, offs, "fp8_block") for t in (dy, h))
    return [
        ("bf16 gemm1+swiglu", bf16["gemm1+swiglu"]),
        ("fp8 gemm1+swiglu", lambda: sm90_fp8_expert.grouped_gemm1_swiglu_fp8_block(*xq, offs, *wg, *wu, limit=4.0)),
        ("bf16 gemm2", bf16["gemm2"]),
        ("fp8 gemm2", lambda: sm90_fp8_gemm.grouped_gemm_fp8_block(*hq, offs, *wd)),
        ("bf16 dgrad2+dswiglu", bf16["dgrad2+dswiglu"]),
        ("fp8 dgrad2+dswiglu", lambda: sm90_fp8_expert.grouped_dswiglu_dgrad_fp8_block(*dyq, offs, *wdt, gu, limit=4.0)),
        ("bf16 dgrad1", bf16["dgrad1"]),
        ("fp8 dgrad1", lambda: sm90_fp8_expert.grouped_dgrad1_fp8_block(*dguq, offs, *w1t)),
        ("bf16 wgrad dWd", bf16["wgrad dWd"]),
        ("fp8 wgrad dWd", lambda: sm90_fp8_scaled.grouped_wgrad_fp8_block(*dy_t, *h_t, offs)),
        ("quantize 1x128 rows x", lambda: quantize_fp8.quantize_fp8_block_act(x)),
        ("quantize 128x128 weight Wd", lambda: quantize_fp8.quantize_fp8_block_weight(wd_bf16)),
        ("quantize tokens dy", lambda: quantize_fp8.quantize_tokens(dy, offs, "fp8_block")),
    ]


def main() -> int:
    ks = fp8_kernels() if "--fp8" in sys.argv else kernels()
    for _, fn in ks:  # compile + warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in ks:
        fn()
        torch.cuda.synchronize()
        print(f"[ncu_sm90] ran {name}", flush=True)
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

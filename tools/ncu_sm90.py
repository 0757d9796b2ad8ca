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

    from mok_cute.kernels import sm90_expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels import sm90_grouped_gemm as gg  # noqa: PLC0415

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


def fp8_kernels(e: int = 8, rows: int = 4096, k: int = 7168, n: int = 4096):
    """[(name, fn)]: the FP8 grouped GEMMs (fp8_block default consumer, MXFP8 per-32 promoted)
    and the BF16 plain grouped GEMM at one shape (operands quantized once, outside)."""
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels import quantize, quantize_fp8, sm90_fp8_gemm, sm90_fp8_scaled  # noqa: PLC0415
    from mok_cute.kernels import sm90_grouped_gemm as gg  # noqa: PLC0415

    dev = torch.device("cuda")
    m = e * rows
    offs = torch.arange(0, m + 1, rows, device=dev, dtype=torch.int32)
    x = torch.randn(m, k, device=dev).bfloat16()
    w = (torch.randn(e, n, k, device=dev) * k ** -0.5).bfloat16()
    xq, xs = quantize_fp8.quantize_fp8_block_act(x)
    wq = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=dev)
    ws = torch.empty(e, n // 128, k // 128, device=dev)
    for i in range(e):
        wq[i], ws[i] = ref.fp8_block_quantize_weight(w[i])
    xmq, xms = quantize.quantize_mxfp8(x, -1)
    wmq, wms = quantize.quantize_mxfp8(w.reshape(e * n, k), -1)
    wmq, wms = wmq.view(e, n, k), wms.view(e, n, k // 32)
    return [
        ("bf16 plain K7168 N4096", lambda: gg.grouped_gemm(x, offs, w)),
        ("fp8_block K7168 N4096", lambda: sm90_fp8_gemm.grouped_gemm_fp8_block(xq, xs, offs, wq, ws)),
        ("mxfp8 promoted K7168 N4096", lambda: sm90_fp8_scaled.grouped_gemm_mxfp8_promoted(xmq, xms, offs, wmq, wms)),
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

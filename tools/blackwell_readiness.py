"""Compile every SM100 kernel (expert GEMMs, the fused forward, the fused backward core) for
sm_100a and sm_103a (CPU only) and print a readiness table: compiled per arch, key PTX
instructions, TMA descriptors (kernel CUtensorMap parameters), registers, spills, shared memory.

Nothing here runs a kernel: no Blackwell GPU was available, so everything at run time
(numerics, barrier protocol, TMEM/scale-factor layouts on hardware, performance) stays
unverified. Usage: ``python tools/blackwell_readiness.py``.
"""
from __future__ import annotations

import re
import sys
import time

from mok_cute.kernels.sm100 import fused_bwd, fused_moe, grouped_gemm

ARCHS = ("sm_100a", "sm_103a")
UNVERIFIED = (
    "run-time numerics vs mok_cute.reference (no Blackwell GPU)",
    "mbarrier / TMEM alloc protocol on hardware (hangs, races), cta_group::2 cluster pairing",
    "MXFP8 cta_group::2: SFB split + multicast over the CTA pair, SFA tiles at odd 128-row atoms",
    "scale-factor TMEM placement (tcgen05.cp) and the grouped 128x4 SF layouts on hardware",
    "TMA ragged-K wrap-around (wgrad, incl. column-slice operands) on sm_100a",
    "dgrad1's switch between the dgu-half / w_gate / w_up descriptors at k-tile ceil(I / tile_k) on hardware",
    "N / K tails on hardware: partial last tiles, TMA boxes past (or wider than) the tensor, e.g. I = 128 < tile_n",
    "performance (stores are per-row 16-byte vectors, no TMA store; multicast only for the 2-CTA MXFP8 SFB)",
    "fused forward: ticket / readiness counters, the task-id mbarrier ring (TMA -> MMA + epilogue warps), "
    "ring-slot reuse, bounded waits and the slot sum on hardware; bitwise equality with the unfused SM100 path",
    "fused forward BF16 gather through the B stages (slot_rows.gather_rows_staged: cp.async one batch behind, the "
    "async-proxy fence before the stages' TMA loads): ring rows equal to the register gather's (MXFP8 / EP > 1)",
    "fused forward MXFP8: the gather's scale words into the ring's blocked scales (slot = scale atom row), the "
    "SwiGLU epilogue's h quantization and scale bytes (grouped atom rows), read by TMA after the readiness counters",
    "fused backward core: the ticket, d2[mt] readiness counts and bounded waits, D2 / D1 / W tiles through one "
    "ring read with two smem layouts (K- and MN-major A) on hardware; bitwise equality with the unfused SM100 "
    "backward",
    "fused forward EP > 1 (ep): the READY / DONE / DATA / FREE flags across ranks, peer pulls into the ring (MXFP8: "
    "the staged rows' scale words), R2's pushes to peer slot rows after FREE, the system-scope fences",
    "fused backward gather / shared (mode 3): the comm CTAs' routed rows (route_row, copy_row) read by TMA after "
    "gdy[mt], the shared expert's group interleaved in the ticket order; bitwise the unfused backward",
    "fused backward EP > 1 (ep, mode 3): dy / x rows pulled from the peers' dy / src sections between READY and "
    "DONE, D1 rows pushed to the source ranks' slots after FREE (system-scope fence), DATA before the slot sum, "
    "FREE after; d topk_w from this rank's slot rows; bitwise the unfused EP backward",
    "fused backward core MXFP8: D2's dgu quantizations (along I into the blocked row scales, along tokens by "
    "warp shuffles into the token scales) read by D1 / dWg / dWu's TMA after d2[mt]; bitwise mx_backward",
    "fused backward MXFP8 mode 3 / EP > 1: the comm CTAs' quantized dy / x operands (mx_gather.quantize_tile; "
    "its bytes verified bitwise on an H200 by gpu_check mx_gather, arch-neutral code) read by D2's and the W "
    "tiles' TMA after gdy[mt] (generic-proxy stores, then the async-proxy fence); bitwise the unfused backward",
    "fused backward MXFP8 tokens with consume (grouped_slots): D1 rows stored over the bf16 dy in grouped order, "
    "the slot sum reading them through the inverse route order; bitwise the slot-buffer variant",
    "fused backward main_grads (accumulate): the W epilogue's fp32 read-add-write of each dW tile "
    "(GroupedGemmSm100._store_accumulate); bitwise start + fp32(dW)",
    "fused forward gather='tma' (Sm100Launch, a kernel launch parameter): R1's rows by TMA tile::gather4 from x into "
    "A's MMA "
    "layout (the gather4 atom built on the tile atom's _thrfrg_A projection), 32 issues per k-tile from the TMA "
    "warp: bitwise the comm-gather forward; its speed against the ring",
)


def main() -> int:
    rows, failed = [], 0
    for name, (build, needed) in {**grouped_gemm.variants(), **fused_moe.variants(), **fused_bwd.variants()}.items():
        cells, regs, spills, info = [name], [], [], ""
        for arch in ARCHS:
            t0 = time.time()
            try:
                _, rep = build(arch)
            except Exception as exc:  # report and continue: the table is the point
                failed += 1
                cells.append(f"NO ({type(exc).__name__})")
                continue
            missing = [i for i in needed if not rep.has(i)]
            ok = not missing and rep.total_spill_bytes == 0 and rep.registers
            failed += not ok
            cells.append(f"yes {time.time() - t0:.1f}s" + ("" if ok else f" MISSING {missing}"))
            regs.append(str(rep.max_registers))
            spills.append(str(rep.total_spill_bytes))
            tma = len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx))
            info = f"{tma} | {', '.join(i for i in needed if rep.has(i))}"
        rows.append(cells + ["/".join(regs), "/".join(spills), info])
    print("| kernel | sm_100a | sm_103a | registers (100a/103a) | spill bytes | TMA descriptors | PTX found |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nShared memory per CTA (host budget, sm100_layouts; checked against CuTe at trace time):")
    from mok_cute.kernels.sm100.grouped_gemm import DEFAULT_CONFIG, MXFP8_2CTA_CONFIG, MXFP8_CONFIG  # noqa: PLC0415
    from mok_cute.kernels.sm100.mainloop import Sm100Config, Sm100Mainloop  # noqa: PLC0415

    for label, cfg in (("bf16 128x256", DEFAULT_CONFIG), ("bf16 256x256 2cta", Sm100Config(tile_m=256)),
                       ("mxfp8 128x256", MXFP8_CONFIG), ("mxfp8 256x256 2cta", MXFP8_2CTA_CONFIG)):
        ml = Sm100Mainloop(cfg)
        print(f"  {label}: {ml.stages} stages x {ml.stage_bytes} B + {1024} B = {ml.smem_bytes} B; "
              f"TMEM {ml.tmem_used} of {ml.tmem_alloc} allocated columns, {ml.acc_stages} accumulator stage(s)")
    print("\nUnverified (everything at run time):")
    for u in UNVERIFIED:
        print(f"  - {u}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Device check: the fused SM90 forward with ``MOK_CUTE_FUSED_TMA_STORE=1`` (its S1 / R1 / S2 tiles leave
through TMA stores, row-bounded per expert, and are published once the store warp has seen them written).

Per case (uniform + shared, skewed + shared with empty experts, -1 slots and SwiGLU clamped at 4, and
H 1216 / I 320: the masked last n-tiles), at 132 CTAs and at 8 comm CTAs with 256-token minibatches:
every output of ``fused_moe.fused_forward`` (y, gu, h, the slot rows, gus, hs, s_out) bitwise the
default variant's, run twice (the TMA-stored tensors are what the backward and GEMM2 read).
"""
from __future__ import annotations

import torch

from checks.common import Row, env_var
from checks.layer_sm90 import _problem

CASES = (("uniform+shared", 1024, 512, False, None), ("skew+shared L=4", 1024, 512, True, 4.0),
         ("uniform+shared H1216 I320", 1216, 320, False, None))
CONFIGS = ((16, 1024), (8, 256))  # (comm CTAs, minibatch tokens)


def _forward(x, idx, w, ws, sh, limit, comm: int, minibatch: int) -> list[torch.Tensor]:
    from mok_cute.kernels.sm90 import fused_moe as fused
    from mok_cute.layers.grouped import routing_plan

    order, offsets, idx32 = routing_plan(idx, ws[0].shape[0], watch=False)
    ring = -(-minibatch * idx.shape[1] // fused.CHUNK)
    out = fused.fused_forward(x, order, offsets, idx32, w.float().contiguous(), *ws, sh, limit, comm, 10.0,
                              ring_chunks=ring)
    fused.check_errors()
    return [o for o in out[:7] if o is not None]


def run(ctx) -> list[Row]:
    from checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_tma_store")
    if skip:
        return skip
    rows = []
    for i, (name, h, inter, skew, limit) in enumerate(CASES):
        x, idx, w, ws, sh, _ = _problem(1000, h, inter, 8, 4, True, skew, ctx.device, seed=700 + i)
        with torch.no_grad():
            for comm, mb in CONFIGS:
                want = _forward(x, idx, w, ws, sh, limit, comm, mb)
                with env_var("MOK_CUTE_FUSED_TMA_STORE", "1"):
                    got = [_forward(x, idx, w, ws, sh, limit, comm, mb) for _ in range(2)]
                same = [all(torch.equal(a, b) for a, b in zip(want, g)) for g in got]
                rows.append(Row(f"fused fwd tma_store {name} c{comm} m{mb}", bitwise=all(same), ok=all(same),
                                note=f"y, gu, h, slot rows, gus, hs, s_out == the default variant's: {same}"))
    return rows

"""Device check: the fused SM90 forward with ``MOK_CUTE_FUSED_TMA_STORE=1`` (at EP = 1 every tile leaves
through TMA stores, row-bounded per expert, and is published once the store warp has seen it written; the
GEMM2 rows are stored by grouped row and the slot sum reads them through the inverse route order).

Per case (uniform + shared, skewed + shared with empty experts, -1 slots and SwiGLU clamped at 4, and
H 1216 / I 320: the masked last n-tiles), at 132 CTAs and at 8 comm CTAs with 256-token minibatches:
every output of ``fused_moe.fused_forward`` (y, gu, h, the slot rows, gus, hs, s_out) bitwise the
default variant's (the slot rows: grouped row i the default's route ``order[i]``), run twice (the TMA-stored
tensors are what the backward and GEMM2 read); and the layer's y and gradients (``mok_cute.moe``, the backward
reading the grouped rows) bitwise the default's.
"""
from __future__ import annotations

import torch

from checks.common import Row, env_var
from checks.layer_sm90 import _problem

CASES = (("uniform+shared", 1024, 512, False, None), ("skew+shared L=4", 1024, 512, True, 4.0),
         ("uniform+shared H1216 I320", 1216, 320, False, None))
CONFIGS = ((16, 1024), (8, 256))  # (comm CTAs, minibatch tokens)


def _forward(x, idx, w, ws, sh, limit, comm: int, minibatch: int, grouped: bool = False) -> list[torch.Tensor]:
    """The outputs of one fused forward; ``grouped``: its slot rows (by grouped row) put back in route order."""
    from mok_cute.kernels.sm90 import fused_moe as fused
    from mok_cute.layers.grouped import routing_plan

    order, offsets, idx32 = routing_plan(idx, ws[0].shape[0], watch=False)
    ring = -(-minibatch * idx.shape[1] // fused.CHUNK)
    out = list(fused.fused_forward(x, order, offsets, idx32, w.float().contiguous(), *ws, sh, limit, comm, 10.0,
                                   ring_chunks=ring)[:7])
    fused.check_errors()
    if grouped:  # the rows of routes with an expert (rows of -1 slots are never written)
        m = int(offsets[-1])
        by_route = torch.zeros_like(out[3])
        by_route[order[:m].long()] = out[3][:m]
        out[3] = by_route
    else:
        valid = torch.zeros(out[3].shape[0], dtype=torch.bool, device=x.device)
        valid[order[:int(offsets[-1])].long()] = True
        out[3] = torch.where(valid[:, None], out[3], torch.zeros_like(out[3]))
    return [o for o in out if o is not None]


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
                    got = [_forward(x, idx, w, ws, sh, limit, comm, mb, grouped=True) for _ in range(2)]
                same = [all(torch.equal(a, b) for a, b in zip(want, g)) for g in got]
                rows.append(Row(f"fused fwd tma_store {name} c{comm} m{mb}", bitwise=all(same), ok=all(same),
                                note=f"y, gu, h, slot rows, gus, hs, s_out == the default variant's: {same}"))
        dy = torch.randn_like(x)
        want = _layer(x, idx, w, ws, sh, dy, limit)
        with env_var("MOK_CUTE_FUSED_TMA_STORE", "1"):
            got = _layer(x, idx, w, ws, sh, dy, limit)
        same = [torch.equal(a, b) for a, b in zip(want, got)]
        rows.append(Row(f"fused fwd tma_store {name} layer fwd+bwd", bitwise=all(same), ok=all(same),
                        note=f"y, dx, d topk_w, dW... == the default variant's: {same}"))
    return rows


def _layer(x, idx, w, ws, sh, dy, limit) -> list[torch.Tensor]:
    """y and every gradient of one fused forward + the default backward through ``mok_cute.moe``."""
    from checks.layer_sm90 import _run

    with env_var("MOK_CUTE_FUSED", "1"):
        return _run("sm90", x, idx, w, ws, sh, dy, limit)

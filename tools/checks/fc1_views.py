"""Device check: gate and up as the two halves of one [E, 2I, H] fc1 tensor on the sm90 backend:
y and every gradient bitwise those of contiguous copies (fused forward, default backward), and
torch.profiler shows no copy of the weights in the forward (no aten::copy_ / contiguous of an
expert weight's size)."""
from __future__ import annotations

import torch

from tools.checks.common import Row


def run(ctx) -> list[Row]:
    from tools.checks.common import sm90_skip
    from tools.checks.layer_sm90 import _problem
    from torch.profiler import ProfilerActivity, profile

    import mok_cute

    skip = sm90_skip(ctx, "fc1_views")
    if skip:
        return skip
    x, idx, w, ws, sh, dy = _problem(600, 1024, 512, 8, 4, True, True, ctx.device, seed=91)
    cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False)
    inter = ws[0].shape[1]
    fc1 = torch.cat([ws[0], ws[1]], 1).requires_grad_()
    wd = ws[2].clone().requires_grad_()
    sh_l = [p.clone().requires_grad_() for p in sh]

    def call(gate, up, down):
        return mok_cute.moe(x, idx, w, gate, up, down, shared=tuple(sh_l), swiglu_limit=4.0, config=cfg)

    y = call(fc1[:, :inter], fc1[:, inter:], wd)
    y.backward(dy)
    gate, up = ws[0].clone().requires_grad_(), ws[1].clone().requires_grad_()
    wd2 = ws[2].clone().requires_grad_()
    y2 = call(gate, up, wd2)
    y2.backward(dy)
    same = [torch.equal(y, y2), torch.equal(fc1.grad, torch.cat([gate.grad, up.grad], 1)), torch.equal(wd.grad, wd2.grad)]
    weight_numel = ws[0].numel()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        call(fc1[:, :inter], fc1[:, inter:], wd)
        torch.cuda.synchronize()
    copies = [ev.key for ev in prof.key_averages(group_by_input_shape=True)
              if ev.key in ("aten::copy_", "aten::contiguous", "aten::clone")
              and any(s and len(s) == 3 and s[0] * s[1] * s[2] == weight_numel for s in ev.input_shapes)]
    return [Row("fc1 halves (views of [E, 2I, H]) == contiguous weights", bitwise=all(same), ok=all(same),
                note=f"[y, d fc1, d w_down] equal: {same}"),
            Row("fc1 halves: no weight copy in the forward (profiler)", ok=not copies,
                note=f"weight-sized copy ops: {copies or 'none'}")]

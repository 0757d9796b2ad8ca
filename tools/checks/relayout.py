"""Device check: the tiled transposes of expert weights (mok_cute.kernels.relayout.relayout) and the layer's use of
them for gpt-oss's layouts (mok_cute.fc1 / mok_cute.transposed).

Each mode on small shapes with edge tiles and on gpt-oss-20b's weights (E 32, H = I = 2880: gate_up_proj
[E, H, 2I] interleaved to [E, 2I, H] halves, those halves back, down_proj [E, I, H] to [E, H, I]): bitwise
:func:`~mok_cute.kernels.relayout.reference_relayout` (torch's strided copy), a second run and the ``out=`` form
equal; one CUDA graph captures a call and replays it on new values. Timed against torch's copy (GB/s of reads plus
writes). Then ``mok_cute.moe`` on the sm90 backend with gpt-oss's views (gate and up as views of one [E, H, 2I]
interleaved tensor, w_down the transpose of a [E, I, H] tensor): y and every gradient bitwise those of contiguous
copies, the weights' gradients in their own layouts.
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded


def _mode_row(R, name, inp, mode):
    got = R.relayout(inp, mode)
    want = R.reference_relayout(inp, mode)
    into = torch.empty_like(got)
    same = torch.equal(got, R.relayout(inp, mode)) and R.relayout(inp, mode, out=into) is into \
        and torch.equal(into, got)
    ok = torch.equal(got, want) and same
    return Row(f"relayout {mode} {name}", bitwise=ok, ok=ok, note=f"inp {tuple(inp.shape)} == torch's copy")


def _graph_row(R, inp):
    out = R.relayout(inp, "deinterleave")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        R.relayout(inp, "deinterleave", out=out)
    inp.copy_(torch.randn_like(inp))
    g.replay()
    torch.cuda.synchronize()
    ok = torch.equal(out, R.reference_relayout(inp, "deinterleave"))
    return Row("relayout CUDA graph, new values", bitwise=ok, ok=ok, note="replay == torch's copy")


def _speed_row(R, name, inp, mode):
    t_k = bench_us(lambda: R.relayout(inp, mode))
    t_t = bench_us(lambda: R.reference_relayout(inp, mode))
    gb = 2 * inp.numel() * 2 / 1e9
    return Row(f"relayout speed {mode} {name}", time_us=t_k,
               note=f"{gb / t_k * 1e6:.0f} GB/s; torch copy {t_t:.0f} us ({gb / t_t * 1e6:.0f} GB/s, x{t_t / t_k:.2f})")


def _layer_row(ctx):
    """mok_cute.moe with gpt-oss's weight views against contiguous copies (sm90, gpt-oss activation and biases)."""
    import mok_cute
    from mok_cute import fc1 as F
    from mok_cute.reference import SwiGLU

    gen = seeded(5)
    dev = ctx.device
    t, h, i, e, k = 1024, 512, 256, 8, 4
    x = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev)
    w = torch.rand(t, k, generator=gen).to(dev)
    base = (torch.randn(e, h, 2 * i, generator=gen) * 0.05).bfloat16().to(dev).requires_grad_()
    down = (torch.randn(e, i, h, generator=gen) * 0.05).bfloat16().to(dev).requires_grad_()
    bgu = (torch.randn(e, 2 * i, generator=gen) * 0.1).bfloat16().to(dev).requires_grad_()
    bd = (torch.randn(e, h, generator=gen) * 0.1).bfloat16().to(dev).requires_grad_()
    dy = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False)

    def run(gate, up, wd, bg, bu):
        y = mok_cute.moe(x, idx, w, (gate, bg), (up, bu), (wd, bd), swiglu_limit=SwiGLU.gpt_oss(), config=cfg)
        y.backward(dy)
        return y

    gate, up = F.split(F.rows(base, True), True)
    y = run(gate, up, down.transpose(1, 2), bgu[:, 0::2], bgu[:, 1::2])
    grads = [base.grad, down.grad, bgu.grad.clone(), bd.grad.clone()]
    bgu.grad, bd.grad = None, None
    g2, u2 = (v.detach().contiguous().requires_grad_() for v in (gate, up))
    d2 = down.detach().transpose(1, 2).contiguous().requires_grad_()
    y2 = run(g2, u2, d2, bgu[:, 0::2], bgu[:, 1::2])
    dg, du = F.split(F.rows(grads[0], True), True)
    same = [torch.equal(y, y2), torch.equal(dg, g2.grad) and torch.equal(du, u2.grad),
            torch.equal(grads[1], d2.grad.transpose(1, 2)), torch.equal(grads[2], bgu.grad),
            torch.equal(grads[3], bd.grad)]
    layouts = grads[0].stride() == base.stride() and grads[1].is_contiguous()
    ok = all(same) and layouts
    return Row("moe with gpt-oss's views == contiguous", bitwise=all(same), ok=ok,
               note=f"[y, d gate_up, d down, d biases (2)] equal: {same}; grads in the weights' layouts {layouts}")


def run(ctx) -> list[Row]:
    from mok_cute.kernels import relayout as R  # noqa: PLC0415
    from tools.checks.common import sm90_skip  # noqa: PLC0415

    dev, gen = ctx.device, seeded(17)
    out = []
    for name, shape in (("small", (3, 24, 16)), ("edges", (2, 136, 200)), ("one tile", (1, 64, 64))):
        inp = torch.randn(*shape, generator=gen).bfloat16().to(dev)
        out += [_mode_row(R, name, inp, m) for m in R.MODES]
    e, hid, inter = 32, 2880, 2880
    gate_up = torch.randn(e, hid, 2 * inter, generator=gen).bfloat16().to(dev)
    halves = R.relayout(gate_up, "deinterleave")
    down = torch.randn(e, inter, hid, generator=gen).bfloat16().to(dev)
    big = (("gate_up [E, H, 2I]", gate_up, "deinterleave"), ("halves [E, 2I, H]", halves, "interleave"),
           ("down [E, I, H]", down, "plain"))
    out += [_mode_row(R, name, inp, m) for name, inp, m in big]
    out.append(_graph_row(R, torch.randn(4, 256, 512, generator=gen).bfloat16().to(dev)))
    out += [_speed_row(R, name, inp, m) for name, inp, m in big]
    out += sm90_skip(ctx, "relayout layer") or [_layer_row(ctx)]
    return out

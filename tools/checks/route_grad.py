"""Device check: the routed-gradient prologue (mok_cute.kernels.route_grad) vs its torch
mirror / the reference formulas.

Random routings with -1 slots (and one with every slot -1 on half the tokens), T 1..4096,
k 1..8, H 64..7168: dy rows bitwise equal to bf16(fp32(dy) * topk_w) on rows < offsets[E];
d topk_w within 1e-5 of the fp64 sum (relative to sum |dy * r|), exactly 0 on -1 slots;
5 repeats bitwise. Timed: T 4096, k 8, H 7168, kernel vs the torch ops it replaced. The same for
``slot_dtopk_w`` (d topk_w from [T*k, H] slot rows, the EP > 1 unfused backward's): within 1e-5
of the fp64 sum, 0 on -1 slots (their rows NaN), 5 repeats bitwise, timed vs the torch sum.
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded


def _problem(t, k, e, h, drop, dev, gen):
    idx = torch.randint(0, e, (t, k), generator=gen)
    idx[torch.rand(t, k, generator=gen) < drop] = -1
    w = torch.rand(t, k, generator=gen)
    dy = (torch.randn(t, h, generator=gen) * 2.0 ** torch.randint(-4, 4, (t, 1), generator=gen)).bfloat16()
    r = torch.randn(t * k, h, generator=gen).bfloat16()
    return [v.to(dev) for v in (idx, w, dy, r)]


def _check(rg, route_sort, name, t, k, e, h, drop, dev, gen):
    idx, w, dy, r = _problem(t, k, e, h, drop, dev, gen)
    order, offsets, _ = route_sort(idx, e)
    n = int(offsets[-1])
    outs = [rg.dy_rows_and_dtopk_w(dy, r, order, w, offsets) for _ in range(5)]
    same = all(torch.equal(o[0][:n], outs[0][0][:n]) and torch.equal(o[1], outs[0][1]) for o in outs[1:])
    # the x rows in the same pass, and the forward rows in route order: the same dy rows and d topk_w
    x = torch.randn_like(dy)
    r_route = torch.empty_like(r)
    r_route[order] = r
    for rows_x, dtw_x, x_rows in (rg.dy_x_rows_and_dtopk_w(dy, x, r, order, w, offsets),
                                  rg.dy_x_rows_and_dtopk_w(dy, x, r_route, order, w, offsets, rows_by_route=True)):
        same = same and torch.equal(rows_x[:n], outs[0][0][:n]) and torch.equal(dtw_x, outs[0][1])
        same = same and torch.equal(x_rows[:n], x.index_select(0, order[:n] // k))
    rows, dtw = outs[0]
    want_rows, _ = rg.dy_rows_and_dtopk_w_torch(dy, r, order, w, offsets)
    rows_bad = int((rows[:n].view(torch.int16) != want_rows[:n].view(torch.int16)).sum())
    slots = torch.zeros(t * k, h, dtype=torch.float64, device=dev)
    slots[order[:n]] = r[:n].double()
    terms = dy.double()[:, None] * slots.view(t, k, h)
    want = terms.sum(-1)
    err = ((dtw.double() - want).abs() / terms.abs().sum(-1).clamp_min(1e-30)).max().item()
    zeros_ok = bool(torch.all(dtw[idx < 0] == 0))
    ok = rows_bad == 0 and err <= 1e-5 and zeros_ok and same and bool(torch.isfinite(dtw).all())
    return Row(f"route_grad {name}", max_err=err, bitwise=same, ok=ok,
               note=f"T{t} k{k} E{e} H{h}: dy rows mismatches {rows_bad}, -1 slots zero {zeros_ok}; repeats, x rows "
                    f"(== index_select) and rows by route bitwise: {same}")


def _check_slots(rg, name, t, k, e, h, drop, dev, gen):
    idx, _, dy, r = _problem(t, k, e, h, drop, dev, gen)
    r[idx.reshape(-1) < 0] = float("nan")  # rows of -1 slots are never read
    outs = [rg.slot_dtopk_w(dy, r, idx) for _ in range(5)]
    same = all(torch.equal(o, outs[0]) for o in outs[1:])
    terms = torch.where((idx >= 0)[..., None], dy.double()[:, None] * r.view(t, k, h).double(), 0.0)
    err = ((outs[0].double() - terms.sum(-1)).abs() / terms.abs().sum(-1).clamp_min(1e-30)).max().item()
    zeros_ok = bool(torch.all(outs[0][idx < 0] == 0))
    return Row(f"slot_dtopk_w {name}", max_err=err, bitwise=same, ok=err <= 1e-5 and zeros_ok and same,
               note=f"T{t} k{k} H{h}: -1 slots zero {zeros_ok}")


def run(ctx) -> list[Row]:
    from mok_cute.layers.grouped import route_sort  # noqa: PLC0415
    from mok_cute.kernels import route_grad as rg  # noqa: PLC0415

    dev, gen = ctx.device, seeded(77)
    rows = [_check(rg, route_sort, n, *a, dev, gen) for n, a in [
        ("small", (37, 4, 6, 64, 0.2)), ("T=1", (1, 1, 2, 128, 0.0)), ("half dropped", (300, 8, 16, 512, 0.5)),
        ("large", (4096, 8, 64, 7168, 0.05))]]
    idx, w, dy, r = _problem(4096, 8, 64, 7168, 0.05, dev, gen)
    order, offsets, _ = route_sort(idx, 64)
    t_k = bench_us(lambda: rg.dy_rows_and_dtopk_w(dy, r, order, w, offsets))
    t_t = bench_us(lambda: rg.dy_rows_and_dtopk_w_torch(dy, r, order, w, offsets))
    gbytes = (2 * r.numel() * 2 + r.numel() * 2) / 1e9  # read dy rows + r, write dy rows
    rows.append(Row("route_grad speed T4096 k8 H7168", time_us=t_k,
                    note=f"{gbytes / t_k * 1e6:.0f} GB/s; torch ops {t_t:.0f} us (x{t_t / t_k:.1f})"))
    x = torch.randn_like(dy)
    t_x = bench_us(lambda: rg.dy_x_rows_and_dtopk_w(dy, x, r, order, w, offsets))
    t_sel = bench_us(lambda: x.index_select(0, order // 8))
    rows.append(Row("route_grad + x rows speed T4096 k8 H7168", time_us=t_x,
                    note=f"{(gbytes + r.numel() * 4 / 1e9) / t_x * 1e6:.0f} GB/s of rows; dy pass + index_select "
                         f"{t_k + t_sel:.0f} us (x{(t_k + t_sel) / t_x:.2f})"))
    rows += [_check_slots(rg, n, *a, dev, gen) for n, a in [("small", (37, 4, 6, 64, 0.2)),
                                                           ("large", (4096, 8, 64, 7168, 0.05))]]
    idx, _, dy, r = _problem(4096, 8, 64, 7168, 0.05, dev, gen)
    t_k = bench_us(lambda: rg.slot_dtopk_w(dy, r, idx))
    t_t = bench_us(lambda: (dy.float()[:, None, :] * r.view(4096, 8, -1).float()).sum(-1))
    rows.append(Row("slot_dtopk_w speed T4096 k8 H7168", time_us=t_k,
                    note=f"{r.numel() * 2 / t_k / 1e3:.0f} GB/s of slot rows; torch sum {t_t:.0f} us (x{t_t / t_k:.1f})"))
    return rows

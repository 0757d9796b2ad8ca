"""Device check: the per-expert row sums (mok_cute.kernels.row_sums.expert_row_sums, the expert bias gradient).

Random bf16 rows (per-row scales 2^-4..2^3) and random expert sizes with empty experts (the first and last among
them), rows before offsets[0] and past offsets[E] belonging to none: a small case, one chunk of columns (N 8), a
column tail (N 1032), one expert holding every row (the unrolled loop and its tail), M = 0, and the two halves
``dgu[:, :I]`` / ``dgu[:, I:]`` of a [M, 2I] tensor read in place (gpt-oss I 2880, 32 768 rows, 64 experts).
Each: bitwise equal to :func:`fp32_mirror` (the kernel's fp32 adds in its order, in torch ops: 8 interleaved row
stripes per expert, each in row order, then added in stripe order), empty experts exactly 0, within one bf16 ulp of
the reference (``|out - reference.grouped_row_sums| <= 2^-7 * sum|rows|`` per column: the reference sums in fp64,
each side rounds to bf16 once), a second run and the ``out=`` form bitwise equal. One CUDA graph captures a call
and is replayed after the offsets change in place (no host read of them). Timed: the gpt-oss half slice, vs a
torch fp32 ``index_add_``.
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded

TOL = 2.0 ** -7  # one bf16 ulp relative to sum |rows|
STRIPES = 8  # the kernel's row stripes per expert (mok_cute.kernels.row_sums._WARPS)


def fp32_mirror(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The kernel's sums in torch ops: for each expert (rows from ``lo = offsets[e]``) and stripe ``w`` < 8,
    ``s_w = s_w + fp32(rows[lo + w + 8 i])`` for i ascending from fp32 0, then ``((s_0 + s_1) + s_2) + ... + s_7``
    and one rounding to bf16 (adding 0.0 for a stripe already done leaves its sum as it is: a sum that starts at
    +0.0 is never -0.0). [E, N] bf16."""
    offs = offsets.tolist()
    e, n = len(offs) - 1, rows.shape[1]
    lo = torch.tensor(offs[:-1], device=rows.device, dtype=torch.long)
    cnt = torch.tensor(offs[1:], device=rows.device, dtype=torch.long) - lo
    w = torch.arange(STRIPES, device=rows.device)
    part = torch.zeros(e, STRIPES, n, dtype=torch.float32, device=rows.device)
    rounds = (int(cnt.max()) + STRIPES - 1) // STRIPES if e else 0
    for i in range(rounds):
        k = i * STRIPES + w[None, :]  # [E, 8]: the rows' ranks in their experts
        live = (k < cnt[:, None])[..., None]
        idx = (lo[:, None] + k).clamp(0, max(rows.shape[0] - 1, 0))
        part = part + torch.where(live, rows[idx].float(), 0.0)
    acc = part[:, 0]
    for s in range(1, STRIPES):
        acc = acc + part[:, s]
    return acc.bfloat16()


def _offsets(m, e, gen, empty=0.3, before=0, after=0):
    """Random int32 offsets [E+1] covering rows ``before .. m - after``, about ``empty`` of the experts (and the
    first and last) without rows."""
    w = torch.rand(e, generator=gen)
    w[torch.rand(e, generator=gen) < empty] = 0
    w[0] = w[-1] = 0
    if w.sum() == 0:
        w[e // 2] = 1
    cuts = (w.cumsum(0) / w.sum() * (m - before - after)).round().long()
    return torch.cat([torch.zeros(1, dtype=torch.long), cuts]).add(before).int()


def _rows(m, n, gen):
    return (torch.randn(m, n, generator=gen) * 2.0 ** torch.randint(-4, 4, (m, 1), generator=gen)).bfloat16()


def _check(rs, ref, name, rows, offsets):
    """One row: bitwise vs the fp32 mirror, repeats and ``out=``; empty experts 0; the tolerance vs the reference."""
    got = rs.expert_row_sums(rows, offsets)
    again = rs.expert_row_sums(rows, offsets)
    into = torch.full_like(got, float("nan"))
    same = torch.equal(got, again) and rs.expert_row_sums(rows, offsets, out=into) is into and torch.equal(into, got)
    mirror_bad = int((got.view(torch.int16) != fp32_mirror(rows, offsets).view(torch.int16)).sum())
    want = ref.grouped_row_sums(rows, offsets)
    offs = offsets.tolist()
    scale = torch.stack([rows[lo:hi].double().abs().sum(0) for lo, hi in zip(offs[:-1], offs[1:])]) \
        if len(offs) > 1 else torch.zeros(0, rows.shape[1], dtype=torch.float64, device=rows.device)
    err = ((got.double() - want.double()).abs() / scale.clamp_min(1e-30)).max().item() if got.numel() else 0.0
    empty = [i for i, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])) if hi <= lo]
    zeros_ok = all(bool(torch.all(got[i].view(torch.int16) == 0)) for i in empty)
    ok = mirror_bad == 0 and same and zeros_ok and err <= TOL
    return Row(f"row_sums {name}", max_err=err, bitwise=same, ok=ok,
               note=f"M{rows.shape[0]} N{rows.shape[1]} E{len(offs) - 1} ({len(empty)} empty, +0 {zeros_ok}), "
                    f"mirror mismatches {mirror_bad}, tol {TOL:.3g}")


def _graph_row(rs, rows, offsets, gen):
    """A captured call replayed after the offsets change in place equals a fresh call with the new offsets."""
    out = rs.expert_row_sums(rows, offsets)  # warm: compiled and loaded outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rs.expert_row_sums(rows, offsets, out=out)
    new = _offsets(rows.shape[0], offsets.numel() - 1, gen).to(offsets.device)
    offsets.copy_(new)
    g.replay()
    torch.cuda.synchronize()
    ok = torch.equal(out, rs.expert_row_sums(rows, new))
    return Row("row_sums CUDA graph, offsets changed", bitwise=ok, ok=ok, note="replay == fresh call")


def run(ctx) -> list[Row]:
    from mok_cute import reference as ref  # noqa: PLC0415
    from mok_cute.kernels import row_sums as rs  # noqa: PLC0415

    dev, gen = ctx.device, seeded(91)
    out = []
    for name, m, n, e, before, after in [("small", 37, 64, 6, 0, 0), ("N8", 300, 8, 16, 0, 0),
                                         ("tail N1032", 999, 1032, 8, 3, 7), ("M0", 0, 64, 4, 0, 0)]:
        out.append(_check(rs, ref, name, _rows(m, n, gen).to(dev), _offsets(m, e, gen, 0.3, before, after).to(dev)))
    one = torch.tensor([0, 0, 5003, 5003], dtype=torch.int32, device=dev)
    out.append(_check(rs, ref, "one expert", _rows(5003, 136, gen).to(dev), one))
    m, inter, e = 32768, 2880, 64
    dgu = _rows(m, 2 * inter, gen).to(dev)
    offsets = _offsets(m, e, gen, 0.1).to(dev)
    for half, rows in (("dgu[:, :I]", dgu[:, :inter]), ("dgu[:, I:]", dgu[:, inter:])):
        out.append(_check(rs, ref, f"slice {half} I{inter}", rows, offsets))
    out.append(_graph_row(rs, dgu[:, inter:], offsets.clone(), gen))
    rows = dgu[:, inter:]
    t_k = bench_us(lambda: rs.expert_row_sums(rows, offsets))
    expert_of = torch.repeat_interleave(torch.arange(e, device=dev), (offsets[1:] - offsets[:-1]).long())
    n_rows = int(offsets[-1])
    t_t = bench_us(lambda: torch.zeros(e, inter, device=dev).index_add_(0, expert_of, rows[:n_rows].float()))
    gbytes = n_rows * inter * 2 / 1e9
    out.append(Row(f"row_sums speed M{m} I{inter} E{e} (slice)", time_us=t_k,
                   note=f"{gbytes / t_k * 1e6:.0f} GB/s of rows; torch fp32 index_add_ {t_t:.0f} us "
                        f"(x{t_t / t_k:.1f})"))
    return out

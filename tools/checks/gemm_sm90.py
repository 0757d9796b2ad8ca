"""Device check: SM90 grouped expert GEMMs vs mok_cute.reference (functions of the same names).

Forward: plain, GEMM1+SwiGLU. Backward (mok_cute.kernels.sm90.expert_bwd): GEMM2 dgrad with
fused dSwiGLU, GEMM1 dgrad (B split along K), grouped wgrad (K = tokens, ragged TMA;
column-slice operands as used for dWg / dWu).
Per kernel and routing (uniform / skewed: one expert with most rows, empty experts, counts
not multiples of the 128-row / 64-token tiles): fresh random inputs (weights randn *
fan_in^-0.5), outputs poisoned with NaN before the launch (catches unwritten rows), max-abs
and rel-L1 against the reference computed on the GPU (tolerance: rel-L1 <= 1e-2, finite),
and bitwise equality over 5 repeats. Wgrad also checks exact zeros for empty experts and
that an expert's K tail never reads the next expert's rows (a NaN planted in the first row
of one expert must not reach any other expert). Then one big shape (8 experts x 4096
rows, H=7168, I=2048) is timed per kernel (TFLOP/s in the note) and the compile cache is
checked to grow only per kernel variant, never per token count.
Outputs are heads of larger buffers whose tails hold a sentinel that must survive (no write
past the last row: plain, swiglu, dgrad1 and wgrad store through TMA, row-bounded per expert). A tile_n=128
config gets a plain row too (tagged ``[tile_n=128]``).
GEMM1 + SwiGLU with h made by the helper warps (K >= HELPERS_MIN_K) bitwise the MMA warps' h (the mx_h launch
at the same K, which has no helpers). GEMM1 + SwiGLU with h's MXFP8 copy (``mx_h``): gu, h bitwise equal to
the plain kernel's and hq, hs bitwise equal to ``reference.mxfp8_quantize(h, -1)``.
"""
from __future__ import annotations

import torch

from tools.checks.common import Row, bench_us, seeded, sm90_skip

REL_L1_TOL = 1e-2
REPEATS = 5
E, H, INTER = 8, 1024, 512  # correctness shape (GEMM1: K=H, N=2I; GEMM2: K=I, N=H)


def _counts(routing: str, total: int, gen: torch.Generator) -> list[int]:
    if routing == "uniform":
        w = torch.ones(E)
    else:  # one hot expert, two empty ones, a few tiny
        w = torch.tensor([40.0, 0.0, 0.3, 0.0, 0.05, 1.0, 0.02, 0.6])
    probs = w / w.sum()
    counts = torch.multinomial(probs, total, replacement=True, generator=gen).bincount(minlength=E)
    return counts.tolist()


def _offsets(counts, device, dtype=torch.int32):
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return torch.tensor(offs, dtype=dtype, device=device)


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, bool]:
    o, r = out.float(), ref.float()
    finite = bool(torch.isfinite(o).all())
    diff = (o - r).abs()
    rel = float(diff.sum() / r.abs().sum().clamp_min(1e-30))
    return float(diff.max()) if diff.numel() else 0.0, rel, finite


def _nanmax(a: float, b: float) -> float:
    """max that keeps NaN (Python's max(x, nan) silently drops it)."""
    return float("nan") if a != a or b != b else max(a, b)


def _span(idx: torch.Tensor) -> str:
    if idx.numel() == 0:
        return "-"
    idx = idx.unique()
    return f"{int(idx.min())}..{int(idx.max())} ({idx.numel()})"


def nonfinite_where(name: str, t: torch.Tensor) -> str:
    """Where a 2-D output is not finite: count, row span, column span (column blocks of 128)."""
    bad = ~torch.isfinite(t.float())
    n = int(bad.sum())
    if n == 0:
        return ""
    rows, cols = bad.nonzero(as_tuple=True)
    blocks = (cols // 128).unique().tolist()
    return f"{name}: {n} nonfinite rows {_span(rows)} cols {_span(cols)} col-blocks/128 {blocks[:12]}"


def _row(name, outs, refs, repeats_equal, note="", names=None):
    worst_abs, worst_rel, all_finite = 0.0, 0.0, True
    where = []
    for i, (o, r) in enumerate(zip(outs, refs)):
        a, rel, fin = _errors(o, r)
        worst_abs, worst_rel, all_finite = _nanmax(worst_abs, a), _nanmax(worst_rel, rel), all_finite and fin
        if not fin and o.dim() == 2:
            where.append(nonfinite_where(names[i] if names else f"out{i}", o))
    ok = all_finite and worst_rel <= REL_L1_TOL and repeats_equal
    note = f"relL1={worst_rel:.2e} finite={all_finite} {note} {'; '.join(where)}".strip()
    return Row(name, max_err=worst_abs, bitwise=repeats_equal, ok=ok, note=note)


def _poisoned(*shapes, device):
    return [torch.full(s, float("nan"), dtype=torch.bfloat16, device=device) for s in shapes]


SENTINEL = 12352.0  # exact in bf16


def _guarded_out(shape, device, pad=128):
    """A NaN-poisoned output that is the head of a larger buffer whose tail (``pad`` more
    entries of dim 0 past the end) holds SENTINEL: returns (out, tail); the tail must survive
    any launch (a TMA store whose row bound failed would write past the last expert's rows)."""
    big = torch.full((shape[0] + pad, *shape[1:]), SENTINEL, dtype=torch.bfloat16, device=device)
    out = big[:shape[0]]
    out.fill_(float("nan"))
    return out, big[shape[0]:]


def _tail_ok(tails) -> bool:
    return all(bool((t == SENTINEL).all()) for t in tails)


def _tag(cfg) -> str:
    return "" if cfg is None else f" [tile_n={cfg.tile_n}]"


def _kw(cfg) -> dict:
    return {} if cfg is None else {"cfg": cfg}


def _check_plain(gg, ref, dev, gen, routing, offs_dtype, cfg=None):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev, offs_dtype)
    a = torch.randn(m, INTER, device=dev).bfloat16()
    w = (torch.randn(E, H, INTER, device=dev) * INTER ** -0.5).bfloat16()
    want = ref.grouped_gemm(a, offs, w)
    outs, tails = [], []
    for _ in range(REPEATS):
        out, tail = _guarded_out((m, H), dev)
        tails.append(tail)
        outs.append(gg.grouped_gemm(a, offs, w, out=out, **_kw(cfg)))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    tail_ok = _tail_ok(tails)
    row = _row(f"plain {routing} {offs_dtype}{_tag(cfg)}".replace("torch.", ""), [outs[0]], [want], same,
               f"M={m} counts={counts} rows_past_M_untouched={tail_ok}")
    row.ok = row.ok and tail_ok
    return row


def _swiglu_problem(dev, gen, routing, hid: int = H):
    """GEMM1 + SwiGLU operands ``(M, offsets, x [M, hid], w_gate, w_up [E, I, hid])``: 3000 rows over ``routing``'s
    expert counts, weights randn * hid^-0.5."""
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    x = torch.randn(m, hid, device=dev).bfloat16()
    wg = (torch.randn(E, INTER, hid, device=dev) * hid ** -0.5).bfloat16()
    wu = (torch.randn(E, INTER, hid, device=dev) * hid ** -0.5).bfloat16()
    return m, _offsets(counts, dev), x, wg, wu


def _check_swiglu(gg, ref, dev, gen, routing, limit, cfg=None):
    m, offs, x, wg, wu = _swiglu_problem(dev, gen, routing)
    gu_ref, h_ref = ref.grouped_gemm1_swiglu(x, offs, wg, wu, limit=limit)
    results, tails = [], []
    for _ in range(REPEATS):
        (gu_o, gu_t), (h_o, h_t) = _guarded_out((m, 2 * INTER), dev), _guarded_out((m, INTER), dev)
        tails += [gu_t, h_t]
        results.append(gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=limit, out=(gu_o, h_o), **_kw(cfg)))
    torch.cuda.synchronize()
    tail_ok = _tail_ok(tails)
    same = all(torch.equal(results[0][0], gu) and torch.equal(results[0][1], h) for gu, h in results[1:])
    gu, h = results[0]
    # h from the kernel's own gu isolates the epilogue math from GEMM rounding differences
    h_own = ref.swiglu(gu[:, :INTER].float(), gu[:, INTER:].float(), limit).bfloat16()
    _, rel_own, _ = _errors(h, h_own)
    rels = [f"{n} relL1={_errors(o, r)[1]:.1e}" for n, o, r in (("gu", gu, gu_ref), ("h", h, h_ref))]
    row = _row(f"swiglu {routing} L={limit}{_tag(cfg)}", [gu, h], [gu_ref, h_ref], same,
               f"{' '.join(rels)} h-vs-own-gu relL1={rel_own:.1e} M={m} rows_past_M_untouched={tail_ok}",
               names=["gu", "h"])
    row.ok = row.ok and tail_ok
    return row


def _check_swiglu_mx(gg, ref, dev, gen, routing, limit):
    """GEMM1 + SwiGLU with h's MXFP8 copy (mx_h): gu, h bitwise equal to the plain swiglu
    kernel's; hq, hs bitwise equal to reference.mxfp8_quantize(h, -1) on the expert rows;
    5 repeats bitwise."""
    m, offs, x, wg, wu = _swiglu_problem(dev, gen, routing)
    x[: m // 3] *= 2.0 ** 40  # rows far from 1 both ways (extreme MX scale bytes)
    x[m // 3: m // 2] *= 2.0 ** -50
    gu0, h0 = gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=limit)
    runs = [gg._run_gemm1_swiglu(x, offs, wg, wu, limit, mx_h=True) for _ in range(REPEATS)]
    torch.cuda.synchronize()
    gu, h, hq, hs = runs[0]
    same = all(all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(runs[0], r)) for r in runs[1:])
    wq, ws = ref.mxfp8_quantize(h, -1)
    bad_q = int((hq.view(torch.uint8) != wq.view(torch.uint8)).sum())
    bad_s = int((hs != ws).sum())
    base_eq = torch.equal(gu, gu0) and torch.equal(h, h0)
    ok = same and base_eq and bad_q == 0 and bad_s == 0
    return Row(f"swiglu mx_h {routing} L={limit}", bitwise=same, ok=ok,
               note=f"gu,h == swiglu kernel {base_eq}; hq mismatches {bad_q}, hs mismatches {bad_s} "
                    f"(vs reference.mxfp8_quantize) M={m}")


def _check_swiglu_helpers(gg, dev, gen, routing, limit):
    """GEMM1 + SwiGLU with h made by the helper warps (K = ``HELPERS_MIN_K``: the helpers run from there)
    against the MMA warps' h at the same K (the launch with h's MXFP8 copy, which runs without helpers):
    gu and h bitwise equal, 5 repeats bitwise."""
    m, offs, x, wg, wu = _swiglu_problem(dev, gen, routing, gg.HELPERS_MIN_K)
    assert gg.swiglu_helpers("swiglu", False, x.shape[1]) and not gg.swiglu_helpers("swiglu", True, x.shape[1])
    runs = {True: [gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=limit) for _ in range(REPEATS)],
            False: [gg._run_gemm1_swiglu(x, offs, wg, wu, limit, mx_h=True)[:2]]}
    torch.cuda.synchronize()
    same = all(torch.equal(runs[True][0][i], r[i]) for r in runs[True][1:] for i in range(2))
    equal = [torch.equal(runs[True][0][i], runs[False][0][i]) for i in range(2)]
    return Row(f"swiglu helpers {routing} L={limit}", bitwise=same, ok=same and all(equal),
               note=f"gu, h == the MMA warps' h: {equal} M={m}")


def _check_dswiglu_dgrad(bwd, ref, dev, gen, routing, limit):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    dy = (torch.randn(m, H, device=dev) * 0.1).bfloat16()
    wd = (torch.randn(E, H, INTER, device=dev) * H ** -0.5).bfloat16()
    gu = (torch.randn(m, 2 * INTER, device=dev) * 3).bfloat16()  # |.| > 4 often: clamps engage
    want = ref.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=limit)
    outs = []
    for _ in range(REPEATS):
        (out,) = _poisoned((m, 2 * INTER), device=dev)
        outs.append(bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=limit, out=out))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    return _row(f"dswiglu dgrad {routing} L={limit}", [outs[0]], [want], same, f"M={m}")


def _check_dgrad1(bwd, ref, dev, gen, routing, cfg=None):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    dgu = (torch.randn(m, 2 * INTER, device=dev) * 0.1).bfloat16()
    w_gu = (torch.randn(E, 2 * INTER, H, device=dev) * (2 * INTER) ** -0.5).bfloat16()
    wg, wu = w_gu[:, :INTER], w_gu[:, INTER:]  # two halves of one stacked tensor
    wg2, wu2 = wg.contiguous(), wu.contiguous()  # and two separate tensors
    want = ref.grouped_dgrad1(dgu, offs, wg2, wu2)
    outs, tails = [], []
    for i in range(REPEATS):
        out, tail = _guarded_out((m, H), dev)
        tails.append(tail)
        outs.append(bwd.grouped_dgrad1(dgu, offs, *((wg, wu) if i % 2 else (wg2, wu2)), out=out, **_kw(cfg)))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    tail_ok = _tail_ok(tails)
    row = _row(f"dgrad1 {routing}{_tag(cfg)}", [outs[0]], [want], same,
               f"M={m} (stacked and separate weights) rows_past_M_untouched={tail_ok}")
    row.ok = row.ok and tail_ok
    return row


def _check_wgrad(bwd, ref, dev, gen, routing, sliced, cfg=None, na=None):
    counts = _counts(routing, 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    if na is not None:  # Na not a multiple of tile_m: the last m-tile of each expert is partial
        a, b, name = torch.randn(m, na, device=dev).bfloat16(), torch.randn(m, INTER, device=dev).bfloat16(), \
            f"wgrad Na={na}"
    elif sliced:  # dWg = wgrad(dgu[:, :I], x): A is a column slice with row stride 2I
        dgu = torch.randn(m, 2 * INTER, device=dev).bfloat16()
        a, b, name = dgu[:, :INTER], torch.randn(m, H, device=dev).bfloat16(), "wgrad dWg-like (slice)"
    else:  # dWd = wgrad(dy, h)
        a, b, name = torch.randn(m, H, device=dev).bfloat16(), torch.randn(m, INTER, device=dev).bfloat16(), \
            "wgrad dWd-like"
    want = ref.grouped_wgrad(a, b, offs)
    outs, tails = [], []
    for _ in range(REPEATS):
        out, tail = _guarded_out((E, a.shape[1], b.shape[1]), dev, pad=1)
        tails.append(tail)
        outs.append(bwd.grouped_wgrad(a, b, offs, out=out, **_kw(cfg)))
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    empty = [e for e, c in enumerate(counts) if c == 0]
    zeros_ok = all(bool((outs[0][e] == 0).all()) for e in empty)
    tail_ok = _tail_ok(tails)
    row = _row(f"{name} {routing}{_tag(cfg)}", [outs[0]], [want], same,
               f"M={m} empty={empty} zeros_ok={zeros_ok} past_end_untouched={tail_ok}")
    row.ok = row.ok and zeros_ok and tail_ok
    return row


def _check_wgrad_isolation(bwd, dev):
    """A NaN in the first row of expert p stays in dW[p]: the K tail of expert p-1 (count
    not a multiple of 64) must be zero-filled, not read from expert p's rows."""
    counts = [100, 37, 0, 300, 1, 65, 250, 5]
    m = sum(counts)
    offs = _offsets(counts, dev)
    a = torch.randn(m, INTER, device=dev).bfloat16()
    b = torch.randn(m, 256, device=dev).bfloat16()
    poisoned = [1, 3, 5, 6]  # each follows an expert whose count is not a multiple of 64 (or 0)
    for p in poisoned:
        a[sum(counts[:p])] = float("nan")
    out = bwd.grouped_wgrad(a, b, offs)
    torch.cuda.synchronize()
    clean = [e for e in range(E) if e not in poisoned]
    ok = all(bool(torch.isfinite(out[e]).all()) for e in clean) and all(bool(out[p].isnan().any()) for p in poisoned)
    return Row("wgrad K tail isolation (NaN rows)", ok=ok, note=f"counts={counts} NaN row in experts {poisoned}")


def _guarded(name, fn, *args):
    """Run one check; a crash becomes a failed row so the other checks still report."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return Row(f"{name}: crashed", ok=False, note=f"{type(exc).__name__}: {exc}"[:160])


def _check_zero_rows(gg, bwd, dev):
    offs = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    a = torch.zeros(0, INTER, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(E, H, INTER, dtype=torch.bfloat16, device=dev)
    out = gg.grouped_gemm(a, offs, w)
    gu, h = gg.grouped_gemm1_swiglu(torch.zeros(0, H, dtype=torch.bfloat16, device=dev), offs,
                                    w.new_zeros(E, INTER, H), w.new_zeros(E, INTER, H))
    dy = torch.zeros(0, H, dtype=torch.bfloat16, device=dev)
    dgu = bwd.grouped_dswiglu_dgrad(dy, offs, w, gu, limit=4.0)
    dx = bwd.grouped_dgrad1(dgu, offs, w.new_zeros(E, INTER, H), w.new_zeros(E, INTER, H))
    dw = bwd.grouped_wgrad(dy, a, offs, out=torch.full((E, H, INTER), float("nan"), dtype=torch.bfloat16,
                                                         device=dev))
    ok = (out.shape == (0, H) and gu.shape == (0, 2 * INTER) and h.shape == (0, INTER)
          and dgu.shape == (0, 2 * INTER) and dx.shape == (0, H) and bool((dw == 0).all()))
    return Row("zero total rows (fwd + bwd)", ok=ok)


def _check_launch_paths(gg, bwd, dev, gen):
    """Graph replays (sm90_launch) vs the DSL call path: each kernel writes a NaN-poisoned
    preallocated output through the DSL path, then three times through the graph path
    (capture, replay, replay; the output refilled with NaN before each): all bitwise equal."""
    from mok_cute.dsl import launch as sm90_launch  # noqa: PLC0415

    counts = _counts("skewed", 3000, gen)
    m = sum(counts)
    offs = _offsets(counts, dev)
    x = torch.randn(m, H, device=dev).bfloat16()
    wg, wu = ((torch.randn(E, INTER, H, device=dev) * H ** -0.5).bfloat16() for _ in range(2))
    wd = (torch.randn(E, H, INTER, device=dev) * INTER ** -0.5).bfloat16()
    gu, h = gg.grouped_gemm1_swiglu(x, offs, wg, wu)
    dy = torch.randn(m, H, device=dev).bfloat16()
    dgu = bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=4.0)
    h2 = torch.empty_like(h)
    cases = [
        ("swiglu", (m, 2 * INTER), lambda o: gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=4.0, out=(o, h2))),
        ("plain", (m, H), lambda o: gg.grouped_gemm(h, offs, wd, out=o)),
        ("dswiglu", (m, 2 * INTER), lambda o: bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=4.0, out=o)),
        ("dgrad1", (m, H), lambda o: bwd.grouped_dgrad1(dgu, offs, wg, wu, out=o)),
        ("wgrad", (E, INTER, H), lambda o: bwd.grouped_wgrad(dgu[:, :INTER], x, offs, out=o)),
    ]
    bad = []
    before = sm90_launch.stats()
    was = sm90_launch._enabled
    for name, shape, fn in cases:
        out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=dev)
        sm90_launch._enabled = False
        fn(out)
        torch.cuda.synchronize()
        want = out.clone()
        sm90_launch._enabled = was
        for i in range(3):
            out.fill_(float("nan"))
            fn(out)
            torch.cuda.synchronize()
            if not torch.equal(out, want) or not bool(torch.isfinite(want).all()):
                bad.append(f"{name}#{i}")
    after = sm90_launch.stats()
    delta = {k: after[k] - before[k] for k in after}
    ok = not bad and (not was or delta["graph"] >= 3 * len(cases))
    return Row("launch paths: graph replay == DSL launch", bitwise=not bad, ok=ok,
               note=f"mismatch {bad} paths {delta} graph_path={'on' if was else 'off'}")


def _bench(gg, bwd, dev):
    e, rows, hid, inter = 8, 4096, 7168, 2048
    m = e * rows
    offs = _offsets([rows] * e, dev)
    x = torch.randn(m, hid, device=dev).bfloat16()
    wg = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wu = (torch.randn(e, inter, hid, device=dev) * hid ** -0.5).bfloat16()
    wd = (torch.randn(e, hid, inter, device=dev) * inter ** -0.5).bfloat16()
    w1 = torch.cat([wg, wu], dim=1)  # same FLOPs as GEMM1 through the plain kernel
    h = torch.randn(m, inter, device=dev).bfloat16()
    dy = torch.randn(m, hid, device=dev).bfloat16()
    gu = torch.randn(m, 2 * inter, device=dev).bfloat16()
    dgu = torch.randn(m, 2 * inter, device=dev).bfloat16()
    rows_out = []
    cfg128 = gg.MainloopConfig(tile_n=128)
    flops1 = 2.0 * m * hid * 2 * inter
    flops2 = 2.0 * m * inter * hid
    for name, fn, flops in [
        ("bench gemm1 mainloop (plain, w_gu)", lambda: gg.grouped_gemm(x, offs, w1), flops1),
        ("bench gemm1+swiglu L=4", lambda: gg.grouped_gemm1_swiglu(x, offs, wg, wu, limit=4.0), flops1),
        ("bench gemm1+swiglu+mx_h L=4", lambda: gg._run_gemm1_swiglu(x, offs, wg, wu, 4.0, mx_h=True), flops1),
        ("bench gemm2 plain", lambda: gg.grouped_gemm(h, offs, wd), flops2),
        ("bench dgrad2+dswiglu L=4", lambda: bwd.grouped_dswiglu_dgrad(dy, offs, wd, gu, limit=4.0), flops2),
        ("bench dgrad1 (K=2I, split B)", lambda: bwd.grouped_dgrad1(dgu, offs, wg, wu), flops1),
        ("bench wgrad dWd = wgrad(dy, h)", lambda: bwd.grouped_wgrad(dy, h, offs), flops2),
        ("bench wgrad dWg = wgrad(dgu[:, :I], x)", lambda: bwd.grouped_wgrad(dgu[:, :inter], x, offs), flops2),
        ("variant gemm1 plain tile_n=128", lambda: gg.grouped_gemm(x, offs, w1, cfg=cfg128), flops1),
        ("variant gemm2 plain tile_n=128", lambda: gg.grouped_gemm(h, offs, wd, cfg=cfg128), flops2),
    ]:
        t = bench_us(fn)
        rows_out.append(Row(name, time_us=t, note=f"{flops / t / 1e6:.0f} TFLOP/s ({e}x{rows} rows, H={hid}, I={inter})"))
    return rows_out


def run(ctx) -> list[Row]:
    if skipped := sm90_skip(ctx, "gemm_sm90"):
        return skipped
    from mok_cute import reference as ref  # noqa: PLC0415 (lazy: written in parallel)
    from mok_cute.kernels.sm90 import expert_bwd as bwd  # noqa: PLC0415
    from mok_cute.kernels.sm90 import grouped_gemm as gg  # noqa: PLC0415
    from mok_cute.dsl.compile import cache_stats  # noqa: PLC0415

    dev = ctx.device
    gen = seeded(1234)
    rows = []
    for routing in ("uniform", "skewed"):
        rows.append(_check_plain(gg, ref, dev, gen, routing, torch.int32))
        for limit in (None, 4.0):
            rows.append(_check_swiglu(gg, ref, dev, gen, routing, limit))
    rows.append(_check_plain(gg, ref, dev, gen, "skewed", torch.int64))
    for routing, limit in (("uniform", None), ("skewed", 4.0)):
        rows.append(_guarded("swiglu helpers", _check_swiglu_helpers, gg, dev, gen, routing, limit))
    for routing, limit in (("uniform", None), ("skewed", 4.0)):
        rows.append(_guarded("swiglu mx_h", _check_swiglu_mx, gg, ref, dev, gen, routing, limit))
    for routing in ("uniform", "skewed"):
        for limit in (None, 4.0):
            rows.append(_guarded("dswiglu dgrad", _check_dswiglu_dgrad, bwd, ref, dev, gen, routing, limit))
        rows.append(_guarded("dgrad1", _check_dgrad1, bwd, ref, dev, gen, routing))
        for sliced in (False, True):
            rows.append(_guarded("wgrad", _check_wgrad, bwd, ref, dev, gen, routing, sliced))
    rows.append(_guarded("wgrad isolation", _check_wgrad_isolation, bwd, dev))
    rows.append(_guarded("wgrad Na=200", _check_wgrad, bwd, ref, dev, gen, "skewed", False, None, 200))
    rows.append(_guarded("plain [tile_n=128]", _check_plain, gg, ref, dev, gen, "skewed", torch.int64,
                         gg.MainloopConfig(tile_n=128)))
    compiles = cache_stats()["compiles"]
    rows.append(_check_swiglu(gg, ref, dev, gen, "skewed", 1.5))  # new counts, new limit
    rows.append(_guarded("dswiglu dgrad", _check_dswiglu_dgrad, bwd, ref, dev, gen, "skewed", 1.5))
    rows.append(_guarded("wgrad", _check_wgrad, bwd, ref, dev, gen, "skewed", True))
    rows.append(_check_zero_rows(gg, bwd, dev))
    rows.append(_guarded("launch paths", _check_launch_paths, gg, bwd, dev, gen))
    recompiled = cache_stats()["compiles"] - compiles
    rows.append(Row("no recompile for new counts/limit", ok=recompiled == 0, note=f"{recompiled} new compiles"))
    rows += _bench(gg, bwd, dev)
    return rows

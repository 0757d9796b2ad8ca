"""Device check: the routed backward core in one launch (kernels/sm90/fused_bwd.py) against the
unfused backward's five grouped launches (dgrad2 + dSwiGLU, dgrad1, three wgrads).

* dx rows, dWg, dWu and dWd bitwise equal to the unfused ones, on uniform, skewed (empty
  experts, partial m-tiles) and one-expert routings, with and without the SwiGLU clamp, and with
  gpt-oss's SwiGLU (alpha 1.702, up offset 1; its limit 7, and 1.5 where clamps act);
* bitwise across 3 repeats and across grid sizes (132, 37, 8 CTAs);
* ``tokens=`` (the dx rows scattered to their slots and summed in the launch): dx bitwise the
  unfused scatter + ``reference.slot_sum`` from the shared expert's dx (or zeros), -1 slots
  included; with ``x_tok=`` (x's token rows gathered in the weight gradients' loads) every output
  bitwise the unfused backward on grouped x rows (empty experts, tile_n 128, a small grid);
* the layer: ``mok_cute.moe`` forward + backward with ``MoKConfig(backward_path=...)`` FUSED and
  FUSED_WHOLE (also the route_grad pass and the x gather in the launch, the fused forward's rows)
  gives every gradient bitwise equal to UNFUSED (shared expert included: it runs the core too, as
  one group of all tokens), with the clamped SwiGLU and with gpt-oss's;
* ``main_grads`` on the sm90 backend (unfused and fused backward): two backwards into random
  fp32 buffers give start + fp32(dW_1) + fp32(dW_2) bitwise, the weights no ``.grad``;
* time of the core vs the five launches at 8 experts x 4096 rows, H 7168, I 2048.

``run(ctx, parts=...)`` runs a subset (:data:`PARTS`; e.g. ``("bench",)``: the speed rows alone, or
``("mx",)``: the MXFP8 rows alone); the trace of the bench's core is written to ``out_dir``.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from mok_cute import SwiGLU
from tools.checks.common import Row, bench_us, env_var
from tools.checks.layer_sm90 import _problem, _run

PARTS = ("core", "tokens", "mx", "layer", "bench")  # what run() checks by default: everything
# (name, rows per expert, activation) of the core rows at H 1024, I 512
CORE_CASES = (("uniform", [370, 385, 390, 361, 402, 377, 366, 389], None),
              ("skewed", [2845, 0, 32, 0, 4, 82, 0, 37], 4.0),
              ("one expert", [0, 0, 1000, 0], 1.5),
              ("skewed gpt-oss", [2845, 0, 32, 0, 4, 82, 0, 37], SwiGLU.gpt_oss()),
              ("one expert gpt-oss", [0, 0, 1000, 0], SwiGLU.gpt_oss(limit=1.5)))  # g, u ~ N(0, 1): clamps act
LAYER_ACTS = (("L=4", 4.0), ("gpt-oss", SwiGLU.gpt_oss()))  # the layer rows' activations


def _act_name(act) -> str:
    """A row's name for an activation (None, L or a SwiGLU, its alpha / up offset in the case's name): its limit."""
    return f"L={act.limit if isinstance(act, SwiGLU) else act}"


def _operands(m_counts, h, inter, dev, seed, rows=None):
    """Random backward operands over experts of ``m_counts`` rows (``rows`` >= their sum: the
    buffers' rows, the rest past the last expert as in the layer)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    e = len(m_counts)
    m = sum(m_counts) if rows is None else rows
    rnd = lambda *s, fan=1.0: (torch.randn(*s, device=dev, generator=g) * fan ** -0.5).bfloat16()
    offsets = torch.tensor([0] + list(torch.tensor(m_counts).cumsum(0)), dtype=torch.int32, device=dev)
    return (rnd(m, h), rnd(m, h), rnd(m, 2 * inter), rnd(m, inter), offsets, rnd(e, inter, h, fan=h),
            rnd(e, inter, h, fan=h), rnd(e, h, inter, fan=inter))


def _core(ops, limit, tokens=None, consume: bool = False, **launch):
    """``fused_backward_core`` on ``_operands``' tuple (its rows, then its weights); ``launch``: the
    ``BackwardLaunch`` fields (num_ctas, trace, mx)."""
    from mok_cute.kernels.sm90.fused_bwd import BackwardLaunch, ExpertRows, fused_backward_core

    return fused_backward_core(ExpertRows(*ops[:5]), ops[5:], limit, BackwardLaunch(**launch), tokens=tokens,
                               consume=consume)


def _unfused(dy, x, gu, h, offsets, wg, wu, wd, limit):
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.layers.common import ExpertGroup, mlp_backward

    g = ExpertGroup(x, offsets, gu, h, "bf16")
    return mlp_backward(bwd._run_dswiglu_dgrad, bwd._run_dgrad1, bwd._run_wgrad, g, dy, wg, wu, wd, limit)


def run(ctx, parts: tuple[str, ...] = PARTS, out_dir: str | None = None) -> list[Row]:
    """The rows of ``parts`` (:data:`PARTS`); the bench's trace goes to ``out_dir`` (default: the temp dir)."""
    from tools.checks.common import sm90_skip

    skip = sm90_skip(ctx, "fused_bwd")
    if skip:
        return skip
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    dev = ctx.device
    rows = _core_rows(dev) if "core" in parts else []
    if "tokens" in parts:
        rows += _tokens_rows(dev) + _x_gather_rows(dev)
    if "mx" in parts:
        rows += _mx_rows(dev)
    if "layer" in parts:
        rows += _layer_rows(dev)
    if "bench" in parts:
        rows += _bench_rows(dev, Path(out_dir or tempfile.gettempdir()))
    return rows


def _core_rows(dev) -> list[Row]:
    """The core vs the unfused launches on uniform, skewed and one-expert routings, over grid sizes."""
    rows = []
    names = ("dx", "dWg", "dWu", "dWd")
    for name, counts, limit in CORE_CASES:
        ops = _operands(counts, 1024, 512, dev, seed=len(name))
        want = _unfused(*ops, limit)
        runs = [_core(ops, limit, num_ctas=n) for n in (132, 132, 132, 37, 8)]
        torch.cuda.synchronize()
        eq = [all(torch.equal(a, b) for a, b in zip(r, want)) for r in runs]
        diff = [n for n, a, b in zip(names, runs[0], want) if not torch.equal(a, b)]
        finite = all(bool(torch.isfinite(a.float()).all()) for a in runs[0])
        rows.append(Row(f"fused bwd core {name} {_act_name(limit)}", bitwise=all(eq), ok=all(eq) and finite,
                        note=f"== unfused per run (132 x3, 37, 8 CTAs): {eq}; differs: {diff} M={sum(counts)}"))
    return rows


def _layer_rows(dev) -> list[Row]:
    """The layer's gradients per backward path vs UNFUSED (per activation of :data:`LAYER_ACTS`), its launch
    count, its main_grads."""
    rows = []
    x, idx, w, ws, sh, dy = _problem(600, 1024, 512, 8, 4, True, True, dev, seed=71)
    for tag, act in LAYER_ACTS:
        outs = {path: _run("sm90", x, idx, w, ws, sh, dy, act, backward_path=path)
                for path in ("unfused", "fused", "fused_whole")}
        for path in ("fused", "fused_whole"):
            same = [torch.equal(a, b) for a, b in zip(outs["unfused"], outs[path])]
            suffix = "" if tag == "L=4" else f" {tag}"  # (the clamped rows keep their names)
            rows.append(Row(f"layer grads backward_path={path} == unfused (skew + shared){suffix}", bitwise=all(same),
                            ok=all(same), note=f"[y, dx, dtw, dWg, dWu, dWd, dWs...] equal: {same}"))
    rows.append(_launch_count_row(x, idx, w, ws, sh, dy))
    return rows + _main_grads_rows(x, idx, w, ws, sh, dy)


def _bench_rows(dev, out_dir: Path) -> list[Row]:
    """The fused core vs the unfused launches at 8 x 4096 rows, H 7168, I 2048, then its trace (written
    into ``out_dir``)."""
    rows = []
    ops = _operands([4096] * 8, 7168, 2048, dev, seed=5)
    from mok_cute.dsl import launch

    t_unf = bench_us(lambda: _unfused(*ops, 4.0))
    _core(ops, 4.0)
    before = dict(launch._stats)
    t_fus = bench_us(lambda: _core(ops, 4.0))
    captures = launch._stats["capture"] - before["capture"]  # a graph captured per call would cost ~1 ms of host
    torch.cuda.synchronize()
    flop = 2 * 8 * 4096 * 7168 * 2048 * 3 * 2  # dgrad2, dgrad1 (2I), dWd, dWg + dWu
    rows.append(Row("bench fused bwd core vs unfused (8x4096 rows, H 7168, I 2048)", time_us=t_fus, ok=True,
                    note=f"unfused {t_unf:.0f} us, fused {t_fus:.0f} us: {t_unf / t_fus:.3f}x; "
                         f"{flop / t_fus / 1e6:.0f} TFLOP/s fused; graph captures in the timed calls {captures}"))
    rows += _trace_rows(ops, out_dir)
    return rows


def _trace_rows(ops, out_dir: Path) -> list[Row]:
    """The bench's core once more traced (``BackwardLaunch(trace=True)``): bitwise the untraced run,
    and its time per kind of tile (trace busy time / tiles) next to the unfused kernel's per tile
    (its time x CTAs / tiles); the trace is written to ``out_dir``/trace_bwd_core.json."""
    from mok_cute import trace as trace_view
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.kernels.sm90 import fused_bwd

    dy, x, gu, h, offsets, wg, wu, wd = ops
    want = _core(ops, 4.0)
    got = _core(ops, 4.0, trace=True)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    path = str(out_dir / "trace_bwd_core.json")
    records, comm = fused_bwd.last_trace()
    trace_view.dump(path, records, comm, fused_bwd.KINDS, fused_bwd.GEMM_KINDS)
    s = trace_view.summary(*trace_view.load(path))
    inter = wg.shape[1]
    dgu = bwd._run_dswiglu_dgrad(dy, offsets, wd, gu, 4.0)
    ctas = torch.cuda.get_device_properties(dy.device).multi_processor_count
    unf = {"D2": bench_us(lambda: bwd._run_dswiglu_dgrad(dy, offsets, wd, gu, 4.0)),
           "D1": bench_us(lambda: bwd._run_dgrad1(dgu, offsets, wg, wu)),
           "dWd": bench_us(lambda: bwd._run_wgrad(dy, h, offsets)),
           "dWg": bench_us(lambda: bwd._run_wgrad(dgu[:, :inter], x, offsets))}
    per = []
    for kind, n in s["tasks"].items():
        t_u = unf.get(kind, unf["dWg"] if kind == "dWu" else None)
        u = f", unfused {t_u * ctas / n:.1f}" if t_u is not None else ""
        per.append(f"{kind} {s['busy_us'][kind] / n:.1f}{u}")
    return [Row("trace fused bwd core (same problem)", bitwise=same, ok=same and sum(s["tasks"].values()) > 0,
                time_us=s["span_us"], note=f"== untraced: {same}; us per tile: {'; '.join(per)}; scheduler share "
                                             f"{100 * s['scheduler_share']:.2f}%; unfused kernels us {unf}"),
            _device_time_row(ops)]


def _device_time_row(ops) -> Row:
    """Device time per kernel (torch.profiler, mean of 3 calls) of the fused core, traced and
    not, and of the unfused launches: what the trace's span leaves out (start-up, tail, host)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(fn):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
            if t > 0:
                out[ev.key[:40]] = round(t / 3)
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:6])

    fused = kernels(lambda: _core(ops, 4.0))
    traced = kernels(lambda: _core(ops, 4.0, trace=True))
    unfused = kernels(lambda: _unfused(*ops, 4.0))
    return Row("device us per kernel (profiler): fused core / traced / unfused", ok=True,
               note=f"fused {fused}; traced {traced}; unfused {unfused}")


def _routes(g, t: int, k: int, e: int):
    """``(idx int32 [t, k], order, valid, rows per expert)``: random routes on ``g``'s device with -1
    slots (every fifth token's slot 1, token 7's all), ``order`` the stable sort by expert (-1 last)."""
    idx = torch.randint(0, e, (t, k), device=g.device, generator=g).to(torch.int32)
    idx[::5, 1] = -1
    idx[7] = -1
    flat = idx.reshape(-1).long()
    order = torch.argsort(torch.where(flat >= 0, flat, e), stable=True)
    valid = flat >= 0
    return idx, order, valid, torch.bincount(flat[valid], minlength=e).tolist()


def _tokens_rows(dev) -> list[Row]:
    """``tokens=``: dx [T, H] of the launch vs the unfused rows scattered and slot-summed."""
    from mok_cute.layers.grouped import _scatter_slots
    from mok_cute.reference import slot_sum

    rows = []
    g = torch.Generator(device=dev).manual_seed(9)
    t, k, e = 700, 4, 8
    for shared in (False, True):
        idx, order, valid, counts = _routes(g, t, k, e)
        ops = _operands(counts, 1024, 512, dev, seed=3 + shared, rows=t * k)
        dxs = (torch.randn(t, 1024, device=dev, generator=g)).bfloat16() if shared else None
        dxr, *dws = _unfused(*ops, None)
        acc = torch.zeros(t, 1024, dtype=torch.float32, device=dev) if dxs is None else dxs.float()
        want = slot_sum(acc, _scatter_slots(dxr, order, valid, t, k), idx).to(torch.bfloat16)
        got = [_core(ops, None, tokens=(order, idx, dxs), num_ctas=n) for n in (132, 132, 19)]
        torch.cuda.synchronize()
        eq = [torch.equal(r[0], want) and all(torch.equal(a, b) for a, b in zip(r[1:], dws)) for r in got]
        rows.append(Row(f"fused bwd core tokens= (dx slot sum){' + shared dx' if shared else ''}", bitwise=all(eq),
                        ok=all(eq), note=f"dx and dW == unfused scatter + slot_sum per run (132 x2, 19 CTAs): {eq}"))
    return rows


def _x_gather_rows(dev) -> list[Row]:
    """``x_tok=`` (the layer's FUSED backward at BF16: x's token rows gathered in the dW_gate / dW_up loads, no
    grouped x rows): dx and every weight gradient bitwise the unfused backward on the grouped x rows, with -1 slots,
    empty experts and ragged k-tiles, at tile_n 256 and 128 and on a small grid; at H 1024, I 512 and at H 960,
    I 320 (partial last tiles along H and I)."""
    return [r for hid, inter in ((1024, 512), (960, 320)) for r in _x_gather_case(dev, hid, inter)]


def _x_gather_case(dev, hid: int, inter: int) -> list[Row]:
    """:func:`_x_gather_rows` at one (H, I)."""
    from mok_cute.layers.grouped import _scatter_slots
    from mok_cute.reference import slot_sum

    rows = []
    g = torch.Generator(device=dev).manual_seed(17)
    t, k, e = 700, 4, 12
    idx, order, valid, counts = _routes(g, t, k, e // 2)  # experts 6..11 get no rows
    counts += [0] * (e - len(counts))
    ops = list(_operands(counts, hid, inter, dev, seed=21, rows=t * k))
    x_tok = (torch.randn(t, hid, device=dev, generator=g)).bfloat16()
    ops[1] = x_tok[order // k]
    dxr, *dws = _unfused(*ops, 4.0)
    want = slot_sum(torch.zeros(t, hid, dtype=torch.float32, device=dev), _scatter_slots(dxr, order, valid, t, k),
                    idx).to(torch.bfloat16)
    from mok_cute.kernels.sm90.fused_bwd import BackwardLaunch, ExpertRows, fused_backward_core

    for tile_n, ctas in ((None, 132), (None, 132), (128, 132), (None, 11)):
        mine = [a.clone() for a in ops]  # consume: the launch writes over dy and gu
        got = fused_backward_core(ExpertRows(mine[0], None, *mine[2:5]), ops[5:], 4.0,
                                  BackwardLaunch(num_ctas=ctas, tile_n=tile_n), tokens=(order, idx, None),
                                  consume=True, x_tok=x_tok)
        torch.cuda.synchronize()
        eq = [torch.equal(got[0], want)] + [torch.equal(a, b) for a, b in zip(got[1:], dws)]
        rows.append(Row(f"fused bwd core x gathered in the loads H{hid} I{inter} (tile_n {tile_n or 256}, {ctas} CTAs)",
                        bitwise=all(eq), ok=all(eq), note=f"[dx, dWg, dWu, dWd] == unfused on grouped x rows: {eq}"))
    return rows


def _mx_rows(dev) -> list[Row]:
    """MXFP8 (``mx=True``): the fused core vs the unfused MXFP8 backward (``_mx_backward``: every
    operand's round trip a separate kernel), expert sizes off the 32-row blocks, grids of 132 and
    37, with and without the dx slot sum; then the layer at MXFP8, every gradient of the backward paths
    FUSED (after the MXFP8 prologue) and FUSED_WHOLE vs UNFUSED."""
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.layers.common import ExpertGroup
    from mok_cute.layers.sm90 import Sm90ExpertMLP

    rows = []
    mlp = Sm90ExpertMLP()
    for name, counts, limit in (("uniform", [370, 385, 390, 361, 402, 377, 366, 389], None),
                                ("skewed", [2845, 0, 33, 0, 5, 82, 0, 37], 4.0)):
        ops = _operands(counts, 1024, 512, dev, seed=11 + len(name))
        dy, x, gu, h, offsets, wg, wu, wd = ops
        g = ExpertGroup(x, offsets, gu, h, "mxfp8")
        want = mlp._mx_backward(bwd, g, dy, wg, wu, wd, limit)
        wts = mlp._bwd_weights(g, wg, wu, wd)
        got = [_core((*ops[:5], *wts), limit, num_ctas=n, mx=True) for n in (132, 132, 37)]
        torch.cuda.synchronize()
        eq = [all(torch.equal(a, b) for a, b in zip(r, want)) for r in got]
        diff = [n for n, a, b in zip(("dx", "dWg", "dWu", "dWd"), got[0], want) if not torch.equal(a, b)]
        rows.append(Row(f"fused bwd core MXFP8 {name} L={limit}", bitwise=all(eq), ok=all(eq),
                        note=f"== unfused MXFP8 backward per run (132 x2, 37 CTAs): {eq}; differs: {diff}"))
    rows.append(_mx_tokens_row(dev))
    rows += _mx_prologue_rows(dev)
    x, idx, w, ws, sh, dy = _problem(600, 1024, 512, 8, 4, True, True, dev, seed=72)
    # FUSED_WHOLE: the whole MXFP8 backward in one launch, the shared expert's before it; FUSED: the fused core
    # after the rows and their round trips made in two launches over every SM (route_grad.mx_dy_rows_and_dtopk_w,
    # mx_x_rows)
    outs = {path: _run("sm90", x, idx, w, ws, sh, dy, 4.0, precision="mxfp8", backward_path=path)
            for path in ("unfused", "fused", "fused_whole")}
    for path in ("fused", "fused_whole"):
        same = [torch.equal(a, b) for a, b in zip(outs["unfused"], outs[path])]
        rows.append(Row(f"layer grads MXFP8 backward_path={path} == unfused (skew + shared)",
                        bitwise=all(same), ok=all(same), note=f"[y, dx, dtw, dWg, dWu, dWd, dWs...] equal: {same}"))
    return rows


def _mx_prologue_rows(dev) -> list[Row]:
    """The MXFP8 prologue's two launches (``route_grad.mx_dy_rows_and_dtopk_w``, ``mx_x_rows``) against the unfused
    passes (route_grad's kernel, then ``mxfp8_round_trip`` / ``mxfp8_round_trip_tokens``), bitwise on the experts'
    rows and twice: H 1536 (a partial slab of 64 chunks after a whole one) over uniform routes, H 4096 with the
    forward rows in route order over a skew (empty experts, -1 slots, blocks off 32 rows); the blocks run in the
    token-local round order (the slabs copied in by cp.async), the outputs' memory NaN-filled before each run."""
    from mok_cute.kernels import route_grad
    from mok_cute.kernels.quant.dequant_mxfp8 import mxfp8_round_trip, mxfp8_round_trip_tokens
    from mok_cute.layers.grouped import route_sort

    rows = []
    for t, h, e, k, skew, by_route in ((700, 1536, 8, 4, False, False), (1100, 4096, 16, 6, True, True)):
        x, idx, w, _, _, dy = _problem(t, h, 256, e, k, False, skew, dev, seed=t)
        order, offsets, _ = route_sort(idx, e)
        r = torch.randn(t * k, h, device=dev).bfloat16()
        n = int(offsets[-1])
        u_rows, u_dtw = route_grad.dy_rows_and_dtopk_w(dy, r, order, w, offsets, by_route)
        want = (mxfp8_round_trip(u_rows)[:n], mxfp8_round_trip_tokens(u_rows, offsets)[:n], u_dtw,
                mxfp8_round_trip_tokens(x[order // k].contiguous(), offsets)[:n])
        o32 = order.int()
        runs = []
        for _ in range(2):
            # NaN in the memory the outputs will take: a block the launch misses cannot keep an earlier run's rows
            poison = [torch.full_like(v, float("nan")) for v in (r, r, r, r, w, w)]
            del poison
            d_rows, d_t, dtw = route_grad.mx_dy_rows_and_dtopk_w(dy, r, o32, w, offsets, by_route)
            runs.append((d_rows[:n], d_t[:n], dtw, route_grad.mx_x_rows(x, o32, offsets, k)[:n]))
        torch.cuda.synchronize()
        eq = [[torch.equal(a, b) for a, b in zip(got, want)] for got in runs]
        ok = all(all(v) for v in eq)
        tags = f"{' skew' if skew else ''}{' by-route' if by_route else ''}"
        rows.append(Row(f"MXFP8 prologue T{t} H{h} E{e} k{k}{tags}", bitwise=ok, ok=ok,
                        note=f"[dy rows, dy_t, d topk_w, x rows] == unfused passes, 2 runs: {eq}"))
    return rows


def _mx_tokens_row(dev) -> Row:
    """MXFP8 ``tokens=`` (the dx rows written over dy's round trip, summed through the inverse order):
    dx bitwise the unfused MXFP8 rows scattered and slot-summed, on routes with -1 slots, consumed and
    not, grids of 132 and 37; at I 768 (2I > H: dgu's token round trip in its own buffer) and at I 512
    (2I <= H, ``wd_first``: the dW_down tiles first, dgu's token round trip over dy's)."""
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.layers.common import ExpertGroup
    from mok_cute.layers.grouped import _scatter_slots
    from mok_cute.layers.sm90 import Sm90ExpertMLP
    from mok_cute.reference import slot_sum

    g = torch.Generator(device=dev).manual_seed(19)
    t, k, e = 700, 4, 8
    idx, order, valid, counts = _routes(g, t, k, e)
    dxs = torch.randn(t, 1024, device=dev, generator=g).bfloat16()
    mlp = Sm90ExpertMLP()
    eq = {}
    for inter in (768, 512):
        ops = _operands(counts, 1024, inter, dev, seed=23, rows=t * k)
        dy, x, gu, h, offsets, wg, wu, wd = ops
        grp = ExpertGroup(x, offsets, gu, h, "mxfp8")
        dxr, *dws = mlp._mx_backward(bwd, grp, dy, wg, wu, wd, 4.0)
        want = slot_sum(dxs.float(), _scatter_slots(dxr, order, valid, t, k), idx).to(torch.bfloat16)
        wts = mlp._bwd_weights(grp, wg, wu, wd)
        eq[inter] = []
        for n, consume in ((132, False), (132, False), (37, False), (132, True)):
            a = [o.clone() for o in (dy, x, gu, h)] if consume else (dy, x, gu, h)
            r = _core((*a, offsets, *wts), 4.0, tokens=(order, idx, dxs), consume=consume, num_ctas=n, mx=True)
            torch.cuda.synchronize()
            eq[inter].append(torch.equal(r[0], want) and all(torch.equal(p, q) for p, q in zip(r[1:], dws)))
    ok = all(all(v) for v in eq.values())
    return Row("fused bwd core MXFP8 tokens= (dx over dy's rows)", bitwise=ok, ok=ok,
               note=f"dx and dW == unfused MXFP8 scatter + slot_sum per run (132 x2, 37, 132 consumed) at I 768 "
                    f"and I 512 (wd_first): {eq}")


def _main_grads_rows(x, idx, w, ws, sh, dy, backend: str = "sm90", paths=("unfused", "fused", "fused_whole"),
                     env=None) -> list[Row]:
    """``mok_cute.moe(..., main_grads=)`` on the device, per backward path in ``paths``, on ``backend``
    with ``env`` set around every call (tools/checks/sm100.py: the opt-in)."""
    import mok_cute

    rows = []
    env = env or {}
    cfg = mok_cute.MoKConfig(backend=backend)
    weights = [p.clone().requires_grad_() for p in (*ws, *sh)]
    fresh = torch.autograd.grad(mok_cute.moe(x, idx, w, *weights[:3], shared=tuple(weights[3:]), swiglu_limit=4.0,
                                             config=cfg), weights, dy)
    for path in paths:
        cfg_path = mok_cute.MoKConfig(backend=backend, backward_path=path)
        with env_var(env):
            g = torch.Generator(device=x.device).manual_seed(4)
            start = [torch.randn(p.shape, device=x.device, generator=g) for p in weights]
            acc = [s.clone() for s in start]
            for _ in range(2):
                y = mok_cute.moe(x, idx, w, *weights[:3], shared=tuple(weights[3:]), swiglu_limit=4.0,
                                 config=cfg_path, main_grads=tuple(acc))
                y.backward(dy)
            torch.cuda.synchronize()
        want = [s + f.float() + f.float() for s, f in zip(start, fresh)]
        same = all(torch.equal(a, b) for a, b in zip(acc, want))
        no_grad = all(p.grad is None for p in weights)
        rows.append(Row(f"{backend} main_grads += fp32(dW) twice, backward_path={path}", bitwise=same,
                        ok=same and no_grad,
                        note=f"== start + 2 fp32(fresh dW): {same}; weights without .grad: {no_grad}"))
    return rows


def _launch_count_row(x, idx, w, ws, sh, dy) -> Row:
    """backward_path FUSED_WHOLE: one fused backward launch per backward (torch.profiler), shared expert in."""
    import mok_cute
    from torch.profiler import ProfilerActivity, profile

    leaves = [p.clone().requires_grad_() for p in (*ws, *sh)]
    cfg = mok_cute.MoKConfig(backend="sm90", validate_routing=False, backward_path="fused_whole")
    y = mok_cute.moe(x, idx, w, *leaves[:3], shared=tuple(leaves[3:]), swiglu_limit=4.0, config=cfg)
    torch.autograd.grad(y, leaves, dy)  # compiles outside the profile
    y = mok_cute.moe(x, idx, w, *leaves[:3], shared=tuple(leaves[3:]), swiglu_limit=4.0, config=cfg)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(y, leaves, dy)
        torch.cuda.synchronize()
    names = [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    fused = sum("FusedMoeBwdCoreSm90" in n for n in names)
    return Row("backward_path=fused_whole: fused backward launches per backward", ok=fused == 1,
               note=f"fused kernel x{fused}, {len(names)} kernels in all (allocations, zeroing included)")

"""The per-row warp work of the routed-gradient prologue (:mod:`mok_cute.kernels.route_grad`), shared
by its kernel and the fused backwards (``kernels/sm90/fused_bwd.py``, ``kernels/sm100/fused_bwd.py``,
whose comm CTAs run :func:`gather_chunks`): one warp scales a dy row by
its router weight (``mul.rn.f32``, ``cvt.rn.bf16x2.f32``) and sums dy . r in fp32 in a fixed order
(each lane FMAs its 16-byte chunks ``lane, lane + 32, ...``, then a fixed butterfly). A lane
loads ``ROW_BATCH`` chunks of each operand before it uses them (one CTA per SM in the fused
backward: the loads' latency is hidden by the batch, not by other CTAs)."""
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from mok_cute.comm.protocol import gptr
from mok_cute.kernels import mx_rows, slot_rows
from mok_cute.kernels.sm90 import persistent
from mok_cute.schedule.fused_tasks import mtile

ROW_BATCH = 4  # 16-byte chunks of dy and of r in flight per lane


def _ptx(text, *args):
    return cute.arch.inline_ptx(text, write_only_types=[Uint32], read_only_args=list(args))


def scale_pair(word, w):
    """bf16x2 word -> bf16x2 of (element * w) with mul.rn.f32 (``w`` fp32 bits)."""
    return _ptx("{ .reg .b32 lo, hi, p0, p1;\n"
                "shl.b32 lo, {$r0}, 16;\n"
                "and.b32 hi, {$r0}, 0xFFFF0000;\n"
                "mul.rn.f32 p0, lo, {$r1};\n"
                "mul.rn.f32 p1, hi, {$r1};\n"
                "cvt.rn.bf16x2.f32 {$w0}, p1, p0; }", word, w)


def dot_pair(acc, a, b):
    """acc + a.lo * b.lo, then + a.hi * b.hi (two fma.rn.f32 on bf16x2 words)."""
    return _ptx("{ .reg .b32 al, ah, bl, bh, s;\n"
                "shl.b32 al, {$r1}, 16;\n"
                "and.b32 ah, {$r1}, 0xFFFF0000;\n"
                "shl.b32 bl, {$r2}, 16;\n"
                "and.b32 bh, {$r2}, 0xFFFF0000;\n"
                "fma.rn.f32 s, al, bl, {$r0};\n"
                "fma.rn.f32 {$w0}, ah, bh, s; }", acc, a, b)


@cute.jit
def gather_dy_row(lane: Int32, dy: cute.Tensor, r: cute.Tensor, out: cute.Tensor, w: cute.Tensor, dtw: cute.Tensor,
                  p: Int32, q: Int32, k: Int32, hc: Int32, by_route: cutlass.Constexpr[bool]):
    """One warp, grouped row ``p`` of route ``q = t*k + j`` in a fused backward's gather (EP = 1):
    :func:`route_row` with w = ``w[q]`` into ``out`` row p, and lane 0 stores d topk_w[q] = dy[t] .
    r[p] (``by_route``: r[q], the forward's rows in route order) into ``dtw``; ``w`` / ``dtw``: uint32
    views of fp32 [T*k]."""
    src = p
    if cutlass.const_expr(by_route):
        src = q
    acc = route_row(lane, dy, r, out, q // k, src, p, w[q], hc)
    if lane == 0:
        dtw[q] = acc


@cute.jit
def route_row(lane: Int32, dy: cute.Tensor, r: cute.Tensor, out: cute.Tensor, t: Int32, rr: Int32, p: Int32,
              wq: Uint32, hc: Int32):
    """One warp, one routed row (the module contract): ``out`` row p = bf16(fp32(dy row t) * w)
    (``wq``: w's fp32 bits), and the returned fp32 bits (every lane's, after the butterfly) of
    sum_h dy[t, h] * r[rr, h]. ``dy``, ``r``, ``out``: (rows * hc, 4) uint32 views of bf16 rows
    (``hc`` = H / 8 16-byte chunks per row). ``r`` None: the scaled row only (returns 0); ``out``
    None: the sum only (the EP > 1 backward makes the two on different ranks)."""
    acc = Uint32(0)
    a = cute.make_rmem_tensor((4, ROW_BATCH), Uint32)
    b = cute.make_rmem_tensor((4, ROW_BATCH), Uint32)
    for c0 in cutlass.range(lane, hc, 32 * ROW_BATCH, unroll=1):
        for u in cutlass.range_constexpr(ROW_BATCH):  # every load first
            c = c0 + u * 32
            if c < hc:
                a[None, u].store(dy[t * hc + c, None].load())
                if cutlass.const_expr(r is not None):
                    b[None, u].store(r[rr * hc + c, None].load())
        for u in cutlass.range_constexpr(ROW_BATCH):  # then the chunks in order: the sum's order
            c = c0 + u * 32
            if c < hc:
                o = cute.make_rmem_tensor((4,), Uint32)
                for j in cutlass.range_constexpr(4):
                    if cutlass.const_expr(out is not None):
                        o[j] = scale_pair(a[j, u], wq)
                    if cutlass.const_expr(r is not None):
                        acc = dot_pair(acc, a[j, u], b[j, u])
                if cutlass.const_expr(out is not None):
                    out[p * hc + c, None].store(o.load())
    if cutlass.const_expr(r is not None):
        acc = warp_sum_rn(acc)
    return acc


@cute.jit
def warp_sum_rn(v):
    """Every lane's fp32 bits ``v`` summed over the warp by the fixed butterfly (offsets 16, 8, 4, 2, 1, one
    ``add.rn.f32`` each): d topk_w's last step, the same bits on every lane."""
    for s in cutlass.range_constexpr(5):
        v = _ptx("add.rn.f32 {$w0}, {$r0}, {$r1};", v, cute.arch.shuffle_sync_bfly(v, offset=16 >> s))
    return v


class CommCta(NamedTuple):
    """Who runs a gather: thread ``tidx`` of comm CTA ``bidx`` of ``comm_ctas`` (the first CTAs of the
    grid), ``threads`` per CTA (a Python int: one warp per row)."""

    tidx: Int32
    bidx: Int32
    comm_ctas: Int32
    threads: int


class RowWalk(NamedTuple):
    """The routed rows a gather walks: ``chunks`` routed m-tiles over ``offsets`` int32 [E+1]
    (``num_experts`` E; ``tile_m`` rows each, a Python int, an expert's last m-tile partial); ``order``
    int32 [M] the route q = t*k + j of each grouped row (EP > 1: packed ``p*T*k + t*k + j``); ``idx``
    int32 [T*k] each route's expert (-1: none; read at EP > 1); ``k`` routes per token; ``hidden`` H."""

    chunks: Int32
    offsets: cute.Tensor
    num_experts: Int32
    order: cute.Tensor
    idx: cute.Tensor
    k: Int32
    hidden: Int32
    tile_m: int


class GatherRows(NamedTuple):
    """The tensors of a gather (bf16 rows [*, H] unless said): ``dy_tok``, ``x_tok`` [T, H] the layer's
    dy and x (EP > 1: unread, the rows come from the peers); ``r`` the forward's GEMM2 rows ([M, H]
    expert-grouped, or [T*k, H] in route order: ``by_route``; EP > 1: this rank's slot rows [T*k, H]);
    ``w`` fp32 [T*k] topk_w (EP > 1: [M], each grouped row's router weight); ``dtw`` fp32 [T*k], d topk_w
    out; ``ready`` int32 [m-tiles], the passes published per m-tile (1: dy rows, 2: x rows too);
    ``dy_rows``, ``x_rows`` [M, H] the grouped rows made; ``dyt_rows`` [M, H] or None: the SM90 MXFP8
    variant's dy round trip along the tokens (its step's operand). A fused kernel takes the bundle whole
    (this field order is its parameters' order)."""

    dy_tok: cute.Tensor
    x_tok: cute.Tensor
    r: cute.Tensor
    w: cute.Tensor
    dtw: cute.Tensor
    ready: cute.Tensor
    dy_rows: cute.Tensor | None = None
    x_rows: cute.Tensor | None = None
    dyt_rows: cute.Tensor | None = None


class EpPull(NamedTuple):
    """EP > 1: the rows pulled from the source ranks. ``x`` / ``dy``:
    :class:`~mok_cute.comm.peer_rows.PeerRows` of the workspace's x and dy sections; ``counters``
    the int32 word array the comm CTAs arrive on (``counters + pulled_word``: the last one says DONE)."""

    x: object
    dy: object
    counters: cute.Pointer
    pulled_word: int


class MxTile(NamedTuple):
    """One gathered m-tile as an MXFP8 step sees it (the ``mx`` step of :func:`gather_chunks`): thread
    ``tidx`` (``warp``, ``lane``) of the CTA's ``threads`` (a Python int), the bf16 ``dy_rows`` /
    ``x_rows`` [M, H], the tile's grouped rows ``row0 .. row0 + rows`` (``tile_m`` at most, a Python
    int), ``hc`` = H / 8 16-byte chunks per row, ``offsets`` int32 [E+1], the tile's ``expert`` and its
    ``m_tile`` inside the expert."""

    tidx: Int32
    warp: Int32
    lane: Int32
    threads: int
    dy_rows: cute.Tensor
    x_rows: cute.Tensor
    row0: Int32
    rows: Int32
    tile_m: int
    hc: Int32
    offsets: cute.Tensor
    expert: Int32
    m_tile: Int32


@cute.jit
def gather_chunks(cta: CommCta, walk: RowWalk, g: GatherRows, pull: EpPull | None, trace_rec: tuple | None,
                  unroll: cutlass.Constexpr[int], by_route: cutlass.Constexpr[bool], mx: tuple = None):
    """A fused backward's comm CTA ``cta.bidx`` of ``cta.comm_ctas`` (one warp per row): routed
    m-tile ``c`` of ``walk`` (``tile_m`` grouped rows p of one expert, route q = ``order[p]`` = t*k + j)
    for c = bidx, bidx + comm_ctas, ..., in two passes: ``dy_rows[p]`` = bf16(dy[t] * w[q]) with
    d topk_w[q] = dy[t] . r[p] (``by_route``: r[q]) (:func:`gather_dy_row`), then ``x_rows[p]`` =
    x[t]; each pass publishes chunk c by a release add on ``ready[c]`` (1: dy rows, 2: x rows too).
    Then d topk_w = 0 for the routes past the experts' rows (-1 slots). ``g``: :class:`GatherRows`;
    ``unroll``: 16-byte loads in flight per lane of the x copy.

    EP > 1 (``pull``, :class:`EpPull`; else None): the rows of route q (packed ``p*T*k + t*k + j``)
    are pulled from rank p's staged dy and x between ``open_pull`` and ``close_pull``, dy scaled by
    ``w[p]``; then d topk_w of this rank's routes q in [T*k] from its slot rows ``r`` (0 where
    ``idx`` is -1). ``trace_rec``: ``(records, base, kinds)`` (chunk c's passes recorded at base + c
    and base + chunks + c with kinds[0] / kinds[1]) or None.

    ``mx`` = ``(step, operands)`` (the MXFP8 backward's; else None): before each pass publishes its
    m-tile, ``step(tile, xpass, operands)`` (``tile``: :class:`MxTile`) makes from the tile's bf16 rows
    what the MXFP8 GEMMs read (m-tiles start at their expert's first row, so the tokens' blocks of 32
    are the tile's): SM90 :func:`mx_round_trips`, SM100 ``sm100.mx_gather.quantize_tile``."""
    tidx, bidx, comm_ctas, threads = cta
    chunks, offsets, num_experts, order, idx, k, hidden, tile_m = walk
    ep = ep_dy = None
    if cutlass.const_expr(pull is not None):
        ep, ep_dy = pull.x, pull.dy
    hc = hidden // 8
    warps = threads // 32

    def rows4(m: cute.Tensor):
        return cute.make_tensor(cute.recast_ptr(m.iterator, dtype=Uint32),
                                cute.make_layout((m.shape[0] * hc, 4), stride=(4, 1)))

    dyv, rv, outv = rows4(g.dy_tok), rows4(g.r), rows4(g.dy_rows)
    xtok, xrows = g.x_tok.iterator.toint(), g.x_rows.iterator.toint()
    w, dtw = g.w, g.dtw
    wv = cute.make_tensor(cute.recast_ptr(w.iterator, dtype=Uint32), cute.make_layout(w.shape[0]))
    dtwv = cute.make_tensor(cute.recast_ptr(dtw.iterator, dtype=Uint32), cute.make_layout(dtw.shape[0]))
    warp = tidx // 32
    lane = tidx % 32
    traced = cutlass.const_expr(trace_rec is not None)
    if cutlass.const_expr(ep is not None):
        ep.open_pull(tidx, bidx)
    for xpass in cutlass.range_constexpr(2):
        ge, gb = Int32(0), Int32(0)
        for c in cutlass.range(bidx, chunks, comm_ctas, unroll=1):
            t0 = persistent.now(traced)
            row0, rows, ge, gb = mtile(offsets, num_experts, tile_m, c, ge, gb)
            for rr in cutlass.range(warp, rows, warps, unroll=1):
                p = row0 + rr
                q = order[p]
                t = q // k
                if cutlass.const_expr(xpass == 0):
                    if cutlass.const_expr(ep is not None):
                        src = cute.make_tensor(gptr(Uint32, ep_dy.src_row(q, k, hidden * 2), 16),
                                               cute.make_layout((hc, 4), stride=(4, 1)))
                        route_row(lane, src, None, outv, Int32(0), Int32(0), p, wv[p], hc)
                    else:
                        gather_dy_row(lane, dyv, rv, outv, wv, dtwv, p, q, k, hc, by_route)
                else:
                    src = xtok + Int64(t) * Int64(hidden * 2)
                    if cutlass.const_expr(ep is not None):
                        src = ep.src_row(q, k, hidden * 2)
                    slot_rows.copy_row(lane, src, xrows + Int64(p) * Int64(hidden * 2), hc, unroll)
            if cutlass.const_expr(mx is not None):
                mx[0](MxTile(tidx, warp, lane, threads, g.dy_rows, g.x_rows, row0, rows, tile_m, hc, offsets, ge,
                             c - gb), xpass, mx[1])
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                cute.arch.atomic_add(g.ready.iterator + c, Int32(1), sem="release", scope="gpu")
                if cutlass.const_expr(traced):
                    records, base, kinds = trace_rec
                    persistent.record(records, base + xpass * chunks + c, t0, persistent.now(traced), kinds[xpass],
                                      bidx, c)
    if cutlass.const_expr(ep is not None):  # every comm CTA has pulled its rows: the last one says DONE
        ep.close_pull(tidx, pull.counters + pull.pulled_word, comm_ctas)
        for q in cutlass.range(bidx * warps + warp, idx.shape[0], comm_ctas * warps, unroll=1):
            acc = Uint32(0)
            if idx[q] >= 0:
                acc = route_row(lane, dyv, rv, None, q // k, q, Int32(0), Uint32(0), hc)
            if lane == 0:
                dtwv[q] = acc
    else:
        for p in cutlass.range(offsets[num_experts] + bidx * threads + tidx, order.shape[0], comm_ctas * threads,
                               unroll=1):
            dtwv[order[p]] = Uint32(0)


@cute.jit
def mx_round_trips(tile: MxTile, xpass: cutlass.Constexpr[int], operands: tuple):
    """:func:`gather_chunks`' SM90 MXFP8 step (``operands`` = ``(dy_t,)``, bf16 [M, H]) on the m-tile
    rows ``row0 .. row0 + rows`` of ``tile`` (:class:`MxTile`) in pass ``xpass`` (the tile's rows
    stored before it, by any of the CTA's threads; the caller's fence and barrier follow it), bitwise
    the unfused round trips (:mod:`~mok_cute.kernels.mx_rows`): pass 0 writes dy's round trip along
    the tokens into ``dy_t``, then replaces the dy rows by their round trip along H; pass 1 replaces
    the x rows by theirs along the tokens (``offsets`` / ``expert`` / ``m_tile`` unread)."""
    tidx, warp, lane, threads, dy_rows, x_rows, row0, rows, tile_m, hc = tile[:10]
    cute.arch.barrier()
    if cutlass.const_expr(xpass == 0):
        dyw = mx_rows.chunk_words(dy_rows, hc, 4)
        mx_rows.mx_tile_columns(tidx, threads, dyw, mx_rows.chunk_words(operands[0], hc, 4), row0, rows, tile_m, hc)
        cute.arch.barrier()  # every column block has read the rows before they are rewritten
        for rr in cutlass.range(warp, rows, threads // 32, unroll=1):
            mx_rows.mx_row(lane, dyw, row0 + rr, hc)
    else:
        xw = mx_rows.chunk_words(x_rows, hc, 4)
        mx_rows.mx_tile_columns(tidx, threads, xw, xw, row0, rows, tile_m, hc)

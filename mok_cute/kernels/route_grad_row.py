"""The per-row warp work of the routed-gradient prologue (:mod:`mok_cute.kernels.route_grad`), shared
by its kernel and the fused backward (``kernels/sm90/fused_bwd.py``): one warp scales a dy row by
its router weight (``mul.rn.f32``, ``cvt.rn.bf16x2.f32``) and sums dy . r in fp32 in a fixed order
(each lane FMAs its 16-byte chunks ``lane, lane + 32, ...``, then a fixed butterfly). A lane
loads ``ROW_BATCH`` chunks of each operand before it uses them (one CTA per SM in the fused
backward: the loads' latency is hidden by the batch, not by other CTAs)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

ROW_BATCH = 4  # 16-byte chunks of dy and of r in flight per lane


def _ptx(text, *args):
    return cute.arch.inline_ptx(text, write_only_types=[Uint32], read_only_args=list(args))


def _scale_pair(word, w):
    """bf16x2 word -> bf16x2 of (element * w) with mul.rn.f32 (``w`` fp32 bits)."""
    return _ptx("{ .reg .b32 lo, hi, p0, p1;\n"
                "shl.b32 lo, {$r0}, 16;\n"
                "and.b32 hi, {$r0}, 0xFFFF0000;\n"
                "mul.rn.f32 p0, lo, {$r1};\n"
                "mul.rn.f32 p1, hi, {$r1};\n"
                "cvt.rn.bf16x2.f32 {$w0}, p1, p0; }", word, w)


def _dot_pair(acc, a, b):
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
                        o[j] = _scale_pair(a[j, u], wq)
                    if cutlass.const_expr(r is not None):
                        acc = _dot_pair(acc, a[j, u], b[j, u])
                if cutlass.const_expr(out is not None):
                    out[p * hc + c, None].store(o.load())
    if cutlass.const_expr(r is not None):
        for s in cutlass.range_constexpr(5):
            acc = _ptx("add.rn.f32 {$w0}, {$r0}, {$r1};", acc, cute.arch.shuffle_sync_bfly(acc, offset=16 >> s))
    return acc



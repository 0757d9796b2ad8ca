"""Routing plan of one rank at EP = 1 on the device: two launches, no host sync.

From ``topk_idx`` [T, k] (int32 / int64 expert ids; -1 = no expert) it writes
  * ``order`` int32 [T*k]: the routes ``t*k + j`` sorted stably by expert, the routes with
    no expert last (bitwise the order of a stable sort by expert id with -1 as E);
  * ``offsets`` int32 [E+1]: expert ``e``'s grouped rows are ``offsets[e]..offsets[e+1]``;
  * ``idx`` int32 [T*k]: the ids with those outside [-1, E) replaced by -1 (such a route is
    skipped like a -1 slot, so no later kernel reads or writes for it);
  * ``words`` int32 [2]: the number of ids outside [-1, E) and the route of the first one
    (-1 if none), for :mod:`mok_cute.dsl.deferred`.

Two launches of ``plan_ctas(n)`` CTAs of 1024 threads (32 warps); CTA c owns a contiguous
range of the routes, warp w of it a contiguous chunk. Pass 1 (``count_kernel``) writes the
sanitised ids and counts CTA c's routes per bucket (bucket E holds the routes with no expert)
into ``part[c]``. Pass 2 (``scatter_kernel``) counts them again per (warp, bucket) with a
``match.any`` made of ballots (the group's lowest lane adds the group size), and gives each
route its row: its bucket's start (every CTA's counts summed, buckets in order) + the bucket's
routes in earlier CTAs + those in earlier warps + the lanes of its group below it (CTA, warp,
then lane order = route order: stable). Each lane loads ``LOADS`` ids ahead of their use.
This module imports no GEMM code; :func:`plan_reference` is its torch mirror.
"""

import torch

THREADS = 1024
MAX_EXPERTS = 1024
LOADS = 4  # id loads in flight per lane, a batch of 32 * LOADS routes per warp
CTA_ROUTES = 4096  # routes per CTA at least (more past MAX_CTAS CTAs)
MAX_CTAS = 128


def plan_reference(topk_idx: torch.Tensor, num_experts: int):
    """The specification in torch: ``(order, offsets, idx, words)`` as the kernel writes them
    (any device, no host sync)."""
    flat = topk_idx.reshape(-1).long()
    bad = (flat < -1) | (flat >= num_experts)
    idx = torch.where(bad, torch.full_like(flat, -1), flat)
    key = torch.where(idx >= 0, idx, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    none = torch.full((), -1, device=flat.device)
    first = torch.where(bad.any(), torch.argmax(bad.to(torch.int32)), none) if flat.numel() else none
    words = torch.stack([bad.sum(), first]).to(torch.int32)
    return order.to(torch.int32), offsets.to(torch.int32), idx.to(torch.int32), words


def _launcher():
    """The compiled-function entry (built lazily: needs the CuTe DSL)."""
    if hasattr(_launcher, "fn"):
        return _launcher.fn
    from mok_cute.dsl.compile import dsl

    cutlass, cute = dsl()
    from cutlass import Constexpr, Int32

    warps = THREADS // 32

    @cute.jit
    def load(tk: cute.Tensor, g: Int32, lane: Int32, c1: Int32, bs: cute.Tensor, bad: cute.Tensor, E: Constexpr):
        """Buckets of the lane's routes ``g + u*32 + lane`` (u < LOADS, all loads first): the
        expert, E for no expert or an id outside [-1, E) (compared in the ids' own dtype), -1
        past the warp's chunk; ``bad[u]`` 1 for an id outside [-1, E)."""
        for u in cutlass.range_constexpr(LOADS):
            i = g + u * 32 + lane
            b = Int32(-1)
            x = Int32(0)
            if i < c1:
                v = tk[i]
                b = Int32(E)
                if v >= 0 and v < E:
                    b = Int32(v)
                if v < -1 or v >= E:
                    x = Int32(1)
            bs[u] = b
            bad[u] = x

    @cute.jit
    def peers(b: Int32, E: Constexpr) -> Int32:
        """The lanes whose bucket equals this lane's (``match.any``'s mask, from one ballot per bit
        of the bucket: ``bits`` with 2**bits > E + 1, so the -1 of lanes past the chunk matches no
        bucket)."""
        m = Int32(-1)
        for j in cutlass.range_constexpr((E + 1).bit_length()):
            bit = (b >> j) & 1
            m = m & (cute.arch.vote_ballot_sync(bit != 0) ^ (bit - 1))
        return m

    def start(E):
        """A plan kernel's ``(tidx, bidx, lane, warp)``, its ``E + 1`` buckets (the experts, then -1
        and bad ids) and its shared-memory allocator (traced at the call site)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        return tidx, bidx, tidx % 32, tidx // 32, E + 1, cutlass.memory.SmemAllocator()

    @cute.jit
    def warp_range(n: Int32, ctas: Int32, w: Int32):
        """``(c0, c1)``: warp ``w``'s routes (the CTAs' ranges in order, each warp's a whole number of
        batches of 32 * LOADS)."""
        bidx, _, _ = cute.arch.block_idx()
        per = 32 * LOADS
        chunk = (n + ctas * warps * per - 1) // (ctas * warps * per) * per
        lo = bidx * warps * chunk
        hi = cutlass.min(lo + warps * chunk, n)
        c0 = lo + w * chunk
        return c0, cutlass.min(c0 + chunk, hi)

    @cute.kernel
    def count_kernel(topk: cute.Tensor, idx_out: cute.Pointer, part: cute.Pointer, n: Int32, ctas: Int32,
                     E: Constexpr):
        """Pass 1 of CTA c: the sanitised ids of its routes, and ``part[c]`` = its routes per bucket, its
        count of ids outside [-1, E) and the first such route (n if none)."""
        tidx, bidx, lane, w, nb, smem = start(E)
        cnt = smem.allocate_tensor(Int32, cute.make_layout(nb), byte_alignment=16)
        misc = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
        idx = cute.make_tensor(idx_out, cute.make_layout(n))
        pt = cute.make_tensor(part, cute.make_layout(ctas * (nb + 2)))
        c0, c1 = warp_range(n, ctas, w)
        lt = cute.arch.lanemask_lt()
        for x in cutlass.range(tidx, nb, THREADS, unroll=1):
            cnt[x] = Int32(0)
        if tidx == 0:
            misc[0] = Int32(0)
            misc[1] = Int32(n)
        cute.arch.barrier()
        bs = cute.make_rmem_tensor((LOADS,), Int32)
        bad = cute.make_rmem_tensor((LOADS,), Int32)
        g = c0
        while g < c1:
            load(topk, g, lane, c1, bs, bad, E)
            for u in cutlass.range_constexpr(LOADS):
                i = g + u * 32 + lane
                b = bs[u]
                if b >= 0:
                    if bad[u] != 0:
                        cute.arch.atomic_add(misc.iterator, Int32(1), scope="cta")
                        cute.arch.atomic_min(misc.iterator + 1, i, scope="cta")
                    if b < E:
                        idx[i] = b
                    else:
                        idx[i] = Int32(-1)
                m = peers(b, E)
                if b >= 0 and (m & lt) == 0:
                    cute.arch.atomic_add(cnt.iterator + b, Int32(cute.arch.popc(m)), scope="cta")
            g += 32 * LOADS
        cute.arch.barrier()
        for x in cutlass.range(tidx, nb, THREADS, unroll=1):
            pt[bidx * (nb + 2) + x] = cnt[x]
        if tidx == 0:
            pt[bidx * (nb + 2) + nb] = misc[0]
            pt[bidx * (nb + 2) + nb + 1] = misc[1]

    @cute.kernel
    def scatter_kernel(topk: cute.Tensor, order: cute.Pointer, offsets: cute.Pointer, words: cute.Pointer,
                       part: cute.Pointer, n: Int32, ctas: Int32, E: Constexpr):
        """Pass 2 of CTA c: each of its routes' row = its bucket's start (all CTAs' counts, in bucket
        order) + the bucket's routes in CTAs before c + those in warps before this one + the lanes of
        its group below it; CTA 0 also writes the offsets and the error words."""
        tidx, bidx, lane, w, nb, smem = start(E)
        hist = smem.allocate_tensor(Int32, cute.make_layout(warps * nb), byte_alignment=16)
        base = smem.allocate_tensor(Int32, cute.make_layout(nb), byte_alignment=16)
        prev = smem.allocate_tensor(Int32, cute.make_layout(nb), byte_alignment=16)
        ordr = cute.make_tensor(order, cute.make_layout(n))
        offs = cute.make_tensor(offsets, cute.make_layout(nb))
        pt = cute.make_tensor(part, cute.make_layout(ctas * (nb + 2)))
        c0, c1 = warp_range(n, ctas, w)
        lt = cute.arch.lanemask_lt()
        for x in cutlass.range(tidx, warps * nb, THREADS, unroll=1):
            hist[x] = Int32(0)
        cute.arch.barrier()
        bs = cute.make_rmem_tensor((LOADS,), Int32)
        bad = cute.make_rmem_tensor((LOADS,), Int32)
        g = c0
        while g < c1:  # counts per (warp, bucket) of this CTA
            load(topk, g, lane, c1, bs, bad, E)
            for u in cutlass.range_constexpr(LOADS):
                b = bs[u]
                m = peers(b, E)
                if b >= 0 and (m & lt) == 0:
                    hist[w * nb + b] += Int32(cute.arch.popc(m))
                cute.arch.sync_warp()
            g += 32 * LOADS
        cute.arch.barrier()
        for b in cutlass.range(tidx, nb, THREADS, unroll=1):  # prefixes over warps, over CTAs; totals
            run = Int32(0)
            for ww in cutlass.range(warps, unroll=1):
                c = hist[ww * nb + b]
                hist[ww * nb + b] = run
                run += c
            tot = Int32(0)
            pre = Int32(0)
            for cc in cutlass.range(ctas, unroll=1):
                v = pt[cc * (nb + 2) + b]
                if cc < bidx:
                    pre += v
                tot += v
            base[b] = tot
            prev[b] = pre
        cute.arch.barrier()
        if tidx == 0:  # bucket totals -> starts, in bucket order
            run = Int32(0)
            for b in cutlass.range(nb, unroll=1):
                c = base[b]
                base[b] = run + prev[b]
                if bidx == 0:
                    offs[b] = run
                run += c
            if bidx == 0:
                nbad = Int32(0)
                first = Int32(n)
                for cc in cutlass.range(ctas, unroll=1):
                    nbad += pt[cc * (nb + 2) + nb]
                    first = cutlass.min(first, pt[cc * (nb + 2) + nb + 1])
                wd = cute.make_tensor(words, cute.make_layout(2))
                wd[0] = nbad
                wd[1] = Int32(-1)
                if nbad > 0:
                    wd[1] = first
        cute.arch.barrier()
        g = c0
        while g < c1:  # each route's row
            load(topk, g, lane, c1, bs, bad, E)
            for u in cutlass.range_constexpr(LOADS):
                b = bs[u]
                m = peers(b, E)
                if b >= 0:
                    ordr[base[b] + hist[w * nb + b] + Int32(cute.arch.popc(m & lt))] = g + u * 32 + lane
                cute.arch.sync_warp()
                if b >= 0 and (m & lt) == 0:
                    hist[w * nb + b] += Int32(cute.arch.popc(m))
                cute.arch.sync_warp()
            g += 32 * LOADS

    @cute.jit
    def plan_host(topk: cute.Tensor, order: cute.Pointer, offsets: cute.Pointer, idx_out: cute.Pointer,
                  words: cute.Pointer, part: cute.Pointer, n: Int32, ctas: Int32, stream, E: Constexpr):
        count_kernel(topk, idx_out, part, n, ctas, E).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], smem=(E + 1) * 4 + 64, stream=stream)
        scatter_kernel(topk, order, offsets, words, part, n, ctas, E).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], smem=(warps + 2) * (E + 1) * 4 + 64, stream=stream)

    _launcher.fn = plan_host
    return plan_host


def compile_local_plan(arch: str, E: int, id_dtype: str = "i32", inspect: bool = False):
    """Compile the planner for ``arch``, E experts and int32 (``"i32"``) or int64 ids;
    ``(compiled, report | None)``."""
    from mok_cute.dsl.compile import compile_kernel, dsl
    from mok_cute.dsl.host import fake_ptr, fake_stream

    cutlass, cute = dsl()
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"E must be in [1, {MAX_EXPERTS}], got {E}")
    dt = {"i32": cutlass.Int32, "i64": cutlass.Int64}[id_dtype]
    topk = cute.runtime.make_fake_tensor(dt, (cute.sym_int(),), stride=(1,), assumed_align=dt.width // 8)
    i32 = fake_ptr("i32")
    return compile_kernel(_launcher(), topk, i32, i32, i32, i32, i32, cutlass.Int32(1), cutlass.Int32(1), fake_stream(),
                          E, arch=arch, inspect=inspect)


def plan_ctas(n: int) -> int:
    """CTAs of the planner for ``n`` routes: one per :data:`CTA_ROUTES`, at most :data:`MAX_CTAS`."""
    return max(1, min(MAX_CTAS, -(-n // CTA_ROUTES)))


def plan_local(topk_idx: torch.Tensor, num_experts: int):
    """``(order, offsets, idx, words)`` (see the module doc) for ``topk_idx`` [T, k] on a CUDA
    device, from one launch on the current stream (no host sync). T*k < 2**31, E <= MAX_EXPERTS."""
    from mok_cute.dsl.compile import compile_cached, device_arch
    from mok_cute.dsl.host import current_stream, dptr
    from mok_cute.dsl.tensors import _cute_tensor

    dev, arch = device_arch(topk_idx.device)
    n = topk_idx.numel()
    kind = {torch.int32: "i32", torch.int64: "i64"}[topk_idx.dtype]
    fn = compile_cached(("schedule.local_plan", arch, num_experts, kind),
                        lambda: compile_local_plan(arch, num_experts, kind)[0])
    i32 = dict(dtype=torch.int32, device=topk_idx.device)
    order, idx, words = torch.empty(n, **i32), torch.empty(n, **i32), torch.empty(2, **i32)
    offsets = torch.empty(num_experts + 1, **i32)
    if n:
        from cutlass import Int32

        ctas = plan_ctas(n)
        part = torch.empty(ctas * (num_experts + 3), **i32)  # per CTA: bucket counts, bad ids, first bad route
        fn(_cute_tensor(topk_idx.reshape(-1), align=topk_idx.element_size()), dptr(order), dptr(offsets), dptr(idx),
           dptr(words), dptr(part), Int32(n), Int32(ctas), current_stream(dev))
    else:
        offsets.zero_()
        words.fill_(-1)
        words[0].zero_()
    return order, offsets, idx, words

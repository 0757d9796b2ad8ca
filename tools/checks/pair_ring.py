"""Device check of the CTA pair's task ring (``kernels/sm100/task_ring.py``: ``make_pair``,
``publish_pair``, ``take_pair``) on any GPU with clusters: the ring is arch-neutral (``st.async``
into the peer's slot, remote ``mbarrier`` arrives; no tcgen05), so a probe kernel compiled for
this device runs it with the SM100 megakernels' roles and arrival counts. Clusters of two CTAs of
192 threads: the leader's warp 5 claims ids from a global ticket and publishes each to both CTAs
(the last, ``>= n_tasks``, stops everyone); the leader's warp 4 and the peer's warp 5 and both
CTAs' warps 0-3 take every id (lane 0 logs it), the epilogue warps sleeping a few hundred ns on
some ids so that the ring fills and the leader waits for the slowest reader of either CTA.

Checked: in every pair the ten reading warps logged the same sequence, ending with the stop id;
over all pairs the ids below n_tasks were taken exactly once each (none lost, none twice). Three
task counts (0, a few per pair, thousands), five repeats each.
"""

import torch

from tools.checks.common import Row

THREADS = 192
READERS = ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3), (1, 5))  # (cta_v, warp)


def _probe():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from mok_cute.kernels.sm100 import task_ring
    from mok_cute.kernels.sm90 import persistent

    class Probe:
        @cute.jit
        def __call__(self, mTicket: cute.Tensor, mLog: cute.Tensor, n_tasks: Int32, num_ctas: Int32, stream):
            self.storage = cute.struct(type("PairRingStorage", (), {"__annotations__": dict(task_ring.STORAGE)}))
            self.kernel(mTicket, mLog, n_tasks).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1],
                                                       cluster=[2, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mTicket: cute.Tensor, mLog: cute.Tensor, n_tasks: Int32):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, _, _ = cute.arch.block_idx()
            cta_v = bidx % 2
            storage = cutlass.memory.SmemAllocator().allocate(self.storage)
            bars, sTask = task_ring.make_pair(storage)
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
            lane = cute.arch.lane_idx()
            role = Int32(0)  # 1: the leader's claimer, 2: a reader (the ring's users in the megakernels)
            if warp < 4:
                role = Int32(2)
            elif warp == 4 + cta_v:
                role = Int32(2)
            elif warp == 5:
                role = Int32(1)
            if role == 1:
                state = task_ring.producer_state()
                t = persistent.claim(mTicket.iterator)
                state = task_ring.publish_pair(bars, state, sTask, t)
                while t < n_tasks:
                    t = persistent.claim(mTicket.iterator)
                    state = task_ring.publish_pair(bars, state, sTask, t)
            if role == 2:
                state = task_ring.consumer_state()
                seq = Int32(0)
                t, state = task_ring.take_pair(bars, state, sTask)
                row = (bidx * 6 + warp) * (n_tasks + 1)  # mLog: flat [num_ctas, 6, n_tasks + 1]
                if lane == 0:
                    mLog[row + seq] = t
                while t < n_tasks:
                    if t % 3 == warp % 3:  # a slow reader now and then
                        until = cute.arch.globaltimer() + cutlass.Int64(200 + 100 * (t % 5))
                        while cute.arch.globaltimer() < until:
                            pass
                    seq += 1
                    t, state = task_ring.take_pair(bars, state, sTask)
                    if lane == 0:
                        mLog[row + seq] = t
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    return Probe()


def compiled(arch: str, inspect: bool = False):
    """``(compiled, report)`` of the probe for ``arch`` (any arch with clusters: sm_90a, sm_100a ..)."""
    import cutlass
    import cutlass.cute as cute

    from mok_cute.dsl.compile import compile_cached, compile_kernel

    def build():
        ticket = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        log = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        return compile_kernel(_probe(), ticket, log, cutlass.Int32(1), cutlass.Int32(2),
                              cute.runtime.make_fake_stream(), arch=arch, inspect=inspect)
    return compile_cached(("pair_ring_probe", arch, inspect), build)


def verify(log: torch.Tensor, n_tasks: int) -> str:
    """'' if ``log`` [num_ctas, 6, n_tasks + 1] (int32, -1 where unwritten) shows the contract of
    the module doc, else what broke."""
    taken = []
    for pair in range(log.shape[0] // 2):
        seqs = [log[2 * pair + v, w].tolist() for v, w in READERS]
        first = seqs[0]
        for (v, w), s in zip(READERS, seqs):
            if s != first:
                i = next(i for i, (a, b) in enumerate(zip(s, first)) if a != b)
                return f"pair {pair}: CTA {v} warp {w} logged {s[i:i + 3]} at {i}, CTA 0 warp 0 {first[i:i + 3]}"
        stop = next((i for i, t in enumerate(first) if t >= n_tasks), None)
        if stop is None or any(t != -1 for t in first[stop + 1:]):
            return f"pair {pair}: no stop id, or ids after it"
        taken += first[:stop]
    if sorted(taken) != list(range(n_tasks)):
        return f"{len(taken)} ids taken, {len(set(taken))} distinct, for {n_tasks} tasks"
    return ""


def run(ctx) -> list[Row]:
    from cutlass import Int32

    from mok_cute.dsl.compile import arch_of_device
    from mok_cute.dsl.host import sm_count
    from mok_cute.dsl.launch import GraphLauncher

    dev = ctx.device
    arch = arch_of_device(dev)
    launcher = GraphLauncher(compiled(arch)[0])
    num_ctas = sm_count(dev) - sm_count(dev) % 2
    rows = []
    for n_tasks in (0, 3 * num_ctas // 2, 20000):
        bad, t_us = "", []
        for rep in range(5):
            ticket = torch.zeros(1, dtype=torch.int32, device=dev)
            log = torch.full((num_ctas, 6, n_tasks + 1), -1, dtype=torch.int32, device=dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launcher.launch_tensors(dev.index or 0, (ticket, log.view(-1)), (Int32(n_tasks), Int32(num_ctas)),
                                    (n_tasks, num_ctas), (), direct=())
            end.record()
            torch.cuda.synchronize()
            t_us.append(start.elapsed_time(end) * 1e3)
            bad = bad or verify(log.cpu(), n_tasks)
        rows.append(Row(f"pair_ring: {num_ctas // 2} pairs, {n_tasks} tasks x5", bitwise=not bad,
                        time_us=sorted(t_us)[2], ok=not bad, note=bad or "every pair's readers agree, ids once"))
    return rows

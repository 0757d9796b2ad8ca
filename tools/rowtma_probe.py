"""Row-gather TMA experiment: 128 token rows of x [T, H] bf16 (ids idx) -> one 128x64 swizzled
A stage (the wgmma K-major SW128 layout), by (A) one elected lane issuing 128 one-row TMA boxes,
(B) 32 lanes issuing 4 each through inline PTX with the descriptor copied to global memory.
Read back through the swizzled layout and compare with x[idx, k*64:(k+1)*64]."""
import sys
import torch
import cutlass, cutlass.cute as cute
from cutlass import Int32, Int64
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum
from mok_cute.dsl.compile import compile_kernel
from mok_cute.dsl.tensors import _fake_2d


def _layouts():
    staged = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, 256, 64), cutlass.BFloat16, 1)
    one = cute.slice_(staged, (None, None, 0))
    return staged, cute.make_composed_layout(one.inner, 0, cute.make_layout((1, 64), stride=(64, 1)))


class K:
    def __init__(self, lanes: bool):
        self.lanes = lanes

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor, mDesc: cute.Tensor, kt: Int32, stream):
        _, row_l = _layouts()
        atom, coord = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX, row_l, (1, 64))
        self.kernel(atom, coord, mIdx, mOut, mDesc, kt).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, atom: cute.CopyAtom, coord: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor,
               mDesc: cute.Tensor, kt: Int32):
        @cute.struct
        class S:
            bar: cute.struct.MemRange[cutlass.Int64, 2]
            a: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, 128 * 64], 1024]
        st = cutlass.utils.SmemAllocator().allocate(S)
        staged, row_l = _layouts()
        sA = st.a.get_tensor(staged.outer, swizzle=staged.inner)
        tidx, _, _ = cute.arch.thread_idx()
        bar = st.bar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if tidx < 32:
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, 128 * 128)
            if cutlass.const_expr(not self.lanes):
                for r in cutlass.range(128, unroll=1):
                    dst = cute.make_tensor(st.a.data_ptr() + r * 64, row_l)
                    g = cute.local_tile(coord, (1, 64), (mIdx[r], kt))
                    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                   cute.group_modes(g, 0, 2))
                    cute.copy(atom, tG, tS, tma_bar_ptr=bar)
            else:
                desc = mDesc.iterator
                if tidx == 0:
                    cpasync.copy_tensormap(atom, desc)
                    cpasync.fence_tma_desc_release()
                cute.arch.sync_warp()
                cpasync.fence_tma_desc_acquire(desc)
                base = st.a.data_ptr().toint()
                mb = bar.toint()
                for j in cutlass.range_constexpr(4):
                    r = tidx + 32 * j
                    cute.arch.inline_ptx(
                        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                        "[{$r0}], [{$r1}, {{$r2}, {$r3}}], [{$r4}];",
                        read_only_args=[base + r * 128, desc.toint(), kt * 64, mIdx[r], mb])
        cute.arch.mbarrier_wait(bar, 0)
        cute.arch.barrier()
        for i in cutlass.range(tidx, 128 * 64, 128):
            mOut[i // 64, i % 64] = sA[(i // 64, i % 64, 0)]


def build(lanes):
    x = _fake_2d(cutlass.BFloat16, cute.sym_int(), cute.sym_int(divisibility=8))
    idx = cute.runtime.make_fake_tensor(Int32, (128,), stride=(1,), assumed_align=4)
    out = _fake_2d(cutlass.BFloat16, cute.sym_int(), cute.sym_int(divisibility=8))
    desc = cute.runtime.make_fake_tensor(Int64, (16,), stride=(1,), assumed_align=128)
    arch = "sm_90a"
    return compile_kernel(K(lanes), x, idx, out, desc, Int32(0), cute.runtime.make_fake_stream(), arch=arch,
                          inspect=True)


if __name__ == "__main__":
    for lanes in (False, True):
        c, rep = build(lanes)
        ptx = rep.ptx
        print("lanes" if lanes else "elected", "spills", rep.total_spill_bytes,
              [l.strip()[:110] for l in ptx.splitlines() if "cp.async.bulk.tensor" in l][:2])
        if not torch.cuda.is_available():
            continue
        import cuda.bindings.driver as cuda
        from mok_cute.dsl.launch import _Desc
        T, H = 1000, 512
        x = torch.randn(T, H, device="cuda").bfloat16()
        idx = torch.randint(0, T, (128,), device="cuda", dtype=torch.int32)
        out = torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16)
        desc = torch.zeros(16, device="cuda", dtype=torch.int64)
        import time
        for kt in (0, 3, 7):
            c(_Desc(x), _Desc(idx), _Desc(out), _Desc(desc), Int32(kt),
              cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            torch.cuda.synchronize()
            want = x[idx.long(), kt * 64:(kt + 1) * 64]
            print(f"  kt {kt}: equal {torch.equal(out, want)}; rows equal {int((out == want).all(1).sum())}/128")

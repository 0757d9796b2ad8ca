"""Device check of the SM100 fused backward's MXFP8 gather step (``kernels/sm100/mx_gather.py``) on
any GPU: its code is arch-neutral (no tcgen05), so a probe kernel compiled for this device runs
``quantize_tile`` on every routed m-tile of bf16 dy / x rows, one CTA per m-tile (the comm CTAs'
call, both passes), and every output is compared bitwise with what the unfused SM100 MXFP8
backward's host makes from the same rows (``fused_bwd._mx_operands``: the reference quantizers,
``layouts.pack_row_scales``, ``token_rows``, ``pack_token_scales_device``): dy's e4m3 rows along
H and their blocked row scales, dy's and x's e4m3 token rows and token scales. Shapes: H 1024 and
H 320 (partial scale atoms), skewed experts with an empty and a one-row expert, rows past the
experts' (routes without one), values with per-block magnitudes 2^-60..2^60 and a NaN row. Both
m-tile heights: 128 rows, and 256 (the ``cta_group::2`` megakernels': two scale atom rows per tile).
"""

import torch

from tools.checks.common import Row

THREADS = 256


def _probe(tile_m: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from mok_cute.kernels.route_grad_row import MxTile
    from mok_cute.kernels.sm100.mx_gather import quantize_tile
    from mok_cute.schedule.fused_tasks import mtile

    class Probe:
        @cute.jit
        def __call__(self, mDy, mX, mOffsets, mDyq, mDysf, mDyt, mDytsf, mXt, mXtsf, n_tiles: Int32, stream):
            self.kernel(mDy, mX, mOffsets, (mDyq, mDysf, mDyt, mDytsf, mXt, mXtsf)).launch(
                grid=[n_tiles, 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mDy, mX, mOffsets, ops: tuple):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            row0, rows, e, b = mtile(mOffsets, mOffsets.shape[0] - 1, tile_m, bidx, Int32(0), Int32(0))
            hc = mDy.shape[1] // 8
            for xpass in cutlass.range_constexpr(2):
                quantize_tile(MxTile(tidx, tidx // 32, tidx % 32, THREADS, mDy, mX, row0, rows, tile_m, hc, mOffsets,
                                     e, bidx - b), xpass, ops)

    return Probe()


def _compiled(arch: str, tile_m: int = 128):
    import cutlass
    import cutlass.cute as cute

    from mok_cute.dsl.compile import compile_cached, compile_kernel
    from mok_cute.dsl.tensors import _fake_2d

    def build():
        m, hid = cute.sym_int(), cute.sym_int(divisibility=64)
        u8 = lambda: cute.runtime.make_fake_tensor(cutlass.Uint8, (cute.sym_int(),), stride=(1,),  # noqa: E731
                                                    assumed_align=4)
        f8 = cutlass.Float8E4M3FN
        offs = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        bf = cutlass.BFloat16
        return compile_kernel(_probe(tile_m), _fake_2d(bf, m, hid), _fake_2d(bf, m, hid), offs,
                              _fake_2d(f8, m, hid), u8(), _fake_2d(f8, m, hid), u8(), _fake_2d(f8, m, hid), u8(),
                              cutlass.Int32(1), cute.runtime.make_fake_stream(), arch=arch)[0]
    return compile_cached(("mx_gather_probe", arch, tile_m), build)


def _rows(m: int, hid: int, gen, dev) -> torch.Tensor:
    k = torch.randint(-60, 61, (m // 32 + 1, hid // 32), generator=gen).float()
    mag = torch.exp2(k).repeat_interleave(32, 0)[:m].repeat_interleave(32, 1)
    x = (torch.randn(m, hid, generator=gen) * mag).bfloat16()
    x[5, 40] = float("nan")  # a NaN block (its scale 0xFF, its bytes 0x7F)
    return x.to(dev)


def _case(name: str, offs: list[int], m: int, hid: int, seed: int, dev, tile_m: int = 128) -> list[Row]:
    from cutlass import Int32

    from mok_cute import reference as R
    from mok_cute.dsl.compile import arch_of_device
    from mok_cute.dsl.launch import GraphLauncher
    from mok_cute.kernels.sm100 import layouts as lay
    from mok_cute.schedule.fused_tasks import mtile_rows

    gen = torch.Generator().manual_seed(seed)
    dy, x = _rows(m, hid, gen, dev), _rows(m, hid, gen, dev)
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    e = len(offs) - 1
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    tok_kb = lay.grouped_sf_rows(m, e) // 32
    out = dict(dyq=torch.full((m, hid), 0x55, dtype=u8, device=dev).view(f8),
               dysf=torch.zeros(lay.sf_bytes(lay.grouped_sf_rows(m, e), hid // 32), dtype=u8, device=dev),
               dyt=torch.zeros((m, hid), dtype=f8, device=dev), dytsf=torch.zeros(lay.sf_bytes(hid, tok_kb), dtype=u8,
                                                                               device=dev),
               xt=torch.zeros((m, hid), dtype=f8, device=dev), xtsf=torch.zeros(lay.sf_bytes(hid, tok_kb), dtype=u8,
                                                                             device=dev))
    n_tiles = len(mtile_rows(offs, tile_m))
    launcher = GraphLauncher(_compiled(arch_of_device(dev), tile_m))
    launcher.launch_tensors(dev.index or 0, (dy, x, offsets, *out.values()), (Int32(n_tiles),), (n_tiles,), ())
    torch.cuda.synchronize()
    valid = offs[-1]
    dq, ds = R.mxfp8_quantize(dy.cpu(), -1)
    used = (valid // 128 + e) * -(-hid // 128) * lay.SF_ATOM_BYTES  # the experts' atom rows
    want = {"dy along H": (dq[:valid].view(u8), out["dyq"][:valid].view(u8).cpu()),
            "dy row scales": (lay.pack_row_scales(ds, offsets.cpu())[:used], out["dysf"][:used].cpu())}
    for what, src, dst, dsf in (("dy", dy, "dyt", "dytsf"), ("x", x, "xt", "xtsf")):
        data_t, scales = R.mxfp8_quantize_tokens(src.cpu(), offsets.cpu())
        want[f"{what} token rows"] = (lay.token_rows(data_t, offsets.cpu(), m).view(u8), out[dst].view(u8).cpu())
        want[f"{what} token scales"] = (lay.pack_token_scales_device(scales, offsets.cpu(), m), out[dsf].cpu())
    same = {k: torch.equal(a, b) for k, (a, b) in want.items()}
    return [Row(f"mx_gather {name} tile_m {tile_m}", bitwise=all(same.values()), ok=all(same.values()),
                note=f"{n_tiles} m-tiles, H {hid}; equal: {same}")]


def run(ctx) -> list[Row]:
    dev = ctx.device
    return [row for tile_m in (128, 256) for row in
            _case("skewed H1024", [0, 700, 700, 701, 1000], 1100, 1024, 1, dev, tile_m)
            + _case("uniform H320", [0, 256, 512, 768], 800, 320, 2, dev, tile_m)]

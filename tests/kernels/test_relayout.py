"""relayout: the tiled transposes of expert weights (gpt-oss's layouts to the kernels' and back) compile for SM90
and SM100 to 16-byte global loads and stores through one shared tile, refuse bad arguments before any launch, take
the torch reference on CPU tensors, and the kernel's tiling (mirrored here thread by thread) writes every output
element once, with the reference's value, edge tiles included. The device run is tools/checks/relayout.py."""
import itertools

import pytest
import torch

from mok_cute.kernels import relayout as R


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("mode", R.MODES)
def test_compiles_to_vector_copies_through_one_shared_tile(arch, mode):
    _, rep = R.compiled_relayout(arch, mode)
    assert rep.total_spill_bytes == 0
    assert rep.ptx.count("ld.global.v4") == R._PER_THREAD and rep.ptx.count("st.global.v4") == R._PER_THREAD
    assert rep.ptx.count("ld.shared.v4") == R._PER_THREAD and rep.ptx.count("bar.sync") == 1
    assert rep.ptx.count("st.shared.b16") == R._PER_THREAD * R._VEC


def _chunks():
    """Every (thread, j) of a CTA with its tile row and chunk, as the kernel's ``_chunk``."""
    for tid, j in itertools.product(range(R._THREADS), range(R._PER_THREAD)):
        yield divmod(tid + j * R._THREADS, R._ROW_CHUNKS)


def _row(r: int, dim: int, interleaved: bool) -> int:
    return (r % 2) * (dim // 2) + r // 2 if interleaved else r


def _kernel_mirror(inp: torch.Tensor, mode: str) -> torch.Tensor:
    """The kernel's index arithmetic, thread by thread (grid, tile, swizzle, masks), on int64 element ids; -1 where
    nothing was written; raises if an element is written twice."""
    e_n, b_n, a_n = inp.shape
    out = torch.full((e_n, a_n, b_n), -1, dtype=torch.int64)
    flat_in = inp.reshape(-1, R._VEC)
    for e, ta, tb in itertools.product(range(e_n), range(-(-a_n // R._TILE)), range(-(-b_n // R._TILE))):
        a0, b0 = ta * R._TILE, tb * R._TILE
        tile = {}
        for bb, v in _chunks():
            if b0 + bb < b_n and a0 + v * R._VEC < a_n:
                chunk = flat_in[(e * b_n + _row(b0 + bb, b_n, mode == "interleave")) * (a_n // R._VEC)
                                + a0 // R._VEC + v]
                for i in range(R._VEC):
                    tile[((v * R._VEC + i) * R._ROW_CHUNKS + ((bb // R._VEC) ^ v), bb % R._VEC)] = int(chunk[i])
        for aa, w in _chunks():
            if a0 + aa < a_n and b0 + w * R._VEC < b_n:
                dst = out[e, _row(a0 + aa, a_n, mode == "deinterleave"), b0 + w * R._VEC: b0 + (w + 1) * R._VEC]
                assert torch.all(dst == -1), "an element written twice"
                dst.copy_(torch.tensor([tile[(aa * R._ROW_CHUNKS + (w ^ (aa // R._VEC)), i)]
                                        for i in range(R._VEC)]))
    return out


@pytest.mark.parametrize("mode", R.MODES)
@pytest.mark.parametrize("shape", [(2, 64, 64), (2, 136, 72), (1, 8, 200)])
def test_kernel_tiling_writes_every_element_once_with_the_reference_value(mode, shape):
    inp = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    got = _kernel_mirror(inp, mode)
    assert torch.equal(got, R.reference_relayout(inp, mode))


def test_reference_modes():
    """The three modes on gpt-oss's layouts: gate_up [E, H, 2I] interleaved -> [E, 2I, H] halves and back; a
    [E, I, H] down_proj to [E, H, I]."""
    e, h, i = 2, 16, 8
    gate_up = torch.randn(e, h, 2 * i)
    halves = R.reference_relayout(gate_up, "deinterleave")
    assert torch.equal(halves[:, :i], gate_up[:, :, 0::2].transpose(1, 2))
    assert torch.equal(halves[:, i:], gate_up[:, :, 1::2].transpose(1, 2))
    assert torch.equal(R.reference_relayout(halves, "interleave"), gate_up)
    down = torch.randn(e, i, h)
    assert torch.equal(R.reference_relayout(down, "plain"), down.transpose(1, 2))


def test_cpu_path_and_out():
    inp = torch.randn(3, 24, 16).bfloat16()
    for mode in R.MODES:
        want = R.reference_relayout(inp, mode)
        assert torch.equal(R.relayout(inp, mode), want)
        out = torch.empty(3, 16, 24, dtype=torch.bfloat16)
        assert R.relayout(inp, mode, out=out) is out and torch.equal(out, want)


def test_bad_arguments_name_themselves():
    good = torch.zeros(2, 16, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode must be one of"):
        R.relayout(good, "transpose")
    with pytest.raises(TypeError, match="inp must be a 3-D torch.bfloat16"):
        R.relayout(good.float(), "plain")
    with pytest.raises(ValueError, match="multiples of 8"):
        R.relayout(torch.zeros(2, 16, 20, dtype=torch.bfloat16), "plain")
    with pytest.raises(ValueError, match="inp must be contiguous"):
        R.relayout(good.transpose(1, 2), "plain")
    with pytest.raises(ValueError, match=r"out must be contiguous.*\(2, 24, 16\)"):
        R.relayout(good, "plain", out=torch.zeros(2, 16, 24, dtype=torch.bfloat16))
    assert R.relayout_fits(good) and not R.relayout_fits(good.transpose(1, 2)) and not R.relayout_fits(good.float())


def test_device_check_is_registered():
    from tools.gpu_check import check_names

    assert "relayout" in check_names()

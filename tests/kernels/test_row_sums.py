"""row_sums: the per-expert row sums (expert bias gradient) compile for SM90 and SM100 to the contract's
instructions, refuse bad arguments before any launch, take the reference on CPU tensors, and the device check's
fp32 mirror (tools/checks/row_sums.py) is the row-order fp32 sum within its stated tolerance of the reference."""
import pytest
import torch

from mok_cute import reference
from mok_cute.kernels import row_sums
from tools.checks import row_sums as check
from tools.gpu_check import check_names


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_to_vector_loads_and_plain_adds(arch):
    """0 spills; 16-byte loads (the unrolled rows plus the tail's), one 16-byte store, fp32 adds with no FMA or
    multiply (nothing contracted), one rn conversion to bf16 pairs per pair of columns."""
    _, rep = row_sums.compiled_row_sums(arch)
    assert rep.total_spill_bytes == 0
    assert rep.ptx.count("ld.global.v4") == row_sums._UNROLL + 1
    assert rep.ptx.count("st.global.v4") == 1 and rep.ptx.count("cvt.rn.bf16x2.f32") == 4
    assert rep.has("add.f32")
    for inst in ("fma.", "mul.f32", "atom.", "red."):
        assert not rep.has(inst), inst


def _problem(m=40, n=24, counts=(5, 0, 17, 0, 18), seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(m, n, generator=g) * 2.0 ** torch.randint(-4, 4, (m, 1), generator=g)).bfloat16()
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return rows, offsets


def test_cpu_path_is_the_reference():
    rows, offsets = _problem()
    want = reference.grouped_row_sums(rows, offsets)
    assert torch.equal(row_sums.expert_row_sums(rows, offsets), want)
    assert torch.all(want[1] == 0) and torch.all(want[3] == 0)
    out = torch.full((5, 24), float("nan"), dtype=torch.bfloat16)
    assert row_sums.expert_row_sums(rows, offsets, out=out) is out and torch.equal(out, want)
    dgu = torch.cat([rows, -rows], 1)  # the two halves of a [M, 2I] tensor, as column slices
    assert torch.equal(row_sums.expert_row_sums(dgu[:, 24:], offsets), reference.grouped_row_sums(-rows, offsets))


def test_check_mirror_is_the_row_order_fp32_sum():
    """The device check's mirror: fp32 adds in row order, 0 for empty experts, within TOL of the reference."""
    rows, offsets = _problem(m=300, n=16, counts=(0, 120, 3, 0, 170, 7))
    got = check.fp32_mirror(rows, offsets)
    offs = offsets.tolist()
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        acc = torch.zeros(16)
        for p in range(lo, hi):
            acc = acc + rows[p].float()
        assert torch.equal(got[e], acc.bfloat16()), e
        scale = rows[lo:hi].double().abs().sum(0).clamp_min(1e-30)
        want = reference.grouped_row_sums(rows, offsets)[e].double()
        assert torch.all((got[e].double() - want).abs() <= check.TOL * scale), e
    assert "row_sums" in check_names() and callable(check.run)


def test_validation(forbid):
    """Bad arguments raise TypeError / ValueError naming them, before any compile or launch."""
    forbid(row_sums, "compiled_row_sums", "current_stream", "dptr")
    rows, offsets = _problem()
    cases = [
        (TypeError, "rows must be a 2-D torch.bfloat16", (rows.float(), offsets)),
        (TypeError, "rows must be a 2-D", (rows[0], offsets)),
        (TypeError, "offsets must be a 1-D torch.int32", (rows, offsets.long())),
        (TypeError, "offsets must be", (rows, [0, 40])),
        (ValueError, "multiple of 8", (rows[:, :20], offsets)),
        (ValueError, "unit column stride", (rows.t().contiguous().t(), offsets)),
        (ValueError, "row stride", (torch.zeros(40, 36, dtype=torch.bfloat16)[:, :24], offsets)),
        (ValueError, "16-byte aligned", (torch.zeros(40, 32, dtype=torch.bfloat16)[:, 4:28], offsets)),
        (ValueError, "E\\+1 >= 2", (rows, offsets[:1])),
        (ValueError, "offsets must be contiguous", (rows, torch.zeros(12, dtype=torch.int32)[::2])),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            row_sums.expert_row_sums(*args)
    with pytest.raises(TypeError, match="out must be a torch.bfloat16"):
        row_sums.expert_row_sums(rows, offsets, out=torch.zeros(5, 24))
    with pytest.raises(ValueError, match=r"out must be contiguous.*\(5, 24\)"):
        row_sums.expert_row_sums(rows, offsets, out=torch.zeros(4, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        row_sums.expert_row_sums(rows, offsets, out=torch.zeros(24, 5, dtype=torch.bfloat16).t())
    meta = dict(dtype=torch.bfloat16, device="meta")  # another device than rows' (no CUDA here)
    with pytest.raises(ValueError, match="offsets must be on rows' device"):
        row_sums.expert_row_sums(rows, offsets.to("meta"))
    with pytest.raises(ValueError, match="out must be on rows' device"):
        row_sums.expert_row_sums(rows, offsets, out=torch.zeros(5, 24, **meta))

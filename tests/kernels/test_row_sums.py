"""row_sums: the per-expert row sums (expert bias gradient) compile for SM90 and SM100 to the contract's
instructions, refuse bad arguments before any launch, take the reference on CPU tensors, and the device check's
fp32 mirror (tools/checks/row_sums.py) is the kernel's fixed-order fp32 sum (8 interleaved row stripes, each in row
order, added in stripe order) within its stated tolerance of the reference."""
import re

import pytest
import torch

from mok_cute import reference
from mok_cute.kernels import row_sums
from tools.checks import row_sums as check
from tools.gpu_check import check_names


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_to_vector_loads_and_plain_adds(arch):
    """0 spills; 16-byte loads (a round of rows before the pipelined loop and one in it), one 16-byte store, fp32 adds
    with no FMA or multiply (nothing contracted), one rn conversion to bf16 pairs per pair of columns; the stripes'
    partials through shared memory across one barrier, no atomics. The registers hold a whole round of loads in
    flight (ptxas interleaving the loads with the adds, as it did before the loop was pipelined, needs ~32)."""
    _, rep = row_sums.compiled_row_sums(arch)
    assert rep.total_spill_bytes == 0
    assert rep.ptx.count("ld.global.v4") == 2 * row_sums._UNROLL
    assert rep.ptx.count("st.global.v4") == 1 and rep.ptx.count("cvt.rn.bf16x2.f32") == 4
    assert rep.ptx.count("bar.sync") == 1  # 16-byte shared stores and loads (SM100: as v2.b64 for the packed adds)
    assert rep.ptx.count("st.shared.v") == 2 and rep.ptx.count("ld.shared.v") == 2 * (row_sums._WARPS - 1)
    assert rep.max_registers >= 4 * row_sums._UNROLL + row_sums._VEC
    assert rep.has("add.f32")
    for inst in ("fma.", "mul.f32"):
        assert not rep.has(inst), inst
    assert not re.search(r"\b(atom|red)\.", rep.ptx)


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


def _striped_sums(rows, offsets, stripes=8):
    """The kernel's order, one row at a time: stripe w of an expert sums its rows lo + w, lo + w + 8, ... in order
    from fp32 0; the stripes are added in order (0, 1, ..., 7); one rounding to bf16."""
    offs = offsets.tolist()
    out = []
    for lo, hi in zip(offs[:-1], offs[1:]):
        part = [torch.zeros(rows.shape[1]) for _ in range(stripes)]
        for p in range(lo, hi):
            part[(p - lo) % stripes] = part[(p - lo) % stripes] + rows[p].float()
        acc = part[0]
        for s in part[1:]:
            acc = acc + s
        out.append(acc.bfloat16())
    return torch.stack(out)


def test_check_mirror_is_the_striped_fp32_sum():
    """The device check's mirror: the kernel's fp32 adds (8 row stripes, each in row order, then in stripe order),
    0 for empty experts, within TOL of the reference; experts of fewer rows than stripes, of a multiple of the
    kernel's round (64 rows) and of more with a partial last round."""
    counts = (0, 120, 3, 0, 170, 7, 64, 8, 1)
    rows, offsets = _problem(m=sum(counts) + 5, n=16, counts=counts)
    assert check.STRIPES == row_sums._WARPS and 64 == row_sums._WARPS * row_sums._UNROLL
    got = check.fp32_mirror(rows, offsets)
    assert torch.equal(got.view(torch.int16), _striped_sums(rows, offsets).view(torch.int16))
    offs = offsets.tolist()
    want = reference.grouped_row_sums(rows, offsets)
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi == lo:
            assert torch.all(got[e].view(torch.int16) == 0), e
        scale = rows[lo:hi].double().abs().sum(0).clamp_min(1e-30)
        assert torch.all((got[e].double() - want[e].double()).abs() <= check.TOL * scale), e
    # the order is not plain row order: 2^24 + 1 rounds to 2^24 in fp32, so row order gives 0 where stripes give 7
    big = torch.tensor([2.0 ** 24, *[1.0] * 7, -(2.0 ** 24)]).bfloat16()[:, None].expand(9, 8).contiguous()
    nine = torch.tensor([0, 9], dtype=torch.int32)
    assert torch.all(_striped_sums(big, nine, stripes=1) == 0) and torch.all(check.fp32_mirror(big, nine) == 7)
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

"""Host-side SM100 rules: the 128x4 blocked MXFP8 scale layout (against a brute-force
construction from the PTX description and against reference.mxfp8_quantize scales), the
per-expert grouped placements, TMEM and shared-memory budgets, and tile scheduling over
experts (group_tiles' Python mirror) for the SM100 tile shapes."""
import random

import pytest
import torch

from mok_cute import reference
from mok_cute.kernels.sm100 import layouts as lay
from mok_cute.schedule import group_tiles
from conftest import offsets_from


def _brute_blocked(scales: torch.Tensor) -> torch.Tensor:
    """PTX 'scale factor layout': 128 x 4 atoms, K atoms fastest; in an atom the byte of
    (row, kb) is 16 * (row % 32) + 4 * ((row % 128) // 32) + kb % 4. Built element by element."""
    rows, kbs = scales.shape
    rb, cb = -(-rows // 128), -(-kbs // 4)
    out = torch.zeros(rb * cb * 512, dtype=torch.uint8)
    for r in range(rb * 128):
        for k in range(cb * 4):
            atom = (r // 128) * cb + k // 4
            byte = atom * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + k % 4
            out[byte] = scales[r, k] if r < rows and k < kbs else 0
    return out


@pytest.mark.parametrize("rows, kbs", [(128, 4), (300, 6), (1, 1), (257, 9)])
def test_blocked_layout_brute_force(rows, kbs):
    s = torch.randint(0, 255, (rows, kbs), dtype=torch.uint8)
    blocked = lay.to_blocked(s)
    assert torch.equal(blocked, _brute_blocked(s))
    assert blocked.numel() == lay.sf_bytes(rows, kbs)
    offs = torch.tensor([lay.sf_offset(r, k, kbs) for r in range(rows) for k in range(kbs)])
    assert torch.equal(blocked[offs], s.reshape(-1))
    assert len(set(offs.tolist())) == offs.numel()  # injective


def test_blocked_batch_equals_per_expert():
    s = torch.randint(0, 255, (3, 200, 5), dtype=torch.uint8)
    b = lay.to_blocked(s)
    assert b.shape == (3, lay.sf_bytes(200, 5))
    for e in range(3):
        assert torch.equal(b[e], lay.to_blocked(s[e]))


@pytest.mark.parametrize("sizes", [[100, 0, 200], [128, 128, 1], [0, 0, 5], [513, 31, 0, 77]])
def test_row_scales_from_quantize(sizes):
    offs = offsets_from(sizes)
    m, k = offs[-1], 96
    x = torch.randn(m, k) * 3
    _, scales = reference.mxfp8_quantize(x, -1)  # [M, K/32]
    packed = lay.pack_row_scales(scales, torch.tensor(offs, dtype=torch.int32))
    assert packed.numel() == lay.sf_bytes(lay.grouped_sf_rows(m, len(sizes)), k // 32)
    for e in range(len(sizes)):
        start = lay.expert_sf_start(offs, e)
        assert start % 128 == 0
        for r in range(offs[e], offs[e + 1]):
            for kb in range(k // 32):
                assert packed[lay.sf_offset(start + r - offs[e], kb, k // 32)] == scales[r, kb]


def test_token_scales_from_quantize():
    sizes = [70, 0, 33, 128]
    offs = offsets_from(sizes)
    n = 64
    x = torch.randn(offs[-1], n)
    per_expert = []
    for e, size in enumerate(sizes):  # reference wgrad blocking: 32 tokens from the expert's first row
        xp = torch.nn.functional.pad(x[offs[e]:offs[e + 1]], (0, 0, 0, -size % 32))
        per_expert.append(reference.mxfp8_quantize(xp, 0)[1] if size else torch.zeros(0, n, dtype=torch.uint8))
    packed = lay.pack_token_scales(per_expert, offs, n)
    kbs = lay.grouped_sf_rows(offs[-1], len(sizes)) // 32
    assert packed.numel() == lay.sf_bytes(n, kbs)
    for e, s in enumerate(per_expert):
        c0 = lay.expert_sf_start(offs, e) // 32
        for j in range(s.shape[0]):
            for col in range(n):
                assert packed[lay.sf_offset(col, c0 + j, kbs)] == s[j, col]


def test_kn_weight_scales_split_k():
    """dgrad1 B = [Wg; Wu] along K (I each), quantized along I (rows of [I, H]): the two parts'
    scales packed together equal the blocked (H, 2I/32) matrix of the reference's quantization
    of the concatenated [2I, H] weight (blocks never straddle the halves: I % 32 == 0)."""
    e, inter, hid = 2, 128, 160
    wg, wu = torch.randn(e, inter, hid), torch.randn(e, inter, hid)
    parts = [torch.stack([reference.mxfp8_quantize(w[x], 0)[1] for x in range(e)]) for w in (wg, wu)]
    packed = lay.pack_kn_weight_scales(*parts)
    kbs = 2 * inter // 32
    per_expert = lay.sf_bytes(hid, kbs)
    assert packed.shape == (e * per_expert,)
    for x in range(e):
        full = reference.mxfp8_quantize(torch.cat([wg[x], wu[x]]), 0)[1]  # [2I/32, H]
        for h in range(hid):
            for kb in range(kbs):
                assert packed[x * per_expert + lay.sf_offset(h, kb, kbs)] == full[kb, h]


def test_grouped_regions_never_overlap():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 31, 127, 128, 129, rng.randrange(1000)]) for _ in range(rng.randrange(1, 9))]
        offs = offsets_from(sizes)
        spans = [(lay.expert_sf_start(offs, e), lay.expert_sf_start(offs, e) + max(1, -(-n // 128)) * 128)
                 for e, n in enumerate(sizes)]
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0
        assert spans[-1][1] <= lay.grouped_sf_rows(offs[-1], len(sizes))


@pytest.mark.parametrize("tile_n, mx, stages, used, alloc", [
    (256, False, 2, 512, 512), (128, False, 2, 256, 256), (256, True, 1, 304, 512), (128, True, 2, 288, 512),
    (64, False, 2, 128, 128), (32, False, 2, 64, 64),
])
def test_tmem_budget(tile_n, mx, stages, used, alloc):
    assert lay.acc_stages(tile_n, mx) == stages
    assert lay.tmem_columns(tile_n, stages, mx) == (used, alloc)
    assert alloc <= lay.TMEM_COLUMNS


def test_smem_budget():
    assert lay.stage_bytes(128, 256, False) == (128 + 256) * 128
    assert lay.stage_bytes(256, 256, False, cta_group=2) == (128 + 128) * 128
    assert lay.stage_bytes(128, 256, True) == (128 + 256) * 128 + 128 * 4 + 256 * 4
    assert lay.stage_bytes(128, 128, True) == 256 * 128 + 512 + 512
    for args in [(128, 256, False, 1), (256, 256, False, 2), (128, 256, True, 1), (128, 128, True, 1)]:
        n = lay.num_stages(*args)
        assert n >= 2 and n * lay.stage_bytes(*args) + lay.SMEM_RESERVED <= lay.SMEM_CAPACITY
        assert (n + 1) * lay.stage_bytes(*args) + lay.SMEM_RESERVED > lay.SMEM_CAPACITY


@pytest.mark.parametrize("tile_m", [128, 256])
def test_group_schedule_covers_every_tile_once(tile_m):
    offs, n_tiles, ctas = [0, 300, 300, 301, 1000], 3, 7
    seen = []
    for c in range(ctas):  # with cta_group::2 a "CTA" here is a cluster
        seen += [(e, mt, nt) for e, mt, nt, _, _ in group_tiles.cta_tiles(offs, tile_m, n_tiles, c, ctas)]
    expect = [(e, mt, nt) for e in range(4) for nt in range(n_tiles)
              for mt in range(-(-(offs[e + 1] - offs[e]) // tile_m))]
    assert sorted(seen) == sorted(expect)
    assert len(seen) == group_tiles.total_tiles(offs, tile_m, n_tiles)


def test_wgrad_schedule_and_sf_column():
    offs = [0, 100, 100, 400]
    tiles = [t for c in range(5) for t in group_tiles.wgrad_cta_tiles(3, 2, 2, c, 5)]
    assert sorted(tiles) == [(e, m, n) for e in range(3) for m in range(2) for n in range(2)]
    # the kernel's first scale k-tile of expert e: o_e // 128 + e (one 128-token atom per k-tile)
    assert [lay.expert_sf_start(offs, e) // 128 for e in range(3)] == [0, 1, 2]

"""Host-side layout and budget rules of the SM100/SM103 expert GEMMs (pure Python + torch).

Nothing here imports the DSL: the kernels (:mod:`mok_cute.kernels.sm100.mainloop`) size
themselves with these functions and check at trace time that CuTe agrees, and the tests
check these functions against brute-force constructions. :class:`TokenOperand` (a wgrad
operand quantized along tokens: the token quantizer, looked up at call time, then
:func:`token_rows` / :func:`pack_token_scales_device`) serves the unfused MXFP8 backward and
the fused one's host.

MXFP8 scale factors: the 128x4 blocked layout of ``tcgen05.mma ... block_scale``
-------------------------------------------------------------------------------
A scale matrix S [R, KB] (R rows of the operand's M or N dim, KB = K / 32 blocks along the
reduction) is stored padded to R' = ceil(R / 128) * 128 rows and KB' = ceil(KB / 4) * 4
columns, as ``(R' / 128) x (KB' / 4)`` atoms of 512 bytes, the K atom index fastest. Inside an
atom, row r = 32 * r1 + r0 (r0 < 32, r1 < 4) and block kb < 4 sit at byte
``16 * r0 + 4 * r1 + kb`` (PTX "scale factor A/B layout", CuTe ``BlockScaledBasicChunk``;
also ``torch``'s ``to_blocked``). Padding bytes are zero.

Grouped operands whose token count per expert varies use a closed-form per-expert placement
(no prefix sum, so the kernel finds an expert's scales from ``offsets`` alone):

* token rows (forward / dgrad A operand, quantized along K): token row ``r`` of expert e
  (``offsets[e] <= r < offsets[e+1]``) is scale row ``128 * (offsets[e] // 128 + e) + r -
  offsets[e]``; the matrix has :func:`grouped_sf_rows` rows. Expert e's 128-row tile t
  reads scale atom row ``offsets[e] // 128 + e + t``.
* tokens along K (wgrad, quantized along tokens in blocks of 32 from each expert's first
  row): token block j of expert e is scale column ``4 * (offsets[e] // 128 + e) + j`` of a
  [N, :func:`grouped_sf_rows` / 32] matrix (N = the operand's feature dim).

The regions of consecutive experts never overlap: 128 * (o_{e+1} // 128 - o_e // 128 + 1)
>= ceil((o_{e+1} - o_e) / 128) * 128; every expert (even an empty one) owns >= 1 atom.
"""
from __future__ import annotations

import torch

SF_VEC = 32  # elements per E8M0 scale (MX block)
SF_ATOM_ROWS = 128
SF_ATOM_KBLOCKS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_KBLOCKS
SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm_100 / sm_103
SMEM_RESERVED = 1024  # mbarriers, TMEM pointer, struct padding
TMEM_COLUMNS = 512  # 32-bit columns of tensor memory per SM (128 lanes each)
K_TILE_BYTES = 128  # one k-tile is one 128-byte swizzle atom (64 bf16 / 128 fp8 elements)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- scale-factor layout
def sf_offset(row: int, kb: int, k_blocks: int) -> int:
    """Byte offset of scale (row, k-block kb) in the blocked layout of a [*, k_blocks] matrix."""
    return sf_byte(row // SF_ATOM_ROWS, row % SF_ATOM_ROWS, kb, _ceil(k_blocks, SF_ATOM_KBLOCKS))


def sf_byte(atom_row, r, kb, kb_atoms):
    """Byte offset of scale (row ``r`` < 128 of atom row ``atom_row``, k-block kb) in a blocked
    matrix of ``kb_atoms`` atoms per atom row; non-negative ints or DSL integers (the fused
    forward's in-kernel scale stores use it)."""
    atom = atom_row * kb_atoms + kb // SF_ATOM_KBLOCKS
    return atom * SF_ATOM_BYTES + 16 * (r % 32) + 4 * (r // 32) + kb % SF_ATOM_KBLOCKS


def sf_bytes(rows: int, k_blocks: int) -> int:
    """Bytes of the padded blocked layout of a [rows, k_blocks] scale matrix."""
    return _ceil(rows, SF_ATOM_ROWS) * _ceil(k_blocks, SF_ATOM_KBLOCKS) * SF_ATOM_BYTES


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [R, KB] -> flat uint8 [sf_bytes(R, KB)] in the blocked layout (zero padding);
    a batch [B, R, KB] -> [B, sf_bytes(R, KB)] (e.g. per-expert weight scales)."""
    if scales.dtype != torch.uint8 or scales.dim() not in (2, 3):
        raise ValueError(f"scales must be 2-D or 3-D uint8, got {scales.dtype} {tuple(scales.shape)}")
    batch = scales.shape[:-2]
    rows, kbs = scales.shape[-2:]
    rb, cb = _ceil(rows, SF_ATOM_ROWS), _ceil(kbs, SF_ATOM_KBLOCKS)
    padded = torch.zeros(*batch, rb * SF_ATOM_ROWS, cb * SF_ATOM_KBLOCKS, dtype=torch.uint8, device=scales.device)
    padded[..., :rows, :kbs] = scales
    atoms = padded.view(-1, rb, 4, 32, cb, 4).permute(0, 1, 4, 3, 2, 5)  # (b, rb, cb, r0, r1, kb)
    return atoms.reshape(*batch, -1)


def grouped_sf_rows(m_total: int, num_experts: int) -> int:
    """Rows (token-row operands) or tokens (wgrad operands) of a grouped scale matrix."""
    return SF_ATOM_ROWS * (_ceil(m_total, SF_ATOM_ROWS) + num_experts)


def expert_sf_start(offsets, e: int) -> int:
    """First scale row (token-row operands) / token (wgrad) of expert e: 128 * (o_e // 128 + e)."""
    return SF_ATOM_ROWS * (int(offsets[e]) // SF_ATOM_ROWS + e)


def pack_row_scales(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Token-row operand scales uint8 [M, K/32] (``mxfp8_quantize(x, -1)``) -> flat blocked
    [sf_bytes(grouped_sf_rows(M, E), K/32)] with each expert at :func:`expert_sf_start`.
    ``offsets``: int tensor [E+1] on the scales' device (torch ops only: no host sync)."""
    m, kbs = scales.shape
    offs = offsets.to(device=scales.device, dtype=torch.int64)
    rows = torch.arange(m, device=scales.device)
    e = torch.searchsorted(offs[1:], rows, right=True)  # expert of each token row
    dest = SF_ATOM_ROWS * (offs[e] // SF_ATOM_ROWS + e) + rows - offs[e]
    grouped = torch.zeros(grouped_sf_rows(m, offs.numel() - 1), kbs, dtype=torch.uint8, device=scales.device)
    grouped[dest] = scales
    return to_blocked(grouped)


def pad_k_parts(parts, dim: int) -> torch.Tensor:
    """Scales of K in parts (split K: A's and B's pieces through their own TMA descriptors):
    each part's blocks (along ``dim``) zero-padded to whole k-tiles of :data:`SF_ATOM_KBLOCKS`
    blocks (128 elements), then concatenated along ``dim``, so part 2 starts at k-tile
    ceil(K1 / 128) as its data does."""
    out = []
    for p in parts:
        pad = list(p.shape)
        pad[dim] = -p.shape[dim] % SF_ATOM_KBLOCKS
        out += [p, p.new_zeros(pad)]
    return torch.cat(out, dim)


def pack_kn_weight_scales(*parts: torch.Tensor) -> torch.Tensor:
    """Scales of a weight stored [E, K, N] and read as B (N, K), quantized along K (its rows,
    ``mxfp8_quantize(w[e], 0)``): ``parts`` uint8 [E, K_i/32, N], consecutive pieces of K
    (dgrad1: gate then up, each padded to whole k-tiles by :func:`pad_k_parts`) -> flat blocked
    [E * sf_bytes(N, KB)] of the (N, KB) matrices (KB = the padded blocks of all parts)."""
    return to_blocked(pad_k_parts(parts, 1).transpose(1, 2)).reshape(-1)


def pack_token_scales(expert_scales: list[torch.Tensor], offsets, n: int) -> torch.Tensor:
    """Wgrad operand scales: ``expert_scales[e]`` uint8 [ceil(L_e / 32), N] (expert e's tokens
    quantized along tokens, zero-padded last block) -> flat blocked [sf_bytes(N,
    grouped_sf_rows(M, E) / 32)], expert e's blocks from column ``expert_sf_start / 32``."""
    offs = [int(o) for o in offsets]
    kbs = grouped_sf_rows(offs[-1], len(offs) - 1) // SF_VEC
    grouped = torch.zeros(n, kbs, dtype=torch.uint8)
    for e, s in enumerate(expert_scales):
        c = expert_sf_start(offs, e) // SF_VEC
        grouped[:, c:c + s.shape[0]] = s.t()
    return to_blocked(grouped)


def token_rows(data_t: torch.Tensor, offsets: torch.Tensor, m: int) -> torch.Tensor:
    """Token-wise quantized data in the transposed tile-aligned layout of ``quantize_tokens``
    (data_t [N, 32 S]: token offsets[e] + t of expert e at column 32 (offsets[e] // 32 + e) + t)
    -> token rows [m, N] e4m3 (row r = token r; rows at or past offsets[E] are 0). Device ops."""
    offs = offsets.to(device=data_t.device, dtype=torch.int64)
    rows = torch.arange(m, device=data_t.device)
    e = torch.searchsorted(offs[1:], rows, right=True)  # expert of each row (E: past offsets[E])
    valid = e < offs.numel() - 1
    col = SF_VEC * (offs[e] // SF_VEC + e) + rows - offs[e]
    col = torch.where(valid, col, torch.zeros_like(col))
    raw = data_t.view(torch.uint8).index_select(1, col).t()
    raw = torch.where(valid[:, None], raw, torch.zeros((), dtype=torch.uint8, device=raw.device))
    return raw.contiguous().view(torch.float8_e4m3fn)


def pack_token_scales_device(scales: torch.Tensor, offsets: torch.Tensor, m: int) -> torch.Tensor:
    """Token-wise scales [S, N] of ``quantize_tokens(x [m, *], offsets, "mxfp8")`` (S = m // 32 +
    E, expert e's blocks from slot offsets[e] // 32 + e; a column slice picks features) -> the
    wgrad kernel's flat blocked layout, equal to :func:`pack_token_scales` of the
    per-expert scales: block j of expert e at column 4 (offsets[e] // 128 + e) + j of a
    [N, grouped_sf_rows(m, E) / 32] matrix. Torch ops on device tensors, no host sync."""
    s_n, n = scales.shape
    dev = scales.device
    offs = offsets.to(device=dev, dtype=torch.int64)
    num_e = offs.numel() - 1
    kbs = grouped_sf_rows(m, num_e) // SF_VEC
    base = offs[:-1] // SF_VEC + torch.arange(num_e, device=dev)  # strictly increasing, base[0] = 0
    blocks = (offs[1:] - offs[:-1] + SF_VEC - 1) // SF_VEC
    slot = torch.arange(s_n, device=dev)
    e = (torch.searchsorted(base, slot, right=True) - 1).clamp(min=0)  # largest e with base[e] <= slot
    j = slot - base[e]
    dest = SF_ATOM_KBLOCKS * (offs[:-1][e] // SF_ATOM_ROWS + e) + j
    dest = torch.where(j < blocks[e], dest, torch.full_like(dest, kbs))  # unused slots -> dump column
    grouped = torch.zeros(n, kbs + 1, dtype=torch.uint8, device=dev)
    grouped[:, dest] = scales.t()
    return to_blocked(grouped[:, :kbs])


class TokenOperand:
    """A wgrad operand x [M, N] quantized along tokens per expert, in the wgrad kernel's
    layout: ``data`` e4m3 token rows [M, N]; :meth:`scales` packs a feature range."""

    def __init__(self, x: torch.Tensor, offsets: torch.Tensor):
        from mok_cute.dsl.host import offsets_i32
        from mok_cute.kernels.quant import quantize_fp8

        data_t, self._scales = quantize_fp8.quantize_tokens(x, offsets_i32(offsets), "mxfp8")
        self.m, self.offsets = x.shape[0], offsets
        self.data = token_rows(data_t, offsets, self.m)

    def scales(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return pack_token_scales_device(self._scales[:, lo:hi], self.offsets, self.m)


# ---------------------------------------------------------------- budgets
def sf_tmem_columns(cta_tile_m: int, tile_n: int) -> tuple[int, int]:
    """TMEM columns of one k-tile's (SFA, SFB): 4 per 32 rows (SFB's N padded to 128)."""
    return cta_tile_m // 32 * SF_ATOM_KBLOCKS, _ceil(tile_n, 128) * 128 // 32 * SF_ATOM_KBLOCKS


def acc_stages(tile_n: int, mx: bool, cta_tile_m: int = 128) -> int:
    """Accumulator buffers in TMEM: 2 (epilogue of tile i overlaps the MMAs of tile i+1) when
    they fit beside the scale factors, else 1."""
    sf = sum(sf_tmem_columns(cta_tile_m, tile_n)) if mx else 0
    return 2 if 2 * tile_n + sf <= TMEM_COLUMNS else 1


def tmem_columns(tile_n: int, stages: int, mx: bool, cta_tile_m: int = 128) -> tuple[int, int]:
    """``(used, allocated)`` TMEM columns: FP32 accumulators (``tile_n`` columns per stage,
    128 lanes = the CTA's rows) then SFA, SFB; the allocation is the next power of two >= 32."""
    used = tile_n * stages + (sum(sf_tmem_columns(cta_tile_m, tile_n)) if mx else 0)
    alloc = 32
    while alloc < used:
        alloc *= 2
    return used, alloc


def stage_bytes(tile_m: int, tile_n: int, mx: bool, cta_group: int = 1) -> int:
    """Shared-memory bytes of one pipeline stage per CTA: the A and B k-tiles (128 bytes of K
    per row; with cta_group 2 each CTA holds half of A's and half of B's rows) plus, for
    MXFP8, one k-tile of SFA (cta rows x 4 bytes) and SFB (N padded to 128, x 4 bytes)."""
    cta_m = tile_m // cta_group
    ab = (cta_m + tile_n // cta_group) * K_TILE_BYTES
    if not mx:
        return ab
    sfa, sfb = cta_m * SF_ATOM_KBLOCKS, _ceil(tile_n, 128) * 128 * SF_ATOM_KBLOCKS
    return ab + sfa + sfb


def num_stages(tile_m: int, tile_n: int, mx: bool, cta_group: int = 1, stages: int = 0) -> int:
    """Ring depth: ``stages`` if set, else as many as fit (the epilogue uses no shared memory)."""
    return stages or (SMEM_CAPACITY - SMEM_RESERVED) // stage_bytes(tile_m, tile_n, mx, cta_group)

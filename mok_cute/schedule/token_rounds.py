"""Token-local order of the row blocks of an expert-grouped buffer (device function and its pure-Python mirror).

Expert ``e`` owns rows ``offsets[e]..offsets[e+1]``, its routes in token order, cut into blocks of ``blk`` rows
(``nb_e = ceil(rows_e / blk)``). Taken expert after expert, the blocks sweep all the tokens once per expert, so a
pass that reads each block's token rows (dy[t], x[t]) rereads every token row from DRAM once per expert when the
token rows do not fit in L2. The *round order* interleaves the experts: round ``rho`` of ``rounds`` holds blocks
``floor(rho nb_e / rounds) .. floor((rho + 1) nb_e / rounds) - 1`` of every expert (experts in order, then
blocks), so blocks at the same fraction of every expert's rows, which hold about the same tokens, run side by
side. It is a bijection of ``[0, sum_e nb_e)`` onto the blocks.

Rank ``c`` on the device (:func:`round_block`, one warp, every lane gets the result): the round whose start
``S(rho) = sum_e floor(rho nb_e / rounds)`` satisfies ``S(rho) <= c < S(rho + 1)`` by binary search, then the
expert by a prefix sum of the round's block counts over the experts (32 at a time). This module imports no GEMM
code.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from mok_cute.schedule.group_tiles import warp_sum


# ---------------------------------------------------------------- pure-Python mirror
def _blocks(offsets, blk: int) -> list[int]:
    offs = [int(o) for o in offsets]
    return [-(-(offs[e + 1] - offs[e]) // blk) for e in range(len(offs) - 1)]


def round_blocks(offsets, blk: int, rounds: int) -> list[tuple[int, int]]:
    """Every block ``(expert, block)`` in round order (the definition)."""
    nb = _blocks(offsets, blk)
    return [(e, b) for rho in range(rounds) for e, n in enumerate(nb)
            for b in range(rho * n // rounds, (rho + 1) * n // rounds)]


def round_block_mirror(offsets, blk: int, rounds: int, c: int) -> tuple[int, int]:
    """:func:`round_block`'s steps in Python: the block of rank ``c``, ``(E, 0)`` past the last one."""
    nb = _blocks(offsets, blk)

    def start(rho):
        return sum(rho * n // rounds for n in nb)

    if c >= start(rounds):
        return len(nb), 0
    lo, hi = 0, rounds
    for _ in range(search_steps(rounds)):
        if hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if start(mid) <= c else (lo, mid)
    rem = c - start(lo)
    for e, n in enumerate(nb):
        f0, f1 = lo * n // rounds, (lo + 1) * n // rounds
        if rem < f1 - f0:
            return e, f0 + rem
        rem -= f1 - f0
    raise AssertionError("unreachable: c < the blocks' count")


def rounds_for(tokens: int, width: int = 32) -> int:
    """Rounds of about ``width`` tokens each (at least one)."""
    return max(1, -(-tokens // width))


def search_steps(rounds: int) -> int:
    """Binary-search steps that pin a round among ``rounds``."""
    return max(1, int(rounds).bit_length())


# ---------------------------------------------------------------- device
@cute.jit
def _share(rho: Int32, n: Int32, rounds: Int32) -> Int32:
    """floor(rho * n / rounds) without Int32 overflow."""
    return Int32(Int64(rho) * Int64(n) // Int64(rounds))


@cute.jit
def _start(offs: cute.Tensor, n_exp: Int32, blk: cutlass.Constexpr[int], rho: Int32, rounds: Int32,
           lane: Int32) -> Int32:
    """S(rho) on every lane of the warp."""
    s = Int32(0)
    for e in cutlass.range(lane, n_exp, 32, unroll=1):
        s = s + _share(rho, (offs[e + 1] - offs[e] + blk - 1) // blk, rounds)
    return warp_sum(s)


@cute.jit
def round_block(offs: cute.Tensor, n_exp: Int32, blk: cutlass.Constexpr[int], rounds: Int32, steps: Int32, c: Int32,
                lane: Int32):
    """The block of rank ``c`` in round order as ``(expert, block)``, ``(n_exp, 0)`` for ``c`` past the last block.
    One warp, every lane (``lane`` 0..31) calls it with the same arguments; ``offs`` int32 [n_exp + 1];
    ``steps`` = :func:`search_steps` of ``rounds``."""
    e_out = n_exp
    b_out = Int32(0)
    if c < _start(offs, n_exp, blk, rounds, rounds, lane):
        lo = Int32(0)
        hi = rounds
        for _ in cutlass.range(steps, unroll=1):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                if _start(offs, n_exp, blk, mid, rounds, lane) <= c:
                    lo = mid
                else:
                    hi = mid
        rem = c - _start(offs, n_exp, blk, lo, rounds, lane)
        base = Int32(0)
        for e0 in cutlass.range(0, n_exp, 32, unroll=1):
            e = e0 + lane
            f0 = Int32(0)
            n = Int32(0)
            if e < n_exp:
                nb = (offs[e + 1] - offs[e] + blk - 1) // blk
                f0 = _share(lo, nb, rounds)
                n = _share(lo + 1, nb, rounds) - f0
            incl = n  # inclusive prefix sum of the round's counts over the group's lanes
            for s in cutlass.range_constexpr(5):
                v = cute.arch.shuffle_sync_up(incl, offset=1 << s)
                if lane >= (1 << s):
                    incl = incl + v
            # lanes whose prefix does not pass rem come first; the next one holds block rem
            below = cute.arch.popc(cute.arch.vote_ballot_sync(base + incl <= rem))
            if below < 32:
                if e_out == n_exp:
                    e_out = e0 + below
                    b_out = cute.arch.shuffle_sync(f0 + rem - (base + incl - n), below)
            base = base + cute.arch.shuffle_sync(incl, 31)
    return e_out, b_out

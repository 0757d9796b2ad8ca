"""The operand bundles of the SM100 megakernels (:mod:`~mok_cute.kernels.sm100.fused_moe`,
:mod:`~mok_cute.kernels.sm100.fused_bwd`) and their launch.

Each bundle is a ``typing.NamedTuple`` whose fields are tensors (``cute.Tensor`` at compile time,
a :class:`~mok_cute.dsl.launch._Desc` of a torch tensor at launch), DSL scalars
(``Int32`` / ``Int64`` / ``Float32``) or None. The DSL flattens a bundle into its fields in order
and drops a None field at compile time, so a kernel that takes bundles has exactly the parameters
it had as a flat list: the field order below is that list's order (the PTX stays byte-identical).
A launcher hands a kernel a bundle with the fields that kernel does not read set to None
(``bundle._replace(...)``). A bundle whose fields are all None (a variant without MXFP8, tokens,
a gather or a shared expert) crosses the host boundary as None (:func:`present`: the DSL takes None
as an absent argument, an all-None tuple is no JIT argument type); ``__call__`` turns it back into
the empty bundle. No cutlass import here: the host builds the same bundles.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


# ---------------------------------------------------------------- fused forward
class FwdOperands(NamedTuple):
    """The forward's GEMM operands, row-major (bf16; MXFP8: e4m3): x [T, H]; the ring of gathered
    rows xg [ring * tile_m, H] (TMA gather: a one-slot stand-in); w1 [E, 2 I_p, H] (gate / up
    interleaved in blocks of tile_n / 2 rows, I_p = I rounded up to 128); w_down [E, H, I]; the
    shared expert's s1 [1, 2 I_sp, H] and s_down [1, H, I_s] (None without one)."""
    x: Any
    xg: Any
    w1: Any
    w_down: Any
    s1: Any = None
    s_down: Any = None


class FwdOutputs(NamedTuple):
    """The forward's outputs, bf16: gu [M_cap, 2, I], h [M_cap, I]; the shared expert's gus
    [T, 2, I_s], hs [T, I_s], s_out [T, H] (None without one); slot [T*k, H] (each route's GEMM2
    row; EP > 1: the workspace's slot section); y [T, H]."""
    gu: Any
    h: Any
    gus: Any
    hs: Any
    slot: Any
    s_out: Any
    y: Any


class FwdRouting(NamedTuple):
    """The routing plan as the forward reads it: order int32 [M_cap] (route ``t*k + j`` of each
    grouped row; EP > 1: packed sources ``p*T*k + t*k + j``), offsets int32 [E+1], idx int32 [T*k]
    (-1: no expert), w fp32 [T*k] (topk_w), gate fp32 [T] or None (the shared expert's output gate),
    tok int32 [M_cap + 128] or None (TMA gather: each grouped row's token, then padding)."""
    order: Any
    offsets: Any
    idx: Any
    w: Any
    gate: Any = None
    tok: Any = None


class FwdCounters(NamedTuple):
    """int32, zero at launch (:func:`mok_cute.kernels.sm90.fused_moe.counter_sizes`): gather_ready,
    h_ready [routed m-tiles], sh_ready [shared m-tiles], done [4] (GEMM2 tiles, ticket, gather and
    slot-sum arrivals), status [4]; trace int64 [records * 4] or None."""
    gather_ready: Any
    h_ready: Any
    sh_ready: Any
    done: Any
    status: Any
    trace: Any = None


class FwdMx(NamedTuple):
    """The MXFP8 forward's operands (None each at BF16), uint8 blocked E8M0 scales unless said:
    x_words int32 [T, ceil(H / 128)] (x's scale bytes per row, zero-padded to whole atoms), ring_sf
    (the ring's scales), w1_sf, hq e4m3 [M_cap, I] and h_sf (grouped, zeroed), wd_sf; with a shared
    expert x_sf, s1_sf, hsq e4m3 [T, I_s], hs_sf (zeroed), sd_sf."""
    x_words: Any = None
    ring_sf: Any = None
    w1_sf: Any = None
    hq: Any = None
    h_sf: Any = None
    wd_sf: Any = None
    x_sf: Any = None
    s1_sf: Any = None
    hsq: Any = None
    hs_sf: Any = None
    sd_sf: Any = None


class FwdScalars(NamedTuple):
    """Int32 k (slots per token), Float32 limit (SwiGLU clamp, 0: none), Int32 comm_ctas (the
    gathering CTAs), num_ctas (the grid), ring (slots), band (R1's m-tile band), Int64 timeout_ns
    (every device wait's bound)."""
    k: Any
    limit: Any
    comm_ctas: Any
    num_ctas: Any
    ring: Any
    band: Any
    timeout_ns: Any


class FwdPeer(NamedTuple):
    """EP > 1 (:meth:`~mok_cute.comm.workspace.CommWorkspace.kernel_args` order): int64 peer bases
    [EP], w_rows fp32 [M_cap] (each grouped row's router weight), slot_copy [T*k, H] (this rank's
    slot rows), Int32 me, n_ranks, Int64 offsets of the src / slots / w / flags sections, Int32 pull
    and push epochs. EP = 1: the tensors None, the scalars :data:`~mok_cute.kernels.sm90.fused_moe._NO_EP`."""
    peer: Any
    w_rows: Any
    slot_copy: Any
    me: Any
    n_ranks: Any
    src_off: Any
    slots_off: Any
    w_off: Any
    flags_off: Any
    epoch_pull: Any
    epoch_push: Any


class ExpertBias(NamedTuple):
    """The routed experts' biases (gpt-oss; :mod:`~mok_cute.kernels.sm100.bias`), bf16 with unit column strides:
    gate, up [E, I] (GEMM1's, added before the SwiGLU), down [E, H] (GEMM2's); None each where absent (an unbiased
    variant: the bundle crosses as None). The fused forward's last bundle and the grouped GEMM's ``bias``."""
    gate: Any = None
    up: Any = None
    down: Any = None


# ---------------------------------------------------------------- fused backward
class BwdGroup(NamedTuple):
    """One group of the backward's tiles (the routed experts, or the shared expert as one expert
    over the T tokens), row-major (bf16; MXFP8: the GEMM operands e4m3): dy, x [M, H] (grouped
    rows), gu [M, 2, I] bf16, h [M, I], w_gate, w_up [E, I, H], w_down [E, H, I]; outputs dgu
    [M, 2, I] (scratch the D1 and W tiles read), dx [M, H] (tokens: the slot rows [T*k, H]), dwg,
    dwu [E, I, H], dwd [E, H, I] (bf16, or fp32 main grads added into); offsets int32 [E+1], d2
    int32 [routed m-tiles] (D2 tiles per m-tile), words int32 (the ticket, the status words, then
    the done / arrival words); None each where absent (``BwdGroup()``: no such group)."""
    dy: Any = None
    x: Any = None
    gu: Any = None
    h: Any = None
    w_gate: Any = None
    w_up: Any = None
    w_down: Any = None
    dgu: Any = None
    dx: Any = None
    dwg: Any = None
    dwu: Any = None
    dwd: Any = None
    offsets: Any = None
    d2: Any = None
    words: Any = None


class BwdTokens(NamedTuple):
    """The tokens variant (dx rows to their (token, slot) rows and the slot sum; else None each):
    order int32 (grouped row -> t*k + j; see the kernel class), idx int32 [T*k], init bf16 [T, H]
    or None (the slot sum's start), add fp32 [T, H] or None, out bf16 [T, H] (dx)."""
    order: Any = None
    idx: Any = None
    init: Any = None
    add: Any = None
    out: Any = None


class BwdMx(NamedTuple):
    """The MXFP8 backward's operands (None each at BF16), flat uint8 blocked scales unless said:
    dy_sf (dy rows), wd_sf, dgu_sf (dgu rows), wgu_sf ([w_gate; w_up] along K), dy_t e4m3 [M, H]
    (dy along the tokens), dy_tsf, h_tsf, dgu_t e4m3 [M, 2, I] (dgu along the tokens), dg_tsf,
    du_tsf, x_tsf (token scales)."""
    dy_sf: Any = None
    wd_sf: Any = None
    dgu_sf: Any = None
    wgu_sf: Any = None
    dy_t: Any = None
    dy_tsf: Any = None
    h_tsf: Any = None
    dgu_t: Any = None
    dg_tsf: Any = None
    du_tsf: Any = None
    x_tsf: Any = None


class BwdGather(NamedTuple):
    """The gather variant (the routed rows made in the launch; else None each): dy_tok, x_tok
    [T, H] bf16, r (the forward's GEMM2 rows, grouped or by route; EP > 1: this rank's slot rows
    [T*k, H]), w fp32 (topk_w [T*k]; EP > 1: each grouped row's router weight [M]), dtw fp32 [T*k]
    (d topk_w out), gdy int32 [routed m-tiles] (1: dy rows, 2: x rows too); MXFP8: dy_rows, x_rows
    [M, H] bf16 (the gathered rows the comm CTAs quantize)."""
    dy_tok: Any = None
    x_tok: Any = None
    r: Any = None
    w: Any = None
    dtw: Any = None
    gdy: Any = None
    dy_rows: Any = None
    x_rows: Any = None


class GatherPass(NamedTuple):
    """Inside the backward kernel: what its comm CTAs read and write (:class:`BwdGather`'s first
    six, the rows they write, the comm CTAs, and at MXFP8 ``(dyq, dy_sf, dy_t, dy_tsf, x_t, x_tsf)``,
    the operands they quantize each m-tile into, else None)."""
    dy_tok: Any
    x_tok: Any
    r: Any
    w: Any
    dtw: Any
    gdy: Any
    dy_rows: Any
    x_rows: Any
    comm_ctas: Any
    mx: Any


class BwdScalars(NamedTuple):
    """Int32 k (slots per token), comm_ctas (gather: the comm CTAs), Float32 limit (SwiGLU clamp, 0:
    none), Int32 num_ctas (the grid), Int64 timeout_ns (every device wait's bound)."""
    k: Any
    comm_ctas: Any
    limit: Any
    num_ctas: Any
    timeout_ns: Any


class BwdPeer(NamedTuple):
    """EP > 1 (:meth:`~mok_cute.comm.workspace.CommWorkspace.kernel_args` order): int64 peer bases
    [EP], status int32 [4] (the workspace's: every wait's error), Int32 me, n_ranks, Int64 offsets
    of the src / dy / slots / flags sections, Int32 pull and push epochs. EP = 1: the tensors None,
    the scalars :data:`~mok_cute.kernels.sm90.fused_bwd._NO_EP`."""
    peer: Any
    status: Any
    me: Any
    n_ranks: Any
    src_off: Any
    dy_off: Any
    slots_off: Any
    flags_off: Any
    epoch_pull: Any
    epoch_push: Any


# ---------------------------------------------------------------- launch
def present(bundle):
    """``bundle``, or None where every field is None (how an absent bundle is compiled and launched)."""
    return None if bundle is None or all(v is None for v in bundle) else bundle


def _scalar_key(v):
    """A DSL scalar's Python value (their hash is per object), anything else as is."""
    return getattr(v, "value", v)


def launch_bundles(launcher, dev: int, bundles: tuple, direct: bool = False) -> None:
    """Launch ``launcher``'s (a :class:`~mok_cute.dsl.launch.GraphLauncher`) compiled kernel on the
    current stream with ``bundles`` (NamedTuples of torch tensors, DSL scalars and None; each
    tensor handed over as a ``_Desc``, an all-None bundle as None, the stream last): a graph replay
    keyed by every field
    (tensors by pointer, shape and stride, scalars by value), or with ``direct`` (fields that
    change every call, e.g. the EP epochs) through the DSL."""
    from mok_cute.dsl.launch import _Desc, tensor_key

    stream = torch._C._cuda_getCurrentRawStream(dev)
    bundles = tuple(present(b) for b in bundles)
    wrapped = tuple(None if b is None else type(b)(*(_Desc(v) if isinstance(v, torch.Tensor) else v for v in b))
                    for b in bundles)

    def args(st):
        return (*wrapped, st)
    if direct:
        launcher.launch_direct(stream, args)
        return
    key = tuple(tensor_key(v) if isinstance(v, torch.Tensor) else _scalar_key(v) for b in bundles if b is not None
                for v in b)
    launcher.launch(dev, stream, key, args)

"""The sm90 backend: the MoE layer on the SM90 CuTe DSL kernels (EP = 1, BF16).

Unfused stages, no host sync (CUDA-graph friendly): a stable sort of the T*k (token, slot)
routes by expert gives expert-grouped rows in the reference's order (token, then slot) and
device-side offsets; the grouped GEMM kernels (mok_cute.kernels.sm90_*) run the expert MLPs
over a fixed [T*k, ...] row buffer (rows past offsets[E] belong to -1 slots and are never
read); the shared expert runs through the same kernels as one more group; the combine is
the reference's fixed-order slot sum. Numerics follow mok_cute.reference except that the
GEMMs accumulate in fp32 and d topk_w sums in fp32 (compared with tolerances).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import MoEGrads, _world, slot_sum


@dataclass
class _Group:
    """One expert group's forward state: rows, offsets, gu, h."""

    x: torch.Tensor
    offsets: torch.Tensor
    gu: torch.Tensor
    h: torch.Tensor


@dataclass
class _State:
    limit: float | None
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    order: torch.Tensor  # [T*k] route index (t*k + j) of each grouped row
    valid: torch.Tensor  # [T*k] route is not -1
    weights: tuple
    shared: tuple | None
    routed: _Group
    shared_group: _Group | None
    slot_out: torch.Tensor  # [T, k, H] routed rows per slot (zero for -1 slots)


def _kernels():
    from .kernels import sm90_expert_bwd as bwd
    from .kernels import sm90_grouped_gemm as fwd

    return fwd, bwd


def route_sort(topk_idx: torch.Tensor, num_experts: int):
    """(order [T*k] int64, offsets [E+1] int32, valid [T*k] bool) on the device, no sync:
    routes sorted stably by expert id (-1 routes last), i.e. by expert, token, slot."""
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    return order, offsets, valid


def _check_mlp(fwd, x_rows, offsets, w_gate, w_up, w_down, limit):
    """Validate, once, everything the expert MLP's seven launches need (the kernels then run
    unchecked): x [M, H], w_gate/w_up [E, I, H], w_down [E, H, I] bf16 contiguous and 16-byte
    aligned on one CUDA device, offsets int32/int64 [E+1], H and I multiples of tile_n."""
    cfg = fwd.DEFAULT_CONFIG
    m, hid, e = fwd._check_operands(x_rows, offsets, {"w_gate": w_gate, "w_up": w_up}, a_name="x")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_up shape {tuple(w_up.shape)} must equal w_gate shape {tuple(w_gate.shape)}")
    inter = w_gate.shape[1]
    fwd._check_tensor("w_down", w_down, 3, (torch.bfloat16,))
    if tuple(w_down.shape) != (e, hid, inter) or not w_down.is_contiguous() or w_down.data_ptr() % 16:
        raise ValueError(f"w_down must be contiguous [E, H, I] = {(e, hid, inter)} and 16-byte aligned, "
                         f"got {tuple(w_down.shape)}")
    for name, v in (("H", hid), ("I", inter)):
        if v % cfg.tile_n or v == 0:
            raise ValueError(f"expert MLP: {name} = {v} must be a positive multiple of tile_n = {cfg.tile_n}")
    if m >= 2 ** 31:
        raise ValueError(f"x: M = {m} rows must be < 2^31")
    fwd._check_limit(limit)
    fwd._check_devices(x=x_rows, offsets=offsets, w_gate=w_gate, w_up=w_up, w_down=w_down)


def _check_dy(fwd, g: "_Group", dy_rows):
    """The backward's one new input: dy [M, H] bf16 contiguous, 16-byte aligned, x's device."""
    fwd._check_tensor("dy", dy_rows, 2, (torch.bfloat16,))
    if dy_rows.shape != g.x.shape or not dy_rows.is_contiguous() or dy_rows.data_ptr() % 16:
        raise ValueError(f"dy must be contiguous {tuple(g.x.shape)} and 16-byte aligned, got {tuple(dy_rows.shape)}")
    fwd._check_devices(x=g.x, dy=dy_rows)


def _mlp_forward(fwd, x_rows, offsets, w_gate, w_up, w_down, limit):
    _check_mlp(fwd, x_rows, offsets, w_gate, w_up, w_down, limit)
    gu, h = fwd._run_gemm1_swiglu(x_rows, offsets, w_gate, w_up, limit)
    return fwd._run_gemm(h, offsets, w_down), _Group(x_rows, offsets, gu, h)


def _mlp_backward(bwd, g: _Group, dy_rows, w_gate, w_up, w_down, limit):
    """Backward of :func:`_mlp_forward` (its operands were validated there; only dy is new)."""
    from .kernels import sm90_grouped_gemm as fwd

    _check_dy(fwd, g, dy_rows)
    inter = w_gate.shape[1]
    dgu = bwd._run_dswiglu_dgrad(dy_rows, g.offsets, w_down, g.gu, limit)
    dx = bwd._run_dgrad1(dgu, g.offsets, w_gate, w_up)
    dwd = bwd._run_wgrad(dy_rows, g.h, g.offsets)
    dwg = bwd._run_wgrad(dgu[:, :inter], g.x, g.offsets)
    dwu = bwd._run_wgrad(dgu[:, inter:], g.x, g.offsets)
    return dx, dwg, dwu, dwd


def _scatter_slots(rows, order, valid, t, k):
    """Grouped rows back to [T, k, width] slot order; -1 slots are zero."""
    out = torch.empty_like(rows)
    out[order] = rows
    out = torch.where(valid[:, None], out, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return out.view(t, k, rows.shape[1])


class Sm90Backend:
    """EP = 1, BF16 layer on the SM90 grouped GEMM kernels (forward and backward)."""

    name = "sm90"

    def check(self, inp, config, group) -> None:
        """Raise for what this backend does not run yet, before any kernel."""
        ep, _ = _world(group)
        if ep != 1:
            raise NotImplementedError("mok_cute backend 'sm90': EP > 1 needs the symmetric-memory "
                                      "dispatch/combine path, not built yet")
        if config.precision != "bf16":
            raise NotImplementedError(f"mok_cute backend 'sm90': precision {config.precision!r} "
                                      "kernels are not built yet (bf16 only)")
        h, inter = inp.x.shape[1], inp.w_gate.shape[1]
        sizes = [("H", h), ("I", inter)] + ([("I_s", inp.shared[0].shape[0])] if inp.shared else [])
        for name, v in sizes:
            if v % 256:
                raise ValueError(f"backend 'sm90': {name} = {v} must be a multiple of 256 "
                                 "(the 256-wide output tile of the SM90 GEMMs)")

    def forward(self, inp, config, group):
        self.check(inp, config, group)
        fwd, _ = _kernels()
        x, idx, limit = inp.x, inp.topk_idx, inp.swiglu_limit
        t, k = idx.shape
        order, offsets, valid = route_sort(idx, inp.w_gate.shape[0])
        x_rows = x.index_select(0, order // k)
        r, routed = _mlp_forward(fwd, x_rows, offsets, inp.w_gate, inp.w_up, inp.w_down, limit)
        slot_out = _scatter_slots(r, order, valid, t, k)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        shared_group = None
        if inp.shared is not None:
            offs = torch.tensor([0, t], dtype=torch.int32, device=x.device)
            s, shared_group = _mlp_forward(fwd, x, offs, *(w[None] for w in inp.shared), limit)
            acc = s.float()
        y = slot_sum(acc, slot_out, idx, inp.topk_w).to(torch.bfloat16)
        state = _State(limit, idx, inp.topk_w, order, valid, (inp.w_gate, inp.w_up, inp.w_down),
                       inp.shared, routed, shared_group, slot_out)
        return y, state

    def backward(self, st: _State, dy: torch.Tensor) -> MoEGrads:
        _, bwd = _kernels()
        t, k = st.topk_idx.shape
        w_rows = st.topk_w.reshape(-1)[st.order]
        dy_rows = (dy.index_select(0, st.order // k).float() * w_rows[:, None]).to(torch.bfloat16)
        dxr, dwg, dwu, dwd = _mlp_backward(bwd, st.routed, dy_rows, *st.weights, st.limit)
        dx_slots = _scatter_slots(dxr, st.order, st.valid, t, k)
        acc = torch.zeros(dy.shape, dtype=torch.float32, device=dy.device)
        d_shared = None
        if st.shared is not None:
            dxs, *dws = _mlp_backward(bwd, st.shared_group, dy, *(w[None] for w in st.shared), st.limit)
            acc = dxs.float()
            d_shared = tuple(d[0] for d in dws)
        dx = slot_sum(acc, dx_slots, st.topk_idx).to(torch.bfloat16)
        dtw = (dy.float()[:, None, :] * st.slot_out.float()).sum(-1)
        dtw = torch.where(st.topk_idx >= 0, dtw, torch.zeros_like(dtw))
        return MoEGrads(dx, dtw, dwg, dwu, dwd, d_shared)

"""SM90 expert MLP: the five Hopper grouped GEMM kernels behind one validated call.

Forward: GEMM1 + SwiGLU (gu, h), GEMM2. Backward: dgrad2 + dSwiGLU, dgrad1, three wgrads.
Inputs are validated once per call here; the kernels then run unchecked
(mok_cute.kernels.sm90_grouped_gemm / sm90_expert_bwd).
"""
from __future__ import annotations

import torch

from .grouped_backend import ExpertGroup, mlp_backward, mlp_forward


class Sm90ExpertMLP:
    """BF16 expert MLP on the SM90 kernels (output tile 256 wide)."""

    arch = "sm90"
    tile_n = 256
    precisions = ("bf16",)
    expert_parallel = True  # EP > 1 through mok_cute.ep_layer

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit):
        """(rows [M, H], ExpertGroup) for expert-grouped x_rows."""
        from .kernels import sm90_grouped_gemm as fwd

        _check_mlp(fwd, x_rows, offsets, w_gate, w_up, w_down, limit)
        return mlp_forward(fwd._run_gemm1_swiglu, fwd._run_gemm, x_rows, offsets, w_gate, w_up, w_down, limit)

    def backward(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit):
        """(dx rows, dWg, dWu, dWd); operands were validated by forward, only dy is new."""
        from .kernels import sm90_expert_bwd as bwd
        from .kernels import sm90_grouped_gemm as fwd

        _check_dy(fwd, g, dy_rows)
        return mlp_backward(bwd._run_dswiglu_dgrad, bwd._run_dgrad1, bwd._run_wgrad, g, dy_rows, w_gate, w_up,
                            w_down, limit)


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


def _check_dy(fwd, g: ExpertGroup, dy_rows):
    """The backward's one new input: dy [M, H] bf16 contiguous, 16-byte aligned, x's device."""
    fwd._check_tensor("dy", dy_rows, 2, (torch.bfloat16,))
    if dy_rows.shape != g.x.shape or not dy_rows.is_contiguous() or dy_rows.data_ptr() % 16:
        raise ValueError(f"dy must be contiguous {tuple(g.x.shape)} and 16-byte aligned, got {tuple(dy_rows.shape)}")
    fwd._check_devices(x=g.x, dy=dy_rows)



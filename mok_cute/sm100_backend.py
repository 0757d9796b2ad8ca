"""SM100/SM103 expert MLP: the Blackwell (tcgen05) grouped GEMM kernels behind one call.

Compile-verified only: no Blackwell GPU is available to this project, so this path has
never run. Forward: GEMM1 + SwiGLU (gu, h), GEMM2; backward: dgrad2 + dSwiGLU, dgrad1, three
wgrads (mok_cute.kernels.sm100_grouped_gemm, whose wrappers validate every call). BF16 is
wired; MXFP8 operands (quantize + blocked scales) are not yet.
"""
from __future__ import annotations

from .grouped_backend import ExpertGroup, mlp_backward, mlp_forward


class Sm100ExpertMLP:
    """BF16 expert MLP on the SM100 kernels (output tile 256 wide)."""

    arch = "sm100"
    tile_n = 256
    precisions = ("bf16",)

    def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit):
        """(rows [M, H], ExpertGroup) for expert-grouped x_rows."""
        from .kernels import sm100_grouped_gemm as k

        return mlp_forward(k.grouped_gemm1_swiglu, k.grouped_gemm, x_rows, offsets, w_gate, w_up, w_down, limit)

    def backward(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit):
        """(dx rows, dWg, dWu, dWd)."""
        from .kernels import sm100_grouped_gemm as k

        return mlp_backward(k.grouped_dswiglu_dgrad, k.grouped_dgrad1, k.grouped_wgrad, g, dy_rows, w_gate, w_up,
                            w_down, limit)

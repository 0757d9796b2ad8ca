"""MoELayer: an nn.Module owning this rank's routed experts, an optional shared expert and
an optional top-k softmax router."""
from __future__ import annotations

import torch
from torch import nn

from .config import MoKConfig
from .ops import moe
from .reference import _world
from .validate import check_num_experts


class MoELayer(nn.Module):
    """MoE layer over ``num_experts`` experts split across the expert-parallel ``group``.

    Parameters (bf16, the kernels' dtype, unless said): w_gate, w_up [E_local, I, H]; w_down [E_local, H, I];
    with ``shared_intermediate_size`` I_s: ws_gate, ws_up [I_s, H], ws_down [H, I_s];
    with ``router=True``: router_weight [E, H] fp32 (logits = x . router_weight^T in fp32,
    top-k of the logits, softmax over the k kept values; its gradient flows through topk_w).
    Init: N(0, 1) * fan_in^-0.5. ``forward(x)`` routes itself; ``forward(x, topk_idx, topk_w)``
    takes external routing (required when ``router=False``).
    ``accumulate_main_grad=True``: each expert weight (routed and shared, not the router) gets a
    ``.main_grad`` fp32 buffer of its shape, zero at construction, that every backward adds its
    gradient into (``mok_cute.moe(..., main_grads=...)``); its ``.grad`` stays None. Zeroing
    ``main_grad`` between optimizer steps is the caller's, as in Megatron.
    ``shared_output_gate=True`` (needs the shared expert): shared_gate [1, H] bf16, the shared
    expert's output gate (``mok_cute.moe(..., shared_gate=...)``), initialized to 0 (g = 0.5).
    ``swiglu_limit``: None, L, or a :class:`~mok_cute.reference.SwiGLU` (the experts' activation,
    e.g. ``SwiGLU.gpt_oss()``), passed to ``mok_cute.moe``. Expert biases (gpt-oss):
    :meth:`add_expert_biases` gives the routed experts b_gate, b_up [E_local, I] and b_down
    [E_local, H] bf16 parameters (zeros), passed with their weights (``mok_cute.moe``'s
    (weight, bias) pairs).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 shared_intermediate_size: int | None = None, router: bool = True,
                 swiglu_limit: float | None = None, config: MoKConfig | None = None, group=None,
                 accumulate_main_grad: bool = False, shared_output_gate: bool = False, device=None):
        super().__init__()
        ep, rank = _world(group)
        e_local = check_num_experts(num_experts, ep)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts = {num_experts}], got {top_k!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.ep, self.rank = num_experts, top_k, ep, rank
        self.swiglu_limit, self.config, self.group = swiglu_limit, config or MoKConfig(), group
        h, i = hidden_size, intermediate_size

        def param(*shape, fan_in, dt=torch.bfloat16):
            return nn.Parameter((torch.randn(*shape, device=device) * fan_in ** -0.5).to(dt))

        self.w_gate = param(e_local, i, h, fan_in=h)
        self.w_up = param(e_local, i, h, fan_in=h)
        self.w_down = param(e_local, h, i, fan_in=i)
        self.ws_gate = self.ws_up = self.ws_down = None
        if shared_intermediate_size is not None:
            s = shared_intermediate_size
            self.ws_gate = param(s, h, fan_in=h)
            self.ws_up = param(s, h, fan_in=h)
            self.ws_down = param(h, s, fan_in=s)
        if not isinstance(shared_output_gate, bool):
            raise TypeError(f"shared_output_gate must be a bool, got {type(shared_output_gate).__name__}")
        if shared_output_gate and shared_intermediate_size is None:
            raise ValueError("shared_output_gate=True needs the shared expert (shared_intermediate_size)")
        self.shared_gate = self.b_gate = self.b_up = self.b_down = None
        if shared_output_gate:
            self.shared_gate = nn.Parameter(torch.zeros(1, h, device=device, dtype=torch.bfloat16))
        self.router_weight = param(num_experts, h, fan_in=h, dt=torch.float32) if router else None
        if not isinstance(accumulate_main_grad, bool):
            raise TypeError(f"accumulate_main_grad must be a bool, got {type(accumulate_main_grad).__name__}")
        self.accumulate_main_grad = accumulate_main_grad
        for w in self._expert_weights() if accumulate_main_grad else ():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def add_expert_biases(self) -> MoELayer:
        """Give the routed experts biases (gpt-oss's experts): b_gate, b_up [E_local, I] and
        b_down [E_local, H] bf16 parameters, zeros, on the weights' device (with
        ``accumulate_main_grad``, their ``.main_grad`` buffers too). Create the optimizer after.
        Returns the layer; raises if it has them already."""
        if self.b_gate is not None:
            raise ValueError("this MoELayer has expert biases already")
        e_local, inter, h = self.w_gate.shape
        dev = self.w_gate.device
        self.b_gate = nn.Parameter(torch.zeros(e_local, inter, device=dev, dtype=torch.bfloat16))
        self.b_up = nn.Parameter(torch.zeros(e_local, inter, device=dev, dtype=torch.bfloat16))
        self.b_down = nn.Parameter(torch.zeros(e_local, h, device=dev, dtype=torch.bfloat16))
        for b in (self.b_gate, self.b_up, self.b_down) if self.accumulate_main_grad else ():
            b.main_grad = torch.zeros(b.shape, dtype=torch.float32, device=dev)
        return self

    def _expert_weights(self) -> tuple:
        """w_gate, w_up, w_down, then the shared expert's three and its output gate when there
        are, then the expert biases when there are (``mok_cute.moe``'s ``main_grads`` order)."""
        shared = () if self.ws_gate is None else (self.ws_gate, self.ws_up, self.ws_down)
        gate = () if self.shared_gate is None else (self.shared_gate,)
        biases = () if self.b_gate is None else (self.b_gate, self.b_up, self.b_down)
        return (self.w_gate, self.w_up, self.w_down) + shared + gate + biases

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx [T, k] int64, topk_w [T, k] fp32) from the router."""
        logits = x.float() @ self.router_weight.t()
        vals, idx = logits.topk(self.top_k, dim=-1)
        return idx, torch.softmax(vals, dim=-1)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                topk_w: torch.Tensor | None = None) -> torch.Tensor:
        if topk_idx is None or topk_w is None:
            if self.router_weight is None:
                raise ValueError("this MoELayer has no router: pass topk_idx and topk_w")
            topk_idx, topk_w = self.route(x)
        shared = None if self.ws_gate is None else (self.ws_gate, self.ws_up, self.ws_down)
        main_grads = tuple(w.main_grad for w in self._expert_weights()) if self.accumulate_main_grad else None
        routed = (self.w_gate, self.w_up, self.w_down)
        if self.b_gate is not None:  # (weight, bias) pairs
            routed = tuple(zip(routed, (self.b_gate, self.b_up, self.b_down)))
        return moe(x, topk_idx, topk_w, *routed, shared=shared,
                   swiglu_limit=self.swiglu_limit, config=self.config, group=self.group, main_grads=main_grads,
                   shared_gate=self.shared_gate)

"""Quickstart: one MoE layer forward + backward on whatever device is here."""
import torch

import mok_cute

device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs the reference backend
config = mok_cute.MoKConfig(precision="bf16")              # or "mxfp8", "fp8_block"
layer = mok_cute.MoELayer(hidden_size=256, intermediate_size=256, num_experts=8, top_k=2,
                          shared_intermediate_size=256, swiglu_limit=4.0, config=config,
                          device=device)
x = torch.randn(512, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
y = layer(x)                        # [512, 256] bf16
y.float().square().mean().backward()
print(y.shape, x.grad.shape, layer.w_gate.grad.shape)

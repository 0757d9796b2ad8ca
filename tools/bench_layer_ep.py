"""Layer benchmark at EP > 1 (issues 16, 17), one process per GPU, side by side in one run:

    torchrun --nproc_per_node=2 -m tools.bench_layer_ep [--shapes 0,1] [--mx]

Rows per shape: the torch + NCCL layer a Megatron user has (``mok_cute.bench.torch_layer.torch_ep_layer``:
permute, ``all_to_all_single``, grouped_mm experts, reverse all_to_all, fp32 weighted combine,
dense shared expert), mok_cute fused (the default at EP > 1) and unfused
(``MoKConfig(forward_path="unfused", backward_path="unfused")``),
and with ``--mx`` mok_cute MXFP8. Shapes are per GPU (T tokens on each rank, E experts over the
group); fwd and fwd+bwd are the mean of back-to-back calls (``bench_pipelined_us``; each
backward from ``.grad = None``), the ranks started together by a barrier; rank 0 prints the
table (the slowest rank's time per row). NVLink multicast stays off.
"""
from __future__ import annotations

import argparse
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402  (after the NCCL settings above)
import torch.distributed as dist  # noqa: E402

from mok_cute.bench.torch_layer import torch_ep_layer  # noqa: E402
from tools.checks.common import bench_pipelined_us  # noqa: E402

SHAPES = [  # per GPU: (T, H, I, E global, k)
    (4096, 7168, 2048, 32, 8),
    (8192, 4096, 1024, 64, 10),
    (2048, 7168, 2048, 32, 8),
]


def _problem(t, h, inter, e, k, ep, rank, dev):
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    vals, idx = torch.randn(t, e, device=dev, generator=g).topk(k, dim=-1)
    w = torch.softmax(vals, dim=-1)
    gw = torch.Generator(device=dev).manual_seed(7 + rank)  # this rank's experts
    rnd = lambda *s, fan: (torch.randn(*s, device=dev, generator=gw) * fan ** -0.5).bfloat16()
    el = e // ep
    ws = [rnd(el, inter, h, fan=h), rnd(el, inter, h, fan=h), rnd(el, h, inter, fan=inter)]
    sh = [rnd(inter, h, fan=h), rnd(inter, h, fan=h), rnd(h, inter, fan=inter)]
    dy = torch.randn(t, h, device=dev, generator=g).bfloat16()
    return x, idx, w, ws, sh, dy


def run_shape(shape, ep, rank, dev, mx: bool):
    import mok_cute

    t, h, inter, e, k = shape
    x, idx, w, ws, sh, dy = _problem(t, h, inter, e, k, ep, rank, dev)
    group = dist.group.WORLD
    w1 = torch.cat(ws[:2], 1)
    leaves = [x, w, w1, *ws, *sh]
    for p in leaves:
        p.requires_grad_()

    def ours(precision="bf16", **paths):
        cfg = mok_cute.MoKConfig(precision=precision, validate_routing=False, **paths)
        return lambda: mok_cute.moe(x, idx, w, *ws, shared=tuple(sh), config=cfg, group=group)

    impls = {"torch + NCCL": lambda: torch_ep_layer(x, idx, w, w1, ws[2], tuple(sh), None, group),
             "fused": ours(), "unfused": ours(forward_path="unfused", backward_path="unfused")}
    if mx:
        impls["fused mxfp8"] = ours("mxfp8")
    out = {}
    for name, fn in impls.items():
        def step(fn=fn):
            for p in leaves:
                p.grad = None
            torch.autograd.backward(fn(), dy)
        with torch.no_grad():
            dist.barrier()
            t_f = bench_pipelined_us(fn, warmup=2, iters=10)
        dist.barrier()
        t_fb = bench_pipelined_us(step, warmup=2, iters=5)
        times = torch.tensor([t_f, t_fb], device=dev)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
        out[name] = times.tolist()
    base_f, base_fb = out["torch + NCCL"]
    label = f"EP{ep} T{t}/GPU H{h} I{inter} E{e} k{k} +shared"
    return [f"| {label} | {name} | {f:.0f} | {base_f / f:.2f}x | {fb:.0f} | {base_fb / fb:.2f}x |"
            for name, (f, fb) in out.items()]


def main() -> int:
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m tools.bench_layer_ep",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    ap.add_argument("--mx", action="store_true", help="add the MXFP8 row")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, ep = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    lines = []
    for i in args.shapes.split(","):
        lines += run_shape(SHAPES[int(i)], ep, rank, dev, args.mx)
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"\n== bench_layer_ep on {ep} x {torch.cuda.get_device_name(dev)} (BF16 unless said) ==")
        print("| shape | impl | fwd us | fwd vs torch+NCCL | fwd+bwd us | f+b vs torch+NCCL |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

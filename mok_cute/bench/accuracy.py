"""The benchmark's accuracy columns: each system's y and gradients against an fp32 computation of
the same layer.

:mod:`mok_cute.reference` specifies where a BF16 / MX layer rounds (fp64 sums) and offers an
unrounded mode only in float64 ("exact"): at gpt-oss-120b's shape its weights and their gradients
alone would take 51 GB of the GPU. So the fp32 computation here is the reference's math with
nothing rounded: the BF16 inputs upcast once, every GEMM, the SwiGLU
(:func:`mok_cute.reference.swiglu`, the clamp included) and the weighted sum over slots in fp32
(TF32 off), -1 slots skipped, gradients by autograd. tests/tooling/test_bench_peers.py checks it
against the reference's float64 mode.

A column is the relative L1 error ``sum |got - want| / sum |want|`` of one tensor (y, dx, dtopk_w,
dw_gate, dw_up, dw_down, and the shared expert's where the shape has one).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from mok_cute.bench.run import GRAD_NAMES
from mok_cute.bench.shapes import Shape, make_inputs
from mok_cute.reference import swiglu
from mok_cute.schedule.local_plan import plan_reference

CHUNK = 1 << 26  # elements per step of rel_l1 (bounded temporaries at the model shapes)


def _mlp(rows, w_gate, w_up, w_down, limit):
    """SwiGLU expert MLP of ``rows`` [M, H]: silu(min(g, L)) * clamp(u, -L, L) . w_down^T."""
    return swiglu(rows @ w_gate.t(), rows @ w_up.t(), limit) @ w_down.t()


def float32_layer(x, topk_idx, topk_w, w_gate, w_up, w_down, shared=None, limit=None) -> torch.Tensor:
    """y [T, H] in the dtype of ``x`` (fp32 here) of the routed layer plus the shared expert: per token
    the sum over its kept slots of topk_w * expert MLP, nothing rounded in between. ``w_gate`` /
    ``w_up`` / ``w_down`` are indexed by expert (a tensor [E, ...] or a list of per-expert leaves)."""
    k = topk_idx.shape[1]
    order, offsets, _, _ = plan_reference(topk_idx, len(w_gate))  # routes by expert (stable), -1 last
    order = order[: int(offsets[-1])].long()
    counts = offsets.diff().tolist()
    tok = order // k
    parts = x[tok].split(counts)
    rows = torch.cat([_mlp(p, w_gate[e], w_up[e], w_down[e], limit) for e, p in enumerate(parts)])
    y = torch.zeros_like(x).index_add(0, tok, rows * topk_w.reshape(-1)[order][:, None])
    return y if shared is None else y + _mlp(x, *shared, limit)


@contextmanager
def _no_tf32():
    """fp32 matmuls in full fp32 (no TF32) for the block (torch's newer ``fp32_precision`` setting
    where it has one, else ``allow_tf32``)."""
    m = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") else ("allow_tf32", False)
    before = getattr(m, name)
    setattr(m, name, value)
    try:
        yield
    finally:
        setattr(m, name, before)


def reference(inputs: dict, dy: torch.Tensor, limit=None, store="cpu") -> dict[str, torch.Tensor]:
    """y and every gradient (names ``y`` and :data:`GRAD_NAMES`, the shared expert's where ``inputs``
    has one) of :func:`float32_layer` at ``inputs`` (:func:`mok_cute.bench.shapes.make_inputs`'s
    tensors) for the output gradient ``dy``, fp32, computed on the inputs' device and kept on
    ``store``."""
    def leaf(t):
        return t.detach().float().requires_grad_()

    x, topk_w = leaf(inputs["x"]), leaf(inputs["topk_w"])
    experts = [[p.requires_grad_() for p in inputs[n].detach().float().unbind(0)] for n in ("w_gate", "w_up", "w_down")]
    shared = [leaf(w) for w in inputs.get("shared") or ()]
    with _no_tf32():
        y = float32_layer(x, inputs["topk_idx"], topk_w, *experts, shared or None, limit)
        grads = torch.autograd.grad(y, [x, topk_w, *sum(experts, []), *shared], dy.float(), allow_unused=True,
                                    materialize_grads=True)
    e = len(experts[0])
    out = [grads[0], grads[1]] + [torch.stack([g.to(store) for g in grads[2 + j * e: 2 + (j + 1) * e]])
                                  for j in range(3)] + list(grads[2 + 3 * e:])
    return {"y": y.detach().to(store), **{n: g.to(store) for n, g in zip(GRAD_NAMES, out)}}


def reference_for(shape: Shape, device, seed: int = 0, store="cpu") -> dict[str, torch.Tensor]:
    """:func:`reference` at ``shape``'s benchmark inputs (:func:`make_inputs` with ``seed``: the
    tensors every row of the shape runs on), kept on ``store``."""
    inputs, dy = make_inputs(shape, device, seed)
    return reference(inputs, dy, shape.limit, store)


def rel_l1(got: torch.Tensor, want: torch.Tensor, chunk: int = CHUNK) -> float:
    """``sum |got - want| / sum |want|`` in fp32 per element, fp64 sums, on ``got``'s device
    (``want`` moved there ``chunk`` elements at a time); inf if ``want`` is all zero and ``got`` not."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    g, w = got.detach().reshape(-1), want.detach().reshape(-1)
    num = den = 0.0
    for lo in range(0, w.numel(), chunk):
        gi = g[lo:lo + chunk].float()
        wi = w[lo:lo + chunk].to(gi.device, torch.float32)
        num += float((gi - wi).abs().sum(dtype=torch.float64))
        den += float(wi.abs().sum(dtype=torch.float64))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """:func:`rel_l1` of every tensor ``want`` has (names: ``rel_l1_`` + its name); a name ``got``
    lacks is left out."""
    return {f"rel_l1_{n}": rel_l1(got[n], w) for n, w in want.items() if got.get(n) is not None}

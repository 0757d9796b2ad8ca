"""Timing the mok_cute layer against the torch layer on one GPU (EP = 1).

Method (every implementation on the same inputs, in one process, on one warm GPU): each
implementation's first call compiles its kernels, then ``warmup`` more calls; the forward is
timed under ``torch.no_grad()``, forward + backward as a training step (every gradient set to
None first, as ``zero_grad(set_to_none=True)``, then the forward and ``backward(dy)``). A time
is the mean of ``iters`` back-to-back calls between two CUDA events (the host enqueues the next
call while the GPU runs this one, as in training), after one untimed call; the implementations
take turns within each of ``rounds`` rounds (clock and thermal drift hit them alike) and each
one's median round is reported. Peak memory: the most one forward + backward allocates above
what was allocated before it. First call: the wall seconds of an implementation's first forward +
backward (compiling included), before its warm-up. Peers (:mod:`mok_cute.bench.peers`) join the
rows on the same :func:`leaves` only after every mok row has compiled (that module says why).
"""
from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from mok_cute import MoKConfig, moe
from mok_cute.bench.shapes import Shape, make_inputs
from mok_cute.bench.torch_layer import torch_layer

GRAD_NAMES = ("dx", "dtopk_w", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


@dataclass
class Impl:
    """One timed implementation: ``call(config)`` returns y (``config``: the MoKConfig of a mok row,
    None for the torch layer and peers); ``leaves`` are the tensors whose gradients a step computes (x,
    topk_w, the routed weights, the shared expert's); ``unpack`` maps their gradients (a list, leaves'
    order) to ours by name (:func:`named_grads`; None: ``leaves`` are in :data:`GRAD_NAMES`'s order
    already); ``error`` says why it did not run (empty: it ran); ``times`` holds each round's ms per
    pass ("fwd", "fwdbwd"); ``first_s`` the wall seconds of its first step (:func:`warm`)."""

    name: str
    precision: str
    call: Callable
    leaves: list
    dy: torch.Tensor
    config: MoKConfig | None = None
    error: str = ""
    times: dict = field(default_factory=lambda: {"fwd": [], "fwdbwd": []})
    unpack: Callable | None = None
    first_s: float | None = None

    def forward(self) -> torch.Tensor:
        return self.call(self.config)

    def step(self, config: MoKConfig | None = None) -> torch.Tensor:
        """Forward + backward from cleared gradients (with ``config`` instead of the row's if given); y."""
        self.clear()
        y = self.call(config or self.config)
        torch.autograd.backward(y, self.dy)
        return y

    def clear(self) -> None:
        for p in self.leaves:
            p.grad = None


def leaves(shape: Shape, device, seed: int = 0, local_experts: int | None = None) -> tuple[dict, torch.Tensor]:
    """``(inputs, dy)`` of :func:`mok_cute.bench.shapes.make_inputs` (``local_experts`` passed on) with x,
    topk_w, the routed weights and the shared expert's (``inputs["shared"]``, None without one) requiring
    grad: the tensors every row of the shape runs on (the peers' too: :func:`mok_cute.bench.peers.build`)."""
    inputs, dy = make_inputs(shape, device, seed, local_experts)
    for name in ("x", "topk_w", "w_gate", "w_up", "w_down"):
        inputs[name].requires_grad_()
    if inputs["shared"] is not None:
        inputs["shared"] = tuple(s.requires_grad_() for s in inputs["shared"])
    return inputs, dy


def rows(shape: Shape, inputs: dict, dy: torch.Tensor, precisions, config: dict) -> list[Impl]:
    """The torch layer (BF16) and mok_cute's layer at each precision on :func:`leaves`' ``inputs``;
    ``config``: further MoKConfig fields of the mok rows."""
    routed = {k: v for k, v in inputs.items() if k != "shared"}
    shared = inputs["shared"]
    mok_leaves = [inputs[n] for n in ("x", "topk_w", "w_gate", "w_up", "w_down")] + list(shared or ())
    impls = [torch_impl(shape, inputs, shared, dy)]
    for p in precisions:
        cfg = MoKConfig(**{"validate_routing": False, **config, "precision": p})
        impls.append(Impl(f"mok {p}", p, lambda c: moe(**routed, shared=shared, swiglu_limit=shape.limit, config=c),
                          mok_leaves, dy, cfg))
    return impls


def build(shape: Shape, device, precisions, config: dict, seed: int = 0) -> list[Impl]:
    """:func:`rows` on one shape's :func:`leaves` (``seed``): the torch row, then one per precision."""
    return rows(shape, *leaves(shape, device, seed), precisions, config)


def torch_impl(shape: Shape, i: dict, shared, dy) -> Impl:
    """The torch layer's row on ``i`` (:func:`build`'s leaves; its own [E, 2I, H] gate / up weight,
    whose gradient :func:`named_grads` splits into dw_gate and dw_up)."""
    w1 = torch.cat([i["w_gate"].detach(), i["w_up"].detach()], 1).requires_grad_()
    inter = w1.shape[1] // 2

    def unpack(grads):
        g = list(grads)
        return dict(zip(GRAD_NAMES, [g[0], g[1], g[2][:, :inter], g[2][:, inter:], *g[3:]]))

    return Impl("torch", "bf16", lambda _: torch_layer(i["x"], i["topk_idx"], i["topk_w"], w1, i["w_down"], shared,
                                                       shape.limit),
                [i["x"], i["topk_w"], w1, i["w_down"], *(shared or ())], dy, unpack=unpack)


def warm(impl: Impl, warmup: int) -> None:
    """Compile and warm up ``impl``: its first step (forward + backward, compiling; its wall seconds
    into ``impl.first_s``), then its forward (the no-grad variant's first call) and step ``warmup``
    more times each. A failure is kept in ``impl.error`` (e.g. a precision this GPU's backend does
    not run) instead of raised; an ``impl`` that has an error already is left alone."""
    if impl.error:
        return
    try:
        start = time.perf_counter()
        impl.step()
        torch.cuda.synchronize()
        impl.first_s = time.perf_counter() - start
        with torch.no_grad():
            for _ in range(1 + warmup):
                impl.forward()
        for _ in range(warmup):
            impl.step()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (reported in its row; the other rows still run)
        impl.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    finally:
        impl.clear()


def peak_mb(impl: Impl) -> float:
    """MiB that one forward + backward of ``impl`` allocates above what was allocated before it."""
    impl.clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    impl.step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    impl.clear()
    return peak


def events_ms(fn: Callable, iters: int) -> float:
    """Mean ms of ``iters`` back-to-back calls of ``fn`` between two CUDA events, after one untimed call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_round(impls: list[Impl], iters: int) -> None:
    """One round: each implementation that runs, in turn, its forward then its step (appended to ``times``)."""
    for impl in impls:
        if impl.error:
            continue
        with torch.no_grad():
            impl.times["fwd"].append(events_ms(impl.forward, iters))
        impl.times["fwdbwd"].append(events_ms(impl.step, max(1, iters // 2)))
        impl.clear()


def median_ms(impl: Impl, what: str) -> float | None:
    """The median round's time of ``what`` ("fwd" or "fwdbwd"), None if it did not run."""
    return statistics.median(impl.times[what]) if impl.times[what] else None


def named_grads(impl: Impl) -> dict[str, torch.Tensor]:
    """The gradients the last step left on ``impl``'s leaves, by our names (:data:`GRAD_NAMES`, the
    shared expert's only where it has one), mapped from its own weight layout by ``impl.unpack``."""
    grads = [p.grad for p in impl.leaves]
    return impl.unpack(grads) if impl.unpack else dict(zip(GRAD_NAMES, grads))


def step_outputs(impl: Impl) -> dict[str, torch.Tensor]:
    """y and every gradient (:func:`named_grads`) of one step of ``impl``, where it ran them (the
    caller drops them; ``impl``'s gradients are cleared)."""
    y = impl.step()
    out = {"y": y.detach(), **{n: g.detach() for n, g in named_grads(impl).items()}}
    impl.clear()
    return out


def outputs(impl: Impl) -> dict[str, torch.Tensor]:
    """:func:`step_outputs` on the CPU (names: ``y`` and :data:`GRAD_NAMES`, the shared expert's last
    if it has one)."""
    return {n: t.cpu() for n, t in step_outputs(impl).items()}


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes with its dtype and shape (equal digests: bitwise equal tensors)."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def traced_step(impl: Impl):
    """One step of a mok ``impl`` with ``MoKConfig(trace=True)`` (a separate compiled variant, run
    outside the timing): its ``(forward, backward)`` traces (:class:`mok_cute.trace.Trace`; None for a
    pass that ran no traced fused kernel)."""
    from mok_cute import trace

    impl.clear()
    y = impl.call(replace(impl.config, trace=True))
    torch.cuda.synchronize()
    fwd = trace.last("forward")
    torch.autograd.backward(y, impl.dy)
    torch.cuda.synchronize()
    impl.clear()
    return fwd, trace.last("backward")

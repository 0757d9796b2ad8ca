"""Timing the mok_cute layer against the torch layer on one GPU (EP = 1).

Method (every implementation on the same inputs, in one process, on one warm GPU): each
implementation's first call compiles its kernels, then ``warmup`` more calls; the forward is
timed under ``torch.no_grad()``, forward + backward as a training step (every gradient set to
None first, as ``zero_grad(set_to_none=True)``, then the forward and ``backward(dy)``). A time
is the mean of ``iters`` back-to-back calls between two CUDA events (the host enqueues the next
call while the GPU runs this one, as in training), after one untimed call; the implementations
take turns within each of ``rounds`` rounds (clock and thermal drift hit them alike) and each
one's median round is reported. Peak memory: the most one forward + backward allocates above
what was allocated before it.
"""
from __future__ import annotations

import hashlib
import statistics
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
    None for the torch layer); ``leaves`` are the tensors whose gradients a step computes (x, topk_w,
    the routed weights, the shared expert's); ``error`` says why it did not run (empty: it ran);
    ``times`` holds each round's ms per pass ("fwd", "fwdbwd")."""

    name: str
    precision: str
    call: Callable
    leaves: list
    dy: torch.Tensor
    config: MoKConfig | None = None
    error: str = ""
    times: dict = field(default_factory=lambda: {"fwd": [], "fwdbwd": []})

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


def build(shape: Shape, device, precisions, config: dict, seed: int = 0) -> list[Impl]:
    """The torch layer (BF16) and mok_cute's layer at each precision on one shape's inputs
    (:func:`mok_cute.bench.shapes.make_inputs`); ``config``: further MoKConfig fields of the mok rows."""
    inputs, dy = make_inputs(shape, device, seed)
    for name in ("x", "topk_w", "w_gate", "w_up", "w_down"):
        inputs[name].requires_grad_()
    shared = inputs.pop("shared")
    shared = None if shared is None else tuple(s.requires_grad_() for s in shared)
    w1 = torch.cat([inputs["w_gate"].detach(), inputs["w_up"].detach()], 1).requires_grad_()
    sh_leaves = list(shared or ())
    i = inputs
    impls = [Impl("torch", "bf16", lambda _: torch_layer(i["x"], i["topk_idx"], i["topk_w"], w1, i["w_down"], shared,
                                                         shape.limit), [i["x"], i["topk_w"], w1, i["w_down"], *sh_leaves],
                  dy)]
    mok_leaves = [i["x"], i["topk_w"], i["w_gate"], i["w_up"], i["w_down"], *sh_leaves]
    for p in precisions:
        cfg = MoKConfig(**{"validate_routing": False, **config, "precision": p})
        impls.append(Impl(f"mok {p}", p, lambda c: moe(**inputs, shared=shared, swiglu_limit=shape.limit, config=c),
                          mok_leaves, dy, cfg))
    return impls


def warm(impl: Impl, warmup: int) -> None:
    """Compile (the first call) and warm up ``impl``'s forward and step; a failure is kept in
    ``impl.error`` (e.g. a precision this GPU's backend does not run) instead of raised."""
    try:
        with torch.no_grad():
            for _ in range(1 + warmup):
                impl.forward()
        for _ in range(1 + warmup):
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


def outputs(impl: Impl) -> dict[str, torch.Tensor]:
    """y and every gradient of one step of a mok ``impl`` (names: ``y`` and :data:`GRAD_NAMES`, the
    shared expert's last if it has one), on the CPU."""
    y = impl.step()
    out = {"y": y.detach().cpu()}
    out.update({n: p.grad.detach().cpu() for n, p in zip(GRAD_NAMES, impl.leaves)})
    impl.clear()
    return out


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

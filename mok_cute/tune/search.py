"""The tuner's measurements and search: one layer problem on this GPU (or this rank of an EP group).

Method: the default policy's step runs first (compiling) and its outputs are kept (y, and with a
backward dx, d topk_w and every weight gradient). Then, for each group of :mod:`mok_cute.tune.space`
in turn, each candidate around the current best policy runs once and its outputs must be bitwise
the default's (every policy field is documented as bitwise invariant: a candidate that differs is
a bug, reported and never chosen). The current best and the group's candidates are then timed
side by side: ``rounds`` rounds, the order rotated each round, each a mean of ``iters`` back-to-back
calls between CUDA events (:func:`mok_cute.bench.run.events_ms`); a candidate's time is its median
round. The fastest candidate replaces the current best only when it is faster by more than
``margin``. Last, the default and the winner are timed side by side again (twice the rounds; both
the forward and the forward + backward); a winner not faster than the default there gives way to
the default, so the result is never slower than the default as measured. At EP > 1 every rank runs
the same sequence and a time is the slowest rank's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from mok_cute.bench.shapes import LayerSize
from mok_cute import tuning
from mok_cute.config import MoKConfig
from mok_cute.layers import paths as P
from mok_cute.ops import moe
from mok_cute.policy import KernelPolicy
from mok_cute.tune import space


@dataclass(frozen=True)
class Problem(LayerSize):
    """One layer per rank (:class:`~mok_cute.bench.shapes.LayerSize`, E experts in all: E / ep per rank), the
    SwiGLU clamp ``limit`` (None: none), the precision, and whether the backward is tuned too."""

    precision: str = "bf16"
    limit: float | None = None
    backward: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.experts % self.ep:
            raise ValueError(f"experts ({self.experts}) must be a multiple of ep ({self.ep})")

    @property
    def objective(self) -> str:
        """The pass every choice is timed by: "fwdbwd" (a training step) or "fwd"."""
        return "fwdbwd" if self.backward else "fwd"


@dataclass
class Trial:
    """One candidate: its group and fields, its median ms and the current best's in the same rounds
    (``ratio`` = best / candidate: > 1 is faster), bitwise the default or not, adopted or not, error."""

    group: str
    fields: dict
    ms: float | None = None
    base_ms: float | None = None
    bitwise: bool | None = None
    adopted: bool = False
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return None if not self.ms or not self.base_ms else self.base_ms / self.ms


@dataclass
class Result:
    """What :func:`search` found: the winning policy (``KernelPolicy()``: the default is the fastest
    measured), the tuning key, the default's and the winner's ms per pass measured side by side,
    and every trial."""

    policy: KernelPolicy
    key: tuning.Key
    default_ms: dict
    tuned_ms: dict
    objective: str
    trials: list = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Default over tuned time of the objective pass (1.0: the default kept)."""
        return self.default_ms[self.objective] / self.tuned_ms[self.objective]

    def table(self) -> str:
        """The trials and the verdict as a Markdown table plus a summary line."""
        lines = ["| group | candidate | ms | current best ms | speedup | bitwise | adopted |", "|---|---|---|---|---|---|---|"]
        for t in self.trials:
            ms = "-" if t.ms is None else f"{t.ms:.3f}"
            base = "-" if t.base_ms is None else f"{t.base_ms:.3f}"
            ratio = "-" if t.ratio is None else f"{t.ratio:.3f}x"
            bit = {True: "yes", False: "NO", None: "-"}[t.bitwise]
            lines.append(f"| {t.group} | {space.describe(t.fields)}{' (' + t.error + ')' if t.error else ''} | {ms} | "
                         f"{base} | {ratio} | {bit} | {'yes' if t.adopted else ''} |")
        d, w = self.default_ms, self.tuned_ms
        lines.append("")
        lines.append(f"winner: {self.policy!r}; " + ", ".join(
            f"{p} {d[p]:.3f} -> {w[p]:.3f} ms ({d[p] / w[p]:.3f}x)" for p in d))
        return "\n".join(lines)


class Bench:
    """The problem's layer on this rank: seeded inputs, one step under a policy, its outputs, and
    side-by-side timing. ``group``: the EP group (None at EP = 1); ``backend``: MoKConfig's."""

    def __init__(self, problem: Problem, device, backend: str = "auto", group=None, seed: int = 0):
        from mok_cute.bench.run import leaves
        from mok_cute.bench.shapes import Shape

        self.p, self.device, self.backend, self.group = problem, torch.device(device), backend, group
        rank = 0 if group is None else torch.distributed.get_rank(group)
        pr = problem
        shape = Shape("tune", pr.tokens, pr.hidden, pr.inter, pr.experts, pr.topk, pr.shared, pr.limit)
        i, self.dy = leaves(shape, self.device, seed + 1000 * rank, local_experts=pr.experts // pr.ep)
        self.x, self.topk_idx, self.topk_w, self.shared = i["x"], i["topk_idx"], i["topk_w"], i["shared"]
        self.weights = (i["w_gate"], i["w_up"], i["w_down"])
        self.leaves = [self.x, self.topk_w, *self.weights, *(self.shared or ())]

    def config(self, policy: KernelPolicy) -> MoKConfig:
        """The config a trial runs: ``policy`` exactly (no tuning file), no routing check."""
        return MoKConfig(precision=self.p.precision, policy=policy, backend=self.backend, tuned=False,
                         validate_routing=False)

    def call(self, config: MoKConfig, backward: bool) -> torch.Tensor:
        """One forward (with ``backward``: from cleared gradients, then the backward); y."""
        for t in self.leaves:
            t.grad = None
        if not backward:
            with torch.no_grad():
                return self._forward(config)
        y = self._forward(config)
        torch.autograd.backward(y, self.dy)
        return y

    def _forward(self, config: MoKConfig) -> torch.Tensor:
        return moe(self.x, self.topk_idx, self.topk_w, *self.weights, shared=self.shared, swiglu_limit=self.p.limit,
                   config=config, group=self.group)

    def outputs(self, policy: KernelPolicy) -> list[torch.Tensor]:
        """y and (with the problem's backward) every leaf's gradient of one step under ``policy``."""
        y = self.call(self.config(policy), self.p.backward).detach()
        out = [y] + ([t.grad for t in self.leaves] if self.p.backward else [])
        for t in self.leaves:
            t.grad = None
        return out

    def bitwise(self, policy: KernelPolicy, want: list[torch.Tensor]) -> bool:
        """Whether one step under ``policy`` gives ``want`` bitwise (on every rank)."""
        got = self.outputs(policy)
        same = len(got) == len(want) and all(a is not None and torch.equal(a, b) for a, b in zip(got, want))
        return bool(self._reduce([0.0 if same else 1.0])[0] == 0.0)

    def time(self, policies: list[KernelPolicy], what: str, rounds: int, iters: int) -> list[float]:
        """Median ms per call of each policy for pass ``what`` ("fwd" or "fwdbwd"), side by side (the
        module doc); at EP > 1 the slowest rank's."""
        configs = [self.config(p) for p in policies]
        backward = what == "fwdbwd"
        n = max(1, iters // 2) if backward else iters
        runs: list[list[float]] = [[] for _ in configs]
        for r in range(rounds):
            for j in range(len(configs)):
                i = (j + r) % len(configs)
                runs[i].append(self._ms(lambda: self.call(configs[i], backward), n))
        for t in self.leaves:
            t.grad = None
        return self._reduce([statistics.median(v) for v in runs], op="max")

    def _ms(self, fn, iters: int) -> float:
        if self.device.type == "cuda":
            from mok_cute.bench.run import events_ms

            return events_ms(fn, iters)
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters

    def _reduce(self, values: list[float], op: str = "max") -> list[float]:
        """``values`` reduced over the EP group (max), unchanged at EP = 1."""
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()


def search(bench: Bench, key: tuning.Key, arch: str, rounds: int = 5, iters: int = 10, margin: float = 0.01,
           bar=None) -> Result:
    """The fastest policy for ``bench``'s problem found by coordinate descent over
    :mod:`mok_cute.tune.space` (the module doc); ``bar``: a tqdm progress bar or None."""
    p = bench.p
    call = P.Call(p.precision, p.ep, shared=p.shared > 0, cuda=bench.device.type == "cuda")
    default = best = KernelPolicy()
    _note(bar, "default: compiling")
    want = bench.outputs(default)
    trials: list[Trial] = []
    for group in space.groups(p.backward):
        opts = space.options(group, best, p.precision, arch, call)
        ok = []
        for fields in opts:
            _note(bar, f"{group.name}: {space.describe(fields)}")
            trial = Trial(group.name, fields)
            try:
                trial.bitwise = bench.bitwise(space.with_fields(best, fields), want)
            except Exception as e:  # noqa: BLE001 (a candidate that fails is reported, the search goes on)
                trial.error = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            trials.append(trial)
            if trial.bitwise:
                ok.append(trial)
        if ok:
            ms = bench.time([best] + [space.with_fields(best, t.fields) for t in ok], p.objective, rounds, iters)
            for t, m in zip(ok, ms[1:]):
                t.ms, t.base_ms = m, ms[0]
            win = min(ok, key=lambda t: t.ms)
            if win.ms < ms[0] * (1 - margin):
                win.adopted = True
                best = space.with_fields(best, win.fields)
    _note(bar, "default against the winner")
    passes = ("fwd", "fwdbwd") if p.backward else ("fwd",)
    final = {w: bench.time([default, best], w, 2 * rounds, iters) for w in passes}
    if final[p.objective][1] >= final[p.objective][0]:
        best = default
        final = {w: [v[0], v[0]] for w, v in final.items()}
    return Result(best, key, {w: v[0] for w, v in final.items()}, {w: v[1] for w, v in final.items()}, p.objective,
                  trials)


def _note(bar, text: str) -> None:
    if bar is not None:
        bar.set_description(text)
        bar.update()

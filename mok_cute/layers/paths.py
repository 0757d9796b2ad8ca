"""Which forward and backward paths each arch runs, and the one decision per layer call.

A GPU backend runs a layer call's forward along a :class:`~mok_cute.config.ForwardPath` and its
backward along a :class:`~mok_cute.config.BackwardPath`. :func:`decide` picks both once per call
from the config, the arch and what the call asks for (:class:`Call`), by the capability table
:data:`TABLE`; the forward state keeps the result (:class:`Paths`), so the backward runs the path
decided with the forward (also when ``activations="recompute"`` runs the forward again: the same
call, the same decision). Every path gives bitwise the same results (the device checks compare
them); they differ in launches, memory and speed.

The table (``default``: the decision may take the path when the config leaves it None; "after
FUSED": the path reads the fused forward's state; every path runs with a shared expert and with
each ``activations`` policy):

======  ========  ===========  =====================================  ==========================================
arch    pass      path         EP = 1                                 EP > 1
======  ========  ===========  =====================================  ==========================================
sm90    forward   FUSED        bf16, mxfp8 (default)                  bf16, mxfp8; no shared_gate (default)
sm90    forward   UNFUSED      bf16, mxfp8, fp8_block (default)       bf16, mxfp8; no shared_gate (default)
sm90    backward  FUSED        bf16, mxfp8 (default)                  bf16, mxfp8 after FUSED; no shared_gate
                                                                      (default)
sm90    backward  FUSED_WHOLE  bf16, mxfp8 after FUSED; no            bf16, mxfp8 after FUSED (the same launch
                               shared_gate, no main_grads at mxfp8,   as FUSED); no shared_gate
                               no biases
sm90    backward  UNFUSED      bf16, mxfp8, fp8_block (default)       bf16, mxfp8; no shared_gate (default)
sm100   forward   FUSED        bf16, mxfp8                            bf16, mxfp8; no shared_gate
sm100   forward   UNFUSED      bf16, mxfp8 (default)                  bf16, mxfp8; no shared_gate
sm100   backward  FUSED        bf16, mxfp8                            bf16, mxfp8 after FUSED; no shared_gate
sm100   backward  FUSED_WHOLE  bf16, mxfp8 after FUSED; no            bf16, mxfp8 after FUSED (the same launch
                               shared_gate                            as FUSED); no shared_gate
sm100   backward  UNFUSED      bf16, mxfp8 (default)                  bf16, mxfp8; no shared_gate (default)
======  ========  ===========  =====================================  ==========================================

SM100 has no fp8_block row: its backend runs a layer asking for fp8_block as mxfp8 (hardware block scales;
:meth:`~mok_cute.layers.grouped.GroupedExpertBackend.run_config`, warned once), before this table is read.

Expert biases (gpt-oss; the "biases" feature) run at EP = 1 and bf16 only, on every path but FUSED_WHOLE
(sm100: compile-verified only, like all its kernels); nowhere at EP > 1.

The paths are the config's ``kernel_policy`` fields (``MoKConfig.forward_path`` /
``backward_path`` or ``KernelPolicy``'s); the GEMM tiles and stages of the kernels each path runs
are checked by :func:`mok_cute.layers.tiles.check` (ValueError naming the field and the allowed
values, never silently ignored).

So the defaults are: SM90 FUSED both ways where the table allows it, else UNFUSED (fp8_block
runs unfused: that is its default, not an error); SM100 UNFUSED both ways at EP = 1 (its fused
kernels are compile-verified only, never run on a Blackwell GPU) and no default forward at
EP > 1 (ask for one: ``MoKConfig(forward_path=...)``). FUSED_WHOLE is never a default: FUSED
measured faster on an H200 (docs/design-decisions.md, 2026-12-01). The fused paths' kernels need CUDA
tensors: elsewhere (the CPU tests' emulated kernels) the defaults are UNFUSED; an explicit path
is taken as asked. A path the table does not allow for the call, asked for explicitly, raises
NotImplementedError naming the path, the arch, the precision and the feature; so does a call no
path runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mok_cute.config import BackwardPath, ForwardPath, MoKConfig
from mok_cute.dsl import env

ARCHES = ("sm90", "sm100")
EP1, EPN = "EP = 1", "EP > 1"
BF16_MX = ("bf16", "mxfp8")
ALL = ("bf16", "mxfp8", "fp8_block")
FEATURES = {"shared": "the shared expert", "shared_gate": "shared_gate", "main_grads": "main_grads",
            "recompute": "activations recompute", "biases": "expert biases"}  # Call's feature fields, as messages
#                                                                            name them


@dataclass(frozen=True)
class Runs:
    """Where one path runs at one EP kind: ``precisions``; ``default``: the decision may take it
    when the config leaves the path None; ``not_with``: ``(feature, precisions)`` pairs it does
    not run (the :class:`Call` feature at those precisions); ``after_fused_forward``: it reads the
    fused forward's state (a backward path)."""

    precisions: tuple[str, ...]
    default: bool = True
    not_with: tuple[tuple[str, tuple[str, ...]], ...] = ()
    after_fused_forward: bool = False


_NO_GATE = (("shared_gate", ALL),)
_BF16_BIASES = (("biases", ("mxfp8", "fp8_block")),)  # the kernels' epilogues add expert biases at BF16 only
_NO_BIASES = (("biases", ALL),)
_EPN = _NO_GATE + _NO_BIASES  # EP > 1: neither the output gate nor expert biases
_EP_FUSED_BWD = Runs(BF16_MX, not_with=_EPN, after_fused_forward=True)  # one launch per rank

TABLE: dict[str, dict[str, dict]] = {
    "sm90": {
        "forward": {
            ForwardPath.FUSED: {EP1: Runs(BF16_MX, not_with=_BF16_BIASES), EPN: Runs(BF16_MX, not_with=_EPN)},
            ForwardPath.UNFUSED: {EP1: Runs(ALL, not_with=_BF16_BIASES), EPN: Runs(BF16_MX, not_with=_EPN)},
        },
        "backward": {
            BackwardPath.FUSED: {EP1: Runs(BF16_MX, not_with=_BF16_BIASES), EPN: _EP_FUSED_BWD},
            BackwardPath.FUSED_WHOLE: {
                EP1: Runs(BF16_MX, default=False, not_with=_NO_GATE + _NO_BIASES + (("main_grads", ("mxfp8",)),),
                          after_fused_forward=True),
                EPN: replace(_EP_FUSED_BWD, default=False)},
            BackwardPath.UNFUSED: {EP1: Runs(ALL, not_with=_BF16_BIASES), EPN: Runs(BF16_MX, not_with=_EPN)},
        },
    },
    "sm100": {
        "forward": {
            ForwardPath.FUSED: {EP1: Runs(BF16_MX, default=False, not_with=_BF16_BIASES),
                                EPN: Runs(BF16_MX, default=False, not_with=_EPN)},
            ForwardPath.UNFUSED: {EP1: Runs(BF16_MX, not_with=_BF16_BIASES),
                                  EPN: Runs(BF16_MX, default=False, not_with=_EPN)},
        },
        "backward": {
            BackwardPath.FUSED: {EP1: Runs(BF16_MX, default=False, not_with=_BF16_BIASES),
                                 EPN: replace(_EP_FUSED_BWD, default=False)},
            BackwardPath.FUSED_WHOLE: {
                EP1: Runs(BF16_MX, default=False, not_with=_NO_GATE + _NO_BIASES, after_fused_forward=True),
                EPN: replace(_EP_FUSED_BWD, default=False)},
            BackwardPath.UNFUSED: {EP1: Runs(BF16_MX, not_with=_BF16_BIASES), EPN: Runs(BF16_MX, not_with=_EPN)},
        },
    },
}
# the order the decision tries the paths in when the config leaves one None (entries marked default only)
_ORDER = {"forward": (ForwardPath.FUSED, ForwardPath.UNFUSED),
          "backward": (BackwardPath.FUSED, BackwardPath.UNFUSED)}


@dataclass(frozen=True)
class Call:
    """What one layer call asks for, as the path decision reads it: ``precision``, the
    expert-parallel size ``ep``, the features (a shared expert, its output gate, ``main_grads``,
    ``activations`` other than "save", the routed experts' biases) and whether its tensors are on a CUDA
    device."""

    precision: str
    ep: int = 1
    shared: bool = False
    shared_gate: bool = False
    main_grads: bool = False
    recompute: bool = False
    biases: bool = False
    cuda: bool = True

    @classmethod
    def of(cls, inp, config: MoKConfig, ep: int) -> Call:
        """The call of the layer inputs ``inp`` (:class:`~mok_cute.layers.select.MoEInputs`)."""
        return cls(config.precision, ep, inp.shared is not None, inp.shared_gate is not None,
                   inp.main_grads is not None, config.activations != "save", inp.biases is not None, inp.x.is_cuda)

    def describe(self) -> str:
        """E.g. ``EP > 1, precision 'bf16', with shared_gate``."""
        feats = [FEATURES[f] for f in FEATURES if getattr(self, f)]
        return (f"{EP1 if self.ep == 1 else EPN}, precision {self.precision!r}"
                + (f", with {', '.join(feats)}" if feats else ""))


@dataclass(frozen=True)
class Paths:
    """The paths one layer call runs: decided with its forward (:func:`decide`), kept in its state."""

    forward: ForwardPath
    backward: BackwardPath


def runs(arch: str, pass_: str, path, ep: int) -> Runs | None:
    """The table's entry for ``path`` of ``pass_`` ("forward" / "backward") on ``arch`` at
    expert-parallel size ``ep`` (None: the path does not run there)."""
    return TABLE[arch][pass_][path].get(EP1 if ep == 1 else EPN)


def precisions(arch: str) -> tuple[str, ...]:
    """Every precision some path of ``arch`` runs (at EP = 1)."""
    return tuple(p for p in ALL if any(p in runs(arch, "forward", f, 1).precisions for f in ForwardPath))


def refusal(arch: str, pass_: str, path, call: Call, forward: ForwardPath | None = None) -> str | None:
    """Why ``path`` of ``pass_`` cannot run ``call`` on ``arch`` (a backward path after the
    forward path ``forward``), or None when it can."""
    r = runs(arch, pass_, path, call.ep)
    if r is None:
        return f"does not run at {EP1 if call.ep == 1 else EPN}"
    if call.precision not in r.precisions:
        return f"runs precision {', '.join(r.precisions)} only here, not {call.precision!r}"
    for feature, at in r.not_with:
        if getattr(call, feature) and call.precision in at:
            return f"does not run with {FEATURES[feature]}" + ("" if at == ALL else f" at precision {call.precision!r}")
    if r.after_fused_forward and forward is not ForwardPath.FUSED:
        return f"runs after forward_path=FUSED only, not after {forward.name if forward else None}"
    return None


def _choose(arch: str, pass_: str, asked, call: Call, forward: ForwardPath | None):
    """The path of ``pass_``: ``asked`` when the table allows it (else NotImplementedError), or,
    when None, the first default path that runs the call."""
    if arch not in TABLE:
        raise NotImplementedError(f"mok_cute: no path table for arch {arch!r} (known: {', '.join(ARCHES)})")
    if asked is not None:
        why = refusal(arch, pass_, asked, call, forward)
        if why is not None:
            raise NotImplementedError(f"mok_cute backend {arch!r}: {call.describe()}: {pass_}_path={asked.name} {why}")
        return asked
    reasons = []
    for path in _ORDER[pass_]:
        r = runs(arch, pass_, path, call.ep)
        if r is not None and not r.default:
            why = "runs here only when asked for (MoKConfig." + pass_ + "_path)"
        elif not call.cuda and path.value != "unfused":
            why = "needs CUDA tensors"
        else:
            why = refusal(arch, pass_, path, call, forward)
        if why is None:
            return path
        reasons.append(f"{path.name} {why}")
    raise NotImplementedError(f"mok_cute backend {arch!r}: {call.describe()}: no default {pass_} path runs this call "
                              f"({'; '.join(reasons)})")


def decide(config: MoKConfig, arch: str, call: Call) -> Paths:
    """The forward and the backward path of one layer call on ``arch`` ("sm90", "sm100"): the
    config's (``kernel_policy``'s) ``forward_path`` / ``backward_path`` where given
    (NotImplementedError naming the path, arch, precision and feature when the table does not allow
    it), else the arch's default (see the module docstring). Runs on any machine: it reads no device."""
    policy = config.kernel_policy
    forward = _choose(arch, "forward", policy.forward_path, call, None)
    return Paths(forward, _choose(arch, "backward", policy.backward_path, call, forward))


def decide_expert_mlp(config: MoKConfig, arch: str, call: Call) -> BackwardPath:
    """The backward path of :func:`mok_cute.expert_mlp` (rows already grouped): FUSED (the fused
    backward core, one launch) or UNFUSED (the separate kernels), as :func:`decide` picks them
    after an unfused forward; its forward is the arch's grouped GEMMs (``forward_path`` is the
    routed layer's and does not apply; FUSED_WHOLE needs the layer's routing and is refused)."""
    return _choose(arch, "backward", config.kernel_policy.backward_path, call, ForwardPath.UNFUSED)


_TRACED: dict[tuple[str, bool], MoKConfig] = {}


def with_trace(config: MoKConfig) -> MoKConfig:
    """``config`` with ``trace`` a bool: its own when given, else the environment's
    (:func:`mok_cute.dsl.env.trace`, read now, once per layer call); the layer passes this config
    down, so the kernels read ``config.trace`` and never the environment."""
    if config.trace is not None:
        return config
    on = env.trace()
    key = (config._key, on)
    hit = _TRACED.get(key)
    if hit is None:
        hit = _TRACED[key] = replace(config, trace=on)
    return hit

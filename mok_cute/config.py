"""MoKConfig: every knob of the fused MoE layer, validated on construction."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import Enum

from mok_cute.policy import BackwardPath, ForwardPath, GemmTiles, KernelPolicy  # the path enums: re-exported
from mok_cute.policy import _choice, _enum  # the checks both dataclasses share

PRECISIONS = ("bf16", "mxfp8", "fp8_block")
ACTIVATIONS = ("save", "recompute", "budget")
BACKENDS = ("auto", "reference", "sm90", "sm100")
TRANSPORTS = ("plain", "bulk")
KNOBS = ("minibatch_tokens", "comm_sms_fwd", "comm_sms_bwd", "forward_path", "backward_path")  # KernelPolicy's names
TILE_KNOBS = ("tile_m", "tile_n", "tile_k")  # KernelPolicy.tiles' fields


@dataclass(frozen=True)
class MoKConfig:
    """Configuration of :func:`mok_cute.moe`.

    precision: "bf16", "mxfp8" (E4M3 + E8M0 per 32 along K) or "fp8_block" (E4M3 + fp32
        scales per 1x128 activation tile and 128x128 weight block); see mok_cute.reference.
    policy: a :class:`~mok_cute.policy.KernelPolicy` (or a mapping of its fields): how the GPU
        kernels run (paths, ring, comm CTAs, tiles and stages per GEMM); None: every choice its
        tuned default. Read the merged choices from :attr:`kernel_policy`.
    tuned: whether a GPU layer call fills the policy fields left None from a tuning file entry
        matching its GPU, shape, EP and precision (:mod:`mok_cute.tuning`, written by
        ``python -m mok_cute.tune``; explicit fields always win); False: the built-in defaults.
        Every policy field is bitwise invariant, so this changes speed only.
    minibatch_tokens, comm_sms_fwd, comm_sms_bwd: knobs for the policy's fields of the same names
        (see :class:`~mok_cute.policy.KernelPolicy`: the ring's tokens, a multiple of 256; the comm
        CTAs per pass, even, >= 2); None (default): the policy's, else the tuned default (1024
        tokens; 16 forward CTAs at EP = 1, 40 at EP > 1, 28 backward: :meth:`comm_ctas_fwd`,
        :meth:`comm_ctas_bwd`). A knob and the policy may not set one choice to two different
        values (ValueError): each choice has one source.
    tile_m / tile_n / tile_k: knobs for ``policy.tiles`` (every GEMM the call runs, where its own
        ``GemmTiles`` leaves the field None); a value a GEMM of the call cannot run raises
        ValueError naming the field and the allowed values (the reference backend ignores tiles).
    backend: "auto" (by device capability), "reference" (pure torch), "sm90", "sm100".
    device_timeout_s: bound on any device-side wait for a peer; exceeding it raises
        RuntimeError on the host instead of hanging.
    activations: what the forward keeps for the backward: "save" (default: its activations, gu, h
        and the GEMM2 rows, as the backward reads them) or "recompute" (only the layer's inputs,
        which autograd keeps anyway; the backward runs the forward once more, without autograd,
        then the backward: the same gradients bitwise, the activations' memory freed between the
        passes at the cost of a second forward). At EP > 1 the second forward is collective like
        the first. "budget" (with ``activation_budget_mb``): a layer call keeps its activations
        while all the calls of this process that kept theirs and await their backward hold at most
        that many MiB, else it recomputes ("keep what fits, recompute the rest", per layer call in
        forward order; a call's activations are released by its backward).
    forward_path / backward_path: knobs for the policy's paths, :class:`ForwardPath` /
        :class:`BackwardPath` (or their string values); None (default): the arch's default (SM90:
        FUSED both ways; SM100: UNFUSED, its fused kernels being compile-verified only). Every path
        gives bitwise the same results.
        A path an arch cannot run for the call (precision, EP, features) raises
        NotImplementedError naming it. The reference backend ignores both.
    comm_transport: how rows move between ranks at EP > 1: "plain" (default: 16-byte vector
        loads / stores through registers) or "bulk" (``cp.async.bulk`` through shared memory);
        bitwise the same rows.
    trace: the megakernels write a task trace (``mok_cute.trace``); None (default): the
        environment variable ``MOK_CUTE_TRACE`` (mok_cute.dsl.env); an explicit value wins.
    validate_routing: check topk_idx values before the step (one host sync; turn off for
        CUDA-graph capture). Off, an id outside [-1, E) is skipped like a -1 slot (EP = 1; the
        EP > 1 plan likewise) and raised as RuntimeError by a later call or
        ``mok_cute.check_errors()``.
    """

    precision: str = "bf16"
    minibatch_tokens: int | None = None
    comm_sms_fwd: int | None = None
    comm_sms_bwd: int | None = None
    tile_m: int | None = None
    tile_n: int | None = None
    tile_k: int | None = None
    backend: str = "auto"
    device_timeout_s: float = 30.0
    validate_routing: bool = True
    activations: str = "save"
    activation_budget_mb: float | None = None
    forward_path: ForwardPath | None = None
    backward_path: BackwardPath | None = None
    comm_transport: str = "plain"
    trace: bool | None = None
    policy: KernelPolicy | None = None
    tuned: bool = True

    def __post_init__(self) -> None:
        for name, enum in (("forward_path", ForwardPath), ("backward_path", BackwardPath)):
            object.__setattr__(self, name, _enum(name, getattr(self, name), enum))
        if isinstance(self.policy, Mapping):  # a serialized config's (see _key)
            object.__setattr__(self, "policy", KernelPolicy(**self.policy))
        if self.policy is not None and not isinstance(self.policy, KernelPolicy):
            raise TypeError(f"policy must be a KernelPolicy (or a mapping of its fields), got "
                            f"{type(self.policy).__name__}")
        object.__setattr__(self, "_policy", _merged(self))
        _choice("comm_transport", self.comm_transport, TRANSPORTS)
        if self.trace is not None and not isinstance(self.trace, bool):
            raise TypeError(f"trace must be a bool or None, got {type(self.trace).__name__}")
        _choice("precision", self.precision, PRECISIONS)
        _choice("activations", self.activations, ACTIVATIONS)
        b = self.activation_budget_mb
        if (self.activations == "budget") != (b is not None):
            raise ValueError(f"activation_budget_mb must be given exactly with activations='budget', got "
                             f"activations={self.activations!r}, activation_budget_mb={b!r}")
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0):
            raise ValueError(f"activation_budget_mb must be a finite number of MiB >= 0, got {b!r}")
        _choice("backend", self.backend, BACKENDS)
        t = self.device_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"device_timeout_s must be a positive finite number of seconds, got {t!r}")
        if not isinstance(self.tuned, bool):
            raise TypeError(f"tuned must be a bool, got {type(self.tuned).__name__}")
        if not isinstance(self.validate_routing, bool):
            raise TypeError(f"validate_routing must be a bool, got {type(self.validate_routing).__name__}")
        # the layer's custom ops take the config as this string (read without tracing under torch.compile)
        object.__setattr__(self, "_key", json.dumps(asdict(self), sort_keys=True, default=_plain))

    @property
    def kernel_policy(self) -> KernelPolicy:
        """The :class:`~mok_cute.policy.KernelPolicy` the GPU backends run: ``policy`` with the knobs
        given here (``minibatch_tokens``, ..., ``tile_n``) folded in; None fields: tuned defaults."""
        return self._policy

    def comm_ctas_fwd(self, ep: int) -> int:
        """The forward's comm CTAs at expert-parallel size ``ep``: ``comm_sms_fwd`` (knob or policy), or
        its default (:meth:`KernelPolicy.forward_comm_ctas <mok_cute.policy.KernelPolicy.forward_comm_ctas>`)."""
        return self._policy.forward_comm_ctas(ep)

    def comm_ctas_bwd(self) -> int:
        """The backward's comm CTAs: ``comm_sms_bwd`` (knob or policy), or its default."""
        return self._policy.backward_comm_ctas()


def _merged(config: MoKConfig) -> KernelPolicy:
    """``config.policy`` with the knobs ``config`` sets folded in (validated as the policy's fields);
    ValueError for a choice set by both to different values."""
    knobs = {n: getattr(config, n) for n in KNOBS if getattr(config, n) is not None}
    tiles = {n: getattr(config, n) for n in TILE_KNOBS if getattr(config, n) is not None}
    given = KernelPolicy(**knobs, tiles=GemmTiles(**tiles)).given()  # validates the knobs
    policy = config.policy or KernelPolicy()
    have = policy.given()
    for name, v in given.items():
        if name in have and have[name] != v:
            knob = name.removeprefix("tiles.")
            raise ValueError(f"{knob} is given twice, MoKConfig({knob}={v!r}) and policy.{name} = {have[name]!r}: "
                             f"give it once")
    if not given:
        return policy
    return KernelPolicy(**{**asdict(policy), **knobs, "tiles": {**asdict(policy.tiles), **tiles}})


def _plain(v):
    """JSON form of an enum field (its string value)."""
    if isinstance(v, Enum):
        return v.value
    raise TypeError(f"not JSON serializable: {v!r}")

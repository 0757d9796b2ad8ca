"""MoKConfig: every knob of the fused MoE layer, validated on construction."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from enum import Enum

PRECISIONS = ("bf16", "mxfp8", "fp8_block")
ACTIVATIONS = ("save", "recompute", "budget")
BACKENDS = ("auto", "reference", "sm90", "sm100")
TILE_M = (64, 128, 256)
TILE_N = (64, 128, 192, 256)
TILE_K = (32, 64, 128)


TRANSPORTS = ("plain", "bulk")


class ForwardPath(str, Enum):
    """What runs in a forward on a GPU backend (chosen once per call by the layer)."""

    FUSED = "fused"
    """One persistent megakernel after the routing plan: gather (or pull), GEMM1 + SwiGLU, GEMM2,
    the (token, slot) rows and the fixed-order slot sum with the shared expert, in one launch."""
    UNFUSED = "unfused"
    """The same math as separate launches (gather, grouped GEMM1 + SwiGLU, grouped GEMM2, slot
    sum); bitwise the fused path on SM90. The fallback and the test oracle."""


class BackwardPath(str, Enum):
    """What runs in a backward on a GPU backend (chosen once per call by the layer)."""

    FUSED = "fused"
    """A prologue (routed dy rows, d topk_w, x rows) then one persistent launch: dgrad2 +
    dSwiGLU, dgrad1, the three weight gradients, the dx scatter and the fixed-order dx slot sum;
    the shared expert's backward beside it. The fastest measured on SM90."""
    FUSED_WHOLE = "fused_whole"
    """The whole backward in one launch: also the prologue's rows (by the comm CTAs) and the
    shared expert's tiles; ``main_grads`` accumulated in its epilogue."""
    UNFUSED = "unfused"
    """The same math as separate launches; bitwise the fused paths. Fallback and test oracle."""


COMM_SMS_FWD_EP1 = 16  # the fused forward's gather CTAs at EP = 1 by default
COMM_SMS_FWD_EP = 40  # the forward's comm CTAs at EP > 1 by default (not yet tuned on two GPUs)


@dataclass(frozen=True)
class MoKConfig:
    """Configuration of :func:`mok_cute.moe`.

    precision: "bf16", "mxfp8" (E4M3 + E8M0 per 32 along K) or "fp8_block" (E4M3 + fp32
        scales per 1x128 activation tile and 128x128 weight block); see mok_cute.reference.
    minibatch_tokens: the fused forward's ring of gathered rows holds the routed rows of this
        many tokens (``minibatch_tokens * k`` rows, in slots of 128), reused as GEMM1 consumes
        them, so its memory does not grow with T; a multiple of 256. 512-8192 measured within
        noise of each other on one H200 (docs/benchmarks.md).
    comm_sms_fwd / comm_sms_bwd: SMs given to communication in each pass; even, >= 2. The fused
        forward's row-gathering CTAs (clamped to the grid) and the unfused EP > 1 path's forward /
        backward comm kernels' CTAs. ``comm_sms_fwd`` None (default): :data:`COMM_SMS_FWD_EP1` at
        EP = 1 (8-16 measured best on one H200, docs/benchmarks.md), :data:`COMM_SMS_FWD_EP` at
        EP > 1 (see :meth:`comm_ctas_fwd`).
    tile_m / tile_n / tile_k: GEMM tile override (M = tokens, N = output features, K =
        reduction); None (default): each backend's tuned tiles per precision. The GPU backends
        do not take overrides yet and raise NotImplementedError for one (the reference ignores
        tiles).
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
    forward_path / backward_path: :class:`ForwardPath` / :class:`BackwardPath` (or their string
        values); None (default): the arch's default (SM90: FUSED both ways; SM100: UNFUSED, its
        fused kernels being compile-verified only). Every path gives bitwise the same results.
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
    minibatch_tokens: int = 1024
    comm_sms_fwd: int | None = None
    comm_sms_bwd: int = 28
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

    def __post_init__(self) -> None:
        for name, enum in (("forward_path", ForwardPath), ("backward_path", BackwardPath)):
            object.__setattr__(self, name, _enum(name, getattr(self, name), enum))
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
        _int("minibatch_tokens", self.minibatch_tokens)
        if self.minibatch_tokens < 256 or self.minibatch_tokens % 256:
            raise ValueError(f"minibatch_tokens must be a positive multiple of 256, got {self.minibatch_tokens}")
        for name in ("comm_sms_fwd", "comm_sms_bwd"):
            v = getattr(self, name)
            if v is None and name == "comm_sms_fwd":
                continue
            _int(name, v)
            if v < 2 or v % 2:
                raise ValueError(f"{name} must be an even integer >= 2, got {v}")
        for name, allowed in (("tile_m", TILE_M), ("tile_n", TILE_N), ("tile_k", TILE_K)):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name))
                _choice(name, getattr(self, name), allowed)
        t = self.device_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"device_timeout_s must be a positive finite number of seconds, got {t!r}")
        if not isinstance(self.validate_routing, bool):
            raise TypeError(f"validate_routing must be a bool, got {type(self.validate_routing).__name__}")
        # the layer's custom ops take the config as this string (read without tracing under torch.compile)
        object.__setattr__(self, "_key", json.dumps(asdict(self), sort_keys=True, default=_plain))


    def comm_ctas_fwd(self, ep: int) -> int:
        """The forward's comm CTAs at expert-parallel size ``ep``: ``comm_sms_fwd``, or its default."""
        if self.comm_sms_fwd is not None:
            return self.comm_sms_fwd
        return COMM_SMS_FWD_EP1 if ep == 1 else COMM_SMS_FWD_EP


def _plain(v):
    """JSON form of an enum field (its string value)."""
    if isinstance(v, Enum):
        return v.value
    raise TypeError(f"not JSON serializable: {v!r}")


def _enum(name: str, v, enum):
    """``v`` as a member of ``enum`` (given as the member or its value), None kept."""
    if v is None or isinstance(v, enum):
        return v
    try:
        return enum(v)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in enum]} (or None), got {v!r}") from None


def _int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")


def _choice(name: str, v, allowed) -> None:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {v!r}")

"""KernelPolicy: how the GPU kernels run (never what they compute), as plain validated data.

A :class:`KernelPolicy` bundles every performance choice a GPU backend makes for a layer call:
the forward and backward path, the ring (minibatch) size, the comm CTAs of each pass, and the
tiles and pipeline stages of each GEMM (:class:`GemmTiles`, one per kernel that has its own
mainloop). It is reached as ``MoKConfig(policy=KernelPolicy(...))``; ``MoKConfig``'s older
fields (``minibatch_tokens``, ``comm_sms_fwd``, ...) are constructor knobs for the same choices
(:attr:`MoKConfig.kernel_policy <mok_cute.config.MoKConfig.kernel_policy>` merges them).

``None`` (every field's default) means the tuned default for the arch, shape and precision.
This module checks types and the values any kernel could take; which values a given arch and
precision run is the layer's check (:mod:`mok_cute.layers.tiles`), made once per call when it
decides its paths, before any launch: a value the call's kernels cannot run raises ValueError
naming the field and the values allowed there (never clamped, never ignored).

Plain data: importing it needs no GPU, no torch and no CuTe DSL.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum

TILE_M = (64, 128, 256)  # values some kernel's tile could take (the arch's check narrows them)
TILE_N = (64, 128, 192, 256)
TILE_K = (32, 64, 128)
MAX_STAGES = 16
MINIBATCH_TOKENS = 1024  # the fused forward's ring by default (512-8192 within noise, docs/benchmarks.md)
COMM_SMS_FWD_EP1 = 16  # the fused forward's gather CTAs at EP = 1 by default
COMM_SMS_FWD_EP = 40  # the forward's comm CTAs at EP > 1 by default (not yet tuned on two GPUs)
COMM_SMS_BWD = 28  # the backward's comm CTAs by default
RASTER_BAND = 8  # the fused forward's GEMM1 walk: m-tiles per band (16 and 32 within 0.3%, docs/design-decisions.md)


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


@dataclass(frozen=True)
class GemmTiles:
    """One mainloop's tile and pipeline (M = rows, N = output features, K = reduction); None each:
    the tuned default. Any value here is also checked per arch and precision by the layer.

    tile_m: rows per tile. SM90: 128 only. SM100 fused kernels: 128 or 256 (``cta_group::2``: a
        cluster of two CTAs per tile, the only cluster shape the kernels take; the SM90 kernels run
        without clusters). Bitwise invariant (each element's sum over K keeps its order).
    tile_n: columns per tile. SM90 (BF16, MXFP8): 128 or 256 (default 256; GEMM1's tile is the
        gate and up halves of ``tile_n / 2`` columns each). Bitwise invariant expected (the k-tile
        walk and tile_k are unchanged; the device check confirms it per kernel).
    tile_k: reduction depth per pipeline stage; only each kernel's own (SM90 BF16: 64) today.
    stages: the ring of A/B shared-memory stages; default: as many as fit beside the epilogue.
        The allowed range depends on the arch, the kernel and ``tile_n``. Bitwise invariant (only
        how many k-tiles are in flight changes).
    """

    tile_m: int | None = None
    tile_n: int | None = None
    tile_k: int | None = None
    stages: int | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("tile_m", TILE_M), ("tile_n", TILE_N), ("tile_k", TILE_K)):
            v = getattr(self, name)
            if v is not None:
                _int(name, v)
                _choice(name, v, allowed)
        if self.stages is not None:
            _int("stages", self.stages)
            if not 2 <= self.stages <= MAX_STAGES:
                raise ValueError(f"stages must be in [2, {MAX_STAGES}], got {self.stages}")

    def given(self) -> dict:
        """The fields set (not None), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __repr__(self) -> str:  # the fields set only
        return f"GemmTiles({', '.join(f'{k}={v!r}' for k, v in self.given().items())})"

    def under(self, base: GemmTiles) -> GemmTiles:
        """These tiles with each None field taken from ``base``."""
        return GemmTiles(**{**base.given(), **self.given()})


#: the mainloops a policy sets tiles for: the fused kernels (each one mainloop for all of its GEMMs),
#: then the unfused kernels (one launch per GEMM)
GEMMS = ("fused_forward", "fused_backward", "gemm1", "gemm2", "dgrad2", "dgrad1", "wgrad")
GEMM_NAMES = {
    "fused_forward": "the fused forward (GEMM1 + SwiGLU and GEMM2, one mainloop)",
    "fused_backward": "the fused backward (dgrad2 + dSwiGLU, dgrad1 and wgrad, one mainloop)",
    "gemm1": "the unfused GEMM1 + SwiGLU", "gemm2": "the unfused GEMM2",
    "dgrad2": "the unfused dgrad2 + dSwiGLU", "dgrad1": "the unfused dgrad1", "wgrad": "the unfused wgrad",
}


@dataclass(frozen=True)
class KernelPolicy:
    """How the GPU kernels of a layer call run; every field None by default: the tuned default for
    the arch, shape and precision. A field the call's kernels cannot run raises ValueError naming it
    and the allowed values, when the layer decides its paths (before any launch); a GEMM's tiles
    apply where its kernel runs (the paths decide which). Each field says whether changing it keeps
    the results bitwise identical (what the device checks confirm).

    forward_path / backward_path: :class:`ForwardPath` / :class:`BackwardPath` (or their values);
        None: the arch's default (:mod:`mok_cute.layers.paths`). Bitwise invariant: every path gives
        the same results.
    minibatch_tokens: the fused forward's ring of gathered rows holds the routed rows of this many
        tokens (``ceil(minibatch_tokens * k / 128)`` slots of 128 rows), reused as GEMM1 consumes
        them; a multiple of 256; default :data:`MINIBATCH_TOKENS`. Bitwise invariant (a row's
        arithmetic does not depend on its ring slot).
    comm_sms_fwd / comm_sms_bwd: CTAs (one per SM) that move rows in each pass: the fused forward's
        gather (clamped to the grid) and the fused backward's row building, and the unfused EP > 1
        path's comm kernels; even, >= 2. Default: forward :data:`COMM_SMS_FWD_EP1` at EP = 1,
        :data:`COMM_SMS_FWD_EP` at EP > 1; backward :data:`COMM_SMS_BWD`. Bitwise invariant (the
        task list and each task's arithmetic are fixed; only which CTA runs a task changes).
    grid_ctas: CTAs of each fused persistent kernel, comm CTAs included (the rest take GEMM tiles);
        None: one per SM (at EP > 1 with virtual ranks: the rank's share). Fewer leave SMs to work
        running beside the layer (e.g. overlapped communication); more than the device's SMs, or
        not more than a pass's comm CTAs, raises ValueError at the call. Bitwise invariant (as the
        comm CTAs).
    raster_band: the fused forward's GEMM1 tile walk (its raster order): each expert's m-tiles in
        bands of this many m-tiles, a band's tiles n-tile outer, m-tile inner, before the next band's
        (1: n-tile inner, m-tile by m-tile; large: every n-tile of an expert's m-tile column).
        At most the ring's slots (``ceil(minibatch_tokens * k / 128)``: a slot is reused only after
        the band that read it; ValueError at the call otherwise); None: :data:`RASTER_BAND`.
        Bitwise invariant (the order tiles are claimed in, not their arithmetic).
    tiles: :class:`GemmTiles` for every GEMM of the call, where the GEMM's own field below leaves
        one None (``MoKConfig(tile_n=...)`` sets it); every GEMM the call runs must take it.
    fused_forward, fused_backward: :class:`GemmTiles` of the fused kernels (each one mainloop shared
        by its GEMMs: GEMM1 + SwiGLU and GEMM2; dgrad2 + dSwiGLU, dgrad1 and the weight gradients).
    gemm1, gemm2, dgrad2, dgrad1, wgrad: :class:`GemmTiles` of the unfused kernels (one launch each;
        the shared expert's GEMMs run on the same kernels). Bitwise invariance: see
        :class:`GemmTiles`.

    GemmTiles may be given as mappings (``{"tile_n": 128}``), paths as their string values: the
    form a serialized config (:attr:`MoKConfig._key <mok_cute.config.MoKConfig>`) comes back in.
    """

    forward_path: ForwardPath | None = None
    backward_path: BackwardPath | None = None
    minibatch_tokens: int | None = None
    comm_sms_fwd: int | None = None
    comm_sms_bwd: int | None = None
    grid_ctas: int | None = None
    raster_band: int | None = None
    tiles: GemmTiles = GemmTiles()
    fused_forward: GemmTiles = GemmTiles()
    fused_backward: GemmTiles = GemmTiles()
    gemm1: GemmTiles = GemmTiles()
    gemm2: GemmTiles = GemmTiles()
    dgrad2: GemmTiles = GemmTiles()
    dgrad1: GemmTiles = GemmTiles()
    wgrad: GemmTiles = GemmTiles()

    def __post_init__(self) -> None:
        for name, enum in (("forward_path", ForwardPath), ("backward_path", BackwardPath)):
            object.__setattr__(self, name, _enum(name, getattr(self, name), enum))
        for name in ("tiles",) + GEMMS:
            object.__setattr__(self, name, _tiles(name, getattr(self, name)))
        if self.minibatch_tokens is not None:
            _int("minibatch_tokens", self.minibatch_tokens)
            if self.minibatch_tokens < 256 or self.minibatch_tokens % 256:
                raise ValueError(f"minibatch_tokens must be a positive multiple of 256, got {self.minibatch_tokens}")
        for name in ("comm_sms_fwd", "comm_sms_bwd"):
            v = getattr(self, name)
            if v is not None:
                _int(name, v)
                if v < 2 or v % 2:
                    raise ValueError(f"{name} must be an even integer >= 2, got {v}")
        for name, lo in (("grid_ctas", 2), ("raster_band", 1)):
            v = getattr(self, name)
            if v is not None:
                _int(name, v)
                if v < lo:
                    raise ValueError(f"{name} must be an integer >= {lo}, got {v}")

    def gemm(self, name: str) -> GemmTiles:
        """The tiles of GEMM ``name`` (one of :data:`GEMMS`): its own fields, each None one from
        :attr:`tiles` (None where both are: the kernel's default)."""
        if name not in GEMMS:
            raise ValueError(f"GEMM must be one of {GEMMS}, got {name!r}")
        return getattr(self, name).under(self.tiles)

    def ring_tokens(self) -> int:
        """The fused forward's ring in tokens: ``minibatch_tokens``, or :data:`MINIBATCH_TOKENS`."""
        return MINIBATCH_TOKENS if self.minibatch_tokens is None else self.minibatch_tokens

    def forward_comm_ctas(self, ep: int) -> int:
        """The forward's comm CTAs at expert-parallel size ``ep``: ``comm_sms_fwd``, or its default."""
        if self.comm_sms_fwd is not None:
            return self.comm_sms_fwd
        return COMM_SMS_FWD_EP1 if ep == 1 else COMM_SMS_FWD_EP

    def band(self) -> int:
        """The fused forward's raster band: ``raster_band``, or :data:`RASTER_BAND`."""
        return RASTER_BAND if self.raster_band is None else self.raster_band

    def backward_comm_ctas(self) -> int:
        """The backward's comm CTAs: ``comm_sms_bwd``, or :data:`COMM_SMS_BWD`."""
        return COMM_SMS_BWD if self.comm_sms_bwd is None else self.comm_sms_bwd

    def __repr__(self) -> str:  # the fields set only
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        given = {k: v for k, v in given.items() if v is not None and v != GemmTiles()}
        return f"KernelPolicy({', '.join(f'{k}={v!r}' for k, v in given.items())})"

    @classmethod
    def from_given(cls, given: Mapping) -> KernelPolicy:
        """The policy whose :meth:`given` is ``given`` (dotted names; paths as enums or their string
        values): the inverse of :meth:`given`, validated like the constructor (ValueError naming an
        unknown field)."""
        top, tiles = {}, {}
        names = {f.name for f in fields(cls)}
        for name, v in given.items():
            head, _, sub = str(name).partition(".")
            if head not in names or bool(sub) != (head in ("tiles",) + GEMMS):
                raise ValueError(f"KernelPolicy has no field {name!r}")
            if sub:
                tiles.setdefault(head, {})[sub] = v
            else:
                top[head] = v
        return cls(**top, **tiles)

    def given(self) -> dict:
        """Every field set, by dotted name (``"fused_forward.tile_n"``), with its value."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, GemmTiles):
                out.update({f"{f.name}.{k}": x for k, x in v.given().items()})
            elif v is not None:
                out[f.name] = v
        return out


def _tiles(name: str, v) -> GemmTiles:
    """``v`` as GemmTiles: itself, a mapping of its fields, or None (all defaults)."""
    if v is None:
        return GemmTiles()
    if isinstance(v, Mapping):
        unknown = set(v) - {f.name for f in fields(GemmTiles)}
        if unknown:
            raise ValueError(f"{name}: GemmTiles has no field {sorted(unknown)[0]!r}")
        return GemmTiles(**v)
    if not isinstance(v, GemmTiles):
        raise TypeError(f"{name} must be a GemmTiles (or a mapping of its fields), got {type(v).__name__}")
    return v


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

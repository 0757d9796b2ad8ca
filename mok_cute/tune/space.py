"""The tuner's pruned candidate space: groups of alternative values for the policy fields, each
group tried against the current best policy in turn (coordinate descent).

A group holds one field (or one GEMM's tile fields); its options are the values other than the
current one that the arch's kernels take for the call (the path table, :mod:`mok_cute.layers.paths`,
and the tiles table, :data:`mok_cute.layers.tiles.CHOICES`), so a candidate never raises. Pruned:

- tile_m and tile_k: not searched (SM90 runs one value each; SM100's tile_m 256 needs two CTAs
  per cluster and is compile-verified only);
- stages: the ring one shallower than "as many as fit", at the current tile_n only (a deeper ring
  is the default; shallower ones only free shared memory the kernels do not use);
- the ring (``minibatch_tokens``) 512, 2048 and 4096 tokens around the default 1024; the GEMM1
  walk's raster band 4 and 16 m-tiles around the default 8 (a band the ring cannot hold fails its
  trial); the comm CTAs half and one and a half times their default (even);
- ``grid_ctas`` is not searched: fewer CTAs than SMs only leave SMs to work beside the layer;
- the unfused GEMMs' tiles only when the current path runs them;
- SM100: the paths stay at their defaults (its fused kernels are compile-verified, never run).

Every candidate is measured side by side with the current best and checked bitwise against the
default (:mod:`mok_cute.tune.search`).
"""
from __future__ import annotations

from dataclasses import dataclass

from mok_cute.config import MoKConfig
from mok_cute.layers import paths as P
from mok_cute.layers import tiles
from mok_cute.policy import BackwardPath, ForwardPath, KernelPolicy

RINGS = (512, 2048, 4096)
BANDS = (4, 16)


@dataclass(frozen=True)
class Group:
    """One coordinate of the search: its name and whether it needs a backward (a backward field)."""

    name: str
    backward: bool


GROUPS = (Group("forward_path", False), Group("fused_forward", False), Group("minibatch_tokens", False),
          Group("raster_band", False),
          Group("comm_sms_fwd", False), Group("gemm1", False), Group("gemm2", False),
          Group("backward_path", True), Group("fused_backward", True), Group("comm_sms_bwd", True),
          Group("dgrad2", True), Group("dgrad1", True), Group("wgrad", True))


def groups(backward: bool) -> tuple[Group, ...]:
    """The groups searched, in order (the backward's only with ``backward``)."""
    return tuple(g for g in GROUPS if backward or not g.backward)


def decided(policy: KernelPolicy, precision: str, arch: str, call: P.Call) -> P.Paths:
    """The paths ``policy`` runs for ``call`` on ``arch``."""
    return P.decide(MoKConfig(precision=precision, policy=policy), arch, call)


def valid(policy: KernelPolicy, precision: str, arch: str, call: P.Call) -> bool:
    """Whether the call's kernels run ``policy`` (its paths allowed, its tiles taken)."""
    try:
        paths = decided(policy, precision, arch, call)
        tiles.check(policy, arch, precision, paths.forward, paths.backward)
    except (ValueError, NotImplementedError):
        return False
    return True


def options(group: Group, current: KernelPolicy, precision: str, arch: str, call: P.Call) -> list[dict]:
    """The candidates of ``group`` around ``current``: each a dict of dotted policy fields to set
    (:meth:`KernelPolicy.given <mok_cute.policy.KernelPolicy.given>` names); empty when the group
    does not apply (e.g. the fused forward's tiles under the unfused path)."""
    paths = decided(current, precision, arch, call)
    name = group.name
    if name.endswith("_path") and arch == "sm100":
        return []
    if name == "forward_path":
        out = [{name: p} for p in ForwardPath if p is not paths.forward]
    elif name == "backward_path":
        out = [{name: p} for p in BackwardPath if p is not paths.backward]
    elif name in tiles.CHOICES[arch][precision]:
        if name not in tiles.running(paths.forward, paths.backward):
            return []
        out = _tile_options(name, current, tiles.CHOICES[arch][precision][name])
    elif name == "minibatch_tokens":
        if paths.forward is not ForwardPath.FUSED:
            return []
        out = [{name: r} for r in RINGS if r != current.ring_tokens()]
    elif name == "raster_band":
        if paths.forward is not ForwardPath.FUSED:
            return []
        out = [{name: b} for b in BANDS if b != current.band()]
    elif name == "comm_sms_fwd":
        out = _spread(name, current.forward_comm_ctas(call.ep))
    elif name == "comm_sms_bwd":
        out = _spread(name, current.backward_comm_ctas())
    else:
        return []
    return [o for o in out if valid(with_fields(current, o), precision, arch, call)]


def _tile_options(gemm: str, current: KernelPolicy, choices: tiles.Choices) -> list[dict]:
    tile = current.gemm(gemm)
    tn = choices.tile_n[0] if tile.tile_n is None else tile.tile_n
    out = [{f"{gemm}.tile_n": n} for n in choices.tile_n if n != tn]
    depths = choices.stages_at(tn)
    if len(depths) > 1 and tile.stages in (None, depths[-1]):
        out.append({f"{gemm}.stages": depths[-2]})
    return out


def _spread(name: str, default: int) -> list[dict]:
    """Half and one and a half times ``default``, rounded to even, at least 2."""
    vals = sorted({max(2, 2 * round(default * f / 2)) for f in (0.5, 1.5)} - {default})
    return [{name: v} for v in vals]


def with_fields(policy: KernelPolicy, fields: dict) -> KernelPolicy:
    """``policy`` with the dotted ``fields`` set (a tile_n change resets that GEMM's stages to the default)."""
    given = dict(policy.given())
    for name in fields:
        if name.endswith(".tile_n"):
            given.pop(name.replace(".tile_n", ".stages"), None)
    return KernelPolicy.from_given({**given, **fields})


def describe(fields: dict) -> str:
    """``fused_forward.tile_n=128`` (paths by value)."""
    return ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in fields.items()) or "default"

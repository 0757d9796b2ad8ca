"""The tuned policy of a layer call: a matching entry of the tuning files (:mod:`mok_cute.tuning`)
fills the policy fields its config leaves None.

Explicit choices win: a tuned field is taken only where the config's merged policy
(:attr:`MoKConfig.kernel_policy <mok_cute.config.MoKConfig.kernel_policy>`) sets neither it nor,
for a GEMM's tile field, the same field of ``policy.tiles`` (``MoKConfig(tile_n=...)``). A tuned
path the call cannot run (a feature the tuner's layer did not have, such as a shared-expert gate)
is left out, as is a tuned tile its kernels do not take: a tuned entry only ever changes how fast
a call runs, never whether it runs, and never its results (every policy field is bitwise invariant).
``MoKConfig(tuned=False)`` skips the lookup. Resolved once per (config, call shape, device).
"""
from __future__ import annotations

from dataclasses import replace

from mok_cute import tuning
from mok_cute.config import KNOBS, TILE_KNOBS, MoKConfig
from mok_cute.layers import paths as P
from mok_cute.layers import tiles
from mok_cute.policy import GEMMS, KernelPolicy

_RESOLVED: dict[tuple, MoKConfig] = {}


def key_of(inp, config: MoKConfig, arch: str, ep: int) -> tuning.Key:
    """The tuning key of the layer inputs ``inp`` (:class:`~mok_cute.layers.select.MoEInputs`) on their
    CUDA device."""
    gpu, sms = tuning.device_identity(inp.x.device)
    e, inter, h = inp.w_gate.shape
    return tuning.Key(gpu, sms, arch, inp.x.shape[0], h, inter, e, inp.topk_idx.shape[1],
                      0 if inp.shared is None else inp.shared[0].shape[0], ep, config.precision, tuning.version())


def apply(config: MoKConfig, arch: str, inp, ep: int) -> MoKConfig:
    """``config`` with the tuned entry for this call merged under its policy (the module doc), or
    ``config`` itself (no entry, ``tuned=False``, or not on CUDA)."""
    if not config.tuned or not inp.x.is_cuda:
        return config
    key, call = key_of(inp, config, arch, ep), P.Call.of(inp, config, ep)
    stamps = tuple(tuning._stamp(f) for f in tuning.files())  # a rewritten file is read again
    memo = (config._key, key, call, stamps)
    hit = _RESOLVED.get(memo)
    if hit is None:
        entry = tuning.lookup(key)
        hit = config if entry is None else _merge(config, entry.policy, arch, call)
        _RESOLVED[memo] = hit
    return hit


def _merge(config: MoKConfig, tuned: KernelPolicy, arch: str, call: P.Call) -> MoKConfig:
    """``config`` whose policy takes ``tuned``'s fields where it leaves them None; without the tuned
    paths if the call cannot run them, ``config`` itself if it still cannot (the module doc)."""
    own = config.kernel_policy.given()
    taken = {name: v for name, v in tuned.given().items()
             if name not in own and not (name.partition(".")[0] in GEMMS and "tiles." + name.partition(".")[2] in own)}
    if not taken:
        return config
    for drop in ((), ("forward_path", "backward_path")):
        policy = KernelPolicy.from_given({**own, **{k: v for k, v in taken.items() if k not in drop}})
        out = replace(config, policy=policy, **{name: None for name in KNOBS + TILE_KNOBS})
        try:
            decided = P.decide(out, arch, call)
            tiles.check(policy, arch, config.precision, decided.forward, decided.backward)
        except (ValueError, NotImplementedError):
            continue
        return out
    return config

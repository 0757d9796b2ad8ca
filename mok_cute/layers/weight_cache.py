"""Per-weight cache of derived forms (quantized copies, transposed blocks) for the layer backends.

A training step reads each weight in the forward and again in the backward (and a shared
expert through the same calls): the backends quantize it once and reuse the result until
the weight changes. An entry is valid while every source weight keeps its storage, data
pointer, shape, strides, dtype, device and ``_version`` (an optimizer's in-place update
bumps the version); it holds no reference to the weights and is dropped once their storage
is freed. Cost: one extra copy per cached form. Writes that bypass the version counter
(``w.data``) are not seen.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class WeightCache:
    """Derived forms of weights: ``get(kind, weights, build)`` returns ``build(*weights)``,
    computed once per (kind, weights) while the weights are unchanged."""

    def __init__(self):
        self._entries = {}

    @staticmethod
    def _key(w: torch.Tensor):
        return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)

    def get(self, kind, weights: tuple, build):
        key = (kind,) + tuple(self._key(w) for w in weights)
        stamp = tuple(w._version for w in weights)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == stamp and not any(r.expired() for r in hit[1]):
            return hit[2]
        self._entries = {k: v for k, v in self._entries.items() if not any(r.expired() for r in v[1])}
        with torch.no_grad():
            val = build(*weights)
        self._entries[key] = (stamp, tuple(StorageWeakRef(w.untyped_storage()) for w in weights), val)
        return val

    def __len__(self):
        return len(self._entries)

"""Device error words read by the host later, with no host sync in the step.

A launch that can detect an error on the device (a wait that timed out, an expert id out of
range) writes a few int32 words; :func:`watch` copies them into pinned memory behind an event
on the current stream, and a later :func:`watch` (the next layer call) or :func:`check` raises
``RuntimeError`` with the message its ``describe`` gives once that event has passed. During
CUDA-graph capture nothing is queued: the words of captured launches are not looked at (the
kernels still never read or write out of bounds; check routing eagerly before capturing).
"""
from __future__ import annotations

from typing import Callable

import torch

Describe = Callable[[list], "str | None"]
_pending: list = []  # (event, pinned copy, describe) in launch order


def _raise_first(done: list) -> None:
    for _, words, describe in done:
        msg = describe(words.tolist())
        if msg:
            raise RuntimeError(msg)


def watch(words: torch.Tensor, describe: Describe, first: bool = True) -> None:
    """Raise for any earlier watched words whose launch has finished and that ``describe`` as an
    error, then queue ``words`` (int32 device tensor of this launch; ``describe(list) -> str |
    None``). ``first=False`` for the later watches of one layer call: they only queue, so an
    error is raised at the start of a later call, never half-way through the one that made it.
    Not queued while the current stream is being captured."""
    if words.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    done = []
    while first and _pending and (_pending[0][0] is None or _pending[0][0].query()):
        done.append(_pending.pop(0))
    try:
        _raise_first(done)
    except RuntimeError:
        _pending.clear()  # one report per failure, not one per later call
        raise
    if not words.is_cuda:  # CPU tensors (kernels emulated in torch): ready now, looked at next call
        _pending.append((None, words.clone(), describe))
        return
    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
    host.copy_(words, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    _pending.append((ev, host, describe))


def check() -> None:
    """Wait for every queued launch and raise RuntimeError for the first recorded error."""
    for ev, _, _ in _pending:
        if ev is not None:
            ev.synchronize()
    done, _pending[:] = list(_pending), []
    _raise_first(done)

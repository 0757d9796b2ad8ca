"""The autotuner: the fastest :class:`~mok_cute.policy.KernelPolicy` for one layer shape on the GPU
here, written to the tuning file every later layer call of that shape reads (:mod:`mok_cute.tuning`).

    python -m mok_cute.tune --hidden 2048 --inter 768 --experts 128 --topk 8 --tokens 16384
    policy = mok_cute.tune(hidden=2048, inter=768, experts=128, topk=8, tokens=16384)

The search (:mod:`mok_cute.tune.space`, :mod:`mok_cute.tune.search`): coordinate descent over a
pruned candidate space (paths, the fused kernels' tile_n and ring depth, the forward's ring, the
comm CTAs of each pass, the unfused GEMMs' tiles where they run), each candidate checked bitwise
against the default and timed side by side with the current best; the winner is timed against the
default at the end and kept only if faster. At EP > 1, run it under ``torchrun`` with one process
per GPU of the group (``--ep`` = the world size). Importing this package needs no GPU.
"""
from __future__ import annotations

import datetime
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from mok_cute.policy import KernelPolicy


@dataclass(frozen=True)
class Options:
    """How :func:`tune` runs: ``rounds`` / ``iters`` / ``margin`` the timing (:mod:`mok_cute.tune.search`);
    ``file`` the tuning file the winner is written to ("default": the user's,
    :func:`mok_cute.tuning.user_file`; None: not written); ``progress`` a tqdm bar on stderr; ``device``;
    ``backend`` / ``arch`` for tests on a CPU (``backend="reference"`` and the arch whose candidate space
    to walk; on a GPU the arch is the device's); ``report``: return the whole
    :class:`~mok_cute.tune.search.Result` instead of its policy."""

    rounds: int = 5
    iters: int = 10
    margin: float = 0.01
    file: str | Path | None = "default"
    progress: bool = True
    device: object = "cuda"
    backend: str = "auto"
    arch: str | None = None
    report: bool = False

    def __post_init__(self):
        for name in ("rounds", "iters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.margin < 0.5:
            raise ValueError(f"margin must be in [0, 0.5), got {self.margin!r}")


def tune(hidden: int, inter: int, experts: int, topk: int, tokens: int, *, shared: int = 0, ep: int = 1,
         precision: str = "bf16", backward: bool = True, limit: float | None = None, **options):
    """Tune the layer ``(tokens, hidden, inter, experts, topk, shared)`` per rank (``experts`` in all, E / ep
    per rank) with the SwiGLU clamp ``limit`` at expert-parallel size ``ep`` and ``precision``, its
    forward + backward (or, ``backward=False``, the forward alone), and return the winning
    :class:`~mok_cute.policy.KernelPolicy` (``KernelPolicy()`` when the default is the fastest measured),
    written to the tuning file. ``options``: :class:`Options` fields (TypeError for any other). At ``ep``
    > 1 the default process group must be initialized with ``ep`` ranks (ValueError otherwise)."""
    import torch
    from tqdm import tqdm

    from mok_cute import tuning
    from mok_cute.tune.search import Bench, Problem, search

    problem = Problem(tokens, hidden, inter, experts, topk, shared, ep, precision, limit, backward)
    opt = Options(**options)
    group = _group(ep)
    device = torch.device(opt.device)
    arch = opt.arch or _arch(device)
    gpu, sms = tuning.device_identity(device) if device.type == "cuda" else ("cpu", 0)
    key = tuning.Key(gpu, sms, arch, tokens, hidden, inter, experts // ep, topk, shared, ep, precision,
                     tuning.version())
    bench = Bench(problem, device, opt.backend, group)
    lead = group is None or torch.distributed.get_rank() == 0
    with tqdm(disable=not (opt.progress and lead), file=sys.stderr, unit="step", desc="mok_cute.tune") as bar:
        result = search(bench, key, arch, opt.rounds, opt.iters, opt.margin, bar)
    path = tuning.user_file() if opt.file == "default" else (None if opt.file is None else Path(opt.file))
    if path is not None and lead:
        tuning.record(path, key, result.policy, _measured(result, opt))
    return result if opt.report else result.policy


def _group(ep: int):
    """The default process group when ``ep`` > 1 (ValueError unless it has ``ep`` ranks), else None."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if ep == 1:
        return None
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != ep:
        raise ValueError(f"ep={ep} needs the default process group initialized with {ep} ranks (one per GPU: "
                         f"torchrun --nproc_per_node {ep} -m mok_cute.tune ...), got a world of {world}")
    return dist.group.WORLD


def _arch(device) -> str:
    """The arch whose kernels run on ``device`` ("sm90", "sm100"); ValueError for any other."""
    import torch

    from mok_cute.config import MoKConfig
    from mok_cute.layers.select import select_backend

    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device here, so no mok_cute GPU kernels run there; tune on an "
                         "SM90 or SM100 GPU")
    name = select_backend(device, MoKConfig())
    if name not in ("sm90", "sm100"):
        raise ValueError(f"device {device}: no mok_cute GPU kernels run there (backend {name!r}); tune on an SM90 "
                         "or SM100 GPU (or pass arch= with backend='reference' to test the tuner itself)")
    return name


def _measured(result, opt: Options) -> dict:
    from mok_cute.bench.cli import _commit

    return {"objective": result.objective, "default_ms": result.default_ms, "tuned_ms": result.tuned_ms,
            "speedup": round(result.speedup, 4), "date": datetime.date.today().isoformat(), "commit": _commit(),
            "rounds": opt.rounds, "iters": opt.iters}


class _CallableModule(types.ModuleType):
    """``mok_cute.tune(...)`` calls :func:`tune` (the package is also ``python -m mok_cute.tune``)."""

    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = ["KernelPolicy", "Options", "tune"]

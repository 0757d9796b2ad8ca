"""Shared test fixtures: random MoE problems (never zeros) in the MoK test-suite style; tests marked
``gpu`` are skipped where torch sees no CUDA device."""
from __future__ import annotations

import os

import pytest
import torch

# the suite compiles with the on-disk kernel cache off (tests/dsl point it at their own temporary
# directories): no test writes to the user's cache, and every run compiles what it tests
os.environ.setdefault("MOK_CUTE_CACHE_DIR", "off")
# and reads no user tuning file (tests/tune point it at their own files): only the shipped tuned defaults
os.environ.setdefault("MOK_CUTE_TUNING_FILE", "off")

from mok_cute.comm.workspace import CommWorkspace
from mok_cute.dsl.launch import GraphLauncher


def offsets_from(counts) -> list[int]:
    """Group offsets [0, c0, c0 + c1, ...] of per-group row counts."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def make_problem(T=24, H=64, I=64, E=4, k=2, shared_I=None, seed=0, dtype=torch.bfloat16,
                 minus_one=True, idx=None):
    """Random layer inputs: logits ~ N(0,1), top-k, softmax over the k values; weights
    N(0,1) * fan_in^-0.5. With ``minus_one``, a few slots (and one whole token) are -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    vals, top = logits.topk(k, dim=-1)
    topk_w = torch.softmax(vals, dim=-1)
    if idx is not None:
        top = idx
    elif minus_one and T > 2 and k > 1:
        top[1, k - 1] = -1
        top[T // 2, :] = -1
    w = lambda *s, fan: (torch.randn(*s, generator=g) * fan ** -0.5).to(dtype)
    wg, wu, wd = w(E, I, H, fan=H), w(E, I, H, fan=H), w(E, H, I, fan=I)
    shared = None
    if shared_I:
        shared = (w(shared_I, H, fan=H), w(shared_I, H, fan=H), w(H, shared_I, fan=shared_I))
    dy = torch.randn(T, H, generator=g).to(dtype)
    return dict(x=x, topk_idx=top, topk_w=topk_w, w_gate=wg, w_up=wu, w_down=wd, shared=shared), dy


GPU_SKIP_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False here"


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``gpu`` (tests/gpu: the device checks) when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def forbid(monkeypatch):
    """``forbid(module, *names)``: calling those attributes of ``module`` fails the test (for
    validation tests that must raise before any compile, device query or launch)."""
    def apply(module, *names):
        def boom(*a, **k):
            raise AssertionError("reached the launch path")
        for name in names:
            monkeypatch.setattr(module, name, boom)
    return apply


class FakeLauncher(GraphLauncher):
    """Stands in for a compiled kernel's GraphLauncher (its ``launch_tensors`` kept): records the
    arguments each launch packs (``calls``: the graph-replay path, ``direct``: the DSL path of EP
    launches)."""

    def __init__(self):
        self.calls, self.direct = [], []

    def launch(self, dev, stream, key, make_args):
        self.calls.append(make_args(None))

    def launch_direct(self, stream, make_args):
        self.direct.append(make_args(None))


class FakeWorkspace:
    """The attributes of a CommWorkspace that the fused kernels' EP launches read (CPU tensors,
    rank 1 of 2)."""

    def __init__(self, t, h, k):
        self.me, self.EP, self.status = 1, 2, torch.zeros(4, dtype=torch.int32)
        self.peer_bases = torch.zeros(2, dtype=torch.int64)
        self.offsets = {"src": 0, "slots": 4096, "w": 8192, "flags": 12288, "dy": 16384}
        self.epoch = {"pull": 0, "push": 0}
        self.timeout_s = 3.0
        self._src, self._slots = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t * k, h, dtype=torch.bfloat16)
        self._dy, self._w = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k)

    def acquire_src(self, row_bytes=None):
        return self._src if row_bytes is None else self._src.view(torch.uint8)[:, :row_bytes]

    def view(self, name, dtype, shape):
        return {"slots": self._slots, "w": self._w, "dy": self._dy}[name].view(shape)

    def next_epoch(self, kind):
        self.epoch[kind] += 1
        return self.epoch[kind]

    kernel_args = CommWorkspace.kernel_args  # the real packing of the EP arguments


def fake_sm100_device(monkeypatch, module, arch="sm_100a"):
    """``module``'s host path as on an ``arch`` device with 148 SMs, its compile cache returning a
    :class:`FakeLauncher`: ``(module, launcher, compile keys)``."""
    fake, keys = FakeLauncher(), []
    monkeypatch.setattr(module, "device_arch", lambda d: (0, arch))
    monkeypatch.setattr(module, "sm_count", lambda d: 148)
    monkeypatch.setattr(module, "compile_cached", lambda key, build: keys.append(key) or fake)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    return module, fake, keys

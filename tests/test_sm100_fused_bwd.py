"""The fused SM100 backward core (kernels/sm100/fused_bwd.py) on the CPU: it compiles for sm_100a
and sm_103a with the instructions its protocol needs (tcgen05 MMA / TMEM, TMA, the ticket and the
D2 readiness release adds, %globaltimer-bounded waits), no spills, no multicast; its host entry
validates before any compile or launch and passes one argument per kernel parameter. Nothing
here runs a kernel (no Blackwell GPU)."""
import functools
import inspect
import re

import pytest

from mok_cute.kernels.sm100.grouped_gemm import ARCHS
from mok_cute.kernels.sm100.mainloop import NUM_THREADS

MAX_REGISTERS = 200  # as tests/test_sm100_compile.py: headroom below 255


@functools.cache
def _rep(arch: str, clamp: bool):
    from mok_cute.kernels.sm100 import fused_bwd as fb

    return fb.compile_fused_backward_sm100(clamp, arch=arch, inspect=True)[1]


NEEDED = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
          "mbarrier.try_wait", "atom.global.add.u32",  # the ticket (relaxed)
          "atom.global.release.add.u32",  # d2[mt]
          "ld.acquire", "%globaltimer", "fence.proxy.async.global", "fence.acq_rel.gpu", "ex2.approx")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp", [True, False])
def test_compiles_with_its_protocol(arch, clamp):
    rep = _rep(arch, clamp)
    missing = [i for i in NEEDED if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    # one CUtensorMap per TMA operand: D2 dy + w_down, D1 dg + w_gate + du + w_up, dWd dy + h, dWg dg + x, dWu du
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == 11
    assert rep.ptx.count("tcgen05.alloc") == 1 and "tcgen05.relinquish_alloc_permit" in rep.ptx
    assert rep.ptx.count("atom.global.release.add.u32") == 1  # only D2 tiles publish
    # no data atomics: the ticket (claimed before and in the loop), the D2 count, the status word's first-error CAS
    ops = re.findall(r"\b(?:atom|red)\.global\.(\S+)", rep.ptx)
    assert sorted(set(ops)) == ["add.u32", "cas.b32", "release.add.u32"] and ops.count("add.u32") == 2, ops


def test_clamp_changes_only_the_dswiglu():
    """The clamp variant adds the dSwiGLU clamp's selects; the GEMM and protocol code is the same."""
    on, off = _rep("sm_100a", True), _rep("sm_100a", False)
    for i in ("tcgen05.mma", "cp.async.bulk.tensor", "atom.global", "%globaltimer"):
        assert on.ptx.count(i) == off.ptx.count(i), i
    assert on.ptx.count("selp") > off.ptx.count("selp")


def test_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_bwd as fb

    with pytest.raises(ValueError, match="arch"):
        fb.compile_fused_backward_sm100(True, arch="sm_90a")


class _FakeLauncher:
    """Records the arguments fused_backward_core launches with (graph path)."""

    def __init__(self):
        self.calls = []

    def launch(self, dev, stream, key, make_args):
        self.calls.append(make_args(None))


def _fake_device(monkeypatch, arch="sm_100a"):
    import torch

    from mok_cute.kernels.sm100 import fused_bwd as fb

    fake, keys = _FakeLauncher(), []
    monkeypatch.setattr(fb, "device_arch", lambda d: (0, arch))
    monkeypatch.setattr(fb, "sm_count", lambda d: 148)
    monkeypatch.setattr(fb, "compile_cached", lambda key, build: keys.append(key) or fake)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    return fb, fake, keys


def _operands(m=200, h=256, inter=192, e=4, mcap=260):
    import torch

    bf = torch.bfloat16
    return dict(
        dy=torch.randn(m, h).to(bf), x=torch.randn(m, h).to(bf), gu=torch.randn(mcap, 2 * inter).to(bf),
        h=torch.randn(mcap, inter).to(bf), offsets=torch.tensor([0, 50, 100, 150, 200], dtype=torch.int32)[:e + 1],
        w_gate=torch.randn(e, inter, h).to(bf), w_up=torch.randn(e, inter, h).to(bf),
        w_down=torch.randn(e, h, inter).to(bf), limit=4.0, timeout_s=1.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("limit", [4.0, None])
def test_host_launch_matches_the_kernel_signature(monkeypatch, arch, limit):
    """fused_backward_core's host side on CPU tensors (compile and launch replaced): one argument
    per parameter of the kernel's ``__call__`` (a host / kernel mismatch fails here, not on the
    GPU), the operands the unfused SM100 kernels read, the counters, the cache key per variant."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch, arch)
    ops = _operands()
    ops["limit"] = limit
    dx, dwg, dwu, dwd = fb.fused_backward_core(**ops)
    (args,) = fake.calls
    params = list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    by = dict(zip(params, args))
    assert keys == [("sm100_fused_moe_bwd_core", arch, limit is not None)]
    assert by["mDy"]._keep is ops["dy"] and by["mX"]._keep is ops["x"] and by["mWd"]._keep is ops["w_down"]
    assert by["mWg"]._keep is ops["w_gate"] and by["mWu"]._keep is ops["w_up"] and by["mOffsets"]._keep is ops["offsets"]
    assert torch.equal(by["mGU"]._keep, ops["gu"][:200].view(200, 2, 192))  # the forward's first M rows
    assert torch.equal(by["mH"]._keep, ops["h"][:200])
    assert tuple(by["mDgu"]._keep.shape) == (200, 2, 192)
    assert by["mDx"]._keep is dx and by["mDWg"]._keep is dwg and by["mDWu"]._keep is dwu and by["mDWd"]._keep is dwd
    assert tuple(dx.shape) == (200, 256) and tuple(dwg.shape) == tuple(dwu.shape) == (4, 192, 256)
    assert tuple(dwd.shape) == (4, 256, 192)
    # d2: ceil(200 / 128) + 4 + 1 m-tiles at most (one zeroed buffer with the ticket + status words)
    d2, words = by["mD2"]._keep, by["mWords"]._keep
    assert tuple(d2.shape) == (6,) and tuple(words.shape) == (5,) and not d2.any() and not words.any()
    assert words.data_ptr() == d2.data_ptr() + 6 * 4
    assert int(by["num_ctas"]) == 148 and int(by["timeout_ns"]) == 10 ** 9
    assert by["limit"].value == (0.0 if limit is None else 4.0)
    fb.fused_backward_core(**ops, num_ctas=7)
    assert int(dict(zip(params, fake.calls[1]))["num_ctas"]) == 7


def test_host_no_rows(monkeypatch):
    """M = 0: zero weight gradients, an empty dx, nothing compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch)
    ops = _operands()
    ops.update(dy=ops["dy"][:0], x=ops["x"][:0], offsets=torch.zeros(5, dtype=torch.int32))
    dx, dwg, dwu, dwd = fb.fused_backward_core(**ops)
    assert tuple(dx.shape) == (0, 256) and not fake.calls and not keys
    assert not dwg.any() and not dwu.any() and not dwd.any()


@pytest.mark.parametrize("change, exc, match", [
    (dict(dy="dy"), TypeError, "dy"),
    (dict(dy=None), TypeError, "dy"),
    ("dy_float", TypeError, "dy"),
    ("dy_h", ValueError, "multiple of 64"),
    ("x_shape", ValueError, "x"),
    ("x_float", TypeError, "x"),
    ("offsets_i64", TypeError, "offsets"),
    ("offsets_len", ValueError, "offsets"),
    ("inter", ValueError, "w_gate"),
    ("w_up_shape", ValueError, "w_up"),
    ("w_down_shape", ValueError, "w_down"),
    ("w_down_strided", ValueError, "w_down"),
    ("gu_rows", ValueError, "gu"),
    ("gu_cols", ValueError, "gu"),
    ("h_float", TypeError, "h"),
    ("h_strided", ValueError, "h"),
    ("dy_strided", ValueError, "dy"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(timeout_s=0.0), ValueError, "timeout_s"),
    (dict(timeout_s="1"), TypeError, "timeout_s"),
    (dict(num_ctas=0), ValueError, "num_ctas"),
    ("arch", ValueError, "sm_100a / sm_103a"),
])
def test_host_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad operand raises, naming it, before anything is compiled or launched."""
    import torch

    fb, fake, keys = _fake_device(monkeypatch, "sm_90a" if change == "arch" else "sm_100a")
    ops = _operands()
    bf = torch.bfloat16
    edits = {
        "dy_float": dict(dy=torch.zeros(200, 256)),
        "dy_h": dict(dy=torch.zeros(200, 96, dtype=bf)),
        "x_shape": dict(x=torch.zeros(199, 256, dtype=bf)),
        "x_float": dict(x=torch.zeros(200, 256)),
        "offsets_i64": dict(offsets=torch.zeros(5, dtype=torch.int64)),
        "offsets_len": dict(offsets=torch.zeros(4, dtype=torch.int32)),
        "inter": dict(w_gate=torch.zeros(4, 100, 256, dtype=bf)),
        "w_up_shape": dict(w_up=torch.zeros(4, 128, 256, dtype=bf)),
        "w_down_shape": dict(w_down=torch.zeros(4, 192, 256, dtype=bf)),
        "w_down_strided": dict(w_down=torch.zeros(4, 256, 384, dtype=bf)[:, :, :192]),
        "gu_rows": dict(gu=torch.zeros(199, 384, dtype=bf)),
        "gu_cols": dict(gu=torch.zeros(260, 192, dtype=bf)),
        "h_float": dict(h=torch.zeros(260, 192)),
        "h_strided": dict(h=torch.zeros(260, 384, dtype=bf)[:, :192]),
        "dy_strided": dict(dy=torch.zeros(200, 512, dtype=bf)[:, :256]),
        "arch": {},
    }
    ops.update(change if isinstance(change, dict) else edits[change])
    with pytest.raises(exc, match=match):
        fb.fused_backward_core(**ops)
    assert not fake.calls and (change == "arch" or not keys)


def test_strided_gate_up_halves_accepted(monkeypatch):
    """w_gate / w_up may be the halves of one stacked [E, 2I, H] (read in place, as the unfused dgrad1)."""
    import torch

    fb, fake, _ = _fake_device(monkeypatch)
    ops = _operands()
    w = torch.cat([ops["w_gate"], ops["w_up"]], 1)
    ops.update(w_gate=w[:, :192], w_up=w[:, 192:])
    fb.fused_backward_core(**ops)
    (args,) = fake.calls
    by = dict(zip(list(inspect.signature(fb.FusedMoeBwdSm100.__call__).parameters)[1:], args))
    assert by["mWg"]._keep.stride() == (384 * 256, 256, 1) and by["mWu"]._keep.data_ptr() == w[:, 192:].data_ptr()


def test_variants_registry():
    """tools/blackwell_readiness.py's entries: both clamp variants, each PTX item in the compiled kernel."""
    from mok_cute.kernels.sm100 import fused_bwd as fb

    reg = fb.variants()
    assert sorted(reg) == ["fused-bwd-core-clamp", "fused-bwd-core-noclamp"]
    for name, (build, needed) in reg.items():
        assert callable(build)
        rep = _rep("sm_100a", name.endswith("-clamp"))
        assert all(rep.has(i) for i in needed), [i for i in needed if not rep.has(i)]

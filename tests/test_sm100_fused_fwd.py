"""The fused SM100 forward (kernels/sm100/fused_moe.py) on the CPU: it compiles for sm_100a and
sm_103a with the instructions its protocol needs (tcgen05 MMA / TMEM, TMA, the ticket and
readiness atomics, %globaltimer-bounded waits, the fixed-order slot sum), no spills, no
multicast; its host entry validates before any launch and passes one argument per kernel
parameter. Nothing here runs a kernel (no Blackwell GPU)."""
import functools
import re

import pytest

from conftest import fake_sm100_device

from mok_cute.kernels.sm100.grouped_gemm import ARCHS
from mok_cute.kernels.sm100.mainloop import NUM_THREADS

MAX_REGISTERS = 200  # as tests/test_sm100_compile.py: headroom below 255


@functools.cache
def _rep(arch: str, clamp: bool, shared: bool, trace: bool = False, gate: bool = False):
    from mok_cute.kernels.sm100 import fused_moe as fm

    return fm.compile_fused_forward_sm100(clamp, shared, arch=arch, trace=trace, gate=gate, inspect=True)[1]


VARIANTS = [(True, True), (False, False), (True, False), (False, True)]
NEEDED = ("tcgen05.mma", "kind::f16", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "cp.async.bulk.tensor",
          "mbarrier.try_wait", "atom.global.add.u32",  # the ticket (relaxed)
          "atom.global.release.add.u32",  # readiness counters
          "ld.acquire", "%globaltimer", "fence.proxy.async.global", "fence.acq_rel.gpu", "cp.async.cg",
          "mul.rn.f32", "add.rn.f32")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp,shared", VARIANTS)
def test_compiles_with_its_protocol(arch, clamp, shared):
    rep = _rep(arch, clamp, shared)
    missing = [i for i in NEEDED if not rep.has(i)]
    assert not missing, missing
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    # one CUtensorMap per TMA operand: ring + w1, h + w_down (+ x + s1, hs + s_down)
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == (8 if shared else 4)
    assert rep.ptx.count("tcgen05.alloc") == 1 and "tcgen05.relinquish_alloc_permit" in rep.ptx


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_and_gate_variants(arch):
    """The trace variant stamps tasks with %globaltimer (more reads than the bounded waits'); the
    gate variant multiplies the slot sum's start by the gate (8 more mul.rn.f32 per vector);
    GEMM code unchanged, 0 spills."""
    plain = _rep(arch, True, True)
    for rep in (_rep(arch, True, True, trace=True), _rep(arch, True, True, gate=True)):
        assert rep.total_spill_bytes == 0 and rep.ptx.count("tcgen05.mma") == plain.ptx.count("tcgen05.mma")
    assert _rep(arch, True, True, trace=True).ptx.count("%globaltimer") > plain.ptx.count("%globaltimer")
    assert _rep(arch, True, True, gate=True).ptx.count("mul.rn.f32") == plain.ptx.count("mul.rn.f32") + 8


def test_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_moe as fm

    with pytest.raises(ValueError, match="arch"):
        fm.compile_fused_forward_sm100(True, True, arch="sm_90a")
    with pytest.raises(ValueError, match="gate.*needs shared"):
        fm.compile_fused_forward_sm100(True, False, gate=True)
    with pytest.raises(ValueError, match="sum_batch"):
        fm.FusedMoeFwdSm100(True, True, sum_batch=100)


def _operands(shared=True, t=100, h=256, inter=192, inter_s=128, e=4, k=2):
    import torch

    bf = torch.bfloat16
    return dict(
        x=torch.randn(t, h).to(bf), order=torch.arange(t * k, dtype=torch.int32),
        offsets=torch.tensor([0, 50, 100, 150, 200], dtype=torch.int32)[:e + 1],
        topk_idx=torch.zeros(t, k, dtype=torch.int32), topk_w=torch.rand(t, k),
        w_gate=torch.randn(e, inter, h).to(bf), w_up=torch.randn(e, inter, h).to(bf),
        w_down=torch.randn(e, h, inter).to(bf),
        shared=(torch.randn(inter_s, h).to(bf), torch.randn(inter_s, h).to(bf), torch.randn(h, inter_s).to(bf))
        if shared else None,
        limit=4.0, comm_ctas=8, timeout_s=1.0)


def _fake_device(monkeypatch, arch="sm_100a"):
    from mok_cute.kernels.sm100 import fused_moe as fm

    return fake_sm100_device(monkeypatch, fm, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared,gate", [(True, False), (False, False), (True, True)])
def test_host_launch_matches_the_kernel_signature(monkeypatch, arch, shared, gate):
    """fused_forward's host side on CPU tensors (compile and launch replaced): one argument per
    parameter of the kernel's ``__call__`` (a host / kernel mismatch fails here, not on the GPU),
    gate / up interleaved as the unfused SM100 GEMM1 reads them, the cache key per variant."""
    import inspect

    import torch

    from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

    fm, fake, keys = _fake_device(monkeypatch, arch)
    ops = _operands(shared)
    if gate:
        ops["gate"] = torch.rand(100)
    out = fm.fused_forward(**ops, ring_chunks=5)
    (args,) = fake.calls
    params = list(inspect.signature(fm.FusedMoeFwdSm100.__call__).parameters)[1:]
    assert len(args) == len(params), (len(args), len(params))
    by = dict(zip(params, args))
    assert keys[0][:2] == ("sm100_fused_moe_fwd", arch) and keys[0][2:4] == (True, shared) and keys[0][-1] == gate
    assert torch.equal(by["mW1"]._keep, interleave_gate_up(ops["w_gate"], ops["w_up"], 128))
    assert tuple(by["mW1"]._keep.shape) == (4, 2 * 256, 256)  # I = 192 padded to 256
    assert by["mX"]._keep is ops["x"] and by["mWd"]._keep is ops["w_down"]
    assert (by["mS1"] is not None) == shared and (by["mSout"] is not None) == shared
    if shared:
        assert torch.equal(by["mS1"]._keep[0], interleave_gate_up(ops["shared"][0][None], ops["shared"][1][None], 128)[0])
        assert tuple(by["mGUs"]._keep.shape) == (100, 2, 128) and tuple(by["mSd"]._keep.shape) == (1, 256, 128)
    assert (by["mGate"] is not None) == gate and by["mTrace"] is None
    assert tuple(by["mIdx"]._keep.shape) == (200,) and tuple(by["mW"]._keep.shape) == (200,)
    assert (int(by["num_ctas"]), int(by["comm_ctas"]), int(by["k"])) == (148, 8, 2)
    # the ring: 5 slots asked, ceil(200 / 128) + 4 = 6 routed m-tiles at most; bands never wider
    assert (int(by["ring"]), int(by["band"])) == (5, 5) and tuple(by["mXg"]._keep.shape) == (5 * 128, 256)
    assert int(by["timeout_ns"]) == 10 ** 9 and by["limit"].value == 4.0
    # counters: gather_ready, h_ready [6], sh_ready [1], done / ticket / 2 spare, status [4], one zeroed buffer
    assert [tuple(by[n]._keep.shape) for n in ("mGather", "mHready", "mShready", "mDone", "mStatus")] == \
        [(6,), (6,), (1,), (4,), (4,)]
    assert out[7][-1] is by["mStatus"]._keep and out[8] is None
    assert tuple(out[1].shape) == (200, 384) and out[0] is by["mY"]._keep and out[3] is by["mSlot"]._keep


def test_host_launch_traced(monkeypatch):
    """MOK_CUTE_TRACE=1: the traced variant with a record per gather chunk, per possible task and
    two per CTA (the SM90 kernel's layout)."""
    fm, fake, keys = _fake_device(monkeypatch)
    monkeypatch.setenv("MOK_CUTE_TRACE", "1")
    fm.fused_forward(**_operands(True))
    (args,) = fake.calls
    by = dict(zip(list(__import__("inspect").signature(fm.FusedMoeFwdSm100.__call__).parameters)[1:], args))
    n_tasks = 1 * (1 + 1) + 6 * (2 + 1)  # m_sh (n1s + n2) + mt (n1 + n2)
    assert tuple(by["mTrace"]._keep.shape) == ((6 + n_tasks + 2 * 148) * 4,)
    assert keys[0][5] is True and fm.last_trace()[0].shape == (6 + n_tasks + 2 * 148, 4)


@pytest.mark.parametrize("change, exc, match", [
    (dict(x="x"), TypeError, "x"),
    (dict(x=None), TypeError, "x"),
    ("x_h", ValueError, "multiple of 64"),
    ("x_float", TypeError, "x"),
    ("idx_shape", ValueError, "topk_idx"),
    ("idx_dtype", TypeError, "topk_idx"),
    ("w_float", TypeError, "topk_w"),
    ("order_i64", TypeError, "order"),
    ("offsets_len", ValueError, "offsets"),
    ("inter", ValueError, "w_gate"),
    ("w_up_shape", ValueError, "w_up"),
    ("w_down_shape", ValueError, "w_down"),
    ("shared_len", ValueError, "shared"),
    ("shared_inter", ValueError, "I_s"),
    ("ws_down_shape", ValueError, "ws_down"),
    ("gate_no_shared", ValueError, "needs shared"),
    ("gate_shape", ValueError, "gate"),
    ("x_strided", ValueError, "contiguous"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(comm_ctas=0), ValueError, "comm_ctas"),
    (dict(timeout_s=0.0), ValueError, "timeout_s"),
    (dict(num_ctas=1), ValueError, "num_ctas"),
    (dict(ring_chunks=0), ValueError, "ring_chunks"),
    ("arch", ValueError, "sm_100a / sm_103a"),
])
def test_host_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad operand raises before anything is compiled or launched."""
    import torch

    fm, fake, keys = _fake_device(monkeypatch, "sm_90a" if change == "arch" else "sm_100a")
    ops = _operands(True)
    bf = torch.bfloat16
    edits = {
        "x_h": dict(x=torch.zeros(100, 96, dtype=bf)),
        "x_float": dict(x=torch.zeros(100, 256)),
        "idx_shape": dict(topk_idx=torch.zeros(99, 2, dtype=torch.int32)),
        "idx_dtype": dict(topk_idx=torch.zeros(100, 2, dtype=torch.int64)),
        "w_float": dict(topk_w=torch.zeros(100, 2, dtype=torch.float64)),
        "order_i64": dict(order=torch.zeros(200, dtype=torch.int64)),
        "offsets_len": dict(offsets=torch.zeros(4, dtype=torch.int32)),
        "inter": dict(w_gate=torch.zeros(4, 100, 256, dtype=bf)),
        "w_up_shape": dict(w_up=torch.zeros(4, 128, 256, dtype=bf)),
        "w_down_shape": dict(w_down=torch.zeros(4, 192, 256, dtype=bf)),
        "shared_len": dict(shared=ops["shared"][:2]),
        "shared_inter": dict(shared=(torch.zeros(96, 256, dtype=bf),) * 2 + (torch.zeros(256, 96, dtype=bf),)),
        "ws_down_shape": dict(shared=ops["shared"][:2] + (torch.zeros(128, 256, dtype=bf),)),
        "gate_no_shared": dict(shared=None, gate=torch.zeros(100)),
        "gate_shape": dict(gate=torch.zeros(99)),
        "x_strided": dict(x=torch.zeros(100, 512, dtype=bf)[:, :256]),
        "arch": {},
    }
    ops.update(change if isinstance(change, dict) else edits[change])
    with pytest.raises(exc, match=match):
        fm.fused_forward(**ops)
    assert not fake.calls and (change == "arch" or not keys)

"""The fused SM100 forward (kernels/sm100/fused_moe.py) on the CPU: it compiles for sm_100a and
sm_103a with the instructions its protocol needs (tcgen05 MMA / TMEM, TMA, the ticket and
readiness atomics, %globaltimer-bounded waits, the fixed-order slot sum), no spills, no
multicast; its host entry validates before any launch and passes one argument per kernel
parameter. Nothing here runs a kernel (no Blackwell GPU)."""
import functools
import re

import pytest

from conftest import fake_sm100_device
from test_sm100_mxfp8 import ref_quant  # noqa: F401 (fixture)

from mok_cute.kernels.sm100.grouped_gemm import ARCHS
from mok_cute.kernels.sm100.mainloop import NUM_THREADS

MAX_REGISTERS = 200  # as tests/test_sm100_compile.py: headroom below 255


@functools.cache
def _rep(arch: str, clamp: bool, shared: bool, trace: bool = False, gate: bool = False, mx: bool = False,
         ep: bool = False, gather: str = "comm", tile_m: int = 128):
    from mok_cute.kernels.sm100 import fused_moe as fm

    v = fm.FwdVariant(clamp, shared, trace=trace, gate=gate, mx=mx, ep=ep, gather=gather, tile_m=tile_m)
    return fm.compile_fused_forward_sm100(v, arch, inspect=True)[1]


# the launch's bundles' fields as the flat kernel parameters they were (``__call__``'s order before bundling)
PARAM_NAMES = {
    "FwdOperands": ("mX", "mXg", "mW1", "mWd", "mS1", "mSd"),
    "FwdOutputs": ("mGU", "mH", "mGUs", "mHs", "mSlot", "mSout", "mY"),
    "FwdRouting": ("mOrder", "mOffsets", "mIdx", "mW", "mGate", "mTok"),
    "FwdCounters": ("mGather", "mHready", "mShready", "mDone", "mStatus", "mTrace"),
    "FwdMx": ("mXsw", "mXgsf", "mW1sf", "mHq", "mHsf", "mWdsf", "mXsf", "mS1sf", "mHsq", "mHssf", "mSdsf"),
    "FwdScalars": ("k", "limit", "comm_ctas", "num_ctas", "ring", "band", "timeout_ns"),
    "FwdPeer": ("mPeer", "mWrows", "mSlotCopy", "me", "n_ranks", "src_off", "slots_off", "w_off", "flags_off",
                "epoch_pull", "epoch_push"),
    "ExpertBias": ("mBgate", "mBup", "mBdown"),  # the biased variant's (else None)
}


def by_name(args, keep: bool = False) -> dict:
    """One launch's arguments (the bundles, then the stream) by their flat parameter names, after
    checking they are ``__call__``'s bundles in order (an all-None one passed as None); ``keep``: a
    tensor's ``_Desc`` as its tensor."""
    import inspect

    from mok_cute.kernels.sm100 import fused_moe as fm

    params = list(inspect.signature(fm.FusedMoeFwdSm100.__call__).parameters.values())[1:]
    assert len(args) == len(params), (len(args), len(params))
    out = {}
    for b, p in zip(args[:-1], params):  # an absent bundle (all None) is passed as None
        names = PARAM_NAMES[p.annotation]
        assert b is None or (type(b).__name__ == p.annotation and len(b) == len(names)
                             and any(v is not None for v in b))
        out.update(zip(names, (None,) * len(names) if b is None else b))
    if keep:
        out = {n: None if a is None else getattr(a, "_keep", a) for n, a in out.items()}
    return out


def forward(fm, ops: dict, ws=None, interleave=None, **launch):
    """``fm.fused_forward`` on ``ops`` (:func:`_operands`' flat operands, maybe with ``gate``,
    ``w_scales`` / ``shared_scales``) bundled, with an ``Sm100Launch`` of ``ops``' comm_ctas and
    timeout_s and ``launch``'s other fields."""
    from mok_cute.kernels.operands import ExpertWeights, RoutePlan, SharedExpert

    o = dict(ops)
    x = o.pop("x")
    plan = RoutePlan(o.pop("order"), o.pop("offsets"), o.pop("topk_idx"), o.pop("topk_w"))
    weights = ExpertWeights(o.pop("w_gate"), o.pop("w_up"), o.pop("w_down"))
    shared = SharedExpert.of(o.pop("shared"), o.pop("gate", None))
    w_scales, shared_scales = o.pop("w_scales", None), o.pop("shared_scales", None)
    scales = None if w_scales is None and shared_scales is None else fm.MxScales(w_scales, shared_scales)
    limit = o.pop("limit")
    lau = fm.Sm100Launch(o.pop("comm_ctas"), o.pop("timeout_s"), mx=scales is not None, **launch)
    assert not o, o
    kw = {} if interleave is None else dict(interleave=interleave)
    return fm.fused_forward(x, plan, weights, shared, limit, lau, scales, ws=ws, **kw)


VARIANTS = [(True, True), (False, False), (True, False), (False, True)]
MX_VARIANTS = [(True, True), (False, False)]
EP_PARAMS = ("mPeer", "mWrows", "mSlotCopy")
MX_PARAMS = ("mXsw", "mXgsf", "mW1sf", "mHq", "mHsf", "mWdsf", "mXsf", "mS1sf", "mHsq", "mHssf", "mSdsf")
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
def test_bf16_gather_is_staged(arch):
    """The BF16 EP = 1 comm CTAs gather through the idle B stages (slot_rows.gather_rows_staged, the
    SM90 forward's): cp.async one batch behind, fenced before the stages' TMA loads; the MXFP8 and EP
    > 1 gathers go through registers."""
    wait1 = r"cp\.async\.wait_group\s+1;"
    rep = _rep(arch, True, True)
    assert re.search(wait1, rep.ptx) and "fence.proxy.async.shared::cta" in rep.ptx
    for other in (_rep(arch, True, True, mx=True), _rep(arch, True, True, ep=True)):
        assert not re.search(wait1, other.ptx)


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


def test_gated_swiglu_variant():
    """gpt-oss's SwiGLU (``gated``: alpha 1.702, up offset 1) in the R1 / S1 epilogues (sm_100a): the plain
    variant's GEMM code (tcgen05.mma count), 0 spills, registers within the headroom, alpha as an fp32 immediate."""
    from mok_cute.kernels.sm100 import fused_moe as fm
    from mok_cute.kernels.swiglu_math import Gated

    v = fm.FwdVariant(True, True, gated=Gated(1.702, 1.0))
    rep, plain = fm.compile_fused_forward_sm100(v, "sm_100a", inspect=True)[1], _rep("sm_100a", True, True)
    assert rep.total_spill_bytes == 0 and rep.max_registers <= MAX_REGISTERS
    assert rep.ptx.count("tcgen05.mma") == plain.ptx.count("tcgen05.mma")
    alpha = re.compile(r"0f[3B]FD9DB23\b")
    assert alpha.search(rep.ptx) and not alpha.search(plain.ptx)


def test_host_launch_compiles_the_activation_in(monkeypatch):
    """fused_forward takes the activation as ``limit``: SwiGLU.gpt_oss()'s alpha and up offset go in the compiled
    variant (``gated``), its limit 7 in the scalars; a plain SwiGLU(L) is the float L's variant."""
    from mok_cute.kernels.swiglu_math import Gated
    from mok_cute.reference import SwiGLU

    fm, fake, keys = _fake_device(monkeypatch)
    for act in (SwiGLU.gpt_oss(), SwiGLU(4.0), 4.0):
        forward(fm, dict(_operands(), limit=act), ring_chunks=5)
    assert [(k[2].clamp, k[2].gated) for k in keys] == [(True, Gated(1.702, 1.0)), (True, None), (True, None)]
    assert keys[1] == keys[2] and [by_name(args)["limit"].value for args in fake.calls] == [7.0, 4.0, 4.0]


def test_compile_arguments_validated():
    from mok_cute.kernels.sm100 import fused_moe as fm

    with pytest.raises(ValueError, match="arch"):
        fm.compile_fused_forward_sm100(fm.FwdVariant(True, True), "sm_90a")
    with pytest.raises(ValueError, match="gate.*needs shared"):
        fm.FwdVariant(True, False, gate=True)
    with pytest.raises(ValueError, match="sum_batch"):
        fm.FusedMoeFwdSm100(fm.FwdVariant(True, True, sum_batch=100))
    with pytest.raises(ValueError, match="gather"):
        fm.FwdVariant(True, True, gather="ring")


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
    import torch

    from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

    fm, fake, keys = _fake_device(monkeypatch, arch)
    ops = _operands(shared)
    if gate:
        ops["gate"] = torch.rand(100)
    out = forward(fm, ops, ring_chunks=5)
    (args,) = fake.calls
    by = by_name(args)
    v = keys[0][2]
    assert keys[0][:2] == ("sm100_fused_moe_fwd", arch) and (v.clamp, v.shared, v.gate) == (True, shared, gate)
    assert torch.equal(by["mW1"]._keep, interleave_gate_up(ops["w_gate"], ops["w_up"], 128))
    assert tuple(by["mW1"]._keep.shape) == (4, 2 * 256, 256)  # I = 192 padded to 256
    assert by["mX"]._keep is ops["x"] and by["mWd"]._keep is ops["w_down"]
    assert (by["mS1"] is not None) == shared and (by["mSout"] is not None) == shared
    if shared:
        assert torch.equal(by["mS1"]._keep[0], interleave_gate_up(ops["shared"][0][None], ops["shared"][1][None], 128)[0])
        assert tuple(by["mGUs"]._keep.shape) == (100, 2, 128) and tuple(by["mSd"]._keep.shape) == (1, 256, 128)
    assert (by["mGate"] is not None) == gate and by["mTrace"] is None
    assert all(by[n] is None for n in MX_PARAMS)
    assert (v.mx, v.ep, v.gather, v.tile_m, v.bulk_push) == (False, False, "comm", 128, False)
    assert tuple(by["mIdx"]._keep.shape) == (200,) and tuple(by["mW"]._keep.shape) == (200,)
    assert (int(by["num_ctas"]), int(by["comm_ctas"]), int(by["k"])) == (148, 8, 2)
    # the ring: 5 slots asked, ceil(200 / 128) + 4 = 6 routed m-tiles at most; bands never wider
    assert (int(by["ring"]), int(by["band"])) == (5, 5) and tuple(by["mXg"]._keep.shape) == (5 * 128, 256)
    assert int(by["timeout_ns"]) == 10 ** 9 and by["limit"].value == 4.0
    # counters: gather_ready, h_ready [6], sh_ready [1], done / ticket / 2 spare, status [4], one zeroed buffer
    assert [tuple(by[n]._keep.shape) for n in ("mGather", "mHready", "mShready", "mDone", "mStatus")] == \
        [(6,), (6,), (1,), (4,), (4,)]
    assert out.counters[-1] is by["mStatus"]._keep and out.w_rows is None
    assert tuple(out[1].shape) == (200, 384) and out[0] is by["mY"]._keep and out[3] is by["mSlot"]._keep


def test_host_launch_traced(monkeypatch):
    """``Sm100Launch(trace=True)`` (the layer's resolved ``MoKConfig.trace``; the environment is not
    read here): the traced variant with a record per gather chunk, per possible task and two per CTA
    (the SM90 kernel's layout)."""
    fm, fake, keys = _fake_device(monkeypatch)
    monkeypatch.setenv("MOK_CUTE_TRACE", "1")  # not read by the kernel's host: untraced
    forward(fm, _operands(True))
    assert keys[0][2].trace is False and by_name(fake.calls[0])["mTrace"] is None
    forward(fm, _operands(True), trace=True)
    by = by_name(fake.calls[1])
    n_tasks = 1 * (1 + 1) + 6 * (2 + 1)  # m_sh (n1s + n2) + mt (n1 + n2)
    assert tuple(by["mTrace"]._keep.shape) == ((6 + n_tasks + 2 * 148) * 4,)
    assert keys[1][2].trace is True and fm.last_trace()[0].shape == (6 + n_tasks + 2 * 148, 4)


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
    ("shared_len", TypeError, "w_down"),
    ("shared_inter", ValueError, "I_s"),
    ("ws_down_shape", ValueError, "ws_down"),
    ("gate_no_shared", ValueError, "needs a shared expert"),
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
    launch = {}
    for name in ("num_ctas", "ring_chunks"):
        if isinstance(change, dict) and name in change:
            launch[name] = change.pop(name)
    ops.update(change if isinstance(change, dict) else edits[change])
    with pytest.raises(exc, match=match):
        forward(fm, ops, **launch)
    assert not fake.calls and (change == "arch" or not keys)


# ------------------------------------------------------------------ MXFP8 variant
MX_NEEDED = tuple(i for i in NEEDED if i != "kind::f16") + (
    "kind::mxf8f6f4", "block_scale", "tcgen05.cp",  # block-scaled MMA, scales shared -> TMEM
    "cvt.rn.satfinite.e4m3x2.f32", "max.u16x2")  # h quantized in the SwiGLU epilogue (the quantizer's ops)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp,shared", MX_VARIANTS)
def test_mx_compiles_block_scaled(arch, clamp, shared):
    """The MXFP8 variant: block-scaled tcgen05 MMAs only, 0 spills, one CUtensorMap per operand and
    scale tensor, the BF16 variant's task code (same MMA count); each SwiGLU epilogue (R1, S1)
    quantizes its 4 chunks of 32 h values (8 e4m3 words = 16 cvt each) and stores one scale byte
    per chunk."""
    rep = _rep(arch, clamp, shared, mx=True)
    missing = [i for i in MX_NEEDED if not rep.has(i)]
    assert not missing, missing
    assert "kind::f16" not in rep.ptx and "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    # A, B, SFA, SFB of R1 (ring) and R2 (hq) (+ S1 (x), S2 (hsq))
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", rep.ptx)) == (16 if shared else 8)
    assert rep.ptx.count("tcgen05.mma") == _rep(arch, clamp, shared).ptx.count("tcgen05.mma")
    epilogues = 2 if shared else 1
    assert rep.ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 64 * epilogues
    assert len(re.findall(r"st\.global\.b8\b", rep.ptx)) == 4 * epilogues


@pytest.mark.parametrize("arch", ARCHS)
def test_tma_gather_variant_loads_r1_rows_by_gather4(arch):
    """``tma_gather``: R1's A rows by ``cp.async.bulk.tensor.2d.tile::gather4`` from x (32 per k-tile:
    128 rows, four per instruction) beside the B / GEMM2 / shared loads; no comm-CTA gather (its
    staged cp.async copies gone, the slot sum's stay); the same MMAs; 0 spills. The registry lists it."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    rep, comm = _rep(arch, True, True, gather="tma"), _rep(arch, True, True)
    assert rep.ptx.count("tile::gather4") == 32 and "tile::gather4" not in comm.ptx
    assert rep.ptx.count("tcgen05.mma") == comm.ptx.count("tcgen05.mma")
    assert rep.ptx.count("cp.async.cg") < comm.ptx.count("cp.async.cg")
    assert rep.total_spill_bytes == 0 and rep.max_registers <= MAX_REGISTERS
    assert "fused-fwd-tma-gather-clamp-shared" in fm.variants()
    with pytest.raises(ValueError, match="gather='tma'"):
        fm.FwdVariant(True, True, mx=True, gather="tma")


def test_host_tma_gather_hands_each_rows_token(monkeypatch):
    """``Sm100Launch(gather="tma")`` on CPU (compile and launch faked): the variant's key, ``mTok`` =
    order // k then a tile of zero padding, a one-slot stand-in for the ring; the default is the comm
    CTAs' gather (the environment is not read); a bad value is a ValueError; MXFP8, EP > 1 and
    ``tile_m`` 256 refuse it."""
    import torch

    from conftest import FakeWorkspace

    fm, fake, keys = _fake_device(monkeypatch)
    ops = _operands(True)
    forward(fm, ops, gather="tma")
    by = by_name(fake.calls[-1])
    tok = by["mTok"]._keep
    assert keys[-1][2].gather == "tma" and tok.dtype == torch.int32 and tok.shape == (200 + 128,)
    assert torch.equal(tok[:200], (ops["order"] // 2).int()) and not tok[200:].any()
    assert tuple(by["mXg"]._keep.shape) == (128, 256)
    monkeypatch.setenv("MOK_CUTE_SM100_GATHER", "tma")  # gone: not read
    forward(fm, ops)
    assert keys[-1][2].gather == "comm" and by_name(fake.calls[-1])["mTok"] is None
    with pytest.raises(ValueError, match="gather must be one of"):
        forward(fm, ops, gather="ring")
    n = len(keys)
    for bad in (dict(ops=_mx_weights(ops)), dict(ws=FakeWorkspace(100, 256, 2)), dict(tile_m=256)):
        with pytest.raises(ValueError, match="gather='tma'"):
            forward(fm, bad.pop("ops", ops), gather="tma", **bad)
    assert len(keys) == n


def test_variants_registry_has_the_mx_variants():
    """tools/blackwell_readiness.py's and ptx_manifest's MXFP8 entries: each PTX item in the kernel."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    reg = fm.variants()
    for name, (clamp, shared) in (("fused-fwd-mxfp8-clamp-shared", (True, True)),
                                  ("fused-fwd-mxfp8-noclamp-routed", (False, False))):
        rep = _rep("sm_100a", clamp, shared, mx=True)
        assert "kind::mxf8f6f4" in reg[name][1] and all(rep.has(i) for i in reg[name][1]), name


def _mx_weights(ops):
    """``ops`` with its weights MXFP8-quantized along their rows (the reference quantizer) and
    their scales as ``w_scales`` / ``shared_scales``."""
    from mok_cute import reference as R

    def q(w):
        d, s = R.mxfp8_quantize(w.reshape(-1, w.shape[-1]), -1)
        return d.view(w.shape), s.view(*w.shape[:-1], -1)

    (gq, gs), (uq, us), (dq, ds) = (q(ops[n]) for n in ("w_gate", "w_up", "w_down"))
    out = dict(ops, w_gate=gq, w_up=uq, w_down=dq, w_scales=(gs, us, ds))
    if ops["shared"] is not None:
        qs = [q(w) for w in ops["shared"]]
        out.update(shared=tuple(d for d, _ in qs), shared_scales=tuple(s for _, s in qs))
    return out


@pytest.mark.parametrize("shared", [True, False])
def test_mx_host_launch_hands_the_unfused_operands(monkeypatch, ref_quant, shared):  # noqa: F811
    """fused_forward(w_scales=...) on CPU (compile and launch faked): one argument per kernel
    parameter, the MXFP8 variant's cache key, x's e4m3 rows and scale words, and every weight and
    weight-scale operand byte-equal to what the unfused SM100 MXFP8 GEMMs hand their launch
    (``grouped_gemm1_swiglu`` / ``grouped_gemm`` with the same quantized weights)."""
    import torch

    from mok_cute import reference as R
    from mok_cute.kernels.sm100 import grouped_gemm as k
    from mok_cute.kernels.sm100 import layouts as lay

    fm, fake, keys = _fake_device(monkeypatch)
    ops = _mx_weights(_operands(shared))
    out = forward(fm, ops, ring_chunks=5)
    (args,) = fake.calls
    by = by_name(args, keep=True)
    v = keys[0][2]
    assert (v.mx, v.ep, v.gather, v.clamp, v.shared) == (True, False, "comm", True, shared)
    f8 = torch.float8_e4m3fn
    xq, xs = R.mxfp8_quantize(ops["x"], -1)
    assert torch.equal(by["mX"].view(torch.uint8), xq.view(torch.uint8))
    assert by["mXg"].dtype == f8 and tuple(by["mXg"].shape) == (5 * 128, 256)
    words = by["mXsw"].view(torch.uint8)  # H = 256: 8 blocks = 2 whole scale atoms' words
    assert by["mXsw"].dtype == torch.int32 and torch.equal(words, xs)
    assert tuple(by["mXgsf"].shape) == (lay.sf_bytes(5 * 128, 8),)
    assert by["mHq"].dtype == f8 and tuple(by["mHq"].shape) == (200, 192)
    assert tuple(by["mHsf"].shape) == (lay.sf_bytes(lay.grouped_sf_rows(200, 4), 6),) and not by["mHsf"].any()
    assert by["mH"].dtype == torch.bfloat16 and out.h is by["mH"] and out.gu.dtype == torch.bfloat16

    launched = []
    monkeypatch.setattr(k, "_launch", lambda *a, **kw: launched.append(a))
    monkeypatch.setattr(k, "_check_devices", lambda **t: None)
    off = ops["offsets"]
    gs, us, ds = ops["w_scales"]
    k.grouped_gemm1_swiglu(xq, off, ops["w_gate"], ops["w_up"], 4.0, x_scales=xs, w_scales=(gs, us))
    k.grouped_gemm(torch.zeros(200, 192, dtype=f8), off, ops["w_down"], a_scales=torch.zeros(200, 6, dtype=torch.uint8),
                   w_scales=ds)
    (g1, g2) = launched[:2]
    assert torch.equal(by["mW1"].view(torch.uint8), g1[2].view(torch.uint8)) and torch.equal(by["mW1sf"], g1[3][1])
    assert by["mWd"] is ops["w_down"] and torch.equal(by["mWdsf"], g2[3][1])
    assert all((by[n] is None) != shared for n in MX_PARAMS[6:])
    if shared:
        ts = torch.tensor([0, 100], dtype=torch.int32)
        sg, su, sd = (w[None] for w in ops["shared"])
        ssg, ssu, ssd = (s[None] for s in ops["shared_scales"])
        k.grouped_gemm1_swiglu(xq, ts, sg, su, 4.0, x_scales=xs, w_scales=(ssg, ssu))
        k.grouped_gemm(torch.zeros(100, 128, dtype=f8), ts, sd, a_scales=torch.zeros(100, 4, dtype=torch.uint8),
                       w_scales=ssd)
        s1, s2 = launched[2:]
        n = by["mXsf"].numel()  # x's blocked scales: the unfused one-expert packing less its spare atom row
        assert torch.equal(by["mXsf"], s1[3][0][:n]) and not s1[3][0][n:].any()
        assert torch.equal(by["mS1"].view(torch.uint8), s1[2].view(torch.uint8)) and torch.equal(by["mS1sf"], s1[3][1])
        assert torch.equal(by["mSdsf"], s2[3][1])
        assert by["mHsq"].dtype == f8 and tuple(by["mHsq"].shape) == (100, 128)
        assert tuple(by["mHssf"].shape) == (lay.sf_bytes(100, 4),) and not by["mHssf"].any()


@pytest.mark.parametrize("tile_m", [128, 256])
def test_mx_scale_placement_is_the_unfused_layout(monkeypatch, ref_quant, tile_m):  # noqa: F811
    """The kernel's scale stores modelled in torch with the index calls the kernel makes
    (``layouts.sf_byte``): the gather's words into ring slot ``c % ring`` (read by R1 as scale atom
    rows ``(c % ring) * tile_m / 128 ..``) hold m-tile c's rows as the unfused GEMM1's
    ``pack_row_scales`` operand holds them at atom row ``o_e // 128 + e + m_tile * tile_m / 128``;
    the SwiGLU epilogue's h scale bytes (each CTA's 128 rows inside the expert, blocks < I / 32, into
    the zeroed buffer, at ``_sf_row`` of the CTA's first row) are ``pack_row_scales`` of h's scales
    byte for byte over every expert's atoms. H = 320, I = 192: partial scale atoms. ``tile_m`` 256:
    the CTA pairs' 256-row slots and tiles."""
    import torch

    from mok_cute import reference as R
    from mok_cute.kernels.sm100 import fused_moe as fm
    from mok_cute.kernels.sm100 import layouts as lay
    from mok_cute.kernels.sm100.grouped_gemm import interleave_gate_up

    g = torch.Generator().manual_seed(5)
    t, k, hid, inter, ring = 160, 2, 320, 192, 2
    offs = [0, 130, 130, 300, 301]  # an empty expert, two-tile experts, a one-row expert
    e, mcap = len(offs) - 1, t * k
    order = torch.randperm(mcap, generator=g).to(torch.int32)
    x = torch.randn(t, hid, generator=g).bfloat16()
    u8 = torch.uint8
    ws = (torch.zeros(e, inter, hid // 32, dtype=u8),) * 2 + (torch.zeros(e, hid, inter // 32, dtype=u8),)
    xq, (xs_w, ring_sf, _, _, h_sf, _, *_) = fm._mx_operands(x, mcap, e, inter, ring * tile_m, fm.MxScales(ws),
                                                             interleave_gate_up)
    per = tile_m // 128  # scale atom rows per slot / tile
    tok = order.long() // k
    unfused = lay.pack_row_scales(R.mxfp8_quantize(x, -1)[1][tok], torch.tensor(offs))
    words = xs_w.shape[1]
    ring_w, unfused_w = ring_sf.view(torch.int32).clone(), unfused.view(torch.int32)
    tiles = [(ex, mt) for ex in range(e) for mt in range(-(-(offs[ex + 1] - offs[ex]) // tile_m))]
    for c, (ex, mt) in enumerate(tiles):  # the gather, chunk by chunk (slots reused)
        row0, rows = offs[ex] + tile_m * mt, min(tile_m, offs[ex + 1] - offs[ex] - tile_m * mt)
        for rr in range(rows):
            for j in range(words):
                ring_w[lay.sf_byte((c % ring) * per + rr // 128, rr % 128, 4 * j, words) // 4] = xs_w[tok[row0 + rr], j]
        for rr in range(rows):
            sf_row = fm_sf_row(offs, ex, row0 + rr)  # fused_moe._sf_row: the unfused atom row
            got = [int(ring_w[lay.sf_byte((c % ring) * per + rr // 128, rr % 128, 4 * j, words) // 4])
                   for j in range(words)]
            want = [int(unfused_w[lay.sf_byte(sf_row, rr % 128, 4 * j, words) // 4]) for j in range(words)]
            assert got == want, (c, rr)

    hs = torch.randint(0, 255, (mcap, inter // 32), dtype=torch.uint8, generator=g)  # h's scales (quantizer's)
    model = h_sf.clone()
    kb_atoms = -(-inter // 128)
    for ex, mt in tiles:  # R1 epilogue: n-tile nt's chunk c is block 4 nt + c (tile_n / 2 = 128 columns)
        for v in range(per):  # each CTA of the tile: its 128 rows
            row0 = offs[ex] + tile_m * mt + 128 * v
            rows = min(128, offs[ex + 1] - row0)
            for r in range(rows):
                for kb in range(inter // 32):
                    model[lay.sf_byte(fm_sf_row(offs, ex, row0), r, kb, kb_atoms)] = hs[row0 + r, kb]
    want = lay.pack_row_scales(hs, torch.tensor(offs))  # the unfused GEMM2's A scales
    used = (offs[-1] // 128 + e) * kb_atoms * lay.SF_ATOM_BYTES  # every expert's atoms (rows past M: never read)
    assert model.shape == want.shape and torch.equal(model[:used], want[:used])


def fm_sf_row(offs, ex, row):
    """fused_moe._sf_row: the grouped blocked layout's scale atom row of grouped row ``row`` of expert ``ex``."""
    return offs[ex] // 128 + ex + (row - offs[ex]) // 128


@pytest.mark.parametrize("change, exc, match", [
    ("bf16_weights", TypeError, "w_gate"),
    ("no_scales", TypeError, "w_gate"),
    ("scales_len", ValueError, "w_scales must be"),
    ("scale_shape", ValueError, r"w_scales\[2\]"),
    ("scale_dtype", TypeError, r"w_scales\[0\]"),
    ("no_shared_scales", ValueError, "shared_scales must be"),
    ("shared_scale_shape", ValueError, r"shared_scales\[2\]"),
    ("shared_scales_unshared", ValueError, "without a shared expert"),
    ("shared_scales_only", ValueError, "needs w_scales"),
    ("x_fp8", TypeError, "x"),
    ("scales_device", ValueError, "w_scales"),
])
def test_mx_host_validates_before_launch(monkeypatch, change, exc, match):
    """Every bad MXFP8 operand raises before anything is quantized, compiled or launched."""
    import torch

    from mok_cute.kernels.quant import quantize

    fm, fake, keys = _fake_device(monkeypatch)
    monkeypatch.setattr(quantize, "quantize_mxfp8", lambda *a: pytest.fail("quantized before validation"))
    bf16 = _operands(True)
    ops = _mx_weights(bf16)
    gs, us, ds = ops["w_scales"]
    edits = {
        "bf16_weights": dict(w_gate=bf16["w_gate"], w_up=bf16["w_up"], w_down=bf16["w_down"]),
        "no_scales": dict(w_scales=None, shared_scales=None),
        "scales_len": dict(w_scales=(gs, us)),
        "scale_shape": dict(w_scales=(gs, us, ds[:, :, :5])),
        "scale_dtype": dict(w_scales=(gs.int(), us, ds)),
        "no_shared_scales": dict(shared_scales=None),
        "shared_scale_shape": dict(shared_scales=ops["shared_scales"][:2] + (ops["shared_scales"][0],)),
        "shared_scales_unshared": dict(shared=None),
        "shared_scales_only": dict(w_gate=bf16["w_gate"], w_up=bf16["w_up"], w_down=bf16["w_down"],
                                   shared=bf16["shared"], w_scales=None),
        "x_fp8": dict(x=ops["x"].to(torch.float8_e4m3fn)),
        "scales_device": dict(w_scales=(gs, us, ds.to("meta"))),
    }
    ops.update(edits[change])
    with pytest.raises(exc, match=match):
        forward(fm, ops)
    assert not fake.calls and not keys


# ------------------------------------------------------------------ EP > 1 variant
EP_NEEDED = ("st.release.sys", "ld.acquire.sys", "fence.acq_rel.sys")  # the protocol's signals, waits, fences


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clamp,shared,mx", [(True, True, False), (False, False, False), (True, True, True)])
def test_ep_compiles_with_the_pull_push_protocol(arch, clamp, shared, mx):
    """The EP > 1 variant (BF16 and MXFP8): the system-scope release stores (READY / DONE / DATA /
    FREE), acquire waits and fences of the protocol, which the EP = 1 variant has none of (its
    bounded waits load acquire at system scope too, fewer of them); the same GEMM code (MMA count,
    TMA descriptors), 0 spills."""
    rep, local = _rep(arch, clamp, shared, mx=mx, ep=True), _rep(arch, clamp, shared, mx=mx)
    missing = [i for i in EP_NEEDED + (MX_NEEDED if mx else NEEDED) if not rep.has(i)]
    assert not missing, missing
    assert "st.release.sys" not in local.ptx and "fence.acq_rel.sys" not in local.ptx
    assert rep.ptx.count("ld.acquire.sys") > local.ptx.count("ld.acquire.sys")
    assert "multimem" not in rep.ptx and "cta_group::2" not in rep.ptx
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536
    assert rep.ptx.count("tcgen05.mma") == local.ptx.count("tcgen05.mma")
    tma = r"\.param \.align 64 \.b8 \S+\[128\]"
    assert len(re.findall(tma, rep.ptx)) == len(re.findall(tma, local.ptx))


def test_variants_registry_has_the_ep_variants():
    """tools/blackwell_readiness.py's and ptx_manifest's EP entries: each PTX item in the kernel."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    reg = fm.variants()
    for name, (clamp, shared, mx) in (("fused-fwd-ep-clamp-shared", (True, True, False)),
                                      ("fused-fwd-ep-noclamp-routed", (False, False, False)),
                                      ("fused-fwd-mxfp8-ep-clamp-shared", (True, True, True))):
        rep = _rep("sm_100a", clamp, shared, mx=mx, ep=True)
        assert "st.release.sys" in reg[name][1] and all(rep.has(i) for i in reg[name][1]), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared,mx", [(True, False), (False, False), (True, True), (False, True)])
def test_ep_host_launch_matches_the_kernel_signature(monkeypatch, ref_quant, arch, shared, mx):  # noqa: F811
    """fused_forward(ws=...) on CPU (compile and launch faked, a FakeWorkspace of rank 1 of 2): one
    direct launch (no graph: the epochs change every call) of the ep variant with one argument per
    ``__call__`` parameter, x (MXFP8: its e4m3 rows and scale words) and topk_w staged in the
    workspace, mSlot = the workspace's slots, status = ``ws.status``, the epochs bumped, the slot
    sum's copy and w_rows returned; the EP = 1 launch passes None / the neutral scalars there."""
    import torch

    from conftest import FakeWorkspace
    from mok_cute import reference as R
    from mok_cute.comm.workspace import mxfp8_row_bytes

    fm, fake, keys = _fake_device(monkeypatch, arch)
    ops = _operands(shared)
    if mx:
        ops = _mx_weights(ops)
    t, h, k = 100, 256, 2
    ws = FakeWorkspace(t, h, k)
    out = forward(fm, dict(ops, comm_ctas=100), ws=ws, num_ctas=74, ring_chunks=5)
    assert not fake.calls
    (args,) = fake.direct
    by = by_name(args, keep=True)
    v = keys[0][2]
    assert keys[0][:2] == ("sm100_fused_moe_fwd", arch)
    assert (v.mx, v.ep, v.gather, v.tile_m, v.bulk_push) == (mx, True, "comm", 128, False)
    assert by["mPeer"] is ws.peer_bases and by["mWrows"].shape == (t * k,) and not by["mWrows"].any()
    assert by["mSlot"].data_ptr() == ws._slots.data_ptr() and by["mStatus"] is ws.status
    assert out.counters[-1] is ws.status
    assert out.slot_out is by["mSlotCopy"] and out.slot_out.shape == (t * k, h) and out.w_rows is by["mWrows"]
    assert torch.equal(ws._w, ops["topk_w"])
    assert (int(by["me"]), int(by["n_ranks"]), int(by["epoch_pull"]), int(by["epoch_push"])) == (1, 2, 1, 1)
    assert [int(by[n]) for n in ("src_off", "slots_off", "w_off", "flags_off")] == [0, 4096, 8192, 12288]
    assert (int(by["num_ctas"]), int(by["comm_ctas"])) == (74, 73)  # a GEMM CTA is left to free ring slots
    if mx:  # the staged rows: H e4m3 bytes, then the scale words the gather copies (zero-padded atoms)
        q, sc = R.mxfp8_quantize(ops["x"], -1)
        rows = ws.acquire_src(mxfp8_row_bytes(h))
        assert torch.equal(rows[:, :h], q.view(torch.uint8)) and torch.equal(rows[:, h:h + 8], sc)
        assert torch.equal(by["mX"].view(torch.uint8), q.view(torch.uint8))  # S1 reads the local e4m3 rows
    else:
        assert torch.equal(ws._src, ops["x"]) and by["mX"] is ops["x"]  # S1 reads the caller's x
    forward(fm, dict(ops, comm_ctas=100), ws=ws, num_ctas=74, ring_chunks=5)
    again = by_name(fake.direct[1])
    assert (int(again["epoch_pull"]), int(again["epoch_push"])) == (2, 2)
    forward(fm, ops)  # EP = 1: the graph path, no workspace operands
    local = by_name(fake.calls[0])
    assert all(local[n] is None for n in EP_PARAMS) and int(local["n_ranks"]) == 1 and keys[-1][2].ep is False


def test_ep_host_validates_before_launch(monkeypatch):
    """At EP > 1 the shared expert's output gate is refused before anything is staged or launched
    (so are the EP = 1 checks: a bad operand with a workspace)."""
    import torch

    from conftest import FakeWorkspace

    fm, fake, keys = _fake_device(monkeypatch)
    ws = FakeWorkspace(100, 256, 2)
    monkeypatch.setattr(ws, "acquire_src", lambda *a: pytest.fail("staged before validation"))
    with pytest.raises(ValueError, match="EP = 1 only"):
        forward(fm, dict(_operands(True), gate=torch.rand(100)), ws=ws)
    with pytest.raises(ValueError, match="comm_ctas"):
        forward(fm, dict(_operands(True), comm_ctas=0), ws=ws)
    assert not fake.calls and not fake.direct and not keys and ws.epoch == {"pull": 0, "push": 0}


PAIR_PTX = ("cta_group::2", "st.async.shared::cluster.mbarrier::complete_tx::bytes", "mapa.shared::cluster",
            "mbarrier.arrive.release.cluster.shared::cluster", "mbarrier.arrive.expect_tx.shared::cluster",
            "barrier.cluster.arrive", "barrier.cluster.wait")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mx,ep", [(False, False), (True, False), (False, True)])
def test_pair_variant_compiles_with_cta_group_2(arch, mx, ep):
    """``tile_m`` 256: ``cta_group::2`` MMAs, the pair's task ring (``st.async`` of each id into the
    peer's slot, remote arrives on the leader's empty barrier), a cluster barrier before exit; the
    same instructions as the one-CTA variant otherwise, 0 spills; the one-CTA variant has none of
    the pair's instructions."""
    rep, one = _rep(arch, True, True, mx=mx, ep=ep, tile_m=256), _rep(arch, True, True, mx=mx, ep=ep)
    missing = [i for i in PAIR_PTX + ("tcgen05.mma", "tcgen05.alloc", "%globaltimer", "atom.global.release.add.u32")
               if not rep.has(i)]
    assert not missing, missing
    assert not any(one.has(i) for i in PAIR_PTX)
    assert ("kind::mxf8f6f4" in rep.ptx) == mx and ("st.release.sys" in rep.ptx) == ep
    assert rep.total_spill_bytes == 0 and rep.max_registers <= MAX_REGISTERS
    assert rep.ptx.count("tcgen05.mma") == one.ptx.count("tcgen05.mma")


def test_pair_variant_registry_and_arguments():
    from mok_cute.kernels.sm100 import fused_moe as fm

    reg = fm.variants()
    pairs = [n for n in reg if "2cta" in n]
    assert len(pairs) == 8 and all("cta_group::2" in reg[n][1] for n in pairs)  # (one with expert biases)
    with pytest.raises(ValueError, match=r"tile_m must be one of \(128, 256\)"):
        fm.FwdVariant(True, True, tile_m=64)
    with pytest.raises(ValueError, match="gather='tma'"):
        fm.FwdVariant(True, True, gather="tma", tile_m=256)


def test_host_pair_launch(monkeypatch, ref_quant):  # noqa: F811
    """``Sm100Launch(tile_m=256)`` on CPU (compile and launch faked): the variant's key, 256-row ring
    slots (one per routed 256-row m-tile at most), whole CTA pairs (an odd comm_ctas rounded up); the
    default is 128 (the environment is not read); another tile_m is a ValueError naming it and the
    allowed values, ``gather="tma"`` refuses 256; MXFP8: the ring's blocked scales hold 256 rows per
    slot."""
    from mok_cute.kernels.sm100 import layouts as lay

    fm, fake, keys = _fake_device(monkeypatch)
    ops = _operands(True)
    forward(fm, {**ops, "comm_ctas": 7}, tile_m=256)
    by = by_name(fake.calls[-1])
    assert keys[-1][2].tile_m == 256 and keys[-1][2].gather == "comm"
    ring = -(-200 // 256) + 4
    assert int(by["ring"]) == ring and tuple(by["mXg"]._keep.shape) == (ring * 256, 256)
    assert (int(by["num_ctas"]), int(by["comm_ctas"])) == (148, 8)
    forward(fm, ops, num_ctas=9)
    assert keys[-1][2].tile_m == 128 and int(by_name(fake.calls[-1])["num_ctas"]) == 9
    forward(fm, ops, num_ctas=9, tile_m=256, ring_chunks=5)  # 5 chunks of 128 rows: 3 slots of 256
    by = by_name(fake.calls[-1])
    assert int(by["num_ctas"]) == 8 and int(by["ring"]) == 3 and int(by["band"]) <= 3
    with pytest.raises(ValueError, match="two CTA pairs"):
        forward(fm, ops, num_ctas=3, tile_m=256)
    monkeypatch.setenv("MOK_CUTE_SM100_TILE_M", "256")  # gone: not read
    forward(fm, ops)
    assert keys[-1][2].tile_m == 128
    with pytest.raises(ValueError, match="gather='tma'"):
        forward(fm, ops, gather="tma", tile_m=256)
    for bad in (64, 512, "256"):
        with pytest.raises(ValueError, match=r"tile_m must be one of \(128, 256\)"):
            forward(fm, ops, tile_m=bad)
    forward(fm, _mx_weights(ops), tile_m=256)
    by = by_name(fake.calls[-1])
    assert by["mXgsf"]._keep.numel() == lay.sf_bytes(ring * 256, 256 // lay.SF_VEC)

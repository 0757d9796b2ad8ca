"""Expert biases (gpt-oss) in the SM100 kernels, on the CPU: no Blackwell GPU exists here, so nothing runs.

* the biased variants (grouped GEMM plain / swiglu, the fused forward's R1 / R2 epilogues) compile for sm_100a and
  sm_103a with the bias loads in the PTX (four 16-byte loads per 32-column accumulator chunk, one fp32 + bf16 add
  per accumulator), no spills, registers within the headroom; the unbiased variants hold none of it and keep their
  kernel parameters (their PTX byte-identical to before the biases: ``tools/ptx_manifest.py``);
* BF16 only: the MXFP8, dswiglu, wgrad and split-K variants refuse ``biased``; the host wrappers validate the bias
  tensors before any launch;
* the layer's plumbing (:class:`~mok_cute.layers.sm100.Sm100ExpertMLP`) through the real wrappers with each
  launch modelled in torch (``test_sm100_tails.launch_model``: the bias added to the fp32 accumulator before the
  rounding) gives the reference's rows, gu, h and every gradient bitwise, the bias gradients included; the fused
  forward and the fused backward core get and give back the biases as documented.
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import fake_sm100_device
from mok_cute import reference as R
from mok_cute.kernels.sm100 import grouped_gemm as k
from mok_cute.kernels.sm100.mainloop import EPI_N, NUM_THREADS
from test_sm100_mxfp8 import ref_quant  # noqa: F401 (fixture of the model fixture)
from test_sm100_tails import model  # noqa: F401 (fixture: the wrappers' launches modelled)

MAX_REGISTERS = 200  # as test_sm100_compile
V4 = re.compile(r"ld\.global\.v4\.b32")
ADD = "add.rn.f32.bf16"  # fp32(acc) + fp32(bf16 bias), one rounding to fp32


def _entry_params(ptx: str) -> int:
    return len(re.findall(r"^\s*\.param\s", ptx, re.M))


def _gemm(epi, biased, arch, **kw):
    return k.compile_grouped_gemm(epi, biased=biased, arch=arch, inspect=True, **kw)[1]


def _check_fits(rep):
    assert rep.registers, rep.log[-2000:]
    assert rep.total_spill_bytes == 0
    assert rep.max_registers <= MAX_REGISTERS and rep.max_registers * NUM_THREADS <= 65536


@pytest.mark.parametrize("arch", k.ARCHS)
@pytest.mark.parametrize("epi, kw", [("plain", {}), ("swiglu", dict(clamp=True, gated=k.GPT_OSS)),
                                     ("plain", dict(cfg=k.Sm100Config(tile_m=256)))], ids=["plain", "swiglu", "2cta"])
def test_grouped_gemm_biased_compiles_with_the_bias_loads(arch, epi, kw):
    """Per tile: tile_n / 32 chunks (swiglu: 4 of gate, 4 of up), each four 16-byte bias loads and 32 adds; the
    unbiased variant has none of them and fewer kernel parameters (the DSL drops the absent bias bundle)."""
    biased, plain = _gemm(epi, True, arch, **kw), _gemm(epi, False, arch, **kw)
    _check_fits(biased)
    chunks = k.Sm100Config().tile_n // EPI_N
    assert len(V4.findall(biased.ptx)) - len(V4.findall(plain.ptx)) == 4 * chunks
    assert biased.ptx.count(ADD) == chunks * EPI_N and ADD not in plain.ptx
    assert biased.ptx.count("tcgen05.mma") == plain.ptx.count("tcgen05.mma")
    assert _entry_params(biased.ptx) > _entry_params(plain.ptx)


@pytest.mark.parametrize("arch", k.ARCHS)
@pytest.mark.parametrize("kw", [dict(clamp=True, shared=True, gated=k.GPT_OSS), dict(clamp=False, shared=False,
                                                                                   tile_m=256),
                                dict(clamp=False, shared=False, ep=True, bulk_push=True)],
                         ids=["gpt-oss-shared", "2cta", "ep-bulk-push"])
def test_fused_forward_biased_compiles_with_the_bias_loads(arch, kw):
    """R1 (gate and up, 4 chunks each) and R2 (8 chunks) add their expert's biases: 16 chunks of four 16-byte
    loads and 32 adds; S1 / S2 (the shared expert) none; the MMA code and the fences unchanged."""
    from mok_cute.kernels.sm100 import fused_moe as fm

    kw = dict(kw)
    clamp, shared = kw.pop("clamp"), kw.pop("shared")
    rep = fm.compile_fused_forward_sm100(fm.FwdVariant(clamp, shared, biased=True, **kw), arch, inspect=True)[1]
    plain = fm.compile_fused_forward_sm100(fm.FwdVariant(clamp, shared, **kw), arch, inspect=True)[1]
    _check_fits(rep)
    assert len(V4.findall(rep.ptx)) - len(V4.findall(plain.ptx)) == 16 * 4
    assert rep.ptx.count(ADD) == 16 * EPI_N and ADD not in plain.ptx
    for op in ("tcgen05.mma", "atom.global.release.add.u32", "fence.proxy.async.global"):
        assert rep.ptx.count(op) == plain.ptx.count(op), op
    assert _entry_params(rep.ptx) > _entry_params(plain.ptx)


def test_biased_is_bf16_plain_and_swiglu_only():
    cfg, mx = k.Sm100Config(), k.MXFP8_CONFIG
    for args, kw in (((cfg, "dswiglu"), dict(b_major=k.MN_MAJOR)), ((cfg, "plain"), dict(wgrad=True)),
                     ((cfg, "plain"), dict(b_major=k.MN_MAJOR, split_k=True)), ((mx, "plain"), {}),
                     ((mx, "swiglu"), {})):
        with pytest.raises(ValueError, match="biased"):
            k.GroupedGemmSm100(*args, biased=True, **kw)
    from mok_cute.kernels.sm100 import fused_moe as fm

    with pytest.raises(ValueError, match="biased.*BF16"):
        fm.FwdVariant(True, True, mx=True, biased=True)


# ------------------------------------------------------------------ host wrappers
def _bf(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_check_bias_and_aligned():
    from mok_cute.kernels.sm100.bias import aligned, check_bias

    b = _bf(4, 64)
    check_bias("b", b, (4, 64), b.device)
    for bad, match in ((b.float(), "bfloat16"), (b[:3], r"shape \(4, 64\)"), (_bf(4, 128)[:, ::2], "unit last"),
                       (_bf(4, 68)[:, :64], "multiple of 8"), (_bf(4 * 64 + 1)[1:].view(4, 64), "16-byte")):
        with pytest.raises(ValueError, match=match):
            check_bias("b", bad, (4, 64), b.device)
    assert aligned(b) is b
    for odd in (_bf(4, 128)[:, ::2], _bf(4, 68)[:, :64], _bf(4 * 64 + 1)[1:].view(4, 64)):
        fixed = aligned(odd)
        assert torch.equal(fixed, odd) and fixed.is_contiguous() and fixed.data_ptr() % 16 == 0
        check_bias("b", fixed, (4, 64), b.device)


def test_wrappers_validate_biases_before_launch(monkeypatch):
    """The GEMM1 + SwiGLU and GEMM2 wrappers check the biases (shape, all or none, BF16 only) before any
    launch, and hand ``_launch`` an ``ExpertBias`` only when given (the unbiased calls unchanged)."""
    from mok_cute.kernels.sm100.bundles import ExpertBias

    launched = []
    monkeypatch.setattr(k, "_launch", lambda *a, **kw: launched.append(kw))
    monkeypatch.setattr(k, "_check_devices", lambda **t: None)
    e, m, hid, inter = 3, 40, 64, 96
    offs = torch.tensor([0, 10, 10, 40], dtype=torch.int32)
    x, wg, wu, wd = _bf(m, hid), _bf(e, inter, hid, seed=1), _bf(e, inter, hid, seed=2), _bf(e, hid, inter, seed=3)
    bg, bu, bd = _bf(e, inter, seed=4), _bf(e, inter, seed=5), _bf(e, hid, seed=6)
    k.grouped_gemm1_swiglu(x, offs, wg, wu, 4.0)
    k.grouped_gemm(_bf(m, inter), offs, wd)
    assert launched == [{}, {}]
    k.grouped_gemm1_swiglu(x, offs, wg, wu, 4.0, bias=(bg, bu))
    k.grouped_gemm(_bf(m, inter), offs, wd, bias=bd)
    assert launched[2]["bias"] == ExpertBias(bg, bu) and launched[3]["bias"] == ExpertBias(down=bd)
    with pytest.raises(ValueError, match="b_up"):
        k.grouped_gemm1_swiglu(x, offs, wg, wu, 4.0, bias=(bg, None))
    with pytest.raises(ValueError, match="b_gate.*shape"):
        k.grouped_gemm1_swiglu(x, offs, wg, wu, 4.0, bias=(bg[:2], bu))
    with pytest.raises(ValueError, match="bias.*shape"):
        k.grouped_gemm(_bf(m, inter), offs, wd, bias=bg)
    with pytest.raises(ValueError, match="BF16"):
        f8 = torch.float8_e4m3fn
        k.grouped_gemm(_bf(m, inter).to(f8), offs, wd.to(f8), a_scales=torch.zeros(m, inter // 32, dtype=torch.uint8),
                       w_scales=torch.zeros(e, hid, inter // 32, dtype=torch.uint8), bias=bd)
    assert len(launched) == 4


def test_fused_forward_host_passes_the_biases(monkeypatch):
    """fused_forward's host side (compile and launch replaced): the biased variant's key, the biases as the launch's
    last bundle (the kernel's ``bias`` parameter); unbiased: that bundle None; bad biases raise before it."""
    from test_sm100_fused_fwd import _operands, by_name, forward

    from mok_cute.kernels.sm100 import fused_moe as fm

    fm_, fake, keys = fake_sm100_device(monkeypatch, fm)
    ops = _operands(True)
    e, inter, hid = ops["w_gate"].shape[0], ops["w_gate"].shape[1], ops["x"].shape[1]
    biases = (_bf(e, inter, seed=1), _bf(e, inter, seed=2), _bf(e, hid, seed=3))
    forward(fm_, ops)
    real = fm_.fused_forward
    monkeypatch.setattr(fm_, "fused_forward", lambda *a, **kw: real(*a, biases=biases, **kw))
    forward(fm_, ops)
    assert (keys[0][2].biased, keys[1][2].biased) == (False, True)
    plain, biased = (by_name(args, keep=True) for args in fake.calls)
    assert (plain["mBgate"], plain["mBup"], plain["mBdown"]) == (None,) * 3
    assert all(biased[n] is b for n, b in zip(("mBgate", "mBup", "mBdown"), biases))
    assert fake.calls[0][-2] is None and type(fake.calls[1][-2]) is fm.ExpertBias  # the kernel's last bundle
    for bad, match in (((biases[0], biases[1]), "b_gate"), ((biases[0], biases[1], biases[0]), "b_down"),
                       ((biases[0].float(),) + biases[1:], "b_gate")):
        monkeypatch.setattr(fm_, "fused_forward", lambda *a, b=bad, **kw: real(*a, biases=b, **kw))
        with pytest.raises(ValueError, match=match):
            forward(fm_, ops)
    assert len(fake.calls) == 2


# ------------------------------------------------------------------ the layer's MLP
def _experts(seed=0, e=4, m=150, hid=192, inter=320):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).bfloat16()  # noqa: E731
    offs = torch.tensor([0, 60, 60, 100, m][:e + 1], dtype=torch.int32)
    ws = (bf(e, inter, hid, scale=hid ** -0.5), bf(e, inter, hid, scale=hid ** -0.5),
          bf(e, hid, inter, scale=inter ** -0.5))
    biases = (bf(e, inter), bf(e, inter), bf(e, hid))
    return bf(m, hid), offs, ws, biases, bf(m, hid)


@pytest.mark.parametrize("act", [None, 4.0, R.SwiGLU(1.0, 1.702, 1.0)], ids=["plain", "clamp", "gpt-oss"])
def test_mlp_with_biases_equals_reference(model, act):  # noqa: F811
    """Sm100ExpertMLP.forward(biases=) / backward(biased=True) through the real wrappers, launches modelled (the
    bias in the fp32 accumulator before the rounding, N tails: H = 192, I = 320): bitwise the reference's
    experts_forward / experts_backward with biases, (d b_gate, d b_up, d b_down) last."""
    from mok_cute.layers.sm100 import Sm100ExpertMLP

    x, offs, ws, biases, dy = _experts()
    mlp = Sm100ExpertMLP()
    r, g = mlp.forward(x, offs, *ws, act, biases=biases)
    rr, saved = R.experts_forward(x, offs, *ws, act, "bf16", biases)
    assert torch.equal(r, rr) and torch.equal(g.gu, saved.gu) and torch.equal(g.h, saved.h)
    r0, _ = mlp.forward(x, offs, *ws, act)  # the biases change the rows
    assert not torch.equal(r0, r)
    grads = mlp.backward(g, dy, *ws, act, biased=True)
    want = R.experts_backward(saved, dy, *ws, act, "bf16")
    assert len(grads) == len(want) == 7
    for name, a, b in zip(("dx", "dwg", "dwu", "dwd", "d b_gate", "d b_up", "d b_down"), grads, want):
        assert torch.equal(a, b), name
    assert len(mlp.backward(g, dy, *ws, act)) == 4


def test_mlp_biases_bf16_only():
    """Expert biases at another precision: NotImplementedError naming them and the precision (before any
    kernel); the fused backward(biased) and backward_tokens(biased) without consume: ValueError."""
    from mok_cute.config import MoKConfig
    from mok_cute.layers.common import ExpertGroup
    from mok_cute.layers.sm100 import Sm100ExpertMLP

    x, offs, ws, biases, dy = _experts()
    mlp = Sm100ExpertMLP()
    with pytest.raises(NotImplementedError, match="expert biases.*'mxfp8'"):
        mlp.forward(x, offs, *ws, None, precision="mxfp8", biases=biases)
    with pytest.raises(NotImplementedError, match="expert biases.*'mxfp8'"):
        mlp.fused_forward(x, None, ws, None, None, MoKConfig(precision="mxfp8"), biases=biases)
    g = ExpertGroup(x, offs, _bf(150, 640), _bf(150, 320), "mxfp8")
    with pytest.raises(NotImplementedError, match="expert biases.*'mxfp8'"):
        mlp.backward(g, dy, *ws, None, biased=True)
    g.precision = "bf16"
    with pytest.raises(ValueError, match="biased.*fused"):
        mlp.backward(g, dy, *ws, None, fused=True, biased=True)
    with pytest.raises(ValueError, match="consume"):
        mlp.backward_tokens(g, dy, *ws, None, (None,) * 4, biased=True)


def test_fused_forward_passes_the_biases(monkeypatch):
    """Sm100ExpertMLP.fused_forward hands the kernel's host the biases (a compact copy of a misaligned one);
    without them no ``biases`` keyword (the unbiased call unchanged)."""
    from mok_cute.config import MoKConfig
    from mok_cute.kernels.operands import ExpertWeights, FusedForwardOut, RoutePlan
    from mok_cute.kernels.sm100 import fused_moe as fm
    from mok_cute.layers.sm100 import Sm100ExpertMLP

    seen = []

    def fused_forward(x, plan, weights, shared, limit, launch, scales=None, ws=None, interleave=None, **kw):
        seen.append(kw)
        status = torch.zeros(4, dtype=torch.int32)
        return FusedForwardOut(*([None] * 7), (status,), None)

    monkeypatch.setattr(fm, "fused_forward", fused_forward)
    monkeypatch.setattr("mok_cute.kernels.sm90.fused_moe.watch_status", lambda *a, **kw: None)
    x, offs, ws, biases, _ = _experts()
    plan = RoutePlan(torch.zeros(300, dtype=torch.int32), offs, torch.zeros(150, 2, dtype=torch.int32),
                     torch.rand(150, 2))
    mlp, cfg = Sm100ExpertMLP(), MoKConfig()
    mlp.fused_forward(x, plan, ExpertWeights(*ws), None, 4.0, cfg)
    odd = _bf(4, 196)[:, :192]  # row stride 196 (not a multiple of 8): copied
    mlp.fused_forward(x, plan, ExpertWeights(*ws), None, 4.0, cfg, biases=biases[:2] + (odd,))
    assert seen[0] == {} and seen[1]["biases"][:2] == biases[:2]
    assert torch.equal(seen[1]["biases"][2], odd) and seen[1]["biases"][2].is_contiguous()


def test_backward_tokens_bias_grads_around_the_core(monkeypatch):
    """backward_tokens(biased=True, consume=True) at BF16: d b_down from dy_rows before the launch (a core that
    writes over them does not change it), d b_gate / d b_up from the dgu the core writes over gu; the core's four
    outputs first."""
    import mok_cute.kernels.sm100.fused_bwd as fb
    from mok_cute.layers.common import ExpertGroup
    from mok_cute.layers.sm100 import Sm100ExpertMLP

    x, offs, ws, _, dy = _experts()
    gu, h = _bf(150, 640, seed=7), _bf(150, 320, seed=8)
    dgu = _bf(150, 640, seed=9)
    dy0 = dy.clone()

    def core(dy_rows, x_, gu_, h_, offsets, weights, limit, launch, tokens=None, w_scales=None, consume=False):
        assert consume and gu_ is gu and dy_rows is dy
        gu_.copy_(dgu)  # D2's dgu over gu
        dy_rows.zero_()  # a core free to write over the dy rows
        return "dx", "dwg", "dwu", "dwd"

    monkeypatch.setattr(fb, "fused_backward_core", core)
    out = Sm100ExpertMLP().backward_tokens(ExpertGroup(x, offs, gu, h), dy, *ws, None, (None,) * 4, consume=True,
                                           biased=True)
    inter = 320
    assert out[:4] == ("dx", "dwg", "dwu", "dwd") and len(out) == 7
    for got, rows in zip(out[4:], (dgu[:, :inter], dgu[:, inter:], dy0)):
        assert torch.equal(got, R.grouped_row_sums(rows, offs))

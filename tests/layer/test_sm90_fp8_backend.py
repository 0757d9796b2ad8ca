"""SM90 MXFP8 / FP8-blockwise expert MLP on CPU (numerics of the kernels: tools/checks/layer_fp8.py).

* the MXFP8 -> BF16 dequantize kernels compile for sm_90a and sm_100a (both layouts and the
  token-wise one, with and without the inexact counter): PTX instructions, no spills; their
  wrappers validate before any compile or launch;
* the layer (GroupedExpertBackend over Sm90ExpertMLP) at mxfp8 and fp8_block with every GPU
  kernel replaced by a torch emulation of its contract built from the reference (quantizers =
  reference quantizers, dequantize = ``reference.mxfp8_dequantize(...).bfloat16()``, GEMMs =
  fp64 matmul rounded to fp32 then bf16, like the reference) equals the reference backend's
  layer at the same precision: y, dx and every weight gradient bitwise; d topk_w within fp32
  summation tolerance (the backend sums it in fp32, the reference in fp64);
* the weight cache: forward + backward quantize each weight once; an in-place update
  recomputes; entries of freed weights are dropped;
* EP > 1 at fp8_block raises NotImplementedError before any launch (mxfp8 passes the check); a missing FP8
  kernel raises NotImplementedError before any quantization.
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import make_problem
from mok_cute import reference as R
from mok_cute.layers import sm90 as S
from mok_cute.layers import sm100 as S100
from mok_cute.dsl import compile as kc
from mok_cute.kernels.quant import dequant_mxfp8 as dq
from mok_cute.layers.weight_cache import WeightCache

CASES = [(layout, arch, count) for layout in dq.LAYOUTS for arch in ("sm_90a", "sm_100a") for count in (False, True)]
RT = {"rt_row", "rt_tokens"}  # one-pass round trips: two fp32 multiplies per element (quantize, dequantize)
# per thread: row / col _UNROLL 16-element chunks; tokens 32 tokens x 8 features; rt_row _UNROLL
# 8-element chunks; rt_tokens 32 rows x 8 features
U = dq._UNROLL
ELEMS = {"row": 16 * U, "col": 16 * U, "tokens": 256, "rt_row": 8 * U, "rt_tokens": 256}
# ld.global.v4 (col: data + its 16 scales; rt_tokens counting: rows reloaded on the rare path)
LOADS = {"row": U, "col": 2 * U, "tokens": 16, "rt_row": U, "rt_tokens": 32}
# st.global.v4 (token layouts: 32 rows + 32 tail-zeroing rows)
STORES = {"row": 2 * U, "col": 2 * U, "tokens": 64, "rt_row": U, "rt_tokens": 64}


@pytest.fixture(scope="module")
def reports():
    return {c: dq.compiled_dequant(*c)[1] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'count' if c[2] else 'plain'}")
def test_dequant_compiles_without_spills(reports, case):
    rep = reports[case]
    assert rep.arch == case[1] and len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values())
    assert rep.max_registers <= (64 if case[0] in ("row", "col", "rt_row") else 255), rep.registers


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'count' if c[2] else 'plain'}")
def test_dequant_ptx(reports, case):
    layout, _, count = case
    ptx = reports[case].ptx
    n = ELEMS[layout]
    # exact conversion: e4m3 pairs -> f16x2, f16 -> f32, one non-FTZ fp32 multiply per element,
    # one round-to-nearest-even bf16x2 pack per pair
    recount = 2 if layout == "rt_tokens" and count else 1  # the rare recount path converts again
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == recount * n // 2
    assert len(re.findall(r"\bmul\.rn\.f32\b", ptx)) == recount * n * (2 if layout in RT else 1)
    assert len(re.findall(r"cvt\.rn\.bf16x2\.f32", ptx)) == recount * n // 2
    if layout in RT:  # quantized with the MXFP8 quantizers' instructions
        assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == recount * n // 2
        assert "max.u16x2" in ptx
    assert ".ftz" not in ptx
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == LOADS[layout] * recount
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == STORES[layout]
    if layout == "tokens":
        assert len(re.findall(r"\bprmt\.b32", ptx)) == 32 * 6  # the byte transpose
        assert len(re.findall(r"ld\.global\.v2\.b32", ptx)) == 1  # 8 scale bytes
    assert ("atom.global" in ptx) == count


def test_dequant_validates_before_launch(forbid):
    forbid(dq, "compiled_dequant", "arch_of_device")
    d = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="data"):
        dq.dequantize_mxfp8(d.view(torch.uint8), torch.zeros(64, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales must be"):
        dq.dequantize_mxfp8(d, torch.zeros(64, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales must be"):
        dq.dequantize_mxfp8(d, torch.zeros(64, 2, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="dim"):
        dq.dequantize_mxfp8(d, torch.zeros(64, 2, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="CUDA"):
        dq.dequantize_mxfp8(d, torch.zeros(64, 2, dtype=torch.uint8))
    offs = torch.tensor([0, 40, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="S = m // 32"):
        dq.dequantize_mxfp8_tokens(torch.zeros(16, 32 * 3, dtype=torch.float8_e4m3fn),
                                   torch.zeros(3, 16, dtype=torch.uint8), offs, 64)
    with pytest.raises(TypeError, match="offsets"):
        dq.dequantize_mxfp8_tokens(torch.zeros(16, 32 * 4, dtype=torch.float8_e4m3fn),
                                   torch.zeros(4, 16, dtype=torch.uint8), offs.long(), 64)
    with pytest.raises(ValueError, match="CUDA"):
        dq.dequantize_mxfp8_tokens(torch.zeros(16, 32 * 4, dtype=torch.float8_e4m3fn),
                                   torch.zeros(4, 16, dtype=torch.uint8), offs, 64)


def test_dequant_compile_cache_hits(reports):
    before = kc.cache_stats()
    assert dq.compiled_dequant("tokens", "sm_90a", True) is dq.compiled_dequant("tokens", "sm_90a", True)
    assert kc.cache_stats()["compiles"] == before["compiles"]


# ------------------------------------------------------------------ emulated kernels
def _mm(a, b):
    return (a.double() @ b.double().t()).float()


def _spans(offsets):
    o = offsets.tolist()
    return [(e, lo, hi) for e, (lo, hi) in enumerate(zip(o[:-1], o[1:])) if hi > lo]


def _emu_dequant(data, scales, dim=-1, *, out=None, counter=None):
    """dequantize_mxfp8's contract; the inputs here never need rounding (asserted)."""
    v = R.mxfp8_dequantize(data, scales, dim)
    assert torch.equal(v, v.bfloat16().float())
    return v.bfloat16()


def _emu_dequant_tokens(data_t, scales, offsets, m, *, out=None, counter=None):
    """dequantize_mxfp8_tokens's contract (token rows, 0 past offsets[E])."""
    rows = S100.token_rows(data_t, offsets, m).float()
    o = offsets.long()
    r = torch.arange(m)
    e = torch.searchsorted(o[1:], r, right=True)
    valid = e < o.numel() - 1
    ec = e.clamp(max=o.numel() - 2)
    slot = torch.where(valid, o[ec] // 32 + ec + (r - o[ec]) // 32, torch.zeros_like(r))
    mult = R._pow2_f32(scales[slot].to(torch.int32) - 127)
    v = torch.where(valid[:, None], rows * mult, torch.zeros(()))
    assert torch.equal(v, v.bfloat16().float())
    return v.bfloat16()


def _emu_round_trip(x, *, out=None, counter=None):
    """mxfp8_round_trip's contract: the reference quantizer, then :func:`_emu_dequant`."""
    return _emu_dequant(*R.mxfp8_quantize(x, -1), -1)


def _emu_round_trip_tokens(x, offsets, *, out=None, counter=None):
    """mxfp8_round_trip_tokens's contract: token-wise reference quantizer, then
    :func:`_emu_dequant_tokens` (rows past offsets[E] are 0)."""
    return _emu_dequant_tokens(*R.mxfp8_quantize_tokens(x, offsets), offsets, x.shape[0])


def test_round_trip_emulations_equal_reference_round_trips():
    """The two emulations above (composed from the quantize / dequantize contracts) are the
    reference's round trips, so the layer tests below check the MLP against the reference."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g) * 10).bfloat16()
    assert torch.equal(_emu_round_trip(x), R.mx_round_trip(x, -1).bfloat16())
    offs = torch.tensor([0, 40, 40, 90], dtype=torch.int32)
    want = torch.zeros(96, 64)
    want[:90] = R._mx_round_trip_groups(x, offs.tolist())[:90]
    assert torch.equal(_emu_round_trip_tokens(x, offs), want.bfloat16())
    whole = torch.tensor([0, 96], dtype=torch.int32)  # the weight path: column-wise round trip
    assert torch.equal(_emu_round_trip_tokens(x, whole), R.mx_round_trip(x, 0).bfloat16())


class Bf16Emu:
    """The BF16 SM90 kernels' contract (run functions, operands as the MLP passes them)."""

    def __init__(self):
        self.calls = []

    def gemm1_swiglu(self, x, offsets, wg, wu, limit, gu=None, h=None):
        self.calls.append("gemm1")
        inter = wg.shape[1]
        gu = torch.zeros(x.shape[0], 2 * inter, dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            gu[lo:hi] = _mm(x[lo:hi], torch.cat([wg[e], wu[e]])).bfloat16()
        return gu, R.swiglu(gu[:, :inter].float(), gu[:, inter:].float(), limit).bfloat16()

    def gemm(self, a, offsets, w, out=None):
        self.calls.append("gemm2")
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[lo:hi] = _mm(a[lo:hi], w[e]).bfloat16()
        return out

    def dswiglu(self, dy, offsets, wd, gu, limit, out=None):
        self.calls.append("dswiglu")
        inter = wd.shape[2]
        dh = torch.zeros(dy.shape[0], inter)
        for e, lo, hi in _spans(offsets):
            dh[lo:hi] = _mm(dy[lo:hi], wd[e].t())
        return torch.cat(R.dswiglu(dh, gu[:, :inter].float(), gu[:, inter:].float(), limit), 1).bfloat16()

    def dgrad1(self, dgu, offsets, wg, wu, out=None):
        self.calls.append("dgrad1")
        out = torch.zeros(dgu.shape[0], wg.shape[2], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[lo:hi] = _mm(dgu[lo:hi], torch.cat([wg[e], wu[e]]).t()).bfloat16()
        return out

    def wgrad(self, a, b, offsets, out=None):
        self.calls.append("wgrad")
        out = torch.zeros(offsets.numel() - 1, a.shape[1], b.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[e] = _mm(a[lo:hi].float().t(), b[lo:hi].float().t()).bfloat16()
        return out


def _deq_w(q, s):
    return R.fp8_block_dequantize_weight(q, s, torch.float64)


def _deq_a(q, s):
    return R.fp8_block_dequantize_act(q, s, torch.float64)


class Fp8Emu:
    """The SM90 FP8-blockwise kernels' contract (signatures of the wrappers the MLP calls)."""

    def __init__(self):
        self.calls = []

    def grouped_gemm1_swiglu_fp8_block(self, xq, xs, offsets, gq, gs, uq, us, limit=None):
        self.calls.append("gemm1")
        inter = gq.shape[1]
        xd = _deq_a(xq, xs)
        gu = torch.zeros(xq.shape[0], 2 * inter, dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            gu[lo:hi] = _mm(xd[lo:hi], torch.cat([_deq_w(gq[e], gs[e]), _deq_w(uq[e], us[e])])).bfloat16()
        return gu, R.swiglu(gu[:, :inter].float(), gu[:, inter:].float(), limit).bfloat16()

    def grouped_gemm_fp8_block(self, a, a_s, offsets, w, w_s):
        self.calls.append("gemm2")
        ad = _deq_a(a, a_s)
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[lo:hi] = _mm(ad[lo:hi], _deq_w(w[e], w_s[e])).bfloat16()
        return out

    def grouped_dswiglu_dgrad_fp8_block(self, dyq, dys, offsets, wdt_q, wdt_s, gu, limit=None):
        self.calls.append("dswiglu")
        inter = wdt_q.shape[1]
        dyd = _deq_a(dyq, dys)
        dh = torch.zeros(dyq.shape[0], inter)
        for e, lo, hi in _spans(offsets):
            dh[lo:hi] = _mm(dyd[lo:hi], _deq_w(wdt_q[e], wdt_s[e]))
        return torch.cat(R.dswiglu(dh, gu[:, :inter].float(), gu[:, inter:].float(), limit), 1).bfloat16()

    def grouped_dgrad1_fp8_block(self, dguq, dgus, offsets, w1t_q, w1t_s):
        self.calls.append("dgrad1")
        dd = _deq_a(dguq, dgus)
        out = torch.zeros(dguq.shape[0], w1t_q.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[lo:hi] = _mm(dd[lo:hi], _deq_w(w1t_q[e], w1t_s[e])).bfloat16()
        return out

    @staticmethod
    def _tokens(t, s, offsets):
        """float64 token rows [M, N] of a token-wise operand (data_t [N, 128 S], scales [S, N])."""
        o = offsets.tolist()
        out = torch.zeros(o[-1], t.shape[0], dtype=torch.float64)
        for e, (lo, hi) in enumerate(zip(o[:-1], o[1:])):
            j = torch.arange(hi - lo)
            base = lo // 128 + e
            out[lo:hi] = t[:, 128 * base + j].double().t() * s[base + j // 128].double()
        return out

    def grouped_wgrad_fp8_block(self, a_t, a_s, b_t, b_s, offsets):
        self.calls.append("wgrad")
        assert a_t.stride(1) == 1 and a_s.stride(1) == 1
        a, b = self._tokens(a_t, a_s, offsets), self._tokens(b_t, b_s, offsets)
        out = torch.zeros(offsets.numel() - 1, a_t.shape[0], b_t.shape[0], dtype=torch.bfloat16)
        for e, lo, hi in _spans(offsets):
            out[e] = _mm(a[lo:hi].t(), b[lo:hi].t()).bfloat16()
        return out


def _emu_weights_t(*ws):
    """quantize_fp8_block_weights_t's contract from the reference: per-expert 128x128
    quantization of each weight, and their stack along R transposed per expert."""
    from mok_cute.kernels.sm90.fp8_expert import transpose_weight_blocks

    parts = []
    for w in ws:
        q = [R.fp8_block_quantize_weight(w[e]) for e in range(w.shape[0])]
        parts.append((torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])))
    return parts, transpose_weight_blocks(*parts)


@pytest.fixture
def emu(monkeypatch):
    """Every GPU kernel of the sm90 MLP replaced by its emulation; returns (bf16 emu, fp8 emu)."""
    from mok_cute.kernels.quant import dequant_mxfp8, quantize, quantize_fp8
    from mok_cute.kernels.sm90 import expert_bwd as sm90_expert_bwd, grouped_gemm as sm90_grouped_gemm

    monkeypatch.setattr(quantize, "quantize_mxfp8", R.mxfp8_quantize)
    monkeypatch.setattr(quantize_fp8, "quantize_fp8_block_act", R.fp8_block_quantize_act)
    monkeypatch.setattr(quantize_fp8, "quantize_fp8_block_weights_t", _emu_weights_t)

    def tokens(x, offsets, fmt):
        assert offsets.dtype == torch.int32
        return (R.mxfp8_quantize_tokens if fmt == "mxfp8" else R.fp8_block_quantize_tokens)(x, offsets)

    monkeypatch.setattr(quantize_fp8, "quantize_tokens", tokens)
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip", _emu_round_trip)
    monkeypatch.setattr(dequant_mxfp8, "mxfp8_round_trip_tokens", _emu_round_trip_tokens)
    b = Bf16Emu()
    for mod, name, fn in ((sm90_grouped_gemm, "_run_gemm1_swiglu", b.gemm1_swiglu),
                          (sm90_grouped_gemm, "_run_gemm", b.gemm), (sm90_expert_bwd, "_run_dswiglu_dgrad", b.dswiglu),
                          (sm90_expert_bwd, "_run_dgrad1", b.dgrad1), (sm90_expert_bwd, "_run_wgrad", b.wgrad)):
        monkeypatch.setattr(mod, name, fn)
    monkeypatch.setattr(sm90_grouped_gemm, "_check_devices", lambda **t: None)
    f = Fp8Emu()
    real = S.fp8_kernel
    monkeypatch.setattr(S, "fp8_kernel", lambda name: getattr(f, name) if hasattr(f, name) else real(name))
    return b, f


def _fresh_backend(monkeypatch):
    """The registered sm90 backend with a fresh MLP (empty weight cache)."""
    from mok_cute.layers import select as B

    be = B.get_backend("sm90")
    monkeypatch.setattr(be, "mlp", S.Sm90ExpertMLP())
    return be


def _layer(be, p, dy, limit, precision):
    from mok_cute.layers import select as B
    from mok_cute.config import MoKConfig

    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)
    y, st = be.forward(inp, MoKConfig(precision=precision), None)
    return y, be.backward(st, dy), st


def _reference(p, dy, limit, precision):
    y, saved = R.moe_forward(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"],
                             limit, precision=precision)
    return y, R.moe_backward(saved, dy)


def _assert_equal_layer(y, g, ry, rg, shared):
    assert torch.equal(y, ry)
    for name in ("dx", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(g, name), getattr(rg, name)), name
    if shared:
        for a, b in zip(g.d_shared, rg.d_shared):
            assert torch.equal(a, b)
    else:
        assert g.d_shared is None and rg.d_shared is None
    torch.testing.assert_close(g.d_topk_w, rg.d_topk_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_block"])
@pytest.mark.parametrize("shared_i,limit", [(256, 4.0), (None, None)])
def test_sm90_layer_equals_reference(emu, monkeypatch, precision, shared_i, limit):
    p, dy = make_problem(T=40, H=256, I=256, E=5, k=3, shared_I=shared_i, seed=31)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    be = _fresh_backend(monkeypatch)
    y, g, st = _layer(be, p, dy, limit, precision)
    assert st.routed.precision == precision
    _assert_equal_layer(y, g, *_reference(p, dy, limit, precision), shared_i)
    used = emu[0] if precision == "mxfp8" else emu[1]
    groups = 2 if shared_i else 1
    assert used.calls == ["gemm1", "gemm2"] * groups + (["dswiglu", "dgrad1"] + ["wgrad"] * 3) * groups
    other = emu[1] if precision == "mxfp8" else emu[0]
    assert other.calls == []


def test_weight_cache_reuse_and_invalidation(emu, monkeypatch):
    """Forward + backward build each weight form once; an in-place update (optimizer step)
    rebuilds, and the next step equals the reference for the new weights."""
    builds = []
    real = S._mx_dequant_weight
    monkeypatch.setattr(S, "_mx_dequant_weight", lambda w, axis: builds.append(axis) or real(w, axis))
    p, dy = make_problem(T=24, H=256, I=256, E=3, k=2, shared_I=256, seed=5)
    be = _fresh_backend(monkeypatch)
    _layer(be, p, dy, None, "mxfp8")
    assert sorted(builds) == [1] * 6 + [2] * 6  # 6 weights (routed + shared), 2 axes each
    builds.clear()
    _layer(be, p, dy, None, "mxfp8")  # same weights: all cached
    assert builds == []
    with torch.no_grad():
        p["w_gate"].add_(0.01)  # version bump, same storage
        p["shared"][2].mul_(1.5)
    y, g, _ = _layer(be, p, dy, None, "mxfp8")
    assert sorted(builds) == [1, 1, 2, 2]  # w_gate and ws_down, both axes
    _assert_equal_layer(y, g, *_reference(p, dy, None, "mxfp8"), True)
    # fp8_block: data + scales and the transposed dgrad form, one entry per (Wd) and (Wg, Wu)
    cache = be.mlp.weights
    n = len(cache)
    t_builds = []
    monkeypatch.setattr(S, "_fp8_weights", lambda *ws: t_builds.append(len(ws)) or _emu_weights_t(*ws))
    _layer(be, p, dy, None, "fp8_block")
    assert len(cache) == n + 4 and sorted(t_builds) == [1, 1, 2, 2]  # (wd), (wg, wu): routed and shared
    _layer(be, p, dy, None, "fp8_block")
    assert len(cache) == n + 4 and len(t_builds) == 4
    with torch.no_grad():
        p["w_down"].sub_(0.01)
    y, g, _ = _layer(be, p, dy, None, "fp8_block")
    _assert_equal_layer(y, g, *_reference(p, dy, None, "fp8_block"), True)


def test_weight_cache_drops_freed_weights():
    cache = WeightCache()
    w = torch.randn(4, 8)
    first = cache.get("k", (w,), lambda t: t * 2)
    assert cache.get("k", (w,), lambda t: pytest.fail("rebuilt")) is first
    assert cache.get("k", (w.detach(),), lambda t: pytest.fail("rebuilt")) is first  # same storage and version
    w2 = torch.randn(4, 8)
    cache.get("k", (w2,), lambda t: t)
    assert len(cache) == 2
    del w
    cache.get("k", (torch.randn(2, 2),), lambda t: t)  # pruning happens on the next build
    assert len(cache) == 2


def test_ep_gt1_fp8_block_raises_before_launch(monkeypatch):
    from mok_cute.layers import select as B
    from mok_cute.layers import grouped as G
    from mok_cute.config import MoKConfig

    monkeypatch.setattr(G, "_world", lambda group: (2, 0))
    p, _ = make_problem(T=8, H=256, I=256, E=2, k=2)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    be = B.get_backend("sm90")
    monkeypatch.setattr(be.mlp, "forward", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(NotImplementedError, match="EP > 1"):
        be.forward(inp, MoKConfig(precision="fp8_block"), object())
    for precision in ("bf16", "mxfp8"):  # EP > 1 runs these (mok_cute.layers.ep)
        be.check(inp, MoKConfig(precision=precision), object())


def test_precision_validation(emu, monkeypatch):
    mlp = S.Sm90ExpertMLP()
    p, _ = make_problem(T=8, H=256, I=256, E=2, k=2)
    offs = torch.tensor([0, 4, 8], dtype=torch.int32)
    x = p["x"][:8].contiguous()
    with pytest.raises(ValueError, match="precision"):
        mlp.forward(x, offs, p["w_gate"], p["w_up"], p["w_down"], None, precision="fp4")
    bad = make_problem(T=8, H=320, I=256, E=2, k=2)[0]  # a multiple of 64, not of fp8_block's 128
    with pytest.raises(ValueError, match="H = 320 must be a positive multiple of 128"):
        mlp.forward(bad["x"], offs, bad["w_gate"], bad["w_up"], bad["w_down"], None, precision="fp8_block")

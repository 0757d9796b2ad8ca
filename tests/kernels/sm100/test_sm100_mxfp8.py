"""SM100 MXFP8 expert MLP glue on CPU (no Blackwell anywhere: the kernels never run here).

* the quantization glue (CuTe quantize kernels swapped for the reference quantizers) hands the
  sm100 wrappers exactly the operands the reference quantizes, bitwise;
* the device-side wgrad packers (token rows, grouped blocked token scales) equal
  ``sm100_layouts.pack_token_scales`` on random offsets with empty experts, without host syncs;
* the layer (GroupedExpertBackend over Sm100ExpertMLP) with the sm100 GEMM wrappers replaced by
  a torch emulation of their contract (dequantize the MXFP8 operands from the layouts the
  wrappers take, fp64 matmul rounded to fp32, like the reference) equals the reference
  backend's mxfp8 layer: outputs and weight / input gradients bitwise, d topk_w within fp32
  summation tolerance (the backend sums it in fp32, the reference in fp64).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_problem
from mok_cute import reference as R
from mok_cute.layers import sm100 as S
from mok_cute.kernels.sm100 import layouts as lay


@pytest.fixture
def ref_quant(monkeypatch):
    """The CuTe quantize kernels replaced by the reference quantizers (their bitwise contract)."""
    from mok_cute.kernels.quant import quantize, quantize_fp8

    monkeypatch.setattr(quantize, "quantize_mxfp8", R.mxfp8_quantize)

    def tokens(x, offsets, fmt):
        assert fmt == "mxfp8" and offsets.dtype == torch.int32
        return R.mxfp8_quantize_tokens(x, offsets)

    monkeypatch.setattr(quantize_fp8, "quantize_tokens", tokens)


# ------------------------------------------------------------------ emulated sm100 wrappers
def _deq(data, scales, dim):
    """fp32 values of e4m3 ``data`` [R, C] with E8M0 ``scales`` along ``dim`` (exact)."""
    return R.mxfp8_dequantize(data, scales, dim)


def _unblock(flat, rows, kbs):
    """Inverse of ``sm100_layouts.to_blocked``: flat blocked bytes -> uint8 [rows, kbs]."""
    rb, cb = -(-rows // 128), -(-kbs // 4)
    assert flat.shape == (lay.sf_bytes(rows, kbs),)
    t = flat.view(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rb * 128, cb * 4)
    return t[:rows, :kbs]


def _mm(a, b):
    return (a.double() @ b.double().t()).float()


class Emu:
    """Torch emulation of the sm100 MXFP8 wrappers' contract (operands as the wrappers take
    them); records every call's arguments."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _spans(offsets):
        o = offsets.tolist()
        return [(e, lo, hi) for e, (lo, hi) in enumerate(zip(o[:-1], o[1:])) if hi > lo]

    def grouped_gemm1_swiglu(self, x, offsets, w_gate, w_up, limit=None, *, x_scales, w_scales, interleave=None):
        self.calls.append(("gemm1", dict(x=x, x_scales=x_scales, w_gate=w_gate, w_up=w_up, w_scales=w_scales)))
        inter = w_gate.shape[1]
        gu = torch.zeros(x.shape[0], 2 * inter, dtype=torch.bfloat16)
        xd = _deq(x, x_scales, -1)
        for e, lo, hi in self._spans(offsets):
            w = torch.cat([_deq(w_gate[e], w_scales[0][e], -1), _deq(w_up[e], w_scales[1][e], -1)])
            gu[lo:hi] = _mm(xd[lo:hi], w).bfloat16()
        h = R.swiglu(gu[:, :inter].float(), gu[:, inter:].float(), limit).bfloat16()
        return gu, h

    def grouped_gemm(self, a, offsets, w, *, a_scales, w_scales):
        self.calls.append(("gemm2", dict(a=a, a_scales=a_scales, w=w, w_scales=w_scales)))
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.bfloat16)
        ad = _deq(a, a_scales, -1)
        for e, lo, hi in self._spans(offsets):
            out[lo:hi] = _mm(ad[lo:hi], _deq(w[e], w_scales[e], -1)).bfloat16()
        return out

    def grouped_dswiglu_dgrad(self, dy, offsets, w_down, gu, limit=None, *, dy_scales, w_scales):
        self.calls.append(("dswiglu", dict(dy=dy, dy_scales=dy_scales, w_down=w_down, w_scales=w_scales)))
        inter = w_down.shape[2]
        dh = torch.zeros(dy.shape[0], inter)
        dyd = _deq(dy, dy_scales, -1)
        for e, lo, hi in self._spans(offsets):
            dh[lo:hi] = _mm(dyd[lo:hi], _deq(w_down[e], w_scales[e], 0).t())
        dg, du = R.dswiglu(dh, gu[:, :inter].float(), gu[:, inter:].float(), limit)
        self.dgu = torch.cat([dg, du], 1).bfloat16()
        return self.dgu

    def grouped_dgrad1(self, dgu, offsets, w_gate, w_up, *, dgu_scales, w_scales):
        self.calls.append(("dgrad1", dict(dgu=dgu, dgu_scales=dgu_scales, w_gate=w_gate, w_up=w_up,
                                          w_scales=w_scales)))
        out = torch.zeros(dgu.shape[0], w_gate.shape[2], dtype=torch.bfloat16)
        dd = _deq(dgu, dgu_scales, -1)
        for e, lo, hi in self._spans(offsets):
            w = torch.cat([_deq(w_gate[e], w_scales[0][e], 0), _deq(w_up[e], w_scales[1][e], 0)])
            out[lo:hi] = _mm(dd[lo:hi], w.t()).bfloat16()
        return out

    @staticmethod
    def _tok_deq(data, flat, offsets):
        """fp32 values of a token-row operand with grouped blocked token scales (the layout of
        ``pack_token_scales``): token r of expert e uses column 4 (o_e // 128 + e) + (r - o_e) // 32."""
        m, n = data.shape
        o = offsets.tolist()
        grouped = _unblock(flat, n, lay.grouped_sf_rows(m, len(o) - 1) // 32)
        out = torch.zeros(m, n)
        for e, (lo, hi) in enumerate(zip(o[:-1], o[1:])):
            cols = 4 * (lo // 128 + e) + torch.arange(hi - lo) // 32
            s = grouped[:, cols].t().to(torch.int32)  # [L, n]
            out[lo:hi] = data[lo:hi].float() * R._pow2_f32(s - 127)
        return out

    def grouped_wgrad(self, a, b, offsets, *, a_scales, b_scales):
        self.calls.append(("wgrad", dict(a=a, b=b, a_scales=a_scales, b_scales=b_scales)))
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == b.stride(1) == 1
        ad, bd = self._tok_deq(a, a_scales, offsets), self._tok_deq(b, b_scales, offsets)
        out = torch.zeros(offsets.numel() - 1, a.shape[1], b.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in self._spans(offsets):
            out[e] = _mm(ad[lo:hi].t(), bd[lo:hi].t()).bfloat16()
        return out


@pytest.fixture
def emu(monkeypatch, ref_quant):
    from mok_cute.kernels.sm100 import grouped_gemm as k

    em = Emu()
    for name in ("grouped_gemm1_swiglu", "grouped_gemm", "grouped_dswiglu_dgrad", "grouped_dgrad1", "grouped_wgrad"):
        monkeypatch.setattr(k, name, getattr(em, name))
    return em


# ------------------------------------------------------------------ helpers
def _random_offsets(g, num_e, m):
    """Random int32 offsets [E+1] with some empty experts, offsets[E] <= m."""
    counts = torch.randint(0, 90, (num_e,), generator=g)
    counts[torch.randperm(num_e, generator=g)[: max(1, num_e // 3)]] = 0
    counts[0] = 150  # one expert spanning more than one 128-token atom, partial last block
    offs = torch.zeros(num_e + 1, dtype=torch.int64)
    offs[1:] = counts.cumsum(0)
    offs = torch.minimum(offs, torch.tensor(m))
    return offs.to(torch.int32)


def _token_ref(x, offsets):
    """Reference token-wise quantization per expert: (data rows [M, N] (0 outside experts),
    ``pack_token_scales`` of the per-expert scales)."""
    o = offsets.tolist()
    data = torch.zeros(x.shape, dtype=torch.uint8)
    per_e = []
    for lo, hi in zip(o[:-1], o[1:]):
        pad = (-(hi - lo)) % 32
        d, s = R.mxfp8_quantize(F.pad(x[lo:hi].float(), (0, 0, 0, pad)), 0)
        data[lo:hi] = d.view(torch.uint8)[: hi - lo]
        per_e.append(s)
    return data, lay.pack_token_scales(per_e, o, x.shape[1])


def _same_token_scales(got, want, offsets, m, n):
    """``got`` (packed for M = m rows, the size the wgrad wrapper checks) equals ``want``
    (``pack_token_scales``, sized by offsets[E] <= m): bitwise when offsets[E] == m, else the
    unblocked [n, KB] matrices agree on want's columns and got's extra columns are zero."""
    num_e, m0 = offsets.numel() - 1, int(offsets[-1])
    kb, kb0 = lay.grouped_sf_rows(m, num_e) // 32, lay.grouped_sf_rows(m0, num_e) // 32
    if kb == kb0:
        return torch.equal(got, want)
    g, w = _unblock(got, n, kb), _unblock(want, n, kb0)
    return torch.equal(g[:, :kb0], w) and not g[:, kb0:].any()


class _NoSync:
    """Make host syncs (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``) raise inside the block."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        def boom(*a, **kw):
            raise AssertionError("host sync in a device-side packer")
        for name in ("item", "tolist", "__int__", "__bool__", "__index__", "cpu", "numpy"):
            self.mp.setattr(torch.Tensor, name, boom)

    def __exit__(self, *exc):
        self.mp.undo()


# ------------------------------------------------------------------ (3) device-side packers
@pytest.mark.parametrize("seed", range(6))
def test_token_packers_equal_pack_token_scales(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    num_e = int(torch.randint(1, 9, (1,), generator=g))
    n = 64
    offs = _random_offsets(g, num_e, 10_000)
    extra = (0, 5, 200)[seed % 3]  # rows past offsets[E] (the layer's -1 routes), also a whole atom more
    m = int(offs[-1]) + extra
    x = (torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
    data_t, scales = R.mxfp8_quantize_tokens(x, offs)  # the layout quantize_tokens writes
    want_data, want_scales = _token_ref(x, offs)
    lo, hi = 16, 48  # a feature slice packs like that slice's own quantization
    _, want_slice = _token_ref(x[:, lo:hi].contiguous(), offs)
    with _NoSync(monkeypatch):
        rows = S.token_rows(data_t, offs, m)
        packed = S.pack_token_scales_device(scales, offs, m)
        packed_slice = S.pack_token_scales_device(scales[:, lo:hi], offs, m)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (m, n)
    assert torch.equal(rows.view(torch.uint8), want_data)
    assert _same_token_scales(packed, want_scales, offs, m, n)
    assert _same_token_scales(packed_slice, want_slice, offs, m, hi - lo)


def test_token_packers_all_empty_and_single(monkeypatch):
    for offs, m in ((torch.tensor([0, 0, 0], dtype=torch.int32), 5), (torch.tensor([0, 1], dtype=torch.int32), 1),
                    (torch.tensor([0, 0, 128, 128, 129], dtype=torch.int32), 129)):
        x = torch.randn(m, 32).bfloat16()
        data_t, scales = R.mxfp8_quantize_tokens(x, offs)
        want_data, want_scales = _token_ref(x, offs)
        assert torch.equal(S.token_rows(data_t, offs, m).view(torch.uint8), want_data)
        assert _same_token_scales(S.pack_token_scales_device(scales, offs, m), want_scales, offs, m, 32)


# ------------------------------------------------------------------ (1) quantization glue
def test_mxfp8_glue_operands_equal_reference_quantization(emu):
    g = torch.Generator().manual_seed(3)
    num_e, hid, inter, limit = 4, 64, 96, 3.0
    offs = torch.tensor([0, 150, 150, 181, 300], dtype=torch.int32)
    m = 310
    x = torch.randn(m, hid, generator=g).bfloat16()
    wg, wu = (torch.randn(num_e, inter, hid, generator=g) * 0.2).bfloat16(), \
        (torch.randn(num_e, inter, hid, generator=g) * 0.2).bfloat16()
    wd = (torch.randn(num_e, hid, inter, generator=g) * 0.2).bfloat16()
    dy = torch.randn(m, hid, generator=g).bfloat16()
    mlp = S.Sm100ExpertMLP()
    assert mlp.precisions == ("bf16", "mxfp8")
    out, grp = mlp.forward(x, offs, wg, wu, wd, limit, precision="mxfp8")
    assert grp.precision == "mxfp8"
    mlp.backward(grp, dy, wg, wu, wd, limit)
    calls = emu.calls
    assert [c[0] for c in calls] == ["gemm1", "gemm2", "dswiglu", "dgrad1", "wgrad", "wgrad", "wgrad"]

    def same(got, want):
        d, s = got
        wd_, ws_ = want
        assert d.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
        assert torch.equal(d.view(torch.uint8), wd_.view(torch.uint8)) and torch.equal(s, ws_)

    def per_expert(w, dim):
        qs = [R.mxfp8_quantize(w[e], dim) for e in range(w.shape[0])]
        return torch.stack([q[0].view(torch.uint8) for q in qs]), torch.stack([q[1] for q in qs])

    c = calls[0][1]  # GEMM1: x rows along H, Wg / Wu along H
    same((c["x"], c["x_scales"]), R.mxfp8_quantize(x, -1))
    same((c["w_gate"], c["w_scales"][0]), per_expert(wg, -1))
    same((c["w_up"], c["w_scales"][1]), per_expert(wu, -1))
    c = calls[1][1]  # GEMM2: h rows along I, Wd along I
    same((c["a"], c["a_scales"]), R.mxfp8_quantize(grp.h, -1))
    same((c["w"], c["w_scales"]), per_expert(wd, -1))
    c = calls[2][1]  # dgrad2: dy rows along H, Wd along H (columns of [H, I])
    same((c["dy"], c["dy_scales"]), R.mxfp8_quantize(dy, -1))
    same((c["w_down"], c["w_scales"]), per_expert(wd, 0))
    c = calls[3][1]  # dgrad1: dgu rows along 2I, Wg / Wu along I (columns of [I, H])
    same((c["dgu"], c["dgu_scales"]), R.mxfp8_quantize(emu.dgu, -1))
    same((c["w_gate"], c["w_scales"][0]), per_expert(wg, 0))
    same((c["w_up"], c["w_scales"][1]), per_expert(wu, 0))
    # wgrads: along tokens per expert; data as token rows, scales packed as pack_token_scales
    dg, du = emu.dgu[:, :inter].contiguous(), emu.dgu[:, inter:].contiguous()
    for (_, c), (a, b) in zip(calls[4:], [(dy, grp.h), (dg, x), (du, x)]):
        for t, key in ((a, "a"), (b, "b")):
            want_d, want_s = _token_ref(t, offs)
            assert torch.equal(c[key].view(torch.uint8), want_d)
            assert _same_token_scales(c[key + "_scales"], want_s, offs, m, t.shape[1])


# ------------------------------------------------------------------ (2) the layer end to end
@pytest.mark.parametrize("hid,inter,shared_i,limit", [(256, 256, 256, 4.0), (256, 256, None, None),
                                                      (192, 320, 64, 4.0)])  # the last: N and K tails
def test_sm100_mxfp8_layer_equals_reference(emu, hid, inter, shared_i, limit):
    from mok_cute.layers import select as B
    from mok_cute.config import MoKConfig

    p, dy = make_problem(T=40, H=hid, I=inter, E=5, k=3, shared_I=shared_i, seed=21)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], limit)
    be = B.get_backend("sm100")
    cfg = MoKConfig(precision="mxfp8")
    y, st = be.forward(inp, cfg, None)
    grads = be.backward(st, dy)
    assert st.routed.precision == "mxfp8"
    ry, saved = R.moe_forward(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"],
                              limit, precision="mxfp8")
    rg = R.moe_backward(saved, dy)
    assert torch.equal(y, ry)
    for name in ("dx", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(grads, name), getattr(rg, name)), name
    if shared_i:
        for a, b in zip(grads.d_shared, rg.d_shared):
            assert torch.equal(a, b)
    else:
        assert grads.d_shared is None and rg.d_shared is None
    # d topk_w: the backend sums over H in fp32, the reference in fp64
    torch.testing.assert_close(grads.d_topk_w, rg.d_topk_w, rtol=1e-5, atol=1e-5)
    assert sum(c[0] == "wgrad" for c in emu.calls) == (6 if shared_i else 3)


# ------------------------------------------------------------------ the real wrappers accept the glue's operands
@pytest.mark.parametrize("hid,inter", [(256, 256), (192, 320)])
def test_real_sm100_wrappers_accept_mxfp8_glue_operands(monkeypatch, ref_quant, hid, inter):
    """The real sm100 wrappers (validation + scale repacking on CPU) take every operand the glue
    builds, tail shapes too; only the launch (and the wgrad's arch lookup, after its checks) is
    stubbed out."""
    from mok_cute.kernels.sm100 import grouped_gemm as k

    launches = []

    def launch(kind, a, w, scales, offsets, outs, limit, n, w2=None):
        cfg, epilogue, b_major = kind.cfg, kind.epilogue, kind.b_major
        (a_sf, w_sf), (out0, out1) = scales, outs
        assert cfg.mx and a.dtype == w.dtype == torch.float8_e4m3fn and a_sf.dtype == w_sf.dtype == torch.uint8
        launches.append((epilogue, b_major, w2 is not None))
        out0.zero_()
        out1.zero_()

    class Launched(Exception):
        pass

    def arch(device):
        raise Launched

    real_wgrad = k.grouped_wgrad

    def wgrad(a, b, offsets, **kw):
        with pytest.raises(Launched):  # every check passed; the next step is the launch
            real_wgrad(a, b, offsets, **kw)
        launches.append(("wgrad", a.shape[1], b.shape[1]))
        return torch.zeros(offsets.numel() - 1, a.shape[1], b.shape[1], dtype=torch.bfloat16)

    monkeypatch.setattr(k, "_check_devices", lambda **t: None)
    monkeypatch.setattr(k, "_launch", launch)
    monkeypatch.setattr(k, "_arch", arch)
    monkeypatch.setattr(k, "grouped_wgrad", wgrad)
    g = torch.Generator().manual_seed(5)
    num_e = 3
    offs = torch.tensor([0, 140, 140, 200], dtype=torch.int32)
    m = 230
    x = torch.randn(m, hid, generator=g).bfloat16()
    ws = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in [(num_e, inter, hid)] * 2 + [(num_e, hid, inter)]]
    mlp = S.Sm100ExpertMLP()
    _, grp = mlp.forward(x, offs, *ws, 2.0, precision="mxfp8")
    mlp.backward(grp, torch.randn(m, hid, generator=g).bfloat16(), *ws, 2.0)
    assert launches == [("swiglu", "k", False), ("plain", "k", False), ("dswiglu", "mn", False),
                        ("plain", "mn", True), ("wgrad", hid, inter), ("wgrad", inter, hid), ("wgrad", inter, hid)]


def test_mxfp8_weights_quantized_once_while_unchanged(emu, monkeypatch):
    """Weight quantizations are cached per (weight, axis): a second forward with the same
    weights quantizes only activations; an in-place update (version bump) re-quantizes."""
    from mok_cute.kernels.quant import quantize

    g = torch.Generator().manual_seed(5)
    num_e, hid, inter = 2, 64, 64
    offs = torch.tensor([0, 40, 70], dtype=torch.int32)
    x = torch.randn(70, hid, generator=g).bfloat16()
    wg, wu = ((torch.randn(num_e, inter, hid, generator=g) * 0.2).bfloat16() for _ in range(2))
    wd = (torch.randn(num_e, hid, inter, generator=g) * 0.2).bfloat16()
    shapes = []

    def counting(t, dim=-1):
        shapes.append(tuple(t.shape))
        return R.mxfp8_quantize(t, dim)

    monkeypatch.setattr(quantize, "quantize_mxfp8", counting)
    mlp = S.Sm100ExpertMLP()
    weight_shapes = {(num_e * inter, hid), (num_e * hid, inter)}
    out1, _ = mlp.forward(x, offs, wg, wu, wd, None, precision="mxfp8")
    first = sum(s in weight_shapes for s in shapes)
    shapes.clear()
    out2, _ = mlp.forward(x, offs, wg, wu, wd, None, precision="mxfp8")
    assert first == 3 and sum(s in weight_shapes for s in shapes) == 0 and torch.equal(out1, out2)
    shapes.clear()
    wd.mul_(2.0)
    mlp.forward(x, offs, wg, wu, wd, None, precision="mxfp8")
    assert sum(s in weight_shapes for s in shapes) == 1


def test_sm100_runs_fp8_block_as_mxfp8(emu):
    """precision="fp8_block" on SM100 runs the MXFP8 kernels (Sm100ExpertMLP.precision_alias: hardware block
    scales), warned once: y and every gradient bitwise those of precision="mxfp8"."""
    import warnings

    from mok_cute.config import MoKConfig
    from mok_cute.layers import grouped
    from mok_cute.layers import select as B

    p, dy = make_problem(T=40, H=256, I=256, E=5, k=3, shared_I=None, seed=22)
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, 4.0)
    be = B.get_backend("sm100")
    grouped._ALIASED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, st = be.forward(inp, MoKConfig(precision="fp8_block"), None)
        be.forward(inp, MoKConfig(precision="fp8_block"), None)
    assert [str(w.message) for w in caught if "runs as 'mxfp8'" in str(w.message)] == [
        str(caught[0].message)]  # once per process
    assert st.routed.precision == "mxfp8"
    grads = be.backward(st, dy)
    y2, st2 = be.forward(inp, MoKConfig(precision="mxfp8"), None)
    grads2 = be.backward(st2, dy)
    assert torch.equal(y, y2)
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(grads, name), getattr(grads2, name)), name

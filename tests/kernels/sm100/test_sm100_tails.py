"""SM100 N / K tails (H, I, I_s multiples of 64, not of the 256-wide tile) on CPU: no Blackwell
GPU exists here, so the kernels never run; these tests check the host side they rely on.

* :func:`interleave_gate_up` pads I to tile_n / 2 with zero rows (I % 128 == 64), so every
  SwiGLU tile holds matching gate and up columns;
* :func:`~sm100.layouts.pad_k_parts` starts dgrad1's second K part at k-tile ceil(I / 128);
* the layer through the real sm100 wrappers (validation, interleave, scale packing) with each
  launch replaced by a torch model of the kernel's documented walk (ceil(N / tile_n) tiles;
  TMA zero fill of B past N and of each K part past its end; MXFP8 scales read from the
  packed blocked buffers at the kernel's indices; only columns inside N stored) equals the
  reference layer bitwise, BF16 and MXFP8, d topk_w within fp32 summation tolerance; with
  gpt-oss's SwiGLU too (the launch's kind carries its alpha / up offset, the model applies them).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_problem
from mok_cute import reference as R
from mok_cute.kernels.sm100 import grouped_gemm as k
from mok_cute.kernels.sm100 import layouts as lay
from test_sm100_mxfp8 import Emu, _unblock, ref_quant  # noqa: F401 (fixture)

F8 = torch.float8_e4m3fn


def test_interleave_pads_to_half_tiles():
    g = torch.Generator().manual_seed(0)
    for inter in (64, 192, 320, 256):
        wg, wu = torch.randn(2, inter, 96, generator=g), torch.randn(2, inter, 96, generator=g)
        w = k.interleave_gate_up(wg, wu, 128)
        i_p = -(-inter // 128) * 128
        assert w.shape == (2, 2 * i_p, 96)
        blocks = w.view(2, i_p // 128, 2, 128, 96)
        for j, src in enumerate((wg, wu)):
            half = blocks[:, :, j].reshape(2, i_p, 96)
            assert torch.equal(half[:, :inter], src) and not half[:, inter:].any()


def test_pad_k_parts_starts_part_two_at_a_k_tile():
    a, b = torch.randint(1, 255, (5, 6), dtype=torch.uint8), torch.randint(1, 255, (5, 6), dtype=torch.uint8)
    p = lay.pad_k_parts((a, b), 1)
    assert p.shape == (5, 16)
    assert torch.equal(p[:, :6], a) and torch.equal(p[:, 8:14], b) and not p[:, 6:8].any() and not p[:, 14:].any()
    assert torch.equal(lay.pad_k_parts((a[:, :4],), 1), a[:, :4])


# ------------------------------------------------------------------ torch model of one launch
def _k_parts(t, split, pad):
    """A or B (rows, K) split into its K parts (split K: the two halves), each zero-padded to
    whole k-tiles of ``pad`` (the TMA fill past each part's K), concatenated."""
    raw = t.view(torch.uint8) if t.dtype == F8 else t
    out = torch.cat([F.pad(p, (0, -p.shape[-1] % pad)) for p in (raw.chunk(2, -1) if split else (raw,))], -1)
    return out.view(F8) if t.dtype == F8 else out


def _deq(data, flat, rows, scale_rows):
    """fp32 of e4m3 ``data`` [R, Kp] whose row r has its E8M0 scales at row ``scale_rows[r]``
    of the flat blocked [rows, Kp / 32] scale matrix ``flat``."""
    s = _unblock(flat, rows, data.shape[1] // lay.SF_VEC)[scale_rows].to(torch.int32)
    return data.float() * R._pow2_f32(s - 127).repeat_interleave(lay.SF_VEC, 1)


def launch_model(kind, a, w, scales, offsets, outs, limit, n, w2=None, bias=None):
    """The kernel's tile walk in torch on exactly the operands the wrapper hands ``_launch``; ``bias`` (the
    ``biased`` variant's ``ExpertBias``): fp32(b[e]) added to the fp32 accumulator before the epilogue rounds it
    (swiglu: gate / up to g / u, plain: down)."""
    (cfg, epilogue, clamp, b_major, gated), (a_sf, w_sf), (out0, out1) = kind, scales, outs
    act = limit if clamp else None  # the activation the kind and the runtime limit stand for
    if gated is not None:
        act = R.SwiGLU(act, gated.alpha, gated.up_offset)
    split = w2 is not None
    if split:  # a [M, 2, I]; B = [w_gate; w_up] along K
        a, w = a.reshape(a.shape[0], -1), torch.cat([w, w2], 1)
    b = w if b_major == k.K_MAJOR else w.transpose(1, 2)  # (E, N, K)
    assert b.shape[1] == n and (epilogue != "swiglu" or n % cfg.tile_n == 0)
    a, b = _k_parts(a, split, cfg.tile_k), _k_parts(b, split, cfg.tile_k)
    offs = offsets.tolist()
    if cfg.mx:
        rows = torch.arange(a.shape[0])
        e_of = torch.searchsorted(torch.tensor(offs[1:]), rows, right=True).clamp(max=len(offs) - 2)
        o_e = torch.tensor(offs)[e_of]
        a = _deq(a, a_sf, lay.grouped_sf_rows(a.shape[0], len(offs) - 1),
                 lay.SF_ATOM_ROWS * (o_e // lay.SF_ATOM_ROWS + e_of) + rows - o_e)
        per_e = w_sf.view(b.shape[0], -1)
        b = torch.stack([_deq(b[e], per_e[e], n, torch.arange(n)) for e in range(b.shape[0])])
    n_tiles = -(-n // cfg.tile_n)
    b = F.pad(b, (0, 0, 0, n_tiles * cfg.tile_n - n))  # TMA zero fill past N
    for e, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi == lo:
            continue
        acc = (a[lo:hi].double() @ b[e].double().t()).float()  # [rows, n_tiles * tile_n]
        if epilogue == "plain":
            r = acc[:, :out0.shape[1]]
            out0[lo:hi] = (r if bias is None else r + bias.down[e].float()).bfloat16()
        elif epilogue == "swiglu":  # tile t: gate cols t*half + c, then up; columns < I stored
            inter, half = out1.shape[1], cfg.tile_n // 2
            t = acc.view(hi - lo, n_tiles, 2, half)
            gate, up = (t[:, :, j].reshape(hi - lo, -1)[:, :inter] for j in (0, 1))
            if bias is not None:
                gate, up = gate + bias.gate[e].float(), up + bias.up[e].float()
            gate, up = gate.bfloat16(), up.bfloat16()
            out0[lo:hi, 0], out0[lo:hi, 1] = gate, up
            out1[lo:hi] = R.swiglu(gate.float(), up.float(), act).bfloat16()
        else:
            inter = out0.shape[2]
            dg, du = R.dswiglu(acc[:, :inter], out1[lo:hi, 0].float(), out1[lo:hi, 1].float(), act)
            out0[lo:hi, 0], out0[lo:hi, 1] = dg.bfloat16(), du.bfloat16()


class _Launched(Exception):
    pass


@pytest.fixture
def model(monkeypatch, ref_quant):
    """The real sm100 wrappers with launches modelled (wgrad: its checks run, then the model)."""
    real_wgrad = k.grouped_wgrad

    def arch(device):
        raise _Launched

    def wgrad(a, b, offsets, *, a_scales=None, b_scales=None):
        with pytest.raises(_Launched):  # every check passed; the next step is the launch
            real_wgrad(a, b, offsets, a_scales=a_scales, b_scales=b_scales)
        if a.dtype == F8:
            a, b = Emu._tok_deq(a, a_scales, offsets), Emu._tok_deq(b, b_scales, offsets)
        out = torch.zeros(offsets.numel() - 1, a.shape[1], b.shape[1], dtype=torch.bfloat16)
        for e, lo, hi in Emu._spans(offsets):
            out[e] = (a[lo:hi].double().t() @ b[lo:hi].double()).float().bfloat16()
        return out

    monkeypatch.setattr(k, "_check_devices", lambda **t: None)
    monkeypatch.setattr(k, "_launch", launch_model)
    monkeypatch.setattr(k, "_arch", arch)
    monkeypatch.setattr(k, "grouped_wgrad", wgrad)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("hid, inter, shared_i, act", [(192, 320, 64, 4.0), (320, 128, 192, None),
                                                      (192, 128, 64, R.SwiGLU(1.0, 1.702, 1.0))],
                         ids=["clamp", "plain", "gpt-oss"])
def test_layer_with_tails_equals_reference(model, precision, hid, inter, shared_i, act):
    """``act``: the activation, None, a clamp L or a SwiGLU (gpt-oss's alpha and up offset, a limit that clamps
    here), passed as the layer inputs carry it (``swiglu_limit`` its limit, ``activation`` the SwiGLU)."""
    from mok_cute.config import MoKConfig
    from mok_cute.layers import select as B

    p, dy = make_problem(T=40, H=hid, I=inter, E=5, k=3, shared_I=shared_i, seed=hid + inter)
    p["topk_idx"][p["topk_idx"] == 2] = -1  # expert 2 gets no token
    inp = B.MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"], act)
    be = B.get_backend("sm100")
    y, st = be.forward(inp, MoKConfig(precision=precision), None)
    assert_reference_layer(p, dy, act, y, be.backward(st, dy), precision)


def assert_reference_layer(p, dy, limit, y, grads, precision="bf16"):
    """y and every gradient of the layer on ``make_problem``'s ``p`` bitwise the reference's (d
    topk_w within fp32 summation tolerance)."""
    ry, saved = R.moe_forward(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], p["shared"],
                              limit, precision=precision)
    rg = R.moe_backward(saved, dy)
    assert torch.equal(y, ry)
    for name in ("dx", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(grads, name), getattr(rg, name)), name
    assert (grads.d_shared is None) == (rg.d_shared is None)
    for a, b in zip(grads.d_shared or (), rg.d_shared or ()):
        assert torch.equal(a, b)
    torch.testing.assert_close(grads.d_topk_w, rg.d_topk_w, rtol=1e-5, atol=1e-5)

"""route_grad: the routed-gradient prologue (dy rows scaled by topk_w, d topk_w) compiles for
every arch with the instructions its contract needs, and its torch path (the CPU path and
the GPU check's mirror) equals the reference's formulas."""
import pytest
import torch

from mok_cute.layers.grouped import route_sort
from mok_cute.kernels import route_grad


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("with_x", [False, True])
def test_compiles_with_rn_arithmetic(arch, with_x):
    _, rep = route_grad.compiled_route_grad(arch, with_x=with_x)
    assert rep.total_spill_bytes == 0
    for inst in ("mul.rn.f32", "fma.rn.f32", "cvt.rn.bf16x2.f32", "shfl.sync.bfly", "ld.global.v4", "st.global.v4"):
        assert rep.has(inst), inst
    # the x row copy adds a second batch of 16-byte loads and stores per route
    plain = route_grad.compiled_route_grad(arch)[1]
    assert (rep.ptx.count("st.global.v4") > plain.ptx.count("st.global.v4")) == with_x


def _problem(t=37, k=4, e=6, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, e, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.2] = -1
    w = torch.rand(t, k, generator=g)
    dy = torch.randn(t, h, generator=g).bfloat16()
    order, offsets, valid = route_sort(idx, e)
    r = torch.randn(t * k, h, generator=g).bfloat16()
    return dy, r, order, w, offsets, idx


def test_torch_path_matches_reference_formulas():
    dy, r, order, w, offsets, idx = _problem()
    t, k = idx.shape
    rows, dtw = route_grad.dy_rows_and_dtopk_w(dy, r, order, w, offsets)
    n = int(offsets[-1])
    q = order[:n]
    want_rows = (dy[q // k].float() * w.reshape(-1)[q][:, None]).to(torch.bfloat16)
    assert torch.equal(rows[:n], want_rows)  # bitwise: one fp32 multiply, one rounding
    slots = torch.zeros(t * k, dy.shape[1], dtype=torch.bfloat16)
    slots[q] = r[:n]
    want = torch.where(idx >= 0, (dy.double()[:, None] * slots.view(t, k, -1).double()).sum(-1),
                       torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(dtw.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.all(dtw[idx < 0] == 0)


def test_x_rows_torch_path():
    dy, r, order, w, offsets, idx = _problem()
    x = torch.randn_like(dy)
    rows, dtw, x_rows = route_grad.dy_x_rows_and_dtopk_w(dy, x, r, order, w, offsets)
    want_rows, want_dtw = route_grad.dy_rows_and_dtopk_w(dy, r, order, w, offsets)
    n = int(offsets[-1])
    assert torch.equal(rows[:n], want_rows[:n]) and torch.equal(dtw, want_dtw)
    assert torch.equal(x_rows[:n], x[order[:n] // idx.shape[1]])
    with pytest.raises(TypeError, match="x must"):
        route_grad.dy_x_rows_and_dtopk_w(dy, x.float(), r, order, w, offsets)
    with pytest.raises(ValueError, match="x must be"):
        route_grad.dy_x_rows_and_dtopk_w(dy, x[:-1].contiguous(), r, order, w, offsets)


def test_validation():
    dy, r, order, w, offsets, _ = _problem()
    with pytest.raises(TypeError, match="topk_w"):
        route_grad.dy_rows_and_dtopk_w(dy, r, order, w.double(), offsets)
    with pytest.raises(ValueError, match="shapes"):
        route_grad.dy_rows_and_dtopk_w(dy, r[:-1], order, w, offsets)
    with pytest.raises(ValueError, match="multiple of 8"):
        route_grad.dy_rows_and_dtopk_w(dy[:, :60].contiguous(), r[:, :60].contiguous(), order, w, offsets)
    with pytest.raises(TypeError, match="order"):
        route_grad.dy_rows_and_dtopk_w(dy, r, order.int(), w, offsets)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_slot_variant_compiles_to_the_dot_only(arch):
    """slot_dtopk_w's kernel (the EP > 1 unfused backward's d topk_w from the slot rows): 0 spills,
    route_row's fma.rn sum and butterfly, and no scaled row (no mul.rn, no bf16 convert, no store
    of rows)."""
    _, rep = route_grad.compiled_slot_dtopk_w(arch)
    assert rep.total_spill_bytes == 0
    for inst in ("fma.rn.f32", "shfl.sync.bfly", "ld.global.v4"):
        assert rep.has(inst), inst
    for inst in ("mul.rn.f32", "cvt.rn.bf16x2.f32", "st.global.v4"):
        assert not rep.has(inst), inst


def test_slot_dtopk_w_torch_path_and_checks():
    """The CPU path: dy . slot row per route, 0 on -1 slots (whatever those rows hold, NaN too);
    [T, k, H] slot rows are taken as [T*k, H]; bad arguments raise before any launch."""
    dy, r, _, _, _, idx = _problem()
    t, k = idx.shape
    r[(idx.reshape(-1) < 0).nonzero()[:, 0]] = float("nan")
    got = route_grad.slot_dtopk_w(dy, r, idx)
    want = torch.where(idx >= 0, (dy.double()[:, None] * r.view(t, k, -1).double()).sum(-1), 0.0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5) and bool(torch.all(got[idx < 0] == 0))
    assert torch.equal(route_grad.slot_dtopk_w(dy, r.view(t, k, -1), idx), got)
    with pytest.raises(TypeError, match="topk_idx"):
        route_grad.slot_dtopk_w(dy, r, idx.int())
    with pytest.raises(ValueError, match="slot_rows"):
        route_grad.slot_dtopk_w(dy, r[:-1], idx)
    with pytest.raises(ValueError, match="contiguous"):
        route_grad.slot_dtopk_w(dy.t().contiguous().t(), r, idx)


@pytest.mark.parametrize("xpass,by_route", [(0, False), (0, True), (1, False)])
def test_mx_prologue_compiles_with_its_round_trips(xpass, by_route):
    """The MXFP8 prologue's two kernels (sm_90a; the MXFP8 backward's route_grad pass and x gather with their round
    trips, over every SM): 0 spills, at most 80 registers (three CTAs of 256 threads per SM, as many as their 68 KB of
    shared memory allow); the MXFP8 round trips (e4m3 converts both ways, the packed amax), the slab copied in by
    16-byte cp.async and read back in 16-byte chunks between CTA barriers, 16-byte global stores, the token-local
    block order's search (ballot, shuffles up, popc); the dy pass also route_row's scaled rows written back into the
    slab, the forward rows' 16-byte loads and the fixed-order d topk_w (fma.rn); the x pass loads nothing itself."""
    _, rep = route_grad.compiled_mx_rows("sm_90a", xpass, by_route)
    assert rep.total_spill_bytes == 0 and max(rep.registers.values()) <= 80
    for inst in ("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2", "max.u16x2", "bar.sync", "ld.shared.v4.b32",
                 "st.global.v4.b32", "vote.sync.ballot", "shfl.sync.up", "popc", "shfl.sync.bfly",
                 "cp.async.cg.shared.global", "cp.async.wait_group"):
        assert rep.has(inst), inst
    for inst in ("fma.rn.f32", "st.shared.v4.b32", "ld.global.v4.b32"):
        assert rep.has(inst) == (xpass == 0), inst


def test_mx_prologue_validation():
    """The MXFP8 prologue's two launches refuse, before any launch, an int64 order, a wrong topk_w, an x whose
    rows do not match the order, and CPU tensors (no torch path: its device check compares it with the unfused
    passes)."""
    dy, r, order, w, offsets, idx = _problem()
    k = idx.shape[1]
    x = torch.randn_like(dy.float()).bfloat16()
    o32 = order.int()
    with pytest.raises(TypeError, match="order"):
        route_grad.mx_dy_rows_and_dtopk_w(dy, r, order, w, offsets)
    with pytest.raises(TypeError, match="topk_w"):
        route_grad.mx_dy_rows_and_dtopk_w(dy, r, o32, w.double(), offsets)
    with pytest.raises(ValueError, match="CUDA"):
        route_grad.mx_dy_rows_and_dtopk_w(dy, r, o32, w, offsets)
    with pytest.raises(TypeError, match="order"):
        route_grad.mx_x_rows(x, order, offsets, k)
    with pytest.raises(ValueError, match="order"):
        route_grad.mx_x_rows(x[:-1].contiguous(), o32, offsets, k)
    with pytest.raises(ValueError, match="CUDA"):
        route_grad.mx_x_rows(x, o32, offsets, k)

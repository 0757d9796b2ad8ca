"""SM90 grouped GEMM kernels compile for sm_90a (CPU only) and the host wrappers validate inputs."""
import pytest
import torch

from mok_cute.kernels.sm90_grouped_gemm import (
    compile_grouped_gemm, grouped_gemm, grouped_gemm1_swiglu, interleave_gate_up,
)
from mok_cute.kernels.sm90_mainloop import NUM_THREADS, MainloopConfig

VARIANTS = [
    ("plain", False, MainloopConfig()),
    ("swiglu", False, MainloopConfig()),
    ("swiglu", True, MainloopConfig()),
    ("plain", False, MainloopConfig(tile_n=128)),
]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-clamp{int(v[1])}-n{v[2].tile_n}")
def report(request):
    epilogue, clamp, cfg = request.param
    _, rep = compile_grouped_gemm(epilogue, clamp=clamp, cfg=cfg, inspect=True)
    return rep


def test_ptx_has_wgmma_and_setmaxnreg(report):
    assert report.has("wgmma.mma_async")
    assert report.has("setmaxnreg.inc") and report.has("setmaxnreg.dec")
    assert report.has("cp.async.bulk.tensor")  # TMA loads
    assert report.has("mbarrier.try_wait")


def test_no_spills_and_registers_fit(report):
    assert report.registers, report.log[-2000:]
    assert report.total_spill_bytes == 0
    # the launch register count must leave room for 384 threads (setmaxnreg redistributes)
    assert report.max_registers * NUM_THREADS <= 65536


def test_interleave_gate_up():
    g = torch.randn(2, 256, 16)
    u = torch.randn(2, 256, 16)
    w = interleave_gate_up(g, u, 256)
    assert w.shape == (2, 512, 16)
    assert torch.equal(w[:, :128], g[:, :128]) and torch.equal(w[:, 128:256], u[:, :128])
    assert torch.equal(w[:, 256:384], g[:, 128:]) and torch.equal(w[:, 384:], u[:, 128:])


def _inputs(m=300, k=64, e=3, n=256):
    a = torch.zeros(m, k, dtype=torch.bfloat16)
    offs = torch.tensor([0, 100, 100, m], dtype=torch.int32)[: e + 1]
    w = torch.zeros(e, n, k, dtype=torch.bfloat16)
    return a, offs, w


@pytest.mark.parametrize("mutate, exc, name", [
    (lambda a, o, w: ("x", o, w), TypeError, "a"),
    (lambda a, o, w: (a.float(), o, w), TypeError, "a"),
    (lambda a, o, w: (a[None], o, w), ValueError, "a"),
    (lambda a, o, w: (a[:, :60], o, w), ValueError, "a"),
    (lambda a, o, w: (a.t(), o, w), ValueError, "a"),
    (lambda a, o, w: (a, o.float(), w), TypeError, "offsets"),
    (lambda a, o, w: (a, o[:1], w), ValueError, "offsets"),
    (lambda a, o, w: (a, o, w.half()), TypeError, "w"),
    (lambda a, o, w: (a, o, w[:2]), ValueError, "w"),
    (lambda a, o, w: (a, o, w[:, :, :32]), ValueError, "w"),
    (lambda a, o, w: (a, o, w[:, :200]), ValueError, "w"),
    (lambda a, o, w: (a, o, w), ValueError, "CUDA"),  # valid but on the CPU
])
def test_grouped_gemm_validation(mutate, exc, name):
    with pytest.raises(exc, match=name):
        grouped_gemm(*mutate(*_inputs()))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(w_up=torch.zeros(3, 128, 64, dtype=torch.bfloat16)), ValueError, "w_up"),
    (dict(w_gate=torch.zeros(3, 192, 64, dtype=torch.bfloat16),
          w_up=torch.zeros(3, 192, 64, dtype=torch.bfloat16)), ValueError, "w_gate"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(limit=-1.0), ValueError, "limit"),
    (dict(limit=float("inf")), ValueError, "limit"),
    (dict(x=torch.zeros(8, 64)), TypeError, "x"),
    (dict(limit=4.0), ValueError, "CUDA"),
])
def test_swiglu_validation(kwargs, exc, name):
    a, offs, _ = _inputs()
    args = dict(x=a, offsets=offs, w_gate=torch.zeros(3, 256, 64, dtype=torch.bfloat16),
                w_up=torch.zeros(3, 256, 64, dtype=torch.bfloat16))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        grouped_gemm1_swiglu(**args)

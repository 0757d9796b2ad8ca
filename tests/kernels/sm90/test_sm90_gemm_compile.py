"""SM90 grouped GEMM kernels (forward and backward) compile for sm_90a (CPU only) and the
host wrappers validate inputs."""
import functools
import re

import pytest
import torch

from mok_cute.kernels.sm90.expert_bwd import (
    compile_grouped_wgrad, grouped_dgrad1, grouped_dswiglu_dgrad, grouped_wgrad,
)
from mok_cute.kernels.sm90.grouped_gemm import (
    compile_grouped_gemm, grouped_gemm, grouped_gemm1_swiglu,
)
from mok_cute.kernels.sm90.mainloop import MN_MAJOR, NUM_THREADS, MainloopConfig, Sm90Mainloop
from mok_cute.kernels.swiglu_math import Gated
from mok_cute.reference import SwiGLU

GPT_OSS = Gated(1.702, 1.0)  # SwiGLU.gpt_oss()'s alpha and up offset, compiled in (its limit 7 is the runtime clamp)

N128 = MainloopConfig(tile_n=128)
VARIANTS = {  # plain, swiglu and wgrad store through TMA (cp.async.bulk), dswiglu by row-masked 16-byte stores
    "plain-n256": lambda: compile_grouped_gemm("plain", inspect=True),
    "plain-n128": lambda: compile_grouped_gemm("plain", cfg=N128, inspect=True),
    "swiglu": lambda: compile_grouped_gemm("swiglu", inspect=True),
    "swiglu-clamp": lambda: compile_grouped_gemm("swiglu", clamp=True, inspect=True),
    "swiglu-clamp-n128": lambda: compile_grouped_gemm("swiglu", clamp=True, cfg=N128, inspect=True),
    # h by the producer warpgroup's warps 1-3 (the launches' choice from K = HELPERS_MIN_K)
    "swiglu-helpers": lambda: compile_grouped_gemm("swiglu", helpers=True, inspect=True),
    "swiglu-clamp-helpers": lambda: compile_grouped_gemm("swiglu", clamp=True, helpers=True, inspect=True),
    "swiglu-clamp-tail-helpers": lambda: compile_grouped_gemm("swiglu", clamp=True, n_tail=True, helpers=True,
                                                              inspect=True),
    # backward: GEMM2 dgrad + dSwiGLU (B N-major), GEMM1 dgrad (B split along K), wgrad
    "dswiglu": lambda: compile_grouped_gemm("dswiglu", b_major=MN_MAJOR, inspect=True),
    "dswiglu-clamp": lambda: compile_grouped_gemm("dswiglu", clamp=True, b_major=MN_MAJOR, inspect=True),
    "dgrad1": lambda: compile_grouped_gemm("plain", b_major=MN_MAJOR, split_b=True, inspect=True),
    "wgrad": lambda: compile_grouped_wgrad(inspect=True),
    # gpt-oss's SwiGLU: h = g * sigmoid(1.702 g) * (u + 1), its dSwiGLU
    "swiglu-gpt-oss": lambda: compile_grouped_gemm("swiglu", clamp=True, gated=GPT_OSS, inspect=True),
    "swiglu-gpt-oss-helpers": lambda: compile_grouped_gemm("swiglu", clamp=True, helpers=True, gated=GPT_OSS,
                                                           inspect=True),
    "dswiglu-gpt-oss": lambda: compile_grouped_gemm("dswiglu", clamp=True, b_major=MN_MAJOR, gated=GPT_OSS,
                                                    inspect=True),
}
MX_VARIANTS = {  # GEMM1 + SwiGLU writing h's MXFP8 copy (quantized where it is produced)
    "swiglu-mx": lambda: compile_grouped_gemm("swiglu", mx_h=True, inspect=True),
    "swiglu-clamp-mx": lambda: compile_grouped_gemm("swiglu", clamp=True, mx_h=True, inspect=True),
}
VARIANTS.update(MX_VARIANTS)
MASKED = ("dswiglu", "dswiglu-clamp", "dswiglu-gpt-oss")  # the epilogue without a TMA-store form
_TMA_STORE = "cp.async.bulk.tensor"  # + ".<n>d.global.shared::cta" (the store direction)


@functools.cache
def _compiled(name):
    return VARIANTS[name]()[1]


@pytest.fixture(scope="module", params=list(VARIANTS))
def report(request):
    return _compiled(request.param)


def _tma_stores(rep):
    return [ln for ln in rep.ptx.splitlines() if _TMA_STORE in ln and ".global.shared::cta" in ln]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tma_store_epilogues(name):
    """plain, swiglu and wgrad store through TMA (async bulk groups, fenced, waited before the staging
    buffer is reused); dswiglu keeps the row-masked 16-byte stores (no TMA store in its PTX)."""
    rep = _compiled(name)
    stores = _tma_stores(rep)
    if name not in MASKED:
        assert stores and all(".bulk_group" in ln for ln in stores), stores
        assert rep.has("cp.async.bulk.commit_group")
        assert rep.has("cp.async.bulk.wait_group.read")
        assert rep.has("fence.proxy.async.shared::cta")
    else:
        assert not stores, stores


_ALPHA = re.compile(r"0f[3B]FD9DB23\b")  # +-1.702 as an fp32 PTX immediate


@pytest.mark.parametrize("epilogue", ["swiglu", "dswiglu"])
def test_gated_swiglu_compiles_its_constants_in(epilogue):
    """gpt-oss's SwiGLU (``gated``): alpha 1.702 is an fp32 immediate of the gated kernel (not of the plain one)
    and its epilogue has more multiplies (alpha * g; forward also g * s) and adds (u + 1); ``Gated(1.0, 0.0)``,
    the plain constants through the gated arm, compiles to the plain kernel's PTX byte for byte (the gated math
    keeps the plain formula's op order, as the reference does)."""
    major = MN_MAJOR if epilogue == "dswiglu" else "k"
    plain = _compiled(f"{epilogue}-clamp")
    gated = _compiled(f"{epilogue}-gpt-oss")
    assert _ALPHA.search(gated.ptx) and not _ALPHA.search(plain.ptx)
    for op in ("mul.f32", "add.f32"):
        assert len(re.findall(rf"\b{op}\b", gated.ptx)) > len(re.findall(rf"\b{op}\b", plain.ptx)), op
    same = compile_grouped_gemm(epilogue, clamp=True, b_major=major, gated=Gated(1.0, 0.0), inspect=True)[1]
    assert same.ptx == plain.ptx


def test_compile_key():
    assert MainloopConfig().key() == (128, 256, 64, 0, (1, 1), "BFloat16", "Float32")
    assert MainloopConfig(tile_n=128).key() != MainloopConfig().key()


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


def test_majorness_validated():
    with pytest.raises(ValueError, match="a_major"):
        Sm90Mainloop(MainloopConfig(), 0, a_major="m")


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
    (dict(w_gate=torch.zeros(3, 160, 64, dtype=torch.bfloat16),
          w_up=torch.zeros(3, 160, 64, dtype=torch.bfloat16)), ValueError, "w_gate: I=160 must be a multiple of 64"),
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


def _bwd_inputs(m=300, e=3, hid=64, inter=256):
    bf = torch.bfloat16
    return dict(dy=torch.zeros(m, hid, dtype=bf), offsets=torch.tensor([0, 100, 100, m], dtype=torch.int32)[: e + 1],
                w_down=torch.zeros(e, hid, inter, dtype=bf), gu=torch.zeros(m, 2 * inter, dtype=bf))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(dy="x"), TypeError, "dy"),
    (dict(dy=torch.zeros(300, 64)), TypeError, "dy"),
    (dict(dy=torch.zeros(300, 60, dtype=torch.bfloat16)), ValueError, "dy"),
    (dict(offsets=torch.zeros(4)), TypeError, "offsets"),
    (dict(w_down=torch.zeros(3, 64, 200, dtype=torch.bfloat16)), ValueError, "w_down"),
    (dict(w_down=torch.zeros(2, 64, 256, dtype=torch.bfloat16)), ValueError, "w_down"),
    (dict(w_down=torch.zeros(3, 256, 64, dtype=torch.bfloat16).transpose(1, 2)), ValueError, "w_down"),
    (dict(gu=torch.zeros(300, 256, dtype=torch.bfloat16)), ValueError, "gu"),
    (dict(limit=0.0), ValueError, "limit"),
    (dict(limit="4"), TypeError, "limit"),
    (dict(limit=4.0), ValueError, "CUDA"),  # valid but on the CPU
])
def test_dswiglu_dgrad_validation(kwargs, exc, name):
    args = _bwd_inputs()
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        grouped_dswiglu_dgrad(**args)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(dgu=torch.zeros(300, 512)), TypeError, "dgu"),
    (dict(dgu=torch.zeros(300, 192, dtype=torch.bfloat16)), ValueError, "w_gate"),  # I mismatch
    (dict(dgu=torch.zeros(300, 64, dtype=torch.bfloat16), w_gate=torch.zeros(3, 32, 256, dtype=torch.bfloat16),
          w_up=torch.zeros(3, 32, 256, dtype=torch.bfloat16)), ValueError, "tile_k"),
    (dict(w_up=torch.zeros(3, 256, 128, dtype=torch.bfloat16)), ValueError, "w_up"),
    (dict(w_gate=torch.zeros(3, 256, 96, dtype=torch.bfloat16),
          w_up=torch.zeros(3, 256, 96, dtype=torch.bfloat16)), ValueError, "H=96 must be a positive multiple of 64"),
    (dict(out=torch.zeros(300, 256)), TypeError, "out"),
    (dict(), ValueError, "CUDA"),
])
def test_dgrad1_validation(kwargs, exc, name):
    bf = torch.bfloat16
    args = dict(dgu=torch.zeros(300, 512, dtype=bf), offsets=torch.tensor([0, 100, 100, 300], dtype=torch.int32),
                w_gate=torch.zeros(3, 256, 256, dtype=bf), w_up=torch.zeros(3, 256, 256, dtype=bf))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        grouped_dgrad1(**args)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(a=torch.zeros(300, 64)), TypeError, "a"),
    (dict(b=torch.zeros(299, 256, dtype=torch.bfloat16)), ValueError, "b"),
    (dict(b=torch.zeros(300, 200, dtype=torch.bfloat16)), ValueError, "Nb=200 must be a multiple of 64"),
    (dict(a=torch.zeros(64, 300, dtype=torch.bfloat16).t()), ValueError, "a"),  # column-major
    (dict(a=torch.zeros(300, 70, dtype=torch.bfloat16)[:, 1:65]), ValueError, "a"),  # misaligned slice
    (dict(offsets=torch.tensor([0], dtype=torch.int32)), ValueError, "offsets"),
    (dict(out=torch.zeros(3, 64, 128, dtype=torch.bfloat16)), ValueError, "out"),
    (dict(), ValueError, "CUDA"),
    (dict(a=torch.zeros(300, 512, dtype=torch.bfloat16)[:, 256:]), ValueError, "CUDA"),  # column slice is fine
])
def test_wgrad_validation(kwargs, exc, name):
    bf = torch.bfloat16
    args = dict(a=torch.zeros(300, 64, dtype=bf), b=torch.zeros(300, 256, dtype=bf),
                offsets=torch.tensor([0, 100, 100, 300], dtype=torch.int32))
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        grouped_wgrad(**args)


def test_runtime_tensors_match_fake_signature():
    """The argument descriptor holds only dynamic modes: runtime tensors mark every shape mode
    dynamic, so the compile-time fakes must not hold a static mode (a static 2 in gu's
    [M, 2, I] fake made the kernel read gu's strides from the wrong fields)."""
    from mok_cute.dsl.tensors import _cute_tensor, _fake_3d

    t = _cute_tensor(torch.zeros(5, 2, 16, dtype=torch.bfloat16))
    assert t.dynamic_shapes_mask == (1, 1, 1)
    with pytest.raises(TypeError, match="symbolic"):
        _fake_3d(None, 1, 2, 3)


@pytest.mark.parametrize("t", [
    torch.zeros(300, 512, dtype=torch.bfloat16),
    torch.zeros(300, 1024, dtype=torch.bfloat16).view(300, 2, 512),
    torch.zeros(300, 1024, dtype=torch.bfloat16)[:, 512:],
    torch.zeros(8, 256, 64, dtype=torch.bfloat16)[:, 128:],
    torch.zeros(1, 256, 64, dtype=torch.bfloat16),
    torch.zeros(9, dtype=torch.int32),
])
def test_fast_descriptor_matches_dsl(t):
    """_Desc packs the same argument descriptor bytes as the DSL's from_dlpack path."""
    import ctypes

    from mok_cute.dsl.launch import _Desc
    from mok_cute.dsl.tensors import _cute_tensor

    d = _Desc(t)
    n = t.dim()
    size = 8 + 4 * (n + n % 2) + 8 * (n - 1)
    ct = _cute_tensor(t, 4 if t.dtype == torch.int32 else 16)  # keep alive: it owns the buffer
    official = ctypes.string_at(ct.__c_pointers__()[0], size)
    mine = d.raw()
    if n % 2:  # the padding word is unspecified
        pad_at = 8 + 4 * n
        official, mine = official[:pad_at] + official[pad_at + 4:], mine[:pad_at] + mine[pad_at + 4:]
    assert mine == official


def test_graph_launcher_paths(monkeypatch):
    """GraphLauncher: first launch through the DSL (module load), then one capture per
    argument key and replays; capturing callers and failed captures use the DSL path."""
    from mok_cute.dsl import launch as L

    calls = []
    ok = (L.cuda.CUresult.CUDA_SUCCESS,)

    class FakeCuda:
        CUresult = L.cuda.CUresult
        CUstream = staticmethod(lambda s: ("stream", int(s)))

        @staticmethod
        def cuGraphLaunch(g, s):
            calls.append(("replay", g, s))
            return ok

        @staticmethod
        def cuGraphExecDestroy(g):
            return ok

    captures = []

    def capture(self, dev, make_args):
        captures.append(make_args("side"))
        return f"exec{len(captures)}"

    monkeypatch.setattr(L, "cuda", FakeCuda)
    monkeypatch.setattr(L, "_enabled", True)
    monkeypatch.setattr(L.GraphLauncher, "_capture", capture)
    monkeypatch.setattr(L.torch.cuda, "is_current_stream_capturing", lambda: False)
    launcher = L.GraphLauncher(lambda *args: calls.append(("dsl", args)))
    make = lambda s: (1, 2, s)  # noqa: E731
    launcher.launch(0, 7, "k1", make)  # first: DSL (loads the module)
    launcher.launch(0, 7, "k1", make)  # capture + replay
    launcher.launch(0, 8, "k1", make)  # replay on another stream
    launcher.launch(0, 7, "k2", make)  # new key: capture + replay
    assert calls[0] == ("dsl", (1, 2, ("stream", 7)))
    assert calls[1:] == [("replay", "exec1", ("stream", 7)), ("replay", "exec1", ("stream", 8)),
                         ("replay", "exec2", ("stream", 7))]
    assert captures == [(1, 2, "side"), (1, 2, "side")]
    monkeypatch.setattr(L.torch.cuda, "is_current_stream_capturing", lambda: True)
    launcher.launch(0, 7, "k1", make)  # the caller is capturing: plain DSL launch
    assert calls[-1] == ("dsl", (1, 2, ("stream", 7)))
    monkeypatch.setattr(L.torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken(self, dev, make_args):
        raise RuntimeError("capture unsupported")

    monkeypatch.setattr(L.GraphLauncher, "_capture", broken)
    with pytest.warns(UserWarning, match="graph launch path disabled"):
        launcher.launch(0, 7, "k3", make)
    assert calls[-1] == ("dsl", (1, 2, ("stream", 7))) and L._enabled is False


@pytest.mark.parametrize("name", list(MX_VARIANTS))
def test_swiglu_mx_h_quantizes_in_the_epilogue(name):
    """The MXFP8 h copy uses the quantize kernels' ops: u16x2 amax, butterfly shuffles over the
    4 lanes of a block, IEEE multiply by 2^-e and the saturating e4m3 conversion."""
    rep = _compiled(name)
    for inst in ("max.u16x2", "shfl.sync.bfly", "mul.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "st.global.b8"):
        assert rep.has(inst), inst
    assert rep.total_spill_bytes == 0
    base = _compiled(name.replace("-mx", ""))
    assert not base.has("cvt.rn.satfinite.e4m3x2.f32")


def test_swiglu_mx_h_needs_swiglu():
    from mok_cute.kernels.sm90.grouped_gemm import GroupedGemmSm90
    with pytest.raises(ValueError, match="mx_h"):
        GroupedGemmSm90(MainloopConfig(), "plain", mx_h=True)


@pytest.mark.parametrize("name", [n for n in VARIANTS if "helpers" in n])
def test_swiglu_helpers_hand_off(name):
    """The helper variants: the MMA warps wait on FREE (bar.sync) and meet the helpers at STAGED, the
    helpers arrive on FREE (bar.arrive) and store h from registers (64-bit vectors); the MMA warps no
    longer compute h (fewer IEEE divisions in the PTX than the variant without helpers)."""
    from mok_cute.kernels.sm90 import grouped_gemm as gg
    rep = _compiled(name)
    n = gg.helper_threads(gg.HELPER_WARPS)
    assert rep.has(f"bar.sync \t{gg.FREE_BARRIER}, {n}") and rep.has(f"bar.sync \t{gg.STAGED_BARRIER}, {n}")
    assert rep.has(f"bar.arrive {gg.FREE_BARRIER}, {n}")
    assert rep.has("st.global.v2.b32")
    assert rep.total_spill_bytes == 0
    if name in ("swiglu-helpers", "swiglu-clamp-helpers"):
        without = _compiled(name.replace("-helpers", ""))
        assert rep.ptx.count("div.rn.f32") < without.ptx.count("div.rn.f32")
        assert not without.has(f"bar.arrive {gg.FREE_BARRIER}, {n}")


@pytest.mark.parametrize("epilogue, mx_h, k, helpers", [
    ("swiglu", False, 2048, True),  # HELPERS_MIN_K: the helpers from here
    ("swiglu", False, 7168, True),
    ("swiglu", False, 2048 - 64, False),  # a tile's mainloop shorter than the helpers' h (measured slower)
    ("swiglu", False, 512, False),
    ("swiglu", True, 7168, False),  # the MXFP8 h copy: its stores are the MMA warps'
    ("plain", False, 7168, False),
    ("dswiglu", False, 7168, False),
])
def test_swiglu_helpers_rule(epilogue, mx_h, k, helpers):
    """The launches' choice of the helper-warp variant (no environment switch: a decided measurement)."""
    from mok_cute.kernels.sm90 import grouped_gemm as gg
    assert gg.HELPERS_MIN_K == 2048
    assert gg.swiglu_helpers(epilogue, mx_h, k) is helpers


def test_swiglu_helpers_needs_swiglu_without_mx_h():
    from mok_cute.kernels.sm90 import grouped_gemm as gg
    with pytest.raises(ValueError, match="helpers"):
        gg.GroupedGemmSm90(MainloopConfig(), "plain", helpers=True)
    with pytest.raises(ValueError, match="helpers"):
        gg.GroupedGemmSm90(MainloopConfig(), "swiglu", mx_h=True, helpers=True)


@pytest.mark.parametrize("var", ["MOK_CUTE_SM90_TMA_STORE", "MOK_CUTE_SWIGLU_HELPERS"])
def test_decided_switches_left_the_environment(var):
    """The TMA-store epilogue and SwiGLU's helper warps were measured and decided: neither the kernels' module
    nor anything else in the package reads their former environment variables."""
    from pathlib import Path

    import mok_cute
    root = Path(mok_cute.__file__).parent
    assert not [p for p in root.rglob("*.py") if var in p.read_text()]


class _Recorder:
    """Stands in for a compiled grouped GEMM's GraphLauncher: records each launch's graph key and the flat
    argument tuple it packs (the kernel's ``__call__`` order)."""

    def __init__(self):
        self.keys, self.args = [], []

    def launch(self, dev, stream, key, make_args):
        self.keys.append(key)
        self.args.append(make_args("stream"))


@pytest.fixture
def sm90_host(monkeypatch):
    """grouped_gemm's host path as on an sm_90a device with 132 SMs (CPU tensors), its compile cache returning a
    :class:`_Recorder`: ``(recorder, compile keys)``."""
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    rec, keys = _Recorder(), []
    monkeypatch.setattr(gg, "device_arch", lambda d: (0, "sm_90a"))
    monkeypatch.setattr(gg, "sm_count", lambda d: 132)
    monkeypatch.setattr(gg, "compile_cached", lambda key, build: keys.append(key) or rec)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    return rec, keys


def _arg(x):
    """A packed launch argument as (data pointer, shape) for a tensor descriptor, else the value itself."""
    from mok_cute.dsl.launch import _Desc
    return (x._keep.data_ptr(), tuple(x._keep.shape)) if isinstance(x, _Desc) else x


def _t(t):
    return t.data_ptr(), tuple(t.shape)


def _bf(*shape):
    return torch.randn(*shape).bfloat16()


@pytest.mark.parametrize("case", ["plain", "swiglu", "swiglu-mx", "dswiglu", "dgrad1"])
def test_launch_packs_the_kernel_order(sm90_host, case):
    """Each host wrapper's launch packs ``(A, B, B2, offsets, out0, out1, hq, hs, bias, limit, num_ctas, stream)``
    (:class:`GroupedGemmSm90`'s call order; the outputs from one :class:`GemmOutputs`, the biases one
    :class:`~mok_cute.kernels.sm90.bias.TileBias`), None where absent."""
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    rec, keys = sm90_host
    m, k, n, e = 300, 2048, 256, 3
    offs = torch.tensor([0, 100, 100, m], dtype=torch.int32)
    if case == "plain":
        a, w = _bf(m, k), _bf(e, n, k)
        out = gg._run_gemm(a, offs, w)
        want = [_t(a), _t(w), None, _t(offs), _t(out), _t(out), None, None]
    elif case.startswith("swiglu"):
        x, wg, wu = _bf(m, k), _bf(e, n, k), _bf(e, n, k)
        res = gg._run_gemm1_swiglu(x, offs, wg, wu, 4.0, mx_h=case == "swiglu-mx")
        gu, h = res[:2]
        hq = hs = None
        if case == "swiglu-mx":
            hq, hs = _t(res[2].view(torch.int32)), _t(res[3])
            assert res[2].dtype == torch.float8_e4m3fn and res[3].shape == (m, n // 32)
        want = [_t(x), _t(wg), _t(wu), _t(offs), _t(gu.view(m, 2, n)), _t(h), hq, hs]
    elif case == "dswiglu":
        dy, wd, gu = _bf(m, k), _bf(e, k, n), _bf(m, 2 * n)
        out = bwd._run_dswiglu_dgrad(dy, offs, wd, gu, 4.0)
        want = [_t(dy), _t(wd), None, _t(offs), _t(out.view(m, 2, n)), _t(gu.view(m, 2, n)), None, None]
    else:
        dgu, wg, wu = _bf(m, 2 * n), _bf(e, n, k), _bf(e, n, k)
        out = bwd._run_dgrad1(dgu, offs, wg, wu)
        want = [_t(dgu), _t(wg), _t(wu), _t(offs), _t(out), _t(out), None, None]
    (args,) = rec.args
    assert [_arg(x) for x in args[:8]] == want
    assert tuple(args[8]) == (None, None, None)  # no biases
    assert len(args) == 12 and args[-1] == "stream"
    assert args[9].value == (0.0 if case in ("plain", "dgrad1") else 4.0) and args[10].value >= 1
    (key,) = keys
    assert key[5:9] == (case == "dgrad1", case == "swiglu-mx", False, case == "swiglu")  # split_b, mx_h, tail, helpers


@pytest.mark.parametrize("act, clamp, gated, limit", [
    (None, False, None, 0.0), (4.0, True, None, 4.0), (SwiGLU(4.0), True, None, 4.0),
    (SwiGLU.gpt_oss(), True, GPT_OSS, 7.0), (SwiGLU(None, 1.702, 0.0), False, Gated(1.702, 0.0), 0.0)])
def test_launch_compiles_the_activation_in(sm90_host, act, clamp, gated, limit):
    """GEMM1 + SwiGLU and dgrad2 + dSwiGLU take the activation as their ``limit``: None, L, or a SwiGLU. Its clamp
    and (other than silu(g) * u) its alpha and up offset are in the compile key, a plain SwiGLU(L) is the float L's
    variant; the kernel's runtime limit is L (0 without a clamp)."""
    from mok_cute.kernels.sm90 import expert_bwd as bwd
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    rec, keys = sm90_host
    m, k, n, e = 300, 512, 256, 3
    offs = torch.tensor([0, 100, 100, m], dtype=torch.int32)
    gg._run_gemm1_swiglu(_bf(m, k), offs, _bf(e, n, k), _bf(e, n, k), act)
    bwd._run_dswiglu_dgrad(_bf(m, k), offs, _bf(e, k, n), _bf(m, 2 * n), act)
    assert [key[2:4] + key[9:10] for key in keys] == [("swiglu", clamp, gated), ("dswiglu", clamp, gated)]
    assert [args[9].value for args in rec.args] == [limit, limit]


@pytest.mark.parametrize("which", ["a", "w", "w2", "offsets", "out0", "out1", "hq", "hs"])
def test_graph_key_follows_every_tensor(sm90_host, which):
    """A launch replays a graph captured per argument set: swapping any one tensor of a launch (here GEMM1 +
    SwiGLU with the MXFP8 h copy) must give a new graph key (a stale key would replay old pointers)."""
    from mok_cute.kernels.sm90 import grouped_gemm as gg

    rec, _ = sm90_host
    m, k, n, e = 256, 512, 128, 2
    ops = dict(a=_bf(m, k), w=_bf(e, n, k), w2=_bf(e, n, k), offsets=torch.tensor([0, 100, m], dtype=torch.int32))
    outs = dict(out0=_bf(m, 2, n), out1=_bf(m, n), hq=torch.zeros(m, n // 4, dtype=torch.int32),
                hs=torch.zeros(m, n // 32, dtype=torch.uint8))

    def launch():
        gg._launch("swiglu", gg.DEFAULT_CONFIG, ops["a"], ops["w"], ops["offsets"], gg.GemmOutputs(**outs), 2 * n,
                   4.0, w2=ops["w2"])

    launch()
    launch()
    group = ops if which in ops else outs
    group[which] = group[which].clone()
    launch()
    assert rec.keys[0] == rec.keys[1] != rec.keys[2]


def _flat_params(fn) -> list[str]:
    """A kernel's parameters with each operand bundle (a NamedTuple annotation) replaced by its fields: the
    order of the kernel's flattened parameters, hence of its PTX entry's."""
    import inspect
    import typing

    fn = inspect.unwrap(fn)
    hints = typing.get_type_hints(fn)
    out = []
    for name in list(inspect.signature(fn).parameters)[1:]:  # self
        t = hints.get(name)
        out += list(t._fields) if isinstance(t, type) and issubclass(t, tuple) else [name]
    return out


def test_kernel_bundles_keep_the_flat_parameter_order():
    """GroupedGemmSm90's and Fp8BlockGroupedGemm's kernels take operand bundles whose fields, in order, are the
    flat parameters they replaced (the PTX stays byte-identical up to the entry symbol)."""
    from mok_cute.kernels.sm90.fp8_gemm import Fp8BlockGroupedGemm
    from mok_cute.kernels.sm90.grouped_gemm import GroupedGemmSm90

    loads = ["atom_a", "coord_a", "atom_b", "coord_b", "atom_b2", "coord_b2"]
    assert _flat_params(GroupedGemmSm90.kernel) == loads + [
        "mOffsets", "out0", "out1", "hq", "hs", "gate", "up", "down", "limit", "atom_c", "coord_c", "atom_h",
        "coord_h"]
    assert _flat_params(Fp8BlockGroupedGemm.kernel) == loads + [
        "sa", "sb", "sb2", "mOffsets", "mOut0", "mOut1", "limit"]


def test_mainloop_bundles():
    """The mainloop's device bundles: optional operands default to None (absent at compile time), the tile walk
    in :func:`~mok_cute.schedule.group_tiles.grouped_start`'s terms."""
    from mok_cute.kernels.sm90 import mainloop as ml

    assert ml.TmaLoads(1, 2, 3, 4) == (1, 2, 3, 4, None, None)
    assert ml.GroupWalk._fields == ("offsets", "num_experts", "n_tiles", "linear", "expert", "base", "grid")
    assert ml.SplitB._fields == ("atom", "g", "k_tiles") and ml.StackedB._fields == ("atom", "g")
    assert all(c.__doc__ for c in (ml.TmaLoads, ml.GroupWalk, ml.SplitB, ml.StackedB))

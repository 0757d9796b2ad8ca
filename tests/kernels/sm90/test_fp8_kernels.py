"""CPU tests of the FP8 kernels: quantizers (mok_cute.kernels.quant.quantize_fp8) and the SM90 FP8
blockwise grouped GEMM (mok_cute.kernels.sm90.fp8_gemm) compile, PTX/ptxas checks, argument
validation before any launch. Numerics run on the GPU (tools/checks/quantize.py)."""
import re

import pytest
import torch

from mok_cute.kernels.quant import quantize_fp8 as qf

# per thread: row kernel 4 chunks of C elements, tokens kernel 32 rows x C features
ELEMS = {torch.bfloat16: 8, torch.float32: 4}
CASES = ([("row", "fp8_block", a, dt) for a in ("sm_90a", "sm_100a") for dt in qf.DTYPES]
         + [("tokens", f, a, dt) for f in qf.FORMATS for a in ("sm_90a", "sm_100a") for dt in qf.DTYPES])


def _id(c):
    return f"{c[0]}-{c[1]}-{c[2]}-{str(c[3])[6:]}"


@pytest.fixture(scope="module")
def reports():
    return {c: qf.compiled_quantize_fp8(*c)[1] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_quantizer_compiles_without_spills(reports, case):
    rep = reports[case]
    assert len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values())
    assert rep.max_registers <= (40 if case[0] == "row" else 168), rep.registers


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_quantizer_ptx(reports, case):
    kind, fmt, _, dt = case
    ptx = reports[case].ptx
    c = ELEMS[dt]
    elems = 4 * c if kind == "row" else 32 * c
    scales = 4 if kind == "row" else c  # scale computations per thread
    assert len(re.findall(r"\bmul\.rn\.f32\b", ptx)) == elems
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == elems // 2
    assert ".ftz" not in ptx and "div.approx" not in ptx and "div.full" not in ptx
    # fp8_block: exactly two IEEE divisions per scale (448 / a and a / 448)
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == (2 * scales if fmt == "fp8_block" else 0)
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == (4 if kind == "row" else 32)
    if kind == "tokens":  # each feature's 32 tokens: two aligned 16-byte stores
        assert len(re.findall(r"st\.global\.v4\.b32", ptx)) >= 2 * c
        shuffles = 8 if fmt == "fp8_block" else 0
        assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == shuffles
        # per-column amax words: 31 row maxes per word, then one per shuffle, all per element
        # (bf16: max.u16x2 on the packed pairs; a max.u32 would mix the two halves)
        n_u16x2 = len(re.findall(r"\bmax\.u16x2\b", ptx))
        n_u32 = len(re.findall(r"\bmax\.u32\b", ptx))
        floors = c if fmt == "fp8_block" else 0  # max(amax, 2^-100) per scale
        if dt == torch.bfloat16:
            assert n_u16x2 == 4 * 31 + shuffles and n_u32 == floors
        else:
            assert n_u16x2 == 0 and n_u32 == 4 * 31 + shuffles + floors


def test_bad_keys():
    with pytest.raises(ValueError, match="fmt"):
        qf.compiled_quantize_fp8("row", "mxfp8", "sm_90a")
    with pytest.raises(ValueError, match="kind"):
        qf.compiled_quantize_fp8("col", "fp8_block", "sm_90a")
    with pytest.raises(TypeError, match="dtype"):
        qf.compiled_quantize_fp8("tokens", "mxfp8", "sm_90a", torch.float16)


@pytest.fixture
def no_launch(forbid):
    """Make any step past validation fail loudly (compile, device query)."""
    forbid(qf, "compiled_quantize_fp8", "arch_of_device")


@pytest.mark.parametrize("x, match", [
    (torch.zeros(4, 64, dtype=torch.bfloat16), "multiple of 128"),
    (torch.zeros(4, 128, dtype=torch.float16), "bfloat16 or torch.float32"),
    (torch.zeros(128, 4, dtype=torch.bfloat16).t(), "contiguous"),
    (torch.zeros(4, 128, dtype=torch.bfloat16), "CUDA"),
])
def test_act_validation(no_launch, x, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_fp8_block_act(x)


@pytest.mark.parametrize("x, offs, fmt, match", [
    (torch.zeros(4, 12, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "fp8_block", "multiple of 8"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4]), "fp8_block", "int32"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0], dtype=torch.int32), "mxfp8", "E\\+1"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "nvfp4", "fmt"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32), "mxfp8", "CUDA"),
])
def test_tokens_validation(no_launch, x, offs, fmt, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_tokens(x, offs, fmt)


# ---------------------------------------------------------------- FP8 GEMM
WGMMA_E4M3 = {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}


def _no_spills(rep):
    assert rep.arch == "sm_90a" and len(rep.registers) == 1, rep.log
    assert rep.total_spill_bytes == 0 and all(v == 0 for v in rep.stack_bytes.values()), rep.log
    assert "C7514" not in rep.log and "serialized" not in rep.log, rep.log  # wgmma serialization
    assert "C7517" not in rep.log, rep.log  # ptxas-injected wait_group (accumulator read too early)


@pytest.fixture(scope="module")
def serial_report():
    from mok_cute.kernels.sm90 import fp8_gemm as g
    return g.compile_fp8_block_gemm(g.Fp8MainloopConfig(overlap_promotion=False), inspect=True)[1]


@pytest.fixture(scope="module")
def gemm_report():
    from mok_cute.kernels.sm90 import fp8_gemm as g
    return g.compile_fp8_block_gemm(inspect=True)[1]


def test_fp8_gemm_serial_compiles_e4m3_wgmma(serial_report):
    """overlap_promotion=False: one wgmma batch per k-tile, wait, promote."""
    rep = serial_report
    _no_spills(rep)
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", rep.ptx)) == WGMMA_E4M3
    assert len(re.findall(r"wgmma\.mma_async", rep.ptx)) == 4  # 4 k-blocks of 32 per 128-K tile
    # promotion: one FMA per accumulator element (64 per thread at 128x128), one multiply per row
    assert len(re.findall(r"\bfma\.rn\.f32\b", rep.ptx)) == 64
    assert len(re.findall(r"\bmul\.(rn\.)?f32\b", rep.ptx)) == 2
    assert "cp.async.bulk.tensor" in rep.ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", rep.ptx)) == {"0"}
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", rep.ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", rep.ptx)


def test_fp8_gemm_default_overlap_compiles(gemm_report):
    """Default (overlapped promotion): the next k-tile's wgmma batch is issued into the second
    temporary before waiting on the previous one (wait_group 1), 3 FP32 fragments without
    spills (24 / 240 register split), no wgmma serialization by ptxas."""
    rep = gemm_report
    _no_spills(rep)
    ptx = rep.ptx
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx)) == WGMMA_E4M3
    # 4 k-blocks per batch: k-tile 0, the loop unrolled by two, the even-k_tiles tail
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 16
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 3 and waits.count("0") == 2, waits
    # promotions: 2 in the loop, 2 + 1 in the tails; 2 row-scale multiplies each
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == 5 * 64
    assert len(re.findall(r"\bmul\.(rn\.)?f32\b", ptx)) == 5 * 2
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert "cp.async.bulk.tensor" in ptx


def test_fp8_overlap_compile_key():
    from mok_cute.kernels.sm90.fp8_gemm import DEFAULT_FP8_CONFIG, Fp8MainloopConfig
    assert DEFAULT_FP8_CONFIG.overlap_promotion is True
    assert Fp8MainloopConfig().overlap_promotion is True
    assert Fp8MainloopConfig(overlap_promotion=False).key() != DEFAULT_FP8_CONFIG.key()
    assert Fp8MainloopConfig().key() == DEFAULT_FP8_CONFIG.key()


def test_fp8_config_validation():
    from mok_cute.kernels.sm90.fp8_gemm import Fp8MainloopConfig
    Fp8MainloopConfig().validate()
    for bad in (dict(tile_n=256), dict(tile_k=64), dict(tile_m=64)):
        with pytest.raises(ValueError):
            Fp8MainloopConfig(**bad).validate()


def _gemm_args(m=256, k=256, n=256, e=2):
    f8 = torch.float8_e4m3fn
    return dict(a=torch.zeros(m, k, dtype=f8), a_scales=torch.ones(m, k // 128),
                offsets=torch.tensor([0, m // 2, m], dtype=torch.int32), w=torch.zeros(e, n, k, dtype=f8),
                w_scales=torch.ones(e, n // 128, k // 128))


@pytest.mark.parametrize("change, match", [
    (dict(a=torch.zeros(256, 256, dtype=torch.bfloat16)), "a must have dtype"),
    (dict(a=torch.zeros(256, 192, dtype=torch.float8_e4m3fn)), "multiple of 128"),
    (dict(w=torch.zeros(2, 192, 256, dtype=torch.float8_e4m3fn)), "N=192"),
    (dict(a_scales=torch.ones(256, 3)), "a_scales must be"),
    (dict(w_scales=torch.ones(2, 2, 3)), "w_scales must be"),
    (dict(offsets=torch.tensor([0, 256], dtype=torch.int32)), "E\\+1"),
    ({}, "CUDA"),
])
def test_fp8_gemm_validation(change, match):
    from mok_cute.kernels.sm90 import fp8_gemm as g
    args = dict(_gemm_args(), **change)
    with pytest.raises((TypeError, ValueError), match=match):
        g.grouped_gemm_fp8_block(args["a"], args["a_scales"], args["offsets"], args["w"], args["w_scales"])


# ---------------------------------------------------------------- FP8 expert-MLP GEMMs
EXPERT_CASES = [("swiglu", False), ("swiglu", True), ("dswiglu", False), ("dswiglu", True)]


@pytest.fixture(scope="module")
def expert_reports():
    from mok_cute.kernels.sm90 import fp8_gemm as g
    return {c: g.compile_fp8_block_gemm(inspect=True, epilogue=c[0], clamp=c[1])[1] for c in EXPERT_CASES}


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"{c[0]}-clamp{int(c[1])}")
def test_fp8_expert_kernels_compile(expert_reports, case):
    """GEMM1+SwiGLU and dSwiGLU-dgrad variants (the default, overlapped consumer; dgrad1 is the
    plain kernel above): e4m3 wgmma, the 24 / 240 register split, no spills. swiglu promotes
    the gate and up halves with their own block scales: 2 rows x 2 halves = 4 scale products
    per promotion (5 promotions), dswiglu 2."""
    rep = expert_reports[case]
    _no_spills(rep)
    ptx = rep.ptx
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx)) == WGMMA_E4M3
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 16
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("1") == 3 and waits.count("0") == 2, waits
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) >= 5 * 64
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    # TMA loads per k-tile: A (2-D) and B (3-D [N, K, E]): swiglu two B halves (gate, up)
    b_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", ptx))
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)) == 1
    assert b_loads == (2 if case[0] == "swiglu" else 1)
    if case[0] == "dswiglu":  # dSwiGLU epilogue: g, u fetched with cp.async
        assert "cp.async.ca.shared.global" in ptx


@pytest.mark.parametrize("epilogue", ["swiglu", "dswiglu"])
def test_fp8_expert_kernels_compile_gated(expert_reports, epilogue):
    """gpt-oss's SwiGLU (``gated``: alpha 1.702, up offset 1) in the FP8 expert kernels: no spills, the same
    wgmma count as the plain clamped variant, alpha as an fp32 immediate (the plain one has none)."""
    from mok_cute.kernels.sm90 import fp8_gemm as g
    from mok_cute.kernels.swiglu_math import Gated

    rep = g.compile_fp8_block_gemm(inspect=True, epilogue=epilogue, clamp=True, gated=Gated(1.702, 1.0))[1]
    plain = expert_reports[(epilogue, True)]
    _no_spills(rep)
    assert rep.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    alpha = re.compile(r"0f[3B]FD9DB23\b")
    assert alpha.search(rep.ptx) and not alpha.search(plain.ptx)


def _expert_args(m=256, hid=256, inter=256, e=2):
    f8 = torch.float8_e4m3fn
    offs = torch.tensor([0, m // 2, m], dtype=torch.int32)
    return dict(
        gemm1=dict(xq=torch.zeros(m, hid, dtype=f8), x_scales=torch.ones(m, hid // 128), offsets=offs,
                   wg_q=torch.zeros(e, inter, hid, dtype=f8), wg_s=torch.ones(e, inter // 128, hid // 128),
                   wu_q=torch.zeros(e, inter, hid, dtype=f8), wu_s=torch.ones(e, inter // 128, hid // 128)),
        dswiglu=dict(dyq=torch.zeros(m, hid, dtype=f8), dy_scales=torch.ones(m, hid // 128), offsets=offs,
                     wdt_q=torch.zeros(e, inter, hid, dtype=f8), wdt_s=torch.ones(e, inter // 128, hid // 128),
                     gu=torch.zeros(m, 2 * inter, dtype=torch.bfloat16)),
        dgrad1=dict(dguq=torch.zeros(m, 2 * inter, dtype=f8), dgu_scales=torch.ones(m, 2 * inter // 128),
                    offsets=offs, w1t_q=torch.zeros(e, hid, 2 * inter, dtype=f8),
                    w1t_s=torch.ones(e, hid // 128, 2 * inter // 128)),
    )


F8 = torch.float8_e4m3fn
EXPERT_BAD = [
    ("gemm1", dict(xq=torch.zeros(256, 256, dtype=torch.bfloat16)), "xq must have dtype"),
    ("gemm1", dict(xq=torch.zeros(256, 192, dtype=F8)), "xq: K=192"),
    ("gemm1", dict(x_scales=torch.ones(256, 3)), "x_scales must be"),
    ("gemm1", dict(wg_q=torch.zeros(2, 192, 256, dtype=F8)), "wg_q: dim 1 = 192"),
    ("gemm1", dict(wu_q=torch.zeros(2, 128, 256, dtype=F8)), "wu_q must have shape"),
    ("gemm1", dict(wg_s=torch.ones(2, 2, 3)), "wg_s must be"),
    ("gemm1", dict(wu_s=torch.ones(2, 2, 2, dtype=torch.float64)), "wu_s must have dtype"),
    ("gemm1", dict(offsets=torch.tensor([0, 256], dtype=torch.int32)), "wg_q must have shape"),
    ("gemm1", dict(limit=-1.0), "limit"),
    ("gemm1", dict(gu=torch.zeros(256, 256, dtype=torch.bfloat16)), "gu must be"),
    ("gemm1", dict(h=torch.zeros(256, 256, dtype=torch.float32)), "h must have dtype"),
    ("gemm1", {}, "CUDA"),
    ("dswiglu", dict(dyq=torch.zeros(256, 256, dtype=torch.bfloat16)), "dyq must have dtype"),
    ("dswiglu", dict(dy_scales=torch.ones(2, 256)), "dy_scales must be"),
    ("dswiglu", dict(wdt_q=torch.zeros(2, 256, 128, dtype=F8)), "wdt_q must have shape"),
    ("dswiglu", dict(wdt_s=torch.ones(2, 2, 1)), "wdt_s must be"),
    ("dswiglu", dict(gu=torch.zeros(256, 256, dtype=torch.bfloat16)), "gu must be contiguous"),
    ("dswiglu", dict(gu=torch.zeros(256, 512, dtype=F8)), "gu must have dtype"),
    ("dswiglu", dict(out=torch.zeros(256, 256, dtype=torch.bfloat16)), "out must be"),
    ("dswiglu", dict(limit="4"), "limit"),
    ("dswiglu", {}, "CUDA"),
    ("dgrad1", dict(dguq=torch.zeros(256, 512, dtype=torch.float16)), "dguq must have dtype"),
    ("dgrad1", dict(dguq=torch.zeros(512, 256, dtype=F8).t()), "dguq must be contiguous"),
    ("dgrad1", dict(w1t_q=torch.zeros(2, 256, 256, dtype=F8)), "w1t_q must have shape"),
    ("dgrad1", dict(w1t_s=torch.ones(2, 2, 2)), "w1t_s must be"),
    ("dgrad1", dict(offsets=torch.tensor([[0, 1, 2]], dtype=torch.int32)), "offsets must be 1-D"),
    ("dgrad1", dict(out=torch.zeros(256, 128, dtype=torch.bfloat16)), "out must be"),
    ("dgrad1", {}, "CUDA"),
]


@pytest.mark.parametrize("which, change, match", EXPERT_BAD, ids=lambda v: v if isinstance(v, str) else None)
def test_fp8_expert_validation(forbid, which, change, match):
    from mok_cute.kernels.sm90 import fp8_expert as fx
    from mok_cute.kernels.sm90 import fp8_gemm as g
    forbid(fx, "launch_fp8_block")
    forbid(g, "compile_fp8_block_gemm", "device_arch")
    args = dict(_expert_args()[which], **change)
    fn = {"gemm1": fx.grouped_gemm1_swiglu_fp8_block, "dswiglu": fx.grouped_dswiglu_dgrad_fp8_block,
          "dgrad1": fx.grouped_dgrad1_fp8_block}[which]
    with pytest.raises((TypeError, ValueError), match=match):
        fn(**args)


def test_transpose_weight_blocks_matches_reference():
    """wdt / w1t from the per-expert quantizations equal the transposed dequantized weights
    (values), i.e. exactly what reference.grouped_dswiglu_dgrad / grouped_dgrad1 read."""
    from mok_cute import reference as ref
    from mok_cute.kernels.sm90.fp8_expert import transpose_weight_blocks
    gen = torch.Generator().manual_seed(7)
    e, hid, inter = 2, 256, 384
    blk = torch.exp2(torch.randint(-4, 5, (e, 2 * inter // 128, hid // 128), generator=gen).float())
    blk = blk.repeat_interleave(128, 1).repeat_interleave(128, 2)
    wgu = (torch.randn(e, 2 * inter, hid, generator=gen) * blk).bfloat16()
    wg, wu = wgu[:, :inter], wgu[:, inter:]
    wd = (torch.randn(e, hid, inter, generator=gen) * 0.1).bfloat16()

    def quant(w):
        parts = [ref.fp8_block_quantize_weight(w[i]) for i in range(w.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

    def deq(q, s):
        return torch.stack([ref.fp8_block_dequantize_weight(q[i], s[i], torch.float64) for i in range(q.shape[0])])

    wdt_q, wdt_s = transpose_weight_blocks(quant(wd))
    assert wdt_q.dtype == torch.float8_e4m3fn and wdt_q.is_contiguous() and wdt_s.is_contiguous()
    assert tuple(wdt_q.shape) == (e, inter, hid) and tuple(wdt_s.shape) == (e, inter // 128, hid // 128)
    assert torch.equal(deq(wdt_q, wdt_s), deq(*quant(wd)).transpose(1, 2))
    w1t_q, w1t_s = transpose_weight_blocks(quant(wg), quant(wu))
    assert tuple(w1t_q.shape) == (e, hid, 2 * inter) and tuple(w1t_s.shape) == (e, hid // 128, 2 * inter // 128)
    # the reference's dgrad1 operand: q_weight of cat([Wg, Wu]) per expert, transposed
    want = torch.stack([ref.fp8_round_trip_weight(torch.cat([wg[i], wu[i]])).t() for i in range(e)])
    assert torch.equal(deq(w1t_q, w1t_s), want)
    with pytest.raises(ValueError, match="pairs\\[1\\] data"):
        transpose_weight_blocks(quant(wg), quant(wd))


def test_fp8_ring_stages():
    """Shared memory: 32 KB per 128x128x128 e4m3 stage beside the epilogue buffer (plain,
    swiglu: the 32 KB bf16 tile; dswiglu: g, u of both column halves, 73.7 KB)."""
    from mok_cute.kernels.sm90 import fp8_gemm as g
    stages = {ep: g.Fp8BlockGroupedGemm(g.Fp8MainloopConfig(), ep).mainloop.stages
              for ep in ("plain", "swiglu", "dswiglu")}
    assert stages == {"plain": 6, "swiglu": 6, "dswiglu": 4}
    with pytest.raises(ValueError, match="epilogue"):
        g.Fp8BlockGroupedGemm(g.Fp8MainloopConfig(), "gelu")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dt", qf.DTYPES)
def test_weight_quantizer_compiles_with_its_ops(arch, dt):
    """128x128 blocks, one CTA each: every chunk loaded before any math, one amax over the
    block (per-thread maxima, 5 shuffles, 8 warp maxima through shared memory), two IEEE
    divisions, one multiply and one e4m3 conversion per element."""
    rep = qf.compiled_quantize_fp8("weight", "fp8_block", arch, dt)[1]
    ptx = rep.ptx
    c = ELEMS[dt]
    passes = 128 // (256 // (128 // c))  # block rows per thread
    assert rep.total_spill_bytes == 0 and len(rep.registers) == 1
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == passes
    assert len(re.findall(r"\bmul\.rn\.f32\b", ptx)) == passes * c
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == passes * c // 2
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == 2
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 5
    assert "bar.sync" in ptx and ".ftz" not in ptx and "div.approx" not in ptx


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dt", qf.DTYPES)
def test_weight_t_quantizer_compiles_with_its_ops(arch, dt):
    """The weight kernel's ops plus the transposed copy: every quantized byte stored once into
    the block's shared tile (st.shared.b8), read back as 16 words per thread, and written as
    4-byte global stores (16 words + the data words + two scales), no spills."""
    rep = qf.compiled_quantize_fp8("weight_t", "fp8_block", arch, dt)[1]
    base = qf.compiled_quantize_fp8("weight", "fp8_block", arch, dt)[1].ptx
    ptx = rep.ptx
    c = ELEMS[dt]
    passes = 128 // (256 // (128 // c))
    assert rep.total_spill_bytes == 0 and len(rep.registers) == 1
    for op in (r"ld\.global\.v4\.b32", r"\bmul\.rn\.f32\b", r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"\bdiv\.rn\.f32\b"):
        assert len(re.findall(op, ptx)) == len(re.findall(op, base)), op
    assert len(re.findall(r"st\.shared\.b8", ptx)) == passes * c  # this thread's 128 x 128 / 256 bytes
    stores = len(re.findall(r"st\.global\.b32", base))
    assert len(re.findall(r"st\.global\.b32", ptx)) == stores + 128 * 32 // 256 + 1
    assert ".ftz" not in ptx


@pytest.mark.parametrize("ws, match", [
    ((), "at least one"),
    ((torch.zeros(2, 128, 128, dtype=torch.bfloat16), torch.zeros(3, 128, 128, dtype=torch.bfloat16)), "E and K"),
    ((torch.zeros(2, 128, 256, dtype=torch.bfloat16)[:, :, :128],), "contiguous"),
    ((torch.zeros(2, 64, 128, dtype=torch.bfloat16),), "multiples of 128"),
    ((torch.zeros(256, 128, dtype=torch.bfloat16),), "\\[E, R, K\\]"),
    (("w",), "torch.Tensor"),
    ((torch.zeros(2, 128, 128, dtype=torch.bfloat16),), "CUDA"),
])
def test_weights_t_validation(no_launch, ws, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_fp8_block_weights_t(*ws)


@pytest.mark.parametrize("w, match", [
    (torch.zeros(128, 64, dtype=torch.bfloat16), "multiples of 128"),
    (torch.zeros(64, 128, dtype=torch.bfloat16), "multiples of 128"),
    (torch.zeros(128, 128, dtype=torch.float16), "bfloat16 or torch.float32"),
    (torch.zeros(128, 128, dtype=torch.bfloat16), "CUDA"),
])
def test_weight_quantizer_validation(no_launch, w, match):
    with pytest.raises((TypeError, ValueError), match=match):
        qf.quantize_fp8_block_weight(w)


@pytest.fixture
def fp8_host(monkeypatch):
    """fp8_gemm's launch path as on an sm_90a device with 132 SMs (CPU tensors, the device checks of the
    wrappers off), its compile cache returning a recorder of each launch's flat argument tuple."""
    from mok_cute.kernels.sm90 import fp8_expert as fx
    from mok_cute.kernels.sm90 import fp8_gemm as g

    calls, keys = [], []
    monkeypatch.setattr(g, "device_arch", lambda d: (0, "sm_90a"))
    monkeypatch.setattr(g, "sm_count", lambda d: 132)
    monkeypatch.setattr(g, "current_stream", lambda d: "stream")
    monkeypatch.setattr(g, "compile_cached", lambda key, build: keys.append(key) or (lambda *a: calls.append(a)))
    for mod in (g, fx):
        monkeypatch.setattr(mod, "_check_devices", lambda **kw: None)
    return calls, keys


def _packed(x):
    from mok_cute.dsl.launch import _Desc
    return (x._keep.data_ptr(), tuple(x._keep.shape)) if isinstance(x, _Desc) else x


@pytest.mark.parametrize("which", ["plain", "gemm1", "dswiglu", "dgrad1"])
def test_fp8_launch_packs_the_kernel_order(fp8_host, which):
    """launch_fp8_block unpacks its Fp8Operand bundles into Fp8BlockGroupedGemm's call order ``(A, SA^T, B, SB,
    B2, SB2, offsets, out0, out1, limit, num_ctas, stream)``; B2 / SB2 (w_up and its scales) only for GEMM1."""
    from mok_cute.kernels.sm90 import fp8_expert as fx
    from mok_cute.kernels.sm90 import fp8_gemm as g

    calls, keys = fp8_host
    if which == "plain":
        a = _expert_args()["dgrad1"]
        args = dict(a=a["dguq"], a_scales=a["dgu_scales"], offsets=a["offsets"], w=a["w1t_q"], w_scales=a["w1t_s"])
        out = g.grouped_gemm_fp8_block(**args)
        ops = [args["a"], None, args["w"], args["w_scales"], None, None, args["offsets"], out, out]
    else:
        args = _expert_args()[which]
        fn = {"gemm1": fx.grouped_gemm1_swiglu_fp8_block, "dswiglu": fx.grouped_dswiglu_dgrad_fp8_block,
              "dgrad1": fx.grouped_dgrad1_fp8_block}[which]
        res = fn(**args) if which == "dgrad1" else fn(**args, limit=4.0)
        m = res[0].shape[0] if which == "gemm1" else res.shape[0]
        if which == "gemm1":
            gu, h = res
            ops = [args["xq"], None, args["wg_q"], args["wg_s"], args["wu_q"], args["wu_s"], args["offsets"],
                   gu.view(m, 2, -1), h]
        elif which == "dswiglu":
            ops = [args["dyq"], None, args["wdt_q"], args["wdt_s"], None, None, args["offsets"], res.view(m, 2, -1),
                   args["gu"].view(m, 2, -1)]
        else:
            ops = [args["dguq"], None, args["w1t_q"], args["w1t_s"], None, None, args["offsets"], res, res]
    (packed,) = calls
    want = [None if t is None else (t.data_ptr(), tuple(t.shape)) for t in ops]
    got = [_packed(x) for x in packed[:9]]
    got[1] = None  # A's scales: checked in test_fp8_launch_reads_a_scales_transposed
    assert got == want
    assert packed[9].value == (0.0 if which in ("plain", "dgrad1") else 4.0) and packed[10].value >= 1
    assert packed[11] == "stream" and len(packed) == 12
    assert keys[0][2] == {"plain": "plain", "gemm1": "swiglu", "dswiglu": "dswiglu", "dgrad1": "plain"}[which]


@pytest.mark.parametrize("which", ["gemm1", "dswiglu"])
def test_fp8_launch_compiles_the_activation_in(fp8_host, which):
    """The FP8 expert wrappers take the activation as ``limit``: SwiGLU.gpt_oss()'s alpha and up offset go in the
    compile key (``Gated``), its limit 7 is the kernel's runtime clamp; a plain SwiGLU(L) is the float L's variant."""
    from mok_cute.kernels.sm90 import fp8_expert as fx
    from mok_cute.kernels.swiglu_math import Gated
    from mok_cute.reference import SwiGLU

    calls, keys = fp8_host
    fn = fx.grouped_gemm1_swiglu_fp8_block if which == "gemm1" else fx.grouped_dswiglu_dgrad_fp8_block
    for act in (SwiGLU.gpt_oss(), SwiGLU(4.0), 4.0):
        fn(**_expert_args()[which], limit=act)
    assert [k[3:5] for k in keys] == [(True, Gated(1.702, 1.0)), (True, None), (True, None)]
    assert [c[9].value for c in calls] == [7.0, 4.0, 4.0]


@pytest.mark.parametrize("layout", ["transposed-view", "row-major"])
def test_fp8_launch_reads_a_scales_transposed(fp8_host, layout):
    """A's scales [M, K/128] are read as their [K/128, M] transpose: a transposed view of contiguous [K/128, M]
    storage (quantize_fp8_block_act's output) goes in place, a row-major [M, K/128] tensor is copied once."""
    from mok_cute.kernels.sm90 import fp8_gemm as g

    calls, _ = fp8_host
    a = _expert_args()["dgrad1"]
    m, kb = a["dgu_scales"].shape
    sa = torch.rand(kb, m).t() if layout == "transposed-view" else torch.rand(m, kb)
    out = torch.empty(m, 256, dtype=torch.bfloat16)
    g.launch_fp8_block("plain", g.DEFAULT_FP8_CONFIG, g.Fp8Operand(a["dguq"], sa),
                       g.Fp8Operand(a["w1t_q"], a["w1t_s"]), None, a["offsets"], out, out, 256)
    desc = calls[0][1]._keep
    assert desc.shape == (kb, m) and desc.is_contiguous() and torch.equal(desc, sa.t())
    assert (desc.data_ptr() == sa.data_ptr()) is (layout == "transposed-view")

"""The kernel policy on the CPU (mok_cute.policy, mok_cute.layers.tiles): validation of every field
(types, values, error messages naming the field), the MoKConfig knobs folded in (one source per
choice), the serialized config's round trip (the custom ops' ``config_key``), the per-arch check
(the allowed values per arch and precision in the message) and what reaches the SM90 launches."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mok_cute import GemmTiles, KernelPolicy, MoKConfig
from mok_cute.layers import tiles
from mok_cute.policy import GEMMS, BackwardPath, ForwardPath

F, U = ForwardPath.FUSED, ForwardPath.UNFUSED
BF, BW, BU = BackwardPath.FUSED, BackwardPath.FUSED_WHOLE, BackwardPath.UNFUSED
FULL = KernelPolicy(forward_path="fused", backward_path="fused_whole", minibatch_tokens=2048, comm_sms_fwd=8,
                    comm_sms_bwd=12, tiles=GemmTiles(tile_m=128), fused_forward=GemmTiles(tile_n=128, stages=4),
                    fused_backward={"tile_n": 128, "stages": 3}, gemm1=GemmTiles(tile_n=128), gemm2=GemmTiles(stages=2),
                    dgrad2=GemmTiles(tile_n=128, stages=5), dgrad1=GemmTiles(tile_k=64), wgrad=GemmTiles(stages=6,
                                                                                                          tile_n=128))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kw,exc,msg", [
    (dict(minibatch_tokens=1000), ValueError, "minibatch_tokens must be a positive multiple of 256, got 1000"),
    (dict(minibatch_tokens=2048.0), TypeError, "minibatch_tokens must be an int"),
    (dict(comm_sms_fwd=3), ValueError, "comm_sms_fwd must be an even integer >= 2, got 3"),
    (dict(comm_sms_bwd=0), ValueError, "comm_sms_bwd must be an even integer >= 2"),
    (dict(comm_sms_bwd=True), TypeError, "comm_sms_bwd must be an int, got bool"),
    (dict(forward_path="whole"), ValueError, r"forward_path must be one of \['fused', 'unfused'\]"),
    (dict(backward_path="fast"), ValueError, "backward_path must be one of"),
    (dict(fused_forward=GemmTiles(tile_n=128), gemm1=128), TypeError, "gemm1 must be a GemmTiles"),
    (dict(wgrad={"tile_q": 1}), ValueError, "wgrad: GemmTiles has no field 'tile_q'"),
    (dict(dgrad1={"tile_n": 100}), ValueError, r"tile_n must be one of \(64, 128, 192, 256\), got 100"),
])
def test_policy_rejects(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        KernelPolicy(**kw)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(tile_m=96), ValueError, r"tile_m must be one of \(64, 128, 256\), got 96"),
    (dict(tile_n=100), ValueError, "tile_n must be one of"),
    (dict(tile_k=16), ValueError, r"tile_k must be one of \(32, 64, 128\)"),
    (dict(tile_n=128.0), TypeError, "tile_n must be an int, got float"),
    (dict(stages=1), ValueError, r"stages must be in \[2, 16\], got 1"),
    (dict(stages=17), ValueError, "stages must be in"),
    (dict(stages="3"), TypeError, "stages must be an int, got str"),
])
def test_gemm_tiles_reject(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        GemmTiles(**kw)


def test_policy_defaults_and_resolution():
    """Every field None: the tuned defaults (ring 1024 tokens, comm CTAs 16 / 40 / 28); a GEMM's tiles are
    its own fields, each None one from ``tiles``; frozen and hashable; the repr shows what is set."""
    p = KernelPolicy()
    assert p.given() == {} and repr(p) == "KernelPolicy()"
    assert (p.ring_tokens(), p.forward_comm_ctas(1), p.forward_comm_ctas(4), p.backward_comm_ctas()) == (
        1024, 16, 40, 28)
    assert all(p.gemm(g) == GemmTiles() for g in GEMMS)
    assert FULL.gemm("fused_forward") == GemmTiles(128, 128, None, 4)  # tile_m from tiles
    assert FULL.gemm("dgrad1") == GemmTiles(tile_m=128, tile_k=64)
    assert FULL.fused_backward == GemmTiles(tile_n=128, stages=3)  # a mapping made GemmTiles
    assert (FULL.forward_path, FULL.backward_path) == (F, BW)  # strings made the enums
    assert (FULL.ring_tokens(), FULL.forward_comm_ctas(4), FULL.backward_comm_ctas()) == (2048, 8, 12)
    assert FULL.given()["fused_forward.stages"] == 4 and "gemm1.tile_m" not in FULL.given()
    assert hash(FULL) == hash(dataclasses.replace(FULL)) and repr(GemmTiles(tile_n=128)) == "GemmTiles(tile_n=128)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.minibatch_tokens = 512
    with pytest.raises(ValueError, match="GEMM must be one of"):
        FULL.gemm("gemm3")


# ---------------------------------------------------------------- MoKConfig
def test_config_knobs_fold_into_the_policy():
    """MoKConfig's knobs are the policy's fields of the same names (tile_* its ``tiles``): kernel_policy
    merges them, a choice given by both must agree (ValueError naming both), the knobs' own errors are the
    policy's (the same messages as before the policy)."""
    c = MoKConfig(minibatch_tokens=4096, comm_sms_fwd=6, forward_path="unfused", tile_n=128,
                  policy=KernelPolicy(comm_sms_bwd=10, fused_forward=GemmTiles(stages=5)))
    kp = c.kernel_policy
    assert (kp.minibatch_tokens, kp.comm_sms_fwd, kp.comm_sms_bwd, kp.forward_path) == (4096, 6, 10, U)
    assert kp.tiles == GemmTiles(tile_n=128) and kp.gemm("fused_forward") == GemmTiles(tile_n=128, stages=5)
    assert (c.comm_ctas_fwd(1), c.comm_ctas_bwd(), c.minibatch_tokens, c.policy.minibatch_tokens) == (6, 10, 4096, None)
    assert MoKConfig(policy=FULL).kernel_policy is FULL  # nothing to fold: the policy itself
    same = MoKConfig(minibatch_tokens=2048, policy=KernelPolicy(minibatch_tokens=2048))  # given twice, agreeing
    assert same.kernel_policy.minibatch_tokens == 2048
    for kw, name in ((dict(minibatch_tokens=1024, policy=KernelPolicy(minibatch_tokens=2048)), "minibatch_tokens"),
                     (dict(tile_n=256, policy=KernelPolicy(tiles=GemmTiles(tile_n=128))), "tile_n"),
                     (dict(backward_path="fused", policy=FULL), "backward_path")):
        with pytest.raises(ValueError, match=f"{name} is given twice, MoKConfig.*and policy.*: give it once"):
            MoKConfig(**kw)
    with pytest.raises(TypeError, match="policy must be a KernelPolicy"):
        MoKConfig(policy=[1])
    with pytest.raises(ValueError, match="comm_sms_fwd must be an even integer"):
        MoKConfig(comm_sms_fwd=3)


def test_config_round_trips_with_its_policy():
    """The serialized config (``_key``, the custom ops' ``config_key``) holds the policy as given and comes
    back equal (policy, knobs, merged policy); ``replace`` keeps the policy and re-folds the knobs."""
    from mok_cute.custom_ops import _config, config_key

    for cfg in (MoKConfig(), MoKConfig(policy=FULL, precision="mxfp8"),
                MoKConfig(tile_n=128, minibatch_tokens=512, policy={"gemm1": {"stages": 3}})):
        key = config_key(cfg)
        back = MoKConfig(**json.loads(key))
        assert back == cfg and back.kernel_policy == cfg.kernel_policy and config_key(back) == key
        assert _config(key) == cfg
    assert json.loads(config_key(MoKConfig(policy=FULL)))["policy"]["fused_forward"] == {
        "tile_m": None, "tile_n": 128, "tile_k": None, "stages": 4}
    c = MoKConfig(tile_n=128, policy=KernelPolicy(gemm2=GemmTiles(stages=3)))
    r = dataclasses.replace(c, trace=True)
    assert r.kernel_policy == c.kernel_policy and r.trace is True
    r = dataclasses.replace(c, policy=KernelPolicy(minibatch_tokens=512))
    assert r.kernel_policy.gemm("gemm2") == GemmTiles(tile_n=128) and r.kernel_policy.ring_tokens() == 512


# ---------------------------------------------------------------- the per-arch check
@pytest.mark.parametrize("arch,precision,paths,policy,msg", [
    ("sm90", "bf16", (F, BF), KernelPolicy(fused_forward=GemmTiles(tile_n=192)),
     r"policy.fused_forward.tile_n = 192 does not run on the fused forward .* 'bf16' \(allowed: 256, 128\)"),
    ("sm90", "bf16", (F, BF), KernelPolicy(fused_forward=GemmTiles(stages=4)),
     r"policy.fused_forward.stages = 4 .*\(allowed: 2, 3\)"),  # at the default tile_n 256
    ("sm90", "mxfp8", (F, BF), KernelPolicy(fused_forward=GemmTiles(tile_n=128, stages=2)),
     r"policy.fused_forward.stages = 2 .*precision 'mxfp8' \(allowed: 3, 4, 5, 6\)"),
    ("sm90", "bf16", (F, BW), KernelPolicy(fused_backward=GemmTiles(tile_n=128, stages=6)),
     r"policy.fused_backward.stages = 6 .*\(allowed: 3, 4, 5\)"),
    ("sm90", "bf16", (U, BU), KernelPolicy(dgrad2=GemmTiles(tile_n=128, stages=6)),
     r"policy.dgrad2.stages = 6 .*dgrad2 \+ dSwiGLU .*\(allowed: 2, 3, 4, 5\)"),
    ("sm90", "bf16", (F, BF), KernelPolicy(gemm1=GemmTiles(tile_k=128)),  # checked though not run
     r"policy.gemm1.tile_k = 128 .*unfused GEMM1 \+ SwiGLU .*\(allowed: 64\)"),
    ("sm90", "fp8_block", (U, BU), KernelPolicy(wgrad=GemmTiles(tile_n=256)),
     r"policy.wgrad.tile_n = 256 .*precision 'fp8_block' \(allowed: 128\)"),
    ("sm90", "fp8_block", (U, BU), KernelPolicy(tiles=GemmTiles(tile_k=64)),
     r"policy.tiles.tile_k \(MoKConfig.tile_k\) = 64 .*unfused GEMM1 .*'fp8_block' \(allowed: 128\)"),
    ("sm90", "fp8_block", (U, BU), KernelPolicy(gemm2=GemmTiles(stages=3)),
     r"policy.gemm2.stages = 3 .*\(allowed: none: leave it None"),
    ("sm100", "bf16", (U, BU), KernelPolicy(gemm1=GemmTiles(stages=3)), r"allowed: none: leave it None"),
    ("sm100", "mxfp8", (F, BF), KernelPolicy(fused_backward=GemmTiles(tile_k=64)),
     r"'sm100': policy.fused_backward.tile_k = 64 .*precision 'mxfp8' \(allowed: 128\)"),
    ("sm100", "bf16", (F, BU), KernelPolicy(tiles=GemmTiles(tile_m=256)), r"unfused dgrad2 .*\(allowed: 128\)"),
])
def test_check_names_the_field_and_the_allowed_values(arch, precision, paths, policy, msg):
    with pytest.raises(ValueError, match=msg):
        tiles.check(policy, arch, precision, *paths)


@pytest.mark.parametrize("arch,precision,paths,policy", [
    ("sm90", "bf16", (F, BF), FULL),
    ("sm90", "mxfp8", (U, BU), FULL),
    ("sm90", "bf16", (U, BU), KernelPolicy(tiles=GemmTiles(tile_n=128, stages=5))),  # every unfused GEMM takes it
    ("sm90", "fp8_block", (U, BU), KernelPolicy(tiles=GemmTiles(128, 128, 128))),  # the FP8 kernels' own tiles
    ("sm90", "fp8_block", (U, BU), KernelPolicy(fused_forward=GemmTiles(tile_n=128))),  # no fused kernel there
    ("sm90", "bf16", (U, BU), KernelPolicy(fused_forward=GemmTiles(tile_n=128, stages=6))),  # valid, not run
    ("sm100", "bf16", (F, BF), KernelPolicy(tiles=GemmTiles(tile_m=256))),
    ("sm100", "mxfp8", (F, BU), KernelPolicy(fused_forward=GemmTiles(tile_m=256), tiles=GemmTiles(tile_k=128))),
])
def test_check_accepts(arch, precision, paths, policy):
    tiles.check(policy, arch, precision, *paths)


def test_sm90_wildcard_stages_must_fit_every_gemm_the_call_runs():
    """``tiles.stages`` 6 at tile_n 128 fits GEMM1 / GEMM2 but not the fused backward (5 at most): refused on
    the fused backward, taken with the unfused one except by dgrad2 (5 at most)."""
    p = KernelPolicy(tiles=GemmTiles(tile_n=128, stages=6))
    with pytest.raises(ValueError, match=r"policy.tiles.stages = 6 .*fused backward"):
        tiles.check(p, "sm90", "bf16", F, BF)
    with pytest.raises(ValueError, match="unfused dgrad2"):
        tiles.check(p, "sm90", "bf16", U, BU)
    tiles.check(KernelPolicy(tiles=GemmTiles(tile_n=128, stages=5)), "sm90", "bf16", F, BF)


def test_table_matches_the_kernels():
    """The SM90 stages the table allows are what the kernels build: the largest is the kernel's own default
    (as many as fit, also taken when none is given), one more does not fit, one less than the smallest
    fails the slot sums' buffer (the fused kernels) or is below 2."""
    from mok_cute.kernels.sm90.expert_bwd import GroupedWgradSm90
    from mok_cute.kernels.sm90.fused_bwd import BwdVariant, FusedMoeBwdCoreSm90
    from mok_cute.kernels.sm90.fused_moe import FusedMoeFwdSm90
    from mok_cute.kernels.sm90.grouped_gemm import GroupedGemmSm90
    from mok_cute.kernels.sm90.mainloop import MN_MAJOR, MainloopConfig

    build = {
        "fused_forward": lambda c: FusedMoeFwdSm90(True, True, cfg=c).mainloop,
        "fused_backward": lambda c: FusedMoeBwdCoreSm90(BwdVariant(True, scatter=True), c).ml_d,
        "gemm1": lambda c: GroupedGemmSm90(c, "swiglu").mainloop,
        "gemm2": lambda c: GroupedGemmSm90(c, "plain").mainloop,
        "dgrad2": lambda c: GroupedGemmSm90(c, "dswiglu", b_major=MN_MAJOR).mainloop,
        "dgrad1": lambda c: GroupedGemmSm90(c, "plain", b_major=MN_MAJOR, split_b=True).mainloop,
        "wgrad": lambda c: GroupedWgradSm90(c).mainloop,
    }
    for gemm, choices in tiles.CHOICES["sm90"]["bf16"].items():
        assert choices.default() == GemmTiles(128, 256, 64)
        for tile_n in choices.tile_n:
            allowed = choices.stages_at(tile_n)
            assert allowed == tuple(range(allowed[0], allowed[-1] + 1))
            assert build[gemm](MainloopConfig(tile_n=tile_n)).stages == allowed[-1], (gemm, tile_n)
            for st in allowed:
                assert build[gemm](MainloopConfig(tile_n=tile_n, stages=st)).stages == st
            for st in (allowed[0] - 1, allowed[-1] + 1):
                if st >= 2:
                    with pytest.raises(ValueError):
                        build[gemm](MainloopConfig(tile_n=tile_n, stages=st))


# ---------------------------------------------------------------- what reaches the SM90 launches
def test_sm90_launches_take_the_policy(monkeypatch):
    """The SM90 MLP hands each kernel its GEMM's tiles: the fused forward's ``FusedLaunch`` and the fused
    backward core's ``BackwardLaunch`` carry tile_n / stages, the unfused run functions get ``cfg`` (and, where
    the policy leaves a GEMM alone, are called as before: no ``cfg``)."""
    from mok_cute.kernels.sm90 import expert_bwd, fused_bwd, grouped_gemm
    from mok_cute.kernels.sm90.mainloop import MainloopConfig
    from mok_cute.layers import sm90

    cfg = MoKConfig(tile_n=128, policy=KernelPolicy(fused_forward=GemmTiles(stages=5), gemm2=GemmTiles(tile_n=256),
                                                   wgrad=GemmTiles(stages=2)))
    assert sm90._tiles(cfg, "fused_forward") == {"tile_n": 128, "stages": 5}
    assert sm90._tiles(None, "fused_forward") == {}
    launch = sm90._core_launch(fused_bwd.BackwardLaunch, sm90.ExpertGroup(None, None, None, None, "mxfp8"), cfg)
    assert (launch.tile_n, launch.stages, launch.mx) == (128, None, True)
    assert sm90._core_launch(fused_bwd.BackwardLaunch, sm90.ExpertGroup(None, None, None, None), MoKConfig()) == \
        fused_bwd.BackwardLaunch(timeout_s=30.0, trace=False)
    seen = {}

    def record(name):
        return lambda *a, **kw: seen.setdefault(name, kw.get("cfg"))
    for mod, name in ((grouped_gemm, "_run_gemm1_swiglu"), (grouped_gemm, "_run_gemm"),
                      (expert_bwd, "_run_dswiglu_dgrad"), (expert_bwd, "_run_dgrad1"), (expert_bwd, "_run_wgrad")):
        monkeypatch.setattr(mod, name, record(name))
    for gemm, name, mod in (("gemm1", "_run_gemm1_swiglu", grouped_gemm), ("gemm2", "_run_gemm", grouped_gemm),
                            ("wgrad", "_run_wgrad", expert_bwd)):
        sm90._with_tiles(getattr(mod, name), cfg, gemm)()
    assert seen == {"_run_gemm1_swiglu": MainloopConfig(tile_n=128), "_run_gemm": MainloopConfig(),
                    "_run_wgrad": MainloopConfig(tile_n=128, stages=2)}
    assert sm90._with_tiles(grouped_gemm._run_gemm, MoKConfig(), "gemm2") is grouped_gemm._run_gemm
    assert sm90._with_tiles(grouped_gemm._run_gemm, None, "gemm2") is grouped_gemm._run_gemm


def test_layer_passes_the_config_to_the_unfused_mlp_only_with_tiles():
    """The layer's unfused forward gives the MLP ``config=`` only where the policy sets GEMM1 / GEMM2 tiles
    (an MLP taking none keeps working), and the unfused backward always (its ``config=``)."""
    from conftest import make_problem
    from mok_cute.layers.common import ExpertGroup, mlp_options
    from mok_cute.layers.grouped import GroupedExpertBackend
    from mok_cute.layers.select import MoEInputs

    assert mlp_options(MoKConfig()) == {} and mlp_options(MoKConfig(precision="mxfp8")) == {"precision": "mxfp8"}
    assert mlp_options(MoKConfig(policy=KernelPolicy(fused_forward=GemmTiles(tile_n=128)))) == {}
    c = MoKConfig(policy=KernelPolicy(gemm2=GemmTiles(stages=2)))
    assert mlp_options(c) == {"config": c}
    seen = []

    class Mlp:  # an sm90 row of the table (CPU tensors: the unfused paths)
        arch, dim_multiple, precisions, strided_weights, fused_mx_prologue = "sm90", {"bf16": 64}, ("bf16",), True, True
        gathers_x = False

        def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit, **kw):
            seen.append(("forward", kw.get("config")))
            return torch.zeros_like(x_rows), ExpertGroup(x_rows, offsets, x_rows, x_rows)

        def backward(self, g, dy_rows, w_gate, w_up, w_down, limit, fused, config=None):
            seen.append(("backward", config))
            return torch.zeros_like(dy_rows), w_gate, w_up, w_down

    p, dy = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    be = GroupedExpertBackend(Mlp())
    for cfg in (MoKConfig(trace=False), MoKConfig(tile_n=128, trace=False)):
        seen.clear()
        _, st = be.forward(inp, cfg, None)
        be.backward(st, dy)
        assert seen == [("forward", None if cfg.tile_n is None else cfg), ("backward", cfg)]


def test_expert_mlp_refuses_policy_tiles_on_a_gpu_backend(monkeypatch):
    """``mok_cute.ops.expert_mlp`` runs an arch's tuned tiles only: a policy with tiles raises
    NotImplementedError naming them (never silently ignored); without tiles it runs."""
    from types import SimpleNamespace

    from mok_cute import custom_ops
    from mok_cute.layers import select

    calls = []
    mlp = SimpleNamespace(precisions=("bf16",), arch="sm90",
                          forward=lambda *a, **k: calls.append(a) or (a[0], None))
    monkeypatch.setattr(select, "select_backend", lambda device, cfg: "sm90")
    monkeypatch.setattr(select, "get_backend", lambda name: SimpleNamespace(mlp=mlp))
    x, offs = torch.zeros(4, 64, dtype=torch.bfloat16), torch.tensor([0, 4])
    w = (torch.zeros(1, 64, 64, dtype=torch.bfloat16),) * 3
    for cfg in (MoKConfig(tile_n=128), MoKConfig(policy=KernelPolicy(dgrad1=GemmTiles(stages=2)))):
        with pytest.raises(NotImplementedError, match="expert_mlp: backend 'sm90' runs its tuned tiles only"):
            custom_ops.run_mlp_forward(x, offs, *w, None, cfg)
    assert not calls
    custom_ops.run_mlp_forward(x, offs, *w, None, MoKConfig())
    assert len(calls) == 1

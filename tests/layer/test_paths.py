"""The one path decision per layer call (mok_cute.layers.paths) on the CPU: the arch defaults,
explicit paths the table allows, explicit paths it does not (NotImplementedError naming the path,
arch, precision and feature), the environment never overriding the config, and the layer
keeping the decided paths (and the resolved trace) in its forward state for the backward."""
from __future__ import annotations

import itertools

import pytest
import torch

from mok_cute.config import BackwardPath, ForwardPath, MoKConfig
from mok_cute.layers import paths as P
from mok_cute.layers.paths import Call, Paths, decide

F, U = ForwardPath.FUSED, ForwardPath.UNFUSED
BF, BW, BU = BackwardPath.FUSED, BackwardPath.FUSED_WHOLE, BackwardPath.UNFUSED


@pytest.mark.parametrize("arch,call,want", [
    ("sm90", Call("bf16"), Paths(F, BF)),
    ("sm90", Call("mxfp8", shared=True, main_grads=True), Paths(F, BF)),
    ("sm90", Call("bf16", shared=True, shared_gate=True), Paths(F, BF)),
    ("sm90", Call("fp8_block"), Paths(U, BU)),  # fp8_block runs unfused: its default, not an error
    ("sm90", Call("bf16", ep=4), Paths(F, BF)),
    ("sm90", Call("mxfp8", ep=2, recompute=True), Paths(F, BF)),
    ("sm90", Call("bf16", cuda=False), Paths(U, BU)),  # the CPU tests' emulated kernels
    ("sm100", Call("bf16"), Paths(U, BU)),
    ("sm100", Call("mxfp8", shared=True, main_grads=True), Paths(U, BU)),
])
def test_defaults_per_arch(arch, call, want):
    assert decide(MoKConfig(), arch, call) == want


def test_sm100_has_no_default_at_ep_above_one():
    """SM100 at EP > 1 (compile-verified only) runs a path only when the config asks for one."""
    with pytest.raises(NotImplementedError, match="'sm100': EP > 1, precision 'bf16': no default forward path"):
        decide(MoKConfig(), "sm100", Call("bf16", ep=2))
    assert decide(MoKConfig(forward_path="fused"), "sm100", Call("bf16", ep=2)) == Paths(F, BU)
    assert decide(MoKConfig(forward_path="unfused"), "sm100", Call("mxfp8", ep=2)) == Paths(U, BU)
    assert decide(MoKConfig(forward_path="fused", backward_path="fused"), "sm100", Call("bf16", ep=2)) == Paths(F, BF)


@pytest.mark.parametrize("arch,cfg,call,want", [
    ("sm90", dict(forward_path="unfused"), Call("bf16"), Paths(U, BF)),  # FUSED backward after an unfused forward
    ("sm90", dict(forward_path="unfused"), Call("bf16", ep=2), Paths(U, BU)),  # at EP > 1 it needs the fused one
    ("sm90", dict(backward_path="fused_whole"), Call("bf16", shared=True, main_grads=True), Paths(F, BW)),
    ("sm90", dict(backward_path="fused_whole"), Call("mxfp8"), Paths(F, BW)),
    ("sm90", dict(backward_path="fused_whole"), Call("bf16", ep=2), Paths(F, BW)),
    ("sm90", dict(backward_path="unfused"), Call("mxfp8", shared_gate=True), Paths(F, BU)),
    ("sm90", dict(forward_path="unfused", backward_path="unfused"), Call("bf16", cuda=False), Paths(U, BU)),
    ("sm90", dict(forward_path="fused", backward_path="fused"), Call("bf16", cuda=False), Paths(F, BF)),
    ("sm100", dict(forward_path="fused"), Call("mxfp8"), Paths(F, BU)),
    ("sm100", dict(forward_path="fused", backward_path="fused_whole"), Call("mxfp8", main_grads=True), Paths(F, BW)),
    ("sm100", dict(backward_path="fused"), Call("bf16", shared_gate=True), Paths(U, BF)),
])
def test_explicit_paths_the_table_allows(arch, cfg, call, want):
    assert decide(MoKConfig(**cfg), arch, call) == want


@pytest.mark.parametrize("arch,cfg,call,names", [
    ("sm90", dict(forward_path="fused"), Call("fp8_block"), ("forward_path=FUSED", "fp8_block")),
    ("sm90", dict(backward_path="fused"), Call("fp8_block"), ("backward_path=FUSED", "fp8_block")),
    ("sm90", dict(backward_path="fused_whole"), Call("mxfp8", main_grads=True),
     ("backward_path=FUSED_WHOLE", "'mxfp8'", "main_grads")),
    ("sm90", dict(backward_path="fused_whole"), Call("bf16", shared=True, shared_gate=True),
     ("backward_path=FUSED_WHOLE", "'bf16'", "does not run with shared_gate")),
    ("sm90", dict(forward_path="unfused", backward_path="fused_whole"), Call("bf16"),
     ("backward_path=FUSED_WHOLE", "after forward_path=FUSED only")),
    ("sm90", dict(forward_path="unfused", backward_path="fused"), Call("mxfp8", ep=2),
     ("backward_path=FUSED", "EP > 1", "after forward_path=FUSED only")),
    ("sm90", dict(forward_path="fused"), Call("bf16", ep=2, shared_gate=True),
     ("forward_path=FUSED", "EP > 1", "shared_gate")),
    ("sm100", dict(forward_path="fused"), Call("fp8_block"), ("forward_path=FUSED", "'fp8_block'")),
])
def test_explicit_path_the_table_refuses_names_it(arch, cfg, call, names):
    with pytest.raises(NotImplementedError) as err:
        decide(MoKConfig(**cfg), arch, call)
    msg = str(err.value)
    assert f"mok_cute backend {arch!r}" in msg and f"precision {call.precision!r}" in msg
    for name in names:
        assert name in msg, (name, msg)


def test_no_path_for_the_call_raises_naming_it():
    with pytest.raises(NotImplementedError, match="'sm90': EP > 1, precision 'fp8_block': no default forward path"):
        decide(MoKConfig(), "sm90", Call("fp8_block", ep=2))
    with pytest.raises(NotImplementedError, match="'sm90': EP > 1.*shared_gate.*no default forward path"):
        decide(MoKConfig(), "sm90", Call("bf16", ep=2, shared=True, shared_gate=True))
    with pytest.raises(NotImplementedError, match="no path table for arch 'sm80'"):
        decide(MoKConfig(), "sm80", Call("bf16"))


def test_every_combination_decides_or_names_the_call():
    """Over the whole table: a decision is a pair the table allows (the backward after the
    decided forward), or a NotImplementedError naming the arch and the call; never another error."""
    paths = [None] + list(ForwardPath)
    bwds = [None] + list(BackwardPath)
    for arch, prec, ep, gate, mg, cuda, fwd, bwd in itertools.product(
            P.ARCHES, P.ALL, (1, 2), (False, True), (False, True), (False, True), paths, bwds):
        call = Call(prec, ep, shared=gate, shared_gate=gate, main_grads=mg, cuda=cuda)
        try:
            got = decide(MoKConfig(forward_path=fwd, backward_path=bwd), arch, call)
        except NotImplementedError as err:
            assert f"'{arch}'" in str(err) and f"precision '{prec}'" in str(err)
            continue
        assert P.refusal(arch, "forward", got.forward, call) is None
        assert P.refusal(arch, "backward", got.backward, call, got.forward) is None
        assert fwd is None or got.forward is fwd
        assert bwd is None or got.backward is bwd


def test_expert_mlp_backward_path():
    """expert_mlp: FUSED (the fused core) by default on SM90 at BF16 / MXFP8, UNFUSED at fp8_block
    and on SM100; FUSED_WHOLE refused (it needs the layer's routing)."""
    assert P.decide_expert_mlp(MoKConfig(), "sm90", Call("bf16")) is BF
    assert P.decide_expert_mlp(MoKConfig(), "sm90", Call("fp8_block")) is BU
    assert P.decide_expert_mlp(MoKConfig(), "sm100", Call("mxfp8")) is BU
    assert P.decide_expert_mlp(MoKConfig(backward_path="fused"), "sm100", Call("mxfp8")) is BF
    with pytest.raises(NotImplementedError, match="backward_path=FUSED_WHOLE"):
        P.decide_expert_mlp(MoKConfig(backward_path="fused_whole"), "sm90", Call("bf16"))


def test_removed_environment_switches_change_nothing(monkeypatch):
    """MOK_CUTE_FUSED, _FUSED_EP, _FUSED_BWD (and its _MX, _MX_PROLOGUE), _BACKEND are gone: set to
    their old "off" values they change no decision."""
    for name, value in (("MOK_CUTE_FUSED", "0"), ("MOK_CUTE_FUSED_EP", "0"), ("MOK_CUTE_FUSED_BWD", "0"),
                        ("MOK_CUTE_FUSED_BWD_MX", "0"), ("MOK_CUTE_FUSED_BWD_MX_PROLOGUE", "0"),
                        ("MOK_CUTE_BACKEND", "reference"), ("MOK_CUTE_SM100_FUSED", "1")):
        monkeypatch.setenv(name, value)
    assert decide(MoKConfig(), "sm90", Call("bf16")) == Paths(F, BF)
    assert decide(MoKConfig(), "sm90", Call("mxfp8", ep=2)) == Paths(F, BF)
    assert decide(MoKConfig(), "sm100", Call("bf16")) == Paths(U, BU)


def test_config_trace_beats_the_environment(monkeypatch):
    """``MoKConfig.trace`` given wins over MOK_CUTE_TRACE; None takes the environment's, read per call."""
    monkeypatch.setenv("MOK_CUTE_TRACE", "1")
    assert P.with_trace(MoKConfig(trace=False)).trace is False
    assert P.with_trace(MoKConfig()).trace is True
    monkeypatch.setenv("MOK_CUTE_TRACE", "0")
    assert P.with_trace(MoKConfig(trace=True)).trace is True
    assert P.with_trace(MoKConfig()).trace is False
    cfg = MoKConfig(precision="mxfp8", comm_sms_bwd=12)
    assert P.with_trace(cfg) is P.with_trace(cfg)  # resolved once per distinct config
    assert P.with_trace(cfg).comm_sms_bwd == 12 and P.with_trace(cfg).precision == "mxfp8"


class _Stop(Exception):
    pass


def test_the_layer_decides_once_and_passes_the_resolved_config(monkeypatch):
    """The layer's forward hands the arch's fused forward a config whose trace is resolved (the
    config's False beats MOK_CUTE_TRACE=1; None takes it); an unfused forward keeps the paths it
    decided in its state, and the backward runs that path (the MLP's separate kernels)."""
    from conftest import make_problem
    from mok_cute.layers.grouped import GroupedExpertBackend
    from mok_cute.layers.select import MoEInputs

    seen = []

    class Mlp:  # an sm90 row of the table; fused_forward records the config it gets
        arch, dim_multiple, precisions, strided_weights, fused_mx_prologue = "sm90", {"bf16": 64}, ("bf16",), True, True
        gathers_x = down_grad_first = False

        def fused_forward(self, *a, gate=None):
            seen.append(a[-1].trace)
            raise _Stop

        def forward(self, x_rows, offsets, w_gate, w_up, w_down, limit):
            from mok_cute.layers.common import ExpertGroup

            return torch.zeros_like(x_rows), ExpertGroup(x_rows, offsets, x_rows, x_rows)

        def backward(self, g, dy_rows, w_gate, w_up, w_down, limit, fused, config=None):
            seen.append(("backward", fused))
            return torch.zeros_like(dy_rows), w_gate, w_up, w_down

    p, dy = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    be = GroupedExpertBackend(Mlp())
    monkeypatch.setenv("MOK_CUTE_TRACE", "1")
    for trace in (False, None):
        with pytest.raises(_Stop):
            be.forward(inp, MoKConfig(forward_path="fused", trace=trace), None)
    assert seen == [False, True]
    monkeypatch.setenv("MOK_CUTE_FUSED", "1")  # gone: changes nothing
    y, st = be.forward(inp, MoKConfig(trace=False), None)  # CPU tensors: the default is UNFUSED
    assert st.paths == Paths(U, BU) and st.config.trace is False
    be.backward(st, dy)
    assert seen[2:] == [("backward", False)]


def test_tile_rule_per_arch():
    """The GEMM tiles a call's kernels run (mok_cute.layers.tiles): tile_m 128 / 256 (256: the
    cta_group::2 kernels) reaches SM100's fused kernels; the ``MoKConfig.tile_*`` knobs reach every GEMM
    the call runs, each of which must take the value: where one does not (SM100's unfused kernels,
    tile_n / tile_k there, tile_m 256 on SM90), ValueError names the field and the allowed values."""
    from mok_cute.layers import tiles
    from mok_cute.policy import GemmTiles, KernelPolicy

    def check(arch, paths, cfg, precision="bf16"):
        policy = cfg.kernel_policy if isinstance(cfg, MoKConfig) else cfg
        tiles.check(policy, arch, precision, paths.forward, paths.backward)

    check("sm100", Paths(F, BF), MoKConfig(tile_m=256))
    check("sm100", Paths(F, BW), MoKConfig(tile_m=128), "mxfp8")
    check("sm100", Paths(F, BU), KernelPolicy(fused_forward=GemmTiles(tile_m=256)))  # the forward's own
    check("sm100", Paths(U, BU), KernelPolicy(fused_forward=GemmTiles(tile_m=256)))  # valid there, not run
    check("sm90", Paths(F, BF), MoKConfig())
    check("sm90", Paths(U, BU), MoKConfig(tile_m=128, tile_n=128, tile_k=64))  # SM90 BF16's own tile_m, tile_k
    for arch, paths, cfg, where, allowed in (
            ("sm100", Paths(U, BU), MoKConfig(tile_m=256), r"policy.tiles.tile_m \(MoKConfig.tile_m\) = 256", "128"),
            ("sm100", Paths(F, BU), MoKConfig(tile_m=256), "unfused dgrad2", "128"),
            ("sm100", Paths(F, BF), MoKConfig(tile_m=64), r"MoKConfig.tile_m\) = 64", "128, 256"),
            ("sm100", Paths(F, BF), MoKConfig(tile_m=256, tile_n=128), r"MoKConfig.tile_n\) = 128", "256"),
            ("sm90", Paths(F, BF), MoKConfig(tile_m=256), r"\) = 256 does not run on the fused forward", "128"),
            ("sm90", Paths(U, BU), KernelPolicy(fused_forward=GemmTiles(tile_n=192)),
             "policy.fused_forward.tile_n = 192", "256, 128")):
        with pytest.raises(ValueError, match=f"'{arch}': .*{where}.*allowed: {allowed}"):
            check(arch, paths, cfg)


def test_the_backend_check_applies_the_tile_rule():
    from conftest import make_problem
    from mok_cute.layers.select import MoEInputs, get_backend
    from mok_cute.policy import GemmTiles, KernelPolicy

    p, _ = make_problem(T=8, H=256, I=256, E=2, k=2)
    inp = MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    sm100 = get_backend("sm100")
    fused_fwd = KernelPolicy(forward_path="fused", fused_forward=GemmTiles(tile_m=256))
    assert sm100.check(inp, MoKConfig(policy=fused_fwd), None) == Paths(F, BU)
    with pytest.raises(ValueError, match="'sm100': policy.tiles.tile_m .*unfused GEMM1"):
        sm100.check(inp, MoKConfig(tile_m=256), None)
    with pytest.raises(ValueError, match="'sm90': policy.tiles.tile_m .*allowed: 128"):
        get_backend("sm90").check(inp, MoKConfig(tile_m=256), None)
    assert get_backend("sm90").check(inp, MoKConfig(tile_n=128), None) == Paths(U, BU)  # CPU tensors: unfused


@pytest.mark.parametrize("gathers, down_first", [(True, True), (True, False), (False, False)])
def test_fused_backward_gathers_x_where_the_mlp_does(gathers, down_first):
    """BackwardPath.FUSED at BF16 after the fused forward: on an MLP whose launch gathers x's rows (``gathers_x``,
    SM90) the route_grad pass makes no grouped x rows and ``backward_tokens`` gets the layer's x as ``x_tok``;
    otherwise (SM100) it gets the grouped x rows x[order // k], as before. ``down_grad_first`` (SM90): the MLP's
    ``down_weight_grad`` runs first on the forward's h and the same dy rows, then the state lets h go and
    ``backward_tokens`` gets a group without h and that dW_down as ``dwd``, returned as the layer's."""
    from conftest import make_problem
    from mok_cute.layers.common import ExpertGroup, MadeBefore
    from mok_cute.layers.grouped import GroupedExpertBackend
    from mok_cute.layers.select import MoEInputs

    seen = {}

    class Mlp:  # an sm90 row of the table whose fused kernels are stand-ins
        arch, dim_multiple, precisions, strided_weights, fused_mx_prologue = "sm90", {"bf16": 64}, ("bf16",), True, True
        gathers_x, down_grad_first = gathers, down_first

        def fused_forward(self, x, plan, experts, shared, limit, config, gate=None):
            tk, inter = plan.topk_idx.numel(), experts.w_gate.shape[1]
            rows = torch.zeros(tk, x.shape[1], dtype=x.dtype)
            seen["h"] = torch.zeros(tk, inter, dtype=x.dtype)
            return (torch.zeros_like(x), torch.zeros(tk, 2 * inter, dtype=x.dtype), seen["h"], rows, None, None, None)

        def down_weight_grad(self, g: ExpertGroup, dy_rows, config=None):
            seen.update(down_h=g.h, down_dy=dy_rows, dwd=torch.ones(2, 64, 64))
            return seen["dwd"]

        def backward_tokens(self, g: ExpertGroup, dy_rows, w_gate, w_up, w_down, limit, tokens, consume=False,
                            config=None, made=MadeBefore()):
            seen.update(x=g.x, x_tok=made.x_tok, order=tokens[0], consume=consume, h=g.h, dy=dy_rows, got_dwd=made.dwd)
            dwd = w_down if made.dwd is None else made.dwd
            return torch.zeros(tokens[1].shape[0], dy_rows.shape[1]), w_gate, w_up, dwd

    p, dy = make_problem(T=8, H=64, I=64, E=2, k=2)
    inp = MoEInputs(p["x"], p["topk_idx"], p["topk_w"], p["w_gate"], p["w_up"], p["w_down"], None, None)
    be = GroupedExpertBackend(Mlp())
    _, st = be.forward(inp, MoKConfig(forward_path="fused", backward_path="fused"), None)
    h = seen["h"]
    grads = be.backward(st, dy)
    assert seen["consume"]
    if down_first:
        assert seen["down_h"] is h and seen["down_dy"] is seen["dy"] and seen["h"] is None and st.routed.h is None
        assert seen["got_dwd"] is seen["dwd"] and grads.d_w_down is seen["dwd"]
    else:
        assert "down_h" not in seen and seen["got_dwd"] is None and seen["h"] is h
    if gathers:
        assert seen["x"] is None and seen["x_tok"] is p["x"]
    else:
        assert seen["x_tok"] is None
        assert torch.equal(seen["x"][:16], p["x"][seen["order"][:16] // 2])


def test_sm90_down_weight_grad_checks_before_any_launch():
    """Sm90ExpertMLP.down_weight_grad (the FUSED backward's dW_down before its launch) refuses, before any launch,
    dy rows of the wrong count, non-contiguous or not bf16 (the backward's dy check, with M from gu where the group
    keeps no x rows), and a group that is not BF16 or keeps no h."""
    from mok_cute.layers.common import ExpertGroup
    from mok_cute.layers.sm90 import Sm90ExpertMLP

    bf = torch.bfloat16
    g = ExpertGroup(None, torch.tensor([0, 3, 8], dtype=torch.int32), torch.randn(8, 128).to(bf),
                    torch.randn(8, 64).to(bf))
    mlp = Sm90ExpertMLP()
    for dy, err in ((torch.randn(7, 64).to(bf), ValueError), (torch.randn(64, 8).to(bf).t(), ValueError),
                    (torch.randn(8, 64), TypeError)):
        with pytest.raises(err, match="dy must"):
            mlp.down_weight_grad(g, dy)
    for bad in (ExpertGroup(None, g.offsets, g.gu, g.h, "mxfp8"), ExpertGroup(None, g.offsets, g.gu, None)):
        with pytest.raises(ValueError, match="down_weight_grad: a BF16 group with its h"):
            mlp.down_weight_grad(bad, torch.randn(8, 64).to(bf))

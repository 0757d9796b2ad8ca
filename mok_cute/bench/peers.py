"""Peer MoE layers beside mok_cute in ``python -m mok_cute.bench --peers NAME``: SonicMoE
(Dao-AILab/sonic-moe, pip ``sonic-moe==0.1.2.post1`` on ``quack-kernels==0.6.5``; ``tools/peer_env.sh``
installs the wheels on a GPU machine). Not a dependency of mok_cute: a peer that does not import
gives a row whose ``error`` says so.

Ours first. Importing SonicMoE imports QuACK, whose ``quack.dsl`` changes CuTe DSL process-wide:
it replaces ``__getitem__`` / ``__setitem__`` / ``to`` / ``clone`` / ``contiguous`` of CuTe's tensor
classes and installs an AST rewrite of the DSL's ``if`` (quack/__init__.py, quack/dsl/). A mok_cute
kernel traced after that import could compile to something else or fail; one compiled before it
runs unchanged (a compiled kernel is not traced again). So the benchmark compiles every mok_cute
kernel the run needs (each mok row's first calls at every shape, and the ``--plot`` traced step)
before :func:`load` imports a peer, which happens only in :func:`build`.

The same layer for every system: the same x, routing (topk_idx, topk_w) and weights, no shared
expert and no SwiGLU clamp (SonicMoE has neither; with ``--peers`` every shape runs without them,
:meth:`mok_cute.bench.shapes.Shape.routed_only`, and :func:`build` refuses a shape that has one).

SonicMoE's entry: its layer ``moe_TC_softmax_topk_layer`` (and the ``MoE`` module) computes its
own routing from router weights (softmax over the top-k logits), so it cannot take ours; its
functional API's ``moe_general_routing_inputs`` takes precomputed routing as flat, token-sorted
``(router_scores [TK] fp32, token_indices [TK] int32, expert_indices [TK] int32)`` with
``w1 [2I, H, E]`` and ``w2 [H, I, E]`` (views of ``[E, 2I, H]`` / ``[E, H, I]`` storage, as its
``MoE`` module passes ``weight.permute(1, 2, 0)``), up-projection rows interleaved
``gate_0, up_0, gate_1, up_1, ...`` (its default, ``concat_layout=False``); SwiGLU, no bias.
Its forward under ``torch.no_grad()`` runs in its inference mode (no saved pre-activations), as
mok_cute's does. Its first call compiles unless QuACK's disk cache (``QUACK_CACHE_DIR``, by
default ``$TMPDIR/$USER/quack_cache``) holds the kernels from an earlier run.
"""
from __future__ import annotations

import importlib

import torch

from mok_cute.bench.run import GRAD_NAMES, Impl
from mok_cute.bench.shapes import Shape

PEERS = ("sonicmoe",)
INSTALL = "bash tools/peer_env.sh installs it on a GPU machine"


def versions() -> dict:
    """The installed versions of the peers' distributions (None: not installed), read from their
    metadata without importing them."""
    from importlib import metadata

    out = {}
    for dist in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def to_sonic(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our routed weights (w_gate / w_up [E, I, H], w_down [E, H, I]) in SonicMoE's storage:
    ``(w1 [E, 2I, H], w2 [E, H, I])``, w1 a new contiguous tensor whose rows interleave gate and up
    (row 2j = w_gate[:, j], row 2j + 1 = w_up[:, j]), w2 ``w_down`` itself (the same layout).
    :func:`sonic_views` gives what its functional API takes."""
    e, inter, h = w_gate.shape
    w1 = torch.stack([w_gate.detach(), w_up.detach()], dim=2).reshape(e, 2 * inter, h).contiguous()
    return w1, w_down


def sonic_views(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1 [2I, H, E], w2 [H, I, E])``: :func:`to_sonic`'s storage as ``moe_general_routing_inputs``
    takes it (no copy; gradients flow back to the storage)."""
    return w1.permute(1, 2, 0), w2.permute(1, 2, 0)


def from_sonic(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_sonic` (for weights and for their gradients): ``(w_gate, w_up,
    w_down)`` as strided views of ``w1`` / ``w2``."""
    return w1[:, 0::2], w1[:, 1::2], w2


def flat_routing(topk_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """SonicMoE's routing of ``topk_idx`` [T, k]: ``(kept, token_indices, expert_indices)``, the
    kept slots t * k + j (None: every slot, no -1 in ``topk_idx``, as in the benchmark's inputs) and
    their token / expert as int32, token-sorted (computed once, outside the timing)."""
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    if bool((flat >= 0).all()):
        tokens = torch.arange(t, device=flat.device, dtype=torch.int32).repeat_interleave(k)
        return None, tokens, flat.to(torch.int32).contiguous()
    kept = torch.nonzero(flat >= 0).squeeze(1)
    return kept, (kept // k).to(torch.int32), flat[kept].to(torch.int32)


def unsupported(shape: Shape) -> str:
    """Why a peer cannot run ``shape`` as mok_cute does ("" if it can)."""
    extras = [what for what, has in (("a shared expert", shape.shared_i), ("a SwiGLU clamp", shape.limit)) if has]
    if extras:
        return (f"{shape.dims} has {' and '.join(extras)}, which SonicMoE does not compute "
                "(--peers runs every shape without them)")
    return ""


def load(name: str):
    """``(module, "")`` of peer ``name`` imported now, or ``(None, why)``: an unknown name, or an
    import that failed (any exception: a missing package or one built for other versions)."""
    if name not in PEERS:
        return None, f"unknown peer {name!r}; known: {', '.join(PEERS)}"
    try:
        return importlib.import_module(name), ""
    except Exception as e:  # noqa: BLE001 (reported in its row)
        first = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return None, f"{name} is not importable ({first}); {INSTALL}"


def _refused(name: str, dy, why: str) -> Impl:
    """A row that does not run, ``why`` in its error."""
    def call(_):
        raise RuntimeError(why)

    return Impl(name, "bf16", call, [], dy, error=why)


def build(name: str, shape: Shape, inputs: dict, dy: torch.Tensor) -> Impl:
    """Peer ``name``'s row on :func:`mok_cute.bench.run.leaves`' ``inputs`` (x, topk_idx, topk_w,
    w_gate, w_up, w_down, shared) and ``dy``; imports the peer (call only once every mok row
    has compiled: the module doc). Its own w1 is converted once here; x, topk_w and w_down are the
    shared leaves. A row that cannot run carries the reason in ``error``."""
    why = unsupported(shape)
    if why:
        return _refused(name, dy, why)
    mod, why = load(name)
    if mod is None:
        return _refused(name, dy, why)
    try:
        return sonic_impl(mod, inputs, dy)
    except Exception as e:  # noqa: BLE001 (an API other than 0.1.2.post1's, reported in its row)
        return _refused(name, dy, f"{name} row not built: {type(e).__name__}: {e}".splitlines()[0][:200])


def sonic_impl(mod, i: dict, dy: torch.Tensor) -> Impl:
    """SonicMoE's row: ``mod.moe_general_routing_inputs`` (the module doc) on ``i``'s x, routing and
    weights, y [T, H] bf16; gradients mapped back by :func:`from_sonic`."""
    w1, w2 = to_sonic(i["w_gate"], i["w_up"], i["w_down"])
    w1.requires_grad_()
    kept, tokens, experts = flat_routing(i["topk_idx"])
    x, topk_w, num_experts = i["x"], i["topk_w"], w1.shape[0]
    stream = torch.cuda.current_stream().cuda_stream if x.is_cuda else 0
    swiglu = mod.enums.ActivationType.SWIGLU

    def call(_):
        scores = topk_w.view(-1) if kept is None else topk_w.view(-1)[kept]
        v1, v2 = sonic_views(w1, w2)
        y, _ = mod.moe_general_routing_inputs(x, scores, tokens, experts, v1, None, v2, None, num_experts, stream,
                                              swiglu, not torch.is_grad_enabled())
        return y

    def unpack(grads):
        dx, dtw, dw1, dw2 = grads
        return dict(zip(GRAD_NAMES, (dx, dtw, *from_sonic(dw1, dw2))))

    return Impl("sonicmoe", "bf16", call, [x, topk_w, w1, w2], dy, unpack=unpack)

"""The benchmark's named layer shapes and their random inputs.

A shape is one MoE layer on one GPU (EP = 1): T tokens, hidden size H, expert width I, E experts,
top-k routing, an optional shared expert of width I_s and an optional SwiGLU clamp. The model
shapes take each model's published layer dimensions; T is a training micro-batch's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Shape:
    """One layer shape (see the module doc); ``shared_i`` 0: no shared expert; ``limit`` None: no clamp."""

    name: str
    t: int
    h: int
    i: int
    e: int
    k: int
    shared_i: int = 0
    limit: float | None = None
    note: str = ""

    @property
    def dims(self) -> str:
        """``T4096 H7168 I2048 E16 k8 +shared2048 L7``: the shape in the docs' notation."""
        extra = (f" +shared{self.shared_i}" if self.shared_i else "") + (f" L{self.limit:g}" if self.limit else "")
        return f"T{self.t} H{self.h} I{self.i} E{self.e} k{self.k}{extra}"

    @property
    def flop_fwd(self) -> int:
        """Forward FLOPs: three GEMMs of 2 H I per routed row, and of 2 H I_s per token for the shared expert."""
        return 6 * self.h * (self.t * self.k * self.i + self.t * self.shared_i)

    def with_tokens(self, t: int) -> "Shape":
        """The same layer at ``t`` tokens."""
        return replace(self, t=t)

    def routed_only(self) -> "Shape":
        """The same layer without its shared expert and SwiGLU clamp (same name; :attr:`dims` shows it):
        what ``--peers`` runs for every system, as SonicMoE computes neither."""
        return replace(self, shared_i=0, limit=None)


SHAPES = {s.name: s for s in (
    Shape("mixtral-8x7b", 4096, 4096, 14336, 8, 2, note="Mixtral-8x7B: 8 experts, top-2"),
    Shape("qwen3-30b-a3b", 16384, 2048, 768, 128, 8, note="Qwen3-30B-A3B: 128 experts of width 768, top-8"),
    Shape("gpt-oss-20b", 8192, 2880, 2880, 32, 4, limit=7.0, note="gpt-oss-20b-like: 32 experts, top-4, clamp 7"),
    Shape("gpt-oss-120b", 8192, 2880, 2880, 128, 4, limit=7.0, note="gpt-oss-120b-like: 128 experts, top-4, clamp 7"),
    Shape("deepseek-v3-ep8", 4096, 7168, 2048, 32, 8, shared_i=2048,
          note="DeepSeek-V3 per-rank slice at EP 8: 32 of its 256 experts, top-8, one shared expert"),
    Shape("h7168", 4096, 7168, 2048, 16, 8, shared_i=2048, note="docs' H 7168 shape (DeepSeek-V3 widths, 16 experts)"),
    Shape("i1024", 8192, 4096, 1024, 32, 10, shared_i=1024, note="docs' I 1024 shape (narrow experts, top-10)"),
)}


def pick(names: list[str] | None, tokens: int | None = None) -> list[Shape]:
    """The shapes named (all if None or ["all"]), in the table's order unless named; each at
    ``tokens`` tokens if given. Raises ValueError naming an unknown shape."""
    if not names or names == ["all"]:
        names = list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    return [SHAPES[n] if tokens is None else SHAPES[n].with_tokens(tokens) for n in names]


def parse(text: str) -> Shape:
    """A named shape, or ``T,H,I,E,k`` (a shape with a shared expert of width I, as the docs' H 7168
    and I 1024 shapes have). Raises ValueError for anything else."""
    if text in SHAPES:
        return SHAPES[text]
    try:
        t, h, inter, e, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"a shape is a name ({', '.join(SHAPES)}) or T,H,I,E,k; got {text!r}") from None
    return Shape(f"T{t}H{h}I{inter}E{e}k{k}", t, h, inter, e, k, shared_i=inter)


def make_inputs(shape: Shape, device, seed: int = 0, local_experts: int | None = None) -> tuple[dict, torch.Tensor]:
    """``(inputs, dy)``: the layer's inputs as keyword arguments of ``mok_cute.moe`` (x [T, H] bf16,
    topk_idx [T, k] int32, topk_w [T, k] fp32, w_gate / w_up [E, I, H], w_down [E, H, I] bf16, shared
    None or its three bf16 weights) and a bf16 output gradient dy [T, H]. Logits N(0, 1), top-k, softmax
    over the k values; weights N(0, 1) * fan_in^-0.5. The same ``seed`` and device give the same
    tensors in every run (so outputs of two commits can be compared bitwise). ``local_experts``: the
    weights of that many experts (one rank's at EP > 1, the routing still over all E); None: all E."""
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*size):
        return (torch.randn(*size, device=device, generator=g) * size[-1] ** -0.5).to(torch.bfloat16)

    s = shape
    x = torch.randn(s.t, s.h, device=device, generator=g).to(torch.bfloat16)
    vals, idx = torch.randn(s.t, s.e, device=device, generator=g).topk(s.k, dim=1)
    el = s.e if local_experts is None else local_experts
    inputs = dict(x=x, topk_idx=idx.to(torch.int32), topk_w=vals.softmax(dim=1), w_gate=w(el, s.i, s.h),
                  w_up=w(el, s.i, s.h), w_down=w(el, s.h, s.i),
                  shared=(w(s.shared_i, s.h), w(s.shared_i, s.h), w(s.h, s.shared_i)) if s.shared_i else None)
    dy = torch.randn(s.t, s.h, device=device, generator=g).to(torch.bfloat16)
    return inputs, dy


def add_size_args(ap, experts: str, tokens: str, shape: str) -> None:
    """The layer-size options that the tuner's and the precompiler's command lines share on ``ap`` (an
    ``argparse`` parser): --hidden, --inter, --experts, --topk, --tokens, --shared and --shape NAME..., with
    ``experts``, ``tokens`` and ``shape`` the help texts that differ between them."""
    ap.add_argument("--hidden", type=int, help="H, the model's hidden size")
    ap.add_argument("--inter", type=int, help="I, each routed expert's width")
    ap.add_argument("--experts", type=int, help=experts)
    ap.add_argument("--topk", type=int, help="k, experts per token")
    ap.add_argument("--tokens", type=int, help=tokens)
    ap.add_argument("--shared", type=int, default=0, metavar="I_S", help="the shared expert's width (default 0: none)")
    ap.add_argument("--shape", nargs="+", metavar="NAME", default=None,
                    help=f"instead of the sizes: named shapes (python -m mok_cute.bench --list-shapes), {shape}")


@dataclass(frozen=True)
class LayerSize:
    """The sizes of one layer call that the tuner's and the precompiler's problems share: T ``tokens`` per rank,
    H ``hidden``, I ``inter``, E ``experts``, top-``topk``, the shared expert's width ``shared`` (0: none) and
    the expert-parallel size ``ep``; ValueError for a size no layer call takes."""

    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    shared: int = 0
    ep: int = 1

    def __post_init__(self):
        for name in ("tokens", "hidden", "inter", "experts", "topk", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.shared, bool) or not isinstance(self.shared, int) or self.shared < 0:
            raise ValueError(f"shared must be an int >= 0 (0: no shared expert), got {self.shared!r}")
        if self.topk > self.experts:
            raise ValueError(f"topk = {self.topk} must be at most experts = {self.experts}")

"""PTX manifest: compile every kernel variant of mok_cute on the CPU and write
``{variant: sha256(ptx)}`` as JSON, so that a refactor can be checked to leave every
kernel's PTX byte-identical (run before and after, then ``--compare``).

    python tools/ptx_manifest.py /tmp/ptx_before.json [--only PREFIX ...]
    python tools/ptx_manifest.py --compare /tmp/ptx_before.json /tmp/ptx_after.json

Variant names are ``<family>/<variant>@<arch>``. The PTX is the compile report's
(``compile_kernel(..., inspect=True)``); nothing is launched, no GPU is needed.

Each variant gets three hashes: ``raw`` (the PTX bytes), ``entry`` (the PTX with each
kernel entry symbol replaced by ``kernel_<i>``, in order of first appearance) and ``names`` (that,
with the virtual registers of each class and the basic-block labels renumbered in order of first
appearance: the same instructions on the same operands, named apart). The DSL
names a kernel that is a method after its object's repr, i.e. the defining module's dotted
path (dots dropped) and class, truncated to a fixed length, so moving a kernel class to
another module changes its symbol and nothing else; ``entry`` is what a pure move keeps.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time

_ENTRY = re.compile(r"^\.(?:visible )?\.entry (\w+)\(", re.M)
_NAME = re.compile(r"%(rd|rs|r|p|fd|f|hh|h)\d+\b|\$L__BB\d+_\d+")


def _ptx(result) -> str:
    """The PTX of a ``(compiled, CompileReport)`` pair."""
    rep = result[1]
    if rep is None or not rep.ptx:
        raise RuntimeError("compile returned no PTX (inspect=False?)")
    return rep.ptx


def entry_normalized(ptx: str) -> str:
    """``ptx`` with every kernel entry symbol replaced by ``kernel_<i>`` (see the module doc)."""
    for i, name in enumerate(dict.fromkeys(_ENTRY.findall(ptx))):
        ptx = ptx.replace(name, f"kernel_{i}")  # also the parameters, ``<name>_param_<j>``
    return ptx


def names_normalized(ptx: str) -> str:
    """:func:`entry_normalized` ``ptx`` with virtual registers (``%r12``: per class) and basic-block labels
    (``$L__BB0_3``) renumbered in order of first appearance (see the module doc)."""
    seen: dict[str, str] = {}
    count: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        key = m.group(0)
        if key not in seen:
            prefix = f"%{m.group(1)}" if m.group(1) else "$L"
            seen[key] = f"{prefix}{count.get(prefix, 0)}"
            count[prefix] = count.get(prefix, 0) + 1
        return seen[key]
    return _NAME.sub(rename, entry_normalized(ptx))


def _sm90_bf16():
    from mok_cute.kernels.sm90.expert_bwd import compile_grouped_wgrad
    from mok_cute.kernels.sm90.grouped_gemm import compile_grouped_gemm
    from mok_cute.kernels.sm90.mainloop import MN_MAJOR, MainloopConfig

    # ``plain`` / ``swiglu`` / wgrad store through TMA, the one path since the 2026-11-29 measurement; the "-tma"
    # names are those of the manifest before the row-masked arm was deleted (the same PTX)
    n128 = MainloopConfig(tile_n=128)
    g = compile_grouped_gemm
    out = {
        "dswiglu": lambda: g("dswiglu", b_major=MN_MAJOR, inspect=True),
        "dswiglu-clamp": lambda: g("dswiglu", clamp=True, b_major=MN_MAJOR, inspect=True),
        "plain-n256-tma": lambda: g("plain", inspect=True),
        "plain-n128-tma": lambda: g("plain", cfg=n128, inspect=True),
        "dgrad1-tma": lambda: g("plain", b_major=MN_MAJOR, split_b=True, inspect=True),
        "wgrad-tma": lambda: compile_grouped_wgrad(inspect=True),
        "swiglu-tma": lambda: g("swiglu", inspect=True),
        "swiglu-clamp-n128-tma": lambda: g("swiglu", clamp=True, cfg=n128, inspect=True),
        "swiglu-mx-tma": lambda: g("swiglu", clamp=True, mx_h=True, inspect=True),
        "swiglu-helpers-tma": lambda: g("swiglu", helpers=True, inspect=True),
    }
    return {f"sm90-bf16/{k}@sm_90a": v for k, v in out.items()}


def _sm90_fp8():
    from mok_cute.kernels.sm90 import fp8_gemm as g
    from mok_cute.kernels.sm90 import fp8_scaled as s

    out = {
        "block-plain": lambda: g.compile_fp8_block_gemm(inspect=True),
        "block-plain-serial": lambda: g.compile_fp8_block_gemm(g.Fp8MainloopConfig(overlap_promotion=False),
                                                               inspect=True),
        "block-wgrad-tma": lambda: s.compile_fp8_block_wgrad(s.DEFAULT_WGRAD_CONFIG, inspect=True),
    }
    for epi in ("swiglu", "dswiglu"):
        for clamp in (False, True):
            out[f"block-{epi}-clamp{int(clamp)}"] = (
                lambda e=epi, c=clamp: g.compile_fp8_block_gemm(inspect=True, epilogue=e, clamp=c))
    return {f"sm90-fp8/{k}@sm_90a": v for k, v in out.items()}


def _sm100():
    from mok_cute.kernels.sm100 import fused_bwd, fused_moe, grouped_gemm as g

    variants = {**g.variants(), **fused_moe.variants(), **fused_bwd.variants()}
    return {f"sm100/{name}@{arch}": (lambda b=build, a=arch: b(a, inspect=True))
            for name, (build, _) in variants.items() for arch in g.ARCHS}


def _quant():
    import torch

    from mok_cute.dsl.compile import ARCHS
    from mok_cute.kernels import route_grad, row_sums
    from mok_cute.kernels.quant import dequant_mxfp8 as dq
    from mok_cute.kernels.quant import quantize as q
    from mok_cute.kernels.quant import quantize_fp8 as qf

    def dt(d):
        return str(d).removeprefix("torch.")

    out = {}
    for kind in q.KINDS:
        for arch in ARCHS:
            for d in q.DTYPES if kind != "row_pitched_rt" else (torch.bfloat16,):  # the round trip: bf16 only
                out[f"quantize/{kind}-{dt(d)}@{arch}"] = lambda k=kind, a=arch, d=d: q.compiled_quantize(k, a, d)
    cases = ([("row", "fp8_block")] + [("tokens", f) for f in qf.FORMATS])
    for kind, fmt in cases:
        for arch in ("sm_90a", "sm_100a"):
            for d in qf.DTYPES:
                out[f"quantize_fp8/{kind}-{fmt}-{dt(d)}@{arch}"] = (
                    lambda k=kind, f=fmt, a=arch, d=d: qf.compiled_quantize_fp8(k, f, a, d))
    for layout in dq.LAYOUTS:
        for arch in ("sm_90a", "sm_100a"):
            for count in (False, True):
                out[f"dequant/{layout}-{'count' if count else 'plain'}@{arch}"] = (
                    lambda lo=layout, a=arch, c=count: dq.compiled_dequant(lo, a, c))
    for arch in ARCHS:  # the expert biases' gradients (mok_cute.kernels.row_sums)
        out[f"row_sums/row_sums@{arch}"] = lambda a=arch: row_sums.compiled_row_sums(a)
    for arch in ARCHS:
        out[f"route_grad/route_grad@{arch}"] = lambda a=arch: route_grad.compiled_route_grad(a)
        out[f"route_grad/route_grad-by-route@{arch}"] = lambda a=arch: route_grad.compiled_route_grad(a, True)
        if arch == "sm_90a":  # the MXFP8 prologue's two passes (route_grad_row.mx_round_trips: SM90's MXFP8 step)
            for xpass, by_route in ((0, False), (0, True), (1, False)):
                out[f"route_grad/mx-pass{xpass}{'-by-route' if by_route else ''}@{arch}"] = (
                    lambda a=arch, p=xpass, b=by_route: route_grad.compiled_mx_rows(a, p, b))
    from mok_cute.kernels.sm90 import fused_moe as fm

    # the fused forward: EP = 1 gathers by the comm CTAs, then the background warps (the one gather since the
    # 2026-12-02 measurements); helpers: BF16 from H 2048 (its background warp by cp.async.bulk, hence the
    # "-helpers-bg-bulk" name), MXFP8 from H 7168; EP > 1 through registers
    for clamp in (False, True):
        for shared in (False, True):
            tag = f"sm90/fused-fwd-{'clamp' if clamp else 'noclamp'}-{'shared' if shared else 'routed'}"
            for trace in (False, True):
                out[f"{tag}{'-trace' if trace else ''}@sm_90a"] = (
                    lambda c=clamp, sh=shared, tr=trace: fm.compile_fused_forward(c, sh, trace=tr, inspect=True))
            kinds = {"mxfp8": dict(mx=True), "ep": dict(ep=True), "mxfp8-ep": dict(mx=True, ep=True),
                     "helpers-bg-bulk": dict(helpers=True), "mxfp8-helpers": dict(mx=True, helpers=True)}
            for kind, kw in kinds.items():
                out[f"{tag}-{kind}@sm_90a"] = (
                    lambda c=clamp, sh=shared, kw=kw: fm.compile_fused_forward(c, sh, inspect=True, **kw))
            if shared:
                out[f"{tag}-gate@sm_90a"] = lambda c=clamp: fm.compile_fused_forward(c, True, gate=True, inspect=True)
    from mok_cute.kernels.sm90 import fused_bwd as fb

    def bwd(*flags, **named):
        return lambda: fb.compile_fused_backward_core(fb.BwdVariant(*flags, **named), inspect=True)

    for clamp in (False, True):
        c = 'clamp' if clamp else 'noclamp'
        out[f"sm90/fused-bwd-core-{c}@sm_90a"] = bwd(clamp)
        out[f"sm90/fused-bwd-tokens-{c}-init@sm_90a"] = bwd(clamp, True, True)
        out[f"sm90/fused-bwd-gather-{c}-init-by-route@sm_90a"] = bwd(clamp, True, True, True, True)
        out[f"sm90/fused-bwd-whole-{c}@sm_90a"] = bwd(clamp, True, True, True, True, True)
        out[f"sm90/fused-bwd-whole-{c}-main-grads@sm_90a"] = bwd(clamp, True, True, True, True, True, True)
        out[f"sm90/fused-bwd-tokens-{c}-init-mxfp8-grouped-slots@sm_90a"] = bwd(clamp, True, True, mx=True,
                                                                               grouped_slots=True)
        out[f"sm90/fused-bwd-tokens-{c}-init-mxfp8-wd-first@sm_90a"] = bwd(clamp, True, True, mx=True,
                                                                          grouped_slots=True, wd_first=True)
        out[f"sm90/fused-bwd-tokens-{c}-init-add@sm_90a"] = bwd(clamp, True, True, add=True)
        out[f"sm90/fused-bwd-whole-{c}-ep@sm_90a"] = bwd(clamp, True, True, True, False, True, ep=True)
        out[f"sm90/fused-bwd-gather-{c}-init-mxfp8@sm_90a"] = bwd(clamp, True, True, True, mx=True)
        out[f"sm90/fused-bwd-gather-{c}-init-mxfp8-ep@sm_90a"] = bwd(clamp, True, True, True, mx=True, ep=True)
        out[f"sm90/fused-bwd-whole-{c}-trace@sm_90a"] = bwd(clamp, True, True, True, True, True, trace=True)
    from mok_cute.schedule import local_plan as lp

    for arch in ("sm_90a", "sm_100a"):
        for kind in ("i32", "i64"):
            out[f"schedule/local-plan-{kind}@{arch}"] = lambda a=arch, k=kind: lp.compile_local_plan(a, 64, k, inspect=True)
    return out


def _comm():
    from cutlass import Int32, Int64

    from mok_cute.comm import protocol as P
    from mok_cute.comm import combine as c
    from mok_cute.comm import dispatch as d
    from mok_cute.comm.planner import compile_plan
    from mok_cute.dsl.host import fake_ptr, fake_stream
    from mok_cute.dsl.compile import compile_kernel

    out = {}
    for arch in ("sm_90a", "sm_100a"):
        # "u8": the pull moves 8 vectors per thread per trip (comm.rows.UNROLL)
        out[f"comm/pull-u8@{arch}"] = lambda a=arch: d.compile_pull(a, inspect=True)
        out[f"comm/pull_w@{arch}"] = lambda a=arch: d.compile_pull_w(a, inspect=True)
        out[f"comm/pull_bulk@{arch}"] = lambda a=arch: d.compile_pull_bulk(a, inspect=True)
        out[f"comm/wait@{arch}"] = lambda a=arch: compile_kernel(
            P.wait_flags_host, Int64(0), Int32(0), Int32(1), Int32(0), Int64(0), fake_ptr("i32"), fake_stream(),
            arch=a, inspect=True)
        for E in (8, 384):  # the device planner (comm.planner; "schedule/plan-E*" before it moved)
            out[f"comm/plan-E{E}@{arch}"] = lambda a=arch, e=E: compile_plan(a, e, inspect=True)
        for has_w in (False, True):
            for has_s in (False, True):
                tag = f"w{int(has_w)}s{int(has_s)}"
                out[f"comm/push_reduce-{tag}-u8@{arch}"] = (
                    lambda a=arch, w=has_w, s=has_s: c.compile_push_reduce(a, w, s, inspect=True))
                out[f"comm/push_reduce_bulk-{tag}@{arch}"] = (
                    lambda a=arch, w=has_w, s=has_s: c.compile_push_reduce_bulk(a, w, s, inspect=True))
    return out


def _sm90_policy():
    """SM90 kernels at non-default KernelPolicy tiles (mok_cute.layers.tiles): tile_n 128 (as many stages as fit)
    and 2 stages at tile_n 256, on the fused kernels' fullest variants and the unfused dSwiGLU."""
    from mok_cute.kernels.sm90 import fused_bwd as fb
    from mok_cute.kernels.sm90 import fused_moe as fm
    from mok_cute.kernels.sm90.grouped_gemm import compile_grouped_gemm
    from mok_cute.kernels.sm90.mainloop import MN_MAJOR, MainloopConfig

    out = {}
    for tile_n, stages in ((128, 0), (256, 2)):
        cfg, tag = MainloopConfig(tile_n=tile_n, stages=stages), f"n{tile_n}-s{stages}"
        out[f"sm90/fused-fwd-clamp-shared-{tag}@sm_90a"] = (
            lambda c=cfg: fm.compile_fused_forward(True, True, cfg=c, inspect=True))
        out[f"sm90/fused-fwd-clamp-shared-mxfp8-{tag}@sm_90a"] = (
            lambda c=cfg: fm.compile_fused_forward(True, True, mx=True, cfg=c, inspect=True))
        out[f"sm90/fused-bwd-whole-clamp-{tag}@sm_90a"] = lambda c=cfg: fb.compile_fused_backward_core(
            fb.BwdVariant(True, True, True, True, True, True), cfg=c, inspect=True)
        out[f"sm90-bf16/dswiglu-clamp-{tag}@sm_90a"] = lambda c=cfg: compile_grouped_gemm(
            "dswiglu", clamp=True, b_major=MN_MAJOR, cfg=c, inspect=True)
    return out


FAMILIES = (_sm90_bf16, _sm90_fp8, _sm100, _quant, _comm, _sm90_policy)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def manifest(only=()) -> dict[str, dict[str, str]]:
    """``{variant: {"raw": sha256, "entry": sha256 of entry_normalized, "names": of names_normalized}}`` of every
    variant's PTX (or of those whose name starts with one of ``only``)."""
    out = {}
    for family in FAMILIES:
        for name, build in family().items():
            if only and not name.startswith(tuple(only)):
                continue
            t = time.time()
            ptx = _ptx(build())
            out[name] = {"raw": _sha(ptx), "entry": _sha(entry_normalized(ptx)), "names": _sha(names_normalized(ptx))}
            print(f"{name}: {out[name]['raw'][:16]} ({time.time() - t:.1f} s)", file=sys.stderr, flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    """Print differing, missing and new variants; 0 if every common variant's PTX is identical
    up to its entry symbols (how many are byte-identical, and how many of the others the same but for their
    register and label names, is printed too)."""
    common = sorted(before.keys() & after.keys())
    diff = [k for k in common if before[k]["entry"] != after[k]["entry"]]
    renamed = [k for k in common if before[k]["raw"] != after[k]["raw"] and k not in diff]
    names = [k for k in diff if "names" in before[k] and before[k]["names"] == after[k].get("names")]
    for k in diff:
        print(f"{'SAME BUT FOR NAMES' if k in names else 'DIFFERS'} {k}")
    for k in sorted(before.keys() - after.keys()):
        print(f"only before {k}")
    for k in sorted(after.keys() - before.keys()):
        print(f"only after {k}")
    print(f"{len(common)} variants compared: {len(common) - len(diff) - len(renamed)} byte-identical, "
          f"{len(renamed)} identical but for the kernel entry symbol, {len(diff)} differ ({len(names)} of them only "
          f"in their register and label names)")
    return 1 if diff else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="JSON file to write")
    ap.add_argument("--only", nargs="*", default=(), help="variant name prefixes")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        return compare(a, b)
    if not args.out:
        ap.error("give an output file or --compare")
    result = manifest(args.only)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{len(result)} variants -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

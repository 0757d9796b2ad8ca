"""Compare the layer of two source trees on one GPU, in one process: outputs bitwise, speed side by side.

A refactor that claims "same results, same speed" is checked by running the layer of the base
commit and of the working tree on the same inputs, interleaved, on the same warm GPU:

    python -m tools.compare_trees --prepare d61d162 .baseline   # here (needs git): a renamed copy
    python -m tools.compare_trees --base .baseline [--shapes qwen3 h7168] [--precision bf16 mxfp8]

``--prepare`` exports the base commit's ``mok_cute`` package as ``mok_cute_base`` (every
occurrence of the package name rewritten, custom-op namespace included), so that both import
side by side. The comparison uses only the public API both trees share (``moe``, ``MoKConfig``
with default fields but ``validate_routing=False``: no host sync per call, since 2026-12-07; before, the
routing check's sync was in every timed call): y, dx, d topk_w and every weight gradient of one forward + backward must
be ``torch.equal``; then forward and forward + backward are timed with CUDA events in interleaved
rounds (median of each round's mean) and the ratio ``base / tree`` printed (> 1: the tree is faster),
with each tree's peak memory of one forward + backward (gradients included).
Exit status 1 if any output differs.

``--host``: also the host time per call of the layer's main functions in each tree (one forward
per call, the GPU idle when it starts: :data:`HOST_TARGETS`), to find where an eager call's time
goes when the routing check's sync puts the host on the critical path.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# name: (T, H, I, E, k, I_s or 0, swiglu_limit or None)
SHAPES = {
    "qwen3": (16384, 2048, 768, 128, 8, 0, None),
    "gptoss": (8192, 2880, 2880, 32, 4, 0, 7.0),
    "gptoss120": (8192, 2880, 2880, 128, 4, 0, 7.0),
    "h7168": (4096, 7168, 2048, 16, 8, 2048, None),
    "i1024": (8192, 4096, 1024, 32, 10, 1024, 4.0),
    "mixtral": (4096, 4096, 14336, 8, 2, 0, None),
}


def prepare(commit: str, out: Path) -> None:
    """Export ``commit``'s mok_cute package into ``out/mok_cute_base`` with the name rewritten."""
    data = subprocess.run(["git", "archive", commit, "mok_cute"], check=True, capture_output=True).stdout
    dest = out / "mok_cute_base"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            path = dest / Path(member.name).relative_to("mok_cute")
            path.parent.mkdir(parents=True, exist_ok=True)
            text = tar.extractfile(member).read().decode()
            path.write_text(text.replace("mok_cute", "mok_cute_base"))
    print(f"wrote {dest} from {commit}")


def load_base(base_dir: Path):
    """Import ``base_dir/mok_cute_base`` (made by :func:`prepare`) as the package ``mok_cute_base``."""
    init = base_dir / "mok_cute_base" / "__init__.py"
    spec = importlib.util.spec_from_file_location("mok_cute_base", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mok_cute_base"] = module
    spec.loader.exec_module(module)
    return module


def make_inputs(shape, seed: int = 0):
    """Routing, weights and x of one shape on the GPU (logits ~ N(0,1), softmax over the top k)."""
    import torch

    t, h, i, e, k, i_s, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(*size):
        return (torch.randn(*size, device="cuda", generator=g) * size[-1] ** -0.5).to(torch.bfloat16)

    logits = torch.randn(t, e, device="cuda", generator=g)
    top, idx = logits.topk(k, dim=1)
    inputs = dict(x=torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16), topk_idx=idx.to(torch.int32),
                  topk_w=top.softmax(dim=1), w_gate=w(e, i, h), w_up=w(e, i, h), w_down=w(e, h, i))
    shared = (w(i_s, h), w(i_s, h), w(h, i_s)) if i_s else None
    dy = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    return inputs, shared, dy


def _step(pkg, inputs, shared, dy, limit, precision, backward: bool = True, fields: dict | None = None):
    """One forward (+ backward) of ``pkg.moe`` (``fields``: further ``MoKConfig`` fields; ``validate_routing``
    off unless they set it: no host sync per call, as the benchmark times the layer); returns y and the
    gradients (leaves' .grad)."""
    leaves = {n: v.detach().requires_grad_(v.is_floating_point()) for n, v in inputs.items()}
    sh = None if shared is None else tuple(s.detach().requires_grad_() for s in shared)
    cfg = pkg.MoKConfig(precision=precision, **{"validate_routing": False, **(fields or {})})
    y = pkg.moe(**leaves, shared=sh, swiglu_limit=limit, config=cfg)
    if not backward:
        return [y]
    y.backward(dy)
    grads = [v.grad for v in leaves.values() if v.requires_grad] + ([] if sh is None else [s.grad for s in sh])
    return [y, *grads]


def peak_mib(fn) -> float:
    """MiB one call of ``fn`` allocates at its peak above what was allocated before it (what it returns, the
    gradients, included), after a warm call."""
    import torch

    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2 ** 20


def time_rounds(fns: dict, rounds: int, iters: int) -> dict:
    """Median over ``rounds`` of each fn's mean ms over ``iters`` calls, the fns interleaved per round,
    their order reversed every other round (A B B A ...: what runs before a call, and the allocator
    and clock state it leaves, falls on both trees alike)."""
    from mok_cute.bench.run import events_ms

    out = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            out[name].append(events_ms(fns[name], iters))
    return {name: statistics.median(v) for name, v in out.items()}


# (module under the package, function or Class.method): the host path of one EP = 1 forward
HOST_TARGETS = (("ops", "moe"), ("validate", "check_moe_inputs"), ("custom_ops", "run_forward"),
                ("layers.grouped", "GroupedExpertBackend.forward"), ("layers.grouped", "routing_plan"),
                ("layers.grouped", "GroupedExpertBackend._fused_forward"),
                ("layers.sm90", "Sm90ExpertMLP.fused_forward"), ("kernels.sm90.fused_moe", "fused_forward"),
                ("kernels.sm90.fused_moe", "watch_status"))


@contextlib.contextmanager
def host_timers(pkg, targets=HOST_TARGETS):
    """Within the block, each of ``targets`` present in ``pkg`` (a package module) adds its wall
    seconds per call to the yielded dict under ``"module.name"``; the originals come back after."""
    acc, undo = {}, []
    for mod, name in targets:
        try:
            owner = importlib.import_module(f"{pkg.__name__}.{mod}")
        except ImportError:
            continue
        *cls, attr = name.split(".")
        owner = getattr(owner, cls[0], None) if cls else owner
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue

        def timed(*a, _fn=fn, _key=f"{mod}.{name}", **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_key] = acc.get(_key, 0.0) + time.perf_counter() - t0

        wrapped = functools.wraps(fn)(timed)
        holders = [(owner, attr)] if cls else _holders(pkg, fn)  # a function: every module's name for it
        for holder, held in holders:
            setattr(holder, held, wrapped)
            undo.append((holder, held, fn))
    try:
        yield acc
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)


def _holders(pkg, fn) -> list:
    """``(module, name)`` of every module of ``pkg`` (itself included) whose attribute ``name`` is ``fn``
    (``from .ops import moe`` binds the same function in another module)."""
    mods = [m for n, m in list(sys.modules.items()) if m is not None and (n == pkg.__name__
                                                                          or n.startswith(pkg.__name__ + "."))]
    return [(m, n) for m in mods for n, v in list(vars(m).items()) if v is fn]


def host_table(fns: dict, calls: int, sync) -> list[str]:
    """Markdown rows: per :data:`HOST_TARGETS` entry, the host us per call of each ``fns`` entry
    (label -> (package, one call)), ``sync()`` before each call so the GPU is idle when it starts."""
    per = {}
    for label, (pkg, fn) in fns.items():
        with host_timers(pkg) as acc:
            for _ in range(calls):
                sync()
                fn()
            sync()
        per[label] = {k: v / calls * 1e6 for k, v in acc.items()}
    labels = list(fns)
    rows = [f"| function | {' | '.join(f'{x} us' for x in labels)} |", "|---|" + "---|" * len(labels)]
    for mod, name in HOST_TARGETS:
        key = f"{mod}.{name}"
        rows.append(f"| {key} | " + " | ".join("-" if key not in per[x] else f"{per[x][key]:.1f}" for x in labels)
                    + " |")
    return rows


def compare(base_dir: Path, shapes, precisions, rounds: int, iters: int, host: bool = False,
            fields: dict | None = None) -> int:
    """Both trees' layer on each shape and precision (``fields``: further ``MoKConfig`` fields of every call):
    outputs compared bitwise, then timed side by side; 1 if any output differs."""
    import torch

    step = functools.partial(_step, fields=fields)
    base, tree = load_base(base_dir), importlib.import_module("mok_cute")
    rows, bad = [], 0
    for name in shapes:
        shape = SHAPES[name]
        inputs, shared, dy = make_inputs(shape)
        for prec in precisions:
            outs = [step(pkg, inputs, shared, dy, shape[6], prec) for pkg in (base, tree)]
            same = all(torch.equal(a, b) for a, b in zip(*outs))
            bad += not same
            fns = {}
            for label, pkg in (("base", base), ("tree", tree)):
                fns[f"{label} fwd"] = lambda p=pkg: step(p, inputs, shared, dy, shape[6], prec, backward=False)
                fns[f"{label} fwdbwd"] = lambda p=pkg: step(p, inputs, shared, dy, shape[6], prec)
            del outs
            ms = time_rounds(fns, rounds, iters)
            mib = [peak_mib(fns[f"{label} fwdbwd"]) for label in ("base", "tree")]
            rows.append((name, prec, "bitwise" if same else "DIFFERS", ms["base fwd"], ms["tree fwd"],
                         ms["base fwdbwd"], ms["tree fwdbwd"], *mib))
            print(rows[-1], flush=True)
            if host:
                fwd = {label: (pkg, lambda p=pkg: step(p, inputs, shared, dy, shape[6], prec, backward=False))
                       for label, pkg in (("base", base), ("tree", tree))}
                print(f"host time of one forward, {name} {prec}:", *host_table(fwd, 20, torch.cuda.synchronize),
                      sep="\n", flush=True)
    print(f"\n{torch.cuda.get_device_name()}; base / tree > 1: the tree is faster")
    print("| shape | precision | outputs | fwd ms base | fwd ms tree | base/tree | fwd+bwd ms base | fwd+bwd ms tree |"
          " base/tree | peak MiB base | peak MiB tree |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, p, s, bf, tf, bb, tb, mb, mt in rows:
        print(f"| {n} | {p} | {s} | {bf:.3f} | {tf:.3f} | {bf / tf:.3f} | {bb:.3f} | {tb:.3f} | {bb / tb:.3f} "
              f"| {mb:.0f} | {mt:.0f} |")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", nargs=2, metavar=("COMMIT", "DIR"), help="export COMMIT's package into DIR")
    ap.add_argument("--base", type=Path, help="DIR made by --prepare")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--precision", nargs="+", default=["bf16", "mxfp8"], choices=["bf16", "mxfp8", "fp8_block"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--host", action="store_true", help="also the host time per call of the layer's main functions")
    ap.add_argument("--untuned", action="store_true",
                    help="both trees at their built-in defaults (MoKConfig(tuned=False): no tuning-file entry)")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare[0], Path(args.prepare[1]))
        return 0
    if args.base is None:
        ap.error("--base DIR (or --prepare COMMIT DIR)")
    return compare(args.base, args.shapes, args.precision, args.rounds, args.iters, args.host,
                   {"tuned": False} if args.untuned else None)


if __name__ == "__main__":
    sys.exit(main())

"""An offline Hugging Face transformers bundle for the GPU node (which has torch but no transformers
and no package index), built from the packages installed here:

    python -m tools.hf_bundle                 # writes .hfnode/ (ignored by git), fails over 8 MiB
    python -m tools.hf_bundle --check         # ... then proves it self-sufficient (below)

and on the node, after the CuTe DSL bundle:

    source .gpu-node/activate.sh && source .hfnode/activate.sh && python3 examples/hf_finetune.py ...

``.hfnode/`` holds ``hf-site.tar.xz`` (a site-packages tree), ``activate.sh`` and ``MANIFEST.txt``.
The tree has transformers with its core and only the model folders of ``--models`` (by default the
families the integration and tests/integrations run, plus the folders their modules import:
``auto`` and its own imports), and the distributions transformers imports whenever a model is built
or trained (found by importing them in a clean interpreter): huggingface_hub and its HTTP stack,
tqdm, packaging, filelock, pyyaml (its pure-Python loader; the C extension is dropped), regex,
safetensors and tokenizers. Each comes with a short ``.dist-info`` (transformers checks their
versions at import). Not bundled, because the node's torch environment has them: torch, numpy
(transformers imports it; ``activate.sh`` warns when it is missing), typing_extensions.

Compiled extensions: safetensors' and tokenizers' are abi3 (any CPython >= 3.10 on x86-64 Linux)
and go in stripped; regex's is built per CPython version, so the bundle holds this interpreter's
and one per ``--python-tags`` (default 312, the node's CPython 3.12), the latter taken from that
version's wheel (``pip download`` into ``--wheel-dir``, or a wheel already there). Extensions
cannot be imported from a zip, hence a tarball that ``activate.sh`` unpacks once per node into
``$MOK_HF_SITE`` (default /tmp/mok-hf/site-packages; unpacked again when the bundle changes) and
prepends to PYTHONPATH, so the bundle's copies take precedence over the node's own. It also sets
HF_HUB_OFFLINE=1 unless set: the node reaches no hub.

``--check`` builds a throwaway venv of this interpreter's base (no site-packages) that sees only
the standard library, torch with its own dependencies and numpy (symlinked from here) and the
repository; sources ``activate.sh`` into a temporary ``MOK_HF_SITE``, then builds and trains one
step of a tiny model of each family on transformers' "eager" and "grouped_mm" experts and on
"mok_cute" (its CPU reference backend), and fails if any module came from outside that list.
``--check-tests`` then runs ``pytest tests/integrations`` in that venv (pytest, pytest-xdist and
the CuTe DSL symlinked in from here). ``--check-python PY`` (a CPython 3.12 with typing_extensions
and numpy, as the node has, and no torch or transformers) byte-compiles every bundled source with
PY and imports the bundled distributions and ``transformers.AutoConfig`` there. ``--keep-check``
keeps the venv.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# distribution -> why it is in the bundle
DISTRIBUTIONS = {
    "transformers": "the library",
    "huggingface_hub": "transformers imports it at import",
    "httpx2": "huggingface_hub imports it at import",
    "httpcore2": "httpx2 imports it at import",
    "h11": "httpcore2 imports it at import",
    "idna": "httpx2 imports it at import",
    "truststore": "httpcore2 imports it at import",
    "tqdm": "transformers' logging imports it at import",
    "packaging": "transformers.utils imports it at import",
    "filelock": "huggingface_hub imports it at import",
    "pyyaml": "huggingface_hub imports it at import (its pure-Python loader)",
    "regex": "transformers.utils.auto_docstring imports it at import",
    "safetensors": "transformers.modeling_utils imports it at import",
    "tokenizers": "transformers.generation imports tokenizers.decoders at import",
}
# distributions whose compiled extensions stay out: the package has a pure-Python fallback
PURE_FALLBACK = {"pyyaml"}
# the model folders of the families mok_cute.integrations.transformers covers (tests/integrations)
MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss", "aria")
# what --check leaves visible besides the bundle: the node's torch environment, as import names
NODE_PACKAGES = ("torch", "torchgen", "functorch", "numpy", "typing_extensions", "sympy", "mpmath", "networkx",
                 "jinja2", "markupsafe", "fsspec", "setuptools", "_distutils_hack", "pkg_resources")
# what --check-tests adds: pytest, pytest-xdist, and the CuTe DSL that tests/conftest.py imports
# (the node has it from .gpu-node/), as import / distribution name stems
TEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "pygments", "py", "xdist", "pytest_xdist", "execnet",
                 "nvidia_cutlass_dsl", "cuda", "cuda_bindings", "cuda_core", "cuda_pathfinder", "cuda_python")
SKIP_DIRS = {"__pycache__", "tests", "test"}
SKIP_SUFFIXES = (".pyc", ".pyi")
MIB = 1 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".hfnode", help="the bundle folder (default: .hfnode)")
    p.add_argument("--models", default=",".join(MODELS),
                   help="transformers model folders to keep, comma-separated (their imports are added)")
    p.add_argument("--python-tags", default="312",
                   help="CPython versions (e.g. 312,313) whose regex extension to add besides this one's")
    p.add_argument("--wheel-dir", type=Path, default=Path(tempfile.gettempdir()) / "mok-hf-wheels",
                   help="where the wheels for --python-tags are, or are downloaded to")
    p.add_argument("--max-mib", type=float, default=8.0, help="fail when the bundle is larger (default 8)")
    p.add_argument("--check", action="store_true", help="prove the bundle self-sufficient (see above)")
    p.add_argument("--check-python", help="another interpreter (e.g. a CPython 3.12 with typing_extensions and "
                   "numpy, no transformers) to import the bundle with")
    p.add_argument("--check-tests", action="store_true",
                   help="with --check: also run tests/integrations there (pytest and xdist symlinked from here)")
    p.add_argument("--keep-check", action="store_true", help="keep --check's venv and unpacked bundle")
    a = p.parse_args(argv)

    tags = sorted({t.strip() for t in a.python_tags.split(",") if t.strip()} - {_local_tag()})
    with tempfile.TemporaryDirectory(prefix="hf-bundle-") as tmp:
        site = Path(tmp) / "site-packages"
        models = collect(site, [m for m in a.models.split(",") if m], tags, a.wheel_dir)
        size = write_bundle(site, a.out, models)
    print(f"{a.out}: {size / MIB:.2f} MiB (limit {a.max_mib} MiB)")
    if size > a.max_mib * MIB:
        print(f"hf_bundle: the bundle is over {a.max_mib} MiB", file=sys.stderr)
        return 1
    if a.check:
        check(a.out, sorted(models), a.check_python, a.check_tests, a.keep_check)
    return 0


def _local_tag() -> str:
    return f"{sys.version_info.major}{sys.version_info.minor}"


def collect(site: Path, models: list[str], tags: list[str], wheel_dir: Path) -> set[str]:
    """Copy every distribution of :data:`DISTRIBUTIONS` into ``site`` (transformers with the model
    folders ``models`` and their imports); returns the model folders kept."""
    tf_root = Path(md.distribution("transformers").locate_file("transformers"))
    models = model_closure(tf_root / "models", ["auto", *models])
    for name in DISTRIBUTIONS:
        dist = md.distribution(name)
        kept = []
        for rel in dist.files or ():
            parts = rel.parts
            if parts[0].endswith(".dist-info") or parts[0] == ".." or not _wanted(parts, name, models):
                continue
            if rel.suffix == ".so" and not _keep_extension(rel.name, name):
                continue
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist.locate_file(rel), dst)
            if rel.suffix == ".so":
                _strip(dst)
            kept.append(rel.as_posix())
        if name not in PURE_FALLBACK:
            for so in [k for k in kept if re.search(r"\.cpython-\d+-", k)]:
                kept += _extensions_for(dist, so, tags, wheel_dir, site)
        _write_dist_info(site, dist, kept)
    return models


def _wanted(parts: tuple[str, ...], dist: str, models: set[str]) -> bool:
    if any(p in SKIP_DIRS for p in parts[:-1]) or parts[-1].endswith(SKIP_SUFFIXES):
        return False
    if dist == "transformers" and len(parts) > 3 and parts[1] == "models":
        return parts[2] in models and not parts[-1].startswith("modular_")  # modular_*: sources of codegen
    return True


def _keep_extension(filename: str, dist: str) -> bool:
    """abi3 extensions and this interpreter's; none for a distribution with a pure-Python fallback."""
    if dist in PURE_FALLBACK:
        return False
    return ".abi3." in filename or f".cpython-{_local_tag()}-" in filename


def _strip(path: Path):
    """Drop the symbol tables of an extension (its dynamic symbols stay), when ``strip`` is here."""
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)


def model_closure(models_dir: Path, seeds: list[str]) -> set[str]:
    """The model folders ``seeds`` and every folder their non-modular sources import
    (``from ..x``, ``from ...models.x``, ``transformers.models.x``), transitively."""
    pattern = re.compile(r"from \.\.(?!\.)([a-z0-9_]+)|from \.\.\.models\.([a-z0-9_]+)|transformers\.models\.([a-z0-9_]+)")
    todo, out = list(seeds), set()
    while todo:
        name = todo.pop()
        if name in out:
            continue
        if not (models_dir / name).is_dir():
            raise SystemExit(f"hf_bundle: transformers has no model folder {name!r}")
        out.add(name)
        for src in (models_dir / name).glob("*.py"):
            if src.name.startswith("modular_"):
                continue
            for m in pattern.finditer(src.read_text(encoding="utf-8")):
                dep = next(g for g in m.groups() if g)
                if (models_dir / dep).is_dir():
                    todo.append(dep)
    return out


def _extensions_for(dist, so: str, tags: list[str], wheel_dir: Path, site: Path) -> list[str]:
    """The extension ``so`` (a path in ``site``) built for each CPython of ``tags``, taken from
    ``dist``'s wheel for that version (downloaded into ``wheel_dir`` when not there)."""
    out = []
    for tag in tags:
        wheel = _wheel(dist.metadata["Name"], dist.version, tag, wheel_dir)
        want = re.sub(r"\.cpython-\d+-", f".cpython-{tag}-", so)
        with zipfile.ZipFile(wheel) as z:
            if want not in z.namelist():
                raise SystemExit(f"hf_bundle: {wheel.name} has no {want}")
            (site / want).write_bytes(z.read(want))
        _strip(site / want)
        out.append(want)
    return out


def _wheel(name: str, version: str, tag: str, wheel_dir: Path) -> Path:
    norm = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(wheel_dir.glob(f"{norm}-{version}-cp{tag}-cp{tag}-*x86_64*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", f"{tag[0]}.{tag[1:]}", "--implementation", "cp", "--abi", f"cp{tag}",
               "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--platform", "manylinux_2_28_x86_64", "-d", str(wheel_dir), f"{name}=={version}"]
        print(f"hf_bundle: downloading {name} {version} for CPython {tag[0]}.{tag[1:]} into {wheel_dir}")
        subprocess.run(cmd, check=True)
        found = sorted(wheel_dir.glob(f"{norm}-{version}-cp{tag}-cp{tag}-*x86_64*.whl"))
    if not found:
        raise SystemExit(f"hf_bundle: no {name} {version} wheel for cp{tag} in {wheel_dir}")
    return found[-1]


def _write_dist_info(site: Path, dist, files: list[str]):
    """A short ``<name>-<version>.dist-info``: METADATA's header (no long description), top_level.txt,
    INSTALLER and a RECORD of the bundled files (no hashes)."""
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    info = site / f"{name}-{dist.version}.dist-info"
    info.mkdir()
    header = dist.read_text("METADATA").split("\n\n", 1)[0]
    (info / "METADATA").write_text(header + "\n", encoding="utf-8")
    tops = sorted({f.split("/")[0].removesuffix(".py") for f in files if "/" in f or f.endswith(".py")})
    (info / "top_level.txt").write_text("".join(t + "\n" for t in tops))
    (info / "INSTALLER").write_text("mok_cute tools/hf_bundle.py\n")
    record = [*files, *(f"{info.name}/{f}" for f in ("METADATA", "top_level.txt", "INSTALLER", "RECORD"))]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))


def write_bundle(site: Path, out: Path, models: set[str]) -> int:
    """``out``/hf-site.tar.xz (``site``, reproducible: sorted, no owners, mtime 0), activate.sh and
    MANIFEST.txt; returns the folder's size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name in ("hf-site.tar.xz", "activate.sh", "MANIFEST.txt"):
            old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=9) as tar:
        for path in sorted(site.rglob("*")):
            info = tar.gettarinfo(str(path), path.relative_to(site).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() or path.suffix == ".so" else 0o644
            if path.is_file():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()[:16]
    (out / "hf-site.tar.xz").write_bytes(data)
    (out / "activate.sh").write_text(ACTIVATE.replace("@DIGEST@", digest))
    (out / "activate.sh").chmod(0o755)
    lines = [f"hf-site.tar.xz {len(data)} bytes, sha256 {digest}..., built with Python {sys.version.split()[0]}",
             f"transformers model folders: {', '.join(sorted(models))}", "distributions (bytes unpacked):"]
    for name, why in DISTRIBUTIONS.items():
        dist = md.distribution(name)
        rec = next(site.glob(f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}.dist-info/RECORD"))
        size = sum((site / line.split(",")[0]).stat().st_size for line in rec.read_text().splitlines())
        lines.append(f"  {dist.metadata['Name']} {dist.version}: {size} ({why})")
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file())


ACTIVATE = r"""# Source this on the offline GPU node, after .gpu-node/activate.sh, to make transformers importable:
#   source .gpu-node/activate.sh && source .hfnode/activate.sh && python3 ...
# Built by tools/hf_bundle.py (MANIFEST.txt lists what is inside). Unpacks hf-site.tar.xz once per
# node (again when the bundle changes) into $MOK_HF_SITE (default /tmp/mok-hf/site-packages) and
# prepends it to PYTHONPATH; sets HF_HUB_OFFLINE=1 unless set. Safe to source repeatedly.
_mok_hf_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export MOK_HF_SITE="${MOK_HF_SITE:-/tmp/mok-hf/site-packages}"
if [ "$(cat "$MOK_HF_SITE/.complete" 2>/dev/null)" != "@DIGEST@" ]; then
    rm -rf "$MOK_HF_SITE" && mkdir -p "$MOK_HF_SITE" &&
    tar -xJf "$_mok_hf_here/hf-site.tar.xz" -C "$MOK_HF_SITE" &&
    echo "@DIGEST@" > "$MOK_HF_SITE/.complete" || { echo "hfnode/activate.sh: unpacking the transformers bundle failed" >&2; unset _mok_hf_here; return 1 2>/dev/null || exit 1; }
fi
case ":${PYTHONPATH:-}:" in
    *":$MOK_HF_SITE:"*) ;;
    *) export PYTHONPATH="$MOK_HF_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
"${MOK_HF_PYTHON:-python3}" -c "import numpy" 2>/dev/null ||
    echo "hfnode/activate.sh: numpy is not importable here; transformers needs it (the bundle has none)" >&2
unset _mok_hf_here
"""


# ------------------------------------------------------------------------------------------- check

CHECK_SCRIPT = r'''
import os, sys, sysconfig
allowed = [os.path.realpath(p) for p in sys.argv[1].split(os.pathsep)]
models = sys.argv[2].split(",")
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import mok_cute.integrations.transformers as mok_hf

mok_hf.register()
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                      num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, head_dim=16,
                        num_key_value_heads=2),
    "olmoe": dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    "aria_text": dict(intermediate_size=64, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
}
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
for family, kw in FAMILIES.items():
    if family.removesuffix("_text") not in models:
        continue
    cfg = AutoConfig.for_model(family, **{**COMMON, **kw})
    losses = []
    for experts in ("eager", "grouped_mm", "mok_cute"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation=experts)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
        losses.append(f"{experts} {loss.item():.4f}")
    print(f"  {family}: " + ", ".join(losses))
stdlib = {os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")}
outside = {}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if not f or name in ("__main__", "__mp_main__"):
        continue
    f = os.path.realpath(f)
    if not any(f == p or f.startswith(p + os.sep) for p in (*allowed, *stdlib)):
        outside.setdefault(name.split(".")[0], f)
if outside:
    sys.exit(f"modules from outside the bundle, the node packages and the stdlib: {outside}")
import transformers, huggingface_hub, tqdm, packaging, filelock, yaml, regex, safetensors, tokenizers
for m in (transformers, huggingface_hub, tqdm, packaging, filelock, yaml, regex, safetensors, tokenizers):
    assert os.path.realpath(m.__file__).startswith(allowed[0] + os.sep), m
print(f"  every module from the bundle ({allowed[0]}), the node packages or the stdlib")
'''

CROSS_SCRIPT = r'''
import compileall, importlib, os, sys
site = sys.argv[1]
assert compileall.compile_dir(site, quiet=2, legacy=False, workers=0), "byte-compiling the bundle failed"
try:
    import numpy  # transformers needs it; the bundle has none
except ImportError:
    numpy = None
names = ["huggingface_hub", "tqdm", "packaging", "filelock", "yaml", "regex", "safetensors", "tokenizers",
         "tokenizers.decoders", "httpx2"] + (["transformers"] if numpy else [])
for name in names:
    m = importlib.import_module(name)
    assert os.path.realpath(m.__file__).startswith(os.path.realpath(site)), (name, m.__file__)
import regex
assert regex.findall(r"\p{L}+", "ab1cd") == ["ab", "cd"]
done = "sources compile, the bundled packages import, regex's extension runs"
if numpy:
    from transformers import AutoConfig
    done += f", AutoConfig built a {AutoConfig.for_model('qwen3_moe', num_hidden_layers=1).model_type} config"
else:
    done += " (no numpy there: transformers not imported)"
print(f"  Python {sys.version.split()[0]}: {done}")
'''


def check(out: Path, models: list[str], other_python: str | None, tests: bool, keep: bool):
    """See the module docstring (``--check``)."""
    import torch

    work = Path(tempfile.mkdtemp(prefix="hf-bundle-check-"))
    try:
        venv = work / "venv"
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
        node = work / "node-site"  # the node's torch environment, as symlinks into this one
        node.mkdir()
        torch_site = Path(torch.__file__).resolve().parents[1]
        for entry in torch_site.iterdir():
            stem = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower()
            if stem in NODE_PACKAGES or entry.name in ("numpy.libs", "typing_extensions.py"):
                (node / entry.name).symlink_to(entry)
        purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                       "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                      check=True, capture_output=True, text=True).stdout.strip())
        (purelib / "node-site.pth").write_text(f"{node}\n")
        site = work / "hf-site"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(MOK_HF_SITE=str(site), MOK_HF_PYTHON=str(venv / "bin" / "python"), PYTHONPATH=str(ROOT))
        allowed = os.pathsep.join(map(str, (site, ROOT, venv, *(e.resolve() for e in node.iterdir()))))
        script = work / "check.py"
        script.write_text(CHECK_SCRIPT)
        cmd = (f"source {out / 'activate.sh'} && cd {ROOT} && "
               f"{venv / 'bin' / 'python'} {script} {allowed} {','.join(models)}")
        print(f"check: a venv without site-packages ({venv}) + {node} (torch, numpy, ...) + the bundle")
        subprocess.run(["bash", "-c", cmd], check=True, env=env)
        if tests:
            import pytest

            test_site = Path(pytest.__file__).resolve().parents[1]
            for entry in test_site.iterdir():  # pytest, xdist, and the CuTe DSL tests/conftest.py imports
                stem = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower()
                if stem in TEST_PACKAGES and not (node / entry.name).exists():
                    (node / entry.name).symlink_to(entry)
                if entry.name == "nvidia_cutlass_dsl_packages.pth":  # puts the DSL's packages on sys.path
                    shutil.copyfile(entry, purelib / entry.name)
            print("check: tests/integrations with the bundle's transformers (pytest, pytest-xdist, CuTe DSL added)")
            subprocess.run(["bash", "-c", f"source {out / 'activate.sh'} && cd {ROOT} && {venv / 'bin' / 'python'} -c "
                            f"'import transformers; assert transformers.__file__.startswith(\"{site}/\")' && "
                            f"{venv / 'bin' / 'python'} -m pytest -q -p no:cacheprovider -n 2 tests/integrations"],
                           check=True, env=env)
        if other_python:
            (work / "cross.py").write_text(CROSS_SCRIPT)
            subprocess.run([other_python, "-I", "-c",
                            f"import sys; sys.path.insert(0, {str(site)!r}); exec(open({str(work / 'cross.py')!r}).read())",
                            str(site)], check=True, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
        if keep:
            print(f"check: kept {work}; its interpreter with the bundle:\n  export MOK_HF_SITE={site} && "
                  f"source {out / 'activate.sh'} && {venv / 'bin' / 'python'} ...")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The package's dependency rules, read from the import statements (no import is executed):
the reference imports no kernel; comm and schedule import no GEMM code; kernels import
neither the public API nor the layer backends; nothing in mok_cute imports tools/."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mok_cute"
PUBLIC = {"mok_cute.ops", "mok_cute.layer", "mok_cute.backend", "mok_cute.config", "mok_cute.validate",
          "mok_cute.grouped_backend", "mok_cute.sm90_backend", "mok_cute.sm100_backend", "mok_cute.ep_layer",
          "mok_cute.weight_cache"}
GEMM = ("mok_cute.kernels.sm90_", "mok_cute.kernels.sm100_")


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


FILES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_dependencies_point_one_way(path):
    mod, deps = _module(path), _imports(path)
    assert not any(d == "tools" or d.startswith(("tools.", "checks")) for d in deps), deps
    if mod == "mok_cute.reference":
        assert not any(d.startswith("mok_cute.kernels") for d in deps), deps
    if mod.startswith(("mok_cute.comm", "mok_cute.schedule")):
        assert not any(d.startswith(GEMM) for d in deps), deps
    if mod.startswith("mok_cute.kernels"):
        assert not (deps & PUBLIC), deps & PUBLIC


def test_the_rules_see_imports():
    """The parser finds relative and absolute imports (a rule checking nothing would pass)."""
    deps = _imports(PKG / "grouped_backend.py")
    assert "mok_cute.reference" in deps and "mok_cute.kernels.route_grad" in deps
    assert "mok_cute.schedule.group_tiles" in _imports(PKG / "kernels" / "sm90_mainloop.py")

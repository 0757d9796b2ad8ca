"""The package's dependency rules, read from the import statements (no import is executed;
function-level imports count as much as module-level ones):

    dsl < {kernels, comm, schedule};  kernels may import comm / schedule;
    layers import kernels + reference;  the public API (ops, layer, ...) imports layers;
    the reference imports no kernels, layers or dsl;  nothing in mok_cute imports tools/;
    and no import cycle among mok_cute's modules.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mok_cute"
PUBLIC = ("mok_cute.ops", "mok_cute.layer", "mok_cute.config", "mok_cute.validate")


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
MODULES = {_module(p): p for p in FILES}


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _graph(modules: dict) -> dict[str, set[str]]:
    """Module -> the mok_cute modules it imports; ``from pkg import mod`` is an edge to
    ``pkg.mod`` only (a parent package is imported first in any case, not as a dependency)."""
    graph = {}
    for mod, path in modules.items():
        deps = {d for d in _imports(path) if d in modules and d != mod}
        graph[mod] = {d for d in deps if not any(o.startswith(d + ".") for o in deps)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]`` in ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_dependencies_point_one_way(path):
    mod, deps = _module(path), _imports(path)
    own = {d for d in deps if _under(d, "mok_cute")}
    assert not any(_under(d, "tools", "checks") for d in deps), deps
    if mod == "mok_cute.reference":
        assert not any(_under(d, "mok_cute.kernels", "mok_cute.layers", "mok_cute.dsl") for d in own), own
    if _under(mod, "mok_cute.comm", "mok_cute.schedule"):
        assert not any(_under(d, "mok_cute.kernels", "mok_cute.layers") for d in own), own
    if _under(mod, "mok_cute.dsl"):
        assert all(_under(d, "mok_cute.dsl") for d in own), own
    if _under(mod, "mok_cute.kernels"):
        assert not any(_under(d, "mok_cute.layers", *PUBLIC) for d in own), own


def test_no_import_cycle():
    cycle = find_cycle(_graph(MODULES))
    assert cycle is None, " -> ".join(cycle)


def test_the_rules_see_imports():
    """The parser finds relative, absolute and function-level imports, and the cycle finder
    finds a cycle (a rule checking nothing would pass)."""
    deps = _imports(PKG / "layers" / "grouped.py")
    assert "mok_cute.reference" in deps and "mok_cute.kernels.route_grad" in deps
    assert "mok_cute.layers.ep" in deps  # imported inside a method
    assert "mok_cute.schedule.group_tiles" in _imports(PKG / "kernels" / "sm90" / "mainloop.py")
    assert "mok_cute.custom_ops" in _imports(PKG / "ops.py")  # relative
    assert "mok_cute.layers.select" in _imports(PKG / "custom_ops.py")  # relative, inside a function
    graph = _graph(MODULES)
    assert "mok_cute.layers.ep" in graph["mok_cute.layers.grouped"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    # the layer graph with ep importing grouped back (the circle this layout removed) is caught
    graph["mok_cute.layers.ep"] = graph["mok_cute.layers.ep"] | {"mok_cute.layers.grouped"}
    assert find_cycle(graph) is not None

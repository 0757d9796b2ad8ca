"""The package's dependency rules, read from the import statements (no import is executed;
function-level imports count as much as module-level ones):

    dsl < schedule < comm < kernels: comm may import schedule (the plan it moves rows by),
    schedule imports no comm (one direction between the two folders);  kernels may import comm /
    schedule;  layers import kernels + reference;  the public API (ops, layer, ...) imports layers;
    the reference imports no kernels, layers, comm or dsl;  integrations (e.g. the transformers
    experts backend) sit above the public API: they import only it, nothing imports them;  nothing
    in mok_cute imports tools/;  and no import cycle among mok_cute's modules.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "mok_cute"
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


def broken_rules(mod: str, deps: set[str]) -> list[str]:
    """The dependency rules (module doc) that ``mod`` importing ``deps`` breaks, each as
    ``"rule: offending imports"``; empty when it breaks none."""
    own = {d for d in deps if _under(d, "mok_cute")}

    def rule(name: str, bad) -> list[str]:
        return [f"{name}: {sorted(bad)}"] if bad else []

    out = rule("nothing imports tools/", {d for d in deps if _under(d, "tools", "checks")})
    if mod == "mok_cute.reference":
        out += rule("reference imports no kernels, layers, comm or dsl",
                    {d for d in own
                     if _under(d, "mok_cute.kernels", "mok_cute.layers", "mok_cute.comm", "mok_cute.dsl")})
    if _under(mod, "mok_cute.comm", "mok_cute.schedule"):
        out += rule("comm / schedule import no kernels or layers",
                    {d for d in own if _under(d, "mok_cute.kernels", "mok_cute.layers")})
    if _under(mod, "mok_cute.schedule"):
        out += rule("schedule imports no comm (comm imports schedule)", {d for d in own if _under(d, "mok_cute.comm")})
    if _under(mod, "mok_cute.dsl"):
        out += rule("dsl imports only dsl", {d for d in own if not _under(d, "mok_cute.dsl")})
    if _under(mod, "mok_cute.kernels"):
        out += rule("kernels import no layers or public API", {d for d in own if _under(d, "mok_cute.layers", *PUBLIC)})
    if _under(mod, "mok_cute.integrations"):
        out += rule("integrations import only the public API",
                    {d for d in own if d != "mok_cute" and not _under(d, "mok_cute.integrations", *PUBLIC)})
    else:
        out += rule("nothing imports integrations", {d for d in own if _under(d, "mok_cute.integrations")})
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_dependencies_point_one_way(path):
    assert broken_rules(_module(path), _imports(path)) == []


def folder_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(a, b)`` for every folder (subpackage) ``a`` of mok_cute with a module importing one of
    folder ``b`` (a != b)."""
    def folder(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if len(parts) > 2 else None

    return {(folder(m), folder(d)) for m, deps in graph.items() for d in deps
            if folder(m) and folder(d) and folder(m) != folder(d)}


def test_comm_and_schedule_one_way():
    """comm imports schedule, never the reverse: the two folders' import edges go one way."""
    edges = folder_edges(_graph(MODULES))
    assert ("comm", "schedule") in edges and ("schedule", "comm") not in edges, sorted(edges)
    assert ("dsl", "comm") not in edges and ("dsl", "schedule") not in edges


def test_the_rules_catch_a_back_edge():
    """A synthetic back edge breaks a rule: schedule importing comm (a comm <-> schedule cycle of
    folders), the reference importing comm; the chosen direction (comm -> schedule) does not."""
    assert broken_rules("mok_cute.schedule.plan", {"mok_cute.comm.protocol"})
    assert broken_rules("mok_cute.schedule.fused_tasks", {"mok_cute.comm"})
    assert broken_rules("mok_cute.reference", {"mok_cute.comm.virtual"})
    assert broken_rules("mok_cute.dsl.status", {"mok_cute.comm.protocol"})
    assert broken_rules("mok_cute.comm.dispatch", {"mok_cute.schedule.plan", "mok_cute.dsl.host"}) == []
    assert broken_rules("mok_cute.reference", {"torch"}) == []
    assert broken_rules("mok_cute.ops", {"mok_cute.integrations.transformers"})
    assert broken_rules("mok_cute.integrations.transformers", {"mok_cute.layers.grouped"})
    assert broken_rules("mok_cute.integrations.transformers", {"mok_cute.ops", "mok_cute.config"}) == []
    graph = _graph(MODULES)
    graph["mok_cute.schedule.plan"] = graph["mok_cute.schedule.plan"] | {"mok_cute.comm.protocol"}
    edges = folder_edges(graph)
    assert ("comm", "schedule") in edges and ("schedule", "comm") in edges  # what the one-way test refuses
    toy = {"mok_cute.a.x": {"mok_cute.b.y", "mok_cute.a.z"}, "mok_cute.ops": {"mok_cute.a.x"}}
    assert folder_edges(toy) == {("a", "b")}


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

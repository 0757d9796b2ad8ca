"""Every function in mok_cute takes at most 12 parameters (``self`` / ``cls`` not counted):
kernel launchers and kernels take named operand bundles, not dozens of positional tensors."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mok_cute"
MAX_PARAMS = 12


def param_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of ``fn``, ``*args`` / ``**kwargs`` one each, a leading self / cls not counted."""
    a = fn.args
    names = [*a.posonlyargs, *a.args]
    n = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0].arg in ("self", "cls") else 0)


def wide_functions(root: Path = PKG, limit: int = MAX_PARAMS) -> list[str]:
    """``path:line name(count)`` of every function under ``root`` with more than ``limit`` parameters."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and param_count(node) > limit:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}({param_count(node)})")
    return out


def test_param_count_counts_what_it_should():
    fn = ast.parse("def f(self, a, b, /, c, *d, e, **f): pass").body[0]
    assert param_count(fn) == 6
    fn = ast.parse("def g(a, b): pass").body[0]
    assert param_count(fn) == 2


def test_no_function_takes_more_than_twelve_parameters():
    wide = wide_functions()
    assert not wide, f"{len(wide)} functions take more than {MAX_PARAMS} parameters:\n" + "\n".join(wide)


if __name__ == "__main__":  # the list, for whoever is folding them
    print("\n".join(wide_functions()))

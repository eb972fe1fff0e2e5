"""The layers show: nabla's import graph, module-level and function-level imports alike (only imports for type
checkers are left out), has no cycle; and ``import nabla`` imports none of the extras."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "nabla"


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of import nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for inner in node.body:
                for sub in ast.walk(inner):
                    skip.add(id(sub))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the nabla modules it imports (anywhere in its code). A module's own packages are left out:
    Python runs them before it whatever it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            found: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base) + (f".{node.module}" if node.module else "")
                else:
                    target = node.module or ""
                if not target.startswith("nabla"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names if a.name in mods]
            for t in found:
                if t in mods and t != m and not m.startswith(t + "."):
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    found = cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) + ":\n" + "\n".join(
        f"    {a} imports {b}" for a in c for b in sorted(graph[a] & set(c))) for c in found)


def test_the_walk_sees_function_level_imports_and_would_report_a_cycle():
    graph = import_graph()
    # jit imports autodiff at module level and executor inside functions; both are edges
    assert "nabla.autodiff" in graph["nabla.jit"] or "nabla.pytree" in graph["nabla.jit"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_import_nabla_imports_no_extra():
    code = ("import sys, nabla; bad = [m for m in ('jax', 'onnx', 'onnxruntime', 'scipy', 'matplotlib', 'rich', "
            "'hypothesis', 'torch') if m in sys.modules]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert out.returncode == 0, out.stdout + out.stderr

"""The structure counts of issue 31's "done when", read from nabla/'s source with ``ast`` (nothing is imported):
classes named ``Step``, ``CommEvent`` made outside the collective registry, modules over 600 lines, private
names used across packages, a ``services`` module, ``Value`` attributes assigned outside ``value.py``.

``python tools/structure.py`` prints each count with its goal and where it comes from; ``--root DIR`` reads
``DIR/nabla`` instead, ``--json`` prints the counts and their sites as JSON, ``--check`` exits 1 while a count
is above its goal (CI prints the counts without it for now)."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINES = 600
#: each count's goal (issue 31)
GOALS = {"step_classes": 1, "comm_event_modules": 0, "long_modules": 0, "private_imports": 0,
         "private_attributes": 0, "services_module": 0, "value_writes": 0}


@dataclass
class Module:
    name: str  # dotted, "nabla.reshard" for nabla/reshard/__init__.py
    path: Path
    rel: str  # the path from the root, as printed
    package: str  # the package the module is in ("nabla.reshard" for nabla/reshard/__init__.py too)
    lines: int
    tree: ast.Module
    nodes: list[ast.AST] = field(default_factory=list)  # every node of the tree, walked once

    def __post_init__(self) -> None:
        self.nodes = list(ast.walk(self.tree))


@dataclass
class Report:
    """Each count, and the sites behind it (``(module, line, what)``)."""

    counts: dict[str, int] = field(default_factory=dict)
    sites: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    info: dict[str, int] = field(default_factory=dict)


def modules(root: Path, package: str = "nabla") -> dict[str, Module]:
    """Every module of ``root/package``, by dotted name."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        text = p.read_text(encoding="utf-8")
        out[name] = Module(name, p, p.relative_to(root).as_posix(), name if is_init else name.rpartition(".")[0],
                           len(text.splitlines()), ast.parse(text, filename=str(p)))
    return out


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(name: str, mods: dict[str, Module]) -> str:
    """The package a module (or a package) named ``name`` is in: itself for a package."""
    m = mods.get(name)
    return m.package if m is not None else name.rpartition(".")[0]


def import_base(m: Module, node: ast.ImportFrom) -> str:
    """The dotted module an ``from X import ...`` reads from."""
    if not node.level:
        return node.module or ""
    parts = m.package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base) + (f".{node.module}" if node.module else "")


def module_aliases(m: Module, mods: dict[str, Module]) -> dict[str, str]:
    """Local names bound to a module of the tree by an import (``from . import collectives as C``: C)."""
    out: dict[str, str] = {}
    for node in m.nodes:
        if isinstance(node, ast.ImportFrom):
            base = import_base(m, node)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in mods:
                    out[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        if top in mods:
                            out[top] = top
    return out


def dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + names[::-1]
    return None


# ---- the counts ------------------------------------------------------------------------------------------


def step_classes(mods: dict[str, Module]) -> list[tuple[str, int, str]]:
    """Classes named ``Step``: class statements, and ``Step = NamedTuple(...)``-style assignments."""
    out = []
    for m in mods.values():
        for node in m.nodes:
            if isinstance(node, ast.ClassDef) and node.name == "Step":
                out.append((m.rel, node.lineno, "class Step"))
            elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                  and any(isinstance(t, ast.Name) and t.id == "Step" for t in node.targets)):
                out.append((m.rel, node.lineno, "Step = ...(...)"))
    return out


def registry_modules(mods: dict[str, Module]) -> set[str]:
    """The collective registry: the modules that define ``class Collective`` (else the one defining CommEvent)."""
    def defining(cls: str) -> set[str]:
        return {n for n, m in mods.items()
                if any(isinstance(s, ast.ClassDef) and s.name == cls for s in m.tree.body)}
    return defining("Collective") or defining("CommEvent")


def comm_events(mods: dict[str, Module]) -> list[tuple[str, int, str]]:
    """Calls that make a ``CommEvent`` (``CommEvent(...)``, ``C.CommEvent(...)``, ``CommEvent._make(...)``) outside
    the registry."""
    home = registry_modules(mods)
    out = []
    for name, m in mods.items():
        if name in home:
            continue
        for node in m.nodes:
            if not isinstance(node, ast.Call):
                continue
            chain = dotted(node.func) or []
            if chain[-1:] == ["CommEvent"] or chain[-2:] == ["CommEvent", "_make"]:
                out.append((m.rel, node.lineno, ".".join(chain)))
    return out


def long_modules(mods: dict[str, Module]) -> list[tuple[str, int, str]]:
    """Modules over ``MAX_LINES`` lines, longest first (the line is the count)."""
    return sorted(((m.rel, m.lines, f"{m.lines} lines") for m in mods.values() if m.lines > MAX_LINES),
                  key=lambda s: -s[1])


def private_names(mods: dict[str, Module], across: bool = True) -> tuple[list, list]:
    """Private names read from another module: ``from x import _y`` and ``x._y`` with ``x`` an imported module.
    ``across``: only where the two modules are in different packages (else every other module counts)."""
    imports, attrs = [], []
    for name, m in mods.items():
        def other(target: str) -> bool:
            if target == name:
                return False
            return package_of(target, mods) != m.package if across else True

        for node in m.nodes:
            if isinstance(node, ast.ImportFrom):
                base = import_base(m, node)
                if base.split(".")[0] not in mods:
                    continue
                for a in node.names:
                    if is_private(a.name):
                        full = f"{base}.{a.name}"
                        target = full if full in mods else base
                        if other(target):
                            imports.append((m.rel, node.lineno, f"from {base} import {a.name}"))
        aliases = module_aliases(m, mods)
        for node in m.nodes:
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            chain = dotted(node.value)
            if not chain or chain[0] not in aliases:
                continue
            target = ".".join([aliases[chain[0]]] + chain[1:])
            if target in mods and other(target):
                attrs.append((m.rel, node.lineno, f"{target}.{node.attr}"))
    return imports, attrs


def value_fields(mods: dict[str, Module]) -> tuple[str | None, set[str]]:
    """The module defining ``class Value`` and its attributes (``__slots__``, else what ``__init__`` sets)."""
    for name, m in mods.items():
        for node in m.tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name == "Value"):
                continue
            names: set[str] = set()
            for s in node.body:
                if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                     for t in s.targets):
                    names |= {e.value for e in ast.walk(s.value)
                              if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if not names:
                for s in ast.walk(node):
                    if isinstance(s, ast.Attribute) and isinstance(s.ctx, ast.Store) and dotted(s.value) == ["self"]:
                        names.add(s.attr)
            return name, names - {"__weakref__", "__dict__"}
    return None, set()


def value_subclasses(mods: dict[str, Module]) -> set[str]:
    """Names of ``Value`` and the classes deriving from it, anywhere in the tree."""
    found = {"Value"}
    classes = [n for m in mods.values() for n in m.nodes if isinstance(n, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for c in classes:
            if c.name not in found and any((dotted(b) or [""])[-1] in found for b in c.bases):
                found.add(c.name)
                grew = True
    return found


def _owners(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the innermost class whose body holds it."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            if inner is not None:
                out[id(child)] = inner
            visit(child, inner)

    visit(tree, None)
    return out


def value_writes(mods: dict[str, Module]) -> list[tuple[str, int, str]]:
    """Assignments of a ``Value`` attribute (``x._node = ...``, ``setattr(x, "_node", ...)``) outside its module.
    ``self.<attr> = `` in a class that is no ``Value`` is that class's own attribute, not counted."""
    home, fields = value_fields(mods)
    if home is None:
        return []
    kinds = value_subclasses(mods)
    out = []
    for name, m in mods.items():
        if name == home:
            continue
        owner = _owners(m.tree)

        def counted(target: ast.AST) -> bool:
            if not (isinstance(target, ast.Attribute) and target.attr in fields):
                return False
            cls = owner.get(id(target))
            return not (dotted(target.value) == ["self"] and cls is not None and cls not in kinds)

        for node in m.nodes:
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and (dotted(node.func) or [""])[-1] in ("setattr", "__setattr__"):
                args = node.args
                if len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value in fields:
                    out.append((m.rel, node.lineno, args[1].value))
                continue
            for t in targets:
                for sub in ast.walk(t):
                    if counted(sub):
                        out.append((m.rel, sub.lineno, sub.attr))
    return out


def measure(root: Path, package: str = "nabla") -> Report:
    """Every count of the tree ``root/package``."""
    mods = modules(root, package)
    r = Report()
    r.sites["step_classes"] = step_classes(mods)
    r.sites["comm_events"] = comm_events(mods)
    r.sites["long_modules"] = long_modules(mods)
    r.sites["private_imports"], r.sites["private_attributes"] = private_names(mods)
    r.sites["value_writes"] = value_writes(mods)
    r.counts["step_classes"] = len(r.sites["step_classes"])
    r.counts["comm_event_modules"] = len({s[0] for s in r.sites["comm_events"]})
    r.counts["long_modules"] = len(r.sites["long_modules"])
    r.counts["private_imports"] = len(r.sites["private_imports"])
    r.counts["private_attributes"] = len(r.sites["private_attributes"])
    r.counts["services_module"] = int(f"{package}.services" in mods)
    r.counts["value_writes"] = len(r.sites["value_writes"])
    same = private_names(mods, across=False)
    r.info["comm_event_calls"] = len(r.sites["comm_events"])
    r.info["private_names_any_module"] = len(same[0]) + len(same[1])
    r.info["value_write_modules"] = len({s[0] for s in r.sites["value_writes"]})
    r.info["modules"] = len(mods)
    return r


# ---- printing ----------------------------------------------------------------------------------------------


def _by_module(sites: list[tuple[str, int, str]]) -> list[str]:
    """One line per module: its sites' labels with their line numbers."""
    per: dict[str, list[tuple[int, str]]] = {}
    for mod, line, what in sites:
        per.setdefault(mod, []).append((line, what))
    return [f"    {mod}: " + ", ".join(f"{what} ({line})" for line, what in sorted(items))
            for mod, items in sorted(per.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def render(r: Report) -> str:
    c, s, i = r.counts, r.sites, r.info
    goal = GOALS
    out = [f"nabla structure (issue 31): each count, then [its goal]; {i['modules']} modules read"]
    out.append(f"classes named Step: {c['step_classes']} [{goal['step_classes']}]")
    out += [f"    {m}:{line}" for m, line, _ in s["step_classes"]]
    out.append(f"modules constructing CommEvent outside the collective registry: {c['comm_event_modules']} "
               f"[{goal['comm_event_modules']}] ({i['comm_event_calls']} calls)")
    out += _by_module(s["comm_events"])
    out.append(f"modules of nabla/ over {MAX_LINES} lines: {c['long_modules']} [{goal['long_modules']}]")
    out += [f"    {m} {n}" for m, n, _ in s["long_modules"]]
    out.append(f"imports of another package's private names: {c['private_imports']} [{goal['private_imports']}]")
    out += _by_module(s["private_imports"])
    out.append(f"uses of another package's module._private: {c['private_attributes']} "
               f"[{goal['private_attributes']}]")
    out += _by_module(s["private_attributes"])
    out.append(f"    (private names of any other module, same package included: {i['private_names_any_module']})")
    out.append(f"services module: {'yes' if c['services_module'] else 'no'} ({c['services_module']}) "
               f"[{goal['services_module']}]")
    out.append(f"Value attributes assigned outside value.py: {c['value_writes']} [{goal['value_writes']}] "
               f"(in {i['value_write_modules']} modules)")
    out += _by_module(s["value_writes"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the folder holding nabla/ (default: this checkout)")
    ap.add_argument("--json", action="store_true", help="counts, info and sites as JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 while a count is above its goal")
    a = ap.parse_args(argv)
    r = measure(a.root)
    if a.json:
        print(json.dumps({"counts": r.counts, "info": r.info, "sites": r.sites}, indent=1))
    else:
        print(render(r))
    if a.check and any(r.counts[k] > g for k, g in GOALS.items()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

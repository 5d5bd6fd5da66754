"""The package's import graph, read with ``ast`` (nothing is imported): the CLI is a leaf
(only ``cli.py`` and ``commands/`` import ``moetrace.commands``) and no two modules import
each other, directly or through others. Imports inside functions count too: a lazy import
is still a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "moetrace"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not _is_package(mod):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str) -> str | None:
    """The moetrace module a dotted name lives in (longest known prefix)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


def imports_of(mod: str) -> set[str]:
    tree = ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            names = [f"{base}.{a.name}" for a in node.names]   # a submodule, or a name of base
        else:
            continue
        for n in names:
            if n.split(".")[0] != "moetrace":
                continue
            t = _target(n)
            # a module always imports its parent packages; that edge is not a design choice
            if t and t != mod and not mod.startswith(t + "."):
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    return {m: imports_of(m) for m in MODULES}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        color[u] = 1
        stack.append(u)
        for v in sorted(g.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in color:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = 2
        return None

    for m in sorted(g):
        if m not in color:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_reader_on_known_edges():
    g = graph()
    assert "moetrace.errors" in g["moetrace.store"]              # from .errors import ...
    assert "moetrace.analyze" in g["moetrace.store"]             # lazy: from .analyze import view_statements
    assert "moetrace.run" in g["moetrace.store"] and "moetrace.store" not in g["moetrace.run"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_cli_imports_commands():
    bad = sorted(f"{m} imports {t}" for m, ts in graph().items() for t in ts
                 if t.startswith("moetrace.commands") and not (m == "moetrace.cli" or m.startswith("moetrace.commands")))
    assert not bad, "library code must not depend on the CLI: " + "; ".join(bad)


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)

"""The package's import graph, read with ``ast`` (nothing is imported). Imports inside
functions count too: a lazy import is still a dependency.

- Folders import downward only: every module belongs to one layer of ``LAYERS`` (its
  folder, or for a top-level file its name) and imports only modules of its own layer or
  of layers listed before it; so the folder-level graph has no cycle.
- No two modules import each other, directly or through others.
- The CLI is a leaf (only ``cli.py`` and ``commands/`` import ``moetrace.commands``)."""
from __future__ import annotations

import ast

from .helpers.import_graph import MODULES, _resolve, _target


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


#: the layers, bottom first: a module may import its own layer and the layers before it.
#: "ground" is the top-level files every layer uses; ``costmodel`` (a pure GPU cost model)
#: imports only the ground files; ``placement`` holds every plan module (planners, plan
#: files, plans made and stored) and sits above ``formats`` because its plan-file reader
#: parses TRT-LLM's YAML with ``formats.safe_yaml``; it reads and writes plans only through
#: the files and the store object it is handed, never importing ``storage``; the package's
#: own ``__init__`` (lazy public names), ``cli`` and ``commands`` are the top.
LAYERS = [
    ("ground", {"moetrace.version", "moetrace.errors", "moetrace.output", "moetrace.safety", "moetrace.safety_pickle",
                "moetrace.streams", "moetrace.notebook", "moetrace.units"}),
    ("domain", {"moetrace.domain"}),
    ("formats", {"moetrace.formats"}),
    ("placement", {"moetrace.placement"}),
    ("costmodel", {"moetrace.costmodel"}),
    ("storage", {"moetrace.storage"}),
    ("collect", {"moetrace.collect"}),
    ("analyze", {"moetrace.analyze"}),
    ("replay", {"moetrace.replay"}),
    ("run", {"moetrace.run"}),
    ("report", {"moetrace.report"}),
    ("produce", {"moetrace.produce"}),
    ("top", {"moetrace", "moetrace.cli", "moetrace.__main__", "moetrace.commands"}),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(mod: str) -> str:
    """The layer of a module: the longest package or file prefix named in ``LAYERS``."""
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len and (p != "moetrace" or mod == "moetrace"):
                best, best_len = name, len(p)
    if best is None:
        raise AssertionError(f"{mod} is in no layer of tests/test_imports.py LAYERS: add it there")
    return best


def folder_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {name: set() for name, _ in LAYERS}
    for m, ts in g.items():
        for t in ts:
            a, b = layer_of(m), layer_of(t)
            if a != b:
                out[a].add(b)
    return out


def test_graph_reader_on_known_edges():
    g = graph()
    assert "moetrace.errors" in g["moetrace.storage.store"]              # from ..errors import ...
    assert "moetrace.storage.views" in g["moetrace.storage.store"]       # lazy: from .views import view_statements
    assert "moetrace.storage.store" in g["moetrace.run"] and "moetrace.run" not in g["moetrace.storage.store"]
    assert "moetrace.report.build" in g["moetrace.commands.analyze_cmds"]  # lazy, inside the command
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("moetrace.placement.eplb") == "placement" and layer_of("moetrace") == "top"
    assert layer_of("moetrace.costmodel.gemm") == "costmodel"


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_folders_import_downward_only():
    """An import of a later layer is upward: the folder graph would have a cycle or a
    lower layer would know a higher one (the facade, the report, the CLI)."""
    g = graph()
    bad = sorted(f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})" for m, ts in g.items() for t in ts
                 if RANK[layer_of(t)] > RANK[layer_of(m)])
    assert not bad, "upward imports: " + "; ".join(bad)


def test_no_folder_cycles():
    cycle = find_cycle(folder_graph(graph()))
    assert cycle is None, "folder-level import cycle: " + " -> ".join(cycle)


def test_folder_rule_catches_an_upward_edge():
    fake = {"moetrace.storage.store": {"moetrace.run"}, "moetrace.run": {"moetrace.storage.store"}}
    fg = folder_graph(fake)
    assert fg["storage"] == {"run"} and find_cycle(fg) == ["run", "storage", "run"]


def test_only_the_cli_imports_commands():
    bad = sorted(f"{m} imports {t}" for m, ts in graph().items() for t in ts
                 if t.startswith("moetrace.commands") and not (m == "moetrace.cli" or m.startswith("moetrace.commands")))
    assert not bad, "library code must not depend on the CLI: " + "; ".join(bad)


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)

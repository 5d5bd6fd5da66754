"""Report sections are thin callers: they reach analysis and replay through the Run facade
(``ctx.facade``) or SQL over the views (``ctx.sql``), never by importing ``moetrace.analyze``,
``moetrace.replay``, the store, the collectors or the CLI. Read with ``ast`` (nothing is
imported); imports inside functions count too."""
from __future__ import annotations

import ast

from .helpers.import_graph import MODULES, _resolve, _target

SECTIONS = "moetrace.report.sections"
#: what a section may import from moetrace: the report package itself, the table printer,
#: the number formatters (times, percentages, bytes), the error types, and the kernel-kind
#: vocabulary (constants only, no classifier call)
ALLOWED = ("moetrace.report", "moetrace.output", "moetrace.units", "moetrace.errors")
VOCABULARY = "moetrace.domain.kernels"


def section_imports(mod: str) -> list[tuple[str, str]]:
    """(moetrace module, imported name) for every moetrace import in ``mod``."""
    tree = ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            pairs = [(_target(f"{base}.{a.name}") or base, a.name) for a in node.names]
        else:
            continue
        out += [(t, name) for t, name in pairs if t.split(".")[0] == "moetrace"]
    return out


def refused(mod: str) -> list[str]:
    bad = []
    for t, name in section_imports(mod):
        if t == VOCABULARY and name.isupper():
            continue
        if not any(t == a or t.startswith(a + ".") for a in ALLOWED):
            bad.append(f"{mod} imports {t}" + (f" ({name})" if name else ""))
    return bad


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    src = "from ...replay.placement_whatif import placement_whatif\ndef f():\n    from ...analyze import waits\n    import moetrace.storage.store\n"
    mod = f"{SECTIONS}.__probe"
    path = tmp_path / "probe.py"
    path.write_text(src)
    MODULES[mod] = path
    try:
        assert sorted(refused(mod)) == [f"{mod} imports moetrace.analyze.waits (waits)",
                                        f"{mod} imports moetrace.replay.placement_whatif (placement_whatif)",
                                        f"{mod} imports moetrace.storage.store"]
        path.write_text("from ...domain.kernels import A2A_KINDS, classify\nfrom ..base import Section\n")
        assert refused(mod) == [f"{mod} imports moetrace.domain.kernels (classify)"]
    finally:
        del MODULES[mod]


def test_sections_reach_analysis_only_through_the_facade_or_sql():
    mods = [m for m in MODULES if m.startswith(SECTIONS + ".")]
    assert len(mods) >= 10
    bad = [b for m in mods for b in refused(m)]
    assert not bad, "report sections must use ctx.facade (moetrace.run.Run) or ctx.sql: " + "; ".join(bad)

"""The analysis views, as SQL: every ``sql/*.sql`` file holds CREATE VIEW statements over the
canonical tables (files run in name order, so a view may use views of earlier files)."""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"


def _split(text: str) -> list[str]:
    out, buf = [], []
    for line in text.splitlines():
        if line.strip().startswith("--"):
            continue
        buf.append(line)
        if line.rstrip().endswith(";"):
            stmt = "\n".join(buf).strip().rstrip(";").strip()
            if stmt:
                out.append(stmt)
            buf = []
    rest = "\n".join(buf).strip()
    if rest:
        out.append(rest)
    return out


@lru_cache(maxsize=None)
def view_statements() -> list[str]:
    stmts: list[str] = []
    for f in sorted(SQL_DIR.glob("*.sql")):
        stmts.extend(_split(f.read_text()))
    return stmts


_VIEW_RE = re.compile(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+\"?(\w+)\"?", re.I)


@lru_cache(maxsize=None)
def view_docs() -> dict[str, dict]:
    """{view: {"file", "doc"}} for every view of ``sql/*.sql``, in file order: the one
    place where a metric view is described (``moetrace tables VIEW`` shows it). A view's
    doc is the paragraph of its file's comments that starts with ``-- name:``, else the
    comment block right above its CREATE VIEW statement, else the file's header."""
    out: dict[str, dict] = {}
    for f in sorted(SQL_DIR.glob("*.sql")):
        lines = f.read_text().splitlines()
        comments = [ln.strip()[2:].strip() if ln.strip().startswith("--") else None for ln in lines]
        for i, line in enumerate(lines):
            m = _VIEW_RE.match(line)
            if not m:
                continue
            name = m.group(1)
            para: list[str] = []
            head = next((j for j, c in enumerate(comments) if c and c.lower().startswith(name.lower() + ":")), None)
            if head is not None:
                para = [comments[head][len(name) + 1:].strip()]
                for c in comments[head + 1:]:
                    if not c or _VIEW_RE.match(c) or re.match(r"^\w+:\s", c) and c.split(":")[0] in _view_names(f):
                        break
                    para.append(c)
            else:
                j = i - 1
                while j >= 0 and not lines[j].strip():
                    j -= 1
                k = j
                while k >= 0 and comments[k] is not None:
                    k -= 1
                para = [c for c in comments[k + 1:j + 1] if c]
            if not para:   # a helper view: the file's header says what it is part of
                k = 0
                while k < len(lines) and comments[k] is not None:
                    k += 1
                para = [c for c in comments[:k] if c]
            out[name] = {"file": f.name, "doc": " ".join(para).strip()}
    return out


@lru_cache(maxsize=None)
def view_columns() -> dict[str, dict[str, str]]:
    """{view: {column: meaning}} from ``view_columns.json`` (columns the view's comment does
    not define in so many words)."""
    import json

    doc = json.loads((Path(__file__).resolve().parent / "view_columns.json").read_text())
    return {k: v for k, v in doc.items() if not k.startswith("_")}


@lru_cache(maxsize=None)
def _view_names(f: Path) -> frozenset[str]:
    return frozenset(m.group(1) for m in map(_VIEW_RE.match, f.read_text().splitlines()) if m)


@lru_cache(maxsize=None)
def view_graph() -> dict[str, tuple[int, str, frozenset[str]]]:
    """{view: (position, CREATE statement, views of ``sql/`` it reads)} of every analysis
    view, parsed once: a connection defines only the views a query names, with what they
    read (:class:`moetrace.storage.store.Store`). A word of the statement that names an
    earlier view counts as a dependency (a stray match only defines one view more)."""
    out: dict[str, tuple[int, str, frozenset[str]]] = {}
    for i, stmt in enumerate(view_statements()):
        m = _VIEW_RE.match(stmt)
        if not m:
            raise ValueError(f"not a CREATE VIEW statement in sql/: {stmt[:80]!r}")
        words = set(re.findall(r"\w+", stmt[m.end():]))
        out[m.group(1)] = (i, stmt, frozenset(w for w in words if w in out))
    return out


def views_closure(text: str, defined: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The names of the views of ``sql/`` that ``text`` (a query) names and that are not in
    ``defined``, with the views they read (those not in ``defined``), in file order: what
    must be created, in that order, before ``text`` runs. A word of ``text`` counts as it
    is written (view names are lower case; a caller whose engine folds case passes
    ``text.lower()``)."""
    graph = view_graph()
    todo = [w for w in set(re.findall(r"\w+", text)) if w in graph and w not in defined]
    need: set[str] = set()
    while todo:
        v = todo.pop()
        if v in need or v in defined:
            continue
        need.add(v)
        todo.extend(graph[v][2])
    return sorted(need, key=lambda v: graph[v][0])


def views_needed(text: str, defined: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The CREATE statements of the views of ``sql/`` that ``text`` (a query) names and
    that are not in ``defined``, with the views they read, in file order
    (:func:`views_closure`)."""
    graph = view_graph()
    return [graph[v][1] for v in views_closure(text, defined)]

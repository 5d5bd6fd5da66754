"""The store's views. The analysis views, as SQL: every ``sql/*.sql`` file holds CREATE
VIEW statements over the canonical tables (files run in name order, so a view may use views
of earlier files). The tables' views over their committed Parquet files
(:class:`TableViews`, older stores read through :mod:`.compat`), and the connection that
defines only the views a statement names (:class:`LazyViews`)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..safety import sql_identifier, sql_literal
from ..version import __version__
from . import schema
from .compat import column_sql
from .files import has_files
from .paths import table_glob

if TYPE_CHECKING:
    import duckdb

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
                first = comments[head]
                assert first is not None   # found as a comment line
                para = [first[len(name) + 1:].strip()]
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


# ---------------------------------------------------------------------- the tables' views
_PARQUET_OPTS = "hive_partitioning=true, hive_types={'run_id': VARCHAR}, union_by_name=true"


class TableViews:
    """The views of the contract tables of the store at ``path`` and the statements that
    define every view on a connection. ``scratch`` gives a connection to read Parquet
    footers on (cached in ``footers``) when a table's files predate a contract column
    (:mod:`.compat`)."""

    def __init__(self, path: Path, scratch: Callable[[], duckdb.DuckDBPyConnection], footers: dict[str, Any]):
        self.path, self._scratch, self._footers = path, scratch, footers

    def view_sql(self, table: str, relative: bool, present: set[str] | None = None,
                 files: dict[str, tuple[str, ...]] | None = None) -> str:
        """A table's view. Tables other than ``runs`` show only committed runs (whose
        ``runs`` row is in place: it is renamed last), so a reader never sees part of a run
        being written or left by a crash; readers never recover.

        ``files``: the committed files of every table (``Writer.committed_files``): the
        view reads exactly those (a list, not a glob), so a reader never sees part of an
        append either; the store defines the views again when that set changes. The
        catalog (``relative``) reads globs (docs/hardening.md).

        ``present``: the columns the table's files hold, when some contract column is in
        none of them (a store written before that column existed): a nullable one reads
        NULL, any other is refused; a derivable one is computed where a file lacks it
        (:func:`.compat.column_sql`)."""
        ts = schema.get(table)
        name = sql_identifier(table)
        src: str | None
        if files is not None and not relative:
            listed = files.get(table, ())
            src = "[" + ", ".join(sql_literal(self.path / f) for f in listed) + "]" if listed else None
        else:
            src = sql_literal(table_glob(self.path, table, relative)) if has_files(self.path, table) else None
        if src is not None:
            cols = ", ".join(column_sql(self.path, table, c, present, self._scratch, self._footers)
                             for c in ts.column_names)
            committed = "" if table == "runs" else " WHERE run_id IN (SELECT run_id FROM \"runs\")"
            return (f"CREATE OR REPLACE VIEW {name} AS SELECT {cols} FROM read_parquet({src}, "
                    f"{_PARQUET_OPTS}){committed}")
        cols = ", ".join(f"CAST(NULL AS {schema.DUCK_TYPES[c.type]}) AS {sql_identifier(c.name)}" for c in ts.columns)
        return f"CREATE OR REPLACE VIEW {name} AS SELECT {cols} WHERE false"

    def statements(self, relative: bool = False, present: dict[str, set[str]] | None = None,
                   tables_only: bool = False, files: dict[str, tuple[str, ...]] | None = None,
                   tables: Iterable[str] | None = None) -> list[str]:
        """CREATE VIEW statements: one per contract table (``runs`` first: the others
        filter on it), then the analysis views. ``present``: {table: columns its files
        hold} for tables of an older store that lack a contract column. ``tables``: only
        these tables' views (with ``tables_only``; :func:`tables_read` closes a set)."""
        from .dense import expert_load_views

        present = present or {}
        chosen = sorted(schema.load_all() if tables is None else tables, key=lambda t: t != "runs")
        stmts = [self.view_sql(t, relative, present.get(t), files) for t in chosen]
        # expert_load = its long rows + the dense expert_counts rows unnested (docs/explanation/fleet-scale.md)
        if "expert_load" in chosen:
            stmts += expert_load_views(self.view_sql("expert_load", relative, present.get("expert_load"), files))
        return stmts if tables_only else stmts + view_statements()

    def _present_columns(self, con: duckdb.DuckDBPyConnection, table: str, relative: bool,
                         files: dict[str, tuple[str, ...]] | None = None) -> set[str]:
        if files is not None and not relative:
            glob = "[" + ", ".join(sql_literal(self.path / f) for f in files[table]) + "]"
        else:
            glob = sql_literal(table_glob(self.path, table, relative))
        rows = con.execute(f"DESCRIBE SELECT * FROM read_parquet({glob}, {_PARQUET_OPTS})").fetchall()
        return {r[0] for r in rows}

    def define(self, con: duckdb.DuckDBPyConnection, relative: bool = False, tables_only: bool = False,
               files: dict[str, tuple[str, ...]] | None = None, tables: Iterable[str] | None = None) -> None:
        """Create every view on ``con`` (``tables_only``: the tables' views, not those of
        ``sql/``) over ``files`` (the catalog, ``relative``: over globs). A store written
        before a contract column existed (no file of the table holds it) fails to bind;
        then the views are made again with that column NULL (or derived): older stores are
        read as they are, never rewritten."""
        from .duck import duckdb

        try:
            for stmt in self.statements(relative, tables_only=tables_only, files=files, tables=tables):
                con.execute(stmt)
            return
        except duckdb.BinderException as e:
            first = e
        present = {}
        for t in (schema.load_all() if tables is None else tables):
            if (files.get(t) if files is not None and not relative else has_files(self.path, t)):
                cols = self._present_columns(con, t, relative, files)
                if set(schema.get(t).column_names) - cols:
                    present[t] = cols
        if not present:
            why = str(first).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot define the store's views ({why}); the store may have been "
                             f"written by another moetrace version than {__version__}") from None
        try:
            for stmt in self.statements(relative, present, tables_only=tables_only, files=files, tables=tables):
                con.execute(stmt)
        except duckdb.Error as e:
            why = str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot read this store's tables ({why}); it was written by another "
                             f"moetrace version than {__version__}: re-ingest the sources into a new store") from None


def tables_read(words: Iterable[str]) -> set[str]:
    """The contract tables whose views a statement naming ``words`` needs: those it names,
    ``expert_load`` and ``expert_counts`` for ``expert_load``/``expert_load_long`` (one view
    of both, storage/dense.py), and ``runs`` (every other table's view filters on it)."""
    words = set(words)
    known = schema.load_all()
    need = {w for w in words if w in known}
    if "expert_load" in need or "expert_load_long" in words:
        need |= {"expert_load", "expert_counts"}
    need.discard("expert_load_long")
    return need | {"runs"} if need else need


def main_schema(con: Any) -> str:
    """The connection's own schema, fully qualified: a bare ``main.x`` would also find the
    TEMP table ``x`` (the temp catalog has a schema named main too)."""
    db = con.execute("SELECT current_database()").fetchall()[0][0]
    return '"' + db.replace('"', '""') + '".main'


def _view_name(stmt: str) -> str:
    m = _VIEW_RE.match(stmt)
    if m is None:
        raise ValueError(f"not a CREATE VIEW statement: {stmt[:80]!r}")
    return m.group(1)


class LazyViews:
    """A DuckDB connection of a store whose views (of the tables and of ``sql/``) are
    created when a statement run through it (``execute``, ``sql``) first names them, with
    the views they read: defining all of them costs more than a small query (a small
    command's start-up); anything else is the connection's own.

    ``define_tables(tables)`` defines the views of those contract tables on ``raw`` (the
    store's committed files); ``path`` names the store in errors."""

    def __init__(self, raw: Any, path: Path, define_tables: Callable[[set[str]], None]):
        self.raw, self._path, self._define_tables = raw, path, define_tables
        self._defined: set[str] = set()
        self.tables: set[str] = set()       # tables whose views are defined
        self._shadowed: set[str] = set()    # views a TEMP table of :meth:`temp_table` stands in for

    def _needed(self, query: str) -> list[str]:
        """The CREATE statements of the views ``query`` needs that are neither defined nor
        shadowed, after defining the tables' views that they and ``query`` read."""
        stmts = views_needed(query, self._defined | self._shadowed)
        words = set(re.findall(r"\w+", query))
        for stmt in stmts:
            words |= set(re.findall(r"\w+", stmt))
        need = tables_read(words) - self.tables
        if need:
            self._define_tables(need)
            self.tables |= need
        return stmts

    def _ensure(self, query: object) -> None:
        if not isinstance(query, str):
            return
        for stmt in self._needed(query):
            self._create(stmt)

    def temp_table(self, view: str, where: str, params: Iterable[Any] = ()) -> None:
        """``CREATE OR REPLACE TEMP TABLE view AS SELECT * FROM view WHERE where``: the view
        and the views it reads that are not defined yet inlined as CTEs (NOT MATERIALIZED:
        planned as the views are) instead of being created first. DuckDB then binds the
        chain once: creating each view binds every view below it again (a tiny run's
        layer_skew: the definitions cost several times the query).
        The TEMP table shadows the view until :meth:`unshadow`."""
        self._shadowed.discard(view)        # replaced: made from the view again
        stmts = self._needed(f'SELECT * FROM "{view}"')
        ctes = []
        for stmt in stmts:
            m = _VIEW_RE.match(stmt)
            assert m is not None   # every statement of view_graph matched it
            body = stmt[m.end():].lstrip()
            if not body[:2].upper() == "AS":
                raise ValueError(f"not a CREATE VIEW ... AS statement: {stmt[:80]!r}")
            ctes.append(f'"{m.group(1)}" AS NOT MATERIALIZED ({body[2:].strip()})')
        if any(_view_name(s) == view for s in stmts):
            src = f'"{view}"'
        else:   # a view defined on the connection: its own schema's, not a TEMP table of that name
            src = f'{main_schema(self.raw)}."{view}"'
        with_ = ("WITH " + ",\n".join(ctes) + "\n") if ctes else ""
        self.raw.execute(f'CREATE OR REPLACE TEMP TABLE "{view}" AS {with_}SELECT * FROM {src} WHERE {where}',
                         list(params))
        self._shadowed.add(view)

    def unshadow(self, names: Iterable[str]) -> None:
        """The TEMP tables ``names`` were dropped: their views are defined again when named,
        and so are the views defined while they stood in for them (which read them)."""
        dropped = set(names) & self._shadowed
        if not dropped:
            return
        self._shadowed -= dropped
        graph = view_graph()
        stale, grew = set(dropped), True
        while grew:
            more = {v for v in self._defined if v not in stale and v in graph and graph[v][2] & stale}
            grew = bool(more)
            stale |= more
        self._defined -= stale

    def _create(self, stmt: str) -> None:
        from .duck import duckdb

        try:
            self.raw.execute(stmt)
        except duckdb.Error as e:   # as an eager definition of every view reports it
            why = str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self._path}: cannot define the store's views ({why}); the store may have been "
                             f"written by another moetrace version than {__version__}") from None
        self._defined.add(_view_name(stmt))

    def redefine(self) -> None:
        """Create again the views defined so far (after the tables' views were)."""
        graph = view_graph()
        for v in sorted(self._defined, key=lambda v: graph[v][0]):
            self._create(graph[v][1])

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        from .duck import needs_full

        needs_full()
        self._ensure(query)
        return self.raw.execute(query, *args, **kwargs)

    def sql(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        from .duck import full

        full()
        self._ensure(query)
        return self.raw.sql(query, *args, **kwargs)

    def close(self) -> None:
        self.raw.close()

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self.raw, name)
        except AttributeError:   # a method of the duckdb package's Python layer (duck.full)
            from .duck import full

            full()
            return getattr(self.raw, name)

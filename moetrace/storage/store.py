"""The trace store: a folder of hive-partitioned Parquet, one contract per table.

Layout::

    STORE/
      moetrace-store.json            marker (store format version)
      <table>/run_id=<id>/part-<txid>-<n>.parquet
      catalog.duckdb                 optional: views with store-relative paths
      .txn/ .staging/ .lock          transaction journal, staging area, write lock

Writes are transactions: every table of a run is written to ``.staging`` first, a journal
lists the final paths, files are renamed into place (``runs`` last), then the journal is
removed. A crash leaves either a journal (rolled back, or forward when the ``runs`` row
made it, on the next write) or nothing: never a half-written partition. Appends (plans,
replays, calibrations) are the same transaction, their header table (``plans``,
``replay_runs``) renamed last. Readers read the files of committed transactions only
(``Transactions.committed_files``), looked up again on every query, so they never see
half of a write and see new files without reopening. Validation happens before anything touches the
disk, so bad input leaves the store byte-for-byte as it was.

Hostile stores (docs/hardening.md): readers never write and never recover; their views
show only committed runs (rows whose ``runs`` row is in place), so a reader polling during
a slow write, or after a crash, never sees part of a run. Writers recover first, and
recovery only ever removes files it can recognise as its own: journals named
``.txn/<txid>.json`` whose every entry is ``<table>/run_id=<id>/part-<txid>.parquet`` of a
known table, and ``.staging/<txid>/`` folders; no path component may be a symlink. A
journal that does not match is refused with one line and nothing is changed.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..safety import sql_identifier, sql_literal
from ..version import __version__
from . import schema
from .paths import GLOB_CHARS, STORE_FORMAT, STORE_MARKER, check_store_path
from .txn import Transactions

if TYPE_CHECKING:   # duckdb, pyarrow and polars are imported where a path needs them (start-up: issue #26)
    import duckdb
    import polars as pl
    import pyarrow as pa

    from ..output import Rows


_DUCK_TYPES = {"string": "VARCHAR", "bool": "BOOLEAN", "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER",
               "int64": "BIGINT", "float32": "FLOAT", "float64": "DOUBLE", "int64[]": "BIGINT[]"}
#: required columns added to a contract after stores were written without them, and how a
#: view computes them from such a store's files (the writer's definition is the reference:
#: ``tokens_desc`` is ``dense_table``'s counts sorted descending)
DERIVED_WHEN_MISSING = {("expert_counts", "tokens_desc"): "list_reverse_sort(tokens)"}


def query_arrow(con: duckdb.DuckDBPyConnection, query: str, params=None) -> pa.Table | None:
    """Run ``query`` and return its rows as Arrow (None for statements without rows),
    across DuckDB versions (fetch_arrow_table became to_arrow_table in 2.0)."""
    import pyarrow as pa

    rel = con.sql(query, params=params) if params is not None else con.sql(query)
    if rel is None:
        return None
    fn = getattr(rel, "to_arrow_table", None) or rel.arrow
    out = fn()
    if isinstance(out, pa.RecordBatchReader):
        out = out.read_all()
    return out


def _narrow_hugeints(df: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums BIGINTs into HUGEINT (Decimal(38,0) in polars); bring them back to Int64
    when every value fits, so results behave like integers (numpy, arithmetic)."""
    import polars as pl

    casts = []
    for name, dtype in df.schema.items():
        if isinstance(dtype, pl.Decimal) and (dtype.scale or 0) == 0:
            col = df[name]
            mx, mn = col.max(), col.min()
            if mx is None or (abs(int(mx)) < 2**63 and abs(int(mn)) < 2**63):
                casts.append(pl.col(name).cast(pl.Int64))
    return df.with_columns(casts) if casts else df


TableLike = "pa.Table | pl.DataFrame | dict | Iterable[pa.Table]"


class Store(Transactions):
    """A moetrace store folder. ``Store(path)`` opens (``create=True`` makes it)."""

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(path)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._scratch_con: duckdb.DuckDBPyConnection | None = None
        self._footers: dict = {}    # check.footer_columns' cache: each footer read once per Store
        self._views_files: dict[str, tuple[str, ...]] | None = None
        check_store_path(self.path)
        marker = self.path / STORE_MARKER
        if not marker.exists():
            if not create:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no such store")
                if not self.path.is_dir():
                    raise StoreError(f"{self.path}: not a folder")
                if any(self.path.iterdir()):
                    raise StoreError(f"{self.path}: not a moetrace store (no {STORE_MARKER})")
                return  # an empty folder reads as an empty store; a read never writes
            self._init()
            return
        self._check_format(marker)
        if create:
            self._recover_if_abandoned()  # a writer's open: crash leftovers go now

    def _check_format(self, marker: Path) -> None:
        """The marker names the store format: a store of a newer format (or a marker that
        is not one) is refused with one line before anything reads its tables."""
        try:
            raw = b""
            if marker.is_file():  # not a FIFO or device; a few KiB at most are read
                with open(marker, "rb") as f:
                    raw = f.read(1 << 16)
            doc = json.loads(raw)
            fmt = doc["moetrace_store_format"]
            ok = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= 1
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            ok, doc, fmt = False, None, None
        if not ok:
            raise StoreError(f"{marker}: not a moetrace store marker (expected JSON with an integer "
                             f"moetrace_store_format); nothing was read")
        if fmt > STORE_FORMAT:
            by = str(doc.get("created_by", "a newer moetrace"))[:40]
            raise StoreError(f"{self.path}: store format {fmt} (written by moetrace {by}); this moetrace "
                             f"({__version__}) reads format {STORE_FORMAT} or older: upgrade moetrace to read it")

    # ------------------------------------------------------------------ creation, locking
    def _init(self) -> None:
        if (self.path / STORE_MARKER).exists():
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            import uuid  # here: read-only commands never make an id (start-up)
            tmp = self.path / f".{STORE_MARKER}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"  # unique: racing creators
            tmp.write_text(json.dumps({"moetrace_store_format": STORE_FORMAT, "created_by": __version__}) + "\n")
            os.replace(tmp, self.path / STORE_MARKER)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot create store: {e.strerror}") from None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self._check_no_symlinks()
        self.journals()  # a malformed journal is refused before anything (even .lock) is created
        lock_path = self.path / ".lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise StoreError(f"{self.path}: store is not writable ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _check_writable(self) -> None:
        if not os.access(self.path, os.W_OK):
            raise StoreError(f"{self.path}: store is read-only; nothing was written")


    # ------------------------------------------------------------------ reading
    def table_glob(self, table: str, relative: bool = False) -> str:
        base = Path(table) if relative else self.path / table
        return str(base / "*" / "*.parquet")

    def has_files(self, table: str) -> bool:
        d = self.path / table
        return d.is_dir() and any(d.glob("run_id=*/*.parquet"))

    def _view_sql(self, table: str, relative: bool, present: set[str] | None = None,
                  files: dict[str, tuple[str, ...]] | None = None) -> str:
        """A table's view. Tables other than ``runs`` show only committed runs (whose
        ``runs`` row is in place: it is renamed last), so a reader never sees part of a run
        being written or left by a crash; readers never recover.

        ``files``: the committed files of every table (:meth:`committed_files`): the view
        reads exactly those (a list, not a glob), so a reader never sees part of an append
        either; :attr:`con` defines the views again when that set changes. The catalog
        (``relative``) reads globs (docs/hardening.md).

        ``present``: the columns the table's files hold, when some contract column is in
        none of them (a store written before that column existed): a nullable one reads
        NULL, any other is refused; one in :data:`DERIVED_WHEN_MISSING` is computed where
        a file lacks it (:meth:`_column_sql`)."""
        ts = schema.get(table)
        name = sql_identifier(table)
        if files is not None and not relative:
            listed = files.get(table, ())
            src = "[" + ", ".join(sql_literal(self.path / f) for f in listed) + "]" if listed else None
        else:
            src = sql_literal(self.table_glob(table, relative)) if self.has_files(table) else None
        if src is not None:
            glob = src
            cols = ", ".join(self._column_sql(table, c, present) for c in ts.column_names)
            committed = "" if table == "runs" else " WHERE run_id IN (SELECT run_id FROM \"runs\")"
            return (f"CREATE OR REPLACE VIEW {name} AS SELECT {cols} FROM read_parquet({glob}, "
                    f"hive_partitioning=true, hive_types={{'run_id': VARCHAR}}, union_by_name=true){committed}")
        cols = ", ".join(f"CAST(NULL AS {_DUCK_TYPES[c.type]}) AS {sql_identifier(c.name)}" for c in ts.columns)
        return f"CREATE OR REPLACE VIEW {name} AS SELECT {cols} WHERE false"

    def _column_sql(self, table: str, column: str, present: set[str] | None) -> str:
        """One column of a table's view: the column itself, or what stands for it where the
        table's files predate it. A derived column (:data:`DERIVED_WHEN_MISSING`) is looked
        up in every file's footer, since a store that was written on after an upgrade holds
        both kinds of file (the column read NULL from the older ones): it is the column
        where every file has it, computed where none has, and the two coalesced otherwise."""
        ident = sql_identifier(column)
        if (table, column) in DERIVED_WHEN_MISSING:
            lacking, total = self._files_lacking(table, column)
            if lacking == 0:
                return ident
            derived = DERIVED_WHEN_MISSING[table, column]
            return f"{derived} AS {ident}" if lacking == total else f"coalesce({ident}, {derived}) AS {ident}"
        if present is None or column in present:
            return ident
        return f"{self._missing_column(table, column)} AS {ident}"

    def _files_lacking(self, table: str, column: str) -> tuple[int, int]:
        """(files of ``table`` whose footer lacks ``column``, files of ``table``); a file
        whose footer cannot be read counts as lacking it (the view then coalesces, which
        is right either way)."""
        files = list((self.path / table).glob("*/*.parquet"))  # what the view reads (table_glob)
        if not files:
            return 0, 0
        from .check import footer_columns
        from .engine import duckdb

        try:   # every footer in one DuckDB query (no pyarrow: start-up, issue #26)
            held = footer_columns(self._scratch(), files, self._footers)
        except duckdb.Error:
            held = None
        if held is None or len(held) != len(files):   # a footer DuckDB cannot read: file by file
            import pyarrow as pa
            import pyarrow.parquet as pq

            held = {}
            for f in files:
                try:
                    held[str(f)] = [(n, None) for n in pq.read_schema(f).names]
                except (OSError, pa.ArrowException):
                    pass
        lacking = sum(column not in {n for n, _ in held.get(str(f), ())} for f in files)
        return lacking, len(files)

    def _missing_column(self, table: str, column: str) -> str:
        """The SQL that stands for ``column`` in a store whose ``table`` files predate it."""
        col = next(c for c in schema.get(table).columns if c.name == column)
        if col.nullable:
            return f"CAST(NULL AS {_DUCK_TYPES[col.type]})"
        found = sorted(self.file_versions(table)) or ["unknown"]
        raise StoreError(f"{self.path}: table {table!r} was written with schema version {', '.join(found)}, whose files "
                         f"lack the required column {column!r} of version {schema.get(table).version}; this moetrace "
                         f"({__version__}) cannot read it: re-ingest the sources into a new store, or read it with "
                         f"the moetrace that wrote it")

    def file_versions(self, table: str) -> set[str]:
        """The schema versions recorded in the footers of ``table``'s files."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        out = set()
        for f in (self.path / table).glob("run_id=*/*.parquet"):
            try:
                meta = pq.read_schema(f).metadata or {}
            except (OSError, pa.ArrowException):
                continue
            out.add(meta.get(schema.META_VERSION, b"none").decode(errors="replace"))
        return out

    def _present_columns(self, con: duckdb.DuckDBPyConnection, table: str, relative: bool,
                         files: dict[str, tuple[str, ...]] | None = None) -> set[str]:
        if files is not None and not relative:
            glob = "[" + ", ".join(sql_literal(self.path / f) for f in files[table]) + "]"
        else:
            glob = sql_literal(self.table_glob(table, relative))
        rows = con.execute(f"DESCRIBE SELECT * FROM read_parquet({glob}, hive_partitioning=true, "
                           f"hive_types={{'run_id': VARCHAR}}, union_by_name=true)").fetchall()
        return {r[0] for r in rows}

    def _define_views(self, con: duckdb.DuckDBPyConnection, relative: bool = False, tables_only: bool = False,
                      files: dict[str, tuple[str, ...]] | None = None, tables=None) -> None:
        """Create every view on ``con`` (``tables_only``: the tables' views, not those of
        ``sql/``): over ``files`` (default: the committed files now; the catalog,
        ``relative``, over globs). A store written before a contract column existed
        (no file of the table holds it) fails to bind; then the views are made again with
        that column NULL (or derived): older stores are read as they are, never rewritten."""
        from .engine import duckdb

        if files is None and not relative:
            files = self.committed_files()
        # the files the store's own connection's views read (a plain connection set by the
        # caller included: else refresh() would define every view again at every access)
        if not relative and (self._con is None or con is self._con or con is getattr(self._con, "raw", None)):
            self._views_files = files
        try:
            for stmt in self.view_statements(relative, tables_only=tables_only, files=files, tables=tables):
                con.execute(stmt)
            return
        except duckdb.BinderException as e:
            first = e
        present = {}
        for t in (schema.load_all() if tables is None else tables):
            if (files.get(t) if files is not None and not relative else self.has_files(t)):
                cols = self._present_columns(con, t, relative, files)
                if set(schema.get(t).column_names) - cols:
                    present[t] = cols
        if not present:
            why = str(first).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot define the store's views ({why}); the store may have been "
                             f"written by another moetrace version than {__version__}") from None
        try:
            for stmt in self.view_statements(relative, present, tables_only=tables_only, files=files, tables=tables):
                con.execute(stmt)
        except duckdb.Error as e:
            why = str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot read this store's tables ({why}); it was written by another "
                             f"moetrace version than {__version__}: re-ingest the sources into a new store") from None

    def view_statements(self, relative: bool = False, present: dict[str, set[str]] | None = None,
                        tables_only: bool = False, files: dict[str, tuple[str, ...]] | None = None,
                        tables=None) -> list[str]:
        """CREATE VIEW statements: one per contract table (``runs`` first: the others
        filter on it), then the analysis views. ``present``: {table: columns its files
        hold} for tables of an older store that lack a contract column. ``tables``: only
        these tables' views (with ``tables_only``; :func:`tables_read` closes a set)."""
        from .dense import expert_load_views
        from .views import view_statements as analysis_views

        present = present or {}
        tables = sorted(schema.load_all() if tables is None else tables, key=lambda t: t != "runs")
        stmts = [self._view_sql(t, relative, present.get(t), files) for t in tables]
        # expert_load = its long rows + the dense expert_counts rows unnested (docs/explanation/fleet-scale.md)
        if "expert_load" in tables:
            stmts += expert_load_views(self._view_sql("expert_load", relative, present.get("expert_load"), files))
        return stmts if tables_only else stmts + analysis_views()

    def connect(self, threads: int | None = None, memory_limit: str | None = None,
                tables_only: bool = False, _base=None, _no_views: bool = False) -> duckdb.DuckDBPyConnection:
        """A fresh in-memory DuckDB connection with every view defined. Never writes:
        no recovery (the views hide uncommitted runs), spills go to the store's
        ``.duckdb_tmp`` only when DuckDB needs to spill."""
        from ..safety import memory_limit as check_memory_limit

        if _base is None:   # a connection for any use: the package's every method (engine.full)
            from .engine import full

            con = full().connect(":memory:")
        else:
            con = _base
        # DuckDB draws a progress bar on stderr for queries past 2 s, even when stderr is a
        # pipe; stderr carries moetrace's own one-line notes and errors only
        con.execute("SET enable_progress_bar=false")
        if threads:
            con.execute(f"SET threads={int(threads)}")
        if memory_limit:
            con.execute(f"SET memory_limit={sql_literal(check_memory_limit(memory_limit))}")
        self.check_readable(con)
        tmp = self.path / ".duckdb_tmp"
        if os.access(self.path, os.W_OK) and not tmp.is_symlink():
            con.execute(f"SET temp_directory={sql_literal(tmp)}")
        if _no_views:   # Store.con: _LazyViews defines each view when a statement first names it
            self._views_files = self.committed_files()
        else:
            self._define_views(con, tables_only=tables_only)
        return con

    def check_readable(self, con=None) -> None:
        """A file readers would trip on (truncated, garbage, wrong schema or partition) is
        one line naming it (moetrace/storage/check.py); checked once per Store (the footers
        read on ``con``, else on :meth:`_scratch`)."""
        if not getattr(self, "_readable", False):
            from .check import check_readable

            check_readable(self.path, con if con is not None else self._scratch(), self._footers)
            self._readable = True

    def _scratch(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection for reads that need no view (footers, the runs files): the
        store's own connection once it has one, else one that :attr:`con` later takes as
        its own, so a command opens one DuckDB database, not several (each costs tens of
        milliseconds: start-up, issue #26)."""
        if self._con is not None:
            return self._con.raw if isinstance(self._con, _LazyViews) else self._con
        if self._scratch_con is None:
            from .engine import duckdb, needs_full

            needs_full()
            self._scratch_con = duckdb.connect(":memory:")
        return self._scratch_con

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The store's connection. Its views of ``sql/`` are defined when a statement
        first names them (with the views they read): defining all of them costs more than
        a small query (issue #26); :meth:`connect` and the catalog define every view.
        The tables' views read the committed files as of the last access: each access
        looks again (two folder scans and the journals, no file is opened) and defines the
        views again when another writer committed since, so a reader sees new runs, plans
        and tables without reopening the store."""
        if self._con is None:   # the scratch connection becomes the store's (footer reads while
            base = self._scratch()   # the views are defined go to it too)
            self._con = _LazyViews(self, self.connect(tables_only=True, _base=base, _no_views=True))
            self._scratch_con = None
        else:
            self.refresh()
        return self._con

    def refresh(self) -> None:
        """Re-create the views when the committed files changed (a write landed)."""
        if self._con is not None:
            files = self.committed_files()
            if files != self._views_files:
                if isinstance(self._con, _LazyViews):
                    self._define_views(self._con.raw, tables_only=True, files=files, tables=self._con.tables)
                    self._con.redefine()
                else:   # a plain connection from connect() set by the caller: every view again
                    self._define_views(self._con, files=files)

    def sql(self, query: str, params=None) -> pl.DataFrame:
        """Run SQL over the store's views and return a polars DataFrame."""
        import duckdb
        import polars as pl

        try:
            tbl = query_arrow(self.con, query, params)
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None
        if tbl is None or not tbl.num_columns:
            return pl.DataFrame()
        return _narrow_hugeints(pl.from_arrow(tbl))

    def rows(self, query: str, params=None) -> Rows:
        """Run SQL over the store's views and return its rows as DuckDB gives them
        (:class:`moetrace.output.Rows`: no polars, no Arrow; what ``moetrace runs`` and
        ``moetrace skew`` print, issue #26)."""
        from ..output import Rows
        from .engine import duckdb

        try:
            cur = self.con.execute(query, params) if params is not None else self.con.execute(query)
            desc = cur.description or []
            return Rows([d[0] for d in desc], [str(d[1]) for d in desc], cur.fetchall() if desc else [])
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def copy_parquet(self, query: str, params, path) -> int:
        """Write the rows of ``query`` to the Parquet file ``path`` with DuckDB's COPY (no
        polars, no Arrow: ``moetrace skew -o x.parquet``); returns the rows written."""
        from ..safety import sql_literal as lit
        from .engine import duckdb

        try:
            return int(self.con.execute(f"COPY ({query}) TO {lit(path)} (FORMAT parquet)", params).fetchall()[0][0])
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def arrow(self, query: str, params=None) -> pa.Table:
        return query_arrow(self.con, query, params)

    def numpy(self, query: str, params=None) -> dict:
        """Run SQL over the store's views and return its columns as numpy arrays (DuckDB's
        ``fetchnumpy``: no polars, no Arrow, no pandas; the replay's path, issue #26)."""
        import duckdb

        try:
            return self.con.execute(query, params).fetchnumpy()
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def runs(self) -> pl.DataFrame:
        """The runs rows (contract columns; nullable ones an older file lacks are NULL, a
        required one is refused: :meth:`_missing_column`), oldest first.
        Read from the runs partitions directly (no SQL view is built: ``moetrace runs``); a
        runs file is renamed into place last, so every row here is a committed run. Never
        writes. The rows of :meth:`runs_rows` (the one reader), typed by the contract."""
        import polars as pl

        pl_types = {"string": pl.Utf8, "bool": pl.Boolean, "int8": pl.Int8, "int16": pl.Int16, "int32": pl.Int32,
                    "int64": pl.Int64, "float32": pl.Float32, "float64": pl.Float64, "int64[]": pl.List(pl.Int64)}
        want = {c.name: pl_types[c.type] for c in schema.get("runs").columns}
        rows = self.runs_rows()
        assert list(rows.columns) == list(want)
        return pl.DataFrame(rows.rows, schema=want, orient="row")

    def runs_rows(self) -> Rows:
        """:meth:`runs` as :class:`moetrace.output.Rows`, read by DuckDB from the runs
        partitions (no view is built, no polars, no Arrow: ``moetrace runs``, issue #26)."""
        from ..output import Rows
        from .check import footer_columns
        from .engine import duckdb

        cols = schema.get("runs").columns
        files = [f for part in sorted((self.path / "runs").glob("run_id=*")) for f in sorted(part.glob("*.parquet"))]
        self.check_readable()
        if not files:
            return Rows([c.name for c in cols], [_DUCK_TYPES[c.type] for c in cols], [])
        con = self._scratch()
        try:
            held = footer_columns(con, files, self._footers)
            present = set()
            for f in files:  # a required column older files lack is refused, as the views do
                names = {n for n, _ in held.get(str(f), ())}
                present |= names
                for c in cols:
                    if not c.nullable and c.name != "run_id" and c.name not in names:
                        self._missing_column("runs", c.name)
            exprs = ", ".join(sql_identifier(c.name) if c.name in present or c.name == "run_id"
                              else f"CAST(NULL AS {_DUCK_TYPES[c.type]}) AS {sql_identifier(c.name)}" for c in cols)
            src = "[" + ", ".join(sql_literal(f) for f in files) + "]"
            cur = con.execute(f"SELECT {exprs} FROM read_parquet({src}, hive_partitioning=true, "
                              "hive_types={'run_id': VARCHAR}, union_by_name=true) "
                              "ORDER BY ingested_at_ns NULLS FIRST, run_id NULLS FIRST")
            return Rows([d[0] for d in cur.description], [str(d[1]) for d in cur.description], cur.fetchall())
        except duckdb.Error as e:
            raise StoreError(f"{self.path}: cannot read the runs table ({' '.join(str(e).split())[:200]})") from None

    def partition_rows(self, dense_as_expert_load: bool = False, run_id: str | None = None,
                       tables=None) -> list[tuple[str, str, int]]:
        """(run_id, table, rows) of every partition (of ``run_id`` and ``tables`` when
        given), read from Parquet footers by DuckDB (no data scan). ``dense_as_expert_load``:
        expert_load also counts the rows its view shows of the dense expert_counts rows (one
        per list element, from the footers)."""
        from .engine import duckdb

        parts = []
        for t in (schema.load_all() if tables is None else tables):
            d = self.path / t
            if d.is_dir():
                found = d.glob("run_id=*") if run_id is None else [p for p in [d / f"run_id={run_id}"] if p.is_dir()]
                parts += [(p.name.split("=", 1)[1], t, list(p.glob("*.parquet"))) for p in found]
        files = [str(f) for _, _, fs in parts for f in fs]
        dense = [str(f) for _, t, fs in parts if t == "expert_counts" for f in fs] if dense_as_expert_load else []
        nrows: dict[str, int] = {}
        values: dict[str, int] = {}
        if files:
            con = self._scratch()
            try:
                src = "[" + ", ".join(sql_literal(f) for f in files) + "]"
                nrows = dict(con.execute(f"SELECT file_name, num_rows FROM parquet_file_metadata({src})").fetchall())
                if dense:   # the first column named tokens* (tokens, before tokens_desc): its values
                    src = "[" + ", ".join(sql_literal(f) for f in dense) + "]"
                    values = dict(con.execute(
                        "WITH m AS (SELECT file_name, column_id, num_values, path_in_schema FROM "
                        f"parquet_metadata({src})), c AS (SELECT file_name, min(column_id) AS col FROM m "
                        "WHERE starts_with(path_in_schema, 'tokens') GROUP BY file_name) "
                        "SELECT m.file_name, sum(m.num_values) FROM m JOIN c ON c.file_name = m.file_name "
                        "AND c.col = m.column_id GROUP BY m.file_name").fetchall())
            except duckdb.Error as e:
                raise StoreError(f"{self.path}: cannot read a footer ({' '.join(str(e).split())[:200]})") from None
        out = [(run, t, sum(int(nrows[str(f)]) for f in fs)) for run, t, fs in parts]
        if dense_as_expert_load:
            extra = {run: sum(int(values.get(str(f), 0)) for f in fs) for run, t, fs in parts if t == "expert_counts"}
            seen = set()
            for i, (run, t, n) in enumerate(out):
                if t == "expert_load" and run in extra:
                    out[i] = (run, t, n + extra[run])
                    seen.add(run)
            out += [(run, "expert_load", n) for run, n in sorted(extra.items()) if run not in seen]
        return out

    def run_ids(self) -> list[str]:
        d = self.path / "runs"
        if not d.is_dir():
            return []
        return sorted(p.name.split("=", 1)[1] for p in d.glob("run_id=*") if any(p.glob("*.parquet")))

    def run_row(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict."""
        got = self.rows("SELECT * FROM runs WHERE run_id = ?", [run_id])
        if got.height == 0:
            raise StoreError(f"{self.path}: no run {run_id!r} (runs: {', '.join(self.run_ids()) or 'none'})")
        return got.dicts()[0]

    def resolve_run(self, run_id: str | None) -> str:
        """The given run, or the only run of the store."""
        ids = self.run_ids()
        if run_id is not None:
            if run_id not in ids:
                raise StoreError(f"{self.path}: no run {run_id!r} (runs: {', '.join(ids) or 'none'})")
            return run_id
        if len(ids) == 1:
            return ids[0]
        if not ids:
            raise StoreError(f"{self.path}: the store holds no runs")
        raise StoreError(f"{self.path}: the store holds {len(ids)} runs; choose one (--run RUN_ID on the command "
                         f"line, store.run('RUN_ID') in Python): {', '.join(ids)}")

    def find_by_sha(self, sha: str) -> str | None:
        """The run ingested with dedupe key ``sha``: its ``ingest_key`` (source + options +
        asked run id), or its ``source_sha256`` when it was ingested without options."""
        if not self.has_files("runs"):
            return None
        cols = set(self.sql("SELECT * FROM runs LIMIT 0").columns)
        key = "coalesce(ingest_key, source_sha256)" if "ingest_key" in cols else "source_sha256"
        df = self.sql(f"SELECT run_id FROM runs WHERE {key} = ?", [sha])
        return df["run_id"][0] if df.height else None

    def row_counts(self) -> pl.DataFrame:
        """Rows per (run, table), read from Parquet footers (no data scan)."""
        import polars as pl

        return pl.DataFrame(self.partition_rows(), schema={"run_id": pl.Utf8, "table": pl.Utf8, "rows": pl.Int64},
                            orient="row")


    # ------------------------------------------------------------------ catalog
    def write_catalog(self) -> Path:
        """Write STORE/catalog.duckdb: the same views, with paths relative to the store.

        DuckDB resolves relative paths against ``file_search_path`` (or the working
        directory), so open it with ``cd STORE && duckdb catalog.duckdb`` or
        ``duckdb -cmd "SET file_search_path='STORE'" STORE/catalog.duckdb``.

        A write like the others: under the write lock, to a temporary file renamed into
        place (a crash leaves the old catalog and a temporary file that recovery removes).
        """
        if (self.path / STORE_MARKER).exists() and os.access(self.path, os.W_OK):
            with self._lock():
                return self._write_catalog()
        return self._write_catalog()

    def _write_catalog(self) -> Path:
        import duckdb

        target = self.path / "catalog.duckdb"
        import uuid  # here: read-only commands never make an id (start-up)
        tmp = self.path / f".catalog-{uuid.uuid4().hex[:8]}.duckdb"
        try:
            if not (self.path / STORE_MARKER).exists():
                raise StoreError(f"{self.path}: the store holds nothing yet; catalog not written")
            if target.is_symlink():
                raise StoreError(f"{target}: is a symlink; refused; catalog not written")
            con = duckdb.connect(":memory:")
            try:  # readable by older duckdb CLIs too
                con.execute(f"ATTACH {sql_literal(tmp)} AS cat (STORAGE_VERSION 'v1.0.0')")
            except duckdb.Error as e:
                if "storage" not in str(e).lower() and "version" not in str(e).lower():
                    raise
                con.execute(f"ATTACH {sql_literal(tmp)} AS cat")
            con.execute("USE cat")
            con.execute(f"SET file_search_path={sql_literal(self._search_path())}")
            self._define_views(con, relative=True)
            con.execute("USE memory")
            con.execute("DETACH cat")
            con.close()
            os.replace(tmp, target)
        except (OSError, duckdb.Error) as e:
            if isinstance(e, StoreError):
                raise
            if not os.access(self.path, os.W_OK) or getattr(e, "errno", None) in (errno.EACCES, errno.EROFS,
                                                                                    errno.EPERM):
                raise StoreError(f"{self.path}: store is read-only; catalog not written") from None
            why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot write catalog.duckdb ({why}); catalog not written") from None
        finally:
            for f in (tmp, Path(str(tmp) + ".wal")):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
        return target

    def _search_path(self) -> Path:
        """The store's folder as DuckDB's ``file_search_path`` while the catalog's views are
        bound: its absolute path, not the resolved one (a symlink is how a store under a
        folder with pattern characters is opened). The setting is a comma-separated list of
        folders whose entries are globbed: a ``,`` or a pattern character would bind the
        views to another folder's files, so such a path is refused."""
        where = self.path.absolute()
        bad = "".join(c for c in GLOB_CHARS + "," if c in str(where))
        if bad:
            raise StoreError(f"{where}: the store's full path holds {bad!r}, which DuckDB's file_search_path reads as "
                             f"a list or a pattern; catalog not written (open the store through a path without them)")
        return where

    def _refresh_catalog(self) -> str | None:
        """Rewrite catalog.duckdb when there is one. Runs after a commit: a failure is a
        warning (on stderr and returned), never an error for a write that landed."""
        if not (self.path / "catalog.duckdb").exists():
            return None
        import duckdb

        try:
            self.write_catalog()
        except (StoreError, OSError, duckdb.Error) as e:
            msg = f"catalog.duckdb not refreshed ({e}); the data was written; rerun `moetrace catalog {self.path}`"
            print(f"moetrace: warning: {msg}", file=sys.stderr)
            return msg
        return None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None
        if self._scratch_con is not None:
            self._scratch_con.close()
            self._scratch_con = None


def tables_read(words) -> set[str]:
    """The contract tables whose views a statement naming ``words`` needs: those it names,
    ``expert_load`` and ``expert_counts`` for ``expert_load``/``expert_load_long`` (one view
    of both, storage/dense.py), and ``runs`` (every other table's view filters on it)."""
    known = schema.load_all()
    need = {w for w in words if w in known}
    if "expert_load" in need or "expert_load_long" in words:
        need |= {"expert_load", "expert_counts"}
    need.discard("expert_load_long")
    return need | {"runs"} if need else need


def main_schema(con) -> str:
    """The connection's own schema, fully qualified: a bare ``main.x`` would also find the
    TEMP table ``x`` (the temp catalog has a schema named main too)."""
    db = con.execute("SELECT current_database()").fetchall()[0][0]
    return '"' + db.replace('"', '""') + '".main'


class _LazyViews:
    """A DuckDB connection of a store whose views (of the tables and of ``sql/``) are
    created when a statement run through it (``execute``, ``sql``) first names them, with
    the views they read: defining all of them costs more than a small query (issue #26);
    anything else is the connection's own."""

    def __init__(self, store: Store, con):
        self.raw, self._store, self._defined = con, store, set()
        self.tables: set[str] = set()       # tables whose views are defined
        self._shadowed: set[str] = set()    # views a TEMP table of :meth:`temp_table` stands in for

    def _needed(self, query: str) -> list[str]:
        """The CREATE statements of the views ``query`` needs that are neither defined nor
        shadowed, after defining the tables' views that they and ``query`` read."""
        import re

        from .views import views_needed

        stmts = views_needed(query, self._defined | self._shadowed)
        words = set(re.findall(r"\w+", query))
        for stmt in stmts:
            words |= set(re.findall(r"\w+", stmt))
        need = tables_read(words) - self.tables
        if need:
            self._store._define_views(self.raw, tables_only=True, files=self._store._views_files, tables=need)
            self.tables |= need
        return stmts

    def _ensure(self, query) -> None:
        if not isinstance(query, str):
            return
        for stmt in self._needed(query):
            self._create(stmt)

    def temp_table(self, view: str, where: str, params=()) -> None:
        """``CREATE OR REPLACE TEMP TABLE view AS SELECT * FROM view WHERE where``: the view
        and the views it reads that are not defined yet inlined as CTEs (NOT MATERIALIZED:
        planned as the views are) instead of being created first. DuckDB then binds the
        chain once: creating each view binds every view below it again (a tiny run's
        layer_skew: the definitions cost several times the query; start-up, issue #26).
        The TEMP table shadows the view until :meth:`unshadow`."""
        from .views import _VIEW_RE

        self._shadowed.discard(view)        # replaced: made from the view again
        stmts = self._needed(f'SELECT * FROM "{view}"')
        ctes = []
        for stmt in stmts:
            m = _VIEW_RE.match(stmt)
            body = stmt[m.end():].lstrip()
            if not body[:2].upper() == "AS":
                raise ValueError(f"not a CREATE VIEW ... AS statement: {stmt[:80]!r}")
            ctes.append(f'"{m.group(1)}" AS NOT MATERIALIZED ({body[2:].strip()})')
        if any(_VIEW_RE.match(s).group(1) == view for s in stmts):
            src = f'"{view}"'
        else:   # a view defined on the connection: its own schema's, not a TEMP table of that name
            src = f'{main_schema(self.raw)}."{view}"'
        with_ = ("WITH " + ",\n".join(ctes) + "\n") if ctes else ""
        self.raw.execute(f'CREATE OR REPLACE TEMP TABLE "{view}" AS {with_}SELECT * FROM {src} WHERE {where}',
                         list(params))
        self._shadowed.add(view)

    def unshadow(self, names) -> None:
        """The TEMP tables ``names`` were dropped: their views are defined again when named,
        and so are the views defined while they stood in for them (which read them)."""
        from .views import view_graph

        names = set(names) & self._shadowed
        if not names:
            return
        self._shadowed -= names
        graph = view_graph()
        stale, grew = set(names), True
        while grew:
            more = {v for v in self._defined if v not in stale and graph.get(v, (0, "", frozenset()))[2] & stale}
            grew = bool(more)
            stale |= more
        self._defined -= stale

    def _create(self, stmt: str) -> None:
        from .engine import duckdb
        from .views import _VIEW_RE

        try:
            self.raw.execute(stmt)
        except duckdb.Error as e:   # as an eager definition of every view reports it
            why = str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self._store.path}: cannot define the store's views ({why}); the store may have been "
                             f"written by another moetrace version than {__version__}") from None
        self._defined.add(_VIEW_RE.match(stmt).group(1))

    def redefine(self) -> None:
        """Create again the views defined so far (after the tables' views were)."""
        from .views import view_graph

        graph = view_graph()
        for v in sorted(self._defined, key=lambda v: graph[v][0]):
            self._create(graph[v][1])

    def execute(self, query, *args, **kwargs):
        from .engine import needs_full

        needs_full()
        self._ensure(query)
        return self.raw.execute(query, *args, **kwargs)

    def sql(self, query, *args, **kwargs):
        from .engine import full

        full()
        self._ensure(query)
        return self.raw.sql(query, *args, **kwargs)

    def close(self) -> None:
        self.raw.close()

    def __getattr__(self, name):
        try:
            return getattr(self.raw, name)
        except AttributeError:   # a method of the duckdb package's Python layer (engine.full)
            from .engine import full

            full()
            return getattr(self.raw, name)


def open_store(path: str | os.PathLike, create: bool = False) -> Store:
    """Open the store at ``path``. ``.sql(query)`` returns a polars DataFrame."""
    return Store(path, create=create)


def failed_write_leaves_no_trace(path: str | os.PathLike) -> bool:
    """True when a write into the store at ``path`` that fails and is rolled back leaves
    every file and folder of the store as it was: the store exists, was written before (its
    lock file is there) and holds no leftovers of another write (opening it for writing
    would clear those; the rollback removes its own staging folders)."""
    p = Path(path)
    return ((p / STORE_MARKER).is_file() and (p / ".lock").is_file() and not p.is_symlink()
            and not (p / ".staging").exists() and not (p / ".txn").exists())


def remove_empty_store(path: str | os.PathLike, top: str | os.PathLike) -> None:
    """Remove the store at ``path`` when it holds no run (its marker and lock file only, a
    write having been rolled back), and the empty folders above it up to ``top``: an
    ingest refused while writing into a store it created leaves nothing behind."""
    p, top = Path(path).absolute(), Path(top).absolute()
    if not p.is_dir() or p.is_symlink():
        return
    left = {c.name for c in p.iterdir()}
    if not left <= {STORE_MARKER, ".lock"}:
        return
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            (p / name).unlink()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == top or top not in p.parents:
            return
        p = p.parent

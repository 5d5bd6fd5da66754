"""The trace store: a folder of hive-partitioned Parquet, one contract per table.

Layout::

    STORE/
      moetrace-store.json            marker (store format version)
      <table>/run_id=<id>/part-<txid>-<n>.parquet
      catalog.duckdb                 optional: views with store-relative paths
      .txn/ .staging/ .lock          transaction journal, staging area, write lock

Jobs: this module opens a store (format check, recovery of a crashed writer), reads it
(DuckDB connections, SQL results as polars, Arrow, numpy or plain rows, the runs and
partitions from footers) and hands writes to its :class:`~.writer.Writer`; the views'
SQL is :mod:`.views`, older stores :mod:`.compat`, the catalog file :mod:`.catalog`.

Writes are transactions: every table of a run is written to ``.staging`` first, a journal
lists the final paths, files are renamed into place (``runs`` last), then the journal is
removed. A crash leaves either a journal (rolled back, or forward when the ``runs`` row
made it, on the next write) or nothing: never a half-written partition. Appends (plans,
replays, calibrations) are the same transaction, their header table (``plans``,
``replay_runs``) renamed last. Readers read the files of committed transactions only
(:meth:`.writer.Writer.committed_files`), looked up again on every query, so they never see
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

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..safety import sql_identifier, sql_literal
from . import schema
from .compat import file_versions, missing_column
from .files import has_files, run_ids, walk
from .paths import STORE_MARKER, check_store_path, table_glob
from .views import LazyViews, TableViews
from .writer import Journal, Writer, WriteResult

if TYPE_CHECKING:   # duckdb, pyarrow and polars are imported where a path needs them (start-up)
    import duckdb
    import polars as pl
    import pyarrow as pa

    from ..output import Rows


def query_arrow(con: Any, query: str, params: Any = None) -> pa.Table | None:
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
            mx: Any = col.max()
            mn: Any = col.min()
            if mx is None or (abs(int(mx)) < 2**63 and abs(int(mn)) < 2**63):
                casts.append(pl.col(name).cast(pl.Int64))
    return df.with_columns(casts) if casts else df


class Store:
    """A moetrace store folder. ``Store(path)`` opens (``create=True`` makes it).

    ``threads``: the DuckDB threads of the store's connections (None: the environment
    variable ``MOETRACE_DUCKDB_THREADS``, else DuckDB's default, one per core).

    Writes go to :attr:`writer` (:class:`~.writer.Writer`); this class refreshes its views
    and the catalog after each. ``store.run(run_id)`` is the run's facade
    (:class:`moetrace.run.Run`, registered by that module: :func:`register_facade`)."""

    def __init__(self, path: str | os.PathLike[str], create: bool = False, *, threads: int | None = None):
        from .duck import threads_setting

        self.path = Path(path)
        self.threads = threads_setting(threads)
        self._con: Any = None           # LazyViews, or a plain connection a caller set
        self._scratch_con: duckdb.DuckDBPyConnection | None = None
        self._footers: dict[str, Any] = {}    # check.footer_columns' cache: each footer read once per Store
        self._views_files: dict[str, tuple[str, ...]] | None = None
        self._readable = False
        self._checked: set[str] = set()   # files (relative paths) checked before a view read them
        check_store_path(self.path)
        self.writer = Writer(self.path)
        self._views = TableViews(self.path, self._scratch, self._footers)
        marker = self.path / STORE_MARKER
        if not (marker.exists() or marker.is_symlink()):
            if not create:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no such store")
                if not self.path.is_dir():
                    raise StoreError(f"{self.path}: not a folder")
                if any(self.path.iterdir()):
                    raise StoreError(f"{self.path}: not a moetrace store (no {STORE_MARKER})")
                return  # an empty folder reads as an empty store; a read never writes
            self.writer.create()
            return
        self._check_format(marker)
        if create:
            self.writer.recover_if_abandoned()  # a writer's open: crash leftovers go now

    def _check_format(self, marker: Path) -> None:
        """The marker names the store format: a store of a newer format (or a marker that
        is not one: a FIFO, a symlink, a huge file) is refused with one line before anything
        reads its tables (:func:`.files.marker_problem`)."""
        from .files import marker_problem

        why = marker_problem(self.path)
        if why:
            raise StoreError(f"{marker}: {why}; nothing was read")

    # ------------------------------------------------------------------ writing (the writer's)
    def write_run(self, run: dict[str, Any], tables: dict[str, object], *, run_id: str | None = None,
                  dedupe: bool = True, run_id_hint: str | None = None) -> WriteResult:
        """Write a new run: its ``runs`` row and its tables, as one transaction.

        ``run`` holds the ``runs`` columns (run_id, ingested_at_ns and collector_version are
        filled in when absent). ``run_id`` is taken as is (an existing one is an error);
        ``run_id_hint`` is made unique while the write lock is held. Tables may be Arrow
        tables, polars frames, dicts of columns or iterables of those (streamed chunk by
        chunk). Returns the run id, or the id of the run already holding the same
        ``ingest_key`` (else ``source_sha256``) (``skipped=True``)."""
        res = self.writer.write_run(run, tables, run_id=run_id, run_id_hint=run_id_hint,
                                    existing=self.find_by_sha if dedupe else None)
        if not res.skipped:
            self.refresh()
            res.message = self._refresh_catalog() or ""
        return res

    def append(self, run_id: str, tables: dict[str, object], *, replace: bool = False) -> dict[str, int]:
        """Add rows to an existing run (plans, replay results, calibrations) as one
        transaction, like :meth:`write_run`: staged, journaled, renamed with the header
        table (``Writer.HEADER_TABLES``, else the last table given) last; that file is the
        commit file (a crash after it rolls forward, before it back), and readers see
        all of the append or none of it (:meth:`committed_files`).

        ``replace``: once the append is committed, the run's older files of the same
        tables are removed (under the same lock). A crash between the commit and the
        removal leaves both generations in place: rows that must not be read together
        carry an id of their write (the analysis cache's ``cache_id``), so the older
        generation is ignored until the next replace or :meth:`drop_tables` removes it."""
        rows = self.writer.append(run_id, tables, replace=replace)
        self.refresh()
        self._refresh_catalog()
        return rows

    def drop_tables(self, run_id: str | None, tables: list[str]) -> dict[str, int]:
        """Remove every file of ``tables`` (contract tables, in the order given: put the one
        readers check first, e.g. a header) of ``run_id``, or of every run when None, under
        the write lock; returns {table: files removed}. Used for derived tables only (the
        analysis cache): a run's own rows are never dropped this way."""
        out = self.writer.drop_tables(run_id, tables)
        self.refresh()
        if any(out.values()):
            self._refresh_catalog()
        return out

    def recover(self) -> list[str]:
        """Finish or roll back the transactions a crash left behind (:meth:`.Writer.recover`)."""
        return self.writer.recover()

    def journals(self) -> dict[str, Journal]:
        """Pending journals, validated (:meth:`.Writer.journals`)."""
        return self.writer.journals()

    def committed_files(self) -> dict[str, tuple[str, ...]]:
        """{table: files} a reader may read now (:meth:`.Writer.committed_files`)."""
        return self.writer.committed_files()

    def unique_run_id(self, hint: str) -> str:
        return self.writer.unique_run_id(hint)

    # ------------------------------------------------------------------ views, connections
    def table_glob(self, table: str, relative: bool = False) -> str:
        return table_glob(self.path, table, relative)

    def has_files(self, table: str) -> bool:
        self.check_readable()
        return has_files(self.path, table)

    def file_versions(self, table: str) -> set[str]:
        """The schema versions recorded in the footers of ``table``'s files."""
        return file_versions(self.path, table)

    def view_statements(self, relative: bool = False, present: dict[str, set[str]] | None = None,
                        tables_only: bool = False, files: dict[str, tuple[str, ...]] | None = None,
                        tables: Iterable[str] | None = None) -> list[str]:
        """CREATE VIEW statements of the tables' and the analysis views
        (:meth:`.TableViews.statements`)."""
        return self._views.statements(relative, present, tables_only, files, tables)

    def _define_views(self, con: Any, tables_only: bool = False, files: dict[str, tuple[str, ...]] | None = None,
                      tables: Iterable[str] | None = None) -> None:
        """Create the views on ``con`` over ``files`` (default: the committed files now),
        remembering which files the store's own connection's views read."""
        if files is None:
            files = self.committed_files()
        self._check_new(files, con)
        # the files the store's own connection's views read (a plain connection set by the
        # caller included: else refresh() would define every view again at every access)
        if self._con is None or con is self._con or con is getattr(self._con, "raw", None):
            self._views_files = files
        self._views.define(con, tables_only=tables_only, files=files, tables=tables)

    def connect(self, threads: int | None = None, memory_limit: str | None = None,
                tables_only: bool = False, _base: Any = None, _no_views: bool = False) -> Any:
        """A fresh in-memory DuckDB connection with every view defined. Never writes:
        no recovery (the views hide uncommitted runs), spills go to the store's
        ``.duckdb_tmp`` only when DuckDB needs to spill. ``threads``: this connection's
        DuckDB threads (default: the store's :attr:`threads`)."""
        from ..safety import memory_limit as check_memory_limit

        if _base is None:   # a connection for any use: the package's every method (duck.full)
            from .duck import connect

            con = connect(self.threads, package=True)
        else:
            con = _base
        # DuckDB draws a progress bar on stderr for queries past 2 s, even when stderr is a
        # pipe; stderr carries moetrace's own one-line notes and errors only
        con.execute("SET enable_progress_bar=false")
        if threads:
            con.execute(f"SET threads={int(threads)}")
        if memory_limit:
            con.execute(f"SET memory_limit={sql_literal(check_memory_limit(memory_limit) or memory_limit)}")
        self.check_readable(con)
        tmp = self.path / ".duckdb_tmp"
        if os.access(self.path, os.W_OK) and not tmp.is_symlink():
            con.execute(f"SET temp_directory={sql_literal(tmp)}")
        if _no_views:   # Store.con: LazyViews defines each view when a statement first names it
            self._views_files = self.committed_files()
        else:
            self._define_views(con, tables_only=tables_only)
        return con

    def check_readable(self, con: Any = None) -> None:
        """A file readers would trip on (truncated, garbage, wrong schema or partition) is
        one line naming it (moetrace/storage/check.py); checked once per Store (the footers
        read on ``con``, else on :meth:`_scratch`)."""
        if not self._readable:
            from .check import check_readable

            listed = set(walk(self.path).rel())
            check_readable(self.path, con if con is not None else self._scratch(), self._footers)
            self._readable = True
            self._checked = listed

    def _check_new(self, files: dict[str, tuple[str, ...]], con: Any) -> None:
        """Files committed since :meth:`check_readable` ran (another writer's) are checked
        before a view reads them: their footers' size and, for ``runs`` and
        ``expert_counts``, the values that size arrays (:func:`.check.check_new_files`)."""
        if not self._readable:
            return
        new = [f for fs in files.values() for f in fs if f not in self._checked]
        if new:
            from .check import check_new_files

            check_new_files(self.path, new, con)
            self._checked.update(new)

    def _scratch(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection for reads that need no view (footers, the runs files): the
        store's own connection once it has one, else one that :attr:`con` later takes as
        its own, so a command opens one DuckDB database, not several (each costs tens of
        milliseconds of a small command's start-up)."""
        if self._con is not None:
            return self._con.raw if isinstance(self._con, LazyViews) else self._con
        if self._scratch_con is None:
            from .duck import connect, needs_full

            needs_full()
            self._scratch_con = connect(self.threads)
        return self._scratch_con

    @property
    def con(self) -> Any:
        """The store's connection (:class:`~.views.LazyViews`). Its views of ``sql/`` are
        defined when a statement first names them (with the views they read): defining
        all of them costs more than a small query; :meth:`connect` and the catalog define
        every view. The tables' views read the committed files as of the last access: each
        access looks again (two folder scans and the journals, no file is opened) and
        defines the views again when another writer committed since, so a reader sees new
        runs, plans and tables without reopening the store."""
        if self._con is None:   # the scratch connection becomes the store's (footer reads while
            base = self._scratch()   # the views are defined go to it too)
            raw = self.connect(tables_only=True, _base=base, _no_views=True)
            self._con = LazyViews(raw, self.path, lambda need: self._define_views(
                raw, tables_only=True, files=self._views_files, tables=need))
            self._scratch_con = None
        else:
            self.refresh()
        return self._con

    def refresh(self) -> None:
        """Re-create the views when the committed files changed (a write landed)."""
        if self._con is not None:
            files = self.committed_files()
            if files != self._views_files:
                if isinstance(self._con, LazyViews):
                    self._define_views(self._con.raw, tables_only=True, files=files, tables=self._con.tables)
                    self._con.redefine()
                else:   # a plain connection from connect() set by the caller: every view again
                    self._define_views(self._con, files=files)

    # ------------------------------------------------------------------ reading
    def sql(self, query: str, params: Any = None) -> pl.DataFrame:
        """Run SQL over the store's views and return a polars DataFrame."""
        import duckdb
        import polars as pl

        try:
            tbl = query_arrow(self.con, query, params)
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None
        if tbl is None or not tbl.num_columns:
            return pl.DataFrame()
        df = pl.from_arrow(tbl)
        assert isinstance(df, pl.DataFrame)   # from a table, not an array
        return _narrow_hugeints(df)

    def rows(self, query: str, params: Any = None) -> Rows:
        """Run SQL over the store's views and return its rows as DuckDB gives them
        (:class:`moetrace.output.Rows`: no polars, no Arrow; what ``moetrace runs`` and
        ``moetrace skew`` print, light to import)."""
        from ..output import Rows
        from .duck import duckdb

        try:
            cur = self.con.execute(query, params) if params is not None else self.con.execute(query)
            desc = cur.description or []
            return Rows([d[0] for d in desc], [str(d[1]) for d in desc], cur.fetchall() if desc else [])
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def copy_parquet(self, query: str, params: Any, path: str | os.PathLike[str]) -> int:
        """Write the rows of ``query`` to the Parquet file ``path`` with DuckDB's COPY (no
        polars, no Arrow: ``moetrace skew -o x.parquet``); returns the rows written."""
        from ..safety import sql_literal as lit
        from .duck import duckdb

        try:
            return int(self.con.execute(f"COPY ({query}) TO {lit(path)} (FORMAT parquet)", params).fetchall()[0][0])
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def arrow(self, query: str, params: Any = None) -> pa.Table | None:
        """Run SQL over the store's views and return its rows as Arrow (None for a
        statement without rows)."""
        return query_arrow(self.con, query, params)

    def numpy(self, query: str, params: Any = None) -> dict[str, Any]:
        """Run SQL over the store's views and return its columns as numpy arrays (DuckDB's
        ``fetchnumpy``: no polars, no Arrow, no pandas; the replay's path)."""
        import duckdb

        try:
            return self.con.execute(query, params).fetchnumpy()
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None

    def runs(self) -> pl.DataFrame:
        """The runs rows (contract columns; nullable ones an older file lacks are NULL, a
        required one is refused: :func:`.compat.missing_column`), oldest first.
        Read from the runs partitions directly (no SQL view is built: ``moetrace runs``); a
        runs file is renamed into place last, so every row here is a committed run. Never
        writes. The rows of :meth:`runs_rows` (the one reader), typed by the contract."""
        import polars as pl

        pl_types = {"string": pl.Utf8, "bool": pl.Boolean, "int8": pl.Int8, "int16": pl.Int16, "int32": pl.Int32,
                    "int64": pl.Int64, "float32": pl.Float32, "float64": pl.Float64, "int64[]": pl.List(pl.Int64)}
        want: dict[str, Any] = {c.name: pl_types[c.type] for c in schema.get("runs").columns}
        rows = self.runs_rows()
        assert list(rows.columns) == list(want)
        return pl.DataFrame(rows.rows, schema=want, orient="row")

    def runs_rows(self) -> Rows:
        """:meth:`runs` as :class:`moetrace.output.Rows`, read by DuckDB from the runs
        partitions (no view is built, no polars, no Arrow: ``moetrace runs``)."""
        from ..output import Rows
        from .check import footer_columns
        from .duck import duckdb

        cols = schema.get("runs").columns
        self.check_readable()
        files = walk(self.path, ["runs"]).paths("runs")
        if not files:
            return Rows([c.name for c in cols], [schema.DUCK_TYPES[c.type] for c in cols], [])
        con = self._scratch()
        try:
            held = footer_columns(con, files, self._footers)
            present = set()
            for f in files:  # a required column older files lack is refused, as the views do
                names = {n for n, _ in held.get(str(f), ())}
                present |= names
                for c in cols:
                    if not c.nullable and c.name != "run_id" and c.name not in names:
                        missing_column(self.path, "runs", c.name)
            exprs = ", ".join(sql_identifier(c.name) if c.name in present or c.name == "run_id"
                              else f"CAST(NULL AS {schema.DUCK_TYPES[c.type]}) AS {sql_identifier(c.name)}" for c in cols)
            src = "[" + ", ".join(sql_literal(f) for f in files) + "]"
            cur = con.execute(f"SELECT {exprs} FROM read_parquet({src}, hive_partitioning=true, "
                              "hive_types={'run_id': VARCHAR}, union_by_name=true) "
                              "ORDER BY ingested_at_ns NULLS FIRST, run_id NULLS FIRST")
            return Rows([d[0] for d in cur.description], [str(d[1]) for d in cur.description], cur.fetchall())
        except duckdb.Error as e:
            raise StoreError(f"{self.path}: cannot read the runs table ({' '.join(str(e).split())[:200]})") from None

    def partition_rows(self, dense_as_expert_load: bool = False, run_id: str | None = None,
                       tables: Iterable[str] | None = None) -> list[tuple[str, str, int]]:
        """(run_id, table, rows) of every partition (of ``run_id`` and ``tables`` when
        given), read from Parquet footers by DuckDB (no data scan). ``dense_as_expert_load``:
        expert_load also counts the rows its view shows of the dense expert_counts rows (one
        per list element, from the footers)."""
        from .duck import duckdb

        listing = walk(self.path, tables)
        parts = [(run, t, [self.path / t / f"run_id={run}" / n for n in names])
                 for t, by_run in listing.files.items() for run, names in sorted(by_run.items())
                 if run_id is None or run == run_id]
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
        self.check_readable()   # a store a reader cannot read lists no runs: it is refused
        return run_ids(self.path)

    def run_row(self, run_id: str) -> dict[str, Any]:
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
        # the runs view has every contract column (NULL where an older file lacks one)
        df = self.sql("SELECT run_id FROM runs WHERE coalesce(ingest_key, source_sha256) = ?", [sha])
        return df["run_id"][0] if df.height else None

    def row_counts(self) -> pl.DataFrame:
        """Rows per (run, table), read from Parquet footers (no data scan)."""
        import polars as pl

        return pl.DataFrame(self.partition_rows(), schema={"run_id": pl.Utf8, "table": pl.Utf8, "rows": pl.Int64},
                            orient="row")

    # ------------------------------------------------------------------ catalog
    def write_catalog(self) -> Path:
        """Write STORE/catalog.duckdb: the same views, with paths relative to the store
        (:mod:`.catalog`), under the write lock."""
        from .catalog import write_catalog

        return write_catalog(self.path, self.writer, self._views, self.threads)

    def _refresh_catalog(self) -> str | None:
        """Rewrite catalog.duckdb when there is one. Runs after a commit: a failure is a
        warning (on stderr and returned), never an error for a write that landed."""
        if not (self.path / "catalog.duckdb").exists():
            return None
        import duckdb

        try:
            self.write_catalog()
        except (StoreError, OSError, duckdb.Error) as e:
            from .catalog import warn_refresh_failed

            return warn_refresh_failed(self.path, e)
        return None

    # ------------------------------------------------------------------ the facade
    def run(self, run_id: str | None = None) -> Any:
        """The :class:`moetrace.run.Run` facade of ``run_id`` (None: the store's only run)."""
        return _facade("run")(self, self.resolve_run(run_id))

    def clear_cache(self) -> dict[str, int]:
        """Remove every run's stored analysis, and any a removed run left ({table: files})."""
        return _facade("clear_cache")(self)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None
        if self._scratch_con is not None:
            self._scratch_con.close()
            self._scratch_con = None


#: what the layers above the store put on it: ``run`` (store, run id) -> the run's facade,
#: ``clear_cache`` (store) -> {table: files removed}. The store does not import them (the
#: folders import downward only); :mod:`moetrace.run` registers them when imported, which
#: ``moetrace.open_store`` and ``moetrace.Store`` always do.
_FACADE: dict[str, Callable[..., Any]] = {}


def register_facade(run: Callable[[Store, str], Any], clear_cache: Callable[[Store], dict[str, int]]) -> None:
    """Put the run facade on every :class:`Store` (:mod:`moetrace.run` calls this)."""
    _FACADE.update(run=run, clear_cache=clear_cache)


def _facade(name: str) -> Callable[..., Any]:
    if name not in _FACADE:
        raise StoreError(f"Store.{name} needs the run facade: open the store with moetrace.open_store "
                         f"(or import moetrace.run first)")
    return _FACADE[name]


def open_store(path: str | os.PathLike[str], create: bool = False, *, threads: int | None = None) -> Store:
    """Open (or with ``create=True`` make) the store at ``path``; ``.sql(query)`` returns a
    polars DataFrame, ``open_store(p).run(id)`` gives the run's facade, and
    ``with open_store(p) as st:`` closes it. ``threads``: as :class:`Store`."""
    return Store(path, create=create, threads=threads)

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
made it, on the next write) or nothing: never a half-written partition. Readers only see
complete files because a rename is atomic. Validation happens before anything touches the
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
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__, schema
from .errors import SchemaError, StoreError
from .safety import sql_identifier, sql_literal

STORE_MARKER = "moetrace-store.json"
STORE_FORMAT = 1
_RUN_ID_RE = re.compile(r"[^A-Za-z0-9_.\-]+")
RUN_ID_MAX = 80
_TXID_RE = re.compile(r"[0-9a-f]{12}")
_SAFE_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


#: characters DuckDB's read_parquet (and polars, Spark) take as a file pattern in a path,
#: even in a literal file name: ``a[1]`` reads ``a1``, ``x*y`` reads every ``x..y``
GLOB_CHARS = "*?[]{}"
#: a relative path that starts like a URI (``file:``, ``s3:``, ``mem:``): Arrow writes
#: ``file:/x`` to ``/x``
_URI_START_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")


def check_store_path(path: Path) -> None:
    """Refuse a store path that DuckDB or Arrow would not take literally, so that it would
    read (or write) another folder's files: a pattern character (the views read
    ``read_parquet('<store>/<table>/*/*.parquet')`` and DuckDB cannot be told to take a
    folder name literally: an escaped ``\\[`` matches nothing), a leading ``~`` (both
    expand it to the home folder; the shell did not, so it was quoted) or a relative path
    that starts like a URI (``file:/x``). Raises StoreError (one line, exit 2) before
    anything is read or created."""
    text = str(path)
    bad = "".join(c for c in GLOB_CHARS if c in text)
    if bad:
        raise StoreError(f"{path}: the store path holds {bad!r}, which DuckDB reads as a file pattern (it would "
                         f"read other folders' files); move or rename the store, or open it through a symlink "
                         f"whose path has none of {GLOB_CHARS}")
    if "\\" in text:
        raise StoreError(f"{path}: the store path holds a backslash, which DuckDB reads as '/' (it would read or "
                         f"write another folder's files); move or rename the store, or open it through a symlink "
                         f"whose path has none")
    if text.startswith("~"):
        raise StoreError(f"{path}: the store path starts with '~', which DuckDB and Arrow read as the home folder "
                         f"(the shell did not expand it: it was quoted); give the full path")
    if not path.is_absolute() and _URI_START_RE.match(text):
        raise StoreError(f"{path}: the store path starts like a URI ({text.split(':', 1)[0]}:), which Arrow "
                         f"would write elsewhere; give the full path")


_DUCK_TYPES = {"string": "VARCHAR", "bool": "BOOLEAN", "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER",
               "int64": "BIGINT", "float32": "FLOAT", "float64": "DOUBLE", "int64[]": "BIGINT[]"}

#: required columns added to a contract after stores were written without them, and how a
#: view computes them from such a store's files (the writer's definition is the reference:
#: ``tokens_desc`` is ``dense_table``'s counts sorted descending)
DERIVED_WHEN_MISSING = {("expert_counts", "tokens_desc"): "list_reverse_sort(tokens)"}


def sanitize_run_id(text: str) -> str:
    rid = _RUN_ID_RE.sub("_", text).strip("._-")
    return rid[:RUN_ID_MAX].rstrip("._-") or "run"


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """sha256 over the bytes of the given files, in the order given (names excluded)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def query_arrow(con: duckdb.DuckDBPyConnection, query: str, params=None) -> pa.Table | None:
    """Run ``query`` and return its rows as Arrow (None for statements without rows),
    across DuckDB versions (fetch_arrow_table became to_arrow_table in 2.0)."""
    rel = con.sql(query, params=params) if params is not None else con.sql(query)
    if rel is None:
        return None
    fn = getattr(rel, "to_arrow_table", None) or getattr(rel, "arrow")
    out = fn()
    if isinstance(out, pa.RecordBatchReader):
        out = out.read_all()
    return out


def _narrow_hugeints(df: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums BIGINTs into HUGEINT (Decimal(38,0) in polars); bring them back to Int64
    when every value fits, so results behave like integers (numpy, arithmetic)."""
    casts = []
    for name, dtype in df.schema.items():
        if isinstance(dtype, pl.Decimal) and (dtype.scale or 0) == 0:
            col = df[name]
            mx, mn = col.max(), col.min()
            if mx is None or (abs(int(mx)) < 2**63 and abs(int(mn)) < 2**63):
                casts.append(pl.col(name).cast(pl.Int64))
    return df.with_columns(casts) if casts else df


TableLike = "pa.Table | pl.DataFrame | dict | Iterable[pa.Table]"


@dataclass
class WriteResult:
    run_id: str
    skipped: bool = False
    rows: dict[str, int] = field(default_factory=dict)
    message: str = ""


class Store:
    """A moetrace store folder. ``Store(path)`` opens (``create=True`` makes it)."""

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(path)
        self._con: duckdb.DuckDBPyConnection | None = None
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

    # ------------------------------------------------------------------ recovery
    def _recover_if_abandoned(self) -> None:
        """On a writer's open: a journal whose writer no longer holds the lock was left by
        a crash; finish or roll it back now. A journal of a live writer (lock held) is left
        alone; a store we cannot write, or without any leftovers, is left as is."""
        if not os.access(self.path, os.W_OK):
            return
        if not any((self.path / d).is_symlink() or (self.path / d).exists() for d in (".txn", ".staging")):
            return
        self._check_no_symlinks()
        self.journals()
        try:
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            try:
                self.recover()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _check_no_symlinks(self) -> None:
        """The transaction folders are ours: a symlink there would redirect our deletes
        and writes outside the store, so it is refused."""
        for d in (".txn", ".staging", ".lock"):
            if (self.path / d).is_symlink():
                raise StoreError(f"{self.path / d}: is a symlink; refused (moetrace never follows links "
                                 f"in its transaction folders); remove it to use this store")

    def journals(self) -> dict[str, dict]:
        """Pending journals, validated: {txid: {"files": [...], "commit_file": str|None}}.
        Files in .txn with other names are not ours and are left alone. Raises StoreError
        (naming the journal) for one whose content is not exactly what a writer writes."""
        txn_dir = self.path / ".txn"
        out: dict[str, dict] = {}
        if not txn_dir.is_dir() or txn_dir.is_symlink():
            return out
        for j in sorted(txn_dir.iterdir()):
            if not (j.name.endswith(".json") and _TXID_RE.fullmatch(j.name[:-5])):
                continue
            txid = j.name[:-5]
            if j.is_symlink() or not j.is_file():
                raise StoreError(f"{j}: malformed journal (not a regular file); nothing was changed")
            try:
                raw = j.read_bytes()
                doc = json.loads(raw) if len(raw) < (64 << 20) else None
            except (OSError, ValueError, RecursionError):
                doc = None
            why = self._journal_problem(doc, txid)
            if why:
                raise StoreError(f"{j}: malformed journal ({why}); nothing was changed; a moetrace "
                                 f"writer never writes this, remove the file after checking the store")
            out[txid] = doc
        return out

    def _journal_problem(self, doc, txid: str) -> str | None:
        if not isinstance(doc, dict) or set(doc) != {"files", "commit_file"}:
            return 'not an object {"files": [...], "commit_file": ...}'
        files, commit = doc["files"], doc["commit_file"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            return "files is not a list of paths"
        known = set(schema.load_all())
        for f in files:
            parts = f.split("/")
            if (len(parts) != 3 or parts[0] not in known or not parts[1].startswith("run_id=")
                    or not _SAFE_ID_RE.fullmatch(parts[1][7:]) or parts[2] != f"part-{txid}.parquet"):
                return f"entry {f[:100]!r} is not <table>/run_id=<id>/part-{txid}.parquet"
        if commit is not None and commit not in files:
            return "commit_file is not one of its files"
        return None

    def _safe_unlink(self, rel: str) -> None:
        """Remove STORE/rel (a validated journal entry) and its emptied partition and table
        folders, never through a symlinked folder."""
        p = self.path / rel
        if (self.path / rel.split("/")[0]).is_symlink() or p.parent.is_symlink():
            raise StoreError(f"{p.parent}: is a symlink; refused; nothing was changed")
        if p.is_symlink() or p.is_file():
            p.unlink()
        for parent in (p.parent, p.parent.parent):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when empty: partition, then table folder

    def recover(self) -> list[str]:
        """Finish or roll back transactions a crash left behind (writers only; hold the
        lock or be alone). Returns what was done. Touches only journals, staging folders
        and data files it can recognise as its own; raises StoreError, changing nothing,
        when a journal or a transaction folder is not what moetrace writes."""
        self._check_no_symlinks()
        journals = self.journals()  # validates every journal before anything is removed
        for txid, doc in journals.items():
            for rel in doc["files"]:
                p = self.path / rel
                if (self.path / rel.split("/")[0]).is_symlink() or p.parent.is_symlink():
                    raise StoreError(f"{p.parent}: is a symlink; refused; nothing was changed")
        done = []
        txn_dir = self.path / ".txn"
        for txid, doc in journals.items():
            commit = doc["commit_file"]
            if commit and (self.path / commit).is_file():
                done.append(f"rolled forward {txid}")
            else:
                for rel in doc["files"]:
                    self._safe_unlink(rel)
                done.append(f"rolled back {txid}")
            (txn_dir / f"{txid}.json").unlink()
            self._remove_staging(txid)
        if txn_dir.is_dir():
            for t in txn_dir.iterdir():  # a journal that was never renamed into place
                if t.name.endswith(".json.tmp") and _TXID_RE.fullmatch(t.name[:-9]) and t.is_file() \
                        and not t.is_symlink():
                    t.unlink()
                    done.append(f"dropped unfinished journal {t.name[:-9]}")
        staging = self.path / ".staging"
        if staging.is_dir():
            for d in staging.iterdir():
                if _TXID_RE.fullmatch(d.name) and not (txn_dir / f"{d.name}.json").exists():
                    if self._remove_staging(d.name):
                        done.append(f"removed staging {d.name}")
        for d in (staging, txn_dir):
            with contextlib.suppress(OSError):
                d.rmdir()
        return done

    def _remove_staging(self, txid: str) -> bool:
        """Remove .staging/<txid> when it is a real folder (rmtree never follows links)."""
        d = self.path / ".staging" / txid
        if d.is_symlink() or not d.is_dir():
            return False
        shutil.rmtree(d, ignore_errors=True)
        return True

    # ------------------------------------------------------------------ reading
    def table_glob(self, table: str, relative: bool = False) -> str:
        base = Path(table) if relative else self.path / table
        return str(base / "*" / "*.parquet")

    def has_files(self, table: str) -> bool:
        d = self.path / table
        return d.is_dir() and any(d.glob("run_id=*/*.parquet"))

    def _view_sql(self, table: str, relative: bool, present: set[str] | None = None) -> str:
        """A table's view. Tables other than ``runs`` show only committed runs (whose
        ``runs`` row is in place: it is renamed last), so a reader never sees part of a run
        being written or left by a crash; readers never recover.

        ``present``: the columns the table's files hold, when some contract column is in
        none of them (a store written before that column existed): a nullable one reads
        NULL, any other is refused; one in :data:`DERIVED_WHEN_MISSING` is computed where
        a file lacks it (:meth:`_column_sql`)."""
        ts = schema.get(table)
        name = sql_identifier(table)
        if self.has_files(table):
            glob = sql_literal(self.table_glob(table, relative))
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
        lacking = total = 0
        for f in (self.path / table).glob("*/*.parquet"):  # what the view reads (table_glob)
            total += 1
            try:
                names = pq.read_schema(f).names
            except (OSError, pa.ArrowException):
                names = ()
            lacking += column not in names
        return lacking, total

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
        out = set()
        for f in (self.path / table).glob("run_id=*/*.parquet"):
            try:
                meta = pq.read_schema(f).metadata or {}
            except (OSError, pa.ArrowException):
                continue
            out.add(meta.get(schema.META_VERSION, b"none").decode(errors="replace"))
        return out

    def _present_columns(self, con: duckdb.DuckDBPyConnection, table: str, relative: bool) -> set[str]:
        glob = sql_literal(self.table_glob(table, relative))
        rows = con.execute(f"DESCRIBE SELECT * FROM read_parquet({glob}, hive_partitioning=true, "
                           f"hive_types={{'run_id': VARCHAR}}, union_by_name=true)").fetchall()
        return {r[0] for r in rows}

    def _define_views(self, con: duckdb.DuckDBPyConnection, relative: bool = False) -> None:
        """Create every view on ``con``. A store written before a contract column existed
        (no file of the table holds it) fails to bind; then the views are made again with
        that column NULL (or derived): older stores are read as they are, never rewritten."""
        try:
            for stmt in self.view_statements(relative):
                con.execute(stmt)
            return
        except duckdb.BinderException as e:
            first = e
        present = {}
        for t in schema.load_all():
            if self.has_files(t):
                cols = self._present_columns(con, t, relative)
                if set(schema.get(t).column_names) - cols:
                    present[t] = cols
        if not present:
            why = str(first).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot define the store's views ({why}); the store may have been "
                             f"written by another moetrace version than {__version__}") from None
        try:
            for stmt in self.view_statements(relative, present):
                con.execute(stmt)
        except duckdb.Error as e:
            why = str(e).strip().splitlines()[0][:200]
            raise StoreError(f"{self.path}: cannot read this store's tables ({why}); it was written by another "
                             f"moetrace version than {__version__}: re-ingest the sources into a new store") from None

    def view_statements(self, relative: bool = False, present: dict[str, set[str]] | None = None) -> list[str]:
        """CREATE VIEW statements: one per contract table (``runs`` first: the others
        filter on it), then the analysis views. ``present``: {table: columns its files
        hold} for tables of an older store that lack a contract column."""
        from .analyze import view_statements as analysis_views

        from .analyze.dense import expert_load_views

        present = present or {}
        tables = sorted(schema.load_all(), key=lambda t: t != "runs")
        stmts = [self._view_sql(t, relative, present.get(t)) for t in tables]
        # expert_load = its long rows + the dense expert_counts rows unnested (docs/scale.md)
        stmts += expert_load_views(self._view_sql("expert_load", relative, present.get("expert_load")))
        return stmts + analysis_views()

    def connect(self, threads: int | None = None, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
        """A fresh in-memory DuckDB connection with every view defined. Never writes:
        no recovery (the views hide uncommitted runs), spills go to the store's
        ``.duckdb_tmp`` only when DuckDB needs to spill."""
        from .safety import memory_limit as check_memory_limit

        con = duckdb.connect(":memory:")
        if threads:
            con.execute(f"SET threads={int(threads)}")
        if memory_limit:
            con.execute(f"SET memory_limit={sql_literal(check_memory_limit(memory_limit))}")
        self.check_readable()
        tmp = self.path / ".duckdb_tmp"
        if os.access(self.path, os.W_OK) and not tmp.is_symlink():
            con.execute(f"SET temp_directory={sql_literal(tmp)}")
        self._define_views(con)
        return con

    def check_readable(self) -> None:
        """A file readers would trip on (truncated, garbage, wrong schema or partition) is
        one line naming it (moetrace/store_check.py); checked once per Store."""
        if not getattr(self, "_readable", False):
            from .store_check import check_readable

            check_readable(self.path)
            self._readable = True

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self._con = self.connect()
        return self._con

    def refresh(self) -> None:
        """Re-create views (after a write added a table that was empty)."""
        if self._con is not None:
            self._define_views(self._con)

    def sql(self, query: str, params=None) -> pl.DataFrame:
        """Run SQL over the store's views and return a polars DataFrame."""
        try:
            tbl = query_arrow(self.con, query, params)
        except duckdb.Error as e:
            raise StoreError(f"SQL error: {e}") from None
        if tbl is None or not tbl.num_columns:
            return pl.DataFrame()
        return _narrow_hugeints(pl.from_arrow(tbl))

    def arrow(self, query: str, params=None) -> pa.Table:
        return query_arrow(self.con, query, params)

    def runs(self) -> pl.DataFrame:
        """The runs rows (contract columns; nullable ones an older file lacks are NULL, a
        required one is refused: :meth:`_missing_column`), oldest first.
        Read from the runs partitions directly (no SQL view is built: ``moetrace runs``); a
        runs file is renamed into place last, so every row here is a committed run. Never writes."""
        pl_types = {"string": pl.Utf8, "bool": pl.Boolean, "int8": pl.Int8, "int16": pl.Int16, "int32": pl.Int32,
                    "int64": pl.Int64, "float32": pl.Float32, "float64": pl.Float64, "int64[]": pl.List(pl.Int64)}
        empty = pl.DataFrame(schema={c.name: pl_types[c.type] for c in schema.get("runs").columns})
        self.check_readable()
        frames = [pl.read_parquet(f).with_columns(pl.lit(part.name.split("=", 1)[1]).alias("run_id"))
                  for part in sorted((self.path / "runs").glob("run_id=*")) for f in sorted(part.glob("*.parquet"))]
        for f in frames:  # a required column older files lack is refused, as the views do
            for c in schema.get("runs").columns:
                if not c.nullable and c.name not in f.columns:
                    self._missing_column("runs", c.name)
        df = pl.concat([empty, *frames], how="diagonal_relaxed") if frames else empty
        return df.select(empty.columns).sort("ingested_at_ns", "run_id")

    def run_ids(self) -> list[str]:
        d = self.path / "runs"
        if not d.is_dir():
            return []
        return sorted(p.name.split("=", 1)[1] for p in d.glob("run_id=*") if any(p.glob("*.parquet")))

    def run_row(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict."""
        df = self.sql("SELECT * FROM runs WHERE run_id = ?", [run_id])
        if df.height == 0:
            raise StoreError(f"{self.path}: no run {run_id!r} (runs: {', '.join(self.run_ids()) or 'none'})")
        return df.row(0, named=True)

    def run(self, run_id: str | None = None):
        """The :class:`moetrace.run.Run` facade over ``run_id`` (None: the only run)."""
        from .run import Run

        return Run(self, self.resolve_run(run_id))

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
        raise StoreError(f"{self.path}: the store holds {len(ids)} runs; choose one with --run ({', '.join(ids)})")

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
        rows = []
        for t in schema.load_all():
            d = self.path / t
            if not d.is_dir():
                continue
            for part in d.glob("run_id=*"):
                n = sum(pq.ParquetFile(f).metadata.num_rows for f in part.glob("*.parquet"))
                rows.append({"run_id": part.name.split("=", 1)[1], "table": t, "rows": n})
        return pl.DataFrame(rows, schema={"run_id": pl.Utf8, "table": pl.Utf8, "rows": pl.Int64})

    # ------------------------------------------------------------------ writing
    def unique_run_id(self, hint: str) -> str:
        base = sanitize_run_id(hint)
        taken = set(self.run_ids())
        if base not in taken:
            return base
        i = 2
        while True:  # the suffix always fits: an id cut at RUN_ID_MAX is cut shorter instead
            suffix = f"-{i}"
            cand = base[:RUN_ID_MAX - len(suffix)].rstrip("._-") + suffix
            if cand not in taken:
                return cand
            i += 1

    @staticmethod
    def _chunks(data) -> Iterator:
        if isinstance(data, (pa.Table, pl.DataFrame, dict)):
            yield data
        else:
            yield from data

    def write_run(self, run: dict, tables: dict[str, object], *, run_id: str | None = None,
                  dedupe: bool = True, run_id_hint: str | None = None) -> WriteResult:
        """Write a new run: its ``runs`` row and its tables, as one transaction.

        ``run`` holds the ``runs`` columns (run_id, ingested_at_ns and collector_version are
        filled in when absent). ``run_id`` is taken as is (an existing one is an error);
        ``run_id_hint`` is made unique while the write lock is held. Tables may be Arrow tables, polars frames, dicts of columns or
        iterables of those (streamed chunk by chunk). Returns the run id, or the id of the
        run already holding the same ``ingest_key`` (else ``source_sha256``) (``skipped=True``).
        """
        run = dict(run)
        sha = run.get("ingest_key") or run.get("source_sha256")
        if dedupe and sha:
            existing = self.find_by_sha(sha)
            if existing is not None:
                return WriteResult(existing, skipped=True, message=f"already ingested as run {existing!r}")
        self._init()  # a store opened read-only on an empty folder is created by its first write
        with self._lock():
            self._check_writable()
            self.recover()
            if dedupe and sha:
                existing = self.find_by_sha(sha)
                if existing is not None:
                    return WriteResult(existing, skipped=True, message=f"already ingested as run {existing!r}")
            # a hint becomes a free id under the lock (two writers with one hint get hint, hint-2)
            rid = run_id or run.get("run_id") or self.unique_run_id(run_id_hint or run.get("source", "run"))
            rid = sanitize_run_id(rid)
            if rid in self.run_ids():
                raise StoreError(f"{self.path}: run {rid!r} already exists; pick another --run-id")
            run["run_id"] = rid
            run.setdefault("ingested_at_ns", time.time_ns())
            run.setdefault("collector_version", __version__)
            for col in schema.get("runs").columns:
                run.setdefault(col.name, False if col.type == "bool" and not col.nullable else None)
            runs_tbl = schema.conform("runs", pa.Table.from_pylist([run]))
            rows = self._transaction(rid, {**tables, "runs": runs_tbl}, commit_table="runs")
        self.refresh()
        warning = self._refresh_catalog()
        return WriteResult(rid, rows=rows, message=warning or "")

    def append(self, run_id: str, tables: dict[str, object]) -> dict[str, int]:
        """Add rows to an existing run (plans, replay results) as one transaction."""
        if run_id not in self.run_ids():
            raise StoreError(f"{self.path}: no run {run_id!r}")
        with self._lock():
            self._check_writable()
            self.recover()
            rows = self._transaction(run_id, tables, commit_table=None)
        self.refresh()
        self._refresh_catalog()
        return rows

    def _transaction(self, run_id: str, tables: dict[str, object], commit_table: str | None) -> dict[str, int]:
        txid = uuid.uuid4().hex[:12]
        self._check_no_symlinks()
        staging = self.path / ".staging" / txid
        moves: list[tuple[Path, str]] = []
        rows: dict[str, int] = {}
        try:
            order = [t for t in tables if t != commit_table] + ([commit_table] if commit_table else [])
            for table in order:
                schema.get(table)  # unknown table: SchemaError before anything is written
                n_written = 0
                writer = None
                tmp_file = staging / table / f"part-{txid}.parquet"
                for chunk in self._chunks(tables[table]):
                    if isinstance(chunk, pa.Table) and "run_id" not in chunk.column_names:
                        chunk = chunk.append_column("run_id", pa.array([run_id] * chunk.num_rows, pa.string()))
                    elif isinstance(chunk, pl.DataFrame) and "run_id" not in chunk.columns:
                        chunk = chunk.with_columns(pl.lit(run_id).alias("run_id"))
                    elif isinstance(chunk, dict) and "run_id" not in chunk:
                        n = len(next(iter(chunk.values()))) if chunk else 0
                        chunk = {**chunk, "run_id": [run_id] * n}
                    tbl = schema.conform(table, chunk)
                    if tbl.num_rows and (tbl.column("run_id").unique().to_pylist() != [run_id]):
                        raise SchemaError(table, f"rows belong to another run than {run_id!r}", "run_id")
                    body = tbl.drop_columns(["run_id"])
                    if writer is None:
                        tmp_file.parent.mkdir(parents=True, exist_ok=True)
                        writer = pq.ParquetWriter(tmp_file, body.schema, compression="zstd")
                    writer.write_table(body, row_group_size=1 << 20)
                    n_written += tbl.num_rows
                if writer is None:  # no chunks at all: keep the table empty, write nothing
                    rows[table] = 0
                    continue
                writer.close()
                rows[table] = n_written
                final = f"{table}/run_id={run_id}/part-{txid}.parquet"
                moves.append((tmp_file, final))
            txn_dir = self.path / ".txn"
            txn_dir.mkdir(exist_ok=True)
            commit_file = next((f for _, f in moves if commit_table and f.startswith(commit_table + "/")), None)
            journal = {"files": [f for _, f in moves], "commit_file": commit_file}
            jtmp = txn_dir / f"{txid}.json.tmp"
            jtmp.write_text(json.dumps(journal))
            os.replace(jtmp, txn_dir / f"{txid}.json")
            for tmp_file, final in moves:
                dst = self.path / final
                dst.parent.mkdir(parents=True, exist_ok=True)
                if dst.parent.is_symlink() or dst.parent.parent.is_symlink():
                    raise StoreError(f"{dst.parent}: is a symlink; refused; nothing was written")
                os.replace(tmp_file, dst)
            (txn_dir / f"{txid}.json").unlink()
        except BaseException as exc:
            # undo: remove anything renamed into place, then the staging area
            for _, final in moves:
                with contextlib.suppress(FileNotFoundError):
                    (self.path / final).unlink()
                with contextlib.suppress(OSError):
                    (self.path / final).parent.rmdir()
                with contextlib.suppress(OSError):
                    (self.path / final).parent.parent.rmdir()
            with contextlib.suppress(FileNotFoundError):
                (self.path / ".txn" / f"{txid}.json").unlink()
            if isinstance(exc, (OSError, pa.ArrowException)) and not isinstance(exc, StoreError):
                why = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0][:200]
                raise StoreError(f"{self.path}: cannot write ({why}); nothing was written") from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            for d in (self.path / ".staging", self.path / ".txn"):
                with contextlib.suppress(OSError):
                    d.rmdir()
        return rows

    # ------------------------------------------------------------------ catalog
    def write_catalog(self) -> Path:
        """Write STORE/catalog.duckdb: the same views, with paths relative to the store.

        DuckDB resolves relative paths against ``file_search_path`` (or the working
        directory), so open it with ``cd STORE && duckdb catalog.duckdb`` or
        ``duckdb -cmd "SET file_search_path='STORE'" STORE/catalog.duckdb``.
        """
        target = self.path / "catalog.duckdb"
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
        try:
            self.write_catalog()
        except (StoreError, OSError, duckdb.Error) as e:
            msg = f"catalog.duckdb not refreshed ({e}); the data was written; rerun `moetrace catalog {self.path}`"
            print(f"moetrace: warning: {msg}", file=sys.stderr)
            return msg
        return None

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None


def open_store(path: str | os.PathLike, create: bool = False) -> Store:
    """Open the store at ``path``. ``.sql(query)`` returns a polars DataFrame."""
    return Store(path, create=create)

"""The sandbox ``moetrace sql`` runs a user's query in, and the streaming of its rows.

A query pasted from a colleague should not be able to read or write outside the store.
DuckDB is set up before the query runs, then its configuration is locked
(``lock_configuration``), so no ``SET`` in the query can undo it:

- ``enable_external_access = false`` with ``allowed_directories`` = the store's real path
  (and each ``--allow-path``): ``read_text('/etc/passwd')``, ``read_parquet`` of other
  folders, ``ATTACH``, ``INSTALL`` and ``http(s)://`` reads are refused by DuckDB itself;
- only one ``SELECT`` (or ``EXPLAIN [ANALYZE] SELECT``) statement runs: ``COPY ... TO``
  would otherwise still write *into* the store, ``EXPORT DATABASE`` and ``ATTACH`` create
  files there, ``EXPLAIN ANALYZE COPY`` executes the copy;
- no extension is installed or loaded (``autoinstall_known_extensions``,
  ``autoload_known_extensions``, ``allow_community_extensions`` off);
- ``memory_limit`` (``--memory-limit``, default :data:`DEFAULT_MEMORY`) and spills to a
  private temporary folder outside the store, capped by ``max_temp_directory_size``
  (:data:`DEFAULT_TEMP`), removed afterwards;
- ``--timeout SECONDS``: a timer thread calls ``connection.interrupt()``.

Rows are streamed (Arrow record batches of :data:`BATCH_ROWS`): ``-o`` files are written
batch by batch, CSV/JSON are printed batch by batch and the table format keeps only the
first and last rows, so a 200M-row result never sits in memory. ``--unsafe`` runs the
query on a plain connection (any statement, any file), still streamed and timed.

This module takes the store's connection factory from the caller; it imports no store code.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import StoreError, UsageError, shown
from ..safety import heap_cap, size_bytes, sql_literal
from ..safety import memory_limit as checked_size

#: DuckDB's memory cap for ``moetrace sql`` (``--memory-limit`` or MOETRACE_SQL_MEMORY_LIMIT)
DEFAULT_MEMORY = "1GiB"
#: cap on what DuckDB spills to its private temporary folder (MOETRACE_SQL_TEMP_LIMIT)
DEFAULT_TEMP = "4GiB"
#: how far the process's heap may grow while a query runs, as a multiple of its memory limit
HEAP_FACTOR = 1.5
#: rows per streamed Arrow batch
BATCH_ROWS = 65536

_ALLOWED = ("SELECT", "EXPLAIN")


def _size(value: str, what: str) -> str:
    out = checked_size(value, what)
    assert out is not None   # a value was given
    return out


def default_memory_limit() -> str:
    return _size(os.environ.get("MOETRACE_SQL_MEMORY_LIMIT") or DEFAULT_MEMORY, "MOETRACE_SQL_MEMORY_LIMIT")


def default_temp_limit() -> str:
    return _size(os.environ.get("MOETRACE_SQL_TEMP_LIMIT") or DEFAULT_TEMP, "MOETRACE_SQL_TEMP_LIMIT")


def _refuse(what: str) -> UsageError:
    return UsageError(f"sql: {what}; the sandbox runs one SELECT (or EXPLAIN SELECT) over the store's views "
                      f"(--unsafe lifts it)")


def sql_error_text(e: Exception, most: int = 300) -> str:
    """DuckDB's error message with its first part on one line (at most ``most`` characters)
    and, when it points into the query, its "LINE n: ..." line and the caret line under it
    kept as DuckDB aligned them (folded onto one line the caret points at nothing)."""
    text = str(e)
    head, sep, tail = text.partition("\nLINE ")
    out = " ".join(head.split())[:most]
    if sep:
        lines = ("LINE " + tail).splitlines()[:2]
        out += "\n" + "\n".join(x.rstrip() for x in lines)
    return out


def check_statement(query: str) -> None:
    """Refuse anything but one SELECT / EXPLAIN [ANALYZE] SELECT statement."""
    import duckdb

    try:
        stmts = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise StoreError(f"SQL error: {sql_error_text(e)}") from None
    if len(stmts) != 1:
        raise _refuse(f"{len(stmts)} statements given" if stmts else "no statement given")
    kind = stmts[0].type.name
    if kind not in _ALLOWED:
        raise _refuse(f"statement type {kind} is refused")
    if kind == "EXPLAIN":
        _check_explained(query)


def _check_explained(query: str) -> None:
    """``EXPLAIN [ANALYZE] <stmt>``: ANALYZE executes ``<stmt>``, which must be a SELECT."""
    import duckdb

    toks = [(pos, kind) for pos, kind in duckdb.tokenize(query) if kind != duckdb.token_type.comment]
    i = 1
    if len(toks) > 1 and query[toks[1][0]:toks[1][0] + 7].upper() in ("ANALYZE", "ANALYSE"):
        i = 2
    if len(toks) <= i:
        raise _refuse("EXPLAIN of nothing")
    try:
        inner = duckdb.extract_statements(query[toks[i][0]:])
    except duckdb.Error:
        inner = []
    if len(inner) != 1 or inner[0].type.name != "SELECT":
        raise _refuse("EXPLAIN of a statement that is not a SELECT is refused")


def _dir_entry(path: str | os.PathLike[str]) -> str:
    p = os.path.realpath(path)
    return p if p.endswith("/") else p + "/"


def sandbox(con, store_path: str | os.PathLike, allow: Sequence[str] = (), *, memory_limit: str | None = None,
            temp_dir: str) -> None:
    """Limit ``con`` (its views already defined) to the store and the ``allow`` paths, then
    lock its configuration."""
    dirs = [_dir_entry(store_path)]
    files = []
    for a in allow:
        if os.path.isdir(a):
            dirs.append(_dir_entry(a))
        elif os.path.isfile(a):
            files.append(os.path.realpath(a))
        else:
            raise UsageError(f"--allow-path {a}: no such file or folder")
    lst = lambda xs: "[" + ", ".join(sql_literal(x) for x in xs) + "]"  # noqa: E731
    for stmt in (f"SET memory_limit={sql_literal(_size(memory_limit, '--memory-limit') if memory_limit else default_memory_limit())}",
                 f"SET temp_directory={sql_literal(temp_dir)}",
                 f"SET max_temp_directory_size={sql_literal(default_temp_limit())}",
                 f"SET allowed_directories={lst(dirs)}",
                 *( [f"SET allowed_paths={lst(files)}"] if files else []),
                 "SET autoinstall_known_extensions=false",
                 "SET autoload_known_extensions=false",
                 "SET allow_community_extensions=false",
                 "SET enable_external_access=false",
                 "SET lock_configuration=true"):
        con.execute(stmt)


class _Timer:
    """Calls ``con.interrupt()`` after ``seconds`` (None: never)."""

    def __init__(self, con, seconds: float | None):
        self.fired = False
        self._t = None
        if seconds:
            def fire():
                self.fired = True
                con.interrupt()
            self._t = threading.Timer(seconds, fire)
            self._t.daemon = True

    def __enter__(self):
        if self._t:
            self._t.start()
        return self

    def __exit__(self, *exc):
        if self._t:
            self._t.cancel()


def _narrow(df):
    """DuckDB sums BIGINTs into HUGEINT (Decimal(38,0)); integers where every value fits."""
    import polars as pl

    casts = []
    for name, dtype in df.schema.items():
        if isinstance(dtype, pl.Decimal) and (dtype.scale or 0) == 0:
            mx, mn = df[name].max(), df[name].min()
            if mx is None or (abs(int(mx)) < 2**63 and abs(int(mn)) < 2**63):
                casts.append(pl.col(name).cast(pl.Int64))
    return df.with_columns(casts) if casts else df


class _Sink:
    """Where streamed batches go: an -o file (.parquet / .csv), or stdout as csv/json/table."""

    def __init__(self, fmt: str, output: str | None, store_path, pretty: bool, max_rows: int = 50):
        self.fmt, self.output, self.pretty, self.max_rows = fmt, output, pretty, max_rows
        self.rows = 0
        self._writer: Any = None
        self._schema: Any = None
        self._fh: Any = None
        self._head: list[Any] = []
        self._tail: collections.deque[Any] = collections.deque()
        self._tail_rows = 0
        self._first = True
        if output:
            p = Path(output)
            if p.suffix not in (".parquet", ".csv"):
                raise UsageError(f"-o {output}: use a .parquet or .csv file name")
            real = Path(os.path.realpath(p))
            store = Path(os.path.realpath(store_path))
            if real == store or store in real.parents:
                raise UsageError(f"-o {output}: the file is inside the store {store_path}; write it elsewhere")
            from ..output import AtomicOutput

            # written in a private folder beside the target, renamed over it: no guessable
            # temporary name another user could plant a symlink at
            self._out = AtomicOutput(p)
            self._tmp = self._out.tmp

    def add(self, batch) -> None:
        import polars as pl

        if batch.num_rows == 0 and not self._first:
            return
        df = _narrow(pl.from_arrow(batch))
        if isinstance(df, pl.Series):
            df = df.to_frame()
        self.rows += df.height
        if self.output:
            self._add_file(df)
        elif self.fmt == "csv":
            sys.stdout.write(df.write_csv(include_header=self._first))
        elif self.fmt == "json":
            self._add_json(df)
        else:
            self._add_table(df)
        self._first = False

    def _add_file(self, df) -> None:
        assert self.output is not None
        if Path(self.output).suffix == ".csv":
            if self._fh is None:
                self._fh = self._out.open("wb")
            df.write_csv(self._fh, include_header=self._first)
            return
        import pyarrow.parquet as pq

        tbl = df.to_arrow()
        if self._writer is None:
            self._schema = tbl.schema
            self._writer = pq.ParquetWriter(self._tmp, self._schema)
        elif tbl.schema != self._schema:
            try:
                tbl = tbl.cast(self._schema)
            except Exception as e:  # noqa: BLE001 - a later batch no longer fits the first's types
                raise StoreError(f"-o {self.output}: a later batch of rows does not fit the column types of the "
                                 f"first ({' '.join(str(e).split())[:120]}); CAST the columns in the query") from None
        self._writer.write_table(tbl)

    def _add_json(self, df) -> None:
        out = []
        for row in df.to_dicts():
            text = json.dumps(row, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o),
                              indent=2 if self.pretty else None)
            if self.pretty:
                text = "\n".join("  " + ln for ln in text.splitlines())
            out.append(text)
        if not out:
            return
        sep = ",\n" if self.pretty else ", "
        lead = ("[\n" if self.pretty else "[") if self.rows == df.height else sep
        sys.stdout.write(lead + sep.join(out))

    def _add_table(self, df) -> None:
        keep = self.max_rows
        have = sum(h.height for h in self._head)
        if have < keep:
            self._head.append(df.head(keep - have))
            df = df.slice(keep - have)
        if df.height:
            self._tail.append(df)
            self._tail_rows += df.height
            while self._tail and self._tail_rows - self._tail[0].height >= keep:
                self._tail_rows -= self._tail.popleft().height

    def close(self, ok: bool) -> None:
        import click
        import polars as pl

        if self._writer is not None:
            self._writer.close()
        if self._fh is not None:
            self._fh.close()
        if self.output:
            if not ok:
                self._out.abort()
                return
            self._out.commit()   # no batch at all: an empty file with no columns
            click.echo(f"wrote {self.rows} rows to {shown(self.output)}", err=True)
            return
        if not ok:
            return
        if self.fmt == "json":
            sys.stdout.write(("\n]" if self.pretty else "]") if self.rows else "[]")
            sys.stdout.write("\n")
        elif self.fmt == "table":
            from ..output import render_table

            parts = self._head + list(self._tail)
            df = pl.concat(parts) if parts else pl.DataFrame()
            text = render_table(df, max_rows=self.max_rows)
            if self.rows > df.height:
                text = text.rsplit("\n(", 1)[0] + f"\n({self.rows} rows; first and last shown)"
            click.echo(text)


def run_streamed(con, query: str, *, fmt: str, output: str | None, store_path, pretty: bool = False,
                 timeout: float | None = None) -> int:
    """Run ``query`` on ``con`` and stream its rows to ``output`` or stdout; returns the row
    count. A timeout or a DuckDB error is one line (StoreError / UsageError, exit 2)."""
    import duckdb

    sink = _Sink(fmt, output, store_path, pretty)
    ok = False
    timer = _Timer(con, timeout)
    try:
        with timer:
            try:
                rel = con.sql(query)
                if rel is not None:
                    reader = rel.to_arrow_reader(BATCH_ROWS) if hasattr(rel, "to_arrow_reader") \
                        else rel.fetch_arrow_reader(BATCH_ROWS)
                    for batch in reader:
                        sink.add(batch)
            except (duckdb.Error, OSError) as e:
                if timer.fired:
                    raise UsageError(f"sql: the query ran past --timeout {timeout:g} s and was interrupted") from None
                msg = " ".join(str(e).split())[:300]
                if isinstance(e, duckdb.PermissionException) or "disabled by configuration" in msg \
                        or "configuration has been locked" in msg:
                    raise UsageError(f"sql: refused by the sandbox: {msg} (read other Parquet files with "
                                     f"--allow-path DIR; --unsafe lifts the sandbox)") from None
                if isinstance(e, duckdb.OutOfMemoryException) or "Out of Memory" in msg:
                    raise UsageError(f"sql: the query needs more memory than --memory-limit allows: "
                                     f"{msg.split(' Possible solutions')[0]}") from None
                raise StoreError(f"SQL error: {sql_error_text(e)}") from None
        ok = True
    finally:
        sink.close(ok)
    return sink.rows


def run_query(store, query: str, *, fmt: str, output: str | None, pretty: bool = False, unsafe: bool = False,
              allow: Sequence[str] = (), memory_limit: str | None = None, timeout: float | None = None) -> int:
    """``moetrace sql``: ``store.connect()`` (the views), sandboxed unless ``unsafe``, then
    :func:`run_streamed`. The private spill folder is removed afterwards."""
    if not unsafe:
        check_statement(query)
    elif allow:
        raise UsageError("--allow-path is for the sandbox; --unsafe already reads any file")
    tmp = tempfile.mkdtemp(prefix="moetrace-sql-")
    limit = _size(memory_limit, "--memory-limit") if memory_limit else default_memory_limit()
    try:
        con = store.connect(memory_limit=limit)
        try:
            if unsafe:
                con.execute(f"SET temp_directory={sql_literal(tmp)}")
            else:
                sandbox(con, store.path, list(allow), memory_limit=limit, temp_dir=tmp)
            # DuckDB's limit covers its buffer manager, not every string it builds: the
            # process's heap may grow by HEAP_FACTOR x the limit while the query runs
            with heap_cap(int(HEAP_FACTOR * size_bytes(limit))):
                try:
                    return run_streamed(con, query, fmt=fmt, output=output, store_path=store.path, pretty=pretty,
                                        timeout=timeout)
                except MemoryError:
                    raise UsageError(f"sql: the query needs more memory than --memory-limit {limit} allows "
                                     f"(the process may use {HEAP_FACTOR:g} x the limit)") from None
        finally:
            con.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

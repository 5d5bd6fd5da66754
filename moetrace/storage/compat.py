"""Stores written before a contract column existed: how a table's view reads such files.

A store is never rewritten to a newer contract. Where a table's files lack a column of
its contract, the view reads NULL for a nullable column, computes a derivable one
(:data:`DERIVED_WHEN_MISSING`) and refuses a required one with one line naming the
schema versions found (tests/test_store_old.py builds such stores by hand)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..safety import sql_identifier
from ..version import __version__
from . import schema

if TYPE_CHECKING:
    import duckdb

#: required columns added to a contract after stores were written without them, and how a
#: view computes them from such a store's files (the writer's definition is the reference:
#: ``tokens_desc`` is ``dense_table``'s counts sorted descending)
DERIVED_WHEN_MISSING = {("expert_counts", "tokens_desc"): "list_reverse_sort(tokens)"}


def column_sql(path: Path, table: str, column: str, present: set[str] | None,
               scratch: Callable[[], duckdb.DuckDBPyConnection], footers: dict[str, Any]) -> str:
    """One column of a table's view: the column itself, or what stands for it where the
    table's files predate it. A derived column (:data:`DERIVED_WHEN_MISSING`) is looked
    up in every file's footer, since a store that was written on after an upgrade holds
    both kinds of file (the column read NULL from the older ones): it is the column
    where every file has it, computed where none has, and the two coalesced otherwise.
    ``scratch``: a connection to read footers on; ``footers``: their cache."""
    ident = sql_identifier(column)
    if (table, column) in DERIVED_WHEN_MISSING:
        lacking, total = files_lacking(path, table, column, scratch, footers)
        if lacking == 0:
            return ident
        derived = DERIVED_WHEN_MISSING[table, column]
        return f"{derived} AS {ident}" if lacking == total else f"coalesce({ident}, {derived}) AS {ident}"
    if present is None or column in present:
        return ident
    return f"{missing_column(path, table, column)} AS {ident}"


def files_lacking(path: Path, table: str, column: str, scratch: Callable[[], duckdb.DuckDBPyConnection],
                  footers: dict[str, Any]) -> tuple[int, int]:
    """(files of ``table`` whose footer lacks ``column``, files of ``table``); a file
    whose footer cannot be read counts as lacking it (the view then coalesces, which
    is right either way)."""
    from .files import walk

    files = walk(path, [table]).paths(table)  # what the view reads
    if not files:
        return 0, 0
    from .check import footer_columns
    from .duck import duckdb

    held: dict[str, Any] | None
    try:   # every footer in one DuckDB query (no pyarrow: a reader's start-up)
        held = footer_columns(scratch(), files, footers)
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


def missing_column(path: Path, table: str, column: str) -> str:
    """The SQL that stands for ``column`` in a store whose ``table`` files predate it:
    NULL of its type when it is nullable, else a StoreError naming the versions found."""
    col = next(c for c in schema.get(table).columns if c.name == column)
    if col.nullable:
        return f"CAST(NULL AS {schema.DUCK_TYPES[col.type]})"
    found = sorted(file_versions(path, table)) or ["unknown"]
    raise StoreError(f"{path}: table {table!r} was written with schema version {', '.join(found)}, whose files "
                     f"lack the required column {column!r} of version {schema.get(table).version}; this moetrace "
                     f"({__version__}) cannot read it: re-ingest the sources into a new store, or read it with "
                     f"the moetrace that wrote it")


def file_versions(path: Path, table: str) -> set[str]:
    """The schema versions recorded in the footers of ``table``'s files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = set()
    from .files import walk

    for f in walk(path, [table]).paths(table):
        try:
            meta = pq.read_schema(f).metadata or {}
        except (OSError, pa.ArrowException):
            continue
        out.add(meta.get(schema.META_VERSION, b"none").decode(errors="replace"))
    return out

"""What in a store folder cannot be read, file by file, without changing anything.

:func:`scan` walks a store the way its readers do (``<table>/run_id=<id>/*.parquet`` of
every contract table, the journals in ``.txn``) and returns one :class:`Problem` per file
that a reader would trip on: a truncated or garbage Parquet file (its footer), a file whose
columns have the wrong types for its table, a file holding its own ``run_id`` column
(the partition folder's name is the run id: the two could disagree), a partition folder
whose name is not ``run_id=<id>``, a file where a folder is expected (or the reverse), a
journal that is not what a writer writes. ``deep=True`` (``moetrace check``) also reads
every file's pages, so corruption past the footer is found too.

Readers call :func:`first_problem` before they build their views (footers only: one small
read per file), so a bad file is one line naming it, exit 2, instead of an Arrow, polars or
DuckDB internal error (docs/hardening.md).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

_SAFE_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_TXID_RE = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class Problem:
    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def _schema_problem(table: str, names: list[str], types: list, contract) -> str | None:
    from .schema import _compatible

    if "run_id" in names:
        return ("holds a run_id column; a store file's run id is its partition folder's name (the two could "
                "disagree)")
    want = {c.name: c for c in contract.columns}
    for name, typ in zip(names, types):
        c = want.get(name)
        if c is None:
            continue
        if not _compatible(typ, c.arrow_type):
            return f"column {name!r} is {typ}, table {table!r} needs {c.arrow_type}"
    if not any(n in want for n in names):
        return f"none of its columns ({', '.join(names[:5]) or 'none'}) belongs to table {table!r}"
    return None


#: DuckDB types of a file column that the contract's type surely accepts (what
#: :func:`moetrace.storage.schema._compatible` accepts of the Arrow type pyarrow reads;
#: anything else is looked at by pyarrow, which has the last word)
_INTS = frozenset({"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT"})
_DUCK_OK = {"string": frozenset({"VARCHAR"}), "bool": frozenset({"BOOLEAN"}),
            **{t: _INTS | {"BOOLEAN"} for t in ("int8", "int16", "int32", "int64")},
            **{t: _INTS | {"FLOAT", "DOUBLE"} for t in ("float32", "float64")},
            "int64[]": frozenset(f"{t}[]" for t in _INTS | {"BOOLEAN"})}


def footer_columns(con, files, cache: dict | None = None) -> dict[str, list[tuple[str, str]]]:
    """{file name: [(top-level column, DuckDB type)]} of Parquet ``files`` from their
    footers, in one DuckDB query on ``con`` (raises what DuckDB raises on a bad footer).
    ``cache``: a dict a caller keeps (a Store: its check and its views read the same
    footers), keyed by file name, size and modification time; only the files it lacks are
    read."""
    if cache is None:
        return _footer_columns(con, files)
    keys = {}
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        keys[str(f)] = (str(f), st.st_size, st.st_mtime_ns)
    missing = [f for f in keys if keys[f] not in cache]
    if missing:
        got = _footer_columns(con, missing)
        for f in missing:
            if f in got:
                cache[keys[f]] = got[f]
    return {f: cache[k] for f, k in keys.items() if k in cache}


def _footer_columns(con, files) -> dict[str, list[tuple[str, str]]]:
    from ..safety import sql_literal

    if not files:
        return {}
    rows = con.execute("SELECT file_name, name, num_children, duckdb_type FROM parquet_schema(["
                       + ", ".join(sql_literal(f) for f in files) + "]) ORDER BY file_name, column_id").fetchall()
    by_file: dict[str, list[tuple]] = {}
    for r in rows:
        by_file.setdefault(r[0], []).append(r[1:])
    out = {}
    for f, elems in by_file.items():
        top, i = [], 1          # the root's children, each with its subtree skipped
        for _ in range(elems[0][1] or 0):
            if i >= len(elems):
                break
            top.append((elems[i][0], elems[i][2]))
            todo = elems[i][1] or 0
            i += 1
            while todo and i < len(elems):
                todo += (elems[i][1] or 0) - 1
                i += 1
        else:
            if i == len(elems):
                out[f] = top
    return out


def _quick_footers(root: Path, tables, con=None, cache: dict | None = None) -> set[Path]:
    """The store's data files whose footers DuckDB reads and finds plainly right for their
    table (one query over every footer, no pyarrow: a reader's start-up). A file
    left out is not wrong: :func:`_check_file` reads it with pyarrow, which decides (and
    names the problem); a footer DuckDB cannot read leaves every file to pyarrow."""
    files = {f: t for t in tables for f in (root / t).glob("run_id=*/*.parquet")}
    if not files:
        return set()
    try:
        if con is not None:
            cols = footer_columns(con, list(files), cache)
        else:
            from .duck import connect, threads_setting

            con = connect(threads_setting())
            try:
                cols = footer_columns(con, list(files))
            finally:
                con.close()
    except Exception:   # noqa: BLE001 - any failure: pyarrow looks at every file, as before
        return set()
    ok = set()
    for f, table in files.items():
        top = cols.get(str(f))
        if not top:
            continue
        want = {c.name: c.type for c in tables[table].columns}
        names = [n for n, _ in top]
        if ("run_id" not in names and any(n in want for n in names)
                and all(n not in want or typ in _DUCK_OK[want[n]] for n, typ in top)):
            ok.add(f)
    return ok


def _check_file(table: str, f: Path, contract, deep: bool, trusted: set[Path] | frozenset[Path] = frozenset()) -> str | None:
    if f.is_symlink():
        return "is a symlink; a store holds its own files only"
    if not f.is_file():
        return "is not a regular file (a folder or a device where a Parquet file is expected)"
    try:
        if f.stat().st_size < 12:
            return f"is {f.stat().st_size} bytes, too short for a Parquet file (truncated)"
    except OSError as e:
        msg = " ".join(str(e).split())[:160] or type(e).__name__
        return f"not a readable Parquet file (truncated or corrupt): {msg}"
    if f in trusted and not deep:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        sch = pf.schema_arrow
        why = _schema_problem(table, sch.names, sch.types, contract)
        if why:
            return why
        if deep:
            for i in range(pf.metadata.num_row_groups):
                pf.read_row_group(i)
    except (OSError, pa.ArrowException, ValueError, EOFError) as e:
        msg = " ".join(str(e).split())[:160] or type(e).__name__
        return f"not a readable Parquet file (truncated or corrupt): {msg}"
    return None


def scan(store: str | os.PathLike, deep: bool = False, quick: bool = False, con=None,
         cache: dict | None = None) -> list[Problem]:
    """Every file of the store that a reader cannot read, in path order. ``quick``: the
    footers DuckDB finds plainly right are not read again by pyarrow (:func:`_quick_footers`,
    on the DuckDB connection ``con`` when given)."""
    from . import schema

    root = Path(store)
    out: list[Problem] = []
    tables = schema.load_all()
    trusted = _quick_footers(root, tables, con, cache) if quick and not deep else set()
    committed = set()
    runs_dir = root / "runs"
    for table in sorted(tables, key=lambda t: t != "runs"):
        d = root / table
        if not (d.exists() or d.is_symlink()):
            continue
        if not d.is_dir():
            out.append(Problem(str(d), f"is a file where the folder of table {table!r} is expected"))
            continue
        for part in sorted(d.iterdir()):
            if part.name.startswith("."):
                continue
            if not part.is_dir():
                out.append(Problem(str(part), f"is a file where a partition folder run_id=<id> of table {table!r} "
                                              "is expected"))
                continue
            if not part.name.startswith("run_id=") or not _SAFE_ID_RE.fullmatch(part.name[7:]):
                out.append(Problem(str(part), "partition folder name is not run_id=<id> (letters, digits, . _ -)"))
                continue
            if table == "runs":
                committed.add(part.name[7:])
            elif runs_dir.is_dir() and part.name[7:] not in committed:
                out.append(Problem(str(part), "has no runs row: an uncommitted or orphaned write, hidden from "
                                              "every view (a crashed writer's journal, if any, is rolled back at "
                                              "the next write)"))
            for f in sorted(part.iterdir()):
                if not f.name.endswith(".parquet"):
                    continue
                why = _check_file(table, f, tables[table], deep, trusted)
                if why:
                    out.append(Problem(str(f), why))
    out += _journal_problems(root)
    return out


def _journal_problems(root: Path) -> list[Problem]:
    out = []
    for name in (".txn", ".staging"):
        d = root / name
        if d.is_symlink():
            out.append(Problem(str(d), "is a symlink; refused by every writer"))
        elif d.exists() and not d.is_dir():
            out.append(Problem(str(d), "is a file where moetrace's transaction folder is expected"))
    txn = root / ".txn"
    if txn.is_dir() and not txn.is_symlink():
        for j in sorted(txn.iterdir()):
            if not (j.name.endswith(".json") and _TXID_RE.fullmatch(j.name[:-5])):
                continue
            if j.is_symlink() or not j.is_file():
                out.append(Problem(str(j), "journal is not a regular file"))
                continue
            try:
                doc = json.loads(j.read_bytes()[: 64 << 20])
            except (OSError, ValueError, RecursionError):
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
                out.append(Problem(str(j), "malformed journal (not {\"files\": [...], \"commit_file\": ...})"))
                continue
            for rel in doc["files"]:
                if not isinstance(rel, str):
                    out.append(Problem(str(j), "malformed journal (an entry is not a path)"))
                    break
                parts = rel.split("/")
                for k in range(1, len(parts)):
                    p = root.joinpath(*parts[:k])
                    if p.exists() and not p.is_dir():
                        out.append(Problem(str(j), f"entry {rel[:80]!r}: {p} is a file where a folder is expected"))
                        break
    return out


def first_problem(store: str | os.PathLike, con=None, cache: dict | None = None) -> Problem | None:
    """The first problem :func:`scan` finds with footers only (what readers check), or None.
    Uncommitted partitions are not problems for a reader (the views hide them)."""
    root = Path(store)
    for p in scan(store, deep=False, quick=True, con=con, cache=cache):
        if "has no runs row" in p.what or Path(p.file).parent.name in (".txn", ".staging") \
                or Path(p.file) in (root / ".txn", root / ".staging"):
            continue   # journals are the writers' business (Store.journals refuses a bad one)
        return p
    return None


def check_readable(store: str | os.PathLike, con=None, cache: dict | None = None) -> None:
    """Raise StoreError (one line naming the file) when a reader would trip on a file
    (``con``: a DuckDB connection to read the footers on, else one made for it; ``cache``:
    see :func:`footer_columns`)."""
    from ..errors import StoreError

    p = first_problem(store, con, cache)
    if p is not None:
        raise StoreError(f"{p}; `moetrace check {store}` lists every such file")

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
from pathlib import Path

from .files import LimitReached, Problem, footer_problem, marker_problem, walk
from .paths import _TXID_RE, STORE_MARKER


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


def _quick_footers(files: dict[Path, str], tables, con=None, cache: dict | None = None) -> set[Path]:
    """The store's data files ``files`` ({path: table}) whose footers DuckDB reads and finds
    plainly right for their table (one query over every footer, no pyarrow: a reader's
    start-up). A file left out is not wrong: :func:`_check_file` reads it with pyarrow,
    which decides (and names the problem); a footer DuckDB cannot read leaves every file
    to pyarrow."""
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
    """Why the listed store file ``f`` cannot be read, else None: its size and footer
    length first (:func:`.files.footer_problem`, from its last bytes), then its schema
    (``trusted``: DuckDB found it right), ``deep``: every page."""
    why = footer_problem(f)
    if why or (f in trusted and not deep):
        return why
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
    """Every thing in the store a reader cannot read, in path order: the marker, entries
    that are not regular files in real folders (:func:`.files.walk`), more files or
    partitions than the limits allow, unreadable files, ``runs`` rows whose values cannot
    size anything and dense lists longer than their run's experts (:func:`content_problems`),
    partitions without a runs row, and journals a writer would refuse. ``quick``: the
    footers DuckDB finds plainly right are not read again by pyarrow
    (:func:`_quick_footers`, on the DuckDB connection ``con`` when given)."""
    from . import schema

    root = Path(store)
    out: list[Problem] = []
    why = marker_problem(root)
    if why:
        out.append(Problem(str(root / STORE_MARKER), why))
    tables = schema.load_all()
    try:
        listing = walk(root)
    except LimitReached as e:
        return out + [e.problem]
    out += listing.problems
    committed = set(listing.files.get("runs", {}))
    has_runs = (root / "runs").is_dir()
    files = {}
    for table in sorted(listing.files, key=lambda t: t != "runs"):
        for run, names in sorted(listing.files[table].items()):
            if table != "runs" and has_runs and run not in committed:
                out.append(Problem(str(root / table / f"run_id={run}"),
                                   "has no runs row: an uncommitted or orphaned write, hidden from every view (a "
                                   "crashed writer's journal, if any, is rolled back at the next write)"))
            files.update({root / table / f"run_id={run}" / n: table for n in names})
    trusted = _quick_footers(files, tables, con, cache) if quick and not deep else set()
    readable: dict[Path, str] = {}
    for f, table in files.items():
        why = _check_file(table, f, tables[table], deep, trusted)
        if why:
            out.append(Problem(str(f), why))
        else:
            readable[f] = table
    out += content_problems(readable, con)
    out += _journal_problems(root, listing)
    return sorted(out, key=lambda p: p.file)


def content_problems(files: dict[Path, str], con=None) -> list[Problem]:
    """What the footers of readable store files ``files`` ({path: table}) say a reader
    must not use, before any value sizes an array: a ``runs`` file holds exactly one row
    (a run's row), whose numbers are within their physical range and consistent
    (:func:`moetrace.domain.run_bounds.runs_row_problem`); a dense ``expert_counts`` file
    holds at most its rows x the run's experts list values (2^24 when unknown), so no list
    is longer than a layer has experts."""
    from ..domain.run_bounds import SHAPE_MAX, runs_row_problem
    from ..safety import sql_literal
    from .duck import duckdb

    runs = [f for f, t in files.items() if t == "runs"]
    dense = [f for f, t in files.items() if t == "expert_counts"]
    if not runs and not dense:
        return []
    own = con is None
    if own:
        from .duck import connect, threads_setting

        con = connect(threads_setting())
    out: list[Problem] = []
    experts: dict[str, int | None] = {}
    try:
        def listed(fs):
            return "[" + ", ".join(sql_literal(f) for f in fs) + "]"

        if runs:
            nrows = dict(con.execute(f"SELECT file_name, num_rows FROM parquet_file_metadata({listed(runs)})")
                         .fetchall())
            one = [f for f in runs if nrows.get(str(f)) == 1]
            out += [Problem(str(f), f"a runs file holds {nrows.get(str(f))} rows; a run's file holds its one row")
                    for f in runs if f not in one]
            if one:
                cur = con.execute(f"SELECT * FROM read_parquet({listed(one)}, filename=true, union_by_name=true)")
                names = [d[0] for d in cur.description]
                for row in cur.fetchall():
                    rec = dict(zip(names, row))
                    why = runs_row_problem(rec)
                    f = Path(rec["filename"])
                    if why:
                        out.append(Problem(str(f), f"runs row: {why}; a reader would size arrays by it"))
                    else:
                        experts[f.parent.name[7:]] = rec.get("num_experts")
        if dense:
            got = con.execute(
                "WITH m AS (SELECT file_name, column_id, num_values, path_in_schema, row_group_id, "
                f"row_group_num_rows FROM parquet_metadata({listed(dense)}) WHERE starts_with(path_in_schema, "
                "'tokens')) SELECT file_name, path_in_schema, sum(num_values), sum(row_group_num_rows) FROM m "
                "GROUP BY ALL").fetchall()
            for name, col, values, rows in got:
                f = Path(name)
                e = experts.get(f.parent.name[7:]) or SHAPE_MAX
                if values is not None and rows is not None and int(values) > int(rows) * e:
                    out.append(Problem(name, f"expert_counts.{col.split(',')[0]} holds {int(values)} values in "
                                             f"{int(rows)} rows, more than {e} per row (the run's experts)"))
    except duckdb.Error as e:
        out.append(Problem(str((runs or dense)[0].parent.parent.parent),
                           f"cannot read the footers ({' '.join(str(e).split())[:160]})"))
    finally:
        if own:
            con.close()
    return out


def _journal_problems(root: Path, listing) -> list[Problem]:
    """The transaction folders and journals a writer would refuse (:meth:`.Writer.journals`:
    malformed, or naming a transaction the store holds committed), each one line."""
    from .writer import _journal_problem, journal_conflict

    out = []
    for name in (".txn", ".staging", ".lock"):
        d = root / name
        if d.is_symlink():
            out.append(Problem(str(d), "is a symlink; refused by every writer"))
        elif name != ".lock" and d.exists() and not d.is_dir():
            out.append(Problem(str(d), "is a file where moetrace's transaction folder is expected"))
    txn = root / ".txn"
    if not txn.is_dir() or txn.is_symlink():
        return out
    in_store = listing.rel()
    for j in sorted(txn.iterdir()):
        if not (j.name.endswith(".json") and _TXID_RE.fullmatch(j.name[:-5])):
            continue
        if j.is_symlink() or not j.is_file():
            out.append(Problem(str(j), "journal is not a regular file"))
            continue
        try:
            raw = j.read_bytes() if j.stat().st_size < (64 << 20) else b""
            doc = json.loads(raw)
        except (OSError, ValueError, RecursionError):
            doc = None
        why = _journal_problem(doc, j.name[:-5]) or journal_conflict(j.name[:-5], doc, in_store)
        if why:
            out.append(Problem(str(j), f"malformed journal ({why}); every writer refuses it"))
            continue
        for rel in doc["files"]:
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
                or Path(p.file) in (root / ".txn", root / ".staging", root / ".lock", root / STORE_MARKER):
            continue   # journals are the writers' business (a writer refuses a bad one, readers ignore
        return p       # it); the marker is checked when the store is opened (an empty folder has none)
    return None


def check_new_files(store: str | os.PathLike, rel_files: list[str], con=None) -> None:
    """Raise StoreError (one line naming the file) when one of the data files ``rel_files``
    (relative to the store, listed by :func:`.files.walk`) committed after the store was
    checked has a footer or values a reader must not use (:func:`.files.footer_problem`,
    :func:`content_problems`)."""
    from ..errors import StoreError

    root = Path(store)
    ok: dict[Path, str] = {}
    for rel in rel_files:
        f = root / rel
        why = footer_problem(f)
        if why:
            raise StoreError(f"{f}: {why}; `moetrace check {store}` lists every such file")
        ok[f] = rel.split("/", 1)[0]
    for p in content_problems(ok, con):
        raise StoreError(f"{p}; `moetrace check {store}` lists every such file")


def check_readable(store: str | os.PathLike, con=None, cache: dict | None = None) -> None:
    """Raise StoreError (one line naming the file) when a reader would trip on a file
    (``con``: a DuckDB connection to read the footers on, else one made for it; ``cache``:
    see :func:`footer_columns`)."""
    from ..errors import StoreError

    p = first_problem(store, con, cache)
    if p is not None:
        raise StoreError(f"{p}; `moetrace check {store}` lists every such file")

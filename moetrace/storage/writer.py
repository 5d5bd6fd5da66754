"""A store's writes as transactions: staging, the journal, renames into place (``runs``
last), the write lock, and recovery of an abandoned write (rolled back, or forward when
the ``runs`` row made it); and the committed files readers may read.

:class:`Writer` knows the store's folder only. A :class:`~moetrace.storage.store.Store`
holds one (``store.writer``) and calls it; what a write needs from the reading side (the
run an ingest key was already written as) is passed in, and refreshing the readers'
views and the catalog after a commit is the store's job."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SchemaError, StoreError
from ..version import __version__
from . import schema
from .files import run_ids, walk
from .paths import (
    _SAFE_ID_RE,
    _TXID_RE,
    RUN_ID_MAX,
    STORE_FORMAT,
    STORE_MARKER,
    sanitize_run_id,
)

if TYPE_CHECKING:  # writers import Arrow lazily: a reader never imports it
    import pyarrow as pa

_CATALOG_TMP_RE = re.compile(r"\.catalog-[0-9a-f]{8}\.duckdb(\.wal)?")


def _txid_of(rel: str) -> str | None:
    """The transaction id in a data file's name (``part-<txid>.parquet``), else None."""
    name = rel.rsplit("/", 1)[-1]
    x = name[5:17] if name.startswith("part-") else ""
    return x if _TXID_RE.fullmatch(x) and name[17:] in (".parquet",) else None


def _is_polars(obj: object) -> bool:
    """A polars DataFrame (polars is imported only where one exists, so a reader's start-up
    never pays for it)."""
    pl = sys.modules.get("polars")
    return pl is not None and isinstance(obj, pl.DataFrame)


@dataclass
class WriteResult:
    run_id: str
    skipped: bool = False
    rows: dict[str, int] = field(default_factory=dict)
    message: str = ""


def _encodings(sch: pa.Schema) -> dict[str, Any]:
    """Parquet writer options of a table: lists of integers (``expert_counts``' counts)
    delta-encoded instead of dictionary-encoded. Measured on the 10M-row benchmark's dense
    rows (benchmarks/results/scale_log.md, one pass): the writer's CPU 0.60-0.71 -> 0.39-0.54 s, reading
    them back a little faster too (pyarrow, DuckDB), the file 6% larger (22.0 vs 20.8 MB)."""
    import pyarrow as pa

    delta = [f.name for f in sch if pa.types.is_list(f.type) and pa.types.is_integer(f.type.value_type)]
    if not delta:
        return {}
    return {"use_dictionary": [f.name for f in sch if f.name not in delta],
            "column_encoding": {f"{c}.list.element": "DELTA_BINARY_PACKED" for c in delta}}


def _journal_problem(doc: Any, txid: str) -> str | None:
    """Why ``doc`` is not a journal a writer of transaction ``txid`` writes, else None."""
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
    # a writer lists its files in rename order and renames the commit file last: the runs
    # row of a new run, else the header row of an append (Writer.HEADER_TABLES)
    if commit is not None and commit != files[-1]:
        return "commit_file is not its last file (a writer renames its commit file last)"
    tables = [f.split("/")[0] for f in files]
    for first in ("runs", *Writer.HEADER_TABLES):
        if first in tables:
            if commit is None or commit.split("/")[0] != first:
                return f"it lists a {first} file that is not its commit file (a writer commits with that file)"
            break
    return None


def journal_conflict(txid: str, doc: Journal, in_store: Iterable[str]) -> str | None:
    """Why the journal ``doc`` of ``txid`` cannot be a crashed write, given the store's data
    files ``in_store`` (paths relative to the store), else None. A writer puts its journal,
    listing every file its transaction renames, in place before the first rename: a file
    of ``txid`` in the store that the journal does not list belongs to a transaction that
    committed without it (a planted or stale journal), and rolling the journal back would
    remove part of a committed transaction."""
    listed = set(doc["files"])
    extra = sorted(f for f in in_store if _txid_of(f) == txid and f not in listed)
    if extra:
        return (f"it does not list {extra[0][:100]!r}, a file of its transaction in the store: that "
                f"transaction was committed without this journal")
    return None


#: a pending journal: the files a transaction renames into place, and the one renamed last
Journal = dict[str, Any]


class Writer:
    """The transactions of the store at ``path``: create, lock, write, append, drop,
    recover; and :meth:`committed_files`, what readers may read now."""

    #: tables an append renames last when present: the row that names what the other rows
    #: belong to (a plan's ``plans`` row, a replay's ``replay_runs`` row, a stored analysis's
    #: ``analysis_cache`` row)
    HEADER_TABLES = ("plans", "replay_runs", "analysis_cache")

    def __init__(self, path: Path) -> None:
        self.path = path

    # ------------------------------------------------------------------ creation, locking
    def create(self) -> None:
        """Make the store (its folder and marker) when there is none; racing creators each
        rename their own marker into place."""
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
    def lock(self) -> Iterator[None]:
        """Hold the store's write lock (``.lock``, flock) for the block."""
        self.check_no_symlinks()
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

    def check_writable(self) -> None:
        if not os.access(self.path, os.W_OK):
            raise StoreError(f"{self.path}: store is read-only; nothing was written")

    # ------------------------------------------------------------------ recovery
    def recover_if_abandoned(self) -> None:
        """On a writer's open: a journal whose writer no longer holds the lock was left by
        a crash; finish or roll it back now. A journal of a live writer (lock held) is left
        alone; a store we cannot write, or without any leftovers, is left as is."""
        if not os.access(self.path, os.W_OK):
            return
        if not any((self.path / d).is_symlink() or (self.path / d).exists() for d in (".txn", ".staging")) \
                and not any(self.path.glob(".catalog-*.duckdb*")):
            return
        self.check_no_symlinks()
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

    def check_no_symlinks(self) -> None:
        """The transaction folders are ours: a symlink there would redirect our deletes
        and writes outside the store, so it is refused."""
        for d in (".txn", ".staging", ".lock"):
            if (self.path / d).is_symlink():
                raise StoreError(f"{self.path / d}: is a symlink; refused (moetrace never follows links "
                                 f"in its transaction folders); remove it to use this store")

    def journals(self) -> dict[str, Journal]:
        """Pending journals, validated: {txid: {"files": [...], "commit_file": str|None}}.
        Files in .txn with other names are not ours and are left alone. Raises StoreError
        (naming the journal) for one whose content is not exactly what a writer writes."""
        txn_dir = self.path / ".txn"
        out: dict[str, Journal] = {}
        if not txn_dir.is_dir() or txn_dir.is_symlink():
            return out
        for j in sorted(txn_dir.iterdir()):
            if not (j.name.endswith(".json") and _TXID_RE.fullmatch(j.name[:-5])):
                continue
            txid = j.name[:-5]
            try:
                mode = j.lstat().st_mode
            except FileNotFoundError:
                continue   # removed since the listing: its writer (not holding our lock) is done with it
            if not stat.S_ISREG(mode):   # a symlink, a folder, a device
                raise StoreError(f"{j}: malformed journal (not a regular file); nothing was changed")
            doc: Any
            try:
                raw = j.read_bytes()
                doc = json.loads(raw) if len(raw) < (64 << 20) else None
            except FileNotFoundError:
                continue   # the same, removed between the check and the read
            except (OSError, ValueError, RecursionError):
                doc = None
            why = _journal_problem(doc, txid)
            if why:
                raise StoreError(f"{j}: malformed journal ({why}); nothing was changed; a moetrace "
                                 f"writer never writes this, remove the file after checking the store")
            out[txid] = doc
        if out:
            in_store = walk(self.path).rel()
            for txid, doc in out.items():
                why = journal_conflict(txid, doc, in_store)
                if why:
                    raise StoreError(f"{txn_dir / (txid + '.json')}: refused journal ({why}); nothing was "
                                     f"changed; remove the file after checking the store")
        return out

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
        self.check_no_symlinks()
        journals = self.journals()  # validates every journal before anything is removed
        for _txid, doc in journals.items():
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
        for t in self.path.glob(".catalog-*.duckdb*"):  # a catalog write cut short (it holds the lock too)
            if _CATALOG_TMP_RE.fullmatch(t.name) and t.is_file() and not t.is_symlink():
                t.unlink()
                done.append(f"removed unfinished catalog {t.name}")
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
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        return True

    # ------------------------------------------------------------------ what readers see
    def _scan_files(self) -> dict[str, list[str]]:
        """{table: [files]} of every contract table, paths relative to the store: regular
        files in real folders only (:func:`.files.walk`)."""
        listing = walk(self.path)
        return {t: listing.rel(t) for t in listing.files if listing.rel(t)}

    def _reader_journals(self) -> dict[str, tuple[list[str], str | None]]:
        """Pending journals as a reader sees them: {txid: (files, commit_file)}. A reader
        never refuses or removes: a journal no writer writes (one it cannot parse, or that
        breaks a writer's rules) is no pending write and is ignored (writers refuse it).
        A writer renames a whole journal into place, so a reader never meets half of one."""
        out: dict[str, tuple[list[str], str | None]] = {}
        txn_dir = self.path / ".txn"
        if txn_dir.is_symlink() or not txn_dir.is_dir():
            return out
        with contextlib.suppress(OSError), os.scandir(txn_dir) as it:
            for j in it:
                if not (j.name.endswith(".json") and _TXID_RE.fullmatch(j.name[:-5])):
                    continue
                txid, doc = j.name[:-5], None
                with contextlib.suppress(OSError, ValueError, RecursionError):
                    if j.is_file(follow_symlinks=False) and j.stat().st_size < (64 << 20):
                        doc = json.loads(Path(j.path).read_bytes())
                if doc is not None and not _journal_problem(doc, txid):
                    out[txid] = (doc["files"], doc["commit_file"])
        return out

    def committed_files(self) -> dict[str, tuple[str, ...]]:
        """{table: files} a reader may read now: every transaction's files or none of them.

        A transaction puts its journal in place before its first rename and removes it
        after its last, and renames its commit file last. So: scan the files (1), read
        the journals (2), scan again (3). A transaction with a journal at (2) is visible
        only if its commit file is in place (then all its files are: its journal lists
        them); one without a journal at (2) that had a file at (1) had its journal before
        (1) and none at (2), so every rename was done before (3): its files at (3) are
        whole. A transaction first seen at (3) may be mid-rename: it waits for the next
        query. Files whose name carries no transaction id are always visible."""
        first = self._scan_files()
        pending = self._reader_journals()
        # a journal naming a transaction the store holds committed (files of it it does not
        # list) is no pending write: readers read that transaction, writers refuse the journal
        listed = [f for fs in first.values() for f in fs]
        pending = {x: (fs, c) for x, (fs, c) in pending.items()
                   if not journal_conflict(x, {"files": fs, "commit_file": c}, listed)}
        committed = {x: files for x, (files, commit) in pending.items()
                     if commit and (self.path / commit).is_file()}
        last = self._scan_files()
        seen = {_txid_of(f) for files in first.values() for f in files}
        out: dict[str, list[str]] = {}
        for table, files in last.items():
            for f in files:
                x = _txid_of(f)
                if x is None or (x in seen and x not in pending):
                    out.setdefault(table, []).append(f)
        for files in committed.values():
            for f in files:
                if (self.path / f).is_file():
                    out.setdefault(f.split("/")[0], []).append(f)
        return {t: tuple(sorted(set(fs))) for t, fs in sorted(out.items())}

    # ------------------------------------------------------------------ writing
    def unique_run_id(self, hint: str) -> str:
        """``hint`` made a run id no run of the store has (``hint``, ``hint-2``, ...)."""
        base = sanitize_run_id(hint)
        taken = set(run_ids(self.path))
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
    def _chunks(data: object) -> Iterator[Any]:
        import pyarrow as pa

        if isinstance(data, (pa.Table, dict)) or _is_polars(data):
            yield data
        else:
            assert isinstance(data, Iterable), type(data)
            yield from data

    def write_run(self, run: dict[str, Any], tables: dict[str, object], *, run_id: str | None = None,
                  run_id_hint: str | None = None,
                  existing: Callable[[str], str | None] | None = None) -> WriteResult:
        """Write a new run, its ``runs`` row and its tables, as one transaction (see
        :meth:`moetrace.storage.store.Store.write_run`). ``existing``: the run already
        written with a dedupe key, or None (no dedupe when not given); asked before the
        lock is taken and again under it."""
        run = dict(run)
        sha = run.get("ingest_key") or run.get("source_sha256")
        if existing is not None and sha:
            found = existing(sha)
            if found is not None:
                return WriteResult(found, skipped=True, message=f"already ingested as run {found!r}")
        self.create()  # a store opened read-only on an empty folder is created by its first write
        with self.lock():
            self.check_writable()
            self.recover()
            if existing is not None and sha:
                found = existing(sha)
                if found is not None:
                    return WriteResult(found, skipped=True, message=f"already ingested as run {found!r}")
            # a hint becomes a free id under the lock (two writers with one hint get hint, hint-2)
            rid = run_id or run.get("run_id") or self.unique_run_id(run_id_hint or run.get("source", "run"))
            rid = sanitize_run_id(rid)
            if rid in run_ids(self.path):
                raise StoreError(f"{self.path}: run {rid!r} already exists; pick another --run-id")
            run["run_id"] = rid
            run.setdefault("ingested_at_ns", time.time_ns())
            run.setdefault("collector_version", __version__)
            for col in schema.get("runs").columns:
                run.setdefault(col.name, False if col.type == "bool" and not col.nullable else None)
            runs_tbl = schema.conform("runs", schema.one_row(run))
            rows = self._transaction(rid, {**tables, "runs": runs_tbl}, commit_table="runs")
        return WriteResult(rid, rows=rows)

    def append(self, run_id: str, tables: dict[str, object], *, replace: bool = False) -> dict[str, int]:
        """Add rows to an existing run as one transaction (see
        :meth:`moetrace.storage.store.Store.append`); returns {table: rows}."""
        if run_id not in run_ids(self.path):
            raise StoreError(f"{self.path}: no run {run_id!r}")
        with self.lock():
            self.check_writable()
            self.recover()
            header = next((t for t in self.HEADER_TABLES if t in tables), None)
            import uuid  # here: read-only commands never make an id (start-up)
            txid = uuid.uuid4().hex[:12]
            rows = self._transaction(run_id, tables, commit_table=header or (list(tables)[-1] if tables else None),
                                     txid=txid)
            if replace:
                self._remove_parts(run_id, list(tables), keep_txid=txid)
        return rows

    def drop_tables(self, run_id: str | None, tables: list[str]) -> dict[str, int]:
        """Remove every file of ``tables`` of ``run_id`` (every run when None) under the
        write lock (see :meth:`moetrace.storage.store.Store.drop_tables`); returns {table:
        files removed}."""
        for t in tables:
            schema.get(t)   # unknown table: SchemaError before anything is touched
        with self.lock():
            self.check_writable()
            self.recover()
            runs = [run_id] if run_id is not None else sorted(
                {p.name[7:] for t in tables for p in (self.path / t).glob("run_id=*")})
            out = {t: 0 for t in tables}
            for rid in runs:
                for t, n in self._remove_parts(rid, tables).items():
                    out[t] += n
        return out

    def _remove_parts(self, run_id: str, tables: list[str], keep_txid: str | None = None) -> dict[str, int]:
        """Unlink ``STORE/<table>/run_id=<run_id>/part-<txid>.parquet`` of each table (files
        of another name are not ours: left alone), except ``keep_txid``'s. Hold the lock."""
        if not _SAFE_ID_RE.fullmatch(run_id):
            raise StoreError(f"{self.path}: {run_id[:80]!r} is not a run id; nothing was removed")
        out: dict[str, int] = {}
        for t in tables:
            part = self.path / t / f"run_id={run_id}"
            n = 0
            if part.is_dir() and not part.is_symlink() and not (self.path / t).is_symlink():
                for f in sorted(part.iterdir()):
                    x = _txid_of(f"{t}/{part.name}/{f.name}")
                    if x is not None and x != keep_txid:
                        self._safe_unlink(f"{t}/{part.name}/{f.name}")
                        n += 1
            out[t] = n
        return out

    def _transaction(self, run_id: str, tables: dict[str, object], commit_table: str | None,
                     txid: str | None = None) -> dict[str, int]:
        import uuid  # here: read-only commands never make an id (start-up)

        import pyarrow as pa
        import pyarrow.parquet as pq
        txid = txid or uuid.uuid4().hex[:12]
        self.check_no_symlinks()
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
                    ours = False      # the run_id column added here: every row is the run's
                    if isinstance(chunk, pa.Table) and "run_id" not in chunk.column_names:
                        chunk = chunk.append_column("run_id", schema.repeated_string(run_id, chunk.num_rows))
                        ours = True
                    elif _is_polars(chunk) and "run_id" not in chunk.columns:
                        import polars as pl

                        chunk = chunk.with_columns(pl.lit(run_id).alias("run_id"))
                    elif isinstance(chunk, dict) and "run_id" not in chunk:
                        n = len(next(iter(chunk.values()))) if chunk else 0
                        chunk = {**chunk, "run_id": [run_id] * n}
                    tbl = schema.conform(table, chunk)
                    if tbl.num_rows and not ours and (tbl.column("run_id").unique().to_pylist() != [run_id]):
                        raise SchemaError(table, f"rows belong to another run than {run_id!r}", "run_id")
                    body = tbl.drop_columns(["run_id"])
                    if writer is None:
                        tmp_file.parent.mkdir(parents=True, exist_ok=True)
                        writer = pq.ParquetWriter(tmp_file, body.schema, compression="zstd", **_encodings(body.schema))
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
            # the commit file is the last one renamed (the commit table's, or the last file
            # written when that table got no rows): once it is in place, all of them are
            commit_file = moves[-1][1] if moves else None
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
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            for d in (self.path / ".staging", self.path / ".txn"):
                with contextlib.suppress(OSError):
                    d.rmdir()
        return rows

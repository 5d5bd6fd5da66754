"""The store's files as a reader may open them: one walk of the folder, links never followed.

Every reader and writer of a store lists its data files here (:func:`walk`), so what is
read is decided in one place:

- only ``<table>/run_id=<id>/<name>.parquet`` of a contract table is listed, and only when
  the table folder and the partition folder are real folders (not symlinks: a symlinked
  table folder would read files outside the store) and the file is a regular file (a FIFO
  would hang the reader that opens it, a device would feed it endless bytes, a symlink
  would read a file outside the store). Every entry is judged by ``lstat`` (the folder
  listing's own type, no link followed); anything else is a :class:`Problem`, never read;
- the walk is bounded: more than ``max_store_partitions`` partition folders or
  ``max_store_files`` entries in them (safety.LIMITS, raised with ``MOETRACE_<NAME>=N``)
  stops it with one line naming the store and the limit, before any file is opened;
- :func:`open_regular` opens a store file with ``O_NOFOLLOW | O_NONBLOCK`` and checks the
  opened file is regular (a file swapped for a FIFO or a link after the listing is refused
  there too); :func:`footer_problem` reads a Parquet file's last 8 bytes through it and
  bounds its footer (``max_footer_bytes``) before any Parquet reader parses it;
- :func:`marker_problem`: ``moetrace-store.json`` must be a small regular file holding the
  store format this moetrace reads.

A file swapped between this walk and the query that reads it is read as it is then: the
window is one query, and the next one's walk sees the swap (docs/hardening.md)."""
from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StoreError
from .paths import _SAFE_ID_RE, STORE_FORMAT, STORE_MARKER

#: bytes of moetrace-store.json read at most (a marker is one short JSON line)
MARKER_MAX = 1 << 16


@dataclass(frozen=True)
class Problem:
    """One thing in a store folder a reader cannot use: the path and what is wrong."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


class LimitReached(StoreError):
    """The walk passed ``max_store_files`` or ``max_store_partitions`` (its :attr:`problem`):
    one line, exit 2, nothing read."""

    def __init__(self, problem: Problem):
        super().__init__(f"{problem}; nothing was read")
        self.problem = problem


@dataclass
class Listing:
    """What :func:`walk` found: ``files[table][run_id]`` = the partition's regular
    ``*.parquet`` file names (sorted); a partition folder without any is listed with none.
    ``problems``: entries that are not read, each with the reason."""

    root: Path
    files: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def runs(self, table: str) -> list[str]:
        """The run ids with at least one file of ``table``, sorted."""
        return sorted(r for r, names in self.files.get(table, {}).items() if names)

    def rel(self, table: str | None = None) -> list[str]:
        """Paths relative to the store (``table/run_id=x/name``) of ``table`` (or all), sorted."""
        tables = [table] if table is not None else sorted(self.files)
        return sorted(f"{t}/run_id={r}/{n}" for t in tables for r, names in self.files.get(t, {}).items()
                      for n in names)

    def paths(self, table: str | None = None, run_id: str | None = None) -> list[Path]:
        """Absolute-as-given paths of the listed files of ``table`` (or all), of ``run_id``
        (or all runs), sorted."""
        out = [self.root / r for r in self.rel(table)]
        if run_id is not None:
            out = [p for p in out if p.parent.name == f"run_id={run_id}"]
        return out


def _limit_problem(root: Path, name: str, what: str) -> Problem:
    from ..safety import LIMITS, limit

    return Problem(str(root), f"holds more than {limit(name)} {what} (limit {name}; a reader lists them all "
                              f"on every query); raise it with {LIMITS[name].env}=N")


def walk(root: str | os.PathLike[str], tables: Iterable[str] | None = None, *, bounded: bool = True) -> Listing:
    """List the data files of ``tables`` (default: every contract table) of the store at
    ``root``. Raises :class:`LimitReached` past a limit (``bounded=False``: no limit, for
    tests that build such a store). Entries starting with ``.`` are skipped; a file that
    does not end in ``.parquet`` is never read (counted against ``max_store_files``)."""
    from ..safety import limit
    from . import schema

    root = Path(root)
    out = Listing(root)
    max_parts = limit("max_store_partitions") if bounded else None
    max_files = limit("max_store_files") if bounded else None
    n_parts = n_files = 0
    for table in (sorted(schema.load_all()) if tables is None else tables):
        d = root / table
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            out.problems.append(Problem(str(d), f"is a symlink where the folder of table {table!r} is expected "
                                                "(a store holds its own files only); not read"))
            continue
        if not stat.S_ISDIR(st.st_mode):
            out.problems.append(Problem(str(d), f"is a file where the folder of table {table!r} is expected"))
            continue
        parts: dict[str, list[str]] = {}
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            out.problems.append(Problem(str(d), f"cannot be listed ({e.strerror})"))
            continue
        for part in entries:
            if part.name.startswith("."):
                continue
            n_parts += 1
            if max_parts is not None and n_parts > max_parts:
                raise LimitReached(_limit_problem(root, "max_store_partitions", "partition folders"))
            if part.is_symlink() or not part.is_dir(follow_symlinks=False):
                kind = "a symlink" if part.is_symlink() else "a file"
                out.problems.append(Problem(part.path, f"is {kind} where a partition folder run_id=<id> of table "
                                                       f"{table!r} is expected; not read"))
                continue
            if not part.name.startswith("run_id=") or not _SAFE_ID_RE.fullmatch(part.name[7:]):
                out.problems.append(Problem(part.path, "partition folder name is not run_id=<id> (letters, digits, "
                                                       ". _ -); not read"))
                continue
            names: list[str] = []
            try:
                with os.scandir(part.path) as fs:
                    for f in fs:
                        n_files += 1
                        if max_files is not None and n_files > max_files:
                            raise LimitReached(_limit_problem(root, "max_store_files", "entries in partition "
                                                                                        "folders"))
                        if not f.name.endswith(".parquet") or f.name.startswith("."):
                            continue
                        if f.is_file(follow_symlinks=False):
                            names.append(f.name)
                        else:
                            out.problems.append(Problem(f.path, _not_regular(f)))
            except OSError as e:
                out.problems.append(Problem(part.path, f"cannot be listed ({e.strerror})"))
                continue
            parts[part.name[7:]] = sorted(names)
        if parts:
            out.files[table] = parts
    out.problems.sort(key=lambda p: p.file)
    return out


def has_files(store: str | os.PathLike[str], table: str) -> bool:
    """Whether ``table`` holds any file in the store at ``store`` (:func:`walk`)."""
    return bool(walk(store, [table]).runs(table))


def run_ids(store: str | os.PathLike[str]) -> list[str]:
    """The ids of the runs of the store at ``store`` (a ``runs`` partition holding a file:
    its ``runs`` row is renamed into place last), sorted (:func:`walk`)."""
    return walk(store, ["runs"]).runs("runs")


def _not_regular(entry: os.DirEntry[str]) -> str:
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    kind = ("a symlink" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if
            stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a folder" if stat.S_ISDIR(mode) else "not a regular file")
    return f"is {kind} where a Parquet file is expected (a store holds its own regular files only); not read"


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` opened without following a link and without
    blocking on a FIFO; OSError (``EINVAL`` for anything but a regular file) otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(22, "not a regular file")
    return fd


def footer_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the Parquet file ``path`` must not be parsed, from its size and its last 8
    bytes (footer length, magic), else None: not a regular file, too short, no Parquet
    magic, or a footer over ``max_footer_bytes`` (a footer of 300 MB of key-value
    metadata costs gigabytes to parse)."""
    from ..safety import LIMITS, limit

    try:
        fd = open_regular(path)
    except OSError as e:
        return ("is a symlink; a store holds its own files only" if e.errno == 40 else
                f"cannot be opened as a regular file ({e.strerror})")
    try:
        size = os.fstat(fd).st_size
        if size < 12:
            return f"is {size} bytes, too short for a Parquet file (truncated)"
        tail = os.pread(fd, 8, size - 8)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    if tail[4:] != b"PAR1":
        return "not a Parquet file (no PAR1 magic at its end: truncated or corrupt)"
    n = int.from_bytes(tail[:4], "little")
    if n > size - 12:
        return f"its footer length ({n} bytes) exceeds the file ({size} bytes): truncated or corrupt"
    cap = limit("max_footer_bytes")
    if n > cap:
        return (f"its Parquet footer is {n} bytes, over the limit max_footer_bytes={cap}; raise it with "
                f"{LIMITS['max_footer_bytes'].env}=N")
    return None


def marker_problem(root: str | os.PathLike[str]) -> str | None:
    """Why ``root``/moetrace-store.json (the text follows its path) is not a marker this moetrace reads, else None:
    missing, not a regular file (a FIFO, a symlink), over :data:`MARKER_MAX` bytes, not
    JSON with an integer ``moetrace_store_format``, or a newer format."""
    import json

    from ..version import __version__

    marker = Path(root) / STORE_MARKER
    try:
        fd = open_regular(marker)
    except FileNotFoundError:
        return "missing: not a moetrace store"
    except OSError:
        return "is not a regular file (a symlink, FIFO or device): not a moetrace store marker"
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MARKER_MAX + 1)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if len(raw) > MARKER_MAX:
        return f"is over {MARKER_MAX} bytes: not a moetrace store marker"
    try:
        doc = json.loads(raw)
        fmt = doc["moetrace_store_format"]
        ok = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= 1
    except (ValueError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok:
        return "not a moetrace store marker (expected JSON with an integer moetrace_store_format)"
    if fmt > STORE_FORMAT:
        by = str(doc.get("created_by", "a newer moetrace"))[:40] if isinstance(doc, dict) else "?"
        return (f"store format {fmt} (written by moetrace {by!r}); this moetrace ({__version__}) reads format "
                f"{STORE_FORMAT} or older: upgrade moetrace to read it")
    return None

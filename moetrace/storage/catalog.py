"""``STORE/catalog.duckdb``: the store's views in a DuckDB database file, with paths
relative to the store, for the ``duckdb`` CLI and other DuckDB clients.

DuckDB resolves relative paths against ``file_search_path`` (or the working directory),
so open it with ``cd STORE && duckdb catalog.duckdb`` or
``duckdb -cmd "SET file_search_path='STORE'" STORE/catalog.duckdb``."""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..safety import sql_literal
from .paths import GLOB_CHARS, STORE_MARKER

if TYPE_CHECKING:
    from .views import TableViews
    from .writer import Writer


def write_catalog(path: Path, writer: Writer, views: TableViews, threads: int | None = None) -> Path:
    """Write ``path``/catalog.duckdb: the views of :class:`~.views.TableViews`, over globs
    relative to the store. A write like the others: under the write lock, to a temporary
    file renamed into place (a crash leaves the old catalog and a temporary file that
    recovery removes). ``threads``: DuckDB's threads while it is written (None: its default)."""
    if (path / STORE_MARKER).exists() and os.access(path, os.W_OK):
        with writer.lock():
            return _write(path, views, threads)
    return _write(path, views, threads)


def _write(path: Path, views: TableViews, threads: int | None) -> Path:
    import duckdb

    from .duck import connect

    target = path / "catalog.duckdb"
    import uuid  # here: read-only commands never make an id (start-up)
    tmp = path / f".catalog-{uuid.uuid4().hex[:8]}.duckdb"
    try:
        if not (path / STORE_MARKER).exists():
            raise StoreError(f"{path}: the store holds nothing yet; catalog not written")
        if target.is_symlink():
            raise StoreError(f"{target}: is a symlink; refused; catalog not written")
        con = connect(threads, package=True)
        try:  # readable by older duckdb CLIs too
            con.execute(f"ATTACH {sql_literal(tmp)} AS cat (STORAGE_VERSION 'v1.0.0')")
        except duckdb.Error as e:
            if "storage" not in str(e).lower() and "version" not in str(e).lower():
                raise
            con.execute(f"ATTACH {sql_literal(tmp)} AS cat")
        con.execute("USE cat")
        con.execute(f"SET file_search_path={sql_literal(_search_path(path))}")
        views.define(con, relative=True)
        con.execute("USE memory")
        con.execute("DETACH cat")
        con.close()
        os.replace(tmp, target)
    except (OSError, duckdb.Error) as e:
        if isinstance(e, StoreError):
            raise
        if not os.access(path, os.W_OK) or getattr(e, "errno", None) in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise StoreError(f"{path}: store is read-only; catalog not written") from None
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:200]
        raise StoreError(f"{path}: cannot write catalog.duckdb ({why}); catalog not written") from None
    finally:
        for f in (tmp, Path(str(tmp) + ".wal")):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    return target


def _search_path(path: Path) -> Path:
    """The store's folder as DuckDB's ``file_search_path`` while the catalog's views are
    bound: its absolute path, not the resolved one (a symlink is how a store under a
    folder with pattern characters is opened). The setting is a comma-separated list of
    folders whose entries are globbed: a ``,`` or a pattern character would bind the
    views to another folder's files, so such a path is refused."""
    where = path.absolute()
    bad = "".join(c for c in GLOB_CHARS + "," if c in str(where))
    if bad:
        raise StoreError(f"{where}: the store's full path holds {bad!r}, which DuckDB's file_search_path reads as "
                         f"a list or a pattern; catalog not written (open the store through a path without them)")
    return where


def warn_refresh_failed(path: Path, error: Exception) -> str:
    """The warning printed (and returned) when rewriting the catalog after a commit
    failed: never an error for a write that landed."""
    msg = f"catalog.duckdb not refreshed ({error}); the data was written; rerun `moetrace catalog {path}`"
    print(f"moetrace: warning: {msg}", file=sys.stderr)
    return msg

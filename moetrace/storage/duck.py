"""DuckDB for the store's plain statements, without the start-up of the ``duckdb`` package.

The ``duckdb`` package (2.x) is a Python layer (relations, expressions, Arrow sources,
its version from the installed distribution's metadata) over the C extension ``_duckdb``,
which it re-exports unchanged: ``duckdb.connect is _duckdb.connect`` and
``duckdb.Error is _duckdb.Error``. Importing the package costs about 0.1 s here; the
extension about 0.02 s. ``moetrace runs`` and ``moetrace skew`` on a small store only
connect, ``execute`` and ``fetchall`` (their start-up is kept under 0.3 s), so they take
:data:`duckdb` from here: the extension when it can be imported on its own, else the
package.

A connection made through the extension is the package's connection class: importing the
package (:func:`full`) adds the Python-level methods (``sql``, ``arrow``, ``pl``...) to
that class and installs its Arrow scans, for connections made before as after. Callers
that need more than ``execute``/``fetchall``/``description`` call :func:`full` first
(``Store.sql``, ``Store.connect``, the lazy views' ``sql`` and any other attribute), and
so does :func:`needs_full` when polars, pyarrow or pandas is loaded in the process (a
statement may then scan a Python data frame by name). ``tests/test_startup.py`` checks the
identities above, so a DuckDB release that changes them fails the suite, not a user.
"""
from __future__ import annotations

import os
import sys
from typing import Any

try:
    import _duckdb as duckdb  # the C extension the duckdb package re-exports
    if not (hasattr(duckdb, "connect") and hasattr(duckdb, "Error")):   # another layout
        raise ImportError
except ImportError:   # pragma: no cover - an older or differently built duckdb: the package
    import duckdb  # type: ignore[no-redef]

Error = duckdb.Error

#: modules that, loaded, mean a statement may read a Python object by name (Arrow scans)
_FRAME_MODULES = ("pyarrow", "polars", "pandas")


def full():
    """The ``duckdb`` package, imported (installs the connection class's Python methods
    and the Arrow scans)."""
    import duckdb as package

    return package


def needs_full() -> None:
    """Import the package when a data-frame library is loaded (see the module docstring)."""
    if "duckdb" not in sys.modules and any(m in sys.modules for m in _FRAME_MODULES):
        full()


#: the environment variable that sets the number of threads of a store's DuckDB connections
#: when the store is opened without ``threads`` (unset: DuckDB's default, one per core)
THREADS_ENV = "MOETRACE_DUCKDB_THREADS"


def threads_setting(threads: int | None = None) -> int | None:
    """``threads``, else :data:`THREADS_ENV` read now, else None (DuckDB's default); a
    value that is not a whole number of at least 1 is one line naming it."""
    from ..errors import UsageError

    if threads is None:
        raw = os.environ.get(THREADS_ENV, "").strip()
        if not raw:
            return None
        try:
            threads = int(raw)
        except ValueError:
            raise UsageError(f"{THREADS_ENV}={raw[:40]!r}: not a whole number of threads") from None
        where = THREADS_ENV
    else:
        where = "threads"
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UsageError(f"{where}={threads!r}: the DuckDB thread count must be a whole number of at least 1")
    return threads


def connect(threads: int | None = None, package: bool = False) -> Any:
    """A new in-memory DuckDB connection running ``threads`` threads (None: DuckDB's
    default). ``package``: the duckdb package imported first (:func:`full`)."""
    mod = full() if package else duckdb
    if threads is None:
        return mod.connect(":memory:")
    return mod.connect(":memory:", config={"threads": threads})

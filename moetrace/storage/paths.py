"""A store's names on disk: the marker file, run ids (sanitized, at most ``RUN_ID_MAX``
characters), transaction ids, and the store-path check that refuses paths DuckDB or Arrow
would not take literally."""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import StoreError

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


def table_glob(store: Path, table: str, relative: bool = False) -> str:
    """The file pattern of every file of ``table`` (relative to the store: the catalog's)."""
    base = Path(table) if relative else store / table
    return str(base / "*" / "*.parquet")


def sanitize_run_id(text: str) -> str:
    rid = _RUN_ID_RE.sub("_", text).strip("._-")
    return rid[:RUN_ID_MAX].rstrip("._-") or "run"


def refuse_inside_store(out: str | Path | None, option: str = "-o") -> None:
    """An output file (or report folder) given with ``-o`` may not lie inside a moetrace
    store (a folder holding :data:`STORE_MARKER`, or one below it): writing there would
    overwrite or add files no transaction knows of. Raises UsageError (one line, exit 2)
    before anything is written. Symlinks are resolved, so a link into a store counts."""
    from ..errors import UsageError

    if out is None or str(out) == "-":
        return
    p = Path(out).expanduser().absolute()
    with_links = p.resolve() if p.exists() or p.parent.exists() else p
    for cand in {p, with_links}:
        for d in (cand, *cand.parents):
            if (d / STORE_MARKER).is_file():
                raise UsageError(f"{option} {out}: is inside the store {d}; moetrace never writes files into a "
                                 f"store except through its transactions: write it elsewhere")

"""After a refused ingest: whether a failed write left the store as it was, and removing a
store the ingest created and never wrote a run into."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .paths import STORE_MARKER


def failed_write_leaves_no_trace(path: str | os.PathLike[str]) -> bool:
    """True when a write into the store at ``path`` that fails and is rolled back leaves
    every file and folder of the store as it was: the store exists, was written before (its
    lock file is there) and holds no leftovers of another write (opening it for writing
    would clear those; the rollback removes its own staging folders)."""
    p = Path(path)
    return ((p / STORE_MARKER).is_file() and (p / ".lock").is_file() and not p.is_symlink()
            and not (p / ".staging").exists() and not (p / ".txn").exists())


def remove_empty_store(path: str | os.PathLike[str], top: str | os.PathLike[str]) -> None:
    """Remove the store at ``path`` when it holds no run (its marker and lock file only, a
    write having been rolled back), and the empty folders above it up to ``top``: an
    ingest refused while writing into a store it created leaves nothing behind."""
    p, stop = Path(path).absolute(), Path(top).absolute()
    if not p.is_dir() or p.is_symlink():
        return
    left = {c.name for c in p.iterdir()}
    if not left <= {STORE_MARKER, ".lock"}:
        return
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            (p / name).unlink()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == stop or stop not in p.parents:
            return
        p = p.parent

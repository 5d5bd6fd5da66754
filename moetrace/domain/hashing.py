"""sha256 of files and texts: a run's identity (``runs.source_sha256``), which collectors
compute without the store."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """sha256 over the bytes of the given files, in the order given (names excluded)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()

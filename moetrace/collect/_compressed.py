"""Gzip-compressed routing files (``routing.jsonl.gz``, ``.ndjson.gz``) read as their plain
form: detection reads the inflated head, readers the inflated bytes or a streamed text,
always within the inflation limits (``safety.max_inflated``: ``--set
max_inflate_ratio=N`` / ``max_inflated_bytes=N`` raise them)."""
from __future__ import annotations

import gzip
import io
import os
import zlib
from pathlib import Path

from ..errors import InputError
from ..safety import bounded_gunzip, check_inflated_size

GZ_MAGIC = b"\x1f\x8b"


def plain_name(path: Path) -> str:
    """The file's lower-case name without a trailing ``.gz``: what its content is
    (``routing.jsonl.gz`` -> ``routing.jsonl``)."""
    name = path.name.lower()
    return name[:-3] if name.endswith(".gz") else name


def is_gzip(path: Path, head: bytes | None = None) -> bool:
    """Named ``*.gz`` and starting with the gzip magic bytes."""
    if not path.name.lower().endswith(".gz"):
        return False
    if head is None:
        with open(path, "rb") as f:
            head = f.read(2)
    return head[:2] == GZ_MAGIC


def plain_head(path: Path, head: bytes, n: int = 65536) -> bytes:
    """The first ``n`` inflated bytes of a gzip file (``head``: its raw first bytes, read
    further when they inflate to less); any other file's ``head`` as is. A corrupt stream
    gives what inflated before the damage (detection never fails on it; reading does)."""
    if not is_gzip(path, head):
        return head
    with open(path, "rb") as f:
        raw = f.read(1 << 16)
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        return d.decompress(raw, n)
    except zlib.error:
        return b""


def read_plain(path: Path) -> bytes:
    """The whole (inflated) content."""
    if is_gzip(path):
        return bounded_gunzip(path) or b""
    with open(path, "rb") as f:
        return f.read()


class _BoundedGzip(io.RawIOBase):
    """A gzip stream read in pieces, refused past the inflation limit and on corruption
    (one InputError naming the file)."""

    def __init__(self, path: Path):
        self.path, self.total = path, 0
        self.size = os.stat(path).st_size
        self.f = gzip.open(path, "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:
            n = self.f.readinto(b)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(self.path, f"corrupt or truncated gzip: {e}") from None
        self.total += n
        check_inflated_size(self.path, self.total, self.size)
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def open_binary(path: Path):
    """A binary stream of the file, inflated as it is read when it is gzip (``readline``
    with a size bound works on both)."""
    if is_gzip(path):
        return io.BufferedReader(_BoundedGzip(path))
    return open(path, "rb")


def open_text(path: Path):
    """A UTF-8 text stream of the file, inflated as it is read when it is gzip."""
    if is_gzip(path):
        return io.TextIOWrapper(io.BufferedReader(_BoundedGzip(path)), encoding="utf-8", errors="strict")
    return open(path, encoding="utf-8", errors="strict")

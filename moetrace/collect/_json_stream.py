"""A bounded-memory reader of one big numeric array inside a JSON object.

Engine dumps such as SGLang's ``{"logical_count": [N][L][E]}`` can be gigabytes of digits.
:func:`array_batches` walks the top-level object with a small incremental scanner (other
keys' values are read whole, up to :data:`MAX_OTHER` bytes each, and checked as JSON), and
hands out the wanted array as numpy batches of its outermost elements, a few MiB of text
at a time: memory is bounded by :data:`BLOCK` and the size of one element, never by the
file. Each batch is cut at an element boundary (bracket depth, counted with numpy) and
decoded by msgspec, which checks the JSON grammar of the batch; the batches together
must form a rectangular array (checked by the caller from the shapes).

Errors are :class:`~moetrace.errors.InputError` naming the file, with a line and column.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import InputError

#: bytes of the array decoded at once (the batch's Python lists are about 10x its text)
BLOCK = 4 << 20
#: largest value of another key (read whole)
MAX_OTHER = 64 << 20
#: deepest nesting accepted before the array's numbers start
MAX_DEPTH = 64

_WS = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"(?:[^"\\\x00-\x1f]|\\.)*"', re.S)
_SCALAR = re.compile(rb"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_STRUCT = re.compile(rb'["\[\]{}]')


class _Reader:
    """A byte buffer over a file handle, refilled on demand; ``off`` is the file offset
    of ``buf[0]``."""

    def __init__(self, path: Path, fh):
        self.path, self.fh = path, fh
        self.buf, self.pos, self.off, self.eof = b"", 0, 0, False

    def more(self, n: int | None = None) -> bool:
        """Read up to n (:data:`BLOCK`) more bytes (dropping what was consumed); False at
        end of file."""
        if self.eof:
            return False
        chunk = self.fh.read(n or BLOCK)
        if not chunk:
            self.eof = True
            return False
        self.off += self.pos
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0
        return True

    def ws(self) -> None:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.more():
                return

    def peek(self) -> int | None:
        self.ws()
        return self.buf[self.pos] if self.pos < len(self.buf) else None

    def fail(self, message: str, at: int | None = None):
        """Raise at file offset ``at`` (default: the current position)."""
        raise InputError(self.path, message, _position(self.path, self.off + self.pos if at is None else at))

    def eof_error(self):
        self.fail("invalid JSON: unexpected end of file", self.off + len(self.buf))

    def expect(self, ch: bytes, what: str) -> None:
        c = self.peek()
        if c is None:
            self.eof_error()
        if c != ch[0]:
            self.fail(f"invalid JSON: expected {what}")
        self.pos += 1

    def _grow_until(self, rx, limit: int):
        """Match ``rx`` at pos, reading more while the match could grow; None if none."""
        while True:
            m = rx.match(self.buf, self.pos)
            if m is not None and m.end() < len(self.buf):
                return m
            if len(self.buf) - self.pos > limit:
                self.fail(f"invalid JSON: a value longer than {limit >> 20} MiB outside the counts")
            if not self.more():
                return rx.match(self.buf, self.pos)

    def string(self) -> str:
        import msgspec

        c = self.peek()
        if c is None:
            self.eof_error()
        if c != ord('"'):
            self.fail("invalid JSON: expected a string key")
        m = self._grow_until(_STRING, MAX_OTHER)
        if m is None:
            self.fail("invalid JSON: unterminated or invalid string")
        try:
            s = msgspec.json.decode(m.group())
        except msgspec.DecodeError as e:
            self.fail(f"invalid JSON: {e}")
        self.pos = m.end()
        return s

    def skip_value(self) -> None:
        """Read another key's value whole (at most :data:`MAX_OTHER` bytes) and check
        that it is JSON."""
        import msgspec

        c = self.peek()
        if c is None:
            self.eof_error()
        if c == ord('"'):
            self.string()
            return
        start = self.off + self.pos
        if c not in b"[{":
            m = self._grow_until(_SCALAR, 1 << 10)
            if m is None:
                self.fail("invalid JSON: expected a value")
            self.pos = m.end()
            return
        parts, size, depth, i = [], 0, 0, self.pos
        while True:
            m = _STRUCT.search(self.buf, i)
            if m is None:
                parts.append(self.buf[self.pos:])
                size += len(self.buf) - self.pos
                self.pos = len(self.buf)
                if size > MAX_OTHER:
                    self.fail(f"invalid JSON: a value longer than {MAX_OTHER >> 20} MiB outside the counts", start)
                if not self.more():
                    self.eof_error()
                i = self.pos
                continue
            if m.group() == b'"':
                parts.append(self.buf[self.pos:m.start()])
                size += m.start() - self.pos
                self.pos = m.start()
                s = self._grow_until(_STRING, MAX_OTHER)
                if s is None:
                    self.fail("invalid JSON: unterminated or invalid string")
                parts.append(s.group())
                size += len(s.group())
                self.pos = i = s.end()
                continue
            depth += 1 if m.group() in b"[{" else -1
            i = m.end()
            if depth > 16 * MAX_DEPTH:
                self.fail("JSON nested too deeply to parse (a crafted or corrupt file)", start)
            if depth == 0:
                parts.append(self.buf[self.pos:i])
                self.pos = i
                try:
                    msgspec.json.decode(b"".join(parts))
                except (msgspec.DecodeError, RecursionError) as e:
                    self.fail(f"invalid JSON: {e}", start)
                return


def _position(path: Path, offset: int) -> str:
    """'line L column C' of a byte offset (the file is read again up to it, on errors only)."""
    line, last_nl, done = 1, -1, 0
    with open(path, "rb") as fh:
        while done < offset:
            chunk = fh.read(min(BLOCK, offset - done))
            if not chunk:
                break
            n = chunk.count(b"\n")
            if n:
                line += n
                last_nl = done + chunk.rfind(b"\n")
            done += len(chunk)
    return f"line {line} column {offset - last_nl}"


def _element_type(ndim: int):
    t = int | float
    for _ in range(ndim):
        t = list[t]
    return t


def array_batches(path: str | Path, key: str, what: str, ndims: tuple[int, ...] = (2, 3)
                  ) -> Iterator[tuple[int, np.ndarray]]:
    """``(ndim, batch)`` for the value of top-level ``key`` of the JSON object in ``path``:
    ``batch`` holds consecutive outermost elements of the array, shape ``[n, ...]`` with
    ``ndim`` dimensions (one of ``ndims``), every batch's elements of the first one's
    shape (else an error). ``what`` names the expected shape in errors. The whole object
    is checked (other keys, trailing data) by the time the iteration ends."""
    path = Path(path)
    rect = f"{key} must be a rectangular {what} array of integers"
    with open(path, "rb") as fh:
        r = _Reader(path, fh)
        if r.peek() != ord("{"):
            r.fail(f"expected a JSON object with '{key}'")
        r.pos += 1
        found = False
        if r.peek() == ord("}"):
            r.pos += 1
        else:
            while True:
                k = r.string()
                r.expect(b":", "':'")
                if k != key:
                    r.skip_value()
                elif found:
                    r.fail(f"'{key}' appears twice in the object")
                else:
                    found = True
                    yield from _array(r, rect, ndims)
                if r.peek() == ord(","):
                    r.pos += 1
                    continue
                r.expect(b"}", "',' or '}'")
                break
        if r.peek() is not None:
            r.fail("invalid JSON: extra data after the object")
        if not found:
            r.fail(f"expected a JSON object with '{key}'", 0)


_BYTE = re.compile(r"\(byte (\d+)\)")


def _array(r: _Reader, rect: str, ndims: tuple[int, ...]) -> Iterator[tuple[int, np.ndarray]]:
    import msgspec

    if r.peek() != ord("["):
        r.fail(rect)
    ndim, j = 0, 0                 # nesting depth: the run of '[' the value starts with
    while True:
        if r.pos + j >= len(r.buf):
            if not r.more():
                r.eof_error()
            continue
        c = r.buf[r.pos + j]
        if c == ord("["):
            ndim += 1
            if ndim > MAX_DEPTH:
                r.fail("JSON nested too deeply to parse (a crafted or corrupt file)")
        elif c not in b" \t\n\r":
            break
        j += 1
    if ndim not in ndims:
        r.fail(rect)
    etype = list[_element_type(ndim - 1)]
    r.pos += 1                                  # the outer '['
    shape = None
    while True:
        if len(r.buf) - r.pos < BLOCK:
            r.more(BLOCK)
        seg = np.frombuffer(r.buf, np.uint8, offset=r.pos)
        # the depth at every bracket (brackets are a few per thousand bytes of digits)
        br = np.flatnonzero((seg == ord("[")) | (seg == ord("]")))
        close = seg[br] == ord("]")
        depth = np.cumsum(np.where(close, -1, 1))
        end = np.flatnonzero(depth < 0)
        stop = int(br[end[0]]) if end.size else len(seg)   # the outer ']' (or the buffer's end)
        bad = np.flatnonzero((seg[:stop] == ord('"')) | (seg[:stop] == ord("{")))
        if bad.size:
            r.fail(rect, r.off + r.pos + int(bad[0]))
        # element ends: a ']' that brings the depth back to 0 (inside the outer array)
        ends = br[close & (depth == 0) & (br < stop)]
        if not ends.size:
            if stop < len(seg):                         # "[[1], 2]": no element closes before the end
                r.fail(rect)
            if len(seg) > 16 * BLOCK:
                r.fail(f"{rect} (one element is longer than {16 * BLOCK >> 20} MiB)")
            if not r.more(BLOCK):
                r.eof_error()
            continue
        # the elements that end within BLOCK bytes (at least one): a bounded batch
        within = ends[ends < BLOCK]
        cut = int(within[-1] if within.size else ends[0]) + 1
        last = cut == int(ends[-1]) + 1
        body = seg[:cut].tobytes()
        try:
            vals = msgspec.json.decode(b"[" + body + b"]", type=etype)
        except msgspec.ValidationError:
            r.fail(rect)
        except msgspec.DecodeError as e:
            m = _BYTE.search(str(e))
            at = r.off + r.pos + max(0, int(m.group(1)) - 1) if m else None
            r.fail("invalid JSON: " + _BYTE.sub("", str(e)).strip().removeprefix("JSON is malformed: "), at)
        except RecursionError:
            r.fail("JSON nested too deeply to parse (a crafted or corrupt file)")
        try:
            arr = np.asarray(vals)
        except (ValueError, OverflowError):
            r.fail(rect)
        del vals
        if arr.dtype == object or arr.ndim != ndim or (shape is not None and arr.shape[1:] != shape):
            r.fail(rect)
        shape = arr.shape[1:]
        yield ndim, arr
        if stop < len(seg) and last:                   # the outer array ends in this buffer
            rest = seg[cut:stop].tobytes().strip(b" \t\n\r")
            if rest:
                r.fail("invalid JSON: trailing comma" if rest == b"," else rect, r.off + r.pos + cut)
            r.pos += stop + 1
            return
        r.pos += cut                                    # the next batch starts after a comma
        if r.peek() != ord(","):
            r.fail(rect)
        r.pos += 1
        if r.peek() == ord("]"):
            r.fail("invalid JSON: trailing comma")


# ----------------------------------------------------------------------------- JSON lines
def jsonl_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a JSONL file (inflated as it is read when it is gzip), each
    line read with the ``max_record_bytes`` bound (a sparse 20 GB file of zeros is one
    "line": it is refused after reading that many bytes, not read whole); blank lines skipped."""
    from ..safety import limit, limit_error
    from ._compressed import open_binary

    cap = limit("max_record_bytes")
    path = Path(path)
    try:
        fh = open_binary(path)
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    with fh:
        i = 0
        while True:
            line = fh.readline(cap + 1)
            if not line:
                return
            i += 1
            if len(line) > cap and not line.endswith(b"\n"):
                raise limit_error(path, "max_record_bytes", f"a line longer than {cap} bytes", f"line {i}")
            if line.strip():
                yield i, line


def jsonl_objects(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of a JSONL file: lines bounded as :func:`jsonl_lines` says,
    each a JSON object of at most ``max_columns`` keys, all lines' keys together too (rows
    of distinct keys would become that many columns); UTF-8 required."""
    from ..safety import check_columns, json_loads

    path = Path(path)
    seen: set[str] = set()
    last = None
    for i, raw in jsonl_lines(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(path, f"not UTF-8 text ({e.reason})", f"line {i}") from None
        obj = json_loads(path, text, f"line {i}")
        if not isinstance(obj, dict):
            raise InputError(path, f"expected a JSON object per line, got {type(obj).__name__}", f"line {i}")
        check_columns(path, len(obj), "keys in one object", f"line {i}")
        keys = obj.keys()
        if last is None or keys != last:
            seen.update(keys)
            check_columns(path, len(seen), "distinct keys over the lines", f"line {i}")
            last = keys
        yield i, obj

"""Hostile-input helpers: the one place for SQL/URI quoting, input-file checks and
resource limits.

- :func:`sql_literal` / :func:`sql_identifier`: the only way user-supplied text (a store
  path, a memory size, a table name found in a file) reaches SQL.
- :func:`sqlite_ro_uri`: a percent-encoded ``file:`` URI opening a SQLite file read-only
  and immutable (no ``-wal``/``-shm`` next to the input, ``#``/``?``/``%`` in names safe).
- :func:`check_regular_file`: inputs must be regular files (a FIFO, ``/dev/zero`` or a
  socket is refused before anything reads it).
- Limits (:data:`LIMITS`): defaults a user raises with an environment variable
  ``MOETRACE_<NAME>`` or ``--set <name>=VALUE`` on ``ingest``. Hitting one is an
  :class:`~moetrace.errors.InputError` naming the file, the limit and how to raise it.
- :func:`bounded_gunzip` / :func:`check_inflated_size`: inflation capped by
  ``max_inflate_ratio`` x the compressed size and by ``max_inflated_bytes``.
- :func:`check_array_elements`: an array's declared size checked before allocation.
- :func:`json_loads`: a JSON document nested too deeply is one line, not a traceback.
- :func:`excerpt`: at most a short, printable excerpt of file text for an error message.
"""
from __future__ import annotations

import os
import re
import stat
import urllib.parse
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import InputError, UsageError


# ----------------------------------------------------------------------------- SQL and URIs
def sql_literal(text: str | os.PathLike) -> str:
    """``text`` as a SQL string literal: single-quoted, quotes doubled, NUL refused."""
    s = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
    if "\x00" in s:
        raise UsageError(f"{s!r}: NUL character in a value used in SQL")
    return "'" + s.replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """``name`` as a double-quoted SQL identifier (quotes doubled, NUL refused)."""
    if "\x00" in name:
        raise UsageError(f"{name!r}: NUL character in an identifier")
    return '"' + name.replace('"', '""') + '"'


def sqlite_ro_uri(path: str | os.PathLike) -> str:
    """``file:`` URI for sqlite3.connect(uri=True): absolute, percent-encoded (``#``, ``?``,
    ``%`` in names are data), ``mode=ro&immutable=1`` so SQLite never writes a journal,
    ``-wal`` or ``-shm`` file next to the input and never takes locks on it."""
    p = os.path.abspath(os.fspath(path))
    return "file:" + urllib.parse.quote(p, safe="/") + "?mode=ro&immutable=1"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB|K|M|G|T|%)?\s*$", re.IGNORECASE)


def arrow_path(path: str | os.PathLike) -> str:
    """A local file's path as Arrow must be given it to open that file: absolute. Arrow
    expands a leading ``~`` (a quoted ``'~/x.parquet'`` reads ``$HOME/x.parquet``) and reads
    a relative ``file:/x`` as the URI of ``/x``; an absolute path is taken literally."""
    return os.path.abspath(os.fspath(path))


_UNIT_BYTES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
#: largest memory size accepted (DuckDB takes the size as a 64-bit count of bytes)
MAX_MEMORY_BYTES = 1 << 50


def memory_limit(value: str | None, what: str = "--memory-limit") -> str | None:
    """Validate a DuckDB memory size ('8GB', '512MiB', '50%'); returns it normalised."""
    if value is None:
        return None
    m = _SIZE_RE.match(str(value)[:64])
    if not m or len(str(value)) > 64 or float(m.group(1)) <= 0:
        raise UsageError(f"{what} {excerpt(str(value), 40)!r} is not a size (examples: 8GB, 512MiB, 50%)")
    unit = (m.group(2) or "B").upper()
    unit = {"K": "KB", "M": "MB", "G": "GB", "T": "TB", "KIB": "KiB", "MIB": "MiB", "GIB": "GiB",
            "TIB": "TiB"}.get(unit, unit)
    if unit == "%" and float(m.group(1)) > 100 or unit != "%" and float(m.group(1)) * _UNIT_BYTES[unit] > MAX_MEMORY_BYTES:
        raise UsageError(f"{what} {excerpt(str(value), 40)!r} is larger than any memory (at most 1PiB or 100%)")
    return f"{m.group(1)}{unit}"


def size_bytes(value: str) -> int:
    """Bytes of a size :func:`memory_limit` accepts (a percentage of the physical memory)."""
    norm = memory_limit(value)
    assert norm is not None
    m = _SIZE_RE.match(norm)
    assert m is not None
    unit = m.group(2) or "B"
    if unit == "%":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 << 30
        return int(total * float(m.group(1)) / 100)
    return int(float(m.group(1)) * _UNIT_BYTES[unit])


def _vm_data() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@contextmanager
def heap_cap(extra: int):
    """Let this process's heap (Linux ``RLIMIT_DATA``) grow by at most ``extra`` bytes while
    the block runs. DuckDB's ``memory_limit`` governs its buffer manager only: a string
    built by ``repeat('x', 2000000000)`` is allocated outside it, so ``moetrace sql`` also
    caps the heap; past the cap an allocation fails and DuckDB reports "Out of Memory".
    The soft limit only is lowered (never raised) and restored afterwards."""
    try:
        import resource
    except ImportError:   # not POSIX: DuckDB's own limit only
        yield
        return
    now = _vm_data()
    if now is None or not hasattr(resource, "RLIMIT_DATA"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = now + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, soft)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


# ----------------------------------------------------------------------------- limits
def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


@dataclass(frozen=True)
class Limit:
    name: str
    description: str
    default: object  # int, or a callable computing the default

    @property
    def env(self) -> str:
        return "MOETRACE_" + self.name.upper()


LIMITS = {lim.name: lim for lim in (
    Limit("max_inflate_ratio", "inflated size of a .gz / .zip / .pt / .npz member, as a multiple of its "
                               "compressed size", 200),
    Limit("max_inflated_bytes", "inflated size of one compressed input or member, in bytes (default: the "
                                "memory available when moetrace starts)", lambda: max(64 << 20, _mem_available())),
    Limit("max_array_elements", "elements of one array in a .npy / .npz / .pt dump, checked before it is "
                                "allocated (default: available memory / 8)", lambda: max(1 << 20, _mem_available() // 8)),
    Limit("max_line_bytes", "bytes of one server-log line that is parsed (longer lines are counted, not parsed)",
          64 << 10),
    Limit("max_name_bytes", "bytes of one event / kernel / range name in a profiler trace", 64 << 10),
    Limit("max_yaml_nodes", "nodes of a YAML document counted with every alias expanded (a billion-laughs "
                            "file of a few hundred bytes expands to billions)", 1 << 20),
    Limit("max_replay_bytes", "memory a replay, plan or sweep may allocate for its per-step arrays, "
                              "estimated from the run's shape before it starts (default: available memory / 2)",
          lambda: max(256 << 20, _mem_available() // 2)),
    Limit("max_sweep_cells", "cells of one sweep (replica budgets x re-plan intervals x windows)", 10_000),
    Limit("max_pickle_bytes", "bytes of one pickled dump (Flight Recorder) read by the plain-values unpickler "
                              "(safety_pickle.py)", 1 << 30),
    Limit("max_pickle_objects", "objects the value of one pickled dump reaches, shared references counted "
                                "each time", 10_000_000),
    Limit("max_container_items", "items of one dict or set in a pickled dump or a .pt file (a large one is "
                                 "refused before it is built: hash-colliding keys make building it quadratic)",
          1_000_000),
    Limit("max_record_bytes", "bytes of one JSONL line or CSV header line, read with this bound", 16 << 20),
    Limit("max_columns", "columns of one CSV, Parquet or JSONL input (keys of one JSONL object, and all its "
                         "lines' keys together)", 16_384),
    Limit("max_parquet_metadata_bytes", "bytes of a Parquet file's footer (schema, row groups, key-value "
                                        "metadata), checked before it is parsed", 64 << 20),
    Limit("max_decoded_bytes", "bytes one input Parquet row group decodes to (from its footer: values x width), "
                               "or the whole file for readers that read it whole; at most this or "
                               "max_inflate_ratio x the file's size, whichever is larger (default 256 MiB)",
          256 << 20),
    Limit("max_whole_input_bytes", "bytes of an input a reader takes whole (wide-routing JSONL, serving-API "
                                   "responses; default: available memory / 8)",
          lambda: max(64 << 20, _mem_available() // 8)),
    Limit("max_text_records", "records kept from one text input: matched or malformed server-log lines, "
                              "Prometheus samples (each costs about 2 KB once parsed)", 250_000),
    Limit("max_yaml_bytes", "bytes of a YAML config (TensorRT-LLM EPLB), checked before it is parsed (the pure-"
                            "Python parser takes about 2 KB and 0.1 ms per node)", 2 << 20),
)}

# the store's own bounds: what a reader lists and reads of a store folder (storage/files.py)
LIMITS.update({lim.name: lim for lim in (
    Limit("max_store_files", "entries of a store's partition folders (Parquet files and anything else) "
                             "a reader lists; every listed file is opened by each query", 10_000),
    Limit("max_store_partitions", "partition folders (run_id=<id>) of a store's tables a reader lists",
          10_000),
    Limit("max_footer_bytes", "bytes of one store file's Parquet footer (schema, statistics, key-value "
                              "metadata), checked from the file's last 8 bytes before a reader parses it",
          16 << 20),
)})

# --set values given to ingest (collect() installs them for the duration of a call)
_OVERRIDES: dict[str, int] = {}


def set_overrides(options: dict | None) -> None:
    """Take ``max_*`` keys from collector options (``--set max_line_bytes=1000000``)."""
    _OVERRIDES.clear()
    for k, v in (options or {}).items():
        if k in LIMITS:
            _OVERRIDES[k] = _as_int(v, f"--set {k}")


def resolved_limits() -> dict[str, int]:
    """Every limit's current value (--set, environment or default), resolved in this
    process: what a worker process is handed (:func:`set_overrides` there), so limits a
    user raised or lowered apply in workers too, whatever environment they started with."""
    return {name: limit(name) for name in LIMITS}


def _as_int(v, what: str) -> int:
    try:
        n = int(float(v)) if not isinstance(v, int) else v
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{what}={v!r} is not a number") from None
    if n <= 0:
        raise UsageError(f"{what}={v!r} must be positive")
    return n


def limit(name: str) -> int:
    """The current value of limit ``name``: --set, else $MOETRACE_<NAME>, else the default."""
    lim = LIMITS[name]
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    env = os.environ.get(lim.env)
    if env:
        return _as_int(env, lim.env)
    return lim.default() if callable(lim.default) else lim.default


def how_to_raise(name: str) -> str:
    return f"raise it with --set {name}=N or {LIMITS[name].env}=N"


def limit_error(path, name: str, what: str, position: str | None = None) -> InputError:
    return InputError(path, f"{what} exceeds the limit {name}={limit(name)}; {how_to_raise(name)}", position)


# ----------------------------------------------------------------------------- integers
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
#: ranks, layers, experts, slots: the shape bound of docs/hardening.md
SHAPE_MAX = 2**24


def checked_int(value, lo: int, hi: int, file, where: str, what: str = "", position: str | None = None) -> int:
    """``value`` (an int, or digits in text) as an int within ``lo..hi``, checked *before*
    it is converted to a fixed-width type; otherwise an InputError naming the file, where
    (``"key '3_1'"``, ``"rank"``), the value (cut short) and the limit."""
    what = f"{what} {where}" if what else where
    if isinstance(value, bool):
        raise InputError(file, f"{what} is a boolean, expected an integer", position)
    if isinstance(value, str):
        t = value.strip()
        if not re.fullmatch(r"[+-]?\d{1,4300}", t):
            raise InputError(file, f"{what} = {excerpt(t, 30)!r} is not an integer", position)
        value = int(t)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or value != int(value):
            raise InputError(file, f"{what} = {value!r} is not an integer", position)
        value = int(value)
    elif not isinstance(value, int):
        try:
            value = int(value)   # numpy integers
        except (TypeError, ValueError):
            raise InputError(file, f"{what} is a {type(value).__name__}, expected an integer",
                             position) from None
    if not lo <= value <= hi:
        shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:12]}...({len(str(value))} digits)"
        raise InputError(file, f"{what} = {shown} is outside {_range_name(lo, hi)}", position)
    return value


def _range_name(lo: int, hi: int) -> str:
    names = {INT64: "int64 (-2^63..2^63-1)", INT32: "int32 (-2^31..2^31-1)", (0, INT64[1]): "0..2^63-1 (int64)",
             (0, INT32[1]): "0..2^31-1 (int32)", (0, SHAPE_MAX - 1): "0..2^24-1 (the shape bound)"}
    return names.get((lo, hi), f"{lo}..{hi}")


# ----------------------------------------------------------------------------- files
def check_regular_file(path: str | os.PathLike) -> None:
    """Refuse a FIFO, device, socket (reading one hangs or never ends) before opening it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        return
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else
                "a character device" if stat.S_ISCHR(st.st_mode) else
                "a block device" if stat.S_ISBLK(st.st_mode) else
                "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise InputError(path, f"is {kind}; moetrace reads regular files only")


def max_inflated(path: str | os.PathLike, compressed_bytes: int | None = None) -> int:
    """Largest inflated size allowed for a compressed input of ``compressed_bytes``."""
    if compressed_bytes is None:
        compressed_bytes = os.stat(path).st_size
    return min(limit("max_inflated_bytes"), max(1 << 20, compressed_bytes * limit("max_inflate_ratio")))


def _inflate_error(path, size: int, compressed: int) -> InputError:
    cap = max_inflated(path, compressed)
    which = "max_inflated_bytes" if cap == limit("max_inflated_bytes") else "max_inflate_ratio"
    return InputError(path, f"inflates to more than {cap} bytes (compressed {compressed} bytes; limit "
                            f"max_inflate_ratio={limit('max_inflate_ratio')}, max_inflated_bytes="
                            f"{limit('max_inflated_bytes')}); {how_to_raise(which)}")


def check_inflated_size(path, inflated: int, compressed: int) -> None:
    """Refuse a member whose declared inflated size is beyond the limits."""
    if inflated > max_inflated(path, compressed):
        raise _inflate_error(path, inflated, compressed)


def bounded_gunzip(path: str | os.PathLike, data: bytes | None = None, out=None) -> bytes | None:
    """Inflate a gzip file (all members) with the size cap. Returns the bytes, or writes
    them to ``out`` (a binary file) and returns None. Raises InputError for a corrupt or
    truncated stream and for a stream that inflates beyond the limit."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    cap = max_inflated(path, len(data))
    chunks: list[bytes] = []
    total = 0
    pos = 0
    try:
        while True:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            buf = memoryview(data)[pos:]
            while True:
                piece = d.decompress(buf, 1 << 20)
                total += len(piece)
                if total > cap:
                    raise _inflate_error(path, total, len(data))
                if out is not None:
                    out.write(piece)
                else:
                    chunks.append(piece)
                buf = d.unconsumed_tail
                if d.eof or not buf and not piece:
                    break
            if not d.eof:
                raise InputError(path, "corrupt or truncated gzip: stream ends before its end marker")
            rest = d.unused_data
            pos = len(data) - len(rest)
            if not rest.strip(b"\x00"):
                break
            if rest[:2] != b"\x1f\x8b":
                raise InputError(path, "corrupt gzip: trailing garbage after the stream")
    except zlib.error as e:
        raise InputError(path, f"corrupt or truncated gzip: {e}") from None
    return None if out is not None else b"".join(chunks)


def check_zip_members(path: str | os.PathLike) -> None:
    """A zip archive (.pt, .npz): every member's declared inflated size within the limits,
    checked from the central directory before anything is inflated."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise InputError(path, f"not a readable zip archive (truncated or corrupt): {e}") from None
    total_c = os.stat(path).st_size
    total = sum(i.file_size for i in infos)
    check_inflated_size(path, total, total_c)


def check_array_elements(path, shape, what: str = "array") -> None:
    n = 1
    for d in shape:
        if d < 0:
            raise InputError(path, f"{what} declares a negative dimension {tuple(shape)}")
        n *= int(d)
    if n > limit("max_array_elements"):
        raise limit_error(path, "max_array_elements", f"{what} of shape {tuple(shape)} ({n} elements)")


def check_npy_headers(path: str | os.PathLike) -> dict[str, tuple]:
    """Read the header of a .npy (or every .npy inside a .npz) and check the declared
    shape and dtype before numpy allocates anything (a .npy's declared data size must be
    the file's). Returns {array name ("array" for a .npy): shape}."""
    import zipfile

    import numpy as np
    from numpy.lib import format as npf

    def one(f, what):
        try:
            version = npf.read_magic(f)
            shape, _fortran, dtype = (npf.read_array_header_1_0(f) if version == (1, 0)
                                      else npf.read_array_header_2_0(f))
        except Exception as e:  # noqa: BLE001 - any malformed header
            raise InputError(path, f"{what}: malformed .npy header ({excerpt(str(e), 80)})") from None
        if dtype.hasobject:
            raise InputError(path, f"cannot read {what}: object arrays (pickles) are refused; moetrace loads .npy with "
                                   "allow_pickle=False")
        check_array_elements(path, shape, what)
        shapes[what] = tuple(int(d) for d in shape)
        return np.dtype(dtype).itemsize * int(np.prod(shape, dtype=object))

    shapes: dict[str, tuple] = {}
    with open(path, "rb") as fh:
        magic = fh.read(6)
        fh.seek(0)
        if magic == b"\x93NUMPY":
            need = one(fh, "array")
            have = os.fstat(fh.fileno()).st_size - fh.tell()
            if need != have:   # a header that lies about the data is refused before numpy reads it
                raise InputError(path, f"the .npy header declares {need} bytes of data, the file holds {have}")
            return shapes
    if magic[:4] == b"PK\x03\x04":
        check_zip_members(path)
        try:
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if info.filename.endswith(".npy"):
                        with z.open(info) as f:
                            one(f, info.filename[:-4])
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise InputError(path, f"not a readable .npz (truncated or corrupt): {e}") from None
    return shapes


# ----------------------------------------------------------------------------- tabular inputs
def check_columns(path, n: int, what: str = "columns", position: str | None = None) -> None:
    if n > limit("max_columns"):
        raise limit_error(path, "max_columns", f"{n} {what}", position)


def check_whole_input(path, size: int | None = None) -> int:
    """Refuse an input a reader would take whole beyond ``max_whole_input_bytes``; its size."""
    if size is None:
        size = os.stat(path).st_size
    if size > limit("max_whole_input_bytes"):
        raise limit_error(path, "max_whole_input_bytes", f"a file of {size} bytes read whole")
    return size


def first_line(path, what: str = "header line") -> bytes:
    """The first line of ``path`` (without its end), read with the ``max_record_bytes`` bound."""
    cap = limit("max_record_bytes")
    with open(path, "rb") as f:
        line = f.readline(cap + 1)
    if len(line) > cap:
        raise limit_error(path, "max_record_bytes", f"a {what} longer than {cap} bytes", "line 1")
    return line.rstrip(b"\r\n")


def check_csv_header(path, delimiter: bytes = b",") -> None:
    """A CSV's header line within ``max_record_bytes`` and its columns within ``max_columns``,
    checked before a CSV reader allocates anything per column (a 10 MB header of a million
    columns took 6 GB)."""
    line = first_line(path)
    n = line.count(delimiter) + 1
    if n > limit("max_columns"):
        import csv

        try:   # quoted delimiters do not count
            n = len(next(csv.reader([line.decode("utf-8", "replace")], delimiter=delimiter.decode())))
        except (csv.Error, StopIteration):
            pass
        check_columns(path, n, "columns in the header line", "line 1")


def check_parquet(path, whole: bool = False) -> None:
    """A Parquet input checked from its footer before any data is decoded: the footer's
    size (``max_parquet_metadata_bytes``, read from the file's last 8 bytes before the
    footer is parsed), the columns (``max_columns``), and what a row group (``whole``: the
    file) decodes to, each column's values x their width, against ``max_decoded_bytes``
    (a 131 KB run-length-encoded file decoded to 2.7 GB)."""
    import struct

    size = os.stat(path).st_size
    with open(path, "rb") as f:
        if size < 12:
            raise InputError(path, f"cannot parse: not a Parquet file ({size} bytes, too short)")
        f.seek(size - 8)
        tail = f.read(8)
    if tail[4:] != b"PAR1":
        raise InputError(path, "cannot parse: not a Parquet file (no PAR1 footer magic)")
    meta_len = struct.unpack("<I", tail[:4])[0]
    if meta_len > limit("max_parquet_metadata_bytes"):
        raise limit_error(path, "max_parquet_metadata_bytes", f"a Parquet footer of {meta_len} bytes")
    if meta_len > size - 12:
        raise InputError(path, f"cannot parse: corrupt Parquet file, the footer claims {meta_len} bytes, the file has {size}")
    import pyarrow.parquet as pq

    try:
        md = pq.read_metadata(arrow_path(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - arrow raises several kinds for a bad footer
        raise InputError(path, f"cannot parse the Parquet footer: {excerpt(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, 120)}") from None
    check_columns(path, md.num_columns, "Parquet columns")
    names = md.schema.to_arrow_schema().names
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise InputError(path, f"column {excerpt(dup, 60)!r} appears more than once")
    cap = max(limit("max_decoded_bytes"), min(size * limit("max_inflate_ratio"), limit("max_inflated_bytes")))
    total = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        n = 0
        for c in range(rg.num_columns):
            col = rg.column(c)
            width = 8 if col.physical_type != "BOOLEAN" else 1
            n += max(int(col.num_values) * width, int(col.total_uncompressed_size or 0))
        total = total + n if whole else n
        if total > cap:
            which = "the file" if whole else f"row group {g}"
            raise limit_error(path, "max_decoded_bytes", f"{which} decodes to about {total} bytes (declared in "
                                                         f"the footer; the file has {size})")


# ----------------------------------------------------------------------------- JSON
def json_loads(path, text, position: str | None = None):
    """json.loads with the failures a crafted document causes turned into one line:
    nesting too deep for the parser (RecursionError), numbers beyond any range."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(path, "JSON nested too deeply to parse (more than the parser's recursion limit)",
                         position) from None
    except ValueError as e:
        msg = getattr(e, "msg", None) or excerpt(str(e), 80)
        line = getattr(e, "lineno", None)
        raise InputError(path, f"invalid JSON: {msg}", position or (f"line {line}" if line else None)) from None


# ----------------------------------------------------------------------------- messages
_PRINTABLE = re.compile(r"[^\x20-\x7e]")


def excerpt(text: str, n: int = 40) -> str:
    """At most ``n`` printable ASCII characters of ``text`` (others as '?'), '...' when cut."""
    s = _PRINTABLE.sub("?", str(text))
    return s if len(s) <= n else s[: max(0, n - 3)] + "..."


def plausible_header(names) -> bool:
    """True when column names look like a CSV header (identifiers), so they may be quoted
    back in a message; anything else (a secret file's first line) is never echoed."""
    return all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_ .\-]{0,63}", str(c)) for c in names) and len(names) <= 64

"""Reading the generic collector's files (:mod:`.generic`) in batches: JSONL objects,
Parquet record batches and CSV blocks as polars frames, integer columns checked, required
and optional columns picked, with the row of any bad value named."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from ..errors import InputError
from ..safety import excerpt
from ._compressed import plain_name

if TYPE_CHECKING:   # polars is imported where a path needs it (start-up)
    import polars as pl

_INT_COLS = {"step", "layer", "expert", "tokens", "slot", "src_rank", "token", "choice"}
#: rows per batch of the streamed expert_load path
BATCH_ROWS = 1 << 20


def _jsonl_batches(path: Path, batch_rows: int | None = None, meta: list | None = None) -> Iterator[pl.DataFrame]:
    """The JSON objects of a JSONL file, :data:`BATCH_ROWS` lines at a time. Metadata
    records (``{"type": "meta", ...}``, :func:`._jsonl_meta.is_meta`) are skipped and, when
    ``meta`` is a list, appended to it as (line, record)."""
    from ._json_stream import jsonl_objects
    from ._jsonl_meta import is_meta

    batch_rows = batch_rows or BATCH_ROWS
    rows: list[dict] = []
    # lines, keys and columns are bounded as they are read (safety.py limits)
    for i, obj in jsonl_objects(path):
        if is_meta(obj):
            if meta is not None:
                meta.append((i, obj))
            continue
        for k in _INT_COLS.intersection(obj):
            if isinstance(obj[k], bool):  # JSON true/false would silently become 1/0
                raise InputError(path, f"column {k!r} must be an integer, got {json.dumps(obj[k])}", f"line {i}")
        rows.append(obj)
        if len(rows) >= batch_rows:
            yield _json_frame(path, rows)
            rows = []
    if rows:
        yield _json_frame(path, rows)


def _json_frame(path: Path, rows: list[dict]) -> pl.DataFrame:
    import polars as pl

    try:
        return pl.DataFrame(rows, infer_schema_length=None)
    except Exception as e:
        raise InputError(path, f"inconsistent column types: {e}") from None


def _ints(df: pl.DataFrame, path: Path, offset: int = 0) -> pl.DataFrame:
    """Integer columns as Int64 (``offset``: rows before this batch, for positions)."""
    import polars as pl

    for c in df.columns:
        if c not in _INT_COLS:
            continue
        s = df[c]
        if s.dtype == pl.Boolean:   # true/false would silently become 1/0 (refused in JSONL too)
            raise InputError(path, f"column {c!r} holds booleans, expected integers")
        if isinstance(s.dtype, (pl.Struct, pl.List, pl.Array, pl.Object)):
            raise InputError(path, f"column {c!r} must be integer, got {s.dtype}")
        if isinstance(s.dtype, pl.Decimal):   # 3.5 must not become 3: refused like a float
            i = _first_fraction(s)
            if i is not None:
                raise InputError(path, f"column {c!r} holds a non-integer value {s[i]}", _row(path, offset + i + 1))
        if s.dtype.is_float():
            bad = s.is_nan() | (s != s.round(0))
            if bad.any():
                i = int(bad.arg_max())
                raise InputError(path, f"column {c!r} holds a non-integer value {s[i]!r}", _row(path, offset + i + 1))
        elif not s.dtype.is_integer() and s.dtype != pl.Null:
            if s.dtype == pl.String:   # decimal digits only: "0x10", "1e3", "1_000" are no counts
                bad = ~s.str.contains(r"^\s*[+-]?[0-9]+\s*$") & s.is_not_null()
                if bad.any():
                    i = int(bad.arg_max())
                    raise InputError(path, f"column {c!r} must be integer, got {excerpt(str(s[i]), 40)!r}",
                                     _row(path, offset + i + 1))
            try:
                df = df.with_columns(pl.col(c).cast(pl.Int64, strict=True))
                continue
            except Exception:
                i = _first_uncastable(s)
                raise InputError(path, f"column {c!r} must be integer, got {s[i]!r}" if i is not None else
                                 f"column {c!r} must be integer, got {s.dtype}",
                                 _row(path, offset + i + 1) if i is not None else None) from None
        try:
            df = df.with_columns(pl.col(c).cast(pl.Int64))
        except Exception:  # e.g. a 128-bit integer polars read from a huge literal
            i = _first_uncastable(s)
            pos = _row(path, offset + i + 1) if i is not None else None
            raise InputError(path, f"column {c!r} holds a value outside the 64-bit integer range", pos) from None
    return df


def _first_fraction(s: pl.Series) -> int | None:
    """Index of the first decimal value of ``s`` with a fraction (None: none)."""
    if not getattr(s.dtype, "scale", 0):
        return None
    for i, v in enumerate(s.to_list()):
        if v is not None and v != v.to_integral_value():
            return i
    return None


def _first_uncastable(s: pl.Series) -> int | None:
    """Index of the first non-null value of ``s`` that is no 64-bit integer (None: not found,
    or a type such as a list that has no per-value cast)."""
    import polars as pl

    try:
        bad = s.cast(pl.Int64, strict=False).is_null() & s.is_not_null()
    except Exception:
        return None
    return int(bad.arg_max()) if bad.any() else None


def _row(path: Path, row: int) -> str:
    """Where data row ``row`` (1-based, the header not counted) is: in a CSV also its line
    (the header is line 1), so an editor's line number finds it."""
    name = plain_name(path)
    if name.endswith((".parquet", ".jsonl", ".ndjson")):
        return f"row {row}"
    return f"row {row}, line {row + 1}"


def _parse_error(path: Path, e: BaseException) -> InputError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"Row #(\d+)", msg)       # pyarrow's CSV reader counts lines, the header being line 1
    pos = _row(path, int(m.group(1)) - 1) if m else None
    return InputError(path, f"cannot parse: {msg}", pos)


def _parquet_batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """A Parquet file's rows in record batches of :data:`BATCH_ROWS` (``columns``: only those)."""
    import pyarrow.parquet as pq

    from ..safety import arrow_path

    try:
        pf = pq.ParquetFile(arrow_path(path))
        for f in pf.schema_arrow:
            if pa.types.is_decimal256(f.type):   # polars panics on them; counts are integers
                raise InputError(path, f"column {excerpt(f.name, 60)!r} is a 256-bit decimal ({f.type}); "
                                       "write counts and ids as integers")
        it = pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
    except InputError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise _parse_error(path, e) from None
    while True:
        try:
            b = next(it)
        except StopIteration:
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise _parse_error(path, e) from None
        if b.num_rows:
            yield b


def _frames(path: Path, meta: list | None = None) -> Iterator[pl.DataFrame]:
    """The file's rows in batches: Parquet by row batches of :data:`BATCH_ROWS`, JSONL by
    as many lines, CSV by 8 MiB blocks (pyarrow's streaming reader; column types from the
    first block)."""
    import polars as pl

    if path.name.lower().endswith(".parquet"):
        for b in _parquet_batches(path):
            try:
                df = pl.from_arrow(b)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - polars panics (a decimal256 column) are BaseException
                raise _parse_error(path, e) from None
            yield df
        return
    if plain_name(path).endswith((".jsonl", ".ndjson")):
        it = _jsonl_batches(path, meta=meta)
    else:
        import pyarrow.csv as pacsv

        def csv_batches():
            reader = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=8 << 20, use_threads=False),
                                    convert_options=pacsv.ConvertOptions(null_values=[""]))  # "NaN" is a value
            for b in reader:
                yield pl.from_arrow(b)
        it = csv_batches()
    while True:
        try:
            df = next(it)
        except StopIteration:
            return
        except (InputError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise _parse_error(path, e) from None
        if df.height:
            yield df


def _columns(df: pl.DataFrame, path: Path, req: list[str], opt: list[str], offset: int = 0) -> pl.DataFrame:
    """The ``req`` and ``opt`` columns of ``df``: integers as Int64, required ones without
    nulls, absent optional ones added as nulls (``offset``: rows before this batch)."""
    import polars as pl

    cols = set(df.columns)
    df = _ints(df.select([c for c in req + opt if c in cols]), path, offset)
    for c in req:
        if df[c].null_count():
            i = int(df[c].is_null().arg_max())
            raise InputError(path, f"column {c!r} is empty", _row(path, offset + i + 1))
    for c in opt:
        if c not in df.columns:
            df = df.with_columns(pl.lit(None, dtype=pl.Int64 if c != "gate" else pl.Float32).alias(c))
    return df

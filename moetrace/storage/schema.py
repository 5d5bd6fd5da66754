"""The table contract: loads ``schemas/*.json`` into Arrow schemas and validates tables.

Every writer goes through :func:`conform`, which checks that each contract column is
present with a compatible type, casts to the contract's exact Arrow type, rejects nulls
in non-nullable columns and drops nothing silently (extra columns are an error).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SchemaError

if TYPE_CHECKING:   # pyarrow is imported where a path needs it: readers need only names (start-up time)
    import pyarrow as pa

#: the contract's type names (their Arrow types: :func:`arrow_types`)
TYPE_NAMES = ("string", "bool", "int8", "int16", "int32", "int64", "float32", "float64", "int64[]")
#: each contract type as DuckDB names it (a view's column that no file holds is cast to it)
DUCK_TYPES = {"string": "VARCHAR", "bool": "BOOLEAN", "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER",
              "int64": "BIGINT", "float32": "FLOAT", "float64": "DOUBLE", "int64[]": "BIGINT[]"}



@lru_cache(maxsize=None)
def arrow_types() -> dict[str, pa.DataType]:
    """{contract type name: its Arrow type}."""
    import pyarrow as pa

    return {
        "string": pa.string(),
        "bool": pa.bool_(),
        "int8": pa.int8(),
        "int16": pa.int16(),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float32": pa.float32(),
        "float64": pa.float64(),
        "int64[]": pa.list_(pa.int64()),   # a list of counts (expert_counts.tokens, index = expert id)
    }


META_VERSION = b"moetrace.schema_version"
META_TABLE = b"moetrace.table"


def schema_dir() -> Path:
    """The folder holding the contract: the installed copy, else the repository's."""
    here = Path(__file__).resolve().parent.parent   # the moetrace package
    for cand in (here / "_schemas", here.parent / "schemas"):
        if cand.is_dir() and any(cand.glob("*.json")):
            return cand
    raise FileNotFoundError("moetrace schemas/ folder not found")


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    nullable: bool
    unit: str | None
    description: str

    @property
    def arrow_type(self) -> pa.DataType:
        return arrow_types()[self.type]


@dataclass(frozen=True)
class TableSchema:
    name: str
    version: str
    description: str
    partition_by: str | None
    columns: tuple[Column, ...]

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def arrow(self, with_metadata: bool = True) -> pa.Schema:
        import pyarrow as pa

        fields = [pa.field(c.name, c.arrow_type, nullable=c.nullable) for c in self.columns]
        meta = {META_VERSION: self.version.encode(), META_TABLE: self.name.encode()} if with_metadata else None
        return pa.schema(fields, metadata=meta)


@lru_cache(maxsize=None)
def load_all() -> dict[str, TableSchema]:
    out = {}
    for path in sorted(schema_dir().glob("*.json")):
        doc = json.loads(path.read_text())
        cols = []
        for c in doc["columns"]:
            if c["type"] not in TYPE_NAMES:
                raise ValueError(f"{path}: column {c['name']}: unknown type {c['type']!r}")
            cols.append(Column(c["name"], c["type"], bool(c["nullable"]), c.get("unit"), c.get("description", "")))
        out[doc["table"]] = TableSchema(doc["table"], doc["schema_version"], doc.get("description", ""),
                                        doc.get("partition_by"), tuple(cols))
    return out


def get(table: str) -> TableSchema:
    try:
        return load_all()[table]
    except KeyError:
        raise SchemaError(table, f"no such table in the contract (known: {', '.join(sorted(load_all()))})") from None


def arrow_schema(table: str) -> pa.Schema:
    return get(table).arrow()


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    import pyarrow as pa

    if src == dst or pa.types.is_null(src):
        return True
    if pa.types.is_integer(dst):
        return pa.types.is_integer(src) or pa.types.is_boolean(src)
    if pa.types.is_floating(dst):
        return pa.types.is_integer(src) or pa.types.is_floating(src)
    if pa.types.is_string(dst) or pa.types.is_large_string(dst):
        return pa.types.is_string(src) or pa.types.is_large_string(src) or pa.types.is_dictionary(src)
    if pa.types.is_boolean(dst):
        return pa.types.is_boolean(src)
    if pa.types.is_list(dst):
        return ((pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_fixed_size_list(src))
                and _compatible(src.value_type, dst.value_type))
    return False


def conform(table: str, data, file: str | None = None) -> pa.Table:
    """Validate ``data`` (pyarrow Table, polars DataFrame or dict of columns) against the
    contract of ``table`` and return a pyarrow Table with exactly the contract's schema
    (column order, types, schema-version metadata).

    Raises SchemaError naming the table and column on a missing or extra column, a type
    that cannot represent the contract type, nulls in a non-nullable column, or an integer
    value that does not fit.
    """
    import pyarrow as pa

    ts = get(table)
    if isinstance(data, dict):
        data = pa.table(data)
    elif not isinstance(data, pa.Table):
        to_arrow = getattr(data, "to_arrow", None)
        if to_arrow is None:
            raise TypeError(f"cannot write {type(data).__name__} as table {table}")
        data = to_arrow()
    present = set(data.column_names)
    missing = [c for c in ts.column_names if c not in present]
    if missing:
        raise SchemaError(table, f"missing column(s): {', '.join(missing)}", missing[0], file)
    extra = [c for c in data.column_names if c not in set(ts.column_names)]
    if extra:
        raise SchemaError(table, f"unexpected column(s): {', '.join(extra)}", extra[0], file)
    arrays = []
    for col in ts.columns:
        arr = data.column(col.name)
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        if not _compatible(arr.type, col.arrow_type):
            raise SchemaError(table, f"type {arr.type} cannot hold {col.type}", col.name, file)
        if not col.nullable and arr.null_count:
            raise SchemaError(table, f"{arr.null_count} null value(s) in a non-nullable column", col.name, file)
        if arr.type != col.arrow_type:
            try:
                arr = arr.cast(col.arrow_type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(table, f"values do not fit {col.type}: {e}", col.name, file) from None
        if pa.types.is_floating(col.arrow_type) and len(arr):
            pass  # NaN checks are the collectors' business (they know what NaN means in their format)
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=ts.arrow())


def one_row(row: dict) -> pa.Table:
    """A one-row table of Python values (str, int, bool, float, None; other values as
    ``pa.array`` makes them), column types as ``pa.Table.from_pylist([row])`` infers them.
    Built from buffers: pyarrow imports pandas the first time ``pa.array`` is called, a
    third of a second of every ``moetrace ingest``."""
    import struct

    import pyarrow as pa

    cols = {}
    for k, v in row.items():
        if v is None:
            cols[k] = pa.nulls(1)
        elif isinstance(v, bool):
            cols[k] = pa.Array.from_buffers(pa.bool_(), 1, [None, pa.py_buffer(bytes([int(v)]))])
        elif isinstance(v, int) and -2**63 <= v < 2**63:
            cols[k] = pa.Array.from_buffers(pa.int64(), 1, [None, pa.py_buffer(struct.pack("<q", v))])
        elif isinstance(v, float):
            cols[k] = pa.Array.from_buffers(pa.float64(), 1, [None, pa.py_buffer(struct.pack("<d", v))])
        elif isinstance(v, str):
            cols[k] = _one_string(v)
        else:
            cols[k] = pa.array([v])
    return pa.table(cols)


def repeated_string(value: str, n: int) -> pa.Array:
    """``n`` copies of ``value`` as a string array, built from buffers (see :func:`one_row`):
    the contract's type as is, nothing for :func:`conform` to cast (a dictionary array was
    cast, which imports ``pyarrow.compute``). Past 2 GiB of characters, or for a string
    UTF-8 cannot encode: one dictionary entry and ``n`` zero indices."""
    import numpy as np
    import pyarrow as pa

    try:
        b = value.encode("utf-8")
    except UnicodeEncodeError:
        b = None
    if b is not None and len(b) * n < 1 << 31:
        offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(b))
        return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(b * n)])
    indices = pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(bytes(4 * n))])
    return pa.DictionaryArray.from_arrays(indices, _one_string(value))


def _one_string(v: str) -> pa.Array:
    import struct

    import pyarrow as pa

    try:
        b = v.encode("utf-8")
    except UnicodeEncodeError:    # a lone surrogate (an undecodable file name): as pyarrow says it
        return pa.array([v], pa.string())
    return pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(struct.pack("<ii", 0, len(b))), pa.py_buffer(b)])


def empty(table: str) -> pa.Table:
    return ts_empty(get(table))


def ts_empty(ts: TableSchema) -> pa.Table:
    return ts.arrow().empty_table()


"""A Store reads each Parquet footer once (its check and its views share
``check.footer_columns``' cache), and a file rewritten since is read again."""
from __future__ import annotations

import os

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.storage import check


def test_cache_reads_only_missing_or_changed_files(tmp_path, monkeypatch):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"x": [1, 2], "y": ["u", "v"]}), a)
    pq.write_table(pa.table({"z": [1.5]}), b)
    read = []
    real = check._footer_columns
    monkeypatch.setattr(check, "_footer_columns", lambda con, files: read.append(sorted(files)) or real(con, files))
    con, cache = duckdb.connect(), {}
    first = check.footer_columns(con, [a, b], cache)
    assert first == {str(a): [("x", "BIGINT"), ("y", "VARCHAR")], str(b): [("z", "DOUBLE")]}
    assert check.footer_columns(con, [b], cache) == {str(b): [("z", "DOUBLE")]}
    assert read == [sorted([str(a), str(b)])]              # the second call read nothing
    pq.write_table(pa.table({"w": [7], "v": [8]}), b)       # rewritten: another size and mtime
    os.utime(b, ns=(os.stat(b).st_atime_ns, os.stat(b).st_mtime_ns + 10**9))
    assert check.footer_columns(con, [a, b], cache)[str(b)] == [("w", "BIGINT"), ("v", "BIGINT")]
    assert read[-1] == [str(b)]
    assert check.footer_columns(con, [a, b]) == check.footer_columns(con, [a, b], {})   # no cache: the same

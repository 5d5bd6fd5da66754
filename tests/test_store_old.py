"""Stores written before a contract column existed.

``runs.ingest_key`` (nullable) and ``expert_counts.tokens_desc`` (the counts sorted
descending, derivable) were added after stores were written without them. Such a store,
built here by hand in the old shape, is read as it is (never rewritten): NULL for the
nullable column, the counts sorted for the derived one, also after new runs were written
into it (files of both shapes). A column that cannot be filled, a store format newer than
this moetrace and a marker that is not one are one line, exit 2, the store unchanged.
"""
from __future__ import annotations

import json
import shutil

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.run import Store
from moetrace.storage.paths import STORE_MARKER
from moetrace.storage.schema import META_VERSION

from .helpers import invoke as _cli
from .helpers import tree_hash

SYNTH = ["--layers", "2", "--experts", "8", "--top-k", "2", "--ranks", "2", "--ranks-per-node", "2", "--steps", "4",
         "--tokens-per-step", "64"]


def _one_line(res, *needles: str) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrace: error:"), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _drop(store, table: str, column: str, version: str | None = None) -> None:
    """Rewrite every file of ``table`` without ``column`` (footer version set to ``version``)."""
    for f in (store / table).glob("run_id=*/*.parquet"):
        t = pq.read_table(f)
        t = t.drop_columns([column])
        meta = dict(t.schema.metadata or {})
        if version is not None:
            meta[META_VERSION] = version.encode()
        pq.write_table(t.replace_schema_metadata(meta), f)


@pytest.fixture
def stores(runner, cli, tmp_path):
    """(new, old): the same synth run, ``old`` in the shape written before runs.ingest_key
    (runs 1.0.0) and expert_counts.tokens_desc existed."""
    new = tmp_path / "new"
    res = _cli(runner, cli, "synth", new, *SYNTH, "--seed", "3")
    assert res.exit_code == 0, res.output
    old = tmp_path / "old"
    shutil.copytree(new, old)
    _drop(old, "runs", "ingest_key", "1.0.0")
    _drop(old, "expert_counts", "tokens_desc")
    names = {n for f in (old / "expert_counts").glob("*/*.parquet") for n in pq.read_schema(f).names}
    assert "tokens_desc" not in names and "tokens" in names
    return new, old


def _counts(store) -> np.ndarray:
    """The raw dense counts [rows, experts] read straight from the files (ordered by step, layer)."""
    t = pa.concat_tables([pq.read_table(f, columns=["step", "layer", "tokens"])
                          for f in sorted((store / "expert_counts").glob("*/*.parquet"))])
    t = t.sort_by([("step", "ascending"), ("layer", "ascending")])
    return np.array(t.column("tokens").to_pylist(), dtype=np.int64)


def test_old_store_reads_as_it_is(runner, cli, stores):
    new, old = stores
    before = tree_hash(old)
    st = Store(old)
    desc = st.sql("SELECT step, layer, tokens_desc FROM expert_counts ORDER BY step, layer")["tokens_desc"].to_list()
    # tokens_desc of the old files = the raw counts sorted descending (numpy, not the view)
    assert np.array_equal(np.array(desc), -np.sort(-_counts(old), axis=1))
    assert st.sql("SELECT ingest_key FROM runs")["ingest_key"].to_list() == [None]
    # Store.runs() is runs_rows() typed by the contract (one reader): the lacking column is
    # NULL, the others as the view reads them
    frame = st.runs()
    assert frame["ingest_key"].to_list() == [None] and frame.columns == list(st.runs_rows().columns)
    assert frame.rows() == [tuple(r) for r in st.runs_rows().rows]
    assert frame.drop("ingest_key").equals(st.sql("SELECT * EXCLUDE (ingest_key) FROM runs ORDER BY run_id"))
    st.close()
    # every command reads it as the new store: same output
    for args in (("runs", "--format", "json"), ("skew", "--format", "json"),
                 ("sql", "SELECT * EXCLUDE (ingest_key) FROM runs", "--format", "json")):
        a, b = _cli(runner, cli, args[0], new, *args[1:]), _cli(runner, cli, args[0], old, *args[1:])
        assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
        # equal up to the last bit of a float mean (the old files' sorted counts are summed
        # in another order)
        ra, rb = json.loads(a.output), json.loads(b.output)
        assert [r.keys() for r in ra] == [r.keys() for r in rb], args
        for x, y in zip(ra, rb):
            assert x == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                         for k, v in y.items()}, args
    assert tree_hash(old) == before  # a read never rewrites the files


def test_old_store_written_on_holds_both_shapes(runner, cli, stores):
    """A new run written into the old store has tokens_desc in its files; the old run's
    files still lack it and read the counts sorted, not NULL (the view coalesces)."""
    _, old = stores
    res = _cli(runner, cli, "synth", old, *SYNTH, "--seed", "4")
    assert res.exit_code == 0, res.output
    has = sorted("tokens_desc" in pq.read_schema(f).names for f in (old / "expert_counts").glob("*/*.parquet"))
    assert has == [False, True]
    st = Store(old)
    for rid in ("synth-s3", "synth-s4"):
        rows = st.sql("SELECT tokens, tokens_desc FROM expert_counts WHERE run_id = ? ORDER BY step, layer", [rid])
        tok = np.array(rows["tokens"].to_list())
        assert np.array_equal(np.array(rows["tokens_desc"].to_list()), -np.sort(-tok, axis=1)), rid
    keys = dict(st.sql("SELECT run_id, ingest_key IS NULL AS k FROM runs").iter_rows())
    assert keys["synth-s3"] is True  # the old run's files have no ingest_key: NULL
    # the catalog binds the same views with relative paths
    st.close()
    res = _cli(runner, cli, "catalog", old)
    assert res.exit_code == 0, res.output
    cat = duckdb.connect(str(old / "catalog.duckdb"), read_only=True)
    cat.execute(f"SET file_search_path='{old}'")
    n_null = cat.execute("SELECT count(*) FROM expert_counts WHERE tokens_desc IS NULL").fetchone()[0]
    n = cat.execute("SELECT count(*) FROM expert_counts").fetchone()[0]
    cat.close()
    assert (n_null, n) == (0, 2 * 4 * 2)


def test_old_store_lacking_a_column_that_cannot_be_filled_is_one_line(runner, cli, stores):
    _, old = stores
    _drop(old, "runs", "collector", "0.9.0")   # required, not derivable
    before = tree_hash(old)
    for args in (("runs",), ("skew",), ("sql", "SELECT 1")):
        _one_line(_cli(runner, cli, args[0], old, *args[1:]), str(old), "'runs'", "0.9.0", "'collector'",
                  "re-ingest")
    _one_line(_cli(runner, cli, "synth", old, *SYNTH, "--seed", "9"), str(old), "'collector'")
    assert tree_hash(old) == before


@pytest.mark.parametrize("marker, needles", [
    ({"moetrace_store_format": 99, "created_by": "9.9"}, ["store format 99", "upgrade moetrace"]),
    ({"moetrace_store_format": "1"}, ["not a moetrace store marker"]),
    ([], ["not a moetrace store marker"]),
])
def test_store_marker_newer_or_not_a_marker_is_one_line(runner, cli, stores, marker, needles):
    _, old = stores
    (old / STORE_MARKER).write_text(json.dumps(marker))
    before = tree_hash(old)
    for args in (("runs",), ("synth", *SYNTH, "--seed", "9")):
        _one_line(_cli(runner, cli, args[0], old, *args[1:]), *needles)
    assert tree_hash(old) == before

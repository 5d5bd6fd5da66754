"""The one-pass ingest of a dense expert_load Parquet file (generic collector):
the rows stored are the file's rows (read back through the expert_load view and compared
with the file by DuckDB, and with the same file ingested the two-pass way), a bad row found
while writing is refused with the same one-line message as before and leaves the store as
it was (a new store is not left behind), and a file that is not what its footer promised
(rows out of dense order after the first batches) is written the two-pass way."""
from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.collect import _generic_read, generic
from moetrace.storage.store import Store

from .helpers import tree_hash


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(_generic_read, "BATCH_ROWS", 1000)   # many batches and (step, layer) groups across batch edges


def _file(path, steps=150, layers=3, experts=8, seed=0, **override):
    rng = np.random.default_rng(seed)
    n = steps * layers * experts
    cols = {"step": np.repeat(np.arange(steps), layers * experts),
            "layer": np.tile(np.repeat(np.arange(layers), experts), steps),
            "expert": np.tile(np.arange(experts), steps * layers),
            "tokens": rng.integers(0, 500, n)}
    for k, (i, v) in override.items():
        cols[k][i] = v
    pq.write_table(pa.table({k: pa.array(v, pa.int64()) for k, v in cols.items()}), path, row_group_size=700)
    return n


def _ingest(runner, cli, *args):
    return runner.invoke(cli, ["ingest", *map(str, args)], catch_exceptions=True)


def _stored(st, run):
    return Store(st).sql(f"SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = '{run}' "
                         "ORDER BY step, layer, expert")


def _tables(st, run):
    return sorted(p.parent.parent.name for p in st.glob(f"*/run_id={run}/*.parquet"))


def test_one_pass_stores_the_file_rows(runner, cli, tmp_path, small_batches):
    f = tmp_path / "load.parquet"
    n = _file(f)
    st = tmp_path / "st"
    res = _ingest(runner, cli, f, "--store", st, "--run-id", "one", "--ranks", 4)
    assert res.exit_code == 0, res.output
    assert _tables(st, "one") == ["expert_counts", "runs"]
    # the same rows as the file, by DuckDB over the file itself
    got = _stored(st, "one")
    want = duckdb.connect().execute(f"SELECT step, layer, expert, tokens FROM read_parquet('{f}') "
                                    "ORDER BY step, layer, expert").fetchall()
    assert got.height == n and got.rows() == want
    # and as the two-pass path stores them (the long layout, forced)
    assert _ingest(runner, cli, f, "--store", st, "--run-id", "two", "--set", "layout=long").exit_code == 0
    assert _tables(st, "two") == ["expert_load", "runs"]
    assert _stored(st, "two").rows() == want
    shape = Store(st).sql("SELECT run_id, num_layers, num_experts, num_slots, num_ranks FROM runs ORDER BY run_id")
    assert shape.rows() == [("one", 3, 8, 8, 4), ("two", 3, 8, 8, None)]
    sorted_desc = Store(st).sql("SELECT tokens, tokens_desc FROM expert_counts WHERE run_id = 'one'")
    for t, d in sorted_desc.iter_rows():
        assert d == sorted(t, reverse=True)


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("column,value,words", [("tokens", -3, "expert_load.tokens = -3 is negative"),
                                                ("layer", 7, "expert_load.layer = 7 is outside the run's shape (0..2)")])
def test_bad_row_late_in_the_file_is_refused_and_leaves_nothing(runner, cli, tmp_path, small_batches, monkeypatch,
                                                                fresh, column, value, words):
    """A footer whose statistics say the values are fine (a writer that lies), rows that
    say otherwise at row 2,501: the one pass finds it while writing, after two batches."""
    f = tmp_path / "load.parquet"
    _file(f, **{column: (2500, value)})
    st = tmp_path / "deep" / "st"
    if not fresh:
        g = tmp_path / "good.parquet"
        _file(g, seed=1)
        assert _ingest(runner, cli, g, "--store", st).exit_code == 0
    real = generic._footer_ranges

    def clean_footer(path):
        md, lo, hi = real(path)
        return md, {**lo, "tokens": 0}, {**hi, "layer": 2}

    monkeypatch.setattr(generic, "_footer_ranges", clean_footer)
    before = tree_hash(st)
    res = _ingest(runner, cli, f, "--store", st, "--layers", 3)
    assert res.exit_code == 2, res.output
    assert words in res.output and "row 2501" in res.output and str(f) in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert tree_hash(st) == before
    if fresh:
        assert not (tmp_path / "deep").exists()
    # the two-pass path names the same row the same way
    monkeypatch.setattr(generic, "_footer_ranges", lambda path: None)
    res2 = _ingest(runner, cli, f, "--store", st, "--layers", 3)
    assert res2.exit_code == 2 and res2.output == res.output


def test_rows_out_of_dense_order_late_in_the_file_fall_back(runner, cli, tmp_path, small_batches):
    """Two experts swapped at row 3,000 (after several dense batches were written): the
    one pass gives up, the run is written the two-pass way (long rows), exactly the file."""
    f = tmp_path / "load.parquet"
    n = _file(f)
    t = pq.read_table(f)
    e = t.column("expert").to_numpy().copy()
    e[3000], e[3001] = e[3001], e[3000]
    tk = t.column("tokens").to_numpy().copy()
    tk[3000], tk[3001] = tk[3001], tk[3000]
    pq.write_table(t.set_column(2, "expert", pa.array(e)).set_column(3, "tokens", pa.array(tk)), f, row_group_size=700)
    st = tmp_path / "st"
    res = _ingest(runner, cli, f, "--store", st, "--run-id", "r")
    assert res.exit_code == 0, res.output
    assert _tables(st, "r") == ["expert_load", "runs"]
    assert not (st / ".staging").exists()
    got = _stored(st, "r")
    want = duckdb.connect().execute(f"SELECT step, layer, expert, tokens FROM read_parquet('{f}') "
                                    "ORDER BY step, layer, expert").fetchall()
    assert got.height == n and got.rows() == want

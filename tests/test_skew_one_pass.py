"""Which path `moetrace skew` takes: a run's dense rows stream through layer_skew in one
pass whatever their number, long rows are batched past ``frames.DIRECT_ROWS`` (start-up);
both paths give the rows of the plain view, and those rows are checked by hand."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.analyze import cache, frames, materialize
from moetrace.run import Store

from .helpers.dense_runs import _run, _stores


@pytest.fixture
def counts():
    rng = np.random.default_rng(7)
    return rng.integers(0, 50, size=(12, 3, 8)).astype(np.int64)     # steps x layers x experts


def _skew(st, tmp_path, name):
    out = tmp_path / f"{name}.parquet"
    frames.skew_to_parquet(st, "r", "step", out)
    return pl.read_parquet(out)


def test_dense_rows_take_one_pass_long_rows_are_batched(tmp_path, counts, monkeypatch):
    long_st, dense_st = _stores(tmp_path, counts, np.arange(12), np.arange(3), _run(8, 4, 3))
    assert cache.long_rows(dense_st, "r") == 0 and cache.long_rows(long_st, "r") == counts.size
    batched = []
    real = materialize.materialize_layer_skew
    monkeypatch.setattr(cache, "materialize_layer_skew",
                        lambda *a, **k: batched.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(frames, "DIRECT_ROWS", 10)      # far below either run's 288 expert_load rows
    dense_rows = _skew(dense_st, tmp_path, "dense")
    assert batched == []                                # dense: one pass, at any size
    long_rows = _skew(long_st, tmp_path, "long")
    assert batched == ["r"]                             # long rows past the limit: batched
    assert dense_rows.equals(long_rows)
    # by hand: 4 ranks of 2 contiguous experts each; imbalance = max / mean of the rank sums
    rank = counts.reshape(12, 3, 4, 2).sum(axis=3)
    want = (rank.max(axis=2) / rank.mean(axis=2)).reshape(-1)
    np.testing.assert_allclose(dense_rows.sort(["step", "layer"])["imbalance"].to_numpy(), want, rtol=1e-12)
    # and the plain view (no TEMP table) gives the same rows
    plain = Store(dense_st.path).sql("SELECT * EXCLUDE (assignments, num_ranks, placement_source, run_id) "
                                     "FROM layer_skew ORDER BY step, layer")
    assert plain.select(dense_rows.columns[1:]).equals(dense_rows.select(dense_rows.columns[1:]))

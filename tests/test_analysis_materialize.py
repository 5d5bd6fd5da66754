"""Batched materialization (moetrace.analyze.materialize_layer_skew) against the plain views.

The plain views are the contract (and are themselves checked against numpy in
test_analysis.py); computing them in step batches must not change a single value. Tiny
batch sizes force many batches, windows of skew_by_batch longer than a batch, a last
partial batch and gaps in the step numbers.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from moetrace.analyze import choose_batch_steps, drop_materialized, materialize_layer_skew
from moetrace.report.sections.experts import quantile_from_counts
from moetrace.run import Store

from .helpers import module_fixture
from .helpers.two_runs import KEYS as SORT_KEYS
from .helpers.two_runs import _assert_same

#: the views compared (their sort keys: tests/helpers/two_runs.py)
KEYS = ("layer_skew", "tokens_per_expert", "skew_by_batch", "skew_decomposition", "skew_summary", "run_skew_summary")


# the two runs (a recorded run with gaps and replicas, a dense synth run) and their plain
# views are built once per session (tests/helpers/two_runs.py, conftest's two_runs_template and
# two_runs_live): test_analysis_cache.py compares against the same ones
@module_fixture
def store(two_runs_template):
    path, rids = two_runs_template
    st = Store(path)     # this module's own connection: its TEMP tables are its own
    yield st, rids
    st.close()


@module_fixture
def plain_views(two_runs_live):
    """Each run's views computed from the plain (unmaterialized) views once, for every
    batch size below to be compared against (the store does not change between them)."""
    return {rid: {v: views[v] for v in KEYS} for rid, views in two_runs_live.items()}


@pytest.mark.parametrize("batch_steps", [1, 4, 16, None])
def test_batched_views_equal_the_plain_views(store, plain_views, batch_steps):
    st, rids = store
    for rid in rids:
        want = plain_views[rid]
        m = materialize_layer_skew(st, rid, batch_steps)
        try:
            if batch_steps:
                assert m.batch_steps == batch_steps and m.batches == -(-m.steps // batch_steps) > 1
            else:
                assert m.batches == 1               # tiny run: one batch
            temp = set(st.sql("SELECT table_name FROM duckdb_tables() WHERE temporary")["table_name"].to_list())
            assert temp == {"run_shape", "layer_placement", "dense_rank_map", "layer_skew", "tokens_per_expert", "skew_by_batch",
                            "skew_decomposition"}
            for v in KEYS:     # the summaries read the materialized layer_skew
                _assert_same(st.sql(f"SELECT * FROM {v}").sort(SORT_KEYS[v]), want[v], f"{rid} {v} batch={batch_steps}")
        finally:
            drop_materialized(st.con, m)
        assert st.sql("SELECT count(*) AS n FROM duckdb_tables() WHERE temporary")["n"][0] == 0
    # both runs visible again through the views
    assert st.sql("SELECT count(DISTINCT run_id) AS n FROM layer_skew")["n"][0] == 2


def test_the_fixture_exercises_what_batching_could_break(store):
    st, (rec, _) = store
    sources = set(st.sql("SELECT placement_source FROM layer_placement WHERE run_id = ?", [rec])
                  ["placement_source"].to_list())
    assert sources == {"recorded", "recorded+contiguous"}
    frac = st.sql("SELECT count(*) AS n FROM rank_load_sparse WHERE run_id = ? AND tokens <> floor(tokens)", [rec])
    assert frac["n"][0] > 0                                   # replicas split tokens
    assert st.sql("SELECT count(*) AS n FROM layer_skew WHERE run_id = ? AND imbalance IS NULL", [rec])["n"][0] == 1
    # windows of 32 steps exist (41 steps): longer than every tiny batch above
    assert st.sql("SELECT max(steps_per_batch) AS w FROM skew_by_batch WHERE run_id = ?", [rec])["w"][0] == 32


def test_only_layer_skew(store, two_runs_live):
    st, (rec, _) = store
    want = two_runs_live[rec]["skew_summary"]
    m = materialize_layer_skew(st, rec, 2, views=("layer_skew",))
    try:
        assert set(m.tables) == {"run_shape", "layer_placement", "dense_rank_map", "layer_skew"}
        _assert_same(st.sql("SELECT * FROM skew_summary").sort("layer"), want, "skew_summary")
    finally:
        drop_materialized(st.con, m)


def test_failure_leaves_no_shadowing_tables(store, monkeypatch):
    st, (rec, _) = store
    calls = []

    def boom(line):
        calls.append(line)
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        materialize_layer_skew(st, rec, 1, progress=boom)   # progress is called at the last batch at least
    assert calls
    assert st.sql("SELECT count(*) AS n FROM duckdb_tables() WHERE temporary")["n"][0] == 0


def test_choose_batch_steps():
    # 14,848 rows per step (58 layers x 256 experts), 8M rows per batch: 538 steps -> 512
    assert choose_batch_steps(14_848 * 72_000, 72_000, 8_000_000) == 512
    assert choose_batch_steps(1000, 37, 8_000_000) == 64          # fits: one batch
    assert choose_batch_steps(10 ** 9, 10, 8_000_000) == 1        # huge steps: one at a time


def test_quantile_from_counts_matches_numpy():
    rng = np.random.default_rng(3)
    x = rng.poisson(40, size=5001)
    vals, counts = np.unique(x, return_counts=True)
    for q in (0.0, 0.5, 0.9, 0.999, 1.0):
        assert quantile_from_counts(vals.astype(float), counts, q) == pytest.approx(np.quantile(x, q), abs=1e-9)
    assert quantile_from_counts(np.array([3.0]), np.array([1]), 0.999) == 3.0


def test_skew_cli_batched_equals_view_and_reports_progress(store, runner, cli):
    st, (rec, syn) = store
    want = st.sql("SELECT run_id, layer, steps, imbalance_mean, gini_mean, straggler_rank_mode FROM skew_summary "
                  "ORDER BY run_id, imbalance_mean DESC NULLS LAST")
    res = runner.invoke(cli, ["skew", str(st.path), "--batch-steps", "4", "--format", "json"])
    assert res.exit_code == 0, res.output
    got = pl.DataFrame(json.loads(res.stdout)).select(want.columns)
    assert got["run_id"].to_list() == want["run_id"].to_list() == [rec] * 2 + [syn] * 3
    assert got["layer"].to_list() == want["layer"].to_list()
    np.testing.assert_allclose(got["imbalance_mean"].to_numpy(), want["imbalance_mean"].to_numpy(), rtol=1e-12)
    assert "batch 11/11" in res.stderr and "batch 10/10" in res.stderr   # 41 and 37 steps in batches of 4
    one = runner.invoke(cli, ["skew", str(st.path), "--run", syn, "--by", "run", "--memory-limit", "1GB"])
    assert one.exit_code == 0 and syn in one.stdout and rec not in one.stdout and one.stderr == ""

"""Batched materialization (moetrace.analyze.materialize_layer_skew) against the plain views.

The plain views are the contract (and are themselves checked against numpy in
test_analysis.py); computing them in step batches must not change a single value. Tiny
batch sizes force many batches, windows of skew_by_batch longer than a batch, a last
partial batch and gaps in the step numbers.
"""
from __future__ import annotations

import json
import uuid

import numpy as np
import polars as pl
import pytest

from moetrace.analyze import choose_batch_steps, drop_materialized, materialize_layer_skew
from moetrace.report.sections.experts import quantile_from_counts
from moetrace.run import Store
from moetrace.produce.synth import SynthConfig, synth

KEYS = {"layer_skew": ["step", "layer"], "tokens_per_expert": ["step", "layer"],
        "skew_by_batch": ["layer", "steps_per_batch"], "skew_decomposition": ["layer"],
        "skew_summary": ["layer"], "run_skew_summary": ["run_id"]}


def _write_recorded_run(st: Store) -> str:
    """41 step numbers with gaps, 2 layers x 6 experts on 4 ranks, experts 0 and 4 replicated
    (fractional rank loads), layer 1 without placement for expert 5 (recorded+contiguous),
    one all-zero (step, layer)."""
    rng = np.random.default_rng(7)
    E, S, R = 6, 8, 4
    phy2log = [4, 1, 0, 2, 3, 0, 5, 4]
    pl1 = [0, 1, 2, 3, 4, 0, 1, 2]                          # layer 1: expert 5 has no slot
    placement = {"plan_id": ["recorded"] * 2 * S, "layer": [0] * S + [1] * S, "slot": list(range(S)) * 2,
                 "rank": [s // 2 for s in range(S)] * 2, "node": [0] * 2 * S, "expert": phy2log + pl1}
    steps = [s for s in range(50) if s not in (7, 20, 21, 22, 30, 31, 32, 33, 34)]
    rows = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for s in steps:
        for layer in (0, 1):
            x = rng.poisson([60, 5, 9, 30, 41, 3]) if not (s == 13 and layer == 0) else np.zeros(E, int)
            for e in range(E):
                if x[e] == 0 and e % 2:                      # some experts absent rather than 0
                    continue
                rows["step"].append(s)
                rows["layer"].append(layer)
                rows["expert"].append(e)
                rows["tokens"].append(int(x[e]))
                rows["slot"].append(None)
                rows["src_rank"].append(None)
    run = {"source": "t", "collector": "test", "time_base": "none", "source_sha256": uuid.uuid4().hex,
           "num_experts": E, "num_ranks": R, "num_slots": S, "top_k": 2,
           "approximations": json.dumps([])}
    return st.write_run(run, {"expert_load": rows, "placement": placement}, run_id="rec").run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("mat") / "st", create=True)
    rec = _write_recorded_run(st)
    syn = synth(st, SynthConfig(layers=3, experts=32, top_k=4, ranks=8, ranks_per_node=4, steps=37,
                                tokens_per_step=128, sigma=0.7, seed=5)).run_id
    return st, [rec, syn]


def _plain(st: Store, view: str, rid: str) -> pl.DataFrame:
    return st.sql(f"SELECT * FROM {view} WHERE run_id = ?", [rid]).sort(KEYS[view])


def _assert_same(got: pl.DataFrame, want: pl.DataFrame, what: str):
    assert got.columns == want.columns, what
    assert got.height == want.height, f"{what}: {got.height} rows, view has {want.height}"
    assert got.height > 0, what
    for c in want.columns:
        g, w = got[c], want[c]
        assert g.dtype == w.dtype, f"{what}.{c}: {g.dtype} vs {w.dtype}"
        assert g.null_count() == w.null_count() and (g.is_null() == w.is_null()).all(), f"{what}.{c} nulls"
        if w.dtype.is_float():
            # sums of fractional replica loads may be added in another order: last-bit differences only
            np.testing.assert_allclose(g.drop_nulls().to_numpy(), w.drop_nulls().to_numpy(), rtol=1e-12,
                                       atol=0, err_msg=f"{what}.{c}")
        else:
            assert g.to_list() == w.to_list(), f"{what}.{c}"


@pytest.fixture(scope="module")
def plain_views(store):
    """Each run's views computed from the plain (unmaterialized) views once, for every
    batch size below to be compared against (the store does not change between them)."""
    st, rids = store
    return {rid: {v: _plain(st, v, rid) for v in KEYS} for rid in rids}


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
                _assert_same(st.sql(f"SELECT * FROM {v}").sort(KEYS[v]), want[v], f"{rid} {v} batch={batch_steps}")
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


def test_only_layer_skew(store):
    st, (rec, _) = store
    want = _plain(st, "skew_summary", rec)
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

"""The dense layout (expert_counts) against the long one (expert_load rows): the same
counts written both ways give the same rows in every analysis view, the expert_load view
shows the dense rows as long rows, and read_counts returns the counts written. Numbers
are also checked against numpy by hand (imbalance, gini, rank sums)."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from moetrace.storage import dense
from moetrace.run import Store

VIEWS = {   # view -> sort keys
    "run_shape": ["run_id"],
    "layer_placement": ["layer"],
    "expert_tokens": ["step", "layer", "expert"],
    "expert_step_stats": ["step", "layer"],
    "rank_load_sparse": ["step", "layer", "rank"],
    "rank_load": ["step", "layer", "rank"],
    "layer_skew": ["step", "layer"],
    "tokens_per_expert": ["step", "layer"],
    "skew_summary": ["layer"],
    "run_skew_summary": ["run_id"],
    "skew_by_batch": ["layer", "steps_per_batch"],
    "skew_decomposition": ["layer"],
}


def _run(E, R, L, **kw):
    run = {"source": "t", "source_sha256": f"t-{np.random.default_rng().integers(1 << 60)}", "collector": "t",
           "time_base": "none", "num_layers": L, "num_experts": E, "num_ranks": R, "top_k": 2}
    run.update(kw)
    return run


def _long(counts, steps, layers):
    T, L, E = counts.shape
    return pa.table({"step": np.repeat(steps, L * E).astype(np.int64),
                     "layer": np.tile(np.repeat(layers, E), T).astype(np.int32),
                     "expert": np.tile(np.arange(E), T * L).astype(np.int32),
                     "slot": pa.nulls(T * L * E, pa.int32()), "src_rank": pa.nulls(T * L * E, pa.int32()),
                     "tokens": counts.reshape(-1).astype(np.int64)})


def _stores(tmp_path, counts, steps, layers, run, extra=None):
    long_st = Store(tmp_path / "long", create=True)
    long_st.write_run(dict(run), {"expert_load": _long(counts, steps, layers), **(extra or {})}, run_id="r")
    dense_st = Store(tmp_path / "dense", create=True)
    dense_st.write_run(dict(run), {"expert_counts": [dense.grid_table(steps, layers, counts)], **(extra or {})},
                       run_id="r")
    assert not dense_st.has_files("expert_load") and dense_st.has_files("expert_counts")
    return long_st, dense_st


def _same(a: pl.DataFrame, b: pl.DataFrame, what: str):
    assert a.columns == b.columns, what
    assert a.height == b.height, (what, a.height, b.height)
    for c in a.columns:
        x, y = a[c].to_list(), b[c].to_list()
        for i, (u, v) in enumerate(zip(x, y)):
            if isinstance(u, float) and isinstance(v, float):
                assert math.isclose(u, v, rel_tol=1e-12, abs_tol=1e-12) or (u != u and v != v), (what, c, i, u, v)
            elif isinstance(u, list):
                assert np.allclose(np.asarray(u, float), np.asarray(v, float), rtol=1e-12), (what, c, i)
            else:
                assert u == v, (what, c, i, u, v)


def _compare(long_st, dense_st):
    for v, keys in VIEWS.items():
        q = f"SELECT * FROM {v} ORDER BY {', '.join(keys)}"
        _same(long_st.sql(q), dense_st.sql(q), v)
    q = "SELECT * FROM expert_load ORDER BY step, layer, expert"
    _same(long_st.sql(q), dense_st.sql(q), "expert_load")


def _counts(T, L, E, seed=0, zero_step=None):
    rng = np.random.default_rng(seed)
    w = np.exp(0.8 * rng.standard_normal((L, E)))
    c = rng.poisson(40 * w / w.mean(axis=1, keepdims=True), size=(T, L, E)).astype(np.int64)
    c[:, :, 1] = 0                      # an expert that never gets tokens
    if zero_step is not None:
        c[zero_step] = 0                # a step with no tokens: ratios undefined
    return c


def test_contiguous_views_equal_and_match_numpy(tmp_path):
    T, L, E, R = 12, 3, 16, 4
    c = _counts(T, L, E, zero_step=5)
    steps, layers = np.arange(100, 100 + T), np.array([0, 2, 7])
    long_st, dense_st = _stores(tmp_path, c, steps, layers, _run(E, R, L))
    _compare(long_st, dense_st)
    # by hand: contiguous ranks (E/R experts each), imbalance = max / mean, gini of sorted counts
    ls = dense_st.sql("SELECT step, layer, imbalance, gini, straggler_rank FROM layer_skew ORDER BY step, layer")
    rank = c.reshape(T, L, R, E // R).sum(axis=3)
    with np.errstate(invalid="ignore", divide="ignore"):
        imb = rank.max(axis=2) / rank.mean(axis=2)
    xs = np.sort(c, axis=2)
    i = np.arange(1, E + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        gini = (2 * (xs * i).sum(axis=2)) / (E * xs.sum(axis=2)) - (E + 1) / E
    got = ls["imbalance"].to_numpy().reshape(T, L)
    assert np.allclose(got[~np.isnan(imb)], imb[~np.isnan(imb)])
    assert np.isnan(got[5]).all() or all(v is None for v in ls.filter(pl.col("step") == 105)["imbalance"])
    assert np.allclose(ls["gini"].to_numpy().reshape(T, L)[np.arange(T) != 5], gini[np.arange(T) != 5])
    strag = ls["straggler_rank"].to_numpy().reshape(T, L)
    assert (strag[np.arange(T) != 5] == rank.argmax(axis=2)[np.arange(T) != 5]).all()


def test_ranks_not_dividing_experts(tmp_path):
    T, L, E, R = 6, 2, 10, 3
    c = _counts(T, L, E, seed=1)
    long_st, dense_st = _stores(tmp_path, c, np.arange(T), np.arange(L), _run(E, R, L))
    _compare(long_st, dense_st)
    rl = dense_st.sql("SELECT step, layer, rank, tokens FROM rank_load_sparse ORDER BY step, layer, rank")
    owner = (np.arange(E) * R) // E
    want = np.stack([c[:, :, owner == r].sum(axis=2) for r in range(R)], axis=2)
    assert np.array_equal(rl["tokens"].to_numpy().reshape(T, L, R), want)


def test_recorded_placement_with_replicas_and_unplaced_experts(tmp_path):
    T, L, E, R = 8, 3, 8, 4
    c = _counts(T, L, E, seed=2)
    # layer 0: 12 slots, experts 0 and 3 replicated (3 copies of 0); layer 1: expert 5 missing;
    # layer 2: no recorded placement (contiguous)
    rows = {k: [] for k in ("plan_id", "layer", "slot", "rank", "node", "expert")}

    def add(layer, experts, spr):
        for s, e in enumerate(experts):
            for k, v in zip(rows, ("recorded", layer, s, s // spr, 0, e)):
                rows[k].append(v)
    add(0, [0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 0, 6], 3)
    add(1, [0, 1, 2, 3, 4, 6, 7, 7], 2)
    long_st, dense_st = _stores(tmp_path, c, np.arange(T), np.arange(L), _run(E, R, L, num_slots=12),
                                extra={"placement": pa.table(rows)})
    _compare(long_st, dense_st)
    rl = dense_st.sql("SELECT step, rank, tokens FROM rank_load_sparse WHERE layer = 0 ORDER BY step, rank")
    x = c[:, 0, :].astype(float)
    want = np.stack([x[:, 0] / 3 + x[:, 1] + x[:, 2],
                     x[:, 3] / 2 + x[:, 4] + x[:, 5],
                     x[:, 6] / 2 + x[:, 7] + x[:, 0] / 3,
                     x[:, 3] / 2 + x[:, 0] / 3 + x[:, 6] / 2], axis=1)
    assert np.allclose(rl["tokens"].to_numpy().reshape(T, R), want)
    src = dense_st.sql("SELECT layer, placement_source FROM layer_placement ORDER BY layer")["placement_source"]
    assert src.to_list() == ["recorded", "recorded+contiguous", "contiguous"]


def test_unknown_ranks(tmp_path):
    T, L, E = 4, 2, 8
    c = _counts(T, L, E, seed=3)
    long_st, dense_st = _stores(tmp_path, c, np.arange(T), np.arange(L), _run(E, None, L))
    _compare(long_st, dense_st)
    assert dense_st.sql("SELECT count(imbalance) AS n FROM layer_skew")["n"][0] == 0


def test_materialized_views_equal(tmp_path):
    from moetrace.analyze import HEAVY_VIEWS, materialize_layer_skew

    T, L, E, R = 20, 2, 16, 4
    c = _counts(T, L, E, seed=4)
    long_st, dense_st = _stores(tmp_path, c, np.arange(T), np.arange(L), _run(E, R, L))
    out = {}
    for name, st in (("long", long_st), ("dense", dense_st)):
        m = materialize_layer_skew(st, "r", batch_steps=4, views=HEAVY_VIEWS)
        out[name] = {v: st.sql(f"SELECT * FROM {v} ORDER BY ALL") for v in HEAVY_VIEWS}
        assert m.rows == T * L * E and m.steps == T
    for v in HEAVY_VIEWS:
        _same(out["long"][v], out["dense"][v], v)
    plain = long_st.connect()
    _same(pl.from_arrow(plain.sql("SELECT * FROM layer_skew ORDER BY ALL").to_arrow_table()),
          out["dense"]["layer_skew"], "layer_skew materialized vs plain view")


@pytest.mark.parametrize("layout", ["long", "dense"])
def test_read_counts(tmp_path, layout):
    T, L, E, R = 9, 3, 16, 4
    c = _counts(T, L, E, seed=5)
    steps, layers = np.arange(3, 3 + T) * 2, np.array([1, 4, 5])
    long_st, dense_st = _stores(tmp_path, c, steps, layers, _run(E, R, L))
    st = long_st if layout == "long" else dense_st
    s, la, x = dense.read_counts(st, "r")
    assert np.array_equal(s, steps) and np.array_equal(la, layers) and np.array_equal(x, c)
    s, _, x = dense.read_counts(st, "r", (10, 15))       # steps 10, 12, 14
    assert s.tolist() == [10, 12, 14] and np.array_equal(x, c[2:5])
    s, _, x = dense.read_counts(st, "r", np.array([6, 20, 999]))
    assert s.tolist() == [6, 20] and np.array_equal(x, c[[0, 7]])


@pytest.mark.parametrize("layout", ["long", "dense"])
def test_read_load_total_is_the_sum_by_hand(tmp_path, layout):
    """What a planner is fitted on: the window's counts summed per (layer, expert), read a
    few steps at a time, equal to numpy's sum of the counts written."""
    from moetrace.replay.load import RunShape, read_load_total

    T, L, E, R = 9, 3, 16, 4
    c = _counts(T, L, E, seed=8)
    steps, layers = np.arange(3, 3 + T) * 2, np.array([1, 4, 5])
    st = _stores(tmp_path, c, steps, layers, _run(E, R, L))[0 if layout == "long" else 1]
    shape = RunShape.from_store(st, "r")
    for window, sel in (((10, 19), [2, 3, 4, 5, 6]), (None, list(range(T))), ((100, 200), [])):
        ids, total = read_load_total(st, "r", shape, window, chunk_steps=3)
        assert ids.tolist() == steps[sel].tolist()
        assert total.dtype == np.float64 and total.shape == (L, E)
        assert np.array_equal(total, c[sel].sum(axis=0).astype(np.float64))


def test_dense_chunks_refuses_what_is_not_dense():
    T, L, E = 3, 2, 4
    c = _counts(T, L, E, seed=6)
    t = _long(c, np.arange(T), np.arange(L)).drop_columns(["slot", "src_rank"])
    # chunks cut anywhere (a (step, layer) split over two chunks) give the grid back
    chunks = [t.slice(0, 5), t.slice(5, 7), t.slice(12)]
    out = pa.concat_tables(list(dense.dense_chunks(chunks, E)))
    assert np.array_equal(np.asarray(out.column("tokens").to_pylist()), c.reshape(T * L, E))
    with pytest.raises(dense.NotDense):
        list(dense.dense_chunks([t.slice(1)], E))                      # a gap
    with pytest.raises(dense.NotDense):
        list(dense.dense_chunks([t.take(np.r_[4:8, 0:4, 8:24])], E))   # out of order


def test_shipped_sample_dense_equals_long(tmp_path):
    """The shipped DeepSeek-V3-shaped sample goes in dense; forced long, every view agrees."""
    from moetrace.collect import generic
    from moetrace.collect.checks import validate_run

    from .conftest import REPO

    path = REPO / "sample_traces" / "dsv3_synth_expert_load.parquet"
    stores = {}
    for layout in ("dense", "long"):
        opts = {"num_ranks": 32, "num_experts": 256, "top_k": 8, **({"layout": "long"} if layout == "long" else {})}
        rd = validate_run(generic._collect([path], opts)[0], opts)
        assert set(rd.tables) == {"expert_counts" if layout == "dense" else "expert_load"}
        st = stores[layout] = Store(tmp_path / layout, create=True)
        st.write_run({**rd.run, "collector": "generic"}, rd.tables, run_id="r")
    _compare(stores["long"], stores["dense"])
    assert stores["dense"].sql("SELECT count(*) AS n FROM expert_load")["n"][0] == 200 * 4 * 256


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_generic_ingest_dense_with_groups_across_batches(tmp_path, monkeypatch, suffix):
    """The generic collector's second pass (Parquet: step, layer and tokens only, no second
    check) rebuilds the same counts when (step, layer) groups straddle its batches."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from moetrace.collect import generic, ingest

    T, L, E = 7, 3, 10
    counts = np.random.default_rng(5).poisson(4.0, size=(T, L, E)).astype(np.int64)
    t = pa.table({"step": np.repeat(np.arange(100, 100 + T), L * E), "layer": np.tile(np.repeat(np.arange(L), E), T),
                  "expert": np.tile(np.arange(E), T * L), "tokens": counts.reshape(-1)})
    f = tmp_path / f"load.{suffix}"
    pq.write_table(t, f) if suffix == "parquet" else pacsv.write_csv(t, f)
    monkeypatch.setattr(generic, "BATCH_ROWS", 13)      # 13 rows: groups of 10 straddle batches
    st = Store(tmp_path / "st", create=True)
    (res,) = ingest(st, [f], options={"num_ranks": 2}, run_id="r")
    assert res.rows.get("expert_counts") == T * L            # stored densely
    steps, layers, got = dense.read_counts(st, "r")
    assert steps.tolist() == list(range(100, 100 + T)) and layers.tolist() == list(range(L))
    assert np.array_equal(got, counts)
    desc = np.array(st.sql("SELECT tokens_desc FROM expert_counts ORDER BY step, layer")["tokens_desc"].to_list())
    assert np.array_equal(desc, -np.sort(-counts.reshape(T * L, E), axis=1))

"""The dense layout (expert_counts) against the long one (expert_load rows): the same
counts written both ways give the same rows in every analysis view, the expert_load view
shows the dense rows as long rows, and read_counts returns the counts written. Numbers
are also checked against numpy by hand (imbalance, gini, rank sums)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from moetrace.run import Store
from moetrace.storage import dense

from .helpers import module_fixture
from .helpers.dense_runs import _long, _run, _stores

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


def _same_slow(a: pl.DataFrame, b: pl.DataFrame, what: str, c: str):
    x, y = a[c].to_list(), b[c].to_list()
    for i, (u, v) in enumerate(zip(x, y)):
        if isinstance(u, float) and isinstance(v, float):
            assert math.isclose(u, v, rel_tol=1e-12, abs_tol=1e-12) or (u != u and v != v), (what, c, i, u, v)
        elif isinstance(u, list):
            assert np.allclose(np.asarray(u, float), np.asarray(v, float), rtol=1e-12), (what, c, i)
        else:
            assert u == v, (what, c, i, u, v)


def _same(a: pl.DataFrame, b: pl.DataFrame, what: str):
    """Every value equal; floats to 1e-12 (math.isclose, NaN equals NaN), list values
    np.allclose. Float and plain columns are compared vectorized (the shipped sample's
    views are 200k rows); a mismatch, a list column or differing types go value by value
    (the message names the first bad row)."""
    assert a.columns == b.columns, what
    assert a.height == b.height, (what, a.height, b.height)
    for c in a.columns:
        x, y = a[c], b[c]
        if x.dtype != y.dtype or isinstance(x.dtype, (pl.List, pl.Array, pl.Struct, pl.Object)):
            _same_slow(a, b, what, c)
        elif x.dtype.is_float():
            if not (x.is_null() == y.is_null()).all():
                _same_slow(a, b, what, c)
                continue
            u, v = x.drop_nulls().to_numpy(), y.drop_nulls().to_numpy()
            with np.errstate(invalid="ignore"):
                close = np.abs(u - v) <= np.maximum(1e-12 * np.maximum(np.abs(u), np.abs(v)), 1e-12)
                ok = (u == v) | (np.isfinite(u) & np.isfinite(v) & close) | (np.isnan(u) & np.isnan(v))
            if not ok.all():
                _same_slow(a, b, what, c)
        elif x.to_list() != y.to_list():
            _same_slow(a, b, what, c)


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


def _placement_rows() -> dict:
    """The "placed" run's recorded placement: layer 0: 12 slots, experts 0 and 3 replicated
    (3 copies of 0); layer 1: expert 5 missing; layer 2: none (contiguous)."""
    rows = {k: [] for k in ("plan_id", "layer", "slot", "rank", "node", "expert")}

    def add(layer, experts, spr):
        for s, e in enumerate(experts):
            for k, v in zip(rows, ("recorded", layer, s, s // spr, 0, e)):
                rows[k].append(v)
    add(0, [0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 0, 6], 3)
    add(1, [0, 1, 2, 3, 4, 6, 7, 7], 2)
    return rows


#: the runs of the module's two stores (``pair``): run id -> (T, L, E, R, counts seed,
#: step numbers, layer numbers, run fields, zero step)
CASES = {
    "contig": (12, 3, 16, 4, 0, np.arange(100, 112), np.array([0, 2, 7]), {}, 5),
    "ranks3": (6, 2, 10, 3, 1, np.arange(6), np.arange(2), {}, None),
    "placed": (8, 3, 8, 4, 2, np.arange(8), np.arange(3), {"num_slots": 12}, None),
    "unknown": (4, 2, 8, None, 3, np.arange(4), np.arange(2), {}, None),
    "mat": (20, 2, 16, 4, 4, np.arange(20), np.arange(2), {}, None),
}
SAMPLE_OPTS = {"num_ranks": 32, "num_experts": 256, "top_k": 8}


@module_fixture
def pair(tmp_path_factory):
    """One long store and one dense store holding the same runs (:data:`CASES`, each
    test's counts written both ways, and the shipped sample as run "sample", ingested
    dense and forced long), and every view of :data:`VIEWS` and expert_load of both read
    once: the views' query plans, not the rows, are what costs, so each test compares
    its own run's rows of the same reads instead of querying two stores of its own."""
    from moetrace.collect import generic
    from moetrace.collect.checks import validate_run

    from .helpers import REPO

    root = tmp_path_factory.mktemp("dense-pair")
    long_st, dense_st = Store(root / "long", create=True), Store(root / "dense", create=True)
    counts = {}
    for rid, (T, L, E, R, seed, steps, layers, kw, zero) in CASES.items():
        c = counts[rid] = _counts(T, L, E, seed=seed, zero_step=zero)
        extra = {"placement": pa.table(_placement_rows())} if rid == "placed" else {}
        run = _run(E, R, L, **kw)
        long_st.write_run(dict(run), {"expert_load": _long(c, steps, layers), **extra}, run_id=rid)
        dense_st.write_run(dict(run), {"expert_counts": [dense.grid_table(steps, layers, c)], **extra}, run_id=rid)
    assert not dense_st.has_files("expert_load") and dense_st.has_files("expert_counts")
    # the shipped DeepSeek-V3-shaped sample: dense by default, long when forced
    sample = REPO / "sample_traces" / "dsv3_synth_expert_load.parquet"
    sample_tables = {}
    for layout, st in (("dense", dense_st), ("long", long_st)):
        opts = {**SAMPLE_OPTS, **({"layout": "long"} if layout == "long" else {})}
        rd = validate_run(generic._collect([sample], opts)[0], opts)
        sample_tables[layout] = set(rd.tables)
        st.write_run({**rd.run, "collector": "generic"}, rd.tables, run_id="sample")
    reads = {}
    for name, st in (("long", long_st), ("dense", dense_st)):
        reads[name] = {v: st.sql(f"SELECT * FROM {v} ORDER BY run_id, {', '.join(keys)}")
                       for v, keys in {**VIEWS, "expert_load": ["step", "layer", "expert"]}.items()}
    yield SimpleNamespace(long_st=long_st, dense_st=dense_st, long=reads["long"], dense=reads["dense"],
                          counts=counts, sample_tables=sample_tables)
    long_st.close()
    dense_st.close()


def _of(df: pl.DataFrame, rid: str) -> pl.DataFrame:
    return df.filter(pl.col("run_id") == rid)


def _compare_run(pair, rid: str):
    """Every view (and expert_load) of run ``rid``: the long store's rows == the dense store's."""
    for v in (*VIEWS, "expert_load"):
        _same(_of(pair.long[v], rid), _of(pair.dense[v], rid), f"{rid}: {v}")


def test_contiguous_views_equal_and_match_numpy(pair):
    T, L, E, R = 12, 3, 16, 4
    c = pair.counts["contig"]
    _compare_run(pair, "contig")
    # by hand: contiguous ranks (E/R experts each), imbalance = max / mean, gini of sorted counts
    ls = _of(pair.dense["layer_skew"], "contig").select("step", "layer", "imbalance", "gini", "straggler_rank")
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


def test_ranks_not_dividing_experts(pair):
    T, L, E, R = 6, 2, 10, 3
    c = pair.counts["ranks3"]
    _compare_run(pair, "ranks3")
    rl = _of(pair.dense["rank_load_sparse"], "ranks3").select("step", "layer", "rank", "tokens")
    owner = (np.arange(E) * R) // E
    want = np.stack([c[:, :, owner == r].sum(axis=2) for r in range(R)], axis=2)
    assert np.array_equal(rl["tokens"].to_numpy().reshape(T, L, R), want)


def test_recorded_placement_with_replicas_and_unplaced_experts(pair):
    T, R = 8, 4           # L, E = 3, 8
    c = pair.counts["placed"]
    # layer 0: 12 slots, experts 0 and 3 replicated (3 copies of 0); layer 1: expert 5 missing;
    # layer 2: no recorded placement (contiguous): _placement_rows
    _compare_run(pair, "placed")
    rl = _of(pair.dense["rank_load_sparse"], "placed").filter(pl.col("layer") == 0).select("step", "rank", "tokens")
    x = c[:, 0, :].astype(float)
    want = np.stack([x[:, 0] / 3 + x[:, 1] + x[:, 2],
                     x[:, 3] / 2 + x[:, 4] + x[:, 5],
                     x[:, 6] / 2 + x[:, 7] + x[:, 0] / 3,
                     x[:, 3] / 2 + x[:, 0] / 3 + x[:, 6] / 2], axis=1)
    assert np.allclose(rl["tokens"].to_numpy().reshape(T, R), want)
    src = _of(pair.dense["layer_placement"], "placed")["placement_source"]
    assert src.to_list() == ["recorded", "recorded+contiguous", "contiguous"]


def test_unknown_ranks(pair):
    _compare_run(pair, "unknown")
    ls = _of(pair.dense["layer_skew"], "unknown")
    assert ls.height == 4 * 2 and ls["imbalance"].drop_nulls().len() == 0     # count(imbalance) = 0


def test_materialized_views_equal(pair):
    from moetrace.analyze import HEAVY_VIEWS, drop_materialized, materialize_layer_skew

    T, L, E = 20, 2, 16       # R = 4
    out = {}
    for name, st in (("long", pair.long_st), ("dense", pair.dense_st)):
        m = materialize_layer_skew(st, "mat", batch_steps=4, views=HEAVY_VIEWS)
        try:
            out[name] = {v: st.sql(f"SELECT * FROM {v} ORDER BY ALL") for v in HEAVY_VIEWS}
        finally:
            drop_materialized(st.con, m)
        assert m.rows == T * L * E and m.steps == T
    for v in HEAVY_VIEWS:
        _same(out["long"][v], out["dense"][v], v)
    # the plain view of the long store (read by the fixture before anything was materialized)
    _same(_of(pair.long["layer_skew"], "mat"), out["dense"]["layer_skew"], "layer_skew materialized vs plain view")


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
    from moetrace.replay.load import read_load_total, read_shape

    T, L, E, R = 9, 3, 16, 4
    c = _counts(T, L, E, seed=8)
    steps, layers = np.arange(3, 3 + T) * 2, np.array([1, 4, 5])
    st = _stores(tmp_path, c, steps, layers, _run(E, R, L))[0 if layout == "long" else 1]
    shape = read_shape(st, "r")
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


def test_shipped_sample_dense_equals_long(pair):
    """The shipped DeepSeek-V3-shaped sample goes in dense; forced long, every view agrees
    (the ``pair`` fixture ingests it both ways as run "sample")."""
    assert pair.sample_tables == {"dense": {"expert_counts"}, "long": {"expert_load"}}
    _compare_run(pair, "sample")
    assert _of(pair.dense["expert_load"], "sample").height == 200 * 4 * 256


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_generic_ingest_dense_with_groups_across_batches(tmp_path, monkeypatch, suffix):
    """The generic collector's second pass (Parquet: step, layer and tokens only, no second
    check) rebuilds the same counts when (step, layer) groups straddle its batches."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from moetrace.collect import _generic_read, ingest

    T, L, E = 7, 3, 10
    counts = np.random.default_rng(5).poisson(4.0, size=(T, L, E)).astype(np.int64)
    t = pa.table({"step": np.repeat(np.arange(100, 100 + T), L * E), "layer": np.tile(np.repeat(np.arange(L), E), T),
                  "expert": np.tile(np.arange(E), T * L), "tokens": counts.reshape(-1)})
    f = tmp_path / f"load.{suffix}"
    pq.write_table(t, f) if suffix == "parquet" else pacsv.write_csv(t, f)
    monkeypatch.setattr(_generic_read, "BATCH_ROWS", 13)      # 13 rows: groups of 10 straddle batches
    st = Store(tmp_path / "st", create=True)
    (res,) = ingest(st, [f], options={"num_ranks": 2}, run_id="r")
    assert res.rows.get("expert_counts") == T * L            # stored densely
    steps, layers, got = dense.read_counts(st, "r")
    assert steps.tolist() == list(range(100, 100 + T)) and layers.tolist() == list(range(L))
    assert np.array_equal(got, counts)
    desc = np.array(st.sql("SELECT tokens_desc FROM expert_counts ORDER BY step, layer")["tokens_desc"].to_list())
    assert np.array_equal(desc, -np.sort(-counts.reshape(T * L, E), axis=1))

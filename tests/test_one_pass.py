"""The stored analysis computed in one pass over each step batch (analyze/one_pass.py).

materialize_layer_skew reads a batch of the run's expert_counts once and takes every
per-(step, layer) statistic, the rank windows of skew_by_batch and the whole-run
distributions (token histogram, per-expert bins) from it. Every view it stores must equal
the plain SQL views row for row (floats to the last bits of a sum's order) on the shipped
DeepSeek-V3-shaped sample in both layouts and on a dense run whose lists have more than
one length; and no statement may read expert_counts a second time in a batch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from moetrace.analyze import drop_materialized, materialize_layer_skew
from moetrace.analyze.materialize import ALL_VIEWS
from moetrace.analyze.one_pass import DenseExperts, rank_windows
from moetrace.run import Store

from .helpers import module_fixture
from .helpers.two_runs import KEYS, _assert_same

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "dsv3_synth_expert_load.parquet"
SAMPLE_OPTS = {"num_ranks": 32, "num_experts": 256, "top_k": 8}


@module_fixture
def sample_stores(tmp_path_factory):
    """The shipped sample ingested dense (the default) and long: {layout: store path}."""
    from moetrace.collect import generic
    from moetrace.collect.checks import validate_run

    root = tmp_path_factory.mktemp("one_pass")
    out = {}
    for layout in ("dense", "long"):
        opts = {**SAMPLE_OPTS, **({"layout": "long"} if layout == "long" else {})}
        rd = validate_run(generic._collect([SAMPLE], opts)[0], opts)
        st = Store(root / layout, create=True)
        st.write_run({**rd.run, "collector": "generic"}, rd.tables, run_id="sample")
        assert st.has_files("expert_counts") == (layout == "dense")
        st.close()
        out[layout] = root / layout
    return out


def _plain(path, rid: str) -> dict:
    st = Store(path)           # a fresh connection: no TEMP table shadows a view
    try:
        return {v: st.sql(f"SELECT * FROM {v} WHERE run_id = ?", [rid]).sort(KEYS[v]) for v in ALL_VIEWS}
    finally:
        st.close()


def _compare(path, rid: str, batch_steps) -> int:
    want = _plain(path, rid)
    st = Store(path)
    try:
        m = materialize_layer_skew(st, rid, batch_steps, views=ALL_VIEWS)
        try:
            for v in ALL_VIEWS:
                _assert_same(st.sql(f"SELECT * FROM {v}").sort(KEYS[v]), want[v], f"{path.name} {v} batch={batch_steps}")
        finally:
            drop_materialized(st.con, m)
        return m.batches
    finally:
        st.close()


@pytest.mark.parametrize("layout", ["dense", "long"])
@pytest.mark.parametrize("batch_steps", [8, None])
def test_one_pass_equals_the_views_on_the_sample(sample_stores, layout, batch_steps):
    batches = _compare(sample_stores[layout], "sample", batch_steps)
    assert batches > 1 if batch_steps else batches == 1


def test_one_pass_with_lists_of_two_lengths(tmp_path):
    """Dense lists shorter than num_experts in some steps: the per-(row, expert) path."""
    from moetrace.storage.dense import grid_table

    from .helpers import run_row

    rng = np.random.default_rng(3)
    a = grid_table(np.arange(0, 5), np.arange(2), rng.poisson(20, size=(5, 2, 8)).astype(np.int64))
    b = grid_table(np.arange(5, 9), np.arange(2), rng.poisson(20, size=(4, 2, 6)).astype(np.int64))
    st = Store(tmp_path / "st", create=True)
    st.write_run(run_row(source="t", num_experts=8, num_ranks=4, top_k=2), {"expert_counts": [a, b]}, run_id="r")
    st.close()
    _compare(tmp_path / "st", "r", 4)
    _compare(tmp_path / "st", "r", None)


def test_each_batch_reads_expert_counts_once(sample_stores):
    """The batch's dense rows come from the store once: one statement per batch names the
    stored expert_counts, and none unnests it again (expert_tokens, rank_load_sparse)."""
    st = Store(sample_stores["dense"])
    seen: list[str] = []
    raw = st.con

    class Spy:
        def __getattr__(self, name):
            return getattr(raw, name)

        def execute(self, sql, *args):
            seen.append(sql)
            return raw.execute(sql, *args)

        def sql(self, sql, *args, **kw):
            seen.append(sql)
            return raw.sql(sql, *args, **kw)

    try:
        m = materialize_layer_skew(st, "sample", 4, views=ALL_VIEWS, con=Spy())
        drop_materialized(raw, m)
    finally:
        st.close()
    assert m.batches > 2
    in_loop = [s for s in seen if "main.expert_counts " in s]   # the stored table, not the batch's TEMP copy
    assert len(in_loop) == m.batches, in_loop
    assert not [s for s in seen if "expert_tokens " in s or "rank_load_sparse" in s]


def test_dense_experts_by_hand():
    """Two lists of a layer in one bin, one of another length in the next bin."""
    d = DenseExperts()
    hist = d.add(pa.table({"layer": pa.array([3, 3, 3], pa.int32()), "bin": pa.array([0, 0, 1], pa.int64()),
                           "tokens": pa.array([[1, 0, 2], [1, 5, 0], [7, 1]], pa.list_(pa.int64()))}))
    got = sorted(zip(*(hist.column(c).to_pylist() for c in ("layer", "tokens", "pairs"))))
    assert got == [(3, 0, 2), (3, 1, 3), (3, 2, 1), (3, 5, 1), (3, 7, 1)]
    rows = d.bin_rows({3: 4})
    got = sorted(zip(*(rows.column(c).to_pylist() for c in ("bin", "expert", "tokens", "bins", "steps"))))
    assert got == [(0, 0, 2, 4, 4), (0, 1, 5, 4, 4), (0, 2, 2, 4, 4), (1, 0, 7, 4, 4), (1, 1, 1, 4, 4)]


def test_rank_windows_by_hand():
    """Three steps of one layer on 2 ranks (rank 1 absent in step 1), n = 3: windows of 1
    and 2 steps, the rank totals and the suffix buckets k = ceil(log2(3 - ord))."""
    rows = pa.table({"layer": pa.array([0, 0, 0], pa.int32()), "ord": pa.array([0, 1, 2], pa.int64()),
                     "ranks": pa.array([[0, 1], [0], [0, 1]], pa.list_(pa.int64())),
                     "tokens": pa.array([[1.0, 3.0], [2.0], [0.5, 0.25]], pa.list_(pa.float64()))})
    win, tot, suf = rank_windows(rows, 3, 0, 3, 2, 0)
    w = sorted(zip(*(win.column(c).to_pylist() for c in ("w", "batch", "mx", "total"))))
    assert w == [(1, 0, 3.0, 4.0), (1, 1, 2.0, 2.0), (1, 2, 0.5, 0.75), (2, 0, 3.0, 6.0)]
    assert sorted(zip(tot.column("rank").to_pylist(), tot.column("tokens").to_pylist())) == [(0, 3.5), (1, 3.25)]
    s = sorted(zip(*(suf.column(c).to_pylist() for c in ("k", "rank", "tokens"))))
    # ord 0: k = 2; ord 1: k = 1; ord 2: k = 0
    assert s == [(0, 0, 0.5), (0, 1, 0.25), (1, 0, 2.0), (2, 0, 1.0), (2, 1, 3.0)]

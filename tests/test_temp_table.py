"""Store.con.temp_table: a view's rows of one run as a TEMP table, the views it reads
inlined as CTEs instead of created (a command's start-up), and the connection still
answering every view the same once the TEMP table is dropped."""
from __future__ import annotations

import pyarrow as pa

from moetrace.analyze.materialize import drop_materialized, materialize_one_pass
from moetrace.storage.store import Store

from .helpers import run_row

RUN = run_row(source="unit", source_sha256="a" * 64, num_layers=1, num_experts=4, top_k=1, num_ranks=2,
              ranks_per_node=2)


def _store(tmp_path):
    st = Store(tmp_path / "s", create=True)
    for rid, toks in (("r", [6, 2, 1, 1]), ("q", [1, 1, 1, 1])):
        st.write_run(dict(RUN, source_sha256=rid * 64), {"expert_load": pa.table({
            "step": [0, 0, 0, 0], "layer": [0, 0, 0, 0], "expert": [0, 1, 2, 3],
            "slot": pa.nulls(4, pa.int32()), "src_rank": pa.nulls(4, pa.int32()), "tokens": toks})}, run_id=rid)
    return st


def _views(con):
    return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


def test_temp_table_equals_the_view_and_creates_no_view(tmp_path):
    st = _store(tmp_path)
    m = materialize_one_pass(st, "r", ("run_shape", "layer_placement", "layer_skew"))
    # rank 0 holds experts 0-1 (8 tokens), rank 1 experts 2-3 (2): max / mean = 8 / 5
    assert st.con.raw.execute("SELECT run_id, imbalance FROM temp.layer_skew").fetchall() == [("r", 1.6)]
    assert not {"layer_skew", "dense_step_stats", "layer_placement"} & _views(st.con.raw)   # inlined, not created
    # a view over the TEMP table (defined while it stands in for layer_skew)
    assert st.con.execute("SELECT imbalance_mean FROM skew_summary").fetchall() == [(1.6,)]
    drop_materialized(st.con, m)
    # dropped: the views of both runs again, layer_skew now created, skew_summary over it
    assert sorted(st.con.execute("SELECT run_id, imbalance FROM layer_skew").fetchall()) == [("q", 1.0), ("r", 1.6)]
    assert sorted(st.con.execute("SELECT run_id, imbalance_mean FROM skew_summary").fetchall()) == \
        [("q", 1.0), ("r", 1.6)]
    assert "layer_skew" in _views(st.con.raw)
    st.close()


def test_temp_table_of_a_defined_view_reads_the_view(tmp_path):
    st = _store(tmp_path)
    assert len(st.con.execute("SELECT * FROM layer_skew").fetchall()) == 2      # the view is defined
    st.con.temp_table("layer_skew", "run_id = ?", ["q"])
    st.con.temp_table("layer_skew", "run_id = ?", ["r"])                        # replaced, from the view
    assert st.con.execute("SELECT run_id FROM layer_skew").fetchall() == [("r",)]
    drop_materialized(st.con, ["layer_skew"])
    assert len(st.con.execute("SELECT * FROM layer_skew").fetchall()) == 2
    st.close()

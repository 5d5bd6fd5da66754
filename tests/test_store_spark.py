"""The store is read as it is by a distributed engine: Spark reads the hive-partitioned
Parquet folders (no export, no conversion) and a portable SQL statement of rank-load
imbalance gives the same numbers as moetrace's DuckDB ``layer_skew`` view.

Needs pyspark (``pip install 'moetrace[spark]'``) and a Java runtime; skipped otherwise.
Runs on the session the whole test run shares (conftest ``spark_session``)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from moetrace.run import Store

from .helpers import run_row

pytestmark = pytest.mark.slow

# what docs/how-to/spark-trino-dask.md shows: rank load from the recorded placement (an expert's tokens split
# evenly over its copies), then max / mean over num_ranks per (step, layer)
PORTABLE_IMBALANCE = """
WITH copies AS (
  SELECT run_id, layer, expert, rank, COUNT(*) OVER (PARTITION BY run_id, layer, expert) AS n
  FROM placement WHERE plan_id = 'recorded'
), rank_load AS (
  SELECT e.run_id, e.step, e.layer, c.rank, SUM(CAST(e.tokens AS DOUBLE) / c.n) AS tokens
  FROM expert_load e
  JOIN copies c ON c.run_id = e.run_id AND c.layer = e.layer AND c.expert = e.expert
  GROUP BY e.run_id, e.step, e.layer, c.rank
)
SELECT r.run_id, r.step, r.layer, MAX(r.tokens) / (SUM(r.tokens) / MAX(s.num_ranks)) AS imbalance
FROM rank_load r JOIN runs s ON s.run_id = r.run_id
GROUP BY r.run_id, r.step, r.layer
"""

def _store(path, rng):
    """Two runs with hand-made loads; run 'b' replicates its two hottest experts."""
    st = Store(path, create=True)
    E, R, L, T = 8, 4, 2, 5
    for rid, extra in (("a", 0), ("007", 2)):  # '007' stays a string run id, not the number 7
        tokens = rng.integers(0, 50, size=(T, L, E))
        load = pa.table({"step": np.repeat(np.arange(T), L * E), "layer": np.tile(np.repeat(np.arange(L), E), T),
                         "expert": np.tile(np.arange(E), T * L), "slot": pa.nulls(T * L * E, pa.int32()),
                         "src_rank": pa.nulls(T * L * E, pa.int32()), "tokens": tokens.ravel()})
        S = E + extra
        rows = []
        for layer in range(L):
            hot = list(np.argsort(-tokens[:, layer].sum(0), kind="stable")[:extra])
            for s, e in enumerate(list(range(E)) + hot):
                rows.append({"plan_id": "recorded", "layer": layer, "slot": s, "rank": s * R // S, "node": 0,
                             "expert": int(e)})
        run = run_row(source=rid, source_sha256=rid, num_layers=L, num_experts=E, top_k=2, num_ranks=R,
                      ranks_per_node=R, num_slots=S)
        st.write_run(run, {"expert_load": load, "placement": pa.Table.from_pylist(rows)}, run_id=rid)
    return st


def test_spark_reads_the_store_as_is_and_agrees_with_layer_skew(tmp_path, spark_session):
    st = _store(tmp_path / "store", np.random.default_rng(7))
    spark = spark_session           # the run's one session (conftest); plain reads, no moetrace code
    store = tmp_path / "store"
    from moetrace.storage.spark import forget_registration

    forget_registration()           # the views below replace a registered store's
    for t in ("expert_load", "placement", "runs"):
        spark.read.parquet(str(store / t)).createOrReplaceTempView(t)
    rows = spark.sql(PORTABLE_IMBALANCE).orderBy("run_id", "step", "layer").collect()
    types = {f.name: f.dataType.simpleString() for f in spark.table("expert_load").schema.fields}
    doc = {"types": types, "rows": [[r.run_id, r.step, r.layer, r.imbalance] for r in rows]}
    assert doc["types"] == {"step": "bigint", "layer": "int", "expert": "int", "slot": "int", "src_rank": "int",
                            "tokens": "bigint", "run_id": "string"}
    spark_rows = {(r[0], r[1], r[2]): r[3] for r in doc["rows"]}
    duck = st.sql("SELECT run_id, step, layer, imbalance FROM layer_skew")
    want = {(r[0], r[1], r[2]): r[3] for r in duck.rows()}
    assert set(spark_rows) == set(want) and len(want) == 2 * 5 * 2
    for k in want:
        assert spark_rows[k] == pytest.approx(want[k], rel=1e-12), k

"""The stored analysis computed by another SQL engine (``--engine spark``).

The cached views (:data:`moetrace.analyze.materialize.ALL_VIEWS`) are the SQL contract:
Spark runs the same view SQL, transpiled (moetrace/storage/spark.py), over the store's
files, where a fleet-week's rows live. :func:`compute_with` asks the engine for each view's
rows of one run (one query per view; Spark plans and distributes it), casts them to the
DuckDB view's column types and leaves them as TEMP tables named like the views on the
store's connection, as :func:`~moetrace.analyze.materialize.materialize_layer_skew` does,
so that :mod:`moetrace.analyze.cache` stores them under the same key and the report reads
them the same way.
"""
from __future__ import annotations

import time
from typing import Callable

from .materialize import Materialized, _drop, _main


def compute_with(sql: Callable) -> Callable:
    """A ``compute(store, run_id, views, con)`` for :func:`moetrace.analyze.cache.use` and
    :func:`~moetrace.analyze.cache.store_run`: the views' rows from ``sql(query, params)``
    (a polars DataFrame, as :class:`moetrace.storage.spark.SparkSQL` returns)."""

    def compute(store, run_id: str, views, con=None) -> Materialized:
        con = store.con if con is None else con
        db = _main(con)
        t0 = time.perf_counter()
        m = Materialized(run_id=run_id, batches=1)
        try:
            for v in views:
                cols = con.execute(f'DESCRIBE SELECT * FROM {db}."{v}"').fetchall()
                got = sql(f'SELECT * FROM {v} WHERE run_id = ?', [run_id]).to_arrow()
                if got.column_names != [c[0] for c in cols]:
                    raise ValueError(f"{v}: the engine returned columns {got.column_names}, "
                                     f"the view has {[c[0] for c in cols]}")
                casts = ", ".join(f'CAST("{c[0]}" AS {c[1]}) AS "{c[0]}"' for c in cols)
                con.register("_mt_engine_rows", got)
                try:
                    con.execute(f'CREATE OR REPLACE TEMP TABLE "{v}" AS SELECT {casts} FROM _mt_engine_rows')
                finally:
                    con.unregister("_mt_engine_rows")
                m.tables.append(v)
            if "layer_skew" in m.tables:
                m.steps = m.batch_steps = int(con.execute(
                    'SELECT count(DISTINCT step) FROM temp."layer_skew"').fetchall()[0][0])
        except BaseException:
            _drop(con, m.tables)
            raise
        m.seconds = time.perf_counter() - t0
        return m

    return compute

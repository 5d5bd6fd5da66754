"""Per-run frames read from the metric views: skew, tokens per expert, dummy steps.

Thin readers behind :class:`moetrace.run.Run` (documented there): each selects one run
from a view of ``sql/``; no metric is computed here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:   # polars is imported by the frame readers: skew_rows needs none (start-up)
    import polars as pl

    from ..output import Rows

#: a run with fewer expert_load rows than this is read straight from the views (one pass),
#: not materialized in step batches first (analyze.cache.use, ``direct_below``)
DIRECT_ROWS = 1 << 20

_SKEW_SQL = {
    "run": ("SELECT run_id, layers, steps, imbalance_mean, imbalance_p50, imbalance_p99, balancedness, "
            "worst_layer, worst_layer_imbalance, placement_source FROM run_skew_summary WHERE run_id = ? "
            "ORDER BY run_id"),
    "layer": ("SELECT run_id, layer, steps, steps_undefined, steps_no_ranks, imbalance_mean, imbalance_p50, imbalance_p99, "
              "efficiency_mean, gini_mean, top5pct_share_mean, hottest_expert_mode, straggler_rank_mode, "
              "placement_source FROM skew_summary WHERE run_id = ? ORDER BY run_id, imbalance_mean DESC NULLS LAST"),
    "step": ("SELECT run_id, step, layer, max_rank_tokens, mean_rank_tokens, imbalance, efficiency, straggler_rank, "
             "gini, cv, top5pct_share, hottest_expert, hottest_share, note FROM layer_skew WHERE run_id = ? "
             "ORDER BY run_id, step, layer"),
}


def skew(store, run_id: str, by: str = "layer", *, batch_steps: int | None = None, memory_limit: str | None = None,
         progress=None) -> pl.DataFrame:
    """See :meth:`moetrace.run.Run.skew`. ``layer_skew`` of the run is read from its stored
    analysis when that is fresh (:mod:`moetrace.analyze.cache`), else materialized once in
    step batches (bounded memory on fleet-size runs), read, and dropped."""
    return _skew(store, run_id, by, store.sql, batch_steps=batch_steps, memory_limit=memory_limit,
                 progress=progress)


def skew_rows(store, run_id: str, by: str = "layer", *, batch_steps: int | None = None,
              memory_limit: str | None = None, progress=None) -> Rows:
    """:func:`skew` as :class:`moetrace.output.Rows` (DuckDB's rows: no polars, no Arrow)."""
    return _skew(store, run_id, by, store.rows, batch_steps=batch_steps, memory_limit=memory_limit,
                 progress=progress)


def skew_to_parquet(store, run_id: str, by: str, path, *, batch_steps: int | None = None,
                    memory_limit: str | None = None, progress=None) -> int:
    """:func:`skew`'s rows written to the Parquet file ``path`` by DuckDB (COPY); the rows written."""
    return _skew(store, run_id, by, lambda q, p: store.copy_parquet(q, p, path), batch_steps=batch_steps,
                 memory_limit=memory_limit, progress=progress)


def _skew(store, run_id: str, by: str, read, *, batch_steps, memory_limit, progress):
    """The skew rows of ``run_id`` through ``read(query, params)`` (Store.sql, Store.rows or a
    Store.copy_parquet)."""
    from . import cache
    from .materialize import configure, drop_materialized

    if by not in _SKEW_SQL:
        raise InputError(None, f"skew by {by!r}: choose from {', '.join(_SKEW_SQL)}")
    configure(store.con, memory_limit)
    m = cache.use(store, run_id, batch_steps, views=("run_shape", "layer_placement", "layer_skew"),
                  progress=progress, save_new=False, direct_below=DIRECT_ROWS)
    try:
        return read(_SKEW_SQL[by], [run_id])
    finally:
        drop_materialized(store.con, m)


def skew_frame(sql, run_id: str, by: str = "layer") -> pl.DataFrame:
    """The skew rows of one run straight from the views through ``sql(query, params)``
    (a Store's or :class:`moetrace.storage.spark.SparkSQL`'s): no batching, the engine plans it."""
    if by not in _SKEW_SQL:
        raise InputError(None, f"skew by {by!r}: choose from {', '.join(_SKEW_SQL)}")
    return sql(_SKEW_SQL[by], [run_id])


def tokens_per_expert(store, run_id: str) -> pl.DataFrame:
    """See :meth:`moetrace.run.Run.tokens_per_expert`: the stored rows when the run's
    stored analysis is fresh (:mod:`moetrace.analyze.cache`), else the view."""
    from . import cache
    from .materialize import drop_materialized

    st = cache.state(store, run_id, ("tokens_per_expert",))
    m = cache.load(store, st, ("tokens_per_expert",)) if st.fresh else None
    try:
        return store.sql("SELECT * FROM tokens_per_expert WHERE run_id = ? ORDER BY step, layer", [run_id])
    finally:
        drop_materialized(store.con, m)


def dummy_steps(store, run_id: str, by: str = "rank") -> pl.DataFrame:
    """See :meth:`moetrace.run.Run.dummy_steps`."""
    if by == "rank":
        return store.sql("SELECT * FROM dummy_steps WHERE run_id = ? ORDER BY rank", [run_id])
    if by == "step":
        return store.sql("SELECT * FROM dummy_by_step WHERE run_id = ? ORDER BY step", [run_id])
    raise InputError(None, f"dummy steps by {by!r}: choose from rank, step")

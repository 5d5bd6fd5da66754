"""The per-(step, layer) analysis views of one run, computed in step-range batches.

``layer_skew`` and ``tokens_per_expert`` build, for every (step, layer), a sorted list of
the experts' tokens; DuckDB cannot spill those lists and sorts to disk, so one query over a
fleet-size run (a billion expert_load rows) runs out of any fixed memory limit.
``run_shape`` and ``layer_placement`` aggregate the whole run and take no step filter, so
every query that joins them rescans the run. :func:`materialize_layer_skew` therefore

1. computes ``run_shape``, ``layer_placement`` and ``dense_rank_map`` of the run once
   (TEMP tables),
2. walks the run's steps in batches of ``batch_steps`` consecutive steps (a power of two,
   chosen from the run's row count unless given), reading each batch's dense rows
   (``expert_counts``) from the store once, into a TEMP table that shadows the table for
   the batch: it materializes the batch's per-(step, layer) expert sums and rank lists
   (``expert_step_stats_long``, ``rank_tokens_long``, ``dense_step_stats``) and appends
   the batch's rows of ``layer_skew`` and ``tokens_per_expert``; from the same rows, with
   numpy (analyze/one_pass.py), the batch's merged windows of ``skew_by_batch`` (windows
   of up to ``batch_steps`` steps lie inside one batch, because batches start at
   multiples of ``batch_steps`` in step order), its rank totals per layer and its part of
   the token histogram and per-expert step bins,
3. finishes ``skew_by_batch`` (windows longer than a batch merge the batches' rank totals)
   and ``skew_decomposition`` (its structural part sums the rank totals),

and leaves TEMP tables named like the views on the connection: they shadow the views for
every later query on that connection (``skew_summary``, ``run_skew_summary`` and
``skew_decomposition`` read the materialized ``layer_skew``). Peak memory depends on the
batch size, not on the length of the run. The views themselves are unchanged: they stay
the SQL contract (``moetrace sql``, ``catalog.duckdb``), and the batched result equals
them (``tests/test_analysis_materialize.py`` compares every column).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

# expert_load rows per batch when the batch size is not given: the process's peak RSS
# computing every stored view grows with the batch (fleet shape, 14,848 rows per step:
# 1,241 MiB for a 400-step batch, 850 MiB for 256 steps, 740 MiB for 128 steps), so that
# a report, drawing included, stays under 1 GiB
TARGET_BATCH_ROWS = 4_000_000

SHAPE_VIEWS = ("run_shape", "layer_placement", "dense_rank_map")   # no step filter: once per run
HEAVY_VIEWS = ("layer_skew", "tokens_per_expert", "skew_by_batch", "skew_decomposition")
#: whole-run distributions the report draws (sql/22_expert_distribution.sql): with these the
#: report reads no expert_load row outside this module
DISTRIBUTION_VIEWS = ("rank_totals", "expert_token_hist", "expert_step_bins")
#: every view :func:`materialize_layer_skew` can leave on the connection for a run (and that
#: moetrace.analyze.cache stores): the report's inputs
ALL_VIEWS = ("run_shape", "layer_placement") + HEAVY_VIEWS + DISTRIBUTION_VIEWS
_CHUNK_VIEWS = ("expert_step_stats_long", "rank_tokens_long", "dense_step_stats")  # shadowed per batch
_PRIVATE = ("_mt_steps", "_mt_rank_tot", "_mt_per_batch", "_mt_rank_rows", "_mt_suffix", "_mt_layer_steps",
            "_mt_expert_rows", "_mt_hist")


@dataclass
class Materialized:
    """What :func:`materialize_layer_skew` left on the connection."""
    run_id: str
    tables: list[str] = field(default_factory=list)    # TEMP tables shadowing views
    batch_steps: int = 0
    batches: int = 0
    steps: int = 0
    rows: int = 0                                       # expert_load rows of the run
    seconds: float = 0.0
    reused: str | None = None                           # cache_id when read from the stored cache


def default_memory_limit() -> str:
    """``MOETRACE_MEMORY_LIMIT`` if set, else half of the machine's physical memory."""
    env = os.environ.get("MOETRACE_MEMORY_LIMIT")
    if env:
        return env
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "4GB"
    return f"{max(1, int(total * 0.5 / 2 ** 30))}GB"


def configure(con, memory_limit: str | None = None, temp_directory: str | None = None) -> None:
    """Cap DuckDB's memory (``memory_limit``, default :func:`default_memory_limit`) and make
    sure it has somewhere to spill (the store's ``.duckdb_tmp`` is set by ``Store.connect``
    when the store is writable; otherwise a folder under the system temp dir)."""
    from ..safety import memory_limit as checked
    from ..safety import sql_literal

    con.execute(f"SET memory_limit={sql_literal(checked(memory_limit) or checked(default_memory_limit(), 'MOETRACE_MEMORY_LIMIT'))}")
    if temp_directory is None:
        cur = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
        if cur and os.access(os.path.dirname(cur.rstrip("/")) or ".", os.W_OK):
            return
        import tempfile

        temp_directory = os.path.join(tempfile.gettempdir(), f"moetrace-duckdb-{os.getpid()}")
    con.execute(f"SET temp_directory={sql_literal(temp_directory)}")


def choose_batch_steps(rows: int, steps: int, target_rows: int = TARGET_BATCH_ROWS) -> int:
    """The largest power of two of steps whose rows stay under ``target_rows`` (at least 1),
    or a single batch when the whole run fits."""
    if steps <= 0:
        return 1
    per_step = max(1.0, rows / steps)
    if rows <= target_rows:
        return _pow2_at_least(steps)
    return _pow2_at_most(max(1, int(target_rows // per_step)))


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _pow2_at_least(n: int) -> int:
    n = max(1, int(n))
    return 1 << (n - 1).bit_length()


def _drop(con, names) -> None:
    """Drop the TEMP tables or TEMP views ``names`` (moetrace.analyze.cache shadows the
    views with TEMP views over the stored rows)."""
    from ..storage.duck import duckdb

    for n in names:
        try:
            con.execute(f'DROP TABLE IF EXISTS temp."{n}"')
        except duckdb.CatalogException:    # a TEMP view of that name
            con.execute(f'DROP VIEW IF EXISTS temp."{n}"')
    unshadow = getattr(con, "unshadow", None)     # a store's connection (Store.con)
    if unshadow is not None:
        unshadow(names)


def _main(con) -> str:
    """The connection's own schema, fully qualified (:func:`moetrace.storage.views.main_schema`)."""
    from ..storage.views import main_schema

    return main_schema(con)


def _empty_like(con, name: str, view: str) -> None:
    """A TEMP table with the view's columns and types, created without running the view."""
    db = _main(con)
    cols = con.execute(f'DESCRIBE SELECT * FROM {db}."{view}"').fetchall()
    defs = ", ".join(f'"{c[0]}" {c[1]}' for c in cols)
    con.execute(f'CREATE OR REPLACE TEMP TABLE "{name}" ({defs})')


def _arrow(con, query: str):
    """The rows of ``query`` as an Arrow table (DuckDB 2.0 and 1.x name it differently)."""
    rel = con.sql(query)
    fn = getattr(rel, "to_arrow_table", None) or rel.fetch_arrow_table
    return fn()


def _insert(con, table: str, rows) -> None:
    """Append the Arrow table ``rows`` (the columns of ``table``, in order) to TEMP ``table``."""
    if rows.num_rows == 0:
        return
    con.register("_mt_arrow", rows)
    try:
        con.execute(f'INSERT INTO temp."{table}" SELECT * FROM _mt_arrow')
    finally:
        con.unregister("_mt_arrow")


def materialize_layer_skew(store, run_id: str, batch_steps: int | None = None, *,
                           views=HEAVY_VIEWS, con=None, progress: Callable[[str], None] | None = None,
                           target_rows: int = TARGET_BATCH_ROWS) -> Materialized:
    """Compute ``views`` (a subset of :data:`HEAVY_VIEWS` and :data:`DISTRIBUTION_VIEWS`;
    ``layer_skew`` is always computed) for ``run_id`` in step batches into TEMP tables of
    the same names on ``con`` (default: the store's connection), with ``run_shape`` and
    ``layer_placement`` of the run. Only rows of ``run_id`` are kept: while they exist, queries on ``con`` about other
    runs see no analysis rows. Undo with :func:`drop_materialized`.

    ``batch_steps``: steps per batch, rounded down to a power of two (so the batch-size
    windows of ``skew_by_batch`` never straddle two batches); default from the run's
    expert_load rows (about :data:`TARGET_BATCH_ROWS` rows per batch). ``progress`` gets a
    line of text now and then when the run takes more than one batch.
    """
    # numpy and Arrow: imported for batched views only (a small run takes materialize_one_pass)
    from .one_pass import DenseExperts, rank_windows

    con = store.con if con is None else con
    views = tuple(v for v in HEAVY_VIEWS + DISTRIBUTION_VIEWS if v in set(views) | {"layer_skew"})
    rank_totals = bool({"skew_by_batch", "skew_decomposition", "rank_totals"} & set(views))
    expert_rows = bool({"expert_token_hist", "expert_step_bins"} & set(views))
    m = Materialized(run_id=run_id)
    t0 = time.perf_counter()
    made: list[str] = []
    db = _main(con)
    prev_order = con.execute("SELECT current_setting('preserve_insertion_order')").fetchall()[0][0]
    try:
        con.execute("SET preserve_insertion_order=false")
        # 1. the run's shape, once
        for v in SHAPE_VIEWS:
            con.execute(f'CREATE OR REPLACE TEMP TABLE "{v}" AS SELECT * FROM {db}."{v}" WHERE run_id = ?', [run_id])
            made.append(v)
        # rows of the expert_load view: long rows + dense rows x num_experts (list length)
        m.rows = int(con.execute("SELECT (SELECT count(*) FROM expert_load_long WHERE run_id = ?) + "
                                 "(SELECT count(*) FROM expert_counts WHERE run_id = ?) * "
                                 "(SELECT coalesce(max(num_experts), 0) FROM temp.run_shape)",
                                 [run_id, run_id]).fetchall()[0][0])
        con.execute("CREATE OR REPLACE TEMP TABLE _mt_steps AS SELECT step, "
                    "row_number() OVER (ORDER BY step) - 1 AS ord FROM "
                    "(SELECT DISTINCT step FROM step_layers WHERE run_id = ?)", [run_id])
        made.append("_mt_steps")
        steps = [r[0] for r in con.execute("SELECT step FROM _mt_steps ORDER BY ord").fetchall()]
        n = m.steps = len(steps)
        K = _pow2_at_most(batch_steps) if batch_steps else choose_batch_steps(m.rows, n, target_rows)
        m.batch_steps = K
        m.batches = max(1, -(-n // K)) if n else 0

        # accumulators, typed like the views
        for v in ("layer_skew", "tokens_per_expert"):
            if v in views:
                _empty_like(con, v, v)
                made.append(v)
        con.execute("CREATE OR REPLACE TEMP TABLE _mt_rank_tot (chunk BIGINT, layer INTEGER, rank BIGINT, "
                    "tokens DOUBLE)")
        if expert_rows:   # per (layer, step): its place among the layer's steps, for expert_step_bins
            con.execute("CREATE OR REPLACE TEMP TABLE _mt_layer_steps AS SELECT layer, step, "
                        "row_number() OVER (PARTITION BY layer ORDER BY step) - 1 AS ord, "
                        "count(*) OVER (PARTITION BY layer) AS steps FROM step_layers WHERE run_id = ?", [run_id])
            con.execute("CREATE OR REPLACE TEMP TABLE _mt_hist (layer INTEGER, tokens BIGINT, pairs BIGINT)")
            made += ["_mt_layer_steps", "_mt_hist"]
        con.execute("CREATE OR REPLACE TEMP TABLE _mt_per_batch (layer INTEGER, w BIGINT, batch BIGINT, "
                    "mx DOUBLE, total DOUBLE)")
        # per-(layer, rank) suffix buckets for the windows of the last w steps (see 25_skew_by_batch.sql)
        con.execute("CREATE OR REPLACE TEMP TABLE _mt_suffix (layer INTEGER, rank BIGINT, k BIGINT, tokens DOUBLE)")
        made += ["_mt_rank_tot", "_mt_per_batch", "_mt_suffix"]
        top_level = min(K, _pow2_at_most(n)) if n else 1      # highest window merged inside a batch
        dense = DenseExperts()

        # 2. the batches
        last_report = time.perf_counter()
        for c in range(m.batches):
            lo = steps[c * K]
            hi = steps[(c + 1) * K] if (c + 1) * K < n else None
            rng = "step >= ?" + (" AND step < ?" if hi is not None else "")
            args = [run_id, lo] + ([hi] if hi is not None else [])
            # the batch's dense rows read once: a TEMP table shadowing expert_counts for the
            # batch's queries (the views' list functions and the numpy below all read it)
            if set(views) - {"layer_skew"}:
                con.execute(f'CREATE OR REPLACE TEMP TABLE expert_counts AS SELECT * FROM {db}.expert_counts '
                            f"WHERE run_id = ? AND {rng}", args)
            # shared inputs of several views: computed once per batch (layer_skew alone reads
            # them once anyway, so it skips the copy)
            for v in (_CHUNK_VIEWS if set(views) - {"layer_skew"} else ()):
                con.execute(f'CREATE OR REPLACE TEMP TABLE "{v}" AS SELECT * FROM {db}."{v}" '
                            f"WHERE run_id = ? AND {rng}", args)
                if v not in made:
                    made.append(v)
            for v in ("layer_skew", "tokens_per_expert"):
                if v in views:
                    con.execute(f'INSERT INTO temp."{v}" SELECT * FROM {db}."{v}" WHERE run_id = ? AND {rng}', args)
            if rank_totals:
                # the batch's rank rows (both layouts) as arrays: windows, rank totals, suffix buckets
                rows = _arrow(con, f"SELECT r.layer, s.ord, r.ranks, r.tokens FROM {db}.rank_tokens_by_step r "
                                   "JOIN _mt_steps s ON s.step = r.step")
                win, tot, suf = rank_windows(rows, len(steps[c * K:(c + 1) * K]), c * K, n, top_level, c)
                _insert(con, "_mt_rank_tot", tot)
                if "skew_by_batch" in views:
                    _insert(con, "_mt_suffix", suf)
                    _insert(con, "_mt_per_batch", win)
            if expert_rows:   # dense rows: from the batch's lists (numpy); long rows: summed per expert
                bin_of = "CAST(o.ord * least(o.steps, 300) // o.steps AS BIGINT) AS bin"
                dense_rows = _arrow(con, f"SELECT c.layer, {bin_of}, c.tokens FROM temp.expert_counts c "
                                         "JOIN _mt_layer_steps o ON o.layer = c.layer AND o.step = c.step")
                _insert(con, "_mt_hist", dense.add(dense_rows))
                del dense_rows
                con.execute("CREATE OR REPLACE TEMP TABLE _mt_expert_rows AS SELECT layer, step, expert, tokens "
                            f"FROM {db}.expert_tokens_long WHERE run_id = ? AND {rng}", args)
                con.execute("INSERT INTO _mt_hist SELECT layer, tokens, count(*) FROM _mt_expert_rows GROUP BY ALL")
                dense.add_long(_arrow(con, f"SELECT e.layer, {bin_of}, e.expert, e.tokens FROM _mt_expert_rows e "
                                           "JOIN _mt_layer_steps o ON o.layer = e.layer AND o.step = e.step"))
                _drop(con, ["_mt_expert_rows"])
            now = time.perf_counter()
            if progress is not None and m.batches > 1 and (now - last_report >= 5 or c + 1 == m.batches):
                last_report = now
                done_steps = min(n, (c + 1) * K)
                el = now - t0
                eta = el / done_steps * (n - done_steps)
                progress(f"moetrace: per-(step, layer) views of run {run_id}: batch {c + 1}/{m.batches} "
                         f"({done_steps:,} of {n:,} steps, {m.rows:,} expert_load rows) "
                         f"{el:.0f} s elapsed, ~{eta:.0f} s left")
        _drop(con, _CHUNK_VIEWS + ("expert_counts",))
        made = [t for t in made if t not in _CHUNK_VIEWS]

        # 3. what spans batches
        if "skew_by_batch" in views:
            if n > top_level:      # longer windows: merge the batches' rank totals (one row per batch)
                con.execute(f"""
                    INSERT INTO _mt_per_batch
                    WITH RECURSIVE merged(layer, w, batch, rank, tokens) AS (
                        SELECT layer, CAST({K} AS BIGINT), chunk, rank, tokens FROM _mt_rank_tot
                        UNION ALL
                        SELECT layer, w * 2, batch // 2, rank, sum(tokens)
                        FROM merged WHERE w * 2 <= {n}
                        GROUP BY layer, w, batch // 2, rank
                    )
                    SELECT layer, w, batch, max(tokens), sum(tokens) FROM merged
                    WHERE w > {K} AND batch < {n} // w GROUP BY layer, w, batch""")
            _empty_like(con, "skew_by_batch", "skew_by_batch")
            made.append("skew_by_batch")
            con.execute(f"""
                INSERT INTO temp.skew_by_batch
                WITH a AS (
                    SELECT sh.run_id, b.layer, b.w,
                           avg(b.total / coalesce(sh.top_k, 1)) AS tokens_per_batch,
                           avg(b.mx / (b.total / sh.num_ranks)) FILTER (WHERE b.total > 0) AS imbalance,
                           count(*) FILTER (WHERE b.total > 0) AS batches,
                           CASE WHEN sh.top_k IS NULL
                                THEN 'top_k unknown: tokens_per_batch counts token-expert assignments' END AS note
                    FROM _mt_per_batch b CROSS JOIN temp.run_shape sh
                    WHERE sh.run_id = ? AND sh.num_ranks IS NOT NULL
                    GROUP BY sh.run_id, b.layer, b.w, sh.top_k, sh.num_ranks
                ), levels AS (SELECT layer, w FROM a WHERE {n} % w <> 0
                ), tail AS (     -- the window of the last w steps where the tiling leaves steps out
                    SELECT layer, w, max(tokens) AS mx, sum(tokens) AS total FROM (
                        SELECT lv.layer, lv.w, x.rank, sum(x.tokens) AS tokens
                        FROM levels lv JOIN _mt_suffix x ON x.layer = lv.layer
                                                        AND x.k <= CAST(round(log2(lv.w)) AS BIGINT)
                        GROUP BY ALL)
                    GROUP BY layer, w
                ), tail_steps AS (
                    SELECT lv.layer, lv.w, sum(ls.imbalance) AS s, count(ls.imbalance) AS c
                    FROM levels lv JOIN _mt_steps s ON s.ord >= {n} - lv.w
                    JOIN temp.layer_skew ls ON ls.step = s.step AND ls.layer = lv.layer
                    GROUP BY ALL
                )
                SELECT a.run_id, a.layer, a.w, a.tokens_per_batch, a.imbalance, a.batches, a.note,
                       c.steps_used, c.first_step, c.last_step, c.step_imbalance_mean,
                       a.imbalance / c.step_imbalance_mean,
                       (coalesce(a.imbalance * a.batches, 0) + coalesce(t.mx / (t.total / sh.num_ranks), 0))
                           / nullif(a.batches + CASE WHEN t.total > 0 THEN 1 ELSE 0 END, 0),
                       a.batches + CASE WHEN t.total > 0 THEN 1 ELSE 0 END,
                       (c.s + coalesce(ts.s, 0)) / nullif(c.c + coalesce(ts.c, 0), 0)
                FROM a CROSS JOIN temp.run_shape sh
                LEFT JOIN tail t ON t.layer = a.layer AND t.w = a.w AND t.total > 0
                LEFT JOIN tail_steps ts ON ts.layer = a.layer AND ts.w = a.w
                LEFT JOIN LATERAL (   -- the same steps one at a time (see 25_skew_by_batch.sql)
                    SELECT count(*) AS steps_used, min(s.step) AS first_step, max(s.step) AS last_step,
                           avg(ls.imbalance) AS step_imbalance_mean, sum(ls.imbalance) AS s, count(ls.imbalance) AS c
                    FROM _mt_steps s JOIN temp.layer_skew ls ON ls.step = s.step AND ls.layer = a.layer
                    WHERE s.ord < ({n} // a.w) * a.w
                ) c ON true""", [run_id])
        if rank_totals:   # the batches' rank totals summed (the view sums rank_load_sparse over the run)
            con.execute("CREATE OR REPLACE TEMP TABLE rank_totals AS SELECT CAST(? AS VARCHAR) AS run_id, layer, rank, "
                        "sum(tokens) AS tokens FROM _mt_rank_tot GROUP BY layer, rank", [run_id])
            made.append("rank_totals")
        if "skew_decomposition" in views:   # its structural part reads rank_totals
            con.execute("CREATE OR REPLACE TEMP TABLE skew_decomposition AS "
                        f"SELECT * FROM {db}.skew_decomposition WHERE run_id = ?", [run_id])
            made.append("skew_decomposition")
        if rank_totals and "rank_totals" not in views:
            _drop(con, ["rank_totals"])
            made.remove("rank_totals")
        if "expert_token_hist" in views:
            con.execute("CREATE OR REPLACE TEMP TABLE expert_token_hist AS SELECT CAST(? AS VARCHAR) AS run_id, layer, "
                        "tokens, CAST(sum(pairs) AS BIGINT) AS pairs FROM _mt_hist GROUP BY layer, tokens", [run_id])
            made.append("expert_token_hist")
        if "expert_step_bins" in views:   # the bins summed over the batches (numpy): one row each
            steps_of = dict(con.execute("SELECT layer, any_value(steps) FROM _mt_layer_steps GROUP BY layer").fetchall())
            con.register("_mt_arrow", dense.bin_rows(steps_of))
            try:
                con.execute("CREATE OR REPLACE TEMP TABLE expert_step_bins AS "
                            "SELECT CAST(? AS VARCHAR) AS run_id, * FROM _mt_arrow", [run_id])
            finally:
                con.unregister("_mt_arrow")
            made.append("expert_step_bins")
        del dense
        _drop(con, _PRIVATE)
        made = [t for t in made if t not in _PRIVATE]
    except BaseException:
        _drop(con, list(made) + list(_CHUNK_VIEWS) + ["expert_counts"] + list(_PRIVATE))
        raise
    finally:
        con.execute(f"SET preserve_insertion_order={'true' if str(prev_order).lower() in ('true', '1') else 'false'}")
    m.tables = made
    m.seconds = time.perf_counter() - t0
    return m


def materialize_one_pass(store, run_id: str, views=("layer_skew",), *, con=None) -> Materialized:
    """``views`` of ``run_id`` (of :data:`HEAVY_VIEWS`, :data:`DISTRIBUTION_VIEWS`,
    :data:`SHAPE_VIEWS`) as TEMP tables on ``con`` straight from the views, one statement
    each, no batching: for a run with few long rows (dense rows stream through the views
    in one pass, see :func:`moetrace.analyze.cache.use`), where
    :func:`materialize_layer_skew`'s statements cost more than they save (the same rows:
    that function's batches equal the views). Undo with :func:`drop_materialized`."""
    con = store.con if con is None else con
    t0 = time.perf_counter()
    temp_table = getattr(con, "temp_table", None)     # a store's connection: the views inlined
    db = None if temp_table is not None else _main(con)
    m = Materialized(run_id=run_id, batches=1)
    try:
        for v in views:
            if temp_table is not None:
                temp_table(v, "run_id = ?", [run_id])
            else:
                con.execute(f'CREATE OR REPLACE TEMP TABLE "{v}" AS SELECT * FROM {db}."{v}" WHERE run_id = ?',
                            [run_id])
            m.tables.append(v)
    except BaseException:
        _drop(con, m.tables)
        raise
    m.seconds = time.perf_counter() - t0
    return m


def drop_materialized(con, m: Materialized | list[str] | None) -> None:
    """Drop the TEMP tables of :func:`materialize_layer_skew`: the views show through again."""
    if m is None:
        return
    _drop(con, m.tables if isinstance(m, Materialized) else m)

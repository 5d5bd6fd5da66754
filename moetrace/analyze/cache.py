"""The stored analysis cache: a run's per-(step, layer) views, computed once, kept in the store.

:func:`moetrace.analyze.materialize.materialize_layer_skew` computes the report's inputs
(:data:`~moetrace.analyze.materialize.ALL_VIEWS`: layer_skew, tokens_per_expert,
skew_by_batch, skew_decomposition, run_shape, layer_placement and the whole-run
distributions) in step batches: on a fleet-hour that is most of the report's time. This
module stores those rows in the store, as contract tables ``cache_<view>``
(``schemas/cache_*.json``: the view's columns plus ``cache_id``) under the run's
partition, with one ``analysis_cache`` row (``schemas/analysis_cache.json``) holding the
key, all in one transaction of the store's own write path (``Store.append``: staged,
journaled, the header renamed last; bad input or a crash leaves the store as it was).

The key (:class:`CacheKey`) is

* ``cache_format``, ``moetrace_version`` and ``duckdb_version``: another moetrace or
  DuckDB recomputes;
* ``views_sha256``: the SQL of the cached views and of every view they read (with the
  expert_load views of storage/dense.py), and the contract versions of the input tables
  and of the cache's own tables: a changed definition recomputes;
* ``inputs_sha256``: the run's input rows. moetrace never rewrites a data file (every
  write is a new ``part-<txid>.parquet``), so the names and sizes of the run's committed
  files of the tables the views read identify those rows; the ``placement`` table also
  takes plans, which the views do not read, so for it the recorded placement's rows
  themselves are hashed. A run re-ingested under the same id gets new files: recomputed.

A reader (:func:`use`) takes the run's newest ``analysis_cache`` row; when its key equals
the key now, and every ``cache_<view>`` table holds the rows it lists, the views are
shadowed on the connection by TEMP views over the stored rows (nothing of expert_load is
read); otherwise they are recomputed, and a key that no longer matches says so in one
line. A replaced cache removes the older generation's files after the new one is
committed (``Store.append(replace=True)``; the ``cache_id`` filter ignores a generation a
crash left behind). :func:`clear` drops a run's cache (``moetrace materialize --clear``);
deleting a run's partitions (``STORE/*/run_id=R``) deletes its cache with it.
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import SchemaError, StoreError
from ..safety import sql_literal
from ..storage import schema
from ..storage.views import view_graph
from ..version import __version__
from .materialize import (
    ALL_VIEWS,
    Materialized,
    _drop,
    _main,
    materialize_layer_skew,
    materialize_one_pass,
)

#: layout of the stored rows; a cache of another format is never read (bump on a change of
#: how the rows are stored or computed that the view SQL does not show)
CACHE_FORMAT = 1
HEADER = "analysis_cache"
#: the views stored, each as table cache_<view>
CACHED_VIEWS = ALL_VIEWS
#: contract tables whose rows the views read only in part: hashed by content (a query),
#: not by file, so that appends the views ignore (plans) leave the cache fresh
CONTENT_KEYED = {"placement": "SELECT * FROM placement WHERE run_id = ? AND plan_id = 'recorded' ORDER BY ALL"}
_KEY_FIELDS = ("cache_format", "moetrace_version", "duckdb_version", "views_sha256", "inputs_sha256")
_WHY = {"cache_format": "the cache format changed", "moetrace_version": "moetrace is another version",
        "duckdb_version": "DuckDB is another version", "views_sha256": "the view SQL changed",
        "inputs_sha256": "the run's input rows changed (re-ingested?)"}


def table_of(view: str) -> str:
    """The contract table holding the stored rows of ``view``."""
    return f"cache_{view}"


def cache_tables() -> list[str]:
    """Every table of the cache, the header first (the order :func:`clear` removes them)."""
    return [HEADER] + [table_of(v) for v in CACHED_VIEWS]


@dataclass(frozen=True)
class CacheKey:
    cache_format: int
    moetrace_version: str
    duckdb_version: str
    views_sha256: str
    inputs_sha256: str


@dataclass
class CacheState:
    """Where a run's stored analysis stands: ``status`` is ``fresh`` (its key matches: it is
    read instead of the views), ``stale`` (``reason`` says what changed) or ``absent``."""
    run_id: str
    status: str
    key: CacheKey | None           # None: not computed (state(need_key=False) of a run with nothing stored)
    reason: str | None = None
    header: dict | None = None

    @property
    def fresh(self) -> bool:
        return self.status == "fresh"

    def line(self) -> str:
        """One line for a person: what is stored and whether it is used."""
        h = self.header or {}
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(h["created_at_ns"] / 1e9)) if h else ""
        if self.status == "fresh":
            return (f"run {self.run_id}: stored analysis {h['cache_id']} is fresh (computed {when} by moetrace "
                    f"{h['moetrace_version']} in {h['compute_s'] or 0:.1f} s, {h['steps']} steps)")
        if self.status == "stale":
            return f"run {self.run_id}: stored analysis {h['cache_id']} is stale ({self.reason})"
        return f"run {self.run_id}: no stored analysis"


# ----------------------------------------------------------------------------- the key
def view_closure(views=CACHED_VIEWS) -> list[str]:
    """The views of ``sql/`` that ``views`` are, or read, in file order."""
    graph = view_graph()
    need, todo = set(), list(views)
    while todo:
        v = todo.pop()
        if v in need:
            continue
        need.add(v)
        todo.extend(graph[v][2])
    return sorted(need, key=lambda v: graph[v][0])


def input_tables(views=CACHED_VIEWS) -> list[str]:
    """The contract tables the views read (named in their SQL; ``expert_load_long`` and
    ``expert_load`` are the expert_load and expert_counts tables: storage/dense.py)."""
    graph = view_graph()
    known = set(schema.load_all())
    words: set[str] = set()
    for v in view_closure(views):
        words |= set(re.findall(r"\w+", graph[v][1]))
    if words & {"expert_load_long", "expert_load"}:
        words |= {"expert_load", "expert_counts"}
    return sorted((words & known) | {"runs"})


def views_sha256(views=CACHED_VIEWS) -> str:
    """sha256 of the definitions the stored rows depend on: the SQL of the views (and
    those they read), the expert_load views of storage/dense.py, and the contract versions
    of the input tables and of the cache's own tables."""
    import hashlib  # here, as uuid below: a skew that keys no cache does not import them

    from ..storage.dense import expert_load_views

    graph = view_graph()
    h = hashlib.sha256()
    for v in view_closure(views):
        h.update(graph[v][1].encode())
        h.update(b"\0")
    for stmt in expert_load_views("CREATE OR REPLACE VIEW expert_load AS SELECT 1"):
        h.update(stmt.encode())
    for t in input_tables(views) + cache_tables():
        h.update(f"{t}={schema.get(t).version};".encode())
    return h.hexdigest()


def inputs_sha256(store, run_id: str, views=CACHED_VIEWS) -> str:
    """The fingerprint of the run's input rows (see the module docstring): its committed
    files (name, size) of every input table, and the rows of :data:`CONTENT_KEYED` tables."""
    import hashlib

    files = store.committed_files()
    part = f"run_id={run_id}"
    h = hashlib.sha256()
    for t in input_tables(views):
        if t in CONTENT_KEYED:
            got = store.rows(CONTENT_KEYED[t], [run_id])   # as Arrow's to_pylist: a dict per row
            h.update(f"{t}:{got.height}:".encode())
            h.update(json.dumps(got.dicts(), sort_keys=True, default=str).encode())
            continue
        for f in files.get(t, ()):
            if f.split("/")[1] == part:
                try:
                    size = (store.path / f).stat().st_size
                except OSError:
                    size = -1
                h.update(f"{f}:{size};".encode())
    return h.hexdigest()


def current_key(store, run_id: str) -> CacheKey:
    import duckdb

    return CacheKey(CACHE_FORMAT, __version__, duckdb.__version__, views_sha256(), inputs_sha256(store, run_id))


# ----------------------------------------------------------------------------- reading
def state(store, run_id: str, views=CACHED_VIEWS, *, need_key: bool = True) -> CacheState:
    """The run's stored analysis against the key now (:class:`CacheState`). With
    ``need_key=False`` a run without any stored analysis is ``absent`` with ``key`` None:
    the key (the run's files, its recorded placement hashed) is not computed for nothing."""
    if not need_key and not any(f.split("/")[1] == f"run_id={run_id}" for f in store.committed_files().get(HEADER, ())):
        return CacheState(run_id, "absent", None)
    key = current_key(store, run_id)
    got = store.rows(f"SELECT * FROM {HEADER} WHERE run_id = ? ORDER BY created_at_ns DESC, cache_id LIMIT 1",
                     [run_id])
    if got.height == 0:
        return CacheState(run_id, "absent", key)
    h = got.dicts()[0]
    for f in _KEY_FIELDS:
        if h[f] != getattr(key, f):
            why = _WHY[f]
            if f in ("moetrace_version", "duckdb_version"):
                why += f" (stored by {h[f]}, this is {getattr(key, f)})"
            return CacheState(run_id, "stale", key, why, h)
    stored = set(json.loads(h["views"]))
    if set(views) - stored:
        return CacheState(run_id, "stale", key, f"it lacks {', '.join(sorted(set(views) - stored))}", h)
    want = json.loads(h["rows_json"])
    for v in views:
        n = int(store.rows(f"SELECT count(*) AS n FROM {table_of(v)} WHERE run_id = ? AND cache_id = ?",
                           [run_id, h["cache_id"]]).rows[0][0])
        if n != int(want.get(v, -1)):
            return CacheState(run_id, "stale", key, f"{table_of(v)} holds {n} of its {want.get(v)} rows", h)
    return CacheState(run_id, "fresh", key, None, h)


def load(store, st: CacheState, views=CACHED_VIEWS, con=None) -> Materialized:
    """Shadow ``views`` on ``con`` (default the store's) with TEMP views over the stored rows
    of a fresh cache; undo with :func:`moetrace.analyze.drop_materialized`."""
    con = store.con if con is None else con
    if not st.fresh:
        raise StoreError(f"{store.path}: the stored analysis of run {st.run_id} is {st.status}; not read")
    db = _main(con)
    cid = st.header["cache_id"]
    made: list[str] = []
    try:
        for v in views:
            cols = ", ".join(f'"{c}"' for c in schema.get(table_of(v)).column_names if c != "cache_id")
            con.execute(f'CREATE OR REPLACE TEMP VIEW "{v}" AS SELECT {cols} FROM {db}."{table_of(v)}" '
                        f"WHERE run_id = {sql_literal(st.run_id)} AND cache_id = {sql_literal(cid)}")
            made.append(v)
    except BaseException:
        _drop(con, made)
        raise
    return Materialized(run_id=st.run_id, tables=made, batch_steps=st.header.get("batch_steps") or 0,
                        steps=st.header.get("steps") or 0, reused=cid)


# ----------------------------------------------------------------------------- writing
def _chunks(con, name: str, cache_id: str, rows: int = 1 << 20):
    """The TEMP table ``name`` as Arrow tables of ``rows`` rows, with ``cache_id``."""
    import pyarrow as pa

    rel = con.sql(f'SELECT * FROM temp."{name}"')
    fn = getattr(rel, "to_arrow_reader", None) or rel.fetch_arrow_reader   # DuckDB 2.0 / 1.x
    for batch in fn(rows):
        t = pa.Table.from_batches([batch])
        yield t.append_column("cache_id", pa.array([cache_id] * t.num_rows, pa.string()))


def save(store, m: Materialized, key: CacheKey, con=None) -> dict:
    """Store the TEMP tables of ``m`` (:data:`CACHED_VIEWS`, all of them) as the run's
    cache, replacing the older one, in one transaction; returns the header row."""
    con = store.con if con is None else con
    missing = [v for v in CACHED_VIEWS if v not in m.tables]
    if missing:
        raise ValueError(f"not every cached view was computed (missing {', '.join(missing)})")
    import uuid

    cache_id = uuid.uuid4().hex[:12]
    rows = {v: int(con.execute(f'SELECT count(*) FROM temp."{v}"').fetchall()[0][0]) for v in CACHED_VIEWS}
    header = {"run_id": m.run_id, "cache_id": cache_id, "created_at_ns": time.time_ns(), **key.__dict__,
              "views": json.dumps(list(CACHED_VIEWS)), "rows_json": json.dumps(rows), "steps": m.steps,
              "batch_steps": m.batch_steps, "compute_s": m.seconds}
    tables: dict[str, object] = {table_of(v): _chunks(con, v, cache_id) for v in CACHED_VIEWS}
    tables[HEADER] = {k: [v] for k, v in header.items()}
    store.append(m.run_id, tables, replace=True)
    return header


def clear(store, run_id: str | None = None) -> dict[str, int]:
    """Remove the stored analysis of ``run_id`` (every run's when None): {table: files}."""
    return store.drop_tables(run_id, cache_tables())


# ----------------------------------------------------------------------------- the callers' entry
def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def use(store, run_id: str, batch_steps: int | None = None, *, views=CACHED_VIEWS, con=None,
        progress: Callable[[str], None] | None = None, reuse: bool = True, save_new: bool = True,
        target_rows: int | None = None, direct_below: int = 0,
        compute: Callable | None = None) -> Materialized | None:
    """The run's ``views`` on the connection, from the stored cache when its key matches,
    else computed (:func:`materialize_layer_skew`) and, with ``save_new`` and every cached
    view asked for, stored for the next caller. A key that no longer matches is said in
    one line (``progress``, else stderr); so is a store that cannot take the cache (the
    results are used all the same). ``reuse=False`` recomputes whatever is stored.

    ``direct_below``: when nothing is to be stored, no batch size is asked for and the
    run holds fewer long expert_load rows than this (Parquet footers), the views are
    computed in one pass (:func:`~moetrace.analyze.materialize.materialize_one_pass`).
    Batches bound the memory of the long rows' per-(step, layer) aggregation; a dense row
    is already one (step, layer) and its statistics are list functions of that row alone,
    so dense rows stream through in one pass whatever their number (the TEMP tables hold
    the per-(step, layer) results, as the batches' would), while each batch costs two
    dozen statements that bind the chain of views again (a tiny run's start-up,
    and 10M-100M-row runs' skew).

    ``compute``: compute the views with ``compute(store, run_id, views, con)`` instead
    (:func:`moetrace.analyze.on_engine.compute_with`: on Spark); stored the same way."""
    from .materialize import TARGET_BATCH_ROWS

    con = store.con if con is None else con
    say = progress or _stderr
    full = set(CACHED_VIEWS) <= set(views)
    st = state(store, run_id, views, need_key=full and save_new)
    if st.fresh and reuse:
        m = load(store, st, views, con=con)
        if st.header.get("steps") and st.header.get("batch_steps") and st.header["steps"] > st.header["batch_steps"]:
            say(f"moetrace: {st.line()}: reused")       # a long run: say why this was quick
        return m
    if st.status == "stale":
        say(f"moetrace: {st.line()}: recomputing" + ("" if full and save_new else
                                                     f" (`moetrace materialize {store.path} --run {run_id}` stores it)"))
    if compute is not None:
        m = compute(store, run_id, views, con)
    elif direct_below and batch_steps is None and not (full and save_new) \
            and long_rows(store, run_id) < direct_below:
        return materialize_one_pass(store, run_id, views, con=con)
    else:
        m = materialize_layer_skew(store, run_id, batch_steps, views=views, con=con, progress=progress,
                                   target_rows=target_rows or TARGET_BATCH_ROWS)
    if full and save_new:
        try:
            save(store, m, st.key, con=con)
        except (StoreError, SchemaError) as e:
            say(f"moetrace: note: the per-(step, layer) results of run {run_id} were not stored ({e}); "
                "the next report computes them again")
        else:
            if m.batches > 1:
                say(f"moetrace: stored the per-(step, layer) results of run {run_id} in the store "
                    f"({m.seconds:.0f} s to compute): the next report reuses them")
    return m


def long_rows(store, run_id: str) -> int:
    """Rows of the run's long expert_load files (the dense expert_counts rows not counted),
    from the Parquet footers: no data is read."""
    return sum(n for _, t, n in store.partition_rows(run_id=run_id, tables=("expert_load",)))


def store_run(store, run_id: str, batch_steps: int | None = None, *, force: bool = False,
              progress: Callable[[str], None] | None = None,
              compute: Callable | None = None) -> tuple[CacheState, CacheState]:
    """Compute and store the run's analysis unless a fresh one is stored (``force``: in any
    case); returns (the state before, the state after). A store that cannot be written is
    a StoreError (nothing was written). ``compute``: as for :func:`use` (Spark)."""
    from .materialize import drop_materialized

    before = state(store, run_id)
    if before.fresh and not force:
        return before, before
    if before.status == "stale" and progress is not None:
        progress(f"moetrace: {before.line()}: recomputing")
    m = compute(store, run_id, CACHED_VIEWS, store.con) if compute is not None else \
        materialize_layer_skew(store, run_id, batch_steps, views=CACHED_VIEWS, progress=progress)
    try:
        save(store, m, before.key)
    finally:
        drop_materialized(store.con, m)
    return before, state(store, run_id)

"""Every metric view gives the same rows on Spark (local mode) as on DuckDB, over one store
holding the shipped samples (a DeepSeek-V3-shaped serving run, two real 4-rank CPU runs
with profiler spans, the second with replicas, DeepEP wait counters, NCCL Inspector
collectives) and a synthetic run with idle steps,
replicas of its hottest experts and per-token routing.

The Spark text of each view is not written by hand: it is the DuckDB view transpiled by
``moetrace.storage.spark`` (sqlglot plus the adaptations listed there). Rows are compared as
multisets; floats to a relative tolerance of 1e-9 (both engines compute in IEEE doubles,
but sum in different orders), everything else exactly.

Needs pyspark and a Java runtime; ``.ci/run`` installs both. Skip locally with
``-m "not spark"``. The Spark session is the one the whole run shares (conftest
``spark_session``); each view is computed once (``spark_views``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from moetrace.run import Store
from moetrace.storage import schema

from .helpers import REPO, module_fixture, run_cli, run_row

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REL_TOL = 1e-9
SAMPLES = REPO / "sample_traces"


def _run_ok(args):
    r = run_cli(*args, catch_exceptions=True)
    assert r.exit_code == 0, f"moetrace {' '.join(args)}: {r.output}"


def _replicated_run(store: Store) -> None:
    """A hand-made run: 8 experts on 4 ranks (12 slots: the 4 hottest experts twice), 6
    steps of which step 3 is idle on every rank, plus per-token routing."""
    import pyarrow as pa

    rng = np.random.default_rng(7)
    E, R, L, T, K = 8, 4, 2, 6, 2
    pop = np.array([8, 6, 5, 4, 2, 1, 1, 1], float)
    rows = {"step": [], "layer": [], "token": [], "choice": [], "expert": [], "src_rank": []}
    for t in range(T):
        if t == 3:
            continue  # an idle step: no tokens at all
        for tok in range(24):
            for li in range(L):
                ex = rng.choice(E, size=K, replace=False, p=pop / pop.sum())
                for c, e in enumerate(ex):
                    rows["step"].append(t)
                    rows["layer"].append(li)
                    rows["token"].append(tok)
                    rows["choice"].append(c)
                    rows["expert"].append(int(e))
                    rows["src_rank"].append(tok % R)
    routing = pa.table({k: np.array(v) for k, v in rows.items()})
    agg = {(3, li, e): 0 for li in range(L) for e in range(E)}  # the idle step, recorded as zeros
    for s, li, e in zip(rows["step"], rows["layer"], rows["expert"]):
        agg[(s, li, e)] = agg.get((s, li, e), 0) + 1
    load = pa.table({"step": np.array([k[0] for k in agg]), "layer": np.array([k[1] for k in agg]),
                     "expert": np.array([k[2] for k in agg]), "tokens": np.array(list(agg.values()))})
    phy2log = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # 3 slots per rank
    place = {"plan_id": [], "layer": [], "slot": [], "rank": [], "node": [], "expert": []}
    for li in range(L):
        for s, e in enumerate(phy2log):
            place["plan_id"].append("recorded")
            place["layer"].append(li)
            place["slot"].append(s)
            place["rank"].append(s // 3)
            place["node"].append(s // 6)
            place["expert"].append(e)
    run = run_row(source="hand-made replicated run", source_sha256="0" * 64, num_layers=L, num_experts=E,
                  top_k=K, num_ranks=R, ranks_per_node=2, num_slots=len(phy2log))
    tables = {"expert_load": load, "routing": routing, "placement": pa.table(place)}
    for name, t in tables.items():  # the contract's other (nullable) columns, empty
        for col in schema.get(name).columns:
            if col.name != "run_id" and col.name not in t.column_names:
                t = t.append_column(col.name, pa.nulls(t.num_rows, col.arrow_type))
        tables[name] = t
    store.write_run(run, tables, run_id="rep")


def _run_without_ranks(store: Store) -> None:
    """A hand-made run whose number of ranks is unknown (steps_no_ranks), with one step
    that routed no tokens (steps_undefined)."""
    import pyarrow as pa

    rows = [(s, li, e, 0 if s == 2 else (e + 1) * (s + 1)) for s in range(3) for li in range(2) for e in range(4)]
    load = pa.table({"step": [r[0] for r in rows], "layer": [r[1] for r in rows],
                     "expert": [r[2] for r in rows], "tokens": [r[3] for r in rows]})
    for col in schema.get("expert_load").columns:
        if col.name != "run_id" and col.name not in load.column_names:
            load = load.append_column(col.name, pa.nulls(load.num_rows, col.arrow_type))
    run = run_row(source="hand-made run without ranks", source_sha256="1" * 64, num_layers=2, num_experts=4,
                  top_k=1)
    store.write_run(run, {"expert_load": load}, run_id="noranks")


@module_fixture
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark") / "st"
    _run_ok(["ingest", str(SAMPLES / "dsv3_synth_expert_load.parquet"), "--store", str(root), "--run-id", "dsv3",
             "--ranks", "32", "--ranks-per-node", "8", "--top-k", "8", "--experts", "256", "--layers", "4"])
    for name in ("refrun", "refrun_eplb"):
        _run_ok(["ingest", str(SAMPLES / name), "--store", str(root), "--run-id", name])
    # DeepEP wait counters (4 ranks: paired with the 4-rank timeline runs in deepep_wait_compare)
    # and NCCL Inspector records (collective spans with named process groups)
    _run_ok(["ingest", str(SAMPLES / "deepep"), "--store", str(root), "--run-id", "deepep", "--set", "clock_ghz=2.0"])
    _run_ok(["ingest", str(SAMPLES / "nccl_inspector"), "--store", str(root), "--run-id", "ni"])
    _run_ok(["synth", str(root), "--layers", "2", "--experts", "16", "--top-k", "4", "--ranks", "4",
             "--ranks-per-node", "2", "--steps", "10", "--tokens-per-step", "64", "--per-token",
             "--dummy-share", "0.25", "--seed", "3", "--run-id", "syn"])
    st = Store(root)
    _replicated_run(st)
    _run_without_ranks(st)
    return st


@module_fixture
def spark(store, spark_session):
    from moetrace.storage import spark as ms

    # the tables only: spark_views makes every metric view itself (the full registration,
    # each view over the nest under it, is tests/test_spark_cli.py's)
    ms.register_store(spark_session, store.path, views=False)
    return spark_session


@module_fixture
def spark_views(spark):
    """Each metric view computed once on Spark, in definition order (every view after the
    views it reads): its rows are checkpointed and the view is replaced by them, so a view
    built on others reads their rows instead of planning and running the whole nest of
    views under it again (layer_skew sits under a dozen). A temp view keeps the analyzed
    plan it was made with (``spark.sql.legacy.storeAnalyzedPlanForView``), so each metric
    view is made again from its own Spark statement first, over the rows of the views
    before it. Each view's own SQL still runs on Spark, over inputs Spark computed; the
    nested plans as the commands run them are tests/test_spark_cli.py's. Returns
    ``rows(view) -> Arrow table``."""
    from moetrace.storage import spark as ms
    from moetrace.storage.spark import to_arrow

    order = ["expert_load", *_view_names()]       # the store's own view under them all first
    stmt = dict(ms.spark_view_statements())
    ms.forget_registration()                      # its views are replaced by their rows below
    done: dict = {}

    def rows(view):
        for v in order:
            if v not in done:
                if v in stmt:                     # bound to the rows of the views it reads
                    spark.sql(stmt[v])
                df = spark.table(v).localCheckpoint(eager=True)
                df.createOrReplaceTempView(v)
                done[v] = to_arrow(df)
            if v == view:
                break
        return done[view]

    return rows


def _norm(v):
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, np.generic):
        return v.item()
    return v


def _sort_key(row):
    return tuple((x is None, repr(type(x).__name__ == "float" and round(x, 6) or x)) for x in row)


def _close(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)
    return a == b


def _rows(tbl):
    cols = [tbl.column(i).to_pylist() for i in range(tbl.num_columns)]
    return sorted((tuple(_norm(c[i]) for c in cols) for i in range(tbl.num_rows)), key=_sort_key)


def _view_names():
    from moetrace.storage.spark import _view_name
    from moetrace.storage.views import view_statements

    return [_view_name(s) for s in view_statements()]


def test_every_view_is_transpiled():
    """No view is left out of the Spark set (each is sqlglot output, not a hand copy)."""
    pytest.importorskip("sqlglot", reason="pip install 'moetrace[spark]'")
    from moetrace.storage.spark import spark_view_statements

    names = [n for n, _ in spark_view_statements()]
    assert names == _view_names() and len(names) >= 20
    assert all(s.startswith("CREATE OR REPLACE TEMPORARY VIEW") for _, s in spark_view_statements())


def test_the_store_exercises_the_views(store):
    """The store has what the comparison needs to mean something: idle steps, replicas,
    per-token routing, profiler spans, several placement sources."""
    sources = set(store.sql("SELECT DISTINCT placement_source FROM layer_placement")["placement_source"])
    assert {"slot", "recorded", "contiguous"} <= {s.split("+")[0] for s in sources} | sources
    assert store.sql("SELECT count(*) AS n FROM layer_skew WHERE imbalance IS NULL")["n"][0] > 0
    assert store.sql("SELECT count(*) AS n FROM routing")["n"][0] > 0
    assert store.sql("SELECT count(*) AS n FROM a2a_exposure")["n"][0] > 0
    assert store.sql("SELECT count(*) AS n FROM deepep_wait_compare")["n"][0] > 0
    assert store.sql("SELECT sum(steps_no_ranks) AS n FROM skew_summary")["n"][0] > 0
    assert store.sql("SELECT count(*) AS n FROM coll_spans WHERE NOT group_inferred")["n"][0] > 0


# Views that do not give DuckDB's rows on Spark, each with the reason: none since the list
# index, multi-unnest and explicit-rounding fixes (2026-12-01). Kept so that a newly found
# engine difference is listed here with its reason rather than hidden.
KNOWN_DIFFERENT: dict[str, str] = {}


@pytest.mark.parametrize("view", [
    pytest.param(v, marks=pytest.mark.xfail(reason=KNOWN_DIFFERENT[v], strict=True))
    if v in KNOWN_DIFFERENT else v for v in _view_names()])
def test_view_equal_on_spark_and_duckdb(store, spark_views, view):
    duck = _rows(store.arrow(f'SELECT * FROM "{view}"'))
    sp_tbl = spark_views(view)
    assert sp_tbl.column_names == store.arrow(f'SELECT * FROM "{view}" LIMIT 0').column_names
    sprk = _rows(sp_tbl)
    assert len(duck) == len(sprk), f"{view}: {len(duck)} rows on DuckDB, {len(sprk)} on Spark"
    bad = [(d, s) for d, s in zip(duck, sprk) if not _close(d, s)]
    assert not bad, f"{view}: {len(bad)} rows differ, first: duckdb {bad[0][0]} vs spark {bad[0][1]}"

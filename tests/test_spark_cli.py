"""``--engine spark`` on the commands: ``sql``, ``skew`` and ``exposure`` give on Spark
local mode what they give on DuckDB (the same views, transpiled), and a query Spark refuses
is one line with exit code 2. Every command runs on the suite's one kept Spark session
(conftest ``spark_session``: a JVM start per command cost ~55 s each, 507 s for the file);
``-m "not spark"`` skips it; ``.ci/run`` installs Java and pyspark."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .helpers import REPO, module_fixture, run_cli

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SAMPLES = REPO / "sample_traces"


def _cli(args, code=0):
    r = run_cli(*args, catch_exceptions=True)
    assert r.exit_code == code, f"moetrace {' '.join(args)} -> {r.exit_code}: {r.output}"
    return r


@module_fixture
def store(tmp_path_factory, spark_session):
    root = tmp_path_factory.mktemp("sparkcli") / "st"
    _cli(["ingest", str(root), str(SAMPLES / "refrun"), "--run-id", "refrun"])
    _cli(["synth", str(root), "--layers", "2", "--experts", "16", "--top-k", "4", "--ranks", "4",
          "--ranks-per-node", "2", "--steps", "6", "--tokens-per-step", "64", "--seed", "5", "--run-id", "syn"])
    return str(root)


_SPARK_RESULTS: dict = {}


@pytest.fixture
def spark_results(store, spark_session, monkeypatch):
    """Each Spark query the commands send is run on Spark once per store state: ``exposure``
    computes every exposure table whatever ``--by`` asks (ranks, kinds, groups, stragglers,
    modes; a2a_stragglers alone ~13 s on local[2]), so the three ``--by`` cases would run
    the same queries three times. Here the first case runs them on Spark and the others
    read those same Spark results (keyed by the query text, its parameters and the store's
    file fingerprint, so a write to the store runs them again). Every ``--engine spark``
    output is still Spark's rows, printed by the command."""
    from moetrace.storage import spark as ms

    real = ms.SparkSQL.sql

    def sql(self, query, params=None, dialect="duckdb"):
        key = (ms._store_fingerprint(Path(store)), query, None if params is None else tuple(params), dialect)
        if key not in _SPARK_RESULTS:
            _SPARK_RESULTS[key] = real(self, query, params, dialect)
        return _SPARK_RESULTS[key].clone()

    monkeypatch.setattr(ms.SparkSQL, "sql", sql)


def _json(args):
    return json.loads(_cli([*args, "--format", "json"]).output)


def _same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            x, y = ra[k], rb[k]
            if isinstance(x, float) and isinstance(y, (int, float)):
                assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), (k, x, y)
            else:
                assert x == y, (k, x, y)


def test_sql_on_spark_equals_duckdb(store):
    q = "SELECT layer, count(*) AS n, sum(tokens) AS tokens FROM expert_load WHERE run_id = 'syn' GROUP BY layer ORDER BY layer"
    _same(_json(["sql", store, "--engine", "spark", "--unsafe", q]), _json(["sql", store, q]))
    # every (step, layer) of a synthetic run sums to tokens_per_step x top_k = 64 x 4 (by hand)
    rows = _json(["sql", store, "--engine", "spark", "--unsafe",
                  "SELECT DISTINCT assignments FROM layer_skew WHERE run_id = 'syn'"])
    assert rows == [{"assignments": 256}]


@pytest.mark.parametrize("by", ["layer", "run", "step"])
def test_skew_on_spark_equals_duckdb(store, by):
    _same(_json(["skew", store, "--run", "syn", "--by", by, "--engine", "spark"]),
          _json(["skew", store, "--run", "syn", "--by", by]))


@pytest.mark.parametrize("by", ["rank", "kind", "straggler"])
def test_exposure_on_spark_equals_duckdb(store, spark_results, by):
    _same(_json(["exposure", store, "--run", "refrun", "--by", by, "--engine", "spark"]),
          _json(["exposure", store, "--run", "refrun", "--by", by]))


def test_bad_query_is_one_line_exit_2(store):
    r = _cli(["sql", store, "--engine", "spark", "--unsafe", "SELECT nope FROM layer_skew"], code=2)
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Spark SQL error" in lines[0] and "nope" in lines[0]


def _spy(spark_session, monkeypatch) -> list[str]:
    """The text of every statement sent to ``spark_session.sql`` from now on (the
    registration's CREATE VIEW statements and the queries; the tables' temp views are
    made by DataFrames, not statements)."""
    calls: list[str] = []
    real = spark_session.sql
    monkeypatch.setattr(spark_session, "sql", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def _made(calls) -> list[str]:
    """The temp views made by the statements ``calls``, in order."""
    import re

    return [m.group(1) for m in (re.match(r"\s*CREATE\s+OR\s+REPLACE\s+TEMPORARY\s+VIEW\s+`?(\w+)", c, re.I)
                                 for c in calls) if m]


def test_an_unchanged_store_is_registered_once_on_the_kept_session(store, spark_session, monkeypatch):
    """The kept session registers a store's tables once while its files are unchanged and
    makes each metric view once: ``register_store`` (every view) makes the views the
    commands above did not, and a second call, or a command's query over the unchanged
    store, runs no registration statement. After a write the tables are registered again
    and a view a query names is made again over them (a temp view keeps the plan it was
    analysed with): the new run is in it (one row per layer in layer_placement)."""
    from moetrace.storage import spark as ms
    from moetrace.storage.views import view_graph, views_closure

    names = ms.register_store(spark_session, store)
    assert names[-len(view_graph()):] == list(view_graph())
    calls = _spy(spark_session, monkeypatch)
    assert ms.register_store(spark_session, store) == names and calls == []
    q = "SELECT count(*) AS n FROM layer_placement WHERE run_id = 'syn2'"
    with ms.SparkSQL(store) as sp:
        assert sp.sql(q)["n"][0] == 0
    assert calls == [ms.transpile(q)]    # the query alone
    _cli(["synth", store, "--layers", "2", "--experts", "16", "--top-k", "4", "--ranks", "4",
          "--ranks-per-node", "2", "--steps", "3", "--tokens-per-step", "32", "--seed", "6", "--run-id", "syn2"])
    calls.clear()
    with ms.SparkSQL(store) as sp:           # a view two deep (three views to make: cheap)
        assert sp.sql(q)["n"][0] == 2        # one row per layer of the new run
    # the tables again (the store's own expert_load view), then layer_placement and what it reads
    assert _made(calls) == ["expert_load", *views_closure("layer_placement")]
    calls.clear()
    assert ms.register_store(spark_session, store, views=False) == names[:-len(view_graph())] and calls == []


def test_a_query_makes_only_the_views_it_reads(store, spark_session, monkeypatch):
    """A query naming one metric view makes that view and the views it reads, nothing else:
    layer_placement reads dense_experts and run_shape, dense_experts reads run_shape, and
    run_shape reads tables only (moetrace/storage/sql/10_rank_load.sql, by hand). A word
    in other case names the same view (Spark folds case); a second query makes nothing."""
    from moetrace.storage import spark as ms
    from moetrace.storage.views import views_closure

    ms.forget_registration()             # the tables anew: no metric view counts as made
    calls = _spy(spark_session, monkeypatch)
    with ms.SparkSQL(store) as sp:
        assert _made(calls) == ["expert_load"]        # the tables: the store's own view only
        calls.clear()
        n = sp.sql("SELECT count(*) AS n FROM LAYER_PLACEMENT WHERE run_id = 'syn'", dialect="spark")["n"][0]
        assert n == 2                                 # one row per layer
        want = ["run_shape", "dense_experts", "layer_placement"]
        assert _made(calls) == want == views_closure("layer_placement")
        calls.clear()
        sp.sql("SELECT l.layer FROM layer_placement l JOIN run_shape s USING (run_id)")
        assert _made(calls) == []


def test_a_view_spark_refuses_is_named_at_first_use(store, spark_session, monkeypatch):
    """A metric view Spark cannot take is a StoreError naming it when a query first names
    it (and the command's one line, exit 2); with strict=False it is left out, and so are
    the views that read it, while the rest are made."""
    from moetrace.errors import StoreError
    from moetrace.storage import spark as ms

    real = ms.spark_view_statement
    bad = "CREATE OR REPLACE TEMPORARY VIEW dense_experts AS SELECT nope FROM runs"
    monkeypatch.setattr(ms, "spark_view_statement", lambda v: bad if v == "dense_experts" else real(v))
    ms.forget_registration()
    with ms.SparkSQL(store) as sp:
        sp.sql("SELECT count(*) FROM step_layers")    # reads no refused view
        with pytest.raises(StoreError, match="metric view 'dense_experts' does not run on Spark"):
            sp.sql("SELECT * FROM layer_placement")
        reg = sp._reg
        ms._register_views(spark_session, reg, ["run_shape", "dense_experts", "layer_placement", "step_layers"],
                           strict=False)
        assert reg.failed == {"dense_experts", "layer_placement"} and {"run_shape", "step_layers"} <= reg.views
    r = _cli(["sql", store, "--engine", "spark", "--unsafe", "SELECT * FROM dense_experts"], code=2)
    assert "metric view 'dense_experts'" in r.output
    ms.forget_registration()             # the refused views are made from their own text next time

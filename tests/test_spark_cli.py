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
from click.testing import CliRunner

from moetrace.cli import cli

from .conftest import REPO

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SAMPLES = REPO / "sample_traces"


def _cli(args, code=0):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == code, f"moetrace {' '.join(args)} -> {r.exit_code}: {r.output}"
    return r


@pytest.fixture(scope="module")
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
        key = (ms._store_fingerprint(Path(store), True), query, None if params is None else tuple(params), dialect)
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


def test_an_unchanged_store_is_registered_once_on_the_kept_session(store, spark_session, monkeypatch):
    """The kept session re-registers a store only when its files changed: the second
    registration of an unchanged store runs no Spark statement; after a write it runs them
    all again and the new run is in the views. (The first call registers the store unless
    the commands above already did on this session, ~30 s each: either way it is registered
    once the call returns.)"""
    from moetrace.storage import spark as ms

    names = ms.register_store(spark_session, store)
    calls = []
    real = spark_session.sql
    monkeypatch.setattr(spark_session, "sql", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert ms.register_store(spark_session, store) == names and calls == []
    _cli(["synth", store, "--layers", "2", "--experts", "16", "--top-k", "4", "--ranks", "4",
          "--ranks-per-node", "2", "--steps", "3", "--tokens-per-step", "32", "--seed", "6", "--run-id", "syn2"])
    assert ms.register_store(spark_session, store) == names and len(calls) >= len(ms.spark_view_statements())
    n = real("SELECT count(*) AS n FROM layer_skew WHERE run_id = 'syn2'").collect()[0]["n"]
    assert n == 3 * 2          # 3 steps x 2 layers of the new run

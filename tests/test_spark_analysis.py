"""``materialize --engine spark`` and ``report --engine spark``: the stored analysis computed
on Spark holds the same rows as DuckDB's (moetrace/analyze/on_engine.py).

Two runs (tests/helpers/two_runs.py: a long run with step gaps, replicated experts and a
layer partly without placement; a dense synth run) are stored once, copied per engine;
every ``cache_<view>`` table of each run is compared row for row (floats to the last
bits of a sum's order). Shares conftest's Spark session.
"""
from __future__ import annotations

import shutil

import pytest

from moetrace.analyze import cache
from moetrace.run import Store

from .helpers import run_cli
from .helpers.two_runs import KEYS, _assert_same

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _cli(args, code=0):
    r = run_cli(*args, catch_exceptions=True)
    assert r.exit_code == code, f"moetrace {' '.join(args)} -> {r.exit_code}: {r.output}"
    return r


def _stored(path, rid: str) -> dict:
    st = Store(path)
    try:
        s = cache.state(st, rid)
        assert s.fresh, s.line()
        cid = s.header["cache_id"]
        return {v: st.sql(f"SELECT * EXCLUDE (cache_id) FROM {cache.table_of(v)} WHERE run_id = ? AND cache_id = ?",
                          [rid, cid]).sort(KEYS[v]) for v in cache.CACHED_VIEWS}
    finally:
        st.close()


def test_stored_analysis_on_spark_equals_duckdb(two_runs_template, tmp_path, spark_session):
    src, rids = two_runs_template
    duck, spark = tmp_path / "duck", tmp_path / "spark"
    shutil.copytree(src, duck)
    shutil.copytree(src, spark)
    _cli(["materialize", str(duck)])
    r = _cli(["materialize", str(spark), "--engine", "spark"])
    assert "on Spark" in r.output
    for rid in rids:
        want, got = _stored(duck, rid), _stored(spark, rid)
        for v in cache.CACHED_VIEWS:
            _assert_same(got[v], want[v], f"{rid} {v}")


def test_report_on_spark_stores_duckdbs_rows(two_runs_template, tmp_path, spark_session):
    src, rids = two_runs_template
    duck, spark = tmp_path / "duck", tmp_path / "spark"
    shutil.copytree(src, duck)
    shutil.copytree(src, spark)
    rid = rids[0]
    _cli(["report", str(duck), "--run", rid, "--quiet", "--out-dir", str(tmp_path / "r1")])
    _cli(["report", str(spark), "--run", rid, "--quiet", "--engine", "spark", "--out-dir", str(tmp_path / "r2")])
    want, got = _stored(duck, rid), _stored(spark, rid)
    for v in cache.CACHED_VIEWS:
        _assert_same(got[v], want[v], f"{rid} {v}")
    # the report drawn from Spark's rows is the report drawn from DuckDB's
    assert (tmp_path / "r1" / "report.md").read_text() == (tmp_path / "r2" / "report.md").read_text()

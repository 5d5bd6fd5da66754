"""The stored analysis cache (moetrace.analyze.cache): a run's per-(step, layer) views
computed once, written into the store, and read back instead of the expert_load rows.

What is checked: the report's whole-run distributions against numpy; the stored rows
against the live views, every column of every cached view, after re-opening the store;
that a report on a fresh cache reads no expert_load row (the run's expert_counts file is
overwritten with zeros, same name and size: every read of it fails); staleness (re-ingest,
another moetrace, changed view SQL, files removed); plans do not make it stale; a write
that fails midway or is cut short leaves the store byte for byte as it was.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from moetrace.analyze import cache, drop_materialized, materialize_layer_skew
from moetrace.analyze.materialize import ALL_VIEWS, DISTRIBUTION_VIEWS
from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import Store
from moetrace.storage import schema

from .helpers import SIGKILL_AT_REPLACE, invoke, module_fixture, tree_hash
from .helpers.two_runs import KEYS, _assert_same
from .helpers.two_runs import SYNTH as CFG


def _synth_store(path, seed=5, run_id="syn", **over) -> Store:
    st = Store(path, create=True)
    synth(st, SynthConfig(**{**CFG, **over, "seed": seed}), run_id=run_id)
    return st


def _counts(st: Store, rid: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, layers, counts[rows, E]) of a dense run, read from its Parquet files."""
    files = sorted((st.path / "expert_counts" / f"run_id={rid}").glob("*.parquet"))
    t = pl.concat([pl.read_parquet(f) for f in files]).sort("step", "layer")
    return t["step"].to_numpy(), t["layer"].to_numpy(), np.array(t["tokens"].to_list())


# ----------------------------------------------------------------------------- the new views
def test_distribution_views_match_numpy(tmp_path):
    st = _synth_store(tmp_path / "st")
    steps, layers, x = _counts(st, "syn")
    E, R = CFG["experts"], CFG["ranks"]
    for lyr in range(CFG["layers"]):
        sel = layers == lyr
        xl = x[sel]                                 # (steps, E), steps ascending
        n = xl.shape[0]
        # histogram of (step, expert) token counts: a dense row has all E experts
        vals, cnt = np.unique(xl, return_counts=True)
        h = st.sql("SELECT tokens, pairs FROM expert_token_hist WHERE run_id = 'syn' AND layer = ? ORDER BY tokens", [lyr])
        assert h["tokens"].to_list() == vals.tolist() and h["pairs"].to_list() == cnt.tolist()
        # bins of consecutive steps: step ord in bin ord * bins // n
        bins = min(n, 300)
        want = np.zeros((bins, E), np.int64)
        np.add.at(want, (np.arange(n) * bins) // n, xl)
        b = st.sql("SELECT bin, expert, tokens, bins, steps FROM expert_step_bins WHERE run_id = 'syn' AND layer = ?",
                   [lyr])
        got = np.zeros((bins, E), np.int64)
        got[b["bin"].to_numpy(), b["expert"].to_numpy()] = b["tokens"].to_numpy()
        assert (got == want).all() and set(b["bins"]) == {bins} and set(b["steps"]) == {n}
        # rank totals under contiguous placement (no placement recorded): expert e on rank e*R//E
        r = st.sql("SELECT rank, tokens FROM rank_totals WHERE run_id = 'syn' AND layer = ? ORDER BY rank", [lyr])
        want_r = np.bincount(np.arange(E) * R // E, weights=xl.sum(axis=0), minlength=R)
        np.testing.assert_allclose(r["tokens"].to_numpy(), want_r[r["rank"].to_numpy()], rtol=1e-12)
        assert set(r["rank"].to_list()) == set(np.nonzero(want_r)[0].tolist())


@module_fixture
def two_runs(two_runs_template):
    """A long-layout run with a recorded placement, gaps and replicas, and a dense run
    (tests/helpers/two_runs.py: the store test_analysis_materialize.py reads too, on this module's
    own connection)."""
    path, rids = two_runs_template
    st = Store(path)
    yield st, rids
    st.close()


@module_fixture
def live_distributions(two_runs_live):
    """Each run's distribution views computed live once (by the plain views, on another
    connection to the same store), for every batch size below to be compared against."""
    return {rid: {v: views[v] for v in DISTRIBUTION_VIEWS} for rid, views in two_runs_live.items()}


@pytest.mark.parametrize("batch_steps", [1, 4, None])
def test_batched_distribution_views_equal_the_views(two_runs, live_distributions, batch_steps):
    st, rids = two_runs
    for rid in rids:
        want = live_distributions[rid]
        m = materialize_layer_skew(st, rid, batch_steps, views=ALL_VIEWS)
        try:
            assert set(ALL_VIEWS) <= set(m.tables)
            for v in DISTRIBUTION_VIEWS:
                _assert_same(st.sql(f"SELECT * FROM {v}").sort(KEYS[v]), want[v], f"{rid} {v} batch={batch_steps}")
        finally:
            drop_materialized(st.con, m)


def test_cache_tables_are_the_views_columns():
    """schemas/cache_<view>.json holds the view's columns, in order, with their types."""
    duck = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "float64": "DOUBLE", "bool": "BOOLEAN"}
    from moetrace.commands.store_cmds import _view_columns, _views_columns

    described = _views_columns(cache.CACHED_VIEWS)   # _view_columns of each, on one empty store
    assert described[cache.CACHED_VIEWS[0]] == _view_columns(cache.CACHED_VIEWS[0])
    for v in cache.CACHED_VIEWS:
        ts = schema.get(cache.table_of(v))
        cols = [(c.name, duck[c.type]) for c in ts.columns if c.name != "cache_id"]
        assert cols == described[v], v
        assert all(c.description and not c.description.startswith("TODO") for c in ts.columns), v
    assert schema.get(cache.HEADER).column_names[:2] == ["run_id", "cache_id"]


# ----------------------------------------------------------------------------- stored == live
def test_stored_rows_equal_the_live_views_after_reopening(tmp_path, runner, cli, two_runs_template, two_runs_live):
    # a byte-for-byte copy of the two-run store: the live views are those of the template's
    # files (tests/helpers/two_runs.py: computed by the plain views, before any cache existed)
    template, rids = two_runs_template
    path = tmp_path / "st"
    shutil.copytree(template, path)
    res = invoke(runner, cli, "materialize", path, "--batch-steps", "4")
    assert res.exit_code == 0, res.output
    assert sum("stored analysis" in ln for ln in res.output.splitlines()) == 2
    st = Store(path)          # re-opened: the stored rows against the plain views of the same files
    for rid in rids:
        stt = cache.state(st, rid)
        assert stt.fresh, stt
        for v in cache.CACHED_VIEWS:
            stored = st.sql(f"SELECT * EXCLUDE (cache_id) FROM {cache.table_of(v)} WHERE run_id = ?", [rid])
            _assert_same(stored.sort(KEYS[v]), two_runs_live[rid][v], f"{rid} stored {v}")
        # and read back through the views (the TEMP views the report and skew use)
        m = cache.load(st, stt)
        try:
            for v in cache.CACHED_VIEWS:
                assert st.sql(f"SELECT count(*) AS n FROM {v}")["n"][0] == json.loads(stt.header["rows_json"])[v]
            for v in ("skew_summary", "run_skew_summary"):     # they read the stored layer_skew
                got = st.sql(f"SELECT * FROM {v} WHERE run_id = ?", [rid])
                assert got.height > 0
        finally:
            drop_materialized(st.con, m)
        assert st.sql("SELECT count(*) AS n FROM duckdb_views() WHERE temporary AND NOT internal")["n"][0] == 0
    st.close()
    res = invoke(runner, cli, "materialize", path)       # fresh: nothing computed again
    assert res.exit_code == 0 and res.output.count(": kept") == 2, res.output


def _zero_expert_rows(path, rid: str) -> None:
    """The data pages of every expert_counts file of the run overwritten with zeros: same
    name, size and footer (the fingerprint and the views' schema are unchanged), but any
    query that reads a row of it fails."""
    for f in (path / "expert_counts" / f"run_id={rid}").glob("*.parquet"):
        data = bytearray(f.read_bytes())
        footer = int.from_bytes(data[-8:-4], "little")
        end = len(data) - 8 - footer
        assert data[:4] == b"PAR1" and end > 4
        data[4:end] = bytes(end - 4)
        f.write_bytes(bytes(data))


def test_report_on_a_fresh_cache_reads_no_expert_load(tmp_path, runner, cli):
    from moetrace.report.build import build_report

    path = tmp_path / "st"
    st = _synth_store(path)
    # a stored replay: without one the replay section runs a what-if, which reads expert_load
    # (replay's own business, not a per-(step, layer) section)
    res = invoke(runner, cli, "replay", path, "--policy", "eplb", "--replicas", "8", "--no-rank-rows")
    assert res.exit_code == 0, res.output
    first = build_report(st, "syn", tmp_path / "r1", html_out=False)         # computes and stores
    assert cache.state(st, "syn").fresh
    st.close()
    _zero_expert_rows(path, "syn")
    st = Store(path)
    lines: list[str] = []
    again = build_report(st, "syn", tmp_path / "r2", html_out=False, progress=lines.append)
    assert not [s.key for s in again.sections if "failed" in s.title]
    assert (tmp_path / "r2" / "report.md").read_text() == (tmp_path / "r1" / "report.md").read_text()
    assert [s.key for s in again.sections] == [s.key for s in first.sections]
    for f in first.figures:     # the same figures, from the stored rows
        assert (tmp_path / "r2" / f.path.name).read_bytes() == f.path.read_bytes()
    # the control: without the cache the same report does read those pages, and fails
    import duckdb

    with pytest.raises(duckdb.Error):
        build_report(st, "syn", tmp_path / "r3", html_out=False, reuse=False, save=False)
    st.close()


def test_skew_and_tokens_read_the_cache(tmp_path, runner, cli):
    path = tmp_path / "st"
    st = _synth_store(path)
    want_skew = st.run("syn").skew("layer")
    want_tpe = st.sql("SELECT * FROM tokens_per_expert WHERE run_id = 'syn' ORDER BY step, layer")
    st.run("syn").materialize()
    st.close()
    _zero_expert_rows(path, "syn")
    st = Store(path)
    r = st.run("syn")
    # means over rows read in another order: last-bit differences only (_assert_same: rtol 1e-12)
    _assert_same(r.skew("layer").sort("layer"), want_skew.sort("layer"), "skew from the stored rows")
    _assert_same(r.tokens_per_expert(), want_tpe, "tokens_per_expert from the stored rows")
    with pytest.raises(Exception):  # noqa: B017 (any error of the read will do)     # the control: the live view does read the zeroed pages
        st.sql("SELECT * FROM tokens_per_expert WHERE run_id = 'syn'")
    st.close()


# ----------------------------------------------------------------------------- staleness
def test_reingested_run_is_recomputed_and_says_so(tmp_path, runner, cli):
    path = tmp_path / "st"
    st = _synth_store(path, seed=5)
    st.run("syn").materialize()
    old = cache.state(st, "syn").header["cache_id"]
    st.close()
    # the run deleted by hand (its own partitions; the cache's stay) and ingested again under its id
    for table in ("runs", "expert_counts", "steps", "true_popularity"):
        shutil.rmtree(path / table / "run_id=syn", ignore_errors=True)
    st = _synth_store(path, seed=6)
    s = cache.state(st, "syn")
    assert s.status == "stale" and "input rows changed" in s.reason
    st.close()
    res = invoke(runner, cli, "report", path, "--quiet", "--out-dir", tmp_path / "rep")
    assert res.exit_code == 0, res.output
    said = [ln for ln in res.output.splitlines() if ln.startswith("moetrace: run syn")]
    assert len(said) == 1 and "stale (the run's input rows changed (re-ingested?)): recomputing" in said[0]
    st = Store(path)
    new = cache.state(st, "syn")
    assert new.fresh and new.header["cache_id"] != old
    # the older generation's files are gone: one file per cache table, one header row
    assert st.sql("SELECT count(*) AS n FROM analysis_cache")["n"][0] == 1
    for v in cache.CACHED_VIEWS:
        assert len(list((path / cache.table_of(v) / "run_id=syn").glob("*.parquet"))) <= 1
        assert st.sql(f"SELECT count(*) AS n FROM {cache.table_of(v)} WHERE cache_id = ?", [old])["n"][0] == 0
    want = st.sql("SELECT * FROM layer_skew WHERE run_id = 'syn'").sort("step", "layer")      # live, seed 6
    got = st.sql("SELECT * EXCLUDE (cache_id) FROM cache_layer_skew").sort("step", "layer")
    _assert_same(got, want, "re-ingested layer_skew")
    st.close()


def test_key_changes_make_it_stale(tmp_path, monkeypatch, runner, cli):
    path = tmp_path / "st"
    st = _synth_store(path)
    st.run("syn").materialize()
    assert cache.state(st, "syn").fresh
    # a plan appends placement rows the views do not read: still fresh
    res = invoke(runner, cli, "plan", path, "--policy", "greedy", "--replicas", "8", "--plan-id", "p1")
    assert res.exit_code == 0, res.output
    assert cache.state(st, "syn").fresh
    with monkeypatch.context() as mp:
        mp.setattr(cache, "__version__", "99.0")
        s = cache.state(st, "syn")
        assert s.status == "stale" and "moetrace is another version (stored by" in s.reason and "99.0" in s.reason
    with monkeypatch.context() as mp:
        mp.setattr(cache, "views_sha256", lambda views=None: "0" * 64)
        assert cache.state(st, "syn").reason == "the view SQL changed"
    # the SQL hash follows the view text
    from moetrace.storage import views as views_mod

    g = dict(views_mod.view_graph())
    i, stmt, deps = g["layer_skew"]
    with monkeypatch.context() as mp:
        mp.setattr(cache, "view_graph", lambda: {**g, "layer_skew": (i, stmt + " ", deps)})
        assert cache.views_sha256() != cache.state(st, "syn").header["views_sha256"]
    assert cache.state(st, "syn").fresh
    # a stored table that lost its rows (a file removed by hand) is never read as empty
    f = next((path / "cache_layer_skew" / "run_id=syn").glob("*.parquet"))
    f.unlink()
    s = cache.state(st, "syn")
    assert s.status == "stale" and "cache_layer_skew holds 0 of its" in s.reason
    st.close()


def test_clear_removes_every_stored_file(tmp_path, runner, cli):
    path = tmp_path / "st"
    _synth_store(path).close()
    before = tree_hash(path)
    assert invoke(runner, cli, "materialize", path).exit_code == 0
    assert invoke(runner, cli, "materialize", path, "--force").exit_code == 0    # a second generation replaces the first
    assert len(list((path / "cache_layer_skew").rglob("*.parquet"))) == 1
    res = invoke(runner, cli, "materialize", path, "--status")
    assert res.exit_code == 0 and "is fresh" in res.output
    res = invoke(runner, cli, "materialize", path, "--clear")
    assert res.exit_code == 0 and f"removed {len(cache.cache_tables())} stored-analysis files" in res.output
    assert tree_hash(path) == before
    assert "no stored analysis" in invoke(runner, cli, "materialize", path, "--status").output


# ----------------------------------------------------------------------------- failed writes
def test_a_write_that_fails_midway_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    from moetrace.report.build import build_report

    path = tmp_path / "st"
    st = _synth_store(path)
    before = tree_hash(path)
    real = pq.ParquetWriter.write_table
    calls = [0]

    def failing(self, *a, **k):
        calls[0] += 1
        if calls[0] == 4:          # the fourth table of the transaction
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    lines: list[str] = []
    rep = build_report(st, "syn", tmp_path / "rep", html_out=False, progress=lines.append)
    assert calls[0] >= 4 and not [s for s in rep.sections if "failed" in s.title]
    assert any("were not stored" in ln and "No space left on device" in ln for ln in lines), lines
    assert tree_hash(path) == before
    monkeypatch.setattr(pq.ParquetWriter, "write_table", real)
    # the explicit command says so as an error, exit 1, store unchanged
    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    calls[0] = 0
    from moetrace.errors import StoreError

    with pytest.raises(StoreError, match="nothing was written"):
        st.run("syn").materialize()
    assert tree_hash(path) == before
    st.close()


def test_a_write_cut_short_between_renames_is_rolled_back(tmp_path, monkeypatch):
    """A crash after the journal and some renames, before the header's: the next writer's
    recovery removes the renamed files; a reader meanwhile sees no cache."""
    path = tmp_path / "st"
    st = _synth_store(path)
    before = tree_hash(path)
    real, n = os.replace, [0]

    class Crash(BaseException):
        pass

    def replace(a, b):
        n[0] += 1
        if n[0] == 4:      # journal renamed (1), then three data files: the crash
            raise Crash()
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        st.run("syn").materialize()
    monkeypatch.setattr(os, "replace", real)
    assert tree_hash(path) == before       # the writer's own undo ran (a BaseException)
    st.close()


@pytest.mark.slow
def test_a_sigkilled_store_write_leaves_no_cache(tmp_path):
    """A real SIGKILL at the journal's rename (1), amid the data files' (6) and at the
    header's (11, renamed last): a reader sees no cache, and the next writer's recovery
    leaves the store byte for byte as before."""
    import signal
    import subprocess
    import sys

    from .helpers import REPO

    template = tmp_path / "t"
    _synth_store(template).close()
    before = tree_hash(template)
    for k in (1, 6, 1 + len(cache.cache_tables())):
        path = tmp_path / f"s{k}"
        shutil.copytree(template, path)
        res = subprocess.run([sys.executable, "-c", SIGKILL_AT_REPLACE.format(repo=str(REPO)), str(k), "materialize", str(path)],
                             capture_output=True, text=True, timeout=300, cwd=str(REPO))
        assert res.returncode == -signal.SIGKILL, res.stderr
        st = Store(path)
        assert cache.state(st, "syn").status == "absent", k
        assert st.sql("SELECT count(*) AS n FROM cache_layer_skew")["n"][0] == 0
        st.close()
        Store(path, create=True).close()      # a writer's open recovers
        assert tree_hash(path) == before, k

"""Every write is one transaction: plans, replays, sweeps, calibrations, catalogs
and ingests, killed between each pair of renames, leave the store exactly as before or
exactly as after, for a reader that opens it right away (no recovery) and after the next
writer's recovery; a reader opened before a table's first file sees it after the write.

A crash is simulated at the k-th crash point (each ``os.replace`` and the journal's removal):
the store folder is copied as it is on disk at that instant (what a SIGKILL would leave,
the lock released). The copy is what is checked. What is on disk at the k-th point depends
only on what the write did before it, so one write copies the store at every point (a
write aborted at its k-th point would have left the same copy; one per write is, and the
two are compared). One real SIGKILL test (a subprocess, as tests/test_store_atomic.py does
for ingests) covers a plan.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal

import pyarrow as pa
import pytest

from moetrace.cli import cli
from moetrace.storage import schema
from moetrace.storage.store import Store

from .helpers import REPO, SIGKILL_AT_REPLACE, module_fixture, tree_hash
from .helpers.forked_writers import _ForkedWriters
from .helpers.slot_store import build_slot_store

L, S = 2, 12  # the slot_store's shape: a plan is L * S placement rows


class Crash(BaseException):
    """Stands for SIGKILL: not an Exception, so no handler of moetrace turns it into a message."""


def _physical_counts(path) -> dict[str, int]:
    """Rows per table over every data file on disk (footers, read here, not by the store)."""
    import pyarrow.parquet as pq

    out = {}
    for t in schema.load_all():
        n = sum(pq.ParquetFile(f).metadata.num_rows for f in (path / t).glob("run_id=*/*.parquet"))
        if n:
            out[t] = n
    return out


def _visible_counts(path) -> dict[str, int]:
    """Rows per table as a reader sees them (the views, no recovery): one query counting
    every table's view."""
    st = Store(path)
    got = st.sql(" UNION ALL ".join(f"SELECT '{t}' AS t, count(*) AS n FROM \"{t}\"" for t in schema.load_all()))
    st.close()
    return {t: n for t, n in zip(got["t"].to_list(), got["n"].to_list()) if n}


def _cli(args: list[str]) -> None:
    cli.main(args=[str(a) for a in args], prog_name="moetrace", standalone_mode=False)


def _patch_points(monkeypatch, store, point) -> None:
    """Call ``point()`` before every os.replace of a path under ``store`` and every unlink
    of one of its journal files: the write's crash points."""
    real_replace, real_unlink = os.replace, pathlib.Path.unlink

    def replace(a, b, *args, **kw):
        if str(a).startswith(str(store)):
            point()
        return real_replace(a, b, *args, **kw)

    def unlink(self, *args, **kw):
        if self.parent.name == ".txn" and self.name.endswith(".json") and str(self).startswith(str(store)):
            point()
        return real_unlink(self, *args, **kw)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)


def _crash_points(monkeypatch, k: int, store, snap) -> list[int]:
    """At the k-th crash point (:func:`_patch_points`) copy ``store`` to ``snap`` and raise
    Crash. Returns a one-item list counting the points."""
    n = [0]

    def point():
        n[0] += 1
        if n[0] == k:
            shutil.copytree(store, snap, symlinks=True)
            raise Crash()

    _patch_points(monkeypatch, store, point)
    return n


def _snapshot_points(monkeypatch, store, snaps) -> list[int]:
    """Copy ``store`` to ``snaps / f"crash{k}"`` at every crash point k
    (:func:`_patch_points`) and go on: the copies are what a write killed at each point
    leaves. Returns a one-item list counting the points."""
    n = [0]

    def point():
        n[0] += 1
        shutil.copytree(store, snaps / f"crash{n[0]}", symlinks=True)

    _patch_points(monkeypatch, store, point)
    return n


@module_fixture
def slot_template(tmp_path_factory):
    """test_replay's slot_store with a catalog.duckdb (so every write also replaces it: one
    more crash point), built once: read-only, a test copies it."""
    template, _ = build_slot_store(tmp_path_factory.mktemp("slots"))
    Store(template, create=True).write_catalog()
    return template


def _seed_csv(tmp_path):
    p = tmp_path / "more.csv"
    p.write_text("step,layer,expert,tokens\n0,0,0,5\n0,0,1,3\n0,1,0,4\n0,1,1,4\n")
    return p


WRITES = {
    "plan": lambda st, tmp: ["plan", st, "--policy", "greedy", "--replicas", "4", "--plan-id", "p1"],
    "replay": lambda st, tmp: ["replay", st, "--plan", "recorded"],
    "sweep": lambda st, tmp: ["sweep", st, "--policy", "eplb-global", "--replicas", "0,4", "--save", "--format", "json"],
    "catalog": lambda st, tmp: ["catalog", st],
    "ingest": lambda st, tmp: ["ingest", _seed_csv(tmp), "--store", st, "--run-id", "more"],
}


# plan and replay (the cases) run by default; the others take a minute each on a loaded machine
@pytest.mark.parametrize("write", [w if w in ("plan", "replay") else pytest.param(w, marks=pytest.mark.slow)
                                   for w in sorted(WRITES)])
def test_killed_between_any_two_renames_store_is_before_or_after(slot_template, tmp_path, monkeypatch, write):
    template = slot_template
    before_hash, before = tree_hash(template), _physical_counts(template)
    # the write once, whole: how many crash points it has, what "after" is, and the store
    # as it is on disk at each point (crash1 .. crashN)
    ref, snaps = tmp_path / "ref", tmp_path / "snaps"
    shutil.copytree(template, ref)
    snaps.mkdir()
    with monkeypatch.context() as m:
        n = _snapshot_points(m, ref, snaps)
        _cli(WRITES[write](ref, tmp_path))
    points, after = n[0], _physical_counts(ref)
    seen_before, seen_after = _visible_counts(template), _visible_counts(ref)  # views (expert_load: + dense rows)
    assert points >= (1 if write == "catalog" else 3), points  # journal, >= 1 data file, its removal
    assert sorted(p.name for p in snaps.iterdir()) == sorted(f"crash{k}" for k in range(1, points + 1))
    if write == "plan":  # by hand: a plan of the 2 x 12 slots is 24 placement rows and one plans row
        assert after == {**before, "placement": before["placement"] + L * S, "plans": 1}
    elif write in ("replay", "sweep"):  # a replay's rows come with their replay_runs rows
        assert after["replay_runs"] == (1 if write == "replay" else 2) and after.get("replay_layer", 0) > 0
    # one write really aborted at a crash point (the first data file's; the catalog's only
    # one): the exception gets out of the command, and the store copied at that instant
    # holds what the whole write's copy at that point holds
    k_abort = min(2, points)
    store, aborted = tmp_path / "aborted", tmp_path / "aborted-crash"
    shutil.copytree(template, store)
    with monkeypatch.context() as m:
        _crash_points(m, k_abort, store, aborted)
        with pytest.raises(Crash):
            _cli(WRITES[write](store, tmp_path))
    assert _physical_counts(aborted) == _physical_counts(snaps / f"crash{k_abort}"), k_abort
    assert _visible_counts(aborted) == _visible_counts(snaps / f"crash{k_abort}"), k_abort
    outcomes = []
    for k in range(1, points + 1):
        snap = snaps / f"crash{k}"
        # a reader opening the crashed store (no recovery) sees all of the write or none of it
        seen = _visible_counts(snap)
        assert seen in (seen_before, seen_after), (write, k, seen)
        # the next writer's open recovers: exactly before (byte for byte) or exactly after
        Store(snap, create=True).close()
        assert not (snap / ".txn").exists() and not (snap / ".staging").exists()
        assert not list(snap.glob(".catalog-*")), k
        if tree_hash(snap) == before_hash:
            outcomes.append("before")
        else:
            assert _physical_counts(snap) == after, (write, k)
            assert _visible_counts(snap) == seen_after, (write, k)
            outcomes.append("after")
    assert outcomes[0] == "before", outcomes
    if write != "catalog":  # a kill after the commit file's rename rolls forward
        assert "after" in outcomes, outcomes


def test_plan_killed_before_its_plans_row_lists_no_plan(slot_store, tmp_path, monkeypatch):  # noqa: F811
    """The issue's case: placement renamed, plans not yet: `plan --list` must not list it."""
    from click.testing import CliRunner

    path, _ = slot_store
    snap = tmp_path / "crash"
    with monkeypatch.context() as m:
        _crash_points(m, 3, path, snap)  # 1: journal, 2: placement, 3: plans (the commit file)
        with pytest.raises(Crash):
            _cli(["plan", path, "--policy", "greedy", "--replicas", "4", "--plan-id", "p1"])
    assert (snap / ".txn").is_dir() and any((snap / "placement").glob("*/*.parquet"))
    r = CliRunner().invoke(cli, ["plan", str(snap), "--list", "--json"])
    assert r.exit_code == 0, r.output
    assert "p1" not in r.output and "recorded" in r.output
    # and the next writer rolls it back: the plan id is free again
    r = CliRunner().invoke(cli, ["plan", str(snap), "--policy", "greedy", "--replicas", "4", "--plan-id", "p1"])
    assert r.exit_code == 0, r.output
    st = Store(snap)
    assert st.sql("SELECT count(*) AS n FROM placement WHERE plan_id = 'p1'")["n"][0] == L * S
    assert st.sql("SELECT count(*) AS n FROM plans WHERE plan_id = 'p1'")["n"][0] == 1


def test_generic_append_calibration_is_atomic(slot_store, tmp_path, monkeypatch):  # noqa: F811
    """Calibrations go through Store.append with one table; two tables with no header
    table commit on the last one given."""
    path, _ = slot_store
    st = Store(path)
    before = _physical_counts(path)
    plans = pa.table({"plan_id": ["x"], "policy": ["manual"], "start_plan_id": pa.array([None], pa.string()),
                      "fit_start": pa.array([None], pa.int64()), "fit_end": pa.array([None], pa.int64()),
                      "fit_steps": pa.array([None], pa.int64()), "created_at_ns": [1], "params_json": ["{}"]})
    placement = pa.table({"plan_id": ["x"] * 2, "layer": [0, 0], "slot": [0, 1], "rank": [0, 0], "node": [0, 0],
                          "expert": [0, 1]})
    snap = tmp_path / "crash"
    with monkeypatch.context() as m:
        _crash_points(m, 2, path, snap)  # 1: journal, 2: the first data file (placement: plans is last)
        with pytest.raises(Crash):
            st.append("slots", {"plans": plans, "placement": placement})
    assert _visible_counts(snap) == before
    Store(snap, create=True)
    assert _physical_counts(snap) == before


def test_reader_opened_before_a_tables_first_file_sees_it(slot_store):  # noqa: F811
    path, _ = slot_store
    reader = Store(path)
    assert reader.sql("SELECT count(*) AS n FROM plans")["n"][0] == 0  # views defined: plans is empty
    assert reader.sql("SELECT count(*) AS n FROM replay_runs")["n"][0] == 0
    writer = Store(path, create=True)
    from moetrace.placement.plan_files import plan_ids

    _cli(["plan", path, "--policy", "greedy", "--replicas", "4", "--plan-id", "p1"])
    _cli(["replay", path, "--plan", "recorded"])
    # the same reader, not reopened
    assert reader.sql("SELECT count(*) AS n FROM plans")["n"][0] == 1
    assert reader.sql("SELECT count(*) AS n FROM placement WHERE plan_id = 'p1'")["n"][0] == L * S
    assert reader.sql("SELECT count(*) AS n FROM replay_runs")["n"][0] == 1
    assert plan_ids(reader, "slots") == ["p1", "recorded"]
    writer.close()


def test_reader_sees_a_new_run_without_reopening(tmp_path):
    st_path = tmp_path / "st"
    reader = Store(st_path, create=True)
    assert reader.sql("SELECT count(*) AS n FROM expert_load")["n"][0] == 0
    _cli(["ingest", _seed_csv(tmp_path), "--store", st_path])
    assert reader.run_ids() == ["more"]
    assert reader.sql("SELECT sum(tokens) AS t FROM expert_load")["t"][0] == 5 + 3 + 4 + 4


def test_out_inside_a_store_is_refused(slot_store, tmp_path):  # noqa: F811
    from click.testing import CliRunner

    path, _ = slot_store
    before = tree_hash(path)
    for args in (["runs", path, "-o", path / "runs.csv"], ["runs", path, "-o", path / "placement" / "x.parquet"],
                 ["plan", path, "--policy", "greedy", "--replicas", "4", "--no-store", "--export", path / "plan.json"],
                 ["report", path, "--out-dir", path / "rep"]):
        r = CliRunner().invoke(cli, [str(a) for a in args])
        assert r.exit_code == 2, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1 and "inside the store" in r.output, r.output
    assert tree_hash(path) == before
    link = tmp_path / "link"
    link.symlink_to(path)
    r = CliRunner().invoke(cli, ["runs", str(path), "-o", str(link / "x.csv")])
    assert r.exit_code == 2 and tree_hash(path) == before
    r = CliRunner().invoke(cli, ["runs", str(path), "-o", str(tmp_path / "fine.csv")])
    assert r.exit_code == 0 and (tmp_path / "fine.csv").is_file()


# ------------------------------------------------------------------ a real SIGKILL
@pytest.mark.slow
def test_sigkilled_plan_leaves_before_or_after(slot_store, tmp_path):  # noqa: F811
    template, _ = slot_store
    before_hash, before = tree_hash(template), _physical_counts(template)
    # each kill in its own process, forked from one that imported the CLI and the plan's modules
    writers = _ForkedWriters(tmp_path, SIGKILL_AT_REPLACE.format(repo=str(REPO)), preload=(
        "moetrace.cli", "moetrace.commands.replay_cmds", "moetrace.run", "moetrace.placement.plans",
        "moetrace.placement.plan_files", "moetrace.storage.check"))
    for k in (1, 2, 3):  # journal, placement, plans
        store = tmp_path / f"s{k}"
        shutil.copytree(template, store)
        res = writers(k, "plan", store, "--policy", "greedy", "--replicas", "4", "--plan-id", "p1")
        assert res.returncode == -signal.SIGKILL, res.stderr
        seen = _visible_counts(store)
        after = {**before, "placement": before["placement"] + L * S, "plans": 1}
        assert seen in (before, after), (k, seen)
        Store(store, create=True)
        assert tree_hash(store) == before_hash if seen == before else _physical_counts(store) == after
    writers.close()

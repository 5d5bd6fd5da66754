"""Transactions a store cannot be tricked into undoing, and commands of several
transactions (families 6, 9 and 10 of the round-3 audit; docs/hardening.md).

- 6: a journal planted under the name of a committed transaction (generated: every way
  of listing some or all of its files with an absent commit file, for a run's ingest and a
  plan's append) is refused by every writer with one line naming it and the store left
  byte for byte; readers never recover or write (``report --no-save`` included), and a
  real crash's journal is still rolled back by the next writer.
- 9: ``materialize`` failing with ENOSPC at any rename of the second or third run says
  which runs were stored, and a rerun stores the rest.
- 10: a SIGKILL at any rename of ``ingest a.csv b.csv`` or of ``replay --replan-every``
  leaves whole transactions: a rerun of the ingest completes the set; the drift replay's
  three replays land together or not at all."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moetrace.storage.store import Store

from .helpers import REPO, SIGKILL_AT_REPLACE
from .test_hostile3_store import GIB, fresh, one_line, run_cli, seeded, tree_hash  # noqa: F401


def _txid(f: Path) -> str:
    return f.name[5:17]


def _files_of(st: Path, table: str) -> list[Path]:
    return sorted((st / table).glob("run_id=*/*.parquet"))


def _plan(st: Path, tmp_path: Path) -> None:
    res, _ = run_cli([["plan", st, "--policy", "greedy", "--replicas", "0", "--plan-id", "p1"]], tmp_path)
    assert res[0][0] == 0, res


def _journal(st: Path, txid: str, files: list[str], commit: str | None) -> Path:
    (st / ".txn").mkdir(exist_ok=True)
    j = st / ".txn" / f"{txid}.json"
    j.write_text(json.dumps({"files": files, "commit_file": commit}))
    return j


def _rel(st: Path, f: Path) -> str:
    return str(f.relative_to(st))


def planted(kind: str):
    """A journal named after the run's ingest (``run``) or the plan's append (``plan``)."""
    def plant(st: Path) -> Path:
        head, body = ("runs", "expert_counts") if kind.startswith("run") else ("plans", "placement")
        h = _files_of(st, head)[0]
        x = _txid(h)
        b = [f for f in _files_of(st, body) if _txid(f) == x][0]
        ghost = f"calibration/run_id=seed/part-{x}.parquet"   # absent: a commit file never renamed
        files = {"body-only": [_rel(st, b), ghost],
                 "all-with-ghost-commit": [_rel(st, b), _rel(st, h), ghost],
                 "all-no-commit": [_rel(st, b), _rel(st, h)],
                 "header-first": [_rel(st, h), _rel(st, b)]}[kind.split(":")[1]]
        commit = None if kind.endswith("no-commit") else files[-1]
        return _journal(st, x, files, commit)
    plant.__name__ = kind.replace(":", "_")
    return plant


PLANTED = [planted(f"{w}:{k}") for w in ("run", "plan")
           for k in ("body-only", "all-with-ghost-commit", "all-no-commit", "header-first")]


@pytest.fixture(scope="module")
def planned(seeded, tmp_path_factory) -> Path:
    """The seeded store with a committed plan (an append: placement + plans)."""
    import shutil

    d = tmp_path_factory.mktemp("planned")
    st, _ = fresh(seeded, d)
    _plan(st, d)
    out = d / "template"
    shutil.copytree(st, out)
    return out


@pytest.mark.parametrize("plant", PLANTED, ids=lambda f: f.__name__)
def test_a_journal_naming_a_committed_transaction_is_refused(plant, planned, tmp_path):
    st, b = fresh(planned, tmp_path)
    j = plant(st)
    before = tree_hash(tmp_path, "out")
    writers = [["ingest", st, b], ["materialize", st], ["plan", st, "--policy", "greedy", "--plan-id", "p2"]]
    readers = [["runs", st], ["sql", st, "SELECT count(*) FROM placement"], ["skew", st],
               ["report", st, "--out-dir", tmp_path / "out" / "rep", "--no-save", "--quiet"]]
    res, peak = run_cli(writers + readers + [["check", st]], tmp_path)
    for r in res[:len(writers)]:
        one_line(r, str(j))
    for argv, r in zip(readers, res[len(writers):]):
        assert r[0] in (0, 2) and "Traceback" not in r[1], (argv, r)
    assert res[-1][0] == 2 and str(j) in res[-1][2], res[-1]
    assert peak < GIB
    assert tree_hash(tmp_path, "out") == before


def test_a_crash_journal_is_still_rolled_back_and_readers_never_recover(planned, tmp_path):
    st, b = fresh(planned, tmp_path)
    x = "0123456789ab"   # a write that crashed after its journal, before any rename
    j = _journal(st, x, [f"expert_load/run_id=new/part-{x}.parquet", f"runs/run_id=new/part-{x}.parquet"],
                 f"runs/run_id=new/part-{x}.parquet")
    before = tree_hash(tmp_path, "out")
    res, _ = run_cli([["runs", st], ["skew", st], ["sql", st, "SELECT count(*) FROM runs"],
                      ["report", st, "--out-dir", tmp_path / "out" / "rep", "--no-save", "--quiet"], ["check", st]],
                     tmp_path)
    assert [r[0] for r in res] == [0, 0, 0, 0, 0], res
    assert tree_hash(tmp_path, "out") == before and j.exists()     # readers: nothing written, nothing recovered
    res, _ = run_cli([["ingest", st, b]], tmp_path)
    assert res[0][0] == 0 and not j.exists(), res                  # the next writer rolls it back


# ----------------------------------------------------------------------------- family 9
def _three_runs(seeded: Path, tmp_path: Path) -> Path:
    st, _ = fresh(seeded, tmp_path)
    for i in (1, 2):
        f = tmp_path / "in" / f"r{i}.csv"
        f.write_text("step,layer,expert,tokens\n" + "".join(f"{s},0,{e},{(s + e + i) % 3}\n"
                                                            for s in range(3) for e in range(4)))
        res, _ = run_cli([["ingest", st, f, "--ranks", "2", "--top-k", "1"]], tmp_path)
        assert res[0][0] == 0, res
    return st


@pytest.mark.parametrize("at", [1, 5, 9, 14])
def test_materialize_on_a_full_disk_says_what_was_stored(at, seeded, tmp_path, runner, cli, monkeypatch):
    """ENOSPC at the ``at``-th rename into the store after the first run's analysis is
    stored: one line naming the runs stored and the rerun; the rerun completes the set."""
    st = _three_runs(seeded, tmp_path)
    real, n = os.replace, [0]
    first = {}

    def replace(a, b):
        if str(b).startswith(str(st)) and "/.txn/" not in str(b):
            if "analysis_cache" in str(b) and not first:
                first["done"] = True      # the first run's commit: count from here
            elif first:
                n[0] += 1
                if n[0] == at:
                    raise OSError(errno.ENOSPC, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    res = runner.invoke(cli, ["materialize", str(st)])
    monkeypatch.setattr(os, "replace", real)
    line = one_line_of(res)
    stored = [r for r in Store(st).run_ids() if Store(st).run(r).cache_state().fresh]
    assert stored and len(stored) < 3, (stored, line)
    assert "No space left on device" in line and "rerun `moetrace materialize" in line and stored[0] in line, line
    assert "nothing was written" not in line
    res = runner.invoke(cli, ["materialize", str(st)])
    assert res.exit_code == 0, res.output
    with Store(st) as s:
        assert all(s.run(r).cache_state().fresh for r in s.run_ids())


def one_line_of(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrace: error:"), lines
    return lines[0]


# ----------------------------------------------------------------------------- family 10
def _killed_at(k: int, args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGKILL_AT_REPLACE.format(repo=str(REPO)), str(k),
                           *[str(a) for a in args]], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def _replays(st: Path) -> int:
    with Store(st) as s:
        return s.sql("SELECT count(*) AS n FROM replay_runs")["n"][0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_a_killed_ingest_of_two_files_completes_on_rerun(k, seeded, tmp_path):
    st, b = fresh(seeded, tmp_path)
    a = tmp_path / "in" / "a.csv"
    a.write_text("step,layer,expert,tokens\n0,0,0,7\n0,0,1,1\n0,0,2,1\n0,0,3,1\n")
    p = _killed_at(k, ["ingest", st, a, b], tmp_path)
    assert p.returncode in (-signal.SIGKILL, 0), p.stderr
    with Store(st, create=True) as s:   # a writer's open: the killed write recovered
        assert len(s.run_ids()) in (1, 2, 3)
    res, _ = run_cli([["ingest", st, a, b], ["check", st]], tmp_path)
    assert [r[0] for r in res] == [0, 0], res
    with Store(st) as s:
        assert sorted(s.run_ids()) == ["a", "b", "seed"]


@pytest.fixture(scope="module")
def drift_store(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("drift")
    st = d / "st"
    res, _ = run_cli([["synth", st, "--layers", "2", "--experts", "8", "--top-k", "2", "--ranks", "4",
                       "--ranks-per-node", "2", "--steps", "8", "--tokens-per-step", "64"]], d.parent)
    assert res[0][0] == 0, res
    return st


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_killed_drift_replay_stores_all_three_replays_or_none(k, drift_store, tmp_path):
    import shutil

    st = tmp_path / "st"
    shutil.copytree(drift_store, st)
    args = ["replay", st, "--policy", "greedy", "--replan-every", "2", "--window", "2"]
    p = _killed_at(k, args, tmp_path)
    assert p.returncode in (-signal.SIGKILL, 0), p.stderr
    assert _replays(st) in (0, 3)
    if p.returncode == 0:
        return
    Store(st, create=True).close()      # recovery: rolled back or forward, still 0 or 3
    assert _replays(st) in (0, 3)

"""Store atomicity under real crashes and real concurrency (separate processes).

- A writer process is SIGKILLed at every rename of a transaction (and while it is still
  streaming chunks into staging): afterwards the store holds either exactly what it held
  before (byte for byte) or the whole new run, never part of one, for readers opening it
  and after ``recover()``.
- Two processes ingesting into one store at the same moment: both land, or one fails
  cleanly (exit 2, nothing half-written); so do processes creating the same new store.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moetrace.run import Store

from .helpers import REPO, module_fixture, tree_hash
from .helpers.forked_writers import CHUNK_ROWS, N_CHUNKS, _chunk, _ForkedWriters, _run


def _seeded(path: Path) -> Path:
    st = Store(path, create=True)
    st.write_run(_run("old"), {"expert_load": [_chunk(0)]}, run_id="old")
    st.write_catalog()  # so a write also replaces catalog.duckdb: one more crash point
    return path


@module_fixture
def seed(tmp_path_factory) -> Path:
    """One seeded store (a run and a catalog): read-only, each test copies it byte for byte."""
    return _seeded(tmp_path_factory.mktemp("seed") / "seed")


@module_fixture
def writer(tmp_path_factory):
    """The WRITER's fork server, one for the module's SIGKILL tests."""
    w = _ForkedWriters(tmp_path_factory.mktemp("writers"))
    yield w
    w.close()


def _new_run_is_whole(store: Path) -> bool:
    st = Store(store)
    got = st.sql("SELECT count(*) AS n, sum(tokens) AS t FROM expert_load WHERE run_id = 'new'")
    want_t = sum(i * 1000 * CHUNK_ROWS + CHUNK_ROWS * (CHUNK_ROWS - 1) // 2 for i in range(N_CHUNKS))
    pl_rows = st.sql("SELECT count(*) AS n FROM placement WHERE run_id = 'new'")["n"][0]
    return (got["n"][0], got["t"][0], pl_rows) == (N_CHUNKS * CHUNK_ROWS, want_t, 2)


def _visible_new_rows(store: Path) -> int:
    return Store(store).sql("SELECT count(*) AS n FROM expert_load WHERE run_id = 'new'")["n"][0]


@pytest.mark.slow
def test_sigkill_at_every_rename_leaves_old_store_or_whole_run(tmp_path, seed, writer):
    # how many renames a full write does: run it once without a kill
    # (each write starts from a byte-for-byte copy of one seeded store)
    ref = tmp_path / "ref"
    shutil.copytree(seed, ref)
    res = writer(ref, 0, -1)
    assert res.returncode == 0, res.stderr
    n_replaces = int(res.stdout.split("REPLACES")[1])
    assert n_replaces >= 4  # journal, placement, expert_load, runs (+ catalog)
    outcomes = []
    for k in range(1, n_replaces + 1):
        store = tmp_path / f"s{k}"
        shutil.copytree(seed, store)
        before = tree_hash(store)
        res = writer(store, k, -1)
        assert res.returncode == -signal.SIGKILL, (k, res.returncode, res.stderr)
        # a reader opening the store right after the crash sees all of the run or none of it
        visible = _visible_new_rows(store)
        assert visible in (0, N_CHUNKS * CHUNK_ROWS), (k, visible)
        done = Store(store).recover()
        assert not (store / ".txn").exists() and not (store / ".staging").exists()
        if tree_hash(store) == before:
            outcomes.append("rolled back")
            assert Store(store).run_ids() == ["old"]
        else:
            outcomes.append("whole")
            assert Store(store).run_ids() == ["new", "old"], (k, done)
            assert _new_run_is_whole(store), k
        # the store still takes writes afterwards
        Store(store).write_run(_run(f"after{k}"), {"expert_load": _chunk(9)}, run_id="after")
        assert Store(store).sql("SELECT count(*) AS n FROM expert_load WHERE run_id = 'after'")["n"][0] == CHUNK_ROWS
    # the kill before the runs row is renamed rolls back; a kill after it keeps the run
    assert outcomes[0] == "rolled back" and "whole" in outcomes, outcomes


@pytest.mark.parametrize("kill_after_chunk", [0, 2])
def test_sigkill_while_streaming_chunks_leaves_store_unchanged(tmp_path, seed, writer, kill_after_chunk):
    store = tmp_path / "st"
    shutil.copytree(seed, store)
    before = tree_hash(store)
    res = writer(store, 0, kill_after_chunk)
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert _visible_new_rows(store) == 0
    Store(store).recover()
    assert tree_hash(store) == before


# ----------------------------------------------------------------------------- concurrency
# The ingesters of a race: each its own process, forked from one server that imported the CLI
# and what an ingest uses (polars, DuckDB, pyarrow, the collectors) once, instead of a fresh
# interpreter each; a child says it is ready, waits for the start signal, then runs the CLI.
RACE_SERVER = textwrap.dedent("""
    import importlib, json, os, sys, time, traceback
    sys.path.insert(0, {repo!r})
    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    from moetrace.cli import main
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for i, argv in enumerate(job["argvs"]):
            pid = os.fork()
            if pid == 0:
                os.chdir(job["cwd"])
                for fd, name in ((1, "out"), (2, "err")):
                    os.dup2(os.open(job["go"] + "." + name + str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                open(job["go"] + ".ready" + str(i), "w").close()
                while not os.path.exists(job["go"]):
                    time.sleep(0.002)
                try:
                    main(argv)
                    rc = 0
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:
                    traceback.print_exc()
                    rc = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
            pids.append(pid)
        print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]), flush=True)
""")
RACE_PRELOAD = ("duckdb", "polars", "numpy", "pyarrow", "pyarrow.parquet", "moetrace.cli", "moetrace.commands.store_cmds",
                "moetrace.storage.store", "moetrace.storage.writer", "moetrace.storage.dense", "moetrace.collect.generic",
                "moetrace.collect.checks", "moetrace.collect.conservation")


@module_fixture
def racers():
    proc = subprocess.Popen([sys.executable, "-c", RACE_SERVER.format(repo=str(REPO)), ",".join(RACE_PRELOAD)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    assert proc.stdout.readline() == "READY\n"
    yield proc
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def _wait_ready(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    """Until every process has written its ready file (done importing), or one has exited."""
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not get ready"
        time.sleep(0.005)


def _race(racers: subprocess.Popen, tmp_path: Path, argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    go = tmp_path / f"go-{time.monotonic_ns()}"
    ready = [Path(f"{go}.ready{i}") for i in range(len(argvs))]
    racers.stdin.write(json.dumps({"go": str(go), "cwd": str(tmp_path), "argvs": argvs}) + "\n")
    racers.stdin.flush()
    _wait_ready(ready, [racers])  # every process forked and waiting
    go.write_text("go")
    codes = json.loads(racers.stdout.readline())
    return [subprocess.CompletedProcess(argv, rc, Path(f"{go}.out{i}").read_text(), Path(f"{go}.err{i}").read_text())
            for i, (argv, rc) in enumerate(zip(argvs, codes))]


def _csv(path: Path, scale: int, steps: int = 30) -> tuple[Path, int]:
    lines = ["step,layer,expert,tokens"]
    total = 0
    for s in range(steps):
        for l in range(3):
            for e in range(16):
                v = scale * (s + 1) + l * e
                total += v
                lines.append(f"{s},{l},{e},{v}")
    path.write_text("\n".join(lines) + "\n")
    return path, total


def _assert_clean(store: Path) -> None:
    assert not (store / ".txn").exists() and not (store / ".staging").exists()
    runs = Store(store).run_ids()
    for t in ("load", "runs"):  # load: expert_load (long rows) or expert_counts (the dense layout)
        dirs = [store / "expert_load", store / "expert_counts"] if t == "load" else [store / t]
        parts = sorted(p.name.split("=", 1)[1] for d in dirs for p in d.glob("run_id=*"))
        assert parts == runs, (t, parts, runs)  # no partition without its runs row and vice versa


def test_two_processes_ingesting_different_files_both_land(tmp_path, racers):
    a, ta = _csv(tmp_path / "a.csv", 7)
    b, tb = _csv(tmp_path / "b.csv", 11)
    store = tmp_path / "store"
    res = _race(racers, tmp_path, [["ingest", str(a), "--store", str(store)], ["ingest", str(b), "--store", str(store)]])
    assert [r.returncode for r in res] == [0, 0], [r.stderr for r in res]
    got = Store(store).sql("SELECT run_id, sum(tokens) AS t FROM expert_load GROUP BY run_id ORDER BY run_id")
    assert got.rows() == [("a", ta), ("b", tb)]
    _assert_clean(store)


def test_same_file_twice_at_once_lands_once(tmp_path, racers):
    a, ta = _csv(tmp_path / "a.csv", 5)
    store = tmp_path / "store"
    res = _race(racers, tmp_path, [["ingest", str(a), "--store", str(store)]] * 2)
    assert [r.returncode for r in res] == [0, 0], [r.stderr for r in res]
    assert sum("already ingested" in r.stdout for r in res) == 1, [r.stdout for r in res]
    assert Store(store).sql("SELECT sum(tokens) AS t FROM expert_load").rows() == [(ta,)]
    _assert_clean(store)


def test_same_run_id_at_once_one_fails_cleanly(tmp_path, racers):
    a, ta = _csv(tmp_path / "a.csv", 3)
    b, tb = _csv(tmp_path / "b.csv", 13)
    store = tmp_path / "store"
    res = _race(racers, tmp_path, [["ingest", str(a), "--store", str(store), "--run-id", "incident"],
                           ["ingest", str(b), "--store", str(store), "--run-id", "incident"]])
    codes = sorted(r.returncode for r in res)
    assert codes == [0, 2], [(r.returncode, r.stderr) for r in res]
    loser = next(r for r in res if r.returncode == 2)
    assert "already exists" in loser.stderr and "Traceback" not in loser.stderr
    winner = next(i for i, r in enumerate(res) if r.returncode == 0)
    assert Store(store).sql("SELECT sum(tokens) AS t FROM expert_load").rows() == [([ta, tb][winner],)]
    _assert_clean(store)


def test_two_files_with_the_same_name_from_two_folders_both_land(tmp_path, racers):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a, ta = _csv(tmp_path / "x" / "load.csv", 2)
    b, tb = _csv(tmp_path / "y" / "load.csv", 9)
    store = tmp_path / "store"
    res = _race(racers, tmp_path, [["ingest", str(a), "--store", str(store)], ["ingest", str(b), "--store", str(store)]])
    assert [r.returncode for r in res] == [0, 0], [r.stderr for r in res]
    got = sorted(Store(store).sql("SELECT sum(tokens) AS t FROM expert_load GROUP BY run_id")["t"].to_list())
    assert got == sorted([ta, tb])
    _assert_clean(store)


def test_processes_creating_the_same_new_store(tmp_path, racers):
    files = [_csv(tmp_path / f"f{i}.csv", i + 1)[0] for i in range(3)]
    store = tmp_path / "fresh"
    res = _race(racers, tmp_path, [["ingest", str(f), "--store", str(store)] for f in files])
    assert [r.returncode for r in res] == [0, 0, 0], [r.stderr for r in res]
    assert json.loads((store / "moetrace-store.json").read_text())["moetrace_store_format"] == 1
    assert Store(store).run_ids() == ["f0", "f1", "f2"]
    assert [p.name for p in store.iterdir() if p.name.startswith(".moetrace-store")] == []
    _assert_clean(store)


CREATOR = textwrap.dedent("""
    import os, sys, time
    from moetrace.storage.store import Store
    base, go = sys.argv[1], sys.argv[2]
    open(sys.argv[3], "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    for k in range(150):
        Store(os.path.join(base, f"s{k}"), create=True)
""")


def test_many_processes_creating_the_same_stores_never_fail(tmp_path):
    """Four processes create the same 150 stores in the same order, so creations collide
    (with one shared temp name for the marker, a loser's rename would find it gone)."""
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", CREATOR, str(tmp_path / "base"), str(go), str(r)],
                              stderr=subprocess.PIPE, text=True) for r in ready]
    _wait_ready(ready, procs)
    go.write_text("go")
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errs
    for k in range(150):
        d = tmp_path / "base" / f"s{k}"
        assert sorted(p.name for p in d.iterdir()) == ["moetrace-store.json"], k
        assert json.loads((d / "moetrace-store.json").read_text())["moetrace_store_format"] == 1

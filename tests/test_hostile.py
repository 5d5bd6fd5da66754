"""Hostile stores, hostile files and faults.

Every case asserts the exit code, the one-line message (naming the file) and that the
store is byte-for-byte unchanged (``tree_hash``); the dangerous ones also assert that a
file outside the store was not touched.
"""
from __future__ import annotations

import errno
import gzip
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.errors import StoreError
from moetrace.storage.store import Store

from .helpers import REPO, tree_hash
from .helpers import invoke as _cli
from .helpers.seed_store import _seed_store as _seeded  # a store holding one run (seed-store)


# ----------------------------------------------------------------------------- helpers
def _csv_text(steps=2, layers=2, experts=4, scale=1) -> str:
    rows = ["step,layer,expert,tokens"]
    rows += [f"{s},{l},{e},{scale * (s + 1) * (e + 2) + l}" for s in range(steps) for l in range(layers)
             for e in range(experts)]
    return "\n".join(rows) + "\n"


@pytest.fixture
def store(tmp_path):
    return _seeded(tmp_path / "store")


def one_line_error(res, code: int, *needles: str) -> str:
    """Exit ``code``, exactly one line on stderr starting 'moetrace: error:' holding the needles."""
    out = res.stderr if hasattr(res, "stderr") and res.stderr is not None else res.output
    assert res.exit_code == code, f"exit {res.exit_code}: {res.output!r} {res.exception!r}"
    assert "Traceback" not in res.output
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrace: error:"), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _outside(tmp_path: Path) -> tuple[Path, Path]:
    """A folder outside the store holding a file that must survive."""
    d = tmp_path / "outside"
    (d / "sub" / "deeper").mkdir(parents=True)
    victim = d / "sub" / "precious.parquet"
    victim.write_bytes(b"do not delete")
    (d / "sub" / "deeper" / "x.txt").write_text("keep")
    return d, victim


# ----------------------------------------------------------------------------- 1. recovery is confined to the store
@pytest.mark.parametrize("entries", [
    "absolute", "dotdot", "table-dotdot", "unknown-table", "other-txid"])
def test_crafted_journal_cannot_touch_files_outside_the_store(runner, cli, store, tmp_path, entries):
    out, victim = _outside(tmp_path)
    rel_victim = os.path.relpath(victim, store)
    files = {"absolute": [str(victim)],
             "dotdot": [rel_victim],
             "table-dotdot": ["expert_load/run_id=x/../../../outside/sub/precious.parquet"],
             "unknown-table": ["../outside/run_id=x/part-0123456789ab.parquet"],
             "other-txid": ["expert_load/run_id=seed-store/part-ffffffffffff.parquet"]}[entries]
    (store / ".txn").mkdir()
    journal = store / ".txn" / "0123456789ab.json"
    journal.write_text(json.dumps({"files": files, "commit_file": None}))
    before, before_out = tree_hash(store), tree_hash(out)
    # a read ignores the journal, shows the committed data, writes nothing
    res = _cli(runner, cli, "sql", store, "SELECT count(*) AS n FROM expert_load", "--format", "csv")
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == str(2 * 2 * 4)
    # a write refuses the journal with one line naming it, and changes nothing
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=3))
    msg = one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, str(journal), "malformed journal")
    assert "nothing was changed" in msg
    with pytest.raises(StoreError, match="malformed journal"):
        Store(store).recover()
    assert victim.read_bytes() == b"do not delete"
    assert tree_hash(store) == before and tree_hash(out) == before_out


@pytest.mark.parametrize("doc", ["[]", '{"files": null}', '{"files": null, "commit_file": null}',
                                 '{"files": [1, 2], "commit_file": null}', "not json", "",
                                 '{"files": [], "commit_file": "runs/run_id=a/part-0123456789ab.parquet"}',
                                 "[" * 100000 + "]" * 100000])
def test_malformed_journal_is_one_line_and_no_change(runner, cli, store, tmp_path, doc):
    (store / ".txn").mkdir()
    journal = store / ".txn" / "0123456789ab.json"
    journal.write_text(doc)
    before = tree_hash(store)
    res = _cli(runner, cli, "runs", store)  # reads are not affected
    assert res.exit_code == 0 and "seed-store" in res.output, res.output
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=5))
    one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, str(journal))
    one_line_error(_cli(runner, cli, "synth", store, "--steps", 2, "--layers", 1), 2, str(journal))
    assert tree_hash(store) == before


def test_symlinked_staging_is_refused_and_its_target_untouched(runner, cli, store, tmp_path):
    out, victim = _outside(tmp_path)
    (out / "0123456789ab").mkdir()  # looks like a staging folder of ours
    (out / "0123456789ab" / "f").write_text("keep")
    os.symlink(out, store / ".staging")
    before, before_out = tree_hash(store), tree_hash(out)
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=7))
    one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, str(store / ".staging"), "symlink")
    with pytest.raises(StoreError, match="symlink"):
        Store(store).recover()
    res = _cli(runner, cli, "runs", store)
    assert res.exit_code == 0, res.output
    assert tree_hash(store) == before and tree_hash(out) == before_out
    assert (out / "0123456789ab" / "f").read_text() == "keep"


def test_symlinked_journal_folder_and_lock_are_refused(runner, cli, store, tmp_path):
    out, _ = _outside(tmp_path)
    os.symlink(out, store / ".txn")
    before, before_out = tree_hash(store), tree_hash(out)
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=9))
    one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, str(store / ".txn"), "symlink")
    assert tree_hash(store) == before        # the refused write left the store as it was
    os.unlink(store / ".txn")
    (store / ".lock").unlink()
    os.symlink(out / "sub" / "precious.parquet", store / ".lock")
    one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, "symlink")
    assert (out / "sub" / "precious.parquet").read_bytes() == b"do not delete"
    assert tree_hash(out) == before_out


def test_foreign_files_in_transaction_folders_are_left_alone(store):
    (store / ".txn").mkdir()
    (store / ".txn" / "notes.json").write_text("[]")  # not a journal name of ours: ignored, kept
    (store / ".staging").mkdir()
    (store / ".staging" / "mine").mkdir()
    (store / ".staging" / "0123456789ab").mkdir()  # a crash leftover: ours, no journal
    (store / ".staging" / "0123456789ab" / "part.parquet").write_bytes(b"x")
    Store(store, create=True)  # a writer's open cleans leftovers it recognises
    assert not (store / ".staging" / "0123456789ab").exists()
    assert (store / ".txn" / "notes.json").read_text() == "[]" and (store / ".staging" / "mine").is_dir()


def test_crash_leftovers_in_staging_are_cleaned_at_the_next_writer_open(store):
    before = tree_hash(store)
    leftover = store / ".staging" / "0123456789ab" / "expert_load"
    leftover.mkdir(parents=True)
    (leftover / "part-0123456789ab.parquet").write_bytes(b"half a file")
    Store(store)  # a reader leaves it
    assert leftover.exists()
    Store(store, create=True)
    assert not (store / ".staging").exists()
    assert tree_hash(store) == before


def test_a_read_never_writes(runner, cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["runs", empty], ["sql", empty, "SELECT count(*) AS n FROM runs"]):
        res = _cli(runner, cli, *args)
        assert res.exit_code == 0, res.output
    assert list(empty.iterdir()) == []
    # and a reader does not roll back a pending journal (a writer does)
    st = _seeded(tmp_path / "st")
    (st / ".txn").mkdir()
    (st / ".txn" / "0123456789ab.json").write_text(json.dumps(
        {"files": ["expert_load/run_id=ghost/part-0123456789ab.parquet"], "commit_file": None}))
    ghost = st / "expert_load" / "run_id=ghost" / "part-0123456789ab.parquet"
    ghost.parent.mkdir(parents=True)
    pq.write_table(pa.table({"step": [0], "layer": [0], "expert": [0], "slot": pa.nulls(1, pa.int32()),
                             "src_rank": pa.nulls(1, pa.int32()), "tokens": [99]}), ghost)
    before = tree_hash(st)
    res = _cli(runner, cli, "sql", st, "SELECT count(*) AS n, sum(tokens) AS t FROM expert_load", "--format", "csv")
    assert res.exit_code == 0, res.output
    want = sum((s + 1) * (e + 2) + l for s in range(2) for l in range(2) for e in range(4))
    assert res.output.strip().splitlines()[-1] == f"16,{want}"  # the ghost row is not shown
    assert tree_hash(st) == before
    assert Store(st, create=True) and not ghost.exists()  # the writer's open rolls it back


SLOW_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import pyarrow as pa
    from moetrace.storage.store import Store
    real = os.replace
    pause, go = sys.argv[2], sys.argv[3]
    def slow(a, b):
        time.sleep(0.1)
        if "/runs/run_id=" in str(b):  # every other file of the run is in place: wait for the reader
            open(pause, "w").close()
            t0 = time.monotonic()
            while not os.path.exists(go) and time.monotonic() - t0 < 120:
                time.sleep(0.01)
        return real(a, b)
    os.replace = slow
    st = Store(sys.argv[1])
    n = 200
    el = pa.table({{"step": [0] * n, "layer": [0] * n, "expert": list(range(n)), "slot": pa.nulls(n, pa.int32()),
                    "src_rank": pa.nulls(n, pa.int32()), "tokens": [1] * n}})
    pl_ = pa.table({{"plan_id": ["recorded"], "layer": [0], "slot": [0], "rank": [0], "node": [0], "expert": [0]}})
    st.write_run({{"source": "slow", "source_sha256": "slow", "collector": "t", "time_base": "none",
                  "num_layers": 1, "num_experts": n, "top_k": 1}}, {{"expert_load": el, "placement": pl_}},
                 run_id="slow")
""")


def test_reader_polling_during_slow_renames_never_sees_part_of_a_run(store, tmp_path):
    """The writer stops right before renaming its runs file (every other file in place)
    until the reader has looked: the partial state is observed on every run, whatever the
    machine's load; the reader also polls through the other renames."""
    import duckdb

    pause, go = tmp_path / "paused", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(repo=str(REPO)), str(store), str(pause),
                             str(go)], stderr=subprocess.PIPE, text=True)
    seen, at_pause = [], None

    def look():
        st = Store(store)
        n_el = st.sql("SELECT count(*) AS n FROM expert_load WHERE run_id = 'slow'")["n"][0]
        n_runs = st.sql("SELECT count(*) AS n FROM runs WHERE run_id = 'slow'")["n"][0]
        st.close()
        return n_el, n_runs

    while proc.poll() is None:
        if pause.exists() and at_pause is None:
            raw = (len(list((store / "expert_load").glob("run_id=slow/*.parquet"))),
                   len(list((store / "runs").glob("run_id=slow/*.parquet"))))
            at_pause = (raw, look())
            go.touch()
        seen.append(look())
        time.sleep(0.02)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    # at the pause the expert_load file is in place and the runs file is not; the reader sees none of the run
    assert at_pause == ((1, 0), (0, 0)), at_pause
    # expert_load is counted first, runs second: the run may commit between the two queries
    # (0, 1); never part of the run, never its rows before its runs row (200, 0)
    assert all(s in ((0, 0), (0, 1), (200, 1)) for s in seen), seen
    assert look() == (200, 1)
    assert duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{store}/expert_load/run_id=slow/*.parquet')").fetchone()[0] == 200


# ----------------------------------------------------------------------------- 2. no user text in SQL
def test_store_path_with_sql_injection_is_data(runner, cli, tmp_path):
    pwned = tmp_path / "PWNED.csv"
    evil = tmp_path / f"x';COPY (SELECT 42) TO '{pwned}';--"
    src = tmp_path / "load.csv"
    src.write_text(_csv_text())
    res = _cli(runner, cli, "ingest", src, "--store", evil)
    assert res.exit_code == 0, res.output
    for args in (["runs", evil], ["sql", evil, "SELECT sum(tokens) AS t FROM expert_load", "--format", "csv"],
                 ["skew", evil], ["catalog", evil]):
        res = _cli(runner, cli, *args)
        assert res.exit_code == 0, (args, res.output)
        assert not pwned.exists(), args
    res = _cli(runner, cli, "sql", evil, "SELECT sum(tokens) AS t FROM expert_load", "--format", "csv")
    want = sum((s + 1) * (e + 2) + l for s in range(2) for l in range(2) for e in range(4))
    assert res.output.strip().splitlines()[-1] == str(want)


def test_quote_in_store_path_and_catalog(runner, cli, tmp_path):
    import duckdb

    st = tmp_path / "it's o'clock"
    src = tmp_path / "load.csv"
    src.write_text(_csv_text())
    assert _cli(runner, cli, "ingest", src, "--store", st).exit_code == 0
    res = _cli(runner, cli, "catalog", st)
    assert res.exit_code == 0, res.output
    con = duckdb.connect(str(st / "catalog.duckdb"), read_only=True)
    con.execute("SET file_search_path = ?", [str(st)]) if False else None
    con.execute(f"SET file_search_path='{str(st).replace(chr(39), chr(39) * 2)}'")
    assert con.execute("SELECT count(*) FROM expert_load").fetchone()[0] == 16
    con.close()


def test_memory_limit_is_validated(runner, cli, store):
    before = tree_hash(store)
    for bad in ("abc", "8GB'; COPY (SELECT 1) TO 'x.csv", "-3GB"):
        msg = one_line_error(_cli(runner, cli, "skew", store, "--memory-limit", bad), 2, "--memory-limit")
        assert "not a size" in msg
    res = _cli(runner, cli, "skew", store, "--memory-limit", "512MB")
    assert res.exit_code == 0, res.output
    assert tree_hash(store) == before


# ----------------------------------------------------------------------------- faults while writing
def test_enospc_during_a_write_is_one_line_and_no_change(runner, cli, store, tmp_path, monkeypatch):
    real = pq.ParquetWriter.write_table

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    before = tree_hash(store)
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=11))
    one_line_error(_cli(runner, cli, "ingest", src, "--store", store), 2, str(store), "No space left on device",
                   "nothing was written")
    assert tree_hash(store) == before
    monkeypatch.setattr(pq.ParquetWriter, "write_table", real)
    assert _cli(runner, cli, "ingest", src, "--store", store).exit_code == 0


def test_catalog_on_a_read_only_file_system(runner, cli, store, monkeypatch):
    real = os.replace

    def erofs(a, b):
        if str(b).endswith("catalog.duckdb"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(a, b)

    monkeypatch.setattr(os, "replace", erofs)
    before = tree_hash(store)
    one_line_error(_cli(runner, cli, "catalog", store), 2, str(store), "catalog not written")
    assert tree_hash(store) == before


def test_ingest_does_not_fail_after_commit_when_the_catalog_refresh_fails(runner, cli, store, tmp_path, monkeypatch):
    assert _cli(runner, cli, "catalog", store).exit_code == 0
    monkeypatch.setattr(Store, "write_catalog", lambda self: (_ for _ in ()).throw(
        StoreError(f"{self.path}: store is read-only; catalog not written")))
    src = tmp_path / "more.csv"
    src.write_text(_csv_text(scale=13))
    res = _cli(runner, cli, "ingest", src, "--store", store)
    assert res.exit_code == 0, res.output
    assert "warning" in res.output and "catalog" in res.output
    assert "more" in Store(store).run_ids()


def test_ids_cut_at_80_characters_get_a_suffix(runner, cli, tmp_path):
    name = "incident_" + "x" * 100 + ".csv"
    for i, d in enumerate(("a", "b", "c")):
        (tmp_path / d).mkdir()
        (tmp_path / d / name).write_text(_csv_text(scale=i + 1))
        res = _cli(runner, cli, "ingest", tmp_path / d / name, "--store", tmp_path / "st")
        assert res.exit_code == 0, res.output
    ids = Store(tmp_path / "st").run_ids()
    base = ("incident_" + "x" * 100)[:80]
    assert sorted(ids) == sorted([base, base[:78] + "-2", base[:78] + "-3"]) and all(len(i) <= 80 for i in ids)


def test_internal_error_is_one_line_exit_1_and_debug_shows_it(runner, cli, store, monkeypatch):
    def boom(self, *a, **k):
        raise ValueError("unexpected\nmulti-line")

    monkeypatch.setattr(Store, "runs_rows", boom)   # what `moetrace runs` reads the runs with
    res = runner.invoke(cli, ["runs", str(store)])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "internal error: ValueError: unexpected multi-line" in lines[0]
    assert "--debug" in lines[0]
    res = runner.invoke(cli, ["--debug", "runs", str(store)])
    assert isinstance(res.exception, ValueError)


# ----------------------------------------------------------------------------- Nsight exports: URI, WAL, views, bombs
def _nsys_export(path: Path) -> Path:
    from .helpers.nsys_export import make_export

    return make_export(path)


@pytest.mark.parametrize("name", ["rank #1.nsys.sqlite", "what?x=1.nsys.sqlite", "%41%2e.nsys.sqlite",
                                  "a'b\".nsys.sqlite"])
def test_nsys_odd_names_read_the_named_file_and_write_nothing_next_to_it(runner, cli, tmp_path, name):
    d = tmp_path / "in"
    d.mkdir()
    f = _nsys_export(d / name)
    decoy = d / "rank "  # what an unescaped 'file:rank #1...' URI would open (and create)
    before_in = tree_hash(d)
    res = _cli(runner, cli, "ingest", f, "--store", tmp_path / "st", "--format", "nsys")
    assert res.exit_code == 0, res.output
    assert tree_hash(d) == before_in and not decoy.exists()
    n = Store(tmp_path / "st").sql("SELECT count(*) AS n FROM spans")["n"][0]
    assert n > 0


def test_nsys_wal_mode_export_leaves_no_wal_or_shm(runner, cli, tmp_path):
    import sqlite3

    d = tmp_path / "in"
    d.mkdir()
    f = _nsys_export(d / "wal.nsys.sqlite")
    con = sqlite3.connect(f)
    assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    con.close()
    assert sorted(p.name for p in d.iterdir()) == ["wal.nsys.sqlite"]
    os.chmod(d, 0o755)
    before_in = tree_hash(d)
    res = _cli(runner, cli, "ingest", f, "--store", tmp_path / "st", "--format", "nsys")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in d.iterdir()) == ["wal.nsys.sqlite"] and tree_hash(d) == before_in


def test_nsys_kernel_table_that_is_an_endless_view_is_refused(runner, cli, store, tmp_path):
    import sqlite3

    f = _nsys_export(tmp_path / "view.nsys.sqlite")
    con = sqlite3.connect(f)
    con.executescript("""
        DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL;
        CREATE VIEW CUPTI_ACTIVITY_KIND_KERNEL AS
          WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r)
          SELECT n AS start, n + 1 AS end, 0 AS deviceId, 0 AS contextId, 7 AS streamId, n AS correlationId,
                 0 AS globalPid, 1 AS demangledName, 1 AS shortName, 1 AS mangledName FROM r;
    """)
    con.close()
    before = tree_hash(store)
    t0 = time.process_time()
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "nsys"), 2, str(f))
    assert "CUPTI_ACTIVITY_KIND_KERNEL" in msg and "view" in msg
    assert time.process_time() - t0 < 30
    assert tree_hash(store) == before


def test_nsys_gzip_bomb_is_refused_and_leaves_no_temp_files(runner, cli, store, tmp_path, monkeypatch):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    f = tmp_path / "bomb.nsys.sqlite.gz"
    with gzip.open(f, "wb", compresslevel=9) as g:  # a SQLite header, then 64 MiB of zeros
        g.write(b"SQLite format 3\x00")
        for _ in range(64):
            g.write(bytes(1 << 20))
    ratio = (64 << 20) / f.stat().st_size
    assert ratio > 200  # beyond the default max_inflate_ratio
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store), 2, str(f), "max_inflate_ratio")
    assert "MOETRACE_MAX_INFLATE_RATIO" in msg or "--set max_inflate_ratio" in msg
    assert list(tmpdir.iterdir()) == []
    assert tree_hash(store) == before
    # raising the limit lets it through to the next check (not an nsys export: still refused, differently)
    res = _cli(runner, cli, "ingest", f, "--store", store, "--set", "max_inflate_ratio=100000")
    assert res.exit_code == 2 and "max_inflate_ratio" not in res.output
    assert tree_hash(store) == before


# ----------------------------------------------------------------------------- server logs
_VLLM = ("(EngineCore_0 pid=1) INFO 11-29 10:00:01 [eplb_state.py:512] EPLB step: 3 for model ds: "
         "avg_tokens=10.50, max_tokens=20, balancedness=0.5250\n")
_SGL = ("[{date} 10:00:01 TP0] [Expert Balancedness] forward_pass_id={fp} current_pass_balancedness=0.400 "
        "last_10_average_balancedness=0.400 gpu_physical_count_sum={n}\n")


@pytest.mark.parametrize("line,pos,words", [
    (_SGL.format(date="0026-11-29", fp=1, n=40), "line 2", "1970..2262"),
    (_SGL.format(date="9999-11-29", fp=1, n=40), "line 2", "1970..2262"),
    (_SGL.format(date="2026-11-29", fp=2 ** 63, n=40), "line 2", "64-bit"),
    (_SGL.format(date="2026-11-29", fp=1, n=2 ** 64 + 5), "line 2", "64-bit"),
])
def test_log_values_beyond_64_bits_are_one_line(runner, cli, store, tmp_path, line, pos, words):
    f = tmp_path / "server.log"
    f.write_text(_VLLM + line)
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "logs"), 2, str(f), pos)
    assert words in msg
    assert tree_hash(store) == before


def test_log_year_option_out_of_range(runner, cli, store, tmp_path):
    f = tmp_path / "server.log"
    f.write_text(_VLLM)
    before = tree_hash(store)
    for y in ("9999", "abc", "26"):
        one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--set", f"year={y}"), 2, "year")
    assert tree_hash(store) == before


def test_log_line_of_300kb_is_fast_and_counted(runner, cli, tmp_path):
    f = tmp_path / "server.log"
    bad = "EPLB step: avg_tokens=" + "1" * 300_000 + "x\n"  # backtracked for minutes before
    near = "[Expert Balancedness] forward_pass_id=1 current_pass_balancedness=" + "1" * 60_000 + " x\n"
    f.write_text(_VLLM + bad + near + _VLLM)
    t0 = time.process_time()
    res = _cli(runner, cli, "ingest", f, "--store", tmp_path / "st", "--format", "logs")
    assert res.exit_code == 0, res.output
    assert time.process_time() - t0 < 20
    meta = json.loads(Store(tmp_path / "st").sql("SELECT meta_json FROM runs")["meta_json"][0])
    counts = meta["line_counts"]
    # line 2 is over max_line_bytes (64 KiB): counted, not parsed; line 3 parsed and malformed
    assert (counts["lines"], counts["matched"], counts["too_long"], counts["malformed"]) == (4, 2, 1, 1)
    approx = Store(tmp_path / "st").sql("SELECT approximations FROM runs")["approximations"][0]
    assert "max_line_bytes=65536" in approx
    # each regex alone on the long line: linear, not backtracking
    from moetrace.collect.logs import parse_line

    t0 = time.process_time()
    for text in (bad, near, "Rearranged experts in " + "1" * 300_000 + "x\n",
                 "[EPLBManager] Skipped ep rebalancing: current GPU utilization " + "1" * 300_000 + "\n"):
        with pytest.raises(ValueError):
            parse_line(text)
    assert time.process_time() - t0 < 5


def test_fifo_and_devices_are_refused_before_reading(runner, cli, store, tmp_path):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    before = tree_hash(store)
    for p, words in ((fifo, "FIFO"), (Path("/dev/zero"), "character device")):
        for extra in ([], ["--format", "logs"], ["--format", "kineto"]):
            msg = one_line_error(_cli(runner, cli, "ingest", p, "--store", store, *extra), 2, str(p))
            assert words in msg
    assert tree_hash(store) == before


# ----------------------------------------------------------------------------- Kineto traces
def _kev(**over) -> dict:
    ev = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1000, "dur": 1,
          "args": {"device": 0, "stream": 7, "correlation": 1}}
    for k, v in over.items():
        if k in ("device", "stream", "correlation"):
            ev["args"][k] = v
        else:
            ev[k] = v
    return ev


@pytest.mark.parametrize("raw,words", [
    ('"ts": 1e999999999', "64-bit ns range"),
    ('"ts": "1e999999999"', "64-bit ns range"),
    ('"ts": 1e-999999999', None),  # rounds to 0 µs: a valid (if odd) time
    ('"device": 2147483648', "args.device"),
    ('"stream": -2147483649', "args.stream"),
    ('"correlation": 9223372036854775808', "args.correlation"),
])
def test_kineto_values_beyond_their_columns_are_one_line(runner, cli, store, tmp_path, raw, words):
    key = raw.split(":")[0].strip('"')
    text = json.dumps({"schemaVersion": 1, "traceEvents": [_kev(), _kev(name="k2", ts=1005)]})
    old = {"ts": '"ts": 1000', "device": '"device": 0', "stream": '"stream": 7', "correlation": '"correlation": 1'}[key]
    text = text.replace(old, raw, 1)
    f = tmp_path / "rank0.pt.trace.json"
    f.write_text(text)
    before = tree_hash(store)
    res = _cli(runner, cli, "ingest", f, "--store", store, "--format", "kineto")
    if words is None:
        assert res.exit_code in (0, 2) and "Traceback" not in res.output and "internal error" not in res.output
        return
    msg = one_line_error(res, 2, str(f), "event 0")
    assert words in msg
    assert tree_hash(store) == before


@pytest.mark.parametrize("where", ["event", "traceEvents", "document"])
def test_deep_json_is_one_line(runner, cli, store, tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    doc = {"event": json.dumps({"schemaVersion": 1, "traceEvents": [_kev()]}).replace('"args"', f'"x": {deep}, "args"'),
           "traceEvents": '{"schemaVersion": 1, "traceEvents": ' + deep + "}",
           "document": deep}[where]
    f = tmp_path / "rank0.pt.trace.json"
    f.write_text(doc)
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "kineto"), 2, str(f))
    assert "nested too deeply" in msg
    assert tree_hash(store) == before


@pytest.mark.parametrize("name", ["~/load.parquet", "file:{home}/load.parquet"])
def test_parquet_input_named_like_home_or_a_uri_reads_the_named_file(runner, cli, tmp_path, monkeypatch, name):
    """Arrow expands a leading ``~`` and reads a relative ``file:/x`` as ``/x``: a quoted
    ``'~/load.parquet'`` would ingest ``$HOME/load.parquet``. The named file (under the
    working folder) is what is ingested; the other one is never read."""
    home, work = tmp_path / "home", tmp_path / "work"
    name = name.format(home=home)
    rows = {"step": [0, 0], "layer": [0, 0], "expert": [0, 1], "tokens": [3, 5]}
    home.mkdir()
    pq.write_table(pa.table({**rows, "tokens": [1000, 2000]}), home / "load.parquet")   # not this one
    (work / name).parent.mkdir(parents=True)
    pq.write_table(pa.table(rows), work / name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    res = _cli(runner, cli, "ingest", name, "--store", tmp_path / "st", "--format", "generic")
    assert res.exit_code == 0, res.output
    assert Store(tmp_path / "st").sql("SELECT sum(tokens) AS t FROM expert_load")["t"][0] == 3 + 5


@pytest.mark.parametrize("name, text, needle", [
    ("plan.json", '{"phy2log": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ("eplb.yaml", "num_slots: 8\ninitial_global_assignments: " + "[" * 100_000 + "]" * 100_000 + "\n",
     "YAML nested too deeply")])
def test_plan_import_of_deep_json_or_yaml_is_one_line(runner, cli, store, tmp_path, name, text, needle):
    """plan --import of a 100k-deep document (SGLang / EPLB JSON, TensorRT-LLM YAML): one
    line naming the file, exit 2, no plan stored."""
    f = tmp_path / name
    f.write_text(text)
    before = tree_hash(store)
    one_line_error(_cli(runner, cli, "plan", store, "--import", f, "--ranks", 2), 2, str(f), needle)
    assert tree_hash(store) == before


def test_kineto_gzip_bomb_and_long_names_hit_limits(runner, cli, store, tmp_path):
    f = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(f, "wb", compresslevel=9) as g:
        g.write(b'{"schemaVersion": 1, "traceEvents": [' + json.dumps(_kev()).encode())
        for _ in range(64):
            g.write(b" " * (1 << 20))
        g.write(b"]}")
    assert (64 << 20) / f.stat().st_size > 200
    before = tree_hash(store)
    t0 = time.process_time()
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store), 2, str(f), "max_inflate_ratio=200")
    assert "MOETRACE_MAX_INFLATE_RATIO" in msg and time.process_time() - t0 < 30
    # a name beyond max_name_bytes (lowered here; 64 KiB by default)
    g = tmp_path / "rank1.pt.trace.json"
    g.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [_kev(name="n" * 5000), _kev(name="k", ts=1005)]}))
    msg = one_line_error(_cli(runner, cli, "ingest", g, "--store", store, "--set", "max_name_bytes=4096"), 2, str(g),
                         "max_name_bytes=4096")
    assert "5000 bytes" in msg
    assert tree_hash(store) == before
    res = _cli(runner, cli, "ingest", g, "--store", store)  # under the default limit it ingests
    assert res.exit_code == 0, res.output


def test_kineto_parsing_workers_get_the_parents_limits(runner, cli, store, tmp_path, monkeypatch):
    """Kineto files are parsed by worker processes (--set jobs=N, or inputs of 256 MiB and
    more) started through a forkserver, which sees neither this process's --set nor an
    environment changed after it started: the workers are handed the resolved limits. The
    worker here parses the file alone (the parent claims nothing), so what it refuses or
    accepts is its own limit."""
    import multiprocessing as mp

    from moetrace.collect import kineto
    from moetrace.safety import set_overrides

    f = tmp_path / "rank0.pt.trace.json"
    f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [_kev(name="n" * 5000), _kev(name="k", ts=1005)]}))
    ctx = mp.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")

    def in_worker():
        ex = kineto._worker_pool(ctx, 1, ctx.Array("q", [0, 1]))   # one file, all the worker's
        try:
            [(i, res)] = ex.submit(kineto._worker_loop, [f], False).result(timeout=300)
        finally:
            ex.shutdown(wait=True)
        assert i == 0
        return res

    try:
        set_overrides({"max_name_bytes": 4096})          # --set lowers it: the worker refuses
        res = in_worker()
        assert res[0] == "error" and "max_name_bytes=4096" in res[2] and "5000 bytes" in res[2], res
        set_overrides({})
        monkeypatch.setenv("MOETRACE_MAX_NAME_BYTES", "4000")  # set after the forkserver started
        res = in_worker()
        assert res[0] == "error" and "max_name_bytes=4000" in res[2], res
        set_overrides({"max_name_bytes": 100_000})       # --set raises it over the environment's
        res = in_worker()
        assert res[0] == "ok" and res[1][0]["n_events"] == 2, res[:1]
    finally:
        set_overrides({})
    # through the command: two rank files, both named 5000 bytes, parsed by this process and
    # one worker (whichever claims each); lowered, refused; raised over the environment, ingested
    g = tmp_path / "rank1.pt.trace.json"
    g.write_text(f.read_text())
    before = tree_hash(store)
    one_line_error(_cli(runner, cli, "ingest", f, g, "--store", store, "--set", "jobs=2", "--set",
                        "max_name_bytes=4096"), 2, "max_name_bytes=4096")
    assert tree_hash(store) == before
    res = _cli(runner, cli, "ingest", f, g, "--store", store, "--set", "jobs=2", "--set", "max_name_bytes=100000")
    assert res.exit_code == 0, res.output


# ----------------------------------------------------------------------------- dumps: bombs, headers, empty arrays
def _npy_header_only(shape, descr="<i8") -> bytes:
    import io

    from numpy.lib import format as npf

    buf = io.BytesIO()
    npf.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def test_npz_declaring_a_huge_array_is_refused_before_allocation(runner, cli, store, tmp_path):
    import zipfile

    f = tmp_path / "eplb.npz"
    with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("expert_load_pass.npy", _npy_header_only((100_000, 100_000)))  # 74.5 GiB of int64
    assert f.stat().st_size < 400
    before = tree_hash(store)
    t0 = time.process_time()
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "vllm"), 2, str(f),
                         "max_array_elements")
    assert "10000000000 elements" in msg and time.process_time() - t0 < 20
    g = tmp_path / "expert_load_pass.npy"
    g.write_bytes(_npy_header_only((100_000, 100_000)))
    one_line_error(_cli(runner, cli, "ingest", g, "--store", store), 2, str(g), "max_array_elements")
    assert tree_hash(store) == before


def test_npz_with_an_empty_step_array_or_empty_load(runner, cli, store, tmp_path):
    before = tree_hash(store)
    f = tmp_path / "a.npz"
    np.savez(f, expert_load_window=np.ones((4, 2, 8), np.int64), expert_load_window_step=np.array([], np.int64))
    one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "vllm"), 2, str(f),
                   "expert_load_window_step")
    g = tmp_path / "b.npz"
    np.savez(g, expert_load_window=np.ones((0, 2, 8), np.int64), expert_load_window_step=np.array([1], np.int64))
    one_line_error(_cli(runner, cli, "ingest", g, "--store", store, "--format", "vllm"), 2, str(g), "nothing recorded")
    h = tmp_path / "c.npz"
    np.savez(h, expert_load_pass=np.ones((2, 0), np.int64))
    one_line_error(_cli(runner, cli, "ingest", h, "--store", store, "--format", "vllm"), 2, str(h), "nothing recorded")
    assert tree_hash(store) == before


def test_pt_zip_bomb_is_refused_before_torch_reads_it(runner, cli, store, tmp_path):
    import zipfile

    torch = pytest.importorskip("torch")
    src = tmp_path / "ok.pt"
    torch.save({"expert_load_pass": torch.ones((2, 8), dtype=torch.int64)}, src)
    f = tmp_path / "expert_load_pass.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(f, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        prefix = zin.infolist()[0].filename.split("/")[0]
        zout.writestr(zipfile.ZipInfo(f"{prefix}/data/99"), bytes(64 << 20), compress_type=zipfile.ZIP_DEFLATED)
    assert (64 << 20) / f.stat().st_size > 200
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "vllm"), 2, str(f),
                         "max_inflate_ratio")
    assert "inflates to more than" in msg
    assert tree_hash(store) == before


def test_sglang_empty_or_deep_logical_count(runner, cli, store, tmp_path):
    before = tree_hash(store)
    for name, text, words in (("empty", '{"logical_count": [[]]}', "no layers or experts"),
                              ("empty3", '{"logical_count": [[[]]]}', "no layers or experts"),
                              ("deep", '{"logical_count": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply")):
        f = tmp_path / f"counts {name}.json"
        f.write_text(text)
        msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, "--format", "sglang"), 2, str(f))
        assert words in msg
    assert tree_hash(store) == before


# ----------------------------------------------------------------------------- values out of physical range
@pytest.mark.parametrize("args,words", [
    (["--ranks", "-4"], "'--ranks': -4 is not in the range 1<=x<=16777216"),   # the option's declared range
    (["--ranks", "0"], "'--ranks': 0 is not in the range"),
    (["--ranks-per-node", "-1"], "'--ranks-per-node': -1 is not in the range"),
    (["--set", "num_slots=-3"], "num_slots = -3"),
    (["--top-k", "9", "--experts", "4"], "top_k = 9 is larger than the 4 experts"),
    (["--top-k", "0"], "'--top-k': 0 is not in the range"),
    (["--ranks", "4", "--ranks-per-node", "8"], "ranks_per_node = 8 is larger than the 4 ranks"),
    (["--set", "num_ranks=abc"], "not a whole number"),
])
def test_shape_values_out_of_range_are_refused_at_ingest(runner, cli, store, tmp_path, args, words):
    f = tmp_path / "load.csv"
    f.write_text(_csv_text(experts=4))
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store, *args), 2)  # an option: no file named
    assert words in msg and "<input>" not in msg
    assert tree_hash(store) == before


def test_counts_that_would_overflow_later_are_refused(runner, cli, store, tmp_path):
    f = tmp_path / "load.csv"
    f.write_text("step,layer,expert,tokens\n0,0,0,5\n0,0,1,4611686018427387904\n")  # 2^62
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", f, "--store", store), 2, str(f), "row 2")
    assert "2^40" in msg and "4611686018427387904" in msg
    assert tree_hash(store) == before          # refused: the store as it was
    g = tmp_path / "ok.csv"
    g.write_text(f"step,layer,expert,tokens\n0,0,0,5\n0,0,1,{2 ** 40}\n")  # the limit itself is accepted
    assert _cli(runner, cli, "ingest", g, "--store", store).exit_code == 0
    got = Store(store).sql("SELECT sum(tokens) AS t FROM expert_load WHERE run_id = 'ok'")["t"][0]
    assert got == 2 ** 40 + 5


def test_secret_file_content_is_never_echoed(runner, cli, store, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRETHASH$abcdef:20228:0:99999:7:::\nbin:*:1:0:99999:7:::\n")
    link = tmp_path / "load.csv"
    os.symlink(secret, link)
    before = tree_hash(store)
    msg = one_line_error(_cli(runner, cli, "ingest", link, "--store", store), 2, str(link), "missing columns")
    assert "SECRETHASH" not in msg and "$6$" not in msg and "20228" not in msg
    assert tree_hash(store) == before


def test_synth_options_out_of_range(runner, cli, tmp_path):
    for args, words in ((["--seed", "-1"], "--seed"), (["--sigma", "nan"], "--sigma"), (["--ranks", "-4"], "--ranks"),
                        (["--ranks", "0"], "--ranks"), (["--top-k", "300"], "--top-k")):
        res = _cli(runner, cli, "synth", tmp_path / "sy", "--steps", 2, "--layers", 1, *args)
        one_line_error(res, 2, words)
        assert not (tmp_path / "sy").exists()  # bad options leave no store behind


@pytest.mark.parametrize("ranks", [0, -3, 10 ** 9])
def test_refrun_manifest_with_absurd_ranks(runner, cli, store, tmp_path, ranks):
    d = tmp_path / "refrun out"
    d.mkdir()
    man = d / "moetrace-refrun.json"
    man.write_text(json.dumps({"config": {"ranks": ranks, "layers": 1, "experts": 2, "top_k": 1},
                               "phy2log": [[0, 1]]}))
    before = tree_hash(store)
    t0 = time.process_time()
    one_line_error(_cli(runner, cli, "ingest", d, "--store", store), 2, str(man), "num_ranks")
    assert time.process_time() - t0 < 20 and tree_hash(store) == before


# ----------------------------------------------------------------------------- report
def test_report_out_that_cannot_be_created_and_failed_sections(runner, cli, tmp_path, monkeypatch):
    st = tmp_path / "st"
    assert _cli(runner, cli, "synth", st, "--steps", 4, "--layers", 2, "--experts", 16, "--ranks", 4,
                "--ranks-per-node", 4, "--top-k", 2).exit_code == 0
    (tmp_path / "file").write_text("x")
    before = tree_hash(st)
    one_line_error(_cli(runner, cli, "report", st, "--out-dir", tmp_path / "file" / "sub", "--quiet"), 2,
                   str(tmp_path / "file" / "sub"), "cannot create the report folder")
    assert tree_hash(st) == before
    from moetrace.report import build as rb

    real = rb.discover_sections

    def with_a_broken_one():
        class Broken:
            __name__ = "moetrace.report.sections.broken"
            ORDER = 1

            @staticmethod
            def build(ctx):
                raise RuntimeError("boom")

        return [Broken, *real()]

    monkeypatch.setattr(rb, "discover_sections", with_a_broken_one)
    res = _cli(runner, cli, "report", st, "--out-dir", tmp_path / "rep", "--quiet")
    assert res.exit_code == 1, res.output
    assert "section(s) Broken failed" in res.output and (tmp_path / "rep" / "report.md").exists()

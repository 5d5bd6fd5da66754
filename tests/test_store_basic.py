import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest

import moetrace
from moetrace.errors import StoreError
from moetrace.run import Store

from .helpers import run_row, tree_hash


def _run(sha="abc"):
    return run_row(source="unit", source_sha256=sha, num_layers=2, num_experts=4, top_k=2, num_ranks=2,
                   ranks_per_node=2)


def _load():
    # 2 steps x 2 layers x 4 experts, tokens chosen by hand
    rows = []
    for step in range(2):
        for layer in range(2):
            for e in range(4):
                rows.append((step, layer, e, (step + 1) * (layer + 1) * (e + 1)))
    s, l, e, t = zip(*rows)
    return pa.table({"step": list(s), "layer": list(l), "expert": list(e), "slot": pa.nulls(len(s), pa.int32()),
                     "src_rank": pa.nulls(len(s), pa.int32()), "tokens": list(t)})


def test_hive_layout_sql_and_open_store(tmp_path):
    st = moetrace.open_store(tmp_path / "st", create=True)
    res = st.write_run(_run(), {"expert_load": _load()}, run_id="r1")
    assert not res.skipped and res.rows["expert_load"] == 16
    parts = list((tmp_path / "st" / "expert_load" / "run_id=r1").glob("part-*.parquet"))
    assert len(parts) == 1
    df = moetrace.open_store(tmp_path / "st").sql(
        "SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL ORDER BY ALL")
    assert isinstance(df, pl.DataFrame)
    # sum over e of (s+1)(l+1)(e+1) = (s+1)(l+1)*10
    assert df["t"].to_list() == [(s + 1) * (l + 1) * 10 for s in range(2) for l in range(2)]
    assert st.sql("SELECT run_id FROM expert_load LIMIT 1")["run_id"][0] == "r1"


def test_same_source_twice_is_not_duplicated(tmp_path):
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run("same"), {"expert_load": _load()})
    before = tree_hash(tmp_path / "st")
    res = st.write_run(_run("same"), {"expert_load": _load()})
    assert res.skipped
    assert tree_hash(tmp_path / "st") == before
    assert st.sql("SELECT count(*) AS n FROM expert_load")["n"][0] == 16
    assert st.sql("SELECT count(*) AS n FROM runs")["n"][0] == 1


def test_second_run_gets_its_own_partition_and_unique_id(tmp_path):
    st = Store(tmp_path / "st", create=True)
    a = st.write_run(_run("a"), {"expert_load": _load()})
    b = st.write_run(_run("b"), {"expert_load": _load()})
    assert a.run_id != b.run_id
    assert st.run_ids() == sorted([a.run_id, b.run_id])
    with pytest.raises(StoreError, match="choose one \\(--run RUN_ID"):
        st.resolve_run(None)


def test_failed_write_leaves_store_unchanged(tmp_path):
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run("a"), {"expert_load": _load()})
    before = tree_hash(tmp_path / "st")
    bad = _load().drop_columns(["tokens"])
    with pytest.raises(Exception, match="tokens"):
        st.write_run(_run("b"), {"steps": pa.table({"step": [0], "rank": [0], "phase": ["decode"],
                                                    "num_tokens": [1], "is_dummy": [False], "start_ns": [None],
                                                    "end_ns": [None], "inferred": [False]}),
                                 "expert_load": bad})
    assert tree_hash(tmp_path / "st") == before


def test_streamed_chunks_are_written_as_one_table(tmp_path):
    st = Store(tmp_path / "st", create=True)
    chunks = (_load().slice(i * 4, 4) for i in range(4))
    st.write_run(_run("s"), {"expert_load": chunks}, run_id="s")
    expected_total = sum(_load()["tokens"].to_pylist())
    assert st.sql("SELECT count(*) AS n, sum(tokens) AS t FROM expert_load").row(0) == (16, expected_total)
    assert len(list((tmp_path / "st" / "expert_load" / "run_id=s").glob("*.parquet"))) == 1


def test_empty_tables_still_have_typed_views(tmp_path):
    st = Store(tmp_path / "st", create=True)
    df = st.sql("SELECT * FROM spans")
    assert df.height == 0 and "start_ns" in df.columns


def test_catalog_opens_from_anywhere_after_the_store_moves(tmp_path):
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run(), {"expert_load": _load()}, run_id="r1")
    st.write_catalog()
    moved = tmp_path / "elsewhere" / "moved_store"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "st"), moved)
    con = duckdb.connect(str(moved / "catalog.duckdb"), read_only=True)
    con.execute(f"SET file_search_path='{moved}'")
    assert con.execute("SELECT sum(tokens) FROM expert_load").fetchone()[0] == sum(_load()["tokens"].to_pylist())
    con.close()


def test_plain_duckdb_cli_answers_from_catalog(tmp_path):
    exe = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
    if not os.path.exists(exe):
        pytest.skip("the duckdb CLI (pip package duckdb-cli, a test extra) is not installed")
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run(), {"expert_load": _load()}, run_id="r1")
    st.write_catalog()
    out = subprocess.run([exe, "catalog.duckdb", "-csv", "-c",
                          "SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL ORDER BY ALL"],
                         cwd=tmp_path / "st", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "step,layer,t"
    assert [int(x.split(",")[2]) for x in lines[1:]] == [(s + 1) * (l + 1) * 10 for s in range(2) for l in range(2)]


def test_crash_between_renames_is_rolled_back_on_next_write(tmp_path, monkeypatch):
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run("a"), {"expert_load": _load()}, run_id="a")
    before = tree_hash(tmp_path / "st")
    real_replace = os.replace
    calls = {"n": 0}

    def crash_on_second(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:  # journal written, first data file renamed, then "crash"
            raise KeyboardInterrupt("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        st.write_run(_run("b"), {"expert_load": _load(), "placement": pa.table({
            "plan_id": ["recorded"], "layer": [0], "slot": [0], "rank": [0], "node": [0], "expert": [0]})})
    monkeypatch.setattr(os, "replace", real_replace)
    # the in-process undo already restored the store; recover() finds nothing more to do
    assert tree_hash(tmp_path / "st") == before
    assert Store(tmp_path / "st").run_ids() == ["a"]


def test_journal_left_by_a_killed_process_is_rolled_back(tmp_path):
    st = Store(tmp_path / "st", create=True)
    st.write_run(_run("a"), {"expert_load": _load()}, run_id="a")
    # what a SIGKILL after the first rename leaves: a data file in place, a journal, no runs row
    orphan = tmp_path / "st" / "expert_load" / "run_id=b" / "part-00000000dead.parquet"
    orphan.parent.mkdir(parents=True)
    shutil.copy(next((tmp_path / "st" / "expert_load" / "run_id=a").glob("*.parquet")), orphan)
    (tmp_path / "st" / ".txn").mkdir()
    (tmp_path / "st" / ".txn" / "00000000dead.json").write_text(
        '{"files": ["expert_load/run_id=b/part-00000000dead.parquet", "runs/run_id=b/part-00000000dead.parquet"], '
        '"commit_file": "runs/run_id=b/part-00000000dead.parquet"}')
    # a reader never recovers, and never shows the uncommitted run
    assert Store(tmp_path / "st").sql("SELECT count(*) AS n FROM expert_load")["n"][0] == 16
    assert orphan.exists()
    done = Store(tmp_path / "st").recover()
    assert done == ["rolled back 00000000dead"]
    assert not orphan.exists() and not (tmp_path / "st" / ".txn").exists()
    assert Store(tmp_path / "st").sql("SELECT count(*) AS n FROM expert_load")["n"][0] == 16


def test_not_a_store_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file.txt").write_text("hi")
    with pytest.raises(StoreError, match="not a moetrace store"):
        Store(tmp_path / "x")
    with pytest.raises(StoreError, match="no such store"):
        Store(tmp_path / "missing")

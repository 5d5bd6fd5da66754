"""Nsight Systems SQLite export: the real saxpy export against its own kernel table, a
crafted two-process export with NVTX labels, and bad input."""
from __future__ import annotations

import gzip
import shutil
import sqlite3
from pathlib import Path

import pytest

from moetrace.collect import collect
from moetrace.run import Store

from .helpers import shared_data, tree_hash
from .helpers.nsys_export import EPOCH, make_export


def _gunzip(src: Path, dst: Path) -> Path:
    with gzip.open(src) as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)
    return dst


def test_saxpy_spans_match_kernel_table(tmp_path, runner, cli):
    src = shared_data("nsys_saxpy_mpi_cuda.sqlite.gz")
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(src), "--store", str(st)])
    assert res.exit_code == 0, res.output
    db = sqlite3.connect(_gunzip(src, tmp_path / "saxpy.sqlite"))
    (epoch,) = db.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
    want = sorted(db.execute("""SELECT k.start + ?, k.end + ?, k.deviceId, k.streamId, s.value
                                FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName""",
                             (epoch, epoch)).fetchall())
    n_copies = db.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY").fetchone()[0]
    store = Store(st)
    got = store.sql("""SELECT s.start_ns, s.end_ns, s.device, s.stream, k.name FROM spans s
                       JOIN kernel_names k USING (run_id, name_id) WHERE s.kind NOT IN ('memcpy', 'memset')
                       ORDER BY 1, 2""").rows()
    assert [tuple(r) for r in got] == want and len(want) == 5
    assert store.sql("SELECT count(*) AS n FROM spans WHERE kind = 'memcpy'")["n"][0] == n_copies == 15
    assert store.sql("SELECT time_base FROM runs")["time_base"][0] == "epoch"
    res = runner.invoke(cli, ["exposure", str(st)])
    assert "no all-to-all found" in res.output


def test_two_process_export_with_nvtx_labels(tmp_path, runner, cli):
    f = make_export(tmp_path / "job.nsys.sqlite")
    (run,) = collect([f])
    t = run.tables["spans"].to_pylist()
    names = dict(zip(run.tables["kernel_names"].column("name_id").to_pylist(),
                     run.tables["kernel_names"].column("name").to_pylist()))
    got = sorted((r["rank"], r["kind"], r["step"], r["layer"], r["start_ns"] - EPOCH, r["end_ns"] - EPOCH, r["device"],
                  r["inferred"]) for r in t)
    want = []
    for rank in (0, 1):
        off = rank * 7
        want += [(rank, "dispatch", 2, 1, 100 + off, 150 + off, rank, False),
                 (rank, "expert_gemm", 2, None, 160 + off, 400 + off, rank, False),
                 (rank, "combine", 2, 1, 410 + off, 470 + off, rank, False),
                 (rank, "memset", 2, None, 480 + off, 481 + off, rank, False)]
    assert got == sorted(want)
    # Nsight's (bool)1 demangling normalized to the Kineto spelling
    assert any(n.startswith("deep_ep::internode_ll::dispatch<true, 3, 7168>") for n in names.values())
    assert run.run["num_ranks"] == 2 and run.run["time_base"] == "epoch"
    st = tmp_path / "st"
    assert runner.invoke(cli, ["ingest", str(f), "--store", str(st)]).exit_code == 0
    res = runner.invoke(cli, ["exposure", str(st), "--by", "mode"])
    assert "deepep_ll_hook" in res.output and "hook mode detected" in res.output
    # exposure by hand: dispatch 100..150 and combine 410..470 overlap no compute (gemm is 160..400)
    ex = Store(st).sql("SELECT rank, kind, comm_ns, overlapped_ns, exposed_ns FROM a2a_exposure ORDER BY 1, 2").rows()
    assert [tuple(r) for r in ex] == [(0, "combine", 60, 0, 60), (0, "dispatch", 50, 0, 50),
                                      (1, "combine", 60, 0, 60), (1, "dispatch", 50, 0, 50)]


def test_sqlite_that_is_not_an_export(tmp_path, runner, cli):
    f = tmp_path / "other.sqlite"
    db = sqlite3.connect(f)
    db.execute("CREATE TABLE t (a INT)")
    db.commit()
    db.close()
    st = tmp_path / "st"
    ok = make_export(tmp_path / "ok.sqlite")
    assert runner.invoke(cli, ["ingest", str(ok), "--store", str(st)]).exit_code == 0
    before = tree_hash(st)
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(st)])
    assert res.exit_code == 2 and "other.sqlite" in res.output and "not an Nsight Systems export" in res.output
    g = tmp_path / "trunc.sqlite.gz"
    g.write_bytes(gzip.compress(ok.read_bytes())[:200])
    res = runner.invoke(cli, ["ingest", str(g), "--store", str(st), "--format", "nsys"])
    assert res.exit_code == 2 and "trunc.sqlite.gz" in res.output
    assert tree_hash(st) == before


@pytest.mark.parametrize("bad", ["negative", "absurd"])
def test_bad_durations(tmp_path, runner, cli, bad):
    f = make_export(tmp_path / "x.sqlite")
    db = sqlite3.connect(f)
    if bad == "negative":
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 5 WHERE demangledName = 3")
    else:
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start + 7200000000000 WHERE demangledName = 3")
    db.commit()
    db.close()
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st")])
    assert res.exit_code == 2 and "x.sqlite" in res.output and "duration" in res.output
    assert not (tmp_path / "st").exists() or not Store(tmp_path / "st").run_ids()

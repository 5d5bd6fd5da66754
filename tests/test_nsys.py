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

from .conftest import shared_data, tree_hash

EPOCH = 1_700_000_000_000_000_000


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


def make_export(path: Path, *, processes=(1001, 1002)) -> Path:
    """A minimal export in the real schema: two processes, one GPU each, NVTX labels."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT, mangledName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, eventClass INT, globalTid INT,
            correlationId INT, nameId INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, value INT, bytes INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, eventType INT, rangeId INT, category INT, color INT,
            text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT);
        CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INT, utcTime TEXT, localTime TEXT);
    """)
    names = {1: "void deep_ep::internode_ll::dispatch<(bool)1, (int)3, (int)7168>(void *, float *)",
             2: "void deep_ep::internode_ll::combine<(bool)0, (int)3, (int)7168>(void *)",
             3: "void cutlass::device_kernel<grouped_gemm::Kernel>(Params)",
             4: "ProfilerStep#2", 5: "dispatch layer 1", 6: "combine layer 1", 7: "cudaLaunchKernel"}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", names.items())
    db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')", (EPOCH,))
    for i, pid in enumerate(processes):
        gpid = (0x1 << 56) | (pid << 24)
        gtid = gpid | pid
        off = i * 7  # the second process is a little late
        c = 100 * (i + 1)
        # NVTX: step 0..1000, dispatch 10..60 (launch at 20), combine 300..360 (launch at 310)
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, NULL, ?, NULL, 4, 0)",
                   (0 + off, 1000 + off, gtid))
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, 'dispatch layer 1', ?, NULL, NULL, 0)",
                   (10 + off, 60 + off, gtid))
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, NULL, ?, NULL, 6, 0)",
                   (300 + off, 360 + off, gtid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)", (20 + off, 25 + off, gtid, c))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)",
                   (100 + off, 105 + off, gtid, c + 1))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 7)",
                   (310 + off, 315 + off, gtid, c + 2))
        # hook mode: LL kernels on the compute stream 7
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 1, 1, 1)",
                   (100 + off, 150 + off, i, c, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 3, 3, 3)",
                   (160 + off, 400 + off, i, c + 1, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 7, ?, ?, 2, 2, 2)",
                   (410 + off, 470 + off, i, c + 2, gpid))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?, ?, ?, 1, 7, ?, ?, 0, 64)",
                   (480 + off, 481 + off, i, 9999, gpid))
    db.commit()
    db.close()
    return path


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

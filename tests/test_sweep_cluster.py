"""Replay sweeps fanned out on a Dask cluster: the same rows as the single-process
sweep, the same stored replay tables, one line and exit 2 (store unchanged) when the
scheduler cannot be reached. One LocalCluster of 2 worker processes (threads_per_worker=1)
serves the module; ``--workers 2`` (a cluster of its own) is the slow test."""
from __future__ import annotations

import json
import math
import shutil
import socket
from dataclasses import asdict

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import Store

from .helpers import module_fixture, tree_hash

distributed_pkg = pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is not installed")

from moetrace.replay import distributed  # noqa: E402
from moetrace.replay import sweep as sweeps

TOKENS, TOP_K, RANKS = 256, 4, 8
SWEEP = dict(policy="eplb", replicas=[0, 8], intervals=[5, 10], windows=[10])


def run_cli(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env)


@module_fixture
def store_path(tmp_path_factory):
    """Two drifting synthetic runs (64 experts, 8 ranks in 2 nodes, 4 groups, 40 steps)."""
    p = tmp_path_factory.mktemp("sweep") / "st"
    st = Store(p, create=True)
    for seed in (0, 1):
        synth(st, SynthConfig(layers=2, experts=64, top_k=TOP_K, ranks=RANKS, ranks_per_node=4, steps=40,
                              tokens_per_step=TOKENS, sigma=0.8, drift=0.6, seed=seed, num_groups=4,
                              dummy_share=0.1 * seed), run_id=f"r{seed}")
    return p


@module_fixture
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=50) as c, Client(c) as client:
        yield c, client


def _copy(store_path, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(store_path, dst)
    return dst


def _job(st, run_id, sweep_id):
    run = st.run(run_id)
    return sweeps.plan_sweep(st, run_id, run._replay_shape, SWEEP["policy"], SWEEP["replicas"], SWEEP["intervals"],
                              SWEEP["windows"], run._replay_opts(), write=True, sweep_id=sweep_id)


def _same_value(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-12 * max(1.0, abs(a))
    return a == b


def _assert_rows_equal(x, y):
    assert len(x.rows) == len(y.rows)
    for rx, ry in zip(x.rows, y.rows):
        dx, dy = asdict(rx), asdict(ry)
        assert dx.keys() == dy.keys()
        bad = {k: (dx[k], dy[k]) for k in dx if not _same_value(dx[k], dy[k])}
        assert not bad, (rx.what, bad)
    assert x.notes == y.notes


def _replay_tables(path, run_id):
    st = Store(path)
    runs = st.sql("SELECT * EXCLUDE (created_at_ns) FROM replay_runs WHERE run_id = ? ORDER BY replay_id", [run_id])
    layer = st.sql("SELECT * FROM replay_layer WHERE run_id = ? ORDER BY replay_id, step, layer", [run_id])
    return runs, layer


def test_cluster_sweep_equals_single_process(store_path, tmp_path, cluster):
    """Both runs' cells fanned out together on 2 worker processes: the same rows and notes
    as the single-process sweep of each run, and the same replay_runs / replay_layer rows
    stored (created_at_ns aside: a wall-clock stamp)."""
    _, client = cluster
    a, b = _copy(store_path, tmp_path, "a"), _copy(store_path, tmp_path, "b")
    sa, sb = Store(a), Store(b)
    single = {rid: sweeps.finish_sweep(sa, job, sweeps.run_sweep_cells(sa, job))
              for rid, job in ((rid, _job(sa, rid, f"s-{rid}")) for rid in ("r0", "r1"))}
    jobs = [_job(sb, rid, f"s-{rid}") for rid in ("r0", "r1")]
    assert len(jobs[0].cells) == 2 * 3 * 1          # replicas x (static + 2 intervals) x windows
    on_cluster = distributed.run_jobs(client, sb, jobs)
    for job, res in zip(jobs, on_cluster):
        _assert_rows_equal(single[job.run_id], res)
        assert res.sweep_id == f"s-{job.run_id}"
        ra, la = _replay_tables(a, job.run_id)
        rb, lb = _replay_tables(b, job.run_id)
        assert ra.height == len(job.cells) and ra["replay_id"].to_list() == [c.replay_id for c in job.cells]
        assert ra.equals(rb, null_equal=True)
        assert la.equals(lb, null_equal=True)
        # independent of both paths: every (step, layer) of a synthetic run routes tokens x top_k
        # assignments, so the mean rank load is tokens x top_k / ranks where the step ran (idle
        # steps of run r1 carry fewer tokens, never more)
        T, J = job.shape.steps.size, job.first
        assert la.height == len(job.cells) * (T - J) * job.shape.layers.size
        mean = lb["mean_rank_tokens"].to_numpy()
        assert np.all(mean <= TOKENS * TOP_K / RANKS + 1e-9)
        if job.run_id == "r0":
            np.testing.assert_allclose(mean, TOKENS * TOP_K / RANKS, rtol=0, atol=1e-9)
        # the stored row of each cell is the table's row
        for c, row in zip(job.cells, (r for r in res.rows if r.skipped is None)):
            got = rb.filter(pl.col("replay_id") == c.replay_id).row(0, named=True)
            assert got["kind"] == "sweep" and json.loads(got["params_json"])["cell"] == row.what
            assert got["net_step_ns"] == round(row.net_ms * 1e6)
            li = lb.filter(pl.col("replay_id") == c.replay_id)["imbalance"].drop_nulls().to_numpy()
            assert row.mean_imbalance == pytest.approx(float(li.mean()), rel=1e-12)


def test_cli_scheduler_address_and_env(store_path, tmp_path, cluster):
    """`moetrace sweep --scheduler ADDRESS` (and DASK_SCHEDULER_ADDRESS) on an existing
    cluster prints the single-process table."""
    c, _ = cluster
    args = ("sweep", store_path, "--run", "r0", "--replicas", "0,8", "--replan-every", "5,10", "--window", "10",
            "--format", "json")
    one = run_cli(*args)
    assert one.exit_code == 0, one.output
    rows = json.loads(one.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    addr = c.scheduler_address
    for extra, env in ((("--scheduler", addr), None), ((), {"DASK_SCHEDULER_ADDRESS": addr})):
        r = run_cli(*args, *extra, env=env)
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert [x.keys() for x in got] == [x.keys() for x in rows]
        for x, y in zip(rows, got):
            assert all(_same_value(x[k], y[k]) for k in x), (x, y)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_scheduler_one_line_exit_2_store_unchanged(store_path, tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT_S", 1)
    p = _copy(store_path, tmp_path, "u")
    before = tree_hash(p)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    r = run_cli("sweep", p, "--run", "r0", "--replicas", "0", "--replan-every", "5", "--save", "--scheduler", addr)
    assert r.exit_code == 2
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and addr in lines[0] and "no Dask scheduler reachable" in lines[0], r.output
    assert tree_hash(p) == before


@pytest.mark.parametrize("extra, words", [(("--workers", "0"), "'--workers': 0 is not in the range 1<=x<=1024"),
                                         (("--workers", "2", "--scheduler", "tcp://127.0.0.1:1"), "not both")])
def test_bad_cluster_options(store_path, tmp_path, extra, words):
    p = _copy(store_path, tmp_path, "o")
    before = tree_hash(p)
    r = run_cli("sweep", p, "--run", "r0", "--replicas", "0", "--replan-every", "5", "--save", *extra)
    assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert tree_hash(p) == before


@pytest.mark.slow
def test_cli_workers_local_cluster_saves_once(store_path, tmp_path):
    """`--workers 2 --save` starts its own LocalCluster of processes: the table equals the
    single-process one and one transaction adds the cells' replay rows."""
    a, b = _copy(store_path, tmp_path, "wa"), _copy(store_path, tmp_path, "wb")
    args = ("--run", "r1", "--replicas", "0,8", "--replan-every", "5", "--window", "10", "--save", "--format", "json")
    one, two = run_cli("sweep", a, *args), run_cli("sweep", b, *args, "--workers", "2")
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    x, y = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (one, two))
    assert len(x) == 4 and all(_same_value(p[k], q[k]) for p, q in zip(x, y) for k in p)
    parts = sorted(f.name for f in (b / "replay_runs" / "run_id=r1").glob("*.parquet"))
    assert len(parts) == 1            # one transaction
    ra, la = _replay_tables(a, "r1")
    rb, lb = _replay_tables(b, "r1")
    drop = ["replay_id", "summary_json", "params_json"]    # ids carry the sweep's own id and time
    assert ra.drop(drop).equals(rb.drop(drop), null_equal=True)
    assert la.drop("replay_id").equals(lb.drop("replay_id"), null_equal=True)


def test_cli_all_runs_fanned_out_together(store_path, tmp_path, cluster):
    """`--all-runs`: every run's cells are tasks of one fan-out (plans x windows x budgets x
    runs); each run's rows equal its own single-process sweep, each run stored once."""
    c, _ = cluster
    p = _copy(store_path, tmp_path, "all")
    sweep = ("--replicas", "0,8", "--replan-every", "5", "--window", "10", "--format", "json")
    r = run_cli("sweep", p, "--all-runs", *sweep, "--save", "--scheduler", c.scheduler_address)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["run_id"] for x in got] == ["r0"] * 4 + ["r1"] * 4
    for rid in ("r0", "r1"):
        one = run_cli("sweep", store_path, "--run", rid, *sweep)
        rows = json.loads(one.stdout.strip().splitlines()[-1])
        mine = [{k: v for k, v in x.items() if k != "run_id"} for x in got if x["run_id"] == rid]
        assert all(_same_value(a[k], b[k]) for a, b in zip(rows, mine) for k in a) and len(mine) == len(rows)
        assert len(list((p / "replay_runs" / f"run_id={rid}").glob("*.parquet"))) == 1
        assert Store(p).sql("SELECT count(*) n FROM replay_runs WHERE run_id = ? AND kind = 'sweep'",
                            [rid])["n"][0] == 4

"""NCCL Inspector records as the plugin's writer prints them (tests/fixtures/nccl_inspector_v4,
built from NVIDIA/nccl 5067397c plugins/profiler/inspector/inspector_json.cc and json.cc):
compact JSON, "%lf" doubles, "nan" bandwidths, P2P records, plain and verbose; numbers
written as whole-number floats; records of another kind; later v4.x version strings;
Prometheus mode. Expected values are the fixture's hand-set values (its make.py docstring)."""
from __future__ import annotations

import shutil

import pytest

from moetrace.run import Store

from .helpers import REPO, invoke
from .helpers import one_line_error as _one_line_error

FIX = REPO / "tests" / "fixtures" / "nccl_inspector_v4"
# per rank r: AllReduce 100+r, 200+r, 300+r us; AllGather 0 us; one P2P of 50 us
WANT_US = {0: 100 + 200 + 300 + 0 + 50, 1: 101 + 201 + 301 + 0 + 50}


def _ingest(src, tmp_path, runner, cli, *extra):
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", src, "--store", st, *extra)
    assert res.exit_code == 0, res.output
    return Store(st)


def test_fixture_is_what_make_writes(tmp_path):
    import runpy

    mod = runpy.run_path(str(FIX / "make.py"))
    for sub, verb in (("plain", False), ("verbose", True)):
        for r in (0, 1):
            assert (FIX / sub / f"node0-pid{2000 + r}.log").read_text() == "\n".join(mod["lines"](r, verb)) + "\n"


@pytest.mark.parametrize("sub", ["plain", "verbose"])
def test_writer_layout_ingests_with_hand_values(sub, tmp_path, runner, cli):
    s = _ingest(FIX / sub, tmp_path, runner, cli)
    got = {r: (n, us, p2p, nulls) for r, n, us, p2p, nulls in s.sql(
        "SELECT rank, count(*), sum(duration_ns) // 1000, count(*) FILTER (WHERE is_p2p), "
        "count(*) FILTER (WHERE algo_bw_gbps IS NULL) FROM collectives GROUP BY rank").iter_rows()}
    assert got == {0: (5, WANT_US[0], 1, 1), 1: (5, WANT_US[1], 1, 1)}
    peers = dict(s.sql("SELECT op, peer FROM collectives WHERE is_p2p AND rank = 0").iter_rows())
    assert peers == {"send": 1}
    # "%lf": 1 MiB in 100 us = 10.485760 GB/s as printed
    bw = s.sql("SELECT algo_bw_gbps FROM collectives WHERE rank = 0 AND op = 'all_reduce' AND seq = 0")
    assert bw.item() == pytest.approx(10.485760)
    spans = s.sql("SELECT count(*) AS n FROM spans")["n"][0] if sub == "verbose" else 0
    assert spans == (8 if sub == "verbose" else 0)     # 4 collectives x 2 ranks; P2P stays a record


def _edited(tmp_path, old, new, extra_line=None):
    d = tmp_path / "in"
    shutil.copytree(FIX / "plain", d)
    f = d / "node0-pid2000.log"
    text = f.read_text()
    assert old in text
    text = text.replace(old, new, 1)
    f.write_text(text + (extra_line + "\n" if extra_line else ""))
    return d


def test_whole_number_floats_are_read_and_a_fraction_refused(tmp_path, runner, cli):
    d = _edited(tmp_path, '"coll_exec_time_us":100,', '"coll_exec_time_us":100.0,')
    s = _ingest(d, tmp_path, runner, cli)
    assert s.sql("SELECT sum(duration_ns) // 1000 AS us FROM collectives WHERE rank = 0")["us"][0] == WANT_US[0]
    bad = _edited(tmp_path / "b", '"coll_exec_time_us":100,', '"coll_exec_time_us":100.5,')
    res = invoke(runner, cli, "ingest", bad, "--store", tmp_path / "st2")
    _one_line_error(res, "node0-pid2000.log", "line 1", "coll_exec_time_us")


def test_records_of_another_kind_and_later_versions_are_said_not_refused(tmp_path, runner, cli):
    first = (FIX / "plain" / "node0-pid2000.log").read_text().splitlines()[0]
    other = first.split(',"coll_perf"')[0] + ',"dump_stats":{"records_written":5}}'
    d = _edited(tmp_path, '"v4.0"', '"v4.3"', extra_line=other)
    s = _ingest(d, tmp_path, runner, cli)
    assert s.sql("SELECT count(*) AS n FROM collectives")["n"][0] == 10
    approx = s.sql("SELECT approximations FROM runs")["approximations"][0]
    assert "1 record(s) with neither coll_perf nor p2p_perf" in approx and "v4.3" in approx


def test_prometheus_mode_is_named_and_refused(tmp_path, runner, cli):
    # the metric lines of NVIDIA/nccl 5067397c plugins/profiler/inspector/README.md ("Current Metric
    # Format Examples"), as inspector_prom.cc prints them
    f = tmp_path / "nccl_inspector_metrics_GPU-0.prom"
    f.write_text(
        'nccl_bus_bandwidth_gbs{version="v5.1",slurm_job_id="unknown",node="n1",gpu="GPU0",comm_name="DP Group 0",'
        'n_nodes="1",nranks="4",collective="AllReduce",message_size="4-5GB",algo_proto="Ring_ll"} 678.263\n'
        'nccl_collective_exec_time_microseconds{version="v5.1",slurm_job_id="unknown",node="n1",gpu="GPU0",'
        'comm_name="DP Group 0",n_nodes="1",nranks="4",collective="AllReduce",message_size="4-5GB",'
        'algo_proto="Ring_ll"} 9498.47\n')
    res = invoke(runner, cli, "ingest", f, "--store", tmp_path / "st")
    _one_line_error(res, f.name, "Prometheus-mode", "NCCL_INSPECTOR_PROM_DUMP=0")
    assert not (tmp_path / "st").exists()

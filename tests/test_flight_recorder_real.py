"""Flight Recorder dumps written by real PyTorch (the installed torch, CPU, gloo, four ranks:
tests/helpers/fr_writer.py), ingested without --format, and the hang post-mortem on them. Every
expected number is the hand count of what the writer's ranks run (its docstring), not read
back from the dumps."""
from __future__ import annotations

import subprocess
import sys

import pytest

from moetrace.run import Store
from moetrace.safety_pickle import load_plain

from .helpers import REPO, invoke
from .helpers import fr_writer as W

DEFAULT = W.N_ALL_REDUCE + 2          # all_reduce x12, barrier, all_gather
STUCK = DEFAULT + 1                   # the all_reduce rank 2 never calls


def _write(out, *flags):
    res = subprocess.run([sys.executable, "-m", "tests.helpers.fr_writer", str(out), *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fr_real") / "dumps")


def _split(dumps, tmp_path):
    """The pickles and the JSON dumps in two folders (one run each)."""
    pk, js = tmp_path / "pickle", tmp_path / "json"
    pk.mkdir()
    js.mkdir()
    for r in range(W.WORLD):
        (pk / f"fr_rank_{r}").write_bytes((dumps / f"fr_rank_{r}").read_bytes())
        (js / f"fr_rank_{r}.json").write_bytes((dumps / f"fr_rank_{r}.json").read_bytes())
    return pk, js


# entries per rank by hand: the default group's collectives it called (the pending one
# included), plus the pair group's all_reduce on ranks 0 and 1; sends/recvs leave no entry
WANT_ENTRIES = {0: STUCK + 1, 1: STUCK + 1, 2: DEFAULT, 3: STUCK}
# pg_status last enqueued, in collective seq ids, per (rank, group). (gloo's last completed
# is written by whichever of its worker threads ends an op last, so it may lag: only its
# bound is checked; the entries' `retired` says what finished.)
WANT_STATUS = {(0, "0"): STUCK, (1, "0"): STUCK, (2, "0"): DEFAULT, (3, "0"): STUCK, (0, "1"): 1, (1, "1"): 1}


def test_the_real_dumps_carry_what_the_collector_must_accept(dumps):
    d = load_plain(dumps / "fr_rank_0")        # the plain-values reader: nothing is imported or called
    assert d["version"] == "2.10"
    assert {st["last_started_collective"] for st in d["pg_status"].values()} == {-1}   # timing off
    assert set(d["pg_config"]) == {""}          # gloo registers groups before naming them
    assert {e["state"] for e in d["entries"]} == {"scheduled"} and any(e["retired"] for e in d["entries"])
    head = (dumps / "fr_rank_0.json").read_bytes()[:4096]
    assert b'"version"' not in head and b'"pg_config"' not in head   # sorted keys: after the entries


@pytest.mark.parametrize("kind", ["pickle", "json"])
def test_real_dumps_ingest_without_format_and_name_the_hang(dumps, tmp_path, runner, cli, kind):
    src = dict(zip(("pickle", "json"), _split(dumps, tmp_path)))[kind]
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", src, "--store", st)
    assert res.exit_code == 0, res.output
    s = Store(st)
    assert s.sql("SELECT format FROM runs")["format"].to_list() == ["flight_recorder"] \
        if "format" in s.sql("SELECT * FROM runs LIMIT 0").columns else True
    got = dict(s.sql("SELECT rank, count(*) AS n FROM collectives GROUP BY rank").iter_rows())
    assert got == WANT_ENTRIES
    g = s.sql("SELECT rank, grp, last_enqueued_seq, last_started_seq, last_completed_seq FROM comm_groups")
    assert {(r, grp): e for r, grp, e, _, _ in g.iter_rows()} == WANT_STATUS
    assert all(c <= WANT_STATUS[r, grp] for r, grp, _, _, c in g.iter_rows() if c is not None)
    fin = dict(s.sql("SELECT rank, count(*) FILTER (WHERE retired) AS n FROM collectives GROUP BY rank").iter_rows())
    assert fin == {0: DEFAULT + 1, 1: DEFAULT + 1, 2: DEFAULT, 3: DEFAULT}   # all but the pending one
    assert g["last_started_seq"].null_count() == g.height        # -1 in the dump: nothing known
    desc = dict(s.sql("SELECT DISTINCT grp, group_desc FROM collectives").iter_rows())
    assert desc == {"0": "default_pg", "1": "pair"}

    h = s.run().hang()
    rows = {r["grp"]: r for r in h.groups.iter_rows(named=True)}
    assert set(rows) == {"0", "1"}               # no group "" of every rank
    assert (rows["0"]["stuck_seq"], rows["0"]["op"], rows["0"]["waiting"], rows["0"]["never_reached"]) == \
        (STUCK, "gloo:all_reduce", [0, 1, 3], [2])
    assert rows["0"]["members"] == [0, 1, 2, 3] and rows["1"]["members"] == [0, 1]
    assert rows["1"]["stuck_seq"] is None
    out = invoke(runner, cli, "hang", st)
    assert out.exit_code == 0, out.output
    assert f"ranks 0, 1, 3 wait in gloo:all_reduce #{STUCK}" in out.output
    assert f"rank 2 never reached it (rank 2 got to #{DEFAULT}, completed)" in out.output
    assert "group 1 (pair)" not in out.output


@pytest.mark.slow
def test_timing_on_reads_the_same(tmp_path, runner, cli):
    # TORCH_NCCL_ENABLE_TIMING=1: gloo still records no duration and no start (pg_status -1)
    d = _write(tmp_path / "timed", "--timing")
    pk, _ = _split(d, tmp_path)
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", pk, "--store", st).exit_code == 0
    s = Store(st)
    assert s.sql("SELECT count(*) AS n FROM collectives WHERE duration_ns IS NOT NULL")["n"][0] == 0
    h = s.run().hang()
    assert h.never_reached("0") == [2]


# ----------------------------------------------------------------------------- schema versions
# The entry fields of each dump version as PyTorch's writer emits them (NCCL backend):
# version 2.3: torch/csrc/distributed/c10d/TraceUtils.h (NCCLTraceBuffer::dump: record_id,
# pg_id, process_group, collective_seq_id, p2p_seq_id, op_id, profiling_name,
# time_created_ns, duration_ms when timed, input/output sizes and dtypes, state,
# time_discovered_*_ns, retired, timeout_ms, is_p2p, frames); 2.10 (torch 2.13:
# FlightRecorder.hpp version_val "2.10", FlightRecorderDetail.hpp getCollectiveTrace) adds
# thread_name and thread_id and the dump's comm_lib_version. pg_status values are ints in the
# pickle (-1 for nothing yet), text in dump_json.
def _nccl_entry(version, rid, seq, state, timed):
    e = {"frames": [], "record_id": rid, "pg_id": 0, "process_group": ("0", "default_pg"),
         "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce",
         "time_created_ns": 10**18 + 1000 * rid, "input_sizes": [[1024]], "input_dtypes": ["BFloat16"],
         "output_sizes": [[1024]], "output_dtypes": ["BFloat16"], "state": state,
         "time_discovered_started_ns": 10**18 + 1000 * rid + 5 if state != "scheduled" and timed else None,
         "time_discovered_completed_ns": 10**18 + 1000 * rid + 9 if state == "completed" and timed else None,
         "retired": state == "completed", "timeout_ms": 600000, "is_p2p": False}
    if timed and state == "completed":
        e["duration_ms"] = 0.25
    if version == "2.10":
        e["thread_name"], e["thread_id"] = "pt_nccl_watchdg", "140000"
    return e


@pytest.mark.parametrize("version", ["2.3", "2.4", "2.7", "2.10"])
@pytest.mark.parametrize("timed", [False, True])
def test_nccl_dumps_of_every_version(version, timed, tmp_path, runner, cli):
    """Two NCCL ranks: rank 0 completed #1..#3 and started #4; rank 1 completed #1..#3 only."""
    import pickle

    d = tmp_path / "dumps"
    d.mkdir()
    for r in (0, 1):
        last = 4 if r == 0 else 3
        ents = [_nccl_entry(version, s - 1, s, "completed" if s < 4 else ("started" if timed else "scheduled"), timed)
                for s in range(1, last + 1)]
        dump = {"version": version, "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                "pg_status": {"0": {"last_enqueued_collective": last, "last_started_collective": last if timed else -1,
                                    "last_completed_collective": 3}},
                "entries": ents}
        if version == "2.10":
            dump["comm_lib_version"] = "2.27.5"
        (d / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2))
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st)
    assert res.exit_code == 0, res.output
    s = Store(st)
    assert s.sql("SELECT count(*) AS n FROM collectives")["n"][0] == 7
    timed_n = s.sql("SELECT count(*) AS n FROM collectives WHERE duration_ns = 250000")["n"][0]
    assert timed_n == (6 if timed else 0)
    row = s.run().hang().groups.row(0, named=True)
    assert (row["stuck_seq"], row["waiting"], row["never_reached"]) == (4, [0], [1])

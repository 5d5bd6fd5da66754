"""NCCL Inspector JSON lines (sample_traces/nccl_inspector). Expected numbers are computed
here from the raw records with json, by hand: counts, durations, and the waits of the
instances matched by (communicator, collective, coll_sn)."""
from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from moetrace.errors import InputError
from moetrace.run import Store

from .helpers import REPO, invoke, module_fixture, tree_hash
from .helpers import one_line_error as _one_line_error

SAMPLE = REPO / "sample_traces" / "nccl_inspector"


def _raw():
    """{file: [record dict]} of the sample, parsed with json."""
    return {p.name: [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
            for p in sorted(SAMPLE.iterdir())}


def _global_rank(recs):
    """The file's rank in the 4-rank communicator (the one every file records)."""
    return next(r["header"]["rank"] for r in recs if r["header"]["n_ranks"] == 4)




@module_fixture
def store(tmp_path_factory):
    from click.testing import CliRunner

    from moetrace.cli import cli

    st = tmp_path_factory.mktemp("ni") / "st"
    res = CliRunner().invoke(cli, ["ingest", str(SAMPLE), "--store", str(st)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return Store(st)


def test_sample_is_what_the_generator_writes(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mcs", REPO / "sample_traces" / "make_comm_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", tmp_path)
    mod.nccl_inspector()
    for p in sorted(SAMPLE.iterdir()):
        assert (tmp_path / "nccl_inspector" / p.name).read_bytes() == p.read_bytes(), p.name
    assert sum(p.stat().st_size for p in SAMPLE.iterdir()) < 100_000


def test_counts_and_durations_equal_the_raw_records(store):
    raw = _raw()
    got = store.sql("SELECT rank, count(*) AS n, sum(duration_ns) AS d, sum(msg_bytes) AS b, "
                    "count(*) FILTER (WHERE is_p2p) AS p2p FROM collectives GROUP BY rank ORDER BY rank")
    want = {}
    for recs in raw.values():
        g = _global_rank(recs)
        perf = [r.get("coll_perf") or r["p2p_perf"] for r in recs]
        want[g] = (len(recs), sum(1000 * (p.get("coll_exec_time_us", p.get("p2p_exec_time_us"))) for p in perf),
                   sum(p.get("coll_msg_size_bytes", p.get("p2p_msg_size_bytes")) for p in perf),
                   sum("p2p_perf" in r for r in recs))
    assert {r: (n, d, b, p) for r, n, d, b, p in got.iter_rows()} == want
    run = store.sql("SELECT * FROM runs").row(0, named=True)
    assert run["num_ranks"] == 4 and run["time_base"] == "epoch" and run["collector"] == "nccl_inspector"


def test_ranks_in_small_communicators_are_global_ranks(store):
    raw = _raw()
    rows = store.sql("SELECT rank, group_rank, grp FROM collectives WHERE group_size = 2 ORDER BY rank, grp")
    want = sorted({(_global_rank(recs), r["header"]["rank"], r["header"]["id"]) for recs in raw.values()
                   for r in recs if r["header"]["n_ranks"] == 2})
    assert sorted(set(rows.iter_rows())) == want
    assert {(2, 0), (3, 1)} <= {(a, b) for a, b, _ in want}   # rank 2 is rank 0 of its TP pair


def _instances(raw):
    """(comm, coll, sn) -> {global rank: (first kernel start µs, last kernel stop µs)} and n_ranks."""
    inst, size = defaultdict(dict), {}
    for recs in raw.values():
        g = _global_rank(recs)
        for r in recs:
            c = r.get("coll_perf")
            if c is None:
                continue
            k = (r["header"]["id"], c["coll"], c["coll_sn"])
            ks = c["event_trace_ts"]["kernel_events"]
            inst[k][g] = (min(e["kernel_start_ts"] for e in ks), max(e["kernel_stop_ts"] for e in ks))
            size[k] = r["header"]["n_ranks"]
    return inst, size


def test_waits_of_instances_matched_by_comm_and_sequence_number(store):
    inst, size = _instances(_raw())
    full = {k: v for k, v in inst.items() if len(v) == size[k]}
    assert len(inst) == 13 and len(full) == 12          # AllReduce #2 lacks rank 3's record
    matrix = defaultdict(int)
    caused = defaultdict(int)
    last_count = defaultdict(int)
    for _k, v in full.items():
        last = max(a for a, _ in v.values())
        lr = max((a, -r) for r, (a, _) in v.items())   # latest start; ties: lowest rank (the view's rule)
        lr = -lr[1]
        last_count[lr] += 1
        for r, (a, _) in v.items():
            if r != lr and last > a:
                matrix[r, lr] += (last - a) * 1000
                caused[lr] += (last - a) * 1000
    m = store.sql("SELECT rank, waited_for, wait_ns FROM wait_matrix")
    assert {(r, w): ns for r, w, ns in m.iter_rows()} == dict(matrix)
    s = store.sql("SELECT rank, caused_wait_ns, times_last FROM rank_wait_summary ORDER BY rank")
    assert {r: (c, t) for r, c, t in s.iter_rows()} == {r: (caused[r], last_count[r]) for r in range(4)}
    assert caused[2] == 6 * (170 + 160 + 140) * 1000      # 150 µs late at each of the 6 All2All
    cov = store.sql("SELECT matched, unmatched FROM wait_coverage").row(0)
    assert cov == (12, 0)
    approx = json.loads(store.sql("SELECT approximations FROM runs")["approximations"][0])
    assert any("1 of 13 collective instances" in a for a in approx)
    assert any("gettimeofday" in a for a in approx)
    # spans hold exactly the full instances, with the kernel window
    sp = store.sql("SELECT rank, process_group, collective, start_ns, end_ns FROM spans")
    assert sp.height == sum(len(v) for v in full.values())


def test_waits_command_names_the_late_rank(store, runner, cli):
    res = invoke(runner, cli, "waits", store.path)
    assert res.exit_code == 0, res.output
    assert "rank 2 made the others wait most: 2.820 ms" in res.output


def _strip_verbose(src: Path, dst: Path) -> None:
    dst.mkdir()
    for p in sorted(src.iterdir()):
        out = []
        for ln in p.read_text().splitlines():
            r = json.loads(ln)
            for key in ("coll_perf", "p2p_perf"):
                if key in r:
                    r[key].pop("event_trace_ts", None)
                    r[key].pop("event_trace_sn", None)
            out.append(json.dumps(r))
        (dst / p.name).write_text("\n".join(out) + "\n")


def test_non_verbose_gives_per_rank_times_without_waits(tmp_path, runner, cli):
    src = tmp_path / "plain"
    _strip_verbose(SAMPLE, src)
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", src, "--store", st)
    assert res.exit_code == 0, res.output
    s = Store(st)
    raw = _raw()
    assert s.sql("SELECT count(*) AS n FROM collectives")["n"][0] == sum(len(v) for v in raw.values())
    assert s.sql("SELECT count(*) AS n FROM spans")["n"][0] == 0
    assert s.sql("SELECT count(*) AS n FROM collectives WHERE started_ns IS NOT NULL")["n"][0] == 0
    run = s.sql("SELECT time_base, approximations FROM runs").row(0, named=True)
    assert run["time_base"] == "none"
    assert any("NCCL_INSPECTOR_DUMP_VERBOSE=0" in a and "no cross-rank waits" in a
               for a in json.loads(run["approximations"]))
    res = invoke(runner, cli, "waits", st)
    assert res.exit_code == 0 and "nothing to align" in res.output


HEAD = {"id": "0xabc", "comm_name": "c", "rank": 0, "n_ranks": 2, "nnodes": 1}
META = {"inspector_output_format_version": "v4.0", "dump_timestamp_us": 1, "hostname": "h", "pid": 1}
COLL = {"coll": "AllReduce", "coll_sn": 0, "coll_msg_size_bytes": 8192, "coll_exec_time_us": 10,
        "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": 1.0, "coll_busbw_gbs": 1.0}


def _line(**over):
    rec = {"header": dict(HEAD), "metadata": dict(META), "coll_perf": dict(COLL)}
    for k, v in over.items():
        part, _, field = k.partition("__")
        if v is None:
            rec[part].pop(field)
        else:
            rec[part][field] = v
    return json.dumps(rec)


GOOD = _line()
BAD = [
    ("bad json", GOOD + "\n" + _line(coll_perf__coll_sn=1) + "\n{\"header\": {\"id\"\n", "line 3", "invalid JSON"),
    ("missing key", GOOD + "\n" + _line(header__rank=None).replace('"coll_sn": 0', '"coll_sn": 1'), "line 2", "rank"),
    ("wrong type", _line(coll_perf__coll_sn="seven"), "line 1", "coll_sn"),
    ("huge integer", _line(coll_perf__coll_sn=2**70), "line 1", "coll_sn"),
    ("negative time", _line(coll_perf__coll_exec_time_us=-5), "line 1", "coll_exec_time_us"),
    ("rank beyond size", _line(header__rank=2), "line 1", "n_ranks"),
    ("duplicate record", GOOD + "\n" + GOOD, "line 2", "twice"),
    ("not an object", GOOD + "\n[1, 2]", "line 2", "NCCL Inspector record"),
    ("both perf kinds", _line().replace('"coll_perf"', '"p2p_perf": {"p2p": "Send", "p2p_sn": 0, '
                                                       '"p2p_msg_size_bytes": 1, "p2p_exec_time_us": 1}, "coll_perf"'),
     "line 1", "both coll_perf and p2p_perf"),
]


@module_fixture
def seeded(tmp_path_factory):
    from click.testing import CliRunner

    from moetrace.cli import cli

    base = tmp_path_factory.mktemp("seeded")
    seed = base / "seed"
    seed.mkdir()
    shutil.copy(SAMPLE / "node0-pid1000.log", seed / "host-pid1.log")
    res = CliRunner().invoke(cli, ["ingest", str(seed), "--store", str(base / "st")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return base / "st"


@pytest.mark.parametrize("name,text,position,words", BAD, ids=[b[0] for b in BAD])
def test_bad_records_are_refused_and_the_store_is_unchanged(tmp_path, runner, cli, seeded, name, text, position,
                                                           words):
    st = seeded   # (one store for every case: a refused ingest leaves it as it was)
    before = tree_hash(st)
    f = tmp_path / "host-pid9.log"
    f.write_text(text + "\n")
    res = invoke(runner, cli, "ingest", f, "--store", st, "--format", "nccl_inspector")
    _one_line_error(res, str(f), position, words)
    assert tree_hash(st) == before


def test_detected_without_format_and_told_apart_from_server_logs(tmp_path):
    from moetrace.collect import detect

    assert detect(SAMPLE / "node0-pid1000.log").name == "nccl_inspector"
    other = tmp_path / "server.log"
    other.write_text('INFO 12-01 10:00:00 {"header": 1}\n')
    try:
        assert detect(other).name != "nccl_inspector"
    except InputError:
        pass                     # not recognized at all: fine too

"""PyTorch Flight Recorder dumps: read without running pickle code, stored in collectives /
comm_groups, and the hang post-mortem. Expected numbers come from the dump dictionaries
the generator pickles (sample_traces/make_comm_samples.py), or from dumps crafted here,
worked out by hand; no test unpickles a file."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle

import pytest

from moetrace.errors import InputError
from moetrace.run import Store
from moetrace.safety_pickle import load_plain

from .helpers import REPO, invoke, module_fixture, tree_hash
from .helpers import one_line_error as _one_line_error

SAMPLE = REPO / "sample_traces" / "flight_recorder"


def _gen():
    spec = importlib.util.spec_from_file_location("mcs", REPO / "sample_traces" / "make_comm_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@module_fixture
def dumps():
    return _gen().flight_recorder_dumps()




@module_fixture
def store(tmp_path_factory):
    from click.testing import CliRunner

    from moetrace.cli import cli

    st = tmp_path_factory.mktemp("fr") / "st"
    res = CliRunner().invoke(cli, ["ingest", str(SAMPLE), "--store", str(st)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return Store(st)


def test_sample_files_are_the_generator_dicts_pickled(dumps):
    for r, d in dumps.items():
        assert (SAMPLE / f"nccl_trace_rank_{r}").read_bytes() == pickle.dumps(d, protocol=2)
    assert sum(p.stat().st_size for p in SAMPLE.iterdir()) < 50_000


def test_entries_and_groups_equal_the_dumps(store, dumps):
    got = store.sql("SELECT rank, count(*) AS n, count(*) FILTER (WHERE state = 'completed') AS c, "
                    "count(*) FILTER (WHERE is_p2p) AS p, sum(created_ns) AS t FROM collectives "
                    "GROUP BY rank ORDER BY rank")
    want = {r: (len(d["entries"]), sum(e["state"] == "completed" for e in d["entries"]),
                sum(e["is_p2p"] for e in d["entries"]), sum(e["time_created_ns"] for e in d["entries"]))
            for r, d in dumps.items()}
    assert {r: (n, c, p, t) for r, n, c, p, t in got.iter_rows()} == want
    g = store.sql("SELECT rank, grp, members, last_enqueued_seq, last_completed_seq FROM comm_groups ORDER BY rank, grp")
    want_g = []
    for r, d in dumps.items():
        ids = {str(e["pg_id"]): e["process_group"][0] for e in d["entries"]}
        for name, cfg in sorted(d["pg_config"].items()):
            st = next(v for k, v in d["pg_status"].items() if ids[k] == name)
            want_g.append((r, name, json.dumps(json.loads(cfg["ranks"])), st["last_enqueued_collective"],
                           st["last_completed_collective"]))
    assert list(g.iter_rows()) == want_g


def test_hang_names_the_rank_that_never_arrived(store, dumps, runner, cli):
    # by hand from the dicts: in group "0" the lowest seq some rank left incomplete, and who got there
    ent = {r: [e for e in d["entries"] if e["process_group"][0] == "0"] for r, d in dumps.items()}
    stuck = min(e["collective_seq_id"] for es in ent.values() for e in es if e["state"] != "completed")
    never = [r for r, es in ent.items() if max(e["collective_seq_id"] for e in es) < stuck]
    assert (stuck, never) == (8, [2])
    res = store.run().hang()
    row = res.groups.filter(res.groups["grp"] == "0").row(0, named=True)
    assert row["stuck_seq"] == 8 and row["never_reached"] == [2] and row["waiting"] == [0, 1, 3]
    assert row["op"] == "nccl:all_reduce"
    out = invoke(runner, cli, "hang", store.path)
    assert out.exit_code == 0, out.output
    assert "ranks 0, 1, 3 wait in nccl:all_reduce #8" in out.output
    assert "rank 2 never reached it (rank 2 got to #7, completed)" in out.output
    mism = {(g, s, w) for g, s, w, _ in res.mismatches.iter_rows()}
    assert mism == {("1", 2, "input sizes"), ("2", 2, "ops")}
    prog = {(g, r): (c, s) for g, r, c, s in res.progress.select("grp", "rank", "last_completed", "last_started")
            .iter_rows()}
    assert prog["0", 2] == (7, 7) and prog["0", 3] == (7, 7) and prog["0", 0] == (7, 8)


def test_a_missing_dump_is_said_apart_from_a_rank_that_never_arrived(tmp_path, runner, cli):
    import shutil

    d = tmp_path / "three"
    d.mkdir()
    for r in (0, 1, 3):
        shutil.copy(SAMPLE / f"nccl_trace_rank_{r}", d)
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", d, "--store", st).exit_code == 0
    row = Store(st).run().hang().groups.filter(pl_col("grp") == "0").row(0, named=True)
    # rank 2 left no dump: nothing says whether it reached #8; the three others wait in it
    assert (row["stuck_seq"], row["waiting"], row["never_reached"], row["no_dump"]) == (8, [0, 1, 3], [], [2])


def pl_col(name):
    import polars as pl

    return pl.col(name)


def _dump(entries, groups, status=None):
    return {"version": "2.4", "pg_config": {g: {"name": g, "desc": d, "ranks": json.dumps(m)}
                                            for g, (d, m) in groups.items()},
            "pg_status": status or {}, "entries": entries}


def _e(rid, g, seq, name="nccl:all_reduce", state="completed", sizes=((8,),), pg_id=0):
    return {"record_id": rid, "pg_id": pg_id, "process_group": (g, "world"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": rid, "profiling_name": name, "time_created_ns": 10**18 + rid,
            "input_sizes": [list(s) for s in sizes], "output_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "is_p2p": False}


def test_crafted_four_rank_hang_without_pg_status(tmp_path, runner, cli):
    """Ranks 0, 2, 3 completed #1..#4 and started #5; rank 1 completed #1..#3 only."""
    d = tmp_path / "dumps"
    d.mkdir()
    groups = {"pgA": ("world", [0, 1, 2, 3])}
    for r in range(4):
        last = 3 if r == 1 else 5
        ents = [_e(s, "pgA", s, state="completed" if s < 5 else "started") for s in range(1, last + 1)]
        (d / f"trace_{r}.pkl").write_bytes(pickle.dumps(_dump(ents, groups), protocol=2))
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", d, "--store", st).exit_code == 0
    res = Store(st).run().hang()
    row = res.groups.row(0, named=True)
    # the lowest seq left incomplete is #5 (ranks 0, 2, 3); rank 1 never reached it: it got to #3
    assert (row["stuck_seq"], row["waiting"], row["never_reached"]) == (5, [0, 2, 3], [1])
    assert any("rank 1 never reached it (rank 1 got to #3, completed)" in ln for ln in res.lines)


def test_json_variant_reads_the_same(tmp_path, runner, cli, dumps):
    d = tmp_path / "json"
    d.mkdir()
    for r, dump in dumps.items():
        j = json.loads(json.dumps(dump))      # tuples become lists, as dump_json writes them
        for e in j["entries"]:
            for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                e[k] = e[k] or 0
            e.pop("frames", None)
        j["pg_status"] = {k: {kk: str(vv) for kk, vv in v.items()} for k, v in j["pg_status"].items()}
        (d / f"nccl_trace_rank_{r}.json").write_text(json.dumps(j))
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", d, "--store", st)
    assert res.exit_code == 0, res.output
    s = Store(st)
    assert s.sql("SELECT count(*) AS n FROM collectives")["n"][0] == sum(len(x["entries"]) for x in dumps.values())
    assert s.sql("SELECT count(*) AS n FROM collectives WHERE state = 'scheduled' AND started_ns IS NULL")["n"][0] == 1
    h = s.run().hang()
    assert h.never_reached("0") == [2]


# ----------------------------------------------------------------------------- hostile pickles
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _seeded(tmp_path, runner, cli):
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", SAMPLE / "nccl_trace_rank_0", "--store", st).exit_code == 0
    return st, tree_hash(st)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path, runner, cli, protocol):
    marker = tmp_path / "pwned"
    evil = tmp_path / "nccl_trace_rank_1"
    evil.write_bytes(pickle.dumps({"version": "2.4", "pg_config": {}, "entries": [_RunsCode(marker)]},
                                  protocol=protocol))
    st, before = _seeded(tmp_path, runner, cli)
    res = invoke(runner, cli, "ingest", evil, "--store", st)       # detected as a dump, then refused
    msg = _one_line_error(res, str(evil), "refused", "import a name")
    assert "system" in msg and "byte " in msg
    assert not marker.exists()
    assert tree_hash(st) == before


def test_global_builtins_eval_is_refused(tmp_path, runner, cli):
    marker = tmp_path / "pwned2"
    evil = tmp_path / "dump"
    # protocol 0: GLOBAL builtins.eval, a string, TUPLE, REDUCE
    evil.write_bytes(b"cbuiltins\neval\n(Vopen(%r, 'w')\ntR." % str(marker).encode())
    st, before = _seeded(tmp_path, runner, cli)
    res = invoke(runner, cli, "ingest", evil, "--store", st, "--format", "flight_recorder")
    _one_line_error(res, str(evil), "GLOBAL builtins.eval", "byte 0")
    assert not marker.exists() and tree_hash(st) == before
    with pytest.raises(InputError, match="refused"):
        load_plain(evil)
    assert not marker.exists()


def test_find_class_refuses_even_when_the_scan_is_bypassed(tmp_path):
    import io

    from moetrace.safety_pickle import PlainUnpickler

    data = pickle.dumps(_RunsCode(tmp_path / "m"), protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refused to import"):
        PlainUnpickler(io.BytesIO(data)).load()
    assert not (tmp_path / "m").exists()


def _nested(depth):
    x = []
    for _ in range(depth):
        x = [x]
    return x


def test_pickle_bounds(tmp_path, runner, cli, monkeypatch):
    from moetrace.safety import set_overrides

    monkeypatch.setenv("MOETRACE_MAX_PICKLE_OBJECTS", "100000")
    f = tmp_path / "deep"
    f.write_bytes(pickle.dumps({"pg_config": {}, "entries": _nested(100)}, protocol=2))
    with pytest.raises(InputError, match="nested more than"):
        load_plain(f)
    # a memo bomb: 40 levels of [x, x] is 2^40 objects reached from a file of a few hundred bytes
    x = []
    for _ in range(40):
        x = [x, x]
    g = tmp_path / "bomb"
    g.write_bytes(pickle.dumps({"entries": x}, protocol=2))
    assert g.stat().st_size < 2000
    with pytest.raises(InputError, match="max_pickle_objects=100000"):
        load_plain(g)
    loop = []
    loop.append(loop)
    h = tmp_path / "loop"
    h.write_bytes(pickle.dumps(loop, protocol=2))
    with pytest.raises(InputError, match="contains itself"):
        load_plain(h)
    big = tmp_path / "nccl_trace_rank_0"
    big.write_bytes((SAMPLE / "nccl_trace_rank_0").read_bytes())
    res = invoke(runner, cli, "ingest", big, "--store", tmp_path / "st", "--set", "max_pickle_bytes=100")
    _one_line_error(res, "max_pickle_bytes=100")
    assert not (tmp_path / "st").exists()
    set_overrides({})   # (the --set above stays installed in this process until the next ingest)
    assert load_plain(SAMPLE / "nccl_trace_rank_3")["version"] == "2.4"


def _bad_dumps(dumps):
    d0 = dumps[0]

    def with_entry(i, **kw):
        d = pickle.loads(pickle.dumps(d0))   # a deep copy of our own dict (no file is unpickled)
        for k, v in kw.items():
            if v is None:
                d["entries"][i].pop(k)
            else:
                d["entries"][i][k] = v
        return pickle.dumps(d, protocol=2)

    return [
        ("missing key", with_entry(3, state=None), "entry 3", "state"),
        ("wrong type", with_entry(2, collective_seq_id="x"), "entry 2", "collective_seq_id"),
        ("huge integer", with_entry(1, collective_seq_id=2**70), "entry 1", "collective_seq_id"),
        ("unknown state", with_entry(0, state="hung"), "entry 0", "state"),
        ("not a dict", pickle.dumps([1, 2, 3], protocol=2), None, "not a dict"),
        ("truncated", pickle.dumps(d0, protocol=2)[:300], None, "truncated"),
        ("completed before started", with_entry(0, time_discovered_started_ns=10**18 + 5,
                                                time_discovered_completed_ns=10**18), "entry 0", "before"),
    ]


def test_malformed_dumps_are_refused_and_the_store_is_unchanged(tmp_path, runner, cli, dumps):
    st, before = _seeded(tmp_path, runner, cli)
    for name, data, position, words in _bad_dumps(dumps):
        f = tmp_path / f"nccl_trace_rank_{len(name)}"
        f.write_bytes(data)
        res = invoke(runner, cli, "ingest", f, "--store", st, "--format", "flight_recorder")
        _one_line_error(res, str(f), *([position] if position else []), words)
        assert tree_hash(st) == before, name


def test_plain_values_come_through(tmp_path):
    v = {"a": [1, 2.5, None, True, "x", (1, 2)], "b": {"c": -3}, "e": 2**100}
    w = {**v, "f": b"y", "g": frozenset({1}), "h": {3}}   # bytes and sets need protocol 3 / 4 (else a GLOBAL)
    f = tmp_path / "ok"
    for proto, val in ((0, v), (2, v), (4, w), (5, w)):
        f.write_bytes(pickle.dumps(val, protocol=proto))
        assert load_plain(f) == val
    f.write_bytes(pickle.dumps(w, protocol=2))
    with pytest.raises(InputError, match="GLOBAL"):
        load_plain(f)

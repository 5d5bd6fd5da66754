"""The hostile-input audit's families (issue 27), one parametrized case per member.

Every case is generated in tmp_path (nothing large is committed) and must end in: exit
code 2, exactly one line on stderr naming the file, no traceback, the store byte-for-byte
unchanged (tree_hash), nothing written outside it (the whole tmp_path tree and a fake
HOME hashed), and, for the resource family, the child's peak memory under 1 GiB
(measured with os.wait4 on a subprocess). The sandboxed `moetrace sql` family is in
tests/test_sql_sandbox.py.
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetrace.collect import ingest
from moetrace.storage.store import Store

from .conftest import REPO, tree_hash

GIB = 1 << 30


def _seed(root: Path) -> Path:
    src = root / "seed.csv"
    src.write_text("step,layer,expert,tokens\n0,0,0,3\n0,0,1,5\n0,0,2,0\n0,0,3,0\n")
    st = root / "store"
    ingest(Store(st, create=True), [src])
    src.unlink()
    return st


# ----------------------------------------------------------------------------- generators
LAUGHS = "".join(f"{c}: &{c} [" + ",".join([f"*{p}"] * 9 if p else ['"lol"'] * 9) + "]\n"
                 for c, p in zip("abcdefghi", [None, *"abcdefgh"]))


def billion_laughs_plan(d: Path):
    f = d / "lb.yaml"
    f.write_text(LAUGHS + "num_slots: *i\ninitial_global_assignments: {0: *i}\n")
    assert len(f.read_bytes()) < 600
    return ["plan", "{store}", "--import", f, "--ranks", "1"], f


def billion_laughs_trtllm_config(d: Path):
    stats = _stats(d / "stats")
    f = d / "moe_load_balancer.yaml"
    f.write_text(LAUGHS + "num_slots: 4\nlayer_updates_per_iter: 0\ninitial_global_assignments: {1: *i}\n")
    return ["ingest", stats, f, "--store", "{store}"], f


def _stats(folder: Path, ranks=None, meta=None) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps(meta or {"num_experts": 4, "num_experts_per_token": 2}))
    for r, rec in (ranks or {0: {"0_1": np.array([1, 1, 0, 0], np.int64)}}).items():
        save_file(rec, str(folder / f"rank{r}.safetensors"))
    return folder


def trtllm_keys_span_a_huge_grid(d: Path):
    # 20,000 keys (i, i): 20,000 iterations x 20,000 layers = 4e8 (iteration, layer) pairs
    rec = {f"{i}_{i}": np.array([1, 1, 0, 0], np.int32) for i in range(20000)}
    folder = _stats(d / "stats", {0: rec})
    return ["ingest", folder, "--store", "{store}"], folder


def nsys_generated_huge_string(d: Path):
    f = d / "gen.nsys.sqlite"
    db = sqlite3.connect(f)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, n INT, value TEXT GENERATED ALWAYS AS (printf('%.*c', n, 'x')));
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT, mangledName INT);
        INSERT INTO StringIds (id, n) VALUES (1, 1000000000);
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (1, 2, 0, 1, 7, 1, 16777216, 1, 1, 1);""")
    db.commit()
    db.close()
    assert f.stat().st_size < 64 << 10
    return ["ingest", f, "--store", "{store}", "--format", "nsys"], f


def npy_dimension_past_the_shape_bound(d: Path):
    f = d / "expert_load_pass.npy"
    np.save(f, np.ones((1, 20_000_000), np.int8))   # 20 MB: 2e7 physical slots > 2^24
    return ["ingest", f, "--store", "{store}"], f


def npy_header_lies(d: Path):
    f = d / "expert_load_pass.npy"
    np.save(f, np.ones((4, 8), np.int64))
    raw = f.read_bytes()
    lied = raw.replace(b"(4, 8), }" + b" " * 6, b"(4000, 8000), }", 1)   # same header length, 10^6 x the data
    assert len(lied) == len(raw) and lied != raw
    f.write_bytes(lied)
    return ["ingest", f, "--store", "{store}"], f


RESOURCE = [billion_laughs_plan, billion_laughs_trtllm_config, trtllm_keys_span_a_huge_grid,
            nsys_generated_huge_string, npy_dimension_past_the_shape_bound, npy_header_lies]


# integers past int64 / int32 and values stored silently before
def _kineto(d: Path, name="trace.json", **change):
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2},
           "baseTimeNanoseconds": 1_700_000_000_000_000_000,
           "traceEvents": [
               {"ph": "X", "cat": "kernel", "name": "void fused_moe_kernel<float>(float*)", "pid": 0, "tid": 7,
                "ts": 10.0, "dur": 5.0, "args": {"device": 0, "stream": 7, "correlation": 1}},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, "ts": 8.0,
                "dur": 1.0, "args": {"correlation": 1}},
               {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 100, "tid": 100, "ts": 0.0,
                "dur": 50.0}]}
    for k, v in change.items():
        if k == "rank":
            doc["distributedInfo"]["rank"] = v
        elif k == "no_dist":
            doc.pop("distributedInfo")
        elif k == "no_base":
            doc.pop("baseTimeNanoseconds")
        elif k == "no_dur":
            doc["traceEvents"][0].pop("dur")
        elif k == "ts":
            doc["traceEvents"][0]["ts"] = v
        else:
            doc[k] = v
    f = d / name
    f.write_text(json.dumps(doc))
    return ["ingest", f, "--store", "{store}"], f


def kineto_base_2_70(d):
    return _kineto(d, baseTimeNanoseconds=2**70)


def kineto_rank_99999999999(d):
    return _kineto(d, rank=99999999999)


def kineto_negative_rank(d):
    return _kineto(d, rank=-1)


def kineto_rank_in_name_past_bound(d):
    return _kineto(d, name="trace_rank99999999999.json", no_dist=True)


def kineto_x_without_dur(d):
    return _kineto(d, no_dur=True)


def kineto_negative_time(d):
    return _kineto(d, no_base=True, ts=-5.0)


def trtllm_30_digit_iteration(d):
    folder = _stats(d / "stats", {0: {"1" + "0" * 29 + "_1": np.array([1, 1, 0, 0], np.int64)}})
    return ["ingest", folder, "--store", "{store}"], folder / "rank0.safetensors"


def prometheus_timestamp_past_int64(d):
    f = d / "metrics.prom"
    f.write_text("vllm:eplb_balancedness_avg 0.5 99999999999999999999\n")
    return ["ingest", f, "--store", "{store}"], f


def plan_30_digit_id(d):
    f = d / "plan.json"
    f.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 10**30]]}))
    return ["plan", "{store}", "--import", f, "--ranks", "1"], f


def plan_negative_logical_count(d):
    f = d / "plan.json"
    f.write_text(json.dumps({"logical_count": [[3, -5, 0, 0]]}))
    return ["plan", "{store}", "--import", f, "--ranks", "1"], f


def plan_eplb_contradicts_itself(d):
    f = d / "plan.json"
    f.write_text(json.dumps({"phy2log": [[0, 1, 2, 3]], "logcnt": [[1, 2, 1, 0]], "num_experts": 4,
                             "num_ranks": 1, "ranks_per_node": 1}))
    return ["plan", "{store}", "--import", f, "--ranks", "1"], f


def sglang_map_contradicts_itself(d):
    f = d / "plan.json"
    f.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3]],
                             "logical_to_physical_map": [[[1], [0], [2], [3]]]}))
    return ["plan", "{store}", "--import", f, "--ranks", "1"], f


def sglang_zero_dimension(d):
    f = d / "expert_distribution_recorder_1.json"
    f.write_text(json.dumps({"logical_count": [[[]]]}))
    return ["ingest", f, "--store", "{store}", "--format", "sglang"], f


def nsys_timestamp_overflows_int64(d):
    from .test_nsys import make_export

    f = make_export(d / "wrap.nsys.sqlite")
    db = sqlite3.connect(f)
    db.execute("UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = 9223372036854775000")
    db.commit()
    db.close()
    return ["ingest", f, "--store", "{store}", "--format", "nsys"], f


VALUES = [kineto_base_2_70, kineto_rank_99999999999, kineto_negative_rank, kineto_rank_in_name_past_bound,
          kineto_x_without_dur, kineto_negative_time, trtllm_30_digit_iteration, prometheus_timestamp_past_int64,
          plan_30_digit_id, plan_negative_logical_count, plan_eplb_contradicts_itself, sglang_map_contradicts_itself,
          sglang_zero_dimension, nsys_timestamp_overflows_int64]


# stores that cannot be read: the command reads the store, the store is the "file"
def _runs_file(st: Path) -> Path:
    return next((st / "runs").glob("run_id=*/*.parquet"))


def _load_file(st: Path) -> Path:
    return next((st / "expert_load").glob("run_id=*/*.parquet"))


def store_truncated_parquet(st: Path):
    f = _runs_file(st)
    f.write_bytes(f.read_bytes()[:-40])
    return f


def store_garbage_parquet(st: Path):
    f = _load_file(st)
    f.write_bytes(os.urandom(2000))
    return f


def store_wrong_schema(st: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = _load_file(st)
    pq.write_table(pa.table({"step": ["zero"], "layer": [0], "expert": [0], "tokens": [1.5]}), f)
    return f


def store_file_holds_its_own_run_id(st: Path):
    import pyarrow.parquet as pq

    f = _load_file(st)
    t = pq.read_table(f)
    pq.write_table(t.append_column("run_id", __import__("pyarrow").array(["other"] * t.num_rows)), f)
    return f


def store_partition_folder_misnamed(st: Path):
    d = _load_file(st).parent
    bad = d.parent / "run=seed"
    d.rename(bad)
    return bad


def store_file_where_folder_expected(st: Path):
    d = st / "steps"
    d.write_text("not a folder")
    return d


STORE = [store_truncated_parquet, store_garbage_parquet, store_wrong_schema, store_file_holds_its_own_run_id,
         store_partition_folder_misnamed, store_file_where_folder_expected]
READERS = [["runs", "{store}"], ["sql", "{store}", "SELECT count(*) FROM expert_load"], ["skew", "{store}"]]


# ----------------------------------------------------------------------------- the checks
def _fill(args, store):
    return [str(store) if a == "{store}" else str(a) for a in args]


def _refused_in_process(runner, cli, root: Path, args, file, monkeypatch):
    home = root / "home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    work = root / "work"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    before = tree_hash(root)
    r = runner.invoke(cli, _fill(args, root / "store"))
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrace: error: "), r.stderr
    assert "Traceback" not in r.output
    assert str(file) in lines[0], (str(file), lines[0])
    assert tree_hash(root) == before, "the store or a file outside it changed"
    return lines[0]


@pytest.mark.parametrize("make", VALUES + RESOURCE, ids=lambda f: f.__name__)
def test_refused_with_one_line(make, runner, cli, tmp_path, monkeypatch):
    _seed(tmp_path)
    (tmp_path / "in").mkdir()
    args, file = make(tmp_path / "in")
    _refused_in_process(runner, cli, tmp_path, args, file, monkeypatch)


@pytest.mark.parametrize("reader", READERS, ids=lambda a: a[0])
@pytest.mark.parametrize("damage", STORE, ids=lambda f: f.__name__)
def test_unreadable_store_file_is_one_line_naming_it(damage, reader, runner, cli, tmp_path, monkeypatch):
    st = _seed(tmp_path)
    bad = damage(st)
    _refused_in_process(runner, cli, tmp_path, reader, bad, monkeypatch)


@pytest.mark.parametrize("damage", STORE, ids=lambda f: f.__name__)
def test_check_lists_every_bad_file_and_changes_nothing(damage, runner, cli, tmp_path):
    st = _seed(tmp_path)
    bad = damage(st)
    before = tree_hash(tmp_path)
    r = runner.invoke(cli, ["check", str(st)])
    assert r.exit_code == 2, r.output
    listed = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert listed and all(ln.startswith(str(st)) for ln in listed), r.stdout
    assert any(ln.startswith(f"{bad}: ") for ln in listed), (bad, listed)
    assert tree_hash(tmp_path) == before


def test_check_passes_a_good_store_and_lists_two_bad_files(runner, cli, tmp_path):
    st = _seed(tmp_path)
    r = runner.invoke(cli, ["check", str(st)])
    assert r.exit_code == 0 and r.stdout == "", r.output
    a, b = store_truncated_parquet(st), store_garbage_parquet(st)
    r = runner.invoke(cli, ["check", str(st)])
    assert r.exit_code == 2
    assert sorted(ln.split(": ", 1)[0] for ln in r.stdout.splitlines()) == sorted([str(a), str(b)])


def test_backslash_in_a_store_path_is_refused(runner, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub" / "st" / "x").mkdir(parents=True)
    before = tree_hash(tmp_path)
    for args in (["runs", "sub/st\\x"], ["sql", "sub/st\\x", "SELECT 1"], ["check", "sub/st\\x"]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 2 and "backslash" in r.stderr and r.stderr.count("\n") == 1, r.output
    assert tree_hash(tmp_path) == before


# ----------------------------------------------------------------------------- bounded memory
_WRAP = """
import sys
from moetrace.cli import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))
sys.stdout.write(hwm.split()[1] + '\\n')
sys.exit(code)
"""


def _peak_rss_child(args, cwd: Path, env: dict) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in bytes) of the CLI in a fresh process: VmHWM of its own
    memory map (ru_maxrss would start from the forking pytest process's size)."""
    p = subprocess.run([sys.executable, "-c", _WRAP, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stderr, int(p.stdout.split()[-1]) * 1024


@pytest.mark.parametrize("make", [m if m is billion_laughs_plan else pytest.param(m, marks=pytest.mark.slow)
                                  for m in RESOURCE], ids=lambda f: f.__name__)
def test_tiny_files_stay_under_a_gib(make, tmp_path):
    st = _seed(tmp_path)
    (tmp_path / "in").mkdir()
    args, file = make(tmp_path / "in")
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "in"))
    before = tree_hash(st)
    rc, err, peak = _peak_rss_child(_fill(args, st), tmp_path, env)
    assert rc == 2 and err.count("\n") == 1 and str(file) in err, err
    assert peak < GIB, f"peak RSS {peak / 2**20:.0f} MiB"
    assert tree_hash(st) == before

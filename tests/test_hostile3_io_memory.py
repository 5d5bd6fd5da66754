"""Small inputs that would take gigabytes are refused by what is read before anything is
allocated (the limits of moetrace/safety.py, docs/hardening.md).

Generated cases, each ingested into a new store by the CLI in a child process: one line
naming the file and the limit, exit 2, peak RSS under 1 GiB, no hang, no store created.
Cases that would need a large file to hit a default limit lower the limit through its
environment variable, so the mechanism (not a default's value) is what they test; the
sparse 20 GiB files hit the defaults."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .helpers import module_fixture, tree_hash
from .helpers.bounded_cli import GiB, run_cases, synth_store

LOAD_HEADER = "step,layer,expert,tokens"


def _csv_wide(p: Path, n: int, quoted: bool = False) -> None:
    cols = ",".join((f'"c,{i}"' if quoted else f"c{i}") for i in range(n))
    p.write_text(f"{LOAD_HEADER},{cols}\n0,0,0,1{',0' * n}\n")


def _sparse(p: Path, size: int = 20 * GiB) -> None:
    with open(p, "wb") as f:
        f.truncate(size)


def _jsonl_keys(p: Path, n: int) -> None:
    row = {"step": 0, "layer": 0, "expert": 0, "tokens": 1, **{f"k{i}": 0 for i in range(n)}}
    p.write_text(json.dumps(row) + "\n")


def _jsonl_distinct(p: Path, lines: int, per_line: int) -> None:
    with open(p, "w") as f:
        for j in range(lines):
            f.write(json.dumps({"step": 0, "layer": 0, "expert": 0, "tokens": 1,
                                **{f"k{j}_{i}": 0 for i in range(per_line)}}) + "\n")


def _jsonl_long_line(p: Path, nbytes: int) -> None:
    with open(p, "w") as f:
        f.write('{"step": 0, "layer": 0, "expert": 0, "tokens": 1, "pad": "')
        f.write("x" * nbytes)
        f.write('"}\n')


def _parquet(p: Path, **kw) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = kw.get("rows", 4)
    cols = {"step": pa.array([0] * n, pa.int64()), "layer": pa.array([0] * n, pa.int64()),
            "expert": pa.array([0] * n, pa.int64()), "tokens": pa.array([1] * n, pa.int64())}
    for i in range(kw.get("extra_cols", 0)):
        cols[f"c{i}"] = pa.array([0] * n, pa.int8())
    t = pa.table(cols)
    if kw.get("kv_bytes"):
        t = t.replace_schema_metadata({"junk": "x" * kw["kv_bytes"]})
    pq.write_table(t, p, row_group_size=n)


# name -> (file name, builder, environment, words the refusal names)
CASES = {
    "csv_wide_20k": ("load.csv", lambda p: _csv_wide(p, 20_000), {}, ["max_columns"]),
    "csv_wide_200k": ("load.csv", lambda p: _csv_wide(p, 200_000), {}, ["max_columns"]),
    "csv_wide_quoted": ("load.csv", lambda p: _csv_wide(p, 20_000, quoted=True), {}, ["max_columns"]),
    "csv_sparse_20g": ("load.csv", _sparse, {}, ["max_record_bytes"]),
    "csv_long_header": ("load.csv", lambda p: p.write_text(LOAD_HEADER + ",x" * 600_000 + "\n"),
                        {"MOETRACE_MAX_RECORD_BYTES": "1000000"}, ["max_record_bytes"]),
    "jsonl_sparse_20g": ("load.jsonl", _sparse, {}, ["max_record_bytes"]),
    "jsonl_keys_100k": ("load.jsonl", lambda p: _jsonl_keys(p, 100_000), {}, ["max_columns"]),
    "jsonl_distinct_keys": ("load.jsonl", lambda p: _jsonl_distinct(p, 400, 50), {}, ["max_columns"]),
    "jsonl_long_line": ("load.jsonl", lambda p: _jsonl_long_line(p, 3_000_000),
                        {"MOETRACE_MAX_RECORD_BYTES": "2000000"}, ["max_record_bytes", "line 1"]),
    "parquet_columns": ("load.parquet", lambda p: _parquet(p, extra_cols=17_000), {}, ["max_columns"]),
    "parquet_footer": ("load.parquet", lambda p: _parquet(p, kv_bytes=3 << 20),
                       {"MOETRACE_MAX_PARQUET_METADATA_BYTES": str(1 << 20)}, ["max_parquet_metadata_bytes"]),
    "parquet_decoded": ("load.parquet", lambda p: _parquet(p, rows=2_000_000),
                        {"MOETRACE_MAX_DECODED_BYTES": str(8 << 20), "MOETRACE_MAX_INFLATE_RATIO": "2"},
                        ["max_decoded_bytes", "row group 0"]),
    "log_lines": ("server.log", lambda p: p.write_text("".join(
        "[2025-06-01 12:00:00 DP0 TP0 EP0] [EPLBManager] rebalance start\n" for _ in range(3000))),
        {"MOETRACE_MAX_TEXT_RECORDS": "1000"}, ["max_text_records", "line 1001"]),
    "prometheus_series": ("m.prom", lambda p: p.write_text("".join(
        f'vllm:eplb_balancedness_avg{{engine="{i}"}} 0.5\n' for i in range(3000))),
        {"MOETRACE_MAX_TEXT_RECORDS": "1000"}, ["max_text_records"]),
    "parquet_truncated_footer": ("load.parquet", lambda p: p.write_bytes(b"PAR1" + b"\0" * 8 + b"\xff\xff\xff\x7fPAR1"),
                                 {}, ["max_parquet_metadata_bytes"]),
}


def test_memory_bombs_are_refused_before_allocating(tmp_path):
    cases, want = [], []
    for name, (fname, build, env, words) in CASES.items():
        d = tmp_path / name
        d.mkdir()
        build(d / fname)
        fmt = {"server.log": ["--format", "logs"], "m.prom": ["--format", "prometheus"],
               }.get(fname, [])
        cases.append({"args": ["ingest", d / "st", d / fname, *fmt], "cwd": d, "env": env})
        want.append((name, d, fname, words))
    for (name, d, fname, words), res in zip(want, run_cases(cases, tmp_path / "run", timeout=60)):
        res.refused(fname, *words)
        assert sorted(os.listdir(d)) == [fname], (name, os.listdir(d))   # no store, nothing beside


def test_raised_limit_reads_the_file(tmp_path):
    """The override works: the same wide CSV is read once max_columns is raised."""
    p = tmp_path / "load.csv"
    _csv_wide(p, 20_000)
    res, = run_cases([{"args": ["ingest", tmp_path / "st", p, "--set", "max_columns=30000"], "cwd": tmp_path}],
                     tmp_path / "run")
    assert res.rc == 0, res.stderr
    assert res.maxrss < GiB


def _pt_shared(p: Path, depth: int, width: int) -> None:
    import torch

    inner: list = [1] * width
    for _ in range(depth - 1):
        inner = [inner] * width     # one list referenced width times: the pickle stays small
    torch.save({"logical_count": inner}, p)


@pytest.mark.parametrize("depth,width", [(3, 1000), (4, 200), (6, 40)])
def test_pt_of_shared_nested_lists(tmp_path, depth, width):
    pytest.importorskip("torch")
    p = tmp_path / "expert_distribution_recorder_0.pt"
    _pt_shared(p, depth, width)
    assert p.stat().st_size < 64 << 10
    res, = run_cases([{"args": ["ingest", tmp_path / "st", p, "--format", "sglang"], "cwd": tmp_path}],
                     tmp_path / "run")
    res.refused(p.name, "max_pickle_objects")
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("query,limit", [
    ("SELECT length(repeat('x', 2000000000))", None),     # under the default 1 GiB
    ("SELECT length(repeat('x', 2000000000))", "512MiB"),
    ("SELECT length(string_agg(repeat('y', 100000000), '')) FROM range(20)", "512MiB"),
    ("SELECT md5(repeat('z', 1500000000))", "512MiB"),
])
def test_sql_heap_is_bounded_by_the_memory_limit(sqlstore, tmp_path, query, limit):
    """DuckDB's memory_limit does not cover strings it builds; the heap cap (1.5 x the
    limit) does: a query past it is one line, exit 2, under 1 GiB with a 512 MiB limit."""
    before = tree_hash(sqlstore / "st")
    args = ["sql", "st", query] + (["--memory-limit", limit] if limit else [])
    res, = run_cases([{"args": args, "cwd": sqlstore}], tmp_path / "run", timeout=120)
    res.refused("memory")
    assert tree_hash(sqlstore / "st") == before


@pytest.mark.parametrize("size", ["99999999999999999999TB", "1" * 5000 + "GB", "101%", "0", "-1GB", "1e9GB"])
def test_memory_limit_out_of_range(sqlstore, tmp_path, size):
    res, = run_cases([{"args": ["sql", "st", "SELECT 1", "--memory-limit", size], "cwd": sqlstore}],
                     tmp_path / "run")
    line = res.refused("--memory-limit")
    assert len(line) < 300


@module_fixture
def sqlstore(tmp_path_factory):
    return synth_store(tmp_path_factory.mktemp("sqlst"))


@pytest.mark.parametrize("keys", [300_000, 1_000_000])
def test_yaml_of_many_keys(sqlstore, tmp_path, keys):
    """A TensorRT-LLM EPLB YAML of 300k keys took 1.23 GB and 56 s: refused by its size."""
    p = tmp_path / "lb.yaml"
    p.write_text("num_slots: 10\n" + "".join(f"k{i}: 1\n" for i in range(keys)))
    before = tree_hash(sqlstore / "st")
    res, = run_cases([{"args": ["plan", "st", "--import", p], "cwd": sqlstore}], tmp_path / "run")
    res.refused("lb.yaml", "max_yaml_bytes")
    assert tree_hash(sqlstore / "st") == before

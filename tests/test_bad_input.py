"""Bad input, fed to every collector through ``moetrace ingest``.

For each malformed input: exit code 2, a one-line error that names the file (and the
position where the format has one), and the store byte-for-byte as it was (``tree_hash``
covers every path and byte, hidden journal/staging/lock files included). Corruptions the
format cannot detect (a CSV cut exactly at a row boundary is still a valid CSV) must
either ingest cleanly or fail that way: never a traceback, never a half-written store.

Every collector of the package is fed bad input here; each test names the collector it
needs and fails (never skips) when that collector is missing.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrace.collect import Collector, RunData, register, registry
from moetrace.run import Store

from .helpers import REPO, tree_hash
from .helpers.seed_store import _load_csv_text, _seed_store

HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def store(tmp_path):
    return _seed_store(tmp_path / "store")


def _ingest(runner, cli, *args):
    return runner.invoke(cli, ["ingest", *map(str, args)], catch_exceptions=True)


def assert_refused(res, store_path: Path, before: str, file: Path | str | None, position: str | None = None):
    """Exit 2, a clean message naming the file (and position), store unchanged."""
    msg = res.output  # click >= 8.2: stdout and stderr together
    assert res.exit_code == 2, f"exit {res.exit_code}, output: {msg!r}, exception: {res.exception!r}"
    assert "Traceback" not in msg
    assert "moetrace: error:" in msg
    if file is not None:
        assert str(file) in msg, f"{file} not named in {msg!r}"
    if position is not None:
        assert position in msg, f"{position!r} not in {msg!r}"
    assert tree_hash(store_path) == before, "store changed after refused input"
    return msg


# ----------------------------------------------------------------------------- generic CSV / JSONL / Parquet
CASES = [
    # (name, file name, bytes, position expected in the message or None, words expected)
    ("empty csv", "load.csv", b"", None, "empty"),
    ("empty jsonl", "load.jsonl", b"", None, "empty"),
    ("header only", "load.csv", b"step,layer,expert,tokens\n", None, "no rows"),
    ("blank jsonl lines only", "load.jsonl", b"\n\n  \n", None, "no rows"),
    ("invalid json line", "load.jsonl",
     b'{"step":0,"layer":0,"expert":0,"tokens":3}\n{"step":0,"layer":0,"expert":1,"tok\n', "line 2", "invalid JSON"),
    ("json array per line", "load.jsonl", b'[0,0,0,3]\n', "line 1", "JSON object"),
    ("json string count", "load.jsonl", b'{"step":0,"layer":0,"expert":0,"tokens":"many"}\n', None, "tokens"),
    ("json list count", "load.jsonl", b'{"step":0,"layer":0,"expert":0,"tokens":[3]}\n', None, "tokens"),
    ("json null count", "load.jsonl", b'{"step":0,"layer":0,"expert":0,"tokens":null}\n', "row 1", "empty"),
    ("json boolean count", "load.jsonl",
     b'{"step":0,"layer":0,"expert":0,"tokens":5}\n{"step":0,"layer":0,"expert":1,"tokens":true}\n', "line 2", "integer"),
    ("json mixed types", "load.jsonl",
     b'{"step":0,"layer":0,"expert":0,"tokens":3}\n{"step":"x","layer":0,"expert":1,"tokens":4}\n', None, "step"),
    ("NaN count csv", "load.csv", b"step,layer,expert,tokens\n0,0,0,3\n0,0,1,NaN\n", "row 2", "non-integer"),
    ("NaN count json", "load.jsonl",
     b'{"step":0,"layer":0,"expert":0,"tokens":3}\n{"step":0,"layer":0,"expert":1,"tokens":NaN}\n', "row 2", "non-integer"),
    ("fractional count", "load.csv", b"step,layer,expert,tokens\n0,0,0,2.5\n", "row 1", "non-integer"),
    ("negative count", "load.csv", b"step,layer,expert,tokens\n0,0,0,3\n0,0,1,-4\n", "row 2", "negative"),
    ("negative expert", "load.csv", b"step,layer,expert,tokens\n0,0,-1,3\n", "row 1", "negative"),
    ("negative layer", "load.csv", b"step,layer,expert,tokens\n0,-2,0,3\n", "row 1", "negative"),
    ("negative step", "load.csv", b"step,layer,expert,tokens\n-5,0,0,3\n", "row 1", "negative"),
    ("step beyond int64", "load.csv", b"step,layer,expert,tokens\n99999999999999999999999,0,0,3\n", None, "step"),
    ("layer beyond int32", "load.csv", b"step,layer,expert,tokens\n0,4294967296,0,3\n", None, "layer"),
    ("duplicate row", "load.csv", b"step,layer,expert,tokens\n0,0,0,3\n0,0,1,1\n0,0,0,3\n", None, "duplicate"),
    ("missing column", "load.csv", b"step,layer,expert,tokenz\n0,0,0,3\n", None, None),
    ("missing value", "load.csv", b"step,layer,expert,tokens\n0,0,0,3\n0,,1,4\n", "row 2", "empty"),
    ("parquet magic, garbage body", "load.parquet", b"PAR1" + b"\x00garbage" * 10, None, "cannot parse"),
    ("parquet without magic", "load.parquet", b"step,layer,expert,tokens\n0,0,0,1\n", None, "unknown file type"),
    ("binary junk", "load.csv", bytes(range(256)) * 4, None, None),
    ("not utf-8 jsonl", "load.jsonl", b'{"step":0,"layer":0,"expert":0,"tokens":3}\n\xff\xfe\xfa\n', None, None),
    ("routing negative expert", "route.csv", b"step,layer,token,expert\n0,0,0,1\n0,0,0,-3\n", None, "negative"),
]


@pytest.mark.parametrize("name,fname,data,position,words", CASES, ids=[c[0] for c in CASES])
def test_generic_bad_file_is_refused_and_store_unchanged(runner, cli, store, tmp_path, name, fname, data,
                                                         position, words):
    f = tmp_path / fname
    f.write_bytes(data)
    before = tree_hash(store)
    res = _ingest(runner, cli, f, "--store", store)
    msg = assert_refused(res, store, before, f, position)
    if words:
        assert words.lower() in msg.lower()


def test_ids_outside_the_declared_shape_are_refused(runner, cli, store, tmp_path):
    f = tmp_path / "load.csv"
    f.write_text(_load_csv_text(steps=2, layers=3, experts=4))  # layer 2 exists
    before = tree_hash(store)
    res = _ingest(runner, cli, f, "--store", store, "--layers", 2)
    msg = assert_refused(res, store, before, f)
    # first row with layer 2: rows are ordered step, layer, expert -> data row 2*4 + 1 = 9
    assert "layer = 2" in msg and "0..1" in msg and "row 9" in msg
    res = _ingest(runner, cli, f, "--store", store, "--experts", 3)
    msg = assert_refused(res, store, before, f)
    assert "expert = 3" in msg and "row 4" in msg


def test_one_bad_file_among_good_ones_writes_nothing(runner, cli, store, tmp_path):
    good = tmp_path / "good.csv"
    good.write_text(_load_csv_text())
    bad = tmp_path / "bad.csv"
    bad.write_text("step,layer,expert,tokens\n0,0,0,-1\n")
    before = tree_hash(store)
    res = _ingest(runner, cli, good, bad, "--store", store)
    assert_refused(res, store, before, bad)


def test_missing_input_and_empty_folder(runner, cli, store, tmp_path):
    before = tree_hash(store)
    assert_refused(_ingest(runner, cli, tmp_path / "nope.csv", "--store", store), store, before,
                   tmp_path / "nope.csv")
    (tmp_path / "empty dir").mkdir()
    assert_refused(_ingest(runner, cli, tmp_path / "empty dir", "--store", store), store, before,
                   tmp_path / "empty dir")


def test_bad_input_into_a_new_store_creates_nothing(runner, cli, tmp_path):
    f = tmp_path / "load.csv"
    f.write_text("step,layer,expert,tokens\n0,0,0,-1\n")
    res = _ingest(runner, cli, f, "--store", tmp_path / "fresh")
    assert res.exit_code == 2
    assert not (tmp_path / "fresh").exists()


# ----------------------------------------------------------------------------- paths with spaces and unicode
def test_spaces_and_unicode_in_paths(runner, cli, tmp_path):
    d = tmp_path / "incident 42 — ранги" / "trace ë 負荷"
    d.mkdir(parents=True)
    good = d / "expert load ü.csv"
    good.write_text(_load_csv_text(steps=2, layers=2, experts=3))
    st = tmp_path / "store with space ñ"
    res = _ingest(runner, cli, good, "--store", st)
    assert res.exit_code == 0, res.output
    tot = Store(st).sql("SELECT sum(tokens) AS t, count(*) AS n FROM expert_load")
    want = sum((s + 1) * (e + 2) + l for s in range(2) for l in range(2) for e in range(3))
    assert (tot["t"][0], tot["n"][0]) == (want, 12)
    assert Store(st).sql("SELECT source FROM runs")["source"][0] == good.name
    bad = d / "ßad ✗.csv"
    bad.write_text("step,layer,expert,tokens\n0,0,0,NaN\n")
    before = tree_hash(st)
    assert_refused(_ingest(runner, cli, bad, "--store", st), st, before, bad, "row 1")


# ----------------------------------------------------------------------------- truncation and corruption (property)
def _valid_payload(kind: str) -> bytes:
    text = _load_csv_text(steps=4, layers=2, experts=4)
    if kind == "csv":
        return text.encode()
    rows = [dict(zip(["step", "layer", "expert", "tokens"], map(int, ln.split(","))))
            for ln in text.strip().splitlines()[1:]]
    if kind == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _check_clean_or_refused(runner, cli, store_path, f):
    before = tree_hash(store_path)
    res = _ingest(runner, cli, f, "--store", store_path)
    if res.exit_code == 0 and "already ingested" in res.output:
        # the cut fell where the file's bytes equal the seed run's source exactly: a
        # re-ingest of the same source is a no-op, so the store must not have changed
        assert tree_hash(store_path) == before
        return "duplicate"
    if res.exit_code == 0:
        return "ingested"
    assert_refused(res, store_path, before, f)
    return "refused"


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
@HYP
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_at_any_offset(runner, cli, tmp_path_factory, kind, frac):
    tmp = tmp_path_factory.mktemp("trunc")
    store_path = _seed_store(tmp / "store")
    data = _valid_payload(kind)
    cut = int(frac * len(data))
    f = tmp / f"load.{kind}"
    f.write_bytes(data[:cut])
    outcome = _check_clean_or_refused(runner, cli, store_path, f)
    if kind == "parquet" or cut == 0:
        assert outcome == "refused"  # no footer (or no bytes): always detectable
    if outcome == "ingested":
        # what landed is exactly the complete rows of the cut text, nothing invented
        text = data[:cut].decode()
        complete = text.splitlines()[1:] if kind == "csv" else text.splitlines()
        if not text.endswith("\n"):
            complete = complete[:-1]  # the partial last line may parse as a shorter number
        got = Store(store_path).sql("SELECT count(*) AS n FROM expert_load WHERE run_id LIKE 'load%'")["n"][0]
        assert got in (len(complete), len(complete) + 1)


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
@HYP
@given(data=st.data())
def test_random_byte_corruption(runner, cli, tmp_path_factory, kind, data):
    tmp = tmp_path_factory.mktemp("flip")
    store_path = _seed_store(tmp / "store")
    payload = bytearray(_valid_payload(kind))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    f = tmp / f"load.{kind}"
    f.write_bytes(bytes(payload))
    _check_clean_or_refused(runner, cli, store_path, f)


@HYP
@given(value=st.one_of(st.text(max_size=5), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                       st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                            max_size=1), st.none(),
                       st.integers(min_value=-(2 ** 70), max_value=2 ** 70)),
       column=st.sampled_from(["step", "layer", "expert", "tokens"]))
def test_any_json_value_in_any_column(runner, cli, tmp_path_factory, value, column):
    tmp = tmp_path_factory.mktemp("types")
    store_path = _seed_store(tmp / "store")
    rows = [{"step": 0, "layer": 0, "expert": e, "tokens": 5} for e in range(3)]
    rows[1][column] = value
    f = tmp / "load.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outcome = _check_clean_or_refused(runner, cli, store_path, f)
    bound = 2 ** 63 if column in ("step", "tokens") else 2 ** 31  # int64 / int32 columns
    ok_int = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound
    ok_float = isinstance(value, float) and math.isfinite(value) and value.is_integer() and 0 <= value < bound
    try:  # a quoted integer ("7", as protobuf's JSON writes int64) may be read as that integer
        ok_str = isinstance(value, str) and 0 <= int(value) < bound
    except ValueError:
        ok_str = False
    if outcome == "ingested":
        assert ok_int or ok_float or ok_str, f"{column}={value!r} was accepted"
        if column == "tokens":
            got = Store(store_path).sql("SELECT tokens FROM expert_load WHERE run_id LIKE 'load%' AND expert = 1")
            assert got["tokens"][0] == int(value)
    if (isinstance(value, (str, list, dict, bool)) and not ok_str) or value is None or (
            isinstance(value, float) and not math.isfinite(value)):
        assert outcome == "refused"
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        assert outcome == "refused"


# ----------------------------------------------------------------------------- corrupt gzip (collectors reading .gz)
def _collectors_for(path: Path) -> list[str]:
    head = path.read_bytes()[:4096]
    out = []
    for name, c in registry().items():
        try:
            if c.sniff(path, head):
                out.append(name)
        except Exception:
            pass
    return out


def test_corrupt_gzip_trace(runner, cli, store, tmp_path):
    body = json.dumps({"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 2.0}] * 50}).encode()
    gz = gzip.compress(body)
    before = tree_hash(store)
    cases = {
        "truncated.pt.trace.json.gz": gz[: len(gz) // 2],
        "flipped.pt.trace.json.gz": gz[:20] + bytes(b ^ 0x5A for b in gz[20:40]) + gz[40:],
        "not gzip.pt.trace.json.gz": b"\x1f\x8b" + b"nonsense" * 20,
    }
    for fname, data in cases.items():
        f = tmp_path / fname
        f.write_bytes(data)
        res = _ingest(runner, cli, f, "--store", store)
        assert_refused(res, store, before, f)
        if "kineto" in registry():
            res = _ingest(runner, cli, f, "--store", store, "--format", "kineto")
            assert_refused(res, store, before, f)


# ----------------------------------------------------------------------------- malicious pickle
class _Exploit:
    """Unpickling this object calls exec(), which creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _malicious_pt(path: Path, marker: Path) -> None:
    """A torch.save archive whose keys make auto-detection route it to a collector:
    SGLang (logical_count / records) or vLLM (expert_load_pass)."""
    torch = pytest.importorskip("torch", reason="torch is needed to write a .pt in torch.save's zip format")
    if "vllm" in path.name or "expert_load" in path.name:
        obj = {"expert_load_pass": _Exploit(marker)}
    elif path.name.endswith("_0.pt"):
        obj = {"records": [{"forward_pass_id": 0, "rank": 0, "global_physical_count": _Exploit(marker)}],
               "last_physical_to_logical_map": [[0, 1]]}
    else:
        obj = {"logical_count": _Exploit(marker), "rank": 0}
    torch.save(obj, path)


def test_malicious_pickle_is_refused_and_does_not_run(runner, cli, store, tmp_path):
    # the payload is live: plain unpickling runs it (proves the test can fail)
    probe = tmp_path / "probe-marker"
    pickle.loads(pickle.dumps(_Exploit(probe)))
    assert probe.read_text() == "pwned"

    marker = tmp_path / "PWNED-marker"
    names = ["expert_distribution_recorder_1700000000.pt", "expert_distribution_recorder_1700000000_0.pt",
             "expert_load_window.pt", "dump.pt"]
    before = tree_hash(store)
    tried = []
    for n in names:
        f = tmp_path / n
        _malicious_pt(f, marker)
        res = _ingest(runner, cli, f, "--store", store)
        msg = assert_refused(res, store, before, f)
        if n != "dump.pt" and any(k in registry() for k in ("sglang", "vllm")):
            assert "weights_only" in msg or "refused" in msg, msg  # reached a loader, which refused it
        tried.append("auto")
        for fmt in [k for k in registry() if any(w in k for w in ("sglang", "vllm"))]:
            res = _ingest(runner, cli, f, "--store", store, "--format", fmt)
            assert_refused(res, store, before, f)
            tried.append(fmt)
        assert not marker.exists(), f"unpickling ran code while ingesting {n} ({tried})"


# ----------------------------------------------------------------------------- conservation (through the CLI)
_FIXTURE_TABLES: dict = {}


def _fixture_collect(paths, options):
    run, tables = _FIXTURE_TABLES["run"], _FIXTURE_TABLES["tables"]
    return [RunData(run=dict(run), tables=dict(tables), run_id_hint="fx", files=[str(p) for p in paths])]


register(Collector("test_fixture", "test-only: returns the tables the test set", lambda p, h: p.suffix == ".tfx",
                   _fixture_collect, priority=99))


def _consistent_run(rng, steps=3, layers=2, experts=6, top_k=2, ranks=2):
    """Routing drawn by hand with numpy; expert_load and steps derived from it by hand."""
    rows, load, srows = [], {}, []
    for s in range(steps):
        per_rank = rng.integers(0, 5, size=ranks)
        n = int(per_rank.sum())
        for r in range(ranks):
            srows.append({"step": s, "rank": r, "phase": "decode", "num_tokens": int(per_rank[r]),
                          "is_dummy": bool(per_rank[r] == 0), "start_ns": 1000 * s, "end_ns": 1000 * s + 900,
                          "inferred": False})
        for l in range(layers):
            for t in range(n):
                for c, e in enumerate(rng.choice(experts, size=top_k, replace=False)):
                    rows.append({"step": s, "layer": l, "token": t, "src_rank": None, "choice": c, "expert": int(e),
                                 "slot": None, "gate": 0.5})
                    load[(s, l, int(e))] = load.get((s, l, int(e)), 0) + 1
    el = [{"step": s, "layer": l, "expert": e, "slot": None, "src_rank": None, "tokens": v}
          for (s, l, e), v in sorted(load.items())]
    run = {"source": "fixture", "source_sha256": f"fx-{rng.integers(1 << 60)}", "time_base": "capture_start",
           "num_layers": layers, "num_experts": experts, "top_k": top_k, "num_ranks": ranks}
    return run, {"routing": pa.Table.from_pylist(rows), "expert_load": pa.Table.from_pylist(el),
                 "steps": pa.Table.from_pylist(srows)}


def test_conservation_consistent_run_is_ingested_unflagged(runner, cli, store, tmp_path):
    run, tables = _consistent_run(np.random.default_rng(1))
    _FIXTURE_TABLES.update(run=run, tables=tables)
    (tmp_path / "a.tfx").write_text("x")
    res = _ingest(runner, cli, tmp_path / "a.tfx", "--store", store)
    assert res.exit_code == 0, res.output
    r = Store(store).sql("SELECT inconsistent FROM runs WHERE collector = 'test_fixture'")
    assert r["inconsistent"].to_list() == [False]


def test_conservation_token_sum_refused_with_numbers_or_flagged(runner, cli, store, tmp_path):
    run, tables = _consistent_run(np.random.default_rng(2))
    el = tables["expert_load"].to_pylist()
    # one extra token at the first row of step 1: by hand, that (step, layer) sums to n1*k + 1
    i = next(j for j, r in enumerate(el) if r["step"] == 1)
    s, l = el[i]["step"], el[i]["layer"]
    n1 = sum(r["num_tokens"] for r in tables["steps"].to_pylist() if r["step"] == 1)
    el[i]["tokens"] += 1
    tables = {"expert_load": pa.Table.from_pylist(el), "steps": tables["steps"]}
    _FIXTURE_TABLES.update(run=run, tables=tables)
    f = tmp_path / "b.tfx"
    f.write_text("x")
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f, f"step {s}, layer {l}")
    assert f"sum to {n1 * 2 + 1}" in msg and f"= {n1 * 2}" in msg and "1 of 6 (step, layer) pairs" in msg
    assert "--allow-inconsistent" in msg
    res = _ingest(runner, cli, f, "--store", store, "--allow-inconsistent")
    assert res.exit_code == 0, res.output
    r = Store(store).sql("SELECT inconsistent, approximations FROM runs WHERE collector = 'test_fixture'")
    assert r["inconsistent"].to_list() == [True]
    notes = json.loads(r["approximations"][0])
    assert any("token conservation" in n and f"sum to {n1 * 2 + 1}" in n for n in notes)


def test_conservation_routing_must_aggregate_to_load(runner, cli, store, tmp_path):
    run, tables = _consistent_run(np.random.default_rng(3))
    rt = tables["routing"].to_pylist()
    dropped = rt.pop()  # one routing row lost: its (step, layer, expert) count is one short
    _FIXTURE_TABLES.update(run=run, tables={**tables, "routing": pa.Table.from_pylist(rt)})
    f = tmp_path / "c.tfx"
    f.write_text("x")
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f,
                         f"step {dropped['step']}, layer {dropped['layer']}, expert {dropped['expert']}")
    want = sum(1 for r in rt if (r["step"], r["layer"], r["expert"]) ==
               (dropped["step"], dropped["layer"], dropped["expert"]))
    assert f"routing has {want} rows" in msg and f"records {want + 1} tokens" in msg


def test_conservation_backwards_span_refused_or_flagged(runner, cli, store, tmp_path):
    run, tables = _consistent_run(np.random.default_rng(4))
    spans = pa.table({"rank": [0, 0, 1], "device": [0, 0, 1], "stream": [7, 7, 7], "kind": ["dispatch"] * 3,
                      "name_id": [0, 0, 0], "start_ns": [100, 500, 900], "end_ns": [200, 450, 950],
                      "step": [0, 0, 0], "layer": [None, None, None], "micro_batch": [None] * 3,
                      "inferred": [False] * 3, "correlation": [None] * 3, "collective": [None] * 3,
                      "process_group": pa.array([None] * 3, pa.string()),
                      "classified_by": pa.array([None] * 3, pa.string()), "moe_context": pa.array([None] * 3, pa.string())})
    _FIXTURE_TABLES.update(run=run, tables={**tables, "spans": spans})
    f = tmp_path / "d.tfx"
    f.write_text("x")
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f, "row 2")
    assert "500" in msg and "450" in msg
    res = _ingest(runner, cli, f, "--store", store, "--allow-inconsistent")
    assert res.exit_code == 0, res.output
    r = Store(store).sql("SELECT inconsistent, approximations FROM runs WHERE collector = 'test_fixture'")
    assert r["inconsistent"].to_list() == [True]
    assert "-50 ns" in r["approximations"][0]


def test_conservation_skips_dense_layers_and_unknown_tokens(runner, cli, store, tmp_path):
    run, tables = _consistent_run(np.random.default_rng(5), layers=2)
    el = tables["expert_load"].to_pylist()
    el += [{"step": s, "layer": 2, "expert": 0, "slot": None, "src_rank": None, "tokens": 0} for s in range(3)]
    run = {**run, "num_layers": 3}
    st_rows = tables["steps"].to_pylist()
    st_rows[0]["num_tokens"] = None  # step 0 unknown: not checked; the others still are
    _FIXTURE_TABLES.update(run=run, tables={"expert_load": pa.Table.from_pylist(el),
                                            "steps": pa.Table.from_pylist(st_rows)})
    f = tmp_path / "e.tfx"
    f.write_text("x")
    res = _ingest(runner, cli, f, "--store", store)
    assert res.exit_code == 0, res.output


# ----------------------------------------------------------------------------- read-only store
def _as_unprivileged(cmd: list[str], **kw):
    if os.geteuid() != 0:
        return subprocess.run(cmd, capture_output=True, text=True, **kw)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only folder does not stop root, "
                    "and there is no unprivileged user to run the ingest as")
    return subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                          capture_output=True, text=True, **kw)


def test_read_only_store_refuses_cleanly_and_stays_unchanged():
    """As root, chmod does not stop writes: the ingest runs as uid 65534 (nobody) via
    setpriv, for whom the 0555 store is genuinely read-only at the kernel level."""
    base = Path(tempfile.mkdtemp(prefix="moetrace-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        store_path = _seed_store(base / "store")
        src = base / "load.csv"
        src.write_text(_load_csv_text(steps=5))
        for dirpath, _dirnames, filenames in os.walk(store_path):
            os.chmod(dirpath, 0o555)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o444)
        os.chmod(src, 0o644)
        before = tree_hash(store_path)
        # the package and its contract, copied where uid 65534 can read them: the test must not
        # depend on where the clone lives (a mktemp -d checkout is 0700)
        pkg = base / "pkg"
        shutil.copytree(REPO / "moetrace", pkg / "moetrace", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(REPO / "schemas", pkg / "schemas")
        for dirpath, _dirnames, filenames in os.walk(pkg):
            os.chmod(dirpath, 0o755)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o644)
        env = {**os.environ, "HOME": str(base), "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": str(pkg) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        probe = _as_unprivileged([sys.executable, "-c", "import moetrace.cli, duckdb, polars"], env=env,
                                 cwd=str(base), timeout=120)
        if probe.returncode != 0:
            pytest.skip("uid 65534 cannot run this interpreter or import its dependencies (the virtual "
                        f"environment is not readable by that user): {probe.stderr.strip().splitlines()[-1:]}")
        res = _as_unprivileged([sys.executable, "-m", "moetrace", "ingest", str(src), "--store", str(store_path)],
                               env=env, cwd=str(base), timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stderr
        assert str(store_path) in res.stderr and ("read-only" in res.stderr or "not writable" in res.stderr)
        assert tree_hash(store_path) == before
        # the same user can still read it
        res = _as_unprivileged([sys.executable, "-m", "moetrace", "sql", str(store_path),
                                "SELECT count(*) AS n FROM expert_load", "--format", "csv"], env=env, cwd=str(base), timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().splitlines()[-1] == str(2 * 2 * 4)
        assert tree_hash(store_path) == before
    finally:
        for dirpath, _dirnames, _filenames in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------- SGLang / vLLM dumps
def _need(name: str):
    assert name in registry(), "collector missing from the package"
    return pytest.importorskip("torch", reason="torch is needed to write .pt dumps")


def _stat_dump(torch, path: Path, lc) -> Path:
    torch.save({"rank": 0, "logical_count": lc, "average_utilization_rate_over_window": 0.5}, path)
    return path


def _per_pass_dump(torch, path: Path, rank: int, layers: int, slots: int, passes=2, counts=None) -> Path:
    p2l = torch.arange(slots, dtype=torch.int32).remainder(4).repeat(layers, 1)
    recs = [{"forward_pass_id": f, "rank": rank, "gatherer_key": "primary",
             "global_physical_count": (counts if counts is not None else torch.full((layers, slots), 3, dtype=torch.int32))}
            for f in range(passes)]
    torch.save({"records": recs, "last_physical_to_logical_map": p2l}, path)
    return path


def test_sglang_valid_dumps_ingest(runner, cli, tmp_path):
    """The fixtures below are otherwise valid: the refusals are about the one defect."""
    torch = _need("sglang")
    lc = torch.zeros((6, 3, 4), dtype=torch.int32)
    lc[:4] = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    f = _stat_dump(torch, tmp_path / "expert_distribution_recorder_1700000000.pt", lc)
    res = _ingest(runner, cli, f, "--store", tmp_path / "st")
    assert res.exit_code == 0, res.output
    got = Store(tmp_path / "st").sql("SELECT sum(tokens) AS t, count(DISTINCT step) AS s FROM expert_load")
    assert (got["t"][0], got["s"][0]) == (4 * sum(range(12)), 4)  # 2 trailing zero rows dropped
    d = tmp_path / "pp"
    d.mkdir()
    for r in range(2):
        _per_pass_dump(torch, d / f"expert_distribution_recorder_1700000000_{r}.pt", r, layers=3, slots=8)
    res = _ingest(runner, cli, d, "--store", tmp_path / "st")
    assert res.exit_code == 0, res.output
    got = Store(tmp_path / "st").sql("SELECT sum(tokens) AS t FROM expert_load WHERE run_id IN "
                                     "(SELECT run_id FROM runs WHERE meta_json LIKE '%per_pass%')")
    assert got["t"][0] == 2 * 2 * 3 * 8 * 3  # ranks x passes x layers x slots x 3


def test_sglang_bad_dumps(runner, cli, store, tmp_path):
    torch = _need("sglang")
    before = tree_hash(store)
    neg = torch.ones((2, 3, 4), dtype=torch.int32)
    neg[1, 2, 3] = -7
    cases = [
        ("negative count", neg, "index [1, 2, 3]", "-7"),
        ("NaN count", torch.tensor([[[1.0, float("nan")]]]), None, "non-integer"),
        ("fractional count", torch.tensor([[[1.5, 2.0]]]), None, "non-integer"),
        ("1-D counts", torch.tensor([1, 2, 3], dtype=torch.int32), None, "shape"),
        ("all zero", torch.zeros((3, 2, 4), dtype=torch.int32), None, "zeros"),
        ("string instead of tensor", "lots", None, None),
    ]
    for i, (name, lc, pos, words) in enumerate(cases):
        f = _stat_dump(torch, tmp_path / f"expert_distribution_recorder_17000000{i:02d}.pt", lc)
        msg = assert_refused(_ingest(runner, cli, f, "--store", store, "--format", "sglang"), store, before, f, pos)
        if words:
            assert words in msg, (name, msg)


@HYP
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_sglang_truncated_pt_at_any_offset(runner, cli, tmp_path_factory, frac):
    torch = _need("sglang")
    tmp = tmp_path_factory.mktemp("pt")
    store_path = _seed_store(tmp / "store")
    full = _stat_dump(torch, tmp / "full.pt", torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)).read_bytes()
    f = tmp / "expert_distribution_recorder_1700000000.pt"
    f.write_bytes(full[: int(frac * len(full))])
    before = tree_hash(store_path)
    res = _ingest(runner, cli, f, "--store", store_path, "--format", "sglang")
    assert_refused(res, store_path, before, f)  # a zip without its central directory is never valid


def test_sglang_mismatched_layer_counts_between_rank_files(runner, cli, store, tmp_path):
    torch = _need("sglang")
    d = tmp_path / "dump"
    d.mkdir()
    _per_pass_dump(torch, d / "expert_distribution_recorder_1700000000_0.pt", 0, layers=3, slots=8)
    bad = _per_pass_dump(torch, d / "expert_distribution_recorder_1700000000_1.pt", 1, layers=2, slots=8)
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, d, "--store", store), store, before, bad)
    assert "expert_distribution_recorder_1700000000_0.pt" in msg  # names the file it disagrees with
    # a record whose counts have the wrong layer count, inside one file
    d2 = tmp_path / "dump2"
    d2.mkdir()
    bad = _per_pass_dump(torch, d2 / "expert_distribution_recorder_1700000000_0.pt", 0, layers=3, slots=8,
                         counts=torch.ones((2, 8), dtype=torch.int32))
    assert_refused(_ingest(runner, cli, d2, "--store", store), store, before, bad, "record 0")


def test_sglang_per_token_ids_out_of_range(runner, cli, store, tmp_path):
    torch = _need("sglang")
    L, P, T, K = 2, 8, 5, 2
    topk = torch.randint(0, P, (L, T, K), dtype=torch.int32)
    topk[1, 3, 1] = P + 5
    p2l = torch.arange(P, dtype=torch.int32).remainder(4).repeat(L, 1)
    f = tmp_path / "expert_distribution_recorder_1700000000_0.pt"
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "forward_mode": 2,
                             "topk_ids_of_layer": topk}], "last_physical_to_logical_map": p2l}, f)
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f, "record 0")
    assert str(P + 5) in msg


def test_sglang_json_wrong_types(runner, cli, store, tmp_path):
    assert 'sglang' in registry(), "collector missing from the package"
    before = tree_hash(store)
    cases = {
        "string": '{"logical_count": "lots"}',
        "ragged": '{"logical_count": [[1, 2, 3], [4, 5]]}',
        "nan": '{"logical_count": [[1, NaN], [2, 3]]}',
        "negative": '{"logical_count": [[1, 2], [3, -4]]}',
        "nested objects": '{"logical_count": [[{"a": 1}, 2], [3, 4]]}',
        "truncated": '{"logical_count": [[1, 2], [3, 4',
    }
    for name, text in cases.items():
        f = tmp_path / f"counts {name}.json"
        f.write_text(text)
        res = _ingest(runner, cli, f, "--store", store, "--format", "sglang")
        msg = assert_refused(res, store, before, f)
        if name == "truncated":
            assert "line 1" in msg


def test_vllm_bad_dumps(runner, cli, store, tmp_path):
    _need("vllm")
    before = tree_hash(store)
    marker = tmp_path / "NPY-PWNED"
    obj = np.empty(2, dtype=object)
    obj[0] = _Exploit(marker)
    f = tmp_path / "expert_load_window.npy"
    np.save(f, obj, allow_pickle=True)  # an object array is stored as a pickle
    assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f)
    assert not marker.exists(), "loading the .npy ran code"
    f = tmp_path / "expert_load_pass.npy"
    a = np.ones((3, 8), np.int32)
    a[2, 5] = -1
    np.save(f, a)
    assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f, "index [2, 5]")
    f = tmp_path / "eplb.npz"
    np.savez(f, expert_load_pass=np.ones((3, 8), np.int32), physical_to_logical_map=np.zeros((2, 8), np.int64))
    assert_refused(_ingest(runner, cli, f, "--store", store), store, before, f)  # map has 2 layers, load 3
    data = f.read_bytes()
    f2 = tmp_path / "cut.npz"
    f2.write_bytes(data[: len(data) // 2])
    assert_refused(_ingest(runner, cli, f2, "--store", store, "--format", "vllm"), store, before, f2)


# ----------------------------------------------------------------------------- profiler traces (Kineto, Nsight)
def _kineto_payload(gz: bool) -> bytes:
    from .helpers.kineto_trace import annotated_events, write_trace
    assert 'kineto' in registry(), "collector missing from the package"
    d = Path(tempfile.mkdtemp(prefix="moetrace-kin-"))
    try:
        return write_trace(d / "t.json", annotated_events(), rank=0, base=1767189312000000000, gz=gz).read_bytes()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_kineto_truncated_or_corrupted(runner, cli, tmp_path_factory, gz, data):
    payload = bytearray(_kineto_payload(gz))
    tmp = tmp_path_factory.mktemp("kin")
    store_path = _seed_store(tmp / "store")
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(payload) - 1))
        payload = payload[:cut]
        truncated = True
    else:
        for _ in range(data.draw(st.integers(1, 6))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
        truncated = False
    f = tmp / ("rank0.pt.trace.json.gz" if gz else "rank0.pt.trace.json")
    f.write_bytes(bytes(payload))
    before = tree_hash(store_path)
    res = _ingest(runner, cli, f, "--store", store_path, "--format", "kineto")
    if res.exit_code != 0 or truncated:  # a cut JSON document (or gzip stream) is never complete
        assert_refused(res, store_path, before, f)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_nsys_export_truncated_or_corrupted(runner, cli, tmp_path_factory, data):
    from .helpers.nsys_export import make_export
    assert 'nsys' in registry(), "collector missing from the package"
    tmp = tmp_path_factory.mktemp("nsys")
    payload = bytearray(make_export(tmp / "ok.sqlite").read_bytes())
    store_path = _seed_store(tmp / "store")
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 16))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    f = tmp / "report 1.nsys.sqlite"
    f.write_bytes(bytes(payload))
    before = tree_hash(store_path)
    res = _ingest(runner, cli, f, "--store", store_path, "--format", "nsys")
    if res.exit_code != 0:
        assert_refused(res, store_path, before, f)


@pytest.mark.parametrize("what,text,needle", [
    ("timestamp beyond int64 ns", '{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":1e25,"dur":1,'
                                  '"args":{"device":0,"stream":7,"correlation":1}}', None),
    ("timestamp that wraps int64 ns", '{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":99999999999999999,'
                                      '"dur":1,"args":{"device":0,"stream":7,"correlation":1}}', None),
    ("duration of a day", '{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":1000,"dur":86400000000,'
                          '"args":{"device":0,"stream":7,"correlation":1}}', None),
    ("negative duration", '{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":1000,"dur":-3,'
                          '"args":{"device":0,"stream":7,"correlation":1}}', None),
    ("timestamp as a word", '{"ph":"X","cat":"kernel","name":"k","pid":0,"tid":7,"ts":"soon","dur":1,'
                            '"args":{"device":0,"stream":7,"correlation":1}}', None),
    ("event is a list", '[1, 2, 3]', None),
])
def test_kineto_absurd_times_and_wrong_types(runner, cli, store, tmp_path, what, text, needle):
    assert 'kineto' in registry(), "collector missing from the package"
    f = tmp_path / "rank0.pt.trace.json"
    f.write_text('{"schemaVersion": 1, "traceEvents": [' + text + ']}')
    before = tree_hash(store)
    msg = assert_refused(_ingest(runner, cli, f, "--store", store, "--format", "kineto"), store, before, f)
    if what != "event is a list":
        assert "event 0" in msg, msg  # the position: index in traceEvents


def test_kineto_trace_events_of_the_wrong_type(runner, cli, store, tmp_path):
    assert 'kineto' in registry(), "collector missing from the package"
    before = tree_hash(store)
    for i, body in enumerate(['{"traceEvents": {"a": 1}}', '{"schemaVersion": 1}', '[]', '"trace"', '{"traceEvents": []}']):
        f = tmp_path / f"r{i}.pt.trace.json"
        f.write_text(body)
        assert_refused(_ingest(runner, cli, f, "--store", store, "--format", "kineto"), store, before, f)


# ----------------------------------------------------------------------------- engine logs
_LOG = (
    "(EngineCore_0 pid=4242) INFO 11-29 10:00:0{i} [eplb_state.py:512] EPLB step: {i} for model ds: "
    "avg_tokens=1{i}.50, max_tokens=2{i}, balancedness=0.{i}123\n"
    "[2026-11-29 10:00:0{i} TP0] [Expert Balancedness] forward_pass_id={i} current_pass_balancedness=0.400 "
    "last_10_average_balancedness=0.400 last_100_average_balancedness=0.400 last_1000_average_balancedness=0.400  "
    "gpu_physical_count_sum=40\n"
    "INFO some unrelated line {i}\n")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_engine_logs_truncated_or_corrupted(runner, cli, tmp_path_factory, data):
    assert 'logs' in registry(), "collector missing from the package"
    payload = bytearray("".join(_LOG.format(i=i) for i in range(1, 8)).encode())
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 12))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    tmp = tmp_path_factory.mktemp("logs")
    store_path = _seed_store(tmp / "store")
    f = tmp / "server log ü.log"
    f.write_bytes(bytes(payload))
    before = tree_hash(store_path)
    res = _ingest(runner, cli, f, "--store", store_path, "--format", "logs")
    if res.exit_code != 0:
        assert_refused(res, store_path, before, f)


def test_refrun_folder_with_a_corrupt_parquet(runner, cli, store, tmp_path):
    assert 'refrun' in registry(), "collector missing from the package"
    d = tmp_path / "refrun out"
    d.mkdir()
    (d / "moetrace-refrun.json").write_text(json.dumps({"num_ranks": 1, "num_layers": 1, "num_experts": 2,
                                                         "top_k": 1}))
    good = io.BytesIO()
    pq.write_table(pa.table({"step": [0], "layer": [0], "token": [0], "expert": [1]}), good)
    bad = d / "routing_rank0.parquet"
    bad.write_bytes(good.getvalue()[:4] + b"\x00" * 40 + good.getvalue()[-12:])
    before = tree_hash(store)
    assert_refused(_ingest(runner, cli, d, "--store", store), store, before, None)

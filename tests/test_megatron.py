"""Megatron-LM router traces, tokens-per-expert JSONL and loads arrays: counts equal a
plain-Python reading of the raw sample; bad records are refused with their line."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from moetrace.collect import collect, detect
from moetrace.run import Store

from .helpers import invoke, tree_hash

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _records(folder: Path):
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            yield f, json.loads(line)


def test_detected():
    assert detect(SAMPLES / "megatron_trace" / "router_trace_rank0.jsonl").name == "megatron"
    assert detect(SAMPLES / "megatron_tpe" / "rank0.jsonl").name == "megatron"
    assert detect(SAMPLES / "megatron_loads.npy").name == "megatron"


def test_router_trace_counts():
    want = Counter()
    tokens = 0
    mtp = 0
    for _, r in _records(SAMPLES / "megatron_trace"):
        if r["block"] != "decoder":
            mtp += 1
            continue
        for row in r["top_indices"]:
            tokens += 1
            for e in row:
                want[(r["step"], r["layer"], e)] += 1
    rd = collect([SAMPLES / "megatron_trace"])[0]
    load = rd.tables["expert_load"].to_pylist()
    assert {(x["step"], x["layer"], x["expert"]): x["tokens"] for x in load} == dict(want)
    routing = rd.tables["routing"]
    assert routing.num_rows == 2 * tokens and mtp == 1
    # rank 1, step 2, layer 1 came in two records (3 + 5 tokens): tokens 0..7, no repeats
    sub = [(x["token"], x["choice"]) for x in routing.to_pylist()
           if (x["src_rank"], x["step"], x["layer"]) == (1, 2, 1)]
    assert sorted(sub) == [(t, c) for t in range(8) for c in range(2)]
    assert (rd.run["top_k"], rd.run["num_experts"]) == (2, 8)
    assert any("1 MTP router-trace records skipped" in a for a in json.loads(rd.run["approximations"]))


def test_tokens_per_expert_counts():
    want = Counter()
    for f, r in _records(SAMPLES / "megatron_tpe"):
        rank = int(f.stem[4:])
        for mb in r["tpe"]:
            for e, n in enumerate(mb):
                want[(r["iter"], r["layer"], rank * 2 + e)] += n
    rd = collect([SAMPLES / "megatron_tpe"])[0]
    got = {(x["step"], x["layer"], x["expert"]): x["tokens"] for x in rd.tables["expert_load"].to_pylist()}
    assert got == dict(want)
    assert (rd.run["num_experts"], rd.run["num_ranks"]) == (8, 4)
    # ep_size 2: ranks 0,2 -> EP 0 and 1,3 -> EP 1, summed
    rd2 = collect([SAMPLES / "megatron_tpe"], options={"ep_size": "2"})[0]
    got2 = Counter()
    for (s, l, e), n in want.items():
        rank, local = divmod(e, 2)
        got2[(s, l, (rank % 2) * 2 + local)] += n
    assert {(x["step"], x["layer"], x["expert"]): x["tokens"] for x in rd2.tables["expert_load"].to_pylist()} \
        == dict(got2)


def test_loads_array_counts():
    a = np.load(SAMPLES / "megatron_loads.npy")
    rd = collect([SAMPLES / "megatron_loads.npy"])[0]
    t = rd.tables["expert_load"].to_pylist()
    assert len(t) == a.size
    assert all(x["tokens"] == a[x["layer"], x["step"], x["expert"]] for x in t)
    assert (rd.run["num_layers"], rd.run["num_experts"]) == (2, 8)


REC = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0, "num_tokens": 2, "topk": 2,
       "top_indices": [[0, 1], [2, 3]]}


@pytest.mark.parametrize("bad, message", [
    ('{"step": 0, "layer": 1, "rank": 0, "num_tokens": 2, "topk": 2, "top_indices": [[0, 1], [2',
     "line 2"),
    (json.dumps({**REC, "top_indices": [[0, 1], [2]]}), "top_indices has shape"),
    (json.dumps({**REC, "top_indices": [[0, 1], [2, -3]]}), "holds -3"),
    (json.dumps({**REC, "top_indices": [[0, 1], [2, 2**70]]}), "top_indices has shape"),
    (json.dumps({**REC, "top_indices": [[0, 1], [2, 2]]}), "names an expert twice"),
    (json.dumps({**REC, "num_tokens": 3}), "expected [3, 2]"),
    (json.dumps({**REC, "top_indices": [[0, 1.5], [2, 3]]}), "must hold integers"),
    (json.dumps({**REC, "step": True}), "'step' must be an integer"),
])
def test_bad_trace_refused(tmp_path, runner, cli, bad, message):
    p = tmp_path / "router_trace_rank0.jsonl"
    p.write_text(json.dumps(REC) + "\n" + bad + "\n")
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    res = invoke(runner, cli, "ingest", p, "--store", st, "--format", "megatron")
    assert res.exit_code == 2, res.output
    assert message in res.output and "line 2" in res.output and len(res.output.strip().splitlines()) == 1
    assert tree_hash(st) == before


def test_bad_tpe_and_loads(tmp_path, runner, cli):
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    p = tmp_path / "rank0.jsonl"
    p.write_text(json.dumps({"iter": 1, "block": "decoder", "layer": 0, "tpe": [[1, -2]]}) + "\n")
    res = invoke(runner, cli, "ingest", p, "--store", st, "--format", "megatron")
    assert res.exit_code == 2 and "holds -2" in res.output and "line 1" in res.output
    q = tmp_path / "loads.npy"
    np.save(q, np.zeros((2, 3), np.int64))
    res = invoke(runner, cli, "ingest", q, "--store", st)
    assert res.exit_code == 2 and "expected [layers, forwards, experts]" in res.output
    assert tree_hash(st) == before

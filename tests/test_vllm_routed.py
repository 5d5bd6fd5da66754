"""vLLM routed-experts arrays ([tokens, layers, top_k] per request, .npy or JSON lists) and
routing JSONL with metadata header lines."""
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


def _want(arrays):
    c = Counter()
    for step, a in enumerate(arrays):
        for t in range(a.shape[0]):
            for layer in range(a.shape[1]):
                for e in a[t, layer]:
                    c[(step, layer, int(e))] += 1
    return c


def _load(rd):
    return {(x["step"], x["layer"], x["expert"]): x["tokens"] for x in rd.tables["expert_load"].to_pylist()}


def test_npy_per_request():
    files = sorted((SAMPLES / "vllm_routed").glob("*.npy"))
    assert detect(files[0]).name == "routing_wide"
    arrays = [np.load(f) for f in files]
    rd = collect([SAMPLES / "vllm_routed"])[0]
    assert _load(rd) == dict(_want(arrays))
    assert rd.tables["routing"].num_rows == sum(a.size for a in arrays)
    assert (rd.run["num_layers"], rd.run["top_k"]) == (4, 2)
    assert any("each file is one request" in a for a in json.loads(rd.run["approximations"]))


def test_json_lists_equal_npy():
    p = SAMPLES / "vllm_routed_outputs.jsonl"
    assert detect(p).name == "routing_wide"
    arrays = [np.array(json.loads(line)["routed_experts"]) for line in p.read_text().splitlines()]
    rd = collect([p])[0]
    assert _load(rd) == dict(_want(arrays)) == _load(collect([SAMPLES / "vllm_routed"])[0])


@pytest.mark.parametrize("value, message", [
    ([[[0, 1]], [[2]]], "routed_experts has shape"),            # ragged
    ([[0, 1], [2, 3]], "routed_experts has shape [2, 2]"),       # 2-D
    ([[[0, 1.5]]], "must hold integer expert ids"),
    ([[[0, -5]]], "expert id -5 is negative"),
    ([[[0, 2**70]]], "routed_experts has shape"),
])
def test_bad_json_refused(tmp_path, runner, cli, value, message):
    p = tmp_path / "outputs.jsonl"
    p.write_text(json.dumps({"routed_experts": [[[0, 1]]]}) + "\n" + json.dumps({"routed_experts": value}) + "\n")
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    res = invoke(runner, cli, "ingest", p, "--store", st)
    assert res.exit_code == 2, res.output
    assert message in res.output and len(res.output.strip().splitlines()) == 1
    assert tree_hash(st) == before


def test_bad_npy_refused(tmp_path, runner, cli):
    p = tmp_path / "req0_routed_experts.npy"
    np.save(p, np.zeros((3, 2, 2), np.float32))
    res = invoke(runner, cli, "ingest", p, "--store", tmp_path / "st", "--format", "routing_wide")
    assert res.exit_code == 2 and "expected integer [tokens, layers, top_k]" in res.output


# ---------------------------------------------------------------- routing JSONL with metadata lines
def test_jsonl_with_meta_header():
    p = SAMPLES / "routing_with_meta.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    meta = [(i, r) for i, r in enumerate(rows, 1) if r.get("type") == "meta"]
    want = Counter((r["step"], r["layer"], r["expert"]) for r in rows if "type" not in r)
    assert detect(p).name == "generic"
    rd = collect([p])[0]
    assert _load(rd) == dict(want)
    m = json.loads(rd.run["meta_json"])["jsonl_meta"]
    assert [(x["line"], x["record"]) for x in m] == meta
    approx = json.loads(rd.run["approximations"])
    assert any(f"{len(meta)} metadata record(s)" in a and "lines 1, " in a for a in approx)


def test_wide_jsonl_with_meta_header(tmp_path):
    p = tmp_path / "layer_3.jsonl"
    p.write_text(json.dumps({"type": "meta", "model": "m"}) + "\n"
                 + "".join(json.dumps({"topk_ids": [t % 4, (t + 1) % 4]}) + "\n" for t in range(6)))
    assert detect(p).name == "routing_wide"
    rd = collect([p])[0]
    want = Counter([(0, 3, t % 4) for t in range(6)] + [(0, 3, (t + 1) % 4) for t in range(6)])
    assert _load(rd) == dict(want)
    assert json.loads(rd.run["meta_json"])["jsonl_meta"][0]["record"] == {"type": "meta", "model": "m"}


def test_unrecognized_jsonl_names_the_routing_formats(tmp_path, runner, cli):
    p = tmp_path / "routes.jsonl"
    p.write_text(json.dumps({"type": "meta", "model": "m"}) + "\n"
                 + json.dumps({"req": 1, "top_indices": [[1, 2]], "topk": 2, "num_tokens": 1}) + "\n")
    res = invoke(runner, cli, "ingest", p, "--store", tmp_path / "st", "--format", "generic")
    assert res.exit_code == 2
    assert "the columns match" in res.output and "megatron router trace" in res.output
    p.write_text(json.dumps({"step": 0, "topk_ids": [1, 2]}) + "\n")
    res = invoke(runner, cli, "ingest", p, "--store", tmp_path / "st", "--format", "generic")
    assert res.exit_code == 2 and "routing_wide" in res.output

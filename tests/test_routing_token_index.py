"""Per-token routing logs with req_id / token_idx (a vLLM route-logging patch's JSONL):
steps where the file has them (token_idx restarts each forward pass), tokens in their
order; and runs.source naming the folder of many relative paths. Expected numbers are
counted here from the raw lines, independently of the collector."""
from __future__ import annotations

import gzip
import json
import os

from moetrace.run import Store

from .helpers import invoke, shared_data


def _lines(tokens_per_pass, layers=(0,), req="r1"):
    out = [json.dumps({"type": "meta", "model_id": "m", "top_k": 2})]
    for n in tokens_per_pass:
        for t in range(n):
            for lay in layers:
                out.append(json.dumps({"type": "route", "req_id": req, "token_idx": t, "layer": lay,
                                       "topk_ids": [t % 4, 4 + t % 3], "topk_weights": [0.6, 0.4]}))
    return "\n".join(out) + "\n"


def test_token_index_restarts_are_steps(tmp_path, runner, cli):
    f = tmp_path / "moe_routes.jsonl"
    f.write_text(_lines([5, 1, 1, 3], layers=(0, 1)))
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", f, "--store", st)
    assert res.exit_code == 0, res.output
    got = Store(st).sql("SELECT step, layer, count(DISTINCT token) AS t, max(token) AS m FROM routing "
                        "GROUP BY step, layer ORDER BY step, layer").rows()
    assert got == [(s, lay, n, n - 1) for s, n in enumerate([5, 1, 1, 3]) for lay in (0, 1)]


def test_real_vllm_route_log_keeps_its_forward_passes(tmp_path, runner, cli):
    p = shared_data("real_logs", "vllm_qwen15moe_routes.jsonl.gz")
    f = tmp_path / "moe_routes.jsonl"
    f.write_bytes(gzip.decompress(p.read_bytes()))
    # independent count: a forward pass is a run of growing token_idx
    passes, prev, assignments = [], None, 0
    for line in f.read_text().splitlines():
        d = json.loads(line)
        if d.get("type") != "route":
            continue
        if prev is None or d["token_idx"] <= prev:
            passes.append(0)
        passes[-1] += 1
        prev = d["token_idx"]
        assignments += len(d["topk_ids"])
    assert (len(passes), assignments) == (132, 84_096)
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", f, "--store", st).exit_code == 0
    s = Store(st)
    got = [n for (n,) in s.sql("SELECT count(DISTINCT token) FROM routing GROUP BY step ORDER BY step").rows()]
    assert got == passes
    assert s.sql("SELECT count(*) AS n FROM routing")["n"][0] == assignments


def test_source_names_the_folder_of_many_relative_paths(tmp_path, runner, cli, monkeypatch):
    d = tmp_path / "route_shards"
    d.mkdir()
    for lay in range(5):
        (d / f"layer_{lay}.jsonl").write_text(
            "\n".join(json.dumps({"token": t, "step": 0, "topk_ids": [t % 4, 4]}) for t in range(3)) + "\n")
    monkeypatch.chdir(d)
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", *sorted(os.listdir(".")), "--store", st)
    assert res.exit_code == 0, res.output
    assert Store(st).sql("SELECT source FROM runs")["source"][0] == "route_shards/ (5 files)"

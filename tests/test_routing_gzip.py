"""Routing files compressed with gzip (``routes.jsonl.gz``, ``.ndjson.gz``) detected and read
as their plain form, by every routing collector that reads JSONL: the same rows as the
same file uncompressed; a corrupt or over-inflating stream is one line naming the file."""
from __future__ import annotations

import gzip
import json

from moetrace.run import Store

from .helpers import invoke, shared_data


def _wide(passes=(5, 1, 3), layers=(0, 1)):
    out = [json.dumps({"type": "meta", "model_id": "m", "top_k": 2})]
    for n in passes:
        for t in range(n):
            for lay in layers:
                out.append(json.dumps({"type": "route", "req_id": "r1", "token_idx": t, "layer": lay,
                                       "topk_ids": [t % 4, 4 + t % 3], "topk_weights": [0.6, 0.4]}))
    return "\n".join(out) + "\n"


def _long():
    return "\n".join(json.dumps({"step": s, "layer": lay, "token": t, "expert": (t + lay) % 8})
                     for s in range(2) for lay in range(2) for t in range(6)) + "\n"


def _routing(runner, cli, path, st):
    res = invoke(runner, cli, "ingest", path, "--store", st)
    assert res.exit_code == 0, res.output
    return Store(st).sql("SELECT step, layer, token, expert FROM routing ORDER BY ALL").rows()


def test_gzip_jsonl_reads_as_the_plain_file(tmp_path, runner, cli):
    for name, text in (("routes.jsonl", _wide()), ("routes.ndjson", _wide()), ("long.jsonl", _long())):
        plain = tmp_path / name
        plain.write_text(text)
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress(text.encode()))
        want = _routing(runner, cli, plain, tmp_path / f"{name}-plain")
        assert want and _routing(runner, cli, gz, tmp_path / f"{name}-gz") == want


def test_real_vllm_route_log_ingests_compressed(tmp_path, runner, cli):
    p = shared_data("real_logs", "vllm_qwen15moe_routes.jsonl.gz")
    # independent count from the inflated lines
    rows = [json.loads(line) for line in gzip.decompress(p.read_bytes()).decode().splitlines() if line.strip()]
    assignments = sum(len(d["topk_ids"]) for d in rows if d.get("type") == "route")
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", p, "--store", st).exit_code == 0
    assert Store(st).sql("SELECT count(*) AS n FROM routing")["n"][0] == assignments


def test_corrupt_or_too_large_gzip_is_one_line(tmp_path, runner, cli):
    data = gzip.compress(_long().encode())
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2])
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", bad, "--store", st)
    assert res.exit_code == 2 and "cut.jsonl.gz" in res.output and "gzip" in res.output, res.output
    assert not st.exists() or not any((st / "runs").glob("*"))
    big = tmp_path / "big.jsonl.gz"
    big.write_bytes(gzip.compress((_long() * 1000).encode()))   # ~1.4 MB inflated, a few KB compressed
    res = invoke(runner, cli, "ingest", big, "--store", st, "--set", "max_inflated_bytes=1048576")
    assert res.exit_code == 2 and "big.jsonl.gz" in res.output and "max_inflated_bytes" in res.output, res.output

"""Bad input for the plan-file and statistics sources (TensorRT-LLM statistics and EPLB YAML, wide
per-token routing, Prometheus scrapes, vllm-ascend / TensorRT-LLM plan files), fed through
the CLI: exit code 2, one line naming the file (and the position where the format has
one), no traceback, and the store byte-for-byte as it was (``tree_hash``). Same style as
tests/test_bad_input.py."""
from __future__ import annotations

import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save_file

from moetrace.collect import ingest
from moetrace.run import Store

from .helpers import tree_hash


def _seed(tmp_path):
    src = tmp_path / "seed.csv"
    src.write_text("step,layer,expert,tokens\n0,0,0,3\n0,0,1,5\n")
    st = tmp_path / "store"
    ingest(Store(st, create=True), [src])
    return st


def _refused(runner, cli, st, args, file, position=None, words=None):
    before = tree_hash(st)
    res = runner.invoke(cli, ["ingest", *map(str, args), "--store", str(st)], catch_exceptions=True)
    msg = res.output
    assert res.exit_code == 2, f"exit {res.exit_code}: {msg!r} {res.exception!r}"
    assert "Traceback" not in msg and "moetrace: error:" in msg
    assert len([l for l in msg.splitlines() if l.strip()]) == 1, msg
    assert str(file) in msg, f"{file} not named in {msg!r}"
    if position:
        assert position in msg, msg
    if words:
        assert words in msg, msg
    assert tree_hash(st) == before, "store changed after refused input"


def _stats(folder, meta=None, ranks=None):
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps(meta or {"num_experts": 4, "num_experts_per_token": 2}))
    for r, rec in (ranks or {0: {"0_1": np.array([1, 1, 0, 0], np.int64)},
                             1: {"0_1": np.array([0, 1, 1, 2], np.int64)}}).items():
        save_file(rec, str(folder / f"rank{r}.safetensors"))
    return folder


# ----------------------------------------------------------------------------- TensorRT-LLM statistics
def test_trtllm_truncated_rank_file(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    f = d / "rank1.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    _refused(runner, cli, st, [d], f, words="cannot read safetensors")


def test_trtllm_huge_header_length(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    f = d / "rank0.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 62) + b'{"0_1":{}}')
    _refused(runner, cli, st, [d, f], f, position="byte 0")


@pytest.mark.parametrize("rec, words", [
    ({"0_1": np.array([1, 1, 0], np.int64)}, "expected [4]"),
    ({"0_1": np.array([1.0, 1.0, 0, 0])}, "expected integer counts"),
    ({"0_1": np.array([3, -1, 0, 0], np.int64)}, "negative count"),
    ({"iter0_layer1": np.array([1, 1, 0, 0], np.int64)}, "is not '{iter}_{layer}'"),
])
def test_trtllm_bad_tensor(runner, cli, tmp_path, rec, words):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats", ranks={0: {"0_1": np.array([1, 1, 0, 0], np.int64)}, 1: rec})
    _refused(runner, cli, st, [d], d / "rank1.safetensors", words=words)


def test_trtllm_missing_rank_file(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats", ranks={0: {"0_1": np.array([1, 1, 0, 0], np.int64)},
                                          2: {"0_1": np.array([1, 1, 0, 0], np.int64)}})
    _refused(runner, cli, st, [d], d, words="missing ranks 1")


@pytest.mark.parametrize("meta, words", [
    ({"num_experts": 4}, "num_experts_per_token must be a positive integer"),
    ({"num_experts": 4, "num_experts_per_token": 9}, "> num_experts"),
    ({"num_experts": "4", "num_experts_per_token": 2}, "num_experts must be a positive integer"),
])
def test_trtllm_bad_meta(runner, cli, tmp_path, meta, words):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    (d / "meta_info.json").write_text(json.dumps(meta) if "num_experts_per_token" in meta
                                      else '{"num_experts": 4, "num_experts_per_token": null}')
    _refused(runner, cli, st, [d], d / "meta_info.json", words=words)


def test_trtllm_yaml_that_does_not_fit_the_statistics(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    y = tmp_path / "lb.yaml"
    y.write_text("num_slots: 5\nlayer_updates_per_iter: 0\ninitial_global_assignments:\n  1: [0, 1, 2, 3, 0]\n")
    _refused(runner, cli, st, [d, y], y, words="does not split into consecutive blocks over the 2 EP ranks")


def test_trtllm_yaml_with_a_python_tag(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    y = tmp_path / "lb.yaml"
    y.write_text("num_slots: 4\nlayer_updates_per_iter: 0\ninitial_global_assignments:\n"
                 "  1: !!python/object/apply:os.system ['touch pwned']\n")
    _refused(runner, cli, st, [d, y], y, words="invalid YAML")
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- wide routing
@pytest.mark.parametrize("rows, words, position", [
    ([[1, 2], [3, 3]], "names expert 3 twice", "row 2"),
    ([[1, 2], [0, -5]], "is negative", "row 2"),
])
def test_wide_routing_bad_rows(runner, cli, tmp_path, rows, words, position):
    st = _seed(tmp_path)
    f = tmp_path / "layer_2.parquet"
    pq.write_table(pa.table({"indices": pa.array(rows, pa.list_(pa.int16()))}), f)
    _refused(runner, cli, st, [f], f, position=position, words=words)


def test_wide_routing_gate_lengths_differ(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "layer_2.parquet"
    pq.write_table(pa.table({"indices": pa.array([[1, 2], [0, 3]], pa.list_(pa.int16())),
                             "scores": pa.array([[0.5, 0.5], [1.0]], pa.list_(pa.float16()))}), f)
    _refused(runner, cli, st, [f], f, position="row 2", words="differ in length")


def test_wide_routing_truncated_parquet(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "layer_2.parquet"
    pq.write_table(pa.table({"indices": pa.array([[1, 2]] * 50, pa.list_(pa.int16()))}), f)
    f.write_bytes(f.read_bytes()[:-20])
    _refused(runner, cli, st, [f, "--format", "routing_wide"], f, words="cannot parse")


def test_wide_routing_jsonl_nested_too_deep(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "routes.jsonl"
    f.write_text('{"layer": 0, "experts": [1, 2]}\n{"layer": 0, "experts": ' + "[" * 100000 + "]" * 100000 + "}\n")
    _refused(runner, cli, st, [f], f, position="row 2")


# ----------------------------------------------------------------------------- Prometheus
def test_prometheus_garbage_line(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "metrics.prom"
    f.write_text("# TYPE vllm:eplb_balancedness_avg gauge\nvllm:eplb_balancedness_avg 0.5\n<html>oops</html>\n")
    _refused(runner, cli, st, [f], f, position="line 3", words="not a Prometheus sample line")


def test_prometheus_counter_jump(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = tmp_path / "scrapes"
    d.mkdir()
    (d / "m_1764547200.prom").write_text("vllm:eplb_rearrangements_total 1\nvllm:eplb_balancedness_avg 0.5\n")
    (d / "m_1764547260.prom").write_text("vllm:eplb_rearrangements_total 1e12\nvllm:eplb_balancedness_avg 0.5\n")
    _refused(runner, cli, st, [d], d / "m_1764547260.prom", position="line 1", words="rose by")


def test_prometheus_summary_half(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "metrics.prom"
    f.write_text("# TYPE sglang:eplb_balancedness summary\nsglang:eplb_balancedness_count 4\n")
    _refused(runner, cli, st, [f], f, words="without both _sum and _count")


# ----------------------------------------------------------------------------- plan files
def test_plan_import_bad_vllm_ascend_map(runner, cli, tmp_path):
    st = _seed(tmp_path)
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 1, "device_list": [
        {"device_id": 0, "device_expert": [0, "one"]}]}]}))
    before = tree_hash(st)
    res = runner.invoke(cli, ["plan", str(st), "--import", str(f), "--ranks", "1"], catch_exceptions=True)
    assert res.exit_code == 2 and str(f) in res.output and "Traceback" not in res.output, res.output
    assert tree_hash(st) == before


@pytest.mark.parametrize("field, words", [
    ('"routed_experts": "not base64!!"', "not valid base64"),
    ('"routed_experts": "AAAAAAAAAAA="', "do not split into"),
])
def test_serving_api_response_bad_payload(runner, cli, tmp_path, field, words):
    st = _seed(tmp_path)
    f = tmp_path / "responses.jsonl"
    f.write_text('{"meta_info": {"prompt_tokens": 2, "completion_tokens": 2, ' + field + '}}\n')
    _refused(runner, cli, st, [f, "--top-k", "2"], f, position="line 1 meta_info", words=words)


def test_trtllm_yaml_alone_is_not_a_run(runner, cli, tmp_path):
    st = _seed(tmp_path)
    y = tmp_path / "moe_load_balancer.yaml"
    y.write_text("num_slots: 4\nlayer_updates_per_iter: 0\ninitial_global_assignments:\n  1: [0, 1, 2, 3]\n")
    _refused(runner, cli, st, [y], y, words="plan --import")


def test_trtllm_folder_without_meta_info(runner, cli, tmp_path):
    st = _seed(tmp_path)
    d = _stats(tmp_path / "stats")
    (d / "meta_info.json").unlink()
    _refused(runner, cli, st, [d], d, words="no meta_info.json")


def test_plan_import_refuses_a_fifo(runner, cli, tmp_path):
    import os

    st = _seed(tmp_path)
    f = tmp_path / "plan.yaml"
    os.mkfifo(f)
    before = tree_hash(st)
    res = runner.invoke(cli, ["plan", str(st), "--import", str(f), "--ranks", "1"], catch_exceptions=True)
    assert res.exit_code == 2 and "FIFO" in res.output and str(f) in res.output, res.output
    assert tree_hash(st) == before


def test_trtllm_far_apart_iterations_fail_fast(runner, cli, tmp_path):
    st = _seed(tmp_path)
    c = np.array([1, 1, 0, 0], np.int64)
    d = _stats(tmp_path / "stats", ranks={0: {"0_1": c, "1000000000000_1": c}, 1: {"0_1": c, "1000000000000_1": c}})
    _refused(runner, cli, st, [d], d, words="1-999999999999 missing between 0 and 1000000000000")


def test_wide_routing_sparse_huge_steps(tmp_path):
    """Step ids far apart must not allocate per step id (counts are per distinct step)."""
    from moetrace.collect import collect

    f = tmp_path / "r.parquet"
    pq.write_table(pa.table({"step": [0, 10**15], "layer": [0, 0],
                             "indices": pa.array([[1, 2], [0, 3]], pa.list_(pa.int16()))}), f)
    rd = collect([f])[0]
    assert sorted(rd.tables["expert_load"].column("step").to_pylist()) == [0, 0, 10**15, 10**15]

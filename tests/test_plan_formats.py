"""Plan files in every format: TensorRT-LLM EPLB YAML and vllm-ascend expert map JSON
(beside SGLang and EPLB JSON) export and read back to the same placement; the files are
checked against the layouts the engines document, written out here by hand."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moetrace.errors import InputError
from moetrace.placement import plan_files as plan_io
from moetrace.placement.planners import Plan

# 4 experts on 6 slots over 2 ranks (3 slots each), model layers 3 and 4 (dense 0-2)
P2L = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 3]])
LAYERS = np.array([3, 4])


def _plan():
    return Plan(P2L, 4, 2, 2, layers=LAYERS, policy="hand")


@pytest.mark.parametrize("fmt", plan_io.FORMATS)
def test_round_trip(tmp_path, fmt):
    f = plan_io.export_plan(_plan(), tmp_path / ("plan.yaml" if fmt == "trtllm" else "plan.json"), fmt)
    q = plan_io.import_plan(f, 4, 2, 2, layers=LAYERS)
    assert np.array_equal(q.phy2log, P2L) and q.layers.tolist() == [3, 4] and q.num_ranks == 2


def test_trtllm_yaml_is_the_engine_layout(tmp_path):
    f = plan_io.export_plan(_plan(), tmp_path / "moe_load_balancer.yaml", "trtllm")
    doc = yaml.safe_load(f.read_text())
    # TensorRT-LLM: num_slots, layer_updates_per_iter (0 = static), {model layer: [expert per slot]}
    assert doc == {"num_slots": 6, "layer_updates_per_iter": 0,
                   "initial_global_assignments": {3: [0, 1, 2, 3, 0, 1], 4: [3, 2, 1, 0, 3, 3]}}


def test_trtllm_yaml_inline_under_moe_config(tmp_path):
    f = tmp_path / "extra_llm_api_options.yaml"
    f.write_text("enable_attention_dp: true\nmoe_config:\n  backend: WideEP\n  load_balancer:\n    num_slots: 6\n"
                 "    layer_updates_per_iter: 0\n    initial_global_assignments:\n      '3': [0, 1, 2, 3, 0, 1]\n"
                 "      '4': [3, 2, 1, 0, 3, 3]\n")
    q = plan_io.import_plan(f, 4, 2, 2, layers=LAYERS)
    # rank r holds consecutive slots [3r, 3r+3): rank 1 holds experts 3, 0, 1 on layer 3
    assert q.phy2log[0, 3:].tolist() == [3, 0, 1] and q.slot_rank.tolist() == [0, 0, 0, 1, 1, 1]


def test_vllm_ascend_map_is_the_engine_layout(tmp_path):
    f = plan_io.export_plan(_plan(), tmp_path / "expert_map.json", "vllm-ascend")
    doc = json.loads(f.read_text())
    assert doc["moe_layer_count"] == 2
    assert doc["layer_list"][1] == {"layer_id": 1, "device_count": 2, "device_list": [
        {"device_id": 0, "device_expert": [3, 2, 1]}, {"device_id": 1, "device_expert": [0, 3, 3]}]}


def test_vllm_ascend_map_written_by_hand(tmp_path):
    # the shape vllm-ascend's own tests use (no device_id), 4 experts on 2 devices, layers 0-1
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"moe_layer_count": 2, "layer_list": [
        {"layer_id": 0, "device_count": 2, "device_list": [{"device_expert": [0, 1]}, {"device_expert": [2, 3]}]},
        {"layer_id": 1, "device_count": 2, "device_list": [{"device_expert": [3, 1]}, {"device_expert": [2, 0]}]}]}))
    q = plan_io.import_plan(f, 4, 8, 8, layers=np.array([0, 1]))
    assert q.num_ranks == 2 and q.phy2log.tolist() == [[0, 1, 2, 3], [3, 1, 2, 0]]
    assert q.params == {}   # ids matched directly


@pytest.mark.parametrize("text, msg", [
    ("num_slots: 6\ninitial_global_assignments:\n  3: [0, 1, 2]\n", "has 3 slots, num_slots is 6"),
    ("num_slots: 4\ninitial_global_assignments:\n  3: [0, 1, 2, 9]\n", "holds expert 9"),
    ("num_slots: 4\ninitial_global_assignments:\n  x: [0, 1, 2, 3]\n", "is not a layer number"),
    ("num_slots: 4\nlayer_updates_per_iter: 2\n", "online balancing"),
    ("num_slots: [4\n", "invalid YAML"),
    ("num_slots: !!python/object/apply:os.system ['true']\n", "invalid YAML"),
])
def test_bad_trtllm_yaml(tmp_path, text, msg):
    f = tmp_path / "lb.yaml"
    f.write_text(text)
    with pytest.raises(InputError, match=msg) as e:
        plan_io.import_plan(f, 4, 2, 2, layers=np.array([3]))
    assert e.value.file == str(f)


@pytest.mark.parametrize("doc, msg", [
    ({"moe_layer_count": 2, "layer_list": [{"layer_id": 0, "device_list": [{"device_expert": [0, 1]}]}]},
     "moe_layer_count 2 differs"),
    ({"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
        {"device_expert": [0, 1]}, {"device_expert": [2]}]}]}, "every device needs the same number of slots"),
    ({"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 3, "device_list": [
        {"device_expert": [0, 1]}, {"device_expert": [2, 3]}]}]}, "device_count 3 differs"),
    ({"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
        {"device_expert": [0, 1]}, {"device_expert": [1, 0]}]}]}, "without a slot"),
])
def test_bad_vllm_ascend_map(tmp_path, doc, msg):
    f = tmp_path / "map.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=msg):
        plan_io.import_plan(f, 4, 2, 2, layers=np.array([0]))


def test_cli_export_recorded_trtllm_and_import_vllm_ascend(tmp_path, runner, cli):
    """The TensorRT-LLM sample's recorded placement exports back to its own YAML; the
    vllm-ascend sample map imports as a plan and replays (rank loads checked by hand)."""
    from pathlib import Path

    from moetrace.collect import ingest
    from moetrace.run import Store

    here = Path(__file__).resolve().parent.parent / "sample_traces"
    st_path = tmp_path / "st"
    ingest(Store(st_path, create=True), [here / "trtllm_stats", here / "trtllm_moe_load_balancer.yaml"], run_id="t")
    out = tmp_path / "back.yaml"
    r = runner.invoke(cli, ["plan", str(st_path), "--plan", "recorded", "--export", str(out), "--export-format", "trtllm"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((here / "trtllm_moe_load_balancer.yaml").read_text())
    r = runner.invoke(cli, ["plan", str(st_path), "--import", str(out), "--plan-id", "back"])
    assert r.exit_code == 0, r.output
    q = "SELECT layer, slot, rank, expert FROM placement WHERE plan_id = ? ORDER BY layer, slot"
    assert Store(st_path).sql(q, ["back"]).equals(Store(st_path).sql(q, ["recorded"]))
    r = runner.invoke(cli, ["plan", str(st_path), "--import", str(here / "vllm_ascend_expert_map.json"),
                            "--plan-id", "ascend"])
    assert r.exit_code == 0, r.output
    doc = json.loads((here / "vllm_ascend_expert_map.json").read_text())
    r = runner.invoke(cli, ["replay", str(st_path), "--plan", "ascend", "--json"])
    assert r.exit_code == 0, r.output
    rid = json.loads(r.output)["replay_id"]
    st = Store(st_path)
    got = st.sql("SELECT step, layer, imbalance FROM replay_layer WHERE replay_id = ? ORDER BY step, layer", [rid])
    load = st.sql("SELECT step, layer, expert, sum(tokens) AS t FROM expert_load GROUP BY ALL")
    tok = {(s, l, e): t for s, l, e, t in load.iter_rows()}
    for step, layer, imb in got.iter_rows():
        devs = doc["layer_list"][layer - 1]["device_list"]           # MoE layer i = model layer i + 1 here
        flat = [e for d in devs for e in d["device_expert"]]
        copies = np.bincount(flat, minlength=16)
        ranks = [sum(tok.get((step, layer, e), 0) / copies[e] for e in d["device_expert"]) for d in devs]
        assert imb == pytest.approx(max(ranks) / np.mean(ranks))

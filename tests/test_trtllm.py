"""TensorRT-LLM expert statistics (meta_info.json + rank{r}.safetensors) and its EPLB config
as the recorded placement. Expected numbers come from the token choices the test draws
itself, counted with numpy, never from the collector."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from moetrace.collect import collect, ingest
from moetrace.errors import InputError
from moetrace.run import Store

R, E, K, LAYERS, ITERS = 2, 8, 2, (3, 4), range(10, 14)


def _choices(seed=0):
    """token choices [rank][iter][layer] -> int [tokens, K]; rank 1 idles in iteration 12."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in range(R):
        for it in ITERS:
            n = 0 if (r, it) == (1, 12) else 6 + r
            for l in LAYERS:
                p = np.arange(1, E + 1, dtype=float)[::-1] ** 2
                out[r, it, l] = np.array([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(n)],
                                         dtype=np.int64).reshape(n, K)
    return out


def _write(folder, ch, drop=(), extra=None):
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": K}))
    for r in range(R):
        rec = {f"{it}_{l}": np.bincount(ch[r, it, l].ravel(), minlength=E).astype(np.int64)
               for it in ITERS for l in LAYERS if (it, l) not in drop}
        rec.update((extra or {}).get(r, {}))
        save_file(rec, str(folder / f"rank{r}.safetensors"))
    return folder


YAML = """num_slots: 10
layer_updates_per_iter: 0
initial_global_assignments:
  3: [0, 1, 2, 3, 0, 4, 5, 6, 7, 0]
  4: [7, 6, 5, 4, 3, 2, 1, 0, 1, 2]
"""


def test_counts_per_iteration_layer_expert_and_source_rank(tmp_path):
    ch = _choices()
    rd = collect([_write(tmp_path / "stats", ch)])[0]
    assert rd.run["collector"] == "trtllm" and (rd.run["num_ranks"], rd.run["num_experts"], rd.run["top_k"]) == (R, E, K)
    load = rd.tables["expert_load"].to_pandas()
    got = load.groupby(["step", "layer", "src_rank", "expert"])["tokens"].sum().to_dict()
    for (r, it, l), c in ch.items():
        for e in range(E):
            n = int((c == e).sum())
            assert got.get((it, l, r, e), 0) == n
    # conservation: per (iteration, layer) the load is tokens x K, tokens counted by hand
    for it in ITERS:
        for l in LAYERS:
            assert load[(load.step == it) & (load.layer == l)].tokens.sum() == K * sum(len(ch[r, it, 3]) for r in range(R))
    steps = rd.tables["steps"].to_pandas().set_index(["step", "rank"])
    assert steps.loc[(12, 1), "is_dummy"] and steps.loc[(12, 1), "num_tokens"] == 0
    assert steps.loc[(11, 1), "num_tokens"] == 7 and not steps.loc[(11, 1), "is_dummy"]


def test_missing_iterations_are_named(tmp_path):
    folder = _write(tmp_path / "stats", _choices(), drop={(11, 3), (11, 4), (12, 3), (12, 4)})
    with pytest.raises(InputError, match=r"iterations are not contiguous: 11-12 missing"):
        collect([folder])


def test_missing_layer_in_one_iteration_is_named(tmp_path):
    folder = _write(tmp_path / "stats", _choices(), drop={(12, 4)})
    with pytest.raises(InputError, match=r"first iteration 12 layer 4"):
        collect([folder])


def test_count_not_a_multiple_of_top_k(tmp_path):
    folder = _write(tmp_path / "stats", _choices(), extra={1: {"10_3": np.array([1, 0, 0, 0, 0, 0, 0, 0])}})
    with pytest.raises(InputError, match=r"iteration 10 layer 3 sum to 1, not a multiple") as e:
        collect([folder])
    assert e.value.file.endswith("rank1.safetensors")


def _rank_tokens(ch, yaml_rows, it, l):
    """tokens per rank under the YAML placement, each expert split evenly over its copies."""
    row = yaml_rows[l]
    per = len(row) // R
    cnt = sum(np.bincount(ch[r, it, l].ravel(), minlength=E) for r in range(R))
    copies = np.bincount(row, minlength=E)
    out = np.zeros(R)
    for s, e in enumerate(row):
        out[s // per] += cnt[e] / copies[e]
    return out


def test_eplb_yaml_is_the_recorded_placement_in_skew_and_replay(tmp_path, runner, cli):
    ch = _choices()
    folder = _write(tmp_path / "stats", ch)
    (tmp_path / "lb.yaml").write_text(YAML)
    st = Store(tmp_path / "st", create=True)
    ingest(st, [folder, tmp_path / "lb.yaml"])
    pl = st.sql("SELECT layer, slot, rank, expert FROM placement WHERE plan_id = 'recorded' ORDER BY layer, slot")
    assert pl["rank"].to_list()[:10] == [0] * 5 + [1] * 5 and pl["expert"].to_list()[:10] == [0, 1, 2, 3, 0, 4, 5, 6, 7, 0]
    rows = {3: [0, 1, 2, 3, 0, 4, 5, 6, 7, 0], 4: [7, 6, 5, 4, 3, 2, 1, 0, 1, 2]}
    sk = st.sql("SELECT step, layer, imbalance FROM layer_skew ORDER BY step, layer")
    for it, l, imb in sk.iter_rows():
        t = _rank_tokens(ch, rows, it, l)
        assert imb == pytest.approx(t.max() / t.mean())
    r = runner.invoke(cli, ["skew", str(tmp_path / "st")])
    assert r.exit_code == 0 and "recorded" in r.output, r.output
    r = runner.invoke(cli, ["replay", str(tmp_path / "st"), "--plan", "recorded", "--json"])
    assert r.exit_code == 0, r.output
    rid = json.loads(r.output)["replay_id"]
    lay = Store(tmp_path / "st").sql("SELECT step, layer, imbalance FROM replay_layer WHERE replay_id = ? "
                                     "ORDER BY step, layer", [rid])
    for it, l, imb in lay.iter_rows():
        t = _rank_tokens(ch, rows, it, l)
        assert imb == pytest.approx(t.max() / t.mean())


def test_yaml_missing_a_layer_of_the_statistics(tmp_path):
    folder = _write(tmp_path / "stats", _choices())
    (tmp_path / "lb.yaml").write_text("num_slots: 10\ninitial_global_assignments:\n  3: [0, 1, 2, 3, 0, 4, 5, 6, 7, 0]\n")
    with pytest.raises(InputError, match="no row for layers 4"):
        collect([folder, tmp_path / "lb.yaml"])


def test_online_balancing_is_stated(tmp_path):
    folder = _write(tmp_path / "stats", _choices())
    (tmp_path / "lb.yaml").write_text(YAML.replace("layer_updates_per_iter: 0", "layer_updates_per_iter: 2"))
    rd = collect([folder, tmp_path / "lb.yaml"])[0]
    assert any("moved experts online" in a for a in json.loads(rd.run["approximations"]))


def test_sample_folder_ingests(tmp_path):
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "sample_traces"
    st = Store(tmp_path / "st", create=True)
    res = ingest(st, [here / "trtllm_stats", here / "trtllm_moe_load_balancer.yaml"])
    assert res[0].rows["placement"] == 40
    # 4 ranks x 8 iterations x 32 tokens, rank 3 idle once, top-2, 2 layers
    assert st.sql("SELECT sum(tokens) AS t FROM expert_load")["t"][0] == (4 * 8 - 1) * 32 * 2 * 2


def test_report_on_the_sample(tmp_path, runner, cli):
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "sample_traces"
    ingest(Store(tmp_path / "st", create=True), [here / "trtllm_stats", here / "trtllm_moe_load_balancer.yaml"],
           run_id="trt")
    r = runner.invoke(cli, ["report", str(tmp_path / "st"), "--run", "trt", "--out-dir", str(tmp_path / "rep"), "--quiet"])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "rep" / "report.md").read_text()
    # the sample idles rank 3 in one of 8 iterations: 1 dummy step of 4 x 8 (step, rank) pairs
    assert "1 of 32 (step, rank) pairs were dummy steps" in md
    assert "steps.num_tokens inferred" in md and "Per-layer skew" in md

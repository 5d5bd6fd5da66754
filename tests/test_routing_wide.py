"""Per-token routing in wide form (a row per token, a list column of experts): the
per-layer Parquet shape of public routing datasets, the serving-API shape (token x layer x
top_k), JSONL and Arrow. Expected loads are counted here with numpy from the choices the
test draws, never read back from the collector."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from moetrace.collect import collect, ingest
from moetrace.errors import InputError
from moetrace.run import Store

E, K = 8, 2


def _draw(n, seed):
    rng = np.random.default_rng(seed)
    idx = np.array([rng.choice(E, K, replace=False) for _ in range(n)], np.int16)
    sc = np.sort(rng.random((n, K)), axis=1)[:, ::-1].astype(np.float16)
    return idx, sc


def _per_layer_files(tmp_path, n=24, layers=(0, 1, 2)):
    drawn = {}
    for l in layers:
        idx, sc = _draw(n, l)
        drawn[l] = (idx, sc)
        pq.write_table(pa.table({"indices": pa.array(list(idx), pa.list_(pa.int16())),
                                 "scores": pa.array(list(sc), pa.list_(pa.float16()))}), tmp_path / f"layer_{l}.parquet")
    return drawn, [tmp_path / f"layer_{l}.parquet" for l in layers]


def test_dataset_layout_one_file_per_layer(tmp_path):
    drawn, files = _per_layer_files(tmp_path)
    rd = collect(files, options={"tokens_per_step": 8})[0]
    assert rd.run["collector"] == "routing_wide" and rd.run["top_k"] == K
    r = rd.tables["routing"].to_pandas()
    # row i of layer l's file: token i % 8 of step i // 8, choice j = list position, gate = score (float16)
    for l, (idx, sc) in drawn.items():
        sub = r[r.layer == l].sort_values(["step", "token", "choice"])
        assert sub.expert.tolist() == idx.ravel().tolist()
        np.testing.assert_array_equal(sub.gate.to_numpy(np.float32), sc.astype(np.float32).ravel())
        assert sub.step.tolist() == (np.repeat(np.arange(24), K) // 8).tolist()
    # expert_load is the exact count per (step, layer, expert)
    load = rd.tables["expert_load"].to_pandas().set_index(["step", "layer", "expert"])["tokens"]
    for l, (idx, _) in drawn.items():
        for s in range(3):
            want = np.bincount(idx[s * 8:(s + 1) * 8].ravel(), minlength=E)
            got = [int(load.get((s, l, e), 0)) for e in range(E)]
            assert got == want.tolist() and sum(got) == 8 * K
    approx = json.loads(rd.run["approximations"])
    assert any("layer taken from the file name" in a for a in approx)
    assert any("blocks of 8 tokens" in a for a in approx)


def test_serving_api_shape_token_by_layer_by_k(tmp_path):
    # SGLang / vLLM return [tokens, num_hidden_layers, top_k]; dense layer 0 stays all zeros
    rng = np.random.default_rng(5)
    n, L = 10, 3
    arr = np.zeros((n, L, K), np.int64)
    for t in range(n):
        for l in (1, 2):
            arr[t, l] = rng.choice(E, K, replace=False)
    f = tmp_path / "responses.jsonl"
    f.write_text("".join(json.dumps({"step": t // 5, "token": t % 5, "routed_experts": arr[t].tolist()}) + "\n"
                         for t in range(n)))
    rd = collect([f])[0]
    r = rd.tables["routing"].to_pandas()
    assert sorted(r.layer.unique()) == [1, 2]
    for t in range(n):
        for l in (1, 2):
            got = r[(r.step == t // 5) & (r.token == t % 5) & (r.layer == l)].sort_values("choice").expert.tolist()
            assert got == arr[t, l].tolist()
    assert any("layers 0 hold only expert 0" in a for a in json.loads(rd.run["approximations"]))


def test_arrow_ipc_with_layer_column_and_padding(tmp_path):
    f = tmp_path / "routes.arrow"
    t = pa.table({"step": [0, 0, 1], "layer": [4, 4, 4], "token": [0, 1, 0],
                  "topk_ids": pa.array([[1, 2], [3, -1], [0, 5]], pa.list_(pa.int32()))})
    with ipc.new_file(f, t.schema) as w:
        w.write_table(t)
    rd = collect([f])[0]
    load = sorted(tuple(d.values()) for d in rd.tables["expert_load"].select(["step", "layer", "expert", "tokens"])
                  .to_pylist())
    assert load == [(0, 4, 1, 1), (0, 4, 2, 1), (0, 4, 3, 1), (1, 4, 0, 1), (1, 4, 5, 1)]
    assert any("padding" in a for a in json.loads(rd.run["approximations"]))


@pytest.mark.parametrize("rows, msg, where", [
    ([[1, 1]], "names expert 1 twice", "row 1"),
    ([[1, 2], [3, -4]], "expert id -4 is negative", "row 2"),
    ([[1, 2], None], r"empty \(null\) list", "row 2"),
])
def test_bad_rows_are_refused_with_the_row(tmp_path, rows, msg, where):
    f = tmp_path / "layer_3.parquet"
    pq.write_table(pa.table({"indices": pa.array(rows, pa.list_(pa.int16()))}), f)
    with pytest.raises(InputError, match=msg) as e:
        collect([f])
    assert e.value.position == where and e.value.file == str(f)


def test_no_layer_anywhere(tmp_path):
    f = tmp_path / "routes.parquet"
    pq.write_table(pa.table({"indices": pa.array([[1, 2]], pa.list_(pa.int16()))}), f)
    with pytest.raises(InputError, match="no layer column and no layer number"):
        collect([f])


def test_skew_and_replay_recorded_on_wide_routing(tmp_path, runner, cli):
    drawn, files = _per_layer_files(tmp_path, n=32, layers=(0, 1))
    st = Store(tmp_path / "st", create=True)
    ingest(st, files, options={"tokens_per_step": 16, "num_ranks": 4, "ranks_per_node": 4})
    # contiguous placement: expert e on rank e // 2
    sk = st.sql("SELECT step, layer, imbalance FROM layer_skew ORDER BY step, layer")
    for s, l, imb in sk.iter_rows():
        rank = np.bincount(drawn[l][0][s * 16:(s + 1) * 16].ravel() // 2, minlength=4)
        assert imb == pytest.approx(rank.max() / rank.mean())
    r = runner.invoke(cli, ["skew", str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["replay", str(tmp_path / "st"), "--plan", "recorded", "--json"])
    assert r.exit_code == 0, r.output
    rid = json.loads(r.output)["replay_id"]
    lay = Store(tmp_path / "st").sql("SELECT step, layer, imbalance FROM replay_layer WHERE replay_id = ? "
                                     "ORDER BY step, layer", [rid])
    assert np.allclose(lay["imbalance"].to_numpy(), sk["imbalance"].to_numpy())


def test_sample_ingests(tmp_path):
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "sample_traces" / "routing_wide"
    st = Store(tmp_path / "st", create=True)
    ingest(st, [here], options={"tokens_per_step": 64})
    # conservation on the sample: every (step, layer) holds 64 tokens x top-2
    df = st.sql("SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL")
    assert set(df["t"].to_list()) == {128}
    assert st.sql("SELECT count(*) AS n FROM routing")["n"][0] == 2 * 256 * 2


def _b64_int32(a):
    import base64

    return base64.b64encode(np.ascontiguousarray(a, "<i4").tobytes()).decode()


def _b64_npy(a):
    import base64
    import io

    buf = io.BytesIO()
    np.save(buf, a.astype(np.uint8), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _seq(rng, n, L=3):
    a = np.zeros((n, L, K), np.int64)           # layer 0 dense: zeros, as the engines' buffers leave it
    for t in range(n):
        for l in range(1, L):
            a[t, l] = rng.choice(E, K, replace=False)
    return a


def test_sglang_and_vllm_responses(tmp_path):
    rng = np.random.default_rng(9)
    s1, s2, v1 = _seq(rng, 5), _seq(rng, 7), _seq(rng, 4)
    sg = tmp_path / "sglang_responses.jsonl"
    # SGLang /generate: base64 int32 [prompt + completion - 1, layers, k]; a batch answer is a list
    sg.write_text(json.dumps({"text": "x", "meta_info": {"prompt_tokens": 4, "completion_tokens": 2,
                                                          "routed_experts": _b64_int32(s1)}}) + "\n"
                  + json.dumps([{"meta_info": {"prompt_tokens": 3, "completion_tokens": 5,
                                               "routed_experts": _b64_int32(s2)}}]) + "\n")
    rd = collect([sg], options={"top_k": K})[0]
    r = rd.tables["routing"].to_pandas()
    assert sorted(r.layer.unique()) == [1, 2] and sorted(r.step.unique()) == [0, 1]
    for step, a in ((0, s1), (1, s2)):
        for t in range(a.shape[0]):
            for l in (1, 2):
                got = r[(r.step == step) & (r.token == t) & (r.layer == l)].sort_values("choice").expert.tolist()
                assert got == a[t, l].tolist()
    load = rd.tables["expert_load"].to_pandas()
    assert load[load.step == 1].tokens.sum() == 7 * 2 * K      # 7 tokens x 2 MoE layers x top-k
    vl = tmp_path / "vllm_responses.jsonl"
    vl.write_text(json.dumps({"choices": [{"index": 0, "text": "y", "routed_experts": _b64_npy(v1)}]}) + "\n")
    r = collect([vl])[0].tables["routing"].to_pandas()
    assert r[(r.token == 3) & (r.layer == 2)].sort_values("choice").expert.tolist() == v1[3, 2].tolist()


def test_sglang_response_without_top_k(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"meta_info": {"routed_experts": _b64_int32(np.zeros((2, 2, 2)))}}) + "\n")
    with pytest.raises(InputError, match="give --top-k") as e:
        collect([f])
    assert e.value.position == "line 1 meta_info"


def test_layers_with_different_token_counts_are_said(tmp_path):
    for l, n in ((0, 10), (1, 12)):
        idx, _ = _draw(n, l)
        pq.write_table(pa.table({"indices": pa.array(list(idx), pa.list_(pa.int16()))}), tmp_path / f"layer_{l}.parquet")
    rd = collect([tmp_path / "layer_0.parquet", tmp_path / "layer_1.parquet"])[0]
    approx = json.loads(rd.run["approximations"])
    assert any("1 steps have different token counts in different layers (first: step 0)" in a for a in approx)
    load = rd.tables["expert_load"].to_pandas().groupby("layer").tokens.sum().to_dict()
    assert load == {0: 10 * K, 1: 12 * K}


from hypothesis import given, settings
from hypothesis import strategies as hst


@settings(max_examples=20, deadline=None, derandomize=True)
@given(hst.lists(hst.lists(hst.integers(-1, 11), min_size=1, max_size=4, unique=True), min_size=1, max_size=40),
       hst.integers(1, 7))
def test_load_is_the_count_of_the_lists(lists, tps):
    """Any rows of distinct ids (-1 = padding): expert_load per (step, layer, expert) equals a
    plain Python count over the kept entries."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    if all(x == -1 for row in lists for x in row):
        return
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "layer_2.parquet"
        pq.write_table(pa.table({"experts": pa.array(lists, pa.list_(pa.int32()))}), f)
        rd = collect([f], options={"tokens_per_step": tps})[0]
    want = Counter((i // tps, 2, e) for i, row in enumerate(lists) for e in row if e != -1)
    got = {(d["step"], d["layer"], d["expert"]): d["tokens"] for d in rd.tables["expert_load"].to_pylist()}
    assert got == dict(want)


def test_shards_of_one_layer_continue_each_other(tmp_path):
    a, _ = _draw(5, 1)
    b, _ = _draw(3, 2)
    for name, idx in (("layer_3-00000.parquet", a), ("layer_3-00001.parquet", b)):
        pq.write_table(pa.table({"indices": pa.array(list(idx), pa.list_(pa.int16()))}), tmp_path / name)
    rd = collect([tmp_path / "layer_3-00001.parquet", tmp_path / "layer_3-00000.parquet"], options={"tokens_per_step": 4})[0]
    r = rd.tables["routing"].to_pandas().sort_values(["step", "token", "choice"])
    # rows 0-4 from the first shard (name order), 5-7 from the second: steps of 4 tokens
    assert r.expert.tolist() == np.concatenate([a, b]).ravel().tolist()
    assert (r.step * 4 + r.token).tolist() == np.repeat(np.arange(8), K).tolist()

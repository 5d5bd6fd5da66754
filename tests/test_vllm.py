"""vLLM EPLB expert load in the documented layouts: [layers, physical] per pass and
[window, layers, physical] windows, as .pt, .npz and .npy."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moetrace.collect import collect, ingest
from moetrace.errors import InputError
from moetrace.run import Store

L, P, E = 3, 10, 8   # 2 redundant slots


def _logical(counts: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """[..., L, P] per-slot counts -> [..., L, E] by hand."""
    out = np.zeros(counts.shape[:-1] + (E,), np.int64)
    for layer in range(L):
        for s in range(P):
            out[..., layer, p2l[layer, s]] += counts[..., layer, s]
    return out


def _dense(tbl, steps):
    t = tbl.to_pydict()
    out = np.zeros((steps, L, E), np.int64)
    np.add.at(out, (t["step"], t["layer"], t["expert"]), t["tokens"])
    return out


def test_npy_pass_without_map_uses_initial_map(tmp_path):
    rng = np.random.default_rng(0)
    load = rng.integers(0, 50, size=(L, P)).astype(np.int32)
    p = tmp_path / "expert_load_pass_step100.npy"
    np.save(p, load)
    rd = collect([p], options={"num_experts": E})[0]
    init = np.array([[s % E for s in range(P)]] * L)
    np.testing.assert_array_equal(_dense(rd.tables["expert_load"], 1)[0], _logical(load, init))
    t = rd.tables["expert_load"].to_pydict()
    for _layer, slot, e in zip(t["layer"], t["slot"], t["expert"]):
        assert e == slot % E
    assert "initial map" in rd.run["approximations"] and rd.run["num_slots"] == P


def test_pt_window_with_map_ring_order_and_placement(tmp_path):
    torch = pytest.importorskip("torch", reason="vLLM .pt files need PyTorch")
    rng = np.random.default_rng(1)
    W = 4
    win = rng.integers(0, 20, size=(W, L, P)).astype(np.int32)
    p2l = np.stack([rng.permutation(np.r_[np.arange(E), [0, 1]]) for _ in range(L)])
    p = tmp_path / "eplb_state.pt"
    # a wrapped ring of 4 whose next write goes to row 2: row 2 is the oldest
    torch.save({"expert_load_window": torch.from_numpy(win), "physical_to_logical_map": torch.from_numpy(p2l),
                "expert_load_window_step": 2}, p)
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [p], options={"num_ranks": 2})[0].run_id
    got = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    dense = np.zeros((W, L, E), np.int64)
    np.add.at(dense, (got["step"].to_numpy(), got["layer"].to_numpy(), got["expert"].to_numpy()),
              got["tokens"].to_numpy())
    ordered = win[[2, 3, 0, 1]]
    np.testing.assert_array_equal(dense, _logical(ordered, p2l))
    pl_rows = st.sql("SELECT layer, slot, rank, expert FROM placement WHERE run_id = ? ORDER BY layer, slot", [rid])
    assert pl_rows["expert"].to_list() == p2l.ravel().tolist()
    assert pl_rows["rank"].to_list() == [s // 5 for s in range(P)] * L


def test_npz_dp_size_divides(tmp_path):
    rng = np.random.default_rng(2)
    load = rng.integers(0, 30, size=(L, P)) * 4
    p = tmp_path / "load.npz"
    np.savez(p, expert_load_pass=load)
    rd = collect([p], options={"num_experts": E, "dp_size": 4})[0]
    assert sum(rd.tables["expert_load"].column("tokens").to_pylist()) == load.sum() // 4
    assert "dp_size=4" in rd.run["approximations"]
    with pytest.raises(InputError, match="not divisible by 3"):
        collect([p], options={"num_experts": E, "dp_size": 3})


def test_map_shape_disagrees(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, expert_load_pass=np.ones((L, P), np.int32), physical_to_logical_map=np.zeros((L, P - 1), np.int64))
    with pytest.raises(InputError, match="disagrees with physical_to_logical_map"):
        collect([p])


def test_negative_and_float_counts(tmp_path):
    p = tmp_path / "neg_expert_load.npy"
    a = np.ones((L, P), np.int32)
    a[1, 2] = -1
    np.save(p, a)
    with pytest.raises(InputError, match="negative"):
        collect([p])
    q = tmp_path / "float_expert_load.npy"
    np.save(q, np.full((L, P), 0.5))
    with pytest.raises(InputError, match="non-integer"):
        collect([q])


def test_object_npy_is_refused(tmp_path):
    p = tmp_path / "obj_expert_load.npy"
    np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="cannot read"):
        collect([p])


def test_meta_records_format(tmp_path):
    p = tmp_path / "x_expert_load.npy"
    np.save(p, np.ones((2, L, P), np.int32))
    rd = collect([p], options={"num_experts": E})[0]
    meta = json.loads(rd.run["meta_json"])
    assert meta["table"] == "window" and rd.run["collector"] == "vllm"
    assert "ring order unknown" in rd.run["approximations"]


def test_unwrapped_window_drops_unfilled_rows(tmp_path):
    win = np.zeros((5, L, P), np.int32)
    win[0], win[1] = 3, 4  # two passes written, next write at row 2; rows 2-4 unfilled
    p = tmp_path / "w.npz"
    np.savez(p, expert_load_window=win, expert_load_window_step=np.array(2))
    rd = collect([p], options={"num_experts": E})[0]
    t = rd.tables["expert_load"].to_pydict()
    assert sorted(set(t["step"])) == [0, 1]
    assert sum(tok for s, tok in zip(t["step"], t["tokens"]) if s == 1) == 4 * L * P
    assert "3 leading all-zero window rows" in rd.run["approximations"]


def test_sum_ranks(tmp_path):
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 9, size=(L, P)), rng.integers(0, 9, size=(L, P))
    pa_, pb = tmp_path / "r0.npz", tmp_path / "r1.npz"
    np.savez(pa_, expert_load_pass=a)
    np.savez(pb, expert_load_pass=b)
    rds = collect([pa_, pb], options={"num_experts": E, "sum_ranks": True})
    assert len(rds) == 1
    dense = _dense(rds[0].tables["expert_load"], 1)[0]
    np.testing.assert_array_equal(dense, _logical(a + b, np.array([[s % E for s in range(P)]] * L)))
    assert len(collect([pa_, pb], options={"num_experts": E})) == 2

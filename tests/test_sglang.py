"""SGLang expert-distribution dumps, built at run time in the documented layouts
(docs/reference/formats.md) with torch.save, plus the real logical_count JSON files in ../shared/data."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from moetrace.collect import collect, ingest
from moetrace.errors import InputError
from moetrace.run import Store

from .helpers import shared_data, tree_hash


def _torch():
    return pytest.importorskip("torch", reason="SGLang .pt dumps need PyTorch (pip install 'moetrace[torch]')")


# ----------------------------------------------------------------------------- real JSON
@pytest.mark.parametrize("name", ["prefill_in512.json", "decode_in1000out1000.json"])
def test_real_logical_count_json(tmp_path, name):
    path = shared_data("sglang_dsv3_expert_counts", name)
    lc = np.asarray(json.loads(path.read_text())["logical_count"], np.int64)
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [path])[0].run_id
    run = st.run_row(rid)
    assert (run["num_layers"], run["num_experts"], run["collector"]) == (61, 256, "sglang")
    approx = " ".join(json.loads(run["approximations"]))
    assert "pseudo-step" in approx and "0-2" in approx
    got = st.sql("SELECT layer, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    dense = np.zeros_like(lc)
    dense[got["layer"].to_numpy(), got["expert"].to_numpy()] = got["tokens"].to_numpy()
    np.testing.assert_array_equal(dense, lc)
    assert st.sql("SELECT DISTINCT step FROM expert_load WHERE run_id = ?", [rid])["step"].to_list() == [0]
    # dense layers 0-2 carry nothing; every MoE layer routes the same 8 x tokens
    assert lc[:3].sum() == 0
    per_layer = st.sql("SELECT layer, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY layer", [rid])
    assert set(per_layer["layer"].to_list()) == set(range(3, 61))
    assert len(set(per_layer["t"].to_list())) == 1 and per_layer["t"][0] % 8 == 0


# ----------------------------------------------------------------------------- stat
def test_stat_ring_buffer_drops_unfilled_rows(tmp_path):
    torch = _torch()
    rng = np.random.default_rng(0)
    buf = np.zeros((7, 3, 4), np.int32)
    buf[:5] = rng.integers(0, 9, size=(5, 3, 4))
    buf[2] = 0  # an idle pass inside the recorded range stays a step
    buf[4, 0, 0] = 5
    p = tmp_path / "expert_distribution_recorder_1700000000.123.pt"
    torch.save({"rank": 0, "logical_count": torch.from_numpy(buf), "average_utilization_rate_over_window": 0.7}, p)
    rd = collect([p])[0]
    t = rd.tables["expert_load"].to_pydict()
    assert set(t["step"]) == {0, 1, 3, 4}  # zero row 2 has no rows, rows 5-6 dropped
    got = np.zeros((5, 3, 4), np.int64)
    got[t["step"], t["layer"], t["expert"]] = t["tokens"]
    np.testing.assert_array_equal(got, buf[:5])
    approx = " ".join(json.loads(rd.run["approximations"]))
    assert "2 unfilled trailing rows dropped" in approx and "1 all-zero rows" in approx
    assert json.loads(rd.run["meta_json"])["average_utilization_rate_over_window"] == 0.7


def test_stat_full_ring_is_flagged(tmp_path):
    torch = _torch()
    p = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": torch.ones(3, 2, 4, dtype=torch.int32)}, p)
    rd = collect([p])[0]
    assert "rotated" in rd.run["approximations"]
    assert sum(rd.tables["expert_load"].column("tokens").to_pylist()) == 24


# ----------------------------------------------------------------------------- per_pass / per_token
L_, E_, P_, R_ = 2, 4, 6, 2
P2L = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 2]])  # 2 redundant slots per layer


def _per_pass_files(tmp_path, torch, counts, extra=None):
    """counts[rank][pass] -> [L, P] array; writes one file per rank."""
    paths = []
    for rank, passes in counts.items():
        recs = []
        for fpid, c in passes.items():
            rec = {"forward_pass_id": fpid, "rank": rank, "gatherer_key": "primary",
                   "global_physical_count": torch.from_numpy(np.asarray(c, np.int32))}
            if extra:
                rec.update(extra(rank, fpid))
            recs.append(rec)
        p = tmp_path / f"expert_distribution_recorder_1700000000.5_{rank}.pt"
        torch.save({"records": recs, "last_physical_to_logical_map": torch.from_numpy(P2L)}, p)
        paths.append(p)
    return paths


def test_per_pass_sums_ranks_maps_slots_and_records_placement(tmp_path):
    torch = _torch()
    rng = np.random.default_rng(1)

    def pass_counts(n):  # n tokens, 2 distinct slots each, in every layer
        c = np.zeros((L_, P_), int)
        for layer in range(L_):
            for _ in range(n):
                c[layer, rng.choice(P_, 2, replace=False)] += 1
        return c

    ntok = {(r, f): int(rng.integers(1, 9)) for r in range(R_) for f in (10, 11, 12)}
    ntok[(1, 11)] = 0  # rank 1 idle in pass 11
    counts = {r: {f: pass_counts(ntok[(r, f)]) for f in (10, 11, 12)} for r in range(R_)}
    paths = _per_pass_files(tmp_path, torch, counts)
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, paths, options={"top_k": 2})[0].run_id
    run = st.run_row(rid)
    assert (run["num_slots"], run["num_experts"], run["num_ranks"]) == (P_, E_, R_)
    # logical load per step: sum over ranks, then over the slots of each expert
    for step, fpid in enumerate((10, 11, 12)):
        tot = counts[0][fpid] + counts[1][fpid]
        want = np.zeros((L_, E_), int)
        for layer in range(L_):
            for s in range(P_):
                want[layer, P2L[layer, s]] += tot[layer, s]
        got = st.sql("SELECT layer, expert, sum(tokens) t FROM expert_load WHERE run_id = ? AND step = ? GROUP BY ALL",
                     [rid, step])
        arr = np.zeros((L_, E_), int)
        arr[got["layer"].to_numpy(), got["expert"].to_numpy()] = got["t"].to_numpy()
        np.testing.assert_array_equal(arr, want)
        # per-rank load exact through the slots: slots 0-2 on rank 0, 3-5 on rank 1
        rk = st.sql("SELECT p.rank, sum(e.tokens) t FROM expert_load e JOIN placement p ON p.run_id = e.run_id "
                    "AND p.layer = e.layer AND p.slot = e.slot AND p.plan_id = 'recorded' WHERE e.run_id = ? "
                    "AND e.step = ? AND e.layer = 1 GROUP BY p.rank ORDER BY p.rank", [rid, step])
        assert rk["t"].to_list() == [int(tot[1, :3].sum()), int(tot[1, 3:].sum())]
    pl_rows = st.sql("SELECT layer, slot, rank, expert FROM placement WHERE run_id = ? ORDER BY layer, slot", [rid])
    assert pl_rows["expert"].to_list() == P2L.ravel().tolist()
    assert pl_rows["rank"].to_list() == [s // 3 for s in range(P_)] * L_
    steps = st.sql("SELECT step, rank, is_dummy, phase, num_tokens FROM steps WHERE run_id = ? ORDER BY step, rank",
                   [rid])
    dummy = {(s, r) for s, r, d, _, _ in steps.iter_rows() if d}
    assert dummy == {(1, 1)}
    # num_tokens = a layer's assignments / top_k
    for s, r, _d, _ph, n in steps.iter_rows():
        assert n == ntok[(r, (10, 11, 12)[s])]


def test_per_token_routing_maps_physical_ids_and_idle_pass(tmp_path):
    torch = _torch()
    rng = np.random.default_rng(2)
    topk = {}

    def extra(rank, fpid):
        if (rank, fpid) == (1, 1):  # IDLE pass on rank 1: no tokens
            t = np.zeros((L_, 0, 8), np.int32)
            mode = 4
        else:
            n = 3 + rank
            t = np.full((L_, n, 8), -1, np.int32)
            t[:, :, :2] = rng.integers(0, P_, size=(L_, n, 2))
            mode = 1 if fpid == 0 else 2
        topk[(rank, fpid)] = t
        return {"topk_ids_of_layer": torch.from_numpy(t), "forward_mode": mode,
                "input_ids": torch.zeros(t.shape[1], dtype=torch.int64)}

    counts = {r: {f: np.zeros((L_, P_), int) for f in (0, 1)} for r in range(R_)}
    paths = _per_pass_files(tmp_path, torch, counts, extra)
    # replace the zero counts by the counts of the ids, as SGLang would record them
    for rank, p in zip(range(R_), paths):
        d = torch.load(p, weights_only=True)
        for rec in d["records"]:
            t = topk[(rank, rec["forward_pass_id"])]
            c = np.zeros((L_, P_), np.int32)
            for layer in range(L_):
                ids = t[layer][t[layer] >= 0]
                np.add.at(c[layer], ids, 1)
            rec["global_physical_count"] = torch.from_numpy(c)
        torch.save(d, p)
    rd = collect(paths)[0]
    r = rd.tables["routing"].to_pydict()
    n_valid = sum(int((t >= 0).sum()) for t in topk.values())
    assert len(r["step"]) == n_valid
    # expert = map[layer, physical], slot kept
    for layer, slot, e in zip(r["layer"], r["slot"], r["expert"]):
        assert e == P2L[layer, slot]
    # token ids unique per step across ranks: rank 1's tokens follow rank 0's
    s0 = [(tok, sr) for st_, lay, tok, sr in zip(r["step"], r["layer"], r["token"], r["src_rank"])
          if st_ == 0 and lay == 0]
    assert sorted({t for t, sr in s0 if sr == 1}) == [3, 4, 5, 6]
    assert rd.run["top_k"] == 2 and set(r["choice"]) == {0, 1}
    steps = rd.tables["steps"].to_pydict()
    rows = {(s, k): (ph, d, n) for s, k, ph, d, n in zip(steps["step"], steps["rank"], steps["phase"],
                                                         steps["is_dummy"], steps["num_tokens"])}
    assert rows[(1, 1)] == ("idle", True, 0)
    assert rows[(0, 0)] == ("prefill", False, 3) and rows[(1, 0)] == ("decode", False, 3)


def test_legacy_csv(tmp_path):
    a = tmp_path / "expert_distribution_rank0_timestamp1712000000.5.csv"
    b = tmp_path / "expert_distribution_rank1_timestamp1712000000.5.csv"
    a.write_text("layer_id,expert_id,count\n0,0,5\n0,3,2\n1,1,4\n")
    b.write_text("layer_id,expert_id,count\n0,0,1\n1,2,7\n")
    rd = collect([a, b])[0]
    t = rd.tables["expert_load"].to_pydict()
    rows = sorted(zip(t["layer"], t["expert"], t["src_rank"], t["tokens"]))
    assert rows == [(0, 0, 0, 5), (0, 0, 1, 1), (0, 3, 0, 2), (1, 1, 0, 4), (1, 2, 1, 7)]
    assert rd.run["num_ranks"] == 2 and rd.run["collector"] == "sglang"


# ----------------------------------------------------------------------------- bad input
def test_pickle_with_code_is_refused_and_store_unchanged(tmp_path, runner, cli):
    torch = _torch()
    import argparse

    p = tmp_path / "expert_distribution_recorder_1.pt"
    # an arbitrary class is not on torch's weights_only allow-list
    torch.save({"logical_count": torch.ones(2, 2, 2, dtype=torch.int32),
                "extra": argparse.Namespace(a=1)}, p)
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(st)])
    assert res.exit_code == 2
    assert "weights_only" in res.output and "argparse.Namespace" in res.output and p.name in res.output
    assert tree_hash(st) == before


def test_shape_disagrees_with_map(tmp_path):
    torch = _torch()
    p = tmp_path / "expert_distribution_recorder_1_0.pt"
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
                             "global_physical_count": torch.zeros(2, 5, dtype=torch.int32)}],
                "last_physical_to_logical_map": torch.from_numpy(P2L)}, p)
    with pytest.raises(InputError, match="disagrees with last_physical_to_logical_map"):
        collect([p])


def test_truncated_dump(tmp_path):
    torch = _torch()
    p = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"logical_count": torch.ones(4, 2, 2, dtype=torch.int32)}, p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="truncated"):
        collect([p])


def test_physical_id_out_of_range(tmp_path):
    torch = _torch()
    t = np.full((L_, 2, 8), -1, np.int32)
    t[:, :, 0] = 9
    p = tmp_path / "expert_distribution_recorder_1_0.pt"
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
                             "topk_ids_of_layer": torch.from_numpy(t), "forward_mode": 2}],
                "last_physical_to_logical_map": torch.from_numpy(P2L)}, p)
    with pytest.raises(InputError, match="physical id 9 outside"):
        collect([p])


def test_without_torch_the_error_says_how_to_install(tmp_path, monkeypatch):
    p = tmp_path / "expert_distribution_recorder_1.pt"
    p.write_bytes(b"PK\x03\x04" + b"\x00" * 26 + b"x/data.pkl" + b"logical_count" + b"\x00" * 100)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(InputError, match=r"pip install 'moetrace\[torch\]'") as ei:
        collect([p])
    assert p.name in str(ei.value)

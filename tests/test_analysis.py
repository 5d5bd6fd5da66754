"""Analysis views checked against independent numpy computations on the raw rows.

The reference functions below work on dense numpy arrays built from expert_load rows
and use different formulas from the SQL (Gini from the mean absolute difference, median
from np.median over all experts, rank loads from bincount / explicit loops).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import Store

from .helpers import module_fixture, run_row


# ----------------------------------------------------------------------------- reference
def dense_loads(st: Store, run_id: str, E: int):
    """{(step, layer): tokens[E]} from the raw expert_load rows (summed over slots)."""
    df = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ?", [run_id])
    out: dict[tuple[int, int], np.ndarray] = {}
    for s, l, e, t in df.iter_rows():
        out.setdefault((s, l), np.zeros(E, dtype=np.float64))[e] += t
    return out


def gini_mad(x: np.ndarray) -> float:
    """Gini as mean absolute difference over 2 * mean (no sorting)."""
    n = len(x)
    return float(np.abs(x[:, None] - x[None, :]).sum() / (2 * n * n * x.mean()))


def ref_metrics(x: np.ndarray, rank_of_expert: np.ndarray, R: int) -> dict:
    ranks = np.zeros(R)
    for e, t in enumerate(x):
        ranks[rank_of_expert[e]] += t
    E = len(x)
    n_top = max(1, math.ceil(0.05 * E))
    return {
        "max_rank_tokens": ranks.max(),
        "mean_rank_tokens": ranks.mean(),
        "imbalance": ranks.max() / ranks.mean(),
        "efficiency": ranks.mean() / ranks.max(),
        "straggler_rank": int(np.argmax(ranks)),
        "gini": gini_mad(x),
        "cv": float(np.std(x) / np.mean(x)),
        "top5pct_share": float(np.sort(x)[::-1][:n_top].sum() / x.sum()),
        "hottest_expert": int(np.argmax(x)),
        "hottest_share": float(x.max() / x.sum()),
    }


def skew_rows(st: Store, run_id: str) -> dict:
    df = st.sql("SELECT * FROM layer_skew WHERE run_id = ? ORDER BY step, layer", [run_id])
    return {(r["step"], r["layer"]): r for r in df.iter_rows(named=True)}


def write(st: Store, run: dict, load: dict, **tables) -> str:
    base = run_row(source=run.pop("source", "test"))
    base.update(run)
    return st.write_run(base, {"expert_load": load, **tables}, run_id=run.get("run_id", "r")).run_id


def load_table(rows: list[tuple]) -> dict:
    """rows of (step, layer, expert, tokens[, slot])"""
    cols = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for r in rows:
        cols["step"].append(r[0])
        cols["layer"].append(r[1])
        cols["expert"].append(r[2])
        cols["tokens"].append(r[3])
        cols["slot"].append(r[4] if len(r) > 4 else None)
        cols["src_rank"].append(None)
    return cols


METRICS = ["max_rank_tokens", "mean_rank_tokens", "imbalance", "efficiency", "gini", "cv",
           "top5pct_share", "hottest_share"]


def assert_row_matches(row: dict, ref: dict):
    for k in METRICS:
        assert row[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), k
    assert row["straggler_rank"] == ref["straggler_rank"]
    assert row["hottest_expert"] == ref["hottest_expert"]


# ----------------------------------------------------------------------------- synthetic run
@module_fixture
def small_synth(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("an") / "st", create=True)
    cfg = SynthConfig(layers=3, experts=64, top_k=4, ranks=8, ranks_per_node=4, steps=12, tokens_per_step=300,
                      sigma=0.8, seed=3, dummy_share=0.25)
    rid = synth(st, cfg).run_id
    return st, rid, cfg


def test_layer_skew_matches_numpy_on_synthetic_run(small_synth):
    st, rid, cfg = small_synth
    loads = dense_loads(st, rid, cfg.experts)
    rows = skew_rows(st, rid)
    assert set(rows) == set(loads) and len(rows) == cfg.steps * cfg.layers
    contiguous = np.arange(cfg.experts) // (cfg.experts // cfg.ranks)
    for key, x in loads.items():
        assert_row_matches(rows[key], ref_metrics(x, contiguous, cfg.ranks))
        assert rows[key]["placement_source"] == "contiguous"
        assert rows[key]["note"] is None


def test_rank_load_is_dense_and_conserves_tokens(small_synth):
    st, rid, cfg = small_synth
    rl = st.sql("SELECT step, layer, rank, tokens FROM rank_load WHERE run_id = ? ORDER BY step, layer, rank", [rid])
    assert rl.height == cfg.steps * cfg.layers * cfg.ranks
    loads = dense_loads(st, rid, cfg.experts)
    per = cfg.experts // cfg.ranks
    for (s, l), x in loads.items():
        got = rl.filter((rl["step"] == s) & (rl["layer"] == l))["tokens"].to_numpy()
        np.testing.assert_allclose(got, x.reshape(cfg.ranks, per).sum(axis=1))


def test_tokens_per_expert_matches_numpy(small_synth):
    st, rid, cfg = small_synth
    loads = dense_loads(st, rid, cfg.experts)
    df = st.sql("SELECT * FROM tokens_per_expert WHERE run_id = ?", [rid])
    assert df.height == len(loads)
    E, k = cfg.experts, cfg.top_k
    for r in df.iter_rows(named=True):
        x = loads[(r["step"], r["layer"])]
        B = x.sum() / k
        assert B == cfg.tokens_per_step
        assert r["tokens"] == pytest.approx(B)
        assert r["experts_hit"] == int((x > 0).sum())
        assert r["experts_hit_expected"] == pytest.approx(E * (1 - (1 - k / E) ** B))
        assert r["per_expert_mean"] == pytest.approx(x.mean())
        assert r["per_expert_min"] == x.min()
        assert r["per_expert_median"] == pytest.approx(np.median(x))
        assert r["per_expert_max"] == x.max()


def test_dummy_steps_matches_steps_rows(small_synth):
    st, rid, cfg = small_synth
    raw = st.sql("SELECT rank, is_dummy, num_tokens FROM steps WHERE run_id = ?", [rid])
    rank = raw["rank"].to_numpy()
    dummy = raw["is_dummy"].to_numpy().astype(int)
    df = st.sql("SELECT * FROM dummy_steps WHERE run_id = ? ORDER BY rank", [rid])
    assert df.height == cfg.ranks
    exp_dummy = np.bincount(rank, weights=dummy, minlength=cfg.ranks)
    np.testing.assert_array_equal(df["steps"].to_numpy(), np.full(cfg.ranks, cfg.steps))
    np.testing.assert_array_equal(df["dummy_steps"].to_numpy(), exp_dummy)
    np.testing.assert_allclose(df["dummy_share"].to_numpy(), exp_dummy / cfg.steps)
    assert exp_dummy.sum() > 0  # the fixture really has dummy steps
    assert df["dummy_time_ns"].null_count() == cfg.ranks  # synth records no step times


def test_summary_quantiles_match_numpy(small_synth):
    st, rid, cfg = small_synth
    rows = skew_rows(st, rid)
    df = st.sql("SELECT * FROM skew_summary WHERE run_id = ? ORDER BY layer", [rid])
    for r in df.iter_rows(named=True):
        imb = np.array([v["imbalance"] for (s, l), v in rows.items() if l == r["layer"]])
        assert r["steps"] == cfg.steps and r["steps_undefined"] == 0
        assert r["imbalance_mean"] == pytest.approx(imb.mean())
        assert r["imbalance_p50"] == pytest.approx(np.percentile(imb, 50))
        assert r["imbalance_p99"] == pytest.approx(np.percentile(imb, 99))
        assert r["imbalance_max"] == pytest.approx(imb.max())
        for col, mode_col in (("hottest_expert", "hottest_expert_mode"), ("straggler_rank", "straggler_rank_mode")):
            vals = np.array([v[col] for (s, l), v in rows.items() if l == r["layer"]])
            counts = np.bincount(vals)
            assert r[mode_col] == int(np.argmax(counts))        # most frequent, lowest id on ties
    run = st.sql("SELECT * FROM run_skew_summary WHERE run_id = ?", [rid]).row(0, named=True)
    allv = np.array([v["imbalance"] for v in rows.values()])
    assert run["imbalance_mean"] == pytest.approx(allv.mean())
    assert run["balancedness"] == pytest.approx(sum(v["mean_rank_tokens"] for v in rows.values())
                                               / sum(v["max_rank_tokens"] for v in rows.values()))
    worst = max(df.iter_rows(named=True), key=lambda r: r["imbalance_mean"])
    assert run["worst_layer"] == worst["layer"]


def test_skew_by_batch_matches_numpy_merging(small_synth):
    st, rid, cfg = small_synth
    loads = dense_loads(st, rid, cfg.experts)
    per = cfg.experts // cfg.ranks
    df = st.sql("SELECT * FROM skew_by_batch WHERE run_id = ? ORDER BY layer, steps_per_batch", [rid])
    ws = sorted(set(df["steps_per_batch"].to_list()))
    assert ws == [1, 2, 4, 8]  # 12 steps: windows 1..8
    for r in df.iter_rows(named=True):
        w, layer = r["steps_per_batch"], r["layer"]
        imbs = []
        for b in range(cfg.steps // w):
            x = sum(loads[(s, layer)] for s in range(b * w, (b + 1) * w))
            ranks = x.reshape(cfg.ranks, per).sum(axis=1)
            imbs.append(ranks.max() / ranks.mean())
        assert r["batches"] == cfg.steps // w
        assert r["imbalance"] == pytest.approx(np.mean(imbs))
        assert r["tokens_per_batch"] == pytest.approx(w * cfg.tokens_per_step)


# ----------------------------------------------------------------------------- seed physics
def _structural_from_popularity(p: np.ndarray, R: int) -> float:
    ranks = p.reshape(R, -1).sum(axis=1)
    return float(ranks.max() / ranks.mean())


def test_seed_physics_lognormal_structural_skew_independent_numpy():
    """sigma 0.6, 256 experts, 32 contiguous ranks: max/mean of the expected rank load is
    about 1.4-1.7 (pure numpy, no moetrace code)."""
    rng = np.random.default_rng(12345)
    vals = []
    for _ in range(400):
        w = np.exp(0.6 * rng.standard_normal(256))
        vals.append(_structural_from_popularity(w / w.sum(), 32))
    assert 1.4 <= np.median(vals) <= 1.7
    assert 1.35 <= np.mean(vals) <= 1.7


@module_fixture
def physics_runs(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("phys") / "st", create=True)
    out = {}
    for B, T in ((32, 32), (8192, 8)):
        cfg = SynthConfig(layers=4, experts=256, top_k=8, ranks=32, steps=T, tokens_per_step=B, sigma=0.6, seed=7)
        out[B] = synth(st, cfg, run_id=f"b{B}").run_id
    return st, out


def test_structural_skew_plateau_on_synthetic_runs(physics_runs):
    st, runs = physics_runs
    truth = st.sql("SELECT layer, expert, p_start FROM true_popularity WHERE run_id = 'b8192' ORDER BY layer, expert")
    p = truth["p_start"].to_numpy().reshape(4, 256)
    # same seed: same popularity in both runs
    p2 = st.sql("SELECT p_start FROM true_popularity WHERE run_id = 'b32' ORDER BY layer, expert")["p_start"].to_numpy()
    np.testing.assert_array_equal(p.ravel(), p2)
    true_struct = np.array([_structural_from_popularity(p[l], 32) for l in range(4)])
    assert 1.4 <= true_struct.mean() <= 1.7
    # what top-8 of 256 without replacement makes of it: each expert's inclusion share
    # (an expert is picked at most once per token, so hot experts get a bit less than k*p),
    # by an independent numpy exponential race over 100,000 tokens per layer
    rng = np.random.default_rng(2024)
    incl = np.empty_like(p)
    for l in range(4):
        keys = rng.standard_exponential((100_000, 256)) / p[l]
        incl[l] = np.bincount(np.argpartition(keys, 7, axis=1)[:, :8].ravel(), minlength=256)
    expect_struct = np.array([_structural_from_popularity(incl[l] / incl[l].sum(), 32) for l in range(4)])

    dec = {B: st.sql("SELECT * FROM skew_decomposition WHERE run_id = ? ORDER BY layer", [rid])
           for B, rid in runs.items()}
    big = dec[8192]
    # thousands of tokens per step: the measured structural skew is that of the inclusion
    # shares, within a few percent of the popularity's own
    np.testing.assert_allclose(big["structural_imbalance"].to_numpy(), true_struct, rtol=0.05)
    np.testing.assert_allclose(big["structural_imbalance"].to_numpy(), expect_struct, rtol=0.02)
    assert 1.4 <= big["structural_imbalance"].mean() <= 1.7
    # small batches: more imbalance per step (sampling noise) ...
    small = dec[32]
    assert (small["imbalance_mean"].to_numpy() > big["imbalance_mean"].to_numpy() + 0.1).all()
    # ... but the larger batch does not go below the structural skew of what top-k without
    # replacement makes of the popularity (the inclusion shares): sampling excess is small
    assert (big["sampling_excess"].to_numpy() < 0.05).all()
    assert (big["imbalance_mean"].to_numpy() > expect_struct - 0.02).all()
    # merging the small run's steps walks imbalance down toward the plateau
    sb = st.sql("SELECT layer, steps_per_batch, imbalance FROM skew_by_batch WHERE run_id = ? ORDER BY layer, "
                "steps_per_batch", [runs[32]])
    # (all 32 steps merged: 32*32*8 assignments, 256 per rank on average, so the hottest
    # rank's count has a Poisson spread of 1/sqrt(256*structural): it stays within 3 of
    # those below the plateau)
    for layer in range(4):
        imb = sb.filter(sb["layer"] == layer)["imbalance"].to_numpy()
        floor = expect_struct[layer] * (1 - 3 / np.sqrt(256 * expect_struct[layer]))
        assert imb[0] > imb[-1] > floor


# ----------------------------------------------------------------------------- edge cases
def test_one_expert_takes_everything(tmp_path):
    st = Store(tmp_path / "st", create=True)
    E, R = 8, 4
    rows = [(0, 0, e, 800 if e == 3 else 0) for e in range(E)]
    rid = write(st, {"num_experts": E, "num_ranks": R, "top_k": 1}, load_table(rows))
    r = skew_rows(st, rid)[(0, 0)]
    assert r["imbalance"] == pytest.approx(R)             # all on one rank: max/mean = R
    assert r["efficiency"] == pytest.approx(1 / R)
    assert r["straggler_rank"] == 3 // (E // R)
    assert r["gini"] == pytest.approx((E - 1) / E)        # the finite-n maximum
    assert r["cv"] == pytest.approx(math.sqrt(E - 1))
    assert r["hottest_expert"] == 3 and r["hottest_share"] == 1.0 and r["top5pct_share"] == 1.0
    t = st.sql("SELECT * FROM tokens_per_expert").row(0, named=True)
    assert t["experts_hit"] == 1 and t["per_expert_median"] == 0 and t["per_expert_max"] == 800


def test_all_zero_step_is_null_with_reason_and_skipped_in_summary(tmp_path):
    st = Store(tmp_path / "st", create=True)
    E, R = 8, 4
    rows = [(s, 0, e, 0 if s == 1 else (e + 1) * 10) for s in range(3) for e in range(E)]
    rid = write(st, {"num_experts": E, "num_ranks": R, "top_k": 2}, load_table(rows))
    rows_ = skew_rows(st, rid)
    z = rows_[(1, 0)]
    for k in ("imbalance", "efficiency", "straggler_rank", "gini", "cv", "top5pct_share", "hottest_expert",
              "hottest_share"):
        assert z[k] is None, k
    assert "no tokens" in z["note"]
    x = np.arange(1, E + 1) * 10.0
    ranks = x.reshape(R, -1).sum(axis=1)
    s = st.sql("SELECT * FROM skew_summary").row(0, named=True)
    assert s["steps"] == 3 and s["steps_undefined"] == 1
    assert s["imbalance_mean"] == pytest.approx(ranks.max() / ranks.mean())
    assert not any(isinstance(v, float) and math.isnan(v) for v in s.values())
    t = st.sql("SELECT * FROM tokens_per_expert WHERE step = 1").row(0, named=True)
    assert t["experts_hit"] == 0 and t["experts_hit_expected"] == 0 and t["per_expert_max"] == 0


def test_one_rank_has_no_imbalance(tmp_path):
    st = Store(tmp_path / "st", create=True)
    rows = [(0, 0, e, t) for e, t in enumerate([5, 0, 100, 7])]
    rid = write(st, {"num_experts": 4, "num_ranks": 1, "top_k": 1}, load_table(rows))
    r = skew_rows(st, rid)[(0, 0)]
    assert r["imbalance"] == 1.0 and r["straggler_rank"] == 0 and r["max_rank_tokens"] == 112
    assert r["gini"] == pytest.approx(gini_mad(np.array([5, 0, 100, 7.0])))


def test_one_expert_per_rank(tmp_path):
    st = Store(tmp_path / "st", create=True)
    x = np.array([3, 9, 1, 9, 0, 2], dtype=float)
    rows = [(0, 2, e, int(t)) for e, t in enumerate(x)]
    rid = write(st, {"num_experts": 6, "num_ranks": 6, "top_k": 2}, load_table(rows))
    r = skew_rows(st, rid)[(0, 2)]
    assert_row_matches(r, ref_metrics(x, np.arange(6), 6))
    assert r["straggler_rank"] == 1 and r["hottest_expert"] == 1   # ties: lowest id


def test_missing_experts_count_as_zero(tmp_path):
    """Sparse sources omit experts with no tokens: they must still count in gini/median/min."""
    st = Store(tmp_path / "st", create=True)
    E, R = 16, 4
    x = np.zeros(E)
    x[[0, 5, 6, 13]] = [40, 3, 8, 1]
    rows = [(0, 0, e, int(x[e])) for e in np.flatnonzero(x)]
    rid = write(st, {"num_experts": E, "num_ranks": R, "top_k": 1}, load_table(rows))
    assert_row_matches(skew_rows(st, rid)[(0, 0)], ref_metrics(x, np.arange(E) // 4, R))
    t = st.sql("SELECT * FROM tokens_per_expert").row(0, named=True)
    assert t["per_expert_min"] == 0 and t["per_expert_median"] == np.median(x)
    assert t["per_expert_mean"] == pytest.approx(x.mean())
    assert st.sql("SELECT count(*) AS n FROM rank_load")["n"][0] == R


def test_unknown_num_ranks_skips_rank_metrics_visibly(tmp_path):
    st = Store(tmp_path / "st", create=True)
    x = np.array([4, 1, 0, 7, 2, 2, 9, 3], dtype=float)
    rows = [(0, 0, e, int(t)) for e, t in enumerate(x)]
    rid = write(st, {"num_experts": None, "num_ranks": None, "top_k": 2}, load_table(rows))
    r = skew_rows(st, rid)[(0, 0)]
    assert r["imbalance"] is None and r["max_rank_tokens"] is None and r["straggler_rank"] is None
    assert r["placement_source"] == "none" and "num_ranks unknown" in r["note"]
    assert r["gini"] == pytest.approx(gini_mad(x))          # expert metrics still there (E inferred = 8)
    assert st.sql("SELECT count(*) AS n FROM rank_load")["n"][0] == 0
    assert st.sql("SELECT experts_from FROM run_shape").item() == "max expert id + 1"


def test_slot_counts_map_ranks_exactly(tmp_path):
    """Per-slot counts (vLLM/SGLang per_pass): rank = slot // slots_per_rank, no even split."""
    st = Store(tmp_path / "st", create=True)
    E, S, R = 8, 12, 4                      # 3 slots per rank, 4 redundant slots
    phy2log = [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 3, 5]
    tok = [10, 20, 30, 40, 50, 60, 70, 80, 5, 1, 99, 2]   # replicas get uneven counts
    rows = [(0, 0, phy2log[s], tok[s], s) for s in range(S)]
    rid = write(st, {"num_experts": E, "num_ranks": R, "num_slots": S, "top_k": 2}, load_table(rows))
    ranks = np.zeros(R)
    for s in range(S):
        ranks[s // 3] += tok[s]
    r = skew_rows(st, rid)[(0, 0)]
    assert r["placement_source"] == "slot"
    assert r["max_rank_tokens"] == ranks.max() and r["imbalance"] == pytest.approx(ranks.max() / ranks.mean())
    assert r["straggler_rank"] == int(np.argmax(ranks))
    x = np.zeros(E)
    for s in range(S):
        x[phy2log[s]] += tok[s]
    assert r["gini"] == pytest.approx(gini_mad(x)) and r["hottest_expert"] == int(np.argmax(x))


def test_recorded_placement_splits_replicas_evenly(tmp_path):
    st = Store(tmp_path / "st", create=True)
    E, S, R = 6, 8, 4                       # 2 slots per rank; experts 0 and 4 have two copies
    phy2log = [4, 1, 0, 2, 3, 0, 5, 4]
    placement = {"plan_id": ["recorded"] * S, "layer": [0] * S, "slot": list(range(S)),
                 "rank": [s // 2 for s in range(S)], "node": [0] * S, "expert": phy2log}
    x = np.array([100, 10, 20, 30, 64, 6], dtype=float)
    rows = [(0, 0, e, int(t)) for e, t in enumerate(x)]
    rid = write(st, {"num_experts": E, "num_ranks": R, "num_slots": S, "top_k": 1}, load_table(rows),
                placement=placement)
    copies = np.bincount(phy2log, minlength=E)
    ranks = np.zeros(R)
    for s, e in enumerate(phy2log):
        ranks[s // 2] += x[e] / copies[e]
    r = skew_rows(st, rid)[(0, 0)]
    assert r["placement_source"] == "recorded"
    assert r["max_rank_tokens"] == pytest.approx(ranks.max())
    assert r["imbalance"] == pytest.approx(ranks.max() / ranks.mean())
    assert r["straggler_rank"] == int(np.argmax(ranks))
    rl = st.sql("SELECT tokens FROM rank_load ORDER BY rank")["tokens"].to_numpy()
    np.testing.assert_allclose(rl, ranks)


def test_generic_csv_ingest_then_views(tmp_path, runner, cli):
    """Rows through the generic collector: duplicate (step, layer, expert) rows by source
    rank are summed."""
    csv = tmp_path / "load.csv"
    x = {0: [6, 0, 2, 0], 1: [1, 1, 1, 9]}
    lines = ["step,layer,expert,tokens,src_rank"]
    for step, vals in x.items():
        for e, t in enumerate(vals):
            lines += [f"{step},0,{e},{t // 2},0", f"{step},0,{e},{t - t // 2},1"]
    csv.write_text("\n".join(lines) + "\n")
    res = runner.invoke(cli, ["ingest", str(csv), "--store", str(tmp_path / "st"), "--ranks", "2", "--experts", "4",
                              "--top-k", "2"])
    assert res.exit_code == 0, res.output
    st = Store(tmp_path / "st")
    rid = st.run_ids()[0]
    rows = skew_rows(st, rid)
    for step, vals in x.items():
        assert_row_matches(rows[(step, 0)], ref_metrics(np.array(vals, float), np.array([0, 0, 1, 1]), 2))
    t = st.sql("SELECT * FROM tokens_per_expert ORDER BY step").row(0, named=True)
    assert t["tokens"] == pytest.approx(4.0) and t["experts_hit"] == 2


def test_dummy_time_share_from_step_times(tmp_path):
    st = Store(tmp_path / "st", create=True)
    steps = {"step": [0, 0, 1, 1, 2, 2], "rank": [0, 1, 0, 1, 0, 1],
             "phase": ["decode", "idle", "decode", "decode", "idle", "idle"],
             "num_tokens": [5, 0, 3, 4, 0, 0], "is_dummy": [False, True, False, False, True, True],
             "start_ns": [0, 0, 100, 100, 250, 250], "end_ns": [100, 90, 250, 240, 300, 310],
             "inferred": [False] * 6}
    write(st, {"num_experts": 2, "num_ranks": 2, "top_k": 1}, load_table([(0, 0, 0, 5)]), steps=steps)
    df = st.sql("SELECT * FROM dummy_steps ORDER BY rank")
    r0, r1 = df.row(0, named=True), df.row(1, named=True)
    assert (r0["dummy_steps"], r1["dummy_steps"]) == (1, 2)
    assert r0["dummy_time_ns"] == 50 and r0["dummy_time_share"] == pytest.approx(50 / 300)
    assert r1["dummy_time_ns"] == 90 + 60 and r1["dummy_time_share"] == pytest.approx(150 / (90 + 140 + 60))
    by = st.sql("SELECT step, dummy_ranks FROM dummy_by_step ORDER BY step")["dummy_ranks"].to_list()
    assert by == [1, 0, 2]


def test_catalog_holds_the_views(tmp_path):
    import duckdb

    st = Store(tmp_path / "st", create=True)
    write(st, {"num_experts": 4, "num_ranks": 2, "top_k": 1}, load_table([(0, 0, e, e + 1) for e in range(4)]))
    st.write_catalog()
    con = duckdb.connect(str(tmp_path / "st" / "catalog.duckdb"), read_only=True)
    con.execute(f"SET file_search_path='{tmp_path / 'st'}'")
    imb = con.execute("SELECT imbalance FROM layer_skew").fetchone()[0]
    con.close()
    assert imb == pytest.approx(7 / 5)    # ranks [1+2, 3+4]: max 7, mean 5


def test_expert_missing_from_recorded_placement_falls_back_visibly(tmp_path):
    """An expert with tokens but no slot in the recorded placement keeps its tokens
    (contiguous rank) and the layer says 'recorded+contiguous'."""
    st = Store(tmp_path / "st", create=True)
    E, R = 4, 2
    phy2log = [1, 0, 2, 2]           # expert 3 has no slot
    placement = {"plan_id": ["recorded"] * 4, "layer": [0] * 4, "slot": [0, 1, 2, 3], "rank": [0, 0, 1, 1],
                 "node": [0] * 4, "expert": phy2log}
    x = np.array([10, 20, 30, 40], dtype=float)
    rid = write(st, {"num_experts": E, "num_ranks": R, "num_slots": 4, "top_k": 1},
                load_table([(0, 0, e, int(t)) for e, t in enumerate(x)]), placement=placement)
    ranks = np.array([x[0] + x[1], x[2]])
    ranks[3 * R // E] += x[3]        # contiguous fallback: rank 1
    r = skew_rows(st, rid)[(0, 0)]
    assert r["placement_source"] == "recorded+contiguous"
    assert r["mean_rank_tokens"] == pytest.approx(x.sum() / R)       # no token lost
    assert r["imbalance"] == pytest.approx(ranks.max() / ranks.mean())
    lp = st.sql("SELECT unplaced_experts FROM layer_placement").item()
    assert lp == 1

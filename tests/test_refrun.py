"""The CPU expert-parallel reference run: real gloo all-to-alls, ingested as one run; a
replay of one run's routing against another placement checked against a second real run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import polars as pl
import pytest

from .helpers import module_fixture

torch = pytest.importorskip("torch", reason="the reference run needs PyTorch (pip install 'moetrace[torch]')")

from moetrace.collect import ingest, registry  # noqa: E402
from moetrace.errors import InputError  # noqa: E402
from moetrace.produce.refrun import RefRunConfig, parse_placement, run  # noqa: E402
from moetrace.run import Store  # noqa: E402

R, E, K, L, STEPS, TOK = 2, 8, 2, 2, 4, 24
IDLE = (2, 1)
# 12 slots over 2 ranks: experts 0..3 get a second copy
REPLICATED = [0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 2, 3]


def _cfg(**kw):
    base = dict(ranks=R, experts=E, top_k=K, layers=L, hidden=32, ffn=32, steps=STEPS, tokens_per_rank=TOK,
                skew=1.0, idle=[IDLE], seed=3)
    base.update(kw)
    return RefRunConfig(**base)


@module_fixture
def runs(tmp_path_factory, forked_ranks):
    root = tmp_path_factory.mktemp("refrun")
    plan_file = root / "plan.json"
    plan_file.write_text(json.dumps({"phy2log": [REPLICATED] * L}))
    run(_cfg(repeats=3, warmup=1), root / "a")
    run(_cfg(placement=str(plan_file), profile=False), root / "b")
    st = Store(root / "st", create=True)
    ra = ingest(st, [root / "a"])[0].run_id
    rb = ingest(st, [root / "b"])[0].run_id
    return root, st, ra, rb


def test_one_run_with_routing_load_steps_placement(runs):
    root, st, ra, _ = runs
    r = st.run_row(ra)
    assert (r["collector"], r["num_ranks"], r["num_experts"], r["top_k"], r["num_slots"]) == ("refrun", R, E, K, E)
    tokens = {(s, rk): (0 if (s, rk) == IDLE else TOK) for s in range(STEPS) for rk in range(R)}
    # every token routed to K experts in every layer
    n = st.sql("SELECT count(*) n FROM routing WHERE run_id = ?", [ra])["n"][0]
    assert n == sum(tokens.values()) * K * L
    per = st.sql("SELECT step, layer, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL ORDER BY ALL", [ra])
    for row in per.iter_rows(named=True):
        assert row["t"] == K * sum(tokens[(row["step"], rk)] for rk in range(R))
    steps = st.sql("SELECT step, rank, phase, num_tokens, is_dummy, start_ns, end_ns FROM steps WHERE run_id = ? "
                   "ORDER BY step, rank", [ra])
    assert steps.height == STEPS * R
    for row in steps.iter_rows(named=True):
        key = (row["step"], row["rank"])
        assert row["num_tokens"] == tokens[key]
        assert row["is_dummy"] == (key == IDLE)
        assert row["phase"] == ("idle" if key == IDLE else "decode")
        assert row["end_ns"] > row["start_ns"]
    pl_rows = st.sql("SELECT slot, rank, expert FROM placement WHERE run_id = ? AND layer = 0 ORDER BY slot", [ra])
    assert pl_rows["expert"].to_list() == list(range(E))
    assert pl_rows["rank"].to_list() == [s // (E // R) for s in range(E)]


def test_gates_sum_to_one_and_router_prefers_hot_experts(runs):
    _, st, ra, _ = runs
    g = st.sql("SELECT step, layer, token, sum(gate) g FROM routing WHERE run_id = ? GROUP BY ALL", [ra])
    assert np.allclose(g["g"].to_numpy(), 1.0, atol=1e-5)
    c = st.sql("SELECT expert, count(*) n FROM routing WHERE run_id = ? GROUP BY expert ORDER BY expert", [ra])
    n = dict(zip(c["expert"].to_list(), c["n"].to_list()))
    # Zipf(1) prior: expert 0's logit is log(8) ~ 2.1 above expert 7's
    assert n.get(0, 0) > 2 * n.get(E - 1, 0)


def test_same_seed_same_routing_under_another_placement(runs):
    _, st, ra, rb = runs
    q = "SELECT step, layer, token, choice, expert FROM routing WHERE run_id = ? ORDER BY step, layer, token, choice"
    assert st.sql(q, [ra]).equals(st.sql(q, [rb]))


def _hash_slot(token, expert, phy2log_row):
    """Independent re-implementation of the documented replica choice."""
    copies = [s for s, e in enumerate(phy2log_row) if e == expert]
    h = (int(token) * 2654435761) % (1 << 32)
    return copies[h % len(copies)]


def test_replay_prediction_matches_second_real_run(runs):
    """Predict run B's per-rank load from run A's routing and B's placement; B measured it."""
    _, st, ra, rb = runs
    rt = st.sql("SELECT step, layer, token, expert FROM routing WHERE run_id = ?", [ra])
    spr = len(REPLICATED) // R
    pred = np.zeros((STEPS, L, R), np.int64)
    for s, layer, tok, e in rt.iter_rows():
        pred[s, layer, _hash_slot(tok, e, REPLICATED) // spr] += 1
    got = st.sql("SELECT step, layer, slot, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL", [rb])
    meas = np.zeros((STEPS, L, R), np.int64)
    for s, layer, slot, t in got.iter_rows():
        meas[s, layer, slot // spr] += t
    assert meas.sum() == pred.sum() > 0
    np.testing.assert_array_equal(pred, meas)
    # and the measured load differs from what contiguous placement gave (the test can fail)
    a = st.sql("SELECT step, layer, slot, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL", [ra])
    meas_a = np.zeros((STEPS, L, R), np.int64)
    for s, layer, slot, t in a.iter_rows():
        meas_a[s, layer, slot // (E // R)] += t
    assert not np.array_equal(meas_a, meas)


def test_replay_engine_reproduces_second_run(runs):
    from moetrace.placement.planners import Plan
    from moetrace.replay.token_replay import replay_routing

    _, st, ra, rb = runs
    rt = st.sql("SELECT step, layer, token, src_rank, expert FROM routing WHERE run_id = ?", [ra])
    plan = Plan(np.array([REPLICATED] * L), E, R, R)
    blk = replay_routing(rt["step"].to_numpy(), rt["layer"].to_numpy(), rt["token"].to_numpy(),
                         rt["src_rank"].to_numpy(), rt["expert"].to_numpy(), STEPS, plan, "hash", 64)
    got = st.sql("SELECT step, layer, slot, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL", [rb])
    meas = np.zeros((STEPS, L, R))
    for s, layer, slot, t in got.iter_rows():
        meas[s, layer, slot // (len(REPLICATED) // R)] += t
    np.testing.assert_array_equal(blk.tokens, meas)


def test_profiler_spans_are_gloo_all_to_alls(runs):
    assert "kineto" in registry()   # the refrun folder's traces go through it
    _, st, ra, _ = runs
    k = st.sql("SELECT rank, kind, count(*) n FROM spans WHERE run_id = ? AND kind IN ('dispatch', 'combine') "
               "GROUP BY ALL ORDER BY ALL", [ra])
    got = {(r, kind): n for r, kind, n in k.iter_rows()}
    for rank in range(R):
        # per layer and step: the dispatch is 3 all_to_all_single calls (split sizes, rows, slot ids),
        # the combine is one
        assert got.get((rank, "combine")) == STEPS * L
        assert got.get((rank, "dispatch")) == 3 * STEPS * L
    steps = st.sql("SELECT DISTINCT step FROM spans WHERE run_id = ? AND step IS NOT NULL ORDER BY step", [ra])
    assert steps["step"].to_list() == list(range(STEPS))


def test_incomplete_or_inconsistent_folder_is_refused(runs, tmp_path):
    root, _, _, _ = runs
    bad = tmp_path / "bad"
    shutil.copytree(root / "b", bad)
    rec = pl.read_parquet(bad / "received_rank0.parquet")
    rec.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.col("tokens") + 1).otherwise(pl.col("tokens"))
                     .alias("tokens")).write_parquet(bad / "received_rank0.parquet")
    st = Store(tmp_path / "st", create=True)
    with pytest.raises(InputError, match="disagree with the routing"):
        ingest(st, [bad])
    (bad / "steps_rank1.parquet").unlink()
    with pytest.raises(InputError, match="missing steps_rank1.parquet"):
        ingest(st, [bad])
    assert st.run_ids() == []


@pytest.mark.parametrize("spec,err", [
    ([[0, 1, 2, 3, 4, 5, 6, 6]], "every expert"),
    ([[0, 1, 2, 3, 4, 5, 6]], "split evenly"),
    ("nonsense", "neither"),
])
def test_bad_placement(spec, err):
    with pytest.raises(InputError, match=err):
        parse_placement(spec, 1, E, R)


def test_named_placements():
    assert parse_placement("round_robin", 1, 8, 2).tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]
    assert parse_placement("reverse", 2, 4, 2).tolist() == [[3, 2, 1, 0]] * 2
    rnd = parse_placement("random:1", 3, 8, 2)
    assert all(sorted(r) == list(range(8)) for r in rnd.tolist())


def test_cli_rejects_bad_options(runner, tmp_path):
    from moetrace.cli import cli

    res = runner.invoke(cli, ["refrun", str(tmp_path / "x"), "--top-k", "9"])
    assert res.exit_code == 2 and "top-k" in res.output
    res = runner.invoke(cli, ["refrun", str(tmp_path / "x"), "--idle", "9:0"])
    assert res.exit_code == 2 and "outside" in res.output


def test_report_reads_the_reference_run(runs, runner, tmp_path):
    from moetrace.cli import cli

    root, st, ra, _ = runs
    res = runner.invoke(cli, ["report", str(root / "st"), "--run", ra, "--out-dir", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    out = res.output
    # dummy steps: one of STEPS * R (step, rank) pairs had no tokens
    assert f"1 of {STEPS * R} (step, rank) pairs were dummy steps" in out
    assert "Per-layer skew" in out
    assert "All-to-all exposure" in out
    assert (tmp_path / "rep" / "report.html").stat().st_size > 0


def _p(v, q):
    """Percentile by linear interpolation, written out (numpy's default method)."""
    v = sorted(v)
    x = (len(v) - 1) * q
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


def test_cell_times_are_medians_of_the_timed_passes(runs):
    """cell_times = per (step, layer, rank) median over the 3 timed passes, recomputed here
    from the raw per-pass timestamps; the layer time is per pass the last combine end minus
    the last dispatch start."""
    root, st, ra, rb = runs
    raw = pl.concat([pl.read_parquet(root / "a" / f"timing_rank{r}.parquet") for r in range(R)])
    assert sorted(raw["pass"].unique().to_list()) == [0, 1, 2]       # warm-up and profiled pass not timed
    assert raw.height == 3 * STEPS * L * R
    per = {}
    for row in raw.iter_rows(named=True):
        k = (row["step"], row["layer"], row["rank"])
        per.setdefault(k, []).append(row)
    got = st.sql("SELECT * FROM cell_times WHERE run_id = ? ORDER BY step, layer, rank", [ra])
    assert got.height == STEPS * L * R
    for g in got.iter_rows(named=True):
        rows = per[(g["step"], g["layer"], g["rank"])]
        ex = [r["expert_end_ns"] - r["expert_start_ns"] for r in rows]
        moe = [r["combine_end_ns"] - r["dispatch_start_ns"] for r in rows]
        comm = [m - e for m, e in zip(moe, ex)]
        assert g["passes"] == 3
        assert g["expert_ns"] == sorted(ex)[1] and g["moe_ns"] == sorted(moe)[1] and g["comm_ns"] == sorted(comm)[1]
        assert g["expert_spread"] == pytest.approx((_p(ex, .75) - _p(ex, .25)) / sorted(ex)[1])
        lay = []
        for p in range(3):
            rs_p = [r for rk in range(R) for r in per[(g["step"], g["layer"], rk)] if r["pass"] == p]
            lay.append(max(r["combine_end_ns"] for r in rs_p) - max(r["dispatch_start_ns"] for r in rs_p))
        assert g["layer_ns"] == sorted(lay)[1] and g["layer_min_ns"] == min(lay)
        assert g["expert_min_ns"] == min(ex)
    meta = json.loads(st.sql("SELECT meta_json FROM runs WHERE run_id = ?", [ra])["meta_json"][0])
    spreads = sorted(v for v in got["expert_spread"].to_list() if v is not None)
    assert meta["noise"]["passes"] == 3
    assert meta["noise"]["expert_spread_p50"] == pytest.approx(float(np.median(spreads)), abs=1e-4)
    # one pass: medians are the values, no spread
    one = st.sql("SELECT passes, expert_spread FROM cell_times WHERE run_id = ?", [rb])
    assert set(one["passes"].to_list()) == {1} and one["expert_spread"].null_count() == one.height


#: ``python -m moetrace ARGS`` (runpy, as ``-m`` does) with the reference-run ranks forked from a
#: forkserver that imported torch once (benchmarks.common.forked_rank_starts), not spawned: three
#: spawned ranks each import torch and torch._dynamo (~13 s of CPU of this test's 16). The
#: forkserver is started by this process, so the ranks still write to its stdout and stderr
#: (the pipes read here): any profiler chatter of theirs would still be seen.
FORKED_MAIN = """
import runpy, sys
sys.path.insert(0, {repo!r})
from benchmarks.common import forked_rank_starts
sys.argv = ["moetrace", *sys.argv[1:]]
with forked_rank_starts():
    runpy.run_module("moetrace", run_name="__main__", alter_sys=True)
"""


def test_cli_prints_noise_progress_and_no_profiler_chatter(tmp_path):
    import subprocess
    import sys

    from .helpers import REPO

    res = subprocess.run([sys.executable, "-c", FORKED_MAIN.format(repo=str(REPO)), "refrun", str(tmp_path / "o"),
                          "--ranks", "3", "--experts", "6", "--layers", "1", "--hidden", "16", "--ffn", "16",
                          "--steps", "1", "--tokens-per-rank", "4", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "noise over 2 timed pass(es)" in res.stdout
    assert "pass 3/3 done (profiled" in res.stderr
    import os
    if len(os.sched_getaffinity(0)) < 3:
        assert "OVERSUBSCRIBED" in res.stderr
    assert "USDT" not in res.stdout + res.stderr

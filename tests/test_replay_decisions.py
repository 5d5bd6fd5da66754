"""Replay answers an operator can act on: one definition of imbalance (the
recorded-plan replay equals skew_summary), settings known or asked for, pseudo-steps,
net benefit with a break-even step count computed by hand, hierarchical vs global EPLB on
real DeepSeek-V3 counts against the plain reference, per rank-pair traffic."""
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from moetrace.run import Store

from .helpers import make_store, run_cli, run_row, shared_data

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"
LOAD_SCHEMA = pa.schema([("step", pa.int64()), ("layer", pa.int32()), ("expert", pa.int32()), ("slot", pa.int32()),
                         ("src_rank", pa.int32()), ("tokens", pa.int64())])


def _assert_recorded_equals_skew_summary(st: Store, rid: str, per_layer: bool = True, run: dict | None = None):
    """replay --plan recorded: the same mean / p99 / max imbalance as run_skew_summary and the
    same per-layer means as skew_summary, undefined (step, layer) counted the same."""
    res = st.run(rid).replay("recorded", write=per_layer, fit_cost=False)
    s = res.judged.summary
    st = Store(st.path)
    run = run or st.sql("SELECT * FROM run_skew_summary WHERE run_id = ?", [rid]).row(0, named=True)
    assert s.mean_imbalance == pytest.approx(run["imbalance_mean"], rel=1e-12, abs=1e-12), rid
    assert s.p99_imbalance == pytest.approx(run["imbalance_p99"], rel=1e-12), rid
    assert s.max_imbalance == pytest.approx(run["imbalance_max"], rel=1e-12), rid
    if not per_layer:
        return res
    per = st.sql("""SELECT s.layer, s.imbalance_mean AS sql, avg(r.imbalance) AS replay,
                           s.steps_undefined, count(*) - count(r.imbalance) AS replay_undefined
                    FROM skew_summary s JOIN replay_layer r ON r.run_id = s.run_id AND r.layer = s.layer
                    WHERE s.run_id = ? AND r.replay_id = ? GROUP BY ALL ORDER BY s.layer""", [rid, res.replay_id])
    assert per.height > 0
    for row in per.iter_rows(named=True):
        if row["sql"] is None:
            assert row["replay"] is None
        else:
            assert row["replay"] == pytest.approx(row["sql"], rel=1e-12), (rid, row)
        # replay's grid holds every (step, layer); cells with no rows at all count as undefined there too
        assert row["replay_undefined"] >= row["steps_undefined"]
    return res


def test_recorded_replay_equals_skew_summary_on_samples(tmp_path):
    path = tmp_path / "st"
    assert run_cli("ingest", SAMPLES / "dsv3_synth_expert_load.parquet", "--store", path, "--run-id", "dsv3",
                   "--ranks", 32, "--ranks-per-node", 8, "--top-k", 8, "--experts", 256, "--layers", 4).exit_code == 0
    for name in ("refrun", "refrun_eplb"):
        r = run_cli("ingest", SAMPLES / name, "--store", path, "--run-id", name)
        assert r.exit_code == 0, r.output
    st = Store(path)
    for rid in ("dsv3", "refrun", "refrun_eplb"):
        _assert_recorded_equals_skew_summary(st, rid)


def test_recorded_replay_equals_skew_summary_on_real_sglang_counts(tmp_path):
    folder = shared_data("sglang_dsv3_expert_counts")
    st = Store(tmp_path / "st", create=True)
    from moetrace.collect import ingest

    for f in sorted(folder.glob("*.json")):
        ingest(st, [f], options={"num_ranks": 32, "ranks_per_node": 8, "num_groups": 8}, run_id=f.stem)
    sql = {r["run_id"]: r for r in st.sql("SELECT * FROM run_skew_summary").iter_rows(named=True)}
    for i, rid in enumerate(sorted(st.run_ids())):
        res = _assert_recorded_equals_skew_summary(st, rid, per_layer=i == 0, run=None if i == 0 else sql[rid])
        # one pseudo-step aggregating the recording: imbalance yes, time per step no, and it says so
        assert res.judged.gross_step_ns is None and res.to_dict()["time_per"] is None
        assert any("aggregate many passes" in n for n in res.notes)
        assert res.judged.summary.cells == 58                   # layers 0-2 of DeepSeek-V3 are dense: no rows


def test_recorded_replay_equals_skew_summary_with_idle_steps(tmp_path):
    """Steps where a layer routed nothing (idle) are undefined in both, a recorded placement
    with replicas (even split) and one without rows at all for a (step, layer)."""
    rng = np.random.default_rng(7)
    T, L, E = 9, 2, 8
    p2l = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 0, 2], [7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 6, 5]])
    rows = {k: [] for k in LOAD_SCHEMA.names}
    for t in range(T):
        for li in range(L):
            if t == 4 and li == 1:
                continue                               # no rows at all
            for e in range(E):
                n = 0 if t in (2, 6) else int(rng.integers(0, 40))
                for k, v in zip(LOAD_SCHEMA.names, (t, li, e, None, None, n)):
                    rows[k].append(v)
    placement = {"plan_id": ["recorded"] * 24, "layer": np.repeat([0, 1], 12).tolist(), "slot": list(range(12)) * 2,
                 "rank": (np.arange(24) % 12 // 3).tolist(), "node": (np.arange(24) % 12 // 6).tolist(),
                 "expert": p2l.ravel().tolist()}
    run = run_row(source="idle", source_sha256="i" * 64, num_layers=L, num_experts=E, top_k=2, hidden=16,
                  dtype_bytes=2, expert_bytes=1000, num_ranks=4, ranks_per_node=2, num_slots=12)
    st = make_store(tmp_path / "st", run, {"expert_load": pa.table(rows, schema=LOAD_SCHEMA), "placement": placement}, run_id="idle")
    res = _assert_recorded_equals_skew_summary(st, "idle")
    assert res.judged.summary.undefined_cells == 2 * 2 + 1
    # and by hand: max/mean of the even split over the recorded copies, idle cells left out
    tok = np.zeros((T, L, E))
    for t, li, e, n in zip(rows["step"], rows["layer"], rows["expert"], rows["tokens"]):
        tok[t, li, e] += n
    vals = []
    for t in range(T):
        for li in range(L):
            cnt = np.bincount(p2l[li], minlength=E)
            rl = np.zeros(4)
            for s in range(12):
                rl[s // 3] += tok[t, li, p2l[li, s]] / cnt[p2l[li, s]]
            if rl.sum() > 0:
                vals.append(rl.max() / rl.mean())
    assert res.judged.summary.mean_imbalance == pytest.approx(np.mean(vals), rel=1e-12)


# ----------------------------------------------------------------------------- net benefit by hand
def _hand_case(steps, stall_ns=1000.0, overlap=0.0):
    """2 ranks on 2 nodes, 4 experts, experts 0 and 1 hot (100 tokens each per step) and both on
    rank 0 in the recorded layout. Compute 10 ns per token, no all-to-all (top_k unknown).
    Recorded layer time: 200 x 10 = 2000 ns; the swapped plan (0, 2 | 1, 3): 1000 ns, so
    the gain is 1000 ns per step. The swap moves expert 2 to rank 0 and expert 1 to rank 1,
    each 5000 bytes from the other node over a 1 GB/s NIC: 5000 ns per rank, in parallel;
    charged = stall + 5000 x (1 - overlap); break-even = charged / 1000."""
    from moetrace.costmodel.step_cost import CostModel
    from moetrace.placement.planners import Plan
    from moetrace.replay.engine import replay_load
    from moetrace.replay.strategies import Fixed, MoveCost, judge

    load = np.zeros((steps, 1, 4))
    load[:, 0, :2] = 100
    recorded = Plan(np.array([[0, 1, 2, 3]]), 4, 2, 1, plan_id="recorded", policy="recorded")
    plan = Plan(np.array([[0, 2, 1, 3]]), 4, 2, 1, plan_id="swap", policy="hand")
    cost = CostModel(a_ns=10.0, b_ns=0.0, nvlink_Bps=1e10, internode_Bps=1e9, source="hand")

    def fn(ids, ld, sl, p, rec):
        return replay_load(ld, p, "even", None, None, 0)

    return judge(np.arange(steps), load, None, 0, Fixed(plan), recorded, fn, cost, 5000,
                 MoveCost(stall_ns=stall_ns, overlap=overlap))


def test_break_even_by_hand():
    j = _hand_case(20)
    assert j.recorded_step_ns == pytest.approx(2000) and j.gross_step_ns == pytest.approx(1000)
    (c,) = j.changes
    assert (c.moves, c.bytes, c.bytes_inter) == (2, 10000, 10000)
    assert c.transfer_ns == pytest.approx(5000) and c.charged_ns == pytest.approx(6000)
    assert c.gain_per_step_ns == pytest.approx(1000) and c.break_even_steps == pytest.approx(6.0)
    assert j.net_step_ns == pytest.approx(1000 + 6000 / 20)          # 1300 ns vs 2000: -35% > the 25% band
    assert j.verdict == "pays off"
    assert "1.300" not in j.vs_recorded() and "−35.0%" in j.vs_recorded()
    # asynchronous: half the transfer hidden -> 1000 + 2500 = 3500 ns, break-even 3.5 steps
    assert _hand_case(20, overlap=0.5).changes[0].break_even_steps == pytest.approx(3.5)
    # a 1 ms stall per rebalance: net 1000 + 1,005,000 / 20 ns, far above the recorded 2000 ns
    big = _hand_case(20, stall_ns=1e6)
    assert big.net_step_ns == pytest.approx(1000 + 1_005_000 / 20) and big.verdict == "does not pay off"
    # too few judged steps to tell
    few = _hand_case(4)
    assert few.verdict == "not enough evidence" and "only 4 steps" in few.verdict_reason


def test_verdict_within_the_error_band():
    from moetrace.costmodel.step_cost import UNCALIBRATED_REL_ERROR, CostModel
    from moetrace.replay.strategies import verdict

    c = CostModel(1, 1, 1, 1, "x")
    assert verdict(0.9e6, 1e6, 50, c)[0] == "not enough evidence"            # -10% within the ±25% default
    assert UNCALIBRATED_REL_ERROR == 0.25
    c.rel_error, c.rel_error_source = 0.05, "calibrated"
    v, why = verdict(0.9e6, 1e6, 50, c)
    assert v == "pays off" and "±5%" in why


# ----------------------------------------------------------------------------- settings
def _no_groups_store(path):
    rng = np.random.default_rng(3)
    T, L, E = 12, 2, 16
    tok = rng.integers(0, 100, (T, L, E))
    rows = {"step": np.repeat(np.arange(T), L * E), "layer": np.tile(np.repeat(np.arange(L), E), T),
            "expert": np.tile(np.arange(E), T * L), "slot": [None] * (T * L * E), "src_rank": [None] * (T * L * E),
            "tokens": tok.ravel()}
    run = run_row(source="ng", source_sha256="n" * 64, num_layers=L, num_experts=E, top_k=2, hidden=16,
                  dtype_bytes=2, expert_bytes=1000, num_ranks=4, ranks_per_node=2, num_slots=E)
    st = make_store(path, run, {"expert_load": pa.table(rows, schema=LOAD_SCHEMA)}, run_id="ng")
    return st


def test_settings_known_or_asked_for(tmp_path):
    path = tmp_path / "ng"
    _no_groups_store(path)
    from .helpers.slot_store import store_files

    before = store_files(path)
    for args, needle in [
        (("replay", path, "--policy", "eplb"), "--groups"),                          # groups unknown
        (("replay", path, "--policy", "greedy", "--nodes", 3), "--nodes 3"),           # 3 nodes of 2 != 4 ranks
        (("replay", path, "--policy", "greedy", "--nodes", 4, "--ranks-per-node", 2), "--nodes 4"),
        (("replay", path, "--policy", "greedy", "--replicas", 3), "--replicas"),       # 19 slots over 4 ranks
        (("plan", path, "--import", SAMPLES / "refrun_eplb_plan.json", "--replicas", 32), "--replicas"),
        (("replay", path, "--plan", "recorded", "--replicas", 4), "--replicas"),
    ]:
        r = run_cli(*args)
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
    assert store_files(path) == before
    # with the groups given, hierarchical EPLB runs and every description states the settings
    r = run_cli("plan", path, "--policy", "eplb", "--groups", 4, "--replicas", 4, "--no-store", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["policy"] == "eplb" and d["groups"] == 4 and d["nodes"] == 2 and d["ranks_per_node"] == 2
    for word in ("4 ranks", "2 nodes x 2 ranks per node", "20 slots", "4 expert groups", "eplb"):
        assert word in d["plan"], d["plan"]
    # groups that cannot be hierarchical (3 groups... do not divide 16 experts) are refused; 2 groups on
    # 4 nodes fall back to global, and the policy is then called eplb-global
    r = run_cli("plan", path, "--policy", "eplb", "--groups", 2, "--nodes", 4, "--ranks-per-node", 1,
                "--no-store", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["policy"] == "eplb-global"


def test_out_of_sample_by_default(tmp_path):
    path = tmp_path / "ng"
    _no_groups_store(path)
    r = run_cli("replay", path, "--policy", "greedy", "--json")
    d = json.loads(r.output)
    assert d["num_steps"] == 6 and "out-of-sample" in d["judged_on"]       # fitted on 0..5, judged on 6..11
    d2 = json.loads(run_cli("replay", path, "--policy", "greedy", "--fit-steps", "0:9", "--json").output)
    assert d2["num_steps"] == 3
    d3 = json.loads(run_cli("replay", path, "--policy", "greedy", "--in-sample", "--json").output)
    assert d3["num_steps"] == 12 and "IN-SAMPLE" in d3["judged_on"]
    # the recorded baseline is predicted on the same steps: contiguous experts 4r..4r+3 on rank r
    st = Store(path)
    tok = st.sql("SELECT step, expert, sum(tokens) AS t FROM expert_load GROUP BY ALL ORDER BY 1, 2")
    rl = tok["t"].to_numpy().reshape(12, 1, 16)
    per = st.sql("SELECT step, layer, expert, tokens FROM expert_load ORDER BY step, layer, expert")
    arr = per["tokens"].to_numpy().reshape(12, 2, 4, 4).sum(axis=3)[6:]
    assert d["recorded_mean_imbalance"] == pytest.approx((arr.max(axis=2) / arr.mean(axis=2)).mean(), rel=1e-12)
    assert rl.shape == (12, 1, 16)


# ----------------------------------------------------------------------------- real DeepSeek-V3 counts
def test_hierarchical_vs_global_eplb_on_real_deepseek_counts(tmp_path):
    from tests.eplb_reference import rebalance_experts_reference

    f = shared_data("sglang_dsv3_expert_counts", "prefill_in1024.json")
    path = tmp_path / "st"
    r = run_cli("ingest", f, "--store", path, "--run-id", "p", "--ranks", 32, "--ranks-per-node", 8)
    assert r.exit_code == 0, r.output
    r = run_cli("replay", path, "--policy", "eplb", "--replicas", 32, "--in-sample")
    assert r.exit_code == 2 and "--groups" in r.output            # DeepSeek-V3's 8 groups are not in the dump
    counts = np.asarray(json.loads(f.read_text())["logical_count"], dtype=np.float64)
    moe = counts[3:]                                               # layers 0-2 are dense (all zero)
    out = {}
    for policy, groups in (("eplb", 8), ("eplb-global", None)):
        args = ["replay", path, "--policy", policy, "--replicas", 32, "--in-sample", "--json"]
        r = run_cli(*args, *(["--groups", groups] if groups else []))
        assert r.exit_code == 0, r.output
        out[policy] = json.loads(r.output)
        ref, _, _ = rebalance_experts_reference(moe, 288, groups or 1, 4 if groups else 1, 32)
        ref = np.asarray(ref)
        # the plain implementation's plan, judged by hand: even split over copies, slot s on rank s // 9
        vals = []
        for li in range(moe.shape[0]):
            cnt = np.bincount(ref[li], minlength=256)
            rl = np.zeros(32)
            for s in range(288):
                rl[s // 9] += moe[li, ref[li, s]] / cnt[ref[li, s]]
            vals.append(rl.max() / rl.mean())
        assert out[policy]["mean_imbalance"] == pytest.approx(np.mean(vals), rel=1e-9), policy
    assert out["eplb"]["policy"] == "eplb" and out["eplb-global"]["policy"] == "eplb-global"
    assert out["eplb"]["num_groups"] == 8 and out["eplb-global"]["num_groups"] == 1
    assert out["eplb"]["mean_imbalance"] > out["eplb-global"]["mean_imbalance"] + 0.05
    # pseudo-step: imbalance, no time per step, and said in words
    for d in out.values():
        assert d["gross_step_ns"] is None and d["verdict"] == "not enough evidence"
        assert any("no time per step" in n for n in d["approximations"])
    # with the number of passes known, times are per pass and say so
    r = run_cli("replay", path, "--plan", "recorded", "--passes", 1000, "--json")
    d = json.loads(r.output)
    assert d["time_per"] == "pass" and d["gross_step_ns"] > 0
    assert any("times are per pass" in n for n in d["approximations"])


# ----------------------------------------------------------------------------- traffic
def test_dispatch_traffic_matrix_per_rank_pair(tmp_path):
    from moetrace.produce.synth import SynthConfig, synth

    cfg = SynthConfig(layers=2, experts=16, top_k=4, ranks=8, ranks_per_node=4, steps=4, tokens_per_step=64,
                      per_token=True, hidden=16, dtype_bytes=2, seed=3)
    st = Store(tmp_path / "pt", create=True)
    synth(st, cfg, run_id="pt")
    r = run_cli("replay", tmp_path / "pt", "--policy", "greedy", "--fit-steps", "0:2", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    st = Store(tmp_path / "pt")
    tr = st.sql("SELECT plan, src_rank, dst_rank, inter_node, bytes, steps FROM replay_traffic WHERE replay_id = ?",
                [d["replay_id"]])
    assert set(tr["plan"].to_list()) == {"plan", "recorded"}
    # the recorded (contiguous: expert e on rank e // 2) matrix by hand from the routing rows of steps 2, 3
    rt = st.sql("SELECT step, layer, token, src_rank, expert FROM routing WHERE step >= 2")
    m = np.zeros((8, 8))
    seen = {}
    for step, layer, token, src, e in rt.iter_rows():
        seen.setdefault((step, layer, token, src), set()).add(e // 2)
    for (_step, _layer, _token, src), dsts in seen.items():
        for dst in dsts - {src}:
            m[src, dst] += 16 * 2
    rec = tr.filter(tr["plan"] == "recorded")
    got = np.zeros((8, 8))
    got[rec["src_rank"].to_numpy(), rec["dst_rank"].to_numpy()] = rec["bytes"].to_numpy()
    np.testing.assert_array_equal(got, m)
    assert (rec["inter_node"].to_numpy() == (rec["src_rank"].to_numpy() // 4 != rec["dst_rank"].to_numpy() // 4)).all()
    assert set(rec["steps"].to_list()) == {2}
    # the report draws both matrices
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import replay as section

    sec = section.build(ReportContext(st, "pt", st.run_row("pt"), tmp_path / "out"))
    names = {f.path.name for f in sec.figures}
    assert {"replay_traffic_recorded.png", "replay_traffic_plan.png"} <= names
    assert "recorded" in sec.markdown and "net" in sec.markdown


# ----------------------------------------------------------------------------- re-ingest
def test_reingest_with_other_options_needs_a_run_id(tmp_path):
    """The same source with corrected options is never a silent second run: refused
    (one line, exit 2, store unchanged) unless --run-id names the new run."""
    path = tmp_path / "st"
    src = SAMPLES / "dsv3_synth_expert_load.parquet"
    base = ["ingest", src, "--store", path, "--top-k", 8, "--experts", 256, "--layers", 4]
    r1 = run_cli(*base, "--ranks", 32)
    assert r1.exit_code == 0 and "run " in r1.output
    again = run_cli(*base, "--ranks", 32)                       # same source, same options: a no-op
    assert again.exit_code == 0 and "nothing written" in again.output
    r2 = run_cli(*base, "--ranks", 16)                          # corrected options, no new id: refused
    assert r2.exit_code == 2 and "with other options" in r2.output and "--run-id" in r2.output
    r2 = run_cli(*base, "--ranks", 16, "--run-id", "r16")       # named: a new run
    assert r2.exit_code == 0 and "nothing written" not in r2.output
    r3 = run_cli(*base, "--ranks", 32, "--run-id", "again")      # a new run id: a new run
    assert r3.exit_code == 0 and "nothing written" not in r3.output
    st = Store(path)
    rows = st.sql("SELECT run_id, num_ranks, source_sha256 FROM runs ORDER BY ingested_at_ns")
    assert rows["num_ranks"].to_list() == [32, 16, 32] and rows["source_sha256"].n_unique() == 1
    assert rows["run_id"].to_list()[1:] == ["r16", "again"]
    assert run_cli(*base, "--ranks", 32, "--run-id", "again").output.count("nothing written") == 1


def test_groups_from_the_model_config(tmp_path):
    """ingest --model-config: DeepSeek-V3's Hugging Face config gives 8 expert groups, top-8,
    hidden 7168 and FP8 expert bytes 3 x 7168 x 2048; hierarchical EPLB then needs no --groups."""
    f = shared_data("sglang_dsv3_expert_counts", "prefill_in512.json")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256, "n_group": 8,
                               "topk_group": 4, "num_experts_per_tok": 8, "hidden_size": 7168,
                               "moe_intermediate_size": 2048, "quantization_config": {"quant_method": "fp8"},
                               "torch_dtype": "bfloat16"}))
    path = tmp_path / "st"
    r = run_cli("ingest", f, "--store", path, "--ranks", 32, "--ranks-per-node", 8, "--model-config", cfg)
    assert r.exit_code == 0, r.output
    run = Store(path).sql("SELECT num_groups, top_k, hidden, expert_bytes, num_experts FROM runs").row(0)
    assert run == (8, 8, 7168, 3 * 7168 * 2048, 256)
    r = run_cli("replay", path, "--policy", "eplb", "--replicas", 32, "--in-sample", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["num_groups"] == 8
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 5}')
    r = run_cli("ingest", f, "--store", tmp_path / "st2", "--model-config", bad)
    assert r.exit_code == 2 and "bad.json" in r.output and not (tmp_path / "st2").exists()


def test_pseudo_steps_have_no_drift_or_sweep(tmp_path):
    f = shared_data("sglang_dsv3_expert_counts", "decode_in500out1500.json")
    path = tmp_path / "st"
    assert run_cli("ingest", f, "--store", path, "--ranks", 32, "--ranks-per-node", 8, "--groups", 8).exit_code == 0
    for args in (("sweep", path, "--replicas", "0,32"), ("replay", path, "--policy", "eplb", "--replan-every", 5)):
        r = run_cli(*args)
        assert r.exit_code == 2 and "pseudo-step" in r.output, r.output

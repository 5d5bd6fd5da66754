"""The views engines' own tools compute (storage/sql/50_dp_balance.sql, 52_dispatch_fanout.sql,
54_expert_cooccurrence.sql) and the co-occurrence planner (placement/cooccurrence.py),
each checked against a count made here by hand: on a synthetic per-token run, on the CPU
reference run's real writer output (sample_traces/refrun_eplb: recorded slots, replicas,
idle ranks, step times) and on a real public routing log (../shared/data)."""
from __future__ import annotations

import gzip
import itertools
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.domain.model_shape import DEFAULT_DTYPE_BYTES, DEFAULT_HIDDEN
from moetrace.placement.cooccurrence import (
    cooccurrence_counts,
    fanout,
    node_shares,
    rank_shares,
)
from moetrace.placement.planners import PlanShape, make_plan
from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import Store

from .helpers import invoke, shared_data

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def cooccurrence_plan(load, co, shape, tolerance=0.1):
    return make_plan("cooccurrence", load, shape, cooccurrence=co, tolerance=tolerance)


def _by_key(df, keys, col):
    return {tuple(r[k] for k in keys): r[col] for r in df.iter_rows(named=True)}


# --------------------------------------------------------------------------- synthetic per-token run
@pytest.fixture(scope="module")
def synth_store(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("ev") / "st", create=True)
    cfg = SynthConfig(layers=2, experts=16, top_k=4, ranks=4, ranks_per_node=2, steps=6, tokens_per_step=48,
                      per_token=True, dummy_share=0.25, seed=3)
    rid = synth(st, cfg).run_id
    return st, rid, cfg


def test_dp_balance_equals_hand_count_on_synth(synth_store):
    st, rid, cfg = synth_store
    raw = st.sql("SELECT step, rank, num_tokens FROM steps WHERE run_id = ?", [rid])
    per_step = defaultdict(list)
    for r in raw.iter_rows(named=True):
        per_step[r["step"]].append((r["rank"], r["num_tokens"]))
    got = st.sql("SELECT * FROM dp_balance WHERE run_id = ? ORDER BY step", [rid])
    assert got.height == cfg.steps
    balances, means, maxes = [], [], []
    for row in got.iter_rows(named=True):
        toks = np.array([t for _, t in sorted(per_step[row["step"]])], float)
        assert row["max_tokens"] == toks.max() and row["mean_tokens"] == pytest.approx(toks.mean())
        if toks.max() == 0:
            assert row["balance"] is None
            continue
        assert row["balance"] == pytest.approx(toks.mean() / toks.max())
        assert row["slowest_rank"] == int(np.argmax(toks))          # argmax: the lowest rank on ties
        assert row["barrier_share"] == pytest.approx(1 - toks.mean() / toks.max())
        assert row["time_model"] == "tokens-proportional estimate"
        balances.append(toks.mean() / toks.max())
        means.append(toks.mean())
        maxes.append(toks.max())
    assert min(balances) < 1           # the dummy share made some step uneven
    s = st.sql("SELECT * FROM dp_balance_summary WHERE run_id = ?", [rid]).row(0, named=True)
    assert s["balance_mean"] == pytest.approx(np.mean(balances))
    assert s["balance_min"] == pytest.approx(min(balances))
    assert s["balance_overall"] == pytest.approx(sum(means) / sum(maxes))
    assert s["barrier_share"] == pytest.approx(1 - sum(means) / sum(maxes))
    assert s["barrier_ns"] is None and s["timed_steps"] == 0      # synth records no step times


def _routing(st, rid):
    return st.sql("SELECT step, layer, token, expert FROM routing WHERE run_id = ?", [rid])


def test_fanout_and_cooccurrence_equal_hand_count_on_synth(synth_store):
    st, rid, cfg = synth_store
    R, E, rpn = cfg.ranks, cfg.experts, cfg.ranks_per_node
    tokens = defaultdict(set)
    for r in _routing(st, rid).iter_rows(named=True):
        tokens[(r["step"], r["layer"], r["token"])].add(r["expert"])
    # no placement recorded: expert e on rank e * R // E (contiguous, one slot per expert)
    ranks, nodes = defaultdict(list), defaultdict(list)
    pairs = Counter()
    for (step, layer, _), ex in tokens.items():
        rs = {e * R // E for e in ex}
        ranks[(step, layer)].append(len(rs))
        nodes[(step, layer)].append(len({r // rpn for r in rs}))
        for a, b in itertools.combinations(sorted(ex), 2):
            pairs[(layer, a, b)] += 1
    got = st.sql("SELECT * FROM dispatch_fanout WHERE run_id = ?", [rid])
    assert got.height == cfg.steps * cfg.layers
    for row in got.iter_rows(named=True):
        key = (row["step"], row["layer"])
        assert row["tokens"] == cfg.tokens_per_step
        assert row["ranks_per_token"] == pytest.approx(np.mean(ranks[key]))
        assert row["max_ranks_per_token"] == max(ranks[key])
        assert row["nodes_per_token"] == pytest.approx(np.mean(nodes[key]))
        assert row["dispatch_bytes"] == pytest.approx(sum(ranks[key]) * cfg.hidden * cfg.dtype_bytes)
        assert row["placement_source"] == "contiguous" and row["expected"] is False
        assert row["hidden_from"] == "runs" and row["nodes_from"] == "runs"
    co = st.sql("SELECT * FROM expert_cooccurrence WHERE run_id = ?", [rid])
    assert _by_key(co, ("layer", "expert_a", "expert_b"), "tokens") == dict(pairs)


# --------------------------------------------------------------------------- the reference run's real writer
@pytest.fixture(scope="module")
def refrun_store(tmp_path_factory):
    from moetrace.collect import collect

    st = Store(tmp_path_factory.mktemp("rr") / "st", create=True)
    rd = collect([SAMPLES / "refrun_eplb"])[0]
    res = st.write_run(rd.run, rd.tables, run_id="rr")
    return st, res.run_id


def test_views_on_reference_run_with_slots_and_replicas(refrun_store):
    """The writer records each choice's physical slot (replicas picked by a token hash) and
    step times: ranks come from the slot (slot // slots per rank), the barrier time from the
    step's span over its ranks."""
    st, rid = refrun_store
    folder = SAMPLES / "refrun_eplb"
    meta = json.loads((folder / "moetrace-refrun.json").read_text())
    spr = meta["slots_per_rank"]
    routing = pa.concat_tables([pq.read_table(folder / f"routing_rank{r}.parquet") for r in range(4)]).to_pylist()
    dest = defaultdict(set)
    for r in routing:
        dest[(r["step"], r["layer"], r["token"])].add(r["slot"] // spr)
    per_cell = defaultdict(list)
    for (step, layer, _), rs in dest.items():
        per_cell[(step, layer)].append(len(rs))
    got = st.sql("SELECT * FROM dispatch_fanout WHERE run_id = ?", [rid])
    assert got.height == len(per_cell)
    for row in got.iter_rows(named=True):
        v = per_cell[(row["step"], row["layer"])]
        assert row["ranks_per_token"] == pytest.approx(np.mean(v)) and row["placement_source"] == "slot"
        # the reference run computes in float32 on CPU: 4 bytes per element, recorded
        assert row["dispatch_bytes"] == pytest.approx(sum(v) * meta["config"]["hidden"] * 4)
        assert (row["hidden_from"], row["dtype_from"]) == ("runs", "runs")
    steps = pa.concat_tables([pq.read_table(folder / f"steps_rank{r}.parquet") for r in range(4)]).to_pylist()
    by_step = defaultdict(list)
    for s in steps:
        by_step[s["step"]].append(s)
    bal = st.sql("SELECT * FROM dp_balance WHERE run_id = ? ORDER BY step", [rid])
    uneven = 0
    for row in bal.iter_rows(named=True):
        ss = by_step[row["step"]]
        toks = np.array([s["num_tokens"] for s in sorted(ss, key=lambda s: s["rank"])], float)
        span = max(s["end_ns"] for s in ss) - min(s["start_ns"] for s in ss)
        assert row["step_ns"] == span
        assert row["balance"] == pytest.approx(toks.mean() / toks.max())
        assert row["barrier_ns"] == pytest.approx(span * (1 - toks.mean() / toks.max()))
        uneven += toks.mean() < toks.max()
    assert uneven == len(meta["config"]["idle"])      # the idle (step, rank) pairs the run was told to make


def test_fanout_expectation_over_replicas_closed_form(tmp_path):
    """A choice of a replicated expert without a recorded slot reaches one copy, evenly at
    random: the view gives the expected distinct ranks. One token chooses experts 0 and 1;
    expert 0 has two copies on rank 0 and one on rank 1, expert 1 sits on rank 1: rank 1 is
    always reached, rank 0 with probability 2/3, so 5/3 ranks; both ranks are on node 0."""
    st = Store(tmp_path / "st", create=True)
    run = {"source": "hand", "source_sha256": "0" * 64, "collector": "generic", "time_base": "none",
           "num_layers": 1, "num_experts": 2, "top_k": 2, "num_ranks": 2, "ranks_per_node": 2, "num_slots": 4}
    routing = pa.table({"step": pa.array([0, 0], pa.int64()), "layer": pa.array([0, 0], pa.int32()),
                        "token": pa.array([0, 0], pa.int64()), "src_rank": pa.nulls(2, pa.int32()),
                        "choice": pa.array([0, 1], pa.int8()), "expert": pa.array([0, 1], pa.int32()),
                        "slot": pa.nulls(2, pa.int32()), "gate": pa.nulls(2, pa.float32())})
    load = pa.table({"step": pa.array([0, 0], pa.int64()), "layer": pa.array([0, 0], pa.int32()),
                     "expert": pa.array([0, 1], pa.int32()), "slot": pa.nulls(2, pa.int32()),
                     "src_rank": pa.nulls(2, pa.int32()), "tokens": pa.array([1, 1], pa.int64())})
    placement = pa.table({"plan_id": ["recorded"] * 4, "layer": pa.array([0] * 4, pa.int32()),
                          "slot": pa.array([0, 1, 2, 3], pa.int32()), "rank": pa.array([0, 0, 1, 1], pa.int32()),
                          "node": pa.array([0] * 4, pa.int32()), "expert": pa.array([0, 0, 0, 1], pa.int32())})
    rid = st.write_run(run, {"routing": routing, "expert_load": load, "placement": placement}, run_id="hand").run_id
    row = st.sql("SELECT * FROM dispatch_fanout_tokens WHERE run_id = ?", [rid]).row(0, named=True)
    assert row["ranks"] == pytest.approx(1 + 2 / 3) and row["nodes"] == pytest.approx(1.0)
    assert row["expected"] is True and row["placement_source"] == "recorded"
    share = rank_shares(np.array([0, 0, 0, 1]), 2, 2)
    assert fanout(np.array([[0, 1]]), share)[0] == pytest.approx(1 + 2 / 3)


def test_views_empty_without_per_token_routing(tmp_path, runner, cli):
    st = Store(tmp_path / "st", create=True)
    rid = synth(st, SynthConfig(layers=1, experts=8, top_k=2, ranks=2, ranks_per_node=2, steps=3, tokens_per_step=16)).run_id
    for v in ("dispatch_fanout", "expert_cooccurrence"):
        assert st.sql(f"SELECT count(*) AS n FROM {v} WHERE run_id = ?", [rid])["n"][0] == 0
    assert st.sql("SELECT count(*) AS n FROM dp_balance WHERE run_id = ?", [rid])["n"][0] == 3
    for v in ("dispatch_fanout", "expert_cooccurrence"):
        r = invoke(runner, cli, "tables", v)
        assert r.exit_code == 0 and "Empty for a run without per-token routing" in r.output
    r = invoke(runner, cli, "tables", "dp_balance")
    assert "tokens-proportional estimate" in r.output


def test_sql_defaults_are_the_model_shape_defaults():
    """The fan-out bytes default to the same hidden size and dtype bytes the replay assumes."""
    sql = (Path(__file__).resolve().parent.parent / "moetrace/storage/sql/52_dispatch_fanout.sql").read_text()
    assert f"coalesce(r.hidden, {DEFAULT_HIDDEN})" in sql and f"coalesce(r.dtype_bytes, {DEFAULT_DTYPE_BYTES})" in sql


# --------------------------------------------------------------------------- a real routing log
def test_views_on_real_vllm_routing_log(tmp_path):
    """vLLM route-logging patch output (Qwen1.5-MoE, 60 experts, top-4; ../shared/data):
    co-occurrence and fan-out at 4 ranks (2 per node), counted here from the JSON lines."""
    src = shared_data("real_logs", "vllm_qwen15moe_routes.jsonl.gz")
    plain = tmp_path / "routes.jsonl"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    from moetrace.collect import collect

    rd = collect([plain], options={"num_ranks": 4, "ranks_per_node": 2})[0]
    st = Store(tmp_path / "st", create=True)
    rid = st.write_run(rd.run, rd.tables, run_id="real").run_id
    pairs, per_rank, per_node, n = Counter(), [], [], 0
    with plain.open() as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") != "route":
                continue
            ex = sorted(set(rec["topk_ids"]))
            for a, b in itertools.combinations(ex, 2):
                pairs[(rec["layer"], a, b)] += 1
            rs = {e * 4 // 60 for e in ex}
            per_rank.append(len(rs))
            per_node.append(len({r // 2 for r in rs}))
            n += 1
    assert n == 21024
    co = st.sql("SELECT * FROM expert_cooccurrence WHERE run_id = ?", [rid])
    assert _by_key(co, ("layer", "expert_a", "expert_b"), "tokens") == dict(pairs)
    fo = st.sql("SELECT * FROM dispatch_fanout WHERE run_id = ?", [rid])
    assert int(fo["tokens"].sum()) == n
    assert float((fo["ranks_per_token"] * fo["tokens"]).sum() / n) == pytest.approx(np.mean(per_rank))
    assert float((fo["nodes_per_token"] * fo["tokens"]).sum() / n) == pytest.approx(np.mean(per_node))
    assert set(fo["hidden_from"]) == {"default 7168 (DeepSeek-V3)"}     # the log does not give hidden


# --------------------------------------------------------------------------- the planner
def _cliques(T=3000, E=32, groups=8, k=4, noise=0.25, seed=0):
    """Tokens that pick a whole clique {c, c+groups, c+2 groups, ...} (contiguous placement
    puts each member on another rank), a share ``noise`` picking at random."""
    rng = np.random.default_rng(seed)
    c = rng.integers(0, groups, T)
    ch = np.stack([c + groups * m for m in range(k)], 1)
    for t in np.flatnonzero(rng.random(T) < noise):
        ch[t] = rng.choice(E, k, replace=False)
    return ch


def test_cooccurrence_counts_equal_pair_counter():
    ch = _cliques(T=400, seed=1)
    ch[0] = [3, 3, 5, -1]                   # a repeated choice counts once, -1 is no choice
    want = Counter()
    for row in ch:
        ex = sorted({int(e) for e in row if e >= 0})
        for e in ex:
            want[(e, e)] += 1
        for a, b in itertools.combinations(ex, 2):
            want[(a, b)] += 1
            want[(b, a)] += 1
    got = cooccurrence_counts(ch, 32)
    assert {(a, b): int(got[a, b]) for a, b in zip(*np.nonzero(got))} == dict(want)


def test_fanout_equals_enumeration_over_replica_picks():
    """fanout = the mean over every equally likely pick of copies of the distinct ranks."""
    row = np.array([0, 1, 2, 0, 3, 1, 2, 3, 0])             # 9 slots on 3 ranks; experts 0..3
    E, R = 4, 3
    share = rank_shares(row, E, R)
    copies = {e: [s // 3 for s in range(9) if row[s] == e] for e in range(E)}
    for choice in ([0, 1], [0, 2, 3], [1, 3]):
        picks = list(itertools.product(*[copies[e] for e in choice]))
        want = np.mean([len(set(p)) for p in picks])
        assert fanout(np.array([choice]), share)[0] == pytest.approx(want)
        nodes = np.mean([len({r // 2 for r in p}) for p in picks])
        assert fanout(np.array([choice]), node_shares(share, 2))[0] == pytest.approx(nodes)


@pytest.mark.parametrize("rpn", [8, 4])
def test_cooccurrence_plan_cuts_ranks_per_token_within_tolerance(rpn):
    ch = _cliques()
    E, R = 32, 8
    load = np.bincount(ch.ravel(), minlength=E).astype(float)[None]
    co = cooccurrence_counts(ch, E)[None]
    shape = PlanShape(R, rpn, E)
    cont = make_plan("contiguous", load, shape)
    plan = cooccurrence_plan(load, co, shape, tolerance=0.10)
    # every expert placed once, ranks full
    assert sorted(plan.phy2log[0]) == list(range(E))
    f_cont = fanout(ch, rank_shares(cont.phy2log[0], E, R)).mean()
    f_plan = fanout(ch, rank_shares(plan.phy2log[0], E, R)).mean()
    # by hand: a clique token reaches 4 ranks under contiguous placement (one member per rank
    # pair) and 1 when its clique shares a rank; noise tokens are the rest
    assert f_plan < 0.6 * f_cont
    rank_load = load[0] @ rank_shares(plan.phy2log[0], E, R)
    greedy = make_plan("greedy", load, shape)
    g_load = load[0] @ rank_shares(greedy.phy2log[0], E, R)
    assert rank_load.max() <= max(1.10 * rank_load.mean(), g_load.max()) + 1e-9


def test_cooccurrence_plan_with_replicas_keeps_copies_apart():
    ch = _cliques(E=32)
    load = np.bincount(ch.ravel(), minlength=32).astype(float)
    load[0] *= 6                                    # a hot expert that gets replicas
    plan = cooccurrence_plan(load[None], cooccurrence_counts(ch, 32)[None], PlanShape(8, 4, 40), tolerance=0.1)
    row = plan.phy2log[0].reshape(8, 5)
    assert set(plan.phy2log[0]) == set(range(32)) and (np.bincount(plan.phy2log[0]) >= 1).all()
    assert all(len(set(r)) == len(r) for r in row)    # no rank holds two copies of one expert
    assert plan.params["balance_tolerance"] == 0.1


# --------------------------------------------------------------------------- report sections
def _section(st, rid, out, name):
    import importlib

    from moetrace.report.base import ReportContext

    out.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(store=st, run_id=rid, run=st.run_row(rid), outdir=out)
    return importlib.import_module(f"moetrace.report.sections.{name}").build(ctx)


def test_report_sections_state_the_counts(refrun_store, tmp_path):
    st, rid = refrun_store
    folder = SAMPLES / "refrun_eplb"
    steps = pa.concat_tables([pq.read_table(folder / f"steps_rank{r}.parquet") for r in range(4)]).to_pylist()
    by_step = defaultdict(list)
    for s in steps:
        by_step[s["step"]].append(s["num_tokens"])
    bal = [np.mean(v) / max(v) for v in by_step.values()]
    sec = _section(st, rid, tmp_path / "r", "dp_balance")
    assert f"{np.mean(bal):.3f} mean over {len(bal)} steps" in sec.terminal
    assert f"lowest {min(bal):.3f}" in sec.terminal and "tokens-proportional estimate" in sec.terminal
    assert sec.figures and sec.figures[0].path.exists()
    fo = _section(st, rid, tmp_path / "r", "fanout")
    assert "under the recorded slots" in fo.terminal and "distinct ranks" in fo.terminal


def test_report_says_why_without_routing_or_steps(tmp_path):
    st = Store(tmp_path / "st", create=True)
    rid = synth(st, SynthConfig(layers=1, experts=8, top_k=2, ranks=2, ranks_per_node=2, steps=3,
                                tokens_per_step=16)).run_id
    fo = _section(st, rid, tmp_path / "r", "fanout")
    assert "not available" in fo.terminal and "no per-token routing" in fo.terminal


def test_skew_prints_the_dp_balance_line(refrun_store, runner, cli):
    st, rid = refrun_store
    s = st.sql("SELECT * FROM dp_balance_summary WHERE run_id = ?", [rid]).row(0, named=True)
    r = invoke(runner, cli, "skew", st.path, "--by", "run")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())   # the line is wrapped to the terminal: read it as one
    line = said[said.index("attention-DP balance"):]
    assert f"{s['balance_mean']:.3f} mean over 8 steps" in line and "tokens-proportional estimate" in line
    r = invoke(runner, cli, "skew", st.path, "--by", "run", "--format", "json")
    json.loads(r.output)          # json stays one parseable table


# --------------------------------------------------------------------------- measured rank speed, rebalance stall
def test_rank_speed_equals_spans_over_received_tokens(refrun_store):
    """Time per token of each rank's expert GEMMs over its received tokens (the writer's
    received_rank*.parquet, summed by hand), relative to the median rank."""
    st, rid = refrun_store
    spans = st.sql("SELECT rank, step, layer, start_ns, end_ns FROM spans WHERE run_id = ? AND kind = 'expert_gemm' "
                   "AND step IS NOT NULL AND layer IS NOT NULL", [rid])
    cells = set(zip(spans["step"], spans["layer"]))
    ns = Counter()
    for r in spans.iter_rows(named=True):
        ns[r["rank"]] += r["end_ns"] - r["start_ns"]
    meta = json.loads((SAMPLES / "refrun_eplb" / "moetrace-refrun.json").read_text())
    spr = meta["slots_per_rank"]
    toks = Counter()
    for rank in range(4):
        for x in pq.read_table(SAMPLES / "refrun_eplb" / f"received_rank{rank}.parquet").to_pylist():
            if (x["step"], x["layer"]) in cells:
                toks[x["slot"] // spr] += x["tokens"]
    per = {r: ns[r] / toks[r] for r in ns}
    med = float(np.median(list(per.values())))
    got = st.sql("SELECT rank, tokens, ns_per_token, speed_ratio FROM rank_speed WHERE run_id = ?", [rid])
    assert {r["rank"]: r["tokens"] for r in got.iter_rows(named=True)} == dict(toks)
    for r in got.iter_rows(named=True):
        assert r["speed_ratio"] == pytest.approx(per[r["rank"]] / med)


SGL_LOG = """[2026-09-23 17:25:01 TP0 EP0] [EPLBManager] system started, will rebalance per 50 iterations.
[2026-09-23 17:27:08 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:27:13 TP0 EP0] [EPLBManager] rebalance end time=3.930s
[2026-09-23 17:27:44 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:27:46 TP0 EP0] [EPLBManager] rebalance end time=1.945s
[2026-09-23 17:28:44 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:28:46 TP0 EP0] [EPLBManager] rebalance end time=2.125s
"""


def _log_run(tmp_path, path):
    from moetrace.collect import collect

    rd = collect([path])[0]
    st = Store(tmp_path / "st", create=True)
    return st, st.write_run(rd.run, rd.tables, run_id="log").run_id


def test_rebalance_timing_of_sglang_lines(tmp_path):
    p = tmp_path / "server.log"
    p.write_text(SGL_LOG)
    st, rid = _log_run(tmp_path, p)
    r = st.sql("SELECT * FROM rebalance_timing WHERE run_id = ?", [rid]).row(0, named=True)
    assert (r["engine"], r["rebalances"], r["started"], r["skipped"]) == ("sglang", 3, 3, 0)
    assert r["total_s"] == pytest.approx(3.930 + 1.945 + 2.125)
    assert r["median_s"] == pytest.approx(2.125) and r["max_s"] == pytest.approx(3.930)


def test_rebalance_timing_of_real_sglang_log(tmp_path):
    """The real EPLBManager log: 19 rebalances, 38.719 s in all (../shared/data/README.md)."""
    st, rid = _log_run(tmp_path, shared_data("real_logs", "sglang_eplbmanager_a100.log"))
    r = st.sql("SELECT * FROM rebalance_timing WHERE run_id = ?", [rid]).row(0, named=True)
    assert r["rebalances"] == 19 and r["total_s"] == pytest.approx(38.719)

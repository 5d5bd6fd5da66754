"""The replay's fan-out, co-occurrence policy, replica dispatch rules, rank speed and move
schedules, end to end through the CLI and the facade, each checked against a count made
here (sets of destination ranks, closed forms)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.run import ClusterSpec, Store

from .helpers import invoke

E, R, RPN, K, G = 32, 8, 4, 4, 8


def _correlated_routing(path, steps=20, tokens=192, noise=0.25, seed=0):
    """Tokens that pick a whole clique {c, c + 8, c + 16, c + 24} (contiguous placement puts
    each member on another rank), a share ``noise`` picking four experts at random."""
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("step", "layer", "token", "src_rank", "choice", "expert")}
    for t in range(steps):
        for layer in range(2):
            c = rng.integers(0, G, tokens)
            ch = np.stack([c + G * m for m in range(K)], 1)
            for i in np.flatnonzero(rng.random(tokens) < noise):
                ch[i] = rng.choice(E, K, replace=False)
            cols["step"].append(np.full(tokens * K, t))
            cols["layer"].append(np.full(tokens * K, layer))
            cols["token"].append(np.repeat(np.arange(tokens), K))
            cols["src_rank"].append(np.repeat(np.arange(tokens) * R // tokens, K))
            cols["choice"].append(np.tile(np.arange(K), tokens))
            cols["expert"].append(ch.ravel())
    types = {"step": pa.int64(), "layer": pa.int32(), "token": pa.int64(), "src_rank": pa.int32(),
             "choice": pa.int8(), "expert": pa.int32()}
    pq.write_table(pa.table({k: pa.array(np.concatenate(v), types[k]) for k, v in cols.items()}), path)


@pytest.fixture(scope="module")
def corr(tmp_path_factory):
    from moetrace.collect import collect

    d = tmp_path_factory.mktemp("corr")
    _correlated_routing(d / "routing.parquet")
    rd = collect([d / "routing.parquet"], options={"num_ranks": R, "ranks_per_node": RPN, "top_k": K})[0]
    st = Store(d / "st", create=True)
    rid = st.write_run(rd.run, rd.tables, run_id="corr").run_id
    return st, rid, d / "routing.parquet"


def _ranks_per_token(routing_path, steps, rank_of):
    """Mean distinct destination ranks per (step, layer, token) over ``steps``, counted with
    sets; ``rank_of(layer, expert)``."""
    t = pq.read_table(routing_path).to_pydict()
    dest: dict = {}
    for s, layer, tok, e in zip(t["step"], t["layer"], t["token"], t["expert"]):
        if s in steps:
            dest.setdefault((s, layer, tok), set()).add(rank_of(layer, e))
    return float(np.mean([len(v) for v in dest.values()]))


def test_cooccurrence_policy_cuts_ranks_per_token(corr):
    st, rid, path = corr
    run = st.run(rid)
    res = run.replay(policy="cooccurrence", write=False)
    plan = res.judged.plan
    judged = set(int(s) for s in res.judged.steps)
    spr = plan.slots_per_rank
    where = {(li, int(e)): s // spr for li in range(plan.num_layers) for s, e in enumerate(plan.phy2log[li])}
    want_plan = _ranks_per_token(path, judged, lambda layer, e: where[(layer, e)])
    want_rec = _ranks_per_token(path, judged, lambda layer, e: e * R // E)     # contiguous: no placement recorded
    d = res.to_dict()
    assert d["ranks_per_token"] == pytest.approx(want_plan)
    assert d["recorded_ranks_per_token"] == pytest.approx(want_rec)
    assert d["ranks_per_token"] < 0.6 * d["recorded_ranks_per_token"]
    # what it costs in balance, on the load it was fitted on: within 10% of the mean
    fit = st.sql("SELECT layer, expert, sum(tokens) AS t FROM expert_load WHERE run_id = ? AND step < 10 "
                 "GROUP BY ALL", [rid])
    load = np.zeros((2, E))
    for r in fit.iter_rows(named=True):
        load[r["layer"], r["expert"]] = r["t"]
    for li in range(2):
        per_rank = np.bincount(np.arange(E) // spr, weights=load[li, plan.phy2log[li]], minlength=R)
        assert per_rank.max() <= 1.10 * per_rank.mean() + 1e-9
    assert d["load"]["layers"][0]["plan_max_over_mean"] > d["load"]["layers"][0]["recorded_max_over_mean"]


def test_replay_json_keys_and_refusal_without_routing(corr, tmp_path, runner, cli):
    st, rid, _ = corr
    r = invoke(runner, cli, "replay", st.path, "--policy", "cooccurrence", "--balance-tolerance", "0.2", "--json",
               "--no-rank-rows")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"ranks_per_token", "recorded_ranks_per_token"} <= set(d)
    assert d["fanout"]["recorded"]["placement_source"] == "contiguous"
    from moetrace.produce.synth import SynthConfig, synth

    st2 = Store(tmp_path / "agg", create=True)
    synth(st2, SynthConfig(layers=1, experts=8, top_k=2, ranks=2, ranks_per_node=2, steps=6, tokens_per_step=16))
    r = invoke(runner, cli, "replay", st2.path, "--policy", "cooccurrence")
    assert r.exit_code == 2 and "per-token routing" in r.output and len(r.output.strip().splitlines()) == 1


def test_replica_dispatch_side_by_side(corr, runner, cli):
    """The even rule is every copy's equal share of its expert's tokens (numpy by hand from the
    plan and the stored counts); least-loaded never leaves a larger straggler."""
    st, rid, _ = corr
    res = st.run(rid).replay(policy="eplb-global", cluster=ClusterSpec(replicas=8), write=False,
                             replica_dispatch="both", rank_rows=False)
    plan, steps = res.judged.plan, res.judged.steps
    cnt = st.sql("SELECT step, layer, expert, sum(tokens) AS t FROM expert_load WHERE run_id = ? GROUP BY ALL", [rid])
    load = np.zeros((int(steps.max()) + 1, 2, E))
    for r in cnt.iter_rows(named=True):
        load[r["step"], r["layer"], r["expert"]] = r["t"]
    share = plan.share()                                    # [L, E, R]: copies on r / copies
    strag = [np.max(load[s, li] @ share[li]) for s in steps for li in range(2)]
    rd = res.dispatch
    assert rd["even"]["plan"]["straggler_tokens_mean"] == pytest.approx(np.mean(strag))
    assert rd["least-loaded"]["plan"]["straggler_tokens_mean"] < rd["even"]["plan"]["straggler_tokens_mean"]
    assert rd["least-loaded"]["recorded"] == rd["even"]["recorded"]      # one copy per expert: nothing to choose
    r = invoke(runner, cli, "replay", st.path, "--policy", "eplb-global", "--replicas", "8", "--replica-dispatch",
               "least-loaded", "--no-rank-rows")
    assert r.exit_code == 0 and "replica dispatch least-loaded: plan straggler" in r.output


def test_rank_speed_scales_the_slow_rank(corr, runner, cli):
    """A linear cost model (a per token, b per slot touched) times rank r's experts at
    speed[r] x (a tokens + b touched): checked on one array by hand, then end to end."""
    from moetrace.costmodel.step_cost import CostModel

    cm = CostModel(a_ns=2.0, b_ns=10.0, nvlink_Bps=1e9, internode_Bps=1e9, source="hand", rank_speed=(1.0, 1.5))
    tok, touched = np.array([[4.0, 4.0]]), np.array([[1, 1]])
    assert cm.compute_ns(tok, touched).tolist() == [[18.0, 27.0]]
    _, comp, _ = cm.rank_ns(tok, touched, np.zeros((1, 2)), np.zeros((1, 2)))
    assert comp.tolist() == [[18.0, 27.0]]
    st, rid, _ = corr
    base = json.loads(invoke(runner, cli, "replay", st.path, "--plan", "recorded", "--json", "--no-rank-rows").output)
    slow = invoke(runner, cli, "replay", st.path, "--plan", "recorded", "--rank-speed", "3:2.0", "--json",
                  "--no-rank-rows")
    assert slow.exit_code == 0, slow.output
    slow = json.loads(slow.output)
    assert slow["cost"]["rank_speed"][3] == 2.0 and slow["gross_step_ns"] > base["gross_step_ns"]
    bad = invoke(runner, cli, "replay", st.path, "--plan", "recorded", "--rank-speed", "9:1.1")
    assert bad.exit_code == 2 and "rank" in bad.output
    bad = invoke(runner, cli, "replay", st.path, "--plan", "recorded", "--rank-speed", "measured")
    assert bad.exit_code == 2 and "rank_speed" in bad.output       # no profiler spans in this run


SGL_LOG = """[2026-09-23 17:27:08 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:27:13 TP0 EP0] [EPLBManager] rebalance end time=3.930s
[2026-09-23 17:27:44 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:27:46 TP0 EP0] [EPLBManager] rebalance end time=1.945s
[2026-09-23 17:28:44 TP0 EP0] [EPLBManager] rebalance start
[2026-09-23 17:28:46 TP0 EP0] [EPLBManager] rebalance end time=2.125s
"""


def test_move_schedule_and_measured_stall(tmp_path, runner, cli):
    """--move-stall-ms measured charges the median logged rebalance (2.125 s of 3.930, 1.945,
    2.125); --layers-per-step 1 over 2 layers: the second layer waits one step, so half the
    gain per step is lost once, and break-even = (charge + gain / 2) / gain."""
    from moetrace.collect import collect

    _correlated_routing(tmp_path / "routing.parquet", steps=12, tokens=64)
    (tmp_path / "server.log").write_text(SGL_LOG)
    st = Store(tmp_path / "st", create=True)
    for f, opts in (("routing.parquet", {"num_ranks": R, "ranks_per_node": RPN, "top_k": K}), ("server.log", {})):
        rd = collect([tmp_path / f], options=opts)[0]
        st.write_run(rd.run, rd.tables, run_id=f.split(".")[0])
    r = invoke(runner, cli, "replay", st.path, "--run", "routing", "--policy", "cooccurrence", "--move-stall-ms",
               "measured", "--layers-per-step", "1", "--json", "--no-rank-rows")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["move_cost"]["stall_ns"] == pytest.approx(2.125e9) and "3 sglang rebalances" in d["move_cost"]["stall_source"]
    c, sc = d["changes"][0], d["move_schedules"][0]
    assert sc["steps"] == 2 and sc["layers_per_step"] == 1
    assert sc["charged_ns"] == pytest.approx(c["charged_ns"])
    gain = c["gain_per_step_ns"]
    if gain > 0:
        assert sc["transition_loss_ns"] == pytest.approx(gain / 2)
        assert sc["break_even_steps"] == pytest.approx((c["charged_ns"] + gain / 2) / gain)
    else:
        assert sc["break_even_steps"] is None
    r = invoke(runner, cli, "replay", st.path, "--run", "routing", "--plan", "recorded", "--move-stall-ms", "soon")
    assert r.exit_code == 2 and "--move-stall-ms" in r.output
    sw = invoke(runner, cli, "sweep", st.path, "--run", "routing", "--policy", "greedy", "--replicas", "0",
                "--layers-per-step", "1", "--move-stall-ms", "measured:server", "--format", "json")
    assert sw.exit_code == 0, sw.output
    assert json.loads(sw.output)[0]["layers_per_step"] == 1

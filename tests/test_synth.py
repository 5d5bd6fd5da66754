import itertools
import json

import numpy as np
import pytest

from moetrace.errors import InputError
from moetrace.produce.synth import SynthConfig, load_popularity_file, sample_topk, synth
from moetrace.run import Store

from .helpers import module_fixture, shared_data


def inclusion_probabilities(p, k):
    """Exact P(expert e among a token's k picks) under successive sampling without
    replacement, by enumerating every ordered draw sequence (independent of the sampler)."""
    E = len(p)
    pi = np.zeros(E)
    for seq in itertools.permutations(range(E), k):
        prob, used = 1.0, 0.0
        for e in seq:
            prob *= p[e] / (1.0 - used)
            used += p[e]
        for e in seq:
            pi[e] += prob
    return pi


def test_sampler_matches_exact_inclusion_probabilities():
    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    k, n = 2, 200_000
    rng = np.random.default_rng(1)
    picks = sample_topk(p, n, k, rng)
    assert (picks[:, 0] != picks[:, 1]).all()
    freq = np.bincount(picks.ravel(), minlength=5) / n
    pi = inclusion_probabilities(p, k)
    assert pi.sum() == pytest.approx(k)
    se = np.sqrt(pi * (1 - pi) / n)
    assert np.all(np.abs(freq - pi) < 5 * se + 1e-4), (freq, pi)
    # first choice is drawn proportionally to p
    first = np.bincount(picks[:, 0], minlength=5) / n
    assert np.all(np.abs(first - p) < 5 * np.sqrt(p * (1 - p) / n))


@module_fixture
def small_run(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("synth") / "st", create=True)
    cfg = SynthConfig(layers=2, experts=16, top_k=4, ranks=4, ranks_per_node=2, steps=20, tokens_per_step=300,
                      sigma=0.8, per_token=True, dummy_share=0.25, seed=7)
    res = synth(st, cfg, run_id="small")
    return st, cfg, res


def test_loads_sum_to_tokens_times_topk_exactly(small_run):
    st, cfg, _ = small_run
    df = st.sql("SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL")
    assert df.height == cfg.steps * cfg.layers
    assert set(df["t"].to_list()) == {cfg.tokens_per_step * cfg.top_k}


def test_no_token_picks_an_expert_twice_and_routing_aggregates_to_load(small_run):
    st, cfg, _ = small_run
    dup = st.sql("SELECT count(*) AS n FROM (SELECT step, layer, token, expert, count(*) c FROM routing "
                 "GROUP BY ALL HAVING c > 1)")
    assert dup["n"][0] == 0
    per_tok = st.sql("SELECT DISTINCT c FROM (SELECT step, layer, token, count(*) c FROM routing GROUP BY ALL)")
    assert per_tok["c"].to_list() == [cfg.top_k]
    diff = st.sql("""SELECT count(*) AS n FROM (
        SELECT step, layer, expert, count(*) AS t FROM routing GROUP BY ALL) r
        FULL JOIN (SELECT step, layer, expert, tokens FROM expert_load WHERE tokens > 0) l USING (step, layer, expert)
        WHERE r.t IS DISTINCT FROM l.tokens""")
    assert diff["n"][0] == 0


def test_tokens_come_from_dp_ranks_and_dummy_ranks_get_none(small_run):
    st, cfg, _ = small_run
    steps = st.sql("SELECT step, rank, num_tokens, is_dummy, phase FROM steps ORDER BY step, rank")
    assert steps.height == cfg.steps * cfg.ranks
    per_step = st.sql("SELECT step, sum(num_tokens) AS n FROM steps GROUP BY step")
    assert set(per_step["n"].to_list()) == {cfg.tokens_per_step}
    dummies = steps.filter(steps["is_dummy"])
    assert (dummies["num_tokens"] == 0).all() and set(dummies["phase"].to_list()) <= {"idle"}
    share = dummies.height / steps.height
    assert 0.1 < share < 0.4  # 80 pairs at 25%: well inside
    # routing's src_rank agrees with steps.num_tokens
    r = st.sql("SELECT step, src_rank AS rank, count(DISTINCT token) AS n FROM routing WHERE layer = 0 GROUP BY ALL")
    j = r.join(steps.select("step", "rank", "num_tokens"), on=["step", "rank"])
    assert (j["n"] == j["num_tokens"]).all() and j.height == steps.filter(~steps["is_dummy"]).height


def test_measured_shares_converge_to_true_popularity(tmp_path):
    st = Store(tmp_path / "st", create=True)
    cfg = SynthConfig(layers=1, experts=32, top_k=1, ranks=4, ranks_per_node=4, steps=40, tokens_per_step=2000,
                      sigma=1.0, seed=3)
    synth(st, cfg)
    # with top_k=1 the expected share of an expert is exactly its popularity
    df = st.sql("""SELECT l.expert, sum(l.tokens)::DOUBLE / (SELECT sum(tokens) FROM expert_load) AS share,
                   any_value(p.p_start) AS p FROM expert_load l JOIN true_popularity p USING (run_id, layer, expert)
                   GROUP BY l.expert ORDER BY l.expert""")
    n = cfg.steps * cfg.tokens_per_step
    se = np.sqrt(df["p"].to_numpy() * (1 - df["p"].to_numpy()) / n)
    assert np.all(np.abs(df["share"].to_numpy() - df["p"].to_numpy()) < 5 * se)


def test_drift_moves_popularity_toward_the_end_vector(tmp_path):
    st = Store(tmp_path / "st", create=True)
    cfg = SynthConfig(layers=1, experts=64, top_k=1, ranks=4, ranks_per_node=4, steps=21, tokens_per_step=4000,
                      sigma=1.0, drift=1.0, seed=5)
    synth(st, cfg)
    truth = st.sql("SELECT expert, p_start, p_end FROM true_popularity ORDER BY expert")
    first = st.sql("SELECT expert, tokens FROM expert_load WHERE step = 0 ORDER BY expert")["tokens"].to_numpy()
    last = st.sql("SELECT expert, tokens FROM expert_load WHERE step = 20 ORDER BY expert")["tokens"].to_numpy()
    ps, pe = truth["p_start"].to_numpy(), truth["p_end"].to_numpy()
    assert sorted(np.round(ps, 12)) == sorted(np.round(pe, 12))  # same skew, other experts hot
    assert np.corrcoef(first, ps)[0, 1] > 0.8 and np.corrcoef(first, pe)[0, 1] < 0.5
    assert np.corrcoef(last, pe)[0, 1] > 0.8 and np.corrcoef(last, ps)[0, 1] < 0.5


def test_popularity_from_real_sglang_counts(tmp_path):
    path = shared_data("sglang_dsv3_expert_counts", "decode_in1000out1000.json")
    counts = np.asarray(json.loads(path.read_text())["logical_count"], dtype=float)
    moe = counts[counts.sum(axis=1) > 0]
    pop = load_popularity_file(path, layers=3, experts=256)
    np.testing.assert_allclose(pop, moe[:3] / moe[:3].sum(axis=1, keepdims=True))
    st = Store(tmp_path / "st", create=True)
    synth(st, SynthConfig(layers=3, steps=10, tokens_per_step=2048, popularity_from=str(path), seed=1))
    got = st.sql("SELECT layer, expert, sum(tokens) AS t FROM expert_load GROUP BY ALL ORDER BY ALL")
    t = got["t"].to_numpy().reshape(3, 256)
    for layer in range(3):
        assert np.corrcoef(t[layer], moe[layer])[0, 1] > 0.9


def test_bad_configurations_are_refused():
    with pytest.raises(InputError, match="--top-k"):
        SynthConfig(experts=4, top_k=5, ranks=2, ranks_per_node=2).validate()
    with pytest.raises(InputError, match="divide evenly"):
        SynthConfig(experts=10, ranks=4, ranks_per_node=4).validate()
    with pytest.raises(InputError, match="--drift"):
        SynthConfig(drift=1.5).validate()

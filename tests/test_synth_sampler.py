"""The fast top-k sampler of ``moetrace synth`` (TopKSampler) against the law it must have
(successive sampling without replacement ∝ popularity, computed exactly by enumeration)
and against the earlier float alias sampler kept in tests/synth_oracle.py (two-sample
tests). Every test runs at a fixed seed, so it is deterministic; the thresholds are the
chi-square quantile at p = 1e-6 (Wilson–Hilferty), far from what a correct sampler gives.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pyarrow as pa
import pytest

from moetrace.produce.synth import SynthConfig, TopKSampler, generate, sample_topk, share_thresholds

from . import synth_oracle


def chi2_quantile(df: int, z: float = 4.75) -> float:
    """Upper chi-square quantile (z = 4.75: p ≈ 1e-6), Wilson–Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def gof(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square of observed ``counts`` against cell probabilities ``probs``."""
    n = counts.sum()
    exp = n * probs
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a cell of probability 0 was observed"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square: do counts ``a`` and ``b`` come from the same cell law?"""
    na, nb = a.sum(), b.sum()
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    stat = ((a * math.sqrt(nb / na) - b * math.sqrt(na / nb)) ** 2 / (a + b)).sum()
    return float(stat), int(keep.sum()) - 1


def exact_sequences(p: np.ndarray, k: int) -> dict[tuple[int, ...], float]:
    """P(ordered choices = seq) for every sequence of k distinct experts (by hand: the
    product of p[e] / (1 - mass already chosen))."""
    out = {}
    for seq in itertools.permutations(range(len(p)), k):
        prob, used = 1.0, 0.0
        for e in seq:
            prob *= p[e] / (1.0 - used)
            used += p[e]
        out[seq] = prob
    return out


def new_picks(p, n, k, seed):
    return sample_topk(p, n, k, np.random.default_rng(seed))


def old_picks(p, n, k, seed):
    return synth_oracle.sample_topk(p, n, k, np.random.default_rng(seed))


P7 = np.array([0.31, 0.22, 0.17, 0.12, 0.09, 0.06, 0.03])


@pytest.mark.parametrize("sampler", [new_picks, old_picks], ids=["new", "oracle"])
def test_ordered_pairs_and_sets_follow_successive_sampling(sampler):
    """(first, second) choice and the unordered 3-set against their exact probabilities;
    the oracle passes the same test (so the test itself is sound)."""
    k, n, E = 3, 200_000, len(P7)
    picks = sampler(P7, n, k, 11)
    assert picks.shape == (n, k)
    assert (picks[:, 0] != picks[:, 1]).all() and (picks[:, 0] != picks[:, 2]).all() and (picks[:, 1] != picks[:, 2]).all()
    seqs = exact_sequences(P7, k)
    first = np.bincount(picks[:, 0], minlength=E)
    stat, df = gof(first, P7)
    assert stat < chi2_quantile(df), ("first choice", stat, df)
    pair = np.bincount(picks[:, 0] * E + picks[:, 1], minlength=E * E)
    pp = np.zeros(E * E)
    for (a, b, _), q in seqs.items():
        pp[a * E + b] += q
    stat, df = gof(pair, pp)
    assert stat < chi2_quantile(df), ("ordered pair", stat, df)
    ps = np.zeros(E ** 3)                       # unordered set {a < b < c} as cell a·E² + b·E + c
    for s, q in seqs.items():
        a, b, c = sorted(s)
        ps[(a * E + b) * E + c] += q
    srt = np.sort(picks, axis=1)
    got = np.bincount((srt[:, 0] * E + srt[:, 1]) * E + srt[:, 2], minlength=E ** 3)
    stat, df = gof(got, ps)
    assert stat < chi2_quantile(df), ("3-set", stat, df)


def test_fleet_shaped_inclusion_and_pairwise_inclusion_match_the_oracle():
    """256 log-normal experts (sigma 0.6), top-8: per-expert first-choice and inclusion
    counts, and the co-inclusion of the 16 hottest experts' pairs, new vs oracle."""
    E, k, n = 256, 8, 60_000
    rng = np.random.default_rng(5)
    w = np.exp(0.6 * rng.standard_normal(E))
    p = w / w.sum()
    new, old = new_picks(p, n, k, 1), old_picks(p, n, k, 2)
    for a in (new, old):
        assert (np.diff(np.sort(a, axis=1), axis=1) > 0).all()   # k distinct experts per token
        stat, df = gof(np.bincount(a[:, 0], minlength=E), p)
        assert stat < chi2_quantile(df)
    stat, df = homogeneity(np.bincount(new.ravel(), minlength=E), np.bincount(old.ravel(), minlength=E))
    assert stat < chi2_quantile(df), ("inclusion", stat, df)
    hot = np.argsort(p)[::-1][:16]

    def co(a):
        m = np.zeros((n, E), bool)
        m[np.arange(n)[:, None], a] = True
        h = m[:, hot].astype(np.int64)
        c = h.T @ h
        return c[np.triu_indices(16, 1)]

    stat, df = homogeneity(co(new), co(old))
    assert stat < chi2_quantile(df), ("pairwise inclusion", stat, df)


def test_mixture_rows_padding_and_zero_popularity():
    """A draw from row 2 with probability share; experts of popularity 0 (and the padding
    of 5 experts to 8 bins) are never picked; 300 experts (9-bit bins) are right too."""
    p0 = np.array([0.5, 0.0, 0.3, 0.2, 0.0])
    p1 = np.array([0.0, 0.4, 0.1, 0.1, 0.4])
    s = TopKSampler(np.stack([p0, p1]))
    n = 100_000
    bitgen = np.random.PCG64(3)
    g = s.row_offsets(np.zeros(n, np.int64))
    only0 = s.draw(g, 3, bitgen)
    assert set(np.unique(only0).tolist()) == {0, 2, 3}
    assert (np.sort(only0, axis=0) == np.array([[0], [2], [3]])).all()
    share = 0.3
    mix = (s.row_offsets(np.ones(n, np.int64)), share_thresholds(np.full(n, share)))
    first = s.draw(g, 1, bitgen, mix)[0]
    stat, df = gof(np.bincount(first, minlength=5), (1 - share) * p0 + share * p1)
    assert stat < chi2_quantile(df)
    # the oracle's mixture gives the same law
    prob, alias = synth_oracle.alias_tables(np.stack([p0, p1]))
    o = synth_oracle.draw_topk(prob, alias, np.zeros(n, np.int64), 1, np.random.default_rng(4),
                               (np.ones(n, np.int64), np.full(n, share)))[:, 0]
    stat, df = homogeneity(np.bincount(first, minlength=5), np.bincount(o, minlength=5))
    assert stat < chi2_quantile(df)
    assert share_thresholds(np.array([0.0, 1.0])).tolist() == [0, 2**64 - 1]
    w = np.arange(1, 301, dtype=float)
    s3 = TopKSampler(w[None])
    assert s3.b == 9
    f = s3.draw(s3.row_offsets(np.zeros(200_000, np.int64)), 1, np.random.PCG64(9))[0]
    stat, df = gof(np.bincount(f, minlength=300), w / w.sum())
    assert stat < chi2_quantile(df)


def _grid(tbl: pa.Table, T: int, L: int, E: int) -> np.ndarray:
    t = tbl.sort_by([("step", "ascending"), ("layer", "ascending"), ("expert", "ascending")])
    return t.column("tokens").to_numpy().reshape(T, L, E)


def test_every_step_layer_sums_to_tokens_times_top_k_dense_and_long_alike():
    cfg = SynthConfig(layers=3, experts=32, top_k=4, ranks=4, ranks_per_node=2, steps=37, tokens_per_step=700,
                      sigma=0.9, drift=0.5, seed=4)
    _, long = generate(cfg)
    _, dense = generate(cfg, dense=True)
    assert "expert_load" not in dense and "expert_counts" in dense
    g = _grid(pa.concat_tables(list(long["expert_load"])), cfg.steps, cfg.layers, cfg.experts)
    assert (g.sum(axis=2) == cfg.tokens_per_step * cfg.top_k).all()
    assert (g <= cfg.tokens_per_step).all()          # an expert at most once per token
    d = pa.concat_tables(list(dense["expert_counts"]))
    counts = np.array(d.column("tokens").to_pylist()).reshape(cfg.steps, cfg.layers, cfg.experts)
    assert (counts == g).all()                       # one law, one stream: the same numbers
    again = _grid(pa.concat_tables(list(long["expert_load"])), cfg.steps, cfg.layers, cfg.experts)
    assert (again == g).all()                        # a second pass draws the same tokens
    _, other = generate(SynthConfig(**{**cfg.__dict__, "seed": 5}))
    assert (_grid(pa.concat_tables(list(other["expert_load"])), cfg.steps, cfg.layers, cfg.experts) != g).any()


def test_cells_larger_than_a_block_still_sum_exactly():
    from moetrace.produce import synth as mod

    cfg = SynthConfig(layers=2, experts=16, top_k=3, ranks=2, ranks_per_node=2, steps=3,
                      tokens_per_step=mod.BLOCK_TOKENS + 123, seed=2)
    _, tables = generate(cfg)
    g = _grid(pa.concat_tables(list(tables["expert_load"])), cfg.steps, cfg.layers, cfg.experts)
    assert (g.sum(axis=2) == cfg.tokens_per_step * cfg.top_k).all()

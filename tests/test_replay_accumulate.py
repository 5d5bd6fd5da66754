"""The replay's streaming accumulators against the concatenate-then-compute implementation
they replaced (a plain second implementation here), and their memory bound."""
from __future__ import annotations

import numpy as np
import pytest

from moetrace.replay.accumulate import (
    LoadAccumulator,
    Quantiles,
    SummaryAccumulator,
    percentile_from_counts,
    rel_error_text,
)
from moetrace.replay.engine import summarize


# ----------------------------------------------------------------------------- the old way, by hand
def _old_summary(imb, lns, means):
    """engine.summarize before the accumulators: every cell kept, then computed."""
    flat = imb.ravel()
    ok = flat[~np.isnan(flat)]
    e = np.where(lns > 0, means / np.where(lns > 0, lns, 1), np.nan)
    e = e[~np.isnan(imb) & ~np.isnan(e)]
    return dict(mean=ok.mean() if ok.size else None, p99=np.percentile(ok, 99) if ok.size else None,
                max=ok.max() if ok.size else None, undefined=flat.size - ok.size, cells=flat.size,
                step_ns=int(round(float(lns.sum(axis=1).mean()))), eff=e.mean() if e.size else None)


def _old_layer_loads(mx_all, rk_all, mn_all):
    """results._layer_loads before the accumulators: per layer over the concatenated steps."""
    out = []
    for li in range(mx_all.shape[1]):
        rk, mx, mn = rk_all[:, li], mx_all[:, li], mn_all[:, li]
        ok = rk >= 0
        if not ok.any():
            out.append(None)
            continue
        cnt = np.bincount(rk[ok])
        out.append((int(np.argmax(cnt)), int(cnt.max()), mx[ok].mean(), np.percentile(mx[ok], 99), mn[ok].mean(),
                    (mx[ok] / mn[ok]).mean()))
    return out


def _random_run(rng, T, L, R, integer=True, poisson=True):
    """[T, L] per-(step, layer) arrays as a replay block gives them: rank tokens with ties
    (small integers), some (step, layer) cells with no tokens (NaN imbalance, straggler -1)."""
    tok = (rng.poisson(3.0, size=(T, L, R)) if poisson else rng.integers(0, 10, size=(T, L, R))).astype(np.float64)
    if not integer:
        tok = tok / rng.choice([1.0, 2.0, 3.0], size=(T, L, R))
    tok[rng.random((T, L)) < 0.1] = 0.0          # no tokens routed
    mx, mean = tok.max(axis=2), tok.mean(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        imb = np.where(mean > 0, mx / np.where(mean > 0, mean, 1), np.nan)
    strag = np.where(np.isnan(imb), -1, np.argmax(tok, axis=2))
    lns = np.rint(rng.gamma(2.0, 1e4, size=(T, L)))
    lns[rng.random((T, L)) < 0.05] = 0.0          # an idle layer: efficiency undefined there
    means = lns * rng.uniform(0.3, 1.0, size=(T, L))
    return mx, mean, imb, strag, lns, means


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("integer", [True, False])
def test_streaming_equals_concatenate_then_compute(chunk, integer):
    rng = np.random.default_rng(chunk + 10 * integer)
    T, L, R = 403, 5, 6
    mx, mean, imb, strag, lns, means = _random_run(rng, T, L, R, integer)
    sa, la = SummaryAccumulator(), LoadAccumulator()
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        sa.add(imb[a:b], lns[a:b], means[a:b])
        la.add(mx[a:b], strag[a:b], mean[a:b], R)
    s, want = sa.summary(), _old_summary(imb, lns, means)
    assert s.mean_imbalance == pytest.approx(want["mean"], rel=1e-13)
    assert s.p99_imbalance == want["p99"]                      # exact: the same float
    assert s.p99_imbalance_rel_error == 0.0
    assert s.max_imbalance == want["max"]
    assert (s.undefined_cells, s.cells) == (want["undefined"], want["cells"])
    assert s.predicted_step_ns == want["step_ns"]
    assert s.mean_efficiency == pytest.approx(want["eff"], rel=1e-13)
    tot = la.totals()
    for li, w in enumerate(_old_layer_loads(mx, strag, mean)):
        n = tot.n[li]
        top = int(np.argmax(tot.rank_counts[li]))
        assert (top, int(tot.rank_counts[li, top])) == w[:2]   # the mode, ties to the lowest rank
        assert tot.sum_max[li] / n == pytest.approx(w[2], rel=1e-13)
        if integer:
            assert tot.sum_max[li] / n == w[2]                 # integer sums are exact
        assert tot.p99_max[li] == w[3]
        assert tot.sum_mean[li] / n == pytest.approx(w[4], rel=1e-13)
        assert tot.sum_ratio[li] / n == pytest.approx(w[5], rel=1e-13)
    assert tot.p99_rel_error == 0.0
    # summarize() is the same accumulator over one block
    one = summarize(imb, lns, means)
    assert (one.p99_imbalance, one.max_imbalance, one.undefined_cells) == (s.p99_imbalance, s.max_imbalance,
                                                                           s.undefined_cells)


def test_all_cells_undefined():
    sa, la = SummaryAccumulator(), LoadAccumulator()
    nan = np.full((3, 2), np.nan)
    sa.add(nan, np.zeros((3, 2)), np.zeros((3, 2)))
    la.add(np.zeros((3, 2)), np.full((3, 2), -1), np.zeros((3, 2)), 4)
    s = sa.summary()
    assert (s.mean_imbalance, s.p99_imbalance, s.max_imbalance, s.mean_efficiency) == (None,) * 4
    assert (s.undefined_cells, s.cells, s.predicted_step_ns) == (6, 6, 0)
    assert la.totals().n.tolist() == [0, 0]


@pytest.mark.parametrize("n", [1, 2, 3, 99, 100, 101, 199, 1000, 4321])
def test_percentile_from_counts_is_numpys_bit_for_bit(n):
    rng = np.random.default_rng(n)
    x = np.round(rng.gamma(2.0, 3.0, size=n), 1)               # many ties
    v, c = np.unique(x, return_counts=True)
    for q in (0, 1, 50, 99, 99.9, 100):
        assert percentile_from_counts(v, c, q) == np.percentile(x, q), (n, q)


def test_sketch_p99_within_its_stated_error():
    """Past ``max_entries`` distinct values the quantiles are sketched: every percentile
    within the stated relative error of the exact one, and it says so."""
    rng = np.random.default_rng(3)
    x = 1.0 + rng.lognormal(0.0, 0.5, size=(40, 2000))
    q = Quantiles(2, max_entries=500)
    for a in range(40):
        q.add(np.arange(2000) % 2, x[a])
    assert q.rel_error == 1e-4
    got = q.percentile(99)
    for g in range(2):
        exact = np.percentile(x[:, g::2], 99)
        assert abs(got[g] / exact - 1) <= 1e-4 * (1 + 1e-9)
    assert rel_error_text(q.rel_error) == " (within 0.01%)"
    assert rel_error_text(0.0) == ""
    assert q.count().tolist() == [40_000, 40_000]


def test_accumulator_memory_does_not_grow_with_the_chunks():
    """Ten times the chunks: the same bytes (past the exact cap both runs are sketched, over
    the imbalance's fixed range [1, ranks]; integer tokens stay exact in both: one entry per
    distinct count, here 0..9 tokens on each of 2 ranks, all seen in either run)."""
    def run(chunks):
        rng = np.random.default_rng(0)
        sa, la = SummaryAccumulator(max_entries=20_000), LoadAccumulator(max_entries=20_000)
        for _ in range(chunks):
            mx, mean, imb, strag, lns, means = _random_run(rng, 50, 8, 2, poisson=False)
            sa.add(1 + rng.random(imb.shape), lns, means, 2)     # a continuous imbalance: all distinct
            la.add(mx, strag, mean, 2)
        sa.summary(), la.totals()      # compacts what is pending
        return sa.nbytes, la.nbytes, sa.q.rel_error, la.q.rel_error

    small, big = run(100), run(1000)
    assert small[2:] == big[2:] == (1e-4, 0.0)
    assert big[0] == small[0] and big[1] == small[1]
    assert big[0] + big[1] < 2 << 20


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("capacity", [None, 400_000])
def test_merged_histogram_is_exact_over_many_merges(groups, capacity):
    """Past one merge block (the pending values merged into the sorted histogram again and
    again, ties with held values and new ones between them): still np.percentile's floats;
    with ``capacity`` the buffers are the same bytes from the first value to the last."""
    rng = np.random.default_rng(groups)
    q = Quantiles(groups, capacity=capacity)
    before = q.nbytes
    xs, gs = [], []
    for _ in range(60):
        x = np.round(1 + rng.gamma(2.0, 1.0, 5000), 3)     # ties within and across blocks
        g = rng.integers(0, groups, x.size)
        q.add(g, x)
        xs.append(x), gs.append(g)
    got = q.percentile(99), q.percentile(50), q.count()
    x, g = np.concatenate(xs), np.concatenate(gs)
    assert q.rel_error == 0.0
    for k in range(groups):
        assert got[0][k] == np.percentile(x[g == k], 99) and got[1][k] == np.percentile(x[g == k], 50)
        assert got[2][k] == (g == k).sum()
    if capacity:
        assert q.nbytes == before

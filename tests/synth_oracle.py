"""The float alias sampler moetrace.produce.synth used until 2026-12-02, kept as the test
oracle of the faster :class:`moetrace.produce.synth.TopKSampler` (tests/test_synth_sampler.py
compares the laws of the two)."""
from __future__ import annotations

import numpy as np


def alias_tables(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker/Vose alias tables of the rows of ``p [G, E]``: ``(prob [G, E], alias [G, E])``;
    a draw from row g is ``i = floor(u·E)``, kept when ``frac(u·E) < prob[g, i]``, else
    ``alias[g, i]``: exactly ∝ p[g] with one uniform per draw."""
    p = np.atleast_2d(np.asarray(p, np.float64))
    G, E = p.shape
    prob = np.ones((G, E))
    alias = np.tile(np.arange(E), (G, 1))
    for g in range(G):
        q = p[g] * (E / p[g].sum())
        small = [i for i in range(E) if q[i] < 1.0]
        large = [i for i in range(E) if q[i] >= 1.0]
        while small and large:
            s_, l_ = small.pop(), large.pop()
            prob[g, s_], alias[g, s_] = q[s_], l_
            q[l_] -= 1.0 - q[s_]
            (small if q[l_] < 1.0 else large).append(l_)
        for i in small + large:                 # what is left is 1 up to rounding
            prob[g, i] = 1.0
    return prob, alias


def draw_topk(prob: np.ndarray, alias: np.ndarray, table: np.ndarray, k: int, rng: np.random.Generator,
              mix: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[n, k] distinct expert ids for n tokens: successive sampling without replacement,
    each choice drawn ∝ the token's popularity row (``table[n]`` indexes the alias tables)
    and drawn again while it repeats an earlier choice of the token (which is exactly
    drawing ∝ p among the experts not chosen yet). Columns are in draw order. With
    ``mix = (table2 [n], share [n])`` a draw comes from row ``table2`` with probability
    ``share`` (the popularity is the mixture ``(1 - share)·p[table] + share·p[table2]``)."""
    n, E = table.size, prob.shape[1]
    pflat, aflat = prob.ravel(), alias.ravel()
    table = np.asarray(table, np.int64)

    def draw(idx):
        g = table if idx is None else table[idx]
        m = g.shape[0] if idx is None else idx.size
        if mix is not None:
            t2, share = (mix[0], mix[1]) if idx is None else (mix[0][idx], mix[1][idx])
            g = np.where(rng.random(m) < share, t2, g)
        u = rng.random(m) * E
        i = np.minimum(u.astype(np.int64), E - 1)
        gi = g * E + i
        return np.where(u - i < pflat[gi], i, aflat[gi])

    out = np.empty((k, n), np.int64)         # choice-major: each choice's column contiguous
    for j in range(k):       # choice j: drawn for every token, drawn again where it repeats
        e = out[j] = draw(None)
        if not j:
            continue
        hit = out[0] == e
        for c in range(1, j):
            hit |= out[c] == e
        todo = np.flatnonzero(hit)
        while todo.size:
            e = draw(todo)
            out[j, todo] = e
            hit = out[0, todo] == e
            for c in range(1, j):
                hit |= out[c, todo] == e
            todo = todo[hit]
    return np.ascontiguousarray(out.T)


def sample_topk(p: np.ndarray, n_tokens: int, k: int, rng: np.random.Generator, ordered: bool = True) -> np.ndarray:
    """[n_tokens, k] distinct expert ids per token, sampled without replacement ∝ p
    (successive sampling, :func:`draw_topk`). Columns are in draw order (the router's
    order of choice); ``ordered`` is kept for callers and changes nothing."""
    prob, alias = alias_tables(np.asarray(p, np.float64)[None])
    return draw_topk(prob, alias, np.zeros(n_tokens, np.int64), k, rng)



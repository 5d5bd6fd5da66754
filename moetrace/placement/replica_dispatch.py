"""Which copy of a replicated expert serves a step's tokens: rank tokens under a plan, per
step, for two dispatch rules. Pure numpy: arrays in, arrays out.

- ``even``: every copy gets an equal share of its expert's tokens (the replay's default,
  and what the SQL rank views assume);
- ``least-loaded``: per step, the replicated experts' tokens go to the lightest of their
  copies' ranks, a min-max split in the manner of DeepSeek's LPLB (deepseek-ai/LPLB, the
  linear-programming load balancer: per batch, it solves the token assignment over the
  replicas that balances the ranks). Here: the tokens of experts with a single rank are fixed; each replicated
  expert's tokens are poured onto its copies' ranks up to a common level (water-filling),
  heaviest expert first, then every expert is poured again with the others in place until
  no allocation moves by more than ``TOL`` of the cell's tokens (at most ``MAX_PASSES``
  passes): a coordinate descent towards the linear program's optimum, which it reaches
  within float rounding on the tests' random small cases (checked against the optimum's
  closed form, the largest load confined to a set of ranks over its size). The split is
  fractional (tokens as a flow), so the largest rank load is at most the even split's.

Shapes: ``load`` float [N, E] (tokens per logical expert in N cells that share one plan
row, e.g. the steps of one layer); ``row`` int [S] (the plan's slot -> expert for that
layer, slots in rank order); result float [N, R].
"""
from __future__ import annotations

import numpy as np

#: the replica dispatch rules replay knows
DISPATCH = ("even", "least-loaded")
#: most passes of re-pouring every replicated expert after the first
MAX_PASSES = 200
#: stop when no allocation moved by more than this share of the cell's tokens in a pass
TOL = 1e-9


def copies_per_rank(row: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Copies of each expert on each rank: int64 [E, R]."""
    row = np.asarray(row, np.int64)
    spr = row.size // num_ranks
    out = np.zeros((num_experts, num_ranks), np.int64)
    np.add.at(out, (row, np.arange(row.size) // spr), 1)
    return out


def even_rank_tokens(load: np.ndarray, row: np.ndarray, num_ranks: int) -> np.ndarray:
    """Rank tokens with every copy taking an equal share of its expert's tokens: [N, R]."""
    c = copies_per_rank(row, load.shape[1], num_ranks).astype(np.float64)
    tot = c.sum(axis=1, keepdims=True)
    share = np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)
    return np.asarray(load, np.float64) @ share


def pour(levels: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """Water-fill ``amount`` [N] onto bins at ``levels`` [N, c]: the additions [N, c] that
    raise the lowest bins to one common level (bins above it get nothing); each row's
    additions sum to its amount."""
    lv = np.asarray(levels, np.float64)
    n, c = lv.shape
    order = np.argsort(lv, axis=1, kind="stable")
    srt = np.take_along_axis(lv, order, axis=1)
    m = np.arange(1, c + 1)
    level_m = (amount[:, None] + np.cumsum(srt, axis=1)) / m          # level if the m lowest are filled
    ok = level_m >= srt                                                # the m-th lowest is reached
    last = c - 1 - np.argmax(ok[:, ::-1], axis=1)                      # largest m that is reached (a prefix)
    level = level_m[np.arange(n), last]
    return np.maximum(level[:, None] - lv, 0.0) * (amount[:, None] > 0)


def least_loaded_rank_tokens(load: np.ndarray, row: np.ndarray, num_ranks: int,
                             passes: int = MAX_PASSES, tol: float = TOL) -> np.ndarray:
    """Rank tokens with each replicated expert's tokens poured onto its lightest copies'
    ranks, per cell (module doc): [N, R]."""
    load = np.asarray(load, np.float64)
    N, E = load.shape
    c = copies_per_rank(row, E, num_ranks)
    ranks_of = [np.flatnonzero(c[e]) for e in range(E)]
    single = np.array([r.size == 1 for r in ranks_of])
    fixed = np.zeros((E, num_ranks))
    for e in np.flatnonzero(single):
        fixed[e, ranks_of[e][0]] = 1.0
    tokens = load @ fixed
    multi = [e for e in np.argsort(-load.sum(axis=0), kind="stable") if ranks_of[e].size > 1]
    alloc: dict[int, np.ndarray] = {}
    scale = np.maximum(load.sum(axis=1), 1.0)
    for p in range(1 + passes):
        moved = np.zeros(N)
        for e in multi:
            rs = ranks_of[e]
            if p:
                tokens[:, rs] -= alloc[e]
            new = pour(tokens[:, rs], load[:, e])
            if p:
                moved = np.maximum(moved, np.abs(new - alloc[e]).max(axis=1))
            alloc[e] = new
            tokens[:, rs] += new
        if p and (moved <= tol * scale).all():
            break
    return tokens


def rank_tokens(load: np.ndarray, row: np.ndarray, num_ranks: int, dispatch: str = "even") -> np.ndarray:
    """Rank tokens [N, R] of ``load`` [N, E] under plan row ``row`` with rule ``dispatch``."""
    if dispatch == "even":
        return even_rank_tokens(load, row, num_ranks)
    if dispatch == "least-loaded":
        return least_loaded_rank_tokens(load, row, num_ranks)
    raise ValueError(f"unknown replica dispatch {dispatch!r} (choose from {', '.join(DISPATCH)})")

"""Relabel a new plan's ranks (and nodes) to keep as many experts in place as possible.

Planners number GPUs and nodes arbitrarily: EPLB or greedy fitted on almost the same load
put almost the same expert sets on different rank ids, so a full re-plan compared slot by
slot with the previous plan looks like it moves nearly every expert. Rank ids are free to
choose (so is the order of slots inside a rank), so before counting moves the new plan is
relabeled to maximize, per layer, the number of expert copies that stay where they are:
``overlap[a, b] = sum_e min(copies of e on old rank a, copies of e on new rank b)``, and
``moves = slots - sum of the overlap kept`` (exactly what :func:`moves.moves_between`
counts). The rank permutation is an optimal assignment (:func:`linear_assignment`, the
Hungarian method with potentials, numpy only).

For hierarchical plans (EPLB with groups packed onto nodes) node membership matters: the
permutation maps whole nodes to nodes and ranks within a node to ranks of the node it
maps to. That two-level problem is solved exactly too: the value of matching old node
``a`` with new node ``b`` is the optimal within-node assignment, then nodes are assigned.

A relabeled plan is the same placement up to rank names: per-rank loads are permuted,
imbalance, stragglers' loads and the per-rank byte estimates are unchanged.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from .planners import Plan


def linear_assignment(cost) -> np.ndarray:
    """Minimum-cost perfect assignment of a square matrix: ``col[i]`` for every row ``i``.

    Shortest augmenting paths with row/column potentials (O(n^3)), rows added in order,
    the nearest column taken first on ties (the lowest index). The potentials of the
    columns already reached and the distances of the others all move by the same amount
    at every step of a path, so they are updated once per added row, not once per step:
    each step is a few vector operations over the columns. For integer costs every value
    is an exact integer, and the assignment is the one the textbook per-step update gives
    (``tests/test_planners.py`` checks it against that form, ties included)."""
    c = np.asarray(cost, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cost must be a square matrix, got {c.shape}")
    n = c.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    u = np.zeros(n)                         # row potentials
    v = np.zeros(n)                         # column potentials
    row_of = np.full(n, -1, np.int64)       # row matched to column j (-1: none yet)
    way = np.zeros(n, np.int64)             # column before j on the shortest path (-1: the new row)
    dist = np.empty(n)                      # distance to column j plus the path's length so far (inf: reached)
    vv = np.empty(n)                        # v, -inf on reached columns (their distances never change again)
    t = np.empty(n)
    upd = np.empty(n, bool)
    reached_at = np.empty(n)                # the path length when column j was reached
    for i in range(n):
        dist.fill(np.inf)
        np.copyto(vv, v)
        d = 0.0
        i0, j0 = i, -1
        reached = []
        while True:
            np.subtract(c[i0], vv, out=t)
            t += d - u[i0]
            np.less(t, dist, out=upd)
            np.copyto(dist, t, where=upd)
            np.copyto(way, j0, where=upd)
            j0 = int(dist.argmin())
            d = dist[j0]
            reached.append(j0)
            reached_at[j0] = d
            dist[j0] = np.inf
            vv[j0] = -np.inf
            i0 = row_of[j0]
            if i0 < 0:
                break
        js = np.array(reached)
        moved = d - reached_at[js]          # how far the potentials moved after j was reached
        u[row_of[js[:-1]]] += moved[:-1]
        u[i] += d
        v[js] -= moved
        while j0 >= 0:                      # augment along the path
            j1 = way[j0]
            row_of[j0] = row_of[j1] if j1 >= 0 else i
            j0 = j1
    col = np.empty(n, np.int64)
    col[row_of] = np.arange(n)
    return col


def _rank_copies(row: np.ndarray, E: int, R: int) -> np.ndarray:
    """Copies of expert e on rank r for one layer: [E, R]."""
    spr = row.size // R
    return np.bincount(row * R + np.arange(row.size) // spr, minlength=E * R).reshape(E, R)


def overlap_matrix(old_row: np.ndarray, new_row: np.ndarray, E: int, R: int) -> np.ndarray:
    """``[a, b]``: expert copies old rank a and new rank b have in common (multiset)."""
    co, cn = _rank_copies(old_row, E, R), _rank_copies(new_row, E, R)
    # sparse: only (old rank, new rank) pairs that hold a common expert add to the sum (a
    # dense [E, R, R] minimum was 1.5 G operations per plan at 58 layers x 256 experts x 320 ranks)
    eo, ao = np.nonzero(co)
    en, bn = np.nonzero(cn)                     # row-major: sorted by expert
    per_e = np.bincount(en, minlength=E)
    first = np.cumsum(per_e) - per_e
    reps = per_e[eo]                            # new entries paired with each old entry
    i = np.repeat(np.arange(eo.size), reps)
    j = first[eo[i]] + (np.arange(i.size) - np.repeat(np.cumsum(reps) - reps, reps))
    w = np.minimum(co[eo[i], ao[i]], cn[en[j], bn[j]])
    return np.bincount(ao[i] * R + bn[j], weights=w, minlength=R * R).reshape(R, R).astype(np.int64)


def best_rank_map(ov: np.ndarray, ranks_per_node: int | None = None) -> np.ndarray:
    """``to_old[b]``: the old rank label new rank b takes, maximizing the kept overlap.
    With ``ranks_per_node`` the map keeps whole nodes together."""
    R = ov.shape[0]
    if not ranks_per_node or ranks_per_node >= R:
        col = linear_assignment(-ov)          # old rank a gets new rank col[a]
        to_old = np.empty(R, np.int64)
        to_old[col] = np.arange(R)
        return to_old
    k = ranks_per_node
    N = R // k
    to_old = np.arange(R)
    if N * k != R:      # ragged last node: keep nodes as they are, relabel ranks within each
        for n in range(-(-R // k)):
            rs = np.arange(n * k, min(R, (n + 1) * k))
            sub = linear_assignment(-ov[np.ix_(rs, rs)])
            to_old[rs[sub]] = rs
        return to_old
    inner = np.empty((N, N, k), np.int64)   # [old node a, new node b]: new rank of b for each old rank of a
    val = np.empty((N, N))
    for a in range(N):
        for b in range(N):
            block = ov[a * k:(a + 1) * k, b * k:(b + 1) * k]
            col = linear_assignment(-block)
            inner[a, b] = col
            val[a, b] = block[np.arange(k), col].sum()
    node_col = linear_assignment(-val)        # old node a takes new node node_col[a]
    for a in range(N):
        b = node_col[a]
        to_old[b * k + inner[a, b]] = a * k + np.arange(k)
    return to_old


def _order_like(prev_slots: np.ndarray, new_slots: np.ndarray) -> np.ndarray:
    """``new_slots`` reordered so experts the rank already held keep their slot index."""
    left = Counter(new_slots.tolist())
    out = [None] * new_slots.size
    for i, e in enumerate(prev_slots.tolist()[:new_slots.size]):
        if left[e] > 0:
            out[i] = e
            left[e] -= 1
    rest = iter(sorted(left.elements()))
    return np.array([x if x is not None else next(rest) for x in out], np.int64)


def relabel(prev: Plan, new: Plan, keep_nodes: bool | None = None) -> tuple[Plan, dict]:
    """``new`` with its ranks renamed (per layer) and slots reordered within ranks to keep
    the most expert copies where ``prev`` has them. ``keep_nodes`` (default: the new plan
    is hierarchical) only maps whole nodes onto nodes. Returns the plan and ``{"relabeled",
    "moves_before", "moves_after"}``; plans of other shapes come back unchanged."""
    from .moves import moves_between

    same = (prev.num_ranks == new.num_ranks and prev.num_experts == new.num_experts
            and prev.num_layers == new.num_layers and prev.ranks_per_node == new.ranks_per_node
            and np.array_equal(prev.layers, new.layers))
    if not same:
        return new, {"relabeled": False, "reason": "the plans differ in ranks, experts, layers or ranks per node"}
    before = int(moves_between(prev, new).sum())
    if keep_nodes is None:
        keep_nodes = bool(new.params.get("hierarchical", False))
    R, E = new.num_ranks, new.num_experts
    spr_n, spr_p = new.slots_per_rank, prev.slots_per_rank
    out = np.empty_like(new.phy2log)
    for li in range(new.num_layers):
        ov = overlap_matrix(prev.phy2log[li], new.phy2log[li], E, R)
        to_old = best_rank_map(ov, new.ranks_per_node if keep_nodes and new.num_nodes > 1 else None)
        if spr_n == 1:      # one slot per rank: nothing to order inside it (what _order_like gives)
            out[li, to_old] = new.phy2log[li]
            continue
        for b in range(R):
            a = to_old[b]
            out[li, a * spr_n:(a + 1) * spr_n] = _order_like(prev.phy2log[li, a * spr_p:(a + 1) * spr_p],
                                                             new.phy2log[li, b * spr_n:(b + 1) * spr_n])
    plan = replace(new, phy2log=out, params={**new.params, "relabeled_to": prev.plan_id})
    after = int(moves_between(prev, plan).sum())
    return plan, {"relabeled": True, "keep_nodes": keep_nodes, "moves_before": before, "moves_after": after}

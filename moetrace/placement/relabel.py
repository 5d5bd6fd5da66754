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
    at every step of a path, so they are updated once per added row, not once per step.
    For integer costs every value is an exact integer, and the assignment is the one the
    textbook per-step update gives (``tests/test_planners.py`` checks both forms below
    against it, ties included). Relabeling's costs (minus the overlaps: zero but for a
    few entries per row) take :func:`_assignment_sparse`, the rest :func:`_assignment_dense`."""
    c = np.asarray(cost, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cost must be a square matrix, got {c.shape}")
    n = c.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    nnz = int(np.count_nonzero(c))
    if nnz <= 8 * n and (c <= 0).all() and np.array_equal(c, np.rint(c)) and -c.min(initial=0) < 2 ** 40:
        return _assignment_sparse(c)
    return _assignment_dense(c)


def _assignment_dense(c: np.ndarray) -> np.ndarray:
    """:func:`linear_assignment` with each path step a few vector operations over the columns."""
    n = c.shape[0]
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


def _assignment_sparse(c: np.ndarray) -> np.ndarray:
    """:func:`linear_assignment` for integer costs <= 0, mostly zero: the same path, each
    step costing the row's nonzero entries instead of a pass over every column.

    While a row is added, a free column j's distance is ``min(S, N[j]) - v[j]``: ``S`` the
    smallest ``d - u[r]`` of the rows scanned so far (their zero entries), ``N[j]`` the
    smallest ``d - u[r] + c[r, j]`` of the scanned rows with a nonzero entry at j (a row's
    own zero candidate never beats its entry, costs being <= 0). The nearest column is
    then the free column of largest ``v`` at distance ``S - v`` (numpy's argmax: the lowest
    index) or the top of a heap of the columns with ``N[j] < S``, ties to the lower index;
    the column before it on the path is the first scanned row that reached that distance.
    The long paths relabeling makes (hundreds of matched columns at equal distance, taken
    in index order) cost a few microseconds a step instead of a pass over the matrix."""
    import heapq

    n = c.shape[0]
    r_idx, c_idx = np.nonzero(c)
    entries: list[list] = [[] for _ in range(n)]
    for r, j, x in zip(r_idx.tolist(), c_idx.tolist(), c[r_idx, c_idx].tolist()):
        entries[r].append((j, x))
    inf = float("inf")
    u = [0.0] * n
    v = np.zeros(n)                 # column potentials (numpy, for argmax) ...
    vl = [0.0] * n                  # ... and the same as a list
    row_of = [-1] * n               # row matched to column j
    way = [-1] * n                  # column before j on the path (-1: the new row)
    reached_by = [-1] * n           # == i: column j reached while adding row i
    push, pop = heapq.heappush, heapq.heappop
    for i in range(n):
        vm = v.copy()               # -inf at reached columns
        S, step_s, way_s = inf, -1, -1
        near: dict[int, tuple] = {}   # j -> (N[j], step that set it, column it came from)
        heap: list = []               # (N[j] - v[j], j, N[j])
        d = 0.0
        i0, j0, k = i, -1, 0
        reached, reached_at = [], []
        while True:
            s = d - u[i0]
            for j, cv in entries[i0]:
                if reached_by[j] == i:
                    continue
                t = s + cv
                e = near.get(j)
                if e is None or t < e[0]:
                    near[j] = (t, k, j0)
                    push(heap, (t - vl[j], j, t))
            if s < S:
                S, step_s, way_s = s, k, j0
            ja = int(vm.argmax())
            da = S - vl[ja]
            j1 = -1
            while heap:
                key, jb, t = heap[0]
                e = near[jb]
                if reached_by[jb] == i or e[0] != t or t >= S:     # stale, reached, or no nearer than S
                    pop(heap)
                    continue
                if key < da or (key == da and jb < ja):
                    j1, d1, w = jb, key, e[2]
                break
            if j1 < 0:
                j1, d1 = ja, da
                e = near.get(ja)
                w = e[2] if e is not None and e[0] == S and e[1] < step_s else way_s
            way[j1] = w
            reached_by[j1] = i
            vm[j1] = -inf
            reached.append(j1)
            reached_at.append(d1)
            d = d1
            k += 1
            j0 = j1
            i0 = row_of[j1]
            if i0 < 0:
                break
        last = len(reached) - 1
        for idx, j in enumerate(reached):     # potentials moved by the path length since j was reached
            moved = d - reached_at[idx]
            if idx < last:
                u[row_of[j]] += moved
            vl[j] -= moved
            v[j] = vl[j]
        u[i] += d
        while j0 >= 0:                        # augment along the path
            j1 = way[j0]
            row_of[j0] = row_of[j1] if j1 >= 0 else i
            j0 = j1
    col = np.empty(n, np.int64)
    col[np.array(row_of)] = np.arange(n)
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

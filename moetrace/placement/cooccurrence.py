"""Co-occurrence placement: experts that the same tokens choose, packed onto one rank (and
one node), within a stated load-balance tolerance. Pure numpy: arrays in, a Plan out.

A token is dispatched once to every rank that holds one of its experts, so two experts a
token chooses together cost one copy when they share a rank and two when they do not. The
quantity that sets the dispatch's bytes and messages is the distinct destination ranks
per token (:func:`fanout`; the SQL view ``dispatch_fanout`` computes the same from the
store for the recorded placement). TensorRT-LLM's
``examples/wide_ep/ep_load_balancer/generate_eplb_config_cooccurrence.py`` (with
``do_placement_with_cooccurrence`` in its ``utils.py``) places by the same idea: it seeds
each rank with the heaviest remaining expert, grows it by co-occurrence until a share
``alpha`` of its slots or of the mean load is used, and places the rest heaviest first on
the lightest rank. This module starts from the balanced side instead and keeps a hard
load cap:

1. copies per expert by EPLB's replication rule (:func:`moetrace.placement.eplb.replica_counts`);
2. a longest-processing-time packing of the copies onto nodes (when the ranks form more
   than one node), heaviest copy first onto the lightest node with a free slot;
3. pairwise swaps of copies between nodes, best gain first, where the gain is the
   co-occurrence that becomes node-local; a swap is taken only when neither node's load
   passes ``(1 + tolerance) x mean`` (or, if the packing already passed it, its old load)
   and no node would hold two copies of one expert;
4. the same packing and swaps onto the ranks of each node.

Co-occurrence between copies is the experts' count divided by both copy counts (a token
reaches one copy of a replicated expert, evenly at random).
"""
from __future__ import annotations

import numpy as np

from .eplb import replica_counts

#: default load-balance tolerance: a rank may carry up to 10% more than the mean load
DEFAULT_TOLERANCE = 0.10


def cooccurrence_counts(choices: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens that chose both experts: ``choices`` int [T, k] (one row per token, -1 =
    no choice) -> int64 [E, E], symmetric, diagonal = tokens that chose the expert. A
    choice listed twice in one row counts once (as the view ``expert_cooccurrence``)."""
    c = np.asarray(choices, dtype=np.int64)
    E = int(num_experts)
    out = np.zeros((E, E), np.int64)
    if c.size == 0:
        return out
    c = np.sort(c, axis=1)
    dup = np.zeros(c.shape, bool)
    dup[:, 1:] = c[:, 1:] == c[:, :-1]
    c = np.where(dup | (c < 0), -1, c)
    k = c.shape[1]
    for i in range(k):
        ci = c[:, i]
        out[np.arange(E), np.arange(E)] += np.bincount(ci[ci >= 0], minlength=E)
        for j in range(i + 1, k):
            cj = c[:, j]
            ok = (ci >= 0) & (cj >= 0)
            key = ci[ok] * E + cj[ok]
            out += np.bincount(key, minlength=E * E).reshape(E, E)
    upper = np.triu(out, 1) + np.tril(out, -1).T
    return upper + upper.T + np.diag(np.diag(out))


def rank_shares(phy2log_row: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Share of each expert's tokens each rank gets under an even split over its copies:
    one plan row (slot -> expert, slots in rank order) -> float64 [E, R]."""
    row = np.asarray(phy2log_row, np.int64)
    spr = row.size // num_ranks
    cnt = np.zeros((num_experts, num_ranks))
    np.add.at(cnt, (row, np.arange(row.size) // spr), 1.0)
    tot = cnt.sum(axis=1, keepdims=True)
    return np.divide(cnt, tot, out=np.zeros_like(cnt), where=tot > 0)


def fanout(choices: np.ndarray, share: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Distinct destinations per token: ``choices`` int [T, k] (-1 = none), ``share``
    float [E, D] (share of expert e's tokens destination d gets) -> float64 [T]: the sum
    over destinations of 1 - prod over the token's choices of (1 - share). Exact where
    every share is 0 or 1; the expectation under an even random pick of a replica
    otherwise (as the view ``dispatch_fanout_tokens``)."""
    c = np.asarray(choices, np.int64)
    sh = np.vstack([np.asarray(share, np.float64), np.zeros((1, share.shape[1]))])   # row -1: no choice
    out = np.empty(c.shape[0])
    for a in range(0, c.shape[0], chunk):
        miss = np.prod(1.0 - sh[c[a:a + chunk]], axis=1)      # [t, D]: no choice reaches d
        out[a:a + chunk] = (1.0 - miss).sum(axis=1)
    return out


def node_shares(share: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """[E, R] rank shares -> [E, nodes] node shares (rank r on node r // ranks_per_node)."""
    R = share.shape[1]
    nodes = -(-R // ranks_per_node)
    out = np.zeros((share.shape[0], nodes))
    np.add.at(out.T, np.arange(R) // ranks_per_node, share.T)
    return out


def _lpt(w: np.ndarray, expert: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Bin of each copy: heaviest first onto the lightest bin with a free place, avoiding a
    bin that already holds the expert where one can (lowest bin on ties)."""
    load = np.zeros(bins)
    used = np.zeros(bins, np.int64)
    holds: list[set[int]] = [set() for _ in range(bins)]
    out = np.empty(w.size, np.int64)
    for i in np.argsort(-w, kind="stable"):
        free = used < per_bin
        ok = free & np.array([int(expert[i]) not in h for h in holds])
        cand = np.flatnonzero(ok if ok.any() else free)
        b = int(cand[np.argmin(load[cand])])
        out[i] = b
        load[b] += w[i]
        used[b] += 1
        holds[b].add(int(expert[i]))
    return out


def _swap(bins_of: np.ndarray, w: np.ndarray, expert: np.ndarray, C: np.ndarray, nbins: int, cap: float,
          max_swaps: int) -> tuple[np.ndarray, int]:
    """Best-gain pairwise swaps of items between bins (see the module doc): returns the new
    bin of each item and the swaps made."""
    b = bins_of.copy()
    n = b.size
    onehot = np.zeros((n, nbins))
    onehot[np.arange(n), b] = 1.0
    M = C @ onehot                                  # [n, bins]: affinity of item i to bin
    load = np.bincount(b, weights=w, minlength=nbins).astype(np.float64)
    E = int(expert.max()) + 1 if n else 0
    H = np.zeros((E, nbins), np.int64)
    np.add.at(H, (expert, b), 1)
    same_expert = expert[:, None] == expert[None, :]
    swaps = 0
    while swaps < max_swaps:
        A = M[:, b]                                 # A[x, y] = affinity of x to y's bin
        d = np.diag(A)
        gain = A + A.T - d[:, None] - d[None, :] - 2.0 * C
        la, lb = load[b][:, None], load[b][None, :]
        new_a = la - w[:, None] + w[None, :]
        new_b = lb - w[None, :] + w[:, None]
        limit = np.maximum(cap, np.maximum(la, lb)) + 1e-9
        ok = (b[:, None] != b[None, :]) & ~same_expert & (new_a <= limit) & (new_b <= limit)
        ok &= (H[expert][:, b].T == 0) & (H[expert][:, b] == 0)   # no bin gets a second copy of an expert
        gain = np.where(ok, gain, -np.inf)
        flat = int(np.argmax(gain))
        i, j = divmod(flat, n)
        if not gain[i, j] > 1e-12:
            break
        bi, bj = b[i], b[j]
        M[:, bi] += C[:, j] - C[:, i]
        M[:, bj] += C[:, i] - C[:, j]
        load[bi] += w[j] - w[i]
        load[bj] += w[i] - w[j]
        H[expert[i], bi] -= 1
        H[expert[j], bj] -= 1
        H[expert[i], bj] += 1
        H[expert[j], bi] += 1
        b[i], b[j] = bj, bi
        swaps += 1
    return b, swaps


def _place_layer(load: np.ndarray, co: np.ndarray, cnt: np.ndarray, R: int, rpn: int, spr: int,
                 tolerance: float, max_swaps: int | None) -> tuple[np.ndarray, int]:
    """One layer: [S] experts in slot order (rank-major, ids ascending within a rank)."""
    E = load.size
    expert = np.repeat(np.arange(E), cnt)
    w = load[expert] / cnt[expert]
    C = co[np.ix_(expert, expert)] / np.outer(cnt[expert], cnt[expert])
    C[expert[:, None] == expert[None, :]] = 0.0
    n = expert.size
    limit = max_swaps if max_swaps is not None else 2 * n
    mean_rank = load.sum() / R
    nodes = R // rpn if rpn < R and R % rpn == 0 else 1
    swaps = 0
    if nodes > 1:
        node = _lpt(w, expert, nodes, spr * rpn)
        node, s = _swap(node, w, expert, C, nodes, (1 + tolerance) * mean_rank * rpn, limit)
        swaps += s
    else:
        node = np.zeros(n, np.int64)
    rank = np.empty(n, np.int64)
    per_node = R // nodes
    for g in range(nodes):
        idx = np.flatnonzero(node == g)
        local = _lpt(w[idx], expert[idx], per_node, spr)
        local, s = _swap(local, w[idx], expert[idx], C[np.ix_(idx, idx)], per_node, (1 + tolerance) * mean_rank,
                         limit)
        swaps += s
        rank[idx] = g * per_node + local
    order = np.lexsort((expert, rank))
    return expert[order], swaps


def place(load: np.ndarray, co: np.ndarray, num_ranks: int, ranks_per_node: int | None, num_slots: int,
          tolerance: float = DEFAULT_TOLERANCE, max_swaps: int | None = None) -> tuple[np.ndarray, dict]:
    """Place ``load`` float [L, E] (tokens per expert) with co-occurrence ``co`` [L, E, E]
    (tokens that chose both; the diagonal is ignored) on ``num_ranks`` ranks of
    ``num_slots`` slots; a rank may carry up to ``(1 + tolerance) x`` the mean load where the
    balanced packing allows it (module doc). ``max_swaps`` per bin level (default twice the
    copies of a layer). Returns phy2log int64 [L, S] (slots in rank order) and the
    parameters to record with the plan."""
    load = np.asarray(load, np.float64)
    co = np.asarray(co, np.float64)
    L, E = load.shape
    if co.shape != (L, E, E):
        raise ValueError(f"co-occurrence must be [layers, experts, experts] = {(L, E, E)}, got {co.shape}")
    if tolerance < 0:
        raise ValueError(f"balance tolerance {tolerance} must be >= 0")
    R, S = num_ranks, num_slots
    rpn = min(ranks_per_node, R) if ranks_per_node else R
    spr = S // R
    cnt = replica_counts(load, S - E)
    out = np.empty((L, S), np.int64)
    swaps = 0
    for li in range(L):
        out[li], n = _place_layer(load[li], co[li], cnt[li], R, rpn, spr, tolerance, max_swaps)
        swaps += n
    nodes = R // rpn if rpn < R and R % rpn == 0 else 1
    # hierarchical: the nodes are packed first, so a relabeling must keep each node's ranks together
    return out, {"balance_tolerance": float(tolerance), "swaps": int(swaps), "num_nodes": nodes,
                 "hierarchical": nodes > 1}


def plan_fanout(plan, choices: list[np.ndarray]) -> dict:
    """Mean distinct destination ranks and nodes per token of ``plan`` (a
    :class:`moetrace.placement.planners.Plan`): ``choices`` holds,
    for each plan row (layer), the int [T, k] expert choices of its tokens. Returns
    {"tokens", "ranks_per_token", "nodes_per_token"} over all rows (token-weighted) and
    "layers": the same per row (None where a row has no tokens)."""
    layers: list[dict] = []
    n_all, r_all, d_all = 0, 0.0, 0.0
    for li, ch in enumerate(choices):
        ch = np.asarray(ch, np.int64).reshape(len(ch), -1) if len(ch) else np.zeros((0, 1), np.int64)
        if ch.shape[0] == 0:
            layers.append({"tokens": 0, "ranks_per_token": None, "nodes_per_token": None})
            continue
        share = rank_shares(plan.phy2log[li], plan.num_experts, plan.num_ranks)
        r = fanout(ch, share)
        d = fanout(ch, node_shares(share, plan.ranks_per_node))
        layers.append({"tokens": int(ch.shape[0]), "ranks_per_token": float(r.mean()),
                       "nodes_per_token": float(d.mean())})
        n_all += ch.shape[0]
        r_all += float(r.sum())
        d_all += float(d.sum())
    return {"tokens": n_all, "ranks_per_token": r_all / n_all if n_all else None,
            "nodes_per_token": d_all / n_all if n_all else None, "layers": layers}

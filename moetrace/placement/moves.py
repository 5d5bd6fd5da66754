"""Moves between plans and the move-aware re-planner.

Moving an expert copies its weights to another rank, so the cost of switching from plan A
to plan B is the number of expert copies that rank r holds in B but not in A (reordering
slots inside a rank is free): :func:`moves_between`. :func:`replan` starts from the
previous plan and spends a budget of moves where they buy the most: each step takes, over
all layers, the candidate with the largest drop of a layer's hottest-rank load per move
(no rank whose load grows may end above what the hottest rank keeps):

- swap a slot of the hottest rank with a slot of another rank (2 moves), or
- overwrite a redundant copy (an expert with more than one copy) anywhere with one more
  copy of an expert of the hottest rank (1 move).

It stops when the budget is spent, every layer is at or below ``target_imbalance``, or no
move helps.
"""
from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from .planners import Plan


def _copy_keys(plan: Plan, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct (layer, rank, expert) keys ``(layer * ranks + rank) * E + expert``,
    copies of each) of ``plan``'s ranks below ``ranks``: the nonzero entries of
    :meth:`Plan.copies`, without its dense [L, E, R] array (38 MB at fleet shape)."""
    L, E = plan.num_layers, plan.num_experts
    r = np.broadcast_to(plan.slot_rank[None, :], plan.phy2log.shape)
    keep = r < ranks
    key = ((np.arange(L, dtype=np.int64)[:, None] * ranks + r) * E + plan.phy2log)[keep]
    return np.unique(key, return_counts=True)


def _needed(old: Plan, new: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(keys of ``new``'s (layer, rank, expert) as in :func:`_copy_keys`, copies each needs
    that the same rank of ``old`` does not hold)."""
    R = new.num_ranks
    kn, cn = _copy_keys(new, R)
    ko, co = _copy_keys(old, R)
    i = np.minimum(np.searchsorted(ko, kn), max(ko.size - 1, 0))
    held = np.where((ko.size > 0) & (ko[i] == kn), co[i] if ko.size else 0, 0)
    return kn, np.maximum(cn - held, 0)


def moves_between(old: Plan, new: Plan) -> np.ndarray:
    """Expert copies each layer of ``new`` needs that its rank did not hold in ``old``. [L]"""
    if old.num_layers != new.num_layers or old.num_experts != new.num_experts:
        raise ValueError("plans cover different layers or experts")
    kn, need = _needed(old, new)
    layer = kn // (new.num_ranks * new.num_experts)
    return np.bincount(layer, weights=need, minlength=new.num_layers).astype(np.int64)


def _rank_loads(row: np.ndarray, w: np.ndarray, slot_rank: np.ndarray, R: int):
    cnt = np.bincount(row, minlength=w.size)
    per_copy = w[row] / cnt[row]
    return np.bincount(slot_rank, weights=per_copy, minlength=R), cnt, per_copy


def _best_move(row, w, slot_rank, R, max_cost):
    """(gain_per_move, cost, kind, a, b, new_max) of the best single candidate for a layer."""
    rl, cnt, pc = _rank_loads(row, w, slot_rank, R)
    h = int(np.argmax(rl))
    cur = rl[h]
    best: tuple[float, int, str | None, int, int, float] = (0.0, 0, None, -1, -1, float(cur))
    hot_slots = np.flatnonzero(slot_rank == h)
    if max_cost >= 2:
        # swaps: hot slot s with slot t elsewhere
        others = np.flatnonzero(slot_rank != h)
        s_idx, t_idx = np.meshgrid(hot_slots, others, indexing="ij")
        delta = pc[s_idx] - pc[t_idx]
        c = slot_rank[t_idx]
        # the hot rank sheds delta; the partner may not end above what the hot rank keeps
        new_max = np.maximum(cur - delta, rl[c] + delta)
        diff_expert = row[s_idx] != row[t_idx]
        new_max = np.where(diff_expert & (delta > 0), new_max, np.inf)
        ij = np.unravel_index(np.argmin(new_max), new_max.shape)
        g = (cur - new_max[ij]) / 2.0
        if g > best[0] + 1e-12:
            best = (float(g), 2, "swap", int(s_idx[ij]), int(t_idx[ij]), float(new_max[ij]))
    if max_cost >= 1:
        # overwrite a redundant copy (slot t, expert x with cnt>1) with a copy of hot expert e
        red = np.flatnonzero(cnt[row] > 1)
        if red.size:
            E = w.size
            C = np.zeros((E, R))
            np.add.at(C, (row, slot_rank), 1.0)
            for e in np.unique(row[hot_slots]):
                t = red[row[red] != e]
                if not t.size:
                    continue
                x = row[t]
                ct = slot_rank[t]
                # new loads: remove e and x contributions, add them back with new counts
                base = rl[None, :] - C[e][None, :] * (w[e] / cnt[e]) - C[x] * (w[x] / cnt[x])[:, None]
                ce = np.tile(C[e], (t.size, 1))
                ce[np.arange(t.size), ct] += 1
                cx = C[x].copy()
                cx[np.arange(t.size), ct] -= 1
                new = base + ce * (w[e] / (cnt[e] + 1)) + cx * (w[x] / (cnt[x] - 1))[:, None]
                grew = new > rl[None, :] + 1e-12
                nm = np.maximum(new[:, h], np.where(grew, new, -np.inf).max(axis=1))
                k = int(np.argmin(nm))
                g = cur - nm[k]
                if g > best[0] + 1e-12:
                    best = (float(g), 1, "overwrite", int(t[k]), int(e), float(nm[k]))
    return best


def replan(prev: Plan, load, max_moves: int | None = None, target_imbalance: float | None = None,
           policy_name: str = "moves") -> tuple[Plan, dict]:
    """Improve ``prev`` for ``load [L, E]`` with at most ``max_moves`` expert copies
    (all layers together). Returns the new plan and ``{"moves", "per_layer_moves",
    "steps"}``. With neither limit the search runs until no move helps."""
    w_all = np.asarray(load, np.float64)
    if w_all.shape != (prev.num_layers, prev.num_experts):
        raise ValueError(f"load shape {w_all.shape} does not match the plan {(prev.num_layers, prev.num_experts)}")
    rows = prev.phy2log.copy()
    sr, R = prev.slot_rank, prev.num_ranks
    budget = np.inf if max_moves is None else int(max_moves)
    used = np.zeros(prev.num_layers, np.int64)

    def done(li):
        if target_imbalance is None:
            return False
        rl, _, _ = _rank_loads(rows[li], w_all[li], sr, R)
        return rl.mean() <= 0 or rl.max() / rl.mean() <= target_imbalance

    heap: list[tuple] = []
    for li in range(prev.num_layers):
        if not done(li) and w_all[li].sum() > 0:
            b = _best_move(rows[li], w_all[li], sr, R, min(2, budget))
            if b[2] is not None:
                heapq.heappush(heap, (-b[0], li, b))
    steps = 0
    while heap and budget > 0:
        _, li, b = heapq.heappop(heap)
        g, cost, kind, a, c, _ = b
        if cost > budget:
            b = _best_move(rows[li], w_all[li], sr, R, budget)
            if b[2] is not None:
                heapq.heappush(heap, (-b[0], li, b))
            continue
        if kind == "swap":
            rows[li, a], rows[li, c] = rows[li, c], rows[li, a]
        else:
            rows[li, a] = c
        budget -= cost
        used[li] += cost
        steps += 1
        if not done(li):
            b = _best_move(rows[li], w_all[li], sr, R, min(2, budget))
            if b[2] is not None:
                heapq.heappush(heap, (-b[0], li, b))
    new = replace(prev, phy2log=rows, policy=policy_name, plan_id=None,
                  params={**prev.params, "max_moves": max_moves, "target_imbalance": target_imbalance})
    real = moves_between(prev, new)
    return new, {"moves": int(real.sum()), "per_layer_moves": real.tolist(), "steps": steps}


def move_copies(old: Plan, new: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Expert copies each rank of ``new`` must receive, summed over layers, ``(intra [R],
    inter [R])``: intra when a rank of the same node held the expert in ``old`` (the copy
    travels over NVLink), inter when only another node did (over the NIC). The total is
    ``moves_between(old, new).sum()``."""
    moves_between(old, new)   # same layers and experts, else ValueError
    L, E, R = new.num_layers, new.num_experts, new.num_ranks
    kn, need = _needed(old, new)
    layer, rank, expert = kn // (R * E), kn // E % R, kn % E
    # (layer, node, expert) the old plan holds, nodes numbered by each plan's ranks per node
    old_node = old.slot_rank // old.ranks_per_node
    n_nodes = int(max(old_node.max(initial=0), (R - 1) // new.ranks_per_node)) + 1
    held = np.unique(((np.arange(L, dtype=np.int64)[:, None] * n_nodes + old_node[None, :]) * E
                      + old.phy2log).ravel())
    want = (layer * n_nodes + rank // new.ranks_per_node) * E + expert
    i = np.minimum(np.searchsorted(held, want), held.size - 1)
    near = held[i] == want
    intra = np.bincount(rank, weights=need * near, minlength=R)
    inter = np.bincount(rank, weights=need * ~near, minlength=R)
    return intra.astype(np.int64), inter.astype(np.int64)

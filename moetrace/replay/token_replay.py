"""Exact replay of per-token routing rows against a plan: each token goes once to each
distinct destination rank, with the bytes received per rank inside and between nodes.

The per-token counterpart of :func:`.engine.replay_load` (which replays aggregated load
and estimates the bytes); both return an :class:`.engine.Block`.
"""
from __future__ import annotations

import numpy as np

from ..domain.ranks import node_of
from ..errors import InputError
from ..placement.planners import Plan
from .engine import Block, _slot_replica_index

#: vLLM's per-token replica choice: ``replica = (token * _HASH mod 2**32) mod copies``
_HASH = np.uint64(2654435761)


def replay_routing(step_idx, layer_idx, token, src_rank, expert, T: int, plan: Plan, split: str,
                   bytes_per_token: int, recorded_slot=None) -> Block:
    """Exact replay of per-token routing rows (index arrays) against ``plan``: each token
    goes once to each distinct destination rank; bytes received per rank, intra vs inter
    node; a token staying on its own rank moves nothing. ``recorded_slot`` (the physical
    slot each row went to, when the engine recorded it and ``plan`` is the plan it ran)
    replaces the replica choice."""
    L, R, spr, rpn = plan.num_layers, plan.num_ranks, plan.slots_per_rank, plan.ranks_per_node
    E = plan.num_experts
    ti = np.asarray(step_idx, np.int64)
    li = np.asarray(layer_idx, np.int64)
    tok = np.asarray(token, np.int64)
    src = np.asarray(src_rank, np.int64)
    e = np.asarray(expert, np.int64)
    cnt = plan.logcnt()
    maxc = int(cnt.max())
    log2phy = np.full((L, E, maxc), -1, np.int64)
    rep = _slot_replica_index(plan)
    for l in range(L):
        log2phy[l, plan.phy2log[l], rep[l]] = np.arange(plan.num_slots)
    h = (tok.astype(np.uint64) * _HASH) % np.uint64(1 << 32)
    slot = log2phy[li, e, (h % cnt[li, e].astype(np.uint64)).astype(np.int64)]
    if split == "local":
        on_rank = np.full((L, E, R), -1, np.int64)
        on_node = np.full((L, E, plan.num_nodes), -1, np.int64)
        srank, snode = plan.slot_rank, plan.slot_node
        for l in range(L):
            for s in range(plan.num_slots - 1, -1, -1):   # lowest slot wins
                on_rank[l, plan.phy2log[l, s], srank[s]] = s
                on_node[l, plan.phy2log[l, s], snode[s]] = s
        src_ok = np.clip(src, 0, R - 1)
        a = on_rank[li, e, src_ok]
        b = on_node[li, e, node_of(src_ok, rpn)]
        slot = np.where(a >= 0, a, np.where(b >= 0, b, slot))
    if recorded_slot is not None:
        rs = np.asarray(recorded_slot, np.int64)
        if rs.size and (rs.max() >= plan.num_slots or (rs >= 0).sum() != rs.size
                        or (plan.phy2log[li, np.maximum(rs, 0)] != e).any()):
            raise InputError(None, "recorded routing slots do not match the plan's experts")
        slot = rs
    dst = slot // spr
    tl = ti * L + li
    cells = T * L
    tokens = np.bincount(tl * R + dst, minlength=cells * R).reshape(T, L, R).astype(np.float64)
    hit = np.zeros((cells, plan.num_slots), bool)
    hit[tl, slot] = True
    touched = hit.reshape(T, L, R, spr).sum(axis=3)
    # dense (cell, token) x destination-rank marks: a token goes once to each distinct rank
    maxtok = int(tok.max()) + 1 if tok.size else 1
    row = tl * maxtok + tok
    marks = np.zeros((cells * maxtok, R), bool)
    marks[row, dst] = True
    src_of = np.full(cells * maxtok, -1, np.int64)
    src_of[row] = src
    nz_row, d = np.nonzero(marks)
    s = src_of[nz_row]
    cell = nz_row // maxtok
    remote = s != d
    same_node = node_of(s, rpn) == node_of(d, rpn)
    w_intra = (remote & same_node).astype(np.float64) * bytes_per_token
    w_inter = (remote & ~same_node).astype(np.float64) * bytes_per_token
    intra = np.bincount(cell * R + d, weights=w_intra, minlength=cells * R).reshape(T, L, R)
    inter = np.bincount(cell * R + d, weights=w_inter, minlength=cells * R).reshape(T, L, R)
    traffic = np.bincount(np.clip(s, 0, R - 1) * R + d, weights=w_intra + w_inter, minlength=R * R).reshape(R, R)
    # nodes per token (node-limited routing shows as a small maximum)
    nn = plan.num_nodes
    used = src_of >= 0
    if R % rpn == 0:
        per_tok = marks[used].reshape(-1, nn, rpn).any(axis=2).sum(axis=1)
    else:
        per_tok = np.array([len(set(node_of(np.flatnonzero(m), rpn).tolist())) for m in marks[used]])
    return Block(tokens, touched, intra, inter, exact_bytes=True,
                 nodes_per_token_max=int(per_tok.max()) if per_tok.size else 0,
                 nodes_per_token_mean=float(per_tok.mean()) if per_tok.size else 0.0, traffic=traffic)

"""A plain-Python (loops, one layer at a time) implementation of EPLB.

It follows the published algorithm step by step with the tie rules in
docs/reference/formats.md (float32 arithmetic, stable descending sort, lowest index wins) and exists to check the
vectorized :func:`moetrace.placement.eplb.rebalance_experts` and to time it against. Nothing
else should call it: it is slow on purpose (no numpy beyond float32 scalars).
"""
from __future__ import annotations

import numpy as np

from moetrace.placement.eplb import check_shape

f32 = np.float32


def _pack(weights: list, num_packs: int) -> tuple[list[int], list[int]]:
    m = len(weights)
    per = m // num_packs
    if per == 1:
        return list(range(m)), [0] * m
    order = sorted(range(m), key=lambda i: -weights[i])   # sorted() is stable
    pack_w = [f32(0)] * num_packs
    pack_n = [0] * num_packs
    pack, rank = [0] * m, [0] * m
    for item in order:
        best = None
        for p in range(num_packs):
            if pack_n[p] < per and (best is None or pack_w[p] < pack_w[best]):
                best = p
        pack[item] = best
        rank[item] = pack_n[best]
        pack_w[best] = f32(pack_w[best] + weights[item])
        pack_n[best] += 1
    return pack, rank


def _replicate(weights: list, num_phy: int):
    m = len(weights)
    phy2log = list(range(m))
    rank = [0] * m
    cnt = [1] * m
    for _ in range(m, num_phy):
        best, best_v = 0, None
        for e in range(m):
            v = f32(weights[e] / f32(cnt[e]))
            if best_v is None or v > best_v:
                best, best_v = e, v
        phy2log.append(best)
        rank.append(cnt[best])
        cnt[best] += 1
    return phy2log, rank, cnt


def _layer(w: list, num_phy: int, G: int, N: int, num_gpus: int):
    E = len(w)
    gsize = E // G
    gpn = G // N
    per_gpu = num_phy // num_gpus
    gsum = []
    for g in range(G):
        acc = w[g * gsize]
        for j in range(1, gsize):
            acc = f32(acc + w[g * gsize + j])
        gsum.append(acc)
    gpack, grank = _pack(gsum, N)
    log2mlog = [0] * E
    for e in range(E):
        g, j = divmod(e, gsize)
        log2mlog[e] = (gpack[g] * gpn + grank[g]) * gsize + j
    mlog2log = [0] * E
    for e, m in enumerate(log2mlog):
        mlog2log[m] = e
    epn, ppn = E // N, num_phy // N
    phy2log = [0] * num_phy
    phyrank = [0] * num_phy
    logcnt = [0] * E
    for node in range(N):
        local = [w[mlog2log[node * epn + i]] for i in range(epn)]
        p2m, prank, cnt = _replicate(local, ppn)
        per_copy = [f32(local[p2m[s]] / f32(cnt[p2m[s]])) for s in range(ppn)]
        pack, rip = _pack(per_copy, num_gpus // N)
        for s in range(ppn):
            dst = node * ppn + pack[s] * per_gpu + rip[s]
            phy2log[dst] = mlog2log[node * epn + p2m[s]]
            phyrank[dst] = prank[s]
        for i in range(epn):
            logcnt[mlog2log[node * epn + i]] = cnt[i]
    return phy2log, phyrank, logcnt


def rebalance_experts_reference(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Same contract as :func:`moetrace.placement.eplb.rebalance_experts`."""
    rows = [[f32(x) for x in row] for row in np.asarray(weight, dtype=np.float32).tolist()]
    E = len(rows[0])
    if not check_shape(E, num_replicas, num_groups, num_nodes, num_gpus):
        num_groups, num_nodes = 1, 1
    out = [_layer(r, num_replicas, num_groups, num_nodes, num_gpus) for r in rows]
    phy2log = np.array([o[0] for o in out], np.int64)
    logcnt = np.array([o[2] for o in out], np.int64)
    maxcnt = int(logcnt.max())
    log2phy = np.full((len(rows), E, maxcnt), -1, np.int64)
    for li, (p2l, prank, _) in enumerate(out):
        for s, (e, r) in enumerate(zip(p2l, prank)):
            log2phy[li, e, r] = s
    return phy2log, log2phy, logcnt

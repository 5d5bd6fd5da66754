"""DeepSeek's expert-parallel load balancer (EPLB), vectorized with numpy.

``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`` returns
``(phy2log [L, R], log2phy [L, E, maxcnt], logcnt [L, E])`` as int64 arrays with the
meaning of the published algorithm:

1. (hierarchical, when ``num_groups % num_nodes == 0``) balanced packing of expert groups
   onto nodes: groups in descending load order, each onto the lightest node that still has
   room, every node getting the same number of groups;
2. inside each node, replication: every extra slot goes to the expert with the highest
   load per copy;
3. balanced packing of the copies (weight = load / copies) onto the node's GPUs.

Otherwise the same with one group and one node (global policy).

Tie rules (docs/reference/formats.md, "DeepSeek EPLB"): float32 arithmetic throughout (group sums accumulate in expert
order), a **stable** descending sort (equal weights keep index order), the lowest pack
index wins among equal pack weights, the lowest expert index among equal load per copy.
The loops that remain run over items, never over layers: every step is a numpy operation
over all layers (and nodes) at once. ``tests/eplb_reference.py`, a test oracle,` holds a plain
Python implementation of the same algorithm used to check this one.
"""
from __future__ import annotations

import numpy as np

__all__ = ["rebalance_experts", "check_shape"]


def check_shape(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> bool:
    """Validate the shape; returns True when the hierarchical policy applies."""
    if min(num_experts, num_replicas, num_groups, num_nodes, num_gpus) < 1:
        raise ValueError("experts, replicas, groups, nodes and gpus must all be >= 1")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas {num_replicas} < {num_experts} logical experts")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas {num_replicas} is not a multiple of num_gpus {num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus {num_gpus} is not a multiple of num_nodes {num_nodes}")
    hier = num_groups % num_nodes == 0
    if hier:
        if num_experts % num_groups:
            raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
        if num_replicas % num_nodes or (num_replicas // num_nodes) < num_experts // num_nodes:
            raise ValueError(f"num_replicas {num_replicas} do not split over {num_nodes} nodes")
    return hier


def _group_sums(w: np.ndarray, group_size: int) -> np.ndarray:
    """float32 sums of consecutive groups, accumulated in expert order."""
    w3 = w.reshape(w.shape[0], -1, group_size)
    acc = w3[:, :, 0].copy()
    for j in range(1, group_size):
        acc += w3[:, :, j]
    return acc


def _balanced_packing(w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the m items of each row into num_packs packs of m // num_packs items each."""
    n, m = w.shape
    per = m // num_packs
    if per == 1:
        return np.tile(np.arange(m, dtype=np.int64), (n, 1)), np.zeros((n, m), np.int64)
    order = np.argsort(-w, axis=1, kind="stable")
    pack = np.empty((n, m), np.int64)
    rank = np.empty((n, m), np.int64)
    pw = np.zeros((n, num_packs), np.float32)
    pc = np.zeros((n, num_packs), np.int64)
    rows = np.arange(n)
    inf = np.float32(np.inf)
    for j in range(m):
        items = order[:, j]
        p = np.argmin(np.where(pc < per, pw, inf), axis=1)
        pack[rows, items] = p
        rank[rows, items] = pc[rows, p]
        pw[rows, p] += w[rows, items]
        pc[rows, p] += 1
    return pack, rank


def _replicate(w: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each of the num_phy - m extra slots to the expert with the most load per copy."""
    n, m = w.shape
    phy2log = np.empty((n, num_phy), np.int64)
    phy2log[:, :m] = np.arange(m)
    rank = np.zeros((n, num_phy), np.int64)
    cnt = np.ones((n, m), np.int64)
    rows = np.arange(n)
    for i in range(m, num_phy):
        r = np.argmax(w / cnt.astype(np.float32), axis=1)
        phy2log[:, i] = r
        rank[:, i] = cnt[rows, r]
        cnt[rows, r] += 1
    return phy2log, rank, cnt


def replica_counts(w: np.ndarray, extra: int) -> np.ndarray:
    """Copies per expert after giving each of ``extra`` slots to the expert with the most
    load per copy: EPLB's replication step, in its float32 arithmetic and first-index ties,
    the one replicate rule every planner uses. ``w`` [L, E] -> counts [L, E] (int64)."""
    w = np.asarray(w, dtype=np.float32)
    return _replicate(w, w.shape[1] + extra)[2]


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(w, num_phy, num_groups, num_nodes, num_gpus):
    L, E = w.shape
    gsize = E // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    # 1. groups onto nodes
    gpack, grank = _balanced_packing(_group_sums(w, gsize), num_nodes)
    log2mlog = (((gpack * groups_per_node + grank) * gsize)[:, :, None] + np.arange(gsize)).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # 2. replicate inside each node
    per_node = np.take_along_axis(w, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate(per_node, num_phy // num_nodes)
    # 3. copies onto the node's GPUs
    per_copy = np.take_along_axis(per_node / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rip = _balanced_packing(per_copy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rip)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1)
                 + (np.arange(num_nodes) * (E // num_nodes))[None, :, None]).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """EPLB placement for load ``weight [layers, experts]`` (any 2-D array-like, e.g. a
    numpy array, a nested list or a CPU torch tensor).

    Returns int64 numpy arrays ``phy2log [L, num_replicas]`` (logical expert of each
    physical slot; slot s lives on GPU s // (num_replicas // num_gpus)), ``log2phy
    [L, E, maxcnt]`` (the slots of each expert in replica order, -1 padded) and ``logcnt
    [L, E]`` (copies per expert). Hierarchical when ``num_groups % num_nodes == 0``, else
    global. Raises ``ValueError`` on a shape the algorithm cannot place.
    """
    if hasattr(weight, "detach"):
        weight = weight.detach().cpu().numpy()
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [layers, experts], got shape {w.shape}")
    L, E = w.shape
    if L == 0:
        raise ValueError("weight has no layers")
    hier = check_shape(E, num_replicas, num_groups, num_nodes, num_gpus)
    w = np.ascontiguousarray(w)
    if hier:
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    maxcnt = int(logcnt.max())
    log2phy = np.full((L, E * maxcnt), -1, np.int64)
    np.put_along_axis(log2phy, phy2log * maxcnt + phyrank,
                      np.broadcast_to(np.arange(num_replicas, dtype=np.int64), (L, num_replicas)), axis=1)
    return phy2log, log2phy.reshape(L, E, maxcnt), logcnt

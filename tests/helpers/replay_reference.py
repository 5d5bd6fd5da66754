"""A plain numpy reference of the replay kernel's per-step rank loads."""
import numpy as np


def _dense(plan):
    L, E, R = plan.num_layers, plan.num_experts, plan.num_ranks
    c = np.zeros((L, E, R))
    for l in range(L):
        for s, e in enumerate(plan.phy2log[l]):
            c[l, e, s // plan.slots_per_rank] += 1
    return c


def _reference(load, plan, top_k, bpt, cost):
    """Plain numpy: per-rank tokens = load @ (copies / copies per expert); slots touched =
    (load > 0) @ copies; dispatch P = 1 - prod over copies (1 - x); rank time from the cost model."""
    c = _dense(plan)
    share = c / c.sum(axis=2, keepdims=True)
    tokens = np.einsum("tle,ler->tlr", load, share)
    touched = np.einsum("tle,ler->tlr", (load > 0).astype(np.float64), c)
    B = load.sum(axis=2, keepdims=True) / top_k
    x = np.clip(load / (c.sum(axis=2)[None] * np.maximum(B, 1e-30)), 0, 1 - 1e-7)
    recv = B * (1 - np.exp(np.einsum("tle,ler->tlr", np.log1p(-x), c)))
    R, rpn = plan.num_ranks, plan.ranks_per_node
    intra, inter = recv * (rpn - 1) / R * bpt, recv * (R - rpn) / R * bpt
    rank = (intra / cost.nvlink_Bps + inter / cost.internode_Bps) * 2e9 + cost.a_ns * tokens + cost.b_ns * touched
    mean = tokens.mean(axis=2)
    imb = np.where(mean > 0, tokens.max(axis=2) / np.where(mean > 0, mean, 1), np.nan)
    return tokens, touched, intra, inter, rank, imb

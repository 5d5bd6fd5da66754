"""Expected destinations of one token under the routing a kernel benchmark draws.

The published all-to-all bandwidths divide *logical* bytes (token messages times the nodes or
GPUs each token reaches) by the measured time, so turning a published bandwidth back into a
time needs the expected count of destinations per token under the benchmark's own routing:

* **node-limited** (``max_nodes`` set, fewer than the nodes): DeepEP's
  ``tests/test_internode.py`` (deepseek-ai/DeepEP at 567632dd, lines 40-44) draws
  ``scores = |randn(tokens, experts)| + 1``, keeps the ``max_nodes`` nodes whose *highest*
  expert score is largest, then takes the top-k experts inside them. The kept nodes each
  hold a very high score, so a token reaches almost all of them (3.98 of 4 nodes at EP 64
  with 256 experts and top-8, where uniform picks inside 4 nodes would give 3.63). No
  closed form: :func:`simulate_node_limited` draws it (seeded, 200,000 tokens; standard
  error about 0.001 destinations).
* **uniform** (no node limit, or at most ``max_nodes`` nodes in all): the k experts are k
  distinct uniform picks, as DeepEP's V1 test does when every node may be chosen and as
  DeepEP V2's ``tests/elastic/test_ep.py`` (at dd758caf) and the hybrid-ep branch's
  ``tests/test_hybrid_ep.py`` draw them: a node is hit with ``1 - C(E - e_node, k) / C(E, k)``,
  a GPU with ``1 - C(E - e_rank, k) / C(E, k)``.
"""
from __future__ import annotations

from functools import lru_cache
from math import comb

import numpy as np

SIM_TOKENS = 200_000
SIM_SEED = 20250224     # any fixed seed: the counts are expectations, the draw only estimates them


def _miss(pool: int, own: int, k: int) -> float:
    """P(none of k distinct uniform picks from ``pool`` lands in a subset of size ``own``)."""
    if pool - own < k:
        return 0.0
    return comb(pool - own, k) / comb(pool, k)


@lru_cache(maxsize=256)
def simulate_node_limited(nodes: int, ranks_per_node: int, num_experts: int, top_k: int, max_nodes: int,
                          tokens: int = SIM_TOKENS, seed: int = SIM_SEED) -> tuple[float, float]:
    """(nodes, GPUs) reached per token, averaged over ``tokens`` drawn as DeepEP's internode
    test draws them (see the module docstring)."""
    rng = np.random.default_rng(seed)
    e_node = num_experts // nodes
    e_rank = e_node // ranks_per_node
    n_nodes = n_ranks = 0.0
    chunk = max(1, min(tokens, 4_000_000 // num_experts))
    done = 0
    while done < tokens:
        t = min(chunk, tokens - done)
        scores = np.abs(rng.standard_normal((t, num_experts), dtype=np.float32)) + 1.0
        group = scores.reshape(t, nodes, e_node).max(axis=2)
        keep = np.argpartition(-group, max_nodes - 1, axis=1)[:, :max_nodes]
        mask = np.zeros((t, nodes), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(np.repeat(mask, e_node, axis=1), scores, 0.0)
        top = np.argpartition(-masked, top_k - 1, axis=1)[:, :top_k]
        node_hit = np.zeros((t, nodes), bool)
        np.put_along_axis(node_hit, top // e_node, True, axis=1)
        rank_hit = np.zeros((t, nodes * ranks_per_node), bool)
        np.put_along_axis(rank_hit, top // e_rank, True, axis=1)
        n_nodes += float(node_hit.sum())
        n_ranks += float(rank_hit.sum())
        done += t
    return n_nodes / tokens, n_ranks / tokens


def routing_counts(ep: int, ranks_per_node: int, top_k: int, num_experts: int = 256,
                   max_nodes: int | None = 4) -> dict:
    """Expected destinations of one token: ``nodes`` (own included), ``remote_nodes``,
    ``ranks`` (GPUs, own included), ``chosen_nodes`` (nodes a token may use) and ``how``
    (``uniform`` or ``node-limited draw``)."""
    rpn = min(ranks_per_node, ep)
    nodes = max(1, ep // rpn)
    e_node = num_experts // nodes
    e_rank = num_experts // ep
    k = min(top_k, num_experts)
    if max_nodes and nodes > max_nodes:
        n_nodes, n_ranks = simulate_node_limited(nodes, rpn, num_experts, k, int(max_nodes))
        g, how = int(max_nodes), "node-limited draw (DeepEP tests/test_internode.py)"
    else:
        g, how = nodes, "uniform"
        n_nodes = nodes * (1.0 - _miss(num_experts, e_node, k))
        n_ranks = ep * (1.0 - _miss(num_experts, e_rank, k))
    return {"nodes": n_nodes, "remote_nodes": n_nodes * (1.0 - 1.0 / nodes), "ranks": n_ranks,
            "ranks_per_node": rpn, "chosen_nodes": g, "how": how}

"""Time of an expert-parallel dispatch or combine on a GPU, in the two kernel regimes the
real libraries have (DeepEP's definitions).

Bytes per token message (DeepEP tests): FP8 ``hidden + hidden/128*4`` (values + one FP32
scale per 128), BF16 ``2*hidden``; low-latency dispatch messages carry 16 more bytes.

Normal (high-throughput) kernels, per rank, with random routing limited to ``topk_groups``
nodes per token (DeepSeek-V3's node-limited routing, as DeepEP's test draws it):

* a token goes once to every node holding one of its experts (RDMA, deduplicated per node),
  then over NVLink to every GPU of that node holding one (deduplicated per GPU);
* expected counts under uniform routing inside the chosen nodes: a node is hit with
  ``1 - C(E_G - e_node, k) / C(E_G, k)``, a GPU with ``1 - C(E_G - e_rank, k) / C(E_G, k)``
  (E_G experts in the G chosen nodes, e_node / e_rank per node / GPU);
* ``t = latency + max(rdma_bytes / (eff_rdma * NIC), nvl_bytes / (eff_nvl * NVLink))``,
  the bottleneck link (the two links run at the same time); bytes leaving the GPU only
  (the own node's share stays off the NIC, the own GPU's share off NVLink).

DeepEP's published "bottleneck bandwidth" is the logical bytes (own node / own GPU
included) over the time: RDMA bytes between nodes, NVLink bytes inside one node.

Low-latency kernels: every (token, expert) pair is one message, no deduplication; inside a
node over NVLink (DeepEP since 2025-06) or everything over RDMA (the earlier release):
``t = latency + max(remote_bytes / (eff_rdma * NIC), local_bytes / (eff_nvl * NVLink))``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb

from .hardware import GPU


@dataclass(frozen=True)
class A2AParams:
    latency_us: float
    eff_rdma: float
    eff_nvl: float


def message_bytes(hidden: int, dtype: str, low_latency: bool = False, direction: str = "dispatch") -> float:
    if dtype == "fp8":
        b = hidden + hidden / 128 * 4
    elif dtype == "bf16":
        b = 2.0 * hidden
    else:
        raise ValueError(f"no all-to-all message size for dtype {dtype!r}")
    if low_latency and direction == "dispatch":
        b += 16
    return float(b)


def _miss(pool: int, own: int, k: int) -> float:
    """P(none of k distinct picks from ``pool`` lands in a subset of size ``own``)."""
    if pool - own < k:
        return 0.0
    return comb(pool - own, k) / comb(pool, k)


def routing_counts(ep: int, ranks_per_node: int, top_k: int, num_experts: int = 256,
                   topk_groups: int | None = 4) -> dict:
    """Expected destinations of one token (uniform routing inside at most ``topk_groups``
    nodes): nodes (own included), remote nodes, GPUs (own included)."""
    nodes = max(1, ep // ranks_per_node)
    g = nodes if not topk_groups else min(nodes, topk_groups)
    e_node = num_experts // nodes
    e_rank = num_experts // ep
    pool = g * e_node
    k = min(top_k, pool)
    p_node = 1.0 - _miss(pool, e_node, k)
    p_rank = 1.0 - _miss(pool, e_rank, k)
    n_nodes = g * p_node
    own_node = (g / nodes) * p_node
    n_ranks = g * ranks_per_node * p_rank
    return {"nodes": n_nodes, "remote_nodes": n_nodes - own_node, "ranks": n_ranks, "ranks_per_node": ranks_per_node,
            "chosen_nodes": g}


def normal_terms(hw: GPU, params: A2AParams, *, ep: int, ranks_per_node: int, tokens: int, top_k: int,
                 hidden: int, dtype: str, num_experts: int = 256, topk_groups: int | None = 4) -> dict:
    rc = routing_counts(ep, ranks_per_node, top_k, num_experts, topk_groups)
    msg = message_bytes(hidden, dtype)
    internode = ep > ranks_per_node
    rdma_logical = tokens * rc["nodes"] * msg if internode else 0.0
    rdma_bytes = tokens * rc["remote_nodes"] * msg if internode else 0.0
    nvl_logical = tokens * rc["ranks"] * msg
    nvl_bytes = nvl_logical * (1.0 - 1.0 / min(ep, ranks_per_node))
    t_rdma = rdma_bytes / (params.eff_rdma * hw.rdma_Bps)
    t_nvl = nvl_bytes / (params.eff_nvl * hw.nvlink_Bps)
    t = params.latency_us * 1e-6 + max(t_rdma, t_nvl)
    return {"time_s": t, "rdma_s": t_rdma, "nvlink_s": t_nvl, "latency_s": params.latency_us * 1e-6,
            "rdma_bytes": rdma_bytes, "nvlink_bytes": nvl_bytes,
            # the bytes DeepEP's bottleneck bandwidth divides: RDMA between nodes, NVLink inside one
            "logical_bytes": rdma_logical if internode else nvl_logical,
            "bottleneck": "rdma" if t_rdma >= t_nvl else "nvlink", "routing": rc}


def low_latency_terms(hw: GPU, params: A2AParams, *, ep: int, ranks_per_node: int, tokens: int, top_k: int,
                      hidden: int, dtype: str, direction: str = "dispatch", intranode_path: str = "nvlink") -> dict:
    msg = message_bytes(hidden, dtype, low_latency=True, direction=direction)
    logical = tokens * top_k * msg
    rpn = min(ep, ranks_per_node)
    if intranode_path == "nvlink":
        remote = logical * (ep - rpn) / ep
        local = logical * (rpn - 1) / ep
    else:   # every other GPU through the NIC
        remote = logical * (ep - 1) / ep
        local = 0.0
    t_rdma = remote / (params.eff_rdma * hw.rdma_Bps)
    t_nvl = local / (params.eff_nvl * hw.nvlink_Bps)
    t = params.latency_us * 1e-6 + max(t_rdma, t_nvl)
    return {"time_s": t, "rdma_s": t_rdma, "nvlink_s": t_nvl, "latency_s": params.latency_us * 1e-6,
            "rdma_bytes": remote, "nvlink_bytes": local, "logical_bytes": logical,
            "bottleneck": "rdma" if t_rdma >= t_nvl else "nvlink"}

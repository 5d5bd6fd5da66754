"""Time of an expert-parallel dispatch or combine on a GPU, per kernel family.

Bytes per token message (DeepEP tests): FP8 ``hidden + hidden/128*4`` (values + one FP32
scale per 128), BF16 ``2*hidden``; low-latency dispatch messages carry 16 more bytes.

Two ways a kernel moves tokens (:data:`FAMILIES` maps every ``--kernel`` to one):

* ``dedup`` (DeepEP V1 normal, DeepEP V2, hybrid-ep, UCCL/MORI normal): a token goes once
  to every node holding one of its experts (RDMA, deduplicated per node), then over NVLink
  to every GPU of that node holding one (deduplicated per GPU). Expected destinations come
  from :func:`.routing.routing_counts` (node-limited as DeepEP's test draws it, or
  uniform). Bytes leaving the GPU only count (own node off the NIC, own GPU off NVLink).
* ``per-expert`` (DeepEP low-latency, pplx, one-sided NVLink, UCCL/MORI low-latency):
  every (token, expert) pair is one message, no deduplication; inside the NVLink domain
  over NVLink (DeepEP since 2025-06) or everything over RDMA (the earlier release).
* ``nccl``: a plain all-to-all of deduplicated per-GPU messages: every remote-domain GPU's
  share crosses the NIC itself (no forwarding through a peer), the rest NVLink.

``t = latency + (t_link^P + t_sm^P)^(1/P)``, ``t_link = max(rdma_bytes / (eff_rdma * NIC),
nvl_bytes / (eff_nvl * NVLink))`` (the two links run at the same time) and ``t_sm = bytes /
(sms * sm_gbps)``: a kernel given few SMs cannot drive the links (DeepEP's throughput on
B200 roughly doubles from 16 to 48 SMs, the hybrid-ep branch's table); the P-norm lets the
slower of the two dominate smoothly (P = :data:`SM_NORM`, fixed). ``sm_gbps`` 0: no SM
term (the low-latency kernels use the SMs they need).

DeepEP's published "bottleneck bandwidth" is the logical bytes (own node / own GPU
included) over the time: RDMA bytes between nodes, NVLink bytes inside one node.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import GPU
from .routing import routing_counts

#: the P of the link/SM P-norm (fixed: 3 keeps the link term when SMs are plenty)
SM_NORM = 3.0


@dataclass(frozen=True)
class A2AParams:
    latency_us: float
    eff_rdma: float
    eff_nvl: float
    sm_gbps: float = 0.0      # bytes one SM moves per ns (GB/s per SM); 0: no SM limit


#: every ``--kernel``: (fitted regime or None, byte pattern, regime whose parameters an
#: unfitted family borrows, default SM count (None: not SM-limited), default max nodes per
#: token, what it is)
FAMILIES: dict[str, dict] = {
    "normal": dict(regime="a2a_normal", style="dedup", params_from="a2a_normal", sms=24, max_nodes=4,
                   what="DeepEP V1 normal (high-throughput) kernels; 24 SMs as DeepEP's tests run them"),
    "low-latency": dict(regime="a2a_low_latency", style="per-expert", params_from="a2a_low_latency", sms=None,
                        max_nodes=None, what="DeepEP V1 low-latency kernels"),
    "deepep-v2": dict(regime="a2a_deepep_v2", style="dedup", params_from="a2a_deepep_v2", sms=12, max_nodes=None,
                      what="DeepEP V2 (EPv2, 2026-04) kernels; 12 SMs as its README's EP 8x2 rows"),
    "hybrid-ep": dict(regime="a2a_hybrid_ep", style="dedup", params_from="a2a_hybrid_ep", sms=16, max_nodes=None,
                      what="DeepEP hybrid-ep branch (NVIDIA HybridEP) kernels"),
    "pplx": dict(regime=None, style="per-expert", params_from="a2a_low_latency", sms=None, max_nodes=None,
                 what="pplx-kernels all-to-all (per-expert messages); DeepEP low-latency parameters"),
    "nccl": dict(regime=None, style="nccl", params_from="a2a_normal", sms=None, max_nodes=None,
                 what="NCCL all-to-all of per-GPU messages; DeepEP V1 normal efficiencies"),
    "nvlink-one-sided": dict(regime=None, style="per-expert", params_from="a2a_low_latency", sms=None,
                             max_nodes=None, what="one-sided NVLink kernels (TensorRT-LLM NVLinkOneSided, "
                                                  "FlashInfer); DeepEP low-latency parameters"),
    "uccl-normal": dict(regime=None, style="dedup", params_from="a2a_normal", sms=24, max_nodes=4,
                        what="UCCL-EP normal kernels (DeepEP-compatible); DeepEP V1 normal parameters"),
    "uccl-low-latency": dict(regime=None, style="per-expert", params_from="a2a_low_latency", sms=None,
                             max_nodes=None, what="UCCL-EP low-latency kernels; DeepEP low-latency parameters"),
    "mori": dict(regime=None, style="dedup", params_from="a2a_normal", sms=24, max_nodes=None,
                 what="AMD MORI-EP intra/inter-node kernels; DeepEP V1 normal parameters"),
    "mori-low-latency": dict(regime=None, style="per-expert", params_from="a2a_low_latency", sms=None,
                             max_nodes=None, what="AMD MORI-EP low-latency kernels; DeepEP low-latency parameters"),
}


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


def link_bytes(style: str, *, ep: int, ranks_per_node: int, tokens: int, top_k: int, hidden: int, dtype: str,
               num_experts: int = 256, max_nodes: int | None = 4, direction: str = "dispatch",
               intranode_path: str = "nvlink") -> dict:
    """Bytes one rank moves over RDMA and over NVLink in one dispatch or combine (``style``
    of :data:`FAMILIES`), and the logical bytes a published bandwidth divides."""
    rpn = min(ep, ranks_per_node)
    internode = ep > rpn
    if style == "per-expert":
        msg = message_bytes(hidden, dtype, low_latency=True, direction=direction)
        logical = tokens * top_k * msg
        if intranode_path == "nvlink":
            remote, local = logical * (ep - rpn) / ep, logical * (rpn - 1) / ep
        else:   # every other GPU through the NIC
            remote, local = logical * (ep - 1) / ep, 0.0
        return {"rdma_bytes": remote, "nvlink_bytes": local, "logical_bytes": logical, "routing": None}
    rc = routing_counts(ep, rpn, top_k, num_experts, max_nodes)
    msg = message_bytes(hidden, dtype)
    nvl_logical = tokens * rc["ranks"] * msg
    if style == "nccl":     # each remote-domain GPU's share crosses the NIC itself
        remote = nvl_logical * (ep - rpn) / ep
        return {"rdma_bytes": remote, "nvlink_bytes": nvl_logical * (rpn - 1) / ep,
                "logical_bytes": nvl_logical, "routing": rc}
    rdma_logical = tokens * rc["nodes"] * msg if internode else 0.0
    return {"rdma_bytes": tokens * rc["remote_nodes"] * msg if internode else 0.0,
            "nvlink_bytes": nvl_logical * (1.0 - 1.0 / rpn),
            # the bytes DeepEP's bottleneck bandwidth divides: RDMA between nodes, NVLink inside one
            "logical_bytes": rdma_logical if internode else nvl_logical, "routing": rc}


def time_terms(hw: GPU, params: A2AParams, b: dict, sms: int | None) -> dict:
    """Time of moving ``b`` (:func:`link_bytes`) on ``hw`` with ``sms`` SMs (None: not SM-limited)."""
    t_rdma = b["rdma_bytes"] / (params.eff_rdma * hw.rdma_Bps)
    t_nvl = b["nvlink_bytes"] / (params.eff_nvl * hw.nvlink_Bps)
    t_link = max(t_rdma, t_nvl)
    t_sm = 0.0
    if sms and params.sm_gbps > 0:
        t_sm = (b["rdma_bytes"] + b["nvlink_bytes"]) / (sms * params.sm_gbps * 1e9)
    t_move = (t_link ** SM_NORM + t_sm ** SM_NORM) ** (1.0 / SM_NORM) if t_sm > 0 else t_link
    t = params.latency_us * 1e-6 + t_move
    return dict(b, time_s=t, rdma_s=t_rdma, nvlink_s=t_nvl, sm_s=t_sm, latency_s=params.latency_us * 1e-6,
                bottleneck="sm" if t_sm > t_link else ("rdma" if t_rdma >= t_nvl else "nvlink"))


def normal_terms(hw: GPU, params: A2AParams, *, ep: int, ranks_per_node: int, tokens: int, top_k: int,
                 hidden: int, dtype: str, num_experts: int = 256, topk_groups: int | None = 4,
                 sms: int | None = None, style: str = "dedup") -> dict:
    b = link_bytes(style, ep=ep, ranks_per_node=ranks_per_node, tokens=tokens, top_k=top_k, hidden=hidden,
                   dtype=dtype, num_experts=num_experts, max_nodes=topk_groups)
    return time_terms(hw, params, b, sms)


def low_latency_terms(hw: GPU, params: A2AParams, *, ep: int, ranks_per_node: int, tokens: int, top_k: int,
                      hidden: int, dtype: str, direction: str = "dispatch", intranode_path: str = "nvlink") -> dict:
    b = link_bytes("per-expert", ep=ep, ranks_per_node=ranks_per_node, tokens=tokens, top_k=top_k, hidden=hidden,
                   dtype=dtype, direction=direction, intranode_path=intranode_path)
    return time_terms(hw, params, b, None)

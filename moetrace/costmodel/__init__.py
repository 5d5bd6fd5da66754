"""A GPU cost model built from physics and fitted on published kernel measurements.

- :mod:`.hardware` -- per-GPU datasheet peaks (tensor FLOP/s per dtype, HBM, NVLink, RDMA,
  SMs, NVLink domain), each cited
- :mod:`.gemm` -- grouped-GEMM time (quantized roofline, p-norm overlap, launch cost) and
  the expert MLP (gate/up then down)
- :mod:`.a2a` -- dispatch / combine time of every kernel family (:data:`.a2a.FAMILIES`)
- :mod:`.routing` -- destinations per token under the routing a benchmark draws
- :mod:`.published` -- the cited published rows (``data/published.csv``) and their times
- :mod:`.fit` -- fits the achieved efficiencies and measures the error on rows held out in
  whole groups; every GPU × kernel band (``data/fitted.json``)

:func:`expert_ns` and :func:`comm_ns` are what ``moetrace cost`` and replay call;
:func:`band` gives the band of one GPU × kernel and whether it was validated there.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .a2a import FAMILIES, A2AParams, link_bytes, time_terms
from .gemm import GemmParams, expert_mlp_terms
from .hardware import GPUS, gpu

FITTED = Path(__file__).resolve().parent / "data" / "fitted.json"
KERNELS = tuple(FAMILIES)


@lru_cache(maxsize=1)
def fitted() -> dict:
    return json.loads(FITTED.read_text())


class Band(dict):
    """One GPU × kernel band: ``band`` (relative, 0.3 = ±30%), ``validated`` (published rows
    of this kernel on this GPU exist), ``rows``, ``how`` (how it was measured, in words)."""

    def words(self) -> str:
        return "validated" if self["validated"] else f"not validated on {self['key']}"


def band(hardware: str, kernel: str) -> Band:
    """The band of ``kernel`` (a :data:`KERNELS` name, ``gemm_grouped`` or ``gemm_dense``) on ``hardware``."""
    hw = gpu(hardware)
    key = f"{hw.name}/{kernel}"
    b = fitted()["bands"].get(key)
    if b is None:
        raise UsageError(f"--kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return Band(b, key=key)


def regime_params(kernel: str) -> dict:
    """The fitted parameters ``kernel`` runs with (its own, or the family it borrows from)."""
    if kernel.startswith("gemm"):
        return dict(fitted()["regimes"][kernel]["params"])
    return dict(fitted()["regimes"][FAMILIES[kernel]["params_from"]]["params"])


def preset(hardware: str) -> dict:
    """One GPU's cost parameters: peaks, and every kernel's parameters with its band."""
    hw = gpu(hardware)
    kernels: dict[str, dict] = {}
    out: dict[str, Any] = {"hardware": hw.name, "peaks": {"sms": hw.sms, "tensor_flops": hw.tensor_flops, "hbm_Bps": hw.hbm_Bps,
                                          "nvlink_Bps": hw.nvlink_Bps, "rdma_Bps": hw.rdma_Bps,
                                          "nvlink_domain": hw.domain},
           "peaks_source": hw.source, "kernels": kernels, "regimes": {}}
    for kern in ("gemm_grouped", "gemm_dense", *KERNELS):
        b = band(hw.name, kern)
        kernels[kern] = {"params": regime_params(kern), "band": b["band"], "validated": b["validated"],
                                "band_source": b["how"]}
    for reg in fitted()["regimes"]:     # by fitted regime (the kernel that owns it)
        kern = reg if reg.startswith("gemm") else next(k for k, v in FAMILIES.items() if v["regime"] == reg)
        out["regimes"][reg] = kernels[kern]
    return out


def _check_pos(name: str, v, integer: bool = True) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok or (integer and int(v) != v):
        raise UsageError(f"--{name} must be a positive {'integer' if integer else 'number'}, got {v!r}")


def expert_ns(hardware: str, hidden: int, intermediate: int, tokens_per_expert, weight_dtype: str = "fp8") -> dict:
    """Time of all touched experts' MLPs on one rank (gate/up + down grouped GEMMs), with its
    band and every term."""
    hw = gpu(hardware)
    _check_pos("hidden", hidden)
    _check_pos("intermediate", intermediate)
    tpe = list(tokens_per_expert)
    if not tpe:
        raise UsageError("--experts must be a positive integer")
    for m in tpe:
        _check_pos("tokens-per-expert", m)
    if weight_dtype not in hw.tensor_flops:
        raise UsageError(f"{hw.name} has no {weight_dtype.upper()} tensor math "
                         f"(choose from {', '.join(sorted(hw.tensor_flops))})")
    r = fitted()["regimes"]["gemm_grouped"]
    params = GemmParams(**r["params"])
    t = expert_mlp_terms(hw, params, tpe, int(hidden), int(intermediate), weight_dtype)
    b = band(hw.name, "gemm_grouped")
    src, validated = b["how"], b["validated"] and weight_dtype == "fp8"
    if weight_dtype != "fp8":
        src = f"not validated on {hw.name}/{weight_dtype.upper()}: the published rows are FP8; " + src

    def ns(g):
        return {"time_ns": g["time_s"] * 1e9, "compute_ns": g["compute_s"] * 1e9, "memory_ns": g["memory_s"] * 1e9,
                "launch_ns": g["launch_s"] * 1e9, "tiles": g["tiles"], "waves": g["waves"],
                "block_m": g["block_m"], "block_n": g["block_n"], "flops": g["flops"], "bytes": g["bytes"]}

    return {"hardware": hw.name, "expert_ns": t["time_s"] * 1e9, "expert_band": b["band"], "band_source": src,
            # the band was measured on this configuration's kind of row (GPU, FP8) or carried over
            "band_measured": validated,
            "validation": "validated" if validated else f"not validated on {hw.name}/gemm_grouped"
                          + ("" if weight_dtype == "fp8" else f"/{weight_dtype}"),
            "terms": {"gate_up": ns(t["gate_up"]), "down": ns(t["down"]), "params": r["params"],
                      "rule": "per GEMM (t_c^p + t_m^p)^(1/p) + launch; t_c = waves x tile time; "
                              "SwiGLU between the GEMMs not modelled"},
            "source": f"moetrace GPU cost model (gemm_grouped, fit {fitted()['fit_date']}); peaks: {hw.source}"}


def comm_ns(hardware: str, hidden: int, ep: int, ranks_per_node: int | None, tokens: int, top_k: int,
            kernel: str, dispatch_dtype: str = "fp8", combine_dtype: str = "bf16", num_experts: int = 256,
            topk_groups: int | None = None, sms: int | None = None) -> dict:
    """Dispatch and combine time of one rank with ``kernel`` (a :data:`KERNELS` name).

    ``ranks_per_node``: GPUs per NVLink domain (None: the GPU's, 72 on GB200 NVL72);
    ``topk_groups``: the most nodes a token's experts may span (None: the kernel's default,
    4 for DeepEP's normal kernels as DeepSeek-V3 routes; 0: no limit); ``sms``: SMs the
    kernel runs on (None: its default; ignored by kernels that are not SM-limited)."""
    hw = gpu(hardware)
    if kernel not in FAMILIES:
        raise UsageError(f"--kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    fam = FAMILIES[kernel]
    rpn = hw.domain if ranks_per_node is None else ranks_per_node
    for name, v in (("hidden", hidden), ("ep", ep), ("ranks-per-node", rpn), ("tokens", tokens),
                    ("top-k", top_k), ("num-experts", num_experts)):
        _check_pos(name, v)
    if sms is not None:
        _check_pos("sms", sms)
        if sms > hw.sms:
            raise UsageError(f"--sms {sms} exceeds the {hw.sms} SMs of {hw.name}")
    if topk_groups is not None and (not isinstance(topk_groups, int) or topk_groups < 0):
        raise UsageError(f"--max-nodes-per-token must be a non-negative integer, got {topk_groups!r}")
    for name, dt in (("dispatch-dtype", dispatch_dtype), ("combine-dtype", combine_dtype)):
        if dt not in ("fp8", "bf16"):
            raise UsageError(f"--{name} must be fp8 or bf16, got {dt!r}")
    if ep % rpn and ep > rpn:
        raise UsageError(f"--ep {ep} is not a whole number of NVLink domains of --ranks-per-node {rpn}")
    if num_experts % ep:
        raise UsageError(f"--num-experts {num_experts} does not divide over --ep {ep}")
    if top_k > num_experts:
        raise UsageError(f"--top-k {top_k} exceeds --num-experts {num_experts}")
    max_nodes = fam["max_nodes"] if topk_groups is None else (topk_groups or None)
    used_sms = (sms or fam["sms"]) if fam["sms"] is not None else None
    params = A2AParams(**regime_params(kernel))
    common: dict[str, Any] = dict(ep=int(ep), ranks_per_node=int(min(rpn, ep)), tokens=int(tokens), top_k=int(top_k),
                  hidden=int(hidden), num_experts=int(num_experts), max_nodes=max_nodes)
    d = time_terms(hw, params, link_bytes(fam["style"], dtype=dispatch_dtype, direction="dispatch", **common), used_sms)
    c = time_terms(hw, params, link_bytes(fam["style"], dtype=combine_dtype, direction="combine", **common), used_sms)
    b = band(hw.name, kernel)

    def ns(t):
        return {"time_ns": t["time_s"] * 1e9, "rdma_ns": t["rdma_s"] * 1e9, "nvlink_ns": t["nvlink_s"] * 1e9,
                "sm_ns": t["sm_s"] * 1e9, "latency_ns": t["latency_s"] * 1e9, "rdma_bytes": t["rdma_bytes"],
                "nvlink_bytes": t["nvlink_bytes"], "bottleneck": t["bottleneck"],
                "routing": ({k: v for k, v in t["routing"].items()} if t["routing"] else None)}

    src_reg = fam["regime"] or f"{fam['params_from']} (borrowed: no published {kernel} row)"
    return {"hardware": hw.name, "kernel": kernel, "dispatch_ns": d["time_s"] * 1e9, "combine_ns": c["time_s"] * 1e9,
            "comm_band": b["band"], "dispatch_band": b["band"], "combine_band": b["band"],
            "band_source": b["how"], "band_measured": b["validated"], "validation": b.words(),
            "inputs": {"ranks_per_node": int(rpn), "sms": used_sms, "max_nodes_per_token": max_nodes,
                       "num_experts": int(num_experts)},
            "terms": {"dispatch": ns(d), "combine": ns(c), "params": dict(params.__dict__),
                      "rule": "latency + (link^3 + sm^3)^(1/3); link = max(RDMA bytes / (eff_rdma x NIC), "
                              "NVLink bytes / (eff_nvl x NVLink)); sm = bytes / (SMs x sm_gbps)"},
            "source": f"moetrace GPU cost model ({fam['what']}; {src_reg}, fit {fitted()['fit_date']}); "
                      f"peaks: {hw.source}"}


__all__ = ["GPUS", "KERNELS", "band", "preset", "expert_ns", "comm_ns", "fitted", "regime_params"]

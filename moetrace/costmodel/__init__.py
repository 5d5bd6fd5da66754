"""A GPU cost model built from physics and fitted on published kernel measurements.

- :mod:`.hardware` -- per-GPU datasheet peaks (tensor FLOP/s per dtype, HBM, NVLink, RDMA, SMs)
- :mod:`.gemm` -- grouped-GEMM time (quantized roofline, p-norm overlap, launch cost) and
  the expert MLP (gate/up then down)
- :mod:`.a2a` -- dispatch / combine time, normal and low-latency kernel regimes
- :mod:`.fit` -- fits the achieved efficiencies on ``data/published.csv`` and measures the
  held-out error that becomes each regime's stated band (``data/fitted.json``)

:func:`expert_ns` and :func:`comm_ns` are what ``moetrace cost`` (and later replay) call;
:func:`preset` gives one hardware's parameters with their bands.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from ..errors import UsageError
from .a2a import A2AParams, low_latency_terms, normal_terms
from .gemm import GemmParams, expert_mlp_terms
from .hardware import GPUS, gpu

FITTED = Path(__file__).resolve().parent / "data" / "fitted.json"
MEASURED_ON = "H800"   # the only GPU with published rows in data/published.csv


@lru_cache(maxsize=1)
def fitted() -> dict:
    return json.loads(FITTED.read_text())


def _band(regime: str, hardware: str) -> tuple[float, str]:
    d = fitted()
    r = d["regimes"][regime]
    src = (f"max leave-one-out held-out error of {r['rows']} published {MEASURED_ON} rows "
           f"({regime}, fit {d['fit_date']}, moetrace/costmodel/data/published.csv)")
    if hardware != MEASURED_ON:
        src += f"; {hardware} is unmeasured: the {MEASURED_ON} efficiencies applied to {hardware} peaks"
    return float(r["band"]), src


def preset(hardware: str) -> dict:
    """One GPU's cost parameters: peaks, fitted efficiencies per regime, each with its band."""
    hw = gpu(hardware)
    out = {"hardware": hw.name, "peaks": {"sms": hw.sms, "tensor_flops": hw.tensor_flops, "hbm_Bps": hw.hbm_Bps,
                                          "nvlink_Bps": hw.nvlink_Bps, "rdma_Bps": hw.rdma_Bps},
           "peaks_source": hw.source, "regimes": {}}
    for reg, r in fitted()["regimes"].items():
        band, src = _band(reg, hw.name)
        out["regimes"][reg] = {"params": dict(r["params"]), "band": band, "band_source": src}
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
    band, src = _band("gemm_grouped", hw.name)
    if weight_dtype != "fp8":
        src += f"; {weight_dtype.upper()} is unmeasured (the published rows are FP8)"

    def ns(g):
        return {"time_ns": g["time_s"] * 1e9, "compute_ns": g["compute_s"] * 1e9, "memory_ns": g["memory_s"] * 1e9,
                "launch_ns": g["launch_s"] * 1e9, "tiles": g["tiles"], "waves": g["waves"],
                "block_m": g["block_m"], "block_n": g["block_n"], "flops": g["flops"], "bytes": g["bytes"]}

    return {"hardware": hw.name, "expert_ns": t["time_s"] * 1e9, "expert_band": band, "band_source": src,
            # the band was measured on this configuration's kind of row (H800, FP8) or carried over
            "band_measured": hw.name == MEASURED_ON and weight_dtype == "fp8",
            "terms": {"gate_up": ns(t["gate_up"]), "down": ns(t["down"]), "params": r["params"],
                      "rule": "per GEMM (t_c^p + t_m^p)^(1/p) + launch; t_c = waves x tile time; "
                              "SwiGLU between the GEMMs not modelled"},
            "source": f"moetrace GPU cost model (gemm_grouped, fit {fitted()['fit_date']}); peaks: {hw.source}"}


def comm_ns(hardware: str, hidden: int, ep: int, ranks_per_node: int, tokens: int, top_k: int, kernel: str,
            dispatch_dtype: str = "fp8", combine_dtype: str = "bf16", num_experts: int = 256,
            topk_groups: int | None = 4) -> dict:
    """Dispatch and combine time of one rank in the ``kernel`` regime (normal / low-latency)."""
    hw = gpu(hardware)
    for name, v in (("hidden", hidden), ("ep", ep), ("ranks-per-node", ranks_per_node), ("tokens", tokens),
                    ("top-k", top_k), ("num-experts", num_experts)):
        _check_pos(name, v)
    if kernel not in ("normal", "low-latency"):
        raise UsageError(f"--kernel must be normal or low-latency, got {kernel!r}")
    for name, dt in (("dispatch-dtype", dispatch_dtype), ("combine-dtype", combine_dtype)):
        if dt not in ("fp8", "bf16"):
            raise UsageError(f"--{name} must be fp8 or bf16, got {dt!r}")
    if ep % ranks_per_node and ep > ranks_per_node:
        raise UsageError(f"--ep {ep} is not a whole number of nodes of --ranks-per-node {ranks_per_node}")
    if num_experts % ep:
        raise UsageError(f"--num-experts {num_experts} does not divide over --ep {ep}")
    if top_k > num_experts:
        raise UsageError(f"--top-k {top_k} exceeds --num-experts {num_experts}")
    reg = "a2a_normal" if kernel == "normal" else "a2a_low_latency"
    r = fitted()["regimes"][reg]
    params = A2AParams(**r["params"])
    rpn = min(ranks_per_node, ep)
    common = dict(ep=int(ep), ranks_per_node=int(rpn), tokens=int(tokens), top_k=int(top_k), hidden=int(hidden))
    if kernel == "normal":
        d = normal_terms(hw, params, dtype=dispatch_dtype, num_experts=num_experts, topk_groups=topk_groups, **common)
        c = normal_terms(hw, params, dtype=combine_dtype, num_experts=num_experts, topk_groups=topk_groups, **common)
    else:
        d = low_latency_terms(hw, params, dtype=dispatch_dtype, direction="dispatch", **common)
        c = low_latency_terms(hw, params, dtype=combine_dtype, direction="combine", **common)
    band, src = _band(reg, hw.name)

    def ns(t):
        return {"time_ns": t["time_s"] * 1e9, "rdma_ns": t["rdma_s"] * 1e9, "nvlink_ns": t["nvlink_s"] * 1e9,
                "latency_ns": t["latency_s"] * 1e9, "rdma_bytes": t["rdma_bytes"], "nvlink_bytes": t["nvlink_bytes"],
                "bottleneck": t["bottleneck"]}

    return {"hardware": hw.name, "kernel": kernel, "dispatch_ns": d["time_s"] * 1e9, "combine_ns": c["time_s"] * 1e9,
            "comm_band": band, "band_source": src, "band_measured": hw.name == MEASURED_ON,
            "terms": {"dispatch": ns(d), "combine": ns(c), "params": r["params"],
                      "rule": "latency + max(RDMA bytes / (eff_rdma x NIC), NVLink bytes / (eff_nvl x NVLink))"},
            "source": f"moetrace GPU cost model ({reg}, fit {fitted()['fit_date']}); peaks: {hw.source}"}


__all__ = ["GPUS", "preset", "expert_ns", "comm_ns", "fitted"]

"""Fit the GPU cost model's achieved efficiencies on the published rows and measure its
held-out error; write ``data/fitted.json``.

Run: ``python -m moetrace.costmodel.fit`` (numpy only, about a minute on a loaded 2-core host).

Regimes (one parameter set each): ``gemm_grouped`` (DeepGEMM's grouped MoE GEMMs: the
expert MLP), ``gemm_dense`` (DeepGEMM's dense GEMMs), ``a2a_normal`` (DeepEP normal
kernels, dispatch and combine together), ``a2a_low_latency`` (DeepEP low-latency kernels).

Split rule: leave-one-out. Each row's held-out error is the model's error on it with the
parameters fitted on every other row of its regime; the stated band of a regime is the
largest held-out absolute relative error, rounded up to the next 0.01. The stored
parameters are then fitted on all rows of the regime. Loss: sum of squared log ratios
(model time / published time), minimized by Nelder-Mead from a few fixed starts.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import math
from pathlib import Path

import numpy as np

from .a2a import A2AParams, low_latency_terms, normal_terms
from .gemm import GemmParams, gemm_terms
from .hardware import GPUS

DATA = Path(__file__).resolve().parent / "data"
PUBLISHED = DATA / "published.csv"
FITTED = DATA / "fitted.json"

INT_COLS = ("groups", "m_per_group", "n", "k", "ep", "ranks_per_node", "tokens_per_rank", "top_k", "topk_groups",
            "num_experts", "hidden")
FLOAT_COLS = ("published_value", "time_us", "bandwidth_gbps")

REGIMES = ("gemm_grouped", "gemm_dense", "a2a_normal", "a2a_low_latency")
PARAM_NAMES = {"gemm": ("eff_compute", "eff_hbm", "p", "tile_us", "launch_us"),
               "a2a": ("latency_us", "eff_rdma", "eff_nvl")}
STARTS = {"gemm": ([0.75, 0.9, 2.0, 1.0, 5.0], [0.8, 0.8, 4.0, 0.5, 2.0], [0.7, 1.0, 1.5, 1.5, 8.0]),
          "a2a": ([30.0, 0.9, 0.8], [60.0, 0.7, 0.9], [10.0, 1.0, 1.0])}
# physical limits: no efficiency above the datasheet peak (1.1 for links, whose published
# "logical" bandwidths already exceed the nominal peak slightly), p >= 1, times >= 0
UPPER = {"gemm": (1.0, 1.0, 30.0, 100.0, 100.0), "a2a": (1000.0, 1.1, 1.1)}
LOWER = {"gemm": (0.05, 0.05, 1.0, 0.0, 0.0), "a2a": (0.0, 0.05, 0.05)}


def load_rows(path: Path = PUBLISHED) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for c in INT_COLS:
            r[c] = int(r[c]) if r.get(c) not in (None, "") else None
        for c in FLOAT_COLS:
            r[c] = float(r[c]) if r.get(c) not in (None, "") else None
    return rows


def family(regime: str) -> str:
    return "gemm" if regime.startswith("gemm") else "a2a"


def make_params(regime: str, x):
    """Parameters of ``regime`` from a vector (fit order, :data:`PARAM_NAMES`) or a mapping by name."""
    if isinstance(x, dict):
        x = [x[n] for n in PARAM_NAMES[family(regime)]]
    return GemmParams(*map(float, x)) if family(regime) == "gemm" else A2AParams(*map(float, x))


def predict_s(row: dict, params) -> float:
    """The model's time (seconds) of one published row's configuration."""
    hw = GPUS[row["gpu"]]
    reg = row["regime"]
    if reg.startswith("gemm"):
        ms = [row["m_per_group"]] * row["groups"]
        return gemm_terms(hw, params, ms, row["n"], row["k"], row["dtype"],
                          contiguous=row["layout"] == "contiguous")["time_s"]
    common = dict(ep=row["ep"], ranks_per_node=row["ranks_per_node"], tokens=row["tokens_per_rank"],
                  top_k=row["top_k"], hidden=row["hidden"], dtype=row["dtype"])
    if reg == "a2a_normal":
        return normal_terms(hw, params, num_experts=row["num_experts"], topk_groups=row["topk_groups"],
                            **common)["time_s"]
    return low_latency_terms(hw, params, direction=row["direction"], intranode_path=row["intranode_path"],
                             **common)["time_s"]


def measured_s(row: dict) -> float:
    return row["time_us"] * 1e-6


def nelder_mead(f, x0, iters: int = 1500, tol: float = 1e-12):
    x0 = np.asarray(x0, float)
    simplex = [x0] + [x0 + np.eye(len(x0))[i] * (0.2 * x0[i] if x0[i] else 0.1) for i in range(len(x0))]
    vals = [f(s) for s in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex = [simplex[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        c = np.mean(simplex[:-1], axis=0)
        xr = c + (c - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (simplex[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex]
                vals = [f(s) for s in simplex]
    i = int(np.argmin(vals))
    return simplex[i], vals[i]


def fit_regime(regime: str, rows: list[dict]) -> np.ndarray:
    fam = family(regime)
    lo, hi = np.array(LOWER[fam]), np.array(UPPER[fam])
    meas = [measured_s(r) for r in rows]

    def loss(x):
        if np.any(x < lo) or np.any(x > hi):
            return 1e9
        p = make_params(regime, x)
        return sum(math.log(predict_s(r, p) / m) ** 2 for r, m in zip(rows, meas))

    best = None
    for x0 in STARTS[fam]:
        x, v = nelder_mead(loss, x0)
        x, v = nelder_mead(loss, x)     # restart from the end point (Nelder-Mead stalls)
        if best is None or v < best[1]:
            best = (x, v)
    return best[0]


def rel_error(row: dict, params) -> float:
    return predict_s(row, params) / measured_s(row) - 1.0


def band_from(errors) -> float:
    """The stated band: the largest held-out |relative error|, rounded up to 0.01."""
    return math.ceil(max(abs(e) for e in errors) * 100 - 1e-9) / 100


def run(path: Path = PUBLISHED) -> dict:
    rows = load_rows(path)
    out = {"fit_date": _dt.date.today().isoformat(), "data": "moetrace/costmodel/data/published.csv",
           "split": "leave-one-out within each regime; band = max held-out |relative error| rounded up to 0.01",
           "regimes": {}}
    for reg in REGIMES:
        rr = [r for r in rows if r["regime"] == reg]
        x = fit_regime(reg, rr)
        p = make_params(reg, x)
        held = {}
        for i, r in enumerate(rr):
            xi = fit_regime(reg, rr[:i] + rr[i + 1:])
            held[r["row_id"]] = rel_error(r, make_params(reg, xi))
        fitted = {r["row_id"]: rel_error(r, p) for r in rr}
        out["regimes"][reg] = {
            "params": dict(zip(PARAM_NAMES[family(reg)], (round(float(v), 6) for v in x))),
            "rows": len(rr),
            "band": band_from(held.values()),
            "heldout_rel_error": {k: round(v, 4) for k, v in held.items()},
            "fitted_rel_error": {k: round(v, 4) for k, v in fitted.items()},
            "heldout_median_abs": round(float(np.median([abs(v) for v in held.values()])), 4),
            "heldout_max_abs": round(max(abs(v) for v in held.values()), 4),
            "fitted_max_abs": round(max(abs(v) for v in fitted.values()), 4),
        }
    return out


def main() -> None:
    out = run()
    FITTED.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    for reg, d in out["regimes"].items():
        print(f"{reg:16s} rows {d['rows']:2d}  held-out median {d['heldout_median_abs']:.3f} max "
              f"{d['heldout_max_abs']:.3f}  fitted max {d['fitted_max_abs']:.3f}  band {d['band']:.2f}  {d['params']}")


if __name__ == "__main__":
    main()

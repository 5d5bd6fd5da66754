"""Fit the GPU cost model's achieved efficiencies on the published rows, measure its error on
rows held out in whole groups, and write ``data/fitted.json``.

Run: ``python -m moetrace.costmodel.fit`` (numpy only, well under a minute).

Regimes (one parameter set each, every GPU shares it as fractions of its own peaks):
``gemm_grouped`` (DeepGEMM's grouped MoE GEMMs: the expert MLP), ``gemm_dense``
(DeepGEMM's dense GEMMs), ``a2a_normal`` (DeepEP V1 normal kernels), ``a2a_low_latency``
(DeepEP V1 low-latency), ``a2a_deepep_v2`` (DeepEP V2), ``a2a_hybrid_ep`` (the hybrid-ep
branch's HybridEP).

Split rule: **leave one group out**, for each way the rows group: whole source commit,
whole hardware, whole kernel version, whole layout (GEMM layout; all-to-all: NVLink- or
RDMA-bound rows). Each group is held out in turn, the regime refitted on the rest, and
the held-out rows predicted. A group is predicted only where the rest still holds a row
that exercises each term it needs (its link, its SM limit): otherwise the parameter
is not determined by the rest, and the group is listed as untestable. A row's held-out
error is the largest over the groupings.

Bands (``bands`` in ``fitted.json``), for every GPU × kernel of :data:`.a2a.FAMILIES` and the
two GEMM regimes:

* **validated** (the regime has rows on this GPU): the largest |error| on this GPU's rows,
  held out by group or fitted, rounded up to 0.01 (where none of them can be held out, no
  smaller than the regime's cross-hardware error);
* **not validated on this GPU**: the regime's cross-hardware error (its rows predicted with
  their whole GPU held out; a regime with rows on one GPU only takes the largest
  cross-hardware error of any regime), and never less than the regime's widest validated
  band;
* **a kernel with no published row** (pplx, NCCL, ...): the cross-family error (every
  fitted all-to-all family's rows predicted with another family's parameters), or the
  cross-hardware error of the family it borrows from when that is larger.

Loss: sum of squared log ratios (model time / published time), minimized by Nelder-Mead
from a few fixed starts; bounds keep efficiencies at or below the datasheet peak (1.1 for
links, whose published logical bandwidths exceed the nominal peak slightly).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path

import numpy as np

from .a2a import FAMILIES, SM_NORM, A2AParams, link_bytes, time_terms
from .gemm import GemmParams, gemm_terms, tile_config
from .hardware import DTYPE_BYTES, GPUS
from .published import PUBLISHED, load_rows

DATA = Path(__file__).resolve().parent / "data"
FITTED = DATA / "fitted.json"

REGIMES = ("gemm_grouped", "gemm_dense", "a2a_normal", "a2a_low_latency", "a2a_deepep_v2", "a2a_hybrid_ep")
PARAM_NAMES = {"gemm": ("eff_compute", "eff_hbm", "p", "tile_us", "launch_us"),
               "a2a": ("latency_us", "eff_rdma", "eff_nvl", "sm_gbps")}
STARTS = {"gemm": ([0.75, 0.9, 2.0, 1.0, 5.0], [0.8, 0.8, 4.0, 0.5, 2.0], [0.7, 1.0, 1.5, 1.5, 8.0]),
          "a2a": ([30.0, 0.9, 0.8, 15.0], [60.0, 0.7, 0.9, 30.0], [10.0, 1.0, 1.0, 8.0])}
UPPER = {"gemm": (1.0, 1.0, 30.0, 100.0, 100.0), "a2a": (1000.0, 1.1, 1.1, 200.0)}
LOWER = {"gemm": (0.05, 0.05, 1.0, 0.0, 0.0), "a2a": (0.0, 0.05, 0.05, 1.0)}
GROUPINGS = ("source_commit", "gpu", "kernel_version", "layout")


def family(regime: str) -> str:
    return "gemm" if regime.startswith("gemm") else "a2a"


def kernel_of(row: dict) -> str:
    return row["kernel"] or ""


def uses_sm(regime: str) -> bool:
    return regime != "a2a_low_latency"


def make_params(regime: str, x):
    """Parameters of ``regime`` from a vector (fit order, :data:`PARAM_NAMES`) or a mapping by name."""
    if isinstance(x, dict):
        x = [x.get(n, 0.0) for n in PARAM_NAMES[family(regime)]]
    x = [float(v) for v in x]
    if family(regime) == "gemm":
        return GemmParams(*x)
    if not uses_sm(regime):
        x[3] = 0.0
    return A2AParams(*x)


def row_layout(row: dict) -> str:
    if row["regime"].startswith("gemm"):
        return row["layout"]
    return "nvlink-bound" if row["ep"] <= row["ranks_per_node"] else "rdma-bound"


def _a2a_bytes(row: dict) -> dict:
    style = FAMILIES[row["kernel"]]["style"]
    return link_bytes(style, ep=row["ep"], ranks_per_node=row["ranks_per_node"], tokens=row["tokens_per_rank"],
                      top_k=row["top_k"], hidden=row["hidden"], dtype=row["dtype"], num_experts=row["num_experts"],
                      max_nodes=row["topk_groups"], direction=row["direction"] or "dispatch",
                      intranode_path=row["intranode_path"] or "nvlink")


def predict_s(row: dict, params) -> float:
    """The model's time (seconds) of one published row's configuration."""
    hw = GPUS[row["gpu"]]
    if row["regime"].startswith("gemm"):
        ms = [row["m_per_group"]] * row["groups"]
        return gemm_terms(hw, params, ms, row["n"], row["k"], row["dtype"],
                          contiguous=row["layout"] == "contiguous")["time_s"]
    sms = row["sms"] if params.sm_gbps > 0 else None
    return time_terms(hw, params, _a2a_bytes(row), sms)["time_s"]


class Prepared:
    """The parameter-free part of each row's time, as arrays (one model evaluation over all
    rows is then a few numpy operations: the fit calls it tens of thousands of times)."""

    def __init__(self, regime: str, rows: list[dict]):
        self.regime, self.rows = regime, rows
        self.meas = np.array([r["time_us"] * 1e-6 for r in rows])
        if family(regime) == "gemm":
            waves, tile_flops, peak_per_sm, nbytes, hbm = [], [], [], [], []
            for r in rows:
                hw = GPUS[r["gpu"]]
                ms = [r["m_per_group"]] * r["groups"]
                bm, bn, _, w = tile_config(ms, r["n"], hw.sms, r["layout"] == "contiguous")
                waves.append(w)
                tile_flops.append(2.0 * bm * bn * r["k"])
                peak_per_sm.append(hw.tensor_flops[r["dtype"]] / hw.sms)
                rows_ = sum(ms)
                nbytes.append(rows_ * r["k"] * DTYPE_BYTES[r["dtype"]] + r["groups"] * r["n"] * r["k"]
                              * DTYPE_BYTES[r["dtype"]] + rows_ * r["n"] * 2.0)
                hbm.append(hw.hbm_Bps)
            self.g = tuple(np.array(v, float) for v in (waves, tile_flops, peak_per_sm, nbytes, hbm))
        else:
            b = [_a2a_bytes(r) for r in rows]
            self.rb = np.array([x["rdma_bytes"] for x in b])
            self.nb = np.array([x["nvlink_bytes"] for x in b])
            self.R = np.array([GPUS[r["gpu"]].rdma_Bps for r in rows])
            self.N = np.array([GPUS[r["gpu"]].nvlink_Bps for r in rows])
            self.sms = np.array([r["sms"] or 0 for r in rows], float)

    def predict(self, params) -> np.ndarray:
        if family(self.regime) == "gemm":
            waves, tile_flops, pps, nbytes, hbm = self.g
            tc = waves * (tile_flops / (params.eff_compute * pps) + params.tile_us * 1e-6)
            tm = nbytes / (params.eff_hbm * hbm)
            return (tc ** params.p + tm ** params.p) ** (1.0 / params.p) + params.launch_us * 1e-6
        tl = np.maximum(self.rb / (params.eff_rdma * self.R), self.nb / (params.eff_nvl * self.N))
        if params.sm_gbps > 0:
            ts = np.where(self.sms > 0, (self.rb + self.nb) / (np.maximum(self.sms, 1) * params.sm_gbps * 1e9), 0.0)
            tl = np.where(ts > 0, (tl ** SM_NORM + ts ** SM_NORM) ** (1.0 / SM_NORM), tl)
        return params.latency_us * 1e-6 + tl

    def needs(self, i: int) -> set:
        """The terms row ``i`` exercises (a held-out row is predicted only where the rest covers them)."""
        if family(self.regime) == "gemm":
            return {"gemm"}
        out = {"rdma" if self.rb[i] > 0 else "nvlink"}
        if self.sms[i] > 0 and uses_sm(self.regime):
            out.add("sm")
        return out


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


def fit_regime(regime: str, rows: list[dict], prep: Prepared | None = None) -> np.ndarray:
    fam = family(regime)
    lo, hi = np.array(LOWER[fam]), np.array(UPPER[fam])
    prep = prep or Prepared(regime, rows)

    def loss(x):
        if np.any(x < lo) or np.any(x > hi):
            return 1e9
        return float(np.sum(np.log(prep.predict(make_params(regime, x)) / prep.meas) ** 2))

    best = None
    for x0 in STARTS[fam]:
        x, v = nelder_mead(loss, x0)
        x, v = nelder_mead(loss, x)     # restart from the end point (Nelder-Mead stalls)
        if best is None or v < best[1]:
            best = (x, v)
    assert best is not None
    x = best[0]
    if fam == "a2a" and not uses_sm(regime):
        x = x.copy()
        x[3] = 0.0
    return x


def rel_error(row: dict, params) -> float:
    return predict_s(row, params) / (row["time_us"] * 1e-6) - 1.0


def band_from(errors) -> float:
    """A stated band: the largest |relative error|, rounded up to 0.01."""
    return math.ceil(max(abs(e) for e in errors) * 100 - 1e-9) / 100


def _group_key(row: dict, how: str) -> str:
    return row_layout(row) if how == "layout" else str(row[how])


def held_out(regime: str, rows: list[dict]) -> tuple[dict, dict]:
    """Per row, its held-out error under each grouping; per grouping, each group's summary."""
    prep = Prepared(regime, rows)
    npar = len(PARAM_NAMES[family(regime)]) - (0 if uses_sm(regime) or family(regime) == "gemm" else 1)
    per_row: dict[str, dict[str, float]] = {r["row_id"]: {} for r in rows}
    groups: dict[str, dict] = {}
    for how in GROUPINGS:
        keys = sorted({_group_key(r, how) for r in rows})
        if len(keys) < 2:
            continue
        groups[how] = {}
        for key in keys:
            out = [i for i, r in enumerate(rows) if _group_key(r, how) == key]
            rest = [i for i in range(len(rows)) if i not in set(out)]
            covered = set().union(*(prep.needs(i) for i in rest)) if rest else set()
            testable = [i for i in out if prep.needs(i) <= covered]
            if len(rest) <= npar or not testable:
                groups[how][key] = {"rows": len(out), "fit_rows": len(rest), "testable": 0,
                                    "why": "the rest of the rows do not determine the terms these rows need"}
                continue
            rr = [rows[i] for i in rest]
            p = make_params(regime, fit_regime(regime, rr, Prepared(regime, rr)))
            errs = prep.predict(p)[testable] / prep.meas[testable] - 1.0
            for i, e in zip(testable, errs):
                per_row[rows[i]["row_id"]][how] = float(e)
            groups[how][key] = {"rows": len(out), "fit_rows": len(rest), "testable": len(testable),
                                "max_abs": round(float(np.max(np.abs(errs))), 4)}
    return per_row, groups


def _worst(d: dict) -> float | None:
    return max(d.values(), key=abs) if d else None


def run(path: Path = PUBLISHED) -> dict:
    rows = load_rows(path)
    out: dict = {"fit_date": _dt.date.today().isoformat(), "data": "moetrace/costmodel/data/published.csv",
                 "split": "leave one group out (whole source commit, GPU, kernel version, layout); band = largest "
                          "|error| on the GPU's rows, held out or fitted, rounded up to 0.01",
                 "regimes": {}}
    params = {}
    for reg in REGIMES:
        rr = [r for r in rows if r["regime"] == reg]
        x = fit_regime(reg, rr)
        p = make_params(reg, x)
        params[reg] = p
        fitted = {r["row_id"]: rel_error(r, p) for r in rr}
        per_row, groups = held_out(reg, rr)
        worst = {k: _worst(v) for k, v in per_row.items()}
        cross_hw = [v["gpu"] for v in per_row.values() if "gpu" in v]
        by_hw: dict[str, dict] = {}
        for r in rr:
            h = by_hw.setdefault(r["gpu"], {"rows": 0, "fitted": [], "held": []})
            h["rows"] += 1
            h["fitted"].append(fitted[r["row_id"]])
            if worst[r["row_id"]] is not None:
                h["held"].append(worst[r["row_id"]])
        hw_out = {g: {"rows": h["rows"], "fitted_max_abs": round(max(abs(e) for e in h["fitted"]), 4),
                      "logo_max_abs": round(max(abs(e) for e in h["held"]), 4) if h["held"] else None,
                      "logo_rows": len(h["held"]), "band": band_from(h["fitted"] + h["held"])}
                  for g, h in by_hw.items()}
        out["regimes"][reg] = {
            "params": dict(zip(PARAM_NAMES[family(reg)], (round(float(v), 6) for v in x))),
            "rows": len(rr), "hardware": hw_out,
            "versions": sorted({r["kernel_version"] for r in rr}),
            "band": max(h["band"] for h in hw_out.values()),
            "fitted_rel_error": {k: round(v, 4) for k, v in fitted.items()},
            "heldout_rel_error": {k: round(v, 4) for k, v in worst.items() if v is not None},
            "heldout_by": {k: {h: round(e, 4) for h, e in v.items()} for k, v in per_row.items() if v},
            "groups": groups,
            "fitted_max_abs": round(max(abs(v) for v in fitted.values()), 4),
            "logo_max_abs": round(max(abs(v) for v in worst.values() if v is not None), 4),
            "cross_hardware": round(max(abs(e) for e in cross_hw), 4) if cross_hw else None,
        }
    a2a = [r for r in REGIMES if r.startswith("a2a")]
    cross_fam = 0.0
    for a in a2a:
        for b in a2a:
            if a != b:
                rb = [r for r in rows if r["regime"] == b]
                e = Prepared(b, rb).predict(make_params(b, out["regimes"][a]["params"])) / Prepared(b, rb).meas - 1
                cross_fam = max(cross_fam, float(np.max(np.abs(e))))
    out["cross_family"] = round(cross_fam, 4)
    known = [v["cross_hardware"] for v in out["regimes"].values() if v["cross_hardware"] is not None]
    out["cross_hardware_any"] = round(max(known), 4)
    out["bands"] = bands(out)
    return out


def _ceil(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def bands(out: dict) -> dict:
    """The band of every GPU × kernel (see the module docstring), with how it was measured."""
    res = {}
    kernels = {k: v["params_from"] for k, v in FAMILIES.items()}
    kernels.update({"gemm_grouped": "gemm_grouped", "gemm_dense": "gemm_dense"})
    for hw in GPUS:
        for kern, base in kernels.items():
            reg = out["regimes"][base]
            fitted_here = FAMILIES.get(kern, {}).get("regime", base) is not None
            h = reg["hardware"].get(hw)
            xhw = reg["cross_hardware"] if reg["cross_hardware"] is not None else out["cross_hardware_any"]
            xhw = max(xhw, reg["band"])     # never narrower than where the regime was measured
            if fitted_here and h and h["logo_rows"]:
                res[f"{hw}/{kern}"] = {"band": h["band"], "validated": True, "rows": h["rows"],
                                       "how": f"largest |error| on {h['rows']} published {hw} rows of {base}, "
                                              f"{h['logo_rows']} of them held out by whole source/GPU/version/layout"}
            elif fitted_here and h:     # rows here, but none could be held out: no smaller than cross-hardware
                res[f"{hw}/{kern}"] = {"band": max(h["band"], _ceil(xhw)), "validated": True, "rows": h["rows"],
                                       "how": f"{h['rows']} published {hw} rows of {base}, none testable held out "
                                              f"(the other rows do not determine their terms): the larger of their "
                                              f"fitted error and {base}'s cross-hardware error"}
            elif fitted_here:
                res[f"{hw}/{kern}"] = {"band": _ceil(xhw), "validated": False, "rows": 0,
                                       "how": f"not validated on {hw}/{kern}: no published {hw} row; the band is "
                                              f"{base}'s error on rows of a whole GPU held out (cross-hardware) or "
                                              f"its widest validated band, the larger"}
            else:
                b = out["cross_family"] if h else max(out["cross_family"], xhw)
                res[f"{hw}/{kern}"] = {"band": _ceil(b), "validated": False, "rows": 0,
                                       "how": f"not validated on {hw}/{kern}: no published row of this kernel; "
                                              f"{base}'s parameters; the band is the cross-family error (each fitted "
                                              f"all-to-all family's rows predicted with another's parameters)"
                                              + ("" if h else " or the cross-hardware error, the larger")}
    return res


def main() -> None:
    out = run()
    FITTED.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    for reg, d in out["regimes"].items():
        print(f"{reg:16s} rows {d['rows']:3d}  fitted max {d['fitted_max_abs']:.3f}  LOGO max {d['logo_max_abs']:.3f}"
              f"  cross-hw {d['cross_hardware']}  {d['params']}")
        for g, h in d["hardware"].items():
            print(f"    {g:6s} rows {h['rows']:3d}  fitted {h['fitted_max_abs']:.3f}  LOGO {h['logo_max_abs']}  "
                  f"band {h['band']:.2f}")
    print(f"cross-family {out['cross_family']:.3f}  cross-hardware (any) {out['cross_hardware_any']:.3f}")


if __name__ == "__main__":
    main()

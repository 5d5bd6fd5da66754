"""The GPU cost model (moetrace/costmodel) against every published row it was fitted on,
side by side with the H800 preset replay used before it (its numbers kept below).

For each row of ``moetrace/costmodel/data/published.csv``: the published time, the model's
time with the stored parameters (fitted on all rows), the leave-one-out held-out error
(from ``data/fitted.json``), and the old preset's time with its error; then the median and
max absolute error per regime. Pure CPU arithmetic, under a second.

    python benchmarks/bench_costmodel.py                      # print the table
    python benchmarks/bench_costmodel.py --out benchmarks/results/costmodel_DATE.md

The old preset, scaled to a row's shape by its own rule: per group, 2*n*k FLOPs per row at
60% of the FP8 peak plus n*k weight bytes at 80% of HBM (``preset('H800')`` a_ns/b_ns split
by the row's share of the three expert matrices); all-to-all: NVLink bytes at 80% of
200 GB/s plus RDMA bytes at 80% of 50 GB/s, the model's byte counts, no latency.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetrace import costmodel  # noqa: E402
from moetrace.costmodel import fit as F  # noqa: E402
from moetrace.costmodel.a2a import A2AParams, low_latency_terms, normal_terms  # noqa: E402
from moetrace.costmodel.hardware import GPUS  # noqa: E402

HIDDEN, INTER = 7168, 2048


# The preset replay used before the GPU model (moetrace.replay.cost until 2026-12-02, kept
# here as numbers so the comparison stays the old one): H800 FP8 1979 TFLOP/s at 60%, HBM
# 3.35 TB/s at 80%, NVLink 200 GB/s and the NIC 50 GB/s at 80%.
_OLD_A_NS = 2.0 * 3 * HIDDEN * INTER / (1979e12 * 0.6) * 1e9          # per token, the 3 matrices
_OLD_B_NS = 3 * HIDDEN * INTER / (3.35e12 * 0.8) * 1e9                  # per expert touched (weights)
_OLD_NVLINK_BPS, _OLD_NIC_BPS = 200e9 * 0.8, 50e9 * 0.8


def old_preset_s(row: dict) -> float:
    if row["regime"].startswith("gemm"):
        share = row["n"] * row["k"] / (3 * HIDDEN * INTER)
        g, m = row["groups"], row["m_per_group"]
        return share * (_OLD_A_NS * g * m + _OLD_B_NS * g) * 1e-9
    kw = dict(ep=row["ep"], ranks_per_node=row["ranks_per_node"], tokens=row["tokens_per_rank"], top_k=row["top_k"],
              hidden=row["hidden"], dtype=row["dtype"])
    unit = A2AParams(0.0, 1.0, 1.0)
    if row["regime"] == "a2a_normal":
        t = normal_terms(GPUS["H800"], unit, num_experts=row["num_experts"], topk_groups=row["topk_groups"], **kw)
    else:
        t = low_latency_terms(GPUS["H800"], unit, direction=row["direction"], intranode_path=row["intranode_path"], **kw)
    return float(t["nvlink_bytes"] / _OLD_NVLINK_BPS + t["rdma_bytes"] / _OLD_NIC_BPS)


def describe(r: dict) -> str:
    if r["regime"].startswith("gemm"):
        return f"{r['layout']} {r['groups']}x{r['m_per_group']} n{r['n']} k{r['k']}"
    return f"{r['kernel']} {r['direction']} EP{r['ep']} {r['tokens_per_rank']} tok {r['dtype']}"


def _compare() -> tuple[list[str], dict[str, dict[str, list]]]:
    """Each published row's table line, and per regime the absolute relative errors of the
    model, of its held-out fit and of the old preset."""
    fitted = costmodel.fitted()
    lines: list[str] = []
    per: dict[str, dict[str, list]] = {}
    for r in F.load_rows():
        reg = r["regime"]
        d = fitted["regimes"][reg]
        p = F.make_params(reg, d["params"])
        pub = r["time_us"]
        mod = F.predict_s(r, p) * 1e6
        old = old_preset_s(r) * 1e6
        e, h, o = mod / pub - 1, d["heldout_rel_error"][str(r["row_id"])], old / pub - 1
        s = per.setdefault(reg, {"model": [], "held": [], "old": []})
        s["model"].append(abs(e)), s["held"].append(abs(h)), s["old"].append(abs(o))
        lines.append(f"| {r['row_id']} | {reg} | {describe(r)} | {pub:,.1f} | {mod:,.1f} | {e:+.1%} | {h:+.1%} | "
                     f"{old:,.1f} | {o:+.1%} |")
    return lines, per


def table() -> str:
    fitted = costmodel.fitted()
    load = os.getloadavg()
    lines = [f"# GPU cost model vs published H800 rows ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Fit date {fitted['fit_date']}; split: {fitted['split']}. Host load average "
             f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (pure arithmetic: load does not change the figures).", "",
             "| row | regime | configuration | published us | model us | err | held-out err | old preset us | old err |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    rows, per = _compare()
    lines += rows
    lines += ["", "| regime | rows | model median / max abs err | held-out median / max | stated band | "
              "old preset median / max |", "|---|---:|---:|---:|---:|---:|"]
    for reg, s in per.items():
        d = fitted["regimes"][reg]
        lines.append(f"| {reg} | {len(s['model'])} | {np.median(s['model']):.1%} / {max(s['model']):.1%} | "
                     f"{np.median(s['held']):.1%} / {max(s['held']):.1%} | ±{d['band']:.0%} | "
                     f"{np.median(s['old']):.1%} / {max(s['old']):.1%} |")
    return "\n".join(lines) + "\n"


def run(size: str) -> list[dict]:
    """Per regime, the model's largest error on the published rows beside the old preset's
    (the same at every size: the data file is the input)."""
    from benchmarks.common import result

    fitted = costmodel.fitted()
    out = []
    for reg, s in _compare()[1].items():
        model, old = 100 * max(s["model"]), 100 * max(s["old"])
        out.append(result("costmodel", f"{reg}: max |error| on {len(s['model'])} published H800 rows", model, "%",
                          "old H800 preset", old, old / model if model > 0 else None,
                          f"held-out max {100 * max(s['held']):.1f}%, stated band ±{fitted['regimes'][reg]['band']:.0%}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    a = ap.parse_args()
    text = table()
    print(text, end="")
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()

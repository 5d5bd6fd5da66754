"""The GPU cost model (moetrace/costmodel) against every published row, per GPU and kernel
family: the fitted error, the error on rows held out in whole groups, and the stated band.

For each (hardware, kernel family) with published rows (``moetrace/costmodel/data/published.csv``):
the rows, the largest |error| with the stored parameters (fitted on all rows), the largest
|error| on those rows when their whole group was held out (leave one group out: whole
source commit, whole GPU, whole kernel version, whole layout; from ``data/fitted.json``,
which ``python -m moetrace.costmodel.fit`` regenerates), and the stated band. Asserts every
stated band is at least its leave-one-group-out error and its fitted error. Then the bands
of GPUs and kernels with no published row (not validated: cross-hardware / cross-family
error), and each held-out group. Pure CPU arithmetic, a second or two.

    python benchmarks/bench_costmodel.py                      # print the tables
    python benchmarks/bench_costmodel.py --out benchmarks/results/costmodel_DATE.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetrace import costmodel  # noqa: E402
from moetrace.costmodel import fit as F  # noqa: E402

KERNEL_OF = {"a2a_normal": "normal", "a2a_low_latency": "low-latency", "a2a_deepep_v2": "deepep-v2",
             "a2a_hybrid_ep": "hybrid-ep", "gemm_grouped": "gemm_grouped", "gemm_dense": "gemm_dense"}


def per_hardware() -> list[dict]:
    """One entry per (hardware, regime) with published rows, recomputing the fitted error."""
    fitted = costmodel.fitted()
    rows = F.load_rows()
    out = []
    for reg, d in fitted["regimes"].items():
        p = F.make_params(reg, d["params"])
        for hw in d["hardware"]:
            rr = [r for r in rows if r["regime"] == reg and r["gpu"] == hw]
            fit_err = max(abs(F.rel_error(r, p)) for r in rr)
            held = [abs(d["heldout_rel_error"][r["row_id"]]) for r in rr if r["row_id"] in d["heldout_rel_error"]]
            band = fitted["bands"][f"{hw}/{KERNEL_OF[reg]}"]["band"]
            out.append({"hardware": hw, "regime": reg, "kernel": KERNEL_OF[reg], "rows": len(rr),
                        "versions": sorted({r["kernel_version"] for r in rr}), "fitted": fit_err,
                        "logo": max(held) if held else None, "logo_rows": len(held), "band": band})
    return out


def check(entries: list[dict]) -> None:
    for e in entries:
        assert e["band"] + 1e-9 >= e["fitted"], e
        assert e["logo"] is None or e["band"] + 1e-9 >= e["logo"], e


def table() -> str:
    fitted = costmodel.fitted()
    entries = per_hardware()
    check(entries)
    load = os.getloadavg()
    lines = [f"# GPU cost model vs every published kernel row ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)",
             "", f"Fit date {fitted['fit_date']}; split: {fitted['split']}. Host load average {load[0]:.2f} / "
             f"{load[1]:.2f} / {load[2]:.2f} (pure arithmetic: load does not change the figures).", "",
             "## Validated: GPU x kernel family with published rows", "",
             "| hardware | kernel family | rows | kernel versions | fitted max err | leave-one-group-out max err "
             "(rows testable) | stated band |", "|---|---|---:|---|---:|---:|---:|"]
    for e in entries:
        logo = f"{e['logo']:.1%} ({e['logo_rows']})" if e["logo"] is not None else f"untestable (0 of {e['rows']})"
        lines.append(f"| {e['hardware']} | {e['kernel']} | {e['rows']} | {', '.join(e['versions'])} | "
                     f"{e['fitted']:.1%} | {logo} | ±{e['band']:.0%} |")
    lines += ["", "Every stated band >= its leave-one-group-out error and its fitted error: checked.", "",
              f"Cross-family error (each fitted all-to-all family's rows predicted with another family's "
              f"parameters): {fitted['cross_family']:.1%}. Largest cross-hardware error (rows of a whole GPU held "
              f"out): {fitted['cross_hardware_any']:.1%}.", "",
              "## Not validated: bands where no published row exists", "",
              "| hardware | kernel | band | how |", "|---|---|---:|---|"]
    for key, b in sorted(fitted["bands"].items()):
        if not b["validated"]:
            hw, kern = key.split("/")
            lines.append(f"| {hw} | {kern} | ±{b['band']:.0%} | {b['how']} |")
    lines += ["", "## Held-out groups", "", "| regime | grouping | group | rows | fit rows | max abs err |",
              "|---|---|---|---:|---:|---:|"]
    for reg, d in fitted["regimes"].items():
        for how, groups in d["groups"].items():
            for key, g in groups.items():
                err = f"{g['max_abs']:.1%}" if g.get("testable") else "untestable: " + g.get("why", "")
                lines.append(f"| {reg} | {how} | {key} | {g['rows']} | {g['fit_rows']} | {err} |")
    return "\n".join(lines) + "\n"


def run(size: str) -> list[dict]:
    """Per (hardware, kernel family), the held-out error beside the stated band (the same at
    every size: the data file is the input)."""
    from benchmarks.common import result

    out = []
    for e in per_hardware():
        logo = 100 * (e["logo"] if e["logo"] is not None else e["fitted"])
        out.append(result("costmodel", f"{e['hardware']}/{e['kernel']}: leave-one-group-out max |error| on "
                                       f"{e['rows']} published rows", logo, "%", "stated band", 100 * e["band"],
                          None, f"fitted max {100 * e['fitted']:.1f}%"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    a = ap.parse_args()
    text = table()
    print(text, end="")
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()

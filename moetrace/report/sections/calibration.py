"""Cost-model calibration: how well the replay's predicted expert and straggler times
matched what the profiler measured (``moetrace calibrate``; table ``calibration``).

Shown when the run holds calibration cells, as the fit run (in-sample residuals) or as a
judged run (out-of-sample errors). The metrics are recomputed in SQL from the stored cells
(:data:`moetrace.replay.calibrate.SUMMARY_SQL`); the figure plots predicted against
measured expert time per (step, layer, rank) for the newest calibration.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl

from ...units import percent, time_text
from ..base import Figure, ReportContext, Section, md_table

ORDER = 65


def build(ctx: ReportContext) -> Section | None:
    df = ctx.facade.calibrations()
    if df is None or df.height == 0:
        return None
    rows = []
    for r in df.iter_rows(named=True):
        rows.append({
            "calibration_id": r["calibration_id"], "role": r["role"], "fit_run": r["fit_run_id"],
            "steps": f"{r['first_step']}..{r['last_step']}", "a_ns": r["a_ns"], "b_ns": r["b_ns"],
            "fit_r2": r["expert_r2"], "cells": r["cells"],
            "expert_mape_%": percent(r["expert_mape"]), "expert_bias_%": percent(r["expert_bias"]),
            "straggler_mape_%": percent(r["straggler_mape"]), "straggler_hit_%": percent(r["straggler_hit_rate"]),
            "chance_%": percent(r["straggler_chance"]), "comm_mape_%": percent(r["comm_mape"]),
            "layer_mape_%": percent(r["layer_mape"])})
    tbl = pl.DataFrame(rows)
    # the newest calibration's out-of-sample rows where it has them (a run judged on its own
    # held-out steps holds both roles)
    newest = df.filter(pl.col("calibration_id") == df["calibration_id"][0])
    judged = newest.filter(pl.col("role") == "judge")
    top = (judged if judged.height else newest).row(0, named=True)
    if top["role"] != "judge":
        what = "fitted on this run (in-sample)"
    elif top["fit_run_id"] == ctx.run_id:
        what = (f"judged on held-out steps {_held_steps(ctx, top)} of this run, fitted on its other steps")
    else:
        what = "judged with parameters fitted on run " + str(top["fit_run_id"])
    head = (f"Newest calibration {top['calibration_id']} ({what}): expert time = {time_text(top['a_ns'])} × tokens + "
            f"{time_text(top['b_ns'])} × slots touched. Per (step, layer, rank) the predicted expert time is off by "
            f"{percent(top['expert_mape'])}% on average (bias {percent(top['expert_bias']):+}%); the straggler's time per "
            f"(step, layer) by {percent(top['straggler_mape'])}%, and the predicted straggler rank is the measured one in "
            f"{percent(top['straggler_hit_rate'])}% of {top['pairs']} (step, layer) (a random guess: "
            f"{percent(top['straggler_chance'])}%).")
    if top["layer_mape"] is not None:
        head += (f" The layer time (slowest rank's expert + all-to-all time) is off by {percent(top['layer_mape'])}% "
                 f"(bias {percent(top['layer_bias']):+}%).")
    fit = ctx.store.run(str(top["fit_run_id"]))
    hw, band = fit.hardware, fit.error_band()
    head += (f" Error band of time predictions on this hardware ({hw or 'unknown'}): {band.text()}; a predicted "
             "difference smaller than it is within model error, not a win.")
    md = [head, "", md_table(tbl, float_fmt="{:.2f}")]
    from ...output import render_table
    term = [head, "", render_table(tbl, max_rows=20)]
    notes = ["Errors are (predicted − measured) / measured over cells with a measured expert time > 0; "
             "measured time is the sum of the rank's expert_gemm spans in the (step, layer). A straggler hit counts "
             "when the measured slowest rank is among the predicted slowest (ties included)."]
    figs = []
    p = _scatter(ctx, top["calibration_id"], top["role"])
    if p is not None:
        figs.append(p)
    return Section("calibration", "Cost-model calibration", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _held_steps(ctx: ReportContext, top: dict) -> str:
    """The held-out steps as calibrate wrote them on the fit rows ('2–3, 6–7'); the first
    and last step for calibrations stored before they carried the model."""
    d = ctx.sql("SELECT any_value(model_json) AS m FROM calibration WHERE run_id = ? AND calibration_id = ? "
                "AND role = 'fit'", [ctx.run_id, top["calibration_id"]]) if "model_json" in ctx.sql(
                    "SELECT * FROM calibration LIMIT 0").columns else None
    if d is not None and d.height and d["m"][0]:
        judged = json.loads(d["m"][0]).get("calibration", {}).get("judged", [])
        mine = [j["steps"] for j in judged if j.get("held_out")]
        if mine:
            return mine[0]
    return f"{top['first_step']}..{top['last_step']}"


def _scatter(ctx: ReportContext, cid: str, role: str) -> Figure | None:
    d = ctx.sql("""SELECT measured_expert_ns, predicted_expert_ns, measured_straggler FROM calibration
                   WHERE run_id = ? AND calibration_id = ? AND role = ? AND measured_expert_ns > 0""",
                [ctx.run_id, cid, role])
    if d.height == 0:
        return None
    from .. import plots

    m = d["measured_expert_ns"].to_numpy() / 1e3
    p = d["predicted_expert_ns"].to_numpy() / 1e3
    s = d["measured_straggler"].to_numpy()
    err = np.abs(p - m) / m
    r2 = 1 - float(np.sum((p - m) ** 2)) / max(float(np.sum((m - m.mean()) ** 2)), 1e-300)
    path = plots.predicted_vs_measured(
        ctx.outdir / f"calibration_{ctx.run_id}.png", m, p, s,
        title=(f"Expert time, {'in-sample fit' if role == 'fit' else 'judged out of sample'} (run {ctx.run_id})\n"
               f"R² {r2:.2f} (predicted vs measured); |error| median {100 * np.median(err):.0f}%, "
               f"p90 {100 * np.percentile(err, 90):.0f}%"),
        xlabel="measured expert time (µs)", ylabel="predicted expert time (µs)", marked_label="measured straggler")
    return Figure(path, f"Predicted vs measured expert time per (step, layer, rank), {len(m)} cells "
                        f"({int(np.sum(s))} measured stragglers highlighted).")

"""Imbalance against batch size: sampling noise shrinks as batches grow, the structural
skew of the popularity under the placement stays."""
from __future__ import annotations

import polars as pl

from ..base import Figure, ReportContext, Section, md_table
from .. import plots

ORDER = 30
MAX_SERIES = 6


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    sb = ctx.sql("SELECT * FROM skew_by_batch WHERE run_id = ? AND imbalance IS NOT NULL "
                 "ORDER BY layer, steps_per_batch", [rid])
    dec = ctx.sql("SELECT * FROM skew_decomposition WHERE run_id = ? ORDER BY imbalance_mean DESC", [rid])
    if sb.height == 0 or dec.height == 0:
        return None
    if sb["steps_per_batch"].max() == 1 and dec["steps"].max() <= 1:
        text = ("The run has a single step (or one aggregate pseudo-step), so sampling noise and structural skew "
                "cannot be told apart: all of its imbalance shows as structural.")
        return Section(key="batch", title="Imbalance vs batch size", markdown=text, terminal=text)
    tot = dec.select(pl.col("imbalance_mean").mean(), pl.col("structural_imbalance").mean(),
                     pl.col("sampling_excess").mean()).row(0)
    text = (f"Averaged over layers, a step's imbalance of **{tot[0]:.2f}×** splits into a structural part of "
            f"**{tot[1]:.2f}×** (the rank loads summed over the whole run: the popularity under this placement, "
            f"which no batch size removes) and **{tot[2]:+.2f}** of sampling noise on top (shrinks as batches "
            "grow). Re-placing or replicating experts attacks the structural part; bigger batches only the "
            "sampling part.")
    md = [text, "", "Per layer, most skewed first:", "",
          md_table(dec.select("layer", "steps", "imbalance_mean", "structural_imbalance", "sampling_excess",
                              "structural_fraction"), max_rows=64)]
    term = [text.replace("**", ""), "",
            _render(dec.select("layer", "imbalance_mean", "structural_imbalance", "sampling_excess").head(8))]
    layers = dec["layer"].head(MAX_SERIES).to_list()
    series, hl = [], []
    for lyr in layers:
        d = sb.filter(pl.col("layer") == lyr)
        series.append((f"layer {lyr}", d["tokens_per_step"].to_numpy(), d["imbalance"].to_numpy()))
        st = dec.filter(pl.col("layer") == lyr)["structural_imbalance"][0]
        hl.append((float(st), f"layer {lyr} structural"))
    notes = ["Larger batches are emulated by summing the rank loads of consecutive steps (1, 2, 4, ... steps): "
             "what one step with that many tokens would see under the same routing. Only full windows count; "
             "the rightmost point is one window, so it is noisy."]
    figs = []
    if series:
        fig_path = plots.lines(ctx.outdir / "batch_plateau.png", series, logx=True, hlines=hl,
                               title="Imbalance vs tokens per batch (most skewed layers)",
                               xlabel="tokens per batch (log scale; consecutive steps merged)",
                               ylabel="max / mean rank tokens (×)")
        figs.append(Figure(fig_path, "Imbalance falls as batches grow (sampling noise averages out) and levels "
                                     "off at the structural skew (dashed, same colour): the part placement must "
                                     "fix."))
    return Section(key="batch", title="Imbalance vs batch size", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _render(df):
    from ...output import render_table

    return render_table(df, float_precision=3)

"""What-ifs on the recorded timeline: two-micro-batch overlap, attention/FFN
disaggregation, NVLink domain size (table ``replay_whatif``, written by ``moetrace
whatif``; :mod:`moetrace.replay.timeline_whatif`). When the store holds none for the run and the
run has profiler spans, the overlap and disaggregation what-ifs are computed here without
writing (the domain sweep reads all routing rows: run ``moetrace whatif`` for it)."""
from __future__ import annotations

import polars as pl

from ...units import time_text
from ..base import ReportContext, Section, md_table

ORDER = 62


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    df = ctx.facade.stored_whatifs()
    computed = False
    notes = []
    if df is None:
        if not ctx.sql("SELECT count(*) AS n FROM spans WHERE run_id = ?", [rid])["n"][0]:
            return None
        rep = ctx.facade.whatif(domains=(), write=False)
        df = rep.frame()
        notes.extend(rep.notes)
        computed = True
        if df.height == 0:
            return None
    whole = (df.filter(pl.col("step").is_null())
             .with_columns((pl.col("after") / pl.col("before")).round(3).alias("after/before"))
             .select("kind", "scenario", "metric", pl.col("before").round(1), pl.col("after").round(1),
                     "after/before", "unit"))
    band = df["rel_error"].drop_nulls()
    pm = f" ±{100 * float(band.max()):.0f}%" if band.len() else ""   # on every predicted time below
    lines = []
    ov = whole.filter((pl.col("kind") == "overlap") & (pl.col("metric") == "step_ns"))
    if ov.height:
        r = ov.row(0, named=True)
        lines.append(f"**Two micro-batches**: mean step {r['before'] / 1e6:.2f} ms recorded -> "
                     f"{r['after'] / 1e6:.2f} ms{pm} predicted ({r['after/before']:.2f}x)"
                     + (f", a change within the{pm} error band: not a predicted win."
                        if band.len() and abs(r["after/before"] - 1) <= float(band.max()) else "."))
    dg = df.filter((pl.col("kind") == "disaggregation") & (pl.col("metric") == "tokens_per_gpu_s"))
    if dg.height:
        best = dg.sort("after", descending=True).row(0, named=True)
        lines.append(f"**Attention/FFN disaggregation**: best {best['scenario']}, "
                     f"{best['after'] / max(best['before'], 1e-12):.2f}x the co-located per-GPU throughput.")
    dm = whole.filter((pl.col("kind") == "domain") & (pl.col("metric") == "a2a_ns_per_step"))
    if dm.height:
        lines.append("**NVLink domain size**: " + "; ".join(
            f"{d} ranks -> {a / 1e6:.3f} ms{pm} all-to-all per step" for d, a in
            sorted((int(s.split(' ')[0]), a) for s, a in zip(dm["scenario"].to_list(), dm["after"].to_list()))) + ".")
    if band.len():
        lines.append(f"Every predicted value carries an error band of ±{100 * float(band.max()):.0f}% "
                     "(source in replay_whatif.params_json).")
    if computed:
        lines.append("_Computed for this report (not stored): run `moetrace whatif` to store it and add the "
                     "domain-size sweep._")
    # times read in µs/ms with their unit in the cell (the raw ns with decimals read as noise)
    is_ns = pl.col("unit") == "ns"
    shown = whole.with_columns(
        [pl.when(is_ns).then(pl.col(c).map_elements(time_text, return_dtype=pl.Utf8))
         .otherwise(pl.col(c).round(1).cast(pl.Utf8)).alias(c) for c in ("before", "after")]
        + [pl.when(is_ns).then(pl.lit("time")).otherwise(pl.col("unit")).alias("unit")])
    md = "\n\n".join(lines) + "\n\n" + md_table(shown)
    from ...output import render_table
    term = "\n".join(x.replace("**", "") for x in lines) + "\n" + render_table(whole, max_rows=30)
    for kind, text in df.select("kind", "assumptions").unique(maintain_order=True).iter_rows():
        notes.append(f"{kind} what-if assumes: {text}")
    return Section("whatif", "What-ifs on the timeline", markdown=md, terminal=term, notes=notes)

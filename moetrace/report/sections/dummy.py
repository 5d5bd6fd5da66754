"""Dummy steps: ranks that ran a step with no tokens (to keep collectives aligned)."""
from __future__ import annotations

import polars as pl

from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 40


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    df = ctx.sql("SELECT * FROM dummy_steps WHERE run_id = ? ORDER BY rank", [rid])
    if df.height == 0:
        return None
    why = unknown_reason(ctx)
    if why:
        text = f"Dummy steps: unknown — {why}"
        return Section(key="dummy", title="Dummy steps", markdown=text, terminal=text)
    total_steps = int(df["steps"].sum())
    total_dummy = int(df["dummy_steps"].sum())
    notes = []
    if df["inferred"].any():
        notes.append("Some step boundaries were inferred rather than annotated (steps.inferred).")
    share = total_dummy / total_steps if total_steps else 0.0
    text = (f"{total_dummy} of {total_steps} (step, rank) pairs were dummy steps: **{100 * share:.1f}%** of rank "
            "time by step count went to ranks that had no tokens but still ran the forward pass so the "
            "all-to-alls stay aligned.")
    timed = df["timed_ns"].drop_nulls()
    if timed.len() and timed.sum() > 0:
        dt = int(df["dummy_time_ns"].fill_null(0).sum())
        text += f" By recorded step time: {dt / 1e6:.1f} ms of {timed.sum() / 1e6:.1f} ms ({100 * dt / timed.sum():.1f}%)."
    else:
        notes.append("No step times were recorded: dummy share is by step count, not by time.")
    md = [text]
    term = [text.replace("**", "")]
    figs = []
    if total_dummy:
        # a rank with no dummy step and a recorded time spent 0 ns on them (not unknown)
        none = (pl.col("dummy_steps") == 0) & pl.col("timed_ns").is_not_null()
        df = df.with_columns(pl.when(none).then(0).otherwise(pl.col(c)).alias(c)
                             for c in ("dummy_time_ns", "dummy_time_share"))
        worst = df.sort("dummy_share", descending=True).head(10)
        md += ["", "Ranks with the most dummy steps:", "",
               md_table(worst.select("rank", "steps", "dummy_steps", "dummy_share", "dummy_time_ns",
                                     "dummy_time_share"))]
        vals = 100 * df["dummy_share"].to_numpy()
        figs.append(Figure(plots.bars(
            ctx.outdir / "dummy_share_per_rank.png", df["rank"].to_list(), vals,
            title="Dummy steps per rank (ran the forward with no tokens)", xlabel="rank",
            ylabel="dummy steps (% of the rank's steps)", ref_line=100 * share,
            ref_label=f"all ranks {100 * share:.1f}%", highlight="max"),
            "Share of each rank's steps that were dummy steps (no tokens, forward run only to keep the "
            "collectives aligned); dashed: all ranks together; red: the rank(s) with the largest share"
            + (" (tied)" if len(plots.highlighted(vals, "max")) > 1 else "") + "."))
    return Section(key="dummy", title="Dummy steps", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def unknown_reason(ctx: ReportContext) -> str | None:
    """Why this run cannot say which steps were dummy steps (None when it can): a dummy step
    is a rank running the forward with no tokens while other ranks work, so it needs more
    than one rank and a source that records tokens per (step, rank) or flags idle passes."""
    s = ctx.sql("SELECT count(DISTINCT rank) AS ranks, count(num_tokens) AS with_tokens, "
                "count(*) FILTER (WHERE is_dummy) AS flagged FROM steps WHERE run_id = ?", [ctx.run_id]).row(0, named=True)
    if s["flagged"]:
        return None
    if s["ranks"] <= 1:
        return ("the run has one rank: a dummy step is a rank idling while the others work, so there is no other "
                "rank to tell it from.")
    if not s["with_tokens"]:
        return ("this source records neither the tokens of each (step, rank) nor idle passes, so a rank that ran a "
                "step with no tokens cannot be told apart (not zero: unknown).")
    return None

"""Who never arrived: the hang post-mortem of a run's Flight Recorder dumps (the stuck
collective per process group, the ranks waiting in it, the ranks that never reached it,
mismatched ops / sizes). Reads :meth:`moetrace.run.Run.hang` (analyze/hang.py)."""
from __future__ import annotations

import polars as pl

from ..base import ReportContext, Section, md_table

ORDER = 43


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    if not ctx.sql("SELECT count(*) AS n FROM collectives WHERE run_id = ? AND source = 'flight_recorder'",
                   [rid])["n"][0]:
        return None
    res = ctx.facade.hang()
    tbl = res.groups.with_columns([pl.col(c).list.eval(pl.element().cast(pl.Utf8)).list.join(",").alias(c)
                                   for c in ("members", "waiting", "never_reached", "no_dump", "completed")])
    lines = [f"- {ln}" for ln in res.lines]
    md = "\n".join(lines + ["", md_table(tbl)])
    from ...output import render_table

    term = "\n".join(res.lines + ["", render_table(tbl, max_rows=32)])
    notes = ["Flight Recorder keeps each rank's recent operations in a ring buffer; pg_status keeps the last "
             "sequence ids beyond it. A member without a dump is listed apart: nothing says how far it got."]
    return Section("hang", "Who never arrived (Flight Recorder)", markdown=md, terminal=term, notes=notes)

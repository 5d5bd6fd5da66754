"""DeepEP's own wait counters: which source rank the others waited for (deepep_wait_blame),
and where a timeline run of the same ranks names another rank (deepep_wait_compare,
views of 46_deepep_waits.sql)."""
from __future__ import annotations

from ..base import ReportContext, Section, md_table

ORDER = 43


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    blame = ctx.sql("SELECT rank, dispatch_cycles, combine_cycles, cycles, wait_ns, share, blame_rank, stat "
                    "FROM deepep_wait_blame WHERE run_id = ? ORDER BY cycles DESC, rank", [rid])
    if blame.height == 0:
        return None
    top = blame.row(0, named=True)
    total = int(blame["cycles"].sum())
    how = "summed over waiting warps and calls" if top["stat"] == "sum" else "the maximum over waiting warps and calls"
    if not total:
        text = "DeepEP's wait counters are all zero: no rank waited to receive from another."
        return Section("deepep", "DeepEP wait counters", markdown=text, terminal=text)
    lines = [f"DeepEP's wait-receive counters ({how}) charge **rank {top['rank']}** with "
             f"{100 * top['share']:.1f}% of the {total:,} cycles the other ranks spent waiting to receive "
             f"(dispatch {top['dispatch_cycles']:,}, combine {top['combine_cycles']:,} cycles"
             + (f", {top['wait_ns'] / 1e6:.3f} ms at the given clock" if top["wait_ns"] is not None else "") + ")."]
    cmp = ctx.sql("SELECT timeline_run, any_value(deepep_top) AS deepep_top, any_value(timeline_top) AS timeline_top, "
                  "bool_or(top_disagree) AS disagree, max(abs(share_gap)) AS max_gap FROM deepep_wait_compare "
                  "WHERE deepep_run = ? GROUP BY timeline_run ORDER BY timeline_run", [rid])
    for r in cmp.iter_rows(named=True):
        if r["disagree"]:
            lines.append(f"They **disagree** with the timeline of run {r['timeline_run']}: its cross-rank waits name "
                         f"rank {r['timeline_top']} as the last arriver others waited for most (largest share gap "
                         f"{100 * (r['max_gap'] or 0):.1f} points).")
        else:
            lines.append(f"The timeline of run {r['timeline_run']} names the same rank {r['timeline_top']} (largest "
                         f"share gap {100 * (r['max_gap'] or 0):.1f} points).")
    notes = ["DeepEP charges a receiver's wait to the source rank it waited for; the timeline charges every rank's "
             "wait at a collective to its last arriver. Counters are GPU clock cycles (docs/engines.md, DeepEP)."]
    text = "\n".join(lines) + "\n\n" + md_table(blame, max_rows=16)
    return Section("deepep", "DeepEP wait counters", markdown=text, terminal=text.replace("**", ""), notes=notes)

"""Who waited for whom across ranks: the wait matrix as a heatmap, the wait each rank
caused and suffered, and the exposed collective time split into waiting-for-a-peer and
transfer. Reads :func:`moetrace.analyze.waits.wait_result` (views of 45_rank_waits.sql);
says how many collective instances could not be matched and why."""
from __future__ import annotations

import numpy as np
import polars as pl

from ..base import Figure, ReportContext, Section, md_table

ORDER = 42
MAX_HEATMAP_RANKS = 64


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    if not ctx.sql("SELECT count(*) AS n FROM spans WHERE run_id = ?", [rid])["n"][0]:
        return None
    res = ctx.facade.waits()
    cover = res.coverage_message()
    if not res.has_instances:
        return Section("waits", "Who waited for whom", markdown=cover, terminal=cover)
    ranks = res.ranks
    tot_wait = int(ranks["wait_ns"].sum())
    exp_w, exp_t = int(ranks["exposed_wait_ns"].sum()), int(ranks["exposed_transfer_ns"].sum())
    top = res.top_culprit()
    head = (f"Across {res.instances.height} matched collective instances the ranks waited "
            f"{tot_wait / 1e6:.2f} ms in all for the last rank to arrive. With no compute running on the rank, "
            f"{exp_w / 1e6:.2f} ms went to **waiting for a peer** and {exp_t / 1e6:.2f} ms to **transfer** after "
            "everyone had arrived"
            + (f" (the waits of the {res.clock_inconsistent} instances whose clocks disagree run past the waiting "
               "rank's own collective span, so these can add up to more than its collective time)."
               if res.clock_inconsistent else "."))
    if top is not None and top["caused_wait_ns"]:
        head += (f" Rank {top['rank']} made the others wait most: {top['caused_wait_ns'] / 1e6:.2f} ms, "
                 f"last to arrive at {top['times_last']} of {res.instances.height} instances.")
    tbl = ranks.select("rank", "instances", "times_last",
                       *[(pl.col(c) / 1e6).round(3).alias(c[:-3] + "_ms") for c in
                         ("caused_wait_ns", "wait_ns", "transfer_ns", "exposed_wait_ns", "exposed_transfer_ns")])
    md = [head, "", cover, "", "Per rank (caused = wait of the others charged to this rank as last arriver):", "",
          md_table(tbl)]
    from ...output import render_table
    term = [head.replace("**", ""), cover, "", render_table(tbl, max_rows=16)]
    figs = []
    f = _heatmap(ctx, res)
    if f is not None:
        figs.append(f)
    notes = ["Arrival is the collective kernel's (or host op's) start; ranks are aligned only to the trace's "
             "shared time base, with no per-rank clock correction."]
    if res.clock_inconsistent:
        notes.append(f"{res.clock_inconsistent} instances have a rank whose span ended before the last arrival "
                     "(clocks disagree or pairing is off): their transfer is clipped at 0.")
    return Section("waits", "Who waited for whom", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _heatmap(ctx: ReportContext, res) -> Figure | None:
    from .. import plots

    ranks, w = res.matrix_array()
    if len(ranks) < 2 or len(ranks) > MAX_HEATMAP_RANKS:
        return None
    n = len(ranks)
    fig, ax = plots.figure(min(10.0, 2.5 + 0.45 * n), min(9.0, 2.0 + 0.4 * n))
    ax.grid(False)
    im = ax.imshow(w / 1e6, cmap="Reds", aspect="auto")
    ax.set_xticks(np.arange(n))
    ax.set_yticks(np.arange(n))
    ax.set_xticklabels([str(r) for r in ranks], fontsize=8)
    ax.set_yticklabels([str(r) for r in ranks], fontsize=8)
    ax.set_xlabel("waited for (last to arrive)")
    ax.set_ylabel("rank that waited")
    if n <= 16:
        for i in range(n):
            for j in range(n):
                if w[i, j]:
                    ax.text(j, i, f"{w[i, j] / 1e6:.1f}", ha="center", va="center", fontsize=7,
                            color="white" if w[i, j] > 0.6 * w.max() else "black")
    fig.colorbar(im, ax=ax, label="wait, ms (all instances)")
    ax.set_title("Who waited for whom")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in ctx.run_id)
    path = plots.save(fig, ctx.outdir / f"waits_matrix_{safe}.png")
    return Figure(path, "Wait matrix: row = the rank that waited, column = the last arriver it waited for; "
                        "ms summed over matched collective instances.")

"""All-to-all exposure: how much dispatch and combine time no compute kernel hid.

Reads the views a2a_presence, a2a_exposure, a2a_rank_summary, a2a_stragglers and
a2a_modes (storage/sql/40_*, 41_*); draws a per-rank timeline of one step (compute,
dispatch, combine and helper lanes) and exposed-vs-hidden bars per layer. Says plainly
when a run has no all-to-all at all.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from ...domain.kernels import A2A_KINDS, COMPUTE_KINDS
from ...units import ms_text
from ..base import Figure, ReportContext, Section, md_table

ORDER = 40
def _lanes():
    """(label, kinds, colour, caption words) per timeline lane, in the palette's colours."""
    from ..plots import color_name, color_of

    return [("compute", COMPUTE_KINDS, color_of("compute_other"),
             f"{color_name('compute_other')} = compute kernels on any stream"),
            ("dispatch", ("dispatch",), color_of("dispatch"), f"{color_name('dispatch')} = dispatch"),
            ("combine", ("combine",), color_of("combine"), f"{color_name('combine')} = combine"),
            ("a2a other", ("a2a_other",), color_of("a2a_other"),
             f"{color_name('a2a_other')} = notify/barrier kernels")]


MAX_TIMELINE_RANKS = 8


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    has_spans = ctx.sql("SELECT count(*) AS n FROM spans WHERE run_id = ?", [rid])["n"][0]
    if not has_spans:
        return None  # not a profiler run: nothing to say
    t = ctx.facade.exposure()
    notes = []  # the run's approximations are printed by the report header already
    unl = unlabelled_sentence(t.presence)
    if not t.has_a2a:
        msg = t.no_a2a_message() + (" " + unl if unl else "")
        return Section("exposure", "All-to-all exposure", markdown=msg, terminal=msg, notes=notes)
    by_kind, ranks = t.by_kind, t.ranks
    tot_comm = int(by_kind["comm_ns"].sum())
    tot_exp = int(by_kind["exposed_ns"].sum())
    # a CPU-only trace (gloo): the all-to-alls and the compute are host ops on device -1, not kernels
    host = bool(ctx.sql("SELECT bool_and(device < 0) AS h FROM spans WHERE run_id = ?", [rid])["h"][0])
    what, dev = ("host ops", "host") if host else ("kernels", "device")
    head = (f"All-to-all {what} ran for {ms_text(tot_comm)} (union per rank, step, layer, micro-batch and kind); "
            f"**{ms_text(tot_exp)} ({100 * tot_exp / max(tot_comm, 1):.1f}%) was exposed** — no compute "
            f"{what[:-1]} ran on the same {dev} meanwhile.")
    if ranks.height and ranks["exposed_share_of_step"].drop_nulls().len():
        worst = ranks.sort("exposed_share_of_step", descending=True, nulls_last=True).row(0, named=True)
        share = f"{100 * (worst['exposed_share_of_step'] or 0):.1f}%"
        head += (f" On the trace's one rank ({worst['rank']}), exposed all-to-all is {share} of the step time."
                 if ranks.height == 1 else
                 f" Worst rank: {worst['rank']}, exposed all-to-all is {share} of its step time.")
    if unl:
        head += " " + unl
    md = [head, "", "Per kind:", "", md_table(_ms_cols(by_kind))]
    term = [head.replace("**", ""), "", _plain(_ms_cols(by_kind))]
    md += ["", "Per rank (share of comm = exposed / comm; share of step = exposed / step time):", "",
           md_table(_ms_cols(ranks))]
    term += ["", _plain(_ms_cols(ranks).head(16))]
    if t.stragglers.height:
        sent = straggler_sentence(t.stragglers)
        md += ["", sent, "", md_table(_ms_cols(t.stragglers.sort("step")))]
        term += ["", sent]
    hook = t.hook_mode_message()
    if hook:
        notes.append(hook)
    if t.groups["inferred"].any():
        notes.append("Layer (and, for plain all-to-alls, direction) of some groups was inferred from the order of "
                     "dispatches within the step; 'inferred' marks them in a2a_exposure and in the figure titles.")
        lone = lone_layers(t.groups)
        if lone:
            notes.append(f"{len(lone)} inferred layer(s) ({', '.join(map(str, lone[:8]))}"
                         f"{', ...' if len(lone) > 8 else ''}) have only a dispatch or only a combine in some step: "
                         "the all-to-alls do not come in dispatch/combine pairs, so these 'layers' are positions in "
                         "the step, not MoE layers (a non-MoE all-to-all, e.g. embedding exchange, looks like this).")
    figs = []
    p = _timeline(ctx, t)
    if p is not None:
        figs.append(p)
    p = _layer_bars(ctx, t.groups)
    if p is not None:
        figs.append(p)
    return Section("exposure", "All-to-all exposure", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _ms_cols(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns([(pl.col(c) / 1e6).round(3).alias(c.replace("_ns", "_ms"))
                            for c in df.columns if c.endswith("_ns")]).drop([c for c in df.columns if c.endswith("_ns")])


def _plain(df: pl.DataFrame) -> str:
    from ...output import render_table

    return render_table(df, max_rows=20)


def _timeline(ctx: ReportContext, t=None) -> Figure | None:
    """Lanes per rank for the step with the most all-to-all time (``t``: the run's Exposure)."""
    from .. import plots

    rid = ctx.run_id
    pick = ctx.sql("""SELECT step FROM a2a_exposure WHERE run_id = ? GROUP BY step
                      ORDER BY sum(comm_ns) DESC, step NULLS LAST LIMIT 1""", [rid])
    if pick.height == 0:
        return None
    step = pick["step"][0]
    spans = ctx.sql("""SELECT rank, kind, start_ns, end_ns, inferred, name_id, collective FROM spans
                       WHERE run_id = ? AND step IS NOT DISTINCT FROM ? AND list_contains(?, kind)
                       AND rank IN (SELECT DISTINCT rank FROM spans WHERE run_id = ? ORDER BY rank LIMIT ?)""",
                    [rid, step, list(COMPUTE_KINDS + A2A_KINDS), rid, MAX_TIMELINE_RANKS])
    if spans.height == 0:
        return None
    t0 = spans["start_ns"].min()
    ranks = sorted(spans["rank"].unique().to_list())
    present = set(spans["kind"].unique().to_list())
    lanes = [ln for ln in _lanes() if present.intersection(ln[1])]   # only the kinds this step has
    fig, ax = plots.figure(11.0, 1.0 + 0.18 * (len(lanes) + 1) * len(ranks))
    yt, yl = [], []
    for ri, r in enumerate(ranks):
        for li, (label, kinds, color, _) in enumerate(lanes):
            y = ri * (len(lanes) + 1) + li
            d = spans.filter((pl.col("rank") == r) & pl.col("kind").is_in(list(kinds)))
            if d.height:
                s = (d["start_ns"].to_numpy() - t0) / 1e6
                w = (d["end_ns"].to_numpy() - d["start_ns"].to_numpy()) / 1e6
                ax.broken_barh(list(zip(s, np.maximum(w, 1e-4))), (y - 0.4, 0.8), facecolors=color)
            yt.append(y)
            yl.append(f"rank {r} {label}")
    ax.set_yticks(yt)
    ax.set_yticklabels(yl, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first span of the step")
    inferred = (t or ctx.facade.exposure()).direction_inferred(spans)
    ax.set_title(f"Step {step}: compute vs dispatch vs combine per rank"
                 + ("\n(dispatch/combine labels INFERRED from order)" if inferred else ""))
    path = plots.save(fig, ctx.outdir / f"exposure_timeline_{rid}.png")
    n_all = int(ctx.sql("SELECT count(DISTINCT rank) AS n FROM spans WHERE run_id = ?", [rid])["n"][0])
    which = (f"first {len(ranks)} of {n_all} ranks" if n_all > len(ranks) else
             "its one rank" if n_all == 1 else f"all {n_all} ranks")
    return Figure(path, f"Timeline of step {step} ({which}): "
                        + ", ".join(ln[3] for ln in lanes) + "."
                        + (" Dispatch/combine of plain all-to-alls inferred from their order (alternation)."
                           if inferred else ""))


def _layer_bars(ctx: ReportContext, groups: pl.DataFrame) -> Figure | None:
    from .. import plots

    g = groups.filter(pl.col("layer").is_not_null())
    if g.height == 0:
        return None
    per = (g.group_by("layer").agg(pl.col("overlapped_ns").sum(), pl.col("exposed_ns").sum(),
                                   pl.col("inferred").any()).sort("layer"))
    fig, ax = plots.figure(max(6.0, 0.35 * per.height + 3), 4.0)
    x = np.arange(per.height)
    hid = per["overlapped_ns"].to_numpy() / 1e6
    exp = per["exposed_ns"].to_numpy() / 1e6
    # a legend entry only for a series with bars
    ax.bar(x, exp, color=plots.color_of("exposed"), label="exposed" if exp.any() else None)
    ax.bar(x, hid, bottom=exp, color=plots.color_of("hidden"), label="hidden behind compute" if hid.any() else None)
    top = float((exp + hid).max()) if per.height else 0.0
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)   # the bars' sticky edges would clip the tallest one
    ax.set_xticks(x)
    ax.set_xticklabels([str(v) for v in per["layer"].to_list()], fontsize=8)
    inferred = bool(per["inferred"].any())
    ax.set_xlabel("layer" + (" (order of dispatch within the step: inferred)" if inferred else ""))
    ax.set_ylabel("all-to-all time, ms (all ranks, steps)")
    ax.set_title("All-to-all time per layer: " + layer_bars_what(bool(exp.any()), bool(hid.any()))
                 + ("\n(layers INFERRED from the order of all-to-alls in the step)" if inferred else ""))
    if exp.any() or hid.any():
        ax.legend(fontsize=8)
    path = plots.save(fig, ctx.outdir / f"exposure_layers_{rid_safe(ctx.run_id)}.png")
    what = " and ".join(w for w, v in ((f"exposed ({plots.color_name('exposed')})", exp.any()),
                                       (f"hidden ({plots.color_name('hidden')})", hid.any())) if v)
    return Figure(path, f"{what[0].upper() + what[1:] if what else 'No'} all-to-all time per layer, summed over ranks, "
                        "steps, micro-batches and kinds"
                        + ("; layer numbers inferred from order, not annotated." if inferred else "."))


def layer_bars_what(exposed: bool, hidden: bool) -> str:
    """What the per-layer bars draw, as the title says it: only the series that have bars."""
    from ..plots import color_name

    if exposed and hidden:
        return f"exposed ({color_name('exposed')}) vs hidden behind compute ({color_name('hidden')})"
    if exposed:
        return "all exposed (none hidden behind compute)"
    return "all hidden behind compute (none exposed)" if hidden else "none recorded"


def rid_safe(rid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in rid)


def unlabelled_sentence(pres: dict) -> str | None:
    """Collective kernels with no CPU op: counted and said, never silently left out."""
    n = pres.get("unlabelled_comm_spans") or 0
    if not n:
        return None
    return (f"{n} collective kernel(s) ({ms_text(pres.get('unlabelled_comm_ns'))} in all, the longest "
            f"{ms_text(pres.get('unlabelled_comm_max_ns'))}) have no CPU-side collective op (no launch record), so which "
            "collective they belong to is unknown: they are left out of the exposure above (an NCCL SendRecv among "
            "them may be an all-to-all).")


def straggler_sentence(strag: pl.DataFrame) -> str:
    """The three straggler notions of a2a_stragglers, named, and how often they agree."""
    n = strag.height
    la, ls = strag["last_arrival_rank"], strag["longest_step_rank"]
    s = (f"Straggler per step, three notions: **last arrival** (last_arrival_rank: the rank whose own combine waited "
         f"least, so the others waited for it), **longest step** (longest_step_rank) and **most tokens** "
         f"(token_straggler_rank). Last arrival and longest step agree in {int((la == ls).sum())} of {n} steps")
    tok = strag["token_straggler_rank"]
    if tok.null_count() < n:
        s += (f"; last arrival and most tokens in {int((la == tok).fill_null(False).sum())} of {n}; longest step "
              f"and most tokens in {int((ls == tok).fill_null(False).sum())} of {n}.")
    else:
        s += "; tokens per rank were not recorded, so the token straggler is unknown."
    return s


def lone_layers(groups: pl.DataFrame) -> list[int]:
    """Inferred layers that, in some (rank, step, micro-batch), have a dispatch but no combine or
    the other way round."""
    g = groups.filter(pl.col("inferred") & pl.col("layer").is_not_null() & pl.col("kind").is_in(["dispatch", "combine"]))
    if g.height == 0:
        return []
    k = g.group_by(["rank", "step", "micro_batch", "layer"]).agg(pl.col("kind").n_unique().alias("n"))
    return sorted(set(k.filter(pl.col("n") < 2)["layer"].to_list()))


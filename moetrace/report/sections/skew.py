"""Per-layer skew: how unbalanced each MoE layer was across ranks, and where.

Reads the analysis views (run_skew_summary, skew_summary, layer_skew, rank_totals,
expert_step_bins: never a whole-run sort or zero-filled grid, and no expert_load row when
the report shadows them with the run's stored or batched results);
draws per-layer imbalance bars, per-rank load bars for the worst layer and per-expert
load heatmaps over steps for the most skewed layers.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 10
HEATMAP_LAYERS = 2
MAX_HEATMAP_ROWS = 300     # the bins of view expert_step_bins (storage/sql/22_expert_distribution.sql)


def placement_notes(sources: set[str], run: dict) -> list[str]:
    notes = []
    if any("contiguous" in s for s in sources):
        notes.append("No placement was recorded for some or all layers: rank loads assume contiguous placement "
                     "(expert e on rank e·ranks/experts, one slot per expert). A real deployment with "
                     "replicas or a planned placement may differ.")
    if any("recorded" in s for s in sources):
        notes.append("Rank loads use the run's recorded placement; replicas of an expert split its tokens "
                     "evenly (the engine's own replica choice was not recorded).")
    if "none" in sources:
        notes.append("The number of ranks is unknown (runs.num_ranks is empty and no placement was recorded): "
                     "rank imbalance is not computed. Re-ingest with --ranks N.")
    return notes


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    summ = ctx.sql("SELECT * FROM run_skew_summary WHERE run_id = ?", [rid])
    if summ.height == 0:
        return None
    s = summ.row(0, named=True)
    layers = ctx.sql("SELECT * FROM skew_summary WHERE run_id = ? ORDER BY layer", [rid])
    sources = set(layers["placement_source"].drop_nulls().to_list())
    notes = placement_notes(sources, ctx.run)
    figs: list[Figure] = []
    md: list[str] = []
    term: list[str] = []

    if s["imbalance_mean"] is not None:
        head = (f"Across {_n(s['layers'], 'layer')} × {_n(s['steps'], 'step')} on {s['num_ranks']} ranks, "
                f"the busiest rank "
                f"carried **{s['imbalance_mean']:.2f}×** the mean rank load on average (p50 "
                f"{s['imbalance_p50']:.2f}×, p99 {s['imbalance_p99']:.2f}×, worst {s['imbalance_max']:.2f}×). "
                f"Balancedness (Σ mean / Σ max over all steps and layers) is **{s['balancedness']:.3f}**: "
                f"if expert time grows with tokens, about {100 * (1 - s['balancedness']):.0f}% of expert-GPU time is spent "
                f"waiting for the busiest rank at the combine barrier. "
                f"Worst layer: **{s['worst_layer']}** (mean {s['worst_layer_imbalance']:.2f}×).")
    else:
        head = (f"{_n(s['layers'], 'layer')} × {_n(s['steps'], 'step')}. Rank imbalance is not available for this run "
                "(see notes); expert-level skew (Gini, top-5% share) is shown below.")
    md.append(head)
    term.append(head.replace("**", ""))
    # only pairs without tokens: with num_ranks unknown every imbalance is NULL, for another reason (noted above)
    empty = ctx.sql("SELECT count(*) AS n FROM layer_skew WHERE run_id = ? AND assignments = 0", [rid])["n"][0]
    if s["step_layers_undefined"] and empty:
        notes.append(f"{empty} (step, layer) pairs routed no tokens: their imbalance is "
                     "undefined (NULL), and they are left out of every mean and percentile.")

    show = layers.select(
        "layer", "steps", "imbalance_mean", "imbalance_p50", "imbalance_p99", "imbalance_max", "efficiency_mean",
        "gini_mean", "top5pct_share_mean", "hottest_share_mean", "hottest_expert_mode", "straggler_rank_mode",
        "placement_source")
    ranked = show.sort(["imbalance_mean", "gini_mean"], descending=True, nulls_last=True)   # gini when ranks unknown
    md.append("")
    md.append("Per layer, most skewed first (imbalance = max/mean rank tokens per step; efficiency = 1/imbalance; "
              "Gini, top-5% and hottest-expert shares are over logical experts):")
    md.append("")
    md.append(md_table(ranked, max_rows=64))
    term.append("")
    term.append("most skewed layers (imbalance = max/mean rank tokens per step):")
    term.append(_term_table(ranked.select("layer", "imbalance_mean", "imbalance_p99", "efficiency_mean",
                                          "gini_mean", "hottest_expert_mode", "straggler_rank_mode").head(8)))

    out = ctx.outdir
    if layers["imbalance_mean"].drop_nulls().len():
        means = layers["imbalance_mean"].fill_null(float("nan")).to_numpy()
        p99 = layers["imbalance_p99"].fill_null(float("nan")).to_numpy()
        worst_i = int(np.nanargmax(means))
        err = np.vstack([np.zeros_like(means), np.nan_to_num(p99 - means)])
        whiskers = bool(err.max() > 0)     # one step (or a p99 equal to the mean): no whisker is drawn
        bar_is = "mean over steps" if int(layers["steps"].max() or 0) > 1 else "its one step"
        figs.append(Figure(plots.bars(
            out / "skew_layer_imbalance.png", layers["layer"].to_list(), np.nan_to_num(means, nan=0.0),
            title=f"Rank imbalance per layer (bar: {bar_is}" + (", whisker: p99)" if whiskers else ")"),
            xlabel="MoE layer", ylabel="max / mean rank tokens (×)", ref_line=1.0,
            ref_label="perfect balance (1.0×)", highlight=worst_i, errors=err if whiskers else None),
            f"Per-layer imbalance: the busiest rank's tokens over the mean rank's, {bar_is} (bar)"
            + (" and p99 (whisker)" if whiskers else "") + ". 1.0 is perfect balance; the worst layer is in "
            f"{plots.color_name('highlight')}."))
        wl = int(layers["layer"][worst_i])
        rl = _mean_rank_tokens(ctx, wl)
        strag = ctx.sql("SELECT straggler_rank, count(*) AS steps FROM layer_skew WHERE run_id = ? AND layer = ? "
                        "AND straggler_rank IS NOT NULL GROUP BY 1 ORDER BY steps DESC LIMIT 3", [rid, wl])
        if rl.height:
            vals = rl["mean_tokens"].to_numpy()
            figs.append(Figure(plots.bars(
                out / "skew_worst_layer_ranks.png", rl["rank"].to_list(), vals,
                title=f"Layer {wl}: mean tokens per rank per step", xlabel="rank",
                ylabel="tokens per step (token-expert assignments)", ref_line=float(vals.mean()),
                ref_label=f"mean rank {vals.mean():.0f}", highlight="max"),
                f"Worst layer {wl}: tokens each rank received per step, averaged over steps (the most loaded "
                + ("ranks, tied, in red" if len(plots.highlighted(vals, "max")) > 1 else "rank in red")
                + ", dashed line: the mean rank). The busiest rank sets the layer's time."))
            if strag.height:
                total = int(layers.filter(pl.col("layer") == wl)["steps"][0])
                txt = ", ".join(f"rank {r} ({n} of {total} steps)" for r, n in strag.iter_rows())
                md.append("")
                md.append(f"Straggler of layer {wl} (the rank with most tokens): {txt}.")
                term.append(f"straggler of layer {wl}: {txt}")

    # heatmaps of per-expert load over steps for the most skewed layers
    order = ranked.filter(pl.col("imbalance_mean").is_not_null()) if ranked["imbalance_mean"].drop_nulls().len() \
        else layers.sort("gini_mean", descending=True, nulls_last=True)
    for lyr in order["layer"].head(HEATMAP_LAYERS).to_list():
        f = _heatmap(ctx, int(lyr))
        if f is not None:
            figs.append(f)
    return Section(key="skew", title="Per-layer skew", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)


def _n(k, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _heatmap(ctx: ReportContext, layer: int) -> Figure | None:
    rid = ctx.run_id
    # the layer's steps from layer_skew (one row per (step, layer) with expert_load rows: computed
    # once per report), not from another scan of expert_load
    n = ctx.sql("SELECT count(*) AS n, min(step) AS a, max(step) AS b FROM layer_skew WHERE run_id = ? "
                "AND layer = ?", [rid, layer])
    n_steps = n["n"][0]
    E = ctx.sql("SELECT num_experts FROM run_shape WHERE run_id = ?", [rid])["num_experts"][0]
    if not n_steps or E is None:
        return None
    E = int(E)
    if n_steps == 1:   # one (pseudo-)step: a bar per expert says more than a one-row heatmap
        df = ctx.sql("SELECT expert, sum(tokens) AS tokens FROM expert_step_bins WHERE run_id = ? AND layer = ? "
                     "GROUP BY expert", [rid, layer])
        x = np.zeros(E)
        x[df["expert"].to_numpy()] = df["tokens"].to_numpy()
        path = plots.bars(ctx.outdir / f"skew_experts_layer{layer}.png", list(range(E)), x,
                          title=f"Layer {layer}: tokens per logical expert", xlabel="logical expert id",
                          ylabel="tokens (token-expert assignments)", ref_line=float(x.mean()),
                          ref_label=f"mean expert {x.mean():.0f}", highlight="max", width=12)
        return Figure(path, f"Layer {layer}: tokens each logical expert received over the run's single "
                            "(pseudo-)step; the hottest expert in red, dashed: the mean expert.")
    # the view's bins: least(steps, MAX_HEATMAP_ROWS) consecutive bins of the layer's steps
    df = ctx.sql("SELECT bin, expert, tokens, bins FROM expert_step_bins WHERE run_id = ? AND layer = ?", [rid, layer])
    bins = int(df["bins"][0]) if df.height else min(int(n_steps), MAX_HEATMAP_ROWS)
    m = np.zeros((bins, E))
    counts = np.bincount((np.arange(n_steps) * bins) // n_steps, minlength=bins).astype(float)
    m[df["bin"].to_numpy(), df["expert"].to_numpy()] = df["tokens"].to_numpy()
    m /= counts[:, None]
    binned = bins < n_steps
    title = f"Layer {layer}: tokens per expert per step"
    ylabel = "step" if not binned else f"step bin ({n_steps // bins}–{-(-n_steps // bins)} steps each)"
    steps = (int(n["a"][0]), int(n["b"][0]))
    kw = {}
    if steps[1] - steps[0] + 1 == n_steps:     # contiguous steps: the y axis in steps, round ticks
        kw["y_range"] = steps
    else:                                      # gaps: label rows by the step they start at
        yt = np.linspace(0, bins - 1, min(6, bins)).astype(int)
        order = ctx.sql("SELECT step FROM layer_skew WHERE run_id = ? AND layer = ? ORDER BY step",
                        [rid, layer])["step"].to_numpy()
        kw["y_ticks"] = (yt, [str(int(order[(t * n_steps) // bins])) for t in yt])
    groups, strag = _rank_groups(ctx, layer, E)
    # the placement the rank lines stand for is part of what the figure says
    src = ctx.sql("SELECT placement_source FROM layer_placement WHERE run_id = ? AND layer = ?", [rid, layer])
    src = src["placement_source"][0] if src.height else None
    title += ("\nplacement ASSUMED contiguous (none recorded)" if src == "contiguous" else
              "\nplacement recorded (experts not grouped by rank)" if src else "\nplacement unknown")
    path = plots.heatmap(ctx.outdir / f"skew_heatmap_layer{layer}.png", m, title=title,
                         xlabel="logical expert id" + (" (cyan lines: rank boundaries, top axis: rank)"
                                                       if groups else ""),
                         ylabel=ylabel if not binned else "step",
                         cbar_label="tokens per step (token-expert assignments)", groups=groups,
                         mark_group=strag, **kw)
    cap = (f"Layer {layer}: tokens each logical expert received per step (columns: experts, rows: steps"
           + (f", averaged over bins of about {n_steps / bins:.0f} steps" if binned else "")
           + ("; cyan lines split the experts by rank (contiguous placement), the green box is the rank that was "
              f"most often the straggler (rank {strag})" if groups and strag is not None else "")
           + ("; no rank boundaries: the placement is recorded, not contiguous, so logical experts are not grouped "
              "by rank" if not groups else "") +
           "). Bright vertical stripes are persistently hot experts; colour scale clipped at the 99.5th percentile.")
    return Figure(path, cap)


def _rank_groups(ctx: ReportContext, layer: int, E: int):
    """(first expert, label) per rank when the layer's placement is contiguous (expert e on rank
    e·R/E), and the rank most often the straggler; ([], None) otherwise."""
    sh = ctx.sql("SELECT p.placement_source, s.num_ranks FROM layer_placement p JOIN run_shape s USING (run_id) "
                 "WHERE p.run_id = ? AND p.layer = ?", [ctx.run_id, layer])
    if sh.height == 0 or sh["placement_source"][0] != "contiguous" or not sh["num_ranks"][0]:
        return [], None
    R = int(sh["num_ranks"][0])
    if R < 2 or E % R:
        return [], None
    per = E // R
    groups = [(r * per, str(r)) for r in range(R)]
    mode = ctx.sql("SELECT straggler_rank FROM layer_skew WHERE run_id = ? AND layer = ? AND straggler_rank IS NOT NULL "
                   "GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT 1", [ctx.run_id, layer])
    return groups, (int(mode["straggler_rank"][0]) if mode.height else None)


def _mean_rank_tokens(ctx: ReportContext, layer: int) -> pl.DataFrame:
    """Mean tokens per step of every rank (0 .. num_ranks-1) in ``layer``: the rank_load
    average, as the sparse rank totals (view rank_totals) over the layer's step count (no
    zero-filled grid of steps x ranks, which is tens of millions of rows on a fleet run)."""
    return ctx.sql(
        "WITH t AS (SELECT rank, tokens FROM rank_totals WHERE run_id = ? AND layer = ?), n AS (SELECT count(*) AS steps FROM layer_skew WHERE run_id = ? AND layer = ?), "
        "r AS (SELECT unnest(range(num_ranks)) AS rank FROM run_shape WHERE run_id = ? AND num_ranks IS NOT NULL) "
        "SELECT r.rank, coalesce(t.tokens, 0.0) / n.steps AS mean_tokens FROM r CROSS JOIN n "
        "LEFT JOIN t USING (rank) WHERE n.steps > 0 ORDER BY r.rank", [ctx.run_id, layer, ctx.run_id, layer, ctx.run_id])


def _term_table(df: pl.DataFrame) -> str:
    from ...output import render_table

    return render_table(df, max_rows=20, float_precision=3)

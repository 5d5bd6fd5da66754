"""Replay: would another placement have saved the step time, and how often to re-plan.

Shows the replays stored for the run (``moetrace replay``), the drift comparison when one
was run, and, when the run has no stored replay, a what-if computed in memory (nothing is
written): the recorded placement against greedy and EPLB plans fitted on the first half of
the steps and judged on the second half.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl

from ..base import Figure, ReportContext, Section, md_table
from .. import plots

ORDER = 60
WHATIF_MAX_CELLS = 2_000_000    # steps x layers x experts read for the in-memory what-if


def _stored(ctx: ReportContext):
    if not ctx.store.has_files("replay_runs"):
        return None
    df = ctx.sql("""SELECT replay_id, kind, policy, split, num_steps, num_ranks, num_slots, mean_imbalance,
                           p99_imbalance, mean_efficiency, predicted_step_ns, moved_experts, moved_bytes,
                           exact_bytes, approximations, cost_json, created_at_ns
                    FROM replay_runs WHERE run_id = ? ORDER BY created_at_ns""", [ctx.run_id])
    return df if df.height else None


def _whatif(ctx: ReportContext):
    from ...replay.cost import preset
    from ...replay.engine import RunShape, layer_metrics, read_load, recorded_plan, replay_load, summarize
    from ...replay.planners import make_plan

    try:
        shape = RunShape.from_store(ctx.store, ctx.run_id)
    except Exception:   # no expert_load: nothing to replay
        return None, []
    max_steps = max(2, WHATIF_MAX_CELLS // max(1, shape.layers.size * shape.num_experts))
    if shape.steps.size < 2:
        return None, []
    ids, load = read_load(ctx.store, ctx.run_id, shape, max_steps=max_steps)
    half = ids.size // 2
    fit, judge = load[:half].sum(axis=0, dtype=np.float64), load[half:]
    cost = preset("H200", shape.hidden, shape.expert_bytes)
    rows = []
    cands = [("recorded", recorded_plan(ctx.store, ctx.run_id, shape))]
    for pol, rep in (("greedy", 0), ("eplb", 0), ("eplb", shape.num_ranks)):
        ps = shape.plan_shape(replicas=rep)
        if ps.num_slots % ps.num_ranks:
            continue
        try:
            cands.append((f"{pol} +{rep}", make_plan(pol, fit, ps, layers=shape.layers)))
        except Exception:
            continue
    for name, plan in cands:
        m = layer_metrics(replay_load(judge, plan, "even", None, shape.top_k, shape.bytes_per_token), cost)
        s = summarize(m.imbalance, m.layer_ns, m.rank_ns.mean(axis=2))
        rows.append({"plan": name, "slots": plan.num_slots, "mean_imbalance": s["mean_imbalance"],
                     "p99_imbalance": s["p99_imbalance"], "efficiency": s["mean_efficiency"],
                     "predicted_ms_per_step": s["predicted_step_ns"] / 1e6})
    notes = [f"What-if computed in memory: plans fitted on steps {int(ids[0])}..{int(ids[half - 1])}, judged on "
             f"steps {int(ids[half])}..{int(ids[-1])}; even split over replicas; H200 preset cost model; dispatch "
             "bytes estimated (no per-token data used)."] + shape.notes
    if ids.size < shape.steps.size:
        notes.append(f"What-if limited to the first {ids.size} of {shape.steps.size} steps (report time bound).")
    return pl.DataFrame(rows), notes


def _ms(ms: float) -> str:
    """A time given in ms, in µs when it is small (tiny models would all read 0.00 ms)."""
    return f"{ms:.2f} ms" if ms >= 0.1 else f"{ms * 1e3:.2f} µs"


def build(ctx: ReportContext) -> Section | None:
    stored = _stored(ctx)
    notes: list[str] = []
    md: list[str] = []
    term: list[str] = []
    figs: list[Figure] = []
    if stored is None:
        df, notes = _whatif(ctx)
        if df is None:
            return None
        best = df.sort("predicted_ms_per_step").row(0, named=True)
        rec = df.filter(pl.col("plan") == "recorded").row(0, named=True)
        text = (f"Replayed against the run's recorded routing, the recorded placement runs at max/mean "
                f"**{rec['mean_imbalance']:.2f}×**; **{best['plan']}** would bring it to "
                f"**{best['mean_imbalance']:.2f}×** and the predicted MoE time per step from "
                f"{_ms(rec['predicted_ms_per_step'])} to {_ms(best['predicted_ms_per_step'])}. Run "
                "`moetrace replay` / `moetrace sweep` for stored results, drift and the decision table.")
        md += [text, "", md_table(df)]
        term += [text.replace("**", ""), "", _render(df)]
        return Section(key="replay", title="Replay: alternative placements", markdown="\n".join(md),
                       terminal="\n".join(term), figures=figs, notes=notes)
    show = stored.with_columns((pl.col("predicted_step_ns") / 1e6).alias("predicted_ms"),
                               (pl.col("moved_bytes") / 2**30).alias("moved_GiB")).select(
        "replay_id", "kind", "policy", "split", "num_ranks", "num_slots", "mean_imbalance", "p99_imbalance", "mean_efficiency",
        "predicted_ms", "moved_experts", "moved_GiB", "exact_bytes")
    ranks = ctx.run.get("num_ranks")
    real = show.filter(pl.col("kind") != "drift-oracle")   # the oracle is a lower bound, not a plan
    real = real if real.height else show
    same = real.filter(pl.col("num_ranks") == ranks) if ranks else real
    pool = same if same.height else real
    best = pool.sort("predicted_ms").row(0, named=True)
    text = (f"{show.height} stored replay(s). Fastest predicted on {best['num_ranks']} ranks"
            f"{' (the run' + chr(39) + 's own count)' if same.height else ''}: **{best['policy']}** ({best['kind']}), "
            f"max/mean **{best['mean_imbalance']:.2f}×**, {_ms(best['predicted_ms'])} of MoE time per step, "
            f"{best['moved_experts']} expert moves.")
    md += [text, "", md_table(show)]
    term += [text.replace("**", ""), "", _render(show.drop("replay_id"))]
    # the latest drift comparison: imbalance over time
    drift = stored.filter(pl.col("kind").str.starts_with("drift-"))
    if drift.height:
        base = drift["replay_id"][-1].rsplit("-", 1)[0]
        ids = [r for r in drift["replay_id"].to_list() if r.startswith(base + "-")]
        per = ctx.sql("""SELECT replay_id, step, avg(imbalance) AS imbalance FROM replay_layer
                         WHERE run_id = ? AND replay_id IN (SELECT unnest(?)) GROUP BY ALL ORDER BY step""",
                      [ctx.run_id, ids])
        series = []
        for rid in ids:
            d = per.filter(pl.col("replay_id") == rid)
            series.append((rid.rsplit("-", 1)[1], d["step"].to_numpy(), d["imbalance"].to_numpy()))
        p = plots.lines(ctx.outdir / "replay_drift.png", series, title="Imbalance over time: static vs re-planned vs oracle",
                        xlabel="step", ylabel="max / mean rank tokens (mean over layers)", markers=False)
        figs.append(Figure(p, "A plan fitted once goes stale as popularity drifts; re-planning from a trailing "
                              "window recovers most of the gap to the oracle (fitted on the very steps it is "
                              "judged on, a lower bound)."))
    for a in stored["approximations"].drop_nulls().unique().to_list():
        try:
            notes += [n for n in json.loads(a) if n not in notes]
        except ValueError:
            pass
    for c in stored["cost_json"].unique().to_list():
        src = json.loads(c).get("source", "")
        if src and f"Cost model: {src}" not in notes:
            notes.append(f"Cost model: {src}")
    return Section(key="replay", title="Replay: alternative placements and re-planning", markdown="\n".join(md),
                   terminal="\n".join(term), figures=figs, notes=notes)


def _render(df):
    from ...output import render_table

    return render_table(df, float_precision=3)

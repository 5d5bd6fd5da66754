"""Replay: would another placement have saved the step time, net of moving the experts?

Shows the replays stored for the run (``moetrace replay``), each against the recorded
placement on the same steps (recorded vs predicted vs net), the latest drift comparison,
and the dispatch traffic between ranks (recorded vs the fastest plan) when the run has
per-token routing. When the run has no stored replay, a what-if is computed in memory by
the replay adapter (nothing written). This section only reads and draws.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl

from ...units import ms_text, ms_to_ns, pct_change
from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 60
WHATIF_MAX_CELLS = 2_000_000    # steps x layers x experts read for the in-memory what-if


def _ms(ns: float | None) -> str:
    """A predicted time given in ns: ms, in µs below 0.1 ms."""
    return ms_text(ns, none="no time", micro_below_ms=0.1)


def _band(rel: float | None) -> str:
    return "±?" if rel is None else f"±{100 * rel:.0f}%"


def band_sentence(bands: list[tuple[float | None, str]]) -> str:
    """Every time of the section is a cost-model prediction (the recorded placement's too):
    its error band(s), with their sources."""
    uniq = list(dict.fromkeys(bands))
    return ("Every time in this section is predicted by the cost model (the recorded placement's too: the same "
            "model on the recorded plan) and carries its error band: "
            + "; ".join(f"{_band(r)} ({src})" for r, src in uniq) + ".")


def _stored(ctx: ReportContext):
    if not ctx.store.has_files("replay_runs"):
        return None
    df = ctx.sql("SELECT * FROM replay_runs WHERE run_id = ? ORDER BY created_at_ns", [ctx.run_id])
    return df if df.height else None


def _whatif(ctx: ReportContext):
    from ...errors import InputError

    try:
        return ctx.facade.placement_whatif(WHATIF_MAX_CELLS)
    except InputError:   # no expert_load, or no rank count: nothing to replay
        return None


def _whatif_section(ctx, w) -> Section:
    unit = "pass" if w.timing.per_pass else "step"
    rows = []
    for j in w.results:
        la = w.load_answer(j)
        rows.append({"plan": j.name, "slots": j.plan.num_slots, "groups": j.plan.num_groups,
                     # the exact half first: straggler tokens (mean over steps and layers), no band
                     "recorded_straggler_tokens": la.recorded_straggler_tokens if la else None,
                     "straggler_tokens": la.straggler_tokens if la else None,
                     "load": ("baseline" if j.kind == "recorded" else la.verdict) if la else None,
                     "mean_imbalance": j.summary.mean_imbalance, "recorded_imbalance": j.recorded.mean_imbalance,
                     f"predicted_ms_per_{unit}": None if j.gross_step_ns is None else j.gross_step_ns / 1e6,
                     f"net_ms_per_{unit}": None if j.net_step_ns is None else j.net_step_ns / 1e6,
                     "recorded_ms": None if j.recorded_step_ns is None else j.recorded_step_ns / 1e6,
                     "time_band": None if j.gross_step_ns is None else _band(w.error_band[0]),
                     "moved_experts": j.moved_experts, "verdict": "baseline" if j.kind == "recorded" else j.verdict})
    df = pl.DataFrame(rows)
    rec = w.results[0]
    best = w.fastest()
    b = _band(w.error_band[0])
    if rec.gross_step_ns is None:
        text = (f"Replayed against the run's recorded counts, the recorded placement runs at max/mean "
                f"**{rec.summary.mean_imbalance:.2f}×**. The counts aggregate many passes and their number is "
                "unknown, so no time per step is predicted; imbalance only.")
        bi = min(w.results[1:], key=lambda j: j.summary.mean_imbalance or 9e9, default=None)
        if bi is not None:
            text += f" Most balanced: **{bi.name}** at {bi.summary.mean_imbalance:.2f}×."
    elif best is None:
        text = (f"The recorded placement runs at {_ms(rec.gross_step_ns)} {b} per {unit}; no other plan could "
                f"be made. {band_sentence([w.error_band])}")
    else:
        la = w.load_answer(best)
        exact = (f"Exact (counted, no time model): with **{best.name}** {la.reason}. " if la else "")
        text = exact + (f"Recorded placement: max/mean **{rec.summary.mean_imbalance:.2f}×**, {_ms(rec.gross_step_ns)} "
                f"{b} of MoE time per {unit}. Fastest net: **{best.name}**, {_ms(best.net_step_ns)} {b} vs "
                f"{_ms(best.recorded_step_ns)} {b} recorded{pct_change(best.net_step_ns, best.recorded_step_ns)} "
                f"(gross {_ms(best.gross_step_ns)} {b}; {best.moved_experts} expert moves charged), max/mean "
                f"{best.summary.mean_imbalance:.2f}×. Verdict: **{best.verdict}** ({best.verdict_reason}). "
                f"{band_sentence([w.error_band])} Run `moetrace replay` / `moetrace sweep` for stored results, drift "
                "and the decision table.")
    return Section(key="replay", title="Replay: alternative placements", markdown="\n".join([text, "", md_table(df)]),
                   terminal="\n".join([text.replace("**", ""), "", _render(df)]), notes=w.notes)


def build(ctx: ReportContext) -> Section | None:
    stored = _stored(ctx)
    if stored is None:
        w = _whatif(ctx)
        return None if w is None else _whatif_section(ctx, w)
    notes: list[str] = []
    figs: list[Figure] = []
    cols = set(stored.columns)

    def col(name, default=None):
        return pl.col(name) if name in cols else pl.lit(default)

    show = stored.select(
        "replay_id", "kind", "policy", col("plan_desc").alias("plan"), col("judged_on").alias("judged_on"),
        "num_steps", "mean_imbalance", col("recorded_mean_imbalance").alias("recorded_imbalance"),
        (col("recorded_step_ns") / 1e6).alias("recorded_ms"), (pl.col("predicted_step_ns") / 1e6).alias("predicted_ms"),
        (col("net_step_ns") / 1e6).alias("net_ms"), "moved_experts", (pl.col("moved_bytes") / 2**30).alias("moved_GiB"),
        col("verdict").alias("verdict"), col("verdict_reason").alias("verdict_reason"), "exact_bytes")
    loads = [_stored_load(sj) for sj in stored["summary_json"].to_list()]
    at0 = show.columns.index("num_steps") + 1
    for i, (name, key) in enumerate((("recorded_straggler_tokens", "recorded_straggler_tokens_mean"),
                                     ("straggler_tokens", "straggler_tokens_mean"))):
        show = show.insert_column(at0 + i, pl.Series(name, [ld.get(key) for ld in loads], pl.Float64))
    show = show.insert_column(at0 + 2, pl.Series("load", [ld.get("verdict") for ld in loads], pl.Utf8))
    bands = [_stored_band(sj) for sj in stored["summary_json"].to_list()]
    timed = [t is not None for t in show["predicted_ms"].to_list()]
    at = show.columns.index("net_ms") + 1
    show = show.insert_column(at, pl.Series("time_band", [_band(r) if t else None for t, (r, _) in zip(timed, bands)],
                                            pl.Utf8))
    deployable = show.filter(~pl.col("kind").is_in(["drift-oracle"]) & (pl.col("policy") != "plan recorded")
                             & pl.col("net_ms").is_not_null())
    lines = [f"{show.height} stored replay(s), each judged against the recorded placement on the same steps with "
             "the same cost model; net = predicted time plus the cost of moving experts."]
    if deployable.height:
        b = fastest_net(deployable)
        if b is not None and b.get("straggler_tokens") is not None and b.get("recorded_straggler_tokens") is not None:
            lines.append(f"Exact (counted, no time model): under **{b['policy']}** the straggler holds "
                         f"{b['straggler_tokens']:,.0f} tokens vs {b['recorded_straggler_tokens']:,.0f} recorded "
                         f"(mean over the judged steps and layers; load: {b['load']}).")
        lines.append(fastest_sentence(deployable))
    elif show.filter(pl.col("predicted_ms").is_null()).height:
        lines.append("The counts aggregate many passes of unknown number: imbalance answers only, no time per step.")
    if any(timed):
        lines.append(band_sentence([bd for t, bd in zip(timed, bands) if t]))
    text = " ".join(lines)
    table = show.drop("replay_id", "plan", "verdict_reason")
    md = [text, "", md_table(table)]
    term = [text.replace("**", ""), "", _render(table)]
    figs += _drift_figure(ctx, stored)
    figs += _traffic_figures(ctx, stored)
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


def _stored_load(summary_json: str | None) -> dict:
    """The exact half a replay stored (:class:`moetrace.replay.results.LoadAnswer`); {} before it."""
    try:
        return json.loads(summary_json or "{}").get("load") or {}
    except ValueError:
        return {}


def fastest_net(deployable: pl.DataFrame) -> dict | None:
    """The stored replay that gains most net against the recorded placement ON ITS OWN JUDGED
    STEPS (lowest net_ms / recorded_ms; the recorded time of each row is predicted on the very
    steps that row was judged on). Times of replays judged on different steps are never compared
    with each other: within one ``judged_on`` the lowest ratio is the lowest net time."""
    d = deployable.filter(pl.col("net_ms").is_not_null() & pl.col("recorded_ms").is_not_null()
                          & (pl.col("recorded_ms") > 0))
    if not d.height:
        return None
    d = d.with_columns((pl.col("net_ms") / pl.col("recorded_ms")).alias("ratio")).sort("ratio")
    best = d.row(0, named=True)
    best["same_steps"] = d.filter(pl.col("judged_on") == best["judged_on"]).height
    best["step_sets"] = d["judged_on"].n_unique()
    return best


def fastest_sentence(deployable: pl.DataFrame) -> str:
    """The section's headline: the best replay against the recorded placement on the same
    steps, or that none beats it (:func:`fastest_net`)."""
    b = fastest_net(deployable)
    if b is None:
        return "No stored replay has a net time to compare with the recorded placement."
    tb = b["time_band"]
    scope = (" (replays judged on different steps are compared by their change from the recorded placement on "
             f"their own steps, never by their times: {b['step_sets']} sets of judged steps here)"
             if b["step_sets"] > 1 else "")
    what = (f"**{b['policy']}** ({b['kind']}; {b['plan']}): {_ms(ms_to_ns(b['net_ms']))} {tb} vs "
            f"{_ms(ms_to_ns(b['recorded_ms']))} {tb} "
            f"recorded{pct_change(b['net_ms'], b['recorded_ms'])}, gross {_ms(ms_to_ns(b['predicted_ms']))} {tb}, "
            f"{b['moved_experts']} expert moves; judged on {b['judged_on']}")
    verdict = f" Verdict: **{b['verdict']}**" + (f" ({b['verdict_reason']})." if b["verdict_reason"] else ".")
    if b["ratio"] >= 1.0:
        return ("No stored replay is faster net than the recorded placement on the same steps; the closest is "
                + what + scope + "." + verdict)
    from ...units import NOT_ENOUGH

    if b["verdict"] == NOT_ENOUGH:   # the word replay, drift and sweep use for the same comparison
        return ("Lowest predicted net time against the recorded placement on the same steps, not a predicted win "
                "(the difference is within the model's band, or too few steps): " + what + scope + "." + verdict)
    return "Fastest net against the recorded placement on the same steps: " + what + scope + "." + verdict


def _stored_band(summary_json: str | None) -> tuple[float | None, str]:
    """(relative error, source) the replay stored with its predicted times."""
    try:
        b = json.loads(summary_json or "{}").get("error_band") or {}
    except ValueError:
        b = {}
    return b.get("rel"), b.get("source") or "no error band stored with this replay"


def _drift_figure(ctx, stored) -> list[Figure]:
    drift = stored.filter(pl.col("kind").str.starts_with("drift-"))
    if not drift.height:
        return []
    base = drift["replay_id"][-1].rsplit("-", 1)[0]
    ids = [r for r in drift["replay_id"].to_list() if r.startswith(base + "-")]
    per = ctx.sql("""SELECT replay_id, step, avg(imbalance) AS imbalance FROM replay_layer
                     WHERE run_id = ? AND replay_id IN (SELECT unnest(?)) GROUP BY ALL ORDER BY step""",
                  [ctx.run_id, ids])
    curves, step, nets = [], None, {}
    for rid in ids:
        d = per.filter(pl.col("replay_id") == rid)
        r = stored.filter(pl.col("replay_id") == rid).row(0, named=True)
        step = d["step"].to_numpy() if step is None else step
        curves.append((rid.rsplit("-", 1)[1], d["imbalance"].to_numpy(), r["mean_imbalance"], r["moved_experts"],
                       r["moved_bytes"]))
        nets[rid.rsplit("-", 1)[1]] = r.get("net_step_ns")
    p = plots.drift(ctx.outdir / "replay_drift.png", step, curves,
                    title="Imbalance over time: static vs re-planned vs oracle")
    return [Figure(p, drift_caption({c[0]: c[2] for c in curves}, nets))]


def drift_caption(means: dict, nets: dict | None = None) -> str:
    """What the drift figure shows, from the mean imbalance of each plan (``static``,
    ``replan``, ``oracle``; max/mean over the judged steps) and, when given, their net
    predicted time per step in ns (``nets``, moves charged): only what these numbers say. A
    re-plan that balances better but is slower net is said to be slower net."""
    names = {"static": "static plan", "replan": "re-planned", "oracle": "oracle"}
    got = {k: means[k] for k in names if means.get(k) is not None}
    out = ("Mean imbalance over the judged steps: "
           + ", ".join(f"{names[k]} {v:.3f}×" for k, v in got.items())
           + (" (the oracle is fitted on the very steps it is judged on: a lower bound)" if "oracle" in got else "")
           + ".")
    st, rp, orc = got.get("static"), got.get("replan"), got.get("oracle")
    net_s, net_r = (nets or {}).get("static"), (nets or {}).get("replan")
    slower = net_s is not None and net_r is not None and net_r > net_s
    if st is not None and rp is not None:
        if rp >= st:
            out += " Re-planning did not lower the imbalance below the static plan's."
        elif orc is not None and st > orc:
            share = (st - rp) / (st - orc)
            out += (f" Re-planning from a trailing window closes {100 * share:.0f}% of the imbalance gap between the "
                    "static plan and the oracle")
            out += (f", but it is slower net: {_ms(net_r)} vs {_ms(net_s)} per step for the static plan, "
                    "its expert moves costing more than the balance saves." if slower else ".")
        else:
            out += f" Re-planning lowers it by {st - rp:.3f}×"
            out += (f" but is slower net ({_ms(net_r)} vs {_ms(net_s)} static)." if slower else ".")
    if net_s is not None and net_r is not None and not slower:
        out += f" Net of moves: re-planned {_ms(net_r)} vs static {_ms(net_s)} per step."
    return out + " The table above charges each re-plan its expert moves."


def _traffic_figures(ctx, stored) -> list[Figure]:
    """Dispatch bytes per (source rank, destination rank): recorded vs the fastest plan with traffic."""
    if not ctx.store.has_files("replay_traffic"):
        return []
    tr = ctx.sql("SELECT replay_id, plan, src_rank, dst_rank, bytes, steps FROM replay_traffic WHERE run_id = ?",
                 [ctx.run_id])
    if not tr.height:
        return []
    with_tr = stored.filter(pl.col("replay_id").is_in(tr["replay_id"].unique().to_list()))
    key = "net_step_ns" if "net_step_ns" in with_tr.columns else "predicted_step_ns"
    cand = with_tr.filter(pl.col("policy") != "plan recorded")
    pick = (cand if cand.height else with_tr).sort(key, nulls_last=True).row(0, named=True)
    t = tr.filter(pl.col("replay_id") == pick["replay_id"])
    R = int(max(t["src_rank"].max(), t["dst_rank"].max())) + 1
    R = max(R, int(pick["num_ranks"]))
    figs = []
    mats = {}
    for which in ("recorded", "plan"):
        d = t.filter(pl.col("plan") == which)
        if d.height:
            m = np.zeros((R, R))
            m[d["src_rank"].to_numpy(), d["dst_rank"].to_numpy()] = d["bytes"].to_numpy() / max(int(d["steps"][0]), 1)
            mats[which] = m
    # one colour scale and one unit for both figures, so a colour means the same bytes in each
    top = max((float(m.max()) for m in mats.values()), default=0.0)
    uname, udiv = plots.byte_unit(top)
    for which, label in (("recorded", "recorded placement"), ("plan", pick["policy"])):
        if which not in mats:
            continue
        m = mats[which]
        p = plots.heatmap(ctx.outdir / f"replay_traffic_{which}.png", m / udiv,
                          title=f"Dispatch traffic per step: {label}", xlabel="destination rank",
                          ylabel="source rank", cbar_label=f"{uname} per step (same scale in both figures)",
                          vmax=max(top / udiv, 1e-12), integer_ticks=True)
        tu, td = plots.byte_unit(m.sum())
        figs.append(Figure(p, f"Dispatch bytes from each source rank (rows) to each destination rank (columns) per "
                              f"judged step under the {label} (exact, from per-token routing; the combine sends the "
                              f"same rows back). Total {m.sum() / td:.1f} {tu} per step; the colour scale is shared "
                              "with the other traffic figure."))
    return figs


def _render(df):
    from ...output import render_table

    return render_table(df, float_precision=3)

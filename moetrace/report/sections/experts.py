"""Tokens per expert: how many tokens each expert's GEMM saw per step, and how many
experts a step touched against the uniform-routing expectation."""
from __future__ import annotations

import json

import numpy as np

from ...units import time_text
from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 20
# Below a few hundred tokens per expert the expert GEMM reads weights rather than computes.
# The crossover depends on the GPU and the weights' dtype: a GEMM over T tokens does 2 FLOP
# per weight per token and reads each weight once (BYTES per weight), so it is bound by
# memory while T < (peak FLOP/s / HBM bytes/s) x BYTES / 2. Named here, said wherever used.
BOUND_GPU, BOUND_DTYPE, BOUND_TFLOPS, BOUND_TBPS, BOUND_BYTES = "H100 SXM", "BF16", 989.0, 3.35, 2
WEIGHT_BOUND_TOKENS = int(round(BOUND_TFLOPS / BOUND_TBPS * BOUND_BYTES / 2))   # 295
BOUND_WHO = (f"an {BOUND_GPU} with {BOUND_DTYPE} weights ({BOUND_TFLOPS:.0f} dense TFLOP/s over {BOUND_TBPS} TB/s "
             "of HBM)")


def weight_bound(ctx: ReportContext) -> tuple[int, str, str]:
    """(tokens, short name, long description) of the weight-read crossover on the hardware
    the replay used: under its cost model (expert time = a x tokens + b x slots touched) an
    expert below b / a tokens spends more on reading its weights than on arithmetic. From the
    newest replay stored for the run, else the cost model a replay would use now (the facade),
    else the fixed H100/BF16 datasheet figure above (said as assumed)."""
    cost = None
    if ctx.store.has_files("replay_runs"):
        df = ctx.sql("SELECT cost_json FROM replay_runs WHERE run_id = ? ORDER BY created_at_ns DESC LIMIT 1",
                     [ctx.run_id])
        if df.height and df["cost_json"][0]:
            try:
                c = json.loads(df["cost_json"][0])
                cost = (float(c["a_ns"]), float(c["b_ns"]), str(c.get("source", "")), "the stored replay's")
            except (ValueError, KeyError, TypeError):
                cost = None
    if cost is None:
        try:
            m = ctx.facade.cost_model()
            cost = (float(m.a_ns), float(m.b_ns), str(m.source), "the replay's")
        except Exception:   # no shape to build a cost model on: the datasheet figure, said as assumed
            cost = None
    if cost is None or cost[0] <= 0 or cost[1] <= 0:
        return (WEIGHT_BOUND_TOKENS, f"{BOUND_GPU}, {BOUND_DTYPE}, assumed",
                f"{BOUND_WHO} (assumed: no replay cost model for this run)")
    a, b, src, whose = cost
    short = src.split(":", 1)[0].split(";", 1)[0].strip() or "cost model"
    return (max(1, int(round(b / a))), short,
            f"the hardware {whose} cost model uses ({short}: {time_text(b)} to read an expert's weights vs "
            f"{time_text(a)} per token)")


def quantile_from_counts(values: np.ndarray, counts: np.ndarray, q: float) -> float | None:
    """DuckDB's quantile_cont(x, q) (linear between the order statistics around (N-1)·q) of
    a sample given as sorted distinct ``values`` with their ``counts``."""
    total = int(counts.sum())
    if total == 0:
        return None
    h = (total - 1) * q
    lo = int(np.floor(h))
    hi = min(lo + 1, total - 1)
    ends = np.cumsum(counts)                     # index of the last copy of values[i] is ends[i]-1
    v_lo = values[int(np.searchsorted(ends, lo, side="right"))]
    v_hi = values[int(np.searchsorted(ends, hi, side="right"))]
    return float(v_lo + (h - lo) * (v_hi - v_lo))


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    per_layer = ctx.sql(
        "SELECT layer, count(*) AS steps, avg(tokens) AS tokens_per_step, avg(experts_hit) AS experts_hit, "
        "avg(experts_hit_expected) AS experts_hit_expected, avg(per_expert_mean) AS per_expert_mean, "
        "avg(per_expert_median) AS per_expert_median, avg(per_expert_max) AS per_expert_max, "
        "min(per_expert_min) AS per_expert_min FROM tokens_per_expert WHERE run_id = ? GROUP BY layer "
        "ORDER BY layer", [rid])
    if per_layer.height == 0:
        return None
    # one (pseudo-)step: counts over the whole recording, not per forward pass: a per-step bound means nothing
    whole = int(ctx.sql("SELECT count(DISTINCT step) AS n FROM tokens_per_expert WHERE run_id = ?", [rid])["n"][0]) <= 1
    shape = ctx.sql("SELECT num_experts, top_k FROM run_shape WHERE run_id = ?", [rid]).row(0, named=True)
    E, k = shape["num_experts"], shape["top_k"]
    notes = []
    md, term = [], []
    bound, bound_short, bound_who = weight_bound(ctx)
    overall = ctx.sql("SELECT avg(tokens) AS b, avg(per_expert_mean) AS m, avg(per_expert_median) AS med, "
                      "avg(per_expert_max) AS mx, avg(experts_hit) AS hit, avg(experts_hit_expected) AS hit_exp "
                      "FROM tokens_per_expert WHERE run_id = ? AND assignments > 0", [rid]).row(0, named=True)
    if k is None:
        notes.append("top_k is unknown for this run: tokens per step and the expected experts touched cannot be "
                     "derived (only token-expert assignments are known).")
    if overall["m"] is not None:
        if whole:   # one aggregate count per (layer, expert): averages over layers, not over steps
            n_l = int(ctx.sql("SELECT count(*) AS n FROM tokens_per_expert WHERE run_id = ? AND assignments > 0",
                              [rid])["n"][0])
            text = (f"Over the whole recording an expert got **{overall['m']:,.0f}** tokens on average (of the {E} "
                    f"experts of a layer, averaged over the {n_l} layers with routed tokens: median expert "
                    f"{overall['med']:,.0f}, busiest {overall['mx']:,.0f}). ")
        else:
            b = f"{overall['b']:.0f} tokens per step, so each" if overall["b"] is not None else "Each"
            text = (f"{b} of the {E} experts got **{overall['m']:.1f}** tokens per step on average "
                    f"(median expert {overall['med']:.1f}, busiest {overall['mx']:.1f}). ")
        if overall["hit_exp"] is not None and not whole:
            text += (f"A step touched {overall['hit']:.1f} experts per layer; uniform routing would touch "
                     f"{overall['hit_exp']:.1f} (E·(1−(1−k/E)^B)).")
        md.append(text)
        term.append(text.replace("**", ""))
        if whole:
            line = ("The counts cover the whole recording as one aggregate step, so they say nothing about how many "
                    "tokens an expert's GEMM saw per forward pass (and whether it was weight-read bound).")
            md.append("")
            md.append(line)
            term.append(line)
        elif overall["med"] < bound:
            line = (f"The median expert saw fewer than {bound} tokens per step: on {bound_who} its "
                    "GEMM would be bound by reading the expert's weights, not by arithmetic, so extra tokens on a "
                    "cold expert would be nearly free and the hottest expert's count would set the time.")
            md.append("")
            md.append(line)
            term.append(line)
    md.append("")
    md.append("Per layer (means over steps; per-expert figures count experts that received nothing as 0):")
    md.append("")
    md.append(md_table(per_layer, float_fmt="{:.1f}", max_rows=64))

    figs = []
    # distribution of tokens per (expert, step) over the whole run, binned in SQL
    # view expert_token_hist: how many (expert, step, layer) rows have each token count; the
    # 99.9th percentile and the histogram come from these counts (an exact quantile_cont over a
    # billion rows would hold them all in memory)
    vc = ctx.sql("SELECT tokens, sum(pairs) AS n FROM expert_token_hist WHERE run_id = ? GROUP BY tokens "
                 "ORDER BY tokens", [rid])
    vals = vc["tokens"].to_numpy().astype(np.float64) if vc.height else np.zeros(0)
    ns = vc["n"].to_numpy().astype(np.int64) if vc.height else np.zeros(0, dtype=np.int64)
    mx = float(vals[-1]) if vals.size else None
    if mx:
        q = quantile_from_counts(vals, ns, 0.999)
        top = max(float(q or mx), 1.0)
        width = float(max(1, int(np.ceil(top / 60))))   # integer counts: integer-wide bins
        nb = int(np.ceil((top + 1) / width))
        n_layers_steps = ctx.sql("SELECT count(*) AS n FROM tokens_per_expert WHERE run_id = ?", [rid])["n"][0]
        counts = np.zeros(nb + 1)
        np.add.at(counts, np.minimum(np.floor(vals / width).astype(np.int64), nb), ns)
        missing = int(n_layers_steps) * int(E) - int(counts.sum())
        counts[0] += max(missing, 0)  # experts without rows received 0 tokens
        centers = (np.arange(nb + 1) + 0.5) * width
        fig, ax = plots.figure(8, 4)
        ax.bar(centers[:nb], counts[:nb], width=width * 0.95, color=plots.color_of("measured"))
        if counts[nb]:
            ax.bar(centers[nb], counts[nb], width=width * 0.95, color=plots.color_of("highlight"),
                   label=f"{nb * width:.0f} or more (busiest 0.1%)")
        bound_shown = bound <= top * 1.1 and not whole
        if bound_shown:
            ax.axvline(bound, color="black", linestyle="--", linewidth=1,
                       label=f"{bound} tokens: below, weight-read bound\n({bound_short})")
        if counts[nb] or bound_shown:
            ax.legend(frameon=False, loc="upper right")
        ax.set_xlim(0, (nb + 1) * width)
        ax.set_title("Tokens per expert per step (all layers)" if not whole else
                     "Tokens per expert over the whole recording (one aggregate step, all layers)")
        ax.set_xlabel("tokens an expert received in one step (token-expert assignments)" if not whole else
                      "tokens an expert received over the recording (token-expert assignments)")
        ax.set_ylabel("(expert, step, layer) count")
        ax.grid(True, alpha=0.3)
        if whole:
            cap = ("Tokens per expert summed over the whole recording (one aggregate step), over every expert and "
                   "layer (experts that got nothing count at 0); not per forward pass, so no per-step bound applies.")
        else:
            cap = ("How many tokens an expert's GEMM saw per step, over every expert, step and layer (experts that "
                   f"got nothing count at 0). Below about {bound} tokens an expert GEMM on {bound_who} "
                   "would be bound by reading its weights"
                   + (" (dashed line)." if bound_shown else f"; every count here is below {top:.0f}."))
        figs.append(Figure(plots.save(fig, ctx.outdir / "experts_tokens_hist.png"), cap))
    return Section(key="experts", title="Tokens per expert", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)

"""Attention data-parallel balance: tokens per DP rank per step (views dp_balance and
dp_balance_summary), and what the slowest DP rank costs at the barrier."""
from __future__ import annotations

from .. import plots
from ..base import Figure, ReportContext, Section, md_table

#: the model behind every barrier time of this section (the views' time_model column)
MODEL = "tokens-proportional estimate"

ORDER = 41

def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    n = ctx.sql("SELECT count(*) AS rows, count(num_tokens) AS with_tokens, count(DISTINCT rank) AS ranks "
                "FROM steps WHERE run_id = ?", [rid]).row(0, named=True)
    title = "Attention data-parallel balance"
    if not n["rows"]:
        return None
    why = None
    if not n["with_tokens"]:
        why = "this source records no tokens per (step, rank) (steps.num_tokens is empty)."
    elif n["ranks"] <= 1:
        why = "the run has one rank: balance across data-parallel ranks needs more than one."
    if why:
        text = f"Attention-DP balance: unknown — {why}"
        return Section(key="dp_balance", title=title, markdown=text, terminal=text)
    s = ctx.sql("SELECT * FROM dp_balance_summary WHERE run_id = ?", [rid]).row(0, named=True)
    if not s["steps_defined"]:
        text = f"Attention-DP balance: undefined — none of the {s['steps']} steps had tokens on any rank."
        return Section(key="dp_balance", title=title, markdown=text, terminal=text)
    head = ctx.facade.dp_balance_line() or ""
    text = (head[0].upper() + head[1:] + ". Balance = mean / max tokens per DP rank: TensorRT-LLM's attention-DP "
            "balance and vLLM's balancedness form; 1 is even. "
            f"Token-weighted over the run: **{s['balance_overall']:.3f}**."
            + (f" Rank {s['slowest_rank_mode']} was the slowest in {100 * s['slowest_rank_share']:.0f}% of the "
               f"{s['steps_uneven']} uneven steps." if s["steps_uneven"] else " Every step was even."))
    notes = [f"Barrier cost is a {MODEL}: a DP rank's time is taken to grow in proportion to its tokens, so "
             "balancing would save 1 − balance of the step. It is an upper bound where part of the step does not "
             "scale with the rank's own tokens (the MoE layers after the dispatch), and has no fitted error band."]
    if s["steps"] > s["steps_defined"]:
        notes.append(f"{s['steps'] - s['steps_defined']} steps had no tokens on any rank: balance undefined there "
                     "(left out, not counted as 1).")
    if not s["timed_steps"]:
        notes.append("No step times were recorded: the barrier cost is a share of the step, not a time.")
    worst = ctx.sql("SELECT step, dp_ranks, dummy_ranks, max_tokens, mean_tokens, balance, slowest_rank, "
                    "barrier_share, barrier_ns FROM dp_balance WHERE run_id = ? AND balance IS NOT NULL "
                    "ORDER BY balance, step LIMIT 10", [rid])
    md = [text, "", "Least balanced steps:", "", md_table(worst)]
    figs = []
    per = ctx.sql("SELECT step, balance FROM dp_balance WHERE run_id = ? AND balance IS NOT NULL ORDER BY step", [rid])
    if per.height > 1:
        figs.append(Figure(plots.lines(
            ctx.outdir / "dp_balance_per_step.png", [("balance", per["step"].to_numpy(), per["balance"].to_numpy())],
            title="Attention-DP balance per step (mean / max tokens per DP rank)", xlabel="step",
            ylabel="balance (1 = even)", hlines=[(float(s["balance_overall"]), "token-weighted")],
            markers=per.height <= 60),
            "Mean over max tokens per data-parallel rank, per step; dashed: the run's token-weighted balance."))
    return Section(key="dp_balance", title=title, markdown="\n".join(md), terminal=text.replace("**", ""),
                   figures=figs, notes=notes)

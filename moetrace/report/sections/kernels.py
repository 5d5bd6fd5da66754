"""Kernel time by kind: where a profiler run's device time went, per rank and step.

Reads the views kernel_time and kernel_busy (analyze/sql/42_kernel_time.sql), whose kinds
are those the one classifier gave at ingest (the same as ``moetrace kernels``). Every
profiler report gets this section, MoE or not, single GPU or many.
"""
from __future__ import annotations

import polars as pl

from ...units import share_text
from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 35
KIND_NAMES = {"expert_gemm": "expert GEMMs", "attention": "attention", "compute_other": "other compute",
              "dispatch": "dispatch", "combine": "combine", "a2a_other": "all-to-all helpers",
              "comm_other": "other collectives", "memcpy": "memcpy", "memset": "memset", "idle": "idle"}
MAX_ROWS = 40


def breakdown(ctx: ReportContext) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(kind totals over the run with their share of kernel time, per (rank, step) rows)."""
    kt = ctx.sql("SELECT rank, step, kind, spans, kernel_ns FROM kernel_time WHERE run_id = ?", [ctx.run_id])
    tot = (kt.group_by("kind").agg(pl.col("spans").sum(), pl.col("kernel_ns").sum())
           .with_columns((pl.col("kernel_ns") / pl.col("kernel_ns").sum()).alias("share"))
           .sort("kernel_ns", descending=True))
    return tot, kt


def build(ctx: ReportContext) -> Section | None:
    rid = ctx.run_id
    tot, kt = breakdown(ctx)
    if tot.height == 0:
        return None
    busy = ctx.sql("SELECT rank, step, busy_ns, step_ns FROM kernel_busy WHERE run_id = ? ORDER BY rank, step", [rid])
    host = bool(ctx.sql("SELECT bool_and(device < 0) AS h FROM spans WHERE run_id = ?", [rid])["h"][0])
    what = "host time (CPU-only trace: top-level CPU ops and host collectives)" if host else "kernel time"
    n_ranks, n_steps = kt["rank"].n_unique(), kt["step"].drop_nulls().n_unique()
    total = int(tot["kernel_ns"].sum())
    parts = ", ".join(f"{KIND_NAMES.get(k, k)} {share_text(s)}" for k, s in zip(tot["kind"], tot["share"]))
    outside = int(kt.filter(pl.col("step").is_null())["kernel_ns"].sum())
    head = (f"By kind, over {n_ranks} rank{'s' if n_ranks != 1 else ''} and {n_steps} "
            f"step{'s' if n_steps != 1 else ''}"
            + (f" (plus {outside / 1e6:.2f} ms outside any step)" if outside else "")
            + f": **{parts}** of the {total / 1e6:.2f} ms of {what} "
            "(summed over streams; kinds from the same classifier as `moetrace kernels`).")
    win = busy["step_ns"].drop_nulls()
    if win.len() and win.sum() > 0:
        idle = int((busy["step_ns"] - busy["busy_ns"]).drop_nulls().sum())
        head += (f" No {'op' if host else 'kernel'} ran for {idle / 1e6:.2f} ms "
                 f"({100 * idle / win.sum():.1f}%) of the {win.sum() / 1e6:.2f} ms of step windows.")
        if idle > 0.5 * win.sum():
            head += (" That idle time is as the trace records it: kernels a profiler did not capture (for "
                     "example inside graph replays it does not expand) count as idle.")
    gap = ctx.facade.expert_gemm_gap(ctx.sql)
    if gap:   # an MoE trace whose expert GEMMs no rule found: unknown, not 0
        head += " " + gap.split(": ", 1)[1]
    kinds = tot["kind"].to_list()
    # nulls filled in the kinds only: a null step (time outside any step) filled with 0 became a
    # second step-0 row per rank
    wide = (kt.pivot(on="kind", index=["rank", "step"], values="kernel_ns", aggregate_function="sum")
            .with_columns(pl.col(k).fill_null(0) for k in kinds)
            .join(busy, on=["rank", "step"], how="left").sort(["rank", "step"]))
    show = wide.filter(pl.col("step").is_not_null()).select("rank", "step", (pl.col("step_ns") / 1e6).round(3).alias("step_ms"),
                       ((pl.col("step_ns") - pl.col("busy_ns")) / 1e6).round(3).alias("idle_ms"),
                       *[(100 * pl.col(k) / pl.sum_horizontal(kinds)).round(1).alias(f"{k} %") for k in kinds])
    md = [head, "", "Share of kernel time by kind per rank and step (%; idle_ms: no kernel running in the step window):",
          "", md_table(show, float_fmt="{:.1f}", max_rows=MAX_ROWS)]
    term = [head.replace("**", "")]
    figs = []
    by_rank = n_ranks > 1
    g = (wide.group_by("rank").agg([pl.col(k).sum() for k in kinds]).sort("rank") if by_rank else wide)
    labels = [f"rank {r}" for r in g["rank"]] if by_rank else [f"step {s}" for s in g["step"]]
    g = g.head(MAX_ROWS)
    path = plots.stacked(ctx.outdir / "kernel_time_by_kind.png", labels[:MAX_ROWS],
                         {k: g[k].to_numpy() / 1e6 for k in kinds},
                         title=("Kernel" if not host else "Host op") + " time by kind "
                         + ("per rank (all steps)" if by_rank else f"per step (rank {kt['rank'][0]})"),
                         xlabel="ms (summed over streams)", ylabel="rank" if by_rank else "step")
    figs.append(Figure(path, f"Where the {what} went, by kind" + (" per rank, summed over steps" if by_rank else
                                                                  " per step") + "; kinds from the kernel classifier."))
    notes = [gap] if gap else []
    if "compute_other" in kinds and float(tot.filter(pl.col("kind") == "compute_other")["share"][0]) > 0.5 \
            and not host:
        notes.append("Most kernel time is 'other compute': kernels the classifier has no rule for. "
                     "`moetrace kernels STORE --kind compute_other` lists them; add rules with --kernel-rules.")
    return Section(key="kernels", title="Kernel time by kind", markdown="\n".join(md), terminal="\n".join(term),
                   figures=figs, notes=notes)

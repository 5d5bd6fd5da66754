"""Engine-reported balancedness (vLLM / SGLang EPLB log lines) and rebalance events."""
from __future__ import annotations

import json

import numpy as np

from .. import plots
from ..base import Figure, ReportContext, Section, md_table

ORDER = 45


def build(ctx: ReportContext) -> Section | None:
    if not ctx.store.has_files("balancedness"):
        return None
    rid = ctx.run_id
    # imbalance: max/mean as ingest converted it (moetrace.domain.balance); a store written before that column
    # existed reads it empty, and 1/balancedness stands in (vLLM's and SGLang's figures are mean/max)
    b = ctx.sql("SELECT engine, event, step, ts_ns, line, balancedness, "
                "coalesce(imbalance, 1.0 / nullif(balancedness, 0)) AS imbalance, avg_tokens, max_tokens, duration_s, "
                "utilization, threshold, is_profile FROM balancedness WHERE run_id = ? "
                "ORDER BY file, line", [rid])   # scrape folders: many files (named by time)
    if b.height == 0:
        return None
    # an empty window (vLLM max_tokens=0) has no balancedness: null, never 0 (0 would read as perfectly unbalanced)
    bal = b.filter((b["event"] == "balancedness") & (b["balancedness"] > 0)).drop_nulls("balancedness")
    empty = int(((b["event"] == "balancedness") & b["balancedness"].is_null()).sum())
    ev = b.filter(b["event"].is_in(["rebalance_start", "rebalance_end", "rebalance_skip"]))
    # vLLM metrics scrapes also give per-layer spread gauges (events balancedness_min / _p50 / _p90)
    spread = {k: b.filter(b["event"] == f"balancedness_{k}").drop_nulls("balancedness")["balancedness"]
              for k in ("min", "p50", "p90")}
    engines = ", ".join(sorted(set(b["engine"].to_list())))
    md, notes, figs = [], [], []
    if bal.height:
        v = bal["balancedness"].to_numpy()
        what = (f"{bal.height} scrape intervals" if ctx.run.get("collector") == "prometheus"
                else f"{bal.height} passes")
        inv = bal["imbalance"].to_numpy()
        text = (f"The engine ({engines}) logged balancedness for {what}: mean **{v.mean():.3f}**, "
                f"p10 {np.percentile(v, 10):.3f}, worst {v.min():.3f} (1.0 = every rank equally loaded; "
                f"1/balancedness, the busiest rank's load over the mean rank's, is {inv.mean():.2f}× on average and "
                f"{inv.max():.2f}× at worst"
                + ("; for SGLang's per-layer average only approximately" if "sglang" in engines else "") + ")."
                + (f" {empty} passes routed no token: balancedness undefined there, left out." if empty else ""))
        md.append(text)
        x = bal["step"].to_numpy() if bal["step"].null_count() == 0 else np.arange(bal.height)
        figs.append(Figure(plots.lines(ctx.outdir / "balancedness_log.png", [("balancedness", x, v)],
                                       title="Engine-reported balancedness per pass",
                                       xlabel="step / forward_pass_id" if bal["step"].null_count() == 0
                                       else "balancedness line (order in the log)",
                                       ylabel="mean/max tokens per rank", markers=bal.height <= 200),
                           "Balancedness as the engine logged it (vLLM: avg/max tokens per rank; SGLang: per-layer "
                           "(mean+1e-5)/(max+1e-5) over GPUs, averaged over layers)."))
    else:
        md.append(f"No balancedness lines in the log ({engines}); only rebalance events.")
    if any(v.len() for v in spread.values()):
        md.append("Across MoE layers (vLLM EPLB gauges, mean over scrapes): "
                  + ", ".join(f"{name} {spread[k].mean():.3f}" for k, name in
                              (("min", "worst layer"), ("p90", "10th percentile"), ("p50", "median")) if spread[k].len())
                  + ".")
    if ev.height:
        counts = {k: int((ev["event"] == k).sum()) for k in ("rebalance_start", "rebalance_end", "rebalance_skip")}
        dur = ev.filter(ev["event"] == "rebalance_end")["duration_s"].drop_nulls()
        line = (f"Rebalances: {counts['rebalance_end']} finished ({counts['rebalance_start']} started), "
                f"{counts['rebalance_skip']} skipped")
        if dur.len():
            line += f"; rebalance time total {dur.sum():.2f} s, longest {dur.max():.2f} s"
        md.append(line + ".")
        md += ["", md_table(ev.select("line", "engine", "event", "step", "duration_s", "utilization", "threshold",
                                      "is_profile"), max_rows=20)]
        if ev["is_profile"].fill_null(False).any():
            notes.append("vLLM's '(profile)' rearrangement is the startup pass, not a load-driven rebalance.")
    meta = json.loads(ctx.run.get("meta_json") or "{}")
    lc = meta.get("line_counts")
    if lc:
        notes.append(f"Log lines: {lc['lines']} read, {lc['matched']} matched, {lc['malformed']} carried an EPLB "
                     f"marker but did not parse (skipped), {lc['unrelated']} unrelated.")
    text = "\n".join(md)
    return Section(key="balancedness", title="Engine-reported balancedness", markdown=text,
                   terminal=text.replace("**", ""), figures=figs, notes=notes)


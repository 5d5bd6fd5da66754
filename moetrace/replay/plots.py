"""Plots of drift and sweeps (matplotlib, Agg). Computing lives elsewhere: these only draw."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def drift_plot(d: dict, path) -> Path:
    """Imbalance over time for the static, re-planned and oracle plans."""
    plt = _plt()
    s = d["series"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    for k, style in (("static", "-"), ("replan", "-"), ("oracle", "--")):
        ax.plot(s["step"], s[k], style, lw=1.2,
                label=f"{k} (mean {d[k]['mean_imbalance']:.3f}, moved {d[k]['moved_experts']})")
    ax.set_xlabel("step")
    ax.set_ylabel("max/mean rank tokens (mean over layers)")
    ax.set_title(f"{d['policy']}: re-plan every {d['every']} steps from the last {d['window']}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    ra = d.get("replan_by_age")
    if ra:
        ax2.plot(ra["age"], ra["mean_imbalance"], "o-", color="C1", label="re-planned plan")
        ax2.axhline(d["oracle"]["mean_imbalance"], color="C2", ls="--", lw=1, label="oracle (mean)")
        ax2.set_xlabel("steps since the plan was fitted")
        ax2.set_ylabel("mean max/mean")
        ax2.set_title("how fast a fresh plan goes stale")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def sweep_plot(rows: list[dict], path) -> Path:
    """Predicted step time against extra memory (replica budgets) and bytes moved (intervals)."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rep = [r for r in rows if r.get("replan_every") is None and "skipped" not in r]
    itv = [r for r in rows if r.get("replan_every") is not None and "skipped" not in r]
    if rep:
        a.plot([r["extra_mem_per_rank_bytes"] / 2**30 for r in rep], [r["predicted_step_ns"] / 1e6 for r in rep], "o-")
        for r in rep:
            a.annotate(f"+{r['replicas']}", (r["extra_mem_per_rank_bytes"] / 2**30, r["predicted_step_ns"] / 1e6))
    a.set_xlabel("extra expert memory per rank (GiB)")
    a.set_ylabel("predicted MoE time per step (ms)")
    a.set_title("replica budget")
    if itv:
        b.plot([r["moved_bytes"] / 2**30 for r in itv], [r["predicted_step_ns"] / 1e6 for r in itv], "o-")
        for r in itv:
            b.annotate(f"every {r['replan_every']}", (r["moved_bytes"] / 2**30, r["predicted_step_ns"] / 1e6))
    b.set_xlabel("bytes moved by re-plans (GiB)")
    b.set_title("re-plan interval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

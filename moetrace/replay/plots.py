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


def decision_plot(rows, path) -> Path:
    """The operator's decision table (``moetrace sweep``): net predicted time per step
    against extra expert memory per rank (left) and against moved GiB per hour (right),
    one marker per row, the recorded placement as a dashed line. Axes start at zero;
    labels sit beside their markers (offset, never on them). Report plotting style."""
    from ..report.plots import _apply_style, figure, save

    ok = [r for r in rows if r.skipped is None and r.net_ms is not None]
    fig, _ = figure(12.0, 4.6)
    fig.clear()
    axes = fig.subplots(1, 2)
    rec = next((r.recorded_ms for r in ok), None)
    for ax, xkey, xlabel in ((axes[0], "extra_mem_gib_per_rank", "extra expert memory per rank (GiB)"),
                             (axes[1], "moved_gib_per_hour", "expert weights moved (GiB per hour of predicted time)")):
        _apply_style(ax)
        groups = {}
        for r in ok:
            groups.setdefault("static" if r.replan_every is None else f"every {r.replan_every}", []).append(r)
        for i, (name, rs) in enumerate(sorted(groups.items())):
            xs = [getattr(r, xkey) or 0.0 for r in rs]
            ax.plot(xs, [r.net_ms for r in rs], "o", color=f"C{i}", label=name)
            for x, r in zip(xs, rs):
                ax.annotate(f"+{r.replicas}, w{r.window}: {r.verdict}", (x, r.net_ms), textcoords="offset points",
                            xytext=(6, 4), fontsize=7, color=f"C{i}")
        if rec is not None:
            ax.axhline(rec, color="grey", ls="--", lw=1, label=f"recorded {rec:.3f} ms")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0, top=max([r.net_ms for r in ok] + [rec or 0]) * 1.15 if ok else 1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("net predicted MoE time per step (ms)")
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    axes[0].set_title("replica budget: net time vs memory")
    axes[1].set_title("re-plan interval: net time vs bytes moved")
    return save(fig, path)

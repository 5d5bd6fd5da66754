"""Shared matplotlib helpers for report sections (Agg backend: no display needed).

Every helper takes plain numpy arrays, draws one figure, writes a PNG and returns its
path. Computing stays in SQL; these only draw.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 110
STYLE = {
    "figure.facecolor": "white",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
}


def figure(width: float = 8.0, height: float = 4.0):
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    return fig, ax


def save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _apply_style(ax):
    for k in ("top", "right"):
        ax.spines[k].set_visible(False)
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)


def bars(path, labels, values, *, title: str, xlabel: str, ylabel: str, ref_line: float | None = None,
         ref_label: str | None = None, highlight: int | None = None, errors=None, color: str = "#4C72B0",
         width: float | None = None, annotate: bool = False):
    """Vertical bars, one per label; ``highlight`` (an index, a list of indices, or "max")
    draws those bars in red. "max" marks every bar tied for the largest value, so two equal
    bars never get two colours."""
    n = len(values)
    fig, ax = figure(width or min(14.0, max(6.0, 0.22 * n + 3)), 4.0)
    _apply_style(ax)
    x = np.arange(n)
    colors = [color] * n
    for i in highlighted(values, highlight):
        colors[i] = "#C44E52"
    ax.bar(x, values, color=colors, yerr=errors, capsize=2 if errors is not None else 0, width=0.8)
    if ref_line is not None:
        ax.axhline(ref_line, color="black", linestyle="--", linewidth=1, label=ref_label)
        if ref_label:
            ax.legend(loc="upper right", frameon=False)
            lo, hi = ax.get_ylim()             # headroom: the legend must not cover the tallest bar
            ax.set_ylim(lo, hi + 0.15 * (hi - lo))
    step = max(1, int(np.ceil(n / 40)))
    ax.set_xticks(x[::step])
    ax.set_xticklabels([str(labels[i]) for i in range(0, n, step)], rotation=90 if n > 16 else 0)
    ax.set_xlim(-0.7, n - 0.3)
    if annotate and n <= 40:
        for xi, v in zip(x, values):
            ax.annotate(f"{v:.2f}", (xi, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return save(fig, path)


def highlighted(values, highlight) -> list[int]:
    """Indices to draw in red: ``highlight`` as an index, indices, or "max" (all ties)."""
    n = len(values)
    if highlight is None or n == 0:
        return []
    if isinstance(highlight, str):
        v = np.asarray(values, dtype=float)
        if highlight != "max" or not np.isfinite(v).any():
            return []
        return [int(i) for i in np.flatnonzero(v == np.nanmax(v))]
    idx = [highlight] if np.isscalar(highlight) else list(highlight)
    return [int(i) for i in idx if 0 <= int(i) < n]


def heatmap(path, matrix: np.ndarray, *, title: str, xlabel: str, ylabel: str, cbar_label: str,
            x_ticks=None, y_ticks=None, y_range: tuple[float, float] | None = None,
            groups: list[tuple[int, str]] | None = None, mark_group: int | None = None):
    """A [rows, cols] matrix; rows go up the y axis (steps), cols along x (experts).

    ``y_range`` (first, last): the rows' values (e.g. steps) so that the y ticks are round
    numbers of that unit rather than row indices. ``groups``: (first column, label) of
    consecutive column groups (experts of one rank): drawn as boundaries with the labels
    on the top axis; ``mark_group`` outlines one group (e.g. the straggler rank)."""
    fig, ax = figure(9.0, 4.4)
    ax.grid(False)
    m = np.asarray(matrix, dtype=float)
    vmax = np.nanpercentile(m, 99.5) if np.isfinite(m).any() and np.nanmax(m) > 0 else 1.0
    rows, cols = m.shape
    extent = None
    if y_range is not None:
        a, b = float(y_range[0]), float(y_range[1])
        half = (b - a) / max(rows - 1, 1) / 2 if rows > 1 else 0.5
        extent = (-0.5, cols - 0.5, a - half, b + half)
    im = ax.imshow(m, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                   vmin=0, vmax=max(vmax, 1e-12), extent=extent)
    if y_range is not None:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    cb = fig.colorbar(im, ax=ax, pad=0.01)
    cb.set_label(cbar_label)
    if x_ticks is not None:
        ax.set_xticks(x_ticks[0])
        ax.set_xticklabels(x_ticks[1])
    if y_ticks is not None:
        ax.set_yticks(y_ticks[0])
        ax.set_yticklabels(y_ticks[1])
    if groups:
        edges = [g[0] for g in groups] + [cols]
        for e in edges[1:-1]:
            ax.axvline(e - 0.5, color="#00E5FF", linewidth=0.5, alpha=0.7)
        top = ax.secondary_xaxis("top")
        step = max(1, int(np.ceil(len(groups) / 16)))
        centers = [(edges[i] + edges[i + 1] - 1) / 2 for i in range(len(groups))]
        top.set_xticks(centers[::step])
        top.set_xticklabels([g[1] for g in groups][::step], fontsize=7)
        top.tick_params(length=0)
        if mark_group is not None and 0 <= mark_group < len(groups):
            lo, hi = edges[mark_group] - 0.5, edges[mark_group + 1] - 0.5
            ax.axvspan(lo, hi, fill=False, edgecolor="#00FF7F", linewidth=1.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return save(fig, path)


def lines(path, series: list[tuple[str, np.ndarray, np.ndarray]], *, title: str, xlabel: str, ylabel: str,
          logx: bool = False, hlines: list[tuple[float, str]] | None = None, markers: bool = True):
    """Several (label, x, y) series on one axis; ``hlines`` draws dashed reference levels."""
    fig, ax = figure(8.0, 4.4)
    _apply_style(ax)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, x, y) in enumerate(series):
        c = colors[i % len(colors)]
        ax.plot(x, y, marker="o" if markers else None, markersize=4, label=label, color=c)
        if hlines and i < len(hlines) and hlines[i] is not None:
            level, hl = hlines[i]
            ax.axhline(level, color=c, linestyle="--", linewidth=1, alpha=0.8, label=hl)
    if logx:
        ax.set_xscale("log", base=2)
    return _finish(fig, ax, path, title, xlabel, ylabel, legend_right=bool(series))


def _finish(fig, ax, path, title: str, xlabel: str, ylabel: str, legend_right: bool = False):
    """Title, axis labels, the legend outside on the right (inside it covered the data, often
    the last, largest-batch point), and save."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend_right:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    return save(fig, path)


def plateau(path, series, *, title: str, xlabel: str, ylabel: str):
    """Imbalance against tokens per batch: per layer, (label, tokens, merged, same_steps,
    structural). Solid = merged batches, dotted = the same steps one at a time, dashed =
    structural level. The y axis starts at 1.0 (perfect balance), so a 3% wiggle on an
    8-step run looks like 3%, not like a cliff."""
    fig, ax = figure(8.0, 4.4)
    _apply_style(ax)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    top = 1.0
    for i, (label, x, merged, same, structural) in enumerate(series):
        c = colors[i % len(colors)]
        ax.plot(x, merged, marker="o", markersize=4, color=c, alpha=0.75, label=f"{label}: merged batches")
        # on top and thicker: where it coincides with the solid line, merging changed nothing
        ax.plot(x, same, linestyle=":", linewidth=2.2, color="black", alpha=0.6, zorder=3,
                label="each: same steps one at a time" if i == 0 else None)
        top = max(top, float(np.nanmax(merged)), float(np.nanmax(same)))
        if structural is not None:
            ax.axhline(structural, color=c, linestyle="--", linewidth=1, alpha=0.8, label=f"{label}: structural")
            top = max(top, structural)
    ax.set_xscale("log", base=2)
    ax.set_ylim(1.0 - 0.02 * max(top - 1.0, 0.05), top + 0.08 * max(top - 1.0, 0.05))
    return _finish(fig, ax, path, title, xlabel, ylabel, legend_right=bool(series))


#: one colour per span kind, the same in every figure
KIND_COLORS = {"expert_gemm": "#4C72B0", "attention": "#55A868", "compute_other": "#8C8C8C",
               "dispatch": "#DD8452", "combine": "#C44E52", "a2a_other": "#937860", "comm_other": "#8172B3",
               "memcpy": "#DA8BC3", "memset": "#CCB974", "idle": "#FFFFFF"}


def stacked(path, labels, parts: dict[str, np.ndarray], *, title: str, xlabel: str, ylabel: str,
            colors: dict[str, str] | None = None):
    """Horizontal stacked bars: one bar per label, one segment per part (legend only for
    parts with a non-zero segment, each with its share of the whole, so a segment too thin
    to see still says how small it is)."""
    n = len(labels)
    fig, ax = figure(9.0, min(9.0, 1.6 + 0.32 * n))
    _apply_style(ax)
    y = np.arange(n)
    left = np.zeros(n)
    colors = colors or KIND_COLORS
    whole = float(sum(np.asarray(v, dtype=float).sum() for v in parts.values())) or 1.0
    for name, vals in parts.items():
        vals = np.asarray(vals, dtype=float)
        if not vals.any():
            continue
        share = vals.sum() / whole
        ax.barh(y, vals, left=left, color=colors.get(name, None), edgecolor="white", linewidth=0.4,
                label=f"{name} ({'<0.1' if share < 0.0005 else f'{100 * share:.1f}'}%)")
        left += vals
    ax.set_yticks(y)
    ax.set_yticklabels([str(v) for v in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, float(left.max()) * 1.02 if n and left.max() > 0 else 1.0)
    return _finish(fig, ax, path, title, xlabel, ylabel, legend_right=True)


# ----------------------------------------------------------------------------- style helpers
def from_zero(ax, x: bool = False, y: bool = True, headroom: float = 0.12):
    """Start the value axes at zero (a 1.5% difference must look like 1.5%), with headroom
    for labels above the highest point."""
    if y:
        lo, hi = ax.get_ylim()
        ax.set_ylim(0, max(hi, 1e-12) * (1 + headroom))
    if x:
        lo, hi = ax.get_xlim()
        ax.set_xlim(0, max(hi, 1e-12) * (1 + headroom))


def label_points(ax, xs, ys, labels, color=None, fontsize: int = 7):
    """Labels beside markers, offset so they never sit on a marker; alternate above/below
    when neighbours are close."""
    for i, (x, y, t) in enumerate(zip(xs, ys, labels)):
        ax.annotate(str(t), (x, y), textcoords="offset points", xytext=(6, 6 if i % 2 == 0 else -10),
                    fontsize=fontsize, color=color, ha="left", va="bottom" if i % 2 == 0 else "top")


def _gib(b) -> str:
    return "" if b is None else f", {b / 2**30:.2f} GiB moved"


# ----------------------------------------------------------------------------- replay
def drift(path, step, curves: list[tuple[str, np.ndarray, float | None, int | None, int | None]], *,
          title: str, by_age: dict | None = None, oracle_mean: float | None = None):
    """Imbalance over time for the plans of one drift comparison: ``curves`` is (name,
    imbalance per step, mean, expert moves, bytes moved) per plan; the legend and the title
    state the moves each needed. ``by_age`` ({"age": [...], "mean_imbalance": [...]}) adds
    how fast a freshly fitted plan goes stale. One function for the CLI (``replay
    --replan-every --plot``) and the report."""
    if by_age:
        fig, ax = figure(13.0, 4.4)
        fig.clear()
        ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    else:
        fig, ax = figure(9.5, 4.4)
        ax2 = None
    _apply_style(ax)
    styles = {"oracle": "--"}
    for name, y, mean, moved, moved_bytes in curves:
        lab = name + (f" (mean {mean:.3f}×" if mean is not None else " (")
        lab += (f", {moved} expert moves" if moved is not None else "") + _gib(moved_bytes) + ")"
        if name == "oracle":
            lab += " — fitted on the judged steps: a lower bound"
        ax.plot(step, y, styles.get(name, "-"), lw=1.2, label=lab)
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_ylim(bottom=min(1.0, ax.get_ylim()[0]))
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean rank tokens (mean over layers)")
    moves = [(n, m) for n, _, _, m, _ in curves if m and n != "oracle"]
    ax.set_title(title + ("\n" + "; ".join(f"{n}: {m} expert moves" for n, m in moves) if moves else
                          "\nno expert moves"))
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(0, -0.18), ncol=1)
    if ax2 is not None:
        _apply_style(ax2)
        ax2.plot(by_age["age"], by_age["mean_imbalance"], "o-", color="C1", label="re-planned plan")
        if oracle_mean is not None:
            ax2.axhline(oracle_mean, color="C2", ls="--", lw=1, label="oracle (mean)")
        ax2.set_xlabel("steps since the plan was fitted")
        ax2.set_ylabel("mean max / mean")
        ax2.set_title("how fast a fresh plan goes stale")
        ax2.legend(fontsize=8, frameon=False)
    return save(fig, path)


def drift_from_dict(d: dict, path):
    """The drift plot of a ``DriftResult.to_dict(series=True)``."""
    s = d["series"]
    curves = [(k, np.asarray(s[k], dtype=float), d[k].get("mean_imbalance"), d[k].get("moved_experts"),
               d[k].get("moved_bytes")) for k in ("static", "replan", "oracle") if k in s and k in d]
    return drift(path, np.asarray(s["step"]), curves,
                 title=f"{d['policy']}: re-plan every {d['every']} steps from the last {d['window']}",
                 by_age=d.get("replan_by_age"), oracle_mean=d.get("oracle", {}).get("mean_imbalance"))


def decision(rows, path):
    """The operator's decision table (``moetrace sweep``): net predicted time per step
    against extra expert memory per rank (left) and against moved GiB per hour (right),
    one marker per row, the recorded placement as a dashed line. Axes start at zero;
    labels sit beside their markers (offset, never on them)."""
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
            label_points(ax, xs, [r.net_ms for r in rs], [f"+{r.replicas}, w{r.window}: {r.verdict}" for r in rs],
                         color=f"C{i}")
        if rec is not None:
            ax.axhline(rec, color="grey", ls="--", lw=1, label=f"recorded {rec:.3f} ms")
        from_zero(ax, x=True, y=True, headroom=0.15)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("net predicted MoE time per step (ms)")
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    axes[0].set_title("replica budget: net time vs memory")
    axes[1].set_title("re-plan interval: net time vs bytes moved")
    return save(fig, path)


def predicted_vs_measured(path, measured: np.ndarray, predicted: np.ndarray, marked: np.ndarray, *, title: str,
                          xlabel: str, ylabel: str, marked_label: str):
    """Log-log scatter of predictions against measurements with the y = x line; ``marked``
    (a boolean mask) points drawn in orange."""
    fig, ax = figure(5.5, 5.0)
    _apply_style(ax)
    m, p, s = np.asarray(measured, float), np.asarray(predicted, float), np.asarray(marked, bool)
    ax.scatter(m[~s], p[~s], s=12, alpha=0.6, label="rank")
    ax.scatter(m[s], p[s], s=18, alpha=0.8, color="#DD8452", label=marked_label)
    lo = max(min(m.min(), max(p.min(), 1e-3)) * 0.8, 1e-3)
    hi = max(m.max(), p.max()) * 1.2
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return save(fig, path)

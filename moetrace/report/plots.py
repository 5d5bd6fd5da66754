"""Shared matplotlib helpers for report sections (Agg backend: no display needed).

Every helper takes plain numpy arrays, draws one figure, writes a PNG and returns its
path. Computing stays in SQL; these only draw.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# matplotlib writes its font cache under $HOME (~/.config/matplotlib, ~/.cache) unless told
# otherwise: a report reads traces, it does not write into the user's home. A folder of the
# user's own choosing (MPLCONFIGDIR set) is kept.
os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), f"moetrace-mpl-{os.getuid()}"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401
import numpy as np  # noqa: E402

from ..units import gib

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


def fit_titles(fig) -> None:
    """Wrap every axes title (and the figure's) to the width it has, so none is clipped:
    the characters that fit the axes at the title's font size, words never split."""
    import textwrap

    fig_w = fig.get_figwidth()
    for ax in fig.axes:
        title = ax.title
        text = title.get_text()
        if not text:
            continue
        width_in = fig_w * ax.get_position().width
        chars = max(20, int(width_in * 72 / (0.55 * title.get_fontsize())))
        lines = [w for part in text.split("\n") for w in (textwrap.wrap(part, chars, break_long_words=False) or [""])]
        title.set_text("\n".join(lines))
    if getattr(fig, "_suptitle", None) is not None and fig._suptitle.get_text():
        st = fig._suptitle
        chars = max(20, int(fig_w * 72 / (0.55 * st.get_fontsize())))
        st.set_text("\n".join(textwrap.wrap(st.get_text(), chars, break_long_words=False)))


def save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fit_titles(fig)
    fig.tight_layout()
    _savefig(fig, path)
    return path


def _savefig(fig, path: Path) -> None:
    """Save and close ``fig`` through AtomicOutput (no write through a link at ``path``)."""
    from ..output import AtomicOutput

    try:
        with AtomicOutput(path, "plot") as out:
            fig.savefig(out.tmp, dpi=DPI)
    finally:
        plt.close(fig)


def _apply_style(ax):
    for k in ("top", "right"):
        ax.spines[k].set_visible(False)
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)


def bars(path, labels, values, *, title: str, xlabel: str, ylabel: str, ref_line: float | None = None,
         ref_label: str | None = None, highlight: int | None = None, errors=None, color: str | None = None,
         width: float | None = None, annotate: bool = False):
    """Vertical bars, one per label; ``highlight`` (an index, a list of indices, or "max")
    draws those bars in red. "max" marks every bar tied for the largest value, so two equal
    bars never get two colours."""
    n = len(values)
    fig, ax = figure(width or min(14.0, max(6.0, 0.22 * n + 3)), 4.0)
    _apply_style(ax)
    x = np.arange(n)
    colors = [color or KIND_COLORS["measured"]] * n
    for i in highlighted(values, highlight):
        colors[i] = KIND_COLORS["highlight"]
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
            groups: list[tuple[int, str]] | None = None, mark_group: int | None = None,
            vmax: float | None = None, integer_ticks: bool = False):
    """A [rows, cols] matrix; rows go up the y axis (steps), cols along x (experts).

    ``y_range`` (first, last): the rows' values (e.g. steps) so that the y ticks are round
    numbers of that unit rather than row indices. ``groups``: (first column, label) of
    consecutive column groups (experts of one rank): drawn as boundaries with the labels
    on the top axis; ``mark_group`` outlines one group (e.g. the straggler rank). ``vmax``:
    the top of the colour scale (pass the same one to every heatmap of a figure so their
    colours compare; default the 99.5th percentile). ``integer_ticks``: rows and columns are
    integers (ranks): one tick per row/column at its centre (thinned past 32)."""
    fig, ax = figure(9.0, 4.4)
    ax.grid(False)
    m = np.asarray(matrix, dtype=float)
    if vmax is None:
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
    if integer_ticks:
        for n_, set_ in ((cols, ax.set_xticks), (rows, ax.set_yticks)):
            set_(np.arange(0, n_, max(1, int(np.ceil(n_ / 32)))))
    if x_ticks is not None:
        ax.set_xticks(x_ticks[0])
        ax.set_xticklabels(x_ticks[1])
    if y_ticks is not None:
        ax.set_yticks(y_ticks[0])
        ax.set_yticklabels(y_ticks[1])
    if groups:
        edges = [g[0] for g in groups] + [cols]
        for e in edges[1:-1]:
            ax.axvline(e - 0.5, color=KIND_COLORS["boundary"], linewidth=1.1, alpha=1.0)
        top = ax.secondary_xaxis("top")
        step = max(1, int(np.ceil(len(groups) / 16)))
        centers = [(edges[i] + edges[i + 1] - 1) / 2 for i in range(len(groups))]
        top.set_xticks(centers[::step])
        top.set_xticklabels([g[1] for g in groups][::step], fontsize=7)
        top.tick_params(length=0)
        if mark_group is not None and 0 <= mark_group < len(groups):
            lo, hi = edges[mark_group] - 0.5, edges[mark_group + 1] - 0.5
            ax.axvspan(lo, hi, fill=False, edgecolor=KIND_COLORS["window"], linewidth=1.8)
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
        # the solid line is a wide light band, the dotted one a thin dark line drawn over it: where
        # they coincide (merging changed nothing) the dots run inside the band, both visible
        ax.plot(x, merged, marker="o", markersize=6, linewidth=5, color=c, alpha=0.35, zorder=2,
                label=f"{label}: merged batches")
        ax.plot(x, same, linestyle=":", linewidth=1.6, color="black", alpha=0.9, zorder=4,
                label="each: same steps one at a time" if i == 0 else None)
        top = max(top, float(np.nanmax(merged)), float(np.nanmax(same)))
        if structural is not None:
            ax.axhline(structural, color=c, linestyle="--", linewidth=1, alpha=0.8, label=f"{label}: structural")
            top = max(top, structural)
    ax.set_xscale("log", base=2)
    ax.set_ylim(1.0 - 0.02 * max(top - 1.0, 0.05), top + 0.08 * max(top - 1.0, 0.05))
    return _finish(fig, ax, path, title, xlabel, ylabel, legend_right=bool(series))


#: the one palette: one colour per kind, the same in every figure (the report's sections
#: and the replay plots take their colours here, never a literal of their own)
KIND_COLORS = {"expert_gemm": "#4C72B0", "attention": "#55A868", "compute_other": "#8C8C8C",
               "dispatch": "#DD8452", "combine": "#C44E52", "a2a_other": "#937860", "comm_other": "#8172B3",
               "memcpy": "#DA8BC3", "memset": "#CCB974", "idle": "#FFFFFF",
               # all-to-all time no compute hid, and the part compute hid
               "exposed": "#1F1F5C", "hidden": "#B8B8B8",
               # bars of a measured quantity, and the one the text calls out (the worst layer, the straggler)
               "measured": "#4C72B0", "highlight": "#C44E52", "reference": "#000000",
               # lines drawn over a heatmap: an expert-group boundary, a marked step window
               "boundary": "#00E5FF", "window": "#00FF7F"}
#: how a caption names each colour of :data:`KIND_COLORS`
COLOR_NAMES = {"#4C72B0": "blue", "#55A868": "green", "#8C8C8C": "grey", "#DD8452": "orange", "#C44E52": "red",
               "#937860": "brown", "#8172B3": "purple", "#DA8BC3": "pink", "#CCB974": "olive", "#FFFFFF": "white",
               "#1F1F5C": "dark blue", "#B8B8B8": "light grey", "#000000": "black", "#00E5FF": "cyan",
               "#00FF7F": "bright green"}


def color_of(kind: str) -> str:
    """The palette's colour of ``kind``."""
    return KIND_COLORS[kind]


def color_name(kind: str) -> str:
    """The word a caption uses for the colour of ``kind`` ("orange")."""
    return COLOR_NAMES[KIND_COLORS[kind]]


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
BYTE_UNITS = (("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40), ("PiB", 2.0**50))
TIME_UNITS = (("ns", 1.0), ("µs", 1e3), ("ms", 1e6), ("s", 1e9))


def byte_unit(max_bytes: float) -> tuple[str, float]:
    """(name, bytes per unit): the largest binary unit in which ``max_bytes`` reads at least 1
    (so 0.016 MiB reads 16 KiB and 1.1e6 GiB reads 1 PiB)."""
    return _unit(BYTE_UNITS, max_bytes)


def time_unit(max_ns: float) -> tuple[str, float]:
    """(name, ns per unit): the largest of ns, µs, ms, s in which ``max_ns`` reads at least 1."""
    return _unit(TIME_UNITS, max_ns)


def _unit(units, top: float) -> tuple[str, float]:
    top = abs(float(top or 0.0))
    pick = units[0]
    for name, size in units:
        if top >= size:
            pick = (name, size)
    return pick


def place_labels(ax, xs, ys, texts, colors=None, fontsize: int = 7, gap_px: float = 8.0):
    """Text labels beside markers, inside the axes and never overlapping each other: each
    starts right of its point (left of it near the right edge), then overlapping labels are
    pushed apart vertically and kept inside the axes; a thin line joins a moved label to its
    point. Call after the axes' limits and the figure layout are final (display geometry)."""
    fig = ax.figure
    if not texts:
        return []
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    box = ax.get_window_extent(r)
    k = 72.0 / fig.dpi                          # display pixels -> offset points
    colors = colors or [None] * len(texts)
    anns = []
    for x, y, t, c in zip(xs, ys, texts, colors):
        px, _ = ax.transData.transform((x, y))
        a = ax.annotate(str(t), (x, y), xytext=(gap_px * k, 0), textcoords="offset points", ha="left",
                        va="center", fontsize=fontsize, color=c, annotation_clip=False,
                        arrowprops=dict(arrowstyle="-", lw=0.5, color=c or "grey", shrinkA=0, shrinkB=3))
        a.set_in_layout(False)
        w = a.get_window_extent(r).width
        if px + gap_px + w > box.x1 - 2:        # no room on the right: the label goes left of its point
            a.set_ha("right")
            a.xyann = (-gap_px * k, 0)
        anns.append(a)
    for _ in range(300):
        bbs = [a.get_window_extent(r) for a in anns]
        moved = False
        for i in range(len(anns)):
            for j in range(i + 1, len(anns)):
                bi, bj = bbs[i], bbs[j]
                if bi.x1 <= bj.x0 or bj.x1 <= bi.x0 or bi.y1 <= bj.y0 or bj.y1 <= bi.y0:
                    continue
                up, dn = (i, j) if (bi.y0 + bi.y1) >= (bj.y0 + bj.y1) else (j, i)
                push = (min(bi.y1, bj.y1) - max(bi.y0, bj.y0)) / 2 + 1.0
                for idx, sign in ((up, 1), (dn, -1)):
                    ox, oy = anns[idx].xyann
                    anns[idx].xyann = (ox, oy + sign * push * k)
                moved = True
                bbs = [a.get_window_extent(r) for a in anns]
        for a in anns:                           # inside the axes, vertically
            b = a.get_window_extent(r)
            ox, oy = a.xyann
            if b.y1 > box.y1 - 1:
                a.xyann = (ox, oy - (b.y1 - box.y1 + 1) * k)
                moved = True
            elif b.y0 < box.y0 + 1:
                a.xyann = (ox, oy + (box.y0 + 1 - b.y0) * k)
                moved = True
        if not moved:
            break
    return anns


def _moved_label(b) -> str:
    return "" if b is None else f", {gib(b):.2f} GiB moved"


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
        lab += (f", {moved} expert moves" if moved is not None else "") + _moved_label(moved_bytes) + ")"
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


def _extra_gib(r) -> float:
    return float(r.extra_mem_gib_per_rank or 0.0)


def _gib_per_replan(r) -> float:
    """GiB moved per plan change: a static plan changes once (from the recorded placement), a
    re-planned one once per ``replan_every`` judged steps (the first included)."""
    changes = 1 if r.replan_every is None else max(1, -(-int(r.judged_steps) // int(r.replan_every)))
    return float(r.moved_gib or 0.0) / changes


def decision(rows, path):
    """The operator's decision table (``moetrace sweep``): net predicted time per step
    against extra expert memory per rank (left) and against weights moved per hour (right),
    one marker per row labelled with its budget, window and verdict, the recorded placement
    as a dashed line. In the operator's units (ms per step, GiB per plan change), no offset ("1e6") on an
    axis; the time axis spans the values (from 0 it flattened differences of a few percent);
    labels sit inside the axes and never on each other (:func:`place_labels`)."""
    ok = [r for r in rows if r.skipped is None and r.net_ms is not None]
    fig, _ = figure(12.0, 5.0)
    fig.clear()
    axes = fig.subplots(1, 2)
    rec = next((r.recorded_ms for r in ok), None)
    times = [r.net_ms for r in ok] + ([rec] if rec is not None else [])
    tname, tscale = "ms", 1.0               # the operator's unit: ms per step, whatever the size
    groups: dict[str, list] = {}
    for r in ok:
        groups.setdefault("static" if r.replan_every is None else f"re-plan every {r.replan_every}", []).append(r)
    order = sorted(groups, key=lambda g: (g != "static", int(g.rsplit(" ", 1)[1]) if g != "static" else 0))
    panels = ((axes[0], _extra_gib, "extra expert memory per rank (GiB)"),
              (axes[1], _gib_per_replan, "expert weights moved per plan change (GiB)"))
    for ax, xof, xlabel in panels:
        _apply_style(ax)
        pts = []
        for i, name in enumerate(order):
            rs = groups[name]
            xs = [xof(r) for r in rs]
            ys = [r.net_ms * tscale for r in rs]
            ax.plot(xs, ys, "o", color=f"C{i}", label=name, zorder=3)
            pts += [(x, y, f"+{r.replicas}, w{r.window}: {r.verdict}", f"C{i}") for x, y, r in zip(xs, ys, rs)]
        if rec is not None:
            ax.axhline(rec * tscale, color="grey", ls="--", lw=1,
                       label=f"recorded placement {rec * tscale:.3g} {tname}")
        lo, hi = min(times) * tscale, max(times) * tscale
        pad = 0.3 * (hi - lo) if hi - lo > 1e-9 * max(abs(hi), 1e-12) else 0.05 * max(abs(hi), 1e-12)
        ax.set_ylim(lo - pad, hi + pad)
        xmax = max([p[0] for p in pts], default=0.0)
        ax.set_xlim(-0.06 * (xmax or 1.0), 1.08 * (xmax or 1.0))
        for a in (ax.xaxis, ax.yaxis):
            a.set_major_formatter(matplotlib.ticker.ScalarFormatter(useOffset=False))
            a.get_major_formatter().set_scientific(False)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"net predicted MoE time per step ({tname})")
        ax._moetrace_points = pts
    axes[0].set_title("replica budget: net time vs memory")
    axes[1].set_title("re-plan interval: net time vs weights moved")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(handles), 5), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    for ax in axes:
        pts = ax._moetrace_points
        place_labels(ax, [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], [p[3] for p in pts])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _savefig(fig, path)
    return path


def predicted_vs_measured(path, measured: np.ndarray, predicted: np.ndarray, marked: np.ndarray, *, title: str,
                          xlabel: str, ylabel: str, marked_label: str):
    """Log-log scatter of predictions against measurements with the y = x line; ``marked``
    (a boolean mask) points drawn in orange."""
    fig, ax = figure(5.5, 5.0)
    _apply_style(ax)
    m, p, s = np.asarray(measured, float), np.asarray(predicted, float), np.asarray(marked, bool)
    ax.scatter(m[~s], p[~s], s=12, alpha=0.6, label="rank")
    ax.scatter(m[s], p[s], s=18, alpha=0.8, color=KIND_COLORS["highlight"], label=marked_label)
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

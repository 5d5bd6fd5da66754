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
    """Vertical bars, one per label; ``highlight`` (index) draws one bar in red."""
    n = len(values)
    fig, ax = figure(width or min(14.0, max(6.0, 0.22 * n + 3)), 4.0)
    _apply_style(ax)
    x = np.arange(n)
    colors = [color] * n
    if highlight is not None and 0 <= highlight < n:
        colors[highlight] = "#C44E52"
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


def heatmap(path, matrix: np.ndarray, *, title: str, xlabel: str, ylabel: str, cbar_label: str,
            x_ticks=None, y_ticks=None):
    """A [rows, cols] matrix; rows go up the y axis (steps), cols along x (experts)."""
    fig, ax = figure(9.0, 4.2)
    ax.grid(False)
    m = np.asarray(matrix, dtype=float)
    vmax = np.nanpercentile(m, 99.5) if np.isfinite(m).any() and np.nanmax(m) > 0 else 1.0
    im = ax.imshow(m, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                   vmin=0, vmax=max(vmax, 1e-12))
    cb = fig.colorbar(im, ax=ax, pad=0.01)
    cb.set_label(cbar_label)
    if x_ticks is not None:
        ax.set_xticks(x_ticks[0])
        ax.set_xticklabels(x_ticks[1])
    if y_ticks is not None:
        ax.set_yticks(y_ticks[0])
        ax.set_yticklabels(y_ticks[1])
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
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if series:
        # outside the axes, on the right: inside it covered the data (often the last, largest-batch point)
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
        ax.plot(x, merged, marker="o", markersize=4, color=c, label=f"{label}: merged batches")
        ax.plot(x, same, linestyle=":", linewidth=1.2, color=c, label=f"{label}: same steps one at a time")
        top = max(top, float(np.nanmax(merged)), float(np.nanmax(same)))
        if structural is not None:
            ax.axhline(structural, color=c, linestyle="--", linewidth=1, alpha=0.8, label=f"{label}: structural")
            top = max(top, structural)
    ax.set_xscale("log", base=2)
    ax.set_ylim(1.0 - 0.02 * max(top - 1.0, 0.05), top + 0.08 * max(top - 1.0, 0.05))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    return save(fig, path)

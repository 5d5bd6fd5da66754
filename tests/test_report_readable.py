"""The report reads at a glance: figures read back from their matplotlib objects (axis
limits, tick labels, label boxes), and the HTML's text (units, yes/no, emphasis, captions that
the numbers make true). Fast: no store except where a section needs one."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest

from moetrace.report import build as rbuild
from moetrace.report import plots
from moetrace.report.base import md_table
from moetrace.units import time_text as fmt_ns


@pytest.fixture
def keep_figures(monkeypatch):
    """The figures the plot helpers close, kept open for reading back (closed afterwards)."""
    real_close = plots.plt.close
    kept = []
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for f in kept:
        real_close(f)


def _row(replicas, every, net, moved_gib, verdict="not enough evidence", mem=None):
    return SimpleNamespace(skipped=None, net_ms=net, recorded_ms=3.6388, replan_every=every, replicas=replicas,
                           window=50, verdict=verdict, extra_mem_gib_per_rank=mem if mem is not None else
                           0.1641 * (replicas > 0), moved_gib=moved_gib, judged_steps=150)


#: the demo's sweep (moetrace sweep --replicas 0,32 --replan-every 25,50 --window 50): net ms per step,
#: GiB moved in all over the 150 judged steps
DEMO_SWEEP = [_row(0, None, 3.2719, 34.41), _row(0, 25, 3.4898, 180.76), _row(0, 50, 3.3366, 95.20),
              _row(32, None, 3.2486, 38.92), _row(32, 25, 3.5519, 200.10), _row(32, 50, 3.3861, 101.55)]


def test_decision_plot_labels_inside_apart_units_and_range(tmp_path, keep_figures):
    plots.decision(DEMO_SWEEP, tmp_path / "sweep.png")
    fig = keep_figures[-1]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = [a for a in fig.axes if a.get_title()]
    assert len(axes) == 2
    nets = [x.net_ms for x in DEMO_SWEEP] + [3.6388]
    for ax in axes:
        # no offset or scientific text ("1e6") on either axis, and the tick labels are plain numbers
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_offset_text().get_text() == ""
            assert not any("e" in t.get_text().lower() for t in axis.get_ticklabels())
        assert ax.get_ylabel().endswith("(ms)")
        lo, hi = ax.get_ylim()
        # the axis spans the values (3.25..3.64 ms), not 0..3.6: a 10% difference is most of its height
        assert lo > 0.5 * min(nets) and lo < min(nets) and hi > max(nets)
        assert (max(nets) - min(nets)) / (hi - lo) > 0.5
        # every verdict label inside the axes and no two overlapping
        box = ax.get_window_extent(r)
        labels = [t for t in ax.texts if "evidence" in t.get_text()]
        assert len(labels) == len(DEMO_SWEEP)
        bbs = [t.get_window_extent(r) for t in labels]
        for b in bbs:
            assert box.x0 - 0.5 <= b.x0 and b.x1 <= box.x1 + 0.5 and box.y0 - 0.5 <= b.y0 and b.y1 <= box.y1 + 0.5
        for a, b in itertools.combinations(bbs, 2):
            assert not a.overlaps(b), (a, b)
    # the operator's units: GiB per plan change (every 25 steps over 150 judged steps: 6 changes,
    # 200.10 / 6 = 33.35 GiB each; a static plan changes once: 38.92 GiB), GiB per rank
    right = axes[1]
    assert right.get_xlabel() == "expert weights moved per plan change (GiB)"
    xs = sorted(round(float(x), 2) for line in right.lines for x in line.get_xdata() if line.get_marker() == "o")
    assert xs == sorted(round(v, 2) for v in (34.41, 180.76 / 6, 95.20 / 3, 38.92, 200.10 / 6, 101.55 / 3))
    assert axes[0].get_xlabel() == "extra expert memory per rank (GiB)" and axes[0].get_xlim()[1] > 0.1641


def test_units_scale_to_the_number():
    assert plots.byte_unit(0.016 * 2**20) == ("KiB", 1024.0)      # 0.016 MiB reads 16 KiB
    assert plots.byte_unit(3 * 2**30)[0] == "GiB" and plots.byte_unit(12)[0] == "B"
    assert plots.time_unit(87577.5) == ("µs", 1e3) and plots.time_unit(2.9e7)[0] == "ms"
    assert fmt_ns(87577.5) == "87.58 µs" and fmt_ns(29070674) == "29.07 ms" and fmt_ns(0) == "0"
    assert fmt_ns(1.5e9) == "1.5 s" and fmt_ns(12) == "12 ns"


def test_heatmap_integer_rank_ticks_and_a_given_colour_scale(tmp_path, keep_figures):
    m = np.arange(16, dtype=float).reshape(4, 4)
    plots.heatmap(tmp_path / "h.png", m, title="t", xlabel="destination rank", ylabel="source rank",
                  cbar_label="KiB per step", vmax=40.0, integer_ticks=True)
    ax = keep_figures[-1].axes[0]
    assert list(ax.get_xticks()) == [0, 1, 2, 3] and list(ax.get_yticks()) == [0, 1, 2, 3]
    assert ax.images[0].get_clim() == (0.0, 40.0)


def test_plateau_dotted_line_drawn_over_the_solid_one(tmp_path, keep_figures):
    x = np.array([1, 2, 4, 8])
    y = np.array([1.5, 1.5, 1.49, 1.5])
    plots.plateau(tmp_path / "p.png", [("layer 0", x, y, y, 1.5)], title="t", xlabel="x", ylabel="y")
    ax = keep_figures[-1].axes[0]
    solid = [ln for ln in ax.lines if ln.get_linestyle() == "-"][0]
    dotted = [ln for ln in ax.lines if ln.get_linestyle() == ":"][0]
    # where they coincide the dots run inside a wider band: on top, thinner, and both visible
    assert dotted.get_zorder() > solid.get_zorder()
    assert solid.get_linewidth() >= 2 * dotted.get_linewidth()
    assert solid.get_alpha() < 1 and dotted.get_alpha() > 0.5


def test_exposure_layer_title_says_what_is_drawn():
    from moetrace.report.sections.exposure import layer_bars_what

    assert "vs hidden" in layer_bars_what(True, True)
    assert "none hidden" in layer_bars_what(True, False) and "vs" not in layer_bars_what(True, False)
    assert "none exposed" in layer_bars_what(False, True)


def test_html_emphasis_spanning_code_and_lines_is_rendered():
    md = ("_Computed for this report (not stored): run `moetrace whatif` to store it and add the\n"
          "domain-size sweep._")
    h = rbuild.md_to_html(md)
    assert "<em>Computed for this report" in h and "sweep.</em>" in h and "<code>moetrace whatif</code>" in h
    assert "_" not in h.replace("domain-size", "")


def test_md_table_times_with_units_yes_no_and_zero():
    df = pl.DataFrame({"rank": [0, 1], "dummy_time_ns": [29070674, 0], "exact_bytes": [True, False],
                       "share": [0.5, 0.0]})
    t = md_table(df)
    assert "| rank | dummy_time | exact_bytes | share |" in t
    assert "| 0 | 29.07 ms | yes | 0.500 |" in t and "| 1 | 0 | no | 0.000 |" in t
    assert "True" not in t and "False" not in t


def _deployable(rows):
    return pl.DataFrame(rows, schema={"kind": pl.Utf8, "policy": pl.Utf8, "plan": pl.Utf8, "judged_on": pl.Utf8,
                                      "net_ms": pl.Float64, "recorded_ms": pl.Float64, "predicted_ms": pl.Float64,
                                      "moved_experts": pl.Int64, "time_band": pl.Utf8, "verdict": pl.Utf8,
                                      "verdict_reason": pl.Utf8}, orient="row")


def test_fastest_net_compares_each_replay_with_the_recorded_on_its_own_steps():
    from moetrace.report.sections.replay import fastest_sentence

    # A has the lowest net time but is judged on cheaper steps and is SLOWER than the recorded
    # placement there (2.0 vs 1.8); B is faster than its own recorded (3.0 vs 3.6): B is named
    d = _deployable([("replay", "A", "a", "steps 0-9", 2.0, 1.8, 1.9, 5, "±25%", "x", None),
                     ("replay", "B", "b", "steps 10-99", 3.0, 3.6, 2.9, 5, "±25%", "pays off", None)])
    s = fastest_sentence(d)
    assert "**B**" in s and "−16.7%" in s and "**A**" not in s and "2 sets of judged steps" in s
    # nobody beats the recorded placement: said so, not "fastest"
    s = fastest_sentence(_deployable([("replay", "A", "a", "all", 2.0, 1.8, 1.9, 5, "±25%", "x", None)]))
    assert s.startswith("No stored replay is faster net than the recorded placement") and "+11.1%" in s


def test_drift_caption_says_slower_net_when_it_is():
    from moetrace.report.sections.replay import drift_caption

    c = drift_caption({"static": 1.146, "replan": 1.081, "oracle": 1.069}, {"static": 3.231e6, "replan": 3.546e6})
    # (1.146 - 1.081) / (1.146 - 1.069) = 84%, and 3.546 > 3.231 ms net: both said
    assert "closes 84% of the imbalance gap" in c and "slower net: 3.55 ms vs 3.23 ms" in c
    c = drift_caption({"static": 1.146, "replan": 1.081, "oracle": 1.069}, {"static": 3.5e6, "replan": 3.2e6})
    assert "slower" not in c and "re-planned 3.20 ms vs static 3.50 ms" in c


def test_caveats_box_names_an_assumed_placement_and_unknown_shape(tmp_path):
    from moetrace.report.build import shape_caveats

    class St:
        def sql(self, q, p=None):
            return pl.DataFrame({"placement_source": ["contiguous"]})

    notes = shape_caveats(St(), "r", {"num_ranks": None, "top_k": None, "num_experts": 8})
    assert any("ASSUME contiguous placement" in n for n in notes)
    assert any("--ranks" in n for n in notes) and any("--top-k" in n for n in notes)

"""The report: assembler (section discovery, md/html/terminal), sections, CLI."""
from __future__ import annotations

import re
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from moetrace.produce.synth import SynthConfig, synth
from moetrace.report import build as rbuild
from moetrace.run import ClusterSpec, Store

from .helpers import module_fixture, run_row


@module_fixture
def synth_store(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("rep") / "st", create=True)
    cfg = SynthConfig(layers=3, experts=32, top_k=4, ranks=8, ranks_per_node=4, steps=16, tokens_per_step=128,
                      sigma=0.7, seed=5, dummy_share=0.2)
    rid = synth(st, cfg).run_id
    return st, rid, cfg


@module_fixture
def synth_report(synth_store, tmp_path_factory):
    """The report of synth_store, built once, by ``moetrace report STORE --out-dir OUT`` (the CLI
    test reads its output and files), for the tests that read it: (the Report the command
    built, its figures' axis labels as drawn: (file name, x label, y label, title) each, the
    command's result, OUT)."""
    from click.testing import CliRunner

    from moetrace.cli import cli
    from moetrace.report import plots

    seen, built = [], []
    orig, orig_build = plots.save, rbuild.build_report

    def spy(fig, path):
        ax = fig.axes[0]
        seen.append((Path(path).name, ax.get_xlabel(), ax.get_ylabel(), ax.get_title()))
        return orig(fig, path)

    def build(*a, **kw):
        built.append(orig_build(*a, **kw))
        return built[-1]

    st, rid, _ = synth_store
    out = tmp_path_factory.mktemp("rep-report") / "rep"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plots, "save", spy)
        mp.setattr(rbuild, "build_report", build)
        res = CliRunner().invoke(cli, ["report", str(st.path), "--out-dir", str(out)])
    assert len(built) == 1 and built[0].run_id == rid, res.output
    return built[0], seen, res, out


def _numpy_mean_imbalance(st, rid, E, R):
    df = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    loads = {}
    for s, l, e, t in df.iter_rows():
        loads.setdefault((s, l), np.zeros(E))[e] += t
    per_layer = {}
    for (_s, l), x in loads.items():
        r = x.reshape(R, -1).sum(axis=1)
        per_layer.setdefault(l, []).append(r.max() / r.mean())
    return {l: float(np.mean(v)) for l, v in per_layer.items()}


def _sections(st, rid, out, *names):
    """{key: Section} of the named section modules alone, built as build_report builds them (the
    run's analysis views computed once and shadowing the views while they build, then dropped),
    for a test that reads only those sections."""
    import importlib

    from moetrace.analyze import cache as analysis_cache
    from moetrace.analyze import configure, drop_materialized
    from moetrace.report.base import ReportContext

    out.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(store=st, run_id=rid, run=st.run_row(rid), outdir=out)
    configure(st.con, None)
    cached = analysis_cache.use(st, rid, None)
    try:
        secs = [importlib.import_module(f"moetrace.report.sections.{n}").build(ctx) for n in names]
    finally:
        drop_materialized(st.con, cached)
    return {s.key: s for s in secs if s is not None}


def test_report_cli_writes_self_contained_html_md_and_pngs(synth_store, synth_report):
    st, rid, cfg = synth_store
    _, _, res, out = synth_report                # moetrace report STORE --out-dir OUT
    assert res.exit_code == 0, res.output
    pngs = sorted(out.glob("*.png"))
    names = {p.name for p in pngs}
    assert {"skew_layer_imbalance.png", "skew_worst_layer_ranks.png", "batch_plateau.png",
            "dummy_share_per_rank.png", "experts_tokens_hist.png"} <= names
    assert sum(n.startswith("skew_heatmap_layer") for n in names) == 2
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    html = (out / "report.html").read_text()
    # self-contained: every image inline, nothing fetched from elsewhere
    srcs = re.findall(r'src="([^"]*)"', html)
    assert len(srcs) == len(pngs) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"(href|src)=\"(https?:|//|file:)", html)
    assert "<link" not in html and "<script" not in html
    md = (out / "report.md").read_text()
    for ref in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / ref).exists()
    assert len(re.findall(r"!\[", md)) == len(pngs)
    # the worst layer and its mean imbalance, computed independently
    imb = _numpy_mean_imbalance(st, rid, cfg.experts, cfg.ranks)
    worst = max(imb, key=imb.get)
    assert f"Worst layer: {worst} (mean {imb[worst]:.2f}×)" in res.output
    assert f"Worst layer: **{worst}** (mean {imb[worst]:.2f}×)" in md
    # approximations of the run are shown first, in every output
    assert "contiguous placement assumed" in res.output and "contiguous placement assumed" in html
    assert "wrote" in res.output and "report.html" in res.output


def test_dummy_and_expert_sections_report_numpy_figures(synth_store, synth_report):
    st, rid, cfg = synth_store
    rep = synth_report[0]
    steps = st.sql("SELECT is_dummy FROM steps WHERE run_id = ?", [rid])["is_dummy"].to_numpy()
    dummy = {s.key: s for s in rep.sections}["dummy"]
    assert f"{int(steps.sum())} of {len(steps)} (step, rank) pairs" in dummy.markdown
    assert f"{100 * steps.mean():.1f}%" in dummy.markdown
    assert any("No step times" in n for n in dummy.notes)
    experts = {s.key: s for s in rep.sections}["experts"]
    assert f"each of the {cfg.experts} experts got **{cfg.tokens_per_step * cfg.top_k / cfg.experts:.1f}**" \
        in experts.markdown
    E, k, B = cfg.experts, cfg.top_k, cfg.tokens_per_step
    assert f"would touch {E * (1 - (1 - k / E) ** B):.1f}" in experts.markdown
    assert [s.key for s in rep.sections][:4] == ["skew", "experts", "batch", "dummy"]


def test_assembler_includes_any_section_module_and_survives_a_broken_one(synth_store, tmp_path, monkeypatch):
    """Other areas drop modules into report/sections/: they must show up, in ORDER."""
    from moetrace.report import sections

    extra = tmp_path / "extra_sections"
    extra.mkdir()
    tag = uuid.uuid4().hex[:6]
    (extra / f"zz_fake_{tag}.py").write_text(textwrap.dedent("""
        from moetrace.report.base import Section
        ORDER = 15
        def build(ctx):
            n = ctx.sql("SELECT count(*) AS n FROM steps WHERE run_id = ?", [ctx.run_id])["n"][0]
            return Section(key="fake", title="Fake section", markdown=f"steps rows: {n} <b>&",
                           notes=["a fake note"])
    """))
    (extra / f"zz_broken_{tag}.py").write_text("ORDER = 99\ndef build(ctx):\n    raise RuntimeError('boom')\n")
    (extra / f"zz_none_{tag}.py").write_text("ORDER = 5\ndef build(ctx):\n    return None\n")
    monkeypatch.setattr(sections, "__path__", list(sections.__path__) + [str(extra)])
    st, rid, cfg = synth_store
    rep = rbuild.build_report(st, rid, tmp_path / "r")
    keys = [s.key for s in rep.sections]
    assert keys.index("skew") < keys.index("fake") < keys.index("experts")   # ORDER 10 < 15 < 20
    assert keys[-1] == f"zz_broken_{tag}" and "boom" in rep.sections[-1].markdown
    html = rep.html_path.read_text()
    assert f"steps rows: {cfg.steps * cfg.ranks} &lt;b&gt;&amp;" in html     # escaped, not injected
    assert "a fake note" in html and "a fake note" in rep.terminal()
    assert "section failed" in rep.terminal()


def test_unknown_ranks_and_zero_steps_are_visible_in_report(tmp_path):
    st = Store(tmp_path / "st", create=True)
    rows = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for s in range(3):
        for e in range(8):
            rows["step"].append(s)
            rows["layer"].append(0)
            rows["expert"].append(e)
            rows["tokens"].append(0 if s == 2 else e + 1)
            rows["slot"].append(None)
            rows["src_rank"].append(None)
    st.write_run(run_row(source="t", source_sha256="x1", num_experts=8, top_k=2), {"expert_load": rows}, run_id="noranks")
    rep = rbuild.build_report(st, None, tmp_path / "r")
    text = rep.terminal()
    assert "number of ranks is unknown" in text and "--ranks" in text
    assert "routed no tokens" in text
    assert "nan" not in text.lower().replace("nanoseconds", "")
    assert {s.key for s in rep.sections} >= {"skew", "experts"}
    assert "dummy" not in {s.key for s in rep.sections}   # no steps table: nothing to say


def test_report_needs_run_when_store_has_several(synth_store, runner, cli, tmp_path):
    st = Store(tmp_path / "st", create=True)
    for seed in (1, 2):
        synth(st, SynthConfig(layers=1, experts=8, top_k=2, ranks=2, ranks_per_node=2, steps=2,
                              tokens_per_step=16, seed=seed))
    res = runner.invoke(cli, ["report", str(st.path), "--out-dir", str(tmp_path / "o")])
    assert res.exit_code != 0 and "--run" in res.output
    res = runner.invoke(cli, ["report", str(st.path), "--run", "synth-s2", "--out-dir", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "run `synth-s2`" in (tmp_path / "o" / "report.md").read_text()


def test_skew_command_tables(synth_store, runner, cli):
    st, rid, cfg = synth_store
    imb = _numpy_mean_imbalance(st, rid, cfg.experts, cfg.ranks)
    res = runner.invoke(cli, ["skew", str(st.path), "--format", "json"])
    assert res.exit_code == 0, res.output
    import json

    rows = json.loads(res.output)
    assert len(rows) == cfg.layers
    assert [r["layer"] for r in rows] == sorted(imb, key=imb.get, reverse=True)   # most skewed first
    for r in rows:
        assert r["imbalance_mean"] == pytest.approx(imb[r["layer"]])
    res = runner.invoke(cli, ["skew", str(st.path), "--by", "step", "--format", "csv"])
    assert res.exit_code == 0 and len(res.output.strip().splitlines()) == 1 + cfg.layers * cfg.steps


def test_md_to_html_subset():
    h = rbuild.md_to_html("# T\n\nsome `code<x>` and **bold** run_id_x _it_\n\n| a | b |\n|---|---|\n| 1 | <2> |\n\n"
                          "- one\n- two\n")
    assert "<h2>T</h2>" in h and "<code>code&lt;x&gt;</code>" in h and "<strong>bold</strong>" in h
    assert "run_id_x" in h and "<em>it</em>" in h
    assert "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>&lt;2&gt;</td>" in h
    assert "<ul><li>one</li><li>two</li></ul>" in h


def test_every_analysis_command_has_an_example(cli):
    for name in ("report", "skew"):
        assert "Example:" in cli.commands[name].help


@pytest.mark.parametrize("png", ["skew_layer_imbalance.png", "batch_plateau.png"])
def test_plots_have_labelled_axes(png, synth_report):
    """The figures carry axis labels with units (checked on the matplotlib objects, as the
    report saved them: synth_report)."""
    import matplotlib.pyplot as plt

    seen = synth_report[1]
    labels = {n: (x, y, t) for n, x, y, t in seen}
    x, y, t = labels[png]
    assert x and y and t and "×" in y
    assert all(x and y and t for x, y, t in labels.values())
    plt.close("all")


def test_single_pseudo_step_run_gets_expert_bars_and_no_fake_decomposition(tmp_path):
    """Aggregate sources (one pseudo-step) cannot separate sampling from structural skew."""
    st = Store(tmp_path / "st", create=True)
    x = np.array([50, 1, 2, 3, 4, 5, 6, 7])
    rows = {"step": [0] * 8, "layer": [1] * 8, "expert": list(range(8)), "tokens": x.tolist(),
            "slot": [None] * 8, "src_rank": [None] * 8}
    st.write_run(run_row(source="t", source_sha256="agg", num_experts=8, num_ranks=4, top_k=2), {"expert_load": rows}, run_id="agg")
    secs = _sections(st, "agg", tmp_path / "r", "skew", "batch")
    assert "single step" in secs["batch"].markdown and not secs["batch"].figures
    names = [Path(f.path).name for f in secs["skew"].figures]
    assert "skew_experts_layer1.png" in names and not any("heatmap" in n for n in names)
    ranks = x.reshape(4, 2).sum(axis=1)
    assert f"{ranks.max() / ranks.mean():.2f}×" in secs["skew"].markdown
    assert "1 layer × 1 step on 4 ranks" in secs["skew"].markdown


def test_cached_views_give_the_same_report_and_are_dropped(tmp_path, monkeypatch):
    from moetrace.report import plots

    st = Store(tmp_path / "st", create=True)
    for seed in (1, 2):
        synth(st, SynthConfig(layers=2, experts=16, top_k=2, ranks=4, ranks_per_node=2, steps=8,
                              tokens_per_step=32, seed=seed, dummy_share=0.2))

    def drawn_not_rendered(fig, path):
        # the figures are drawn from the views either way (their captions are in report.md);
        # laying them out and rasterizing them into PNGs is the same code both times, and
        # this test compares the Markdown only (the PNGs: the CLI test and test_report_truth)
        plots.plt.close(fig)
        Path(path).write_bytes(b"")
        return Path(path)

    monkeypatch.setattr(plots, "save", drawn_not_rendered)
    a = rbuild.build_report(st, "synth-s1", tmp_path / "a", cache=True).md_path.read_text()
    b = rbuild.build_report(st, "synth-s1", tmp_path / "b", cache=False).md_path.read_text()
    assert a == b
    # the shadowing temp tables are gone: both runs are visible again
    assert st.sql("SELECT count(DISTINCT run_id) AS n FROM layer_skew")["n"][0] == 2
    assert st.sql("SELECT count(*) AS n FROM duckdb_tables() WHERE temporary")["n"][0] == 0


def test_unknown_ranks_alone_is_not_called_empty_steps(tmp_path):
    """Every imbalance is NULL when num_ranks is unknown; that is not 'routed no tokens'."""
    st = Store(tmp_path / "st", create=True)
    gini = {1: [1, 2, 3, 4, 5, 6, 7, 8], 2: [0, 0, 0, 0, 0, 0, 0, 80]}      # layer 2: one expert takes all
    rows = {"step": [], "layer": [], "expert": [], "tokens": [], "slot": [], "src_rank": []}
    for s in range(2):
        for layer, x in gini.items():
            for e, t in enumerate(x):
                for k, v in (("step", s), ("layer", layer), ("expert", e), ("tokens", t), ("slot", None),
                             ("src_rank", None)):
                    rows[k].append(v)
    st.write_run(run_row(source="t", source_sha256="x2", num_experts=8, top_k=2), {"expert_load": rows}, run_id="noranks")
    rep = rbuild.build_report(st, None, tmp_path / "r")
    text = rep.terminal()
    assert "number of ranks is unknown" in text
    assert "routed no tokens" not in text
    # without rank imbalance, the most skewed layer by Gini comes first: layer 2 (Gini 7/8) before layer 1
    table = text.split("most skewed layers")[1]
    assert table.index("| 2 ") < table.index("| 1 ")


def test_batch_plateau_sentence_is_true_when_sampling_noise_falls(tmp_path):
    """Decode-size steps (64 tokens): merging steps lowers the imbalance of the same steps and
    levels off; the sentence says so with numbers computed here by numpy merging."""
    st = Store(tmp_path / "st", create=True)
    cfg = SynthConfig(layers=1, experts=64, top_k=4, ranks=8, steps=64, tokens_per_step=32, sigma=0.6, seed=3)
    rid = synth(st, cfg).run_id
    sec = _sections(st, rid, tmp_path / "r", "batch")["batch"]
    df = st.sql("SELECT step, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    x = np.zeros((cfg.steps, cfg.experts))
    x[df["step"].to_numpy(), df["expert"].to_numpy()] = df["tokens"].to_numpy()
    r = x.reshape(cfg.steps, cfg.ranks, -1).sum(axis=2)

    def imb(a):
        return a.max(axis=-1) / a.mean(axis=-1)

    same = imb(r).mean()
    gains = []
    w = 1
    while w <= cfg.steps:
        gains.append(imb(r.reshape(cfg.steps // w, w, -1).sum(axis=1)).mean() / same)
        w *= 2
    drop = 1 - gains[-1]
    assert drop > 0.05                                   # sampling noise is there to remove
    assert f"lowers the imbalance of the same steps from {same:.3f}× to {gains[-1] * same:.3f}× " \
           f"(−{100 * drop:.1f}%)" in sec.markdown
    levels = abs(gains[-1] - gains[-2]) < 0.25 * drop
    assert ("levels off" in sec.markdown) == levels
    assert ("still falling" in sec.markdown) == (not levels)


def test_tied_maxima_are_drawn_alike():
    from moetrace.report import plots

    assert plots.highlighted([1.0, 3.0, 3.0, 2.0], "max") == [1, 2]
    assert plots.highlighted([0.0, 0.0], "max") == [0, 1]
    assert plots.highlighted([1.0, 2.0], 1) == [1] and plots.highlighted([1.0], None) == []


def test_skew_by_batch_uses_every_step_at_every_batch_size(tmp_path):
    """12 steps: windows of 8 tile steps 0-7 only, so the window of the last 8 steps (4-11) is added;
    imbalance_all, windows_all and step_imbalance_all by numpy over those windows."""
    st = Store(tmp_path / "st", create=True)
    cfg = SynthConfig(layers=2, experts=16, top_k=2, ranks=4, ranks_per_node=4, steps=12, tokens_per_step=24,
                      sigma=0.8, seed=9, drift=0.8)
    rid = synth(st, cfg).run_id
    df = st.sql("SELECT step, layer, expert, tokens FROM expert_load WHERE run_id = ?", [rid])
    x = np.zeros((cfg.steps, cfg.layers, cfg.experts))
    x[df["step"].to_numpy(), df["layer"].to_numpy(), df["expert"].to_numpy()] = df["tokens"].to_numpy()
    r = x.reshape(cfg.steps, cfg.layers, cfg.ranks, -1).sum(axis=3)
    sb = st.sql("SELECT * FROM skew_by_batch WHERE run_id = ? ORDER BY layer, steps_per_batch", [rid])
    for row in sb.iter_rows(named=True):
        w, layer = row["steps_per_batch"], row["layer"]
        wins = [(i * w, (i + 1) * w) for i in range(cfg.steps // w)] + ([(cfg.steps - w, cfg.steps)]
                                                                         if cfg.steps % w else [])
        merged = [r[a:b, layer].sum(axis=0) for a, b in wins]
        assert row["windows_all"] == len(wins)
        assert row["imbalance_all"] == pytest.approx(np.mean([m.max() / m.mean() for m in merged]))
        steps = np.concatenate([np.arange(a, b) for a, b in wins])
        one = r[steps, layer]
        assert row["step_imbalance_all"] == pytest.approx(np.mean(one.max(axis=1) / one.mean(axis=1)))


# a time with its unit that is not followed by an error band ("1.23 ms" without " ±25%")
UNBANDED_TIME = re.compile(r"\d(?:[\d.,]*\d)? (?:ms|µs)(?! ±\d+%)")


def test_every_predicted_time_carries_its_error_band(tmp_path):
    """The replay section's times are cost-model predictions (the recorded placement's too):
    each one printed carries its band, in the sentence and in the table (time_band)."""
    st = Store(tmp_path / "st", create=True)
    rid = synth(st, SynthConfig(layers=2, experts=16, top_k=2, ranks=4, ranks_per_node=4, steps=24,
                                tokens_per_step=256, sigma=0.9, seed=3)).run_id
    run = st.run(rid)

    def replay_section(out):
        # the replay section alone, as build_report builds it (its markdown is the same with
        # the analysis views cached or not: test_cached_views_give_the_same_report_and_are_dropped)
        from moetrace.report.base import ReportContext
        from moetrace.report.sections import replay

        return replay.build(ReportContext(store=st, run_id=rid, run=st.run_row(rid), outdir=tmp_path / out))

    sec = replay_section("memory")                       # nothing stored: the in-memory what-if
    head = sec.markdown.split("\n\n")[0]
    assert re.search(r"\d ms ±\d+%", head) and not UNBANDED_TIME.findall(head), head
    # the preset's band: the GPU cost model's measured band (the larger of its GEMM and all-to-all
    # bands), not validated on the H200: the cross-hardware error of the published rows
    from moetrace import costmodel

    reg = costmodel.preset("H200")["regimes"]
    want = f"±{100 * max(reg['gemm_grouped']['band'], reg['a2a_normal']['band']):.0f}%"
    assert f"carries its error band: {want} (GPU cost model H200, not validated on H200/gemm_grouped" in head
    assert "uncalibrated" not in head
    rows = [r for r in sec.markdown.splitlines() if r.startswith("| ") and "plan" not in r]
    assert rows and all(want in r for r in rows)     # every timed row of the table has its band
    run.replay(policy="eplb", cluster=ClusterSpec(replicas=4), fit_window=(0, 12))
    run.drift("eplb", every=6)
    sec = replay_section("stored")
    head = sec.markdown.split("\n\n")[0]
    assert re.search(r"\d ms ±\d+%", head) and not UNBANDED_TIME.findall(head), head
    assert "time_band" in sec.markdown
    # the drift caption says what these plans' imbalance was, averaged here over the stored
    # per-(step, layer) rows, and how much of the static-to-oracle gap re-planning closed
    per = st.sql("""SELECT regexp_extract(replay_id, '-([a-z]+)$', 1) AS plan, avg(imbalance) AS m FROM replay_layer
                    WHERE replay_id IN (SELECT replay_id FROM replay_runs WHERE kind LIKE 'drift-%') GROUP BY 1""")
    m = dict(per.iter_rows())
    cap = [f.caption for f in sec.figures if "Mean imbalance over the judged steps" in f.caption][0]
    assert f"static plan {m['static']:.3f}×, re-planned {m['replan']:.3f}×, oracle {m['oracle']:.3f}×" in cap
    if m["replan"] < m["static"] and m["static"] > m["oracle"]:
        share = (m["static"] - m["replan"]) / (m["static"] - m["oracle"])
        assert f"closes {100 * share:.0f}% of the imbalance gap" in cap
    else:
        assert "closes" not in cap


def test_drift_caption_states_only_what_the_means_say():
    from moetrace.report.sections.replay import drift_caption

    c = drift_caption({"static": 1.4, "replan": 1.2, "oracle": 1.1})
    assert "static plan 1.400×, re-planned 1.200×, oracle 1.100×" in c and "closes 67% of the imbalance gap" in c
    c = drift_caption({"static": 1.2, "replan": 1.25, "oracle": 1.1})
    assert "did not lower the imbalance" in c and "closes" not in c and "recovers" not in c
    assert "lowers it by 0.100×" in drift_caption({"static": 1.3, "replan": 1.2})

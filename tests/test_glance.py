"""Answers a person reads at a glance: an own CSV without a shape gets to the straggler under
EPLB in one try, every refusal on the way is one line that says what would work, and the
answers fit a 120-column terminal with the cost model's band said once."""
from __future__ import annotations

import re

import numpy as np
import pytest

from .helpers import invoke, module_fixture

E, LAYERS, STEPS = 64, 2, 24


def _csv(path):
    rng = np.random.default_rng(7)
    rows = ["step,layer,expert,tokens"]
    for s in range(STEPS):
        for lay in range(LAYERS):
            for e in range(E):
                rows.append(f"{s},{lay},{e},{int(rng.gamma(0.5, 100.0)) + (400 if e == 5 else 0)}")
    path.write_text("\n".join(rows) + "\n")
    return path


@module_fixture
def noshape(tmp_path_factory):
    """A store holding an own CSV ingested without --ranks / --top-k (run 'loads')."""
    from click.testing import CliRunner

    from moetrace.cli import cli

    d = tmp_path_factory.mktemp("own")
    res = CliRunner().invoke(cli, ["ingest", str(_csv(d / "loads.csv")), "--store", str(d / "st")])
    assert res.exit_code == 0, res.output
    return d / "st"


def _one_line(res):
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, res.output
    assert "<input>" not in lines[0]
    return lines[0]


def test_replay_on_a_store_without_a_shape_takes_the_ranks_from_the_flag(runner, cli, noshape):
    res = invoke(runner, cli, "replay", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "16")
    assert res.exit_code == 0, res.output
    flat = " ".join(res.stdout.split())
    assert "16 ranks x 5 slots" in flat           # (64 + 16) / 16 = 5 slots per rank
    assert "--ranks 16 used" in flat and "contiguous" in flat   # the assumption is said
    res = invoke(runner, cli, "sweep", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "0,16")
    assert res.exit_code == 0, res.output
    res = invoke(runner, cli, "plan", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "16",
                 "--no-store")
    assert res.exit_code == 0, res.output


def test_a_replica_count_that_does_not_fit_says_which_do(runner, cli, noshape):
    res = invoke(runner, cli, "replay", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "8")
    assert res.exit_code == 2
    line = _one_line(res)
    assert "store " in line and "--replicas 8" in line
    offered = [int(x) for x in re.search(r"use --replicas ([\d, ]+)", line).group(1).split(",") if x.strip()]
    # independently: every offered count fills the ranks evenly, and none is skipped
    assert offered == [r for r in range(0, 3 * 16) if (E + r) % 16 == 0][:3]


def test_format_names_users_type_and_a_wrong_one_says_what_the_file_looks_like(runner, cli, tmp_path):
    src = _csv(tmp_path / "l.csv")
    res = invoke(runner, cli, "ingest", src, "--store", tmp_path / "a", "--format", "csv")
    assert res.exit_code == 0, res.output
    res = invoke(runner, cli, "ingest", src, "--store", tmp_path / "b", "--format", "cvs")
    assert res.exit_code == 2 and "generic" in _one_line(res) and "csv" in _one_line(res)
    jsonl = tmp_path / "router_trace_rank0.jsonl"
    from .helpers import REPO

    jsonl.write_bytes((REPO / "sample_traces" / "megatron_trace" / "router_trace_rank0.jsonl").read_bytes())
    res = invoke(runner, cli, "ingest", jsonl, "--store", tmp_path / "c", "--format", "sglang")
    assert res.exit_code == 2
    assert "looks like megatron: use --format megatron" in _one_line(res)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args", [
    ("replay", "--policy", "eplb-global", "--replicas", "16"),           # no ranks anywhere
    ("replay", "--ranks", "16", "--policy", "eplb", "--replicas", "16"),  # hierarchical EPLB without groups
])
def test_every_refusal_on_the_path_is_one_actionable_line(runner, cli, noshape, args):
    res = invoke(runner, cli, args[0], noshape, *args[1:])
    assert res.exit_code == 2
    line = _one_line(res)
    assert "--ranks" in line or "--groups" in line


def test_sql_errors_keep_the_caret_under_the_query(runner, cli, noshape):
    res = invoke(runner, cli, "sql", noshape, "SELECT *\nFROM expert_load WHERE")
    assert res.exit_code != 0
    lines = res.output.rstrip("\n").splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("LINE 2: "))
    caret = lines[at + 1]
    # the carets sit under WHERE, as DuckDB aligned them
    assert lines[at][caret.index("^"):].startswith("WHERE") and set(caret.strip()) == {"^"}


@module_fixture
def sample(tmp_path_factory):
    """The shipped DeepSeek-V3-shaped sample, ingested with its shape."""
    from click.testing import CliRunner

    from moetrace.cli import cli

    from .helpers import REPO

    d = tmp_path_factory.mktemp("sample")
    res = CliRunner().invoke(cli, ["ingest", str(REPO / "sample_traces" / "dsv3_synth_expert_load.parquet"),
                                   "--store", str(d / "st"), "--ranks", "32", "--top-k", "8", "--groups", "8"])
    assert res.exit_code == 0, res.output
    return d / "st"


@pytest.mark.parametrize("args", [
    ("replay", "--policy", "eplb", "--replicas", "32"),
    ("replay", "--policy", "eplb", "--replicas", "32", "--replan-every", "25"),
    ("sweep", "--replicas", "0,32", "--replan-every", "25"),
    ("skew",),
])
def test_answers_fit_120_columns_and_say_the_band_once(args, sample, monkeypatch):
    from click.testing import CliRunner

    from moetrace.cli import cli
    from moetrace.costmodel.step_cost import error_band
    from moetrace.run import Store

    monkeypatch.setenv("COLUMNS", "120")
    res = CliRunner().invoke(cli, [args[0], str(sample), *args[1:]])
    assert res.exit_code == 0, res.output
    text = res.stdout + res.stderr
    assert max(len(x) for x in text.splitlines()) <= 120, max(text.splitlines(), key=len)
    _, src = error_band(Store(sample).run(None).cost_model())
    flat, key = " ".join(text.split()), " ".join(src.split())[:60]
    assert flat.count(key) == (0 if args[0] == "skew" else 1), flat.count(key)


def test_skew_names_the_worst_layer_and_says_when_the_straggler_moved(runner, cli, tmp_path):
    # 2 layers, 8 experts on 4 ranks (2 each); layer 1 is the skewed one: expert 0 (rank 0)
    # is hot in steps 0-9, expert 7 (rank 3) in steps 10-19
    rows = ["step,layer,expert,tokens"]
    for s in range(20):
        for e in range(8):
            rows.append(f"{s},0,{e},{10 + (e == 3)}")
            hot = (e == 0) if s < 10 else (e == 7)
            rows.append(f"{s},1,{e},{100 if hot else 10}")
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    assert invoke(runner, cli, "ingest", tmp_path / "m.csv", "--store", tmp_path / "st", "--ranks", "4",
                  "--top-k", "1").exit_code == 0
    res = invoke(runner, cli, "skew", tmp_path / "st")
    assert res.exit_code == 0, res.output
    flat = " ".join(res.stdout.split())
    assert "layer 1 is the most skewed" in flat
    assert "rank 0 in steps 0-9, rank 3 in steps 10-19" in flat


def test_tokens_per_expert_is_the_sum_of_the_rows(runner, cli, noshape, tmp_path):
    import json

    res = invoke(runner, cli, "tokens", noshape, "--format", "json")
    assert res.exit_code == 0, res.output
    got = {r["expert"]: r for r in json.loads(res.stdout)}
    # independently: the CSV the store was ingested from, summed per expert with numpy
    _csv(tmp_path / "again.csv")
    a = np.loadtxt(tmp_path / "again.csv", delimiter=",", skiprows=1, dtype=np.int64)
    want = np.bincount(a[:, 2], weights=a[:, 3], minlength=E)
    assert [got[e]["tokens"] for e in range(E)] == pytest.approx(want)
    assert got[5]["share_pct"] == pytest.approx(100 * want[5] / want.sum())
    assert got[5]["mean_per_step_layer"] == pytest.approx(want[5] / (STEPS * LAYERS))
    assert list(got)[0] == int(np.argmax(want))          # most loaded first
    res = invoke(runner, cli, "tokens", noshape, "--by", "layer", "--json")
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == LAYERS


def test_one_colour_per_kind_in_every_figure():
    """Every colour in the report's figures comes from the one palette (no hex literal
    outside it), and the timeline draws each kind in the palette's colour."""
    from moetrace.report import plots
    from moetrace.report.sections.exposure import _lanes

    from .helpers import REPO

    for path in (REPO / "moetrace" / "report").rglob("*.py"):
        text = path.read_text()
        if path.name == "plots.py":
            text = text.split("KIND_COLORS = {", 1)[0] + text.split("def color_of", 1)[1]
        assert not re.findall(r"[\"']#[0-9A-Fa-f]{6}[\"']", text), path
    lanes = {label: color for label, _, color, _ in _lanes()}
    assert lanes["dispatch"] == plots.KIND_COLORS["dispatch"] and lanes["combine"] == plots.KIND_COLORS["combine"]
    assert len(set(plots.KIND_COLORS[k] for k in ("dispatch", "combine", "exposed", "hidden", "expert_gemm"))) == 5


def test_a_long_title_is_wrapped_to_fit_its_figure(tmp_path, monkeypatch):
    from moetrace.report import plots

    kept = []
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: kept.append(fig))
    title = "All-to-all time per layer: exposed (dark blue) vs hidden behind compute (light grey), summed " * 2
    plots.bars(tmp_path / "b.png", [0, 1, 2], [1.0, 2.0, 3.0], title=title, xlabel="x", ylabel="y")
    fig = kept[-1]
    fig.canvas.draw()
    t = fig.axes[0].title
    box, page = t.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1 and "\n" in t.get_text()
    plots.plt.close(fig)


def test_the_same_comparison_gets_the_same_word():
    from moetrace.replay.strategies import fastest_text
    from moetrace.units import DOES_NOT, NOT_ENOUGH, PAYS_OFF, compare_word

    # a 4% gap inside a ±10% band is no winner; beyond a ±2% band it is
    said = fastest_text({"static": 96.0, "replan": 100.0, "oracle": 80.0}, 0.10)
    assert "no predicted winner" in said and "oracle" not in said
    assert fastest_text({"static": 96.0, "replan": 100.0}, 0.02).startswith("fastest net: static, beyond")
    assert compare_word(96.0, 100.0, 0.10) == (NOT_ENOUGH, pytest.approx(-0.04))
    assert compare_word(85.0, 100.0, 0.10)[0] == PAYS_OFF and compare_word(115.0, 100.0, 0.10)[0] == DOES_NOT
    assert compare_word(None, 100.0, 0.10)[0] == NOT_ENOUGH

"""The facade's results in a notebook: ``Run`` and the replay, drift and sweep results
render as a title, the answer in words and a short table (``_repr_markdown_`` and
``_repr_html_``, what Jupyter calls), with the numbers of the result itself."""
from __future__ import annotations

import re
from html.parser import HTMLParser

from moetrace.produce.synth import SynthConfig, synth
from moetrace.run import ClusterSpec, Store

from .helpers import module_fixture


class _Cells(HTMLParser):
    """The text of every <td> and <th> of an HTML fragment, and whether the tags balance."""

    def __init__(self):
        super().__init__()
        self.cells, self.open, self._in = [], [], False

    def handle_starttag(self, tag, attrs):
        self.open.append(tag)
        self._in = tag in ("td", "th")
        if self._in:
            self.cells.append("")

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, tag
        self._in = False

    def handle_data(self, data):
        if self._in:
            self.cells[-1] += data


def _html_cells(fragment: str) -> list[str]:
    p = _Cells()
    p.feed(fragment)
    p.close()
    assert not p.open, p.open            # every tag closed
    return p.cells


@module_fixture
def run(tmp_path_factory):
    st = Store(tmp_path_factory.mktemp("nb") / "st", create=True)
    rid = synth(st, SynthConfig(layers=2, experts=16, top_k=2, ranks=4, ranks_per_node=4, steps=24,
                                tokens_per_step=256, sigma=0.9, seed=3, num_groups=4)).run_id
    return st.run(rid)


def test_run_shows_its_shape_and_what_is_unknown(run, tmp_path):
    md, page = run._repr_markdown_(), run._repr_html_()
    r = run.row
    assert md.startswith(f"**moetrace run {run.id}**")
    assert f"layers {r['num_layers']}, experts {r['num_experts']}, top-k {r['top_k']}, ranks {r['num_ranks']}" in md
    cells = _html_cells(page)
    assert "num_ranks" in cells and str(r["num_ranks"]) in cells
    # a run ingested without its shape says what is unknown, in words
    f = tmp_path / "loads.csv"
    f.write_text("step,layer,expert,tokens\n0,0,0,3\n0,0,1,1\n")
    from moetrace.collect import ingest

    ingest(tmp_path / "st", [f])
    bare = Store(tmp_path / "st").run("loads")
    assert "Unknown: num_ranks, top_k" in bare._repr_markdown_()


@module_fixture
def results(run):
    rep = run.replay(policy="eplb", cluster=ClusterSpec(replicas=4), fit_window=(0, 12), write=False)
    drift = run.drift("eplb", every=6, write=False)
    sweep = run.sweep("eplb", replicas=[0, 4], intervals=[6])
    return rep, drift, sweep


def test_replay_result_answers_in_words_with_its_numbers(results):
    rep = results[0]
    j = rep.judged
    md, page = rep._repr_markdown_(), rep._repr_html_()
    assert md.startswith(f"**replay {rep.replay_id} of run {rep.run_id}")
    assert (f"The busiest rank carries {j.summary.mean_imbalance:.2f}× the mean rank's tokens vs "
            f"{j.recorded.mean_imbalance:.2f}× recorded") in md
    assert f"Verdict: {j.verdict}" in md and f"judged on {rep.judged_on}" in md
    cells = _html_cells(page)
    # the table: recorded and the plan, net ms as the result holds them (ns / 1e6)
    assert f"{j.net_step_ns / 1e6:.3f}" in cells and f"{j.recorded_step_ns / 1e6:.3f}" in cells
    assert cells.count("recorded") == 1 and "eplb" in cells


def test_drift_and_sweep_results_name_the_fastest_net(results):
    _, drift, sweep = results
    md = drift._repr_markdown_()
    f = drift.fastest()
    lead = "Fastest net" if f.net_step_ns < f.recorded_step_ns else "No plan beats the recorded placement net; the closest"
    assert f"{lead}: {f.kind}, {f.net_step_ns / 1e6:.3f} ms" in md
    cells = _html_cells(drift._repr_html_())
    assert {"static", "replan", "oracle"} <= set(cells)
    ok = [r for r in sweep.rows if r.skipped is None and r.net_ms is not None]
    best = min(ok, key=lambda r: r.net_ms)                  # by hand over the result's own rows
    md = sweep._repr_markdown_()
    lead = "Fastest net" if best.net_ms < best.recorded_ms else "No cell beats the recorded placement net; the closest"
    assert f"{lead}: {best.replicas} redundant slots" in md and f"{best.net_ms:.3f} ms vs" in md
    assert re.search(r"\| replicas \| replan_every \| window \|", md)
    assert len(_html_cells(sweep._repr_html_())) == 8 * (len(sweep.rows) + 1)

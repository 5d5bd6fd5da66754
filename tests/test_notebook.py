"""The facade's results in a notebook (#25): ``Run`` and the replay, drift and sweep results
render as a title, the answer in words and a short table (``_repr_markdown_`` and
``_repr_html_``, what Jupyter calls), with the numbers of the result itself."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from moetrace.produce.synth import SynthConfig, synth
from moetrace.store import Store


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


@pytest.fixture(scope="module")
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

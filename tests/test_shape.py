"""The one run shape: what the run records (``Run.shape``: None where it is silent) and what a
replay assumes on top of it (``read_shape``), each assumption a note the replay reports;
the cluster asked for as one ``ClusterSpec``; the number formatters of ``moetrace.units``.

Expected values are written out by hand from the rows below."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

import moetrace
from moetrace.domain.balance import imbalance
from moetrace.domain.model_shape import DEFAULT_HIDDEN
from moetrace.domain.shape import ClusterSpec, PlanShape, Shape
from moetrace.errors import InputError
from moetrace.replay.load import read_shape
from moetrace.units import ms_text, pct_change, percent, share_text, time_text

# 1 layer, 8 experts on 4 ranks (expert e on rank e // 2), ranks 0-1 on node 0 and 2-3 on
# node 1; the runs row records neither ranks per node nor the hidden size
E, L, T, R = 8, 1, 4, 4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    st = moetrace.open_store(tmp_path_factory.mktemp("shape") / "st", create=True)
    t, e = np.meshgrid(np.arange(T), np.arange(E), indexing="ij")
    load = {"step": t.ravel(), "layer": np.zeros(T * E, np.int32), "expert": e.ravel().astype(np.int32),
            "tokens": (e.ravel() + 1).astype(np.int64), "slot": [None] * (T * E), "src_rank": [None] * (T * E)}
    slots = np.arange(E)
    placement = {"plan_id": ["recorded"] * E, "layer": np.zeros(E, np.int32), "slot": slots.astype(np.int32),
                 "rank": (slots // 2).astype(np.int32), "node": (slots // 4).astype(np.int32),
                 "expert": slots.astype(np.int32)}
    run = {"source": "hand", "collector": "test", "time_base": "none", "source_sha256": uuid.uuid4().hex,
           "num_experts": E, "num_ranks": R, "top_k": 2}
    st.write_run(run, {"expert_load": load, "placement": placement}, run_id="s")
    return st


def test_the_run_shape_says_none_where_the_run_is_silent(store):
    s = store.run("s").shape
    assert isinstance(s, Shape)
    assert (s.num_experts, s.num_ranks, s.top_k) == (E, R, 2)
    assert s.ranks_per_node is None and s.hidden is None and s.notes == []


def test_a_replay_shape_carries_each_assumption_as_a_note(store):
    s = read_shape(store, "s")
    assert isinstance(s, Shape)
    # 4 ranks on the 2 nodes of the recorded placement: 2 per node, derived and said so
    assert s.ranks_per_node == 2
    assert any("ranks_per_node unknown: 2 from the recorded placement" in n for n in s.notes)
    assert s.hidden == DEFAULT_HIDDEN and any(f"hidden unknown: {DEFAULT_HIDDEN} assumed" in n for n in s.notes)
    assert list(s.steps) == list(range(T)) and list(s.layers) == [0]
    res = store.run("s").replay("recorded", write=False, fit_cost=False)
    assert all(n in res.notes for n in s.notes)       # the replay reports every assumption


def test_cluster_spec_resolves_against_the_run(store):
    s = read_shape(store, "s")
    assert s.plan_shape() == PlanShape(R, 2, E, None, None)
    assert s.plan_shape(ClusterSpec(replicas=4, nodes=4)) == PlanShape(R, 1, E + 4, None, 4)
    assert s.plan_shape(ClusterSpec(ranks=8, ranks_per_node=8)) == PlanShape(8, 8, E, None, None)
    with pytest.raises(InputError, match="--nodes 3 does not divide --ranks 4"):
        s.plan_shape(ClusterSpec(nodes=3))
    with pytest.raises(InputError, match="do not divide evenly over --ranks 4"):
        s.plan_shape(ClusterSpec(replicas=1))


def test_imbalance_is_max_over_mean_and_undefined_without_tokens():
    tok = np.array([[3.0, 1.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    got = imbalance(tok)
    assert got[0] == 3.0 / 2.0 and np.isnan(got[1])
    assert imbalance(tok, mx=np.array([3.0, 0.0]), mean=np.array([2.0, 0.0]))[0] == 1.5


def test_units_read_as_written_by_hand():
    assert ms_text(29_070_674) == "29.07 ms" and ms_text(None) == "–"
    assert ms_text(50_000, micro_below_ms=0.1) == "50.00 µs" and ms_text(None, none="no time") == "no time"
    assert time_text(87_577.5) == "87.58 µs" and time_text(0) == "0" and time_text(None) == ""
    assert pct_change(11.0, 10.0) == " (+10.0%)" and pct_change(9.0, 10.0) == " (−10.0%)"
    assert pct_change(None, 1.0) == "" and pct_change(1.0, 0) == ""
    assert percent(0.12345) == 12.3 and percent(0.12345, 2) == 12.35 and percent(None) is None
    assert share_text(0.0001) == "<0.1%" and share_text(0.5) == "50.0%" and share_text(0.0) == "0.0%"
    assert json.dumps(ClusterSpec().__dict__) == json.dumps(
        {"ranks": None, "replicas": None, "groups": None, "nodes": None, "ranks_per_node": None,
         "kernel": None, "sms": None, "max_nodes_per_token": None})

"""The Run facade: one object per run whose shape and metrics come from the SQL views.

Expected numbers are computed here by hand (numpy over the rows written), never read back
from the code under test."""
from __future__ import annotations

import json

import numpy as np
import pytest

import moetrace
from moetrace.errors import StoreError
from moetrace.run import Run, Shape

from .helpers import module_fixture, run_row

# 2 layers, 8 experts, 3 steps; a recorded placement puts expert e on rank e // 2 (4 ranks),
# and runs.num_ranks is NOT given: the shape must come from the recorded placement.
E, L, T, R = 8, 2, 3, 4
RNG = np.random.default_rng(7)
LOAD = RNG.integers(0, 20, size=(T, L, E))
LOAD[1, 1] = 0   # an idle (step, layer): imbalance undefined


@module_fixture
def store(tmp_path_factory):
    st = moetrace.open_store(tmp_path_factory.mktemp("facade") / "st", create=True)
    t, la, e = np.nonzero(LOAD >= 0)
    keep = (LOAD[t, la, e] > 0) | ((t == 1) & (la == 1))   # the idle (step, layer) is written as zeros
    load = {"step": t[keep], "layer": la[keep].astype(np.int32), "expert": e[keep].astype(np.int32),
            "tokens": LOAD[t, la, e][keep], "slot": [None] * int(keep.sum()), "src_rank": [None] * int(keep.sum())}
    pl_l, pl_s = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")
    placement = {"plan_id": ["recorded"] * (L * E), "layer": pl_l.ravel().astype(np.int32),
                 "slot": pl_s.ravel().astype(np.int32), "rank": (pl_s.ravel() // 2).astype(np.int32),
                 "node": np.zeros(L * E, np.int32), "expert": pl_s.ravel().astype(np.int32)}
    steps = {"step": np.repeat(np.arange(T), R), "rank": np.tile(np.arange(R), T).astype(np.int32),
             "phase": ["decode"] * (T * R), "num_tokens": [5] * (T * R),
             "is_dummy": [s == 2 and r in (1, 3) for s in range(T) for r in range(R)],
             "start_ns": [None] * (T * R), "end_ns": [None] * (T * R), "inferred": [False] * (T * R)}
    run = run_row(source="hand", num_experts=E, top_k=2,
                  approximations=json.dumps(["layer from dispatch order"]))
    st.write_run(run, {"expert_load": load, "placement": placement, "steps": steps}, run_id="h")
    return st


def test_run_is_the_typed_facade_and_resolves_the_only_run(store):
    run = store.run()
    assert isinstance(run, Run) and run.id == "h"
    assert store.run("h").id == "h"
    assert run.row["source"] == "hand" and store.run_row("h")["source"] == "hand"
    assert run.approximations == ["layer from dispatch order"]
    with pytest.raises(StoreError, match="no run 'nope'"):
        store.run("nope")


def test_shape_comes_from_the_run_shape_view(store):
    s = store.run("h").shape
    assert isinstance(s, Shape)
    # 4 ranks from the recorded placement (rank = slot // 2 over 8 slots), not a default
    assert (s.num_experts, s.num_ranks, s.ranks_from, s.num_slots, s.top_k) == (E, R, "recorded placement", E, 2)
    assert s.hidden is None and s.expert_bytes is None   # not recorded: None, never a guess


def test_skew_by_step_matches_a_hand_computation(store):
    df = store.run("h").skew(by="step").sort("step", "layer")
    assert df.height == T * L
    ranks = LOAD.reshape(T, L, R, E // R).sum(axis=3)           # [T, L, R]
    mean = ranks.mean(axis=2)
    for row in df.iter_rows(named=True):
        t, la = row["step"], row["layer"]
        if mean[t, la] == 0:
            assert row["imbalance"] is None          # undefined, not 1.0
            continue
        assert row["imbalance"] == pytest.approx(ranks[t, la].max() / mean[t, la], rel=1e-12)
        assert row["straggler_rank"] == int(np.argmax(ranks[t, la]))


def test_skew_by_layer_counts_undefined_steps_and_averages_the_rest(store):
    df = store.run("h").skew(by="layer").sort("layer")
    ranks = LOAD.reshape(T, L, R, E // R).sum(axis=3)
    mean = ranks.mean(axis=2)
    for row in df.iter_rows(named=True):
        la = row["layer"]
        ok = mean[:, la] > 0
        imb = ranks[ok, la].max(axis=1) / mean[ok, la]
        assert (row["steps"], row["steps_undefined"]) == (T, int((~ok).sum()))
        assert row["imbalance_mean"] == pytest.approx(imb.mean(), rel=1e-12)
    one = store.run("h").skew(by="run")
    assert one.height == 1 and one["layers"][0] == L


def test_tokens_per_expert_and_dummy_steps(store):
    run = store.run("h")
    tpe = run.tokens_per_expert().sort("step", "layer")
    for row in tpe.iter_rows(named=True):
        x = LOAD[row["step"], row["layer"]]
        assert row["experts_hit"] == int((x > 0).sum()) and row["per_expert_max"] == int(x.max())
        B = x.sum() / 2
        assert row["experts_hit_expected"] == pytest.approx(E * (1 - (1 - 2 / E) ** B), rel=1e-12)
    d = run.dummy_steps().sort("rank")
    assert d["dummy_steps"].to_list() == [0, 1, 0, 1] and d["steps"].to_list() == [T] * R
    by_step = run.dummy_steps(by="step").sort("step")
    assert by_step["dummy_ranks"].to_list() == [0, 0, 2]


def test_exposure_and_kernels_without_spans_say_absent(store):
    run = store.run("h")
    ex = run.exposure()
    assert not ex.has_a2a and ex.by_kind.height == 0
    assert "no all-to-all found" in ex.no_a2a_message() and "absent" in ex.no_a2a_message()
    assert run.kernels().height == 0


def test_replay_reads_the_same_shape_and_imbalance(store):
    """A run whose 4 ranks are only in the recorded placement. Replay sees 4 ranks
    (not 1), and replaying the recorded plan gives the hand-computed mean imbalance, the
    idle (step, layer) undefined (not 1.0)."""
    run = store.run("h")
    assert run._replay_shape.num_ranks == run.shape.num_ranks == R
    res = run.replay("recorded", write=False, fit_cost=False)
    ranks = LOAD.reshape(T, L, R, E // R).sum(axis=3)
    mean = ranks.mean(axis=2)
    ok = mean > 0
    want = (ranks.max(axis=2)[ok] / mean[ok]).mean()
    assert res.judged.summary.mean_imbalance == pytest.approx(want, rel=1e-12)
    assert run.skew(by="run")["imbalance_mean"][0] == pytest.approx(want, rel=1e-12)


def test_skew_groupings_are_named_once():
    from moetrace.analyze import frames
    from moetrace.run import SKEW_BY

    assert set(frames._SKEW_SQL) == set(SKEW_BY)

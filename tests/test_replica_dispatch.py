"""Replica dispatch rules (placement/replica_dispatch.py) and move schedules
(replay/move_schedule.py), against closed forms worked here by hand."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from moetrace.placement.replica_dispatch import (
    copies_per_rank,
    even_rank_tokens,
    least_loaded_rank_tokens,
    pour,
    rank_tokens,
)
from moetrace.replay.move_schedule import chunks, schedule_change


def test_least_loaded_two_ranks_by_hand():
    """Expert 0 (10 tokens) has copies on ranks 0 and 1, expert 1 (6 tokens) only on rank 0:
    even gives 5 + 6 = 11 and 5; the min-max split sends 2 to rank 0 and 8 to rank 1: 8, 8."""
    row = np.array([0, 1, 0, 2])        # rank 0: experts 0, 1; rank 1: experts 0, 2
    load = np.array([[10.0, 6.0, 0.0]])
    assert even_rank_tokens(load, row, 2).tolist() == [[11.0, 5.0]]
    assert least_loaded_rank_tokens(load, row, 2) == pytest.approx(np.array([[8.0, 8.0]]))
    # expert 2 heavy on rank 1: all of expert 0 goes to rank 0
    load = np.array([[10.0, 6.0, 30.0]])
    assert least_loaded_rank_tokens(load, row, 2) == pytest.approx(np.array([[16.0, 30.0]]))


def test_pour_fills_lowest_to_one_level():
    add = pour(np.array([[1.0, 5.0, 2.0], [0.0, 0.0, 0.0]]), np.array([4.0, 3.0]))
    # row 0: raise 1 and 2 to 3.5 (2.5 + 1.5 = 4); 5 stays; row 1: 1 each
    assert add == pytest.approx(np.array([[2.5, 0.0, 1.5], [1.0, 1.0, 1.0]]))


def _optimum(load_row, present):
    """The fractional min-max optimum in closed form: the largest load confined to a set of
    ranks (every copy of the expert inside it) over the set's size."""
    R = present.shape[1]
    best = 0.0
    for k in range(1, R + 1):
        for U in itertools.combinations(range(R), k):
            out = [r for r in range(R) if r not in U]
            inside = ~present[:, out].any(axis=1)
            best = max(best, load_row[inside].sum() / k)
    return best


def test_least_loaded_reaches_the_min_max_optimum_on_random_cases():
    rng = np.random.default_rng(7)
    for _ in range(60):
        R, spr = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        S = R * spr
        E = int(rng.integers(max(1, S // 3), S + 1))
        row = np.concatenate([np.arange(E), rng.integers(0, E, S - E)])
        rng.shuffle(row)
        load = rng.integers(0, 50, (3, E)).astype(float)
        got = least_loaded_rank_tokens(load, row, R)
        even = even_rank_tokens(load, row, R)
        present = copies_per_rank(row, E, R) > 0
        assert got.sum(axis=1) == pytest.approx(load.sum(axis=1))
        assert (got.max(axis=1) <= even.max(axis=1) + 1e-9).all()
        for n in range(3):
            assert got[n].max() == pytest.approx(_optimum(load[n], present), rel=1e-6)


def test_rank_tokens_refuses_unknown_rule():
    with pytest.raises(ValueError, match="least-loaded"):
        rank_tokens(np.ones((1, 2)), np.array([0, 1]), 2, "random")


# --------------------------------------------------------------------------- move schedules
def test_all_layers_at_once_charges_one_step():
    c = schedule_change([1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1], transfer_ns=40.0, stall_ns=100.0)
    assert (c.steps, c.charged_ns, c.transition_loss_ns, c.gain_per_step_ns) == (1, 140.0, 0.0, 10.0)
    assert c.break_even_steps == pytest.approx(14.0) and c.worst_step_ns == 140.0


def test_layers_per_step_spreads_charge_and_delays_gain():
    """Two layers per step over four layers: step 0 moves layers 0-1, step 1 layers 2-3.
    Stall 100 split by layers (50, 50); transfer 40 by moved copies (1+3=4 of 10: 16; 6 of
    10: 24). Layers 2 and 3 wait one step: loss 3 + 4 = 7. Break-even (140 + 7) / 10."""
    c = schedule_change([1.0, 2.0, 3.0, 4.0], [1, 3, 2, 4], transfer_ns=40.0, stall_ns=100.0, layers_per_step=2)
    assert c.steps == 2 and c.layers_per_step == 2
    assert c.charged_ns == pytest.approx(140.0) and c.worst_step_ns == pytest.approx(74.0)
    assert c.transition_loss_ns == pytest.approx(7.0)
    assert c.break_even_steps == pytest.approx(14.7)
    # one layer per step: loss 2*1 + 3*2 + 4*3 = 20; an asynchronous engine hides half the transfer
    c1 = schedule_change([1.0, 2.0, 3.0, 4.0], [1, 3, 2, 4], transfer_ns=40.0, stall_ns=100.0, layers_per_step=1,
                         overlap=0.5)
    assert c1.steps == 4 and c1.charged_ns == pytest.approx(120.0) and c1.transition_loss_ns == pytest.approx(20.0)
    assert c1.break_even_steps == pytest.approx(14.0)


def test_no_gain_never_breaks_even():
    assert schedule_change([0.0, -1.0], [1, 1], 10.0, 0.0).break_even_steps is None
    assert [p.tolist() for p in chunks(5, 2)] == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------------- the replay's side-by-side answer
def test_dispatch_compare_sums_by_hand():
    from moetrace.placement.planners import Plan
    from moetrace.replay.dispatch_compare import DispatchCompare, rules_of

    # one layer, experts 0..2 on 2 ranks: rank 0 holds 0, 1; rank 1 holds 0, 2 (expert 0 twice)
    plan = Plan(np.array([[0, 1, 0, 2]]), 3, 2, 2)
    load = np.array([[[10.0, 6.0, 0.0]], [[0.0, 0.0, 0.0]], [[4.0, 0.0, 8.0]]])    # 3 steps
    d = DispatchCompare(rules_of("both"), {"plan": plan})
    d.add(load[:2])
    d.add(load[2:])
    a = d.answer()
    # even: step 0 -> 11, 5 (max 11, mean 8); step 2 -> 2, 10 (max 10, mean 6); step 1 has no tokens
    assert a["even"]["plan"]["cells"] == 2
    assert a["even"]["plan"]["straggler_tokens_mean"] == pytest.approx((11 + 10) / 2)
    assert a["even"]["plan"]["max_over_mean"] == pytest.approx((11 / 8 + 10 / 6) / 2)
    # least-loaded: step 0 -> 8, 8; step 2 -> expert 0's 4 tokens all to rank 0: 4, 8
    assert a["least-loaded"]["plan"]["straggler_tokens_mean"] == pytest.approx((8 + 8) / 2)
    assert a["least-loaded"]["plan"]["max_over_mean"] == pytest.approx((1.0 + 8 / 6) / 2)


def test_rank_speed_parsing_and_refusals():
    from moetrace.errors import InputError
    from moetrace.replay.rank_speed import measured_vector, parse_rank_speed, speed_vector

    assert parse_rank_speed("0:1.0, 2:1.25") == {0: 1.0, 2: 1.25}
    assert speed_vector({2: 1.25}, 4).tolist() == [1.0, 1.0, 1.25, 1.0]
    for bad in ("0=1.1", "a:1", "1:-2", "1:nan", "", "0:1,0:2"):
        with pytest.raises(InputError, match="--rank-speed"):
            parse_rank_speed(bad)
    with pytest.raises(InputError, match="rank"):
        speed_vector({5: 1.1}, 4)
    v, notes = measured_vector([0, 2], [0.9, 1.5], 4)
    assert v.tolist() == [0.9, 1.0, 1.5, 1.0] and "2 of 4 ranks" in notes[0]


def test_plan_fanout_counts_distinct_ranks():
    from moetrace.placement.cooccurrence import plan_fanout
    from moetrace.placement.planners import Plan

    plan = Plan(np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), 4, 4, 2)      # one expert per rank, 2 ranks per node
    ch0 = np.array([[0, 1], [0, 2], [3, 3]])     # ranks {0,1}, {0,2}, {3}: 2, 2, 1; nodes 1, 2, 1
    ch1 = np.array([[0, 3]])                     # layer 1: expert 0 on rank 3, expert 3 on rank 0: 2 ranks, 2 nodes
    f = plan_fanout(plan, [ch0, ch1])
    assert f["layers"][0]["ranks_per_token"] == pytest.approx(5 / 3)
    assert f["layers"][0]["nodes_per_token"] == pytest.approx(4 / 3)
    assert f["ranks_per_token"] == pytest.approx((5 + 2) / 4) and f["tokens"] == 4

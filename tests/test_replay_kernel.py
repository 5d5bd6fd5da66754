"""The replay kernels (per-slot gathers, step sub-blocks) against a plain numpy
reimplementation with dense expert x rank matrices, on random loads with replicas."""
import numpy as np
import pytest

from moetrace.costmodel.step_cost import CostModel
from moetrace.placement.planners import Plan
from moetrace.placement.relabel import _rank_copies, overlap_matrix
from moetrace.replay import engine

from .helpers.replay_reference import _reference


def _plan(rng, L, E, R, S, rpn):
    """Every expert once, the rest of the slots random experts (replicas, some on the same rank)."""
    p2l = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, S - E)])) for _ in range(L)])
    return Plan(p2l, E, R, rpn, np.arange(L), policy="random", plan_id="x")


@pytest.mark.parametrize("R,S,rpn", [(4, 12, 2), (8, 8, 4), (6, 18, 3)])
def test_kernel_equals_plain_numpy(R, S, rpn, monkeypatch):
    rng = np.random.default_rng(R * 100 + S)
    L, E, T = 3, 8, 37
    plan = _plan(rng, L, E, R, S, rpn)
    load = rng.poisson(20, size=(T, L, E)).astype(np.float64)
    load[rng.random(load.shape) < 0.3] = 0
    load[5, 1] = 0                                     # a (step, layer) with no tokens
    cost = CostModel(1.5, 70.0, 4e11, 4e10, "test")   # the linear model (presets go through the GPU model)
    tokens, touched, intra, inter, rank, imb = _reference(load, plan, 2, 14336, cost)
    monkeypatch.setattr(engine, "BLOCK_ELEMENTS", L * max(R, E) * 5)   # several sub-blocks of 5 steps
    for blocks in (True, False):
        if not blocks:
            monkeypatch.setattr(engine, "BLOCK_ELEMENTS", 1 << 30)
        b = engine.replay_load(load, plan, "even", None, 2, 14336)
        np.testing.assert_allclose(b.tokens, tokens, rtol=1e-12)
        np.testing.assert_array_equal(b.touched, touched)
        np.testing.assert_allclose(b.bytes_intra, intra, rtol=2e-5)
        np.testing.assert_allclose(b.bytes_inter, inter, rtol=2e-5)
        m = engine.layer_metrics(b, cost)
        np.testing.assert_allclose(m.rank_ns, rank, rtol=2e-5)
        np.testing.assert_allclose(m.layer_ns, rank.max(axis=2), rtol=2e-5)
        np.testing.assert_array_equal(np.isnan(m.imbalance), np.isnan(imb))
        np.testing.assert_allclose(m.imbalance[~np.isnan(imb)], imb[~np.isnan(imb)], rtol=1e-12)
        assert (m.straggler[np.isnan(imb)] == -1).all()
        ok = ~np.isnan(imb)
        np.testing.assert_array_equal(m.straggler[ok], m.rank_ns.argmax(axis=2)[ok])


def test_sub_blocks_do_not_change_the_answer(monkeypatch):
    """Bit for bit: the same replay in one block and in sub-blocks of 4 steps."""
    rng = np.random.default_rng(7)
    plan = _plan(rng, 2, 6, 3, 9, 3)
    load = rng.poisson(9, size=(23, 2, 6)).astype(np.float64)
    cost = CostModel(1.5, 70.0, 4e11, 4e10, "test", fixed_ns=3.0, latency_ns=800.0, contention=0.1)
    whole = engine.layer_metrics(engine.replay_load(load, plan, "even", None, 2, 100), cost)
    monkeypatch.setattr(engine, "BLOCK_ELEMENTS", 2 * 6 * 4)
    parts = engine.layer_metrics(engine.replay_load(load, plan, "even", None, 2, 100), cost)
    for k in ("max_tokens", "imbalance", "straggler", "layer_ns", "rank_ns", "dispatch_ns", "compute_ns"):
        np.testing.assert_array_equal(getattr(parts, k), getattr(whole, k), err_msg=k)


def test_sparse_overlap_equals_dense_minimum():
    rng = np.random.default_rng(3)
    for E, R, S in ((8, 4, 12), (16, 4, 32), (5, 5, 5), (40, 10, 60)):
        for _ in range(10):
            a, b = rng.integers(0, E, S), rng.integers(0, E, S)
            co, cn = _rank_copies(a, E, R), _rank_copies(b, E, R)
            dense = np.minimum(co[:, :, None], cn[:, None, :]).sum(axis=0)
            np.testing.assert_array_equal(overlap_matrix(a, b, E, R), dense)


def test_reuse_freed_memory_nests_and_changes_no_number():
    """The malloc thresholds are a process setting: the same replay inside and outside,
    nested uses keep them until the outermost ends."""
    rng = np.random.default_rng(9)
    plan = _plan(rng, 2, 6, 3, 9, 3)
    load = rng.poisson(9, size=(11, 2, 6)).astype(np.float64)
    cost = CostModel(1.5, 70.0, 4e11, 4e10, "test")
    out = engine.layer_metrics(engine.replay_load(load, plan, "even", None, 2, 100), cost)
    with engine.reuse_freed_memory():
        with engine.reuse_freed_memory():
            assert engine._MALLOC["depth"] == 2
            inside = engine.layer_metrics(engine.replay_load(load, plan, "even", None, 2, 100), cost)
        assert engine._MALLOC["depth"] == 1
    assert engine._MALLOC["depth"] == 0
    for k in ("imbalance", "straggler", "layer_ns", "rank_ns"):
        np.testing.assert_array_equal(getattr(inside, k), getattr(out, k), err_msg=k)


@pytest.mark.parametrize("max_touched", [1, 4])
def test_expert_ns_table_equals_one_call_per_rank(max_touched):
    """The expert-MLP time table (one gather per block) against the cost model called for
    every rank by itself: ceil(tokens / slots touched) per expert, quantized, timed."""
    from moetrace.costmodel import replay_gpu as gpu_cost
    from moetrace.costmodel import step_cost as costmod

    rng = np.random.default_rng(max_touched)
    c = costmod.preset("H200", 7168, 44040192)
    touched = rng.integers(0, max_touched + 1, (5, 3, 16)).astype(np.int32)
    tokens = np.where(touched > 0, rng.integers(0, 3000, touched.shape) + rng.random(touched.shape) * 0.9, 0.0)
    tokens[0, 0, :4] = [0.0, 1.0, 128.0, 129.5]
    spec = c.gpu
    hand = np.zeros(tokens.shape)
    for idx in np.ndindex(tokens.shape):
        g = int(touched[idx])
        if g:
            m = int(gpu_cost.quantize_tokens(np.ceil(np.array([tokens[idx] / g])))[0])
            hand[idx] = gpu_cost._mlp_ns(spec["hardware"], int(spec["hidden"]), int(spec["intermediate"]),
                                         spec["weight_dtype"], g, m)
    np.testing.assert_array_equal(gpu_cost.expert_ns(spec, tokens, touched), hand)
    np.testing.assert_array_equal(c.compute_ns(tokens, touched), c.fixed_ns + hand)


def test_plan_arrays_follow_a_plan_edited_in_place():
    """The per-plan arrays are reused while the plan is unchanged: a plan whose slots are
    edited in place replays like a fresh plan with those slots."""
    rng = np.random.default_rng(10)
    plan = _plan(rng, 2, 6, 3, 9, 3)
    load = rng.poisson(9, size=(5, 2, 6)).astype(np.float64)
    engine.replay_load(load, plan, "even", None, 2, 100)
    plan.phy2log[0, [0, 4]] = plan.phy2log[0, [4, 0]]
    plan.phy2log[1, 2] = plan.phy2log[1, 7]             # one expert more, one less on layer 1
    if np.unique(plan.phy2log[1]).size < 6:
        plan.phy2log[1, 7] = np.setdiff1d(np.arange(6), plan.phy2log[1])[0]
    fresh = Plan(plan.phy2log.copy(), 6, 3, 3)
    a = engine.replay_load(load, plan, "even", None, 2, 100)
    b = engine.replay_load(load, fresh, "even", None, 2, 100)
    for k in ("tokens", "touched", "bytes_intra", "bytes_inter"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)

"""The replay's fast cost paths against the plain computations they replace: the GPU
model's expert time from a lookup table (bit for bit a call per distinct (slots, tokens)
pair), and the all-to-all timed from the received tokens (the dispatch + combine sum of
the bytes it stands for)."""
from __future__ import annotations

import numpy as np
import pytest

from moetrace.costmodel import replay_gpu as gpu_cost
from moetrace.costmodel import step_cost as costmod
from moetrace.placement.planners import PlanShape, make_plan
from moetrace.replay import engine


def _expert_by_pair(spec, tok, g):
    """One _mlp_ns call per distinct (slots touched, quantized tokens per expert) pair."""
    hw, h, i, dt = spec["hardware"], int(spec["hidden"]), int(spec["intermediate"]), spec["weight_dtype"]
    out = np.zeros(tok.shape)
    m = np.where(g > 0, tok / np.maximum(g, 1), 0.0)
    mq = np.where(g > 0, gpu_cost.quantize_tokens(m), 0)
    cache = {}
    for idx in np.ndindex(tok.shape):
        k = (int(g[idx]), int(mq[idx]))
        if k not in cache:
            cache[k] = gpu_cost._mlp_ns(hw, h, i, dt, *k)
        out[idx] = cache[k]
    return out


@pytest.mark.parametrize("gmax", [1, 4])
def test_expert_table_equals_a_call_per_pair(gmax):
    spec = costmod.preset("H200").gpu
    rng = np.random.default_rng(gmax)
    g = rng.integers(0, gmax + 1, size=(3, 5, 40)).astype(np.int32)
    tok = np.where(g > 0, rng.gamma(2, 400, size=g.shape) * rng.choice([1, 0.5, 1 / 3], size=g.shape), 0.0)
    tok[0, 0, :5] = np.where(g[0, 0, :5] > 0, [1, 127, 128, 129, 5000], 0)
    assert np.array_equal(gpu_cost.expert_ns(spec, tok, g), _expert_by_pair(spec, tok, g))
    big = tok * 40                       # the table grows: the earlier entries keep their times
    assert np.array_equal(gpu_cost.expert_ns(spec, big, g), _expert_by_pair(spec, big, g))


@pytest.mark.parametrize("rpn", [1, 4, 16])
@pytest.mark.parametrize("model", ["gpu", "linear"])
def test_comm_from_received_tokens_equals_dispatch_plus_combine(rpn, model):
    c = costmod.preset("H200") if model == "gpu" else costmod.CostModel(
        a_ns=3.0, b_ns=100.0, nvlink_Bps=4e11, internode_Bps=5e10, source="test", latency_ns=5000, fixed_ns=700)
    rng = np.random.default_rng(rpn)
    L, E, R = 4, 32, 16
    load = rng.poisson(rng.gamma(1, 30, size=(1, L, E)), size=(20, L, E)).astype(np.float64)
    load[3] = 0                                          # a step with no tokens: no all-to-all time
    plan = make_plan("greedy", load.sum(0), PlanShape(R, rpn, E + 16, None, None), layers=np.arange(L))
    blk = engine.replay_load(load, plan, "even", None, 8, 7168 * 2)
    a, b = blk.per_token
    # the bytes as exact float64 products, timed the plain way
    d, comp, cb = c.rank_ns(blk.tokens, blk.touched, blk.received.astype(np.float64) * a,
                            blk.received.astype(np.float64) * b)
    got = c.comm_received_ns(blk.received, blk.per_token)
    np.testing.assert_allclose(got, d + cb, rtol=1e-12, atol=1e-9)
    m = engine.layer_metrics(blk, c)
    np.testing.assert_allclose(m.rank_ns, d + comp + cb, rtol=1e-12, atol=1e-9)
    # against the float32 bytes the block stores: within their rounding
    d2, comp2, cb2 = engine.rank_parts(blk, c)
    np.testing.assert_allclose(m.rank_ns, d2 + comp2 + cb2, rtol=1e-6)

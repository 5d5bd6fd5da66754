"""Both placements in one pass (``engine.replay_pair``), pieces on threads
(``engine.ordered_map``) and the read-ahead of the next chunk (``load.iter_load``): the
same numbers, bit for bit, as one plan after the other on one thread, and as a plain numpy
reimplementation."""
import json

import numpy as np
import pyarrow as pa
import pytest

from moetrace.costmodel.step_cost import CostModel, preset
from moetrace.placement.planners import Plan
from moetrace.replay import engine

from .helpers import run_row
from .helpers.replay_reference import _reference


def _one_slot_plan(rng, L, E, R, rpn, plan_id):
    """One slot per rank: every expert once, the R - E other slots hot experts again."""
    p2l = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, 3, R - E)])) for _ in range(L)])
    return Plan(p2l, E, R, rpn, np.arange(L), policy="random", plan_id=plan_id)


def _load(rng, T, L, E):
    load = rng.poisson(30, size=(T, L, E)).astype(np.float64)
    load[rng.random(load.shape) < 0.2] = 0
    load[3, 1] = 0                                    # a (step, layer) that routed no token
    return load


FIELDS = ("tokens", "touched", "received", "bytes_intra", "bytes_inter")
METRICS = ("max_tokens", "mean_tokens", "imbalance", "straggler", "layer_ns", "rank_ns", "load_straggler")


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


@pytest.mark.parametrize("cost", [preset("H200", hidden=64), CostModel(1.5, 70.0, 4e11, 4e10, "linear")],
                         ids=["gpu", "linear"])
@pytest.mark.parametrize("R,rpn", [(16, 4), (12, 12)])
def test_pair_equals_one_plan_after_the_other(cost, R, rpn):
    rng = np.random.default_rng(R + rpn)
    T, L, E = 23, 3, 10
    a, b = _one_slot_plan(rng, L, E, R, rpn, "a"), _one_slot_plan(rng, L, E, R, rpn, "b")
    load = _load(rng, T, L, E)
    assert engine.pair_applies((a, b), "even", 4, cost)
    got = engine.replay_pair(load, (a, b), 4, 128, cost)
    for plan, (blk, m) in zip((a, b), got):
        ref = engine.replay_load(load, plan, "even", None, 4, 128)
        mref = engine.layer_metrics(ref, cost)
        for f in FIELDS:
            assert _same(getattr(blk, f), getattr(ref, f)), f
        for f in METRICS:
            assert _same(getattr(m, f), getattr(mref, f)), f
        assert m.dispatch_ns is None and mref.dispatch_ns is None
        assert _same(m.rank_ns_mean, mref.rank_ns.mean(axis=2))
        if cost.gpu is None:       # and the plain numpy form of the kernel (dense expert x rank matrices)
            tokens, touched, intra, inter, rank, imb = _reference(load, plan, 4, 128, cost)
            np.testing.assert_allclose(blk.tokens, tokens, rtol=1e-12)
            assert np.array_equal(blk.touched, touched)
            np.testing.assert_allclose(blk.bytes_intra, intra, rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(blk.bytes_inter, inter, rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(m.rank_ns, rank, rtol=1e-4)
            np.testing.assert_allclose(m.imbalance, imb, rtol=1e-12)


def test_pair_of_plans_on_other_rank_counts():
    """A candidate on fewer ranks than the recorded placement (one slot per rank each): its
    own rank count, bytes per received token and rank times."""
    rng = np.random.default_rng(5)
    T, L, E = 9, 2, 10
    a, b = _one_slot_plan(rng, L, E, 12, 4, "a"), _one_slot_plan(rng, L, E, 16, 8, "b")
    load = _load(rng, T, L, E)
    cost = preset("H200", hidden=64)
    assert engine.pair_applies((a, b), "even", 4, cost)
    for plan, (blk, m) in zip((a, b), engine.replay_pair(load, (a, b), 4, 128, cost)):
        ref = engine.replay_load(load, plan, "even", None, 4, 128)
        mref = engine.layer_metrics(ref, cost)
        assert blk.tokens.shape == (T, L, plan.num_ranks)
        for f in FIELDS:
            assert _same(getattr(blk, f), getattr(ref, f)), f
        for f in METRICS:
            assert _same(getattr(m, f), getattr(mref, f)), f


def test_pair_applies_only_where_it_is_exact():
    rng = np.random.default_rng(0)
    a, b = _one_slot_plan(rng, 2, 6, 8, 4, "a"), _one_slot_plan(rng, 2, 6, 8, 4, "b")
    two = Plan(np.tile(np.arange(8) % 6, (2, 1)), 6, 4, 2, np.arange(2), plan_id="two")   # two slots per rank
    cost = preset("H200", hidden=64)
    assert engine.pair_applies((a, b), "even", 2, cost)
    assert not engine.pair_applies((a, two), "even", 2, cost)
    assert not engine.pair_applies((a, b), "hash", 2, cost)
    assert not engine.pair_applies((a, b), "even", None, cost)
    contention = CostModel(1.5, 70.0, 4e11, 4e10, "x", contention=0.1)
    assert not engine.pair_applies((a, b), "even", 2, contention)


def test_ordered_map_keeps_the_order_and_raises():
    import time

    def slow(i):
        time.sleep(0.002 * ((7 * i) % 5))
        return i * i

    for threads in (1, 2, 3):
        assert list(engine.ordered_map(slow, range(20), threads=threads)) == [i * i for i in range(20)]

    def bad(i):
        if i == 5:
            raise ValueError("five")
        return i

    with pytest.raises(ValueError, match="five"):
        list(engine.ordered_map(bad, range(10), threads=2))


# ----------------------------------------------------------------------------- the whole replay
def _store(path, T=70, L=3, E=12, R=16, rpn=4):
    """A small fleet-shaped run: dense counts, one slot per rank, the R - E hottest experts twice."""
    from moetrace.run import Store
    from moetrace.storage.dense import grid_table

    rng = np.random.default_rng(7)
    p = np.exp(0.8 * rng.standard_normal((L, E)))
    p /= p.sum(axis=1, keepdims=True)
    counts = rng.poisson(16 * 8 * 4 * p[None], size=(T, L, E)).astype(np.int64)
    counts[5, 2] = 0
    rows = {k: [] for k in ("plan_id", "layer", "slot", "rank", "node", "expert")}
    for layer in range(L):
        experts = np.concatenate([np.arange(E), np.argsort(-p[layer], kind="stable")[:R - E]])
        for s in range(R):
            for k, v in (("plan_id", "recorded"), ("layer", layer), ("slot", s), ("rank", s), ("node", s // rpn),
                         ("expert", int(experts[s]))):
                rows[k].append(v)
    st = Store(path, create=True)
    run = run_row(source_sha256="pair-test", num_layers=L, num_experts=E, top_k=4, num_ranks=R,
                  ranks_per_node=rpn, num_slots=R, num_groups=4, hidden=256, dtype_bytes=2,
                  expert_bytes=3 * 256 * 64, approximations=json.dumps(["test data"]))
    chunks = [grid_table(np.arange(a, min(T, a + 20)), np.arange(L), counts[a:a + 20]) for a in range(0, T, 20)]
    st.write_run(run, {"expert_counts": iter(chunks), "placement": pa.table(rows)}, run_id="r")
    return st


def _replay(path, monkeypatch, *, pair: bool, threads: int, read_ahead: bool):
    import pyarrow.parquet as pq

    from moetrace.replay import judge as judge_plan
    from moetrace.replay import load
    from moetrace.run import Store

    with monkeypatch.context() as mp:
        mp.setattr(engine, "REPLAY_THREADS", threads)
        mp.setattr(load, "piece_steps", lambda shape: 5)       # pieces of 5 steps: several per chunk
        if not pair:
            mp.setattr(judge_plan, "pair_applies", lambda *a, **k: False)
        real = load.iter_load

        def chunks(store, run_id, shape, chunk_steps, **k):     # reads of 20 steps: several chunks
            assert chunk_steps == 500 and k["read_ahead"]
            return real(store, run_id, shape, 20, **{**k, "read_ahead": read_ahead})

        mp.setattr(judge_plan, "iter_load", chunks)
        res = Store(path).run("r").replay(policy="eplb", fit_window=(0, 12), split="even", rank_rows=True)
    d = res.to_dict()
    d.pop("replay_id")
    tables = {}
    for t in ("replay_layer", "replay_rank"):
        tb = pa.concat_tables([pq.read_table(f) for f in sorted((path / t).rglob("*.parquet"))])
        tables[t] = tb.drop_columns(["replay_id"]).sort_by([(c, "ascending") for c in ("step", "layer")
                                                            + (("rank",) if t == "replay_rank" else ())])
    return d, tables


def test_replay_is_the_same_with_the_pair_kernel_threads_and_read_ahead(tmp_path, monkeypatch):
    """The whole replay (summary JSON, replay_layer and replay_rank rows) one plan after the
    other on one thread, as before, and with both plans in one pass, pieces on two threads,
    the next chunk read ahead (reads of 20 steps here: several chunks, pieces of 5 steps)."""
    import shutil

    base = tmp_path / "st"
    _store(base)
    got = []
    for i, kw in enumerate([dict(pair=False, threads=1, read_ahead=False), dict(pair=True, threads=2, read_ahead=True),
                            dict(pair=True, threads=1, read_ahead=False)]):
        p = tmp_path / f"copy{i}"
        shutil.copytree(base, p)
        got.append(_replay(p, monkeypatch, **kw))
    (d0, t0), *rest = got
    assert d0["load"]["judged_steps"] == 58
    for d, t in rest:
        assert d == d0
        for name in t0:
            assert t[name].equals(t0[name]), name


@pytest.mark.parametrize("read_ahead", [True, False])
def test_pieces_cut_from_row_groups_equal_the_chunk_reads(tmp_path, monkeypatch, read_ahead):
    """iter_load on a dense file (row groups of 20 steps here) gives the same pieces, step
    ids and counts as the chunk by chunk reads, for chunks and pieces that straddle the
    groups, windows starting inside a group, and steps missing from the run."""
    from dataclasses import replace

    from moetrace.replay import load
    from moetrace.run import Store
    from moetrace.storage import dense

    _store(tmp_path / "st")
    st = Store(tmp_path / "st")
    shape = st.run("r")._replay_shape
    assert dense.grid_groups(st, "r") == [(0, 19), (20, 39), (40, 59), (60, 69)]
    for steps, chunk, piece in ((shape.steps, 25, 7), (shape.steps[13:61], 30, 4), (shape.steps[5:9], 500, 14),
                                (np.delete(shape.steps, [21, 22, 50]), 17, 5)):
        sub = replace(shape, steps=steps)
        new = list(load.iter_load(st, "r", sub, chunk, piece=piece, read_ahead=read_ahead))
        with monkeypatch.context() as mp:
            mp.setattr(dense, "grid_groups", lambda *a: None)
            old = list(load.iter_load(st, "r", sub, chunk, piece=piece))
        assert len(new) == len(old) and sum(p[0].size for p in new) == steps.size
        for (i1, l1, s1), (i2, l2, s2) in zip(old, new):
            assert np.array_equal(i1, i2) and l1.dtype == l2.dtype == np.float64 and np.array_equal(l1, l2)
            assert s1 is None and s2 is None
    total = load.read_load_total(st, "r", shape, (3, 47), chunk_steps=10)[1]
    with monkeypatch.context() as mp:
        mp.setattr(dense, "grid_groups", lambda *a: None)
        assert np.array_equal(total, load.read_load_total(st, "r", shape, (3, 47), chunk_steps=10)[1])

"""Planners, seed physics on synthetic runs, the move-aware re-planner and plan files.
Rank loads are recomputed here by hand (np.add.at over slot ranks), never taken from
the replay engine."""
import json

import numpy as np
import pytest

from moetrace.errors import InputError
from moetrace.placement import plan_files as plan_io
from moetrace.placement.moves import moves_between, replan
from moetrace.placement.planners import PLANNERS, Plan, PlanShape, make_plan
from moetrace.produce.synth import SynthConfig, generate

from .helpers import module_fixture


@module_fixture
def seed_load():
    """[steps, layers, experts] from moetrace synth: 256 experts, top-8, sigma 0.6, 8192 tokens."""
    cfg = SynthConfig(layers=3, experts=256, top_k=8, ranks=32, steps=12, tokens_per_step=8192, sigma=0.6, seed=7)
    _, tables = generate(cfg)
    out = np.zeros((cfg.steps, cfg.layers, cfg.experts))
    for t in tables["expert_load"]:
        np.add.at(out, (t.column("step").to_numpy(), t.column("layer").to_numpy(), t.column("expert").to_numpy()),
                  t.column("tokens").to_numpy())
    return out


def hand_rank_loads(load_le, phy2log, num_ranks):
    """Even split of each expert over its copies, summed per rank: [L, R]."""
    L, S = phy2log.shape
    spr = S // num_ranks
    out = np.zeros((L, num_ranks))
    for li in range(L):
        cnt = np.bincount(phy2log[li], minlength=load_le.shape[1])
        for s in range(S):
            e = phy2log[li, s]
            out[li, s // spr] += load_le[li, e] / cnt[e]
    return out


def imb(rl):
    return rl.max(axis=1) / rl.mean(axis=1)


def test_seed_physics(seed_load):
    fit, judge = seed_load[:6].sum(axis=0), seed_load[6:]
    # contiguous on 32 ranks: 8 consecutive experts per rank
    contig = np.concatenate([imb(seed_load[t].reshape(3, 32, 8).sum(axis=2)) for t in range(6, 12)])
    assert 1.4 <= contig.mean() <= 1.7
    g = make_plan("greedy", fit, PlanShape(32, 8, 256))
    gr = np.concatenate([imb(hand_rank_loads(judge[t], g.phy2log, 32)) for t in range(6)])
    assert 1.0 < gr.mean() < 1.1, gr.mean()
    # one expert per rank: max/mean of the expert loads themselves
    one = np.concatenate([imb(judge[t]) for t in range(6)])
    assert 3.5 <= one.mean() <= 6
    p = make_plan("one-per-rank", fit, PlanShape(288, 8, 288))
    assert p.num_ranks == 288 and p.slots_per_rank == 1
    rep = np.concatenate([imb(hand_rank_loads(judge[t], p.phy2log, 288)) for t in range(6)])
    assert 1.6 <= rep.mean() <= 2.5, rep.mean()
    assert rep.mean() < one.mean() / 1.5


@pytest.mark.parametrize("policy", list(PLANNERS))
def test_every_planner_makes_a_valid_plan(policy, seed_load):
    w = seed_load.sum(axis=0)
    shape = PlanShape(256 + 32, 8, 288) if policy == "one-per-rank" else PlanShape(32, 8, 288, num_groups=8)
    p = make_plan(policy, w, shape)
    assert p.phy2log.shape == (3, 288)
    for li in range(3):
        cnt = np.bincount(p.phy2log[li], minlength=256)
        assert cnt.min() >= 1 and cnt.sum() == 288
    if policy != "contiguous":
        # balanced planners beat contiguous on the load they were fitted on
        c = make_plan("contiguous", w, shape)
        assert imb(hand_rank_loads(w, p.phy2log, p.num_ranks)).mean() < \
            imb(hand_rank_loads(w, c.phy2log, c.num_ranks)).mean()


def test_contiguous_with_replicas_is_vllm_initial_map():
    p = make_plan("contiguous", np.ones((1, 8)), PlanShape(4, 2, 12))
    np.testing.assert_array_equal(p.phy2log[0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3])
    np.testing.assert_array_equal(p.slot_rank, np.arange(12) // 3)


def test_greedy_hand_case():
    # LPT with 2 slots per rank: 10 -> r0, 6 -> r1, 5 -> r1 (6 < 10), 1 -> r0
    p = make_plan("greedy", np.array([[10.0, 6.0, 5.0, 1.0]]), PlanShape(2, 2, 4))
    np.testing.assert_array_equal(p.phy2log[0], [0, 3, 1, 2])


def test_bad_shapes_are_input_errors():
    with pytest.raises(InputError):
        make_plan("greedy", np.ones((1, 8)), PlanShape(3, 1, 8))
    with pytest.raises(InputError):
        make_plan("nope", np.ones((1, 8)), PlanShape(4, 1, 8))
    with pytest.raises(ValueError):
        Plan(np.array([[0, 0, 1, 1]]), 3, 2, 1)   # expert 2 has no slot


def _dense_moves(old, new):
    """moves_between and move_copies written with the dense [L, E, R] copies matrices: the
    reference for the sparse (layer, rank, expert) keys the module uses."""
    cn, co = new.copies(), old.copies()
    R = cn.shape[2]
    co = np.concatenate([co, np.zeros(co.shape[:2] + (max(0, R - co.shape[2]),))], axis=2)[:, :, :R]
    need = np.maximum(cn - co, 0)
    old_node = np.arange(old.num_ranks) // old.ranks_per_node
    new_node = np.arange(R) // new.ranks_per_node
    held = np.zeros(co.shape[:2] + (int(max(old_node.max(), new_node.max())) + 1,))
    np.add.at(held, (slice(None), slice(None), old_node), old.copies())
    near = held[:, :, new_node] > 0
    return (need.sum(axis=(1, 2)).astype(np.int64), (need * near).sum(axis=(0, 1)).astype(np.int64),
            (need * ~near).sum(axis=(0, 1)).astype(np.int64))


def test_moves_equal_the_dense_count():
    from moetrace.placement.moves import move_copies

    rng = np.random.default_rng(4)
    E, L = 12, 3
    for R_old, R_new, rpn_old, rpn_new, spr_old, spr_new in ((4, 4, 2, 2, 4, 4), (4, 6, 2, 3, 3, 2), (6, 3, 3, 1, 2, 6),
                                                             (8, 8, 4, 2, 2, 2), (1, 4, 1, 4, 12, 3)):
        for _ in range(5):
            def plan(R, rpn, spr):
                rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, R * spr - E)]))
                        for _ in range(L)]
                return Plan(np.array(rows), E, R, rpn)
            old, new = plan(R_old, rpn_old, spr_old), plan(R_new, rpn_new, spr_new)
            per_layer, intra, inter = _dense_moves(old, new)
            assert moves_between(old, new).tolist() == per_layer.tolist()
            got = move_copies(old, new)
            assert got[0].tolist() == intra.tolist() and got[1].tolist() == inter.tolist()
            assert got[0].sum() + got[1].sum() == per_layer.sum()
    assert moves_between(old, old).sum() == 0


def test_moves_between_hand():
    a = Plan(np.array([[0, 1, 2, 3]]), 4, 2, 1)
    b = Plan(np.array([[1, 0, 2, 3]]), 4, 2, 1)    # same rank, other slots: free
    assert moves_between(a, b).tolist() == [0]
    c = Plan(np.array([[0, 2, 1, 3]]), 4, 2, 1)    # swap across ranks: two copies
    assert moves_between(a, c).tolist() == [2]


def test_move_aware_replanner(seed_load):
    w = seed_load.sum(axis=0)
    shape = PlanShape(32, 8, 288, num_groups=8)
    start = make_plan("contiguous", w, shape)
    before = imb(hand_rank_loads(w, start.phy2log, 32)).mean()
    last = before
    for budget in (0, 6, 30, 120):
        new, info = replan(start, w, max_moves=budget)
        assert info["moves"] <= budget
        assert info["moves"] == int(moves_between(start, new).sum())
        after = imb(hand_rank_loads(w, new.phy2log, 32)).mean()
        assert after <= last + 1e-12
        last = after
    assert last < before - 0.1
    full = make_plan("eplb", w, shape)
    gain_full = before - imb(hand_rank_loads(w, full.phy2log, 32)).mean()
    new, info = replan(start, w, max_moves=120)
    assert info["moves"] <= 120 < moves_between(start, full).sum() / 4
    assert before - imb(hand_rank_loads(w, new.phy2log, 32)).mean() > 0.3 * gain_full
    # a target imbalance stops early
    t, tinfo = replan(start, w, target_imbalance=1.3)
    assert imb(hand_rank_loads(w, t.phy2log, 32)).max() <= 1.3
    unbounded, uinfo = replan(start, w)
    assert 0 < tinfo["moves"] < uinfo["moves"]


def test_plan_files_round_trip(tmp_path, seed_load):
    w = seed_load.sum(axis=0)
    p = make_plan("eplb", w, PlanShape(32, 8, 288, num_groups=8), layers=np.array([3, 4, 5]))
    f1 = plan_io.export_plan(p, tmp_path / "s.json", "sglang")
    doc = json.loads(f1.read_text())
    m = np.array(doc["physical_to_logical_map"])
    assert m.shape == (6, 288)                       # rows for every layer 0..5
    np.testing.assert_array_equal(m[:3], np.tile(np.arange(288) % 256, (3, 1)))
    back = plan_io.import_plan(f1, 256, 32, 8, layers=np.array([3, 4, 5]))
    np.testing.assert_array_equal(back.phy2log, p.phy2log)
    f2 = plan_io.export_plan(p, tmp_path / "e.json", "eplb")
    back2 = plan_io.import_plan(f2, 256, 32, 8)
    np.testing.assert_array_equal(back2.phy2log, p.phy2log)
    np.testing.assert_array_equal(back2.layers, [3, 4, 5])
    e = json.loads(f2.read_text())
    np.testing.assert_array_equal(e["logcnt"], p.logcnt())
    bad = tmp_path / "bad.json"
    bad.write_text('{"physical_to_logical_map": [[0, 1], [0]]}')
    with pytest.raises(InputError, match="bad.json"):
        plan_io.import_plan(bad, 2, 1, 1)
    lc = tmp_path / "lc.json"
    lc.write_text(json.dumps({"logical_count": [[0] * 8, [5, 1, 1, 1, 1, 1, 1, 1]]}))
    q = plan_io.import_plan(lc, 8, 4, 2, layers=np.array([1]))
    assert q.phy2log.shape == (1, 8)


# ----------------------------------------------------------------------------- relabeling
from itertools import permutations  # noqa: E402

from moetrace.placement.relabel import linear_assignment, relabel  # noqa: E402
from moetrace.replay.engine import layer_metrics, replay_load  # noqa: E402


def _hand_moves(old_row, new_row, R):
    """Copies new rank r holds that old rank r did not (multiset difference), by Counter."""
    from collections import Counter

    so, sn = old_row.size // R, new_row.size // R
    out = 0
    for r in range(R):
        o = Counter(old_row[r * so:(r + 1) * so].tolist())
        n = Counter(new_row[r * sn:(r + 1) * sn].tolist())
        out += sum((n - o).values())
    return out


def _permute_ranks(row, perm, spr, rng=None):
    """Rank perm[r] of the result holds rank r's slots (shuffled inside the rank with rng)."""
    out = np.empty_like(row)
    for r, q in enumerate(perm):
        blk = row[r * spr:(r + 1) * spr].copy()
        if rng is not None:
            rng.shuffle(blk)
        out[q * spr:(q + 1) * spr] = blk
    return out


def test_linear_assignment_is_optimal_against_brute_force():
    rng = np.random.default_rng(3)
    for n in range(1, 7):
        for _ in range(40):
            c = rng.integers(0, 4, (n, n)).astype(float)      # small integers: many ties
            col = linear_assignment(c)
            assert sorted(col.tolist()) == list(range(n))
            best = min(sum(c[i, p[i]] for i in range(n)) for p in permutations(range(n)))
            assert c[np.arange(n), col].sum() == pytest.approx(best)


def _textbook_assignment(c):
    """The shortest-augmenting-path method with potentials as usually written (1-based,
    every potential and distance updated at every step of a path): the oracle for the
    lazily updated form in ``linear_assignment``, which must give the same assignment."""
    n = c.shape[0]
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    p, way = [0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):
        p[0], j0 = i, 0
        minv, used = [np.inf] * (n + 1), [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], np.inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = c[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    col = np.empty(n, np.int64)
    for j in range(1, n + 1):
        col[p[j] - 1] = j - 1
    return col


def test_linear_assignment_follows_the_textbook_path():
    """Same assignment as the per-step textbook form, ties included, for both forms:
    integer costs of both signs (dense form), and costs <= 0 that are mostly zero (like
    the negated overlaps relabeling gives it), a third nonzero, or all nonzero (both)."""
    from moetrace.placement.relabel import _assignment_dense, _assignment_sparse

    rng = np.random.default_rng(7)
    for k in range(300):
        n = int(rng.integers(1, 25))
        kind = k % 4
        if kind == 0:
            c = rng.integers(-3, 4, (n, n)).astype(float)
        elif kind == 1:
            c = -(rng.random((n, n)) < 2 / n).astype(float) * rng.integers(1, 3, (n, n))
        elif kind == 2:
            c = -(rng.random((n, n)) < 0.3).astype(float)
        else:
            c = -rng.integers(0, 4, (n, n)).astype(float)
        want = _textbook_assignment(c).tolist()
        assert linear_assignment(c).tolist() == want
        assert _assignment_dense(c).tolist() == want
        if kind:
            assert _assignment_sparse(c).tolist() == want


def test_relabel_hand_case():
    # 3 ranks x 2 slots, one node. new = prev with ranks rotated and one expert swapped for a replica
    prev = Plan(np.array([[0, 1, 2, 3, 4, 5]]), 6, 3, 3)
    new = Plan(np.array([[5, 4, 1, 0, 3, 2]]), 6, 3, 3)       # rank 0 <- {4,5}, 1 <- {0,1}, 2 <- {2,3}
    assert moves_between(prev, new).tolist() == [6]           # the planner's numbering moves everything
    got, info = relabel(prev, new)
    assert moves_between(prev, got).tolist() == [0] and info["moves_before"] == 6 and info["moves_after"] == 0
    assert got.phy2log.tolist() == prev.phy2log.tolist()      # slots inside a rank follow prev too
    # known optimum with a real change: new rank sets {3,4}, {2,5}, {0,1}; the planner's numbering keeps only
    # expert 2 (5 moves); the best renaming keeps {0,1} whole, and one of {2,5} / {3,4} each: 2 moves
    new2 = Plan(np.array([[3, 4, 2, 5, 0, 1]]), 6, 3, 3)
    got2, info2 = relabel(prev, new2)
    assert info2["moves_before"] == _hand_moves(prev.phy2log[0], new2.phy2log[0], 3) == 5
    assert info2["moves_after"] == 2 == _hand_moves(prev.phy2log[0], got2.phy2log[0], 3)
    assert sorted(got2.phy2log[0, :2].tolist()) == [0, 1]


def test_relabel_is_optimal_on_small_random_plans():
    """Against every rank permutation (flat) and every node-respecting one (2 nodes x 2 ranks)."""
    rng = np.random.default_rng(11)
    R, spr, E = 4, 3, 9
    node_perms = [p for p in permutations(range(R))
                  if all(p[2 * n] // 2 == p[2 * n + 1] // 2 for n in range(2))]
    assert len(node_perms) == 8
    for _ in range(60):
        rows = [np.concatenate([rng.permutation(E), rng.integers(0, E, R * spr - E)]) for _ in range(2)]
        prev, new = Plan(rows[0][None], E, R, 2), Plan(rows[1][None], E, R, 2)
        for keep, perms in ((False, list(permutations(range(R)))), (True, node_perms)):
            best = min(_hand_moves(prev.phy2log[0], _permute_ranks(new.phy2log[0], p, spr), R) for p in perms)
            got, info = relabel(prev, new, keep_nodes=keep)
            assert info["moves_after"] == best == _hand_moves(prev.phy2log[0], got.phy2log[0], R)
            assert sorted(got.phy2log[0].tolist()) == sorted(new.phy2log[0].tolist())
            if keep:   # every new node's ranks stay together on one node
                for n in range(2):
                    blk = sorted(new.phy2log[0, n * 6:(n + 1) * 6].tolist())
                    assert blk in (sorted(got.phy2log[0, :6].tolist()), sorted(got.phy2log[0, 6:].tolist()))


@pytest.mark.parametrize("policy,groups", [("eplb", 8), ("greedy", 1)])
def test_relabel_keeps_the_placement_and_the_replay(seed_load, policy, groups):
    """A plan renamed against a rank-shuffled copy of itself: 0 moves (many without relabeling);
    against another plan: per-rank loads permuted, imbalance and byte estimates unchanged."""
    w = seed_load.sum(axis=0)
    shape = PlanShape(32, 8, 288, num_groups=groups)
    p = make_plan(policy, w, shape)
    rng = np.random.default_rng(5)
    nperm = rng.permutation(4)
    shuffled = np.stack([_permute_ranks(row, np.concatenate([nperm[n] * 8 + rng.permutation(8) for n in range(4)])
                                        [np.arange(32)], 9, rng) for row in p.phy2log])
    prev = Plan(shuffled, 256, 32, 8)
    assert moves_between(prev, p).sum() > 500
    got, info = relabel(prev, p)
    assert info["moves_after"] == 0 == moves_between(prev, got).sum()
    # relabel against an unrelated plan (the contiguous layout) and replay both
    other, _ = relabel(make_plan("contiguous", w, PlanShape(32, 8, 256)), p)
    assert other.params.get("hierarchical", False) == (policy == "eplb")
    rl_p, rl_o = hand_rank_loads(w, p.phy2log, 32), hand_rank_loads(w, other.phy2log, 32)
    np.testing.assert_allclose(np.sort(rl_p, axis=1), np.sort(rl_o, axis=1))
    np.testing.assert_allclose(imb(rl_p), imb(rl_o))
    if policy == "eplb":   # hierarchical: whole nodes map onto nodes, so node loads are permuted too
        np.testing.assert_allclose(np.sort(rl_p.reshape(3, 4, 8).sum(axis=2), axis=1),
                                   np.sort(rl_o.reshape(3, 4, 8).sum(axis=2), axis=1))
    step_load = seed_load[:4]
    a, b = replay_load(step_load, p, "even", None, 8, 14336), replay_load(step_load, other, "even", None, 8, 14336)
    np.testing.assert_allclose(np.sort(a.tokens, axis=2), np.sort(b.tokens, axis=2))
    np.testing.assert_allclose(np.sort(a.bytes_inter, axis=2), np.sort(b.bytes_inter, axis=2), rtol=1e-9)
    np.testing.assert_allclose(np.sort(a.bytes_intra, axis=2), np.sort(b.bytes_intra, axis=2), rtol=1e-9)
    from moetrace.costmodel import step_cost as costmod

    c = costmod.preset("H200", 7168, 44040192)
    np.testing.assert_allclose(layer_metrics(a, c).imbalance, layer_metrics(b, c).imbalance)
    np.testing.assert_allclose(layer_metrics(a, c).layer_ns, layer_metrics(b, c).layer_ns, rtol=1e-9)


def test_relabel_one_slot_per_rank_equals_the_slot_ordering():
    """One slot per rank takes a shortcut (the new rank's only expert goes where the rank
    map sends it): the same rows as ordering every rank's slots like the previous plan."""
    from moetrace.placement.relabel import _order_like, best_rank_map, overlap_matrix

    rng = np.random.default_rng(12)
    E, R = 6, 8
    for keep in (False, True):
        for _ in range(20):
            rows = [np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, R - E)]))
                              for _ in range(3)]) for _ in range(2)]
            prev, new = Plan(rows[0], E, R, 4), Plan(rows[1], E, R, 4, params={"hierarchical": keep})
            got, _ = relabel(prev, new)
            for li in range(3):
                to_old = best_rank_map(overlap_matrix(prev.phy2log[li], new.phy2log[li], E, R), 4 if keep else None)
                want = np.empty(R, np.int64)
                for b in range(R):
                    want[to_old[b]] = _order_like(prev.phy2log[li, to_old[b]:to_old[b] + 1],
                                                  new.phy2log[li, b:b + 1])[0]
                assert got.phy2log[li].tolist() == want.tolist()


def test_relabel_leaves_plans_of_another_shape_alone(seed_load):
    w = seed_load.sum(axis=0)
    a = make_plan("greedy", w, PlanShape(32, 8, 288))
    b = make_plan("greedy", w, PlanShape(16, 8, 288))
    got, info = relabel(a, b)
    assert got is b and not info["relabeled"]

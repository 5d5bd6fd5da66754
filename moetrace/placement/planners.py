"""Expert placement plans and the planner registry.

A :class:`Plan` is ``phy2log [layers, slots]`` (the logical expert on every physical
slot) plus the cluster shape: slot ``s`` lives on rank ``s // slots_per_rank``, rank
``r`` on node ``r // ranks_per_node``. Planners are registered by name in
:data:`PLANNERS` (``contiguous``, ``greedy``, ``eplb``, ``eplb-global``,
``one-per-rank``); each takes a load matrix ``[layers, experts]`` and a
:class:`PlanShape` and returns a Plan. ``make_plan(name, load, shape)`` is the entry
point.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from ..domain.ranks import contiguous_experts, node_of
from ..domain.shape import PlanShape, check_shape
from ..errors import InputError
from .eplb import rebalance_experts, replica_counts


@dataclass
class Plan:
    phy2log: np.ndarray            # int64 [L, S]
    num_experts: int
    num_ranks: int
    ranks_per_node: int
    #: layer ids of the rows: any int sequence, None = 0..L-1; an int64 array once constructed
    layers: Any = None
    policy: str = "contiguous"
    plan_id: str | None = None
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        self.phy2log = np.asarray(self.phy2log, dtype=np.int64)
        if self.phy2log.ndim != 2:
            raise ValueError(f"phy2log must be [layers, slots], got {self.phy2log.shape}")
        if self.layers is None:
            self.layers = np.arange(self.phy2log.shape[0], dtype=np.int64)
        self.layers = np.asarray(self.layers, dtype=np.int64)
        S = self.phy2log.shape[1]
        if self.num_ranks < 1 or S % self.num_ranks:
            raise ValueError(f"{S} slots do not divide evenly over {self.num_ranks} ranks")
        if self.ranks_per_node < 1:
            self.ranks_per_node = self.num_ranks
        if self.phy2log.size and (self.phy2log.min() < 0 or self.phy2log.max() >= self.num_experts):
            raise ValueError("phy2log holds expert ids outside [0, num_experts)")
        missing = [int(li) for li, row in zip(self.layers, self.phy2log)
                   if np.unique(row).size < self.num_experts]
        if missing:
            raise ValueError(f"layers {missing[:5]} leave some logical experts without a slot")

    # shape
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_ranks // self.ranks_per_node))

    @property
    def slot_rank(self) -> np.ndarray:
        return np.arange(self.num_slots) // self.slots_per_rank

    @property
    def slot_node(self) -> np.ndarray:
        return node_of(self.slot_rank, self.ranks_per_node)

    @property
    def replicas(self) -> int:
        return self.num_slots - self.num_experts

    def logcnt(self) -> np.ndarray:
        """Copies of each logical expert, [L, E]."""
        L, E = self.num_layers, self.num_experts
        idx = (np.arange(L)[:, None] * E + self.phy2log).ravel()
        return np.bincount(idx, minlength=L * E).reshape(L, E)

    def copies(self) -> np.ndarray:
        """Copies of expert e on rank r, float64 [L, E, R]."""
        L, E, R = self.num_layers, self.num_experts, self.num_ranks
        idx = ((np.arange(L)[:, None] * E + self.phy2log) * R + self.slot_rank[None, :]).ravel()
        return np.bincount(idx, minlength=L * E * R).reshape(L, E, R).astype(np.float64)

    def share(self) -> np.ndarray:
        """Fraction of expert e's tokens that rank r gets under an even split, [L, E, R]."""
        c = self.copies()
        return c / c.sum(axis=2, keepdims=True)

    @property
    def num_groups(self) -> int | None:
        """Expert groups the planner used (None: not a grouped planner, or unknown)."""
        g = self.params.get("num_groups")
        return int(g) if g is not None else None

    def describe(self) -> str:
        """Every setting that shapes the plan: policy, ranks, nodes, ranks per node, slots, groups."""
        g = self.num_groups
        return (f"{self.policy}: {self.num_layers} layers, {self.num_experts} experts on {self.num_slots} slots "
                f"({self.replicas} redundant), {self.num_ranks} ranks x {self.slots_per_rank} slots, "
                f"{self.num_nodes} nodes x {self.ranks_per_node} ranks per node, "
                + (f"{g} expert groups" if g is not None else "expert groups not used"))


def _contiguous_rows(L: int, E: int, S: int) -> np.ndarray:
    """vLLM's initial map: range(E), then slot i holds expert i % E (:mod:`moetrace.domain.ranks`)."""
    return np.tile(contiguous_experts(E, S), (L, 1))


def contiguous(load: np.ndarray, shape: PlanShape) -> Plan:
    L, E = load.shape
    return Plan(_contiguous_rows(L, E, shape.num_slots), E, shape.num_ranks, shape.ranks_per_node,
                policy="contiguous")


def greedy(load: np.ndarray, shape: PlanShape) -> Plan:
    """Longest-processing-time packing: replicate hot experts (load per copy), then place
    copies heaviest first onto the least loaded rank with a free slot, preferring a rank
    that does not already hold a copy of the same expert."""
    L, E = load.shape
    S, R = shape.num_slots, shape.num_ranks
    spr = S // R
    w = np.asarray(load, np.float64)
    cnt = replica_counts(w, S - E)
    out = np.empty((L, S), np.int64)
    for li in range(L):
        items = np.repeat(np.arange(E), cnt[li])
        per_copy = w[li, items] / cnt[li, items]
        order = np.argsort(-per_copy, kind="stable")
        rank_load = np.zeros(R)
        rank_n = np.zeros(R, np.int64)
        holds = np.zeros((R, E), bool)
        rows: list[list[int]] = [[] for _ in range(R)]
        for j in order:
            e = items[j]
            free = rank_n < spr
            ok = free & ~holds[:, e]
            cand = ok if ok.any() else free
            r = int(np.flatnonzero(cand)[np.argmin(rank_load[cand])])
            rows[r].append(e)
            rank_load[r] += per_copy[j]
            rank_n[r] += 1
            holds[r, e] = True
        out[li] = np.concatenate([np.array(sorted(x), np.int64) for x in rows])
    return Plan(out, E, R, shape.ranks_per_node, policy="greedy")


def eplb(load: np.ndarray, shape: PlanShape) -> Plan:
    """DeepSeek's EPLB with the model's groups: hierarchical when the groups divide over the
    nodes, else (as the published algorithm does) global; the policy name says which."""
    G = shape.num_groups
    if G is None:       # check_shape refuses it first; here for the type checker and direct callers
        raise InputError(None, "hierarchical EPLB needs the model's expert group count (--groups N)")
    phy2log, _, _ = rebalance_experts(load, shape.num_slots, G, shape.nodes(), shape.num_ranks)
    hier = G % shape.nodes() == 0
    return Plan(phy2log, load.shape[1], shape.num_ranks, shape.ranks_per_node,
                policy="eplb" if hier else "eplb-global",
                params={"hierarchical": bool(hier), "num_groups": shape.num_groups, "num_nodes": shape.nodes(),
                        **({} if hier else {"global_because": f"{shape.num_groups} groups do not divide over "
                                                              f"{shape.nodes()} nodes"})})


def eplb_global(load: np.ndarray, shape: PlanShape) -> Plan:
    phy2log, _, _ = rebalance_experts(load, shape.num_slots, 1, 1, shape.num_ranks)
    return Plan(phy2log, load.shape[1], shape.num_ranks, shape.ranks_per_node, policy="eplb-global",
                params={"hierarchical": False, "num_groups": 1, "num_nodes": 1})


def one_per_rank(load: np.ndarray, shape: PlanShape) -> Plan:
    """Expert e on rank e; the redundant slots (one per spare rank) hold copies of the
    experts with the highest load per copy. num_ranks becomes num_slots."""
    L, E = load.shape
    S = shape.num_slots
    cnt = replica_counts(np.asarray(load, np.float64), S - E)
    out = np.empty((L, S), np.int64)
    out[:, :E] = np.arange(E)
    for li in range(L):
        extra = np.repeat(np.arange(E), cnt[li] - 1)
        per_copy = load[li, extra] / cnt[li, extra]
        out[li, E:] = extra[np.argsort(-per_copy, kind="stable")]
    rpn = shape.ranks_per_node if S % shape.ranks_per_node == 0 else 1
    return Plan(out, E, S, rpn, policy="one-per-rank")


PLANNERS: dict[str, Callable[[np.ndarray, PlanShape], Plan]] = {
    "contiguous": contiguous,
    "greedy": greedy,
    "eplb": eplb,
    "eplb-global": eplb_global,
    "one-per-rank": one_per_rank,
}


def make_plan(policy: str, load, shape: PlanShape, layers=None, plan_id: str | None = None) -> Plan:
    """Run planner ``policy`` on ``load [layers, experts]`` for ``shape``."""
    if policy not in PLANNERS:
        raise InputError(None, f"unknown policy {policy!r} (choose from {', '.join(PLANNERS)})")
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise InputError(None, f"load must be [layers, experts], got shape {load.shape}")
    check_shape(shape, load.shape[1], policy)
    try:
        plan = PLANNERS[policy](load, shape)
    except ValueError as e:
        raise InputError(None, f"policy {policy}: {e}") from None
    plan = replace(plan, layers=np.arange(load.shape[0]) if layers is None else np.asarray(layers),
                   plan_id=plan_id)
    plan.params = {**plan.params, "num_slots": plan.num_slots, "num_ranks": plan.num_ranks,
                   "ranks_per_node": plan.ranks_per_node}
    return plan


def align_layers(plan: Plan, layers: np.ndarray) -> Plan:
    """Rows of ``plan`` for ``layers`` (the layers present in the load)."""
    if plan.num_layers == len(layers) and np.array_equal(plan.layers, layers):
        return plan
    idx = []
    for l in layers:
        hit = np.flatnonzero(plan.layers == l)
        if not hit.size:
            raise InputError(None, f"plan {plan.plan_id!r} has no row for layer {int(l)}")
        idx.append(int(hit[0]))
    return Plan(plan.phy2log[idx], plan.num_experts, plan.num_ranks, plan.ranks_per_node,
                layers=np.asarray(layers), policy=plan.policy, plan_id=plan.plan_id, params=plan.params)

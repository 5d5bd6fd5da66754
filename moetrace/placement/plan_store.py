"""Plans read from the store: the recorded placement of a run and stored plans
(``plans`` rows -> :class:`~moetrace.placement.planners.Plan`)."""
from __future__ import annotations

import json

import numpy as np

from ..domain.shape import Shape
from ..errors import InputError
from .planners import Plan, align_layers, contiguous


# ----------------------------------------------------------------------------- plans
def plan_from_rows(df, plan_id: str, num_experts: int, ranks_per_node: int | None = None) -> Plan:
    """A Plan from placement rows (layer, slot, rank, node, expert) of one plan: a polars
    frame or a dict of numpy columns (:meth:`moetrace.storage.store.Store.numpy`)."""
    col = {c: np.asarray(df[c]) for c in ("layer", "slot", "rank", "node", "expert")}
    if col["layer"].size == 0:
        raise InputError(None, f"no placement rows for plan {plan_id!r}")
    layers = np.unique(col["layer"])
    S = int(col["slot"].max()) + 1
    L = layers.size
    p2l = np.full((L, S), -1, np.int64)
    li = np.searchsorted(layers, col["layer"])
    p2l[li, col["slot"]] = col["expert"]
    if (p2l < 0).any():
        raise InputError(None, f"plan {plan_id!r}: some (layer, slot) have no expert")
    rank_of = np.zeros(S, np.int64)
    rank_of[col["slot"]] = col["rank"]
    R = int(rank_of.max()) + 1
    if S % R or not np.array_equal(rank_of, np.arange(S) // (S // R)):
        raise InputError(None, f"plan {plan_id!r}: slots are not laid out as slot // slots_per_rank")
    node_of = np.zeros(R, np.int64)
    node_of[col["rank"]] = col["node"]
    nn = int(node_of.max()) + 1
    rpn = R // nn if R % nn == 0 else (ranks_per_node or R)
    try:
        return Plan(p2l, max(num_experts, int(p2l.max()) + 1), R, rpn, layers=layers, policy="stored", plan_id=plan_id)
    except ValueError as e:   # e.g. a recorded placement that leaves experts without a slot
        raise InputError(None, f"plan {plan_id!r} cannot be replayed: {e}") from None


def expert_count(shape: Shape) -> int:
    """The run's expert count (the ``run_shape`` view always gives one: the runs column or
    the largest expert id + 1)."""
    if shape.num_experts is None:
        raise InputError(None, "the run's expert count is unknown: ingest with --experts")
    return int(shape.num_experts)


def recorded_plan(store, run_id: str, shape: Shape) -> Plan:
    """The run's own placement (plan_id 'recorded'), else contiguous (slot = expert)."""
    df = store.numpy("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND "
                       "plan_id = 'recorded'", [run_id]) if store.has_files("placement") else None
    if df is not None and df["layer"].size:
        p = align_layers(plan_from_rows(df, "recorded", expert_count(shape), shape.ranks_per_node), shape.layers)
        p.policy = "recorded"
        return p
    ps = shape.plan_shape()
    p = contiguous(np.zeros((shape.layers.size, expert_count(shape))), ps)
    p.layers, p.plan_id, p.policy = shape.layers, "recorded", "recorded (contiguous assumed)"
    return p


def load_plan(store, run_id: str, plan_id: str, shape: Shape) -> Plan:
    if plan_id == "recorded":
        return recorded_plan(store, run_id, shape)
    df = store.sql("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND plan_id = ?",
                   [run_id, plan_id]) if store.has_files("placement") else None
    if df is None or df.height == 0:
        ids = store.sql("SELECT DISTINCT plan_id FROM placement WHERE run_id = ?", [run_id])["plan_id"].to_list() \
            if store.has_files("placement") else []
        raise InputError(None, f"run {run_id!r} has no plan {plan_id!r} (plans: {', '.join(ids) or 'none'})")
    p = align_layers(plan_from_rows(df, plan_id, expert_count(shape), shape.ranks_per_node), shape.layers)
    from .plan_files import plan_meta

    meta = plan_meta(store, run_id, plan_id)
    if meta is not None:
        p.policy = meta["policy"]
        try:
            p.params = {**json.loads(meta["params_json"] or "{}"), **p.params}
        except ValueError:
            pass
    return p

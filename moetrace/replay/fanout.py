"""Dispatch fan-out in the replay: the distinct destination ranks (and nodes) per token of
the recorded placement and of a plan, on the same judged steps, and the co-occurrence
counts the ``cooccurrence`` policy is fitted on. Needs per-token routing.

The recorded placement's figure is the view ``dispatch_fanout`` (recorded slots where the
engine recorded them, else the recorded or contiguous placement with an even pick among
replicas); a plan's is :func:`moetrace.placement.cooccurrence.plan_fanout` on the same
tokens (an even pick among its replicas: the same rule). Routing rows are read a block of
steps at a time (about ``ROWS`` rows), so memory does not grow with the judged steps.
"""
from __future__ import annotations

import numpy as np

from ..domain.shape import Shape
from ..placement.cooccurrence import cooccurrence_counts, plan_fanout
from ..placement.planners import Plan
from .load import read_choices, read_recorded_fanout

#: routing rows read at once
ROWS = 4_000_000


def _blocks(store, run_id, steps: np.ndarray):
    """(lo, hi) step ranges covering ``steps`` (sorted) with about :data:`ROWS` rows each."""
    if steps.size == 0:
        return
    n = store.rows("SELECT count(*) AS n FROM routing WHERE run_id = ?", [run_id]).rows[0][0]
    per_step = max(1, int(n) // max(1, int(steps.size)))
    k = max(1, ROWS // per_step)
    for a in range(0, steps.size, k):
        part = steps[a:a + k]
        yield int(part[0]), int(part[-1]) + 1


def cooccurrence_over(store, run_id, shape: Shape, steps: np.ndarray) -> np.ndarray:
    """Tokens that chose both experts, per layer of ``shape.layers``, over ``steps``:
    int64 [L, E, E] (diagonal: tokens that chose the expert)."""
    E = shape.num_experts
    out = np.zeros((shape.layers.size, E, E), np.int64)
    for lo, hi in _blocks(store, run_id, np.asarray(steps)):
        for li, ch in enumerate(read_choices(store, run_id, shape, lo, hi)):
            out[li] += cooccurrence_counts(ch, E)
    return out


def fanout_answer(store, run_id, shape: Shape, plan: Plan, steps: np.ndarray) -> dict | None:
    """{"recorded": {...} (view dispatch_fanout), "plan": {...} (the plan on the same tokens)}
    with tokens, ranks_per_token and nodes_per_token each; None without routing rows."""
    rec = read_recorded_fanout(store, run_id, np.asarray(steps))
    if rec is None:
        return None
    n, r, d = 0, 0.0, 0.0
    for lo, hi in _blocks(store, run_id, np.asarray(steps)):
        sel = np.asarray(steps)
        if not ((sel >= lo) & (sel < hi)).any():
            continue
        f = plan_fanout(plan, read_choices(store, run_id, shape, lo, hi))
        if f["tokens"]:
            n += f["tokens"]
            r += f["ranks_per_token"] * f["tokens"]
            d += f["nodes_per_token"] * f["tokens"]
    planned = {"tokens": n, "ranks_per_token": r / n if n else None, "nodes_per_token": d / n if n else None,
               "expected": bool((plan.copies() > 0).sum(axis=2).max(initial=1) > 1)}
    return {"recorded": rec, "plan": planned}

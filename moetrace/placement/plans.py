"""What ``moetrace plan`` does: fit, import, re-plan from a plan, relabel, move accounting,
store, export.

The run's summed load comes in through ``read_total`` (the replay's loader,
``moetrace.replay.load.read_load_total``, bound to the run by the facade), so this module
reads no trace itself: it plans on arrays and reads and writes plans through the store it
is given (:mod:`.plan_store`, :mod:`.plan_files`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..domain.balance import imbalance
from ..domain.shape import ClusterSpec, Shape
from ..errors import InputError
from .moves import moves_between, replan
from .plan_store import expert_count, load_plan
from .planners import Plan, make_plan
from .relabel import relabel


# ----------------------------------------------------------------------------- moetrace plan
@dataclass
class PlanResult:
    """What ``moetrace plan`` made: the plan, what it was fitted on, its moves from the plan it replaces."""
    run_id: str
    plan_id: str
    plan: Plan
    start: Plan
    fit_steps: int
    fit_window: tuple[int, int] | None
    imbalance_on_fit: float | None
    start_imbalance_on_fit: float | None
    moved: int | None
    moved_bytes: int | None
    relabeled: bool
    moves_without_relabel: int | None
    stored_rows: int | None = None
    out: str | None = None
    out_format: str | None = None
    fitted: bool = False

    def to_dict(self) -> dict:
        p = self.plan
        d = {"run_id": self.run_id, "plan_id": self.plan_id, "policy": p.policy, "plan": p.describe(),
             "layers": p.num_layers, "slots": p.num_slots, "ranks": p.num_ranks, "ranks_per_node": p.ranks_per_node,
             "nodes": p.num_nodes, "groups": p.num_groups, "redundant_slots": p.replicas,
             "fit_steps": self.fit_steps, "fit_window": list(self.fit_window) if self.fit_window else None,
             "mean_imbalance_on_fit_load": self.imbalance_on_fit, "start_plan": self.start.plan_id,
             "start_mean_imbalance_on_fit_load": self.start_imbalance_on_fit,
             "moved_experts_vs_start": self.moved, "moved_bytes_vs_start": self.moved_bytes,
             "relabeled": self.relabeled,
             "moved_experts_without_relabel": self.moves_without_relabel if self.relabeled else None,
             "params": p.params}
        if self.stored_rows is not None:
            d["stored_rows"] = self.stored_rows
        if self.out:
            d["out"], d["out_format"] = self.out, self.out_format
        return d


def _mean_imbalance(plan: Plan, total: np.ndarray) -> float | None:
    v = imbalance(np.einsum("le,ler->lr", total, plan.share()))
    return float(np.nanmean(v)) if np.isfinite(v).any() else None


@dataclass(frozen=True)
class PlanOptions:
    """What ``moetrace plan`` is asked beyond the policy and the cluster: the fit window
    (steps A <= step < B; None: all), the plan to start from (``start``: a stored plan id,
    default the recorded one), a plan file to import, a move budget (``max_moves`` /
    ``target_imbalance``: re-plan ``start``), the new plan's id, whether it is stored, the
    file it is exported to and that file's format, and whether ranks are renamed to keep
    experts where ``start`` has them."""
    fit_window: tuple[int, int] | None = None
    start: str | None = None
    import_file: str | Path | None = None
    max_moves: int | None = None
    target_imbalance: float | None = None
    plan_id: str | None = None
    store: bool = True
    out: str | Path | None = None
    out_format: str = "sglang"
    relabel: bool = True


#: ``read_total(fit_window)`` -> (step ids [T], summed load [L, E]) of the run
ReadTotal = Callable[[tuple[int, int] | None], tuple[np.ndarray, np.ndarray]]


def make_run_plan(store, run_id: str, shape: Shape, read_total: ReadTotal, policy: str | None = None,
                  cluster: ClusterSpec | None = None, options: PlanOptions | None = None) -> PlanResult:
    """Fit (``policy``), import (``options.import_file``), re-plan with a move budget from
    ``options.start``, or export a stored plan; relabel, count moves, store and export."""
    from . import plan_files as plan_io

    o, c = options or PlanOptions(), cluster or ClusterSpec()
    ranks, replicas, groups, nodes, rpn = c.ranks, c.replicas, c.groups, c.nodes, c.ranks_per_node
    fit_window, start_plan_id, import_file = o.fit_window, o.start, o.import_file
    max_moves, target_imbalance, plan_id = o.max_moves, o.target_imbalance, o.plan_id
    store_plan, out_file, out_format, relabel_to_start = o.store, o.out, o.out_format, o.relabel

    moves_mode = max_moves is not None or target_imbalance is not None
    if import_file is not None:
        ignored = [n for n, v in (("--policy", policy), ("--replicas", replicas), ("--groups", groups),
                                  ("--fit-steps", fit_window), ("--max-moves", max_moves),
                                  ("--target-imbalance", target_imbalance), ("--plan", start_plan_id)) if v is not None]
        if ignored:
            raise InputError(None, f"--import reads the plan as it is in the file: {', '.join(ignored)} would be "
                                   "ignored; leave them out (use moetrace plan --policy to fit a new plan)")
    if moves_mode and (not start_plan_id or policy):
        raise InputError(None, "--max-moves / --target-imbalance re-plan from --plan ID (without --policy)")
    if not (policy or import_file or start_plan_id):
        raise InputError(None, "give one of --policy (optionally with --plan PREV), --import, --plan ID (export), "
                               "or --plan ID with --max-moves")
    if policy and import_file:
        raise InputError(None, "give --policy or --import, not both")
    ids, total = read_total(fit_window)
    if ids.size == 0 and (policy or moves_mode):
        what = f"--fit-steps {fit_window[0]}:{fit_window[1]}" if fit_window else "the run"
        raise InputError(None, f"{what} holds no recorded steps")
    base = load_plan(store, run_id, "recorded", shape) if shape.num_ranks else None
    info: dict = {}
    relabel_info = None
    if policy:
        ps = shape.plan_shape(c)
        p = make_plan(policy, total, ps, layers=shape.layers)
        if start_plan_id:
            base = load_plan(store, run_id, start_plan_id, shape)
        if relabel_to_start and base is not None:
            p, relabel_info = relabel(base, p)
    elif import_file:
        R = ranks or shape.num_ranks
        if not R:
            raise InputError(None, "the run's rank count is unknown: give --ranks for the imported plan")
        ps = shape.plan_shape(ClusterSpec(ranks=R, nodes=nodes, ranks_per_node=rpn))
        p = plan_io.import_plan(import_file, expert_count(shape), R, ps.ranks_per_node, shape.layers,
                                shape.num_groups or 1)
    else:
        assert start_plan_id is not None     # one of policy, import_file, start_plan_id (checked above)
        start = load_plan(store, run_id, start_plan_id, shape)
        if moves_mode:
            p, info = replan(start, total, max_moves=max_moves, target_imbalance=target_imbalance)
            base = start
        else:
            p = start
    base = base or p
    pid = plan_id or (p.plan_id if p.plan_id and not policy else None) or (
        f"moves{max_moves}" if info else (policy or "imported"))
    try:
        moved = int(moves_between(base, p).sum()) if base.num_ranks == p.num_ranks else None
    except ValueError:
        moved = None
    res = PlanResult(run_id, pid, p, base, int(ids.size), (fit_window[0], fit_window[1]) if fit_window else None,
                     _mean_imbalance(p, total), _mean_imbalance(base, total) if base.num_slots else None, moved,
                     moved * shape.expert_bytes if moved is not None and shape.expert_bytes is not None else None,
                     bool(relabel_info and relabel_info["relabeled"]),
                     relabel_info["moves_before"] if relabel_info and relabel_info["relabeled"] else None,
                     fitted=bool(policy or info))
    if store_plan and not (start_plan_id and pid == start_plan_id):
        fit = ((fit_window[0], fit_window[1]) if fit_window else (int(ids.min()), int(ids.max()) + 1)) \
            if res.fitted and ids.size else None
        res.stored_rows = plan_io.save_plan(store, run_id, p, pid, fit=fit + (int(ids.size),) if fit else None,
                                            start_plan_id=base.plan_id if (policy and relabel_info) or info else None)
    if out_file:
        res.out, res.out_format = str(plan_io.export_plan(p, out_file, out_format)), out_format
    return res

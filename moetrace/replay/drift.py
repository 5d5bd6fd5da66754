"""Static vs re-planned vs oracle placements over time (``moetrace drift``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..costmodel import step_cost as costmod
from ..domain.shape import Shape, Timing
from ..errors import InputError
from ..notebook import NotebookView
from ..placement.planners import PlanShape, make_plan
from ..placement.relabel import relabel
from .cost_fit import _cost
from .judge import _in_memory, _too_short
from .results import (
    ReplayOptions,
    ReplayResult,
    _int,
    _layer_table,
    _runs_row,
    _time_note,
    load_answer,
    new_replay_id,
)
from .strategies import Fixed, Judged, MoveCost, Oracle, Replan, fastest, judge


# ----------------------------------------------------------------------------- drift
@dataclass
class DriftResult(NotebookView):
    run_id: str
    policy: str
    every: int
    window: int
    max_moves: int | None
    results: dict[str, Judged]          # static, replan, oracle
    replay_ids: dict[str, str]
    steps: np.ndarray
    cost: costmod.CostModel
    move: MoveCost
    timing: Timing
    unrelabeled_moves: int | None
    notes: list[str]

    def _notebook_view(self):
        """In a notebook: the answer in words and a short table (moetrace.notebook)."""
        from ..notebook import drift_view

        return drift_view(self)

    def fastest(self) -> Judged | None:
        return fastest(self.results.values())

    def load(self, which: str = "replan"):
        """The exact half of one strategy's answer (static, replan, oracle): see
        :func:`moetrace.replay.results.load_answer`."""
        return load_answer(self.results[which])

    def replan_by_age(self) -> dict:
        j = self.results["replan"]
        ages = j.age_array()
        rng = range(1, min(self.every, ages.size) + 1)
        return {"age": list(rng), "mean_imbalance": [float(np.nanmean(j.series[ages == a])) for a in rng]}

    def static_by_age_quartile(self) -> list[float]:
        st = self.results["static"].series
        q = np.array_split(st, 4) if st.size >= 4 else [st]
        return [float(np.nanmean(x)) for x in q]

    def to_dict(self, series: bool = False) -> dict:
        out = {"run_id": self.run_id, "policy": self.policy, "every": self.every, "window": self.window,
               "max_moves": self.max_moves, "judged_steps": int(self.steps.size), "cost": self.cost.describe(),
               "move_cost": {**asdict(self.move), "text": self.move.describe()},
               "error_band": dict(zip(("rel", "source"), costmod.error_band(self.cost))),
               "approximations": self.notes}
        for k, j in self.results.items():
            la = load_answer(j)
            s = {"load": la.to_dict() if la else None, "load_verdict": la.verdict if la else None,
                 **asdict(j.summary), "gross_step_ns": _int(j.gross_step_ns), "net_step_ns": _int(j.net_step_ns),
                 "recorded_step_ns": _int(j.recorded_step_ns), "vs_recorded": j.vs_recorded(),
                 "moved_experts": j.moved_experts, "moved_bytes": j.moved_bytes, "verdict": j.verdict,
                 "verdict_reason": j.verdict_reason, "replay_id": self.replay_ids.get(k),
                 "plan": j.plan.describe(), "replans": [asdict(c) for c in j.changes],
                 "break_even_steps": [c.break_even_steps for c in j.changes]}
            s["predicted_step_ns"] = s["gross_step_ns"]
            out[k] = s
        if self.unrelabeled_moves is not None:
            out["replan"]["moved_experts_without_relabel"] = self.unrelabeled_moves
        out["recorded"] = {**asdict(self.results["static"].recorded),
                           "predicted_step_ns": _int(self.results["static"].recorded_step_ns)}
        f = self.fastest()
        out["fastest_net"] = f.kind if f else None
        out["static_by_age_quartile"] = self.static_by_age_quartile()
        out["replan_by_age"] = self.replan_by_age()
        for k in ("mean_imbalance", "p99_imbalance", "predicted_step_ns", "moved_experts", "moved_bytes", "replay_id",
                  "net_step_ns", "verdict"):
            out[k] = out["replan"][k]
        if series:
            out["series"] = {"step": self.steps.tolist(),
                             **{k: j.series.tolist() for k, j in self.results.items()}}
        return out


def drift(store, run_id: str, shape: Shape, policy: str, plan_shape: PlanShape, every: int, window: int,
          opts: ReplayOptions, max_moves: int | None = None, write: bool = True, static_window=None) -> DriftResult:
    """Static plan (fitted on the ``window`` steps before the judged ones, or
    ``static_window``) vs re-planning every ``every`` steps from the trailing ``window``
    steps vs an oracle; all judged on the steps after the first ``window``, against the
    recorded placement on the same steps, net of moving experts."""
    if every < 1 or window < 1:
        raise InputError(None, "--replan-every and --window must be >= 1")
    m = _in_memory(store, run_id, shape, opts.split, _cost(store, run_id, shape, opts),
                   opts.passes)      # drift replays the counts (per-token routing not used)
    ids, load, slot_load, recorded, mode, cost, fn = m.ids, m.load, m.slot_load, m.recorded, m.mode, m.cost, m.fn
    T = ids.size
    if T <= window:
        raise InputError(None, _too_short(shape, T, f"--window {window}"))

    if static_window:
        lo, hi = static_window
        sl = (ids >= lo) & (ids < hi)
        if not sl.any():
            raise InputError(None, f"--fit-steps {lo}:{hi} holds no recorded steps")
    else:
        sl = np.arange(T) < window
    static = make_plan(policy, load[sl].sum(axis=0), plan_shape, layers=shape.layers, plan_id=f"{policy}-static")
    static, _ = relabel(recorded, static)
    policy = static.policy          # 'eplb-global' when EPLB could not be hierarchical
    timing = m.timing
    rp = Replan(policy, plan_shape, every, window, window, shape.layers, max_moves)
    strategies = {"static": Fixed(static, kind="static"), "replan": rp,
                  "oracle": Oracle(policy, plan_shape, every, window, shape.layers)}
    base_id = new_replay_id("d")
    results, rids = {}, {}
    notes = list(shape.notes) + _time_note(shape, timing) + [
        "drift replay uses aggregated expert_load (per-token routing not used)",
        f"baseline: the recorded placement ({recorded.policy}) on the same {T - window} steps, same cost model",
        opts.move.describe()] + list(cost.notes)
    if shape.top_k is None:
        notes.append("top_k unknown (ingest with --top-k): no all-to-all bytes or time predicted (expert compute only)")
    elif not (mode == "counts"):
        notes.append("no per-token routing: dispatch bytes estimated")
    layers_all: list = []   # the three replays' rows, appended as ONE transaction after the loop
    runs_rows: list = []
    for k, strat in strategies.items():
        tables = {"l": []}
        rid = f"{base_id}-{k}"

        def on_block(bids, plan, blk, m, _t=tables, _rid=rid, _k=k):
            if write:
                ages = np.arange(1, bids.size + 1) if _k == "replan" else None
                _t["l"].append(_layer_table(bids, plan.layers, m, _rid, plan.plan_id, ages))

        j = judge(ids, load, slot_load, window, strat, recorded, fn, cost, shape.expert_bytes, opts.move,
                  name=policy, timing=timing, on_block=on_block)
        results[k], rids[k] = j, rid
        if write:
            res = ReplayResult(rid, run_id, j, j.plan.describe(), opts.split, False, cost,
                               f"{T - window} steps after the first {window}", notes, costmod.error_band(cost),
                               opts.move, timing, policy)
            params = {"policy": policy, "every": every, "window": window, "max_moves": max_moves,
                      "split": opts.split, "static_window": list(static_window) if static_window else [0, window]}
            layers_all += tables["l"]
            runs_rows.append(_runs_row(res, f"drift-{k}", params))
    if write:   # all three replays or none: a crash never leaves two of three replay_runs rows
        store.append(run_id, {"replay_layer": layers_all, "replay_runs": runs_rows})
    return DriftResult(run_id, policy, every, window, max_moves, results, rids, ids[window:], cost, opts.move, timing,
                       rp.unrelabeled_moves if max_moves is None else None, notes)

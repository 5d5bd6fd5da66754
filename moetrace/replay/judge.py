"""One plan (stored, imported, fitted on a window, or the recorded one) judged against the
recorded placement on the same steps: gross and net time, moves, break-even, verdict
(:func:`judge_plan`, what ``moetrace replay`` does), and the in-memory load the drift and the
sweep judge many plans on."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..costmodel import step_cost as costmod
from ..domain.shape import ClusterSpec, Shape, Timing
from ..domain.windows import first_half
from ..errors import InputError
from ..placement.plan_store import recorded_plan
from ..placement.planners import Plan, PlanShape, make_plan
from ..placement.relabel import relabel
from .cost_fit import _cost
from .engine import (
    Block,
    approximation_notes,
    layer_metrics,
    pair_applies,
    pair_columns,
    rank_parts,
    replay_load,
    replay_pair,
)
from .load import (
    iter_load,
    read_load,
    read_load_total,
    routing_block,
    routing_has_slots,
)
from .results import (
    ReplayOptions,
    ReplayResult,
    _layer_table,
    _rank_table,
    _runs_row,
    _time_note,
    new_replay_id,
    traffic_table,
)
from .spool import Spool
from .strategies import judge_stream
from .trace import PredictedSteps


# ----------------------------------------------------------------------------- replay of one plan
@dataclass
class JudgedSteps:
    """Which steps judge a plan, and how to say it."""
    steps: np.ndarray
    text: str
    notes: list[str] = field(default_factory=list)


def judged_steps(shape: Shape, fit: tuple[int, int] | None, in_sample: bool, plan_id: str | None = None) -> JudgedSteps:
    """Out-of-sample by default: a plan fitted on [a, b) is judged on the steps from b on;
    ``in_sample`` judges it on every step (and says so)."""
    all_steps = shape.steps
    if fit is None:
        return JudgedSteps(all_steps, f"all {all_steps.size} step(s)")
    a, b = fit
    if in_sample:
        return JudgedSteps(all_steps, f"all {all_steps.size} step(s), IN-SAMPLE (the plan was fitted on steps [{a}, {b}))",
                           [f"in-sample judgement (asked for): the plan was fitted on steps [{a}, {b}) and is judged on "
                            "all steps, those included"])
    after = all_steps[all_steps >= b]
    if after.size == 0:
        raise InputError(None, f"no recorded step after the fit window [{a}, {b})"
                               + (f" of plan {plan_id!r}" if plan_id else "") + ": nothing to judge it on "
                               "out of sample (give an earlier --fit-steps, or --in-sample to judge it on the steps "
                               "it was fitted on)")
    return JudgedSteps(after, f"{after.size} steps after the fit window [{a}, {b}) (out-of-sample)",
                       [f"backtest: plan fitted on steps [{a}, {b}), judged on the {after.size} recorded steps from "
                        f"{int(after[0])} on"])


def default_fit_window(shape: Shape, fit_window, in_sample: bool) -> tuple[tuple[int, int], list[str]]:
    """--fit-steps, else the first half of the steps (all steps with --in-sample)."""
    if fit_window is not None:
        return tuple(fit_window), []
    st = shape.steps
    if in_sample or st.size < 2:
        return (int(st[0]), int(st[-1]) + 1), []
    lo, half = first_half(st)
    return (lo, half), [f"no --fit-steps: plan fitted on the first half of the steps [{lo}, {half}) and judged "
                        f"on the rest"]


def _replay_fn(store, run_id, shape: Shape, split: str, recorded_slots: str):
    """The block replayer the core calls: per-token routing when the run has it, recorded
    per-slot counts for the recorded plan when it has them, else the counts."""
    use_routing = shape.has_routing

    def fn(ids, load, slot_load, plan, is_recorded):
        if use_routing and not (is_recorded and recorded_slots == "counts"):
            return routing_block(store, run_id, shape, plan, split, ids, is_recorded and recorded_slots == "routing")
        return replay_load(load, plan, split, slot_load if is_recorded else None, shape.top_k, shape.bytes_per_token)

    def pair(plan, recorded, cost):
        """The kernel judging ``plan`` and ``recorded`` in one pass over each piece's counts
        (:func:`engine.replay_pair`, the same numbers as ``fn`` plan by plan), or None where
        it does not apply (per-token routing, recorded per-slot counts, several slots per rank, ...)."""
        plans = (plan, recorded)
        if use_routing or recorded_slots == "counts" or not pair_applies(plans, split, shape.top_k, cost):
            return None

        columns = pair_columns(plans)       # once: the plans do not change during the replay

        def kernel(ids, load, slot_load):
            if load.dtype != np.float64:
                return [(b, layer_metrics(b, cost)) for b in (fn(ids, load, slot_load, plan, False),
                                                             fn(ids, load, slot_load, recorded, True))]
            return replay_pair(load, plans, shape.top_k, shape.bytes_per_token, cost, columns)

        return kernel

    fn.pair = pair
    return fn


def _recorded_mode(store, run_id, shape: Shape) -> str:
    """How the recorded plan is replayed: 'routing' (per-token rows with slots), 'counts'
    (per-slot counts: exact per-rank tokens), or 'plan' (the split over replicas)."""
    if shape.has_routing and routing_has_slots(store, run_id):
        return "routing"
    if shape.has_slot:
        return "counts"
    return "plan"


def judge_plan(store, run_id: str, shape: Shape, plan: Plan, opts: ReplayOptions, *, judged: JudgedSteps | None = None,
               kind: str = "replay", policy: str | None = None, params: dict | None = None, write: bool = True,
               extra_notes=(), trace_steps=None, fitted: bool = False) -> ReplayResult:
    """Judge ``plan`` against the recorded placement on ``judged`` steps (default all),
    stream the run in step chunks, write ``replay_layer``/``replay_rank``/``replay_runs``
    (and ``replay_traffic`` with per-token routing)."""
    replay_id = new_replay_id()
    cost = _cost(store, run_id, shape, opts)
    recorded = recorded_plan(store, run_id, shape)
    is_rec = plan.plan_id == "recorded"
    if is_rec:
        plan = recorded
    judged = judged or JudgedSteps(shape.steps, f"all {shape.steps.size} step(s)")
    mode = _recorded_mode(store, run_id, shape)
    fn = _replay_fn(store, run_id, shape, opts.split, mode)
    timing = shape.timing(opts.passes)
    # a chunk's [steps, layers, ranks] arrays exist twice (the plan and the recorded baseline): half
    # the chunk of a single replay keeps the peak memory where one replay had it
    chunk = max(1, opts.chunk_steps // (1 if is_rec else 2))
    if shape.has_routing:   # per-token rows are k x tokens per (step, layer): keep chunks near 4 M rows
        n = store.sql("SELECT count(*) AS n FROM routing WHERE run_id = ?", [run_id])["n"][0]
        chunk = max(1, min(chunk, int(4_000_000 * shape.steps.size // max(int(n), 1))))
    sub = replace(shape, steps=judged.steps)
    # result rows go to disk as the replay streams (memory flat over any number of steps)
    layer_tbls, rank_tbls, kept = Spool(), Spool(), []
    agg = {"nmax": [], "nmean": [], "traffic": None, "rtraffic": None}
    with_slots = mode == "counts"

    def on_block(ids, p, blk, m):
        if write:
            layer_tbls.append(_layer_table(ids, p.layers, m, replay_id, p.plan_id))
            if opts.rank_rows:
                rank_tbls.append(_rank_table(ids, p.layers, blk, m, replay_id))
        if blk.nodes_per_token_max is not None:
            agg["nmax"].append(blk.nodes_per_token_max)
            agg["nmean"].append(blk.nodes_per_token_mean)
        if blk.traffic is not None:
            agg["traffic"] = blk.traffic if agg["traffic"] is None else agg["traffic"] + blk.traffic
        if trace_steps is not None:
            sel = np.isin(ids, trace_steps)
            if sel.any():
                if m.dispatch_ns is not None:
                    d, c, cb = m.dispatch_ns[sel], m.compute_ns[sel], (m.rank_ns - m.dispatch_ns - m.compute_ns)[sel]
                else:   # the all-to-all was timed in one pass: its lanes from the cost model
                    d, c, cb = rank_parts(Block(blk.tokens[sel], blk.touched[sel], blk.bytes_intra[sel],
                                                blk.bytes_inter[sel], blk.exact_bytes), cost)
                kept.append((ids[sel], blk.tokens[sel], blk.touched[sel], d, c, m.layer_ns[sel], cb))

    def on_recorded(ids, blk):   # the recorded placement's traffic, on the same steps
        if blk.traffic is not None:
            agg["rtraffic"] = blk.traffic if agg["rtraffic"] is None else agg["rtraffic"] + blk.traffic

    # the next chunk is read while this one is replayed (not with per-token routing: its blocks query the store)
    chunks = iter_load(store, run_id, sub, chunk, with_slots=with_slots, read_ahead=not shape.has_routing)
    try:
        j = judge_stream(chunks, plan, recorded, fn, cost, shape.expert_bytes, opts.move, timing=timing, kind=kind,
                         on_block=on_block, on_recorded=on_recorded, name=policy or plan.policy,
                         expect_cells=int(sub.steps.size * sub.layers.size))
    except ValueError as e:
        raise InputError(None, f"replay of run {run_id!r}: {e}") from None
    split = "recorded" if is_rec and mode in ("counts", "routing") else opts.split
    notes = list(shape.notes) + _time_note(shape, timing)
    blk_probe = Block(np.zeros((0, 0, 0)), None, None, None, exact_bytes=shape.has_routing and not
                      (is_rec and mode == "counts"))
    notes += approximation_notes(blk_probe, opts.split, is_rec and mode == "counts", shape.has_routing,
                                 shape.top_k is not None)
    notes += judged.notes + list(extra_notes) + list(cost.notes)
    if is_rec and "contiguous assumed" in (recorded.policy or ""):
        notes.append("no placement recorded for this run: its own layout is taken as contiguous (slot = expert)")
    if is_rec and mode == "routing":
        notes.append("per-token routing with recorded slots: tokens and dispatch bytes exact")
    elif is_rec and mode == "counts" and shape.has_routing:
        notes.append("per-rank tokens from recorded per-slot counts; per-token routing has no slots, so "
                     "dispatch bytes are estimated")
    if j.summary.undefined_cells:
        notes.append(f"{j.summary.undefined_cells} of {j.summary.cells} (step, layer) cells routed no tokens: "
                     "imbalance undefined there, left out of the means (as in skew_summary)")
    if not is_rec:
        notes.append(f"baseline: the recorded placement ({recorded.policy}) replayed on the same steps with the same "
                     "cost model")
    res = ReplayResult(replay_id, run_id, j, plan.describe(), split, bool(shape.has_routing and not
                       (is_rec and mode == "counts")), cost, judged.text, notes, costmod.error_band(cost), opts.move,
                       timing, policy or (f"plan {plan.plan_id}" if plan.plan_id and not fitted else plan.policy),
                       max(agg["nmax"]) if agg["nmax"] else None,
                       float(np.mean(agg["nmean"])) if agg["nmean"] else None, agg["traffic"], agg["rtraffic"])
    if kept:
        res.trace = PredictedSteps(
            steps=np.concatenate([k[0] for k in kept]), layers=plan.layers, cost_source=cost.source,
            **{name: np.concatenate([k[i] for k in kept])
               for i, name in enumerate(("tokens", "touched", "dispatch_ns", "compute_ns", "layer_ns", "combine_ns"),
                                        1)})
    if write:
        tables = {"replay_layer": layer_tbls, "replay_rank": rank_tbls,
                  "replay_runs": _runs_row(res, kind, params or {})}
        if res.traffic is not None:
            steps = int(j.steps.size)
            tt = [traffic_table(replay_id, plan, "recorded" if is_rec else "plan", res.traffic, steps)]
            if not is_rec and res.recorded_traffic is not None:
                tt.append(traffic_table(replay_id, recorded, "recorded", res.recorded_traffic, steps))
            tables["replay_traffic"] = tt
        store.append(run_id, tables)
    return res


def fit_plan(store, run_id, shape: Shape, policy: str, plan_shape: PlanShape, fit_window=None,
             plan_id=None, in_sample: bool = False) -> tuple[Plan, JudgedSteps]:
    """Plan ``policy`` fitted on the steps of ``fit_window`` (default the first half), and
    the steps that judge it (after the window; all with ``in_sample``)."""
    fw, notes = default_fit_window(shape, fit_window, in_sample)
    ids, total = read_load_total(store, run_id, shape, fw)
    if ids.size == 0:
        raise InputError(None, f"--fit-steps {fw[0]}:{fw[1]} holds no recorded steps")
    plan = make_plan(policy, total, plan_shape, layers=shape.layers, plan_id=plan_id)
    # moves are counted after relabeling in every command (plan, replay, drift, sweep): a
    # planner's rank numbering is arbitrary, so the plan is renamed to keep experts where
    # the recorded placement has them
    plan, info = relabel(recorded_plan(store, run_id, shape), plan)
    if info.get("relabeled"):
        notes = notes + [f"plan ranks relabeled to the recorded placement: {info['moves_after']} experts move "
                         f"({info['moves_before']} without relabeling)"]
    js = judged_steps(shape, fw, in_sample)
    js.notes = notes + js.notes
    return plan, js


def _too_short(shape: Shape, T: int, what: str, hint: str = "") -> str:
    if shape.aggregate:
        return (f"the run's counts aggregate a recording into {T} pseudo-step(s): there are no steps to re-plan over "
                "or judge after a window; moetrace replay --policy P --in-sample answers imbalance on them")
    return f"the run has {T} steps; {what} leaves none to judge{hint}"


@dataclass
class _InMemory:
    """A run's counts in memory with what every strategy loop needs: the recorded plan, how
    it is replayed, the cost model, the timing, and the block replayer (counts only; the
    recorded plan from its per-slot counts when the run has them)."""
    ids: np.ndarray
    load: np.ndarray
    slot_load: np.ndarray | None
    recorded: Plan
    mode: str
    cost: costmod.CostModel
    timing: Timing
    fn: object


def _in_memory(store, run_id, shape: Shape, split: str, cost: costmod.CostModel, passes=None,
               max_steps=None) -> _InMemory:
    mode = _recorded_mode(store, run_id, shape)
    ids, load, slot_load = read_load(store, run_id, shape, max_steps=max_steps, with_slots=mode == "counts")

    def fn(bids, bl, bsl, plan, is_rec):
        return replay_load(bl, plan, split, bsl if is_rec and mode == "counts" else None, shape.top_k,
                           shape.bytes_per_token)

    return _InMemory(ids, load, slot_load, recorded_plan(store, run_id, shape), mode, cost, shape.timing(passes), fn)


def replay_run(store, run_id: str, shape: Shape, opts: ReplayOptions, plan=None, *, policy: str | None = None,
               cluster: ClusterSpec | None = None, fit_window=None, in_sample: bool = False, write: bool = True,
               trace_steps=None, chrome_trace=None, params: dict | None = None) -> ReplayResult:
    """What ``moetrace replay`` does (:meth:`moetrace.run.Run.replay`): ``plan`` (a Plan, a
    stored plan id or ``"recorded"``) or ``policy`` fitted on ``fit_window`` on ``cluster``,
    judged by :func:`judge_plan`; the predicted timeline of ``trace_steps`` written to
    ``chrome_trace`` when given. ``params``: the caller's options, stored with the result."""
    from ..placement import plan_files as plan_io
    from ..placement.plan_store import load_plan
    from .trace import chrome_trace as write_trace

    notes: list[str] = []
    judged = None
    if plan is None:
        ps = shape.plan_shape(cluster, streamed=True)
        plan, judged = fit_plan(store, run_id, shape, policy, ps, fit_window, in_sample=in_sample)
    elif isinstance(plan, str):
        pid = plan
        plan = load_plan(store, run_id, pid, shape)
        meta = plan_io.plan_meta(store, run_id, pid)
        if pid != "recorded" and meta is not None and meta.get("fit_end") is not None:
            judged = judged_steps(shape, (int(meta["fit_start"]), int(meta["fit_end"])), in_sample, pid)
        else:
            notes = plan_io.fit_notes(meta, shape.steps, pid)
    elif not isinstance(plan, Plan):
        raise TypeError("plan must be a Plan, a stored plan id or 'recorded'")
    if chrome_trace and not trace_steps:
        trace_steps = [int(judged.steps[0]) if judged is not None else int(shape.steps[0])]
    res = judge_plan(store, run_id, shape, plan, opts, judged=judged, write=write, fitted=policy is not None,
                     extra_notes=notes, trace_steps=trace_steps,
                     params={"policy": policy, "plan": plan.plan_id, "fit_window": fit_window,
                             "in_sample": in_sample, **(params or {})})
    if chrome_trace:
        if res.trace is None:
            raise InputError(None, f"--trace-steps {trace_steps}: none of these steps were judged")
        write_trace(chrome_trace, res.trace, res.plan_desc)
    return res

"""Replays over a store: fixed plans, re-planning policies over time, and sweeps.

``replay(store, run_id, ...)`` replays the run's recorded load (or per-token routing)
against one plan and writes ``replay_layer``, ``replay_rank`` and ``replay_runs`` rows;
``drift(...)`` compares a static plan, periodic re-planning and an oracle; ``sweep(...)``
tabulates replica budgets and re-plan intervals. Each returns the summary dict that
``moetrace replay --json`` prints.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..errors import InputError
from . import cost as costmod
from .engine import (Block, RunShape, approximation_notes, iter_load, layer_metrics, load_plan, read_load,
                     recorded_plan, replay_load, replay_routing, summarize)
from .moves import moves_between, replan
from .planners import Plan, make_plan
from .relabel import relabel


@dataclass
class ReplayOptions:
    split: str = "even"
    hardware: str = "H200"
    fit_cost: bool = True
    rank_rows: bool = True
    chunk_steps: int = 1000


def new_replay_id(prefix: str = "r") -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def cost_model(store, run_id: str, shape: RunShape, hardware: str = "H200", fit: bool = True):
    base = costmod.preset(hardware, shape.hidden, shape.expert_bytes)
    if fit:
        fitted = costmod.fit_from_store(store, run_id, base)
        if fitted is not None:
            return fitted
    return base


def routing_has_slots(store, run_id) -> bool:
    """True when every per-token routing row records its physical slot."""
    r = store.sql("SELECT count(*) AS n, count(slot) AS s FROM routing WHERE run_id = ?", [run_id]).row(0)
    return r[0] > 0 and r[0] == r[1]


def _routing_block(store, run_id, shape, plan, split, ids, use_recorded_slot=False) -> Block:
    tbl = store.arrow("""SELECT step, layer, token, src_rank, expert, slot FROM routing
                         WHERE run_id = ? AND step BETWEEN ? AND ?""", [run_id, int(ids[0]), int(ids[-1])])
    ti = np.searchsorted(ids, tbl.column("step").to_numpy())
    li = np.searchsorted(plan.layers, tbl.column("layer").to_numpy())
    src = tbl.column("src_rank").to_numpy(zero_copy_only=False).astype(np.float64)
    tok = tbl.column("token").to_numpy()
    src = np.where(np.isnan(src), tok % plan.num_ranks, src).astype(np.int64)
    rs = tbl.column("slot").to_numpy(zero_copy_only=False) if use_recorded_slot else None
    return replay_routing(ti, li, tok, src, tbl.column("expert").to_numpy(), ids.size, plan, split,
                          shape.bytes_per_token, recorded_slot=rs)


def _layer_table(ids, layers, m, replay_id, plan_ids=None, ages=None) -> pa.Table:
    T, L = m.imbalance.shape
    n = T * L
    return pa.table({
        "replay_id": pa.array([replay_id] * n, pa.string()),
        "step": np.repeat(ids, L).astype(np.int64), "layer": np.tile(layers, T).astype(np.int32),
        "plan_id": pa.array(np.repeat(plan_ids, L) if plan_ids is not None else [None] * n, pa.string()),
        "plan_age_steps": pa.array(np.repeat(ages, L) if ages is not None else [None] * n, pa.int64()),
        "max_rank_tokens": m.max_tokens.ravel(), "mean_rank_tokens": m.mean_tokens.ravel(),
        "imbalance": m.imbalance.ravel(), "straggler_rank": m.straggler.ravel().astype(np.int32),
        "predicted_ns": np.rint(m.layer_ns.ravel()).astype(np.int64)})


def _rank_table(ids, layers, block: Block, m, replay_id) -> pa.Table:
    T, L, R = block.tokens.shape
    n = T * L * R
    return pa.table({
        "replay_id": pa.array([replay_id] * n, pa.string()),
        "step": np.repeat(ids, L * R).astype(np.int64),
        "layer": np.tile(np.repeat(layers, R), T).astype(np.int32),
        "rank": np.tile(np.arange(R), T * L).astype(np.int32),
        "tokens": block.tokens.ravel().astype(np.float64),
        "slots_touched": np.rint(block.touched).ravel().astype(np.int32),
        "dispatch_bytes_intra": np.rint(block.bytes_intra).ravel().astype(np.int64),
        "dispatch_bytes_inter": np.rint(block.bytes_inter).ravel().astype(np.int64),
        "predicted_ns": np.rint(m.rank_ns).ravel().astype(np.int64)})


def _runs_row(replay_id, kind, policy, plan_id, split, summary, plan: Plan, cost, params, notes, exact):
    return pa.table({
        "replay_id": [replay_id], "created_at_ns": [time.time_ns()], "kind": [kind], "policy": [policy],
        "plan_id": pa.array([plan_id], pa.string()), "split": [split],
        "num_steps": [summary["num_steps"]], "num_layers": [plan.num_layers], "num_ranks": [plan.num_ranks],
        "num_slots": [plan.num_slots], "mean_imbalance": [summary["mean_imbalance"]],
        "p99_imbalance": [summary["p99_imbalance"]], "predicted_step_ns": [summary["predicted_step_ns"]],
        "mean_efficiency": [summary.get("mean_efficiency")], "moved_experts": [summary["moved_experts"]],
        "moved_bytes": [summary["moved_bytes"]], "exact_bytes": [exact], "cost_json": [cost.to_json()],
        "params_json": [json.dumps(params, sort_keys=True, default=str)],
        "summary_json": [json.dumps(summary, sort_keys=True, default=str)],
        "approximations": [json.dumps(notes)]})


def replay_plan(store, run_id: str, plan: Plan, shape: RunShape, opts: ReplayOptions, *, kind="replay",
                policy=None, params=None, write=True, replay_id=None, extra_notes=(), trace_steps=None):
    """Replay every recorded step against ``plan``. Returns (summary, trace): trace holds
    the arrays of ``trace_steps`` (for :func:`moetrace.replay.trace.chrome_trace`)."""
    replay_id = replay_id or new_replay_id()
    cost = cost_model(store, run_id, shape, opts.hardware, opts.fit_cost)
    is_recorded = plan.plan_id == "recorded"
    routed_slots = is_recorded and shape.has_routing and routing_has_slots(store, run_id)
    use_slots = is_recorded and shape.has_slot and not routed_slots
    use_routing = shape.has_routing and not use_slots
    layer_tbls, rank_tbls = [], []
    imbs, lns, means = [], [], []
    kept = []
    nodes_max, nodes_mean = [], []
    block = None
    chunk = opts.chunk_steps
    if use_routing:   # per-token rows are k x tokens per (step, layer): keep chunks near 4 M rows
        n = store.sql("SELECT count(*) AS n FROM routing WHERE run_id = ?", [run_id])["n"][0]
        chunk = max(1, min(chunk, int(4_000_000 * shape.steps.size // max(int(n), 1))))
    for ids, load, slot_load in iter_load(store, run_id, shape, chunk, with_slots=use_slots):
        if use_routing:
            block = _routing_block(store, run_id, shape, plan, opts.split, ids, routed_slots)
            nodes_max.append(block.nodes_per_token_max)
            nodes_mean.append(block.nodes_per_token_mean)
        else:
            block = replay_load(load, plan, opts.split, slot_load if use_slots else None, shape.top_k,
                                shape.bytes_per_token)
        m = layer_metrics(block, cost)
        imbs.append(m.imbalance)
        lns.append(m.layer_ns)
        means.append(m.rank_ns.mean(axis=2))
        if write:
            layer_tbls.append(_layer_table(ids, plan.layers, m, replay_id, [plan.plan_id] * ids.size))
            if opts.rank_rows:
                rank_tbls.append(_rank_table(ids, plan.layers, block, m, replay_id))
        if trace_steps is not None:
            sel = np.isin(ids, trace_steps)
            if sel.any():
                kept.append((ids[sel], block.tokens[sel], block.touched[sel], m.dispatch_ns[sel],
                             m.compute_ns[sel], m.layer_ns[sel]))
    imb, lns_all = np.concatenate(imbs), np.concatenate(lns)
    summary = {"replay_id": replay_id, "run_id": run_id, "kind": kind, "policy": policy or plan.policy,
               "plan_id": plan.plan_id, "split": "recorded" if (use_slots or routed_slots) else opts.split,
               "num_steps": int(imb.shape[0]), "num_layers": plan.num_layers, "num_ranks": plan.num_ranks,
               "num_slots": plan.num_slots, "redundant_slots": plan.replicas,
               **summarize(imb, lns_all, np.concatenate(means)),
               "moved_experts": 0, "moved_bytes": 0,
               "exact_bytes": bool(use_routing), "cost": cost.describe()}
    if nodes_max:
        summary["nodes_per_token_max"] = int(max(nodes_max))
        summary["nodes_per_token_mean"] = float(np.mean(nodes_mean))
    notes = list(shape.notes) + approximation_notes(block, opts.split, use_slots, shape.has_routing) + list(extra_notes)
    if is_recorded and "contiguous assumed" in (plan.policy or ""):
        notes.append("no placement recorded for this run: its own layout is taken as contiguous (slot = expert)")
    if routed_slots:
        notes.append("per-token routing with recorded slots: tokens and dispatch bytes exact")
    elif is_recorded and shape.has_slot and shape.has_routing:
        notes.append("per-rank tokens from recorded per-slot counts; per-token routing has no slots, so "
                     "dispatch bytes are estimated")
    summary["approximations"] = notes
    if write:
        store.append(run_id, {"replay_layer": layer_tbls, "replay_rank": rank_tbls,
                              "replay_runs": _runs_row(replay_id, kind, summary["policy"], plan.plan_id,
                                                       summary["split"], summary, plan, cost, params or {}, notes,
                                                       bool(use_routing))})
    trace = None
    if kept:
        trace = {"steps": np.concatenate([k[0] for k in kept]),
                 **{name: np.concatenate([k[i] for k in kept])
                    for i, name in enumerate(("tokens", "touched", "dispatch_ns", "compute_ns", "layer_ns"), 1)},
                 "layers": plan.layers, "cost_source": cost.source}
    return summary, trace


def fit_plan(store, run_id, shape: RunShape, policy: str, plan_shape, fit_window=None, plan_id=None) -> tuple[Plan, list[str]]:
    """Plan ``policy`` fitted on the summed load of steps in fit_window (default: all)."""
    ids, load = read_load(store, run_id, shape, fit_window)
    if ids.size == 0:
        raise InputError(None, f"--fit-window {fit_window} holds no recorded steps")
    plan = make_plan(policy, load.sum(axis=0, dtype=np.float64), plan_shape, layers=shape.layers, plan_id=plan_id)
    notes = []
    if fit_window is None:
        notes.append("plan fitted on the same steps it is judged on (in-sample; use --fit-window for out-of-sample)")
    else:
        notes.append(f"plan fitted on {ids.size} steps in [{fit_window[0]}, {fit_window[1]}); the replay judges all "
                     f"{shape.steps.size} steps, those included")
    return plan, notes


# ----------------------------------------------------------------------------- drift
def drift(store, run_id: str, shape: RunShape, policy: str, plan_shape, every: int, window: int,
          opts: ReplayOptions, max_moves: int | None = None, write: bool = True, static_window=None) -> dict:
    """Static plan (fitted once on the first ``window`` steps, or ``static_window``) vs
    re-planning every ``every`` steps from the trailing ``window`` steps (with
    ``max_moves`` the move-aware re-planner starts from the previous plan) vs an oracle
    fitted on each block's own steps. All three are judged on the steps after the first
    window. Returns the summary with one entry per policy and the per-step series."""
    if every < 1 or window < 1:
        raise InputError(None, "--replan-every and --window must be >= 1")
    ids, load = read_load(store, run_id, shape)
    T = ids.size
    if T <= window:
        raise InputError(None, f"the run has {T} steps; --window {window} leaves none to judge")
    cost = cost_model(store, run_id, shape, opts.hardware, opts.fit_cost)
    lo, hi = static_window or (0, window)
    sl = (ids >= lo) & (ids < hi)
    static = make_plan(policy, load[sl].sum(axis=0, dtype=np.float64), plan_shape, layers=shape.layers,
                       plan_id=f"{policy}-static")
    judged = np.arange(window, T)
    starts = list(range(window, T, every))
    series = {}
    out = {"policy": policy, "every": every, "window": window, "max_moves": max_moves, "judged_steps": int(judged.size)}
    base_id = new_replay_id("d")
    for kind in ("static", "replan", "oracle"):
        imb_parts, ln_parts, mean_parts, tables, ranks, plan_ids, ages = [], [], [], [], [], [], []
        moved = unrelabeled = 0
        replans = []
        prev = static
        for t0 in starts:
            t1 = min(t0 + every, T)
            if kind == "static":
                plan, age0 = static, t0 - (hi - 1 if static_window else window - 1)
            elif kind == "replan":
                wl = load[max(0, t0 - window):t0].sum(axis=0, dtype=np.float64)
                if max_moves is not None:
                    plan, info = replan(prev, wl, max_moves=max_moves, policy_name="moves")
                    mv = info["moves"]
                else:   # a full re-plan, its ranks renamed to keep experts where prev has them
                    plan, rinfo = relabel(prev, make_plan(policy, wl, plan_shape, layers=shape.layers))
                    mv = int(moves_between(prev, plan).sum()) if t0 != window else 0
                    unrelabeled += rinfo.get("moves_before", mv) if t0 != window else 0
                plan.plan_id = f"{kind}@{int(ids[t0])}"
                if t0 == window:   # the first re-plan is the static plan's twin: no move
                    mv = 0
                moved += mv
                replans.append({"step": int(ids[t0]), "moves": mv, "bytes": mv * shape.expert_bytes * 1})
                prev, age0 = plan, 1
            else:
                plan = make_plan(policy, load[t0:t1].sum(axis=0, dtype=np.float64), plan_shape, layers=shape.layers,
                                 plan_id=f"oracle@{int(ids[t0])}")
                age0 = None
            block = replay_load(load[t0:t1], plan, opts.split, None, shape.top_k, shape.bytes_per_token)
            m = layer_metrics(block, cost)
            imb_parts.append(m.imbalance)
            ln_parts.append(m.layer_ns)
            mean_parts.append(m.rank_ns.mean(axis=2))
            plan_ids += [plan.plan_id] * (t1 - t0)
            ages += [None] * (t1 - t0) if age0 is None else list(range(age0, age0 + t1 - t0))
            if write:
                tables.append(_layer_table(ids[t0:t1], shape.layers, m, f"{base_id}-{kind}",
                                           np.array(plan_ids[-(t1 - t0):], dtype=object),
                                           None if age0 is None else np.arange(age0, age0 + t1 - t0)))
                if opts.rank_rows:
                    ranks.append(_rank_table(ids[t0:t1], shape.layers, block, m, f"{base_id}-{kind}"))
        imb = np.concatenate(imb_parts)
        s = {**summarize(imb, np.concatenate(ln_parts), np.concatenate(mean_parts)),
             "moved_experts": moved, "moved_bytes": moved * shape.expert_bytes, "num_steps": int(imb.shape[0]),
             "replay_id": f"{base_id}-{kind}"}
        if kind == "replan":
            s["replans"] = replans
            if max_moves is None:   # what the planner's own rank numbering would have moved
                s["moved_experts_without_relabel"] = unrelabeled
        series[kind] = imb.mean(axis=1)
        out[kind] = s
        if write:
            notes = list(shape.notes) + approximation_notes(block, opts.split, False, False)
            notes.append("drift replay uses aggregated expert_load (per-token routing not used)")
            params = {"policy": policy, "every": every, "window": window, "max_moves": max_moves,
                      "split": opts.split, "static_window": [lo, hi]}
            store.append(run_id, {"replay_layer": tables, "replay_rank": ranks,
                                  "replay_runs": _runs_row(f"{base_id}-{kind}", f"drift-{kind}", policy, None,
                                                           opts.split, s, static, cost, params, notes, False)})
    out["series"] = {"step": ids[window:].tolist(), **{k: v.tolist() for k, v in series.items()}}
    out["cost"] = cost.describe()
    # how the stale plan ages: mean imbalance by age quartile
    st = series["static"]
    q = np.array_split(st, 4) if st.size >= 4 else [st]
    out["static_by_age_quartile"] = [float(x.mean()) for x in q]
    # how fast a fresh plan goes stale: re-planned imbalance by steps since its re-plan
    age = (np.arange(judged.size) % every) + 1
    out["replan_by_age"] = {"age": list(range(1, min(every, judged.size) + 1)),
                            "mean_imbalance": [float(series["replan"][age == a].mean())
                                               for a in range(1, min(every, judged.size) + 1)]}
    # headline fields (as for replay --json): the re-planning policy
    for k in ("mean_imbalance", "p99_imbalance", "predicted_step_ns", "moved_experts", "moved_bytes", "replay_id"):
        out[k] = out["replan"][k]
    return out


# ----------------------------------------------------------------------------- sweeps
def sweep(store, run_id: str, shape: RunShape, policy: str, replicas: list[int], intervals: list[int],
          window: int | None, opts: ReplayOptions, ranks: int | None = None, groups=None, nodes=None) -> list[dict]:
    """Rows of the operator's decision table: replica budgets (static plan fitted on all
    steps) and re-plan intervals (with the largest replica budget that fits)."""
    ids, load = read_load(store, run_id, shape)
    cost = cost_model(store, run_id, shape, opts.hardware, opts.fit_cost)
    total = load.sum(axis=0, dtype=np.float64)
    rows = []
    R = ranks or shape.num_ranks
    base = None
    for rep in replicas:
        ps = shape.plan_shape(ranks=R, replicas=rep, groups=groups, nodes=nodes)
        if policy != "one-per-rank" and ps.num_slots % ps.num_ranks:
            rows.append({"what": f"replicas {rep}", "skipped": f"{ps.num_slots} slots do not divide over {R} ranks"})
            continue
        plan = make_plan(policy, total, ps, layers=shape.layers)
        m = layer_metrics(replay_load(load, plan, opts.split, None, shape.top_k, shape.bytes_per_token), cost)
        s = summarize(m.imbalance, m.layer_ns, m.rank_ns.mean(axis=2))
        base = base or s["predicted_step_ns"]
        rows.append({"what": f"replicas {rep}", "replicas": rep, "replan_every": None,
                     "judged_on": f"all {ids.size} steps (plan fitted on them)",
                     "extra_mem_per_rank_bytes": int(rep * shape.expert_bytes * shape.layers.size / plan.num_ranks),
                     "mean_imbalance": s["mean_imbalance"], "p99_imbalance": s["p99_imbalance"],
                     "efficiency": s["mean_efficiency"], "predicted_step_ns": s["predicted_step_ns"],
                     "speedup_vs_first": base / s["predicted_step_ns"] if s["predicted_step_ns"] else None,
                     "moved_experts": 0, "moved_bytes": 0})
    for every in intervals:
        rep = max([r for r in replicas if (shape.num_experts + r) % R == 0] or [0])
        ps = shape.plan_shape(ranks=R, replicas=rep, groups=groups, nodes=nodes)
        w = window or every
        if ids.size <= w:
            rows.append({"what": f"replan every {every}", "skipped": f"run has {ids.size} steps <= window {w}"})
            continue
        d = drift(store, run_id, shape, policy, ps, every, w, opts, write=False)
        s = d["replan"]
        rows.append({"what": f"replan every {every}", "replicas": rep, "replan_every": every,
                     "judged_on": f"steps after the first {w} (trailing-window plans)",
                     "extra_mem_per_rank_bytes": int(rep * shape.expert_bytes * shape.layers.size / ps.num_ranks),
                     "mean_imbalance": s["mean_imbalance"], "p99_imbalance": s["p99_imbalance"],
                     "efficiency": s.get("mean_efficiency"), "predicted_step_ns": s["predicted_step_ns"],
                     "speedup_vs_first": base / s["predicted_step_ns"] if base and s["predicted_step_ns"] else None,
                     "moved_experts": s["moved_experts"], "moved_bytes": s["moved_bytes"],
                     "static_mean_imbalance": d["static"]["mean_imbalance"],
                     "oracle_mean_imbalance": d["oracle"]["mean_imbalance"]})
    return rows

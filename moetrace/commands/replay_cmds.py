"""Replay commands: plan, replay, sweep."""
from __future__ import annotations

import json

import click
import numpy as np
import polars as pl

from ..errors import InputError
from ..output import emit, output_options
from ..store import Store
from ._options import steps_range


_steps_range = steps_range


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


def shape_options(f):
    from ..replay.planners import PLANNERS

    opts = [
        click.option("--run", "run_id", default=None, help="Run id (default: the store's only run)."),
        click.option("--policy", type=click.Choice(list(PLANNERS)), default=None, help="Planner."),
        click.option("--ranks", type=int, default=None, help="Expert-parallel ranks (default: the run's)."),
        click.option("--replicas", type=int, default=None, help="Redundant slots per layer (default: the run's)."),
        click.option("--groups", type=int, default=None, help="Expert groups for EPLB (default: the run's)."),
        click.option("--nodes", type=int, default=None, help="Nodes for EPLB (default: ranks / ranks-per-node)."),
        click.option("--ranks-per-node", "rpn", type=int, default=None, help="Ranks per node (default: the run's)."),
        click.option("--fit-window", callback=_steps_range, default=None,
                     help="Fit the plan on steps A <= step < B (A:B); default all steps."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _open(store, run_id):
    from ..replay.engine import RunShape

    st = Store(store)
    rid = st.resolve_run(run_id)
    return st, rid, RunShape.from_store(st, rid)


def _imbalance(plan, load):
    rl = np.einsum("le,ler->lr", load, plan.share())
    mean = rl.mean(axis=1)
    return np.where(mean > 0, rl.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


@click.command()
@click.argument("store", type=click.Path(file_okay=False))
@shape_options
@click.option("--plan", "plan_id_in", default=None, help="Start from a stored plan ('recorded' = the run's own).")
@click.option("--import", "import_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read a plan file (SGLang physical_to_logical_map / logical_count JSON, EPLB JSON, TensorRT-LLM "
                   "EPLB config YAML, or vllm-ascend expert map JSON).")
@click.option("--max-moves", type=int, default=None, help="Move-aware re-plan from --plan with at most K expert moves.")
@click.option("--target-imbalance", type=float, default=None, help="Move-aware re-plan: stop at this max/mean.")
@click.option("--plan-id", default=None, help="Id to store the plan under (default: the policy name).")
@click.option("--no-store", is_flag=True, help="Do not write the plan into the store.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None, help="Export the plan to FILE.")
@click.option("--out-format", type=click.Choice(["sglang", "eplb", "trtllm", "vllm-ascend"]), default="sglang",
              show_default=True, help="sglang: --init-expert-location JSON; eplb: phy2log/log2phy/logcnt JSON; "
              "trtllm: TensorRT-LLM moe_config.load_balancer YAML; vllm-ascend: expert map JSON (expert_map_path).")
@click.option("--list", "list_plans", is_flag=True, help="List the run's stored plans and exit.")
@click.option("--no-relabel", is_flag=True,
              help="Keep the planner's own rank numbering (default: ranks of a --policy plan are renamed to "
                   "keep the most experts where the start plan, --plan or the recorded one, has them).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def plan(store, run_id, policy, ranks, replicas, groups, nodes, rpn, fit_window, plan_id_in, import_file,
         max_moves, target_imbalance, plan_id, no_store, out_file, out_format, list_plans, no_relabel, as_json):
    """Make an expert placement plan (or import / re-plan / export one) and store it.

    The plan is fitted on the run's summed load (all steps or --fit-window), stored in the
    placement table under --plan-id, and exported with --out as SGLang
    --init-expert-location JSON or EPLB-style JSON. With --plan and --max-moves the
    move-aware re-planner changes as few slots as it can; with --plan and --policy the
    policy re-plans from scratch and its ranks are renamed to keep the most experts where
    the --plan plan has them (renaming ranks is free; without --plan, the recorded plan).

    Example:

    \b
        moetrace plan demo --policy eplb --replicas 32 --plan-id eplb32 --out eplb32.json
    """
    from ..replay import plan_io
    from ..replay.engine import load_plan, read_load
    from ..replay.moves import moves_between, replan
    from ..replay.planners import make_plan
    from ..replay.relabel import relabel

    st, rid, shape = _open(store, run_id)
    if list_plans:
        df = st.sql("""SELECT plan_id, count(DISTINCT layer) AS layers, max(slot) + 1 AS slots,
                       max(rank) + 1 AS ranks, max(node) + 1 AS nodes FROM placement WHERE run_id = ?
                       GROUP BY plan_id ORDER BY plan_id""", [rid]) if st.has_files("placement") else pl.DataFrame()
        emit(df if df.height else pl.DataFrame({"plan_id": ["recorded (contiguous, not stored)"]}))
        return
    moves_mode = max_moves is not None or target_imbalance is not None
    sources = sum(x is not None for x in (policy, import_file)) + (plan_id_in is not None and not moves_mode
                                                                     and policy is None)
    if moves_mode and (not plan_id_in or policy or import_file):
        raise click.UsageError("--max-moves / --target-imbalance re-plan from --plan ID (without --policy)")
    if sources != 1 and not (plan_id_in and moves_mode):
        raise click.UsageError("give one of --policy (optionally with --plan PREV), --import, --plan ID (export), "
                               "or --plan ID with --max-moves")
    ids, load = read_load(st, rid, shape, fit_window)
    if ids.size == 0 and (policy or moves_mode):
        what = f"--fit-window {fit_window[0]}:{fit_window[1]}" if fit_window else "the run"
        raise InputError(None, f"{what} holds no recorded steps")
    total = load.sum(axis=0, dtype=np.float64)
    base = load_plan(st, rid, "recorded", shape)
    info = {}
    relabel_info = None
    if policy:
        ps = shape.plan_shape(ranks=ranks, replicas=replicas, groups=groups, nodes=nodes, rpn=rpn)
        p = make_plan(policy, total, ps, layers=shape.layers)
        if plan_id_in:
            base = load_plan(st, rid, plan_id_in, shape)
        if not no_relabel:   # the new plan replaces base: rename its ranks to keep experts in place
            p, relabel_info = relabel(base, p)
    elif import_file:
        p = plan_io.import_plan(import_file, shape.num_experts, ranks or shape.num_ranks,
                                rpn or shape.ranks_per_node, shape.layers, groups or shape.num_groups)
    else:
        start = load_plan(st, rid, plan_id_in, shape)
        if max_moves is not None or target_imbalance is not None:
            p, info = replan(start, total, max_moves=max_moves, target_imbalance=target_imbalance)
            base = start
        else:
            p = start
    pid = plan_id or (p.plan_id if p.plan_id and not policy else None) or (
        f"moves{max_moves}" if info else (policy or "imported"))
    try:
        moved = int(moves_between(base, p).sum()) if base.num_ranks == p.num_ranks else None
    except ValueError:
        moved = None
    imb_before = _imbalance(base, total) if base.num_ranks and base.num_slots else None
    imb = _imbalance(p, total)
    summary = {"run_id": rid, "plan_id": pid, "policy": p.policy, "layers": p.num_layers, "slots": p.num_slots,
               "ranks": p.num_ranks, "ranks_per_node": p.ranks_per_node, "redundant_slots": p.replicas,
               "fit_steps": int(ids.size), "fit_window": list(fit_window) if fit_window else None,
               "mean_imbalance_on_fit_load": float(imb.mean()),
               "start_plan": base.plan_id, "start_mean_imbalance_on_fit_load":
                   float(imb_before.mean()) if imb_before is not None else None,
               "moved_experts_vs_start": moved,
               "moved_bytes_vs_start": moved * shape.expert_bytes if moved is not None else None,
               "relabeled": bool(relabel_info and relabel_info["relabeled"]),
               "moved_experts_without_relabel": relabel_info["moves_before"]
                   if relabel_info and relabel_info["relabeled"] else None,
               "params": p.params}
    if not no_store and not (plan_id_in and pid == plan_id_in):
        fitted = policy or info   # a planner or the move-aware re-planner ran on this load
        fit = ((fit_window[0], fit_window[1]) if fit_window else (int(ids.min()), int(ids.max()) + 1)) \
            if fitted and ids.size else None
        summary["stored_rows"] = plan_io.save_plan(st, rid, p, pid, fit=fit + (int(ids.size),) if fit else None,
                                                   start_plan_id=base.plan_id if (policy and relabel_info) or info
                                                   else None)
    if out_file:
        summary["out"] = str(plan_io.export_plan(p, out_file, out_format))
        summary["out_format"] = out_format
    if as_json:
        click.echo(json.dumps(summary, default=str))
        return
    click.echo(f"plan {pid}: {p.describe()}")
    what = "fitted on" if policy or info else "judged on the load of"
    click.echo(f"  {what} {ids.size} steps; max/mean rank load on that load: {imb.mean():.3f} "
               f"(start plan {base.plan_id}: {summary['start_mean_imbalance_on_fit_load']:.3f})")
    if moved is not None:
        extra = (f" (ranks renamed to match {base.plan_id}; {summary['moved_experts_without_relabel']} with the "
                 f"planner's own numbering)" if summary["relabeled"] else "")
        click.echo(f"  moves vs {base.plan_id}: {moved} expert copies, {moved * shape.expert_bytes / 2**30:.2f} GiB"
                   + extra)
    if "stored_rows" in summary:
        click.echo(f"  stored {summary['stored_rows']} placement rows as plan_id {pid!r}")
    if out_file:
        click.echo(f"  wrote {out_file} ({out_format})")


@click.command()
@click.argument("store", type=click.Path(file_okay=False))
@shape_options
@click.option("--plan", "plan_id", default=None, help="Replay a stored plan ('recorded' = the run's own).")
@click.option("--replan-every", type=int, default=None, help="Re-plan every N steps (drift replay).")
@click.option("--window", type=int, default=None, help="Re-plan from the trailing W steps (default N).")
@click.option("--max-moves", type=int, default=None, help="Drift: move-aware re-plans with at most K moves each.")
@click.option("--split", type=click.Choice(["even", "hash", "local"]), default="even", show_default=True,
              help="How an expert's tokens split over its replicas.")
@click.option("--hardware", type=click.Choice(["H100", "H200", "H800", "B200"], case_sensitive=False),
              default="H200", show_default=True, help="Cost model preset (fitted from spans when the run has them).")
@click.option("--no-fit", "no_fit", is_flag=True, help="Use the preset even when the run has expert_gemm spans.")
@click.option("--chrome-trace", type=click.Path(dir_okay=False), default=None,
              help="Write the predicted timeline of --trace-steps as a Chrome/Perfetto trace.")
@click.option("--trace-steps", callback=_int_list, default=None, help="Steps for --chrome-trace (default: the first).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Drift: imbalance-over-time PNG.")
@click.option("--no-rank-rows", is_flag=True, help="Do not write replay_rank rows (large replays).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary object as JSON.")
def replay(store, run_id, policy, ranks, replicas, groups, nodes, rpn, fit_window, plan_id, replan_every, window,
           max_moves, split, hardware, no_fit, chrome_trace, trace_steps, plot, no_rank_rows, as_json):
    """Replay the run's recorded routing against a plan and predict per-rank loads,
    stragglers, all-to-all bytes and layer time.

    Results go to replay_layer, replay_rank and replay_runs (query them with moetrace
    sql). With --replan-every N the replay re-plans every N steps from the trailing
    --window steps and compares with a static plan and an oracle.

    Example:

    \b
        moetrace replay demo --policy eplb --replicas 32 --fit-window 0:25 --json
    """
    from ..replay import api
    from ..replay.engine import load_plan
    from ..replay.trace import chrome_trace as write_trace

    if (plan_id is None) == (policy is None):
        raise click.UsageError("give exactly one of --plan PLAN_ID or --policy P")
    st, rid, shape = _open(store, run_id)
    opts = api.ReplayOptions(split=split, hardware=hardware.upper(), fit_cost=not no_fit, rank_rows=not no_rank_rows)
    if replan_every:
        if not policy:
            raise click.UsageError("--replan-every needs --policy (the planner re-run at every re-plan)")
        ps = shape.plan_shape(ranks=ranks, replicas=replicas, groups=groups, nodes=nodes, rpn=rpn)
        d = api.drift(st, rid, shape, policy, ps, replan_every, window or replan_every, opts, max_moves=max_moves,
                      static_window=fit_window)
        if plot:
            from ..replay.plots import drift_plot

            drift_plot(d, plot)
        if as_json:
            out = {k: v for k, v in d.items() if k != "series"}
            click.echo(json.dumps(out, default=str))
            return
        click.echo(f"drift replay of run {rid}: {policy}, re-plan every {replan_every} from the last "
                   f"{window or replan_every} steps; judged on {d['judged_steps']} steps")
        for k in ("static", "replan", "oracle"):
            s = d[k]
            click.echo(f"  {k:<7} mean imbalance {s['mean_imbalance']:.3f}  p99 {s['p99_imbalance']:.3f}  "
                       f"predicted MoE time/step {s['predicted_step_ns'] / 1e6:.3f} ms  moved {s['moved_experts']} "
                       f"experts ({s['moved_bytes'] / 2**30:.2f} GiB)  [{s['replay_id']}]")
        if d["replan"].get("moved_experts_without_relabel") is not None:
            click.echo(f"  re-plans' ranks renamed to keep experts in place: {d['replan']['moved_experts']} moves "
                       f"instead of {d['replan']['moved_experts_without_relabel']} with the planner's own numbering")
        click.echo("  stale plan by age quartile: " + ", ".join(f"{x:.3f}" for x in d["static_by_age_quartile"]))
        ra = d["replan_by_age"]
        click.echo("  re-planned plan by steps since re-plan: " + ", ".join(
            f"{a}: {x:.3f}" for a, x in zip(ra["age"], ra["mean_imbalance"])))
        if plot:
            click.echo(f"  wrote {plot}")
        return
    notes = []
    if plan_id:
        from ..replay import plan_io

        p = load_plan(st, rid, plan_id, shape)
        notes = plan_io.fit_notes(plan_io.plan_meta(st, rid, plan_id), shape.steps, plan_id)
    else:
        ps = shape.plan_shape(ranks=ranks, replicas=replicas, groups=groups, nodes=nodes, rpn=rpn)
        p, notes = api.fit_plan(st, rid, shape, policy, ps, fit_window, plan_id=None)
    params = {"plan": plan_id, "policy": policy, "fit_window": fit_window, "split": split, "hardware": hardware,
              "ranks": p.num_ranks, "slots": p.num_slots, "plan_params": p.params}
    tsteps = None
    if chrome_trace:
        tsteps = trace_steps or [int(shape.steps[0])]
    summary, tr = api.replay_plan(st, rid, p, shape, opts, policy=policy or f"plan {plan_id}", params=params,
                                  extra_notes=notes, trace_steps=tsteps)
    if chrome_trace:
        if tr is None:
            raise InputError(None, f"--trace-steps {tsteps}: none of these steps were recorded")
        write_trace(chrome_trace, tr["steps"], tr["layers"], tr["tokens"], tr["touched"], tr["dispatch_ns"],
                    tr["compute_ns"], tr["layer_ns"], p.describe(), tr["cost_source"])
        summary["chrome_trace"] = chrome_trace
    if as_json:
        click.echo(json.dumps(summary, default=str))
        return
    click.echo(f"replay {summary['replay_id']} of run {rid}: {p.describe()}; split {summary['split']}")
    click.echo(f"  {summary['num_steps']} steps x {summary['num_layers']} layers: mean max/mean rank tokens "
               f"{summary['mean_imbalance']:.3f}, p99 {summary['p99_imbalance']:.3f}, efficiency "
               f"{summary['mean_efficiency']:.3f}")
    click.echo(f"  predicted MoE time per step {summary['predicted_step_ns'] / 1e6:.3f} ms "
               f"(cost model: {summary['cost']['source'].split(':')[0]})")
    if "nodes_per_token_max" in summary:
        click.echo(f"  per-token routing: exact dispatch bytes; nodes per token mean "
                   f"{summary['nodes_per_token_mean']:.2f}, max {summary['nodes_per_token_max']}")
    for n in summary["approximations"]:
        click.echo(f"  note: {n}")
    if chrome_trace:
        click.echo(f"  wrote {chrome_trace} (open in https://ui.perfetto.dev)")


@click.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--run", "run_id", default=None, help="Run id (default: the store's only run).")
@click.option("--policy", default="eplb", show_default=True, help="Planner.")
@click.option("--replicas", "replicas", callback=_int_list, default="0,16,32,64", show_default=True,
              help="Replica budgets (redundant slots per layer).")
@click.option("--replan-every", "intervals", callback=_int_list, default=None,
              help="Re-plan intervals in steps (comma-separated).")
@click.option("--window", type=int, default=None, help="Re-plan window (default: the interval).")
@click.option("--ranks", type=int, default=None, help="Expert-parallel ranks (default: the run's).")
@click.option("--split", type=click.Choice(["even", "hash", "local"]), default="even", show_default=True)
@click.option("--hardware", type=click.Choice(["H100", "H200", "H800", "B200"], case_sensitive=False),
              default="H200", show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write the decision plot (PNG).")
@output_options
def sweep(store, run_id, policy, replicas, intervals, window, ranks, split, hardware, plot, fmt, output):
    """Sweep replica budgets and re-plan intervals: predicted step time and efficiency
    against extra memory and bytes moved (the operator's decision table).

    Example:

    \b
        moetrace sweep demo --replicas 0,16,32,64 --replan-every 10,25
    """
    from ..replay import api
    from ..replay.planners import PLANNERS

    if policy not in PLANNERS:
        raise click.BadParameter(f"{policy!r}: choose from {', '.join(PLANNERS)}", param_hint="--policy")
    st, rid, shape = _open(store, run_id)
    opts = api.ReplayOptions(split=split, hardware=hardware.upper())
    rows = api.sweep(st, rid, shape, policy, replicas or [], intervals or [], window, opts, ranks=ranks)
    if plot:
        from ..replay.plots import sweep_plot

        sweep_plot(rows, plot)
        click.echo(f"wrote {plot}", err=True)
    cols = ["what", "replicas", "replan_every", "judged_on", "extra_mem_per_rank_bytes", "mean_imbalance", "p99_imbalance",
            "efficiency", "predicted_step_ns", "speedup_vs_first", "moved_experts", "moved_bytes", "skipped"]
    df = pl.DataFrame([{c: r.get(c) for c in cols} for r in rows], schema_overrides={"skipped": pl.Utf8})
    if df["skipped"].null_count() == df.height:
        df = df.drop("skipped")
    emit(df, fmt, output)


def register(cli):
    for cmd in (plan, replay, sweep):
        cli.add_command(cmd)

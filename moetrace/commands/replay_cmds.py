"""Replay commands: plan, replay, sweep. Thin callers of the run facade (moetrace.run.Run),
which delegates to the moetrace.replay modules; these only parse options and print."""
from __future__ import annotations

import click

from ..output import (
    Progress,
    check_out_path,
    echo_json,
    echo_wrapped,
    emit,
    json_option,
    output_options,
)
from ..replay.results import load_answer, load_lines, replay_extra_lines
from ..replay.strategies import fastest_text
from ..run import ClusterSpec, Store
from ..units import gib
from ._options import (
    SHAPE,
    chrome_trace_option,
    finite_float,
    fit_steps_option,
    hardware_option,
    ints_option,
    kernel_options,
    policy_option,
    run_option,
    split_option,
    steps_list,
    store_argument,
)


def _stack(*opts):
    """One decorator applying click options in the order given."""
    def deco(f):
        for o in reversed(opts):
            f = o(f)
        return f
    return deco


cluster_options = _stack(
    click.option("--ranks", type=int, default=None, help="Expert-parallel ranks (default: the run's)."),
    click.option("--groups", type=int, default=None,
                 help="Expert groups for hierarchical EPLB (default: the run's; DeepSeek-V3/R1: 8)."),
    click.option("--nodes", type=int, default=None, help="Nodes (must equal ranks / ranks-per-node)."),
    click.option("--ranks-per-node", "rpn", type=int, default=None, help="Ranks per node (default: the run's)."))

def shape_options(fit_help: str):
    """--run, --policy, the cluster shape, --replicas N and --fit-steps A:B (its help says
    what the command fits on by default)."""
    return _stack(
        run_option, policy_option, cluster_options,
        ints_option("--replicas", "replicas", one=True, help="Redundant slots per layer (default: the run's)."),
        fit_steps_option(help=fit_help))

def _stall(ctx, param, value):
    """--move-stall-ms: milliseconds (>= 0) or measured[:RUN], checked here, read by the facade."""
    text = str(value).strip()
    if text.lower().startswith("measured"):
        return text
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not ms >= 0 or ms == float("inf"):
        raise click.BadParameter(f"{value!r}: give milliseconds >= 0, or measured[:RUN] (the median rebalance the "
                                 "engines logged)", param_hint="--move-stall-ms")
    return ms


move_options = _stack(
    click.option("--move-stall-ms", "--stall-ms", "stall_ms", callback=_stall, default="0", show_default=True,
                 metavar="MS|measured[:RUN]",
                 help="Time the engine stops per re-balance besides the weight transfer (e.g. 1800 for a "
                      "synchronous SGLang rebalance), or 'measured': the median rebalance duration the engines "
                      "logged in this store (view rebalance_timing; measured:RUN for one run's log)."),
    click.option("--move-overlap", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                 help="Share of the weight transfer hidden behind compute: 0 = synchronous engine (the step "
                      "waits for it), e.g. 0.9 for an asynchronous one."),
    click.option("--layers-per-step", type=click.IntRange(1, SHAPE), default=None, metavar="N",
                 help="The engine moves N layers per step (TensorRT-LLM layer_updates_per_iter, SGLang chunked "
                      "rebalance): each plan change is spread over steps, and its break-even is given under that "
                      "schedule too (default: every layer at once)."),
    click.option("--rank-speed", default=None, metavar="R:F,...|measured",
                 help="Per-rank expert speed factors carried into the time answer: 0:1.0,1:1.1 (rank 1 takes 10%% "
                      "longer per token; unnamed ranks 1.0) or 'measured' (each rank's expert time per token over "
                      "the median rank's, from the run's spans: view rank_speed)."),
    click.option("--passes", type=int, default=None,
                 help="Passes per recorded step when the counts aggregate a recording (times per pass)."))


def _say(line: str) -> None:
    """A line of an answer, wrapped to the terminal (continuations indented under it)."""
    echo_wrapped(line.lstrip(" "), indent=line[:len(line) - len(line.lstrip(" "))])


def _print_changes(j, indent="  "):
    if not j.changes:
        return
    c0 = j.changes[0]
    be = [c.break_even_steps for c in j.changes]
    _say(f"{indent}moves: {j.moved_experts} expert copies, {gib(j.moved_bytes):.2f} GiB "
               f"({gib(sum(c.bytes_inter for c in j.changes)):.2f} GiB inter-node) in {len(j.changes)} change(s), "
               f"charged {sum(c.charged_ns for c in j.changes) / 1e6:.3f} ms in all")
    if j.gross_step_ns is None:
        _say(f"{indent}break-even: no time per step to weigh the moves against")
    elif len(j.changes) == 1:
        _say(f"{indent}break-even: " + (f"{c0.break_even_steps:.1f} steps (the plan serves {c0.served_steps})"
                                              if c0.break_even_steps is not None else
                                              "never (the plan gains nothing per step)"))
    else:
        ok = [b for b in be if b is not None]
        _say(f"{indent}break-even per re-plan: " + ", ".join("never" if b is None else f"{b:.1f}" for b in be[:12])
                   + (" ..." if len(be) > 12 else "") + f" steps ({sum(c.pays_back for c in j.changes)} of "
                   f"{len(be)} pay back within the steps they serve)" + ("" if ok else ""))


def _print_replay(res):
    j, s = res.judged, res.judged.summary
    _say(f"replay {res.replay_id} of run {res.run_id}: {res.plan_desc}; split {res.split}")
    _say(f"  judged on {res.judged_on}")
    la = load_answer(j)
    if la is not None:
        for line in load_lines(la):
            _say(line)
    und = f"; {s.undefined_cells} (step, layer) with no tokens left out" if s.undefined_cells else ""
    rec = "" if j.kind == "recorded" else f" vs {j.recorded.mean_imbalance:.3f} recorded"
    if s.mean_imbalance is None:
        _say(f"  no (step, layer) routed any token{und}")
    else:
        eff = f", efficiency {s.mean_efficiency:.3f}" if s.mean_efficiency is not None else ""
        _say(f"  {j.steps.size} steps x {j.plan.num_layers} layers: mean max/mean rank tokens "
                   f"{s.mean_imbalance:.3f}{rec}, p99 {s.p99_text()}{eff}{und}")
    _say("  modelled time (cost model, with its band):")
    _say(f"  {res.headline()}")
    _print_changes(j)
    if j.kind != "recorded":
        _say(f"  time verdict: {j.verdict}: {j.verdict_reason}")
    _say(f"  cost model: {res.cost.source.split(':')[0]}; time error band ±{res.error_band[0]:.0%} "
               f"({res.error_band[1]}); {res.move.describe()}")
    if res.nodes_per_token_max is not None:
        _say(f"  per-token routing: exact dispatch bytes; nodes per token mean "
                   f"{res.nodes_per_token_mean:.2f}, max {res.nodes_per_token_max}")
    for line in replay_extra_lines(res):
        click.echo(line)
    for n in res.notes:
        _say(f"  note: {n}")



#: the cost model `moetrace calibrate` fitted on another run (same option on replay, drift, sweep)
cost_model_option = click.option(
    "--cost-model", "cost_model", default=None, metavar="RUN_ID",
    help="Time with the cost model `moetrace calibrate` fitted on RUN_ID (its band measured on held-out steps or "
         "judged runs). Default: the model calibrated on this run's own trace where one is stored.")

@click.command()
@store_argument
@shape_options("Fit the plan on steps A <= step < B (default: every recorded step: a plan to deploy uses all "
               "the data; replay --policy fits on the first half and judges on the rest).")
@click.option("--plan", "plan_id_in", default=None, help="Start from a stored plan ('recorded' = the run's own).")
@click.option("--import", "import_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read a plan file (SGLang physical_to_logical_map / logical_count JSON, EPLB JSON, TensorRT-LLM "
                   "EPLB config YAML, or vllm-ascend expert map JSON).")
@click.option("--max-moves", type=int, default=None, help="Move-aware re-plan from --plan with at most K expert moves.")
@click.option("--target-imbalance", type=float, default=None, help="Move-aware re-plan: stop at this max/mean.")
@click.option("--plan-id", default=None, help="Id to store the plan under (default: the policy name).")
@click.option("--no-store", is_flag=True, help="Do not write the plan into the store.")
@click.option("--export", "out_file", type=click.Path(dir_okay=False), default=None,
              callback=check_out_path, metavar="FILE", help="Export the plan to FILE in --export-format.")
@click.option("--export-format", "out_format",
              type=click.Choice(["sglang", "eplb", "trtllm", "vllm-ascend"]), default="sglang",
              show_default=True, help="sglang: --init-expert-location JSON; eplb: phy2log/log2phy/logcnt JSON; "
              "trtllm: TensorRT-LLM moe_config.load_balancer YAML; vllm-ascend: expert map JSON (expert_map_path).")
@click.option("--list", "list_plans", is_flag=True, help="List the run's stored plans and exit.")
@click.option("--no-relabel", is_flag=True,
              help="Keep the planner's own rank numbering (default: ranks of a --policy plan are renamed to "
                   "keep the most experts where the start plan, --plan or the recorded one, has them).")
@json_option
def plan(store, run_id, policy, ranks, replicas, groups, nodes, rpn, fit_window, plan_id_in, import_file,
         max_moves, target_imbalance, plan_id, no_store, out_file, out_format, list_plans, no_relabel, as_json):
    """Make an expert placement plan (or import / re-plan / export one) and store it.

    The plan is fitted on the run's summed load (all steps or --fit-steps), stored in the
    placement table under --plan-id, and exported with --export as SGLang
    --init-expert-location JSON or EPLB-style JSON. With --plan and --max-moves the
    move-aware re-planner changes as few slots as it can; with --plan and --policy the
    policy re-plans from scratch and its ranks are renamed to keep the most experts where
    the --plan plan has them (renaming ranks is free; without --plan, the recorded plan).
    --import reads a plan as it is: options it would ignore are refused.

    Example:

    \b
        moetrace plan demo --policy eplb --replicas 32 --plan-id eplb32 --export eplb32.json
    """
    if plan_id_in and not policy and not import_file:
        # --plan alone exports it, with --max-moves re-plans it: its shape is the stored plan's
        given = [n for n, v in (("--ranks", ranks), ("--replicas", replicas), ("--groups", groups),
                                ("--nodes", nodes), ("--ranks-per-node", rpn), ("--no-relabel", no_relabel or None))
                 if v is not None]
        if given:
            from ..errors import UsageError

            raise UsageError(f"--plan {plan_id_in} keeps the stored plan's shape: {', '.join(given)} would be "
                             "ignored; leave them out (or fit a new plan with --policy)")
    st = Store(store)
    run = st.run(run_id)
    if list_plans:
        import polars as pl

        df = st.sql("""SELECT plan_id, count(DISTINCT layer) AS layers, max(slot) + 1 AS slots,
                       max(rank) + 1 AS ranks, max(node) + 1 AS nodes FROM placement WHERE run_id = ?
                       GROUP BY plan_id ORDER BY plan_id""", [run.id]) if st.has_files("placement") else pl.DataFrame()
        emit(df if df.height else pl.DataFrame({"plan_id": ["recorded (contiguous, not stored)"]}))
        return
    from ..placement.plans import PlanOptions

    res = run.plan(policy, cluster=ClusterSpec(ranks, replicas, groups, nodes, rpn),
                   options=PlanOptions(fit_window=fit_window, plan_id=plan_id, start=plan_id_in,
                                       import_file=import_file, max_moves=max_moves,
                                       target_imbalance=target_imbalance, store=not no_store, out=out_file,
                                       out_format=out_format, relabel=not no_relabel))
    if as_json:
        echo_json(res.to_dict())
        return
    click.echo(f"plan {res.plan_id}: {res.plan.describe()}")
    what = "fitted on" if res.fitted else "judged on the load of"
    start = (f" (start plan {res.start.plan_id}: {res.start_imbalance_on_fit:.3f})"
             if res.start_imbalance_on_fit is not None and res.start is not res.plan else "")
    if res.imbalance_on_fit is not None:
        click.echo(f"  {what} {res.fit_steps} steps; max/mean rank load on that load: {res.imbalance_on_fit:.3f}{start}")
    if res.moved is not None and res.start is not res.plan:
        extra = (f" (ranks renamed to match {res.start.plan_id}; {res.moves_without_relabel} with the "
                 f"planner's own numbering)" if res.relabeled else "")
        click.echo(f"  moves vs {res.start.plan_id}: {res.moved} expert copies, {gib(res.moved_bytes):.2f} GiB" + extra)
    if res.stored_rows is not None:
        click.echo(f"  stored {res.stored_rows} placement rows as plan_id {res.plan_id!r}")
    if res.out:
        click.echo(f"  wrote {out_file} ({out_format})")


@click.command()
@store_argument
@shape_options("Fit the plan on steps A <= step < B (default: the first half); it is judged on the steps after B.")
@click.option("--plan", "plan_id", default=None, help="Replay a stored plan ('recorded' = the run's own).")
@click.option("--in-sample", is_flag=True,
              help="Judge a fitted plan on every step, those it was fitted on included (labelled in-sample).")
@ints_option("--replan-every", "replan_every", one=True, help="Re-plan every N steps (drift replay).")
@ints_option("--window", "window", one=True, help="Re-plan from the trailing N steps (default: --replan-every).")
@click.option("--max-moves", type=int, default=None, help="Drift: move-aware re-plans with at most K moves each.")
@split_option
@hardware_option
@kernel_options
@click.option("--no-fit", "no_fit", is_flag=True, help="Use the preset even when the run has expert_gemm spans.")
@cost_model_option
@move_options
@chrome_trace_option(help="Write the predicted timeline of --trace-steps as a Chrome/Perfetto trace.")
@click.option("--trace-steps", callback=steps_list, default=None, metavar="A:B|A,B",
              help="Steps for --chrome-trace (A:B or a comma list; default: the first judged).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, callback=check_out_path, help="Drift: imbalance-over-time PNG.")
@click.option("--no-rank-rows", is_flag=True, help="Do not write replay_rank rows (large replays).")
@click.option("--replica-dispatch", type=click.Choice(("even", "least-loaded", "both")), default="even",
              show_default=True,
              help="Which copy of a replicated expert takes its tokens, for the load answer: even (every copy an "
                   "equal share), least-loaded (per step, water-filled onto the lightest copies' ranks, a min-max "
                   "split like DeepSeek's LPLB), or both side by side.")
@click.option("--balance-tolerance", type=finite_float(0, 10), default=None, metavar="F",
              help="Policy cooccurrence: a rank may carry up to (1 + F) x the mean load (default 0.1).")
@json_option(help="Print the summary object as JSON.")
@click.option("--timeline-whatif", is_flag=True,
              help="Also run the timeline what-ifs: two micro-batches, attention/FFN disaggregation, NVLink domain "
                   "8/16/72 (table replay_whatif; `moetrace whatif` has their options; docs/explanation/timeline.md).")
def replay(store, run_id, policy, ranks, replicas, groups, nodes, rpn, fit_window, plan_id, in_sample, replan_every,
           window, max_moves, split, hardware, kernel, sms, max_nodes_per_token, no_fit, cost_model, stall_ms,
           move_overlap, layers_per_step, rank_speed, passes, chrome_trace, trace_steps, plot, no_rank_rows,
           replica_dispatch, balance_tolerance, as_json, timeline_whatif):
    """Replay the run's recorded routing against a plan and predict per-rank loads,
    stragglers, all-to-all bytes and layer time, against the recorded placement on the
    same steps, net of moving the experts.

    A plan fitted on a window is judged on the steps after it (out-of-sample); --in-sample
    judges it on every step and says so. Results go to replay_layer, replay_rank,
    replay_runs (and replay_traffic with per-token routing). With --replan-every N the
    replay re-plans every N steps from the trailing --window steps and compares with a
    static plan and an oracle.

    Example:

    \b
        moetrace replay demo --policy eplb --replicas 32 --fit-steps 0:25 --stall-ms 50
    """
    from ..errors import InputError

    if (plan_id is None) == (policy is None):
        raise click.UsageError("give exactly one of --plan PLAN_ID or --policy P")
    run = Store(store).run(run_id)
    common = dict(split=split, hardware=hardware, fit_cost=not no_fit, stall_ms=stall_ms, overlap=move_overlap,
                  passes=passes, cost_model=cost_model, layers_per_step=layers_per_step, rank_speed=rank_speed)
    shape_kw = dict(ranks=ranks, replicas=replicas, groups=groups, nodes=nodes, ranks_per_node=rpn)
    a2a = dict(kernel=kernel, sms=sms, max_nodes_per_token=max_nodes_per_token)   # the all-to-all model's inputs
    if replan_every:
        if not policy:
            raise click.UsageError("--replan-every needs --policy (the planner re-run at every re-plan)")
        d = run.drift(policy, replan_every, window, cluster=ClusterSpec(**shape_kw, **a2a), max_moves=max_moves,
                      static_window=fit_window, **common)
        if plot:
            from ..report.plots import drift_from_dict

            drift_from_dict(d.to_dict(series=True), plot)
        if as_json:
            echo_json(d.to_dict())
            return
        _print_drift(d, plot, fit_window)
        return
    if plan_id and (fit_window or any(v is not None for v in shape_kw.values())):
        given = [f"--{k.replace('_', '-')}" for k, v in shape_kw.items() if v is not None]
        given += ["--fit-steps"] if fit_window else []
        raise InputError(None, f"--plan {plan_id} replays a stored plan as it is: {', '.join(given)} would be ignored")
    res = run.replay(plan_id, policy=policy, fit_window=fit_window, in_sample=in_sample,
                     rank_rows=not no_rank_rows, replica_dispatch=replica_dispatch,
                     balance_tolerance=balance_tolerance, trace_steps=trace_steps if chrome_trace else None,
                     chrome_trace=chrome_trace, cluster=ClusterSpec(**shape_kw, **a2a), **common)
    wi = run.whatif(hardware=hardware) if timeline_whatif else None   # the timeline what-ifs (commands/timeline_cmds.py)
    if as_json:
        d = res.to_dict()
        if wi is not None:
            d["timeline_whatif_id"] = wi.whatif_id
        if chrome_trace:
            d["chrome_trace"] = chrome_trace
        echo_json(d)
        return
    _print_replay(res)
    if chrome_trace:
        click.echo(f"  wrote {chrome_trace} (open in https://ui.perfetto.dev)")
    if wi is not None:
        from .timeline_cmds import print_whatif

        print_whatif(wi)


def _print_drift(d, plot, fit_window=None):
    fitted = (f"steps [{fit_window[0]}, {fit_window[1]})" if fit_window else f"the {d.window} steps before them")
    first = f" (steps {int(d.steps[0])}-{int(d.steps[-1])})" if d.steps.size else ""
    _say(f"drift replay of run {d.run_id}: {d.policy}, re-plan every {d.every} from the last {d.window} steps; "
         f"judged on {d.steps.size} steps{first} against the recorded placement; the static plan fitted on {fitted}")
    st = d.results["static"]
    _say(f"  plan: {st.plan.describe()}")
    from ..costmodel.step_cost import error_band

    band, src = error_band(d.cost)
    _say(f"  time error band ±{band:.0%} ({src}): a predicted difference within it is not a win")
    unit = "pass" if d.timing.per_pass else "step"
    rec_ms = f"{st.recorded_step_ns / 1e6:.3f} ms" if st.recorded_step_ns is not None else "no time"
    _say(f"  recorded mean imbalance {st.recorded.mean_imbalance:.3f}  predicted MoE time/{unit} {rec_ms}")
    for k, j in d.results.items():
        s = j.summary
        t = (f"gross {j.gross_step_ns / 1e6:.3f} ms, net {j.net_step_ns / 1e6:.3f} ms ({j.vs_recorded()})"
             if j.gross_step_ns is not None else "no time per step")
        _say(f"  {k:<7} mean imbalance {s.mean_imbalance:.3f}  p99 {s.p99_text()}  {t}  moved "
                   f"{j.moved_experts} experts ({gib(j.moved_bytes):.2f} GiB)  [{d.replay_ids[k]}]")
        la = load_answer(j)
        if la is not None:
            _say(f"          load (exact): {la.verdict}: {la.reason}")
        if k != "oracle":
            _print_changes(j, "          ")
        _say(f"          time verdict: {j.verdict}: {j.verdict_reason}")
    _say("  " + fastest_text({k: j.net_step_ns for k, j in d.results.items()}, band))
    if d.unrelabeled_moves is not None:
        _say(f"  re-plans' ranks renamed to keep experts in place: {d.results['replan'].moved_experts} moves "
                   f"instead of {d.unrelabeled_moves} with the planner's own numbering")
    _say("  stale plan by age quartile: " + ", ".join(f"{x:.3f}" for x in d.static_by_age_quartile()))
    ra = d.replan_by_age()
    _say("  re-planned plan by steps since re-plan: " + ", ".join(
        f"{a}: {x:.3f}" for a, x in zip(ra["age"], ra["mean_imbalance"])))
    for n in d.notes:
        _say(f"  note: {n}")
    if plot:
        _say(f"  wrote {plot}")


@click.command()
@store_argument
@run_option
@policy_option(default="eplb")
@ints_option("--replicas", "replicas", default="0,16,32,64", show_default=True,
             help="Replica budgets (redundant slots per layer).")
@ints_option("--replan-every", "intervals", help="Re-plan intervals in steps; a static plan is always a row.")
@ints_option("--window", "windows", help="Fit windows in steps (default: the largest interval, else half the run).")
@cluster_options
@split_option
@hardware_option
@kernel_options
@cost_model_option
@move_options
@click.option("--plot", type=click.Path(dir_okay=False), default=None, callback=check_out_path, help="Write the decision plot (PNG).")
@click.option("--all-runs", is_flag=True,
              help="Sweep every run in the store (a run_id column; runs that cannot be swept are noted).")
@click.option("--save", is_flag=True, help="Store every cell (replay_runs kind 'sweep', with its replay_layer rows).")
@click.option("--workers", type=int, default=None,
              help="Judge the cells on a local Dask cluster of N worker processes (pip install 'moetrace[cluster]').")
@click.option("--scheduler", default=None, envvar="DASK_SCHEDULER_ADDRESS", show_envvar=True,
              help="Judge the cells on an existing Dask cluster (e.g. tcp://host:8786); workers read the store "
                   "at the same path, results are written here.")
@output_options
def sweep(store, run_id, policy, replicas, intervals, windows, ranks, groups, nodes, rpn, split, hardware, kernel, sms,
          max_nodes_per_token, cost_model, stall_ms, move_overlap, layers_per_step, rank_speed, passes, plot, all_runs,
          save, workers, scheduler, fmt,
          output):
    """The operator's decision table: replica budgets x re-plan intervals x fit windows,
    each judged on the same steps against the recorded placement, with net predicted time
    (moving experts charged), extra expert memory per rank, bytes moved per hour and a
    verdict.

    Example:

    \b
        moetrace sweep demo --replicas 0,16,32,64 --replan-every 10,25 --stall-ms 50
        moetrace sweep demo --replan-every 10,25 --workers 2 --save
        moetrace sweep demo --replan-every 10,25 --scheduler tcp://10.0.0.5:8786
    """
    from click.core import ParameterSource

    if workers is not None and click.get_current_context().get_parameter_source("scheduler") is \
            ParameterSource.ENVIRONMENT:
        scheduler = None        # --workers given: a local cluster, whatever DASK_SCHEDULER_ADDRESS says
    kw = dict(replicas=replicas or [], intervals=intervals or [], windows=windows,
              cluster=ClusterSpec(ranks=ranks, groups=groups, nodes=nodes, ranks_per_node=rpn, kernel=kernel, sms=sms,
                                  max_nodes_per_token=max_nodes_per_token),
              split=split, hardware=hardware, stall_ms=stall_ms, overlap=move_overlap, layers_per_step=layers_per_step,
              rank_speed=rank_speed, passes=passes, write=save, workers=workers, scheduler=scheduler or None,
              cost_model=cost_model)
    if all_runs:
        from ..errors import UsageError
        from ..run import sweep_runs

        if run_id is not None or plot:
            raise UsageError("--all-runs sweeps every run: leave out --run and --plot")
        import polars as pl

        st = Store(store)
        with Progress("sweep: judging cells") as bar:
            results, skipped = sweep_runs(st, st.run_ids(), policy, progress=bar, **kw)
        df = pl.concat([r.frame(brief=fmt in (None, "table") and not output).select(
            pl.lit(r.run_id).alias("run_id"), pl.all()) for r in results], how="diagonal_relaxed")
        notes = skipped + [f"{r.run_id}: {n}" for r in results for n in r.notes]
    else:
        with Progress("sweep: judging cells") as bar:
            res = Store(store).run(run_id).sweep(policy, progress=bar, **kw)
        if plot:
            from ..report.plots import decision as decision_plot

            decision_plot(res.rows, plot)
            click.echo(f"wrote {plot}", err=True)
        df, notes = res.frame(brief=fmt in (None, "table") and not output), res.notes
    if fmt in (None, "table") and not output:
        df = _sweep_table(df)
    if fmt in (None, "table"):
        for n in notes:
            echo_wrapped(f"note: {n}", err=True)
    emit(df, fmt, output)


#: the sweep's terminal table: the columns that answer "which budget and interval, and does
#: it pay off", first (a narrow terminal keeps these); the rest follow (--wide shows them)
_SWEEP_COLUMNS = {"replicas": "replicas", "replan_every": "every", "window": "window", "net_ms": "net_ms",
                  "net_vs_rec_%": "vs_rec_%", "time verdict": "time verdict", "straggler_tok": "straggler_tok",
                  "load (exact)": "load (exact)", "extra_GiB_per_rank": "GiB/rank", "moved_GiB": "moved_GiB",
                  "replan_GiB_per_h": "replan_GiB/h", "rec_straggler_tok": "rec_straggler_tok",
                  "imbalance": "imbalance", "recorded_ms": "recorded_ms", "break_even_steps": "break_even_steps"}


def _sweep_table(df):
    """The decision table as a terminal shows it: key columns first, short names, the
    static plan's interval said as "static"."""
    import polars as pl

    first = [c for c in _SWEEP_COLUMNS if c in df.columns]
    df = df.select(first + [c for c in df.columns if c not in _SWEEP_COLUMNS])
    if "replan_every" in df.columns:
        df = df.with_columns(pl.col("replan_every").cast(pl.Utf8).fill_null("static"))
    return df.rename({c: _SWEEP_COLUMNS[c] for c in first})


def register(cli):
    for cmd in (plan, replay, sweep):
        cli.add_command(cmd)

"""``moetrace calibrate``: fit the replay cost model on one run's measured spans and judge
its predictions on another run."""
from __future__ import annotations

import click
import polars as pl

from ..output import echo_json, emit, json_option, output_options
from ..run import Store
from ..units import percent
from ._options import SHAPE, hardware_option, steps_range

_steps_range = steps_range


def metrics_frame(summary: dict) -> pl.DataFrame:
    """One row per judged run (the fit run first, in-sample) with the headline errors in %."""
    rows = [("fit (in-sample)", summary["fit"]["fit_run_id"], summary["fit"]["metrics"])]
    rows += [("judge", j["run_id"], j["metrics"]) for j in summary["judged"]]
    wall = summary.get("wall_clock")
    walls = ([wall["fit"]["metrics"]] + [j["metrics"] for j in wall["judged"]]) if wall else [None] * len(rows)
    out = []
    for (role, rid, m), w in zip(rows, walls):
        out.append({"role": role, "run_id": rid, "cells": m.get("cells_measured"), "pairs": m.get("pairs"),
                    "expert_mape_pct": percent(m.get("expert_mape"), 2), "expert_bias_pct": percent(m.get("expert_bias"), 2),
                    "straggler_mape_pct": percent(m.get("straggler_mape"), 2),
                    "straggler_bias_pct": percent(m.get("straggler_bias"), 2),
                    "straggler_hit_pct": percent(m.get("straggler_hit_rate"), 2),
                    "chance_pct": percent(m.get("straggler_chance"), 2),
                    "comm_mape_pct": percent(m.get("comm_mape"), 2), "layer_mape_pct": percent(m.get("layer_mape"), 2),
                    "layer_bias_pct": percent(m.get("layer_bias"), 2),
                    # the same fit and judgement on the wall clock (host slowdown included), beside
                    "wall_layer_mape_pct": percent(w.get("layer_mape"), 2) if w else None,
                    "wall_expert_mape_pct": percent(w.get("expert_mape"), 2) if w else None})
    df = pl.DataFrame(out, schema={"role": pl.Utf8, "run_id": pl.Utf8, "cells": pl.Int64, "pairs": pl.Int64,
                                     "expert_mape_pct": pl.Float64, "expert_bias_pct": pl.Float64,
                                     "straggler_mape_pct": pl.Float64, "straggler_bias_pct": pl.Float64,
                                     "straggler_hit_pct": pl.Float64, "chance_pct": pl.Float64,
                                     "comm_mape_pct": pl.Float64, "layer_mape_pct": pl.Float64,
                                     "layer_bias_pct": pl.Float64, "wall_layer_mape_pct": pl.Float64,
                                     "wall_expert_mape_pct": pl.Float64})
    return df if wall else df.drop("wall_layer_mape_pct", "wall_expert_mape_pct")


def fit_lines(summary: dict) -> list[str]:
    f = summary["fit"]
    r2 = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    res = f["expert_residuals"]
    lines = [
        f"calibration {summary['calibration_id']}: fitted on run {f['fit_run_id']} steps "
        + (f.get("steps_text") or f"{f['steps'][0]}..{f['steps'][1]}"),
        f"  expert time = {f['a_ns']:.1f} ns x tokens + {f['b_ns']:.1f} ns x slots touched   "
        f"(R^2 {r2(f['expert_r2'])} on {f['expert_points']} (step, layer, rank) cells; residual rmse "
        f"{res.get('rmse_ns', 0) / 1e3:.1f} us, |error| p50 {res.get('p50_abs_pct', 0):.1f}% p90 "
        f"{res.get('p90_abs_pct', 0):.1f}%)",
    ]
    if f.get("method") == "layer":
        lines.append(f"  all-to-all = {f['comm_latency_ns'] / 1e3:.1f} us latency per layer (the median of the layer "
                     "time beyond the slowest rank's experts) + 2 x bytes / bandwidth (from the preset)")
    elif f["comm_points"]:
        bw = lambda c: "not bytes-bound" if not c else f"{1 / c:.2f} GB/s"  # noqa: E731
        lines.append(f"  all-to-all = {f['comm_latency_ns'] / 1e3:.1f} us + bytes intra / {bw(f['comm_ns_per_byte_intra'])}"
                     f" + bytes inter / {bw(f['comm_ns_per_byte_inter'])}   (R^2 {r2(f['comm_r2'])} on "
                     f"{f['comm_points']} cells)")
    for n in list(f.get("input_notes", [])) + list(f.get("notes", [])):
        lines.append(f"  note: {n}")
    return lines


def band_line(summary: dict) -> str:
    """The model's band and where it was measured, in words."""
    b = summary["band"]
    if b["rel_error"] is None:
        return f"band: none ({b['source']})"
    return f"band: ±{100 * b['rel_error']:.1f}%, the {b['source']}; fitted on steps {b['fit_steps']}"


def basis_line(summary: dict) -> str:
    """What the errors are measured on, and the host slowdown of every run."""
    sl = ", ".join(f"{r} {v:.2f}x" for r, v in (summary.get("host_slowdown") or {}).items() if v is not None)
    if summary.get("basis") == "cpu":
        return ("judged on the CPU basis (each rank's main-thread CPU time: the cost model itself, the host's "
                "scheduling of other processes left out); wall-clock errors beside (wall_*)"
                + (f"; host slowdown (wall / CPU layer time): {sl}" if sl else ""))
    return "judged on the wall clock" + (f"; host slowdown (wall / CPU layer time): {sl}" if sl else "")


@click.command("calibrate")
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@click.option("--run", "fit_run", default=None, metavar="RUN_ID",
              help="Run whose measured spans the cost model is fitted on (default: the store's only run).")
@click.option("--judge-run", "judge_runs", multiple=True, metavar="RUN_ID",
              help="Run to predict with the fitted model and compare with its measured spans (repeatable). "
                   "Without it: the fit only (in-sample errors), or with --judge-steps the fit run's other steps.")
@click.option("--load", "loads", multiple=True, metavar="SPANS_RUN=LOAD_RUN",
              help="Take the routing / expert load / placement of SPANS_RUN from LOAD_RUN (a profiler trace "
                   "and an engine dump ingested as two runs); repeatable.")
@click.option("--step-offset", type=int, default=0, show_default=True,
              help="With --load: load step = profiler step + N.")
@click.option("--fit-steps", callback=_steps_range, default=None, metavar="A:B", help="Fit on steps A <= step < B only (A:B).")
@click.option("--judge-steps", callback=_steps_range, default=None, metavar="A:B",
              help="Judge on steps A <= step < B only (A:B); with one run, a time split of it.")
@hardware_option(help="Preset whose bandwidths are kept where the fit run cannot determine them.")
@click.option("--loss", type=click.Choice(["l2", "mape"]), default="l2", show_default=True,
              help="l2: least squares (as replay fits); mape: minimize the mean absolute percentage error "
                   "(robust to preempted or warming-up cells).")
@click.option("--method", type=click.Choice(["auto", "layer", "cells"]), default="auto", show_default=True,
              help="layer: the fidelity basis (a, b from each rank's expert time, the all-to-all latency from the "
                   "layer times); cells: each rank's expert and all-to-all spans fitted on their own; auto: layer "
                   "for timed passes (refrun --repeats), cells for profiler kernels.")
@click.option("--held-out", type=click.Choice(["auto", "blocks", "half", "none"]), default="auto", show_default=True,
              help="Without --judge-run: judge the fit run on its own held-out steps. blocks: alternate whole blocks "
                   "of --block steps (fit, judge, fit, ...); half: fit the first half, judge the second; none: "
                   "the fit only (in-sample). auto: blocks unless --judge-run or --judge-steps is given.")
@click.option("--block", type=click.IntRange(1, SHAPE), default=None, metavar="N",
              help="Steps per block of --held-out blocks (default: a quarter of the steps).")
@click.option("--calibration-id", default=None, help="Id to store the cells under (default: generated).")
@click.option("--no-store", is_flag=True, help="Do not write the calibration table.")
@click.option("--basis", type=click.Choice(["auto", "cpu", "wall"]), default="auto", show_default=True,
              help="What the model is judged on: cpu = each rank's main-thread CPU time (refrun timed passes: "
                   "other processes on a busy host left out), wall = the wall clock; auto: cpu where every run "
                   "has it, with the wall-clock errors and the host slowdown beside.")
@json_option(help="Print the whole summary (fit, residuals, metrics) as JSON.")
@output_options
def calibrate(store, fit_run, judge_runs, loads, step_offset, fit_steps, judge_steps, hardware, loss, method,
              held_out, block, calibration_id, no_store, basis, as_json, fmt, output):
    """Fit the replay cost model on a run's measured spans and judge it on another run.

    Per (step, layer, rank) the fit run's expert_gemm spans give the measured expert
    time and its dispatch/combine spans the all-to-all time; the recorded routing (or
    per-slot load) gives tokens, slots touched and dispatch bytes. Fits expert time =
    a x tokens + b x slots touched and all-to-all = latency + bytes / bandwidth, then
    predicts every judged run from its own recorded routing and compares: mean absolute
    percentage error and bias of per-rank expert time and of the straggler (slowest
    rank) time per (step, layer), and how often the predicted straggler rank is the
    measured one. The cells go to the `calibration` table (SQL, and the report).

    With one run and no --judge-run, the run is judged on its own held-out steps (whole
    blocks of steps, never a step it was fitted on), and that error is the band the model
    is stored with: a replay, sweep or drift of the run then uses the fitted model and
    says so.

    Example:

    \b
        moetrace calibrate st --run gpu_trace --load gpu_trace=engine_dump
        moetrace refrun ra --ranks 4 --experts 16 --skew 1.2 --store st
        moetrace plan st --run ra --policy eplb --replicas 4 --export eplb4.json
        moetrace refrun rb --ranks 4 --experts 16 --skew 1.2 --placement eplb4.json --store st
        moetrace calibrate st --run ra --judge-run rb
    """
    st = Store(store)
    rid = st.resolve_run(fit_run)
    judges = [st.resolve_run(j) for j in judge_runs] or ([rid] if judge_steps else [])
    load_runs = {}
    for item in loads:
        if "=" not in item:
            raise click.BadParameter(f"{item!r} is not SPANS_RUN=LOAD_RUN", param_hint="--load")
        a, b = item.split("=", 1)
        load_runs[st.resolve_run(a)] = st.resolve_run(b)
    summary = st.run(rid).calibrate(judges, fit_steps=fit_steps, judge_steps=judge_steps, hardware=hardware, loss=loss,
                                    load_runs=load_runs, step_offset=step_offset,
                                    write=not no_store, calibration_id=calibration_id, basis=basis, method=method,
                                    held_out=held_out, block=block)
    if as_json:
        echo_json(summary)
        return
    for line in fit_lines(summary):
        click.echo(line)
    click.echo("  " + basis_line(summary))
    emit(metrics_frame(summary), fmt, output)
    for j in summary["judged"]:
        for n in j["notes"]:
            if n not in summary["fit"].get("input_notes", []):
                click.echo(f"note ({j['run_id']}): {n}")
    click.echo(band_line(summary))
    if summary["stored"]:
        judged = [j["run_id"] for j in summary["judged"]]
        judged_s = f", 'judge' on {', '.join(dict.fromkeys(judged))}" if judged else ""
        users = rid + (f" and of run {load_runs[rid]} (its routing/load)" if load_runs.get(rid) else "")
        click.echo(f"stored as calibration_id '{summary['calibration_id']}' in table calibration "
                   f"(role 'fit' on run {rid}{judged_s}); replay, sweep and drift of run {users} use this model "
                   f"(of other runs: --cost-model {rid})")


def register(cli: click.Group) -> None:
    cli.add_command(calibrate)

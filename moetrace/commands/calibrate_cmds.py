"""``moetrace calibrate``: fit the replay cost model on one run's measured spans and judge
its predictions on another run."""
from __future__ import annotations

import click
import polars as pl

from ..output import echo_json, emit, json_option, output_options
from ..run import Store
from ._options import hardware_option, steps_range

_steps_range = steps_range


def _pct(v):
    return None if v is None else round(100.0 * v, 2)


def metrics_frame(summary: dict) -> pl.DataFrame:
    """One row per judged run (the fit run first, in-sample) with the headline errors in %."""
    rows = [("fit (in-sample)", summary["fit"]["fit_run_id"], summary["fit"]["metrics"])]
    rows += [("judge", j["run_id"], j["metrics"]) for j in summary["judged"]]
    wall = summary.get("wall_clock")
    walls = ([wall["fit"]["metrics"]] + [j["metrics"] for j in wall["judged"]]) if wall else [None] * len(rows)
    out = []
    for (role, rid, m), w in zip(rows, walls):
        out.append({"role": role, "run_id": rid, "cells": m.get("cells_measured"), "pairs": m.get("pairs"),
                    "expert_mape_pct": _pct(m.get("expert_mape")), "expert_bias_pct": _pct(m.get("expert_bias")),
                    "straggler_mape_pct": _pct(m.get("straggler_mape")),
                    "straggler_bias_pct": _pct(m.get("straggler_bias")),
                    "straggler_hit_pct": _pct(m.get("straggler_hit_rate")),
                    "chance_pct": _pct(m.get("straggler_chance")),
                    "comm_mape_pct": _pct(m.get("comm_mape")), "layer_mape_pct": _pct(m.get("layer_mape")),
                    "layer_bias_pct": _pct(m.get("layer_bias")),
                    # the same fit and judgement on the wall clock (host slowdown included), beside
                    "wall_layer_mape_pct": _pct(w.get("layer_mape")) if w else None,
                    "wall_expert_mape_pct": _pct(w.get("expert_mape")) if w else None})
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
        f"calibration {summary['calibration_id']}: fitted on run {f['fit_run_id']} steps {f['steps'][0]}..{f['steps'][1]}",
        f"  expert time = {f['a_ns']:.1f} ns x tokens + {f['b_ns']:.1f} ns x slots touched   "
        f"(R^2 {r2(f['expert_r2'])} on {f['expert_points']} (step, layer, rank) cells; residual rmse "
        f"{res.get('rmse_ns', 0) / 1e3:.1f} us, |error| p50 {res.get('p50_abs_pct', 0):.1f}% p90 "
        f"{res.get('p90_abs_pct', 0):.1f}%)",
    ]
    if f["comm_points"]:
        bw = lambda c: "not bytes-bound" if not c else f"{1 / c:.2f} GB/s"  # noqa: E731
        lines.append(f"  all-to-all = {f['comm_latency_ns'] / 1e3:.1f} us + bytes intra / {bw(f['comm_ns_per_byte_intra'])}"
                     f" + bytes inter / {bw(f['comm_ns_per_byte_inter'])}   (R^2 {r2(f['comm_r2'])} on "
                     f"{f['comm_points']} cells)")
    for n in list(f.get("input_notes", [])) + list(f.get("notes", [])):
        lines.append(f"  note: {n}")
    return lines


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
@click.option("--calibration-id", default=None, help="Id to store the cells under (default: generated).")
@click.option("--no-store", is_flag=True, help="Do not write the calibration table.")
@click.option("--basis", type=click.Choice(["auto", "cpu", "wall"]), default="auto", show_default=True,
              help="What the model is judged on: cpu = each rank's main-thread CPU time (refrun timed passes: "
                   "other processes on a busy host left out), wall = the wall clock; auto: cpu where every run "
                   "has it, with the wall-clock errors and the host slowdown beside.")
@json_option(help="Print the whole summary (fit, residuals, metrics) as JSON.")
@output_options
def calibrate(store, fit_run, judge_runs, loads, step_offset, fit_steps, judge_steps, hardware, loss, calibration_id,
              no_store, basis, as_json, fmt, output):
    """Fit the replay cost model on a run's measured spans and judge it on another run.

    Per (step, layer, rank) the fit run's expert_gemm spans give the measured expert
    time and its dispatch/combine spans the all-to-all time; the recorded routing (or
    per-slot load) gives tokens, slots touched and dispatch bytes. Fits expert time =
    a x tokens + b x slots touched and all-to-all = latency + bytes / bandwidth, then
    predicts every judged run from its own recorded routing and compares: mean absolute
    percentage error and bias of per-rank expert time and of the straggler (slowest
    rank) time per (step, layer), and how often the predicted straggler rank is the
    measured one. The cells go to the `calibration` table (SQL, and the report).

    Example:

    \b
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
                                    write=not no_store, calibration_id=calibration_id, basis=basis)
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
    if summary["stored"]:
        judged = f", 'judge' on {', '.join(judges)}" if judges else ""
        click.echo(f"stored as calibration_id '{summary['calibration_id']}' in table calibration "
                   f"(role 'fit' on run {rid}{judged})")


def register(cli: click.Group) -> None:
    cli.add_command(calibrate)

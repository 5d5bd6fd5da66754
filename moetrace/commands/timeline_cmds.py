"""Timeline commands: ``moetrace waits`` (who waited for whom across ranks) and
``moetrace whatif`` (two-micro-batch overlap, attention/FFN disaggregation, NVLink domain
size on the recorded timeline)."""
from __future__ import annotations

import click
import polars as pl

from ..output import emit, output_options
from ..run import Store
from ._options import chrome_trace_option, hardware_option, run_option, steps_select


@click.command("waits")
@click.argument("store", type=click.Path(file_okay=False))
@run_option
@click.option("--by", type=click.Choice(["rank", "matrix", "instance"]), default="rank", show_default=True,
              help="rank: wait caused and suffered per rank, exposed split into waiting and transfer; matrix: "
                   "who waited for whom (ns summed over instances); instance: every matched collective instance.")
@click.option("--shift-steps", callback=steps_select, default=None, metavar="A:B|A,B|even|odd",
              help="Compare the net wait (caused per peer - suffered) of these steps (A:B, a comma list, 'even' or "
                   "'odd') with the other steps: per rank (per (step, layer) cells), or with --by instance per rank, "
                   "collective and position in the layer, the median shift and its standard error. A delay injected with `refrun "
                   "--delay-every 2` shows at its rank and collective.")
@output_options
def waits(store, run_id, by, shift_steps, fmt, output):
    """Who waited for whom: collective instances matched across ranks.

    Each collective instance (the n-th all-to-all, all-reduce, ... of a stream on every
    rank) cannot finish before its last rank arrives (arrival = kernel or op start). Each
    other rank's wait (last arrival - own arrival) is charged to the last arriver;
    transfer = own end - last arrival. exposed_* = the part with no compute running on the
    rank. Also as SQL: coll_instances, rank_waits, wait_matrix, rank_wait_summary,
    wait_coverage.

    Example:

    \b
        moetrace waits st --by matrix
        moetrace waits st --shift-steps even --by instance
    """
    run = Store(store).run(run_id)
    if shift_steps is not None:
        _shift(run, shift_steps, by, fmt, output)
        return
    res = run.waits()
    if not res.has_instances:
        click.echo(res.coverage_message())
        return
    if by == "rank":
        df = res.ranks
    elif by == "matrix":
        df = res.matrix
    else:
        df = res.instances
    df = df.with_columns([(pl.col(c) / 1e6).round(3).alias(c[:-3] + "_ms") for c in df.columns
                          if c.endswith("_ns") and not c.endswith("arrival_ns") and c not in ("completion_ns",
                                                                                                   "first_end_ns")])
    df = df.drop([c for c in df.columns if c.endswith("_ns") and c[:-3] + "_ms" in df.columns])
    emit(df, fmt, output, max_rows=200)
    if fmt == "table" and not output:
        click.echo("\n" + res.coverage_message())
        top = res.top_culprit()
        if top is not None and top["caused_wait_ns"]:
            click.echo(f"rank {top['rank']} made the others wait most: {top['caused_wait_ns'] / 1e6:.3f} ms in all, "
                       f"last to arrive at {top['times_last']} of {res.instances.height} instances.")


def _shift(run, spec, by: str, fmt, output) -> None:
    """``spec``: what the one step parser (``_options.steps_select``) made of --shift-steps."""
    if isinstance(spec, tuple):            # ("parity", 0 | 1): the even or odd recorded steps
        steps = sorted(run.store.sql("SELECT DISTINCT step FROM layer_waits WHERE run_id = ? AND step IS NOT NULL",
                                     [run.id])["step"].to_list())
        chosen = [s for s in steps if s % 2 == spec[1]]
    else:
        chosen = list(spec)
    ws = run.wait_shift(chosen, by="position" if by == "instance" else "layer")
    if ws.ranks.height == 0:
        click.echo(f"run {run.id}: no matched collective instances in both the chosen and the other steps.")
        return
    df = ws.ranks.with_columns([(pl.col(c) / 1e6).round(3).alias(c[:-3] + "_ms") for c in ws.ranks.columns
                                if c.endswith("_ns")]).drop([c for c in ws.ranks.columns if c.endswith("_ns")])
    emit(df, fmt, output, max_rows=200)
    if fmt == "table" and not output:
        t = ws.top()
        where = f", {t['kind']} #{t['pos']} of the layer" if "pos" in t else ""
        click.echo(f"\nlargest rise: rank {t['rank']}{where}: {t['shift_ns'] / 1e6:+.3f} ms "
                   f"(standard error {t['se_ns'] / 1e6:.3f} ms; {t['n_a']} cells against {t['n_b']}).")


def _ints(ctx, param, value):
    if value in (None, ""):
        return ()
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


@click.command("whatif")
@click.argument("store", type=click.Path(file_okay=False))
@run_option
@click.option("--only", type=click.Choice(["all", "overlap", "disagg", "domain"]), default="all", show_default=True,
              help="Which what-if to run.")
@click.option("--split-extra-us", default=0.0, show_default=True,
              help="Overlap: extra compute per layer of running each expert twice on half the tokens, µs.")
@click.option("--a2a-latency-us", type=float, default=None,
              help="Overlap: the all-to-all's fixed cost per layer, paid once more per extra micro-batch, µs "
                   "(default: measured from the matched all-to-all instances).")
@click.option("--domains", callback=_ints, default="8,16,72", show_default=True,
              help="Domain size: ranks per NVLink domain to compare with the run's own.")
@hardware_option(help="Domain size: NVLink and NIC rates of this preset.")
@click.option("--tokens", type=float, default=None, help="Disaggregation: tokens per layer in a batch (default: "
                                                         "measured tokens per step).")
@click.option("--gpus", type=int, default=None, help="Disaggregation: GPUs to split (default: the run's ranks).")
@click.option("--attn-ns", type=float, default=None, help="Disaggregation: attention (non-expert) ns per token on "
                                                          "one GPU (default: measured).")
@click.option("--expert-ns", type=float, default=None, help="Disaggregation: expert FFN ns per token (all top-k) on "
                                                            "one GPU (default: measured).")
@click.option("--transfer-ns", type=float, default=None, help="Disaggregation: one-way transfer ns per token between "
                                                              "the pools (default: measured all-to-all transfer).")
@click.option("--fixed-attn-ns", default=0.0, show_default=True, help="Disaggregation: fixed ns per micro-batch and "
                                                                      "layer on an attention GPU.")
@click.option("--fixed-expert-ns", default=0.0, show_default=True, help="Disaggregation: fixed ns per micro-batch and "
                                                                        "layer on an expert GPU (weight reads).")
@click.option("--max-micro-batches", default=8, show_default=True, help="Disaggregation: micro-batch counts tried.")
@chrome_trace_option(help="Write a Chrome/Perfetto trace of the overlap what-if for the step with most exposed "
                         "all-to-all.")
@click.option("--no-write", is_flag=True, help="Print only; do not append replay_whatif rows to the store.")
@output_options
def whatif(store, run_id, only, split_extra_us, a2a_latency_us, domains, hardware, tokens, gpus, attn_ns, expert_ns, transfer_ns,
           fixed_attn_ns, fixed_expert_ns, max_micro_batches, chrome_trace, no_write, fmt, output):
    """What overlap, disaggregation or a bigger NVLink domain would have done.

    Overlap: two micro-batches, each one's exposed all-to-all hidden behind the other's
    compute (step time and exposed all-to-all before / after per step). Disaggregation:
    attention and expert FFNs on separate GPU pools (best split, micro-batch count,
    per-GPU throughput vs co-located). Domain: ranks per NVLink domain (bytes crossing
    domains, all-to-all time). Each result states its assumptions and error band and is
    appended to table replay_whatif (docs/explanation/timeline.md has the formulas).

    Example:

        moetrace whatif st --domains 8,16,72 --chrome-trace overlap.json
    """
    rep = Store(store).run(run_id).whatif(overlap=only in ("all", "overlap"), disagg=only in ("all", "disagg"),
                      domains=domains if only in ("all", "domain") else (), split_extra_ns=split_extra_us * 1e3,
                      a2a_latency_ns=None if a2a_latency_us is None else a2a_latency_us * 1e3,
                      hardware=hardware, tokens=tokens, gpus=gpus, ta_ns=attn_ns, te_ns=expert_ns,
                      tc_ns=transfer_ns, fa_ns=fixed_attn_ns, fe_ns=fixed_expert_ns,
                      max_micro_batches=max_micro_batches, write=not no_write, trace_path=chrome_trace)
    print_whatif(rep, fmt, output)
    if fmt == "table" and not output and chrome_trace and rep.overlap is not None:
        click.echo(f"wrote {chrome_trace}", err=True)


def print_whatif(rep, fmt: str = "table", output: str | None = None) -> None:
    """The what-if summary rows, then (as a table) the notes, error band and rows written."""
    emit(whatif_summary(rep), fmt, output, max_rows=200)
    if fmt == "table" and not output:
        for n in rep.notes:
            click.echo(f"note: {n}", err=True)
        click.echo(f"error band ±{100 * rep.rel_error:.0f}% ({rep.rel_error_source})", err=True)
        if rep.rows:
            click.echo(f"wrote {rep.rows} replay_whatif rows ({rep.whatif_id})", err=True)


def whatif_summary(rep) -> pl.DataFrame:
    """One row per scenario and metric (whole run), for printing."""
    from ..replay.timeline_whatif_store import rows_table

    df = pl.from_arrow(rows_table(rep))
    if df.height == 0:
        return pl.DataFrame({"kind": [], "scenario": [], "metric": [], "before": [], "after": [], "unit": []})
    return (df.filter(pl.col("step").is_null())
            .with_columns((pl.col("after") / pl.col("before")).alias("after_over_before"))
            .select("kind", "scenario", "metric", "before", "after", "after_over_before", "unit"))


def register(cli):
    cli.add_command(waits)
    cli.add_command(whatif)

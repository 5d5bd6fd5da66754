"""Profiler-trace commands: ``moetrace kernels`` (what the classifier made of every kernel
name) and ``moetrace exposure`` (all-to-all exposure per rank, step, layer, kind)."""
from __future__ import annotations

import click

from .. import open_store
from ..output import emit, output_options, times_in_ms
from ._options import engine_options, engine_sql, run_option


@click.command("kernels")
@click.argument("store", type=click.Path(file_okay=False))
@run_option
@click.option("--kind", default=None, help="Only this kind (dispatch, combine, a2a_other, expert_gemm, moe_other, "
                                           "attention, compute_other, memcpy, memset, comm_other).")
@click.option("--top", "limit", type=int, default=15, show_default=True,
              help="Names per kind (0 = all).")
@output_options
def kernels(store, run_id, kind, limit, fmt, output):
    """List kernel names by kind with total time, heaviest first.

    Heavy names under compute_other are where an unknown all-to-all would hide: add a
    rule for them with `moetrace ingest --kernel-rules FILE` (CSV kind,match,pattern,context:
    match is name, context or stream; see docs/reference/kernels.md). classified_by says which rule
    decided; an MoE trace with no expert GEMM kernel gets one line saying so.

    Example:

        moetrace kernels st --kind compute_other --top 20
    """
    run = open_store(store).run(run_id)
    # full names where they are data (csv, json, a file): a user copies them into --kernel-rules
    df = run.kernels(kind, limit or None, name_width=110 if fmt == "table" and not output else None)
    gap = run.expert_gemm_gap()
    if df.height == 0:
        click.echo(f"run {run.id}: no span of kind {kind}" if kind and run.kernels(None, 1).height
                   else f"run {run.id}: no profiler spans (ingest a Kineto or Nsight trace)")
        if gap:
            click.echo(gap)
        return
    emit(df, fmt, output, max_rows=500)
    if gap:   # (on stderr when stdout is data)
        click.echo(gap, err=fmt != "table" and not output)


@click.command("exposure")
@click.argument("store", type=click.Path(file_okay=False))
@run_option
@click.option("--by", type=click.Choice(["rank", "kind", "group", "straggler", "mode"]), default="rank",
              show_default=True, help="rank: per-rank summary; kind: totals per kind; group: every (rank, step, "
                                      "layer, micro-batch, kind); straggler: per step, the last rank to arrive at "
                                      "the combine, the longest step and the rank with most tokens; mode: stream use.")
@engine_options
@output_options
def exposure(store, run_id, by, engine, master, remote, fmt, output):
    """All-to-all exposure: how much dispatch/combine time no compute kernel hid.

    comm = union of the all-to-all kernel intervals; overlapped = the part of it during
    which a compute kernel ran on any stream of the same device; exposed = comm -
    overlapped. Also as SQL: a2a_exposure, a2a_rank_summary, a2a_stragglers, a2a_modes.

    Example:

        moetrace exposure st --by kind
    """
    st = open_store(store)
    run = st.run(run_id)
    with engine_sql(st, engine, master, remote) as sql:   # --engine spark: the views on Spark
        t = run.exposure(sql=sql)
        gap = run.expert_gemm_gap(sql=sql)                 # (while the session is open)
    if not t.has_a2a:
        click.echo(t.no_a2a_message())
        if gap:
            click.echo(gap)
        return
    df = {"rank": t.ranks, "kind": t.by_kind, "group": t.groups, "straggler": t.stragglers, "mode": t.modes}[by]
    if by == "straggler" and df.height == 0:
        click.echo(f"run {run.id}: stragglers need at least two ranks with combine spans in a step")
        return
    if by == "rank" and {"exposed_ns", "dispatch_exposed_ns", "combine_exposed_ns"} <= set(df.columns):
        import polars as pl

        # exposed time in neither a dispatch nor a combine (other all-to-all kinds), so the
        # parts add up to exposed_ns in every row
        df = df.with_columns(other_exposed_ns=pl.col("exposed_ns") - pl.col("dispatch_exposed_ns")
                             - pl.col("combine_exposed_ns"))
        cols = df.columns
        df = df.select(cols[:cols.index("combine_exposed_ns") + 1] + ["other_exposed_ns"]
                       + [c for c in cols[cols.index("combine_exposed_ns") + 1:] if c != "other_exposed_ns"])
    if by == "mode" and "mode" in df.columns:   # the answer first: a narrow terminal keeps it
        keys = [c for c in ("rank", "device", "stream") if c in df.columns]
        df = df.select(keys + ["mode"] + [c for c in df.columns if c not in keys and c != "mode"])
    table = fmt == "table" and not output
    emit(times_in_ms(df) if table else df, fmt, output, max_rows=200)
    if table:
        msg = t.hook_mode_message()
        if msg:
            click.echo("\n" + msg)
        if gap:
            click.echo(gap)
        for a in run.approximations:
            click.echo(f"note: {a}", err=True)
    elif gap:
        click.echo(gap, err=True)


def register(cli):
    cli.add_command(kernels)
    cli.add_command(exposure)

"""``moetrace hang``: the hang post-mortem of a run's communication log (PyTorch Flight
Recorder dumps ingested into ``collectives`` / ``comm_groups``)."""
from __future__ import annotations

import click
import polars as pl

from ..output import emit, output_options
from ..run import Store
from ._options import run_option


@click.command("hang")
@click.argument("store", type=click.Path(file_okay=False))
@run_option
@click.option("--by", type=click.Choice(["group", "rank", "mismatch"]), default="group", show_default=True,
              help="group: per process group, the collective the others wait in and the ranks that never reached "
                   "it; rank: each rank's last sequence id scheduled / started / completed per group (and "
                   "pg_status where the dump keeps it); mismatch: instances whose op, sizes or dtypes differ "
                   "across ranks.")
@output_options
def hang(store, run_id, by, fmt, output):
    """Who never arrived: the hang post-mortem of Flight Recorder dumps.

    Per process group: the last collective sequence id each rank completed and started,
    the lowest collective some rank entered and did not complete (the one the others wait
    in), the ranks that never reached it, and the instances whose op, input sizes or dtypes
    differ across ranks (docs/engines.md has the definitions).

    Example:

    \b
        moetrace ingest sample_traces/flight_recorder --store st
        moetrace hang st
        moetrace hang st --by rank
    """
    res = Store(store).run(run_id).hang()
    if by == "group":
        df = res.groups.with_columns([pl.col(c).list.eval(pl.element().cast(pl.Utf8)).list.join(",").alias(c)
                                      for c in ("members", "waiting", "never_reached", "no_dump", "completed")])
    elif by == "rank":
        df = res.progress
    else:
        df = res.mismatches
    emit(df, fmt, output, max_rows=500)
    if fmt == "table" and not output:
        click.echo("")
        for line in res.lines:
            click.echo(line)


def register(cli):
    cli.add_command(hang)

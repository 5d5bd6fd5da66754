"""Timeline commands: ``moetrace waits`` (who waited for whom across ranks)."""
from __future__ import annotations

import click
import polars as pl

from ..analyze.waits import wait_result
from ..output import emit, output_options
from ..store import Store


@click.command("waits")
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--run", "run_id", default=None, help="Run id (default: the store's only run).")
@click.option("--by", type=click.Choice(["rank", "matrix", "instance"]), default="rank", show_default=True,
              help="rank: wait caused and suffered per rank, exposed split into waiting and transfer; matrix: "
                   "who waited for whom (ns summed over instances); instance: every matched collective instance.")
@output_options
def waits(store, run_id, by, fmt, output):
    """Who waited for whom: collective instances matched across ranks.

    Each collective instance (the n-th all-to-all, all-reduce, ... of a stream on every
    rank) cannot finish before its last rank arrives (arrival = kernel or op start). Each
    other rank's wait (last arrival - own arrival) is charged to the last arriver;
    transfer = own end - last arrival. exposed_* = the part with no compute running on the
    rank. Also as SQL: coll_instances, rank_waits, wait_matrix, rank_wait_summary,
    wait_coverage.

    Example:

        moetrace waits st --by matrix
    """
    st = Store(store)
    rid = st.resolve_run(run_id)
    res = wait_result(st, rid)
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


def register(cli):
    cli.add_command(waits)

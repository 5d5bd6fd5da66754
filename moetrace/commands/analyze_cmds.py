"""Analysis commands: report, skew."""
from __future__ import annotations

import click

from .. import open_store
from ..output import emit, output_options
from ..run import SKEW_BY
from ._options import engine_options, engine_sql, out_dir_option, run_option


def _progress(line: str) -> None:
    click.echo(line, err=True)


def _heavy_options(f):
    f = click.option("--memory-limit", default=None, metavar="SIZE",
                     help="DuckDB memory cap, e.g. 8GB (default: $MOETRACE_MEMORY_LIMIT, else half the RAM); "
                          "larger intermediate results spill to the store's .duckdb_tmp.")(f)
    f = click.option("--batch-steps", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Compute the per-(step, layer) views N steps at a time (rounded down to a power of two; "
                          "default: about 8M expert_load rows per batch). Smaller uses less memory.")(f)
    return f


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@run_option(help="Run to report on (needed when the store holds several).")
@out_dir_option(help="Folder for report.html, report.md and the PNGs (default ./moetrace-report-RUN).")
@click.option("--quiet", is_flag=True, help="Do not print the summary tables, only where the files went.")
@_heavy_options
def report(store, run_id, out, quiet, batch_steps, memory_limit):
    """Summarize a run: per-layer skew, tokens per expert, imbalance vs batch size, dummy
    steps, and every other section installed (replay, all-to-all exposure). Prints the
    summary tables and writes a self-contained report.html, report.md and PNGs.

    Example:

    \b
        moetrace synth demo --layers 4 --steps 50 --sigma 0.6
        moetrace report demo --out-dir demo-report

    Long runs are analyzed in step batches (progress on stderr), so memory stays bounded.
    """
    from ..report.build import build_report

    st = open_store(store)
    rep = build_report(st, st.resolve_run(run_id), out, batch_steps=batch_steps, memory_limit=memory_limit,
                       progress=_progress)
    if not quiet:
        click.echo(rep.terminal())
    pngs = len(rep.figures)
    click.echo(f"wrote {rep.html_path} (self-contained), {rep.md_path} and {pngs} PNG{'s' if pngs != 1 else ''} "
               f"in {rep.outdir}")
    failed = [s.key for s in rep.sections if s.title.endswith("(section failed)")]
    if failed:  # the exit code says so: the report is written, with the failure in it, and scripts see it failed
        click.echo(f"moetrace: error: report section(s) {', '.join(failed)} failed (see {rep.md_path})", err=True)
        click.get_current_context().exit(1)


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@run_option(help="Only this run (default: every run).")
@click.option("--by", type=click.Choice(SKEW_BY), default="layer", show_default=True,
              help="layer: distribution over steps per layer; run: one line per run; step: every (step, layer).")
@_heavy_options
@engine_options
@output_options
def skew(store, run_id, by, batch_steps, memory_limit, engine, master, remote, fmt, output):
    """Quick skew table: imbalance (max/mean rank tokens), efficiency, Gini and the hottest
    expert, from the layer_skew / skew_summary views.

    Example:

        moetrace skew demo --by layer

    Each run's layer_skew is computed once, in step batches (progress on stderr for long
    runs), so memory stays bounded on fleet-size runs.
    """
    import polars as pl

    st = open_store(store)
    runs = [st.run(run_id)] if run_id else [st.run(r) for r in st.run_ids()]
    if not runs:
        click.echo("no runs")
        return
    with engine_sql(st, engine, master, remote) as sql:   # --engine spark: the views on Spark
        frames = [r.skew(by, batch_steps=batch_steps, memory_limit=memory_limit, progress=_progress, sql=sql)
                  for r in runs]
    df = pl.concat([f for f in frames if f.height] or frames[:1], how="vertical_relaxed")
    emit(df, fmt, output)
    from ..shape_gaps import gap_notes

    for r in runs:   # a null column always has its reason next to it
        for n in gap_notes(r.row):
            click.echo(f"note: {n}", err=True)


def register(cli):
    cli.add_command(report)
    cli.add_command(skew)

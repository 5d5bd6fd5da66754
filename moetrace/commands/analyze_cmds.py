"""Analysis commands: report, skew, materialize."""
from __future__ import annotations

import json

import click

from .. import open_store
from ..errors import StoreError
from ..output import Rows, echo_wrapped, emit, emit_rows, output_options
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
@run_option
@out_dir_option(help="Folder for report.html, report.md and the PNGs (default ./moetrace-report-RUN).")
@click.option("--quiet", is_flag=True, help="Do not print the summary tables, only where the files went.")
@click.option("--recompute", is_flag=True,
              help="Compute the per-(step, layer) views again even when the store holds them (and store the result).")
@click.option("--no-save", is_flag=True,
              help="Never write to the store: compute what is not stored, keep it for this report only.")
@_heavy_options
@engine_options
def report(store, run_id, out, quiet, recompute, no_save, batch_steps, memory_limit, engine, master, remote):
    """Summarize a run: per-layer skew, tokens per expert, imbalance vs batch size, dummy
    steps, and every other section installed (replay, all-to-all exposure). Prints the
    summary tables and writes a self-contained report.html, report.md and PNGs.

    Example:

    \b
        moetrace synth demo --layers 4 --steps 50 --sigma 0.6
        moetrace report demo --out-dir demo-report

    Long runs are analyzed in step batches (progress on stderr), so memory stays bounded.
    The per-(step, layer) results are stored in the store (tables cache_*, see
    `moetrace materialize`): the next report of the same run reads them instead, until the
    run, moetrace or the view SQL changes (then they are recomputed, said on stderr).
    With --engine spark they are computed on Spark (the same rows), then stored alike.
    Storing them is a write (one transaction, after a crashed writer's leftovers are
    recovered, as every writer does); with --no-save the report only reads the store.
    """
    from ..analyze.on_engine import compute_with
    from ..report.build import build_report

    st = open_store(store)
    rid = st.resolve_run(run_id)
    if engine == "spark" and not recompute and st.run(rid).cache_state().fresh:
        engine = "duckdb"     # the stored analysis is read: no Spark session to start
    with engine_sql(st, engine, master, remote) as sql:
        rep = build_report(st, rid, out, batch_steps=batch_steps, memory_limit=memory_limit,
                           progress=_progress, reuse=not recompute, save=not no_save,
                           compute=compute_with(sql) if sql is not None else None)
    if not quiet:
        click.echo(rep.terminal())
    pngs = len(rep.figures)
    click.echo(f"wrote {rep.html_path} (self-contained), {rep.md_path} and {pngs} PNG{'s' if pngs != 1 else ''} "
               f"in {rep.outdir}")
    failed = [s.key for s in rep.sections if s.title.endswith("(section failed)")]
    if failed:  # the exit code says so: the report is written, with the failure in it, and scripts see it failed
        click.echo(f"moetrace: error: report section(s) {', '.join(failed)} failed (see {rep.md_path})", err=True)
        click.get_current_context().exit(1)


#: the skew table a terminal shows: the columns that say which layer and which rank, first
_SKEW_FIRST = ("run_id", "step", "layer", "layers", "imbalance_mean", "imbalance", "imbalance_p99", "balancedness",
               "efficiency_mean", "efficiency", "worst_layer", "worst_layer_imbalance", "straggler_rank_mode",
               "straggler_rank", "hottest_expert_mode", "hottest_expert", "gini_mean", "gini", "steps")


def _skew_table(rows: Rows, nruns: int) -> Rows:
    """Skew rows in the terminal's column order (run_id only when several runs)."""
    first = [c for c in _SKEW_FIRST if c in rows.columns and (c != "run_id" or nruns > 1)]
    order = first + [c for c in rows.columns if c not in first and (c != "run_id" or nruns > 1)]
    idx = [rows.columns.index(c) for c in order]
    return Rows(order, [rows.types[i] for i in idx], [tuple(r[i] for i in idx) for r in rows.rows])


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@run_option(help="Run id (default: every run of the store, one run_id column when there are several).")
@click.option("--by", type=click.Choice(SKEW_BY), default="layer", show_default=True,
              help="layer: distribution over steps per layer; run: one line per run; step: every (step, layer).")
@_heavy_options
@engine_options
@output_options
def skew(store, run_id, by, batch_steps, memory_limit, engine, master, remote, fmt, output):
    """Quick skew table: imbalance (max/mean rank tokens), efficiency, Gini and the hottest
    expert, from the layer_skew / skew_summary views; in table format (--by layer or run),
    then one line of attention data-parallel balance (mean/max tokens per DP rank, view dp_balance_summary)
    where the run records tokens per (step, rank).

    Example:

        moetrace skew demo --by layer

    Each run's layer_skew is computed once, in step batches (progress on stderr for long
    runs), so memory stays bounded on fleet-size runs.
    """
    st = open_store(store)
    runs = [st.run(run_id)] if run_id else [st.run(r) for r in st.run_ids()]
    if not runs:
        click.echo("no runs")
        return
    if engine == "spark":   # --engine spark: the views on Spark, as polars frames
        import polars as pl

        with engine_sql(st, engine, master, remote) as sql:
            frames = [r.skew(by, sql=sql) for r in runs]
        emit(pl.concat([f for f in frames if f.height] or frames[:1], how="vertical_relaxed"), fmt, output)
    elif output and output.endswith(".parquet") and len(runs) == 1:   # written by DuckDB's COPY
        from pathlib import Path

        n = runs[0].skew_to_parquet(by, output, batch_steps=batch_steps, memory_limit=memory_limit,
                                    progress=_progress)
        click.echo(f"wrote {n} rows to {Path(output)}", err=True)
    else:   # DuckDB's rows, printed without polars (a command's start-up)
        parts = [r.skew_rows(by, batch_steps=batch_steps, memory_limit=memory_limit, progress=_progress)
                 for r in runs]
        rows = Rows.concat([p for p in parts if p.height] or parts[:1])
        table = fmt == "table" and not output
        emit_rows(_skew_table(rows, len(runs)) if table else rows, fmt, output)
        if table and by == "layer":
            from ..analyze.glance import skew_sentence

            for r, p in zip(runs, parts):
                said = skew_sentence(st, r.id, p.dicts())
                if said:
                    echo_wrapped(said)
    from ..domain.shape import gap_notes

    for r in runs:   # a null column always has its reason next to it
        for n in gap_notes(r.row):
            click.echo(f"note: {n}", err=True)
        if fmt == "table" and not output and by != "step":   # csv/json and the per-step dump stay one table
            line = r.dp_balance_line()
            if line:
                echo_wrapped(f"run {r.id}: {line}")


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@run_option(help="Run id (default: every run of the store).")
@click.option("--force", is_flag=True, help="Compute and store again even when the stored results are fresh.")
@click.option("--status", "status_only", is_flag=True, help="Only say, per run, whether its stored results are fresh.")
@click.option("--clear", is_flag=True, help="Remove the stored results (of --run, else of every run).")
@_heavy_options
@engine_options
def materialize(store, run_id, force, status_only, clear, batch_steps, memory_limit, engine, master, remote):
    """Compute each run's per-(step, layer) analysis views (layer_skew, tokens_per_expert,
    skew_by_batch, skew_decomposition, run_shape, layer_placement and the report's
    whole-run distributions) once and store them in the store, so that `moetrace report`,
    `moetrace skew` and Run.skew() / Run.tokens_per_expert() read them instead of the
    expert_load rows. `moetrace report` stores them too; this command does it ahead.

    Example:

    \b
        moetrace synth demo --layers 4 --steps 50
        moetrace materialize demo            # compute and store (a fresh run is skipped)
        moetrace materialize demo --status   # fresh, stale (and why) or absent, per run
        moetrace materialize demo --clear    # remove the stored results

    They live in the store as tables analysis_cache (one row per stored computation: its
    key) and cache_<view>, under each run's partition, written as one transaction. The key
    is the moetrace and DuckDB versions, a hash of the views' SQL and a fingerprint of the
    run's input files: when it no longer matches (the run re-ingested, moetrace upgraded,
    a view changed) the results are recomputed. With --engine spark they are computed on
    Spark (the same rows), then stored alike.
    """
    st = open_store(store)
    if clear:
        removed = st.run(run_id).clear_cache() if run_id else st.clear_cache()
        n = sum(removed.values())
        click.echo(f"removed {n} stored-analysis file{'s' if n != 1 else ''}" + (f" of run {run_id}" if run_id else ""))
        return
    runs = [st.run(run_id)] if run_id else [st.run(r) for r in st.run_ids()]
    if not runs:
        click.echo("no runs")
        return
    if status_only:
        for r in runs:
            click.echo(r.cache_state().line())
        return
    from ..analyze.on_engine import compute_with

    stored: list[str] = []
    with engine_sql(st, engine, master, remote) as sql:
        for r in runs:
            try:
                before, after = r.materialize(force=force, batch_steps=batch_steps, memory_limit=memory_limit,
                                              progress=_progress,
                                              compute=compute_with(sql) if sql is not None else None)
            except StoreError as e:   # one transaction per run: the runs before this one are stored
                raise StoreError(_partly_stored(e, r.id, stored, store)) from None
            stored.append(r.id)
            if before.fresh and not force:
                click.echo(f"{after.line()}: kept")
            else:
                rows = sum(json.loads(after.header["rows_json"]).values())
                click.echo(f"run {r.id}: stored analysis {after.header['cache_id']} ({rows:,} rows, computed in "
                           f"{after.header['compute_s']:.1f} s" + (" on Spark" if sql is not None else "") + ")"
                           + (f"; replaced a stale one ({before.reason})" if before.status == "stale" else ""))


@click.command("tokens")
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@run_option
@click.option("--by", type=click.Choice(["expert", "layer", "step"]), default="expert", show_default=True,
              help="expert: each expert's tokens over the run, most loaded first; layer: the per-expert "
                   "distribution of a step, per layer; step: every (step, layer).")
@click.option("--top", type=int, default=None, help="Only the first N rows (--by expert: the N most loaded experts).")
@output_options
def tokens(store, run_id, by, top, fmt, output):
    """Tokens per expert: how many token-expert assignments each expert got, its share, and
    per layer the spread over experts in a step (views expert_load, tokens_per_expert).

    Example:

    \b
        moetrace tokens demo --top 10
        moetrace tokens demo --by layer
    """
    from ..analyze.glance import tokens_table

    st = open_store(store)
    run = st.run(run_id)
    emit(tokens_table(st, run.id, by, top), fmt, output)


def _partly_stored(error: Exception, run_id: str, stored: list[str], store: str) -> str:
    """The one line of a materialize that failed at ``run_id`` after storing ``stored``
    (each run's analysis is its own transaction: those stay stored, and are fresh, so a
    rerun skips them and stores the rest)."""
    msg = str(error)
    if not stored:
        return msg
    msg = msg.replace("; nothing was written", "")
    return (f"{msg}; run {run_id}'s analysis was not written, but {len(stored)} run(s) before it were stored "
            f"({', '.join(stored[:5])}{' ...' if len(stored) > 5 else ''}): rerun `moetrace materialize {store}` "
            f"to store the rest (stored runs are kept)")


def register(cli):
    cli.add_command(report)
    cli.add_command(skew)
    cli.add_command(materialize)
    cli.add_command(tokens)

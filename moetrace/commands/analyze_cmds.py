"""Analysis commands: report, skew."""
from __future__ import annotations

import click

from ..output import emit, output_options
from ..store import Store


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@click.option("--run", "run_id", default=None, help="Run to report on (needed when the store holds several).")
@click.option("--out", "outdir", type=click.Path(file_okay=False), default=None,
              help="Folder for report.html, report.md and the PNGs (default ./moetrace-report-RUN).")
@click.option("--quiet", is_flag=True, help="Do not print the summary tables, only where the files went.")
def report(store, run_id, outdir, quiet):
    """Summarize a run: per-layer skew, tokens per expert, imbalance vs batch size, dummy
    steps, and every other section installed (replay, all-to-all exposure). Prints the
    summary tables and writes a self-contained report.html, report.md and PNGs.

    Example:

    \b
        moetrace synth demo --layers 4 --steps 50 --sigma 0.6
        moetrace report demo --out demo-report
    """
    from ..report.build import build_report

    st = Store(store)
    rep = build_report(st, run_id, outdir)
    if not quiet:
        click.echo(rep.terminal())
    pngs = len(rep.figures)
    click.echo(f"wrote {rep.html_path} (self-contained), {rep.md_path} and {pngs} PNG{'s' if pngs != 1 else ''} "
               f"in {rep.outdir}")


@click.command()
@click.argument("store", type=click.Path(file_okay=False, exists=True))
@click.option("--run", "run_id", default=None, help="Only this run (default: every run).")
@click.option("--by", type=click.Choice(["layer", "run", "step"]), default="layer", show_default=True,
              help="layer: distribution over steps per layer; run: one line per run; step: every (step, layer).")
@output_options
def skew(store, run_id, by, fmt, output):
    """Quick skew table: imbalance (max/mean rank tokens), efficiency, Gini and the hottest
    expert, from the layer_skew / skew_summary views.

    Example:

        moetrace skew demo --by layer
    """
    st = Store(store)
    where, params = ("WHERE run_id = ?", [st.resolve_run(run_id)]) if run_id else ("", [])
    if by == "run":
        q = (f"SELECT run_id, layers, steps, imbalance_mean, imbalance_p50, imbalance_p99, balancedness, "
             f"worst_layer, worst_layer_imbalance, placement_source FROM run_skew_summary {where} ORDER BY run_id")
    elif by == "layer":
        q = (f"SELECT run_id, layer, steps, steps_undefined, imbalance_mean, imbalance_p50, imbalance_p99, "
             f"efficiency_mean, gini_mean, top5pct_share_mean, hottest_expert_mode, straggler_rank_mode, "
             f"placement_source FROM skew_summary {where} ORDER BY run_id, imbalance_mean DESC NULLS LAST")
    else:
        q = (f"SELECT run_id, step, layer, max_rank_tokens, mean_rank_tokens, imbalance, efficiency, straggler_rank, "
             f"gini, cv, top5pct_share, hottest_expert, hottest_share, note FROM layer_skew {where} "
             f"ORDER BY run_id, step, layer")
    emit(st.sql(q, params or None), fmt, output)


def register(cli):
    cli.add_command(report)
    cli.add_command(skew)

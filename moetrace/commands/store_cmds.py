"""Store commands: synth, ingest, runs, sql, catalog, schema."""
from __future__ import annotations

import json

import click
import polars as pl

from ..output import emit, output_options
from ..store import Store


def store_arg(f):
    return click.argument("store", type=click.Path(file_okay=False))(f)


@click.command()
@store_arg
@click.option("--layers", default=4, show_default=True, help="MoE layers.")
@click.option("--experts", default=256, show_default=True, help="Routed experts per layer.")
@click.option("--top-k", default=8, show_default=True, help="Experts per token.")
@click.option("--ranks", default=32, show_default=True, help="Expert-parallel ranks.")
@click.option("--ranks-per-node", default=8, show_default=True, help="Ranks per node.")
@click.option("--steps", default=50, show_default=True, help="Steps (forward passes).")
@click.option("--tokens-per-step", default=4096, show_default=True, help="Tokens per step (all DP ranks).")
@click.option("--sigma", default=0.6, show_default=True, help="Log-normal popularity skew per layer.")
@click.option("--drift", default=0.0, show_default=True,
              help="How far popularity moves over the run (0..1 mix toward a permuted popularity).")
@click.option("--popularity-from", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Take each layer's popularity from a count matrix (SGLang logical_count JSON).")
@click.option("--per-token", is_flag=True, help="Also write the per-token routing table.")
@click.option("--by-src-rank", is_flag=True, help="Split expert_load rows by source (DP) rank.")
@click.option("--dummy-share", default=0.0, show_default=True, help="Fraction of (step, rank) pairs with no tokens.")
@click.option("--seed", default=0, show_default=True, help="Random seed.")
@click.option("--run-id", default=None, help="Run id (default synth-s<seed>).")
def synth(store, run_id, **kw):
    """Generate a synthetic run with known popularity (the truth is stored with it).

    Example:

    \b
        moetrace synth demo --layers 4 --steps 50 --sigma 0.6 --drift 0.5
    """
    from ..produce.synth import SynthConfig, synth as run_synth

    cfg = SynthConfig(**kw)
    res = run_synth(Store(store, create=True), cfg, run_id=run_id)
    if res.skipped:
        click.echo(f"{res.message}; nothing written")
    else:
        click.echo(f"run {res.run_id}: " + ", ".join(f"{t} {n} rows" for t, n in res.rows.items()))


def _kv(ctx, param, values):
    out = {}
    for v in values:
        if "=" not in v:
            raise click.BadParameter(f"{v!r} is not KEY=VALUE")
        k, val = v.split("=", 1)
        try:
            out[k] = json.loads(val)
        except ValueError:
            out[k] = val
    return out


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--store", "store_path", required=True, type=click.Path(file_okay=False), help="Store folder.")
@click.option("--format", "fmt", default=None, help="Force a source format instead of auto-detection.")
@click.option("--run-id", default=None, help="Run id for the ingested run.")
@click.option("--layers", "num_layers", type=int, default=None, help="Model MoE layers (else inferred).")
@click.option("--experts", "num_experts", type=int, default=None, help="Logical experts per layer (else inferred).")
@click.option("--top-k", "top_k", type=int, default=None, help="Experts per token.")
@click.option("--ranks", "num_ranks", type=int, default=None, help="Expert-parallel ranks.")
@click.option("--ranks-per-node", type=int, default=None, help="Ranks per node.")
@click.option("--dp-size", type=int, default=None, help="vLLM naive all-to-all: divide recorded load by DP size.")
@click.option("--kernel-rules", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Extra kernel classification rules (profiler traces).")
@click.option("--allow-inconsistent", is_flag=True, help="Ingest runs that fail conservation checks, flagged in runs.")
@click.option("--set", "extra", multiple=True, callback=_kv, help="Collector option KEY=VALUE (repeatable).")
def ingest(files, store_path, fmt, run_id, extra, **opts):
    """Ingest source files (or folders) into the store; the format is auto-detected.

    Example:

    \b
        moetrace ingest expert_load.csv routing.parquet --store st
    """
    from ..collect import collect

    options = {k: v for k, v in opts.items() if v not in (None, False)}
    options.update(extra)
    def said_skipped(paths):
        click.echo(f"skipped {len(paths)} file(s) of no known format: " + ", ".join(p.name for p in paths[:10])
                   + (" ..." if len(paths) > 10 else ""), err=True)

    runs = collect(files, format=fmt, options=options, on_skip=said_skipped)  # validates all before any write
    store = Store(store_path, create=True)
    if run_id and len(runs) > 1:
        raise click.UsageError(f"--run-id given but the inputs make {len(runs)} runs")
    for rd in runs:
        hint = run_id or rd.run.pop("run_id", None) or rd.run_id_hint
        res = store.write_run(rd.run, rd.tables, run_id=run_id, run_id_hint=hint)
        if res.skipped:
            click.echo(f"{', '.join(rd.files)}: {res.message}; nothing written")
        else:
            click.echo(f"run {res.run_id} ({rd.run.get('collector')}): "
                       + ", ".join(f"{t} {n} rows" for t, n in res.rows.items()))


@click.command()
@store_arg
@output_options
def runs(store, fmt, output):
    """List runs with model and cluster shape, source and row counts.

    Example:

    \b
        moetrace runs demo
    """
    st = Store(store)
    df = st.runs()
    if df.height == 0:
        click.echo("no runs")
        return
    counts = st.row_counts()
    wide = counts.pivot(on="table", index="run_id", values="rows") if counts.height else None
    show = df.select("run_id", "collector", "source", "num_layers", "num_experts", "top_k", "num_ranks",
                     "ranks_per_node", "num_slots", "inconsistent")
    if wide is not None:
        keep = [c for c in ("expert_load", "routing", "steps", "spans", "placement") if c in wide.columns]
        show = show.join(wide.select(["run_id", *keep]), on="run_id", how="left")
    emit(show, fmt, output)


@click.command()
@store_arg
@click.argument("query")
@output_options
def sql(store, query, fmt, output):
    """Run DuckDB SQL over the store's views (expert_load, routing, steps, spans, ...).

    Example:

    \b
        moetrace sql demo "SELECT step, layer, sum(tokens) FROM expert_load GROUP BY ALL LIMIT 5"
    """
    st = Store(store)
    emit(st.sql(query), fmt, output)


@click.command()
@store_arg
def catalog(store):
    """Write STORE/catalog.duckdb with the views, paths relative to the store.

    Example:

    \b
        moetrace catalog demo && cd demo && duckdb catalog.duckdb -c "FROM runs"
    """
    st = Store(store)
    path = st.write_catalog()
    click.echo(f"wrote {path}")
    click.echo(f"open it with:  cd {st.path} && duckdb catalog.duckdb")
    click.echo(f"          or:  duckdb -cmd \"SET file_search_path='{st.path}'\" {path}")


@click.command("tables")
@click.argument("table", required=False)
def tables_cmd(table):
    """Show the table contract (schemas/): tables, or one table's columns.

    Example:

    \b
        moetrace tables expert_load
    """
    from .. import schema

    if table is None:
        emit(pl.DataFrame([{"table": t.name, "version": t.version, "columns": len(t.columns),
                            "description": t.description} for t in schema.load_all().values()]))
        return
    ts = schema.get(table)
    emit(pl.DataFrame([{"column": c.name, "type": c.type, "nullable": c.nullable, "unit": c.unit or "",
                        "meaning": c.description} for c in ts.columns]))


def register(cli):
    for cmd in (synth, ingest, runs, sql, catalog, tables_cmd):
        cli.add_command(cmd)

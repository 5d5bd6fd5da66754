"""Store commands: synth, ingest, runs, sql, catalog, tables."""
from __future__ import annotations

import click

from .. import open_store
from ..output import emit, output_options
from ._options import engine_options, kv_options, rows_written, store_argument

store_arg = store_argument


def _known_collector_options():
    from ..collect import known_options

    return known_options()


def _formats_help() -> str:
    from ..collect import registry

    return "Force a source format instead of auto-detection: " + "; ".join(
        f"{name} ({c.description})" if c.description else name for name, c in registry().items()) + "."


class _LazyHelpOption(click.Option):
    """An option whose help text is computed when help is printed (the collector registry)."""

    def __init__(self, *args, help_fn=None, **kwargs):
        self._help_fn = help_fn
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        if self._help_fn is not None and not self.help:
            self.help = self._help_fn()
        return super().get_help_record(ctx)


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
    from ..produce.synth import SynthConfig
    from ..produce.synth import synth as run_synth

    cfg = SynthConfig(**kw)
    cfg.validate()  # bad options leave no store behind
    res = run_synth(open_store(store, create=True), cfg, run_id=run_id)
    if res.skipped:
        click.echo(f"{res.message}; nothing written")
    else:
        click.echo(f"run {res.run_id}: " + rows_written(res.rows, open_store(store).run_row(res.run_id)))


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(), metavar="STORE FILE...")
@click.option("--store", "store_path", type=click.Path(file_okay=False), default=None,
              help="Store folder (then every positional argument is an input file or folder).")
@click.option("--format", "fmt", default=None, cls=_LazyHelpOption, help_fn=_formats_help)
@click.option("--run-id", default=None, help="Run id for the ingested run.")
@click.option("--layers", "num_layers", type=int, default=None, help="Model MoE layers (else inferred).")
@click.option("--experts", "num_experts", type=int, default=None, help="Logical experts per layer (else inferred).")
@click.option("--top-k", "top_k", type=int, default=None, help="Experts per token.")
@click.option("--ranks", "num_ranks", type=int, default=None, help="Expert-parallel ranks.")
@click.option("--ranks-per-node", type=int, default=None, help="Ranks per node.")
@click.option("--groups", "num_groups", type=int, default=None,
              help="Expert groups of the model (DeepSeek-V3/R1: 8; 1 = not grouped), for hierarchical EPLB.")
@click.option("--model-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The model's Hugging Face config.json: experts, top-k, expert groups, hidden size, expert bytes.")
@click.option("--dp-size", type=int, default=None, help="vLLM naive all-to-all: divide recorded load by DP size.")
@click.option("--kernel-rules", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Extra kernel classification rules (profiler traces).")
@click.option("--allow-inconsistent", is_flag=True, help="Ingest runs that fail conservation checks, flagged in runs.")
@click.option("--set", "extra", multiple=True, callback=kv_options(_known_collector_options), metavar="KEY=VALUE",
              help="Collector option (repeatable); unknown keys are refused with the list of known ones.")
def ingest(paths, store_path, fmt, run_id, extra, **opts):
    """Ingest source files (or folders) into STORE; the format is auto-detected.

    The store comes first, as for every other command (``--store STORE`` followed by the
    files works too). Every input is validated before anything is written.

    Example:

    \b
        moetrace ingest st expert_load.csv routing.parquet
        moetrace ingest traces/ --store st --set jobs=1
    """
    from ..collect import ingest as ingest_files

    # `is`, not `in`: 0 == False, and --ranks 0 must reach the range check, not vanish
    options = {k: v for k, v in opts.items() if v is not None and v is not False}
    options.update(extra)

    def said_skipped(paths):
        click.echo(f"skipped {len(paths)} file(s) of no known format: " + ", ".join(p.name for p in paths[:10])
                   + (" ..." if len(paths) > 10 else ""), err=True)

    def said_written(rd, res):
        if res.skipped:
            click.echo(f"{', '.join(rd.files)}: {res.message}; nothing written")
        else:
            click.echo(f"run {res.run_id} ({rd.run.get('collector')}): " + rows_written(res.rows, rd.run))
            if any(t in rd.tables for t in ("expert_load", "expert_counts", "routing")):
                from ..domain.shape import shape_gaps

                for g in shape_gaps(rd.run):   # what it could not know, said now, not as a null later
                    click.echo(f"warning: run {res.run_id}: {g}", err=True)

    if store_path is None:
        if len(paths) < 2:
            raise click.UsageError("give the store and at least one input: moetrace ingest STORE FILE...")
        store_path, paths = paths[0], paths[1:]
    # validates every input before the store is opened or created
    ingest_files(store_path, paths, format=fmt, options=options, run_id=run_id, on_skip=said_skipped,
                 on_write=said_written, on_warn=lambda line: click.echo(f"warning: {line}", err=True))


@click.command()
@store_arg
@output_options
def runs(store, fmt, output):
    """List runs with model and cluster shape, source and row counts (expert_load: rows of
    the expert_load view, dense expert_counts rows unnested).

    Example:

    \b
        moetrace runs demo
    """
    from ..output import Rows, emit_rows

    st = open_store(store)
    runs = st.runs_rows()   # DuckDB rows: no polars, no Arrow (a command's start-up)
    if runs.height == 0:
        click.echo("no runs")
        return
    counts = {(run, t): n for run, t, n in st.partition_rows(dense_as_expert_load=True)}
    held = {t for _, t in counts}
    keep = [c for c in ("expert_load", "routing", "steps", "spans", "placement") if c in held]
    cols = ["run_id", "collector", "source", "num_layers", "num_experts", "top_k", "num_ranks", "ranks_per_node",
            "num_slots", "inconsistent"]
    at = [runs.columns.index(c) for c in cols]
    rid = runs.columns.index("run_id")
    emit_rows(Rows(cols + keep, [runs.types[i] for i in at] + ["BIGINT"] * len(keep),
                   [tuple(r[i] for i in at) + tuple(counts.get((r[rid], t)) for t in keep) for r in runs.rows]),
              fmt, output)
    from ..domain.shape import gap_notes

    for row in runs.dicts():   # every null shape value with its reason
        for n in gap_notes(row):
            click.echo(f"note: {n}", err=True)


@click.command()
@store_arg
@click.argument("query")
@engine_options
@output_options
@click.option("--timeout", type=click.FloatRange(min=0.001, max=10**7), default=None, metavar="SECONDS",
              help="Interrupt the query after SECONDS (one line, exit 2). Default: no limit.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="DuckDB's memory cap (default 1GiB, or $MOETRACE_SQL_MEMORY_LIMIT); larger work spills.")
@click.option("--allow-path", "allow_paths", multiple=True, metavar="DIR",
              help="Also let the query read Parquet files in DIR (or one FILE), e.g. to join them; repeatable.")
@click.option("--unsafe", is_flag=True,
              help="Lift the sandbox: any statement, any file, extensions (COPY, ATTACH, INSTALL ...).")
def sql(store, query, engine, master, remote, fmt, output, timeout, memory_limit, allow_paths, unsafe):
    """Run SQL over the store's tables and metric views (expert_load, routing, steps, spans,
    layer_skew, ...): DuckDB SQL here, or Spark SQL with --engine spark (the same views,
    transpiled from their DuckDB definitions; see docs/how-to/spark-trino-dask.md).

    DuckDB runs sandboxed: one SELECT (or EXPLAIN) statement, reading only the store's files
    (and --allow-path ones); COPY, ATTACH, INSTALL, SET and reads of other files are refused
    with one line, exit 2. --unsafe lifts the sandbox; --engine spark has no sandbox, so it
    needs --unsafe. Rows are streamed: -o files and
    --format csv/json are written batch by batch (docs/hardening.md).

    Example:

    \b
        moetrace sql demo "SELECT step, layer, sum(tokens) FROM expert_load GROUP BY ALL LIMIT 5"
        moetrace sql demo "SELECT * FROM expert_load" -o load.parquet --timeout 600
        moetrace sql demo "SELECT * FROM runs JOIN 'ref/*.parquet' USING (run_id)" --allow-path ref
        moetrace sql demo --engine spark --unsafe "SELECT layer, avg(imbalance) FROM layer_skew GROUP BY layer"
    """
    if engine == "spark" and not unsafe:
        from ..errors import UsageError

        raise UsageError("--engine spark runs Spark SQL outside the sandbox (it can read any file the "
                         "cluster can); add --unsafe to run it")
    st = open_store(store)
    if engine == "spark":
        from ..storage.spark import SparkSQL

        with SparkSQL(st.path, master=master, remote=remote) as sp:
            emit(sp.sql(query, dialect="spark"), fmt, output)
        return
    from ..output import _is_pretty
    from ..storage.sandbox import run_query

    run_query(st, query, fmt=fmt, output=output, pretty=_is_pretty(), unsafe=unsafe, allow=list(allow_paths),
              memory_limit=memory_limit, timeout=timeout)


@click.command()
@store_arg
def catalog(store):
    """Write STORE/catalog.duckdb with the views, paths relative to the store.

    Example:

    \b
        moetrace catalog demo && cd demo && duckdb catalog.duckdb -c "FROM runs"
    """
    st = open_store(store)
    path = st.write_catalog()
    click.echo(f"wrote {path}")
    click.echo(f"open it with:  cd {st.path} && duckdb catalog.duckdb")
    click.echo(f"          or:  duckdb -cmd \"SET file_search_path='{st.path}'\" {path}")


@click.command("tables")
@click.argument("table", required=False)
@output_options
def tables_cmd(table, fmt, output):
    """Document the stored tables (the contract, schemas/) and the metric views (SQL,
    moetrace/storage/sql): every name with what it holds, or one table's or view's columns
    with their type and meaning.

    Example:

    \b
        moetrace tables
        moetrace tables expert_load
        moetrace tables layer_skew
    """
    import polars as pl

    from ..storage import schema
    from ..storage.views import view_docs
    views = view_docs()
    if table is None:
        rows = [{"name": t.name, "kind": "table", "columns": len(t.columns), "description": t.description}
                for t in schema.load_all().values()]
        rows += [{"name": v, "kind": "view", "columns": None, "description": _first_sentence(d["doc"])}
                 for v, d in views.items()]
        emit(pl.DataFrame(rows, schema={"name": pl.Utf8, "kind": pl.Utf8, "columns": pl.Int64,
                                        "description": pl.Utf8}), fmt, output, max_rows=500)
        return
    if table in views:
        doc = views[table]["doc"]
        cols = _view_columns(table)
        if fmt == "table" and not output:
            click.echo(f"view {table} ({views[table]['file']}): {doc}\n")
        emit(pl.DataFrame([{"column": c, "type": t, "meaning": _column_meaning(table, doc, c)} for c, t in cols],
                          schema={"column": pl.Utf8, "type": pl.Utf8, "meaning": pl.Utf8}), fmt, output, max_rows=500)
        return
    if table not in schema.load_all():
        raise click.BadParameter(f"no table or view {table!r} (tables: {', '.join(schema.load_all())}; "
                                 f"views: {', '.join(views)})", param_hint="TABLE")
    ts = schema.get(table)
    if fmt == "table" and not output:
        click.echo(f"table {table} (schema version {ts.version}): {ts.description}\n")
    emit(pl.DataFrame([{"column": c.name, "type": c.type, "nullable": c.nullable, "unit": c.unit or "",
                        "meaning": c.description} for c in ts.columns]), fmt, output, max_rows=500)


def _first_sentence(text: str) -> str:
    cut = text.find(". ")
    return text if cut < 0 else text[:cut + 1]


def _mention(doc: str, column: str, strong: bool = True) -> str:
    """The clause of a view's doc that defines ``column``: strong, "column = ...",
    "column: ..." or a clause that starts with it; weak, "column (...)"; else ''."""
    import re

    name = re.escape(column)
    pat = rf"(?:^|[\s,;(`]){name}`?\s*(?:=|:\s)" if strong else rf"(?:^|[\s,;`]){name}`?\s*\("
    for clause in re.split(r"(?<=[.;])\s+", doc):
        if re.search(pat, clause) or (strong and re.match(rf"`?{name}\b", clause)):
            return clause
    return ""


def _column_meaning(view: str, doc: str, column: str) -> str:
    """What ``column`` of ``view`` means: storage/view_columns.json, else its view's own
    comment where it defines the column ("column = ..."), else the contract's description
    of an id column of that name; '' when none says."""
    from ..storage import schema
    from ..storage.views import view_columns

    meaning = view_columns().get(view, {}).get(column) or _mention(doc, column)
    if meaning:
        return meaning
    for t in ("expert_load", "steps", "spans", "placement", "runs"):   # ids keep their contract meaning
        ts = schema.get(t)
        if column in ts.column_names and column in ("run_id", "step", "layer", "rank", "expert", "slot"):
            return ts.column(column).description
    return ""


def _view_columns(view: str) -> list[tuple[str, str]]:
    """(column, DuckDB type) of a metric view, described over an empty store."""
    return _views_columns([view])[view]


def _views_columns(views) -> dict[str, list[tuple[str, str]]]:
    """:func:`_view_columns` of each of ``views``, described over one empty store (defining
    every view costs about a second; describing one more, little)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        st = open_store(d, create=True)
        con = st.connect()
        try:
            return {v: [(r[0], r[1]) for r in con.execute(f'DESCRIBE "{v}"').fetchall()] for v in views}
        finally:
            con.close()


def register(cli):
    for cmd in (synth, ingest, runs, sql, catalog, tables_cmd):
        cli.add_command(cmd)

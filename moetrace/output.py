"""Shared output formatting for every command that prints rows (table, csv, json)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    import polars as pl

FORMATS = ("table", "csv", "json")


def _pretty(ctx, param, value):
    if value:
        ctx.meta["moetrace.pretty"] = True
    return value


def pretty_option(f):
    """--pretty: indent --json / --format json output (read by :func:`emit` and :func:`echo_json`).
    Added once however many bundles ask for it."""
    if any(getattr(p, "name", None) == "pretty" for p in getattr(f, "__click_params__", ())):
        return f
    return click.option("--pretty", is_flag=True, expose_value=False, callback=_pretty,
                        help="Indent JSON output.")(f)


def json_option(f=None, *, help="Print the summary as JSON."):
    """--json (the command's function gets ``as_json``) with --pretty to indent it; print with
    :func:`echo_json`."""
    def deco(g):
        return click.option("--json", "as_json", is_flag=True, help=help)(pretty_option(g))
    return deco(f) if f is not None else deco


#: checks every -o/--out path goes through before a command runs (each raises a
#: MoetraceError: one line, exit 2); the commands layer adds the store check
#: (``moetrace.storage.paths.refuse_inside_store``), which this ground module cannot import
OUT_PATH_CHECKS: list = []


def check_out_path(ctx, param, value):
    """click callback of -o/--out options: run :data:`OUT_PATH_CHECKS` on the path."""
    if value is not None:
        for check in OUT_PATH_CHECKS:
            check(value, param.opts[0] if param is not None else "-o")
    return value


def output_options(f):
    """Add --format, -o/--out (FILE) and --pretty to a command (its function gets ``fmt`` and
    ``output``)."""
    f = pretty_option(f)
    f = click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                     help="How to print rows.")(f)
    f = click.option("-o", "--out", "--output", "output", type=click.Path(dir_okay=False), default=None,
                     callback=check_out_path, help="Write rows to FILE (.parquet or .csv) instead of printing them.")(f)
    return f


def _is_pretty() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get("moetrace.pretty"))   # meta is shared by every context of a run


def dumps(obj) -> str:
    """JSON text of ``obj`` (indented under --pretty); arrays as lists, other values that
    JSON lacks through str()."""
    return json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o),
                      indent=2 if _is_pretty() else None)


def echo_json(obj) -> None:
    """Print ``obj`` as JSON (a command's --json summary), indented under --pretty."""
    click.echo(dumps(obj))


def render_table(df: "pl.DataFrame", max_rows: int = 50, float_precision: int = 4) -> str:
    import polars as pl

    if df.width == 0:
        return "(no columns)"
    with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, float_precision=float_precision,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_formatting="ASCII_MARKDOWN",
                   tbl_width_chars=250):
        text = str(df)
    if df.height > max_rows:
        text += f"\n({df.height} rows; first and last shown)"
    return text


def emit(df: "pl.DataFrame", fmt: str = "table", output: str | None = None, max_rows: int = 50) -> None:
    if output:
        path = Path(output)
        if path.suffix == ".parquet":
            df.write_parquet(path)
        elif path.suffix == ".csv":
            df.write_csv(path)
        else:
            raise click.UsageError(f"-o {output}: use a .parquet or .csv file name")
        click.echo(f"wrote {df.height} rows to {path}", err=True)
        return
    if fmt == "csv":
        sys.stdout.write(df.write_csv())
    elif fmt == "json":
        click.echo(dumps(df.to_dicts()))
    else:
        click.echo(render_table(df, max_rows=max_rows))

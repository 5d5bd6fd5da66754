"""Shared output formatting for every command that prints rows (table, csv, json)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import polars as pl

FORMATS = ("table", "csv", "json")


def output_options(f):
    """Add --format and -o/--output to a command."""
    f = click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                     help="How to print rows.")(f)
    f = click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default=None,
                     help="Write rows to FILE (.parquet or .csv) instead of printing them.")(f)
    return f


def render_table(df: pl.DataFrame, max_rows: int = 50, float_precision: int = 4) -> str:
    if df.width == 0:
        return "(no columns)"
    with pl.Config(tbl_rows=max_rows, tbl_cols=-1, fmt_str_lengths=60, float_precision=float_precision,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_formatting="ASCII_MARKDOWN",
                   tbl_width_chars=250):
        text = str(df)
    if df.height > max_rows:
        text += f"\n({df.height} rows; first and last shown)"
    return text


def emit(df: pl.DataFrame, fmt: str = "table", output: str | None = None, max_rows: int = 50) -> None:
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
        click.echo(json.dumps(df.to_dicts(), default=str, indent=None))
    else:
        click.echo(render_table(df, max_rows=max_rows))

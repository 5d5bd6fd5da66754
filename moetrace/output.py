"""Shared output formatting for every command that prints rows (table, csv, json)."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
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


#: DuckDB result types and the polars types a query's frame has for them (``Store.sql``: Arrow,
#: HUGEINTs narrowed to Int64); a type not listed is left to polars to infer
_PL_OF_DUCK = {"BOOLEAN": "Boolean", "TINYINT": "Int8", "SMALLINT": "Int16", "INTEGER": "Int32", "BIGINT": "Int64",
               "HUGEINT": "Int64", "UTINYINT": "UInt8", "USMALLINT": "UInt16", "UINTEGER": "UInt32",
               "UBIGINT": "UInt64", "FLOAT": "Float32", "DOUBLE": "Float64", "VARCHAR": "String"}
_FAST_TYPES = frozenset(_PL_OF_DUCK)


@dataclass
class Rows:
    """Rows of a query as DuckDB returns them (``fetchall``), with their column names and
    DuckDB type names: what a command prints without polars (a command's start-up).
    :func:`emit_rows` prints them as :func:`emit` prints the frame of the same query."""
    columns: list[str]
    types: list[str]
    rows: list[tuple]

    @property
    def height(self) -> int:
        return len(self.rows)

    def dicts(self) -> list[dict]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def to_polars(self) -> "pl.DataFrame":
        """The rows as a polars frame, typed as ``Store.sql`` types the same query."""
        import polars as pl

        schema = {c: getattr(pl, _PL_OF_DUCK[t]) if t in _PL_OF_DUCK else None for c, t in zip(self.columns, self.types)}
        if any(v is None for v in schema.values()):
            return pl.DataFrame([dict(zip(self.columns, r)) for r in self.rows] or None,
                                schema=None if self.rows else list(self.columns))
        return pl.DataFrame(self.rows, schema=schema, orient="row")

    @staticmethod
    def concat(parts: "list[Rows]") -> "Rows":
        """The rows of ``parts`` one after the other (their columns must agree)."""
        first = parts[0]
        types = list(first.types)
        for p in parts[1:]:
            if p.columns != first.columns:
                raise ValueError("rows with other columns")
            types = [a if a == b else "" for a, b in zip(types, p.types)]   # "": unknown, polars infers
        return Rows(list(first.columns), types, [r for p in parts for r in p.rows])


def _cell(value, typ: str) -> str | None:
    """``value`` as polars prints it in :func:`render_table`, or None when this does not
    know for sure (the caller lets polars print the table)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if typ not in ("FLOAT", "DOUBLE") and abs(value) < 2 ** 63 else None
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4f}" if abs(value) < 1e10 else None    # polars writes large ones as 1.0000e15
    if isinstance(value, str):
        return value if len(value) <= 60 and value.isascii() and value.isprintable() else None
    return None


def render_rows(r: Rows, max_rows: int = 50) -> str | None:
    """:func:`render_table` of ``r.to_polars()``, without polars; None where it is not sure
    to print the same text (a type or value it does not know, a table wider than 250
    characters: the caller lets polars print it)."""
    if not r.columns:
        return "(no columns)"
    if any(t not in _FAST_TYPES for t in r.types) or max_rows % 2:
        return None
    shown = r.rows if len(r.rows) <= max_rows else r.rows[:max_rows // 2] + [None] + r.rows[-(max_rows // 2):]
    cells = []
    for row in shown:
        if row is None:
            cells.append(["..."] * len(r.columns))
            continue
        line = []
        for v, t in zip(row, r.types):
            c = _cell(v, t)
            if c is None:
                return None
            line.append(c)
        cells.append(line)
    if not all(h.isascii() and h.isprintable() and len(h) <= 60 for h in r.columns):
        return None
    widths = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(r.columns)]
    if 1 + sum(w + 3 for w in widths) > 250:
        return None
    def fmt(vals):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [fmt(r.columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(line) for line in cells]
    text = "\n".join(out)
    if len(r.rows) > max_rows:
        text += f"\n({len(r.rows)} rows; first and last shown)"
    return text


def emit_rows(r: Rows, fmt: str = "table", output: str | None = None, max_rows: int = 50) -> None:
    """:func:`emit` for :class:`Rows`: the same text, printed without polars where it can be
    (a table or JSON of plain values); otherwise, and for CSV and files, through polars."""
    if not output:
        if fmt == "table":
            text = render_rows(r, max_rows)
            if text is not None:
                click.echo(text)
                return
        elif fmt == "json" and all(t in _FAST_TYPES for t in r.types):
            click.echo(dumps(r.dicts()))
            return
    emit(r.to_polars(), fmt, output, max_rows)


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

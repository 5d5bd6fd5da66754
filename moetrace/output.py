"""Shared output formatting for every command that prints rows (table, csv, json), and
:class:`AtomicOutput`, the one way moetrace writes a file a user named (``-o``, report
files, plan exports, plots, trace exports).

An output is never opened by its name or by a guessable temporary name (another user of a
shared folder could plant a symlink there and have moetrace overwrite any file it can
write): it is written inside a fresh private folder created beside the target
(``mkdtemp``: mode 0700, a random name, never following a link), created there with
``O_CREAT|O_EXCL|O_NOFOLLOW``, then renamed over the target, which a rename replaces
without following. A target that is a symlink, a folder or not a regular file is refused.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
import sys
import tempfile
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
        opt = param.opts[0] if param is not None else "-o"
        folder_ok = bool(getattr(getattr(param, "type", None), "dir_okay", False)) and os.path.isdir(value)
        if os.path.islink(value) and not folder_ok:
            from .errors import UsageError

            raise UsageError(f"{opt} {shown_name(value)}: is a symbolic link; moetrace does not write through "
                             "links (remove it or name another file)")
        for check in OUT_PATH_CHECKS:
            check(value, opt)
    return value


class AtomicOutput:
    """A file ``path`` written atomically and without following links (module docstring):
    write to :attr:`tmp` (or :meth:`open` it), then :meth:`commit`; :meth:`abort` (or an
    exception inside ``with``) leaves ``path`` as it was and removes the private folder.
    Refusals are one-line :class:`~moetrace.errors.UsageError` naming ``what`` and the path."""

    def __init__(self, path: str | os.PathLike, what: str = "-o"):
        from .errors import UsageError

        self.path = Path(path)
        self.what = what
        shown = shown_name(self.path)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise UsageError(f"{what} {shown}: cannot write ({e.strerror})") from None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                raise UsageError(f"{what} {shown}: is a symbolic link; moetrace does not write through links "
                                 "(remove it or name another file)")
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{what} {shown}: exists and is not a regular file")
        parent = self.path.parent
        try:
            self._dir = tempfile.mkdtemp(prefix=f".{self.path.name[:40]}.", suffix=".moetrace-tmp", dir=parent)
        except OSError as e:
            raise UsageError(f"{what} {shown}: cannot write in {shown_name(parent)} ({e.strerror})") from None
        self.tmp = Path(self._dir) / ("out" + self.path.suffix)   # the suffix: writers pick the format by it
        self.done = False

    def open(self, mode: str = "wb", **kw):
        """The temporary file, created with O_CREAT|O_EXCL|O_NOFOLLOW (mode ``w``/``wb``)."""
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o666)
        return os.fdopen(fd, mode, **kw)

    def commit(self) -> Path:
        """Rename the written file over the target (an empty file when nothing was written)."""
        from .errors import UsageError

        try:
            if not os.path.lexists(self.tmp):
                self.open().close()
            st = os.lstat(self.tmp)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{self.what} {shown_name(self.path)}: the temporary file was replaced")
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise UsageError(f"{self.what} {shown_name(self.path)}: cannot write ({e.strerror})") from None
        self.done = True
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "AtomicOutput":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.done:
            self.commit()
        elif exc_type is not None:
            self.abort()


def write_output(path: str | os.PathLike, data: str | bytes, what: str = "-o") -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through :class:`AtomicOutput`."""
    with AtomicOutput(path, what) as out:
        with out.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return out.path


def shown_name(name) -> str:
    """A file name as messages show it: control characters escaped (see errors.shown)."""
    from .errors import shown

    return shown(name)


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
        if path.suffix not in (".parquet", ".csv"):
            raise click.UsageError(f"-o {shown_name(output)}: use a .parquet or .csv file name")
        with AtomicOutput(path) as out:
            if path.suffix == ".parquet":
                df.write_parquet(out.tmp)
            else:
                df.write_csv(out.tmp)
        click.echo(f"wrote {df.height} rows to {shown_name(path)}", err=True)
        return
    if fmt == "csv":
        sys.stdout.write(df.write_csv())
    elif fmt == "json":
        click.echo(dumps(df.to_dicts()))
    else:
        click.echo(render_table(df, max_rows=max_rows))

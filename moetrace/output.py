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
        params = getattr(g, "__click_params__", None)
        if params:   # the command's own --json summary replaces output_options' alias
            params[:] = [p for p in params if p.name != "json_alias"]
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


def _json_alias(ctx, param, value):
    if value:
        ctx.meta["moetrace.json"] = True
    return value


def _resolve_format(ctx, param, value):
    """--format, with --json its alias: None (not given) is table, or json under --json."""
    if ctx.meta.get("moetrace.json"):
        if value not in (None, "json"):
            raise click.BadParameter(f"--json and --format {value} ask for two formats; give one")
        return "json"
    return value or "table"


def _wide(ctx, param, value):
    if value:
        ctx.meta["moetrace.wide"] = True
    return value


def wide_option(f):
    """--wide: a table shows every column, however wide (read by :func:`render_table`)."""
    if any(getattr(p, "name", None) == "wide" for p in getattr(f, "__click_params__", ())):
        return f
    return click.option("--wide", is_flag=True, expose_value=False, callback=_wide,
                        help="Show every column of a table, however wide the terminal (default: the columns "
                             "that fit $COLUMNS; --format csv/json always give all).")(f)


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
    """Add --format table|csv|json (``--json`` its alias, unless the command has its own
    ``--json`` summary), --wide, -o/--out (FILE) and --pretty to a command (its function
    gets ``fmt`` and ``output``)."""
    f = pretty_option(f)
    f = wide_option(f)
    if not any(getattr(p, "name", None) in ("as_json", "json") for p in getattr(f, "__click_params__", ())):
        f = click.option("--json", "json_alias", is_flag=True, is_eager=True, expose_value=False,
                         callback=_json_alias, help="Same as --format json.")(f)
    f = click.option("--format", "fmt", type=click.Choice(FORMATS, case_sensitive=False), default=None,
                     show_default="table", callback=_resolve_format, help="How to print rows.")(f)
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


def term_width() -> int:
    """The width a table or a line of prose must fit: ``$COLUMNS``, else the terminal's,
    else 120 (output piped to a file)."""
    import shutil

    return max(40, shutil.get_terminal_size((120, 24)).columns)


def _is_wide() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get("moetrace.wide"))


def _num_text(v: float, whole: bool) -> str:
    """A float as a person reads it: a whole-number column as integers (1735, not
    1735.0000), a value already rounded to at most 4 decimals as it is (0.152, not 0.1520),
    else 4 significant digits; no exponent from 1000 up (193886, not 1.939e+05)."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if whole or abs(v) >= 1000:
        return f"{v:.0f}"
    if v == 0:
        return "0"
    if round(v, 4) == v:          # already rounded (a query's round(x, 3)): as it is, no padding
        return f"{v:.4f}".rstrip("0").rstrip(".")
    return f"{v:.4g}"


def _text(v, whole: bool) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return _num_text(v, whole)
    t = str(v) if not isinstance(v, str) else v
    t = " ".join(t.split()) if not t.isprintable() else t
    return t if len(t) <= 60 else t[:59] + "…"


def table_text(columns: list[str], rows: list[tuple], max_rows: int = 50) -> str:
    """Rows as a Markdown-style table a person reads: numbers as :func:`_num_text` says,
    at most ``max_rows`` (first and last half), and unless ``--wide`` only the leading
    columns that fit :func:`term_width`; the columns left out are named on the last lines
    (``--wide`` or ``--format csv/json`` give them). The one table renderer of the CLI."""
    if not columns:
        return "(no columns)"
    whole = []
    for i in range(len(columns)):
        vals = [r[i] for r in rows if isinstance(r[i], float) and math.isfinite(r[i])]
        whole.append(bool(vals) and all(v == int(v) and abs(v) < 2**53 for v in vals))
    half = max_rows // 2
    shown: list = list(rows) if len(rows) <= max_rows else list(rows[:half]) + [None] + list(rows[-half:])
    cells = [["…"] * len(columns) if r is None else [_text(v, w) for v, w in zip(r, whole)] for r in shown]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(columns)]
    keep = len(columns)
    if not _is_wide():
        limit = term_width()
        while keep > 1 and 1 + sum(w + 3 for w in widths[:keep]) > limit:
            keep -= 1

    def line(vals):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals[:keep], widths[:keep])) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths[:keep]) + "|"] + [line(c) for c in cells]
    if len(rows) > max_rows:
        out.append(f"({len(rows)} rows; first and last shown)")
    if keep < len(columns):
        import textwrap

        left = columns[keep:]
        out += textwrap.wrap(f"({len(left)} more column(s): {', '.join(left)}; --wide or --format csv shows them)",
                             term_width(), break_on_hyphens=False)
    return "\n".join(out)


def render_table(df: "pl.DataFrame", max_rows: int = 50, float_precision: int | None = None) -> str:
    """``df`` as :func:`table_text` prints it."""
    if df.width == 0:
        return "(no columns)"
    return table_text(list(df.columns), df.rows(), max_rows)


def echo_wrapped(text: str, indent: str = "", hang: str = "    ", err: bool = False) -> None:
    """One line of prose, wrapped to :func:`term_width` (continuation lines indented by
    ``indent + hang``); words are never split."""
    import textwrap

    lines = textwrap.wrap(text, term_width(), initial_indent=indent, subsequent_indent=indent + hang,
                          break_long_words=False, break_on_hyphens=False) or [indent]
    click.echo("\n".join(lines), err=err)


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


def render_rows(r: Rows, max_rows: int = 50) -> str:
    """:func:`render_table` of ``r.to_polars()``, without polars (a command's start-up)."""
    return table_text(list(r.columns), list(r.rows), max_rows)


def emit_rows(r: Rows, fmt: str = "table", output: str | None = None, max_rows: int = 50) -> None:
    """:func:`emit` for :class:`Rows`: the same text, printed without polars where it can be
    (a table or JSON of plain values); otherwise, and for CSV and files, through polars."""
    if not output:
        if fmt == "table":
            click.echo(render_rows(r, max_rows))
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


class Progress:
    """A progress bar on stderr (click's), for a command that can run longer than a few
    seconds: call it with (done, total); silent when stderr is not a terminal (a pipe, a
    log file, a test). Use as a context manager (the bar is closed on exit)."""

    def __init__(self, label: str):
        self.label, self.bar, self.shown = label, None, 0

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.shown)
        self.shown = done

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def times_in_ms(df: "pl.DataFrame") -> "pl.DataFrame":
    """A table's ``*_ns`` columns as ``*_ms`` (nanoseconds are what the store keeps; a
    person reads 191.9 ms, not 191896325): for terminal tables, never for csv/json."""
    import polars as pl

    from .units import ns_to_ms

    ns = [c for c in df.columns if c.endswith("_ns") and df.schema[c].is_numeric()]
    return df.with_columns([(pl.col(c).cast(pl.Float64) * ns_to_ms(1.0)).alias(c[:-3] + "_ms") for c in ns]) \
        .select([c[:-3] + "_ms" if c in ns else c for c in df.columns])


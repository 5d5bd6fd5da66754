"""The report section interface shared by every section module."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import polars as pl

from ..units import time_text


@dataclass
class Figure:
    path: Path          # PNG written into ctx.outdir
    caption: str


@dataclass
class Section:
    key: str                      # short id, used for anchors ("skew", "replay", "exposure")
    title: str
    markdown: str                 # body in Markdown (tables as Markdown tables)
    terminal: str = ""            # what to print in the terminal (plain text tables)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # approximations, caveats: always shown


@dataclass
class ReportContext:
    store: object                 # moetrace.storage.store.Store
    run_id: str
    run: dict                     # the runs row
    outdir: Path

    def sql(self, query: str, params=None) -> pl.DataFrame:
        """SQL over the store's views (the metric definitions of ``storage/sql``)."""
        return self.store.sql(query, params)

    @cached_property
    def facade(self):
        """The run as :class:`moetrace.run.Run`: a section reaches analysis and replay
        through it (or through :meth:`sql`), never by importing them
        (``tests/test_report_imports.py``)."""
        return self.store.run(self.run_id)


def cell(v, float_fmt: str = "{:.3f}") -> str:
    """One table cell: yes/no for booleans, the float format for floats, empty for null."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return float_fmt.format(v)
    return "" if v is None else str(v)


def _md_cell(text: str) -> str:
    """A cell's text in a pipe table: a ``|`` (or a line break) from the data must not
    open another column or end the row."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


_CODE = re.compile(r"(`+)(.+?)\1", re.S)


def md_safe(md: str) -> str:
    """Markdown whose text cannot carry markup from the data into a reader: outside code
    spans and fenced blocks, ``<``, ``>`` and ``&`` become entities (no raw HTML such as
    ``<img onerror=...>``) and ``[``/``]`` are escaped (no links); inside code, text is
    literal already. Applied to report.md as written (report.html escapes on its own)."""
    out, fenced = [], False
    for line in md.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
            continue
        if fenced:
            out.append(line)
            continue
        parts, last = [], 0
        for m in _CODE.finditer(line):
            parts.append(_md_text(line[last:m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_md_text(line[last:]))
        out.append("".join(parts))
    return "\n".join(out)


def _md_text(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("[", "\\[").replace("]", "\\]"))


def md_table(df: pl.DataFrame, float_fmt: str = "{:.3f}", max_rows: int = 40) -> str:
    """A polars frame as a Markdown table (first max_rows rows). Columns named ``*_ns`` are
    shown as times with their unit (µs, ms, s: :func:`time_text`) under the name without
    ``_ns``; booleans read yes/no."""
    if df.height == 0:
        return "_(no rows)_"
    cols = df.columns
    is_ns = [c.endswith("_ns") and df.schema[c].is_numeric() for c in cols]
    heads = [c[:-3] if t else c for c, t in zip(cols, is_ns)]
    lines = ["| " + " | ".join(_md_cell(h) for h in heads) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.head(max_rows).iter_rows():
        lines.append("| " + " | ".join(_md_cell(time_text(v) if t else cell(v, float_fmt)) for v, t in zip(row, is_ns))
                     + " |")
    if df.height > max_rows:
        lines.append(f"\n_({df.height} rows, first {max_rows} shown)_")
    return "\n".join(lines)

"""Assemble a report from every section module in ``report/sections/``.

``build_report(store, run_id, outdir)`` imports each ``sections/*.py`` (skipping names
starting with ``_``), sorts them by ``ORDER`` (then name), calls ``build(ctx)`` and writes

* ``report.md``   Markdown with the PNGs linked by relative path,
* ``report.html`` one self-contained file: styles inline, PNGs inline as base64, no
  external links, so it opens offline and can be mailed as is,
* the PNGs the sections drew (in ``outdir``),

and returns a :class:`Report` whose ``terminal()`` is the text the CLI prints. A section
that raises does not sink the report: it is replaced by a visible "section failed" entry.
"""
from __future__ import annotations

import base64
import html
import importlib
import json
import pkgutil
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..analyze import cache as analysis_cache
from ..analyze import configure, drop_materialized
from ..output import write_output
from .base import ReportContext, Section


@dataclass
class Report:
    run_id: str
    run: dict
    outdir: Path
    sections: list[Section] = field(default_factory=list)
    run_notes: list[str] = field(default_factory=list)
    md_path: Path | None = None
    html_path: Path | None = None

    @property
    def figures(self):
        return [f for s in self.sections for f in s.figures]

    def terminal(self) -> str:
        out = [header_lines(self.run, self.run_notes, plain=True)]
        for s in self.sections:
            out.append("")
            out.append(s.title)
            out.append("=" * len(s.title))
            out.append((s.terminal or s.markdown).rstrip())
            for n in s.notes:
                out.append(f"note: {n}")
        return "\n".join(out).rstrip() + "\n"


def discover_sections():
    """Section modules in report/sections/, sorted by (ORDER, module name)."""
    from . import sections

    mods = []
    for info in pkgutil.iter_modules(sections.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{sections.__name__}.{info.name}")
        if hasattr(mod, "build"):
            mods.append(mod)
    return sorted(mods, key=lambda m: (getattr(m, "ORDER", 1000), m.__name__))


def run_notes(run: dict) -> list[str]:
    """Statements every report shows first: approximations recorded with the run."""
    notes = []
    raw = run.get("approximations")
    if raw:
        try:
            items = json.loads(raw)
        except ValueError:
            items = [raw]
        if isinstance(items, str):
            items = [items]
        notes.extend(str(i) for i in items)
    if run.get("inconsistent"):
        notes.append("this run failed a conservation check and was ingested with --allow-inconsistent")
    return notes


def shape_caveats(store, rid: str, run: dict) -> list[str]:
    """Caveats every report shows first that the run's shape implies: an assumed placement,
    a rank count or top-k that ingest could not know."""
    notes = []
    try:
        src = set(store.sql("SELECT DISTINCT placement_source FROM layer_placement WHERE run_id = ?",
                            [rid])["placement_source"].drop_nulls().to_list())
    except Exception:   # a store without the placement views (no expert load): nothing assumed there
        src = set()
    if "contiguous" in src:
        notes.append("No placement was recorded: rank loads, stragglers and replays ASSUME contiguous placement "
                     "(expert e on rank e·ranks/experts, one slot per expert); a deployment with replicas or a "
                     "planned placement differs.")
    if run.get("num_ranks") is None:
        notes.append("The number of ranks is unknown (runs.num_ranks is empty: ingest --ranks N records it): no "
                     "rank loads, imbalance or replay.")
    if run.get("top_k") is None and run.get("num_experts") is not None:
        notes.append("top-k is unknown (runs.top_k is empty: ingest --top-k K records it): tokens per step are "
                     "not derived, only token-expert assignments.")
    return notes


def header_lines(run: dict, notes: list[str], plain: bool) -> str:
    shape = ", ".join(f"{k} {run[c]}" for k, c in (("layers", "num_layers"), ("experts", "num_experts"),
                                                    ("top-k", "top_k"), ("ranks", "num_ranks"),
                                                    ("ranks/node", "ranks_per_node"), ("slots", "num_slots"))
                      if run.get(c) is not None)
    lines = [f"moetrace report: run {run['run_id']}" if plain else f"# moetrace report: run `{run['run_id']}`", ""]
    lines.append(f"source: {run.get('source')} (collector {run.get('collector')}, moetrace "
                 f"{run.get('collector_version')})")
    lines.append(f"shape: {shape or 'unknown'}")
    if notes:
        lines.append("")
        lines.append("Approximations and caveats of this run:")
        lines.extend(f"- {n}" for n in notes)
    if not plain:
        lines = [lines[0], ""] + [ln if ln.startswith(("-", "Approx")) or not ln else ln + "  " for ln in lines[2:]]
    return "\n".join(lines)


def _failed(mod, exc: BaseException) -> Section:
    name = mod.__name__.rsplit(".", 1)[-1]
    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return Section(key=name, title=f"{name} (section failed)",
                   markdown=f"This section could not be built: `{tb}`",
                   terminal=f"This section could not be built: {tb}",
                   notes=[f"section {name} failed: {tb}"])


def build_report(store, run_id: str | None = None, outdir: str | Path | None = None, *, html_out: bool = True,
                 md_out: bool = True, cache: bool = True, batch_steps: int | None = None,
                 memory_limit: str | None = None, progress=None, reuse: bool = True, save: bool = True,
                 compute=None) -> Report:
    """Build every section for ``run_id`` (the store's only run when None) into ``outdir``.

    With ``cache`` the per-(step, layer) analysis views (layer_skew, tokens_per_expert,
    skew_by_batch, skew_decomposition, run_shape / layer_placement and the whole-run
    distributions: :data:`moetrace.analyze.cache.CACHED_VIEWS`) are read from the run's
    stored analysis when its key matches (``reuse``), else computed once for the run, in
    step batches of ``batch_steps`` (default: from the run's size), and stored for the
    next report (``save``; a store that cannot take them is said in one line). Either way
    they shadow the views on the store's connection while the sections run (TEMP views or
    tables, dropped afterwards): bounded memory on fleet-size runs, one pass instead of one
    per query, none when stored. DuckDB's memory is capped at ``memory_limit`` (default
    :func:`moetrace.analyze.default_memory_limit`). ``progress`` gets progress lines.
    ``compute``: another engine computes the views when they are not stored (Spark:
    :func:`moetrace.analyze.on_engine.compute_with`); they are stored the same way.
    """
    rid = store.resolve_run(run_id)
    run = store.run_row(rid)
    out = Path(outdir) if outdir is not None else Path(f"moetrace-report-{rid}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # --out file/sub, a read-only folder: bad input, one line, exit 2
        from ..errors import UsageError

        raise UsageError(f"{out}: cannot create the report folder ({e.strerror})") from None
    ctx = ReportContext(store=store, run_id=rid, run=run, outdir=out)
    configure(store.con, memory_limit)
    cached = analysis_cache.use(store, rid, batch_steps, progress=progress, reuse=reuse, save_new=save,
                                compute=compute) if cache else None
    try:
        # after the views are shadowed: the caveats read layer_placement, which scans expert_load
        report = Report(run_id=rid, run=run, outdir=out, run_notes=run_notes(run) + shape_caveats(store, rid, run))
        for mod in discover_sections():
            try:
                sec = mod.build(ctx)
            except Exception as exc:  # one broken section must not hide the others
                sec = _failed(mod, exc)
            if sec is not None:
                report.sections.append(sec)
    finally:
        drop_materialized(store.con, cached)
    if md_out:
        report.md_path = out / "report.md"
        write_output(report.md_path, render_markdown(report), "report")
    if html_out:
        report.html_path = out / "report.html"
        write_output(report.html_path, render_html(report), "report")
    return report


# ----------------------------------------------------------------------------- markdown
def render_markdown(report: Report) -> str:
    """report.md: every text from the data made inert (:func:`~.base.md_safe`); the
    anchors this function adds are its own HTML."""
    from .base import md_safe

    parts = [md_safe(header_lines(report.run, report.run_notes, plain=False)), ""]
    if len(report.sections) > 1:
        parts.append("Contents: " + " · ".join(f"[{md_safe(s.title)}](#{s.key})" for s in report.sections))
        parts.append("")
    for s in report.sections:
        parts.append(f'<a id="{s.key}"></a>')
        parts.append(f"## {md_safe(s.title)}")
        parts.append("")
        parts.append(md_safe(s.markdown.rstrip()))
        parts.append("")
        for f in s.figures:
            rel = Path(f.path).name
            parts.append(f"![{md_safe(f.caption)}]({rel})")
            parts.append("")
            parts.append(f"_{md_safe(f.caption)}_")
            parts.append("")
        if s.notes:
            parts.append("**Notes**")
            parts.append("")
            parts.extend(f"- {md_safe(n)}" for n in s.notes)
            parts.append("")
    return "\n".join(parts).rstrip() + "\n"


# ----------------------------------------------------------------------------- html
CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #ddd;padding-bottom:.3em}
h2{font-size:1.3em;margin-top:2em;border-bottom:1px solid #eee;padding-bottom:.2em}
.tbl{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;margin:.8em 0;font-size:.82em}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:right}
th{white-space:normal;vertical-align:bottom}
td{white-space:normal}
th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
code{background:#f4f4f4;padding:0 3px;border-radius:3px;font-size:.92em}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
figure{margin:1em 0}
figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.88em;color:#555}
.notes{background:#fff8e1;border-left:4px solid #f0b400;padding:.4em 1em;margin:.8em 0}
.run-notes{background:#eef5ff;border-left:4px solid #4c72b0;padding:.4em 1em}
nav a{margin-right:1em}
"""

_INLINE = [
    (re.compile(r"`([^`]+)`"), r"<code>\1</code>"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"<strong>\1</strong>"),
    (re.compile(r"(?<![\w])_([^_\n]+)_(?![\w])"), r"<em>\1</em>"),
]


def _inline(text: str) -> str:
    """Escape and apply inline code/bold/italic. Code spans are set aside first (their text
    is never formatted) and put back last, so an emphasis may contain a code span."""
    codes: list[str] = []

    def keep(m):
        codes.append(m.group(1))
        return f"\x00{len(codes) - 1}\x00"

    e = html.escape(re.sub(r"`([^`]+)`", keep, text))
    for pat, rep in _INLINE[1:]:
        e = pat.sub(rep, e)
    return re.sub(r"\x00(\d+)\x00", lambda m: f"<code>{html.escape(codes[int(m.group(1))])}</code>", e)


def md_to_html(md: str) -> str:
    """The Markdown subset sections write: headings, paragraphs, lists, pipe tables,
    fenced code, inline code/bold/italic. Links are kept as text (the file stays offline)."""
    lines = md.splitlines()
    out: list[str] = []
    i = 0
    para: list[str] = []

    def flush():
        if para:
            out.append("<p>" + _inline(" ".join(para)) + "</p>")   # an emphasis may span lines
            para.clear()

    while i < len(lines):
        ln = lines[i]
        s = ln.strip()
        if s.startswith("```"):
            flush()
            j = i + 1
            code = []
            while j < len(lines) and not lines[j].strip().startswith("```"):
                code.append(lines[j])
                j += 1
            out.append("<pre>" + html.escape("\n".join(code)) + "</pre>")
            i = j + 1
            continue
        if s.startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(lines[i].strip())
                i += 1
            out.append(_table(rows))
            continue
        if s.startswith(("- ", "* ")):
            flush()
            items = []
            while i < len(lines) and lines[i].strip().startswith(("- ", "* ")):
                items.append(lines[i].strip()[2:])
                i += 1
            out.append("<ul>" + "".join(f"<li>{_inline(t)}</li>" for t in items) + "</ul>")
            continue
        m = re.match(r"^(#{1,6})\s+(.*)$", s)
        if m:
            flush()
            lvl = min(6, len(m.group(1)) + 1)
            out.append(f"<h{lvl}>{_inline(m.group(2))}</h{lvl}>")
            i += 1
            continue
        if not s:
            flush()
        else:
            para.append(s)
        i += 1
    flush()
    return "\n".join(out)


def _cells(row: str) -> list[str]:
    row = row.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    # a cell's own "|" is written "\|" (base.md_table)
    return [c.strip().replace("\x00", "|").replace("\x01", "\\")
            for c in row.replace("\\\\", "\x01").replace("\\|", "\x00").split("|")]


def _table(rows: list[str]) -> str:
    if not rows:
        return ""
    head = _cells(rows[0])
    body = rows[1:]
    if body and re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", body[0]):
        body = body[1:]
    # column names break after their underscores, so a wide table of long names still fits the page
    h = "<tr>" + "".join(f"<th>{_inline(c).replace('_', '_<wbr>')}</th>" for c in head) + "</tr>"
    b = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>" for r in body)
    return f'<div class="tbl"><table><thead>{h}</thead><tbody>{b}</tbody></table></div>'


def _img(path: Path, caption: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    alt = html.escape(caption, quote=True)
    return (f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_inline(caption)}</figcaption></figure>")


def render_html(report: Report) -> str:
    run = report.run
    title = f"moetrace report: run {run['run_id']}"
    shape_md = header_lines(run, [], plain=True).splitlines()[2:]
    parts = [f"<h1>{html.escape(title)}</h1>", "<p>" + "<br>".join(_inline(x) for x in shape_md if x) + "</p>"]
    if report.run_notes:
        parts.append('<div class="run-notes"><strong>Approximations and caveats of this run</strong><ul>'
                     + "".join(f"<li>{_inline(n)}</li>" for n in report.run_notes) + "</ul></div>")
    if len(report.sections) > 1:
        parts.append("<nav>" + "".join(f'<a href="#{html.escape(s.key)}">{html.escape(s.title)}</a>'
                                       for s in report.sections) + "</nav>")
    for s in report.sections:
        parts.append(f'<section id="{html.escape(s.key)}"><h2>{html.escape(s.title)}</h2>')
        parts.append(md_to_html(s.markdown))
        for f in s.figures:
            parts.append(_img(f.path, f.caption))
        if s.notes:
            parts.append('<div class="notes"><strong>Notes</strong><ul>'
                         + "".join(f"<li>{_inline(n)}</li>" for n in s.notes) + "</ul></div>")
        parts.append("</section>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n{body}\n</body></html>\n")

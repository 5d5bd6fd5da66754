"""Generate the two reference pages that must not drift from the code:

- ``docs/reference/cli.md``: every command's and subcommand's ``--help``, under a heading
  ``moetrace NAME``;
- ``docs/reference/views.md``: every stored table and metric view, from ``moetrace tables``.

Run ``python -m moetrace.commands._docgen`` after changing a command, an option, a table or a
view (``--check`` only compares, and exits 1 naming the stale pages); ``tests/test_docs.py``
fails when the committed pages differ from what this writes. Help is rendered at a fixed
width so the pages do not depend on the terminal they were made in.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = Path("docs/reference/cli.md")
VIEWS_PAGE = Path("docs/reference/views.md")
REGENERATE = "python -m moetrace.commands._docgen"
WIDTH = 88          # help text width: wide enough for the option tables, narrow enough to read


def _walk(cmd: click.Command, ctx: click.Context):
    """(context, command) for ``cmd`` and every subcommand under it, in name order."""
    yield ctx, cmd
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            yield from _walk(sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True,
                                                   terminal_width=WIDTH, max_content_width=WIDTH))


def cli_reference() -> str:
    from ..cli import cli

    cli.load_all()
    # make_context applies the group's context_settings (-h as well as --help), as a real run does
    root = cli.make_context("moetrace", [], resilient_parsing=True, terminal_width=WIDTH, max_content_width=WIDTH)
    parts = ["# Command-line reference", "",
             f"Generated from every command's `--help` by `{REGENERATE}`; do not edit by hand.",
             "Each command's help ends with an example; `moetrace COMMAND --help` prints the same text.",
             ""]
    entries = list(_walk(cli, root))
    parts.append("Commands: " + ", ".join(
        f"[{c.command_path}](#{c.command_path.replace(' ', '-')})" for c, _ in entries[1:]) + ".")
    parts.append("")
    for ctx, cmd in entries:
        parts += [f"## {ctx.command_path}", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(parts)


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _md_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no columns)"]
    keys = list(rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return out


def _tables_json(*args: str) -> list[dict]:
    from click.testing import CliRunner

    from ..cli import cli

    res = CliRunner().invoke(cli, ["tables", *args, "--format", "json"])
    if res.exit_code != 0:
        raise RuntimeError(f"moetrace tables {' '.join(args)} failed: {res.output.strip()}")
    return json.loads(res.output)


def _view_rows() -> dict[str, tuple[str, list[dict]]]:
    """{view: (its documentation, its column rows)}: what ``moetrace tables VIEW`` prints,
    built by the same helpers, with every view described over one empty store (one
    ``moetrace tables VIEW`` per view would define all the views each time)."""
    from ..storage.views import view_docs

    try:
        from .store_cmds import _column_meaning, _views_columns
    except ImportError:     # the helpers moved: one `moetrace tables VIEW` per view (slower, same text)
        return {v: (d["doc"], _tables_json(v)) for v, d in view_docs().items()}
    docs = view_docs()
    cols = _views_columns(list(docs))
    return {v: (d["doc"], [{"column": c, "type": ty, "meaning": _column_meaning(v, d["doc"], c)}
                           for c, ty in cols[v]])
            for v, d in docs.items()}


def views_reference() -> str:
    listing = _tables_json()
    views = _view_rows()
    parts = ["# Tables and metric views", "",
             f"Generated from `moetrace tables` by `{REGENERATE}`; do not edit by hand.",
             "Stored tables are the contract in `schemas/`; metric views are the SQL in",
             "`moetrace/storage/sql/`, available in `moetrace sql` and in `catalog.duckdb`.",
             "What the metrics mean and why: [the metrics](../explanation/metrics.md).", ""]
    for kind, title in (("table", "Stored tables"), ("view", "Metric views")):
        names = [r["name"] for r in listing if r.get("kind") == kind]
        parts += [f"## {title}", "", ", ".join(f"[{n}](#{n})" for n in names), ""]
        for r in listing:
            if r.get("kind") != kind:
                continue
            name = r["name"]
            if kind == "view" and name in views:
                doc, rows = views[name]
            else:
                doc, rows = r.get("description"), _tables_json(name)
            parts += [f"### {name}", "", _cell(doc), ""] + _md_table(rows) + [""]
    return "\n".join(parts)


PAGES = {CLI_PAGE: cli_reference, VIEWS_PAGE: views_reference}


def stale_pages(root: Path = ROOT) -> list[Path]:
    """The generated pages whose committed text differs from what the code says now."""
    stale = []
    for rel, make in PAGES.items():
        path = root / rel
        if not path.exists() or path.read_text() != make():
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        stale = stale_pages()
        for rel in stale:
            print(f"{rel} is stale: run {REGENERATE} to regenerate", file=sys.stderr)
        return 1 if stale else 0
    if args:
        print(f"usage: {REGENERATE} [--check]", file=sys.stderr)
        return 2
    for rel, make in PAGES.items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

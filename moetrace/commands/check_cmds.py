"""`moetrace check STORE`: every file of a store that cannot be read, changing nothing."""
from __future__ import annotations

import click

from ._options import store_argument


@click.command()
@store_argument
@click.option("--quick", is_flag=True, help="Read the Parquet footers only (what readers check), not every page.")
def check(store, quick):
    """List every file of STORE that cannot be read: truncated or garbage Parquet, a file
    with the wrong columns for its table or its own run_id column, a partition folder not
    named run_id=<id>, a file where a folder is expected, a run without its runs row, a
    malformed journal; a FIFO, device or symlink where a file or folder belongs, more files
    or partitions than the limits allow, a footer past max_footer_bytes, runs values out of
    range, an unreadable moetrace-store.json (docs/hardening.md). One line per file ("FILE: what is wrong"); nothing is changed,
    nothing is recovered. Exit code 0 when every file reads, 2 otherwise.

    Example:

    \b
        moetrace check demo
        moetrace check demo --quick
    """
    from pathlib import Path

    from ..errors import StoreError
    from ..storage.check import scan
    from ..storage.paths import check_store_path

    check_store_path(Path(store))
    root = Path(store)
    if not root.is_dir():
        raise StoreError(f"{store}: no such store" if not root.exists() else f"{store}: not a folder")
    problems = scan(root, deep=not quick)
    for p in problems:
        click.echo(str(p))
    if problems:
        click.echo(f"moetrace: error: {store}: {len(problems)} problem(s)", err=True)
        raise SystemExit(2)
    click.echo(f"{store}: every file reads", err=True)


def register(cli):
    cli.add_command(check)

"""Errors moetrace reports to users.

`InputError` is the one exception for bad input: it names the file and, where known, the
position (row, column, event index, byte offset). The CLI turns it into a one-line message
on stderr and exit code 2; the store is never touched when it is raised.
"""
from __future__ import annotations

from pathlib import Path


class MoetraceError(Exception):
    """Base class of errors moetrace reports without a traceback."""

    exit_code = 1


class InputError(MoetraceError):
    """A source file (or a table being written) is malformed."""

    exit_code = 2

    def __init__(self, file: str | Path | None, message: str, position: str | None = None):
        self.file = str(file) if file is not None else None
        self.message = message
        self.position = position
        # no file: the message names what it is about (a run, a plan, an option); the CLI
        # puts the store and run it was asked about in front (cli.MoetraceGroup.invoke)
        where = self.file or ""
        if position:
            where = f"{where} ({position})" if where else position
        super().__init__(f"{where}: {message}" if where else message)


class SchemaError(InputError):
    """A table does not match its contract in schemas/."""

    def __init__(self, table: str, message: str, column: str | None = None, file: str | None = None):
        self.table = table
        self.column = column
        loc = f"table {table!r}" + (f", column {column!r}" if column else "")
        super().__init__(file, f"{loc}: {message}")


class StoreError(MoetraceError):
    """The store cannot be read or written (permissions, locked, missing)."""

    exit_code = 2


class UsageError(MoetraceError):
    """An option or environment value is invalid (a size that is not a size, a count out
    of range): one line, exit code 2, nothing written."""

    exit_code = 2


class MissingExtra(UsageError):
    """An optional dependency is not installed: one line naming the extra and the pip
    command that installs it, exit code 2."""

    def __init__(self, what: str, extra: str, module: str, hint: str = ""):
        self.extra, self.module = extra, module
        super().__init__(f"{what} needs the {extra!r} extra ({module} is not installed): "
                         f"pip install 'moetrace[{extra}]'" + (f" {hint}" if hint else ""))


def require_extra(what: str, extra: str, *modules: str, hint: str = ""):
    """Import ``modules`` (first one returned) or raise :class:`MissingExtra` for the first
    that is missing: the one place an extra's install line is written."""
    import importlib

    got = []
    for m in modules:
        try:
            got.append(importlib.import_module(m))
        except ImportError:
            raise MissingExtra(what, extra, m, hint) from None
    return got[0] if got else None

"""Errors moetrace reports to users.

`InputError` is the one exception for bad input: it names the file and, where known, the
position (row, column, event index, byte offset). The CLI turns it into a one-line message
on stderr and exit code 2; the store is never touched when it is raised.

:func:`shown` is the one way text from outside (a file name, a value) reaches a message:
control characters, escape sequences and line breaks are written escaped (``\\x1b``,
``\\n``), so a name can neither split a message into two lines nor drive a terminal
(set its title, clear its screen). :func:`one_line` applies it to a whole message.
"""
from __future__ import annotations

import unicodedata
from pathlib import Path


def _escape(ch: str) -> str:
    o = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


#: Unicode categories written escaped: controls (C0, DEL, C1: ESC, BEL, CSI), format
#: characters (bidirectional overrides that reorder what a terminal shows), line and
#: paragraph separators, surrogates (undecodable bytes of a name) and unassigned ones
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def shown(text) -> str:
    """``text`` (a name, a path, a value) as it may appear in a message or on a terminal:
    every control or invisible character escaped; printable text, non-ASCII letters
    included, unchanged."""
    s = str(text)
    if s.isprintable() and s.isascii():
        return s
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN else c for c in s)


def one_line(text) -> str:
    """A whole message as one printable line (:func:`shown`)."""
    return shown(str(text).rstrip("\n"))


class TerminalGuard:
    """A text stream that writes to a terminal: every control character but line ends
    and tabs is written escaped (:func:`shown`), whatever printed it (a file name in a
    table, a note, a run's source), so nothing read from a file can set the window's
    title or clear the screen. Installed by the CLI on a stdout/stderr that is a tty;
    output to a pipe or a file stays byte for byte."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if not (text.isascii() and text.isprintable()):
            text = "\n".join("\t".join(shown(part) for part in line.split("\t")) for line in text.split("\n"))
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    @staticmethod
    def install() -> None:
        import sys

        for name in ("stdout", "stderr"):
            s = getattr(sys, name)
            try:
                tty = s is not None and not isinstance(s, TerminalGuard) and s.isatty()
            except (AttributeError, ValueError, OSError):
                tty = False
            if tty:
                setattr(sys, name, TerminalGuard(s))


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
        where = shown(self.file) if self.file is not None else ""
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

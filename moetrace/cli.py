"""The moetrace command line. Each command is a thin caller of the library (the
:class:`moetrace.run.Run` facade, the store, the collectors).

Commands live in ``moetrace/commands/*.py``; each module exposes ``register(cli)``. The
group finds the commands by reading those files (``ast``: names and docstrings) and
imports a module only when one of its commands runs, so ``moetrace --help`` and
``moetrace runs`` do not pay for numpy, matplotlib or the replay engine.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from pathlib import Path

import click

from .errors import MoetraceError, one_line
from .output import OUT_PATH_CHECKS
from .storage.paths import refuse_inside_store
from .version import __version__

if refuse_inside_store not in OUT_PATH_CHECKS:  # -o/--out never inside a store (a write there would corrupt it)
    OUT_PATH_CHECKS.append(refuse_inside_store)

COMMANDS_DIR = Path(__file__).resolve().parent / "commands"


def _command_name(func: ast.FunctionDef, call: ast.Call) -> str:
    """The name click gives a ``@click.command(...)``-decorated function."""
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    for kw in call.keywords:
        if kw.arg == "name" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    name = func.name.lower().replace("_", "-")
    left, sep, suffix = name.rpartition("-")
    return left if sep and suffix in {"command", "cmd", "group", "grp"} else name


def scan_commands(folder: Path = COMMANDS_DIR) -> dict[str, tuple[str, str]]:
    """{command name: (module name, help text)} of every ``@click.command`` /
    ``@click.group`` function in the command modules, read without importing them."""
    index: dict[str, tuple[str, str]] = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if not isinstance(dec, ast.Call):
                    continue
                fn = dec.func
                attr = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if attr not in ("command", "group"):
                    continue
                text = ast.get_docstring(node) or ""
                for kw in dec.keywords:
                    if kw.arg in ("help", "short_help") and isinstance(kw.value, ast.Constant):
                        text = kw.value.value
                index[_command_name(node, dec)] = (path.stem, text)
    return index


def _where(ctx, e: MoetraceError) -> str:
    """"store st, run r: " in front of an input error that names no file: the store and run
    the command was asked about (kept by the STORE and --run callbacks)."""
    from .errors import InputError

    if not isinstance(e, InputError) or e.file is not None:
        return ""
    store, run = ctx.meta.get("moetrace.store"), ctx.meta.get("moetrace.run")
    text = str(e)
    parts = [f"store {store}" if store and f"store {store}" not in text else None,
             f"run {run}" if run and f"run {run}" not in text and f"run {run!r}" not in text else None]
    parts = [p for p in parts if p]
    return ", ".join(parts) + ": " if parts else ""


def _error_text(e: MoetraceError) -> str:
    """The error as printed: one line, except a SQL error pointing into the query, whose
    "LINE n: ..." and caret lines stay under it as DuckDB aligned them (each line escaped)."""
    text = str(e)
    if text.startswith("SQL error") and "\nLINE " in text:
        return "\n".join(one_line(x) for x in text.split("\n"))
    return one_line(e)


class MoetraceGroup(click.Group):
    """Loads command modules on demand and turns MoetraceError into a one-line message
    and its exit code (2 for bad input)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._index: dict[str, tuple[str, str]] | None = None
        self._loaded: set[str] = set()

    @property
    def index(self) -> dict[str, tuple[str, str]]:
        if self._index is None:
            self._index = scan_commands()
        return self._index

    def _load_module(self, module: str) -> None:
        if module not in self._loaded:
            self._loaded.add(module)
            before = set(self.commands)
            importlib.import_module(f"{__package__}.commands.{module}").register(self)
            from .commands._options import apply_ranges  # every numeric option's declared range

            for name in set(self.commands) - before:
                apply_ranges(self.commands[name])

    def load_all(self) -> dict[str, click.Command]:
        """Import every command module (what a test walking ``cli.commands`` needs)."""
        for path in sorted(COMMANDS_DIR.glob("*.py")):
            if not path.name.startswith("_"):
                self._load_module(path.stem)
        return self.commands

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MoetraceError as e:
            click.echo(f"moetrace: error: {_where(ctx, e)}{_error_text(e)}", err=True)
            ctx.exit(e.exit_code)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
            raise
        except RecursionError:
            if ctx.params.get("debug") or os.environ.get("MOETRACE_DEBUG"):
                raise
            click.echo("moetrace: error: input nested too deeply to process (rerun with --debug for the traceback)",
                       err=True)
            ctx.exit(2)
        except Exception as e:  # an internal error: one line and exit 1; --debug shows the traceback
            if ctx.params.get("debug") or os.environ.get("MOETRACE_DEBUG"):
                raise
            text = one_line(" ".join(str(e).split())[:300])
            click.echo(f"moetrace: internal error: {type(e).__name__}: {text} (rerun with --debug for the "
                       "traceback)", err=True)
            ctx.exit(1)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main, with a usage error (a value out of its declared range, a missing
        argument) as one line, exit code 2, like every other refusal."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else (prog_name or "moetrace")
            text = one_line(" ".join(e.format_message().split()))
            click.echo(f"moetrace: error: {where}: {text} (see '{where} --help')", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.ClickException as e:
            click.echo(f"moetrace: error: {one_line(' '.join(e.format_message().split()))}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as e:   # a closed pipe (moetrace sql ... | head)
            if getattr(e, "errno", None) == 32:
                sys.exit(1)
            raise
        sys.exit(rv if isinstance(rv, int) else 0)

    def list_commands(self, ctx):
        return sorted(set(self.commands) | set(self.index))

    def _guess_module(self, name: str) -> str | None:
        """The command module that most likely defines ``name``, found in the files' text
        without parsing them (the index parses every file: a command's start-up): one that
        names it in ``@click.command("name")`` or defines ``def name(`` under such a
        decorator. Only a guess: :meth:`get_command` checks that the import registered it."""
        import re

        named = re.compile(r"@click\.(?:command|group)\(\s*(?:name\s*=\s*)?[\"']" + re.escape(name) + r"[\"']")
        funcs = {name.replace("-", "_") + sfx for sfx in ("", "_command", "_cmd", "_group", "_grp")}
        for path in sorted(COMMANDS_DIR.glob("*.py")):
            if path.name.startswith("_"):
                continue
            decorated = False   # inside the decorators of a @click.command / @click.group
            for line in path.read_text().splitlines():
                if line.startswith(("@click.command(", "@click.group(")):
                    if named.match(line):
                        return path.stem
                    decorated = True
                elif line.startswith("def "):
                    if decorated and line[4:].split("(", 1)[0].strip() in funcs:
                        return path.stem
                    decorated = False
                elif line and not line[0].isspace() and not line.startswith(("@", ")")):
                    decorated = False
        return None

    def get_command(self, ctx, name):
        if name not in self.commands and self._index is None:
            guess = self._guess_module(name)
            if guess is not None:
                self._load_module(guess)
        if name not in self.commands:
            hit = self.index.get(name)
            if hit is not None:
                self._load_module(hit[0])
            if name not in self.commands:   # registered under another name: look everywhere
                self.load_all()
        return self.commands.get(name)

    def format_commands(self, ctx, formatter):
        """The command list from the index: no module is imported to print it."""
        rows = []
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        for name in names:
            if name in self.commands:
                cmd = self.commands[name]
                if cmd.hidden:
                    continue
                rows.append((name, cmd.get_short_help_str(limit)))
            else:
                stub = click.Command(name, help=inspect.cleandoc(self.index[name][1]))
                rows.append((name, stub.get_short_help_str(limit)))
        by_name = dict(rows)
        placed = set()
        for title, members in SECTIONS:
            got = [(n, by_name[n]) for n in members if n in by_name]
            placed.update(n for n, _ in got)
            if got:
                with formatter.section(title):
                    formatter.write_dl(got)
        rest = [r for r in rows if r[0] not in placed]   # a new command nobody filed yet: still listed
        if rest:
            with formatter.section("Other commands"):
                formatter.write_dl(rest)

    def format_epilog(self, ctx, formatter):
        """The top-level help ends, as every command's does, with an example."""
        formatter.write_paragraph()
        formatter.write_text("Example:")
        for line in EXAMPLE:   # as written, never re-wrapped (a command must stay pasteable)
            formatter.write(f"{'':>{formatter.current_indent + 2}}{line}\n")
        formatter.write_paragraph()
        formatter.write_text("moetrace COMMAND --help shows a command's options and its own example.")


#: the top-level help in sections, in the order of the work: get data in, look at it, ask
#: what another placement would do, write it up; the rest are tools
SECTIONS = (
    ("Ingest and the store", ("ingest", "runs", "tables", "catalog", "check")),
    ("Analysis", ("skew", "tokens", "sql", "kernels", "exposure", "waits", "hang")),
    ("Replay and planning", ("replay", "sweep", "plan", "whatif", "calibrate", "cost")),
    ("Reports", ("report", "materialize")),
    ("Tools: make data", ("synth", "capture", "refrun")),
)
EXAMPLE = (
    "moetrace ingest st loads.csv --ranks 32 --top-k 8   # your expert loads, with the shape",
    "moetrace skew st                                    # which layers, which rank",
    "moetrace replay st --policy eplb --replicas 32      # EPLB with 32 redundant slots",
    "moetrace report st --out-dir rep                    # report.html, report.md, PNGs",
)


@click.group(cls=MoetraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moetrace")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error (or set MOETRACE_DEBUG=1).")
def cli(debug):
    """moetrace: trace-driven profiling and placement replay for MoE serving.

    Collect engine dumps, logs and profiler traces into a Parquet store, query it with
    SQL, report skew and all-to-all exposure, and replay the recorded routing against
    other expert placements.
    """


def main(argv=None):
    from .errors import TerminalGuard

    TerminalGuard.install()   # escapes from file names never reach a terminal raw
    return cli.main(args=argv, prog_name="moetrace")


if __name__ == "__main__":
    sys.exit(main())

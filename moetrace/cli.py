"""The moetrace command line. Each command is a thin wrapper over a library call.

Commands live in ``moetrace/commands/*.py``; each module exposes ``register(cli)``.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import click

from . import __version__
from .errors import MoetraceError


class MoetraceGroup(click.Group):
    """Turns MoetraceError into a one-line message and its exit code (2 for bad input)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MoetraceError as e:
            click.echo(f"moetrace: error: {e}", err=True)
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
            text = " ".join(str(e).split())[:300]
            click.echo(f"moetrace: internal error: {type(e).__name__}: {text} (rerun with --debug for the "
                       "traceback)", err=True)
            ctx.exit(1)

    def list_commands(self, ctx):
        return sorted(self.commands)


@click.group(cls=MoetraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moetrace")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error (or set MOETRACE_DEBUG=1).")
def cli(debug):
    """moetrace: trace-driven profiling and placement replay for MoE serving.

    Collect engine dumps, logs and profiler traces into a Parquet store, query it with
    SQL, report skew and all-to-all exposure, and replay the recorded routing against
    other expert placements.
    """


def _load_commands() -> None:
    from . import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{mod.name}").register(cli)


_load_commands()


def main(argv=None):
    return cli.main(args=argv, prog_name="moetrace")


if __name__ == "__main__":
    sys.exit(main())

"""The moetrace command line. Each command is a thin wrapper over a library call.

Commands live in ``moetrace/commands/*.py``; each module exposes ``register(cli)``.
"""
from __future__ import annotations

import importlib
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

    def list_commands(self, ctx):
        return sorted(self.commands)


@click.group(cls=MoetraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moetrace")
def cli():
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

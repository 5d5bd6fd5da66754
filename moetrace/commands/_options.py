"""Option bundles shared by several commands: one definition per repeated option.

Each is a plain decorator (sqlite-utils style). Choices that live in the library (cost
model presets, replica splits, planners) are read from it lazily, when a command runs or
prints its help, so that ``moetrace --help`` imports no numeric module.
"""
from __future__ import annotations

import click

from ..output import check_out_path


class LazyChoice(click.Choice):
    """A click.Choice whose choices come from ``load()`` the first time they are needed."""

    def __init__(self, load, case_sensitive: bool = True):
        self._load = load
        self._choices = None
        super().__init__((), case_sensitive=case_sensitive)

    @property
    def choices(self):
        if self._choices is None:
            self._choices = tuple(self._load())
        return self._choices

    @choices.setter
    def choices(self, value):   # click.Choice.__init__ assigns the (empty) placeholder
        pass


def _hardware_presets():
    from ..replay.cost import PRESETS

    return list(PRESETS)


def _splits():
    from ..replay.engine import SPLITS

    return list(SPLITS)


def _planners():
    from ..placement.planners import PLANNERS

    return list(PLANNERS)


def steps_range(ctx, param, value):
    """click callback: 'A:B' -> (A, B), the steps A <= step < B (:mod:`moetrace.domain.windows`)."""
    if value is None:
        return None
    from ..domain.windows import parse_step_range

    try:
        return parse_step_range(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def steps_list(ctx, param, value):
    """click callback: 'A:B' (steps A <= step < B) or a comma list 'A,B,C' -> list of steps."""
    if value in (None, ""):
        return None
    if ":" in value:
        lo, hi = steps_range(ctx, param, value)
        return list(range(lo, hi))
    return int_list(ctx, param, value)


def int_list(ctx, param, value):
    """click callback: a comma-separated list of integers."""
    if value in (None, ""):
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


def store_argument(f):
    """The STORE positional argument every store command takes first."""
    return click.argument("store", type=click.Path(file_okay=False))(f)


def run_option(f=None, *, help="Run id (default: the store's only run)."):
    """--run RUN_ID."""
    def deco(g):
        return click.option("--run", "run_id", default=None, metavar="RUN_ID", help=help)(g)
    return deco(f) if f is not None else deco


def hardware_option(f=None, *, help="Cost model preset (fitted from spans when the run has them)."):
    """--hardware, a choice of the cost model's presets (H100, H200, ...)."""
    def deco(g):
        return click.option("--hardware", type=LazyChoice(_hardware_presets, case_sensitive=False), default="H200",
                            show_default=True, callback=lambda ctx, p, v: v.upper() if v else v, help=help)(g)
    return deco(f) if f is not None else deco


def split_option(f):
    """--split: how an expert's tokens split over its replicas (replay.engine.SPLITS)."""
    return click.option("--split", type=LazyChoice(_splits), default="even", show_default=True,
                        help="How an expert's tokens split over its replicas.")(f)


def policy_option(f=None, *, default=None, help="Planner."):
    """--policy, a choice of the planner registry."""
    def deco(g):
        return click.option("--policy", type=LazyChoice(_planners), default=default, show_default=default is not None,
                            help=help)(g)
    return deco(f) if f is not None else deco


def steps_option(*names, help: str, dest: str | None = None):
    """A step window option in the one A:B syntax (steps A <= step < B)."""
    decls = list(names) + ([dest] if dest else [])
    return click.option(*decls, callback=steps_range, default=None, metavar="A:B", help=help)


def out_option(f=None, *, dir_okay=False, help="Write to FILE."):
    """-o/--out: where a command writes its file (or folder, with dir_okay)."""
    def deco(g):
        kind = click.Path(file_okay=not dir_okay, dir_okay=dir_okay)
        return click.option("-o", "--out", "out", type=kind, default=None, callback=check_out_path, help=help)(g)
    return deco(f) if f is not None else deco


def kv_options(known=None):
    """click callback factory for repeatable KEY=VALUE options (values parsed as JSON
    when they parse, else kept as text). ``known()`` gives the accepted keys (with their
    meaning); an unknown key is refused with the list (exit code 2)."""
    import json

    def cb(ctx, param, values):
        out = {}
        for v in values:
            if "=" not in v:
                raise click.BadParameter(f"{v!r} is not KEY=VALUE")
            k, val = v.split("=", 1)
            if known is not None:
                keys = known()
                if k not in keys:
                    raise click.BadParameter(f"unknown key {k!r}; known keys: {', '.join(keys)}")
            try:
                out[k] = json.loads(val)
            except ValueError:
                out[k] = val
        return out

    return cb


def engine_options(f):
    """``--engine duckdb|spark`` with ``--master`` / ``--remote`` for Spark: the metric views
    on a local Spark session (default ``local[*]``), a cluster (``spark://host:7077``,
    ``yarn``, ``k8s://...``) or Spark Connect (``sc://host:15002``; also ``SPARK_REMOTE``).
    The store path must be readable by the Spark executors (a shared file system)."""
    f = click.option("--remote", metavar="sc://HOST:PORT", default=None,
                     help="Spark Connect server (default: $SPARK_REMOTE); with --engine spark.")(f)
    f = click.option("--master", metavar="URL", default=None,
                     help="Spark master (default: $MASTER or local[*]); with --engine spark.")(f)
    f = click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True,
                     help="Where the metric SQL runs: DuckDB in this process, or Spark (pip install "
                          "'moetrace[spark]' and a Java runtime).")(f)
    return f


def engine_sql(store, engine: str, master: str | None, remote: str | None):
    """A context giving the ``sql(query, params)`` that ``--engine`` chose: None for DuckDB
    (the Run facade's default), else a :class:`moetrace.storage.spark.SparkSQL` over ``store``
    (its session stopped on exit)."""
    from contextlib import contextmanager

    @contextmanager
    def ctx():
        if engine != "spark":
            yield None
            return
        from ..storage.spark import SparkSQL

        with SparkSQL(store.path, master=master, remote=remote) as sp:
            yield sp.sql

    return ctx()

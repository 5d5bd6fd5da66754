"""Option bundles shared by several commands: one definition per repeated option.

Each is a plain decorator (sqlite-utils style). Choices that live in the library (cost
model presets, replica splits, planners) are read from it lazily, when a command runs or
prints its help, so that ``moetrace --help`` imports no numeric module.
"""
from __future__ import annotations

import click

from ..output import check_out_path
from ..safety import SHAPE_MAX


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
    from ..costmodel.step_cost import PRESETS

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


def _said(key: str):
    """click callback: keep the value in ``ctx.meta`` (shared by every context of one
    command line), so that an error without a file can name the store and run it was
    about (:meth:`moetrace.cli.MoetraceGroup.invoke`)."""
    def cb(ctx, param, value):
        if value is not None:
            ctx.meta[f"moetrace.{key}"] = value
        return value
    return cb


def store_argument(f):
    """The STORE positional argument every store command takes first."""
    return click.argument("store", type=click.Path(file_okay=False), callback=_said("store"))(f)


#: what --run means in every command: one run of the store, by id; left out, the store's
#: only run (a command that can show every run, ``skew``, shows them all when it is left out)
RUN_HELP = "Run id (default: the store's only run)."


def run_option(f=None, *, help=RUN_HELP):
    """--run RUN_ID: one run of the store, in every command."""
    def deco(g):
        return click.option("--run", "run_id", default=None, metavar="RUN_ID", callback=_said("run"), help=help)(g)
    return deco(f) if f is not None else deco


def hardware_option(f=None, *, help="Cost model preset (fitted from spans when the run has them).",
                    required: bool = False):
    """--hardware, one choice list in every command (``cost``, ``replay``, ``sweep``, ...):
    the cost model's presets (H100, H200, ...), any case; default H200 unless ``required``."""
    def deco(g):
        return click.option("--hardware", type=LazyChoice(_hardware_presets, case_sensitive=False),
                            default=None if required else "H200", required=required, show_default=not required,
                            callback=lambda ctx, p, v: v.upper() if v else v, help=help)(g)
    return deco(f) if f is not None else deco


#: the --kernel names (moetrace.costmodel.a2a.FAMILIES, listed here so --help needs no import of numpy)
KERNEL_NAMES = ("normal", "low-latency", "deepep-v2", "hybrid-ep", "pplx", "nccl", "nvlink-one-sided", "uccl-normal",
                "uccl-low-latency", "mori", "mori-low-latency")


def _int_text(lo: int):
    """click callback: an integer >= ``lo`` given as text (one-line UsageError otherwise)."""
    def cb(ctx, param, value):
        from ..errors import UsageError

        if value is None:
            return None
        what = "positive" if lo > 0 else "non-negative"
        try:
            v = int(str(value).strip())
        except ValueError:
            raise UsageError(f"{param.opts[0]} must be a {what} integer, got {value!r}") from None
        if v < lo:
            raise UsageError(f"{param.opts[0]} must be a {what} integer, got {value!r}")
        return v
    return cb


def kernel_options(f=None, *, kernel_help="default normal"):
    """--kernel (the all-to-all family), --sms (the SMs it runs on) and --max-nodes-per-token
    (node-limited routing): the inputs of the all-to-all model, for ``cost`` and the replays."""
    def deco(g):
        for o in reversed((
                click.option("--kernel", default=None, type=click.Choice(list(KERNEL_NAMES)),
                             help=f"All-to-all kernel family ({kernel_help}): normal / low-latency (DeepEP V1), "
                                  "deepep-v2, hybrid-ep, pplx, nccl, nvlink-one-sided, uccl-normal, uccl-low-latency, "
                                  "mori, mori-low-latency."),
                click.option("--sms", default=None, callback=_int_text(1), metavar="N",
                             help="SMs the all-to-all kernel runs on (default: the kernel's; DeepEP V1 24)."),
                click.option("--max-nodes-per-token", default=None, callback=_int_text(0), metavar="N",
                             help="Most nodes one token's experts may span (node-limited routing; default the "
                                  "kernel's: 4 for DeepEP normal as DeepSeek-V3 routes, else no limit; 0: no "
                                  "limit)."))):
            g = o(g)
        return g
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




def out_dir_option(f=None, *, help="Folder to write into."):
    """--out-dir DIR: the folder a command writes its files into (``-o/--out`` is a rows
    file everywhere)."""
    def deco(g):
        return click.option("--out-dir", "out", metavar="DIR",
                            type=click.Path(file_okay=False, dir_okay=True), default=None, callback=check_out_path, help=help)(g)
    return deco(f) if f is not None else deco


def one_int(ctx, param, value):
    """click callback: the comma-list parser (:func:`int_list`) held to one value, for a
    command that replays one configuration (``moetrace sweep`` takes several)."""
    v = int_list(ctx, param, value)
    if v is None:
        return None
    if len(v) != 1:
        raise click.BadParameter(f"{value!r}: {ctx.command.name} takes one value here; moetrace sweep compares "
                                 "several")
    return v[0]


def ints_option(name: str, dest: str, *, one: bool = False, help: str, default=None, show_default: bool = False):
    """``--replicas`` / ``--replan-every`` / ``--window``: integers in the one comma-list
    syntax in every command; ``one``: exactly one of them (replay, plan)."""
    return click.option(name, dest, callback=one_int if one else int_list, default=default,
                        show_default=show_default, metavar="N" if one else "N[,N...]", help=help)


def steps_select(ctx, param, value):
    """click callback: a set of steps as ``A:B`` (A <= step < B), a comma list, or ``even``
    / ``odd`` -> ``("parity", 0 | 1)`` or a sorted list of steps."""
    if value in (None, ""):
        return None
    if value in ("even", "odd"):
        return ("parity", 0 if value == "even" else 1)
    return sorted(steps_list(ctx, param, value))


def fit_steps_option(help: str):
    """--fit-steps A:B: the steps a plan is fitted on."""
    return click.option("--fit-steps", "fit_window", callback=steps_range, default=None,
                        metavar="A:B", help=help)


def chrome_trace_option(help: str):
    """--chrome-trace FILE: a Chrome/Perfetto trace, under one name in every command."""
    return click.option("--chrome-trace", "chrome_trace", type=click.Path(dir_okay=False), callback=check_out_path,
                        default=None, metavar="FILE", help=help)


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


def rows_written(rows: dict, run: dict | None = None) -> str:
    """"expert_load 51200 rows, steps 1600 rows, ...": the rows a write added, as the views show
    them: dense expert_counts rows (one list of E counts per (step, layer)) counted as the
    expert_load rows they hold, so the line matches ``moetrace runs`` and a query of
    expert_load. One line for ingest, synth, refrun and capture."""
    rows = dict(rows)
    E = (run or {}).get("num_experts")
    if "expert_counts" in rows and E:
        dense = rows.pop("expert_counts")
        rows = {"expert_load": rows.pop("expert_load", 0) + dense * int(E), **rows}
    return ", ".join(f"{t} {n} rows" for t, n in rows.items())


# ----------------------------------------------------------------------------- numeric ranges
class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses NaN and ±inf (``nan`` and ``inf`` parse as floats)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        import math

        v = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(v, param, ctx)


def finite_float(min: float | None = None, max: float | None = None, *, min_open: bool = False,
                 max_open: bool = False) -> FiniteFloat:
    """The click type of every float option: finite, within [min, max]."""
    return FiniteFloat(min, max, min_open=min_open, max_open=max_open)


def count(lo: int, hi: int) -> click.IntRange:
    """The click type of an integer option: within lo..hi."""
    return click.IntRange(lo, hi)


SHAPE = SHAPE_MAX      # ranks, layers, experts, slots, groups: the one shape bound (docs/hardening.md)
BIG = 2**40            # steps, moves, intervals: far past any run, far from int64 overflow
SEED = 2**63 - 1

#: the declared range of every numeric option, by option name (``(command, option)`` first).
#: ``apply_ranges`` installs them when a command module registers; tests/test_cli_ranges.py
#: fails on a numeric option missing here. Ranges are what the quantity can be, not a policy:
#: resource limits (memory, cells) are checked where the size is known (docs/hardening.md).
RANGES = {
    "--layers": count(1, SHAPE), "--experts": count(1, SHAPE), "--top-k": count(1, SHAPE),
    "--ranks": count(1, SHAPE), "--ranks-per-node": count(1, SHAPE), "--groups": count(1, SHAPE),
    "--nodes": count(1, SHAPE), "--gpus": count(1, SHAPE), "--dp-size": count(1, SHAPE),
    "--replicas": count(0, SHAPE),
    "--steps": count(1, BIG), "--tokens-per-step": count(1, BIG), "--batch-steps": count(1, BIG),
    "--seed": count(0, SEED), "--sigma": finite_float(0, 100), "--drift": finite_float(0, 1),
    "--dummy-share": finite_float(0, 1, max_open=True),
    "--step-offset": count(-BIG, BIG), "--top": count(0, 10**6),
    "--max-moves": count(0, BIG), "--target-imbalance": finite_float(1, 10**6),
    "--replan-every": count(1, BIG), "--window": count(1, BIG), "--passes": count(1, BIG),
    "--stall-ms": finite_float(0, 10**9), "--move-overlap": finite_float(0, 1),
    "--workers": count(1, 1024), "--timeout": finite_float(0.001, 10**7),
    # refrun / capture: a real model run on this machine
    ("refrun", "--steps"): count(1, 10**4), "--hidden": count(1, 2**16), "--ffn": count(1, 2**16),
    "--tokens-per-rank": count(1, 2**20), "--prefill-tokens": count(0, 2**20), "--skew": finite_float(0, 100),
    "--delay-rank": count(-1, SHAPE), "--delay-us": finite_float(0, 10**9), "--delay-every": count(1, 10**6),
    "--micro-batches": count(1, 2), "--repeats": count(1, 10**4), "--warmup": count(0, 10**4),
    "--threads-per-rank": count(1, 1024), "--max-new-tokens": count(0, 10**5), "--batch-size": count(1, 10**5),
    ("refrun", "--ranks"): count(1, 1024), ("refrun", "--experts"): count(1, 2**16),
    ("refrun", "--layers"): count(1, 1024),
    # whatif: times in µs / ns per token, tokens per batch
    "--split-extra-us": finite_float(0, 10**9), "--a2a-latency-us": finite_float(0, 10**9),
    "--tokens": finite_float(0, 2.0**40, min_open=True), "--attn-ns": finite_float(0, 10**9),
    "--expert-ns": finite_float(0, 10**9), "--transfer-ns": finite_float(0, 10**9),
    "--fixed-attn-ns": finite_float(0, 10**12), "--fixed-expert-ns": finite_float(0, 10**12),
    "--max-micro-batches": count(1, 1024),
}


def is_numeric(param) -> bool:
    return (isinstance(param, click.Option) and not param.is_flag
            and isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)))


def int_list_in(lo: int, hi: int, most: int = 10_000):
    """click callback: a comma-separated list of integers, each within lo..hi, at most
    ``most`` of them."""
    def cb(ctx, param, value):
        xs = int_list(ctx, param, value)
        if xs is None:
            return None
        if len(xs) > most:
            raise click.BadParameter(f"{len(xs)} values; at most {most}")
        bad = [x for x in xs if not lo <= x <= hi]
        if bad:
            raise click.BadParameter(f"{bad[0]} is not in the range {lo}<=x<={hi}")
        return xs

    cb.declared_range = (lo, hi)
    cb.int_list = True          # the one comma-list parser, with a range (tests/test_cli_convention.py)
    return cb


#: declared ranges of the comma-list options (``--replicas 0,16,32``), by option name
def one_int_in(lo: int, hi: int):
    """click callback: :func:`one_int` (exactly one value of the comma-list syntax), within lo..hi."""
    inner = int_list_in(lo, hi)

    def cb(ctx, param, value):
        v = one_int(ctx, param, value)
        if v is not None:
            inner(ctx, param, str(v))
        return v

    cb.declared_range = (lo, hi)
    cb.int_list = True
    return cb


LIST_RANGES = {"--replicas": (0, SHAPE), "--replan-every": (1, BIG), "--window": (1, BIG), "--hot": (0, SHAPE - 1)}


def apply_ranges(cmd: click.Command) -> None:
    """Give each numeric option of ``cmd`` its declared range (:data:`RANGES`), and each
    comma list of integers its range (:data:`LIST_RANGES`)."""
    for p in cmd.params:
        if isinstance(p, click.Option) and p.callback in (int_list, one_int):
            name = max(p.opts, key=len)
            if name in LIST_RANGES:
                p.callback = (one_int_in if p.callback is one_int else int_list_in)(*LIST_RANGES[name])
        if is_numeric(p):
            name = max(p.opts, key=len)
            t = RANGES.get((cmd.name, name)) or RANGES.get(name)
            if t is not None:
                p.type = t

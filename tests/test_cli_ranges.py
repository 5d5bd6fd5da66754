"""Every numeric option of every command has a declared range (commands/_options.py
RANGES), and 0, -1, NaN, inf and 10^12 on each end in exit 0 or exit 2 with one line and
no traceback, never an internal error.

The command tree is walked, so a new numeric option without a range fails here."""
from __future__ import annotations

import math

import click
import pytest

from moetrace.commands._options import FiniteFloat

VALUES = ["0", "-1", "nan", "inf", "1000000000000"]
HEAVY = {"refrun", "capture"}   # a real model run: parsed only (make_context), never run here


def _numeric_options():
    from moetrace.cli import cli

    cli.load_all()
    out = []
    for name, cmd in sorted(cli.commands.items()):
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.is_flag and isinstance(
                    p.type, (click.types.IntParamType, click.types.FloatParamType)):
                out.append((name, max(p.opts, key=len), p))
    return out


OPTIONS = _numeric_options()


def test_the_walk_finds_the_options():
    names = {(c, o) for c, o, _ in OPTIONS}
    assert ("replay", "--groups") in names and ("synth", "--steps") in names and ("sql", "--timeout") in names
    assert len(OPTIONS) >= 70


@pytest.mark.parametrize("cmd, opt, param", OPTIONS, ids=[f"{c}{o}" for c, o, _ in OPTIONS])
def test_every_numeric_option_declares_a_finite_range(cmd, opt, param):
    t = param.type
    assert isinstance(t, (click.IntRange, click.FloatRange)), f"{cmd} {opt}: {t!r} has no declared range"
    assert t.min is not None and t.max is not None, f"{cmd} {opt}: {t!r} is open-ended"
    if isinstance(t, click.FloatRange):
        assert isinstance(t, FiniteFloat), f"{cmd} {opt}: a float option must refuse nan/inf (finite_float)"
        assert math.isfinite(t.min) and math.isfinite(t.max)


def _base(cmd: str, store: str, tmp_path) -> list[str]:
    if cmd == "ingest":
        return [str(tmp_path / "missing.csv"), "--store", store]
    if cmd == "sql":
        return [store, "SELECT 1"]
    if cmd == "tables":
        return []
    if cmd == "synth":
        return [str(tmp_path / "syn"), "--steps", "2", "--layers", "1", "--experts", "4", "--ranks", "2",
                "--ranks-per-node", "2", "--top-k", "2"]
    if cmd in ("replay", "plan", "sweep"):
        return [store, "--policy", "eplb-global"]
    if cmd == "calibrate":
        return [store, "--run", "x"]
    return [store]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("cmd, opt, param", OPTIONS, ids=[f"{c}{o}" for c, o, _ in OPTIONS])
def test_hostile_values_end_in_one_line(cmd, opt, param, value, runner, cli, tmp_path):
    """Against a missing store: a value out of range is refused at parsing (one line, exit 2);
    one in range reaches the command, which refuses the store (one line, exit 2) or runs."""
    if cmd in HEAVY:
        c = cli.commands[cmd]
        args = ([str(tmp_path / "out")] if cmd == "refrun" else [str(tmp_path / "st"), "--prompts", "x"])
        try:
            c.make_context(cmd, args + [opt, value])
        except click.UsageError:
            pass
        return
    r = runner.invoke(cli, [cmd, *_base(cmd, str(tmp_path / "no-store"), tmp_path), opt, value])
    assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    if r.exit_code == 2:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("moetrace: error: "), r.stderr
    assert "Traceback" not in r.output and "internal error" not in r.output


def test_integer_lists_declare_their_range(runner, cli):
    from moetrace.commands._options import int_list

    for name, cmd in cli.commands.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.callback is not None:
                assert p.callback is not int_list, f"{name} {p.opts}: a comma list without a declared range"
    for v in ("0", "-5", "1,0", "99999999999999999999"):
        r = runner.invoke(cli, ["sweep", "st", "--replan-every", v])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Invalid value" in r.stderr, r.stderr
    r = runner.invoke(cli, ["sweep", "st", "--replicas", "-4"])
    assert r.exit_code == 2 and "Invalid value" in r.stderr


def test_refusals_the_audit_named(runner, cli, tmp_path):
    """replay --groups 0 (was ZeroDivisionError), --stall-ms nan/inf/-1, --ranks 0, --passes 0,
    --replan-every 0, --max-moves -1, synth --steps 99999999999 (was a 2.9 TiB MemoryError)."""
    for args in (["replay", "st", "--groups", "0"], ["replay", "st", "--stall-ms", "nan"],
                 ["replay", "st", "--stall-ms", "inf"], ["replay", "st", "--stall-ms", "-1"],
                 ["replay", "st", "--ranks", "0"], ["replay", "st", "--passes", "0"],
                 ["replay", "st", "--replan-every", "0"], ["replay", "st", "--max-moves", "-1"]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Invalid value for" in r.stderr, (args, r.stderr)
    r = runner.invoke(cli, ["synth", str(tmp_path / "s"), "--steps", "99999999999"])
    assert r.exit_code == 2 and "max_replay_bytes" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "s").exists()

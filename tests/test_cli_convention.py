"""One meaning per option name across every command (CONTRIBUTING.md "Command-line
convention"): the click tree is walked, every command's --help rendered, and each visible
option checked against the convention. Old spellings may remain as unlisted aliases."""
from __future__ import annotations

import click
import pytest

from moetrace.commands import _options

#: commands that write a new run: the only ones with --run-id (every other command chooses a
#: run with --run)
WRITERS = {"ingest", "synth", "capture", "refrun"}
#: the one parser family for integer lists and step sets
INT_LISTS = {_options.int_list, _options.one_int}
STEP_PARSERS = {_options.steps_range, _options.steps_list, _options.steps_select}


def _commands(cli):
    cli.load_all()
    out = []

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            out.append((" ".join(path), cmd))

    walk(cli, [])
    return out


def _visible(cmd, ctx):
    """(option, the names its --help shows) for every option shown in the help."""
    out = []
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        rec = p.get_help_record(ctx)
        if rec is None:
            continue
        names = [n.strip().split(" ")[0] for n in rec[0].split(",")]
        out.append((p, [n for n in names if n.startswith("-")]))
    return out


def test_every_command_follows_the_convention(cli):
    problems = []
    for name, cmd in _commands(cli):
        ctx = click.Context(cmd, info_name=name)
        text = cmd.get_help(ctx)
        if "Example:" not in text:
            problems.append(f"{name}: help has no Example: block")
        for p, names in _visible(cmd, ctx):
            where = f"{name} {'/'.join(names)}"
            # -o/--out is a rows file (.parquet/.csv) of the command's table, nothing else
            if "-o" in names or "--out" in names:
                if p.name != "output" or not isinstance(p.type, click.Path) or p.type.dir_okay:
                    problems.append(f"{where}: -o/--out must be the rows file (output_options)")
            if any(n.startswith("--out") and n not in ("--out", "--output", "--out-dir") for n in names):
                problems.append(f"{where}: a folder is --out-dir, a plan file --export")
            if "--out-dir" in names and (not isinstance(p.type, click.Path) or p.type.file_okay):
                problems.append(f"{where}: --out-dir must be a folder")
            # integer lists: one parser everywhere, a list where a list is meant
            if set(names) & {"--replicas", "--replan-every", "--window"} and p.callback not in INT_LISTS \
                    and not getattr(p.callback, "int_list", False):
                problems.append(f"{where}: must use the comma-list parser (_options.ints_option)")
            # step ranges and step sets: named *-steps, parsed by the one parser
            # (an integer option is a count of steps, e.g. --batch-steps N: not a selector)
            ranged = [n for n in names if n.endswith("-steps") and n != "--steps"]
            count = isinstance(p.type, (click.types.IntParamType, click.IntRange))
            if ranged and not count and p.callback not in STEP_PARSERS:
                problems.append(f"{where}: step selectors go through _options' step parsers")
            if any("window" in n and n != "--window" for n in names):
                problems.append(f"{where}: a step range is spelled --X-steps A:B")
            if p.callback in STEP_PARSERS and not all(n.endswith("-steps") for n in names):
                problems.append(f"{where}: a step range must be named --X-steps")
            # a Chrome trace has one name
            if isinstance(p.type, click.Path) and "chrome" in (p.help or "").lower() \
                    and "--chrome-trace" not in names and "--trace-steps" not in names:
                problems.append(f"{where}: a Chrome trace is --chrome-trace")
            # runs: --run RUN_ID chooses an existing one; --run-id names a new one
            if "--run" in names and p.name not in ("run_id", "fit_run"):
                problems.append(f"{where}: --run chooses a run (dest run_id)")
            if "--run-id" in names and name not in WRITERS:
                problems.append(f"{where}: --run-id names a NEW run (only {sorted(WRITERS)})")
            if set(names) & {"--fit", "--judge", "--trace", "--fit-window"}:
                problems.append(f"{where}: old spelling shown in --help")
    assert not problems, "\n".join(problems)


def test_old_spellings_are_gone(cli, runner, tmp_path):
    """The spellings renamed before any release (report -o/--out, plan -o/--out/--out-format,
    --fit-window, calibrate --fit/--judge, whatif --trace) are no longer accepted; the new
    names parse to the same destinations."""
    cli.load_all()
    rep = cli.commands["report"]
    ctx = click.Context(rep, info_name="report")
    assert "--out-dir" in rep.get_help(ctx) and "-o, --out" not in rep.get_help(ctx)
    st = str(tmp_path)
    assert rep.make_context("report", [st, "--out-dir", "x"]).params["out"] == "x"
    assert cli.commands["replay"].make_context("replay", [st, "--fit-steps", "0:4"]).params["fit_window"] == (0, 4)
    new = cli.commands["calibrate"].make_context("calibrate", [st, "--run", "a", "--judge-run", "b"]).params
    assert new["fit_run"] == "a" and new["judge_runs"] == ("b",)
    for argv in (["report", st, "--out", "x"], ["report", st, "-o", "x"], ["plan", st, "--out", "x.json"],
                 ["plan", st, "--out-format", "eplb"], ["replay", st, "--fit-window", "0:4"],
                 ["calibrate", st, "--fit", "a"], ["calibrate", st, "--judge", "b"], ["whatif", st, "--trace", "t.json"]):
        res = runner.invoke(cli, argv)
        assert res.exit_code == 2 and "No such option" in res.output, (argv, res.output)


def test_one_value_where_one_is_meant(cli, runner, tmp_path):
    cli.load_all()
    st = str(tmp_path)
    assert cli.commands["sweep"].make_context("sweep", [st, "--window", "10,20"]).params["windows"] == [10, 20]
    assert cli.commands["replay"].make_context("replay", [st, "--window", "10"]).params["window"] == 10
    res = runner.invoke(cli, ["replay", str(tmp_path), "--policy", "eplb", "--replicas", "0,32"])
    assert res.exit_code == 2 and "takes one value here; moetrace sweep compares several" in res.output


def test_plan_refuses_the_options_a_stored_plan_ignores(runner, cli, tmp_path):
    from moetrace.produce.synth import SynthConfig, synth
    from moetrace.run import Store

    st = Store(tmp_path / "st", create=True)
    synth(st, SynthConfig(layers=1, experts=8, top_k=2, ranks=4, ranks_per_node=4, steps=4, tokens_per_step=32))
    res = runner.invoke(cli, ["plan", str(tmp_path / "st"), "--replicas", "8", "--plan", "recorded", "--max-moves", "8"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--replicas would be ignored" in res.output


def test_plan_fits_where_its_help_says(cli):
    cli.load_all()
    cmd = cli.commands["plan"]
    opt = next(p for p in cmd.params if p.name == "fit_window")
    assert "default: every recorded step" in opt.help


def test_top_level_help_is_grouped_with_an_example(runner, cli):
    res = runner.invoke(cli, ["--help"])
    assert res.exit_code == 0
    out = res.output
    for title in ("Ingest and the store:", "Analysis:", "Replay and planning:", "Reports:", "Tools: make data:",
                  "Example:"):
        assert title in out, title
    cli.load_all()
    listed = {ln.split()[0] for ln in out.splitlines() if ln.startswith("  ") and ln.split()
              and not ln.strip().startswith("-") and not ln.strip().startswith("moetrace")}
    assert set(cli.commands) <= listed            # every command in some section
    assert "…" not in out and "Other commands" not in out


@pytest.mark.parametrize("argv", [["report", "--help"], ["plan", "--help"], ["whatif", "--help"]])
def test_renamed_options_shown_by_their_new_name(runner, cli, argv):
    out = runner.invoke(cli, argv).output
    new = {"report": "--out-dir", "plan": "--export", "whatif": "--chrome-trace"}[argv[0]]
    assert new in out


def test_rows_hardware_run_and_examples_mean_one_thing_everywhere(cli):
    """Every command that prints rows takes --format table|csv|json with --json its alias and
    --wide; every --hardware is the one choice list; every --run chooses one run (dest
    run_id / fit_run, a help that says its default); every help example is one command per
    line (click re-wraps an example without its \\b marker into one paragraph)."""
    from moetrace.commands._options import LazyChoice, _hardware_presets

    problems = []
    for name, cmd in _commands(cli):
        ctx = click.Context(cmd, info_name=name)
        opts = {n: p for p in cmd.params if isinstance(p, click.Option) for n in p.opts}
        if "-o" in opts or "--out" in opts:          # a rows command (output_options)
            fmt = opts.get("--format")
            if fmt is None or not isinstance(fmt.type, click.Choice) \
                    or set(fmt.type.choices) != {"table", "csv", "json"}:
                problems.append(f"{name}: a rows command takes --format table|csv|json")
            if "--json" not in opts:
                problems.append(f"{name}: --json (an alias of --format json) missing")
            if "--wide" not in opts:
                problems.append(f"{name}: --wide missing")
        hw = opts.get("--hardware")
        if hw is not None and not (isinstance(hw.type, LazyChoice)
                                   and list(hw.type.choices) == _hardware_presets()):
            problems.append(f"{name}: --hardware must be the one preset choice list (_options.hardware_option)")
        run = opts.get("--run")
        if run is not None and "default" not in (run.help or ""):
            problems.append(f"{name}: --run's help must say what it is without --run")
        text = cmd.get_help(ctx)
        example = text.split("Example:", 1)[1].split("Options:", 1)[0] if "Example:" in text else ""
        for line in example.splitlines():
            if line.count("moetrace ") > 1:
                problems.append(f"{name}: one command per example line: {line.strip()[:80]}")
    assert not problems, "\n".join(problems)


def test_json_is_an_alias_of_format_json(cli):
    cli.load_all()
    cmd = cli.commands["runs"]
    assert cmd.make_context("runs", ["st", "--json"]).params["fmt"] == "json"
    assert cmd.make_context("runs", ["st"]).params["fmt"] == "table"
    assert cmd.make_context("runs", ["st", "--format", "csv"]).params["fmt"] == "csv"
    with pytest.raises(click.BadParameter):
        cmd.make_context("runs", ["st", "--json", "--format", "csv"])

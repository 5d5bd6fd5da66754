"""A performance engineer's own CSV: ingest says what it could not know, runs/skew say
why a value is null, re-ingesting with a corrected shape is explicit, every CSV/JSONL value
error names its row, and a missing optional dependency is one line with its install command."""
from __future__ import annotations

import sys

import pytest

from moetrace.run import Store

from .helpers import invoke

CSV = "step,layer,expert,tokens\n" + "".join(f"{s},0,{e},{(s + 1) * (e + 1)}\n" for s in range(3) for e in range(4))


@pytest.fixture
def loads(tmp_path):
    p = tmp_path / "loads.csv"
    p.write_text(CSV)
    return p


def test_ingest_without_shape_warns_and_runs_skew_say_why_null(runner, cli, loads, tmp_path):
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(loads), "--store", str(st)])
    assert res.exit_code == 0, res.output
    # stdout: the rows written; stderr: what ingest could not know, and what stays null
    assert "run loads (generic)" in res.stdout and "warning" not in res.stdout
    assert "warning: run loads: num_ranks unknown" in res.stderr and "--ranks N" in res.stderr
    assert "warning: run loads: top_k unknown" in res.stderr and "--top-k K" in res.stderr
    res = runner.invoke(cli, ["runs", str(st)])
    assert res.exit_code == 0 and "note: run loads: num_ranks unknown" in res.stderr
    res = runner.invoke(cli, ["skew", str(st), "--format", "json"])
    assert res.exit_code == 0 and '"imbalance_mean":null' in res.stdout.replace(" ", "")
    assert "imbalance, efficiency, the straggler rank and every replay are null" in res.stderr
    # with the shape given: no warning, and the imbalance is there
    res = runner.invoke(cli, ["ingest", str(loads), "--store", str(tmp_path / "st2"), "--ranks", "2", "--top-k", "1"])
    assert res.exit_code == 0 and "warning" not in res.stderr, res.stderr
    res = runner.invoke(cli, ["skew", str(tmp_path / "st2"), "--format", "json"])
    # experts 0,1 on rank 0 and 2,3 on rank 1: step s loads (s+1)*(1+2) vs (s+1)*(3+4) -> max/mean 7/5
    import json

    row = json.loads(res.stdout)[0]
    assert row["imbalance_mean"] == pytest.approx(7 / 5) and "note:" not in res.stderr


def test_reingest_with_a_corrected_shape_is_explicit(runner, cli, loads, tmp_path):
    st = tmp_path / "st"
    assert invoke(runner, cli, "ingest", loads, "--store", st).exit_code == 0
    assert "already ingested as run 'loads'" in invoke(runner, cli, "ingest", loads, "--store", st).output  # no-op
    before = Store(st).run_ids()
    res = invoke(runner, cli, "ingest", loads, "--store", st, "--ranks", "2")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "already ingested as run 'loads' with other options" in res.output and "--run-id" in res.output
    assert Store(st).run_ids() == before == ["loads"]                      # never silently 'loads-2'
    res = invoke(runner, cli, "ingest", loads, "--store", st, "--ranks", "2", "--run-id", "loads_r2")
    assert res.exit_code == 0, res.output
    assert sorted(Store(st).run_ids()) == ["loads", "loads_r2"]
    assert Store(st).run_row("loads_r2")["num_ranks"] == 2


@pytest.mark.parametrize("name,text,where,what", [
    ("bad.csv", "step,layer,expert,tokens\n0,0,0,5\n0,0,1,abc\n", "(row 2, line 3)", "'tokens' must be integer, got 'abc'"),
    ("neg.csv", "step,layer,expert,tokens\n0,0,0,5\n0,0,1,-3\n", "(row 2, line 3)", "tokens = -3 is negative"),
    ("dup.csv", "step,layer,expert,tokens\n0,0,0,5\n0,0,1,3\n0,0,0,2\n", "(row 3, line 4)",
     "first row 1, line 2, last row 3, line 4"),
    ("frac.csv", "step,layer,expert,tokens\n0,0,0,5.0\n0,0,1,2.5\n", "(row 2, line 3)", "non-integer value 2.5"),
    ("bad.jsonl", '{"step":0,"layer":0,"expert":0,"tokens":1}\n{"step":0,"layer":0,"expert":1,"tokens":"x"}\n',
     "(row 2)", "'tokens' must be integer, got 'x'"),
    ("route.csv", "step,layer,token,expert\n0,0,0,1\n0,0,1,-2\n", "(row 2, line 3)", "expert id -2 is negative"),
])
def test_every_value_error_names_its_row(runner, cli, tmp_path, name, text, where, what):
    f = tmp_path / name
    f.write_text(text)
    res = invoke(runner, cli, "ingest", f, "--store", tmp_path / "st")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{f} {where}:" in res.output and what in res.output, res.output
    assert not (tmp_path / "st").exists() or Store(tmp_path / "st").run_ids() == []


def test_a_value_error_past_the_first_csv_block_names_its_line(runner, cli, tmp_path):
    f = tmp_path / "big.csv"            # 8 MiB blocks: the bad value sits in a later one
    n = 700_000
    with f.open("w") as fh:
        fh.write("step,layer,expert,tokens\n")
        fh.write("".join(f"{i // 64},0,{i % 64},1\n" for i in range(n)))
        fh.write(f"{n // 64 + 1},0,0,oops\n")
    res = invoke(runner, cli, "ingest", f, "--store", tmp_path / "st")
    assert res.exit_code == 2 and f"(row {n + 1}, line {n + 2})" in res.output, res.output


@pytest.mark.parametrize("command,missing,extra", [
    (["capture", "{st}", "--tiny", "qwen3_moe", "--prompts", "{p}"], "transformers", "capture"),
    (["capture", "{st}", "--tiny", "qwen3_moe", "--prompts", "{p}"], "torch", "capture"),
    (["refrun", "{st}/rr", "--ranks", "2"], "torch", "torch"),
])
def test_a_missing_extra_is_one_line_with_its_install_command(runner, cli, tmp_path, monkeypatch, command,
                                                              missing, extra):
    p = tmp_path / "prompts.txt"
    p.write_text("hello\n")
    monkeypatch.setitem(sys.modules, missing, None)     # import torch / transformers raises ImportError
    args = [a.format(st=tmp_path / "st", p=p) for a in command]
    res = invoke(runner, cli, *args)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1 and "internal error" not in line and "Traceback" not in line
    assert f"needs the {extra!r} extra ({missing} is not installed): pip install 'moetrace[{extra}]'" in line
    assert not (tmp_path / "st").exists()


def test_the_other_extras_say_the_same_line():
    from moetrace.errors import MissingExtra, UsageError

    e = MissingExtra("--engine spark", "spark", "pyspark", hint="(and a Java runtime)")
    assert isinstance(e, UsageError) and e.exit_code == 2
    assert str(e) == ("--engine spark needs the 'spark' extra (pyspark is not installed): pip install "
                      "'moetrace[spark]' (and a Java runtime)")


def test_synth_prints_the_line_the_readme_shows(runner, cli, tmp_path):
    """The synth command of docs/how-to/query-sql.md, word for word: dense expert_counts rows
    are counted as the expert_load rows they hold (50 steps x 4 layers x 256 experts = 51200)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs/how-to/query-sql.md").read_text()
    cmd, line = re.search(r"\$ moetrace synth demo ([^\n]+)\n(run synth-s0: [^\n]+)", readme).groups()
    res = runner.invoke(cli, ["synth", str(tmp_path / "demo"), *cmd.split()])
    assert res.exit_code == 0 and res.output.strip() == line, res.output
    assert "expert_load 51200 rows" in line


@pytest.mark.slow
def test_the_readme_own_data_section_runs_word_for_word(tmp_path):
    """The own-data block of docs/how-to/own-csv.md pasted into bash in an empty folder: it
    runs, and prints the skew rows and the replay lines the page shows."""
    import os
    import re
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "docs/how-to/own-csv.md").read_text()
    part = readme.split("## Steps", 1)[1].split("\n## ", 1)[0]
    block, shown = re.findall(r"```(?:bash)?\n(.*?)```", part, re.S)[:2]
    script = f'moetrace() {{ "{sys.executable}" -m moetrace "$@"; }}\nset -e\n' + block
    env = {**os.environ, "PYTHONPATH": str(repo), "COLUMNS": "120"}    # the page shows a 120-column terminal
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    for line in shown.splitlines():
        line = line.rstrip()
        if not line or "r-..." in line or line.endswith("(uncalibrated: ...)"):
            continue
        assert line in res.stdout, line

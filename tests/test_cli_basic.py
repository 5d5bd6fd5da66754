import json

import polars as pl

from .helpers import module_fixture


def test_every_command_has_help_with_an_example(cli):
    assert set(cli.commands) == set(cli.list_commands(None))   # the ast index finds what register() adds
    for name, cmd in cli.commands.items():
        assert cmd.help, f"command {name} has no help"
        assert "Example:" in cmd.help, f"command {name} help lacks an Example: block"


@module_fixture
def demo(tmp_path_factory):
    from click.testing import CliRunner

    from moetrace.cli import cli

    path = tmp_path_factory.mktemp("cli") / "demo"
    r = CliRunner().invoke(cli, ["synth", str(path), "--layers", "2", "--experts", "16", "--top-k", "4", "--ranks", "4",
                                 "--ranks-per-node", "2", "--steps", "6", "--tokens-per-step", "64", "--run-id", "d"])
    assert r.exit_code == 0, r.output
    return path


def test_synth_then_sql_conserves_tokens(demo, runner, cli):
    r = runner.invoke(cli, ["sql", str(demo), "SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert len(rows) == 12 and {row["t"] for row in rows} == {64 * 4}


def test_sql_csv_and_output_files(demo, runner, cli, tmp_path):
    r = runner.invoke(cli, ["sql", str(demo), "SELECT layer, count(*) AS n FROM expert_load GROUP BY 1 ORDER BY 1",
                            "--format", "csv"])
    assert r.output.splitlines() == ["layer,n", "0,96", "1,96"]
    for ext in ("parquet", "csv"):
        out = tmp_path / f"o.{ext}"
        r = runner.invoke(cli, ["sql", str(demo), "SELECT * FROM steps", "-o", str(out)])
        assert r.exit_code == 0, r.output
        df = pl.read_parquet(out) if ext == "parquet" else pl.read_csv(out)
        assert df.height == 6 * 4


def test_sql_error_is_clean(demo, runner, cli):
    r = runner.invoke(cli, ["sql", str(demo), "SELECT nope FROM expert_load"])
    assert r.exit_code != 0 and "SQL error" in r.output and "Traceback" not in r.output


def test_runs_lists_shape_source_and_row_counts(demo, runner, cli):
    r = runner.invoke(cli, ["runs", str(demo), "--format", "json"])
    row = json.loads(r.output)[0]
    assert row["run_id"] == "d" and row["num_experts"] == 16 and row["top_k"] == 4 and row["num_ranks"] == 4
    assert row["expert_load"] == 6 * 2 * 16 and row["steps"] == 6 * 4 and row["source"] == "synth"


def test_catalog_command(demo, runner, cli):
    r = runner.invoke(cli, ["catalog", str(demo)])
    assert r.exit_code == 0 and (demo / "catalog.duckdb").exists()
    assert "file_search_path" in r.output


def test_tables_command_shows_contract(runner, cli):
    r = runner.invoke(cli, ["tables", "expert_load"])
    assert r.exit_code == 0 and "tokens" in r.output and "int64" in r.output


def test_open_store_python_api(demo):
    import moetrace

    df = moetrace.open_store(demo).sql("SELECT count(DISTINCT step) AS n FROM expert_load")
    assert isinstance(df, pl.DataFrame) and df["n"][0] == 6


def _load_csv(tmp_path):
    p = tmp_path / "load.csv"
    p.write_text("step,layer,expert,tokens\n0,0,0,3\n0,0,1,5\n1,0,0,2\n1,0,1,6\n")
    return p


def test_ingest_takes_the_store_first_or_with_store(runner, cli, tmp_path):
    src = _load_csv(tmp_path)
    for argv, st in ((["ingest", str(tmp_path / "a"), str(src)], "a"),
                     (["ingest", str(src), "--store", str(tmp_path / "b")], "b")):
        r = runner.invoke(cli, argv + ["--top-k", "1"])
        assert r.exit_code == 0, r.output
        r = runner.invoke(cli, ["sql", str(tmp_path / st), "SELECT sum(tokens) AS t FROM expert_load", "--format", "csv"])
        assert r.output.splitlines() == ["t", str(3 + 5 + 2 + 6)]
    r = runner.invoke(cli, ["ingest", str(tmp_path / "c")])
    assert r.exit_code == 2 and not (tmp_path / "c").exists()


def test_ingest_set_refuses_unknown_keys_and_lists_known_ones(runner, cli, tmp_path):
    r = runner.invoke(cli, ["ingest", str(tmp_path / "s"), str(_load_csv(tmp_path)), "--set", "tpo_k=2"])
    assert r.exit_code == 2 and "'tpo_k'" in r.output and "top_k" in r.output
    assert not (tmp_path / "s").exists()


def test_ingest_help_lists_the_formats(runner, cli):
    from moetrace.collect import registry

    text = " ".join(runner.invoke(cli, ["ingest", "--help"]).output.split())
    assert all(name in text for name in registry()) and "STORE FILE..." in text


def test_tables_documents_metric_views(runner, cli):
    r = runner.invoke(cli, ["tables", "layer_skew", "--format", "json"])
    assert r.exit_code == 0, r.output
    cols = {row["column"]: row for row in json.loads(r.output)}
    assert {"imbalance", "straggler_rank", "gini"} <= set(cols) and "max_rank_tokens / mean_rank_tokens" in cols["imbalance"]["meaning"]
    r = runner.invoke(cli, ["tables", "--format", "json"])
    kinds = {row["name"]: row["kind"] for row in json.loads(r.output)}
    assert kinds["expert_load"] == "table" and kinds["skew_summary"] == "view"
    r = runner.invoke(cli, ["tables", "no_such_thing"])
    assert r.exit_code == 2 and "layer_skew" in r.output


def test_json_pretty_and_out_alias(demo, runner, cli, tmp_path):
    q = "SELECT layer, count(*) AS n FROM expert_load GROUP BY 1 ORDER BY 1"
    flat = runner.invoke(cli, ["sql", str(demo), q, "--format", "json"]).output
    pretty = runner.invoke(cli, ["sql", str(demo), q, "--format", "json", "--pretty"]).output
    assert json.loads(flat) == json.loads(pretty) == [{"layer": 0, "n": 96}, {"layer": 1, "n": 96}]
    assert len(flat.strip().splitlines()) == 1 and '\n  {\n    "layer": 0' in pretty
    for flag in ("-o", "--out", "--output"):
        out = tmp_path / f"x{flag.strip('-')}.csv"
        assert runner.invoke(cli, ["sql", str(demo), q, flag, str(out)]).exit_code == 0
        assert pl.read_csv(out)["n"].to_list() == [96, 96]


def test_view_column_meanings_name_real_columns(tmp_path):
    """view_columns.json must not drift from the SQL: every column it explains exists."""
    import moetrace
    from moetrace.storage.views import view_columns, view_docs

    con = moetrace.open_store(tmp_path / "empty", create=True).connect()
    for view, cols in view_columns().items():
        assert view in view_docs(), view
        have = {r[0] for r in con.execute(f'DESCRIBE "{view}"').fetchall()}
        assert set(cols) <= have, f"{view}: {sorted(set(cols) - have)} not in the view"


def test_help_imports_no_data_stack():
    """`moetrace --help` lists every command from the command files without importing them,
    nor polars, duckdb, pyarrow, numpy or matplotlib (start-up time; measured, not timed, here)."""
    import subprocess
    import sys

    code = ("import sys\nfrom moetrace.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('polars', 'duckdb', 'pyarrow', 'numpy', 'matplotlib', 'moetrace.storage.store') "
            "if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out and "ingest" in out and "replay" in out

import json

import polars as pl
import pytest



def test_every_command_has_help_with_an_example(cli):
    for name, cmd in cli.commands.items():
        assert cmd.help, f"command {name} has no help"
        assert "Example:" in cmd.help, f"command {name} help lacks an Example: block"


@pytest.fixture(scope="module")
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

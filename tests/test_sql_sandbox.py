"""`moetrace sql` runs sandboxed (moetrace/storage/sandbox.py): real DuckDB, real files.

Each refusal is one line on stderr, exit 2, the store byte-for-byte unchanged and nothing
written outside it (a fake HOME's .bashrc, the working folder)."""
from __future__ import annotations

import os
import subprocess
import sys

import duckdb
import polars as pl
import pytest

from .helpers import REPO, module_fixture, run_cli, tree_hash


class _Result:
    def __init__(self, r):
        self.returncode, self.stdout, self.stderr = r.exit_code, r.stdout, r.stderr
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


def _run(*args, cwd, timeout=None):
    """The CLI in this process (a subprocess per call costs seconds on a loaded machine)."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return _Result(run_cli(*args, catch_exceptions=True))
    finally:
        os.chdir(old)


@module_fixture
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sb")
    r = _run("synth", "st", "--steps", "4", "--layers", "2", "--experts", "16", "--ranks", "4", "--ranks-per-node", "4", cwd=root)
    assert r.returncode == 0, r.stderr
    (root / "lnk").symlink_to("st")   # the store by a symlink (tests of reading and of -o through it)
    return root


HOSTILE = {
    "copy_anywhere": "COPY (SELECT 'pwned') TO 'home/.bashrc' (HEADER false)",
    "copy_into_store": "COPY (SELECT 1) TO 'st/x.csv'",
    "copy_from": "COPY runs FROM '/etc/passwd'",
    "export": "EXPORT DATABASE 'home/dump'",
    "attach": "ATTACH 'home/other.duckdb' AS o",
    "attach_in_store": "ATTACH 'st/o.duckdb' AS o",
    "install": "INSTALL httpfs",
    "load": "LOAD httpfs",
    "read_text": "SELECT * FROM read_text('/etc/passwd')",
    "read_csv": "SELECT * FROM read_csv('/etc/passwd')",
    "read_blob": "SELECT * FROM read_blob('/etc/hostname')",
    "glob": "SELECT * FROM glob('/*')",
    "parquet_elsewhere": "SELECT * FROM read_parquet('home/x.parquet')",
    "dotdot": "SELECT * FROM read_parquet('st/../home/x.parquet')",
    "http": "SELECT * FROM read_parquet('https://example.com/x.parquet')",
    "set": "SET enable_external_access = true",
    "reset": "RESET lock_configuration",
    "pragma": "PRAGMA enable_profiling",
    "explain_analyze_copy": "EXPLAIN ANALYZE COPY (SELECT 1) TO 'st/y.csv'",
    "explain_comment_copy": "EXPLAIN /* x */ ANALYZE COPY (SELECT 1) TO 'home/y.csv'",
    "two_statements": "SELECT 1; COPY (SELECT 1) TO 'home/z.csv'",
    "create_secret": "CREATE PERSISTENT SECRET s (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "create_table": "CREATE TABLE t AS SELECT 1",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_sandbox_refuses(store, name, runner, cli, monkeypatch):
    home = store / "home"
    home.mkdir(exist_ok=True)
    pl.DataFrame({"a": [1]}).write_parquet(home / "x.parquet")
    before_store, before_home = tree_hash(store / "st"), tree_hash(home)
    monkeypatch.chdir(store)
    monkeypatch.setenv("HOME", str(home))
    r = runner.invoke(cli, ["sql", "st", HOSTILE[name]])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrace: error: "), r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert r.stdout == ""
    assert tree_hash(store / "st") == before_store and tree_hash(home) == before_home
    assert sorted(p.name for p in store.iterdir()) == ["home", "lnk", "st"]


def test_sandbox_still_reads_the_store_relative_absolute_and_symlinked(store):
    want = 4 * 2 * 16   # synth: 4 steps x 2 layers x 16 experts of expert_load rows
    for path in ("st", store / "st", "lnk", "./st"):
        r = _run("sql", path, "SELECT count(*) AS n FROM expert_load", "--format", "csv", cwd=store)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["n", str(want)]


def test_allow_path_opens_exactly_that_folder(store, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (tmp_path / "ref2").mkdir()
    pl.DataFrame({"run_id": ["synth-s0"], "note": ["x"]}).write_parquet(ref / "n.parquet")
    pl.DataFrame({"a": [1]}).write_parquet(tmp_path / "ref2" / "m.parquet")
    q = f"SELECT r.run_id, n.note FROM runs r JOIN read_parquet('{ref}/n.parquet') n USING (run_id)"
    r = _run("sql", "st", q, "--format", "csv", cwd=store)
    assert r.returncode == 2 and "--allow-path" in r.stderr
    r = _run("sql", "st", q, "--format", "csv", "--allow-path", ref, cwd=store)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["run_id,note", "synth-s0,x"]
    # a sibling whose name starts with the allowed folder's name stays closed
    r = _run("sql", "st", f"SELECT * FROM '{tmp_path}/ref2/m.parquet'", "--allow-path", ref, cwd=store)
    assert r.returncode == 2


def test_unsafe_lifts_the_sandbox(store, tmp_path):
    out = tmp_path / "c.csv"
    r = _run("sql", "st", f"COPY (SELECT 42 AS x) TO '{out}'", "--unsafe", cwd=store)
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines() == ["x", "42"]
    help_text = _run("sql", "--help", cwd=store).stdout
    assert "--unsafe" in help_text and "sandbox" in help_text.lower() and "--allow-path" in help_text


def test_recursive_cte_ends_at_the_timeout(store):
    q = "WITH RECURSIVE t(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM t) SELECT count(*) FROM t"
    r = _run("sql", "st", q, "--timeout", "1", cwd=store, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--timeout 1" in r.stderr, r.stderr


def test_output_is_never_written_inside_the_store(store):
    before = tree_hash(store / "st")
    for target in ("st/x.parquet", "st/runs/x.csv", "lnk/y.csv"):
        r = _run("sql", "st", "SELECT 1 AS a", "-o", target, cwd=store)
        assert r.returncode == 2 and "inside the store" in r.stderr, r.stderr
    assert tree_hash(store / "st") == before


def test_streamed_outputs_match_duckdb(store, tmp_path):
    """Rows streamed in batches (more than one batch) equal DuckDB's own result."""
    q = "SELECT range AS i, range * 3 AS j, sum(range) OVER () AS s FROM range(150000)"
    for ext in ("parquet", "csv"):
        out = tmp_path / f"o.{ext}"
        r = _run("sql", "st", q, "-o", out, cwd=store)
        assert r.returncode == 0, r.stderr
        df = pl.read_parquet(out) if ext == "parquet" else pl.read_csv(out)
        assert df.height == 150000 and df["i"].to_list() == list(range(150000))
        assert (df["j"] == df["i"] * 3).all() and df["s"].unique().to_list() == [150000 * 149999 // 2]
    r = _run("sql", "st", "SELECT range AS i FROM range(100000)", "--format", "csv", cwd=store)
    assert r.stdout.splitlines() == ["i"] + [str(i) for i in range(100000)]
    r = _run("sql", "st", "SELECT range AS i FROM range(1000)", cwd=store)
    assert "(1000 rows; first and last shown)" in r.stdout and "| 999 " in r.stdout and "| 0 " in r.stdout
    import json
    r = _run("sql", "st", "SELECT range AS i, [range] AS l FROM range(70000)", "--format", "json", cwd=store)
    assert json.loads(r.stdout) == [{"i": i, "l": [i]} for i in range(70000)]
    assert json.loads(_run("sql", "st", "SELECT 1 WHERE false", "--format", "json", cwd=store).stdout) == []


@pytest.mark.slow
def test_a_large_result_is_streamed_in_bounded_memory(store, tmp_path):
    """20M rows (320 MB of int64s) to a Parquet file with the child's peak RSS under 600 MiB.

    The peak is the child's own VmHWM: ru_maxrss of an exec'd child starts from the forking
    pytest process's size (Linux copies the old memory map's high-water mark at exec), which
    in a full run is ~1.8 GiB and failed this test in CI while it passed alone."""
    out = tmp_path / "big.parquet"
    code = ("import sys; from moetrace.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1])")
    r = subprocess.run([sys.executable, "-c", code, "sql", "st", "SELECT range AS a, range * 2 AS b FROM "
                        "range(20000000)", "-o", str(out)], cwd=store, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert "wrote 20000000 rows" in r.stderr, r.stderr
    assert int(r.stdout.split()[-1]) < 600 * 1024   # KiB; holding the rows would need > 320 MB of data alone
    assert duckdb.sql(f"SELECT count(*), sum(b) FROM '{out}'").fetchall()[0] == (20000000, 20000000 * 19999999)


def test_spark_sql_needs_unsafe(store):
    """Spark SQL has no sandbox (it reads any path the session can: parquet.`/etc/...`), so
    the Spark engine is refused before any session starts unless --unsafe is given."""
    before = tree_hash(store / "st")
    r = _run("sql", "st", "--engine", "spark", "SELECT * FROM parquet.`/etc/passwd`", cwd=store)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--unsafe" in lines[0], r.stderr
    assert tree_hash(store / "st") == before


def test_report_keeps_matplotlib_cache_out_of_home(tmp_path):
    """Importing the report's plotting module points matplotlib's config/cache at a temp
    folder (a fake HOME stays empty); a user's own MPLCONFIGDIR is kept."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MPLCONFIGDIR"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"),
               PYTHONPATH=str(REPO))
    code = "import moetrace.report.plots, matplotlib, os; print(matplotlib.get_configdir()); print(os.environ['MPLCONFIGDIR'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    cfg, env_dir = out.split()
    assert cfg == env_dir and not cfg.startswith(str(home)), out
    assert list(home.iterdir()) == []
    own = tmp_path / "mine"
    env["MPLCONFIGDIR"] = str(own)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == str(own)

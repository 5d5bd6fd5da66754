"""Start-up (under 0.3 s): the store module imports neither duckdb nor polars, and the
store's connection defines only the views of sql/ a statement names (plus what they read)."""
from __future__ import annotations

import re
import subprocess
import sys

from moetrace.storage import views

from .helpers import run_row


def test_store_import_is_lazy():
    code = ("import sys, moetrace.storage.store, moetrace.storage.writer; "
            "print(sorted(m for m in ('duckdb', 'polars') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_view_dependencies_from_the_sql_text():
    graph = views.view_graph()
    # every view of sql/ is in the graph, once, in file order
    names = [re.match(r'\s*CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+"?(\w+)', s, re.I).group(1)
             for s in views.view_statements()]
    assert list(graph) == names
    # skew_summary reads layer_skew (its FROM clause names it)
    assert "layer_skew" in graph["skew_summary"][2]
    need = views.views_needed("SELECT * FROM skew_summary")
    made = [re.match(r'\s*CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+"?(\w+)', s, re.I).group(1) for s in need]
    assert made[-1] == "skew_summary" and "layer_skew" in made
    assert made.index("layer_skew") < made.index("skew_summary")
    # closed under dependencies, and nothing already defined is made again
    assert all(d in made for v in made for d in graph[v][2])
    assert views.views_needed("SELECT * FROM skew_summary", set(made)) == []
    assert views.views_needed("SELECT 1") == []


def test_lazy_connection_matches_every_view(tmp_path):
    import pyarrow as pa

    from moetrace.storage.store import Store

    st = Store(tmp_path / "s", create=True)
    st.write_run(run_row(source="unit", source_sha256="a" * 64, num_layers=1, num_experts=4, top_k=1,
                         num_ranks=2, ranks_per_node=2),
                 {"expert_load": pa.table({"step": [0, 0, 0, 0], "layer": [0, 0, 0, 0], "expert": [0, 1, 2, 3],
                                           "slot": pa.nulls(4, pa.int32()), "src_rank": pa.nulls(4, pa.int32()),
                                           "tokens": [6, 2, 1, 1]})}, run_id="r")
    # ranks of 2 experts: rank 0 = 8 tokens, rank 1 = 2: max/mean = 8 / 5
    got = st.sql("SELECT imbalance FROM layer_skew WHERE run_id = 'r'")["imbalance"].to_list()
    assert got == [1.6]
    defined = {r[0] for r in st.con.raw.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert "layer_skew" in defined and "skew_by_batch" not in defined
    eager = st.connect()
    assert eager.execute("SELECT imbalance FROM layer_skew").fetchall() == [(1.6,)]
    assert {r[0] for r in eager.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()} \
        >= set(views.view_graph())
    eager.close()
    st.close()


#: run the CLI in a fresh interpreter and print which heavy modules it imported
_CLI_IMPORTS = """
import io, json, sys
from contextlib import redirect_stdout
sys.path.insert(0, {repo!r})
from moetrace.cli import main
out = io.StringIO()
with redirect_stdout(out):
    try:
        main({args!r})
    except SystemExit as e:
        code = e.code
print(json.dumps({{"code": code, "out": out.getvalue(),
                   "heavy": sorted(m for m in ("polars", "pyarrow", "numpy", "pandas", "duckdb")
                                   if m in sys.modules)}}))
"""


def _cli_in_fresh_python(*args: str) -> dict:
    import json
    from pathlib import Path

    code = _CLI_IMPORTS.format(repo=str(Path(__file__).resolve().parent.parent), args=list(args))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_runs_and_skew_import_neither_polars_nor_arrow_nor_numpy(tmp_path, runner, cli):
    """`moetrace runs` and `moetrace skew` print DuckDB's rows: polars, pyarrow (and its
    pandas), numpy and the duckdb package's Python layer (moetrace.storage.duck: only its
    C extension) are not imported on their path (start-up under 0.3 s).
    Not a timing test: it fails when one of them comes back on the path."""
    st = tmp_path / "tiny"
    res = runner.invoke(cli, ["synth", str(st), "--layers", "2", "--steps", "3", "--tokens-per-step", "64",
                              "--experts", "16", "--top-k", "2", "--ranks", "4", "--ranks-per-node", "4"])
    assert res.exit_code == 0, res.output
    for args in (["runs", str(st)], ["runs", str(st), "--format", "json"], ["skew", str(st)],
                 ["skew", str(st), "--by", "step"], ["skew", str(st), "--by", "run", "--format", "json"]):
        got = _cli_in_fresh_python(*args)
        assert got["code"] in (0, None), (args, got)
        assert got["out"].strip() and "no runs" not in got["out"], (args, got)
        assert got["heavy"] == [], f"moetrace {' '.join(args[:1] + args[2:])} imported {got['heavy']}"
    # -o x.parquet: written by DuckDB's COPY, the rows of the frame
    got = _cli_in_fresh_python("skew", str(st), "--by", "step", "-o", str(tmp_path / "s.parquet"))
    assert got["code"] in (0, None) and got["heavy"] == [], got
    import polars as pl

    from moetrace import open_store as _open

    s0 = _open(st)
    assert pl.read_parquet(tmp_path / "s.parquet").equals(s0.run(s0.resolve_run(None)).skew("step"))
    # the same table as the polars frame of the same rows prints (what `emit` printed before)
    from moetrace import open_store
    from moetrace.output import render_table

    s = open_store(st)
    frame = s.run(s.resolve_run(None)).skew("step")
    from moetrace.commands.analyze_cmds import _SKEW_FIRST

    first = [c for c in _SKEW_FIRST if c in frame.columns and c != "run_id"]   # the terminal's order, one run
    frame = frame.select(first + [c for c in frame.columns if c not in first and c != "run_id"])
    assert _cli_in_fresh_python("skew", str(st), "--by", "step")["out"] == render_table(frame) + "\n"


def test_rows_print_as_polars_prints_their_frame():
    """emit_rows' table (no polars) is render_table of the same rows' polars frame, text for
    text; where it is not sure (wide tables, large floats, odd strings) it lets polars print."""
    from moetrace.output import Rows, render_rows, render_table

    cases = [
        Rows(["a", "bb", "s", "b"], ["BIGINT", "DOUBLE", "VARCHAR", "BOOLEAN"],
             [(1, 1.5, "x", True), (None, None, None, None), (3, float("nan"), "abc d", False),
              (-4, -0.0, "", None), (5, float("-inf"), "a|b", True), (6, 1e20, "long " * 13, False)]),
        # a FLOAT's value as DuckDB returns it: the float32 widened to a double
        Rows(["f", "h", "d"], ["FLOAT", "HUGEINT", "DOUBLE"],
             [(0.10000000149011612, 2 ** 62, 99999.99995), (2.5, -3, 1e9), (100000.0, 0, -1e-9)]),
        Rows(["a"], ["BIGINT"], []),
        Rows(["s"], ["VARCHAR"], [("é",), ("two\nlines",)]),
        *(Rows(["i", "x"], ["INTEGER", "DOUBLE"], [(i, i / 7) for i in range(n)]) for n in (49, 50, 51, 60)),
        # around polars' 250-character table width
        *(Rows([f"c{i}" for i in range(10)], ["VARCHAR"] * 10,
               [tuple("x" * ((w - 31) // 10 + (i < (w - 31) % 10)) for i in range(10))]) for w in range(240, 262)),
    ]
    fast = 0
    for r in cases:
        text = render_rows(r)
        if text is not None:
            fast += 1
            assert text == render_table(r.to_polars()), r
    assert fast >= 15   # the plain cases do not need polars


def test_engine_is_the_packages_extension():
    """moetrace.storage.duck hands out the C extension the duckdb package re-exports: the
    same connect, connection class and exceptions (a DuckDB release that changes this fails
    here); a connection made through it gains the package's methods once the package is
    imported, and the package is imported as soon as a data-frame library is loaded."""
    code = """
import sys
from moetrace.storage import duck
assert "duckdb" not in sys.modules
con = duck.duckdb.connect(":memory:")
assert con.execute("SELECT 6 * 7 AS x").fetchall() == [(42,)]
try:
    con.execute("SELECT * FROM no_such_table")
except duck.Error as e:
    caught = type(e).__name__
import pyarrow as pa
duck.needs_full()
assert "duckdb" in sys.modules
import duckdb
assert duck.duckdb.connect is duckdb.connect and duck.Error is duckdb.Error
assert duck.duckdb.CatalogException is duckdb.CatalogException
assert duck.duckdb.BinderException is duckdb.BinderException
assert type(con) is duckdb.DuckDBPyConnection
t = pa.table({"a": [1, 2, 3]})
assert con.sql("SELECT sum(a) FROM t").fetchall() == [(6,)]      # the package's method, Arrow scan
print(caught)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CatalogException"


def test_lazy_views_bring_the_package_for_its_methods(tmp_path):
    """A store opened in a process without the duckdb package: ``Store.rows`` runs on the
    extension alone; ``con.sql`` (a method of the package's Python layer) still works."""
    code = f"""
import sys
from moetrace.storage.store import Store
st = Store({str(tmp_path / "s")!r}, create=True)
assert st.rows("SELECT 1 AS one").rows == [(1,)]
assert "duckdb" not in sys.modules
assert st.con.sql("SELECT 2").fetchall() == [(2,)]
assert "duckdb" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

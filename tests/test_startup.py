"""Start-up (issue #26): the store module imports neither duckdb nor polars, and the
store's connection defines only the views of sql/ a statement names (plus what they read)."""
from __future__ import annotations

import re
import subprocess
import sys

from moetrace.storage import views


def test_store_import_is_lazy():
    code = ("import sys, moetrace.storage.store, moetrace.storage.txn; "
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
    st.write_run({"source": "unit", "source_sha256": "a" * 64, "collector": "test", "time_base": "none",
                  "num_layers": 1, "num_experts": 4, "top_k": 1, "num_ranks": 2, "ranks_per_node": 2},
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

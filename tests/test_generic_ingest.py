"""The generic collector through the CLI: formats, errors (exit 2, store unchanged)."""
import json

import polars as pl
import pytest

from moetrace.run import Store

from .helpers import tree_hash


def _load_df():
    rows = [(s, l, e, 3 * e + s + l) for s in range(3) for l in range(2) for e in range(8)]
    return pl.DataFrame(rows, schema=["step", "layer", "expert", "tokens"], orient="row")


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_expert_load_in_each_format(tmp_path, runner, cli, fmt):
    df = _load_df()
    f = tmp_path / f"load.{fmt}"
    {"csv": df.write_csv, "jsonl": df.write_ndjson, "parquet": df.write_parquet}[fmt](f)
    r = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st"), "--ranks", "2"])
    assert r.exit_code == 0, r.output
    st = Store(tmp_path / "st")
    got = st.sql("SELECT step, layer, sum(tokens) AS t FROM expert_load GROUP BY ALL ORDER BY ALL")
    want = df.group_by("step", "layer").agg(pl.col("tokens").sum().alias("t")).sort("step", "layer")
    assert got["t"].to_list() == want["t"].to_list()
    run = st.runs().row(0, named=True)
    assert (run["num_layers"], run["num_experts"], run["num_ranks"]) == (2, 8, 2)
    assert "num_experts inferred" in run["approximations"]


def test_routing_is_aggregated_into_expert_load(tmp_path, runner, cli):
    # 2 tokens, top-2, one layer, one step: token0 -> 3,1 ; token1 -> 1,0
    rows = [dict(step=0, layer=0, token=0, expert=3, gate=0.6), dict(step=0, layer=0, token=0, expert=1, gate=0.4),
            dict(step=0, layer=0, token=1, expert=1, gate=0.7), dict(step=0, layer=0, token=1, expert=0, gate=0.3)]
    f = tmp_path / "route.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st"), "--experts", "4"])
    assert r.exit_code == 0, r.output
    st = Store(tmp_path / "st")
    load = dict(st.sql("SELECT expert, tokens FROM expert_load ORDER BY expert").iter_rows())
    assert load == {0: 1, 1: 2, 3: 1}
    ch = st.sql("SELECT token, expert, choice FROM routing ORDER BY token, choice").rows()
    assert ch == [(0, 3, 0), (0, 1, 1), (1, 1, 0), (1, 0, 1)]
    assert st.runs()["top_k"][0] == 2


def test_ingesting_the_same_file_twice_does_not_duplicate(tmp_path, runner, cli):
    f = tmp_path / "load.csv"
    _load_df().write_csv(f)
    runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st")])
    before = tree_hash(tmp_path / "st")
    r = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st")])
    assert r.exit_code == 0 and "already ingested" in r.output
    assert tree_hash(tmp_path / "st") == before


def _bad_cases(tmp_path):
    good = _load_df()
    cases = {}
    p = tmp_path / "missing.csv"
    good.drop("tokens").rename({"expert": "expert"}).write_csv(p)
    cases["missing"] = (p, ["missing columns", "tokens"], [])
    p = tmp_path / "negative.csv"
    good.with_columns(pl.when(pl.col("expert") == 5).then(-4).otherwise(pl.col("tokens")).alias("tokens")).write_csv(p)
    cases["negative"] = (p, ["negative", "tokens", "row"], [])
    p = tmp_path / "range.parquet"
    good.write_parquet(p)
    cases["range"] = (p, ["expert", "outside the run's shape", "0..3"], ["--experts", "4"])
    p = tmp_path / "layer_range.parquet"
    good.write_parquet(p)
    cases["layer_range"] = (p, ["layer", "outside the run's shape"], ["--layers", "1"])
    p = tmp_path / "empty.csv"
    p.write_text("")
    cases["empty"] = (p, ["empty"], [])
    p = tmp_path / "mystery.bin"
    p.write_bytes(b"\x00\x01garbage")
    cases["unknown"] = (p, ["unknown file type"], [])
    p = tmp_path / "header_only.csv"
    p.write_text("step,layer,expert,tokens\n")
    cases["header_only"] = (p, ["no rows"], [])
    p = tmp_path / "bad.jsonl"
    p.write_text('{"step": 0, "layer": 0, "expert": 1, "tokens": 2}\n{"step": 0, "layer": \n')
    cases["bad_json"] = (p, ["invalid JSON", "line 2"], [])
    p = tmp_path / "dup.csv"
    pl.concat([good, good.head(1)]).write_csv(p)
    cases["duplicate"] = (p, ["duplicate", "step=0", "layer=0", "expert=0"], [])
    p = tmp_path / "float.csv"
    p.write_text("step,layer,expert,tokens\n0,0,0,1.5\n")
    cases["fractional"] = (p, ["non-integer", "tokens"], [])
    return cases


@pytest.mark.parametrize("case", ["missing", "negative", "range", "layer_range", "empty", "unknown", "header_only",
                                  "bad_json", "duplicate", "fractional"])
def test_bad_input_exit_2_names_file_and_leaves_store_unchanged(tmp_path, runner, cli, case):
    store = tmp_path / "st"
    ok = tmp_path / "ok.csv"
    _load_df().write_csv(ok)
    assert runner.invoke(cli, ["ingest", str(ok), "--store", str(store)]).exit_code == 0
    before = tree_hash(store)
    path, needles, extra = _bad_cases(tmp_path)[case]
    r = runner.invoke(cli, ["ingest", str(path), "--store", str(store), *extra])
    assert r.exit_code == 2, r.output
    msg = r.output.strip().splitlines()[-1]
    assert path.name in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert tree_hash(store) == before


def test_bad_file_among_good_ones_writes_nothing(tmp_path, runner, cli):
    good = tmp_path / "good.csv"
    _load_df().write_csv(good)
    bad = tmp_path / "bad.csv"
    bad.write_text("step,layer,expert,tokens\n0,0,0,-1\n")
    r = runner.invoke(cli, ["ingest", str(good), str(bad), "--store", str(tmp_path / "st")])
    assert r.exit_code == 2
    assert not (tmp_path / "st").exists()  # validation fails before the store is even created


def test_stray_file_in_a_folder_is_skipped_and_said(tmp_path, runner, cli):
    folder = tmp_path / "dump"
    folder.mkdir()
    _load_df().write_csv(folder / "load.csv")
    (folder / "README.txt").write_text("notes about this dump\n")
    r = runner.invoke(cli, ["ingest", str(folder), "--store", str(tmp_path / "st")])
    assert r.exit_code == 0, r.output
    assert "skipped 1 file(s)" in r.output and "README.txt" in r.output
    st = Store(tmp_path / "st")
    assert st.sql("SELECT sum(tokens) AS t FROM expert_load")["t"][0] == _load_df()["tokens"].sum()
    assert "README.txt" in st.runs()["approximations"][0]


def test_named_unknown_file_still_fails_and_folder_of_nothing_fails(tmp_path, runner, cli):
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / "a.txt").write_text("x")
    r = runner.invoke(cli, ["ingest", str(folder), "--store", str(tmp_path / "st")])
    assert r.exit_code == 2 and "no file of a known format" in r.output
    r = runner.invoke(cli, ["ingest", str(folder / "a.txt"), "--store", str(tmp_path / "st")])
    assert r.exit_code == 2 and "unknown file type" in r.output
    assert not (tmp_path / "st").exists()

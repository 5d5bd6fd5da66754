"""Bad column types and absurd numbers are one-line refusals, never internal errors or a
silent change of data (a decimal 3.5 once became 3).

Generated cases: the ``tokens`` (and id) columns of a Parquet expert_load file in every
Arrow type that is not an integer (struct, list, map, boolean, decimals with a fraction in
any row, strings that are no numbers), duplicated columns, and Chrome-trace timestamps of
thousands of digits. Each: one line naming the file, exit 2, under 1 GiB, no store.
Then the lenient acceptances docs/hardening.md lists, read as documented."""
from __future__ import annotations

import decimal
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .helpers.bounded_cli import run_cases

N = 6


def _base():
    return {"step": pa.array([0] * N, pa.int64()), "layer": pa.array([0] * N, pa.int64()),
            "expert": pa.array(list(range(N)), pa.int64())}


def _dec(vals, scale=1, precision=10):
    return pa.array([decimal.Decimal(v) for v in vals], pa.decimal128(precision, scale))


BAD_TYPES = {
    "struct": pa.array([{"a": i} for i in range(N)]),
    "list": pa.array([[i] for i in range(N)]),
    "map": pa.array([[("a", i)] for i in range(N)], pa.map_(pa.string(), pa.int64())),
    "bool": pa.array([True, False] * (N // 2)),
    "string_words": pa.array(["one"] * N),
    "float_fraction": pa.array([1.0] * (N - 1) + [2.5]),
    **{f"decimal_fraction_row{r}": _dec(["3"] * r + ["3.5"] + ["2"] * (N - r - 1)) for r in (0, N - 1)},
    "decimal_tiny_fraction": _dec(["1"] * (N - 1) + ["1.000001"], scale=6, precision=20),
    "decimal256_fraction": pa.array([decimal.Decimal("7.25")] * N, pa.decimal256(40, 2)),
    "decimal_huge": _dec(["1" + "0" * 30] * N, scale=0, precision=38),
}


def _parquet_case(d, name, col):
    t = pa.table({**_base(), "tokens": col})
    pq.write_table(t, d / "load.parquet")


def _dup_case(d, dup):
    cols = _base()
    arrays = list(cols.values()) + [pa.array([1] * N, pa.int64())]
    names = list(cols) + ["tokens"]
    arrays.append(pa.array([2] * N, pa.int64()))
    names.append(dup)
    pq.write_table(pa.Table.from_arrays(arrays, names=names), d / "load.parquet")


def _kineto_case(d, ts: str):
    ev = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 1,
           "args": {"device": 0, "stream": 7}}]
    text = json.dumps({"traceEvents": ev, "deviceProperties": [{"id": 0}]}).replace('"ts": 1', f'"ts": {ts}')
    (d / "rank0.pt.trace.json").write_text(text)


def test_bad_types_and_numbers_are_one_line(tmp_path):
    cases, want = [], []

    def add(name, fname, words, fmt=()):
        d = tmp_path / name
        cases.append({"args": ["ingest", d / "st", d / fname, *fmt], "cwd": d})
        want.append((name, d, fname, words))

    for name, col in BAD_TYPES.items():
        d = tmp_path / name
        d.mkdir()
        _parquet_case(d, name, col)
        add(name, "load.parquet", ["tokens"])
    for dup in ("tokens", "step", "expert"):
        d = tmp_path / f"dup_{dup}"
        d.mkdir()
        _dup_case(d, dup)
        add(f"dup_{dup}", "load.parquet", [f"'{dup}' appears more than once"])
    for name, ts in {"ts_5000_digits": "9" * 5000, "ts_100k_digits": "1" * 100_000,
                     "ts_fraction_5000": "1." + "5" * 5000 + "e40", "ts_exp": "1e999999"}.items():
        d = tmp_path / name
        d.mkdir()
        _kineto_case(d, ts)
        add(name, "rank0.pt.trace.json", ["timestamp"], ("--format", "kineto"))
    for (name, d, fname, words), res in zip(want, run_cases(cases, tmp_path / "run", timeout=60)):
        line = res.refused(fname, *words)
        assert "internal error" not in line, (name, line)
        assert os.listdir(d) == [fname], (name, os.listdir(d))


@pytest.mark.parametrize("vals,scale", [(["3", "2"], 1), (["3.0", "2.00"], 2), (["5"], 0)])
def test_decimals_without_a_fraction_are_read_exactly(tmp_path, vals, scale):
    """Decimal counts with no fraction are integers and read as such (sums exact)."""
    n = len(vals)
    t = pa.table({"step": pa.array([0] * n, pa.int64()), "layer": pa.array([0] * n, pa.int64()),
                  "expert": pa.array(list(range(n)), pa.int64()), "tokens": _dec(vals, scale)})
    pq.write_table(t, tmp_path / "load.parquet")
    res, = run_cases([{"args": ["ingest", tmp_path / "st", tmp_path / "load.parquet"], "cwd": tmp_path},
                      {"args": ["sql", tmp_path / "st", "SELECT sum(tokens) AS s FROM expert_load", "--format", "csv"],
                       "cwd": tmp_path}][:1], tmp_path / "run")
    assert res.rc == 0, res.stderr
    from moetrace.run import Store

    got = Store(tmp_path / "st").sql("SELECT sum(tokens) AS s FROM expert_load")["s"][0]
    assert got == sum(int(decimal.Decimal(v)) for v in vals)


def test_lenient_acceptances_as_documented(tmp_path):
    """docs/hardening.md "Lenient acceptances": JSONL "5" is 5, CSV 0x10 is 16 (Arrow's CSV
    parser reads hexadecimal integers); booleans are refused."""
    (tmp_path / "a.jsonl").write_text('{"step": 0, "layer": 0, "expert": 0, "tokens": "5"}\n')
    (tmp_path / "b.csv").write_text("step,layer,expert,tokens\n0,0,0,0x10\n")
    (tmp_path / "c.jsonl").write_text('{"step": 0, "layer": 0, "expert": 0, "tokens": true}\n')
    a, b, c = run_cases([{"args": ["ingest", tmp_path / "sa", tmp_path / "a.jsonl"]},
                         {"args": ["ingest", tmp_path / "sb", tmp_path / "b.csv"]},
                         {"args": ["ingest", tmp_path / "sc", tmp_path / "c.jsonl"]}], tmp_path / "run")
    assert a.rc == 0, a.stderr
    from moetrace.run import Store

    assert Store(tmp_path / "sa").sql("SELECT tokens FROM expert_load")["tokens"].to_list() == [5]
    assert b.rc == 0, b.stderr
    assert Store(tmp_path / "sb").sql("SELECT tokens FROM expert_load")["tokens"].to_list() == [16]
    c.refused("c.jsonl", "tokens")


def test_sglang_legacy_repeated_rows_are_summed_and_said(tmp_path):
    p = tmp_path / "expert_distribution_rank0_timestamp1.csv"
    p.write_text("layer_id,expert_id,count\n0,0,3\n0,0,4\n0,1,2\n")
    res, = run_cases([{"args": ["ingest", tmp_path / "st", p, "--format", "sglang"]}], tmp_path / "run")
    assert res.rc == 0, res.stderr
    from moetrace.run import Store

    st = Store(tmp_path / "st")
    got = st.sql("SELECT expert, tokens FROM expert_load ORDER BY expert").rows()
    assert got == [(0, 7), (1, 2)]
    assert "1 repeated (layer_id, expert_id) row(s)" in st.sql("SELECT approximations FROM runs")["approximations"][0]

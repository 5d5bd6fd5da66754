"""vLLM and SGLang server log lines (every variant in docs/reference/formats.md) into the balancedness table."""
from __future__ import annotations

import calendar
import json

import pytest

from moetrace.collect import collect, ingest
from moetrace.collect.logs import parse_line
from moetrace.run import Store

from .helpers import tree_hash

V = "(EngineCore_DP0 pid=4242) INFO 03-14 10:00:{:02d} [eplb_state.py:401] "
S = "[2025-06-01 12:00:{:02d} DP0 TP0 EP0] "

LINES = [
    V.format(1) + "EPLB step: avg_tokens=1024.00, max_tokens=2048, balancedness=0.5000",
    V.format(2) + "EPLB step: 7 for model deepseek-ai/DeepSeek-V3: avg_tokens=900.50, max_tokens=1200, "
                  "balancedness=0.7504",
    V.format(3) + "EPLB step: 8 for model m: avg_tokens=10.00, max_tokens=40, balancedness=0.2500, "
                  "steps until the next rearrangement: 92",
    V.format(4) + "Rearranging experts (profile)...",
    V.format(5) + "Rearranged experts (profile) in 2.50 seconds.",
    V.format(6) + "Rearranged experts  in 0.75 s.",
    "INFO 03-14 10:00:07 [api_server.py:1] some unrelated vLLM line",
    "\x00\x01 binary garbage \xff",
    V.format(8) + "EPLB step: avg_tokens=??, max_tokens=2048, balancedness=0.5",   # malformed
    S.format(0) + "[Expert Balancedness] forward_pass_id=20 current_pass_balancedness=0.400 "
                  "last_10_average_balancedness=0.410 last_100_average_balancedness=0.420 "
                  "last_1000_average_balancedness=0.430  gpu_physical_count_sum=40",
    S.format(1) + "[EPLBManager] rebalance start",
    S.format(2) + "[EPLBManager] rebalance end time=1.234s",
    S.format(3) + "[EPLBManager] Skipped ep rebalancing: current GPU utilization 0.95 > minimum rebalance "
                  "threshold 0.90",
    S.format(4) + "[Expert Balancedness] forward_pass_id=21 current_pass_balancedness=0.5",  # malformed (truncated)
]


@pytest.fixture
def log(tmp_path):
    p = tmp_path / "server.log"
    p.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return p


def test_every_variant(log):
    rd = collect([log], options={"year": 2026})[0]
    t = rd.tables["balancedness"].to_pylist()
    by_line = {r["line"]: r for r in t}
    assert sorted(by_line) == [1, 2, 3, 4, 5, 6, 10, 11, 12, 13]
    r = by_line[1]
    assert (r["engine"], r["event"], r["step"], r["avg_tokens"], r["max_tokens"], r["balancedness"]) == \
        ("vllm", "balancedness", None, 1024.0, 2048.0, 0.5)
    assert r["ts_ns"] == calendar.timegm((2026, 3, 14, 10, 0, 1, 0, 0, 0)) * 10**9
    assert r["process"] == "EngineCore_DP0 pid=4242"
    assert (by_line[2]["step"], by_line[2]["model"], by_line[2]["avg_tokens"]) == (7, "deepseek-ai/DeepSeek-V3", 900.5)
    assert (by_line[3]["steps_until_rearrangement"], by_line[3]["balancedness"]) == (92, 0.25)
    assert (by_line[4]["event"], by_line[4]["is_profile"]) == ("rebalance_start", True)
    assert (by_line[5]["event"], by_line[5]["duration_s"], by_line[5]["is_profile"]) == ("rebalance_end", 2.5, True)
    assert (by_line[6]["duration_s"], by_line[6]["is_profile"]) == (0.75, False)
    s = by_line[10]
    assert (s["engine"], s["step"], s["balancedness"], s["balancedness_last_10"], s["balancedness_last_100"],
            s["balancedness_last_1000"], s["gpu_physical_count_sum"]) == ("sglang", 20, 0.4, 0.41, 0.42, 0.43, 40)
    assert s["ts_ns"] == calendar.timegm((2025, 6, 1, 12, 0, 0, 0, 0, 0)) * 10**9 and s["process"] == "DP0 TP0 EP0"
    assert by_line[11]["event"] == "rebalance_start"
    assert (by_line[12]["event"], by_line[12]["duration_s"]) == ("rebalance_end", 1.234)
    assert (by_line[13]["event"], by_line[13]["utilization"], by_line[13]["threshold"]) == ("rebalance_skip", 0.95, 0.9)


def test_unmatched_lines_are_counted_and_reported(log):
    rd = collect([log], options={"year": 2026})[0]
    counts = json.loads(rd.run["meta_json"])["line_counts"]
    assert counts == {"lines": 14, "matched": 10, "malformed": 2, "unrelated": 2, "malformed_lines": [9, 14],
                      "malformed_kinds": ["SGLang balancedness line", "vLLM balancedness line"]}
    approx = json.loads(rd.run["approximations"])
    assert any("2 log lines carry an EPLB marker but did not parse" in a for a in approx)
    assert any("2 unrelated log lines" in a for a in approx)


def test_balancedness_agrees_with_avg_over_max():
    # vLLM's definition: balancedness = avg / max, check a line built from a real split
    loads = [300, 100, 200, 400]
    avg, mx = sum(loads) / len(loads), max(loads)
    row = parse_line(f"EPLB step: avg_tokens={avg:.2f}, max_tokens={mx}, balancedness={avg / mx:.4f}")
    assert row["balancedness"] == pytest.approx(row["avg_tokens"] / row["max_tokens"], abs=1e-4)


def test_log_without_eplb_lines_is_an_error_and_store_unchanged(tmp_path, runner, cli):
    p = tmp_path / "server.log"
    p.write_text("INFO 03-14 10:00:07 [x.py:1] hello\n" + "EPLB step: broken\n")
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    res = runner.invoke(cli, ["ingest", str(p), "--store", str(st), "--format", "logs"])
    assert res.exit_code == 2 and "no EPLB balancedness" in res.output and "1 malformed" in res.output
    assert tree_hash(st) == before


def test_ingest_and_query(log, tmp_path):
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [log])[0].run_id
    q = st.sql("SELECT engine, count(*) n, avg(balancedness) b FROM balancedness WHERE run_id = ? AND "
               "event = 'balancedness' GROUP BY engine ORDER BY engine", [rid])
    assert q["n"].to_list() == [1, 3]
    assert q["b"][1] == pytest.approx((0.5 + 0.7504 + 0.25) / 3)


def test_report_section(log, tmp_path):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import balancedness

    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [log])[0].run_id
    out = tmp_path / "rep"
    out.mkdir()
    sec = balancedness.build(ReportContext(st, rid, st.run_row(rid), out))
    mean = (0.5 + 0.7504 + 0.25 + 0.4) / 4
    assert f"4 passes: mean **{mean:.3f}**" in sec.markdown
    assert "3 finished (2 started), 1 skipped" in sec.markdown
    assert "total 4.48 s, longest 2.50 s" in sec.markdown  # 2.5 + 0.75 + 1.234
    assert any("2 carried an EPLB marker but did not parse" in n for n in sec.notes)
    assert (out / "balancedness_log.png").stat().st_size > 0

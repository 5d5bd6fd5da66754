"""One balancedness, every engine's name for it, and two log defects:
an empty vLLM EPLB window is undefined (not 0) and SGLang timestamps are only said to be
UTC when there is one."""
from __future__ import annotations

import calendar
import json
from pathlib import Path

import pytest

from moetrace.collect import collect, ingest
from moetrace.domain.balance import DEFINITIONS, ENGINE_FIGURE, to_imbalance
from moetrace.run import Store

V = "(EngineCore_DP0 pid=7) INFO 11-30 10:00:{:02d} [eplb_state.py:790] "


def test_conversions_by_hand():
    # per-rank tokens [300, 100, 200, 400]: mean 250, max 400 -> max/mean 1.6
    loads = [300, 100, 200, 400]
    mean, mx = sum(loads) / 4, max(loads)
    assert to_imbalance("vllm_balancedness", mean / mx) == pytest.approx(1.6)
    assert to_imbalance("sglang_balancedness", mean / mx) == pytest.approx(1.6)
    assert to_imbalance("trtllm_imbalance_ratio", (mx - mean) / mean) == pytest.approx(1.6)
    assert to_imbalance("vllm_balancedness", 0.0) is None            # an empty window
    assert to_imbalance("vllm_balancedness", None) is None
    assert to_imbalance("trtllm_imbalance_ratio", float("nan")) is None
    with pytest.raises(KeyError):
        to_imbalance("bogus", 1.0)
    assert set(ENGINE_FIGURE.values()) == set(DEFINITIONS)


def test_vllm_empty_window_is_null_and_report_never_divides_by_it(tmp_path):
    p = tmp_path / "vllm.log"
    p.write_text(V.format(1) + "EPLB step: 3 for model m: avg_tokens=0.00, max_tokens=0, balancedness=0.0000, "
                 "steps until the next rearrangement: 10\n"
                 + V.format(2) + "EPLB step: 4 for model m: avg_tokens=250.00, max_tokens=400, balancedness=0.6250, "
                 "steps until the next rearrangement: 9\n")
    rd = collect([p], options={"year": 2026})[0]
    rows = {r["line"]: r for r in rd.tables["balancedness"].to_pylist()}
    assert rows[1]["balancedness"] is None and rows[1]["imbalance"] is None
    assert rows[1]["max_tokens"] == 0.0
    assert rows[2]["balancedness"] == 0.625 and rows[2]["imbalance"] == pytest.approx(400 / 250)
    assert rows[2]["definition"].startswith("vllm: avg_tokens / max_tokens")
    approx = json.loads(rd.run["approximations"])
    assert any("1 vLLM EPLB lines had no token routed" in a and "line 1" in a for a in approx)

    from moetrace.report.base import ReportContext
    from moetrace.report.sections import balancedness

    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [p], options={"year": 2026})[0].run_id
    out = tmp_path / "rep"
    out.mkdir()
    sec = balancedness.build(ReportContext(st, rid, st.run_row(rid), out))
    assert "1000000000" not in sec.markdown
    assert "1 passes: mean **0.625**" in sec.markdown and "1.60× on average" in sec.markdown
    assert "1 passes routed no token" in sec.markdown


SGL_MSG = ("[Expert Balancedness] forward_pass_id={} current_pass_balancedness=0.500 "
           "last_10_average_balancedness=0.500 last_100_average_balancedness=0.500 "
           "last_1000_average_balancedness=0.500 gpu_physical_count_sum=64")


def test_sglang_python_logging_timestamp_parsed(tmp_path):
    p = tmp_path / "sglang.log"
    p.write_text("2026-11-30 10:15:02,345 - sglang.srt.eplb.expert_distribution - INFO - " + SGL_MSG.format(5) + "\n"
                 + "2026-11-30 10:15:03,001 INFO " + SGL_MSG.format(6) + "\n")
    rd = collect([p])[0]
    rows = rd.tables["balancedness"].to_pylist()
    assert [r["ts_ns"] for r in rows] == [calendar.timegm((2026, 11, 30, 10, 15, s, 0, 0, 0)) * 10**9 for s in (2, 3)]
    assert rows[0]["imbalance"] == pytest.approx(2.0)
    approx = json.loads(rd.run["approximations"])
    assert any("taken as UTC" in a for a in approx)
    assert not any("carry no timestamp" in a for a in approx)


def test_sglang_without_timestamp_is_not_said_to_be_utc(tmp_path):
    p = tmp_path / "sglang.log"
    p.write_text("INFO:sglang.srt.eplb.expert_distribution:" + SGL_MSG.format(5) + "\n")
    rd = collect([p])[0]
    assert rd.tables["balancedness"].column("ts_ns").to_pylist() == [None]
    assert rd.run["time_base"] == "none"
    approx = json.loads(rd.run["approximations"])
    assert not any("taken as UTC" in a for a in approx)
    assert any("1 SGLang log lines carry no timestamp" in a for a in approx)


def test_tables_and_docs_show_every_definition(runner, cli):
    res = runner.invoke(cli, ["tables", "balancedness", "--format", "csv"])
    assert res.exit_code == 0, res.output
    assert "1/balancedness" in res.output and "imbalance-ratio + 1" in res.output
    doc = (Path(__file__).resolve().parent.parent / "docs" / "explanation" / "metrics.md").read_text()
    for _engine, _formula, source, _ in DEFINITIONS.values():
        assert source.split()[1] in doc, source


def test_metrics_scrapes_get_the_same_conversion():
    samples = Path(__file__).resolve().parent.parent / "sample_traces" / "metrics_scrapes"
    rows = [r for r in collect([samples])[0].tables["balancedness"].to_pylist() if r["event"].startswith("balanc")]
    assert rows
    for r in rows:
        assert r["imbalance"] == pytest.approx(1 / r["balancedness"])
        assert r["definition"].startswith(r["engine"] + ":")

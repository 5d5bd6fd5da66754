"""Saved Prometheus scrapes of vLLM / SGLang EPLB metrics -> balancedness rows with times.
Scrapes are written here by hand; expected values are the arithmetic on them (Δsum/Δcount,
counter differences), done in the test."""
from __future__ import annotations

import json

import pytest

from moetrace.collect import collect, ingest
from moetrace.errors import InputError
from moetrace.run import Store

T0 = 1764547200   # 2025-12-01 00:00:00 UTC


def _scrape(i, avg, mn, rearr, secs, cnt, tot, extra=""):
    return (f"# HELP vllm:eplb_balancedness_avg Mean EPLB balancedness across MoE layers.\n"
            f"# TYPE vllm:eplb_balancedness_avg gauge\n"
            f'vllm:eplb_balancedness_avg{{engine="0",model_name="dsv3"}} {avg}\n'
            f'vllm:eplb_balancedness_min{{engine="0",model_name="dsv3"}} {mn}\n'
            f"# TYPE vllm:eplb_rearrangements_total counter\n"
            f'vllm:eplb_rearrangements_total{{engine="0",model_name="dsv3"}} {rearr}\n'
            f'vllm:eplb_rearrangement_seconds{{engine="0",model_name="dsv3"}} {secs}\n'
            f"# TYPE sglang:eplb_balancedness summary\n"
            f'sglang:eplb_balancedness_count{{forward_mode="decode",moe_ep_rank="0"}} {cnt}\n'
            f'sglang:eplb_balancedness_sum{{forward_mode="decode",moe_ep_rank="0"}} {tot}\n'
            f'sglang:eplb_balancedness_created{{forward_mode="decode",moe_ep_rank="0"}} 1.7645e9\n'
            f'vllm:num_requests_running{{engine="0",model_name="dsv3"}} 3\n'
            f'process_cpu_seconds_total 12.5\n' + extra)


@pytest.fixture
def scrapes(tmp_path):
    d = tmp_path / "scrapes"
    d.mkdir()
    vals = [(0.80, 0.60, 1, 2.0, 10, 7.0), (0.90, 0.70, 3, 1.5, 30, 23.0), (0.85, "NaN", 3, 1.5, 40, 31.5)]
    for i, v in enumerate(vals):
        (d / f"metrics_{T0 + 60 * i}.prom").write_text(_scrape(i, *v))
    return d


def test_rows_and_times(scrapes):
    rd = collect([scrapes])[0]
    rows = rd.tables["balancedness"].to_pylist()
    bal = [(r["engine"], r["event"], r["ts_ns"] // 10**9, r["balancedness"]) for r in rows
           if r["event"].startswith("balancedness")]
    assert bal == [("vllm", "balancedness", T0, 0.80), ("vllm", "balancedness_min", T0, 0.60),
                   ("vllm", "balancedness", T0 + 60, 0.90), ("vllm", "balancedness_min", T0 + 60, 0.70),
                   ("sglang", "balancedness", T0 + 60, pytest.approx((23.0 - 7.0) / (30 - 10))),
                   ("vllm", "balancedness", T0 + 120, 0.85),
                   ("sglang", "balancedness", T0 + 120, pytest.approx((31.5 - 23.0) / (40 - 30)))]
    # the counter rose from 1 to 3 between the first two scrapes: two rearrangements, the last one 1.5 s
    ends = [(r["ts_ns"] // 10**9, r["duration_s"]) for r in rows if r["event"] == "rebalance_end"]
    assert ends == [(T0 + 60, None), (T0 + 60, 1.5)]
    assert {r["model"] for r in rows if r["engine"] == "vllm"} == {"dsv3"}
    approx = json.loads(rd.run["approximations"])
    # other families: vllm:num_requests_running and process_cpu_seconds (3 samples each), never silent
    assert any("6 samples of 2 other metric families" in a for a in approx)
    assert any("1 NaN balancedness samples skipped" in a for a in approx)
    assert any("1 counted before the first scrape" in a for a in approx)
    meta = json.loads(rd.run["meta_json"])
    assert meta["other_families"] == {"process_cpu_seconds": 3, "vllm:num_requests_running": 3}


def test_single_scrape_lifetime_mean_and_sample_timestamps(tmp_path):
    f = tmp_path / "metrics.prom"
    f.write_text('sglang:eplb_balancedness_count{forward_mode="extend"} 8 1764547260000\n'
                 'sglang:eplb_balancedness_sum{forward_mode="extend"} 6 1764547260000\n')
    rd = collect([f])[0]
    (row,) = rd.tables["balancedness"].to_pylist()
    assert row["balancedness"] == 0.75 and row["ts_ns"] == 1764547260 * 10**9
    assert row["process"] == "forward_mode=extend"
    assert any("lifetime mean" in a for a in json.loads(rd.run["approximations"]))


@pytest.mark.parametrize("text, msg, where", [
    ("vllm:eplb_balancedness_avg 0.5\nthis is { not a sample\n", "not a Prometheus sample line", "line 2"),
    ('vllm:eplb_balancedness_avg{engine=0} 0.5\n', "bad label set", "line 1"),
    ("vllm:eplb_balancedness_avg abc\n", "is not a number", "line 1"),
])
def test_bad_lines(tmp_path, text, msg, where):
    f = tmp_path / "m.prom"
    f.write_text(text)
    with pytest.raises(InputError, match=msg) as e:
        collect([f], format="prometheus")
    assert e.value.position == where


def test_no_eplb_metric(tmp_path):
    f = tmp_path / "m.prom"
    f.write_text("# TYPE up gauge\nup 1\n")
    with pytest.raises(InputError, match="no vLLM or SGLang EPLB metric"):
        collect([f], format="prometheus")


def test_report_shows_the_scraped_balancedness(scrapes, tmp_path, runner, cli):
    st = Store(tmp_path / "st", create=True)
    ingest(st, [scrapes], run_id="scr")
    r = runner.invoke(cli, ["report", str(tmp_path / "st"), "--run", "scr", "--out-dir", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Engine-reported balancedness" in md and "mean **0.8" in md


def test_sample_scrapes_ingest(tmp_path):
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "sample_traces" / "metrics_scrapes"
    rd = collect([here])[0]
    assert rd.run["collector"] == "prometheus" and rd.tables["balancedness"].num_rows > 0

"""Every benchmark runs at its small size through benchmarks/run_all.py, so the figures
quoted in the docs come from scripts that still work. Speed is never asserted here (the
figures are printed by the benchmarks); what is checked: each benchmark finishes, returns
well-formed rows, and the JSON and Markdown tables agree with each other."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from .helpers import REPO, SHARED_DATA, module_fixture

BENCHMARKS = sorted(p.stem[len("bench_"):] for p in (REPO / "benchmarks").glob("bench_*.py"))
#: benchmarks that read a real trace under ../shared/data: absent in a fresh clone, they
#: are skipped (benchmarks.common.Skipped), never failed
NEEDS_SHARED_DATA = {"ingest_kineto": "deepseek_ep64_train_rank0.json.gz"}
#: the module fixture runs every benchmark (the suite's longest work unit, over a minute on 2 cores)
pytestmark = pytest.mark.slow


@module_fixture
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-results")
    # the timeouts only catch a hang: the benchmarks take about a minute together on a quiet
    # 2-core machine (their small sizes fork the refrun ranks from the benchmark's process,
    # benchmarks.rank_fork, and fleet's and layer_skew's stages from a forkserver), several
    # times that on a loaded host
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--size", "small", "--out", str(out),
                           "--timeout", "900"], capture_output=True, text=True, timeout=2400, cwd=str(REPO))
    doc = json.loads((out / "results.json").read_text())
    return proc, doc, (out / "results.md").read_text()


def test_every_benchmark_is_listed_and_run_all_succeeds(results):
    proc, doc, _ = results
    assert sorted(b["benchmark"] for b in doc["benchmarks"]) == BENCHMARKS
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_at_small_size(results, name):
    _, doc, _ = results
    b = next(b for b in doc["benchmarks"] if b["benchmark"] == name)
    if b["status"] == "skipped":
        # only a benchmark whose real trace is absent may skip, and it says why
        src = NEEDS_SHARED_DATA.get(name)
        assert src is not None, f"{name} skipped: {b.get('error')}"
        assert not (SHARED_DATA / src).exists(), f"{name} skipped although {SHARED_DATA / src} exists"
        assert src in b.get("error", ""), b
        pytest.skip(f"{name}: {b['error']}")
    assert b["status"] == "ok", b.get("error")


def test_rows_are_well_formed_and_ratios_match_baselines(results):
    _, doc, _ = results
    for b in doc["benchmarks"]:
        assert b["size"] == "small", b["benchmark"]
        if b["status"] == "skipped":
            assert not b["results"], b["benchmark"]
            continue
        assert b["results"], b["benchmark"]
        for r in b["results"]:
            assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), (b["benchmark"], r)
            assert r["unit"], (b["benchmark"], r)
            if r.get("ratio") is not None:
                assert r.get("baseline"), (b["benchmark"], r)  # a ratio always names what it is relative to
                assert math.isfinite(r["ratio"]) and r["ratio"] > 0, (b["benchmark"], r)
            if r.get("baseline_value") is not None and r.get("ratio") is not None and r["value"] > 0:
                # the ratio is baseline/value (time, memory) or value/baseline (rates), nothing else
                q = r["baseline_value"] / r["value"]
                assert math.isclose(r["ratio"], q, rel_tol=1e-6) or math.isclose(r["ratio"], 1 / q, rel_tol=1e-6), \
                    (b["benchmark"], r)


def test_markdown_table_lists_every_json_row(results):
    _, doc, md = results
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| benchmark")]
    # one row per figure, and one status row (with the reason) per benchmark without figures
    assert len(table) == sum(len(b["results"]) or 1 for b in doc["benchmarks"])
    for b in doc["benchmarks"]:
        for r in b["results"]:
            assert any(ln.startswith(f"| {b['benchmark']} | small | {r['metric']} |") for ln in table), r["metric"]


def test_fleet_small_runs_its_whole_shape(results):
    _, doc, _ = results
    fleet = next(b for b in doc["benchmarks"] if b["benchmark"] == "fleet")["results"]
    # the fleet benchmark's small run: 4 layers x 256 experts x 240 steps of expert_load
    assert next(r["value"] for r in fleet if r["metric"] == "expert_load rows") == 4 * 256 * 240


def test_run_all_only_updates_the_named_benchmark(tmp_path):
    """--only reruns the named benchmark (eplb: the quickest; every benchmark's own run is
    the module's fixture above) and keeps the other entries of results.json."""
    prev = {"written_at": "x", "machine": {}, "benchmarks": [
        {"benchmark": "zz_kept", "status": "ok", "size": "full", "wall_s": 1.0, "results": [
            {"benchmark": "zz_kept", "metric": "m", "value": 1.0, "unit": "s", "baseline": None,
             "baseline_value": None, "ratio": None, "notes": ""}]}]}
    (tmp_path / "results.json").write_text(json.dumps(prev))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--size", "small", "--only",
                           "eplb", "--out", str(tmp_path), "--timeout", "120"], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [b["benchmark"] for b in doc["benchmarks"]] == ["eplb", "zz_kept"]
    assert doc["benchmarks"][0]["status"] == "ok" and doc["benchmarks"][0]["results"]
    assert "| zz_kept | full | m |" in (tmp_path / "results.md").read_text()

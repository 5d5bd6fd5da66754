"""Server logs nobody here wrote (../shared/data/real_logs): SGLang's [EPLBManager] lines
from a real A100 run and the vLLM "EPLB step" line with zero tokens quoted in a vLLM issue.
Expected numbers are counted here from the raw lines with a regular expression of this
test's own."""
from __future__ import annotations

import re

import pytest

from moetrace.run import Store

from .helpers import invoke, shared_data


def _ingest(p, tmp_path, runner, cli):
    st = tmp_path / "st"
    res = invoke(runner, cli, "ingest", p, "--store", st)
    assert res.exit_code == 0, res.output
    return Store(st)


def test_sglang_eplbmanager_rebalances(tmp_path, runner, cli):
    p = shared_data("real_logs", "sglang_eplbmanager_a100.log")
    text = p.read_text()
    starts = len(re.findall(r"\[EPLBManager\] rebalance start", text))
    ends = [float(x) for x in re.findall(r"\[EPLBManager\] rebalance end time=([0-9.]+) ?s", text)]
    assert (starts, len(ends), round(sum(ends), 3)) == (19, 19, 38.719)     # ../shared/data/README.md
    got = _ingest(p, tmp_path, runner, cli).sql(
        "SELECT event, count(*) AS n, sum(duration_s) AS s FROM balancedness GROUP BY event ORDER BY event").rows()
    assert got[0][:2] == ("rebalance_end", len(ends)) and got[0][2] == pytest.approx(sum(ends))
    assert got[1][:2] == ("rebalance_start", starts)


def test_vllm_zero_token_step_has_no_ratio(tmp_path, runner, cli):
    p = shared_data("real_logs", "vllm_eplb_zero_tokens.log")
    assert re.search(r"avg_tokens=0\.00, max_tokens=0, balancedness=0\.0000", p.read_text())
    rows = _ingest(p, tmp_path, runner, cli).sql("SELECT event, balancedness, max_tokens FROM balancedness").rows()
    assert rows == [("balancedness", None, 0)]     # 0 / 0 is no balancedness, not a perfect or a zero one

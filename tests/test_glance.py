"""Answers a person reads at a glance: an own CSV without a shape gets to the straggler under
EPLB in one try, every refusal on the way is one line that says what would work, and the
answers fit a 120-column terminal with the cost model's band said once."""
from __future__ import annotations

import re

import numpy as np
import pytest

from .helpers import invoke, module_fixture

E, LAYERS, STEPS = 64, 2, 24


def _csv(path):
    rng = np.random.default_rng(7)
    rows = ["step,layer,expert,tokens"]
    for s in range(STEPS):
        for lay in range(LAYERS):
            for e in range(E):
                rows.append(f"{s},{lay},{e},{int(rng.gamma(0.5, 100.0)) + (400 if e == 5 else 0)}")
    path.write_text("\n".join(rows) + "\n")
    return path


@module_fixture
def noshape(tmp_path_factory):
    """A store holding an own CSV ingested without --ranks / --top-k (run 'loads')."""
    from click.testing import CliRunner

    from moetrace.cli import cli

    d = tmp_path_factory.mktemp("own")
    res = CliRunner().invoke(cli, ["ingest", str(_csv(d / "loads.csv")), "--store", str(d / "st")])
    assert res.exit_code == 0, res.output
    return d / "st"


def _one_line(res):
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, res.output
    assert "<input>" not in lines[0]
    return lines[0]


def test_replay_on_a_store_without_a_shape_takes_the_ranks_from_the_flag(runner, cli, noshape):
    res = invoke(runner, cli, "replay", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "16")
    assert res.exit_code == 0, res.output
    assert "16 ranks x 5 slots" in res.stdout           # (64 + 16) / 16 = 5 slots per rank
    assert "--ranks 16 used" in res.stdout and "contiguous" in res.stdout   # the assumption is said
    res = invoke(runner, cli, "sweep", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "0,16")
    assert res.exit_code == 0, res.output
    res = invoke(runner, cli, "plan", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "16",
                 "--no-store")
    assert res.exit_code == 0, res.output


def test_a_replica_count_that_does_not_fit_says_which_do(runner, cli, noshape):
    res = invoke(runner, cli, "replay", noshape, "--ranks", "16", "--policy", "eplb-global", "--replicas", "8")
    assert res.exit_code == 2
    line = _one_line(res)
    assert "store " in line and "--replicas 8" in line
    offered = [int(x) for x in re.search(r"use --replicas ([\d, ]+)", line).group(1).split(",") if x.strip()]
    # independently: every offered count fills the ranks evenly, and none is skipped
    assert offered == [r for r in range(0, 3 * 16) if (E + r) % 16 == 0][:3]


def test_format_names_users_type_and_a_wrong_one_says_what_the_file_looks_like(runner, cli, tmp_path):
    src = _csv(tmp_path / "l.csv")
    res = invoke(runner, cli, "ingest", src, "--store", tmp_path / "a", "--format", "csv")
    assert res.exit_code == 0, res.output
    res = invoke(runner, cli, "ingest", src, "--store", tmp_path / "b", "--format", "cvs")
    assert res.exit_code == 2 and "generic" in _one_line(res) and "csv" in _one_line(res)
    jsonl = tmp_path / "router_trace_rank0.jsonl"
    from .helpers import REPO

    jsonl.write_bytes((REPO / "sample_traces" / "megatron_trace" / "router_trace_rank0.jsonl").read_bytes())
    res = invoke(runner, cli, "ingest", jsonl, "--store", tmp_path / "c", "--format", "sglang")
    assert res.exit_code == 2
    assert "looks like megatron: use --format megatron" in _one_line(res)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args", [
    ("replay", "--policy", "eplb-global", "--replicas", "16"),           # no ranks anywhere
    ("replay", "--ranks", "16", "--policy", "eplb", "--replicas", "16"),  # hierarchical EPLB without groups
])
def test_every_refusal_on_the_path_is_one_actionable_line(runner, cli, noshape, args):
    res = invoke(runner, cli, args[0], noshape, *args[1:])
    assert res.exit_code == 2
    line = _one_line(res)
    assert "--ranks" in line or "--groups" in line

"""DeepEP diagnosis counters: the samples ingest with counts equal to numpy over the raw
arrays, the wait matrix sits beside the timeline's, bad files are one-line exit-2 refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetrace.collect import collect, detect, ingest
from moetrace.run import Store

from .helpers import invoke, run_row, tree_hash

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"
R, EL = 4, 4


def _raw():
    """The per-rank sample arrays, read with numpy alone."""
    recv, disp, comb = [], [], []
    for r in range(R):
        with np.load(SAMPLES / "deepep" / f"rank{r}.npz") as z:
            recv.append(z["cumulative_local_expert_recv_stats"])
            disp.append(z["dispatch_wait_recv_cost_stats"])
            comb.append(z["combine_wait_recv_cost_stats"])
    return np.stack(recv), np.stack(disp), np.stack(comb)


def test_detected():
    assert detect(SAMPLES / "deepep" / "rank0.npz").name == "deepep"
    assert detect(SAMPLES / "deepep_gathered.safetensors").name == "deepep"


@pytest.mark.parametrize("src", ["deepep", "deepep_gathered.safetensors"])
def test_counts_equal_numpy(src, tmp_path):
    recv, disp, comb = _raw()
    st = Store(tmp_path / "st", create=True)
    rid = ingest(st, [SAMPLES / src], options={"clock_ghz": "2.0"})[0].run_id
    load = st.sql("SELECT expert, tokens FROM expert_load WHERE run_id = ? ORDER BY expert", [rid])
    assert load["expert"].to_list() == list(range(R * EL))
    assert load["tokens"].to_list() == recv.reshape(-1).tolist()        # expert = rank * 4 + local
    w = st.sql("SELECT phase, rank, src_rank, cycles, wait_ns, stat FROM deepep_waits WHERE run_id = ? "
               "ORDER BY phase, rank, src_rank", [rid])
    got = {ph: np.array(w.filter(w["phase"] == ph)["cycles"].to_list()).reshape(R, R) for ph in ("combine", "dispatch")}
    assert np.array_equal(got["dispatch"], disp) and np.array_equal(got["combine"], comb)
    assert w["wait_ns"].to_list() == pytest.approx((np.concatenate([comb.ravel(), disp.ravel()]) / 2.0).tolist())
    assert set(w["stat"]) == {"sum"}
    # blame: column sums off the diagonal, by hand
    off = (disp + comb) * (1 - np.eye(R, dtype=np.int64))
    col = off.sum(axis=0)
    b = st.sql("SELECT rank, cycles, share, blame_rank FROM deepep_wait_blame WHERE run_id = ? ORDER BY rank", [rid])
    assert b["cycles"].to_list() == col.tolist()
    assert b["share"].to_list() == pytest.approx((col / col.sum()).tolist())
    assert b.filter(b["blame_rank"] == 1)["rank"].to_list() == [int(np.argmax(col))] == [2]
    run = st.run_row(rid)
    assert (run["num_ranks"], run["num_experts"], run["num_layers"]) == (R, R * EL, 1)
    assert any("atomicAdd" in a for a in json.loads(run["approximations"]))


def test_max_semantics_and_no_clock(tmp_path):
    rd = collect([SAMPLES / "deepep"], options={"deepep_stat": "max"})[0]
    t = rd.tables["deepep_waits"]
    assert set(t.column("stat").to_pylist()) == {"max"} and t.column("wait_ns").null_count == t.num_rows
    assert any("atomicMax" in a and "wait_ns empty" in a for a in json.loads(rd.run["approximations"]))


def _timeline_store(tmp_path, late_rank: int):
    """A store with a 4-rank timeline run whose all-to-alls wait for ``late_rank`` (it
    starts 500 ns after the others), plus the DeepEP sample as run 'dep'."""
    import pyarrow as pa

    st = Store(tmp_path / "st", create=True)
    rank, start, end = [], [], []
    for seq in range(3):
        for r in range(R):
            s0 = 1_000_000 * seq + (500 if r == late_rank else 0)
            rank.append(r), start.append(s0), end.append(1_000_000 * seq + 2000)
    n = len(rank)
    spans = pa.table({"rank": pa.array(rank, pa.int32()), "device": pa.array(rank, pa.int32()),
                      "stream": pa.array([7] * n, pa.int32()), "kind": ["dispatch"] * n,
                      "name_id": pa.array([0] * n, pa.int32()), "start_ns": start, "end_ns": end,
                      "step": [0] * n, "layer": pa.array([0] * n, pa.int32()), "micro_batch": pa.array([0] * n, pa.int32()),
                      "inferred": [False] * n, "correlation": pa.nulls(n, pa.int64()),
                      "collective": pa.nulls(n, pa.string()), "process_group": pa.nulls(n, pa.string()),
                      "classified_by": pa.nulls(n, pa.string()), "moe_context": pa.nulls(n, pa.string())})
    names = pa.table({"name_id": pa.array([0], pa.int32()), "name": ["deepep_dispatch"], "kind": ["dispatch"],
                      "classified_by": pa.nulls(1, pa.string())})
    st.write_run(run_row(source="timeline", source_sha256="t" * 64, time_base="ns", num_ranks=R), {"spans": spans, "kernel_names": names}, run_id="timeline")
    ingest(st, [SAMPLES / "deepep"], run_id="dep")
    return st


@pytest.mark.parametrize("late, disagree", [(2, False), (1, True)])
def test_compare_with_timeline(tmp_path, late, disagree):
    st = _timeline_store(tmp_path, late)
    top = st.sql("SELECT rank FROM rank_wait_summary WHERE run_id = 'timeline' ORDER BY caused_wait_ns DESC LIMIT 1")
    assert top["rank"].to_list() == [late]
    c = st.sql("SELECT * FROM deepep_wait_compare WHERE deepep_run = 'dep' AND timeline_run = 'timeline' ORDER BY rank")
    assert c.height == R and c["deepep_top"].to_list() == [2] * R and c["timeline_top"].to_list() == [late] * R
    assert c["top_disagree"].to_list() == [disagree] * R
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import deepep

    out = tmp_path / "rep"
    out.mkdir()
    sec = deepep.build(ReportContext(st, "dep", st.run_row("dep"), out))
    assert "charge **rank 2**" in sec.markdown
    assert ("**disagree**" in sec.markdown) == disagree


def _bad(tmp_path, name, **arrays):
    p = tmp_path / name
    np.savez(p, **arrays)
    return p


@pytest.mark.parametrize("arrays, name, message", [
    ({"dispatch_wait_recv_cost_stats": np.zeros((4, 3), np.int64)}, "all.npz", "[ranks, ranks]"),
    ({"cumulative_local_expert_recv_stats": np.array([1, -2, 3], np.int32)}, "rank0.npz", "negative count -2"),
    ({"cumulative_local_expert_recv_stats": np.array([1, 2**50], np.int64)}, "rank0.npz", "beyond the largest count"),
    ({"cumulative_local_expert_recv_stats": np.array([1.5, 2.0])}, "rank0.npz", "expected integer counts"),
    ({"cumulative_local_expert_recv_stats": np.array([1, 2], np.int32)}, "counters.npz", "names the rank"),
    ({"dispatch_wait_recv_cost_stats": np.zeros((2, 2, 2, 2), np.int64)}, "all.npz", "has shape [2, 2, 2, 2]"),
])
def test_bad_files_refused_store_unchanged(tmp_path, runner, cli, arrays, name, message):
    p = _bad(tmp_path, name, **arrays)
    st = tmp_path / "st"
    Store(st, create=True)
    before = tree_hash(st)
    res = invoke(runner, cli, "ingest", p, "--store", st, "--format", "deepep")
    assert res.exit_code == 2, res.output
    assert message in res.output and p.name in res.output and len(res.output.strip().splitlines()) == 1
    assert tree_hash(st) == before


def test_pickled_npz_refused(tmp_path, runner, cli):
    p = tmp_path / "rank0.npz"
    np.savez(p, cumulative_local_expert_recv_stats=np.array([{"x": 1}], dtype=object))
    res = invoke(runner, cli, "ingest", p, "--store", tmp_path / "st", "--format", "deepep")
    assert res.exit_code == 2 and "pickle" in res.output

"""Who waited for whom (storage/sql/45_rank_waits.sql, analyze/waits.py, `moetrace waits`,
the report's wait section) against numbers worked out by hand on crafted traces, and on
the real nccl_a2a_2rank pair against a plain Python pairing of the raw trace events."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from moetrace.analyze.waits import wait_result
from moetrace.run import Store

from .helpers import shared_data
from .helpers.kineto_trace import DISPATCH, GEMM, ev_x, ingest, kernel, launch, write_trace
from .helpers.waits_trace import _three_ranks


def test_hand_worked_waits_matrix_and_split(tmp_path, runner, cli):
    st = ingest(runner, cli, tmp_path / "st", _three_ranks(tmp_path / "run"))
    res = wait_result(st, st.resolve_run(None))
    assert res.coverage["matched"] == 2 and res.coverage["unmatched"] == 0
    inst = res.instances.sort("first_arrival_ns")
    assert inst["last_rank"].to_list() == [1, 2]
    assert inst["arrival_spread_ns"].to_list() == [30_000, 50_000]
    # rank 0 waited 30 µs for rank 1 (dispatch) and 50 µs for rank 2 (combine); rank 2
    # waited 20 µs for rank 1; rank 1 waited 50 µs for rank 2
    mat = {(r, f): ns for r, f, ns in res.matrix.select("rank", "waited_for", "wait_ns").iter_rows()}
    assert mat == {(0, 1): 30_000, (2, 1): 20_000, (0, 2): 50_000, (1, 2): 50_000}
    ranks, w = res.matrix_array()
    assert ranks == [0, 1, 2] and w.sum() == 150_000 and w[0, 2] == 50_000
    by = {r["rank"]: r for r in res.ranks.to_dicts()}
    assert by[1]["caused_wait_ns"] == 50_000 and by[2]["caused_wait_ns"] == 100_000 and by[0]["caused_wait_ns"] == 0
    assert [by[r]["times_last"] for r in (0, 1, 2)] == [0, 1, 1]
    # transfer after the last arrival: dispatch 200-130 = 70, combine 400-350 = 50 µs per rank
    assert all(by[r]["transfer_ns"] == 120_000 for r in (0, 1, 2))
    # the GEMM [100, 120] on rank 0 hides 20 of its 30 µs dispatch wait; nothing else is hidden
    assert by[0]["exposed_wait_ns"] == 10_000 + 50_000
    assert by[1]["exposed_wait_ns"] == by[1]["wait_ns"] == 50_000
    assert all(by[r]["exposed_transfer_ns"] == 120_000 for r in (0, 1, 2))
    assert res.top_culprit()["rank"] == 2 and res.clock_inconsistent == 0


def test_unmatched_instances_are_counted_and_said(tmp_path, runner, cli):
    st = ingest(runner, cli, tmp_path / "st", _three_ranks(tmp_path / "run", extra_rank0=True))
    rid = st.resolve_run(None)
    res = wait_result(st, rid)
    assert (res.coverage["matched"], res.coverage["unmatched"], res.coverage["unmatched_ranks_missing"]) == (2, 1, 1)
    assert "1 unmatched" in res.coverage_message() and "ranks missing" in res.coverage_message()
    out = runner.invoke(cli, ["waits", str(tmp_path / "st"), "--by", "matrix"])
    assert out.exit_code == 0, out.output
    assert "2 of 3 collective instances matched" in out.output and "rank 2 made the others wait most" in out.output


def test_host_collectives_on_gloo_worker_threads_form_one_lane(tmp_path, runner, cli):
    """gloo runs a rank's collectives on either of two worker threads: the thread id must
    not split the order (2 ranks, all-to-alls at known µs, tids alternating)."""
    folder = tmp_path / "run"
    folder.mkdir()
    starts = {0: [10, 100, 200], 1: [40, 100, 230]}
    for r, ss in starts.items():
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000)]
        for i, s in enumerate(ss):
            ev.append(ev_x("cpu_op", "gloo:all_to_all", s, 300 - s if i == 2 else (60 if i == 0 else 50),
                           tid=7 + (i + r) % 2))
        write_trace(folder / f"rank{r}_trace.json", ev, rank=r, world=2)
    st = ingest(runner, cli, tmp_path / "st", folder)
    res = wait_result(st, st.resolve_run(None))
    assert res.coverage["matched"] == 3
    mat = {(r, f): ns for r, f, ns in res.matrix.select("rank", "waited_for", "wait_ns").iter_rows()}
    assert mat == {(0, 1): 30_000 + 30_000}   # instance 1: both at 100 (tie: no wait)


AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
A2A = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
# (all-reduce arrival, all-to-all arrival) in µs; TP groups {0, 1} (pg "1") and {2, 3}
# (pg "2"), EP group {0, 1, 2, 3} (pg "3"); every collective on stream 20 of its rank
PG_ARRIVE = {0: (100, 300), 1: (130, 310), 2: (110, 305), 3: (170, 320)}


def _two_tp_groups(folder: Path, with_pg: bool = True, ranks_only: bool = False) -> Path:
    folder.mkdir()
    for r, (ar, a2a) in PG_ARRIVE.items():
        tp = "1" if r < 2 else "2"
        tp_ranks = [0, 1] if r < 2 else [2, 3]

        def meta(coll, pg, ranks):
            m = {"Collective name": coll}
            if with_pg:
                m.update({"Process Group Ranks": ranks} if ranks_only else
                         {"Process Group Name": pg, "Process Group Ranks": str(ranks)})
            return m
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
              kernel(AR, ar, (200 if r < 2 else 250) - ar, 10 * r + 1, stream=20, device=r,
                     **meta("allreduce", tp, tp_ranks)),
              kernel(A2A, a2a, 400 - a2a, 10 * r + 2, stream=20, device=r, **meta("all_to_all", "3", [0, 1, 2, 3]))]
        write_trace(folder / f"rank{r}_trace.json", ev, rank=r, world=4)
    return folder


def _matrix(res) -> dict:
    return {(r, f): ns for r, f, ns in res.matrix.select("rank", "waited_for", "wait_ns").iter_rows()}


def test_process_groups_keep_two_tp_groups_apart(tmp_path, runner, cli):
    """Two TP groups all-reduce on the same stream position of their ranks: matched within
    each group (rank 0 waits 30 µs for rank 1, rank 2 60 µs for rank 3), never across; the
    EP all-to-all over all four ranks waits for rank 3 (20, 10, 15 µs)."""
    st = ingest(runner, cli, tmp_path / "st", _two_tp_groups(tmp_path / "run"))
    rid = st.resolve_run(None)
    res = wait_result(st, rid)
    assert (res.coverage["matched"], res.coverage["unmatched"], res.coverage["matched_group_inferred"]) == (3, 0, 0)
    assert sorted(res.instances.select("grp", "ranks").iter_rows()) == [("pg 1", 2), ("pg 2", 2), ("pg 3", 4)]
    assert _matrix(res) == {(0, 1): 30_000, (2, 3): 60_000 + 15_000, (0, 3): 20_000, (1, 3): 10_000}
    pgs = st.sql("SELECT DISTINCT rank, process_group FROM spans WHERE run_id = ? ORDER BY ALL", [rid]).rows()
    assert pgs == [(0, "1"), (0, "3"), (1, "1"), (1, "3"), (2, "2"), (2, "3"), (3, "2"), (3, "3")]
    # net per instance: the all-reduce of group {2, 3} has one peer: rank 3 is 60 µs late
    iw = st.sql("SELECT grp, rank, net_ns FROM instance_waits WHERE run_id = ? AND coll_key = 'all_reduce'", [rid])
    assert dict(((g, r), n) for g, r, n in iw.iter_rows())[("pg 2", 3)] == 60_000
    # the EP all-to-all: rank 3 caused 20 + 10 + 15 µs over 3 peers
    iw = st.sql("SELECT rank, net_ns FROM instance_waits WHERE run_id = ? AND grp = 'pg 3'", [rid])
    assert dict(iw.iter_rows())[3] == pytest.approx(45_000 / 3)


def test_without_process_groups_matching_falls_back_to_lanes_and_says_so(tmp_path, runner, cli):
    """The same trace without group names: the n-th all-reduce is paired across all four
    ranks (the old lane matching; rank 3, last at 170 µs, is charged 70 + 40 + 60 µs), and
    the data says the grouping was inferred."""
    st = ingest(runner, cli, tmp_path / "st", _two_tp_groups(tmp_path / "run", with_pg=False))
    res = wait_result(st, st.resolve_run(None))
    assert res.coverage["matched"] == 2 and res.coverage["matched_group_inferred"] == 2
    assert _matrix(res) == {(0, 3): 70_000 + 20_000, (1, 3): 40_000 + 10_000, (2, 3): 60_000 + 15_000}
    assert "process group" in res.coverage_message() and "inferred" in res.coverage_message()


def test_process_group_from_the_record_param_comms_around_the_launch(tmp_path, runner, cli):
    """Kernels without group args take the group of the record_param_comms op (same
    thread) whose span holds their launch: the two TP groups are kept apart again."""
    folder = tmp_path / "run"
    folder.mkdir()
    for r, (ar, _) in PG_ARRIVE.items():
        tp = "1" if r < 2 else "2"
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
              ev_x("cpu_op", "record_param_comms", 40, 10, **{"Collective name": "allreduce",
                                                             "Process Group Name": tp}),
              launch(45, 10 * r + 1),
              kernel(AR, ar, (200 if r < 2 else 250) - ar, 10 * r + 1, stream=20, device=r,
                     **{"Collective name": "allreduce"})]
        write_trace(folder / f"rank{r}_trace.json", ev, rank=r, world=4)
    st = ingest(runner, cli, tmp_path / "st", folder)
    rid = st.resolve_run(None)
    assert set(st.sql("SELECT process_group FROM spans WHERE run_id = ? AND collective IS NOT NULL",
                      [rid])["process_group"]) == {"1", "2"}
    res = wait_result(st, rid)
    assert res.coverage["matched_group_inferred"] == 0
    assert _matrix(res) == {(0, 1): 30_000, (2, 3): 60_000}


def test_process_group_from_its_ranks_when_unnamed(tmp_path, runner, cli):
    st = ingest(runner, cli, tmp_path / "st", _two_tp_groups(tmp_path / "run", ranks_only=True))
    rid = st.resolve_run(None)
    got = set(st.sql("SELECT DISTINCT process_group FROM spans WHERE run_id = ?", [rid])["process_group"])
    assert got == {"ranks [0,1]", "ranks [2,3]", "ranks [0,1,2,3]"}
    assert _matrix(wait_result(st, rid))[(0, 1)] == 30_000


def test_odd_process_group_args_are_not_read_and_do_not_refuse_the_trace(tmp_path, runner, cli):
    """A group name that is an object, ranks that are not a list of ints, a pg_config that
    is not a list: the group is not read (NULL, matched by lane), the trace is ingested."""
    folder = tmp_path / "run"
    folder.mkdir()
    for r, s in ((0, 100), (1, 130)):
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
              kernel(AR, s, 200 - s, r + 1, stream=20, device=r,
                     **{"Collective name": "allreduce", "Process Group Name": {"x": 1}, "Process Group Ranks": "?"})]
        text = ('{"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": %d, "world_size": 2, '
                '"pg_config": {"not": "a list"}}, "traceEvents": [\n%s\n]}' % (r, ",\n".join(ev)))
        (folder / f"rank{r}_trace.json").write_text(text)
    st = ingest(runner, cli, tmp_path / "st", folder)
    rid = st.resolve_run(None)
    assert st.sql("SELECT count(*) AS n FROM spans WHERE run_id = ? AND process_group IS NOT NULL", [rid])["n"][0] == 0
    res = wait_result(st, rid)
    assert res.coverage["matched_group_inferred"] == 1 and _matrix(res) == {(0, 1): 30_000}


def test_single_group_of_pg_config_is_said(tmp_path, runner, cli):
    """A CPU-only (gloo) trace names no group per op; its distributedInfo.pg_config lists
    one, so every collective is in it: filled in, and said in runs.approximations."""
    folder = tmp_path / "run"
    folder.mkdir()
    for r, s in ((0, 10), (1, 40)):
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000), ev_x("cpu_op", "gloo:all_to_all", s, 100 - s)]
        text = ('{"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": %d, "world_size": 2, '
                '"pg_count": 1, "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1]}]}, '
                '"traceEvents": [\n%s\n]}' % (r, ",\n".join(ev)))
        (folder / f"rank{r}_trace.json").write_text(text)
    st = ingest(runner, cli, tmp_path / "st", folder)
    rid = st.resolve_run(None)
    assert set(st.sql("SELECT process_group FROM spans WHERE run_id = ? AND collective IS NOT NULL",
                      [rid])["process_group"]) == {"0"}
    assert any("pg_config" in a for a in st.run(rid).approximations)
    assert _matrix(wait_result(st, rid)) == {(0, 1): 30_000}


def _independent_nccl_waits(folder: Path) -> dict:
    """Plain Python over the raw events: each NCCL kernel's collective from the innermost
    'nccl:' CPU op around its launch (correlation id), kernels paired across ranks per
    (stream, collective) in start order; wait of each rank = latest start - own start."""
    per_rank = {}
    for rank in (0, 1):
        ev = json.loads(gzip.open(folder / f"rank-{rank}.json.gz").read())["traceEvents"]
        ops = [e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("nccl:")]
        launch = {e["args"]["correlation"]: e for e in ev
                  if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
        seqs: dict = {}
        for k in sorted((e for e in ev if e.get("cat") == "kernel" and "nccl" in e["name"].lower()),
                        key=lambda e: e["ts"]):
            ln = launch[k["args"]["correlation"]]
            inner = [o for o in ops if o["tid"] == ln["tid"] and o["ts"] <= ln["ts"] <= o["ts"] + o["dur"]]
            if not inner:   # launched outside the op's thread: the op enclosing the launch time on any thread
                inner = [o for o in ops if o["ts"] <= ln["ts"] <= o["ts"] + o["dur"]]
            coll = max(inner, key=lambda o: o["ts"])["name"].split(":")[-1]
            coll = "all_to_all" if coll.startswith("all_to_all") else coll
            seqs.setdefault((k["args"]["stream"], coll), []).append(round(k["ts"] * 1000))
        per_rank[rank] = seqs
    waits = {(0, 1): 0, (1, 0): 0}
    n = 0
    for key, s0 in per_rank[0].items():
        s1 = per_rank[1][key]
        assert len(s0) == len(s1)
        for a0, a1 in zip(s0, s1):
            n += 1
            if a1 > a0:
                waits[(0, 1)] += a1 - a0
            elif a0 > a1:
                waits[(1, 0)] += a0 - a1
    return {"instances": n, "waits": waits}


def test_nccl_2rank_waits_match_raw_trace(tmp_path, runner, cli):
    d = shared_data("nccl_a2a_2rank")
    want = _independent_nccl_waits(d)
    st = ingest(runner, cli, tmp_path / "st", d)
    res = wait_result(st, st.resolve_run(None))
    assert res.coverage["matched"] == want["instances"] == 10 and res.coverage["unmatched"] == 0
    mat = {(r, f): ns for r, f, ns in res.matrix.select("rank", "waited_for", "wait_ns").iter_rows()}
    assert mat == {k: v for k, v in want["waits"].items() if v}
    # this pair's ranks disagree in time: some kernels end before the peer's starts; said, not hidden
    assert res.clock_inconsistent > 0 and "clocks disagree" in res.coverage_message()


def test_waits_shift_steps_names_the_late_rank(tmp_path, runner, cli):
    """Rank 1 reaches the dispatch 50 µs after rank 0 in step 0 and together with it in
    step 1: step 0 against step 1, rank 1's net wait rose 50 µs, rank 0's fell 50 µs."""
    folder = tmp_path / "run"
    folder.mkdir()
    for r in (0, 1):
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000), ev_x("user_annotation", "ProfilerStep#1", 1000, 1000),
              kernel(DISPATCH, 100 + 50 * r, 100 - 50 * r, 10 * r + 1, stream=20, device=r),
              kernel(DISPATCH, 1100, 100, 10 * r + 2, stream=20, device=r)]
        write_trace(folder / f"rank{r}_trace.json", ev, rank=r, world=2)
    ingest(runner, cli, tmp_path / "st", folder)
    out = runner.invoke(cli, ["waits", str(tmp_path / "st"), "--shift-steps", "0", "--by", "instance",
                              "--format", "json"])
    assert out.exit_code == 0, out.output
    rows = {r["rank"]: r["shift_ms"] for r in json.loads(out.output)}
    assert rows == {0: -0.05, 1: 0.05}
    out = runner.invoke(cli, ["waits", str(tmp_path / "st"), "--shift-steps", "even"])
    assert out.exit_code == 0 and "largest rise: rank 1: +0.050 ms" in out.output, out.output
    bad = runner.invoke(cli, ["waits", str(tmp_path / "st"), "--shift-steps", "x"])
    assert bad.exit_code == 2


def test_report_section_draws_the_heatmap(tmp_path, runner, cli):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import waits

    st = ingest(runner, cli, tmp_path / "st", _three_ranks(tmp_path / "run"))
    rid = st.resolve_run(None)
    sec = waits.build(ReportContext(st, rid, st.run_row(rid), tmp_path / "rep"))
    assert sec is not None and sec.figures and sec.figures[0].path.exists()
    assert "Rank 2 made the others wait most: 0.10 ms" in sec.markdown


def test_no_collectives_says_so(tmp_path, runner, cli):
    folder = tmp_path / "one"
    folder.mkdir()
    write_trace(folder / "rank0_trace.json", [ev_x("user_annotation", "ProfilerStep#0", 0, 100),
                                              kernel(GEMM, 10, 5, 1)], rank=0, world=1)
    ingest(runner, cli, tmp_path / "st", folder / "rank0_trace.json")
    out = runner.invoke(cli, ["waits", str(tmp_path / "st")])
    assert out.exit_code == 0 and "nothing to align" in out.output


# ---------------------------------------------------------------- a known cause
DELAY_US = 10_000.0


@pytest.mark.slow
def test_injected_delay_is_attributed_to_its_rank_and_recovered(tmp_path, forked_ranks):
    """refrun with rank 1 held DELAY µs before the first dispatch of every layer in the
    even steps (``delay_every=2``); the odd steps are the control, interleaved with the
    delayed ones under the same machine load and the same traffic. The per-position wait
    shift (even minus odd steps) must peak at rank 1, at the layer's first all-to-all (the
    dispatch right after the delay), and equal the delay rank 1 really held (the manifest's
    ``injected_delay.held_mean_us``, measured around the sleep: on a loaded machine the OS
    wakes the sleeper late, so it exceeds the requested DELAY) within 3 of its standard
    errors (the noise measured in the run), with a floor of 20% of it: once awake, rank 1
    still has to get a core to reach its collective, and with every core busy that adds
    a scheduler slice or so (1.28 ms seen on a 10 ms hold with two suites sharing 2 cores;
    the hold itself was 0.2 µs late). The per-layer shift must name rank 1 too and hold
    the same tolerance."""
    pytest.importorskip("torch", reason="the reference run needs PyTorch")
    from moetrace.analyze.waits import wait_shift
    from moetrace.collect import ingest as ingest_paths
    from moetrace.produce.refrun import RefRunConfig, run

    st = Store(tmp_path / "st", create=True)
    cfg = RefRunConfig(ranks=2, experts=4, top_k=2, layers=2, hidden=64, ffn=128, steps=8, tokens_per_rank=16,
                       seed=5, delay_rank=1, delay_us=DELAY_US, delay_every=2, progress=False)
    man = run(cfg, tmp_path / "late")
    held = man["injected_delay"]
    assert held["rank"] == 1 and held["n"] == 4 * 2          # 4 delayed steps x 2 layers
    assert held["requested_us"] == DELAY_US <= held["held_mean_us"] <= held["held_max_us"]
    rid = ingest_paths(st, [tmp_path / "late"])[0].run_id
    assert wait_result(st, rid).coverage["unmatched"] == 0
    delayed = range(0, cfg.steps, 2)
    pos = wait_shift(st, rid, delayed, by="position")
    top = pos.top()
    assert (top["rank"], top["coll_key"], top["pos"], top["kind"]) == (1, "all_to_all", 0, "dispatch")
    assert top["n_a"] == top["n_b"] == 8                  # 4 steps x 2 layers on each side
    d = held["held_mean_us"] * 1000
    assert abs(top["shift_ns"] - d) <= max(3 * top["se_ns"], 0.2 * d), top
    lay = wait_shift(st, rid, delayed)
    assert lay.straggler == 1
    r1 = lay.top()
    assert abs(r1["shift_ns"] - d) <= max(3 * r1["se_ns"], 0.2 * d), r1

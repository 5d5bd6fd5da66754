"""All-to-all exposure views against independent interval arithmetic: closed-form crafted
traces, a straggler pair, the DeepSeek trace against a plain Python sweep, and the views
in the plain duckdb CLI (catalog.duckdb)."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import shared_data
from .helpers.intervals import overlap, union
from .helpers.kineto_trace import COMBINE, DISPATCH, GEMM, ev_x, ingest, kernel, launch, write_trace

OTHER = "void at::native::elementwise_kernel<128>(int)"


def test_closed_form_exposure(tmp_path, runner, cli):
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 10000),
          ev_x("user_annotation", "dispatch layer 0", 1, 5), launch(2, 1), launch(3, 2),
          ev_x("user_annotation", "combine layer 0", 10, 5), launch(11, 3),
          launch(20, 10), launch(21, 11), launch(22, 12), launch(23, 13), launch(24, 14), launch(25, 15),
          # dispatch: two kernels of one group on two streams, union 0..120
          kernel(DISPATCH, 100, 100, 1, stream=20), kernel(DISPATCH, 150, 70, 2, stream=21),
          # compute on the same device: 50..80 and 90..150 µs after 100, plus one nested in them
          kernel(GEMM, 150, 30, 10, stream=7), kernel(OTHER, 190, 60, 11, stream=7),
          kernel(OTHER, 160, 10, 12, stream=8),
          # combine 300..360 µs: only a memcpy and a kernel on another device run meanwhile
          kernel(COMBINE, 300, 60, 3, stream=20),
          ev_x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 310, 10, pid=0, tid=7, device=0, stream=7,
               correlation=13),
          kernel(GEMM, 300, 60, 14, stream=7, device=1),
          kernel(GEMM, 350, 40, 15, stream=7)]  # overlaps the combine's last 10 µs
    st = ingest(runner, cli, tmp_path / "st", write_trace(tmp_path / "t.json", ev, rank=0, world=1))
    rows = {r["kind"]: r for r in st.sql("SELECT * FROM a2a_exposure").to_dicts()}
    assert set(rows) == {"dispatch", "combine"}
    d, c = rows["dispatch"], rows["combine"]
    # dispatch union [100, 220) µs; compute union [150, 180) + [190, 250) µs -> 30 + 30 overlap
    assert (d["comm_ns"], d["overlapped_ns"], d["exposed_ns"]) == (120_000, 60_000, 60_000)
    assert (c["comm_ns"], c["overlapped_ns"], c["exposed_ns"]) == (60_000, 10_000, 50_000)
    assert (d["layer"], d["step"], d["inferred"]) == (0, 0, False)
    summ = st.sql("SELECT * FROM a2a_rank_summary").row(0, named=True)
    assert summ["exposed_ns"] == 110_000 and summ["comm_ns"] == 180_000
    assert summ["exposed_share_of_comm"] == pytest.approx(110 / 180)


def test_straggler_is_the_rank_others_waited_for(tmp_path, runner, cli):
    d = tmp_path / "job"
    d.mkdir()
    # rank 1 computes longer, so it reaches the combine last; rank 0 waits in its combine
    for rank, gemm_dur, comb_start, comb_dur in ((0, 100, 120, 200), (1, 280, 300, 20)):
        ev = [ev_x("user_annotation", "ProfilerStep#7", 0, 10000), launch(1, 1), launch(2, 2), launch(3, 3),
              kernel(DISPATCH, 10, 10, 1, stream=20),
              kernel(GEMM, 20, gemm_dur, 2, stream=7),
              kernel(COMBINE, comb_start, comb_dur, 3, stream=20)]
        write_trace(d / f"rank-{rank}.json", ev, rank=rank, world=2)
    st = ingest(runner, cli, tmp_path / "st", d)
    s = st.sql("SELECT * FROM a2a_stragglers").row(0, named=True)
    assert s["step"] == 7 and s["ranks"] == 2
    assert s["last_arrival_rank"] == 1
    assert s["last_arrival_combine_exposed_ns"] == 20_000
    assert s["wait_ns"] == (200_000 + 20_000) // 2 - 20_000
    # the longest step (GPU window: first to last kernel) is rank 1's: 10..320 us against rank 0's 10..320 us
    # -> equal; ties go to the lower rank
    assert (s["longest_step_rank"], s["longest_step_ns"]) == (0, 310_000)
    assert s["token_straggler_rank"] is None          # no expert_load in a profiler trace
    res = runner.invoke(cli, ["exposure", str(tmp_path / "st"), "--by", "straggler", "--format", "json"])
    assert json.loads(res.output)[0]["last_arrival_rank"] == 1


def test_collectives_without_a_cpu_op_are_counted_not_dropped(tmp_path, runner, cli):
    """A SendRecv kernel with no launch record cannot be told apart (all-to-all or not): it is
    counted in a2a_presence and the report says so."""
    send = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 10000), launch(1, 1), launch(2, 2),
          ev_x("cpu_op", "nccl:all_to_all", 1, 5), launch(3, 3),
          kernel(GEMM, 20, 100, 1), kernel(DISPATCH, 130, 40, 3, stream=20),
          kernel(send, 200, 25, 77, stream=21), kernel(send, 300, 5, 78, stream=21)]   # correlation 77, 78: no launch
    p = tmp_path / "t.json"
    from .helpers.kineto_trace import write_trace as wt
    wt(p, ev, rank=0, world=1)
    st = ingest(runner, cli, tmp_path / "st", p)
    pres = st.sql("SELECT * FROM a2a_presence").row(0, named=True)
    assert (pres["unlabelled_comm_spans"], pres["unlabelled_comm_ns"], pres["unlabelled_comm_max_ns"]) == \
        (2, 30_000, 25_000)
    res = runner.invoke(cli, ["report", str(tmp_path / "st"), "--out-dir", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert "2 collective kernel(s) (0.03 ms in all, the longest 0.03 ms) have no CPU-side collective op" in res.output


def test_deepseek_exposure_matches_an_independent_sweep(tmp_path, runner, cli):
    p = shared_data("deepseek_ep64_train_rank0.json.gz")
    doc = json.loads(gzip.open(p).read())
    kernels = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]

    def kind(name):
        if "dpsk::ep::internode::dispatch" in name:
            return "dispatch"
        if "dpsk::ep::internode::combine" in name:
            return "combine"
        if "dpsk::ep::internode::" in name:  # notify_dispatch, cached_notify
            return "a2a_other"
        return "compute"

    iv = {}
    for e in kernels:
        iv.setdefault(kind(e["name"]), []).append((e["ts"] * 1000, (e["ts"] + e["dur"]) * 1000))
    a2a = iv["dispatch"] + iv["combine"] + iv["a2a_other"]
    # precondition of comparing per-kind totals: all-to-all kernels never overlap each other
    assert sum(e - s for s, e in union(a2a)) == sum(e - s for s, e in a2a)
    want = {}
    for k in ("dispatch", "combine", "a2a_other"):
        comm = sum(e - s for s, e in iv[k])
        ov = sum(overlap([x], iv["compute"]) for x in iv[k])
        want[k] = (comm, ov, comm - ov)
    st = ingest(runner, cli, tmp_path / "st", p)
    got = {r["kind"]: (r["c"], r["o"], r["e"]) for r in st.sql(
        "SELECT kind, sum(comm_ns) c, sum(overlapped_ns) o, sum(exposed_ns) e FROM a2a_exposure GROUP BY kind"
    ).to_dicts()}
    assert got == want
    # the capture hides most of the all-to-all: exposed well under a tenth of comm, and not zero
    assert 0 < sum(w[2] for w in want.values()) < 0.1 * sum(w[0] for w in want.values())
    # exposed share of the step: the step is its GPU activity, first to last GPU event (kernel, memcpy,
    # memset) of the trace's one ProfilerStep, not the CPU range (the GPU lags the host)
    gpu = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                       "gpu_memset")]
    start, end = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    summ = st.sql("SELECT * FROM a2a_rank_summary").row(0, named=True)
    assert summ["step_ns"] == (end - start) * 1000
    assert summ["exposed_share_of_step"] == pytest.approx(sum(w[2] for w in want.values()) / summ["step_ns"])
    # per layer: 4 layers in each of the two DualPipe directions, layer inferred from order
    g = st.sql("SELECT count(DISTINCT layer) AS l, count(DISTINCT micro_batch) AS m, bool_and(inferred) AS i "
               "FROM a2a_exposure").row(0, named=True)
    assert g == {"l": 4, "m": 2, "i": True}
    res = runner.invoke(cli, ["exposure", str(tmp_path / "st"), "--by", "kind", "--format", "json"])
    rows = {r["kind"]: r for r in json.loads(res.output)}
    assert rows["combine"]["exposed_ns"] == want["combine"][2]


def test_views_run_in_the_plain_duckdb_cli(tmp_path, runner, cli):
    cand = Path(sys.executable).parent / "duckdb"
    exe = str(cand) if cand.exists() else shutil.which("duckdb")
    if exe is None:
        pytest.skip("duckdb CLI not installed (pip install duckdb-cli, in the test extra)")
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000), launch(1, 1), launch(2, 2),
          kernel(DISPATCH, 10, 100, 1, stream=20), kernel(GEMM, 50, 100, 2, stream=7)]
    st_path = tmp_path / "st"
    st = ingest(runner, cli, st_path, write_trace(tmp_path / "t.json", ev, rank=0, world=1))
    assert runner.invoke(cli, ["catalog", str(st_path)]).exit_code == 0
    q = ("SELECT kind, comm_ns, overlapped_ns, exposed_ns FROM a2a_exposure; "
         "SELECT count(*) FROM a2a_rank_summary; SELECT count(*) FROM a2a_modes; SELECT has_a2a FROM a2a_presence;")
    out = subprocess.run([exe, "-csv", "-noheader", "catalog.duckdb", "-c", q], cwd=st_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "dispatch,100000,60000,40000"
    assert lines[1:] == ["1", "1", "true"]
    assert st.sql("SELECT exposed_ns FROM a2a_exposure")["exposed_ns"][0] == 40_000


def test_report_section(tmp_path, runner, cli):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import exposure as section

    d = tmp_path / "job"
    d.mkdir()
    for rank in (0, 1):
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 10000), launch(1, 1), launch(2, 2), launch(3, 3),
              kernel(DISPATCH, 10, 10, 1, stream=20), kernel(GEMM, 15, 100, 2, stream=7),
              kernel(COMBINE, 120 + 40 * rank, 30, 3, stream=20)]
        write_trace(d / f"rank-{rank}.json", ev, rank=rank, world=2)
    st = ingest(runner, cli, tmp_path / "st", d)
    rid = st.run_ids()[0]
    sec = section.build(ReportContext(store=st, run_id=rid, run=st.run_row(rid), outdir=tmp_path / "out"))
    assert sec.key == "exposure" and len(sec.figures) == 2
    assert all(f.path.exists() and f.path.stat().st_size > 1000 for f in sec.figures)
    # exposed: dispatch 5 of 10 µs per rank, combine 30 µs per rank (no compute after 115 µs)
    tot = st.sql("SELECT sum(exposed_ns) AS e, sum(comm_ns) AS c FROM a2a_exposure").row(0, named=True)
    assert (tot["e"], tot["c"]) == (2 * (5_000 + 30_000), 2 * (10_000 + 30_000))
    assert f"{tot['e'] / 1e6:.2f} ms ({100 * tot['e'] / tot['c']:.1f}%)" in sec.markdown
    # the timeline draws only the kinds the step has: no notify/barrier kernel here, so no such lane
    tl = sec.figures[0].caption
    assert tl.startswith("Timeline") and "dispatch" in tl and "combine" in tl and "notify" not in tl
    (d / "rank-1.json").unlink()
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 10000), launch(1, 1), launch(2, 2),
          kernel(DISPATCH, 10, 10, 1, stream=20), kernel("void deep_ep::intranode::notify_dispatch<8>(int*)", 30, 5, 2)]
    write_trace(d / "rank-0.json", ev, rank=0, world=1)
    st3 = ingest(runner, cli, tmp_path / "st3", d)
    rid3 = st3.run_ids()[0]
    tl3 = section._timeline(ReportContext(store=st3, run_id=rid3, run=st3.run_row(rid3), outdir=tmp_path / "out3"))
    assert "dispatch" in tl3.caption and "notify" in tl3.caption
    assert "compute" not in tl3.caption and "combine" not in tl3.caption
    # a run without spans gets no section; a profiler run without all-to-all gets the plain statement
    plain = write_trace(tmp_path / "dense.json", [ev_x("user_annotation", "ProfilerStep#0", 0, 100), launch(1, 1),
                                                  kernel(GEMM, 10, 10, 1)], rank=0, world=1)
    st2 = ingest(runner, cli, tmp_path / "st2", plain)
    rid2 = st2.run_ids()[0]
    sec2 = section.build(ReportContext(store=st2, run_id=rid2, run=st2.run_row(rid2), outdir=tmp_path / "out2"))
    assert "no all-to-all found" in sec2.markdown and not sec2.figures


def test_inferred_layers_without_a_pair_are_called_positions_not_layers(tmp_path, runner, cli):
    """Three plain all-to-alls in a step (an embedding exchange, say): alternation makes them
    dispatch, combine, dispatch, so 'layer 1' has a dispatch only; the report says these are
    positions in the step, and the per-layer figure title says the layers are inferred."""
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import exposure as section

    from .helpers.kineto_trace import SENDRECV

    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 10000)]
    for i, t in enumerate((10, 200, 400)):
        ev += [ev_x("cpu_op", "nccl:all_to_all", t, 5), launch(t + 1, i + 1), kernel(SENDRECV, t + 50, 40, i + 1)]
    p = tmp_path / "t.json"
    write_trace(p, ev, rank=0, world=1)
    st = ingest(runner, cli, tmp_path / "st", p)
    g = st.sql("SELECT layer, kind FROM a2a_exposure ORDER BY layer, kind").rows()
    assert g == [(0, "combine"), (0, "dispatch"), (1, "dispatch")]
    rid = st.run_ids()[0]
    sec = section.build(ReportContext(store=st, run_id=rid, run=st.run_row(rid), outdir=tmp_path / "out"))
    assert any("1 inferred layer(s) (1) have only a dispatch or only a combine" in n for n in sec.notes)
    assert any("layer numbers inferred from order" in f.caption for f in sec.figures)

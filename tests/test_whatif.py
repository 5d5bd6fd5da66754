"""What-ifs on the recorded timeline (replay/timeline_whatif.py): each model against numbers worked
out by hand, then the store adapter, the command and the report section on a real run."""
from __future__ import annotations

import numpy as np
import pytest

from moetrace.replay.timeline_whatif import disaggregation, domain_sweep, overlap_two_micro_batches


def test_overlap_hand_worked():
    # one step, two layers, two ranks; step 100 ns on both ranks
    # rank 0: exposed [20, 30], combine part [10, 10]; rank 1: exposed [40, 10], combine [20, 4]
    e = np.array([[[20, 40], [30, 10]]], float)          # [S=1, L=2, R=2]
    b = np.array([[[10, 20], [10, 4]]], float)
    step = np.array([[100, 100]], float)
    r = overlap_two_micro_batches([7], step, e, b)
    # compute per layer c = (100 - 50) / 2 = 25 on both ranks
    # rank 0: layer 0 max(0, 20-25) = 0; layer 1 max(0, 30 - 5 - 25) = 0, + 5 (half the last combine) -> 5; step 55
    # rank 1: layer 0 15; layer 1 max(0, 10 - 2 - 25) = 0, + 2 -> 17; step 67
    assert r.before_ns.tolist() == [100.0] and r.after_ns.tolist() == [67.0]
    assert r.exposed_before_ns.tolist() == [50.0] and r.exposed_after_ns.tolist() == [11.0]
    # each expert run twice on half the tokens: +5 ns per layer -> c' = 30
    r = overlap_two_micro_batches([7], step, e, b, split_extra_ns=5)
    # rank 0: 0 + 0 + 5 -> 60 + 5 = 65; rank 1: 10 + 0 + 2 -> 60 + 12 = 72
    assert r.after_ns.tolist() == [72.0] and r.exposed_after_ns.tolist() == [8.5]
    assert "two equal micro-batches" in r.assumptions
    # the all-to-all's fixed latency is paid again by the second micro-batch
    one = overlap_two_micro_batches([0], [[100.0]], [[[20.0]]], [[[10.0]]], a2a_latency_ns=30)
    # c = 80; hideable 20 + 30 - 5 = 45 <= 80 -> only half the combine: 80 + 5
    assert one.after_ns.tolist() == [85.0]
    one = overlap_two_micro_batches([0], [[100.0]], [[[20.0]]], [[[10.0]]], a2a_latency_ns=90)
    # hideable 105 - 80 = 25 stays, + 5 -> 80 + 30 = 110 (slower than one micro-batch)
    assert one.after_ns.tolist() == [110.0] and one.exposed_after_ns.tolist() == [30.0]


def test_overlap_never_hides_more_than_there_is():
    # all compute, no all-to-all: nothing changes; all all-to-all, no compute: nothing hides
    e0 = np.zeros((2, 3, 4))
    r = overlap_two_micro_batches([0, 1], np.full((2, 4), 90.0), e0, e0)
    assert r.after_ns.tolist() == [90.0, 90.0] and r.exposed_after_ns.tolist() == [0.0, 0.0]
    e = np.full((1, 3, 4), 30.0)
    r = overlap_two_micro_batches([0], np.full((1, 4), 90.0), e, e / 2)
    assert r.after_ns.tolist() == [90.0]


def test_disaggregation_hand_worked():
    # B = 1024 tokens, 4 GPUs, attention 1 ns/token, experts 3 ns/token, transfer 0.5 ns/token
    # co-located: 1024/4 * (1 + 3 + 2*0.5) = 1280 ns per layer -> 1024 / 1280 ns / 4 GPUs = 2.0e8 tok/s/GPU
    # M=1, N=3: Ta = Te = 1024/m, Tc = 512/m; round trip 3072/m; layer max(1024, 3072/m) -> 1024 from m = 3
    #   -> 1024 / 1024 ns / 4 = 2.5e8 tok/s/GPU (1.25x). M=2,N=2: Te = 1536/m -> 1536; M=3,N=1: 3072.
    r = disaggregation(1024, 4, ta_ns=1.0, te_ns=3.0, tc_ns=0.5)
    assert (r.best.attn_gpus, r.best.expert_gpus, r.best.micro_batches) == (1, 3, 3)
    assert r.best.layer_ns == pytest.approx(1024.0)
    assert r.colocated_layer_ns == pytest.approx(1280.0)
    assert r.colocated_tokens_per_gpu_s == pytest.approx(2.0e8)
    assert r.best.tokens_per_gpu_s == pytest.approx(2.5e8)
    assert r.gain == pytest.approx(1.25) and r.min_micro_batches == 3
    two = [c for c in r.candidates if (c.attn_gpus, c.micro_batches) == (1, 2)][0]
    assert two.layer_ns == pytest.approx(1536.0)          # m = 2 cannot cover the round trip 512+512+2*256


def test_disaggregation_fixed_costs_favour_fewer_micro_batches():
    # a fixed 100 ns per micro-batch on each side: M=1, N=3, m=3 -> Ta = Te = 441.33, Tc = 170.67,
    # layer max(3 * 441.33, 441.33*2 + 341.33) = 1324; m=2 -> Ta = Te = 612, Tc = 256: max(1224, 1736) = 1736
    r = disaggregation(1024, 4, 1.0, 3.0, 0.5, fa_ns=100.0, fe_ns=100.0)
    c = {(x.attn_gpus, x.micro_batches): x for x in r.candidates}
    assert c[(1, 3)].layer_ns == pytest.approx(3 * (100 + 1024 / 3))
    assert c[(1, 2)].layer_ns == pytest.approx(612 + 612 + 2 * 256)
    assert r.colocated_layer_ns == pytest.approx(200 + 1280)


def test_domain_sweep_hand_worked():
    # 4 ranks each send 10 tokens to every other rank, 100 bytes per token; NVLink 1 B/ns, NIC 0.1 B/ns
    tr = np.full((1, 1, 4, 4), 10.0)
    res = {d.domain_size: d for d in domain_sweep(tr, 100, [1, 2, 4, 8], 1e9, 1e8)}
    # D=2: 1000 B inside, 2000 B across per rank -> 1000 + 20000 ns, x2 (combine) = 42000
    assert (res[2].intra_bytes, res[2].inter_bytes) == (4000.0, 8000.0)
    assert res[2].a2a_ns_per_step == pytest.approx(42000.0) and res[2].inter_share == pytest.approx(2 / 3)
    assert res[1].a2a_ns_per_step == pytest.approx(60000.0) and res[1].domains == 4
    assert res[4].a2a_ns_per_step == pytest.approx(6000.0) and res[4].inter_bytes == 0.0
    assert res[8].a2a_ns_per_step == pytest.approx(6000.0) and res[8].domains == 1


# ---------------------------------------------------------------- store adapter, command, report
def test_overlap_on_a_crafted_trace_through_the_command(tmp_path, runner, cli):
    import json

    from moetrace.run import Store

    from .helpers.kineto_trace import ingest
    from .helpers.waits_trace import _three_ranks

    ingest(runner, cli, tmp_path / "st", _three_ranks(tmp_path / "run"))
    res = runner.invoke(cli, ["whatif", str(tmp_path / "st"), "--only", "overlap", "--a2a-latency-us", "0", "--chrome-trace",
                              str(tmp_path / "ov.json")])
    assert res.exit_code == 0, res.output
    # step 0 on each rank: first kernel to last (no launches inside the ProfilerStep range):
    # rank 0 100..400, rank 1 130..400, rank 2 110..400 µs; one layer. Exposed (dispatch + combine):
    # rank 0: 80 (a GEMM hides 20 of [100, 200]) + 100 = 180, combine 100; rank 1: 70 + 100, combine 100;
    # rank 2: 90 + 50, combine 50. c = step - e = 120, 100, 150; hideable e - b/2 = 130, 120, 115;
    # exposed after = max(0, hideable - c) + b/2 = 10 + 50, 20 + 50, 0 + 25; step after = c + that
    # = 180, 170, 175 -> 180 µs (slowest rank), before 300; exposed mean 490/3 -> 155/3 µs
    rows = Store(tmp_path / "st").sql("""SELECT metric, before, after FROM replay_whatif
                                         WHERE kind = 'overlap' AND step IS NULL""")
    got = {m: (b, a) for m, b, a in rows.iter_rows()}
    assert got["step_ns"] == pytest.approx((300_000, 180_000))
    assert got["exposed_a2a_ns"] == pytest.approx((490_000 / 3, 155_000 / 3))
    doc = json.loads((tmp_path / "ov.json").read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"step 0: recorded", "step 0: two micro-batches (predicted)"}
    assert "error_band" in doc["otherData"]


def test_domain_sweep_against_routing_rows(tmp_path, runner, cli):
    from moetrace.run import Store

    res = runner.invoke(cli, ["synth", str(tmp_path / "st"), "--layers", "2", "--experts", "32", "--top-k", "4",
                              "--ranks", "16", "--ranks-per-node", "8", "--steps", "3", "--tokens-per-step", "64",
                              "--per-token"])
    assert res.exit_code == 0, res.output
    st = Store(tmp_path / "st")
    res = runner.invoke(cli, ["whatif", str(tmp_path / "st"), "--only", "domain", "--domains", "4,16"])
    assert res.exit_code == 0, res.output
    # independent: every routing row, destination rank = expert * 16 // 32 (contiguous), distinct
    # (token, destination) pairs, hidden 7168 x 2 bytes per token
    rows = st.sql("SELECT step, layer, token, src_rank, expert FROM routing").iter_rows()
    pairs = {(s, l, t, src, e * 16 // 32) for s, l, t, src, e in rows}
    want = {}
    for d in (8, 4, 16):
        inter = sum(7168 * 2 for s, l, t, src, dst in pairs if src != dst and src // d != dst // d)
        want[d] = inter
    got = {int(sc.split()[0]): a for sc, a in st.sql(
        "SELECT scenario, after FROM replay_whatif WHERE kind = 'domain' AND metric = 'inter_domain_bytes'").iter_rows()}
    assert got == {d: float(v) for d, v in want.items()} and got[16] == 0.0 and got[4] > got[8] > 0


def test_report_section_shows_the_whatif_table(tmp_path, runner, cli):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import timeline_whatif as whatif

    from .helpers.kineto_trace import ingest
    from .helpers.waits_trace import _three_ranks

    st = ingest(runner, cli, tmp_path / "st", _three_ranks(tmp_path / "run"))
    rid = st.resolve_run(None)
    sec = whatif.build(ReportContext(st, rid, st.run_row(rid), tmp_path / "rep"))   # nothing stored: computed
    # measured latency: 10th percentile of the instances' transfer (70, 50 µs) = 52 µs x 2 per layer = 104 µs;
    # hideable = e + 104 - b/2 = 234, 224, 219 vs c = 120, 100, 150 -> steps 120 + 114 + 50 = 284, 274, 244 µs
    assert "0.30 ms recorded -> 0.28 ms ±25% predicted" in sec.markdown and "not stored" in sec.markdown
    assert any("overlap what-if assumes" in n for n in sec.notes)


@pytest.mark.slow
def test_two_micro_batch_refrun_routes_like_one(tmp_path, forked_ranks):
    """refrun --micro-batches 2 runs the same tokens through the same router: every
    (step, layer, token, choice) picks the same expert and slot, the received load is the
    same, and the trace labels micro-batches 0 and 1."""
    pytest.importorskip("torch", reason="the reference run needs PyTorch")
    from moetrace.collect import ingest as ingest_paths
    from moetrace.produce.refrun import RefRunConfig, run
    from moetrace.run import Store

    st = Store(tmp_path / "st", create=True)
    ids = {}
    for mb in (1, 2):
        run(RefRunConfig(ranks=2, experts=4, top_k=2, layers=2, hidden=32, ffn=64, steps=2, tokens_per_rank=9,
                         seed=4, micro_batches=mb), tmp_path / f"mb{mb}")
        ids[mb] = ingest_paths(st, [tmp_path / f"mb{mb}"])[0].run_id
    q = "SELECT step, layer, token, choice, expert, slot FROM routing WHERE run_id = ? ORDER BY ALL"
    a, b = (st.sql(q, [ids[m]]) for m in (1, 2))
    assert a.height == 2 * 2 * 2 * 9 * 2 and a.equals(b)
    q = "SELECT step, layer, slot, sum(tokens) AS t FROM expert_load WHERE run_id = ? GROUP BY ALL ORDER BY ALL"
    assert st.sql(q, [ids[1]]).equals(st.sql(q, [ids[2]]))
    mbs = st.sql("SELECT DISTINCT micro_batch FROM spans WHERE run_id = ? AND kind IN ('dispatch', 'combine') "
                 "AND micro_batch IS NOT NULL ORDER BY 1", [ids[2]])["micro_batch"].to_list()
    assert mbs == [0, 1]


def test_replay_option_runs_the_timeline_whatifs(tmp_path, runner, cli):
    from moetrace.run import Store

    res = runner.invoke(cli, ["synth", str(tmp_path / "st"), "--layers", "1", "--experts", "16", "--top-k", "2",
                              "--ranks", "16", "--ranks-per-node", "8", "--steps", "2", "--tokens-per-step", "32",
                              "--per-token"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["replay", str(tmp_path / "st"), "--policy", "eplb", "--timeline-whatif"])
    assert res.exit_code == 0, res.output
    kinds = Store(tmp_path / "st").sql("SELECT DISTINCT kind FROM replay_whatif")["kind"].to_list()
    assert kinds == ["domain"]      # no profiler spans: overlap and disaggregation say why they were skipped
    assert "16 ranks per NVLink domain" in res.output

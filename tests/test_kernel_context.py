"""Kernels classified by what launched them: crafted Kineto traces shaped like
recent vLLM ones (TRT-LLM-gen bmm kernels inside vllm::moe_forward, nvjet GEMMs inside
expert_ffn ranges, a multimem all-reduce), a CPU-only gloo trace, a crafted Nsight
export with NVTX ranges around the launches; the "no expert GEMM found" line; and the
real-data defects (kernels without a launch record, steps_undefined without --ranks,
uneven expert blocks)."""
from __future__ import annotations

import json
import sqlite3

import pytest

from moetrace.collect import collect
from moetrace.collect._launch_context import launch_context
from moetrace.domain.kernels import Classifier
from moetrace.run import Store

from .helpers.kineto_trace import ev_x, kernel, launch, write_trace

BMM_FP4 = ("bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x8x512u2_s3_et128x8_m128x8x32_cga1x1x1_16dp256b_rM_TN_transOut_schedS_"
           "biasM_bN_tma_ldgstsSf_rgTma_clmp_dynB_sm100f")
BMM_BF16 = "bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x8x512u2_s3_et128x8_m128x8x32_cga1x1x1_16dp256b_rM_TN_transOut_sm100f"
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN"
MULTIMEM = ("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, "
            "unsigned int**, unsigned long, unsigned long)")
ORPHAN = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)"


def vllm_like_events() -> list[str]:
    """One step: two bmm kernels launched inside the cpu_op vllm::moe_forward; two nvjet
    GEMMs inside an expert_ffn annotation (the second launch comes after a kept op,
    vllm::moe_sum, that ended: the containing range is found by climbing); a dense nvjet
    under aten::mm only; a multimem all-reduce; a kernel whose correlation id has no
    runtime call. Durations in µs: bmm 40 + 25, nvjet 30 + 20 (expert), 50 (dense)."""
    return [
        ev_x("user_annotation", "ProfilerStep#1", 0, 1000),
        ev_x("cpu_op", "vllm::moe_forward", 100, 200),
        launch(110, 1), launch(150, 2),
        kernel(BMM_FP4, 200, 40, 1),
        kernel(BMM_BF16, 250, 25, 2),
        ev_x("user_annotation", "expert_ffn", 400, 100),
        ev_x("cpu_op", "vllm::moe_sum", 402, 2),
        launch(405, 3), launch(420, 4),
        kernel(NVJET, 510, 30, 3),
        kernel(NVJET, 545, 20, 4),
        ev_x("cpu_op", "aten::mm", 600, 20),
        launch(605, 5),
        kernel(NVJET, 640, 50, 5),
        launch(700, 6),
        kernel(MULTIMEM, 710, 60, 6, stream=9),
        kernel(ORPHAN, 800, 5, 99),          # correlation 99: no launch record
    ]


def _ingest(runner, cli, f, st, *extra):
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(st), *map(str, extra)])
    assert res.exit_code == 0, res.output
    return Store(st)


def test_vllm_like_trace_expert_gemm_from_names_and_context(tmp_path, runner, cli):
    events = vllm_like_events()
    f = write_trace(tmp_path / "vllm.json", events, rank=0, world=1)
    path = tmp_path / "st"
    st = _ingest(runner, cli, f, path)
    # by hand from the raw events: the kernels launched inside moe_forward / expert_ffn
    raw = [json.loads(e) for e in events if '"kernel"' in e]
    expert_us = sum(e["dur"] for e in raw if e["args"]["correlation"] in (1, 2, 3, 4))
    assert expert_us == 115
    res = runner.invoke(cli, ["kernels", str(path), "--format", "json", "--top", "0"])
    rows = json.loads(res.stdout)
    eg = [r for r in rows if r["kind"] == "expert_gemm"]
    assert sum(r["total_ms"] for r in eg) == pytest.approx(expert_us / 1000)
    assert sorted((r["name"][:12], r["classified_by"], r["total_ms"]) for r in eg) == [
        ("bmm_Bfloat16", "name", pytest.approx(0.025)), ("bmm_MxE4m3_M", "name", pytest.approx(0.04)),
        ("nvjet_tst_12", "context", pytest.approx(0.05))]
    assert {r["kind"] for r in rows if r["name"].startswith("(anonymous namespace)::multimem")} == {"comm_other"}
    got = st.sql("""SELECT s.correlation, s.kind, s.classified_by, s.moe_context FROM spans s
                    ORDER BY s.correlation""").rows()
    assert [tuple(r) for r in got] == [
        (1, "expert_gemm", "name", "vllm::moe_forward"),
        (2, "expert_gemm", "name", "vllm::moe_forward"),
        (3, "expert_gemm", "context", "expert_ffn"),    # launch at 405: moe_sum ended at 404, expert_ffn holds it
        (4, "expert_gemm", "context", "expert_ffn"),
        (5, "compute_other", "default", None),          # the same nvjet name outside any MoE range
        (6, "comm_other", "name", None),
        (99, "compute_other", "default", None),
    ]
    # a name's kind is what most of its spans got (nvjet: 2 expert spans, 1 dense), and how
    kn = {n: (k, b) for n, k, b in st.sql("SELECT name, kind, classified_by FROM kernel_names").rows()}
    assert kn[NVJET] == ("expert_gemm", "context") and kn[BMM_FP4] == ("expert_gemm", "name")
    # the multimem all-reduce is communication: it hides nothing, it is not compute
    kt = st.sql("SELECT kind, sum(kernel_ns) AS ns FROM kernel_time GROUP BY kind").rows()
    assert dict(kt)["comm_other"] == 60_000


def test_kernel_without_launch_record_is_said(tmp_path):
    f = write_trace(tmp_path / "vllm.json", vllm_like_events(), rank=0, world=1)
    (run,) = collect([f])
    approx = json.loads(run.run["approximations"])
    line = [a for a in approx if "no launch record" in a]
    assert len(line) == 1 and line[0].startswith("1 device event (rank 0: 1)")
    assert "step and annotations were taken at their GPU start time" in line[0]
    # every kernel launched: no such line
    ev = [e for e in vllm_like_events() if ORPHAN not in e]
    f2 = write_trace(tmp_path / "ok.json", ev, rank=0, world=1)
    (run2,) = collect([f2])
    assert not any("no launch record" in a for a in json.loads(run2.run["approximations"] or "[]"))


def test_gloo_barrier_on_a_cpu_trace_is_communication(tmp_path, runner, cli):
    ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
          ev_x("cpu_op", "aten::matmul", 10, 100),
          ev_x("cpu_op", "gloo:barrier", 200, 70),
          ev_x("cpu_op", "gloo:all_to_all", 300, 40),
          ev_x("cpu_op", "aten::add", 400, 30)]
    f = write_trace(tmp_path / "cpu.json", ev, rank=0, world=1)
    st = _ingest(runner, cli, f, tmp_path / "st")
    got = dict(st.sql("""SELECT kn.name, s.kind FROM spans s JOIN kernel_names kn USING (run_id, name_id)""").rows())
    assert got["gloo:barrier"] == "comm_other"
    assert got["aten::matmul"] == "compute_other" and got["aten::add"] == "compute_other"
    assert got["gloo:all_to_all"] in ("dispatch", "combine")
    compute = st.sql("SELECT sum(end_ns - start_ns) AS ns FROM spans WHERE kind = 'compute_other'")["ns"][0]
    assert compute == (100 + 30) * 1000     # the barrier's 70 µs are not compute


def make_nvtx_export(path):
    """An Nsight export: NVTX ranges 'FusedMoE' and 'expert_ffn' around launches of an
    nvjet GEMM, the same GEMM launched outside them, and a plain push/pop 'attn' range."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT, mangledName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, eventClass INT, globalTid INT,
            correlationId INT, nameId INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, eventType INT, rangeId INT, category INT, color INT,
            text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT);
    """)
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, NVJET), (2, "cudaLaunchKernel"), (3, "FusedMoE")])
    gpid = (1 << 56) | (4242 << 24)
    gtid = gpid | 4243
    other_tid = gpid | 4244
    nv = [(0, 1000, 59, None, gtid, 3),               # FusedMoE (text through textId)
          (100, 400, 59, "expert_ffn", gtid, None),
          (500, 600, 59, "attn", gtid, None),
          (0, 2000, 59, "expert_ffn", other_tid, None)]   # another thread's range: not this launch's context
    db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, NULL, NULL, NULL, ?, ?, NULL, ?, 0)", nv)
    launches = [(150, 1), (300, 2), (1500, 3)]       # corr 3 launched after FusedMoE ended
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 2)",
                   [(t, t + 5, gtid, c) for t, c in launches])
    kernels = [(200, 290, 1), (320, 350, 2), (1600, 1700, 3)]
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, ?, ?, 1, 1, 1)",
                   [(s, e, c, gpid) for s, e, c in kernels])
    db.commit()
    db.close()
    return path


def test_nsight_nvtx_ranges_around_launches(tmp_path, runner, cli):
    f = make_nvtx_export(tmp_path / "moe.nsys.sqlite")
    path = tmp_path / "st"
    st = _ingest(runner, cli, f, path)
    got = st.sql("SELECT correlation, kind, classified_by, moe_context, end_ns - start_ns AS ns FROM spans "
                 "ORDER BY correlation").rows()
    assert [tuple(r) for r in got] == [(1, "expert_gemm", "context", "expert_ffn", 90),
                                       (2, "expert_gemm", "context", "expert_ffn", 30),
                                       (3, "compute_other", "default", None, 100)]
    res = runner.invoke(cli, ["kernels", str(path), "--kind", "expert_gemm", "--format", "json"])
    assert json.loads(res.stdout)[0]["total_ms"] == pytest.approx((90 + 30) / 1e6)


def test_launch_context_chain_by_hand():
    import polars as pl

    ranges = pl.DataFrame({"name": ["outer", "inner", "later", "x"], "pid": [1, 1, 1, 1], "tid": [1, 1, 1, 2],
                           "start_ns": [0, 10, 50, 0], "end_ns": [100, 20, 60, 100]})
    pts = pl.DataFrame({"pid": [1, 1, 1, 1, None, 1], "tid": [1, 1, 1, 1, None, 3], "t": [15, 30, 55, 200, 15, 15]})
    ids, chains = launch_context(pts, ranges)
    got = [None if i is None else chains[i] for i in ids.to_list()]
    assert got == [("inner", "outer"), ("outer",), ("later", "outer"), None, None, None]


def test_rules_order_and_match_columns(tmp_path):
    c = Classifier()
    assert c.classify_how(NVJET, context=("expert_ffn",)) == ("expert_gemm", "context")
    assert c.classify_how(NVJET) == ("compute_other", "default")
    # a name rule wins over context: a DeepEP dispatch under an expert range stays a dispatch
    assert c.classify_how("void deep_ep::intranode::dispatch<8>(int4*)", context=("experts",)) == ("dispatch", "name")
    # an activation kernel under moe_forward is no GEMM: the context rule needs a GEMM-like name
    assert c.classify_how("void vllm::act_and_mul_kernel<float>(float*)", context=("vllm::moe_forward",)) == \
        ("compute_other", "default")
    assert c.classify("bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128") == "expert_gemm"
    assert c.classify("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*)") == "comm_other"
    assert c.classify("void mori::moe::EpDispatchIntraNodeKernel<__hip_bfloat16>(mori::moe::Args)") == "dispatch"
    assert c.classify("void uccl::internode_ll::combine<false, 3, 7168, 9>(void*)") == "combine"
    assert c.classify("void marlin_moe_wna16::Marlin<256, 1, 8, 8, 4, 8>(int4 const*)") == "expert_gemm"
    assert c.classify("gloo:barrier") == "comm_other"
    rules = tmp_path / "r.csv"
    rules.write_text("kind,match,pattern,context,stream\n"
                     "attention,context,,my_attn_range,\n"
                     "comm_other,stream,,,9\n")
    u = Classifier(rules)
    assert u.classify_how("anything", context=("my_attn_range",)) == ("attention", "user")
    assert u.classify_how("whatever_kernel", stream=9) == ("comm_other", "user")
    assert u.classify_how("whatever_kernel", stream=19) == ("compute_other", "default")
    # user rules come first: they may override a name rule
    over = tmp_path / "o.csv"
    over.write_text("kind,match,pattern,context\ncompute_other,context,,warmup\n")
    assert Classifier(over).classify_how(BMM_FP4, context=("warmup",)) == ("compute_other", "user")


def test_context_rule_without_context_column_is_refused(tmp_path):
    from moetrace.errors import InputError

    bad = tmp_path / "b.csv"
    bad.write_text("kind,match,pattern\nexpert_gemm,context,nvjet\n")
    with pytest.raises(InputError, match="a context rule needs a context column"):
        Classifier(bad)
    bad.write_text("kind,match,pattern\nexpert_gemm,flavour,nvjet\n")
    with pytest.raises(InputError, match="unknown match 'flavour'"):
        Classifier(bad)


# ------------------------------------------------------------------ never silently zero
MYSTERY = "void sm100_blockscaled_kernel<128>(Params)"


def mystery_events() -> list[str]:
    """An MoE trace whose expert kernel no rule knows, launched inside vllm::moe_forward,
    plus a known attention kernel outside it."""
    return [ev_x("user_annotation", "ProfilerStep#1", 0, 1000),
            ev_x("cpu_op", "vllm::moe_forward", 100, 200),
            launch(110, 1), launch(120, 2), launch(400, 3),
            kernel(MYSTERY, 200, 70, 1), kernel(MYSTERY, 280, 30, 2),
            kernel("void flash::flash_fwd_kernel<128>(Params)", 420, 40, 3)]


def test_moe_trace_without_expert_gemm_says_so(tmp_path, runner, cli):
    f = write_trace(tmp_path / "m.json", mystery_events(), rank=0, world=1)
    st = tmp_path / "st"
    _ingest(runner, cli, f, st)
    res = runner.invoke(cli, ["kernels", str(st)])
    lines = [ln for ln in res.output.splitlines() if "no kernel is classified expert_gemm" in ln]
    assert len(lines) == 1
    assert "'vllm::moe_forward'" in lines[0] and "unknown, not 0" in lines[0]
    assert "sm100_blockscaled_kernel<128>(Params)' (0.100 ms, 2 spans)" in lines[0]   # 70 + 30 µs
    assert "--kernel-rules" in lines[0]
    res = runner.invoke(cli, ["kernels", str(st), "--kind", "expert_gemm"])
    assert "no span of kind expert_gemm" in res.output and "no kernel is classified expert_gemm" in res.output
    res = runner.invoke(cli, ["exposure", str(st)])
    assert "no all-to-all found" in res.output and "no kernel is classified expert_gemm" in res.output
    # the json output stays data: the line goes to stderr there
    res = runner.invoke(cli, ["kernels", str(st), "--format", "json"])
    json.loads(res.stdout)
    # with a rule the kernel is an expert GEMM and the line is gone
    rules = tmp_path / "r.csv"
    rules.write_text("kind,match,pattern\nexpert_gemm,name,sm100_blockscaled\n")
    st2 = tmp_path / "st2"
    _ingest(runner, cli, f, st2, "--kernel-rules", rules)
    res = runner.invoke(cli, ["kernels", str(st2), "--format", "json"])
    eg = [r for r in json.loads(res.stdout) if r["kind"] == "expert_gemm"]
    assert eg[0]["total_ms"] == pytest.approx(0.1)
    assert "no kernel is classified expert_gemm" not in res.output


def test_report_kernel_section_says_so(tmp_path, runner, cli):
    f = write_trace(tmp_path / "m.json", mystery_events(), rank=0, world=1)
    st = tmp_path / "st"
    _ingest(runner, cli, f, st)
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import kernels as ksec

    store = Store(st)
    rid = store.sql("SELECT run_id FROM runs")["run_id"][0]
    ctx = ReportContext(store, rid, store.sql("SELECT * FROM runs").row(0, named=True), tmp_path)
    sec = ksec.build(ctx)
    assert "no kernel is classified expert_gemm" in sec.markdown
    assert any("unknown, not 0" in n for n in sec.notes)


def test_dense_trace_has_no_such_line(tmp_path, runner, cli):
    ev = [ev_x("user_annotation", "ProfilerStep#1", 0, 1000), ev_x("cpu_op", "aten::mm", 100, 50),
          launch(110, 1), kernel(NVJET, 200, 70, 1)]
    f = write_trace(tmp_path / "d.json", ev, rank=0, world=1)
    st = tmp_path / "st"
    _ingest(runner, cli, f, st)
    res = runner.invoke(cli, ["kernels", str(st)])
    assert "expert_gemm" not in res.output


# ------------------------------------------------------------------ shape defects
def _load_csv(path, steps, experts, empty_step=None):
    lines = ["step,layer,expert,tokens"]
    for s in range(steps):
        for e in range(experts):
            lines.append(f"{s},0,{e},{0 if s == empty_step else e % 5 + 1}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_skew_without_ranks_says_why_imbalance_is_null(tmp_path, runner, cli):
    f = _load_csv(tmp_path / "expert_load.csv", steps=4, experts=8, empty_step=2)
    st = tmp_path / "st"
    _ingest(runner, cli, f, st, "--experts", 8)
    s = Store(st).sql("SELECT * FROM skew_summary").row(0, named=True)
    # 4 steps: one routed nothing (undefined for that reason), three have tokens but no rank count
    assert (s["steps"], s["steps_undefined"], s["steps_no_ranks"]) == (4, 1, 3)
    r = Store(st).sql("SELECT * FROM run_skew_summary").row(0, named=True)
    assert (r["step_layers_undefined"], r["step_layers_no_ranks"]) == (1, 3)
    res = runner.invoke(cli, ["skew", str(st), "--format", "json"])
    row = json.loads(res.stdout)[0]     # stderr carries the shape warnings
    assert row["steps_undefined"] == 1 and row["steps_no_ranks"] == 3
    # with --ranks the only undefined step is the empty one
    st2 = tmp_path / "st2"
    _ingest(runner, cli, f, st2, "--experts", 8, "--ranks", 2)
    s2 = Store(st2).sql("SELECT * FROM skew_summary").row(0, named=True)
    assert (s2["steps_undefined"], s2["steps_no_ranks"]) == (1, 0)


def test_uneven_expert_blocks_are_warned_and_recorded(tmp_path, runner, cli):
    f = _load_csv(tmp_path / "expert_load.csv", steps=1, experts=256)
    st = tmp_path / "st"
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(st), "--experts", "256", "--ranks", "72"])
    assert res.exit_code == 0, res.output
    # 256 = 72 * 3 + 40: 40 ranks hold 4 experts, 32 hold 3 (e * 72 // 256 by hand below)
    sizes = {}
    for e in range(256):
        sizes[e * 72 // 256] = sizes.get(e * 72 // 256, 0) + 1
    assert sorted({v: list(sizes.values()).count(v) for v in sizes.values()}.items()) == [(3, 32), (4, 40)]
    # one warning about the blocks (another says top-k was not given)
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: ") and "ranks hold" in ln]
    assert len(warn) == 1 and "40 ranks hold 4 experts and 32 hold 3" in warn[0]
    approx = json.loads(Store(st).sql("SELECT approximations FROM runs")["approximations"][0])
    assert any("256 experts do not divide over 72 ranks" in a for a in approx)
    res = runner.invoke(cli, ["ingest", str(f), "--store", str(tmp_path / "st2"), "--experts", "256", "--ranks", "64"])
    assert "ranks hold" not in res.stderr     # 256 over 64 ranks: even blocks, no warning about them

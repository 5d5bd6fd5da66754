"""Cost-model calibration: the fit recovers known parameters, the judged metrics are what
an independent recomputation from the stored rows gives, and a real pair of reference runs
goes through `moetrace calibrate` end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moetrace.costmodel import calibrate_fit as calfit
from moetrace.replay import calibrate as cal
from moetrace.run import Store

from .helpers import module_fixture, tree_hash
from .helpers.calibration_runs import (  # noqa: F401  (exact_store: a fixture)
    A_TRUE,
    B_TRUE,
    CI,
    CO,
    CONTIG,
    LAT,
    SHUFFLED,
    L,
    R,
    T,
    _routing,
    _truth,
    _write,
    exact_store,
)


def _grid(c: calfit.Cells, arr):
    return arr[c.step, c.layer, c.rank]


def test_observe_inputs_match_independent_count(exact_store):
    st, (tok, tch, bi, bo) = exact_store
    c = cal.observe(st, "a")
    assert c.size == T * L * R
    np.testing.assert_array_equal(c.tokens, _grid(c, tok))
    np.testing.assert_array_equal(c.touched, _grid(c, tch))
    np.testing.assert_array_equal(c.bytes_intra, _grid(c, bi))
    np.testing.assert_array_equal(c.bytes_inter, _grid(c, bo))
    assert c.bytes_inter.sum() > 0 and c.bytes_intra.sum() > 0
    # measured = the sum of the two expert spans per cell; attention spans are not counted
    np.testing.assert_allclose(c.expert_ns, np.round(A_TRUE * c.tokens + B_TRUE * c.touched))


def test_fit_recovers_known_parameters(exact_store):
    st, _ = exact_store
    f = calfit.fit(cal.observe(st, "a"))
    assert f.model.a_ns == pytest.approx(A_TRUE, rel=1e-3)
    assert f.model.b_ns == pytest.approx(B_TRUE, rel=1e-3)
    assert f.comm_latency_ns == pytest.approx(LAT, rel=1e-3)
    assert f.comm_ns_per_byte_intra == pytest.approx(CI, rel=1e-2)
    assert f.comm_ns_per_byte_inter == pytest.approx(CO, rel=1e-3)
    assert f.expert_r2 > 0.9999 and f.comm_r2 > 0.9999
    # the replay's model times dispatch + combine = latency + 2 x bytes / bandwidth: the same all-to-all
    assert f.model.nvlink_Bps == pytest.approx(2e9 / f.comm_ns_per_byte_intra)
    assert f.model.latency_ns == pytest.approx(f.comm_latency_ns)


def test_spans_and_load_from_two_runs_with_step_offset(tmp_path, runner, cli):
    """A profiler trace and an engine dump are two runs; profiler step s is engine step s + 5."""
    rt = _routing(1)
    tok, tch, bi, bo = _truth(rt, CONTIG)
    ex, cm = np.round(A_TRUE * tok + B_TRUE * tch), np.round(LAT + CI * bi + CO * bo)
    path = tmp_path / "st"
    st = Store(path, create=True)
    _write(st, "prof", rt, CONTIG, ex, cm, what="spans", span_step_shift=-5)
    _write(st, "load", rt, CONTIG, ex, cm, what="load")
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "prof", "--load", "prof=load", "--step-offset", "5",
                            "--json"])
    assert r.exit_code == 0, r.output
    f = json.loads(r.output)["fit"]
    assert f["a_ns"] == pytest.approx(A_TRUE, rel=1e-3) and f["b_ns"] == pytest.approx(B_TRUE, rel=1e-3)
    assert f["comm_ns_per_byte_inter"] == pytest.approx(CO, rel=1e-3)
    rows = Store(path).sql("SELECT step, layer, rank, tokens FROM calibration WHERE run_id = 'prof' "
                           "ORDER BY step, layer, rank")
    assert rows["step"].min() == 0 and rows.height == T * L * R
    np.testing.assert_array_equal(rows["tokens"].to_numpy().reshape(T, L, R), tok)
    # without the offset the profiler steps -5..4 meet load steps 0..4 only: a different, smaller fit
    r2 = runner.invoke(cli, ["calibrate", str(path), "--run", "prof", "--load", "prof=load", "--json", "--no-store"])
    assert r2.exit_code == 0, r2.output
    assert json.loads(r2.output)["fit"]["expert_points"] < f["expert_points"]


def test_noisy_fit_is_the_closed_form_least_squares(tmp_path):
    rt = _routing(2)
    tok, tch, bi, bo = _truth(rt, CONTIG)
    rng = np.random.default_rng(5)
    ex = np.round((A_TRUE * tok + B_TRUE * tch) * rng.lognormal(0, 0.2, tok.shape))
    cm = np.round((LAT + CI * bi + CO * bo) * rng.lognormal(0, 0.2, tok.shape))
    st = Store(tmp_path / "st", create=True)
    _write(st, "n", rt, CONTIG, ex, cm, per_slot_spans=False)
    f = calfit.fit(cal.observe(st, "n"))
    m = ex > 0
    x1, x2, y = tok[m], tch[m], ex[m]
    # normal equations of min |a x1 + b x2 - y|^2, solved by hand (Cramer's rule)
    s11, s12, s22, s1y, s2y = x1 @ x1, x1 @ x2, x2 @ x2, x1 @ y, x2 @ y
    det = s11 * s22 - s12 * s12
    a, b = (s1y * s22 - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
    assert a > 0 and b > 0
    assert f.model.a_ns == pytest.approx(a, rel=1e-9) and f.model.b_ns == pytest.approx(b, rel=1e-9)
    pred = a * x1 + b * x2
    assert f.expert_r2 == pytest.approx(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum(), rel=1e-9)
    # all-to-all: least squares with an intercept; with this noise the intra-node slope comes
    # out negative, so the documented rule drops it (0) and refits latency and inter slope
    mc = cm > 0
    X = np.stack([np.ones(mc.sum()), bi[mc], bo[mc]], axis=1)
    full = np.linalg.solve(X.T @ X, X.T @ cm[mc])
    assert full[1] < 0 < full[0] and full[2] > 0
    X2 = X[:, [0, 2]]
    lat, co = np.linalg.solve(X2.T @ X2, X2.T @ cm[mc])
    assert [f.comm_latency_ns, f.comm_ns_per_byte_intra, f.comm_ns_per_byte_inter] == pytest.approx([lat, 0, co], rel=1e-6)


def test_mape_loss_minimizes_the_percentage_error():
    rng = np.random.default_rng(3)
    x1 = rng.integers(1, 400, 200).astype(float)
    x2 = rng.integers(1, 5, 200).astype(float)
    y = A_TRUE * x1 + B_TRUE * x2
    y[:6] *= 20                                     # a few preempted cells
    X = np.stack([x1, x2], axis=1)
    obj = lambda c: np.mean(np.abs(X @ c - y) / y)  # noqa: E731
    c_mape = calfit.fit_mape(X, y)
    c_l2 = np.linalg.lstsq(X, y, rcond=None)[0]
    assert obj(c_mape) < obj(c_l2)
    assert obj(c_mape) <= obj(np.array([A_TRUE, B_TRUE])) * (1 + 1e-6)
    assert c_mape == pytest.approx([A_TRUE, B_TRUE], rel=1e-2)   # 3% outliers barely move it


def test_judged_metrics_match_recomputation(tmp_path, runner, cli):
    """Fit on run a (contiguous), judge run b (another placement, slower experts): the
    stored rows and the printed metrics agree with a recomputation by hand."""
    rt_a, rt_b = _routing(1), _routing(7)
    ta = _truth(rt_a, CONTIG)
    tb = _truth(rt_b, SHUFFLED)
    rng = np.random.default_rng(11)
    ex_a = np.round(A_TRUE * ta[0] + B_TRUE * ta[1])
    ex_b = np.round(1.3 * (A_TRUE * tb[0] + B_TRUE * tb[1]) * rng.lognormal(0, 0.1, tb[0].shape))
    cm_a = np.round(LAT + CI * ta[2] + CO * ta[3])
    cm_b = np.round((LAT + CI * tb[2] + CO * tb[3]) * 1.5)
    path = tmp_path / "st"
    st = Store(path, create=True)
    _write(st, "a", rt_a, CONTIG, ex_a, cm_a)
    _write(st, "b", rt_b, SHUFFLED, ex_b, cm_b)
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "a", "--judge-run", "b", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    a, b = out["fit"]["a_ns"], out["fit"]["b_ns"]
    assert a == pytest.approx(A_TRUE, rel=1e-3) and b == pytest.approx(B_TRUE, rel=1e-3)
    m = out["judged"][0]["metrics"]
    tok, tch, bi, bo = tb
    pred = a * tok + b * tch
    ok = ex_b > 0
    rel = (pred[ok] - ex_b[ok]) / ex_b[ok]
    assert m["expert_mape"] == pytest.approx(np.abs(rel).mean(), rel=1e-6)
    assert m["expert_bias"] == pytest.approx(rel.mean(), rel=1e-6)
    assert m["expert_bias"] < -0.1           # b's experts run 30% slower: predictions are low
    pmax, mmax = pred.max(axis=2), ex_b.max(axis=2)
    srel = (pmax - mmax) / mmax
    assert m["straggler_mape"] == pytest.approx(np.abs(srel).mean(), rel=1e-6)
    hits = [int(np.argmax(ex_b[s, la])) in set(np.flatnonzero(pred[s, la] >= pred[s, la].max() * (1 - 1e-9)))
            for s in range(T) for la in range(L)]
    assert m["straggler_hit_rate"] == pytest.approx(np.mean(hits))
    assert m["pairs"] == T * L
    cp = out["fit"]["comm_latency_ns"] + out["fit"]["comm_ns_per_byte_intra"] * bi + out["fit"]["comm_ns_per_byte_inter"] * bo
    assert m["comm_mape"] == pytest.approx(np.mean(np.abs(cp - cm_b) / cm_b), rel=1e-4)
    lm, lp = (ex_b + cm_b).max(axis=2), (pred + cp).max(axis=2)
    assert m["layer_mape"] == pytest.approx(np.mean(np.abs(lp - lm) / lm), rel=1e-4)
    # the stored rows: SQL over the table gives the same numbers
    st = Store(path)
    rows = st.sql("SELECT step, layer, rank, tokens, slots_touched, measured_expert_ns, predicted_expert_ns, "
                  "measured_straggler, predicted_straggler FROM calibration WHERE run_id = 'b' AND role = 'judge' "
                  "ORDER BY step, layer, rank")
    assert rows.height == T * L * R
    np.testing.assert_array_equal(rows["tokens"].to_numpy().reshape(T, L, R), tok)
    np.testing.assert_array_equal(rows["measured_expert_ns"].to_numpy().reshape(T, L, R), ex_b)
    np.testing.assert_allclose(rows["predicted_expert_ns"].to_numpy().reshape(T, L, R), pred)
    s = cal.stored_summary(st, "b").row(0, named=True)
    assert s["role"] == "judge" and s["fit_run_id"] == "a"
    for k in ("expert_mape", "expert_bias", "straggler_mape", "straggler_hit_rate", "comm_mape", "layer_mape"):
        assert s[k] == pytest.approx(m[k], rel=1e-6), k
    assert st.sql("SELECT count(*) n FROM calibration WHERE run_id = 'a' AND role = 'fit'")["n"][0] == T * L * R
    # the report's calibration section for the judged run (built as build_report builds it)
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import calibration

    (tmp_path / "rep").mkdir()
    sec = calibration.build(ReportContext(st, "b", st.run_row("b"), tmp_path / "rep"))
    assert sec is not None and sec.key == "calibration" and "fitted on run a" in sec.markdown
    assert (tmp_path / "rep" / "calibration_b.png").exists()


def test_bad_input_exit_2_store_unchanged(tmp_path, runner, cli):
    rt = _routing(1)
    tok, tch, _, _ = _truth(rt, CONTIG)
    path = tmp_path / "st"
    st = Store(path, create=True)
    _write(st, "a", rt, CONTIG, np.zeros_like(tok), None)   # spans, but no expert_gemm span
    before = tree_hash(path)
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "a"])
    assert r.exit_code == 2
    assert "expert_gemm" in r.output
    assert tree_hash(path) == before


def test_no_report_section_without_calibration(exact_store, tmp_path):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import calibration as sec

    st, _ = exact_store
    assert sec.build(ReportContext(st, "a", st.run_row("a"), tmp_path)) is None


# ----------------------------------------------------------------------------- real runs
RR, RE, RSTEPS = 2, 8, 3
REPLICATED = [0, 1, 2, 3, 4, 5, 0, 1, 6, 7, 2, 3]


@module_fixture
def refrun_pair(tmp_path_factory, forked_ranks):
    pytest.importorskip("torch", reason="the reference run needs PyTorch (pip install 'moetrace[torch]')")
    from moetrace.collect import ingest
    from moetrace.produce.refrun import RefRunConfig, run

    root = tmp_path_factory.mktemp("calrefrun")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"phy2log": [REPLICATED] * 2}))
    base = dict(ranks=RR, experts=RE, top_k=2, layers=2, hidden=32, ffn=64, steps=RSTEPS, tokens_per_rank=24,
                prefill_tokens=48, skew=1.2, seed=4)
    run(RefRunConfig(**base), root / "ra")
    run(RefRunConfig(**base, placement=str(plan)), root / "rb")
    st = Store(root / "st", create=True)
    ingest(st, [root / "ra"])
    ingest(st, [root / "rb"])
    return root


def test_refrun_has_one_expert_span_per_slot_touched(refrun_pair):
    st = Store(refrun_pair / "st")
    for rid in ("ra", "rb"):
        n = st.sql("SELECT count(*) n FROM spans WHERE run_id = ? AND kind = 'expert_gemm'", [rid])["n"][0]
        touched = st.sql("SELECT count(DISTINCT (step, layer, slot)) n FROM expert_load WHERE run_id = ? AND tokens > 0",
                         [rid])["n"][0]
        assert n == touched > 0
        assert st.sql("SELECT count(*) n FROM spans WHERE run_id = ? AND kind = 'expert_gemm' AND "
                      "(step IS NULL OR layer IS NULL)", [rid])["n"][0] == 0


def test_calibrate_refrun_pair_end_to_end(refrun_pair, runner, cli):
    path = refrun_pair / "st"
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "ra", "--judge-run", "rb", "--basis", "wall", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["basis"] == "wall"
    st = Store(path)
    # independent recomputation from the stored spans and load
    spr_of = {"ra": RE // RR, "rb": len(REPLICATED) // RR}

    def cells(rid):
        # a refrun has timed passes: calibrate uses their medians (cell_times), not the profiled pass's spans
        sp = st.sql("SELECT step, layer, rank, expert_ns d FROM cell_times WHERE run_id = ?", [rid])
        ld = st.sql("SELECT step, layer, slot, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL", [rid])
        meas, tok, tch = np.zeros((RSTEPS, 2, RR)), np.zeros((RSTEPS, 2, RR)), np.zeros((RSTEPS, 2, RR))
        for s, la, rk, d in sp.iter_rows():
            meas[s, la, rk] = d
        for s, la, slot, t in ld.iter_rows():
            tok[s, la, slot // spr_of[rid]] += t
            tch[s, la, slot // spr_of[rid]] += t > 0
        return meas, tok, tch

    ma, ta, ca = cells("ra")
    ok = ma > 0
    X = np.stack([ta[ok], ca[ok]], axis=1)
    coef = np.linalg.lstsq(X, ma[ok], rcond=None)[0]
    if (coef >= 0).all():
        assert [out["fit"]["a_ns"], out["fit"]["b_ns"]] == pytest.approx(coef, rel=1e-6)
    else:   # one-parameter fallback: one of them is 0
        assert min(out["fit"]["a_ns"], out["fit"]["b_ns"]) == 0
    a, b = out["fit"]["a_ns"], out["fit"]["b_ns"]
    mb, tb, cb = cells("rb")
    pred = a * tb + b * cb
    ok = mb > 0
    m = out["judged"][0]["metrics"]
    assert m["cells_measured"] == ok.sum()
    assert m["expert_mape"] == pytest.approx(np.mean(np.abs(pred[ok] - mb[ok]) / mb[ok]), rel=1e-6)
    assert m["expert_bias"] == pytest.approx(np.mean((pred[ok] - mb[ok]) / mb[ok]), rel=1e-6, abs=1e-9)
    pm, mm = pred.max(axis=2), mb.max(axis=2)
    assert m["straggler_mape"] == pytest.approx(np.mean(np.abs(pm - mm) / mm), rel=1e-6)
    hits = [int(np.argmax(mb[s, la])) in set(np.flatnonzero(pred[s, la] >= pred[s, la].max() * (1 - 1e-9)))
            for s in range(RSTEPS) for la in range(2)]
    assert m["straggler_hit_rate"] == pytest.approx(np.mean(hits))
    s = cal.stored_summary(st, "rb").row(0, named=True)
    assert s["expert_mape"] == pytest.approx(m["expert_mape"], rel=1e-6)
    assert s["straggler_hit_rate"] == pytest.approx(m["straggler_hit_rate"])

    assert "medians over 1 timed pass(es)" in " ".join(out["fit"]["input_notes"])
    # the host slowdown note: summed wall-clock layer time / summed CPU-basis layer time, by hand
    lt = st.sql("SELECT layer_ns, layer_cpu_ns FROM cell_times WHERE run_id = 'ra' AND rank = 0")
    slow = lt["layer_ns"].sum() / lt["layer_cpu_ns"].sum()
    assert f"wall-clock layer time = {slow:.2f} x its CPU-basis time" in " ".join(out["fit"]["input_notes"])


def _expert_by_hand(st, rid, col, spr):
    sp = st.sql(f"SELECT step, layer, rank, {col} d FROM cell_times WHERE run_id = ?", [rid])
    ld = st.sql("SELECT step, layer, slot, sum(tokens) t FROM expert_load WHERE run_id = ? GROUP BY ALL", [rid])
    meas, tok, tch = np.zeros((RSTEPS, 2, RR)), np.zeros((RSTEPS, 2, RR)), np.zeros((RSTEPS, 2, RR))
    for s, la, rk, d in sp.iter_rows():
        meas[s, la, rk] = d
    for s, la, slot, t in ld.iter_rows():
        tok[s, la, slot // spr] += t
        tch[s, la, slot // spr] += t > 0
    return meas, tok, tch


def _fit_judge_by_hand(st, col):
    ma, ta, ca = _expert_by_hand(st, "ra", col, RE // RR)
    ok = ma > 0
    a, b = np.linalg.lstsq(np.stack([ta[ok], ca[ok]], axis=1), ma[ok], rcond=None)[0]
    mb, tb, cb = _expert_by_hand(st, "rb", col, len(REPLICATED) // RR)
    pred, ok = a * tb + b * cb, mb > 0
    return (a, b), float(np.mean(np.abs(pred[ok] - mb[ok]) / mb[ok]))


def test_calibrate_refrun_judges_on_the_cpu_basis_by_default(refrun_pair, runner, cli):
    """On refrun runs the default basis is the ranks' main-thread CPU time; the wall-clock
    errors and each run's host slowdown come beside it, all recomputed here by hand."""
    path = refrun_pair / "st"
    st = Store(path)
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "ra", "--judge-run", "rb", "--json", "--no-store"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["basis"] == "cpu"
    (a, b), mape = _fit_judge_by_hand(st, "expert_cpu_ns")
    if a >= 0 and b >= 0:
        assert [out["fit"]["a_ns"], out["fit"]["b_ns"]] == pytest.approx([a, b], rel=1e-6)
        assert out["judged"][0]["metrics"]["expert_mape"] == pytest.approx(mape, rel=1e-6)
    (wa_a, wa_b), wall_mape = _fit_judge_by_hand(st, "expert_ns")
    if wa_a >= 0 and wa_b >= 0:     # (else the fit falls back to one parameter)
        assert out["wall_clock"]["judged"][0]["metrics"]["expert_mape"] == pytest.approx(wall_mape, rel=1e-6)
    for rid in ("ra", "rb"):
        lt = st.sql("SELECT layer_ns, layer_cpu_ns FROM cell_times WHERE run_id = ? AND rank = 0", [rid])
        assert out["host_slowdown"][rid] == pytest.approx(lt["layer_ns"].sum() / lt["layer_cpu_ns"].sum())
    # the measured layer time on the CPU basis is the layer's CPU-basis time
    cj = cal.observe(st, "rb", basis="cpu")
    lay = st.sql("SELECT step, layer, any_value(layer_cpu_ns)::DOUBLE AS l FROM cell_times WHERE run_id = 'rb' "
                 "GROUP BY ALL")
    want = {(s_, la): v for s_, la, v in lay.iter_rows()}
    got = {}
    for s_, la, e, c in zip(cj.step, cj.layer, cj.expert_ns, cj.comm_ns):
        got[(int(s_), int(la))] = max(got.get((int(s_), int(la)), 0.0), e + c)
    assert got == pytest.approx({k: want[k] for k in got})
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "ra", "--judge-run", "rb", "--no-store"])
    assert r.exit_code == 0, r.output
    assert "judged on the CPU basis" in r.output and "host slowdown" in r.output and "wall_layer_mape_pct" in r.output


def test_error_band_from_the_newest_calibration_on_the_same_hardware(refrun_pair, runner, cli):
    """The band is the judged layer-time MAPE of the calibration, recomputed here from the
    stored cells; a preset or other hardware gets no number, "uncalibrated preset" in words."""
    path = refrun_pair / "st"
    st = Store(path)
    r = runner.invoke(cli, ["calibrate", str(path), "--run", "ra", "--judge-run", "rb", "--calibration-id", "band1"])
    assert r.exit_code == 0, r.output
    hw = cal.run_hardware(st, "ra")
    assert hw and hw.startswith("cpu: ")
    band = cal.error_band(st, hw)
    c = st.sql("SELECT step, layer, measured_expert_ns + measured_comm_ns AS m, "
               "predicted_expert_ns + predicted_comm_ns AS p FROM calibration WHERE calibration_id = 'band1' "
               "AND role = 'judge'")
    per = {}
    for s_, la, m, p in c.iter_rows():
        mm, pp = per.get((s_, la), (0.0, -np.inf))
        per[(s_, la)] = (max(mm, m), max(pp, p))
    want = np.mean([abs(p - m) / m for m, p in per.values()])
    assert band.rel_error == pytest.approx(want, rel=1e-9)
    assert "band1" in band.source and "rb" in band.source
    assert band.within(band.rel_error * 0.5) and not band.within(band.rel_error * 2)
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import calibration as sec

    out = sec.build(ReportContext(st, "rb", st.run_row("rb"), refrun_pair / "rep")).terminal
    assert f"±{100 * want:.1f}%" in out and "within model error" in out
    for other in ("H200", "cpu: another one", None):
        b = cal.error_band(st, other)
        assert b.rel_error is None and b.source.startswith("uncalibrated preset")
        assert not b.within(0.0)


# ----------------------------------------------------------------------------- layer model
def test_fit_layer_model_recovers_known_terms():
    from types import SimpleNamespace

    rng = np.random.default_rng(5)
    t_, l_, r_ = 12, 2, 4
    tok = rng.integers(0, 200, (t_, l_, r_)).astype(float)
    tch = np.minimum(tok, rng.integers(1, 5, (t_, l_, r_))).astype(float)
    byt = tok * 512.0
    blk = SimpleNamespace(tokens=tok, touched=tch, bytes_intra=byt, bytes_inter=np.zeros_like(byt))
    a, b, fixed, lat, per_byte = 40.0, 900.0, 15000.0, 60000.0, 0.25
    comp = fixed + a * tok + b * tch
    slow = comp.argmax(axis=2)
    layer = lat + comp.max(axis=2)
    from moetrace.costmodel.step_cost import CostModel
    free = CostModel(0.0, 0.0, 1e30, 1e30, "bytes cost nothing")     # the base bandwidths: bytes free
    m = calfit.fit_layer_model(blk, comp, layer, ("tokens", "slot", "latency", "fixed"), base=free)
    assert (m.a_ns, m.b_ns, m.fixed_ns, m.latency_ns) == pytest.approx((a, b, fixed, lat), rel=1e-6)
    # the replay's rank_ns reproduces the layer time: latency + the slowest rank's compute
    d, c, cb = m.rank_ns(tok, tch, byt, np.zeros_like(byt))
    assert (d + c + cb).max(axis=2) == pytest.approx(layer, rel=1e-9)
    # a bytes term: the remainder grows with the slowest rank's dispatch + combine bytes
    layer_b = layer + per_byte * 2 * np.take_along_axis(byt, slow[..., None], 2)[..., 0]
    mb = calfit.fit_layer_model(blk, comp, layer_b, ("tokens", "slot", "latency", "fixed", "bytes"), base=free)
    assert mb.latency_ns == pytest.approx(lat, rel=1e-6)
    assert 1e9 / mb.nvlink_Bps == pytest.approx(per_byte, rel=1e-6)
    # without the fixed term, tokens and slots soak it up: the fit is worse, not exact
    m0 = calfit.fit_layer_model(blk, comp, layer, ("tokens", "slot"), base=free)
    assert m0.fixed_ns == 0 and m0.latency_ns == 0
    with pytest.raises(Exception, match="unknown cost-model terms"):
        calfit.fit_layer_model(blk, comp, layer, ("tokens", "wait"))


def test_fidelity_evaluate_by_hand():
    """bench_fidelity.evaluate on a 1-step, 1-layer, 2-rank case worked out by hand."""
    from types import SimpleNamespace

    from benchmarks.bench_fidelity import evaluate
    from moetrace.costmodel.step_cost import CostModel

    model = CostModel(a_ns=10.0, b_ns=0.0, nvlink_Bps=1e30, internode_Bps=1e30, source="t", latency_ns=100.0)
    z = np.zeros((1, 1, 2))
    blk_a = SimpleNamespace(tokens=np.array([[[30.0, 10.0]]]), touched=z, bytes_intra=z, bytes_inter=z)
    blk_b = SimpleNamespace(tokens=np.array([[[18.0, 22.0]]]), touched=z, bytes_intra=z, bytes_inter=z)
    # predicted: A = 100 + 300 = 400, B = 100 + 220 = 320 -> ratio 0.8; measured A 500, B 350 -> 0.7
    meas_a = (np.array([[[290.0, 110.0]]]), np.array([[[0.01, 0.01]]]), np.array([[500.0]]))
    meas_b = (np.array([[[170.0, 230.0]]]), np.array([[[0.05, 0.3]]]), np.array([[350.0]]))
    ev = evaluate(model, blk_a, blk_b, meas_a, meas_b)
    assert ev["layer_mape"] == pytest.approx(30 / 350)
    assert ev["ratio_pred"] == pytest.approx(0.8) and ev["ratio_meas"] == pytest.approx(0.7)
    assert ev["ratio_err"] == pytest.approx(0.8 / 0.7 - 1)
    # predicted straggler rank 1 (220 vs 180): gap 40/220 = 0.18 < the measured spread 0.3 -> not decided
    assert ev["straggler_decided"] == 0 and ev["straggler_hits_all"] == 1


def test_gpu_gemm_bench_on_cpu_tiny_shape():
    pytest.importorskip("torch")
    from benchmarks import bench_gpu_gemm as g

    rows = g.time_grid(16, 8, "float32", [1, 2], [1, 8], 2, "cpu")
    assert [(r["experts"], r["tokens_per_expert"]) for r in rows] == [(1, 1), (1, 8), (2, 1), (2, 8)]
    assert all(r["ns"] > 0 for r in rows)
    # the fit recovers known coefficients from exact times, with and without tile rounding
    grid = [{"experts": n, "tokens_per_expert": t, "ns": 3.0 * n * t + 700.0 * n} for n in (1, 2, 4) for t in (1, 5, 9)]
    f = g.fit(grid)
    assert (f["a_ns"], f["b_ns"]) == pytest.approx((3.0, 700.0), rel=1e-6) and f["mape"] < 1e-9
    tiled = [{**r, "ns": 3.0 * r["experts"] * 8 * np.ceil(r["tokens_per_expert"] / 8) + 700.0 * r["experts"]}
             for r in grid]
    assert (g.fit(tiled, 8)["a_ns"], g.fit(tiled, 8)["b_ns"]) == pytest.approx((3.0, 700.0), rel=1e-6)
    assert g.fit(tiled)["mape"] > 1e-3      # the plain fit cannot follow the steps
    assert g.run("small")        # the script's own small size runs on CPU


@pytest.mark.slow
def test_fidelity_matrix_small_runs_for_real(tmp_path, forked_ranks):
    """The matrix at its CI size: real re-runs, every pair's replay of A's routing under B's
    plan gives B's measured per-rank tokens exactly (asserted inside), one row per pair and
    model variant, and the printed table names every target."""
    pytest.importorskip("torch")
    from benchmarks import bench_fidelity as bf

    res = bf.run_matrix("small", tmp_path, log=lambda m: None)
    pairs = sum(len(bf.PAIRS[t[0]]) for t in bf.SIZES["small"]["traffic"])
    assert pairs >= 6 and len(res["rows"]) == pairs * len(bf.VARIANTS) * len(bf.ESTIMATORS)
    for r in res["rows"]:
        assert r["ratio_err"] == pytest.approx(r["ratio_pred"] / r["ratio_meas"] - 1)
    text = bf.format_report(res)
    for key in ("ratio error median", "layer MAPE", "straggler right", "load average"):
        assert key in text

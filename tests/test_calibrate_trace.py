"""Calibration on a run's own measurements: the shipped CPU pair judged on the fidelity
basis, a GPU-shaped Kineto trace with known kernel costs fitted and judged on held-out
steps, the real DeepSeek trace, and a replay that uses its run's own calibrated model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetrace.run import Store

from .helpers.calibration_runs import exact_store  # noqa: F401  (a fixture: one run with trace and routing)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


# ----------------------------------------------------------------------------- the shipped CPU pair
def _by_hand(st, rid: str, spr: int):
    """Per (step, layer): each rank's tokens and slots touched (expert_load, slot // slots per
    rank), each rank's CPU-basis expert time and the layer's CPU-basis time (cell_times)."""
    T, L, R = 8, 2, 4
    tok, tch, ex, lay = np.zeros((T, L, R)), np.zeros((T, L, R)), np.zeros((T, L, R)), np.zeros((T, L))
    for s, la, slot, t in st.sql("SELECT step, layer, slot, sum(tokens) FROM expert_load WHERE run_id = ? "
                                 "GROUP BY ALL", [rid]).iter_rows():
        tok[s, la, slot // spr] += t
        tch[s, la, slot // spr] += t > 0
    for s, la, r, e, lc in st.sql("SELECT step, layer, rank, expert_cpu_ns, layer_cpu_ns FROM cell_times "
                                  "WHERE run_id = ?", [rid]).iter_rows():
        ex[s, la, r] = e
        lay[s, la] = lc
    return tok, tch, ex, lay


def test_shipped_cpu_pair_judged_within_ten_percent(tmp_path, runner, cli):
    """The README's commands on the shipped pair: the default calibrate fits the fidelity
    basis on the CPU times and judges run B's layer time within 10%; the error is recomputed
    here from the raw tables (a, b by least squares, the latency as the median layer time
    beyond the slowest rank's experts; the all-to-all bytes at the preset's NVLink rate
    change a layer by microseconds of milliseconds)."""
    st_path = tmp_path / "st"
    for rid in ("refrun", "refrun_eplb"):
        r = runner.invoke(cli, ["ingest", str(SAMPLES / rid), "--store", str(st_path), "--run-id", rid])
        assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["calibrate", str(st_path), "--run", "refrun", "--judge-run", "refrun_eplb", "--json",
                            "--no-store"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["basis"] == "cpu" and out["method"] == "layer"
    st = Store(st_path)
    ta, ca, ea, la = _by_hand(st, "refrun", 4)
    a, b = np.linalg.lstsq(np.stack([ta.ravel(), ca.ravel()], 1), ea.ravel(), rcond=None)[0]
    assert a > 0 and b > 0
    assert [out["fit"]["a_ns"], out["fit"]["b_ns"]] == pytest.approx([a, b], rel=1e-6)
    lat = np.median(la - (a * ta + b * ca).max(axis=2))
    # the bytes left out here move the latency by a few µs (the layers take milliseconds)
    assert out["fit"]["comm_latency_ns"] == pytest.approx(lat, abs=10e3)
    tb, cb, _, lb = _by_hand(st, "refrun_eplb", 5)
    judged = float(np.mean(np.abs((a * tb + b * cb).max(axis=2) + lat - lb) / lb))
    got = out["judged"][0]["metrics"]["layer_mape"]
    assert got == pytest.approx(judged, rel=2e-2)
    assert got <= 0.10


# ----------------------------------------------------------------------------- a GPU-shaped trace, known costs
R, RPN, E, K, L, T = 4, 2, 16, 2, 2, 16
SPR = E // R
A_NS, B_NS = 42.0, 9000.0                # expert GEMM: ns per token row, ns per slot touched (weight read)
LAT_NS, C_INTRA, C_INTER = 30000.0, 0.02, 0.08   # dispatch + combine: ns, ns per byte intra node, inter node
NOISE = 0.03                             # relative noise of every kernel duration (uniform, ± 3%)
DISPATCH = "void deep_ep::internode::dispatch<false, 8, true, 4>(int4*, float*, int*)"
COMBINE = "void deep_ep::internode::combine<false, 8, __nv_bfloat16>(int4*, float*, int*)"
GEMM = "void cutlass::device_kernel<grouped_gemm::fp8::GemmKernel>(grouped_gemm::fp8::GemmKernel::Params)"


def _routing(seed: int = 7) -> np.ndarray:
    """Per-token routing rows (step, layer, token, src_rank, choice, expert): a skewed,
    drifting router; token t of a step comes from rank t % R."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(T):
        n = int(rng.integers(4, 400))           # decode-sized to prefill-sized steps: slots touched vary
        for layer in range(L):
            p = rng.dirichlet(np.full(E, 0.3))
            for tok in range(n):
                for c, e in enumerate(rng.choice(E, K, replace=False, p=p)):
                    rows.append((s, layer, tok, tok % R, c, int(e)))
    return np.array(rows, np.int64)


def _cell_truth(rt: np.ndarray, bytes_per_token: int):
    """Independent per (step, layer, rank): token rows, slots touched, bytes received from
    the same node / other nodes (each token once per distinct destination rank, nothing from
    its own rank), contiguous placement (slot = expert)."""
    tok, tch = np.zeros((T, L, R)), np.zeros((T, L, R))
    bi, bo = np.zeros((T, L, R)), np.zeros((T, L, R))
    dest: dict = {}
    hit = np.zeros((T, L, E), bool)
    for s, layer, t, src, _c, e in rt:
        r = e // SPR
        tok[s, layer, r] += 1
        hit[s, layer, e] = True
        dest.setdefault((s, layer, t, src), set()).add(r)
    for r in range(R):
        tch[:, :, r] = hit[:, :, r * SPR:(r + 1) * SPR].sum(axis=2)
    for (s, layer, _t, src), rs in dest.items():
        for r in rs:
            if r != src:
                (bi if r // RPN == src // RPN else bo)[s, layer, r] += bytes_per_token
    return tok, tch, bi, bo


def _write_gpu_trace(folder: Path, tok, tch, bi, bo, seed: int = 3):
    """One Kineto JSON per rank: per step a ProfilerStep#N range, per layer a 'moe layer N'
    range whose launches run a DeepEP dispatch, a grouped GEMM and a DeepEP combine; kernel
    durations are the known costs times (1 ± NOISE). Returns the noiseless times."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    truth_ex = A_NS * tok + B_NS * tch
    truth_comm = LAT_NS + C_INTRA * bi + C_INTER * bo           # dispatch + combine
    for r in range(R):
        ev, corr, t = [], 0, 1_000_000.0    # ns from the base time

        def x(cat, name, ts, dur, pid, tid, ev=ev, **args):
            ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": round(ts / 1e3, 3),
                       "dur": round(dur / 1e3, 3), "args": args})

        for s in range(T):
            s0 = t
            x("user_annotation", f"ProfilerStep#{s}", s0, 1e3, 100, 1)
            for layer in range(L):
                c0 = t      # the host launches the layer's three kernels, the GPU runs them after
                x("user_annotation", f"moe layer {layer}", c0 + 10, 500, 100, 1)
                parts = [(DISPATCH, 20, truth_comm[s, layer, r] / 2), (GEMM, 7, truth_ex[s, layer, r]),
                         (COMBINE, 20, truth_comm[s, layer, r] / 2)]
                for i, (name, stream, dur) in enumerate(parts):
                    corr += 1
                    x("cuda_runtime", "cudaLaunchKernel", c0 + 20 + 100 * i, 5, 100, 1, correlation=corr)
                    d = dur * (1 + rng.uniform(-NOISE, NOISE))
                    x("kernel", name, t + 2000, d, 0, stream, device=0, stream=stream, correlation=corr)
                    t += 2000 + d
            ev[[e["name"] for e in ev].index(f"ProfilerStep#{s}")]["dur"] = round((t - s0) / 1e3 - 0.5, 3)
            t += 5000
        doc = {"schemaVersion": 1, "baseTimeNanoseconds": 1767189312000000000,
               "distributedInfo": {"backend": "nccl", "rank": r, "world_size": R}, "traceEvents": ev}
        (folder / f"rank{r}.json").write_text(json.dumps(doc))
    return truth_ex, truth_comm


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory):
    """Run 'eng': the per-token routing (the engine's dump); run 'prof': the profiler trace of
    the same steps, whose kernels cost the known A_NS, B_NS, LAT_NS, C_INTRA, C_INTER."""
    import polars as pl
    from click.testing import CliRunner

    from moetrace.cli import cli
    from moetrace.replay.load import read_shape

    root = tmp_path_factory.mktemp("gputrace")
    rt = _routing()
    pl.DataFrame({"step": rt[:, 0], "layer": rt[:, 1].astype(np.int32), "token": rt[:, 2],
                  "src_rank": rt[:, 3].astype(np.int32), "choice": rt[:, 4].astype(np.int8),
                  "expert": rt[:, 5].astype(np.int32), "gate": np.full(len(rt), 0.5, np.float32)}
                 ).write_parquet(root / "routing.parquet")
    st = root / "st"
    run = CliRunner().invoke
    r = run(cli, ["ingest", str(root / "routing.parquet"), "--store", str(st), "--run-id", "eng", "--ranks", str(R),
                  "--ranks-per-node", str(RPN), "--experts", str(E), "--top-k", str(K), "--layers", str(L)])
    assert r.exit_code == 0, r.output
    bpt = read_shape(Store(st), "eng").bytes_per_token
    tok, tch, bi, bo = _cell_truth(rt, bpt)
    truth = _write_gpu_trace(root / "prof", tok, tch, bi, bo)
    r = run(cli, ["ingest", str(root / "prof"), "--store", str(st), "--run-id", "prof"])
    assert r.exit_code == 0, r.output
    return st, (tok, tch, bi, bo), truth


def test_gpu_trace_kernels_are_classified_and_placed(gpu_store):
    st, _, _ = gpu_store
    df = Store(st).sql("SELECT kind, count(*) AS n, count(step) AS with_step, count(layer) AS with_layer FROM spans "
                       "WHERE run_id = 'prof' GROUP BY kind ORDER BY kind")
    got = {k: (n, s_, la) for k, n, s_, la in df.iter_rows()}
    for kind in ("combine", "dispatch", "expert_gemm"):
        assert got[kind] == (T * L * R,) * 3


def test_calibrate_gpu_trace_recovers_known_costs_within_its_band(gpu_store, runner, cli):
    """Fitted on alternating blocks of steps, judged on the others: a, b, the latency and
    the per-byte costs come back within the band calibrate states, and that band is what the
    held-out cells give, recomputed here from the truth."""
    st, (tok, tch, bi, bo), (truth_ex, truth_comm) = gpu_store
    r = runner.invoke(cli, ["calibrate", str(st), "--run", "prof", "--load", "prof=eng", "--block", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["method"] == "cells" and out["held_out"] == "blocks"
    f, (j,) = out["fit"], out["judged"]
    assert j["held_out"] and j["steps_text"] == "4–7, 12–15" and f["steps_text"] == "0–3, 8–11"
    band = out["band"]["rel_error"]
    assert out["band"]["what"] == "layer-time" and 0 < band < 2 * NOISE
    m = j["metrics"]
    held = np.isin(np.arange(T), [4, 5, 6, 7, 12, 13, 14, 15])
    # the recovered cost functions against the known ones on every held-out cell: within the
    # held-out band calibrate states for that term (a and b trade off where tokens and slots
    # touched move together, so the times are what the band is about)
    fit_ex = f["a_ns"] * tok + f["b_ns"] * tch
    fit_comm = f["comm_latency_ns"] + f["comm_ns_per_byte_intra"] * bi + f["comm_ns_per_byte_inter"] * bo
    assert np.mean(np.abs(fit_ex[held] / truth_ex[held] - 1)) <= m["expert_mape"]
    assert np.mean(np.abs(fit_comm[held] / truth_comm[held] - 1)) <= m["comm_mape"]
    assert np.mean(np.abs((fit_ex + fit_comm)[held].max(axis=2) / (truth_ex + truth_comm)[held].max(axis=2) - 1)) <= band
    # each parameter within 3 standard errors of least squares on the fit cells (by hand)
    fit_cells = ~held
    for X, y_true, got, want in (
            (np.stack([tok[fit_cells].ravel(), tch[fit_cells].ravel()], 1), truth_ex[fit_cells].ravel(),
             (f["a_ns"], f["b_ns"]), (A_NS, B_NS)),
            (np.stack([np.ones(fit_cells.sum() * L * R), bi[fit_cells].ravel(), bo[fit_cells].ravel()], 1),
             truth_comm[fit_cells].ravel(), (f["comm_latency_ns"], f["comm_ns_per_byte_intra"],
                                             f["comm_ns_per_byte_inter"]), (LAT_NS, C_INTRA, C_INTER))):
        sigma = NOISE / np.sqrt(3) * y_true                  # sd of a uniform relative error, per cell
        cov = np.linalg.inv(X.T @ X) @ (X.T * sigma ** 2) @ X @ np.linalg.inv(X.T @ X)
        for g, w, se in zip(got, want, np.sqrt(np.diag(cov))):
            assert abs(g - w) <= 3 * se, (g, w, se)
    # the band: the held-out layer-time error, from the measured durations (truth x noise)
    meas = Store(st).sql("SELECT step, layer, rank, sum(end_ns - start_ns) AS d, kind = 'expert_gemm' AS ex "
                         "FROM spans WHERE run_id = 'prof' GROUP BY ALL")
    me, mc = np.zeros((T, L, R)), np.zeros((T, L, R))
    for s_, la, rk, d, ex in meas.iter_rows():
        (me if ex else mc)[s_, la, rk] += d
    pred = (f["a_ns"] * tok + f["b_ns"] * tch + f["comm_latency_ns"] + f["comm_ns_per_byte_intra"] * bi
            + f["comm_ns_per_byte_inter"] * bo)[held].max(axis=2)
    lay = (me + mc)[held].max(axis=2)
    assert band == pytest.approx(np.mean(np.abs(pred - lay) / lay), rel=1e-6)
    # stored: the fit rows carry the model with its band
    mj = Store(st).sql("SELECT DISTINCT model_json FROM calibration WHERE run_id = 'prof' AND role = 'fit'")
    model = json.loads(mj["model_json"][0])
    assert model["rel_error"] == pytest.approx(band) and model["calibration"]["load_run_id"] == "eng"


def test_calibrate_on_the_real_deepseek_trace_says_what_it_lacks(tmp_path, runner, cli):
    """DeepSeek's published EP64 trace (rank 0, one DualPipe step, balanced routing forced,
    no expert-load dump): calibrate refuses in one line that counts the MoE kernels it found
    and names each missing input, and leaves the store as it was."""
    from .helpers import shared_data, tree_hash

    src = shared_data("deepseek_ep64_train_rank0.json.gz")
    st = tmp_path / "st"
    r = runner.invoke(cli, ["ingest", str(src), "--store", str(st), "--run-id", "ds"])
    assert r.exit_code == 0, r.output
    kinds = {k: n for k, n in Store(st).sql("SELECT kind, count(*) AS n FROM spans WHERE run_id = 'ds' "
                                           "GROUP BY kind").iter_rows()}
    before = tree_hash(st)
    r = runner.invoke(cli, ["calibrate", str(st), "--run", "ds"])
    assert r.exit_code == 2
    msg = r.output.strip()
    assert len(msg.splitlines()) == 1
    assert (f"{kinds['dispatch']} dispatch, {kinds['combine']} combine, {kinds['expert_gemm']} expert_gemm "
            "kernels in 1 step(s)") in msg
    assert "no routing or expert load" in msg and "carry no layer" in msg and "needs 2 steps" in msg
    assert tree_hash(st) == before


# ----------------------------------------------------------------------------- replay uses it
def test_replay_of_a_run_with_its_own_trace_uses_that_model_and_says_so(gpu_store, runner, cli):
    st, (tok, tch, bi, bo), _ = gpu_store
    r = runner.invoke(cli, ["calibrate", str(st), "--run", "prof", "--load", "prof=eng", "--block", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    f, band = out["fit"], out["band"]["rel_error"]
    r = runner.invoke(cli, ["replay", str(st), "--run", "eng", "--policy", "eplb-global", "--json", "--no-rank-rows"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    cost = rep["cost"]
    assert cost["source"].startswith("fitted on this run's trace, steps 0–3, 8–11, band "
                                     f"±{100 * band:.1f}% measured on steps 4–7, 12–15")
    assert rep["error_band"]["rel"] == pytest.approx(band)
    assert (cost["a_ns"], cost["b_ns"], cost["latency_ns"]) == pytest.approx((f["a_ns"], f["b_ns"],
                                                                             f["comm_latency_ns"]))
    # the replay's all-to-all (latency + 2 x bytes / bandwidth) is what calibrate fitted per byte
    assert 2e9 / cost["nvlink_Bps"] == pytest.approx(f["comm_ns_per_byte_intra"])
    assert 2e9 / cost["internode_Bps"] == pytest.approx(f["comm_ns_per_byte_inter"])
    # the recorded placement's predicted step time, by hand from the fitted terms and the exact bytes
    judged = np.arange(T // 2, T)            # the plan is fitted on the first half, judged on the rest
    lay = (f["a_ns"] * tok + f["b_ns"] * tch + f["comm_latency_ns"] + f["comm_ns_per_byte_intra"] * bi
           + f["comm_ns_per_byte_inter"] * bo)[judged].max(axis=2)
    assert rep["recorded_step_ns"] == pytest.approx(lay.sum(axis=1).mean(), abs=1)      # integer ns
    r = runner.invoke(cli, ["replay", str(st), "--run", "eng", "--policy", "eplb-global"])
    assert r.exit_code == 0, r.output
    assert "cost model: fitted on this run's trace, steps 0–3, 8–11" in r.output
    # drift and sweep time with the same model and band, and say so
    r = runner.invoke(cli, ["replay", str(st), "--run", "eng", "--policy", "eplb-global", "--replan-every", "4",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["error_band"]["rel"] == pytest.approx(band)
    r = runner.invoke(cli, ["sweep", str(st), "--run", "eng", "--policy", "eplb-global", "--replicas", "0,4"])
    assert r.exit_code == 0, r.output
    assert "same cost model (fitted on this run's trace, steps 0–3, 8–11" in " ".join(r.output.split())   # notes wrap
    assert f"model's ±{band:.0%} error (layer-time error {100 * band:.1f}% measured on held-out steps" in " ".join(r.output.split())
    # --no-fit: the preset, not the trace's model; --cost-model names a run without one: refused
    r = runner.invoke(cli, ["replay", str(st), "--run", "eng", "--policy", "eplb-global", "--no-fit", "--json",
                            "--no-rank-rows"])
    assert json.loads(r.output)["cost"]["source"].startswith("preset H200")
    r = runner.invoke(cli, ["sweep", str(st), "--run", "eng", "--replicas", "0", "--cost-model", "eng2"])
    assert r.exit_code == 2 and "no cost model fitted on run 'eng2'" in r.output


def test_held_out_half_and_refusals(gpu_store, runner, cli):
    from .helpers import tree_hash

    st, _, _ = gpu_store
    r = runner.invoke(cli, ["calibrate", str(st), "--run", "prof", "--load", "prof=eng", "--held-out", "half",
                            "--json", "--no-store"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["fit"]["steps_text"] == "0–7" and out["judged"][0]["steps_text"] == "8–15"
    assert out["band"]["source"].startswith(f"layer-time error {100 * out['band']['rel_error']:.1f}% measured on "
                                            "held-out steps 8–15 of run prof")
    before = tree_hash(st)
    for args, words in ((["--held-out", "blocks", "--judge-run", "eng"], "leave out --judge-run"),
                        (["--block", "16"], "blocks of 16 steps leave nothing to hold out of 16 steps")):
        r = runner.invoke(cli, ["calibrate", str(st), "--run", "prof", "--load", "prof=eng", *args])
        assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert tree_hash(st) == before


def test_replay_of_a_run_with_its_own_trace_calibrates_in_memory(exact_store, runner, cli):
    """A run that holds its trace and its routing, never calibrated: the replay fits the
    model on alternating blocks of its steps, states the band of the others, says so, and
    writes no calibration. The model is the known one (exact durations)."""
    from .helpers.calibration_runs import A_TRUE, B_TRUE, LAT

    st, _ = exact_store
    r = runner.invoke(cli, ["replay", str(st.path), "--run", "a", "--policy", "eplb-global", "--json",
                            "--no-rank-rows"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    cost = rep["cost"]
    assert cost["source"].startswith("fitted on this run's trace, steps 0–1, 4–5, 8–9, band ±")
    assert "measured on steps 2–3, 6–7" in cost["source"] and "fitted in memory, not stored" in cost["source"]
    assert (cost["a_ns"], cost["b_ns"], cost["latency_ns"]) == pytest.approx((A_TRUE, B_TRUE, LAT), rel=1e-2)
    ref = Store(st.path).run("a").calibrate(write=False, held_out="blocks")
    assert rep["error_band"]["rel"] == pytest.approx(ref["band"]["rel_error"]) and ref["band"]["rel_error"] < 0.01
    assert not Store(st.path).has_files("calibration")


def test_report_section_shows_the_held_out_judgement(exact_store, tmp_path):
    from moetrace.report.base import ReportContext
    from moetrace.report.sections import calibration as sec

    st, _ = exact_store
    out = st.run("a").calibrate(held_out="blocks", calibration_id="held1")
    assert out["judged"][0]["steps_text"] == "2–3, 6–7"
    text = sec.build(ReportContext(st, "a", st.run_row("a"), tmp_path / "rep")).terminal
    assert "Newest calibration held1 (judged on held-out steps 2–3, 6–7 of this run, fitted on its other steps)" in text

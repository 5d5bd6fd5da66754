"""The replay's all-to-all kernel inputs (--kernel, --sms, --max-nodes-per-token on
replay, drift and sweep): the time and band come from that kernel family's model on that
GPU, the words "not validated on <GPU>/<kernel>" follow the band, and a verdict decides
only beyond the band of the model actually applied."""
import json
from pathlib import Path

import numpy as np
import pytest

from moetrace.costmodel import FAMILIES, fitted, regime_params
from moetrace.costmodel import step_cost as costmod
from moetrace.costmodel.hardware import gpu
from moetrace.costmodel.replay_gpu import comm_ns, comm_received_ns
from moetrace.replay import strategies
from moetrace.run import ClusterSpec, Store

from .helpers import module_fixture, one_line_error, run_cli

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "dsv3_synth_expert_load.parquet"
REPLAY = ("--run", "dsv3", "--policy", "eplb", "--replicas", 32, "--fit-steps", "0:100", "--no-rank-rows")


@module_fixture
def dsv3(tmp_path_factory):
    """The shipped DeepSeek-V3-shaped sample, ingested as sample_traces/demo.sh does."""
    path = tmp_path_factory.mktemp("kernel") / "store"
    r = run_cli("ingest", SAMPLE, "--store", path, "--run-id", "dsv3", "--ranks", 32, "--ranks-per-node", 8,
                "--top-k", 8, "--experts", 256, "--layers", 4, "--groups", 8)
    assert r.exit_code == 0, r.output
    return path


def _band(key: str) -> dict:
    return fitted()["bands"][key]       # read from the data file, not through the code under test


def test_replay_b200_hybrid_ep_shows_that_kernels_band_and_words(dsv3):
    r = run_cli("replay", dsv3, *REPLAY, "--hardware", "B200", "--kernel", "hybrid-ep", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    g, a = _band("B200/gemm_grouped"), _band("B200/hybrid-ep")
    # the step band is the larger of the expert-GEMM and the hybrid-ep all-to-all band
    assert d["error_band"]["rel"] == pytest.approx(max(g["band"], a["band"]))
    src = d["error_band"]["source"]
    assert f"hybrid-ep all-to-all band ±{a['band']:.0%}" in src
    assert ("not validated on B200/gemm_grouped" in src) == (not g["validated"])
    assert ("not validated on B200/hybrid-ep" in src) == (not a["validated"])
    text = run_cli("replay", dsv3, *REPLAY, "--hardware", "B200", "--kernel", "hybrid-ep").output
    assert "time verdict:" in text and f"±{max(g['band'], a['band']):.0%}" in text
    flat = " ".join(text.split())      # the answer wraps to the terminal
    assert "not validated on B200/" in flat.split("time verdict:")[1].split(" cost model:")[0]
    assert "all-to-all timed as DeepEP hybrid-ep" in flat and f"on {FAMILIES['hybrid-ep']['sms']} SMs" in flat


def test_the_kernel_changes_the_replayed_time_and_the_python_api_takes_it(dsv3):
    run = Store(dsv3).run("dsv3")
    kw = dict(policy="eplb", fit_window=(0, 100), write=False, hardware="B200")
    normal = run.replay(cluster=ClusterSpec(replicas=32), **kw)
    hybrid = run.replay(cluster=ClusterSpec(replicas=32, kernel="hybrid-ep"), **kw)
    few = run.replay(cluster=ClusterSpec(replicas=32, kernel="hybrid-ep", sms=4), **kw)
    assert normal.cost.gpu["kernel"] == "normal" and hybrid.cost.gpu["kernel"] == "hybrid-ep"
    assert hybrid.judged.recorded_step_ns != pytest.approx(normal.judged.recorded_step_ns, rel=1e-3)
    # 4 SMs move fewer bytes per second than 16: the all-to-all, and so the step, takes longer
    assert few.judged.recorded_step_ns > hybrid.judged.recorded_step_ns
    assert any("node-limited routing (4 nodes per token) is not applied" in n for n in normal.notes)


def test_comm_with_sms_is_the_p_norm_of_link_and_sm_time():
    """A rank's dispatch by hand: latency + (link^3 + sm^3)^(1/3) on the FP8 message."""
    spec = costmod.preset("B200", 7168, kernel="hybrid-ep", sms=8).gpu
    hw, p = gpu("B200"), regime_params("hybrid-ep")
    intra, inter = np.array([3.0e6, 0.0]), np.array([1.0e6, 0.0])
    fp8 = (7168 + 7168 / 128 * 4) / (7168 * 2)
    link = max(inter[0] * fp8 / (p["eff_rdma"] * hw.rdma_Bps), intra[0] * fp8 / (p["eff_nvl"] * hw.nvlink_Bps))
    sm = (intra[0] + inter[0]) * fp8 / (8 * p["sm_gbps"] * 1e9)
    disp, comb = comm_ns(spec, intra, inter)
    assert disp[0] == pytest.approx(p["latency_us"] * 1e3 + (link ** 3 + sm ** 3) ** (1 / 3) * 1e9, rel=1e-12)
    assert disp[1] == comb[1] == 0.0          # receives nothing: no all-to-all time
    # the per-token form equals the sum of the two messages when bytes are received x per token
    rec = np.array([100.0, 250.0])
    d2, c2 = comm_ns(spec, rec * 3e3, rec * 1e3)
    assert comm_received_ns(spec, rec, 3e3, 1e3) == pytest.approx(d2 + c2, rel=1e-12)


def test_a_gain_inside_a_wide_unvalidated_band_is_not_a_win():
    cost = costmod.preset("H200", kernel="pplx")
    band = costmod.error_band(cost)
    assert band.unvalidated() and band.rel_error > 1.0      # pplx has no published row: a wide band
    word, why = strategies.verdict(0.5e6, 1.0e6, 50, cost)  # −50%, inside the band
    assert word == strategies.NOT_ENOUGH and "within the model's" in why and "not validated on H200/pplx" in why
    word, why = strategies.verdict(1.0e6 * (2 + band.rel_error), 1.0e6, 50, cost)   # beyond it: decides
    assert word == strategies.DOES_NOT and "beyond" in why and "not validated on H200/pplx" in why


def test_drift_and_sweep_take_the_kernel(dsv3):
    a = _band("B200/hybrid-ep")
    r = run_cli("replay", dsv3, "--run", "dsv3", "--policy", "eplb", "--replan-every", 50, "--hardware", "B200",
                "--kernel", "hybrid-ep", "--sms", 24)
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())   # the answer wraps to the terminal
    assert f"hybrid-ep all-to-all band ±{a['band']:.0%}" in flat and "on 24 SMs" in flat
    r = run_cli("sweep", dsv3, "--run", "dsv3", "--replicas", "0,32", "--hardware", "B200", "--kernel", "hybrid-ep",
                "--format", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert rows and all(f"hybrid-ep all-to-all band ±{a['band']:.0%}" in " ".join(map(str, row.values()))
                        for row in rows)


@pytest.mark.parametrize("args, needle", [
    (("--sms", 0), "--sms"), (("--sms", "x"), "--sms"), (("--sms", 500), "--sms"),
    (("--max-nodes-per-token", -1), "--max-nodes-per-token")])
def test_bad_kernel_inputs_exit_2_in_one_line(dsv3, args, needle):
    one_line_error(run_cli("replay", dsv3, *REPLAY, "--hardware", "B200", *args), needle)

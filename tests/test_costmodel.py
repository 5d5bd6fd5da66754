"""The GPU cost model (moetrace/costmodel) against hand computations and the published
rows it was fitted on, and the ``moetrace cost`` command."""
from __future__ import annotations

import json
import math
from math import comb

import numpy as np
import pytest

from moetrace import costmodel
from moetrace.costmodel import fit as F
from moetrace.costmodel.a2a import A2AParams, low_latency_terms, routing_counts
from moetrace.costmodel.gemm import GemmParams, gemm_terms, tile_config
from moetrace.costmodel.hardware import GPUS

from .helpers import run_cli

H800 = GPUS["H800"]
ROWS = F.load_rows()
FITTED = costmodel.fitted()
GOAL = {"gemm_grouped": 0.10, "a2a_normal": 0.15, "a2a_low_latency": 0.15}


def test_tile_choice_by_hand():
    # m=64, n=2112 on 132 SMs: only block_n=16 gives 132 tiles = one full wave; block_m 64,
    # 128 and 256 all cover m in one tile, and the smaller block_m wins the tie
    assert tile_config([64], 2112, 132) == (64, 16, 132, 1)
    # contiguous layout: block_m fixed at 128
    assert tile_config([256] * 4, 4096, 132, contiguous=True)[0] == 128


def test_roofline_terms_by_hand():
    p = GemmParams(eff_compute=0.5, eff_hbm=0.5, p=2.0, tile_us=0.0, launch_us=0.0)
    t = gemm_terms(H800, p, [64], 2112, 7168, "fp8")
    tc = 1 * 2 * 64 * 16 * 7168 / (0.5 * 1979e12 / 132)            # one wave of 64x16 tiles
    nbytes = 64 * 7168 * 1 + 2112 * 7168 * 1 + 64 * 2112 * 2          # A fp8, B fp8, out bf16
    tm = nbytes / (0.5 * 3.35e12)
    assert t["compute_s"] == pytest.approx(tc, rel=1e-12)
    assert t["memory_s"] == pytest.approx(tm, rel=1e-12)
    assert t["time_s"] == pytest.approx(math.hypot(tc, tm), rel=1e-12)
    # p = 1 is the plain sum, a large p tends to the max; the launch cost adds
    s = gemm_terms(H800, GemmParams(0.5, 0.5, 1.0, 0.0, 3.0), [64], 2112, 7168)["time_s"]
    assert s == pytest.approx(tc + tm + 3e-6, rel=1e-12)
    mx = gemm_terms(H800, GemmParams(0.5, 0.5, 60.0, 0.0, 0.0), [64], 2112, 7168)["time_s"]
    assert mx == pytest.approx(max(tc, tm), rel=0.02)


def test_bf16_doubles_bytes_and_halves_rate():
    p = GemmParams(1.0, 1.0, 2.0, 0.0, 0.0)
    a = gemm_terms(H800, p, [512], 4096, 7168, "fp8")
    b = gemm_terms(H800, p, [512], 4096, 7168, "bf16")
    assert b["compute_s"] == pytest.approx(2 * a["compute_s"])
    assert b["bytes"] == 512 * 7168 * 2 + 4096 * 7168 * 2 + 512 * 4096 * 2


def test_quantization_steps():
    p = GemmParams(**FITTED["regimes"]["gemm_grouped"]["params"])
    c = {m: gemm_terms(H800, p, [m], 4096, 7168)["compute_s"] for m in (1, 32, 64, 65, 128)}
    # one token costs a whole block_m=64 tile: compute flat from 1 to 64 rows, then a step
    assert c[1] == c[32] == c[64]
    assert c[65] > c[64]
    # 1 token per expert is far from 1/64 of 64 tokens' time
    t1 = gemm_terms(H800, p, [1], 4096, 7168)["time_s"]
    t64 = gemm_terms(H800, p, [64], 4096, 7168)["time_s"]
    assert t1 > 0.5 * t64


def test_published_gemm_columns_agree():
    # the CSV's time (from TFLOPS) times the published GB/s gives DeepGEMM's byte count
    for r in ROWS:
        if r["regime"].startswith("gemm"):
            g, m, n, k = r["groups"], r["m_per_group"], r["n"], r["k"]
            nbytes = g * (m * k + k * n + 2 * m * n)
            assert nbytes / (r["time_us"] * 1e-6) / 1e9 == pytest.approx(r["bandwidth_gbps"], rel=0.012), r["row_id"]
            assert r["source_commit"] and len(r["source_commit"]) == 40


def test_low_latency_bytes_match_published_bandwidth():
    # DeepEP's low-latency "RDMA bandwidth" = tokens*top_k*message bytes / latency: our byte
    # count reproduces the published bandwidth from the published latency
    p = A2AParams(0.0, 1.0, 1.0)
    for r in ROWS:
        if r["regime"] == "a2a_low_latency":
            t = low_latency_terms(H800, p, ep=r["ep"], ranks_per_node=8, tokens=128, top_k=8, hidden=7168,
                                  dtype=r["dtype"], direction=r["direction"])
            assert t["logical_bytes"] / (r["time_us"] * 1e-6) / 1e9 == pytest.approx(r["bandwidth_gbps"], rel=0.03)


def test_routing_counts_closed_form_and_monte_carlo():
    rc = routing_counts(8, 8, 8, 256, 4)
    assert rc["ranks"] == pytest.approx(8 * (1 - comb(224, 8) / comb(256, 8)))
    assert rc["remote_nodes"] == 0
    # EP 32 (4 nodes, all chosen): a second implementation by sampling
    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((20000, 256)), axis=1)[:, :8]
    nodes = np.array([len(set(row)) for row in picks // 64])
    ranks = np.array([len(set(row)) for row in picks // 8])
    rc = routing_counts(32, 8, 8, 256, 4)
    assert rc["nodes"] == pytest.approx(nodes.mean(), rel=0.01)
    assert rc["ranks"] == pytest.approx(ranks.mean(), rel=0.01)


@pytest.mark.parametrize("regime", ["gemm_grouped", "a2a_normal", "a2a_low_latency"])
def test_every_published_row_within_goal_and_band(regime):
    d = FITTED["regimes"][regime]
    params = F.make_params(regime, d["params"])
    rows = [r for r in ROWS if r["regime"] == regime]
    assert len(rows) == d["rows"] >= 8
    for r in rows:
        err = abs(F.predict_s(r, params) / (r["time_us"] * 1e-6) - 1)
        assert err <= GOAL[regime], (r["row_id"], err)
        assert err <= d["band"], (r["row_id"], err)
        assert abs(d["heldout_rel_error"][str(r["row_id"])]) <= d["band"]


def test_dense_rows_inside_their_wider_band():
    # DeepGEMM's dense table is not the expert MLP; its band is wide and some rows miss 10%
    d = FITTED["regimes"]["gemm_dense"]
    params = F.make_params("gemm_dense", d["params"])
    errs = [abs(F.predict_s(r, params) / (r["time_us"] * 1e-6) - 1) for r in ROWS if r["regime"] == "gemm_dense"]
    assert len(errs) == 18 and max(errs) <= d["band"]


def test_band_is_the_heldout_rule():
    # recompute leave-one-out on the low-latency rows (fast) and compare with the stored band
    rows = [r for r in ROWS if r["regime"] == "a2a_low_latency"]
    held = []
    for i, r in enumerate(rows):
        x = F.fit_regime("a2a_low_latency", rows[:i] + rows[i + 1:])
        held.append(F.predict_s(r, F.make_params("a2a_low_latency", x)) / (r["time_us"] * 1e-6) - 1)
    band = math.ceil(max(abs(h) for h in held) * 100) / 100
    assert band == FITTED["regimes"]["a2a_low_latency"]["band"]
    for d in FITTED["regimes"].values():
        assert d["band"] == math.ceil(max(abs(v) for v in d["heldout_rel_error"].values()) * 100 - 1e-9) / 100


def test_preset_has_bands():
    p = costmodel.preset("h800")
    assert p["regimes"]["gemm_grouped"]["band"] == FITTED["regimes"]["gemm_grouped"]["band"]
    assert "unmeasured" in costmodel.preset("B200")["regimes"]["a2a_normal"]["band_source"]


def _cli(*args):
    return run_cli("cost", *args, catch_exceptions=True)


def test_cli_expert_json():
    r = _cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--weight-dtype", "fp8", "--experts", 4,
             "--tokens-per-expert", 256, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"expert_ns", "expert_band", "source", "terms"} <= set(d) and d["band_measured"] is True
    # published: 4 x 256 masked GEMMs, 932 TFLOPS (gate/up) and 815 TFLOPS (down)
    pub = (2 * 4 * 256 * 4096 * 7168 / 932e12 + 2 * 4 * 256 * 7168 * 2048 / 815e12) * 1e9
    assert abs(d["expert_ns"] / pub - 1) <= d["expert_band"] <= 0.10


@pytest.mark.parametrize("kernel,pub_us", [("low-latency", (155, 273)), ("normal", None)])
def test_cli_comm_json(kernel, pub_us):
    r = _cli("--hardware", "H800", "--hidden", 7168, "--ep", 32, "--ranks-per-node", 8, "--tokens", 128, "--top-k", 8,
             "--kernel", kernel, "--dispatch-dtype", "fp8", "--combine-dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"dispatch_ns", "combine_ns", "comm_band", "source", "terms"} <= set(d)
    assert d["combine_ns"] > d["dispatch_ns"] > 0       # BF16 combine moves about twice the FP8 bytes
    if pub_us:   # DeepEP's published EP32 low-latency row
        assert abs(d["dispatch_ns"] / (pub_us[0] * 1e3) - 1) <= d["comm_band"]
        assert abs(d["combine_ns"] / (pub_us[1] * 1e3) - 1) <= d["comm_band"]


def test_unmeasured_gpu_says_so():
    r = _cli("--hardware", "B200", "--hidden", 7168, "--intermediate", 2048, "--weight-dtype", "fp4", "--experts", 8,
             "--tokens-per-expert", 128, "--json")
    d = json.loads(r.output)
    assert r.exit_code == 0 and d["band_measured"] is False and "unmeasured" in d["band_source"]


def test_cli_uneven_tokens_and_both_modes():
    even = json.loads(_cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 2,
                           "--tokens-per-expert", "256,256", "--json").output)
    one = json.loads(_cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 2,
                          "--tokens-per-expert", 256, "--json").output)
    assert even["expert_ns"] == one["expert_ns"]
    r = _cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 2, "--tokens-per-expert",
             "1,300", "--ep", 16, "--tokens", 128, "--kernel", "low-latency", "--json")
    d = json.loads(r.output)
    assert r.exit_code == 0 and {"expert_ns", "dispatch_ns", "combine_ns", "comm_band", "expert_band"} <= set(d)
    assert _cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 3,
                "--tokens-per-expert", "1,2").exit_code == 2


def test_cli_table():
    r = _cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 4, "--tokens-per-expert", 256)
    assert r.exit_code == 0 and "expert_ns" in r.output and "±9%" in r.output


@pytest.mark.parametrize("args", [
    ("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--weight-dtype", "fp4", "--experts", 4,
     "--tokens-per-expert", 256),
    ("--hardware", "H800", "--hidden", 7168, "--kernel", "normal", "--tokens", 128),
    ("--hardware", "TPU9", "--hidden", 7168, "--ep", 8, "--tokens", 128, "--kernel", "normal"),
    ("--hardware", "H800", "--hidden", 0, "--ep", 8, "--tokens", 128, "--kernel", "normal"),
    ("--hardware", "H800", "--hidden", -7168, "--ep", 8, "--tokens", 128, "--kernel", "normal"),
    ("--hardware", "H800", "--hidden", "nan", "--ep", 8, "--tokens", 128, "--kernel", "normal"),
    ("--hardware", "H800", "--hidden", 7168, "--ep", 8, "--tokens", "inf", "--kernel", "normal"),
    ("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--experts", 2.5, "--tokens-per-expert", 256),
    ("--hardware", "H800", "--hidden", 7168),
])
def test_cli_bad_input_exit_2(args):
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_gpu_check_without_gpu_skips(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would time it")
    import sys

    from benchmarks import gpu_costmodel_check as g
    argv, sys.argv = sys.argv, ["gpu_costmodel_check.py"]
    try:
        assert g.main() == 0
    finally:
        sys.argv = argv
    assert capsys.readouterr().out.strip() == "skipped: no GPU"

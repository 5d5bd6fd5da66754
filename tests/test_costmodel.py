"""The GPU cost model (moetrace/costmodel) against hand computations and the published
rows it was fitted on, and the ``moetrace cost`` command."""
from __future__ import annotations

import json
import math
import re
from math import comb

import numpy as np
import pytest

from moetrace import costmodel
from moetrace.costmodel import fit as F
from moetrace.costmodel.gemm import GemmParams, gemm_terms, tile_config
from moetrace.costmodel.hardware import GPUS
from moetrace.costmodel.routing import routing_counts

from .helpers import run_cli

H800 = GPUS["H800"]
ROWS = F.load_rows()
FITTED = costmodel.fitted()


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


def test_every_row_quotes_its_numbers_and_is_cited():
    # each row's quoted source line holds its published number (and, for GEMMs, its shape)
    for r in ROWS:
        nums = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", r["quoted_line"])]
        assert r["published_value"] in nums, r["row_id"]
        if r["regime"].startswith("gemm"):
            assert {r["m_per_group"], r["n"], r["k"]} <= set(nums), r["row_id"]
        elif r["kernel_version"].startswith("v1-") and "hybrid" not in r["kernel_version"]:
            assert r["ep"] in nums, r["row_id"]
        assert r["source_repo"] in ("deepseek-ai/DeepGEMM", "deepseek-ai/DeepEP")
        assert re.fullmatch(r"[0-9a-f]{40}|pull/\d+#[-0-9]+", r["source_commit"]), r["row_id"]
        assert r["source_file"] and r["kernel_version"] and r["time_us"] > 0


def test_no_twin_rows_and_versions_kept_apart():
    keys = [(r["regime"], r["gpu"], r["kernel_version"], r["layout"], r["groups"], r["m_per_group"], r["n"], r["k"],
             r["ep"], r["direction"], r["dtype"], r["sms"], r["measurement"], r["published_value"]) for r in ROWS]
    assert len(keys) == len(set(keys))
    # DeepEP's normal EP32 H800 rows: three published versions, each its own kernel_version
    ep32 = {(r["kernel_version"], r["published_value"]) for r in ROWS if r["regime"] == "a2a_normal"
            and r["gpu"] == "H800" and r["ep"] == 32 and r["direction"] == "dispatch"}
    assert ep32 == {("v1-2025-02", 44.0), ("v1-2025-04-21", 59.0), ("v1-2025-04", 58.0)}
    # the tables the issue names are all there
    have = {(r["regime"], r["gpu"]) for r in ROWS}
    assert {("gemm_grouped", "H20"), ("a2a_normal", "B200"), ("a2a_deepep_v2", "H800"), ("a2a_hybrid_ep", "GB200"),
            ("a2a_low_latency", "H100")} <= have
    b200 = sorted(r["sms"] for r in ROWS if r["regime"] == "a2a_normal" and r["gpu"] == "B200"
                  and r["direction"] == "combine")
    assert b200 == [16, 24, 28, 32, 36, 40, 44, 48]


def test_ep64_time_uses_the_node_limited_draw():
    # DeepEP's EP64 normal dispatch (51 GB/s RDMA): 4096 tokens x nodes per token x 7392 B / 51 GB/s
    r = next(r for r in ROWS if r["regime"] == "a2a_normal" and r["ep"] == 64 and r["published_value"] == 51.0
             and r["direction"] == "dispatch")
    nodes = routing_counts(64, 8, 8, 256, 4)["nodes"]
    assert r["time_us"] == pytest.approx(4096 * nodes * 7392 / 51e9 * 1e6, rel=1e-12)
    uniform = 4 * (1 - comb(96, 8) / comb(128, 8))     # the old assumption: uniform inside 4 of 8 nodes
    assert uniform == pytest.approx(3.63, abs=0.005) and nodes == pytest.approx(3.98, abs=0.01)


def _draw_by_hand(nodes, rpn, experts, k, groups, tokens, seed):
    """DeepEP tests/test_internode.py's draw, token by token in plain Python (a second implementation)."""
    rng = np.random.default_rng(seed)
    e_node, e_rank = experts // nodes, experts // (nodes * rpn)
    n_nodes = n_ranks = 0
    for _ in range(tokens):
        s = np.abs(rng.standard_normal(experts)) + 1
        best = sorted(range(nodes), key=lambda g: -max(s[g * e_node:(g + 1) * e_node]))[:groups]
        pool = [e for g in best for e in range(g * e_node, (g + 1) * e_node)]
        top = sorted(pool, key=lambda e: -s[e])[:k]
        n_nodes += len({e // e_node for e in top})
        n_ranks += len({e // e_rank for e in top})
    return n_nodes / tokens, n_ranks / tokens


@pytest.mark.parametrize("ep", [64, 128, 256])
def test_routing_counts_node_limited_at_ep64_and_above(ep):
    nodes, ranks = _draw_by_hand(ep // 8, 8, 256, 8, 4, 3000, 1)
    rc = routing_counts(ep, 8, 8, 256, 4)
    assert rc["nodes"] == pytest.approx(nodes, abs=0.01)
    assert rc["ranks"] == pytest.approx(ranks, rel=0.02)
    assert rc["chosen_nodes"] == 4 and "node-limited" in rc["how"]


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


KERN = {"a2a_normal": "normal", "a2a_low_latency": "low-latency", "a2a_deepep_v2": "deepep-v2",
        "a2a_hybrid_ep": "hybrid-ep", "gemm_grouped": "gemm_grouped", "gemm_dense": "gemm_dense"}


def test_stated_bands_cover_fitted_and_group_held_out_errors():
    for reg, d in FITTED["regimes"].items():
        params = F.make_params(reg, d["params"])
        for r in ROWS:
            if r["regime"] != reg:
                continue
            band = FITTED["bands"][f"{r['gpu']}/{KERN[reg]}"]["band"]
            assert band >= d["hardware"][r["gpu"]]["band"]
            err = abs(F.predict_s(r, params) / (r["time_us"] * 1e-6) - 1)
            assert err <= band + 1e-9, (r["row_id"], err, band)
            held = d["heldout_rel_error"].get(r["row_id"])
            if held is not None:
                assert abs(held) <= band + 1e-9


def test_held_out_by_whole_gpu_recomputed():
    # the low-latency H100 rows predicted from a fit on the H800 rows alone: the stored error
    rows = [r for r in ROWS if r["regime"] == "a2a_low_latency"]
    x = F.fit_regime("a2a_low_latency", [r for r in rows if r["gpu"] != "H100"])
    p = F.make_params("a2a_low_latency", x)
    stored = FITTED["regimes"]["a2a_low_latency"]["heldout_by"]
    for r in rows:
        if r["gpu"] == "H100":
            assert F.predict_s(r, p) / (r["time_us"] * 1e-6) - 1 == pytest.approx(stored[r["row_id"]]["gpu"], abs=2e-3)


def test_every_gpu_and_kernel_answers_with_a_band_and_its_words():
    for hw in GPUS:
        e = costmodel.expert_ns(hw, 7168, 2048, [64] * 4)
        assert e["expert_band"] > 0 and e["validation"] in ("validated", f"not validated on {hw}/gemm_grouped")
        for kern in costmodel.KERNELS:
            d = costmodel.comm_ns(hw, 7168, 16, 8, 128, 8, kern)
            assert d["dispatch_ns"] > 0 and d["combine_ns"] > 0 and d["dispatch_band"] > 0
            b = FITTED["bands"][f"{hw}/{kern}"]
            assert d["band_measured"] is b["validated"] and d["comm_band"] == b["band"]
            if not b["validated"]:
                assert d["validation"] == f"not validated on {hw}/{kern}" and "not validated" in d["band_source"]
    # kernels without a published row are never validated, and take the cross-family error
    assert not costmodel.band("H800", "pplx")["validated"]
    assert costmodel.band("H800", "pplx")["band"] >= FITTED["cross_family"]
    assert costmodel.band("H800", "normal")["validated"] and costmodel.band("GB200", "hybrid-ep")["validated"]
    assert set(costmodel.preset("MI300X")["kernels"]) >= set(costmodel.KERNELS)


def test_sms_and_domain_inputs():
    # DeepEP on B200 EP8: fewer SMs, slower (the published table roughly halves 48 -> 16 SMs)
    t16 = costmodel.comm_ns("B200", 7168, 8, 8, 4096, 8, "normal", num_experts=64, sms=16)["dispatch_ns"]
    t48 = costmodel.comm_ns("B200", 7168, 8, 8, 4096, 8, "normal", num_experts=64, sms=48)["dispatch_ns"]
    assert 1.4 < t16 / t48 < 3.0
    g = costmodel.comm_ns("GB200", 7168, 64, None, 4096, 8, "hybrid-ep")
    assert g["inputs"]["ranks_per_node"] == 72 and g["terms"]["dispatch"]["rdma_bytes"] == 0
    lim = costmodel.comm_ns("H800", 7168, 64, 8, 4096, 8, "normal", topk_groups=4)
    free = costmodel.comm_ns("H800", 7168, 64, 8, 4096, 8, "normal", topk_groups=0)
    assert free["terms"]["dispatch"]["routing"]["nodes"] > lim["terms"]["dispatch"]["routing"]["nodes"]


def test_preset_has_bands():
    p = costmodel.preset("h800")
    assert p["kernels"]["gemm_grouped"]["band"] == FITTED["bands"]["H800/gemm_grouped"]["band"]
    assert "not validated on B200/gemm_grouped" in costmodel.preset("B200")["kernels"]["gemm_grouped"]["band_source"]


def _cli(*args):
    return run_cli("cost", *args, catch_exceptions=True)


def test_cli_expert_json():
    r = _cli("--hardware", "H800", "--hidden", 7168, "--intermediate", 2048, "--weight-dtype", "fp8", "--experts", 4,
             "--tokens-per-expert", 256, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"expert_ns", "expert_band", "source", "terms"} <= set(d) and d["band_measured"] is True
    assert d["validation"] == "validated"
    # published: 4 x 256 masked GEMMs, 932 TFLOPS (gate/up) and 815 TFLOPS (down)
    pub = (2 * 4 * 256 * 4096 * 7168 / 932e12 + 2 * 4 * 256 * 7168 * 2048 / 815e12) * 1e9
    assert abs(d["expert_ns"] / pub - 1) <= d["expert_band"]


@pytest.mark.parametrize("kernel,pub_us", [("low-latency", (155, 273)), ("normal", None)])
def test_cli_comm_json(kernel, pub_us):
    r = _cli("--hardware", "H800", "--hidden", 7168, "--ep", 32, "--ranks-per-node", 8, "--tokens", 128, "--top-k", 8,
             "--kernel", kernel, "--dispatch-dtype", "fp8", "--combine-dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"dispatch_ns", "combine_ns", "dispatch_band", "combine_band", "source", "terms"} <= set(d)
    assert d["combine_ns"] > d["dispatch_ns"] > 0       # BF16 combine moves about twice the FP8 bytes
    if pub_us:   # DeepEP's published EP32 low-latency row
        assert abs(d["dispatch_ns"] / (pub_us[0] * 1e3) - 1) <= d["comm_band"]
        assert abs(d["combine_ns"] / (pub_us[1] * 1e3) - 1) <= d["comm_band"]


def test_unmeasured_gpu_says_so():
    r = _cli("--hardware", "B200", "--hidden", 7168, "--intermediate", 2048, "--weight-dtype", "fp4", "--experts", 8,
             "--tokens-per-expert", 128, "--json")
    d = json.loads(r.output)
    assert r.exit_code == 0 and d["band_measured"] is False and "not validated on B200/FP4" in d["band_source"]
    r = _cli("--hardware", "H200", "--hidden", 7168, "--ep", 16, "--tokens", 128, "--kernel", "pplx")
    assert r.exit_code == 0
    lines = [x for x in r.output.splitlines() if x.startswith(("dispatch_ns", "combine_ns"))]
    assert len(lines) == 2 and all("not validated on H200/pplx" in x for x in lines)


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
    band = FITTED["bands"]["H800/gemm_grouped"]["band"]
    assert r.exit_code == 0 and "expert_ns" in r.output and f"±{band:.0%}, validated" in r.output


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
    ("--hardware", "H800", "--hidden", 7168, "--ep", 8, "--tokens", 128, "--kernel", "normal", "--sms", 0),
    ("--hardware", "H800", "--hidden", 7168, "--ep", 8, "--tokens", 128, "--kernel", "normal", "--sms", 500),
    ("--hardware", "H800", "--hidden", 7168, "--ep", 8, "--tokens", 128, "--kernel", "deepep-v3"),
    ("--hardware", "H800", "--hidden", 7168, "--ep", 8, "--tokens", 128, "--kernel", "normal",
     "--max-nodes-per-token", -1),
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


def test_verdict_uses_the_applied_models_band_and_says_when_unvalidated():
    from moetrace.costmodel.step_cost import error_band, preset
    from moetrace.replay.strategies import DOES_NOT, NOT_ENOUGH, PAYS_OFF, verdict

    h800, h200 = preset("H800"), preset("H200")
    b800 = max(FITTED["bands"]["H800/gemm_grouped"]["band"], FITTED["bands"]["H800/normal"]["band"])
    b200 = max(FITTED["bands"]["H200/gemm_grouped"]["band"], FITTED["bands"]["H200/normal"]["band"])
    assert error_band(h800).rel_error == b800 and error_band(h200).rel_error == b200 > b800
    assert error_band(h800).unvalidated() is None
    # a difference between the two bands: decided on H800, not on H200 (whose band was not measured there)
    diff = (b800 + b200) / 2
    v, why = verdict(100.0 * (1 - diff), 100.0, 50, h800)
    assert v == PAYS_OFF and "not validated" not in why
    v, why = verdict(100.0 * (1 - diff), 100.0, 50, h200)
    assert v == NOT_ENOUGH and "not validated on H200/normal" in why
    v, why = verdict(100.0 * (1 + b200 + 0.05), 100.0, 50, h200)
    assert v == DOES_NOT and "not validated on H200/gemm_grouped" in why


def test_fit_from_spans_recovers_known_terms():
    from moetrace.costmodel.choose import choose, fit_from_spans
    from moetrace.costmodel.step_cost import ErrorBand, preset

    rng = np.random.default_rng(4)
    T, L, E, R = 12, 2, 4, 2
    dense = rng.integers(0, 50, size=(T, L, E)).astype(float)
    share = np.zeros((L, E, R))
    share[:, :2, 0] = share[:, 2:, 1] = 1.0          # experts 0-1 on rank 0, 2-3 on rank 1
    ids, layers = np.arange(100, 100 + T), np.array([3, 7])
    st, ly, rk, dur = [], [], [], []
    for t in range(T):
        for li in range(L):
            for r in range(R):
                own = dense[t, li, 2 * r:2 * r + 2]
                st.append(ids[t]), ly.append(layers[li]), rk.append(r)
                dur.append(3.0 * own.sum() + 5.0 * (own > 0).sum())       # a = 3 ns/token, b = 5 ns/slot
    base = preset("H800")
    m = fit_from_spans(ids, layers, dense, share, share, np.array(st), np.array(ly), np.array(rk), np.array(dur), base)
    assert m.a_ns == pytest.approx(3.0) and m.b_ns == pytest.approx(5.0)
    # a measured calibration band replaces the one stated; without one the preset keeps its own
    assert choose(base, None, None).rel_error == base.rel_error
    assert choose(base, m, ErrorBand(0.07, "calibration x")).rel_error == 0.07


@pytest.mark.parametrize("regime", F.REGIMES)
def test_vectorized_fit_model_is_the_model(regime):
    # the fit's array form of each row's time equals the scalar model used everywhere else
    rows = [r for r in ROWS if r["regime"] == regime]
    p = F.make_params(regime, FITTED["regimes"][regime]["params"])
    vec = F.Prepared(regime, rows).predict(p)
    assert np.allclose(vec, [F.predict_s(r, p) for r in rows], rtol=1e-9)

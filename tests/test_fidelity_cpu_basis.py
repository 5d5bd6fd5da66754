"""The CPU basis of the reference run's timings: each rank's main-thread CPU
time in its experts and from dispatch start to combine end, summarized per (step, layer,
rank) next to the wall-clock medians. Numbers are worked out by hand here."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.formats.refrun import summarize_timing


def _timing(cpu: bool = True) -> pl.DataFrame:
    # 1 step, 1 layer, 2 ranks, 3 passes; wall: dispatch start, expert start/end, combine end
    rows = []
    #         pass rank  d0    e0    e1    c1   expert_cpu moe_cpu
    for p, r, d0, e0, e1, c1, ec, mc in [
            (0, 0, 100, 110, 210, 230, 90, 105),
            (1, 0, 1000, 1010, 1130, 1150, 95, 112),
            (2, 0, 2000, 2020, 2100, 2130, 70, 99),
            (0, 1, 105, 120, 160, 232, 35, 50),
            (1, 1, 990, 1000, 1050, 1151, 40, 58),
            (2, 1, 2010, 2030, 2090, 2131, 38, 55)]:
        rows.append({"pass": p, "step": 0, "layer": 0, "rank": r, "dispatch_start_ns": d0, "expert_start_ns": e0,
                     "expert_end_ns": e1, "combine_end_ns": c1, "expert_cpu_ns": ec, "moe_cpu_ns": mc})
    df = pl.DataFrame(rows)
    return df if cpu else df.drop(["expert_cpu_ns", "moe_cpu_ns"])


def test_cpu_basis_medians_by_hand():
    cols, noise = summarize_timing(_timing())
    got = pl.DataFrame(cols).sort("rank")
    # rank 0 expert CPU: 90, 95, 70 -> median 90; p75 - p25 = 92.5 - 80 = 12.5
    assert got["expert_cpu_ns"].to_list() == [90, 38]
    assert got["expert_cpu_spread"][0] == pytest.approx(12.5 / 90)
    # rank 1: 35, 40, 38 -> median 38; p75 39, p25 36.5
    assert got["expert_cpu_spread"][1] == pytest.approx(2.5 / 38)
    # layer CPU per pass = max over ranks of moe CPU: 105, 112, 99 -> median 105 (p75 108.5, p25 102)
    assert got["layer_cpu_ns"].to_list() == [105, 105]
    assert got["layer_cpu_spread"][0] == pytest.approx(6.5 / 105)
    # wall clock unchanged: layer per pass = last combine end - last dispatch start
    lay = [232 - 105, 1151 - 1000, 2131 - 2010]
    assert got["layer_ns"][0] == int(np.median(lay))
    assert noise["expert_cpu_spread_p50"] == pytest.approx(round(float(np.median([12.5 / 90, 2.5 / 38])), 4))
    assert noise["layer_cpu_spread_p50"] == pytest.approx(round(6.5 / 105, 4))


def test_timing_without_cpu_columns_gives_nulls():
    """Timing files written before the CPU basis existed: the CPU columns are null, the
    wall-clock ones as before."""
    cols, noise = summarize_timing(_timing(cpu=False))
    assert cols["expert_cpu_ns"] == [None, None] and cols["layer_cpu_ns"] == [None, None]
    assert cols["expert_ns"] == [100, 50]
    assert noise["expert_cpu_spread_p50"] is None


def test_cpu_basis_in_the_cell_times_contract():
    from moetrace.storage import schema

    cols, _ = summarize_timing(_timing())
    t = schema.conform("cell_times", {**cols, "run_id": ["r"] * len(cols["step"])})
    assert t.column("layer_cpu_ns").to_pylist() == [105, 105]
    cols, _ = summarize_timing(_timing(cpu=False))
    t = schema.conform("cell_times", {**cols, "run_id": ["r"] * len(cols["step"])})
    assert t.column("expert_cpu_ns").null_count == 2


@pytest.mark.slow
def test_refrun_cpu_time_is_within_the_wall_time(tmp_path, forked_ranks):
    """A real tiny run: a thread's CPU time over an interval cannot exceed the interval's wall
    time, and cell_times' CPU columns are the medians of the per-pass values."""
    pytest.importorskip("torch")
    from moetrace.collect import collect
    from moetrace.produce.refrun import RefRunConfig, run

    cfg = RefRunConfig(ranks=2, experts=4, layers=1, hidden=32, ffn=64, steps=2, tokens_per_rank=16, seed=1,
                       profile=False, repeats=3, warmup=1, progress=False)
    run(cfg, tmp_path / "o")
    raw = pl.concat([pl.read_parquet(tmp_path / "o" / f"timing_rank{r}.parquet") for r in range(2)])
    assert raw["expert_cpu_ns"].null_count() == 0 and (raw["expert_cpu_ns"] > 0).all()
    slack = 2_000_000   # the CPU clock's own granularity and the two clocks' reads are not simultaneous
    assert (raw["expert_cpu_ns"] <= raw["expert_end_ns"] - raw["expert_start_ns"] + slack).all()
    assert (raw["moe_cpu_ns"] <= raw["combine_end_ns"] - raw["dispatch_start_ns"] + slack).all()
    assert (raw["moe_cpu_ns"] >= raw["expert_cpu_ns"]).all()
    cells = collect([tmp_path / "o"])[0].tables["cell_times"]
    cells = pl.DataFrame(cells)
    for c in cells.iter_rows(named=True):
        sel = raw.filter((pl.col("step") == c["step"]) & (pl.col("layer") == c["layer"]))
        mine = sel.filter(pl.col("rank") == c["rank"])["expert_cpu_ns"].to_numpy()
        assert c["expert_cpu_ns"] == int(round(float(np.median(mine))))
        per_pass = sel.group_by("pass").agg(pl.col("moe_cpu_ns").max())["moe_cpu_ns"].to_numpy()
        assert c["layer_cpu_ns"] == int(round(float(np.median(per_pass))))


# ----------------------------------------------------------------------------- contention term
def test_overlap_is_the_pairwise_min_sum():
    """overlap_ns (sort + cumulative sum) equals the plain double loop Σ_{j≠r} min(w_j, w_r)."""
    from moetrace.costmodel.step_cost import overlap_ns

    rng = np.random.default_rng(3)
    w = rng.integers(0, 50, (5, 3, 7)).astype(float)    # ties included
    want = np.zeros_like(w)
    for idx in np.ndindex(w.shape[:-1]):
        row = w[idx]
        want[idx] = [sum(min(row[j], row[r]) for j in range(row.size) if j != r) for r in range(row.size)]
    assert np.array_equal(overlap_ns(w), want)
    # two ranks by hand: each loses the smaller one's work
    assert overlap_ns(np.array([10.0, 4.0])).tolist() == [4.0, 4.0]
    assert overlap_ns(np.array([3.0])).tolist() == [0.0]


def test_contention_by_hand_and_recovered_by_the_fit():
    from types import SimpleNamespace

    from moetrace.costmodel import calibrate_fit as cal
    from moetrace.costmodel.step_cost import CostModel

    # 3 ranks, work 10, 20, 40 ns, contention 0.5: rank 0 loses 0.5 * (10 + 10) = 10,
    # rank 1 0.5 * (10 + 20) = 15, rank 2 0.5 * (10 + 20) = 15
    m = CostModel(1.0, 0.0, 1e30, 1e30, "", contention=0.5)
    _, c, _ = m.rank_ns(np.array([10.0, 20.0, 40.0]), np.zeros(3), np.zeros(3), np.zeros(3))
    assert c.tolist() == pytest.approx([20.0, 35.0, 55.0])
    # the fit recovers a, b, the contention and the latency from exact times
    rng = np.random.default_rng(11)
    t_, l_, r_ = 10, 2, 4
    tok = rng.integers(1, 300, (t_, l_, r_)).astype(float)
    tch = np.minimum(tok, rng.integers(1, 8, (t_, l_, r_))).astype(float)
    zero = np.zeros_like(tok)
    blk = SimpleNamespace(tokens=tok, touched=tch, bytes_intra=zero, bytes_inter=zero)
    a, b, g, lat = 40.0, 900.0, 0.15, 50000.0
    work = a * tok + b * tch
    ov = np.array([[[sum(min(work[s, la, j], work[s, la, r]) for j in range(r_) if j != r) for r in range(r_)]
                    for la in range(l_)] for s in range(t_)])
    comp = work + g * ov
    layer = lat + comp.max(axis=2)
    free = CostModel(0.0, 0.0, 1e30, 1e30, "bytes cost nothing")
    fm = cal.fit_layer_model(blk, comp, layer, ("tokens", "slot", "latency", "contention"), base=free)
    assert (fm.a_ns, fm.b_ns, fm.contention, fm.latency_ns) == pytest.approx((a, b, g, lat), rel=1e-6)
    d, c, cb = fm.rank_ns(tok, tch, zero, zero)
    assert (d + c + cb).max(axis=2) == pytest.approx(layer, rel=1e-9)
    # without the term the same data is fitted worse (the contention is real in these times)
    f0 = cal.fit_layer_model(blk, comp, layer, ("tokens", "slot", "latency"), base=free)
    d0, c0, cb0 = f0.rank_ns(tok, tch, zero, zero)
    assert np.abs((d0 + c0 + cb0).max(axis=2) / layer - 1).mean() > 1e-3
    # ranks that do not share anything: the fitted contention is 0
    fz = cal.fit_layer_model(blk, work, lat + work.max(axis=2), ("tokens", "slot", "latency", "contention"), base=free)
    assert fz.contention == pytest.approx(0.0, abs=1e-9) and fz.a_ns == pytest.approx(a, rel=1e-6)


# ----------------------------------------------------------------------------- matrix scoring
def _placement_data(rng, T, L, R, a, b, lat, cpu_scale):
    tok = rng.integers(20, 400, (T, L, R)).astype(float)
    tch = np.minimum(tok, rng.integers(2, 9, (T, L, R))).astype(float)
    ex = a * tok + b * tch
    lay = lat + ex.max(axis=2)
    cells = {k: [] for k in ("step", "layer", "rank", "expert_ns", "expert_min_ns", "expert_spread", "layer_ns",
                             "layer_min_ns", "expert_cpu_ns", "expert_cpu_spread", "layer_cpu_ns")}
    for s in range(T):
        for la in range(L):
            for r in range(R):
                for k, v in (("step", s), ("layer", la), ("rank", r), ("expert_ns", ex[s, la, r]),
                             ("expert_min_ns", ex[s, la, r]), ("expert_spread", 0.01), ("layer_ns", lay[s, la]),
                             ("layer_min_ns", lay[s, la]), ("expert_cpu_ns", ex[s, la, r] / cpu_scale),
                             ("expert_cpu_spread", 0.01), ("layer_cpu_ns", lay[s, la] / cpu_scale)):
                    cells[k].append(v)
    zero = np.zeros_like(tok).tolist()
    return {"cells": cells, "tokens": tok.tolist(), "touched": tch.tolist(), "bytes_intra": zero, "bytes_inter": zero}


def test_matrix_scores_an_exact_model_as_exact():
    """Times generated by a·tokens + b·slots + latency (layer = latency + slowest rank): the
    +latency variant fitted on A predicts every B exactly on both bases (ratio error 0,
    layer MAPE 0), and the ratio B/A is the ratio of the summed layer times, by hand."""
    from benchmarks import bench_fidelity as bf

    rng = np.random.default_rng(7)
    sz = {**bf.SIZES["small"], "steps": 3, "layers": 2}
    name = "r2-skew0.6"
    data = {pol: _placement_data(rng, 3, 2, 2, 35_000.0, 700_000.0, 1_200_000.0, 2.0)
            for pol in ("contiguous", "eplb+r", "greedy")}
    rows = bf.score(name, 2, data, sz)
    assert len(rows) == len(bf.PAIRS[name]) * len(bf.ESTIMATORS) * len(bf.VARIANTS)
    for r in rows:
        if r["variant"] != "+latency":
            continue
        assert r["ratio_err"] == pytest.approx(0.0, abs=1e-9) and r["layer_mape"] == pytest.approx(0.0, abs=1e-9)
        lay = {p: np.asarray(data[p]["cells"]["layer_ns"][::2]) for p in data}   # one row per (step, layer)
        assert r["ratio_meas"] == pytest.approx(lay[r["B"]].sum() / lay[r["A"]].sum(), rel=1e-12)
        # the straggler is the rank with the most predicted (= measured) work: always right
        assert r["straggler_hits_all"] == r["straggler_pairs"] == 6

"""Fidelity matrix: are the replay's *time* predictions right? Real re-runs, stated error.

For each traffic (ranks, router skew, seed) the CPU expert-parallel reference run
(``moetrace refrun``, profiler off, ``repeats`` timed passes summarized per (step, layer,
rank) by the median) runs once under contiguous placement (run A) and once under each
placement planned on A's load (greedy, EPLB without replicas, EPLB with one extra slot per
rank). Every run carries the same tokens and weights (same seed), so its routing is A's.

For each pair (A, B) — the model fitted on A only:

* B's per-rank tokens, slots touched and dispatch bytes come from the replay of A's
  routing under B's plan (``replay.engine.replay_routing``, the replica hash rule);
* the cost model (``costmodel.step_cost.CostModel.rank_ns``, layer = max over ranks) predicts B's
  per-layer time, per-step MoE time (sum over layers), the time ratio B/A of the whole
  run (both sides predicted by the same model, as a replay would tell an operator), and
  the straggler rank per (step, layer);
* measured: ``cell_times`` of run B, on two bases (:data:`ESTIMATORS`): wall clock (per
  layer: median over passes of the last combine end minus the last dispatch start;
  straggler: the rank with the largest median expert time) and CPU (each rank's
  main-thread CPU time: the model's own error, without the host's scheduling of other
  jobs). Per run, the host slowdown (wall / CPU layer time) is printed: the measured wall
  ratio B/A is the CPU ratio times the ratio of the two runs' slowdowns.

Targets (what a time prediction must meet to be stated): ratio error median ≤ 5 % and worst ≤ 10 %; per-layer time MAPE
≤ 10 %; straggler right in ≥ 90 % of the (step, layer) where the predicted gap between
the two slowest ranks exceeds the measured noise of those two cells (their (p75 − p25) /
median over passes). Each model variant (the terms of :data:`VARIANTS`) is evaluated on
every pair, so a term is kept only when the matrix shows it helps.

    python benchmarks/bench_fidelity.py --size small   # CI: 2 ranks, 6 pairs, ~1 min
    python benchmarks/bench_fidelity.py --size full    # 2 and 4 ranks, 8 pairs
    python benchmarks/bench_fidelity.py --rescore [FILE.json]   # stored cells, current variants

The machine's load (``os.getloadavg``) is printed before and after: on a shared host the
timings are noisy and the table says so.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import heavy_lock, main, result  # noqa: E402
from benchmarks.rank_fork import ranks_forked_here  # noqa: E402

SIZES = {
    "small": dict(experts=8, layers=2, hidden=128, ffn=256, tokens_per_rank=32, steps=2, repeats=2, rounds=1,
                  traffic=[("r2-skew1.2", 2, 1.2, 2), ("r2-skew0.6", 2, 0.6, 3)]),
    "full": dict(experts=16, layers=2, hidden=512, ffn=1024, tokens_per_rank=128, steps=8, repeats=4, rounds=2,
                 traffic=[("r2-skew1.2", 2, 1.2, 2), ("r2-skew0.6", 2, 0.6, 3), ("r4-skew1.2", 4, 1.2, 1)]),
}
#: (A placement, B placement) per traffic; the placements other than contiguous are planned on A's load
PAIRS = {
    "r2-skew1.2": [("contiguous", "greedy"), ("contiguous", "eplb"), ("contiguous", "eplb+r"),
                   ("eplb+r", "contiguous")],
    "r2-skew0.6": [("contiguous", "eplb+r"), ("contiguous", "greedy")],
    "r4-skew1.2": [("contiguous", "eplb+r"), ("contiguous", "greedy")],
}
#: model variants: the terms of the cost model each one fits on run A
VARIANTS = {
    "a": ("tokens",),
    "a+b (replay before #13)": ("tokens", "slot"),
    "+latency": ("tokens", "slot", "latency"),
    "+latency+contention": ("tokens", "slot", "latency", "contention"),
    "+latency+fixed": ("tokens", "slot", "latency", "fixed"),
    "+latency+fixed+bytes": ("tokens", "slot", "latency", "fixed", "bytes"),
}
CHOSEN = "+latency"
#: what is measured, and how a cell's repeated passes are summarized; the model is fitted and
#: judged on the same one:
#: * ``median``: wall-clock (time.monotonic_ns), median over passes — what the host delivered,
#:   its scheduling of other processes included;
#: * ``min``: wall-clock, the fastest pass (the least disturbed one on a shared host);
#: * ``cpu``: CPU basis, median over passes — each rank's main-thread CPU time (expert: in
#:   its experts; layer: the max over ranks of the CPU time from dispatch start to combine
#:   end). The host's scheduling noise is not in it, so it judges the cost model itself: what
#:   the layer would take with a free core per rank and a transport that costs no waiting.
ESTIMATORS = ("median", "min", "cpu")
TARGETS = {"ratio_err_median": 0.05, "ratio_err_worst": 0.10, "layer_mape": 0.10, "straggler_hit": 0.90}


def _plan_file(policy: str, load: np.ndarray, ranks: int, out: Path) -> Path:
    from moetrace.placement.planners import PlanShape, make_plan

    L, E = load.shape
    slots = E + (ranks if policy == "eplb+r" else 0)
    plan = make_plan("eplb" if policy.startswith("eplb") else policy, load,
                     PlanShape(num_ranks=ranks, ranks_per_node=ranks, num_slots=slots, num_groups=1))
    out.write_text(json.dumps({"phy2log": plan.phy2log.tolist()}))
    return out


def _refrun(folder: Path, ranks: int, skew: float, seed: int, placement, sz: dict) -> dict:
    """One real run; returns its routing, plan and per-pass timing (through the collector)."""
    import polars as pl

    from moetrace.collect import collect
    from moetrace.produce.refrun import RefRunConfig, run

    cfg = RefRunConfig(ranks=ranks, experts=sz["experts"], top_k=2, layers=sz["layers"], hidden=sz["hidden"],
                       ffn=sz["ffn"], steps=sz["steps"], tokens_per_rank=sz["tokens_per_rank"], skew=skew,
                       placement=placement, seed=seed, profile=False, repeats=sz["repeats"], warmup=2,
                       progress=False)
    man = run(cfg, folder)
    rd = collect([folder])[0]
    timing = pl.concat([pl.read_parquet(folder / f"timing_rank{r}.parquet") for r in range(ranks)])
    return {"routing": rd.tables["routing"], "timing": timing, "phy2log": np.asarray(man["phy2log"]),
            "ranks": ranks, "wall_s": man["wall_s"]}


def _pool(parts: list[dict]) -> dict:
    """Runs of one configuration from several rounds: their timed passes pooled (pass ids
    renumbered), summarized per (step, layer, rank) by the median and spread."""
    import polars as pl

    from moetrace.formats.refrun import summarize_timing

    timing, off = [], 0
    for p in parts:
        t = p["timing"]
        timing.append(t.with_columns(pl.col("pass") + off))
        off += int(t["pass"].max()) + 1
    cells, noise = summarize_timing(pl.concat(timing))
    return {**parts[0], "cells": cells, "noise": noise, "wall_s": sum(p["wall_s"] for p in parts)}


def _arrays(r: dict, sz: dict, estimator: str = "median"):
    """Measured [t, L, R] expert time and spread, [t, L] layer time of a run's cells, by the
    median over passes, the fastest pass (``estimator`` 'min') or on the CPU basis ('cpu')."""
    c = r["cells"]
    exk, lk, spk = {"median": ("expert_ns", "layer_ns", "expert_spread"),
                    "min": ("expert_min_ns", "layer_min_ns", "expert_spread"),
                    "cpu": ("expert_cpu_ns", "layer_cpu_ns", "expert_cpu_spread")}[estimator]
    T, L, R = sz["steps"], sz["layers"], r["ranks"]
    ex = np.zeros((T, L, R))
    sp = np.full((T, L, R), np.nan)
    lay = np.zeros((T, L))
    for s, layer, rank, e, spr, ln in zip(c["step"], c["layer"], c["rank"], c[exk], c[spk], c[lk]):
        ex[s, layer, rank] = e
        sp[s, layer, rank] = np.nan if spr is None else spr
        lay[s, layer] = ln
    return ex, sp, lay


def _block(routing, phy2log: np.ndarray, ranks: int, sz: dict):
    """Replay of a run's routing under ``phy2log``: tokens, touched, bytes [t, L, R]."""
    from moetrace.placement.planners import Plan
    from moetrace.replay.token_replay import replay_routing

    plan = Plan(phy2log, sz["experts"], ranks, ranks)
    rt = routing
    return replay_routing(np.asarray(rt["step"]), np.asarray(rt["layer"]), np.asarray(rt["token"]),
                          np.asarray(rt["src_rank"]), np.asarray(rt["expert"]), sz["steps"], plan, "hash",
                          sz["hidden"] * 4)


def evaluate(model, blk_a, blk_b, meas_a, meas_b) -> dict:
    """Errors of ``model``'s predictions for run B (and the ratio B/A) against the measurements."""
    ex_b, sp_b, lay_b = meas_b
    _, _, lay_a = meas_a

    def predict(blk):
        d, c, cb = model.rank_ns(blk.tokens, blk.touched, blk.bytes_intra, blk.bytes_inter)
        return c, (d + c + cb).max(axis=2)
    comp_b, pl_b = predict(blk_b)
    _, pl_a = predict(blk_a)
    layer_err = (pl_b - lay_b) / lay_b
    step_err = (pl_b.sum(axis=1) - lay_b.sum(axis=1)) / lay_b.sum(axis=1)
    ratio_pred = pl_b.sum() / pl_a.sum()
    ratio_meas = lay_b.sum() / lay_a.sum()
    # straggler: predicted = argmax of predicted compute; counted where the predicted gap of
    # the two slowest ranks exceeds the measured spread of those two cells
    order = np.argsort(-comp_b, axis=2, kind="stable")
    top, second = order[..., 0], order[..., 1] if comp_b.shape[2] > 1 else order[..., 0]
    p1 = np.take_along_axis(comp_b, top[..., None], 2)[..., 0]
    p2 = np.take_along_axis(comp_b, second[..., None], 2)[..., 0]
    gap = np.where(p1 > 0, (p1 - p2) / np.where(p1 > 0, p1, 1), 0.0)
    noise = np.fmax(np.take_along_axis(sp_b, top[..., None], 2)[..., 0],
                    np.take_along_axis(sp_b, second[..., None], 2)[..., 0])
    noise = np.where(np.isnan(noise), 0.0, noise)
    decided = gap > noise
    hit = top == ex_b.argmax(axis=2)
    return {"layer_mape": float(np.abs(layer_err).mean()), "layer_bias": float(layer_err.mean()),
            "step_mape": float(np.abs(step_err).mean()), "ratio_pred": float(ratio_pred),
            "ratio_meas": float(ratio_meas), "ratio_err": float(ratio_pred / ratio_meas - 1),
            "straggler_decided": int(decided.sum()), "straggler_pairs": int(decided.size),
            "straggler_hits": int((hit & decided).sum()), "straggler_hits_all": int(hit.sum())}


def run_matrix(size: str, workdir: Path, log=print) -> dict:
    sz = SIZES[size]
    load0 = os.getloadavg()
    rows = []
    runs_info = []
    data: dict = {}
    t_start = time.time()
    for name, ranks, skew, seed in sz["traffic"]:
        base = workdir / name
        base.mkdir(parents=True)
        parts: dict[str, list] = {}
        log(f"# traffic {name}: {ranks} ranks, skew {skew}, seed {seed} (load {os.getloadavg()[0]:.2f})")
        need = sorted({p for pair in PAIRS[name] for p in pair} - {"contiguous"})
        specs = {"contiguous": "contiguous"}
        # rounds: every placement once per round, so slow spells of a shared host hit all alike
        for rnd in range(sz["rounds"]):
            parts.setdefault("contiguous", []).append(
                _refrun(base / f"contiguous.{rnd}", ranks, skew, seed, "contiguous", sz))
            if rnd == 0:
                rt = parts["contiguous"][0]["routing"]
                load = np.zeros((sz["layers"], sz["experts"]))
                np.add.at(load, (np.asarray(rt["layer"]), np.asarray(rt["expert"])), 1.0)
                for pol in need:
                    specs[pol] = str(_plan_file(pol, load, ranks, base / f"{pol}.json"))
            for pol in need:
                parts.setdefault(pol, []).append(_refrun(base / f"{pol}.{rnd}", ranks, skew, seed, specs[pol], sz))
            log(f"  round {rnd + 1}/{sz['rounds']} done (load {os.getloadavg()[0]:.2f})")
        runs = {pol: _pool(ps) for pol, ps in parts.items()}
        for pol, r in runs.items():
            c = r["cells"]
            lay_wall = sum(v for v, rk in zip(c["layer_ns"], c["rank"]) if rk == 0)
            lay_cpu = sum(v or 0 for v, rk in zip(c["layer_cpu_ns"], c["rank"]) if rk == 0)
            runs_info.append({"traffic": name, "placement": pol, "wall_s": r["wall_s"], **r["noise"],
                              "host_slowdown": lay_wall / lay_cpu if lay_cpu else None})
            log(f"  run {pol:<11} {r['wall_s']:5.1f} s  noise: expert {r['noise']['expert_spread_p50']}, "
                f"layer {r['noise']['layer_spread_p50']}")
        # per placement: the pooled cells and the replay of A's routing under its plan, kept in the
        # result (fidelity_full.json) so a model variant can be re-scored without re-running
        contig = runs["contiguous"]
        for pol, r in runs.items():
            blk = _block(contig["routing"], r["phy2log"], ranks, sz)
            data.setdefault(name, {})[pol] = {
                "cells": {k: list(v) for k, v in r["cells"].items()},
                **{k: np.asarray(getattr(blk, k)).tolist() for k in ("tokens", "touched", "bytes_intra", "bytes_inter")}}
        for a_name, b_name in PAIRS[name]:
            A, B = runs[a_name], runs[b_name]
            # the replay of A's routing must give B's measured per-slot load: the tokens are exact
            blk_b = _block(A["routing"], B["phy2log"], ranks, sz)
            blk_b_own = _block(B["routing"], B["phy2log"], ranks, sz)
            assert np.array_equal(blk_b.tokens, blk_b_own.tokens), "A's routing under B's plan != B's load"
            assert np.array_equal(blk_b.tokens, np.asarray(data[name][b_name]["tokens"])), "routing differs from A's"
        rows += score(name, ranks, data[name], sz)
    return {"size": size, "rows": rows, "runs": runs_info, "data": data, "load_before": load0, "load_after": os.getloadavg(),
            "cpu_cores": len(os.sched_getaffinity(0)), "wall_s": time.time() - t_start,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def score(name: str, ranks: int, data: dict, sz: dict) -> list[dict]:
    """One row per (pair, basis, model variant) of traffic ``name``: the model fitted on run
    A's measured cells only, judged on run B. ``data``: per placement, its pooled cells and
    the replay of A's routing under its plan (what :func:`run_matrix` keeps)."""
    from types import SimpleNamespace

    from moetrace.costmodel.calibrate_fit import fit_layer_model

    blk = {pol: SimpleNamespace(**{k: np.asarray(d[k], np.float64)
                                   for k in ("tokens", "touched", "bytes_intra", "bytes_inter")})
           for pol, d in data.items()}
    runs = {pol: {"cells": d["cells"], "ranks": ranks} for pol, d in data.items()}
    rows = []
    for a_name, b_name in PAIRS[name]:
        for est in ESTIMATORS:
            meas_a, meas_b = _arrays(runs[a_name], sz, est), _arrays(runs[b_name], sz, est)
            for vname, terms in VARIANTS.items():
                model = fit_layer_model(blk[a_name], meas_a[0], meas_a[2], terms)
                ev = evaluate(model, blk[a_name], blk[b_name], meas_a, meas_b)
                rows.append({"traffic": name, "ranks": ranks, "A": a_name, "B": b_name, "variant": vname,
                             "estimator": est, **ev,
                             "params": {"a_ns": model.a_ns, "b_ns": model.b_ns, "fixed_ns": model.fixed_ns,
                                        "latency_ns": model.latency_ns, "contention": model.contention,
                                        "nvlink_Bps": model.nvlink_Bps}})
    return rows


def rescore(path: Path) -> dict:
    """Re-score a stored full-size result (its measured cells) with the current model
    variants: the same runs, no re-run; the date of the runs is kept."""
    res = json.loads(Path(path).read_text())
    sz = SIZES[res["size"]]
    ranks = {name: r for name, r, _, _ in sz["traffic"]}
    res["rows"] = [row for name, d in res["data"].items() for row in score(name, ranks[name], d, sz)]
    res["rescored"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return res


def summarize(rows: list[dict], variant: str, estimator: str = "median") -> dict:
    rs = [r for r in rows if r["variant"] == variant and r["estimator"] == estimator]
    ratio = np.abs([r["ratio_err"] for r in rs])
    dec = sum(r["straggler_decided"] for r in rs)
    hits = sum(r["straggler_hits"] for r in rs)
    return {"pairs": len(rs), "ratio_err_median": float(np.median(ratio)), "ratio_err_worst": float(ratio.max()),
            "layer_mape": float(np.mean([r["layer_mape"] for r in rs])),
            "step_mape": float(np.mean([r["step_mape"] for r in rs])),
            "straggler_hit": hits / dec if dec else None, "straggler_decided": dec,
            "straggler_pairs": sum(r["straggler_pairs"] for r in rs)}


def _met(key: str, v) -> str:
    if v is None:
        return "n/a"
    ok = v >= TARGETS[key] if key == "straggler_hit" else v <= TARGETS[key]
    return "met" if ok else "MISSED"


BASIS_WORDS = {"median": "wall-clock, median over the timed passes",
               "cpu": "CPU basis (each rank's main-thread CPU time, median over the timed passes)"}


def _targets_line(rows: list[dict], est: str, pct) -> str:
    s = summarize(rows, CHOSEN, est)
    return (f"targets ({CHOSEN}, {BASIS_WORDS[est]}): ratio error median {pct(s['ratio_err_median'])} (<= 5%: "
            f"{_met('ratio_err_median', s['ratio_err_median'])}), worst {pct(s['ratio_err_worst'])} (<= 10%: "
            f"{_met('ratio_err_worst', s['ratio_err_worst'])}), layer MAPE {pct(s['layer_mape'])} (<= 10%: "
            f"{_met('layer_mape', s['layer_mape'])}), straggler right {pct(s['straggler_hit'])} of "
            f"{s['straggler_decided']} decided (step, layer) (>= 90%: {_met('straggler_hit', s['straggler_hit'])})")


def format_report(res: dict) -> str:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    out = [f"fidelity matrix, size {res['size']}, {res['date']}, {res['cpu_cores']} CPU cores, load average "
           f"{res['load_before'][0]:.2f} before / {res['load_after'][0]:.2f} after (1 min), {res['wall_s']:.0f} s"
           + (f" (re-scored {res['rescored']} from the stored cells of these runs)" if res.get("rescored") else ""),
           f"per pair: model {CHOSEN} fitted on run A only"]
    ests = [e for e in ("median", "cpu") if any(r["estimator"] == e for r in res["rows"])]
    slow = {(r["traffic"], r["placement"]): r.get("host_slowdown") for r in res["runs"]}
    for est in ests:
        wall = est != "cpu"
        out += ["", f"measured = {BASIS_WORDS[est]}", "",
                "| traffic | A -> B | layer MAPE | step MAPE | ratio B/A pred | meas | error | straggler right "
                "(decided / all) |" + (" host slowdown B/A |" if wall else ""),
                "|---|---|---|---|---|---|---|---|" + ("---|" if wall else "")]
        for r in res["rows"]:
            if r["variant"] != CHOSEN or r["estimator"] != est:
                continue
            sa, sb = slow.get((r["traffic"], r["A"])), slow.get((r["traffic"], r["B"]))
            out.append(f"| {r['traffic']} | {r['A']} -> {r['B']} | {pct(r['layer_mape'])} | {pct(r['step_mape'])} | "
                       f"{r['ratio_pred']:.3f} | {r['ratio_meas']:.3f} | {100 * r['ratio_err']:+.1f}% | "
                       f"{r['straggler_hits']}/{r['straggler_decided']} of {r['straggler_pairs']} "
                       f"(all: {r['straggler_hits_all']}/{r['straggler_pairs']}) |"
                       + ((f" {sb / sa:.2f} |" if sa and sb else " n/a |") if wall else ""))
    out += ["", "| variant | terms fitted on A | measured | ratio error median | worst | layer MAPE | "
            "step MAPE | straggler right (decided) |", "|---|---|---|---|---|---|---|---|"]
    for est in ESTIMATORS:
        if not any(r["estimator"] == est for r in res["rows"]):
            continue
        for v in VARIANTS:
            s = summarize(res["rows"], v, est)
            out.append(f"| {v} | {', '.join(VARIANTS[v])} | {est} | {pct(s['ratio_err_median'])} | "
                       f"{pct(s['ratio_err_worst'])} | "
                       f"{pct(s['layer_mape'])} | {pct(s['step_mape'])} | {pct(s['straggler_hit'])} of "
                       f"{s['straggler_decided']} |")
    if any("host_slowdown" in r for r in res["runs"]):
        out += ["", "host slowdown per run (wall-clock layer time / CPU-basis layer time, summed over (step, layer)); "
                "noise = median (p75 - p25) / median per cell:", "",
                "| traffic | placement | wall s | host slowdown | noise expert wall | expert CPU | layer wall | "
                "layer CPU |", "|---|---|---|---|---|---|---|---|"]
        for r in res["runs"]:
            out.append(f"| {r['traffic']} | {r['placement']} | {r['wall_s']:.1f} | {r.get('host_slowdown', 0):.2f} | "
                       f"{pct(r['expert_spread_p50'])} | {pct(r.get('expert_cpu_spread_p50'))} | "
                       f"{pct(r['layer_spread_p50'])} | {pct(r.get('layer_cpu_spread_p50'))} |")
    out.append("")
    out += [_targets_line(res["rows"], est, pct) for est in ests]
    return "\n".join(out)


RESULT = Path(__file__).resolve().parent / "results" / "fidelity_full.md"


def run(size: str, res: dict | None = None) -> list[dict]:
    if res is None:
        # small size: ranks forked from this process (benchmarks.rank_fork: it imports torch once), not spawned
        with heavy_lock(size), ranks_forked_here(size == "small"), \
                tempfile.TemporaryDirectory(prefix="moetrace-fidelity-") as tmp:
            res = run_matrix(size, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True))
    text = format_report(res)
    print(text, file=sys.stderr, flush=True)
    if size == "full":   # the table the docs quote, with its date and load
        out = RESULT
        out.write_text(text + "\n")
        (out.with_suffix(".json")).write_text(json.dumps(res, indent=1, default=float) + "\n")
    s = summarize(res["rows"], CHOSEN)
    note = f"{s['pairs']} pairs, load {res['load_before'][0]:.2f}/{res['load_after'][0]:.2f}"
    base = summarize(res["rows"], "a+b (replay before #13)")
    return [result("fidelity", "ratio_error_median", 100 * s["ratio_err_median"], "%", "a+b model",
                   100 * base["ratio_err_median"], notes=note),
            result("fidelity", "ratio_error_worst", 100 * s["ratio_err_worst"], "%", "a+b model",
                   100 * base["ratio_err_worst"], notes=note),
            result("fidelity", "layer_time_mape", 100 * s["layer_mape"], "%", "a+b model",
                   100 * base["layer_mape"], notes=note),
            result("fidelity", "straggler_right", 100 * (s["straggler_hit"] or 0), "%", notes=note)] + [
        result("fidelity", f"{k}_cpu_basis", 100 * (c[k] or 0), "%", "wall-clock", 100 * (s[k] or 0),
               notes=note + "; CPU basis: the host's scheduling noise removed")
        for c in [summarize(res["rows"], CHOSEN, "cpu")]
        for k in ("ratio_err_median", "ratio_err_worst", "layer_mape", "straggler_hit")]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rescore"]:
        # python benchmarks/bench_fidelity.py --rescore [FILE.json]: the same runs, current model variants
        run("full", rescore(Path(sys.argv[2]) if len(sys.argv) > 2 else RESULT.with_suffix(".json")))
    else:
        main(run)

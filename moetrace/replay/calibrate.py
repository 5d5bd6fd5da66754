"""Calibrate the replay cost model on one run's measured spans and judge its predictions
on another run.

The replay engine predicts, per (step, layer, rank), expert time ``a·tokens + b·slots
touched`` and all-to-all time from the bytes the rank receives; the layer waits for the
slowest rank. This module checks those predictions against what a profiler measured:

1. :func:`observe` builds one row per (step, layer, rank) of a run: the model's inputs
   (tokens, slots touched, dispatch bytes intra/inter node — exact from per-token routing
   with recorded slots where the run has it, else from the per-slot counts, else the
   replay's split) next to the measured time — the summed duration of the rank's
   ``expert_gemm`` spans in that (step, layer), and of its ``dispatch`` + ``combine``
   spans. Only (step, layer) pairs that hold expert spans are kept (a profiler window
   covers a few steps), and only ranks that have spans at all (a missing trace is not a
   rank with no work).
2. :func:`fit` fits ``expert ≈ a·tokens + b·touched`` (the replay's own
   :func:`~moetrace.costmodel.step_cost.fit_expert_time`, no intercept, both ≥ 0) and
   ``comm ≈ latency + c_intra·bytes_intra + c_inter·bytes_inter`` (least squares, every
   coefficient ≥ 0: a negative one is dropped and the rest refitted), on the cells with a
   measured expert time > 0, and reports R² and residuals.
3. :func:`judge` predicts another run's cells with the fitted parameters and compares:
   mean absolute percentage error and bias (mean signed percentage error) of expert time
   per (step, layer, rank) and of the straggler time (the slowest rank's expert time)
   per (step, layer), the share of (step, layer) where the predicted straggler rank is
   the measured one (ties in the prediction count as a hit when the measured straggler is
   among them), the all-to-all error per cell, and the layer time (the slowest rank's
   expert + all-to-all time, the model's layer time) per (step, layer).

The arithmetic on the cells (metrics, held-out split, band) is
:mod:`moetrace.costmodel.calibrate`; the fits are :mod:`moetrace.costmodel.calibrate_fit`. This module is the
adapter that reads the store and writes the ``calibration`` table.
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pyarrow as pa

from ..costmodel import step_cost as costmod
from ..costmodel.calibrate import (
    HELD_OUT,
    Cells,
    block_size,
    metrics,
    model_band,
    split_steps,
    steps_text,
    straggler_flags,
    take,
)
from ..costmodel.calibrate_fit import LAYER_TERMS, METHODS, Fit, fit, fit_layer, fit_layer_model
from ..costmodel.step_cost import ErrorBand
from ..errors import InputError

# ----------------------------------------------------------------------------- observe
BASES = ("auto", "cpu", "wall")


def cpu_basis_available(store, run_id: str) -> bool:
    """Whether ``run_id`` has timed passes (``cell_times``) with the CPU-basis columns on
    every row (a refrun measured with --repeats)."""
    if not store.has_files("cell_times"):
        return False
    cols = store.sql("SELECT * FROM cell_times LIMIT 0").columns
    if "expert_cpu_ns" not in cols or "layer_cpu_ns" not in cols:
        return False
    n = store.sql("""SELECT count(*) AS n, count(expert_cpu_ns) AS e, count(layer_cpu_ns) AS l FROM cell_times
                     WHERE run_id = ?""", [run_id]).row(0, named=True)
    return n["n"] > 0 and n["e"] == n["n"] and n["l"] == n["n"]


def host_slowdown(store, run_id: str) -> float | None:
    """Wall-clock layer time over its CPU-basis time (summed over the run's layers, as the
    lowest rank's rows carry them): how much other processes sharing the cores stretched
    the run; None without CPU-basis times."""
    if not cpu_basis_available(store, run_id):
        return None
    sl = store.sql("""SELECT sum(layer_ns)::DOUBLE / nullif(sum(layer_cpu_ns), 0) AS s FROM cell_times
                      WHERE run_id = ? AND rank = (SELECT min(rank) FROM cell_times WHERE run_id = ?)""",
                   [run_id, run_id])
    v = sl["s"][0] if sl.height else None
    return None if v is None else float(v)


def resolve_basis(store, run_id: str, basis: str = "auto") -> str:
    """'cpu' or 'wall' for ``run_id``: ``auto`` takes the CPU basis where the run has it."""
    if basis not in BASES:
        raise ValueError(f"basis must be one of {', '.join(BASES)}, got {basis!r}")
    if basis == "auto":
        return "cpu" if cpu_basis_available(store, run_id) else "wall"
    if basis == "cpu" and not cpu_basis_available(store, run_id):
        raise InputError(None, f"run {run_id!r} has no CPU-basis times (timed passes of a refrun with --repeats): "
                               "calibrate it on the wall clock")
    return basis


def _timed(store, run_id: str) -> bool:
    """Whether ``run_id`` has timed passes (``cell_times``, a refrun with --repeats)."""
    return bool(store.has_files("cell_times") and store.sql(
        "SELECT count(*) AS n FROM cell_times WHERE run_id = ?", [run_id])["n"][0] > 0)


def _check_trace(store, spans_run: str, load_run: str) -> None:
    """Refuse, in one line saying what the trace has and what it lacks, a profiler trace
    whose kernels cannot be put against the tokens they carried."""
    has = lambda t: store.has_files(t) and store.sql(  # noqa: E731
        f"SELECT count(*) AS n FROM {t} WHERE run_id = ?", [load_run])["n"][0] > 0
    if has("expert_load") or has("routing"):
        return
    inv = store.sql("""SELECT kind, count(*) AS n, count(layer) AS with_layer, count(DISTINCT step) AS steps FROM spans
                       WHERE run_id = ? AND kind IN ('dispatch', 'combine', 'expert_gemm') GROUP BY kind""",
                    [spans_run])
    got = {k: (n, la, st) for k, n, la, st in inv.iter_rows()}
    kinds = ", ".join(f"{got[k][0]} {k}" for k in ("dispatch", "combine", "expert_gemm") if k in got) or "no MoE"
    steps = max((v[2] for v in got.values()), default=0)
    lacks = [f"no routing or expert load of run {load_run!r} says how many tokens they carried (ingest the "
             f"engine's dump of the same steps and pass --load {spans_run}=LOAD_RUN)"]
    if got.get("expert_gemm", (0, 1))[1] == 0:
        lacks.append("its expert_gemm kernels carry no layer (no 'layer N' range around their launch)")
    if steps < 2:
        lacks.append(f"a held-out band needs 2 steps or more (it has {steps})")
    raise InputError(None, f"run {spans_run!r}: cannot calibrate: its trace has {kinds} kernels in {steps} step(s), "
                           f"but {'; '.join(lacks)}")


def observe(store, run_id: str, step_range: tuple[int, int] | None = None, load_run: str | None = None,
            step_offset: int = 0, basis: str = "wall") -> Cells:
    """Per (step, layer, rank) model inputs and measured span times of ``run_id``.

    ``basis`` 'cpu' (timed refrun passes only): the measured expert time is the rank's
    main-thread CPU time in its experts and the all-to-all time the layer's CPU-basis time
    less it (so a (step, layer)'s measured layer time, the max over ranks of expert +
    all-to-all, is the layer's CPU-basis time: what it takes with a free core per rank);
    'wall': the wall clock (monotonic), medians over the passes.

    ``load_run``: take the routing / expert load / placement from this other run of the
    store (a profiler trace and an engine dump are ingested as two runs); span step ``s``
    is load step ``s + step_offset``, and span ranks must be the engine's EP ranks.
    ``step_range`` selects load steps."""
    spans_run = run_id
    run_id = load_run or run_id
    from dataclasses import replace

    from ..placement.plan_store import recorded_plan
    from .engine import replay_load
    from .load import iter_load, read_shape, routing_block, routing_has_slots

    timed = store.has_files("cell_times") and store.sql(
        "SELECT count(*) AS n FROM cell_times WHERE run_id = ?", [spans_run])["n"][0] > 0
    if not timed and (not store.has_files("spans") or store.sql(
            "SELECT count(*) AS n FROM spans WHERE run_id = ?", [spans_run])["n"][0] == 0):
        raise InputError(None, f"run {spans_run!r} has no profiler spans: calibration needs a Kineto or Nsight trace "
                               "(or a refrun) ingested into the same run")
    if not timed:
        _check_trace(store, spans_run, run_id)
    shape = read_shape(store, run_id)
    plan = recorded_plan(store, run_id, shape)
    notes = list(shape.notes)
    if load_run and load_run != spans_run:
        notes.append(f"spans from run {spans_run}, routing/load from run {load_run}"
                     + (f", load step = span step + {step_offset}" if step_offset else ""))
    if plan.policy != "recorded":
        notes.append("no recorded placement: contiguous assumed (slot = expert)")
    if timed:
        # repeated timed passes (refrun --repeats): their medians, not one profiled pass
        if basis == "cpu":
            ex = store.sql("SELECT step + ? AS step, layer, rank, expert_cpu_ns::DOUBLE AS dur FROM cell_times "
                           "WHERE run_id = ?", [int(step_offset), spans_run])
            cm = store.sql("SELECT step + ? AS step, layer, rank, greatest(layer_cpu_ns - expert_cpu_ns, 0)::DOUBLE "
                           "AS dur FROM cell_times WHERE run_id = ?", [int(step_offset), spans_run])
            notes.append("CPU basis: expert time = the rank's main-thread CPU time in its experts; all-to-all = the "
                         "layer's CPU-basis time less it (the host's scheduling of other processes left out)")
        else:
            ex = store.sql("SELECT step + ? AS step, layer, rank, expert_ns::DOUBLE AS dur FROM cell_times "
                           "WHERE run_id = ?", [int(step_offset), spans_run])
            cm = store.sql("SELECT step + ? AS step, layer, rank, comm_ns::DOUBLE AS dur FROM cell_times "
                           "WHERE run_id = ?", [int(step_offset), spans_run])
        traced = np.sort(store.sql("SELECT DISTINCT rank FROM cell_times WHERE run_id = ?", [spans_run])["rank"]
                         .to_numpy())
        passes = store.sql("SELECT min(passes) AS p FROM cell_times WHERE run_id = ?", [spans_run])["p"][0]
        notes.append(f"measured times: medians over {passes} timed pass(es) per (step, layer, rank) (table "
                     "cell_times), not profiler spans")
        if "layer_cpu_ns" in store.sql("SELECT * FROM cell_times LIMIT 0").columns:
            sl = store.sql("""SELECT sum(layer_ns)::DOUBLE / sum(layer_cpu_ns) AS s FROM cell_times
                              WHERE run_id = ? AND rank = (SELECT min(rank) FROM cell_times WHERE run_id = ?)
                              HAVING count(layer_cpu_ns) = count(*)""", [spans_run, spans_run])
            if sl.height and sl["s"][0] is not None:
                notes.append(f"host slowdown of run {spans_run}: wall-clock layer time = {sl['s'][0]:.2f} x its "
                             "CPU-basis time (other processes sharing the cores; wall-clock errors include it)")
    else:
        ex = store.sql("""SELECT step + ? AS step, layer, rank, sum(end_ns - start_ns)::DOUBLE AS dur FROM spans
                          WHERE run_id = ? AND kind = 'expert_gemm' AND step IS NOT NULL AND layer IS NOT NULL
                          GROUP BY ALL""", [int(step_offset), spans_run])
    if ex.height == 0:
        n = store.sql("SELECT count(*) AS n FROM spans WHERE run_id = ? AND kind = 'expert_gemm'", [spans_run])["n"][0]
        why = ("its expert_gemm spans carry no step or layer (annotate steps with ProfilerStep#N and layers with "
               "a 'layer N' range)" if n else
               "no span is classified expert_gemm (see `moetrace kernels`; add your expert kernel's name with "
               "--kernel-rules at ingest)")
        raise InputError(None, f"run {spans_run!r}: cannot calibrate, {why}")
    if not timed:
        cm = store.sql("""SELECT step + ? AS step, layer, rank, sum(end_ns - start_ns)::DOUBLE AS dur FROM spans
                          WHERE run_id = ? AND kind IN ('dispatch', 'combine') AND step IS NOT NULL AND layer IS NOT NULL
                          GROUP BY ALL""", [int(step_offset), spans_run])
        traced = np.sort(store.sql("SELECT DISTINCT rank FROM spans WHERE run_id = ?", [spans_run])["rank"].to_numpy())
    traced = traced[(traced >= 0) & (traced < plan.num_ranks)]
    # span layers are model layer ids when they match the load's; else the i-th MoE layer
    span_layers = np.unique(ex["layer"].to_numpy())
    layers = shape.layers
    layer_map = None
    if not np.isin(span_layers, layers).all():
        if span_layers.max() < layers.size and span_layers.min() >= 0:
            layer_map = layers
            notes.append("span layer ids are not the load's layer ids: span layer i taken as the i-th MoE layer")
        else:
            raise InputError(None, f"run {run_id!r}: span layers {span_layers.tolist()} do not match the "
                                   f"expert_load layers {layers.tolist()}")

    def cells_of(df):
        s = df["step"].to_numpy().astype(np.int64)
        li = df["layer"].to_numpy().astype(np.int64)
        lay = layer_map[li] if layer_map is not None else li
        return s, lay, df["rank"].to_numpy().astype(np.int64), df["dur"].to_numpy()

    es, el, er, ed = cells_of(ex)
    keep = np.isin(es, shape.steps)
    if step_range is not None:
        keep &= (es >= step_range[0]) & (es < step_range[1])
    if not keep.any():
        raise InputError(None, f"run {run_id!r}: no step with expert spans has recorded expert load"
                               + (f" in steps [{step_range[0]}, {step_range[1]})" if step_range else ""))
    if (~np.isin(es, shape.steps)).any():
        notes.append(f"{int((~np.isin(es, shape.steps)).sum())} expert span groups fall in steps without "
                     "recorded load: left out")
    pairs = np.unique(np.stack([es[keep], el[keep]], axis=1), axis=0)           # (step, layer)
    steps = np.unique(pairs[:, 0])
    # model inputs for every step in [min, max] that has load (the engine indexes contiguous step ids)
    ids = shape.steps[(shape.steps >= steps[0]) & (shape.steps <= steps[-1])]
    if shape.has_routing:
        with_slots = routing_has_slots(store, run_id)
        block = routing_block(store, run_id, shape, plan, "hash", ids, use_recorded_slot=with_slots)
        notes.append("tokens, slots touched and dispatch bytes from per-token routing"
                     + (" with the recorded slots (exact)" if with_slots else
                        " (replica chosen by the token hash: the recorded slot is unknown)"))
    else:
        parts = list(iter_load(store, run_id, replace(shape, steps=ids), with_slots=True))
        load = np.concatenate([p[1] for p in parts])
        slot_load = np.concatenate([p[2] for p in parts]) if shape.has_slot else None
        block = replay_load(load, plan, "hash", slot_load, shape.top_k, shape.bytes_per_token)
        notes.append("tokens and slots touched from the recorded per-slot counts (exact); dispatch bytes estimated"
                     if shape.has_slot else
                     "tokens and slots touched from per-expert counts split over replicas by the hash rule; "
                     "dispatch bytes estimated")
    # the cell grid: (step, layer) with expert spans x traced ranks
    P, Rt = pairs.shape[0], traced.size
    c_step = np.repeat(pairs[:, 0], Rt)
    c_layer = np.repeat(pairs[:, 1], Rt)
    c_rank = np.tile(traced, P)
    ti = np.searchsorted(ids, c_step)
    li = np.searchsorted(plan.layers, c_layer)
    if not (np.array_equal(ids[np.minimum(ti, ids.size - 1)], c_step) and (li < plan.num_layers).all()
            and np.array_equal(plan.layers[np.minimum(li, plan.num_layers - 1)], c_layer)):
        raise InputError(None, f"run {run_id!r}: span steps or layers outside the recorded load")

    def measured(s, lay, r, d):
        out = np.zeros(c_step.size)
        R = plan.num_ranks
        key_c = (c_step * (int(layers.max()) + 1) + c_layer) * R + c_rank
        key_m = (s * (int(layers.max()) + 1) + lay) * R + r
        order = np.argsort(key_c)
        pos = np.searchsorted(key_c[order], key_m)
        ok = (pos < key_c.size) & (r >= 0) & (r < R)
        ok[ok] &= key_c[order][pos[ok]] == key_m[ok]
        out[order[pos[ok]]] = d[ok]
        return out

    expert_ns = measured(es, el, er, ed)
    cs, clay, cr, cd = cells_of(cm) if cm.height else (np.zeros(0, np.int64),) * 3 + (np.zeros(0),)
    comm_ns = measured(cs, clay, cr, cd)
    if cm.height == 0:
        notes.append("no dispatch/combine spans: all-to-all not calibrated")
    sel = (ti, li, c_rank)
    return Cells(spans_run, c_step, c_layer, c_rank,
                 np.asarray(block.tokens, np.float64)[sel], np.asarray(block.touched, np.float64)[sel],
                 np.asarray(block.bytes_intra, np.float64)[sel], np.asarray(block.bytes_inter, np.float64)[sel],
                 expert_ns, comm_ns, notes)


def fit_from_cell_times(store, run_id: str, base: costmod.CostModel | None = None) -> costmod.CostModel | None:
    """The cost model fitted (:func:`fit_layer_model`, :data:`LAYER_TERMS`) on a run's
    measured ``cell_times`` (refrun --repeats medians) against its recorded routing /
    load; None when the run has no cell_times."""
    if not store.has_files("cell_times") or store.sql(
            "SELECT count(*) AS n FROM cell_times WHERE run_id = ?", [run_id])["n"][0] == 0:
        return None
    from types import SimpleNamespace

    c = observe(store, run_id)
    ranks = np.unique(c.rank)
    P = c.size // ranks.size
    grid = lambda v: np.asarray(v, np.float64).reshape(P, 1, ranks.size)  # noqa: E731  (pair-major, rank-minor)
    lay = store.sql("SELECT step, layer, any_value(layer_ns)::DOUBLE AS ns FROM cell_times WHERE run_id = ? "
                    "GROUP BY ALL", [run_id])
    ln = {(int(s_), int(la)): v for s_, la, v in lay.iter_rows()}
    pairs = np.stack([c.step, c.layer], axis=1)[::ranks.size]
    layer_ns = np.array([[ln[(int(s_), int(la))]] for s_, la in pairs])
    blk = SimpleNamespace(tokens=grid(c.tokens), touched=grid(c.touched), bytes_intra=grid(c.bytes_intra),
                          bytes_inter=grid(c.bytes_inter))
    m = fit_layer_model(blk, grid(c.expert_ns), layer_ns, LAYER_TERMS, base, run_id)
    m.source = (f"fitted on run {run_id}'s measured cell_times ({', '.join(LAYER_TERMS)}; medians of timed passes); "
                f"bandwidths from {(base.source if base else 'preset H200').split(':')[0]}")
    return m


def cell_table(c: Cells, f: Fit, calibration_id: str, role: str, created_at_ns: int,
               model_json: str | None = None) -> pa.Table:
    ex, cm = f.predict(c)
    mf, pf = straggler_flags(c.step, c.layer, c.expert_ns, ex)
    n = c.size
    const = lambda v, t: pa.array([v] * n, t)  # noqa: E731
    return pa.table({
        "calibration_id": const(calibration_id, pa.string()), "role": const(role, pa.string()),
        "fit_run_id": const(f.run_id, pa.string()), "created_at_ns": const(created_at_ns, pa.int64()),
        "step": pa.array(c.step, pa.int64()), "layer": pa.array(c.layer, pa.int32()),
        "rank": pa.array(c.rank, pa.int32()), "tokens": pa.array(c.tokens, pa.float64()),
        "slots_touched": pa.array(c.touched.astype(np.int32), pa.int32()),
        "bytes_intra": pa.array(c.bytes_intra, pa.float64()), "bytes_inter": pa.array(c.bytes_inter, pa.float64()),
        "measured_expert_ns": pa.array(np.round(c.expert_ns).astype(np.int64), pa.int64()),
        "predicted_expert_ns": pa.array(ex, pa.float64()),
        "measured_comm_ns": pa.array(np.round(c.comm_ns).astype(np.int64), pa.int64()),
        "predicted_comm_ns": pa.array(cm, pa.float64()),
        "measured_straggler": pa.array(mf, pa.bool_()), "predicted_straggler": pa.array(pf, pa.bool_()),
        "a_ns": const(f.model.a_ns, pa.float64()), "b_ns": const(f.model.b_ns, pa.float64()),
        "comm_latency_ns": const(f.comm_latency_ns, pa.float64()),
        "comm_ns_per_byte_intra": const(f.comm_ns_per_byte_intra, pa.float64()),
        "comm_ns_per_byte_inter": const(f.comm_ns_per_byte_inter, pa.float64()),
        "expert_r2": const(f.expert_r2, pa.float64()), "comm_r2": const(f.comm_r2, pa.float64()),
        "model_json": const(model_json, pa.string()),
    })


def new_calibration_id() -> str:
    return f"c-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def calibrate(store, fit_run: str, judge_runs: list[str] = (), *, fit_steps=None, judge_steps=None,
              hardware: str = "H200", loss: str = "l2", write: bool = True,
              calibration_id: str | None = None, load_runs: dict | None = None, step_offset: int = 0,
              basis: str = "auto", method: str = "auto", held_out: str = "auto", block: int | None = None,
              keep_model: bool = False) -> dict:
    """Fit on ``fit_run``, judge on each of ``judge_runs``; with none, on held-out steps of
    the fit run itself (``held_out``, :data:`~moetrace.costmodel.calibrate.HELD_OUT`: 'auto' = 'blocks',
    alternating whole blocks of ``block`` steps; 'none' = the fit only, in-sample). Stores
    the cells in ``calibration`` unless ``write`` is False, the fitted model (with the band
    it was judged at) on the fit rows, for replays to use. Returns a summary dict (fit
    parameters, one metrics dict per judged run, the band).

    ``basis`` (see :func:`observe`): 'auto' judges on the CPU basis when the fit run and
    every judged run have it (refrun timed passes) and on the wall clock otherwise. On the
    CPU basis the same fit and judgement on the wall clock come beside it (``wall_clock``,
    not stored) with each run's host slowdown (``host_slowdown``).

    ``method`` (:data:`~moetrace.costmodel.calibrate_fit.METHODS`): 'auto' fits on the fidelity basis
    ('layer': per-rank expert times and the layer times) where the runs carry timed passes,
    else each cell's expert and all-to-all spans on their own ('cells')."""
    from .load import read_shape

    if method not in METHODS:
        raise InputError(None, f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if held_out not in HELD_OUT:
        raise InputError(None, f"unknown held-out scheme {held_out!r} (choose from {', '.join(HELD_OUT)})")
    if held_out == "auto":
        held_out = "none" if judge_runs or judge_steps else "blocks"
    elif held_out != "none" and (judge_runs or judge_steps):
        raise InputError(None, f"--held-out {held_out} judges the fit run's own steps: leave out --judge-run and "
                               "--judge-steps")
    cid = calibration_id or new_calibration_id()
    now = time.time_ns()
    load_runs = load_runs or {}
    runs = [fit_run] + [r for r in judge_runs if r != fit_run]
    if basis == "auto":
        basis = "cpu" if all(cpu_basis_available(store, r) for r in runs) else "wall"
    else:
        for r in runs:
            resolve_basis(store, r, basis)
    if method == "auto":
        method = "layer" if all(_timed(store, r) for r in runs) else "cells"
    for r in runs:
        if not _timed(store, r) and store.has_files("spans"):
            _check_trace(store, r, load_runs.get(r) or r)
    shape = read_shape(store, load_runs.get(fit_run) or fit_run)
    base = costmod.preset(hardware, shape.hidden, shape.expert_bytes)
    ctx = dict(store=store, fit_run=fit_run, judge_runs=list(judge_runs), fit_steps=fit_steps, judge_steps=judge_steps,
               base=base, loss=loss, load_runs=load_runs, step_offset=step_offset, cid=cid, now=now, method=method,
               held_out=held_out, block=block)
    out = _calibrate_on(basis=basis, **ctx)
    tables, model = out.pop("_tables"), out.pop("_model")
    if keep_model:      # the fitted CostModel itself, for a replay that calibrates in memory
        out["model"] = model
    out["basis"] = basis
    out["host_slowdown"] = {r: host_slowdown(store, r) for r in runs}
    if basis == "cpu":
        wall = _calibrate_on(basis="wall", **ctx)
        wall.pop("_model")
        out["wall_clock"] = {"fit": {"metrics": wall["fit"]["metrics"]},
                             "judged": [{"run_id": j["run_id"], "metrics": j["metrics"]} for j in wall["judged"]]}
    if write:
        for rid, parts in tables.items():
            store.append(rid, {"calibration": pa.concat_tables(parts)})
    out["stored"] = bool(write)
    return out


def _calibrate_on(*, store, fit_run, judge_runs, fit_steps, judge_steps, base, loss, load_runs, step_offset, basis,
                  cid, now, method, held_out, block) -> dict:
    cf = observe(store, fit_run, fit_steps, load_runs.get(fit_run), step_offset, basis)
    held = None
    if held_out != "none":
        fs, js = split_steps(cf.step, held_out, block)
        held = take(cf, np.isin(cf.step, js))
        cf = take(cf, np.isin(cf.step, fs))
    f = fit_layer(cf, base) if method == "layer" else fit(cf, base, loss)
    ex, cm = f.predict(cf)
    fit_metrics = metrics(cf.step, cf.layer, cf.expert_ns, ex, cf.comm_ns, cm)
    out = {"calibration_id": cid, "loss": loss, "method": method, "held_out": held_out,
           "fit": {**f.describe(), "steps": _steps_of(cf), "steps_text": steps_text(cf.step),
                   "metrics": fit_metrics, "input_notes": cf.notes}, "judged": []}
    judged = [(rid, observe(store, rid, judge_steps, load_runs.get(rid), step_offset, basis)) for rid in judge_runs]
    if held is not None:
        judged.append((fit_run, held))
    cells = {}
    for rid, cj in judged:
        if held is not None and cj is held:
            note = (f"held out: steps {steps_text(cj.step)} of the fit run (whole "
                    + (f"blocks of {block_size(cf, cj)} steps" if held_out == "blocks" else "second half")
                    + f"), fitted on steps {steps_text(cf.step)}")
        elif rid == fit_run and not judge_steps:
            note = "judged on the fit run itself (in-sample)"
        elif rid == fit_run:
            note = f"judged on steps [{judge_steps[0]}, {judge_steps[1]}) of the fit run"
        else:
            note = None
        pe, pc = f.predict(cj)
        mt = metrics(cj.step, cj.layer, cj.expert_ns, pe, cj.comm_ns, pc)
        out["judged"].append({"run_id": rid, "steps": _steps_of(cj), "steps_text": steps_text(cj.step),
                              "held_out": cj is held, "metrics": mt, "notes": cj.notes + ([note] if note else [])})
        cells[rid] = cells.get(rid, []) + [cj]
    out["band"] = model_band(out, cid, load_runs.get(fit_run), basis)
    if out["band"]["rel_error"] is not None:
        f.model.rel_error, f.model.rel_error_source = out["band"]["rel_error"], out["band"]["source"]
    model_json = json.dumps({**f.model.describe(), "calibration": {
        k: out["band"][k] for k in ("calibration_id", "fit_run_id", "load_run_id", "fit_steps", "judged", "rel_error",
                                    "what", "method", "basis")}}, sort_keys=True, default=float)
    tables = {fit_run: [cell_table(cf, f, cid, "fit", now, model_json)]}
    for rid, cs in cells.items():
        for cj in cs:
            tables.setdefault(rid, []).append(cell_table(cj, f, cid, "judge", now))
    out["_tables"], out["_model"] = tables, f.model
    return out


def _steps_of(c: Cells) -> list[int]:
    s = np.unique(c.step)
    return [int(s.min()), int(s.max())] if s.size else []


# ----------------------------------------------------------------------------- stored
SUMMARY_SQL = """
WITH c AS (SELECT * FROM calibration WHERE run_id = ?),
pairs AS (
    SELECT calibration_id, role, step, layer, max(measured_expert_ns) AS mmax, max(predicted_expert_ns) AS pmax,
           bool_or(measured_straggler AND predicted_straggler) AS hit, count(*) AS ranks,
           max(measured_expert_ns + measured_comm_ns) AS lm, max(predicted_expert_ns + predicted_comm_ns) AS lp,
           max(measured_comm_ns) > 0 AS has_comm
    FROM c GROUP BY ALL HAVING max(measured_expert_ns) > 0),
p AS (
    SELECT calibration_id, role, count(*) AS pairs, avg(abs(pmax - mmax) / mmax) AS straggler_mape,
           avg((pmax - mmax) / mmax) AS straggler_bias, avg(hit::DOUBLE) AS straggler_hit_rate,
           avg(1.0 / ranks) AS straggler_chance,
           avg(abs(lp - lm) / lm) FILTER (WHERE has_comm) AS layer_mape,
           avg((lp - lm) / lm) FILTER (WHERE has_comm) AS layer_bias
    FROM pairs GROUP BY ALL),
s AS (
    SELECT calibration_id, role, any_value(fit_run_id) AS fit_run_id, min(created_at_ns) AS created_at_ns,
           any_value(a_ns) AS a_ns, any_value(b_ns) AS b_ns, any_value(expert_r2) AS expert_r2,
           any_value(comm_latency_ns) AS comm_latency_ns, any_value(comm_r2) AS comm_r2,
           min(step) AS first_step, max(step) AS last_step,
           count(*) FILTER (WHERE measured_expert_ns > 0) AS cells,
           avg(abs(predicted_expert_ns - measured_expert_ns) / measured_expert_ns)
               FILTER (WHERE measured_expert_ns > 0) AS expert_mape,
           avg((predicted_expert_ns - measured_expert_ns) / measured_expert_ns)
               FILTER (WHERE measured_expert_ns > 0) AS expert_bias,
           avg(abs(predicted_comm_ns - measured_comm_ns) / measured_comm_ns)
               FILTER (WHERE measured_comm_ns > 0) AS comm_mape
    FROM c GROUP BY ALL)
SELECT s.*, p.pairs, p.straggler_mape, p.straggler_bias, p.straggler_hit_rate, p.straggler_chance,
       p.layer_mape, p.layer_bias
FROM s LEFT JOIN p USING (calibration_id, role)
ORDER BY created_at_ns DESC, role
"""


def stored_summary(store, run_id: str):
    """One row per (calibration, role) stored for ``run_id``, newest first, with the
    metrics recomputed in SQL from the stored cells (a polars frame; empty when none)."""
    if not store.has_files("calibration"):
        return None
    return store.sql(SUMMARY_SQL, [run_id])


# ----------------------------------------------------------------------------- error band
def run_hardware(store, run_id: str) -> str | None:
    """The hardware a run was measured on, as its collector recorded it (runs.meta_json
    ``hardware``); None when unknown."""
    df = store.sql("SELECT meta_json FROM runs WHERE run_id = ?", [run_id])
    if df.height == 0 or df["meta_json"][0] is None:
        return None
    try:
        hw = json.loads(df["meta_json"][0]).get("hardware")
    except (ValueError, AttributeError):
        return None
    return hw if isinstance(hw, str) else None


def error_band(store, hardware: str | None) -> ErrorBand:
    """The error band of the time model on ``hardware``: the layer-time error (mean absolute
    percentage error of the predicted layer time; the straggler-time error where no
    all-to-all was measured) of the newest out-of-sample calibration stored in ``store``
    whose fit run was measured on that hardware (``runs.meta_json`` ``hardware``, e.g. the
    CPU of a refrun). Without one: ``rel_error`` None and "uncalibrated preset" in words.
    A preset name (H100, H200, H800, B200) never matches a measured run: the presets are
    datasheet figures (see docs/calibration.md)."""
    if hardware and store.has_files("calibration"):
        cands = store.sql("""SELECT calibration_id, fit_run_id, min(created_at_ns) AS t FROM calibration
                             WHERE role = 'judge' GROUP BY ALL ORDER BY t DESC""")
        for cid, fit_run, t in cands.iter_rows():
            if run_hardware(store, fit_run) != hardware:
                continue
            judged = store.sql("SELECT DISTINCT run_id FROM calibration WHERE calibration_id = ? AND role = 'judge'",
                               [cid])["run_id"].to_list()
            vals = []
            for rid in judged:
                m = stored_summary(store, rid)
                m = m.filter((m["calibration_id"] == cid) & (m["role"] == "judge"))
                if m.height:
                    r = m.row(0, named=True)
                    v = r["layer_mape"] if r["layer_mape"] is not None else r["straggler_mape"]
                    if v is not None:
                        vals.append((float(v), rid, "layer-time" if r["layer_mape"] is not None else "straggler-time"))
            if vals:
                v, rid, what = max(vals)
                when = time.strftime("%Y-%m-%d", time.gmtime(t / 1e9))
                return ErrorBand(v, f"{what} error of calibration {cid} ({when}): fitted on run {fit_run}, "
                                    f"judged on run {rid}, hardware {hardware}")
    what = f"preset {hardware}" if hardware and hardware.upper() in costmod.PRESETS else (
        f"hardware {hardware}" if hardware else "unknown hardware")
    return ErrorBand(None, f"uncalibrated preset: no calibration on {what} in this store, the time model's "
                           "error is not measured")

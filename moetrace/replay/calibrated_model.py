"""The cost model a replay takes from calibration: the one ``moetrace calibrate`` stored
for the run (or, with ``--cost-model RUN_ID``, for another run), else one fitted in memory
on held-out blocks of the run's own trace. Each carries the band measured where it was
judged and says in its source where it was fitted and judged."""
from __future__ import annotations

import json

from ..costmodel import step_cost as costmod
from ..errors import InputError
from .calibrate import _timed, calibrate


def _with_words(model: costmod.CostModel, cal: dict, run_id: str, from_run: str | None,
                where: str = "") -> costmod.CostModel:
    """``model`` with a source that says whose measurements it was fitted on, which steps,
    and where its band was measured (``cal``: the ``calibration`` object of model_json)."""
    whose = "this run's" if from_run in (None, run_id) else f"run {from_run}'s"
    what = "timed passes" if cal.get("method") == "layer" else "trace"
    judged = "; ".join((f"steps {j['steps']}" if j["run_id"] == cal["fit_run_id"] else
                        f"run {j['run_id']} steps {j['steps']}") for j in cal.get("judged", []))
    band = (f", band ±{100 * model.rel_error:.1f}% measured on {judged}" if model.rel_error is not None
            else ", not judged out of sample")
    model.source = (f"fitted on {whose} {what}, steps {cal.get('fit_steps')}{band}: calibration "
                    f"{cal.get('calibration_id')}, method {cal.get('method')}, {cal.get('basis')} basis{where}"
                    + (f"; used by --cost-model {from_run}" if from_run and from_run != run_id else ""))
    return model


def stored_model(store, run_id: str, from_run: str | None = None) -> costmod.CostModel | None:
    """The cost model ``calibrate`` fitted and stored, for a replay of ``run_id``.

    ``from_run`` None: the newest calibration fitted on this run's own measurements (its
    trace or timed passes, or a trace whose load came from this run) and judged out of
    sample (held-out steps or another run): None when there is none. ``from_run`` given
    (``--cost-model RUN_ID``): the newest calibration fitted on that run, judged or not;
    refused when there is none."""
    rows = []
    if store.has_files("calibration") and "model_json" in store.sql("SELECT * FROM calibration LIMIT 0").columns:
        rows = store.sql("""SELECT calibration_id, min(created_at_ns) AS t, any_value(model_json) AS m
                            FROM calibration WHERE role = 'fit' AND model_json IS NOT NULL
                            GROUP BY ALL ORDER BY t DESC""").rows()
    want = from_run or run_id
    known = set(costmod.CostModel.__dataclass_fields__)
    for _cid, _t, mj in rows:
        d = json.loads(mj)
        cal = d.pop("calibration", {})
        if want not in (cal.get("fit_run_id"), cal.get("load_run_id")):
            continue
        if from_run is None and d.get("rel_error") is None:
            continue
        return _with_words(costmod.CostModel(**{k: v for k, v in d.items() if k in known}), cal, run_id, from_run)
    if from_run is not None:
        raise InputError(None, f"--cost-model {from_run}: no cost model fitted on run {from_run!r} is stored (run "
                               f"`moetrace calibrate STORE --run {from_run}` first)")
    return None


def own_trace_model(store, run_id: str, hardware: str = "H200") -> costmod.CostModel | None:
    """For a run that holds its own profiler trace and its routing or load (and no stored
    calibration): the model fitted in memory on alternating blocks of its steps, with the
    band measured on the other blocks (nothing is written). None where the trace cannot be
    calibrated (no expert kernels with step and layer, fewer than 2 steps, too few cells):
    the replay then falls back to its plain fit."""
    if _timed(store, run_id) or not store.has_files("spans") or store.sql(
            "SELECT count(*) AS n FROM spans WHERE run_id = ? AND kind = 'expert_gemm' AND step IS NOT NULL "
            "AND layer IS NOT NULL", [run_id])["n"][0] == 0:
        return None
    try:
        out = calibrate(store, run_id, hardware=hardware, write=False, held_out="blocks", keep_model=True)
    except InputError:
        return None
    if out["band"]["rel_error"] is None:
        return None
    return _with_words(out["model"], out["band"], run_id, None,
                       where="; fitted in memory, not stored (`moetrace calibrate` stores it)")

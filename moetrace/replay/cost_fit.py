"""The cost model a replay of a run uses: the hardware preset, or fitted from the run's
measurements (timed passes of a reference run, else expert_gemm spans), carrying the error
band of the newest out-of-sample calibration on the run's hardware when the store holds one."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..costmodel import choose
from ..costmodel import step_cost as costmod
from ..domain.shape import ClusterSpec, Shape
from ..placement.plan_store import recorded_plan
from .calibrate import error_band, fit_from_cell_times, run_hardware
from .calibrated_model import own_trace_model, stored_model
from .load import read_load, read_shape


# ----------------------------------------------------------------------------- cost model
def fit_cost_from_store(store, run_id: str, base: costmod.CostModel, shape: Shape | None = None):
    """Fit a and b from the run's expert_gemm spans that carry step, layer and rank,
    against the recorded per-rank tokens and slots touched. None when the run has too few."""
    if not store.has_files("spans"):
        return None
    df = store.sql("""SELECT step, layer, rank, sum(end_ns - start_ns) AS dur FROM spans
                      WHERE run_id = ? AND kind = 'expert_gemm' AND step IS NOT NULL AND layer IS NOT NULL
                      GROUP BY ALL""", [run_id])
    if df.height < 8:
        return None
    shape = shape or read_shape(store, run_id)
    if shape.num_ranks is None:
        return None
    plan = recorded_plan(store, run_id, shape)
    steps = np.unique(df["step"].to_numpy())
    ids, dense, _ = read_load(store, run_id, replace(shape, steps=np.intersect1d(shape.steps, steps)))
    return choose.fit_from_spans(ids, plan.layers, dense, plan.share(), plan.copies(), df["step"].to_numpy(),
                                 df["layer"].to_numpy(), df["rank"].to_numpy(), df["dur"].to_numpy(), base)


def cost_model(store, run_id: str, shape: Shape, hardware: str = "H200", fit: bool = True,
               cluster: ClusterSpec | None = None) -> costmod.CostModel:
    """The preset (with ``cluster``'s all-to-all kernel, SMs and node limit), or (with
    ``fit``) the model fitted from the run's expert_gemm spans. The measured error band and
    the timed-pass fit come on top in :func:`run_cost_model`."""
    model = _preset(hardware, shape, cluster)
    if fit:
        model = fit_cost_from_store(store, run_id, model, shape) or model
    return model


def _cost(store, run_id, shape: Shape, opts) -> costmod.CostModel:
    return opts.cost if opts.cost is not None else cost_model(store, run_id, shape, opts.hardware, opts.fit_cost)


def _preset(hardware: str, shape: Shape, cluster: ClusterSpec | None) -> costmod.CostModel:
    c = cluster or ClusterSpec()
    return costmod.preset(hardware, shape.hidden, shape.expert_bytes, kernel=c.kernel, sms=c.sms,
                          max_nodes_per_token=c.max_nodes_per_token)


def _kernel_note(cost: costmod.CostModel, cluster: ClusterSpec | None) -> costmod.CostModel:
    """A model measured on the run (not the preset) times the all-to-all its own way: the
    kernel options given then only name what they would have chosen, said in a note."""
    c = cluster or ClusterSpec()
    given = [f"{o} {v}" for o, v in (("--kernel", c.kernel), ("--sms", c.sms),
                                      ("--max-nodes-per-token", c.max_nodes_per_token)) if v is not None]
    if given and cost.gpu is None:
        cost.notes = [*cost.notes, f"{', '.join(given)}: this replay is timed by the model measured on the run "
                                   f"({cost.source.split(':')[0]}), not by the hardware preset these options "
                                   "choose; --no-fit times it with the preset"]
    return cost


def run_cost_model(store, run_id: str, shape: Shape, hardware: str = "H200", fit: bool = True,
                   cost_model_run: str | None = None, cluster: ClusterSpec | None = None) -> costmod.CostModel:
    """What the run facade passes in as ``ReplayOptions.cost``: the model ``calibrate``
    stored for this run (or, ``cost_model_run``, for that run) with its held-out band; else
    one fitted in memory on held-out blocks of the run's own trace; else the timed-pass fit
    of :mod:`.calibrate`, else the spans fit, else the preset (with ``cluster``'s all-to-all
    kernel, SMs and node limit), carrying the error band of the newest out-of-sample
    calibration on the run's hardware."""
    stored = stored_model(store, run_id, cost_model_run) if (fit or cost_model_run) else None
    if stored is None and fit:
        stored = own_trace_model(store, run_id, hardware)
    if stored is not None:
        return _kernel_note(stored, cluster)
    base = _preset(hardware, shape, cluster)
    fitted = (fit_from_cell_times(store, run_id, base) or fit_cost_from_store(store, run_id, base, shape)) if fit else None
    band = error_band(store, run_hardware(store, run_id) if fitted is not None else hardware)
    return _kernel_note(choose.choose(base, fitted, band), cluster)

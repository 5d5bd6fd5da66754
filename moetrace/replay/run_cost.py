"""The cost model a replay of a run uses: the hardware preset, or fitted from the run's
measurements (timed passes of a reference run, else expert_gemm spans), carrying the error
band of the newest out-of-sample calibration on the run's hardware when the store holds
one. Composes :mod:`.adapter` (spans fit) and :mod:`.calibrate` (timed passes, error band)
so that neither imports the other's caller: calibrate reads the store through the
adapter, the adapter never reads calibrations."""
from __future__ import annotations

from . import cost as costmod
from .adapter import RunShape, fit_cost_from_store
from .calibrate import error_band, fit_from_cell_times, run_hardware


def run_cost_model(store, run_id: str, shape: RunShape, hardware: str = "H200", fit: bool = True) -> costmod.CostModel:
    base = costmod.preset(hardware, shape.hidden, shape.expert_bytes)
    fitted = (fit_from_cell_times(store, run_id, base) or fit_cost_from_store(store, run_id, base, shape)) if fit else None
    cost = fitted if fitted is not None else base
    band = error_band(store, run_hardware(store, run_id) if fitted is not None else hardware)
    if band.rel_error is not None:
        cost.rel_error, cost.rel_error_source = band.rel_error, band.source
    return cost

"""Which cost model a replay applies, from arrays (the store side that reads them stays in
:mod:`moetrace.replay.cost_fit`):

- :func:`fit_from_spans`: the linear expert-time model fitted on a run's ``expert_gemm``
  spans against the tokens and slots each rank had in the same (step, layer);
- :func:`choose`: the fitted model where there is one, else the hardware preset, carrying
  the band of an out-of-sample calibration where one was measured (a band stated by the
  model it belongs to: the preset's own, or the calibration's for the fitted one).
"""
from __future__ import annotations

import numpy as np

from . import step_cost as costmod


def fit_from_spans(step_ids: np.ndarray, layers: np.ndarray, dense: np.ndarray, share: np.ndarray,
                   copies: np.ndarray, span_step: np.ndarray, span_layer: np.ndarray, span_rank: np.ndarray,
                   span_ns: np.ndarray, base: costmod.CostModel) -> costmod.CostModel | None:
    """Fit ``a`` and ``b`` of ``base`` from span durations. ``dense`` [steps, layers,
    experts] is the recorded load of steps ``step_ids`` and layers ``layers``; ``share`` and
    ``copies`` [layers, experts, ranks] the plan's token share and copies; the spans are
    one row per (step, layer, rank) with their summed duration. None when fewer than 8
    spans match a recorded (step, layer, rank)."""
    if step_ids.size == 0:
        return None
    L, R = share.shape[0], share.shape[2]
    tokens = np.einsum("tle,ler->tlr", dense, share)
    touched = np.einsum("tle,ler->tlr", (dense > 0).astype(np.float64), copies)
    s_i = np.searchsorted(step_ids, span_step)
    l_i = np.searchsorted(layers, span_layer)
    r = span_rank
    ok = (l_i < L) & (r < R) & (r >= 0) & (s_i < step_ids.size)
    ok &= layers[np.minimum(l_i, L - 1)] == span_layer
    ok &= step_ids[np.minimum(s_i, step_ids.size - 1)] == span_step
    if ok.sum() < 8:
        return None
    return costmod.fit_expert_time(tokens[s_i[ok], l_i[ok], r[ok]], touched[s_i[ok], l_i[ok], r[ok]],
                                   np.asarray(span_ns)[ok].astype(np.float64), base)


def choose(base: costmod.CostModel, fitted: costmod.CostModel | None,
           band: costmod.ErrorBand | None) -> costmod.CostModel:
    """The model a replay applies: ``fitted`` if any, else ``base`` (the preset, with its own
    GPU x kernel band); a measured calibration ``band`` replaces the stated one."""
    cost = fitted if fitted is not None else base
    if band is not None and band.rel_error is not None:
        cost.rel_error, cost.rel_error_source = band.rel_error, band.source
    return cost

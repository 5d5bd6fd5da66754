"""The cost model's fits on measured cells (arrays in, coefficients out; no store):
least squares with non-negative coefficients, a MAPE fit, and the per-layer model with
its terms."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from . import step_cost as costmod
from .calibrate import LOSSES, Cells, _resid, fit_mape, layer_grids, nonneg_lstsq, r2


@dataclass
class Fit:
    model: costmod.CostModel
    run_id: str
    expert_points: int
    expert_r2: float | None
    expert_resid: dict
    comm_latency_ns: float
    comm_ns_per_byte_intra: float
    comm_ns_per_byte_inter: float
    comm_points: int
    comm_r2: float | None
    comm_resid: dict
    notes: list[str] = field(default_factory=list)
    #: how it was fitted: 'cells' (each rank's expert and all-to-all time on its own) or
    #: 'layer' (the fidelity basis: expert times per rank, the all-to-all latency from the
    #: layer times; :func:`fit_layer`)
    method: str = "cells"

    def predict(self, c: Cells) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (expert ns, all-to-all ns) per cell."""
        ex = self.model.fixed_ns + self.model.a_ns * c.tokens + self.model.b_ns * c.touched
        cm = (self.comm_latency_ns + self.comm_ns_per_byte_intra * c.bytes_intra
              + self.comm_ns_per_byte_inter * c.bytes_inter)
        return ex, cm

    def describe(self) -> dict:
        return {"fit_run_id": self.run_id, "a_ns": self.model.a_ns, "b_ns": self.model.b_ns,
                "expert_points": self.expert_points, "expert_r2": self.expert_r2, "expert_residuals": self.expert_resid,
                "comm_latency_ns": self.comm_latency_ns, "comm_ns_per_byte_intra": self.comm_ns_per_byte_intra,
                "comm_ns_per_byte_inter": self.comm_ns_per_byte_inter, "comm_points": self.comm_points,
                "comm_r2": self.comm_r2, "comm_residuals": self.comm_resid,
                "nvlink_Bps": self.model.nvlink_Bps, "internode_Bps": self.model.internode_Bps,
                "fixed_ns": self.model.fixed_ns, "method": self.method,
                "source": self.model.source, "notes": self.notes}


# ----------------------------------------------------------------------------- fit
def fit(c: Cells, base: costmod.CostModel | None = None, loss: str = "l2") -> Fit:
    """Fit the expert and all-to-all parameters on the cells with measured expert time.

    ``loss='l2'``: ordinary least squares (what ``moetrace replay`` fits from a run's
    spans); ``'mape'``: minimize the mean absolute percentage error (robust to the few
    cells a preempted or warming-up process inflates)."""
    if loss not in LOSSES:
        raise InputError(None, f"unknown loss {loss!r} (choose from {', '.join(LOSSES)})")
    base = base or costmod.preset("H200")
    m = c.expert_ns > 0
    if m.sum() < 8:
        raise InputError(None, f"run {c.run_id!r}: {int(m.sum())} (step, layer, rank) cells with expert spans; "
                               "the fit needs at least 8")
    if np.ptp(c.tokens[m]) == 0:
        raise InputError(None, f"run {c.run_id!r}: every measured cell has the same token count; a and b cannot "
                               "be told apart (profile more steps, or a skewed load)")
    y = c.expert_ns[m]
    model: costmod.CostModel | None
    if loss == "l2":
        # (not None: at least 8 cells with a spread of tokens, checked above)
        model = costmod.fit_expert_time(c.tokens[m], c.touched[m], y, base)
        assert model is not None
    else:
        a, b = fit_mape(np.stack([c.tokens[m], c.touched[m]], axis=1), y)
        model = costmod.CostModel(float(a), float(b), base.nvlink_Bps, base.internode_Bps, source="")
    pred = model.a_ns * c.tokens[m] + model.b_ns * c.touched[m]
    notes = []
    cm = c.comm_ns > 0
    notes.append(f"loss {loss}")
    lat = cin = cout = 0.0
    comm_r2, comm_res = None, {}
    if cm.sum() >= 3:
        X = np.stack([np.ones(int(cm.sum())), c.bytes_intra[cm], c.bytes_inter[cm]], axis=1)
        coef = nonneg_lstsq(X, c.comm_ns[cm]) if loss == "l2" else fit_mape(X, c.comm_ns[cm])
        lat, cin, cout = (float(v) for v in coef)
        cp = lat + cin * c.bytes_intra[cm] + cout * c.bytes_inter[cm]
        comm_r2, comm_res = r2(c.comm_ns[cm], cp), _resid(c.comm_ns[cm], cp)
        # the replay's all-to-all is dispatch + combine = latency + 2 x bytes / bandwidth
        nv = 2e9 / cin if cin > 0 else base.nvlink_Bps
        io = 2e9 / cout if cout > 0 else base.internode_Bps
        if cin <= 0 and c.bytes_intra[cm].any():
            notes.append("intra-node all-to-all time does not grow with bytes in this run: fitted as a constant latency (the cost model keeps the preset NVLink bandwidth)")
        if not c.bytes_inter[cm].any():
            notes.append("no inter-node bytes in the fit run: inter-node bandwidth from the preset")
        model = costmod.CostModel(model.a_ns, model.b_ns, nv, io, source=(
            f"calibrated on run {c.run_id} ({loss}): a, b from {int(m.sum())} (step, layer, rank) expert times; "
            f"all-to-all latency and bandwidth from {int(cm.sum())} cells"),
            fit={"points": int(m.sum()), "r2": r2(y, pred), "comm_latency_ns": lat, "comm_r2": comm_r2},
            latency_ns=lat)
    else:
        notes.append("fewer than 3 cells with all-to-all spans: all-to-all not fitted (preset bandwidths)")
        cin, cout = 1e9 / base.nvlink_Bps, 1e9 / base.internode_Bps
        model = costmod.CostModel(model.a_ns, model.b_ns, base.nvlink_Bps, base.internode_Bps, source=(
            f"calibrated on run {c.run_id} ({loss}): a, b from {int(m.sum())} (step, layer, rank) expert times; "
            f"bandwidths from {base.source.split(':')[0]}"), fit={"points": int(m.sum()), "r2": r2(y, pred)})
    return Fit(model, c.run_id, int(m.sum()), r2(y, pred), _resid(y, pred), lat, cin, cout,
               int(cm.sum()), comm_r2, comm_res, notes)


# ----------------------------------------------------------------------------- layer model
TERMS = ("tokens", "slot", "latency", "fixed", "bytes", "contention")


def fit_layer_model(block, expert_ns: np.ndarray, layer_ns: np.ndarray, terms=("tokens", "slot", "latency", "fixed"),
                    base: costmod.CostModel | None = None, run_id: str = "A") -> costmod.CostModel:
    """Fit the cost model's terms on one run's measured times.

    ``block``: the run's per-(step, layer, rank) ``tokens``, ``touched``, ``bytes_intra``,
    ``bytes_inter`` (a replay Block, [t, L, R]); ``expert_ns`` [t, L, R] measured expert
    time; ``layer_ns`` [t, L] measured layer time (the max over ranks of dispatch start to
    combine end). ``terms``:

    * ``tokens`` (always): a ns per token-expert row; ``slot``: b ns per slot touched;
      ``fixed``: a fixed cost per rank and layer — fitted together by least squares on
      the per-rank expert times (every coefficient ≥ 0);
    * ``contention``: with them, the ns a rank loses per ns that another rank computes at
      the same time (:func:`~moetrace.costmodel.step_cost.overlap_ns`); the overlap depends on a
      and b, so the fit alternates: overlap from the last a, b; least squares of a, b (,
      fixed) and the contention; until a and b settle;
    * ``latency``: the layer's all-to-all latency, the median over (step, layer) of the
      measured layer time minus the slowest rank's predicted compute (the time the fastest
      ranks wait for the slowest is in the max);
    * ``bytes``: with ``latency``, a least-squares fit of that remainder on the slowest
      rank's dispatch + combine bytes (its inverse is the bandwidth).

    Terms left out are 0 (bandwidths from ``base``, preset H200 by default)."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise InputError(None, f"unknown cost-model terms {sorted(unknown)} (choose from {', '.join(TERMS)})")
    base = base or costmod.preset("H200")
    tok = np.asarray(block.tokens, np.float64)
    tch = np.asarray(block.touched, np.float64)
    y = np.asarray(expert_ns, np.float64).ravel()
    names = [n for n in ("tokens", "slot", "fixed") if n in terms or n == "tokens"]
    design = {"tokens": tok.ravel(), "slot": tch.ravel(), "fixed": np.ones(tok.size)}
    X = np.stack([design[n] for n in names], axis=1)
    coef = dict(zip(names, nonneg_lstsq(X, y)))
    g = 0.0
    if "contention" in terms:
        for _ in range(100):
            work = coef["tokens"] * tok + coef.get("slot", 0.0) * tch
            c = nonneg_lstsq(np.column_stack([X, costmod.overlap_ns(work).ravel()]), y)
            new, g = dict(zip(names, c[:-1])), float(c[-1])
            settled = all(abs(new[n] - coef[n]) <= 1e-9 * max(abs(coef[n]), 1.0) for n in names)
            coef = new
            if settled:
                break
    a, b, fixed = float(coef["tokens"]), float(coef.get("slot", 0.0)), float(coef.get("fixed", 0.0))
    lat, bw = 0.0, base.nvlink_Bps
    if "latency" in terms or "bytes" in terms:
        # the layer time the model gives without latency (bytes at the base bandwidths)
        m0 = costmod.CostModel(a, b, base.nvlink_Bps, base.internode_Bps, "", fixed_ns=fixed, contention=g)
        d, comp, cb = m0.rank_ns(tok, tch, block.bytes_intra, block.bytes_inter)
        if "bytes" in terms:
            slow = comp.argmax(axis=2)[..., None]
            rest = np.asarray(layer_ns, np.float64) - np.take_along_axis(comp, slow, 2)[..., 0]
            byt = 2 * np.take_along_axis(np.asarray(block.bytes_intra, np.float64)
                                         + np.asarray(block.bytes_inter, np.float64), slow, 2)[..., 0]
            c = nonneg_lstsq(np.stack([np.ones(rest.size), byt.ravel()], axis=1), rest.ravel())
            lat, per_byte = float(c[0]), float(c[1])
            bw = 1e9 / per_byte if per_byte > 0 else base.nvlink_Bps
        else:
            lat = max(0.0, float(np.median(np.asarray(layer_ns, np.float64) - (d + comp + cb).max(axis=2))))
    return costmod.CostModel(a_ns=a, b_ns=b, nvlink_Bps=bw, internode_Bps=bw if "bytes" in terms else base.internode_Bps,
                             source=f"fitted on run {run_id} ({', '.join(terms)}): {tok.size} (step, layer, rank) "
                                    f"expert times, {np.size(layer_ns)} layer times",
                             fit={"terms": list(terms), "points": int(tok.size)}, fixed_ns=fixed, latency_ns=lat,
                             contention=g)


#: the terms the fidelity matrix (benchmarks/bench_fidelity.py) keeps: see docs/calibration.md
LAYER_TERMS = ("tokens", "slot", "latency")
#: how ``calibrate`` fits: 'layer' = the fidelity matrix's basis (:func:`fit_layer`), 'cells'
#: = each cell's expert and all-to-all time on their own (:func:`fit`); 'auto' takes
#: 'layer' where the measured all-to-all time of a rank is the layer time less its experts
#: (timed passes of a reference run) and 'cells' where the profiler timed each rank's
#: dispatch and combine kernels
METHODS = ("auto", "layer", "cells")


def fit_layer(c: Cells, base: costmod.CostModel | None = None, terms=LAYER_TERMS) -> Fit:
    """The fidelity matrix's fit (:func:`fit_layer_model` with ``terms``) as a :class:`Fit`:
    a, b (and a fixed cost) from each rank's expert time, the all-to-all latency (and with
    ``bytes`` a bandwidth) from the layer times. Its all-to-all prediction per cell is the
    model's dispatch + combine: latency + 2 x bytes / bandwidth."""
    base = base or costmod.preset("H200")
    m = c.expert_ns > 0
    if m.sum() < 8:
        raise InputError(None, f"run {c.run_id!r}: {int(m.sum())} (step, layer, rank) cells with expert times; "
                               "the fit needs at least 8")
    blk, ex, lay = layer_grids(c)
    model = fit_layer_model(blk, ex, lay, terms, base, c.run_id)
    model.source = (f"calibrated on run {c.run_id} ({', '.join(terms)}; the fidelity basis): a, b from "
                    f"{int(m.sum())} (step, layer, rank) expert times, all-to-all latency from {lay.size} layer times")
    cin, cout = 2e9 / model.nvlink_Bps, 2e9 / model.internode_Bps
    y = c.expert_ns[m]
    pred = model.fixed_ns + model.a_ns * c.tokens[m] + model.b_ns * c.touched[m]
    cm = c.comm_ns > 0
    cp = model.latency_ns + cin * c.bytes_intra[cm] + cout * c.bytes_inter[cm]
    notes = [f"method layer: the fidelity basis ({', '.join(terms)})"]
    if "bytes" not in terms:
        notes.append("all-to-all bandwidths from " + base.source.split(":")[0] + " (not fitted)")
    return Fit(model, c.run_id, int(m.sum()), r2(y, pred), _resid(y, pred), model.latency_ns, cin, cout,
               int(cm.sum()), r2(c.comm_ns[cm], cp) if cm.any() else None,
               _resid(c.comm_ns[cm], cp) if cm.any() else {}, notes, method="layer")



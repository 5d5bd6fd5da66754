"""Calibration's arithmetic on measured cells, arrays in and numbers out (no store, no
cost-model object): the cells of one run, least squares with non-negative coefficients and
its MAPE variant, the judged metrics, and the split of a run's steps into fitted and
held-out blocks. The fits that produce a cost model are in :mod:`.calibrate_fit`;
what reads the store is :mod:`moetrace.replay.calibrate`.

Metric definitions, exactly as :func:`metrics` computes them from the stored rows, so SQL
over the ``calibration`` table reproduces them: a cell enters the expert metrics when its
measured expert time is > 0; a (step, layer) enters the straggler metrics when any of its
cells does; a cell enters the all-to-all metrics when its measured all-to-all time is > 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError

TIE_RTOL = 1e-9


@dataclass
class Cells:
    """One entry per (step, layer, rank) of one run: model inputs and measured times."""
    run_id: str
    step: np.ndarray
    layer: np.ndarray
    rank: np.ndarray
    tokens: np.ndarray
    touched: np.ndarray
    bytes_intra: np.ndarray
    bytes_inter: np.ndarray
    expert_ns: np.ndarray          # measured, 0 where the rank had no expert span
    comm_ns: np.ndarray            # measured dispatch + combine, 0 where none
    notes: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.step.size)


# ----------------------------------------------------------------------------- least squares
def _resid(y: np.ndarray, pred: np.ndarray) -> dict:
    if y.size == 0:
        return {}
    r = pred - y
    rel = np.abs(r) / y
    return {"rmse_ns": float(np.sqrt((r ** 2).mean())), "mean_abs_ns": float(np.abs(r).mean()),
            "p50_abs_pct": float(100 * np.percentile(rel, 50)), "p90_abs_pct": float(100 * np.percentile(rel, 90)),
            "max_abs_pct": float(100 * rel.max())}


def r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    ss = float(((y - y.mean()) ** 2).sum()) if y.size else 0.0
    return 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None


def nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: drop the most negative one, refit, repeat."""
    active = [j for j in range(X.shape[1]) if np.any(X[:, j] != 0)]
    coef = np.zeros(X.shape[1])
    while active:
        c, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (c >= 0).all():
            coef[active] = c
            break
        active.pop(int(np.argmin(c)))
    return coef


LOSSES = ("l2", "mape")


def fit_mape(X: np.ndarray, y: np.ndarray, iters: int = 100) -> np.ndarray:
    """Coefficients ≥ 0 minimizing the mean absolute percentage error Σ|X·c − y| / y
    (iteratively reweighted least squares from the relative-L2 solution; y > 0)."""
    w = 1.0 / y
    coef = nonneg_lstsq(X * w[:, None], y * w)
    best, best_err = coef, float(np.abs(X @ coef - y).dot(w))
    for _ in range(iters):
        r = np.abs(X @ coef - y) * w
        ww = w / np.sqrt(np.maximum(r, 1e-6))          # sqrt: the LS weights are squared
        coef = nonneg_lstsq(X * ww[:, None], y * ww)
        err = float(np.abs(X @ coef - y).dot(w))
        if err < best_err - 1e-12 * best_err:
            best, best_err = coef, err
        elif err >= best_err:
            break
    return best


def layer_grids(c: Cells):
    """The cells of a full (step, layer) x rank grid as [P, 1, R] arrays (a replay Block's
    shape, one pseudo-layer per (step, layer) pair) and the measured layer time [P, 1]: the
    slowest rank's expert + all-to-all time."""
    from types import SimpleNamespace

    ranks = np.unique(c.rank)
    R = ranks.size
    if R == 0 or c.size % R:
        raise InputError(None, f"run {c.run_id!r}: the cells are not a full (step, layer) x rank grid")
    P = c.size // R

    def grid(v):
        return np.asarray(v, np.float64).reshape(P, 1, R)     # observe's order: pair-major, rank-minor

    blk = SimpleNamespace(tokens=grid(c.tokens), touched=grid(c.touched), bytes_intra=grid(c.bytes_intra),
                          bytes_inter=grid(c.bytes_inter))
    return blk, grid(c.expert_ns), (grid(c.expert_ns) + grid(c.comm_ns)).max(axis=2)



# ----------------------------------------------------------------------------- judge
def straggler_flags(step, layer, measured, predicted):
    """Per cell: is it the measured straggler of its (step, layer) (the argmax, lowest rank
    on ties), is it among the predicted stragglers (every rank within TIE_RTOL of the max)."""
    key = np.unique(np.stack([step, layer], axis=1), axis=0, return_inverse=True)[1].ravel()
    n = int(key.max()) + 1 if key.size else 0
    mmax = np.full(n, -np.inf)
    np.maximum.at(mmax, key, measured)
    pmax = np.full(n, -np.inf)
    np.maximum.at(pmax, key, predicted)
    is_m = measured == mmax[key]
    # first (lowest index: cells are ordered by rank within a pair) measured max only
    first = np.zeros(n, np.int64) - 1
    for i in np.flatnonzero(is_m)[::-1]:
        first[key[i]] = i
    meas_flag = np.zeros(measured.size, bool)
    meas_flag[first[first >= 0]] = True
    pred_flag = predicted >= pmax[key] - TIE_RTOL * np.abs(pmax[key])
    return meas_flag, pred_flag


def metrics(step, layer, measured, predicted, comm_measured=None, comm_predicted=None) -> dict:
    """The judged errors (module docstring). Percentages are fractions (0.1 = 10%)."""
    out: dict = {}
    m = measured > 0
    out["cells"] = int(step.size)
    out["cells_measured"] = int(m.sum())
    if m.any():
        rel = (predicted[m] - measured[m]) / measured[m]
        out["expert_mape"] = float(np.abs(rel).mean())
        out["expert_bias"] = float(rel.mean())
        out["expert_total_ratio"] = float(predicted[m].sum() / measured[m].sum())
    mf, pf = straggler_flags(step, layer, measured, predicted)
    key, inv = np.unique(np.stack([step, layer], axis=1), axis=0, return_inverse=True)
    inv = inv.ravel()
    n = key.shape[0]
    mmax = np.zeros(n)
    np.maximum.at(mmax, inv, measured)
    pmax = np.full(n, -np.inf)
    np.maximum.at(pmax, inv, predicted)
    hit = np.zeros(n, bool)
    np.logical_or.at(hit, inv, mf & pf)
    ok = mmax > 0
    out["pairs"] = int(ok.sum())
    if ok.any():
        srel = (pmax[ok] - mmax[ok]) / mmax[ok]
        out["straggler_mape"] = float(np.abs(srel).mean())
        out["straggler_bias"] = float(srel.mean())
        out["straggler_hit_rate"] = float(hit[ok].mean())
        out["straggler_chance"] = float((1.0 / np.bincount(inv, minlength=n)[ok]).mean())   # a random guess
    if comm_measured is not None and comm_predicted is not None:
        # layer time: the slowest rank's expert + all-to-all time (the model's rank time)
        lm = np.zeros(n)
        np.maximum.at(lm, inv, measured + comm_measured)
        lp = np.full(n, -np.inf)
        np.maximum.at(lp, inv, predicted + comm_predicted)
        has_comm = np.zeros(n, bool)
        np.logical_or.at(has_comm, inv, comm_measured > 0)
        lok = ok & has_comm
        if lok.any():
            lrel = (lp[lok] - lm[lok]) / lm[lok]
            out["layer_mape"] = float(np.abs(lrel).mean())
            out["layer_bias"] = float(lrel.mean())
        cm = comm_measured > 0
        out["comm_cells"] = int(cm.sum())
        if cm.any():
            crel = (comm_predicted[cm] - comm_measured[cm]) / comm_measured[cm]
            out["comm_mape"] = float(np.abs(crel).mean())
            out["comm_bias"] = float(crel.mean())
    return out


# ----------------------------------------------------------------------------- held-out steps
#: how one run's steps are split when it is judged on itself: 'blocks' alternates whole
#: blocks of steps (fit, judge, fit, ...: slow drifts of the host or the traffic hit both
#: sides), 'half' fits on the first half and judges on the second, 'none' judges in-sample
HELD_OUT = ("auto", "blocks", "half", "none")


def take(c: Cells, mask: np.ndarray) -> Cells:
    """The cells of ``c`` where ``mask`` holds (same run, same notes)."""
    return Cells(c.run_id, c.step[mask], c.layer[mask], c.rank[mask], c.tokens[mask], c.touched[mask],
                 c.bytes_intra[mask], c.bytes_inter[mask], c.expert_ns[mask], c.comm_ns[mask], list(c.notes))


def split_steps(steps: np.ndarray, scheme: str = "blocks", block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(fit steps, held-out steps) of the distinct sorted ``steps``, in whole blocks.

    'blocks': blocks of ``block`` consecutive steps (default: a quarter of the steps, at
    least 1), even blocks fitted, odd blocks held out; 'half': the first half fitted."""
    s = np.unique(np.asarray(steps, np.int64))
    if s.size < 2:
        raise InputError(None, f"{s.size} step(s) with measured times: a held-out band needs at least 2 "
                               "(profile more steps, or judge on another run)")
    if scheme == "half":
        cut = s.size // 2
        return s[:cut], s[cut:]
    if scheme != "blocks":
        raise InputError(None, f"unknown held-out scheme {scheme!r} (choose from blocks, half)")
    size = max(1, int(block) if block else s.size // 4)
    if size >= s.size:
        raise InputError(None, f"blocks of {size} steps leave nothing to hold out of {s.size} steps")
    odd = (np.arange(s.size) // size) % 2 == 1
    return s[~odd], s[odd]


def steps_text(steps) -> str:
    """Sorted steps as ranges: '0–3, 8–11'."""
    s = np.unique(np.asarray(steps, np.int64))
    if s.size == 0:
        return "none"
    cuts = np.flatnonzero(np.diff(s) != 1) + 1
    return ", ".join(f"{int(g[0])}" if g.size == 1 else f"{int(g[0])}–{int(g[-1])}" for g in np.split(s, cuts))


def band_of(m: dict) -> tuple[float | None, str]:
    """The judged error a band is stated from: the layer time where the all-to-all was
    measured, else the straggler time, else the per-rank expert time."""
    for key, what in (("layer_mape", "layer-time"), ("straggler_mape", "straggler-time"),
                      ("expert_mape", "expert-time")):
        if m.get(key) is not None:
            return float(m[key]), what
    return None, "none"


def block_size(cf: Cells, cj: Cells) -> int:
    """The block length of an alternating split: the first run of consecutive fit steps."""
    s = np.unique(np.concatenate([cf.step, cj.step]))
    first = np.isin(s, np.unique(cj.step)).argmax()
    return int(first) if first else 1


def model_band(out: dict, cid: str, load_run: str | None, basis: str) -> dict:
    """The band the fitted model is stated with: its worst judged error (held-out steps of
    the fit run, or the other runs it was judged on); None when it was judged on nothing."""
    fit_run = out["fit"]["fit_run_id"]
    cands: list[tuple[float, str, dict]] = []
    for j in out["judged"]:
        v, what = band_of(j["metrics"])
        if v is not None:
            cands.append((v, what, j))
    band = {"calibration_id": cid, "fit_run_id": fit_run, "load_run_id": load_run, "fit_steps": out["fit"]["steps_text"],
            "method": out["method"], "basis": basis, "judged": [], "rel_error": None, "what": None,
            "source": "not judged out of sample: no band (run calibrate with held-out steps or --judge-run)"}
    if not cands:
        return band
    rel, what, j = max(cands, key=lambda c: c[0])
    where = (f"held-out steps {j['steps_text']} of run {fit_run}" if j["held_out"] else
             f"run {j['run_id']} (steps {j['steps_text']})")
    band.update(rel_error=rel, what=what, judged=[{"run_id": x["run_id"], "steps": x["steps_text"],
                                                    "held_out": x["held_out"]} for x in out["judged"]],
                source=f"{what} error {100 * rel:.1f}% measured on {where} (calibration {cid}, {basis} basis)")
    return band

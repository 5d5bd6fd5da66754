"""The reference run's files as moetrace reads them: the manifest's name and the timing
summary of its timed passes (per (step, layer, rank) medians and spreads, the run's noise
level), shared by the producer (``moetrace refrun``) and the collector."""
from __future__ import annotations

import numpy as np

MANIFEST = "moetrace-refrun.json"


# ----------------------------------------------------------------------------- timing
def _rel_spread(v: np.ndarray) -> float | None:
    """(p75 - p25) / median of the values (None with fewer than 2 values or a zero median)."""
    med = float(np.median(v))
    if v.size < 2 or med <= 0:
        return None
    q75, q25 = np.percentile(v, [75, 25])
    return float((q75 - q25) / med)


def summarize_timing(timing):
    """Per (step, layer, rank) medians and spreads of the timed passes (the ``cell_times``
    table, as a dict of columns) and the run's noise level.

    ``timing``: rows (pass, step, layer, rank, dispatch_start_ns, expert_start_ns,
    expert_end_ns, combine_end_ns[, expert_cpu_ns, moe_cpu_ns]) as a polars frame. Per
    pass, a rank's expert time is expert end − start, its all-to-all time dispatch +
    combine, its MoE time combine end − dispatch start, and the layer's time the last
    combine end − the last dispatch start over the ranks (time.monotonic_ns, one clock for
    all processes).

    CPU basis (when the file has the CPU columns): a rank's expert CPU time and MoE CPU
    time are its main thread's CPU time (``time.thread_time_ns``) in its experts and from
    dispatch start to combine end; the layer's CPU time of a pass is the max over ranks of
    the MoE CPU time (the busiest rank's own work; the time it waits for peers or for the
    OS to schedule it is not in it). With one torch thread per rank the expert compute
    runs in that thread; gloo's transfers run in its own threads, so the all-to-all's wait
    costs no main-thread CPU.

    The noise level is the median over cells of the relative spread ((p75 − p25) / median
    over passes) of the expert time, of the MoE time, of the layer time, and of the CPU
    expert and layer times."""
    import polars as pl

    has_cpu = {"expert_cpu_ns", "moe_cpu_ns"} <= set(timing.columns)
    if not has_cpu:
        timing = timing.with_columns(pl.lit(None, pl.Int64).alias("expert_cpu_ns"),
                                     pl.lit(None, pl.Int64).alias("moe_cpu_ns"))
    t = timing.with_columns(
        (pl.col("expert_end_ns") - pl.col("expert_start_ns")).alias("ex"),
        (pl.col("expert_start_ns") - pl.col("dispatch_start_ns") + pl.col("combine_end_ns")
         - pl.col("expert_end_ns")).alias("cm"),
        (pl.col("combine_end_ns") - pl.col("dispatch_start_ns")).alias("moe"))
    # the layer: from the last rank's arrival at the dispatch to the last combine's end (one
    # monotonic clock for all rank processes), so a rank's late arrival from non-MoE work
    # is not counted, the wait of the fastest ranks for the slowest is
    lay = t.group_by(["pass", "step", "layer"]).agg(
        (pl.col("combine_end_ns").max() - pl.col("dispatch_start_ns").max()).alias("lay"),
        # CPU basis: the busiest rank's MoE CPU time (null when any rank lacks it)
        pl.when(pl.col("moe_cpu_ns").null_count() == 0).then(pl.col("moe_cpu_ns").max()).alias("lay_cpu"))
    lay_cells = lay.group_by(["step", "layer"]).agg(pl.col("lay"), pl.col("lay_cpu")).sort(["step", "layer"])
    lay_med = {}
    for s, layer, v, vc in lay_cells.iter_rows():
        v = np.asarray(v, np.float64)
        vc = np.asarray([x for x in vc if x is not None], np.float64)
        lay_med[(s, layer)] = (int(round(float(np.median(v)))), _rel_spread(v), int(v.min()),
                               int(round(float(np.median(vc)))) if vc.size == len(v) else None,
                               _rel_spread(vc) if vc.size == len(v) else None)
    cells = t.group_by(["step", "layer", "rank"]).agg(pl.col("ex"), pl.col("cm"), pl.col("moe"),
                                                       pl.col("expert_cpu_ns")).sort(["step", "layer", "rank"])
    cols = {k: [] for k in ("step", "layer", "rank", "passes", "expert_ns", "expert_spread", "expert_min_ns", "comm_ns",
                            "moe_ns", "moe_spread", "layer_ns", "layer_spread", "layer_min_ns", "expert_cpu_ns",
                            "expert_cpu_spread", "layer_cpu_ns", "layer_cpu_spread")}
    for s, layer, r, ex, cm, moe, exc in cells.iter_rows():
        ex, cm, moe = (np.asarray(v, np.float64) for v in (ex, cm, moe))
        exc = np.asarray([x for x in exc if x is not None], np.float64)
        exc = exc if exc.size == ex.size else None
        ln, lsp, lmin, lcpu, lcsp = lay_med[(s, layer)]
        for k, v in (("step", s), ("layer", layer), ("rank", r), ("passes", ex.size),
                     ("expert_ns", int(round(float(np.median(ex))))), ("expert_spread", _rel_spread(ex)),
                     ("expert_min_ns", int(ex.min())),
                     ("comm_ns", int(round(float(np.median(cm))))), ("moe_ns", int(round(float(np.median(moe))))),
                     ("moe_spread", _rel_spread(moe)), ("layer_ns", ln), ("layer_spread", lsp),
                     ("layer_min_ns", lmin),
                     ("expert_cpu_ns", None if exc is None else int(round(float(np.median(exc))))),
                     ("expert_cpu_spread", None if exc is None else _rel_spread(exc)),
                     ("layer_cpu_ns", lcpu), ("layer_cpu_spread", lcsp)):
            cols[k].append(v)

    def p50(vals):
        v = [x for x in vals if x is not None]
        return round(float(np.median(v)), 4) if v else None
    noise = {"passes": int(t["pass"].n_unique()) if t.height else 0,
             "expert_spread_p50": p50(cols["expert_spread"]), "moe_spread_p50": p50(cols["moe_spread"]),
             "layer_spread_p50": p50([v[1] for v in lay_med.values()]),
             "expert_cpu_spread_p50": p50(cols["expert_cpu_spread"]),
             "layer_cpu_spread_p50": p50([v[4] for v in lay_med.values()]),
             "definition": "median over (step, layer, rank) cells of (p75 - p25) / median over the timed passes"}
    return cols, noise

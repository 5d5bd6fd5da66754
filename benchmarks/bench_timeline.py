"""Two-micro-batch overlap: the what-if's prediction against a real two-micro-batch run.

The CPU expert-parallel reference run (``moetrace refrun``, gloo all-to-alls, profiler on)
runs once with one micro-batch (run A) and once with ``--micro-batches 2`` (run B: the
all-to-all of one half in flight while the other half computes; same seed, same tokens,
same routing). The overlap what-if (``moetrace whatif --only overlap``,
:func:`moetrace.replay.whatif.overlap_two_micro_batches`) predicts B's step time from A's
recorded timeline alone; printed side by side with B's measured step time (mean over
steps of the slowest rank's step) and A's.

At full size it also measures the wait attribution on a known cause: a control run and a
run with rank 1 held ``DELAY_US`` per layer (``--delay-rank 1 --delay-us``); the delay
recovered = median per-(step, layer) ``layer_waits.net_ns`` of rank 1, delayed minus control,
printed with its standard error (1.2533 x that of the difference of means).

    python benchmarks/bench_timeline.py --size small   # CI: 2 ranks, 3 steps
    python benchmarks/bench_timeline.py --size full    # 2 ranks, 4 layers, 8 steps, 256 tokens per rank; + delay

The machine's load is printed: on a shared host the timings are noisy and gloo's worker
threads compete with the compute for the same cores.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import heavy_lock, main, result  # noqa: E402

DELAY_US = 10_000.0
SIZES = {
    "small": dict(ranks=2, experts=4, top_k=2, layers=2, hidden=64, ffn=128, steps=3, tokens_per_rank=32),
    "full": dict(ranks=2, experts=8, top_k=2, layers=4, hidden=256, ffn=512, steps=8, tokens_per_rank=256),
}


def run(size: str) -> list[dict]:
    from moetrace.collect import ingest
    from moetrace.produce.refrun import RefRunConfig
    from moetrace.produce.refrun import run as refrun
    from moetrace.replay.whatif_store import run_whatifs
    from moetrace.store import Store

    cfg = SIZES[size]
    load0 = os.getloadavg()[0]
    with heavy_lock(size), tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        st = Store(tmp / "st", create=True)
        ids = {}
        for mb in (1, 2):
            refrun(RefRunConfig(**cfg, seed=1, micro_batches=mb), tmp / f"mb{mb}")
            ids[mb] = ingest(st, [tmp / f"mb{mb}"])[0].run_id
        rep = run_whatifs(st, ids[1], disagg=False, domains=(), write=False)
        delay = _delay(st, tmp, cfg) if size == "full" else []
        measured = st.sql("""SELECT avg(ns) AS ns FROM (SELECT step, max(end_ns - start_ns) AS ns FROM steps
                             WHERE run_id = ? GROUP BY step)""", [ids[2]])["ns"][0]
    load1 = os.getloadavg()[0]
    o = rep.overlap
    a_ms, pred_ms, meas_ms = o.before_ns.mean() / 1e6, o.after_ns.mean() / 1e6, measured / 1e6
    note = (f"{cfg['ranks']} ranks, {cfg['layers']} layers, {cfg['tokens_per_rank']} tokens/rank, {cfg['steps']} steps; "
            f"load average {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    err = (pred_ms - meas_ms) / meas_ms
    return [
        result("timeline", "step one micro-batch (measured)", a_ms, "ms", notes=note),
        result("timeline", "step two micro-batches (predicted)", pred_ms, "ms", "measured two-micro-batch run",
               meas_ms, meas_ms / pred_ms, notes=f"prediction error {100 * err:+.1f}%"),
        result("timeline", "exposed a2a one micro-batch", o.exposed_before_ns.mean() / 1e6, "ms"),
        result("timeline", "exposed a2a two (predicted)", o.exposed_after_ns.mean() / 1e6, "ms"),
    ] + delay


def _delay(st, tmp, cfg) -> list[dict]:
    import numpy as np

    from moetrace.analyze.waits import wait_result
    from moetrace.collect import ingest
    from moetrace.produce.refrun import RefRunConfig
    from moetrace.produce.refrun import run as refrun

    nets, culprit = {}, None
    for name, rank in (("ctrl", -1), ("late", 1)):
        refrun(RefRunConfig(**cfg, seed=1, delay_rank=rank, delay_us=DELAY_US if rank >= 0 else 0.0), tmp / name)
        rid = ingest(st, [tmp / name])[0].run_id
        nets[name] = st.sql("""SELECT net_ns FROM layer_waits WHERE run_id = ? AND rank = 1 AND step IS NOT NULL
                               AND layer IS NOT NULL""", [rid])["net_ns"].to_numpy().astype(float)
        if rank >= 0:
            culprit = wait_result(st, rid).top_culprit()["rank"]
    a, c = nets["late"], nets["ctrl"]
    diff = float(np.median(a) - np.median(c))
    se = 1.2533 * float(np.sqrt(a.var(ddof=1) / a.size + c.var(ddof=1) / c.size))
    return [result("timeline", "injected delay recovered", diff / 1e6, "ms", "injected", DELAY_US / 1e3,
                   notes=f"standard error {se / 1e6:.3f} ms over {a.size} (step, layer) cells; top culprit rank "
                         f"{culprit} (injected on rank 1)")]


if __name__ == "__main__":
    main(run)

"""Two-micro-batch overlap: the what-if's prediction against a real two-micro-batch run.

The CPU expert-parallel reference run (``moetrace refrun``, gloo all-to-alls, profiler on)
runs once with one micro-batch (run A) and once with ``--micro-batches 2`` (run B: the
all-to-all of one half in flight while the other half computes; same seed, same tokens,
same routing). The overlap what-if (``moetrace whatif --only overlap``,
:func:`moetrace.replay.timeline_whatif.overlap_two_micro_batches`) predicts B's step time from A's
recorded timeline alone; printed side by side with B's measured step time (mean over
steps of the slowest rank's step) and A's.

At full size it also measures the wait attribution on a known cause: one run with rank 1
held ``DELAY_US`` before the first dispatch of every layer in the even steps
(``--delay-rank 1 --delay-us --delay-every 2``; the odd steps are the control, interleaved
under the same load); the delay recovered = the median net wait of the delayed steps minus
that of the control steps (:func:`moetrace.analyze.waits.wait_shift`), at the collective
where it is largest and per layer, with its standard error.

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
from benchmarks.rank_fork import ranks_forked_here  # noqa: E402

DELAY_US = 10_000.0
SIZES = {
    "small": dict(ranks=2, experts=4, top_k=2, layers=2, hidden=64, ffn=128, steps=3, tokens_per_rank=32),
    "full": dict(ranks=2, experts=8, top_k=2, layers=4, hidden=256, ffn=512, steps=8, tokens_per_rank=256),
}


def run(size: str) -> list[dict]:
    from moetrace.collect import ingest
    from moetrace.produce.refrun import RefRunConfig
    from moetrace.produce.refrun import run as refrun
    from moetrace.replay.timeline_whatif_store import WhatIfOptions, run_whatifs
    from moetrace.run import Store

    cfg = SIZES[size]
    load0 = os.getloadavg()[0]
    # small size: ranks forked from this process (benchmarks.rank_fork: it imports torch once), not spawned
    with heavy_lock(size), ranks_forked_here(size == "small"), tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        st = Store(tmp / "st", create=True)
        ids = {}
        for mb in (1, 2):
            refrun(RefRunConfig(**cfg, seed=1, micro_batches=mb), tmp / f"mb{mb}")
            ids[mb] = ingest(st, [tmp / f"mb{mb}"])[0].run_id
        rep = run_whatifs(st, ids[1], WhatIfOptions(disagg=False, domains=()), write=False)
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
    from moetrace.analyze.waits import wait_result, wait_shift
    from moetrace.collect import ingest
    from moetrace.produce.refrun import RefRunConfig
    from moetrace.produce.refrun import run as refrun

    refrun(RefRunConfig(**cfg, seed=1, delay_rank=1, delay_us=DELAY_US, delay_every=2), tmp / "late")
    rid = ingest(st, [tmp / "late"])[0].run_id
    delayed = range(0, cfg["steps"], 2)
    pos, lay = wait_shift(st, rid, delayed, by="position").top(), wait_shift(st, rid, delayed)
    r1 = lay.ranks.filter(lay.ranks["rank"] == 1).row(0, named=True)
    culprit = wait_result(st, rid).top_culprit()["rank"]
    where = f"rank {pos['rank']}, {pos['kind']} #{pos['pos']} of the layer"
    return [
        result("timeline", "injected delay recovered (at its collective)", pos["shift_ns"] / 1e6, "ms",
               notes=f"injected {DELAY_US / 1e3:g} ms; standard error {pos['se_ns'] / 1e6:.3f} ms, {pos['n_a']} delayed vs "
                                     f"{pos['n_b']} interleaved control cells; largest shift at {where} "
                                     "(injected on rank 1 before the first dispatch)"),
        result("timeline", "injected delay recovered (per layer, rank 1)", r1["shift_ns"] / 1e6, "ms",
               notes=f"injected {DELAY_US / 1e3:g} ms; standard error {r1['se_ns'] / 1e6:.3f} ms; straggler by shift: rank "
                                     f"{lay.straggler}; top culprit by total caused wait: rank {culprit} "
                                     "(the hot experts' rank causes wait at every combine too)"),
    ]


if __name__ == "__main__":
    main(run)

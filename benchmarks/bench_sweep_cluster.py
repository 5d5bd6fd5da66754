"""Replay sweep on a Dask LocalCluster (2 worker processes, one thread each) vs the same
sweep in one process: wall time and speedup, the rows checked equal.

Full size: a synthetic drifting run of 16 layers x 256 experts x 400 steps on 32 ranks (4
nodes, 8 groups); the sweep is replica budgets 0,32,64,96 x (static, re-plan every
10/25/50) x fit windows 50,100 = 32 cells, each judged on the 300 steps after the largest
window. The cluster time is measured twice: with the cluster's start (what ``moetrace sweep
--workers 2`` costs) and on an already running cluster (what ``--scheduler`` costs). On a
machine other jobs share, wall time says little about parallelism, so the CPU seconds are
measured too: the single process's, and each worker's on the running cluster; their ratio
(single CPU / the busiest worker's CPU) is the speedup the sweep would get with a core per
worker.

    python benchmarks/bench_sweep_cluster.py --size full
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import heavy_lock, main, result, timer  # noqa: E402
from moetrace.produce.synth import SynthConfig, synth  # noqa: E402
from moetrace.run import Store  # noqa: E402

SIZES = {
    "small": dict(cfg=dict(layers=2, experts=64, top_k=4, ranks=8, ranks_per_node=4, steps=40, tokens_per_step=256,
                           num_groups=4),
                  replicas=[0, 8], intervals=[5, 10], windows=[10]),
    "full": dict(cfg=dict(layers=16, experts=256, top_k=8, ranks=32, ranks_per_node=8, steps=400,
                          tokens_per_step=4096, num_groups=8),
                 replicas=[0, 32, 64, 96], intervals=[10, 25, 50], windows=[50, 100]),
}
WORKERS = 2


def _worker_starts(size: str):
    """small (Linux): the clusters' worker processes forked from this process, which imported
    moetrace and distributed already, instead of spawned (a fresh interpreter importing them
    per worker: most of the small size's time); full: distributed's default, as a user's
    ``moetrace sweep --workers`` gets."""
    import contextlib

    import dask

    if size != "small" or not sys.platform.startswith("linux"):
        return contextlib.nullcontext()
    return dask.config.set({"distributed.worker.multiprocessing-method": "fork"})


def run(size: str) -> list[dict]:
    import logging

    from distributed import Client, LocalCluster

    from moetrace.replay import distributed

    p = SIZES[size]
    with tempfile.TemporaryDirectory() as tmp, heavy_lock(size), _worker_starts(size):
        st = Store(os.path.join(tmp, "st"), create=True)
        synth(st, SynthConfig(sigma=0.8, drift=0.6, seed=0, **p["cfg"]), run_id="r")
        run_ = st.run("r")
        kw = dict(replicas=p["replicas"], intervals=p["intervals"], windows=p["windows"])
        cpu0 = time.process_time()
        with timer() as t1:
            one = run_.sweep("eplb", **kw)
        single_s, single_cpu = t1(), time.process_time() - cpu0
        cells = sum(r.skipped is None for r in one.rows)
        with timer() as t2:
            two = run_.sweep("eplb", workers=WORKERS, **kw)
        cold_s = t2()
        with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            before = client.run(time.process_time)     # workers up before the clock starts
            with timer() as t3:
                three = run_.sweep("eplb", scheduler=cluster.scheduler_address, **kw)
            warm_s = t3()
            after = client.run(time.process_time)
            worker_cpu = sorted(after[w] - before[w] for w in before)
        for other in (two, three):
            if [asdict(r) for r in other.rows] != [asdict(r) for r in one.rows]:
                raise AssertionError("the cluster sweep's rows differ from the single-process sweep's")
        del distributed
    c = p["cfg"]
    what = (f"{c['layers']} layers x {c['experts']} experts x {c['steps']} steps, {c['ranks']} ranks; {cells} cells "
            f"({len(p['replicas'])} budgets x {1 + len(p['intervals'])} strategies x {len(p['windows'])} windows)")
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end"
    return [
        result("sweep_cluster", "single process", single_s, "s", notes=what),
        result("sweep_cluster", "single process, CPU", single_cpu, "s", notes="CPU seconds of the sweep"),
        result("sweep_cluster", f"LocalCluster {WORKERS} workers, busiest worker CPU", worker_cpu[-1], "s",
               "single process, CPU", single_cpu, single_cpu / worker_cpu[-1],
               notes="CPU seconds per worker " + " / ".join(f"{c:.1f}" for c in worker_cpu)
               + "; the ratio is the speedup with a core per worker"),
        result("sweep_cluster", f"LocalCluster {WORKERS} workers, with start", cold_s, "s", "single process",
               single_s, single_s / cold_s, notes=f"moetrace sweep --workers {WORKERS}; rows equal; {load}"),
        result("sweep_cluster", f"LocalCluster {WORKERS} workers, running", warm_s, "s", "single process",
               single_s, single_s / warm_s, notes=f"moetrace sweep --scheduler ADDRESS; rows equal; {load}"),
    ]


if __name__ == "__main__":
    main(run)

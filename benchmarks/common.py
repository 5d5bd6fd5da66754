"""Shared helpers for benchmark scripts.

Every ``benchmarks/bench_*.py`` exposes ``run(size: str) -> list[dict]`` (size is
"small" for CI or "full" for the figures quoted in the README) and can be run alone with
``python benchmarks/bench_x.py --size full``. Each result dict has the keys of
:func:`result`; ``benchmarks/run_all.py`` runs them all and writes the results table.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import sys
import tempfile
import time
from contextlib import contextmanager


class Skipped(Exception):
    """Raised by a benchmark's ``run`` when what it measures is absent here (a real trace
    under ../shared/data, a GPU): ``run_all.py`` records it as skipped, with the message as
    the reason, instead of as a failure."""


def result(benchmark: str, metric: str, value: float, unit: str, baseline: str | None = None,
           baseline_value: float | None = None, ratio: float | None = None, notes: str = "") -> dict:
    """One measured figure; ``ratio`` is how many times better than the baseline (>1 = faster/smaller)."""
    return {"benchmark": benchmark, "metric": metric, "value": value, "unit": unit, "baseline": baseline,
            "baseline_value": baseline_value, "ratio": ratio, "notes": notes}


def peak_rss_mib(children: bool = False) -> float:
    """Peak resident memory of this process (or of its finished children) in MiB."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024.0


@contextmanager
def timer():
    """``with timer() as t: ...`` then ``t()`` gives elapsed seconds."""
    start = time.perf_counter()
    end = [None]
    yield lambda: (end[0] if end[0] is not None else time.perf_counter()) - start
    end[0] = time.perf_counter()


#: one heavy benchmark at a time on a shared machine (run_all.py holds it for the whole run
#: and tells the benchmarks it started through MOETRACE_HEAVY_LOCK_HELD)
HEAVY_LOCK = os.path.join(tempfile.gettempdir(), "moetrace-heavy.lock")


@contextmanager
def heavy_lock(size: str, announce: bool = False):
    """Hold the heavy-job lock around a full-size run (no-op at small size or when held)."""
    if size != "full" or os.environ.get("MOETRACE_HEAVY_LOCK_HELD"):
        yield
        return
    fd = os.open(HEAVY_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if announce:
            print(f"waiting for {HEAVY_LOCK} ...", file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


#: what a forkserver imports once for the reference-run ranks it forks: torch, the refrun module,
#: what a rank imports lazily otherwise (in its untimed start and warm-up): torch._dynamo (by the
#: first call of the custom expert op ``refrun::moe_mlp``, ~4 s of CPU), pyarrow.parquet (its
#: output files) and pandas (pyarrow's ``pa.table`` checks for a DataFrame, ~1.4 s)
RANK_PRELOAD = ["torch", "torch._dynamo", "pyarrow.parquet", "pandas", "moetrace.produce.refrun"]


@contextmanager
def forked_rank_starts(enabled: bool = True):
    """Within this block ``moetrace.produce.refrun.run`` starts its ranks from a forkserver
    that imported :data:`RANK_PRELOAD` once, instead of "spawn" (a fresh interpreter per rank
    importing torch, then torch._dynamo at the first expert call: seconds of CPU per rank,
    most of a tiny run's time). The ranks are still separate processes running the same
    worker on the same pickled arguments (gloo over TCP, their own files): what a rank
    computes, times and writes is the same; only its start is cheaper. No-op when
    ``enabled`` is false or torch is absent. Used by the small sizes of the benchmarks and
    by the tests (tests/helpers/forked_ranks.py); the full sizes keep "spawn", as a user's
    ``moetrace refrun`` does."""
    if not enabled:
        yield
        return
    try:
        import multiprocessing

        import torch.multiprocessing  # noqa: F401
    except ImportError:
        yield
        return
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    with rank_start_method("forkserver"):
        yield


@contextmanager
def rank_start_method(method: str):
    """Within this block torch.multiprocessing.start_processes starts with ``method`` what
    would be spawned (the one patch behind :func:`forked_rank_starts` and
    ``benchmarks.rank_fork.ranks_forked_here``); torch must be importable."""
    import torch.multiprocessing as tmp

    real = tmp.start_processes

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        chosen = method if start_method == "spawn" else start_method
        return real(fn, args=args, nprocs=nprocs, join=join, daemon=daemon, start_method=chosen)

    tmp.start_processes = start_processes
    try:
        yield
    finally:
        tmp.start_processes = real


def main(run) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["small", "full"], default="small")
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    args = ap.parse_args()
    try:
        rows = run(args.size)
    except Skipped as e:
        print(f"skipped: {e}", file=sys.stderr)
        return
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            extra = ""
            if r.get("baseline"):
                extra = f"   vs {r['baseline']}: {r['baseline_value']:.4g} {r['unit']} (ratio {r['ratio']:.2f}x)" \
                    if r.get("baseline_value") is not None and r.get("ratio") is not None else f"   vs {r['baseline']}"
            print(f"{r['benchmark']:<28} {r['metric']:<32} {r['value']:>14.4g} {r['unit']}{extra}  {r.get('notes', '')}")
    sys.stdout.flush()

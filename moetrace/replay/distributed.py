"""Replay sweeps fanned out on a Dask cluster (``moetrace sweep --workers N`` / ``--scheduler``).

A sweep's cells (replica budgets x re-plan intervals x fit windows, for one run or many)
are independent: :func:`moetrace.replay.sweeps.plan_sweep` lists them on the client,
each cell becomes one Dask task that opens the store read-only (``Store(path)``: a reader
never writes and never recovers), reads the run's counts from the Parquet files itself and
judges the cell with :func:`moetrace.replay.sweeps.sweep_cell`, the function the
single-process sweep calls. The results come back to the client, which assembles the
decision table and, when the sweep is stored, writes it in one transaction per run
(:func:`moetrace.replay.sweeps.finish_sweep`): workers never write.

Workers must see the store at the same path as the client (a shared or network file
system on a real cluster); a worker that cannot open it fails its task with the store's
one-line error. A worker keeps the last runs it read in memory (keyed by the files of the
run, so a store changed between sweeps is read again).

Why Dask and not Ray (docs/how-to/spark-trino-dask.md): it is a pip package (``moetrace[cluster]``) with no
daemon to install, its ``LocalCluster`` runs in-process for tests and CI, and an existing
cluster is one address (``tcp://host:8786``); its tasks are plain Python functions.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from ..errors import MoetraceError, UsageError
from . import sweep as sweeps

#: seconds the client waits for an existing scheduler before giving up
CONNECT_TIMEOUT_S = 10
#: runs a worker keeps in memory between tasks
_CACHE_RUNS = 2
_cache: "OrderedDict[tuple, object]" = OrderedDict()


def _need_dask():
    try:
        import distributed  # noqa: F401
    except ImportError:
        from ..errors import MissingExtra

        raise MissingExtra("--workers / --scheduler", "cluster", "distributed") from None


def run_fingerprint(store_path, run_id: str) -> tuple:
    """The committed files of a run (path, size, mtime): a worker's cached counts are
    reused only while these are unchanged."""
    base = Path(store_path)
    out = []
    for table in sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        part = base / table / f"run_id={run_id}"
        if part.is_dir():
            for f in sorted(part.glob("*.parquet")):
                st = f.stat()
                out.append((f"{table}/{f.name}", st.st_size, st.st_mtime_ns))
    return tuple(out)


def _context(opener, store_path: str, job: sweeps.SweepJob, fingerprint: tuple):
    key = (store_path, job.run_id, fingerprint, job.opts.split, job.opts.passes, job.opts.cost.to_json())
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    store = opener(store_path)      # Store(path): a reader (no create, no recovery)
    try:
        m = sweeps.sweep_context(store, job)
    finally:
        store.close()
    _cache[key] = m
    while len(_cache) > _CACHE_RUNS:
        _cache.popitem(last=False)
    return m


def judge_cells(opener, store_path: str, job: sweeps.SweepJob, fingerprint: tuple,
                cells: list[sweeps.SweepCell]) -> list[sweeps.SweepCellResult]:
    """One Dask task: judge ``cells`` of ``job`` on a worker (reads, never writes).
    ``opener`` is the client's store class (``Store``, opened read-only by path)."""
    m = _context(opener, store_path, job, fingerprint)
    return [sweeps.sweep_cell(m, job, c) for c in cells]


@contextlib.contextmanager
def client_for(workers: int | None = None, scheduler: str | None = None) -> Iterator[object]:
    """A Dask client: on a new LocalCluster of ``workers`` processes (one thread each), or
    on the existing scheduler at ``scheduler`` (else ``DASK_SCHEDULER_ADDRESS``). An
    unreachable scheduler is a one-line UsageError (exit 2)."""
    if workers is not None and scheduler is not None:
        raise UsageError("give --workers N (a local cluster) or --scheduler ADDRESS (an existing one), not both")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be >= 1 (got {workers})")
    address = scheduler if workers is None else None
    if workers is None and not address:
        address = os.environ.get("DASK_SCHEDULER_ADDRESS") or None
        if not address:
            raise UsageError("no Dask cluster: give --workers N, --scheduler ADDRESS or set DASK_SCHEDULER_ADDRESS")
    _need_dask()
    from distributed import Client, LocalCluster

    if address is None:
        with warnings.catch_warnings():   # another cluster's HTTP port in use: not worth a warning here
            warnings.filterwarnings("ignore", message=r"Port \d+ is already in use", category=UserWarning)
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                                   silence_logs=logging.ERROR)
        with cluster, Client(cluster) as client:
            yield client
        return
    try:
        client = Client(address, timeout=CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError, TypeError) as e:
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UsageError(f"--scheduler {address!r}: no Dask scheduler reachable ({why}); nothing was written") from None
    with client:
        yield client


def run_jobs(client, store, jobs: list[sweeps.SweepJob], cells_per_task: int = 1) -> list[sweeps.SweepResult]:
    """Fan the cells of ``jobs`` out on ``client`` (``cells_per_task`` per task), gather
    them and finish each job on the client (stored sweeps are written here, one
    transaction per run)."""
    path = str(Path(store.path).resolve())
    futures, owner = [], []
    for n, job in enumerate(jobs):
        fp = run_fingerprint(path, job.run_id)
        cells = job.cells
        for i in range(0, len(cells), cells_per_task):
            futures.append(client.submit(judge_cells, type(store), path, job, fp, cells[i:i + cells_per_task],
                                         pure=False))
            owner.append(n)
    try:
        gathered = client.gather(futures)
    except MoetraceError:
        raise                   # a task's own one-line error (a store a worker cannot open, bad input)
    except Exception as e:      # the cluster's: a worker lost, a connection closed
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" if str(e).strip() else type(e).__name__
        raise MoetraceError(f"the Dask cluster did not finish the sweep ({why}); nothing was written") from None
    results: list[list] = [[] for _ in jobs]
    for n, part in zip(owner, gathered):
        results[n].extend(part)
    return [sweeps.finish_sweep(store, job, res) for job, res in zip(jobs, results)]

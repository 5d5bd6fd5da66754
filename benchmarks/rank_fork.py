"""Reference-run ranks forked from the benchmark's own process, for the small sizes.

:func:`benchmarks.common.forked_rank_starts` starts the ranks from a forkserver: a fresh
interpreter importing :data:`benchmarks.common.RANK_PRELOAD` (torch, torch._dynamo, pyarrow,
pandas, the refrun module: ~5 s of CPU on 2 cores), once per benchmark process. A benchmark
whose own process imports them anyway (timeline, fidelity, engines) can fork the ranks from
itself instead: the imports are done once, here. The ranks are still separate processes
running the same worker on the same arguments (gloo over TCP, their own files); what a rank
computes, times and writes is the same. Forked only where fork is the platform's default
(Linux) and before this process ran any torch operation (its intra-op threads: a forked
child keeps none of them); elsewhere this is :func:`forked_rank_starts`. The full sizes
keep "spawn", as ``moetrace refrun`` does.
"""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager

from benchmarks.common import RANK_PRELOAD, forked_rank_starts, rank_start_method


@contextmanager
def ranks_forked_here(enabled: bool = True):
    """Within this block ``moetrace.produce.refrun.run`` forks its ranks from this process
    (after importing :data:`RANK_PRELOAD` here). No-op when ``enabled`` is false or torch is
    absent; :func:`forked_rank_starts` off Linux."""
    if not enabled:
        yield
        return
    if not sys.platform.startswith("linux"):
        with forked_rank_starts(enabled):
            yield
        return
    try:
        import torch.multiprocessing  # noqa: F401
    except ImportError:
        yield
        return
    for mod in RANK_PRELOAD:
        importlib.import_module(mod)
    with rank_start_method("fork"):
        yield

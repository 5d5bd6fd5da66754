"""Reference-run ranks started from a forkserver that has torch imported, for the test
tests that run small reference runs in this process (``from ._forked_ranks import
forked_ranks``, then take the fixture ``forked_ranks``; module-scoped).

``moetrace.produce.refrun.run`` starts its ranks with ``start_method="spawn"``: each rank is a
fresh interpreter importing torch, seconds per rank on 2 cores and most of a tiny run's
time. Here the same ``torch.multiprocessing.start_processes`` call is made with
``"forkserver"``: the ranks are still separate processes running the same worker function
on the same pickled arguments (gloo over TCP, their own files), forked from a server that
imported torch and the refrun module once. What a rank computes, times and writes is the
same; only its start is cheaper. ``moetrace refrun`` itself keeps "spawn" (the
command-line tests in test_refrun.py run it as a user would, in a subprocess)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def forked_ranks():
    try:
        import multiprocessing

        import torch.multiprocessing as tmp
    except ImportError:     # the tests that need torch skip themselves
        yield
        return
    real = tmp.start_processes

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        method = "forkserver" if start_method == "spawn" else start_method
        return real(fn, args=args, nprocs=nprocs, join=join, daemon=daemon, start_method=method)

    multiprocessing.set_forkserver_preload(["torch", "moetrace.produce.refrun"])
    mp = pytest.MonkeyPatch()
    mp.setattr(tmp, "start_processes", start_processes)
    yield
    mp.undo()

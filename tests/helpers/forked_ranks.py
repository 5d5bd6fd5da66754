"""Reference-run ranks started from a forkserver that has torch imported, for the
tests that run small reference runs in this process (conftest's module-scoped fixture
``forked_ranks``).

``moetrace.produce.refrun.run`` starts its ranks with ``start_method="spawn"``: each rank is a
fresh interpreter importing torch (and torch._dynamo at the first call of the expert op),
seconds per rank on 2 cores and most of a tiny run's time. Here the same
``torch.multiprocessing.start_processes`` call is made with ``"forkserver"``
(:func:`benchmarks.common.forked_rank_starts`, also used by the benchmarks' small sizes):
the ranks are still separate processes running the same worker function on the same
pickled arguments (gloo over TCP, their own files), forked from a server that imported
torch, torch._dynamo and the refrun module once. What a rank computes, times and writes is
the same; only its start is cheaper. ``moetrace refrun`` itself keeps "spawn" (its
command-line test in test_refrun.py runs ``python -m moetrace refrun`` in a subprocess, with
the ranks forked from a forkserver of that process: test_refrun.FORKED_MAIN). The tests taking
this fixture share one xdist group (conftest.SHARED_FIXTURE_GROUPS): one worker starts the
forkserver."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def forked_ranks() -> Iterator[None]:
    from benchmarks.common import forked_rank_starts

    with forked_rank_starts():
        yield

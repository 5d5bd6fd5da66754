"""Tables handed to the store as streams that can be read more than once."""
from __future__ import annotations


class Rereadable:
    """An iterable of table chunks whose every ``iter()`` starts a new pass (calls
    ``factory()``): the store writes it chunk by chunk, and checks that need a second look
    (collect/conservation.py) can take one. A plain generator is read once only."""

    def __init__(self, factory):
        self.factory = factory

    def __iter__(self):
        return iter(self.factory())


def prefetched(factory, depth: int = 2):
    """Iterate ``factory()`` in a second thread, up to ``depth`` items ahead of the caller:
    while the store compresses and writes one chunk, the next one is read and built
    (Parquet reading, numpy and the Parquet writer release the GIL). An exception of the
    producer is raised here, in the caller; a caller that stops early stops the producer."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in factory():
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as e:      # handed to the caller, raised there
            put((False, e))

    t = threading.Thread(target=work, name="moetrace-prefetch", daemon=True)
    t.start()
    try:
        while True:
            more, item = q.get()
            if more:
                yield item
            elif item is None:
                return
            else:
                raise item
    finally:
        stop.set()
        t.join()

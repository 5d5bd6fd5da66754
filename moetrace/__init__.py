"""moetrace: trace-driven profiling and placement replay for mixture-of-experts serving.

Entry points:

- :func:`open_store` -- open a trace store; ``store.sql("SELECT ...")`` returns polars.
- ``moetrace`` CLI -- ``synth``, ``ingest``, ``runs``, ``sql``, ``catalog``, ``report``, ...
"""
__version__ = "0.1.0"


def open_store(path, create: bool = False):
    """Open (or with ``create=True`` make) the store at ``path``."""
    from .store import open_store as _open

    return _open(path, create=create)


def __getattr__(name):  # lazy public API provided by later modules
    if name == "rebalance_experts":
        from .replay.eplb import rebalance_experts

        return rebalance_experts
    raise AttributeError(name)

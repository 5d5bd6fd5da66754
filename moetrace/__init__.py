"""moetrace: trace-driven profiling and placement replay for mixture-of-experts serving.

Entry points:

- :func:`open_store` -- open a trace store; ``store.sql("SELECT ...")`` returns polars;
  ``store.run(run_id)`` returns the :class:`moetrace.run.Run` facade (shape, skew, tokens
  per expert, dummy steps, exposure, kernels, plan, replay, drift, sweep, calibrate,
  report), documented in ``moetrace/run.py``.
- ``moetrace`` CLI -- ``synth``, ``ingest``, ``runs``, ``sql``, ``catalog``, ``report``, ...
- :func:`rebalance_experts` -- DeepSeek's EPLB, vectorized (``moetrace.replay.eplb``).

Importing ``moetrace`` is cheap: the store, the facade and the replay engine are imported
when first used.
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
    if name in ("Run", "Shape"):
        from . import run

        return getattr(run, name)
    if name == "Store":
        from .store import Store

        return Store
    raise AttributeError(name)

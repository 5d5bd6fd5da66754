"""moetrace: trace-driven profiling and placement replay for mixture-of-experts serving.

Entry points:

- :func:`open_store` -- open a trace store; ``store.sql("SELECT ...")`` returns polars;
  ``store.run(run_id)`` returns the :class:`moetrace.run.Run` facade (shape, skew, tokens
  per expert, dummy steps, exposure, kernels, plan, replay, drift, sweep, calibrate),
  documented in ``moetrace/run.py``; ``moetrace.report.build.build_report(store, run_id)``
  writes the report.
- ``moetrace`` CLI -- ``synth``, ``ingest``, ``runs``, ``sql``, ``catalog``, ``report``, ...
- :func:`rebalance_experts` -- DeepSeek's EPLB, vectorized (``moetrace.placement.eplb``).

Importing ``moetrace`` is cheap: the store, the facade and the replay engine are imported
when first used.
"""
from .version import __version__  # noqa: F401


def __getattr__(name):  # lazy public API provided by later modules
    if name == "rebalance_experts":
        from .placement.eplb import rebalance_experts

        return rebalance_experts
    if name in ("Run", "Shape", "Store", "open_store"):
        from . import run  # the facade: registers store.run(run_id) on the Store

        return getattr(run, name)
    raise AttributeError(name)

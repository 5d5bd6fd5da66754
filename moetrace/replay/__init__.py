"""Replay: what another expert placement would have done, net of moving the experts.

A numeric core (arrays in, arrays and typed results out; no store, no files), over the
pure planners of :mod:`moetrace.placement`:

- :mod:`moetrace.costmodel.step_cost` -- hardware presets, the per-layer cost model, its error band (``ErrorBand``)
- :mod:`.engine` -- the replay kernel: recorded load against a plan -> per-rank tokens,
  bytes, layer time (imbalance: :func:`moetrace.domain.balance.imbalance`);
  :mod:`.token_replay` the exact replay of per-token routing
- :mod:`.strategies` -- fixed / re-planned / oracle plans judged in one loop against the
  recorded placement: gross and net time, break-even, verdict
- :mod:`.timeline_whatif` -- what-ifs on a recorded timeline (overlap, disaggregation,
  NVLink domain size)

and the store side, one module per job, which the run facade (:class:`moetrace.run.Run`)
calls: :mod:`.load` (``read_shape``: the run's shape and what a replay assumes, loads),
:mod:`.cost_fit` (the cost model a replay uses), :mod:`.results` (options, results,
``replay_*`` tables), :mod:`.judge` (``judge_plan``, ``replay_run``: ``moetrace replay``),
:mod:`.drift`, :mod:`.sweep` (cells; :func:`moetrace.run.sweep_runs` is the one entry, with
:mod:`.distributed` for Dask), :mod:`.placement_whatif` (the report's), :mod:`.calibrate` (the store side
of calibration; its fits are in :mod:`moetrace.costmodel.calibrate_fit`), :mod:`.timeline_whatif_store`, and :mod:`.trace` (the predicted
timeline as a Chrome trace).
"""

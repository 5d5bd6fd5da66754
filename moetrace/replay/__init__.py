"""Replay: what another expert placement would have done, net of moving the experts.

A numeric core (arrays in, arrays and typed results out; no store, no files), over the
pure planners of :mod:`moetrace.placement`:

- :mod:`moetrace.costmodel.step_cost` -- hardware presets, the per-layer cost model, its error band (``ErrorBand``)
- :mod:`.engine` -- the replay kernel: recorded load / routing against a plan -> per-rank
  tokens, bytes, layer time; one definition of imbalance (NaN where nothing was routed)
- :mod:`.strategies` -- fixed / re-planned / oracle plans judged in one loop against the
  recorded placement: gross and net time, break-even, verdict
- :mod:`.timeline_whatif` -- what-ifs on a recorded timeline (overlap, disaggregation,
  NVLink domain size)

and the store side, one module per job, which the run facade (:class:`moetrace.run.Run`)
calls: :mod:`.load` (``RunShape`` from the ``run_shape`` view, loads), :mod:`.plan_store`
(recorded and stored plans), :mod:`.cost_fit` (the cost model a replay uses),
:mod:`.results` (options, results, ``replay_*`` tables), :mod:`.judge_plan` (``replay``),
:mod:`.drift`, :mod:`.sweep` (and :mod:`.distributed` for Dask), :mod:`.make_plan`
(``moetrace plan``), :mod:`.placement_whatif` (the report's), :mod:`.calibrate` with
:mod:`.calibrate_fit`, :mod:`.timeline_whatif_store`, and :mod:`.trace` (the predicted
timeline as a Chrome trace).
"""

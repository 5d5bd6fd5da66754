"""Replay: what another expert placement would have done, net of moving the experts.

A numeric core (arrays in, arrays and typed results out; no store, no files):

- :mod:`.eplb` -- ``rebalance_experts`` (DeepSeek's EPLB, vectorized, stable ties)
- :mod:`.planners` -- ``Plan``, ``PlanShape`` (checked: contradictory settings are refused)
  and the planner registry (contiguous, greedy, eplb, eplb-global, one-per-rank)
- :mod:`.moves` -- move accounting between plans (copies, intra/inter node) and the
  move-aware re-planner
- :mod:`.relabel` -- renaming a new plan's ranks to keep experts where they are
- :mod:`.cost` -- hardware presets, the per-layer cost model, its error band
- :mod:`.engine` -- the replay kernel: recorded load / routing against a plan -> per-rank
  tokens, bytes, layer time; one definition of imbalance (NaN where nothing was routed)
- :mod:`.strategies` -- fixed / re-planned / oracle plans judged in one loop against the
  recorded placement: gross and net time, break-even, verdict

and one store adapter, :mod:`.adapter` (run shape from the ``run_shape`` view, loads,
plans, ``replay_*`` tables; replay, drift, sweep, plan), which the run facade
(:class:`moetrace.run.Run`) calls. :mod:`.plan_io` reads and writes plan files,
:mod:`.calibrate` fits and judges the cost model on measured runs, :mod:`.trace` writes the
predicted timeline as a Chrome trace.
"""

"""Expert placement, pure (numpy arrays in, arrays and plans out; no store, no files):

- :mod:`.eplb` -- ``rebalance_experts`` (DeepSeek's EPLB, vectorized, stable ties)
- :mod:`.planners` -- ``Plan``, ``PlanShape`` (checked: contradictory settings are refused)
  and the planner registry (contiguous, greedy, eplb, eplb-global, one-per-rank)
- :mod:`.moves` -- move accounting between plans (copies, intra/inter node) and the
  move-aware re-planner
- :mod:`.relabel` -- renaming a new plan's ranks to keep experts where they are
"""

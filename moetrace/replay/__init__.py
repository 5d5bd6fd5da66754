"""Replay: placement planners, the replay engine, the cost model and drift policies.

- :mod:`.eplb` -- ``rebalance_experts`` (DeepSeek's EPLB, vectorized, stable ties)
- :mod:`.planners` -- ``Plan`` and the planner registry (contiguous, greedy, eplb, ...)
- :mod:`.moves` -- the move-aware re-planner and move accounting between plans
- :mod:`.engine` -- replay of recorded load / routing against a plan
- :mod:`.cost` -- hardware presets and fitting of the per-layer cost model
- :mod:`.drift` -- re-planning policies over time (static, periodic, oracle) and sweeps
- :mod:`.plan_io` -- plans in the store and SGLang / EPLB JSON files
"""

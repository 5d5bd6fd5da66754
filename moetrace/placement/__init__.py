"""Expert placement: every plan module.

Pure (numpy arrays in, arrays and plans out; no store, no files):

- :mod:`.eplb` -- ``rebalance_experts`` (DeepSeek's EPLB, vectorized, stable ties)
- :mod:`.planners` -- ``Plan`` and the planner registry (contiguous, greedy, eplb,
  eplb-global, one-per-rank) on a ``PlanShape`` (:mod:`moetrace.domain.shape`, checked:
  contradictory settings are refused)
- :mod:`.moves` -- move accounting between plans (copies, intra/inter node) and the
  move-aware re-planner
- :mod:`.relabel` -- renaming a new plan's ranks to keep experts where they are

Plans read and written, through the files and the store object they are handed (no
module here imports the store):

- :mod:`.plans` -- what ``moetrace plan`` does: fit, import, re-plan, relabel, store, export
- :mod:`.plan_store` -- the recorded placement and stored plans as ``Plan``
- :mod:`.plan_files` (+ :mod:`.plan_checks`) -- engine plan files: SGLang/EPLB JSON,
  TRT-LLM YAML, vllm-ascend
"""

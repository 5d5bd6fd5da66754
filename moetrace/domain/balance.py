"""One balancedness, every engine's name for it: the engines' balance figures and their
conversion to moetrace's ``imbalance`` (busiest rank's tokens / mean rank's tokens,
1.0 = even; the ``layer_skew`` view's definition).

Each engine defines its figure differently (checked in its source, docs/explanation/metrics.md):

- vLLM EPLB (``vllm/distributed/eplb/eplb_state.py``): ``balancedness = avg_tokens /
  max_tokens``, tokens per EP rank summed over MoE layers, mean over ranks / max over
  ranks; it logs 0.0 when no token was routed (max_tokens = 0): undefined here.
- SGLang (``python/sglang/srt/eplb/expert_distribution.py`` ``compute_utilization_rate``):
  per layer ``(mean + 1e-5) / (max + 1e-5)`` of the tokens per GPU, then the mean over
  layers (``current_pass_balancedness``, ``last_N_average_balancedness``,
  ``sglang:eplb_balancedness``).
- TensorRT-LLM (``examples/ep_load_balancer/report_load_statistics.py``
  ``calculate_load_statistics``): ``imbalance-ratio = max / mean - 1`` of the tokens per
  rank, per iteration, then the mean over iterations.

This module is the one place a figure is converted; collectors store the converted
value beside the engine's own (``balancedness.imbalance`` and ``balancedness.definition``).
"""
from __future__ import annotations

import math

import numpy as np

#: figure name -> (engine, the engine's formula, its source, how it becomes max/mean)
DEFINITIONS: dict[str, tuple[str, str, str, str]] = {
    "vllm_balancedness": (
        "vllm", "avg_tokens / max_tokens (tokens per EP rank summed over layers; mean over ranks / max over ranks)",
        "vllm-project/vllm vllm/distributed/eplb/eplb_state.py",
        "imbalance = 1 / balancedness (exact for the layer-summed loads); undefined when max_tokens = 0"),
    "sglang_balancedness": (
        "sglang", "mean over layers of (mean + 1e-5) / (max + 1e-5) of the tokens per GPU",
        "sgl-project/sglang python/sglang/srt/eplb/expert_distribution.py compute_utilization_rate",
        "imbalance = 1 / balancedness (approximate: the inverse of a mean over layers is not the mean of the "
        "inverses)"),
    "trtllm_imbalance_ratio": (
        "trtllm", "max / mean - 1 of the tokens per rank, per iteration, mean over iterations",
        "NVIDIA/TensorRT-LLM examples/ep_load_balancer/report_load_statistics.py calculate_load_statistics",
        "imbalance = imbalance_ratio + 1 (exact per iteration; the mean over iterations carries over)"),
}

#: the figure each engine's balancedness rows carry
ENGINE_FIGURE = {"vllm": "vllm_balancedness", "sglang": "sglang_balancedness", "trtllm": "trtllm_imbalance_ratio"}


def to_imbalance(figure: str, value: float | None) -> float | None:
    """moetrace's imbalance (max / mean) from an engine's figure (a key of
    :data:`DEFINITIONS`); None when the value is missing, not finite, or says nothing
    (a ratio <= 0: an empty window)."""
    if value is None or not math.isfinite(value):
        return None
    if figure in ("vllm_balancedness", "sglang_balancedness"):
        return 1.0 / value if value > 0 else None
    if figure == "trtllm_imbalance_ratio":
        return value + 1.0 if value >= 0 else None
    raise KeyError(f"unknown balance figure {figure!r} (known: {', '.join(DEFINITIONS)})")


def definition(figure: str) -> str:
    """The one-line definition stored with a converted value."""
    engine, formula, source, conv = DEFINITIONS[figure]
    return f"{engine}: {formula} [{source}]; {conv}"


def imbalance(tokens: np.ndarray, *, mx: np.ndarray | None = None, mean: np.ndarray | None = None) -> np.ndarray:
    """max / mean rank tokens over the last axis; NaN where no tokens were routed. The one
    definition replay uses; ``layer_skew`` computes the same in SQL. ``mx`` and ``mean``:
    ``tokens.max(axis=-1)`` and ``tokens.mean(axis=-1)`` when the caller already has them."""
    mx = tokens.max(axis=-1) if mx is None else mx
    mean = tokens.mean(axis=-1) if mean is None else mean
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, mx / np.where(mean > 0, mean, 1), np.nan)

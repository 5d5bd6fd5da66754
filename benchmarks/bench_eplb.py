"""rebalance_experts (vectorized) against the plain-Python reference at DeepSeek-V3 scale:
58 layers x 256 experts, 288 slots, 8 groups, 4 nodes, 32 GPUs. Outputs must be equal.

    python benchmarks/bench_eplb.py --size full
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import main, result, timer  # noqa: E402
from moetrace.placement.eplb import rebalance_experts  # noqa: E402
from tests.eplb_reference import rebalance_experts_reference  # noqa: E402


def run(size: str = "small") -> list[dict]:
    layers = 58 if size == "full" else 8
    rng = np.random.default_rng(0)
    w = np.rint(rng.lognormal(0, 0.6, (layers, 256)) * 2000)
    args = (288, 8, 4, 32)
    best = float("inf")
    for _ in range(7 if size == "full" else 3):
        with timer() as t:
            out = rebalance_experts(w, *args)
        best = min(best, t())
    with timer() as t:
        ref = rebalance_experts_reference(w, *args)
    ref_s = t()
    equal = all(np.array_equal(a, b) for a, b in zip(out, ref))
    # tie-heavy input (all-zero and constant layers) must agree too
    wt = np.zeros((layers, 256))
    wt[1::2] = 5
    equal_ties = all(np.array_equal(a, b) for a, b in zip(rebalance_experts(wt, *args),
                                                          rebalance_experts_reference(wt, *args)))
    note = f"{layers} layers x 256 experts, 288 slots, 8 groups, 4 nodes, 32 GPUs; outputs equal: {equal}, ties: {equal_ties}"
    if not (equal and equal_ties):
        raise SystemExit("vectorized EPLB differs from the reference: " + note)
    return [result("eplb", "rebalance_experts time", best * 1e3, "ms", baseline="pure-Python reference",
                   baseline_value=ref_s * 1e3, ratio=ref_s / best, notes=note)]


if __name__ == "__main__":
    main(run)

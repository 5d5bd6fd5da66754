"""Per-rank speed: a GPU that runs its experts slower holds the combine barrier longer for
the same tokens (GPU-to-GPU spread in clocks and thermals; GEM and ViBE, 2026, report
7.9-16.5% latency from it). The cost model multiplies each rank's expert compute time by
its factor (:class:`moetrace.replay.cost.CostModel` ``rank_speed``), so stragglers and the
time answer follow it.

A factor is the rank's time per token relative to a typical rank (1.1 = 10% slower):
stated (``--rank-speed 0:1.0,1:1.1``; ranks not named run at 1.0) or measured (``--rank-speed
measured``: the view ``rank_speed``'s ``speed_ratio``, expert-GEMM time per received token
over the median rank's, from the run's own profiler spans). Arrays in, arrays out.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InputError

#: --rank-speed value that reads the factors from the run's spans
MEASURED = "measured"


def parse_rank_speed(text: str) -> dict[int, float]:
    """``"0:1.0,3:1.25"`` -> {0: 1.0, 3: 1.25}; one line naming ``--rank-speed`` on bad input."""
    out: dict[int, float] = {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        rank, sep, value = part.partition(":")
        try:
            r, v = int(rank), float(value)
        except ValueError:
            r, v = -1, math.nan
        if not sep or r < 0 or not math.isfinite(v) or v <= 0:
            raise InputError(None, f"--rank-speed {text!r}: {part!r} is not RANK:FACTOR with RANK >= 0 and a factor "
                                   "> 0 (e.g. 0:1.0,1:1.1)")
        if r in out:
            raise InputError(None, f"--rank-speed {text!r}: rank {r} given twice")
        out[r] = v
    if not out:
        raise InputError(None, f"--rank-speed {text!r}: no RANK:FACTOR pairs (e.g. 0:1.0,1:1.1, or 'measured')")
    return out


def speed_vector(factors: dict[int, float], num_ranks: int) -> np.ndarray:
    """float64 [R]: each rank's factor, 1.0 where none is given; a rank outside the
    plan's ranks is refused."""
    bad = sorted(r for r in factors if r >= num_ranks)
    if bad:
        raise InputError(None, f"--rank-speed names rank(s) {bad[:5]} but the plan has {num_ranks} ranks")
    v = np.ones(num_ranks)
    for r, f in factors.items():
        v[r] = f
    return v


def measured_vector(ranks, ratios, num_ranks: int) -> tuple[np.ndarray, list[str]]:
    """The view ``rank_speed``'s rows (rank, speed_ratio) as a factor per rank, [R], and
    what was assumed: ranks without a measured ratio run at 1.0."""
    v = np.ones(num_ranks)
    seen = set()
    for r, x in zip(ranks, ratios):
        if x is not None and 0 <= int(r) < num_ranks and math.isfinite(float(x)) and float(x) > 0:
            v[int(r)] = float(x)
            seen.add(int(r))
    notes = []
    if len(seen) < num_ranks:
        notes.append(f"rank speed measured on {len(seen)} of {num_ranks} ranks (expert spans per rank, view "
                     "rank_speed); the others taken at 1.0")
    return v, notes


def describe(speed: np.ndarray | None, source: str) -> str:
    """One line: which ranks are slower or faster than 1.0, and where the factors came from."""
    if speed is None:
        return "every rank at one speed"
    odd = [(r, float(f)) for r, f in enumerate(speed) if abs(f - 1.0) > 1e-9]
    shown = ", ".join(f"rank {r} x{f:.3g}" for r, f in sorted(odd, key=lambda x: -abs(x[1] - 1))[:4])
    return (f"rank speed ({source}): " + (shown + (f" and {len(odd) - 4} more" if len(odd) > 4 else "")
                                           if odd else "every rank x1"))

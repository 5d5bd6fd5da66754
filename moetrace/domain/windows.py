"""Step windows: one spelling (``A:B``, the steps ``A <= step < B``) and one parser, and
the default split of a run's steps into a fit half and a judged half."""
from __future__ import annotations

import numpy as np


def parse_step_range(text: str) -> tuple[int, int]:
    """``'A:B'`` -> ``(A, B)``, the steps ``A <= step < B``. Raises ValueError saying what
    is wrong (not ``A:B``, or ``B <= A``)."""
    try:
        a, b = text.split(":")
        lo, hi = int(a), int(b)
    except ValueError:
        raise ValueError(f"{text!r} is not A:B (steps A <= step < B)") from None
    if hi <= lo:
        raise ValueError(f"{text!r}: B must be greater than A")
    return lo, hi


def first_half(steps: np.ndarray) -> tuple[int, int]:
    """The window ``[first step, middle step)`` of the sorted recorded ``steps`` (at least
    two): what a plan is fitted on when no window is given; the rest judges it."""
    return int(steps[0]), int(steps[steps.size // 2])

"""Three crafted Kineto ranks with dispatch/combine waits."""
from __future__ import annotations

from pathlib import Path

from .kineto_trace import COMBINE, DISPATCH, GEMM, ev_x, kernel, write_trace


def _three_ranks(folder: Path, extra_rank0: bool = False) -> Path:
    """Rank r's (dispatch arrival, combine arrival) in µs; every kernel of an instance
    ends together (dispatch at 200, combine at 400). Rank 1 uses another stream id."""
    folder.mkdir()
    arrive = {0: (100, 300), 1: (130, 300), 2: (110, 350)}
    for r, (d, c) in arrive.items():
        stream = 21 if r == 1 else 20
        ev = [ev_x("user_annotation", "ProfilerStep#0", 0, 1000),
              kernel(DISPATCH, d, 200 - d, 10 * r + 1, stream=stream, device=r),
              kernel(COMBINE, c, 400 - c, 10 * r + 2, stream=stream, device=r)]
        if r == 0:
            ev.append(kernel(GEMM, 100, 20, 9, stream=7, device=0))      # hides 20 of rank 0's 30 µs wait
            if extra_rank0:
                ev.append(kernel(DISPATCH, 500, 10, 8, stream=20, device=0))   # no partner on ranks 1, 2
        write_trace(folder / f"rank{r}_trace.json", ev, rank=r, world=3)
    return folder

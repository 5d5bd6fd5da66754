"""What a run's shape leaves unknown, and what that makes null: one sentence per gap, said by
``ingest`` (stderr, right after the write), ``runs`` and ``skew`` (notes under the table), so
a null in a table always has its reason next to it. Ground module: imports nothing."""
from __future__ import annotations

#: (runs column, the ingest option that records it, what stays null without it)
GAPS = (
    ("num_ranks", "--ranks N", "no rank loads: imbalance, efficiency, the straggler rank and every replay are null"),
    ("top_k", "--top-k K", "tokens per step (assignments / top-k) and the experts a step is expected to touch are "
                           "null; counts are token-expert assignments"),
)


def shape_gaps(run: dict) -> list[str]:
    """One line per shape value the run lacks: which, how to record it, what is null because
    of it (``run``: a ``runs`` row as a dict)."""
    return [f"{col} unknown (not in the source; ingest {opt} records it): {what}"
            for col, opt, what in GAPS if run.get(col) is None]


def gap_notes(run: dict) -> list[str]:
    """:func:`shape_gaps` prefixed with the run id, for notes under a table of several runs."""
    return [f"run {run.get('run_id')}: {g}" for g in shape_gaps(run)]

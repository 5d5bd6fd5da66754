"""Attention data-parallel balance in one line: the text ``moetrace skew`` prints and the
report opens its section with, from a ``dp_balance_summary`` row (storage/sql/50_dp_balance.sql).
Light to import (no polars): the skew command prints DuckDB's rows."""
from __future__ import annotations

#: the model behind every barrier time of the DP-balance views (their time_model column)
MODEL = "tokens-proportional estimate"


def _ms(ns) -> str:
    return f"{float(ns) / 1e6:.4g} ms"


def summary_line(s: dict) -> str | None:
    """One line from a ``dp_balance_summary`` row (a dict); None when no step had tokens."""
    if not s or not s.get("steps_defined"):
        return None
    line = (f"attention-DP balance (mean/max tokens per DP rank over {s['dp_ranks']} ranks): "
            f"{s['balance_mean']:.3f} mean over {s['steps_defined']} steps, lowest {s['balance_min']:.3f} "
            f"(step {s['worst_step']}); the slowest DP rank costs {100 * s['barrier_share']:.1f}% of the step "
            f"at the barrier ({MODEL})")
    if s.get("timed_steps"):
        line += f", {_ms(s['barrier_ns'])} of {_ms(s['step_ns'])} recorded"
    return line

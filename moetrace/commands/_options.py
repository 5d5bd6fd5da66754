"""Option parsers shared by several commands."""
from __future__ import annotations

import click


def steps_range(ctx, param, value):
    """click callback: 'A:B' -> (A, B), the steps A <= step < B."""
    if value is None:
        return None
    try:
        a, b = value.split(":")
        lo, hi = int(a), int(b)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not A:B (steps A <= step < B)") from None
    if hi <= lo:
        raise click.BadParameter(f"{value!r}: B must be greater than A")
    return lo, hi

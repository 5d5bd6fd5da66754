"""The physical range of a run's shape values, in one place: what ``ingest`` accepts and
what a reader accepts of a ``runs`` row before any value sizes an array.

A shape value is a whole number in 1..2^24 (ranks, layers, experts, slots, groups), and
the values agree: a token picks ``top_k`` distinct experts (``top_k <= num_experts``), a
node holds at most all ranks, every expert has a slot. The other numbers of a ``runs`` row
that a reader multiplies are bounded too (``hidden``, ``dtype_bytes``, ``expert_bytes``,
``tokens_per_step``), so no product of them overflows int64 or allocates past memory."""
from __future__ import annotations

from collections.abc import Mapping

from ..safety import SHAPE_MAX  # the shape bound (2^24): ranks, layers, experts, slots, groups

#: shape values of a run (``runs`` columns), each 1..SHAPE_MAX
SHAPE_COLUMNS = ("num_layers", "num_experts", "top_k", "num_ranks", "ranks_per_node", "num_slots", "num_groups")
#: the other integers of a ``runs`` row a reader computes with, and their range: an
#: activation of at most 2^24 elements of at most 64 bytes, an expert of at most 1 PiB, at
#: most 2^40 tokens in one step (the bound of one token count)
OTHER_RANGES = {"hidden": (1, SHAPE_MAX), "dtype_bytes": (1, 64), "expert_bytes": (1, 1 << 50),
                "tokens_per_step": (0, 1 << 40)}


def range_problem(name: str, value: int) -> str | None:
    """Why ``value`` is outside the range of the run value ``name``, else None."""
    lo, hi = OTHER_RANGES.get(name, (1, SHAPE_MAX))
    if not lo <= value <= hi:
        return f"{name} = {value} is out of range ({lo}..{hi})"
    return None


def relation_problem(values: Mapping[str, int | None]) -> str | None:
    """Why the shape values (``runs`` names, None where unknown) contradict each other,
    else None."""
    E, k, R, rpn, P = (values.get(x) for x in ("num_experts", "top_k", "num_ranks", "ranks_per_node", "num_slots"))
    if E and k and k > E:
        return f"top_k = {k} is larger than the {E} experts (a token picks distinct experts)"
    if R and rpn and rpn > R:
        return f"ranks_per_node = {rpn} is larger than the {R} ranks"
    if P and E and P < E:
        return f"num_slots = {P} is smaller than the {E} experts (every expert needs a slot)"
    return None


def runs_row_problem(row: Mapping[str, object]) -> str | None:
    """Why a ``runs`` row's numbers cannot be used to size anything, else None: each
    shape value within 1..2^24, the other values within :data:`OTHER_RANGES`, and the
    shape values consistent (:func:`relation_problem`)."""
    for name in (*SHAPE_COLUMNS, *OTHER_RANGES):
        v = row.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{name} = {str(v)[:30]!r} is not a whole number"
        why = range_problem(name, v)
        if why:
            return why
    return relation_problem({k: v for k, v in row.items() if isinstance(v, int)})

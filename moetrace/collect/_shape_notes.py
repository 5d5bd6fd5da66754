"""Notes on a run's shape that ingest states (``runs.approximations``) and warns about."""
from __future__ import annotations


def uneven_blocks_note(run: dict) -> str | None:
    """When the experts (or physical slots) do not divide evenly over the ranks, the
    contiguous layout (slot s on rank s * R // S, the rule of the rank views,
    sql/10_rank_load.sql) gives ranks blocks of two sizes: say how many of each, since rank loads
    then compare unequal blocks. None when they divide or the shape is not known."""
    R = run.get("num_ranks")
    S = run.get("num_slots") or run.get("num_experts")
    if not R or not S or int(S) % int(R) == 0:
        return None
    R, S = int(R), int(S)
    what = "slots" if run.get("num_slots") and run.get("num_slots") != run.get("num_experts") else "experts"
    lo, big = S // R, S % R
    if lo == 0:
        return (f"{S} {what} over {R} ranks: {R - S} ranks hold no {what[:-1]} at all in the contiguous layout "
                f"(slot s on rank s * {R} // {S}); their load is 0 by construction")
    return (f"{S} {what} do not divide over {R} ranks: in the contiguous layout (slot s on rank s * {R} // {S}) "
            f"{big} ranks hold {lo + 1} {what} and {R - big} hold {lo}, so rank loads (imbalance, straggler) compare "
            f"blocks of unequal size")

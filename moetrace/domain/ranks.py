"""Slots, ranks and nodes: the one definition of where a slot's rank and a rank's node
are, and of what moetrace assumes when a run does not record ranks per node.

- a rank's node is ``rank // ranks_per_node``;
- ranks per node unknown: all ranks are taken as one node (all-to-all and expert moves
  over NVLink only), and whoever assumes it says so (:data:`UNKNOWN_RPN_NOTE`);
- without a recorded placement, slot ``i`` holds expert ``i mod num_experts`` (vLLM's
  initial map) and sits on rank ``i * num_ranks // num_slots``; the SQL views
  (``contiguous_map`` in ``storage/sql/10_rank_load.sql``) spell the same rule.

Arrays or ints in, the same out."""
from __future__ import annotations

import numpy as np

#: what a collector or the replay notes when it assumes one node
UNKNOWN_RPN_NOTE = "ranks_per_node not given: all ranks taken as one node"


def node_of(rank, ranks_per_node: int):
    """The node of ``rank`` (an int or an integer array)."""
    return rank // ranks_per_node


def ranks_per_node_or_all(ranks_per_node: int | None, num_ranks: int) -> int:
    """Ranks per node as given, else (unknown: None or 0) all ranks on one node; never
    more than ``num_ranks``."""
    return min(int(ranks_per_node), num_ranks) if ranks_per_node else num_ranks


def contiguous_experts(num_experts: int, num_slots: int) -> np.ndarray:
    """The expert of each slot without a recorded placement: ``range(E)``, then slot ``i``
    holds expert ``i % E``. [S]"""
    return np.arange(num_slots, dtype=np.int64) % num_experts


def slot_rank(slot, num_slots: int, num_ranks: int):
    """The rank of ``slot`` when slots are spread evenly over ranks in order."""
    return slot * num_ranks // num_slots

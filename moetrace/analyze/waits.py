"""Who waited for whom across ranks: the views of ``sql/45_rank_waits.sql`` as one typed
result per run, for the ``moetrace waits`` command and the report's wait section.

The definitions live in the SQL (one place): collective instances matched across ranks
per (lane, collective, order); arrival = span start; each rank's wait = last arrival -
own arrival, charged to the last arriver; transfer = own end - last arrival.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass
class WaitResult:
    run_id: str
    coverage: dict               # wait_coverage row: positions, matched, unmatched (+ why), lanes
    ranks: pl.DataFrame          # rank_wait_summary (without run_id), by rank
    matrix: pl.DataFrame         # wait_matrix (without run_id): rank, waited_for, instances, wait_ns, ...
    instances: pl.DataFrame      # coll_instances (without run_id)
    clock_inconsistent: int      # instances where some rank's span ended before the last arrival

    @property
    def has_instances(self) -> bool:
        return self.instances.height > 0

    def matrix_array(self) -> tuple[list[int], np.ndarray]:
        """(ranks, W) with W[i, j] = ns rank ranks[i] waited for rank ranks[j]."""
        ranks = sorted(set(self.ranks["rank"].to_list()))
        idx = {r: i for i, r in enumerate(ranks)}
        w = np.zeros((len(ranks), len(ranks)), np.int64)
        for r, f, ns in self.matrix.select("rank", "waited_for", "wait_ns").iter_rows():
            w[idx[r], idx[f]] = ns
        return ranks, w

    def top_culprit(self) -> dict | None:
        """The rank that caused the most wait (ties: lowest rank), or None without instances."""
        if self.ranks.height == 0:
            return None
        return self.ranks.sort(["caused_wait_ns", "rank"], descending=[True, False]).row(0, named=True)

    def coverage_message(self) -> str:
        c = self.coverage
        if not c.get("positions"):
            return (f"run {self.run_id}: no collective spans on two or more ranks — nothing to align "
                    "(a single-rank trace, or no communication kernels recognized: see `moetrace kernels`).")
        msg = f"run {self.run_id}: {c['matched']} of {c['positions']} collective instances matched across ranks"
        if c["unmatched"]:
            why = []
            if c["unmatched_ranks_missing"]:
                why.append(f"{c['unmatched_ranks_missing']} with ranks missing (span counts differ between ranks)")
            if c["unmatched_kinds_differ"]:
                why.append(f"{c['unmatched_kinds_differ']} whose kind differs between ranks")
            if c["unmatched_single_rank"]:
                why.append(f"{c['unmatched_single_rank']} on one rank only")
            msg += f"; {c['unmatched']} unmatched: " + ", ".join(why)
            if c["lanes_counts_differ"]:
                msg += (f" ({c['lanes_counts_differ']} of {c['lanes']} lanes have different span counts per rank, "
                        "so order matching there may be off after the first missing span)")
        msg += "."
        if self.clock_inconsistent:
            msg += (f" In {self.clock_inconsistent} matched instances a rank's span ended before the last rank "
                    "arrived: the ranks' clocks disagree (traces are aligned only to their shared time base) or "
                    "the pairing is off there; their transfer is clipped at 0.")
        return msg


def wait_result(store, run_id: str) -> WaitResult:
    """The run's wait attribution from the SQL views."""
    cov = store.sql("SELECT * EXCLUDE (run_id) FROM wait_coverage WHERE run_id = ?", [run_id])
    coverage = cov.row(0, named=True) if cov.height else {"positions": 0, "matched": 0, "unmatched": 0}
    ranks = store.sql("SELECT * EXCLUDE (run_id) FROM rank_wait_summary WHERE run_id = ? ORDER BY rank", [run_id])
    matrix = store.sql("SELECT * EXCLUDE (run_id) FROM wait_matrix WHERE run_id = ? ORDER BY rank, waited_for",
                       [run_id])
    inst = store.sql("""SELECT * EXCLUDE (run_id) FROM coll_instances WHERE run_id = ?
                        ORDER BY first_arrival_ns, lane, coll_key""", [run_id])
    bad = int(inst["clock_inconsistent"].sum()) if inst.height else 0
    return WaitResult(run_id, coverage, ranks, matrix, inst, bad)


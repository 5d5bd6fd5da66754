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
        if c.get("matched_group_inferred"):
            msg += (f" {c['matched_group_inferred']} of them were paired by stream lane and order: the trace names no "
                    "process group for them (inferred; collectives of different groups on one lane could be paired).")
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
                        ORDER BY first_arrival_ns, grp, coll_key""", [run_id])
    bad = int(inst["clock_inconsistent"].sum()) if inst.height else 0
    return WaitResult(run_id, coverage, ranks, matrix, inst, bad)



@dataclass
class WaitShift:
    """How much each rank's net wait moved between two sets of steps (e.g. steps with an
    injected delay against the interleaved steps without): per rank (``by="layer"``: the
    per-(step, layer) net of ``layer_waits``) or per (rank, collective, position in the
    layer) (``by="position"``: the per-instance net of ``instance_waits``)."""
    run_id: str
    by: str
    ranks: pl.DataFrame   # rank[, coll_key, pos, kind], shift_ns, se_ns, n_a, n_b, median_a_ns, median_b_ns

    def top(self) -> dict | None:
        """The row whose net wait rose most (ties: lowest rank), or None without cells."""
        if self.ranks.height == 0:
            return None
        keys = ["shift_ns", "rank"] + (["coll_key", "pos"] if self.by == "position" else [])
        return self.ranks.sort(keys, descending=[True] + [False] * (len(keys) - 1)).row(0, named=True)

    @property
    def straggler(self) -> int | None:
        """The rank whose net wait rose most."""
        t = self.top()
        return None if t is None else int(t["rank"])


def _robust_se_of_median(v: np.ndarray) -> float:
    """Standard error of a median: 1.2533 sigma / sqrt(n), sigma from the median absolute
    deviation (1.4826 MAD): a rank descheduled for many ms on a loaded machine is an
    outlier, not spread."""
    if v.size < 2:
        return float("inf")
    sigma = 1.4826 * float(np.median(np.abs(v - np.median(v))))
    return 1.2533 * sigma / np.sqrt(v.size)


def wait_shift(store, run_id: str, steps_a, steps_b=None, by: str = "layer") -> WaitShift:
    """Per rank (or per rank, collective and position in the layer, ``by="position"``):
    the median net wait over the cells of ``steps_a`` minus the median over those of
    ``steps_b`` (default: every other step), with the standard error of that difference
    (:func:`_robust_se_of_median` of each side).

    Net wait (``instance_waits.net_ns``, summed per layer in ``layer_waits``) = the wait a
    rank caused per waiting peer − the wait it suffered: a rank held d longer before one
    collective in every layer of ``steps_a`` shows a shift of d there (and the others
    about −d/(ranks − 1)). The median is over cells: a rank descheduled mid-layer on a
    loaded machine is one outlier cell, not a shift. ``by="position"`` isolates the
    collective where the lateness enters from the noise of the others in the layer."""
    if by == "layer":
        keys = ["rank"]
        cells = store.sql("""SELECT rank, step, CAST(net_ns AS DOUBLE) AS net_ns FROM layer_waits
                             WHERE run_id = ? AND step IS NOT NULL AND layer IS NOT NULL""", [run_id])
    elif by == "position":
        keys = ["rank", "coll_key", "pos", "kind"]
        cells = store.sql("""SELECT rank, coll_key, pos, any_value(kind) OVER (PARTITION BY rank, coll_key, pos) AS kind,
                                    step, net_ns FROM instance_waits
                             WHERE run_id = ? AND step IS NOT NULL AND layer IS NOT NULL""", [run_id])
    else:
        raise ValueError(f"by must be 'layer' or 'position', not {by!r}")
    a = [int(x) for x in steps_a]
    rows = []
    for key, c in cells.group_by(keys, maintain_order=True):
        in_a = c["step"].is_in(a)
        in_b = ~in_a if steps_b is None else c["step"].is_in([int(x) for x in steps_b])
        va = c.filter(in_a)["net_ns"].to_numpy().astype(float)
        vb = c.filter(in_b)["net_ns"].to_numpy().astype(float)
        if va.size == 0 or vb.size == 0:
            continue
        ma, mb = float(np.median(va)), float(np.median(vb))
        se = float(np.hypot(_robust_se_of_median(va), _robust_se_of_median(vb)))
        rows.append({**dict(zip(keys, key)), "shift_ns": ma - mb, "se_ns": se, "n_a": int(va.size),
                     "n_b": int(vb.size), "median_a_ns": ma, "median_b_ns": mb})
    schema = {"rank": pl.Int64, "coll_key": pl.Utf8, "pos": pl.Int64, "kind": pl.Utf8}
    schema = {k: schema[k] for k in keys} | {"shift_ns": pl.Float64, "se_ns": pl.Float64, "n_a": pl.Int64,
                                             "n_b": pl.Int64, "median_a_ns": pl.Float64, "median_b_ns": pl.Float64}
    out = pl.DataFrame(rows, schema=schema).sort(keys)
    return WaitShift(run_id, by, out)

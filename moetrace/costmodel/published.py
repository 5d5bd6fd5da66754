"""The published kernel measurements (``data/published.csv``) and the time of each.

Every row is one number of one table of deepseek-ai/DeepGEMM or deepseek-ai/DeepEP, cited by
repository, commit (or pull-request comment), file, table and the quoted source line
(``quoted_line``, byte-exact). A table line whose numbers changed in a later commit is a
new row with its own ``kernel_version``; numbers that stayed the same are stored once, under
the commit that first published them. Rows of the same kernel version are never averaged
with another version's.

The time of a row (:func:`time_us`), from its published value and unit:

* ``TFLOPS``: ``2 * groups * m * n * k / TFLOPS`` (the FLOP count DeepGEMM's tests divide by);
* ``us``: the published time itself;
* ``GB/s (...)``: logical bytes / bandwidth, the bytes the benchmark divides: token
  messages (:func:`.a2a.message_bytes`) times the expected nodes (RDMA / IB rows) or GPUs
  (NVLink rows) each token reaches under the benchmark's routing (:mod:`.routing`).
"""
from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from .a2a import message_bytes
from .routing import routing_counts

PUBLISHED = Path(__file__).resolve().parent / "data" / "published.csv"

INT_COLS = ("groups", "m_per_group", "n", "k", "ep", "ranks_per_node", "tokens_per_rank", "top_k", "topk_groups",
            "num_experts", "hidden", "sms")
FLOAT_COLS = ("published_value",)


def time_us(row: dict) -> float:
    """The published row's time in microseconds (see the module docstring)."""
    unit, v = row["published_unit"], row["published_value"]
    if unit == "TFLOPS":
        return 2.0 * row["groups"] * row["m_per_group"] * row["n"] * row["k"] / (v * 1e12) * 1e6
    if unit == "us":
        return float(v)
    if unit.startswith("GB/s"):
        rc = routing_counts(row["ep"], row["ranks_per_node"], row["top_k"], row["num_experts"], row["topk_groups"])
        per_token = rc["ranks"] if ("NVLink" in unit) else rc["nodes"]
        nbytes = row["tokens_per_rank"] * per_token * message_bytes(row["hidden"], row["dtype"])
        return nbytes / (v * 1e9) * 1e6
    raise ValueError(f"row {row['row_id']}: no time rule for unit {unit!r}")


@lru_cache(maxsize=4)
def _load(path: str) -> tuple:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for c in INT_COLS:
            r[c] = int(r[c]) if r.get(c) not in (None, "") else None
        for c in FLOAT_COLS:
            r[c] = float(r[c])
        r["time_us"] = time_us(r)
    return tuple(rows)


def load_rows(path: Path = PUBLISHED) -> list[dict]:
    """Every published row (a fresh list of fresh dicts), with ``time_us`` derived."""
    return [dict(r) for r in _load(str(path))]

"""One sentence under a table, for a person who reads it at a glance: which layer is worst
and which rank is its straggler, and whether that rank moved when the experts' popularity
drifted (the straggler of the first half of the steps against the second half's).

Reads the store's rows through DuckDB only (no polars: ``moetrace skew``'s start-up)."""
from __future__ import annotations

from collections import Counter


def _mode(xs: list) -> tuple[int | None, int]:
    """The most frequent value (lowest on a tie) and how often it occurs."""
    c = Counter(x for x in xs if x is not None)
    if not c:
        return None, 0
    top = max(c.values())
    return min(k for k, v in c.items() if v == top), top


def skew_sentence(store, run_id: str, layer_rows: list[dict]) -> str | None:
    """"run r: layer 3 is the most skewed (max/mean 2.75 on average); its straggler is rank
    10 (12 of 40 steps), and it moved from rank 10 in steps 0-19 to rank 4 in steps 20-39."
    ``layer_rows``: the run's ``skew --by layer`` rows. None when no layer has an imbalance
    (the run records no rank count)."""
    rows = [r for r in layer_rows if r.get("imbalance_mean") is not None]
    if not rows:
        return None
    worst = max(rows, key=lambda r: (r["imbalance_mean"], -r["layer"]))
    layer = worst["layer"]
    steps = store.rows("SELECT step, straggler_rank FROM layer_skew WHERE run_id = ? AND layer = ? "
                       "AND straggler_rank IS NOT NULL ORDER BY step", [run_id, layer]).rows
    ranks = [r for _, r in steps]
    rank, n = _mode(ranks)
    text = f"run {run_id}: layer {layer} is the most skewed (max/mean {worst['imbalance_mean']:.2f} on average)"
    if rank is None:
        return text + "."
    where = {"recorded": ", recorded placement", "contiguous": ", ranks contiguous: no placement recorded"}
    text += f"; its straggler is rank {rank} ({n} of {len(ranks)} steps{where.get(str(worst.get('placement_source')), '')})"
    if len(steps) >= 4:
        h = len(steps) // 2
        (a, _), (b, _) = _mode(ranks[:h]), _mode(ranks[h:])
        if a is not None and b is not None and a != b:
            text += (f", and it moved as the load drifted: rank {a} in steps {steps[0][0]}-{steps[h - 1][0]}, "
                     f"rank {b} in steps {steps[h][0]}-{steps[-1][0]}")
        else:
            text += ", in both halves of the steps"
    return text + "."


#: ``moetrace tokens --by``: what one row is
TOKENS_BY = ("expert", "layer", "step")


def tokens_table(store, run_id: str, by: str = "expert", top: int | None = None):
    """Tokens per expert as a table (a polars frame):

    - ``expert``: one row per expert, its token-expert assignments summed over every step
      and layer, the mean per (step, layer), and its share of all assignments, most loaded
      first (``top``: only the first N);
    - ``layer``: one row per layer, the per-expert distribution of a step (mean, min,
      median, max over the steps of view ``tokens_per_expert``) and the experts a step
      touched against the number expected if tokens picked experts uniformly;
    - ``step``: the view ``tokens_per_expert`` itself, one row per (step, layer)."""
    if by == "expert":
        q = """SELECT expert, sum(tokens) AS tokens, sum(tokens) / count(DISTINCT (step, layer)) AS mean_per_step_layer,
                      100 * sum(tokens) / (SELECT sum(tokens) FROM expert_load WHERE run_id = ?) AS share_pct
               FROM expert_load WHERE run_id = ? GROUP BY expert ORDER BY tokens DESC, expert"""
        params = [run_id, run_id]
    elif by == "layer":
        q = """SELECT layer, count(*) AS steps, avg(per_expert_mean) AS per_expert_mean,
                      avg(per_expert_min) AS per_expert_min, avg(per_expert_median) AS per_expert_median,
                      avg(per_expert_max) AS per_expert_max, avg(experts_hit) AS experts_hit,
                      avg(experts_hit_expected) AS experts_hit_expected
               FROM tokens_per_expert WHERE run_id = ? GROUP BY layer ORDER BY layer"""
        params = [run_id]
    elif by == "step":
        q = "SELECT * EXCLUDE (run_id) FROM tokens_per_expert WHERE run_id = ? ORDER BY step, layer"
        params = [run_id]
    else:
        raise ValueError(f"by must be one of {TOKENS_BY}")
    df = store.sql(q, params)
    return df.head(top) if top else df
